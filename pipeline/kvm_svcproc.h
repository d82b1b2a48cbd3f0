/* kvm_svcproc.h: the store service as a child of `kvmill run` / `kvmill serve` ([store]
 * service_bind): started on the host that owns the LMDB directory so that workers on other
 * hosts upload and fetch caches through it, restarted if it dies, stopped at the end (once
 * the runs that store through it are done with it: kvm_svcproc_ask_stop). */
#ifndef KVM_SVCPROC_H
#define KVM_SVCPROC_H

#include <sys/types.h>

typedef struct kvm_svcproc {
    pid_t pid;          /* the running service, 0 when none */
    char exe[2048];     /* bin_dir/kvmill-store */
    char store[4096];   /* --store PATH */
    char bind[1024];    /* --bind ENDPOINT */
    char config[4096];  /* --config FILE ([store] and [security] settings), "" = none */
    char log[4096];     /* its stdout and stderr are appended here */
    int restarts;       /* times it was started again after dying */
    int asked;          /* 1: asked to stop once, it stays up for other runs' claims */
} kvm_svcproc;

/* Fills p and starts `kvmill-store --store STORE --bind BIND --create [--config CONFIG]`, then waits up
 * to timeout_ms for its "ready on" line in the log (so workers find it bound). Errors:
 * KVM_EINVAL (binary missing), KVM_EIO (spawn failed, or it exited or did not get ready in
 * time: the detail quotes the log's last line, e.g. a bind error). */
int kvm_svcproc_start(kvm_svcproc *p, const char *bin_dir, const char *store, const char *bind, const char *config,
                      const char *log, double timeout_ms);

/* Starts the service again after it died (p->pid was reaped by the caller: set p->pid = 0
 * first). Same errors. */
int kvm_svcproc_restart(kvm_svcproc *p, double timeout_ms);

/* Stops it now: two stop requests (SIGTERM, and SIGINT unless kvm_svcproc_ask_stop asked once
 * already), wait up to grace_ms (it finishes the transaction in hand), then SIGKILL; reaps it,
 * whatever claims of other runs it serves. p->pid is 0 afterwards. Safe when none runs. */
void kvm_svcproc_stop(kvm_svcproc *p, double grace_ms);

/* Asks it to stop (one SIGTERM) and waits up to grace_ms for it to exit (reaped: returns 0) or to
 * say in its log that it stays up for the live claims of other runs that store through it
 * (kvm_storesvc.h): returns 1, p->pid still running, whom[0, n) naming those runs ("OWNER on
 * HOST (N claims, ...)"); the caller waits for it to exit by itself (their claims released
 * or lapsed; kvm_spawn_reaped) or stops it now (kvm_svcproc_stop). Neither within grace_ms:
 * SIGKILL, reaped, 0. Safe when none runs (0). */
int kvm_svcproc_ask_stop(kvm_svcproc *p, double grace_ms, char *whom, size_t n);

#endif
