/* kvm_kvcache.h: the ragged KV cache. Each (layer, KV head) holds its own number of
 * entries; an entry is a post-RoPE key, a value, its original position (KVM_POS_NONE for a
 * distilled KVSculpt entry) and a logit bias added to its attention score (0 for ordinary
 * entries). Entries stay sorted (distilled first, then by position) so the entries visible
 * to a query form a prefix (kernels/LAYOUT.md). Keys and values are float32 or IEEE f16
 * (kvm_kv_dtype, the [model] kv_dtype setting: half the memory, widened by attention as it reads
 * them); positions and biases are always int32/float32. Host memory. Not thread-safe. */
#ifndef KVM_KVCACHE_H
#define KVM_KVCACHE_H

#include "kernels/kvm_kernels.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kvm_kv_head {
    int64_t n;           /* entries in use */
    int64_t cap;         /* entries allocated */
    float *k;            /* KVM_KV_F32: [cap][head_dim] post-RoPE keys; NULL in an f16 head */
    float *v;            /* KVM_KV_F32: [cap][head_dim] values; NULL in an f16 head */
    uint16_t *k16;       /* KVM_KV_F16: [cap][head_dim] post-RoPE keys, IEEE binary16 bits; else NULL */
    uint16_t *v16;       /* KVM_KV_F16: [cap][head_dim] values, IEEE binary16 bits; else NULL */
    int32_t *pos;        /* [cap] original token positions, or KVM_POS_NONE */
    float *bias;         /* [cap] logit bias (nats) added to the entry's score (float32 in both types) */
    kvm_kv_dtype dtype;  /* element type of k/v: the cache's (a zeroed head is float32) */
} kvm_kv_head;

typedef struct kvm_kvcache {
    int n_layers;       /* layers */
    int n_kv_heads;     /* KV heads per layer */
    int head_dim;       /* elements per key/value */
    int32_t next_pos;   /* position the next appended token gets (= document length so far) */
    kvm_kv_dtype dtype; /* element type of every head's keys and values ([model] kv_dtype) */
    kvm_kv_head *heads; /* [n_layers][n_kv_heads] */
} kvm_kvcache;

/* Parses a kv_dtype value ("f32" or "f16"). Returns 0 and *out, or KVM_EINVAL (message names
 * the value and the choices). */
int kvm_kvcache_dtype_parse(const char *s, kvm_kv_dtype *out);

/* The setting's name of d: "f32" or "f16" (a static string; any value other than KVM_KV_F16
 * names f32). */
const char *kvm_kvcache_dtype_name(kvm_kv_dtype d);

/* Allocates an empty cache of element type dtype with room for cap_per_head entries per head
 * (grows on demand). Returns 0, KVM_EINVAL (non-positive shape, unknown dtype), KVM_ENOMEM.
 * Free with kvm_kvcache_free. */
int kvm_kvcache_new_dtype(int n_layers, int n_kv_heads, int head_dim, int64_t cap_per_head, kvm_kv_dtype dtype,
                          kvm_kvcache **out);

/* kvm_kvcache_new_dtype with float32 entries (every compression path's cache). */
int kvm_kvcache_new(int n_layers, int n_kv_heads, int head_dim, int64_t cap_per_head, kvm_kvcache **out);

/* Frees a cache. Accepts NULL and *c == NULL; sets *c = NULL. */
void kvm_kvcache_free(kvm_kvcache **c);

/* Frees the entries of every head of layer l (in range: caller's invariant), leaving them empty
 * (n = cap = 0, of the cache's dtype): a reader going through a cache layer by layer holds one
 * layer's memory at a time. */
void kvm_kvcache_release_layer(kvm_kvcache *c, int l);

/* The head (layer, kv_head); both must be in range (caller's invariant). */
kvm_kv_head *kvm_kvcache_head(const kvm_kvcache *c, int layer, int kv_head);

/* Ensures room for cap entries in head h (of h->dtype). Returns 0 or KVM_ENOMEM (h unchanged). */
int kvm_kvcache_reserve(kvm_kv_head *h, int head_dim, int64_t cap);

/* Appends one entry: head_dim float32 of k and v, copied, or rounded to nearest even in an f16
 * head. The caller keeps the sort order (append positions in increasing order). Returns 0 or
 * KVM_ENOMEM. */
int kvm_kvcache_append(kvm_kv_head *h, int head_dim, const float *k, const float *v, int32_t pos, float bias);

/* Entry e (< h->n) of head h as float32: k and v (either may be NULL) receive head_dim values,
 * widened exactly from an f16 head. The accessor for code that reads single keys (TOVA). */
void kvm_kvcache_read(const kvm_kv_head *h, int head_dim, int64_t e, float *k, float *v);

/* Keeps only entries keep[0..n_keep) of head h (indices strictly increasing, each < h->n),
 * compacting them in order: the eviction primitive. Returns 0 or KVM_EINVAL (bad index
 * list; h unchanged). */
int kvm_kvcache_keep(kvm_kv_head *h, int head_dim, const int64_t *keep, int64_t n_keep);

/* Removes entry e of head h (0 ≤ e < h->n: caller's invariant), moving the later entries' keys,
 * values, positions and biases down one so the order is kept (decode-time eviction). The
 * capacity is kept; cannot fail. */
void kvm_kvcache_drop(kvm_kv_head *h, int head_dim, int64_t e);

/* Replaces every KV head of layer l of dst by a copy of src's (same shape: caller's invariant),
 * converted to dst's element type when the two differ (f32 -> f16 rounds to nearest even).
 * Returns 0 or KVM_ENOMEM (dst's layer may then be partly copied). */
int kvm_kvcache_copy_layer(kvm_kvcache *dst, const kvm_kvcache *src, int l);
/* The same for KV head g of layer l only. */
int kvm_kvcache_copy_head(kvm_kvcache *dst, const kvm_kvcache *src, int l, int g);

/* Deep copy (same element type). Returns 0 or KVM_ENOMEM. */
int kvm_kvcache_clone(const kvm_kvcache *src, kvm_kvcache **out);

/* Converts every head of c to element type dtype in place (f32 -> f16 rounds to nearest even,
 * f16 -> f32 is exact; the same type does nothing). Capacities are kept. Peak memory: one
 * head's old and new arrays. Returns 0, KVM_EINVAL (unknown dtype) or KVM_ENOMEM (c then
 * mixes types and must only be freed). */
int kvm_kvcache_convert(kvm_kvcache *c, kvm_kv_dtype dtype);

/* KVM_ENOTSUP unless c holds float32 entries: for the paths that read the cache's arrays as
 * float32 (KVSculpt's reference cache, the sculpt file writer). what names the caller. */
int kvm_kvcache_need_f32(const kvm_kvcache *c, const char *what);

/* Entries over all heads, and the bytes they use (k and v in the cache's element type, pos,
 * bias). */
int64_t kvm_kvcache_entries(const kvm_kvcache *c);
int64_t kvm_kvcache_bytes(const kvm_kvcache *c);

#endif
