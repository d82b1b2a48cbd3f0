/* kvm_store_cache.c: caches: put (all layers, then the manifest, in one write txn, after
 * evicting for the cap), verified get into one heap block, presence check, removal,
 * listing manifests, and resolving "MODEL:DOC:CONFIG" hex prefixes to a key. */
#include "store/kvm_store_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"

static int key_eq(const kvm_store_id *a, const kvm_store_id *b) { return memcmp(a->b, b->b, KVM_STORE_ID_BYTES) == 0; }

/* ---- put ---- */

typedef struct put_arg {
    const kvm_store_manifest *m;    /* caller's manifest */
    const kvm_store_layer *layers;  /* [m->n_layers] */
    kvm_store_cache_key key;        /* from the manifest */
    int64_t rec_bytes;              /* bytes of all values to write */
    int64_t stored_bytes;           /* frame payload bytes */
} put_arg;

static int put_check(const kvm_store_manifest *m, const kvm_store_layer *layers, put_arg *a)
{
    if (!m || !layers) return kvm_err(KVM_EINVAL, "store put: NULL manifest or layers");
    if (m->n_layers < 1 || m->n_layers > KVM_STORE_MAX_LAYERS)
        return kvm_err(KVM_EINVAL, "store put: n_layers %d outside [1, %d]", m->n_layers, KVM_STORE_MAX_LAYERS);
    if (m->n_tokens < 0 || m->n_entries < 0 || m->full_bytes < 0)
        return kvm_err(KVM_EINVAL, "store put: negative n_tokens, n_entries or full_bytes");
    if (memchr(m->dtype, '\0', sizeof m->dtype) == NULL || m->dtype[0] == '\0')
        return kvm_err(KVM_EINVAL, "store put: dtype must be a non-empty NUL-terminated name");
    if (m->config.size > 0) {
        kvm_store_id want;
        if (!m->config.data) return kvm_err(KVM_EINVAL, "store put: config bytes are NULL");
        kvm_store_hash_bytes(m->config.data, m->config.size, &want);
        if (!key_eq(&want, &m->config_id))
            return kvm_err(KVM_EINVAL, "store put: config_id is not BLAKE2b-256 of the config bytes");
    }
    a->m = m;
    a->layers = layers;
    a->key = (kvm_store_cache_key){m->model_id, m->doc_hash, m->config_id};
    a->stored_bytes = 0;
    a->rec_bytes = 0;
    for (int32_t l = 0; l < m->n_layers; l++) {
        const kvm_store_layer *L = &layers[l];
        if (L->n_frames > KVM_STORE_MAX_FRAMES || (L->n_frames && !L->frames))
            return kvm_err(KVM_EINVAL, "store put: layer %d: bad frame list (%u frames)", l, L->n_frames);
        for (uint32_t f = 0; f < L->n_frames; f++) {
            if (L->frames[f].size && !L->frames[f].data)
                return kvm_err(KVM_EINVAL, "store put: layer %d frame %u: NULL data", l, f);
            a->stored_bytes += (int64_t)L->frames[f].size;
        }
        a->rec_bytes += (int64_t)kvm_store__rec_size(L->frames, L->n_frames);
    }
    kvm_frame parts[2] = {{NULL, KVM_STORE__MANIFEST_FIXED}, m->config};
    a->rec_bytes += (int64_t)kvm_store__rec_size(parts, 2);
    return 0;
}

static int put_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    const put_arg *a = arg;
    int64_t freed, n_keys, bytes;
    int st = kvm_store__cache_delete(s, txn, &a->key, &freed, &n_keys); /* replace an old version */
    if (st == 0) st = kvm_store__evict_for(s, txn, &a->key, a->rec_bytes);
    if (st) return st;
    MDB_dbi dbi = s->dbi[KVM_STORE__DB_CACHES];
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    MDB_val key = {sizeof kb, kb};
    char name[48], what[96];
    for (int32_t l = 0; l < a->m->n_layers; l++) {
        kvm_store__cache_key(&a->key, (uint32_t)l, kb);
        int rc = kvm_store__rec_put(txn, dbi, &key, KVM_STORE__KIND_LAYER, a->layers[l].frames, a->layers[l].n_frames);
        if (rc) {
            snprintf(what, sizeof what, "cache %s layer %d", kvm_store__key_name(&a->key, name), l);
            return kvm_store__mdb(s, rc, what);
        }
    }
    if (s->txn_hook) s->txn_hook(s->txn_hook_arg);
    uint64_t now_ns = kvm_store__now_ns();
    kvm_store_manifest m = *a->m;
    m.format_version = KVM_STORE_FORMAT_VERSION;
    m.stored_bytes = a->stored_bytes;
    m.created_unix_ms = (int64_t)(now_ns / 1000000);
    uint8_t fixed[KVM_STORE__MANIFEST_FIXED];
    kvm_store__manifest_encode(&m, fixed);
    kvm_frame parts[2] = {{fixed, sizeof fixed}, m.config};
    kvm_store__cache_key(&a->key, KVM_STORE__MANIFEST, kb);
    int rc = kvm_store__rec_put(txn, dbi, &key, KVM_STORE__KIND_MANIFEST, parts, 2);
    if (rc) return kvm_store__mdb(s, rc, "cache manifest");
    st = kvm_store__meta_get(s, txn, "cache_bytes", &bytes);
    if (st == 0) st = kvm_store__meta_set(s, txn, "cache_bytes", bytes + a->rec_bytes);
    if (st == 0) st = kvm_store__atime_set(s, txn, &a->key, now_ns);
    return st;
}

int kvm_store_put_cache(kvm_store *s, const kvm_store_manifest *m, const kvm_store_layer *layers)
{
    put_arg a;
    int st = put_check(m, layers, &a);
    if (st) return st;
    st = kvm_store__lock(s);
    if (st) return st;
    st = kvm_store__write(s, put_fn, &a);
    kvm_store__unlock(s);
    return st;
}

/* ---- get ---- */

static int check_compat(const kvm_store_cache_key *k, const kvm_store_manifest *m, const kvm_store_id *tok)
{
    char name[48], a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1];
    kvm_store__key_name(k, name);
    /* the ids in full: ids that differ past their first 12 hex digits were printed as the same
     * ("manifest belongs to 3e77c0b76962:...", the cache's own name; "built with tokenizer
     * 83ad61f1ef3e, expected tokenizer 83ad61f1ef3e") */
    const struct {
        const char *what;
        const kvm_store_id *in_manifest, *in_key;
    } ids[3] = {{"model id", &m->model_id, &k->model_id},
                {"document hash", &m->doc_hash, &k->doc_hash},
                {"config id", &m->config_id, &k->config_id}};
    for (int i = 0; i < 3; i++)
        if (!key_eq(ids[i].in_manifest, ids[i].in_key))
            return kvm_err(KVM_EMISMATCH, "cache %s: its manifest names %s %s, its key %s; refused", name, ids[i].what,
                           kvm_store_id_hex(ids[i].in_manifest, a), kvm_store_id_hex(ids[i].in_key, b));
    if (tok && !key_eq(&m->tokenizer_id, tok))
        return kvm_err(KVM_EMISMATCH, "cache %s: built with tokenizer %s, expected tokenizer %s; refused", name,
                       kvm_store_id_hex(&m->tokenizer_id, a), kvm_store_id_hex(tok, b));
    return 0;
}

/* Reads and checks every layer value of a manifest in txn; vals[l] and n_frames[l] are
 * views valid until txn ends. */
static int get_layers(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, const kvm_store_manifest *m,
                      MDB_val *vals, uint32_t *n_frames, int64_t *total_frames)
{
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    char name[48], what[96];
    kvm_store__key_name(k, name);
    int64_t payload = 0;
    *total_frames = 0;
    for (int32_t l = 0; l < m->n_layers; l++) {
        kvm_store__cache_key(k, (uint32_t)l, kb);
        MDB_val key = {sizeof kb, kb};
        snprintf(what, sizeof what, "cache %s layer %d", name, l);
        int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_CACHES], &key, &vals[l]);
        if (rc == MDB_NOTFOUND)
            return kvm_err(KVM_ECORRUPT, "%s: missing (manifest says %d layers)", what, m->n_layers);
        if (rc) return kvm_store__mdb(s, rc, what);
        int st = kvm_store__rec_check(&key, &vals[l], KVM_STORE__KIND_LAYER, &n_frames[l], what);
        if (st) return st;
        size_t body = vals[l].mv_size - KVM_STORE__REC_HEADER - KVM_STORE__REC_SUM - 8 * (size_t)n_frames[l];
        payload += (int64_t)body;
        *total_frames += n_frames[l];
    }
    if (payload != m->stored_bytes)
        return kvm_err(KVM_ECORRUPT, "cache %s: layers hold %lld frame bytes, manifest says %lld", name,
                       (long long)payload, (long long)m->stored_bytes);
    return 0;
}

/* Copies a checked manifest and its layers into one heap block. */
static int copy_out(const kvm_store_manifest *m, const MDB_val *vals, const uint32_t *n_frames,
                    int64_t total_frames, kvm_store_cache **out)
{
    size_t head = sizeof(kvm_store_cache) + (size_t)m->n_layers * sizeof(kvm_store_layer) +
                  (size_t)total_frames * sizeof(kvm_frame);
    size_t total = head + m->config.size + (size_t)m->stored_bytes;
    uint8_t *block = malloc(total ? total : 1);
    if (!block) return kvm_err(KVM_ENOMEM, "store get: out of memory for a %zu-byte cache", total);
    kvm_store_cache *c = (kvm_store_cache *)block;
    c->manifest = *m;
    c->layers = (kvm_store_layer *)(block + sizeof(kvm_store_cache));
    kvm_frame *frames = (kvm_frame *)(c->layers + m->n_layers);
    uint8_t *bytes = block + head;
    if (m->config.size) memcpy(bytes, m->config.data, m->config.size);
    c->manifest.config.data = m->config.size ? bytes : NULL;
    bytes += m->config.size;
    for (int32_t l = 0; l < m->n_layers; l++) {
        kvm_store__rec_parts(&vals[l], frames, n_frames[l]);
        for (uint32_t f = 0; f < n_frames[l]; f++) {
            if (frames[f].size) memcpy(bytes, frames[f].data, frames[f].size);
            frames[f].data = frames[f].size ? bytes : NULL;
            bytes += frames[f].size;
        }
        c->layers[l].frames = frames;
        c->layers[l].n_frames = n_frames[l];
        frames += n_frames[l];
    }
    *out = c;
    return 0;
}

static int get_locked(kvm_store *s, const kvm_store_cache_key *k, const kvm_store_id *tok, kvm_store_cache **out,
                      uint64_t *atime_ns)
{
    MDB_txn *txn = NULL;
    MDB_val *vals = NULL;
    uint32_t *n_frames = NULL;
    kvm_store_manifest m;
    int64_t total_frames = 0;
    int st = kvm_store__read_begin(s, &txn);
    if (st == 0) st = kvm_store__manifest_read(s, txn, k, &m);
    if (st == 0) st = check_compat(k, &m, tok);
    if (st == 0) {
        vals = malloc((size_t)m.n_layers * sizeof *vals);
        n_frames = malloc((size_t)m.n_layers * sizeof *n_frames);
        if (!vals || !n_frames) st = kvm_err(KVM_ENOMEM, "store get: out of memory");
    }
    if (st == 0) st = get_layers(s, txn, k, &m, vals, n_frames, &total_frames);
    if (st == 0) st = copy_out(&m, vals, n_frames, total_frames, out);
    if (st == 0) st = kvm_store__atime_get(s, txn, k, atime_ns);
    if (st) kvm_store_cache_free(out);
    free(vals);
    free(n_frames);
    if (txn) mdb_txn_abort(txn);
    return st;
}

int kvm_store_get_cache(kvm_store *s, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id,
                        kvm_store_cache **out)
{
    if (!out) return kvm_err(KVM_EINVAL, "store get: NULL output");
    *out = NULL;
    if (!key) return kvm_err(KVM_EINVAL, "store get: NULL key");
    int st = kvm_store__lock(s);
    if (st) return st;
    uint64_t atime = 0;
    st = get_locked(s, key, tokenizer_id, out, &atime);
    if (st == 0) kvm_store__touch(s, key, atime);
    kvm_store__unlock(s);
    return st;
}

void kvm_store_cache_free(kvm_store_cache **c)
{
    if (!c || !*c) return;
    free(*c);
    *c = NULL;
}

int kvm_store_has_cache(kvm_store *s, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id, int *found)
{
    *found = 0;
    int st = kvm_store__lock(s);
    if (st) return st;
    MDB_txn *txn;
    kvm_store_manifest m;
    st = kvm_store__read_begin(s, &txn);
    if (st == 0) {
        st = kvm_store__manifest_read(s, txn, key, &m);
        if (st == 0) st = check_compat(key, &m, tokenizer_id);
        if (st == 0) *found = 1;
        if (st == KVM_ENOTFOUND) st = 0;
        mdb_txn_abort(txn);
    }
    kvm_store__unlock(s);
    return st;
}

/* ---- remove ---- */

int kvm_store__cache_delete(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, int64_t *freed_bytes,
                            int64_t *n_keys)
{
    MDB_cursor *cur;
    *freed_bytes = 0;
    *n_keys = 0;
    int rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_CACHES], &cur);
    if (rc) return kvm_store__mdb(s, rc, "cursor");
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    kvm_store__cache_key(k, 0, kb);
    for (;;) {
        MDB_val key = {sizeof kb, kb}, val;
        rc = mdb_cursor_get(cur, &key, &val, MDB_SET_RANGE); /* re-seek after each delete */
        if (rc || key.mv_size != sizeof kb || memcmp(key.mv_data, kb, KVM_STORE__PREFIX_BYTES) != 0) break;
        *freed_bytes += (int64_t)val.mv_size;
        rc = mdb_cursor_del(cur, 0);
        if (rc) break;
        (*n_keys)++;
    }
    mdb_cursor_close(cur);
    if (rc && rc != MDB_NOTFOUND) return kvm_store__mdb(s, rc, "delete cache");
    int st = 0;
    if (*n_keys) {
        int64_t bytes;
        st = kvm_store__meta_get(s, txn, "cache_bytes", &bytes);
        bytes -= *freed_bytes;
        if (st == 0) st = kvm_store__meta_set(s, txn, "cache_bytes", bytes < 0 ? 0 : bytes);
    }
    if (st == 0) st = kvm_store__atime_del(s, txn, k);
    return st;
}

static int rm_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    int64_t freed, n_keys;
    int st = kvm_store__cache_delete(s, txn, arg, &freed, &n_keys);
    if (st == 0 && n_keys == 0) {
        char name[48];
        return kvm_err(KVM_ENOTFOUND, "store %s: no cache %s", s->path, kvm_store__key_name(arg, name));
    }
    return st;
}

int kvm_store_rm_cache(kvm_store *s, const kvm_store_cache_key *key)
{
    int st = kvm_store__lock(s);
    if (st) return st;
    st = kvm_store__write(s, rm_fn, (void *)key);
    kvm_store__unlock(s);
    return st;
}

/* ---- listing ---- */

/* A listing that re-seeks (MDB_SET_RANGE past a cache's keys) terminates only if each key it
 * lands on sorts after the last one: LMDB's binary search in a damaged page whose keys are out
 * of order can land before it, and the listing would visit the same caches forever. `last`
 * holds the previous cache key (have_last: whether there is one). KVM_ECORRUPT when the key
 * at `key` does not sort after it. */
static int key_advances(kvm_store *s, const MDB_val *key, uint8_t last[KVM_STORE__CACHE_KEY_BYTES], int *have_last)
{
    if (key->mv_size != KVM_STORE__CACHE_KEY_BYTES) return 0;
    if (*have_last && memcmp(key->mv_data, last, KVM_STORE__CACHE_KEY_BYTES) <= 0)
        return kvm_err(KVM_ECORRUPT, "store %s: caches db: keys out of order (a damaged B-tree page); run kvmill store "
                                     "verify", s->path);
    memcpy(last, key->mv_data, KVM_STORE__CACHE_KEY_BYTES);
    *have_last = 1;
    return 0;
}

/* Positions cur past every key of the cache whose key cur is on. */
static int skip_cache(MDB_cursor *cur, const uint8_t *prefix, MDB_val *key, MDB_val *val)
{
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    memcpy(kb, prefix, KVM_STORE__PREFIX_BYTES);
    memset(kb + KVM_STORE__PREFIX_BYTES, 0xff, 4);
    key->mv_size = sizeof kb;
    key->mv_data = kb;
    int rc = mdb_cursor_get(cur, key, val, MDB_SET_RANGE);
    if (rc == 0 && key->mv_size == sizeof kb && memcmp(key->mv_data, kb, sizeof kb) == 0)
        rc = mdb_cursor_get(cur, key, val, MDB_NEXT);
    return rc;
}

int kvm_store_list_caches(kvm_store *s, const kvm_store_id *model_id, kvm_store_cache_visit_fn fn, void *arg)
{
    MDB_txn *txn;
    MDB_cursor *cur;
    int st = kvm_store__cursor_begin(s, KVM_STORE__DB_CACHES, &txn, &cur);
    if (st) return st;
    MDB_val key = {model_id ? KVM_STORE_ID_BYTES : 0, model_id ? (void *)model_id->b : NULL}, val;
    uint8_t last[KVM_STORE__CACHE_KEY_BYTES];
    int have_last = 0;
    int rc = mdb_cursor_get(cur, &key, &val, model_id ? MDB_SET_RANGE : MDB_FIRST);
    while (st == 0 && rc == 0) {
        const uint8_t *kp = key.mv_data;
        if ((st = key_advances(s, &key, last, &have_last))) break;
        if (key.mv_size != KVM_STORE__CACHE_KEY_BYTES) { /* not a cache key: verify reports it */
            rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT);
            continue;
        }
        if (model_id && memcmp(kp, model_id->b, KVM_STORE_ID_BYTES) != 0) break;
        if (kvm_store__key_layer(kp) != KVM_STORE__MANIFEST) { /* layers: jump to the manifest */
            uint8_t prefix[KVM_STORE__PREFIX_BYTES];
            memcpy(prefix, kp, sizeof prefix);
            uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
            memcpy(kb, prefix, sizeof prefix);
            memset(kb + sizeof prefix, 0xff, 4);
            key = (MDB_val){sizeof kb, kb};
            rc = mdb_cursor_get(cur, &key, &val, MDB_SET_RANGE);
            continue;
        }
        kvm_store_cache_key k;
        kvm_store_manifest m;
        char name[48], what[96];
        kvm_store__prefix_decode(kp, &k);
        snprintf(what, sizeof what, "cache %s manifest", kvm_store__key_name(&k, name));
        int mst = kvm_store__manifest_parse(&key, &val, &m, what);
        st = fn(&k, mst ? NULL : &m, mst, arg);
        if (st == 0) rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT);
    }
    if (st == 0 && rc && rc != MDB_NOTFOUND) st = kvm_store__mdb(s, rc, "list caches");
    kvm_store__cursor_end(s, &txn, &cur);
    return st;
}

/* Splits "A:B:C" into three hex prefixes of 1..64 digits. */
static int split_key(const char *text, char parts[3][KVM_STORE_ID_HEX + 1])
{
    const char *p = text;
    for (int i = 0; i < 3; i++) {
        size_t n = strcspn(p, ":");
        if (n == 0 || n > KVM_STORE_ID_HEX || (i < 2 && p[n] != ':') || (i == 2 && p[n] != '\0'))
            return kvm_err(KVM_EINVAL, "key '%s': expected MODELID:DOCHASH:CONFIGID, each 1 to %d hex digits", text,
                           KVM_STORE_ID_HEX);
        memcpy(parts[i], p, n);
        parts[i][n] = '\0';
        if (strspn(parts[i], "0123456789abcdefABCDEF") != n)
            return kvm_err(KVM_EINVAL, "key '%s': '%s' is not hexadecimal", text, parts[i]);
        p += n + (i < 2);
    }
    return 0;
}

int kvm_store_find_cache(kvm_store *s, const char *text, kvm_store_cache_key *out)
{
    char parts[3][KVM_STORE_ID_HEX + 1];
    int st = split_key(text ? text : "", parts);
    if (st) return st;
    MDB_txn *txn;
    MDB_cursor *cur;
    if ((st = kvm_store__cursor_begin(s, KVM_STORE__DB_CACHES, &txn, &cur))) return st;
    int64_t n_match = 0;
    MDB_val key, val;
    uint8_t last[KVM_STORE__CACHE_KEY_BYTES];
    int have_last = 0;
    int rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST);
    while (st == 0 && rc == 0) {
        if ((st = key_advances(s, &key, last, &have_last))) break;
        if (key.mv_size != KVM_STORE__CACHE_KEY_BYTES) {
            rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT);
            continue;
        }
        kvm_store_cache_key k;
        kvm_store__prefix_decode(key.mv_data, &k);
        if (kvm_store_id_has_prefix(&k.model_id, parts[0]) && kvm_store_id_has_prefix(&k.doc_hash, parts[1]) &&
            kvm_store_id_has_prefix(&k.config_id, parts[2])) {
            if (n_match++ == 0) *out = k;
        }
        uint8_t prefix[KVM_STORE__PREFIX_BYTES];
        memcpy(prefix, key.mv_data, sizeof prefix);
        rc = skip_cache(cur, prefix, &key, &val);
    }
    if (st == 0 && rc && rc != MDB_NOTFOUND) st = kvm_store__mdb(s, rc, "find cache");
    kvm_store__cursor_end(s, &txn, &cur);
    if (st) return st;
    if (n_match == 0) return kvm_err(KVM_ENOTFOUND, "key '%s': no cache in store %s matches", text, s->path);
    if (n_match > 1)
        return kvm_err(KVM_EINVAL, "key '%s' is ambiguous: it matches %lld caches; give more hex digits", text,
                       (long long)n_match);
    return 0;
}

int kvm_store_doc_configs(kvm_store *s, const kvm_store_id *model_id, const kvm_store_id *doc_hash,
                          kvm_store_id *configs, int max, int *n)
{
    *n = 0;
    MDB_txn *txn;
    MDB_cursor *cur;
    int st = kvm_store__cursor_begin(s, KVM_STORE__DB_CACHES, &txn, &cur);
    if (st) return st;
    uint8_t start[2 * KVM_STORE_ID_BYTES], last[KVM_STORE__CACHE_KEY_BYTES];
    int have_last = 0;
    MDB_val key = {sizeof start, start}, val;
    memcpy(start, model_id->b, KVM_STORE_ID_BYTES);
    memcpy(start + KVM_STORE_ID_BYTES, doc_hash->b, KVM_STORE_ID_BYTES);
    int rc = mdb_cursor_get(cur, &key, &val, MDB_SET_RANGE);
    while (st == 0 && rc == 0) {
        const uint8_t *kp = key.mv_data;
        if (key.mv_size != KVM_STORE__CACHE_KEY_BYTES) { /* not a cache key: verify reports it */
            rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT);
            continue;
        }
        if (memcmp(kp, start, sizeof start) != 0) break; /* past this model's document */
        if ((st = key_advances(s, &key, last, &have_last))) break;
        if (kvm_store__key_layer(kp) != KVM_STORE__MANIFEST) { /* layers: jump to the manifest */
            uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
            memcpy(kb, kp, KVM_STORE__PREFIX_BYTES);
            memset(kb + KVM_STORE__PREFIX_BYTES, 0xff, 4);
            key = (MDB_val){sizeof kb, kb};
            rc = mdb_cursor_get(cur, &key, &val, MDB_SET_RANGE);
            continue;
        }
        if (*n < max) memcpy(configs[*n].b, kp + 2 * KVM_STORE_ID_BYTES, KVM_STORE_ID_BYTES);
        (*n)++;
        rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT);
    }
    if (st == 0 && rc && rc != MDB_NOTFOUND) st = kvm_store__mdb(s, rc, "list a document's caches");
    kvm_store__cursor_end(s, &txn, &cur);
    return st;
}
