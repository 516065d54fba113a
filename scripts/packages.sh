# Shared by scripts/test, scripts/dev and scripts/bench-services: installs the
# system packages they need when missing (the real servers the tests and the
# dev cluster start, and protoc for the etcd client's build). Source it, then
# call ensure_system_packages (and, for the tests, ensure_promtool).
ensure_system_packages() {
  local missing=()
  command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
  command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
  # The TLS tests make their certificates with it (tests::TestCa).
  command -v openssl >/dev/null 2>&1 || missing+=(openssl)
  [ -e /usr/include/google/protobuf/timestamp.proto ] || missing+=(libprotobuf-dev)
  install_packages "${missing[@]}"
  export PATH="$PATH:/usr/sbin"
}

# promtool (Debian's prometheus package) checks the services' /metrics text
# in the tests (tests::promtool). Its service is not started.
ensure_promtool() {
  command -v promtool >/dev/null 2>&1 || install_packages prometheus
}

install_packages() {
  if (($#)); then
    printf '\n==> installing %s\n' "$*"
    local sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "$@"
  fi
}
