/* check_target.c: [compress] target_kl in the pipeline (issue 14, item 5): the compress
 * worker's budget search returns the smallest budget on the grid whose KL on the search part
 * is within the target (checked against budgets it did not return), restores the config,
 * handles documents without tokens after their context, and `kvmill run` stores caches at
 * the chosen budgets and reports them; bad values are refused before anything starts. */
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"
#include "model/kvm_model.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_target.h"
#include "pipeline/kvm_worker.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 192, T = 32 };

static kvm_model *model;
static int32_t ids[256];

static void load_model(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void free_model(void) { kvm_model_close(&model); }

static kvm_config *config(const char *compress_extra)
{
    char text[2048];
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = %d\n[eval]\ncontinuation = %d\n[compress]\n%s\n",
             kvm_test_data_path("models/stories260K.bin"), N, T, compress_extra);
    kvm_config *c = NULL;
    ck_assert_msg(kvm_config_parse(text, "t.ini", &c) == 0, "%s", kvm_errmsg());
    return c;
}

/* KL on tokens [N, N+T) of method h2o at budget b, independently of the search. */
static double kl_at(int64_t b)
{
    char extra[128];
    snprintf(extra, sizeof extra, "method = h2o\nbudget = %lld", (long long)b);
    kvm_config *c = config(extra);
    kvm_eval_doc *d = NULL;
    kvm_kvcache *cc = NULL;
    kvm_eval_result r;
    kvm_store_id mid = {{0}};
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + T, N, T, &d), 0);
    kvm_compress_input in = *kvm_eval_doc_input(d);
    in.n_future = 64;
    ck_assert_msg(kvm_worker_compress(c, &in, NULL, &mid, &cc) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_eval_continue(d, cc, NULL, NULL, &r), 0);
    double kl = kvm_eval_kl_range(d, 0, T);
    kvm_kvcache_free(&cc);
    kvm_eval_doc_free(&d);
    kvm_config_free(&c);
    return kl;
}

static int64_t entries_per_head(const kvm_kvcache *c)
{
    return kvm_kvcache_entries(c) / ((int64_t)c->n_layers * c->n_kv_heads);
}

/* The search on h2o with the target set to the KL of budget 64: the budget returned is a
 * multiple of 16 at most 64 whose KL is within the target while one step less is not; the
 * returned cache has that budget; the config's budget is restored; the check part's KL is
 * reported. A document with no tokens after its context searches on its own end. */
START_TEST(test_search_smallest)
{
    double target = kl_at(64);
    ck_assert(target > 0);
    char extra[256];
    snprintf(extra, sizeof extra, "method = h2o\nbudget = 40\ntarget_kl = %.17g\ntarget_step = 16", target);
    kvm_config *c = config(extra);
    kvm_eval_doc *d = NULL;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + 2 * T, N, 2 * T, &d), 0); /* the job's prefill */
    kvm_compress_input in = *kvm_eval_doc_input(d);
    in.n_future = 64;
    kvm_kvcache *cc = NULL;
    kvm_target_result r;
    kvm_store_id mid = {{0}};
    ck_assert_msg(kvm_target_compress(c, &in, ids + N, 2 * T, NULL, &mid, NULL, &cc, &r) == 0, "%s", kvm_errmsg());
    printf("target %.6f: budget %lld, KL %.6f, check %.6f, %d probes, %d nonmonotone\n", target, (long long)r.budget,
           r.kl_search, r.kl_check, r.probes, r.nonmonotone);
    ck_assert(r.reached);
    ck_assert_int_eq(r.n_ctx_search, N);
    ck_assert_int_le(r.budget, 64);
    ck_assert_int_eq(r.budget % 16, 0);
    ck_assert(r.kl_search <= target);
    ck_assert(fabs(r.kl_search - kl_at(r.budget)) <= 1e-9 + 1e-6 * r.kl_search);
    if (r.budget > 16)
        ck_assert_msg(kl_at(r.budget - 16) > target, "budget %lld is not the smallest", (long long)r.budget);
    ck_assert(isfinite(r.kl_check) && r.kl_check >= 0);
    ck_assert_int_eq(entries_per_head(cc), r.budget);
    ck_assert_int_eq(cc->next_pos, N);
    ck_assert_str_eq(kvm_config_str(c, "compress", "budget"), "40");
    kvm_kvcache_free(&cc);
    /* a worker's device forward on the CPU (pipeline/kvm_devmodel.h) searches on the host: the same result */
    kvm_devmodel cpu_dev;
    kvm_target_result r2;
    ck_assert_int_eq(kvm_devmodel_init(&cpu_dev, "compress", "cpu", "-", "-"), 0);
    ck_assert_int_eq(kvm_target_compress(c, &in, ids + N, 2 * T, NULL, &mid, &cpu_dev, &cc, &r2), 0);
    ck_assert(r2.budget == r.budget && r2.kl_search == r.kl_search && r2.kl_check == r.kl_check);
    kvm_devmodel_deinit(&cpu_dev);
    kvm_kvcache_free(&cc);
    /* T tokens after the context: no check part */
    ck_assert_int_eq(kvm_target_compress(c, &in, ids + N, T, NULL, &mid, NULL, &cc, &r), 0);
    ck_assert(isnan(r.kl_check));
    ck_assert_int_eq(entries_per_head(cc), r.budget);
    kvm_kvcache_free(&cc);
    /* none: the search runs on context N - T and its last T tokens; the budget is scaled to N */
    ck_assert_int_eq(kvm_target_compress(c, &in, NULL, 0, NULL, &mid, NULL, &cc, &r), 0);
    ck_assert_int_eq(r.n_ctx_search, N - T);
    ck_assert(isnan(r.kl_check));
    ck_assert_int_le(r.budget, N - 1);
    ck_assert(r.budget % 16 == 0 || r.budget == N - 1);
    ck_assert_int_eq(entries_per_head(cc), r.budget);
    kvm_kvcache_free(&cc);
    /* an unreachable target: the largest budget, reached = 0 */
    ck_assert_int_eq(kvm_config_set(c, "compress", "target_kl", "1e-12"), 0);
    ck_assert_int_eq(kvm_target_compress(c, &in, ids + N, 2 * T, NULL, &mid, NULL, &cc, &r), 0);
    ck_assert(!r.reached || r.kl_search <= 1e-12);
    if (!r.reached) ck_assert_int_eq(r.budget, N - 1);
    kvm_kvcache_free(&cc);
    /* target_kl off */
    ck_assert_int_eq(kvm_config_set(c, "compress", "target_kl", "0"), 0);
    ck_assert_int_eq(kvm_target_compress(c, &in, ids + N, 2 * T, NULL, &mid, NULL, &cc, &r), KVM_EINVAL);
    ck_assert_ptr_null(cc);
    kvm_config_free(&c);
    kvm_eval_doc_free(&d);
}
END_TEST

static kvm_store_id id_of(const char *extra)
{
    kvm_config *c = config(extra);
    kvm_store_id id;
    ck_assert_int_eq(kvm_jobcfg_config_id(c, NULL, &id, NULL, NULL), 0);
    kvm_config_free(&c);
    return id;
}

/* target_kl = 0 keeps the ids of configs without the keys (and target_step is then ignored);
 * each target gets its own; method full / polykv are refused with it. */
START_TEST(test_config)
{
    kvm_store_id a = id_of("method = h2o"), b = id_of("method = h2o\ntarget_kl = 0\ntarget_step = 8"),
                 c = id_of("method = h2o\ntarget_kl = 0.01"), d = id_of("method = h2o\ntarget_kl = 0.02");
    ck_assert_int_eq(memcmp(&a, &b, sizeof a), 0);
    ck_assert_int_ne(memcmp(&a, &c, sizeof a), 0);
    ck_assert_int_ne(memcmp(&c, &d, sizeof a), 0);
    const char *bad[] = {"method = full\ntarget_kl = 0.1", "method = polykv\ntarget_kl = 0.1"};
    for (int i = 0; i < 2; i++) {
        kvm_config *cfg = config(bad[i]);
        ck_assert_int_eq(kvm_jobcfg_check(cfg), KVM_EINVAL);
        ck_assert_msg(strstr(kvm_errmsg(), "target_kl chooses a budget per document"), "%s", kvm_errmsg());
        kvm_config_free(&cfg);
    }
    const char *range[] = {"target_kl = -0.1", "target_kl = nan", "target_step = 0", "target_kl = x"};
    for (int i = 0; i < 4; i++) {
        char text[1024];
        snprintf(text, sizeof text, "[model]\npath = x\n[compress]\n%s\n", range[i]);
        kvm_config *cfg = NULL;
        ck_assert_msg(kvm_config_parse(text, "t.ini", &cfg) != 0, "%s accepted", range[i]);
        ck_assert_msg(strstr(kvm_errmsg(), "target_"), "%s: %s", range[i], kvm_errmsg());
    }
}
END_TEST

/* `kvmill run` with target_kl on the embedded corpus (h2o): exit 0, the summary's target_kl
 * line, every stored cache at a budget on the grid (or N - 1); a rerun skips them all (same
 * config id); a window too small for the search and check parts is refused with exit 2. */
START_TEST(test_cli_run)
{
    char *dir = kvm_test_tmpdir(), cfgp[4200], text[4096], cmd[8192], *out = NULL, *err = NULL;
    snprintf(cfgp, sizeof cfgp, "%s/t.ini", dir);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 256\n[compress]\nmethod = h2o\nbudget = 32\ntarget_kl = 0.05\n"
             "target_step = 32\n[eval]\ncontinuation = 32\n[store]\npath = %s/store\n[stages]\nbin_dir = %s\n"
             "[run]\nrun_dir = %s/run\n",
             kvm_test_data_path("models/stories260K.bin"), dir, kvm_test_bin(), dir);
    ck_assert_int_eq(kvm_test_write_file(cfgp, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill run --config %s --corpus %s", kvm_test_bin(), cfgp,
             kvm_test_data_path("corpus"));
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    printf("%s", strstr(out, "target_kl:") ? strstr(out, "target_kl:") : out);
    ck_assert_msg(strstr(out, "target_kl: 0.05 nats: budget per KV head ") && strstr(out, "over 6 documents"), "%s",
                  out);
    ck_assert_msg(strstr(out, "compressed=6 "), "%s", out);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill store ls --store %s/store --csv", kvm_test_bin(), dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    int rows = 0;
    for (char *line = strchr(out, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        long long tokens, entries;
        ck_assert_int_eq(sscanf(line + 1, "%*64[0-9a-f],%*64[0-9a-f],%*64[0-9a-f],%lld,%lld", &tokens, &entries), 2);
        long long per_head = entries / (5 * 4); /* stories260K: 5 layers, 4 KV heads */
        ck_assert_msg(entries % 20 == 0 && (per_head % 32 == 0 || per_head == tokens - 1), "entries %lld", entries);
        rows++;
    }
    ck_assert_int_eq(rows, 6);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill run --config %s --corpus %s", kvm_test_bin(), cfgp,
             kvm_test_data_path("corpus"));
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(strstr(out, "compressed=0 skipped=6 "), "%s", out);
    free(out);
    free(err);
    /* 480 + 2 x 32 > 512 */
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 480\n[compress]\nmethod = h2o\nbudget = 32\ntarget_kl = 0.05\n"
             "[eval]\ncontinuation = 32\n[store]\npath = %s/store\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfgp, text, strlen(text)), 0);
    st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "target_kl searches on the 64 tokens after the context"), "exit %d: %s", st,
                  err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *target_suite(void)
{
    Suite *s = suite_create("target");
    TCase *tc = tcase_create("search_smallest");
    tcase_add_checked_fixture(tc, load_model, free_model);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_search_smallest);
    suite_add_tcase(s, tc);
    tc = tcase_create("config");
    tcase_add_test(tc, test_config);
    suite_add_tcase(s, tc);
    tc = tcase_create("cli_run");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_cli_run);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return kvm_test_run_suite(target_suite()); }
