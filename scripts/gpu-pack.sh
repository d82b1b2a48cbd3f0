#!/usr/bin/env bash
# scripts/gpu-pack.sh: prepares the git-ignored folder gpu-pack/ that travels with the tree to a
# bare GPU host for scripts/gpu-check.sh (issues 12 and 13): that host has the CUDA toolkit (nvcc
# 13, cuBLAS), the driver and PyTorch, but none of kvmill's Debian libraries, no network and no
# ../shared, and at most 64 MiB of the tree travels (tracked files plus named ignored folders).
#   scripts/gpu-pack.sh            # build, pack, check the size; run from any directory
# Makes, under gpu-pack/:
#   bin/     bin/kvmill, kvmill-prefill and kvmill-compress (check_cuda_sculpt's `kvmill run`),
#            build/tests/check_cuda_forward, check_cuda_prefill (its `kvmill run` with the prefill on
#            cuda:0), check_forward_body, check_quant_body, check_evict_body, build/bench/bench_forward_cuda
#            and, where their sources exist, check_cuda_sculpt, check_ridge_body and bench_solver (debug info stripped)
#   root.tar.xz  root/, the runtime .debs of every library those binaries load (ldd; glibc, libstdc++ and CUDA's own
#            libraries excepted, the host has them) and, for building there when a binary does not run,
#            the -dev packages pkg-config reads for kvmill's libraries plus pkgconf, unpacked with
#            dpkg -x (static archives dropped except Check's), checked here, then archived with xz
#            (OpenBLAS alone is 43 MiB unpacked); debs/LIST keeps the downloaded files' names
#   shared/  models/stories260K.bin, models/tok512.bin and golden/ from $KVMILL_SHARED (../shared)
#   MANIFEST the binaries' library list and the total size
# Fails (exit 1) when a library ldd names is not in the pack, or the total reaches 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${KVMILL_SHARED:-../shared}
PACK=gpu-pack
LIMIT=$((64 * 1024 * 1024))
grep -qxF "/$PACK/" .git/info/exclude 2>/dev/null || grep -qxF "/$PACK/" .gitignore ||
    { echo "gpu-pack: /$PACK/ must be git-ignored (.gitignore)"; exit 1; }

targets=(bin/kvmill bin/kvmill-prefill bin/kvmill-compress build/tests/check_cuda_forward build/tests/check_forward_body build/bench/bench_forward_cuda)
[ -f tests/check_cuda_sculpt.c ] && targets+=(build/tests/check_cuda_sculpt)
targets+=(build/tests/check_quant_body build/tests/check_evict_body build/tests/check_cuda_prefill)
[ -f tests/check_ridge_body.c ] && targets+=(build/tests/check_ridge_body)
[ -f bench/bench_solver.c ] && targets+=(build/bench/bench_solver)
make -j2 "${targets[@]}"
for t in bin/kvmill build/tests/check_cuda_forward build/bench/bench_forward_cuda; do
    ldd "$t" | grep -q libcudart || { echo "gpu-pack: $t is not linked with CUDA (nvcc missing or CUDA=0?)"; exit 1; }
done

rm -rf "$PACK"
mkdir -p "$PACK"/{bin,root,debs,shared/models}
for t in "${targets[@]}"; do strip --strip-debug -o "$PACK/bin/$(basename "$t")" "$t"; done

# libraries the host lacks: everything ldd lists but glibc, the compiler's runtime and CUDA's
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libstdc\+\+|libgcc_s|libcublas|libcublasLt|libcudart)'
mapfile -t libs < <(for t in "${targets[@]}"; do ldd "$t"; done | awk '$3 ~ /^\// {print $1, $3}' | sort -u |
    grep -Ev "$skip" | awk '{print $2}')
owner() { # the package owning a library path (dpkg records /lib or /usr/lib, the link or its target)
    local p r
    for p in "$1" "$(readlink -f "$1")" "${1/#\/lib\//\/usr\/lib\/}" "$(readlink -f "$1" | sed 's#^/usr/lib/#/lib/#')"; do
        r=$(dpkg -S "$p" 2>/dev/null | head -1 | cut -d: -f1) && [ -n "$r" ] && { echo "$r"; return; }
    done
    echo "gpu-pack: no package owns $1" >&2
    return 1
}
runtime=()
for l in "${libs[@]}"; do runtime+=("$(owner "$l")"); done
# -dev packages of the .pc files pkg-config reads for the build (Makefile PKGS, and Check for the tests)
pcs=$(for p in libzmq msgpack lmdb openblas lapacke liblbfgs inih libsodium libpcre2-8 jansson libutf8proc check; do
    pkg-config --debug --cflags --libs "$p" 2>&1 | grep -o 'found: [^ ]*\.pc' | sed 's/found: //'; done | sort -u)
dev=(pkgconf pkgconf-bin libpkgconf3)
for f in $pcs; do dev+=("$(owner "$f")"); done
mapfile -t pkgs < <(printf '%s\n' "${runtime[@]}" "${dev[@]}" | sort -u)
echo "gpu-pack: ${#pkgs[@]} packages: ${pkgs[*]}"
(cd "$PACK/debs" && apt-get download "${pkgs[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
for d in "$PACK"/debs/*.deb; do dpkg -x "$d" "$PACK/root"; done
ls "$PACK"/debs/*.deb | xargs -n1 basename > "$PACK/debs/LIST"
rm -f "$PACK"/debs/*.deb
# .pc files that are Debian alternatives links here (lapack.pc, openblas.pc) are in no .deb:
# recreate them as links inside the root
for f in $pcs; do
    [ -L "$f" ] && [ ! -e "$PACK/root$f" ] && mkdir -p "$PACK/root$(dirname "$f")" &&
        ln -s "$(realpath --relative-to="$(dirname "$f")" "$(readlink -f "$f")")" "$PACK/root$f"
done
# what a build there does not need: documentation and the static archives (Check links statically)
rm -rf "$PACK"/root/usr/share/{doc,man,info,lintian,locale}
find "$PACK/root" -name '*.a' ! -name 'libcheck*' ! -name 'libsubunit*' -delete

# every library ldd named is in the pack (by file name, in the folders gpu-check.sh puts on
# LD_LIBRARY_PATH)
libdirs="$PACK/root/usr/lib/x86_64-linux-gnu $PACK/root/lib/x86_64-linux-gnu $PACK/root/usr/lib/x86_64-linux-gnu/openblas-pthread"
# the same binaries, run here with the pack's folders first, load every library from the pack
for d in $libdirs; do LDP=${LDP:+$LDP:}$PWD/$d; done
missing=0
for l in "${libs[@]}"; do
    n=$(basename "$l")
    found=0
    for d in $libdirs; do [ -e "$d/$n" ] && found=1; done
    [ $found = 1 ] || { echo "gpu-pack: $n (ldd: $l) is not in the pack"; missing=1; }
done
[ $missing = 0 ] || exit 1
# and they resolve there when the pack's folders come first (as gpu-check.sh sets them), and run
for t in "$PACK"/bin/*; do
    bad=$(LD_LIBRARY_PATH=$LDP ldd "$t" | awk '$3 ~ /^\// {print $1, $3}' | grep -Ev "$skip" | grep -v " $PWD/$PACK/" || true)
    [ -z "$bad" ] || { echo "gpu-pack: $t loads from outside the pack: $bad"; exit 1; }
done
LD_LIBRARY_PATH=$LDP "$PACK/bin/check_forward_body" > /dev/null || { echo "gpu-pack: check_forward_body fails on the pack's libraries"; exit 1; }
LD_LIBRARY_PATH=$LDP "$PACK/bin/kvmill" generate --model data/models/stories260K.bin --prompt a -n 8 --temperature 0 \
    > /dev/null 2>&1 || { echo "gpu-pack: kvmill generate fails on the pack's libraries"; exit 1; }

for f in models/stories260K.bin models/tok512.bin; do
    [ -f "$SHARED/$f" ] && cp "$SHARED/$f" "$PACK/shared/$f" || cp "data/$f" "$PACK/shared/$f"
done
if [ -d "$SHARED/golden" ]; then
    mkdir -p "$PACK/shared/golden" && cp "$SHARED"/golden/seq256.* "$SHARED/golden/README.md" "$PACK/shared/golden/"
else
    echo "gpu-pack: no $SHARED/golden: check_cuda_forward will compare with the CPU only"
fi

# unpacked, OpenBLAS alone is 43 MiB: the tree travels as one xz archive that gpu-check.sh
# extracts on the host (to $TMPDIR, outside the carried folder)
tar -C "$PACK" -cf - root | xz -6 -T2 > "$PACK/root.tar.xz"
rm -rf "$PACK/root"
bytes=$(du -sb "$PACK" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
{ echo "libraries: ${libs[*]}"; echo "packages: ${pkgs[*]}"; echo "pack_bytes: $bytes"; echo "tracked_bytes: $tree"; } > "$PACK/MANIFEST"
printf 'gpu-pack: %s is %.1f MiB, tracked files %.1f MiB, together %.1f MiB of 64\n' "$PACK" \
    "$(echo "$bytes / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "($bytes + $tree) / 1048576" | bc -l)"
[ $((bytes + tree)) -lt $LIMIT ] || { echo "gpu-pack: over the 64 MiB that travels"; exit 1; }
echo "gpu-pack: ready; on the GPU host run scripts/gpu-check.sh with gpu-pack/ carried"
