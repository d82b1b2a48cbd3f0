#!/usr/bin/env bash
# bench/polykv_sculpt.sh: issue 5's combined design space on stories260K. At each average
# budget B (entries per KV head, equal memory for every row), on long/doc_005-019 (context 384 +
# continuation 64, prefill-phase compression):
#   best single eviction pattern   (streaming, h2o, tova, snapkv, pyramidkv: the best mean)
#   PolyKV, eviction patterns only (kvmill calibrate on doc_000-004)
#   sculpt everywhere              (KVSculpt with retain min(32, B/2), k = B - retain)
#   PolyKV with sculpt in the menu (kvmill calibrate --sculpt on the same documents), with the
#     strategy's budgets, and with the sculpt layers' budgets re-split by the KVSculpt pilot
#     (alloc=layer: the paper's MSE^0.5 rule per layer; alloc=gain: ours)
#   bench/polykv_sculpt.sh              # from the repository root, after make
# Environment: KVMILL (bin/kvmill), KVMILL_SHARED (../shared), OUT (build/bench/polykv_sculpt),
# WINDOWS (calibration windows per document, 1), BUDGETS ("32 64 128"), THREADS (sculpt
# worker threads, 2).
set -euo pipefail
KVMILL=${KVMILL:-bin/kvmill}
SHARED=${KVMILL_SHARED:-../shared}
OUT=${OUT:-build/bench/polykv_sculpt}
WINDOWS=${WINDOWS:-1}
BUDGETS=${BUDGETS:-32 64 128}
THREADS=${THREADS:-2}
MODEL=$SHARED/models/stories260K.bin
DOCS=$SHARED/data/long
mkdir -p "$OUT"
list() { local first=$1 last=$2 s="" i; for ((i = first; i <= last; i++)); do s+="${s:+,}$DOCS/$(printf 'doc_%03d.txt' "$i")"; done; echo "$s"; }
CAL=$(list 0 4)
EVAL=$(list 5 19)
COMMON=(--model "$MODEL" --context 384 --continuation 64)

for B in $BUDGETS; do
    R=$((B / 2 < 32 ? B / 2 : 32))
    nice "$KVMILL" calibrate "${COMMON[@]}" --docs "$CAL" --budget "$B" --windows "$WINDOWS" \
        --out "$OUT/evict_B$B.bin" >"$OUT/calibrate_evict_B$B.log"
    /usr/bin/time -f "calibrate --sculpt B=$B: %e s wall" nice "$KVMILL" calibrate "${COMMON[@]}" --docs "$CAL" \
        --budget "$B" --windows "$WINDOWS" --sculpt --sculpt-opts "threads=$THREADS" --out "$OUT/sculpt_B$B.bin" \
        --dump-signals "$OUT/signals_B$B.csv" >"$OUT/calibrate_sculpt_B$B.log"
    rm -f "$OUT/eval_B$B.csv.part" # an interrupted eval's rows: eval refuses a .part holding rows
    nice "$KVMILL" eval "${COMMON[@]}" --docs "$EVAL" --budget "$B" \
        --method "streaming,h2o,tova,snapkv,pyramidkv,polykv:$OUT/evict_B$B.bin,sculpt:retain=$R:threads=$THREADS,polykv:$OUT/sculpt_B$B.bin:threads=$THREADS,polykv:$OUT/sculpt_B$B.bin:threads=$THREADS:alloc=layer,polykv:$OUT/sculpt_B$B.bin:threads=$THREADS:alloc=gain" \
        --csv "$OUT/eval_B$B.csv" >"$OUT/eval_B$B.log"
done

# Mean over the evaluation documents per (budget, row); the two PolyKV rows are told apart by
# their strategy file.
printf '%-5s %-28s %7s %11s %11s %6s %8s %8s\n' B row budget kl_mean kl_p99 top1 s/doc strategy
for B in $BUDGETS; do
    awk -F, -v B="$B" -v out="$OUT" 'NR > 1 {
        m = $2; if (m ~ /^polykv:/) m = (m ~ /alloc=layer/) ? "polykv+sculpt, pilot layer" : (m ~ /alloc=gain/) ? "polykv+sculpt, pilot gain" : (m ~ /sculpt_B/) ? "polykv+sculpt" : "polykv(evict)"; else sub(/:.*/, "", m);
        n[m]++; bt[m] += $3; kl[m] += $5; p99[m] += $7; t1[m] += $8; sec[m] += $11;
        if (!(m in seen)) { seen[m] = 1; order[++k] = m } }
    END {
        best = ""; for (i = 1; i <= k; i++) { m = order[i];
            if (m ~ /^(streaming|h2o|tova|snapkv|pyramidkv)$/ && (best == "" || kl[m] / n[m] < kl[best] / n[best])) best = m }
        for (i = 1; i <= k; i++) { m = order[i]; tag = m == best ? " (best single)" : "";
            printf "%-5s %-28s %7.2f %11.3g %11.3g %6.3f %8.2f\n", B, m tag, bt[m] / n[m], kl[m] / n[m], p99[m] / n[m],
                t1[m] / n[m], sec[m] / n[m] } }' "$OUT/eval_B$B.csv"
    grep -h "^best:" "$OUT/calibrate_evict_B$B.log" "$OUT/calibrate_sculpt_B$B.log" | sed "s/^/      calibration /"
done
