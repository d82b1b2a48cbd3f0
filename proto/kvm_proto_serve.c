/* kvm_proto_serve.c: the serving messages: `get_cache` (fetch a stored cache by ids), `ask`
 * (a prompt over a document, given as text, bytes or tokens, or named by hash or name) and
 * `answer`. */
#include <stddef.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

#define I32 KVM_PROTO__BIT(KVM_PROTO_I32)

static const kvm_proto__field kvm_get_cache__fields[] = {
    KVM_F_U64(kvm_proto_get_cache, request_id, 1),
    KVM_F_ID32(kvm_proto_get_cache, model_id, 1),
    KVM_F_ID32(kvm_proto_get_cache, doc_hash, 1),
    KVM_F_ID32(kvm_proto_get_cache, config_id, 1),
};
static const kvm_proto__spec kvm_get_cache__spec = {
    KVM_PROTO_GET_CACHE,
    sizeof(kvm_proto_get_cache),
    kvm_get_cache__fields,
    KVM_PROTO__N(kvm_get_cache__fields),
    NULL,
    0,
    NULL,
    NULL,
};

static const kvm_proto__field kvm_ask__fields[] = {
    KVM_F_U64(kvm_proto_ask, request_id, 1),
    KVM_F_STR(kvm_proto_ask, doc_text, 0, 0, KVM_PROTO_MAX_TEXT_BYTES),
    KVM_F_I64(kvm_proto_ask, n_doc_tokens, 1, 0, KVM_PROTO_MAX_TOKENS),
    KVM_F_STR(kvm_proto_ask, prompt, 1, 0, KVM_PROTO_MAX_TEXT_BYTES),
    KVM_F_I64(kvm_proto_ask, max_new_tokens, 1, 0, KVM_PROTO_MAX_TOKENS),
    KVM_F_F64(kvm_proto_ask, temperature, 0, 0.0, 100.0),
    KVM_F_BIN(kvm_proto_ask, doc_bytes, 0, 0, KVM_PROTO_MAX_DOC_BYTES),
    KVM_F_ID32_OPT(kvm_proto_ask, doc_hash, has_doc_hash),
    KVM_F_STR(kvm_proto_ask, doc_name, 0, 0, KVM_PROTO_MAX_NAME_BYTES),
    KVM_F_BOOL(kvm_proto_ask, compute_grant, 0),
    KVM_F_BIN(kvm_proto_ask, prompt_bytes, 0, 0, KVM_PROTO_MAX_TEXT_BYTES),
    KVM_F_I64(kvm_proto_ask, doc_size, 0, 0, 1LL << 62),
};
static const kvm_proto__tensor kvm_ask__tensors[] = {
    KVM_T(kvm_proto_ask, doc_tokens, I32, -1, 0, "n_doc_tokens", 1, offsetof(kvm_proto_ask, n_doc_tokens)),
};

static int kvm_ask__check_tensors(const void *v)
{
    const kvm_proto_ask *a = v;
    if (a->n_doc_tokens > 0 && !a->doc_tokens)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_ASK, "missing tensor 'doc_tokens' (n_doc_tokens = %lld)",
                               (long long)a->n_doc_tokens);
    int given = (a->doc_text.len > 0) + (a->n_doc_tokens > 0) + (a->doc_bytes.len > 0) + (a->has_doc_hash != 0) +
                (a->doc_name.len > 0);
    if (given != 1)
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_ASK,
                               "%s of 'doc_text', 'doc_bytes', 'doc_tokens', 'doc_hash' and 'doc_name' given: exactly "
                               "one names the document",
                               given ? "several" : "none");
    /* a beginning is of a document given as text or bytes, and shorter than the document */
    const size_t len = a->doc_text.len + a->doc_bytes.len;
    if (a->doc_size != 0 && (len == 0 || (uint64_t)a->doc_size <= len))
        return kvm_proto__fail(KVM_EPROTO, KVM_PROTO_ASK,
                               "field 'doc_size' = %lld with %zu bytes of 'doc_text'/'doc_bytes': it must exceed "
                               "them (0: they are the whole document)",
                               (long long)a->doc_size, len);
    return kvm_proto__check_i32(KVM_PROTO_ASK, "doc_tokens", a->doc_tokens, a->n_doc_tokens, 0, INT32_MAX);
}

static const kvm_proto__spec kvm_ask__spec = {
    KVM_PROTO_ASK,
    sizeof(kvm_proto_ask),
    kvm_ask__fields,
    KVM_PROTO__N(kvm_ask__fields),
    kvm_ask__tensors,
    KVM_PROTO__N(kvm_ask__tensors),
    NULL,
    kvm_ask__check_tensors,
};

static const kvm_proto__field kvm_answer__fields[] = {
    KVM_F_U64(kvm_proto_answer, request_id, 1),
    KVM_F_I32(kvm_proto_answer, status, 1, -KVM_PROTO_MAX_STATUS, 0),
    KVM_F_STR(kvm_proto_answer, text, 1, 0, KVM_PROTO_MAX_TEXT_BYTES),
    KVM_F_I64(kvm_proto_answer, n_tokens, 1, 0, KVM_PROTO_MAX_TOKENS),
    KVM_F_F64(kvm_proto_answer, load_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(kvm_proto_answer, prefill_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(kvm_proto_answer, decode_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_F64(kvm_proto_answer, total_ms, 0, 0.0, KVM_PROTO_MAX_MS),
    KVM_F_STR(kvm_proto_answer, message, 0, 0, KVM_PROTO_MAX_MESSAGE_BYTES),
    KVM_F_BOOL(kvm_proto_answer, new_cache, 0),
    KVM_F_BOOL(kvm_proto_answer, computed, 0),
};
static const kvm_proto__tensor kvm_answer__tensors[] = {
    KVM_T(kvm_proto_answer, tokens, I32, -1, 1, "n_tokens", 1, offsetof(kvm_proto_answer, n_tokens)),
};

static int kvm_answer__check_tensors(const void *v)
{
    const kvm_proto_answer *a = v;
    return kvm_proto__check_i32(KVM_PROTO_ANSWER, "tokens", a->tokens, a->n_tokens, 0, INT32_MAX);
}

static const kvm_proto__spec kvm_answer__spec = {
    KVM_PROTO_ANSWER,
    sizeof(kvm_proto_answer),
    kvm_answer__fields,
    KVM_PROTO__N(kvm_answer__fields),
    kvm_answer__tensors,
    KVM_PROTO__N(kvm_answer__tensors),
    NULL,
    kvm_answer__check_tensors,
};
#undef I32

int kvm_proto_get_cache_encode(const kvm_proto_get_cache *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_get_cache__spec, in, out);
}

int kvm_proto_get_cache_decode(const kvm_msg *msg, kvm_proto_get_cache *out)
{
    return kvm_proto__decode(&kvm_get_cache__spec, msg, out);
}

int kvm_proto_ask_encode(const kvm_proto_ask *in, kvm_msg **out) { return kvm_proto__encode(&kvm_ask__spec, in, out); }

int kvm_proto_ask_decode(const kvm_msg *msg, kvm_proto_ask *out) { return kvm_proto__decode(&kvm_ask__spec, msg, out); }

int kvm_proto_answer_encode(const kvm_proto_answer *in, kvm_msg **out)
{
    return kvm_proto__encode(&kvm_answer__spec, in, out);
}

int kvm_proto_answer_decode(const kvm_msg *msg, kvm_proto_answer *out)
{
    return kvm_proto__decode(&kvm_answer__spec, msg, out);
}
