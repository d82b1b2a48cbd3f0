#!/usr/bin/env bash
# bench/polykv.sh: issue 4's acceptance experiment. Calibrates PolyKV on doc_000-004 and
# evaluates every single eviction pattern and the PolyKV strategy on doc_005-019 at each
# average budget B, then prints the mean table with the share of the gap to full KV that
# PolyKV recovers over the best single pattern: (KL_best_single - KL_polykv) / KL_best_single.
# Defaults: stories260K, long/, context 384 + continuation 64, B = 32 64 128.
#   bench/polykv.sh                     # from the repository root, after make
#   WINDOWS=1 PHASES=both bench/polykv.sh
#   MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf DOCS=$KVMILL_SHARED/data/long2k CTX=2048 CONT=128 \
#       CAL_CONT=64 WINDOWS=1 CAL_PHASES=prefill BUDGETS=256 CANDIDATES="h2o_ppl cosine_ppl" bench/polykv.sh
# Environment: KVMILL (bin/kvmill), KVMILL_SHARED (../shared), OUT (build/bench/polykv),
# MODEL, DOCS (stories260K, long/), CTX, CONT (384, 64), CAL_CONT (calibration continuation,
# CONT), WINDOWS (calibration windows per document, 4), PHASES (evaluation phases, prefill),
# CAL_PHASES (calibration signals, both), BUDGETS ("32 64 128"), THREADS (1), CANDIDATES
# (builder candidates to evaluate too, by their --dump-candidates file name without .bin),
# CAL_FLAGS (more calibrate flags, e.g. "--kvzip").
# Resumable: a budget whose strategy or evaluation CSV exists is not run again.
set -euo pipefail
KVMILL=${KVMILL:-bin/kvmill}
SHARED=${KVMILL_SHARED:-../shared}
OUT=${OUT:-build/bench/polykv}
WINDOWS=${WINDOWS:-4}
PHASES=${PHASES:-prefill}
CAL_PHASES=${CAL_PHASES:-both}
BUDGETS=${BUDGETS:-32 64 128}
MODEL=${MODEL:-$SHARED/models/stories260K.bin}
DOCS=${DOCS:-$SHARED/data/long}
CTX=${CTX:-384}
CONT=${CONT:-64}
CAL_CONT=${CAL_CONT:-$CONT}
THREADS=${THREADS:-1}
CANDIDATES=${CANDIDATES:-}
CAL_FLAGS=${CAL_FLAGS:-}
mkdir -p "$OUT"
list() { local first=$1 last=$2 s="" i; for ((i = first; i <= last; i++)); do s+="${s:+,}$DOCS/$(printf 'doc_%03d.txt' "$i")"; done; echo "$s"; }
CAL=$(list 0 4)
EVAL=$(list 5 19)

for B in $BUDGETS; do
    mkdir -p "$OUT/cand_B$B"
    [ -s "$OUT/polykv_B$B.bin" ] || /usr/bin/time -f "calibrate B=$B: %e s wall, %U s user" nice "$KVMILL" calibrate \
        --model "$MODEL" --docs "$CAL" --budget "$B" --context "$CTX" --continuation "$CAL_CONT" --windows "$WINDOWS" \
        --phases "$CAL_PHASES" --threads "$THREADS" --out "$OUT/polykv_B$B.bin" --dump-signals "$OUT/signals_B$B.csv" \
        --dump-candidates "$OUT/cand_B$B" $CAL_FLAGS >"$OUT/calibrate_B$B.log"
    extra=""
    for c in $CANDIDATES; do extra+=",polykv:$OUT/cand_B$B/$c.bin"; done
    [ -s "$OUT/eval_${PHASES}_B$B.csv" ] || rm -f "$OUT/eval_${PHASES}_B$B.csv.part" # an interrupted eval's rows
    [ -s "$OUT/eval_${PHASES}_B$B.csv" ] || nice "$KVMILL" eval --model "$MODEL" --docs "$EVAL" --budget "$B" \
        --context "$CTX" --continuation "$CONT" --phases "$PHASES" --threads "$THREADS" --decode-steps 0 \
        --method "streaming,h2o,tova,snapkv,pyramidkv,polykv:$OUT/polykv_B$B.bin$extra" \
        --csv "$OUT/eval_${PHASES}_B$B.csv" >"$OUT/eval_${PHASES}_B$B.log"
done

# Mean over the evaluation documents per (budget, method), and the gap recovered; PolyKV rows
# are named by their strategy file.
echo "phases=$PHASES windows=$WINDOWS"
printf '%-6s %-22s %8s %10s %10s %10s %6s %9s %9s %8s\n' B method budget kl_mean kl_median kl_p99 top1 ppl_full ppl_comp gap%
for B in $BUDGETS; do
    awk -F, -v B="$B" 'NR > 1 {
        m = $2; if (m ~ /^polykv:/) { sub(/^polykv:/, "", m); sub(/.*\//, "", m); sub(/\.bin$/, "", m); m = "pk:" m } else sub(/:.*/, "", m);
        n[m]++; bt[m] += $3; kl[m] += $5; md[m] += $6; p99[m] += $7; t1[m] += $8;
        pf[m] += $9; pc[m] += $10; if (!(m in seen)) { seen[m] = 1; order[++k] = m } }
    END {
        best = 1e9; for (i = 1; i <= k; i++) { m = order[i]; if (m !~ /^pk:/ && kl[m] / n[m] < best) best = kl[m] / n[m] }
        for (i = 1; i <= k; i++) { m = order[i]; g = m ~ /^pk:/ ? sprintf("%.1f", 100 * (best - kl[m] / n[m]) / best) : "";
            printf "%-6s %-22s %8.2f %10.6f %10.6f %10.6f %6.3f %9.4f %9.4f %8s\n", B, m, bt[m] / n[m], kl[m] / n[m],
                md[m] / n[m], p99[m] / n[m], t1[m] / n[m], pf[m] / n[m], pc[m] / n[m], g } }' "$OUT/eval_${PHASES}_B$B.csv"
done
