/* kvm_proto_kv.c: the `kv` message (prefill -> compress / signals): one layer's post-RoPE keys,
 * values, the queries compression needs and the attention statistics signals need. */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define T kvm_proto_kv
#define D(m) offsetof(T, m)
#define F32 KVM_PROTO__BIT(KVM_PROTO_F32)
static const kvm_proto__field kvm_kv__fields[] = {
    KVM_F_U64(T, job_id, 1),
    KVM_F_I64(T, layer, 1, 0, KVM_PROTO_MAX_LAYERS - 1),
    KVM_F_I64(T, n_layers, 1, 1, KVM_PROTO_MAX_LAYERS),
    KVM_F_I64(T, n_tokens, 1, 1, KVM_PROTO_MAX_TOKENS),
    KVM_F_I64(T, n_heads, 1, 1, KVM_PROTO_MAX_HEADS),
    KVM_F_I64(T, n_kv_heads, 1, 1, KVM_PROTO_MAX_HEADS),
    KVM_F_I64(T, head_dim, 1, 1, KVM_PROTO_MAX_HEAD_DIM),
    KVM_F_I64(T, q_start, 1, 0, KVM_PROTO_MAX_TOKENS),
    KVM_F_I64(T, n_queries, 1, 0, KVM_PROTO_MAX_TOKENS),
};
static const kvm_proto__tensor kvm_kv__tensors[] = {
    KVM_T(T, keys, KVM_PROTO__FLOATS, D(dtype), 1, "n_kv_heads, n_tokens, head_dim", 3, D(n_kv_heads), D(n_tokens), D(head_dim)),
    KVM_T(T, values, KVM_PROTO__FLOATS, D(dtype), 1, "n_kv_heads, n_tokens, head_dim", 3, D(n_kv_heads), D(n_tokens), D(head_dim)),
    KVM_T(T, q_pre, KVM_PROTO__FLOATS, D(dtype), 0, "n_heads, n_queries, head_dim", 3, D(n_heads), D(n_queries), D(head_dim)),
    KVM_T(T, q_post, KVM_PROTO__FLOATS, D(dtype), 0, "n_heads, n_queries, head_dim", 3, D(n_heads), D(n_queries), D(head_dim)),
    KVM_T(T, entropy, F32, -1, 1, "n_heads, n_tokens", 2, D(n_heads), D(n_tokens)),
    KVM_T(T, attn_mass, F32, -1, 1, "n_heads, n_tokens", 2, D(n_heads), D(n_tokens)),
};

static int kvm_kv__check_fields(const void *v)
{
    const T *k = v;
    if (k->layer >= k->n_layers)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_KV, "field 'layer' = %lld must be < n_layers = %lld",
                               (long long)k->layer, (long long)k->n_layers);
    if (k->n_kv_heads > k->n_heads || k->n_heads % k->n_kv_heads != 0)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_KV, "field 'n_kv_heads' = %lld must divide n_heads = %lld (GQA)",
                               (long long)k->n_kv_heads, (long long)k->n_heads);
    if (k->q_start + k->n_queries > k->n_tokens)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_KV,
                               "fields 'q_start' + 'n_queries' = %lld + %lld exceed n_tokens = %lld",
                               (long long)k->q_start, (long long)k->n_queries, (long long)k->n_tokens);
    return 0;
}

static const kvm_proto__spec kvm_kv__spec = {
    KVM_PROTO_KV,         sizeof(T),
    kvm_kv__fields,       KVM_PROTO__N(kvm_kv__fields),
    kvm_kv__tensors,      KVM_PROTO__N(kvm_kv__tensors),
    kvm_kv__check_fields, NULL,
};
#undef T
#undef D
#undef F32

int kvm_proto_kv_encode(const kvm_proto_kv *in, kvm_msg **out) { return kvm_proto__encode(&kvm_kv__spec, in, out); }

int kvm_proto_kv_decode(const kvm_msg *msg, kvm_proto_kv *out) { return kvm_proto__decode(&kvm_kv__spec, msg, out); }
