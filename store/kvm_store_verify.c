/* kvm_store_verify.c: the full consistency check behind `kvmill store verify`: every
 * record's checksum in every db, every manifest against its layers (all present, valid,
 * no orphans), the bookkeeping (access times, recorded cache bytes) and the document-name
 * index (kvm_store_docnames.c). */
#include "store/kvm_store_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"

/* State of one verify run. */
typedef struct verify_ctx {
    kvm_store *s;               /* the store */
    MDB_txn *txn;               /* the one read txn */
    kvm_store_report_fn report; /* where problems go (may be NULL) */
    void *arg;                  /* report's argument */
    int64_t n_records;          /* values checked */
    int64_t n_problems;         /* problems found */
    int64_t cache_bytes;        /* sum of value bytes in `caches` */
    int64_t n_manifests;        /* valid manifests seen */
    /* the cache whose keys are being walked */
    uint8_t prefix[KVM_STORE__PREFIX_BYTES]; /* its key prefix */
    int in_group;               /* 1 when prefix is set */
    uint32_t *layers;           /* valid layer indices seen, ascending */
    int64_t *layer_bytes;       /* their frame payload bytes */
    int64_t n_layers, cap_layers; /* used / allocated entries of the two arrays */
    int64_t n_bad_layers;       /* layers of this cache that failed their check */
} verify_ctx;

__attribute__((format(printf, 2, 3))) static void problem(verify_ctx *v, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    v->n_problems++;
    if (v->report) v->report(msg, v->arg);
}

static const char *group_name(verify_ctx *v, char out[48])
{
    kvm_store_cache_key k;
    kvm_store__prefix_decode(v->prefix, &k);
    return kvm_store__key_name(&k, out);
}

/* Ends the current cache group; a group that had no manifest holds orphan layers. */
static void group_end(verify_ctx *v, int had_manifest)
{
    char name[48];
    if (v->in_group && !had_manifest && (v->n_layers || v->n_bad_layers))
        problem(v, "cache %s: %lld orphan layer value(s) without a manifest", group_name(v, name),
                (long long)(v->n_layers + v->n_bad_layers));
    v->in_group = 0;
    v->n_layers = 0;
    v->n_bad_layers = 0;
}

static int group_add(verify_ctx *v, uint32_t layer, int64_t bytes)
{
    if (v->n_layers == v->cap_layers) {
        int64_t cap = v->cap_layers ? 2 * v->cap_layers : 64;
        uint32_t *l = realloc(v->layers, (size_t)cap * sizeof *l);
        if (l) v->layers = l;
        int64_t *b = realloc(v->layer_bytes, (size_t)cap * sizeof *b);
        if (b) v->layer_bytes = b;
        if (!l || !b) return kvm_err(KVM_ENOMEM, "verify: out of memory");
        v->cap_layers = cap;
    }
    v->layers[v->n_layers] = layer;
    v->layer_bytes[v->n_layers++] = bytes;
    return 0;
}

/* Checks a manifest against the layers collected for its cache. */
static void check_manifest(verify_ctx *v, const MDB_val *key, const MDB_val *val)
{
    char name[48], what[96];
    kvm_store_cache_key k;
    kvm_store_manifest m;
    kvm_store__prefix_decode(v->prefix, &k);
    snprintf(what, sizeof what, "cache %s manifest", kvm_store__key_name(&k, name));
    if (kvm_store__manifest_parse(key, val, &m, what) != 0) {
        problem(v, "%s", kvm_errmsg());
        return;
    }
    v->n_manifests++;
    if (memcmp(m.model_id.b, k.model_id.b, KVM_STORE_ID_BYTES) || memcmp(m.doc_hash.b, k.doc_hash.b, KVM_STORE_ID_BYTES) ||
        memcmp(m.config_id.b, k.config_id.b, KVM_STORE_ID_BYTES))
        problem(v, "%s: ids differ from the key it is stored under", what);
    if (m.config.size) {
        kvm_store_id cid;
        kvm_store_hash_bytes(m.config.data, m.config.size, &cid);
        if (memcmp(cid.b, m.config_id.b, KVM_STORE_ID_BYTES))
            problem(v, "%s: config id is not the hash of its config bytes", what);
    }
    int64_t next = 0, bytes = 0, missing = 0, orphans = 0;
    for (int64_t i = 0; i < v->n_layers; i++) {
        uint32_t l = v->layers[i];
        if (l >= (uint32_t)m.n_layers) {
            orphans++;
            continue;
        }
        missing += l - next; /* indices are ascending: the gap before l is missing or invalid */
        next = (int64_t)l + 1;
        bytes += v->layer_bytes[i];
    }
    missing += m.n_layers - next;
    if (missing > v->n_bad_layers)
        problem(v, "cache %s: %lld of %d layers missing", name, (long long)(missing - v->n_bad_layers), m.n_layers);
    if (orphans) problem(v, "cache %s: %lld orphan layer(s) at index >= n_layers %d", name, (long long)orphans, m.n_layers);
    if (missing == 0 && bytes != m.stored_bytes)
        problem(v, "cache %s: layers hold %lld frame bytes, manifest says %lld", name, (long long)bytes,
                (long long)m.stored_bytes);
    uint64_t atime;
    if (kvm_store__atime_get(v->s, v->txn, &k, &atime) == 0 && atime == 0)
        problem(v, "cache %s: no access time recorded", name);
}

static int verify_caches(verify_ctx *v)
{
    MDB_cursor *cur;
    MDB_val key, val;
    int rc = mdb_cursor_open(v->txn, v->s->dbi[KVM_STORE__DB_CACHES], &cur);
    if (rc) return kvm_store__mdb(v->s, rc, "cursor");
    int st = 0;
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0 && st == 0;
         rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        v->n_records++;
        v->cache_bytes += (int64_t)val.mv_size;
        if (key.mv_size != KVM_STORE__CACHE_KEY_BYTES) {
            problem(v, "caches: a key of %zu bytes is not a cache key", key.mv_size);
            continue;
        }
        if (v->in_group && memcmp(key.mv_data, v->prefix, KVM_STORE__PREFIX_BYTES) != 0) group_end(v, 0);
        if (!v->in_group) {
            memcpy(v->prefix, key.mv_data, KVM_STORE__PREFIX_BYTES);
            v->in_group = 1;
        }
        uint32_t layer = kvm_store__key_layer(key.mv_data);
        if (layer == KVM_STORE__MANIFEST) {
            check_manifest(v, &key, &val);
            group_end(v, 1);
            continue;
        }
        char name[48], what[96];
        snprintf(what, sizeof what, "cache %s layer %u", group_name(v, name), layer);
        uint32_t np;
        if (kvm_store__rec_check(&key, &val, KVM_STORE__KIND_LAYER, &np, what) != 0) {
            problem(v, "%s", kvm_errmsg());
            v->n_bad_layers++;
            continue;
        }
        st = group_add(v, layer, (int64_t)(val.mv_size - KVM_STORE__REC_HEADER - KVM_STORE__REC_SUM - 8 * (size_t)np));
    }
    group_end(v, 0);
    mdb_cursor_close(cur);
    if (st == 0 && rc && rc != MDB_NOTFOUND) st = kvm_store__mdb(v->s, rc, "verify caches");
    return st;
}

/* Checks every record of a small-record db. */
static int verify_records(verify_ctx *v, int db, uint16_t kind, const char *dbname, size_t key_min, size_t key_max)
{
    MDB_cursor *cur;
    MDB_val key, val;
    int rc = mdb_cursor_open(v->txn, v->s->dbi[db], &cur);
    if (rc) return kvm_store__mdb(v->s, rc, "cursor");
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        char hex[KVM_STORE_ID_HEX + 1], what[128];
        kvm_store_id id = {{0}};
        memcpy(id.b, key.mv_data, key.mv_size < KVM_STORE_ID_BYTES ? key.mv_size : KVM_STORE_ID_BYTES);
        snprintf(what, sizeof what, "%s %.12s", dbname, kvm_store_id_hex(&id, hex));
        v->n_records++;
        uint32_t np;
        if (key.mv_size < key_min || key.mv_size > key_max)
            problem(v, "%s: key of %zu bytes", what, key.mv_size);
        else if (kvm_store__rec_check(&key, &val, kind, &np, what) != 0)
            problem(v, "%s", kvm_errmsg());
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : kvm_store__mdb(v->s, rc, dbname);
}

/* Every docnames entry is a 64-byte key with an empty value naming a stored document. An
 * entry whose document now has another source is stale but harmless (the lookup checks the
 * record; an older build renamed it), and documents without an entry (an older build added
 * them) are found by the scan the lookup falls back to: neither is a problem. */
static int verify_docnames(verify_ctx *v)
{
    MDB_cursor *cur;
    MDB_val key, val;
    int rc = mdb_cursor_open(v->txn, v->s->dbi[KVM_STORE__DB_DOCNAMES], &cur);
    if (rc) return kvm_store__mdb(v->s, rc, "cursor");
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        v->n_records++;
        if (key.mv_size != KVM_STORE__DOCNAME_KEY_BYTES || val.mv_size != 0) {
            problem(v, "docnames: an entry of %zu key bytes and %zu value bytes (expected %d and 0)", key.mv_size,
                    val.mv_size, KVM_STORE__DOCNAME_KEY_BYTES);
            continue;
        }
        MDB_val dk = {KVM_STORE_ID_BYTES, (uint8_t *)key.mv_data + KVM_STORE_ID_BYTES}, dv;
        int grc = mdb_get(v->txn, v->s->dbi[KVM_STORE__DB_DOCS], &dk, &dv);
        if (grc == MDB_NOTFOUND) {
            kvm_store_id id;
            char hex[KVM_STORE_ID_HEX + 1];
            memcpy(id.b, dk.mv_data, KVM_STORE_ID_BYTES);
            problem(v, "docnames: an entry names document %.12s, which has no docs record", kvm_store_id_hex(&id, hex));
        } else if (grc) {
            mdb_cursor_close(cur);
            return kvm_store__mdb(v->s, grc, "docs");
        }
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : kvm_store__mdb(v->s, rc, "docnames");
}

/* atime entries must name stored caches; lru entries must mirror atime. */
static int verify_bookkeeping(verify_ctx *v)
{
    MDB_cursor *cur;
    MDB_val key, val;
    int64_t n_atime = 0;
    int rc = mdb_cursor_open(v->txn, v->s->dbi[KVM_STORE__DB_LRU], &cur);
    if (rc) return kvm_store__mdb(v->s, rc, "cursor");
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        kvm_store_cache_key k;
        uint64_t at = 0, lt;
        char name[48];
        if (key.mv_size != KVM_STORE__LRU_KEY_BYTES) {
            problem(v, "lru: key of %zu bytes", key.mv_size);
            continue;
        }
        kvm_store__prefix_decode((uint8_t *)key.mv_data + 8, &k);
        const uint8_t *p = key.mv_data;
        lt = 0;
        for (int i = 0; i < 8; i++) lt = lt << 8 | p[i];
        kvm_store__atime_get(v->s, v->txn, &k, &at);
        if (at != lt) problem(v, "lru: entry of cache %s does not match its access time", kvm_store__key_name(&k, name));
    }
    mdb_cursor_close(cur);
    if (rc != MDB_NOTFOUND) return kvm_store__mdb(v->s, rc, "lru");
    MDB_stat ms;
    rc = mdb_stat(v->txn, v->s->dbi[KVM_STORE__DB_ATIME], &ms);
    if (rc) return kvm_store__mdb(v->s, rc, "atime");
    n_atime = (int64_t)ms.ms_entries;
    if (n_atime != v->n_manifests)
        problem(v, "atime: %lld access times for %lld valid manifests", (long long)n_atime, (long long)v->n_manifests);
    int64_t recorded;
    int st = kvm_store__meta_get(v->s, v->txn, "cache_bytes", &recorded);
    if (st) problem(v, "meta: %s", kvm_errmsg());
    else if (recorded != v->cache_bytes)
        problem(v, "meta: recorded cache bytes %lld, values hold %lld", (long long)recorded, (long long)v->cache_bytes);
    return 0;
}

/* Every db's records, in the read txn v->txn. */
static int verify_all(verify_ctx *v)
{
    kvm_store *s = v->s;
    int st = verify_caches(v);
    if (st == 0) st = verify_records(v, KVM_STORE__DB_STRATEGIES, KVM_STORE__KIND_STRATEGY, "strategy",
                                     KVM_STORE_ID_BYTES + 1, KVM_STORE_ID_BYTES + KVM_STORE_MAX_NAME);
    if (st == 0) st = verify_records(v, KVM_STORE__DB_MODELS, KVM_STORE__KIND_MODEL, "model", KVM_STORE_ID_BYTES,
                                     KVM_STORE_ID_BYTES);
    if (st == 0)
        st = verify_records(v, KVM_STORE__DB_DOCS, KVM_STORE__KIND_DOC, "doc", KVM_STORE_ID_BYTES, KVM_STORE_ID_BYTES);
    if (st == 0) st = verify_records(v, KVM_STORE__DB_FILES, KVM_STORE__KIND_FILE, "model id memo",
                                     KVM_STORE_ID_BYTES, KVM_STORE_ID_BYTES);
    if (st == 0 && !s->no_claims)
        st = verify_records(v, KVM_STORE__DB_CLAIMS, KVM_STORE__KIND_CLAIM, "claim", KVM_STORE__PREFIX_BYTES,
                            KVM_STORE__PREFIX_BYTES);
    if (st == 0 && !s->no_docnames) st = verify_docnames(v);
    if (st == 0) st = verify_bookkeeping(v);
    return st;
}

int kvm_store_verify(kvm_store *s, kvm_store_report_fn report, void *arg, int64_t *n_records, int64_t *n_problems)
{
    int st = kvm_store__lock(s);
    if (st) return st;
    verify_ctx v = {.s = s, .report = report, .arg = arg};
    st = kvm_store__read_begin(s, &v.txn);
    if (st == 0) {
        st = verify_all(&v);
    } else if (st == KVM_ECORRUPT) { /* damaged pages: reading the records through LMDB is not safe */
        problem(&v, "%s", kvm_errmsg());
        st = 0;
    }
    if (v.txn) mdb_txn_abort(v.txn);
    free(v.layers);
    free(v.layer_bytes);
    kvm_store__unlock(s);
    if (n_records) *n_records = v.n_records;
    if (n_problems) *n_problems = v.n_problems;
    return st;
}
