/* kvm_cpu_math.h: branch-free float32 exp that compilers vectorise (Cephes polynomial,
 * ~2 ulp on [-69, 88]); libm's expf is a scalar call per element, which dominated the
 * softmax and SwiGLU of small models. Results below e^-69 (~1e-30) are flushed to 0: a
 * softmax weight that small changes nothing, but the subnormal products it feeds into the
 * PV GEMM cost ~100 cycles each and made causal prefill 25% slower. Internal to kernels/cpu. */
#ifndef KVM_CPU_MATH_H
#define KVM_CPU_MATH_H

#include <stdint.h>

static inline float kvm__expf(float x)
{
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float x_in = x;
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = (x * log2e + round_magic) - round_magic;
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t i; float f; } scale; /* 2^n; a union (not memcpy) keeps the loop vectorisable */
    scale.i = (uint32_t)((int32_t)n + 127) << 23; /* unsigned: a NaN input gives NaN, not undefined behaviour */
    return x_in < -69.0f ? 0.0f : p * scale.f;
}

/* The same exp on 16 lanes with GCC vector extensions (compiled per target clone), for loops
 * GCC does not vectorise on its own (reductions, selects). */
typedef float kvm__v16 __attribute__((vector_size(64)));
typedef int32_t kvm__v16i __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) kvm__v16 kvm__vselect(kvm__v16i mask, kvm__v16 a, kvm__v16 b)
{
    return (kvm__v16)(((kvm__v16i)a & mask) | ((kvm__v16i)b & ~mask));
}

static inline __attribute__((always_inline)) kvm__v16 kvm__expf16(kvm__v16 x)
{
    kvm__v16 c = kvm__vselect(x < -87.0f, (kvm__v16){0} - 87.0f, x);
    c = kvm__vselect(c > 88.0f, (kvm__v16){0} + 88.0f, c);
    kvm__v16 n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    kvm__v16 r = c - n * 0.693359375f - n * -2.12194440e-4f;
    kvm__v16 p = (kvm__v16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    kvm__v16i bits = (__builtin_convertvector(n, kvm__v16i) + 127) << 23;
    return kvm__vselect(x < -69.0f, (kvm__v16){0}, p * (kvm__v16)bits);
}

#endif
