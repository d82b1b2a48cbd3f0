/* check_evict_body.c: the eviction bodies (kernels/kvm_evict_body.h) in the CUDA selection's
 * order — every key scored on its own, kept when its kvm_eb_rank is below the number to choose —
 * against the CPU selection (kvm_evict_select: the same scores, sorted) on stories260K's
 * statistics for every scored pattern, every (layer, KV head) and several budgets: the kept sets
 * are equal. Also the order on ties and NaNs against kvm_evict_topk. On a GPU the device
 * selection and compaction themselves (kvm_cuda_model_evict) are tests/check_cuda_forward's. */
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
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
