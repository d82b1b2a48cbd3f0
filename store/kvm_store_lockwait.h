/* kvm_store_lockwait.h: the watchdog of waits for LMDB's write lock (internal to store/).
 * LMDB has no try-lock for write transactions: mdb_txn_begin blocks on a process-shared
 * robust mutex, which no signal interrupts. Another process holding that lock (a kvmill
 * writer stopped with Ctrl-Z or kill -STOP inside a commit, or hung) froze the waiter
 * silently, Ctrl-C included. So each writable handle marks its waits here (one atomic store
 * before mdb_txn_begin, one compare-and-swap after), and one thread per process, started by
 * the first writable handle and joined when the last is closed, looks at them every 250 ms: it says a wait of 2 s or
 * more on stderr (kvm_log), once per wait, and that it ended; and when the interrupt flag of
 * kvm_store_set_interrupt moved during such a wait it ends the process with status 130, but only
 * when the wait looks stuck (a stopped process has the store open, the wait has lasted
 * KVM_STORE__LOCKWAIT_STUCK_MS, or the flag counts a second interrupt): a holder that is merely
 * busy (other writers' ordinary commits on a busy disk) lets the lock go soon, and the
 * process's first Ctrl-C is then its graceful drain, not an exit. It scans /proc and writes
 * to stderr without its mutex held: open, close and fork never wait behind a slow stderr. */
#ifndef KVM_STORE_LOCKWAIT_H
#define KVM_STORE_LOCKWAIT_H

#include <stdatomic.h>
#include <stdint.h>

/* A wait said after this long. */
#define KVM_STORE__LOCKWAIT_SAY_MS 2000
/* The watchdog's period. */
#define KVM_STORE__LOCKWAIT_TICK_MS 250
/* An interrupt during a wait this long ends the process though no stopped holder was found:
 * far beyond any ordinary commit, so the holder is hung. */
#define KVM_STORE__LOCKWAIT_STUCK_MS 30000
/* While an interrupt waits for the lock, /proc is scanned for a stopped holder at most this
 * often (a scan reads every process's descriptors). */
#define KVM_STORE__LOCKWAIT_SCAN_MS 1000

/* One writable handle's wait state; embedded in the handle, zero-initialized. */
typedef struct kvm_store__lockwait {
    _Atomic int64_t state;            /* 0 idle; > 0 waiting since this CLOCK_MONOTONIC ms; or
                                         KVM_STORE__LW_WRITING / KVM_STORE__LW_STOPPING */
    atomic_int intr_at_start;         /* the interrupt flag's value when the wait began */
    const char *path;                 /* the store's directory; borrowed from the handle */
    int64_t said_since;               /* watchdog only: the wait it said (its state), 0 none */
    int64_t busy_said;                /* watchdog only: the wait whose interrupt it said deferred */
    int64_t scanned_ms;               /* watchdog only: its last /proc scan for this handle */
    unsigned looked;                  /* watchdog only: the tick that last looked at it */
    struct kvm_store__lockwait *next; /* the process's list; under the module's mutex */
} kvm_store__lockwait;

/* Holds the write lock (a write transaction is open). */
#define KVM_STORE__LW_WRITING (-1)
/* The watchdog is ending the process: the waiter must not write. */
#define KVM_STORE__LW_STOPPING (-2)

/* Adds w (path borrowed until kvm_store__lockwait_remove) to the watched waits and starts
 * the process's watchdog thread if none runs in this process now. When the thread cannot be
 * started the waits go unwatched (as before; nothing else changes) and the next add tries
 * again. */
void kvm_store__lockwait_add(kvm_store__lockwait *w, const char *path);
/* Takes w off the list (a no-op when it is not on it); says the end of a wait it said. The
 * last one taken off stops and joins the watchdog (within a tick at most). Not from a forked
 * child for a handle of its parent. */
void kvm_store__lockwait_remove(kvm_store__lockwait *w);
/* Marks w waiting for the write lock from now on: call right before mdb_txn_begin. */
void kvm_store__lockwait_begin(kvm_store__lockwait *w);
/* Marks the wait over: holding = 1 when mdb_txn_begin gave a write transaction, 0 when it
 * failed. Returns 0; when the watchdog is ending the process (an interrupt during a long
 * wait) it returns 1 instead: the caller aborts its transaction, writes nothing and calls
 * kvm_store__lockwait_park. */
int kvm_store__lockwait_got(kvm_store__lockwait *w, int holding);
/* Never returns: waits for the watchdog's _exit, which follows at once. */
_Noreturn void kvm_store__lockwait_park(void);
/* Marks w idle (its write transaction committed or aborted). */
void kvm_store__lockwait_end(kvm_store__lockwait *w);

#endif
