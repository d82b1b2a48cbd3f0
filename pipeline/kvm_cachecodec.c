/* kvm_cachecodec.c: ragged cache <-> proto cache messages <-> packed store values. */
#include "pipeline/kvm_cachecodec.h"
#include "proto/kvm_half.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Head h's keys / values and their wire element type: an f16 cache travels to and from f16
 * frames without rounding, and to f32 frames exactly. */
static void *head_keys(const kvm_kv_head *h) { return h->dtype == KVM_KV_F16 ? (void *)h->k16 : (void *)h->k; }
static void *head_values(const kvm_kv_head *h) { return h->dtype == KVM_KV_F16 ? (void *)h->v16 : (void *)h->v; }
static kvm_proto_dtype head_dtype(const kvm_kv_head *h) { return h->dtype == KVM_KV_F16 ? KVM_PROTO_F16 : KVM_PROTO_F32; }

/* Why a cache would hold a non-finite key or value, ending the refusal: written by this
 * process's forward or compression, or read from a store or a socket. */
#define CAUSE_OVERFLOW "the model's activations or the compression overflowed"
#define CAUSE_OLD_F16 "a stored cache written by an older kvmill's f16 encoder, or damaged"
#define CAUSE_STORED                                                                                                   \
    "committed by a store service that did not check uploads, written by an older kvmill's f16 encoder, or damaged"

/* Refuses n keys or values (what: "key"/"value") of KV head g of layer `layer`, in dtype src_dt,
 * that dtype dst_dt would not hold: a non-finite value (a cache never holds one: the forward
 * overflowed), or a finite one f16 would turn into inf. The first offender is named by layer,
 * head, entry (row within the head) and value; cause says where a non-finite one came from.
 * KVM_ERANGE, or 0. */
static int check_values(const void *src, kvm_proto_dtype src_dt, kvm_proto_dtype dst_dt, size_t n, int d, int layer,
                        int g, const char *what, const char *cause)
{
    for (size_t i = 0; i < n; i++) {
        float x = kvm_half_load(src, src_dt, i);
        if (!isfinite(x))
            return kvm_err(KVM_ERANGE,
                           "cache layer %d, KV head %d, %s of entry %zu: %g is not a finite number (%s): the cache "
                           "is refused",
                           layer, g, what, i / (size_t)d, (double)x, cause);
        if (kvm_half_overflows(x, dst_dt))
            return kvm_err(KVM_ERANGE,
                           "cache layer %d, KV head %d, %s of entry %zu: value %g exceeds %s's range (%s): store it "
                           "as %s",
                           layer, g, what, i / (size_t)d, (double)x, kvm_proto_dtype_name(dst_dt),
                           dst_dt == KVM_PROTO_F16 ? "65504" : "3.39e38",
                           dst_dt == KVM_PROTO_F16 ? "bf16 or f32" : "f32");
    }
    return 0;
}

/* Refuses the n logit biases of KV head g of layer `layer` holding NaN or +inf (an entry whose
 * bias dominates every softmax, or poisons it); -inf is an entry never attended, harmless.
 * KVM_ERANGE naming layer, head, entry and value, or 0. */
static int check_bias(const float *bias, size_t n, int layer, int g, const char *cause)
{
    for (size_t e = 0; e < n; e++)
        if (isnan(bias[e]) || bias[e] == INFINITY)
            return kvm_err(KVM_ERANGE,
                           "cache layer %d, KV head %d, logit bias of entry %zu: %g is not a usable bias (%s): the "
                           "cache is refused",
                           layer, g, e, (double)bias[e], cause);
    return 0;
}

int kvm_cachecodec_encode_layer(const kvm_kvcache *c, int layer, int64_t n_tokens, kvm_proto_dtype dtype,
                                kvm_msg **out)
{
    *out = NULL;
    const int d = c->head_dim, nkv = c->n_kv_heads;
    int64_t total = 0;
    int32_t *head_entries = malloc((size_t)nkv * sizeof *head_entries);
    if (!head_entries) return kvm_err(KVM_ENOMEM, "cache codec: out of memory");
    for (int g = 0; g < nkv; g++) total += head_entries[g] = (int32_t)kvm_kvcache_head(c, layer, g)->n;
    size_t esz = kvm_proto_dtype_size(dtype), rows = (size_t)(total > 0 ? total : 1);
    uint8_t *keys = malloc(rows * (size_t)d * esz), *vals = malloc(rows * (size_t)d * esz);
    int32_t *pos = malloc(rows * sizeof *pos);
    float *bias = malloc(rows * sizeof *bias);
    int rc = (keys && vals && pos && bias) ? 0 : kvm_err(KVM_ENOMEM, "cache codec: out of memory");
    int64_t row = 0;
    for (int g = 0; !rc && g < nkv; g++) {
        const kvm_kv_head *h = kvm_kvcache_head(c, layer, g);
        size_t n = (size_t)h->n * (size_t)d;
        if ((rc = check_values(head_keys(h), head_dtype(h), dtype, n, d, layer, g, "key", CAUSE_OVERFLOW)) ||
            (rc = check_values(head_values(h), head_dtype(h), dtype, n, d, layer, g, "value", CAUSE_OVERFLOW)) ||
            (rc = check_bias(h->bias, (size_t)h->n, layer, g, CAUSE_OVERFLOW)) ||
            (rc = kvm_half_convert(keys + (size_t)row * d * esz, dtype, head_keys(h), head_dtype(h), n)) ||
            (rc = kvm_half_convert(vals + (size_t)row * d * esz, dtype, head_values(h), head_dtype(h), n)))
            break;
        for (int64_t e = 0; e < h->n; e++) {
            pos[row + e] = h->pos[e] == KVM_POS_NONE ? -1 : h->pos[e];
            bias[row + e] = h->bias[e];
        }
        row += h->n;
    }
    if (!rc) {
        kvm_proto_cache m = {.layer = layer, .n_layers = c->n_layers, .n_kv_heads = nkv, .head_dim = d,
                             .n_tokens = n_tokens, .n_entries = total, .dtype = dtype, .head_entries = head_entries,
                             .keys = keys, .values = vals, .positions = pos, .logit_bias = bias};
        rc = kvm_proto_cache_encode(&m, out);
    }
    free(head_entries); free(keys); free(vals); free(pos); free(bias);
    return rc;
}

int kvm_cachecodec_decode_layer(const kvm_msg *msg, int layer, kvm_kvcache *c)
{
    kvm_proto_cache m;
    int rc = kvm_proto_cache_decode(msg, &m);
    if (rc) return rc;
    if (m.layer != layer || m.n_layers != c->n_layers || m.n_kv_heads != c->n_kv_heads || m.head_dim != c->head_dim)
        return kvm_err(KVM_EMISMATCH, "cache layer %d: message is layer %lld of %lld, %lld KV heads x %lld, cache is %d x %d x %d",
                       layer, (long long)m.layer, (long long)m.n_layers, (long long)m.n_kv_heads, (long long)m.head_dim,
                       c->n_layers, c->n_kv_heads, c->head_dim);
    const int d = c->head_dim;
    size_t esz = kvm_proto_dtype_size(m.dtype);
    int64_t row = 0;
    for (int g = 0; g < c->n_kv_heads; g++) {
        kvm_kv_head *h = kvm_kvcache_head(c, layer, g);
        int64_t n = m.head_entries[g];
        if ((rc = kvm_kvcache_reserve(h, d, n > 0 ? n : 1))) return rc;
        size_t cnt = (size_t)n * (size_t)d;
        /* into an f32 head from f16/bf16 frames: a cache an older kvmill's f16 encoder filled with
         * inf, or damaged bytes; from f32 frames: what the writer's forward or compression made */
        const char *cause = head_dtype(h) == KVM_PROTO_F32 && m.dtype != KVM_PROTO_F32 ? CAUSE_OLD_F16 : CAUSE_OVERFLOW;
        const uint8_t *ks = (const uint8_t *)m.keys + (size_t)row * d * esz, *vs = (const uint8_t *)m.values + (size_t)row * d * esz;
        if ((rc = check_values(ks, m.dtype, head_dtype(h), cnt, d, layer, g, "key", cause)) ||
            (rc = check_values(vs, m.dtype, head_dtype(h), cnt, d, layer, g, "value", cause)) ||
            (rc = check_bias(m.logit_bias + row, (size_t)n, layer, g, cause)) ||
            (rc = kvm_half_convert(head_keys(h), head_dtype(h), ks, m.dtype, cnt)) ||
            (rc = kvm_half_convert(head_values(h), head_dtype(h), vs, m.dtype, cnt)))
            return rc;
        for (int64_t e = 0; e < n; e++) {
            h->pos[e] = m.positions[row + e] < 0 ? KVM_POS_NONE : m.positions[row + e];
            h->bias[e] = m.logit_bias[row + e];
        }
        h->n = n;
        row += n;
    }
    if (m.n_tokens > c->next_pos) c->next_pos = (int32_t)m.n_tokens;
    return 0;
}

int kvm_cachecodec_check_finite(const kvm_proto_cache *m, const char *cause)
{
    const int d = (int)m->head_dim;
    const size_t esz = kvm_proto_dtype_size(m->dtype);
    int64_t row = 0;
    int rc = 0;
    for (int g = 0; !rc && g < (int)m->n_kv_heads; g++) {
        const size_t cnt = (size_t)m->head_entries[g] * (size_t)d, off = (size_t)row * (size_t)d * esz;
        /* into f32: only a non-finite value is refused (every finite f16/bf16/f32 one fits) */
        if (!(rc = check_values((const uint8_t *)m->keys + off, m->dtype, KVM_PROTO_F32, cnt, d, (int)m->layer, g,
                                "key", cause)))
            rc = check_values((const uint8_t *)m->values + off, m->dtype, KVM_PROTO_F32, cnt, d, (int)m->layer, g,
                              "value", cause);
        if (!rc) rc = check_bias(m->logit_bias + row, (size_t)m->head_entries[g], (int)m->layer, g, cause);
        row += m->head_entries[g];
    }
    return rc;
}

int kvm_cachecodec_check_stored(const kvm_store_cache *sc)
{
    int rc = 0;
    for (int l = 0; !rc && l < sc->manifest.n_layers; l++) {
        kvm_msg *msg = NULL;
        kvm_proto_cache m;
        /* the stored frames, copied: the decoder needs them aligned for their element type */
        rc = kvm_msg_new(&msg);
        for (uint32_t f = 0; !rc && f < sc->layers[l].n_frames; f++)
            rc = kvm_msg_add_copy(msg, sc->layers[l].frames[f].data, sc->layers[l].frames[f].size);
        if (!rc && !(rc = kvm_proto_cache_decode(msg, &m))) rc = kvm_cachecodec_check_finite(&m, CAUSE_STORED);
        kvm_msg_free(&msg);
        if (rc && rc != KVM_ENOMEM) {
            char why[1024];
            snprintf(why, sizeof why, "%s", kvm_errmsg());
            rc = kvm_err(KVM_ECORRUPT, "stored cache layer %d does not decode: %s", l, why);
        }
    }
    return rc;
}

int kvm_cachecodec_pack(const kvm_kvcache *c, int64_t n_tokens, kvm_proto_dtype dtype, uint8_t ***blobs,
                        size_t **sizes)
{
    uint8_t **b = calloc((size_t)c->n_layers, sizeof *b);
    size_t *s = calloc((size_t)c->n_layers, sizeof *s);
    int rc = (b && s) ? 0 : kvm_err(KVM_ENOMEM, "cache codec: out of memory");
    for (int l = 0; !rc && l < c->n_layers; l++) {
        kvm_msg *m = NULL;
        rc = kvm_cachecodec_encode_layer(c, l, n_tokens, dtype, &m);
        if (!rc) rc = kvm_msg_pack(m, &b[l], &s[l]);
        kvm_msg_free(&m);
    }
    if (rc) {
        for (int l = 0; b && l < c->n_layers; l++) free(b[l]);
        free(b);
        free(s);
        return rc;
    }
    *blobs = b;
    *sizes = s;
    return 0;
}

int kvm_cachecodec_unpack(const uint8_t *const *blobs, const size_t *sizes, int n_layers, int n_kv_heads, int head_dim,
                          kvm_kvcache **out)
{
    *out = NULL;
    kvm_kvcache *c;
    int rc = kvm_kvcache_new(n_layers, n_kv_heads, head_dim, 0, &c);
    if (rc) return rc;
    for (int l = 0; !rc && l < n_layers; l++) {
        kvm_msg *m = NULL;
        rc = kvm_msg_unpack(blobs[l], sizes[l], 0, &m);
        if (!rc) rc = kvm_cachecodec_decode_layer(m, l, c);
        kvm_msg_free(&m);
        if (rc && rc != KVM_EMISMATCH && rc != KVM_ENOMEM)
            rc = kvm_err(KVM_ECORRUPT, "stored cache layer %d does not decode: %s", l, kvm_errmsg());
    }
    if (rc) {
        kvm_kvcache_free(&c);
        return rc;
    }
    *out = c;
    return 0;
}

int kvm_cachecodec_roundtrip(const kvm_kvcache *c, int64_t n_tokens, kvm_proto_dtype dtype, kvm_kvcache **out,
                             int64_t *stored_bytes)
{
    *out = NULL;
    *stored_bytes = 0;
    kvm_kvcache *r;
    int64_t bytes = 0;
    int rc = kvm_kvcache_new(c->n_layers, c->n_kv_heads, c->head_dim, 0, &r);
    for (int l = 0; !rc && l < c->n_layers; l++) {
        kvm_msg *m = NULL;
        rc = kvm_cachecodec_encode_layer(c, l, n_tokens, dtype, &m);
        for (size_t f = 0; !rc && f < kvm_msg_nframes(m); f++)
            bytes += (int64_t)kvm_msg_frame(m, f).size;
        if (!rc) rc = kvm_cachecodec_decode_layer(m, l, r);
        kvm_msg_free(&m);
    }
    if (rc) {
        kvm_kvcache_free(&r);
        return rc;
    }
    *out = r;
    *stored_bytes = bytes;
    return 0;
}
