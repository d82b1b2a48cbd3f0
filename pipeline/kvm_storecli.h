/* kvm_storecli.h: the client side of the store service (kvm_storesvc.h): a compress worker on
 * another host uploads each cache with kvm_storecli_put and acks its job only after the
 * service's store_reply says committed; a decode worker fetches caches with kvm_storecli_get. */
#ifndef KVM_STORECLI_H
#define KVM_STORECLI_H

#include "pipeline/kvm_config.h"
#include "pipeline/kvm_serve_cache.h"
#include "proto/kvm_msg.h"

#include <stdint.h>

typedef struct kvm_storecli kvm_storecli;

/* Connects a DEALER to the store service at endpoint (tcp://HOST:PORT, ipc://...), as a
 * CurveZMQ client when [security] server_public_key is set in cfg (then client_public_key and
 * client_secret_key are this worker's pair). A non-local endpoint without those keys is
 * refused (KVM_EINVAL naming the settings). *out is owned (kvm_storecli_close). Errors:
 * KVM_EINVAL, the key files' errors, KVM_EIO, KVM_ENOMEM. cfg is not kept. */
int kvm_storecli_open(const kvm_config *cfg, const char *endpoint, kvm_storecli **out);
void kvm_storecli_close(kvm_storecli **c);

/* Uploads e (its manifest and layer messages, which stay the caller's) as put_cache + one
 * `cache` message per layer, job_id and doc_name (may be NULL) in the header, and waits up to
 * timeout_ms for the reply. When no reply comes (service down, restarting, link cut) the
 * connection is made again and the whole upload sent again, attempts times in all (a put is
 * idempotent: the same key is overwritten). Returns 0 once committed; the service's refusal
 * status (KVM_EMISMATCH, KVM_EPROTO, KVM_EFULL, ...) with its reason in kvm_errmsg; KVM_EIO
 * when no attempt got a reply. *bytes (may be NULL) += bytes sent. */
int kvm_storecli_put(kvm_storecli *c, const kvm_serve_cache_enc *e, uint64_t job_id, const char *doc_name,
                     int timeout_ms, int attempts, int64_t *bytes);

/* Fetches the cache under key: *layers[0, *n_layers) are its `cache` messages (owned by the
 * caller: kvm_msg_free each, free the array). Errors: the service's status (KVM_ENOTFOUND,
 * KVM_ECORRUPT, ...) with its message, KVM_EIO (no reply within timeout_ms), KVM_EPROTO. */
int kvm_storecli_get(kvm_storecli *c, const kvm_store_cache_key *key, int timeout_ms, kvm_msg ***layers,
                     int *n_layers);

#endif
