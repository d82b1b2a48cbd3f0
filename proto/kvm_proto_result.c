/* kvm_proto_result.c: the `result` and `error` messages (stage -> orchestrator): how a job
 * ended, with timings. Same struct; `result` has status 0, `error` a negative kvm_status. */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define T kvm_proto_result
/* result: status 0 */
static const kvm_proto__field kvm_result__fields[] = {
    KVM_F_U64(T, job_id, 1),
    KVM_F_I32(T, status, 1, 0, 0),
    KVM_F_STR(T, stage, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_STR(T, worker_id, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_F64(T, wait_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(T, compute_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(T, total_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_STR(T, message, 0, 0, KVM_PROTO_MAX_MESSAGE_BYTES),
    KVM_F_BOOL(T, retryable, 0),
    KVM_F_BOOL(T, evaluated, 0),
    KVM_F_F64(T, kl_mean, 0, 0.0, 1e6),
    KVM_F_F64(T, transport_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(T, store_ms, 0, 0.0, KVM_PROTO_MAX_MS),
};
/* error: the same fields, a negative status */
static const kvm_proto__field kvm_error__fields[] = {
    KVM_F_U64(T, job_id, 1),
    KVM_F_I32(T, status, 1, -KVM_PROTO_MAX_STATUS, -1),
    KVM_F_STR(T, stage, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_STR(T, worker_id, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_F64(T, wait_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(T, compute_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(T, total_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_STR(T, message, 0, 0, KVM_PROTO_MAX_MESSAGE_BYTES),
    KVM_F_BOOL(T, retryable, 0),
};

static const kvm_proto__spec kvm_result__spec = {
    KVM_PROTO_RESULT, sizeof(T), kvm_result__fields, KVM_PROTO__N(kvm_result__fields), NULL, 0, NULL, NULL,
};
static const kvm_proto__spec kvm_error__spec = {
    KVM_PROTO_ERROR, sizeof(T), kvm_error__fields, KVM_PROTO__N(kvm_error__fields), NULL, 0, NULL, NULL,
};
#undef T

int kvm_proto_result_encode(const kvm_proto_result *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_result__spec, in, out);
}

int kvm_proto_result_decode(const kvm_msg *msg, kvm_proto_result *out)
{
    return kvm_proto__decode(&kvm_result__spec, msg, out);
}

int kvm_proto_error_encode(const kvm_proto_error *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_error__spec, in, out);
}

int kvm_proto_error_decode(const kvm_msg *msg, kvm_proto_error *out)
{
    return kvm_proto__decode(&kvm_error__spec, msg, out);
}
