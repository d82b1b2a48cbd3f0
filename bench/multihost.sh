#!/bin/bash
# multihost.sh: kvmill run across "hosts" in network namespaces (as tests/multihost/netns.sh)
# with every host's link limited to RATE (tc tbf, default 1gbit): the orchestrator host runs
# kvmill run (its prefill worker, and the store service it starts, [store] service_bind); 1, 2
# and 3 compress workers run in namespaces of their own and upload caches to the service.
# Eviction (snapkv), so transport and the store dominate. Prints, per worker count: documents/s,
# bytes on the wire per document (orchestrator's data socket, both ways) and the share of wall
# time in transport and in store commits (from the run's --metrics file), plus the load average.
# Needs root (namespaces); prints SKIP otherwise. Not part of make test (it measures).
# Usage: bench/multihost.sh [wire_dtype]   (RATE=1gbit DOCS=3 copies of ../shared/data/long)
set -u
SRC=$(cd "$(dirname "$0")/.." && pwd)
BIN=${KVMILL_BIN:-$SRC/bin}
SHARED=${KVMILL_SHARED:-$SRC/../shared}
RATE=${RATE:-1gbit}
COPIES=${COPIES:-3}
WIRE=${1:-f32}
P=kvmb$$
NET=10.213.78
T=
PIDS=()
skip() { echo "SKIP: multihost bench: $*"; exit 0; }
fail() { echo "FAIL: multihost bench: $*"; for f in "$T"/*/*.err "$T"/orch/run/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -8 "$f"; }; done; exit 1; }
cleanup() {
    exec 2>/dev/null
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
    for h in orch c1 c2 c3 sw; do for p in $(ip netns pids "$P-$h" 2>/dev/null); do kill -9 "$p"; done; done
    for h in orch c1 c2 c3 sw; do ip netns del "$P-$h" 2>/dev/null; done
    [ -n "$T" ] && rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
[ "$(id -u)" = 0 ] || skip "needs root to make network namespaces"
command -v tc >/dev/null || skip "no tc(8)"
[ -d "$SHARED/data/long" ] || skip "no $SHARED/data/long"
ip netns add "$P-sw" 2>/dev/null || skip "cannot make network namespaces"
T=$(mktemp -d)
ip -n "$P-sw" link add br0 type bridge && ip -n "$P-sw" link set br0 up || skip "cannot make a bridge"
n=1
for h in orch c1 c2 c3; do
    ip netns add "$P-$h"
    ip link add eth0 netns "$P-$h" type veth peer name "to-$h" netns "$P-sw" || skip "cannot make veth pairs"
    ip -n "$P-sw" link set "to-$h" master br0 up
    ip -n "$P-$h" addr add "$NET.$n/24" dev eth0
    ip -n "$P-$h" link set eth0 up
    ip -n "$P-$h" link set lo up
    # the host's link, both directions: its own egress and the switch port's egress towards it
    ip netns exec "$P-$h" tc qdisc add dev eth0 root tbf rate "$RATE" burst 256kb latency 100ms || skip "tc tbf failed"
    ip netns exec "$P-sw" tc qdisc add dev "to-$h" root tbf rate "$RATE" burst 256kb latency 100ms
    mkdir -p "$T/$h"
    cp "$SHARED/models/stories260K.bin" "$SHARED/models/tok512.bin" "$T/$h/"
    n=$((n + 1))
done
inns() { local h=$1; shift; ip netns exec "$P-$h" "$@"; }
mkdir -p "$T/orch/authorized" "$T/orch/corpus"
"$BIN/kvmill" keygen --out "$T/orch/server" >/dev/null
for h in orch c1 c2 c3; do
    "$BIN/kvmill" keygen --out "$T/$h/$h" >/dev/null
    cp "$T/$h/$h.public" "$T/orch/authorized/"
    [ "$h" = orch ] || cp "$T/orch/server.public" "$T/$h/"
done
for c in $(seq "$COPIES"); do
    for f in "$SHARED"/data/long/*.txt; do { echo "Copy $c."; cat "$f"; } >"$T/orch/corpus/$c-$(basename "$f")"; done
done
NDOCS=$(ls "$T/orch/corpus" | wc -l)
echo "bench/multihost.sh: $NDOCS documents (stories260K, context 384, snapkv ratio 0.3), links $RATE (tbf), wire_dtype $WIRE"
printf '| compress workers | documents/s | wall s | wire bytes / doc (orchestrator, in + out) | transport share | store commit share | load avg (1 min) |\n|---|---|---|---|---|---|---|\n'
for W in 1 2 3; do
    rm -rf "$T/orch/store.lmdb" "$T/orch/run" "$T/orch/metrics.json"
    cat >"$T/orch/run.ini" <<EOF
[model]
path = $T/orch/stories260K.bin
context = 384
[compress]
method = snapkv
ratio = 0.3
[store]
path = $T/orch/store.lmdb
service_bind = tcp://$NET.1:7200
[run]
run_dir = $T/orch/run
bind = tcp://$NET.1:7100
wire_dtype = $WIRE
heartbeat_ms = 500
[stages]
compress_workers = 0
bin_dir = $BIN
[security]
server_secret_key = $T/orch/server.secret
server_public_key = $T/orch/server.public
client_public_key = $T/orch/orch.public
client_secret_key = $T/orch/orch.secret
authorized_keys = $T/orch/authorized
EOF
    inns orch "$BIN/kvmill" run --config "$T/orch/run.ini" --corpus "$T/orch/corpus" --metrics "$T/orch/metrics.json" \
        >"$T/orch/run.out" 2>"$T/orch/run.err" &
    RUN=$!
    PIDS+=("$RUN")
    for i in $(seq "$W"); do
        h=c$i
        inns "$h" "$BIN/kvmill-compress" --connect "tcp://$NET.1:7100" --store "tcp://$NET.1:7200" \
            --model "$T/$h/stories260K.bin" --server-key "$T/$h/server.public" --client-public "$T/$h/$h.public" \
            --client-secret "$T/$h/$h.secret" --id "$h" 2>"$T/$h/worker.err" &
        PIDS+=($!)
    done
    wait "$RUN" || fail "kvmill run failed: $(tail -3 "$T/orch/run.err")"
    load=$(cut -d' ' -f1 /proc/loadavg)
    for h in $(ip netns pids "$P-c1") $(ip netns pids "$P-c2") $(ip netns pids "$P-c3"); do kill "$h" 2>/dev/null; done
    sleep 0.5
    grep -q "summary: compressed=$NDOCS " "$T/orch/run.out" || fail "not every document compressed: $(grep summary "$T/orch/run.out")"
    python3 - "$T/orch/metrics.json" "$W" "$load" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
n, wall = m["documents_done"], m["elapsed_s"]
print("| %s | %.2f | %.2f | %.0f | %.1f%% | %.1f%% | %s |" % (sys.argv[2], n / wall, wall,
      (m["wire_in_bytes"] + m["wire_out_bytes"]) / n, 100 * m["transport_s"] / wall, 100 * m["store_s"] / wall, sys.argv[3]))
PY
done
