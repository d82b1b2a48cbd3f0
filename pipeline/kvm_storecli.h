/* kvm_storecli.h: the client side of the store service (kvm_storesvc.h): a compress worker on
 * another host uploads each cache with kvm_storecli_put and acks its job only after the
 * service's store_reply says committed, and fetches its PolyKV strategy with
 * kvm_storecli_get_strategy; a decode worker fetches caches with kvm_storecli_get; a run on
 * another host claims its documents with kvm_storecli_claim and renews and releases the
 * claims with kvm_storecli_renew (protocol revision 6). */
#ifndef KVM_STORECLI_H
#define KVM_STORECLI_H

#include "pipeline/kvm_config.h"
#include "pipeline/kvm_serve_cache.h"
#include "proto/kvm_msg.h"

#include <stdint.h>

typedef struct kvm_storecli kvm_storecli;

/* CurveZMQ key files of a store service client; NULL or "" = not given. */
typedef struct kvm_storecli_keys {
    const char *server_public; /* the store service's public key */
    const char *client_public; /* this worker's key pair */
    const char *client_secret;
} kvm_storecli_keys;

/* The keys a worker uses: [security] server_public_key, client_public_key, client_secret_key
 * of cfg (may be NULL) where set, else the stage's --server-key / --client-public /
 * --client-secret (may be NULL). The store service runs on the store's host with that host's
 * server key pair (the orchestrator's), so the same files serve both connections. Strings
 * borrow from cfg and the arguments. */
kvm_storecli_keys kvm_storecli_keys_of(const kvm_config *cfg, const char *server_key, const char *client_public,
                                       const char *client_secret);

/* Connects a DEALER to the store service at endpoint (tcp://HOST:PORT, ipc://...), as a
 * CurveZMQ client when keys->server_public is given (then the client pair too). A non-local
 * endpoint without keys is refused (KVM_EINVAL naming the settings), as is one that is not an
 * endpoint or has a port outside [0, 65535] (kvm_serve_endpoint_check). The key paths are copied.
 * *out is owned (kvm_storecli_close). Errors: KVM_EINVAL, the key files' errors, KVM_EIO,
 * KVM_ENOMEM. */
int kvm_storecli_open(const kvm_storecli_keys *keys, const char *endpoint, kvm_storecli **out);
/* Closes the socket and frees the client; accepts NULL and *c == NULL; sets *c = NULL. */
void kvm_storecli_close(kvm_storecli **c);

/* 1 when the service refused this client's CurveZMQ handshake (a key not in its authorized_keys,
 * a wrong server key): the requests' errors say so, and they are not sent again. */
int kvm_storecli_rejected(const kvm_storecli *c);

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

/* Fetches the PolyKV strategy stored under (model_id, name) with get_strategy (revision 5):
 * *data[0, *len) is a malloc'ed copy of the stored record (caller frees; decode it with
 * kvm_strategy_decode). Waits up to timeout_ms; when no reply comes the connection is made
 * again and the request sent again, attempts times in all (it is read-only). Errors: the
 * service's status with its reason (KVM_ENOTFOUND: none stored, the message names the model
 * id and name), KVM_EPROTO (a reply without a strategy), KVM_EIO (no reply), KVM_ENOMEM. */
int kvm_storecli_get_strategy(kvm_storecli *c, const kvm_store_id *model_id, const char *name, int timeout_ms,
                              int attempts, uint8_t **data, size_t *len);

/* A claim's outcome as the service reports it (kvm_storesvc_claim.h). */
typedef enum kvm_storecli_claim_state {
    KVM_STORECLI_TAKEN = 1, /* this owner holds the claim now */
    KVM_STORECLI_HELD,      /* another owner's live claim holds it: *holder */
    KVM_STORECLI_STORED,    /* the cache is stored (nothing taken): *full_bytes, *stored_bytes */
    KVM_STORECLI_MISSING,   /* a probe: not stored */
} kvm_storecli_claim_state;

/* What kvm_storecli_claim reports besides the state. */
typedef struct kvm_storecli_claim_info {
    kvm_store_claim holder;           /* HELD: the other run (owner, host) and when its claim
                                         lapses (service clock; 0 from a service older than
                                         protocol revision 12) */
    int64_t full_bytes, stored_bytes; /* STORED: the manifest's sizes (0 with INDEX_ONLY) */
} kvm_storecli_claim_info;

/* kvm_storecli_claim's flags. */
enum {
    KVM_STORECLI_PROBE = 1,      /* only ask whether the cache is stored; nothing taken */
    KVM_STORECLI_INDEX_ONLY = 2, /* revision 12: "stored" by the index entry alone (a recheck: the
                                    service reads no layers) */
};

/* Claims key for owner (1..127 bytes) from host (0..63) for ttl_ms (protocol revision 6,
 * `claim`), or with flags KVM_STORECLI_PROBE only asks whether the cache is stored for
 * tokenizer_id (may be NULL: zero). Waits up to timeout_ms per attempt, attempts times (taking one's own claim
 * again renews it, so a retry is safe). *state and *info (may be NULL) say what the service
 * found. Errors: the service's refusal (KVM_ERANGE, KVM_EPROTO, KVM_ESTATE, ...) with its
 * reason, KVM_EPROTO (a reply without an outcome: a revision-5 service), KVM_EIO (no reply). */
int kvm_storecli_claim(kvm_storecli *c, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id,
                       const char *owner, const char *host, int64_t ttl_ms, int flags, int timeout_ms, int attempts,
                       kvm_storecli_claim_state *state, kvm_storecli_claim_info *info);

/* Asks the endpoint of c, once, whether a cache nobody stores is stored (a probe claim: it
 * only reads), to tell at start-up that a store service answers there. Waits up to timeout_ms
 * for the first reply. Returns 0 when it is a store_reply (whatever it says: a refusal of the
 * probe is still a store service's), KVM_EPROTO when it is anything else (another kvmill
 * endpoint: a serve front end's answer, ...; a message that is not kvmill's protocol; a
 * store_reply that does not decode), the message naming the endpoint and what it answered with
 * ("ENDPOINT is not a store service: it answered with TYPE ..."), KVM_EIO when no reply came
 * (nothing listening there yet, or a refused handshake; the message says which). Not for a
 * connection with requests under way (their late replies would be taken as foreign). */
int kvm_storecli_probe_service(kvm_storecli *c, int timeout_ms);

/* Renews every claim of owner for ttl_ms, or with release removes them (`renew_claims`);
 * *n (may be NULL) counts them. Waits and retries as kvm_storecli_claim. Errors: as it. */
int kvm_storecli_renew(kvm_storecli *c, const char *owner, int64_t ttl_ms, int release, int timeout_ms, int attempts,
                       int64_t *n);

#endif
