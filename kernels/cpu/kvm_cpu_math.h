/* kvm_cpu_math.h: branch-free float32 exp that compilers vectorise (Cephes polynomial,
 * ~2 ulp on [-69, 88]); libm's expf is a scalar call per element, which dominated the
 * softmax and SwiGLU of small models. Results below e^-69 (~1e-30) are flushed to 0: a
 * softmax weight that small changes nothing, but the subnormal products it feeds into the
 * PV GEMM cost ~100 cycles each and made causal prefill 25% slower. Internal to kernels/cpu. */
#ifndef KVM_CPU_MATH_H
#define KVM_CPU_MATH_H

#include "kernels/kvm_forward_body.h"

#include <stdint.h>
#include <string.h>

/* The scalar body is kvm_fb_expf (kernels/kvm_forward_body.h), shared with the CUDA backend. */
static inline float kvm__expf(float x) { return kvm_fb_expf(x); }

/* The same exp on 16 lanes with GCC vector extensions (the operations of kvm_fb_expf, in its
 * order, per lane) (compiled per target clone), for loops
 * GCC does not vectorise on its own (reductions, selects). */
typedef float kvm__v16 __attribute__((vector_size(64)));
typedef int32_t kvm__v16i __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) kvm__v16 kvm__vselect(kvm__v16i mask, kvm__v16 a, kvm__v16 b)
{
    return (kvm__v16)(((kvm__v16i)a & mask) | ((kvm__v16i)b & ~mask));
}

/* a < b per lane, as the 16-lane compare (kvm__lt16) or as two 8-lane ones (kvm__lt16h): GCC 12
 * turns a 16-lane compare into 16 scalar vcomiss where AVX-512 is absent, and the 8-lane form
 * into one vcmpps per half. Compares are exact, so both give the same masks; kernels pick the
 * form by kvm__cpu_v4 (the 16-lane one is a single instruction with AVX-512). */
typedef float kvm__v8 __attribute__((vector_size(32)));
typedef int32_t kvm__v8i __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) kvm__v16i kvm__lt16(kvm__v16 a, kvm__v16 b) { return a < b; }

static inline __attribute__((always_inline)) kvm__v16i kvm__lt16h(kvm__v16 a, kvm__v16 b)
{
    kvm__v8 al, ah, bl, bh;
    memcpy(&al, &a, 32), memcpy(&ah, (const float *)&a + 8, 32);
    memcpy(&bl, &b, 32), memcpy(&bh, (const float *)&b + 8, 32);
    const kvm__v8i l = al < bl, h = ah < bh;
    kvm__v16i m;
    memcpy(&m, &l, 32), memcpy((int32_t *)&m + 8, &h, 32);
    return m;
}

/* kvm__expf16's body over the compare LT (a < b per lane, a kvm__v16i mask). */
#define KVM__EXPF16_BODY(LT)                                                                                           \
    kvm__v16 c = kvm__vselect(LT(x, (kvm__v16){0} - 87.0f), (kvm__v16){0} - 87.0f, x);                                 \
    c = kvm__vselect(LT((kvm__v16){0} + 88.0f, c), (kvm__v16){0} + 88.0f, c);                                          \
    kvm__v16 n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                                               \
    kvm__v16 r = c - n * 0.693359375f - n * -2.12194440e-4f;                                                           \
    kvm__v16 p = (kvm__v16){0} + 1.9875691500e-4f;                                                                     \
    p = p * r + 1.3981999507e-3f;                                                                                      \
    p = p * r + 8.3334519073e-3f;                                                                                      \
    p = p * r + 4.1665795894e-2f;                                                                                      \
    p = p * r + 1.6666665459e-1f;                                                                                      \
    p = p * r + 5.0000001201e-1f;                                                                                      \
    p = p * r * r + r + 1.0f;                                                                                          \
    kvm__v16i bits = (__builtin_convertvector(n, kvm__v16i) + 127) << 23;                                              \
    return kvm__vselect(LT(x, (kvm__v16){0} - 69.0f), (kvm__v16){0}, p * (kvm__v16)bits);

static inline __attribute__((always_inline)) kvm__v16 kvm__expf16(kvm__v16 x) { KVM__EXPF16_BODY(kvm__lt16); }

/* kvm__expf16 with the 8-lane compares (the same bits; for processors without AVX-512). */
static inline __attribute__((always_inline)) kvm__v16 kvm__expf16h(kvm__v16 x) { KVM__EXPF16_BODY(kvm__lt16h); }

#endif
