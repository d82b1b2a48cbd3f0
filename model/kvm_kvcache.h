/* kvm_kvcache.h: the ragged KV cache. Each (layer, KV head) holds its own number of
 * entries; an entry is a post-RoPE key, a value, its original position (KVM_POS_NONE for a
 * distilled KVSculpt entry) and a logit bias added to its attention score (0 for ordinary
 * entries). Entries stay sorted (distilled first, then by position) so the entries visible
 * to a query form a prefix (kernels/LAYOUT.md). Host memory. Not thread-safe. */
#ifndef KVM_KVCACHE_H
#define KVM_KVCACHE_H

#include "kernels/kvm_kernels.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvm_kv_head {
    int64_t n;      /* entries in use */
    int64_t cap;    /* entries allocated */
    float *k;       /* [cap][head_dim] post-RoPE keys */
    float *v;       /* [cap][head_dim] values */
    int32_t *pos;   /* [cap] original token positions, or KVM_POS_NONE */
    float *bias;    /* [cap] logit bias (nats) added to the entry's score */
} kvm_kv_head;

typedef struct kvm_kvcache {
    int n_layers;       /* layers */
    int n_kv_heads;     /* KV heads per layer */
    int head_dim;       /* floats per key/value */
    int32_t next_pos;   /* position the next appended token gets (= document length so far) */
    kvm_kv_head *heads; /* [n_layers][n_kv_heads] */
} kvm_kvcache;

/* Allocates an empty cache with room for cap_per_head entries per head (grows on demand).
 * Returns 0, KVM_EINVAL (non-positive shape), KVM_ENOMEM. Free with kvm_kvcache_free. */
int kvm_kvcache_new(int n_layers, int n_kv_heads, int head_dim, int64_t cap_per_head, kvm_kvcache **out);

/* Frees a cache. Accepts NULL and *c == NULL; sets *c = NULL. */
void kvm_kvcache_free(kvm_kvcache **c);

/* The head (layer, kv_head); both must be in range (caller's invariant). */
kvm_kv_head *kvm_kvcache_head(const kvm_kvcache *c, int layer, int kv_head);

/* Ensures room for cap entries in head h. Returns 0 or KVM_ENOMEM (h unchanged). */
int kvm_kvcache_reserve(kvm_kv_head *h, int head_dim, int64_t cap);

/* Appends one entry (copies head_dim floats of k and v). The caller keeps the sort order
 * (append positions in increasing order). Returns 0 or KVM_ENOMEM. */
int kvm_kvcache_append(kvm_kv_head *h, int head_dim, const float *k, const float *v, int32_t pos, float bias);

/* Keeps only entries keep[0..n_keep) of head h (indices strictly increasing, each < h->n),
 * compacting them in order: the eviction primitive. Returns 0 or KVM_EINVAL (bad index
 * list; h unchanged). */
int kvm_kvcache_keep(kvm_kv_head *h, int head_dim, const int64_t *keep, int64_t n_keep);

/* Replaces every KV head of layer l of dst by a copy of src's (same shape: caller's invariant).
 * Returns 0 or KVM_ENOMEM (dst's layer may then be partly copied). */
int kvm_kvcache_copy_layer(kvm_kvcache *dst, const kvm_kvcache *src, int l);

/* Deep copy. Returns 0 or KVM_ENOMEM. */
int kvm_kvcache_clone(const kvm_kvcache *src, kvm_kvcache **out);

/* Entries over all heads, and the bytes they use in float32 (k, v, pos, bias). */
int64_t kvm_kvcache_entries(const kvm_kvcache *c);
int64_t kvm_kvcache_bytes(const kvm_kvcache *c);

#endif
