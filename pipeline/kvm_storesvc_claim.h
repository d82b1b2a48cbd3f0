/* kvm_storesvc_claim.h: the store service's side of claims (protocol revision 6): a run whose
 * store is on another host claims each document through the service, which takes the lease
 * in the store exactly as a run on the store's host does (store/kvm_store_claim.c), so two
 * runs on different hosts sharing one store service compress each document once, and a dead
 * run's claims lapse after their time-to-live. */
#ifndef KVM_STORESVC_CLAIM_H
#define KVM_STORESVC_CLAIM_H

#include "proto/kvm_proto.h"
#include "store/kvm_store.h"

#include <stdint.h>

/* What a claim request found. */
typedef struct kvm_storesvc_claim_out {
    const char *state;            /* "taken", "held", "stored" or "missing" (static strings) */
    kvm_store_claim holder;       /* with "held": the live claim of another owner */
    int64_t full_bytes;           /* with "stored": the manifest's f32 bytes ... */
    int64_t stored_bytes;         /* ... and the cache's stored bytes */
} kvm_storesvc_claim_out;

/* Answers claim c over store s (opened for writing): a cache stored under c's key for c's
 * tokenizer whose layers verify and hold finite keys and values is "stored" (nothing taken; a
 * manifest of another tokenizer or a corrupt cache counts as not stored, as the orchestrator's
 * own check does); else a probe
 * is "missing", and a take claims the key for c->owner for c->ttl_ms ("taken", or "held" with
 * the other owner's lease in out->holder). Returns 0, or the store's error (KVM_ESTATE
 * read-only, KVM_EFULL, KVM_EIO, KVM_EINVAL, KVM_ERANGE: c->ttl_ms above the longest lease,
 * KVM_STORE_CLAIM_MAX_TTL_MS, refused so the client does not believe in a longer lease; checked
 * first, for any take, so a stored key does not answer "stored" to it) with kvm_errmsg set. */
int kvm_storesvc_claim(kvm_store *s, const kvm_proto_claim *c, kvm_storesvc_claim_out *out);

/* Renews (r->ttl_ms from now) or, with r->release, removes every claim of r->owner in one
 * write transaction; *n counts them. Errors: as kvm_store_claim_renew (KVM_ERANGE: r->ttl_ms
 * above KVM_STORE_CLAIM_MAX_TTL_MS). */
int kvm_storesvc_renew(kvm_store *s, const kvm_proto_renew_claims *r, int64_t *n);

enum { KVM_STORESVC_MAX_CLIENTS = 256 };

/* The owners that took or renewed claims through this service: the runs on other hosts (or
 * with [store] path = this service) that store through it. A service started by a run or by
 * kvmill serve ([store] service_bind) stays up for them when its parent asks it to stop. */
typedef struct kvm_storesvc_clients {
    char owner[KVM_STORESVC_MAX_CLIENTS][KVM_PROTO_MAX_NAME_BYTES + 1]; /* NUL-terminated names */
    int n;                                                              /* entries in owner */
    int next;                                                           /* slot replaced when all are used */
} kvm_storesvc_clients;

/* Notes owner (1..127 bytes) as a client (once); when the table is full the oldest entry is
 * replaced (a run that renews is noted again at its next renewal). */
void kvm_storesvc_clients_note(kvm_storesvc_clients *c, const char *owner);

/* Forgets owner (its claims were released: the run ended). */
void kvm_storesvc_clients_forget(kvm_storesvc_clients *c, const char *owner);

/* The live claims (expiring after now, wall clock) of the clients in c, as the store s holds
 * them: *n_claims claims of *n_runs runs; desc gets "OWNER on HOST (N claims, lapsing in S s
 * unless renewed)" for the first three runs, then "and K more runs". Returns 0, or the
 * store's error (kvm_store_list_claims). */
int kvm_storesvc_clients_live(kvm_store *s, const kvm_storesvc_clients *c, int64_t *n_claims, int *n_runs, char *desc,
                              size_t n);

#endif
