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

#endif
