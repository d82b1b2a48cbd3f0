/* kvm_serve_cache.h: a document's compressed cache to and from the store, in the wire
 * encoding (one proto `cache` message per layer, then the manifest, in one transaction).
 * The compress stage writes with it, the decode workers read with it (and write when they
 * compress a missing document on demand), so both sides agree on keys and manifests. */
#ifndef KVM_SERVE_CACHE_H
#define KVM_SERVE_CACHE_H

#include "model/kvm_kvcache.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_worker.h"
#include "proto/kvm_msg.h"
#include "store/kvm_store.h"

#include <stdint.h>

/* Encodes every layer of cc (keys/values in [store] dtype of cfg) and stores cache +
 * manifest in one transaction under (wm->model_id, doc hash of tokens[0, n_tokens), config
 * id of cfg). tokens are the document's ids as prepared (BOS first, truncated): n_tokens is
 * the document length N, and every kept entry's position must lie in [0, N). The manifest
 * records wm->tok_id and the full f32 size of the model's cache for N tokens. Everything is
 * borrowed; frames are copied by the store. Thread-safety: the store serialises calls.
 * Errors: KVM_EINVAL (bad dtype, positions out of range), KVM_ENOMEM, and the store's
 * errors (KVM_EFULL, KVM_EIO, KVM_ESTATE, ...), all with kvm_errmsg() detail. *stored_bytes
 * (NULL: not wanted) gets the bytes of the layers' frames stored (the manifest's stored_bytes;
 * 0 on an error). */
int kvm_serve_cache_store(kvm_store *store, const kvm_config *cfg, const kvm_worker_model *wm, const int32_t *tokens,
                          int64_t n_tokens, const kvm_kvcache *cc, int64_t *stored_bytes);

/* A cache encoded for the store but not yet committed: what kvm_serve_cache_store writes, and
 * what a compress worker on another host uploads to the store service (kvm_storecli.h). */
typedef struct kvm_serve_cache_enc {
    kvm_store_manifest man; /* ids, counts, dtype; man.config points at canon */
    kvm_msg **msgs;         /* [n_layers] `cache` messages, owned */
    int n_layers;
    char *canon;            /* canonical config text, owned */
    size_t canon_n;
} kvm_serve_cache_enc;

/* Encodes cc as kvm_serve_cache_store would store it (store: for the PolyKV strategy's hash in
 * the config id; may be NULL for other methods, or when strategy is given). strategy[0,
 * strategy_len) (may be NULL): the PolyKV strategy record the cache was compressed with, as
 * fetched from the store service; its hash goes into the config id instead of the store's
 * (only for method polykv). *out is owned by the caller (kvm_serve_cache_enc_free; zeroed on
 * failure). Errors: as kvm_serve_cache_store, the store's read errors. */
int kvm_serve_cache_encode(kvm_store *store, const uint8_t *strategy, size_t strategy_len, const kvm_config *cfg,
                           const kvm_worker_model *wm, const int32_t *tokens, int64_t n_tokens, const kvm_kvcache *cc,
                           kvm_serve_cache_enc *out);
/* Frees what kvm_serve_cache_encode made; accepts a zeroed struct. */
void kvm_serve_cache_enc_free(kvm_serve_cache_enc *e);

/* Loads the cache stored under `key` (checked against tokenizer_id when not NULL) into a
 * new ragged cache shaped for model m, with next_pos = the document length N (the manifest's
 * n_tokens), so appended tokens get positions N, N+1, ... extra_per_head reserves room for
 * that many more entries in every (layer, KV head), so a decode of that many tokens does
 * not reallocate. On success *out is owned by the caller (kvm_kvcache_free) and *n_tokens
 * (may be NULL) is N. Errors: KVM_ENOTFOUND (no cache under key), KVM_EMISMATCH (stored for
 * another model shape, tokenizer or config), KVM_ECORRUPT (a checksum or layer fails to
 * decode: the detail names the layer), KVM_ENOMEM, the store's KVM_ESTATE/KVM_EIO. */
int kvm_serve_cache_load(kvm_store *store, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id,
                         const kvm_model *m, int64_t extra_per_head, kvm_kvcache **out, int64_t *n_tokens);

/* Decodes layer l (in [0, sc->manifest.n_layers)) of a stored cache into layer l of c, as
 * kvm_serve_cache_load does: the frames are copied (aligned) and decoded by
 * kvm_cachecodec_decode_layer, replacing the layer's entries. Everything is borrowed.
 * Errors: KVM_ECORRUPT (the frames are no valid `cache` message: "stored cache layer L does
 * not decode: why"), KVM_EMISMATCH (a message of another layer or shape than c), KVM_ENOMEM. */
int kvm_serve_cache_decode_layer(const kvm_store_cache *sc, int l, kvm_kvcache *c);

/* `store verify`'s decode check of the cache under key: reads it (no tokenizer check) and
 * decodes every layer as kvm_serve_cache_load would, into a cache shaped by the store's
 * record of its model (and checks the manifest's n_tokens against the model's window and its
 * layer count against the model's, as serve does), or, without such a record, by layer 0's own
 * message; one decoded layer is held at a time. Each layer that fails is reported through
 * report (may be NULL) as "cache M:D:C layer L: why" and counted in *n_bad. A cache the
 * store's record checks refuse (KVM_ECORRUPT, KVM_EMISMATCH, KVM_ENOTFOUND) is left to
 * kvm_store_verify's report: 0 and *n_bad = 0. Returns 0 when the check ran; errors:
 * KVM_ENOMEM, the store's KVM_ESTATE / KVM_EIO. */
int kvm_serve_cache_check(kvm_store *store, const kvm_store_cache_key *key, kvm_store_report_fn report, void *arg,
                          int64_t *n_bad);

#endif
