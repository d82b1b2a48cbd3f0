#!/usr/bin/env bash
# bench_gguf.sh (issue 7): SmolLM2-135M-Instruct Q4_1 (GGUF) through kvmill's CPU forward
# (build/bench/bench_forward: prefill of N = 2048 tokens in one batch, then 64 greedy decode
# steps at that context) against llama.cpp's llama-bench on the same file, same machine and
# thread counts (pp2048, and tg64 at depth 2048, i.e. decode after a 2048-token context).
#   LLAMA_BENCH  path of llama-bench (default /tmp/llamacpp/build/bin/llama-bench, as built by
#                scripts/gguf-reference.sh's build plus `cmake --build ... --target llama-bench`);
#                skipped with a note when absent.
#   THREADS      thread counts to run (default "1 2")
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${KVMILL_GGUF_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
BENCH="${KVMILL_BUILD:-build}/bench/bench_forward"
LLAMA_BENCH="${LLAMA_BENCH:-/tmp/llamacpp/build/bin/llama-bench}"
THREADS="${THREADS:-1 2}"
[ -f "$MODEL" ] || bash scripts/get-model.sh
for t in $THREADS; do
    "$BENCH" --model "$MODEL" --tokens 2048 --tbt-tokens 16 --gen 64 --reps 3 --threads "$t"
done
if [ -x "$LLAMA_BENCH" ]; then
    for t in $THREADS; do
        # --repack 0: the AMX / repacked weight buffers fault (SIGILL) on VMs that do not grant AMX
        # state; Q4_1 has no CPU repack anyway, only the Q8_0 token embedding would be repacked.
        "$LLAMA_BENCH" -m "$MODEL" -t "$t" -r 3 --repack 0 -p 2048 -n 0 -o md
        "$LLAMA_BENCH" -m "$MODEL" -t "$t" -r 3 --repack 0 -p 0 -n 64 -d 2048 -o md
    done
else
    echo "bench_gguf: $LLAMA_BENCH not found: llama.cpp side skipped"
fi
