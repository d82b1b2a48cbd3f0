/* decode.c: the kvmill-decode stage (a serving worker of kvmill serve): for an `ask` it
 * tokenises and hashes the document exactly as `kvmill run` does (or finds a stored one by
 * hash or name), loads the document's compressed cache from the store (or compresses it on
 * demand with [serve] compute_missing, when the broker granted it), appends the prompt in one
 * batched prefill, generates up to max_new_tokens (greedy, or at the request's temperature)
 * and answers with the text (valid UTF-8: model/kvm_utf8.h), the token ids and timings.
 * Every refusal (limits, context window, missing cache) is an error `answer`, so the client
 * always learns why. With --device cuda:N ([serve] devices) the prompt and the answer run on
 * that GPU's forward over the stored cache, uploaded as it is (float32, ragged, distilled
 * entries and β; weights by [model] weight_dtype: bf16/f16, else float32); that needs a method
 * without a decode-phase policy (full, the sculpt family) and [model] kv_dtype = f32, else the
 * worker is refused at start. */
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "model/kvm_capture.h"
#include "model/kvm_forward.h"
#include "model/kvm_sampler.h"
#include "model/kvm_utf8.h"
#include "pipeline/kvm_chatcfg.h"
#include "pipeline/kvm_corpus.h"
#include "pipeline/kvm_devmodel.h"
#include "pipeline/kvm_doctok.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_serve_cache.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_storew.h"
#include "pipeline/kvm_worker.h"
#include "compress/sculpt/kvm_sculpt.h"
#ifdef KVM_WITH_CUDA
#include "model/kvm_forward_cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct decode_state {
    kvm_config *cfg;          /* --config, with --store applied */
    kvm_worker_model wm;      /* model, tokenizer, model id, tokenizer id */
    kvm_tokenizer *tok_own;   /* a GGUF model's embedded tokenizer (when wm has none) */
    const kvm_tokenizer *tok; /* the tokenizer in use */
    kvm_store *store;         /* the LMDB store, on the store's host */
    int store_gone;           /* the last ask found it gone from its path (kvm_store_follow) */
    kvm_storecli *svc;      /* or the store service on another host ([store] service / --store tcp://) */
    uint8_t *strategy;      /* with svc and polykv: the strategy record fetched for the current ask */
    size_t strategy_len;
    kvm_store_id config_id; /* of cfg: the cache key's third part */
    kvm_store_id settings_id; /* of cfg without a PolyKV strategy: ready names it (has_settings) */
    int has_settings;
    kvm_store_id place;     /* of the LMDB store: ready names it (store_id), made again at each ready */
    int64_t ctx;            /* [model] context: documents are truncated to it */
    int64_t max_prompt, max_new;
    int compute_missing;
    int64_t max_new_caches, max_new_caches_per_key; /* for messages; the broker enforces them */
    int keyed;                                      /* the front end authenticates client keys */
    char *chat_open, *chat_close; /* [model] chat: before each document / after each prompt; NULL: none */
    kvm_kv_dtype kv_dtype;                          /* [model] kv_dtype: the cache while decoding */
    int said_name_scan;                             /* the name index was found incomplete (said once) */
#ifdef KVM_WITH_CUDA
    kvm_cuda_model *dm; /* --device cuda:N: the device forward every ask runs on */
#endif
} decode_state;

/* kvm_stage_ops.device_refusal: what of --config keeps this worker off a device — a method
 * whose cache a decode-phase policy keeps within budget through the host forward's hooks
 * (eviction patterns, PolyKV), or a 16-bit host cache ([model] kv_dtype) — else NULL. */
static const char *device_refusal(const kvm_stage_args *a)
{
    static char why[512];
    kvm_config *c = NULL;
    if (!a->config || kvm_config_load(a->config, &c)) {
        kvm_config_free(&c);
        return NULL; /* setup reports the config's own error */
    }
    const char *method = kvm_config_str(c, "compress", "method"), *kvd = kvm_config_str(c, "model", "kv_dtype");
    kvm_sculpt_mode mode;
    why[0] = '\0';
    if (strcmp(method, "full") && kvm_sculpt_mode_parse(method, &mode))
        snprintf(why, sizeof why, "the decode stage on a device serves caches of full and the sculpt family; [compress] "
                 "method %s keeps its cache within budget with a decode-phase policy over the host forward's hooks",
                 method);
    else if (strcmp(kvd, "f32"))
        snprintf(why, sizeof why, "the decode stage on a device keeps the cache float32 there; [model] kv_dtype = %s "
                 "is a host cache", kvd);
    kvm_config_free(&c);
    return why[0] ? why : NULL;
}

static int setup(void *stp, const kvm_stage_args *a)
{
    decode_state *st = stp;
    if (!a->config)
        return kvm_err(KVM_EINVAL, "kvmill-decode needs --config FILE (the config the caches were made with)");
    int rc = kvm_config_load(a->config, &st->cfg);
    const char *svc = rc ? NULL : kvm_serve_remote_endpoint(a->store, st->cfg);
    if (!rc && a->store && !svc) rc = kvm_config_set(st->cfg, "store", "path", a->store);
    if (rc) return rc;
    st->wm.override = a->model;
    st->wm.pinned = 1; /* its config's model, loaded here, answers every request: ready names it */
    kvm_storecli_keys keys = kvm_storecli_keys_of(st->cfg, a->server_key, a->client_public, a->client_secret);
    kvm_store_opts so;
    kvm_storew_worker_opts(st->cfg, 0, &so); /* kvmill serve records its cap, not its workers */
    /* as kvmill serve: a store that does not exist is refused unless this worker may compress
     * documents into a new one (a mistyped --store would answer every ask "no cache") */
    so.must_exist = !kvm_config_bool(st->cfg, "serve", "compute_missing");
    /* a worker that only reads opens a store it may not write (a read-only mount, a copy
     * owned by someone else) read-only: it then records no access times for the cap's LRU
     * order, which is all it would have written */
    char ro_why[4400];
    if (!svc && so.must_exist &&
        kvm_store_unwritable(kvm_config_str(st->cfg, "store", "path"), ro_why, sizeof ro_why)) {
        kvm_storew_opts(st->cfg, 1, &so);
        kvm_log(KVM_LOG_INFO, "store_read_only", NULL, 0,
                "%s: serving it read-only (no access times recorded for the cap's LRU order)", ro_why);
    }
    if ((rc = svc ? kvm_storecli_open(&keys, svc, &st->svc)
                  : kvm_store_open(kvm_config_str(st->cfg, "store", "path"), &so, &st->store)) ||
        (rc = kvm_worker_model_get(&st->wm, st->cfg, st->store)))
        return rc;
    if (st->store && !so.read_only) kvm_storew_cap_note(st->store, st->cfg);
    if (st->store && kvm_store_lock_note(st->store))
        kvm_log(KVM_LOG_WARN, "store_no_lock", NULL, 0, "%s: reading without LMDB's reader lock",
                kvm_store_lock_note(st->store));
    st->tok = st->wm.tok;
    if (!st->tok && !strcmp(st->wm.model->format, "gguf")) {
        if ((rc = kvm_tokenizer_open_gguf(st->wm.path, &st->tok_own))) return rc;
        st->tok = st->tok_own;
    }
    if (!st->tok) return kvm_err(KVM_ENOTFOUND, "no tokenizer found for model %s ([model] tokenizer)", st->wm.path);
    if ((rc = kvm_chatcfg_frame(st->cfg, st->tok, &st->chat_open, &st->chat_close))) return rc;
    if ((rc = kvm_kvcache_dtype_parse(kvm_config_str(st->cfg, "model", "kv_dtype"), &st->kv_dtype)))
        return kvm_err(rc, "%s: [model] %s", kvm_config_path(st->cfg), kvm_errmsg());
    if (st->kv_dtype != KVM_KV_F32)
        kvm_log(KVM_LOG_INFO, "kv_dtype", NULL, 0, "caches stay %s in memory while decoding ([model] kv_dtype)",
                kvm_kvcache_dtype_name(st->kv_dtype));
    st->ctx = kvm_config_int(st->cfg, "model", "context");
    if (st->ctx > st->wm.model->cfg.seq_len)
        return kvm_err(KVM_EINVAL, "%s: [model] context = %lld exceeds the model's window of %d tokens",
                       kvm_config_path(st->cfg), (long long)st->ctx, st->wm.model->cfg.seq_len);
    st->max_prompt = kvm_config_int(st->cfg, "serve", "max_prompt_tokens");
    st->max_new = kvm_config_int(st->cfg, "serve", "max_new_tokens");
    st->compute_missing = kvm_config_bool(st->cfg, "serve", "compute_missing");
    st->max_new_caches = kvm_config_int(st->cfg, "serve", "max_new_caches");
    st->max_new_caches_per_key = kvm_config_int(st->cfg, "serve", "max_new_caches_per_key");
    st->keyed = !kvm_curve_is_local(kvm_config_str(st->cfg, "serve", "bind")) ||
                *kvm_config_str(st->cfg, "security", "server_secret_key");
    rc = kvm_jobcfg_check(st->cfg);
    if (!rc && !(rc = kvm_jobcfg_config_id(st->cfg, NULL, &st->settings_id, NULL, NULL))) st->has_settings = 1;
#ifdef KVM_WITH_CUDA
    int cuda = -1;
    if (!rc) rc = kvm_device_parse(a->device, &cuda);
    if (!rc && cuda >= 0) { /* the whole window on the device, prompts in one batch */
        const kvm_cuda_wdtype t = (kvm_cuda_wdtype)kvm_devmodel_wdtype(st->cfg); /* [model] weight_dtype */
        rc = kvm_model_cuda_new(st->wm.model, cuda, t, st->wm.model->cfg.seq_len, st->max_prompt, &st->dm);
        if (!rc)
            kvm_log(KVM_LOG_INFO, "decode_device", NULL, 0,
                    "prompts and answers on cuda:%d (%s weights, the stored cache uploaded per ask)", cuda,
                    t == KVM_CUDA_F32 ? "float32" : t == KVM_CUDA_BF16 ? "bf16" : "f16");
    }
#endif
    if (!rc && (!st->svc || strcmp(kvm_config_str(st->cfg, "compress", "method"), "polykv")))
        rc = kvm_jobcfg_config_id_in(st->cfg, st->store, &st->wm.model_id, &st->config_id, NULL, NULL);
    return rc == KVM_ENOTFOUND ? 0 : rc; /* polykv before calibration (or remote): each ask looks again */
}

/* The config id for this ask, made again each time: a recalibrated strategy changes it, and
 * old caches must not answer. On the store's host the strategy is read from the store; a
 * worker on another host fetches it from the store service (get_strategy, a few KB per ask)
 * and keeps the bytes for the ask's decode policy and an on-demand compression, so all three
 * use the strategy the id names. Errors: KVM_ENOTFOUND (no strategy stored: the message
 * names the model id and the strategy), the service's or the store's. */
static int ask_config_id(decode_state *st)
{
    if (!st->svc || strcmp(kvm_config_str(st->cfg, "compress", "method"), "polykv"))
        return kvm_jobcfg_config_id_in(st->cfg, st->store, &st->wm.model_id, &st->config_id, NULL, NULL);
    free(st->strategy);
    st->strategy = NULL, st->strategy_len = 0;
    int rc = kvm_serve_remote_strategy(st->svc, st->cfg, &st->wm.model_id, &st->strategy, &st->strategy_len);
    if (rc) return rc;
    return kvm_jobcfg_config_id_with(st->cfg, st->strategy, st->strategy_len, &st->config_id, NULL, NULL);
}

/* Whether m is an ask: the one request a decode worker answers. */
static int is_ask(const kvm_msg *m)
{
    kvm_proto_type t;
    return kvm_proto_peek(m, &t) == 0 && t == KVM_PROTO_ASK;
}

/* An ask is one message; whatever it holds, work() answers it (an error answer when malformed).
 * Any other message is no request and gets no answer: answering one (a store service's reply)
 * drew a reply to the answer, answered again, forever. It is dropped, with the stage's
 * rate-limited line, and no result (job_id gives it none). */
static int complete(void *st, kvm_msg *const *in, int n_in)
{
    kvm_proto_type t;
    int rc = kvm_proto_peek(in[0], &t);
    if (rc) return rc;
    if (t != KVM_PROTO_ASK)
        return kvm_err(KVM_EPROTO, "a '%s' message is not a request (an ask): not answered", kvm_proto_type_name(t));
    return 1;
}

static uint64_t job_id(void *st, kvm_msg *const *in, int n_in)
{
    uint64_t id = 0;
    return n_in > 0 && is_ask(in[0]) && kvm_serve_request_id(in[0], &id) ? id : 0;
}

/* The answer being built. */
typedef struct reply {
    int32_t *tokens; /* generated ids */
    int64_t n_tokens;
    char *text; /* their text, valid UTF-8 */
    size_t text_len;
    double load_ms, prefill_ms, decode_ms;
    int new_cache; /* the document's cache was computed and stored for this answer */
    int computed;  /* its computation was tried for this answer (stored or not: new_cache says) */
} reply;

/* The stored cache under key, from the LMDB store or the store service. */
static int load_cache(decode_state *st, const kvm_store_cache_key *key, int64_t extra, kvm_kvcache **out, int64_t *n)
{
    if (st->svc) return kvm_serve_remote_load(st->svc, st->cfg, key, st->wm.model, extra, out, n);
    return kvm_serve_cache_load(st->store, key, &st->wm.tok_id, st->wm.model, extra, out, n);
}

/* Where a document has no cache under this server's config id: the config ids it is stored
 * under for this model (a server started with other settings than the run that made the
 * caches, a [store] dtype = f16 say), as a clause for the "no compressed cache" error, or ""
 * (none, or a remote store, which has no such lookup). Without it the error said only to
 * compress the document again, and compute_missing would store a second cache of it. */
static const char *other_configs(decode_state *st, const kvm_store_cache_key *key, char *buf, size_t size)
{
    kvm_store_id ids[4];
    int n = 0, kept = 0;
    buf[0] = '\0';
    if (st->svc || !st->store || kvm_store_doc_configs(st->store, &key->model_id, &key->doc_hash, ids, 4, &n))
        return buf;
    for (int i = 0; i < n && i < 4; i++) /* a cache stored under this config since the load failed is no other */
        if (memcmp(&ids[i], &key->config_id, sizeof ids[i])) ids[kept++] = ids[i];
    n -= (n < 4 ? n : 4) - kept;
    if (n <= 0) return buf;
    size_t len = (size_t)snprintf(buf, size, "; the store holds it under %s config%s", n == 1 ? "another" : "other",
                                  n == 1 ? "" : "s");
    for (int i = 0; i < n && i < 3 && len < size; i++) {
        char h[KVM_STORE_ID_HEX + 1];
        len += (size_t)snprintf(buf + len, size - len, "%s%.16s", i ? ", " : " ", kvm_store_id_hex(&ids[i], h));
    }
    if (len < size && n > 3) len += (size_t)snprintf(buf + len, size - len, " and %d more", n - 3);
    char mh[KVM_STORE_ID_HEX + 1], dh[KVM_STORE_ID_HEX + 1], ch[KVM_STORE_ID_HEX + 1];
    /* with polykv the likeliest cause is a strategy calibrated since the cache was made: the
     * same config then names other caches, and "serve with the config that made it" misled */
    const int polykv = !strcmp(kvm_config_str(st->cfg, "compress", "method"), "polykv");
    if (len < size)
        snprintf(buf + len, size - len,
                 " (made with other settings: [compress], [store] dtype, [run] wire_dtype, [model] context or chat, or "
                 "another kvmill algorithm version%s): %s (kvmill store show %.12s:%.12s:%.12s)",
                 polykv ? "; or, with method polykv, with the strategy stored before `kvmill calibrate` stored the one "
                          "used now: `kvmill store ls --config FILE` lists such caches as stale-strategy"
                        : "",
                 polykv ? "compress the document again with kvmill run (stale-strategy), or serve with the config "
                          "that made it"
                        : "serve with the config that made it",
                 kvm_store_id_hex(&key->model_id, mh), kvm_store_id_hex(&key->doc_hash, dh),
                 kvm_store_id_hex(&ids[0], ch));
    return buf;
}

/* Prefills the document with a capture, compresses it with the config's method, stores it
 * (a failure to store is logged: the answer does not depend on it; *stored says whether it
 * was). *out gets room for `extra` more entries per head. */
static int compute_cache(decode_state *st, const kvm_doc *d, int64_t extra, kvm_kvcache **out, int *stored)
{
    *stored = 0;
    const kvm_model *m = st->wm.model;
    kvm_capture *cap = NULL;
    kvm_forward *f = NULL;
    kvm_kvcache *full = NULL, *cc = NULL;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    int32_t *rp = NULL; /* the repeat prompt (query_source repeat), as the compress stage's */
    int64_t n_rp = 0;
    int rc;
    if ((rc = kvm_worker_repeat_prompt(st->cfg, &st->wm, &rp, &n_rp)) ||
        (rc = kvm_capture_new(&m->cfg, d->n_tokens, &co, &cap)) || (rc = kvm_forward_new(m, NULL, d->n_tokens, &f)) ||
        (rc = kvm_forward_add_hooks(f, kvm_capture_hooks(cap))) ||
        (rc = kvm_forward_cache_new(m, d->n_tokens, &full)) ||
        (rc = kvm_forward_prefill(f, full, d->tokens, d->n_tokens, NULL, KVM_LOGITS_NONE)))
        goto done;
    kvm_compress_input ci = {.model = m,
                             .full = full,
                             .cap = cap,
                             .n_tokens = d->n_tokens,
                             .tokens = d->tokens,
                             .n_future = kvm_config_int(st->cfg, "compress", "future"),
                             .repeat_prompt = rp,
                             .n_repeat_prompt = n_rp};
    if ((rc = st->svc ? kvm_worker_compress_with(st->cfg, &ci, st->strategy, st->strategy_len, &cc)
                      : kvm_worker_compress(st->cfg, &ci, st->store, &st->wm.model_id, &cc)))
        goto done;
    if (st->svc ? kvm_serve_remote_store(st->svc, st->cfg, &st->wm, d->tokens, d->n_tokens, cc, st->strategy,
                                         st->strategy_len, 0, NULL, NULL)
                : kvm_serve_cache_store(st->store, st->cfg, &st->wm, d->tokens, d->n_tokens, cc, NULL))
        kvm_log(KVM_LOG_WARN, "store_failed", NULL, 0, "could not store the cache computed on demand: %s", kvm_errmsg());
    else
        *stored = 1;
    for (int l = 0; !rc && l < cc->n_layers; l++)
        for (int g = 0; !rc && g < cc->n_kv_heads; g++) {
            kvm_kv_head *h = kvm_kvcache_head(cc, l, g);
            rc = kvm_kvcache_reserve(h, cc->head_dim, h->n + extra);
        }
    cc->next_pos = (int32_t)d->n_tokens;
    if (!rc) *out = cc, cc = NULL;
done:
    free(rp);
    kvm_kvcache_free(&cc);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
    kvm_capture_free(&cap);
    return rc;
}

/* The error for a --doc-name whose only caches for this server's model and config are corrupt
 * (n of them; key and why: the first): the corruption, as --doc and --doc-hash report it,
 * naming the cache, rather than "no stored document named ...", which sent the user looking for
 * a name that is there. */
static int corrupt_named(const char *name, const kvm_store_cache_key *key, int n, const char *why)
{
    char mh[KVM_STORE_ID_HEX + 1], dh[KVM_STORE_ID_HEX + 1], ch[KVM_STORE_ID_HEX + 1];
    kvm_store_id_hex(&key->model_id, mh);
    kvm_store_id_hex(&key->doc_hash, dh);
    kvm_store_id_hex(&key->config_id, ch);
    return kvm_err(KVM_ECORRUPT,
                   "the stored document named '%s' has a corrupt cache for this server's model and config%s: %s "
                   "(kvmill store verify checks the store; kvmill store rm %.12s:%.12s:%.12s removes that cache, and "
                   "the document is compressed again by the next kvmill run)",
                   name, n > 1 ? " (as have its other matches)" : "", why, mh, dh, ch);
}

/* The document an ask names with doc_hash or doc_name, as its hash. A name must match
 * exactly one document that has a cache for this server's model and config (and tokenizer).
 * The store's name index finds the documents of that name (kvm_store_find_docs); a store
 * whose index is not complete (written by an older build) is scanned instead, said once. */
static int resolve_stored(decode_state *st, const kvm_proto_ask *ask, kvm_store_id *hash)
{
    if (ask->has_doc_hash) {
        memcpy(hash->b, ask->doc_hash, sizeof hash->b);
        return 0;
    }
    if (st->svc)
        return kvm_err(KVM_ENOTSUP, "this decode worker reads caches from a store service: name documents by hash "
                                    "(--doc-hash) or send them (--doc)");
    char name[KVM_PROTO_MAX_NAME_BYTES + 1];
    snprintf(name, sizeof name, "%.*s", (int)ask->doc_name.len, ask->doc_name.ptr);
    kvm_store_doc_match *docs = NULL;
    int64_t n = 0, found = 0;
    int scanned = 0, missed = 0, corrupt = 0;
    kvm_store_cache_key miss = {.model_id = st->wm.model_id, .config_id = st->config_id};
    kvm_store_cache_key bad = miss; /* the first corrupt cache of the name */
    char bad_why[1024] = "";
    /* sources are stored as their first 255 bytes, cut at a character: a longer name is matched by those */
    int rc = kvm_store_find_docs(st->store, name, ask->doc_name.len, &docs, &n, &scanned);
    if (scanned && !st->said_name_scan) {
        st->said_name_scan = 1;
        kvm_log(KVM_LOG_WARN, "name_index_incomplete", NULL, 0,
                "the store's document-name index is incomplete (documents written by an older kvmill): --doc-name "
                "reads every stored document until a process of this build opens the store for writing (a decode "
                "worker starting, kvmill run) and rebuilds the index");
    }
    char list[2048] = "";
    size_t o = 0;
    for (int64_t i = 0; !rc && i < n; i++) {
        kvm_store_cache_key key = {.model_id = st->wm.model_id, .doc_hash = docs[i].doc_hash, .config_id = st->config_id};
        int has = 0;
        int hrc = kvm_store_has_cache(st->store, &key, &st->wm.tok_id, &has);
        if (hrc == KVM_ESTATE || hrc == KVM_EIO || hrc == KVM_ENOMEM || hrc == KVM_EBUSY) rc = hrc; /* not "no cache" */
        if (!hrc && !has && !missed++) miss.doc_hash = docs[i].doc_hash; /* stored under another config? */
        if (hrc == KVM_ECORRUPT && !corrupt++) {                         /* said when no other matches */
            bad.doc_hash = docs[i].doc_hash;
            snprintf(bad_why, sizeof bad_why, "%s", kvm_errmsg());
        }
        if (hrc || !has) continue; /* no cache, or one of another tokenizer, or a corrupt one */
        if (found++ == 0) *hash = docs[i].doc_hash;
        char h[KVM_STORE_ID_HEX + 1];
        if (o < sizeof list - 1)
            o += (size_t)snprintf(list + o, sizeof list - o, "%s%s (%s, %lld tokens)", found > 1 ? "; " : "",
                                  kvm_store_id_hex(&docs[i].doc_hash, h), docs[i].meta.source,
                                  (long long)docs[i].meta.n_tokens);
    }
    free(docs);
    if (rc) return rc;
    char mh[KVM_STORE_ID_HEX + 1], ch[KVM_STORE_ID_HEX + 1], hint[512] = "";
    if (found == 0 && corrupt) return corrupt_named(name, &bad, corrupt, bad_why);
    if (found == 0) {
        /* names are stored without the folder: a path given as a name matches nothing, say so */
        const char *slash = strrchr(name, '/');
        char path_note[400] = "";
        if (slash && slash[1])
            snprintf(path_note, sizeof path_note, "; '%s' is a path: the name is the file name alone, '%s'", name,
                     slash + 1);
        /* plain `store ls` lists caches by hash only; --names lists the names */
        return kvm_err(KVM_ENOTFOUND,
                       "no stored document named '%s' has a cache for this server's model %.16s and config %.16s "
                       "(names are the corpus file names or JSONL ids kvmill run stored: kvmill store ls --names "
                       "lists them%s)%s",
                       name, kvm_store_id_hex(&st->wm.model_id, mh), kvm_store_id_hex(&st->config_id, ch), path_note,
                       missed ? other_configs(st, &miss, hint, sizeof hint) : "");
    }
    if (found > 1)
        return kvm_err(KVM_EINVAL, "the name '%s' matches %lld stored documents: %s; name one with --doc-hash", name,
                       (long long)found, list);
    return 0;
}

/* The ask's prompt as ids, followed by the chat frame's close text when [model] chat is on
 * (tokenised as one string, as the chat template renders it). A prompt that is not UTF-8 comes
 * as prompt_bytes (revision 7) and is tokenised as those bytes, as kvmill generate does. */
static int encode_prompt(const decode_state *st, const kvm_proto_ask *ask, int32_t **ids, int64_t *n)
{
    const char *p = ask->prompt_bytes.len ? (const char *)ask->prompt_bytes.ptr : ask->prompt.ptr;
    size_t len = ask->prompt_bytes.len ? ask->prompt_bytes.len : ask->prompt.len;
    if (!st->chat_close) return kvm_tokenizer_encode(st->tok, p, len, 0, 0, ids, n);
    size_t lc = strlen(st->chat_close);
    char *s = malloc(len + lc + 1);
    if (!s) return kvm_err(KVM_ENOMEM, "out of memory for the prompt");
    memcpy(s, p, len);
    memcpy(s + len, st->chat_close, lc + 1);
    int rc = kvm_tokenizer_encode(st->tok, s, len + lc, 0, 0, ids, n);
    free(s);
    return rc;
}

/* Tokenises, truncates and hashes the ask's document d as kvmill run does (under the chat frame
 * when [model] chat is on). A document kvmill serve cut to fit [serve] max_message_bytes
 * (doc_size: its whole length) is only its beginning: enough when that settles the ids the
 * cache is made of ([model] context: the same ids, so the same hash, as the whole document's),
 * else an error (KVM_ERANGE) naming the document's bytes, the bytes received, their tokens and
 * the limits. Errors: those of kvm_doc_prepare_n. */
static int prepare_doc(const decode_state *st, const kvm_proto_ask *ask, kvm_doc *d)
{
    const kvm_model_config *mc = &st->wm.model->cfg;
    if (ask->doc_size == 0 || !d->text)
        return kvm_doc_prepare_n(d, st->tok, mc->vocab_size, mc->bos_id, st->chat_open, st->ctx, st->ctx);
    int more = 0;
    int rc = kvm_doc_prepare_begin(d, st->tok, mc->vocab_size, mc->bos_id, st->chat_open, st->ctx, st->ctx, &more);
    if (rc || !more) return rc;
    int32_t *ids = NULL; /* the beginning's tokens, for the message */
    int64_t n = 0;
    if ((rc = kvm_tokenizer_encode(st->tok, d->text, d->text_len, 1, 0, &ids, &n))) return rc;
    free(ids);
    return kvm_err(KVM_ERANGE,
                   "the document is %lld bytes, more than this server's [serve] max_message_bytes takes: its first "
                   "%zu bytes came (%lld tokens, BOS included), and fixing the first %lld tokens ([model] context) "
                   "its cache is made of takes a longer beginning (up to %zu bytes: room after them for the "
                   "tokenizer's merges); ask about it by name or hash once kvmill run stored it (kvmill ask "
                   "--doc-name, --doc-hash), or raise [serve] max_message_bytes",
                   (long long)ask->doc_size, d->text_len, (long long)n, (long long)st->ctx,
                   kvm_doctok_begin_bytes(st->ctx + 1));
}

/* One forward call of the ask: the prompt (a batched prefill) or one generated token, logits
 * of the last into logits; on the device forward when the worker has one. */
static int step(decode_state *st, kvm_forward *f, kvm_kvcache *cache, const int32_t *tok, int64_t n, int prompt,
                float *logits)
{
#ifdef KVM_WITH_CUDA
    if (st->dm) return kvm_cuda_model_forward(st->dm, tok, n, logits, 1, NULL);
#else
    (void)st;
#endif
    return prompt ? kvm_forward_prefill(f, cache, tok, n, logits, KVM_LOGITS_LAST) : kvm_forward_decode(f, cache, tok[0], logits);
}

/* The whole request: checks, cache, prompt prefill, generation. Errors carry the reason. */
/* A store replaced since this worker opened it (a compacted copy moved in its place, README)
 * is opened again before the ask reads it: the old handle would go on answering from the file
 * that was moved away, missing every cache stored since and serving removed ones (and storing
 * computed ones there), while a respawned worker of the same server answered from the new one.
 * A store gone from the path (for more than a second: a swap's renames) fails the ask, naming
 * why; so does a new store that cannot be opened; the next ask looks again. */
static int refresh_store(decode_state *st)
{
    int reopened = 0;
    /* the second's wait (a swap's renames) only when the store was there at the last ask: while it
     * stays gone every ask would wait it, and the queue behind drain one per second */
    int rc = st->store ? kvm_store_follow(&st->store, st->store_gone ? 0 : 1000, &reopened) : 0;
    st->store_gone = rc == KVM_ESTATE;
    if (reopened)
        kvm_log(KVM_LOG_WARN, "store_reopened", NULL, 0,
                "the store %s was replaced since this worker opened it (a compacted copy moved in its place?): "
                "opened again",
                kvm_store_path(st->store));
    return rc;
}

static int answer(decode_state *st, const kvm_proto_ask *ask, reply *r)
{
    const kvm_model *m = st->wm.model;
    const kvm_model_config *mc = &m->cfg;
    kvm_doc d = {.name = "of the ask"};
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
    if (ask->prompt.len == 0 && ask->prompt_bytes.len == 0) {
        rc = kvm_err(KVM_EINVAL, "the prompt is empty: give at least one token to append to the document");
        goto done;
    }
    if ((rc = refresh_store(st))) goto done;
    int by_key = ask->has_doc_hash || ask->doc_name.len > 0; /* a stored document, named */
    if (by_key) {
        /* nothing to tokenise: the stored cache says how long the document is */
    } else if (ask->n_doc_tokens > 0) {
        d.tokens = malloc((size_t)ask->n_doc_tokens * sizeof *d.tokens);
        if (!d.tokens) {
            rc = kvm_err(KVM_ENOMEM, "out of memory for %lld document tokens", (long long)ask->n_doc_tokens);
            goto done;
        }
        memcpy(d.tokens, ask->doc_tokens, (size_t)ask->n_doc_tokens * sizeof *d.tokens);
        d.n_tokens = ask->n_doc_tokens;
    } else {
        /* text or the file's bytes: tokenised alike (kvmill run reads files as bytes) */
        const char *src = ask->doc_bytes.len ? (const char *)ask->doc_bytes.ptr : ask->doc_text.ptr;
        size_t len = ask->doc_bytes.len ? ask->doc_bytes.len : ask->doc_text.len;
        d.text = malloc(len + 1);
        if (!d.text) {
            rc = kvm_err(KVM_ENOMEM, "out of memory for the document text");
            goto done;
        }
        memcpy(d.text, src, len);
        d.text[len] = '\0';
        d.text_len = len;
    }
    /* [model] chat: the document opens the user's turn as kvmill run framed it; the prompt is
     * closed with the end of the turn and the assistant marker (pipeline/kvm_chatcfg.h) */
    if (!by_key && (rc = prepare_doc(st, ask, &d))) goto done;
    if ((rc = encode_prompt(st, ask, &prompt, &n_prompt))) goto done;
    if (n_prompt > st->max_prompt) {
        rc = kvm_err(KVM_ERANGE,
                     "the prompt has %lld tokens, more than this server's limit of %lld ([serve] max_prompt_tokens)",
                     (long long)n_prompt, (long long)st->max_prompt);
        goto done;
    }
    if ((rc = ask_config_id(st))) goto done;
    kvm_store_cache_key key = {.model_id = st->wm.model_id, .doc_hash = d.hash, .config_id = st->config_id};
    int64_t n_stored = 0;
    char mh[KVM_STORE_ID_HEX + 1], dh[KVM_STORE_ID_HEX + 1], ch[KVM_STORE_ID_HEX + 1], hint[1200];
    if (by_key) {
        if ((rc = resolve_stored(st, ask, &key.doc_hash))) goto done;
        d.hash = key.doc_hash;
        rc = load_cache(st, &key, n_prompt + T, &cache, &n_stored);
        if (rc == KVM_ENOTFOUND)
            rc = kvm_err(KVM_ENOTFOUND,
                         "no compressed cache for document %.16s with this server's model %.16s and config %.16s "
                         "(kvmill store ls --csv lists the stored document hashes)%s",
                         kvm_store_id_hex(&key.doc_hash, dh), kvm_store_id_hex(&st->wm.model_id, mh),
                         kvm_store_id_hex(&st->config_id, ch), other_configs(st, &key, hint, sizeof hint));
        if (rc) goto done;
        d.n_tokens = n_stored;
    }
    if (d.n_tokens + n_prompt + T > mc->seq_len) {
        rc = kvm_err(KVM_ERANGE,
                     "document (%lld tokens%s) + prompt (%lld) + new tokens (%lld) = %lld exceeds the model's "
                     "window of %d tokens",
                     (long long)d.n_tokens, d.truncated ? ", truncated to [model] context" : "", (long long)n_prompt,
                     (long long)T, (long long)(d.n_tokens + n_prompt + T), mc->seq_len);
        goto done;
    }
    if (!by_key) {
        rc = load_cache(st, &key, n_prompt + T, &cache, &n_stored);
        if (rc == KVM_ENOTFOUND && st->compute_missing && ask->compute_grant) {
            r->computed = 1;
            rc = compute_cache(st, &d, n_prompt + T, &cache, &r->new_cache);
            n_stored = d.n_tokens;
        } else if (rc == KVM_ENOTFOUND && st->compute_missing) {
            char per_key[128] = "";
            if (st->keyed)
                snprintf(per_key, sizeof per_key, " and max_new_caches_per_key = %lld per client key",
                         (long long)st->max_new_caches_per_key);
            rc = kvm_err(KVM_ENOTFOUND,
                         "no compressed cache for this document (%lld tokens, doc hash %.16s, model %.16s, config "
                         "%.16s), and this server adds no more caches now: [serve] compute_missing is bounded by "
                         "max_new_caches = %lld per server run%s (counting caches being computed); compress it with "
                         "kvmill run",
                         (long long)d.n_tokens, kvm_store_id_hex(&d.hash, dh), kvm_store_id_hex(&st->wm.model_id, mh),
                         kvm_store_id_hex(&st->config_id, ch), (long long)st->max_new_caches, per_key);
        } else if (rc == KVM_ENOTFOUND) {
            rc = kvm_err(KVM_ENOTFOUND,
                         "no compressed cache for this document (%lld tokens, doc hash %.16s, model %.16s, "
                         "config %.16s): compress it first with kvmill run, or set [serve] compute_missing = true%s",
                         (long long)d.n_tokens, kvm_store_id_hex(&d.hash, dh), kvm_store_id_hex(&st->wm.model_id, mh),
                         kvm_store_id_hex(&st->config_id, ch), other_configs(st, &key, hint, sizeof hint));
        }
        if (rc) goto done;
    }
    if (n_stored != d.n_tokens) {
        rc = kvm_err(KVM_ECORRUPT, "stored cache is for %lld tokens, the document has %lld", (long long)n_stored,
                     (long long)d.n_tokens);
        goto done;
    }
    /* [model] kv_dtype = f16: loaded (or just computed and stored) in float32, the cache stays
     * 16-bit in memory while the prompt and the answer are decoded; f16 stored entries come
     * back bit for bit */
    if ((rc = kvm_kvcache_convert(cache, st->kv_dtype))) goto done;
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
    if ((rc = st->svc ? kvm_worker_policy_with(st->cfg, m, st->strategy, st->strategy_len, cache, &pol)
                      : kvm_worker_policy_new(st->cfg, m, st->store, &st->wm.model_id, cache, &pol)))
        goto done;
#ifdef KVM_WITH_CUDA
    /* the stored cache onto the device as it is (device workers have no policy: device_refusal) */
    if (st->dm && (rc = kvm_kvcache_cuda_upload(st->dm, cache))) goto done;
    if (!st->dm)
#endif
        if ((rc = kvm_forward_new(m, NULL, n_prompt, &f)) || (pol && (rc = kvm_forward_add_hooks(f, &pol->hooks))))
            goto done;
    if ((rc = kvm_sampler_new(mc->vocab_size, (float)ask->temperature, 0.0f, seed, &smp)) ||
        (rc = step(st, f, cache, prompt, n_prompt, 1, logits)))
        goto done;
    double t2 = kvm_now_ms();
    r->prefill_ms = t2 - t1;
    int stop_at_eos = !strcmp(m->format, "gguf") || !strcmp(m->format, "hf");
    while (r->n_tokens < T) {
        int32_t next = kvm_sampler_sample(smp, logits);
        if (next == mc->bos_id || (stop_at_eos && kvm_model_is_eos(mc, next))) break;
        r->tokens[r->n_tokens++] = next;
        if (r->n_tokens == T) break;
        if ((rc = step(st, f, cache, &next, 1, 0, logits))) goto done;
    }
    /* the pieces' bytes, then text that is valid UTF-8: a character split over tokens joins,
     * bytes that never form one (byte fallback, a cut-off end) and NUL become U+FFFD; the
     * exact ids go in the answer's tokens */
    char *raw = NULL;
    size_t raw_len = 0;
    if ((rc = kvm_tokenizer_decode(st->tok, r->tokens, r->n_tokens, &raw, &raw_len)) ||
        (rc = kvm_utf8_sanitize(raw, raw_len, &r->text, &r->text_len, NULL))) {
        free(raw);
        goto done;
    }
    free(raw);
    r->text_len = kvm_utf8_cut(r->text, r->text_len, KVM_PROTO_MAX_TEXT_BYTES); /* the answer's limit */
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
    if (rc) {
        /* the detail may quote bytes of the request: as valid UTF-8, within the field's limit */
        char *why = NULL;
        size_t n = 0;
        const char *msg = kvm_errmsg();
        int status = rc < -KVM_PROTO_MAX_STATUS ? KVM_EINVAL : rc;
        if ((rc = kvm_utf8_sanitize(msg, strlen(msg), &why, &n, NULL)) == 0) {
            kvm_proto_answer e = {.request_id = rid,
                                  .status = status,
                                  .message = {why, kvm_utf8_cut(why, n, KVM_PROTO_MAX_MESSAGE_BYTES)},
                                  .new_cache = r.new_cache != 0,
                                  .computed = r.computed != 0};
            rc = kvm_proto_answer_encode(&e, &out->data[0]);
        }
        free(why);
    } else {
        kvm_proto_answer a = {.request_id = rid,
                              .status = 0,
                              .text = {r.text, r.text_len},
                              .n_tokens = r.n_tokens,
                              .tokens = r.tokens,
                              .load_ms = r.load_ms,
                              .prefill_ms = r.prefill_ms,
                              .decode_ms = r.decode_ms,
                              .total_ms = kvm_now_ms() - t0,
                              .new_cache = r.new_cache != 0,
                              .computed = r.computed != 0};
        rc = kvm_proto_answer_encode(&a, &out->data[0]);
    }
    if (!rc) out->n_data = 1;
    free(r.tokens);
    free(r.text);
    return rc;
}

/* The stage's model for ready (kvm_stage_ops.model_id): loaded at setup. */
static const uint8_t *model_id(void *stp) { return kvm_worker_model_id(&((decode_state *)stp)->wm); }

/* The stage's settings for ready (kvm_stage_ops.settings_id): a server of other settings
 * refuses this worker. */
static const uint8_t *settings_id(void *stp)
{
    const decode_state *st = stp;
    return st->has_settings ? st->settings_id.b : NULL;
}

/* The place of the LMDB store for ready (kvm_stage_ops.store_id), made again each time (a stat):
 * a store swapped in under its path is the place the worker reads now, as the server sees it. A
 * store service's is not known here: NULL, not compared. */
static const uint8_t *store_place(void *stp)
{
    decode_state *st = stp;
    if (st->svc || !st->store) return NULL;
    return kvm_store_place_id(kvm_store_path(st->store), &st->place) == 0 ? st->place.b : NULL;
}

static void teardown(void *stp)
{
    decode_state *st = stp;
#ifdef KVM_WITH_CUDA
    kvm_cuda_model_free(&st->dm);
#endif
    free(st->chat_open);
    free(st->chat_close);
    kvm_tokenizer_close(&st->tok_own);
    kvm_worker_model_free(&st->wm);
    kvm_store_close(&st->store);
    kvm_storecli_close(&st->svc);
    free(st->strategy);
    kvm_config_free(&st->cfg);
}

int main(int argc, char **argv)
{
    static decode_state st;
    kvm_stage_ops ops = {.stage = "decode",
                         .setup = setup,
                         .complete = complete,
                         .job_id = job_id,
                         .work = work,
                         .teardown = teardown,
                         .device_refusal = device_refusal,
                         .model_id = model_id,
                         .settings_id = settings_id,
                         .store_id = store_place};
    return kvm_stage_main(argc, argv, &ops, &st);
}
