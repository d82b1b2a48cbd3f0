/* kvm_store_meta.c: the small records: strategies (opaque bytes by model id + name, never
 * evicted), model metadata (by model id) and document metadata (by doc hash). Each is one
 * checksummed record of one part. */
#include "store/kvm_store_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"
#include "model/kvm_utf8.h"

#define MODEL_FIXED (64 + 256 + 8 * 4)
#define DOC_FIXED (8 + 256)

typedef struct one_arg {
    int db;          /* enum kvm_store__db */
    MDB_val key;     /* record key */
    uint16_t kind;   /* enum kvm_store__kind */
    kvm_frame part;  /* the one part */
    const char *what; /* for messages */
} one_arg;

static int put_one_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    const one_arg *a = arg;
    int rc = kvm_store__rec_put(txn, s->dbi[a->db], &a->key, a->kind, &a->part, 1);
    return rc ? kvm_store__mdb(s, rc, a->what) : 0;
}

static int put_one(kvm_store *s, one_arg *a)
{
    int st = kvm_store__lock(s);
    if (st) return st;
    st = kvm_store__write(s, put_one_fn, a);
    kvm_store__unlock(s);
    return st;
}

/* Reads one record and returns a malloc'ed copy of its part (NUL-terminated, never NULL). */
static int get_one(kvm_store *s, const one_arg *a, uint8_t **copy, size_t *size)
{
    *copy = NULL;
    *size = 0;
    int st = kvm_store__lock(s);
    if (st) return st;
    MDB_txn *txn;
    st = kvm_store__read_begin(s, &txn);
    if (st == 0) {
        MDB_val key = a->key, val;
        uint32_t np = 0;
        int rc = mdb_get(txn, s->dbi[a->db], &key, &val);
        if (rc == MDB_NOTFOUND) st = kvm_err(KVM_ENOTFOUND, "store %s: no %s", s->path, a->what);
        else if (rc) st = kvm_store__mdb(s, rc, a->what);
        else st = kvm_store__rec_check(&key, &val, a->kind, &np, a->what);
        if (st == 0 && np != 1) st = kvm_err(KVM_ECORRUPT, "%s: %u parts, expected 1", a->what, np);
        if (st == 0) {
            kvm_frame part;
            kvm_store__rec_parts(&val, &part, 1);
            *copy = malloc(part.size + 1);
            if (!*copy) st = kvm_err(KVM_ENOMEM, "%s: out of memory", a->what);
            else {
                if (part.size) memcpy(*copy, part.data, part.size);
                (*copy)[part.size] = '\0';
                *size = part.size;
            }
        }
        mdb_txn_abort(txn);
    }
    kvm_store__unlock(s);
    return st;
}

/* ---- strategies ---- */

static int strategy_key(const kvm_store_id *model_id, const char *name, uint8_t *kb, size_t *n)
{
    size_t len = name ? strlen(name) : 0;
    if (!model_id || len == 0 || len > KVM_STORE_MAX_NAME)
        return kvm_err(KVM_EINVAL, "strategy: name must be 1 to %d bytes and the model id given", KVM_STORE_MAX_NAME);
    memcpy(kb, model_id->b, KVM_STORE_ID_BYTES);
    memcpy(kb + KVM_STORE_ID_BYTES, name, len);
    *n = KVM_STORE_ID_BYTES + len;
    return 0;
}

int kvm_store_put_strategy(kvm_store *s, const kvm_store_id *model_id, const char *name, const void *data, size_t size)
{
    uint8_t kb[KVM_STORE_ID_BYTES + KVM_STORE_MAX_NAME];
    size_t n;
    int st = strategy_key(model_id, name, kb, &n);
    if (st) return st;
    if (size && !data) return kvm_err(KVM_EINVAL, "strategy %s: NULL data", name);
    one_arg a = {KVM_STORE__DB_STRATEGIES, {n, kb}, KVM_STORE__KIND_STRATEGY, {data, size}, "strategy"};
    return put_one(s, &a);
}

int kvm_store_get_strategy(kvm_store *s, const kvm_store_id *model_id, const char *name, uint8_t **data,
                           size_t *size)
{
    uint8_t kb[KVM_STORE_ID_BYTES + KVM_STORE_MAX_NAME];
    size_t n;
    *data = NULL;
    *size = 0;
    int st = strategy_key(model_id, name, kb, &n);
    if (st) return st;
    char what[KVM_STORE_MAX_NAME + 32];
    snprintf(what, sizeof what, "strategy '%s'", name);
    one_arg a = {KVM_STORE__DB_STRATEGIES, {n, kb}, KVM_STORE__KIND_STRATEGY, {NULL, 0}, what};
    return get_one(s, &a, data, size);
}

typedef struct rm_arg {
    MDB_val key;      /* strategy key */
    const char *name; /* for messages */
} rm_arg;

static int rm_strategy_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    rm_arg *a = arg;
    int rc = mdb_del(txn, s->dbi[KVM_STORE__DB_STRATEGIES], &a->key, NULL);
    if (rc == MDB_NOTFOUND) return kvm_err(KVM_ENOTFOUND, "store %s: no strategy '%s'", s->path, a->name);
    return rc ? kvm_store__mdb(s, rc, "strategy") : 0;
}

int kvm_store_rm_strategy(kvm_store *s, const kvm_store_id *model_id, const char *name)
{
    uint8_t kb[KVM_STORE_ID_BYTES + KVM_STORE_MAX_NAME];
    size_t n;
    int st = strategy_key(model_id, name, kb, &n);
    if (st) return st;
    rm_arg a = {{n, kb}, name};
    st = kvm_store__lock(s);
    if (st) return st;
    st = kvm_store__write(s, rm_strategy_fn, &a);
    kvm_store__unlock(s);
    return st;
}

int kvm_store_list_strategies(kvm_store *s, const kvm_store_id *model_id, kvm_store_strategy_visit_fn fn, void *arg)
{
    MDB_txn *txn;
    MDB_cursor *cur;
    int st = kvm_store__cursor_begin(s, KVM_STORE__DB_STRATEGIES, &txn, &cur);
    if (st) return st;
    MDB_val key = {model_id ? KVM_STORE_ID_BYTES : 0, model_id ? (void *)model_id->b : NULL}, val;
    int rc = mdb_cursor_get(cur, &key, &val, model_id ? MDB_SET_RANGE : MDB_FIRST);
    while (st == 0 && rc == 0) {
        const uint8_t *kp = key.mv_data;
        if (model_id && (key.mv_size < KVM_STORE_ID_BYTES || memcmp(kp, model_id->b, KVM_STORE_ID_BYTES) != 0)) break;
        if (key.mv_size > KVM_STORE_ID_BYTES && key.mv_size <= KVM_STORE_ID_BYTES + KVM_STORE_MAX_NAME) {
            kvm_store_id mid;
            char name[KVM_STORE_MAX_NAME + 1];
            size_t len = key.mv_size - KVM_STORE_ID_BYTES;
            memcpy(mid.b, kp, KVM_STORE_ID_BYTES);
            memcpy(name, kp + KVM_STORE_ID_BYTES, len);
            name[len] = '\0';
            uint32_t np;
            kvm_frame part = {NULL, 0};
            if (kvm_store__rec_check(&key, &val, KVM_STORE__KIND_STRATEGY, &np, "strategy") == 0 && np == 1)
                kvm_store__rec_parts(&val, &part, 1);
            st = fn(&mid, name, part.size, arg);
        }
        if (st == 0) rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT);
    }
    if (st == 0 && rc && rc != MDB_NOTFOUND) st = kvm_store__mdb(s, rc, "list strategies");
    kvm_store__cursor_end(s, &txn, &cur);
    return st;
}

/* ---- models and documents ---- */

static int str_ok(const char *s, size_t cap) { return memchr(s, '\0', cap) != NULL; }

int kvm_store_put_model(kvm_store *s, const kvm_store_id *model_id, const kvm_store_model_meta *meta)
{
    if (!model_id || !meta || !str_ok(meta->name, sizeof meta->name) || !str_ok(meta->source, sizeof meta->source))
        return kvm_err(KVM_EINVAL, "model meta: NULL argument or unterminated name/source");
    uint8_t b[MODEL_FIXED] = {0};
    memcpy(b, meta->name, strlen(meta->name));
    memcpy(b + 64, meta->source, strlen(meta->source));
    const int32_t v[8] = {meta->dim,        meta->hidden_dim, meta->n_layers,   meta->n_heads,
                          meta->n_kv_heads, meta->head_dim,   meta->vocab_size, meta->seq_len};
    for (int i = 0; i < 8; i++) kvm_store__put_u32(b + 320 + 4 * i, (uint32_t)v[i]);
    one_arg a = {KVM_STORE__DB_MODELS, {KVM_STORE_ID_BYTES, (void *)model_id->b}, KVM_STORE__KIND_MODEL, {b, sizeof b},
                 "model meta"};
    return put_one(s, &a);
}

int kvm_store_get_model(kvm_store *s, const kvm_store_id *model_id, kvm_store_model_meta *out)
{
    memset(out, 0, sizeof *out);
    one_arg a = {KVM_STORE__DB_MODELS, {KVM_STORE_ID_BYTES, (void *)model_id->b}, KVM_STORE__KIND_MODEL, {NULL, 0},
                 "model meta"};
    uint8_t *b;
    size_t n;
    int st = get_one(s, &a, &b, &n);
    if (st) return st;
    if (n != MODEL_FIXED || b[63] != '\0' || b[64 + 255] != '\0') {
        free(b);
        return kvm_err(KVM_ECORRUPT, "model meta: %zu bytes or unterminated strings", n);
    }
    memcpy(out->name, b, 64);
    memcpy(out->source, b + 64, 256);
    int32_t *v[8] = {&out->dim,        &out->hidden_dim, &out->n_layers,   &out->n_heads,
                     &out->n_kv_heads, &out->head_dim,   &out->vocab_size, &out->seq_len};
    for (int i = 0; i < 8; i++) *v[i] = (int32_t)kvm_store__get_u32(b + 320 + 4 * i);
    free(b);
    return 0;
}

typedef struct doc_arg {
    const kvm_store_id *doc_hash; /* the record's key */
    uint8_t fixed[DOC_FIXED];     /* its one part: n_tokens, source */
} doc_arg;

/* The doc record and its name-index entry, in one transaction. */
static int put_doc_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    const doc_arg *a = arg;
    return kvm_store__doc_put(s, txn, a->doc_hash, a->fixed, sizeof a->fixed);
}

int kvm_store_put_doc(kvm_store *s, const kvm_store_id *doc_hash, const kvm_store_doc_meta *meta)
{
    if (!doc_hash || !meta || !str_ok(meta->source, sizeof meta->source) || meta->n_tokens < 0)
        return kvm_err(KVM_EINVAL, "doc meta: NULL argument, negative n_tokens or unterminated source");
    doc_arg a = {doc_hash, {0}};
    kvm_store__put_u64(a.fixed, (uint64_t)meta->n_tokens);
    memcpy(a.fixed + 8, meta->source, strlen(meta->source));
    int st = kvm_store__lock(s);
    if (st) return st;
    st = kvm_store__write(s, put_doc_fn, &a);
    kvm_store__unlock(s);
    return st;
}

size_t kvm_store_doc_source_len(const char *name, size_t len)
{
    return kvm_utf8_cut(name, len, sizeof((kvm_store_doc_meta *)0)->source - 1);
}

void kvm_store_doc_set_source(kvm_store_doc_meta *meta, const char *name, size_t len)
{
    size_t n = len ? kvm_store_doc_source_len(name, len) : 0;
    if (n) memcpy(meta->source, name, n);
    meta->source[n] = '\0';
}

int kvm_store_get_doc(kvm_store *s, const kvm_store_id *doc_hash, kvm_store_doc_meta *out)
{
    memset(out, 0, sizeof *out);
    one_arg a = {KVM_STORE__DB_DOCS, {KVM_STORE_ID_BYTES, (void *)doc_hash->b}, KVM_STORE__KIND_DOC, {NULL, 0},
                 "doc meta"};
    uint8_t *b;
    size_t n;
    int st = get_one(s, &a, &b, &n);
    if (st) return st;
    if (n != DOC_FIXED || b[8 + 255] != '\0') {
        free(b);
        return kvm_err(KVM_ECORRUPT, "doc meta: %zu bytes or unterminated source", n);
    }
    out->n_tokens = (int64_t)kvm_store__get_u64(b);
    memcpy(out->source, b + 8, 256);
    free(b);
    return 0;
}
