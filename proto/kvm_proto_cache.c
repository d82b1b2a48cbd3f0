/* kvm_proto_cache.c: the `cache` message: one layer of a ragged compressed cache (per KV head
 * entry counts, keys and values in f32/f16/bf16, original positions, logit biases). The
 * store keeps these messages as blobs (kvm_msg_pack) and serving sends them back. */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define T kvm_proto_cache
#define D(m) offsetof(T, m)
#define I32 KVM_PROTO__BIT(KVM_PROTO_I32)
#define F32 KVM_PROTO__BIT(KVM_PROTO_F32)
static const kvm_proto__field kvm_cache__fields[] = {
    KVM_F_I64(T, layer, 1, 0, KVM_PROTO_MAX_LAYERS - 1),
    KVM_F_I64(T, n_layers, 1, 1, KVM_PROTO_MAX_LAYERS),
    KVM_F_I64(T, n_kv_heads, 1, 1, KVM_PROTO_MAX_HEADS),
    KVM_F_I64(T, head_dim, 1, 1, KVM_PROTO_MAX_HEAD_DIM),
    KVM_F_I64(T, n_tokens, 1, 1, KVM_PROTO_MAX_TOKENS),
    KVM_F_I64(T, n_entries, 1, 0, (int64_t)KVM_PROTO_MAX_HEADS *KVM_PROTO_MAX_TOKENS),
};
static const kvm_proto__tensor kvm_cache__tensors[] = {
    KVM_T(T, head_entries, I32, -1, 1, "n_kv_heads", 1, D(n_kv_heads)),
    KVM_T(T, keys, KVM_PROTO__FLOATS, D(dtype), 1, "n_entries, head_dim", 2, D(n_entries), D(head_dim)),
    KVM_T(T, values, KVM_PROTO__FLOATS, D(dtype), 1, "n_entries, head_dim", 2, D(n_entries), D(head_dim)),
    KVM_T(T, positions, I32, -1, 1, "n_entries", 1, D(n_entries)),
    KVM_T(T, logit_bias, F32, -1, 1, "n_entries", 1, D(n_entries)),
};

static int kvm_cache__check_fields(const void *v)
{
    const T *c = v;
    if (c->layer >= c->n_layers)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_CACHE, "field 'layer' = %lld must be < n_layers = %lld",
                               (long long)c->layer, (long long)c->n_layers);
    if (c->n_entries > c->n_kv_heads * c->n_tokens)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_CACHE,
                               "field 'n_entries' = %lld exceeds n_kv_heads * n_tokens = %lld", (long long)c->n_entries,
                               (long long)(c->n_kv_heads * c->n_tokens));
    return 0;
}

static int kvm_cache__check_tensors(const void *v)
{
    const T *c = v;
    int rc = kvm_proto__check_i32(KVM_PROTO_CACHE, "head_entries", c->head_entries, c->n_kv_heads, 0, c->n_tokens);
    if (rc) return rc;
    int64_t sum = 0;
    for (int64_t h = 0; h < c->n_kv_heads; h++)
        sum += c->head_entries[h];
    if (sum != c->n_entries)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_CACHE,
                               "tensor 'head_entries' sums to %lld, but n_entries (rows of keys/values) = %lld",
                               (long long)sum, (long long)c->n_entries);
    return kvm_proto__check_i32(KVM_PROTO_CACHE, "positions", c->positions, c->n_entries, -1, c->n_tokens - 1);
}

static const kvm_proto__spec kvm_cache__spec = {
    KVM_PROTO_CACHE,         sizeof(T),
    kvm_cache__fields,       KVM_PROTO__N(kvm_cache__fields),
    kvm_cache__tensors,      KVM_PROTO__N(kvm_cache__tensors),
    kvm_cache__check_fields, kvm_cache__check_tensors,
};
#undef T
#undef D
#undef I32
#undef F32

int kvm_proto_cache_encode(const kvm_proto_cache *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_cache__spec, in, out);
}

int kvm_proto_cache_decode(const kvm_msg *msg, kvm_proto_cache *out)
{
    return kvm_proto__decode(&kvm_cache__spec, msg, out);
}
