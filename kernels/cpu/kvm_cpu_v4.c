/* kvm_cpu_v4.c: whether the CPU kernels run their hand-written x86-64-v4 (AVX-512) loops (the
 * loss's exponential at head dim 8 in kvm_cpu_sculpt.c, the f16 panels' widening in
 * kvm_cpu_gemm.c, the Cholesky's 64-byte blocks in kvm_cpu_chol.c) and x86-64-v3 (AVX2, F16C)
 * ones (the f16 panels' widening). Decided once, race-free: the GEMM asks from the pool's
 * threads. */
#include "kernels/cpu/kvm_cpu_clones.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* 1 when the processor runs x86-64-v4 code (AVX-512 F, BW, CD, DQ, VL) */
static int v4_supported(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512cd");
}
/* 1 when the processor runs x86-64-v3 code (AVX2, FMA, F16C, BMI1/2, ...) */
static int v3_supported(void) { return __builtin_cpu_supports("x86-64-v3") != 0; }
#else
static int v4_supported(void) { return 0; }
static int v3_supported(void) { return 0; }
#endif

static _Atomic int v4_on = -1; /* -1: not decided yet */

int kvm__cpu_v4(void)
{
    int v = atomic_load_explicit(&v4_on, memory_order_relaxed);
    if (v >= 0) return v;
    const char *off = getenv("KVMILL_NO_AVX512");
    int want = !(off && *off && strcmp(off, "0")) && v4_supported(), expected = -1;
    atomic_compare_exchange_strong(&v4_on, &expected, want); /* the first decision stands */
    return atomic_load(&v4_on);
}

int kvm__cpu_v4_set(int on)
{
    const int was = kvm__cpu_v4();
    atomic_store(&v4_on, on && v4_supported());
    return was;
}

static _Atomic int v3_on = -1; /* -1: not decided yet */

int kvm__cpu_v3(void)
{
    int v = atomic_load_explicit(&v3_on, memory_order_relaxed);
    if (v >= 0) return v;
    int want = v3_supported(), expected = -1;
    atomic_compare_exchange_strong(&v3_on, &expected, want);
    return atomic_load(&v3_on);
}

int kvm__cpu_v3_set(int on)
{
    const int was = kvm__cpu_v3();
    atomic_store(&v3_on, on && v3_supported());
    return was;
}
