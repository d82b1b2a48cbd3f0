/* sculpt_ridge.c: KVSculpt's closed-form value step (arXiv 2603.27819 §3): given the distilled
 * keys (and biases), the attention output is linear in the distilled values, so the MSE term is
 * a least-squares problem; solved as ridge regression shrinking toward the current values
 * (normal equations by Cholesky, float64), followed by the value-norm guard. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Fills P[nq][k] (probability of distilled entry j for query i, softmax over distilled +
 * visible retain) and T[nq][d] = O_full − p_ret·O_ret. sc is [k] scratch. */
static void design_matrix(const kvm_sculpt_problem *p, const float *kc, const float *beta, int64_t k, double *P,
                          double *T, double *sc)
{
    const int d = p->d;
    for (int64_t i = 0; i < p->nq; i++) {
        const float *q = p->q + i * d;
        double mx = -INFINITY;
        for (int64_t j = 0; j < k; j++) {
            double s = 0;
            for (int t = 0; t < d; t++) s += (double)q[t] * kc[j * d + t];
            sc[j] = s * p->scale + (beta ? beta[j] : 0.0);
            mx = sc[j] > mx ? sc[j] : mx;
        }
        double lr = p->lse_ret[i];
        int has_r = p->n_vis[i] > 0;
        double m2 = has_r && lr > mx ? lr : mx;
        double z = has_r ? exp(lr - m2) : 0;
        for (int64_t j = 0; j < k; j++) z += (sc[j] = exp(sc[j] - m2));
        double pr = has_r ? exp(lr - m2) / z : 0;
        for (int64_t j = 0; j < k; j++) P[i * k + j] = sc[j] / z;
        for (int t = 0; t < d; t++) T[i * d + t] = (double)p->o_full[i * d + t] - pr * p->o_ret[i * d + t];
    }
}

int kvm_sculpt_ridge(const kvm_sculpt_problem *p, const float *kc, const float *beta, int64_t k, double alpha_rel,
                     double vnorm_cap, float *vc)
{
    if (k <= 0) return 0;
    const int d = p->d;
    const int64_t nq = p->nq;
    double *P = malloc((size_t)(nq * k) * sizeof *P), *T = malloc((size_t)(nq * d) * sizeof *T);
    double *A = malloc((size_t)(k * k) * sizeof *A), *B = malloc((size_t)(k * d) * sizeof *B);
    double *sc = malloc((size_t)k * sizeof *sc);
    int rc = 0;
    if (!P || !T || !A || !B || !sc) {
        rc = kvm_err(KVM_ENOMEM, "sculpt ridge: out of memory (k = %lld, %lld queries)", (long long)k, (long long)nq);
        goto done;
    }
    design_matrix(p, kc, beta, k, P, T, sc);
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)k, (int)nq, 1.0, P, (int)k, 0.0, A, (int)k);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)k, d, (int)nq, 1.0, P, (int)k, T, d, 0.0, B, d);
    double tr = 0;
    for (int64_t j = 0; j < k; j++) tr += A[j * k + j];
    double alpha = alpha_rel * tr / (double)k;
    if (!(alpha > 1e-30)) alpha = 1e-30 + alpha_rel; /* nothing attends the entries: stay at V0 */
    for (int64_t j = 0; j < k; j++) {
        A[j * k + j] += alpha;
        for (int t = 0; t < d; t++) B[j * d + t] += alpha * vc[j * d + t];
    }
    lapack_int info = LAPACKE_dposv(LAPACK_ROW_MAJOR, 'U', (lapack_int)k, d, A, (lapack_int)k, B, d);
    if (info != 0) {
        rc = kvm_err(KVM_ERANGE, "sculpt ridge: normal matrix not positive definite (dposv info %d, k = %lld)",
                     (int)info, (long long)k);
        goto done;
    }
    for (int64_t i = 0; i < k * d; i++)
        if (!isfinite(B[i])) {
            rc = kvm_err(KVM_ERANGE, "sculpt ridge: non-finite value (entry %lld)", (long long)(i / d));
            goto done;
        }
    double cap = vnorm_cap > 0 ? vnorm_cap * p->vnorm_max : INFINITY;
    for (int64_t j = 0; j < k; j++) {
        double n2 = 0;
        for (int t = 0; t < d; t++) n2 += B[j * d + t] * B[j * d + t];
        double f = sqrt(n2) > cap ? cap / sqrt(n2) : 1.0;
        for (int t = 0; t < d; t++) vc[j * d + t] = (float)(B[j * d + t] * f);
    }
done:
    free(P);
    free(T);
    free(A);
    free(B);
    free(sc);
    return rc;
}
