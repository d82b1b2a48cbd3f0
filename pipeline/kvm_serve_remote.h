/* kvm_serve_remote.h: a document's compressed cache to and from the store service on another
 * host (kvm_storecli.h), shaped like kvm_serve_cache.h's local calls, so compress and decode
 * workers switch between a local LMDB store and a remote one at one place. */
#ifndef KVM_SERVE_REMOTE_H
#define KVM_SERVE_REMOTE_H

#include "pipeline/kvm_serve_cache.h"
#include "pipeline/kvm_storecli.h"

/* 1 when a --store value / [store] path names a store service endpoint (tcp://, ipc://)
 * rather than an LMDB directory. */
int kvm_serve_remote_is_endpoint(const char *store);

/* The store service a worker uses: `store` (--store, may be NULL) when it is an endpoint, else
 * [store] service of cfg (may be NULL) when set, else NULL (open the LMDB store directly). */
const char *kvm_serve_remote_endpoint(const char *store, const kvm_config *cfg);

/* kvm_serve_cache_store over the service: encodes cc and uploads it with job_id and doc_name
 * (may be NULL), up to 3 attempts of [store] upload_timeout_ms each. The config id is made
 * without a store: for PolyKV from strategy[0, strategy_len), the record cc was compressed
 * with (kvm_serve_remote_strategy; NULL for other methods). Returns 0 once committed; *bytes
 * (may be NULL) += bytes sent. Errors: encode's (KVM_ENOTFOUND: polykv without strategy),
 * kvm_storecli_put's (KVM_EIO: no reply). */
int kvm_serve_remote_store(kvm_storecli *svc, const kvm_config *cfg, const kvm_worker_model *wm, const int32_t *tokens,
                           int64_t n_tokens, const kvm_kvcache *cc, const uint8_t *strategy, size_t strategy_len,
                           uint64_t job_id, const char *doc_name, int64_t *bytes);

/* The PolyKV strategy [compress] strategy of cfg stored for model_id, fetched from the store
 * service (get_strategy, up to 3 attempts of kvm_orch_remote_timeout_ms): *data[0, *len)
 * malloc'ed (caller frees). Errors: kvm_storecli_get_strategy's (KVM_ENOTFOUND: none stored,
 * the message names the model id and the strategy). */
int kvm_serve_remote_strategy(kvm_storecli *svc, const kvm_config *cfg, const kvm_store_id *model_id, uint8_t **data,
                              size_t *len);

/* kvm_serve_cache_load over the service (get_cache): the cache under key as a new ragged
 * cache for model m with room for extra_per_head more entries per head, next_pos = N; *n_tokens
 * (may be NULL) = N. The tokenizer is not checked (the key's model id is). Errors: the
 * service's (KVM_ENOTFOUND, ...), KVM_EIO (no reply within kvm_orch_remote_timeout_ms: [run]
 * heartbeat_ms x liveness),
 * KVM_EMISMATCH (layers for another shape), KVM_ECORRUPT (a layer does not decode). */
int kvm_serve_remote_load(kvm_storecli *svc, const kvm_config *cfg, const kvm_store_cache_key *key, const kvm_model *m,
                          int64_t extra_per_head, kvm_kvcache **out, int64_t *n_tokens);

#endif
