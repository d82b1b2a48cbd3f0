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

/* One query's scalars after its distilled softmax: the shares of the distilled and retain
 * parts of the whole softmax and the LSE-matching terms. Inputs: lc = LSE over the distilled
 * entries (KVM_SB_NO_LSE when k = 0), lr = LSE over its visible retain entries, has_r = any
 * visible, lz = the full compress zone's LSE (nats), nc > 0, mass_w = 1 to weight the LSE error
 * by the zone's share σ(lz − lr). Outputs pc, pr (shares), dl = lc − lz (0 when no zone or no
 * distilled entry), wz (its weight). */
typedef struct kvm_sb_query {
    float pc, pr;
    double dl, wz;
} kvm_sb_query;

static inline KVM_HD kvm_sb_query kvm_sb_query_shares(float lc, float lr, int has_c, int has_r, float lz, int has_zone,
                                                      int mass_w)
{
    kvm_sb_query s;
    float mm = lc > lr ? lc : lr;
    /* the larger of the two is exp(0) = 1 exactly: one exponential instead of two */
    float ac = has_c ? (lc > lr ? 1.0f : expf(lc - mm)) : 0.0f, ar = has_r ? (lc > lr ? expf(lr - mm) : 1.0f) : 0.0f;
    float zz = ac + ar;
    s.pc = zz > 0 ? ac / zz : 0.0f;
    s.pr = zz > 0 ? ar / zz : 0.0f;
    s.dl = 0;
    s.wz = 1;
    if (has_c && has_zone) {
        s.dl = (double)lc - lz;
        if (mass_w && has_r) s.wz = 1.0 / (1.0 + exp((double)lr - lz));
    }
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
