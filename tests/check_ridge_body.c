/* check_ridge_body.c: the batched Cholesky of the CUDA solver's value step, run on the CPU
 * (kernels/kvm_ridge_body.h: the per-column and per-row bodies the device kernel calls, in its
 * order), against the CPU backend's solve (kvm_sculpt_ridge_solve: LAPACKE_dposv) on random
 * normal equations of the solver's sizes, with the value-norm guard on and off; a matrix that is
 * not positive definite is refused with the values left as they were. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"
#include "kernels/kvm_ridge_body.h"
#include "tests/util/kvm_test.h"

#include <check.h>
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

int main(void)
{
    Suite *s = suite_create("ridge_body");
    TCase *tc = tcase_create("ridge_body");
    tcase_add_test(tc, test_equals_dposv);
    tcase_add_test(tc, test_refuses_indefinite);
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
