/* sculpt_ridge.c: KVSculpt's closed-form value step (arXiv 2603.27819 §3): given the distilled
 * keys (and biases), the attention output is linear in the distilled values, so the MSE term is
 * a least-squares problem; solved as ridge regression shrinking toward the current values
 * (normal equations by Cholesky in float64, the equations built in float32 blocks or float64),
 * followed by the value-norm guard. The α and the guard are kernels/kvm_ridge_body.h's, which
 * the CUDA backend's batched solve runs too; the Cholesky is the CPU backend's blocked one
 * (kvm_cpu_dposv_upper: LAPACKE_dposv's result within rounding, without its row-major transposes). */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"
#include "kernels/kvm_ridge_body.h"
#include "kernels/kvm_sculpt_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int kvm_sculpt_ridge(const kvm_sculpt_problem *p, const float *kc, const float *beta, int64_t k, double alpha_rel,
                     double vnorm_cap, int f32, float *vc)
{
    if (k <= 0) return 0;
    const int d = p->d;
    double *A = malloc((size_t)(k * k) * sizeof *A), *B = malloc((size_t)(k * d) * sizeof *B);
    int rc = 0;
    if (!A || !B) {
        rc = kvm_err(KVM_ENOMEM, "sculpt ridge: out of memory (k = %lld)", (long long)k);
        goto done;
    }
    kvm_sculpt_view v = {.d = d, .scale = p->scale, .nq = p->nq, .nc = p->nc, .q = p->q, .o_full = p->o_full,
                         .o_ret = p->o_ret, .lse_zone = p->lse_zone, .lse_ret = p->lse_ret, .n_vis = p->n_vis,
                         .out_ms = p->out_ms, .ridge_f32 = f32 != 0};
    if ((rc = kvm_cpu_sculpt_normal(&v, kc, beta, k, A, B))) goto done;
    rc = f32 ? kvm_sculpt_ridge_solve_f32(p, A, B, k, alpha_rel, vnorm_cap, vc)
             : kvm_sculpt_ridge_solve(p, A, B, k, alpha_rel, vnorm_cap, vc);
    if (rc == KVM_SCULPT_RIDGE_F64) { /* ill-conditioned for float32 sums: the float64 equations */
        v.ridge_f32 = 0;
        if (!(rc = kvm_cpu_sculpt_normal(&v, kc, beta, k, A, B)))
            rc = kvm_sculpt_ridge_solve(p, A, B, k, alpha_rel, vnorm_cap, vc);
    }
done:
    free(A);
    free(B);
    return rc;
}

/* The solve; pivot_limit < INFINITY: returns KVM_SCULPT_RIDGE_F64 (vc unchanged) when a
 * Cholesky pivot fell below 1/pivot_limit of its diagonal entry. */
static int solve(const kvm_sculpt_problem *p, double *A, double *B, int64_t k, double alpha_rel, double vnorm_cap,
                 float *vc, double pivot_limit)
{
    const int d = p->d;
    const double alpha = kvm_rb_alpha(A, k, alpha_rel); /* nothing attends the entries: 1e-30 + alpha_rel, stay at V0 */
    double dmax = 0;
    for (int64_t j = 0; j < k; j++) {
        A[j * k + j] += alpha;
        dmax = fmax(dmax, A[j * k + j]);
        for (int t = 0; t < d; t++) B[j * d + t] += alpha * vc[j * d + t];
    }
    const int64_t info = kvm_cpu_dposv_upper(k, d, A, B);
    if (info != 0 && isfinite(pivot_limit)) return KVM_SCULPT_RIDGE_F64;
    if (info != 0)
        return kvm_err(KVM_ERANGE, "sculpt ridge: normal matrix not positive definite (pivot %lld, k = %lld)",
                       (long long)info, (long long)k);
    if (isfinite(pivot_limit)) /* A = UᵀU: U_jj² is pivot j, what is left of A_jj after the cancellation */
        for (int64_t j = 0; j < k; j++)
            if (!(A[j * k + j] * A[j * k + j] * pivot_limit >= dmax)) return KVM_SCULPT_RIDGE_F64;
    for (int64_t j = 0; j < k; j++)
        if (!kvm_rb_row_finite(B, d, j)) return kvm_err(KVM_ERANGE, "sculpt ridge: non-finite value (entry %lld)", (long long)j);
    const double cap = vnorm_cap > 0 ? vnorm_cap * p->vnorm_max : INFINITY;
    for (int64_t j = 0; j < k; j++) kvm_rb_row_cap(B, d, j, cap, vc);
    return 0;
}

int kvm_sculpt_ridge_solve(const kvm_sculpt_problem *p, double *A, double *B, int64_t k, double alpha_rel,
                           double vnorm_cap, float *vc)
{
    return solve(p, A, B, k, alpha_rel, vnorm_cap, vc, INFINITY);
}

int kvm_sculpt_ridge_solve_f32(const kvm_sculpt_problem *p, double *A, double *B, int64_t k, double alpha_rel,
                               double vnorm_cap, float *vc)
{
    return solve(p, A, B, k, alpha_rel, vnorm_cap, vc, KVM_SCULPT_RIDGE_PIVOT_LIMIT);
}
