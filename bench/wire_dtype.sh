#!/usr/bin/env bash
# Wire dtype benchmark (issue 15): bytes per document on the wire prefill -> orchestrator ->
# compress and the KL cost of 16-bit KV on the wire ([run] wire_dtype = f32|f16|bf16), for the
# 20 long documents (stories260K, context 384) with an eviction method, with KVSculpt and with
# method = full (no compression: the KL is the wire's alone). KL(full || compressed) over a
# 64-token continuation ([eval] enabled), the full-KV reference recomputed from the tokens.
# Usage: bench/wire_dtype.sh [methods...]   (default: full snapkv sculpt)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED="${KVMILL_SHARED:-../shared}"
CORPUS="${CORPUS:-$SHARED/data/long}"
MODEL="${MODEL:-$SHARED/models/stories260K.bin}"
CONTEXT="${CONTEXT:-384}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
methods=("$@")
[ ${#methods[@]} -gt 0 ] || methods=(full snapkv sculpt)
echo "load: $(cut -d' ' -f1-3 /proc/loadavg); model $MODEL; corpus $CORPUS; context $CONTEXT"
printf '| method | wire_dtype | documents | bytes received from prefill / doc | bytes sent to workers / doc | mean KL (nats) | wall s |\n|---|---|---|---|---|---|---|\n'
for method in "${methods[@]}"; do
    for dt in f32 f16 bf16; do
        cat > "$DIR/w.ini" <<INI
[model]
path = $MODEL
context = $CONTEXT
[compress]
method = $method
ratio = 0.3
[eval]
enabled = true
continuation = 64
[store]
path = $DIR/store-$method-$dt.lmdb
[run]
wire_dtype = $dt
INI
        out="$(bin/kvmill run --config "$DIR/w.ini" --corpus "$CORPUS" 2>"$DIR/err")" || { cat "$DIR/err" >&2; exit 1; }
        kl="$(echo "$out" | sed -n 's/^evaluation: mean KL(full || compressed) \([0-9.e+-]*\) nats.*/\1/p')"
        echo "$out" | awk -v m="$method" -v dt="$dt" -v kl="$kl" '/^summary:/ {
            for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
            n = v["compressed"]; if (n == 0) n = 1
            printf "| %s | %s | %d | %.0f | %.0f | %s | %.1f |\n", m, dt, v["compressed"], v["wire_in_bytes"] / n,
                   v["wire_out_bytes"] / n, kl, v["seconds"] }'
    done
done
