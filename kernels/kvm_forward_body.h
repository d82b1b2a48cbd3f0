/* kvm_forward_body.h: the per-element and per-row math of the Llama forward (RMSNorm, RoPE in
 * both conventions, SwiGLU, residual add, embedding row, softmax row and the online-softmax
 * update of tiled attention, and the attention statistics compression reads), written once as
 * inline functions that cc compiles into the CPU backend's loops (kernels/cpu/kvm_cpu.c,
 * kvm_cpu_attn.c) and nvcc compiles as device code (KVM_HD = __host__ __device__) for
 * kernels/cuda/, so the CPU tests run the arithmetic the GPU runs (kernels/LAYOUT.md). Every
 * function is pure (no memory but its arguments), float32. */
#ifndef KVM_FORWARD_BODY_H
#define KVM_FORWARD_BODY_H

#include <math.h>
#include <stdint.h>

#include "kernels/kvm_hd.h"

/* exp(x), branch-free so loops over it vectorise (Cephes polynomial, ~2 ulp on [−69, 88]).
 * Results below e^−69 (~1e−30) are flushed to 0: a softmax weight that small changes nothing,
 * but the subnormal products it would feed into the PV product cost ~100 cycles each on CPU.
 * A NaN input gives NaN. */
static inline KVM_HD float kvm_fb_expf(float x)
{
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round_magic = 12582912.0f; /* 1.5 · 2^23: adding it rounds to an integer */
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
    scale.i = (uint32_t)((int32_t)n + 127) << 23; /* unsigned: NaN gives NaN, not undefined behaviour */
    return x_in < -69.0f ? 0.0f : p * scale.f;
}

/* RMSNorm (Zhang & Sennrich 2019, eq. 4): the row's scale 1/sqrt(ss/dim + eps) from its sum of
 * squares ss, then each output element w_i · (inv · x_i). */
static inline KVM_HD float kvm_fb_rms_inv(float ss, int64_t dim, float eps)
{
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

static inline KVM_HD float kvm_fb_rms_elem(float w, float inv, float x) { return w * (inv * x); }

/* RoPE (Su et al. 2021, eq. 34) on pair i of one head vector v[head_dim]: interleaved pairs
 * (2i, 2i+1) or half pairs (i, i + head_dim/2) (kvm_rope_style: 0 interleaved, 1 half), rotated
 * by the angle whose cos/sin are c, s. */
static inline KVM_HD void kvm_fb_rope_pair(float *v, int i, int half, int half_style, float c, float s)
{
    int i0 = half_style ? i : 2 * i, i1 = half_style ? i + half : 2 * i + 1;
    float v0 = v[i0], v1 = v[i1];
    v[i0] = v0 * c - v1 * s;
    v[i1] = v0 * s + v1 * c;
}

/* SwiGLU (Shazeer 2020, eq. 6): silu(g) · u with silu(g) = g / (1 + e^−g). */
static inline KVM_HD float kvm_fb_swiglu(float g, float u) { return g / (1.0f + kvm_fb_expf(-g)) * u; }

/* Residual add. */
static inline KVM_HD float kvm_fb_add(float x, float y) { return x + y; }

/* Embedding row: out[0, dim) = table[tok][0, dim) (token ids checked by the caller). */
static inline KVM_HD void kvm_fb_embed_row(float *out, const float *table, int32_t tok, int64_t dim)
{
    const float *r = table + (int64_t)tok * dim;
    for (int64_t i = 0; i < dim; i++) out[i] = r[i];
}

/* Softmax of row[0, vis) in place (bias[e] added to score e first when bias is not NULL), zero
 * on [vis, width). Returns 1/Σ; the row is scaled by it only when normalize (else the caller
 * scales the attention output, head_dim values rather than vis). */
static inline KVM_HD float kvm_fb_softmax_row(float *row, const float *bias, int64_t vis, int64_t width, int normalize)
{
    float m = -INFINITY, s = 0.0f;
    for (int64_t e = 0; e < vis; e++) {
        if (bias) row[e] += bias[e];
        m = row[e] > m ? row[e] : m;
    }
    for (int64_t e = 0; e < vis; e++) s += row[e] = kvm_fb_expf(row[e] - m);
    float inv = vis > 0 ? 1.0f / s : 0.0f;
    for (int64_t e = 0; normalize && e < vis; e++) row[e] *= inv;
    for (int64_t e = vis; e < width; e++) row[e] = 0.0f;
    return inv;
}

/* Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Alg. 1): the
 * running maximum m and sum l of one query's exponentials over the scores seen so far. Before
 * a tile of scores whose maximum is tile_max, kvm_fb_online_rescale moves m to the new maximum
 * and returns the factor by which l and the output accumulator must be multiplied; each score
 * s of the tile then weighs kvm_fb_expf(s − m) and adds that weight to l. Start with m = −inf,
 * l = 0. The LSE of the scores is m + log l. */
typedef struct kvm_fb_online {
    float m, l;
} kvm_fb_online;

static inline KVM_HD float kvm_fb_online_rescale(kvm_fb_online *st, float tile_max)
{
    if (tile_max <= st->m) return 1.0f;
    float f = st->m == -INFINITY ? 0.0f : kvm_fb_expf(st->m - tile_max);
    st->m = tile_max;
    st->l *= f;
    return f;
}

static inline KVM_HD float kvm_fb_online_weight(kvm_fb_online *st, float s)
{
    float p = kvm_fb_expf(s - st->m);
    st->l += p;
    return p;
}

/* 1/l, the output scale at the end of a query's tiles (0 when no entry was visible). */
static inline KVM_HD float kvm_fb_online_inv(const kvm_fb_online *st) { return st->l > 0 ? 1.0f / st->l : 0.0f; }

/* A row's Shannon entropy H = −Σ p ln p (nats; the ENTROPY statistic compression reads) without
 * a log per weight, from sums the softmax forms anyway (issue 13): for scores s_e, any reference
 * r (the row's maximum on the CPU, its LSE in the CUDA statistics pass), weights x_e = e^(s_e − r),
 * Z = Σ x_e and p_e = x_e / Z, ln p_e = (s_e − r) − ln Z and Σ p = 1 give
 *   H = ln Z − (Σ_e x_e (s_e − r)) / Z.
 * kvm_fb_entropy_acc is one weight's share of that sum, x·t with t = s − r; a weight that is 0
 * (a −inf-masked score, or one kvm_fb_expf flushed) adds 0 rather than 0·(−inf) = NaN.
 * kvm_fb_entropy_finish(Z, Σ x·t) is H, 0 when nothing is visible (Z = 0). */
static inline KVM_HD float kvm_fb_entropy_acc(float x, float t) { return x > 0.0f ? x * t : 0.0f; }

static inline KVM_HD float kvm_fb_entropy_finish(double z, double xt)
{
    return z > 0.0 ? (float)(log(z) - xt / z) : 0.0f;
}

/* Number of entries among pos[0, n) with pos <= p (pos sorted, KVM_POS_NONE = −1 first): the
 * prefix of a ragged cache head that a query at position p sees. */
static inline KVM_HD int64_t kvm_fb_visible(const int32_t *pos, int64_t n, int32_t p)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (pos[mid] <= p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* One attention score: scale·⟨q, k⟩ + bias over d floats. */
static inline KVM_HD float kvm_fb_score(const float *q, const float *k, float scale, float bias, int d)
{
    float dot = 0.0f;
    for (int c = 0; c < d; c++) dot += q[c] * k[c];
    return dot * scale + bias;
}

/* One query's step of tiled attention over a tile of n visible entries (FlashAttention, Dao et
 * al. 2022, Alg. 1, one row): scores s_j = scale·⟨q, k_j⟩ + bias_j into s[0, n), the running state
 * moved to the tile's maximum (acc[0, d) rescaled), then acc += Σ_j e^(s_j − m) v_j. k, v are the
 * tile's rows [n][d] (row stride d); bias is NULL for all zero. After the last tile, the output
 * is acc · kvm_fb_online_inv(st) and the row's LSE is st->m + log st->l. */
static inline KVM_HD void kvm_fb_attn_tile(const float *q, float scale, const float *k, const float *v,
                                           const float *bias, int n, int d, float *s, kvm_fb_online *st,
                                           float *acc)
{
    float tmax = -INFINITY;
    for (int j = 0; j < n; j++) {
        s[j] = kvm_fb_score(q, k + (int64_t)j * d, scale, bias ? bias[j] : 0.0f, d);
        tmax = s[j] > tmax ? s[j] : tmax;
    }
    if (n == 0) return;
    float f = kvm_fb_online_rescale(st, tmax);
    if (f != 1.0f)
        for (int c = 0; c < d; c++) acc[c] *= f;
    for (int j = 0; j < n; j++) {
        float p = kvm_fb_online_weight(st, s[j]);
        for (int c = 0; c < d; c++) acc[c] += p * v[j * d + c];
    }
}

/* Merges the online state and accumulator of a second part (b, acc_b) of the same query's
 * entries into (a, acc_a) (split-entry decode attention, flash-decoding). */
static inline KVM_HD void kvm_fb_online_merge(kvm_fb_online *a, float *acc_a, const kvm_fb_online *b,
                                              const float *acc_b, int d)
{
    if (b->l == 0.0f) return;
    float m = a->m > b->m ? a->m : b->m;
    float fa = a->l > 0.0f ? kvm_fb_expf(a->m - m) : 0.0f, fb = kvm_fb_expf(b->m - m);
    for (int c = 0; c < d; c++) acc_a[c] = acc_a[c] * fa + acc_b[c] * fb;
    a->l = a->l * fa + b->l * fb;
    a->m = m;
}

/* The probability of a score s in a row whose log-sum-exp is lse (the statistics pass, which
 * recomputes scores after the row's LSE is known instead of storing an N×N matrix). */
static inline KVM_HD float kvm_fb_prob(float s, float lse) { return kvm_fb_expf(s - lse); }

#endif
