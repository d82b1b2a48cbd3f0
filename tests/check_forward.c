/* check_forward.c: the CPU forward against llama2.c's run.c golden dumps (logits, K/V
 * caches), batched prefill vs token-by-token decode vs chunked prefill, ragged caches,
 * hooks, one layer's step replayed alone (kvm_forward_attend), and several caches' sequences in
 * one call (kvm_forward_multi). */
#include "model/kvm_forward.h"
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvm_model *model;
static int32_t ids[256];
static float *gold_logits, *gold_k, *gold_v;
static int have_golden; /* 1: gold_* are run.c's dumps from ../shared/golden */

static void load_golden(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
    size_t n;
    if (!kvm_test_shared_find("golden/seq256.logits.f32")) {
        /* no ../shared: the golden tests skip; the others compare with our own full-cache
         * logits (which the golden tests check against run.c's where ../shared is) */
        kvm_forward *f;
        kvm_kvcache *c;
        gold_logits = malloc(256 * 512 * sizeof *gold_logits);
        ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
        ck_assert_int_eq(kvm_forward_cache_new(model, 256, &c), 0);
        ck_assert_int_eq(kvm_forward_prefill(f, c, ids, 256, gold_logits, KVM_LOGITS_ALL), 0);
        kvm_kvcache_free(&c);
        kvm_forward_free(&f);
        return;
    }
    have_golden = 1;
    gold_logits = (float *)kvm_test_read_file(kvm_test_shared_find("golden/seq256.logits.f32"), &n);
    ck_assert_uint_eq(n, 256 * 512 * 4);
    gold_k = (float *)kvm_test_read_file(kvm_test_shared_find("golden/seq256.kcache.f32"), &n);
    ck_assert_uint_eq(n, 5 * 256 * 32 * 4);
    gold_v = (float *)kvm_test_read_file(kvm_test_shared_find("golden/seq256.vcache.f32"), &n);
    ck_assert_uint_eq(n, 5 * 256 * 32 * 4);
}

/* 1 (after one SKIP line) when the golden dumps of ../shared are absent */
static int no_golden(void)
{
    if (have_golden) return 0;
    kvm_test_shared_path("golden/seq256.logits.f32");
    return 1;
}

static void free_golden(void)
{
    kvm_model_close(&model);
    free(gold_logits);
    free(gold_k);
    free(gold_v);
}

static float max_abs_diff(const float *a, const float *b, int64_t n)
{
    float m = 0;
    for (int64_t i = 0; i < n; i++) m = fmaxf(m, fabsf(a[i] - b[i]));
    return m;
}

/* max |Δ| between the cache and golden [layer][t][kv_dim] for keys (which=0) or values. */
static float cache_diff(const kvm_kvcache *c, const float *gold, int which)
{
    float m = 0;
    for (int l = 0; l < 5; l++)
        for (int g = 0; g < 4; g++) {
            const kvm_kv_head *h = kvm_kvcache_head(c, l, g);
            ck_assert_int_eq(h->n, 256);
            for (int t = 0; t < 256; t++) {
                ck_assert_int_eq(h->pos[t], t);
                const float *ours = (which == 0 ? h->k : h->v) + t * 8;
                m = fmaxf(m, max_abs_diff(ours, gold + ((size_t)l * 256 + t) * 32 + g * 8, 8));
            }
        }
    return m;
}

static void check_prefill(int64_t max_batch)
{
    if (no_golden()) return;
    kvm_forward *f;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_new(model, NULL, max_batch, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 256, &c), 0);
    float *logits = malloc(256 * 512 * sizeof *logits);
    ck_assert_int_eq(kvm_forward_prefill(f, c, ids, 256, logits, KVM_LOGITS_ALL), 0);
    float dl = max_abs_diff(logits, gold_logits, 256 * 512), dk = cache_diff(c, gold_k, 0), dv = cache_diff(c, gold_v, 1);
    printf("prefill (batch %lld): max|dlogit| %.3g max|dk| %.3g max|dv| %.3g\n", (long long)max_batch, dl, dk, dv);
    ck_assert_float_le(dl, 2e-4f);
    ck_assert_float_le(dk, 2e-4f);
    ck_assert_float_le(dv, 1e-4f);
    ck_assert_int_eq(c->next_pos, 256);
    free(logits);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
}

START_TEST(test_prefill_golden) { check_prefill(0); }
END_TEST

START_TEST(test_prefill_chunked_golden) { check_prefill(100); }
END_TEST

START_TEST(test_decode_golden)
{
    if (no_golden()) return;
    kvm_forward *f;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 1, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 8, &c), 0); /* grows on demand */
    float logits[512], worst = 0;
    for (int t = 0; t < 256; t++) {
        ck_assert_int_eq(kvm_forward_decode(f, c, ids[t], logits), 0);
        worst = fmaxf(worst, max_abs_diff(logits, gold_logits + (size_t)t * 512, 512));
    }
    printf("decode: max|dlogit| %.3g\n", worst);
    ck_assert_float_le(worst, 2e-4f);
    ck_assert_float_le(cache_diff(c, gold_k, 0), 2e-4f);
    ck_assert_float_le(cache_diff(c, gold_v, 1), 1e-4f);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
}
END_TEST

START_TEST(test_bad_inputs)
{
    kvm_forward *f;
    kvm_kvcache *c, *wrong;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 4, &c), 0);
    int32_t bad[2] = {1, 512};
    ck_assert_int_eq(kvm_forward_prefill(f, c, bad, 2, NULL, KVM_LOGITS_NONE), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "token 1 has id 512"), "message: %s", kvm_errmsg());
    ck_assert_int_eq(kvm_forward_prefill(f, c, bad, 0, NULL, KVM_LOGITS_NONE), KVM_EINVAL);
    ck_assert_int_eq(kvm_kvcache_new(5, 2, 8, 4, &wrong), 0);
    ck_assert_int_eq(kvm_forward_decode(f, wrong, 1, NULL), KVM_EINVAL);
    ck_assert_int_eq(c->next_pos, 0);
    kvm_kvcache_free(&wrong);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
}
END_TEST

/* Each head keeps a different subset: a ragged cache must decode exactly like the full
 * cache with the dropped entries masked out (bias -1e30). */
START_TEST(test_ragged_equals_masked)
{
    kvm_forward *f;
    kvm_kvcache *full, *ragged;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 64, &full), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, full, ids, 64, NULL, KVM_LOGITS_NONE), 0);
    ck_assert_int_eq(kvm_kvcache_clone(full, &ragged), 0);
    int64_t keep[64];
    for (int l = 0; l < 5; l++)
        for (int g = 0; g < 4; g++) {
            kvm_kv_head *hf = kvm_kvcache_head(full, l, g), *hr = kvm_kvcache_head(ragged, l, g);
            int64_t nk = 0;
            int stride = 2 + (l * 4 + g) % 5; /* a different subset per head */
            for (int t = 0; t < 64; t++) {
                if (t % stride == 0 || t < 2) keep[nk++] = t;
                else hf->bias[t] = -1e30f;
            }
            ck_assert_int_eq(kvm_kvcache_keep(hr, 8, keep, nk), 0);
            ck_assert_int_eq(hr->n, nk);
        }
    float lf[512], lr[512];
    for (int step = 0; step < 4; step++) {
        ck_assert_int_eq(kvm_forward_decode(f, full, ids[64 + step], lf), 0);
        ck_assert_int_eq(kvm_forward_decode(f, ragged, ids[64 + step], lr), 0);
        float d = max_abs_diff(lf, lr, 512);
        ck_assert_msg(d < 1e-4f, "step %d: ragged vs masked differ by %g", step, d);
        /* and the masking matters: logits differ from the full-cache golden row */
        ck_assert_float_gt(max_abs_diff(lr, gold_logits + (size_t)(64 + step) * 512, 512), 1e-2f);
    }
    ck_assert_int_eq(ragged->next_pos, 68);
    ck_assert_int_eq(kvm_kvcache_head(ragged, 0, 0)->pos[kvm_kvcache_head(ragged, 0, 0)->n - 1], 67);
    kvm_kvcache_free(&full);
    kvm_kvcache_free(&ragged);
    kvm_forward_free(&f);
}
END_TEST

/* A pre_attn hook that points the kernel at another cache, and a post_attn hook that
 * checks the kernel's observation rows sum to one over visible entries (and the mass to
 * n_q) and counts calls. */
typedef struct hook_state {
    int pre_calls, post_calls, update_calls;
    kvm_kvcache *other;
    double max_rowsum_err;
} hook_state;

static int on_update(void *u, kvm_attn_site *s)
{
    ((hook_state *)u)->update_calls++;
    return s->k_new && s->v_new ? 0 : KVM_EINVAL;
}

static int on_pre(void *u, kvm_attn_site *s)
{
    hook_state *st = u;
    st->pre_calls++;
    if (st->other) s->cache = st->other;
    return 0;
}

static int on_post(void *u, const kvm_attn_site *s)
{
    hook_state *st = u;
    st->post_calls++;
    const kvm_attn_layer *a = s->attn;
    if (!a || a->n_obs != s->n_q || !a->obs || !a->mass) return KVM_EINVAL;
    for (int h = 0; h < a->n_heads; h++) {
        const int64_t n_e = a->n_e[h / (a->n_heads / a->n_kv_heads)];
        double mass = 0;
        for (int64_t e = 0; e < n_e; e++) mass += a->mass[(int64_t)h * a->ld_e + e];
        /* every query's row sums to one, so the mass over all of them sums to n_q */
        st->max_rowsum_err = fmax(st->max_rowsum_err, fabs(mass - (double)s->n_q) / (double)s->n_q);
        for (int64_t i = 0; i < s->n_q; i++) {
            double sum = 0;
            for (int64_t e = 0; e < n_e; e++) sum += a->obs[((int64_t)h * a->n_obs + i) * a->ld_e + e];
            st->max_rowsum_err = fmax(st->max_rowsum_err, fabs(sum - 1.0));
        }
    }
    return 0;
}

static int on_fail(void *u, kvm_attn_site *s) { return s->layer == 2 ? kvm_err(KVM_ESTATE, "hook says no") : 0; }

START_TEST(test_hooks)
{
    kvm_forward *f;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 64, &c), 0);
    hook_state st = {0};
    kvm_hooks h = {.user = &st, .cache_update = on_update, .pre_attn = on_pre, .post_attn = on_post,
                   .stats = KVM_ATTN_STAT_OBS | KVM_ATTN_STAT_MASS, .n_obs = 64};
    ck_assert_int_eq(kvm_forward_add_hooks(f, &h), 0);
    float *logits = malloc(32 * 512 * sizeof *logits);
    ck_assert_int_eq(kvm_forward_prefill(f, c, ids, 32, logits, KVM_LOGITS_ALL), 0);
    ck_assert_int_eq(st.update_calls, 5);
    ck_assert_int_eq(st.pre_calls, 5);
    ck_assert_int_eq(st.post_calls, 5); /* once per layer */
    ck_assert_double_lt(st.max_rowsum_err, 1e-5);
    /* hooks observe without changing results */
    ck_assert_float_le(max_abs_diff(logits, gold_logits, 32 * 512), 2e-4f);

    /* substitute an empty-but-for-BOS cache: output must change, and the real cache still grows */
    kvm_kvcache *other;
    kvm_forward *f0;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f0), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 4, &other), 0);
    ck_assert_int_eq(kvm_forward_prefill(f0, other, ids, 1, NULL, KVM_LOGITS_NONE), 0);
    st.other = other;
    float l1[512];
    ck_assert_int_eq(kvm_forward_decode(f, c, ids[32], l1), 0);
    ck_assert_float_gt(max_abs_diff(l1, gold_logits + 32 * 512, 512), 1e-2f);
    ck_assert_int_eq(kvm_kvcache_head(c, 0, 0)->n, 33);

    kvm_hooks bad = {.user = NULL, .pre_attn = on_fail};
    kvm_forward_clear_hooks(f);
    ck_assert_int_eq(kvm_forward_add_hooks(f, &bad), 0);
    ck_assert_int_eq(kvm_forward_decode(f, c, ids[33], l1), KVM_ESTATE);
    free(logits);
    kvm_kvcache_free(&other);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f0);
    kvm_forward_free(&f);
}
END_TEST

static int post_noop(void *u, const kvm_attn_site *s) { return u && s ? 0 : KVM_EINVAL; }

/* Hook sets must agree on the MASS window; OBS needs n_obs ≥ 1; a set whose post_attn is
 * NULL asks for nothing, whatever its flags. */
START_TEST(test_hook_stats_requests)
{
    kvm_forward *f;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    int u = 0;
    kvm_hooks a = {.user = &u, .post_attn = post_noop, .stats = KVM_ATTN_STAT_MASS, .mass_p0 = 0, .mass_p1 = 16};
    kvm_hooks same = a, other = a, all = a, obs0 = {.user = &u, .post_attn = post_noop, .stats = KVM_ATTN_STAT_OBS};
    other.mass_p1 = 17;
    all.mass_p1 = 0; /* every query */
    ck_assert_int_eq(kvm_forward_add_hooks(f, &a), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, &same), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, &other), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "[0, 17)"));
    ck_assert_int_eq(kvm_forward_add_hooks(f, &all), KVM_EINVAL);
    ck_assert_int_eq(kvm_forward_add_hooks(f, &obs0), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "n_obs"));
    kvm_forward_clear_hooks(f);
    ck_assert_int_eq(kvm_forward_add_hooks(f, &all), 0); /* cleared: a new window is fine */
    other.post_attn = NULL;
    ck_assert_int_eq(kvm_forward_add_hooks(f, &other), 0);
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_cache_new(model, 16, &c), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c, ids, 8, NULL, KVM_LOGITS_NONE), 0);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
}
END_TEST

/* Records layer 2's queries, keys, values and attention outputs of a one-token call. */
typedef struct rec {
    float q[64], k[32], v[32], out[64];
} rec;

static int rec_post(void *user, const kvm_attn_site *s)
{
    rec *r = user;
    if (s->layer != 2) return 0;
    memcpy(r->q, s->q, sizeof r->q);
    memcpy(r->k, s->k_new, sizeof r->k);
    memcpy(r->v, s->v_new, sizeof r->v);
    memcpy(r->out, s->attn->out, sizeof r->out);
    return 0;
}

/* kvm_forward_attend replays one layer of a decode step exactly: the same kernel on the same
 * inputs gives the same outputs, bit for bit, and only that layer's cache grows. */
START_TEST(test_attend_replay)
{
    kvm_forward *f;
    kvm_kvcache *c, *c2;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    ck_assert_int_eq(model->cfg.n_heads * model->cfg.head_dim, 64);
    ck_assert_int_eq(kvm_forward_cache_new(model, 32, &c), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c, ids, 16, NULL, KVM_LOGITS_NONE), 0);
    ck_assert_int_eq(kvm_kvcache_clone(c, &c2), 0);
    rec r;
    kvm_hooks h = {.user = &r, .post_attn = rec_post, .stats = KVM_ATTN_STAT_MASS};
    ck_assert_int_eq(kvm_forward_add_hooks(f, &h), 0);
    float logits[512], out[64];
    ck_assert_int_eq(kvm_forward_decode(f, c, ids[16], logits), 0);
    rec seen = r;
    const int32_t pos = 16;
    ck_assert_int_eq(kvm_forward_attend(f, c2, 2, KVM_PHASE_DECODE, seen.q, seen.k, seen.v, &pos, 1, out), 0);
    ck_assert_mem_eq(out, seen.out, sizeof out);
    ck_assert_mem_eq(r.out, seen.out, sizeof out); /* the hooks ran on the replayed step too */
    ck_assert_int_eq(kvm_kvcache_head(c2, 2, 0)->n, 17);
    ck_assert_int_eq(kvm_kvcache_head(c2, 1, 0)->n, 16);
    ck_assert_int_eq(c2->next_pos, 16);
    ck_assert_int_eq(kvm_forward_attend(f, c2, 5, KVM_PHASE_DECODE, seen.q, seen.k, seen.v, &pos, 1, out), KVM_EINVAL);
    ck_assert_int_eq(kvm_forward_attend(f, c2, 2, KVM_PHASE_DECODE, seen.q, seen.k, seen.v, &pos, 0, out), KVM_EINVAL);
    kvm_hooks pre = {.want_q_pre = 1};
    ck_assert_int_eq(kvm_forward_add_hooks(f, &pre), 0);
    ck_assert_int_eq(kvm_forward_attend(f, c2, 2, KVM_PHASE_DECODE, seen.q, seen.k, seen.v, &pos, 1, out), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "pre-RoPE"));
    kvm_forward_clear_hooks(f);
    kvm_kvcache_free(&c);
    kvm_kvcache_free(&c2);
    kvm_forward_free(&f);
}
END_TEST

/* The caches of test_multi: A a 100-token prefix, B a 60-token prefix with a different
 * subset kept per head (ragged), C empty. */
static void multi_caches(kvm_forward *f, kvm_kvcache *c[3])
{
    ck_assert_int_eq(kvm_forward_cache_new(model, 128, &c[0]), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c[0], ids, 100, NULL, KVM_LOGITS_NONE), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 64, &c[1]), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c[1], ids, 60, NULL, KVM_LOGITS_NONE), 0);
    int64_t keep[60];
    for (int l = 0; l < 5; l++)
        for (int g = 0; g < 4; g++) {
            int64_t nk = 0;
            for (int t = 0; t < 60; t++)
                if (t < 2 || t % (2 + (l + g) % 3) == 0) keep[nk++] = t;
            ck_assert_int_eq(kvm_kvcache_keep(kvm_kvcache_head(c[1], l, g), 8, keep, nk), 0);
        }
    ck_assert_int_eq(kvm_forward_cache_new(model, 8, &c[2]), 0);
}

static float max_abs(const float *a, int64_t n)
{
    float m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(a[i]));
    return m;
}

/* 1 when every head of a and b holds the same entries, positions and next_pos (values within
 * float32 rounding of sums taken in another order: 1e-5 of the head's largest). */
static int same_entries(const kvm_kvcache *a, const kvm_kvcache *b)
{
    if (a->next_pos != b->next_pos) return 0;
    for (int l = 0; l < 5; l++)
        for (int g = 0; g < 4; g++) {
            const kvm_kv_head *x = kvm_kvcache_head(a, l, g), *y = kvm_kvcache_head(b, l, g);
            if (x->n != y->n || memcmp(x->pos, y->pos, (size_t)x->n * sizeof *x->pos)) return 0;
            float dk = max_abs_diff(x->k, y->k, x->n * 8), dv = max_abs_diff(x->v, y->v, x->n * 8);
            if (dk > 1e-5f * max_abs(x->k, x->n * 8) || dv > 1e-5f * max_abs(x->v, x->n * 8)) {
                printf("layer %d head %d: max|dk| %g max|dv| %g\n", l, g, dk, dv);
                return 0;
            }
        }
    return 1;
}

static int on_nothing(void *u, kvm_attn_site *s)
{
    (void)u;
    (void)s;
    return 0;
}

/* kvm_forward_multi: three sequences over three caches (a long one, a ragged one, an empty one)
 * give each sequence's logits rows and cache what it gives run alone, in one chunk or in chunks
 * that cut sequences; every refused call leaves every cache as it was. */
START_TEST(test_multi)
{
    kvm_forward *f, *small;
    kvm_kvcache *c[3], *alone[3];
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    multi_caches(f, c);
    const int32_t *tok[3] = {ids + 100, ids + 60, ids};
    const int64_t n[3] = {5, 1, 8}, nl[3] = {5, 1, 2};
    float *got = malloc(8 * 512 * sizeof *got), *want = malloc(8 * 512 * sizeof *want);
    int64_t row = 0;
    for (int s = 0; s < 3; s++) { /* each sequence alone, on a copy */
        float *lg = malloc((size_t)n[s] * 512 * sizeof *lg);
        ck_assert_int_eq(kvm_kvcache_clone(c[s], &alone[s]), 0);
        ck_assert_int_eq(kvm_forward_prefill(f, alone[s], tok[s], n[s], lg, KVM_LOGITS_ALL), 0);
        memcpy(want + row * 512, lg + (n[s] - nl[s]) * 512, (size_t)nl[s] * 512 * sizeof *lg);
        row += nl[s];
        free(lg);
    }
    /* refused calls first: nothing may change */
    kvm_kvcache *shared[2] = {c[0], c[0]};
    ck_assert_int_eq(kvm_forward_multi(f, shared, tok, n, 2, nl, got), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "sequences 0 and 1 share one cache"), "%s", kvm_errmsg());
    const int64_t too_many[3] = {5, 2, 2};
    ck_assert_int_eq(kvm_forward_multi(f, c, tok, n, 3, too_many, got), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "sequence 1 asks for 2 logits rows of 1 tokens"), "%s", kvm_errmsg());
    int32_t bad[8];
    memcpy(bad, ids, sizeof bad);
    bad[7] = 512;
    const int32_t *bad_tok[3] = {tok[0], tok[1], bad};
    ck_assert_int_eq(kvm_forward_multi(f, c, bad_tok, n, 3, nl, got), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "sequence 2: forward: token 7 has id 512"), "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_forward_multi(f, c, tok, n, 0, nl, got), KVM_EINVAL);
    kvm_hooks h = {.pre_attn = on_nothing};
    ck_assert_int_eq(kvm_forward_add_hooks(f, &h), 0);
    ck_assert_int_eq(kvm_forward_multi(f, c, tok, n, 3, nl, got), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "hook"), "%s", kvm_errmsg());
    kvm_forward_clear_hooks(f);
    ck_assert_int_eq(c[0]->next_pos, 100);
    ck_assert_int_eq(c[1]->next_pos, 60);
    ck_assert_int_eq(c[2]->next_pos, 0);
    ck_assert_int_eq(kvm_kvcache_head(c[0], 4, 3)->n, 100);
    ck_assert_int_eq(kvm_kvcache_head(c[2], 0, 0)->n, 0);
    /* the call */
    ck_assert_int_eq(kvm_forward_multi(f, c, tok, n, 3, nl, got), 0);
    float scale = 0;
    for (int i = 0; i < 8 * 512; i++)
        scale = fmaxf(scale, fabsf(want[i]));
    float d = max_abs_diff(got, want, 8 * 512);
    ck_assert_msg(d <= 1e-5f * scale, "multi vs alone: max|dlogit| %g of %g", d, scale);
    for (int s = 0; s < 3; s++)
        ck_assert_msg(same_entries(c[s], alone[s]), "sequence %d's cache", s);
    /* the same in chunks of 3 rows, which cut sequences 0 and 2 (and run 1 with both), asking
     * for no logits of sequence 1 */
    kvm_kvcache *again[3];
    for (int s = 0; s < 3; s++) {
        ck_assert_int_eq(kvm_kvcache_clone(alone[s], &again[s]), 0);
        kvm_kvcache_free(&alone[s]);
    }
    multi_caches(f, alone);
    ck_assert_int_eq(kvm_forward_new(model, NULL, 3, &small), 0);
    const int64_t nl_mid0[3] = {5, 0, 2}; /* and no row of the middle sequence */
    ck_assert_int_eq(kvm_forward_multi(small, alone, tok, n, 3, nl_mid0, want), 0);
    kvm_forward_free(&small);
    d = fmaxf(max_abs_diff(got, want, 5 * 512), max_abs_diff(got + 6 * 512, want + 5 * 512, 2 * 512));
    ck_assert_msg(d <= 1e-5f * scale, "chunks of 3 vs one call: max|dlogit| %g of %g", d, scale);
    for (int s = 0; s < 3; s++) {
        ck_assert_msg(same_entries(alone[s], again[s]), "sequence %d's cache in chunks", s);
        kvm_kvcache_free(&again[s]);
    }
    /* and no logits at all */
    ck_assert_int_eq(kvm_forward_multi(f, c, tok, n, 1, NULL, NULL), 0);
    ck_assert_int_eq(c[0]->next_pos, 110);
    for (int s = 0; s < 3; s++) {
        kvm_kvcache_free(&c[s]);
        kvm_kvcache_free(&alone[s]);
    }
    free(got);
    free(want);
    kvm_forward_free(&f);
}
END_TEST

static Suite *forward_suite(void)
{
    Suite *s = suite_create("forward");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"prefill_golden", test_prefill_golden},
                 {"prefill_chunked_golden", test_prefill_chunked_golden},
                 {"decode_golden", test_decode_golden},
                 {"bad_inputs", test_bad_inputs},
                 {"ragged_equals_masked", test_ragged_equals_masked},
                 {"hooks", test_hooks},
                 {"hook_stats_requests", test_hook_stats_requests},
                 {"attend_replay", test_attend_replay},
                 {"multi", test_multi}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, load_golden, free_golden);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(forward_suite()); }
