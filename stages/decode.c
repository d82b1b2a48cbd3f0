/* decode.c: the kvmill-decode stage (a serving worker of kvmill serve): for an `ask` it
 * tokenises and hashes the document exactly as `kvmill run` does, loads the document's
 * compressed cache from the store (or compresses it on demand with [serve]
 * compute_missing), appends the prompt in one batched prefill, generates up to
 * max_new_tokens (greedy, or at the request's temperature) and answers with the text, the
 * token ids and timings. Every refusal (limits, context window, missing cache) is an error
 * `answer`, so the client always learns why. */
#include "common/kvm_error.h"
#include "model/kvm_capture.h"
#include "model/kvm_forward.h"
#include "model/kvm_sampler.h"
#include "pipeline/kvm_corpus.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_serve_cache.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_worker.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct decode_state {
    kvm_config *cfg;          /* --config, with --store applied */
    kvm_worker_model wm;      /* model, tokenizer, model id, tokenizer id */
    kvm_tokenizer *tok_own;   /* a GGUF model's embedded tokenizer (when wm has none) */
    const kvm_tokenizer *tok; /* the tokenizer in use */
    kvm_store *store;
    kvm_store_id config_id; /* of cfg: the cache key's third part */
    int64_t ctx;            /* [model] context: documents are truncated to it */
    int64_t max_prompt, max_new;
    int compute_missing;
} decode_state;

static int setup(void *stp, const kvm_stage_args *a)
{
    decode_state *st = stp;
    if (!a->config)
        return kvm_err(KVM_EINVAL, "kvmill-decode needs --config FILE (the config the caches were made with)");
    int rc = kvm_config_load(a->config, &st->cfg);
    if (!rc && a->store) rc = kvm_config_set(st->cfg, "store", "path", a->store);
    if (rc) return rc;
    kvm_store_opts so = {.map_size_bytes = kvm_config_int(st->cfg, "store", "map_size_mb") << 20,
                         .map_max_bytes = kvm_config_int(st->cfg, "store", "map_max_mb") << 20};
    st->wm.override = a->model;
    if ((rc = kvm_store_open(kvm_config_str(st->cfg, "store", "path"), &so, &st->store)) ||
        (rc = kvm_worker_model_get(&st->wm, st->cfg, st->store)))
        return rc;
    st->tok = st->wm.tok;
    if (!st->tok && !strcmp(st->wm.model->format, "gguf")) {
        if ((rc = kvm_tokenizer_open_gguf(st->wm.path, &st->tok_own))) return rc;
        st->tok = st->tok_own;
    }
    if (!st->tok) return kvm_err(KVM_ENOTFOUND, "no tokenizer found for model %s ([model] tokenizer)", st->wm.path);
    st->ctx = kvm_config_int(st->cfg, "model", "context");
    if (st->ctx > st->wm.model->cfg.seq_len)
        return kvm_err(KVM_EINVAL, "%s: [model] context = %lld exceeds the model's window of %d tokens",
                       kvm_config_path(st->cfg), (long long)st->ctx, st->wm.model->cfg.seq_len);
    st->max_prompt = kvm_config_int(st->cfg, "serve", "max_prompt_tokens");
    st->max_new = kvm_config_int(st->cfg, "serve", "max_new_tokens");
    st->compute_missing = kvm_config_bool(st->cfg, "serve", "compute_missing");
    return kvm_jobcfg_config_id(st->cfg, &st->config_id, NULL, NULL);
}

/* An ask is one message; whatever it holds, work() answers it (an error answer when malformed). */
static int complete(void *st, kvm_msg *const *in, int n_in) { return 1; }

static uint64_t job_id(void *st, kvm_msg *const *in, int n_in)
{
    uint64_t id = 0;
    return n_in > 0 && kvm_serve_request_id(in[0], &id) ? id : 0;
}

/* The answer being built. */
typedef struct reply {
    int32_t *tokens; /* generated ids */
    int64_t n_tokens;
    char *text; /* their text */
    size_t text_len;
    double load_ms, prefill_ms, decode_ms;
} reply;

/* Prefills the document with a capture, compresses it with the config's method, stores it
 * (a failure to store is logged: the answer does not depend on it). *out gets room for
 * `extra` more entries per head. */
static int compute_cache(decode_state *st, const kvm_doc *d, int64_t extra, kvm_kvcache **out)
{
    const kvm_model *m = st->wm.model;
    kvm_capture *cap = NULL;
    kvm_forward *f = NULL;
    kvm_kvcache *full = NULL, *cc = NULL;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    int rc;
    if ((rc = kvm_capture_new(&m->cfg, d->n_tokens, &co, &cap)) || (rc = kvm_forward_new(m, NULL, d->n_tokens, &f)) ||
        (rc = kvm_forward_add_hooks(f, kvm_capture_hooks(cap))) ||
        (rc = kvm_forward_cache_new(m, d->n_tokens, &full)) ||
        (rc = kvm_forward_prefill(f, full, d->tokens, d->n_tokens, NULL, KVM_LOGITS_NONE)))
        goto done;
    kvm_compress_input ci = {.model = m,
                             .full = full,
                             .cap = cap,
                             .n_tokens = d->n_tokens,
                             .n_future = kvm_config_int(st->cfg, "compress", "future")};
    if ((rc = kvm_worker_compress(st->cfg, &ci, st->store, &st->wm.model_id, &cc))) goto done;
    if (kvm_serve_cache_store(st->store, st->cfg, &st->wm, d->tokens, d->n_tokens, cc))
        fprintf(stderr, "[decode] could not store the cache computed on demand: %s\n", kvm_errmsg());
    for (int l = 0; !rc && l < cc->n_layers; l++)
        for (int g = 0; !rc && g < cc->n_kv_heads; g++) {
            kvm_kv_head *h = kvm_kvcache_head(cc, l, g);
            rc = kvm_kvcache_reserve(h, cc->head_dim, h->n + extra);
        }
    cc->next_pos = (int32_t)d->n_tokens;
    if (!rc) *out = cc, cc = NULL;
done:
    kvm_kvcache_free(&cc);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
    kvm_capture_free(&cap);
    return rc;
}

/* The whole request: checks, cache, prompt prefill, generation. Errors carry the reason. */
static int answer(decode_state *st, const kvm_proto_ask *ask, reply *r)
{
    const kvm_model *m = st->wm.model;
    const kvm_model_config *mc = &m->cfg;
    kvm_doc d = {.name = NULL}; /* messages say "the document" */
    int32_t *prompt = NULL;
    int64_t n_prompt = 0, T = ask->max_new_tokens;
    kvm_kvcache *cache = NULL;
    kvm_forward *f = NULL;
    kvm_sampler *smp = NULL;
    float *logits = NULL;
    kvm_decode_policy *pol = NULL;
    int rc = 0;
    double t0 = kvm_now_ms();
    if (T > st->max_new) {
        rc = kvm_err(KVM_ERANGE, "max_new_tokens = %lld exceeds this server's limit of %lld ([serve] max_new_tokens)",
                     (long long)T, (long long)st->max_new);
        goto done;
    }
    if (ask->prompt.len == 0) {
        rc = kvm_err(KVM_EINVAL, "the prompt is empty: give at least one token to append to the document");
        goto done;
    }
    if (ask->n_doc_tokens > 0) {
        d.tokens = malloc((size_t)ask->n_doc_tokens * sizeof *d.tokens);
        if (!d.tokens) {
            rc = kvm_err(KVM_ENOMEM, "out of memory for %lld document tokens", (long long)ask->n_doc_tokens);
            goto done;
        }
        memcpy(d.tokens, ask->doc_tokens, (size_t)ask->n_doc_tokens * sizeof *d.tokens);
        d.n_tokens = ask->n_doc_tokens;
    } else {
        d.text = malloc(ask->doc_text.len + 1);
        if (!d.text) {
            rc = kvm_err(KVM_ENOMEM, "out of memory for the document text");
            goto done;
        }
        memcpy(d.text, ask->doc_text.ptr, ask->doc_text.len);
        d.text[ask->doc_text.len] = '\0';
        d.text_len = ask->doc_text.len;
    }
    if ((rc = kvm_doc_prepare(&d, st->tok, mc->vocab_size, mc->bos_id, st->ctx))) goto done;
    if ((rc = kvm_tokenizer_encode(st->tok, ask->prompt.ptr, ask->prompt.len, 0, 0, &prompt, &n_prompt))) goto done;
    if (n_prompt > st->max_prompt) {
        rc = kvm_err(KVM_ERANGE,
                     "the prompt has %lld tokens, more than this server's limit of %lld ([serve] max_prompt_tokens)",
                     (long long)n_prompt, (long long)st->max_prompt);
        goto done;
    }
    if (d.n_tokens + n_prompt + T > mc->seq_len) {
        rc = kvm_err(KVM_ERANGE,
                     "document (%lld tokens%s) + prompt (%lld) + new tokens (%lld) = %lld exceeds the model's "
                     "window of %d tokens",
                     (long long)d.n_tokens, d.truncated ? ", truncated to [model] context" : "", (long long)n_prompt,
                     (long long)T, (long long)(d.n_tokens + n_prompt + T), mc->seq_len);
        goto done;
    }
    kvm_store_cache_key key = {.model_id = st->wm.model_id, .doc_hash = d.hash, .config_id = st->config_id};
    int64_t n_stored = 0;
    rc = kvm_serve_cache_load(st->store, &key, &st->wm.tok_id, m, n_prompt + T, &cache, &n_stored);
    if (rc == KVM_ENOTFOUND && st->compute_missing) {
        rc = compute_cache(st, &d, n_prompt + T, &cache);
        n_stored = d.n_tokens;
    } else if (rc == KVM_ENOTFOUND) {
        char mh[KVM_STORE_ID_HEX + 1], dh[KVM_STORE_ID_HEX + 1], ch[KVM_STORE_ID_HEX + 1];
        rc = kvm_err(KVM_ENOTFOUND,
                     "no compressed cache for this document (%lld tokens, doc hash %.16s, model %.16s, "
                     "config %.16s): compress it first with kvmill run, or set [serve] compute_missing = true",
                     (long long)d.n_tokens, kvm_store_id_hex(&d.hash, dh), kvm_store_id_hex(&st->wm.model_id, mh),
                     kvm_store_id_hex(&st->config_id, ch));
    }
    if (rc) goto done;
    if (n_stored != d.n_tokens) {
        rc = kvm_err(KVM_ECORRUPT, "stored cache is for %lld tokens, the document has %lld", (long long)n_stored,
                     (long long)d.n_tokens);
        goto done;
    }
    double t1 = kvm_now_ms();
    r->load_ms = t1 - t0;
    logits = malloc((size_t)mc->vocab_size * sizeof *logits);
    r->tokens = malloc((size_t)(T > 0 ? T : 1) * sizeof *r->tokens);
    if (!logits || !r->tokens) {
        rc = kvm_err(KVM_ENOMEM, "out of memory");
        goto done;
    }
    uint64_t seed = ask->request_id ^ (uint64_t)time(NULL);
    /* the method's decode-phase policy keeps each KV head within its budget as the prompt
     * and the answer are appended (eviction patterns, PolyKV); sculpt methods have none */
    if ((rc = kvm_worker_policy_new(st->cfg, m, st->store, &st->wm.model_id, cache, &pol))) goto done;
    if ((rc = kvm_forward_new(m, NULL, n_prompt, &f)) ||
        (pol && (rc = kvm_forward_add_hooks(f, &pol->hooks))) ||
        (rc = kvm_sampler_new(mc->vocab_size, (float)ask->temperature, 0.0f, seed, &smp)) ||
        (rc = kvm_forward_prefill(f, cache, prompt, n_prompt, logits, KVM_LOGITS_LAST)))
        goto done;
    double t2 = kvm_now_ms();
    r->prefill_ms = t2 - t1;
    int stop_at_eos = !strcmp(m->format, "gguf");
    while (r->n_tokens < T) {
        int32_t next = kvm_sampler_sample(smp, logits);
        if (next == mc->bos_id || (stop_at_eos && next == mc->eos_id)) break;
        r->tokens[r->n_tokens++] = next;
        if (r->n_tokens == T) break;
        if ((rc = kvm_forward_decode(f, cache, next, logits))) goto done;
    }
    rc = kvm_tokenizer_decode(st->tok, r->tokens, r->n_tokens, &r->text, &r->text_len);
    r->decode_ms = kvm_now_ms() - t2;
done:
    free(logits);
    kvm_sampler_free(&smp);
    kvm_forward_free(&f);
    kvm_decode_policy_free(&pol);
    kvm_kvcache_free(&cache);
    free(prompt);
    free(d.text);
    free(d.tokens);
    return rc;
}

static int work(void *stp, kvm_msg *const *in, int n_in, kvm_stage_out *out, int *retryable)
{
    decode_state *st = stp;
    double t0 = kvm_now_ms();
    *retryable = 0;
    kvm_proto_ask ask;
    reply r = {0};
    uint64_t rid = 0;
    int rc = kvm_proto_ask_decode(in[0], &ask);
    if (rc)
        kvm_serve_request_id(in[0], &rid);
    else {
        rid = ask.request_id;
        rc = answer(st, &ask, &r);
    }
    if (rc)
        rc = kvm_serve_error_answer(rid, rc, kvm_errmsg(), &out->data[0]);
    else {
        kvm_proto_answer a = {.request_id = rid,
                              .status = 0,
                              .text = {r.text, r.text_len},
                              .n_tokens = r.n_tokens,
                              .tokens = r.tokens,
                              .load_ms = r.load_ms,
                              .prefill_ms = r.prefill_ms,
                              .decode_ms = r.decode_ms,
                              .total_ms = kvm_now_ms() - t0};
        rc = kvm_proto_answer_encode(&a, &out->data[0]);
    }
    if (!rc) out->n_data = 1;
    free(r.tokens);
    free(r.text);
    return rc;
}

static void teardown(void *stp)
{
    decode_state *st = stp;
    kvm_tokenizer_close(&st->tok_own);
    kvm_worker_model_free(&st->wm);
    kvm_store_close(&st->store);
    kvm_config_free(&st->cfg);
}

int main(int argc, char **argv)
{
    static decode_state st;
    kvm_stage_ops ops = {
        .stage = "decode", .setup = setup, .complete = complete, .job_id = job_id, .work = work, .teardown = teardown};
    return kvm_stage_main(argc, argv, &ops, &st);
}
