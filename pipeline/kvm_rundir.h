/* kvm_rundir.h: the run directory of `kvmill run` and `kvmill serve`: where ipc://
 * endpoints and stage logs live. */
#ifndef KVM_RUNDIR_H
#define KVM_RUNDIR_H

#include <stddef.h>

/* Uses `configured` ([run] run_dir) when not empty (created if missing), else makes a fresh
 * $TMPDIR/kvmill-PREFIX.XXXXXX. Writes the path to buf and *own = 1 when this call created a
 * temporary one (the caller removes it with kvm_rundir_remove). Returns 0 or KVM_EIO. */
int kvm_rundir_make(const char *configured, const char *prefix, char *buf, size_t size, int *own);

/* Removes the directory's files (sockets, logs) and the directory. */
void kvm_rundir_remove(const char *dir);

#endif
