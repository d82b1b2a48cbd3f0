/* kvm_eval_answer.c: one question answered over many caches at once (task accuracy). The
 * question with a reference answer teacher-forced after it, then each cache's greedy decode,
 * run as batched forward calls over all the caches (kvm_forward_multi): on a CPU a small
 * forward call is bound by reading the weights, so one call for every cache costs about what
 * one call for one cache does. */
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"
#include "model/kvm_sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One cache's answer in progress. */
typedef struct ans_seq {
    kvm_kvcache *c; /* the caller's cache, question and answer appended */
    int32_t tok;    /* the token to feed next */
    int active;     /* 0: the answer is complete */
} ans_seq;

/* −log softmax(x)[t] in float64. */
static double token_nll(const float *x, int64_t V, int32_t t)
{
    float mx = x[0];
    for (int64_t v = 1; v < V; v++)
        mx = x[v] > mx ? x[v] : mx;
    double z = 0;
    for (int64_t v = 0; v < V; v++)
        z += exp((double)(x[v] - mx));
    return log(z) + mx - x[t];
}

/* Appends the greedy choice of row to answer i; 0 when the answer is complete (EOS, which is
 * not stored, max_new tokens, or o->done). */
static int take(const kvm_model_config *c, const float *row, const kvm_eval_answers_opts *o, int i, int max_new,
                int32_t *out, int *n)
{
    int32_t next = kvm_argmax(row, c->vocab_size);
    if (kvm_model_is_eos(c, next)) return 0;
    out[(*n)++] = next;
    return *n < max_new && !(o && o->done && o->done(o->user, i, out, *n));
}

/* After the first call: answer i's NLL of the reference (rows 0..n_ref-1 of lg predict ref),
 * then its greedy tokens while they follow the reference; at the first that does not, the
 * entries of the reference's rejected tokens (the positions from the first rejected one on)
 * are dropped from the cache and the token becomes the next to feed. */
static void after_first(const kvm_model_config *c, const float *lg, const kvm_eval_answers_opts *o, int i, int max_new,
                        ans_seq *s, int32_t *out, int *n, double *nll)
{
    const int64_t V = c->vocab_size;
    const int n_ref = o && o->ref ? o->n_ref : 0;
    if (nll) {
        double sum = 0;
        for (int j = 0; j < n_ref; j++)
            sum += token_nll(lg + (size_t)j * V, V, o->ref[j]);
        *nll = n_ref ? sum / n_ref : NAN;
    }
    int j = 0; /* the cache holds the question and ref[0, n_ref); row j follows ref[0, j) */
    s->active = take(c, lg, o, i, max_new, out, n);
    while (s->active && j < n_ref && out[*n - 1] == o->ref[j]) {
        j++;
        s->active = take(c, lg + (size_t)j * V, o, i, max_new, out, n);
    }
    s->c->next_pos -= n_ref - j;
    for (int l = 0; l < s->c->n_layers; l++) /* the rejected reference tokens' entries: positions past it */
        for (int h = 0; h < s->c->n_kv_heads; h++) {
            kvm_kv_head *kh = kvm_kvcache_head(s->c, l, h);
            while (kh->n > 0 && kh->pos[kh->n - 1] >= s->c->next_pos)
                kvm_kvcache_drop(kh, s->c->head_dim, kh->n - 1);
        }
    if (s->active) s->tok = out[*n - 1];
}

/* Checks the arguments, before any cache changes. */
static int check_answers(const kvm_eval_doc *d, kvm_kvcache *const *caches, int n, int max_new,
                         const kvm_eval_answers_opts *o)
{
    const kvm_model_config *c = &kvm_eval_doc_input(d)->model->cfg;
    const int64_t N = kvm_eval_doc_input(d)->n_tokens;
    const int n_ref = o && o->ref ? o->n_ref : 0;
    if (n < 1 || max_new < 1 || n_ref < 0 || n_ref > max_new)
        return kvm_err(KVM_EINVAL, "eval: answers: %d caches, max_new %d, a reference of %d tokens", n, max_new, n_ref);
    for (int i = 0; i < n; i++)
        if (caches[i]->n_layers != c->n_layers || caches[i]->n_kv_heads != c->n_kv_heads ||
            caches[i]->head_dim != c->head_dim || caches[i]->next_pos != N)
            return kvm_err(KVM_EINVAL, "eval: answers: cache %d is not a %lld-token context cache of this model", i,
                           (long long)N);
    for (int i = 0; i < n; i++)
        for (int t = 0; t < i; t++)
            if (caches[t] == caches[i])
                return kvm_err(KVM_EINVAL, "eval: answers: caches %d and %d are one cache", t, i);
    return 0;
}

/* The decode steps: one call feeds every active answer its next token. */
static int decode_steps(kvm_eval_doc *d, ans_seq *s, int n, int max_new, const kvm_eval_answers_opts *o, int32_t *out,
                        int *n_out, float *lg, int *calls)
{
    const kvm_model_config *c = &kvm_eval_doc_input(d)->model->cfg;
    kvm_kvcache **cs = malloc((size_t)n * sizeof *cs);
    const int32_t **tok = malloc((size_t)n * sizeof *tok);
    int64_t *one = malloc((size_t)n * sizeof *one);
    int *idx = malloc((size_t)n * sizeof *idx);
    int rc = cs && tok && one && idx ? 0 : kvm_err(KVM_ENOMEM, "eval: answers: out of memory");
    for (int k = 0; k < n; k++)
        if (one) one[k] = 1;
    while (!rc) {
        int m = 0;
        for (int i = 0; i < n; i++)
            if (s[i].active) {
                cs[m] = s[i].c;
                tok[m] = &s[i].tok;
                idx[m++] = i;
            }
        if (m == 0) break;
        (*calls)++;
        if ((rc = kvm_forward_multi(kvm_eval_doc_forward(d), cs, tok, one, m, one, lg))) break;
        for (int k = 0; k < m; k++) {
            ans_seq *a = &s[idx[k]];
            int32_t *o_i = out + (size_t)idx[k] * max_new;
            a->active = take(c, lg + (size_t)k * c->vocab_size, o, idx[k], max_new, o_i, &n_out[idx[k]]);
            if (a->active) a->tok = o_i[n_out[idx[k]] - 1];
        }
    }
    free(cs);
    free(tok);
    free(one);
    free(idx);
    return rc;
}

int kvm_eval_answers(kvm_eval_doc *d, kvm_kvcache *const *caches, int n, int max_new, const kvm_eval_answers_opts *o,
                     int32_t *out, int *n_out, double *nll, int *forward_calls)
{
    int calls = 0, rc = check_answers(d, caches, n, max_new, o);
    if (rc) return rc;
    const kvm_model_config *c = &kvm_eval_doc_input(d)->model->cfg;
    const int n_ref = o && o->ref ? o->n_ref : 0;
    int64_t T;
    const int32_t *question = kvm_eval_doc_continuation(d, &T);
    const int64_t first = T + n_ref, rows = (int64_t)n * (n_ref + 1);
    ans_seq *s = calloc((size_t)n, sizeof *s);
    kvm_kvcache **cs = malloc((size_t)n * sizeof *cs);
    const int32_t **tok = malloc((size_t)n * sizeof *tok);
    int64_t *len = malloc((size_t)n * sizeof *len), *n_lg = malloc((size_t)n * sizeof *n_lg);
    int32_t *qa = malloc((size_t)first * sizeof *qa);
    float *lg = malloc((size_t)rows * (size_t)c->vocab_size * sizeof *lg); /* rows ≥ n: the steps' too */
    if (!s || !cs || !tok || !len || !n_lg || !qa || !lg) rc = kvm_err(KVM_ENOMEM, "eval: answers: out of memory");
    if (!rc) {
        memcpy(qa, question, (size_t)T * sizeof *qa);
        if (n_ref) memcpy(qa + T, o->ref, (size_t)n_ref * sizeof *qa);
    }
    for (int i = 0; !rc && i < n; i++) {
        n_out[i] = 0;
        cs[i] = s[i].c = caches[i];
        tok[i] = qa;
        len[i] = first;
        n_lg[i] = n_ref + 1;
    }
    if (!rc) rc = kvm_forward_multi(kvm_eval_doc_forward(d), cs, tok, len, n, n_lg, lg);
    for (int i = 0; !rc && i < n; i++)
        after_first(c, lg + (size_t)i * (n_ref + 1) * c->vocab_size, o, i, max_new, &s[i], out + (size_t)i * max_new,
                    &n_out[i], nll ? &nll[i] : NULL);
    if (!rc) rc = decode_steps(d, s, n, max_new, o, out, n_out, lg, &calls);
    if (forward_calls) *forward_calls = calls;
    free(s);
    free(cs);
    free(tok);
    free(len);
    free(n_lg);
    free(qa);
    free(lg);
    return rc;
}
