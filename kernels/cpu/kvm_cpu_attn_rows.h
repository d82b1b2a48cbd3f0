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

/* 8 values of a row of V at element offset off: float32 (v), or f16 widened (vh, when v is NULL):
 * by F16C's vcvtph2ps where the including file compiles for x86-64-v3 and sets KVM__ATTN_F16C
 * (kvm_cpu_attn_f16c.c), else by integer operations (kvm__f16_widen8). Both give the exact
 * float32 values (a signalling NaN comes out quiet from vcvtph2ps: the products are NaN alike). */
static inline __attribute__((always_inline)) kvm__v8 kvm__attn_load8(const float *v, const uint16_t *vh, int64_t off)
{
    kvm__v8 x;
    if (v) memcpy(&x, v + off, sizeof x);
#ifdef KVM__ATTN_F16C
    else
        x = (kvm__v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(vh + off)));
#else
    else x = kvm__f16_widen8(vh + off);
#endif
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
        for (int64_t e = 0; e < n; e++)
            acc += p[e] * kvm__attn_load1(v, vh, e * d + c0);
        o[c0] = acc;
    }
}

/* Column c of o = Σ_e p[e] · V[e][c] for the columns past the last multiple of 8, as
 * kvm__attn_pv_body computes them. */
static inline __attribute__((always_inline)) void kvm__attn_pv_tail(const float *p, const float *v, const uint16_t *vh,
                                                                    int64_t n, int d, float *o)
{
    for (int c0 = d / 8 * 8; c0 < d; c0++) {
        float acc = 0.0f;
        for (int64_t e = 0; e < n; e++) acc += p[e] * kvm__attn_load1(v, vh, e * d + c0);
        o[c0] = acc;
    }
}

/* Probability rows one pass over V serves at once: 4 sums of 8 columns per row, 12 with 3
 * rows, meant for AVX2's 16 registers (GCC keeps a few on the stack there, beside the f16
 * widening's constants). */
enum { KVM_ATTN_PV_ROWS = 3 };

/* kvm__attn_pv_body's 8 columns [c0, c0 + 8) for NR (≤ KVM_ATTN_PV_ROWS, a constant) rows
 * p + r·ldp into o + r·ldo: each 8 values of V loaded once for every row, each row with its own
 * four sums (the same operations in the same order per row, so the same bits). */
static inline __attribute__((always_inline)) void kvm__attn_pv_strip_n(const float *p, int64_t ldp, const int NR,
                                                                       const float *v, const uint16_t *vh, int64_t n,
                                                                       int d, int c0, float *o, int64_t ldo)
{
    typedef kvm__v8 v8;
    v8 a[KVM_ATTN_PV_ROWS][4] = {{{0}}}, x;
    int64_t e = 0;
    for (; e + 4 <= n; e += 4)
        for (int u = 0; u < 4; u++) {
            x = kvm__attn_load8(v, vh, (e + u) * d + c0);
            for (int r = 0; r < NR; r++)
                a[r][u] += p[r * ldp + e + u] * x;
        }
    for (; e < n; e++) {
        x = kvm__attn_load8(v, vh, e * d + c0);
        for (int r = 0; r < NR; r++)
            a[r][0] += p[r * ldp + e] * x;
    }
    for (int r = 0; r < NR; r++) {
        v8 sum = (a[r][0] + a[r][1]) + (a[r][2] + a[r][3]);
        memcpy(o + r * ldo + c0, &sum, sizeof sum);
    }
}

/* kvm__attn_pv_body for nr probability rows p + r·ldp into o + r·ldo, the rows of one KV head
 * (GQA): per row and column the same operations, so the same bits, with each strip of V (8
 * columns) read once for up to KVM_ATTN_PV_ROWS rows. */
static inline __attribute__((always_inline)) void kvm__attn_pv_rows_body(const float *p, int64_t ldp, int nr,
                                                                         const float *v, const uint16_t *vh, int64_t n,
                                                                         int d, float *o, int64_t ldo)
{
    for (int r0 = 0; r0 < nr; r0 += KVM_ATTN_PV_ROWS) {
        const float *pr = p + r0 * ldp;
        float *orow = o + r0 * ldo;
        const int rn = nr - r0 < KVM_ATTN_PV_ROWS ? nr - r0 : KVM_ATTN_PV_ROWS;
        for (int c0 = 0; c0 + 8 <= d; c0 += 8)
            switch (rn) {
            case 1:
                kvm__attn_pv_strip_n(pr, ldp, 1, v, vh, n, d, c0, orow, ldo);
                break;
            case 2:
                kvm__attn_pv_strip_n(pr, ldp, 2, v, vh, n, d, c0, orow, ldo);
                break;
            default:
                kvm__attn_pv_strip_n(pr, ldp, 3, v, vh, n, d, c0, orow, ldo);
                break;
            }
    }
    for (int r = 0; r < nr; r++)
        kvm__attn_pv_tail(p + r * ldp, v, vh, n, d, o + r * ldo);
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

/* The 8 × 8 floats r[e][c] transposed in registers: r[c][e] afterwards. */
static inline __attribute__((always_inline)) void kvm__attn_tr8(kvm__v8 r[8])
{
    typedef kvm__v8 v8;
    v8 t[8], u[8];
    for (int i = 0; i < 8; i += 2) { /* rows i, i+1 interleaved: lanes 0 1 of each 128-bit half */
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) { /* four rows' column c in lanes 0-3 and c + 4 in lanes 4-7 */
        u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int c = 0; c < 4; c++) { /* rows 0-3 and 4-7 of columns c and c + 4 */
        r[c] = __builtin_shufflevector(u[c], u[4 + c], 0, 1, 2, 3, 8, 9, 10, 11);
        r[c + 4] = __builtin_shufflevector(u[c], u[4 + c], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* Query rows one pass over the keys serves at once (their sums stay in registers). */
enum { KVM_ATTN_ROWS = 4 };

/* kvm__attn_scores_body for NR (≤ KVM_ATTN_ROWS, a constant) rows q + r·ldq into p + r·ldp,
 * head_dim d a multiple of 8: 8 entries at a time, their keys loaded once as 8 rows of 8 and
 * transposed, so that column c of the 8 entries is one vector multiplied into every row's
 * sums. Each score is the same chain of operations as in kvm__attn_scores_body (0, then
 * + (q[c]·scale)·K[e][c] for c in order), so the same bits. */
static inline __attribute__((always_inline)) void kvm__attn_scores_rows_n(const float *q, int64_t ldq, const int NR,
                                                                          const float *k, const uint16_t *kh,
                                                                          int64_t vis, int d, float scale, float *p,
                                                                          int64_t ldp)
{
    typedef kvm__v8 v8;
    int64_t e0 = 0;
    for (; e0 + 8 <= vis; e0 += 8) {
        v8 acc[KVM_ATTN_ROWS] = {{0}};
        for (int c0 = 0; c0 < d; c0 += 8) {
            v8 col[8];
            for (int e = 0; e < 8; e++)
                col[e] = kvm__attn_load8(k, kh, (e0 + e) * d + c0);
            kvm__attn_tr8(col);
            for (int c = 0; c < 8; c++)
                for (int r = 0; r < NR; r++)
                    acc[r] += (q[r * ldq + c0 + c] * scale) * col[c];
        }
        for (int r = 0; r < NR; r++)
            memcpy(p + r * ldp + e0, &acc[r], sizeof acc[r]);
    }
    if (e0 < vis) /* the last vis % 8 entries as kvm__attn_scores_body runs them (a sum over c as
                     the inner loop would be vectorised as products rounded, then added: not FMAs) */
        for (int r = 0; r < NR; r++)
            kvm__attn_scores_body(q + r * ldq, k ? k + e0 * d : NULL, kh ? kh + e0 * d : NULL, vis - e0, d, scale,
                                  p + r * ldp + e0);
}

/* Scores of nr query rows q + r·ldq (the query heads of one KV head, GQA) against entries
 * [0, vis) of float32 K (k) or f16 K (kh) into p + r·ldp: bit for bit kvm__attn_scores_body
 * row by row, with each key read once for up to KVM_ATTN_ROWS rows (decode). */
static inline __attribute__((always_inline)) void kvm__attn_scores_rows_body(const float *q, int64_t ldq, int nr,
                                                                             const float *k, const uint16_t *kh,
                                                                             int64_t vis, int d, float scale, float *p,
                                                                             int64_t ldp)
{
    if (d % 8) {
        for (int r = 0; r < nr; r++)
            kvm__attn_scores_body(q + r * ldq, k, kh, vis, d, scale, p + r * ldp);
        return;
    }
    for (int r0 = 0; r0 < nr; r0 += KVM_ATTN_ROWS) {
        const float *qr = q + r0 * ldq;
        float *pr = p + r0 * ldp;
        switch (nr - r0 < KVM_ATTN_ROWS ? nr - r0 : KVM_ATTN_ROWS) {
        case 1:
            kvm__attn_scores_rows_n(qr, ldq, 1, k, kh, vis, d, scale, pr, ldp);
            break;
        case 2:
            kvm__attn_scores_rows_n(qr, ldq, 2, k, kh, vis, d, scale, pr, ldp);
            break;
        case 3:
            kvm__attn_scores_rows_n(qr, ldq, 3, k, kh, vis, d, scale, pr, ldp);
            break;
        default:
            kvm__attn_scores_rows_n(qr, ldq, 4, k, kh, vis, d, scale, pr, ldp);
            break;
        }
    }
}

/* Decode's attention for the nr query heads of one KV head (rows q + r·ldq, d apart in a
 * query row): scores into p + r·ldp (kvm__attn_scores_rows_body); the softmax and
 * kvm__attn_pv_rows are the caller's, between. Float32 keys (k) or f16 (kh). */
KVM_CLONES
static inline void kvm__attn_scores_rows(const float *q, int64_t ldq, int nr, const float *k, int64_t vis, int d,
                                         float scale, float *p, int64_t ldp)
{
    kvm__attn_scores_rows_body(q, ldq, nr, k, NULL, vis, d, scale, p, ldp);
}

KVM_CLONES
static inline void kvm__attn_scores_rows_f16(const float *q, int64_t ldq, int nr, const uint16_t *kh, int64_t vis,
                                             int d, float scale, float *p, int64_t ldp)
{
    kvm__attn_scores_rows_body(q, ldq, nr, NULL, kh, vis, d, scale, p, ldp);
}

/* o + r·ldo [0, d) = Σ_e p[r·ldp + e] · V[e] for nr rows over float32 V (v) or f16 V (vh):
 * bit for bit kvm__attn_pv_direct row by row (kvm__attn_pv_rows_body). */
KVM_CLONES
static inline void kvm__attn_pv_rows(const float *p, int64_t ldp, int nr, const float *v, int64_t n, int d, float *o,
                                     int64_t ldo)
{
    kvm__attn_pv_rows_body(p, ldp, nr, v, NULL, n, d, o, ldo);
}

KVM_CLONES
static inline void kvm__attn_pv_rows_f16(const float *p, int64_t ldp, int nr, const uint16_t *vh, int64_t n, int d,
                                         float *o, int64_t ldo)
{
    kvm__attn_pv_rows_body(p, ldp, nr, NULL, vh, n, d, o, ldo);
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
