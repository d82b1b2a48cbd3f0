/* kvm_test.c: helpers shared by the Check suites. */
#include "tests/util/kvm_test.h"
#include "common/kvm_error.h"
#include "model/kvm_tokenizer.h"
#include "store/kvm_store.h"

#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <lmdb.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *kvm_test_shared(void)
{
    const char *s = getenv("KVMILL_SHARED");
    return (s && *s) ? s : "../shared";
}

/* the source tree (the Makefile passes it) */
#ifndef KVM_TEST_SRCDIR
#define KVM_TEST_SRCDIR "."
#endif

const char *kvm_test_shared_find(const char *rel)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", kvm_test_shared(), rel);
    return access(buf, F_OK) == 0 ? buf : NULL;
}

int kvm_test_quick(void)
{
    const char *s = getenv("KVMILL_TEST_QUICK");
    return s && *s && strcmp(s, "0") != 0;
}

void kvm_test_skip(const char *why)
{
    /* each reason once (a test asking for one absent file several times says it once), but
     * every reason: a flag for the first line alone silenced the other skipped tests' reasons
     * in the processes forked after it (a fixture's skip in the parent, or CK_FORK=no) */
    static char *said[64];
    static int n_said;
    for (int i = 0; i < n_said; i++)
        if (!strcmp(said[i], why)) return;
    if (n_said < 64 && (said[n_said] = strdup(why))) n_said++;
    printf("SKIP: %s\n", why);
    fflush(stdout);
}

const char *kvm_test_shared_path(const char *rel)
{
    const char *p = kvm_test_shared_find(rel);
    if (!p) {
        char why[4300];
        snprintf(why, sizeof why, "%s not in KVMILL_SHARED=%s (data only ../shared has; the test is skipped)", rel,
                 kvm_test_shared());
        kvm_test_skip(why);
    }
    return p;
}

/* $KVMILL_SRCDIR, else the source tree the tests were built in (a test binary carried to another
 * host, as scripts/gpu-check.sh does, finds the tree there through the variable) */
static const char *srcdir(void)
{
    const char *s = getenv("KVMILL_SRCDIR");
    return s && *s ? s : KVM_TEST_SRCDIR;
}

const char *kvm_test_data(void)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/data", srcdir());
    return buf;
}

const char *kvm_test_data_path(const char *rel)
{
    /* a few buffers in turn: one buffer made `f(kvm_test_data_path(a), kvm_test_data_path(b))`
     * pass the same path twice (--model X --docs X), whichever the compiler evaluated last */
    static char buf[8][4096];
    static unsigned next;
    char *b = buf[next++ % 8];
    snprintf(b, sizeof buf[0], "%s/data/%s", srcdir(), rel);
    return b;
}

const char *kvm_test_device_tag(const char *device)
{
    static char buf[4][64];
    static unsigned next;
    char *b = buf[next++ % 4], *o = b;
    for (const char *c = device; *c && o < b + sizeof buf[0] - 1; c++)
        if (*c != ':') *o++ = *c;
    *o = '\0';
    return b;
}

const char *kvm_test_bin(void)
{
    const char *s = getenv("KVMILL_BIN");
    return (s && *s) ? s : "bin";
}

char *kvm_test_tmpdir(void)
{
    const char *t = getenv("TMPDIR");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s/kvmtest.XXXXXX", (t && *t) ? t : "/tmp");
    if (!mkdtemp(buf)) return NULL;
    return strdup(buf);
}

void kvm_test_rmtree(const char *path)
{
    if (!path || !*path) return;
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) fprintf(stderr, "kvm_test_rmtree: could not remove %s\n", path);
}

char *kvm_test_read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    size_t r;
    while (buf && (r = fread(buf + len, 1, cap - len, f)) > 0) {
        len += r;
        if (len == cap) {
            char *nb = realloc(buf, 2 * cap + 1);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (!buf) return NULL;
    buf[len] = '\0';
    if (n) *n = len;
    return buf;
}

int kvm_test_write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    return (fclose(f) == 0 && w == n) ? 0 : -1;
}

int kvm_test_run(const char *cmd, char **out, char **err)
{
    char *dir = kvm_test_tmpdir();
    if (!dir) return -1;
    char o[4200], e[4200], full[16384];
    snprintf(o, sizeof o, "%s/out", dir);
    snprintf(e, sizeof e, "%s/err", dir);
    snprintf(full, sizeof full, "( %s ) >'%s' 2>'%s' </dev/null", cmd, o, e);
    int st = system(full);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    if (out) *out = kvm_test_read_file(o, NULL);
    if (err) *err = kvm_test_read_file(e, NULL);
    kvm_test_rmtree(dir);
    free(dir);
    return rc;
}

void kvm_test_golden_ids(int32_t ids[256])
{
    char tok_path[4200];
    snprintf(tok_path, sizeof tok_path, "%s", kvm_test_data_path("models/tok512.bin"));
    size_t len = 0;
    char *text = kvm_test_read_file(kvm_test_data_path("corpus/doc_000.txt"), &len);
    ck_assert_msg(text != NULL, "cannot read %s", kvm_test_data_path("corpus/doc_000.txt"));
    kvm_tokenizer *tok = NULL;
    ck_assert_msg(kvm_tokenizer_open_llama2c(tok_path, 512, &tok) == 0, "open %s: %s", tok_path, kvm_errmsg());
    int32_t *all = NULL;
    int64_t n = 0;
    ck_assert_int_eq(kvm_tokenizer_encode(tok, text, len, 1, 0, &all, &n), 0);
    ck_assert_int_ge(n, 256);
    memcpy(ids, all, 256 * sizeof *ids);
    free(all);
    free(text);
    kvm_tokenizer_close(&tok);
}

int kvm_test_run_suite(void *suite)
{
    SRunner *sr = srunner_create((Suite *)suite);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}

int kvm_test_store_caches(const char *store)
{
    char cmd[8000], *out = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --csv --store '%s'", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    int lines = 0;
    for (char *p = out; p && *p; p++) lines += *p == '\n';
    free(out);
    return lines - 1; /* header */
}

void kvm_test_store_create(const char *path)
{
    kvm_store_opts so = {.no_sync = 1};
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(path, &so, &s) == 0, "store %s: %s", path, kvm_errmsg());
    kvm_store_close(&s);
}

int kvm_test_serve_start(const char *const *args, const char *log, int timeout_s, pid_t *pid)
{
    char exe[4200];
    snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
    unlink(log);
    pid_t p = fork();
    ck_assert_int_ge(p, 0);
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* a failing test must not leave a server behind */
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        const char *argv[16] = {exe, "serve"};
        int n = 2;
        for (int i = 0; args && args[i] && n < 15; i++)
            argv[n++] = args[i];
        argv[n] = NULL;
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    for (int i = 0; i < timeout_s * 20; i++) {
        int st;
        if (waitpid(p, &st, WNOHANG) == p) {
            char *text = kvm_test_read_file(log, NULL);
            fprintf(stderr, "kvmill serve exited; its log:\n%s\n", text ? text : "(none)");
            free(text);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        char *text = kvm_test_read_file(log, NULL);
        int ready = text && strstr(text, "kvmill serve: ready");
        free(text);
        if (ready) {
            *pid = p;
            return -1;
        }
        usleep(50000);
    }
    kill(p, SIGKILL);
    waitpid(p, NULL, 0);
    ck_abort_msg("kvmill serve did not report ready within %d s", timeout_s);
    return -2;
}

char *kvm_test_stderr_of(void (*fn)(void *), void *arg)
{
    char *dir = kvm_test_tmpdir(), path[4200];
    snprintf(path, sizeof path, "%s/stderr", dir);
    fflush(stderr);
    int saved = dup(2), f = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ck_assert(saved >= 0 && f >= 0);
    ck_assert_int_eq(dup2(f, 2), 2);
    close(f);
    fn(arg);
    fflush(stderr);
    ck_assert_int_eq(dup2(saved, 2), 2);
    close(saved);
    char *text = kvm_test_read_file(path, NULL);
    ck_assert_ptr_nonnull(text);
    kvm_test_rmtree(dir);
    free(dir);
    return text;
}

void kvm_test_concat_file(const char *src, const char *more, const char *dst)
{
    size_t n = 0, m = 0;
    char *a = kvm_test_read_file(src, &n), *b = more ? kvm_test_read_file(more, &m) : NULL;
    ck_assert_ptr_nonnull(a);
    ck_assert(!more || b);
    char *all = malloc(n + m + 1);
    ck_assert_ptr_nonnull(all);
    memcpy(all, a, n);
    if (b) memcpy(all + n, b, m);
    ck_assert_int_eq(kvm_test_write_file(dst, all, n + m), 0);
    free(all);
    free(a);
    free(b);
}

int kvm_test_count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

int kvm_test_wait_text(const char *path, const char *needle, int times, double seconds)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        char *text = kvm_test_read_file(path, NULL);
        int n = text ? kvm_test_count(text, needle) : 0;
        free(text);
        if (n >= times) return 1;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((double)(t.tv_sec - t0.tv_sec) + 1e-9 * (double)(t.tv_nsec - t0.tv_nsec) >= seconds) return 0;
        usleep(20000);
    }
}

void kvm_test_keygen(const char *dir, const char *name)
{
    char cmd[8192], *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' keygen --out '%s/%s'", kvm_test_bin(), dir, name);
    int rc = kvm_test_run(cmd, NULL, &err);
    ck_assert_msg(rc == 0, "keygen: %s", err ? err : "");
    free(err);
}

void kvm_test_serve_dirs(char **dir, char *front, size_t nf, char *log, size_t nl)
{
    *dir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(*dir);
    snprintf(front, nf, "ipc://%s/front", *dir);
    snprintf(log, nl, "%s/serve.log", *dir);
}

void kvm_test_serve_cleanup(pid_t pid, char *dir)
{
    if (pid > 0) {
        kill(pid, SIGTERM);
        waitpid(pid, NULL, 0);
    }
    kvm_test_rmtree(dir);
    free(dir);
}

int kvm_test_tcp_port(unsigned salt)
{
    /* below Linux's default ephemeral range (32768-60999), whose ports connect() hands out (the
     * tests' 20000 + pid % 20000 reached into it: a service could then find its port taken by
     * some client connection's own end); from a pid-derived start, the first one free now */
    const int lo = 20000, span = 12000;
    int start = (int)(((unsigned)getpid() * 7919u + salt * 104729u) % (unsigned)span);
    for (int i = 0; i < span; i++) {
        int port = lo + (start + i) % span, fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        ck_assert_msg(fd >= 0, "socket: %s", strerror(errno));
        /* as ZeroMQ binds: a port whose old connections wait in TIME_WAIT counts as free */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in a = {
            .sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
        close(fd);
        if (ok) return port;
    }
    ck_abort_msg("no free TCP port in %d..%d", lo, lo + span - 1);
    return -1;
}

/* The child of kvm_test_readers_hold: 'y' on `ready` once it holds the slots, 'n' when it
 * could not; then it waits for EOF on `release`. */
static void readers_child(const char *path, int n, int ready, int release)
{
    MDB_env *env = NULL;
    MDB_txn *txn[64];
    int ok = n <= 64 && mdb_env_create(&env) == 0 && mdb_env_open(env, path, MDB_NOTLS | MDB_RDONLY, 0664) == 0;
    for (int i = 0; ok && i < n; i++)
        ok = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn[i]) == 0;
    char c = ok ? 'y' : 'n';
    if (write(ready, &c, 1) != 1) _exit(1);
    ssize_t r;
    while ((r = read(release, &c, 1)) > 0 || (r < 0 && errno == EINTR)) {
    }
    for (int i = 0; ok && i < n; i++)
        mdb_txn_abort(txn[i]);
    mdb_env_close(env);
    _exit(0);
}

pid_t kvm_test_readers_hold(const char *path, int n, int *release_fd)
{
    int ready[2], release[2];
    ck_assert(pipe(ready) == 0 && pipe(release) == 0);
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(ready[0]);
        close(release[1]);
        readers_child(path, n, ready[1], release[0]);
    }
    close(ready[1]);
    close(release[0]);
    char c = 0;
    ssize_t r = read(ready[0], &c, 1);
    close(ready[0]);
    ck_assert_msg(r == 1 && c == 'y', "the reader process could not begin %d read transactions in %s", n, path);
    *release_fd = release[1];
    return pid;
}

void kvm_test_readers_release(pid_t pid, int release_fd)
{
    close(release_fd);
    int st;
    waitpid(pid, &st, 0);
}

void kvm_test_scaled_model(const char *dir, const char *name, int wv_layers, float wv_scale, float final_norm)
{
    size_t n;
    char *d = kvm_test_read_file(kvm_test_data_path("models/stories260K.bin"), &n), path[4400], cmd[9000];
    ck_assert_ptr_nonnull(d);
    int32_t h[7]; /* llama2.c header: dim, hidden, layers, heads, kv heads, vocab, seq */
    memcpy(h, d, sizeof h);
    const size_t dim = (size_t)h[0], hid = (size_t)h[1], L = (size_t)h[2], kvd = dim * (size_t)h[4] / (size_t)h[3];
    float *w = (float *)(void *)(d + 28);
    /* run.c's order: embeddings, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final */
    const size_t wv = (size_t)abs(h[5]) * dim + L * dim + L * dim * dim + L * dim * kvd;
    for (size_t i = wv; i < wv + (size_t)wv_layers * dim * kvd; i++)
        w[i] *= wv_scale;
    const size_t final = wv + L * dim * kvd + L * dim * dim + L * dim + 3 * L * dim * hid;
    for (size_t i = 0; final_norm != 0 && i < dim; i++)
        w[final + i] = final_norm;
    snprintf(path, sizeof path, "%s/%s.bin", dir, name);
    ck_assert_int_eq(kvm_test_write_file(path, d, n), 0);
    free(d);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s/'", kvm_test_data_path("models/tok512.bin"), dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
}
