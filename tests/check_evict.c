/* check_evict.c: eviction patterns: each pattern's prefill selection on hand-made
 * attention inputs with known kept sets, deterministic ties, budget apportioning and the
 * PyramidKV schedule, prefill plans on the real model, and the decode-phase hooks keeping
 * each head within budget. */
#include "common/kvm_error.h"
#include "compress/evict/kvm_evict.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void expect_keep(const int64_t *keep, int64_t n_keep, const int64_t *want, int64_t n_want)
{
    ck_assert_int_eq(n_keep, n_want);
    for (int64_t i = 0; i < n_want; i++)
        ck_assert_msg(keep[i] == want[i], "kept[%lld] = %lld, want %lld", (long long)i, (long long)keep[i],
                      (long long)want[i]);
}

START_TEST(test_topk_ties)
{
    float s[6] = {1, 3, 3, 2, 3, 0};
    uint8_t m[6];
    ck_assert_int_eq(kvm_evict_topk(s, 6, 2, m), 0);
    uint8_t want[6] = {0, 1, 1, 0, 0, 0}; /* three 3s: the two earliest win */
    ck_assert_mem_eq(m, want, 6);
    ck_assert_int_eq(kvm_evict_topk(s, 6, 6, m), 0);
    for (int i = 0; i < 6; i++)
        ck_assert_int_eq(m[i], 1);
}
END_TEST

START_TEST(test_streaming)
{
    kvm_evict_params p = kvm_evict_params_default();
    kvm_evict_attn a = {.n = 10, .n_group = 1};
    int64_t keep[10], nk;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_STREAMING, &p, &a, 6, keep, &nk), 0);
    expect_keep(keep, nk, (int64_t[]){0, 1, 2, 3, 8, 9}, 6);
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_STREAMING, &p, &a, 3, keep, &nk), 0); /* budget < sinks */
    expect_keep(keep, nk, (int64_t[]){0, 1, 2}, 3);
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_STREAMING, &p, &a, 10, keep, &nk), 0); /* b ≥ n keeps all */
    ck_assert_int_eq(nk, 10);
}
END_TEST

START_TEST(test_h2o)
{
    kvm_evict_params p = kvm_evict_params_default();
    /* two query heads share the KV head; summed mass over [0, 8): 5 at 2, 5 at 6 (tie), 4 at 0 */
    float mass[2][10] = {{4, 0, 2, 1, 0, 0, 3, 0, 9, 9}, {0, 1, 3, 0, 0, 1, 2, 0, 9, 9}};
    kvm_evict_attn a = {.n = 10, .n_group = 2, .mass = &mass[0][0]};
    int64_t keep[10], nk;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_H2O, &p, &a, 4, keep, &nk), 0); /* 2 heavy + 2 recent */
    expect_keep(keep, nk, (int64_t[]){2, 6, 8, 9}, 4);
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_H2O, &p, &a, 5, keep, &nk), 0); /* 3 heavy + 2 recent */
    expect_keep(keep, nk, (int64_t[]){0, 2, 6, 8, 9}, 5);
    a.mass = NULL;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_H2O, &p, &a, 4, keep, &nk), KVM_EINVAL);
}
END_TEST

START_TEST(test_tova)
{
    kvm_evict_params p = kvm_evict_params_default();
    /* last query's attention for 2 heads; mean: .05 .25 .05 .15 .25 .25 → top-3 by mean, ties earlier */
    float obs[2][1][6] = {{{0.1f, 0.3f, 0.0f, 0.1f, 0.2f, 0.3f}}, {{0.0f, 0.2f, 0.1f, 0.2f, 0.3f, 0.2f}}};
    kvm_evict_attn a = {.n = 6, .n_group = 2, .n_obs = 1, .obs = &obs[0][0][0]};
    int64_t keep[6], nk;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_TOVA, &p, &a, 3, keep, &nk), 0);
    expect_keep(keep, nk, (int64_t[]){1, 4, 5}, 3);
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_TOVA, &p, &a, 4, keep, &nk), 0);
    expect_keep(keep, nk, (int64_t[]){1, 3, 4, 5}, 4);
}
END_TEST

START_TEST(test_snapkv)
{
    kvm_evict_params p = kvm_evict_params_default();
    p.window = 2;
    p.pool = 3;
    /* n = 10, window 2 (queries 8, 9), candidates [0, 8). Votes: a spike at 5; pooling
     * spreads it to 4..6; next a spike at 1 spreading to 0..2. Budget 5: top-3 + window:
     * {4, 5, 6} (plateau 4..6 wins), then 8, 9. */
    float obs[1][2][10] = {{{0, .1f, 0, 0, 0, .5f, 0, 0, .2f, .2f}, {0, .2f, 0, 0, 0, .3f, 0, 0, .2f, .1f}}};
    kvm_evict_attn a = {.n = 10, .n_group = 1, .n_obs = 2, .obs = &obs[0][0][0]};
    int64_t keep[10], nk;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_SNAPKV, &p, &a, 5, keep, &nk), 0);
    expect_keep(keep, nk, (int64_t[]){4, 5, 6, 8, 9}, 5);
    /* budget 6: one more from the 0..2 plateau (votes 0.3): the earliest, 0 */
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_SNAPKV, &p, &a, 6, keep, &nk), 0);
    expect_keep(keep, nk, (int64_t[]){0, 4, 5, 6, 8, 9}, 6);
    /* PyramidKV selects like SnapKV at the budget it is given */
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_PYRAMIDKV, &p, &a, 6, keep, &nk), 0);
    expect_keep(keep, nk, (int64_t[]){0, 4, 5, 6, 8, 9}, 6);
    a.n_obs = 1; /* too few observation rows */
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_SNAPKV, &p, &a, 5, keep, &nk), KVM_EINVAL);
}
END_TEST

START_TEST(test_bad_inputs)
{
    kvm_evict_params p = kvm_evict_params_default();
    kvm_evict_attn a = {.n = 10, .n_group = 1};
    int64_t keep[10], nk;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_STREAMING, &p, &a, 0, keep, &nk), KVM_EINVAL);
    ck_assert_int_eq(kvm_evict_select((kvm_pattern)9, &p, &a, 3, keep, &nk), KVM_EINVAL);
    kvm_pattern pat;
    ck_assert_int_eq(kvm_pattern_parse("bogus", &pat), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "snapkv"));
    ck_assert_int_eq(kvm_pattern_parse("tova", &pat), 0);
    ck_assert_int_eq(pat, KVM_PATTERN_TOVA);
    kvm_evict_plan *pl;
    ck_assert_int_eq(kvm_evict_plan_new(5, 4, KVM_PATTERN_H2O, 0, &pl), KVM_EINVAL);
    ck_assert_ptr_null(pl);
}
END_TEST

START_TEST(test_apportion_pyramid)
{
    int64_t out[5];
    ck_assert_int_eq(kvm_evict_pyramid_budgets(64, 5, out), 0);
    int64_t want[5] = {96, 80, 64, 48, 32};
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(out[i], want[i]);
    ck_assert_int_eq(kvm_evict_pyramid_budgets(7, 5, out), 0);
    int64_t s = 0;
    for (int i = 0; i < 5; i++) {
        s += out[i];
        ck_assert_int_ge(out[i], 1);
    }
    ck_assert_int_eq(s, 35);
    double w[4] = {1, 0, 100, 3};
    ck_assert_int_eq(kvm_evict_apportion(w, 4, 40, 5, out), 0);
    s = 0;
    for (int i = 0; i < 4; i++) {
        s += out[i];
        ck_assert_int_ge(out[i], 5);
    }
    ck_assert_int_eq(s, 40);
    ck_assert_int_eq(out[1], 5);
    ck_assert_int_eq(kvm_evict_apportion(w, 4, 19, 5, out), KVM_EINVAL); /* floor × n > total */
    /* a ceiling (a KV head keeps at most the context's N tokens): the heavy part is pinned at it
     * and its excess goes to the others by weight, not lost (PolyKV's +heads split of a layer
     * whose budget is N kept fewer entries than its budget) */
    double hw[4] = {1, 1, 10, 1};
    ck_assert_int_eq(kvm_evict_apportion_capped(hw, 4, 4 * 96, 1, 96, out), 0);
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(out[i], 96);
    ck_assert_int_eq(kvm_evict_apportion_capped(hw, 4, 200, 1, 96, out), 0);
    ck_assert_int_eq(out[2], 96);
    ck_assert_int_eq(out[0] + out[1] + out[3], 104);
    ck_assert(out[0] >= 34 && out[0] <= 35 && out[1] >= 34 && out[3] >= 34);
    ck_assert_int_eq(kvm_evict_apportion_capped(hw, 4, 500, 1, 96, out), 0); /* more than fits: 4 × 96 */
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(out[i], 96);
    /* near-zero weights beside heavy ones (an attention-sink head): the floor's pins are undone
     * once the heavy shares are capped, so the whole budget is given */
    double sink[4] = {10, 0.01, 0.01, 5};
    ck_assert_int_eq(kvm_evict_apportion_capped(sink, 4, 400, 1, 100, out), 0);
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(out[i], 100);
    ck_assert_int_eq(kvm_evict_apportion_capped(sink, 4, 300, 1, 100, out), 0);
    ck_assert(out[0] == 100 && out[3] == 100 && out[1] == 50 && out[2] == 50);
    ck_assert_int_eq(kvm_evict_apportion_capped(hw, 4, 40, 5, 4, out), KVM_EINVAL); /* ceiling below the floor */
    ck_assert_int_eq(kvm_evict_apportion_capped(w, 4, 40, 5, 0, out), 0);           /* no ceiling: as before */
    ck_assert_int_eq(out[1], 5);
}
END_TEST

/* ---- on the model: a 48-token context of the golden sequence ---- */
static kvm_model *model;
static int32_t ids[256];

static void load_model(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void free_model(void) { kvm_model_close(&model); }

enum { N_CTX = 48 };

/* Prefill N_CTX tokens with a capture; fills in. */
static void context(kvm_forward **f, kvm_kvcache **full, kvm_capture **cap, kvm_compress_input *in)
{
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    ck_assert_int_eq(kvm_forward_new(model, NULL, N_CTX, f), 0);
    ck_assert_int_eq(kvm_capture_new(&model->cfg, N_CTX, &co, cap), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 64, full), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(*f, kvm_capture_hooks(*cap)), 0);
    ck_assert_int_eq(kvm_forward_prefill(*f, *full, ids, N_CTX, NULL, KVM_LOGITS_NONE), 0);
    kvm_forward_clear_hooks(*f);
    *in = (kvm_compress_input){.model = model, .full = *full, .cap = *cap, .n_tokens = N_CTX, .n_future = 16};
}

START_TEST(test_prefill_plan)
{
    kvm_forward *f;
    kvm_kvcache *full, *c;
    kvm_capture *cap;
    kvm_compress_input in;
    context(&f, &full, &cap, &in);
    for (int p = 0; p < KVM_PATTERN_COUNT; p++) {
        kvm_evict_plan *pl;
        ck_assert_int_eq(kvm_evict_plan_new(5, 4, (kvm_pattern)p, 20, &pl), 0);
        ck_assert_int_eq(kvm_evict_prefill(&in, pl, &c), 0);
        ck_assert_int_eq(c->next_pos, N_CTX);
        for (int l = 0; l < 5; l++)
            for (int g = 0; g < 4; g++) {
                const kvm_kv_head *h = kvm_kvcache_head(c, l, g);
                int64_t b = pl->budget[l * 4 + g] < N_CTX ? pl->budget[l * 4 + g] : N_CTX;
                ck_assert_int_eq(h->n, b);
                for (int64_t e = 1; e < h->n; e++)
                    ck_assert_int_lt(h->pos[e - 1], h->pos[e]);
                /* keys are the full cache's at the kept positions */
                const kvm_kv_head *fh = kvm_kvcache_head(full, l, g);
                ck_assert_mem_eq(h->k + (h->n - 1) * 8, fh->k + (int64_t)h->pos[h->n - 1] * 8, 8 * sizeof(float));
                if (p == KVM_PATTERN_STREAMING)
                    for (int64_t e = 0; e < h->n; e++)
                        ck_assert_int_eq(h->pos[e], e < 4 ? e : N_CTX - (h->n - e));
                if (p == KVM_PATTERN_H2O || p == KVM_PATTERN_SNAPKV) ck_assert_int_eq(h->pos[h->n - 1], N_CTX - 1);
            }
        if (p == KVM_PATTERN_PYRAMIDKV) ck_assert_int_eq(kvm_kvcache_head(c, 0, 0)->n, 30);
        kvm_kvcache_free(&c);
        kvm_evict_plan_free(&pl);
    }
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
}
END_TEST

START_TEST(test_decode_policy)
{
    kvm_forward *f;
    kvm_kvcache *full, *c;
    kvm_capture *cap;
    kvm_compress_input in;
    context(&f, &full, &cap, &in);
    float *logits = malloc(512 * sizeof *logits);
    for (int p = 0; p < KVM_PATTERN_COUNT; p++) {
        kvm_evict_plan *pl;
        kvm_decode_policy *pol;
        ck_assert_int_eq(kvm_evict_plan_new(5, 4, (kvm_pattern)p, 12, &pl), 0);
        ck_assert_int_eq(kvm_evict_prefill(&in, pl, &c), 0);
        ck_assert_int_eq(kvm_evict_decode_new(&model->cfg, pl, &in, &pol), 0);
        ck_assert_int_eq(kvm_forward_add_hooks(f, &pol->hooks), 0);
        for (int t = 0; t < 10; t++)
            ck_assert_int_eq(kvm_forward_decode(f, c, ids[N_CTX + t], logits), 0);
        kvm_forward_clear_hooks(f);
        for (int l = 0; l < 5; l++)
            for (int g = 0; g < 4; g++) {
                const kvm_kv_head *h = kvm_kvcache_head(c, l, g);
                ck_assert_int_eq(h->n, pl->budget[l * 4 + g]);
                for (int64_t e = 1; e < h->n; e++)
                    ck_assert_int_lt(h->pos[e - 1], h->pos[e]);
                if (p == KVM_PATTERN_STREAMING) /* sinks + the most recent, new tokens included */
                    for (int64_t e = 0; e < h->n; e++)
                        ck_assert_int_eq(h->pos[e], e < 4 ? e : N_CTX + 10 - (h->n - e));
                if (p != KVM_PATTERN_TOVA) ck_assert_int_eq(h->pos[h->n - 1], N_CTX + 9); /* recent protected */
            }
        kvm_decode_policy_free(&pol);
        ck_assert_ptr_null(pol);
        kvm_kvcache_free(&c);
        kvm_evict_plan_free(&pl);
    }
    free(logits);
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
}
END_TEST

static Suite *evict_suite(void)
{
    Suite *s = suite_create("evict");
    struct {
        const char *name;
        const TTest *fn;
        int model;
    } cases[] = {{"topk_ties", test_topk_ties, 0},
                 {"streaming", test_streaming, 0},
                 {"h2o", test_h2o, 0},
                 {"tova", test_tova, 0},
                 {"snapkv", test_snapkv, 0},
                 {"bad_inputs", test_bad_inputs, 0},
                 {"apportion_pyramid", test_apportion_pyramid, 0},
                 {"prefill_plan", test_prefill_plan, 1},
                 {"decode_policy", test_decode_policy, 1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        if (cases[i].model) tcase_add_checked_fixture(tc, load_model, free_model);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(evict_suite()); }
