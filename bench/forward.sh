#!/usr/bin/env bash
# Foundation benchmark (issue 2): batched prefill vs token-by-token vs decode, for
# stories260K at N=512 and for a random dim-1024/16-layer model at N=2048, 1 and 2 threads,
# with GFLOP/s against plain cblas_sgemm of the same shapes and peak memory.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED="${KVMILL_SHARED:-../shared}"
BENCH="${KVMILL_BUILD:-build}/bench/bench_forward"
BIG="${KVMILL_BENCH_DIR:-/tmp/kvmill-bench}/m1024-l16.bin"
for t in 1 2; do
    "$BENCH" --model "$SHARED/models/stories260K.bin" --tokens 512 --gen 128 --reps 7 --threads "$t"
done
if [ ! -f "$BIG" ]; then
    mkdir -p "$(dirname "$BIG")"
    bin/kvmill make-model --dim 1024 --layers 16 --heads 16 --kv-heads 4 --hidden 2816 --vocab 32000 \
        --seq-len 2048 --seed 1 --out "$BIG"
fi
for t in 1 2; do
    # token-by-token over the first 128 tokens only: at ~20 tokens/s the full 2048 would take minutes
    "$BENCH" --model "$BIG" --tokens 2048 --tbt-tokens 128 --gen 32 --reps 3 --threads "$t"
done
