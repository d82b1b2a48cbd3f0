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
 * was reused). Entries without an owner in their name are left alone, and so are directories
 * kept for the user (holding KVM_RUNDIR_KEPT: a failed run's stage logs). Returns how many were
 * removed; errors are ignored (best effort). */
int kvm_rundir_sweep(void);

/* The file that marks a temporary run directory kept for the user: written, when the process
 * that made it (kvm_rundir_make) exits normally, into each one it has not removed (a failed
 * run's stage logs); kvm_rundir_sweep leaves a directory holding it. */
#define KVM_RUNDIR_KEPT "KEPT"

/* The identity of process pid as this process sees it, for a claim owner (kvm_storew_owner):
 * "B<the kernel's boot id, its first 16 hex>N<its pid namespace's inode>T<its start, clock ticks since
 * boot>" into out (n bytes, >= 80). Empty when /proc cannot tell (no /proc, hidepid, the process
 * gone): an owner without an identity is never taken over. The host name alone did not tell a
 * machine: containers sharing one (host networking) and machines of the same name have other
 * kernels or pid namespaces, where the pid means another process. Never blocks. */
void kvm_rundir_proc_id(long pid, char *out, size_t n);

/* 1 when the process pid whose identity was id (kvm_rundir_proc_id, recorded by that process)
 * is gone: id names this kernel boot and this process's pid namespace, and the pid is not
 * running (kill: ESRCH), has exited unreaped (a zombie), or belongs to a process with another
 * start (reused). 0 when it may be running or cannot be told (another boot or namespace, an
 * empty or malformed id, EPERM, /proc unreadable): the caller keeps its lease rule. Uses no wall
 * clock (a clock stepped after a suspend made a live run look reused). Never blocks. */
int kvm_rundir_pid_gone(long pid, const char *id);

/* Removes the directory's files (sockets, logs) and the directory. */
void kvm_rundir_remove(const char *dir);

#endif
