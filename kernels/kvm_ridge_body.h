/* kvm_ridge_body.h: the KVSculpt value step's solve (arXiv 2603.27819 §3: ridge regression of
 * the distilled values on the normal equations A V = B, float64) written once as inline
 * functions: the CUDA backend's batched Cholesky (kernels/cuda/kvm_cuda_sculpt.cu, one thread
 * block per problem, threads over the rows of a column and over the columns of B) calls them,
 * and kvm_rb_ridge_ref below runs the same steps in order on the CPU for the tests
 * (tests/check_ridge_body.c: against LAPACKE_dposv, the CPU backend's solve). Layout: A [k][k]
 * row-major, full symmetric on entry; its lower triangle becomes the Cholesky factor L (A + αI =
 * L·Lᵀ) in place; B [k][d] row-major becomes the solution. Every sum runs in index order. */
#ifndef KVM_RIDGE_BODY_H
#define KVM_RIDGE_BODY_H

#include <math.h>
#include <stdint.h>

#include "kernels/kvm_hd.h"

/* The ridge α: alpha_rel × the mean diagonal of A (the value-fit's scale-free shrinkage, as
 * compress/sculpt/sculpt_ridge.c), or 1e-30 + alpha_rel when nothing attends the entries. */
static inline KVM_HD double kvm_rb_alpha(const double *A, int64_t k, double alpha_rel)
{
    double tr = 0;
    for (int64_t j = 0; j < k; j++) tr += A[j * k + j];
    double alpha = alpha_rel * tr / (double)k;
    return alpha > 1e-30 ? alpha : 1e-30 + alpha_rel;
}

/* Σ_{l<n} a[l]·b[l], in order. */
static inline KVM_HD double kvm_rb_dot(const double *a, const double *b, int64_t n)
{
    double s = 0;
    for (int64_t l = 0; l < n; l++) s += a[l] * b[l];
    return s;
}

/* Cholesky–Crout, column j's pivot: L[j][j] = sqrt(A[j][j] − Σ_{l<j} L[j][l]²) in place (columns
 * < j done). Returns 0, or 1 when the pivot is not positive and finite (A not positive definite). */
static inline KVM_HD int kvm_rb_chol_pivot(double *A, int64_t k, int64_t j)
{
    const double a = A[j * k + j] - kvm_rb_dot(A + j * k, A + j * k, j);
    if (!(a > 0) || !isfinite(a)) return 1;
    A[j * k + j] = sqrt(a);
    return 0;
}

/* Column j's entry of row i > j: L[i][j] = (A[i][j] − Σ_{l<j} L[i][l]·L[j][l]) / L[j][j]
 * (pivot j done). Rows of one column are independent: one thread each. */
static inline KVM_HD void kvm_rb_chol_entry(double *A, int64_t k, int64_t j, int64_t i)
{
    A[i * k + j] = (A[i * k + j] - kvm_rb_dot(A + i * k, A + j * k, j)) / A[j * k + j];
}

/* Column t of B [k][d] ← (L·Lᵀ)⁻¹ B: forward L·Y = B, then back Lᵀ·X = Y, in place. Columns are
 * independent: one thread each. */
static inline KVM_HD void kvm_rb_solve_col(const double *L, int64_t k, double *B, int d, int t)
{
    for (int64_t i = 0; i < k; i++) {
        double s = B[i * d + t];
        for (int64_t l = 0; l < i; l++) s -= L[i * k + l] * B[l * d + t];
        B[i * d + t] = s / L[i * k + i];
    }
    for (int64_t i = k - 1; i >= 0; i--) {
        double s = B[i * d + t];
        for (int64_t l = i + 1; l < k; l++) s -= L[l * k + i] * B[l * d + t];
        B[i * d + t] = s / L[i * k + i];
    }
}

/* Row j of the solution X [k][d]: 1 when every value is finite. */
static inline KVM_HD int kvm_rb_row_finite(const double *X, int d, int64_t j)
{
    for (int t = 0; t < d; t++)
        if (!isfinite(X[j * d + t])) return 0;
    return 1;
}

/* Value-norm guard of row j (|v| ≤ cap; cap = INFINITY: off): v[j] = X[j]·min(1, cap/|X[j]|) as
 * float32. */
static inline KVM_HD void kvm_rb_row_cap(const double *X, int d, int64_t j, double cap, float *v)
{
    double n2 = 0;
    for (int t = 0; t < d; t++) n2 += X[j * d + t] * X[j * d + t];
    const double f = sqrt(n2) > cap ? cap / sqrt(n2) : 1.0;
    for (int t = 0; t < d; t++) v[j * d + t] = (float)(X[j * d + t] * f);
}

/* The whole value step of one problem on the CPU, in the order the CUDA kernel takes the steps:
 * A += αI, B += α·V0 (V0 = v, float32 [k][d]), Cholesky, solve, guard; v ← the new values. A and B
 * are overwritten. Returns 0, or 1 (not positive definite or a non-finite value; v unchanged). */
static inline int kvm_rb_ridge_ref(double *A, double *B, int64_t k, int d, double alpha_rel, double cap, float *v)
{
    const double alpha = kvm_rb_alpha(A, k, alpha_rel);
    for (int64_t j = 0; j < k; j++) {
        A[j * k + j] += alpha;
        for (int t = 0; t < d; t++) B[j * d + t] += alpha * v[j * d + t];
    }
    for (int64_t j = 0; j < k; j++) {
        if (kvm_rb_chol_pivot(A, k, j)) return 1;
        for (int64_t i = j + 1; i < k; i++) kvm_rb_chol_entry(A, k, j, i);
    }
    for (int t = 0; t < d; t++) kvm_rb_solve_col(A, k, B, d, t);
    for (int64_t j = 0; j < k; j++)
        if (!kvm_rb_row_finite(B, d, j)) return 1;
    for (int64_t j = 0; j < k; j++) kvm_rb_row_cap(B, d, j, cap, v);
    return 0;
}

#endif
