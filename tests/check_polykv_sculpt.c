/* check_polykv_sculpt.c: KVSculpt (and KVzip scoring, "kvzip") inside PolyKV's per-layer
 * design space: "sculpt" is not an
 * eviction pattern; strategies that route layers to it encode, decode and plan correctly; the
 * polykv method distils exactly those layers (an all-sculpt uniform strategy equals
 * kvm_sculpt_compress, a mixed one shares its sculpt layers); the builder's memo changes no
 * score; calibration signals for sculpt (exact when the budget covers the context); the
 * method ARG's sculpt options and `kvmill calibrate --sculpt`. */
#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvm_model *model;
static int32_t ids[256];

static void load_model(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void free_model(void) { kvm_model_close(&model); }

/* Small, fast KVSculpt settings (the results only need to be deterministic). */
static kvm_sculpt_opts quick(void)
{
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.n_synth = 64;
    o.rounds = 1;
    o.lbfgs_iters = 5;
    o.future_tokens = 16;
    return o;
}

static int heads_equal(const kvm_kvcache *a, const kvm_kvcache *b, int l)
{
    for (int g = 0; g < a->n_kv_heads; g++) {
        const kvm_kv_head *x = kvm_kvcache_head(a, l, g), *y = kvm_kvcache_head(b, l, g);
        size_t nd = (size_t)(x->n * a->head_dim) * sizeof(float);
        if (x->n != y->n || memcmp(x->k, y->k, nd) || memcmp(x->v, y->v, nd) ||
            memcmp(x->pos, y->pos, (size_t)x->n * 4) || memcmp(x->bias, y->bias, (size_t)x->n * 4))
            return 0;
    }
    return 1;
}

static kvm_strategy *strategy_of(const kvm_pattern *p, int64_t B)
{
    kvm_strategy *s;
    ck_assert_int_eq(kvm_strategy_new(5, &s), 0);
    s->budget_avg = B;
    s->b_min = 1;
    s->alloc_power = 1.0;
    for (int l = 0; l < 5; l++) {
        s->layers[l].pattern[0] = s->layers[l].pattern[1] = p[l];
        s->layers[l].budget = B;
    }
    return s;
}

/* Scoring st on doc with the sculpt options already set gives the same positive KL without the
 * memo, on the memo's first call and from the memo; then restores the default options. */
static void assert_memo_neutral(kvm_eval_doc *doc, const kvm_strategy *st)
{
    double kl0, kl1, kl2;
    ck_assert_int_eq(kvm_polykv_score(&doc, 1, st, NULL, &kl0), 0);
    kvm_polykv_memo_begin();
    ck_assert_int_eq(kvm_polykv_score(&doc, 1, st, NULL, &kl1), 0);
    ck_assert_int_eq(kvm_polykv_score(&doc, 1, st, NULL, &kl2), 0);
    kvm_polykv_memo_end();
    kvm_polykv_score_sculpt_opts(NULL);
    ck_assert(kl0 == kl1 && kl1 == kl2 && kl0 > 0);
}

START_TEST(test_not_an_eviction_pattern)
{
    ck_assert_str_eq(kvm_pattern_name(KVM_PATTERN_SCULPT), "sculpt");
    kvm_pattern p;
    ck_assert_int_eq(kvm_pattern_parse("sculpt", &p), KVM_EINVAL);
    kvm_evict_plan *plan = NULL;
    ck_assert_int_eq(kvm_evict_plan_new(5, 4, KVM_PATTERN_SCULPT, 8, &plan), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "not an eviction pattern"));
    float obs[4] = {0.25f, 0.25f, 0.25f, 0.25f};
    kvm_evict_attn a = {.n = 4, .n_group = 1, .n_obs = 1, .obs = obs};
    int64_t keep[4], nk;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_SCULPT, NULL, &a, 2, keep, &nk), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "sculpt is not an eviction pattern"));
}
END_TEST

/* Strategy encoding and building with sculpt layers. */
START_TEST(test_strategy_with_sculpt)
{
    kvm_pattern pat[5] = {KVM_PATTERN_SCULPT, KVM_PATTERN_H2O, KVM_PATTERN_SCULPT, KVM_PATTERN_TOVA, KVM_PATTERN_SNAPKV};
    kvm_strategy *s = strategy_of(pat, 16), *back;
    uint8_t *b;
    size_t n;
    ck_assert_int_eq(kvm_strategy_encode(s, &b, &n), 0);
    ck_assert_uint_eq(b[24], KVM_PATTERN_SCULPT);
    ck_assert_uint_eq(b[25], KVM_PATTERN_SCULPT);
    ck_assert_int_eq(kvm_strategy_decode(b, n, &back), 0);
    ck_assert_int_eq(back->layers[2].pattern[1], KVM_PATTERN_SCULPT);
    kvm_strategy_free(&back);
    b[25] = KVM_PATTERN_H2O; /* sculpt in prefill only: refused */
    ck_assert_int_eq(kvm_strategy_decode(b, n, &back), KVM_EFORMAT);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "pattern pair 5/1 at offset 24"));
    b[24] = KVM_PATTERN_STRATEGY_COUNT; /* beyond kvzip */
    ck_assert_int_eq(kvm_strategy_decode(b, n, &back), KVM_EFORMAT);
    free(b);
    s->layers[1].pattern[1] = KVM_PATTERN_SCULPT;
    ck_assert_int_eq(kvm_strategy_encode(s, &b, &n), KVM_EINVAL);
    s->layers[1].pattern[1] = KVM_PATTERN_H2O;

    /* plans: sculpt layers are left to the caller (NONE) with their budget, in both phases */
    for (int ph = 0; ph < 2; ph++) {
        kvm_evict_plan *p;
        ck_assert_int_eq(kvm_strategy_plan(s, ph, 16, 4, &p), 0);
        ck_assert_int_eq(p->pattern[0], KVM_PATTERN_NONE);
        ck_assert_int_eq(p->pattern[2 * 4 + 3], KVM_PATTERN_NONE);
        ck_assert_int_eq(p->budget[2 * 4 + 3], 16);
        ck_assert_int_eq(p->pattern[1 * 4], KVM_PATTERN_H2O);
        kvm_evict_plan_free(&p);
    }
    kvm_strategy_free(&s);

    /* the builder routes a layer to sculpt when its prefill signal beats every eviction pattern */
    kvm_polykv_signals *sig;
    ck_assert_int_eq(kvm_polykv_signals_new(5, &sig), 0);
    for (int i = 0; i < 2 * 5 * KVM_PATTERN_COUNT; i++) {
        sig->cosine[i] = (i % KVM_PATTERN_COUNT) == KVM_PATTERN_TOVA ? 0.95 : 0.9;
        sig->ppl_delta[i] = (i % KVM_PATTERN_COUNT) == KVM_PATTERN_TOVA ? 0.1 : 0.5;
    }
    for (int l = 0; l < 5; l++) {
        sig->entropy[l] = 1.0;
        sig->sculpt_cosine[l] = l == 3 ? 0.99 : 0.94;
        sig->sculpt_ppl[l] = l == 3 ? 0.01 : 0.2;
    }
    ck_assert_int_eq(kvm_polykv_strategy_build(sig, KVM_POLYKV_SELECT_COSINE, 0, KVM_POLYKV_ALLOC_UNIFORM, 1, 16, 4, &s),
                     0);
    for (int l = 0; l < 5; l++) ck_assert_int_eq(s->layers[l].pattern[0], KVM_PATTERN_TOVA); /* not measured */
    kvm_strategy_free(&s);
    sig->has_sculpt = 1;
    for (int sel = 0; sel < 2; sel++) {
        ck_assert_int_eq(kvm_polykv_strategy_build(sig, sel, 0, KVM_POLYKV_ALLOC_UNIFORM, 1, 16, 4, &s), 0);
        for (int l = 0; l < 5; l++)
            for (int ph = 0; ph < 2; ph++)
                ck_assert_int_eq(s->layers[l].pattern[ph], l == 3 ? KVM_PATTERN_SCULPT : KVM_PATTERN_TOVA);
        kvm_strategy_free(&s);
    }
    ck_assert_int_eq(kvm_polykv_strategy_build(sig, KVM_POLYKV_SELECT_SINGLE, KVM_PATTERN_SCULPT,
                                               KVM_POLYKV_ALLOC_ENTROPY, 1, 16, 4, &s), 0);
    for (int l = 0; l < 5; l++) ck_assert_int_eq(s->layers[l].pattern[1], KVM_PATTERN_SCULPT);
    kvm_strategy_free(&s);
    kvm_polykv_signals_free(&sig);
}
END_TEST

/* The method distils the sculpt layers: all-sculpt at a uniform budget is kvm_sculpt_compress
 * (retain min(m, B/2)); in a mixed strategy the sculpt layers are the same and the eviction
 * layers are cut to their budget; scores through the memo equal scores without it. */
START_TEST(test_method_distils_sculpt_layers)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 96, 80, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_sculpt_opts so = quick();
    kvm_sculpt_opts ref_o = so;
    ref_o.retain_tokens = 10; /* min(32, 20/2) */
    ref_o.k_entries = 10;
    kvm_kvcache *ref, *all, *mix;
    ck_assert_int_eq(kvm_sculpt_compress(in, &ref_o, &ref, NULL), 0);

    kvm_pattern p_all[5] = {KVM_PATTERN_SCULPT, KVM_PATTERN_SCULPT, KVM_PATTERN_SCULPT, KVM_PATTERN_SCULPT,
                            KVM_PATTERN_SCULPT};
    kvm_pattern p_mix[5] = {KVM_PATTERN_SCULPT, KVM_PATTERN_H2O, KVM_PATTERN_SCULPT, KVM_PATTERN_SNAPKV,
                            KVM_PATTERN_STREAMING};
    kvm_strategy *s_all = strategy_of(p_all, 20), *s_mix = strategy_of(p_mix, 20);
    kvm_budget bud = {.tokens = 20};
    void *o_all, *o_mix;
    ck_assert_int_eq(kvm_polykv_method_opts_from(s_all, &bud, &o_all), 0);
    ck_assert_int_eq(kvm_polykv_method_opts_from(s_mix, &bud, &o_mix), 0);
    kvm_polykv_method_set_sculpt(o_all, &so);
    kvm_polykv_method_set_sculpt(o_mix, &so);
    ck_assert_int_eq(kvm_polykv_method_compress(in, o_all, &all), 0);
    ck_assert_int_eq(kvm_polykv_method_compress(in, o_mix, &mix), 0);
    for (int l = 0; l < 5; l++) ck_assert(heads_equal(all, ref, l));
    ck_assert(heads_equal(mix, ref, 0) && heads_equal(mix, ref, 2));
    for (int l = 0; l < 5; l++)
        for (int g = 0; g < 4; g++) {
            const kvm_kv_head *h = kvm_kvcache_head(mix, l, g);
            ck_assert_int_eq(h->n, 20);
            int distilled = 0;
            for (int64_t e = 0; e < h->n; e++) distilled += h->pos[e] == KVM_POS_NONE;
            ck_assert_int_eq(distilled, p_mix[l] == KVM_PATTERN_SCULPT ? 10 : 0);
        }
    /* head budgets split over every (layer, head) by entropy: the sculpt layers' mean budgets
     * never exceed the total memory */
    s_all->head_split = 2;
    kvm_kvcache *split;
    ck_assert_int_eq(kvm_polykv_method_compress(in, o_all, &split), 0);
    ck_assert_int_le(kvm_kvcache_entries(split), 5 * 4 * 20);
    ck_assert_int_gt(kvm_kvcache_entries(split), 5 * 4 * 20 - 4);
    int differs = 0;
    for (int l = 0; l < 5; l++) differs |= kvm_kvcache_head(split, l, 0)->n != 20;
    ck_assert(differs); /* the split moved budget between layers */
    kvm_kvcache_free(&split);
    s_all->head_split = 0;
    kvm_eval_result r;
    ck_assert_int_eq(kvm_eval_continue(doc, mix, NULL, NULL, &r), 0);
    ck_assert(isfinite(r.kl_mean) && r.kl_mean > 0);

    kvm_polykv_score_sculpt_opts(&so);
    double kl0, kl1, kl2;
    ck_assert_int_eq(kvm_polykv_score(&doc, 1, s_mix, NULL, &kl0), 0);
    kvm_polykv_memo_begin();
    ck_assert_int_eq(kvm_polykv_score(&doc, 1, s_mix, NULL, &kl1), 0); /* fills the memo */
    ck_assert_int_eq(kvm_polykv_score(&doc, 1, s_mix, NULL, &kl2), 0); /* served from it */
    kvm_polykv_memo_end();
    kvm_polykv_score_sculpt_opts(NULL);
    ck_assert(kl0 == kl1 && kl1 == kl2);
    ck_assert(kl0 == r.kl_mean);
    /* a solver setting that changes the fit makes the memo forget: served from it, the ridge's
     * precision or the gradient stop of the first options would be scored for the second */
    for (int v = 0; v < 2; v++) {
        kvm_sculpt_opts o2 = so;
        if (v == 0) o2.ridge_f32 = !so.ridge_f32;
        if (v == 1) o2.lbfgs_gtol = 0.5;
        double kl_memo, kl_fresh;
        kvm_polykv_memo_begin();
        kvm_polykv_score_sculpt_opts(&so);
        ck_assert_int_eq(kvm_polykv_score(&doc, 1, s_mix, NULL, &kl1), 0);
        kvm_polykv_score_sculpt_opts(&o2);
        ck_assert_int_eq(kvm_polykv_score(&doc, 1, s_mix, NULL, &kl_memo), 0);
        kvm_polykv_memo_end();
        ck_assert_int_eq(kvm_polykv_score(&doc, 1, s_mix, NULL, &kl_fresh), 0);
        kvm_polykv_score_sculpt_opts(NULL);
        ck_assert_msg(kl_fresh != kl1, "setting %d does not change the fit", v);
        ck_assert_msg(kl_memo == kl_fresh, "setting %d: memo %.9g, fresh %.9g", v, kl_memo, kl_fresh);
    }

    kvm_polykv_method_opts_free(o_all);
    kvm_polykv_method_opts_free(o_mix);
    kvm_strategy_free(&s_all);
    kvm_strategy_free(&s_mix);
    kvm_kvcache_free(&ref);
    kvm_kvcache_free(&all);
    kvm_kvcache_free(&mix);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* Sculpt signals: a budget covering the context keeps every layer whole (cosine exactly 1, KL
 * 0); a small one does not. */
START_TEST(test_calibrate_sculpt)
{
    kvm_eval_doc *d;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 64, 32, 8, &d), 0);
    kvm_polykv_signals *s;
    ck_assert_int_eq(kvm_polykv_signals_new(5, &s), 0);
    kvm_sculpt_opts so = quick();
    ck_assert_int_eq(kvm_polykv_calibrate_sculpt(&d, 1, 32, &so, s), 0);
    ck_assert_int_eq(s->has_sculpt, 1);
    for (int l = 0; l < 5; l++) ck_assert(s->sculpt_cosine[l] == 1.0 && s->sculpt_kl[l] == 0.0 && s->sculpt_ppl[l] == 0.0);
    ck_assert_int_eq(kvm_polykv_calibrate_sculpt(&d, 1, 8, &so, s), 0);
    double kl = 0;
    for (int l = 0; l < 5; l++) {
        ck_assert(s->sculpt_cosine[l] < 1.0 && s->sculpt_cosine[l] > 0.5);
        ck_assert(s->sculpt_kl[l] >= 0);
        kl += s->sculpt_kl[l];
    }
    ck_assert(kl > 0);
    s->budget = 8;
    char *dir = kvm_test_tmpdir(), path[512];
    snprintf(path, sizeof path, "%s/sig.csv", dir);
    FILE *f = fopen(path, "w");
    ck_assert_int_eq(kvm_polykv_signals_csv(s, f), 0);
    fclose(f);
    char *text = kvm_test_read_file(path, NULL);
    ck_assert_ptr_nonnull(strstr(text, "\nprefill,4,sculpt,8,"));
    ck_assert_ptr_nonnull(strstr(text, "\ndecode,0,sculpt,8,"));
    free(text);
    kvm_test_rmtree(dir);
    free(dir);
    ck_assert_int_eq(kvm_polykv_calibrate_sculpt(&d, 1, 0, &so, s), KVM_EINVAL);
    kvm_polykv_signals_free(&s);
    kvm_eval_doc_free(&d);
}
END_TEST

/* "polykv:FILE[:sculpt options]" and `kvmill calibrate --sculpt`. */
START_TEST(test_arg_and_cli)
{
    char *dir = kvm_test_tmpdir(), path[512], spec[1024];
    snprintf(path, sizeof path, "%s/s.bin", dir);
    kvm_pattern pat[5] = {KVM_PATTERN_SCULPT, KVM_PATTERN_H2O, KVM_PATTERN_H2O, KVM_PATTERN_H2O, KVM_PATTERN_H2O};
    kvm_strategy *s = strategy_of(pat, 16);
    ck_assert_int_eq(kvm_strategy_write(s, path), 0);
    kvm_strategy_free(&s);
    const kvm_method *m = kvm_method_find("polykv");
    kvm_model_config c = {.n_layers = 5};
    kvm_budget b = {.tokens = 16};
    void *o = NULL;
    snprintf(spec, sizeof spec, "%s:threads=2:queries=64:bias", path);
    ck_assert_int_eq(m->opts_new(spec, &b, &c, &o), 0);
    m->opts_free(o);
    snprintf(spec, sizeof spec, "%s:threads=0", path);
    ck_assert_int_eq(m->opts_new(spec, &b, &c, &o), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "threads"));
    snprintf(spec, sizeof spec, "%s:nonsense=1", path); /* not a setting: part of the file name */
    ck_assert_int_eq(m->opts_new(spec, &b, &c, &o), KVM_ENOTFOUND);

    char cmd[4096], *out = NULL, *err = NULL;
    const char *base = "%s/kvmill calibrate --model %s/models/stories260K.bin --docs %s/corpus/doc_000.txt "
                       "--budget 12 --context 40 --continuation 8 --out %s %s";
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), kvm_test_data(), kvm_test_data(), path, "--sculpt-opts threads=2");
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_ptr_nonnull(strstr(err, "--sculpt-opts needs --sculpt"));
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), kvm_test_data(), kvm_test_data(), path,
             "--sculpt --sculpt-opts lambda=-1");
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_ptr_nonnull(strstr(err, "lambda"));
    free(out);
    free(err);
    char extra[1024];
    snprintf(extra, sizeof extra, "--sculpt --sculpt-opts queries=64,rounds=1,iterations=5,threads=2 --dump-signals %s/sig.csv",
             dir);
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), kvm_test_data(), kvm_test_data(), path, extra);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "%s", err);
    ck_assert_ptr_nonnull(strstr(out, "sculpt cosine per layer:"));
    ck_assert_ptr_nonnull(strstr(out, "\nsculpt/uniform "));
    free(out);
    free(err);
    snprintf(path, sizeof path, "%s/sig.csv", dir);
    char *text = kvm_test_read_file(path, NULL);
    ck_assert_ptr_nonnull(strstr(text, "\nprefill,0,sculpt,12,"));
    free(text);
    /* --kvzip: its signals and its single-pattern candidates */
    snprintf(path, sizeof path, "%s/z.bin", dir);
    snprintf(extra, sizeof extra, "--kvzip --sculpt-opts queries=64 --dump-signals %s/zsig.csv --dump-candidates %s",
             dir, dir);
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), kvm_test_data(), kvm_test_data(), path, extra);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "%s", err);
    ck_assert_ptr_nonnull(strstr(out, "kvzip cosine per layer:"));
    ck_assert_ptr_nonnull(strstr(out, "\nkvzip/uniform "));
    ck_assert_ptr_null(strstr(out, "\nsculpt/uniform "));
    free(out);
    free(err);
    snprintf(path, sizeof path, "%s/zsig.csv", dir);
    text = kvm_test_read_file(path, NULL);
    ck_assert_ptr_nonnull(strstr(text, "\nprefill,0,kvzip,12,"));
    ck_assert_ptr_null(strstr(text, ",sculpt,"));
    /* the options the kvzip rows were measured with lead the file */
    ck_assert_msg(strstr(text, "# sculpt_options=method=sculpt,retain=32,queries=64,") == text, "%s", text);
    free(text);
    /* a candidate records the options it was scored with (KVST v2) */
    kvm_strategy *kz;
    snprintf(path, sizeof path, "%s/kvzip_uniform.bin", dir);
    ck_assert_int_eq(kvm_strategy_read(path, &kz), 0);
    ck_assert_int_eq(kz->sculpt_known, 1);
    ck_assert_int_eq(kz->sculpt.n_synth, 64);
    kvm_strategy_free(&kz);
    /* --signals keeps the kvzip rows only when they were measured with this run's options */
    snprintf(path, sizeof path, "%s/z.bin", dir);
    const char *again = "--kvzip --sculpt-opts %s --signals %s/%s";
    const struct {
        const char *opts, *file, *msg;
    } reuse[] = {{"queries=64", "zsig.csv", NULL},
                 {"queries=32", "zsig.csv", "--signals %s/zsig.csv: its kvzip rows were measured with other sculpt "
                                            "options: queries=32 (the file's: 64); measuring them again"},
                 {"queries=64", "old.csv", "--signals %s/old.csv: its kvzip rows were measured with sculpt options "
                                           "the file does not record"}};
    snprintf(cmd, sizeof cmd, "sed 1d %s/zsig.csv > %s/old.csv", dir, dir); /* as written before the line */
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    for (size_t i = 0; i < sizeof reuse / sizeof reuse[0]; i++) {
        snprintf(extra, sizeof extra, again, reuse[i].opts, dir, reuse[i].file);
        snprintf(cmd, sizeof cmd, base, kvm_test_bin(), kvm_test_data(), kvm_test_data(), path, extra);
        ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "%s", err);
        char want[1024];
        snprintf(want, sizeof want, reuse[i].msg ? reuse[i].msg : "--signals", dir);
        ck_assert_msg(reuse[i].msg ? strstr(err, want) != NULL : strstr(err, want) == NULL, "%s: %s", extra, err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* kvzip, a pattern of its own beside sculpt: not an eviction pattern, encoded in both phases,
 * chosen per layer on its signals, and applied by the method as KVzip scoring: an
 * all-kvzip uniform strategy is kvm_sculpt_compress in kvzip mode; a strategy mixing kvzip,
 * sculpt and eviction layers gives each layer its own method's heads; the memo keeps the two
 * apart; calibration signals are exact when the budget covers the context. */
START_TEST(test_kvzip_pattern)
{
    ck_assert_str_eq(kvm_pattern_name(KVM_PATTERN_KVZIP), "kvzip");
    ck_assert(kvm_pattern_is_distilled(KVM_PATTERN_KVZIP) && !kvm_pattern_is_distilled(KVM_PATTERN_SNAPKV));
    float obs[4] = {0.25f, 0.25f, 0.25f, 0.25f};
    kvm_evict_attn a = {.n = 4, .n_group = 1, .n_obs = 1, .obs = obs};
    int64_t keep[4], nk;
    ck_assert_int_eq(kvm_evict_select(KVM_PATTERN_KVZIP, NULL, &a, 2, keep, &nk), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "kvzip is not an eviction pattern"));

    kvm_pattern pat[5] = {KVM_PATTERN_KVZIP, KVM_PATTERN_H2O, KVM_PATTERN_SCULPT, KVM_PATTERN_KVZIP, KVM_PATTERN_SNAPKV};
    kvm_strategy *st = strategy_of(pat, 20), *back;
    uint8_t *b;
    size_t n;
    ck_assert_int_eq(kvm_strategy_encode(st, &b, &n), 0);
    ck_assert_int_eq(kvm_strategy_decode(b, n, &back), 0);
    for (int l = 0; l < 5; l++) ck_assert_int_eq(back->layers[l].pattern[1], pat[l]);
    kvm_strategy_free(&back);
    b[25] = KVM_PATTERN_H2O; /* kvzip in prefill only: refused */
    ck_assert_int_eq(kvm_strategy_decode(b, n, &back), KVM_EFORMAT);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "pattern pair 6/1 at offset 24"));
    free(b);
    kvm_evict_plan *plan;
    ck_assert_int_eq(kvm_strategy_plan(st, 1, 20, 4, &plan), 0);
    ck_assert_int_eq(plan->pattern[0], KVM_PATTERN_NONE);
    ck_assert_int_eq(plan->pattern[3 * 4], KVM_PATTERN_NONE);
    kvm_evict_plan_free(&plan);

    /* per-layer choice: kvzip where it beats the eviction patterns and sculpt */
    kvm_polykv_signals *sig;
    ck_assert_int_eq(kvm_polykv_signals_new(5, &sig), 0);
    for (int i = 0; i < 2 * 5 * KVM_PATTERN_COUNT; i++) {
        sig->cosine[i] = 0.9;
        sig->ppl_delta[i] = 0.5;
    }
    for (int l = 0; l < 5; l++) {
        sig->entropy[l] = 1.0;
        sig->sculpt_cosine[l] = l == 2 ? 0.99 : 0.8;
        sig->sculpt_ppl[l] = l == 2 ? 0.01 : 0.9;
        sig->kvzip_cosine[l] = l == 1 ? 0.98 : l == 2 ? 0.97 : 0.85;
        sig->kvzip_ppl[l] = l == 1 ? 0.02 : l == 2 ? 0.03 : 0.7;
    }
    sig->has_sculpt = sig->has_kvzip = 1;
    for (int sel = 0; sel < 2; sel++) {
        kvm_strategy *bs;
        ck_assert_int_eq(kvm_polykv_strategy_build(sig, sel, 0, KVM_POLYKV_ALLOC_UNIFORM, 1, 16, 4, &bs), 0);
        for (int l = 0; l < 5; l++)
            ck_assert_int_eq(bs->layers[l].pattern[1], l == 1   ? KVM_PATTERN_KVZIP
                                                       : l == 2 ? KVM_PATTERN_SCULPT
                                                                : KVM_PATTERN_STREAMING);
        kvm_strategy_free(&bs);
    }
    kvm_polykv_signals_free(&sig);

    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 96, 80, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_sculpt_opts so = quick(), zo = quick();
    so.retain_tokens = zo.retain_tokens = 10; /* min(32, 20/2) */
    so.k_entries = zo.k_entries = 10;
    zo.mode = KVM_SCULPT_KVZIP;
    kvm_kvcache *ref_s, *ref_z, *all, *mix;
    ck_assert_int_eq(kvm_sculpt_compress(in, &so, &ref_s, NULL), 0);
    ck_assert_int_eq(kvm_sculpt_compress(in, &zo, &ref_z, NULL), 0);
    kvm_pattern p_all[5] = {KVM_PATTERN_KVZIP, KVM_PATTERN_KVZIP, KVM_PATTERN_KVZIP, KVM_PATTERN_KVZIP,
                            KVM_PATTERN_KVZIP};
    kvm_strategy *s_all = strategy_of(p_all, 20);
    kvm_budget bud = {.tokens = 20};
    void *o_all, *o_mix;
    ck_assert_int_eq(kvm_polykv_method_opts_from(s_all, &bud, &o_all), 0);
    ck_assert_int_eq(kvm_polykv_method_opts_from(st, &bud, &o_mix), 0);
    kvm_sculpt_opts q = quick();
    kvm_polykv_method_set_sculpt(o_all, &q);
    kvm_polykv_method_set_sculpt(o_mix, &q);
    ck_assert_int_eq(kvm_polykv_method_compress(in, o_all, &all), 0);
    ck_assert_int_eq(kvm_polykv_method_compress(in, o_mix, &mix), 0);
    for (int l = 0; l < 5; l++) ck_assert(heads_equal(all, ref_z, l));
    ck_assert(heads_equal(mix, ref_z, 0) && heads_equal(mix, ref_z, 3) && heads_equal(mix, ref_s, 2));
    ck_assert(!heads_equal(ref_s, ref_z, 2)); /* the two methods differ, so the test tells them apart */
    ck_assert_int_eq(kvm_kvcache_head(mix, 1, 0)->n, 20);
    kvm_polykv_score_sculpt_opts(&q);
    assert_memo_neutral(doc, st);
    kvm_polykv_method_opts_free(o_all);
    kvm_polykv_method_opts_free(o_mix);
    kvm_strategy_free(&s_all);
    kvm_strategy_free(&st);
    kvm_kvcache_free(&ref_s);
    kvm_kvcache_free(&ref_z);
    kvm_kvcache_free(&all);
    kvm_kvcache_free(&mix);
    kvm_eval_doc_free(&doc);

    /* signals: exact at a budget covering the context, measured below it */
    kvm_eval_doc *d;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 64, 32, 8, &d), 0);
    kvm_polykv_signals *s;
    ck_assert_int_eq(kvm_polykv_signals_new(5, &s), 0);
    ck_assert_int_eq(kvm_polykv_calibrate_kvzip(&d, 1, 32, &q, s), 0);
    ck_assert_int_eq(s->has_kvzip, 1);
    ck_assert_int_eq(s->has_sculpt, 0);
    for (int l = 0; l < 5; l++) ck_assert(s->kvzip_cosine[l] == 1.0 && s->kvzip_kl[l] == 0.0);
    ck_assert_int_eq(kvm_polykv_calibrate_kvzip(&d, 1, 8, &q, s), 0);
    for (int l = 0; l < 5; l++) ck_assert(s->kvzip_cosine[l] < 1.0 && s->kvzip_kl[l] > 0.0);
    ck_assert_int_eq(kvm_polykv_calibrate_kvzip(&d, 1, 0, &q, s), KVM_EINVAL);
    ck_assert_int_eq(s->has_kvzip, 0);
    kvm_polykv_signals_free(&s);
    kvm_eval_doc_free(&d);
}
END_TEST

/* A head split reaches kvzip and sculpt layers: each of their KV heads keeps the entries the
 * split gives it, and is the head that a uniform kvzip / sculpt budget of that size makes (per
 * head: the split changes which entries, not how they are chosen); a global split moves budget
 * between distilled layers and sums exactly; the memo serves split heads unchanged; KVSculpt's
 * pilot allocation keeps one budget per layer and refuses unequal heads by name. */
START_TEST(test_head_split_distilled)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 96, 80, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    const int H = model->cfg.n_kv_heads;
    kvm_pattern pat[5] = {KVM_PATTERN_KVZIP, KVM_PATTERN_H2O, KVM_PATTERN_SCULPT, KVM_PATTERN_KVZIP, KVM_PATTERN_SNAPKV};
    kvm_strategy *st = strategy_of(pat, 20);
    kvm_budget bud = {.tokens = 20};
    kvm_sculpt_opts q = quick(), qz = quick();
    qz.mode = KVM_SCULPT_KVZIP;
    void *o;
    ck_assert_int_eq(kvm_polykv_method_opts_from(st, &bud, &o), 0);
    kvm_polykv_method_set_sculpt(o, &q);
    for (int mode = 1; mode <= 2; mode++) {
        st->head_split = mode;
        kvm_evict_plan *plan;
        ck_assert_int_eq(kvm_strategy_plan(st, 0, 20, H, &plan), 0);
        ck_assert_int_eq(kvm_polykv_head_split(&model->cfg, in->cap, mode, plan), 0);
        kvm_kvcache *split;
        ck_assert_int_eq(kvm_polykv_method_compress(in, o, &split), 0);
        int differ = 0;
        int64_t sum = 0, want = 0;
        for (int l = 0; l < 5; l++) {
            if (!kvm_pattern_is_distilled(pat[l])) continue;
            for (int g = 0; g < H; g++) {
                int64_t b = plan->budget[l * H + g];
                const kvm_kv_head *h = kvm_kvcache_head(split, l, g);
                ck_assert_int_eq(h->n, b);
                differ |= b != plan->budget[l * H];
                sum += h->n;
                want += b;
                kvm_kvcache *ref; /* the same head at a uniform budget b */
                int64_t ub[5] = {b, b, b, b, b};
                ck_assert_int_eq(kvm_kvcache_new(5, H, model->cfg.head_dim, 1, &ref), 0);
                ck_assert_int_eq(kvm_sculpt_compress_layers(in, pat[l] == KVM_PATTERN_KVZIP ? &qz : &q, ub, ref, NULL), 0);
                const kvm_kv_head *r = kvm_kvcache_head(ref, l, g);
                size_t nd = (size_t)(r->n * model->cfg.head_dim) * sizeof(float);
                ck_assert_msg(r->n == h->n && !memcmp(r->k, h->k, nd) && !memcmp(r->v, h->v, nd) &&
                                  !memcmp(r->pos, h->pos, (size_t)r->n * 4),
                              "mode %d layer %d head %d (budget %lld)", mode, l, g, (long long)b);
                kvm_kvcache_free(&ref);
            }
        }
        ck_assert(differ); /* the split gave the heads of a distilled layer different budgets */
        ck_assert_int_eq(sum, want);
        kvm_kvcache_free(&split);
        kvm_evict_plan_free(&plan);
    }
    kvm_polykv_score_sculpt_opts(&q); /* memo-neutral with split heads */
    assert_memo_neutral(doc, st);
    /* the pilot allocation: the strategy still compresses (one budget per layer), while
     * unequal heads are refused by kvm_sculpt_compress_heads */
    kvm_sculpt_opts qa = q;
    qa.alloc = KVM_SCULPT_ALLOC_HEAD;
    kvm_polykv_method_set_sculpt(o, &qa);
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_polykv_method_compress(in, o, &c), 0);
    kvm_kvcache_free(&c);
    int64_t hb[20];
    for (int i = 0; i < 20; i++) hb[i] = i == 9 ? 12 : 20;
    ck_assert_int_eq(kvm_kvcache_new(5, H, model->cfg.head_dim, 1, &c), 0);
    ck_assert_int_eq(kvm_sculpt_compress_heads(in, &qa, hb, c, NULL), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "layer 2's KV heads have budgets 20 and 12"));
    kvm_kvcache_free(&c);
    kvm_polykv_method_opts_free(o);
    kvm_strategy_free(&st);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* opts_new of `spec` for a 5-layer model at 20 tokens per head (the test's method options). */
typedef struct opened {
    const char *spec;
    void *o;
    int rc;
} opened;

static void open_spec(void *arg)
{
    opened *p = arg;
    kvm_model_config c = {.n_layers = 5};
    kvm_budget b = {.tokens = 20};
    p->rc = kvm_method_find("polykv")->opts_new(p->spec, &b, &c, &p->o);
}

/* The cache `polykv:spec` makes of in (the method through its options string), and the stderr
 * it printed into *err (malloc'ed). */
static kvm_kvcache *compress_spec(const kvm_compress_input *in, const char *spec, char **err)
{
    opened p = {.spec = spec};
    *err = kvm_test_stderr_of(open_spec, &p);
    ck_assert_msg(p.rc == 0, "%s: %s", spec, kvm_errmsg());
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_polykv_method_compress(in, p.o, &c), 0);
    kvm_polykv_method_opts_free(p.o);
    return c;
}

/* The cache strategy s makes with options o for its distilled layers. */
static kvm_kvcache *compress_with(const kvm_compress_input *in, const kvm_strategy *s, const kvm_sculpt_opts *o)
{
    kvm_budget b = {.tokens = 20};
    void *opts;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_polykv_method_opts_from(s, &b, &opts), 0);
    kvm_polykv_method_set_sculpt(opts, o);
    ck_assert_int_eq(kvm_polykv_method_compress(in, opts, &c), 0);
    kvm_polykv_method_opts_free(opts);
    return c;
}

static int caches_equal(const kvm_kvcache *a, const kvm_kvcache *b)
{
    for (int l = 0; l < 5; l++)
        if (!heads_equal(a, b, l)) return 0;
    return 1;
}

/* A strategy file records the options of its kvzip and sculpt layers (KVST v2) and
 * `polykv:FILE` uses them, not the defaults; options after the file override them field by
 * field, said on stderr once; a version-1 file uses the defaults and says so. */
START_TEST(test_file_records_options)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 96, 80, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_pattern pat[5] = {KVM_PATTERN_KVZIP, KVM_PATTERN_H2O, KVM_PATTERN_SCULPT, KVM_PATTERN_KVZIP, KVM_PATTERN_SNAPKV};
    kvm_strategy *st = strategy_of(pat, 20);
    kvm_sculpt_opts rec = quick(), def = kvm_sculpt_opts_default();
    rec.n_synth = 48;
    rec.seed = 5;
    st->sculpt = rec;
    st->sculpt_known = 1;
    char *dir = kvm_test_tmpdir(), v2[512], v1[512], spec[1200], *err;
    snprintf(v2, sizeof v2, "%s/v2.bin", dir);
    snprintf(v1, sizeof v1, "%s/v1.bin", dir);
    ck_assert_int_eq(kvm_strategy_write(st, v2), 0);
    kvm_kvcache *ref = compress_with(in, st, &rec), *dflt = compress_with(in, st, &def), *c;
    ck_assert(!caches_equal(ref, dflt)); /* the options matter, so the test tells them apart */
    c = compress_spec(in, v2, &err);
    ck_assert(caches_equal(c, ref)); /* the recorded options, not the defaults */
    ck_assert_msg(!strstr(err, "polykv"), "%s", err);
    kvm_kvcache_free(&c);
    free(err);
    kvm_sculpt_opts over = rec;
    over.n_synth = 32;
    kvm_kvcache *ref32 = compress_with(in, st, &over);
    snprintf(spec, sizeof spec, "%s:queries=32:threads=2", v2);
    c = compress_spec(in, spec, &err);
    ck_assert(caches_equal(c, ref32)); /* one field overridden, the others recorded */
    ck_assert_msg(strstr(err, "the options after the file override the strategy's for its 3 sculpt/kvzip layers: "
                              "queries=32 (recorded: 48)\n"), "%s", err);
    ck_assert_msg(!strstr(err, "threads"), "%s", err); /* not a recorded setting */
    kvm_kvcache_free(&c);
    free(err);
    c = compress_spec(in, spec, &err); /* once */
    ck_assert_msg(!strstr(err, "override"), "%s", err);
    kvm_kvcache_free(&c);
    free(err);
    st->sculpt_known = 0;
    ck_assert_int_eq(kvm_strategy_write(st, v1), 0);
    c = compress_spec(in, v1, &err);
    ck_assert(caches_equal(c, dflt));
    ck_assert_msg(strstr(err, "is a version-1 strategy: it does not record the options its 3 sculpt/kvzip layers were "
                              "calibrated with, so they use the KVSculpt defaults ("), "%s", err);
    kvm_kvcache_free(&c);
    free(err);
    kvm_kvcache_free(&ref);
    kvm_kvcache_free(&ref32);
    kvm_kvcache_free(&dflt);
    kvm_strategy_free(&st);
    kvm_test_rmtree(dir);
    free(dir);
    kvm_eval_doc_free(&doc);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("polykv_sculpt");
    TCase *tc = tcase_create("pure");
    tcase_add_test(tc, test_not_an_eviction_pattern);
    tcase_add_test(tc, test_strategy_with_sculpt);
    suite_add_tcase(s, tc);
    TCase *tm = tcase_create("model");
    tcase_add_checked_fixture(tm, load_model, free_model);
    tcase_set_timeout(tm, 120);
    tcase_add_test(tm, test_method_distils_sculpt_layers);
    tcase_add_test(tm, test_calibrate_sculpt);
    tcase_add_test(tm, test_arg_and_cli);
    tcase_add_test(tm, test_kvzip_pattern);
    tcase_add_test(tm, test_head_split_distilled);
    tcase_add_test(tm, test_file_records_options);
    suite_add_tcase(s, tm);
    return s;
}

int main(void) { return kvm_test_run_suite(suite()); }
