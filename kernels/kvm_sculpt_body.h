/* kvm_sculpt_body.h: the per-element and per-query math of the KVSculpt loss and gradient
 * (arXiv 2603.27819 §3), written once as inline functions that cc compiles into the CPU
 * backend's row loops (kernels/cpu/kvm_cpu_sculpt.c) and nvcc compiles as device code
 * (KVM_HD = __host__ __device__), so the CPU tests run the arithmetic the GPU runs. Every
 * function is pure (no memory but its arguments), float32 unless stated. */
#ifndef KVM_SCULPT_BODY_H
#define KVM_SCULPT_BODY_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kvm_hd.h"

#define KVM_SB_NO_LSE (-1e30f) /* log-sum-exp of an empty set */

/* exp(x) for x ≤ 88 (clamped below at −87): 2^n · e^(f·ln2), f ∈ [−½, ½], degree-6 Taylor;
 * branch-free so loops over it vectorise. Relative error < 2e-7. */
static inline KVM_HD float kvm_sb_expf(float x)
{
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float r = (t + 12582912.0f) - 12582912.0f; /* round to nearest integer */
    float f = (t - r) * 0.693147180559945309f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    int32_t bits = ((int32_t)r + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

/* ln z for a normal float z > 0 (the softmax sums it is used on are ≥ 1): z = 2^e·m with
 * m ∈ [√½, √2), ln m = 2·atanh(s) = 2s + 2s·(s²/3 + s⁴/5 + s⁶/7 + s⁸/9), s = (m − 1)/(m + 1)
 * (|s| ≤ 0.172: truncation < 3e-9), e·ln2 in two parts. Branch-free, so loops over it vectorise
 * (kernels/cpu's v16_logf is it lanewise); within 3 ulp of the C library's logf (2 measured). */
static inline KVM_HD float kvm_sb_logf(float z)
{
    int32_t bits, mb;
    memcpy(&bits, &z, sizeof bits);
    int32_t e = ((bits >> 23) & 255) - 127;
    mb = (bits & 0x7fffff) | 0x3f800000;
    float m;
    memcpy(&m, &mb, sizeof m);
    const int32_t big = m > 1.41421356f;
    m = big ? m * 0.5f : m;
    e += big;
    const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    const float q = s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9))));
    const float ef = (float)e;
    return ef * 0.693145751953125f + ((2.0f * s + 2.0f * s * q) + ef * 1.42860677e-6f);
}

/* One query's shares of the whole softmax between its distilled entries and its visible retain
 * entries: pc, pr from lc = LSE over the distilled entries (KVM_SB_NO_LSE when k = 0), lr = LSE
 * over the visible retain entries, has_c = any distilled entry, has_r = any visible. The larger
 * of the two is exp(0) = 1 exactly: one exponential (kvm_sb_expf) instead of two. */
static inline KVM_HD void kvm_sb_shares(float lc, float lr, int has_c, int has_r, float *pc, float *pr)
{
    const int gt = lc > lr;
    const float mm = gt ? lc : lr, e = kvm_sb_expf(gt ? lr - mm : lc - mm);
    const float ac = has_c ? (gt ? 1.0f : e) : 0.0f, ar = has_r ? (gt ? e : 1.0f) : 0.0f;
    const float zz = ac + ar;
    *pc = zz > 0 ? ac / zz : 0.0f;
    *pr = zz > 0 ? ar / zz : 0.0f;
}

/* One query's LSE-matching terms: dl = lc − lz (lz = the full compress zone's LSE, nats; 0 when
 * no zone or no distilled entry) and its weight wz (1, or the zone's share σ(lz − lr) when
 * mass_w and a retain entry is visible), in float64. */
static inline KVM_HD void kvm_sb_lse_terms(float lc, float lr, int has_c, int has_r, float lz, int has_zone,
                                           int mass_w, double *dl, double *wz)
{
    *dl = 0;
    *wz = 1;
    if (has_c && has_zone) {
        *dl = (double)lc - lz;
        if (mass_w && has_r) *wz = 1.0 / (1.0 + exp((double)lr - lz));
    }
}

/* One query's scalars after its distilled softmax (kvm_sb_shares and kvm_sb_lse_terms): the
 * shares pc, pr of the distilled and retain parts of the whole softmax, dl and its weight wz. */
typedef struct kvm_sb_query {
    float pc, pr;
    double dl, wz;
} kvm_sb_query;

static inline KVM_HD kvm_sb_query kvm_sb_query_shares(float lc, float lr, int has_c, int has_r, float lz, int has_zone,
                                                      int mass_w)
{
    kvm_sb_query s;
    kvm_sb_shares(lc, lr, has_c, has_r, &s.pc, &s.pr);
    kvm_sb_lse_terms(lc, lr, has_c, has_r, lz, has_zone, mass_w, &s.dl, &s.wz);
    return s;
}

/* Output error of one element: Ô = pc·ôc + pr·o_ret, returns Ô − O and stores Ô in *oh. */
static inline KVM_HD float kvm_sb_out_err(float pc, float ohc, float pr, float o_ret, float o_full, float *oh)
{
    *oh = pc * ohc + pr * o_ret;
    return *oh - o_full;
}

/* ∂L/∂score of one (query, entry): w·(b1·(e·v − ⟨Ô, e⟩) + b2), with ev = Σ_t e_t v_jt,
 * oe = Σ_t Ô_t e_t, b1 = 2·pc/(nq·out_ms), b2 = 2λ·wz·dl/nq. */
static inline KVM_HD float kvm_sb_dscore(float w, float ev, float oe, float b1, float b2)
{
    return w * (b1 * (ev - oe) + b2);
}

#endif
