/* kvm_store_docnames.c: the document-name index (`docnames` db) behind `kvmill ask --doc-name`:
 * one key per docs record, BLAKE2b-256 of the last '/'-part of its source + its doc hash, written
 * in the transaction that writes the record, so a name is found by a range lookup instead of a
 * read of every stored document. Stores written by older builds are indexed on this build's
 * first writable open (and again whenever the two counts differ); until then, and for a
 * read-only open of such a store, a lookup reads every docs record (and says so). */
#include "store/kvm_store_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"

#define DOC_FIXED (8 + 256)

/* The last '/'-part of s[0, len). */
static const char *last_part(const char *s, size_t len, size_t *n)
{
    size_t i = len;
    while (i > 0 && s[i - 1] != '/') i--;
    *n = len - i;
    return s + i;
}

void kvm_store__docname_key(const char *source, size_t len, const kvm_store_id *doc_hash,
                            uint8_t out[KVM_STORE__DOCNAME_KEY_BYTES])
{
    size_t n;
    const char *base = last_part(source, len, &n);
    kvm_store_id h;
    kvm_store_hash_bytes(base, n, &h);
    memcpy(out, h.b, KVM_STORE_ID_BYTES);
    memcpy(out + KVM_STORE_ID_BYTES, doc_hash->b, KVM_STORE_ID_BYTES);
}

/* The source string of a checked docs record's fixed part, or NULL (wrong size, unterminated). */
static const char *record_source(const kvm_frame *part)
{
    if (part->size != DOC_FIXED || part->data[8 + 255] != '\0') return NULL;
    return (const char *)part->data + 8;
}

/* The fixed part of the docs record under key, checked; 0 with *src = NULL when it is absent or
 * fails its checks (a corrupt record has no index entry to remove: verify reports it). */
static int doc_source(kvm_store *s, MDB_txn *txn, const MDB_val *key, const char **src)
{
    MDB_val k = *key, val;
    *src = NULL;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_DOCS], &k, &val);
    if (rc == MDB_NOTFOUND) return 0;
    if (rc) return kvm_store__mdb(s, rc, "doc meta");
    uint32_t np;
    if (kvm_store__rec_check(&k, &val, KVM_STORE__KIND_DOC, &np, "doc meta") || np != 1) return 0;
    kvm_frame part;
    kvm_store__rec_parts(&val, &part, 1);
    *src = record_source(&part);
    return 0;
}

int kvm_store__doc_put(kvm_store *s, MDB_txn *txn, const kvm_store_id *doc_hash, const uint8_t *fixed, size_t n)
{
    MDB_val key = {KVM_STORE_ID_BYTES, (void *)doc_hash->b}, empty = {0, ""};
    const char *old;
    uint8_t nk[KVM_STORE__DOCNAME_KEY_BYTES];
    int st = doc_source(s, txn, &key, &old);
    if (st) return st;
    if (old) { /* the entry of the source it replaces (the same one when the name is unchanged) */
        kvm_store__docname_key(old, strlen(old), doc_hash, nk);
        MDB_val k = {sizeof nk, nk};
        int rc = mdb_del(txn, s->dbi[KVM_STORE__DB_DOCNAMES], &k, NULL);
        if (rc && rc != MDB_NOTFOUND) return kvm_store__mdb(s, rc, "docnames");
    }
    kvm_frame part = {fixed, n};
    int rc = kvm_store__rec_put(txn, s->dbi[KVM_STORE__DB_DOCS], &key, KVM_STORE__KIND_DOC, &part, 1);
    if (rc) return kvm_store__mdb(s, rc, "doc meta");
    const char *src = (const char *)fixed + 8;
    kvm_store__docname_key(src, strnlen(src, n - 8), doc_hash, nk);
    MDB_val k = {sizeof nk, nk};
    rc = mdb_put(txn, s->dbi[KVM_STORE__DB_DOCNAMES], &k, &empty, 0);
    return rc ? kvm_store__mdb(s, rc, "docnames") : 0;
}

static int entries(kvm_store *s, MDB_txn *txn, int db, int64_t *n)
{
    MDB_stat ms;
    int rc = mdb_stat(txn, s->dbi[db], &ms);
    *n = rc ? 0 : (int64_t)ms.ms_entries;
    return rc ? kvm_store__mdb(s, rc, db == KVM_STORE__DB_DOCS ? "docs" : "docnames") : 0;
}

int kvm_store__docnames_sync(kvm_store *s, MDB_txn *txn)
{
    int64_t n_docs, n_names;
    int st = entries(s, txn, KVM_STORE__DB_DOCS, &n_docs);
    if (st == 0) st = entries(s, txn, KVM_STORE__DB_DOCNAMES, &n_names);
    if (st || n_docs == n_names) return st;
    int rc = mdb_drop(txn, s->dbi[KVM_STORE__DB_DOCNAMES], 0); /* emptied, then one entry per readable record */
    if (rc) return kvm_store__mdb(s, rc, "docnames");
    MDB_cursor *cur;
    MDB_val key, val, empty = {0, ""};
    if ((rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_DOCS], &cur))) return kvm_store__mdb(s, rc, "docs cursor");
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        uint32_t np;
        kvm_frame part;
        if (key.mv_size != KVM_STORE_ID_BYTES || kvm_store__rec_check(&key, &val, KVM_STORE__KIND_DOC, &np, "doc meta") ||
            np != 1)
            continue; /* corrupt: verify names it */
        kvm_store__rec_parts(&val, &part, 1);
        const char *src = record_source(&part);
        if (!src) continue;
        kvm_store_id h;
        memcpy(h.b, key.mv_data, KVM_STORE_ID_BYTES);
        uint8_t nk[KVM_STORE__DOCNAME_KEY_BYTES];
        kvm_store__docname_key(src, strlen(src), &h, nk);
        MDB_val k = {sizeof nk, nk};
        int prc = mdb_put(txn, s->dbi[KVM_STORE__DB_DOCNAMES], &k, &empty, 0);
        if (prc) {
            mdb_cursor_close(cur);
            return kvm_store__mdb(s, prc, "docnames");
        }
    }
    mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : kvm_store__mdb(s, rc, "docs");
}

/* 1 when a stored source is `name`, or ends in "/" + name. */
static int name_matches(const char *source, const char *name, size_t len)
{
    size_t n = strlen(source);
    if (n == len && !memcmp(source, name, len)) return 1;
    return n > len && source[n - len - 1] == '/' && !memcmp(source + n - len, name, len);
}

/* Appends a match to the caller's growing array. */
static int add_match(kvm_store_doc_match **out, int64_t *n, int64_t *cap, const uint8_t *hash, const char *src,
                     int64_t n_tokens)
{
    if (*n == *cap) {
        int64_t c = *cap ? 2 * *cap : 8;
        kvm_store_doc_match *m = realloc(*out, (size_t)c * sizeof *m);
        if (!m) return kvm_err(KVM_ENOMEM, "out of memory listing the documents of a name");
        *out = m;
        *cap = c;
    }
    kvm_store_doc_match *m = &(*out)[(*n)++];
    memcpy(m->doc_hash.b, hash, KVM_STORE_ID_BYTES);
    m->meta.n_tokens = n_tokens;
    memset(m->meta.source, 0, sizeof m->meta.source);
    memcpy(m->meta.source, src, strlen(src));
    return 0;
}

/* Every readable docs record whose source matches (an index that cannot be trusted). */
static int find_by_scan(kvm_store *s, MDB_txn *txn, const char *name, size_t len, kvm_store_doc_match **out,
                        int64_t *n, int64_t *cap)
{
    MDB_cursor *cur;
    MDB_val key, val;
    int rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_DOCS], &cur), st = 0;
    if (rc) return kvm_store__mdb(s, rc, "docs cursor");
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST); rc == 0 && st == 0;
         rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        uint32_t np;
        kvm_frame part;
        if (key.mv_size != KVM_STORE_ID_BYTES || kvm_store__rec_check(&key, &val, KVM_STORE__KIND_DOC, &np, "doc meta") ||
            np != 1)
            continue;
        kvm_store__rec_parts(&val, &part, 1);
        const char *src = record_source(&part);
        if (src && name_matches(src, name, len))
            st = add_match(out, n, cap, key.mv_data, src, (int64_t)kvm_store__get_u64(part.data));
    }
    mdb_cursor_close(cur);
    if (st) return st;
    return rc == 0 || rc == MDB_NOTFOUND ? 0 : kvm_store__mdb(s, rc, "docs");
}

/* The index entries under the name's hash, each checked against its docs record. */
static int find_by_index(kvm_store *s, MDB_txn *txn, const char *name, size_t len, kvm_store_doc_match **out,
                         int64_t *n, int64_t *cap)
{
    kvm_store_id zero = {{0}};
    uint8_t nk[KVM_STORE__DOCNAME_KEY_BYTES];
    kvm_store__docname_key(name, len, &zero, nk); /* the first key of the name's range */
    MDB_cursor *cur;
    MDB_val key = {sizeof nk, nk}, val;
    int rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_DOCNAMES], &cur), st = 0;
    if (rc) return kvm_store__mdb(s, rc, "docnames cursor");
    for (rc = mdb_cursor_get(cur, &key, &val, MDB_SET_RANGE); rc == 0 && st == 0;
         rc = mdb_cursor_get(cur, &key, &val, MDB_NEXT)) {
        if (key.mv_size != KVM_STORE__DOCNAME_KEY_BYTES || memcmp(key.mv_data, nk, KVM_STORE_ID_BYTES)) break;
        MDB_val dk = {KVM_STORE_ID_BYTES, (uint8_t *)key.mv_data + KVM_STORE_ID_BYTES}, dv;
        uint32_t np;
        kvm_frame part;
        const char *src = NULL;
        if (mdb_get(txn, s->dbi[KVM_STORE__DB_DOCS], &dk, &dv) == 0 &&
            kvm_store__rec_check(&dk, &dv, KVM_STORE__KIND_DOC, &np, "doc meta") == 0 && np == 1) {
            kvm_store__rec_parts(&dv, &part, 1);
            src = record_source(&part);
        }
        if (src && name_matches(src, name, len))
            st = add_match(out, n, cap, dk.mv_data, src, (int64_t)kvm_store__get_u64(part.data));
    }
    mdb_cursor_close(cur);
    if (st) return st;
    return rc == 0 || rc == MDB_NOTFOUND ? 0 : kvm_store__mdb(s, rc, "docnames");
}

int kvm_store_find_docs(kvm_store *s, const char *name, size_t len, kvm_store_doc_match **out, int64_t *n_out,
                        int *scanned)
{
    if (out) *out = NULL;
    if (n_out) *n_out = 0;
    if (scanned) *scanned = 0;
    if (!out || !n_out || !name || len == 0 || memchr(name, '\0', len))
        return kvm_err(KVM_EINVAL, "store: find documents: a name without NUL and outputs are needed");
    /* as a source is stored: its first 255 bytes, cut at a character; an older kvmill cut inside
     * one, and a name it stored is found by those 255 bytes when the cut one finds nothing */
    const size_t raw =
        len < sizeof((kvm_store_doc_meta *)0)->source - 1 ? len : sizeof((kvm_store_doc_meta *)0)->source - 1;
    len = kvm_store_doc_source_len(name, len);
    int st = kvm_store__lock(s);
    if (st) return st;
    MDB_txn *txn;
    int64_t n = 0, cap = 0;
    if ((st = kvm_store__read_begin(s, &txn)) == 0) {
        int64_t n_docs = 0, n_names = -1;
        int use_index = !s->no_docnames;
        if (use_index) {
            st = entries(s, txn, KVM_STORE__DB_DOCS, &n_docs);
            if (st == 0) st = entries(s, txn, KVM_STORE__DB_DOCNAMES, &n_names);
            use_index = n_docs == n_names;
        }
        if (st == 0) st = use_index ? find_by_index(s, txn, name, len, out, &n, &cap) : find_by_scan(s, txn, name, len, out, &n, &cap);
        if (st == 0 && n == 0 && raw != len) {
            len = raw;
            st = use_index ? find_by_index(s, txn, name, len, out, &n, &cap)
                           : find_by_scan(s, txn, name, len, out, &n, &cap);
        }
        if (scanned) *scanned = !use_index;
        mdb_txn_abort(txn);
    }
    kvm_store__unlock(s);
    if (st) {
        free(*out);
        *out = NULL;
        n = 0;
    }
    /* a source that is the name itself wins over those that end in "/" + name */
    int64_t n_exact = 0;
    for (int64_t i = 0; i < n; i++)
        if (strlen((*out)[i].meta.source) == len && !memcmp((*out)[i].meta.source, name, len))
            (*out)[n_exact++] = (*out)[i];
    if (n_exact) n = n_exact;
    *n_out = n;
    return st;
}
