/* sculpt_loss.c: the reference KVSculpt loss (one query at a time; kept as the test oracle of
 * the blocked kernel, kernels/kvm_sculpt_kernels.h) (arXiv 2603.27819 §3) over the training queries of one
 * problem — normalised attention-output MSE + λ·LSE matching — and its analytic gradient with
 * respect to the distilled keys and logit biases. Inner loops run over entries j with keys and
 * values transposed ([d][k]) so they vectorise; compiled for AVX-512/AVX2/baseline. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3") /* the Makefile builds compress/ at -O2, whose cost model skips these loops */
#endif
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "kernels/kvm_sculpt_body.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SCULPT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SCULPT_CLONES
#endif

#define NO_LSE (-1e30f)

/* exp is kvm_sb_expf (kernels/kvm_sculpt_body.h), the function the blocked kernels use. */

/* Entries are padded to a multiple of B = 16 (padding: score −1e30, value 0) and every loop over
 * entries runs in whole blocks with B independent lanes, so the compiler vectorises them without
 * tails (strict IEEE order would otherwise forbid vectorising the reductions: no -ffast-math). */
#define B 16
#define FOR_BLOCKS(j, n) for (int64_t j##0 = 0; j##0 < (n); j##0 += B) for (int64_t j = j##0; j < j##0 + B; j++)

/* Sum of the B lanes as a tree (4 dependent steps instead of B). Destroys acc. */
static inline float lanes_sum(float *acc)
{
    for (int h = B / 2; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) acc[l] += acc[l + h];
    return acc[0];
}

/* Scratch of one loss evaluation. kp = k rounded up to B. */
typedef struct loss_work {
    int64_t kp;
    float *kt, *vt, *gt; /* [d][kp] transposed keys, values; [d + 1][kp] key gradient, then ∂L/∂β */
    float *b0;           /* [kp] biases (−1e30 on padding) */
    float *w;            /* [kp] the current query's softmax within the distilled entries */
    float *U;            /* [nq][kp] ∂L/∂score of every query (for the gradient's Qᵀ·U) */
} loss_work;

/* B floats as one GCC vector (split into the widest registers the clone has); loads and stores
 * go through memcpy so arrays need no particular alignment. */
typedef float v16 __attribute__((vector_size(B * sizeof(float))));
#define VLOAD(v, p) memcpy(&(v), (p), sizeof(v16))
#define VSTORE(p, v) memcpy((p), &(v), sizeof(v16))

/* out[j] = init[j] (or init_c) + Σ_t xs·x[t]·m[t][j] for j in [0, kp): one register block of B
 * entries at a time, accumulated over t (a GEMM row with inner dimension d). */
static inline void row_times(const float *restrict x, const float *restrict m, int d, int64_t kp, float xs,
                             const float *restrict init, float init_c, float *restrict out)
{
    for (int64_t j0 = 0; j0 < kp; j0 += B) {
        v16 a = (v16){0} + init_c, mt;
        if (init) VLOAD(a, init + j0);
        for (int t = 0; t < d; t++) {
            VLOAD(mt, m + (int64_t)t * kp + j0);
            a += (x[t] * xs) * mt;
        }
        VSTORE(out + j0, a);
    }
}

/* gt[t][j] = xs · Σ_i q[i][t]·U[i][j]: blocks of 8 rows t × B entries j kept in registers. */
static inline void qt_times_u(const float *restrict q, const float *restrict U, int64_t nq, int d, int64_t kp,
                              float xs, float *restrict gt)
{
    for (int t0 = 0; t0 < d; t0 += 8) {
        const int nt = d - t0 < 8 ? d - t0 : 8;
        for (int64_t j0 = 0; j0 < kp; j0 += B) {
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
            for (int64_t i = 0; i < nq; i++) {
                v16 u;
                VLOAD(u, U + i * kp + j0);
                const float *qi = q + i * d + t0;
                a0 += qi[0] * u;
                if (nt > 1) a1 += qi[1] * u;
                if (nt > 2) a2 += qi[2] * u;
                if (nt > 3) a3 += qi[3] * u;
                if (nt > 4) a4 += qi[4] * u;
                if (nt > 5) a5 += qi[5] * u;
                if (nt > 6) a6 += qi[6] * u;
                if (nt > 7) a7 += qi[7] * u;
            }
            v16 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
            for (int t = 0; t < nt; t++) {
                v16 g = xs * acc[t];
                VSTORE(gt + (int64_t)(t0 + t) * kp + j0, g);
            }
        }
    }
}

SCULPT_CLONES
static double loss_core(const kvm_sculpt_problem *p, int64_t k, double lambda, int want_grad, loss_work *wk,
                        double *mse_sum, double *lse_sum)
{
    const int d = p->d;
    const int64_t kp = wk->kp, nq = p->nq;
    const double a1 = 2.0 / ((double)nq * p->out_ms), a2 = 2.0 * lambda / (double)nq;
    float *restrict w = wk->w, *restrict gb = wk->gt + (int64_t)d * kp;
    const float *restrict kt = wk->kt, *restrict vt = wk->vt;
    float oh[512], e[512], acc[B];
    double mse = 0, lse = 0;
    if (want_grad) memset(gb, 0, (size_t)kp * sizeof *gb);
    for (int64_t i = 0; i < nq; i++) {
        const float *restrict q = p->q + i * d;
        float lc = NO_LSE;
        if (k > 0) {
            row_times(q, kt, d, kp, p->scale, wk->b0, 0, w);
            for (int l = 0; l < B; l++) acc[l] = w[l];
            FOR_BLOCKS(j, kp) acc[j - j0] = w[j] > acc[j - j0] ? w[j] : acc[j - j0];
            float mx = acc[0];
            for (int l = 1; l < B; l++) mx = acc[l] > mx ? acc[l] : mx;
            for (int l = 0; l < B; l++) acc[l] = 0;
            FOR_BLOCKS(j, kp) {
                w[j] = kvm_sb_expf(w[j] - mx);
                acc[j - j0] += w[j];
            }
            const float z = lanes_sum(acc), iz = 1.0f / z;
            FOR_BLOCKS(j, kp) w[j] *= iz;
            lc = mx + logf(z);
        }
        const float lr = p->lse_ret[i];
        const int has_r = p->n_vis[i] > 0;
        float mm = lc > lr ? lc : lr;
        float ac = k > 0 ? expf(lc - mm) : 0.0f, ar = has_r ? expf(lr - mm) : 0.0f;
        float zz = ac + ar, pc = zz > 0 ? ac / zz : 0.0f, pr = zz > 0 ? ar / zz : 0.0f;
        const float *o = p->o_full + i * d, *orr = p->o_ret + i * d;
        double ei = 0;
        for (int t = 0; t < d; t++) {
            const float *restrict vr = vt + (int64_t)t * kp;
            for (int l = 0; l < B; l++) acc[l] = 0;
            if (k > 0) FOR_BLOCKS(j, kp) acc[j - j0] += w[j] * vr[j];
            oh[t] = pc * lanes_sum(acc) + pr * orr[t];
            e[t] = oh[t] - o[t];
            ei += (double)e[t] * e[t];
        }
        mse += ei;
        double dl = 0, wz = 1;
        if (k > 0 && p->nc > 0) {
            dl = (double)lc - p->lse_zone[i];
            if (p->lse_mass_weight && has_r) /* weight by the zone's share of the full attention */
                wz = 1.0 / (1.0 + exp((double)lr - p->lse_zone[i]));
            lse += wz * dl * dl;
        }
        if (!want_grad || k == 0) continue;
        float oe = 0;
        for (int t = 0; t < d; t++) oe += oh[t] * e[t];
        float *restrict u = wk->U + i * kp;
        row_times(e, vt, d, kp, 1.0f, NULL, -oe, u);
        const float b1 = (float)(a1 * pc), b2 = (float)(a2 * wz * dl);
        FOR_BLOCKS(j, kp) {
            u[j] = w[j] * (b1 * u[j] + b2); /* ∂L/∂score_ij */
            gb[j] += u[j];
        }
    }
    if (want_grad && k > 0) qt_times_u(p->q, wk->U, nq, d, kp, p->scale, wk->gt);
    *mse_sum = mse;
    *lse_sum = lse;
    return mse / ((double)nq * p->out_ms) + lambda * lse / (double)nq;
}

double kvm_sculpt_loss_ref(const kvm_sculpt_problem *p, const float *kc, const float *vc, const float *beta,
                       int64_t k, double lambda, float *grad_k, float *grad_b, double *mse, double *lse_part)
{
    const int d = p->d;
    if (d > 512 || k < 0) return NAN;
    const int64_t kp = k > 0 ? (k + B - 1) / B * B : B;
    loss_work wk = {.kp = kp};
    const size_t nq = (size_t)p->nq;
    const int grad = grad_k != NULL || grad_b != NULL;
    float *buf = calloc((size_t)kp * (size_t)(3 * d + 3) + (grad ? nq * (size_t)kp : 0), sizeof *buf);
    if (!buf) return NAN;
    wk.kt = buf;
    wk.vt = wk.kt + kp * d;
    wk.gt = wk.vt + kp * d;
    wk.b0 = wk.gt + kp * (d + 1);
    wk.w = wk.b0 + kp;
    wk.U = wk.w + kp;
    for (int64_t j = 0; j < kp; j++) wk.b0[j] = j < k ? (beta ? beta[j] : 0.0f) : -1e30f;
    for (int64_t j = 0; j < k; j++)
        for (int t = 0; t < d; t++) {
            wk.kt[t * kp + j] = kc[j * d + t];
            wk.vt[t * kp + j] = vc[j * d + t];
        }
    double ms, ls;
    double L = loss_core(p, k, lambda, grad_k != NULL || grad_b != NULL, &wk, &ms, &ls);
    if (grad_k)
        for (int64_t j = 0; j < k; j++)
            for (int t = 0; t < d; t++) grad_k[j * d + t] = wk.gt[t * kp + j];
    if (grad_b)
        for (int64_t j = 0; j < k; j++) grad_b[j] = wk.gt[d * kp + j];
    if (mse) *mse = ms / (double)p->nq;
    if (lse_part) *lse_part = lambda * ls / (double)p->nq;
    free(buf);
    return L;
}
