/* sculpt_ridge.c: KVSculpt's closed-form value step (arXiv 2603.27819 §3): given the distilled
 * keys (and biases), the attention output is linear in the distilled values, so the MSE term is
 * a least-squares problem; solved as ridge regression shrinking toward the current values
 * (normal equations by Cholesky, float64), followed by the value-norm guard. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"
#include "kernels/kvm_sculpt_kernels.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Fills P[nq][k] (probability of distilled entry j for query i, softmax over distilled +
 * visible retain) and T[nq][d] = O_full − p_ret·O_ret: the probabilities by the backend's
 * blocked float32 kernel (scores are well scaled: float32 loses nothing the ridge needs), the
 * normal equations then in float64. Pf [nq][k] and pr [nq] are scratch. Returns 0 or an error. */
static int design_matrix(const kvm_sculpt_problem *p, const float *kc, const float *beta, int64_t k, double *P,
                         double *T, float *Pf, double *pr)
{
    const int d = p->d;
    kvm_sculpt_view v = {.d = d, .scale = p->scale, .nq = p->nq, .nc = p->nc, .q = p->q, .o_full = p->o_full,
                         .o_ret = p->o_ret, .lse_zone = p->lse_zone, .lse_ret = p->lse_ret, .n_vis = p->n_vis,
                         .out_ms = p->out_ms};
    int rc = kvm_cpu_sculpt_probs(&v, kc, beta, k, Pf, pr);
    if (rc) return rc;
    for (int64_t i = 0; i < p->nq * k; i++) P[i] = Pf[i];
    for (int64_t i = 0; i < p->nq; i++)
        for (int t = 0; t < d; t++) T[i * d + t] = (double)p->o_full[i * d + t] - pr[i] * p->o_ret[i * d + t];
    return 0;
}

int kvm_sculpt_ridge(const kvm_sculpt_problem *p, const float *kc, const float *beta, int64_t k, double alpha_rel,
                     double vnorm_cap, float *vc)
{
    if (k <= 0) return 0;
    const int d = p->d;
    const int64_t nq = p->nq;
    double *P = malloc((size_t)(nq * k) * sizeof *P), *T = malloc((size_t)(nq * d) * sizeof *T);
    double *A = malloc((size_t)(k * k) * sizeof *A), *B = malloc((size_t)(k * d) * sizeof *B);
    double *sc = malloc((size_t)nq * sizeof *sc);
    float *Pf = malloc((size_t)(nq * k) * sizeof *Pf);
    int rc = 0;
    if (!P || !T || !A || !B || !sc || !Pf) {
        rc = kvm_err(KVM_ENOMEM, "sculpt ridge: out of memory (k = %lld, %lld queries)", (long long)k, (long long)nq);
        goto done;
    }
    if ((rc = design_matrix(p, kc, beta, k, P, T, Pf, sc))) goto done;
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
    free(Pf);
    return rc;
}
