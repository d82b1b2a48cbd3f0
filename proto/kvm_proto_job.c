/* kvm_proto_job.c: the `job` message (orchestrator -> prefill): one document to process. */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define T kvm_proto_job
static const kvm_proto__field kvm_job__fields[] = {
    KVM_F_U64(T, job_id, 1),
    KVM_F_I64(T, attempt, 1, 0, KVM_PROTO_MAX_ATTEMPTS),
    KVM_F_STR(T, doc_id, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_STR(T, doc_name, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_I64(T, n_ctx, 1, 1, KVM_PROTO_MAX_TOKENS),
    KVM_F_I64(T, n_tokens, 1, 1, KVM_PROTO_MAX_TOKENS),
    KVM_F_SETTINGS(T, settings, settings_bytes),
    KVM_F_I64(T, n_continuation, 0, 0, KVM_PROTO_MAX_TOKENS),
    KVM_F_ID32_OPT(T, model_id, has_model_id), /* revision 10: the run's model */
};
static const kvm_proto__tensor kvm_job__tensors[] = {
    KVM_T(T, tokens, KVM_PROTO__BIT(KVM_PROTO_I32), -1, 1, "n_tokens", 1, offsetof(T, n_tokens)),
    KVM_T(T, continuation, KVM_PROTO__BIT(KVM_PROTO_I32), -1, 0, "n_continuation", 1, offsetof(T, n_continuation)),
};

static int kvm_job__check_fields(const void *v)
{
    const T *j = v;
    if (j->n_tokens > j->n_ctx)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_JOB, "field 'n_tokens' = %lld exceeds n_ctx = %lld",
                               (long long)j->n_tokens, (long long)j->n_ctx);
    return 0;
}

static int kvm_job__check_tensors(const void *v)
{
    const T *j = v;
    int rc = kvm_proto__check_i32(KVM_PROTO_JOB, "tokens", j->tokens, j->n_tokens, 0, INT32_MAX);
    if (!rc && j->continuation)
        rc = kvm_proto__check_i32(KVM_PROTO_JOB, "continuation", j->continuation, j->n_continuation, 0, INT32_MAX);
    return rc;
}

static const kvm_proto__spec kvm_job__spec = {
    KVM_PROTO_JOB,         sizeof(T),
    kvm_job__fields,       KVM_PROTO__N(kvm_job__fields),
    kvm_job__tensors,      KVM_PROTO__N(kvm_job__tensors),
    kvm_job__check_fields, kvm_job__check_tensors,
};
#undef T

int kvm_proto_job_encode(const kvm_proto_job *in, kvm_msg **out) { return kvm_proto__encode(&kvm_job__spec, in, out); }

int kvm_proto_job_decode(const kvm_msg *msg, kvm_proto_job *out) { return kvm_proto__decode(&kvm_job__spec, msg, out); }
