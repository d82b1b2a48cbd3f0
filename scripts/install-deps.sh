#!/usr/bin/env bash
# Installs the Debian packages kvmill needs, only those that are missing; does nothing
# when all are present. Never installs CUDA (nvcc/cuBLAS are on the machine or not).
# libopenblas-serial-dev: the OpenBLAS build without server threads, which the Makefile links
# when it is there (see its OPENBLAS_SERIAL).
set -euo pipefail
PKGS=(build-essential pkg-config clang libclang-rt-14-dev
      libzmq3-dev libmsgpack-dev liblmdb-dev check libsubunit-dev
      libopenblas-dev libopenblas-serial-dev liblapacke-dev liblbfgs-dev libinih-dev libsodium-dev libpcre2-dev libjansson-dev libutf8proc-dev
      python3 python3-pip unzip)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-deps: all ${#PKGS[@]} packages present"
    exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    SUDO=sudo
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
