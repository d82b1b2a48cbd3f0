/* check_kernel_shapes.c: the CPU row kernels' two shapes (kernels/LAYOUT.md, "16 registers")
 * give the same bits on every machine: attention's softmax row with 16-lane compares
 * (kvm__attn_softmax_row16, what AVX-512 processors run) and with 8-lane ones
 * (kvm__attn_softmax_row16h, AVX2 and baseline), over rows whose length is and is not a
 * multiple of 16, with and without bias, normalised or not, with LSE and entropy; the KVSculpt
 * rows' exponential, maximum and exponentiated row (v16_expf / _h, v16_max / _h, exp_row_body /
 * _h) on values around the exponential's clamps, NaN and signed zeros. Both shapes are
 * generic vector code, so this runs wherever the tests run (the head-dim-8 loss kernels and the
 * Cholesky, whose wide shapes need AVX-512's registers only for speed, are compared in
 * check_sculpt and check_ridge_body where the processor has AVX-512). */
/* the kernels' vector helpers are always inlined; kernels/cpu is compiled with -Wno-psabi */
#pragma GCC diagnostic ignored "-Wpsabi"
#include "kernels/cpu/kvm_cpu_attn_rows.h"
#include "kernels/cpu/kvm_cpu_sculpt_rows.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 777;
static float frand(float lo, float hi)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float)((double)(rng >> 40) / (double)(1ull << 24));
}

/* Scores spread over the exponential's whole range once the maximum is taken off. */
static void fill(float *x, int64_t n, float spread)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = frand(-spread, spread);
}

START_TEST(test_attn_softmax_row_shapes)
{
    const int64_t viss[] = {0, 1, 15, 16, 17, 100, 257};
    const float spreads[] = {1.0f, 60.0f, 200.0f};
    int rows = 0;
    for (size_t a = 0; a < sizeof viss / sizeof viss[0]; a++)
        for (size_t b = 0; b < sizeof spreads / sizeof spreads[0]; b++)
            for (int variant = 0; variant < 8; variant++) {
                const int64_t vis = viss[a], width = vis + 5;
                const int use_bias = variant & 1, normalize = (variant >> 1) & 1, want_ent = (variant >> 2) & 1;
                float r1[300], r2[300], bias[300], lse1 = 0, lse2 = 0, ent1 = 0, ent2 = 0;
                fill(r1, width, spreads[b]);
                fill(bias, width, 3.0f);
                memcpy(r2, r1, sizeof r1);
                const float i1 = kvm__attn_softmax_row16(r1, use_bias ? bias : NULL, vis, width, normalize, &lse1,
                                                         want_ent ? &ent1 : NULL);
                const float i2 = kvm__attn_softmax_row16h(r2, use_bias ? bias : NULL, vis, width, normalize, &lse2,
                                                          want_ent ? &ent2 : NULL);
                ck_assert_msg(!memcmp(r1, r2, (size_t)width * sizeof *r1) && !memcmp(&i1, &i2, sizeof i1) &&
                                  !memcmp(&lse1, &lse2, sizeof lse1) && !memcmp(&ent1, &ent2, sizeof ent1),
                              "vis %lld, spread %g, variant %d: the 8-lane compares' row differs", (long long)vis,
                              (double)spreads[b], variant);
                rows++;
            }
    printf("attention softmax rows: %d rows bit-identical in both shapes\n", rows);
}
END_TEST

START_TEST(test_sculpt_row_shapes)
{
    /* lanes around the clamps (−87, −69, 88), NaN, ±0 and ±inf, then random rows */
    const float edge[16] = {-100.0f, -87.0f,   -86.99f,   -69.5f, -69.0f, 88.5f, 0.0f,  -0.0f,
                            NAN,     INFINITY, -INFINITY, 1e-30f, -1e30f, 3.0f,  -3.0f, 87.9f};
    v16f x, y;
    memcpy(&x, edge, sizeof x);
    for (int l = 0; l < 16; l++)
        y[l] = edge[(l * 7 + 3) % 16];
    const v16f e1 = v16_expf(x), e2 = v16_expf_h(x);
    v16f m1 = v16_max(x, y), m2 = v16_max_h(x, y);
    ck_assert_msg(!memcmp(&e1, &e2, sizeof e1), "v16_expf_h differs from v16_expf at the edge values");
    ck_assert_msg(!memcmp(&m1, &m2, sizeof m1), "v16_max_h differs from v16_max at the edge values");
    v16f pz = {0}, nz; /* +0 and −0 in every lane */
    for (int l = 0; l < 16; l++)
        nz[l] = -0.0f;
    v16f z1 = v16_max(pz, nz), z2 = v16_max_h(pz, nz); /* a tie: the first argument's zero */
    ck_assert_msg(!memcmp(&z1, &z2, sizeof z1), "v16_max_h breaks a tie of +0 and -0 unlike v16_max");
    z1 = v16_max(nz, pz), z2 = v16_max_h(nz, pz);
    ck_assert_msg(!memcmp(&z1, &z2, sizeof z1), "v16_max_h breaks a tie of -0 and +0 unlike v16_max");
    for (int t = 0; t < 200; t++) {
        float a[64], b[64], mx = -INFINITY, iz1, iz2;
        const int64_t kp = 16 * (1 + t % 4);
        fill(a, kp, t % 2 ? 100.0f : 5.0f);
        for (int64_t j = 0; j < kp; j++)
            mx = a[j] > mx ? a[j] : mx;
        if (t % 5 == 0) a[kp - 1] = -1e30f; /* a padding entry */
        memcpy(b, a, sizeof a);
        const float l1 = exp_row_body(a, kp, mx, &iz1), l2 = exp_row_body_h(b, kp, mx, &iz2);
        ck_assert_msg(!memcmp(a, b, (size_t)kp * sizeof *a) && !memcmp(&l1, &l2, sizeof l1) &&
                          !memcmp(&iz1, &iz2, sizeof iz1),
                      "row %d: exp_row_body_h differs from exp_row_body", t);
        memcpy(&x, a, sizeof x);
        memcpy(&y, a + 16 * (kp > 16), sizeof y);
        m1 = v16_max(x, y), m2 = v16_max_h(x, y);
        ck_assert_msg(!memcmp(&m1, &m2, sizeof m1), "row %d: v16_max_h differs", t);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("kernel_shapes");
    TCase *tc = tcase_create("kernel_shapes");
    tcase_add_test(tc, test_attn_softmax_row_shapes);
    tcase_add_test(tc, test_sculpt_row_shapes);
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
