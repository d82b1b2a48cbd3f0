/* kvm_serve_grant.c: the serving broker's [serve] compute_missing allowance: how many new
 * caches a run (max_new_caches) and each client key (max_new_caches_per_key) may add, counting
 * the grants held by requests in flight. */
#include "pipeline/kvm_serve_int.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "store/kvm_store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- [serve] compute_missing allowance: max_new_caches per run, max_new_caches_per_key ---- */

/* Index of the client entry for key (created when absent), or -1 without a key / memory. */
static int client_slot(srv *s, const char *key)
{
    if (!key || !*key) return -1;
    for (int i = 0; i < s->n_clients; i++)
        if (!strcmp(s->clients[i].key, key)) return i;
    if (s->n_clients == s->cap_clients) {
        int cap = s->cap_clients ? 2 * s->cap_clients : 8;
        srv_client *c = realloc(s->clients, (size_t)cap * sizeof *c);
        if (!c) return -1;
        s->clients = c;
        s->cap_clients = cap;
    }
    srv_client *c = &s->clients[s->n_clients];
    memset(c, 0, sizeof *c);
    snprintf(c->key, sizeof c->key, "%s", key);
    return s->n_clients++;
}

/* Whether a request from `key` may add a cache: the run's allowance, and the key's when the
 * front end authenticates clients, each counting the grants in flight. On yes, one grant is
 * held for it (released by grant_done) and *client is its client entry. */
static int grant_take(srv *s, const char *key, int *client)
{
    *client = -1;
    if (!s->compute_missing || s->new_made + s->new_out >= s->max_new) return 0;
    if (s->front_curve) {
        int c = client_slot(s, key);
        if (c < 0) return 0; /* a keyed front end without a key: not expected; refuse */
        if (s->clients[c].made + s->clients[c].out >= s->max_new_per_key) return 0;
        s->clients[c].out++;
        *client = c;
    }
    s->new_out++;
    return 1;
}

/* The request that held worker wk's grant ended; new_cache: it added a cache. */
void kvm_serve__grant_done(srv *s, srv_worker *wk, int new_cache)
{
    if (!wk->grant) return;
    wk->grant = 0;
    s->new_out--;
    srv_client *c = wk->grant_client >= 0 ? &s->clients[wk->grant_client] : NULL;
    if (c) c->out--;
    if (!new_cache) return;
    s->new_made++;
    if (c) c->made++;
    if (c)
        kvm_serve__log("request %llu added a cache: %lld of [serve] max_new_caches = %lld this run, %lld of "
                       "max_new_caches_per_key = %lld for client key %.8s...",
                       (unsigned long long)wk->request_id, (long long)s->new_made, (long long)s->max_new,
                       (long long)c->made, (long long)s->max_new_per_key, c->key);
    else
        kvm_serve__log("request %llu added a cache: %lld of [serve] max_new_caches = %lld this run",
                       (unsigned long long)wk->request_id, (long long)s->new_made, (long long)s->max_new);
    if (c && c->made >= s->max_new_per_key)
        kvm_serve__log(
            "client key %.8s... has added its [serve] max_new_caches_per_key = %lld caches: its missing caches "
            "are refused from now on",
            c->key, (long long)s->max_new_per_key);
    if (s->new_made >= s->max_new && !s->new_full_logged) {
        s->new_full_logged = 1;
        kvm_serve__log(
            "[serve] max_new_caches = %lld caches added: missing caches are refused from now on (compress them "
            "with kvmill run)",
            (long long)s->max_new);
    }
}

/* Gives back a grant taken for a request that never reached a worker. */
void kvm_serve__grant_release_unused(srv *s, int client)
{
    s->new_out--;
    if (client >= 0) s->clients[client].out--;
}

/* Sets the request's compute_grant field (re-encoding the ask) to whether it may add a cache;
 * the client's own value never passes. *grant = 1 when a grant is held for it. */
int kvm_serve__with_grant(srv *s, srv_request *r, int *grant, int *client)
{
    kvm_proto_ask ask;
    *grant = 0;
    *client = -1;
    int rc = kvm_proto_ask_decode(r->msg, &ask); /* decoded fine on arrival */
    if (rc) return rc;
    if (!s->compute_missing && !ask.compute_grant) return 0; /* nothing to grant, nothing to overwrite */
    /* a stored document named by hash or name is never computed: no grant to hold */
    /* nor is one whose document a request answered before it stored */
    if (!ask.has_doc_hash && ask.doc_name.len == 0 && r->released != SRV_RELEASED_STORED)
        *grant = grant_take(s, r->key, client);
    ask.compute_grant = *grant != 0;
    kvm_msg *m = NULL;
    if ((rc = kvm_proto_ask_encode(&ask, &m))) return rc;
    kvm_msg_free(&r->msg);
    r->msg = m;
    return 0;
}

/* ---- one computation per document: a request waits while its document is being computed ---- */

void kvm_serve__doc_key(const srv *s, const kvm_proto_ask *ask, srv_doc_key *out)
{
    kvm_store_id id;
    memset(out, 0, sizeof *out);
    if (!s->compute_missing) return; /* no grants, so no computation to wait for */
    if (ask->doc_bytes.len || ask->doc_text.len) {
        /* text and bytes are tokenised alike (stages/decode.c): one key for both */
        int b = ask->doc_bytes.len > 0;
        kvm_store_hash_bytes(b ? (const void *)ask->doc_bytes.ptr : ask->doc_text.ptr,
                             b ? ask->doc_bytes.len : ask->doc_text.len, &id);
        out->kind = SRV_DOC_TEXT;
    } else if (ask->n_doc_tokens > 0) {
        kvm_store_hash_bytes(ask->doc_tokens, (size_t)ask->n_doc_tokens * sizeof *ask->doc_tokens, &id);
        out->kind = SRV_DOC_TOKENS;
    } else
        return;
    memcpy(out->hash, id.b, sizeof out->hash);
}

static int doc_same(const srv_doc_key *a, const srv_doc_key *b)
{
    return a->kind && a->kind == b->kind && !memcmp(a->hash, b->hash, sizeof a->hash);
}

/* A second computation of the same cache would be wasted work and would count twice against
 * max_new_caches: a request waits while a granted one for its document is in flight. */
int kvm_serve__doc_holder(const srv *s, const srv_request *r)
{
    if (!r->doc.kind || r->released) return -1;
    for (int w = 0; w < s->n_workers; w++)
        if (s->workers[w].busy && s->workers[w].grant && doc_same(&s->workers[w].doc, &r->doc)) return w;
    return -1;
}

void kvm_serve__doc_name(const srv_doc_key *k, char out[80])
{
    static const char hex[] = "0123456789abcdef";
    int n = snprintf(out, 80, "%s:", k->kind == SRV_DOC_TOKENS ? "tokens" : "text");
    for (size_t i = 0; i < sizeof k->hash && n + 2 < 80; i++, n += 2)
        out[n] = hex[k->hash[i] >> 4], out[n + 1] = hex[k->hash[i] & 15];
    out[n] = '\0';
}

/* One line at info level on the requests held for document `doc` that request_id's end
 * released (n of them) or left held. */
static void log_release(const srv_doc_key *doc, uint64_t request_id, srv_doc_end end, const char *why, int64_t n)
{
    char name[80];
    kvm_serve__doc_name(doc, name);
    kvm_log_field f[] = {KVM_LOG_S("doc", name), KVM_LOG_I("request_id", request_id), KVM_LOG_I("held", n)};
    if (end == SRV_END_STORED)
        kvm_log(KVM_LOG_INFO, "held_released", f, 3,
                "document %s: request %llu stored its cache: %lld held request(s) released, served from the store",
                name, (unsigned long long)request_id, (long long)n);
    else if (end == SRV_END_FOUND)
        kvm_log(KVM_LOG_INFO, "held_released", f, 3,
                "document %s: request %llu found its cache stored: %lld held request(s) released", name,
                (unsigned long long)request_id, (long long)n);
    else
        kvm_log(KVM_LOG_INFO, "held_handed_on", f, 3,
                "document %s: request %llu ended without storing its cache (%s): the oldest of %lld held request(s) "
                "computes it, the others stay held",
                name, (unsigned long long)request_id, why ? why : "failed", (long long)n);
}

/* Without a stored cache every held request used to be let go, each with a grant of its own,
 * and each computed the same cache: now they stay held (SRV_HELD), and the first the dispatch
 * reaches (the oldest) takes a grant and holds the others again. */
void kvm_serve__doc_release(srv *s, const srv_worker *wk, srv_doc_end end, const char *why)
{
    if (!wk->grant || !wk->doc.kind) return;
    int64_t n = 0;
    for (int64_t i = 0; i < s->n_queue; i++) {
        srv_request *r = &s->queue[i];
        if (!doc_same(&r->doc, &wk->doc)) continue;
        n += r->released == SRV_HELD;
        r->held_logged = 0;
        if (end == SRV_END_STORED) /* also those a FOUND end let go: no grant needed now */
            r->released = SRV_RELEASED_STORED;
        else if (end == SRV_END_FOUND && r->released == SRV_HELD)
            r->released = SRV_RELEASED;
    }
    if (n) log_release(&wk->doc, wk->request_id, end, why, n);
}
