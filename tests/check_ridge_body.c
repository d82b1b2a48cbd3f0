/* check_ridge_body.c: the batched Cholesky of the CUDA solver's value step, run on the CPU
 * (kernels/kvm_ridge_body.h: the per-column and per-row bodies the device kernel calls, in its
 * order), against the CPU backend's solve (kvm_sculpt_ridge_solve: LAPACKE_dposv) on random
 * normal equations of the solver's sizes, with the value-norm guard on and off; a matrix that is
 * not positive definite is refused with the values left as they were. The CPU backend's blocked
 * Cholesky (kvm_cpu_dposv_upper) against LAPACKE_dposv itself, at sizes around its panel edges
 * and SmolLM2's k ≈ 600. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"
#include "kernels/kvm_ridge_body.h"
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_clones.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 12345;
static double drand(void) /* uniform in [-1, 1) */
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}

/* A = PᵀP (full symmetric) and B = PᵀT for a random design P [nq][k] with softmax-like rows
 * (non-negative, rows summing to < 1) and targets T [nq][d]; V0 random. */
static void make(int64_t nq, int64_t k, int d, double *A, double *B, float *v)
{
    double *P = malloc((size_t)(nq * k) * sizeof *P), *T = malloc((size_t)(nq * d) * sizeof *T);
    ck_assert(P && T);
    for (int64_t i = 0; i < nq; i++) {
        double s = 0;
        for (int64_t j = 0; j < k; j++) s += P[i * k + j] = fabs(drand()) + 1e-3;
        for (int64_t j = 0; j < k; j++) P[i * k + j] *= 0.9 / s;
        for (int t = 0; t < d; t++) T[i * d + t] = drand();
    }
    for (int64_t a = 0; a < k; a++)
        for (int64_t b = 0; b < k; b++) {
            double s = 0;
            for (int64_t i = 0; i < nq; i++) s += P[i * k + a] * P[i * k + b];
            A[a * k + b] = s;
        }
    for (int64_t a = 0; a < k; a++)
        for (int t = 0; t < d; t++) {
            double s = 0;
            for (int64_t i = 0; i < nq; i++) s += P[i * k + a] * T[i * d + t];
            B[a * d + t] = s;
        }
    for (int64_t i = 0; i < k * d; i++) v[i] = (float)drand();
    free(P);
    free(T);
}

START_TEST(test_equals_dposv)
{
    const struct {
        int64_t nq, k;
        int d;
        double cap;
    } cases[] = {{40, 1, 8, 0}, {200, 7, 16, 0}, {300, 64, 64, 0}, {600, 120, 64, 1.5}, {96, 160, 32, 0}};
    double worst = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t k = cases[c].k, nq = cases[c].nq;
        const int d = cases[c].d;
        double *A = malloc((size_t)(k * k) * sizeof *A), *B = malloc((size_t)(k * d) * sizeof *B);
        double *A2 = malloc((size_t)(k * k) * sizeof *A2), *B2 = malloc((size_t)(k * d) * sizeof *B2);
        float *v = malloc((size_t)(k * d) * sizeof *v), *v2 = malloc((size_t)(k * d) * sizeof *v2);
        ck_assert(A && B && A2 && B2 && v && v2);
        make(nq, k, d, A, B, v);
        memcpy(A2, A, (size_t)(k * k) * sizeof *A);
        memcpy(B2, B, (size_t)(k * d) * sizeof *B);
        memcpy(v2, v, (size_t)(k * d) * sizeof *v);
        kvm_sculpt_problem p = {.d = d, .vnorm_max = 1.0f};
        ck_assert_msg(kvm_sculpt_ridge_solve(&p, A2, B2, k, 1e-3, cases[c].cap, v2) == 0, "%s", kvm_errmsg());
        ck_assert_int_eq(kvm_rb_ridge_ref(A, B, k, d, 1e-3, cases[c].cap > 0 ? cases[c].cap : INFINITY, v), 0);
        double num = 0, den = 0;
        for (int64_t i = 0; i < k * d; i++) {
            num += ((double)v[i] - v2[i]) * ((double)v[i] - v2[i]);
            den += (double)v2[i] * v2[i];
        }
        const double r = sqrt(num / den);
        worst = r > worst ? r : worst;
        ck_assert_msg(r < 1e-6, "k = %lld: relative difference %g from dposv", (long long)k, r);
        if (cases[c].cap > 0)
            for (int64_t j = 0; j < k; j++) {
                double n2 = 0;
                for (int t = 0; t < d; t++) n2 += (double)v[j * d + t] * v[j * d + t];
                ck_assert_double_le(sqrt(n2), cases[c].cap * (1 + 1e-6));
            }
        free(A), free(B), free(A2), free(B2), free(v), free(v2);
    }
    printf("ridge body (Cholesky-Crout) vs LAPACKE_dposv over 5 sizes (k 1..160): worst relative %.2g\n", worst);
}
END_TEST

/* Not positive definite (a zero ridge on a rank-deficient A): refused, the values unchanged. */
START_TEST(test_refuses_indefinite)
{
    const int64_t k = 3;
    const int d = 2;
    double A[9] = {1, 1, 0, 1, 1, 0, 0, 0, -1}, B[6] = {1, 2, 3, 4, 5, 6};
    float v[6] = {1, 2, 3, 4, 5, 6}, v0[6];
    memcpy(v0, v, sizeof v);
    ck_assert_int_eq(kvm_rb_ridge_ref(A, B, k, d, 0, INFINITY, v), 1);
    ck_assert_int_eq(memcmp(v, v0, sizeof v), 0);
    double one = 1;
    ck_assert_double_eq(kvm_rb_alpha(&one, 1, 0.5), 0.5);
    double zero = 0;
    ck_assert_double_eq(kvm_rb_alpha(&zero, 1, 0.5), 1e-30 + 0.5); /* nothing attends: stay at V0 */
}
END_TEST

/* kvm_cpu_dposv_upper vs LAPACKE_dposv (row-major, 'U') on the same ridge normal equations: k
 * from 1 through panel edges (47, 48, 49, 97) to SmolLM2's size, head dims 8, 64 and an odd 13;
 * only the upper triangle is given (the lower holds garbage that must not be read). The factor's
 * diagonal (the pivots the float32 path's conditioning check reads) and the solution agree within
 * 1e-9 relative; the solve is deterministic (a second call gives the same bits), and the AVX2
 * block shapes give the AVX-512 ones' bits where the processor has both. */
START_TEST(test_blocked_cholesky_vs_dposv)
{
    const struct {
        int64_t nq, k;
        int d;
    } cases[] = {{30, 1, 8}, {80, 17, 13}, {200, 47, 64}, {200, 48, 8}, {220, 49, 64}, {300, 97, 64}, {640, 595, 64}};
    double worst = 0;
    const int v4_was = kvm__cpu_v4_set(1), paths = kvm__cpu_v4() ? 2 : 1;
    kvm__cpu_v4_set(v4_was);
    if (paths == 1) printf("SKIP: no AVX-512 (x86-64-v4) on this processor: the AVX2 blocks only\n");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int64_t k = cases[c].k, nq = cases[c].nq;
        const int d = cases[c].d;
        const size_t na = (size_t)(k * k), nb = (size_t)(k * d);
        double *A = malloc(na * sizeof *A), *B = malloc(nb * sizeof *B), *A1 = malloc(na * sizeof *A);
        double *B1 = malloc(nb * sizeof *B), *A2 = malloc(na * sizeof *A), *B2 = malloc(nb * sizeof *B);
        float *v = malloc(nb * sizeof *v);
        ck_assert(A && B && A1 && B1 && A2 && B2 && v);
        make(nq, k, d, A, B, v);
        const double alpha = kvm_rb_alpha(A, k, 1e-3);
        for (int64_t j = 0; j < k; j++) A[j * k + j] += alpha;
        memcpy(A1, A, na * sizeof *A);
        memcpy(B1, B, nb * sizeof *B);
        for (int64_t r = 1; r < k; r++) /* garbage below the diagonal: never read */
            for (int64_t q = 0; q < r; q++) A[r * k + q] = NAN;
        memcpy(A2, A, na * sizeof *A);
        memcpy(B2, B, nb * sizeof *B);
        ck_assert_int_eq(LAPACKE_dposv(LAPACK_ROW_MAJOR, 'U', (lapack_int)k, d, A1, (lapack_int)k, B1, d), 0);
        ck_assert_int_eq(kvm_cpu_dposv_upper(k, d, A, B), 0);
        double num = 0, den = 0, piv = 0;
        for (size_t i = 0; i < nb; i++) {
            num += (B[i] - B1[i]) * (B[i] - B1[i]);
            den += B1[i] * B1[i];
        }
        for (int64_t j = 0; j < k; j++)
            piv = fmax(piv, fabs(A[j * k + j] - A1[j * k + j]) / A1[j * k + j]);
        const double r = sqrt(num / den);
        worst = fmax(worst, fmax(r, piv));
        ck_assert_msg(r < 1e-9 && piv < 1e-9, "k = %lld, d = %d: solution %g, pivots %g from dposv", (long long)k,
                      d, r, piv);
        for (int narrow = 0; narrow < paths; narrow++) { /* again, and by the other path's block shapes */
            memcpy(A1, A2, na * sizeof *A);
            memcpy(B1, B2, nb * sizeof *B);
            kvm__cpu_v4_set(!narrow);
            ck_assert_int_eq(kvm_cpu_dposv_upper(k, d, A1, B1), 0);
            kvm__cpu_v4_set(v4_was);
            ck_assert_msg(!memcmp(A, A1, na * sizeof *A) && !memcmp(B, B1, nb * sizeof *B),
                          "k = %lld, d = %d: the %s blocks differ", (long long)k, d, narrow ? "AVX2" : "AVX-512");
        }
        free(A), free(B), free(A1), free(B1), free(A2), free(B2), free(v);
    }
    printf("blocked Cholesky vs LAPACKE_dposv over 7 sizes (k 1..595): worst relative %.2g\n", worst);
}
END_TEST

/* Not positive definite: the failing pivot's index + 1 (here the third, after two good ones, and
 * a NaN pivot in the second panel), B untouched. */
START_TEST(test_blocked_cholesky_refuses)
{
    double A[9] = {4, 2, 0, 0, 1, 0, 0, 0, 1}, B[3] = {1, 2, 3};
    ck_assert_int_eq(kvm_cpu_dposv_upper(3, 1, A, B), 2); /* 1 − 2²/4 = 0: pivot 1 */
    ck_assert(B[0] == 1 && B[1] == 2 && B[2] == 3);
    const int64_t k = 60;
    double *M = calloc((size_t)(k * k), sizeof *M), b[60] = {0};
    ck_assert(M);
    for (int64_t j = 0; j < k; j++) M[j * k + j] = 1;
    M[55 * k + 55] = NAN;
    ck_assert_int_eq(kvm_cpu_dposv_upper(k, 1, M, b), 56);
    free(M);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("ridge_body");
    TCase *tc = tcase_create("ridge_body");
    tcase_add_test(tc, test_equals_dposv);
    tcase_add_test(tc, test_refuses_indefinite);
    tcase_add_test(tc, test_blocked_cholesky_vs_dposv);
    tcase_add_test(tc, test_blocked_cholesky_refuses);
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
