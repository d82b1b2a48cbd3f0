/* kvm_eval_cuda.c: eviction methods scored on a CUDA device (kvm_eval_cuda.h). */
#include "compress/eval/kvm_eval_cuda.h"
#include "model/kvm_model_window.h"

#ifdef KVM_WITH_CUDA
#include "common/kvm_error.h"
#include "model/kvm_forward_cuda.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kvm_eval_cuda_doc {
    kvm_cuda_model *dm;        /* borrowed */
    const kvm_model_config *c; /* borrowed */
    int32_t *tokens;           /* [N + T] */
    int64_t N, T;
    float *ref, *work; /* [T][vocab]: the full-KV reference, a compressed run */
    float *ref_dec;    /* [T][vocab]: the reference token by token (runs with a decode policy), or NULL */
    double *kl;        /* [T] scratch */
    double *kl_steps;  /* [T] per-step KL of the last scored run (kvm_eval_cuda_kl_range) */
    int have_kl;       /* kl_steps holds a run */
    double ppl_full, ppl_dec;
};

/* the context prefill (with the eviction statistics when n_obs > 0; logits of its last token into
 * out[0]), an optional eviction, then the continuation teacher-forced into out[1, T): in one
 * batched call, or (stepwise) one decode call per token, with the plan's decode-phase policy on
 * the device when decode is set (kvm_cuda_model_decode_evict), as kvm_eval_continue runs a
 * method's decode policy on the CPU */
static int run(kvm_eval_cuda_doc *d, int64_t n_obs, const kvm_cuda_evict_plan *ep, int stepwise, int decode, float *out,
               double *evict_s)
{
    const int V = d->c->vocab_size;
    kvm_cuda_model_reset(d->dm);
    int rc = kvm_cuda_model_keep_evict_stats(d->dm, n_obs);
    if (!rc) rc = kvm_cuda_model_forward(d->dm, d->tokens, d->N, out, 1, NULL);
    if (!rc && ep) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        rc = kvm_cuda_model_evict(d->dm, ep);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        *evict_s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    if (!rc && ep && decode) rc = kvm_cuda_model_decode_evict(d->dm, ep);
    if (!stepwise && !rc && d->T > 1) rc = kvm_cuda_model_forward(d->dm, d->tokens + d->N, d->T - 1, out + V, 0, NULL);
    for (int64_t i = 1; stepwise && !rc && i < d->T; i++)
        rc = kvm_cuda_model_forward(d->dm, d->tokens + d->N + i - 1, 1, out + i * V, 1, NULL);
    kvm_cuda_model_decode_evict(d->dm, NULL);
    return rc;
}

int kvm_eval_cuda_doc_new(kvm_cuda_model *dm, const kvm_model_config *c, const int32_t *tokens, int64_t N, int64_t T,
                          kvm_eval_cuda_doc **out)
{
    *out = NULL;
    if (N < 1 || T < 1 || N + T > kvm_model_window(c))
        return kvm_err(KVM_EINVAL, "eval: context %lld + continuation %lld (model window %d)", (long long)N,
                       (long long)T, kvm_model_window(c));
    kvm_eval_cuda_doc *d = calloc(1, sizeof *d);
    if (!d) return kvm_err(KVM_ENOMEM, "eval: out of memory");
    const size_t TV = (size_t)T * (size_t)c->vocab_size;
    *d = (kvm_eval_cuda_doc){.dm = dm, .c = c, .N = N, .T = T};
    d->tokens = malloc((size_t)(N + T) * sizeof *d->tokens);
    d->ref = malloc(TV * sizeof *d->ref);
    d->work = malloc(TV * sizeof *d->work);
    d->kl = malloc((size_t)T * sizeof *d->kl);
    d->kl_steps = malloc((size_t)T * sizeof *d->kl_steps);
    int rc = d->tokens && d->ref && d->work && d->kl && d->kl_steps ? 0 : kvm_err(KVM_ENOMEM, "eval: out of memory");
    if (!rc) {
        memcpy(d->tokens, tokens, (size_t)(N + T) * sizeof *tokens);
        rc = run(d, 0, NULL, 0, 0, d->ref, NULL);
    }
    if (rc) {
        kvm_eval_cuda_doc_free(&d);
        return rc;
    }
    d->ppl_full = kvm_eval_ppl(d->ref, d->tokens + N, T, c->vocab_size);
    *out = d;
    return 0;
}

void kvm_eval_cuda_doc_free(kvm_eval_cuda_doc **pd)
{
    if (!pd || !*pd) return;
    kvm_eval_cuda_doc *d = *pd;
    free(d->tokens);
    free(d->ref);
    free(d->ref_dec);
    free(d->work);
    free(d->kl);
    free(d->kl_steps);
    free(d);
    *pd = NULL;
}

/* The token-by-token reference, made on first use. */
static int ref_decode(kvm_eval_cuda_doc *d)
{
    if (d->ref_dec) return 0;
    if (!(d->ref_dec = malloc((size_t)d->T * (size_t)d->c->vocab_size * sizeof *d->ref_dec)))
        return kvm_err(KVM_ENOMEM, "eval: out of memory");
    int rc = run(d, 0, NULL, 1, 0, d->ref_dec, NULL);
    if (rc) {
        free(d->ref_dec);
        d->ref_dec = NULL;
        return rc;
    }
    d->ppl_dec = kvm_eval_ppl(d->ref_dec, d->tokens + d->N, d->T, d->c->vocab_size);
    return 0;
}

int kvm_eval_cuda_evict(kvm_eval_cuda_doc *d, const kvm_evict_plan *p, int phases_both, kvm_eval_result *r)
{
    const kvm_model_config *c = d->c;
    if (p->n_layers != c->n_layers || p->n_kv_heads != c->n_kv_heads)
        return kvm_err(KVM_EINVAL, "eval: plan shape %dx%d is not the model's %dx%d", p->n_layers, p->n_kv_heads,
                       c->n_layers, c->n_kv_heads);
    const int64_t nh = (int64_t)c->n_layers * c->n_kv_heads;
    uint8_t *pat = malloc((size_t)nh);
    if (!pat) return kvm_err(KVM_ENOMEM, "eval: out of memory");
    int64_t entries = 0;
    for (int64_t i = 0; i < nh; i++) {
        pat[i] = (uint8_t)p->pattern[i];
        entries += p->pattern[i] == KVM_PATTERN_NONE || p->budget[i] >= d->N ? d->N : p->budget[i];
    }
    /* the window's rows for every pattern (TOVA reads the last), so the buffers stay the same size */
    const int64_t n_obs = p->params.window < d->N ? p->params.window : d->N;
    const kvm_cuda_evict_plan ep = {.pattern = pat,
                                    .budget = p->budget,
                                    .sinks = p->params.sinks,
                                    .window = p->params.window,
                                    .pool = p->params.pool,
                                    .recent_frac = p->params.recent_frac};
    memset(r, 0, sizeof *r);
    d->have_kl = 0;
    int rc = phases_both ? ref_decode(d) : 0;
    if (!rc) rc = run(d, n_obs, &ep, phases_both, phases_both, d->work, &r->seconds);
    free(pat);
    if (rc) return rc;
    kvm_eval_score(phases_both ? d->ref_dec : d->ref, d->work, d->tokens + d->N, d->T, c->vocab_size, d->kl,
                   d->kl_steps, r);
    d->have_kl = 1;
    r->ppl_full = phases_both ? d->ppl_dec : d->ppl_full;
    r->budget_tokens = (double)entries / (double)nh;
    r->ratio = r->budget_tokens / (double)d->N;
    return 0;
}

int kvm_eval_cuda_continue(kvm_eval_cuda_doc *d, const kvm_kvcache *compressed, kvm_eval_result *r)
{
    const kvm_model_config *c = d->c;
    const int V = c->vocab_size;
    if (compressed->n_layers != c->n_layers || compressed->n_kv_heads != c->n_kv_heads ||
        compressed->head_dim != c->head_dim || compressed->next_pos != d->N)
        return kvm_err(KVM_EINVAL, "eval: the compressed cache is not a %lld-token context cache of this model",
                       (long long)d->N);
    memset(r, 0, sizeof *r);
    d->have_kl = 0;
    kvm_cuda_model_decode_evict(d->dm, NULL);
    kvm_cuda_model_reset(d->dm);
    memcpy(d->work, d->ref, (size_t)V * sizeof *d->work);
    int rc = kvm_kvcache_cuda_upload(d->dm, compressed);
    if (!rc && d->T > 1) rc = kvm_cuda_model_forward(d->dm, d->tokens + d->N, d->T - 1, d->work + V, 0, NULL);
    if (rc) return rc;
    kvm_eval_score(d->ref, d->work, d->tokens + d->N, d->T, V, d->kl, d->kl_steps, r);
    d->have_kl = 1;
    r->ppl_full = d->ppl_full;
    r->budget_tokens = (double)kvm_kvcache_entries(compressed) / ((double)c->n_layers * c->n_kv_heads);
    r->ratio = r->budget_tokens / (double)d->N;
    return 0;
}

double kvm_eval_cuda_kl_range(const kvm_eval_cuda_doc *d, int64_t t0, int64_t t1)
{
    return kvm_eval_kl_steps_mean(d->have_kl ? d->kl_steps : NULL, d->T, t0, t1);
}
#endif
