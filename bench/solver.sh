#!/usr/bin/env bash
# bench/solver.sh: the KVSculpt solver's speed (issue 12). For stories260K long/doc_005 (N 384,
# m 32, r 0.3, defaults) and, when present, SmolLM2 long2k/doc_005 (N 2048, m 64, r 0.3):
#   1. bench_solver: kvmill's own sgemm on 2048³ (the ceiling), the loss+gradient (reference vs
#      blocked) and the ridge (float64 vs float32 normal equations, and their precision) at the
#      problem shape (GFLOP/s), the query construction, and every
#      problem solved by kvmill's L-BFGS vs liblbfgs (CPU s, objective ratio) — one run;
#   2. `kvmill sculpt` per document with 1 and 2 worker threads: CPU s (user+sys) and wall s,
#      RUNS runs each alternating, medians, with the load average before each.
#   bench/solver.sh                     # from the repository root, after make
# Environment: KVMILL (bin/kvmill), BENCH (build/bench/bench_solver), KVMILL_SHARED (../shared),
# SMOLLM2 (a SmolLM2-135M GGUF; default $KVMILL_SHARED/models/SmolLM2-135M-Instruct.Q4_1.gguf),
# RUNS (5), SMOL_RUNS (1: a SmolLM2 document costs minutes), SOLVE (1: run bench_solver's
# solve section).
set -euo pipefail
KVMILL=${KVMILL:-bin/kvmill}
BENCH=${BENCH:-build/bench/bench_solver}
SHARED=${KVMILL_SHARED:-../shared}
SMOLLM2=${SMOLLM2:-$SHARED/models/SmolLM2-135M-Instruct.Q4_1.gguf}
RUNS=${RUNS:-5}
SMOL_RUNS=${SMOL_RUNS:-1}
SOLVE=${SOLVE:-1}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

# sculpt_runs NAME RUNS ARGS...: RUNS runs at 1 and 2 threads, alternating; prints the medians.
sculpt_runs() {
    local name=$1 runs=$2 i t
    shift 2
    for ((i = 0; i < runs; i++)); do
        for t in 1 2; do
            echo "load $(cut -d' ' -f1 /proc/loadavg)" >> "$OUT/$name.$t.load"
            /usr/bin/time -f "%U %S %e" -o "$OUT/time" "$KVMILL" sculpt "$@" --threads "$t" --out "$OUT/c.kvs" > /dev/null
            awk '{print $1 + $2, $3}' "$OUT/time" >> "$OUT/$name.$t"
        done
    done
    for t in 1 2; do
        echo "sculpt,$name,threads,$t,runs,$runs,cpu_s,$(cut -d' ' -f1 "$OUT/$name.$t" | median),wall_s,$(cut -d' ' -f2 "$OUT/$name.$t" | median),load,$(cut -d' ' -f2 "$OUT/$name.$t.load" | median)"
    done
}

S260=(--model "$SHARED/models/stories260K.bin" --doc "$SHARED/data/long/doc_005.txt" --context 384 --ratio 0.3)
echo "uptime: $(uptime)"
"$BENCH" --model "$SHARED/models/stories260K.bin" --doc "$SHARED/data/long/doc_005.txt" --ctx 384 --retain 32 --solve "$SOLVE"
sculpt_runs stories260K "$RUNS" "${S260[@]}"
if [ -f "$SMOLLM2" ]; then
    SM=(--model "$SMOLLM2" --doc "$SHARED/data/long2k/doc_005.txt" --context 2048 --retain 64 --ratio 0.3)
    echo "uptime: $(uptime)"
    "$BENCH" --model "$SMOLLM2" --doc "$SHARED/data/long2k/doc_005.txt" --ctx 2048 --retain 64 --solve 0 --gemm 0
    for alloc in uniform head; do sculpt_runs "smollm2-$alloc" "$SMOL_RUNS" "${SM[@]}" --alloc "$alloc"; done
else
    echo "SKIP: SmolLM2 not found at $SMOLLM2"
fi
