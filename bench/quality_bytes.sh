#!/bin/sh
# quality_bytes.sh: mean KL, top-1, perplexity, stored bytes and decode ms per token of each
# method at each budget, with the cache stored as f32, f16 and bf16 (issue 14, item 4), on
# SmolLM2 at N = 2048. Resumable: one CSV per (document, dtype) under OUT, finished ones are
# skipped; bench/quality_bytes_table.sh prints the table from them.
# usage: bench/quality_bytes.sh [OUT_DIR] ; env DOCS, METHODS, RATIOS, DTYPES, N, T, THREADS
set -eu
OUT=${1:-bench/out/quality_bytes}
SHARED=${KVMILL_SHARED:-../shared}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
DOCS=${DOCS:-"doc_005 doc_006 doc_007 doc_008 doc_009"}
METHODS=${METHODS:-full,streaming,h2o,tova,snapkv,pyramidkv}
RATIOS=${RATIOS:-0.125,0.25,0.5}
DTYPES=${DTYPES:-"f32 f16 bf16"}
N=${N:-2048}
T=${T:-64}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
for d in $DOCS; do
    for dt in $DTYPES; do
        f="$OUT/$d.$dt.csv"
        [ -s "$f" ] && continue
        bin/kvmill eval --model "$MODEL" --docs "$SHARED/data/long2k/$d.txt" --method "$METHODS" --ratio "$RATIOS" \
            --context "$N" --continuation "$T" --dtype "$dt" --threads "$THREADS" --csv "$f.part" > /dev/null
        mv "$f.part" "$f"
        echo "$f $(uptime | sed 's/.*load average: //')"
    done
done
