#!/usr/bin/env bash
# bench/polykv.sh: issue 4's acceptance experiment on stories260K. Calibrates PolyKV on
# long/doc_000-004 and evaluates every single eviction pattern and the PolyKV strategy on
# long/doc_005-019 (context 384 + continuation 64) at average budgets 32, 64 and 128, then
# prints the mean table with the share of the gap to full KV that PolyKV recovers over the
# best single pattern: (KL_best_single - KL_polykv) / KL_best_single.
#   bench/polykv.sh                     # from the repository root, after make
#   WINDOWS=1 PHASES=both bench/polykv.sh
# Environment: KVMILL (bin/kvmill), KVMILL_SHARED (../shared), OUT (build/bench/polykv),
# WINDOWS (calibration windows per document, 4), PHASES (prefill), BUDGETS ("32 64 128").
set -euo pipefail
KVMILL=${KVMILL:-bin/kvmill}
SHARED=${KVMILL_SHARED:-../shared}
OUT=${OUT:-build/bench/polykv}
WINDOWS=${WINDOWS:-4}
PHASES=${PHASES:-prefill}
BUDGETS=${BUDGETS:-32 64 128}
MODEL=$SHARED/models/stories260K.bin
DOCS=$SHARED/data/long
mkdir -p "$OUT"
list() { local first=$1 last=$2 s="" i; for ((i = first; i <= last; i++)); do s+="${s:+,}$DOCS/$(printf 'doc_%03d.txt' "$i")"; done; echo "$s"; }
CAL=$(list 0 4)
EVAL=$(list 5 19)

for B in $BUDGETS; do
    nice "$KVMILL" calibrate --model "$MODEL" --docs "$CAL" --budget "$B" --context 384 --continuation 64 \
        --windows "$WINDOWS" --out "$OUT/polykv_B$B.bin" --dump-signals "$OUT/signals_B$B.csv" >"$OUT/calibrate_B$B.log"
    nice "$KVMILL" eval --model "$MODEL" --docs "$EVAL" --budget "$B" --context 384 --continuation 64 --phases "$PHASES" \
        --method "streaming,h2o,tova,snapkv,pyramidkv,polykv:$OUT/polykv_B$B.bin" --csv "$OUT/eval_${PHASES}_B$B.csv" \
        >"$OUT/eval_${PHASES}_B$B.log"
done

# Mean over the evaluation documents per (budget, method), and the gap recovered.
echo "phases=$PHASES windows=$WINDOWS"
printf '%-6s %-10s %8s %10s %10s %10s %6s %9s %9s %8s\n' B method budget kl_mean kl_median kl_p99 top1 ppl_full ppl_comp gap%
for B in $BUDGETS; do
    awk -F, -v B="$B" 'NR > 1 {
        m = $2; sub(/:.*/, "", m); n[m]++; bt[m] += $3; kl[m] += $5; md[m] += $6; p99[m] += $7; t1[m] += $8;
        pf[m] += $9; pc[m] += $10; if (!(m in seen)) { seen[m] = 1; order[++k] = m } }
    END {
        best = 1e9; for (i = 1; i <= k; i++) { m = order[i]; if (m != "polykv" && kl[m] / n[m] < best) best = kl[m] / n[m] }
        for (i = 1; i <= k; i++) { m = order[i]; g = m == "polykv" ? sprintf("%.1f", 100 * (best - kl[m] / n[m]) / best) : "";
            printf "%-6s %-10s %8.2f %10.6f %10.6f %10.6f %6.3f %9.4f %9.4f %8s\n", B, m, bt[m] / n[m], kl[m] / n[m],
                md[m] / n[m], p99[m] / n[m], t1[m] / n[m], pf[m] / n[m], pc[m] / n[m], g } }' "$OUT/eval_${PHASES}_B$B.csv"
done
