/* sculpt_problem.c: builds one KVSculpt problem (layer, KV head): the training queries (real
 * retain-zone queries of the GQA group + synthetic future queries re-RoPE'd at future
 * positions) and the full-cache references the loss compares against (KVSculpt §3). */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "common/kvm_error.h"
#include "kernels/kvm_sculpt_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>


static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform integer in [0, n), n > 0. */
static int64_t rand_below(uint64_t *s, int64_t n) { return (int64_t)(splitmix64(s) % (uint64_t)n); }

void kvm_sculpt_problem_free(kvm_sculpt_problem *p)
{
    if (!p) return;
    free(p->q);
    free(p->n_vis);
    free(p->o_full);
    free(p->o_ret);
    free(p->lse_zone);
    free(p->lse_ret);
    free(p->mass);
    memset(p, 0, sizeof *p);
}

int kvm_sculpt_problem_prepare(kvm_sculpt_problem *p)
{
    const int d = p->d;
    const int64_t nc = p->nc, nq = p->nq;
    p->o_full = malloc((size_t)(nq * d) * sizeof *p->o_full);
    p->o_ret = malloc((size_t)(nq * d) * sizeof *p->o_ret);
    p->lse_zone = malloc((size_t)nq * sizeof *p->lse_zone);
    p->lse_ret = malloc((size_t)nq * sizeof *p->lse_ret);
    p->mass = calloc((size_t)(nc > 0 ? nc : 1), sizeof *p->mass);
    double *mass = calloc((size_t)(nc > 0 ? nc : 1), sizeof *mass);
    int rc = 0;
    if (!p->o_full || !p->o_ret || !p->lse_zone || !p->lse_ret || !p->mass || !mass) {
        rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory for %lld training queries", (long long)nq);
        goto done;
    }
    /* the references by the backend's blocked float32 GEMMs and row kernels (sums in float64) */
    kvm_sculpt_refs_in in = {.d = d, .scale = p->scale, .nq = nq, .nc = nc, .m = p->m,
                             .n_mass = p->nq_real + p->nq_model > 0 ? p->nq_real + p->nq_model : nq, .q = p->q, .kz = p->kz, .vz = p->vz,
                             .kr = p->kr, .vr = p->vr, .n_vis = p->n_vis};
    double ms = 0;
    if ((rc = kvm_cpu_sculpt_refs(&in, p->o_full, p->o_ret, p->lse_zone, p->lse_ret, mass, &ms))) goto done;
    for (int64_t j = 0; j < nc; j++) p->mass[j] = (float)mass[j];
    p->out_ms = nq > 0 ? ms / (double)nq : 0;
    if (!(p->out_ms > 1e-30)) p->out_ms = 1e-30; /* all-zero outputs: avoid 0/0 */
    float vmax = 0, kmax = 0;
    for (int64_t j = 0; j < nc; j++) {
        double n2 = 0, k2 = 0;
        for (int t = 0; t < d; t++) {
            n2 += (double)p->vz[j * d + t] * p->vz[j * d + t];
            k2 += (double)p->kz[j * d + t] * p->kz[j * d + t];
        }
        vmax = fmaxf(vmax, (float)sqrt(n2));
        kmax = fmaxf(kmax, (float)sqrt(k2));
    }
    p->vnorm_max = vmax;
    p->knorm_max = kmax;
done:
    free(mass);
    return rc;
}

int kvm_sculpt_problem_build(const kvm_model_config *c, const kvm_capture *cap, int layer, int kv_head,
                             int64_t m, int64_t n_synth, int64_t future_tokens, uint64_t seed,
                             kvm_sculpt_problem *p)
{
    return kvm_sculpt_problem_build_mixed(c, cap, layer, kv_head, m, n_synth, future_tokens, seed, NULL, NULL, p);
}

/* Appends n model queries of set (source src) for KV head kv_head at p->q + *i (stratified). */
static void add_model_queries(const kvm_model_config *c, const kvm_sculpt_qset *set, int src, int layer, int kv_head,
                              int64_t n, uint64_t seed, kvm_sculpt_problem *p, int64_t *i)
{
    const int d = c->head_dim, H = c->n_heads, group = c->n_heads / c->n_kv_heads;
    const int64_t pairs = (int64_t)group * set->n;
    uint64_t st = seed ^ (0x632BE59BD9B4E019ull * (uint64_t)(layer + 1)) ^ (0x8CB92BA72F3D8DD7ull * (uint64_t)(kv_head + 1)) ^
                  (0xD6E8FEB86659FD93ull * (uint64_t)(src + 1));
    splitmix64(&st);
    const float *base = set->q + (size_t)layer * (size_t)H * (size_t)set->n * (size_t)d;
    for (int64_t s = 0; s < n; s++, (*i)++) {
        double u = (double)(splitmix64(&st) >> 11) * 0x1.0p-53;
        int64_t j = (int64_t)(((double)s + u) * (double)pairs / (double)n);
        if (j >= pairs) j = pairs - 1;
        int64_t t = j / group;
        int g = (int)(j % group);
        memcpy(p->q + *i * d, base + ((size_t)(kv_head * group + g) * (size_t)set->n + (size_t)t) * (size_t)d,
               (size_t)d * sizeof *p->q);
        p->n_vis[*i] = p->m;
    }
}

int kvm_sculpt_problem_build_mixed(const kvm_model_config *c, const kvm_capture *cap, int layer, int kv_head,
                                   int64_t m, int64_t n_synth, int64_t future_tokens, uint64_t seed,
                                   const kvm_sculpt_qsets *qs, const int64_t *n_model, kvm_sculpt_problem *p)
{
    memset(p, 0, sizeof *p);
    int64_t n_mod = 0;
    for (int s = KVM_SCULPT_QSRC_REPEAT; n_model && s < KVM_SCULPT_QSRC_COUNT; s++) {
        if (n_model[s] < 0) return kvm_err(KVM_EINVAL, "sculpt: %lld model queries", (long long)n_model[s]);
        if (n_model[s] > 0 && (!qs || qs->set[s].n < 1 || !qs->set[s].q))
            return kvm_err(KVM_EINVAL, "sculpt: query source %d has no captured queries", s);
        n_mod += n_model[s];
    }
    const int64_t N = kvm_capture_n_tokens(cap);
    const int d = c->head_dim, group = c->n_heads / c->n_kv_heads;
    const kvm_capture_layer *L = kvm_capture_layer_get(cap, layer);
    if (m < 0 || m > N) return kvm_err(KVM_EINVAL, "sculpt: retain zone %lld not in [0, N=%lld]", (long long)m, (long long)N);
    if (n_synth < 0) return kvm_err(KVM_EINVAL, "sculpt: synthetic queries %lld < 0", (long long)n_synth);
    if (!L->q || !L->q_pre) return kvm_err(KVM_EINVAL, "sculpt: the capture has no queries (want_queries = 0)");
    if (future_tokens < 1) future_tokens = 1;
    p->d = d;
    p->scale = 1.0f / sqrtf((float)d);
    p->nc = N - m;
    p->m = m;
    p->kz = L->k + (size_t)kv_head * (size_t)N * (size_t)d;
    p->vz = L->v + (size_t)kv_head * (size_t)N * (size_t)d;
    p->kr = p->kz + (size_t)p->nc * (size_t)d;
    p->vr = p->vz + (size_t)p->nc * (size_t)d;
    p->nq_real = (int64_t)group * m;
    p->nq_model = n_mod;
    p->nq = p->nq_real + n_mod + n_synth;
    if (p->nq == 0) return kvm_err(KVM_EINVAL, "sculpt: no training queries (retain zone and synthetic queries both empty)");
    int rc = KVM_ENOMEM;
    float *cs = NULL, *sn = NULL;
    int32_t *pos = NULL;
    p->q = malloc((size_t)(p->nq * d) * sizeof *p->q);
    p->n_vis = malloc((size_t)p->nq * sizeof *p->n_vis);
    if (!p->q || !p->n_vis) goto fail;
    int64_t i = 0;
    for (int g = 0; g < group; g++) {
        const float *qh = L->q + ((size_t)(kv_head * group + g) * (size_t)N) * (size_t)d;
        for (int64_t t = N - m; t < N; t++, i++) {
            memcpy(p->q + i * d, qh + t * d, (size_t)d * sizeof *p->q);
            p->n_vis[i] = t - (N - m) + 1;
        }
    }
    for (int s = KVM_SCULPT_QSRC_REPEAT; n_mod > 0 && s < KVM_SCULPT_QSRC_COUNT; s++)
        if (n_model[s] > 0) add_model_queries(c, &qs->set[s], s, layer, kv_head, n_model[s], seed, p, &i);
    if (n_synth > 0) {
        cs = malloc((size_t)(n_synth * (d / 2)) * sizeof *cs);
        sn = malloc((size_t)(n_synth * (d / 2)) * sizeof *sn);
        pos = malloc((size_t)n_synth * sizeof *pos);
        if (!cs || !sn || !pos) goto fail;
        uint64_t st = seed ^ (0x632BE59BD9B4E019ull * (uint64_t)(layer + 1)) ^ (0x8CB92BA72F3D8DD7ull * (uint64_t)(kv_head + 1));
        splitmix64(&st);
        for (int64_t s = 0; s < n_synth; s++, i++) {
            int64_t t = rand_below(&st, N);
            int g = (int)rand_below(&st, group);
            const float *src = L->q_pre + (((size_t)(kv_head * group + g) * (size_t)N) + (size_t)t) * (size_t)d;
            memcpy(p->q + i * d, src, (size_t)d * sizeof *p->q);
            int64_t ps = N + (s * future_tokens) / n_synth;
            pos[s] = ps > INT32_MAX ? INT32_MAX : (int32_t)ps;
            p->n_vis[i] = m;
        }
        kvm_model_rope_table(c, pos, n_synth, cs, sn); /* the model's RoPE, llama3 scaling included */
        kvm_kernels_cpu()->rope(p->q + (p->nq_real + n_mod) * d, n_synth, d, 1, d, cs, sn, c->rope_style);
    }
    if ((rc = kvm_sculpt_problem_prepare(p))) goto fail;
    free(cs);
    free(sn);
    free(pos);
    return 0;
fail:
    free(cs);
    free(sn);
    free(pos);
    kvm_sculpt_problem_free(p);
    return rc == KVM_ENOMEM ? kvm_err(KVM_ENOMEM, "sculpt: out of memory building problem (%d, %d)", layer, kv_head) : rc;
}

int kvm_sculpt_select(const kvm_sculpt_problem *p, int64_t k, int64_t *idx)
{
    /* O(k·nc) repeated arg-max: nc is at most the context length, k ≤ nc */
    const int64_t nc = p->nc;
    if (k < 0 || k > nc) return kvm_err(KVM_EINVAL, "sculpt: select %lld of %lld zone tokens", (long long)k, (long long)nc);
    if (k == 0) return 0;
    uint8_t *taken = calloc((size_t)nc, 1);
    if (!taken) return kvm_err(KVM_ENOMEM, "sculpt: out of memory selecting tokens");
    for (int64_t r = 0; r < k; r++) {
        int64_t best = -1;
        for (int64_t j = 0; j < nc; j++)
            if (!taken[j] && (best < 0 || p->mass[j] > p->mass[best])) best = j;
        if (best < 0) break;
        taken[best] = 1;
    }
    int64_t n = 0;
    for (int64_t j = 0; j < nc && n < k; j++)
        if (taken[j]) idx[n++] = j;
    free(taken);
    return 0;
}
