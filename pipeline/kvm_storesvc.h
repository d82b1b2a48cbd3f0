/* kvm_storesvc.h: the store service (`kvmill-store`, `kvmill store serve`): the one process
 * that opens the LMDB store for writing when workers run on other hosts. It answers, on one
 * ROUTER socket (proto/PROTOCOL.md, revisions 3, 5 and 6):
 *   put_cache + n_layers `cache` messages -> checks every layer against the upload's header,
 *       commits cache + manifest in one transaction (kvm_store_put_cache), records the
 *       document's name, then answers store_reply status 0; anything else is refused with a
 *       store_reply status < 0 naming the reason, and the store is left unchanged;
 *   get_cache -> store_reply {n_layers} followed by the stored `cache` messages, one per
 *       layer, or store_reply status < 0 (KVM_ENOTFOUND, ...);
 *   get_strategy (revision 5) -> store_reply {strategy: the stored bytes}, read-only, or
 *       status KVM_ENOTFOUND naming the model id and strategy name (a remote PolyKV worker);
 *   claim, renew_claims (revision 6) -> store_reply {claim: taken|held|stored|missing, holder,
 *       n_claims}: the claims of runs on other hosts (kvm_storesvc_claim.h).
 * Uploads are tracked per connection (routing id); an upload interrupted by another request
 * of the same client, or not finished within upload_timeout_ms, is refused (truncated). */
#ifndef KVM_STORESVC_H
#define KVM_STORESVC_H

#include "pipeline/kvm_config.h"
#include "store/kvm_store.h"

#include <signal.h>
#include <stdint.h>
#include <stdio.h>

/* Counters of a service loop, for logs and tests. */
typedef struct kvm_storesvc_stats {
    int64_t committed;  /* caches committed */
    int64_t refused;    /* uploads refused (bad input, truncated, store errors) */
    int64_t served;     /* get_cache requests answered with a cache */
    int64_t strategies; /* get_strategy requests answered with a strategy */
    int64_t claims;     /* claim and renew_claims requests answered (revision 6) */
    int64_t bytes_in;   /* bytes of accepted upload messages (all frames) */
    int64_t bytes_out;  /* bytes of cache messages served */
} kvm_storesvc_stats;

/* Runs the service on sock (a bound ZMQ_ROUTER) over store *s (opened for writing) until *stop
 * becomes non-zero (checked at least every 200 ms; *stop counts the stop requests) or the
 * context terminates. In a service kvm_storesvc_main started with parent_pid > 0, a first stop
 * request while runs that took or renewed claims through it hold live ones keeps it serving
 * (said once: "stays up for OWNER on HOST (N claims, ...) until ...") until those claims are
 * released or lapse, or *stop reaches 2. Logs one line
 * per refusal and commit to log (may be NULL). stats (may be NULL) is kept current. Before each
 * message the store at its path is followed (kvm_store_follow): a compacted copy moved in place
 * is opened again and *s set to the new handle (the caller closes whichever *s holds at the
 * end); a store gone from its path (after a second's wait for a swap's renames) makes every
 * request refused, naming why, until a store is there again: commits went into the folder moved
 * away, lost to every reader of the path. Returns 0, or KVM_EIO when the socket fails. */
int kvm_storesvc_loop(kvm_store **s, void *sock, int64_t upload_timeout_ms, const volatile sig_atomic_t *stop,
                      kvm_storesvc_stats *stats, FILE *log);

/* The whole service process: opens the store at path (NULL: [store] path of cfg) with cfg's
 * [store] settings (a store that does not exist there is refused unless create is 1, then
 * made empty), binds a ROUTER at endpoint (the rules of kvm_serve_bind: a non-local
 * endpoint needs [security] server_secret_key and authorized_keys; keys, when set, are used on
 * local endpoints too), prints "kvmill-store: ready on ENDPOINT" (the bound endpoint, port 0
 * resolved) on stdout, and serves until SIGINT/SIGTERM, or, with parent_pid > 0, until that
 * process is no longer its parent (it died: kvm_svcproc starts the service so). With
 * parent_pid > 0 the first SIGINT/SIGTERM waits for the live claims of the runs that claim
 * through it (kvm_storesvc_loop), a second one stops it now. Returns a process exit status: 0 after
 * a signal, 2 when the store or the endpoint cannot be opened (the reason on stderr). */
int kvm_storesvc_main(const kvm_config *cfg, const char *path, const char *endpoint, int create, long parent_pid);

#endif
