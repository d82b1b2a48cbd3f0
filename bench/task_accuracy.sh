#!/bin/sh
# task_accuracy.sh: task accuracy of full KV and each method at budgets of 12.5%, 25%, 50% of
# the context on SmolLM2 with chat framing (issue 14, item 3). Resumable: cases run in chunks
# of CHUNK, one CSV per (task, chunk) under OUT; finished chunks are skipped. The summary
# (accuracy, Wilson 95% interval, McNemar against full KV over all finished cases) comes from
# bench/task_table.sh.
# usage: bench/task_accuracy.sh [OUT_DIR] ; env TASKS, FIRST (first case, default 0), CASES (up
# to case FIRST + CASES), CHUNK, N, METHODS, RATIOS, THREADS, KVMILL (the binary, default
# bin/kvmill), NICE (default 10), TAG (in the CSV names, to run other METHODS on the same cases
# beside: bench/task_table.sh pairs them with either run's full KV), BUDGETS (entries per KV head
# including the retain zone, e.g. 512 for 25% of N = 2048; replaces RATIOS when set)
set -eu
OUT=${1:-bench/out/task}
SHARED=${KVMILL_SHARED:-../shared}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
TASKS=${TASKS:-"passkey recall multikey"}
CASES=${CASES:-36}
CHUNK=${CHUNK:-9}
N=${N:-2048}
METHODS=${METHODS:-streaming,h2o,tova,snapkv,pyramidkv}
RATIOS=${RATIOS:-0.125,0.25,0.5}
THREADS=${THREADS:-2}
KVMILL=${KVMILL:-bin/kvmill}
DOCS=${DOCS:-$SHARED/data/long2k}
mkdir -p "$OUT"
if [ -n "${BUDGETS:-}" ]; then size="--budget $BUDGETS"; else size="--ratio $RATIOS"; fi
for task in $TASKS; do
    first=${FIRST:-0}
    while [ "$first" -lt "$((${FIRST:-0} + CASES))" ]; do
        f="$OUT/$task.N$N${TAG:+.$TAG}.c$first.csv"
        if [ ! -s "$f" ]; then
            rm -f "$f.part" # an interrupted chunk's rows: the chunk runs again whole (eval refuses a .part holding rows)
            nice -n "${NICE:-10}" "$KVMILL" eval --model "$MODEL" --docs "$DOCS" --task "$task" --chat --context "$N" \
                --first-case "$first" --cases "$CHUNK" --method "$METHODS" $size --threads "$THREADS" \
                --csv "$f" > "$f.log"   # rows go to $f.part, renamed to $f when the chunk is done
            echo "$f $(uptime | sed 's/.*load average: //')"
        fi
        first=$((first + CHUNK))
    done
done
