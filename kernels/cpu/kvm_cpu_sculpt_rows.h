/* kvm_cpu_sculpt_rows.h: the CPU backend's row kernel shared by the KVSculpt loss
 * (kvm_cpu_sculpt.c) and the references (kvm_cpu_sculpt_refs.c): the exponentiated softmax row
 * in explicit 256-bit vectors, with the 8-lane form of kvm_sb_expf. Internal. */
#ifndef KVM_CPU_SCULPT_ROWS_H
#define KVM_CPU_SCULPT_ROWS_H

#include "kernels/kvm_sculpt_body.h"
#include "kernels/cpu/kvm_cpu_gemm.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define SB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SB_CLONES
#endif
enum { KVM_SB_QB = 64 }; /* queries per block of the blocked kernels */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* kvm_sb_expf on 8 lanes: the same operations in the same order, so each lane is bit-identical
 * to the scalar body (GCC does not vectorise the body's bit cast by itself). */
static inline v8f v8_expf(v8f x)
{
    const v8f lo = (v8f){0} - 87.0f;
    const v8i keep = x >= lo;
    x = (v8f)(((v8i)x & keep) | ((v8i)lo & ~keep)); /* x < −87 ? −87 : x, one blend */
    v8f t = x * 1.44269504088896341f;
    v8f r = (t + 12582912.0f) - 12582912.0f;
    v8f f = (t - r) * 0.693147180559945309f;
    v8f p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    v8i bits = (__builtin_convertvector(r, v8i) + 127) << 23;
    return p * (v8f)bits;
}

/* Lanewise max(a, b): one compare and one blend (a where a ≥ b, else b). */
static inline v8f v8_max(v8f a, v8f b)
{
    const v8i ge = a >= b;
    return (v8f)(((v8i)a & ge) | ((v8i)b & ~ge));
}

/* The largest of the 8 lanes. */
static inline float v8_hmax(v8f m)
{
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++) mx = m[l] > mx ? m[l] : mx;
    return mx;
}

/* The sum of the 8 lanes as a fixed tree. */
static inline float v8_hsum(v8f a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* The exponentiation half of a softmax row: s_j ← exp(s_j − mx) in place (v8_expf) for j < kp
 * (a multiple of 16), mx the row's maximum. Returns the row's LSE mx + ln Σ_j s_j and
 * *iz = 1/Σ_j s_j (two 8-lane accumulators, then a fixed tree). */
SB_CLONES
static inline float exp_row(float *restrict s, int64_t kp, float mx, float *iz)
{
    v8f a0 = {0}, a1 = {0}, x0, x1;
    for (int64_t j = 0; j < kp; j += KVM_GEMM_NR) {
        memcpy(&x0, s + j, 32);
        memcpy(&x1, s + j + 8, 32);
        x0 = v8_expf(x0 - mx);
        x1 = v8_expf(x1 - mx);
        memcpy(s + j, &x0, 32);
        memcpy(s + j + 8, &x1, 32);
        a0 += x0;
        a1 += x1;
    }
    float z = v8_hsum(a0 + a1);
    *iz = 1.0f / z;
    return mx + logf(z);
}

/* Exponentials of one score row s[0..kp) (+ beta; padding beyond k is −1e30) in place,
 * unnormalised: s_j ← exp(s_j + β_j − max). Returns the row's LSE; *iz = 1/Σ_j s_j. */
SB_CLONES
static inline float softmax_row(float *restrict s, const float *restrict b0, int64_t kp, float *iz)
{
    v8f m0 = (v8f){0} - INFINITY, m1 = m0, x0, x1, y0, y1;
    for (int64_t j = 0; j < kp; j += KVM_GEMM_NR) {
        memcpy(&x0, s + j, 32);
        memcpy(&x1, s + j + 8, 32);
        memcpy(&y0, b0 + j, 32);
        memcpy(&y1, b0 + j + 8, 32);
        x0 += y0;
        x1 += y1;
        memcpy(s + j, &x0, 32);
        memcpy(s + j + 8, &x1, 32);
        m0 = v8_max(m0, x0);
        m1 = v8_max(m1, x1);
    }
    return exp_row(s, kp, v8_hmax(v8_max(m0, m1)), iz);
}

#endif
