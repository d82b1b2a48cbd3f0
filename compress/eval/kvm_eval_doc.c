/* kvm_eval_doc.c: one document's full-KV reference (context cache, capture, reference
 * logits) and the teacher-forced continuation over a compressed cache, scored against it. */
#include "model/kvm_model_window.h"
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "model/kvm_sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kvm_eval_doc {
    const kvm_model *m;
    kvm_forward *f;
    int32_t *tokens;       /* [N+T] */
    int64_t n_ctx, n_cont; /* N, T */
    kvm_kvcache *full;     /* context cache */
    kvm_capture *cap;      /* context capture */
    float *ref;            /* [T][vocab] reference logits, continuation in one batched call */
    float *ref_dec;        /* [T][vocab] the same token by token (for runs with a decode policy), or
                              NULL until first needed */
    float *work;           /* [T][vocab] logits of the compressed run */
    double *kl_steps;      /* [T] per-step KL of the last compressed run (kvm_eval_kl_range) */
    int have_kl;           /* kl_steps holds a run */
    double ppl_full;       /* of ref */
    double ppl_dec;        /* of ref_dec */
    kvm_compress_input in;
    kvm_sculpt_qsets qcache; /* model query sets of the context (query_source), built on first use */
    int32_t *repeat_prompt;  /* [in.n_repeat_prompt] (kvm_eval_doc_set_repeat_prompt), or NULL */
};

double kvm_eval_kl(const float *lp, const float *lq, int vocab)
{
    double mp = -INFINITY, mq = -INFINITY, zp = 0, zq = 0, kl = 0;
    for (int i = 0; i < vocab; i++) {
        if (lp[i] > mp) mp = lp[i];
        if (lq[i] > mq) mq = lq[i];
    }
    for (int i = 0; i < vocab; i++) {
        zp += exp((double)lp[i] - mp);
        zq += exp((double)lq[i] - mq);
    }
    const double lzp = mp + log(zp), lzq = mq + log(zq);
    for (int i = 0; i < vocab; i++) {
        double a = (double)lp[i] - lzp, b = (double)lq[i] - lzq;
        kl += exp(a) * (a - b);
    }
    /* rounding can give -1e-17 for equal distributions; NaN (non-finite logits) stays NaN, so a
     * broken run never reads as a perfect cache */
    return kl < 0 ? 0.0 : kl;
}

/* −log softmax(l)[target]. */
static double nll(const float *l, int vocab, int32_t target)
{
    double mx = -INFINITY, z = 0;
    for (int i = 0; i < vocab; i++)
        if (l[i] > mx) mx = l[i];
    for (int i = 0; i < vocab; i++)
        z += exp((double)l[i] - mx);
    return mx + log(z) - (double)l[target];
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kvm_eval_quantile(double *x, int64_t n, double q)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    double p = q * (double)(n - 1);
    int64_t i = (int64_t)floor(p);
    if (i >= n - 1) return x[n - 1];
    return x[i] + (p - (double)i) * (x[i + 1] - x[i]);
}

double kvm_eval_ppl(const float *logits, const int32_t *next, int64_t T, int vocab)
{
    double s = 0;
    for (int64_t i = 0; i < T; i++)
        s += nll(logits + i * vocab, vocab, next[i]);
    return exp(s / (double)T);
}

void kvm_eval_score(const float *ref, const float *got, const int32_t *next, int64_t T, int vocab, double *kl,
                    double *kl_steps, kvm_eval_result *r)
{
    double s = 0, agree = 0, sk = 0;
    for (int64_t i = 0; i < T; i++) {
        const float *p = ref + i * vocab, *q = got + i * vocab;
        kl[i] = kvm_eval_kl(p, q, vocab);
        sk += kl[i];
        agree += kvm_argmax(p, vocab) == kvm_argmax(q, vocab);
        s += nll(q, vocab, next[i]);
    }
    if (kl_steps) memcpy(kl_steps, kl, (size_t)T * sizeof *kl); /* before the quantiles sort kl */
    r->kl_mean = isnan(sk) ? NAN : sk / (double)T;              /* NAN: printed "nan", not the sign bit's "-nan" */
    r->top1 = agree / (double)T;
    r->ppl_compressed = exp(s / (double)T);
    int nan_steps = 0; /* qsort has no order for NaN: the quantiles of such a run are NaN too */
    for (int64_t i = 0; i < T; i++)
        nan_steps += isnan(kl[i]);
    r->kl_median = nan_steps ? NAN : kvm_eval_quantile(kl, T, 0.5);
    r->kl_p99 = nan_steps ? NAN : kvm_eval_quantile(kl, T, 0.99);
}

/* Teacher-forces tokens N..N+T-2 over cache c; logits rows 1..T-1 go to out (row 0, the
 * context prefill's own prediction, is copied from the reference). batched = 1: one prefill
 * call over the T−1 tokens (causal among themselves, every cache entry visible), as fast as a
 * prefill; 0: one decode call per token, which a decode-phase policy needs (it changes the
 * cache between tokens). The two differ only by float rounding, so each run is compared with
 * a reference made the same way. */
static int continue_run(kvm_eval_doc *d, kvm_kvcache *c, float *out, int batched)
{
    const int V = d->m->cfg.vocab_size;
    memcpy(out, d->ref, (size_t)V * sizeof *out);
    if (batched)
        return d->n_cont > 1 ? kvm_forward_prefill(d->f, c, d->tokens + d->n_ctx, d->n_cont - 1, out + V, KVM_LOGITS_ALL)
                             : 0;
    for (int64_t i = 1; i < d->n_cont; i++) {
        int rc = kvm_forward_decode(d->f, c, d->tokens[d->n_ctx + i - 1], out + i * V);
        if (rc) return rc;
    }
    return 0;
}

/* The token-by-token reference, made on first use (no hooks may be registered). */
static int ref_decode(kvm_eval_doc *d)
{
    if (d->ref_dec) return 0;
    const size_t TV = (size_t)d->n_cont * (size_t)d->m->cfg.vocab_size;
    kvm_kvcache *tmp = NULL;
    float *r = malloc(TV * sizeof *r);
    int rc = r ? kvm_kvcache_clone(d->full, &tmp) : kvm_err(KVM_ENOMEM, "eval: out of memory");
    if (!rc) rc = continue_run(d, tmp, r, 0);
    kvm_kvcache_free(&tmp);
    if (rc) {
        free(r);
        return rc;
    }
    d->ref_dec = r;
    d->ppl_dec = kvm_eval_ppl(r, d->tokens + d->n_ctx, d->n_cont, d->m->cfg.vocab_size);
    return 0;
}

struct kvm_eval_prefix {
    const kvm_model *m;
    const kvm_kernels *k;
    int32_t *tokens;   /* [n] */
    int64_t n, done;   /* prefix length; positions prefilled so far */
    kvm_forward *f;
    kvm_kvcache *cache; /* positions [0, done) */
    kvm_capture *cap;   /* positions [0, done), mass from those queries only */
};

/* What every method may read of the context: queries and statistics over all N queries. */
static const kvm_capture_opts doc_capture = {.want_queries = 1, .want_stats = 1};

/* Empties p: a new capture and cache, nothing prefilled. */
static int prefix_reset(kvm_eval_prefix *p)
{
    kvm_capture_free(&p->cap);
    kvm_kvcache_free(&p->cache);
    p->done = 0;
    int rc = kvm_capture_new(&p->m->cfg, p->n, &doc_capture, &p->cap);
    return rc ? rc : kvm_forward_cache_new(p->m, p->n, &p->cache);
}

/* kvm_eval_doc_new; with p, positions [0, s) (s ≥ 1, p->done == s) come from the prefix. */
static int doc_build(const kvm_model *m, const kvm_kernels *k, const int32_t *tokens, int64_t n_tokens, int64_t n_ctx,
                     int64_t n_cont, const kvm_eval_prefix *p, int64_t s, kvm_eval_doc **out)
{
    *out = NULL;
    const kvm_model_config *c = &m->cfg;
    if (n_ctx < 1 || n_cont < 1 || n_tokens < n_ctx + n_cont)
        return kvm_err(KVM_EINVAL, "eval: a document of %lld tokens cannot give context %lld + continuation %lld",
                       (long long)n_tokens, (long long)n_ctx, (long long)n_cont);
    if (n_ctx + n_cont > kvm_model_window(c))
        return kvm_err(KVM_EINVAL, "eval: context %lld + continuation %lld exceeds the model's window of %d tokens",
                       (long long)n_ctx, (long long)n_cont, kvm_model_window(c));
    kvm_eval_doc *d = calloc(1, sizeof *d);
    if (!d) return kvm_err(KVM_ENOMEM, "eval: out of memory");
    d->m = m;
    d->n_ctx = n_ctx;
    d->n_cont = n_cont;
    const size_t TV = (size_t)n_cont * (size_t)c->vocab_size;
    d->tokens = malloc((size_t)(n_ctx + n_cont) * sizeof *d->tokens);
    d->ref = malloc(TV * sizeof *d->ref);
    d->work = malloc(TV * sizeof *d->work);
    d->kl_steps = malloc((size_t)n_cont * sizeof *d->kl_steps);
    kvm_kvcache *tmp = NULL;
    int rc = d->tokens && d->ref && d->work && d->kl_steps ? 0 : kvm_err(KVM_ENOMEM, "eval: out of memory");
    if (!rc) {
        memcpy(d->tokens, tokens, (size_t)(n_ctx + n_cont) * sizeof *d->tokens);
        rc = kvm_forward_new(m, k, n_ctx, &d->f);
    }
    if (!p) s = 0;
    if (!rc) rc = kvm_capture_new(c, n_ctx, &doc_capture, &d->cap);
    if (!rc) rc = s ? kvm_kvcache_clone(p->cache, &d->full) : kvm_forward_cache_new(m, n_ctx + n_cont, &d->full);
    if (!rc && s) rc = kvm_capture_copy_prefix(d->cap, p->cap, s);
    if (!rc) rc = kvm_forward_add_hooks(d->f, kvm_capture_hooks(d->cap));
    if (!rc) rc = kvm_forward_prefill(d->f, d->full, d->tokens + s, n_ctx - s, d->ref, KVM_LOGITS_LAST);
    if (d->f) kvm_forward_clear_hooks(d->f);
    if (!rc) rc = kvm_kvcache_clone(d->full, &tmp);
    if (!rc) rc = continue_run(d, tmp, d->ref, 1);
    kvm_kvcache_free(&tmp);
    if (rc) {
        kvm_eval_doc_free(&d);
        return rc;
    }
    d->ppl_full = kvm_eval_ppl(d->ref, d->tokens + n_ctx, n_cont, c->vocab_size);
    d->in = (kvm_compress_input){.model = m, .full = d->full, .cap = d->cap, .n_tokens = n_ctx, .n_future = n_cont,
                                 .tokens = d->tokens, .qcache = &d->qcache};
    *out = d;
    return 0;
}

int kvm_eval_doc_new(const kvm_model *m, const kvm_kernels *k, const int32_t *tokens, int64_t n_tokens, int64_t n_ctx,
                     int64_t n_cont, kvm_eval_doc **out)
{
    return doc_build(m, k, tokens, n_tokens, n_ctx, n_cont, NULL, 0, out);
}

int kvm_eval_prefix_new(const kvm_model *m, const kvm_kernels *k, const int32_t *tokens, int64_t n,
                        kvm_eval_prefix **out)
{
    *out = NULL;
    if (n < 1 || n > kvm_model_window(&m->cfg))
        return kvm_err(KVM_EINVAL, "eval: a prefix of %lld tokens (the model's window is %d)", (long long)n,
                       kvm_model_window(&m->cfg));
    kvm_eval_prefix *p = calloc(1, sizeof *p);
    if (!p) return kvm_err(KVM_ENOMEM, "eval: out of memory");
    *p = (kvm_eval_prefix){.m = m, .k = k, .n = n, .tokens = malloc((size_t)n * sizeof *p->tokens)};
    int rc = p->tokens ? 0 : kvm_err(KVM_ENOMEM, "eval: out of memory");
    if (!rc) {
        memcpy(p->tokens, tokens, (size_t)n * sizeof *p->tokens);
        rc = kvm_forward_new(m, k, n, &p->f);
    }
    if (!rc) rc = prefix_reset(p);
    if (rc) kvm_eval_prefix_free(&p);
    *out = p;
    return rc;
}

void kvm_eval_prefix_free(kvm_eval_prefix **pp)
{
    if (!pp || !*pp) return;
    kvm_eval_prefix *p = *pp;
    kvm_forward_free(&p->f);
    kvm_capture_free(&p->cap);
    kvm_kvcache_free(&p->cache);
    free(p->tokens);
    free(p);
    *pp = NULL;
}

int kvm_eval_doc_new_after(kvm_eval_prefix *p, const int32_t *tokens, int64_t n_tokens, int64_t n_ctx,
                           int64_t n_cont, int64_t *reused, kvm_eval_doc **out)
{
    int64_t s = 0, lim = n_ctx - 1 < p->n ? n_ctx - 1 : p->n; /* the context's last token is always prefilled */
    if (reused) *reused = 0;
    if (n_ctx >= 1 && n_tokens >= n_ctx)
        while (s < lim && tokens[s] == p->tokens[s])
            s++;
    int rc = 0;
    if (s < p->done && (rc = prefix_reset(p))) { /* its mass already holds queries past s: start it afresh */
        *out = NULL;
        return rc;
    }
    if (s > p->done) {
        rc = kvm_forward_add_hooks(p->f, kvm_capture_hooks(p->cap));
        if (!rc) rc = kvm_forward_prefill(p->f, p->cache, p->tokens + p->done, s - p->done, NULL, KVM_LOGITS_NONE);
        kvm_forward_clear_hooks(p->f);
        if (rc) {
            p->n = 0; /* its cache may hold a partial step: later documents are prefilled whole */
            *out = NULL;
            return rc;
        }
        p->done = s;
    }
    rc = doc_build(p->m, p->k, tokens, n_tokens, n_ctx, n_cont, p, s, out);
    if (!rc && reused) *reused = s;
    return rc;
}

int kvm_eval_doc_set_repeat_prompt(kvm_eval_doc *d, const int32_t *ids, int64_t n)
{
    int32_t *copy = n > 0 ? malloc((size_t)n * sizeof *copy) : NULL;
    if (n > 0 && !copy) return kvm_err(KVM_ENOMEM, "eval: out of memory");
    if (n > 0) memcpy(copy, ids, (size_t)n * sizeof *copy);
    free(d->repeat_prompt);
    d->repeat_prompt = copy;
    d->in.repeat_prompt = copy;
    d->in.n_repeat_prompt = n > 0 ? n : 0;
    kvm_sculpt_qsets_free(&d->qcache); /* a repeat set of the old prompt is stale */
    return 0;
}

void kvm_eval_doc_free(kvm_eval_doc **pd)
{
    if (!pd || !*pd) return;
    kvm_eval_doc *d = *pd;
    kvm_forward_free(&d->f);
    kvm_capture_free(&d->cap);
    kvm_kvcache_free(&d->full);
    kvm_sculpt_qsets_free(&d->qcache);
    free(d->repeat_prompt);
    free(d->tokens);
    free(d->ref_dec);
    free(d->ref);
    free(d->work);
    free(d->kl_steps);
    free(d);
    *pd = NULL;
}

const kvm_compress_input *kvm_eval_doc_input(const kvm_eval_doc *d) { return &d->in; }

double kvm_eval_doc_ppl_full(const kvm_eval_doc *d) { return d->ppl_full; }

int kvm_eval_continue(kvm_eval_doc *d, const kvm_kvcache *compressed, kvm_decode_policy *pol, const kvm_hooks *extra,
                      kvm_eval_result *r)
{
    const kvm_model_config *c = &d->m->cfg;
    const int V = c->vocab_size;
    const int64_t T = d->n_cont;
    if (compressed->n_layers != c->n_layers || compressed->n_kv_heads != c->n_kv_heads ||
        compressed->head_dim != c->head_dim || compressed->next_pos != d->n_ctx)
        return kvm_err(KVM_EINVAL, "eval: the compressed cache is not a %d-token context cache of this model",
                       (int)d->n_ctx);
    int64_t entries = kvm_kvcache_entries(compressed);
    kvm_kvcache *c2 = NULL;
    double *kl = malloc((size_t)T * sizeof *kl);
    int rc = kl ? 0 : kvm_err(KVM_ENOMEM, "eval: out of memory");
    if (!rc && pol) rc = ref_decode(d);
    const float *ref = pol ? d->ref_dec : d->ref;
    d->have_kl = 0;
    if (!rc) rc = kvm_kvcache_clone(compressed, &c2);
    if (!rc && pol) rc = kvm_forward_add_hooks(d->f, &pol->hooks);
    if (!rc && extra) rc = kvm_forward_add_hooks(d->f, extra);
    if (!rc) rc = continue_run(d, c2, d->work, pol == NULL);
    kvm_forward_clear_hooks(d->f);
    if (!rc) {
        kvm_eval_score(ref, d->work, d->tokens + d->n_ctx, T, V, kl, d->kl_steps, r);
        d->have_kl = 1;
        r->ppl_full = pol ? d->ppl_dec : d->ppl_full;
        r->budget_tokens = (double)entries / ((double)c->n_layers * c->n_kv_heads);
        r->ratio = r->budget_tokens / (double)d->n_ctx;
    }
    kvm_kvcache_free(&c2);
    free(kl);
    return rc;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const kvm_kvcache *kvm_eval_doc_full(const kvm_eval_doc *d) { return d->full; }

kvm_forward *kvm_eval_doc_forward(kvm_eval_doc *d) { return d->f; }

const int32_t *kvm_eval_doc_continuation(const kvm_eval_doc *d, int64_t *n)
{
    *n = d->n_cont;
    return d->tokens + d->n_ctx;
}

double kvm_eval_kl_steps_mean(const double *kl_steps, int64_t T, int64_t t0, int64_t t1)
{
    if (!kl_steps || t0 < 0 || t1 <= t0 || t1 > T) return NAN;
    double s = 0;
    for (int64_t i = t0; i < t1; i++)
        s += kl_steps[i];
    return s / (double)(t1 - t0);
}

double kvm_eval_kl_range(const kvm_eval_doc *d, int64_t t0, int64_t t1)
{
    return kvm_eval_kl_steps_mean(d->have_kl ? d->kl_steps : NULL, d->n_cont, t0, t1);
}

/* Wall ms per decode step: tokens N, N+1, ... one decode call each over a copy of c. */
static int decode_ms(kvm_eval_doc *d, const kvm_kvcache *c, int steps, double *ms)
{
    kvm_kvcache *c2 = NULL;
    float *logits = malloc((size_t)d->m->cfg.vocab_size * sizeof *logits);
    int rc = logits ? kvm_kvcache_clone(c, &c2) : kvm_err(KVM_ENOMEM, "eval: out of memory");
    double t0 = now_s();
    for (int i = 0; !rc && i < steps; i++)
        rc = kvm_forward_decode(d->f, c2, d->tokens[d->n_ctx + i], logits);
    *ms = 1e3 * (now_s() - t0) / steps;
    kvm_kvcache_free(&c2);
    free(logits);
    return rc;
}

int kvm_eval_run_ex(kvm_eval_doc *d, const kvm_method *m, const void *opts, const kvm_eval_opts *eo,
                    kvm_eval_result *r)
{
    kvm_kvcache *cc = NULL, *served = NULL;
    kvm_decode_policy *pol = NULL;
    memset(r, 0, sizeof *r);
    if (eo->decode_steps < 0 || eo->decode_steps > d->n_cont)
        return kvm_err(KVM_EINVAL, "eval: %d decode steps do not fit a continuation of %lld tokens", eo->decode_steps,
                       (long long)d->n_cont);
    double t0 = now_s();
    int rc = m->compress(&d->in, opts, &cc);
    double dt = now_s() - t0;
    int64_t bytes = 0;
    if (!rc && eo->roundtrip) rc = eo->roundtrip(eo->user, cc, d->n_ctx, &served, &bytes);
    if (served) {
        kvm_kvcache_free(&cc);
        cc = served;
    }
    if (!rc && eo->phases_both && m->decode_new) rc = m->decode_new(&d->in, opts, cc, &pol);
    if (!rc) rc = kvm_eval_continue(d, cc, pol, NULL, r);
    double ms = 0;
    if (!rc && eo->decode_steps > 0) rc = decode_ms(d, cc, eo->decode_steps, &ms);
    r->seconds = dt;
    r->bytes_compressed = bytes;
    r->decode_ms = ms;
    kvm_decode_policy_free(&pol);
    kvm_kvcache_free(&cc);
    return rc;
}

int kvm_eval_run(kvm_eval_doc *d, const kvm_method *m, const void *opts, int phases_both, kvm_eval_result *r)
{
    kvm_eval_opts eo = {.phases_both = phases_both};
    return kvm_eval_run_ex(d, m, opts, &eo, r);
}
