/* check_qsource.c: training queries from the model itself (query_source: synthetic, repeat,
 * continuation and mixes) and the am / kvzip baselines (issue 14): the setting's syntax and
 * errors; the repeat and continuation queries against a plain prefill of the same tokens
 * (positions, shapes); sampling reproducible with a seed; loss ~0 at k = N−m with the original
 * keys on these queries too; NNLS, am and kvzip on hand-checkable problems (one dominant key,
 * duplicated keys); every method exact at k = N−m. */
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "compress/eval/kvm_eval.h"
#include "common/kvm_error.h"
#include "model/kvm_capture.h"
#include "model/kvm_tokenizer.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------- the setting ---------------- */

START_TEST(test_parse)
{
    kvm_sculpt_qsource q;
    ck_assert_int_eq(kvm_sculpt_qsource_parse("synthetic", &q), 0);
    ck_assert(q.share[0] == 1 && q.share[1] == 0 && q.share[2] == 0);
    ck_assert_int_eq(kvm_sculpt_qsource_parse("repeat+synthetic", &q), 0);
    ck_assert(q.share[0] == 0.5 && q.share[1] == 0.5 && q.share[2] == 0);
    ck_assert_int_eq(kvm_sculpt_qsource_parse("repeat@3+continuation@1", &q), 0);
    ck_assert(q.share[0] == 0 && q.share[1] == 0.75 && q.share[2] == 0.25);
    char buf[128];
    kvm_sculpt_qsource_format(&q, buf, sizeof buf);
    ck_assert_str_eq(buf, "repeat@0.75+continuation@0.25");
    kvm_sculpt_qsource r;
    ck_assert_int_eq(kvm_sculpt_qsource_parse(buf, &r), 0);
    ck_assert(!memcmp(&q, &r, sizeof q));
    const char *bad[] = {"", "bogus", "repeat+repeat", "repeat@-1", "repeat@", "repeat+", "repeat@x", "repeat@0",
                         "synthetic,repeat"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_msg(kvm_sculpt_qsource_parse(bad[i], &q) == KVM_EINVAL, "accepted '%s'", bad[i]);
        ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "query_source"));
    }
    int64_t n[3];
    kvm_sculpt_qsource_parse("repeat@0.5+synthetic@0.5", &q);
    kvm_sculpt_qsource_counts(&q, 2048, n);
    ck_assert(n[0] == 1024 && n[1] == 1024 && n[2] == 0);
    kvm_sculpt_qsource_parse("synthetic+repeat+continuation", &q);
    kvm_sculpt_qsource_counts(&q, 7, n);
    ck_assert(n[0] == 3 && n[1] == 2 && n[2] == 2);
    /* one name everywhere: the option string, the flag spelling; queries stays the count */
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "query-source=continuation,queries=64"), 0);
    ck_assert(o.query_source.share[2] == 1 && o.n_synth == 64);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "query_source=nope"), KVM_EINVAL);
    kvm_sculpt_mode m;
    ck_assert_int_eq(kvm_sculpt_mode_parse("am", &m), 0);
    ck_assert_int_eq(m, KVM_SCULPT_AM);
    ck_assert_int_eq(kvm_sculpt_mode_parse("kvzip", &m), 0);
    ck_assert_int_eq(m, KVM_SCULPT_KVZIP);
}
END_TEST

/* A named source whose share of `queries` rounds to none was accepted and ignored: the fit ran
 * on synthetic queries alone (repeat@1e-6+synthetic, or repeat+synthetic with queries = 1), and
 * on_policy with such a repeat share, or with queries = 0, changed nothing. Refused with the
 * settings named; a share that gets a query, and queries = 0 without on_policy, still pass. */
START_TEST(test_share_of_no_query)
{
    const struct {
        const char *opts, *msg;
    } bad[] = {
        {"query_source=repeat@1e-6+synthetic", "with queries = 2048 gives repeat no query"},
        {"query_source=repeat+synthetic,queries=1", "with queries = 1 gives repeat no query"},
        {"query_source=synthetic@1+continuation@1e-300,on_policy=true", "gives continuation no query"},
        {"query_source=repeat,queries=0,on_policy=true", "on_policy takes its queries from forward passes over the "
                                                         "compressed layers: queries = 0 gives it none"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvm_sculpt_opts o = kvm_sculpt_opts_default();
        ck_assert_int_eq(kvm_sculpt_opts_parse(&o, bad[i].opts), 0);
        ck_assert_msg(kvm_sculpt_opts_check_combination(&o) == KVM_EINVAL, "accepted %s", bad[i].opts);
        ck_assert_msg(strstr(kvm_errmsg(), bad[i].msg), "%s: '%s' lacks '%s'", bad[i].opts, kvm_errmsg(), bad[i].msg);
    }
    /* a share a double cannot hold was "not a positive number" */
    kvm_sculpt_qsource q;
    ck_assert_int_eq(kvm_sculpt_qsource_parse("repeat@1e-320+synthetic", &q), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "share '1e-320' of repeat is beyond a double's range"), "%s", kvm_errmsg());
    const char *good[] = {"query_source=repeat@1e-3+synthetic", "query_source=repeat+synthetic+continuation,queries=3",
                          "query_source=repeat,queries=0", "query_source=repeat@0.01+synthetic,on_policy=true"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        kvm_sculpt_opts o = kvm_sculpt_opts_default();
        ck_assert_int_eq(kvm_sculpt_opts_parse(&o, good[i]), 0);
        ck_assert_msg(kvm_sculpt_opts_check_combination(&o) == 0, "%s: %s", good[i], kvm_errmsg());
    }
}
END_TEST

/* ---------------- model queries on stories260K ---------------- */

static kvm_model *model;
static int32_t ids[256];
enum { N = 96, T_CONT = 24 };

static void model_setup(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void model_teardown(void) { kvm_model_close(&model); }

/* A capture of a plain prefill of seq[0..n) (the reference queries). */
static kvm_capture *reference(const int32_t *seq, int64_t n)
{
    kvm_capture *cap;
    kvm_forward *f;
    kvm_kvcache *c;
    kvm_capture_opts co = {.want_queries = 1};
    ck_assert_int_eq(kvm_capture_new(&model->cfg, n, &co, &cap), 0);
    ck_assert_int_eq(kvm_forward_new(model, NULL, n, &f), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, n, &c), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c, seq, n, NULL, KVM_LOGITS_NONE), 0);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
    return cap;
}

/* max |set − reference| over every layer, head and captured position */
static double set_vs_ref(const kvm_sculpt_qset *s, const kvm_capture *ref)
{
    const kvm_model_config *c = &model->cfg;
    const int64_t R = kvm_capture_n_tokens(ref);
    double worst = 0;
    for (int l = 0; l < c->n_layers; l++)
        for (int h = 0; h < c->n_heads; h++)
            for (int64_t t = 0; t < s->n; t++)
                for (int u = 0; u < c->head_dim; u++) {
                    float a = s->q[(((size_t)l * c->n_heads + h) * s->n + t) * c->head_dim + u];
                    float b = kvm_capture_layer_get(ref, l)->q[((size_t)h * R + s->pos0 + t) * c->head_dim + u];
                    worst = fmax(worst, fabs((double)a - b));
                }
    return worst;
}

static int32_t argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

START_TEST(test_repeat_and_continuation_queries)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + 16, N, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_sculpt_qsource src;
    ck_assert_int_eq(kvm_sculpt_qsource_parse("repeat+continuation", &src), 0);
    kvm_sculpt_qsets qs;
    const int G = model->cfg.n_heads / model->cfg.n_kv_heads;
    ck_assert_int_eq(kvm_sculpt_qsets_build(in, &src, 2 * G * T_CONT, &qs), 0);
    const kvm_sculpt_qset *rep = &qs.set[KVM_SCULPT_QSRC_REPEAT], *con = &qs.set[KVM_SCULPT_QSRC_CONTINUATION];
    ck_assert_int_eq(qs.set[KVM_SCULPT_QSRC_SYNTHETIC].n, 0);
    ck_assert_int_eq(rep->n, N);
    ck_assert_int_eq(rep->pos0, N + 1); /* context, BOS, context again */
    ck_assert_int_eq(con->n, T_CONT);
    ck_assert_int_eq(con->pos0, N);
    /* repeat: the queries of [context, BOS, context] prefilled at once */
    int32_t seq[2 * N + 1 + T_CONT];
    memcpy(seq, ids, N * sizeof *seq);
    seq[N] = model->cfg.bos_id;
    memcpy(seq + N + 1, ids, N * sizeof *seq);
    kvm_capture *ref = reference(seq, 2 * N + 1);
    double e_rep = set_vs_ref(rep, ref);
    kvm_capture_free(&ref);
    /* continuation: the greedy tokens after the context, then one prefill of them all */
    kvm_forward *f;
    kvm_kvcache *c;
    float *logits = malloc((size_t)model->cfg.vocab_size * sizeof *logits);
    ck_assert_int_eq(kvm_forward_new(model, NULL, N, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, N + T_CONT, &c), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c, ids, N, logits, KVM_LOGITS_LAST), 0);
    memcpy(seq, ids, N * sizeof *seq);
    for (int t = 0; t < T_CONT; t++) {
        seq[N + t] = argmax(logits, model->cfg.vocab_size);
        ck_assert_int_eq(kvm_forward_decode(f, c, seq[N + t], logits), 0);
    }
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
    free(logits);
    ref = reference(seq, N + T_CONT);
    double e_con = set_vs_ref(con, ref);
    kvm_capture_free(&ref);
    printf("model queries vs a plain prefill: repeat max |diff| %.3g, continuation %.3g\n", e_rep, e_con);
    ck_assert_double_lt(e_rep, 1e-4);
    ck_assert_double_lt(e_con, 1e-4);

    /* problems: shapes, order, reproducibility, loss ~0 with k = N − m and the original keys */
    const int64_t m = 16, nm[3] = {0, 40, 30};
    kvm_sculpt_problem p, p2, p3;
    ck_assert_int_eq(kvm_sculpt_problem_build_mixed(&model->cfg, in->cap, 2, 1, m, 20, 16, 5, &qs, nm, &p), 0);
    ck_assert_int_eq(p.nq, G * m + 40 + 30 + 20);
    ck_assert_int_eq(p.nq_real, G * m);
    ck_assert_int_eq(p.nq_model, 70);
    for (int64_t i = p.nq_real; i < p.nq_real + p.nq_model; i++) ck_assert_int_eq(p.n_vis[i], m);
    ck_assert_int_eq(kvm_sculpt_problem_build_mixed(&model->cfg, in->cap, 2, 1, m, 20, 16, 5, &qs, nm, &p2), 0);
    ck_assert(!memcmp(p.q, p2.q, (size_t)(p.nq * p.d) * sizeof *p.q));
    ck_assert_int_eq(kvm_sculpt_problem_build_mixed(&model->cfg, in->cap, 2, 1, m, 20, 16, 6, &qs, nm, &p3), 0);
    ck_assert(memcmp(p.q + p.nq_real * p.d, p3.q + p.nq_real * p.d, (size_t)(p.nq_model * p.d) * sizeof *p.q));
    /* the repeat queries drawn are distinct (stratified: 40 of G·N pairs) */
    for (int64_t a = p.nq_real; a < p.nq_real + 40; a++)
        for (int64_t b = a + 1; b < p.nq_real + 40; b++)
            ck_assert(memcmp(p.q + a * p.d, p.q + b * p.d, (size_t)p.d * sizeof *p.q));
    double mse, lse;
    kvm_sculpt_loss(&p, p.kz, p.vz, NULL, p.nc, 0.1, NULL, NULL, &mse, &lse);
    ck_assert_double_lt(lse, 1e-9);
    ck_assert_double_lt(mse / p.out_ms, 1e-9);
    kvm_sculpt_problem_free(&p);
    kvm_sculpt_problem_free(&p2);
    kvm_sculpt_problem_free(&p3);
    ck_assert_int_eq(kvm_sculpt_problem_build_mixed(&model->cfg, in->cap, 0, 0, m, 8, 16, 5, NULL, nm, &p), KVM_EINVAL);
    kvm_sculpt_qsets_free(&qs);

    /* no tokens: a clear refusal */
    kvm_compress_input bare = *in;
    bare.tokens = NULL;
    ck_assert_int_eq(kvm_sculpt_qsets_build(&bare, &src, 64, &qs), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "tokens"));
    kvm_eval_doc_free(&doc);
}
END_TEST

/* KVzip's instruction between the context and its copy: the prompt decodes to it (no BOS), the
 * repeat queries are those of the copy after the prompt (positions N + P ..), equal to a plain
 * prefill of [context, prompt, context], the same on every build, and other than the BOS-only
 * ones; chat framing needs a chat template. */
START_TEST(test_repeat_prompt)
{
    kvm_tokenizer *tok;
    ck_assert_int_eq(kvm_tokenizer_open_llama2c(kvm_test_data_path("models/tok512.bin"), 512, &tok), 0);
    int32_t *rp;
    int64_t P;
    ck_assert_int_eq(kvm_sculpt_repeat_prompt(tok, 0, &rp, &P), 0);
    ck_assert_int_gt(P, 3);
    char *text;
    size_t len;
    ck_assert_int_eq(kvm_tokenizer_decode(tok, rp, P, &text, &len), 0);
    ck_assert_str_eq(text, " " KVM_SCULPT_REPEAT_INSTRUCTION); /* SentencePiece's dummy prefix, no BOS */
    free(text);
    for (int64_t i = 0; i < P; i++) ck_assert_int_ne(rp[i], model->cfg.bos_id);
    int32_t *none = NULL;
    int64_t nn = 0;
    ck_assert_int_eq(kvm_sculpt_repeat_prompt(tok, 1, &none, &nn), KVM_ENOTSUP); /* llama2.c: no chat template */
    ck_assert(none == NULL && nn == 0);
    kvm_tokenizer_close(&tok);

    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + 16, N, 16, &doc), 0);
    kvm_sculpt_qsource src;
    ck_assert_int_eq(kvm_sculpt_qsource_parse("repeat", &src), 0);
    kvm_sculpt_qsets bos = {0}, qs = {0}, again = {0};
    ck_assert_int_eq(kvm_sculpt_qsets_build(kvm_eval_doc_input(doc), &src, 64, &bos), 0);
    ck_assert_int_eq(kvm_eval_doc_set_repeat_prompt(doc, rp, P), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    ck_assert(in->n_repeat_prompt == P && in->repeat_prompt != rp && !memcmp(in->repeat_prompt, rp, (size_t)P * 4));
    ck_assert_int_eq(kvm_sculpt_qsets_build(in, &src, 64, &qs), 0);
    ck_assert_int_eq(kvm_sculpt_qsets_build(in, &src, 64, &again), 0);
    const kvm_sculpt_qset *rep = &qs.set[KVM_SCULPT_QSRC_REPEAT];
    ck_assert_int_eq(rep->n, N);
    ck_assert_int_eq(rep->pos0, N + P); /* the copy starts after the prompt */
    ck_assert_int_eq(bos.set[KVM_SCULPT_QSRC_REPEAT].pos0, N + 1);
    const size_t bytes = (size_t)model->cfg.n_layers * model->cfg.n_heads * N * model->cfg.head_dim * sizeof(float);
    ck_assert(!memcmp(rep->q, again.set[KVM_SCULPT_QSRC_REPEAT].q, bytes)); /* reproducible */
    ck_assert(memcmp(rep->q, bos.set[KVM_SCULPT_QSRC_REPEAT].q, bytes)); /* the instruction changes them */
    int32_t *seq = malloc((size_t)(2 * N + P) * sizeof *seq);
    memcpy(seq, ids, N * sizeof *seq);
    memcpy(seq + N, rp, (size_t)P * sizeof *seq);
    memcpy(seq + N + P, ids, N * sizeof *seq);
    kvm_capture *ref = reference(seq, 2 * N + P);
    double e = set_vs_ref(rep, ref);
    printf("repeat queries after the prompt (%lld tokens) vs a plain prefill: max |diff| %.3g\n", (long long)P, e);
    ck_assert_double_lt(e, 1e-4);
    kvm_capture_free(&ref);
    free(seq);
    kvm_sculpt_qsets_free(&bos);
    kvm_sculpt_qsets_free(&qs);
    kvm_sculpt_qsets_free(&again);
    /* a compression through the document's query cache sees the prompt too: a changed prompt drops it */
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "query_source=repeat,queries=64,budget=40,rounds=1,iterations=3"), 0);
    kvm_kvcache *a, *b, *c;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &a, NULL), 0);
    ck_assert_int_eq(kvm_eval_doc_set_repeat_prompt(doc, NULL, 0), 0);
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &b, NULL), 0);
    ck_assert_int_eq(kvm_eval_doc_set_repeat_prompt(doc, rp, P), 0);
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, NULL), 0);
    int differ = 0, same = 1;
    for (int l = 0; l < model->cfg.n_layers; l++)
        for (int g = 0; g < model->cfg.n_kv_heads; g++) {
            const kvm_kv_head *x = kvm_kvcache_head(a, l, g), *y = kvm_kvcache_head(b, l, g), *z = kvm_kvcache_head(c, l, g);
            const size_t nb = (size_t)x->n * a->head_dim * sizeof(float);
            differ |= x->n != y->n || memcmp(x->k, y->k, nb);
            same &= x->n == z->n && !memcmp(x->k, z->k, nb) && !memcmp(x->v, z->v, nb);
        }
    ck_assert_msg(differ && same, "differ %d same %d", differ, same);
    kvm_kvcache_free(&a);
    kvm_kvcache_free(&b);
    kvm_kvcache_free(&c);
    free(rp);
    kvm_eval_doc_free(&doc);
}
END_TEST

START_TEST(test_repeat_needs_the_window)
{
    kvm_eval_doc *doc; /* 2·300 + 1 > 512 positions of stories260K */
    int32_t *tok = malloc(320 * sizeof *tok);
    for (int i = 0; i < 320; i++) tok[i] = ids[i % 256];
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, tok, 320, 300, 20, &doc), 0);
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.retain_tokens = 16;
    o.n_synth = 32;
    o.mode = KVM_SCULPT_SELECTFIT;
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "query_source", "repeat"), 0);
    kvm_kvcache *c = NULL;
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, NULL), KVM_EINVAL);
    ck_assert_ptr_null(c);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "601 positions"));
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "window is 512"));
    /* continuation fits: 212 positions remain */
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "query_source", "continuation"), 0);
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, NULL), 0);
    kvm_kvcache_free(&c);
    kvm_eval_doc_free(&doc);
    free(tok);
}
END_TEST

/* every method exact at k = N − m on model queries: KL ~ 0 */
START_TEST(test_exact_at_full_k)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + 32, N, 32, &doc), 0);
    const char *srcs[] = {"repeat", "continuation", "repeat@0.5+synthetic@0.5"};
    kvm_sculpt_mode modes[] = {KVM_SCULPT_SELECTFIT, KVM_SCULPT_AM, KVM_SCULPT_KVZIP, KVM_SCULPT_FULL};
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < 4; i++) {
            kvm_sculpt_opts o = kvm_sculpt_opts_default();
            o.retain_tokens = 16;
            o.n_synth = 96;
            o.rounds = 1;
            o.lbfgs_iters = 5;
            o.mode = modes[i];
            o.k_entries = N - 16;
            ck_assert_int_eq(kvm_sculpt_opts_set(&o, "query_source", srcs[s]), 0);
            kvm_kvcache *c;
            kvm_sculpt_stats st;
            ck_assert_msg(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, &st) == 0, "%s", kvm_errmsg());
            ck_assert(i > 0 || s == 2 || st.qprefill_s > 0); /* later calls find the document's cache */
            kvm_eval_result r;
            ck_assert_int_eq(kvm_eval_continue(doc, c, NULL, NULL, &r), 0);
            printf("k = N - m, %s, mode %d: KL %.3g\n", srcs[s], (int)modes[i], r.kl_mean);
            ck_assert_double_lt(r.kl_mean, 1e-5);
            kvm_kvcache_free(&c);
        }
    kvm_eval_doc_free(&doc);
}
END_TEST

static int caches_equal(const kvm_kvcache *a, const kvm_kvcache *b)
{
    for (int i = 0; i < a->n_layers * a->n_kv_heads; i++) {
        const kvm_kv_head *x = &a->heads[i], *y = &b->heads[i];
        size_t nd = (size_t)(x->n * a->head_dim) * sizeof(float);
        if (x->n != y->n || memcmp(x->k, y->k, nd) || memcmp(x->v, y->v, nd) || memcmp(x->bias, y->bias, (size_t)x->n * 4))
            return 0;
    }
    return 1;
}

/* the document's query cache (kvm_compress_input.qcache) changes nothing but the time */
START_TEST(test_cache_same_result)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + 32, N, 32, &doc), 0);
    kvm_compress_input bare = *kvm_eval_doc_input(doc);
    bare.qcache = NULL;
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.retain_tokens = 16;
    o.n_synth = 60;
    o.mode = KVM_SCULPT_AM;
    o.ratio = 0.3;
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "query_source", "repeat+continuation+synthetic"), 0);
    kvm_kvcache *a, *b, *c;
    kvm_sculpt_stats s1, s2;
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &a, &s1), 0);
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &b, &s2), 0);
    ck_assert_int_eq(kvm_sculpt_compress(&bare, &o, &c, NULL), 0);
    ck_assert_double_gt(s1.qprefill_s, 0);
    ck_assert_double_eq(s2.qprefill_s, 0); /* cached */
    ck_assert(caches_equal(a, b) && caches_equal(a, c));
    kvm_kvcache_free(&a);
    kvm_kvcache_free(&b);
    kvm_kvcache_free(&c);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* am and kvzip as PolyKV's distilled layers (kvm_sculpt_compress_layers): a uniform budget over
 * every layer reproduces kvm_sculpt_compress */
START_TEST(test_layers_match_compress)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, N + 32, N, 32, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_sculpt_mode modes[2] = {KVM_SCULPT_AM, KVM_SCULPT_KVZIP};
    for (int i = 0; i < 2; i++) {
        kvm_sculpt_opts o = kvm_sculpt_opts_default();
        o.retain_tokens = 16;
        o.n_synth = 64;
        o.mode = modes[i];
        o.k_entries = 24;
        ck_assert_int_eq(kvm_sculpt_opts_set(&o, "query_source", "repeat"), 0);
        kvm_kvcache *a, *b;
        ck_assert_int_eq(kvm_sculpt_compress(in, &o, &a, NULL), 0);
        ck_assert_int_eq(kvm_kvcache_clone(in->full, &b), 0);
        int64_t bud[5] = {40, 40, 40, 40, 40};
        ck_assert_int_eq(kvm_sculpt_compress_layers(in, &o, bud, b, NULL), 0);
        ck_assert(caches_equal(a, b));
        kvm_kvcache_free(&a);
        kvm_kvcache_free(&b);
    }
    kvm_eval_doc_free(&doc);
}
END_TEST

/* ---------------- hand-checkable problems ---------------- */

/* A problem of nc zone keys kz (d = 4), m = 0, nq queries q; values v. Arrays borrowed. */
static void hand_problem(kvm_sculpt_problem *p, int64_t nc, const float *kz, const float *vz, int64_t nq,
                         const float *q)
{
    memset(p, 0, sizeof *p);
    p->d = 4;
    p->scale = 0.5f;
    p->nc = nc;
    p->kz = kz;
    p->vz = vz;
    p->kr = kz + nc * 4;
    p->vr = vz + nc * 4;
    p->nq = nq;
    p->q = malloc((size_t)(nq * 4) * sizeof *p->q);
    memcpy(p->q, q, (size_t)(nq * 4) * sizeof *p->q);
    p->n_vis = calloc((size_t)nq, sizeof *p->n_vis);
    ck_assert_int_eq(kvm_sculpt_problem_prepare(p), 0);
}

static float qs_hand[8 * 4];
static void hand_queries(void)
{
    for (int i = 0; i < 8; i++) {
        qs_hand[i * 4 + 0] = 4.0f + 0.25f * (float)i; /* aligned with the first axis */
        qs_hand[i * 4 + 1] = 0.3f * (float)(i % 3) - 0.3f;
        qs_hand[i * 4 + 2] = 0.2f * (float)(i % 2);
        qs_hand[i * 4 + 3] = -0.1f * (float)i;
    }
}

START_TEST(test_nnls)
{
    const double I3[9] = {1, 0, 0, 0, 1, 0, 0, 0, 1}, h[3] = {1, -1, 2};
    double w[3] = {0, 5, -1}; /* start: −1 is clamped to 0 */
    kvm_sculpt_nnls(I3, h, 3, 1e-12, 100, w);
    ck_assert(w[0] == 1 && w[1] == 0 && w[2] == 2);
    /* correlated: the unconstrained solution of [2 1; 1 1] w = (3, 1) is (2, −1); the NNLS
     * optimum is (1.5, 0) (KKT: the gradient 1.5 − 1 = 0.5 ≥ 0 at the bound) */
    const double G[4] = {2, 1, 1, 1}, h2[2] = {3, 1};
    w[0] = w[1] = 1;
    kvm_sculpt_nnls(G, h2, 2, 1e-12, 1000, w);
    ck_assert_double_eq_tol(w[0], 1.5, 1e-9);
    ck_assert_double_eq(w[1], 0);
    /* degenerate input: a zero column and NaN in h never give NaN or negative mass */
    const double Z[4] = {0, 0, 0, 1}, h3[2] = {NAN, 2};
    w[0] = NAN;
    w[1] = 0;
    kvm_sculpt_nnls(Z, h3, 2, 1e-12, 10, w);
    ck_assert(w[0] == 0 && w[1] == 2);
}
END_TEST

/* one dominant key: both baselines keep it; am gives it w ≈ 1 (β ≈ 0) */
START_TEST(test_dominant_key)
{
    hand_queries();
    float kz[5 * 4] = {0}, vz[5 * 4];
    kz[2 * 4 + 0] = 6.0f; /* key 2 points along the queries */
    for (int j = 0; j < 5; j++) {
        if (j != 2) kz[j * 4 + 1 + j % 3] = 0.5f;
        for (int u = 0; u < 4; u++) vz[j * 4 + u] = (float)(j + 1) * (u % 2 ? -1.0f : 1.0f);
    }
    kvm_sculpt_problem p;
    hand_problem(&p, 5, kz, vz, 8, qs_hand);
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    float kc[4], vc[4], beta[1];
    kvm_sculpt_head_stats st;
    o.mode = KVM_SCULPT_KVZIP;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 1, 0, 0, kc, vc, beta, &st), 0);
    ck_assert(!memcmp(kc, kz + 8, sizeof kc) && !memcmp(vc, vz + 8, sizeof vc) && beta[0] == 0);
    o.mode = KVM_SCULPT_AM;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 1, 0, 0, kc, vc, beta, &st), 0);
    ck_assert(!memcmp(kc, kz + 8, sizeof kc));
    printf("am, one dominant key: beta %.4f, loss %.3g\n", beta[0], st.loss);
    ck_assert(isfinite(beta[0]) && fabs(beta[0]) < 0.01);
    ck_assert_double_lt(st.mse / p.out_ms, 1e-3);
    kvm_sculpt_problem_free(&p);
}
END_TEST

/* duplicated keys: two copies of the dominant key (same value); am keeps one with w ≈ 2
 * (β ≈ log 2) and matches the partition function; kvzip keeps the first copy (tie) */
START_TEST(test_duplicated_keys)
{
    hand_queries();
    float kz[4 * 4] = {0}, vz[4 * 4];
    kz[1 * 4 + 0] = kz[3 * 4 + 0] = 6.0f;
    kz[0 * 4 + 1] = kz[2 * 4 + 2] = -1.0f;
    for (int j = 0; j < 4; j++)
        for (int u = 0; u < 4; u++) vz[j * 4 + u] = j == 1 || j == 3 ? 1.0f + (float)u : -(float)j;
    kvm_sculpt_problem p;
    hand_problem(&p, 4, kz, vz, 8, qs_hand);
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.lambda = 1;
    float kc[4], vc[4], beta[1];
    kvm_sculpt_head_stats st;
    o.mode = KVM_SCULPT_KVZIP;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 1, 0, 0, kc, vc, beta, &st), 0);
    ck_assert(!memcmp(kc, kz + 4, sizeof kc));
    double kvzip_loss = st.loss;
    o.mode = KVM_SCULPT_AM;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 1, 0, 0, kc, vc, beta, &st), 0);
    ck_assert(!memcmp(kc, kz + 4, sizeof kc));
    printf("am, duplicated keys: beta %.4f (log 2 = %.4f), loss %.3g (kvzip %.3g)\n", beta[0], log(2.0), st.loss,
           kvzip_loss);
    ck_assert_double_eq_tol(beta[0], log(2.0), 0.01);
    ck_assert_double_lt(st.loss, 0.01 * kvzip_loss); /* the LSE term is what β fixes */
    kvm_sculpt_problem_free(&p);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("qsource");
    TCase *tc = tcase_create("hand");
    tcase_add_test(tc, test_parse);
    tcase_add_test(tc, test_share_of_no_query);
    tcase_add_test(tc, test_nnls);
    tcase_add_test(tc, test_dominant_key);
    tcase_add_test(tc, test_duplicated_keys);
    suite_add_tcase(s, tc);
    TCase *tm = tcase_create("model");
    tcase_add_checked_fixture(tm, model_setup, model_teardown);
    tcase_set_timeout(tm, 120);
    tcase_add_test(tm, test_repeat_and_continuation_queries);
    tcase_add_test(tm, test_repeat_needs_the_window);
    tcase_add_test(tm, test_repeat_prompt);
    tcase_add_test(tm, test_exact_at_full_k);
    tcase_add_test(tm, test_cache_same_result);
    tcase_add_test(tm, test_layers_match_compress);
    suite_add_tcase(s, tm);
    return s;
}

int main(void) { return kvm_test_run_suite(suite()); }
