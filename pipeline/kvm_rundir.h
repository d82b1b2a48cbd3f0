/* kvm_rundir.h: the run directory of `kvmill run` and `kvmill serve`: where ipc://
 * endpoints and stage logs live. A temporary one is named after its owner (pid and process
 * start time), so a later start can remove the ones whose owner is gone (kill -9). */
#ifndef KVM_RUNDIR_H
#define KVM_RUNDIR_H

#include <stddef.h>

/* Uses `configured` ([run] run_dir) when not empty (created if missing), else first
 * removes stale temporary entries (kvm_rundir_sweep) and makes a fresh
 * $TMPDIR/kvmill-PREFIX.P<pid>-S<start>.XXXXXX. Writes the path to buf and *own = 1 when this
 * call created a temporary one (the caller removes it with kvm_rundir_remove). Returns 0,
 * KVM_EINVAL for a configured folder whose parent is missing or not searchable, or that is not a
 * directory (the config's mistake), or a TMPDIR as kvm_rundir_mkstemp refuses it, or KVM_EIO. */
int kvm_rundir_make(const char *configured, const char *prefix, char *buf, size_t size, int *own);

/* A temporary file $TMPDIR/kvmill-PREFIX.P<pid>-S<start>.XXXXXX made by mkstemp: its path in
 * buf, its descriptor in *fd. Returns 0, KVM_EINVAL for a TMPDIR that is too long, missing, not
 * a folder or not writable (named as TMPDIR), or KVM_EIO. */
int kvm_rundir_mkstemp(const char *prefix, char *buf, size_t size, int *fd);

/* Writes the mkstemp/mkdtemp template $TMPDIR/kvmill-PREFIX.P<pid>-S<start>.XXXXXX for this
 * process into buf (size bytes; truncated names are the caller's problem: use 4096). */
void kvm_rundir_template(const char *prefix, char *buf, size_t size);

/* Removes, in $TMPDIR (or /tmp), every kvmill-run.*, kvmill-serve.* and
 * kvmill-serve-config.* entry of this user whose name records an owner (P<pid>-S<start>)
 * that is gone: no such process, or a process of that pid with another start time (the pid
 * was reused). Entries without an owner in their name are left alone. Returns how many were
 * removed; errors are ignored (best effort). */
int kvm_rundir_sweep(void);

/* 1 when the process pid of this host that began at wall-clock time started_unix_ms (ms since
 * 1970, read by the process itself after it started: a run's claim owner, kvm_storew_owner) is
 * gone: no such process, or the pid now belongs to a process that started later (reused). 0 when
 * it may be running (alive, or no /proc to tell: the caller keeps its other rule). The start
 * times compare to within 2 s: /proc's boot time has whole seconds. Never blocks. */
int kvm_rundir_pid_gone(long pid, long long started_unix_ms);

/* Removes the directory's files (sockets, logs) and the directory. */
void kvm_rundir_remove(const char *dir);

#endif
