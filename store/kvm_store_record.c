/* kvm_store_record.c: the on-disk encodings: fixed-width keys, the checksummed record that
 * wraps every stored value (layout in kvm_store_internal.h), and the manifest's fields.
 * Every decoder treats the bytes as untrusted: a bad value is an error, never a crash. */
#include "store/kvm_store_internal.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>

#include "common/kvm_error.h"

void kvm_store__put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

void kvm_store__put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void kvm_store__put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void kvm_store__put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i));
}

uint16_t kvm_store__get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

uint32_t kvm_store__get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint64_t kvm_store__get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

void kvm_store__prefix(const kvm_store_cache_key *k, uint8_t out[KVM_STORE__PREFIX_BYTES])
{
    memcpy(out, k->model_id.b, KVM_STORE_ID_BYTES);
    memcpy(out + KVM_STORE_ID_BYTES, k->doc_hash.b, KVM_STORE_ID_BYTES);
    memcpy(out + 2 * KVM_STORE_ID_BYTES, k->config_id.b, KVM_STORE_ID_BYTES);
}

void kvm_store__prefix_decode(const uint8_t *p, kvm_store_cache_key *k)
{
    memcpy(k->model_id.b, p, KVM_STORE_ID_BYTES);
    memcpy(k->doc_hash.b, p + KVM_STORE_ID_BYTES, KVM_STORE_ID_BYTES);
    memcpy(k->config_id.b, p + 2 * KVM_STORE_ID_BYTES, KVM_STORE_ID_BYTES);
}

void kvm_store__cache_key(const kvm_store_cache_key *k, uint32_t layer, uint8_t out[KVM_STORE__CACHE_KEY_BYTES])
{
    kvm_store__prefix(k, out);
    uint8_t *p = out + KVM_STORE__PREFIX_BYTES; /* big-endian so layers sort in order */
    p[0] = (uint8_t)(layer >> 24);
    p[1] = (uint8_t)(layer >> 16);
    p[2] = (uint8_t)(layer >> 8);
    p[3] = (uint8_t)layer;
}

uint32_t kvm_store__key_layer(const uint8_t *key)
{
    const uint8_t *p = key + KVM_STORE__PREFIX_BYTES;
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

const char *kvm_store__key_name(const kvm_store_cache_key *k, char out[48])
{
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], c[KVM_STORE_ID_HEX + 1];
    snprintf(out, 48, "%.12s:%.12s:%.12s", kvm_store_id_hex(&k->model_id, a), kvm_store_id_hex(&k->doc_hash, b),
             kvm_store_id_hex(&k->config_id, c));
    return out;
}

size_t kvm_store__rec_size(const kvm_frame *parts, uint32_t n_parts)
{
    size_t n = KVM_STORE__REC_HEADER + 8 * (size_t)n_parts + KVM_STORE__REC_SUM;
    for (uint32_t i = 0; i < n_parts; i++) n += parts[i].size;
    return n;
}

void kvm_store__rec_write(uint8_t *dst, const MDB_val *key, uint16_t kind, const kvm_frame *parts,
                          uint32_t n_parts)
{
    memcpy(dst, KVM_STORE__REC_MAGIC, 4);
    kvm_store__put_u16(dst + 4, (uint16_t)KVM_STORE_FORMAT_VERSION);
    kvm_store__put_u16(dst + 6, kind);
    kvm_store__put_u32(dst + 8, n_parts);
    kvm_store__put_u32(dst + 12, 0);
    uint8_t *p = dst + KVM_STORE__REC_HEADER;
    for (uint32_t i = 0; i < n_parts; i++, p += 8) kvm_store__put_u64(p, parts[i].size);
    for (uint32_t i = 0; i < n_parts; i++) {
        if (parts[i].size) memcpy(p, parts[i].data, parts[i].size);
        p += parts[i].size;
    }
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KVM_STORE__REC_SUM);
    crypto_generichash_update(&h, key->mv_data, key->mv_size);
    crypto_generichash_update(&h, dst, (size_t)(p - dst));
    crypto_generichash_final(&h, p, KVM_STORE__REC_SUM);
}

int kvm_store__rec_put(MDB_txn *txn, MDB_dbi dbi, const MDB_val *key, uint16_t kind, const kvm_frame *parts,
                       uint32_t n_parts)
{
    MDB_val k = *key, d = {kvm_store__rec_size(parts, n_parts), NULL};
    int rc = mdb_put(txn, dbi, &k, &d, MDB_RESERVE);
    if (rc) return rc;
    kvm_store__rec_write(d.mv_data, key, kind, parts, n_parts);
    return 0;
}

int kvm_store__rec_check(const MDB_val *key, const MDB_val *val, uint16_t kind, uint32_t *n_parts,
                         const char *what)
{
    const uint8_t *v = val->mv_data;
    size_t n = val->mv_size;
    *n_parts = 0;
    if (n < KVM_STORE__REC_HEADER + KVM_STORE__REC_SUM)
        return kvm_err(KVM_ECORRUPT, "%s: value of %zu bytes is shorter than a record", what, n);
    if (memcmp(v, KVM_STORE__REC_MAGIC, 4) != 0) return kvm_err(KVM_ECORRUPT, "%s: bad record magic", what);
    uint8_t sum[KVM_STORE__REC_SUM];
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KVM_STORE__REC_SUM);
    crypto_generichash_update(&h, key->mv_data, key->mv_size);
    crypto_generichash_update(&h, v, n - KVM_STORE__REC_SUM);
    crypto_generichash_final(&h, sum, KVM_STORE__REC_SUM);
    if (sodium_memcmp(sum, v + n - KVM_STORE__REC_SUM, KVM_STORE__REC_SUM) != 0)
        return kvm_err(KVM_ECORRUPT, "%s: checksum mismatch (value of %zu bytes)", what, n);
    uint16_t version = kvm_store__get_u16(v + 4);
    if (version != KVM_STORE_FORMAT_VERSION)
        return kvm_err(KVM_EMISMATCH, "%s: written by store format version %u, this build reads version %u", what,
                       (unsigned)version, KVM_STORE_FORMAT_VERSION);
    uint16_t k = kvm_store__get_u16(v + 6);
    if (k != kind) return kvm_err(KVM_ECORRUPT, "%s: record kind %u, expected %u", what, (unsigned)k, (unsigned)kind);
    uint32_t np = kvm_store__get_u32(v + 8);
    size_t body = n - KVM_STORE__REC_HEADER - KVM_STORE__REC_SUM;
    if (np > KVM_STORE_MAX_FRAMES || (size_t)np * 8 > body)
        return kvm_err(KVM_ECORRUPT, "%s: %u parts do not fit in %zu bytes", what, np, body);
    size_t left = body - (size_t)np * 8;
    for (uint32_t i = 0; i < np; i++) {
        uint64_t len = kvm_store__get_u64(v + KVM_STORE__REC_HEADER + 8 * (size_t)i);
        if (len > left) return kvm_err(KVM_ECORRUPT, "%s: part %u length %llu overruns the value", what, i, (unsigned long long)len);
        left -= (size_t)len;
    }
    if (left != 0) return kvm_err(KVM_ECORRUPT, "%s: %zu stray bytes after the parts", what, left);
    *n_parts = np;
    return 0;
}

void kvm_store__rec_parts(const MDB_val *val, kvm_frame *parts, uint32_t n_parts)
{
    const uint8_t *v = val->mv_data;
    const uint8_t *p = v + KVM_STORE__REC_HEADER + 8 * (size_t)n_parts;
    for (uint32_t i = 0; i < n_parts; i++) {
        parts[i].size = (size_t)kvm_store__get_u64(v + KVM_STORE__REC_HEADER + 8 * (size_t)i);
        parts[i].data = p;
        p += parts[i].size;
    }
}

void kvm_store__manifest_encode(const kvm_store_manifest *m, uint8_t out[KVM_STORE__MANIFEST_FIXED])
{
    memset(out, 0, KVM_STORE__MANIFEST_FIXED);
    kvm_store__put_u32(out, (uint32_t)m->n_layers);
    kvm_store__put_u64(out + 8, (uint64_t)m->n_tokens);
    kvm_store__put_u64(out + 16, (uint64_t)m->n_entries);
    kvm_store__put_u64(out + 24, (uint64_t)m->stored_bytes);
    kvm_store__put_u64(out + 32, (uint64_t)m->full_bytes);
    kvm_store__put_u64(out + 40, (uint64_t)m->created_unix_ms);
    memcpy(out + 48, m->dtype, strnlen(m->dtype, sizeof m->dtype - 1));
    memcpy(out + 64, m->model_id.b, KVM_STORE_ID_BYTES);
    memcpy(out + 96, m->doc_hash.b, KVM_STORE_ID_BYTES);
    memcpy(out + 128, m->config_id.b, KVM_STORE_ID_BYTES);
    memcpy(out + 160, m->tokenizer_id.b, KVM_STORE_ID_BYTES);
}

int kvm_store__manifest_decode(const kvm_frame *fixed, const kvm_frame *config, kvm_store_manifest *m,
                               const char *what)
{
    memset(m, 0, sizeof *m);
    if (fixed->size != KVM_STORE__MANIFEST_FIXED)
        return kvm_err(KVM_ECORRUPT, "%s: manifest fields are %zu bytes, expected %d", what, fixed->size,
                       KVM_STORE__MANIFEST_FIXED);
    const uint8_t *p = fixed->data;
    m->format_version = KVM_STORE_FORMAT_VERSION;
    m->n_layers = (int32_t)kvm_store__get_u32(p);
    m->n_tokens = (int64_t)kvm_store__get_u64(p + 8);
    m->n_entries = (int64_t)kvm_store__get_u64(p + 16);
    m->stored_bytes = (int64_t)kvm_store__get_u64(p + 24);
    m->full_bytes = (int64_t)kvm_store__get_u64(p + 32);
    m->created_unix_ms = (int64_t)kvm_store__get_u64(p + 40);
    memcpy(m->dtype, p + 48, 16);
    memcpy(m->model_id.b, p + 64, KVM_STORE_ID_BYTES);
    memcpy(m->doc_hash.b, p + 96, KVM_STORE_ID_BYTES);
    memcpy(m->config_id.b, p + 128, KVM_STORE_ID_BYTES);
    memcpy(m->tokenizer_id.b, p + 160, KVM_STORE_ID_BYTES);
    m->config = *config;
    if (m->n_layers < 1 || m->n_layers > KVM_STORE_MAX_LAYERS)
        return kvm_err(KVM_ECORRUPT, "%s: manifest n_layers %d outside [1, %d]", what, m->n_layers,
                       KVM_STORE_MAX_LAYERS);
    if (m->n_tokens < 0 || m->n_entries < 0 || m->stored_bytes < 0 || m->full_bytes < 0)
        return kvm_err(KVM_ECORRUPT, "%s: manifest has a negative count", what);
    if (m->dtype[15] != '\0') return kvm_err(KVM_ECORRUPT, "%s: manifest dtype is not NUL-terminated", what);
    return 0;
}

int kvm_store__manifest_parse(const MDB_val *key, const MDB_val *val, kvm_store_manifest *m, const char *what)
{
    uint32_t np;
    memset(m, 0, sizeof *m);
    int st = kvm_store__rec_check(key, val, KVM_STORE__KIND_MANIFEST, &np, what);
    if (st) return st;
    if (np != 2) return kvm_err(KVM_ECORRUPT, "%s: %u parts, expected 2", what, np);
    kvm_frame parts[2];
    kvm_store__rec_parts(val, parts, 2);
    return kvm_store__manifest_decode(&parts[0], &parts[1], m, what);
}

int kvm_store__manifest_read(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, kvm_store_manifest *m)
{
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    char name[48], what[128];
    kvm_store__cache_key(k, KVM_STORE__MANIFEST, kb);
    snprintf(what, sizeof what, "cache %s manifest", kvm_store__key_name(k, name));
    MDB_val key = {sizeof kb, kb}, val;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_CACHES], &key, &val);
    if (rc == MDB_NOTFOUND) return kvm_err(KVM_ENOTFOUND, "store %s: no cache %s", s->path, name);
    if (rc) return kvm_store__mdb(s, rc, what);
    return kvm_store__manifest_parse(&key, &val, m, what);
}
