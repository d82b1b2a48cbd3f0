/* fuzz_blob.c: libFuzzer target for kvm_msg_unpack (the store's blob format), copy and borrow
 * modes: an accepted blob must pack back to the same bytes, and its message then goes to the
 * decoder its header names. */
#include "proto/fuzz/fuzz_common.h"

static void kvm_fuzz_dispatch(const kvm_msg *m)
{
    kvm_proto_type t;
    if (kvm_proto_peek(m, &t) != 0) return;
    union {
        kvm_proto_job job;
        kvm_proto_kv kv;
        kvm_proto_stats stats;
        kvm_proto_strategy strategy;
        kvm_proto_cache cache;
        kvm_proto_result result;
        kvm_proto_ctl ctl;
        kvm_proto_get_cache get_cache;
        kvm_proto_ask ask;
        kvm_proto_answer answer;
        kvm_proto_put_cache put_cache;
        kvm_proto_store_reply store_reply;
        kvm_proto_get_strategy get_strategy;
        kvm_proto_claim claim;
        kvm_proto_renew_claims renew_claims;
    } u;
    switch (t) {
    case KVM_PROTO_JOB:
        (void)kvm_proto_job_decode(m, &u.job);
        break;
    case KVM_PROTO_KV:
        (void)kvm_proto_kv_decode(m, &u.kv);
        break;
    case KVM_PROTO_STATS:
        (void)kvm_proto_stats_decode(m, &u.stats);
        break;
    case KVM_PROTO_STRATEGY:
        (void)kvm_proto_strategy_decode(m, &u.strategy);
        break;
    case KVM_PROTO_CACHE:
        (void)kvm_proto_cache_decode(m, &u.cache);
        break;
    case KVM_PROTO_RESULT:
        (void)kvm_proto_result_decode(m, &u.result);
        break;
    case KVM_PROTO_ERROR:
        (void)kvm_proto_error_decode(m, &u.result);
        break;
    case KVM_PROTO_READY:
        (void)kvm_proto_ready_decode(m, &u.ctl);
        break;
    case KVM_PROTO_HEARTBEAT:
        (void)kvm_proto_heartbeat_decode(m, &u.ctl);
        break;
    case KVM_PROTO_ACK:
        (void)kvm_proto_ack_decode(m, &u.ctl);
        break;
    case KVM_PROTO_GET_CACHE:
        (void)kvm_proto_get_cache_decode(m, &u.get_cache);
        break;
    case KVM_PROTO_ASK:
        (void)kvm_proto_ask_decode(m, &u.ask);
        break;
    case KVM_PROTO_ANSWER:
        (void)kvm_proto_answer_decode(m, &u.answer);
        break;
    case KVM_PROTO_PUT_CACHE:
        (void)kvm_proto_put_cache_decode(m, &u.put_cache);
        break;
    case KVM_PROTO_STORE_REPLY:
        (void)kvm_proto_store_reply_decode(m, &u.store_reply);
        break;
    case KVM_PROTO_GET_STRATEGY:
        (void)kvm_proto_get_strategy_decode(m, &u.get_strategy);
        break;
    case KVM_PROTO_CLAIM:
        (void)kvm_proto_claim_decode(m, &u.claim);
        break;
    case KVM_PROTO_RENEW_CLAIMS:
        (void)kvm_proto_renew_claims_decode(m, &u.renew_claims);
        break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size heap copy, 8-aligned like an LMDB overflow value */
    uint8_t *blob = malloc(size ? size : 1);
    if (!blob) return 0;
    if (size) memcpy(blob, data, size);
    for (unsigned flags = 0; flags <= KVM_MSG_BORROW; flags++) {
        kvm_msg *m = NULL;
        if (kvm_msg_unpack(blob, size, flags, &m) != 0) continue;
        uint8_t *again = NULL;
        size_t n = 0;
        if (kvm_msg_pack(m, &again, &n) != 0 || n != size || memcmp(again, blob, size) != 0) {
            fprintf(stderr, "accepted blob does not pack back to itself\n");
            abort();
        }
        free(again);
        kvm_fuzz_dispatch(m);
        kvm_msg_free(&m);
    }
    free(blob);
    return 0;
}
