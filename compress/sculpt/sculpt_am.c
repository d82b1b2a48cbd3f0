/* sculpt_am.c: the Attention Matching baseline (Zweiger et al., arXiv 2602.16284 §3) on one
 * KVSculpt problem: original keys chosen by attention mass and orthogonal matching pursuit on the
 * zone's partition function, per-entry logit biases β = log w from non-negative least squares on
 * the attention mass, values by (ridge-regularised) least squares — and the NNLS solver. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"
#include "kernels/kvm_blas.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { AM_OMP_BLOCKS = 4, AM_NNLS_SWEEPS = 300 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int kvm_sculpt_nnls(const double *G, const double *h, int64_t k, double tol, int max_sweeps, double *w)
{
    /* mu = G w − h, the gradient; a coordinate step w_j ← max(0, w_j − mu_j / G_jj) is exact
     * minimisation along j, so the objective never increases (Franc et al. 2005, Alg. 1) */
    double *mu = malloc((size_t)(k > 0 ? k : 1) * sizeof *mu), hmax = 0;
    for (int64_t j = 0; j < k; j++) {
        if (!(w[j] > 0) || !isfinite(w[j])) w[j] = 0;
        hmax = fmax(hmax, fabs(h[j]));
    }
    if (!mu) return 0; /* the start is feasible; the caller's loss shows the cost */
    for (int64_t j = 0; j < k; j++) {
        double s = -h[j];
        for (int64_t t = 0; t < k; t++) s += G[j * k + t] * w[t];
        mu[j] = s;
    }
    const double eps = tol * (hmax > 0 ? hmax : 1);
    int sweep = 0;
    while (sweep < max_sweeps) {
        sweep++;
        for (int64_t j = 0; j < k; j++) {
            double gjj = G[j * k + j];
            if (!(gjj > 0)) continue;
            double nw = w[j] - mu[j] / gjj;
            if (!(nw > 0)) nw = 0; /* also catches NaN */
            double dw = nw - w[j];
            if (dw == 0) continue;
            w[j] = nw;
            const double *gj = G + j * k; /* G symmetric: row j = column j */
            for (int64_t t = 0; t < k; t++) mu[t] += dw * gj[t];
        }
        double viol = 0; /* KKT: mu_j = 0 where w_j > 0, mu_j ≥ 0 where w_j = 0 */
        for (int64_t j = 0; j < k; j++)
            if (G[j * k + j] > 0) viol = fmax(viol, w[j] > 0 ? fabs(mu[j]) : fmax(0, -mu[j]));
        if (viol <= eps) break;
    }
    free(mu);
    for (int64_t j = 0; j < k; j++)
        if (!isfinite(w[j]) || w[j] < 0) w[j] = 0;
    return sweep;
}

/* A[nq][nc] = exp(s·Q·Kzᵀ − LSE_zone): every query's softmax over the compress zone. */
static void zone_softmax(const kvm_sculpt_problem *p, float *A)
{
    const int64_t nq = p->nq, nc = p->nc;
    kvm_blas_lock(); /* one BLAS call at a time: the problems' workers call it concurrently */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nq, (int)nc, p->d, p->scale, p->q, p->d, p->kz, p->d,
                0.0f, A, (int)nc);
    kvm_blas_unlock();
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < nc; j++) A[i * nc + j] = expf(A[i * nc + j] - p->lse_zone[i]);
}

/* w[ns] from NNLS on columns sel[0..ns) of A (target: partition function 1 for every query).
 * AS [nq][ns] and G [ns][ns] are scratch. */
static void fit_mass(const kvm_sculpt_problem *p, const float *A, const int64_t *sel, int64_t ns, float *AS, float *Gf,
                     double *G, double *h, double *w)
{
    const int64_t nq = p->nq, nc = p->nc;
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < ns; j++) AS[i * ns + j] = A[i * nc + sel[j]];
    kvm_blas_lock();
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)ns, (int)nq, 1.0f, AS, (int)ns, 0.0f, Gf, (int)ns);
    kvm_blas_unlock();
    for (int64_t a = 0; a < ns; a++) {
        for (int64_t b = a; b < ns; b++) G[a * ns + b] = G[b * ns + a] = Gf[a * ns + b];
        h[a] = 0;
        w[a] = 1; /* start from the tokens as they are (β = 0): exact when every token is kept */
    }
    for (int64_t i = 0; i < nq; i++) /* row by row (each h[a] still sums over i in order) */
        for (int64_t a = 0; a < ns; a++)
            h[a] += AS[i * ns + a];
    kvm_sculpt_nnls(G, h, ns, 1e-6, AM_NNLS_SWEEPS, w);
}

/* One OMP block: adds the `add` unselected zone tokens whose columns correlate most with the
 * residual of the current fit (ties: lower index). */
static void omp_block(const kvm_sculpt_problem *p, const float *A, const double *cnorm, const int64_t *sel,
                      const double *w, int64_t ns, int64_t add, uint8_t *taken, double *r, double *corr)
{
    const int64_t nq = p->nq, nc = p->nc;
    for (int64_t i = 0; i < nq; i++) {
        double s = 0;
        for (int64_t j = 0; j < ns; j++) s += (double)A[i * nc + sel[j]] * w[j];
        r[i] = 1.0 - s;
    }
    for (int64_t j = 0; j < nc; j++) corr[j] = 0;
    for (int64_t i = 0; i < nq; i++)
        for (int64_t j = 0; j < nc; j++) corr[j] += (double)A[i * nc + j] * r[i];
    for (int64_t a = 0; a < add; a++) {
        int64_t best = -1;
        double bv = 0;
        for (int64_t j = 0; j < nc; j++) {
            if (taken[j]) continue;
            double v = cnorm[j] > 0 ? corr[j] / cnorm[j] : -INFINITY;
            if (best < 0 || v > bv) best = j, bv = v;
        }
        if (best < 0) break;
        taken[best] = 1;
    }
}

int kvm_sculpt_am_head(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, float *kc, float *vc,
                       float *beta, kvm_sculpt_head_stats *st)
{
    memset(st, 0, sizeof *st);
    const int64_t nq = p->nq, nc = p->nc, kk = k > 0 ? k : 1;
    const int d = p->d;
    if (k < 0 || k > nc) return kvm_err(KVM_EINVAL, "am: k = %lld entries but the compress zone has %lld", (long long)k, (long long)nc);
    double t0 = now_s();
    float *A = malloc((size_t)(nq * (nc > 0 ? nc : 1)) * sizeof *A), *AS = malloc((size_t)(nq * kk) * sizeof *AS);
    float *Gf = malloc((size_t)(kk * kk) * sizeof *Gf);
    double *G = malloc((size_t)(kk * kk) * sizeof *G), *h = malloc((size_t)kk * sizeof *h), *w = malloc((size_t)kk * sizeof *w);
    double *cnorm = malloc((size_t)(nc > 0 ? nc : 1) * sizeof *cnorm), *r = malloc((size_t)nq * sizeof *r);
    double *corr = malloc((size_t)(nc > 0 ? nc : 1) * sizeof *corr);
    int64_t *sel = malloc((size_t)kk * sizeof *sel);
    uint8_t *taken = calloc((size_t)(nc > 0 ? nc : 1), 1);
    int rc = 0;
    if (!A || !AS || !Gf || !G || !h || !w || !cnorm || !r || !corr || !sel || !taken) {
        rc = kvm_err(KVM_ENOMEM, "am: out of memory (k = %lld, %lld queries)", (long long)k, (long long)nq);
        goto done;
    }
    if (k == 0) goto fit;
    zone_softmax(p, A);
    for (int64_t j = 0; j < nc; j++)
        cnorm[j] = 0;
    for (int64_t i = 0; i < nq; i++) /* row by row: A is [nq][nc], a column walk misses the cache */
        for (int64_t j = 0; j < nc; j++)
            cnorm[j] += (double)A[i * nc + j] * A[i * nc + j];
    for (int64_t j = 0; j < nc; j++)
        cnorm[j] = sqrt(cnorm[j]);
    /* the first half by attention mass, the rest by OMP blocks */
    int64_t ns = (k + 1) / 2;
    if ((rc = kvm_sculpt_select(p, ns, sel))) goto done;
    for (int64_t j = 0; j < ns; j++) taken[sel[j]] = 1;
    for (int b = 0; b < AM_OMP_BLOCKS && ns < k; b++) {
        int64_t add = (k - ns + (AM_OMP_BLOCKS - b) - 1) / (AM_OMP_BLOCKS - b);
        fit_mass(p, A, sel, ns, AS, Gf, G, h, w);
        omp_block(p, A, cnorm, sel, w, ns, add, taken, r, corr);
        ns = 0;
        for (int64_t j = 0; j < nc; j++)
            if (taken[j]) sel[ns++] = j;
    }
    fit_mass(p, A, sel, ns, AS, Gf, G, h, w);
    for (int64_t j = 0; j < k; j++) {
        memcpy(kc + j * d, p->kz + sel[j] * d, (size_t)d * sizeof *kc);
        memcpy(vc + j * d, p->vz + sel[j] * d, (size_t)d * sizeof *vc);
        beta[j] = (float)log(fmax(w[j], 1e-12));
    }
fit:
    st->lbfgs_s = now_s() - t0;
    t0 = now_s();
    rc = kvm_sculpt_ridge(p, kc, beta, k, o->ridge_alpha, o->vnorm_cap, o->ridge_f32, vc);
    st->ridge_s = now_s() - t0;
    if (rc == KVM_ERANGE) rc = 0; /* keep the selected tokens' own values */
    if (rc) goto done;
    st->loss0 = st->loss = kvm_sculpt_loss(p, kc, vc, beta, k, o->lambda, NULL, NULL, &st->mse, NULL);
    if (!isfinite(st->loss)) rc = kvm_err(KVM_ERANGE, "am: non-finite loss (k = %lld)", (long long)k);
done:
    free(A); free(AS); free(Gf); free(G); free(h); free(w); free(cnorm); free(r); free(corr); free(sel); free(taken);
    return rc;
}
