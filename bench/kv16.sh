#!/usr/bin/env bash
# 16-bit KV cache benchmark (issue 16, [model] kv_dtype): peak RSS of `kvmill generate` prefilling
# N = 512 and 2048 SmolLM2 tokens on one thread with the float32 and the f16 KV cache (the same
# command as bench/RESULTS.md's weight-dtype table; `rounds` alternations, user CPU seconds beside
# it), then bench_kv16 on the same tokens: KL(f32 || f16 KV) over every position and prefill /
# decode CPU seconds of both dtypes in one process (medians).
# Usage: bench/kv16.sh [rounds]   (default 2; needs models/SmolLM2-135M-Instruct.Q4_1.gguf)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
BUILD="${KVMILL_BUILD:-build}"
ROUNDS="${1:-2}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
python3 - "$DIR" <<'PY'
import sys
ids = [l.strip() for l in open('tests/data/smollm2/seq256.ids') if l[0] != '#']
for n in (512, 2048, 2048 + 32):
    open(f'{sys.argv[1]}/ids{n}.txt', 'w').write('\n'.join((ids * 9)[:n]))
open(f'{sys.argv[1]}/ids1.txt', 'w').write('1\n')
PY
echo "load: $(cut -d' ' -f1-3 /proc/loadavg); model $MODEL; $(nproc) cores"
printf '| N | kv_dtype | round | peak RSS MiB | user CPU s | wall tok/s |\n|---|---|---|---|---|---|\n'
for r in $(seq 1 "$ROUNDS"); do
    for n in 1 512 2048; do
        for dt in f32 f16; do
            /usr/bin/time -v bin/kvmill generate --model "$MODEL" --tokens "$DIR/ids$n.txt" -n $((n + 1)) \
                --temperature 0 --threads 1 --kv-dtype $dt > /dev/null 2> "$DIR/err"
            rss=$(awk '/Maximum resident/ {printf "%.1f", $6 / 1024}' "$DIR/err")
            user=$(awk '/User time/ {print $4}' "$DIR/err")
            tps=$(awk '/achieved tok\/s/ {printf "%.1f", $3}' "$DIR/err")
            echo "| $n | $dt | $r | $rss | $user | $tps |"
        done
    done
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
"$BUILD/bench/bench_kv16" --model "$MODEL" --tokens "$DIR/ids2080.txt" --n 2048 --decode 32 --reps 3 --threads 1
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
