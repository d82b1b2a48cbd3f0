/* kvm_progress.h: a progress counter a long computation updates from any thread and a
 * supervisor reads while it runs (the compress stage's heartbeats carry it). */
#ifndef KVM_PROGRESS_H
#define KVM_PROGRESS_H

#include <stdatomic.h>
#include <stdint.h>

typedef struct kvm_progress {
    _Atomic int64_t done;  /* units finished so far (e.g. (layer, KV head) problems) */
    _Atomic int64_t total; /* units announced so far; grows as passes start; 0 = nothing to report */
} kvm_progress;

/* Adds n units to the total (at the start of a pass); p may be NULL. Thread-safe. */
static inline void kvm_progress_add_total(kvm_progress *p, int64_t n)
{
    if (p) atomic_fetch_add(&p->total, n);
}

/* One more unit done; p may be NULL. Thread-safe. */
static inline void kvm_progress_step(kvm_progress *p)
{
    if (p) atomic_fetch_add(&p->done, 1);
}

#endif
