#!/usr/bin/env bash
# bench/qsource.sh (issue 14, items 1-3): training-query sources (synthetic, repeat, continuation)
# and the am / kvzip baselines against Select+Fit and KVSculpt, by KL on the teacher-forced
# continuation (kvmill eval). Resumable: rows are appended to $CSV, and a document is only run
# again for the method specs it lacks (any ratio missing), so the grid can be run in pieces:
#   make -j2 all && bench/qsource.sh                       # SmolLM2 long2k, the small grid
#   DOCS="005 006 007 008" METHODS="sculpt:query_source=repeat" bench/qsource.sh
#   MODEL=$KVMILL_SHARED/models/stories260K.bin DOCDIR=$KVMILL_SHARED/data/long CTX=192 CONT=64 \
#       RETAIN=32 S=2048 ROUNDS=4 ITERS=30 CSV=build/bench/qsource_260k.csv bench/qsource.sh
#   SUMMARY_ONLY=1 bench/qsource.sh                         # the tables from the CSV only
# Prints per ratio and method: documents, mean KL, top-1, s/doc, and against BASE (default
# selectfit with synthetic queries): ratio of mean KLs (BASE / method, > 1 = method better),
# geometric mean of per-document ratios, wins; only documents both have count.
# Environment: KVMILL (bin/kvmill), KVMILL_SHARED (../shared), MODEL, DOCDIR, DOCS (numbers),
# RATIOS, CTX, CONT, RETAIN, S (queries), ROUNDS, ITERS, THREADS, SEED (of the synthetic queries,
# default 1: one CSV per seed), METHODS (comma-separated specs), BASE, CSV.
set -euo pipefail
KVMILL=${KVMILL:-bin/kvmill}
SHARED=${KVMILL_SHARED:-../shared}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
DOCDIR=${DOCDIR:-$SHARED/data/long2k}
DOCS=${DOCS:-005 006 007}
RATIOS=${RATIOS:-0.3,0.5}
CTX=${CTX:-2048}
CONT=${CONT:-128}
RETAIN=${RETAIN:-64}
S=${S:-1024}
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-15}
THREADS=${THREADS:-1}
SEED=${SEED:-1}
Q=query_source
METHODS=${METHODS:-selectfit:$Q=synthetic,selectfit:$Q=repeat,selectfit:$Q=continuation,am:$Q=synthetic,am:$Q=repeat,am:$Q=continuation,kvzip:$Q=synthetic,kvzip:$Q=repeat,kvzip:$Q=continuation,sculpt:$Q=synthetic,sculpt:$Q=repeat,sculpt:$Q=continuation}
BASE=${BASE:-selectfit:$Q=synthetic}
CSV=${CSV:-build/bench/qsource.csv}
mkdir -p "$(dirname "$CSV")"
# the header is eval's own, taken from its first output below: a header of our own named 11 of
# the 14 columns eval writes (dtype, bytes_compressed and decode_ms came after it)
touch "$CSV"
tmp=""
trap 'rm -f "$tmp"' EXIT

if [ -z "${SUMMARY_ONLY:-}" ]; then
    IFS=, read -ra RS <<<"$RATIOS"
    IFS=, read -ra MS <<<"$METHODS"
    for n in $DOCS; do
        doc=$DOCDIR/doc_$n.txt
        name=doc_$n
        missing=""
        for m in "${MS[@]}"; do # rows per ratio; the CSV's ratio column is budget/N, not r
            have=$(awk -F, -v d="$name" -v m="$m" '$1 == d && $2 == m { c++ } END { print c + 0 }' "$CSV")
            [ "$have" -ge "${#RS[@]}" ] || missing+="${missing:+,}$m"
        done
        [ -n "$missing" ] || continue
        tmp=$(mktemp)
        echo "$(date -u +%H:%M:%S) $name: $missing (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
        nice "$KVMILL" eval --model "$MODEL" --docs "$doc" --context "$CTX" --continuation "$CONT" --ratio "$RATIOS" \
            --retain "$RETAIN" --queries "$S" --rounds "$ROUNDS" --iterations "$ITERS" --threads "$THREADS" --seed "$SEED" \
            --method "$missing" --csv "$tmp" >&2
        [ -s "$CSV" ] || head -1 "$tmp" >"$CSV"
        # only the rows this CSV lacks (a re-run of a partly finished document repeats some)
        tail -n +2 "$tmp" | while IFS= read -r row; do
            IFS=, read -r d m b _ <<<"$row"
            awk -F, -v d="$d" -v m="$m" -v b="$b" '$1 == d && $2 == m && $3 == b { f = 1 } END { exit !f }' "$CSV" ||
                echo "$row" >>"$CSV"
        done
        rm -f "$tmp"
    done
fi

# per budget/N (the same for every sculpt-family method at one r: k + m entries per KV head)
awk -F, -v base="$BASE" 'NR > 1 {
    r = sprintf("%.4f", $4); key = r "|" $2
    if (!(key in n)) order[r] = order[r] "|" $2
    n[key]++; kl[key] += $5; t1[key] += $8; s[key] += $11; v[r "|" $2 "|" $1] = $5; docs[r "|" $1] = 1; rs[r] = 1 }
END {
    for (r in rs) {
        printf "\nbudget/N %s (base %s)\n", r, base
        printf "%-34s %4s %10s %6s %7s %9s %9s %6s\n", "method", "docs", "mean KL", "top1", "s/doc", "mean-rat", "gmean", "wins"
        nm = split(substr(order[r], 2), ms, "|")
        for (i = 1; i <= nm; i++) {
            m = ms[i]; key = r "|" m; pb = pm = lg = c = w = 0
            for (k in docs) {
                split(k, a, "|"); if (a[1] != r) continue
                kb = r "|" base "|" a[2]; km = r "|" m "|" a[2]
                if ((kb in v) && (km in v)) {
                    pb += v[kb]; pm += v[km]; c++; lg += log((v[kb] + 1e-12) / (v[km] + 1e-12)); w += v[km] < v[kb]
                }
            }
            mr = 0; gm = 0
            if (c > 0 && pm > 0) mr = pb / pm
            if (c > 0) gm = exp(lg / c)
            printf "%-34s %4d %10.4g %6.3f %7.1f %9.3g %9.3g %3d/%d\n", m, n[key], kl[key] / n[key], t1[key] / n[key], \
                s[key] / n[key], mr, gm, w, c
        }
    }
}' "$CSV"
