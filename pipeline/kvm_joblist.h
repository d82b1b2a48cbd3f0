/* kvm_joblist.h: the orchestrator's jobs grouped by state: one doubly-linked list per state
 * over the indices [0, n) of the caller's job array, with counts, so that the broker's work per
 * event (the next queued job, the prefilled ones, the jobs in workers, counts for progress)
 * touches only the jobs it acts on, never the whole corpus (a scan of every job per event made
 * a run quadratic in the corpus size). Each list keeps its order: pushed at the back (or front). */
#ifndef KVM_JOBLIST_H
#define KVM_JOBLIST_H

#include <stdint.h>

enum { KVM_JOBLIST_MAX_STATES = 16 };

typedef struct kvm_joblist {
    int64_t n;                                 /* items: indices [0, n) */
    int n_states;                              /* states [0, n_states) */
    int64_t *prev, *next;                      /* [n] neighbours in the item's list; -1 = none */
    uint8_t *state;                            /* [n] the list each item is in */
    int64_t head[KVM_JOBLIST_MAX_STATES];      /* first item of each state's list, -1 = empty */
    int64_t tail[KVM_JOBLIST_MAX_STATES];      /* last item, -1 = empty */
    int64_t count[KVM_JOBLIST_MAX_STATES];     /* items in each list */
} kvm_joblist;

/* Initialises l (caller's storage) with items [0, n) (n >= 0) all in list `initial`, in index
 * order; states are [0, n_states), n_states in [1, KVM_JOBLIST_MAX_STATES], initial in it.
 * Returns 0, KVM_EINVAL (a bound broken: l is zeroed) or KVM_ENOMEM (l is zeroed). Release
 * with kvm_joblist_deinit. */
int kvm_joblist_init(kvm_joblist *l, int64_t n, int n_states, int initial);

/* Frees the arrays; l is zeroed (a zeroed or half-initialised l is accepted). */
void kvm_joblist_deinit(kvm_joblist *l);

/* Moves item i (in [0, n)) from its list to the back of state s's list, or to the front when
 * front is non-zero (also when it is in s already: it is moved within the list). O(1). */
void kvm_joblist_move(kvm_joblist *l, int64_t i, int s, int front);

/* The first item of state s's list, or -1 when it is empty. */
static inline int64_t kvm_joblist_first(const kvm_joblist *l, int s) { return l->head[s]; }

/* The item after i in its list, or -1. Take it before moving i when walking a list that i
 * may leave. */
static inline int64_t kvm_joblist_next(const kvm_joblist *l, int64_t i) { return l->next[i]; }

/* Items in state s's list. */
static inline int64_t kvm_joblist_count(const kvm_joblist *l, int s) { return l->count[s]; }

#endif
