/* kvm_evict_body.h: the prefill-phase eviction patterns' per-key scores and their top-b order
 * (compress/evict/kvm_evict.h: H2O, TOVA, SnapKV/PyramidKV; StreamingLLM needs no score), and
 * the decode phase's protected zone, victim order and score update (kvm_evict_decode.c),
 * written once as inline functions: the CPU selection (compress/evict/kvm_evict_select.c) calls
 * them key by key and sorts by kvm_eb_before; the CUDA selection (kernels/cuda/kvm_cuda_evict.cu)
 * runs one thread per key over the attention kernel's statistics and keeps the keys whose
 * kvm_eb_rank is below the budget, which is the same set (the order is total: ties go to the
 * earlier key). tests/check_evict_body.c runs the device's order on the CPU. Statistics of one KV
 * head: its n_group query heads' rows, row r of group head g at base + (g·rows_per_head + r)·ld. */
#ifndef KVM_EVICT_BODY_H
#define KVM_EVICT_BODY_H

#include <math.h>
#include <stdint.h>

#include "kernels/kvm_hd.h"

/* H2O (arXiv 2306.14048, §3): key j's attention accumulated over the context's queries, summed
 * over the group's query heads in head order; mass [n_group][ld]. */
static inline KVM_HD float kvm_eb_h2o(const float *mass, int64_t ld, int n_group, int64_t j)
{
    float s = 0;
    for (int g = 0; g < n_group; g++) s += mass[(int64_t)g * ld + j];
    return s;
}

/* TOVA (arXiv 2401.06104, §4): key j's probability under the last query, averaged over the
 * group; obs [n_group][n_obs][ld], the last row of each head read. */
static inline KVM_HD float kvm_eb_tova(const float *obs, int64_t n_obs, int64_t ld, int n_group, int64_t j)
{
    float s = 0;
    for (int g = 0; g < n_group; g++) s += obs[((int64_t)g * n_obs + n_obs - 1) * ld + j];
    return s / (float)n_group;
}

/* SnapKV (arXiv 2404.14469, Alg. 1): key j's votes from the last `rows` of the n_obs
 * observation rows of every group head, summed head by head, row by row. */
static inline KVM_HD float kvm_eb_snap_vote(const float *obs, int64_t n_obs, int64_t rows, int64_t ld, int n_group,
                                            int64_t j)
{
    float s = 0;
    for (int g = 0; g < n_group; g++)
        for (int64_t r = n_obs - rows; r < n_obs; r++) s += obs[((int64_t)g * n_obs + r) * ld + j];
    return s;
}

/* SnapKV's 1-D max pooling of votes vote[0, m) at key j, kernel 2·half + 1 clipped at the ends. */
static inline KVM_HD float kvm_eb_pool(const float *vote, int64_t m, int64_t half, int64_t j)
{
    float best = vote[j];
    for (int64_t t = j - half; t <= j + half; t++)
        if (t >= 0 && t < m && vote[t] > best) best = vote[t];
    return best;
}

/* The top-b order: 1 when key ia with score sa ranks before key ib with sb (higher score first,
 * NaN last, equal scores to the earlier key). A total order over distinct keys. */
static inline KVM_HD int kvm_eb_before(float sa, int64_t ia, float sb, int64_t ib)
{
    const int na = isnan(sa), nb = isnan(sb);
    if (na != nb) return nb;
    if (!na && sa != sb) return sa > sb;
    return ia < ib;
}

/* Key j's place in that order among score[0, m) (0 = first): the device keeps j when it is
 * below the number of keys to choose. */
static inline KVM_HD int64_t kvm_eb_rank(const float *score, int64_t m, int64_t j)
{
    int64_t r = 0;
    for (int64_t i = 0; i < m; i++) r += i != j && kvm_eb_before(score[i], i, score[j], j);
    return r;
}

/* The zones of a scored pattern (1 H2O, 2 TOVA, 3 SnapKV, 4 PyramidKV: kvm_pattern's numbers)
 * for n keys at budget b < n: candidates [0, *m), of which the top *k are kept, and the tail
 * [*tail0, n) always kept (H2O: floor(b · recent_frac) recent keys; SnapKV/PyramidKV: the last
 * min(window, b) keys, the observation window; TOVA: none). */
static inline KVM_HD void kvm_eb_zones(int pattern, double recent_frac, int64_t window, int64_t n, int64_t b,
                                       int64_t *m, int64_t *tail0, int64_t *k)
{
    if (pattern == 1) {
        int64_t r = (int64_t)floor((double)b * recent_frac);
        if (r > b) r = b;
        *m = *tail0 = n - r;
    } else if (pattern == 2) {
        *m = *tail0 = n;
    } else {
        const int64_t w = window < b ? window : b;
        *m = *tail0 = n - w;
    }
    *k = b - (n - *tail0);
}

/* Decode phase (compress/evict/kvm_evict_decode.c): of a head's positioned entries at budget b,
 * how many of the most recent no score evicts: H2O floor(b · recent_frac), TOVA none,
 * SnapKV/PyramidKV min(window, b), the observation window. (StreamingLLM evicts the oldest
 * entry after the sinks, by no score.) */
static inline KVM_HD int64_t kvm_eb_decode_protected(int pattern, double recent_frac, int64_t window, int64_t b)
{
    if (pattern == 1) return (int64_t)floor((double)b * recent_frac);
    if (pattern == 2) return 0;
    return window < b ? window : b;
}

/* The decode victim order: 1 when candidate ia with score sa is evicted before ib with sb (the
 * lower score; equal scores the later entry, so earlier positions are kept; NaN after every
 * number). A total order over distinct entries. */
static inline KVM_HD int kvm_eb_victim_before(float sa, int64_t ia, float sb, int64_t ib)
{
    const int na = isnan(sa), nb = isnan(sb);
    if (na != nb) return nb;
    if (!na && sa != sb) return sa < sb;
    return ia > ib;
}

/* The victim among candidates score[0, m), m ≥ 1: the first in kvm_eb_victim_before's order. */
static inline KVM_HD int64_t kvm_eb_victim(const float *score, int64_t m)
{
    int64_t best = 0;
    for (int64_t i = 1; i < m; i++)
        if (kvm_eb_victim_before(score[i], i, score[best], best)) best = i;
    return best;
}

/* A scored entry's decode score after one attention call of n_q queries (H2O 1, SnapKV 3,
 * PyramidKV 4): SnapKV/PyramidKV first decay it by (1 − 1/window) per query (window > 1: the
 * votes of about the last `window` queries), then the mass entry e received from each of the
 * group's query heads is added in head order; mass [n_group][ld] (the attention kernel's MASS
 * over the call's queries). */
static inline KVM_HD float kvm_eb_decode_score(float s, int pattern, int64_t window, int64_t n_q, const float *mass,
                                               int64_t ld, int n_group, int64_t e)
{
    if (pattern != 1 && window > 1)
        for (int64_t i = 0; i < n_q; i++) s *= 1.0f - 1.0f / (float)window;
    for (int g = 0; g < n_group; g++) s += mass[(int64_t)g * ld + e];
    return s;
}

#endif
