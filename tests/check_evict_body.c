/* check_evict_body.c: the eviction bodies (kernels/kvm_evict_body.h) in the CUDA selection's
 * order — every key scored on its own, kept when its kvm_eb_rank is below the number to choose —
 * against the CPU selection (kvm_evict_select: the same scores, sorted) on stories260K's
 * statistics for every scored pattern, every (layer, KV head) and several budgets: the kept sets
 * are equal. Also the order on ties and NaNs against kvm_evict_topk. The decode phase: a policy
 * keeping its scores per cache entry (compacted with the cache, as a device keeps them) and
 * choosing victims with the decode bodies evicts the same entries, step by step, as the CPU
 * policy's scores by position (kvm_evict_decode_new), for H2O, SnapKV and PyramidKV. On a GPU the
 * device selection and compaction themselves (kvm_cuda_model_evict) are tests/check_cuda_forward's. */
#include "common/kvm_error.h"
#include "compress/evict/kvm_evict.h"
#include "kernels/kvm_evict_body.h"
#include "model/kvm_capture.h"
#include "model/kvm_forward.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N_CTX = 256 };

/* The device's selection on the CPU: scores one key at a time, ranks, the tail; keep[] increasing. */
static void device_order(kvm_pattern p, const kvm_evict_params *prm, const kvm_evict_attn *a, int64_t b, int64_t *keep,
                         int64_t *n_keep)
{
    const int64_t n = a->n;
    int64_t m, tail0, k, c = 0;
    kvm_eb_zones((int)p, prm->recent_frac, prm->window, n, b, &m, &tail0, &k);
    float *vote = malloc((size_t)(m + 1) * sizeof *vote), *score = malloc((size_t)(m + 1) * sizeof *score);
    ck_assert(vote && score);
    const int64_t rows = prm->window < a->n_obs ? prm->window : a->n_obs, half = (prm->pool > 1 ? prm->pool : 1) / 2;
    for (int64_t j = 0; j < m; j++)
        vote[j] = p == KVM_PATTERN_H2O    ? kvm_eb_h2o(a->mass, n, a->n_group, j)
                  : p == KVM_PATTERN_TOVA ? kvm_eb_tova(a->obs, a->n_obs, n, a->n_group, j)
                                          : kvm_eb_snap_vote(a->obs, a->n_obs, rows, n, a->n_group, j);
    for (int64_t j = 0; j < m; j++)
        score[j] = p == KVM_PATTERN_SNAPKV || p == KVM_PATTERN_PYRAMIDKV ? kvm_eb_pool(vote, m, half, j) : vote[j];
    for (int64_t j = 0; j < m; j++)
        if (kvm_eb_rank(score, m, j) < k) keep[c++] = j;
    for (int64_t j = tail0; j < n; j++)
        keep[c++] = j;
    *n_keep = c;
    free(vote);
    free(score);
}

START_TEST(test_device_order_equals_cpu_on_stories)
{
    kvm_model *model;
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    const kvm_model_config *c = &model->cfg;
    int32_t ids[256];
    kvm_test_golden_ids(ids);
    kvm_forward *f;
    kvm_kvcache *full;
    kvm_capture *cap;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    ck_assert_int_eq(kvm_forward_new(model, NULL, N_CTX, &f), 0);
    ck_assert_int_eq(kvm_capture_new(c, N_CTX, &co, &cap), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, N_CTX, &full), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, full, ids, N_CTX, NULL, KVM_LOGITS_NONE), 0);
    const kvm_evict_params prm = kvm_evict_params_default();
    const int grp = c->n_heads / c->n_kv_heads;
    float *obs = malloc((size_t)grp * prm.window * N_CTX * sizeof *obs),
          *mass = malloc((size_t)grp * N_CTX * sizeof *mass);
    int64_t cpu[N_CTX], dev[N_CTX], n_cpu, n_dev, compared = 0;
    ck_assert(obs && mass);
    static const kvm_pattern pats[] = {KVM_PATTERN_H2O, KVM_PATTERN_TOVA, KVM_PATTERN_SNAPKV, KVM_PATTERN_PYRAMIDKV};
    static const int64_t budgets[] = {1, 7, 20, 64, 128, 255};
    for (size_t pi = 0; pi < sizeof pats / sizeof pats[0]; pi++)
        for (int l = 0; l < c->n_layers; l++)
            for (int g = 0; g < c->n_kv_heads; g++) {
                const int64_t n_obs = pats[pi] == KVM_PATTERN_TOVA || pats[pi] == KVM_PATTERN_H2O ? 1 : prm.window;
                kvm_evict_attn a;
                ck_assert_int_eq(kvm_evict_attn_from_capture(c, cap, l, g, n_obs, obs, mass, &a), 0);
                for (size_t bi = 0; bi < sizeof budgets / sizeof budgets[0]; bi++) {
                    ck_assert_int_eq(kvm_evict_select(pats[pi], &prm, &a, budgets[bi], cpu, &n_cpu), 0);
                    device_order(pats[pi], &prm, &a, budgets[bi], dev, &n_dev);
                    ck_assert_int_eq(n_cpu, budgets[bi]);
                    ck_assert_int_eq(n_dev, n_cpu);
                    for (int64_t i = 0; i < n_cpu; i++)
                        ck_assert_msg(cpu[i] == dev[i],
                                      "%s layer %d head %d b %lld: kept[%lld] CPU %lld, device order %lld",
                                      kvm_pattern_name(pats[pi]), l, g, (long long)budgets[bi], (long long)i,
                                      (long long)cpu[i], (long long)dev[i]);
                    compared++;
                }
            }
    printf("kept sets equal in both orders: %lld (pattern, layer, KV head, budget) cases\n", (long long)compared);
    free(obs);
    free(mass);
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
    kvm_model_close(&model);
}
END_TEST

/* ---- the decode phase with per-entry scores ---- */

typedef struct entry_policy {
    const kvm_model_config *c;
    const kvm_evict_plan *plan;
    float *score[64];   /* [layer·n_kv + g][entries], aligned with the cache's entries */
} entry_policy;

/* After an append: while a head holds more than its budget, the victim among its candidates
 * by the decode bodies; the entry and its score are dropped together. */
static int entry_update(void *user, kvm_attn_site *s)
{
    entry_policy *ep = user;
    const int H = ep->c->n_kv_heads;
    const kvm_evict_params *prm = &ep->plan->params;
    for (int g = 0; g < H; g++) {
        const int i = s->layer * H + g, p = (int)ep->plan->pattern[i];
        const int64_t b = ep->plan->budget[i];
        kvm_kv_head *h = kvm_kvcache_head(s->cache, s->layer, g);
        float *sc = ep->score[i]; /* budget + 2 floats: the budget, the appended entry, one spare */
        while (h->n > b) { /* a fresh eviction leaves no distilled entries: all are positioned */
            const int64_t prot = kvm_eb_decode_protected(p, prm->recent_frac, prm->window, b), m = h->n - prot;
            int64_t v = 0;
            if (m > 0) {
                float pooled[N_CTX + 64];
                for (int64_t j = 0; j < m; j++) pooled[j] = p == 1 ? sc[j] : kvm_eb_pool(sc, m, prm->pool / 2, j);
                v = kvm_eb_victim(pooled, m);
            }
            kvm_kvcache_drop(h, s->cache->head_dim, v);
            memmove(sc + v, sc + v + 1, (size_t)(h->n - v) * sizeof *sc);
            sc[h->n] = 0; /* the next appended entry starts unscored */
        }
    }
    return 0;
}

/* After attention: every entry's score updated from the kernel's MASS (host memory on the CPU). */
static int entry_post(void *user, const kvm_attn_site *s)
{
    entry_policy *ep = user;
    const int H = ep->c->n_kv_heads, grp = ep->c->n_heads / H;
    const kvm_attn_layer *a = s->attn;
    for (int g = 0; g < H; g++) {
        const int i = s->layer * H + g;
        for (int64_t e = 0; e < a->n_e[g]; e++)
            ep->score[i][e] = kvm_eb_decode_score(ep->score[i][e], (int)ep->plan->pattern[i], ep->plan->params.window,
                                                  s->n_q, a->mass + (int64_t)g * grp * a->ld_e, a->ld_e, grp, e);
    }
    return 0;
}

START_TEST(test_decode_entry_scores_equal_cpu_policy)
{
    enum { STEPS = 40, B = 24 };
    kvm_model *model;
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    const kvm_model_config *c = &model->cfg;
    ck_assert_int_le(c->n_layers * c->n_kv_heads, 64);
    int32_t ids[256];
    kvm_test_golden_ids(ids);
    kvm_forward *f;
    kvm_kvcache *full;
    kvm_capture *cap;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    const int64_t n = N_CTX - STEPS, grp = c->n_heads / c->n_kv_heads;
    ck_assert_int_eq(kvm_forward_new(model, NULL, n, &f), 0);
    ck_assert_int_eq(kvm_capture_new(c, n, &co, &cap), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, N_CTX, &full), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, full, ids, n, NULL, KVM_LOGITS_NONE), 0);
    kvm_forward_clear_hooks(f);
    kvm_compress_input in = {.model = model, .full = full, .cap = cap, .n_tokens = n, .tokens = ids};
    static const kvm_pattern pats[] = {KVM_PATTERN_H2O, KVM_PATTERN_SNAPKV, KVM_PATTERN_PYRAMIDKV};
    float *logits = malloc((size_t)c->vocab_size * sizeof *logits), *obs = malloc((size_t)grp * n * n * sizeof *obs),
          *mass = malloc((size_t)grp * n * sizeof *mass);
    int64_t steps = 0;
    for (size_t pi = 0; pi < sizeof pats / sizeof pats[0]; pi++) {
        kvm_evict_plan *pl;
        kvm_decode_policy *pol;
        kvm_kvcache *a, *b;
        ck_assert_int_eq(kvm_evict_plan_new(c->n_layers, c->n_kv_heads, pats[pi], B, &pl), 0);
        ck_assert_int_eq(kvm_evict_prefill(&in, pl, &a), 0);
        ck_assert_int_eq(kvm_evict_prefill(&in, pl, &b), 0);
        ck_assert_int_eq(kvm_evict_decode_new(c, pl, &in, &pol), 0);
        /* per-entry scores seeded as the device would from the prefill's statistics: the kept
         * entries' prefill scores (H2O mass, SnapKV window votes), gathered by position */
        entry_policy ep = {.c = c, .plan = pl};
        const int64_t w = pl->params.window < n ? pl->params.window : n;
        for (int l = 0; l < c->n_layers; l++)
            for (int g = 0; g < c->n_kv_heads; g++) {
                kvm_evict_attn at;
                ck_assert_int_eq(kvm_evict_attn_from_capture(c, cap, l, g, w, obs, mass, &at), 0);
                const kvm_kv_head *h = kvm_kvcache_head(b, l, g);
                float *sc = ep.score[l * c->n_kv_heads + g] = calloc((size_t)h->n + 2, sizeof(float));
                for (int64_t e = 0; e < h->n; e++)
                    sc[e] = pats[pi] == KVM_PATTERN_H2O ? kvm_eb_h2o(mass, n, (int)grp, h->pos[e])
                                                        : kvm_eb_snap_vote(obs, w, w, n, (int)grp, h->pos[e]);
            }
        const kvm_hooks eh = {.user = &ep, .cache_update = entry_update, .post_attn = entry_post,
                              .stats = KVM_ATTN_STAT_MASS};
        for (int t = 0; t < STEPS; t++) {
            ck_assert_int_eq(kvm_forward_add_hooks(f, &pol->hooks), 0);
            ck_assert_int_eq(kvm_forward_decode(f, a, ids[n + t], logits), 0);
            kvm_forward_clear_hooks(f);
            ck_assert_int_eq(kvm_forward_add_hooks(f, &eh), 0);
            ck_assert_int_eq(kvm_forward_decode(f, b, ids[n + t], logits), 0);
            kvm_forward_clear_hooks(f);
            for (int l = 0; l < c->n_layers; l++)
                for (int g = 0; g < c->n_kv_heads; g++) {
                    const kvm_kv_head *ha = kvm_kvcache_head(a, l, g), *hb = kvm_kvcache_head(b, l, g);
                    ck_assert_int_eq(ha->n, hb->n);
                    for (int64_t e = 0; e < ha->n; e++)
                        ck_assert_msg(ha->pos[e] == hb->pos[e], "%s step %d layer %d head %d: entry %lld at %d (CPU "
                                      "policy), %d (per-entry scores)", kvm_pattern_name(pats[pi]), t, l, g,
                                      (long long)e, ha->pos[e], hb->pos[e]);
                }
            steps++;
        }
        for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) free(ep.score[i]);
        kvm_decode_policy_free(&pol);
        kvm_kvcache_free(&a);
        kvm_kvcache_free(&b);
        kvm_evict_plan_free(&pl);
    }
    printf("decode eviction with per-entry scores: the CPU policy's kept sets at every one of %lld steps\n",
           (long long)steps);
    free(logits);
    free(obs);
    free(mass);
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
    kvm_model_close(&model);
}
END_TEST

/* the decode victim order: lowest score, ties to the later entry, NaN after every number */
START_TEST(test_victim_order)
{
    const float nan = __builtin_nanf("");
    const float s[] = {2, 1, 3, 1, nan, 1};
    ck_assert_int_eq(kvm_eb_victim(s, 6), 5);     /* the last of the three 1s */
    ck_assert_int_eq(kvm_eb_victim(s, 3), 1);
    const float t[] = {nan, 4, 4};
    ck_assert_int_eq(kvm_eb_victim(t, 3), 2);     /* a NaN first is not chosen over numbers */
    ck_assert_int_eq(kvm_eb_victim(t, 1), 0);
    ck_assert_int_eq(kvm_eb_decode_protected(1, 0.5, 32, 9), 4);
    ck_assert_int_eq(kvm_eb_decode_protected(2, 0.5, 32, 9), 0);
    ck_assert_int_eq(kvm_eb_decode_protected(3, 0.5, 32, 9), 9);
    ck_assert_int_eq(kvm_eb_decode_protected(4, 0.5, 4, 9), 4);
    const float m[] = {0.25f, 0.5f}; /* two group heads, ld 1 */
    ck_assert_float_eq(kvm_eb_decode_score(1.0f, 1, 4, 2, m, 1, 2, 0), 1.75f);
    ck_assert_float_eq(kvm_eb_decode_score(1.0f, 3, 4, 2, m, 1, 2, 0), 0.5625f + 0.75f); /* 1 · 0.75² + mass */
}
END_TEST

/* ties go to the earlier key, NaN last: rank < k marks what kvm_evict_topk marks */
START_TEST(test_rank_ties_and_nan)
{
    const float nan = __builtin_nanf("");
    const float s[] = {1, 3, 3, nan, 2, 3, nan, 1, 0, 2};
    const int64_t n = sizeof s / sizeof s[0];
    for (int64_t k = 0; k <= n; k++) {
        uint8_t mark[sizeof s / sizeof s[0]];
        ck_assert_int_eq(kvm_evict_topk(s, n, k, mark), 0);
        for (int64_t j = 0; j < n; j++)
            ck_assert_msg((kvm_eb_rank(s, n, j) < k) == mark[j], "k %lld key %lld: rank %lld, top-k mark %d",
                          (long long)k, (long long)j, (long long)kvm_eb_rank(s, n, j), mark[j]);
    }
    ck_assert_int_eq(kvm_eb_rank(s, n, 1), 0); /* the first 3 */
    ck_assert_int_eq(kvm_eb_rank(s, n, 6), 9); /* the later NaN is last */
    ck_assert(kvm_eb_before(1.0f, 5, nan, 0)); /* a number before any NaN */
}
END_TEST

int main(void)
{
    Suite *s = suite_create("evict_body");
    TCase *tc = tcase_create("evict_body");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_device_order_equals_cpu_on_stories);
    tcase_add_test(tc, test_rank_ties_and_nan);
    tcase_add_test(tc, test_victim_order);
    tcase_add_test(tc, test_decode_entry_scores_equal_cpu_policy);
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
