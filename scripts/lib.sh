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

# High availability on loopback: three nats-servers forming one JetStream
# cluster (clients on 4222-4224, routes on 6222-6224, monitoring on
# 8222-8224) and a three-member etcd cluster (clients on 2379, 12379,
# 22379); data under $1, nats-server's configuration file in $2. Exports
# every endpoint, and 3 replicas for the streams.
start_ha_servers() {
  for program in nats-server etcd; do
    command -v "$program" >/dev/null || { echo "$program is missing: scripts/packages.sh installs it" >&2; exit 1; }
  done
  local i routes initial=
  for i in 0 1 2; do
    routes=$(for j in 0 1 2; do [ "$j" = "$i" ] || printf 'nats://127.0.0.1:%s,' $((6222 + j)); done)
    start "nats-$i" nats-server ${2:+-c "$2"} -a 127.0.0.1 -p $((4222 + i)) -m $((8222 + i)) \
      -n "nats-$i" -js -sd "$1/nats-$i" --cluster_name switchyard-dev \
      -cluster "nats://127.0.0.1:$((6222 + i))" -routes "${routes%,}"
    initial+="etcd-$i=http://127.0.0.1:${i#0}2380,"
  done
  initial=${initial%,}
  for i in 0 1 2; do
    local client="http://127.0.0.1:${i#0}2379" peer="http://127.0.0.1:${i#0}2380"
    start "etcd-$i" etcd --name "etcd-$i" --data-dir "$1/etcd-$i" --log-level warn \
      --listen-client-urls "$client" --advertise-client-urls "$client" \
      --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
      --initial-cluster "$initial" --initial-cluster-state new \
      --heartbeat-interval 50 --election-timeout 500
  done
  for i in 0 1 2; do
    wait_http "http://127.0.0.1:$((8222 + i))/healthz"
    wait_http "http://127.0.0.1:${i#0}2379/health"
  done
  # JetStream takes writes once the cluster has elected its meta leader.
  for _ in $(seq 1 300); do
    curl -fsS http://127.0.0.1:8222/jsz 2>/dev/null | grep -q '"leader":' && break
    sleep 0.1
  done
  export SWITCHYARD_NATS_URL=nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224
  export SWITCHYARD_ETCD_ENDPOINTS=http://127.0.0.1:2379,http://127.0.0.1:12379,http://127.0.0.1:22379
  export SWITCHYARD_STREAM_REPLICAS=3
}

export SWITCHYARD_NATS_URL=nats://127.0.0.1:4222
export SWITCHYARD_ETCD_ENDPOINTS=http://127.0.0.1:2379
