/* check_store_reliab.c: the store under faults and bad input (issue 11): a truncated
 * data.mdb at any length is a clear error (never SIGBUS), `store` commands on a missing
 * store, duplicated config keys and settings that would grow the cache, config ids that
 * follow the strategy's bytes (stale caches listed and removed), store settings taking
 * effect in the stage processes, compaction, and two concurrent runs sharing the work
 * through claims. Tests that need ../shared print one SKIP line and pass without it. */
#include <check.h>
#include <lmdb.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <errno.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_storew.h"
#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

static char *g_dir;           /* this test's temporary directory */
static char g_store[4200];    /* a store directory inside it */
static char g_cfg[4200];      /* a config file inside it */
static char g_docs[4200];     /* a corpus folder inside it */

/* g_store opened read-write without fsync (the claims tests' handle); fails the test otherwise. */
static kvm_store *open_store_nosync(void)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_msg(kvm_store_open(g_store, &o, &s) == 0, "%s", kvm_errmsg());
    return s;
}

static void setup(void)
{
    g_dir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(g_dir);
    snprintf(g_store, sizeof g_store, "%s/store.lmdb", g_dir);
    snprintf(g_cfg, sizeof g_cfg, "%s/t.ini", g_dir);
    snprintf(g_docs, sizeof g_docs, "%s/docs", g_dir);
}

static void teardown(void)
{
    kvm_test_rmtree(g_dir);
    free(g_dir);
    g_dir = NULL;
}

/* 1 (and one SKIP line) when ../shared lacks what a test needs. */
static int skip_without_shared(const char *test)
{
    struct stat st;
    /* the embedded model and corpus (data/: data/corpus = the first 6 of ../shared/data/long)
     * are all these tests need, so they run in a fresh clone too */
    if (stat(kvm_test_data_path("models/stories260K.bin"), &st) == 0 &&
        stat(kvm_test_data_path("corpus/doc_004.txt"), &st) == 0)
        return 0;
    printf("SKIP: %s: needs %s\n", test, kvm_test_data());
    return 1;
}

/* Runs `kvmill ARGS` (a shell fragment); returns its exit status (128+signal if killed). */
static int kvmill(char **out, char **err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int kvmill(char **out, char **err, const char *fmt, ...)
{
    char args[12000], cmd[16000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' %s", kvm_test_bin(), args);
    return kvm_test_run(cmd, out, err);
}

/* Encodes layer `layer` of a 2-layer cache of one KV head x 8 holding n_entries entries for a
 * document of n_tokens: a `cache` message that decodes as serve decodes it. */
static kvm_msg *layer_msg(int layer, int64_t n_entries, int64_t n_tokens)
{
    kvm_kvcache *c = NULL;
    ck_assert_int_eq(kvm_kvcache_new(2, 1, 8, n_entries, &c), 0);
    float k[8], v[8];
    for (int64_t e = 0; e < n_entries; e++) {
        for (int d = 0; d < 8; d++) {
            k[d] = (float)(e * 8 + d) * 0.01f;
            v[d] = -k[d];
        }
        ck_assert_int_eq(kvm_kvcache_append(kvm_kvcache_head(c, layer, 0), 8, k, v, (int32_t)e, 0.0f), 0);
    }
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_cachecodec_encode_layer(c, layer, n_tokens, KVM_PROTO_F32, &m) == 0, "%s", kvm_errmsg());
    kvm_kvcache_free(&c);
    return m;
}

/* Puts n small caches (2 layers each, of about payload and payload / 2 frame bytes, layers that
 * decode) of one made-up model into a store at path. */
static void put_caches(const char *path, int n, size_t payload)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(path, &o, &s), 0);
    int64_t n_entries = (int64_t)payload / 72 + 1; /* 72 f32 bytes an entry: key, value, position, bias */
    int64_t n_tokens = n_entries < 10 ? 10 : n_entries;
    kvm_msg *msgs[2] = {layer_msg(0, n_entries, n_tokens), layer_msg(1, n_entries / 2, n_tokens)};
    kvm_frame fr[2][8];
    kvm_store_layer layers[2];
    for (int l = 0; l < 2; l++) {
        size_t nf = kvm_msg_nframes(msgs[l]);
        ck_assert_uint_le(nf, 8);
        for (size_t f = 0; f < nf; f++)
            fr[l][f] = kvm_msg_frame(msgs[l], f);
        layers[l] = (kvm_store_layer){fr[l], (uint32_t)nf};
    }
    for (int i = 0; i < n; i++) {
        kvm_store_manifest m = {.n_layers = 2, .n_tokens = n_tokens, .n_entries = n_entries, .full_bytes = 4096};
        snprintf(m.dtype, sizeof m.dtype, "f32");
        kvm_store_hash_bytes("model", 5, &m.model_id);
        int32_t toks[2] = {i, 7};
        ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &m.doc_hash), 0);
        const char *cfg = "compress.method=test\n";
        m.config = (kvm_frame){(const uint8_t *)cfg, strlen(cfg)};
        kvm_store_hash_bytes(cfg, strlen(cfg), &m.config_id);
        ck_assert_msg(kvm_store_put_cache(s, &m, layers) == 0, "put: %s", kvm_errmsg());
    }
    kvm_msg_free(&msgs[0]);
    kvm_msg_free(&msgs[1]);
    kvm_store_close(&s);
}

/* ---- item 5: a truncated data.mdb ---- */

/* Starts `kvmill store SUB --store DIR [a:b:c]` with stdout and stderr in <dir>.out and
 * <dir>.err; returns its pid. */
static pid_t store_cmd_start(const char *sub, const char *dir, int with_key)
{
    char out[4400], err[4400], exe[4200];
    snprintf(out, sizeof out, "%s.out", dir);
    snprintf(err, sizeof err, "%s.err", dir);
    snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "r", stdin) || !freopen(out, "w", stdout) || !freopen(err, "w", stderr)) _exit(126);
        execl(exe, exe, "store", sub, "--store", dir, with_key ? "a:b:c" : (char *)NULL, (char *)NULL);
        _exit(127);
    }
    ck_assert_int_gt(pid, 0);
    return pid;
}

/* Its exit status (0..255, 128+signal), once it has ended. */
static int wait_status(pid_t pid)
{
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

START_TEST(test_truncated_data_file)
{
    char good[4300], data[4400];
    snprintf(good, sizeof good, "%s/good.lmdb", g_dir);
    snprintf(data, sizeof data, "%s/data.mdb", good);
    put_caches(good, 12, 20000);
    size_t n = 0;
    char *bytes = kvm_test_read_file(data, &n);
    ck_assert_ptr_nonnull(bytes);
    ck_assert_uint_gt(n, 8 * 4096);
    /* empty, a few bytes, mid first meta, mid second meta, mid data, one page short */
    const size_t lens[] = {0, 5, 100, 4096 + 60, n / 2, n - 4096};
    enum { N_LENS = sizeof lens / sizeof lens[0], N_SUBS = 5 };
    const char *subs[N_SUBS] = {"verify", "ls", "stats", "show", "rm"};
    /* each open of a file without its meta pages waits 3 s (a store being created looks like
     * that for a moment): every command and the library's open get their own copy of the cut
     * file and all run at once, so that the waits overlap (one after the other, with only verify
     * and ls on the three lengths that wait, they took 45 s; now every command sees every length) */
    char cut[N_LENS][N_SUBS + 1][4300];
    pid_t cmd[N_LENS][N_SUBS], lib[N_LENS];
    for (size_t i = 0; i < N_LENS; i++) {
        for (size_t k = 0; k <= N_SUBS; k++) { /* k == N_SUBS: the library's copy */
            char cutdata[4400];
            snprintf(cut[i][k], sizeof cut[i][k], "%s/cut%zu_%zu.lmdb", g_dir, i, k);
            snprintf(cutdata, sizeof cutdata, "%s/data.mdb", cut[i][k]);
            ck_assert_int_eq(mkdir(cut[i][k], 0700), 0);
            ck_assert_int_eq(kvm_test_write_file(cutdata, bytes, lens[i]), 0);
        }
    }
    free(bytes);
    for (size_t i = 0; i < N_LENS; i++) {
        for (size_t k = 0; k < N_SUBS; k++) cmd[i][k] = store_cmd_start(subs[k], cut[i][k], k >= 3);
        /* the library refuses it too, read-write included (in a child of its own, which writes
         * kvm_store_open's return value and message into <dir>.lib) */
        fflush(NULL);
        lib[i] = fork();
        if (lib[i] == 0) {
            kvm_store *s = NULL;
            int rc = kvm_store_open(cut[i][N_SUBS], NULL, &s);
            char path[4400], text[8192];
            snprintf(path, sizeof path, "%s.lib", cut[i][N_SUBS]);
            int len = snprintf(text, sizeof text, "%d %s", rc, rc ? kvm_errmsg() : "");
            _exit(kvm_test_write_file(path, text, (size_t)len) == 0 ? 0 : 1);
        }
        ck_assert_int_gt(lib[i], 0);
    }
    for (size_t i = 0; i < N_LENS; i++) {
        char want[64];
        snprintf(want, sizeof want, "truncated: %zu bytes, expected at least", lens[i]);
        for (size_t k = 0; k < N_SUBS; k++) {
            char cutdata[4400], errp[4400];
            snprintf(cutdata, sizeof cutdata, "%s/data.mdb", cut[i][k]);
            snprintf(errp, sizeof errp, "%s.err", cut[i][k]);
            int rc = wait_status(cmd[i][k]);
            char *err = kvm_test_read_file(errp, NULL);
            ck_assert_ptr_nonnull(err);
            ck_assert_msg(rc == 2, "store %s, %zu bytes: exit %d\n%s", subs[k], lens[i], rc, err);
            ck_assert_msg(strstr(err, cutdata) && strstr(err, want), "store %s, %zu bytes: %s", subs[k], lens[i], err);
            free(err);
        }
        char libp[4400];
        snprintf(libp, sizeof libp, "%s.lib", cut[i][N_SUBS]);
        ck_assert_int_eq(wait_status(lib[i]), 0);
        char *text = kvm_test_read_file(libp, NULL);
        ck_assert_ptr_nonnull(text);
        ck_assert_msg(atoi(text) == KVM_EFORMAT, "kvm_store_open, %zu bytes: %s", lens[i], text);
        free(text);
        /* ... and neither they nor the library touched the file */
        for (size_t k = 0; k <= N_SUBS; k++) {
            char cutdata[4400];
            snprintf(cutdata, sizeof cutdata, "%s/data.mdb", cut[i][k]);
            struct stat st;
            ck_assert_int_eq(stat(cutdata, &st), 0);
            ck_assert_int_eq((long long)st.st_size, (long long)lens[i]);
        }
    }
    /* the whole file still opens and verifies */
    char *out = NULL;
    ck_assert_int_eq(kvmill(&out, NULL, "store verify --store '%s'", good), 0);
    free(out);
}
END_TEST

/* A data.mdb that is not a regular file: a FIFO made the first look at it (open before the
 * pread of the meta pages) wait for a writer, so store ls, run and serve hung forever; a
 * device (a link to /dev/zero) read as "truncated: 0 bytes". Both are refused by name, exit 2,
 * and the library's open says KVM_EFORMAT. */
START_TEST(test_data_file_not_regular)
{
    char fifo[4300], data[4400], dev[4300];
    snprintf(fifo, sizeof fifo, "%s/fifo.lmdb", g_dir);
    snprintf(data, sizeof data, "%s/data.mdb", fifo);
    ck_assert_int_eq(mkdir(fifo, 0700), 0);
    ck_assert_int_eq(mkfifo(data, 0600), 0);
    snprintf(dev, sizeof dev, "%s/dev.lmdb", g_dir);
    ck_assert_int_eq(mkdir(dev, 0700), 0);
    char link[4400];
    snprintf(link, sizeof link, "%s/data.mdb", dev);
    ck_assert_int_eq(symlink("/dev/zero", link), 0);
    const char *dirs[] = {fifo, dev};
    for (int i = 0; i < 2; i++) {
        char *out = NULL, *err = NULL;
        int rc = kvmill(&out, &err, "store ls --store '%s'", dirs[i]);
        ck_assert_msg(rc == 2 && strstr(err, "data.mdb is not a regular file"), "%s: exit %d: %s", dirs[i], rc, err);
        free(out);
        free(err);
        kvm_store *s = NULL;
        ck_assert_int_eq(kvm_store_open(dirs[i], NULL, &s), KVM_EFORMAT);
        ck_assert_ptr_null(s);
    }
}
END_TEST

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A zero-byte data.mdb waited 3 s before "truncated" (the wait is for a store another process
 * is creating, which holds lock.mdb's record lock meanwhile): with no lock.mdb, or one nobody
 * holds, the refusal comes at once, from the commands and the library (read-write too); with
 * the lock held by another process the open still waits for the creator to finish. */
START_TEST(test_zero_byte_data_file_at_once)
{
    char data[4400], lock[4400];
    snprintf(data, sizeof data, "%s/data.mdb", g_store);
    snprintf(lock, sizeof lock, "%s/lock.mdb", g_store);
    ck_assert_int_eq(mkdir(g_store, 0700), 0);
    ck_assert_int_eq(kvm_test_write_file(data, "", 0), 0);
    for (int with_lock = 0; with_lock < 2; with_lock++) { /* a lock.mdb that nobody holds */
        if (with_lock) ck_assert_int_eq(kvm_test_write_file(lock, "", 0), 0);
        char *out = NULL, *err = NULL;
        double t0 = now_s();
        int rc = kvmill(&out, &err, "store ls --store '%s'", g_store);
        double ls_s = now_s() - t0;
        ck_assert_msg(rc == 2 && strstr(err, data) && strstr(err, "truncated: 0 bytes"), "exit %d: %s", rc, err);
        ck_assert_msg(ls_s < 1.5, "store ls took %.2f s to refuse a zero-byte data.mdb (lock.mdb: %d)", ls_s,
                      with_lock);
        free(out);
        free(err);
        kvm_store *s = NULL;
        t0 = now_s();
        ck_assert_int_eq(kvm_store_open(g_store, NULL, &s), KVM_EFORMAT);
        double open_s = now_s() - t0;
        ck_assert_msg(open_s < 1.5, "kvm_store_open took %.2f s (lock.mdb: %d)", open_s, with_lock);
        ck_assert_ptr_null(s);
    }
    int ready[2];
    ck_assert_int_eq(pipe(ready), 0);
    fflush(NULL);
    pid_t holder = fork(); /* holds lock.mdb as a process creating the store does */
    if (holder == 0) {
        int fd = open(lock, O_RDWR);
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        if (fd < 0 || fcntl(fd, F_SETLK, &fl) != 0 || write(ready[1], "1", 1) != 1) _exit(1);
        pause();
        _exit(0);
    }
    char c;
    ck_assert_int_eq(read(ready[0], &c, 1), 1);
    kvm_store *s = NULL;
    double t0 = now_s();
    int rc = kvm_store_open(g_store, NULL, &s);
    double held_s = now_s() - t0;
    kill(holder, SIGKILL);
    waitpid(holder, NULL, 0);
    close(ready[0]);
    close(ready[1]);
    ck_assert_int_eq(rc, KVM_EFORMAT);
    ck_assert_msg(held_s > 2.0, "with lock.mdb held the open waited only %.2f s for the store's creator", held_s);
}
END_TEST

START_TEST(test_truncated_run)
{
    if (skip_without_shared("truncated_run")) return;
    put_caches(g_store, 12, 20000);
    char data[4400];
    snprintf(data, sizeof data, "%s/data.mdb", g_store);
    ck_assert_int_eq(truncate(data, 3 * 4096), 0);
    ck_assert_int_eq(mkdir(g_docs, 0700), 0);
    char doc[4400];
    snprintf(doc, sizeof doc, "%s/a.txt", g_docs);
    ck_assert_int_eq(kvm_test_write_file(doc, "Once upon a time", 16), 0);
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 64\n[store]\npath = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), g_store, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    char *out = NULL, *err = NULL;
    int rc = kvmill(&out, &err, "run --config '%s' --corpus '%s'", g_cfg, g_docs);
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, err);
    ck_assert_msg(strstr(err, data) && strstr(err, "truncated: 12288 bytes, expected at least"), "%s", err);
    free(out);
    free(err);
}
END_TEST


/* ---- item 13: store commands on a missing store, --config ---- */

START_TEST(test_store_cli_missing_and_config)
{
    char missing[4300], *out = NULL, *err = NULL;
    snprintf(missing, sizeof missing, "%s/nope", g_dir);
    const char *subs[] = {"ls", "verify", "show a:b:c", "rm a:b:c", "compact"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        int rc = kvmill(&out, &err, "store %s --store '%s'", subs[i], missing);
        ck_assert_msg(rc == 2, "store %s on a missing store: exit %d\n%s", subs[i], rc, err);
        ck_assert_msg(strstr(err, "cannot open store") && strstr(err, missing), "store %s: %s", subs[i], err);
        free(out);
        free(err);
    }
    struct stat st;
    ck_assert_int_ne(stat(missing, &st), 0); /* nothing created */
    ck_assert_int_eq(kvmill(&out, &err, "store ls"), 2);
    ck_assert_msg(strstr(err, "--store PATH or --config FILE is required"), "%s", err);
    free(out);
    free(err);
    /* --config finds the store through [store] path */
    put_caches(g_store, 2, 100);
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = %s/model.bin\n[store]\npath = %s\n", g_dir, g_store);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    char model[4300];
    snprintf(model, sizeof model, "%s/model.bin", g_dir);
    ck_assert_int_eq(kvm_test_write_file(model, "not a model", 11), 0);
    ck_assert_int_eq(kvmill(&out, &err, "store verify --config '%s'", g_cfg), 0);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store ls --csv --config '%s'", g_cfg), 0);
    ck_assert_msg(strstr(out, "model_id,doc_hash,config_id,tokens,entries,bytes,ratio,dtype,state\n"), "%s", out);
    int rows = 0;
    for (char *p = strstr(out, ",other-config\n"); p; p = strstr(p + 1, ",other-config\n")) rows++;
    ck_assert_msg(rows == 2, "%s", out); /* another model's caches */
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store stats --config '%s'", g_cfg), 0);
    ck_assert_msg(strstr(out, "caches          2"), "%s", out);
    free(out);
    free(err);
}
END_TEST

/* A store whose lock.mdb cannot be opened for writing (copied read-only, or the lock file
 * owned by someone else) is still read: LMDB's MDB_RDONLY still writes a reader slot in
 * lock.mdb, so the read-only commands fall back to MDB_NOLOCK and say so. A directory in
 * lock.mdb's place fails its open even for root (for whom chmod stops no write). */
START_TEST(test_store_cli_readonly_lock)
{
    put_caches(g_store, 2, 100);
    char data[4400], lock[4400], *out = NULL, *err = NULL;
    snprintf(data, sizeof data, "%s/data.mdb", g_store);
    snprintf(lock, sizeof lock, "%s/lock.mdb", g_store);
    size_t n_before = 0, n_after = 0;
    char *before = kvm_test_read_file(data, &n_before);
    ck_assert_ptr_nonnull(before);
    ck_assert_int_eq(unlink(lock), 0);
    ck_assert_int_eq(mkdir(lock, 0555), 0);
    ck_assert_int_eq(chmod(data, 0444), 0);
    ck_assert_int_eq(chmod(g_store, 0555), 0);
    const char *subs[] = {"ls", "stats", "verify"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        int rc = kvmill(&out, &err, "store %s --store '%s'", subs[i], g_store);
        ck_assert_msg(rc == 0, "store %s on a store without a writable lock.mdb: exit %d\n%s", subs[i], rc, err);
        ck_assert_msg(strstr(err, "lock.mdb") && strstr(err, "reading without a lock"), "store %s: %s", subs[i], err);
        free(out);
        free(err);
    }
    ck_assert_int_eq(kvmill(&out, &err, "store ls --csv --store '%s'", g_store), 0);
    int rows = 0;
    for (char *p = strstr(out, ",f32\n"); p; p = strstr(p + 1, ",f32\n")) rows++;
    ck_assert_msg(rows == 2, "%s", out);
    free(out);
    free(err);
    kvm_store *s = NULL; /* the library: a read-only open falls back, a writable one does not */
    kvm_store_opts ro = {.read_only = 1}, rw = {.must_exist = 1};
    ck_assert_msg(kvm_store_open(g_store, &ro, &s) == 0, "%s", kvm_errmsg());
    ck_assert_ptr_nonnull(kvm_store_lock_note(s));
    kvm_store_stats stats;
    ck_assert_int_eq(kvm_store_stats_get(s, &stats), 0);
    ck_assert_int_eq(stats.n_caches, 2);
    kvm_store_close(&s);
    ck_assert_int_ne(kvm_store_open(g_store, &rw, &s), 0);
    ck_assert_ptr_null(s);
    /* the writable open names the lock file (it said "open environment: Is a directory") */
    ck_assert_msg(strstr(kvm_errmsg(), "lock.mdb cannot be opened for writing") &&
                      strstr(kvm_errmsg(), "this command writes to the store and needs it"),
                  "%s", kvm_errmsg());
    char *after = kvm_test_read_file(data, &n_after);
    ck_assert_ptr_nonnull(after);
    ck_assert_msg(n_after == n_before && memcmp(before, after, n_before) == 0, "data.mdb changed: %zu -> %zu bytes",
                  n_before, n_after);
    free(before);
    free(after);
    chmod(g_store, 0775); /* for teardown's removal */
    rmdir(lock);
    /* with a usable lock file the handle takes the lock and says nothing */
    ck_assert_msg(kvm_store_open(g_store, &ro, &s) == 0, "%s", kvm_errmsg());
    ck_assert_ptr_null(kvm_store_lock_note(s));
    kvm_store_close(&s);
}
END_TEST

/* A damaged meta page (one of the two pages LMDB starts every open from) is the store's
 * damage, named with its page and bytes: `store verify` exits 1 as for any damaged page, the
 * other commands 2. Meta page 0 without its magic read "not an LMDB environment" (exit 2);
 * a flipped page number was not noticed at all. */
START_TEST(test_verify_meta_page_damage)
{
    put_caches(g_store, 2, 100);
    char data[4400];
    snprintf(data, sizeof data, "%s/data.mdb", g_store);
    size_t n = 0;
    char *bytes = kvm_test_read_file(data, &n);
    ck_assert_ptr_nonnull(bytes);
    ck_assert_uint_ge(n, 2 * 4096);
    const struct {
        int page, off;    /* meta page (of 4096 bytes) and byte in it to overwrite */
        const char *what; /* what the message says */
    } sites[] = {
        {0, 0, "page number"},  {0, 10, "meta page (flags"}, {0, 16, "magic number"}, {0, 20, "data version"},
        {0, 40, "page size"},   {1, 16, "magic number"},     {1, 20, "data version"},
    };
    for (size_t i = 0; i < sizeof sites / sizeof sites[0]; i++) {
        char dir[4400], cut[4500], want[64], *out = NULL, *err = NULL;
        snprintf(dir, sizeof dir, "%s/meta%zu.lmdb", g_dir, i);
        snprintf(cut, sizeof cut, "%s/data.mdb", dir);
        ck_assert_int_eq(mkdir(dir, 0700), 0);
        size_t at = (size_t)sites[i].page * 4096 + (size_t)sites[i].off;
        char keep[4];
        memcpy(keep, bytes + at, 4);
        memset(bytes + at, sites[i].off == 10 ? 0 : 0xA5, 4); /* flags: clearing P_META is what LMDB checks */
        ck_assert_int_eq(kvm_test_write_file(cut, bytes, n), 0);
        memcpy(bytes + at, keep, 4);
        snprintf(want, sizeof want, "meta page, page %d (bytes %d-", sites[i].page, sites[i].page * 4096);
        int rc = kvmill(&out, &err, "store verify --store '%s'", dir);
        ck_assert_msg(rc == 1, "verify, meta page %d byte %d: exit %d\n%s%s", sites[i].page, sites[i].off, rc, out,
                      err);
        ck_assert_msg(strstr(err, "data.mdb is damaged") && strstr(err, want) && strstr(err, cut) &&
                          strstr(err, sites[i].what) && !strstr(err, "not an LMDB"),
                      "verify, meta page %d byte %d: %s", sites[i].page, sites[i].off, err);
        ck_assert_msg(strstr(out, "1 problem(s)"), "%s", out);
        free(out);
        free(err);
        rc = kvmill(&out, &err, "store ls --store '%s'", dir);
        ck_assert_msg(rc == 2 && strstr(err, want), "ls, meta page %d byte %d: exit %d\n%s", sites[i].page,
                      sites[i].off, rc, err);
        free(out);
        free(err);
    }
    free(bytes);
    char *out = NULL; /* the intact store still verifies */
    ck_assert_int_eq(kvmill(&out, NULL, "store verify --store '%s'", g_store), 0);
    free(out);
}
END_TEST

/* A damaged meta value: format_version read from bytes no build wrote was reported as "store
 * format version 8955095580320447181, this build reads version 1 (mismatched model, tokenizer or
 * config)", and store verify exited 2 (unopenable) rather than reporting a damaged store. */
START_TEST(test_meta_version_damage)
{
    put_caches(g_store, 1, 100);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    ck_assert_int_eq(mdb_env_create(&env), 0);
    ck_assert_int_eq(mdb_env_set_maxdbs(env, 32), 0);
    ck_assert_int_eq(mdb_env_open(env, g_store, 0, 0644), 0);
    ck_assert_int_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    ck_assert_int_eq(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
    uint8_t v[8] = {0xcd, 0x7a, 0x10, 0x5e, 0x93, 0x22, 0x47, 0x7c}; /* little-endian 8955...: no version */
    MDB_val key = {14, "format_version"}, val = {8, v};
    ck_assert_int_eq(mdb_put(txn, dbi, &key, &val, 0), 0);
    ck_assert_int_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    kvm_store *st = NULL;
    ck_assert_int_eq(kvm_store_open(g_store, &(kvm_store_opts){.read_only = 1}, &st), KVM_ECORRUPT);
    char *out = NULL, *err = NULL;
    int rc = kvmill(&out, &err, "store verify --store '%s'", g_store);
    ck_assert_msg(rc == 1 && strstr(err, "format_version holds") && strstr(err, "data.mdb is damaged") &&
                      strstr(out, "1 problem(s)"),
                  "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
    rc = kvmill(&out, &err, "store ls --store '%s'", g_store);
    ck_assert_msg(rc == 2 && strstr(err, "data.mdb is damaged") && !strstr(err, "mismatched model"), "exit %d: %s", rc,
                  err);
    free(out);
    free(err);
}
END_TEST

/* A store a newer kvmill wrote (format_version 2 in its meta) was refused as "store format
 * version 2, this build reads version 1 (mismatched model, tokenizer or config)": no model,
 * tokenizer or config is at fault, and nothing said what to do. It is said to be a newer
 * kvmill's, what to do, and not supported (exit 2 for store commands, as before). */
START_TEST(test_meta_version_newer)
{
    put_caches(g_store, 1, 100);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    ck_assert_int_eq(mdb_env_create(&env), 0);
    ck_assert_int_eq(mdb_env_set_maxdbs(env, 32), 0);
    ck_assert_int_eq(mdb_env_open(env, g_store, 0, 0644), 0);
    ck_assert_int_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    ck_assert_int_eq(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
    uint8_t v[8] = {2}; /* little-endian 2: the next format version */
    MDB_val key = {14, "format_version"}, val = {8, v};
    ck_assert_int_eq(mdb_put(txn, dbi, &key, &val, 0), 0);
    ck_assert_int_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    static const char *const cmds[] = {"store ls", "store verify", "store compact"};
    for (int i = 0; i < 3; i++) {
        char *out = NULL, *err = NULL;
        int rc = kvmill(&out, &err, "%s --store '%s'", cmds[i], g_store);
        ck_assert_msg(rc == 2 && strstr(err, "store format version 2, this build reads version 1") &&
                          strstr(err, "written by a newer kvmill") && !strstr(err, "mismatched model"),
                      "%s: exit %d: %s", cmds[i], rc, err);
        free(out);
        free(err);
    }
}
END_TEST

/* A store path that is a symbolic link to a folder that does not exist (a disk not mounted): a
 * writer said "no lock file lock.mdb, and the directory is not writable", store ls "no such
 * directory" and store serve "give --create", which cannot help. Each now names the link and
 * where it leads (exit 2), and nothing is made where it points. */
START_TEST(test_store_dangling_link)
{
    char link[4300], target[4300];
    snprintf(link, sizeof link, "%s/link.lmdb", g_dir);
    snprintf(target, sizeof target, "%s/unmounted/store.lmdb", g_dir);
    ck_assert_int_eq(symlink(target, link), 0);
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(link, NULL, &s), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "is a symbolic link to") && strstr(kvm_errmsg(), target), "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_check_new_dir(link), KVM_EINVAL);
    static const char *const cmds[] = {"store ls", "store serve --bind tcp://127.0.0.1:0"};
    for (int i = 0; i < 2; i++) {
        char *out = NULL, *err = NULL;
        int rc = kvmill(&out, &err, "%s --store '%s'", cmds[i], link);
        ck_assert_msg(rc == 2 && strstr(err, "is a symbolic link to") && strstr(err, target) &&
                          !strstr(err, "--create"),
                      "%s: exit %d: %s", cmds[i], rc, err);
        free(out);
        free(err);
    }
    struct stat st;
    ck_assert_int_ne(lstat(target, &st), 0);
}
END_TEST

/* A layer record rewritten with a valid checksum whose frames are no `cache` message passed
 * store verify (every record check holds), and every ask on that document then failed. verify
 * decodes each layer as serve does and names the cache and layer that does not. */
START_TEST(test_verify_layer_decode)
{
    put_caches(g_store, 2, 100);
    char *out = NULL, *err = NULL;
    int rc = kvmill(&out, &err, "store verify --store '%s'", g_store);
    ck_assert_msg(rc == 0 && strstr(out, "0 problem(s)"), "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_store, &(kvm_store_opts){.no_sync = 1}, &s), 0);
    kvm_store_manifest m = {.n_layers = 2, .n_tokens = 10, .n_entries = 1, .full_bytes = 4096};
    snprintf(m.dtype, sizeof m.dtype, "f32");
    kvm_store_hash_bytes("model", 5, &m.model_id);
    int32_t toks[2] = {99, 7};
    ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &m.doc_hash), 0);
    const char *cfg = "compress.method=test\n";
    m.config = (kvm_frame){(const uint8_t *)cfg, strlen(cfg)};
    kvm_store_hash_bytes(cfg, strlen(cfg), &m.config_id);
    kvm_msg *good = layer_msg(0, 1, 10);
    kvm_frame fr0[8], junk = {(const uint8_t *)"not a cache message", 19};
    size_t nf = kvm_msg_nframes(good);
    for (size_t f = 0; f < nf; f++)
        fr0[f] = kvm_msg_frame(good, f);
    kvm_store_layer layers[2] = {{fr0, (uint32_t)nf}, {&junk, 1}};
    ck_assert_msg(kvm_store_put_cache(s, &m, layers) == 0, "put: %s", kvm_errmsg());
    kvm_msg_free(&good);
    kvm_store_close(&s);
    char hex[KVM_STORE_ID_HEX + 1], want[64];
    snprintf(want, sizeof want, ":%.12s:", kvm_store_id_hex(&m.doc_hash, hex));
    rc = kvmill(&out, &err, "store verify --store '%s'", g_store);
    ck_assert_msg(rc == 1 && strstr(err, want) && strstr(err, "layer 1") && strstr(err, "does not decode") &&
                      !strstr(err, "layer 0") && strstr(out, "1 problem(s)"),
                  "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
}
END_TEST

/* A cache of 2 layers whose store's model record says 3: serve refuses it ("stored cache has 2
 * layers, the model 3"), and verify passed it. */
START_TEST(test_verify_layer_count)
{
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_store, &(kvm_store_opts){.no_sync = 1}, &s), 0);
    kvm_store_manifest m = {.n_layers = 2, .n_tokens = 10, .n_entries = 2, .full_bytes = 4096};
    snprintf(m.dtype, sizeof m.dtype, "f32");
    kvm_store_hash_bytes("model3", 6, &m.model_id);
    kvm_store_model_meta mm = {.name = "three",
                               .source = "three.bin",
                               .dim = 16,
                               .hidden_dim = 32,
                               .n_layers = 3,
                               .n_heads = 2,
                               .n_kv_heads = 1,
                               .head_dim = 8,
                               .vocab_size = 512,
                               .seq_len = 512};
    ck_assert_int_eq(kvm_store_put_model(s, &m.model_id, &mm), 0);
    int32_t toks[2] = {5, 6};
    ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &m.doc_hash), 0);
    const char *cfg = "compress.method=test\n";
    m.config = (kvm_frame){(const uint8_t *)cfg, strlen(cfg)};
    kvm_store_hash_bytes(cfg, strlen(cfg), &m.config_id);
    kvm_msg *l0 = layer_msg(0, 1, 10), *l1 = layer_msg(1, 1, 10);
    kvm_frame fr[2][8];
    kvm_store_layer layers[2];
    for (int l = 0; l < 2; l++) {
        kvm_msg *msg = l ? l1 : l0;
        size_t nf = kvm_msg_nframes(msg);
        for (size_t f = 0; f < nf; f++)
            fr[l][f] = kvm_msg_frame(msg, f);
        layers[l] = (kvm_store_layer){fr[l], (uint32_t)nf};
    }
    ck_assert_msg(kvm_store_put_cache(s, &m, layers) == 0, "put: %s", kvm_errmsg());
    kvm_msg_free(&l0);
    kvm_msg_free(&l1);
    kvm_store_close(&s);
    char *out = NULL, *err = NULL;
    int rc = kvmill(&out, &err, "store verify --store '%s'", g_store);
    ck_assert_msg(rc == 1 && strstr(err, "stored with 2 layers, its model record has 3") && strstr(out, "1 problem(s)"),
                  "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
}
END_TEST

/* A zero-filled format_version read as "no version yet": a read-write open wrote 1 over it (the
 * damage gone unreported) and a read-only one called it "store format version 0". 0 is no value
 * kvmill writes: damage, naming the store and the value, and the value stays as it was. */
START_TEST(test_meta_version_zero)
{
    put_caches(g_store, 1, 100);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    ck_assert_int_eq(mdb_env_create(&env), 0);
    ck_assert_int_eq(mdb_env_set_maxdbs(env, 32), 0);
    ck_assert_int_eq(mdb_env_open(env, g_store, 0, 0644), 0);
    ck_assert_int_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    ck_assert_int_eq(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
    uint8_t v[8] = {0};
    MDB_val key = {14, "format_version"}, val = {8, v};
    ck_assert_int_eq(mdb_put(txn, dbi, &key, &val, 0), 0);
    ck_assert_int_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    kvm_store *st = NULL;
    ck_assert_int_eq(kvm_store_open(g_store, NULL, &st), KVM_ECORRUPT);
    ck_assert_ptr_null(st);
    ck_assert_msg(strstr(kvm_errmsg(), g_store) && strstr(kvm_errmsg(), "format_version holds 0"), "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_open(g_store, &(kvm_store_opts){.read_only = 1}, &st), KVM_ECORRUPT);
    ck_assert_msg(strstr(kvm_errmsg(), "format_version holds 0"), "%s", kvm_errmsg());
    /* the read-write open left the value as it found it */
    ck_assert_int_eq(mdb_env_create(&env), 0);
    ck_assert_int_eq(mdb_env_set_maxdbs(env, 32), 0);
    ck_assert_int_eq(mdb_env_open(env, g_store, MDB_RDONLY, 0644), 0);
    ck_assert_int_eq(mdb_txn_begin(env, NULL, MDB_RDONLY, &txn), 0);
    ck_assert_int_eq(mdb_dbi_open(txn, "meta", 0, &dbi), 0);
    ck_assert_int_eq(mdb_get(txn, dbi, &key, &val), 0);
    ck_assert_uint_eq(val.mv_size, 8);
    ck_assert_msg(memcmp(val.mv_data, v, 8) == 0, "format_version was rewritten");
    mdb_txn_abort(txn);
    mdb_env_close(env);
    char *out = NULL, *err = NULL;
    int rc = kvmill(&out, &err, "store verify --store '%s'", g_store);
    ck_assert_msg(rc == 1 && strstr(err, "format_version holds 0") && strstr(out, "1 problem(s)"), "exit %d: %s%s", rc,
                  out, err);
    free(out);
    free(err);
}
END_TEST

/* ---- item 13: config files ---- */

START_TEST(test_config_duplicate_and_empty)
{
    kvm_config *c = NULL;
    int rc = kvm_config_parse("[model]\npath = /m\n[compress]\nratio = 0.3\nmethod = h2o\n[store]\ndtype = f16\n"
                              "[compress]\nratio = 0.5\n",
                              "t.ini", &c);
    ck_assert_int_eq(rc, KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "t.ini:9: [compress] ratio is set again (first set on line 4)"), "%s", kvm_errmsg());
    /* an indented line right after a key continues its value; after a section header it is a key */
    rc = kvm_config_parse("[model]\npath = /m\n[compress]\n  ratio = 0.3\nratio = 0.5\n", "t.ini", &c);
    ck_assert_int_eq(rc, KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "t.ini:5: [compress] ratio is set again (first set on line 4)"), "%s", kvm_errmsg());
    /* the same key in two sections is two keys */
    ck_assert_int_eq(kvm_config_parse("[model]\npath = /m\n[run]\nbind =\n[serve]\nbind = tcp://127.0.0.1:1\n", "t.ini", &c), 0);
    kvm_config_free(&c);
    rc = kvm_config_parse("[model]\npath =\n", "t.ini", &c);
    ck_assert_int_eq(rc, KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "t.ini: [model] path: required key is empty"), "%s", kvm_errmsg());
    /* and through the command line: exit 2, naming the key */
    ck_assert_int_eq(kvm_test_write_file(g_cfg, "[model]\npath =\n", 15), 0);
    ck_assert_int_eq(mkdir(g_docs, 0700), 0);
    char *out = NULL, *err = NULL;
    rc = kvmill(&out, &err, "run --config '%s' --corpus '%s'", g_cfg, g_docs);
    ck_assert_msg(rc == 2 && strstr(err, "[model] path: required key is empty"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    const char *dup = "[model]\npath = /m\ncontext = 64\ncontext = 128\n";
    ck_assert_int_eq(kvm_test_write_file(g_cfg, dup, strlen(dup)), 0);
    rc = kvmill(&out, &err, "run --config '%s' --corpus '%s'", g_cfg, g_docs);
    ck_assert_msg(rc == 2 && strstr(err, "t.ini:4: [model] context is set again (first set on line 3)"), "exit %d: %s",
                  rc, err);
    free(out);
    free(err);
}
END_TEST

static kvm_config *parse_ok(const char *text)
{
    kvm_config *c = NULL;
    int rc = kvm_config_parse(text, "t.ini", &c);
    ck_assert_msg(rc == 0, "%s", kvm_errmsg());
    return c;
}

START_TEST(test_budget_retain_vs_context)
{
    kvm_config *c = parse_ok("[model]\npath = /m\ncontext = 128\n[compress]\nmethod = h2o\nbudget = 128\n");
    ck_assert_int_eq(kvm_jobcfg_check(c), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "[compress] budget = 128 is not below [model] context = 128"), "%s", kvm_errmsg());
    kvm_config_free(&c);
    c = parse_ok("[model]\npath = /m\ncontext = 128\n[compress]\nmethod = sculpt\nretain = 200\n");
    ck_assert_int_eq(kvm_jobcfg_check(c), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "[compress] retain = 200 is not below [model] context = 128"), "%s", kvm_errmsg());
    kvm_config_free(&c);
    const char *retain_methods[] = {"am", "kvzip"}; /* the baselines keep the retain zone too */
    for (int i = 0; i < 2; i++) {
        char t[256];
        snprintf(t, sizeof t, "[model]\npath = /m\ncontext = 64\n[compress]\nmethod = %s\nretain = 64\n", retain_methods[i]);
        c = parse_ok(t);
        ck_assert_int_eq(kvm_jobcfg_check(c), KVM_EINVAL);
        ck_assert_msg(strstr(kvm_errmsg(), "[compress] retain = 64 is not below [model] context = 64"), "%s: %s",
                      retain_methods[i], kvm_errmsg());
        kvm_config_free(&c);
    }
    c = parse_ok("[model]\npath = /m\ncontext = 128\n[compress]\nmethod = sculpt\nretain = 32\nbudget = 64\n");
    ck_assert_int_eq(kvm_jobcfg_check(c), 0);
    kvm_config_free(&c);
    c = parse_ok("[model]\npath = /m\ncontext = 16\n[compress]\nmethod = h2o\n"); /* retain is a sculpt setting */
    ck_assert_int_eq(kvm_jobcfg_check(c), 0);
    kvm_config_free(&c);
    c = parse_ok("[model]\npath = /m\ncontext = 16\n[compress]\nmethod = full\nbudget = 100\n");
    ck_assert_int_eq(kvm_jobcfg_check(c), 0);
    kvm_config_free(&c);
    if (skip_without_shared("budget_retain_vs_context (run)")) return;
    ck_assert_int_eq(mkdir(g_docs, 0700), 0);
    char doc[4400], text[8192], *out = NULL, *err = NULL;
    snprintf(doc, sizeof doc, "%s/a.txt", g_docs);
    ck_assert_int_eq(kvm_test_write_file(doc, "Once upon a time", 16), 0);
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 64\n[compress]\nretain = 64\n[store]\npath = %s\n",
             kvm_test_data_path("models/stories260K.bin"), g_store);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    int rc = kvmill(&out, &err, "run --config '%s' --corpus '%s'", g_cfg, g_docs);
    ck_assert_msg(rc == 2 && strstr(err, "[compress] retain = 64 is not below [model] context = 64"), "exit %d: %s", rc, err);
    free(out);
    free(err);
}
END_TEST

/* ---- item 3: what the config id covers ---- */

/* A value for setting s other than its default. */
static const char *other_value(const kvm_cfg_setting *s, char *buf, size_t n)
{
    switch (s->type) {
    case KVM_CFG_INT: {
        long long d = strtoll(s->def, NULL, 10);
        snprintf(buf, n, "%lld", d + 1 <= (long long)s->hi ? d + 1 : d - 1);
        return buf;
    }
    case KVM_CFG_FLOAT: {
        double d = strtod(s->def, NULL);
        snprintf(buf, n, "%.9g", d * 0.5 + (d == 0 ? 0.25 * s->hi : 0));
        return buf;
    }
    case KVM_CFG_BOOL: return strcmp(s->def, "true") ? "true" : "false";
    case KVM_CFG_ENUM: {
        const char *c = s->choices;
        size_t l = strcspn(c, "|");
        if (l == strlen(s->def) && !strncmp(c, s->def, l)) c += l + 1, l = strcspn(c, "|");
        snprintf(buf, n, "%.*s", (int)l, c);
        return buf;
    }
    default: snprintf(buf, n, "%s-other", s->def); return buf;
    }
}

START_TEST(test_config_id_covers)
{
    kvm_config *base = parse_ok("[model]\npath = /m\n");
    kvm_store_id a, b, h1, h2;
    char *canon = NULL;
    size_t n = 0;
    ck_assert_int_eq(kvm_jobcfg_config_id(base, NULL, &a, &canon, &n), 0);
    char want[64];
    snprintf(want, sizeof want, "kvmill.algorithm=%d\n", KVM_JOBCFG_ALGORITHM_VERSION);
    ck_assert_msg(!strncmp(canon, want, strlen(want)), "%s", canon);
    int n_compress = 0;
    for (int i = 0; kvm_cfg_settings[i].section; i++) {
        const kvm_cfg_setting *s = &kvm_cfg_settings[i];
        int counts = !strcmp(s->section, "compress") || (!strcmp(s->section, "model") && !strcmp(s->key, "context")) ||
                     (!strcmp(s->section, "store") && !strcmp(s->key, "dtype")) ||
                     (!strcmp(s->section, "model") && !strcmp(s->key, "weight_dtype")) ||
                     (!strcmp(s->section, "run") && !strcmp(s->key, "wire_dtype")) ||
                     (!strcmp(s->section, "model") && !strcmp(s->key, "chat"));
        if (!counts) continue;
        kvm_config *c = parse_ok("[model]\npath = /m\n");
        char buf[128];
        kvm_store_id ref = a;
        if (!strcmp(s->key, "target_step")) { /* read only with target_kl on: compared at target_kl = 0.1 */
            kvm_config *t = parse_ok("[model]\npath = /m\n[compress]\ntarget_kl = 0.1\n");
            ck_assert_int_eq(kvm_jobcfg_config_id(t, NULL, &ref, NULL, NULL), 0);
            ck_assert_int_eq(kvm_config_set(c, "compress", "target_kl", "0.1"), 0);
            kvm_config_free(&t);
        }
        if (!strncmp(s->key, "pilot_", 6) || !strcmp(s->key, "power")) { /* the pilot runs with alloc != uniform */
            kvm_config *t = parse_ok("[model]\npath = /m\n[compress]\nalloc = head\n");
            ck_assert_int_eq(kvm_jobcfg_config_id(t, NULL, &ref, NULL, NULL), 0);
            ck_assert_int_eq(kvm_config_set(c, "compress", "alloc", "head"), 0);
            kvm_config_free(&t);
        }
        ck_assert_int_eq(kvm_config_set(c, s->section, s->key, other_value(s, buf, sizeof buf)), 0);
        ck_assert_int_eq(kvm_jobcfg_config_id(c, NULL, &b, NULL, NULL), 0);
        ck_assert_msg(memcmp(&ref, &b, sizeof a), "[%s] %s = %s leaves the config id unchanged", s->section, s->key, buf);
        kvm_config_free(&c);
        n_compress += !strcmp(s->section, "compress");
    }
    ck_assert_int_ge(n_compress, 14);
    /* the strategy's bytes, not its name */
    kvm_store_hash_bytes("strategy one", 12, &h1);
    kvm_store_hash_bytes("strategy two", 12, &h2);
    char *c1 = NULL, *c2 = NULL;
    size_t n1 = 0, n2 = 0;
    ck_assert_int_eq(kvm_jobcfg_config_id(base, &h1, &a, &c1, &n1), 0);
    ck_assert_int_eq(kvm_jobcfg_config_id(base, &h2, &b, &c2, &n2), 0);
    ck_assert_int_ne(memcmp(&a, &b, sizeof a), 0);
    ck_assert_ptr_nonnull(strstr(c1, "strategy.hash="));
    ck_assert_int_eq(kvm_jobcfg_compare(c1, n1, c1, n1), KVM_JOBCFG_OK);
    ck_assert_int_eq(kvm_jobcfg_compare(c1, n1, c2, n2), KVM_JOBCFG_STALE_STRATEGY);
    ck_assert_int_eq(kvm_jobcfg_compare(canon, n, c2, n2), KVM_JOBCFG_STALE_STRATEGY);
    /* an older algorithm version (or a build before the line existed): stale-algorithm */
    const char *nl = strchr(c2, '\n');
    ck_assert_int_eq(kvm_jobcfg_compare(nl + 1, n2 - (size_t)(nl + 1 - c2), c2, n2), KVM_JOBCFG_STALE_ALGORITHM);
    char *old = malloc(n2 + 8);
    int k = snprintf(old, n2 + 8, "kvmill.algorithm=0\n%s", nl + 1);
    ck_assert_int_eq(kvm_jobcfg_compare(old, (size_t)k, c2, n2), KVM_JOBCFG_STALE_ALGORITHM);
    /* other settings */
    kvm_config *c = parse_ok("[model]\npath = /m\n[compress]\nratio = 0.5\n");
    char *c3 = NULL;
    size_t n3 = 0;
    ck_assert_int_eq(kvm_jobcfg_config_id(c, &h1, &b, &c3, &n3), 0);
    ck_assert_int_eq(kvm_jobcfg_compare(c1, n1, c3, n3), KVM_JOBCFG_OTHER);
    ck_assert_str_eq(kvm_jobcfg_state_name(KVM_JOBCFG_STALE_STRATEGY), "stale-strategy");
    ck_assert_str_eq(kvm_jobcfg_state_name(KVM_JOBCFG_OTHER), "other-config");
    free(old);
    free(c1);
    free(c2);
    free(c3);
    free(canon);
    kvm_config_free(&c);
    kvm_config_free(&base);
}
END_TEST

/* --store naming the store's data.mdb (or lock.mdb) rather than its folder, as a new user may:
 * it said "not an LMDB environment directory", which does not say what to give instead. Every
 * store command now names the folder, exit 2 as before. */
START_TEST(test_store_cli_file_of_store)
{
    put_caches(g_store, 2, 100);
    const char *subs[] = {"ls", "verify", "show a:b:c", "rm a:b:c", "compact", "stats"};
    for (int f = 0; f < 2; f++)
        for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
            char file[4400], want[4600], *out = NULL, *err = NULL;
            snprintf(file, sizeof file, "%s/%s", g_store, f ? "lock.mdb" : "data.mdb");
            int rc = kvmill(&out, &err, "store %s --store '%s'", subs[i], file);
            snprintf(want, sizeof want, "is a file of the store: name its folder, %s, instead", g_store);
            ck_assert_msg(rc == 2 && strstr(err, want), "store %s --store %s: exit %d: %s", subs[i], file, rc, err);
            free(out);
            free(err);
        }
    char other[4300], *out = NULL, *err = NULL; /* any other file: as before */
    snprintf(other, sizeof other, "%s/plain.txt", g_dir);
    ck_assert_int_eq(kvm_test_write_file(other, "x", 1), 0);
    ck_assert_int_eq(kvmill(&out, &err, "store ls --store '%s'", other), 2);
    ck_assert_msg(strstr(err, "not an LMDB environment directory") && !strstr(err, "name its folder"), "%s", err);
    free(out);
    free(err);
}
END_TEST

/* ---- item 13: compaction ---- */

START_TEST(test_compact)
{
    put_caches(g_store, 30, 20000);
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_store, NULL, &s), 0);
    for (int i = 0; i < 25; i++) {
        kvm_store_cache_key k;
        kvm_store_hash_bytes("model", 5, &k.model_id);
        int32_t toks[2] = {i, 7};
        ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &k.doc_hash), 0);
        const char *cfg = "compress.method=test\n";
        kvm_store_hash_bytes(cfg, strlen(cfg), &k.config_id);
        ck_assert_int_eq(kvm_store_rm_cache(s, &k), 0);
    }
    kvm_store_close(&s);
    char data[4400], copy[4300], cdata[4400], *out = NULL, *err = NULL;
    snprintf(data, sizeof data, "%s/data.mdb", g_store);
    snprintf(copy, sizeof copy, "%s.compact", g_store);
    snprintf(cdata, sizeof cdata, "%s/data.mdb", copy);
    int rc = kvmill(&out, &err, "store compact --store '%s'", g_store);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    ck_assert_msg(strstr(out, copy) && strstr(out, "mv '"), "%s", out);
    free(out);
    free(err);
    struct stat a, b;
    ck_assert_int_eq(stat(data, &a), 0);
    ck_assert_int_eq(stat(cdata, &b), 0);
    ck_assert_msg(b.st_size * 2 < a.st_size, "copy %lld bytes, store %lld", (long long)b.st_size, (long long)a.st_size);
    /* the copy's folder has a new store's mode (0775 less the umask), not mkdtemp's 0700: swapped
     * in, it would shut out the group */
    struct stat cd;
    mode_t mask = umask(0);
    umask(mask);
    ck_assert_int_eq(stat(copy, &cd), 0);
    ck_assert_msg((cd.st_mode & 0777) == (0775 & ~mask), "the copy's folder has mode %o",
                  (unsigned)(cd.st_mode & 0777));
    /* the copy is a whole store: it verifies and holds the 5 caches left */
    ck_assert_int_eq(kvmill(&out, &err, "store verify --store '%s'", copy), 0);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store ls --csv --store '%s'", copy), 0);
    int lines = 0;
    for (char *p = out; *p; p++) lines += *p == '\n';
    ck_assert_int_eq(lines, 6);
    free(out);
    free(err);
    /* an existing destination is refused, the store is left as it was */
    rc = kvmill(&out, &err, "store compact --store '%s' --out '%s'", g_store, copy);
    ck_assert_msg(rc == 2 && strstr(err, "already exists"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    struct stat a2;
    ck_assert_int_eq(stat(data, &a2), 0);
    ck_assert_int_eq((long long)a2.st_size, (long long)a.st_size);
    /* a copy inside the store's own directory was written, and the swap printed with it
     * (mv STORE STORE.old && mv STORE/sub STORE) moved the copy away with the store: the second
     * mv failed and no store was left. Refused (exit 2), however the path is spelled; nothing is
     * created in the store. */
    char link[4300];
    snprintf(link, sizeof link, "%s/dangling", g_dir); /* was "cannot create: File exists", exit 1 (I/O) */
    ck_assert_int_eq(symlink("/nonexistent/kvmill", link), 0);
    rc = kvmill(&out, &err, "store compact --store '%s' --out '%s'", g_store, link);
    ck_assert_msg(rc == 2 && strstr(err, "already exists (a symbolic link)"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(link, sizeof link, "%s/store-link", g_dir);
    ck_assert_int_eq(symlink(g_store, link), 0);
    char insides[4][4400];
    snprintf(insides[0], sizeof insides[0], "%s/sub", g_store);
    snprintf(insides[1], sizeof insides[1], "%s/./sub/", g_store);
    snprintf(insides[2], sizeof insides[2], "%s/../store.lmdb/sub", g_store);
    snprintf(insides[3], sizeof insides[3], "%s/sub", link); /* through a symbolic link to the store */
    for (int i = 0; i < 4; i++) {
        const char *inside = insides[i];
        rc = kvmill(&out, &err, "store compact --store '%s' --out '%s'", g_store, inside);
        ck_assert_msg(rc == 2 && strstr(err, "is inside the store"), "%s: exit %d: %s", inside, rc, err);
        ck_assert_msg(!strstr(out, "mv '"), "%s", out);
        free(out);
        free(err);
        char sub[4400];
        snprintf(sub, sizeof sub, "%s/sub", g_store);
        ck_assert_msg(access(sub, F_OK) != 0, "%s was created", sub);
    }
}
END_TEST

/* Folders in g_dir whose names start with `prefix`. */
static int count_prefixed(const char *prefix)
{
    DIR *d = opendir(g_dir);
    ck_assert_ptr_nonnull(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

/* `kvmill store compact --store g_store --out OUT` in a child whose files may grow to `limit`
 * bytes at most (kvmill ignores SIGXFSZ: the write past it fails, EFBIG, and is said).
 * compact_start returns the child's pid, compact_limited its wait status. */
static pid_t compact_start(const char *outdir, rlim_t limit)
{
    char exe[4300];
    snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        struct rlimit fs = {limit, limit}, core = {0, 0};
        int null = open("/dev/null", O_WRONLY);
        if (setrlimit(RLIMIT_CORE, &core) || setrlimit(RLIMIT_FSIZE, &fs) || null < 0) _exit(126);
        dup2(null, 1);
        dup2(null, 2);
        execl(exe, "kvmill", "store", "compact", "--store", g_store, "--out", outdir, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static int compact_limited(const char *outdir, rlim_t limit)
{
    const pid_t pid = compact_start(outdir, limit);
    int st = 0;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return st;
}

/* What a compact to g_dir/BASE that was killed midway leaves: ".STEM.compact-XXXXXX" (STEM as
 * store/kvm_store_compact.c's tmp_prefix makes it: BASE, or for a BASE past 239 characters its
 * first 222, '~' and its FNV-1a 64 hash in hex) holding a truncated data.mdb (the store's first
 * 256 KiB) and a lock.mdb, unlocked. */
static void make_leftover(const char *base)
{
    char stem[300], dir[4600], f[4700];
    const size_t len = strlen(base);
    if (1 + len + 15 <= 255)
        snprintf(stem, sizeof stem, "%s", base);
    else {
        unsigned long long h = 1469598103934665603ULL;
        for (const unsigned char *c = (const unsigned char *)base; *c; c++)
            h = (h ^ *c) * 1099511628211ULL;
        snprintf(stem, sizeof stem, "%.222s~%016llx", base, h);
    }
    snprintf(dir, sizeof dir, "%s/.%s.compact-XXXXXX", g_dir, stem);
    ck_assert_ptr_nonnull(mkdtemp(dir));
    size_t n = 0;
    snprintf(f, sizeof f, "%s/data.mdb", g_store);
    char *data = kvm_test_read_file(f, &n);
    ck_assert_msg(data && n > 256 * 1024, "the store is %zu bytes", n);
    snprintf(f, sizeof f, "%s/data.mdb", dir);
    ck_assert_int_eq(kvm_test_write_file(f, data, 256 * 1024), 0);
    free(data);
    snprintf(f, sizeof f, "%s/lock.mdb", dir);
    ck_assert_int_eq(kvm_test_write_file(f, "", 0), 0);
}

/* Occurrences of `needle` in `hay`. */
static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* A compact killed midway left a truncated data.mdb under the --out name: `store verify`
 * refused it, but the next compact to the same --out failed "already exists", and a user could
 * take it for a good copy. Now the copy is written beside it and renamed when complete: a
 * compact cut short (here by a file size limit, which it says) leaves no --out and removes its
 * copy; one killed midway leaves its folder (made here as it is left), which the next one
 * removes before it succeeds. A leftover holding a file of the user's is named and kept. */
START_TEST(test_compact_killed_midway)
{
    put_caches(g_store, 30, 20000); /* about 900 KB: the 256 KB limit is crossed midway */
    char ck[4300], *out = NULL, *err = NULL;
    snprintf(ck, sizeof ck, "%s/ck", g_dir);
    /* a compact cut short by a file size limit: no --out, and its partial copy removed */
    int st = compact_limited(ck, 256 * 1024);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "the compact was not cut short: status 0x%x", st);
    struct stat sb;
    ck_assert_msg(lstat(ck, &sb) != 0, "%s exists after a compact cut short", ck);
    ck_assert_int_eq(count_prefixed(".ck.compact-"), 0);
    make_leftover("ck"); /* one killed midway (SIGKILL, a power cut) leaves its folder */
    int rc = kvmill(&out, &err, "store compact --store '%s' --out '%s'", g_store, ck);
    /* the command's prefix once: the line read "kvmill store compact: store compact: removed" */
    ck_assert_msg(rc == 0 && strstr(err, "/.ck.compact-") && strstr(err, "cut short") &&
                      strstr(err, "kvmill store compact: removed ") && count_of(err, "store compact:") == 1,
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(count_prefixed(".ck.compact-"), 0);
    ck_assert_int_eq(kvmill(&out, &err, "store verify --store '%s'", ck), 0);
    free(out);
    free(err);
    /* a leftover with a file that is not LMDB's: named, kept, the compact goes on */
    char keep[4400], note[4500];
    snprintf(keep, sizeof keep, "%s/.ck2.compact-abc123", g_dir);
    snprintf(note, sizeof note, "%s/notes.txt", keep);
    ck_assert_int_eq(mkdir(keep, 0700), 0);
    ck_assert_int_eq(kvm_test_write_file(note, "x", 1), 0);
    rc = kvmill(&out, &err, "store compact --store '%s' --out '%s/ck2'", g_store, g_dir);
    ck_assert_msg(rc == 0 && strstr(err, ".ck2.compact-abc123") && strstr(err, "left as it is") &&
                      count_of(err, "store compact:") == 1,
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(access(note, F_OK), 0);
}
END_TEST

/* A store put and a stats read on handle s: the statuses into *put, *read. */
static void put_and_read(kvm_store *s, int seed, int *put, int *read)
{
    kvm_store_id id = {{0}};
    id.b[0] = (uint8_t)seed;
    kvm_store_model_meta mm = {.n_layers = 2, .n_heads = 1, .n_kv_heads = 1, .head_dim = 8};
    *put = kvm_store_put_model(s, &id, &mm);
    kvm_store_stats st;
    *read = kvm_store_stats_get(s, &st);
}

/* A store removed, replaced or stripped of its lock.mdb under a process that has it open: LMDB
 * goes on with the files it holds, so `kvmill run` committed into a deleted store and reported
 * every document stored (nothing was on disk once it exited), and a process whose lock.mdb was
 * removed wrote beside one that opened the new lock file, with no common mutex (a read then took
 * the other's reuse of its pages for "data.mdb is damaged"). Now every write into a store gone
 * or replaced is refused, and every transaction once lock.mdb is lost, naming what happened. */
START_TEST(test_store_gone_under_handle)
{
    kvm_store_opts o = {.no_sync = 1};
    kvm_store *s = NULL;
    int put, read;
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    put_and_read(s, 1, &put, &read);
    ck_assert_int_eq(put, 0);
    ck_assert_int_eq(read, 0);
    /* removed: the write refused, the read (of what this process already had) not */
    char away[4400];
    snprintf(away, sizeof away, "%s/away", g_dir);
    ck_assert_int_eq(rename(g_store, away), 0);
    put_and_read(s, 2, &put, &read);
    ck_assert_msg(put == KVM_ESTATE && strstr(kvm_errmsg(), "is gone since this process opened it"), "put: %d %s", put,
                  kvm_errmsg());
    ck_assert_int_eq(read, 0);
    /* another store at the path: the write would go into the one moved away */
    kvm_test_store_create(g_store);
    put_and_read(s, 3, &put, &read);
    ck_assert_msg(put == KVM_ESTATE && strstr(kvm_errmsg(), "was replaced since this process opened it"), "put: %d %s",
                  put, kvm_errmsg());
    kvm_test_rmtree(g_store);
    ck_assert_int_eq(rename(away, g_store), 0); /* put back: written again */
    put_and_read(s, 4, &put, &read);
    ck_assert_int_eq(put, 0);
    /* lock.mdb removed: neither writes nor reads, and kvm_store_follow says the same */
    char lock[4400];
    snprintf(lock, sizeof lock, "%s/lock.mdb", g_store);
    ck_assert_int_eq(unlink(lock), 0);
    put_and_read(s, 5, &put, &read);
    ck_assert_msg(put == KVM_ESTATE && read == KVM_ESTATE && strstr(kvm_errmsg(), "its lock.mdb was removed"),
                  "put %d, read %d: %s", put, read, kvm_errmsg());
    int reopened = 1;
    ck_assert_int_eq(kvm_store_follow(&s, 0, &reopened), KVM_ESTATE);
    ck_assert_int_eq(reopened, 0);
    kvm_store_close(&s);
    /* opened again (a new lock.mdb): what was committed while it was there is all there */
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    kvm_store_model_meta mm;
    kvm_store_id id = {{0}};
    for (int seed = 1; seed <= 5; seed++) {
        id.b[0] = (uint8_t)seed;
        ck_assert_int_eq(kvm_store_get_model(s, &id, &mm), seed == 1 || seed == 4 ? 0 : KVM_ENOTFOUND);
    }
    kvm_store_close(&s);
}
END_TEST

/* Two compacts to the same --out at once: the second looked for leftovers while the first had
 * created its temporary folder but not yet locked it, took the empty unlocked folder for a dead
 * compact's leftover and removed it, and the first failed. Here the test is the first compact,
 * caught in that moment: it holds the parent folder's lock (as a compact does from its look for
 * leftovers until its folder is locked), creates its folder, and starts the second. The second
 * waits for the parent's lock (the old code removed the folder at once and finished), then
 * passes the folder by, locked now, and makes its copy beside it. */
START_TEST(test_compact_concurrent_same_out)
{
    put_caches(g_store, 3, 2000);
    char ck[4400], first[4400];
    snprintf(ck, sizeof ck, "%s/ck3", g_dir);
    snprintf(first, sizeof first, "%s/.ck3.compact-XXXXXX", g_dir);
    const int parent_fd = open(g_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* the child holds no lock */
    ck_assert_msg(parent_fd >= 0 && flock(parent_fd, LOCK_EX) == 0, "lock %s: %s", g_dir, strerror(errno));
    ck_assert_ptr_nonnull(mkdtemp(first));
    const pid_t pid = compact_start(ck, RLIM_INFINITY);
    int st = 0;
    pid_t done = 0;
    for (int i = 0; i < 40 && done == 0; i++) { /* 2 s: the old code finished in milliseconds */
        usleep(50000);
        done = waitpid(pid, &st, WNOHANG);
    }
    struct stat sb;
    ck_assert_msg(done == 0, "the second compact did not wait for the first (status 0x%x; %s %s)", st, first,
                  stat(first, &sb) == 0 ? "kept" : "removed");
    const int first_fd = open(first, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ck_assert_msg(first_fd >= 0 && flock(first_fd, LOCK_EX) == 0, "%s: %s", first, strerror(errno));
    close(parent_fd);
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the second compact failed: status 0x%x", st);
    ck_assert_msg(stat(first, &sb) == 0 && S_ISDIR(sb.st_mode), "the first compact's folder %s was removed", first);
    ck_assert_msg(stat(ck, &sb) == 0 && S_ISDIR(sb.st_mode), "%s missing", ck);
    close(first_fd);
    rmdir(first);
}
END_TEST

/* 1 when process pid has folder `dir` open (a descriptor in /proc/PID/fd links to it). */
static int has_open(pid_t pid, const char *dir)
{
    char fds[64], link[4400], target[4400];
    snprintf(fds, sizeof fds, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(fds);
    int found = 0;
    for (struct dirent *e; d && !found && (e = readdir(d));) {
        snprintf(link, sizeof link, "%s/%s", fds, e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        found = n > 0 && (target[n] = '\0', !strcmp(target, dir));
    }
    if (d) closedir(d);
    return found;
}

/* A --out created while the copy is written is refused, and left as it is: the compact, caught
 * waiting for the parent folder's lock after its first look at --out, finds an empty folder
 * there when it renames its copy (rename replaced an empty folder; renameat2's RENAME_NOREPLACE
 * now refuses it), and removes its own copy. */
START_TEST(test_compact_out_created_meanwhile)
{
    put_caches(g_store, 3, 2000);
    char ck[4400], real[4400];
    snprintf(ck, sizeof ck, "%s/ck5", g_dir);
    ck_assert_ptr_nonnull(realpath(g_dir, real));
    const int parent_fd = open(g_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ck_assert_msg(parent_fd >= 0 && flock(parent_fd, LOCK_EX) == 0, "lock %s: %s", g_dir, strerror(errno));
    const pid_t pid = compact_start(ck, RLIM_INFINITY);
    /* it has looked at --out and waits for the lock: the folder held open on 4 looks in a row (a
     * sanitized build's first look at --out opens it too, for long enough to be seen once) */
    int held = 0;
    for (int i = 0; i < 600 && held < 4; i++, usleep(50000))
        held = has_open(pid, real) ? held + 1 : 0;
    ck_assert_msg(held == 4, "the compact did not open %s", real);
    ck_assert_int_eq(mkdir(ck, 0755), 0);
    close(parent_fd);
    int st = 0;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "the compact was not refused: status 0x%x", st);
    DIR *d = opendir(ck);
    ck_assert_ptr_nonnull(d);
    int entries = 0;
    for (struct dirent *e; (e = readdir(d));)
        entries += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    ck_assert_int_eq(entries, 0); /* the user's folder is as it was */
    ck_assert_int_eq(count_prefixed(".ck5.compact-"), 0);
}
END_TEST

/* `flock DIR kvmill store compact --out DIR/x` hands the compact a descriptor that holds DIR's
 * lock: its own flock on DIR would wait for itself forever. It waits 5 s, says so, and goes on. */
START_TEST(test_compact_parent_lock_inherited)
{
    put_caches(g_store, 3, 2000);
    const int parent_fd = open(g_dir, O_RDONLY | O_DIRECTORY); /* no O_CLOEXEC: the compact inherits it */
    ck_assert_msg(parent_fd >= 0 && flock(parent_fd, LOCK_EX) == 0, "lock %s: %s", g_dir, strerror(errno));
    char *out = NULL, *err = NULL;
    const int rc = kvmill(&out, &err, "store compact --store '%s' --out '%s/ck4'", g_store, g_dir);
    close(parent_fd);
    ck_assert_msg(rc == 0 && strstr(err, "stayed locked (flock) for 5 s"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    char ck[4400];
    snprintf(ck, sizeof ck, "%s/ck4", g_dir);
    ck_assert_int_eq(kvmill(&out, &err, "store verify --store '%s'", ck), 0);
    free(out);
    free(err);
}
END_TEST

/* A valid --out of 250 characters: the temporary folder ".NAME.compact-XXXXXX" was 266, past
 * NAME_MAX, and the compact failed "File name too long" naming --out. Now NAME's part is
 * shortened (a prefix and a hash): the compact works, and a leftover of one killed midway (made
 * here as one is left) is found and removed by the next compact to that name, with the
 * command's prefix said once. */
START_TEST(test_compact_long_out_name)
{
    put_caches(g_store, 30, 20000); /* about 900 KB: the 256 KB limit is crossed midway */
    char name[251], ck[4600], *out = NULL, *err = NULL;
    memset(name, 'n', 250);
    name[250] = '\0';
    snprintf(ck, sizeof ck, "%s/%s", g_dir, name);
    make_leftover(name);
    char prefix[64];
    snprintf(prefix, sizeof prefix, ".%.40s", name); /* the shortened stem starts with NAME's prefix */
    ck_assert_int_eq(count_prefixed(prefix), 1);
    int rc = kvmill(&out, &err, "store compact --store '%s' --out '%s'", g_store, ck);
    ck_assert_msg(rc == 0 && strstr(err, "cut short") && count_of(err, "store compact:") == 1 &&
                      strstr(err, "kvmill store compact: removed "),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(count_prefixed(prefix), 0);
    struct stat sb;
    ck_assert_msg(lstat(ck, &sb) == 0 && S_ISDIR(sb.st_mode), "%s missing", ck);
    ck_assert_int_eq(kvmill(&out, &err, "store verify --store '%s'", ck), 0);
    free(out);
    free(err);
    /* long names sharing their first 249 characters do not share leftovers: a compact to one
     * leaves the other's alone */
    name[249] = 'm';
    make_leftover(name);
    name[249] = 'o';
    snprintf(ck, sizeof ck, "%s/%s", g_dir, name);
    rc = kvmill(&out, &err, "store compact --store '%s' --out '%s'", g_store, ck);
    ck_assert_msg(rc == 0 && !strstr(err, "cut short"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(count_prefixed(prefix), 1);
}
END_TEST

/* Runs the swap line ("  mv ... && mv ...") that store compact printed in out, from folder cwd,
 * and returns its exit status. */
static int run_swap(const char *out, const char *cwd)
{
    const char *mv = strstr(out, "\n  mv ");
    ck_assert_msg(mv != NULL, "no swap line in: %s", out);
    char line[8192], cmd[9000];
    snprintf(line, sizeof line, "%.*s", (int)strcspn(mv + 1, "\n"), mv + 1);
    snprintf(cmd, sizeof cmd, "cd '%s' && %s", cwd, line);
    return system(cmd);
}

/* The swap store compact prints works as printed: for --store . (the default copy was
 * "..compact", inside the store, and "mv '.' '..old'" cannot move the current folder) and for a
 * store whose path holds a quote (the printed 'quoting' broke). Afterwards the store holds the
 * compacted copy and verifies, the old one is beside it. */
START_TEST(test_compact_swap_as_printed)
{
    char quoted[4300], cmd[9000], *out = NULL, *err = NULL;
    snprintf(quoted, sizeof quoted, "%s/it's store", g_dir);
    const char *stores[] = {g_store, quoted};
    for (int i = 0; i < 2; i++) {
        put_caches(stores[i], 3, 2000);
        if (i == 0)
            snprintf(cmd, sizeof cmd, "cd '%s' && '%s/kvmill' store compact --store .", g_store, kvm_test_bin());
        else
            snprintf(cmd, sizeof cmd, "'%s/kvmill' store compact --store \"%s\"", kvm_test_bin(), quoted);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 0, "%s: exit %d: %s", cmd, rc, err);
        ck_assert_msg(run_swap(out, i == 0 ? g_store : g_dir) == 0, "the swap failed: %s", out);
        free(out);
        free(err);
        char old[4400];
        snprintf(old, sizeof old, "%s.old/data.mdb", stores[i]);
        ck_assert_msg(access(old, F_OK) == 0, "%s missing", old);
        snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --csv --store \"%s\"", kvm_test_bin(), stores[i]);
        ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
        int lines = 0;
        for (char *p = out; *p; p++)
            lines += *p == '\n';
        ck_assert_msg(lines == 4, "%s", out);
        free(out);
        free(err);
    }
}
END_TEST

/* A store whose path is a symbolic link (to a folder on a larger disk, say): the copy was
 * written beside the link and the printed swap moved the link, so the link became a folder
 * holding the copy and the store it pointed to stayed whole, now behind LINK.old. The copy is
 * written beside the store the link points to now and the swap moves that store: the link
 * stays a link and names the compacted store; the old store is beside it as STORE.old. */
START_TEST(test_compact_symlinked_store)
{
    char link[4300], cmd[9000], *out = NULL, *err = NULL;
    snprintf(link, sizeof link, "%s/link", g_dir);
    put_caches(g_store, 3, 2000);
    ck_assert_int_eq(symlink(g_store, link), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store compact --store '%s/'", kvm_test_bin(), link);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "%s: exit %d: %s", cmd, rc, err);
    ck_assert_msg(strstr(err, "is a symbolic link to"), "%s", err);
    ck_assert_msg(run_swap(out, g_dir) == 0, "the swap failed: %s", out);
    free(out);
    free(err);
    struct stat st;
    ck_assert_int_eq(lstat(link, &st), 0);
    ck_assert_msg(S_ISLNK(st.st_mode), "the swap replaced the link %s with a folder", link);
    char old[4400];
    snprintf(old, sizeof old, "%s.old/data.mdb", g_store);
    ck_assert_msg(access(old, F_OK) == 0, "%s missing", old);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store verify --store '%s'", kvm_test_bin(), link);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --csv --store '%s'", kvm_test_bin(), link);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    int lines = 0;
    for (char *p = out; *p; p++)
        lines += *p == '\n';
    ck_assert_msg(lines == 4, "%s", out);
    free(out);
    free(err);
}
END_TEST

/* ---- item 10: claims ---- */

START_TEST(test_claim_lease)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    kvm_store_cache_key k;
    memset(&k, 7, sizeof k);
    int taken = -1;
    kvm_store_claim h;
    /* a lease of 1 s, not 300 ms: each check that it still holds comes one LMDB write after a
     * take or renewal, and a test process stalled 300 ms there (2 cores shared with 3 other
     * sanitized suites) would see it lapse */
    const int64_t lease = 1000;
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:a", "hostA", lease, &taken, &h), 0);
    ck_assert_int_eq(taken, 1);
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:b", "hostB", lease, &taken, &h), 0);
    ck_assert_int_eq(taken, 0);
    ck_assert_str_eq(h.owner, "run:a");
    ck_assert_str_eq(h.host, "hostA");
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:a", "hostA", lease, &taken, &h), 0); /* its own: renewed */
    ck_assert_int_eq(taken, 1);
    /* renewed while the job lives: b cannot take it past the first lease's end */
    for (double t0 = now_s(); now_s() - t0 < (double)(lease + 300) / 1000;) {
        usleep(100000);
        int64_t n = 0;
        ck_assert_int_eq(kvm_store_claim_renew(s, "run:a", lease, &n), 0);
        ck_assert_int_eq(n, 1);
    }
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:b", "hostB", lease, &taken, &h), 0);
    ck_assert_int_eq(taken, 0);
    /* a run that died stops renewing: its lease lapses and another run takes over */
    usleep((useconds_t)(lease + 200) * 1000);
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:b", "hostB", lease, &taken, &h), 0);
    ck_assert_int_eq(taken, 1);
    kvm_store_claim got;
    ck_assert_int_eq(kvm_store_claim_get(s, &k, &got), 0);
    ck_assert_str_eq(got.owner, "run:b");
    int64_t n = 0;
    ck_assert_int_eq(kvm_store_claim_release(s, "run:b", &n), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(kvm_store_claim_get(s, &k, &got), KVM_ENOTFOUND);
    int64_t recs = 0, bad = -1;
    ck_assert_int_eq(kvm_store_verify(s, NULL, NULL, &recs, &bad), 0);
    ck_assert_int_eq(bad, 0);
    kvm_store_close(&s);
    /* a read-only handle cannot claim */
    o.read_only = 1;
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:c", "", 300, &taken, &h), KVM_ESTATE);
    kvm_store_close(&s);
}
END_TEST

/* A claim's lease had no upper bound: a claim with ttl_ms 2^40 (~34 years, or the 1000 h a
 * valid config makes) kept the document from every other run for that long. A lease above
 * 24 h is refused now, by a take and by a renewal, and nothing is written; 24 h is taken. */
START_TEST(test_claim_lease_capped)
{
    kvm_store *s = open_store_nosync();
    kvm_store_cache_key k;
    memset(&k, 9, sizeof k);
    int taken = -1;
    kvm_store_claim h, got;
    const int64_t day = 86400000;
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:evil:1:1", "evil", (int64_t)1 << 40, &taken, &h), KVM_ERANGE);
    ck_assert_msg(strstr(kvm_errmsg(), "86400000 ms") != NULL, "%s", kvm_errmsg());
    ck_assert_int_eq(taken, 0);
    ck_assert_int_eq(kvm_store_claim_get(s, &k, &got), KVM_ENOTFOUND);
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:a", "hostA", day + 1, &taken, &h), KVM_ERANGE);
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:a", "hostA", day, &taken, &h), 0);
    ck_assert_int_eq(taken, 1);
    ck_assert_int_eq(kvm_store_claim_get(s, &k, &got), 0);
    int64_t n = -1;
    ck_assert_int_eq(kvm_store_claim_renew(s, "run:a", (int64_t)1 << 40, &n), KVM_ERANGE);
    kvm_store_claim after;
    ck_assert_int_eq(kvm_store_claim_get(s, &k, &after), 0);
    ck_assert_int_eq(after.expires_unix_ms, got.expires_unix_ms); /* the refused renewal changed nothing */
    kvm_store_close(&s);
}
END_TEST

static int count_claim(const kvm_store_cache_key *k, const kvm_store_claim *c, void *arg)
{
    (void)k, (void)c;
    ++*(int *)arg;
    return 0;
}

/* Nothing listed or cleared claims: a stuck one (a hostile client's, a run killed on another
 * host) held its document until it lapsed. `store claims` lists them (owner, host, key, expiry,
 * live or lapsed; --csv), and `store claims --release OWNER` removes an owner's, refused while
 * one of them is live unless --force: a run of this host still running (this test process)
 * and, as much, another host's run (which went unprotected: its claims were removed, the run
 * going on without noticing). An owner with lapsed claims only is released. */
START_TEST(test_store_claims_cli)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    kvm_store_cache_key k[3];
    char self[192], host[64];
    kvm_storew_owner(self, sizeof self, host, sizeof host);
    const char *owners[3] = {"run:evil:1:1", "run:gone:2:2", self}, *hosts[3] = {"evil", "gone", host};
    for (int i = 0; i < 3; i++) {
        int taken = 0;
        memset(&k[i], 0x11 * (i + 1), sizeof k[i]);
        ck_assert_int_eq(kvm_store_claim_take(s, &k[i], owners[i], hosts[i], i == 1 ? 1 : 3600000, &taken, NULL), 0);
        ck_assert_int_eq(taken, 1);
    }
    kvm_store_close(&s);
    usleep(20000); /* run:gone's 1 ms lease lapses */
    char *out = NULL, *err = NULL;
    ck_assert_msg(kvmill(&out, &err, "store claims --store '%s'", g_store) == 0, "%s%s", out, err);
    ck_assert_msg(strstr(out, "run:evil:1:1") && strstr(out, "evil") && strstr(out, "111111111111") &&
                      strstr(out, self) && strstr(out, "lapsed") && strstr(out, "3 claim(s), 2 live"),
                  "%s", out);
    free(out), free(err);
    ck_assert_msg(kvmill(&out, &err, "store claims --store '%s' --csv", g_store) == 0, "%s%s", out, err);
    ck_assert_msg(strstr(out, "model_id,doc_hash,config_id,since_ms,expires_ms,state,host,owner\n") &&
                      strstr(out, ",lapsed,gone,run:gone:2:2\n") && strstr(out, ",live,evil,run:evil:1:1\n"),
                  "%s", out);
    free(out), free(err);
    /* a live claim of another host's run: that run may go on (it would not notice), so refused
     * without --force; a lapsed one's is released */
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release run:evil:1:1", g_store), 1);
    ck_assert_msg(strstr(err, "run:evil:1:1 holds 1 live claim(s), the latest lapsing at ") &&
                      strstr(err, "lets other runs compress those documents again while that run goes on (it would "
                                  "not notice); use --force if it is gone"),
                  "%s", err);
    free(out), free(err);
    ck_assert_msg(kvmill(&out, &err, "store claims --store '%s' --release run:evil:1:1 --force", g_store) == 0, "%s%s",
                  out, err);
    ck_assert_msg(strstr(out, "released 1 claim(s) of run:evil:1:1"), "%s", out);
    free(out), free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release run:evil:1:1", g_store), 1);
    ck_assert_msg(strstr(err, "no claim of run:evil:1:1"), "%s", err);
    free(out), free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release '%s'", g_store, self), 1);
    ck_assert_msg(strstr(err, "(a live run: process ") && strstr(err, "is running)") && strstr(err, "--force"), "%s",
                  err);
    free(out), free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --force", g_store), 2);
    free(out), free(err);
    /* an owner no claim can have: named by the option and its limit, not the store's "host 0..63,
     * ttl_ms >= 1" (given by no one here) */
    char long_owner[200];
    memset(long_owner, 'o', 128);
    long_owner[128] = '\0';
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release ''", g_store), 2);
    ck_assert_msg(strstr(err, "--release: the owner is empty; an owner is 1 to 127 bytes") && !strstr(err, "ttl"), "%s",
                  err);
    free(out), free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release %s --force", g_store, long_owner), 2);
    ck_assert_msg(strstr(err, "--release: the owner is 128 bytes; an owner is 1 to 127 bytes") && !strstr(err, "ttl"),
                  "%s", err);
    free(out), free(err);
    int n = 0;
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    ck_assert_int_eq(kvm_store_list_claims(s, count_claim, &n), 0);
    kvm_store_close(&s);
    ck_assert_int_eq(n, 2); /* run:gone's and this process's */
    ck_assert_msg(kvmill(&out, &err, "store claims --store '%s' --release '%s' --force", g_store, self) == 0, "%s%s",
                  out, err);
    free(out), free(err);
    kvm_store_claim got;
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    ck_assert_int_eq(kvm_store_claim_get(s, &k[2], &got), KVM_ENOTFOUND);
    ck_assert_int_eq(kvm_store_claim_get(s, &k[1], &got), 0);
    kvm_store_close(&s);
    ck_assert_msg(kvmill(&out, &err, "store claims --store '%s' --release run:gone:2:2", g_store) == 0, "%s%s", out,
                  err);
    ck_assert_msg(strstr(out, "released 1 claim(s) of run:gone:2:2"), "%s", out);
    free(out), free(err);
}
END_TEST

/* Claims of owner o in the store, and of any owner. */
typedef struct claim_count {
    const char *owner;
    int mine, all;
} claim_count;

static int count_owner_claim(const kvm_store_cache_key *k, const kvm_store_claim *c, void *arg)
{
    (void)k;
    claim_count *x = arg;
    x->mine += !strcmp(c->owner, x->owner);
    x->all++;
    return 0;
}

/* Whether t is one line, ended by its only line break. */
static int one_line(const char *t)
{
    const char *nl = strchr(t, '\n');
    return nl && nl[1] == '\0';
}

static claim_count claims_of(kvm_store *s, const char *owner)
{
    claim_count x = {owner, 0, 0};
    ck_assert_int_eq(kvm_store_list_claims(s, count_owner_claim, &x), 0);
    return x;
}

/* `store claims --release` checked the owner's claims for a live one in a read, then removed
 * them all in a later write txn: a claim the run took while the command waited for the write
 * lock was removed with the lapsed ones ("released 4 claim(s)"). The check is made in the txn
 * that removes (kvm_store_claim_release_lapsed): with a live claim there, added after any check
 * the caller made, nothing is removed (KVM_EBUSY, the live count and latest expiry); lapsed
 * claims only are removed; --force removes all; another owner's claims are never touched. */
START_TEST(test_claim_release_lapsed_in_txn)
{
    kvm_store *s = open_store_nosync();
    const char *own = "run:far:1:1";
    kvm_store_cache_key k[5];
    int taken = 0;
    for (int i = 0; i < 5; i++)
        memset(&k[i], 0x21 + i, sizeof k[i]);
    for (int i = 0; i < 3; i++) { /* three lapsed claims of own */
        ck_assert_int_eq(kvm_store_claim_take(s, &k[i], own, "farhost", 1, &taken, NULL), 0);
        ck_assert_int_eq(taken, 1);
    }
    ck_assert_int_eq(kvm_store_claim_take(s, &k[4], "run:other:2:2", "other", 3600000, &taken, NULL), 0);
    usleep(20000);
    int64_t n = -1, n_live = -1, latest = -1;
    /* a caller's check would find them all lapsed; then the run takes a new claim */
    ck_assert_int_eq(kvm_store_claim_take(s, &k[3], own, "farhost", 600000, &taken, NULL), 0);
    kvm_store_claim live;
    ck_assert_int_eq(kvm_store_claim_get(s, &k[3], &live), 0);
    ck_assert_int_eq(kvm_store_claim_release_lapsed(s, own, 0, &n, &n_live, &latest), KVM_EBUSY);
    ck_assert_int_eq(n, 0);
    ck_assert_int_eq(n_live, 1);
    ck_assert_int_eq(latest, live.expires_unix_ms);
    claim_count c = claims_of(s, own);
    ck_assert_int_eq(c.mine, 4); /* nothing removed, the lapsed ones neither */
    ck_assert_int_eq(c.all, 5);
    /* --force: every claim of own, the live one too; the other owner's stays */
    ck_assert_int_eq(kvm_store_claim_release_lapsed(s, own, 1, &n, &n_live, &latest), 0);
    ck_assert_int_eq(n, 4);
    ck_assert_int_eq(n_live, 0);
    c = claims_of(s, own);
    ck_assert_int_eq(c.mine, 0);
    ck_assert_int_eq(c.all, 1);
    /* lapsed claims only: removed without force */
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(kvm_store_claim_take(s, &k[i], own, "farhost", 1, &taken, NULL), 0);
    usleep(20000);
    ck_assert_int_eq(kvm_store_claim_release_lapsed(s, own, 0, &n, &n_live, &latest), 0);
    ck_assert_int_eq(n, 2);
    ck_assert_int_eq(n_live, 0);
    ck_assert_int_eq(latest, 0);
    c = claims_of(s, own);
    ck_assert_int_eq(c.mine, 0);
    ck_assert_int_eq(c.all, 1);
    /* no claim of the owner: nothing to do */
    ck_assert_int_eq(kvm_store_claim_release_lapsed(s, own, 0, &n, NULL, NULL), 0);
    ck_assert_int_eq(n, 0);
    kvm_store_close(&s);
}
END_TEST

/* `store claims --release` printed the owner raw in its refusal, "no claim of" and "released"
 * lines (an ESC sequence drove the terminal, a line break forged a line), though the listing
 * escapes it: each line now shows it as the listing does (\xNN). */
START_TEST(test_store_claims_release_escaped)
{
    kvm_store *s = open_store_nosync();
    kvm_store_cache_key k;
    memset(&k, 0x31, sizeof k);
    int taken = 0;
    const char *own = "run:e\033[2J\nforged:1:1";
    ck_assert_int_eq(kvm_store_claim_take(s, &k, own, "h", 3600000, &taken, NULL), 0);
    ck_assert_int_eq(taken, 1);
    kvm_store_close(&s);
    const char *arg = "\"$(printf 'run:e\\033[2J\\nforged:1:1')\"", *esc = "run:e\\x1b[2J\\x0aforged:1:1";
    char *out = NULL, *err = NULL;
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release %s", g_store, arg), 1);
    ck_assert_msg(strstr(err, esc) && strstr(err, " holds 1 live claim(s)") && !strchr(err, '\033') && one_line(err),
                  "%s", err);
    free(out), free(err);
    ck_assert_msg(kvmill(&out, &err, "store claims --store '%s' --release %s --force", g_store, arg) == 0, "%s%s", out,
                  err);
    ck_assert_msg(strstr(out, "released 1 claim(s) of ") && strstr(out, esc) && !strchr(out, '\033') && one_line(out),
                  "%s", out);
    free(out), free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release %s", g_store, arg), 1);
    ck_assert_msg(strstr(err, "no claim of ") && strstr(err, esc) && !strchr(err, '\033') && one_line(err), "%s", err);
    free(out), free(err);
}
END_TEST

/* `store claims --release x --owner y` ignored --owner (and --csv): it released x's claims, or
 * said "no claim of x". Options of the listing are refused with --release (exit 2, named), as
 * --force is without it, and nothing is released. */
START_TEST(test_store_claims_release_listing_opts)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    kvm_store_cache_key k;
    memset(&k, 0x41, sizeof k);
    int taken = 0;
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:x:1:1", "h", 1, &taken, NULL), 0); /* lapsed: releasable */
    kvm_store_close(&s);
    usleep(20000);
    char *out = NULL, *err = NULL;
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release run:x:1:1 --owner run:y:2:2", g_store), 2);
    ck_assert_msg(strstr(err, "--owner does not go with --release OWNER"), "%s", err);
    free(out), free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store claims --store '%s' --release run:x:1:1 --csv", g_store), 2);
    ck_assert_msg(strstr(err, "--csv does not go with --release OWNER"), "%s", err);
    free(out), free(err);
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    ck_assert_int_eq(claims_of(s, "run:x:1:1").mine, 1); /* nothing released */
    kvm_store_close(&s);
    ck_assert_msg(kvmill(&out, &err, "store claims --store '%s' --release run:x:1:1", g_store) == 0, "%s%s", out, err);
    ck_assert_msg(strstr(out, "released 1 claim(s) of run:x:1:1"), "%s", out);
    free(out), free(err);
}
END_TEST

/* ---- pipeline runs (the embedded model and corpus) ---- */

static void copy_docs(int n)
{
    ck_assert_int_eq(mkdir(g_docs, 0700), 0);
    for (int i = 0; i < n; i++) {
        char src[64], dst[4400];
        snprintf(src, sizeof src, "corpus/doc_%03d.txt", i); /* = ../shared/data/long's */
        snprintf(dst, sizeof dst, "%s/doc_%03d.txt", g_docs, i);
        size_t len;
        char *t = kvm_test_read_file(kvm_test_data_path(src), &len);
        ck_assert_ptr_nonnull(t);
        ck_assert_int_eq(kvm_test_write_file(dst, t, len), 0);
        free(t);
    }
}

/* A pipeline config over g_store with extra lines appended (no key of the base repeated);
 * a worker is declared dead after 5 s of silence, so a loaded machine does not fail jobs. */
static void write_run_config(const char *compress, const char *extra)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\n%s\n[store]\npath = %s\n[run]\nheartbeat_ms = 100\n"
             "liveness = 50\n[stages]\nbin_dir = %s\n%s",
             kvm_test_data_path("models/stories260K.bin"), compress, g_store, kvm_test_bin(), extra ? extra : "");
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
}

static int run_corpus(char **out, char **err)
{
    return kvmill(out, err, "run --config '%s' --corpus '%s'", g_cfg, g_docs);
}

/* n: the summary's `name=` value, or -1. */
static long long summary_field(const char *out, const char *name)
{
    const char *p = out ? strstr(out, "summary: ") : NULL;
    char key[64];
    snprintf(key, sizeof key, " %s=", name);
    const char *q = p ? strstr(p, key) : NULL;
    return q ? strtoll(q + strlen(key), NULL, 10) : -1;
}

static int count_state(const char *state)
{
    char *out = NULL;
    ck_assert_int_eq(kvmill(&out, NULL, "store ls --csv --config '%s'", g_cfg), 0);
    char want[64];
    snprintf(want, sizeof want, ",%s\n", state);
    int n = 0;
    for (char *p = strstr(out, want); p; p = strstr(p + 1, want)) n++;
    free(out);
    return n;
}

/* A uniform PolyKV strategy for stories260K (5 layers) with pattern p everywhere. */
static void put_strategy(kvm_pattern p)
{
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_store, NULL, &s), 0);
    kvm_store_id mid;
    ck_assert_int_eq(kvm_store_model_id(s, kvm_test_data_path("models/stories260K.bin"), &mid), 0);
    kvm_strategy *st = NULL;
    ck_assert_int_eq(kvm_strategy_new(5, &st), 0);
    st->budget_avg = 32;
    st->b_min = 8;
    for (int l = 0; l < 5; l++) st->layers[l] = (kvm_strategy_layer){.pattern = {p, p}, .budget = 32};
    uint8_t *buf = NULL;
    size_t len = 0;
    ck_assert_msg(kvm_strategy_encode(st, &buf, &len) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_put_strategy(s, &mid, "default", buf, len), 0);
    free(buf);
    kvm_strategy_free(&st);
    kvm_store_close(&s);
}


/* Starts `kvmill serve --config g_cfg` on ipc://g_dir/front; returns its pid once ready. */
static pid_t serve_start(char *front, size_t n)
{
    char log[4300];
    snprintf(front, n, "ipc://%s/front", g_dir);
    snprintf(log, sizeof log, "%s/serve.log", g_dir);
    const char *args[] = {"--config", g_cfg, "--bind", front, NULL};
    pid_t pid = 0;
    ck_assert_msg(kvm_test_serve_start(args, log, 20, &pid) == -1, "kvmill serve exited early");
    return pid;
}

static int serve_ask(const char *front, const char *doc, char **err)
{
    char *out = NULL;
    int rc = kvmill(&out, err, "ask --connect '%s' --doc '%s' --prompt 'Then the' -n 4 --timeout 20", front, doc);
    free(out);
    return rc;
}

START_TEST(test_recalibration_invalidates)
{
    if (skip_without_shared("recalibration_invalidates")) return;
    copy_docs(5);
    write_run_config("method = polykv\nbudget = 32", NULL);
    put_strategy(KVM_PATTERN_SNAPKV);
    char *out = NULL, *err = NULL;
    int rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "compressed") == 5, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    ck_assert_int_eq(count_state("ok"), 5);
    char front[4300], doc[4400];
    snprintf(doc, sizeof doc, "%s/doc_000.txt", g_docs);
    pid_t srv = serve_start(front, sizeof front);
    rc = serve_ask(front, doc, &err);
    ck_assert_msg(rc == 0, "ask before recalibration: exit %d: %s", rc, err);
    free(err);
    /* recalibrated: another strategy under the same name */
    put_strategy(KVM_PATTERN_H2O);
    ck_assert_int_eq(count_state("stale-strategy"), 5);
    ck_assert_int_eq(count_state("ok"), 0);
    /* the running server no longer answers from a cache made with the old strategy */
    rc = serve_ask(front, doc, &err);
    ck_assert_msg(rc == 1 && strstr(err, "no compressed cache"), "ask after recalibration: exit %d: %s", rc, err);
    free(err);
    kill(srv, SIGTERM);
    waitpid(srv, NULL, 0);
    rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "compressed") == 5 && summary_field(out, "skipped") == 0,
                  "a rerun after recalibration must compress again: exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    ck_assert_int_eq(count_state("ok"), 5);
    ck_assert_int_eq(count_state("stale-strategy"), 5);
    /* the manifest records the strategy's hash */
    ck_assert_int_eq(kvmill(&out, &err, "store ls --csv --config '%s'", g_cfg), 0);
    char *ok = strstr(out, ",ok\n");
    ck_assert_ptr_nonnull(ok);
    char *line = ok;
    while (line > out && line[-1] != '\n') line--;
    char key[200];
    snprintf(key, sizeof key, "%.12s:%.12s:%.12s", line, line + 65, line + 130);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store show --config '%s' %s", g_cfg, key), 0);
    ck_assert_msg(strstr(out, "strategy_hash "), "%s", out);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store rm --stale --config '%s'", g_cfg), 0);
    ck_assert_msg(strstr(out, "5 stale cache(s) removed"), "%s", out);
    free(out);
    free(err);
    ck_assert_int_eq(count_state("stale-strategy"), 0);
    ck_assert_int_eq(count_state("ok"), 5);
    ck_assert_int_eq(kvmill(&out, &err, "store verify --config '%s'", g_cfg), 0);
    free(out);
    free(err);
    rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "skipped") == 5, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
}
END_TEST


typedef struct retag_ctx {
    kvm_store_cache_key keys[16]; /* caches found */
    int n;
} retag_ctx;

static int collect_keys(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    retag_ctx *c = arg;
    if (c->n < 16) c->keys[c->n++] = *k;
    return 0;
}

/* A stored cache made from another tokenizer's ids is not "already stored". */
START_TEST(test_other_tokenizer_recompressed)
{
    if (skip_without_shared("other_tokenizer_recompressed")) return;
    copy_docs(3);
    write_run_config("method = h2o\nbudget = 32", NULL);
    char *out = NULL, *err = NULL;
    int rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "compressed") == 3, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    /* the same caches, recorded as made with another tokenizer */
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_store, NULL, &s), 0);
    retag_ctx c = {.n = 0};
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, collect_keys, &c), 0);
    ck_assert_int_eq(c.n, 3);
    for (int i = 0; i < c.n; i++) {
        kvm_store_cache *cc = NULL;
        ck_assert_int_eq(kvm_store_get_cache(s, &c.keys[i], NULL, &cc), 0);
        kvm_store_hash_bytes("another tokenizer", 17, &cc->manifest.tokenizer_id);
        ck_assert_int_eq(kvm_store_put_cache(s, &cc->manifest, cc->layers), 0);
        kvm_store_cache_free(&cc);
    }
    kvm_store_close(&s);
    rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "compressed") == 3 && summary_field(out, "skipped") == 0,
                  "exit %d\n%s\n%s", rc, out, err);
    ck_assert_msg(strstr(err, "built with tokenizer"), "%s", err);
    free(out);
    free(err);
    rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "skipped") == 3, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
}
END_TEST

/* A document whose cache was stored without a name (kvmill serve --compute-missing stores the
 * cache alone) kept none: a run over the corpus skipped it as stored and recorded nothing, so
 * `store ls --names` said "-" and ask --doc-name did not find it. The run now records the
 * corpus name of a skipped document the store has no name for. */
START_TEST(test_skip_records_name)
{
    if (skip_without_shared("skip_records_name")) return;
    copy_docs(3);
    write_run_config("method = h2o\nbudget = 32", NULL);
    char *out = NULL, *err = NULL;
    int rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "compressed") == 3, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    /* the same caches, moved into a fresh store without their docs records */
    char orig[4300];
    snprintf(orig, sizeof orig, "%s.orig", g_store);
    ck_assert_int_eq(rename(g_store, orig), 0);
    kvm_store *from = NULL, *to = NULL;
    ck_assert_int_eq(kvm_store_open(orig, NULL, &from), 0);
    ck_assert_int_eq(kvm_store_open(g_store, NULL, &to), 0);
    retag_ctx c = {.n = 0};
    ck_assert_int_eq(kvm_store_list_caches(from, NULL, collect_keys, &c), 0);
    ck_assert_int_eq(c.n, 3);
    for (int i = 0; i < c.n; i++) {
        kvm_store_cache *cc = NULL;
        ck_assert_int_eq(kvm_store_get_cache(from, &c.keys[i], NULL, &cc), 0);
        ck_assert_int_eq(kvm_store_put_cache(to, &cc->manifest, cc->layers), 0);
        kvm_store_cache_free(&cc);
    }
    kvm_store_close(&from);
    kvm_store_doc_match *m = NULL;
    int64_t n = -1;
    ck_assert_int_eq(kvm_store_find_docs(to, "doc_001.txt", 11, &m, &n, NULL), 0);
    ck_assert_int_eq(n, 0); /* no name yet */
    kvm_store_close(&to);
    rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "skipped") == 3, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store ls --names --config '%s'", g_cfg), 0);
    for (int i = 0; i < 3; i++) {
        char name[32];
        snprintf(name, sizeof name, "doc_%03d.txt", i);
        ck_assert_msg(strstr(out, name), "%s not listed:\n%s", name, out);
    }
    free(out);
    free(err);
    kvm_store_opts ro = {.read_only = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &ro, &to), 0);
    ck_assert_int_eq(kvm_store_find_docs(to, "doc_001.txt", 11, &m, &n, NULL), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_str_eq(m[0].meta.source, "doc_001.txt");
    ck_assert_int_gt(m[0].meta.n_tokens, 0);
    free(m);
    kvm_store_close(&to);
}
END_TEST

/* `store rm --stale` removed stale-* caches only: other-config ones (an old model's, old
 * [compress] settings') piled up, removable one key at a time. --other-config --config F removes
 * them, and keeps F's own caches; --stale alone still leaves them. */
START_TEST(test_rm_other_config)
{
    if (skip_without_shared("rm_other_config")) return;
    copy_docs(3);
    write_run_config("method = h2o\nbudget = 32", NULL);
    char *out = NULL, *err = NULL;
    int rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "compressed") == 3, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    put_caches(g_store, 2, 2000);                        /* another model's */
    write_run_config("method = h2o\nbudget = 16", NULL); /* the budget-32 caches are other settings now */
    rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 0 && summary_field(out, "compressed") == 3, "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    ck_assert_int_eq(count_state("other-config"), 5);
    ck_assert_int_eq(kvmill(&out, &err, "store rm --stale --config '%s'", g_cfg), 0);
    ck_assert_msg(strstr(out, "0 stale cache(s) removed"), "%s", out);
    free(out);
    free(err);
    ck_assert_int_eq(count_state("other-config"), 5);
    rc = kvmill(&out, &err, "store rm --other-config --config '%s'", g_cfg);
    ck_assert_msg(rc == 0 && strstr(out, "5 other-config cache(s) removed"), "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    ck_assert_int_eq(count_state("other-config"), 0);
    ck_assert_int_eq(count_state("ok"), 3);
    /* it needs the config it compares with, as --stale does */
    rc = kvmill(&out, &err, "store rm --other-config --store '%s'", g_store);
    ck_assert_msg(rc == 2 && strstr(err, "--other-config with --config FILE"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "store verify --config '%s'", g_cfg), 0);
    free(out);
    free(err);
}
END_TEST

/* [store] map_max_mb reaches the compress workers (they open the store with the job's
 * settings): 5 full caches of 640 KiB do not fit in a 2 MiB map. A full map takes no later
 * cache either: the run stops feeding documents and says so (it retried each one, which could
 * only fail again, and called them failed). */
START_TEST(test_store_opts_in_worker)
{
    if (skip_without_shared("store_opts_in_worker")) return;
    copy_docs(5);
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 512\n[compress]\nmethod = full\n[store]\npath = %s\nmap_size_mb = 1\n"
             "map_max_mb = 2\n[run]\nmax_retries = 0\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), g_store, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    char *out = NULL, *err = NULL;
    int rc = run_corpus(&out, &err);
    ck_assert_msg(rc == 1 && summary_field(out, "failed") == 0 && summary_field(out, "compressed") >= 1,
                  "exit %d\n%s\n%s", rc, out, err);
    ck_assert_msg(strstr(err, "map_max_bytes 2097152") && strstr(err, "the store's map is full at [store] map_max_mb"),
                  "%s", err);
    ck_assert_msg(strstr(out, "not processed (the store's map reached [store] map_max_mb"), "%s", out);
    ck_assert_msg(!strstr(err, "requeueing"), "%s", err);
    free(out);
    free(err);
    kvm_store *s = NULL;
    kvm_store_opts o = {.read_only = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    kvm_store_stats t;
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    ck_assert_msg(t.map_size_bytes <= (2 << 20), "map grew to %lld bytes", (long long)t.map_size_bytes);
    kvm_store_close(&s);
}
END_TEST

/* A run under a file size limit (ulimit -f) that data.mdb reaches: the write crossing it is cut
 * short, which LMDB reports as EIO, and the run said "commit: Input/output error" (a failing
 * disk, to a reader) and retried each document. It names the limit now, and feeds no more. */
START_TEST(test_run_file_size_limit)
{
    copy_docs(3);
    write_run_config("method = streaming\nbudget = 64", NULL);
    char cmd[16384], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "ulimit -f 200; '%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), g_cfg,
             g_docs);
    const int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 1, "exit %d: %s", rc, err);
    ck_assert_msg(strstr(err, "the file size limit (ulimit -f, RLIMIT_FSIZE) of ") &&
                      strstr(err, "KiB stops data.mdb (") && strstr(err, "feeding no more documents") &&
                      !strstr(err, "Input/output error"),
                  "%s", err);
    ck_assert_msg(strstr(out, "the file size limit (ulimit -f) stops data.mdb from growing; raise it"), "%s", out);
    free(out);
    free(err);
}
END_TEST

/* The store folder moved away while a run has it open (rm -rf, a swap): the run committed into
 * the unlinked files and reported every document stored, exit 0, with nothing on disk after.
 * Now it says the store is gone, feeds no more documents and counts them not processed
 * ("store gone:"), exit 1. The run and its workers are stopped (SIGSTOP) once it has opened
 * the store, while the folder is moved (a document fed before may be stored in it). */
START_TEST(test_run_store_moved_away)
{
    copy_docs(3);
    write_run_config("method = streaming\nbudget = 64", NULL);
    char outp[4300], errp[4300], away[4300], exe[4300];
    snprintf(outp, sizeof outp, "%s/run.out", g_dir);
    snprintf(errp, sizeof errp, "%s/run.err", g_dir);
    snprintf(away, sizeof away, "%s/away.lmdb", g_dir);
    snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
    kvm_test_store_create(g_store);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (!freopen(outp, "w", stdout) || !freopen(errp, "w", stderr) || setpgid(0, 0)) _exit(126);
        raise(SIGSTOP); /* the test stops it before its first look at the store */
        execl(exe, exe, "run", "--config", g_cfg, "--corpus", g_docs, (char *)NULL);
        _exit(127);
    }
    int st = 0;
    ck_assert_int_eq(waitpid(pid, &st, WUNTRACED), pid);
    ck_assert(WIFSTOPPED(st));
    ck_assert_int_eq(kill(pid, SIGCONT), 0);
    /* its first line names the documents once the store is open and scanned */
    ck_assert_msg(kvm_test_wait_text(errp, "documents (0 already stored)", 1, 60), "the run did not start");
    ck_assert_int_eq(kill(-pid, SIGSTOP), 0); /* the run and its workers: a job fed before runs on */
    ck_assert_int_eq(rename(g_store, away), 0);
    ck_assert_int_eq(kill(-pid, SIGCONT), 0);
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    char *out = kvm_test_read_file(outp, NULL), *err = kvm_test_read_file(errp, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status 0x%x\n%s\n%s", st, out, err);
    ck_assert_msg(strstr(out, "store gone: ") && summary_field(out, "compressed") < 3, "%s\n%s", out, err);
    ck_assert_msg(summary_field(out, "not_processed") == atoll(strstr(out, "store gone: ") + strlen("store gone: ")),
                  "the summary's not_processed is not the store gone line's count: %s", out);
    ck_assert_msg(strstr(err, "is gone since this process opened it") && strstr(err, "feeding no more documents"), "%s",
                  err);
    free(out);
    free(err);
    struct stat sb;
    ck_assert_msg(stat(g_store, &sb) != 0, "a store was made again at %s", g_store);
}
END_TEST

/* Two `kvmill run` at once on one store: each document is compressed once. */
START_TEST(test_two_runs_share)
{
    if (skip_without_shared("two_runs_share")) return;
    copy_docs(5);
    write_run_config("method = sculpt\nsynthetic_queries = 64\niterations = 40\nrounds = 2", NULL);
    pid_t pid[2];
    char outp[2][4300], errp[2][4300];
    for (int r = 0; r < 2; r++) {
        snprintf(outp[r], sizeof outp[r], "%s/run%d.out", g_dir, r);
        snprintf(errp[r], sizeof errp[r], "%s/run%d.err", g_dir, r);
        if ((pid[r] = fork()) == 0) {
            freopen(outp[r], "w", stdout);
            freopen(errp[r], "w", stderr);
            char exe[4200];
            snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
            execl(exe, exe, "run", "--config", g_cfg, "--corpus", g_docs, (char *)NULL);
            _exit(127);
        }
    }
    long long compressed = 0, claimed = 0;
    for (int r = 0; r < 2; r++) {
        int st;
        ck_assert_int_eq(waitpid(pid[r], &st, 0), pid[r]);
        char *out = kvm_test_read_file(outp[r], NULL), *err = kvm_test_read_file(errp[r], NULL);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "run %d: status %d\n%s", r, st, err);
        long long c = summary_field(out, "compressed"), k = summary_field(out, "claimed");
        long long sk = summary_field(out, "skipped"), f = summary_field(out, "failed");
        ck_assert_msg(c >= 0 && k >= 0 && f == 0 && c + k + sk == 5, "run %d:\n%s\n%s", r, out, err);
        compressed += c;
        claimed += k;
        free(out);
        free(err);
    }
    ck_assert_msg(compressed == 5, "%lld compressions for 5 documents (%lld claimed)", compressed, claimed);
    ck_assert_int_eq(count_state("ok"), 5);
    char *out = NULL;
    ck_assert_int_eq(kvmill(&out, NULL, "store verify --config '%s'", g_cfg), 0);
    free(out);
}
END_TEST

/* LMDB's reader table full (MDB_READERS_FULL: as many read transactions open at once, all
 * processes together, as lock.mdb has slots) was KVM_EFULL, so a run failed the document as
 * for a full disk. It is KVM_EBUSY now, retryable, its message naming the reader table and its
 * size; the read works once a slot frees, and slots of a process that died reading are taken
 * back at once (mdb_reader_check), not only at the next open. A full map stays KVM_EFULL. */
START_TEST(test_readers_full_retryable)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1, .max_readers = 2};
    ck_assert_msg(kvm_store_open(g_store, &o, &s) == 0, "%s", kvm_errmsg());
    kvm_store_id mid = {{1}};
    kvm_store_model_meta mm;
    ck_assert_int_eq(kvm_store_get_model(s, &mid, &mm), KVM_ENOTFOUND);
    int release;
    pid_t pid = kvm_test_readers_hold(g_store, 2, &release);
    int rc = kvm_store_get_model(s, &mid, &mm);
    ck_assert_msg(rc == KVM_EBUSY, "status %d (%s): %s", rc, kvm_strerror(rc), kvm_errmsg());
    ck_assert_msg(strstr(kvm_errmsg(), "reader table is full (2 slots") && strstr(kvm_errmsg(), g_store), "%s",
                  kvm_errmsg());
    ck_assert(kvm_err_retryable(rc));
    kvm_test_readers_release(pid, release);
    ck_assert_msg(kvm_store_get_model(s, &mid, &mm) == KVM_ENOTFOUND, "%s", kvm_errmsg());
    /* a reader killed while it held the slots: they are taken back by the next read */
    pid = kvm_test_readers_hold(g_store, 2, &release);
    kill(pid, SIGKILL);
    kvm_test_readers_release(pid, release);
    ck_assert_msg(kvm_store_get_model(s, &mid, &mm) == KVM_ENOTFOUND, "%s", kvm_errmsg());
    kvm_store_close(&s);
    ck_assert(!kvm_err_retryable(KVM_EFULL)); /* a full map or disk: the same write fails again */
}
END_TEST

/* A document stored as "x" could not be found by "x" when another stored name ended in "/x"
 * (JSONL ids x and ../../etc/x): both matched, and kvmill ask --doc-name x said the name
 * matches 2 stored documents. A stored source equal to the name wins; the "/" + name rule
 * applies only when no source is the name (through the index and through a scan alike). */
START_TEST(test_doc_name_exact_wins)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_msg(kvm_store_open(g_store, &o, &s) == 0, "%s", kvm_errmsg());
    const char *names[3] = {"../../etc/x", "x", "a/y"};
    kvm_store_id h[3];
    for (int i = 0; i < 3; i++) {
        int32_t toks[2] = {i, 9};
        ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &h[i]), 0);
        kvm_store_doc_meta dm = {.n_tokens = 10 + i};
        snprintf(dm.source, sizeof dm.source, "%s", names[i]);
        ck_assert_msg(kvm_store_put_doc(s, &h[i], &dm) == 0, "%s", kvm_errmsg());
    }
    for (int pass = 0; pass < 2; pass++) {
        kvm_store_doc_match *m = NULL;
        int64_t n = -1;
        int scanned = -1;
        ck_assert_msg(kvm_store_find_docs(s, "x", 1, &m, &n, &scanned) == 0, "%s", kvm_errmsg());
        ck_assert_int_eq(scanned, pass);
        ck_assert_msg(n == 1 && !memcmp(m[0].doc_hash.b, h[1].b, KVM_STORE_ID_BYTES) && !strcmp(m[0].meta.source, "x"),
                      "pass %d: %lld matches for x, the first %s", pass, (long long)n, n > 0 ? m[0].meta.source : "-");
        free(m);
        /* no stored source is "y": the suffix rule finds a/y */
        ck_assert_int_eq(kvm_store_find_docs(s, "y", 1, &m, &n, NULL), 0);
        ck_assert_msg(n == 1 && !strcmp(m[0].meta.source, "a/y"), "%lld matches for y", (long long)n);
        free(m);
        ck_assert_int_eq(kvm_store_find_docs(s, "etc/x", 5, &m, &n, NULL), 0);
        ck_assert_msg(n == 1 && !strcmp(m[0].meta.source, "../../etc/x"), "%lld matches for etc/x", (long long)n);
        free(m);
        if (pass == 0) { /* again as a store an older build wrote: no name index, every record read */
            kvm_store_close(&s);
            MDB_env *env;
            MDB_txn *txn;
            MDB_dbi dbi;
            ck_assert_int_eq(mdb_env_create(&env), 0);
            mdb_env_set_maxdbs(env, 32);
            ck_assert_int_eq(mdb_env_open(env, g_store, 0, 0664), 0);
            ck_assert_int_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
            ck_assert_int_eq(mdb_dbi_open(txn, "docnames", 0, &dbi), 0);
            ck_assert_int_eq(mdb_drop(txn, dbi, 1), 0);
            ck_assert_int_eq(mdb_txn_commit(txn), 0);
            mdb_env_close(env);
            kvm_store_opts ro = {.read_only = 1};
            ck_assert_msg(kvm_store_open(g_store, &ro, &s) == 0, "%s", kvm_errmsg());
        }
    }
    kvm_store_close(&s);
}
END_TEST

/* A hand-started worker's --config set the store's cap: kvmill-compress --store S --config X with
 * [store] cap_mb = 1 in X (a config of another store) rewrote S's cap_bytes, and the next put
 * evicted the caches of other runs. A stage worker keeps the store's recorded cap now (the cap
 * belongs to its owner: run, calibrate, serve, store rm and claims --release) and says that its
 * own is not applied; the owner's open still records it. */
START_TEST(test_worker_keeps_store_cap)
{
    if (skip_without_shared("worker_keeps_store_cap")) return;
    put_caches(g_store, 16, 100000); /* 16 caches of some 150 KB: over a 1 MiB cap */
    char text[8192], run_dir[4300], err_path[4300];
    snprintf(text, sizeof text, "[model]\npath = %s\n[store]\npath = %s/other.lmdb\ncap_mb = 1\n",
             kvm_test_data_path("models/stories260K.bin"), g_dir);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    snprintf(run_dir, sizeof run_dir, "%s/rd", g_dir);
    ck_assert_int_eq(mkdir(run_dir, 0700), 0);
    snprintf(err_path, sizeof err_path, "%s/compress.err", g_dir);
    char exe[4200], conn[4400];
    snprintf(exe, sizeof exe, "%s/kvmill-compress", kvm_test_bin());
    snprintf(conn, sizeof conn, "ipc://%s", run_dir);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "r", stdin) || !freopen("/dev/null", "w", stdout) || !freopen(err_path, "w", stderr))
            _exit(126);
        execl(exe, exe, "--connect", conn, "--store", g_store, "--config", g_cfg, "--heartbeat-ms", "100",
              (char *)NULL);
        _exit(127);
    }
    ck_assert_int_gt(pid, 0);
    /* the store is opened at setup, before the worker connects: wait for its word, or its end */
    char *err = NULL;
    int ended = 0;
    for (int i = 0; i < 300 && !ended; i++, usleep(100000)) {
        free(err);
        err = kvm_test_read_file(err_path, NULL);
        if (err && strstr(err, "is not applied")) break;
        ended = waitpid(pid, NULL, WNOHANG) == pid;
    }
    if (!ended) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    kvm_store *s = NULL;
    kvm_store_opts ro = {.read_only = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &ro, &s), 0);
    kvm_store_stats t;
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    kvm_store_close(&s);
    ck_assert_msg(t.cap_bytes == 0, "the worker's --config set the store's cap to %lld bytes\n%s",
                  (long long)t.cap_bytes, err ? err : "");
    ck_assert_int_eq(t.n_caches, 16);
    ck_assert_msg(err && strstr(err, "[store] cap_mb = 1 of this worker's settings is not applied") &&
                      strstr(err, "keeps its cap (none)"),
                  "%s", err ? err : "(no stderr)");
    free(err);
    /* the owner's open (kvmill store commands, run, serve: kvm_storew_open) records it */
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse(text, "cap.ini", &c), 0);
    ck_assert_msg(kvm_storew_open(c, g_store, 0, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    ck_assert_int_eq(t.cap_bytes, 1 << 20);
    kvm_store_close(&s);
    kvm_config_free(&c);
}
END_TEST

/* README and `store stats --help` said the store commands record their config's cap and stats
 * shows usage against it, but stats, ls and verify open the store read-only (a store on a
 * read-only mount stays readable) and recorded nothing: `store stats --config` with [store]
 * cap_mb = 1 said "cap_bytes none" only. It keeps that line and shows the config's cap on a line
 * of its own, saying it is not recorded and what records it; a writing open then records it. */
START_TEST(test_stats_shows_config_cap)
{
    if (skip_without_shared("stats_shows_config_cap")) return;
    put_caches(g_store, 2, 1000);
    char text[8192], *out = NULL, *err = NULL;
    snprintf(text, sizeof text, "[model]\npath = %s\n[store]\npath = %s\ncap_mb = 1\n",
             kvm_test_data_path("models/stories260K.bin"), g_store);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    ck_assert_int_eq(kvmill(NULL, NULL, "store ls --config '%s'", g_cfg), 0);
    ck_assert_int_eq(kvmill(NULL, NULL, "store verify --config '%s'", g_cfg), 0);
    int rc = kvmill(&out, &err, "store stats --config '%s'", g_cfg);
    ck_assert_msg(rc == 0, "stats: exit %d: %s", rc, err);
    ck_assert_msg(strstr(out, "\ncap_bytes       none\n"), "the recorded cap's line changed: %s", out);
    ck_assert_msg(strstr(out, "\nconfig_cap_bytes 1048576 (") && strstr(out, "cap_mb = 1 of ") &&
                      strstr(out, "not recorded in this store") && strstr(out, "store rm"),
                  "stats does not show the config's cap: %s", out);
    free(out);
    free(err);
    kvm_store *s = NULL;
    kvm_store_opts ro = {.read_only = 1};
    kvm_store_stats t;
    ck_assert_int_eq(kvm_store_open(g_store, &ro, &s), 0);
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    kvm_store_close(&s);
    ck_assert_int_eq(t.cap_bytes, 0); /* the read-only commands wrote nothing */
    /* a writing open records it: the recorded line shows it, the config's line is gone */
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse(text, "cap.ini", &c), 0);
    ck_assert_msg(kvm_storew_open(c, g_store, 0, &s) == 0, "%s", kvm_errmsg());
    kvm_store_close(&s);
    kvm_config_free(&c);
    ck_assert_int_eq(kvmill(&out, NULL, "store stats --config '%s'", g_cfg), 0);
    ck_assert_msg(strstr(out, "\ncap_bytes       1048576 (") && !strstr(out, "config_cap_bytes"), "%s", out);
    free(out);
    ck_assert_int_eq(kvmill(&out, NULL, "store stats --store '%s'", g_store), 0); /* no --config: no such line */
    ck_assert_msg(!strstr(out, "config_cap_bytes"), "%s", out);
    free(out);
}
END_TEST

static TCase *tcase(const char *name, const TTest *fn, int timeout_s)
{
    TCase *tc = tcase_create(name);
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, timeout_s);
    tcase_add_test(tc, fn);
    return tc;
}

int main(void)
{
    if (sodium_init() < 0) return 1;
    Suite *su = suite_create("store_reliab");
    suite_add_tcase(su, tcase("truncated_data_file", test_truncated_data_file, 120));
    suite_add_tcase(su, tcase("data_file_not_regular", test_data_file_not_regular, 60));
    suite_add_tcase(su, tcase("zero_byte_data_file_at_once", test_zero_byte_data_file_at_once, 60));
    suite_add_tcase(su, tcase("truncated_run", test_truncated_run, 120));
    suite_add_tcase(su, tcase("store_cli_missing_and_config", test_store_cli_missing_and_config, 60));
    suite_add_tcase(su, tcase("store_cli_readonly_lock", test_store_cli_readonly_lock, 60));
    suite_add_tcase(su, tcase("verify_meta_page_damage", test_verify_meta_page_damage, 60));
    suite_add_tcase(su, tcase("meta_version_damage", test_meta_version_damage, 60));
    suite_add_tcase(su, tcase("meta_version_zero", test_meta_version_zero, 60));
    suite_add_tcase(su, tcase("verify_layer_decode", test_verify_layer_decode, 60));
    suite_add_tcase(su, tcase("verify_layer_count", test_verify_layer_count, 60));
    suite_add_tcase(su, tcase("config_duplicate_and_empty", test_config_duplicate_and_empty, 60));
    suite_add_tcase(su, tcase("budget_retain_vs_context", test_budget_retain_vs_context, 60));
    suite_add_tcase(su, tcase("config_id_covers", test_config_id_covers, 30));
    suite_add_tcase(su, tcase("store_cli_file_of_store", test_store_cli_file_of_store, 60));
    suite_add_tcase(su, tcase("compact", test_compact, 60));
    suite_add_tcase(su, tcase("compact_swap_as_printed", test_compact_swap_as_printed, 60));
    suite_add_tcase(su, tcase("meta_version_newer", test_meta_version_newer, 60));
    suite_add_tcase(su, tcase("store_dangling_link", test_store_dangling_link, 60));
    suite_add_tcase(su, tcase("compact_symlinked_store", test_compact_symlinked_store, 60));
    suite_add_tcase(su, tcase("compact_killed_midway", test_compact_killed_midway, 60));
    suite_add_tcase(su, tcase("compact_long_out_name", test_compact_long_out_name, 60));
    suite_add_tcase(su, tcase("compact_concurrent_same_out", test_compact_concurrent_same_out, 60));
    suite_add_tcase(su, tcase("store_gone_under_handle", test_store_gone_under_handle, 60));
    suite_add_tcase(su, tcase("run_file_size_limit", test_run_file_size_limit, 60));
    suite_add_tcase(su, tcase("run_store_moved_away", test_run_store_moved_away, 60));
    suite_add_tcase(su, tcase("compact_parent_lock_inherited", test_compact_parent_lock_inherited, 60));
    suite_add_tcase(su, tcase("compact_out_created_meanwhile", test_compact_out_created_meanwhile, 60));
    suite_add_tcase(su, tcase("skip_records_name", test_skip_records_name, 120));
    suite_add_tcase(su, tcase("rm_other_config", test_rm_other_config, 120));
    suite_add_tcase(su, tcase("claim_lease", test_claim_lease, 30));
    suite_add_tcase(su, tcase("claim_lease_capped", test_claim_lease_capped, 30));
    suite_add_tcase(su, tcase("store_claims_cli", test_store_claims_cli, 60));
    suite_add_tcase(su, tcase("claim_release_lapsed_in_txn", test_claim_release_lapsed_in_txn, 30));
    suite_add_tcase(su, tcase("store_claims_release_escaped", test_store_claims_release_escaped, 60));
    suite_add_tcase(su, tcase("store_claims_release_listing_opts", test_store_claims_release_listing_opts, 60));
    suite_add_tcase(su, tcase("readers_full_retryable", test_readers_full_retryable, 30));
    suite_add_tcase(su, tcase("doc_name_exact_wins", test_doc_name_exact_wins, 30));
    suite_add_tcase(su, tcase("worker_keeps_store_cap", test_worker_keeps_store_cap, 60));
    suite_add_tcase(su, tcase("stats_shows_config_cap", test_stats_shows_config_cap, 60));
    suite_add_tcase(su, tcase("recalibration_invalidates", test_recalibration_invalidates, 240));
    suite_add_tcase(su, tcase("other_tokenizer_recompressed", test_other_tokenizer_recompressed, 240));
    suite_add_tcase(su, tcase("store_opts_in_worker", test_store_opts_in_worker, 240));
    suite_add_tcase(su, tcase("two_runs_share", test_two_runs_share, 300));
    SRunner *sr = srunner_create(su);
    srunner_set_fork_status(sr, CK_FORK);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
