#!/bin/bash
# remote_store.sh: what a run pays for reaching its store only through the store service
# (`[store] path = tcp://...`: claims, probes and uploads over the wire, protocol revision 6)
# against a run on the store's host (LMDB opened directly), and two such runs sharing one
# service on one corpus. Loopback TCP on this machine, eviction (snapkv) so that the store path
# and not compression dominates. Per mode, REPS runs on a fresh store each; prints the median
# wall seconds (the summary's), documents/s and, for the shared case, how the documents split.
# Not part of make test (it measures). Usage: bench/remote_store.sh   (REPS=3, DOCS=dir)
set -u
SRC=$(cd "$(dirname "$0")/.." && pwd)
BIN=${KVMILL_BIN:-$SRC/bin}
SHARED=${KVMILL_SHARED:-$SRC/../shared}
REPS=${REPS:-3}
DOCS=${DOCS:-$SHARED/data/long}
[ -d "$DOCS" ] || DOCS=$SRC/data/corpus
PORT=$((21000 + $$ % 20000))
T=$(mktemp -d)
SVC=
cleanup() { [ -n "$SVC" ] && kill "$SVC" 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
N=$(ls "$DOCS" | wc -l)
cat >"$T/run.ini" <<EOF
[model]
path = $SRC/data/models/stories260K.bin
context = 384
[compress]
method = snapkv
ratio = 0.3
[store]
path = $T/store.lmdb
[stages]
bin_dir = $BIN
EOF
secs() { grep -o "seconds=[0-9.]*" "$1" | cut -d= -f2; }
field() { grep -o " $2=[0-9]*" "$1" | cut -d= -f2; }
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
fresh() { rm -rf "$T/store.lmdb"; }
service() {
    "$BIN/kvmill" store serve --create --store "$T/store.lmdb" --bind "tcp://127.0.0.1:$PORT" >"$T/svc.out" 2>"$T/svc.err" &
    SVC=$!
    for _ in $(seq 100); do grep -q ready "$T/svc.out" && return; sleep 0.1; done
    echo "the store service did not start"; exit 1
}
stop_service() { kill "$SVC"; wait "$SVC" 2>/dev/null; SVC=; }
echo "corpus $DOCS ($N documents), snapkv ratio 0.3, context 384, $REPS runs per mode; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for mode in local remote shared; do
    : >"$T/$mode.s"
    for r in $(seq "$REPS"); do
        fresh
        if [ "$mode" = local ]; then
            "$BIN/kvmill" run --config "$T/run.ini" --corpus "$DOCS" >"$T/a.out" 2>"$T/a.err" || { tail -3 "$T/a.err"; exit 1; }
            secs "$T/a.out" >>"$T/$mode.s"
            continue
        fi
        service
        t0=$(date +%s.%N)
        "$BIN/kvmill" run --config "$T/run.ini" --store "tcp://127.0.0.1:$PORT" --corpus "$DOCS" >"$T/a.out" 2>"$T/a.err" &
        A=$!
        if [ "$mode" = shared ]; then
            "$BIN/kvmill" run --config "$T/run.ini" --store "tcp://127.0.0.1:$PORT" --corpus "$DOCS" >"$T/b.out" 2>"$T/b.err" &
            B=$!
            wait "$B" || { tail -3 "$T/b.err"; exit 1; }
        fi
        wait "$A" || { tail -3 "$T/a.err"; exit 1; }
        t1=$(date +%s.%N)
        stop_service
        commits=$(grep -c "committed job" "$T/svc.err")
        if [ "$mode" = shared ]; then
            echo "  shared run $r: a compressed $(field "$T/a.out" compressed) (claimed $(field "$T/a.out" claimed)), b $(field "$T/b.out" compressed) (claimed $(field "$T/b.out" claimed)); the service committed $commits"
            echo "$t1 - $t0" | bc >>"$T/$mode.s"
        else
            secs "$T/a.out" >>"$T/$mode.s"
        fi
    done
    m=$(median <"$T/$mode.s")
    echo "$mode: median $m s wall ($(tr '\n' ' ' <"$T/$mode.s")), $(echo "scale=2; $N / $m" | bc) documents/s"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
