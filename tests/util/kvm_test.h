/* kvm_test.h: helpers shared by the Check suites: where ../shared and bin/ are, temporary
 * directories, running a command and capturing its output. */
#ifndef KVM_TEST_H
#define KVM_TEST_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* $KVMILL_SHARED or "../shared"; never NULL. The folder may not exist (a fresh clone). */
const char *kvm_test_shared(void);
/* Data only ../shared has (golden/, data/long2k, data/tinystories, the other 14 long
 * documents): kvm_test_shared() joined with `rel` when that file or folder exists, in a static
 * buffer (valid until the next call). When it does not, prints one line
 * "SKIP: <rel> not in KVMILL_SHARED=<dir> (...)" to stdout (kvm_test_skip: once per reason and
 * process) and returns NULL: the test then returns
 * without failing. kvm_test_shared_find is the same without the SKIP line (for fixtures that
 * load optional data, the test printing the SKIP with kvm_test_skip). */
const char *kvm_test_shared_path(const char *rel);
const char *kvm_test_shared_find(const char *rel);
/* 1 when KVMILL_TEST_QUICK is set to anything but "" or "0" (`make SAN=1 test` sets it): the
 * slowest integration cases then run on fewer documents or inputs. The un-sanitized `make test`
 * runs them whole, so every case keeps its full form once in CI. */
int kvm_test_quick(void);
/* Prints "SKIP: <why>" to stdout, once per reason and process (a later call with the same why
 * prints nothing; another why gets its own line). */
void kvm_test_skip(const char *why);
/* The repository's embedded data (data/, always present): models/stories260K.bin,
 * models/tok512.bin, corpus/doc_000.txt .. doc_005.txt (= ../shared/data/long's first six).
 * Absolute path of the source tree's data/ ($KVMILL_SRCDIR's where set: test binaries carried to
 * a GPU host) joined with `rel`, in one of 8 static buffers used in turn (valid for the next 7
 * calls, so one argument list may hold several). */
const char *kvm_test_data_path(const char *rel);
/* The embedded data folder itself ("<source tree>/data"), in a static buffer; never NULL. */
const char *kvm_test_data(void);
/* A device name as part of a file or folder name: "cuda:0" -> "cuda0" (its ':' removed; a colon
 * in a run directory lands in ipc:// endpoint paths, legal there but broken in some tools), in
 * one of 4 static buffers used in turn. */
const char *kvm_test_device_tag(const char *device);
/* $KVMILL_BIN or "bin"; the folder holding the kvmill binaries. */
const char *kvm_test_bin(void);
/* `kvmill keygen --out dir/name` (a CurveZMQ key pair dir/name.public, dir/name.secret); a failure
 * fails the test with keygen's stderr. */
void kvm_test_keygen(const char *dir, const char *name);
/* mkdtemp under $TMPDIR (or /tmp); returns a malloc'ed path the caller frees. */
char *kvm_test_tmpdir(void);
/* Removes a directory tree (rm -rf). */
void kvm_test_rmtree(const char *path);
/* Runs `cmd` with /bin/sh, stdout captured into *out (malloc'ed, NUL-terminated, may be
 * NULL to discard) and stderr into *err likewise. Returns the exit status (0..255), or
 * 128+signal. A command meant to be stopped by `timeout` runs under `timeout --foreground`:
 * without it timeout follows its signal with SIGCONT, and a SIGCONT that arrives while
 * LeakSanitizer's exit check stops the process (PTRACE_ATTACH's SIGSTOP, which SIGCONT
 * discards) leaves that check waiting forever (SAN=1). */
int kvm_test_run(const char *cmd, char **out, char **err);

/* A TCP port on 127.0.0.1 that nothing is bound to now, for a service a test starts on a port it
 * names: in 20000..31999 (below the ephemeral range that connect() takes its local ports from),
 * starting from one derived from the pid and salt (tests of one process that need different
 * ports pass different salts). Fails the test when none is free. */
int kvm_test_tcp_port(unsigned salt);

/* Caches in the store at `store`, as `kvmill store ls --csv` (of the binaries under test) lists
 * them: its data rows, the header not counted. Fails the current test when the command fails. */
int kvm_test_store_caches(const char *store);

/* Forks a process that opens the LMDB environment at `path` (a store someone opened already,
 * so its lock.mdb exists) and begins n read transactions there, holding n slots of its reader
 * table until kvm_test_readers_release. Returns the process's pid once it holds them, with
 * *release_fd set; fails the current test when it could not. */
pid_t kvm_test_readers_hold(const char *path, int n, int *release_fd);
/* Ends the transactions of kvm_test_readers_hold (closes release_fd) and waits for its process. */
void kvm_test_readers_release(pid_t pid, int release_fd);

/* Creates an empty store at `path` (a decode server refuses a store that does not exist).
 * Fails the current test on error. */
void kvm_test_store_create(const char *path);

/* Starts `kvmill serve ARGS...` (args NULL-terminated, at most 12) with stdout and stderr in
 * `log` (removed first, so an earlier server's "ready" is not read as this one's), the child
 * dying with the test process (SIGTERM). Waits up to timeout_s for "kvmill serve: ready".
 * Returns -1 with *pid set once ready; the exit status (0..255, 128+signal) when serve exits
 * first (its log then printed to stderr); aborts the test on timeout, after SIGKILL. */
int kvm_test_serve_start(const char *const *args, const char *log, int timeout_s, pid_t *pid);
/* A serve test's folders: *dir a fresh temporary folder (kvm_test_tmpdir; the caller frees it
 * through kvm_test_serve_cleanup), front = "ipc://DIR/front" and log = "DIR/serve.log" in
 * buffers of nf and nl bytes. A failure fails the test. */
void kvm_test_serve_dirs(char **dir, char *front, size_t nf, char *log, size_t nl);
/* Stops a server started by kvm_test_serve_start when pid > 0 (SIGTERM, waited for), then
 * removes dir and frees it. */
void kvm_test_serve_cleanup(pid_t pid, char *dir);
/* Runs fn(arg) with this process's stderr going to a temporary file and returns what it
 * wrote (malloc'ed, NUL-terminated); fails the current test when the redirection fails. */
char *kvm_test_stderr_of(void (*fn)(void *), void *arg);
/* Reads a whole file; returns malloc'ed bytes (NUL-terminated) and the size, or NULL. */
char *kvm_test_read_file(const char *path, size_t *n);
/* Writes bytes to a file; returns 0 on success. */
int kvm_test_write_file(const char *path, const void *data, size_t n);
/* Writes dir/name.bin, a copy of data/models/stories260K.bin whose value projections (wv) of
 * its first wv_layers layers are multiplied by wv_scale and, when final_norm != 0, whose final
 * RMSNorm weights are all final_norm (finite: the loaders refuse inf; 3e38 overflows the
 * activations, so every logit is not finite), with tok512.bin beside it: models whose values
 * overflow f16 or whose logits are NaN. Fails the current test on an I/O error. */
void kvm_test_scaled_model(const char *dir, const char *name, int wv_layers, float wv_scale, float final_norm);

/* Writes dst = the bytes of src, then those of `more` (NULL: none); fails the current test
 * when src cannot be read or dst written. */
void kvm_test_concat_file(const char *src, const char *more, const char *dst);
/* The number of non-overlapping occurrences of needle (non-empty) in hay. */
int kvm_test_count(const char *hay, const char *needle);
/* Waits up to `seconds` (polling every 20 ms) for the file at path to hold needle at least
 * `times` times; returns 1 when it does, 0 on timeout. Tests wait on a condition with a generous
 * deadline rather than a fixed sleep: a loaded CI machine under ASan is many times slower. */
int kvm_test_wait_text(const char *path, const char *needle, int times, double seconds);

/* The golden 256-token sequence (the ids of ../shared/golden/seq256.ids.txt: BOS and the
 * first 255 tok512 tokens of the first TinyStories story) into ids[256], computed from the
 * embedded data (data/corpus/doc_000.txt begins with that story; check_tokenizer compares the
 * result with the golden file when ../shared is there); fails the calling Check test when the
 * embedded files are unreadable. */
void kvm_test_golden_ids(int32_t ids[256]);

/* Runs a suite (CK_NORMAL output) and returns the process exit status: 0 when every test
 * passed, 1 otherwise. */
int kvm_test_run_suite(void *suite);

#endif
