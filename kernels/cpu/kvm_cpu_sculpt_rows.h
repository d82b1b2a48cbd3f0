/* kvm_cpu_sculpt_rows.h: the CPU backend's row kernel shared by the KVSculpt loss
 * (kvm_cpu_sculpt.c) and the references (kvm_cpu_sculpt_refs.c): the exponentiated softmax row
 * in explicit 16-lane vectors, with the 16-lane form of kvm_sb_expf. Internal. */
#ifndef KVM_CPU_SCULPT_ROWS_H
#define KVM_CPU_SCULPT_ROWS_H

#include "kernels/kvm_sculpt_body.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_clones.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define SB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SB_CLONES
#endif
/* The vector helpers below are always inlined: called out of line from a clone they would pass
 * 512-bit vectors by a different ABI than the clone expects (GCC's -Wpsabi note). */
#define SB_INLINE __attribute__((always_inline))
enum { KVM_SB_QB = 64 }; /* queries per block of the blocked kernels */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
/* One 16-entry panel column block (NR = 16 lanes): a single zmm register in the x86-64-v4 clone,
 * two ymm in the v3 clone, four xmm in the baseline one. Every operation on it is lanewise, so the
 * three clones compute each lane with the same operations in the same order (bit-identical). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* kvm_sb_expf on 16 lanes: the same operations in the same order, so each lane is bit-identical
 * to the scalar body (GCC does not vectorise the body's bit cast by itself). */
#define V16_EXPF_BODY(KEEP)                                                                                            \
    const v16f lo = (v16f){0} - 87.0f;                                                                                 \
    const v16i keep = KEEP;                                                                                            \
    x = (v16f)(((v16i)x & keep) | ((v16i)lo & ~keep));                                                                 \
    v16f t = x * 1.44269504088896341f;                                                                                 \
    v16f r = (t + 12582912.0f) - 12582912.0f;                                                                          \
    v16f f = (t - r) * 0.693147180559945309f;                                                                          \
    v16f p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));  \
    v16i bits = (__builtin_convertvector(r, v16i) + 127) << 23;                                                        \
    return p * (v16f)bits;

static inline SB_INLINE v16f v16_expf(v16f x) { V16_EXPF_BODY(x >= lo); }

/* v16_expf on 8 lanes (the same operations, so the same bits): GCC lowers v16_expf's integer
 * conversion and shift on AVX2 through 128-bit pieces and the stack. */
static inline SB_INLINE v8f v8_expf(v8f x)
{
    const v8f lo = (v8f){0} - 87.0f;
    const v8i keep = x >= lo;
    x = (v8f)(((v8i)x & keep) | ((v8i)lo & ~keep));
    v8f t = x * 1.44269504088896341f;
    v8f r = (t + 12582912.0f) - 12582912.0f;
    v8f f = (t - r) * 0.693147180559945309f;
    v8f p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    v8i bits = (__builtin_convertvector(r, v8i) + 127) << 23;
    return p * (v8f)bits;
}

/* kvm_sb_logf on 16 lanes: the same operations in the same order (z normal and > 0). */
static inline SB_INLINE v16f v16_logf(v16f z)
{
    const v16i bits = (v16i)z;
    v16i e = ((bits >> 23) & 255) - 127;
    v16f m = (v16f)((bits & 0x7fffff) | 0x3f800000);
    const v16i big = m > 1.41421356f; /* −1 where m > √2 */
    m = (v16f)(((v16i)(m * 0.5f) & big) | ((v16i)m & ~big));
    e -= big;
    const v16f s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    const v16f q = s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9))));
    const v16f ef = __builtin_convertvector(e, v16f);
    return ef * 0.693145751953125f + ((2.0f * s + 2.0f * s * q) + ef * 1.42860677e-6f);
}

/* Lanewise max(a, b): one compare and one blend (a where a ≥ b, else b). */
static inline SB_INLINE v8f v8_max(v8f a, v8f b)
{
    const v8i ge = a >= b;
    return (v8f)(((v8i)a & ge) | ((v8i)b & ~ge));
}

static inline SB_INLINE v16f v16_max(v16f a, v16f b)
{
    const v16i ge = a >= b;
    return (v16f)(((v16i)a & ge) | ((v16i)b & ~ge));
}

/* a >= b per lane as two 8-lane compares: GCC 12 turns a 16-lane compare into 16 scalar
 * vcomiss where AVX-512 is absent (exact either way: the same masks). */
static inline SB_INLINE v16i v16_ge_h(v16f a, v16f b)
{
    v8f al, ah, bl, bh;
    memcpy(&al, &a, 32), memcpy(&ah, (const float *)&a + 8, 32);
    memcpy(&bl, &b, 32), memcpy(&bh, (const float *)&b + 8, 32);
    const v8i l = al >= bl, h = ah >= bh;
    v16i m;
    memcpy(&m, &l, 32), memcpy((int32_t *)&m + 8, &h, 32);
    return m;
}

/* v16_max with v16_ge_h (the same bits, for processors without AVX-512). */
static inline SB_INLINE v16f v16_max_h(v16f a, v16f b)
{
    const v16i ge = v16_ge_h(a, b);
    return (v16f)(((v16i)a & ge) | ((v16i)b & ~ge));
}

/* v16_expf with v16_ge_h (the same bits). */
static inline SB_INLINE v16f v16_expf_h(v16f x) { V16_EXPF_BODY(v16_ge_h(x, lo)); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define SB_HAVE_V4 1
#define SB_V4 __attribute__((target("arch=x86-64-v4")))
/* v16_expf in two AVX-512 instructions fewer, bit for bit the same values: the clamp is one
 * vmaxps (max(x, lo) is x > lo ? x : lo, a NaN giving lo, as the compare-and-blend the generic
 * form compiles to) and p·2^r is one vscalefps instead of the exponent's conversion, shift and
 * multiply (both exact: r is an integer in [−126, 127], and a product by a power of two rounds
 * or flushes under MXCSR alike). Only for functions compiled for x86-64-v4 (SB_V4). */
SB_V4 static inline SB_INLINE v16f v16_expf_v4(v16f x)
{
    x = _mm512_max_ps(x, (v16f){0} - 87.0f);
    v16f t = x * 1.44269504088896341f;
    v16f r = (t + 12582912.0f) - 12582912.0f;
    v16f f = (t - r) * 0.693147180559945309f;
    v16f p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    return _mm512_scalef_ps(p, r);
}

#endif

/* The eight 16-lane sums of acc [8] into out [8] (out[t] = Σ_l acc[t][l]) as a fixed tree of
 * half-vector shuffles: lanes l and l + 8 first, then l and l + 4, l + 2, l + 1. */
static inline SB_INLINE void v16_hsum8(const v16f acc[8], float out[8])
{
    v16f s[4], u[2];
    for (int i = 0; i < 4; i++) {
        const v16f a = acc[2 * i], b = acc[2 * i + 1];
        s[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; i++) {
        const v16f a = s[2 * i], b = s[2 * i + 1];
        u[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    const v16f w = __builtin_shufflevector(u[0], u[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                   __builtin_shufflevector(u[0], u[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    const v8f r = __builtin_shufflevector(w, w, 0, 2, 4, 6, 8, 10, 12, 14) +
                  __builtin_shufflevector(w, w, 1, 3, 5, 7, 9, 11, 13, 15);
    memcpy(out, &r, 32);
}

/* The largest of the 8 lanes. */
static inline SB_INLINE float v8_hmax(v8f m)
{
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++) mx = m[l] > mx ? m[l] : mx;
    return mx;
}

/* The sum of the 8 lanes as a fixed tree. */
static inline SB_INLINE float v8_hsum(v8f a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* Lanes 0–7 and 8–15 of a 16-lane vector. */
static inline SB_INLINE v8f v16_lo(v16f a)
{
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7);
}

static inline SB_INLINE v8f v16_hi(v16f a)
{
    return __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* The largest of the 16 lanes; the sum of the 16 lanes as lo + hi, then v8_hsum's tree (the
 * order the two-accumulator 8-lane loops summed in). */
static inline SB_INLINE float v16_hmax(v16f m)
{
    return v8_hmax(v8_max(v16_lo(m), v16_hi(m)));
}

static inline SB_INLINE float v16_hsum(v16f a)
{
    return v8_hsum(v16_lo(a) + v16_hi(a));
}

/* The exponentiation half of a softmax row: s_j ← exp(s_j − mx) in place (v16_expf) for j < kp
 * (a multiple of 16), mx the row's maximum. Returns the row's LSE mx + ln Σ_j s_j and
 * *iz = 1/Σ_j s_j (one 16-lane accumulator, then v16_hsum's fixed tree). */
#define EXP_ROW_BODY(EXPF)                                                                                             \
    v16f a = {0}, x;                                                                                                   \
    for (int64_t j = 0; j < kp; j += KVM_GEMM_NR) {                                                                    \
        memcpy(&x, s + j, 64);                                                                                         \
        x = EXPF(x - mx);                                                                                              \
        memcpy(s + j, &x, 64);                                                                                         \
        a += x;                                                                                                        \
    }                                                                                                                  \
    float z = v16_hsum(a);                                                                                             \
    *iz = 1.0f / z;                                                                                                    \
    return mx + kvm_sb_logf(z);

static inline SB_INLINE float exp_row_body(float *restrict s, int64_t kp, float mx, float *iz)
{
    EXP_ROW_BODY(v16_expf);
}

/* exp_row_body with v16_expf_h (the same bits; processors without AVX-512, kvm__cpu_v4 off). */
static inline SB_INLINE float exp_row_body_h(float *restrict s, int64_t kp, float mx, float *iz)
{
    EXP_ROW_BODY(v16_expf_h);
}

/* exp_row over nb rows s [nb][kp] (maxima mx [nb]) in one cloned call, so the polynomial's
 * constants are set up once per block instead of once per row: LSEs into lse [nb], inverse sums
 * into iz [nb]. */
SB_CLONES
static inline void exp_rows(float *restrict s, int nb, int64_t kp, const float *mx, float *lse, float *iz)
{
    if (kvm__cpu_v4())
        for (int b = 0; b < nb; b++)
            lse[b] = exp_row_body(s + b * kp, kp, mx[b], &iz[b]);
    else
        for (int b = 0; b < nb; b++)
            lse[b] = exp_row_body_h(s + b * kp, kp, mx[b], &iz[b]);
}

/* Exponentials of one score row s[0..kp) (+ beta; padding beyond k is −1e30) in place,
 * unnormalised: s_j ← exp(s_j + β_j − max). Returns the row's LSE; *iz = 1/Σ_j s_j. */
SB_CLONES
static inline float softmax_row(float *restrict s, const float *restrict b0, int64_t kp, float *iz)
{
    const int v4 = kvm__cpu_v4();
    v16f m = (v16f){0} - INFINITY, x, y;
    for (int64_t j = 0; j < kp; j += KVM_GEMM_NR) {
        memcpy(&x, s + j, 64);
        memcpy(&y, b0 + j, 64);
        x += y;
        memcpy(s + j, &x, 64);
        m = v4 ? v16_max(m, x) : v16_max_h(m, x);
    }
    const float mx = v16_hmax(m);
    return v4 ? exp_row_body(s, kp, mx, iz) : exp_row_body_h(s, kp, mx, iz);
}

#endif
