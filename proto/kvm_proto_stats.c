/* kvm_proto_stats.c: the `stats` message (signals -> strategy): per layer, phase and pattern
 * calibration signals of one model. */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define T kvm_proto_stats
#define D(m) offsetof(T, m)
#define F32 KVM_PROTO__BIT(KVM_PROTO_F32)
static const kvm_proto__field kvm_stats__fields[] = {
    KVM_F_U64(T, job_id, 1),
    KVM_F_I64(T, n_layers, 1, 1, KVM_PROTO_MAX_LAYERS),
    KVM_F_I64(T, n_phases, 1, 1, KVM_PROTO_MAX_PHASES),
    KVM_F_NAMES(T, patterns, n_patterns),
    KVM_F_I64(T, n_tokens, 1, 1, KVM_PROTO_MAX_TOKENS),
    KVM_F_I64(T, n_docs, 1, 1, INT32_MAX),
    KVM_F_I64(T, budget_tokens, 1, 0, KVM_PROTO_MAX_TOKENS),
};
static const kvm_proto__tensor kvm_stats__tensors[] = {
    KVM_T(T, cos_sim, F32, -1, 1, "n_layers, n_phases, n_patterns", 3, D(n_layers), D(n_phases), D(n_patterns)),
    KVM_T(T, ppl_delta, F32, -1, 1, "n_layers, n_phases, n_patterns", 3, D(n_layers), D(n_phases), D(n_patterns)),
    KVM_T(T, entropy, F32, -1, 1, "n_layers, n_phases", 2, D(n_layers), D(n_phases)),
    KVM_T(T, ppl_worst, F32, -1, 1, "n_layers, n_phases", 2, D(n_layers), D(n_phases)),
};

static int kvm_stats__check_fields(const void *v)
{
    const T *s = v;
    if (s->budget_tokens > s->n_tokens)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_STATS, "field 'budget_tokens' = %lld exceeds n_tokens = %lld",
                               (long long)s->budget_tokens, (long long)s->n_tokens);
    return 0;
}

static const kvm_proto__spec kvm_stats__spec = {
    KVM_PROTO_STATS,         sizeof(T),
    kvm_stats__fields,       KVM_PROTO__N(kvm_stats__fields),
    kvm_stats__tensors,      KVM_PROTO__N(kvm_stats__tensors),
    kvm_stats__check_fields, NULL,
};
#undef T
#undef D
#undef F32

int kvm_proto_stats_encode(const kvm_proto_stats *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_stats__spec, in, out);
}

int kvm_proto_stats_decode(const kvm_msg *msg, kvm_proto_stats *out)
{
    return kvm_proto__decode(&kvm_stats__spec, msg, out);
}
