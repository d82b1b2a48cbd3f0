#!/bin/bash
# netns.sh: kvmill across four "hosts" over real TCP: network namespaces joined by veth pairs
# to a bridge in a fifth namespace, each host with its own private directory (no shared
# filesystem) and CurveZMQ keys:
#   orch  10.213.77.1  kvmill run (orchestrator + its prefill worker) and the store service
#   c1    10.213.77.2  kvmill-compress, uploads to the store service
#   c2    10.213.77.3  kvmill-compress, uploads to the store service
#   dec   10.213.77.4  kvmill-decode for kvmill serve on orch, fetches caches with get_cache
# Checks: every cache lands in the store; c1's link cut mid-run (its job requeued, no document
# lost or counted twice) and restored (c1 accepted again); the store service SIGKILLed and
# restarted mid-run (committed caches intact, the run completes); `kvmill ask` answered by the
# remote decode worker equals the answer of a decode worker reading the store locally; two runs
# on c1 and c2 whose store is the service (no LMDB there) share new documents, each compressed once.
# Traffic stays between the test's own namespaces. Needs root; prints one SKIP line otherwise.
# Usage: tests/multihost/netns.sh   (KVMILL_BIN: folder of the binaries, default ./bin)
set -u
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${KVMILL_BIN:-$SRC/bin}
P=kvmh$$ # namespace prefix, unique per run
NET=10.213.77
T=
PIDS=()
skip() { echo "SKIP: multihost netns: $*"; exit 0; }
fail() {
    echo "FAIL: multihost netns: $*"
    for f in "$T"/*/*.err "$T"/*/run/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -15 "$f"; }; done
    exit 1
}
cleanup() {
    exec 2>/dev/null # no "Killed" job notices
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
    # `ip netns exec` may fork: every process left in the test's namespaces is the test's
    for h in orch c1 c2 dec sw; do
        for p in $(ip netns pids "$P-$h" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    for h in orch c1 c2 dec sw; do ip netns del "$P-$h" 2>/dev/null; done
    [ -n "$T" ] && [ -z "${KEEP:-}" ] && rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

[ "$(id -u)" = 0 ] || skip "needs root to make network namespaces"
command -v ip >/dev/null || skip "no ip(8) (iproute2)"
ip netns add "$P-sw" 2>/dev/null || skip "cannot make network namespaces (ip netns add failed)"
T=$(mktemp -d)
ip -n "$P-sw" link add br0 type bridge && ip -n "$P-sw" link set br0 up || skip "cannot make a bridge in a namespace"
n=1
for h in orch c1 c2 dec; do
    ip netns add "$P-$h" || fail "ip netns add $P-$h"
    ip link add eth0 netns "$P-$h" type veth peer name "to-$h" netns "$P-sw" || skip "cannot make veth pairs"
    ip -n "$P-sw" link set "to-$h" master br0 up
    ip -n "$P-$h" addr add "$NET.$n/24" dev eth0
    ip -n "$P-$h" link set eth0 up
    ip -n "$P-$h" link set lo up
    mkdir -p "$T/$h"
    cp "$SRC/data/models/stories260K.bin" "$SRC/data/models/tok512.bin" "$T/$h/"
    n=$((n + 1))
done
inns() { local h=$1; shift; ip netns exec "$P-$h" "$@"; }
# spawn HOST PIDFILE CMD...: CMD in the background in HOST; its own pid in $SPAWNED
spawn() {
    local h=$1 pf=$2
    shift 2
    rm -f "$pf"
    inns "$h" sh -c 'echo $$ >"$0"; exec "$@"' "$pf" "$@" &
    PIDS+=($!)
    for _ in $(seq 50); do [ -s "$pf" ] && break; sleep 0.1; done
    SPAWNED=$(cat "$pf")
    PIDS+=("$SPAWNED")
}

# keys: the orch host's server pair and its own client pair; one pair per worker host, whose
# public half goes to orch's authorized folder; each worker host gets the server's public key
mkdir -p "$T/orch/authorized"
"$BIN/kvmill" keygen --out "$T/orch/server" >/dev/null || fail "keygen"
for h in orch c1 c2 dec; do
    "$BIN/kvmill" keygen --out "$T/$h/$h" >/dev/null || fail "keygen $h"
    cp "$T/$h/$h.public" "$T/orch/authorized/"
    [ "$h" = orch ] || cp "$T/orch/server.public" "$T/$h/"
done
mkdir -p "$T/orch/corpus"
for f in "$SRC"/data/corpus/doc_00[0-5].txt; do # 12 documents: each twice, the copy with a first line of its own
    b=$(basename "$f" .txt)
    cp "$f" "$T/orch/corpus/"
    { echo "Part two of $b."; cat "$f"; } >"$T/orch/corpus/$b-b.txt"
done

common() { # model and compression: the same on every host (the config id depends on them)
    cat <<EOF
[model]
path = $T/$1/stories260K.bin
context = 96
[compress]
method = sculpt
ratio = 0.3
queries = 512
iterations = 200
rounds = 4
; every round runs: the jobs must last past c1's outage (3 s at least) (with the solver's round stop they
; all ended first, and c1 found no job when its link came back)
round_tolerance = 0
[store]
upload_timeout_ms = 2000
EOF
}
{ common orch; cat <<EOF
path = $T/orch/store.lmdb
[run]
run_dir = $T/orch/run
bind = tcp://$NET.1:7100
heartbeat_ms = 200
liveness = 10
max_retries = 5
[stages]
compress_workers = 0
bin_dir = $BIN
[serve]
backend = tcp://$NET.1:7300
[security]
server_secret_key = $T/orch/server.secret
server_public_key = $T/orch/server.public
client_public_key = $T/orch/orch.public
client_secret_key = $T/orch/orch.secret
authorized_keys = $T/orch/authorized
EOF
} >"$T/orch/run.ini"

start_store() { # the store service; STORE_PID is its own pid (ip netns exec may fork)
    spawn orch "$T/orch/store.pid" "$BIN/kvmill" store serve --create --config "$T/orch/run.ini" \
        --bind "tcp://$NET.1:7200" >>"$T/orch/store.out" 2>>"$T/orch/store.err"
    STORE_PID=$SPAWNED
    for _ in $(seq 100); do [ "$(grep -c ready "$T/orch/store.out" 2>/dev/null)" -ge "$1" ] && return; sleep 0.1; done
    fail "the store service did not start"
}
worker() { # host: a compress worker connecting to the orchestrator and the store service
    inns "$1" "$BIN/kvmill-compress" --connect "tcp://$NET.1:7100" --store "tcp://$NET.1:7200" \
        --model "$T/$1/stories260K.bin" --server-key "$T/$1/server.public" --client-public "$T/$1/$1.public" \
        --client-secret "$T/$1/$1.secret" --heartbeat-ms 200 --id "$1" 2>>"$T/$1/worker.err" &
    PIDS+=($!)
}
committed() { cat "$T/orch/store.err" 2>/dev/null | grep -c "kvmill-store: committed"; }

start_store 1
inns orch "$BIN/kvmill" run --config "$T/orch/run.ini" --corpus "$T/orch/corpus" >"$T/orch/run.out" 2>"$T/orch/run.err" &
RUN_PID=$!
PIDS+=("$RUN_PID")
worker c1
worker c2

# once caches flow (c1 mid-job) c1's link goes down; meanwhile the store service dies (SIGKILL)
# and comes back on the same port; c1's link comes back once the run has declared c1 silent
for _ in $(seq 600); do [ "$(committed)" -ge 1 ] && break; sleep 0.1; done
[ "$(committed)" -ge 1 ] || fail "no cache committed within 60 s"
ip -n "$P-sw" link set to-c1 down
echo "link of c1 down after $(committed) commits"
sleep 1
kill -9 "$STORE_PID"
while kill -0 "$STORE_PID" 2>/dev/null; do sleep 0.1; done
BEFORE=$(committed)
kill -0 "$RUN_PID" 2>/dev/null || fail "the run ended before the faults: make the jobs slower"
echo "store service killed after $BEFORE commits, the run still going"
sleep 1
start_store 2
sleep 1
# up again once the run has declared c1 silent (its dead time is 2 s; a loaded machine can delay
# the declaration past a fixed outage), at most 30 s later
for _ in $(seq 300); do grep -q "worker c1 went silent" "$T/orch/run.err" && break; sleep 0.1; done
ip -n "$P-sw" link set to-c1 up
C1_DONE=$(grep -c "^\[compress c1\] job" "$T/c1/worker.err")

for _ in $(seq 1800); do kill -0 "$RUN_PID" 2>/dev/null || break; sleep 0.1; done
kill -0 "$RUN_PID" 2>/dev/null && fail "the run did not finish within 3 minutes"
wait "$RUN_PID"
RC=$?
[ "$RC" = 0 ] || fail "kvmill run exited $RC: $(tail -3 "$T/orch/run.out")"
grep -q "summary: compressed=12 skipped=0 failed=0" "$T/orch/run.out" || fail "summary: $(grep summary "$T/orch/run.out")"
grep -q "requeueing" "$T/orch/run.err" || fail "no job was requeued after c1's link went down"
grep -q "worker c1 went silent" "$T/orch/run.err" || fail "c1 was not declared silent while its link was down"
C1_AFTER=$(($(grep -c "^\[compress c1\] job" "$T/c1/worker.err") - C1_DONE))
echo "c1 finished $C1_AFTER of 12 jobs after its link came back"
[ "$C1_AFTER" -gt 0 ] || fail "c1 finished no job after its link came back (not accepted again)"
N=$(inns orch "$BIN/kvmill" store ls --store "$T/orch/store.lmdb" --csv | tail -n +2 | wc -l)
[ "$N" = 12 ] || fail "$N caches in the store, expected 12"
inns orch "$BIN/kvmill" store verify --store "$T/orch/store.lmdb" >/dev/null || fail "store verify"
[ -e "$T/c1/store.lmdb" ] || [ -e "$T/c2/store.lmdb" ] && fail "a worker host made an LMDB store"
grep summary "$T/orch/run.out"
echo "run: 12 caches committed through the store service; requeue and restart survived"

# two more runs, on c1 and c2, whose store is the service on orch (no LMDB on either host):
# they claim over the wire (protocol revision 6) and share 4 new documents, each compressed once
remote_run() { # host: a run with its own prefill and compress worker, [store] path = the service
    mkdir -p "$T/$1/corpus2"
    for f in "$SRC"/data/corpus/doc_00[0-3].txt; do
        { echo "Part three of $(basename "$f" .txt)."; cat "$f"; } >"$T/$1/corpus2/$(basename "$f")"
    done
    { common "$1"; cat <<EOF
path = tcp://$NET.1:7200
[run]
run_dir = $T/$1/run2
heartbeat_ms = 200
liveness = 10
[stages]
bin_dir = $BIN
[security]
server_public_key = $T/$1/server.public
client_public_key = $T/$1/$1.public
client_secret_key = $T/$1/$1.secret
EOF
    } >"$T/$1/remote.ini"
    inns "$1" "$BIN/kvmill" run --config "$T/$1/remote.ini" --corpus "$T/$1/corpus2" >"$T/$1/remote.out" \
        2>"$T/$1/remote.err" &
    REMOTE_PID=$!
    PIDS+=("$REMOTE_PID")
}
BEFORE=$(committed)
remote_run c1
R1=$REMOTE_PID
remote_run c2
R2=$REMOTE_PID
wait "$R1" || fail "the run on c1 exited $?: $(tail -3 "$T/c1/remote.err")"
wait "$R2" || fail "the run on c2 exited $?: $(tail -3 "$T/c2/remote.err")"
grep -q "this run opens no LMDB" "$T/c1/remote.err" || fail "the run on c1 did not use the store service"
n1=$(grep -o "summary: compressed=[0-9]*" "$T/c1/remote.out" | grep -o "[0-9]*$")
n2=$(grep -o "summary: compressed=[0-9]*" "$T/c2/remote.out" | grep -o "[0-9]*$")
[ -n "$n1" ] && [ -n "$n2" ] && [ $((n1 + n2)) = 4 ] || fail "the two runs compressed ${n1:-?} + ${n2:-?}, expected 4 in all"
[ $(($(committed) - BEFORE)) = 4 ] || fail "the service committed $(($(committed) - BEFORE)) caches for 4 documents"
[ -e "$T/c1/store.lmdb" ] || [ -e "$T/c2/store.lmdb" ] && fail "a run host made an LMDB store"
echo "two runs on c1 and c2 through one store service: $n1 + $n2 documents, each compressed once"

# ask through a decode worker on dec (caches over get_cache), then through a local one
{ common dec; cat <<EOF
[security]
server_public_key = $T/dec/server.public
client_public_key = $T/dec/dec.public
client_secret_key = $T/dec/dec.secret
EOF
} >"$T/dec/dec.ini"
ask_via() { # workers, then: ask the serve front end once it is ready; prints the answer text
    local out="$T/orch/serve-$1.out"
    spawn orch "$T/orch/serve.pid" "$BIN/kvmill" serve --config "$T/orch/run.ini" --workers "$1" \
        --bind tcp://127.0.0.1:0 >"$out" 2>"$out.err"
    local sp=$SPAWNED
    if [ "$1" = 0 ]; then
        spawn dec "$T/dec/decode.pid" "$BIN/kvmill-decode" --connect "tcp://$NET.1:7300" --config "$T/dec/dec.ini" \
            --store "tcp://$NET.1:7200" --server-key "$T/dec/server.public" --client-public "$T/dec/dec.public" \
            --client-secret "$T/dec/dec.secret" --heartbeat-ms 200 --id dec 2>"$T/dec/decode.err"
        DEC_PID=$SPAWNED
    fi
    for _ in $(seq 300); do grep -q "joined" "$out.err" && grep -q "ready" "$out" "$out.err" && break; sleep 0.1; done
    local fe
    fe=$(grep ready "$out" "$out.err" | grep -o "tcp://127.0.0.1:[0-9]*" | head -1)
    inns orch "$BIN/kvmill" ask --connect "$fe" --server-key "$T/orch/server.public" \
        --client-public "$T/orch/orch.public" --client-secret "$T/orch/orch.secret" \
        --doc "$T/orch/corpus/doc_002.txt" --prompt "Then the" -n 24 --timeout 30 2>"$T/orch/ask-$1.err"
    kill "$sp" 2>/dev/null
    # the next serve binds the same backend port: this one must be gone (its drain can last grace_s)
    for _ in $(seq 600); do kill -0 "$sp" 2>/dev/null || break; sleep 0.1; done
}
ask_via 0 >"$T/orch/remote.txt"
REMOTE=$(cat "$T/orch/remote.txt")
grep -q "external decode worker dec joined" "$T/orch/serve-0.out.err" || fail "the remote decode worker did not join"
kill "$DEC_PID" # the local answer comes from the local worker alone (gone before the next serve)
for _ in $(seq 600); do kill -0 "$DEC_PID" 2>/dev/null || break; sleep 0.1; done
ask_via 1 >"$T/orch/local.txt"
LOCAL=$(cat "$T/orch/local.txt")
[ -n "$REMOTE" ] || fail "no answer through the remote decode worker: $(cat "$T/orch/ask-0.err")"
[ "$REMOTE" = "$LOCAL" ] || fail "remote answer '$REMOTE' differs from local '$LOCAL'"
echo "ask: the remote decode worker's answer equals the local one: $REMOTE"
echo "PASS: multihost netns"
