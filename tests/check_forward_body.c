/* check_forward_body.c: the forward's kernel bodies (kernels/kvm_forward_body.h) run the way the
 * CUDA launches run them (kernels/cuda/kvm_cuda_attn.cu: tiles of 32 entries per query for
 * prefill, entries split over threads and merged for decode, a second pass against each row's
 * LSE for statistics), on the CPU, against the CPU backend's attention: so a machine without a
 * GPU still tests the arithmetic the GPU does. */
#include "kernels/kvm_forward_body.h"
#include "kernels/kvm_kernels.h"
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { D = 16, NE = 150, NQ = 40, N_DISTILLED = 6, TILE = 32, SPLIT = 8 };

static float frand(unsigned *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / 16777216.0f * 2.0f - 1.0f;
}

typedef struct head {
    float q[NQ * D], k[NE * D], v[NE * D], bias[NE];
    int32_t qpos[NQ], pos[NE];
} head;

/* a ragged head: distilled entries (KVM_POS_NONE, bias β) then positions 0.. with gaps (evicted) */
static void make_head(head *h, unsigned seed)
{
    for (int i = 0; i < NQ * D; i++) h->q[i] = 2.0f * frand(&seed);
    for (int i = 0; i < NE * D; i++) h->k[i] = 2.0f * frand(&seed), h->v[i] = frand(&seed);
    int32_t p = 0;
    for (int e = 0; e < NE; e++) {
        h->pos[e] = e < N_DISTILLED ? KVM_POS_NONE : (p += 1 + (e % 3 == 0));
        h->bias[e] = e < N_DISTILLED ? 0.5f * frand(&seed) : 0.0f;
    }
    /* queries from before the first positioned entry to past the last */
    for (int i = 0; i < NQ; i++) h->qpos[i] = -1 + i * (p + 2) / (NQ - 1);
}

/* the CPU backend's per-layer kernel on this one head; probs [NQ][NE] are every query's
 * probability row (the OBS statistic over all NQ queries) */
static void cpu_ref(const head *h, float *out, float *probs)
{
    const float *k = h->k, *v = h->v, *bias = h->bias;
    const int32_t *pos = h->pos;
    const int64_t n_e = NE;
    kvm_attn_layer a = {.n_heads = 1, .n_kv_heads = 1, .head_dim = D, .scale = 1.0f / sqrtf((float)D), .q = h->q,
                        .ldq = D, .qpos = h->qpos, .n_q = NQ, .k = &k, .v = &v, .pos = &pos, .bias = &bias,
                        .n_e = &n_e, .out = out, .ldo = D, .stats = KVM_ATTN_STAT_OBS, .n_obs = NQ, .ld_e = NE,
                        .obs = probs};
    ck_assert_int_eq(kvm_kernels_cpu()->attention(&a), 0);
}

/* the prefill launch: each query walks tiles of TILE entries of its visible prefix */
static float tiled(const head *h, int i, float *o)
{
    const float *q = h->q + i * D;
    float acc[D] = {0}, s[TILE];
    kvm_fb_online st = {-INFINITY, 0.0f};
    int64_t vis = kvm_fb_visible(h->pos, NE, h->qpos[i]);
    for (int64_t e0 = 0; e0 < vis; e0 += TILE) {
        int n = (int)(vis - e0 < TILE ? vis - e0 : TILE);
        kvm_fb_attn_tile(q, 1.0f / sqrtf((float)D), h->k + e0 * D, h->v + e0 * D, h->bias + e0, n, D, s, &st, acc);
    }
    float inv = kvm_fb_online_inv(&st);
    for (int c = 0; c < D; c++) o[c] = acc[c] * inv;
    return st.l > 0 ? st.m + logf(st.l) : -INFINITY;
}

/* the decode launch: SPLIT threads take entries t, t + SPLIT, ..., then merge pairwise */
static void split(const head *h, int i, float *o)
{
    float acc[SPLIT][D] = {{0}}, s[1];
    kvm_fb_online st[SPLIT];
    int64_t vis = kvm_fb_visible(h->pos, NE, h->qpos[i]);
    for (int t = 0; t < SPLIT; t++) {
        st[t] = (kvm_fb_online){-INFINITY, 0.0f};
        for (int64_t e = t; e < vis; e += SPLIT)
            kvm_fb_attn_tile(h->q + i * D, 1.0f / sqrtf((float)D), h->k + e * D, h->v + e * D, h->bias + e, 1, D, s,
                             &st[t], acc[t]);
    }
    for (int stride = SPLIT / 2; stride > 0; stride /= 2)
        for (int t = 0; t < stride; t++) kvm_fb_online_merge(&st[t], acc[t], &st[t + stride], acc[t + stride], D);
    float inv = kvm_fb_online_inv(&st[0]);
    for (int c = 0; c < D; c++) o[c] = acc[0][c] * inv;
}

START_TEST(test_tiled_and_split_match_cpu)
{
    static head h;
    static float ref[NQ * D], probs[NQ * NE];
    make_head(&h, 7);
    cpu_ref(&h, ref, probs);
    float worst_t = 0, worst_s = 0, o[D];
    int empty = 0;
    for (int i = 0; i < NQ; i++) {
        tiled(&h, i, o);
        for (int c = 0; c < D; c++) worst_t = fmaxf(worst_t, fabsf(o[c] - ref[i * D + c]));
        split(&h, i, o);
        for (int c = 0; c < D; c++) worst_s = fmaxf(worst_s, fabsf(o[c] - ref[i * D + c]));
        empty += kvm_fb_visible(h.pos, NE, h.qpos[i]) == N_DISTILLED; /* only distilled entries visible */
    }
    printf("tiled max|d| %.3g, split max|d| %.3g\n", worst_t, worst_s);
    ck_assert_int_ge(empty, 1);
    ck_assert_float_le(worst_t, 2e-6f);
    ck_assert_float_le(worst_s, 2e-6f);
}
END_TEST

/* the statistics pass: p = e^(s − LSE) per visible entry reproduces the CPU's probabilities;
 * row entropies, key mass over a window and the last row follow from them */
START_TEST(test_stats_pass_matches_cpu_probs)
{
    static head h;
    static float ref[NQ * D], probs[NQ * NE];
    make_head(&h, 11);
    cpu_ref(&h, ref, probs);
    const int win0 = NQ - 8;
    float mass[NE] = {0}, mass_ref[NE] = {0}, worst = 0, o[D];
    for (int i = 0; i < NQ; i++) {
        float lse = tiled(&h, i, o), ent_ref = 0, sum = 0;
        double z = 0, xt = 0; /* the CUDA pass's entropy sums, its row's LSE as reference */
        int64_t vis = kvm_fb_visible(h.pos, NE, h.qpos[i]);
        for (int64_t e = 0; e < NE; e++) {
            float sc = kvm_fb_score(h.q + i * D, h.k + e * D, 1.0f / sqrtf((float)D), h.bias[e], D);
            float p = e < vis ? kvm_fb_prob(sc, lse) : 0.0f;
            worst = fmaxf(worst, fabsf(p - probs[i * NE + e]));
            z += p, xt += kvm_fb_entropy_acc(p, sc - lse);
            ent_ref += probs[i * NE + e] > 0 ? -probs[i * NE + e] * logf(probs[i * NE + e]) : 0.0f;
            sum += p;
            if (i >= win0) mass[e] += p, mass_ref[e] += probs[i * NE + e];
        }
        ck_assert_float_eq_tol(sum, 1.0f, 1e-5f);
        ck_assert_float_eq_tol(kvm_fb_entropy_finish(z, xt), ent_ref, 1e-5f); /* vs a log per weight */
    }
    for (int e = 0; e < NE; e++) ck_assert_float_eq_tol(mass[e], mass_ref[e], 1e-5f);
    ck_assert_float_le(worst, 1e-6f);
}
END_TEST

START_TEST(test_online_edge_cases)
{
    kvm_fb_online a = {-INFINITY, 0.0f}, b = {-INFINITY, 0.0f};
    float acc_a[2] = {0, 0}, acc_b[2] = {0, 0};
    ck_assert_float_eq(kvm_fb_online_inv(&a), 0.0f); /* nothing visible: output 0, not NaN */
    kvm_fb_online_merge(&a, acc_a, &b, acc_b, 2);  /* two empty parts */
    ck_assert_float_eq(a.l, 0.0f);
    b = (kvm_fb_online){3.0f, 2.0f};
    acc_b[0] = 4.0f;
    kvm_fb_online_merge(&a, acc_a, &b, acc_b, 2); /* empty + part = part */
    ck_assert_float_eq(a.m, 3.0f);
    ck_assert_float_eq(a.l, 2.0f);
    ck_assert_float_eq(acc_a[0], 4.0f);
    ck_assert_float_eq(kvm_fb_online_rescale(&a, 1.0f), 1.0f); /* a lower tile maximum changes nothing */
    ck_assert_float_eq_tol(kvm_fb_online_rescale(&a, 4.0f), expf(-1.0f), 1e-6f);
    ck_assert_float_eq(kvm_fb_entropy_acc(0.0f, -INFINITY), 0.0f); /* a masked entry: 0, not NaN */
    ck_assert_float_eq(kvm_fb_entropy_finish(0.0, 0.0), 0.0f);     /* nothing visible */
    ck_assert_float_eq_tol(kvm_fb_entropy_finish(4.0, 0.0), logf(4.0f), 1e-7f); /* uniform over 4 */
    ck_assert_float_eq(kvm_fb_expf(-80.0f), 0.0f);
    ck_assert_float_eq_tol(kvm_fb_expf(1.0f), expf(1.0f), 1e-6f);
    ck_assert(isnan(kvm_fb_expf(NAN)));
}
END_TEST

/* the row and element bodies against their definitions (the CPU table calls them too) */
START_TEST(test_row_bodies)
{
    float x[4] = {1, -2, 3, 0.5f}, w[4] = {1, 2, 0.5f, -1}, ss = 0;
    for (int i = 0; i < 4; i++) ss += x[i] * x[i];
    float inv = kvm_fb_rms_inv(ss, 4, 1e-5f);
    ck_assert_float_eq_tol(inv, 1.0f / sqrtf(ss / 4 + 1e-5f), 1e-7f);
    ck_assert_float_eq_tol(kvm_fb_rms_elem(w[1], inv, x[1]), 2.0f * -2.0f * inv, 1e-6f);
    float v[4] = {1, 2, 3, 4}, u[4] = {1, 2, 3, 4};
    kvm_fb_rope_pair(v, 1, 2, 0, 0.0f, 1.0f); /* interleaved pair (2, 3) by 90° */
    ck_assert_float_eq(v[2], -4.0f);
    ck_assert_float_eq(v[3], 3.0f);
    kvm_fb_rope_pair(u, 1, 2, 1, 0.0f, 1.0f); /* half pair (1, 3) by 90° */
    ck_assert_float_eq(u[1], -4.0f);
    ck_assert_float_eq(u[3], 2.0f);
    ck_assert_float_eq_tol(kvm_fb_swiglu(2.0f, 3.0f), 2.0f / (1.0f + expf(-2.0f)) * 3.0f, 1e-6f);
    float row[5] = {1, 2, 3, 9, 9}, table[6] = {0, 1, 2, 3, 4, 5}, e[3];
    float r1 = kvm_fb_softmax_row(row, NULL, 3, 5, 1);
    ck_assert_float_eq_tol(row[0] + row[1] + row[2], 1.0f, 1e-6f);
    ck_assert_float_eq(row[3], 0.0f);
    ck_assert_float_gt(r1, 0.0f);
    kvm_fb_embed_row(e, table, 1, 3);
    ck_assert_float_eq(e[0], 3.0f);
    ck_assert_float_eq(e[2], 5.0f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("forward_body");
    TCase *tc = tcase_create("bodies");
    tcase_add_test(tc, test_tiled_and_split_match_cpu);
    tcase_add_test(tc, test_stats_pass_matches_cpu_probs);
    tcase_add_test(tc, test_online_edge_cases);
    tcase_add_test(tc, test_row_bodies);
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
