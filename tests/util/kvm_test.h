/* kvm_test.h: helpers shared by the Check suites: where ../shared and bin/ are, temporary
 * directories, running a command and capturing its output. */
#ifndef KVM_TEST_H
#define KVM_TEST_H

#include <stddef.h>
#include <stdint.h>

/* $KVMILL_SHARED or "../shared"; never NULL. */
const char *kvm_test_shared(void);
/* Joins kvm_test_shared() and `rel` into a static buffer (valid until the next call). */
const char *kvm_test_shared_path(const char *rel);
/* $KVMILL_BIN or "bin"; the folder holding the kvmill binaries. */
const char *kvm_test_bin(void);
/* mkdtemp under $TMPDIR (or /tmp); returns a malloc'ed path the caller frees. */
char *kvm_test_tmpdir(void);
/* Removes a directory tree (rm -rf). */
void kvm_test_rmtree(const char *path);
/* Runs `cmd` with /bin/sh, stdout captured into *out (malloc'ed, NUL-terminated, may be
 * NULL to discard) and stderr into *err likewise. Returns the exit status (0..255), or
 * 128+signal. */
int kvm_test_run(const char *cmd, char **out, char **err);
/* Reads a whole file; returns malloc'ed bytes (NUL-terminated) and the size, or NULL. */
char *kvm_test_read_file(const char *path, size_t *n);
/* Writes bytes to a file; returns 0 on success. */
int kvm_test_write_file(const char *path, const void *data, size_t n);

/* The golden 256-token sequence (../shared/golden/seq256.ids.txt) into ids[256]; fails the
 * calling Check test when the file is missing or short. */
void kvm_test_golden_ids(int32_t ids[256]);

/* Runs a suite (CK_NORMAL output) and returns the process exit status: 0 when every test
 * passed, 1 otherwise. */
int kvm_test_run_suite(void *suite);

#endif
