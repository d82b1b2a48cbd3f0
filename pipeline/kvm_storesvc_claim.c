/* kvm_storesvc_claim.c: claims over the store service (kvm_storesvc_claim.h). */
#include "pipeline/kvm_storesvc_claim.h"
#include "pipeline/kvm_storew.h"
#include "common/kvm_error.h"
#include "pipeline/kvm_cachecodec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void key_of(const kvm_proto_claim *c, kvm_store_cache_key *k, kvm_store_id *tok)
{
    memcpy(k->model_id.b, c->model_id, sizeof k->model_id.b);
    memcpy(k->doc_hash.b, c->doc_hash, sizeof k->doc_hash.b);
    memcpy(k->config_id.b, c->config_id, sizeof k->config_id.b);
    memcpy(tok->b, c->tokenizer_id, sizeof tok->b);
}

/* The orchestrator's "already stored?" rule (kvm_orch_store.c, cache_stored): a verified manifest
 * for this tokenizer and layers that pass their checksums and decode to finite keys and values;
 * another tokenizer's cache or a corrupt one is not stored (the next put replaces it). */
/* A damaged data.mdb (its pages, not one cache's records: kvm_store_tree.c) is the store's error:
 * answered "missing", it sent every run to compress each document only to have its upload refused. */
static int cache_corrupt(int rc) { return rc == KVM_ECORRUPT && !strstr(kvm_errmsg(), "data.mdb is damaged"); }

static int stored(kvm_store *s, const kvm_store_cache_key *k, const kvm_store_id *tok, int index_only,
                  kvm_storesvc_claim_out *out)
{
    int found = 0, rc = kvm_store_has_cache(s, k, tok, &found);
    if (rc == KVM_EMISMATCH || cache_corrupt(rc) || (rc == 0 && !found)) return 0;
    if (rc) return rc;
    if (index_only) return 1; /* revision 12: a recheck; the layers of a large cache are not read */
    kvm_store_cache *c = NULL;
    rc = kvm_store_get_cache(s, k, tok, &c);
    if (rc == 0) rc = kvm_cachecodec_check_stored(c); /* NaN/inf layers: every ask refuses them */
    if (rc == 0) {
        out->full_bytes = c->manifest.full_bytes;
        out->stored_bytes = c->manifest.stored_bytes;
    }
    kvm_store_cache_free(&c);
    if (rc == KVM_EMISMATCH || cache_corrupt(rc)) return 0;
    return rc ? rc : 1;
}

int kvm_storesvc_claim(kvm_store *s, const kvm_proto_claim *c, kvm_storesvc_claim_out *out)
{
    memset(out, 0, sizeof *out);
    kvm_store_cache_key k;
    kvm_store_id tok;
    key_of(c, &k, &tok);
    /* a lease above the longest is refused before anything is looked up: one rule, whatever
     * the key holds (it was answered `stored` on a stored cache, refused on any other) */
    int rc = c->probe ? 0 : kvm_store_claim_check_ttl(c->ttl_ms);
    if (rc) return rc;
    rc = stored(s, &k, &tok, c->index_only, out);
    if (rc < 0) return rc;
    if (rc == 1) {
        out->state = "stored";
        return 0;
    }
    if (c->probe) {
        out->state = "missing";
        return 0;
    }
    char owner[KVM_PROTO_MAX_NAME_BYTES + 1], host[KVM_PROTO_MAX_NAME_BYTES + 1];
    snprintf(owner, sizeof owner, "%.*s", (int)c->owner.len, c->owner.ptr);
    snprintf(host, sizeof host, "%.*s", (int)c->host.len, c->host.ptr);
    int taken = 0;
    if ((rc = kvm_store_claim_take(s, &k, owner, host, c->ttl_ms, &taken, &out->holder))) return rc;
    out->state = taken ? "taken" : "held";
    return 0;
}

int kvm_storesvc_renew(kvm_store *s, const kvm_proto_renew_claims *r, int64_t *n)
{
    char owner[KVM_PROTO_MAX_NAME_BYTES + 1];
    snprintf(owner, sizeof owner, "%.*s", (int)r->owner.len, r->owner.ptr);
    *n = 0;
    return r->release ? kvm_store_claim_release(s, owner, n) : kvm_store_claim_renew(s, owner, r->ttl_ms, n);
}

void kvm_storesvc_clients_note(kvm_storesvc_clients *c, const char *owner)
{
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->owner[i], owner)) return;
    int slot = c->n < KVM_STORESVC_MAX_CLIENTS ? c->n++ : c->next++ % KVM_STORESVC_MAX_CLIENTS;
    snprintf(c->owner[slot], sizeof c->owner[slot], "%s", owner);
}

void kvm_storesvc_clients_forget(kvm_storesvc_clients *c, const char *owner)
{
    for (int i = 0; i < c->n; i++)
        if (!strcmp(c->owner[i], owner)) {
            memmove(c->owner[i], c->owner[c->n - 1], sizeof c->owner[i]);
            c->n--;
            return;
        }
}

/* What kvm_storesvc_clients_live gathers while listing the claims. */
typedef struct live_scan {
    const kvm_storesvc_clients *c;
    int64_t now_ms;                              /* wall clock, ms since 1970 */
    int64_t n[KVM_STORESVC_MAX_CLIENTS];         /* live claims per client */
    int64_t latest_ms[KVM_STORESVC_MAX_CLIENTS]; /* the last of them to lapse */
    char host[KVM_STORESVC_MAX_CLIENTS][64];     /* the host its claims name */
} live_scan;

static int live_visit(const kvm_store_cache_key *key, const kvm_store_claim *cl, void *arg)
{
    (void)key;
    live_scan *ls = arg;
    if (cl->expires_unix_ms <= ls->now_ms) return 0;          /* lapsed: nobody relies on it */
    if (kvm_storew_owner_gone(cl->owner, cl->host)) return 0; /* a run of this host that is gone (kill -9) */
    for (int i = 0; i < ls->c->n; i++)
        if (!strcmp(ls->c->owner[i], cl->owner)) {
            ls->n[i]++;
            if (cl->expires_unix_ms > ls->latest_ms[i]) ls->latest_ms[i] = cl->expires_unix_ms;
            snprintf(ls->host[i], sizeof ls->host[i], "%s", cl->host);
            break;
        }
    return 0;
}

int kvm_storesvc_clients_live(kvm_store *s, const kvm_storesvc_clients *c, int64_t *n_claims, int *n_runs, char *desc,
                              size_t n)
{
    *n_claims = 0, *n_runs = 0;
    if (n) desc[0] = '\0';
    if (c->n == 0) return 0;
    live_scan *ls = calloc(1, sizeof *ls);
    if (!ls) return kvm_err(KVM_ENOMEM, "store service: out of memory");
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ls->c = c;
    ls->now_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    int rc = kvm_store_list_claims(s, live_visit, ls);
    size_t used = 0;
    for (int i = 0; !rc && i < c->n; i++) {
        if (!ls->n[i]) continue;
        *n_claims += ls->n[i];
        if (++*n_runs <= 3 && used < n)
            used += (size_t)snprintf(
                desc + used, n - used, "%s%s on %s (%lld claim%s, lapsing in %.1f s unless renewed)",
                *n_runs > 1 ? ", " : "", c->owner[i], ls->host[i][0] ? ls->host[i] : "?", (long long)ls->n[i],
                ls->n[i] == 1 ? "" : "s", (double)(ls->latest_ms[i] - ls->now_ms) / 1000.0);
    }
    if (*n_runs > 3 && used < n)
        snprintf(desc + used, n - used, " and %d more run%s", *n_runs - 3, *n_runs == 4 ? "" : "s");
    free(ls);
    return rc;
}
