/* check_onpolicy.c: [compress] on_policy (issue 14, item 6): layers compressed in order, each
 * layer's repeat/continuation queries from a forward pass over the layers below already
 * compressed. Off is byte-identical to the option left out (and keeps config ids); on leaves
 * layer 0 as off makes it and changes the layers above; it is reproducible with a seed; with
 * k = the compress zone and the original keys the loss on on-policy queries is ~0; what it
 * cannot do is refused by name. stories260K. */
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "model/kvm_model.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_jobcfg.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvm_model *model;
static int32_t ids[256];
enum { N = 96, T = 32 };

static void model_setup(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void model_teardown(void) { kvm_model_close(&model); }

static int heads_equal(const kvm_kvcache *a, const kvm_kvcache *b, int layer)
{
    for (int g = 0; g < a->n_kv_heads; g++) {
        const kvm_kv_head *x = kvm_kvcache_head((kvm_kvcache *)a, layer, g),
                          *y = kvm_kvcache_head((kvm_kvcache *)b, layer, g);
        size_t nd = (size_t)(x->n * a->head_dim) * sizeof(float);
        if (x->n != y->n || memcmp(x->k, y->k, nd) || memcmp(x->v, y->v, nd) ||
            memcmp(x->bias, y->bias, (size_t)x->n * 4) || memcmp(x->pos, y->pos, (size_t)x->n * 4))
            return 0;
    }
    return 1;
}

static int caches_equal(const kvm_kvcache *a, const kvm_kvcache *b)
{
    for (int l = 0; l < a->n_layers; l++)
        if (!heads_equal(a, b, l)) return 0;
    return 1;
}

static kvm_sculpt_opts opts(const char *qsource, const char *on_policy)
{
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.retain_tokens = 16;
    o.n_synth = 64;
    o.rounds = 2;
    o.lbfgs_iters = 8;
    o.ratio = 0.3;
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "query_source", qsource), 0);
    if (on_policy) ck_assert_msg(kvm_sculpt_opts_set(&o, "on_policy", on_policy) == 0, "%s", kvm_errmsg());
    return o;
}

static kvm_kvcache *compress(const kvm_compress_input *in, const kvm_sculpt_opts *o)
{
    kvm_kvcache *c = NULL;
    ck_assert_msg(kvm_sculpt_compress(in, o, &c, NULL) == 0, "%s", kvm_errmsg());
    return c;
}

/* off = the option left out, bit for bit; on: layer 0 as off (its queries see the full cache
 * alone), the layers above differ; the same seed twice gives the same cache, another seed
 * another one; KL stays of the same size. */
START_TEST(test_off_and_on)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + T, N, T, &doc), 0);
    kvm_compress_input in = *kvm_eval_doc_input(doc);
    in.qcache = NULL;
    kvm_sculpt_opts base = opts("repeat", NULL), off = opts("repeat", "false"), on = opts("repeat", "true");
    kvm_kvcache *a = compress(&in, &base), *b = compress(&in, &off), *c = compress(&in, &on), *d = compress(&in, &on);
    ck_assert(caches_equal(a, b));
    ck_assert(heads_equal(a, c, 0));
    int differ = 0;
    for (int l = 1; l < model->cfg.n_layers; l++)
        differ += !heads_equal(a, c, l);
    ck_assert_int_ge(differ, 1);
    ck_assert(caches_equal(c, d));
    on.seed = 2;
    kvm_kvcache *e = compress(&in, &on);
    ck_assert(!caches_equal(c, e));
    kvm_eval_result ra, rc;
    ck_assert_int_eq(kvm_eval_continue(doc, a, NULL, NULL, &ra), 0);
    ck_assert_int_eq(kvm_eval_continue(doc, c, NULL, NULL, &rc), 0);
    printf("repeat queries, r = 0.3: KL off %.6f, on_policy %.6f (%d of %d layers changed)\n", ra.kl_mean, rc.kl_mean,
           differ, model->cfg.n_layers - 1);
    ck_assert(rc.kl_mean < 10 * ra.kl_mean + 1e-4);
    kvm_kvcache_free(&a);
    kvm_kvcache_free(&b);
    kvm_kvcache_free(&c);
    kvm_kvcache_free(&d);
    kvm_kvcache_free(&e);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* The queries on_policy gives layer 1 (repeat over the full cache with layer 0 distilled) with
 * k = N − m and the original keys: loss ~0; and the methods that keep original keys at
 * k = N − m reach KL ~0 with on_policy. */
START_TEST(test_exact_at_full_k)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + T, N, T, &doc), 0);
    kvm_compress_input in = *kvm_eval_doc_input(doc);
    in.qcache = NULL;
    kvm_sculpt_opts on = opts("repeat@0.5+continuation@0.5", "true");
    kvm_kvcache *c = compress(&in, &on), *mixed = NULL;
    ck_assert_int_eq(kvm_kvcache_clone(in.full, &mixed), 0);
    ck_assert_int_eq(kvm_kvcache_copy_layer(mixed, c, 0), 0);
    kvm_compress_input ol = in;
    ol.full = mixed;
    kvm_sculpt_qsets qs, full_qs;
    ck_assert_msg(kvm_sculpt_qsets_build(&ol, &on.query_source, 64, &qs) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_sculpt_qsets_build(&in, &on.query_source, 64, &full_qs), 0);
    const kvm_sculpt_qset *r1 = &qs.set[KVM_SCULPT_QSRC_REPEAT], *r0 = &full_qs.set[KVM_SCULPT_QSRC_REPEAT];
    size_t per_layer = (size_t)model->cfg.n_heads * (size_t)r1->n * (size_t)model->cfg.head_dim;
    ck_assert_int_eq(memcmp(r1->q, r0->q, per_layer * sizeof(float)), 0); /* layer 0: same inputs */
    ck_assert_int_ne(memcmp(r1->q + per_layer, r0->q + per_layer, per_layer * sizeof(float)), 0); /* layer 1 sees c */
    const int64_t m = 16, nm[3] = {0, 40, 24};
    kvm_sculpt_problem p;
    ck_assert_int_eq(kvm_sculpt_problem_build_mixed(&model->cfg, in.cap, 1, 1, m, 0, 16, 1, &qs, nm, &p), 0);
    double mse, lse;
    kvm_sculpt_loss(&p, p.kz, p.vz, NULL, p.nc, 0.1, NULL, NULL, &mse, &lse);
    printf("on-policy queries of layer 1, original keys: mse / mean square %.3g, lse %.3g\n", mse / p.out_ms, lse);
    ck_assert_double_lt(lse, 1e-9);
    ck_assert_double_lt(mse / p.out_ms, 1e-9);
    kvm_sculpt_problem_free(&p);
    kvm_sculpt_qsets_free(&qs);
    kvm_sculpt_qsets_free(&full_qs);
    kvm_kvcache_free(&mixed);
    kvm_kvcache_free(&c);
    kvm_sculpt_mode modes[] = {KVM_SCULPT_SELECTFIT, KVM_SCULPT_AM, KVM_SCULPT_FULL};
    for (int i = 0; i < 3; i++) {
        kvm_sculpt_opts o = opts("repeat", "true");
        o.mode = modes[i];
        o.k_entries = N - 16;
        c = compress(&in, &o);
        kvm_eval_result r;
        ck_assert_int_eq(kvm_eval_continue(doc, c, NULL, NULL, &r), 0);
        printf("on_policy, k = N - m, mode %d: KL %.3g\n", (int)modes[i], r.kl_mean);
        ck_assert_double_lt(r.kl_mean, 1e-5);
        kvm_kvcache_free(&c);
    }
    kvm_eval_doc_free(&doc);
}
END_TEST

/* Synthetic queries alone (nothing to take from a forward pass), a non-uniform alloc (the
 * pilot allocates across layers) and PolyKV's distilled layers are refused by name; a bad
 * value is refused by the option parser; config ids: off = left out, on differs. */
START_TEST(test_refusals)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + T, N, T, &doc), 0);
    kvm_kvcache *c = NULL;
    kvm_sculpt_opts o = opts("synthetic", "true");
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, NULL), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "on_policy") && strstr(kvm_errmsg(), "query_source repeat or continuation"),
                  "%s", kvm_errmsg());
    o = opts("repeat", "true");
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "alloc", "head"), 0);
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, NULL), KVM_ENOTSUP);
    ck_assert_msg(strstr(kvm_errmsg(), "alloc = uniform"), "%s", kvm_errmsg());
    o = opts("repeat", "true");
    ck_assert_int_eq(kvm_kvcache_new(model->cfg.n_layers, model->cfg.n_kv_heads, model->cfg.head_dim, N, &c), 0);
    int64_t budget[5] = {32, 32, 32, 32, 32};
    ck_assert_int_eq(kvm_sculpt_compress_layers(kvm_eval_doc_input(doc), &o, budget, c, NULL), KVM_ENOTSUP);
    kvm_kvcache_free(&c);
    ck_assert_int_ne(kvm_sculpt_opts_set(&o, "on_policy", "sometimes"), 0);
    kvm_eval_doc_free(&doc);
    const char *extra[] = {"", "on_policy = false", "on_policy = true\nquery_source = repeat"};
    kvm_store_id id[3];
    for (int i = 0; i < 3; i++) {
        char text[1024];
        snprintf(text, sizeof text, "[model]\npath = x\n[compress]\nquery_source = repeat\n%s\n", extra[i]);
        if (i == 2) snprintf(text, sizeof text, "[model]\npath = x\n[compress]\n%s\n", extra[i]);
        kvm_config *cfg = NULL;
        ck_assert_msg(kvm_config_parse(text, "t.ini", &cfg) == 0, "%s", kvm_errmsg());
        ck_assert_int_eq(kvm_jobcfg_config_id(cfg, NULL, &id[i], NULL, NULL), 0);
        kvm_config_free(&cfg);
    }
    ck_assert_int_eq(memcmp(&id[0], &id[1], sizeof id[0]), 0);
    ck_assert_int_ne(memcmp(&id[0], &id[2], sizeof id[0]), 0);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("onpolicy");
    TCase *tc = tcase_create("model");
    tcase_add_checked_fixture(tc, model_setup, model_teardown);
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_off_and_on);
    tcase_add_test(tc, test_exact_at_full_k);
    tcase_add_test(tc, test_refusals);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return kvm_test_run_suite(suite()); }
