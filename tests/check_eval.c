/* check_eval.c: the evaluation harness: KL and quantiles, the method table, exactness when
 * the budget covers everything (KL exactly 0 for every method and both phases), scoring the
 * cache as the store serves it (--dtype), the target_kl budget search, and the `kvmill eval`
 * command's CSV and errors. */
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"
#include "compress/eval/kvm_task.h"
#include "compress/evict/kvm_evict.h"
#include "compress/polykv/kvm_polykv.h"
#include "model/kvm_capture.h"
#include "pipeline/kvm_cachecodec.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

START_TEST(test_kl_quantile)
{
    float a[4] = {1, 2, 3, 4}, b[4] = {4, 3, 2, 1};
    ck_assert(kvm_eval_kl(a, a, 4) == 0.0);
    double kl = kvm_eval_kl(a, b, 4);
    /* closed form: Σ p (log p − log q) */
    double zp = exp(1) + exp(2) + exp(3) + exp(4), want = 0;
    for (int i = 0; i < 4; i++)
        want += exp(a[i]) / zp * ((a[i] - log(zp)) - (b[i] - log(zp)));
    ck_assert_double_eq_tol(kl, want, 1e-12);
    double x[5] = {5, 1, 4, 2, 3};
    ck_assert_double_eq_tol(kvm_eval_quantile(x, 5, 0.5), 3.0, 1e-12);
    ck_assert_double_eq_tol(kvm_eval_quantile(x, 5, 0.99), 4.96, 1e-12);
    ck_assert_double_eq_tol(kvm_eval_quantile(x, 5, 0.0), 1.0, 1e-12);
    /* non-finite logits: the KL was clamped to 0, a "perfect" cache */
    float n[4] = {1, NAN, 3, 4};
    ck_assert(isnan(kvm_eval_kl(a, n, 4)) && isnan(kvm_eval_kl(n, a, 4)));
}
END_TEST

START_TEST(test_method_table)
{
    const char *names[] = {"full", "streaming", "h2o", "tova", "snapkv", "pyramidkv", "polykv"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        ck_assert_ptr_nonnull(kvm_method_find(names[i]));
    ck_assert_ptr_null(kvm_method_find("bogus"));
    char name[64];
    const kvm_method *m;
    const char *arg;
    ck_assert_int_eq(kvm_eval_method_parse("polykv:/x/s.bin", name, sizeof name, &m, &arg), 0);
    ck_assert_str_eq(name, "polykv");
    ck_assert_str_eq(arg, "/x/s.bin");
    ck_assert_int_eq(kvm_eval_method_parse("h2o", name, sizeof name, &m, &arg), 0);
    ck_assert_ptr_null(arg);
    ck_assert_int_eq(kvm_eval_method_parse("bogus", name, sizeof name, &m, &arg), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "streaming|h2o"));
    ck_assert_int_eq(kvm_eval_method_parse("polykv", name, sizeof name, &m, &arg), KVM_EINVAL);
    ck_assert_int_eq(kvm_eval_method_parse("h2o:3", name, sizeof name, &m, &arg), KVM_EINVAL);
    kvm_budget zero = {0};
    void *o;
    ck_assert_int_eq(kvm_method_find("h2o")->opts_new(NULL, &zero, NULL, &o), KVM_EINVAL);
    kvm_budget r = {.ratio = 0.25};
    ck_assert_int_eq(kvm_budget_resolve(&r, 384), 96);
}
END_TEST

/* the device path's plan of an eviction method is what its compress function uses; a method that
 * needs the host forward has none (kvmill eval --device cuda:N runs it on the CPU, said) */
START_TEST(test_method_evict_plan)
{
    kvm_model_config c = {.n_layers = 5, .n_kv_heads = 4};
    kvm_budget r = {.ratio = 0.25};
    static const char *const names[] = {"streaming", "h2o", "tova", "snapkv", "pyramidkv"};
    for (int p = 0; p < 5; p++) {
        const kvm_method *m = kvm_method_find(names[p]);
        void *o;
        kvm_evict_plan *pl, *want;
        ck_assert_int_eq(m->opts_new(NULL, &r, &c, &o), 0);
        ck_assert_int_eq(kvm_method_evict_plan(m, o, 384, &pl), 0);
        ck_assert_int_eq(kvm_evict_plan_new(5, 4, (kvm_pattern)p, 96, &want), 0);
        ck_assert_mem_eq(pl->pattern, want->pattern, 20 * sizeof *pl->pattern);
        ck_assert_mem_eq(pl->budget, want->budget, 20 * sizeof *pl->budget);
        kvm_evict_plan_free(&pl);
        kvm_evict_plan_free(&want);
        m->opts_free(o);
    }
    const kvm_method *am = kvm_method_find("am");
    kvm_evict_plan *pl = (kvm_evict_plan *)&r; /* set to NULL on refusal */
    ck_assert_int_eq(kvm_method_evict_plan(am, NULL, 384, &pl), KVM_ENOTSUP);
    ck_assert_ptr_null(pl);
    ck_assert_msg(strstr(kvm_errmsg(), "'am' is not one eviction pattern"), "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_method_evict_plan(kvm_method_find("full"), NULL, 384, &pl), KVM_ENOTSUP);
}
END_TEST

static kvm_model *model;
static int32_t ids[256];

static void load_model(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void free_model(void) { kvm_model_close(&model); }

enum { N = 64, T = 16 };

/* Every method (polykv through a strategy file) at a budget covering everything: exact. */
START_TEST(test_full_budget_exact)
{
    kvm_eval_doc *d;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 256, N, T, &d), 0);
    char *dir = kvm_test_tmpdir(), path[512];
    snprintf(path, sizeof path, "%s/s.bin", dir);
    kvm_strategy *s;
    ck_assert_int_eq(kvm_strategy_new(5, &s), 0);
    s->budget_avg = 10;
    s->b_min = 1;
    s->select = KVM_POLYKV_SELECT_COSINE;
    for (int l = 0; l < 5; l++)
        s->layers[l] = (kvm_strategy_layer){{(kvm_pattern)l, (kvm_pattern)(4 - l)}, 6 + 2 * l};
    ck_assert_int_eq(kvm_strategy_write(s, path), 0);
    kvm_strategy_free(&s);
    int n_methods;
    const kvm_method *tab = kvm_method_table(&n_methods);
    for (int both = 0; both < 2; both++)
        for (int i = 0; i < n_methods; i++) {
            /* prefill only: b = N keeps the context; both phases: b ≥ N + T (PyramidKV's last
             * layer gets 0.5·B, so twice that) */
            kvm_budget b = {.tokens = both || strcmp(tab[i].name, "pyramidkv") == 0 ? 2 * (N + T) : N};
            if (strcmp(tab[i].name, "polykv") == 0) b.tokens = 4 * (N + T); /* smallest layer: 0.6·B */
            /* distillation methods: b = N distils the whole zone into N−m entries (no decode policy) */
            int distils = !strcmp(tab[i].name, "sculpt") || !strcmp(tab[i].name, "selectfit") ||
                          !strcmp(tab[i].name, "joint-fixed") || !strcmp(tab[i].name, "am") ||
                          !strcmp(tab[i].name, "kvzip");
            if (distils) b.tokens = N;
            void *o;
            kvm_eval_result r;
            ck_assert_int_eq(tab[i].opts_new(tab[i].arg == 2 ? path : distils ? "queries=64:iterations=3:rounds=1" : NULL, &b,
                                             &model->cfg, &o), 0);
            ck_assert_int_eq(kvm_eval_run(d, &tab[i], o, both, &r), 0);
            if (distils) /* k = N − m with the original keys: KL ~0 (issue 5), not bit-exact */
                ck_assert_msg(r.kl_mean < 1e-6, "%s (phases %d): KL %g", tab[i].name, both, r.kl_mean);
            else
                ck_assert_msg(r.kl_mean == 0.0 && r.kl_p99 == 0.0, "%s (phases %d): KL %g", tab[i].name, both, r.kl_mean);
            ck_assert_double_eq(r.top1, 1.0);
            /* perplexity as its mean NLL (nats, the KL's unit): distillation at k = N − m moves it
             * by float rounding only (the SAN build's baseline code: 1.6e-6 of 6.43) */
            ck_assert_double_le(fabs(log(r.ppl_compressed) - log(r.ppl_full)), distils ? 1e-5 : 0.0);
            ck_assert_double_eq(r.budget_tokens, N);
            ck_assert_double_eq(r.ratio, 1.0);
            tab[i].opts_free(o);
        }
    kvm_test_rmtree(dir);
    free(dir);
    kvm_eval_doc_free(&d);
    ck_assert_ptr_null(d);
}
END_TEST

START_TEST(test_small_budget)
{
    kvm_eval_doc *d;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 256, N, T, &d), 0);
    const kvm_method *m = kvm_method_find("snapkv");
    kvm_budget b = {.ratio = 0.25};
    void *o;
    kvm_eval_result r;
    ck_assert_int_eq(m->opts_new(NULL, &b, &model->cfg, &o), 0);
    ck_assert_int_eq(kvm_eval_run(d, m, o, 0, &r), 0);
    ck_assert_double_eq(r.budget_tokens, 16);
    ck_assert_double_eq(r.ratio, 0.25);
    ck_assert(r.kl_mean > 0 && r.kl_p99 >= r.kl_median && r.top1 <= 1 && r.top1 >= 0);
    ck_assert(r.ppl_full > 1 && r.ppl_compressed > 1);
    m->opts_free(o);
    kvm_eval_doc_free(&d);
    /* documents that are too short, or windows beyond the model's */
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 70, N, T, &d), KVM_EINVAL);
    ck_assert_ptr_null(d);
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 256, 500, 100, &d), KVM_EINVAL);
}
END_TEST

static int stop_at_3(void *user, int i, const int32_t *out, int n)
{
    (void)user;
    (void)i;
    (void)out;
    return n >= 3;
}

/* The document of ids (context N, continuation T) and its cache compressed by H2O to a quarter. */
static void h2o_quarter(kvm_eval_doc **d, kvm_kvcache **c)
{
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 256, N, T, d), 0);
    const kvm_method *m = kvm_method_find("h2o");
    kvm_budget b = {.ratio = 0.25};
    void *o;
    ck_assert_int_eq(m->opts_new(NULL, &b, &model->cfg, &o), 0);
    ck_assert_int_eq(m->compress(kvm_eval_doc_input(*d), o, c), 0);
    m->opts_free(o);
}

/* −log softmax(x)[t] in float64. */
static double nll_of(const float *x, int V, int32_t t)
{
    double mx = x[0], z = 0;
    for (int v = 1; v < V; v++)
        mx = x[v] > mx ? x[v] : mx;
    for (int v = 0; v < V; v++)
        z += exp(x[v] - mx);
    return log(z) + mx - x[t];
}

static int32_t argmax_of(const float *x, int V)
{
    int32_t b = 0;
    for (int v = 1; v < V; v++)
        b = x[v] > x[b] ? v : b;
    return b;
}

/* By hand, one token a call over a copy of c: the greedy answer (up to max tokens, EOS ends it)
 * in plain[*n] and, for ref[n_ref], its mean NLL under c (ref NULL: not computed). */
static void by_hand(kvm_eval_doc *d, const kvm_kvcache *c, int max, int32_t *plain, int *n, const int32_t *ref,
                    int n_ref, double *nll)
{
    const int V = model->cfg.vocab_size;
    float *lg = malloc((size_t)V * sizeof *lg);
    kvm_forward *f = kvm_eval_doc_forward(d);
    kvm_kvcache *c2;
    for (int pass = 0; pass < 2; pass++) { /* 0: greedy, 1: teacher-forced ref */
        if (pass == 1 && !ref) break;
        ck_assert_int_eq(kvm_kvcache_clone(c, &c2), 0);
        ck_assert_int_eq(kvm_forward_prefill(f, c2, ids + N, T, lg, KVM_LOGITS_LAST), 0);
        double sum = 0;
        for (int i = 0; i < (pass ? n_ref : max); i++) {
            int32_t t = pass ? ref[i] : argmax_of(lg, V);
            if (pass)
                sum += nll_of(lg, V, t);
            else if (kvm_model_is_eos(&model->cfg, t))
                break;
            else
                plain[(*n = i + 1) - 1] = t;
            ck_assert_int_eq(kvm_forward_decode(f, c2, t, lg), 0);
        }
        if (pass) *nll = sum / n_ref;
        kvm_kvcache_free(&c2);
    }
    free(lg);
}

/* Copies of caches[0, n) for one kvm_eval_answers call (which spends them). */
static void copies(const kvm_kvcache *const *caches, int n, kvm_kvcache **out)
{
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(kvm_kvcache_clone(caches[i], &out[i]), 0);
}

static void free_copies(kvm_kvcache **c, int n)
{
    for (int i = 0; i < n; i++)
        kvm_kvcache_free(&c[i]);
}

/* kvm_eval_answers over the full cache and an H2O quarter at once gives each cache's greedy
 * answer, one decode step a call for all of them, whatever the reference (none, right, wrong from
 * the third or the first token, shorter); the reference's NLL equals token-by-token teacher forcing (a wrong
 * third token costs more); `done` stops an answer; bad arguments are refused before any cache
 * changes. */
START_TEST(test_answers)
{
    kvm_eval_doc *d;
    kvm_kvcache *c, *cp[3];
    h2o_quarter(&d, &c);
    enum { MAX = 12 };
    const kvm_kvcache *caches[3] = {kvm_eval_doc_full(d), c, kvm_eval_doc_full(d)};
    int32_t plain[2][MAX], got[3][MAX];
    int n0[2] = {0, 0}, n[3], calls;
    double want_nll[2], nll[3];
    for (int ci = 0; ci < 2; ci++)
        by_hand(d, caches[ci], MAX, plain[ci], &n0[ci], NULL, 0, NULL);
    ck_assert_int_ge(n0[0], 4); /* stories260K goes on for the 12 tokens here */
    int32_t wrong[MAX], wrong0[MAX];
    memcpy(wrong, plain[0], sizeof wrong);
    wrong[2] = (plain[0][2] + 1) % model->cfg.vocab_size;
    memcpy(wrong0, plain[0], sizeof wrong0); /* rejected at once: every reference entry dropped */
    wrong0[0] = (plain[0][0] + 1) % model->cfg.vocab_size;
    struct {
        const int32_t *ref;
        int n_ref;
    } runs[] = {{NULL, 0}, {plain[0], n0[0]}, {wrong, n0[0]}, {plain[0], 2}, {wrong0, n0[0]}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        kvm_eval_answers_opts ao = {.ref = runs[r].ref, .n_ref = runs[r].n_ref};
        copies(caches, 3, cp);
        ck_assert_int_eq(kvm_eval_answers(d, cp, 3, MAX, &ao, &got[0][0], n, nll, &calls), 0);
        free_copies(cp, 3);
        for (int i = 0; i < 3; i++) {
            ck_assert_int_eq(n[i], n0[i % 2]);
            ck_assert_mem_eq(got[i], plain[i % 2], (size_t)n[i] * sizeof **got);
        }
        int longest = n0[0] > n0[1] ? n0[0] : n0[1];
        ck_assert_msg(calls <= longest - 1, "run %zu: %d calls for answers of %d tokens", r, calls, longest);
        if (!runs[r].ref) {
            ck_assert(isnan(nll[0]) && isnan(nll[1]));
            continue;
        }
        for (int ci = 0; ci < 2; ci++) {
            int unused;
            int32_t scratch[MAX];
            by_hand(d, caches[ci], 0, scratch, &unused, runs[r].ref, runs[r].n_ref, &want_nll[ci]);
            ck_assert_msg(fabs(nll[ci] - want_nll[ci]) <= 1e-4 * (1 + want_nll[ci]),
                          "run %zu cache %d: %.7f, by hand %.7f", r, ci, nll[ci], want_nll[ci]);
        }
    }
    /* full KV answers its own answer with no decode step at all */
    kvm_eval_answers_opts ao = {.ref = plain[0], .n_ref = n0[0]};
    copies(caches, 1, cp);
    ck_assert_int_eq(kvm_eval_answers(d, cp, 1, n0[0], &ao, &got[0][0], n, nll, &calls), 0);
    ck_assert_int_ge(cp[0]->next_pos, N + T); /* the question (and the answer) appended in place */
    free_copies(cp, 1);
    ck_assert_int_eq(calls, 0);
    ck_assert_int_eq(n[0], n0[0]);
    double right_nll = nll[0];
    ao.ref = wrong;
    copies(caches, 1, cp);
    ck_assert_int_eq(kvm_eval_answers(d, cp, 1, n0[0], &ao, &got[0][0], n, nll, &calls), 0);
    free_copies(cp, 1);
    ck_assert_msg(nll[0] > right_nll, "wrong %.6f, greedy %.6f", nll[0], right_nll);
    /* done */
    kvm_eval_answers_opts stop = {.done = stop_at_3, .ref = plain[0], .n_ref = n0[0]};
    copies(caches, 2, cp);
    ck_assert_int_eq(kvm_eval_answers(d, cp, 2, MAX, &stop, &got[0][0], n, NULL, &calls), 0);
    free_copies(cp, 2);
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(n[i], 3);
        ck_assert_mem_eq(got[i], plain[i], 3 * sizeof **got);
    }
    /* refused, every cache left as it was */
    copies(caches, 2, cp);
    ck_assert_int_eq(kvm_eval_answers(d, cp, 0, MAX, NULL, &got[0][0], n, NULL, NULL), KVM_EINVAL);
    ck_assert_int_eq(kvm_eval_answers(d, cp, 1, 0, NULL, &got[0][0], n, NULL, NULL), KVM_EINVAL);
    ao = (kvm_eval_answers_opts){.ref = plain[0], .n_ref = MAX + 1};
    ck_assert_int_eq(kvm_eval_answers(d, cp, 1, MAX, &ao, &got[0][0], n, NULL, NULL), KVM_EINVAL);
    kvm_kvcache *twice[2] = {cp[0], cp[0]};
    ck_assert_int_eq(kvm_eval_answers(d, twice, 2, MAX, NULL, &got[0][0], n, NULL, NULL), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "caches 0 and 1 are one cache"), "%s", kvm_errmsg());
    cp[1]->next_pos++;
    ck_assert_int_eq(kvm_eval_answers(d, cp, 2, MAX, NULL, &got[0][0], n, NULL, NULL), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "cache 1 is not"), "%s", kvm_errmsg());
    ck_assert_int_eq(cp[0]->next_pos, N);
    ck_assert_int_eq(kvm_kvcache_entries(cp[0]), kvm_kvcache_entries(caches[0]));
    free_copies(cp, 2);
    kvm_kvcache_free(&c);
    kvm_eval_doc_free(&d);
}
END_TEST

/* Largest |a − b| over n floats (NULL pairs: 0). */
static double max_diff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; a && b && i < n; i++)
        if (fabs((double)a[i] - b[i]) > m) m = fabs((double)a[i] - b[i]);
    return m;
}

/* The largest difference between two docs' caches and captures (same shapes). */
static double doc_diff(const kvm_eval_doc *a, const kvm_eval_doc *b)
{
    const kvm_model_config *c = &model->cfg;
    const kvm_kvcache *ca = kvm_eval_doc_full(a), *cb = kvm_eval_doc_full(b);
    ck_assert_int_eq(ca->next_pos, cb->next_pos);
    double m = 0;
    size_t kv = (size_t)c->n_kv_heads * N * c->head_dim, q = (size_t)c->n_heads * N * c->head_dim,
           st = (size_t)c->n_heads * N;
    for (int l = 0; l < c->n_layers; l++) {
        for (int h = 0; h < c->n_kv_heads; h++) {
            const kvm_kv_head *x = kvm_kvcache_head(ca, l, h), *y = kvm_kvcache_head(cb, l, h);
            ck_assert_int_eq(x->n, y->n);
            ck_assert_mem_eq(x->pos, y->pos, (size_t)x->n * sizeof *x->pos);
            m = fmax(m, max_diff(x->k, y->k, (size_t)x->n * c->head_dim));
            m = fmax(m, max_diff(x->v, y->v, (size_t)x->n * c->head_dim));
        }
        const kvm_capture_layer *x = kvm_capture_layer_get(kvm_eval_doc_input(a)->cap, l),
                                *y = kvm_capture_layer_get(kvm_eval_doc_input(b)->cap, l);
        m = fmax(m, fmax(max_diff(x->k, y->k, kv), max_diff(x->v, y->v, kv)));
        m = fmax(m, fmax(max_diff(x->q, y->q, q), max_diff(x->q_pre, y->q_pre, q)));
        m = fmax(m, fmax(max_diff(x->entropy, y->entropy, st), max_diff(x->mass, y->mass, st)));
    }
    return m;
}

/* A document prefilled from a shared prefix equals one prefilled whole (cache, capture with
 * its mass, and what methods make of it), also when a later document shares less (the prefix
 * starts again) or nothing. */
START_TEST(test_prefix_reuse)
{
    kvm_eval_prefix *p;
    ck_assert_int_eq(kvm_eval_prefix_new(model, NULL, ids, 256, &p), 0);
    const kvm_method *m = kvm_method_find("snapkv");
    kvm_budget b = {.ratio = 0.25};
    void *o;
    ck_assert_int_eq(m->opts_new(NULL, &b, &model->cfg, &o), 0);
    struct {
        int32_t diverge; /* first token that differs from the prefix */
        int64_t reused;
    } docs[] = {{40, 40}, {50, 50}, {20, 20}, {0, 0}, {N + 5, N - 1}};
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
        int32_t t[256]; /* the prefix's tokens up to diverge, then others (a fact inserted there) */
        for (int j = 0; j < 256; j++)
            t[j] = j < docs[i].diverge ? ids[j] : ids[(j + 7) % 256];
        if (docs[i].diverge == 0) t[0] = (ids[0] + 1) % model->cfg.vocab_size;
        kvm_eval_doc *whole, *shared;
        int64_t reused = -1;
        ck_assert_int_eq(kvm_eval_doc_new(model, NULL, t, 256, N, T, &whole), 0);
        ck_assert_int_eq(kvm_eval_doc_new_after(p, t, 256, N, T, &reused, &shared), 0);
        ck_assert_int_eq(reused, docs[i].reused);
        double diff = doc_diff(whole, shared);
        kvm_eval_result rw, rs;
        ck_assert_int_eq(kvm_eval_run(whole, m, o, 0, &rw), 0);
        ck_assert_int_eq(kvm_eval_run(shared, m, o, 0, &rs), 0);
        printf("prefix reuse %lld of %d: largest difference %.3g, snapkv KL %.9g / %.9g\n", (long long)reused, N, diff,
               rw.kl_mean, rs.kl_mean);
        ck_assert_msg(diff < 1e-4, "diverging at %d: difference %g", docs[i].diverge, diff);
        ck_assert(fabs(rw.kl_mean - rs.kl_mean) <= 1e-4 * rw.kl_mean);
        ck_assert_double_eq(rw.budget_tokens, rs.budget_tokens);
        kvm_eval_doc_free(&whole);
        kvm_eval_doc_free(&shared);
    }
    m->opts_free(o);
    kvm_eval_prefix_free(&p);
    ck_assert_ptr_null(p);
    ck_assert_int_eq(kvm_eval_prefix_new(model, NULL, ids, 0, &p), KVM_EINVAL);
    ck_assert_ptr_null(p);
    /* captures of other shapes or options do not mix */
    kvm_capture *a, *q;
    kvm_capture_opts with_q = {.want_queries = 1};
    ck_assert_int_eq(kvm_capture_new(&model->cfg, 8, NULL, &a), 0);
    ck_assert_int_eq(kvm_capture_new(&model->cfg, 8, &with_q, &q), 0);
    ck_assert_int_eq(kvm_capture_copy_prefix(a, q, 4), KVM_EINVAL);
    ck_assert_int_eq(kvm_capture_copy_prefix(q, q, 9), KVM_EINVAL);
    kvm_capture_free(&a);
    kvm_capture_free(&q);
}
END_TEST

/* ---- target_kl: the budget search on functions with a known answer ---- */
typedef struct kl_table {
    double (*f)(int64_t b);
    int calls;
    int fail_at; /* budget whose probe fails, or 0 */
} kl_table;

static double inv_budget(int64_t b) { return 1.0 / (double)b; }
/* falls with b except a dip at 100..149 (KL lower than at 250) */
static double dip(int64_t b) { return b >= 100 && b < 150 ? 1e-4 : 1.0 / (double)b; }

static int table_kl(void *user, int64_t b, double *kl)
{
    kl_table *t = user;
    t->calls++;
    if (b == t->fail_at) return kvm_err(KVM_EIO, "probe failed");
    *kl = t->f(b);
    return 0;
}

START_TEST(test_target_budget)
{
    kvm_eval_target r;
    kl_table t = {inv_budget, 0, 0};
    /* KL = 1/b ≤ 0.01 first at b = 100 */
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 1, 1000, 1, 0.01, &r), 0);
    ck_assert_int_eq(r.budget, 100);
    ck_assert(r.reached);
    ck_assert_double_eq(r.kl, 0.01);
    ck_assert_int_eq(r.n_probes, t.calls);
    ck_assert_int_le(r.n_probes, 12); /* hi, then ⌈log2 1000⌉ halvings */
    ck_assert_int_eq(r.n_nonmonotone, 0);
    for (int i = 0; i < r.n_probes; i++) /* no probe below the answer reaches the target */
        ck_assert(r.probe_budget[i] >= 100 || r.probe_kl[i] > 0.01);
    /* on a grid of multiples of 16: the first one ≥ 100 */
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 16, 1000, 16, 0.01, &r), 0);
    ck_assert_int_eq(r.budget, 112);
    /* hi is always a candidate, off the grid too */
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 16, 1000, 16, 0.001, &r), 0);
    ck_assert_int_eq(r.budget, 1000);
    ck_assert(r.reached);
    /* not reachable: one probe, hi, reached = 0 */
    t.calls = 0;
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 1, 1000, 1, 1e-4, &r), 0);
    ck_assert(!r.reached);
    ck_assert_int_eq(r.budget, 1000);
    ck_assert_int_eq(t.calls, 1);
    /* lo = hi: a single probe */
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 5, 5, 1, 1.0, &r), 0);
    ck_assert_int_eq(r.budget, 5);
    ck_assert_int_eq(r.n_probes, 1);
    /* a dip the bisection steps on (probes 1000, 500, 250, then 125 in the dip): counted as
     * non-monotone (KL(250) > KL(125)); the answer is the dip's start */
    kl_table dt = {dip, 0, 0};
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &dt, 1, 1000, 1, 0.0045, &r), 0);
    ck_assert_int_gt(r.n_nonmonotone, 0);
    ck_assert_int_eq(r.budget, 100);
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 1, 1000, 1, 0.0045, &r), 0);
    ck_assert_int_eq(r.budget, 223); /* without the dip: the smallest b with 1/b <= 0.0045 */
    /* errors */
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 0, 10, 1, 0.1, &r), KVM_EINVAL);
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 10, 5, 1, 0.1, &r), KVM_EINVAL);
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 1, 10, 0, 0.1, &r), KVM_EINVAL);
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 1, 10, 1, -1, &r), KVM_EINVAL);
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &t, 1, 10, 1, NAN, &r), KVM_EINVAL);
    kl_table ft = {inv_budget, 0, 5};
    ck_assert_int_eq(kvm_eval_target_budget(table_kl, &ft, 1, 10, 1, 0.1, &r), KVM_EIO);
}
END_TEST

/* The store round trip: f32 exact, 16-bit close; stored bytes count 2 bytes less per key and
 * value element; kvm_eval_kl_range splits the per-step KL. */
static int roundtrip(void *user, const kvm_kvcache *c, int64_t n_tokens, kvm_kvcache **out, int64_t *bytes)
{
    return kvm_cachecodec_roundtrip(c, n_tokens, *(const kvm_proto_dtype *)user, out, bytes);
}

START_TEST(test_store_dtype)
{
    kvm_eval_doc *d;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 256, N, T, &d), 0);
    ck_assert(isnan(kvm_eval_kl_range(d, 0, T))); /* no run yet */
    const kvm_method *full = kvm_method_find("full"), *h2o = kvm_method_find("h2o");
    kvm_budget b = {.tokens = N}, q = {.ratio = 0.25};
    void *of, *oh;
    ck_assert_int_eq(full->opts_new(NULL, &b, &model->cfg, &of), 0);
    ck_assert_int_eq(h2o->opts_new(NULL, &q, &model->cfg, &oh), 0);
    kvm_proto_dtype dt[3] = {KVM_PROTO_F32, KVM_PROTO_F16, KVM_PROTO_BF16};
    kvm_eval_result rf[3], rh[3];
    for (int i = 0; i < 3; i++) {
        kvm_eval_opts eo = {.roundtrip = roundtrip, .user = &dt[i], .decode_steps = 4};
        ck_assert_int_eq(kvm_eval_run_ex(d, full, of, &eo, &rf[i]), 0);
        ck_assert_int_eq(kvm_eval_run_ex(d, h2o, oh, &eo, &rh[i]), 0);
        ck_assert(rf[i].decode_ms > 0 && rh[i].decode_ms > 0);
        ck_assert_double_eq_tol(0.5 * (kvm_eval_kl_range(d, 0, T / 2) + kvm_eval_kl_range(d, T / 2, T)),
                                rh[i].kl_mean, 1e-12);
        printf("%s: full KL %.3g, h2o KL %.6g (bytes %lld, %lld)\n", kvm_proto_dtype_name(dt[i]), rf[i].kl_mean,
               rh[i].kl_mean, (long long)rf[i].bytes_compressed, (long long)rh[i].bytes_compressed);
    }
    ck_assert(rf[0].kl_mean == 0.0 && rf[0].top1 == 1.0); /* f32 is exact */
    for (int i = 1; i < 3; i++) {
        ck_assert(rf[i].kl_mean > 0 && rf[i].kl_mean < 1e-3);
        ck_assert(fabs(rh[i].kl_mean - rh[0].kl_mean) < 0.05 * rh[0].kl_mean);
    }
    /* keys and values, n_layers x n_kv_heads x entries x head_dim elements each, 2 bytes fewer */
    const kvm_model_config *c = &model->cfg;
    int64_t el_full = (int64_t)c->n_layers * c->n_kv_heads * N * c->head_dim;
    ck_assert_int_eq(rf[0].bytes_compressed - rf[1].bytes_compressed, 2 * 2 * el_full);
    ck_assert_int_eq(rh[0].bytes_compressed - rh[1].bytes_compressed, 2 * 2 * el_full / 4);
    ck_assert(rf[0].bytes_compressed > 2 * 4 * el_full); /* plus positions, biases, headers */
    /* decode steps beyond the continuation */
    kvm_eval_opts bad = {.decode_steps = T + 1};
    kvm_eval_result r;
    ck_assert_int_eq(kvm_eval_run_ex(d, h2o, oh, &bad, &r), KVM_EINVAL);
    ck_assert(isnan(kvm_eval_kl_range(d, 0, T + 1)) && isnan(kvm_eval_kl_range(d, 3, 3)));
    full->opts_free(of);
    h2o->opts_free(oh);
    kvm_eval_doc_free(&d);
}
END_TEST

/* ---- task accuracy: the case generator, the scorer, the statistics ---- */

/* 1 when s[0, n) is whole UTF-8 sequences (lead byte, then its continuation bytes). */
static int utf8_whole(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (!k || i + k > n) return 0;
        for (size_t j = 1; j < k; j++)
            if (((unsigned char)s[i + j] & 0xC0) != 0x80) return 0;
        i += k;
    }
    return 1;
}

/* One long sentence: multikey's four facts all go after its end, in door order, so the asked
 * fact can follow others inserted at the same offset; the depth counted only the facts at
 * smaller offsets and named a place before the fact. It is where the asked fact starts. */
START_TEST(test_task_depth_same_offset)
{
    char text[400];
    memset(text, 'x', 300);
    memcpy(text + 300, ". yyyyyyyyy", 12);
    const size_t n = strlen(text);
    for (uint64_t i = 0; i < KVM_TASK_DEPTHS; i++) {
        kvm_task_case a;
        ck_assert_int_eq(kvm_task_make(KVM_TASK_MULTIKEY, text, n, i, &a), 0);
        char door[32], fact[80];
        ck_assert_int_eq(sscanf(a.question, "What is the code for the %31s door?", door), 1);
        snprintf(fact, sizeof fact, "The code for the %s door is %s.", door, a.answer);
        const char *at = strstr(a.document, fact);
        ck_assert_ptr_nonnull(at);
        double want = (double)(at - a.document) / (double)a.document_len;
        ck_assert_msg(fabs(a.depth - want) < 1e-12, "case %d: depth %.4f, the asked fact starts at %.4f", (int)i,
                      a.depth, want);
        kvm_task_case_deinit(&a);
    }
}
END_TEST

/* Text with no sentence end: the fact went at byte depth·len, inside a 3-byte character at
 * case 3 (0.4 · 603 = 241), which became two invalid sequences around it. */
START_TEST(test_task_utf8)
{
    char text[700];
    size_t n = 0;
    for (int i = 0; i < 201; i++) {
        memcpy(text + n, "\xe7\x8c\xab", 3); /* U+732B */
        n += 3;
    }
    for (int kind = 0; kind < 3; kind++)
        for (uint64_t i = 0; i < KVM_TASK_DEPTHS; i++) {
            kvm_task_case a;
            ck_assert_int_eq(kvm_task_make((kvm_task_kind)kind, text, n, i, &a), 0);
            ck_assert_msg(utf8_whole(a.document, a.document_len), "%s case %d splits a character",
                          kvm_task_name((kvm_task_kind)kind), (int)i);
            kvm_task_case_deinit(&a);
        }
}
END_TEST

START_TEST(test_task_cases)
{
    size_t n;
    char *text = kvm_test_read_file(kvm_test_data_path("corpus/doc_000.txt"), &n);
    ck_assert_ptr_nonnull(text);
    for (int kind = 0; kind < 3; kind++)
        for (uint64_t i = 0; i < 12; i++) {
            kvm_task_case a, b;
            ck_assert_int_eq(kvm_task_make((kvm_task_kind)kind, text, n, i, &a), 0);
            ck_assert_int_eq(kvm_task_make((kvm_task_kind)kind, text, n, i, &b), 0);
            ck_assert_str_eq(a.document, b.document); /* deterministic */
            ck_assert_str_eq(a.answer, b.answer);
            ck_assert_str_eq(a.question, b.question);
            /* the answer is in the document (once, but twice for the pass key's repetition) at
             * about the depth, and the original text is all there */
            const char *at = strstr(a.document, a.answer);
            ck_assert_ptr_nonnull(at);
            double want = 0.1 * (double)(1 + i % KVM_TASK_DEPTHS), got = (double)(at - a.document) / strlen(a.document);
            ck_assert_msg(fabs(got - want) < 0.08, "%s case %d: answer at %.3f, depth %.1f", kvm_task_name(kind),
                          (int)i, got, want);
            ck_assert(fabs(a.depth - want) < 0.08);
            ck_assert_int_eq(kvm_task_match(a.answer, a.document, strlen(a.document)), 1);
            size_t extra = strlen(a.document) - n;
            ck_assert(extra > 20 && extra < (kind == KVM_TASK_MULTIKEY ? 200u : 100u));
            if (kind == KVM_TASK_MULTIKEY) { /* four doors, one asked */
                int doors = 0;
                for (const char *p = a.document; (p = strstr(p, "The code for the ")); p++)
                    doors++;
                ck_assert_int_eq(doors, KVM_TASK_MULTI_KEYS);
            }
            kvm_task_case_deinit(&a);
            kvm_task_case_deinit(&b);
        }
    kvm_task_case a, b;
    ck_assert_int_eq(kvm_task_make(KVM_TASK_PASSKEY, text, n, 0, &a), 0);
    ck_assert_int_eq(kvm_task_make(KVM_TASK_PASSKEY, text, n, 1, &b), 0);
    ck_assert_str_ne(a.answer, b.answer);
    kvm_task_case_deinit(&a);
    kvm_task_case_deinit(&b);
    ck_assert_int_eq(kvm_task_make(KVM_TASK_PASSKEY, text, 0, 0, &a), KVM_EINVAL);
    free(text);
    kvm_task_kind k;
    ck_assert_int_eq(kvm_task_parse("multikey", &k), 0);
    ck_assert_int_eq(k, KVM_TASK_MULTIKEY);
    ck_assert_int_eq(kvm_task_parse("needle", &k), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "passkey|recall|multikey"));
    /* exact match with word boundaries, ASCII case folded */
    const char *g = "The pass key is 48213.";
    ck_assert_int_eq(kvm_task_match("48213", g, strlen(g)), 1);
    ck_assert_int_eq(kvm_task_match("4821", g, strlen(g)), 0);
    ck_assert_int_eq(kvm_task_match("482130", g, strlen(g)), 0);
    ck_assert_int_eq(kvm_task_match("marta quill", "Marta Quill", 11), 1);
    ck_assert_int_eq(kvm_task_match("Marta Quill", "Marta Quillson", 14), 0);
    ck_assert_int_eq(kvm_task_match("Marta Quill", "Marta Quill", 5), 0);
    ck_assert_int_eq(kvm_task_match("", g, strlen(g)), 0);
    /* complete once a character closes the answer: no later token changes the score */
    ck_assert_int_eq(kvm_task_answered("48213", "The pass key is 48213", 21), 0);
    ck_assert_int_eq(kvm_task_answered("48213", "The pass key is 48213.", 22), 1);
    ck_assert_int_eq(kvm_task_answered("48213", "The pass key is 482130 ", 23), 0);
    ck_assert_int_eq(kvm_task_answered("Marta Quill", "Marta Quill\n", 12), 1);
    /* Wilson 95%: 8/10 gives [0.490, 0.943]; McNemar exact */
    double lo, hi;
    kvm_task_wilson(8, 10, &lo, &hi);
    ck_assert_double_eq_tol(lo, 0.4902, 1e-4);
    ck_assert_double_eq_tol(hi, 0.9433, 1e-4);
    kvm_task_wilson(0, 5, &lo, &hi);
    ck_assert(lo == 0.0 && hi > 0.4 && hi < 0.5);
    ck_assert_double_eq_tol(kvm_task_mcnemar_p(0, 3), 0.25, 1e-12);
    ck_assert_double_eq_tol(kvm_task_mcnemar_p(10, 0), 2.0 / 1024, 1e-12);
    ck_assert_double_eq(kvm_task_mcnemar_p(5, 5), 1.0);
    ck_assert_double_eq(kvm_task_mcnemar_p(0, 0), 1.0);
    ck_assert_double_eq_tol(kvm_task_mcnemar_p(2, 8), 2 * (1 + 10 + 45) / 1024.0, 1e-12);
}
END_TEST

/* ---- the command ---- */
static char *cmdbuf(const char *fmt, const char *a, const char *b)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, fmt, kvm_test_bin(), kvm_test_data(), a ? a : "", b ? b : "");
    return buf;
}

#define EVAL "%s/kvmill eval --model %s/models/stories260K.bin --context 64 --continuation 8 "

static void expect_usage_error(const char *args, const char *msg)
{
    char *out = NULL, *err = NULL;
    char full[4096];
    snprintf(full, sizeof full, EVAL "--docs %s/corpus/doc_000.txt %s", kvm_test_bin(), kvm_test_data(),
             kvm_test_data(), args);
    int st = kvm_test_run(full, &out, &err);
    ck_assert_msg(st == 2, "%s: exit %d, stderr %s", args, st, err);
    ck_assert_msg(strstr(err, msg), "%s: stderr '%s' lacks '%s'", args, err, msg);
    free(out);
    free(err);
}

/* `eval --method full` without --budget/--ratio was refused ("give exactly one of --budget and
 * --ratio"), though full KV keeps every entry and needs no budget: it runs. Another method
 * beside it still needs one, and the refusal names that method. */
START_TEST(test_cli_full_no_budget)
{
    char *out = NULL, *err = NULL, full[4096];
    snprintf(full, sizeof full, EVAL "--docs %s/corpus/doc_000.txt --method full", kvm_test_bin(), kvm_test_data(),
             kvm_test_data());
    int st = kvm_test_run(full, &out, &err);
    ck_assert_msg(st == 0 && strstr(out, "\nfull ") && strstr(out, "0.000000"), "exit %d: %s%s", st, out, err);
    free(out);
    free(err);
    expect_usage_error("--method full,h2o:sinks=2", "--method h2o:sinks=2 needs a budget");
    expect_usage_error("--method full:x=1,full,sculpt", "--method sculpt needs a budget");
}
END_TEST

/* --continuation 4 without --decode-steps was refused ("--decode-steps 8: at most the
 * continuation (4)"): a default the user never set. The default is now min(8, continuation); an
 * explicit --decode-steps above the continuation is still refused. */
START_TEST(test_cli_decode_steps_default)
{
    char *out = NULL, *err = NULL, full[4096];
    const char *fmt = "%s/kvmill eval --model %s/models/stories260K.bin --docs %s/corpus/doc_000.txt --method h2o "
                      "--budget 1 --context 2 --continuation 4%s";
    snprintf(full, sizeof full, fmt, kvm_test_bin(), kvm_test_data(), kvm_test_data(), "");
    int st = kvm_test_run(full, &out, &err);
    ck_assert_msg(st == 0 && strstr(out, "\nh2o "), "exit %d: %s%s", st, out, err);
    free(out);
    free(err);
    snprintf(full, sizeof full, fmt, kvm_test_bin(), kvm_test_data(), kvm_test_data(), " --decode-steps 5");
    st = kvm_test_run(full, &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "--decode-steps 5: at most the continuation (4)"), "exit %d: %s", st, err);
    free(out);
    free(err);
}
END_TEST

START_TEST(test_cli_errors)
{
    expect_usage_error("--method h2o --budget 0", "--budget: 0 is outside");
    expect_usage_error("--method h2o --budget 99999999999999999999", "--budget: 99999999999999999999 is outside"); /* not "not an integer" */
    expect_usage_error("--method h2o --budget 8 --ratio 0.5", "exactly one of --budget and --ratio");
    /* a positive value a double cannot hold was said to be "outside (0, 1e+06]" */
    expect_usage_error("--method h2o --target-kl 1e-308", "--target-kl: 1e-308 is too close to 0 for a double");
    expect_usage_error("--method h2o --target-kl 1e999", "--target-kl: 1e999 is outside (0, 1e+06]");
    /* so was a sculpt option's: "--lambda 1e-320: expected a number in [0, 1e+06]" */
    expect_usage_error("--method sculpt:retain=4:lambda=1e-320 --budget 16",
                       "--method sculpt:retain=4:lambda=1e-320: --lambda 1e-320 is too close to 0 for a double");
    expect_usage_error("--method sculpt:retain=4 --ridge 1e-999 --budget 16",
                       "--ridge 1e-999 is outside [1e-12, 1e+06] (beyond a double's range)");
    { /* a listed document that does not open (a dangling link named *.txt) is a usage error, as
       * sculpt's --doc says it: eval exited 1 */
        char *dir = kvm_test_tmpdir(), sub[4200], full[8192];
        snprintf(sub, sizeof sub, "%s/bad.txt", dir);
        ck_assert_int_eq(symlink("/nonexistent/kvmill-doc", sub), 0);
        snprintf(full, sizeof full, EVAL "--docs %s --method h2o --budget 16", kvm_test_bin(), kvm_test_data(), dir);
        char *out = NULL, *err = NULL;
        int st = kvm_test_run(full, &out, &err);
        ck_assert_msg(st == 2 && strstr(err, "bad.txt"), "exit %d, stderr %s", st, err);
        free(out);
        free(err);
        kvm_test_rmtree(dir);
        free(dir);
    }
    /* at or above the context every document keeps everything: refused as run refuses it (it was clamped unsaid) */
    expect_usage_error("--method full,h2o --budget 16,70", "--budget 70 is not below --context 64");
    expect_usage_error("--method sculpt --budget 64", "--budget 64 is not below --context 64");
    expect_usage_error("--method h2o --ratio 0.5,1", "--ratio 1 keeps every entry");
    expect_usage_error("--method h2o", "--method h2o needs a budget: give one of --budget and --ratio");
    expect_usage_error("--method bogus --budget 8", "unknown method 'bogus'");
    expect_usage_error("--method polykv --budget 8", "needs ':ARG'");
    expect_usage_error("--method polykv:/nonexistent/s.bin --budget 8", "/nonexistent/s.bin");
    expect_usage_error("--method h2o --ratio 1.5", "--ratio: 1.5 is outside");
    expect_usage_error("--method h2o --ratio 1e-400", "--ratio: 1e-400 is outside"); /* not "not a number" */
    expect_usage_error("--method h2o --budget 8 --phases decode", "--phases: 'decode'");
    expect_usage_error("--method h2o --budget 8 --context 500 --continuation 100", "exceeds the model's window");
    expect_usage_error("--method h2o --budget 8 --bogus", "unknown option '--bogus'");
    expect_usage_error("--method h2o --budget 8 --dtype f8", "--dtype: 'f8' is not f32, f16 or bf16");
    expect_usage_error("--method h2o --budget 8 --dtype i32", "--dtype: 'i32' is not f32, f16 or bf16");
    expect_usage_error("--method h2o --budget 8 --decode-steps 9", "--decode-steps 9: at most the continuation");
    expect_usage_error("--method h2o --target-kl 0.1 --budget 8", "--target-kl chooses the budget");
    /* the one range, 0 excluded, in the one message (it said [0, 1e+06], then refused 0 apart) */
    expect_usage_error("--method h2o --target-kl -1", "--target-kl: -1 is outside (0, 1e+06]");
    expect_usage_error("--method h2o --target-kl 0", "--target-kl: 0 is outside (0, 1e+06]");
    expect_usage_error("--method h2o --target-kl 0.1 --target-step 0", "--target-step: 0 is outside");
    expect_usage_error("--method h2o --target-kl 0.1 --context 480 --continuation 20", "2 x --continuation");
    expect_usage_error("--method h2o --budget 8 --task needle", "unknown task 'needle'");
    expect_usage_error("--method h2o --budget 8 --cases 3", "need --task");
    expect_usage_error("--method h2o --budget 8 --first-case 3", "need --task");
    expect_usage_error("--method h2o --budget 8 --task passkey --cases 0", "--cases: 0 is outside");
    expect_usage_error("--method h2o --budget 8 --task passkey --system hi", "--system needs --chat");
    expect_usage_error("--method h2o --target-kl 0.1 --task passkey", "do not combine");
    expect_usage_error("--method h2o --budget 8 --target-step 4", "--target-step needs --target-kl");
    expect_usage_error("--method h2o --budget 8 --task passkey --context 500 --answer-tokens 100",
                       "--task: context 500 + --answer-tokens 100 exceeds the model's window of 512");
    expect_usage_error("--method sculpt --budget 40 --retain ''", "--retain needs a value");
    expect_usage_error("--method sculpt:queries= --budget 40", "--queries needs a value");
    expect_usage_error("--method sculpt --budget 40 --query-source ''", "--query_source needs a value");
    expect_usage_error("--method sculpt --budget 40 --query-source repeat@1e308+synthetic@1e308",
                       "the shares' sum overflows");
    /* --task: the continuation and --decode-steps play no part (said on stderr, not ignored unsaid; a
     * base command line may carry them); context + question + answer must fit */
    char *o2 = NULL, *e2 = NULL;
    int st2 = kvm_test_run(cmdbuf(EVAL "--docs %s/corpus/doc_000.txt --method h2o --budget 16 --task passkey --cases 1 "
                                       "--continuation 4",
                                  kvm_test_data(), NULL),
                           &o2, &e2);
    ck_assert_msg(st2 == 0 && strstr(e2, "--continuation does not apply with --task"),
                  "--task --continuation 4: exit %d, stderr %s", st2, e2);
    free(o2);
    free(e2);
    st2 = kvm_test_run(cmdbuf("%s/kvmill eval --model %s/models/stories260K.bin --docs %s/corpus/doc_000.txt%s "
                              "--method h2o --budget 16 --task recall --cases 1 --context 500 --answer-tokens 12",
                              kvm_test_data(), NULL),
                       &o2, &e2);
    ck_assert_msg(st2 == 2 && strstr(e2, "--answer-tokens 12 exceed the model's window of 512 tokens"), /* usage */
                  "exit %d, stderr %s", st2, e2);
    free(o2);
    free(e2);
    /* --target-kl with a sculpt-family method: the search starts above its retain zone (32 here) */
    st2 = kvm_test_run(cmdbuf(EVAL "--docs %s/corpus/doc_000.txt --method kvzip --queries 8 --target-kl 0.0001 "
                                   "--target-step 1%s",
                              kvm_test_data(), NULL),
                       &o2, &e2);
    ck_assert_msg(st2 == 0, "kvzip --target-kl: exit %d, stderr %s", st2, e2);
    free(o2);
    free(e2);
    /* a document shorter than the context: refused before any work as the input error it is */
    char *dir = kvm_test_tmpdir(), path[512], *out = NULL, *err = NULL;
    snprintf(path, sizeof path, "%s/short.txt", dir);
    ck_assert_int_eq(kvm_test_write_file(path, "Once upon a time.", 17), 0);
    int st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --budget 8", path, NULL), &out, &err);
    ck_assert_msg(st == 2, "exit %d, stderr %s", st, err);
    ck_assert_ptr_nonnull(strstr(err, "fewer than context 64"));
    free(out);
    free(err);
    /* an empty document read as its BOS alone: "1 token, fewer than context 64"; it is named empty */
    snprintf(path, sizeof path, "%s/empty.txt", dir);
    ck_assert_int_eq(kvm_test_write_file(path, "", 0), 0);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --budget 8", path, NULL), &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "--docs ") && strstr(err, "empty.txt: the document is empty (0 bytes)") &&
                      !strstr(err, "1 token"),
                  "exit %d, stderr %s", st, err);
    free(out);
    free(err);
    /* a JSONL corpus was evaluated as one text, its JSON syntax and all: refused, named */
    snprintf(path, sizeof path, "%s/c.jsonl", dir);
    static const char row[] =
        "{\"id\": \"a\", \"text\": \"Once upon a time there was a cat. It sat on a mat all day "
        "long and dreamt of fish, of birds, of mice and of the big red ball it lost. One day a girl came by and "
        "gave the cat a new ball, and the cat was happy and played with it until the sun went "
        "down.\"}\n";
    ck_assert_int_eq(kvm_test_write_file(path, row, strlen(row)), 0);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --budget 8", path, NULL), &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "--docs ") && strstr(err, "c.jsonl: a JSONL corpus (one document per line"),
                  "exit %d, stderr %s", st, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A document with a NUL byte: the KL evaluation reads all of it, but --task built each case's
 * text as a C string, so a case whose fact went after the NUL lost the fact and the rest of the
 * document (context 52 tokens, the question about a pass key it never saw). Every case now
 * holds its whole document, as many tokens as --context takes. */
START_TEST(test_cli_task_nul)
{
    char *dir = kvm_test_tmpdir(), doc[4200], cmd[8192], text[1400];
    size_t n = 0;
    for (int i = 0; i < 5; i++)
        n += (size_t)snprintf(text + n, sizeof text - n, "Once upon a time there was a cat. ");
    text[n++] = '\0';
    for (int i = 0; i < 30; i++)
        n += (size_t)snprintf(text + n, sizeof text - n, "The dog ran home. ");
    snprintf(doc, sizeof doc, "%s/nul.txt", dir);
    ck_assert_int_eq(kvm_test_write_file(doc, text, n), 0);
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --context 256 --docs %s --task passkey --cases 4 "
             "--method h2o --budget 32",
             kvm_test_bin(), kvm_test_data(), doc);
    char *out = NULL, *err = NULL;
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
    for (int i = 0; i < 4; i++) { /* cases 2 and 3 put the fact after the NUL byte */
        char line[64];
        snprintf(line, sizeof line, "case %4d nul ", i);
        const char *at = strstr(out, line);
        ck_assert_msg(at && strstr(at, " context   256 ") && strstr(at, " context   256 ") < strchr(at, '\n'),
                      "case %d: not the whole context: %s", i, out);
    }
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* An answer's text was kept in 512 bytes: with --answer-tokens in the hundreds the CSV's
 * generated field stopped at its first 511 bytes, and the exact match (and the early stop)
 * looked at that start only, so an answer given later was scored wrong. The whole text now. */
START_TEST(test_cli_task_long_answer)
{
    char *dir = kvm_test_tmpdir(), csv[4200], cmd[8192];
    snprintf(csv, sizeof csv, "%s/t.csv", dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --context 128 --docs %s/corpus/doc_000.txt --task "
             "passkey --cases 1 --answer-tokens 300 --method h2o --budget 32 --csv %s",
             kvm_test_bin(), kvm_test_data(), kvm_test_data(), csv);
    char *out = NULL, *err = NULL;
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
    char *text = kvm_test_read_file(csv, NULL);
    ck_assert_ptr_nonnull(text);
    size_t longest = 0;
    for (const char *p = strchr(text, '"'); p; p = strchr(p, '"')) { /* the quoted generated fields */
        const char *q = strchr(p + 1, '"');
        ck_assert_ptr_nonnull(q);
        if ((size_t)(q - p - 1) > longest) longest = (size_t)(q - p - 1);
        p = q + 1;
    }
    ck_assert_msg(longest > 600, "the longest answer holds %zu bytes: %s", longest, text);
    free(text);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The first row of the mean section of an eval's stdout: budget, ratio, kl_mean, kl_median. */
static void mean_row(const char *out, double *v)
{
    const char *m = strstr(out, "== mean over");
    ck_assert_ptr_nonnull(m);
    m = strchr(strchr(m, '\n') + 1, '\n') + 1; /* past the header */
    ck_assert_int_eq(sscanf(m, "%*s %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3]), 4);
}

/* Runs `kvmill eval` on stories260K at context 64, continuation 8 with args (of any length: the
 * helpers above hold 4 KiB); returns the exit status with stdout and stderr. */
static int eval_long(const char *args, char **out, char **err)
{
    size_t n = strlen(args) + 8192;
    char *cmd = malloc(n);
    ck_assert_ptr_nonnull(cmd);
    snprintf(cmd, n, EVAL "--docs %s/corpus/doc_000.txt %s", kvm_test_bin(), kvm_test_data(), kvm_test_data(), args);
    int st = kvm_test_run(cmd, out, err);
    free(cmd);
    return st;
}

/* Options were copied into fixed buffers and cut to fit in silence: a long --lambda value cut
 * the joined flags and the method's own options after them (retain=4 lost: the run used
 * retain 32), a long method item lost its tail. Options now fit whole or are refused. */
START_TEST(test_cli_long_options)
{
    char zeros[2200], args[16384], *out = NULL, *err = NULL;
    memset(zeros, '0', sizeof zeros - 1);
    zeros[sizeof zeros - 1] = '\0';
    double a[4], b[4];
    snprintf(args, sizeof args,
             "--method sculpt:retain=4:queries=64:iterations=2 --lambda 0.1%s --budget 40 "
             "--decode-steps 0",
             zeros);
    int st = eval_long(args, &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    mean_row(out, a);
    free(out);
    free(err);
    st = eval_long("--method sculpt:retain=4:queries=64:iterations=2 --lambda 0.1 --budget 40 --decode-steps 0", &out,
                   &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    mean_row(out, b);
    free(out);
    free(err);
    ck_assert_msg(a[2] == b[2] && a[3] == b[3], "kl %g %g with the long --lambda, %g %g with 0.1", a[2], a[3], b[2],
                  b[3]);
    snprintf(args, sizeof args, "--method sculpt:retain=4:lambda=0.1%s%s%s --budget 16", zeros, zeros, zeros);
    st = eval_long(args, &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "bytes, more than the 6143 a job holds; shorten it") && !*out, "exit %d: %s",
                  st, err);
    free(out);
    free(err);
}
END_TEST

START_TEST(test_cli_csv)
{
    char *dir = kvm_test_tmpdir(), csv[512], docs[1024], *out = NULL, *err = NULL;
    snprintf(csv, sizeof csv, "%s/r.csv", dir);
    snprintf(docs, sizeof docs, "%s/corpus/doc_000.txt,%s/corpus/doc_001.txt --csv %s", kvm_test_data(),
             kvm_test_data(), csv);
    int st = kvm_test_run(cmdbuf(EVAL "--docs %s --method full,h2o --budget 16 --phases both", docs, NULL), &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    ck_assert_ptr_nonnull(strstr(out, "== mean over 2 documents"));
    size_t n;
    char *text = kvm_test_read_file(csv, &n);
    ck_assert_ptr_nonnull(text);
    ck_assert_int_eq(strncmp(text, KVM_EVAL_CSV_HEADER "\n", strlen(KVM_EVAL_CSV_HEADER) + 1), 0);
    int lines = 0;
    for (size_t i = 0; i < n; i++)
        lines += text[i] == '\n';
    ck_assert_int_eq(lines, 1 + 2 * 2);
    ck_assert_ptr_nonnull(strstr(text, "\ndoc_000,full,64.0000,1.000000,0,0,0,1.000000,"));
    ck_assert_ptr_nonnull(strstr(text, "\ndoc_001,h2o,16.0000,0.250000,"));
    free(text);
    free(out);
    free(err);
    /* a document named with a comma and a quote: the name was written bare and split its row
     * into 15 fields under a 14-field header; it is quoted now (RFC 4180) */
    char sub[600], doc[700], cmd[2048];
    snprintf(sub, sizeof sub, "%s/d", dir);
    ck_assert_int_eq(mkdir(sub, 0755), 0);
    snprintf(doc, sizeof doc, "%s/a\"b,c.txt", sub);
    snprintf(cmd, sizeof cmd, "cp '%s/corpus/doc_000.txt' '%s'", kvm_test_data(), doc);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(docs, sizeof docs, "%s --csv %s", sub, csv);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --budget 16", docs, NULL), &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    text = kvm_test_read_file(csv, &n);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(strstr(text, "\n\"a\"\"b,c\",h2o,16.0000,"), "%s", text);
    free(text);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Non-finite numbers never read as a good cache: a model whose values overflow f16 (wv x 1e5)
 * printed KL 0.000000 for --dtype f16 (the store's encoder made them inf, the logits NaN, and
 * the KL clamp made NaN 0), exit 0; now the cache is refused naming layer and value (bf16 keeps
 * it). A model whose logits are not finite (final norm weight inf) printed KL 0 too; now nan,
 * in the table and the CSV, with a note naming the document and exit 1. (The weights stay
 * finite: 3e38 final norm weights overflow the activations.) */
START_TEST(test_cli_nonfinite)
{
    char *dir = kvm_test_tmpdir(), cmd[4096], part[600], *out = NULL, *err = NULL;
    kvm_test_scaled_model(dir, "bigv", 5, 1e5f, 0);
    kvm_test_scaled_model(dir, "nanlogits", 0, 1, 3e38f);
    const char *base = "%s/kvmill eval --model %s/%s.bin --docs %s/corpus/doc_000.txt --context 64 --continuation 16 "
                       "--method h2o --budget 32 %s";
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), dir, "bigv", kvm_test_data(), "--dtype f16");
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 1 && strstr(err, "doc_000, h2o: cache layer 0, KV head 0, value of entry ") &&
                      strstr(err, "exceeds f16's range (65504): store it as bf16 or f32"),
                  "exit %d: %s%s", st, out, err);
    ck_assert_msg(!strstr(out, "0.000000"), "%s", out);
    free(out), free(err);
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), dir, "bigv", kvm_test_data(), "--dtype bf16");
    st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0 && strstr(out, "stored as bf16"), "exit %d: %s%s", st, out, err);
    free(out), free(err);
    char csvopt[700];
    snprintf(csvopt, sizeof csvopt, "--csv %s/r.csv", dir);
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), dir, "nanlogits", kvm_test_data(), csvopt);
    st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 1 && strstr(err, "doc_000, h2o: KL is nan: the model's logits are not finite"), "exit %d: %s%s",
                  st, out, err);
    ck_assert_msg(strstr(out, "h2o                             32.00  0.5000        nan        nan        nan"), "%s",
                  out);
    snprintf(part, sizeof part, "%s/r.csv.part", dir);
    size_t n;
    char *text = kvm_test_read_file(part, &n);
    ck_assert_msg(text && strstr(text, "\ndoc_000,h2o,32.0000,0.500000,nan,nan,nan,"), "%s", text ? text : "no csv");
    /* the failed row stays out of the mean, and the header says the means are not over every
     * document; a NaN prints "nan" whatever its sign bit (ppl printed "-nan") */
    ck_assert_msg(strstr(out, "== mean over the documents each method measured (of 1)") && !strstr(out, "-nan") &&
                      (!text || !strstr(text, "-nan")) && strstr(err, "h2o: its mean is over 0 of the 1 documents"),
                  "%s%s", out, err);
    free(text), free(out), free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* An eval that failed after rows were written (--task's tenth case, on an empty second
 * document, exit 2) left them as --csv, a file that looked finished: rows now go to CSV.part,
 * renamed over CSV only on success. Every case is now made before any work, so that case is
 * refused up front: the old CSV stays as it was and no .part is written. */
START_TEST(test_cli_csv_failed)
{
    char *dir = kvm_test_tmpdir(), csv[512], part[600], empty[512], cmd[4096], *out = NULL, *err = NULL;
    snprintf(csv, sizeof csv, "%s/r.csv", dir);
    snprintf(part, sizeof part, "%s.part", csv);
    snprintf(empty, sizeof empty, "%s/empty.txt", dir);
    ck_assert_int_eq(kvm_test_write_file(empty, "", 0), 0);
    ck_assert_int_eq(kvm_test_write_file(csv, "keep\n", 5), 0);
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --context 128 --docs %s/corpus/doc_000.txt,%s "
             "--task passkey --cases 12 --method h2o --budget 32 --threads 1 --csv %s",
             kvm_test_bin(), kvm_test_data(), kvm_test_data(), empty, csv);
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "task case 9 (empty)"), "exit %d: %s", st, err);
    ck_assert_msg(!strstr(out, "case "), "a case ran before the refusal: %s", out);
    char *text = kvm_test_read_file(csv, NULL);
    ck_assert_msg(text && !strcmp(text, "keep\n"), "--csv was rewritten: %s", text);
    free(text);
    size_t n;
    ck_assert_int_ne(access(part, F_OK), 0);
    free(out);
    free(err);
    /* the same without the empty document: CSV replaced, no .part left */
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --context 128 --docs %s/corpus/doc_000.txt "
             "--task passkey --cases 2 --method h2o --budget 32 --threads 1 --csv %s",
             kvm_test_bin(), kvm_test_data(), kvm_test_data(), csv);
    st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    text = kvm_test_read_file(csv, &n);
    ck_assert_msg(text && !strncmp(text, "case,task,doc,", 14), "%s", text);
    /* the last column: the mean NLL of full KV's answer under each cache (empty when full KV
     * answered nothing), full KV's own answer the likeliest of all under its own cache */
    ck_assert_ptr_nonnull(strstr(text, ",generated,answer_nll\n"));
    double nll_full = -1, nll_h2o = -1;
    for (char *line = strchr(text, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        char *end = strchr(line + 1, '\n'), *last = end;
        while (last > line && last[-1] != ',')
            last--;
        ck_assert_ptr_nonnull(end);
        double v = end > last ? strtod(last, NULL) : -1;
        if (strstr(line, ",full,") && strstr(line, ",full,") < end)
            nll_full = v;
        else
            nll_h2o = v;
        ck_assert_msg(end == last || (v >= 0 && v < 50), "answer_nll %.*s", (int)(end - line), line + 1);
    }
    ck_assert_msg(nll_full >= 0 && nll_h2o >= 0, "%s", text);
    free(text);
    ck_assert_int_ne(access(part, F_OK), 0);
    free(out);
    free(err);
    /* --csv a link to a file: the file gets the rows, the link stays (as writing through it did) */
    char real[600];
    snprintf(real, sizeof real, "%s/real.csv", dir);
    ck_assert_int_eq(kvm_test_write_file(real, "old\n", 4), 0);
    ck_assert_int_eq(unlink(csv), 0);
    ck_assert_int_eq(symlink(real, csv), 0);
    st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    struct stat sb;
    ck_assert(lstat(csv, &sb) == 0 && S_ISLNK(sb.st_mode));
    text = kvm_test_read_file(real, NULL);
    ck_assert_msg(text && !strncmp(text, "case,task,doc,", 14), "%s", text);
    free(text);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Two evals given one --csv shared CSV.part: each emptied and wrote the other's file, and the
 * first to finish renamed it into place, exit 0, holding the other run's rows (the other then
 * failed, or also exited 0). CSV.part is now written under an exclusive lock: while another
 * process holds it (here this test) eval is refused, exit 2, and neither CSV nor CSV.part is
 * touched; once it is free the run writes CSV as before. */
START_TEST(test_cli_csv_locked)
{
    char *dir = kvm_test_tmpdir(), csv[512], part[600], args[2048], *out = NULL, *err = NULL;
    snprintf(csv, sizeof csv, "%s/r.csv", dir);
    snprintf(part, sizeof part, "%s.part", csv);
    ck_assert_int_eq(kvm_test_write_file(csv, "keep\n", 5), 0);
    ck_assert_int_eq(kvm_test_write_file(part, "other run\n", 10), 0);
    int fd = open(part, O_RDWR);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(flock(fd, LOCK_EX | LOCK_NB), 0); /* another writer at work */
    snprintf(args, sizeof args, "%s/corpus/doc_000.txt --csv %s", kvm_test_data(), csv);
    int st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --budget 16 --threads 1", args, NULL), &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "r.csv: another process is writing it (") &&
                      strstr(err, "r.csv.part is locked"),
                  "exit %d: %s", st, err);
    free(out);
    free(err);
    char *text = kvm_test_read_file(csv, NULL);
    ck_assert_msg(text && !strcmp(text, "keep\n"), "--csv was rewritten: %s", text);
    free(text);
    text = kvm_test_read_file(part, NULL);
    ck_assert_msg(text && !strcmp(text, "other run\n"), "the other writer's .part was touched: %s", text);
    free(text);
    close(fd); /* the other writer is done: the name is free */
    ck_assert_int_eq(unlink(part), 0);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --budget 16 --threads 1", args, NULL), &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    free(out);
    free(err);
    text = kvm_test_read_file(csv, NULL);
    ck_assert_msg(text && !strncmp(text, KVM_EVAL_CSV_HEADER "\n", strlen(KVM_EVAL_CSV_HEADER) + 1), "%s", text);
    free(text);
    ck_assert_int_ne(access(part, F_OK), 0);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Options a sculpt-family method never reads were accepted silently: kvzip:iterations=10 (kvzip
 * runs no L-BFGS), am's bias (always fitted), joint-fixed's kcap (its keys never move). They are
 * still accepted (strategy files and configs share one option set) with one stderr note per
 * method naming them; options the method reads get none, and neither does kvmill sculpt's
 * --method sculpt. kvmill sculpt notes its flags the same way. */
START_TEST(test_cli_unused_options)
{
    const char *cases[][2] = {
        {"kvzip:iterations=10", "--method kvzip:iterations=10: note: iterations not read by this method; ignored"},
        {"am:iterations=10:bias:ridge=0.01", "--method am:iterations=10:bias:ridge=0.01: note: iterations, bias not"},
        {"joint-fixed:kcap=2:bias", "note: kcap, bias not read"},
        {"selectfit:rounds=3", "--method selectfit:rounds=3: note: rounds not read"},
        {"sculpt:iterations=3:kcap=2", NULL},
        {"selectfit:rounds=3:bias", NULL},
        {"kvzip:queries=64:retain=16", NULL},
        /* the allocation pilot's settings with uniform budgets (the default alloc): no pilot runs */
        {"sculpt:power=1:pilot_rounds=2:iterations=3", "--method sculpt:power=1:pilot_rounds=2:iterations=3: note: "
                                                       "power, pilot_rounds not read"},
        {"am:alloc=head:power=1", NULL},
        /* future places the synthetic queries; kvzip's query_source in eval is repeat */
        {"kvzip:future=16", "--method kvzip:future=16: note: future not read"},
        {"sculpt:query_source=continuation:future=16:queries=64", "note: future not read"},
        {"kvzip:future=16:query_source=repeat+synthetic:queries=64", NULL},
    };
    char args[1024];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out = NULL, *err = NULL;
        snprintf(args, sizeof args, "--docs %s/corpus/doc_000.txt --method %s --budget 40 --threads 1", kvm_test_data(),
                 cases[i][0]);
        int st = kvm_test_run(cmdbuf(EVAL "%s", args, NULL), &out, &err);
        ck_assert_msg(st == 0, "%s: exit %d: %s", cases[i][0], st, err);
        if (cases[i][1])
            ck_assert_msg(strstr(err, cases[i][1]), "%s: stderr '%s' lacks '%s'", cases[i][0], err, cases[i][1]);
        else
            ck_assert_msg(!strstr(err, "note:"), "%s: %s", cases[i][0], err);
        free(out);
        free(err);
    }
    char *dir = kvm_test_tmpdir(), cmd[4096], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd,
             "%s/kvmill sculpt --model %s/models/stories260K.bin --doc %s/corpus/doc_000.txt --context 64 "
             "--budget 40 --threads 1 --method kvzip --iterations 3 --rounds 2 --queries 64 --out %s/c.kvs",
             kvm_test_bin(), kvm_test_data(), kvm_test_data(), dir);
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0 && strstr(err, "note: --method kvzip does not read rounds, iterations; ignored"),
                  "exit %d: %s", st, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* An eval CSV's rows without the timings (seconds and what follows): doc, method, budget, ratio,
 * KL, top-1 and perplexities, which two runs over the same documents give alike. Caller frees. */
static char *csv_scores(const char *path)
{
    char *text = kvm_test_read_file(path, NULL);
    ck_assert_msg(text != NULL, "%s: not written", path);
    char *out = malloc(strlen(text) + 1), *w = out;
    for (const char *line = text; *line;) {
        const char *end = strchr(line, '\n');
        if (!end) end = line + strlen(line);
        int commas = 0;
        for (const char *p = line; p < end && commas < 10; p++) {
            commas += *p == ',';
            if (commas < 10) *w++ = *p;
        }
        *w++ = '\n';
        line = *end ? end + 1 : end;
    }
    *w = '\0';
    free(text);
    return out;
}

/* The same document under two names (a copy in the folder, a list naming a copy) was evaluated
 * twice and counted twice in the means, unsaid. Each distinct content is now evaluated once, with
 * one note per repeat naming both files, in each mode: the KL table's rows and means are those of
 * the distinct documents alone; --target-kl's summary counts them; --task's cases cycle over
 * them. What counts is what the mode reads: a document repeating another's first N + T tokens is
 * a repeat for KL, not for --task, whose cases are made from the whole text. */
START_TEST(test_cli_repeated_docs)
{
    char *dir = kvm_test_tmpdir(), docs[600], a[700], b[700], c[700], d[700], csv[700], csv0[700], args[4000];
    char *out = NULL, *err = NULL;
    snprintf(docs, sizeof docs, "%s/docs", dir);
    ck_assert_int_eq(mkdir(docs, 0755), 0);
    snprintf(a, sizeof a, "%s/a.txt", docs);
    snprintf(b, sizeof b, "%s/b.txt", docs);
    snprintf(c, sizeof c, "%s/c.txt", docs);
    snprintf(d, sizeof d, "%s/d.txt", dir);
    snprintf(csv, sizeof csv, "%s/x.csv", dir);
    snprintf(csv0, sizeof csv0, "%s/ac.csv", dir);
    kvm_test_concat_file(kvm_test_data_path("corpus/doc_000.txt"), NULL, a);
    kvm_test_concat_file(a, NULL, b);
    kvm_test_concat_file(kvm_test_data_path("corpus/doc_001.txt"), NULL, c);
    kvm_test_concat_file(a, kvm_test_data_path("corpus/doc_002.txt"), d); /* a's text, then more */
    char note[2048];
    snprintf(note, sizeof note, "kvmill eval: note: %s has the same content as %s; evaluating it once\n", b, a);
    snprintf(args, sizeof args, "%s,%s --csv %s", a, c, csv0);
    int st = kvm_test_run(cmdbuf(EVAL "--docs %s --method full,h2o --budget 16 --threads 1", args, NULL), &out, &err);
    ck_assert_msg(st == 0 && !strstr(err, "note:"), "exit %d: %s", st, err); /* the distinct documents alone */
    free(out);
    free(err);
    char *want = csv_scores(csv0), list[2200];
    snprintf(list, sizeof list, "%s,%s,%s", a, b, c);
    const char *specs[] = {docs, list}; /* a folder holding a copy; a list naming one */
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "%s --csv %s", specs[i], csv);
        st = kvm_test_run(cmdbuf(EVAL "--docs %s --method full,h2o --budget 16 --threads 1", args, NULL), &out, &err);
        ck_assert_msg(st == 0, "--docs %s: exit %d: %s", specs[i], st, err);
        ck_assert_msg(strstr(err, note) && kvm_test_count(err, "note:") == 1, "--docs %s: stderr lacks one '%s': %s",
                      specs[i], note, err);
        ck_assert_msg(strstr(out, "== mean over 2 documents") && !strstr(out, "== b "), "--docs %s: %s", specs[i], out);
        char *got = csv_scores(csv);
        ck_assert_msg(!strcmp(got, want), "--docs %s: rows\n%s\ndiffer from a and c's\n%s", specs[i], got, want);
        free(got);
        free(out);
        free(err);
    }
    free(want);
    /* --target-kl: the summary is over the distinct documents */
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --target-kl 0.05 --target-step 8 --threads 1", docs, NULL),
                      &out, &err);
    ck_assert_msg(st == 0 && strstr(err, note) && kvm_test_count(err, "note:") == 1, "--target-kl: exit %d: %s", st,
                  err);
    ck_assert_msg(strstr(out, "== over 2 documents") && !strstr(out, "== b:"), "--target-kl: %s", out);
    free(out);
    free(err);
    /* --task: case 9 is made from the second distinct document (c), not from a's copy */
    const char *task = "%s/kvmill eval --model %s/models/stories260K.bin --context 128 --docs %s --task passkey "
                       "--cases 10 --method h2o --budget 16 --threads 1";
    char full[8192];
    snprintf(full, sizeof full, task, kvm_test_bin(), kvm_test_data(), list);
    st = kvm_test_run(full, &out, &err);
    ck_assert_msg(st == 0 && strstr(err, note) && kvm_test_count(err, "note:") == 1, "--task: exit %d: %s", st, err);
    ck_assert_msg(strstr(out, "case    9 c ") && !strstr(out, " b "), "--task: %s", out);
    free(out);
    free(err);
    /* d repeats a's first N + T tokens: one document for KL, two for --task */
    char ad[1500], dnote[2048];
    snprintf(ad, sizeof ad, "%s,%s", a, d);
    snprintf(dnote, sizeof dnote, "kvmill eval: note: %s has the same content as %s; evaluating it once\n", d, a);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --budget 16 --threads 1", ad, NULL), &out, &err);
    ck_assert_msg(st == 0 && strstr(err, dnote) && strstr(out, "== mean over 1 document\n"), "KL: exit %d: %s%s", st,
                  err, out);
    free(out);
    free(err);
    snprintf(full, sizeof full, task, kvm_test_bin(), kvm_test_data(), ad);
    st = kvm_test_run(full, &out, &err);
    ck_assert_msg(st == 0 && !strstr(err, "note:") && strstr(out, "case    9 d "), "--task: exit %d: %s%s", st, err,
                  out);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Full-KV accuracy of SmolLM2 on committed cases (data/corpus/doc_000.txt, chat framing,
 * context 384): measured 9/9 on passkey and recall (cases 0-8), 4/9 on multikey (bench/RESULTS.md,
 * issue 14); cases 0-3 of passkey and recall are asserted within one case of that (4/4).
 * Without the model: SKIP. The stories260K model has
 * no chat template: --chat is refused by name. */
START_TEST(test_cli_task)
{
    char *out = NULL, *err = NULL, cmd[4096];
    int st = kvm_test_run(cmdbuf(EVAL "--docs %s/corpus/doc_000.txt --task passkey --chat --method h2o --budget 16",
                                 kvm_test_data(), NULL),
                          &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "no chat template"), "exit %d, stderr %s", st, err);
    free(out);
    free(err);
    /* plain framing runs on stories260K: one row per case, the summary */
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --context 256 --docs %s/corpus/doc_000.txt --task recall "
             "--cases 2 --method h2o --budget 16",
             kvm_test_bin(), kvm_test_data(), kvm_test_data());
    st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
    ck_assert_ptr_nonnull(strstr(out, "case    1 doc_000    depth 0.2"));
    ck_assert_ptr_nonnull(strstr(out, "== accuracy over 2 cases"));
    /* case 1 prefills from its fact on: case 0's document prefix is kept (kvm_eval_doc_new_after) */
    long long ctx = 0, reused = 0, tokens = 0, calls = 0;
    const char *cost = strstr(err, "task: 2 cases; context ");
    ck_assert_msg(cost && sscanf(cost, "task: 2 cases; context %lld tokens, %lld of them taken from their document's "
                                       "prefix; answers %lld tokens in %lld forward calls",
                                 &ctx, &reused, &tokens, &calls) == 4,
                  "stderr %s", err);
    ck_assert(reused > 0 && reused < ctx);
    ck_assert(calls < tokens); /* the second answer starts as the first did: checked as a draft */
    free(out);
    free(err);
    /* --first-case 1: the same case 1, alone */
    size_t at = strlen(cmd);
    snprintf(cmd + at, sizeof cmd - at, ",24 --first-case 1 --cases 1"); /* two budgets: a summary row each */
    char *out1 = NULL;
    st = kvm_test_run(cmd, &out1, &err);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
    ck_assert_ptr_nonnull(strstr(out1, "case    1 doc_000    depth 0.2"));
    ck_assert_ptr_null(strstr(out1, "case    0 "));
    ck_assert_ptr_nonnull(strstr(out1, "== accuracy over 1 cases"));
    out = out1;
    ck_assert_ptr_nonnull(strstr(out, "McNemar p = "));
    ck_assert_msg(strstr(out, "\nh2o @ 16 ") && strstr(out, "\nh2o @ 24 "), "summary names no budget: %s", out);
    free(out);
    free(err);
    /* --method full in a task: the baseline already, not a second column under a budget's name;
     * full KV right on no case (stories260K): "n/a", not "0.000 of its accuracy" */
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --context 128 --docs %s/corpus/doc_000.txt --task "
             "passkey --cases 1 --method full,h2o --budget 16",
             kvm_test_bin(), kvm_test_data(), kvm_test_data());
    st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
    ck_assert_msg(!strstr(out, "full @") && strstr(out, "\nh2o @ 16 "), "stdout %s", out);
    ck_assert_msg(strstr(err, "--method full adds no column"), "stderr %s", err);
    const char *full_row = strstr(out, "\nfull ");
    ck_assert_ptr_nonnull(full_row);
    const int full_none = strncmp(full_row + strspn(full_row + 5, " ") + 5, "0/1", 3) == 0;
    ck_assert_msg(!strstr(out, "vs full: n/a (full KV answered none)") == !full_none, "stdout %s", out);
    free(out);
    free(err);
    const char *smol = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
#if defined(__SANITIZE_ADDRESS__)
    printf("SKIP: SmolLM2 task accuracy not checked under the sanitizers (minutes there; the plain build runs it)\n");
    return;
#endif
    FILE *f = fopen(smol, "rb");
    if (!f) {
        printf("SKIP: %s absent (run scripts/get-model.sh): SmolLM2 task accuracy not checked\n", smol);
        return;
    }
    fclose(f);
    const struct {
        const char *task;
        int min_right;
    } want[] = {{"passkey", 3}, {"recall", 3}}; /* multikey (4/9) is too noisy for 4 cases */
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 "%s/kvmill eval --model %s --docs %s/corpus/doc_000.txt --context 384 --task %s --chat --cases 4 "
                 "--method streaming --budget 48 --threads 2",
                 kvm_test_bin(), smol, kvm_test_data(), want[i].task);
        st = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
        const char *row = strstr(out, "\nfull ");
        ck_assert_ptr_nonnull(row);
        int right = -1, n = -1;
        ck_assert_int_eq(sscanf(row, " full %d/%d", &right, &n), 2);
        printf("SmolLM2 %s full KV %d/%d\n", want[i].task, right, n);
        ck_assert_int_eq(n, 4);
        ck_assert_msg(right >= want[i].min_right, "%s: full KV %d/4, measured 4/4", want[i].task, right);
        free(out);
        free(err);
    }
}
END_TEST

/* --target-kl: one row per (document, method), the summary; a document with fewer than N + 2T
 * tokens takes context L − 2T and says so; the CSV's budget is the smallest on the grid. */
START_TEST(test_cli_target)
{
    char *dir = kvm_test_tmpdir(), csv[512], docs[1024], *out = NULL, *err = NULL;
    snprintf(csv, sizeof csv, "%s/t.csv", dir);
    snprintf(docs, sizeof docs, "%s/corpus/doc_000.txt --csv %s --target-step 8 --dtype f16", kvm_test_data(), csv);
    /* full keeps every entry: no budget to search (a row with budget 8 for it said what is not) */
    int st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o,full --target-kl 0.05", docs, NULL), &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "which method full does not take") && !*out, "exit %d: %s", st, err);
    free(out);
    free(err);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --target-kl 0.05", docs, NULL), &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    ck_assert_ptr_nonnull(strstr(out, "target KL 0.05 on tokens [64, 72), check on [72, 80), stored as f16"));
    ck_assert_ptr_nonnull(strstr(out, "within"));
    char *text = kvm_test_read_file(csv, NULL);
    ck_assert_ptr_nonnull(text);
    ck_assert_int_eq(strncmp(text, "doc,method,target_kl,context,budget_tokens,", 43), 0);
    ck_assert_ptr_nonnull(strstr(text, "\ndoc_000,h2o,0.05,64,"));
    free(text);
    free(out);
    free(err);
    /* two documents: the summary's median is the mean of the two budgets (it printed the upper) */
    snprintf(docs, sizeof docs, "%s/corpus/doc_000.txt,%s/corpus/doc_003.txt --csv %s --target-step 8", kvm_test_data(),
             kvm_test_data(), csv);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --target-kl 0.02", docs, NULL), &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    text = kvm_test_read_file(csv, NULL);
    long long b2[2] = {-1, -1};
    const char *row = text;
    for (int i = 0; i < 2 && row && (row = strstr(row + 1, ",h2o,0.02,64,")); i++)
        b2[i] = atoll(row + strlen(",h2o,0.02,64,"));
    const char *sum = strstr(out, "h2o                          budget ");
    double lo = -1, median = -1, hi = -1;
    ck_assert_msg(
        sum && sscanf(sum + strlen("h2o                          budget "), "%lf / %lf / %lf", &lo, &median, &hi) == 3,
        "%s", out);
    ck_assert_msg(b2[0] > 0 && b2[1] > 0 && median == 0.5 * (double)(b2[0] + b2[1]), "budgets %lld, %lld; summary: %s",
                  b2[0], b2[1], sum);
    free(text);
    free(out);
    free(err);
    char path[600];
    snprintf(path, sizeof path, "%s/short.txt", dir);
    const char *story = "Once upon a time, there was a little girl named Lily. She liked to play outside in the sun. "
                        "One day she saw a big red ball in the park and ran to get it.";
    ck_assert_int_eq(kvm_test_write_file(path, story, strlen(story)), 0);
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o --target-kl 0.05", path, NULL), &out, &err);
    ck_assert_msg(st == 0, "exit %d: %s", st, err);
    ck_assert_ptr_nonnull(strstr(out, "its last 16 tokens are the search and check parts"));
    free(out);
    free(err);
    /* that context, 38 tokens, leaves sculpt (retain zone 32) no budget to search below it: it
     * reported the whole context as the budget found, as --context would have been refused for
     * (and a context within the zone failed the run at that document, exit 1, after the rows
     * before it); refused before any work now, naming the document */
    snprintf(docs, sizeof docs, "%s,%s/corpus/doc_000.txt", path, kvm_test_data());
    st = kvm_test_run(cmdbuf(EVAL "--docs %s --method h2o,sculpt:queries=16 --target-kl 0.05", docs, NULL), &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "--target-kl: method sculpt:queries=16: no budget below the context of ") &&
                      strstr(err, "short.txt") && strstr(err, "above the retain zone") && !*out,
                  "exit %d: %s%s", st, out, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The batched continuation (no decode policy) and the token-by-token one (a policy that does
 * nothing) score the same compressed cache alike: they differ by float rounding only. */
static int count_calls(void *user, kvm_attn_site *site)
{
    (void)site;
    ++*(int *)user;
    return 0;
}

START_TEST(test_batched_equals_token_by_token)
{
    kvm_eval_doc *d;
    kvm_kvcache *c;
    h2o_quarter(&d, &c);
    int calls = 0;
    kvm_decode_policy *pol = calloc(1, sizeof *pol);
    pol->hooks = (kvm_hooks){.user = &calls, .cache_update = count_calls};
    kvm_eval_result rb, rt;
    ck_assert_int_eq(kvm_eval_continue(d, c, NULL, NULL, &rb), 0);
    ck_assert_int_eq(kvm_eval_continue(d, c, pol, NULL, &rt), 0);
    ck_assert_int_eq(calls, (T - 1) * model->cfg.n_layers); /* one decode call per token and layer */
    printf("batched KL %.9g, token by token %.9g\n", rb.kl_mean, rt.kl_mean);
    ck_assert(rb.kl_mean > 1e-4);
    ck_assert(fabs(rb.kl_mean - rt.kl_mean) < 1e-4 * rb.kl_mean);
    ck_assert(fabs(rb.ppl_compressed - rt.ppl_compressed) < 1e-4 * rb.ppl_compressed);
    ck_assert_double_eq(rb.top1, rt.top1);
    kvm_decode_policy_free(&pol);
    kvm_kvcache_free(&c);
    kvm_eval_doc_free(&d);
}
END_TEST

static Suite *eval_suite(void)
{
    Suite *s = suite_create("eval");
    struct {
        const char *name;
        const TTest *fn;
        int model;
    } cases[] = {{"kl_quantile", test_kl_quantile, 0},
                 {"method_table", test_method_table, 0},
                 {"method_evict_plan", test_method_evict_plan, 0},
                 {"full_budget_exact", test_full_budget_exact, 1},
                 {"small_budget", test_small_budget, 1},
                 {"batched_equals_token_by_token", test_batched_equals_token_by_token, 1},
                 {"answers", test_answers, 1},
                 {"prefix_reuse", test_prefix_reuse, 1},
                 {"target_budget", test_target_budget, 0},
                 {"store_dtype", test_store_dtype, 1},
                 {"cli_errors", test_cli_errors, 0},
                 {"cli_full_no_budget", test_cli_full_no_budget, 0},
                 {"cli_decode_steps_default", test_cli_decode_steps_default, 0},
                 {"cli_target", test_cli_target, 0},
                 {"task_cases", test_task_cases, 0},
                 {"task_utf8", test_task_utf8, 0},
                 {"task_depth_same_offset", test_task_depth_same_offset, 0},
                 {"cli_task", test_cli_task, 0},
                 {"cli_task_nul", test_cli_task_nul, 0},
                 {"cli_task_long_answer", test_cli_task_long_answer, 0},
                 {"cli_long_options", test_cli_long_options, 0},
                 {"cli_csv", test_cli_csv, 0},
                 {"cli_csv_failed", test_cli_csv_failed, 0},
                 {"cli_nonfinite", test_cli_nonfinite, 0},
                 {"cli_unused_options", test_cli_unused_options, 0},
                 {"cli_repeated_docs", test_cli_repeated_docs, 0},
                 {"cli_csv_locked", test_cli_csv_locked, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        if (cases[i].model) tcase_add_checked_fixture(tc, load_model, free_model);
        tcase_set_timeout(tc, strcmp(cases[i].name, "cli_task") ? 60 : 600); /* SmolLM2: 8 prefills */
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(eval_suite()); }
