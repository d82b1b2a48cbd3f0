/* kvm_proto_control.c: the control messages a stage sends its orchestrator (DEALER -> ROUTER):
 * `ready` (the stage is up), `heartbeat` (still alive; with `stopping` on the data socket: the
 * stage stops), `ack` (a job is committed; with `stopping`, orchestrator -> stage on the data
 * socket: the end of the stopping stage's work, PROTOCOL.md §5, revision 13). */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define T kvm_proto_ctl
static const kvm_proto__field kvm_ready__fields[] = {
    KVM_F_STR(T, worker_id, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_STR(T, stage, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_I64(T, pid, 1, 1, INT32_MAX),
    KVM_F_STR(T, device, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_ID32_OPT(T, model_id, has_model_id),       /* revision 10: the stage's model */
    KVM_F_ID32_OPT(T, settings_id, has_settings_id), /* revision 11: its config's settings */
    KVM_F_U64(T, instance, 0),                       /* revision 15: the process, beyond its pid */
    KVM_F_ID32_OPT(T, store_id, has_store_id),       /* revision 15: a decode worker's store */
};
static const kvm_proto__field kvm_heartbeat__fields[] = {
    KVM_F_STR(T, worker_id, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_STR(T, stage, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_I64(T, pid, 1, 1, INT32_MAX),
    KVM_F_U64(T, job_id, 0),         /* optional: the job being worked on (0 = none) */
    KVM_F_U64(T, progress_done, 0),  /* optional: units of that job done ... */
    KVM_F_U64(T, progress_total, 0), /* ... of this many announced so far (0 = no report) */
    KVM_F_BOOL(T, stopping, 0),      /* revision 13, on the data socket: the worker stops */
    KVM_F_BOOL(T, probe, 0),         /* revision 15: ... or only asks whether it is heard */
};
static const kvm_proto__field kvm_ack__fields[] = {
    KVM_F_STR(T, worker_id, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_STR(T, stage, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_I64(T, pid, 1, 1, INT32_MAX),
    KVM_F_U64(T, job_id, 1),
    KVM_F_BOOL(T, stopping, 0), /* revision 13, orchestrator -> stage on data: end of work */
    KVM_F_U64(T, revision, 0),  /* revision 15: the orchestrator's protocol revision */
};

static const kvm_proto__spec kvm_ready__spec = {
    KVM_PROTO_READY, sizeof(T), kvm_ready__fields, KVM_PROTO__N(kvm_ready__fields), NULL, 0, NULL, NULL,
};
static const kvm_proto__spec kvm_heartbeat__spec = {
    KVM_PROTO_HEARTBEAT, sizeof(T), kvm_heartbeat__fields, KVM_PROTO__N(kvm_heartbeat__fields), NULL, 0, NULL, NULL,
};
static const kvm_proto__spec kvm_ack__spec = {
    KVM_PROTO_ACK, sizeof(T), kvm_ack__fields, KVM_PROTO__N(kvm_ack__fields), NULL, 0, NULL, NULL,
};
#undef T

int kvm_proto_ready_encode(const kvm_proto_ready *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_ready__spec, in, out);
}

int kvm_proto_ready_decode(const kvm_msg *msg, kvm_proto_ready *out)
{
    return kvm_proto__decode(&kvm_ready__spec, msg, out);
}

int kvm_proto_heartbeat_encode(const kvm_proto_heartbeat *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_heartbeat__spec, in, out);
}

int kvm_proto_heartbeat_decode(const kvm_msg *msg, kvm_proto_heartbeat *out)
{
    return kvm_proto__decode(&kvm_heartbeat__spec, msg, out);
}

int kvm_proto_ack_encode(const kvm_proto_ack *in, kvm_msg **out) { return kvm_proto__encode(&kvm_ack__spec, in, out); }

int kvm_proto_ack_decode(const kvm_msg *msg, kvm_proto_ack *out) { return kvm_proto__decode(&kvm_ack__spec, msg, out); }
