# Shared by scripts/dev and scripts/bench-services: starting processes on
# loopback and stopping them all at exit. Source it; set $logs first.
export PATH="$PATH:/usr/sbin"
pids=()

# Newest first (services before the servers they use); SIGKILL after 5 s.
stop_all() {
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill "${pids[i]}" 2>/dev/null || continue
    for _ in $(seq 1 50); do
      kill -0 "${pids[i]}" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "${pids[i]}" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}

start() { # name, command...
  local name=$1; shift
  "$@" >"$logs/$name.log" 2>&1 &
  pids+=($!)
}

wait_http() { # url
  for _ in $(seq 1 300); do
    curl -fsS "$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "no answer from $1; see $logs" >&2
  exit 1
}

# nats-server and etcd on their default loopback ports, data under $1;
# a second argument is nats-server's configuration file (users and
# permissions: deploy/nats/switchyard.conf).
start_servers() {
  for program in nats-server etcd; do
    command -v "$program" >/dev/null || { echo "$program is missing: scripts/packages.sh installs it" >&2; exit 1; }
  done
  start nats nats-server ${2:+-c "$2"} -a 127.0.0.1 -p 4222 -m 8222 -js -sd "$1/nats"
  start etcd etcd --name dev --data-dir "$1/etcd" --log-level warn \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster dev=http://127.0.0.1:2380
  wait_http http://127.0.0.1:8222/healthz
  wait_http http://127.0.0.1:2379/health
}

export SWITCHYARD_NATS_URL=nats://127.0.0.1:4222
export SWITCHYARD_ETCD_ENDPOINTS=http://127.0.0.1:2379
