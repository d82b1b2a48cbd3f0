/* kvm_store_claim.c: claims, the leases two runs on one store use to share the work: the
 * run about to compress a document claims its cache key for a while and renews the lease
 * while the job lives; another run that finds a live claim of someone else skips the
 * document. A lease of a run that died lapses after its time-to-live. */
#include "store/kvm_store_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"

#define CLAIM_FIXED 16 /* i64 since ms, i64 expires ms */

static int64_t now_ms(void) { return (int64_t)(kvm_store__now_ns() / 1000000); }

/* Decodes a claim record read under key. */
static int claim_parse(const MDB_val *key, const MDB_val *val, kvm_store_claim *c)
{
    uint32_t np;
    memset(c, 0, sizeof *c);
    int st = kvm_store__rec_check(key, val, KVM_STORE__KIND_CLAIM, &np, "claim");
    if (st) return st;
    kvm_frame p[3];
    if (np != 3) return kvm_err(KVM_ECORRUPT, "claim: %u parts, expected 3", np);
    kvm_store__rec_parts(val, p, 3);
    if (p[0].size != CLAIM_FIXED || p[1].size == 0 || p[1].size >= sizeof c->owner || p[2].size >= sizeof c->host)
        return kvm_err(KVM_ECORRUPT, "claim: bad field sizes");
    c->since_unix_ms = (int64_t)kvm_store__get_u64(p[0].data);
    c->expires_unix_ms = (int64_t)kvm_store__get_u64(p[0].data + 8);
    memcpy(c->owner, p[1].data, p[1].size);
    memcpy(c->host, p[2].data, p[2].size);
    return 0;
}

static int claim_put(kvm_store *s, MDB_txn *txn, const MDB_val *key, const kvm_store_claim *c)
{
    uint8_t fixed[CLAIM_FIXED];
    kvm_store__put_u64(fixed, (uint64_t)c->since_unix_ms);
    kvm_store__put_u64(fixed + 8, (uint64_t)c->expires_unix_ms);
    kvm_frame parts[3] = {{fixed, sizeof fixed}, {(const uint8_t *)c->owner, strlen(c->owner)},
                          {(const uint8_t *)c->host, strlen(c->host)}};
    int rc = kvm_store__rec_put(txn, s->dbi[KVM_STORE__DB_CLAIMS], key, KVM_STORE__KIND_CLAIM, parts, 3);
    return rc ? kvm_store__mdb(s, rc, "claim") : 0;
}

typedef struct take_arg {
    uint8_t prefix[KVM_STORE__PREFIX_BYTES]; /* the cache key */
    kvm_store_claim want;                    /* owner, host, expiry */
    int taken;                               /* out */
    kvm_store_claim holder;                  /* out when not taken */
} take_arg;

static int take_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    take_arg *a = arg;
    MDB_val key = {sizeof a->prefix, a->prefix}, val;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_CLAIMS], &key, &val);
    if (rc && rc != MDB_NOTFOUND) return kvm_store__mdb(s, rc, "claim");
    kvm_store_claim cur;
    /* a damaged record is no claim: overwriting it is the repair */
    if (rc == 0 && claim_parse(&key, &val, &cur) == 0 && cur.expires_unix_ms > now_ms()) {
        if (strcmp(cur.owner, a->want.owner)) {
            a->taken = 0;
            a->holder = cur;
            return 0;
        }
        a->want.since_unix_ms = cur.since_unix_ms;
    }
    a->taken = 1;
    return claim_put(s, txn, &key, &a->want);
}

/* A lease above KVM_STORE_CLAIM_MAX_TTL_MS is refused, not cut to it: a caller that asked for
 * more would otherwise believe it holds the key longer than it does. */
int kvm_store_claim_check_ttl(int64_t ttl_ms)
{
    if (ttl_ms > KVM_STORE_CLAIM_MAX_TTL_MS)
        return kvm_err(KVM_ERANGE, "claim: ttl_ms %lld is above the longest lease, %lld ms (24 h)", (long long)ttl_ms,
                       (long long)KVM_STORE_CLAIM_MAX_TTL_MS);
    return 0;
}

static int check_owner(const char *owner, const char *host, int64_t ttl_ms)
{
    if (!owner || !*owner || strlen(owner) >= sizeof ((kvm_store_claim *)0)->owner || (host && strlen(host) >= 64) ||
        ttl_ms < 1)
        return kvm_err(KVM_EINVAL, "claim: owner must be 1..127 bytes, host 0..63, ttl_ms >= 1");
    return kvm_store_claim_check_ttl(ttl_ms);
}

/* Claims need a writable handle (which always has the claims db). */
static int claims_lock(kvm_store *s)
{
    int st = kvm_store__lock(s);
    if (st == 0 && s->read_only) {
        kvm_store__unlock(s);
        st = kvm_err(KVM_ESTATE, "store %s: opened read-only, cannot claim", s->path);
    }
    return st;
}

int kvm_store_claim_take(kvm_store *s, const kvm_store_cache_key *key, const char *owner, const char *host,
                         int64_t ttl_ms, int *taken, kvm_store_claim *holder)
{
    *taken = 0;
    int st = check_owner(owner, host, ttl_ms);
    if (st) return st;
    take_arg a = {.taken = 0};
    kvm_store__prefix(key, a.prefix);
    snprintf(a.want.owner, sizeof a.want.owner, "%s", owner);
    snprintf(a.want.host, sizeof a.want.host, "%s", host ? host : "");
    int64_t now = now_ms();
    a.want.since_unix_ms = now;
    a.want.expires_unix_ms = now + ttl_ms;
    if ((st = claims_lock(s))) return st;
    st = kvm_store__write(s, take_fn, &a);
    kvm_store__unlock(s);
    if (st) return st;
    *taken = a.taken;
    if (!a.taken && holder) *holder = a.holder;
    return 0;
}

typedef struct each_arg {
    const char *owner; /* whose claims */
    int64_t expires;   /* new expiry, or < 0 to delete */
    int64_t n;         /* claims touched */
    int keep_live;     /* delete nothing when one of them is live (kvm_store_claim_release_lapsed) */
    int64_t n_live;    /* out with keep_live: live claims found */
    int64_t latest_ms; /* out with keep_live: the latest live expiry */
} each_arg;

/* Renews or deletes every claim of a->owner: the keys are collected first, then changed,
 * so no cursor walks a db being written. */
static int each_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    each_arg *a = arg;
    MDB_cursor *cur;
    MDB_val key, val;
    kvm_store_claim *mine = NULL, c;
    uint8_t (*keys)[KVM_STORE__PREFIX_BYTES] = NULL;
    int64_t cap = 0;
    a->n = a->n_live = a->latest_ms = 0; /* a txn retried (a map grown) counts again */
    int rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_CLAIMS], &cur);
    if (rc) return kvm_store__mdb(s, rc, "claims cursor");
    int st = 0;
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0 && st == 0;
         rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        if (key.mv_size != KVM_STORE__PREFIX_BYTES || claim_parse(&key, &val, &c) || strcmp(c.owner, a->owner)) continue;
        if (a->n == cap) {
            cap = cap ? 2 * cap : 64;
            void *k2 = realloc(keys, (size_t)cap * sizeof *keys), *m2 = k2 ? realloc(mine, (size_t)cap * sizeof *mine) : NULL;
            if (k2) keys = k2;
            if (m2) mine = m2;
            if (!k2 || !m2) st = kvm_err(KVM_ENOMEM, "claims: out of memory");
            if (st) break;
        }
        memcpy(keys[a->n], key.mv_data, KVM_STORE__PREFIX_BYTES);
        mine[a->n++] = c;
    }
    mdb_cursor_close(cur);
    if (st == 0 && rc && rc != MDB_NOTFOUND) st = kvm_store__mdb(s, rc, "claims");
    if (st == 0 && a->keep_live) {
        /* judged under the write lock, in the txn that deletes: a claim the owner took or
         * renewed while this waited for the lock is seen here, not lost to a check made before */
        const int64_t now = now_ms();
        for (int64_t i = 0; i < a->n; i++)
            if (mine[i].expires_unix_ms > now) {
                a->n_live++;
                if (mine[i].expires_unix_ms > a->latest_ms) a->latest_ms = mine[i].expires_unix_ms;
            }
        if (a->n_live)
            st = kvm_err(KVM_EBUSY, "claims: %lld of the owner's %lld claim(s) live, none released",
                         (long long)a->n_live, (long long)a->n);
    }
    for (int64_t i = 0; st == 0 && i < a->n; i++) {
        MDB_val k = {KVM_STORE__PREFIX_BYTES, keys[i]};
        if (a->expires < 0) {
            rc = mdb_del(txn, s->dbi[KVM_STORE__DB_CLAIMS], &k, NULL);
            if (rc) st = kvm_store__mdb(s, rc, "release claim");
        } else {
            mine[i].expires_unix_ms = a->expires;
            st = claim_put(s, txn, &k, &mine[i]);
        }
    }
    free(keys);
    free(mine);
    return st;
}

static int each(kvm_store *s, each_arg *a, int64_t *n)
{
    int st = check_owner(a->owner, NULL, 1);
    if (st) return st;
    if ((st = claims_lock(s))) return st;
    st = kvm_store__write(s, each_fn, a);
    kvm_store__unlock(s);
    if (n) *n = st ? 0 : a->n;
    return st;
}

static int each_owner(kvm_store *s, const char *owner, int64_t expires, int64_t *n)
{
    each_arg a = {.owner = owner, .expires = expires};
    return each(s, &a, n);
}

int kvm_store_claim_renew(kvm_store *s, const char *owner, int64_t ttl_ms, int64_t *n)
{
    if (ttl_ms < 1) return kvm_err(KVM_EINVAL, "claim: ttl_ms %lld must be >= 1", (long long)ttl_ms);
    int st = kvm_store_claim_check_ttl(ttl_ms);
    if (st) return st;
    return each_owner(s, owner, now_ms() + ttl_ms, n);
}

int kvm_store_claim_release(kvm_store *s, const char *owner, int64_t *n) { return each_owner(s, owner, -1, n); }

int kvm_store_claim_release_lapsed(kvm_store *s, const char *owner, int force, int64_t *n, int64_t *n_live,
                                   int64_t *latest_ms)
{
    each_arg a = {.owner = owner, .expires = -1, .keep_live = !force};
    int st = each(s, &a, n);
    if (n_live) *n_live = a.n_live;
    if (latest_ms) *latest_ms = a.latest_ms;
    return st;
}

int kvm_store_claim_get(kvm_store *s, const kvm_store_cache_key *key, kvm_store_claim *out)
{
    memset(out, 0, sizeof *out);
    int st = kvm_store__lock(s);
    if (st) return st;
    if (s->no_claims) {
        kvm_store__unlock(s);
        return kvm_err(KVM_ENOTFOUND, "store %s: no claims", s->path);
    }
    MDB_txn *txn;
    st = kvm_store__read_begin(s, &txn);
    if (st == 0) {
        uint8_t kb[KVM_STORE__PREFIX_BYTES];
        kvm_store__prefix(key, kb);
        MDB_val k = {sizeof kb, kb}, val;
        int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_CLAIMS], &k, &val);
        if (rc == MDB_NOTFOUND) st = kvm_err(KVM_ENOTFOUND, "store %s: no claim on that cache", s->path);
        else if (rc) st = kvm_store__mdb(s, rc, "claim");
        else st = claim_parse(&k, &val, out);
        mdb_txn_abort(txn);
    }
    kvm_store__unlock(s);
    return st;
}

/* Visits every claim record of the claims db open in txn; a damaged one is skipped (the
 * next take overwrites it; kvm_store_verify reports it). */
static int list_txn(kvm_store *s, MDB_txn *txn, kvm_store_claim_visit_fn fn, void *arg)
{
    MDB_cursor *cur;
    MDB_val key, val;
    int rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_CLAIMS], &cur);
    if (rc) return kvm_store__mdb(s, rc, "claims cursor");
    int st = 0;
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0 && st == 0;
         rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        kvm_store_claim c;
        kvm_store_cache_key k;
        if (key.mv_size != KVM_STORE__PREFIX_BYTES || claim_parse(&key, &val, &c)) continue;
        kvm_store__prefix_decode(key.mv_data, &k);
        st = fn(&k, &c, arg);
    }
    mdb_cursor_close(cur);
    if (st == 0 && rc && rc != MDB_NOTFOUND) st = kvm_store__mdb(s, rc, "claims");
    return st;
}

int kvm_store_list_claims(kvm_store *s, kvm_store_claim_visit_fn fn, void *arg)
{
    int st = kvm_store__lock(s);
    if (st) return st;
    MDB_txn *txn;
    if (!s->no_claims && (st = kvm_store__read_begin(s, &txn)) == 0) { /* no claims db (an older store): none */
        st = list_txn(s, txn, fn, arg);
        mdb_txn_abort(txn);
    }
    kvm_store__unlock(s);
    return st;
}
