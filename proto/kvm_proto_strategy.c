/* kvm_proto_strategy.c: the `strategy` message: per layer and phase, the eviction pattern and
 * the budget (entries per KV head), optionally per KV head. */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define T kvm_proto_strategy
#define D(m) offsetof(T, m)
#define I32 KVM_PROTO__BIT(KVM_PROTO_I32)
static const kvm_proto__field kvm_strategy__fields[] = {
    KVM_F_STR(T, name, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_I64(T, n_layers, 1, 1, KVM_PROTO_MAX_LAYERS),
    KVM_F_I64(T, n_phases, 1, 1, KVM_PROTO_MAX_PHASES),
    KVM_F_I64(T, n_kv_heads, 1, 1, KVM_PROTO_MAX_HEADS),
    KVM_F_I64(T, n_ctx, 1, 1, KVM_PROTO_MAX_TOKENS),
    KVM_F_I64(T, budget_min, 1, 0, KVM_PROTO_MAX_TOKENS),
    KVM_F_NAMES(T, patterns, n_patterns),
};
static const kvm_proto__tensor kvm_strategy__tensors[] = {
    KVM_T(T, pattern, I32, -1, 1, "n_layers, n_phases", 2, D(n_layers), D(n_phases)),
    KVM_T(T, budget, I32, -1, 1, "n_layers, n_phases", 2, D(n_layers), D(n_phases)),
    KVM_T(T, head_budget, I32, -1, 0, "n_layers, n_phases, n_kv_heads", 3, D(n_layers), D(n_phases), D(n_kv_heads)),
};

static int kvm_strategy__check_fields(const void *v)
{
    const T *s = v;
    if (s->budget_min > s->n_ctx)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_STRATEGY, "field 'budget_min' = %lld exceeds n_ctx = %lld",
                               (long long)s->budget_min, (long long)s->n_ctx);
    return 0;
}

static int kvm_strategy__check_tensors(const void *v)
{
    const T *s = v;
    int64_t rows = s->n_layers * s->n_phases;
    int rc = kvm_proto__check_i32(KVM_PROTO_STRATEGY, "pattern", s->pattern, rows, 0, s->n_patterns - 1);
    if (!rc) rc = kvm_proto__check_i32(KVM_PROTO_STRATEGY, "budget", s->budget, rows, s->budget_min, s->n_ctx);
    if (!rc && s->head_budget)
        rc = kvm_proto__check_i32(KVM_PROTO_STRATEGY, "head_budget", s->head_budget, rows * s->n_kv_heads, 0, s->n_ctx);
    return rc;
}

static const kvm_proto__spec kvm_strategy__spec = {
    KVM_PROTO_STRATEGY,         sizeof(T),
    kvm_strategy__fields,       KVM_PROTO__N(kvm_strategy__fields),
    kvm_strategy__tensors,      KVM_PROTO__N(kvm_strategy__tensors),
    kvm_strategy__check_fields, kvm_strategy__check_tensors,
};
#undef T
#undef D
#undef I32

int kvm_proto_strategy_encode(const kvm_proto_strategy *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_strategy__spec, in, out);
}

int kvm_proto_strategy_decode(const kvm_msg *msg, kvm_proto_strategy *out)
{
    return kvm_proto__decode(&kvm_strategy__spec, msg, out);
}
