/* kvm_file.h: opening a user-named input file (a strategy, a signals CSV) so that a folder, a
 * FIFO or a device is refused by name before any read: fopen() of a folder succeeds on Linux
 * and its first read fails with an unhelpful "read error", and fopen() of a FIFO blocks until
 * a writer appears. */
#ifndef KVM_FILE_H
#define KVM_FILE_H

#include <stdio.h>

/* Opens `path` with fopen(path, mode) after checking (stat, following links) that it is a
 * regular file. `what` names the file's role in messages ("strategy", "signals"). On success
 * *out is the open stream (the caller fcloses it) and 0 is returned. Errors, *out = NULL,
 * kvm_errmsg naming what and path: KVM_ENOTFOUND (no such file), KVM_EFORMAT (a folder, or not
 * a regular file: a FIFO, socket or device), KVM_EIO (stat or fopen failed otherwise, e.g.
 * permission). Thread-safe (kvm_err's message is per thread). */
int kvm_file_open_regular(const char *path, const char *mode, const char *what, FILE **out);

#endif
