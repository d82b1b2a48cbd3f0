/* check_store_pages.c: the store on a data.mdb with damaged B-tree pages (store/kvm_store_tree.c).
 * LMDB keeps no page checksums: one flipped byte in a page header or node made the old code die
 * inside LMDB (SIGSEGV in mdb_cursor_del and mdb_get, SIGBUS, LMDB's assert) or loop, on open,
 * get, listing, rm and put. Each damage here is one that crashed it; now every open and every
 * operation of a handle opened before the damage returns KVM_ECORRUPT naming the store and the
 * page, in a process that lives, and the undamaged store works for every operation. */
#include <check.h>
#include <fcntl.h>
#include <lmdb.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

#define N_CACHES 24 /* caches in the fixture store (those % 4 == 0 on overflow pages) */
#define N_REMOVED 4 /* caches [16, 20) removed again: the free db gets page lists */
#define N_LAYERS 3  /* layers per cache */

static char *g_dir;       /* this test's temporary directory */
static char g_orig[4200]; /* the undamaged fixture store */
static char g_work[4200]; /* a damaged copy */

/* ---- the fixture store ---- */

/* One deterministic cache: i picks the model (i % 3), document and payload bytes. */
typedef struct fcache {
    kvm_store_manifest m;             /* manifest */
    kvm_store_layer layers[N_LAYERS]; /* one frame each */
    kvm_frame frames[N_LAYERS];       /* payloads */
    uint8_t *payload[N_LAYERS];       /* malloc'ed */
} fcache;

static const char g_config[] = "pattern=snapkv;budget=0.25";

static void fc_make(fcache *f, int i)
{
    char name[32];
    memset(f, 0, sizeof *f);
    snprintf(name, sizeof name, "model-%d", i % 3);
    kvm_store_hash_bytes(name, strlen(name), &f->m.model_id);
    int32_t toks[2] = {i, 7};
    ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &f->m.doc_hash), 0);
    f->m.config = (kvm_frame){(const uint8_t *)g_config, strlen(g_config)};
    kvm_store_hash_bytes(g_config, strlen(g_config), &f->m.config_id);
    kvm_store_hash_bytes("tok", 3, &f->m.tokenizer_id);
    f->m.n_layers = N_LAYERS;
    f->m.n_tokens = 10 + i;
    snprintf(f->m.dtype, sizeof f->m.dtype, "f32");
    for (int l = 0; l < N_LAYERS; l++) {
        size_t n = i % 4 == 0 ? 6000 : 40 + (size_t)i; /* 6000 bytes: two overflow pages */
        f->payload[l] = malloc(n);
        ck_assert_ptr_nonnull(f->payload[l]);
        for (size_t j = 0; j < n; j++)
            f->payload[l][j] = (uint8_t)(j * 7 + (size_t)i * 13 + (size_t)l);
        f->frames[l] = (kvm_frame){f->payload[l], n};
        f->layers[l] = (kvm_store_layer){&f->frames[l], 1};
    }
}

static void fc_free(fcache *f)
{
    for (int l = 0; l < N_LAYERS; l++)
        free(f->payload[l]);
}

static kvm_store_cache_key fc_key(const fcache *f)
{
    return (kvm_store_cache_key){f->m.model_id, f->m.doc_hash, f->m.config_id};
}

/* Caches, documents (with their name index), a strategy, a claim, and removed caches. */
static void make_fixture(const char *path)
{
    kvm_store_opts o = {.no_sync = 1};
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(path, &o, &s), 0);
    for (int i = 0; i < N_CACHES; i++) {
        fcache f;
        fc_make(&f, i);
        ck_assert_int_eq(kvm_store_put_cache(s, &f.m, f.layers), 0);
        kvm_store_doc_meta dm = {.n_tokens = f.m.n_tokens};
        snprintf(dm.source, sizeof dm.source, "corpus/doc_%03d.txt", i);
        ck_assert_int_eq(kvm_store_put_doc(s, &f.m.doc_hash, &dm), 0);
        fc_free(&f);
    }
    fcache f;
    fc_make(&f, 0);
    ck_assert_int_eq(kvm_store_put_strategy(s, &f.m.model_id, "polykv", "strategy", 8), 0);
    kvm_store_cache_key k = fc_key(&f);
    int taken = 0;
    ck_assert_int_eq(kvm_store_claim_take(s, &k, "run:a", "host", 60000, &taken, NULL), 0);
    fc_free(&f);
    for (int i = 16; i < 16 + N_REMOVED; i++) {
        fc_make(&f, i);
        k = fc_key(&f);
        ck_assert_int_eq(kvm_store_rm_cache(s, &k), 0);
        fc_free(&f);
    }
    kvm_store_close(&s);
}

static void setup(void)
{
    g_dir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(g_dir);
    snprintf(g_orig, sizeof g_orig, "%s/orig.lmdb", g_dir);
    snprintf(g_work, sizeof g_work, "%s/work.lmdb", g_dir);
    make_fixture(g_orig);
}

static void teardown(void)
{
    kvm_test_rmtree(g_dir);
    free(g_dir);
    g_dir = NULL;
}

/* ---- where to damage ---- */

/* One byte to flip: page pgno, offset in the page, what it is. */
typedef struct site {
    int64_t pgno;     /* page */
    int off;          /* byte in the page */
    const char *what; /* the field, for messages */
} site;

static uint8_t *read_data(const char *store, size_t *n)
{
    char p[4300];
    snprintf(p, sizeof p, "%s/data.mdb", store);
    uint8_t *b = (uint8_t *)kvm_test_read_file(p, n);
    ck_assert_ptr_nonnull(b);
    return b;
}

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static unsigned le16(const uint8_t *p) { return (unsigned)p[0] | (unsigned)p[1] << 8; }

/* Marks in free[] the pages the free db lists (LMDB's own reader: dbi 0 is the free db, each
 * value a u64 count and that many page numbers): those hold stale bytes nothing reads. */
static void free_pages(const char *store, uint8_t *is_free, size_t n_pages)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_cursor *cur;
    MDB_val k, v;
    ck_assert_int_eq(mdb_env_create(&env), 0);
    ck_assert_int_eq(mdb_env_open(env, store, MDB_RDONLY, 0664), 0);
    ck_assert_int_eq(mdb_txn_begin(env, NULL, MDB_RDONLY, &txn), 0);
    ck_assert_int_eq(mdb_cursor_open(txn, 0, &cur), 0);
    while (mdb_cursor_get(cur, &k, &v, MDB_NEXT) == 0) {
        const uint8_t *p = v.mv_data;
        for (uint64_t i = 0; i < le64(p); i++)
            if (le64(p + 8 + 8 * i) < n_pages) is_free[le64(p + 8 + 8 * i)] = 1;
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    mdb_env_close(env);
}

/* Every byte this test flips in the fixture: on each branch and leaf page in use, the page's
 * own number, its flags, the high bytes of lower, upper and the first node offset, and the
 * first node's size (a leaf's value size, a branch's child page) and key size; on each
 * overflow page, its number, flags and page count. Returns the count; *out is malloc'ed. */
static int damage_sites(site **out)
{
    size_t n;
    uint8_t *b = read_data(g_orig, &n);
    size_t psize = le16(b + 16 + 24) | (size_t)le16(b + 16 + 26) << 16, n_pages = n / psize;
    uint8_t *is_free = calloc(n_pages, 1);
    free_pages(g_orig, is_free, n_pages);
    site *s = calloc(n_pages * 8, sizeof *s);
    int ns = 0;
    for (size_t pg = 2; pg < n_pages; pg++) {
        const uint8_t *p = b + pg * psize;
        unsigned flags = le16(p + 10);
        if (is_free[pg] || le64(p) != pg) continue; /* free, unused, or the tail of an overflow run */
        if (flags == 4) {
            s[ns++] = (site){(int64_t)pg, 0, "overflow page number"};
            s[ns++] = (site){(int64_t)pg, 10, "overflow page flags"};
            s[ns++] = (site){(int64_t)pg, 14, "overflow page count"};
            continue;
        }
        if (flags != 1 && flags != 2) continue;
        unsigned ptr0 = le16(p + 16);
        s[ns++] = (site){(int64_t)pg, 0, "page number"};
        s[ns++] = (site){(int64_t)pg, 10, "page flags"};
        s[ns++] = (site){(int64_t)pg, 13, "lower"};
        s[ns++] = (site){(int64_t)pg, 15, "upper"};
        s[ns++] = (site){(int64_t)pg, 17, "node 0 offset"};
        s[ns++] = (site){(int64_t)pg, (int)ptr0 + 3, flags == 1 ? "node 0 child page" : "node 0 value size"};
        s[ns++] = (site){(int64_t)pg, (int)ptr0 + 7, "node 0 key size"};
    }
    free(is_free);
    free(b);
    *out = s;
    return ns;
}

/* Flips (xor 0xff) the site's byte of store's data.mdb in place. */
static void flip(const char *store, const site *st)
{
    char p[4300];
    snprintf(p, sizeof p, "%s/data.mdb", store);
    int fd = open(p, O_RDWR);
    ck_assert_int_ge(fd, 0);
    size_t n;
    uint8_t *b = read_data(store, &n);
    size_t psize = le16(b + 16 + 24) | (size_t)le16(b + 16 + 26) << 16;
    off_t at = (off_t)((size_t)st->pgno * psize + (size_t)st->off);
    uint8_t c = b[at] ^ 0xff;
    ck_assert_int_eq(pwrite(fd, &c, 1, at), 1);
    close(fd);
    free(b);
}

/* A fresh copy of the fixture at g_work (data.mdb only: a store copied as a file). */
static void copy_fixture(void)
{
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir '%s' && cp '%s/data.mdb' '%s/data.mdb'", g_work, g_work, g_orig,
             g_work);
    ck_assert_int_eq(system(cmd), 0);
}

/* ---- what every operation must do on a damaged store ---- */

/* 0 when the last error is KVM_ECORRUPT naming the store and a page, else a code for the child's exit. */
static int refused(int st, int code)
{
    const char *m = kvm_errmsg();
    if (st != KVM_ECORRUPT || !strstr(m, g_work) || !strstr(m, "data.mdb is damaged") || !strstr(m, ", page ")) {
        fprintf(stderr, "operation %d: status %d (%s)\n", code, st, m);
        return code;
    }
    return 0;
}

/* The first nonzero of r and x: every operation runs even after one was not refused (on the
 * old code a later one is the one that crashed). */
static int first(int r, int x) { return r ? r : x; }

static int count_visit(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    return ++*(int *)arg > 10000 ? KVM_EINVAL : 0;
}

static int strat_visit(const kvm_store_id *model_id, const char *name, size_t size, void *arg) { return 0; }

/* Every read on handle s: each must be refused. Returns 0, or which one was not. */
static int reads_refused(kvm_store *s)
{
    fcache f;
    fc_make(&f, 5);
    kvm_store_cache_key k = fc_key(&f);
    kvm_store_cache *c = NULL;
    kvm_store_cache_key found;
    kvm_store_doc_meta dm;
    kvm_store_doc_match *docs = NULL;
    kvm_store_stats stats;
    kvm_store_claim cl;
    uint8_t *data = NULL;
    size_t size;
    int64_t n_docs = 0;
    int has = 0, n = 0, r = refused(kvm_store_get_cache(s, &k, NULL, &c), 10);
    r = first(r, refused(kvm_store_has_cache(s, &k, NULL, &has), 11));
    r = first(r, refused(kvm_store_list_caches(s, NULL, count_visit, &n), 12));
    r = first(r, refused(kvm_store_find_cache(s, "0:0:0", &found), 13));
    r = first(r, refused(kvm_store_get_doc(s, &f.m.doc_hash, &dm), 14));
    r = first(r, refused(kvm_store_find_docs(s, "doc_005.txt", 11, &docs, &n_docs, NULL), 15));
    r = first(r, refused(kvm_store_get_strategy(s, &f.m.model_id, "polykv", &data, &size), 16));
    r = first(r, refused(kvm_store_list_strategies(s, NULL, strat_visit, NULL), 17));
    r = first(r, refused(kvm_store_stats_get(s, &stats), 18));
    r = first(r, refused(kvm_store_claim_get(s, &k, &cl), 19));
    kvm_store_cache_free(&c);
    free(docs);
    free(data);
    fc_free(&f);
    return r;
}

/* Every write on a writable handle s: each must be refused, and write nothing. */
static int writes_refused(kvm_store *s)
{
    fcache f, g;
    fc_make(&f, 5);
    fc_make(&g, 99);
    kvm_store_cache_key k = fc_key(&f);
    kvm_store_doc_meta dm = {.n_tokens = 3};
    snprintf(dm.source, sizeof dm.source, "new.txt");
    int taken = 0;
    int r = refused(kvm_store_rm_cache(s, &k), 20);
    r = first(r, refused(kvm_store_put_cache(s, &f.m, f.layers), 21));
    r = first(r, refused(kvm_store_put_cache(s, &g.m, g.layers), 22));
    r = first(r, refused(kvm_store_put_doc(s, &g.m.doc_hash, &dm), 23));
    r = first(r, refused(kvm_store_put_strategy(s, &f.m.model_id, "polykv", "x", 1), 24));
    r = first(r, refused(kvm_store_rm_strategy(s, &f.m.model_id, "polykv"), 25));
    r = first(r, refused(kvm_store_claim_take(s, &k, "run:b", "h", 1000, &taken, NULL), 26));
    r = first(r, refused(kvm_store_claim_release(s, "run:a", NULL), 27));
    fc_free(&f);
    fc_free(&g);
    return r;
}

/* verify on s: exactly one problem, the damage; compact: refused, no copy left. */
static int verify_and_compact(kvm_store *s)
{
    int64_t n_rec = -1, n_bad = 0;
    int st = kvm_store_verify(s, NULL, NULL, &n_rec, &n_bad);
    if (st != 0 || n_bad != 1 || n_rec != 0) {
        fprintf(stderr, "verify: %d, %lld problems, %lld records\n", st, (long long)n_bad, (long long)n_rec);
        return 30;
    }
    char dst[4300];
    struct stat sb;
    snprintf(dst, sizeof dst, "%s/copy.lmdb", g_dir);
    int r = refused(kvm_store_compact(s, dst, NULL), 31);
    return r ? r : stat(dst, &sb) == 0 ? 32 : 0;
}

/* In a child: opening the damaged copy (read-write, read-only) is refused; handles opened on
 * the copy before the damage refuse every operation after it. Exit status: 0, or which check
 * failed. A signal or the alarm is the old code's failure. */
static int damaged_child(const site *st)
{
    alarm(60); /* a loop inside LMDB would hang the test: die visibly instead */
    kvm_store *w = NULL, *ro = NULL;
    kvm_store_opts o = {.no_sync = 1}, oro = {.read_only = 1};
    if (kvm_store_open(g_work, &o, &w) || kvm_store_open(g_work, &oro, &ro)) return 1;
    flip(g_work, st);
    /* the flip's write stamps the file's mtime; make it differ from the open's however fast
     * the clock ticks, as any later write by another program does */
    struct timespec ts[2] = {{0, UTIME_OMIT}, {1, 0}};
    char p[4300];
    snprintf(p, sizeof p, "%s/data.mdb", g_work);
    if (utimensat(AT_FDCWD, p, ts, 0)) return 2;
    int r = reads_refused(ro);
    r = first(r, reads_refused(w));
    r = first(r, writes_refused(w));
    r = first(r, verify_and_compact(ro));
    kvm_store_close(&ro);
    kvm_store_close(&w);
    r = first(r, refused(kvm_store_open(g_work, &o, &w), 40));
    r = first(r, refused(kvm_store_open(g_work, &oro, &ro), 41));
    if (!r && (w || ro)) r = 42;
    kvm_store_close(&ro);
    kvm_store_close(&w);
    return r;
}

/* Runs damaged_child for a site in a forked process. Returns 0, or 1 after appending what
 * went wrong to why (a signal: the process died; else the check that failed). */
static int check_site(const site *st, char *why, size_t why_n)
{
    copy_fixture();
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) _exit(damaged_child(st));
    int ws = 0;
    ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
    if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0) return 0;
    size_t len = strlen(why);
    if (WIFSIGNALED(ws))
        snprintf(why + len, why_n - len, "\n  page %lld byte %d (%s): killed by signal %d%s", (long long)st->pgno,
                 st->off, st->what, WTERMSIG(ws), WTERMSIG(ws) == SIGALRM ? " (a loop)" : "");
    else
        snprintf(why + len, why_n - len, "\n  page %lld byte %d (%s): check %d failed", (long long)st->pgno, st->off,
                 st->what, WEXITSTATUS(ws));
    return 1;
}

/* ---- tests ---- */

/* Every damage site of the fixture, one process each: refused, never a crash or a loop. */
START_TEST(test_damaged_pages_refused)
{
    site *sites;
    int n = damage_sites(&sites), n_bad = 0;
    int pages_seen[3] = {0};
    char *why = calloc(1, 1 << 16);
    for (int i = 0; i < n; i++) {
        pages_seen[strstr(sites[i].what, "overflow") ? 2 : strstr(sites[i].what, "child") ? 1 : 0]++;
        n_bad += check_site(&sites[i], why, 1 << 16);
    }
    ck_assert_msg(pages_seen[0] > 0 && pages_seen[1] > 0 && pages_seen[2] > 0,
                  "fixture lacks leaf (%d), branch (%d) or overflow (%d) sites", pages_seen[0], pages_seen[1],
                  pages_seen[2]);
    ck_assert_msg(n_bad == 0, "%d of %d damaged copies not refused cleanly:%.4000s", n_bad, n, why);
    free(why);
    free(sites);
}
END_TEST

/* In a child: both opens of the damaged copy are refused naming the store. */
static int meta_child(void)
{
    alarm(60);
    kvm_store *w = NULL, *ro = NULL;
    kvm_store_opts o = {.no_sync = 1}, oro = {.read_only = 1};
    int r = first(refused(kvm_store_open(g_work, &o, &w), 1), refused(kvm_store_open(g_work, &oro, &ro), 2));
    kvm_store_close(&ro);
    kvm_store_close(&w);
    return r;
}

/* The meta pages (0 and 1): LMDB maps the file with the newer one's page size and finds page 1
 * at page 0's, so a flipped page size byte in either made the old code die with SIGBUS inside
 * mdb_env_open; the free db's flags (LMDB's free-page cursor asserted on DUPSORT) and the roots
 * and depth of the newer one, which every transaction starts from. */
START_TEST(test_damaged_meta_refused)
{
    size_t n;
    uint8_t *b = read_data(g_orig, &n);
    size_t psize = le16(b + 16 + 24) | (size_t)le16(b + 16 + 26) << 16;
    int64_t cur = le64(b + psize + 16 + 128) > le64(b + 16 + 128); /* the meta with the higher txnid */
    free(b);
    const site sites[] = {
        {0, 40, "meta 0 page size"},     {0, 41, "meta 0 page size"}, {0, 42, "meta 0 page size"},
        {0, 43, "meta 0 page size"},     {1, 40, "meta 1 page size"}, {1, 41, "meta 1 page size"},
        {1, 42, "meta 1 page size"},     {1, 43, "meta 1 page size"}, {cur, 44, "free db flags"},
        {cur, 56, "free db leaf pages"}, {cur, 80, "free db root"},   {cur, 94, "main db depth"},
        {cur, 120, "main db entries"},   {cur, 128, "main db root"},
    }; /* the meta: 16-byte page header, then u32 magic, u32 version, address, map size, and two
        * 48-byte db records (free at byte 40, main at 88: u32 pad = page size in the free db's,
        * u16 flags, u16 depth, u64 branch, leaf, overflow pages, entries, root) */
    char why[4096] = "";
    int n_bad = 0;
    for (size_t i = 0; i < sizeof sites / sizeof sites[0]; i++) {
        copy_fixture();
        flip(g_work, &sites[i]);
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) _exit(meta_child());
        int ws = 0;
        ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
        if (WIFEXITED(ws) && WEXITSTATUS(ws) == 0) continue;
        size_t len = strlen(why);
        snprintf(why + len, sizeof why - len, "\n  page %lld byte %d (%s): %s %d", (long long)sites[i].pgno,
                 sites[i].off, sites[i].what, WIFSIGNALED(ws) ? "killed by signal" : "not refused by open",
                 WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
        n_bad++;
    }
    ck_assert_msg(n_bad == 0, "%d of %zu damaged meta pages not refused cleanly:%s", n_bad,
                  sizeof sites / sizeof sites[0], why);
}
END_TEST

/* In a child: a writer's own commit spares its next transaction the check, but a page damaged
 * after it (the main db's root, which every transaction reads) is still caught. */
static int own_commit_child(void)
{
    alarm(60);
    kvm_store *w = NULL;
    kvm_store_opts o = {.no_sync = 1};
    fcache f, g;
    fc_make(&f, 77);
    fc_make(&g, 5);
    int r = kvm_store_open(g_work, &o, &w) || kvm_store_put_cache(w, &f.m, f.layers) ? 1 : 0;
    size_t n;
    uint8_t *b = read_data(g_work, &n);
    size_t psize = le16(b + 16 + 24) | (size_t)le16(b + 16 + 26) << 16;
    int64_t cur = le64(b + psize + 16 + 128) > le64(b + 16 + 128);
    site root = {(int64_t)le64(b + cur * (int64_t)psize + 128), 10, "main db root flags"};
    free(b);
    flip(g_work, &root);
    struct timespec ts[2] = {{0, UTIME_OMIT}, {1, 0}};
    char p[4300];
    snprintf(p, sizeof p, "%s/data.mdb", g_work);
    if (!r && utimensat(AT_FDCWD, p, ts, 0)) r = 2;
    kvm_store_cache_key k = fc_key(&g);
    kvm_store_cache *c = NULL;
    r = first(r, refused(kvm_store_get_cache(w, &k, NULL, &c), 3));
    r = first(r, refused(kvm_store_put_cache(w, &g.m, g.layers), 4));
    kvm_store_cache_free(&c);
    kvm_store_close(&w);
    fc_free(&f);
    fc_free(&g);
    return r;
}

START_TEST(test_damage_after_own_commit)
{
    copy_fixture();
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) _exit(own_commit_child());
    int ws = 0;
    ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
    ck_assert_msg(!WIFSIGNALED(ws), "killed by signal %d", WTERMSIG(ws));
    ck_assert_msg(WEXITSTATUS(ws) == 0, "check %d failed", WEXITSTATUS(ws));
}
END_TEST

/* The undamaged fixture: every operation works and returns what was stored (the check finds
 * nothing wrong in pages LMDB wrote: branch and leaf pages, overflow runs, free-page lists). */
START_TEST(test_undamaged_store_works)
{
    kvm_store_opts o = {.no_sync = 1};
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_orig, &o, &s), 0);
    for (int i = 0; i < N_CACHES; i++) {
        fcache f;
        fc_make(&f, i);
        kvm_store_cache_key k = fc_key(&f);
        kvm_store_cache *c = NULL;
        int st = kvm_store_get_cache(s, &k, &f.m.tokenizer_id, &c), removed = i >= 16 && i < 16 + N_REMOVED;
        ck_assert_msg(st == (removed ? KVM_ENOTFOUND : 0), "cache %d: %d %s", i, st, kvm_errmsg());
        for (int l = 0; !removed && l < N_LAYERS; l++)
            ck_assert(c->layers[l].frames[0].size == f.frames[l].size &&
                      !memcmp(c->layers[l].frames[0].data, f.payload[l], f.frames[l].size));
        kvm_store_cache_free(&c);
        fc_free(&f);
    }
    int n = 0;
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, count_visit, &n), 0);
    ck_assert_int_eq(n, N_CACHES - N_REMOVED);
    kvm_store_doc_match *docs = NULL;
    int64_t n_docs = 0;
    ck_assert_int_eq(kvm_store_find_docs(s, "doc_005.txt", 11, &docs, &n_docs, NULL), 0);
    ck_assert_int_eq(n_docs, 1);
    free(docs);
    /* writes: 200 more caches (branch pages, page reuse from the free db), then remove half */
    for (int i = 100; i < 300; i++) {
        fcache f;
        fc_make(&f, i);
        ck_assert_int_eq(kvm_store_put_cache(s, &f.m, f.layers), 0);
        if (i % 2) {
            kvm_store_cache_key k = fc_key(&f);
            ck_assert_int_eq(kvm_store_rm_cache(s, &k), 0);
        }
        fc_free(&f);
    }
    int64_t n_rec = 0, n_bad = -1;
    ck_assert_int_eq(kvm_store_verify(s, NULL, NULL, &n_rec, &n_bad), 0);
    ck_assert_int_eq(n_bad, 0);
    char dst[4300];
    snprintf(dst, sizeof dst, "%s/copy.lmdb", g_dir);
    ck_assert_int_eq(kvm_store_compact(s, dst, NULL), 0);
    kvm_store_close(&s);
    kvm_store_opts ro = {.read_only = 1};
    ck_assert_int_eq(kvm_store_open(dst, &ro, &s), 0);
    n = 0;
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, count_visit, &n), 0);
    ck_assert_int_eq(n, N_CACHES - N_REMOVED + 100);
    kvm_store_close(&s);
}
END_TEST

/* `kvmill store` on a damaged store: verify says what is damaged and exits 1; ls and rm are
 * refused at open (exit 2, as for a truncated data.mdb), naming the store and the page, and rm
 * leaves data.mdb as it was. */
START_TEST(test_cli_damaged)
{
    site *sites;
    ck_assert_int_gt(damage_sites(&sites), 0);
    copy_fixture();
    flip(g_work, &sites[1]); /* the first page's flags */
    free(sites);
    size_t n0, n1;
    uint8_t *before = read_data(g_work, &n0);
    char cmd[9000], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill store verify --store %s", kvm_test_bin(), g_work);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
    ck_assert_msg(strstr(err, g_work) && strstr(err, "data.mdb is damaged") && strstr(err, "flags 0x"), "%s", err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill store ls --store %s", kvm_test_bin(), g_work);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "data.mdb is damaged") && strstr(err, "store verify"), "%s", err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill store rm --store %s 0:0:0", kvm_test_bin(), g_work);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "data.mdb is damaged"), "%s", err);
    free(out);
    free(err);
    uint8_t *after = read_data(g_work, &n1);
    ck_assert(n0 == n1 && memcmp(before, after, n0) == 0);
    free(before);
    free(after);
}
END_TEST

int main(void)
{
    if (sodium_init() < 0) return 1;
    Suite *su = suite_create("store_pages");
    TCase *tc = tcase_create("damaged_pages_refused");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_damaged_pages_refused);
    suite_add_tcase(su, tc);
    tc = tcase_create("damaged_meta_refused");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_damaged_meta_refused);
    suite_add_tcase(su, tc);
    tc = tcase_create("damage_after_own_commit");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_damage_after_own_commit);
    suite_add_tcase(su, tc);
    tc = tcase_create("undamaged_store_works");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_undamaged_store_works);
    suite_add_tcase(su, tc);
    tc = tcase_create("cli_damaged");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_cli_damaged);
    suite_add_tcase(su, tc);
    SRunner *sr = srunner_create(su);
    srunner_set_fork_status(sr, CK_FORK);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
