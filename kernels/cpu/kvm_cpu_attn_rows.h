/* kvm_cpu_attn_rows.h: the per-row pieces of CPU attention shared by the per-layer kernel
 * (kvm_cpu_attn.c) and the per-head reference it replaced (kvm_cpu_attn_ref.c), so both
 * round alike. Internal to the CPU backend. */
#ifndef KVM_CPU_ATTN_ROWS_H
#define KVM_CPU_ATTN_ROWS_H

#include "kernels/cpu/kvm_cpu_clones.h"
#include "kernels/cpu/kvm_cpu_half.h"
#include "kernels/cpu/kvm_cpu_math.h"
#include "kernels/kvm_forward_body.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KVM_ATTN_QBLOCK = 64 };

/* Number of entries among pos[0, n) with pos <= p (pos sorted, KVM_POS_NONE = -1 first):
 * kvm_fb_visible (kernels/kvm_forward_body.h), the body the CUDA kernels run. */
static inline int64_t kvm__attn_visible(const int32_t *pos, int64_t n, int32_t p) { return kvm_fb_visible(pos, n, p); }

/* kvm__attn_softmax_row's body over the compare LT (kvm__v16i mask of a < b) and the 16-lane
 * exponential EXPF (kvm_fb_entropy_acc per lane in the entropy loop). */
#define KVM__ATTN_SOFTMAX_BODY(LT, EXPF)                                                                               \
    typedef kvm__v16 v16;                                                                                              \
    const int64_t nv = vis / 16 * 16;                                                                                  \
    v16 vm = (v16){0} - INFINITY, x, b;                                                                                \
    for (int64_t e = 0; e < nv; e += 16) {                                                                             \
        memcpy(&x, row + e, sizeof x);                                                                                 \
        if (bias) {                                                                                                    \
            memcpy(&b, bias + e, sizeof b);                                                                            \
            x += b;                                                                                                    \
            memcpy(row + e, &x, sizeof x);                                                                             \
        }                                                                                                              \
        vm = kvm__vselect(LT(vm, x), x, vm);                                                                           \
    }                                                                                                                  \
    float m = -INFINITY;                                                                                               \
    for (int l = 0; l < 16; l++)                                                                                       \
        m = vm[l] > m ? vm[l] : m;                                                                                     \
    for (int64_t e = nv; e < vis; e++) {                                                                               \
        if (bias) row[e] += bias[e];                                                                                   \
        m = row[e] > m ? row[e] : m;                                                                                   \
    }                                                                                                                  \
    v16 vs = {0}, vxt = {0}, t;                                                                                        \
    if (ent_out) /* a loop of its own: rows asking no entropy pay nothing */                                           \
        for (int64_t e = 0; e < nv; e += 16) {                                                                         \
            memcpy(&t, row + e, sizeof t);                                                                             \
            t -= m;                                                                                                    \
            x = EXPF(t);                                                                                               \
            vs += x;                                                                                                   \
            vxt += kvm__vselect(LT((v16){0}, x), x * t, (v16){0});                                                     \
            memcpy(row + e, &x, sizeof x);                                                                             \
        }                                                                                                              \
    else                                                                                                               \
        for (int64_t e = 0; e < nv; e += 16) {                                                                         \
            memcpy(&x, row + e, sizeof x);                                                                             \
            x = EXPF(x - m);                                                                                           \
            vs += x;                                                                                                   \
            memcpy(row + e, &x, sizeof x);                                                                             \
        }                                                                                                              \
    float s = 0.0f, xt = 0.0f;                                                                                         \
    for (int l = 0; l < 16; l++)                                                                                       \
        s += vs[l], xt += vxt[l];                                                                                      \
    for (int64_t e = nv; e < vis; e++) {                                                                               \
        const float te = row[e] - m;                                                                                   \
        s += row[e] = kvm__expf(te);                                                                                   \
        xt += kvm_fb_entropy_acc(row[e], te);                                                                          \
    }                                                                                                                  \
    float inv = vis > 0 ? 1.0f / s : 0.0f;                                                                             \
    if (lse_out) *lse_out = vis > 0 ? m + logf(s) : -INFINITY;                                                         \
    if (ent_out) *ent_out = kvm_fb_entropy_finish(vis > 0 ? s : 0.0, xt);                                              \
    if (normalize)                                                                                                     \
        for (int64_t e = 0; e < vis; e++)                                                                              \
            row[e] *= inv;                                                                                             \
    if (width > vis) memset(row + vis, 0, (size_t)(width - vis) * sizeof *row);                                        \
    return inv;

KVM_CLONES
static inline float kvm__attn_softmax_row16(float *row, const float *bias, int64_t vis, int64_t width, int normalize,
                                            float *lse_out, float *ent_out)
{
    KVM__ATTN_SOFTMAX_BODY(kvm__lt16, kvm__expf16);
}

/* The same with 8-lane compares (same bits): GCC scalarises 16-lane compares without AVX-512. */
KVM_CLONES
static inline float kvm__attn_softmax_row16h(float *row, const float *bias, int64_t vis, int64_t width, int normalize,
                                             float *lse_out, float *ent_out)
{
    KVM__ATTN_SOFTMAX_BODY(kvm__lt16h, kvm__expf16h);
}

/* In-place softmax of row[0, vis) (scores, bias added), zero on [vis, width): the SIMD form of
 * kvm_fb_softmax_row (kernels/kvm_forward_body.h) with the same per-element operations (bias add,
 * max, kvm_fb_expf per lane, 1/Σ); the sum is taken over 16 lanes, then across them. Explicit
 * 16-lane vectors: GCC does not vectorise the max/sum reductions without -ffast-math.
 * Returns 1/sum; the row is scaled by it only when `normalize` (else the caller scales the
 * attention output instead, which is head_dim values rather than vis). *lse_out, when not
 * NULL, receives ln Σ exp(row) = max + ln sum (−∞ for an empty row); *ent_out, when not NULL,
 * the row's entropy −Σ p ln p from the same pass (kvm_fb_entropy_acc per lane on the scores
 * less the maximum, summed as the weights are, then kvm_fb_entropy_finish: no log per weight). */
static inline float kvm__attn_softmax_row(float *row, const float *bias, int64_t vis, int64_t width, int normalize,
                                   float *lse_out, float *ent_out)
{
    return kvm__cpu_v4() ? kvm__attn_softmax_row16(row, bias, vis, width, normalize, lse_out, ent_out)
                         : kvm__attn_softmax_row16h(row, bias, vis, width, normalize, lse_out, ent_out);
}

/* 8 values of a row of V at element offset off: float32 (v), or f16 widened (vh, when v is NULL). */
static inline __attribute__((always_inline)) kvm__v8 kvm__attn_load8(const float *v, const uint16_t *vh, int64_t off)
{
    kvm__v8 x;
    if (v) memcpy(&x, v + off, sizeof x);
    else x = kvm__f16_widen8(vh + off);
    return x;
}

/* One element of K or V at offset off, float32 or f16 widened (as kvm__attn_load8). */
static inline __attribute__((always_inline)) float kvm__attn_load1(const float *v, const uint16_t *vh, int64_t off)
{
    return v ? v[off] : kvm__f16_float(vh[off]);
}

/* o[0, d) = Σ_e p[e] · V[e][0, d) over float32 V (v) or f16 V (vh): 8 columns at a time with
 * four accumulators over e, so consecutive entries do not wait on each other's FMA. The two
 * element types run the same operations in the same order (f16 widened as it is read). */
static inline __attribute__((always_inline)) void kvm__attn_pv_body(const float *p, const float *v, const uint16_t *vh,
                                                                    int64_t n, int d, float *o)
{
    typedef kvm__v8 v8;
    int c0 = 0;
    for (; c0 + 8 <= d; c0 += 8) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, x0, x1, x2, x3;
        int64_t e = 0;
        for (; e + 4 <= n; e += 4) {
            x0 = kvm__attn_load8(v, vh, (e + 0) * d + c0);
            x1 = kvm__attn_load8(v, vh, (e + 1) * d + c0);
            x2 = kvm__attn_load8(v, vh, (e + 2) * d + c0);
            x3 = kvm__attn_load8(v, vh, (e + 3) * d + c0);
            a0 += p[e] * x0;
            a1 += p[e + 1] * x1;
            a2 += p[e + 2] * x2;
            a3 += p[e + 3] * x3;
        }
        for (; e < n; e++) {
            x0 = kvm__attn_load8(v, vh, e * d + c0);
            a0 += p[e] * x0;
        }
        v8 sum = (a0 + a1) + (a2 + a3);
        memcpy(o + c0, &sum, sizeof sum);
    }
    for (; c0 < d; c0++) {
        float acc = 0.0f;
        for (int64_t e = 0; e < n; e++) acc += p[e] * kvm__attn_load1(v, vh, e * d + c0);
        o[c0] = acc;
    }
}

KVM_CLONES
static inline void kvm__attn_pv_direct(const float *p, const float *v, int64_t n, int d, float *o)
{
    kvm__attn_pv_body(p, v, NULL, n, d, o);
}

/* kvm__attn_pv_direct over f16 values vh [n][d], widened as they are read. */
KVM_CLONES
static inline void kvm__attn_pv_direct_f16(const float *p, const uint16_t *vh, int64_t n, int d, float *o)
{
    kvm__attn_pv_body(p, NULL, vh, n, d, o);
}

/* Scores of one query against entries [0, vis) of float32 K (k) or f16 K (kh) by direct
 * products (decode: each entry is read once, so packing would not pay). Loops run over
 * entries innermost so the multiply-adds of different entries are independent (a per-entry
 * dot product would be one serial FMA chain). */
static inline __attribute__((always_inline)) void kvm__attn_scores_body(const float *q, const float *k,
                                                                        const uint16_t *kh, int64_t vis, int d,
                                                                        float scale, float *p)
{
    enum { EB = 64 };
    for (int64_t e0 = 0; e0 < vis; e0 += EB) {
        const int64_t nb = vis - e0 < EB ? vis - e0 : EB;
        float s[EB] = {0};
        for (int c = 0; c < d; c++) {
            const float qc = q[c] * scale;
            const int64_t off = e0 * d + c;
            for (int64_t j = 0; j < nb; j++) s[j] += qc * kvm__attn_load1(k, kh, off + j * d);
        }
        memcpy(p + e0, s, (size_t)nb * sizeof *s);
    }
}

KVM_CLONES
static inline void kvm__attn_scores_direct(const float *q, const float *k, int64_t vis, int d, float scale, float *p)
{
    kvm__attn_scores_body(q, k, NULL, vis, d, scale, p);
}

/* kvm__attn_scores_direct over f16 keys kh [vis][d], widened as they are read. */
KVM_CLONES
static inline void kvm__attn_scores_direct_f16(const float *q, const uint16_t *kh, int64_t vis, int d, float scale,
                                               float *p)
{
    kvm__attn_scores_body(q, NULL, kh, vis, d, scale, p);
}

/* −Σ p ln p over row[0, n) in double (zeros skipped), a log per weight: the formula the
 * per-layer kernel used before it took the entropy from its softmax pass
 * (kvm_fb_entropy_finish), kept in the per-head reference (kvm_cpu_attn_ref.c), which
 * tests/check_attn_layer.c checks the per-layer kernel's entropies against (1e-5 nats). */
static inline float kvm__attn_entropy(const float *row, int64_t n)
{
    double h = 0.0;
    for (int64_t e = 0; e < n; e++)
        if (row[e] > 0.0f) h -= (double)row[e] * log((double)row[e]);
    return (float)h;
}

#endif
