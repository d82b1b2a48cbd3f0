/* kvm_proto_storesvc.c: the store service messages (revision 3): `put_cache` (the header of a
 * cache upload) and `store_reply` (committed, refused, or found); revision 5: `get_strategy`
 * (a model's PolyKV strategy, for compress workers on other hosts). */
#include <stddef.h>
#include <string.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define KVM_PROTO__MAX_COUNT ((int64_t)1 << 62)

static const kvm_proto__field kvm_put_cache__fields[] = {
    KVM_F_U64(kvm_proto_put_cache, request_id, 1),
    KVM_F_U64(kvm_proto_put_cache, job_id, 0),
    KVM_F_ID32(kvm_proto_put_cache, model_id, 1),
    KVM_F_ID32(kvm_proto_put_cache, doc_hash, 1),
    KVM_F_ID32(kvm_proto_put_cache, config_id, 1),
    KVM_F_ID32(kvm_proto_put_cache, tokenizer_id, 1),
    KVM_F_I64(kvm_proto_put_cache, n_layers, 1, 1, KVM_PROTO_MAX_LAYERS),
    KVM_F_I64(kvm_proto_put_cache, n_kv_heads, 1, 1, KVM_PROTO_MAX_HEADS),
    KVM_F_I64(kvm_proto_put_cache, head_dim, 1, 1, KVM_PROTO_MAX_HEAD_DIM),
    KVM_F_I64(kvm_proto_put_cache, n_tokens, 1, 1, KVM_PROTO_MAX_TOKENS),
    KVM_F_I64(kvm_proto_put_cache, n_entries, 1, 0, KVM_PROTO__MAX_COUNT),
    KVM_F_I64(kvm_proto_put_cache, full_bytes, 1, 0, KVM_PROTO__MAX_COUNT),
    KVM_F_STR(kvm_proto_put_cache, dtype, 1, 1, 16),
    KVM_F_BIN(kvm_proto_put_cache, config, 0, 0, KVM_PROTO_MAX_TEXT_BYTES),
    KVM_F_STR(kvm_proto_put_cache, doc_name, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
};

static int kvm_put_cache__check_fields(const void *v)
{
    const kvm_proto_put_cache *p = v;
    static const char *const ok[] = {"f32", "f16", "bf16"};
    for (size_t i = 0; i < KVM_PROTO__N(ok); i++)
        if (kvm_proto_str_eq(p->dtype, ok[i])) return 0;
    char q[64];
    kvm_proto__quote(q, sizeof q, p->dtype.ptr, p->dtype.len);
    return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_PUT_CACHE, "field 'dtype' is \"%s\", expected f32, f16 or bf16", q);
}

static const kvm_proto__spec kvm_put_cache__spec = {
    KVM_PROTO_PUT_CACHE,
    sizeof(kvm_proto_put_cache),
    kvm_put_cache__fields,
    KVM_PROTO__N(kvm_put_cache__fields),
    NULL,
    0,
    kvm_put_cache__check_fields,
    NULL,
};

static const kvm_proto__field kvm_store_reply__fields[] = {
    KVM_F_U64(kvm_proto_store_reply, request_id, 1),
    KVM_F_U64(kvm_proto_store_reply, job_id, 0),
    KVM_F_I32(kvm_proto_store_reply, status, 1, -KVM_PROTO_MAX_STATUS, 0),
    KVM_F_STR(kvm_proto_store_reply, message, 0, 0, KVM_PROTO_MAX_MESSAGE_BYTES),
    KVM_F_I64(kvm_proto_store_reply, n_layers, 0, 0, KVM_PROTO_MAX_LAYERS),
    KVM_F_BIN(kvm_proto_store_reply, strategy, 0, 0, KVM_PROTO_MAX_TEXT_BYTES),
    KVM_F_STR(kvm_proto_store_reply, claim, 0, 0, 16),
    KVM_F_STR(kvm_proto_store_reply, holder, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_STR(kvm_proto_store_reply, holder_host, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_I64(kvm_proto_store_reply, n_claims, 0, 0, KVM_PROTO__MAX_COUNT),
    KVM_F_I64(kvm_proto_store_reply, full_bytes, 0, 0, KVM_PROTO__MAX_COUNT),
    KVM_F_I64(kvm_proto_store_reply, stored_bytes, 0, 0, KVM_PROTO__MAX_COUNT),
    KVM_F_I64(kvm_proto_store_reply, holder_expires_ms, 0, 0, KVM_PROTO__MAX_COUNT),
};

/* Revision 6: a claim outcome is one of four words; the holder (and, revision 12, its expiry)
 * comes with "held" only. */
static int kvm_store_reply__check_claim(const kvm_proto_store_reply *r)
{
    static const char *const ok[] = {"", "taken", "held", "stored", "missing"};
    size_t i = 0;
    while (i < KVM_PROTO__N(ok) && !kvm_proto_str_eq(r->claim, ok[i]))
        i++;
    if (i == KVM_PROTO__N(ok)) {
        char q[64];
        kvm_proto__quote(q, sizeof q, r->claim.ptr, r->claim.len);
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_STORE_REPLY,
                               "field 'claim' is \"%s\", expected taken, held, stored or missing", q);
    }
    if (r->status < 0 && r->claim.len)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_STORE_REPLY, "field 'claim' in a refusal (status %d)", (int)r->status);
    int held = kvm_proto_str_eq(r->claim, "held");
    if (held != (r->holder.len > 0) || (!held && r->holder_host.len))
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_STORE_REPLY,
                               "field 'holder' comes with claim \"held\" and only with it");
    if (!held && r->holder_expires_ms)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_STORE_REPLY,
                               "field 'holder_expires_ms' comes with claim \"held\" only");
    return 0;
}

static int kvm_store_reply__check_fields(const void *v)
{
    const kvm_proto_store_reply *r = v;
    if (r->status < 0 && r->n_layers != 0)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_STORE_REPLY, "field 'n_layers' is %lld in a refusal (status %d)",
                               (long long)r->n_layers, (int)r->status);
    if (r->status < 0 && r->strategy.len != 0)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_STORE_REPLY, "field 'strategy' has %zu bytes in a refusal (status %d)",
                               r->strategy.len, (int)r->status);
    if (r->n_layers != 0 && r->strategy.len != 0)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_STORE_REPLY,
                               "fields 'n_layers' (%lld) and 'strategy' (%zu bytes) in one reply: a reply answers "
                               "either a get_cache or a get_strategy",
                               (long long)r->n_layers, r->strategy.len);
    return kvm_store_reply__check_claim(r);
}

static const kvm_proto__spec kvm_store_reply__spec = {
    KVM_PROTO_STORE_REPLY,
    sizeof(kvm_proto_store_reply),
    kvm_store_reply__fields,
    KVM_PROTO__N(kvm_store_reply__fields),
    NULL,
    0,
    kvm_store_reply__check_fields,
    NULL,
};

static const kvm_proto__field kvm_get_strategy__fields[] = {
    KVM_F_U64(kvm_proto_get_strategy, request_id, 1),
    KVM_F_ID32(kvm_proto_get_strategy, model_id, 1),
    KVM_F_STR(kvm_proto_get_strategy, name, 1, 1, KVM_PROTO_MAX_NAME_BYTES),
};

static const kvm_proto__spec kvm_get_strategy__spec = {
    KVM_PROTO_GET_STRATEGY,
    sizeof(kvm_proto_get_strategy),
    kvm_get_strategy__fields,
    KVM_PROTO__N(kvm_get_strategy__fields),
    NULL,
    0,
    NULL,
    NULL,
};

int kvm_proto_put_cache_encode(const kvm_proto_put_cache *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_put_cache__spec, in, out);
}

int kvm_proto_put_cache_decode(const kvm_msg *msg, kvm_proto_put_cache *out)
{
    return kvm_proto__decode(&kvm_put_cache__spec, msg, out);
}

int kvm_proto_store_reply_encode(const kvm_proto_store_reply *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_store_reply__spec, in, out);
}

int kvm_proto_store_reply_decode(const kvm_msg *msg, kvm_proto_store_reply *out)
{
    return kvm_proto__decode(&kvm_store_reply__spec, msg, out);
}

int kvm_proto_get_strategy_encode(const kvm_proto_get_strategy *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_get_strategy__spec, in, out);
}

int kvm_proto_get_strategy_decode(const kvm_msg *msg, kvm_proto_get_strategy *out)
{
    return kvm_proto__decode(&kvm_get_strategy__spec, msg, out);
}
