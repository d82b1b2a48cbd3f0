#!/usr/bin/env bash
# Per-layer attention kernel (issue 13): the CPU forward on the per-layer call against the
# same forward on the per-head kernel it replaced (kvm_cpu_attention_ref), interleaved ABBA
# in one run per line: prefill tokens/s at N = 2048 and decode tokens/s at context 2048, for
# stories260K (8 query / 4 KV heads, head 8) and SmolLM2-135M (9 / 3, head 64), 1 and 2 threads.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED="${KVMILL_SHARED:-../shared}"
BENCH="${KVMILL_BUILD:-build}/bench/bench_forward"
SMOL="${KVMILL_SMOLLM2:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
REPS="${KVMILL_BENCH_REPS:-5}"
for t in 1 2; do
    uptime
    "$BENCH" --model "$SHARED/models/stories260K.bin" --tokens 2048 --gen 64 --reps "$REPS" --threads "$t" --compare-ref 1
done
if [ -f "$SMOL" ]; then
    for t in 1 2; do
        uptime
        "$BENCH" --model "$SMOL" --tokens 2048 --gen 32 --reps "$REPS" --threads "$t" --compare-ref 1
    done
else
    echo "SKIP: $SMOL not found (set KVMILL_SMOLLM2)"
fi
uptime
