#!/usr/bin/env bash
# gguf-to-hf.sh GGUF OUT_DIR: writes a Hugging Face folder (config.json, float32
# model.safetensors, tokenizer.json, tokenizer_config.json) from a llama-architecture GGUF with
# a byte-level BPE vocabulary (scripts/gguf_to_hf.py: the dequantised weights, llama.cpp's Q/K
# row permutation undone). The Python packages it needs (gguf, numpy, safetensors, tokenizers;
# no torch) are installed with pip into $KVMILL_PYDEPS (default ~/.cache/kvmill/pydeps) on the
# first run. For SmolLM2-135M the folder is about 540 MB.
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: scripts/gguf-to-hf.sh GGUF OUT_DIR" >&2
    exit 2
fi
# a wrong path is said before pip spends minutes installing (gguf_to_hf.py checks the contents)
if [ ! -f "$1" ] || [ ! -r "$1" ]; then
    echo "gguf-to-hf: GGUF $1: not a readable file" >&2
    exit 2
fi
if [ -e "$2" ] && [ ! -d "$2" ]; then
    echo "gguf-to-hf: OUT_DIR $2 exists and is not a folder" >&2
    exit 2
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
PYDEPS="${KVMILL_PYDEPS:-$HOME/.cache/kvmill/pydeps}"
PKGS=(gguf==0.19.0 numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3)
export PYTHONPATH="$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import gguf, numpy, safetensors, tokenizers" >/dev/null 2>&1; then
    echo "gguf-to-hf: installing ${PKGS[*]} into $PYDEPS"
    mkdir -p "$PYDEPS"
    PIP=(python3 -m pip)
    "${PIP[@]}" --version >/dev/null 2>&1 || PIP=(pip3)
    if ! "${PIP[@]}" install --quiet --disable-pip-version-check --target "$PYDEPS" "${PKGS[@]}"; then
        echo "gguf-to-hf: error: pip could not install ${PKGS[*]} (no PyPI access?)" >&2
        exit 1
    fi
fi
exec python3 "$HERE/gguf_to_hf.py" "$1" "$2"
