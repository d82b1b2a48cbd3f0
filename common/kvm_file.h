/* kvm_file.h: opening a user-named input file (a document, a strategy, a signals CSV) so that a
 * folder is refused by name before any read: fopen() of a folder succeeds on Linux and its first
 * read fails with an unhelpful "read error". A FIFO or device the user named is read (/dev/stdin,
 * a shell's <(...)); a FIFO that has no writer when it is opened reads as empty rather than
 * blocking the open for ever. Code that finds files itself (a folder's *.txt) must check for
 * regular files (kvm_file_check_found). */
#ifndef KVM_FILE_H
#define KVM_FILE_H

#include <stdio.h>

/* Opens `path` for reading (mode "r" or "rb", as fopen's) after checking (stat, following links)
 * that it is not a folder; a FIFO without a writer is not waited for (it reads as empty). `what` names the file's role
 * in messages ("strategy", "signals", "document"). On success *out is the open stream (the caller fcloses it) and 0 is
 * returned. Errors, *out = NULL, kvm_errmsg naming what and path: KVM_ENOTFOUND (no such file), KVM_EFORMAT (a folder),
 * KVM_EIO (stat or fopen failed otherwise, e.g. permission). Thread-safe (kvm_err's message is
 * per thread). */
int kvm_file_open_input(const char *path, const char *mode, const char *what, FILE **out);

/* Checks that `path`, a file the code looked for itself (a Hugging Face folder's config.json,
 * weights, tokenizer.json), is a regular file once symbolic links are followed, before it is
 * opened (a FIFO would block the open or the read). Returns 0, or, with kvm_errmsg naming path:
 * KVM_ENOTFOUND (no entry of that name), KVM_EFORMAT (a symbolic link to nothing, naming its
 * target, as the Hugging Face cache leaves after an unfinished download; a link loop; a path
 * through a file; a directory, FIFO, device or socket), KVM_EIO (another stat failure, e.g.
 * permission). Thread-safe. */
int kvm_file_check_found(const char *path);

/* fopen(path, mode) for writing ("w" or "wb": created, or emptied) an output the user names
 * (`what` its role in messages: "--csv", "strategy"), without blocking: a FIFO with no reader
 * is refused at once (fopen waited for one for ever); one with a reader (a shell's >(...),
 * /dev/stdout on a pipe) and other files open as fopen opens them. Returns 0 with *out the
 * stream (the caller fcloses it), else *out = NULL and KVM_EINVAL (a FIFO without a reader:
 * "WHAT PATH: a FIFO that no process is reading; ...") or KVM_EIO (the open failed: its reason),
 * kvm_errmsg naming what and path. Thread-safe. */
int kvm_file_open_output(const char *path, const char *mode, const char *what, FILE **out);

/* 1 when the existing file `path` (st: its stat, by the caller) is one this process may replace:
 * access(W_OK) passes and a write permission bit is set. The bits are read too because root
 * passes access() on any file, and a file made read-only on purpose (an earlier output kept, a
 * corpus document) was replaced without a word. 0 otherwise. No errors, nothing said. */
struct stat;
int kvm_file_replaceable(const char *path, const struct stat *st);

/* The folder or file `path` names, written to out[0, n) in one spelling for comparisons (never
 * for opening): made absolute against the working directory, '.' and '..' and runs of '/' taken
 * out as text, then the longest leading part that exists resolved through its symbolic links
 * (realpath), the rest appended. So "rd", "./rd/", "/tmp/x/../w/rd" and a link to it compare
 * equal, also while rd does not exist yet. Returns 0, or -1 (no working directory, out too
 * small: out is then path as given). */
int kvm_file_path_norm(const char *path, char *out, size_t n);

/* The first 16 hex digits of the running kernel's boot id (/proc/sys/kernel/random/boot_id: 64
 * random bits, the same in every container on that kernel) into out[17]; 0, or -1 when
 * unreadable (out then ""). */
int kvm_file_boot_id(char out[17]);

#endif
