/* sculpt_qsource.c: the query_source setting (parse, format, counts) and the forward passes that
 * give real model queries for training: the repeated context (KVzip arXiv 2505.23416 §3.1,
 * Attention Matching arXiv 2602.16284) and a greedy continuation. */
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "model/kvm_model_window.h"
#include "model/kvm_chat.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "common/kvm_number.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *const qsrc_names[KVM_SCULPT_QSRC_COUNT] = {"synthetic", "repeat", "continuation"};

int kvm_sculpt_qsource_parse(const char *s, kvm_sculpt_qsource *out)
{
    kvm_sculpt_qsource r = {{0}};
    int seen = 0;
    if (!s || !*s) return kvm_err(KVM_EINVAL, "sculpt: query_source is empty (synthetic | repeat | continuation | mix)");
    const char *p = s;
    while (*p) {
        const char *end = strchr(p, '+');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *at = memchr(p, '@', len);
        size_t nlen = at ? (size_t)(at - p) : len;
        int src = -1;
        for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++)
            if (strlen(qsrc_names[i]) == nlen && !strncmp(p, qsrc_names[i], nlen)) src = i;
        if (src < 0)
            return kvm_err(KVM_EINVAL, "sculpt: query_source '%s': '%.*s' is not synthetic, repeat or continuation", s,
                           (int)nlen, p);
        if (seen & (1 << src)) return kvm_err(KVM_EINVAL, "sculpt: query_source '%s' names %s twice", s, qsrc_names[src]);
        seen |= 1 << src;
        double w = 1;
        if (at) {
            char num[64];
            size_t wl = len - nlen - 1;
            if (wl == 0 || wl >= sizeof num)
                return kvm_err(KVM_EINVAL, "sculpt: query_source '%s': %s@ needs a share", s, qsrc_names[src]);
            memcpy(num, at + 1, wl);
            num[wl] = 0;
            int prc = kvm_parse_decimal(num, &w);
            if (prc == KVM_ERANGE) /* 1e-320 is positive: a double cannot hold it */
                return kvm_err(KVM_EINVAL, "sculpt: query_source '%s': share '%s' of %s is beyond a double's range", s,
                               num, qsrc_names[src]);
            if (prc || !(w > 0))
                return kvm_err(KVM_EINVAL, "sculpt: query_source '%s': share '%s' of %s is not a positive number", s,
                               num, qsrc_names[src]);
        }
        r.share[src] = w;
        if (!end) break;
        p = end + 1;
        if (!*p) return kvm_err(KVM_EINVAL, "sculpt: query_source '%s' ends with '+'", s);
    }
    double sum = 0;
    for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++) sum += r.share[i];
    if (!isfinite(sum)) return kvm_err(KVM_EINVAL, "sculpt: query_source '%s': the shares' sum overflows", s);
    for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++) r.share[i] /= sum;
    *out = r;
    return 0;
}

void kvm_sculpt_qsource_format(const kvm_sculpt_qsource *src, char *buf, size_t size)
{
    int n_used = 0;
    for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++) n_used += src->share[i] > 0;
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < KVM_SCULPT_QSRC_COUNT && at < size; i++) {
        if (!(src->share[i] > 0)) continue;
        int w = n_used > 1 ? snprintf(buf + at, size - at, "%s%s@%g", at ? "+" : "", qsrc_names[i], src->share[i])
                           : snprintf(buf + at, size - at, "%s", qsrc_names[i]);
        if (w < 0) break;
        at += (size_t)w;
    }
}

void kvm_sculpt_qsource_counts(const kvm_sculpt_qsource *src, int64_t S, int64_t *n)
{
    double rem[KVM_SCULPT_QSRC_COUNT];
    int64_t given = 0;
    for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++) {
        double x = src->share[i] > 0 ? src->share[i] * (double)S : 0;
        n[i] = (int64_t)floor(x);
        rem[i] = x - (double)n[i];
        given += n[i];
    }
    while (given < S) { /* largest remainder, ties to the earlier source */
        int best = -1;
        for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++)
            if (src->share[i] > 0 && (best < 0 || rem[i] > rem[best])) best = i;
        if (best < 0) best = KVM_SCULPT_QSRC_SYNTHETIC;
        n[best]++;
        rem[best] = -1;
        given++;
    }
}

void kvm_sculpt_qsets_free(kvm_sculpt_qsets *qs)
{
    if (!qs) return;
    for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++) free(qs->set[i].q);
    memset(qs, 0, sizeof *qs);
}

/* Forward hook: copies the post-RoPE queries of positions [pos0, pos0 + n) head-major. */
typedef struct grab {
    const kvm_model_config *c;
    kvm_sculpt_qset *set;
} grab;

static int on_update(void *user, kvm_attn_site *s)
{
    grab *g = user;
    const int H = g->c->n_heads, d = g->c->head_dim;
    const int64_t n = g->set->n;
    float *base = g->set->q + (size_t)s->layer * (size_t)H * (size_t)n * (size_t)d;
    for (int64_t i = 0; i < s->n_q; i++) {
        int64_t t = (int64_t)s->qpos[i] - g->set->pos0;
        if (t < 0 || t >= n) continue;
        for (int h = 0; h < H; h++)
            memcpy(base + ((size_t)h * (size_t)n + (size_t)t) * (size_t)d, s->q + ((size_t)i * H + h) * (size_t)d,
                   (size_t)d * sizeof(float));
    }
    return 0;
}

static int set_alloc(const kvm_model_config *c, int64_t n, int32_t pos0, kvm_sculpt_qset *set)
{
    set->n = n;
    set->pos0 = pos0;
    set->q = malloc((size_t)c->n_layers * (size_t)c->n_heads * (size_t)n * (size_t)c->head_dim * sizeof(float));
    return set->q ? 0 : kvm_err(KVM_ENOMEM, "sculpt: out of memory for %lld model queries", (long long)n);
}

int kvm_sculpt_repeat_prompt(const kvm_tokenizer *tok, int chat, int32_t **ids, int64_t *n)
{
    *ids = NULL;
    *n = 0;
    char *open = NULL, *close = NULL, *text = NULL;
    int rc = chat ? kvm_chat_frame(tok, NULL, &open, &close) : 0; /* the turn's end does not depend on the system */
    const size_t il = strlen(KVM_SCULPT_REPEAT_INSTRUCTION), cl = close ? strlen(close) : 0;
    if (!rc && !(text = malloc(il + cl + 1))) rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory");
    if (!rc) {
        memcpy(text, KVM_SCULPT_REPEAT_INSTRUCTION, il);
        if (cl) memcpy(text + il, close, cl);
        rc = kvm_tokenizer_encode(tok, text, il + cl, 0, 0, ids, n);
    }
    if (!rc && *n < 1) rc = kvm_err(KVM_EINVAL, "sculpt: the repeat prompt encodes to no tokens");
    if (rc) {
        free(*ids);
        *ids = NULL;
        *n = 0;
    }
    free(open);
    free(close);
    free(text);
    return rc;
}

/* repeat: prompt + context prefilled after the context; queries of the repeated copy. */
static int build_repeat(const kvm_compress_input *in, kvm_forward *f, kvm_sculpt_qset *set)
{
    const kvm_model_config *c = &in->model->cfg;
    const int64_t N = in->n_tokens, P = in->n_repeat_prompt > 0 ? in->n_repeat_prompt : 1;
    if (2 * N + P > kvm_model_window(c))
        return kvm_err(KVM_EINVAL,
                       "sculpt: query_source repeat needs 2N + P = %lld positions (N = %lld, prompt %lld) "
                       "but the model's window is %d tokens: use a shorter context or another source",
                       (long long)(2 * N + P), (long long)N, (long long)P, kvm_model_window(c));
    int32_t *seq = malloc((size_t)(N + P) * sizeof *seq);
    kvm_kvcache *cc = NULL;
    int rc = seq ? set_alloc(c, N, (int32_t)(N + P), set) : kvm_err(KVM_ENOMEM, "sculpt: out of memory");
    if (!rc) {
        if (in->n_repeat_prompt > 0) memcpy(seq, in->repeat_prompt, (size_t)P * sizeof *seq);
        else seq[0] = c->bos_id;
        memcpy(seq + P, in->tokens, (size_t)N * sizeof *seq);
        grab g = {c, set};
        kvm_hooks h = {.user = &g, .cache_update = on_update};
        rc = kvm_kvcache_clone(in->full, &cc);
        if (!rc) rc = kvm_forward_add_hooks(f, &h);
        if (!rc) rc = kvm_forward_prefill(f, cc, seq, N + P, NULL, KVM_LOGITS_NONE);
        kvm_forward_clear_hooks(f);
    }
    kvm_kvcache_free(&cc);
    free(seq);
    return rc;
}

static int32_t argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* continuation: T greedy tokens after the context (the last context token decoded again over
 * the cache without it, for its logits); queries of positions N .. N+T−1. */
static int build_continuation(const kvm_compress_input *in, kvm_forward *f, int64_t T, kvm_sculpt_qset *set)
{
    const kvm_model_config *c = &in->model->cfg;
    const int64_t N = in->n_tokens;
    if (T > kvm_model_window(c) - N) T = kvm_model_window(c) - N;
    if (T < 1)
        return kvm_err(KVM_EINVAL,
                       "sculpt: query_source continuation: the context of %lld tokens fills the model's "
                       "window of %d",
                       (long long)N, kvm_model_window(c));
    float *logits = malloc((size_t)c->vocab_size * sizeof *logits);
    kvm_kvcache *cc = NULL;
    int rc = logits ? set_alloc(c, T, (int32_t)N, set) : kvm_err(KVM_ENOMEM, "sculpt: out of memory");
    if (!rc) rc = kvm_kvcache_clone(in->full, &cc);
    for (int l = 0; !rc && l < c->n_layers; l++) /* drop position N−1 */
        for (int g = 0; !rc && g < c->n_kv_heads; g++) {
            kvm_kv_head *h = kvm_kvcache_head(cc, l, g);
            if (h->n > 0 && h->pos[h->n - 1] == (int32_t)(N - 1)) h->n--;
            else rc = kvm_err(KVM_EINVAL, "sculpt: the full cache's last entry is not position N-1 = %lld", (long long)(N - 1));
        }
    if (!rc) {
        cc->next_pos = (int32_t)(N - 1);
        rc = kvm_forward_decode(f, cc, in->tokens[N - 1], logits);
    }
    grab g = {c, set};
    kvm_hooks h = {.user = &g, .cache_update = on_update};
    if (!rc) rc = kvm_forward_add_hooks(f, &h);
    for (int64_t t = 0; !rc && t < T; t++) rc = kvm_forward_decode(f, cc, argmax(logits, c->vocab_size), logits);
    kvm_forward_clear_hooks(f);
    kvm_kvcache_free(&cc);
    free(logits);
    return rc;
}

int kvm_sculpt_qsets_build(const kvm_compress_input *in, const kvm_sculpt_qsource *src, int64_t S,
                           kvm_sculpt_qsets *out)
{
    memset(out, 0, sizeof *out);
    int rc = kvm_sculpt_qsets_ensure(in, src, S, out);
    if (rc) kvm_sculpt_qsets_free(out);
    return rc;
}

int kvm_sculpt_qsets_ensure(const kvm_compress_input *in, const kvm_sculpt_qsource *src, int64_t S,
                            kvm_sculpt_qsets *out)
{
    out->seconds = 0;
    int64_t n[KVM_SCULPT_QSRC_COUNT];
    kvm_sculpt_qsource_counts(src, S, n);
    if (n[KVM_SCULPT_QSRC_REPEAT] == 0 && n[KVM_SCULPT_QSRC_CONTINUATION] == 0) return 0;
    if (!in->tokens)
        return kvm_err(KVM_EINVAL, "sculpt: query_source repeat/continuation needs the context's tokens, and this "
                                   "caller passed none");
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const kvm_model_config *c = &in->model->cfg;
    const int group = c->n_heads / c->n_kv_heads;
    int64_t T = (n[KVM_SCULPT_QSRC_CONTINUATION] + group - 1) / group;
    if (T > kvm_model_window(c) - in->n_tokens) T = kvm_model_window(c) - in->n_tokens;
    kvm_sculpt_qset *rep = &out->set[KVM_SCULPT_QSRC_REPEAT], *con = &out->set[KVM_SCULPT_QSRC_CONTINUATION];
    int want_rep = n[KVM_SCULPT_QSRC_REPEAT] > 0 && !(rep->q && rep->n == in->n_tokens);
    int want_con = n[KVM_SCULPT_QSRC_CONTINUATION] > 0 && !(con->q && con->n == T);
    if (!want_rep && !want_con) return 0;
    kvm_forward *f = NULL;
    int rc = kvm_forward_new(in->model, NULL, in->n_tokens + 1, &f);
    if (!rc && want_rep) {
        free(rep->q);
        memset(rep, 0, sizeof *rep);
        if ((rc = build_repeat(in, f, rep))) {
            free(rep->q);
            memset(rep, 0, sizeof *rep);
        }
    }
    if (!rc && want_con) {
        free(con->q);
        memset(con, 0, sizeof *con);
        if (T >= 1 && T * group < n[KVM_SCULPT_QSRC_CONTINUATION]) /* said, not silent: fewer distinct queries */
            kvm_log(KVM_LOG_WARN, "message", NULL, 0,
                    "sculpt: query_source continuation: the model's window of %d tokens leaves %lld positions after "
                    "the %lld-token context, so its %lld queries are drawn from %lld distinct ones (%lld tokens "
                    "x %d query heads per KV head; %lld tokens asked)",
                    kvm_model_window(c), (long long)T, (long long)in->n_tokens,
                    (long long)n[KVM_SCULPT_QSRC_CONTINUATION], (long long)(T * group), (long long)T, group,
                    (long long)((n[KVM_SCULPT_QSRC_CONTINUATION] + group - 1) / group));
        if ((rc = build_continuation(in, f, T, con))) {
            free(con->q);
            memset(con, 0, sizeof *con);
        }
    }
    kvm_forward_free(&f);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    out->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    return rc;
}
