/* kvm_cachecodec.h: a ragged KV cache (model/kvm_kvcache.h) as proto `cache` messages, one
 * per layer, and as the per-layer store values (packed messages), so the compress stage,
 * the store and the decode workers all use the wire encoding (PROTOCOL.md). */
#ifndef KVM_CACHECODEC_H
#define KVM_CACHECODEC_H

#include "model/kvm_kvcache.h"
#include "proto/kvm_proto.h"
#include "store/kvm_store.h"

/* Encodes layer `layer` of c as a `cache` message with keys/values in dtype (f32, f16 or
 * bf16; 16-bit types round to nearest even; an f16 cache (kv_dtype) goes to f16 frames bit for
 * bit and to f32 frames exactly). n_tokens is the document length (positions
 * must lie in [0, n_tokens) or be KVM_POS_NONE). Returns 0 and *out (caller frees),
 * KVM_EINVAL (bad dtype, positions out of range), KVM_ERANGE (a key or value is NaN or inf, or
 * f16 would make a finite one inf, |x| >= 65520: the message names layer, head, entry and value),
 * KVM_ENOMEM. */
int kvm_cachecodec_encode_layer(const kvm_kvcache *c, int layer, int64_t n_tokens, kvm_proto_dtype dtype,
                                kvm_msg **out);

/* Decodes one `cache` message into layer `layer` of c (replacing that layer's entries),
 * converting keys/values to c's element type (float32, or f16 for a kv_dtype = f16 cache:
 * f16 frames are then copied bit for bit, f32/bf16 frames rounded to nearest even). The message's layer, n_layers,
 * n_kv_heads and head_dim must equal c's shape and `layer`. Errors: KVM_EPROTO / KVM_ERANGE (malformed message, or a
 * key or value that is NaN or inf, or overflows c's f16),
 * KVM_EMISMATCH (shape differs from c), KVM_ENOMEM. */
int kvm_cachecodec_decode_layer(const kvm_msg *msg, int layer, kvm_kvcache *c);

/* Checks that the keys and values of m (one `cache` message, decoded by kvm_proto_cache_decode:
 * [n_entries][head_dim] in m->dtype, rows grouped by KV head as m->head_entries says) are
 * finite: the rule kvm_cachecodec_encode_layer applies before it writes a layer and
 * _decode_layer before it reads one, for a process that keeps the message as it came (the store
 * service, which commits an upload's messages unchanged). cause (a phrase, borrowed) says where
 * a non-finite value came from. A logit bias that is NaN or +inf is refused as well (-inf, an
 * entry never attended, is kept), as the encoder and decoder refuse it; positions are checked
 * by the message decoder. Reads m only. Returns 0, or KVM_ERANGE with the first
 * offender named: "cache layer L, KV head G, key|value of entry E (row within the head): X is
 * not a finite number (cause): the cache is refused". */
int kvm_cachecodec_check_finite(const kvm_proto_cache *m, const char *cause);

/* Checks a stored cache sc (from kvm_store_get_cache, whose checksums passed; borrowed) the
 * way a reader finds it: every layer must decode as a `cache` message whose keys and values
 * are finite (kvm_cachecodec_check_finite). A cache that passes its checksums yet fails this
 * (committed by a store service that took non-finite uploads, or an older kvmill's f16
 * encoder) is refused by every ask, so "already stored?" must not count it. Returns 0,
 * KVM_ECORRUPT ("stored cache layer L does not decode: ..."), KVM_ENOMEM. */
int kvm_cachecodec_check_stored(const kvm_store_cache *sc);

/* Packs every layer into store values: *blobs[l] malloc'ed (caller frees each and the array),
 * *sizes[l] bytes. Returns 0 or an error as above. */
int kvm_cachecodec_pack(const kvm_kvcache *c, int64_t n_tokens, kvm_proto_dtype dtype, uint8_t ***blobs,
                        size_t **sizes);

/* Builds a cache from packed store values (one per layer), shaped n_layers x n_kv_heads x
 * head_dim; next_pos = n_tokens of the messages. Returns 0 and *out, KVM_ECORRUPT when a
 * value does not unpack or decode (the detail names the layer), KVM_EMISMATCH, KVM_ENOMEM. */
int kvm_cachecodec_unpack(const uint8_t *const *blobs, const size_t *sizes, int n_layers, int n_kv_heads, int head_dim,
                          kvm_kvcache **out);

/* What the store would serve for c: every layer encoded as its `cache` message in dtype (as
 * the compress stage writes it) and decoded back to float32 into a new cache *out (caller
 * frees; next_pos = n_tokens). *stored_bytes gets the messages' frame bytes, the figure the
 * store records as a cache's stored_bytes and the run summary sums as bytes_compressed. f32
 * is exact; f16/bf16 round keys and values to nearest even (positions and logit biases stay
 * float32/int32). Returns 0, or an error as kvm_cachecodec_encode_layer / _decode_layer. */
int kvm_cachecodec_roundtrip(const kvm_kvcache *c, int64_t n_tokens, kvm_proto_dtype dtype, kvm_kvcache **out,
                             int64_t *stored_bytes);

#endif
