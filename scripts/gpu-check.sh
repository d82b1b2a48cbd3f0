#!/usr/bin/env bash
# scripts/gpu-check.sh: the GPU checks of issues 12 (solver) and 13 (forward), in one script that
# prints a table and finishes in ≤ 5 minutes, for a rented GPU slot (a failed run can be repeated
# within 15 minutes). The host needs bash, the NVIDIA driver, the CUDA toolkit's runtime libraries
# (nvcc 13 for a rebuild) and python3 with PyTorch; no network, no ../shared, none of kvmill's
# Debian libraries: those, the binaries, stories260K, tok512 and the golden files come in the
# git-ignored folder gpu-pack/, made here by scripts/gpu-pack.sh and carried with the tree.
#   scripts/gpu-check.sh [solver] [forward]       # default: both sections
# Environment: DEVICE (cuda:0), REPS (20 for the solver's PyTorch step, 3 for the forward),
#   TOKENS (2048), GPU_CHECK_BUILD=1 to build on the host even when the carried binaries run,
#   GPU_CHECK_BUILD_TIMEOUT (240 s), GPU_CHECK_ASSUME_DEVICE=1 to go past the device probe (tests
#   this script where no GPU is).
# Exit status: 0 every check passed, 1 a check failed, 2 bad usage or no gpu-pack/, 3 no CUDA
# device on this host (nothing was run; the message says what was looked for, with nvidia-smi's
# exit status and first line).
#
# solver: the PyTorch peer of the batched KVSculpt loss+gradient step (bench/torch_sculpt_step.py)
#   at Qwen2.5-1.5B's, SmolLM2's and stories260K's problem shapes, against torch's own GEMM ceiling
#   in the same run; build/tests/check_ridge_body (the device Cholesky's bodies on the CPU),
#   build/tests/check_cuda_sculpt (CPU parity of loss, gradients, normal equations and the device
#   value step; objectives; `kvmill eval/sculpt --device cuda:0` end to end, KL within 5%) and
#   build/bench/bench_solver --device cuda:0 where this revision has them, else a line saying so.
# forward: build/tests/check_forward_body, check_quant_body (the device's dequantisation of every
#   GGUF block type vs the loader's, bit for bit), check_evict_body (the eviction bodies' device
#   order on the CPU), check_cuda_forward (logits vs CPU and run.c's golden, K/V capture,
#   statistics, ragged decode with β, device eviction's kept sets vs the CPU's in both phases,
#   `kvmill eval --device cuda:0` with --phases prefill and both, KL within 1%), check_cuda_prefill
#   (the prefill stage's capture on the device vs the host hooks', float32 and bf16 weights;
#   `kvmill run` with prefill_devices = cuda:0 vs cpu for the five eviction patterns, and with
#   compress_devices = cuda:0, the [eval] evaluation on the device, for h2o and snapkv, KL
#   within 1%), then
#   bench_forward_cuda (random bf16 models made on the device, N = TOKENS: prefill tokens/s,
#   cuBLAS alone on the same GEMMs, decode tokens/s at context N; and the device eviction, SnapKV
#   to N/4: prefill with its statistics and the eviction, ms) and bench/torch_prefill.py (SDPA +
#   bf16 matmuls) at Qwen2.5-1.5B's and SmolLM2's shapes, in two tables.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda:0}
TOKENS=${TOKENS:-2048}
SECTIONS=${*:-solver forward}
PACK=$PWD/gpu-pack
status=0
for sec in $SECTIONS; do
    case $sec in solver | forward) ;; *) echo "gpu-check: unknown section '$sec' (solver, forward)"; exit 2 ;; esac
done
echo "gpu-check: $(date -u +%FT%TZ), sections: $SECTIONS"

# ---- a device? (nvidia-smi, else the driver library; PyTorch is asked below only if both fail)
# nvidia-smi prints its failures on stdout ("No devices were found", exit 6; "NVIDIA-SMI has
# failed because it couldn't communicate with the NVIDIA driver", exit 9): only exit 0 lists GPUs
gpu=""
smi="no nvidia-smi on PATH"
if command -v nvidia-smi > /dev/null; then
    smi_out=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)
    smi_rc=$?
    smi="nvidia-smi exit $smi_rc: $(echo "$smi_out" | head -1)"
    [ $smi_rc = 0 ] && gpu=$(echo "$smi_out" | head -1)
fi
[ "${GPU_CHECK_ASSUME_DEVICE:-0}" = 1 ] && gpu="assumed (GPU_CHECK_ASSUME_DEVICE: testing this script without one)"
if [ -z "$gpu" ]; then
    gpu=$(timeout 60 python3 -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)
fi
if [ -z "$gpu" ]; then
    echo "gpu-check: no CUDA device on this host ($smi; PyTorch, if installed, sees none): nothing run"
    exit 3
fi
echo "gpu-check: device $DEVICE: $gpu"

# ---- the carried libraries and binaries
if [ ! -d "$PACK/bin" ] || [ ! -f "$PACK/root.tar.xz" ]; then
    echo "gpu-check: no gpu-pack/ (run scripts/gpu-pack.sh where kvmill builds, and carry gpu-pack)"
    exit 2
fi
ROOT=${TMPDIR:-/tmp}/kvmill-gpu-root
# an unpack cut short (a run interrupted there) or one of an earlier pack must not be reused:
# unpack beside, move into place whole, and remember which archive it came from
stamp=$(stat -c '%s %Y' "$PACK/root.tar.xz")
if [ ! -d "$ROOT/root" ] || [ "$(cat "$ROOT/root.stamp" 2> /dev/null)" != "$stamp" ]; then
    rm -rf "$ROOT/root" "$ROOT/root.stamp" "$ROOT/unpack"
    mkdir -p "$ROOT/unpack" && xz -dc "$PACK/root.tar.xz" | tar -C "$ROOT/unpack" -xf - && mv "$ROOT/unpack/root" "$ROOT/root" &&
        echo "$stamp" > "$ROOT/root.stamp" || { echo "gpu-check: cannot unpack gpu-pack/root.tar.xz into $ROOT"; exit 2; }
    rm -rf "$ROOT/unpack"
fi
R=$ROOT/root
cudalib=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib; do
    [ -e "$d/libcublas.so.13" ] && cudalib=${cudalib:+$cudalib:}$d
done
if [ -z "$cudalib" ]; then # PyTorch's wheels carry cuBLAS 13 too
    cudalib=$(python3 -c 'import nvidia, os; p = os.path.dirname(nvidia.__path__[0]); print(":".join(os.path.join(p, "nvidia", s, "lib") for s in ("cublas", "cuda_runtime", "cu13")))' 2>/dev/null)
fi
export LD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:$R/usr/lib/x86_64-linux-gnu/openblas-pthread:$R/lib/x86_64-linux-gnu${cudalib:+:$cudalib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVMILL_SHARED=$PACK/shared KVMILL_SRCDIR=$PWD CK_DEFAULT_TIMEOUT=300
BIN=$PACK/bin
if [ "${GPU_CHECK_BUILD:-0}" = 1 ] || ! "$BIN/kvmill" --help > /dev/null 2>&1; then
    # the carried binaries do not load here (another C library?): build on the host with the
    # carried headers, libraries and pkg-config
    echo "gpu-check: building on this host ($("$BIN/kvmill" --help 2>&1 | head -1))"
    tools=$ROOT/tools && mkdir -p "$tools" && ln -sf "$R/usr/bin/pkgconf" "$tools/pkg-config"
    targets="bin/kvmill bin/kvmill-prefill bin/kvmill-compress build/tests/check_cuda_forward build/tests/check_forward_body build/bench/bench_forward_cuda"
    [ -f tests/check_quant_body.c ] && targets="$targets build/tests/check_quant_body"
    [ -f tests/check_evict_body.c ] && targets="$targets build/tests/check_evict_body"
    [ -f tests/check_cuda_prefill.c ] && targets="$targets build/tests/check_cuda_prefill"
    [ -f tests/check_cuda_sculpt.c ] && targets="$targets build/tests/check_cuda_sculpt"
    [ -f tests/check_ridge_body.c ] && targets="$targets build/tests/check_ridge_body"
    [ -f bench/bench_solver.c ] && targets="$targets build/bench/bench_solver"
    # shellcheck disable=SC2086
    if ! PATH=$tools:$PATH PKG_CONFIG_LIBDIR=$R/usr/lib/x86_64-linux-gnu/pkgconfig:$R/usr/share/pkgconfig \
        PKG_CONFIG_SYSROOT_DIR=$R PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1 \
        CPATH=$R/usr/include:$R/usr/include/x86_64-linux-gnu LIBRARY_PATH=${LD_LIBRARY_PATH} \
        timeout "${GPU_CHECK_BUILD_TIMEOUT:-240}" make -j"$(nproc)" CUDA=1 $targets > "$ROOT/build.log" 2>&1; then
        echo "gpu-check: the build failed; the end of $ROOT/build.log:"
        tail -20 "$ROOT/build.log"
        exit 1
    fi
    BIN=$ROOT/bin && mkdir -p "$BIN" && for t in $targets; do cp "$t" "$BIN/"; done
fi
export KVMILL_BIN=$BIN

# runs one check binary (CHECK_TIMEOUT seconds, default 150); prints PASS/FAIL with its figures
run_check() {
    local name=$1 out
    shift
    if [ ! -x "$BIN/$name" ]; then
        echo "$name: not in this revision: not run"
        return
    fi
    out=$(timeout "${CHECK_TIMEOUT:-150}" "$BIN/$name" "$@" 2>&1)
    local rc=$?
    echo "$out" | grep -E '^(SKIP|cuda|tiled|batched solver|kvmill (eval|run)|ridge body)|max\|d' | sed "s/^/  $name: /"
    if [ $rc = 0 ] && echo "$out" | grep -q '100%: Checks'; then
        echo "$name: PASS ($(echo "$out" | grep -o 'Checks: [0-9]*' | tail -1))"
    else
        echo "$name: FAIL (exit $rc)"
        echo "$out" | tail -15
        status=1
    fi
}

for sec in $SECTIONS; do
    case $sec in
    solver)
        echo "== solver"
        run_check check_ridge_body
        CHECK_TIMEOUT=210 run_check check_cuda_sculpt # with two evals and two kvmill runs end to end
        printf '%-10s %-8s %12s %10s %12s\n' shape device ms/step TFLOP/s gemm_TFLOP/s
        for shape in qwen smollm2 stories; do
            line=$(timeout 90 python3 bench/torch_sculpt_step.py --device "$DEVICE" --shape "$shape" --reps "${REPS:-20}" 2>&1 | tail -1)
            case $line in
            torch,*) IFS=, read -r _ sh dev _ ms _ tf _ gt <<< "$line"
                     printf '%-10s %-8s %12s %10s %12s\n' "$sh" "$dev" "$ms" "$tf" "$gt" ;;
            *) echo "$shape: FAILED: $line"; status=1 ;;
            esac
        done
        if [ ! -x "$BIN/bench_solver" ]; then
            echo "bench_solver: not in this revision: not run"
        elif out=$(timeout 90 "$BIN/bench_solver" --device "$DEVICE" 2>&1); then
            echo "$out" | tail -5
        else
            echo "bench_solver --device $DEVICE: FAILED:"
            echo "$out" | tail -3
            status=1
        fi
        ;;
    forward)
        echo "== forward"
        run_check check_forward_body
        run_check check_quant_body
        run_check check_evict_body
        run_check check_cuda_forward
        CHECK_TIMEOUT=210 run_check check_cuda_prefill # fourteen kvmill runs end to end
        fmt='%-14s %-7s %14s %14s %7s %13s %14s %13s\n'
        rows=()
        evrows=()
        for shape in qwen2.5-1.5b smollm2; do
            k=$(timeout 150 "$BIN/bench_forward_cuda" --device "$DEVICE" --shape "$shape" --tokens "$TOKENS" --gen 32 --reps "${REPS_FWD:-3}" --evict snapkv 2>&1)
            kl=$(echo "$k" | grep '^kvmill,' | tail -1)
            el=$(echo "$k" | grep '^kvmill-evict,' | tail -1)
            [ -n "$el" ] || { echo "bench_forward_cuda --evict snapkv $shape: no eviction line"; status=1; }
            IFS=, read -r _ _ _ _ _ _ _ ep _ eb _ es _ ee <<< "${el:-,,,,,,,-,,-,,-,,-}"
            evrows+=("$(printf '%-14s %-10s %8s %18s %10s\n' "$shape" "$ep" "$eb" "$es" "$ee")")
            [ -n "$kl" ] || { echo "bench_forward_cuda $shape: FAILED:"; echo "$k" | tail -5; status=1; }
            t=$(timeout 120 python3 bench/torch_prefill.py --device "$DEVICE" --shape "$shape" --tokens "$TOKENS" --gen 32 --reps "${REPS_FWD:-3}" 2>&1)
            tl=$(echo "$t" | grep '^torch,' | tail -1)
            [ -n "$tl" ] || { echo "torch_prefill $shape: FAILED:"; echo "$t" | tail -5; status=1; }
            IFS=, read -r _ _ _ dt _ _ _ kp _ kg _ ks _ kd <<< "${kl:-,,,,,,,-,,-,,-,,-}"
            IFS=, read -r _ _ _ _ _ _ _ tp _ td <<< "${tl:-,,,,,,,-,,-}"
            rows+=("$(printf "$fmt" "$shape" "${dt:-bf16}" "$kp" "$kg" "$ks" "$kd" "$tp" "$td")")
        done
        echo "forward at N = $TOKENS (tokens/s; share = kvmill prefill / cuBLAS alone on the same GEMMs):"
        printf "$fmt" shape dtype kvm_prefill cublas_only share kvm_decode torch_prefill torch_decode
        printf '%s\n' "${rows[@]}"
        echo "device eviction at N = $TOKENS (prefill phase, every layer and KV head to the budget; ms):"
        printf '%-14s %-10s %8s %18s %10s\n' shape pattern budget prefill_stats_ms evict_ms
        printf '%s\n' "${evrows[@]}"
        ;;
    esac
done
exit $status
