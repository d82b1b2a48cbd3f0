/* kvm_storesvc.c: the store service loop (kvm_storesvc.h). */
#include "pipeline/kvm_storesvc.h"
#include "common/kvm_signal.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_storesvc_claim.h"
#include "pipeline/kvm_storew.h"
#include "proto/kvm_proto.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

enum { SVC_MAX_UPLOADS = 256, SVC_ENV_BYTES = 256 };

/* One upload in progress: the client's routing id, the header, the layers received. */
typedef struct svc_upload {
    uint8_t env[SVC_ENV_BYTES];
    size_t env_len;   /* 0: slot free */
    kvm_msg *header;  /* the put_cache message (its strings borrow from it) */
    kvm_proto_put_cache pc;
    kvm_msg **layers; /* [pc.n_layers] */
    int64_t n_got, entries;
    int64_t started_ms;
} svc_upload;

typedef struct svc {
    kvm_store *store;    /* the caller's handle, replaced by svc_refresh_store */
    int gone;            /* the store is gone from its path, or could not be opened again */
    char gone_why[1200]; /* why, for the refusals */
    void *sock;
    FILE *log;
    kvm_storesvc_stats *st;
    kvm_storesvc_clients clients; /* the runs that claim through this service */
    int staying;                  /* asked to stop once, it serves on for their live claims */
    int64_t next_look_ms;         /* when to look at their claims again while staying */
    svc_upload up[SVC_MAX_UPLOADS];
} svc;

static int64_t svc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void svc_drop(svc_upload *u)
{
    for (int64_t l = 0; u->layers && l < u->pc.n_layers; l++)
        kvm_msg_free(&u->layers[l]);
    free(u->layers);
    kvm_msg_free(&u->header);
    memset(u, 0, sizeof *u);
}

/* Sends a store_reply (then, for a found cache, its layers) to the client env[0, n). */
/* A log line: "kvmill-store: ..." as text, or on stderr a JSON object when kvm_log is set
 * to JSON ([run] log_format). */
static void svc_log(const svc *s, kvm_log_level lv, const char *event, const kvm_log_field *f, int n, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static void svc_log(const svc *s, kvm_log_level lv, const char *event, const kvm_log_field *f, int n, const char *fmt, ...)
{
    if (!s->log) return;
    va_list ap;
    va_start(ap, fmt);
    if (s->log == stderr && kvm_log_format_get() == KVM_LOG_JSON) kvm_logv(lv, event, f, n, fmt, ap);
    else {
        fputs("kvmill-store: ", s->log);
        vfprintf(s->log, fmt, ap);
        fputc('\n', s->log);
    }
    va_end(ap);
}

/* Sends reply r to the client behind envelope env[0, n). Its message is made valid UTF-8 first
 * (kvm_proto_str_utf8): messages name store paths and cut kvm_errmsg texts, and one that did not
 * encode left the client without a reply until its timeout. */
static void svc_send_reply(svc *s, const uint8_t *env, size_t n, const kvm_proto_store_reply *in)
{
    char text[2048];
    char *msg = kvm_proto_str_dup(in->message); /* a str view, not NUL-terminated */
    kvm_proto_store_reply clean = *in, *r = &clean;
    clean.message = kvm_proto_str_utf8(msg ? msg : "", text, sizeof text);
    free(msg);
    uint64_t req = r->request_id;
    kvm_msg *m = NULL, *e = NULL;
    if (kvm_proto_store_reply_encode(r, &m) || kvm_msg_new(&e) || kvm_msg_add_copy(e, env, n) || kvm_msg_join(e, &m) ||
        kvm_msg_send(s->sock, &e, 0))
        svc_log(s, KVM_LOG_WARN, "reply_failed", NULL, 0, "could not reply to request %llu: %s", (unsigned long long)req,
                kvm_errmsg());
    kvm_msg_free(&m);
    kvm_msg_free(&e);
}

static void svc_reply(svc *s, const uint8_t *env, size_t n, uint64_t req, uint64_t job, int status, const char *why,
                      int64_t n_layers)
{
    kvm_proto_store_reply r = {.request_id = req, .job_id = job, .status = status < 0 ? status : 0,
                               .message = kvm_proto_str_c(why), .n_layers = status < 0 ? 0 : n_layers};
    svc_send_reply(s, env, n, &r);
}

static void svc_refuse(svc *s, svc_upload *u, int status, const char *why)
{
    kvm_log_field f[] = {KVM_LOG_I("request_id", u->pc.request_id), KVM_LOG_I("job_id", u->pc.job_id),
                         KVM_LOG_I("status", status), KVM_LOG_S("reason", why)};
    svc_log(s, KVM_LOG_WARN, "upload_refused", f, 4, "refused upload %llu (job %llu): %s", (unsigned long long)u->pc.request_id,
            (unsigned long long)u->pc.job_id, why);
    /* counted before the reply: a client that has the reply may read the counters at once */
    if (s->st) s->st->refused++;
    svc_reply(s, u->env, u->env_len, u->pc.request_id, u->pc.job_id, status, why, 0);
    svc_drop(u);
}

static svc_upload *svc_find(svc *s, const uint8_t *env, size_t n, int make)
{
    svc_upload *free_slot = NULL;
    for (int i = 0; i < SVC_MAX_UPLOADS; i++) {
        svc_upload *u = &s->up[i];
        if (u->env_len == n && !memcmp(u->env, env, n)) return u;
        if (!u->env_len && !free_slot) free_slot = u;
    }
    if (!make || !free_slot || n > SVC_ENV_BYTES || n == 0) return NULL;
    memcpy(free_slot->env, env, n);
    free_slot->env_len = n;
    return free_slot;
}

/* Commits a complete upload in one transaction, then records the document's name. */
static void svc_commit(svc *s, svc_upload *u)
{
    const kvm_proto_put_cache *p = &u->pc;
    if (s->gone) return svc_refuse(s, u, KVM_ESTATE, s->gone_why); /* never into a store no one sees */
    if (u->entries != p->n_entries) {
        char why[256];
        snprintf(why, sizeof why, "the layers hold %lld entries, the header says %lld", (long long)u->entries,
                 (long long)p->n_entries);
        return svc_refuse(s, u, KVM_EMISMATCH, why);
    }
    kvm_store_manifest man = {.n_layers = (int32_t)p->n_layers, .n_tokens = p->n_tokens, .n_entries = p->n_entries,
                              .full_bytes = p->full_bytes,
                              .config = {.data = p->config.ptr, .size = p->config.len}};
    snprintf(man.dtype, sizeof man.dtype, "%.*s", (int)p->dtype.len, p->dtype.ptr);
    memcpy(man.model_id.b, p->model_id, KVM_PROTO_ID_BYTES);
    memcpy(man.doc_hash.b, p->doc_hash, KVM_PROTO_ID_BYTES);
    memcpy(man.config_id.b, p->config_id, KVM_PROTO_ID_BYTES);
    memcpy(man.tokenizer_id.b, p->tokenizer_id, KVM_PROTO_ID_BYTES);
    kvm_store_layer *layers = calloc((size_t)p->n_layers, sizeof *layers);
    kvm_frame *frames = calloc((size_t)p->n_layers * 16, sizeof *frames);
    int rc = layers && frames ? 0 : kvm_err(KVM_ENOMEM, "out of memory committing a cache");
    for (int64_t l = 0; !rc && l < p->n_layers; l++) {
        size_t nf = kvm_msg_nframes(u->layers[l]);
        for (size_t f = 0; f < nf && f < 16; f++)
            frames[l * 16 + (int64_t)f] = kvm_msg_frame(u->layers[l], f);
        layers[l] = (kvm_store_layer){.frames = &frames[l * 16], .n_frames = (uint32_t)(nf < 16 ? nf : 16)};
    }
    if (!rc) rc = kvm_store_put_cache(s->store, &man, layers);
    free(layers);
    free(frames);
    if (rc) {
        char why[1024];
        snprintf(why, sizeof why, "store: %s", kvm_errmsg());
        return svc_refuse(s, u, rc, why);
    }
    if (p->doc_name.len) {
        kvm_store_doc_meta dm = {.n_tokens = p->n_tokens};
        kvm_store_doc_set_source(&dm, p->doc_name.ptr, p->doc_name.len);
        if (kvm_store_put_doc(s->store, &man.doc_hash, &dm))
            svc_log(s, KVM_LOG_WARN, "meta_failed", NULL, 0, "could not record the document's name: %s", kvm_errmsg());
    }
    if (s->st) s->st->committed++;
    kvm_log_field f[] = {KVM_LOG_I("request_id", p->request_id), KVM_LOG_I("job_id", p->job_id),
                         KVM_LOG_I("n_layers", p->n_layers), KVM_LOG_I("n_entries", p->n_entries)};
    svc_log(s, KVM_LOG_INFO, "commit", f, 4, "committed job %llu (%lld layers, %lld entries)", (unsigned long long)p->job_id,
            (long long)p->n_layers, (long long)p->n_entries);
    svc_reply(s, u->env, u->env_len, p->request_id, p->job_id, 0, "", 0);
    svc_drop(u);
}

/* Refuses layer c of upload u when a key or value is NaN or inf, with the rule the local
 * encoder applies (kvm_cachecodec_check_finite): committed, such a cache counted as stored
 * while every ask over it was refused as corrupt. The reason names the document (name and
 * hash), the layer, the KV head, the tensor and the entry. 1 when refused (u is dropped), 0. */
static int svc_refuse_nonfinite(svc *s, svc_upload *u, const kvm_proto_cache *c)
{
    if (!kvm_cachecodec_check_finite(c, "the uploading worker's model activations or compression overflowed, or the "
                                        "upload is damaged"))
        return 0;
    const kvm_proto_put_cache *p = &u->pc;
    kvm_store_id doc;
    char hex[KVM_STORE_ID_HEX + 1], why[1536];
    memcpy(doc.b, p->doc_hash, sizeof doc.b);
    kvm_store_id_hex(&doc, hex);
    snprintf(why, sizeof why, "document %.*s%s(doc_hash %.16s): %s",
             (int)(p->doc_name.len ? kvm_store_doc_source_len(p->doc_name.ptr, p->doc_name.len) : 0),
             p->doc_name.len ? p->doc_name.ptr : "", p->doc_name.len ? " " : "", hex, kvm_errmsg());
    svc_refuse(s, u, KVM_ERANGE, why);
    return 1;
}

/* One cache layer of an upload: its shape must be the header's, it must come in order, and its
 * keys and values must be finite. */
static void svc_layer(svc *s, svc_upload *u, kvm_msg **m)
{
    kvm_proto_cache c;
    char why[512];
    const kvm_proto_put_cache *p = &u->pc;
    int rc = kvm_proto_cache_decode(*m, &c);
    if (rc) {
        snprintf(why, sizeof why, "layer %lld: %s", (long long)u->n_got, kvm_errmsg());
        kvm_msg_free(m);
        return svc_refuse(s, u, rc, why);
    }
    const char *dn = kvm_proto_dtype_name(c.dtype);
    if (c.layer != u->n_got || c.n_layers != p->n_layers || c.n_kv_heads != p->n_kv_heads || c.head_dim != p->head_dim ||
        c.n_tokens != p->n_tokens || !kvm_proto_str_eq(p->dtype, dn)) {
        snprintf(why, sizeof why,
                 "cache message %lld (layer %lld of %lld, %lld KV heads x %lld, %lld tokens, %s) does not match the "
                 "upload (%lld layers, %lld KV heads x %lld, %lld tokens, %.*s)",
                 (long long)u->n_got, (long long)c.layer, (long long)c.n_layers, (long long)c.n_kv_heads,
                 (long long)c.head_dim, (long long)c.n_tokens, dn, (long long)p->n_layers, (long long)p->n_kv_heads,
                 (long long)p->head_dim, (long long)p->n_tokens, (int)p->dtype.len, p->dtype.ptr);
        kvm_msg_free(m);
        return svc_refuse(s, u, KVM_EMISMATCH, why);
    }
    if (svc_refuse_nonfinite(s, u, &c)) return kvm_msg_free(m);
    u->entries += c.n_entries;
    u->layers[u->n_got++] = *m;
    *m = NULL;
    if (u->n_got == p->n_layers) svc_commit(s, u);
}

/* The header of an upload; a previous unfinished upload of the client is refused first. */
static void svc_begin(svc *s, const uint8_t *env, size_t n, kvm_msg **m)
{
    svc_upload *u = svc_find(s, env, n, 1);
    if (!u) {
        svc_reply(s, env, n, 0, 0, KVM_EFULL, "too many uploads in progress", 0);
        return kvm_msg_free(m);
    }
    if (u->header) svc_refuse(s, u, KVM_EPROTO, "truncated upload: a new request came before its last layer");
    if (!u->env_len) memcpy(u->env, env, n), u->env_len = n;
    u->header = *m;
    *m = NULL;
    u->started_ms = svc_now_ms();
    int rc = kvm_proto_put_cache_decode(u->header, &u->pc);
    if (rc) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        return svc_refuse(s, u, rc, why);
    }
    /* a model the store knows: the upload's shape must be the model's */
    kvm_store_model_meta mm;
    kvm_store_id mid;
    memcpy(mid.b, u->pc.model_id, sizeof mid.b);
    if (kvm_store_get_model(s->store, &mid, &mm) == 0 &&
        (mm.n_layers != u->pc.n_layers || mm.n_kv_heads != u->pc.n_kv_heads || mm.head_dim != u->pc.head_dim)) {
        char why[256];
        snprintf(why, sizeof why, "the upload has %lld layers x %lld KV heads x %lld, the stored model %d x %d x %d",
                 (long long)u->pc.n_layers, (long long)u->pc.n_kv_heads, (long long)u->pc.head_dim, (int)mm.n_layers,
                 (int)mm.n_kv_heads, (int)mm.head_dim);
        return svc_refuse(s, u, KVM_EMISMATCH, why);
    }
    u->layers = calloc((size_t)u->pc.n_layers, sizeof *u->layers);
    if (!u->layers) svc_refuse(s, u, KVM_ENOMEM, "out of memory");
}

/* get_cache: the reply, then the stored layers as they were uploaded. */
static void svc_get(svc *s, const uint8_t *env, size_t n, const kvm_msg *m)
{
    kvm_proto_get_cache g;
    kvm_store_cache *c = NULL;
    char why[1024];
    int rc = kvm_proto_get_cache_decode(m, &g);
    if (!rc) {
        kvm_store_cache_key key;
        memcpy(key.model_id.b, g.model_id, sizeof key.model_id.b);
        memcpy(key.doc_hash.b, g.doc_hash, sizeof key.doc_hash.b);
        memcpy(key.config_id.b, g.config_id, sizeof key.config_id.b);
        rc = s->gone ? kvm_err(KVM_ESTATE, "%s", s->gone_why) : kvm_store_get_cache(s->store, &key, NULL, &c);
    }
    snprintf(why, sizeof why, "%s", rc ? kvm_errmsg() : "");
    svc_reply(s, env, n, g.request_id, 0, rc, why, rc ? 0 : c->manifest.n_layers);
    for (int l = 0; !rc && l < c->manifest.n_layers; l++) {
        kvm_msg *e = NULL;
        rc = kvm_msg_new(&e);
        if (!rc) rc = kvm_msg_add_copy(e, env, n);
        for (uint32_t f = 0; !rc && f < c->layers[l].n_frames; f++) {
            rc = kvm_msg_add_copy(e, c->layers[l].frames[f].data, c->layers[l].frames[f].size);
            if (s->st) s->st->bytes_out += (int64_t)c->layers[l].frames[f].size;
        }
        if (!rc) rc = kvm_msg_send(s->sock, &e, 0);
        kvm_msg_free(&e);
    }
    if (!rc && c && s->st) s->st->served++;
    kvm_store_cache_free(&c);
}

/* get_strategy (revision 5): the strategy record stored under (model id, name), read-only, in
 * the reply; none stored is KVM_ENOTFOUND naming both, so the remote worker's error says what
 * to calibrate. */
static void svc_get_strategy(svc *s, const uint8_t *env, size_t n, const kvm_msg *m)
{
    kvm_proto_get_strategy g;
    uint8_t *buf = NULL;
    size_t len = 0;
    char why[1600], name[KVM_PROTO_MAX_NAME_BYTES + 1];
    int rc = kvm_proto_get_strategy_decode(m, &g);
    if (!rc) {
        kvm_store_id mid;
        char hex[KVM_STORE_ID_HEX + 1];
        memcpy(mid.b, g.model_id, sizeof mid.b);
        snprintf(name, sizeof name, "%.*s", (int)g.name.len, g.name.ptr);
        rc =
            s->gone ? kvm_err(KVM_ESTATE, "%s", s->gone_why) : kvm_store_get_strategy(s->store, &mid, name, &buf, &len);
        if (rc == KVM_ENOTFOUND)
            snprintf(why, sizeof why, "no PolyKV strategy '%s' is stored for model %s: run kvmill calibrate on the store's host first",
                     name, kvm_store_id_hex(&mid, hex));
        else if (rc)
            snprintf(why, sizeof why, "strategy '%s' of model %s: %s", name, kvm_store_id_hex(&mid, hex), kvm_errmsg());
    } else
        snprintf(why, sizeof why, "%s", kvm_errmsg());
    kvm_proto_store_reply r = {.request_id = g.request_id, /* 0 when it did not decode */
                               .status = rc < 0 ? rc : 0,
                               .message = kvm_proto_str_c(rc ? why : ""), .strategy = {buf, rc ? 0 : len}};
    if (rc) {
        kvm_log_field f[] = {KVM_LOG_I("status", rc), KVM_LOG_S("reason", why)};
        svc_log(s, KVM_LOG_WARN, "strategy_refused", f, 2, "get_strategy refused: %s", why);
    }
    if (!rc && s->st) s->st->strategies++; /* before the reply: a client reading it sees the count */
    svc_send_reply(s, env, n, &r);
    free(buf);
}

/* A run that took or renewed claims here is a client the service stays up for (svc_stop_now);
 * one that released them (its end) is one no more. */
static void svc_note_client(svc *s, kvm_proto_type t, const kvm_proto_claim *c, const kvm_proto_renew_claims *rn,
                            const kvm_storesvc_claim_out *out, int64_t n_claims)
{
    char owner[KVM_PROTO_MAX_NAME_BYTES + 1];
    if (t == KVM_PROTO_CLAIM && !c->probe && !strcmp(out->state, "taken")) {
        snprintf(owner, sizeof owner, "%.*s", (int)c->owner.len, c->owner.ptr);
        kvm_storesvc_clients_note(&s->clients, owner);
    } else if (t == KVM_PROTO_RENEW_CLAIMS) {
        snprintf(owner, sizeof owner, "%.*s", (int)rn->owner.len, rn->owner.ptr);
        if (rn->release)
            kvm_storesvc_clients_forget(&s->clients, owner);
        else if (n_claims > 0)
            kvm_storesvc_clients_note(&s->clients, owner);
    }
}

/* claim and renew_claims (revision 6): a run on another host takes, probes, renews and
 * releases its claims here; the answer is one store_reply (claim outcome, holder, n_claims),
 * (revision 12: the holder's expiry), a malformed request or a store error a refusal naming
 * why, the claims unchanged. */
static void svc_claim(svc *s, const uint8_t *env, size_t n, const kvm_msg *m, kvm_proto_type t)
{
    kvm_proto_claim c;
    kvm_proto_renew_claims rn;
    kvm_storesvc_claim_out out = {0};
    kvm_proto_store_reply r = {0};
    char why[1200];
    int rc = t == KVM_PROTO_CLAIM ? kvm_proto_claim_decode(m, &c) : kvm_proto_renew_claims_decode(m, &rn);
    const char *where = ""; /* the decoder's messages name the type already */
    uint64_t req = 0;       /* 0 while the request did not decode */
    if (!rc) {
        req = t == KVM_PROTO_CLAIM ? c.request_id : rn.request_id;
        where = t == KVM_PROTO_CLAIM ? "claim: store: " : "renew_claims: store: ";
        rc = s->gone                ? kvm_err(KVM_ESTATE, "%s", s->gone_why)
             : t == KVM_PROTO_CLAIM ? kvm_storesvc_claim(s->store, &c, &out)
                                    : kvm_storesvc_renew(s->store, &rn, &r.n_claims);
    }
    if (!rc) {
        r.request_id = req;
        svc_note_client(s, t, &c, &rn, &out, r.n_claims);
        if (t == KVM_PROTO_CLAIM) {
            r.claim = kvm_proto_str_c(out.state);
            if (!strcmp(out.state, "held"))
                r.holder = kvm_proto_str_c(out.holder.owner), r.holder_host = kvm_proto_str_c(out.holder.host),
                r.holder_expires_ms = out.holder.expires_unix_ms > 0 ? out.holder.expires_unix_ms : 0;
            r.full_bytes = out.full_bytes, r.stored_bytes = out.stored_bytes;
        }
        if (s->st) s->st->claims++;
        return svc_send_reply(s, env, n, &r);
    }
    snprintf(why, sizeof why, "%s%s", where, kvm_errmsg());
    kvm_log_field f[] = {KVM_LOG_I("status", rc), KVM_LOG_S("reason", why)};
    svc_log(s, KVM_LOG_WARN, "claim_refused", f, 2, "%s", why);
    svc_reply(s, env, n, req, 0, rc, why, 0);
}

/* A message kvm_serve_recv_routed refused unread (too many parts; kvm_errmsg says so): its
 * sender, behind env (taken), gets a refusal for request 0 and the reason. */
static void svc_refuse_unread(svc *s, kvm_msg *env)
{
    char why[512];
    snprintf(why, sizeof why, "%s", kvm_errmsg());
    kvm_frame id = kvm_msg_frame(env, 0);
    if (id.size > 0 && id.size <= SVC_ENV_BYTES) svc_reply(s, id.data, id.size, 0, 0, KVM_EPROTO, why, 0);
    kvm_msg_free(&env);
}

/* One message: its routing id (env) and the rest (m); takes both. */
static void svc_one(svc *s, kvm_msg *env, kvm_msg *m)
{
    kvm_frame id = kvm_msg_frame(env, 0);
    if (kvm_msg_nframes(m) == 0) goto done; /* a routing id alone carries no request to answer */
    if (id.size == 0 || id.size > SVC_ENV_BYTES) goto done;
    for (size_t f = 0; s->st && f < kvm_msg_nframes(m); f++)
        s->st->bytes_in += (int64_t)kvm_msg_frame(m, f).size;
    kvm_proto_type t;
    int rc = kvm_proto_peek(m, &t);
    svc_upload *u = svc_find(s, id.data, id.size, 0);
    if (!rc && t == KVM_PROTO_CACHE && u && u->header) {
        svc_layer(s, u, &m);
        goto done;
    }
    if (u && u->header) svc_refuse(s, u, KVM_EPROTO, "truncated upload: a new request came before its last layer");
    if (rc) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        svc_reply(s, id.data, id.size, 0, 0, rc, why, 0);
    } else if (t == KVM_PROTO_PUT_CACHE)
        svc_begin(s, id.data, id.size, &m);
    else if (t == KVM_PROTO_GET_CACHE)
        svc_get(s, id.data, id.size, m);
    else if (t == KVM_PROTO_GET_STRATEGY)
        svc_get_strategy(s, id.data, id.size, m);
    else if (t == KVM_PROTO_CLAIM || t == KVM_PROTO_RENEW_CLAIMS)
        svc_claim(s, id.data, id.size, m, t);
    else {
        char why[128];
        snprintf(why, sizeof why, "the store service does not take %s messages", kvm_proto_type_name(t));
        svc_reply(s, id.data, id.size, 0, 0, KVM_EPROTO, why, 0);
    }
done:
    kvm_msg_free(&m);
    kvm_msg_free(&env);
}

static long svc_parent_pid;         /* kvm_storesvc_main's parent_pid: the loop stops when it is gone */
static int svc_stay;                /* started by a run or serve: a first stop waits for the clients' claims */
static kvm_serve_ipc_file *svc_ipc; /* kvm_storesvc_main's ipc socket file, noted again after a rebind */

/* The store at the service's path followed (kvm_store_follow): a compacted copy moved in its place
 * is opened again (commits went into the folder moved away); a store gone from the path (moved or
 * removed, for more than a second) makes the service refuse what comes (s->gone) rather than commit
 * caches into a store no one else sees, acknowledged as stored; said once per change. */
static void svc_refresh_store(svc *s, kvm_store **owner)
{
    int reopened = 0;
    int rc = kvm_store_follow(owner, s->gone ? 0 : 1000, &reopened); /* the second only while a swap may be under way */
    s->store = *owner;
    if (reopened)
        kvm_log(KVM_LOG_WARN, "store_reopened", NULL, 0,
                "the store %s was replaced since this service opened it (a compacted copy moved in its place?): "
                "opened again",
                kvm_store_path(s->store));
    if (rc && !s->gone)
        kvm_log(KVM_LOG_ERROR, "store_gone", NULL, 0, "%s: refusing every request meanwhile", kvm_errmsg());
    if (!rc && s->gone)
        kvm_log(KVM_LOG_INFO, "store_back", NULL, 0, "the store %s is there again", kvm_store_path(s->store));
    s->gone = rc != 0;
    if (rc) snprintf(s->gone_why, sizeof s->gone_why, "%s", kvm_errmsg());
}

/* Whether the service stops, asked `asked` times (*stop). Started by a run or kvmill serve
 * (--parent-pid), asked once, it serves on while runs that claimed through it hold live claims:
 * they store their documents through it, and its parent said they would (a run leaves such
 * documents to them); it stops once they are released (their runs ended) or lapse (their runs
 * died), or at a second request. Looked at every 200 ms; said once each way. */
static int svc_stop_now(svc *s, sig_atomic_t asked)
{
    if (!svc_stay || s->gone) return 1;
    int64_t now = svc_now_ms();
    if (asked < 2 && s->staying && now < s->next_look_ms) return 0;
    s->next_look_ms = now + 200;
    int64_t n = 0;
    int runs = 0;
    char desc[1200];
    if (kvm_storesvc_clients_live(s->store, &s->clients, &n, &runs, desc, sizeof desc)) {
        svc_log(s, KVM_LOG_WARN, "claims_unread", NULL, 0, "cannot read the claims of its clients: stopping: %s",
                kvm_errmsg());
        return 1;
    }
    kvm_log_field f[] = {KVM_LOG_I("claims", n), KVM_LOG_I("runs", runs), KVM_LOG_S("holders", desc)};
    if (n > 0 && asked >= 2) {
        svc_log(s, KVM_LOG_WARN, "stopped_under_claims", f, 3,
                "a second stop request: stopping now, under %lld live claim%s of %s (they find the store down)",
                (long long)n, n == 1 ? "" : "s", desc);
        return 1;
    }
    if (n == 0) {
        if (s->staying)
            svc_log(s, KVM_LOG_INFO, "clients_done", NULL, 0,
                    "the claims it stayed up for were released or lapsed: stopping");
        return 1;
    }
    if (!s->staying)
        svc_log(s, KVM_LOG_WARN, "staying_up", f, 3,
                "stays up for %s until their claims are released or lapse: asked to stop while %lld live claim%s of "
                "%d other run%s store through it; a second stop request (SIGTERM, Ctrl-C) stops it now",
                desc, (long long)n, n == 1 ? "" : "s", runs, runs == 1 ? "" : "s");
    s->staying = 1;
    return 0;
}

int kvm_storesvc_loop(kvm_store **store, void *sock, int64_t upload_timeout_ms, const volatile sig_atomic_t *stop,
                      kvm_storesvc_stats *stats, FILE *log)
{
    svc *s = calloc(1, sizeof *s);
    if (!s) return kvm_err(KVM_ENOMEM, "store service: out of memory");
    *s = (svc){.store = *store, .sock = sock, .log = log, .st = stats};
    int rc = 0;
    char ep[1100] = "";
    size_t epn = sizeof ep - 1;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, ep, &epn)) ep[0] = '\0';
    time_t next_look = 0;
    while (!(stop && *stop && svc_stop_now(s, *stop))) {
        if (svc_parent_pid > 0 && getppid() != (pid_t)svc_parent_pid) { /* reparented: the parent died */
            kvm_log(KVM_LOG_WARN, "parent_gone", NULL, 0,
                    "the process that started this service (pid %ld) is gone: stopping", svc_parent_pid);
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if (*ep && ts.tv_sec >= next_look) { /* its ipc:// socket file removed: bound again (kvm_serve.h) */
            next_look = ts.tv_sec + 1;
            if (kvm_serve_rebind_if_removed(sock, ep, "store service") && svc_ipc)
                kvm_serve_ipc_note(ep, svc_ipc); /* its new file, removed at the stop as the first was */
        }
        zmq_pollitem_t it = {.socket = sock, .events = ZMQ_POLLIN};
        int pr = zmq_poll(&it, 1, 200);
        if (pr < 0 && errno != EINTR) {
            rc = errno == ETERM ? 0 : kvm_err(KVM_EIO, "store service: poll: %s", zmq_strerror(errno));
            break;
        }
        for (int k = 0; pr > 0 && k < 64; k++) {
            kvm_msg *env = NULL, *m = NULL;
            const int r = kvm_serve_recv_routed(sock, ZMQ_DONTWAIT, &env, &m);
            if (r == KVM_EPROTO) /* too many parts, drained: refused, as the malformed are, not dropped unanswered */
                svc_refuse_unread(s, env);
            else if (r)
                break;
            else {
                /* per message, not per poll: a request sent just after the store came back (or went)
                 * may arrive within the same batch */
                svc_refresh_store(s, store);
                svc_one(s, env, m);
            }
        }
        int64_t now = svc_now_ms();
        for (int i = 0; i < SVC_MAX_UPLOADS; i++)
            if (s->up[i].header && now - s->up[i].started_ms > upload_timeout_ms)
                svc_refuse(s, &s->up[i], KVM_EPROTO, "truncated upload: its layers did not arrive in time");
    }
    for (int i = 0; i < SVC_MAX_UPLOADS; i++)
        svc_drop(&s->up[i]);
    free(s);
    return rc;
}

static volatile sig_atomic_t svc_stop;
static void svc_on_signal(int sig) { (void)sig, svc_stop = svc_stop < 2 ? svc_stop + 1 : 2; } /* requests so far */

int kvm_storesvc_main(const kvm_config *cfg, const char *path, const char *endpoint, int create, long parent_pid)
{
    svc_parent_pid = parent_pid;
    svc_stay = parent_pid > 0;
    kvm_store *store = NULL;
    void *zctx = NULL, *sock = NULL;
    kvm_serve_ipc_file ipc;
    memset(&ipc, 0, sizeof ipc);
    int status = 2;
    if (kvm_log_setup("store", "kvmill-store: ", cfg ? kvm_config_str(cfg, "run", "log_format") : NULL))
        return fprintf(stderr, "kvmill-store: %s\n", kvm_errmsg()), 2;
    kvm_store_opts so;
    kvm_storew_opts(cfg, 0, &so);
    so.must_exist = !create; /* a mistyped path would take uploads into a store no run reads */
    const char *sp = path ? path : kvm_config_str(cfg, "store", "path");
    if (kvm_serve_remote_is_endpoint(sp)) { /* was "no such directory: give --create", which then failed too */
        kvm_log(KVM_LOG_ERROR, "open_failed", NULL, 0,
                "store %s is a store service endpoint: the store service opens the LMDB directory itself, so give "
                "--store (or [store] path) the store's directory on this host",
                sp);
        return 2;
    }
    int orc = kvm_store_open(sp, &so, &store);
    if (orc == KVM_ENOTFOUND) {
        kvm_log(KVM_LOG_ERROR, "open_failed", NULL, 0,
                "%s: give --create to start the service on a new, empty store there", kvm_errmsg());
        return 2;
    }
    if (orc) {
        kvm_log(KVM_LOG_ERROR, "open_failed", NULL, 0, "%s", kvm_errmsg());
        return 2;
    }
    zctx = zmq_ctx_new();
    sock = zctx ? zmq_socket(zctx, ZMQ_ROUTER) : NULL;
    int linger = 0;
    if (!sock || zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger)) {
        kvm_log(KVM_LOG_ERROR, "message", NULL, 0, "cannot make a socket: %s", zmq_strerror(errno));
        goto done;
    }
    int brc = kvm_serve_bind(zctx, sock, endpoint, cfg, 1, "--bind");
    if (brc) {
        kvm_log(KVM_LOG_ERROR, "message", NULL, 0, "%s", kvm_errmsg());
        status = brc == KVM_EIO ? 1 : 2; /* an endpoint in use is the host's state, as for kvmill serve */
        goto done;
    }
    char bound[1100];
    kvm_serve_bound_endpoint(sock, endpoint, bound, sizeof bound);
    kvm_serve_ipc_note(endpoint, &ipc);
    svc_ipc = &ipc;
    struct sigaction sa = {.sa_handler = svc_on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    kvm_signal_hup(svc_on_signal, NULL); /* a closed terminal or a daemon's hang-up: as SIGTERM */
    printf("kvmill-store: ready on %s\n", bound);
    fflush(stdout);
    kvm_storesvc_stats st = {0};
    int rc = kvm_storesvc_loop(&store, sock, kvm_config_int(cfg, "store", "upload_timeout_ms"), &svc_stop, &st, stderr);
    kvm_log_field f[] = {KVM_LOG_I("committed", st.committed), KVM_LOG_I("refused", st.refused),
                         KVM_LOG_I("served", st.served), KVM_LOG_I("bytes_in", st.bytes_in), KVM_LOG_I("bytes_out", st.bytes_out)};
    kvm_log(KVM_LOG_INFO, "stopped", f, 5, "stopped: %lld committed, %lld refused, %lld served", (long long)st.committed,
            (long long)st.refused, (long long)st.served);
    status = rc ? 1 : 0;
done:
    if (sock) zmq_close(sock);
    kvm_curve_ctx_term(zctx); /* joins the ZAP handler too: no thread outlives the return */
    svc_ipc = NULL;
    kvm_serve_ipc_remove(&ipc); /* its ipc:// socket file, when still its own */
    kvm_store_close(&store);
    return status;
}
