/* kvm_idxset.h: a set of item indices found by a caller-computed hash (open addressing, linear
 * probing, grown at half full). The caller keeps the items (documents, names) in its own array
 * and says when two are the same; the set only avoids comparing each new item with all earlier
 * ones, which made a corpus scan quadratic in its size (100,000 documents: minutes). */
#ifndef KVM_IDXSET_H
#define KVM_IDXSET_H

#include <stdint.h>

typedef struct kvm_idxset_slot {
    uint64_t hash; /* the item's hash as given */
    int64_t idx;   /* the item's index in the caller's array; -1 = empty slot */
} kvm_idxset_slot;

typedef struct kvm_idxset {
    kvm_idxset_slot *slot; /* cap slots, cap a power of two; NULL until the first add */
    uint64_t cap;
    int64_t n; /* indices stored */
} kvm_idxset;

/* Is item idx of the caller's array the one being looked for? (user: the caller's context) */
typedef int (*kvm_idxset_match_fn)(void *user, int64_t idx);

/* The first index added with this hash for which match() says yes, or -1 (none; an empty set). */
int64_t kvm_idxset_find(const kvm_idxset *s, uint64_t hash, kvm_idxset_match_fn match, void *user);

/* Adds idx (>= 0) under hash (add only items find did not match: of two equal ones, find may return
 * either). Returns 0 or KVM_ENOMEM (the set is unchanged). */
int kvm_idxset_add(kvm_idxset *s, uint64_t hash, int64_t idx);

/* Frees the slots; the set is empty again. Accepts a zeroed set. */
void kvm_idxset_free(kvm_idxset *s);

/* FNV-1a 64 of a NUL-terminated string, for sets of names. */
uint64_t kvm_idxset_hash_str(const char *s);

#endif
