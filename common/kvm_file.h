/* kvm_file.h: opening a user-named input file (a document, a strategy, a signals CSV) so that a
 * folder is refused by name before any read: fopen() of a folder succeeds on Linux and its first
 * read fails with an unhelpful "read error". A FIFO or device the user named is read (/dev/stdin,
 * a shell's <(...)); code that finds files itself (a folder's *.txt) must check for regular
 * files, since opening a FIFO blocks until a writer appears. */
#ifndef KVM_FILE_H
#define KVM_FILE_H

#include <stdio.h>

/* Opens `path` with fopen(path, mode) after checking (stat, following links) that it is not a
 * folder. `what` names the file's role in messages ("strategy", "signals", "document"). On
 * success *out is the open stream (the caller fcloses it) and 0 is returned. Errors, *out =
 * NULL, kvm_errmsg naming what and path: KVM_ENOTFOUND (no such file), KVM_EFORMAT (a folder),
 * KVM_EIO (stat or fopen failed otherwise, e.g. permission). Thread-safe (kvm_err's message is
 * per thread). */
int kvm_file_open_input(const char *path, const char *mode, const char *what, FILE **out);

#endif
