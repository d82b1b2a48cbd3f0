/* kvm_kvcache.c: the ragged KV cache (per-head entry arrays with positions and biases). */
#include "model/kvm_kvcache.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

int kvm_kvcache_new(int n_layers, int n_kv_heads, int head_dim, int64_t cap_per_head, kvm_kvcache **out)
{
    *out = NULL;
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || cap_per_head < 0)
        return kvm_err(KVM_EINVAL, "kv cache: bad shape layers=%d kv_heads=%d head_dim=%d cap=%lld", n_layers,
                       n_kv_heads, head_dim, (long long)cap_per_head);
    kvm_kvcache *c = calloc(1, sizeof *c);
    if (!c) return kvm_err(KVM_ENOMEM, "kv cache: out of memory");
    c->n_layers = n_layers;
    c->n_kv_heads = n_kv_heads;
    c->head_dim = head_dim;
    c->heads = calloc((size_t)n_layers * (size_t)n_kv_heads, sizeof *c->heads);
    if (!c->heads) goto fail;
    for (int i = 0; i < n_layers * n_kv_heads; i++)
        if (kvm_kvcache_reserve(&c->heads[i], head_dim, cap_per_head)) goto fail;
    *out = c;
    return 0;
fail:
    kvm_kvcache_free(&c);
    return kvm_err(KVM_ENOMEM, "kv cache: out of memory for %lld entries per head", (long long)cap_per_head);
}

void kvm_kvcache_free(kvm_kvcache **pc)
{
    if (!pc || !*pc) return;
    kvm_kvcache *c = *pc;
    if (c->heads)
        for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
            free(c->heads[i].k);
            free(c->heads[i].v);
            free(c->heads[i].pos);
            free(c->heads[i].bias);
        }
    free(c->heads);
    free(c);
    *pc = NULL;
}

kvm_kv_head *kvm_kvcache_head(const kvm_kvcache *c, int layer, int kv_head)
{
    return &c->heads[(size_t)layer * (size_t)c->n_kv_heads + (size_t)kv_head];
}

int kvm_kvcache_reserve(kvm_kv_head *h, int head_dim, int64_t cap)
{
    if (cap <= h->cap) return 0;
    size_t n = (size_t)cap;
    float *k = realloc(h->k, n * (size_t)head_dim * sizeof *k);
    if (k) h->k = k;
    float *v = realloc(h->v, n * (size_t)head_dim * sizeof *v);
    if (v) h->v = v;
    int32_t *pos = realloc(h->pos, n * sizeof *pos);
    if (pos) h->pos = pos;
    float *bias = realloc(h->bias, n * sizeof *bias);
    if (bias) h->bias = bias;
    if (!k || !v || !pos || !bias) return kvm_err(KVM_ENOMEM, "kv cache: out of memory for %lld entries", (long long)cap);
    h->cap = cap;
    return 0;
}

int kvm_kvcache_append(kvm_kv_head *h, int head_dim, const float *k, const float *v, int32_t pos, float bias)
{
    if (h->n == h->cap) {
        int rc = kvm_kvcache_reserve(h, head_dim, h->cap < 16 ? 32 : 2 * h->cap);
        if (rc) return rc;
    }
    memcpy(h->k + h->n * head_dim, k, (size_t)head_dim * sizeof *k);
    memcpy(h->v + h->n * head_dim, v, (size_t)head_dim * sizeof *v);
    h->pos[h->n] = pos;
    h->bias[h->n] = bias;
    h->n++;
    return 0;
}

int kvm_kvcache_keep(kvm_kv_head *h, int head_dim, const int64_t *keep, int64_t n_keep)
{
    if (n_keep < 0 || n_keep > h->n) return kvm_err(KVM_EINVAL, "kv cache keep: %lld of %lld entries", (long long)n_keep, (long long)h->n);
    for (int64_t i = 0; i < n_keep; i++)
        if (keep[i] < 0 || keep[i] >= h->n || (i > 0 && keep[i] <= keep[i - 1]))
            return kvm_err(KVM_EINVAL, "kv cache keep: index %lld at %lld is out of range or not increasing",
                           (long long)keep[i], (long long)i);
    for (int64_t i = 0; i < n_keep; i++) {
        int64_t j = keep[i];
        if (j == i) continue;
        memcpy(h->k + i * head_dim, h->k + j * head_dim, (size_t)head_dim * sizeof *h->k);
        memcpy(h->v + i * head_dim, h->v + j * head_dim, (size_t)head_dim * sizeof *h->v);
        h->pos[i] = h->pos[j];
        h->bias[i] = h->bias[j];
    }
    h->n = n_keep;
    return 0;
}

int kvm_kvcache_copy_layer(kvm_kvcache *dst, const kvm_kvcache *src, int l)
{
    const int d = src->head_dim;
    for (int g = 0; g < src->n_kv_heads; g++) {
        const kvm_kv_head *a = kvm_kvcache_head(src, l, g);
        kvm_kv_head *b = kvm_kvcache_head(dst, l, g);
        int rc = kvm_kvcache_reserve(b, d, a->n);
        if (rc) return rc;
        memcpy(b->k, a->k, (size_t)(a->n * d) * sizeof *a->k);
        memcpy(b->v, a->v, (size_t)(a->n * d) * sizeof *a->v);
        memcpy(b->pos, a->pos, (size_t)a->n * sizeof *a->pos);
        memcpy(b->bias, a->bias, (size_t)a->n * sizeof *a->bias);
        b->n = a->n;
    }
    return 0;
}

int kvm_kvcache_clone(const kvm_kvcache *src, kvm_kvcache **out)
{
    *out = NULL;
    kvm_kvcache *c;
    int rc = kvm_kvcache_new(src->n_layers, src->n_kv_heads, src->head_dim, 0, &c);
    if (rc) return rc;
    c->next_pos = src->next_pos;
    for (int i = 0; i < src->n_layers * src->n_kv_heads; i++) {
        const kvm_kv_head *s = &src->heads[i];
        kvm_kv_head *d = &c->heads[i];
        if ((rc = kvm_kvcache_reserve(d, src->head_dim, s->n > 0 ? s->n : 1))) {
            kvm_kvcache_free(&c);
            return rc;
        }
        size_t kv = (size_t)s->n * (size_t)src->head_dim * sizeof(float);
        if (s->n) {
            memcpy(d->k, s->k, kv);
            memcpy(d->v, s->v, kv);
            memcpy(d->pos, s->pos, (size_t)s->n * sizeof *s->pos);
            memcpy(d->bias, s->bias, (size_t)s->n * sizeof *s->bias);
        }
        d->n = s->n;
    }
    *out = c;
    return 0;
}

int64_t kvm_kvcache_entries(const kvm_kvcache *c)
{
    int64_t n = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) n += c->heads[i].n;
    return n;
}

int64_t kvm_kvcache_bytes(const kvm_kvcache *c)
{
    return kvm_kvcache_entries(c) * (2 * (int64_t)c->head_dim * (int64_t)sizeof(float) + 8);
}
