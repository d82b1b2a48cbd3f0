#!/usr/bin/env bash
# Pipeline benchmark (issue 6): the 20 long documents through kvmill run with the default
# configuration (stories260K, context 384, KVSculpt r = 0.3), with 1 and 2 compress workers;
# documents/s, tokens/s, the per-stage split and the share of ZeroMQ/MessagePack transport.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED="${KVMILL_SHARED:-../shared}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
for workers in 1 2; do
    cat > "$DIR/bench.ini" <<INI
[model]
path = $SHARED/models/stories260K.bin
context = 384
[compress]
method = sculpt
ratio = 0.3
[store]
path = $DIR/store-$workers.lmdb
[stages]
compress_workers = $workers
INI
    echo "-- compress_workers=$workers"
    out="$(bin/kvmill run --config "$DIR/bench.ini" --corpus "$SHARED/data/long" 2>/dev/null)"
    echo "$out" | sed 's/^/   /'
    echo "$out" | awk -v w="$workers" '/^summary:/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
        printf "   => %d workers: %.3f documents/s, %.0f tokens/s (context 384)\n", w, v["compressed"] / v["seconds"], v["compressed"] * 384 / v["seconds"] }'
done
