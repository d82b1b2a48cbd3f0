/* sculpt_problem.c: builds one KVSculpt problem (layer, KV head): the training queries (real
 * retain-zone queries of the GQA group + synthetic future queries re-RoPE'd at future
 * positions) and the full-cache references the loss compares against (KVSculpt §3). */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NO_LSE (-1e30f)

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

/* log Σ exp(s_j) of scores sc[0..n) in float64, or NO_LSE when n == 0; w[j] gets exp(s_j − lse). */
static double lse_softmax(double *sc, int64_t n)
{
    if (n == 0) return NO_LSE;
    double mx = sc[0];
    for (int64_t j = 1; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
    double z = 0;
    for (int64_t j = 0; j < n; j++) z += exp(sc[j] - mx);
    double l = mx + log(z);
    for (int64_t j = 0; j < n; j++) sc[j] = exp(sc[j] - l);
    return l;
}

/* float rows [n][d] -> new double copy (NULL on n == 0 is fine: never read). */
static double *to_double(const float *x, int64_t n, int d)
{
    double *y = malloc((size_t)(n > 0 ? n * d : 1) * sizeof *y);
    if (y)
        for (int64_t i = 0; i < n * d; i++) y[i] = x[i];
    return y;
}

enum { QB = 64 }; /* queries per block: scores and outputs of a block are two float64 GEMMs each */

/* Scores of nb queries qd[nb][d] against keys kd[n][d] into S[nb][n] (scaled), or nothing when n == 0. */
static void block_scores(const double *qd, int nb, const double *kd, int64_t n, int d, double scale, double *S)
{
    if (n > 0)
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, (int)n, d, scale, qd, d, kd, d, 0.0, S, (int)n);
}

/* O[nb][d] = P[nb][n] · V[n][d], zeros when n == 0. */
static void block_out(const double *P, int nb, const double *vd, int64_t n, int d, double *O)
{
    if (n > 0) cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, d, (int)n, 1.0, P, (int)n, vd, d, 0.0, O, d);
    else memset(O, 0, (size_t)nb * d * sizeof *O);
}

int kvm_sculpt_problem_prepare(kvm_sculpt_problem *p)
{
    const int d = p->d;
    const int64_t nc = p->nc, m = p->m, nq = p->nq;
    p->o_full = malloc((size_t)(nq * d) * sizeof *p->o_full);
    p->o_ret = malloc((size_t)(nq * d) * sizeof *p->o_ret);
    p->lse_zone = malloc((size_t)nq * sizeof *p->lse_zone);
    p->lse_ret = malloc((size_t)nq * sizeof *p->lse_ret);
    p->mass = calloc((size_t)(nc > 0 ? nc : 1), sizeof *p->mass);
    double *kzd = to_double(p->kz, nc, d), *vzd = to_double(p->vz, nc, d), *krd = to_double(p->kr, m, d);
    double *vrd = to_double(p->vr, m, d), *qd = malloc((size_t)QB * d * sizeof *qd);
    double *S = malloc((size_t)QB * (nc > 0 ? nc : 1) * sizeof *S), *R = malloc((size_t)QB * (m > 0 ? m : 1) * sizeof *R);
    double *OZ = malloc((size_t)QB * d * sizeof *OZ), *OR = malloc((size_t)QB * d * sizeof *OR);
    double *mass = calloc((size_t)(nc > 0 ? nc : 1), sizeof *mass);
    int rc = 0;
    if (!p->o_full || !p->o_ret || !p->lse_zone || !p->lse_ret || !p->mass || !kzd || !vzd || !krd || !vrd || !qd ||
        !S || !R || !OZ || !OR || !mass) {
        rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory for %lld training queries", (long long)nq);
        goto done;
    }
    int64_t mass_q1 = p->nq_real > 0 ? p->nq_real : nq;
    double ms = 0;
    for (int64_t i0 = 0; i0 < nq; i0 += QB) {
        int nb = nq - i0 < QB ? (int)(nq - i0) : QB;
        for (int64_t x = 0; x < (int64_t)nb * d; x++) qd[x] = p->q[i0 * d + x];
        block_scores(qd, nb, kzd, nc, d, p->scale, S);
        block_scores(qd, nb, krd, m, d, p->scale, R);
        double lz[QB], lr[QB];
        for (int b = 0; b < nb; b++) { /* retain entries beyond the causal prefix get weight 0 */
            int64_t nv = p->n_vis[i0 + b];
            lz[b] = lse_softmax(S + (int64_t)b * nc, nc);
            lr[b] = lse_softmax(R + (int64_t)b * m, nv);
            for (int64_t j = nv; j < m; j++) R[(int64_t)b * m + j] = 0;
        }
        block_out(S, nb, vzd, nc, d, OZ);
        block_out(R, nb, vrd, m, d, OR);
        for (int b = 0; b < nb; b++) {
            int64_t i = i0 + b, nv = p->n_vis[i];
            double mx = lz[b] > lr[b] ? lz[b] : lr[b];
            double az = nc > 0 ? exp(lz[b] - mx) : 0, ar = nv > 0 ? exp(lr[b] - mx) : 0;
            double zt = az + ar, pz = zt > 0 ? az / zt : 0, pr = zt > 0 ? ar / zt : 0; /* nothing visible: output 0 */
            double on = 0;
            for (int t = 0; t < d; t++) {
                double o = pz * OZ[b * d + t] + pr * OR[b * d + t];
                p->o_full[i * d + t] = (float)o;
                p->o_ret[i * d + t] = (float)OR[b * d + t];
                on += o * o;
            }
            ms += on;
            p->lse_zone[i] = nc > 0 ? (float)lz[b] : NO_LSE;
            p->lse_ret[i] = nv > 0 ? (float)lr[b] : NO_LSE;
            if (i < mass_q1)
                for (int64_t j = 0; j < nc; j++) mass[j] += pz * S[(int64_t)b * nc + j];
        }
    }
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
    free(kzd);
    free(vzd);
    free(krd);
    free(vrd);
    free(qd);
    free(S);
    free(R);
    free(OZ);
    free(OR);
    free(mass);
    return rc;
}

int kvm_sculpt_problem_build(const kvm_model_config *c, const kvm_capture *cap, int layer, int kv_head,
                             int64_t m, int64_t n_synth, int64_t future_tokens, uint64_t seed,
                             kvm_sculpt_problem *p)
{
    memset(p, 0, sizeof *p);
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
    p->nq = p->nq_real + n_synth;
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
        kvm_rope_table(pos, n_synth, d, c->rope_theta, cs, sn);
        kvm_kernels_cpu()->rope(p->q + p->nq_real * d, n_synth, d, 1, d, cs, sn, c->rope_style);
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
