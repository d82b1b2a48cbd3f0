#!/usr/bin/env bash
# Orchestrator memory (issue 11): peak RSS (VmHWM) of the `kvmill run` process itself, its
# stage processes excluded, and the peak of its anonymous part (RssAnon: its own heap; the
# rest is file-backed: the binary, libraries and the store's LMDB map, reclaimable page cache), for corpora of 20 and 2,000 documents (the 20 long TinyStories
# documents repeated, each copy made distinct by a first line "Copy N." so every one is
# compressed), with the cheap `streaming` method at context 128. Usage:
#   bench/orch_rss.sh [KVMILL_BIN_DIR ...]    (default: bin; give several to compare builds)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED="${KVMILL_SHARED:-../shared}"
DIR="$(mktemp -d)"
trap 'rm -rf "$DIR"' EXIT
BINS=("$@")
[ ${#BINS[@]} -gt 0 ] || BINS=(bin)
for n in 20 2000; do
    mkdir -p "$DIR/docs-$n"
    for ((i = 0; i < n; i++)); do
        { echo "Copy $i."; cat "$SHARED/data/long/doc_$(printf %03d $((i % 20))).txt"; } > "$DIR/docs-$n/doc_$(printf %05d "$i").txt"
    done
done
for bin in "${BINS[@]}"; do
    for n in 20 2000; do
        rm -rf "$DIR/store.lmdb"
        cat > "$DIR/rss.ini" <<INI
[model]
path = $SHARED/models/stories260K.bin
context = 128
[compress]
method = streaming
budget = 32
[store]
path = $DIR/store.lmdb
INI
        "$bin/kvmill" run --config "$DIR/rss.ini" --corpus "$DIR/docs-$n" > "$DIR/out" 2> "$DIR/err" &
        pid=$!
        hwm=0 anon=0
        while kill -0 "$pid" 2> /dev/null; do
            read -r h a < <(awk '/^VmHWM:/ { h = $2 } /^RssAnon:/ { a = $2 } END { print h + 0, a + 0 }' \
                "/proc/$pid/status" 2> /dev/null || echo "0 0")
            [ "$h" -gt "$hwm" ] && hwm=$h
            [ "$a" -gt "$anon" ] && anon=$a
            sleep 0.02
        done
        wait "$pid" || true
        printf '%-24s %5d documents: peak RSS %6.1f MiB, of it anonymous %5.1f MiB; %s\n' "$bin" "$n" \
            "$(echo "$hwm / 1024" | bc -l)" "$(echo "$anon / 1024" | bc -l)" "$(grep '^summary:' "$DIR/out" | cut -d' ' -f2,3,8)"
    done
done
