/* kvm_proto_claim.c: the claim messages of the store service (revision 6): `claim` (take or
 * probe one document's cache key) and `renew_claims` (renew or release a run's claims), so
 * runs that reach their store only through the service share the work as runs on the
 * store's host do (store/kvm_store_claim.c). */
#include <stddef.h>
#include <string.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define KVM_PROTO__MAX_TTL_MS ((int64_t)1 << 40)
#define KVM_PROTO__MAX_OWNER 127 /* the store's claim record: owner < 128 bytes, host < 64 */
#define KVM_PROTO__MAX_HOST 63

static const kvm_proto__field kvm_claim__fields[] = {
    KVM_F_U64(kvm_proto_claim, request_id, 1),
    KVM_F_STR(kvm_proto_claim, owner, 1, 1, KVM_PROTO__MAX_OWNER),
    KVM_F_STR(kvm_proto_claim, host, 0, 0, KVM_PROTO__MAX_HOST),
    KVM_F_I64(kvm_proto_claim, ttl_ms, 0, 0, KVM_PROTO__MAX_TTL_MS),
    KVM_F_ID32(kvm_proto_claim, model_id, 1),
    KVM_F_ID32(kvm_proto_claim, doc_hash, 1),
    KVM_F_ID32(kvm_proto_claim, config_id, 1),
    KVM_F_ID32(kvm_proto_claim, tokenizer_id, 1),
    KVM_F_BOOL(kvm_proto_claim, probe, 0),
    KVM_F_BOOL(kvm_proto_claim, index_only, 0),
};

static int kvm_claim__check_fields(const void *v)
{
    const kvm_proto_claim *c = v;
    if (!c->probe && c->ttl_ms < 1)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_CLAIM, "field 'ttl_ms' is %lld: a claim that is no probe needs a lease >= 1 ms",
                               (long long)c->ttl_ms);
    return 0;
}

static const kvm_proto__spec kvm_claim__spec = {
    KVM_PROTO_CLAIM, sizeof(kvm_proto_claim), kvm_claim__fields, KVM_PROTO__N(kvm_claim__fields), NULL, 0,
    kvm_claim__check_fields, NULL,
};

static const kvm_proto__field kvm_renew_claims__fields[] = {
    KVM_F_U64(kvm_proto_renew_claims, request_id, 1),
    KVM_F_STR(kvm_proto_renew_claims, owner, 1, 1, KVM_PROTO__MAX_OWNER),
    KVM_F_I64(kvm_proto_renew_claims, ttl_ms, 0, 0, KVM_PROTO__MAX_TTL_MS),
    KVM_F_BOOL(kvm_proto_renew_claims, release, 0),
};

static int kvm_renew_claims__check_fields(const void *v)
{
    const kvm_proto_renew_claims *r = v;
    if (!r->release && r->ttl_ms < 1)
        return kvm_proto__fail(KVM_ERANGE, KVM_PROTO_RENEW_CLAIMS,
                               "field 'ttl_ms' is %lld: renewing needs a lease >= 1 ms (or release)", (long long)r->ttl_ms);
    return 0;
}

static const kvm_proto__spec kvm_renew_claims__spec = {
    KVM_PROTO_RENEW_CLAIMS, sizeof(kvm_proto_renew_claims), kvm_renew_claims__fields,
    KVM_PROTO__N(kvm_renew_claims__fields), NULL, 0, kvm_renew_claims__check_fields, NULL,
};

int kvm_proto_claim_encode(const kvm_proto_claim *in, kvm_msg **out) { return kvm_proto__encode(&kvm_claim__spec, in, out); }

int kvm_proto_claim_decode(const kvm_msg *msg, kvm_proto_claim *out) { return kvm_proto__decode(&kvm_claim__spec, msg, out); }

int kvm_proto_renew_claims_encode(const kvm_proto_renew_claims *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_renew_claims__spec, in, out);
}

int kvm_proto_renew_claims_decode(const kvm_msg *msg, kvm_proto_renew_claims *out)
{
    return kvm_proto__decode(&kvm_renew_claims__spec, msg, out);
}
