/* kvm_kvcache.c: the ragged KV cache (per-head entry arrays with positions and biases), keys
 * and values float32 or f16. */
#include "model/kvm_kvcache.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

int kvm_kvcache_dtype_parse(const char *s, kvm_kv_dtype *out)
{
    if (s && !strcmp(s, "f32")) *out = KVM_KV_F32;
    else if (s && !strcmp(s, "f16")) *out = KVM_KV_F16;
    else return kvm_err(KVM_EINVAL, "kv_dtype '%s': expected f32 or f16", s ? s : "");
    return 0;
}

const char *kvm_kvcache_dtype_name(kvm_kv_dtype d) { return d == KVM_KV_F16 ? "f16" : "f32"; }

/* Bytes of one key (or value) element. */
static size_t esize(kvm_kv_dtype d) { return d == KVM_KV_F16 ? sizeof(uint16_t) : sizeof(float); }

/* Key / value arrays of h as bytes (whichever type h holds). */
static unsigned char *kbytes(const kvm_kv_head *h) { return h->dtype == KVM_KV_F16 ? (void *)h->k16 : (void *)h->k; }
static unsigned char *vbytes(const kvm_kv_head *h) { return h->dtype == KVM_KV_F16 ? (void *)h->v16 : (void *)h->v; }

int kvm_kvcache_new_dtype(int n_layers, int n_kv_heads, int head_dim, int64_t cap_per_head, kvm_kv_dtype dtype,
                          kvm_kvcache **out)
{
    *out = NULL;
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || cap_per_head < 0)
        return kvm_err(KVM_EINVAL, "kv cache: bad shape layers=%d kv_heads=%d head_dim=%d cap=%lld", n_layers,
                       n_kv_heads, head_dim, (long long)cap_per_head);
    if (dtype != KVM_KV_F32 && dtype != KVM_KV_F16)
        return kvm_err(KVM_EINVAL, "kv cache: unknown element type %d", (int)dtype);
    kvm_kvcache *c = calloc(1, sizeof *c);
    if (!c) return kvm_err(KVM_ENOMEM, "kv cache: out of memory");
    c->n_layers = n_layers;
    c->n_kv_heads = n_kv_heads;
    c->head_dim = head_dim;
    c->dtype = dtype;
    c->heads = calloc((size_t)n_layers * (size_t)n_kv_heads, sizeof *c->heads);
    if (!c->heads) goto fail;
    for (int i = 0; i < n_layers * n_kv_heads; i++) {
        c->heads[i].dtype = dtype;
        if (kvm_kvcache_reserve(&c->heads[i], head_dim, cap_per_head)) goto fail;
    }
    *out = c;
    return 0;
fail:
    kvm_kvcache_free(&c);
    return kvm_err(KVM_ENOMEM, "kv cache: out of memory for %lld entries per head", (long long)cap_per_head);
}

int kvm_kvcache_new(int n_layers, int n_kv_heads, int head_dim, int64_t cap_per_head, kvm_kvcache **out)
{
    return kvm_kvcache_new_dtype(n_layers, n_kv_heads, head_dim, cap_per_head, KVM_KV_F32, out);
}

static void head_free(kvm_kv_head *h)
{
    free(h->k);
    free(h->v);
    free(h->k16);
    free(h->v16);
    free(h->pos);
    free(h->bias);
}

void kvm_kvcache_free(kvm_kvcache **pc)
{
    if (!pc || !*pc) return;
    kvm_kvcache *c = *pc;
    if (c->heads)
        for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) head_free(&c->heads[i]);
    free(c->heads);
    free(c);
    *pc = NULL;
}

void kvm_kvcache_release_layer(kvm_kvcache *c, int l)
{
    for (int g = 0; g < c->n_kv_heads; g++) {
        kvm_kv_head *h = kvm_kvcache_head(c, l, g);
        head_free(h);
        *h = (kvm_kv_head){.dtype = c->dtype};
    }
}

kvm_kv_head *kvm_kvcache_head(const kvm_kvcache *c, int layer, int kv_head)
{
    return &c->heads[(size_t)layer * (size_t)c->n_kv_heads + (size_t)kv_head];
}

int kvm_kvcache_reserve(kvm_kv_head *h, int head_dim, int64_t cap)
{
    if (cap <= h->cap) return 0;
    size_t n = (size_t)cap, kv = n * (size_t)head_dim * esize(h->dtype);
    int ok = 1;
    if (h->dtype == KVM_KV_F16) {
        uint16_t *k = realloc(h->k16, kv);
        if (k) h->k16 = k;
        uint16_t *v = realloc(h->v16, kv);
        if (v) h->v16 = v;
        ok = k && v;
    } else {
        float *k = realloc(h->k, kv);
        if (k) h->k = k;
        float *v = realloc(h->v, kv);
        if (v) h->v = v;
        ok = k && v;
    }
    int32_t *pos = realloc(h->pos, n * sizeof *pos);
    if (pos) h->pos = pos;
    float *bias = realloc(h->bias, n * sizeof *bias);
    if (bias) h->bias = bias;
    if (!ok || !pos || !bias) return kvm_err(KVM_ENOMEM, "kv cache: out of memory for %lld entries", (long long)cap);
    h->cap = cap;
    return 0;
}

int kvm_kvcache_append(kvm_kv_head *h, int head_dim, const float *k, const float *v, int32_t pos, float bias)
{
    if (h->n == h->cap) {
        int rc = kvm_kvcache_reserve(h, head_dim, h->cap < 16 ? 32 : 2 * h->cap);
        if (rc) return rc;
    }
    if (h->dtype == KVM_KV_F16) {
        kvm_f16_round(h->k16 + h->n * head_dim, k, head_dim);
        kvm_f16_round(h->v16 + h->n * head_dim, v, head_dim);
    } else {
        memcpy(h->k + h->n * head_dim, k, (size_t)head_dim * sizeof *k);
        memcpy(h->v + h->n * head_dim, v, (size_t)head_dim * sizeof *v);
    }
    h->pos[h->n] = pos;
    h->bias[h->n] = bias;
    h->n++;
    return 0;
}

void kvm_kvcache_read(const kvm_kv_head *h, int head_dim, int64_t e, float *k, float *v)
{
    const int64_t o = e * head_dim;
    if (h->dtype == KVM_KV_F16) {
        if (k) kvm_f16_widen(k, h->k16 + o, head_dim);
        if (v) kvm_f16_widen(v, h->v16 + o, head_dim);
        return;
    }
    if (k) memcpy(k, h->k + o, (size_t)head_dim * sizeof *k);
    if (v) memcpy(v, h->v + o, (size_t)head_dim * sizeof *v);
}

int kvm_kvcache_keep(kvm_kv_head *h, int head_dim, const int64_t *keep, int64_t n_keep)
{
    if (n_keep < 0 || n_keep > h->n) return kvm_err(KVM_EINVAL, "kv cache keep: %lld of %lld entries", (long long)n_keep, (long long)h->n);
    for (int64_t i = 0; i < n_keep; i++)
        if (keep[i] < 0 || keep[i] >= h->n || (i > 0 && keep[i] <= keep[i - 1]))
            return kvm_err(KVM_EINVAL, "kv cache keep: index %lld at %lld is out of range or not increasing",
                           (long long)keep[i], (long long)i);
    const size_t row = (size_t)head_dim * esize(h->dtype);
    unsigned char *k = kbytes(h), *v = vbytes(h);
    for (int64_t i = 0; i < n_keep; i++) {
        int64_t j = keep[i];
        if (j == i) continue;
        memcpy(k + (size_t)i * row, k + (size_t)j * row, row);
        memcpy(v + (size_t)i * row, v + (size_t)j * row, row);
        h->pos[i] = h->pos[j];
        h->bias[i] = h->bias[j];
    }
    h->n = n_keep;
    return 0;
}

void kvm_kvcache_drop(kvm_kv_head *h, int head_dim, int64_t e)
{
    const size_t row = (size_t)head_dim * esize(h->dtype), tail = (size_t)(h->n - e - 1);
    unsigned char *k = kbytes(h), *v = vbytes(h);
    memmove(k + (size_t)e * row, k + (size_t)(e + 1) * row, tail * row);
    memmove(v + (size_t)e * row, v + (size_t)(e + 1) * row, tail * row);
    memmove(h->pos + e, h->pos + e + 1, tail * sizeof *h->pos);
    memmove(h->bias + e, h->bias + e + 1, tail * sizeof *h->bias);
    h->n--;
}

/* Entries [0, a->n) of a into b (room reserved), converting between element types. */
static void copy_entries(kvm_kv_head *b, const kvm_kv_head *a, int d)
{
    const int64_t n = a->n * d;
    if (a->dtype == b->dtype) {
        memcpy(kbytes(b), kbytes(a), (size_t)n * esize(a->dtype));
        memcpy(vbytes(b), vbytes(a), (size_t)n * esize(a->dtype));
    } else if (b->dtype == KVM_KV_F16) {
        kvm_f16_round(b->k16, a->k, n);
        kvm_f16_round(b->v16, a->v, n);
    } else {
        kvm_f16_widen(b->k, a->k16, n);
        kvm_f16_widen(b->v, a->v16, n);
    }
    memcpy(b->pos, a->pos, (size_t)a->n * sizeof *a->pos);
    memcpy(b->bias, a->bias, (size_t)a->n * sizeof *a->bias);
    b->n = a->n;
}

int kvm_kvcache_copy_head(kvm_kvcache *dst, const kvm_kvcache *src, int l, int g)
{
    const kvm_kv_head *a = kvm_kvcache_head(src, l, g);
    kvm_kv_head *b = kvm_kvcache_head(dst, l, g);
    int rc = kvm_kvcache_reserve(b, src->head_dim, a->n);
    if (!rc) copy_entries(b, a, src->head_dim);
    return rc;
}

int kvm_kvcache_copy_layer(kvm_kvcache *dst, const kvm_kvcache *src, int l)
{
    for (int g = 0; g < src->n_kv_heads; g++) {
        int rc = kvm_kvcache_copy_head(dst, src, l, g);
        if (rc) return rc;
    }
    return 0;
}

int kvm_kvcache_clone(const kvm_kvcache *src, kvm_kvcache **out)
{
    *out = NULL;
    kvm_kvcache *c;
    int rc = kvm_kvcache_new_dtype(src->n_layers, src->n_kv_heads, src->head_dim, 0, src->dtype, &c);
    if (rc) return rc;
    c->next_pos = src->next_pos;
    for (int i = 0; i < src->n_layers * src->n_kv_heads; i++) {
        const kvm_kv_head *s = &src->heads[i];
        kvm_kv_head *d = &c->heads[i];
        if ((rc = kvm_kvcache_reserve(d, src->head_dim, s->n > 0 ? s->n : 1))) {
            kvm_kvcache_free(&c);
            return rc;
        }
        copy_entries(d, s, src->head_dim);
    }
    *out = c;
    return 0;
}

int kvm_kvcache_convert(kvm_kvcache *c, kvm_kv_dtype dtype)
{
    if (dtype != KVM_KV_F32 && dtype != KVM_KV_F16)
        return kvm_err(KVM_EINVAL, "kv cache: unknown element type %d", (int)dtype);
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        kvm_kv_head *h = &c->heads[i];
        if (h->dtype == dtype) continue;
        kvm_kv_head t = {.dtype = dtype};
        if (kvm_kvcache_reserve(&t, c->head_dim, h->cap > 0 ? h->cap : 1)) {
            head_free(&t);
            return kvm_err(KVM_ENOMEM, "kv cache: out of memory converting to %s", kvm_kvcache_dtype_name(dtype));
        }
        copy_entries(&t, h, c->head_dim);
        head_free(h);
        *h = t;
    }
    c->dtype = dtype;
    return 0;
}

int kvm_kvcache_need_f32(const kvm_kvcache *c, const char *what)
{
    if (c->dtype == KVM_KV_F32) return 0;
    return kvm_err(KVM_ENOTSUP, "%s reads float32 keys and values; this cache holds %s entries (kv_dtype = %s is for "
                   "decoding only)", what, kvm_kvcache_dtype_name(c->dtype), kvm_kvcache_dtype_name(c->dtype));
}

int64_t kvm_kvcache_entries(const kvm_kvcache *c)
{
    int64_t n = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) n += c->heads[i].n;
    return n;
}

int64_t kvm_kvcache_bytes(const kvm_kvcache *c)
{
    return kvm_kvcache_entries(c) * (2 * (int64_t)c->head_dim * (int64_t)esize(c->dtype) + 8);
}
