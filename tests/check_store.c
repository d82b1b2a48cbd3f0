/* check_store.c: the LMDB store (store/) and `kvmill store` (orchestrator/cmd_store.c):
 * round trips, concurrent writer and reader processes, a writer killed mid-transaction,
 * corruption detection, map growth, the cap's LRU eviction, compatibility refusal, CLI, and
 * the document-name index (found without reading every document; older stores). */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <signal.h>
#include <sodium.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "proto/kvm_proto.h"
#include "model/kvm_utf8.h"
#include "store/kvm_store.h"
#include "store/kvm_store_internal.h"
#include "tests/util/kvm_test.h"

/* ---- deterministic test caches ---- */

#define TC_MAXL 8

/* A cache whose every byte follows from (model, writer, index). */
typedef struct tcache {
    kvm_store_manifest m;            /* manifest to put */
    kvm_store_layer layers[TC_MAXL]; /* layer frame lists */
    kvm_frame frames[TC_MAXL][3];    /* header, payload, empty (odd layers) */
    uint8_t hdr[TC_MAXL][32];        /* per-layer header frame */
    uint8_t *payload[TC_MAXL];       /* per-layer payload, malloc'ed */
    char config[64];                 /* canonical config bytes */
    kvm_msg *msg[TC_MAXL];           /* tc_make_dec: each layer's `cache` message, owned */
    kvm_frame msg_frames[TC_MAXL][8]; /* tc_make_dec: its frames */
} tcache;

static void tc_make(tcache *t, uint32_t model, uint32_t w, uint32_t i, int n_layers, size_t payload, int vary)
{
    memset(t, 0, sizeof *t);
    char s[64];
    snprintf(s, sizeof s, "model-%u", model);
    kvm_store_hash_bytes(s, strlen(s), &t->m.model_id);
    int32_t toks[3] = {(int32_t)w, (int32_t)i, 12345};
    ck_assert_int_eq(kvm_store_doc_hash(toks, 3, &t->m.doc_hash), 0);
    snprintf(t->config, sizeof t->config, "pattern=snapkv;budget=0.25");
    t->m.config = (kvm_frame){(const uint8_t *)t->config, strlen(t->config)};
    kvm_store_hash_bytes(t->config, strlen(t->config), &t->m.config_id);
    kvm_store_hash_bytes("tok-1", 5, &t->m.tokenizer_id);
    t->m.n_layers = n_layers;
    t->m.n_tokens = 100 + i;
    t->m.n_entries = 40 + i;
    t->m.full_bytes = 2ll * n_layers * 2 * t->m.n_tokens * 16 * 4;
    snprintf(t->m.dtype, sizeof t->m.dtype, "f16");
    for (int l = 0; l < n_layers; l++) {
        snprintf((char *)t->hdr[l], sizeof t->hdr[l], "m=%u w=%u i=%u l=%d", model, w, i, l);
        size_t n = payload + (vary ? (i * 37u + (uint32_t)l * 101u) % 997u : 0);
        t->payload[l] = malloc(n);
        uint64_t x = 0x9E3779B97F4A7C15ull ^ ((uint64_t)model << 48 | (uint64_t)w << 32 | (uint64_t)i << 8 | (uint64_t)l);
        for (size_t j = 0; j < n; j++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            t->payload[l][j] = (uint8_t)(x >> 24);
        }
        t->frames[l][0] = (kvm_frame){t->hdr[l], sizeof t->hdr[l]};
        t->frames[l][1] = (kvm_frame){t->payload[l], n};
        t->frames[l][2] = (kvm_frame){NULL, 0};
        t->layers[l] = (kvm_store_layer){t->frames[l], l % 2 ? 3u : 2u};
    }
}

#define TC_DEC_HEADS 4     /* tc_make_dec: KV heads */
#define TC_DEC_HEAD_DIM 16 /* tc_make_dec: head_dim; an entry's key is 64 payload bytes */

/* tc_make with layers that decode as serve decodes them (what `store verify` checks): each
 * layer is a `cache` message whose keys tensor holds the layer's payload (values are 0), payload
 * rounded up to a whole number of entries, spread over TC_DEC_HEADS KV heads. */
static void tc_make_dec_inf(tcache *t, uint32_t model, uint32_t w, uint32_t i, int n_layers, size_t payload,
                            int inf_layer);
static void tc_make_dec(tcache *t, uint32_t model, uint32_t w, uint32_t i, int n_layers, size_t payload)
{
    tc_make_dec_inf(t, model, w, i, n_layers, payload, -1);
}

/* tc_make_dec with the first key of layer inf_layer (-1: none) +inf, a cache no forward makes. */
static void tc_make_dec_inf(tcache *t, uint32_t model, uint32_t w, uint32_t i, int n_layers, size_t payload,
                            int inf_layer)
{
    const size_t entry = TC_DEC_HEAD_DIM * sizeof(float);
    tc_make(t, model, w, i, n_layers, (payload + entry - 1) / entry * entry, 0);
    snprintf(t->m.dtype, sizeof t->m.dtype, "f32");
    for (int l = 0; l < n_layers; l++) {
        for (size_t j = 0; j + 4 <= t->frames[l][1].size; j += 4) { /* finite keys: a NaN or inf does not decode */
            uint32_t u;
            memcpy(&u, t->payload[l] + j, 4);
            if ((u & 0x7f800000u) == 0x7f800000u) u &= ~0x40000000u;
            memcpy(t->payload[l] + j, &u, 4);
        }
        if (l == inf_layer) memcpy(t->payload[l], &(float){INFINITY}, 4);
        int64_t ne = (int64_t)t->frames[l][1].size / (int64_t)entry;
        ck_assert_int_le((ne + TC_DEC_HEADS - 1) / TC_DEC_HEADS, t->m.n_tokens);
        int32_t head_entries[TC_DEC_HEADS], *pos = malloc((size_t)ne * sizeof *pos);
        float *bias = calloc((size_t)ne, sizeof *bias), *values = calloc((size_t)ne * TC_DEC_HEAD_DIM, sizeof *values);
        ck_assert(pos && bias && values);
        for (int g = 0, row = 0; g < TC_DEC_HEADS; g++) {
            head_entries[g] = (int32_t)(ne / TC_DEC_HEADS + (g < ne % TC_DEC_HEADS));
            for (int e = 0; e < head_entries[g]; e++)
                pos[row++] = e;
        }
        kvm_proto_cache pc = {.layer = l,
                              .n_layers = n_layers,
                              .n_kv_heads = TC_DEC_HEADS,
                              .head_dim = TC_DEC_HEAD_DIM,
                              .n_tokens = t->m.n_tokens,
                              .n_entries = ne,
                              .dtype = KVM_PROTO_F32,
                              .head_entries = head_entries,
                              .keys = t->payload[l],
                              .values = values,
                              .positions = pos,
                              .logit_bias = bias};
        ck_assert_msg(kvm_proto_cache_encode(&pc, &t->msg[l]) == 0, "%s", kvm_errmsg());
        free(pos);
        free(bias);
        free(values);
        size_t nf = kvm_msg_nframes(t->msg[l]);
        ck_assert_uint_le(nf, 8);
        for (size_t f = 0; f < nf; f++)
            t->msg_frames[l][f] = kvm_msg_frame(t->msg[l], f);
        t->layers[l] = (kvm_store_layer){t->msg_frames[l], (uint32_t)nf};
    }
}

static void tc_free(tcache *t)
{
    for (int l = 0; l < TC_MAXL; l++) free(t->payload[l]);
    for (int l = 0; l < TC_MAXL; l++)
        kvm_msg_free(&t->msg[l]);
    memset(t, 0, sizeof *t);
}

static kvm_store_cache_key tc_key(const tcache *t)
{
    return (kvm_store_cache_key){t->m.model_id, t->m.doc_hash, t->m.config_id};
}

/* 0 when c holds exactly t, else a line number to say where they differ. */
static int tc_diff(const tcache *t, const kvm_store_cache *c)
{
    const kvm_store_manifest *a = &t->m, *b = &c->manifest;
    if (a->n_layers != b->n_layers || a->n_tokens != b->n_tokens || a->n_entries != b->n_entries ||
        a->full_bytes != b->full_bytes || strcmp(a->dtype, b->dtype) != 0)
        return __LINE__;
    if (memcmp(&a->model_id, &b->model_id, 32) || memcmp(&a->doc_hash, &b->doc_hash, 32) ||
        memcmp(&a->config_id, &b->config_id, 32) || memcmp(&a->tokenizer_id, &b->tokenizer_id, 32))
        return __LINE__;
    if (a->config.size != b->config.size || memcmp(a->config.data, b->config.data, a->config.size)) return __LINE__;
    if (b->format_version != KVM_STORE_FORMAT_VERSION) return __LINE__;
    int64_t bytes = 0;
    for (int l = 0; l < a->n_layers; l++) {
        if (t->layers[l].n_frames != c->layers[l].n_frames) return __LINE__;
        for (uint32_t f = 0; f < t->layers[l].n_frames; f++) {
            const kvm_frame *x = &t->layers[l].frames[f], *y = &c->layers[l].frames[f];
            if (x->size != y->size || (x->size && memcmp(x->data, y->data, x->size))) return __LINE__;
            bytes += (int64_t)x->size;
        }
    }
    return bytes == b->stored_bytes ? 0 : __LINE__;
}

/* ---- helpers ---- */

static char *g_dir;   /* this test's temporary directory */
static char g_path[4200]; /* the store directory inside it */

static void setup(void)
{
    g_dir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(g_dir);
    snprintf(g_path, sizeof g_path, "%s/store", g_dir);
}

static void teardown(void)
{
    kvm_test_rmtree(g_dir);
    free(g_dir);
    g_dir = NULL;
}

static kvm_store *open_store(const char *path, int64_t map, int64_t max, int64_t cap, int64_t gran_ms)
{
    kvm_store_opts o = {.map_size_bytes = map, .map_max_bytes = max, .cap_bytes = cap,
                        .atime_granularity_ms = gran_ms, .no_sync = 1};
    kvm_store *s = NULL;
    int st = kvm_store_open(path, &o, &s);
    ck_assert_msg(st == 0, "open %s: %d %s", path, st, kvm_errmsg());
    return s;
}

static void put_ok(kvm_store *s, const tcache *t)
{
    int st = kvm_store_put_cache(s, &t->m, t->layers);
    ck_assert_msg(st == 0, "put: %d %s", st, kvm_errmsg());
}

/* Gets t's cache and compares; returns the status (0 also means equal). */
static int get_cmp(kvm_store *s, const tcache *t)
{
    kvm_store_cache_key k = tc_key(t);
    kvm_store_cache *c = NULL;
    int st = kvm_store_get_cache(s, &k, &t->m.tokenizer_id, &c);
    if (st == 0) {
        int d = tc_diff(t, c);
        ck_assert_msg(d == 0, "cache content differs (check at line %d)", d);
    } else {
        ck_assert_ptr_null(c);
    }
    kvm_store_cache_free(&c);
    return st;
}

static int has(kvm_store *s, const tcache *t)
{
    kvm_store_cache_key k = tc_key(t);
    int found = -1;
    int st = kvm_store_has_cache(s, &k, &t->m.tokenizer_id, &found);
    ck_assert_msg(st == 0, "has: %d %s", st, kvm_errmsg());
    return found;
}

static int64_t verify_problems(kvm_store *s)
{
    int64_t n_rec = 0, n_bad = -1;
    ck_assert_int_eq(kvm_store_verify(s, NULL, NULL, &n_rec, &n_bad), 0);
    return n_bad;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Runs kvm_cmd_store("store", args...) in a forked child; captures stdout and stderr. */
static int run_cli(char **out, char **err, ...)
{
    char *argv[16];
    int argc = 0;
    argv[argc++] = "store";
    va_list ap;
    va_start(ap, err);
    for (char *a; (a = va_arg(ap, char *)) != NULL && argc < 15;) argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    char o[4300], e[4300];
    snprintf(o, sizeof o, "%s/cli.out", g_dir);
    snprintf(e, sizeof e, "%s/cli.err", g_dir);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int fo = open(o, O_WRONLY | O_CREAT | O_TRUNC, 0644), fe = open(e, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fo < 0 || fe < 0) _exit(99);
        dup2(fo, 1);
        dup2(fe, 2);
        int rc = kvm_cmd_store(argc, argv);
        fflush(stdout);
        fflush(stderr);
        _exit(rc);
    }
    int wst;
    waitpid(pid, &wst, 0);
    char *ob = kvm_test_read_file(o, NULL), *eb = kvm_test_read_file(e, NULL);
    if (out) *out = ob;
    else free(ob);
    if (err) *err = eb;
    else free(eb);
    return WIFEXITED(wst) ? WEXITSTATUS(wst) : 128 + WTERMSIG(wst);
}

/* First occurrence of needle[0, m) in hay[0, n), or NULL (memmem is a GNU extension). */
static const char *find_bytes(const char *hay, size_t n, const void *needle, size_t m)
{
    for (size_t i = 0; m <= n && i <= n - m; i++)
        if (hay[i] == *(const char *)needle && memcmp(hay + i, needle, m) == 0) return hay + i;
    return NULL;
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; s && *s; s++) n += *s == '\n';
    return n;
}

/* Raw LMDB access to the store's `caches` db, bypassing the store (to damage it). */
static void raw_open(MDB_env **env, MDB_txn **txn, MDB_dbi *dbi, const char *db)
{
    ck_assert_int_eq(mdb_env_create(env), 0);
    mdb_env_set_maxdbs(*env, 16);
    ck_assert_int_eq(mdb_env_open(*env, g_path, 0, 0664), 0);
    ck_assert_int_eq(mdb_txn_begin(*env, NULL, 0, txn), 0);
    ck_assert_int_eq(mdb_dbi_open(*txn, db, 0, dbi), 0);
}

static void raw_close(MDB_env *env, MDB_txn *txn)
{
    ck_assert_int_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
}

/* Makes `path` an LMDB environment of another program: its unnamed database holds n_keys keys
 * ("key00", ...) and no kvmill database. */
static void foreign_lmdb(const char *path, int n_keys)
{
    ck_assert_int_eq(mkdir(path, 0775), 0);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    ck_assert_int_eq(mdb_env_create(&env), 0);
    ck_assert_int_eq(mdb_env_open(env, path, 0, 0664), 0);
    ck_assert_int_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    ck_assert_int_eq(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    for (int i = 0; i < n_keys; i++) {
        char k[16];
        snprintf(k, sizeof k, "key%02d", i);
        MDB_val key = {strlen(k), k}, val = {1, "v"};
        ck_assert_int_eq(mdb_put(txn, dbi, &key, &val, 0), 0);
    }
    raw_close(env, txn);
}

/* Rewrites the value of one cache key through `edit`. */
static void raw_edit(const tcache *t, uint32_t layer, void (*edit)(uint8_t *v, size_t n, const MDB_val *key))
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    raw_open(&env, &txn, &dbi, "caches");
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    kvm_store_cache_key k = tc_key(t);
    kvm_store__cache_key(&k, layer, kb);
    MDB_val key = {sizeof kb, kb}, val;
    ck_assert_int_eq(mdb_get(txn, dbi, &key, &val), 0);
    uint8_t *copy = malloc(val.mv_size);
    memcpy(copy, val.mv_data, val.mv_size);
    edit(copy, val.mv_size, &key);
    MDB_val nv = {val.mv_size, copy};
    ck_assert_int_eq(mdb_put(txn, dbi, &key, &nv, 0), 0);
    free(copy);
    raw_close(env, txn);
}

static void edit_flip_middle(uint8_t *v, size_t n, const MDB_val *key)
{
    (void)key;
    v[n / 2] ^= 0x01;
}

/* Sets the record's format version to 2 and re-seals the checksum: a valid future record. */
static void edit_version2(uint8_t *v, size_t n, const MDB_val *key)
{
    kvm_store__put_u16(v + 4, 2);
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KVM_STORE__REC_SUM);
    crypto_generichash_update(&h, key->mv_data, key->mv_size);
    crypto_generichash_update(&h, v, n - KVM_STORE__REC_SUM);
    crypto_generichash_final(&h, v + n - KVM_STORE__REC_SUM, KVM_STORE__REC_SUM);
}

/* Flips the last byte of the manifest's model id (part 0 at 64 + 31) and re-seals the checksum. */
static void edit_model_id_last(uint8_t *v, size_t n, const MDB_val *key)
{
    v[KVM_STORE__REC_HEADER + 8 * 2 + 64 + 31] ^= 1;
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KVM_STORE__REC_SUM);
    crypto_generichash_update(&h, key->mv_data, key->mv_size);
    crypto_generichash_update(&h, v, n - KVM_STORE__REC_SUM);
    crypto_generichash_final(&h, v + n - KVM_STORE__REC_SUM, KVM_STORE__REC_SUM);
}

static void raw_del(const tcache *t, uint32_t layer)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    raw_open(&env, &txn, &dbi, "caches");
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    kvm_store_cache_key k = tc_key(t);
    kvm_store__cache_key(&k, layer, kb);
    MDB_val key = {sizeof kb, kb};
    ck_assert_int_eq(mdb_del(txn, dbi, &key, NULL), 0);
    raw_close(env, txn);
}

/* ---- ids ---- */

START_TEST(test_ids)
{
    kvm_store_id id, id2;
    char hex[KVM_STORE_ID_HEX + 1];
    kvm_store_hash_bytes("abc", 3, &id); /* RFC 7693-style BLAKE2b-256 test vector */
    ck_assert_str_eq(kvm_store_id_hex(&id, hex), "bddd813c634239723171ef3fee98579b94964e3bb1cb3e427262c8c068d52319");
    ck_assert_int_eq(kvm_store_id_parse(hex, &id2), 0);
    ck_assert_mem_eq(id.b, id2.b, 32);
    ck_assert_int_eq(kvm_store_id_parse("BDDD813C634239723171EF3FEE98579B94964E3BB1CB3E427262C8C068D52319", &id2), 0);
    ck_assert_mem_eq(id.b, id2.b, 32);
    ck_assert_int_eq(kvm_store_id_parse("bddd", &id2), KVM_EINVAL);
    ck_assert_int_eq(kvm_store_id_parse("gddd813c634239723171ef3fee98579b94964e3bb1cb3e427262c8c068d52319", &id2), KVM_EINVAL);
    ck_assert_int_eq(kvm_store_id_has_prefix(&id, "bDd"), 1);
    ck_assert_int_eq(kvm_store_id_has_prefix(&id, ""), 1);
    ck_assert_int_eq(kvm_store_id_has_prefix(&id, "bde"), 0);

    /* doc hash = hash of the int32 tokens, little-endian */
    int32_t toks[3] = {1, -2, 0x01020304};
    uint8_t le[12] = {1, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff, 4, 3, 2, 1};
    kvm_store_hash_bytes(le, sizeof le, &id);
    ck_assert_int_eq(kvm_store_doc_hash(toks, 3, &id2), 0);
    ck_assert_mem_eq(id.b, id2.b, 32);
    ck_assert_int_eq(kvm_store_doc_hash(NULL, -1, &id2), KVM_EINVAL);

    /* model id: hash of the file bytes, remembered per (path, size, mtime, inode, device, ctime) */
    char mpath[4300];
    snprintf(mpath, sizeof mpath, "%s/model.bin", g_dir);
    ck_assert_int_eq(kvm_test_write_file(mpath, "weights-A", 9), 0);
    kvm_store_id want_a, want_b;
    kvm_store_hash_bytes("weights-A", 9, &want_a);
    kvm_store_hash_bytes("weights-B", 9, &want_b);
    ck_assert_int_eq(kvm_store_hash_file(mpath, &id), 0);
    ck_assert_mem_eq(id.b, want_a.b, 32);
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    ck_assert_int_eq(kvm_store_model_id(s, mpath, &id), 0);
    ck_assert_mem_eq(id.b, want_a.b, 32);
    struct stat st0;
    ck_assert_int_eq(stat(mpath, &st0), 0);
    /* other bytes at the same size, the mtime set back (cp -p, touch -r): the memo answered the
     * old id (caches of the old weights served as current); the write's new ctime tells now */
    usleep(20 * 1000); /* a ctime the clock can tell from the first write's */
    int fd = open(mpath, O_WRONLY);
    ck_assert_int_eq(pwrite(fd, "weights-B", 9, 0), 9);
    struct timespec times[2] = {st0.st_atim, st0.st_mtim};
    ck_assert_int_eq(futimens(fd, times), 0);
    close(fd);
    struct stat st1;
    ck_assert_int_eq(stat(mpath, &st1), 0);
    ck_assert(st1.st_mtim.tv_sec == st0.st_mtim.tv_sec && st1.st_mtim.tv_nsec == st0.st_mtim.tv_nsec);
    ck_assert_int_eq(kvm_store_model_id(s, mpath, &id), 0);
    ck_assert_mem_eq(id.b, want_b.b, 32);
    ck_assert_int_eq(kvm_store_model_id(s, mpath, &id), 0); /* remembered: the same */
    ck_assert_mem_eq(id.b, want_b.b, 32);
    /* a new mtime: hashed again */
    ck_assert_int_eq(kvm_test_write_file(mpath, "weights-A", 9), 0);
    times[1].tv_sec += 5;
    ck_assert_int_eq(utimensat(AT_FDCWD, mpath, times, 0), 0);
    ck_assert_int_eq(kvm_store_model_id(s, mpath, &id), 0);
    ck_assert_mem_eq(id.b, want_a.b, 32);
    ck_assert_int_eq(kvm_store_model_id(s, "/nonexistent/model.bin", &id), KVM_EIO);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
    ck_assert_ptr_null(s);
    kvm_store_close(&s); /* NULL is fine */
}
END_TEST

/* ---- put / get ---- */

START_TEST(test_put_get)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache a, b, a2;
    tc_make(&a, 1, 0, 1, 3, 500, 1);
    tc_make(&b, 1, 0, 2, 5, 5000, 1);
    put_ok(s, &a);
    put_ok(s, &b);
    ck_assert_int_eq(get_cmp(s, &a), 0);
    ck_assert_int_eq(get_cmp(s, &b), 0);
    ck_assert_int_eq(has(s, &a), 1);

    kvm_store_cache_key k = tc_key(&a);
    kvm_store_cache *c = NULL;
    ck_assert_int_eq(kvm_store_get_cache(s, &k, NULL, &c), 0);
    ck_assert_int_eq(c->manifest.format_version, KVM_STORE_FORMAT_VERSION);
    ck_assert_int_gt(c->manifest.created_unix_ms, 1600000000000ll);
    ck_assert_int_eq(c->layers[1].n_frames, 3);
    ck_assert_uint_eq(c->layers[1].frames[2].size, 0);
    kvm_store_cache_free(&c);
    ck_assert_ptr_null(c);

    /* unknown key */
    tcache u;
    tc_make(&u, 1, 9, 9, 1, 10, 0);
    ck_assert_int_eq(get_cmp(s, &u), KVM_ENOTFOUND);
    ck_assert_int_eq(has(s, &u), 0);

    /* replace a with a 2-layer version: old layer 2 must go */
    tc_make(&a2, 1, 0, 1, 2, 300, 0);
    put_ok(s, &a2);
    ck_assert_int_eq(get_cmp(s, &a2), 0);
    ck_assert_int_eq(verify_problems(s), 0);

    /* bad puts */
    kvm_store_manifest m = a.m;
    m.n_layers = 0;
    ck_assert_int_eq(kvm_store_put_cache(s, &m, a.layers), KVM_EINVAL);
    m = a.m;
    m.config_id.b[0] ^= 1;
    ck_assert_int_eq(kvm_store_put_cache(s, &m, a.layers), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "config_id"));

    /* find by prefixes */
    char h1[65], h2[65], h3[65], text[256];
    kvm_store_id_hex(&b.m.model_id, h1);
    kvm_store_id_hex(&b.m.doc_hash, h2);
    kvm_store_id_hex(&b.m.config_id, h3);
    snprintf(text, sizeof text, "%.6s:%.6s:%.3s", h1, h2, h3);
    kvm_store_cache_key f;
    ck_assert_int_eq(kvm_store_find_cache(s, text, &f), 0);
    ck_assert_mem_eq(f.doc_hash.b, b.m.doc_hash.b, 32);
    ck_assert_int_eq(kvm_store_find_cache(s, "abc", &f), KVM_EINVAL);

    /* remove */
    k = tc_key(&b);
    ck_assert_int_eq(kvm_store_rm_cache(s, &k), 0);
    ck_assert_int_eq(get_cmp(s, &b), KVM_ENOTFOUND);
    ck_assert_int_eq(kvm_store_rm_cache(s, &k), KVM_ENOTFOUND);
    kvm_store_stats t;
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    ck_assert_int_eq(t.n_caches, 1);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);

    /* persists; read-only handle refuses writes */
    kvm_store_opts ro = {.read_only = 1};
    ck_assert_int_eq(kvm_store_open(g_path, &ro, &s), 0);
    ck_assert_int_eq(get_cmp(s, &a2), 0);
    ck_assert_int_eq(kvm_store_put_cache(s, &a.m, a.layers), KVM_ESTATE);
    kvm_store_close(&s);
    tc_free(&a);
    tc_free(&a2);
    tc_free(&b);
    tc_free(&u);
}
END_TEST

/* ---- strategies, models, docs ---- */

typedef struct strat_list {
    int n;             /* strategies seen */
    char names[8][32]; /* their names */
} strat_list;

static int strat_visit(const kvm_store_id *model_id, const char *name, size_t size, void *arg)
{
    (void)model_id;
    (void)size;
    strat_list *l = arg;
    if (l->n < 8) snprintf(l->names[l->n], sizeof l->names[0], "%s", name);
    l->n++;
    return 0;
}

START_TEST(test_strategies_meta)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    kvm_store_id m1, m2;
    kvm_store_hash_bytes("m1", 2, &m1);
    kvm_store_hash_bytes("m2", 2, &m2);
    ck_assert_int_eq(kvm_store_put_strategy(s, &m1, "plan-a", "\x01\x02\x03", 3), 0);
    ck_assert_int_eq(kvm_store_put_strategy(s, &m1, "plan-b", "", 0), 0);
    ck_assert_int_eq(kvm_store_put_strategy(s, &m2, "plan-a", "zz", 2), 0);
    ck_assert_int_eq(kvm_store_put_strategy(s, &m1, "plan-a", "\x04\x05\x06\x07", 4), 0); /* replace */
    uint8_t *d = NULL;
    size_t n = 0;
    ck_assert_int_eq(kvm_store_get_strategy(s, &m1, "plan-a", &d, &n), 0);
    ck_assert_uint_eq(n, 4);
    ck_assert_mem_eq(d, "\x04\x05\x06\x07", 4);
    free(d);
    ck_assert_int_eq(kvm_store_get_strategy(s, &m1, "plan-b", &d, &n), 0);
    ck_assert_uint_eq(n, 0);
    ck_assert_ptr_nonnull(d);
    free(d);
    ck_assert_int_eq(kvm_store_get_strategy(s, &m1, "nope", &d, &n), KVM_ENOTFOUND);
    ck_assert_ptr_null(d);
    ck_assert_int_eq(kvm_store_put_strategy(s, &m1, "", "x", 1), KVM_EINVAL);
    strat_list l = {0};
    ck_assert_int_eq(kvm_store_list_strategies(s, &m1, strat_visit, &l), 0);
    ck_assert_int_eq(l.n, 2);
    ck_assert_str_eq(l.names[0], "plan-a");
    ck_assert_str_eq(l.names[1], "plan-b");
    memset(&l, 0, sizeof l);
    ck_assert_int_eq(kvm_store_list_strategies(s, NULL, strat_visit, &l), 0);
    ck_assert_int_eq(l.n, 3);
    ck_assert_int_eq(kvm_store_rm_strategy(s, &m2, "plan-a"), 0);
    ck_assert_int_eq(kvm_store_rm_strategy(s, &m2, "plan-a"), KVM_ENOTFOUND);

    kvm_store_model_meta mm = {.name = "stories260K", .source = "/models/stories260K.bin", .dim = 64,
                               .hidden_dim = 172, .n_layers = 5, .n_heads = 8, .n_kv_heads = 4, .head_dim = 8,
                               .vocab_size = 512, .seq_len = 512},
                         mo;
    ck_assert_int_eq(kvm_store_put_model(s, &m1, &mm), 0);
    ck_assert_int_eq(kvm_store_get_model(s, &m1, &mo), 0);
    ck_assert_str_eq(mo.name, "stories260K");
    ck_assert_str_eq(mo.source, mm.source);
    ck_assert_int_eq(mo.n_kv_heads, 4);
    ck_assert_int_eq(mo.seq_len, 512);
    ck_assert_int_eq(kvm_store_get_model(s, &m2, &mo), KVM_ENOTFOUND);
    kvm_store_doc_meta dm = {.n_tokens = 777, .source = "tinystories/val.txt#12"}, dout;
    ck_assert_int_eq(kvm_store_put_doc(s, &m2, &dm), 0);
    ck_assert_int_eq(kvm_store_get_doc(s, &m2, &dout), 0);
    ck_assert_int_eq(dout.n_tokens, 777);
    ck_assert_str_eq(dout.source, dm.source);
    kvm_store_stats t;
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    ck_assert_int_eq(t.n_strategies, 2);
    ck_assert_int_eq(t.n_models, 1);
    ck_assert_int_eq(t.n_docs, 1);
    ck_assert_int_eq(t.n_caches, 0);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
}
END_TEST

/* ---- two writers and two readers in parallel ---- */

#define CONC_PER_WRITER 150
#define CONC_TOTAL (2 * CONC_PER_WRITER)

static int writer_main(uint32_t w)
{
    kvm_store_opts o = {.map_size_bytes = 256 << 10, .no_sync = 1}; /* small map: growth under contention */
    kvm_store *s = NULL;
    if (kvm_store_open(g_path, &o, &s)) return 10;
    int rc = 0;
    for (uint32_t i = 0; i < CONC_PER_WRITER && rc == 0; i++) {
        tcache t;
        tc_make(&t, 1, w, i, 4, 200, 1);
        if (kvm_store_put_cache(s, &t.m, t.layers)) {
            fprintf(stderr, "writer %u put %u: %s\n", w, i, kvm_errmsg());
            rc = 11;
        }
        tc_free(&t);
    }
    kvm_store_close(&s);
    return rc;
}

typedef struct key_list {
    kvm_store_cache_key keys[CONC_TOTAL + 8]; /* caches listed */
    int n;                                    /* how many */
    int bad;                                  /* manifests that failed */
} key_list;

static int collect(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    key_list *l = arg;
    if (!m || status) l->bad++;
    else if (l->n < CONC_TOTAL + 8) l->keys[l->n++] = *k;
    return 0;
}

static int reader_main(void)
{
    kvm_store_id docs[2][CONC_PER_WRITER];
    for (uint32_t w = 0; w < 2; w++)
        for (uint32_t i = 0; i < CONC_PER_WRITER; i++) {
            int32_t toks[3] = {(int32_t)w, (int32_t)i, 12345};
            kvm_store_doc_hash(toks, 3, &docs[w][i]);
        }
    kvm_store *s = NULL;
    if (kvm_store_open(g_path, &(kvm_store_opts){.no_sync = 1}, &s)) return 20;
    key_list *l = malloc(sizeof *l);
    int rc = 0;
    double deadline = now_s() + 100;
    for (int done = 0; !done && rc == 0;) {
        memset(l, 0, sizeof *l);
        if (kvm_store_list_caches(s, NULL, collect, l) || l->bad) rc = 21;
        for (int j = 0; j < l->n && rc == 0; j++) {
            int w = -1, i = -1;
            for (int a = 0; a < 2 && w < 0; a++)
                for (int b = 0; b < CONC_PER_WRITER; b++)
                    if (memcmp(docs[a][b].b, l->keys[j].doc_hash.b, 32) == 0) w = a, i = b;
            if (w < 0) {
                rc = 22;
                break;
            }
            tcache t;
            tc_make(&t, 1, (uint32_t)w, (uint32_t)i, 4, 200, 1);
            kvm_store_cache *c = NULL;
            int st = kvm_store_get_cache(s, &l->keys[j], &t.m.tokenizer_id, &c);
            if (st || tc_diff(&t, c)) {
                fprintf(stderr, "reader: cache w=%d i=%d: status %d %s\n", w, i, st, kvm_errmsg());
                rc = 23;
            }
            kvm_store_cache_free(&c);
            tc_free(&t);
        }
        if (l->n == CONC_TOTAL) done = 1;
        else if (now_s() > deadline) rc = 24;
    }
    free(l);
    kvm_store_close(&s);
    return rc;
}

START_TEST(test_concurrent)
{
    kvm_store *s = open_store(g_path, 64 << 10, 0, 0, 0);
    kvm_store_close(&s);
    pid_t pids[4];
    for (int p = 0; p < 4; p++) {
        fflush(stdout);
        fflush(stderr);
        pids[p] = fork();
        ck_assert_int_ge(pids[p], 0);
        if (pids[p] == 0) _exit(p < 2 ? writer_main((uint32_t)p) : reader_main());
    }
    for (int p = 0; p < 4; p++) {
        int wst;
        ck_assert_int_eq(waitpid(pids[p], &wst, 0), pids[p]);
        ck_assert_msg(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "%s %d exited with %d", p < 2 ? "writer" : "reader", p,
                      WIFEXITED(wst) ? WEXITSTATUS(wst) : -WTERMSIG(wst));
    }
    s = open_store(g_path, 0, 0, 0, 0);
    for (uint32_t w = 0; w < 2; w++)
        for (uint32_t i = 0; i < CONC_PER_WRITER; i++) {
            tcache t;
            tc_make(&t, 1, w, i, 4, 200, 1);
            ck_assert_msg(get_cmp(s, &t) == 0, "cache w=%u i=%u lost: %s", w, i, kvm_errmsg());
            tc_free(&t);
        }
    kvm_store_stats st;
    ck_assert_int_eq(kvm_store_stats_get(s, &st), 0);
    ck_assert_int_eq(st.n_caches, CONC_TOTAL);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
}
END_TEST

/* ---- a writer killed mid-transaction, a reader killed holding a read txn ---- */

static int g_pipe_w = -1; /* write end the blocked child signals on */

static void block_forever(void *arg)
{
    (void)arg;
    if (write(g_pipe_w, "x", 1) != 1) _exit(30);
    for (;;) pause();
}

static int block_in_list(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    (void)k, (void)m, (void)status;
    block_forever(arg);
    return 0;
}

/* Forks a child that runs fn and blocks inside a transaction; kills it with SIGKILL. */
static void kill_mid_txn(int writer)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(fds[0]);
        g_pipe_w = fds[1];
        kvm_store *s = NULL;
        if (kvm_store_open(g_path, &(kvm_store_opts){.no_sync = 1}, &s)) _exit(31);
        if (writer) {
            tcache t;
            tc_make(&t, 2, 7, 999, 3, 1 << 20, 0); /* big: many pages written before the kill */
            kvm_store__set_txn_hook(s, block_forever, NULL);
            kvm_store_put_cache(s, &t.m, t.layers);
        } else {
            kvm_store_list_caches(s, NULL, block_in_list, NULL);
        }
        _exit(32);
    }
    close(fds[1]);
    char c;
    ck_assert_int_eq(read(fds[0], &c, 1), 1);
    close(fds[0]);
    ck_assert_int_eq(kill(pid, SIGKILL), 0);
    int wst;
    ck_assert_int_eq(waitpid(pid, &wst, 0), pid);
    ck_assert(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL);
}

START_TEST(test_sigkill)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache t[20];
    for (uint32_t i = 0; i < 20; i++) {
        tc_make(&t[i], 2, 0, i, 3, 3000, 1);
        put_ok(s, &t[i]);
    }
    kvm_store_close(&s);
    kill_mid_txn(0); /* a reader dies holding a read txn (stale reader slot) */
    kill_mid_txn(1); /* a writer dies holding the write lock, mid-put */
    s = open_store(g_path, 0, 0, 0, 0);
    for (uint32_t i = 0; i < 20; i++) ck_assert_int_eq(get_cmp(s, &t[i]), 0);
    tcache lost;
    tc_make(&lost, 2, 7, 999, 3, 16, 0);
    ck_assert_int_eq(has(s, &lost), 0); /* the killed put left nothing */
    tcache more;
    tc_make(&more, 2, 1, 1, 2, 100, 0);
    put_ok(s, &more); /* the write lock is usable again */
    ck_assert_int_eq(get_cmp(s, &more), 0);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
    for (int i = 0; i < 20; i++) tc_free(&t[i]);
    tc_free(&lost);
    tc_free(&more);
}
END_TEST

/* ---- corruption ---- */

/* A cache holding inf (stored before the store's encoder refused non-finite values: f16
 * overflow, a model whose activations overflow) passed `store verify` with 0 problems; its
 * layers decode to inf and every ask over it is NaN. verify now names it. */
START_TEST(test_verify_nonfinite)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache a, b;
    tc_make_dec(&a, 3, 0, 1, 2, 500);
    tc_make_dec_inf(&b, 3, 0, 2, 2, 500, 1);
    put_ok(s, &a);
    put_ok(s, &b);
    kvm_store_close(&s);
    char *err = NULL;
    int rc = run_cli(NULL, &err, "verify", "--store", g_path, NULL);
    ck_assert_msg(rc == 1 && strstr(err, "stored cache layer 1 does not decode: cache layer 1, KV head 0, key of entry "
                                         "0: inf is not a finite number"),
                  "exit %d: %s", rc, err);
    free(err);
    tc_free(&a);
    tc_free(&b);
}
END_TEST

START_TEST(test_corrupt)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache a, b, c;
    tc_make_dec(&a, 3, 0, 1, 3, 8192); /* 8 KiB payloads live in overflow pages, written once */
    tc_make_dec(&b, 3, 0, 2, 3, 500);
    tc_make_dec(&c, 3, 0, 3, 3, 500);
    put_ok(s, &a);
    put_ok(s, &b);
    put_ok(s, &c);
    kvm_store_close(&s);
    ck_assert_int_eq(run_cli(NULL, NULL, "verify", "--store", g_path, NULL), 0);

    /* flip one byte of a's layer 1 payload directly in data.mdb */
    char data[4300];
    snprintf(data, sizeof data, "%s/data.mdb", g_path);
    size_t n;
    char *file = kvm_test_read_file(data, &n);
    ck_assert_ptr_nonnull(file);
    const char *hit = find_bytes(file, n, a.payload[1], 64);
    ck_assert_ptr_nonnull(hit);
    ck_assert_ptr_null(find_bytes(hit + 1, n - (size_t)(hit + 1 - file), a.payload[1], 64)); /* exactly one copy */
    long off = (long)(hit - file) + 100;
    free(file);
    int fd = open(data, O_RDWR);
    uint8_t byte;
    ck_assert_int_eq(pread(fd, &byte, 1, off), 1);
    byte ^= 0x20;
    ck_assert_int_eq(pwrite(fd, &byte, 1, off), 1);
    close(fd);

    s = open_store(g_path, 0, 0, 0, 0);
    ck_assert_int_eq(get_cmp(s, &a), KVM_ECORRUPT);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "layer 1"));
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "checksum"));
    ck_assert_int_eq(get_cmp(s, &b), 0);
    kvm_store_close(&s);
    char *out = NULL, *err = NULL;
    ck_assert_int_eq(run_cli(&out, &err, "verify", "--store", g_path, NULL), 1);
    ck_assert_msg(strstr(err, "layer 1: checksum mismatch") != NULL, "stderr: %s", err);
    free(out);
    free(err);

    /* a flipped manifest byte (raw LMDB write); a missing layer */
    raw_edit(&b, KVM_STORE__MANIFEST, edit_flip_middle);
    raw_del(&c, 2);
    s = open_store(g_path, 0, 0, 0, 0);
    ck_assert_int_eq(get_cmp(s, &b), KVM_ECORRUPT);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "manifest"));
    ck_assert_int_eq(get_cmp(s, &c), KVM_ECORRUPT);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "layer 2: missing"));
    ck_assert_int_eq(verify_problems(s), 5); /* a layer, b manifest, c layer, atime count, cache bytes */
    kvm_store_close(&s);
    ck_assert_int_eq(run_cli(&out, &err, "verify", "--store", g_path, NULL), 1);
    ck_assert_msg(strstr(err, "1 of 3 layers missing") != NULL, "stderr: %s", err);
    ck_assert_msg(strstr(err, "manifest: checksum mismatch") != NULL, "stderr: %s", err);
    free(out);
    free(err);
    ck_assert_int_eq(run_cli(&out, &err, "ls", "--store", g_path, NULL), 1); /* b's manifest is unreadable */
    ck_assert_int_eq(count_lines(out), 3); /* header, a, c */
    free(out);
    free(err);

    /* a manifest gone: its layers are orphans */
    raw_del(&a, KVM_STORE__MANIFEST);
    ck_assert_int_eq(run_cli(&out, &err, "verify", "--store", g_path, NULL), 1);
    ck_assert_msg(strstr(err, "orphan layer value(s) without a manifest") != NULL, "stderr: %s", err);
    free(out);
    free(err);
    tc_free(&a);
    tc_free(&b);
    tc_free(&c);
}
END_TEST

/* ---- map growth ---- */

START_TEST(test_map_growth)
{
    kvm_store *s = open_store(g_path, 64 << 10, 256ll << 20, 0, 0);
    kvm_store_stats t0, t1;
    ck_assert_int_eq(kvm_store_stats_get(s, &t0), 0);
    for (uint32_t i = 0; i < 200; i++) {
        tcache t;
        tc_make(&t, 4, 0, i, 3, 4000, 1);
        put_ok(s, &t);
        tc_free(&t);
    }
    ck_assert_int_eq(kvm_store_stats_get(s, &t1), 0);
    ck_assert_int_gt(t1.map_size_bytes, t0.map_size_bytes);
    ck_assert_int_eq(t1.n_caches, 200);
    kvm_store_close(&s);

    /* another process grows the map; this one adopts it (MDB_MAP_RESIZED) */
    s = open_store(g_path, 64 << 10, 256ll << 20, 0, 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        kvm_store *cs = NULL;
        if (kvm_store_open(g_path, &(kvm_store_opts){.map_size_bytes = 64 << 10, .no_sync = 1}, &cs)) _exit(40);
        int rc = 0;
        for (uint32_t i = 200; i < 400 && rc == 0; i++) {
            tcache t;
            tc_make(&t, 4, 0, i, 3, 8000, 1);
            rc = kvm_store_put_cache(cs, &t.m, t.layers) ? 41 : 0;
            tc_free(&t);
        }
        kvm_store_close(&cs);
        _exit(rc);
    }
    int wst;
    waitpid(pid, &wst, 0);
    ck_assert(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    for (uint32_t i = 0; i < 400; i += 7) {
        tcache t;
        tc_make(&t, 4, 0, i, 3, i < 200 ? 4000 : 8000, 1);
        ck_assert_msg(get_cmp(s, &t) == 0, "cache %u: %s", i, kvm_errmsg());
        tc_free(&t);
    }
    tcache extra;
    tc_make(&extra, 4, 1, 0, 2, 100, 0);
    put_ok(s, &extra);
    tc_free(&extra);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);

    /* a map that may not grow enough: KVM_EFULL, nothing lost */
    char small[4300];
    snprintf(small, sizeof small, "%s/small", g_dir);
    s = open_store(small, 64 << 10, 512 << 10, 0, 0);
    uint32_t stored = 0;
    int st = 0;
    for (uint32_t i = 0; i < 1000; i++) {
        tcache t;
        tc_make(&t, 5, 0, i, 2, 6000, 0);
        st = kvm_store_put_cache(s, &t.m, t.layers);
        tc_free(&t);
        if (st) break;
        stored++;
    }
    ck_assert_int_eq(st, KVM_EFULL);
    ck_assert_msg(strstr(kvm_errmsg(), "map full") != NULL, "%s", kvm_errmsg());
    ck_assert_uint_gt(stored, 10);
    for (uint32_t i = 0; i < stored; i++) {
        tcache t;
        tc_make(&t, 5, 0, i, 2, 6000, 0);
        ck_assert_int_eq(get_cmp(s, &t), 0);
        tc_free(&t);
    }
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
}
END_TEST

/* ---- cap and LRU eviction ---- */

START_TEST(test_evict)
{
    tcache c[6];
    for (uint32_t i = 0; i < 6; i++) tc_make(&c[i], 6, 0, i, 2, 2000, 0);
    kvm_store *s = open_store(g_path, 0, 0, 0, -1);
    put_ok(s, &c[0]);
    kvm_store_stats t;
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    int64_t one = t.cache_bytes;
    ck_assert_int_gt(one, 4000);
    kvm_store_close(&s);

    s = open_store(g_path, 0, 0, 3 * one + one / 2, -1); /* room for three */
    ck_assert_int_eq(kvm_store_put_strategy(s, &c[0].m.model_id, "plan", "keep me", 7), 0);
    put_ok(s, &c[1]);
    put_ok(s, &c[2]);
    ck_assert_int_eq(get_cmp(s, &c[0]), 0); /* served: now the most recent */
    put_ok(s, &c[3]);                       /* evicts c1, the least recently served */
    ck_assert_int_eq(has(s, &c[1]), 0);
    ck_assert_int_eq(has(s, &c[0]), 1);
    ck_assert_int_eq(has(s, &c[2]), 1);
    ck_assert_int_eq(has(s, &c[3]), 1);
    ck_assert_int_eq(get_cmp(s, &c[2]), 0);
    put_ok(s, &c[4]); /* evicts c0 (served before c2 and put before c3) */
    ck_assert_int_eq(has(s, &c[0]), 0);
    ck_assert_int_eq(has(s, &c[2]), 1);
    ck_assert_int_eq(has(s, &c[3]), 1);
    ck_assert_int_eq(has(s, &c[4]), 1);
    ck_assert_int_eq(kvm_store_stats_get(s, &t), 0);
    ck_assert_int_eq(t.n_caches, 3);
    ck_assert_int_eq(t.n_evicted, 2);
    ck_assert_int_le(t.cache_bytes, t.cap_bytes);
    ck_assert_int_eq(t.cap_bytes, 3 * one + one / 2);
    uint8_t *d;
    size_t n;
    ck_assert_int_eq(kvm_store_get_strategy(s, &c[0].m.model_id, "plan", &d, &n), 0); /* never evicted */
    free(d);
    /* a cache larger than the cap: refused, nothing evicted */
    tcache big;
    tc_make(&big, 6, 1, 0, 2, (size_t)(4 * one), 0);
    ck_assert_int_eq(kvm_store_put_cache(s, &big.m, big.layers), KVM_EFULL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "exceeds the cap"));
    tc_free(&big);
    ck_assert_int_eq(has(s, &c[2]), 1);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);

    /* the cap is recorded in the store; stats shows it */
    char *out = NULL;
    ck_assert_int_eq(run_cli(&out, NULL, "stats", "--store", g_path, NULL), 0);
    ck_assert_msg(strstr(out, "caches          3") && strstr(out, "evicted         2") && strstr(out, "% used"),
                  "stats: %s", out);
    free(out);
    for (int i = 0; i < 6; i++) tc_free(&c[i]);
}
END_TEST

/* ---- compatibility refusal ---- */

START_TEST(test_mismatch)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache a, b;
    tc_make(&a, 7, 0, 1, 2, 100, 0);
    tc_make(&b, 7, 0, 2, 2, 100, 0);
    put_ok(s, &a);
    put_ok(s, &b);
    kvm_store_id other;
    kvm_store_hash_bytes("tok-2", 5, &other);
    kvm_store_cache_key k = tc_key(&a);
    kvm_store_cache *c = NULL;
    ck_assert_int_eq(kvm_store_get_cache(s, &k, &other, &c), KVM_EMISMATCH);
    ck_assert_ptr_null(c);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "tokenizer"));
    int found = -1;
    ck_assert_int_eq(kvm_store_has_cache(s, &k, &other, &found), KVM_EMISMATCH);
    ck_assert_int_eq(found, 0);
    /* ids that differ only past their first 12 hex digits: the message shows both in full (it
     * printed "built with tokenizer X, expected tokenizer X" with the same 12 digits twice) */
    kvm_store_id near = a.m.tokenizer_id;
    near.b[31] ^= 1;
    char hex_stored[KVM_STORE_ID_HEX + 1], hex_near[KVM_STORE_ID_HEX + 1];
    kvm_store_id_hex(&a.m.tokenizer_id, hex_stored);
    kvm_store_id_hex(&near, hex_near);
    ck_assert_int_eq(kvm_store_get_cache(s, &k, &near, &c), KVM_EMISMATCH);
    ck_assert_msg(strstr(kvm_errmsg(), hex_stored) && strstr(kvm_errmsg(), hex_near), "%s", kvm_errmsg());
    kvm_store_close(&s);
    /* a manifest (valid checksum) naming another model id, differing in its last byte */
    raw_edit(&a, KVM_STORE__MANIFEST, edit_model_id_last);
    s = open_store(g_path, 0, 0, 0, 0);
    ck_assert_int_eq(kvm_store_get_cache(s, &k, &a.m.tokenizer_id, &c), KVM_EMISMATCH);
    kvm_store_id moved = a.m.model_id;
    moved.b[31] ^= 1;
    kvm_store_id_hex(&moved, hex_near);
    kvm_store_id_hex(&a.m.model_id, hex_stored);
    ck_assert_msg(strstr(kvm_errmsg(), "model id") && strstr(kvm_errmsg(), hex_stored) &&
                      strstr(kvm_errmsg(), hex_near),
                  "%s", kvm_errmsg());
    kvm_store_close(&s);
    raw_edit(&a, KVM_STORE__MANIFEST, edit_model_id_last); /* back, for what follows */

    /* a manifest of another store format version (valid checksum): refused, not misread */
    raw_edit(&b, KVM_STORE__MANIFEST, edit_version2);
    s = open_store(g_path, 0, 0, 0, 0);
    ck_assert_int_eq(get_cmp(s, &b), KVM_EMISMATCH);
    ck_assert_msg(strstr(kvm_errmsg(), "format version 2") != NULL, "%s", kvm_errmsg());
    ck_assert_int_eq(get_cmp(s, &a), 0);
    kvm_store_close(&s);

    /* a whole store of another format version */
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    raw_open(&env, &txn, &dbi, "meta");
    uint8_t v[8];
    kvm_store__put_u64(v, 2);
    MDB_val key = {14, "format_version"}, val = {8, v};
    ck_assert_int_eq(mdb_put(txn, dbi, &key, &val, 0), 0);
    raw_close(env, txn);
    /* a newer kvmill's store: not supported by this build, not "mismatched model, tokenizer or config" */
    ck_assert_int_eq(kvm_store_open(g_path, NULL, &s), KVM_ENOTSUP);
    ck_assert_ptr_null(s);
    ck_assert_int_eq(kvm_store_open(g_path, &(kvm_store_opts){.read_only = 1}, &s), KVM_ENOTSUP);
    ck_assert_msg(strstr(kvm_errmsg(), "written by a newer kvmill"), "%s", kvm_errmsg());
    tc_free(&a);
    tc_free(&b);
}
END_TEST

/* A store on a network filesystem is refused before LMDB opens it (README: "never point --store at an
 * LMDB directory on a network filesystem"): nothing checked it, so two hosts could write one store
 * through NFS and corrupt it. statfs magics of such filesystems are named; local ones are not. */
START_TEST(test_network_fs)
{
    ck_assert_str_eq(kvm_store__network_fs(0x6969), "nfs");
    ck_assert_str_eq(kvm_store__network_fs(0xFF534D42ul), "cifs");
    ck_assert_str_eq(kvm_store__network_fs(0xFE534D42ul), "smb2");
    ck_assert_str_eq(kvm_store__network_fs(0x00C36400), "ceph");
    ck_assert_str_eq(kvm_store__network_fs(0x0BD00BD0), "lustre");
    ck_assert_ptr_null(kvm_store__network_fs(0xEF53));       /* ext2/3/4 */
    ck_assert_ptr_null(kvm_store__network_fs(0x01021994));   /* tmpfs */
    ck_assert_ptr_null(kvm_store__network_fs(0x58465342));   /* xfs */
    ck_assert_ptr_null(kvm_store__network_fs(0x794C7630));   /* overlayfs */
    ck_assert_ptr_null(kvm_store__network_fs(0x65735546));   /* fuse: local ones too */
    ck_assert_int_eq(kvm_store__check_fs("/nonexistent/kvmill-store"), 0); /* left to the open, which names it */
}
END_TEST

/* ---- CLI ---- */

START_TEST(test_cli_missing_path)
{
    char missing[4300];
    snprintf(missing, sizeof missing, "%s/nope", g_dir);
    char *out = NULL, *err = NULL;
    /* a store that is not there is an error, as for verify (issue 11) */
    ck_assert_int_eq(run_cli(&out, &err, "ls", "--store", missing, "--csv", NULL), 2);
    ck_assert_str_eq(out, "");
    ck_assert_ptr_nonnull(strstr(err, "cannot open store"));
    free(out);
    free(err);
    /* stats too: every store command refuses a store that does not exist (README) */
    ck_assert_int_eq(run_cli(&out, &err, "stats", "--store", missing, NULL), 2);
    ck_assert_str_eq(out, "");
    ck_assert_ptr_nonnull(strstr(err, "cannot open store"));
    free(out);
    free(err);
    struct stat st;
    ck_assert_int_ne(stat(missing, &st), 0); /* not created */
    ck_assert_int_eq(run_cli(NULL, &err, "verify", "--store", missing, NULL), 2);
    ck_assert_ptr_nonnull(strstr(err, "cannot open store"));
    free(err);
    ck_assert_int_eq(run_cli(NULL, NULL, "rm", "--store", missing, "a:b:c", NULL), 2);
    ck_assert_int_ne(stat(missing, &st), 0);

    /* a file, and a directory of garbage: not LMDB environments */
    char file[4300];
    snprintf(file, sizeof file, "%s/file", g_dir);
    ck_assert_int_eq(kvm_test_write_file(file, "hello", 5), 0);
    ck_assert_int_eq(run_cli(NULL, &err, "verify", "--store", file, NULL), 2);
    ck_assert_msg(strstr(err, "not an LMDB environment") != NULL, "%s", err);
    free(err);
    ck_assert_int_eq(run_cli(NULL, NULL, "ls", "--store", file, NULL), 2);
    mkdir(g_path, 0775);
    char data[4300];
    snprintf(data, sizeof data, "%s/data.mdb", g_path);
    char junk[8192];
    memset(junk, 'j', sizeof junk);
    ck_assert_int_eq(kvm_test_write_file(data, junk, sizeof junk), 0);
    ck_assert_int_eq(run_cli(NULL, &err, "verify", "--store", g_path, NULL), 2);
    ck_assert_msg(strstr(err, "not an LMDB environment") != NULL, "%s", err);
    free(err);

    /* an LMDB environment of another program: refused, left untouched */
    kvm_test_rmtree(g_path);
    foreign_lmdb(g_path, 20);
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_path, NULL, &s), KVM_EFORMAT);
    ck_assert_int_eq(run_cli(NULL, &err, "verify", "--store", g_path, NULL), 2);
    ck_assert_msg(strstr(err, "not a kvmill store") != NULL, "%s", err);
    free(err);
    ck_assert_int_eq(run_cli(NULL, NULL, "ls", "--store", g_path, NULL), 2);
}
END_TEST

/* Names in folder dir (without "." and ".."), joined by ' ' into buf. */
static const char *dir_names(const char *dir, char *buf, size_t size)
{
    buf[0] = '\0';
    DIR *dp = opendir(dir);
    ck_assert_ptr_nonnull(dp);
    for (struct dirent *e; (e = readdir(dp));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            snprintf(buf + strlen(buf), size - strlen(buf), "%s%s", buf[0] ? " " : "", e->d_name);
    closedir(dp);
    return buf;
}

/* The read-only store commands on a folder that holds no store leave it as they found it. A
 * data.mdb that is not an LMDB file (garbage, text) was refused only by mdb_env_open, which
 * had created lock.mdb first: the failed inspection left a new file in the user's folder. It
 * is now refused before LMDB opens anything, naming the file; a lock.mdb that LMDB makes on
 * the way to another refusal (an LMDB environment of another program) is removed again; one
 * that was there before is kept. A folder without data.mdb gets neither file. */
START_TEST(test_cli_readonly_leaves_no_files)
{
    const char *subs[][3] = {
        {"ls", NULL, NULL}, {"stats", NULL, NULL}, {"verify", NULL, NULL}, {"show", "a:b:c", NULL}};
    char data[4300], lock[4300], names[512], *err = NULL;
    snprintf(data, sizeof data, "%s/data.mdb", g_path);
    snprintf(lock, sizeof lock, "%s/lock.mdb", g_path);
    ck_assert_int_eq(mkdir(g_path, 0775), 0);
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) { /* no data.mdb */
        int rc = run_cli(NULL, &err, subs[i][0], "--store", g_path, subs[i][1], NULL);
        ck_assert_msg(rc == 2 && strstr(err, "no data.mdb"), "store %s: exit %d: %s", subs[i][0], rc, err);
        ck_assert_msg(!strcmp(dir_names(g_path, names, sizeof names), ""), "store %s left: %s", subs[i][0], names);
        free(err);
    }
    char junk[8192], text[600];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (char)(i * 7 + 3);
    memset(text, 'x', sizeof text);
    const struct {
        const char *bytes;
        size_t n;
    } files[] = {{junk, sizeof junk}, {text, sizeof text}};
    for (size_t f = 0; f < 2; f++) {
        ck_assert_int_eq(kvm_test_write_file(data, files[f].bytes, files[f].n), 0);
        for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
            int rc = run_cli(NULL, &err, subs[i][0], "--store", g_path, subs[i][1], NULL);
            ck_assert_msg(rc == 2 && strstr(err, data) && strstr(err, "is not an LMDB file") &&
                              strstr(err, "not an LMDB environment"),
                          "store %s, %zu bytes: exit %d: %s", subs[i][0], files[f].n, rc, err);
            ck_assert_msg(!strcmp(dir_names(g_path, names, sizeof names), "data.mdb"), "store %s left: %s", subs[i][0],
                          names);
            free(err);
        }
        kvm_store *s = NULL; /* the library as well */
        kvm_store_opts ro = {.read_only = 1};
        ck_assert_int_eq(kvm_store_open(g_path, &ro, &s), KVM_EFORMAT);
        ck_assert_ptr_null(s);
        ck_assert_msg(!strcmp(dir_names(g_path, names, sizeof names), "data.mdb"), "open left: %s", names);
    }
    ck_assert_int_eq(kvm_test_write_file(lock, "held", 4), 0); /* another's lock file: never removed */
    ck_assert_int_eq(run_cli(NULL, NULL, "ls", "--store", g_path, NULL), 2);
    size_t n = 0;
    char *kept = kvm_test_read_file(lock, &n);
    ck_assert_msg(kept && n == 4 && !memcmp(kept, "held", 4), "lock.mdb was removed or changed");
    free(kept);

    /* an LMDB environment of another program, without its lock.mdb: LMDB makes one before the
     * store is found not to be kvmill's; the refusal removes it, and keeps one that was there */
    kvm_test_rmtree(g_path);
    foreign_lmdb(g_path, 1);
    for (int with_lock = 0; with_lock < 2; with_lock++) {
        if (!with_lock) ck_assert_int_eq(unlink(lock), 0);
        for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
            int rc = run_cli(NULL, &err, subs[i][0], "--store", g_path, subs[i][1], NULL);
            ck_assert_msg(rc == 2 && strstr(err, "not a kvmill store"), "store %s: exit %d: %s", subs[i][0], rc, err);
            free(err);
            const char *want = with_lock ? "data.mdb lock.mdb" : "data.mdb";
            char got[512];
            dir_names(g_path, got, sizeof got);
            int same = !strcmp(got, want) || (with_lock && !strcmp(got, "lock.mdb data.mdb"));
            ck_assert_msg(same, "store %s, %s lock.mdb before: the folder holds %s", subs[i][0], with_lock ? "a" : "no",
                          got);
        }
        if (!with_lock) ck_assert_int_eq(kvm_test_write_file(lock, "", 0), 0);
    }
}
END_TEST

/* A failed read-write open (run, the library's) left the lock.mdb LMDB made on the way (the
 * read-only commands already removed theirs): an LMDB environment of another program, refused
 * after mdb_env_open, keeps its folder as it was, and a lock.mdb that was there is kept. */
START_TEST(test_writable_open_leaves_no_lock)
{
    char lock[4300], names[512], *err = NULL;
    snprintf(lock, sizeof lock, "%s/lock.mdb", g_path);
    foreign_lmdb(g_path, 64); /* more keys than a kvmill store's databases: another program's */
    ck_assert_int_eq(unlink(lock), 0);
    char cfg[4300], text[9000], cmd[13000];
    snprintf(cfg, sizeof cfg, "%s/run.ini", g_dir);
    snprintf(text, sizeof text, "[model]\npath = %s\n[store]\npath = %s\n",
             kvm_test_data_path("models/stories260K.bin"), g_path);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    for (int with_lock = 0; with_lock < 2; with_lock++) {
        const char *want = with_lock ? "data.mdb lock.mdb" : "data.mdb";
        int rc = kvm_test_run(cmd, NULL, &err); /* run opens the store read-write */
        ck_assert_msg(rc != 0 && strstr(err, "another program, not a kvmill store"), "run: exit %d: %s", rc, err);
        free(err);
        dir_names(g_path, names, sizeof names);
        ck_assert_msg(!strcmp(names, want) || (with_lock && !strcmp(names, "lock.mdb data.mdb")),
                      "run, %s lock.mdb before: the folder holds %s", with_lock ? "a" : "no", names);
        kvm_store *s = NULL; /* the library's read-write open as well */
        ck_assert_int_eq(kvm_store_open(g_path, NULL, &s), KVM_EFORMAT);
        ck_assert_ptr_null(s);
        dir_names(g_path, names, sizeof names);
        ck_assert_msg(!strcmp(names, want) || (with_lock && !strcmp(names, "lock.mdb data.mdb")),
                      "kvm_store_open, %s lock.mdb before: the folder holds %s", with_lock ? "a" : "no", names);
        if (!with_lock) ck_assert_int_eq(kvm_test_write_file(lock, "", 0), 0);
    }
}
END_TEST

/* Opens g_path read-write in a child whose files may not grow past fsize_bytes (SIGXFSZ
 * ignored: writes past it fail with EFBIG). Returns the open's status; its message in msg. */
static int open_limited(rlim_t fsize_bytes, char *msg, size_t size)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(fds[0]);
        struct rlimit rl = {fsize_bytes, fsize_bytes};
        signal(SIGXFSZ, SIG_IGN);
        kvm_store *s = NULL;
        int st = setrlimit(RLIMIT_FSIZE, &rl) ? 99 : -kvm_store_open(g_path, NULL, &s);
        const char *m = kvm_errmsg();
        if (write(fds[1], m, strlen(m)) < 0) st = 98;
        kvm_store_close(&s);
        _exit(st);
    }
    close(fds[1]);
    ssize_t n = read(fds[0], msg, size - 1);
    msg[n > 0 ? n : 0] = '\0';
    close(fds[0]);
    int wst = 0;
    ck_assert_int_eq(waitpid(pid, &wst, 0), pid);
    ck_assert_msg(WIFEXITED(wst) && WEXITSTATUS(wst) != 98 && WEXITSTATUS(wst) != 99, "child: %d", wst);
    return -WEXITSTATUS(wst);
}

/* A read-write open that creates a store and fails (here a file size limit; a full disk does
 * the same) left what it created: LMDB writes data.mdb's two meta pages, the first commit
 * fails, and the folder kept a data.mdb holding no store (a later open took it for one, or,
 * cut shorter, refused it as damaged), with the lock.mdb and the directory the open made. Now
 * the folder is as the open found it; a lock.mdb that was there stays. */
START_TEST(test_failed_create_leaves_folder)
{
    char msg[1024], names[512], lock[4300];
    snprintf(lock, sizeof lock, "%s/lock.mdb", g_path);
    /* a folder holding only a lock.mdb (its store moved away): 12 KiB holds the meta pages only */
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    kvm_store_close(&s);
    char data[4300];
    snprintf(data, sizeof data, "%s/data.mdb", g_path);
    ck_assert_int_eq(unlink(data), 0);
    int st = open_limited(12288, msg, sizeof msg);
    printf("failed creation: %d %s\n", st, msg);
    ck_assert_msg(st != 0 && strstr(msg, g_path), "open: %d %s", st, msg);
    ck_assert_msg(!strcmp(dir_names(g_path, names, sizeof names), "lock.mdb"), "the folder holds %s", names);
    /* a new directory: the lock file cannot get its size, the open fails before data.mdb */
    kvm_test_rmtree(g_path);
    st = open_limited(12288, msg, sizeof msg);
    ck_assert_msg(st != 0 && strstr(msg, g_path), "open: %d %s", st, msg);
    struct stat sb;
    ck_assert_msg(stat(g_path, &sb) != 0 && errno == ENOENT, "the new directory was left: %s",
                  dir_names(g_path, names, sizeof names));
    /* an existing store is kept whatever fails: the limit below its size */
    s = open_store(g_path, 0, 0, 0, 0);
    kvm_store_close(&s);
    st = open_limited(4096, msg, sizeof msg);
    printf("existing store under a 4 KiB limit: %d %s\n", st, msg);
    ck_assert_int_eq(stat(data, &sb), 0);
    ck_assert_int_eq(stat(lock, &sb), 0);
    s = open_store(g_path, 0, 0, 0, 0);
    kvm_store_close(&s);
}
END_TEST

/* A writable open that creates a store in a directory that is there and holds other files (a
 * corpus folder given as --store by mistake) put data.mdb and lock.mdb among them: now refused
 * (KVM_EINVAL, a usage error: run and serve exit 2) naming the folder, how many entries and
 * one, and the folder is left as it was (`kvmill run --store` exit 2: check_newuser). An empty folder, one holding only
 * lost+found (a fresh filesystem), or only a lock.mdb, is used; an existing store with other files beside it opens. */
START_TEST(test_create_in_foreign_dir)
{
    char f[4400], names[512];
    ck_assert_int_eq(mkdir(g_path, 0775), 0);
    snprintf(f, sizeof f, "%s/doc_000.txt", g_path);
    ck_assert_int_eq(kvm_test_write_file(f, "text", 4), 0);
    snprintf(f, sizeof f, "%s/doc_001.txt", g_path);
    ck_assert_int_eq(kvm_test_write_file(f, "text", 4), 0);
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(g_path, NULL, &s), KVM_EINVAL);
    ck_assert_ptr_null(s);
    const char *msg = kvm_errmsg();
    printf("non-empty folder: %s\n", msg);
    ck_assert_msg(strstr(msg, g_path) && strstr(msg, "2 entries") && strstr(msg, "doc_00") &&
                      strstr(msg, "empty or new folder"),
                  "%s", msg);
    const char *got = dir_names(g_path, names, sizeof names);
    ck_assert_msg(!strstr(got, "data.mdb") && !strstr(got, "lock.mdb"), "the folder now holds %s", got);
    /* an empty folder and one holding lost+found only: used */
    kvm_test_rmtree(g_path);
    ck_assert_int_eq(mkdir(g_path, 0775), 0);
    s = open_store(g_path, 0, 0, 0, 0);
    kvm_store_close(&s);
    kvm_test_rmtree(g_path);
    ck_assert_int_eq(mkdir(g_path, 0775), 0);
    snprintf(f, sizeof f, "%s/lost+found", g_path);
    ck_assert_int_eq(mkdir(f, 0700), 0);
    snprintf(f, sizeof f, "%s/.gitkeep", g_path); /* hidden: housekeeping, not a corpus */
    ck_assert_int_eq(kvm_test_write_file(f, "", 0), 0);
    s = open_store(g_path, 0, 0, 0, 0);
    /* an existing store with a file put beside it later still opens, read-write too */
    kvm_store_close(&s);
    snprintf(f, sizeof f, "%s/NOTES", g_path);
    ck_assert_int_eq(kvm_test_write_file(f, "x", 1), 0);
    s = open_store(g_path, 0, 0, 0, 0);
    kvm_store_close(&s);
}
END_TEST

/* Two processes that open one new store at once (deploy/slurm/kvmill.sbatch starts the store
 * service and the run together on one [store] path): the second checked for data.mdb, found none,
 * then listed the folder after the first had created data.mdb, and refused a store folder "that
 * holds 1 entry that is not a store's (such as 'data.mdb')" (CI, 7 Dec). A child makes and removes
 * data.mdb over and over while this process checks the folder: the listing alone decides now, so
 * every check accepts it. */
START_TEST(test_create_while_another_creates)
{
    char data[4400];
    ck_assert_int_eq(mkdir(g_path, 0775), 0);
    snprintf(data, sizeof data, "%s/data.mdb", g_path);
    pid_t pid = fork();
    ck_assert_int_ne(pid, -1);
    if (pid == 0) {
        for (;;) {
            int fd = open(data, O_WRONLY | O_CREAT, 0644);
            if (fd >= 0) close(fd);
            unlink(data);
        }
    }
    int refused = 0;
    char why[512] = "";
    for (int i = 0; i < 20000 && !refused; i++)
        if (kvm_store_check_new_dir(g_path)) {
            refused = 1;
            snprintf(why, sizeof why, "%s", kvm_errmsg());
        }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ck_assert_msg(!refused, "refused while another process created the store: %s", why);
    /* a foreign file beside it is still refused */
    unlink(data);
    snprintf(data, sizeof data, "%s/doc_000.txt", g_path);
    ck_assert_int_eq(kvm_test_write_file(data, "text", 4), 0);
    ck_assert_int_eq(kvm_store_check_new_dir(g_path), KVM_EINVAL);
}
END_TEST

/* A new store's parent folder: missing, a plain file, or there (kvmill serve --compute-missing
 * refuses the first two at start; its decode workers each failed to create the store). */
START_TEST(test_check_new_dir_parent)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/no/such/s.lmdb", g_dir);
    ck_assert_int_eq(kvm_store_check_new_dir(p), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), p) && strstr(kvm_errmsg(), "/no/such does not exist"), "%s", kvm_errmsg());
    snprintf(p, sizeof p, "%s/file", g_dir);
    ck_assert_int_eq(kvm_test_write_file(p, "x", 1), 0);
    snprintf(p, sizeof p, "%s/file/s.lmdb", g_dir);
    ck_assert_int_eq(kvm_store_check_new_dir(p), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "/file is not a folder"), "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_check_new_dir(g_path), 0); /* not there, in a folder that is */
    snprintf(p, sizeof p, "%s/", g_path);
    ck_assert_int_eq(kvm_store_check_new_dir(p), 0); /* a trailing slash names the same folder */
}
END_TEST

START_TEST(test_cli_commands)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache t[3];
    tc_make_dec(&t[0], 8, 0, 0, 2, 1000);
    /* two caches of model 9 whose doc hashes share their first hex digit: "X:D:C" is ambiguous */
    char h[65], h2[65];
    uint32_t i2 = 2;
    tc_make_dec(&t[1], 9, 0, 1, 3, 500);
    kvm_store_id_hex(&t[1].m.doc_hash, h);
    for (;; i2++) {
        tc_make_dec(&t[2], 9, 0, i2, 3, 500);
        if (kvm_store_id_hex(&t[2].m.doc_hash, h2)[0] == h[0]) break;
        tc_free(&t[2]);
    }
    for (int i = 0; i < 3; i++) put_ok(s, &t[i]);
    kvm_store_close(&s);

    char *out = NULL, *err = NULL, want[512], key[256], m[65], d[65], c[65];
    ck_assert_int_eq(run_cli(&out, &err, "ls", "--store", g_path, "--csv", NULL), 0);
    ck_assert_int_eq(count_lines(out), 4);
    ck_assert_ptr_eq(strstr(out, "model_id,doc_hash,config_id,tokens,entries,bytes,ratio,dtype\n"), out);
    kvm_store_id_hex(&t[0].m.model_id, m);
    kvm_store_id_hex(&t[0].m.doc_hash, d);
    kvm_store_id_hex(&t[0].m.config_id, c);
    int64_t bytes = 0; /* the layers' frame bytes */
    for (int l = 0; l < 2; l++)
        for (uint32_t f = 0; f < t[0].layers[l].n_frames; f++)
            bytes += (int64_t)t[0].layers[l].frames[f].size;
    snprintf(want, sizeof want, "%s,%s,%s,100,40,%lld,%.3f,f32\n", m, d, c, (long long)bytes,
             (double)t[0].m.full_bytes / (double)bytes);
    ck_assert_msg(strstr(out, want) != NULL, "want row %s in:\n%s", want, out);
    free(out);
    free(err);
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--model", m, NULL), 0);
    ck_assert_int_eq(count_lines(out), 2); /* header + model 8's cache */
    free(out);
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, NULL), 0);
    ck_assert_int_eq(count_lines(out), 4);
    free(out);

    /* show with unique prefixes */
    snprintf(key, sizeof key, "%.8s:%.8s:%.8s", m, d, c);
    ck_assert_int_eq(run_cli(&out, &err, "show", "--store", g_path, key, NULL), 0);
    ck_assert_msg(strstr(out, d) && strstr(out, "layers        2") && strstr(out, "tokens        100"), "%s", out);
    free(out);
    free(err);
    /* ambiguous, malformed, unknown */
    kvm_store_id_hex(&t[1].m.model_id, m);
    kvm_store_id_hex(&t[1].m.config_id, c);
    snprintf(key, sizeof key, "%.6s:%c:%.6s", m, h[0], c);
    ck_assert_int_eq(run_cli(NULL, &err, "show", "--store", g_path, key, NULL), 2);
    ck_assert_msg(strstr(err, "ambiguous") && strstr(err, "2 caches"), "%s", err);
    free(err);
    ck_assert_int_eq(run_cli(NULL, &err, "show", "--store", g_path, "xyz", NULL), 2);
    ck_assert_ptr_nonnull(strstr(err, "MODELID:DOCHASH:CONFIGID"));
    free(err);
    ck_assert_int_eq(run_cli(NULL, &err, "show", "--store", g_path, "zz:aa:bb", NULL), 2);
    ck_assert_ptr_nonnull(strstr(err, "not hexadecimal"));
    free(err);
    ck_assert_int_eq(run_cli(NULL, NULL, "show", "--store", g_path, "a:b:c:d", NULL), 2);
    ck_assert_int_eq(run_cli(NULL, NULL, "show", "--store", g_path, NULL), 2);
    snprintf(key, sizeof key, "%.6s:%c:%.6s", m, h[0] == '0' ? '1' : '0', c);
    ck_assert_int_eq(run_cli(NULL, &err, "show", "--store", g_path, key, NULL), 1);
    ck_assert_ptr_nonnull(strstr(err, "no cache"));
    free(err);

    /* rm, then stats and verify */
    snprintf(key, sizeof key, "%.6s:%.5s:%.6s", m, h2, c);
    ck_assert_int_eq(run_cli(&out, NULL, "rm", "--store", g_path, key, NULL), 0);
    ck_assert_ptr_nonnull(strstr(out, h2));
    free(out);
    ck_assert_int_eq(run_cli(NULL, NULL, "rm", "--store", g_path, key, NULL), 1);
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--csv", NULL), 0);
    ck_assert_int_eq(count_lines(out), 3);
    free(out);
    ck_assert_int_eq(run_cli(&out, NULL, "stats", "--store", g_path, NULL), 0);
    ck_assert_msg(strstr(out, "caches          2") && strstr(out, "cap_bytes       none"), "%s", out);
    free(out);
    ck_assert_int_eq(run_cli(&out, NULL, "verify", "--store", g_path, NULL), 0);
    ck_assert_ptr_nonnull(strstr(out, " 0 problem"));
    free(out);

    /* usage errors and help */
    ck_assert_int_eq(run_cli(NULL, NULL, NULL), 2);
    ck_assert_int_eq(run_cli(&out, NULL, "--help", NULL), 0);
    ck_assert_ptr_nonnull(strstr(out, "verify"));
    free(out);
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--help", NULL), 0);
    ck_assert_ptr_nonnull(strstr(out, "--csv"));
    free(out);
    ck_assert_int_eq(run_cli(NULL, &err, "frobnicate", "--store", g_path, NULL), 2);
    ck_assert_ptr_nonnull(strstr(err, "unknown subcommand"));
    free(err);
    ck_assert_int_eq(run_cli(NULL, &err, "ls", NULL), 2);
    ck_assert_ptr_nonnull(strstr(err, "--store"));
    free(err);
    ck_assert_int_eq(run_cli(NULL, NULL, "ls", "--store", g_path, "--bogus", NULL), 2);
    ck_assert_int_eq(run_cli(NULL, NULL, "ls", "--store", g_path, "--model", "zz", NULL), 2);
    ck_assert_int_eq(run_cli(NULL, NULL, "stats", "--store", g_path, "extra", NULL), 2);
    for (int i = 0; i < 3; i++) tc_free(&t[i]);
}
END_TEST

/* The real binary, when it is built: `kvmill store` is wired into main.c. */
START_TEST(test_cli_binary)
{
    char bin[4300], cmd[9000];
    snprintf(bin, sizeof bin, "%s/kvmill", kvm_test_bin());
    if (access(bin, X_OK) != 0) {
        fprintf(stderr, "check_store: SKIP test_cli_binary: %s not built\n", bin);
        return;
    }
    char *out = NULL;
    snprintf(cmd, sizeof cmd, "'%s' --help", bin);
    int rc = kvm_test_run(cmd, &out, NULL);
    if (rc != 0 || !out || !strstr(out, "  store ")) {
        fprintf(stderr, "check_store: SKIP test_cli_binary: %s predates `kvmill store` (rebuild it)\n", bin);
        free(out);
        return;
    }
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' store ls --csv --store '%s/none'", bin, g_dir);
    rc = kvm_test_run(cmd, &out, NULL);
    ck_assert_int_eq(rc, 2); /* no store there: an error, as for verify */
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' store verify --store '%s/none'", bin, g_dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 2);
}
END_TEST

/* ---- the document-name index ---- */

/* Puts n documents named "dir/doc_I.txt" (doc hashes from tokens {I, 777}). */
/* Nothing listed the names --doc-name takes (the docs db's sources): `store ls --names` adds
 * each cache's document name, "-" for a document the store has no record of; in CSV a last
 * name column, quoted when it holds a comma or a quote. */
START_TEST(test_cli_ls_names)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache t[3];
    const char *names[3] = {"doc_000.txt", "a,\"b\".txt", NULL};
    for (uint32_t i = 0; i < 3; i++) {
        tc_make(&t[i], 8, 0, i, 2, 100, 0);
        put_ok(s, &t[i]);
        if (!names[i]) continue;
        kvm_store_doc_meta dm = {.n_tokens = 100};
        snprintf(dm.source, sizeof dm.source, "%s", names[i]);
        ck_assert_msg(kvm_store_put_doc(s, &t[i].m.doc_hash, &dm) == 0, "%s", kvm_errmsg());
    }
    kvm_store_close(&s);
    const char *csv_name[3] = {",doc_000.txt\n", ",\"a,\"\"b\"\".txt\"\n", ",-\n"};
    const char *table_name[3] = {" doc_000.txt\n", " a,\"b\".txt\n", " -\n"};
    char *out = NULL, want[512], d[65];
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--csv", "--names", NULL), 0);
    ck_assert_int_eq(count_lines(out), 4);
    ck_assert_ptr_eq(strstr(out, "model_id,doc_hash,config_id,tokens,entries,bytes,ratio,dtype,name\n"), out);
    for (int i = 0; i < 3; i++) {
        const char *row = strstr(out, kvm_store_id_hex(&t[i].m.doc_hash, d));
        ck_assert_msg(row, "no row for doc %d in:\n%s", i, out);
        size_t len = strcspn(row, "\n") + 1, nl = strlen(csv_name[i]);
        ck_assert_msg(len >= nl && !strncmp(row + len - nl, csv_name[i], nl), "row %.*s: want the name %s", (int)len,
                      row, csv_name[i]);
    }
    free(out);
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--names", NULL), 0);
    ck_assert_msg(strstr(out, " DTYPE  NAME\n"), "header: %s", out);
    for (int i = 0; i < 3; i++) {
        snprintf(want, sizeof want, "%.12s", kvm_store_id_hex(&t[i].m.doc_hash, d));
        const char *row = strstr(out, want);
        ck_assert_msg(row, "no row for doc %d in:\n%s", i, out);
        size_t len = strcspn(row, "\n") + 1, nl = strlen(table_name[i]);
        ck_assert_msg(len >= nl && !strncmp(row + len - nl, table_name[i], nl), "row %.*s: want the name %s",
                      (int)len, row, table_name[i]);
    }
    free(out);
    for (int i = 0; i < 3; i++) tc_free(&t[i]);
}
END_TEST

/* A JSONL id may hold a line break or a terminal escape: the table of `store ls --names` printed
 * it raw, so one row took two lines and ESC[31m recoloured the terminal. Control bytes are
 * \xNN there now (CSV keeps the bytes, quoted). */
START_TEST(test_cli_ls_names_control_bytes)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache t;
    tc_make(&t, 8, 0, 5, 2, 100, 0);
    put_ok(s, &t);
    kvm_store_doc_meta dm = {.n_tokens = 100};
    snprintf(dm.source, sizeof dm.source, "%s", "new\nline\x1b[31mred");
    ck_assert_msg(kvm_store_put_doc(s, &t.m.doc_hash, &dm) == 0, "%s", kvm_errmsg());
    kvm_store_close(&s);
    char *out = NULL;
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--names", NULL), 0);
    ck_assert_int_eq(count_lines(out), 2);
    ck_assert_msg(strstr(out, " new\\x0aline\\x1b[31mred\n") && !strchr(out, 0x1b), "table: %s", out);
    free(out);
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--names", "--csv", NULL), 0);
    ck_assert_msg(strstr(out, ",\"new\nline\x1b[31mred\"\n"), "csv: %s", out);
    free(out);
    tc_free(&t);
}
END_TEST

/* store ls --names printed a name that is not UTF-8 (a Latin-1 file name, a JSONL id's bytes)
 * raw: the terminal showed garbage, or joined the bytes with what followed, and a C1 control
 * (U+009B, CSI) could drive it. The table escapes such bytes as \xNN, and a backslash and the
 * bidirectional controls as well, and keeps UTF-8 text (é, CJK, emoji) as it is; --csv keeps
 * every byte as stored. */
START_TEST(test_cli_ls_names_not_utf8)
{
    const char *names[] = {"caf\xe9.txt",
                           "\xff\xfe-bom.txt",
                           "ok-caf\xc3\xa9-\xe6\x96\x87-\xf0\x9f\x98\x80.txt",
                           "csi\xc2\x9b"
                           "31m.txt",
                           "cut\xe6\x96.txt",
                           "lit\\xe9.txt", /* a backslash of the name: escaped too, so \xNN always means a byte */
                           "rlo\xe2\x80\xaetxt.exe"}; /* U+202E, a bidi override, would reorder the line */
    const char *shown[] = {" caf\\xe9.txt\n",
                           " \\xff\\xfe-bom.txt\n",
                           " ok-caf\xc3\xa9-\xe6\x96\x87-\xf0\x9f\x98\x80.txt\n",
                           " csi\\xc2\\x9b31m.txt\n",
                           " cut\\xe6\\x96.txt\n",
                           " lit\\x5cxe9.txt\n",
                           " rlo\\xe2\\x80\\xaetxt.exe\n"};
    enum { N = sizeof names / sizeof names[0] };
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache t[N];
    for (int i = 0; i < N; i++) {
        tc_make(&t[i], 8, 0, (uint32_t)(20 + i), 2, 100, 0);
        put_ok(s, &t[i]);
        kvm_store_doc_meta dm = {.n_tokens = 100};
        snprintf(dm.source, sizeof dm.source, "%s", names[i]);
        ck_assert_msg(kvm_store_put_doc(s, &t[i].m.doc_hash, &dm) == 0, "%s", kvm_errmsg());
    }
    kvm_store_close(&s);
    char *out = NULL;
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--names", NULL), 0);
    ck_assert_int_eq(count_lines(out), N + 1);
    for (int i = 0; i < N; i++)
        ck_assert_msg(strstr(out, shown[i]), "table lacks '%s':\n%s", shown[i], out);
    free(out);
    ck_assert_int_eq(run_cli(&out, NULL, "ls", "--store", g_path, "--names", "--csv", NULL), 0);
    for (int i = 0; i < N; i++) {
        char want[128];
        snprintf(want, sizeof want, ",%s\n", names[i]);
        ck_assert_msg(strstr(out, want), "csv lacks '%s':\n%s", names[i], out);
    }
    free(out);
    for (int i = 0; i < N; i++)
        tc_free(&t[i]);
}
END_TEST

/* A map larger than the address space ([store] map_size_mb = 1073741824, the config's upper
 * bound): on an existing store LMDB's mdb_env_set_mapsize unmapped the store and could not map
 * it again, and the first transaction died with SIGSEGV in mdb_txn_begin (`kvmill run` exit
 * 139); a new store was created with that size in its meta pages, so every later open failed
 * with "Cannot allocate memory". Such a size is refused before anything is created or mapped. */
START_TEST(test_map_beyond_address_space)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    tcache t;
    tc_make(&t, 8, 0, 1, 2, 100, 0);
    put_ok(s, &t);
    kvm_store_close(&s);
    kvm_store_opts o = {.map_size_bytes = (int64_t)1 << 50, .no_sync = 1};
    ck_assert_int_ne(kvm_store_open(g_path, &o, &s), 0);
    ck_assert_msg(strstr(kvm_errmsg(), "map_size_mb"), "%s", kvm_errmsg());
    ck_assert_ptr_null(s);
    s = open_store(g_path, 0, 0, 0, 0); /* the store is as it was */
    ck_assert_int_eq(get_cmp(s, &t), 0);
    kvm_store_close(&s);
    char fresh[4300];
    snprintf(fresh, sizeof fresh, "%s/fresh", g_dir);
    ck_assert_int_ne(kvm_store_open(fresh, &o, &s), 0);
    ck_assert_int_ne(access(fresh, F_OK), 0); /* nothing created */
    tc_free(&t);
}
END_TEST

static void put_named_docs(kvm_store *s, int from, int to)
{
    for (int i = from; i < to; i++) {
        kvm_store_id h;
        int32_t toks[2] = {i, 777};
        ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &h), 0);
        kvm_store_doc_meta dm = {.n_tokens = 10 + i};
        snprintf(dm.source, sizeof dm.source, "%s/doc_%d.txt", i % 2 ? "a" : "b/c", i);
        ck_assert_msg(kvm_store_put_doc(s, &h, &dm) == 0, "%s", kvm_errmsg());
    }
}

/* kvm_store_find_docs of name: the number of matches, *tokens the first's n_tokens. */
static int64_t find_named(kvm_store *s, const char *name, int *scanned, int64_t *tokens)
{
    kvm_store_doc_match *m = NULL;
    int64_t n = -1;
    int st = kvm_store_find_docs(s, name, strlen(name), &m, &n, scanned);
    ck_assert_msg(st == 0, "find %s: %s", name, kvm_errmsg());
    if (tokens) *tokens = n > 0 ? m[0].meta.n_tokens : -1;
    free(m);
    return n;
}

/* Drops the docnames db with raw LMDB: the store as a build before the index wrote it. */
static void drop_docnames(const char *path)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    ck_assert_int_eq(mdb_env_create(&env), 0);
    mdb_env_set_maxdbs(env, 32);
    ck_assert_int_eq(mdb_env_open(env, path, 0, 0664), 0);
    ck_assert_int_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    ck_assert_int_eq(mdb_dbi_open(txn, "docnames", 0, &dbi), 0);
    ck_assert_int_eq(mdb_drop(txn, dbi, 1), 0);
    ck_assert_int_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
}

/* A name is found through the index (no scan of the documents), by its whole stored source or
 * its last part; a renamed document moves in the index; a long name or another name finds
 * nothing; verify passes. */
START_TEST(test_docnames_index)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    put_named_docs(s, 0, 300);
    int scanned = -1;
    int64_t tokens;
    ck_assert_int_eq(find_named(s, "doc_17.txt", &scanned, &tokens), 1);
    ck_assert_int_eq(scanned, 0); /* the index, not every document */
    ck_assert_int_eq(tokens, 27);
    ck_assert_int_eq(find_named(s, "a/doc_17.txt", &scanned, NULL), 1);
    ck_assert_int_eq(find_named(s, "c/doc_18.txt", &scanned, NULL), 1);
    ck_assert_int_eq(find_named(s, "b/c/doc_18.txt", &scanned, NULL), 1);
    ck_assert_int_eq(find_named(s, "x/doc_18.txt", &scanned, NULL), 0);
    ck_assert_int_eq(find_named(s, "oc_18.txt", &scanned, NULL), 0); /* a whole part, not a suffix */
    ck_assert_int_eq(find_named(s, "doc_300.txt", &scanned, NULL), 0);
    /* the same document stored again under another name: found under the new one only */
    kvm_store_id h;
    int32_t toks[2] = {17, 777};
    ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &h), 0);
    kvm_store_doc_meta dm = {.n_tokens = 27};
    snprintf(dm.source, sizeof dm.source, "renamed.txt");
    ck_assert_int_eq(kvm_store_put_doc(s, &h, &dm), 0);
    ck_assert_int_eq(find_named(s, "doc_17.txt", &scanned, NULL), 0);
    ck_assert_int_eq(find_named(s, "renamed.txt", &scanned, NULL), 1);
    ck_assert_int_eq(scanned, 0);
    /* two documents of one name in two folders */
    snprintf(dm.source, sizeof dm.source, "z/doc_19.txt");
    int32_t t2[2] = {1000, 777};
    ck_assert_int_eq(kvm_store_doc_hash(t2, 2, &h), 0);
    ck_assert_int_eq(kvm_store_put_doc(s, &h, &dm), 0);
    ck_assert_int_eq(find_named(s, "doc_19.txt", &scanned, NULL), 2);
    kvm_store_doc_match *m = (void *)1;
    int64_t n = 5;
    ck_assert_int_eq(kvm_store_find_docs(s, "", 0, &m, &n, NULL), KVM_EINVAL);
    ck_assert_ptr_null(m);
    ck_assert_int_eq(n, 0);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
}
END_TEST

/* A JSONL id longer than 255 bytes is stored as its first 255 (the compress stage truncates
 * it into kvm_store_doc_meta.source, here in the middle of a two-byte character): asked by the
 * id kvmill run took, the document is found by those bytes. The old lookup refused names
 * over 255 bytes and the decode worker answered "no stored document named ...". */
START_TEST(test_docnames_long_name)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    char id[512] = "dir/";
    for (int i = 0; i < 200; i++) strcat(id, "\xc3\xa9"); /* 4 + 400 bytes */
    kvm_store_id h;
    int32_t toks[2] = {42, 777};
    ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &h), 0);
    kvm_store_doc_meta dm = {.n_tokens = 9};
    snprintf(dm.source, sizeof dm.source, "%.*s", 255, id); /* as stages/compress.c stores it */
    ck_assert_int_eq(kvm_store_put_doc(s, &h, &dm), 0);
    int scanned = -1;
    ck_assert_int_eq(find_named(s, id, &scanned, NULL), 1);
    ck_assert_int_eq(scanned, 0);
    ck_assert_int_eq(find_named(s, "dir/\xc3\xa9", &scanned, NULL), 0);
    /* stored as kvmill stores it now: cut before the character that does not fit whole (254
     * bytes, valid UTF-8; 255 split an "é"), and found by the whole name as well */
    int32_t toks2[2] = {42, 778};
    ck_assert_int_eq(kvm_store_doc_hash(toks2, 2, &h), 0);
    kvm_store_doc_set_source(&dm, id, strlen(id));
    ck_assert_uint_eq(strlen(dm.source), 254);
    ck_assert(kvm_utf8_valid(dm.source, strlen(dm.source)));
    ck_assert_int_eq(kvm_store_put_doc(s, &h, &dm), 0);
    kvm_store_doc_match *m = NULL;
    int64_t n = 0;
    ck_assert_int_eq(kvm_store_find_docs(s, id, strlen(id), &m, &n, NULL), 0);
    ck_assert_int_eq(n, 1);
    ck_assert_mem_eq(m[0].doc_hash.b, h.b, sizeof h.b);
    free(m);
    kvm_store_close(&s);
}
END_TEST

/* name is found once in s, by the index (want_scan 0) or by reading every document (1). */
static void assert_named(kvm_store *s, const char *name, int want_scan)
{
    int scanned = -1;
    ck_assert_msg(find_named(s, name, &scanned, NULL) == 1 && scanned == want_scan, "%s: scanned %d", name, scanned);
}

/* A store written before the index (no docnames db): a read-only open finds names by reading
 * every document (and says so through *scanned); the first writable open indexes it, nothing
 * lost; documents an older build adds later (no entry) make the lookup scan again until the
 * next writable open; verify passes throughout. */
START_TEST(test_docnames_older_store)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    put_named_docs(s, 0, 50);
    kvm_store_close(&s);
    drop_docnames(g_path);
    kvm_store_opts ro = {.read_only = 1};
    ck_assert_int_eq(kvm_store_open(g_path, &ro, &s), 0);
    assert_named(s, "doc_7.txt", 1);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
    s = open_store(g_path, 0, 0, 0, 0); /* indexes it */
    assert_named(s, "doc_7.txt", 0);
    kvm_store_stats ss;
    ck_assert_int_eq(kvm_store_stats_get(s, &ss), 0);
    ck_assert_int_eq(ss.n_docs, 50);
    for (int i = 0; i < 50; i++) {
        char name[32];
        snprintf(name, sizeof name, "doc_%d.txt", i);
        assert_named(s, name, 0);
    }
    ck_assert_int_eq(verify_problems(s), 0);
    /* an older build adds a document: a docs record without an index entry */
    MDB_txn *txn;
    ck_assert_int_eq(mdb_txn_begin(s->env, NULL, 0, &txn), 0);
    kvm_store_id h;
    int32_t toks[2] = {5000, 777};
    ck_assert_int_eq(kvm_store_doc_hash(toks, 2, &h), 0);
    uint8_t fixed[8 + 256] = {0};
    memcpy(fixed + 8, "old/late.txt", 12);
    kvm_frame part = {fixed, sizeof fixed};
    MDB_val key = {KVM_STORE_ID_BYTES, h.b};
    ck_assert_int_eq(kvm_store__rec_put(txn, s->dbi[KVM_STORE__DB_DOCS], &key, KVM_STORE__KIND_DOC, &part, 1), 0);
    ck_assert_int_eq(mdb_txn_commit(txn), 0);
    assert_named(s, "late.txt", 1);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
    s = open_store(g_path, 0, 0, 0, 0); /* indexed again */
    assert_named(s, "late.txt", 0);
    assert_named(s, "doc_7.txt", 0);
    ck_assert_int_eq(verify_problems(s), 0);
    kvm_store_close(&s);
}
END_TEST

/* LMDB gives lock.mdb its size with ftruncate and maps it: its pages get disk blocks only when
 * first written, so on a full device `kvmill store ls` (and run, serve) died with SIGBUS
 * inside mdb_env_open (found on a full 6 MiB tmpfs). The open now refuses such a device with
 * KVM_EFULL naming lock.mdb. Needs a small tmpfs of its own (root); SKIP elsewhere. */
START_TEST(test_lock_file_full_device)
{
    char mnt[4300], fill[4400], lock[4400];
    snprintf(mnt, sizeof mnt, "%s/tmpfs", g_dir);
    ck_assert_int_eq(mkdir(mnt, 0755), 0);
    if (geteuid() != 0 || mount("tmpfs", mnt, "tmpfs", 0, "size=1m") != 0) {
        printf("SKIP: lock_file_full_device: cannot mount a tmpfs (needs root)\n");
        return;
    }
    char store[4400];
    snprintf(store, sizeof store, "%s/st", mnt);
    kvm_store *s = open_store(store, 0, 0, 0, 0);
    kvm_store_close(&s);
    snprintf(lock, sizeof lock, "%s/lock.mdb", store);
    ck_assert_int_eq(unlink(lock), 0);
    snprintf(fill, sizeof fill, "%s/fill", mnt);
    int fd = open(fill, O_WRONLY | O_CREAT, 0644);
    ck_assert_int_ge(fd, 0);
    static char block[4096];
    while (write(fd, block, sizeof block) > 0) {
    }
    close(fd);
    kvm_store_opts ro = {.read_only = 1};
    int st = kvm_store_open(store, &ro, &s); /* the old code died here with SIGBUS */
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kvm_errmsg());
    kvm_store_close(&s);
    umount2(mnt, MNT_DETACH);
    ck_assert_msg(st == KVM_EFULL && strstr(msg, "lock.mdb"), "open: %d %s", st, msg);
}
END_TEST

/* Orders keys by memcmp reversed: written with it, the caches db holds keys that are out of
 * order for the store's own (memcmp) reads, as a damaged B-tree page does. */
static int cmp_reversed(const MDB_val *a, const MDB_val *b)
{
    size_t n = a->mv_size < b->mv_size ? a->mv_size : b->mv_size;
    int c = memcmp(a->mv_data, b->mv_data, n);
    if (c == 0) c = a->mv_size < b->mv_size ? -1 : a->mv_size > b->mv_size;
    return -c;
}

/* A caches db whose keys are out of order (a manifest of cache A stored before a layer key of
 * cache C < A): the listing's re-seek from C's layer to C's manifest landed on A's manifest
 * again, so `kvmill store ls` (and the end of `kvmill run`, and `store show KEY`) visited the
 * two keys forever. The listings stopped with KVM_ECORRUPT; now the page check refuses the
 * store when it is opened (kvm_store__tree_check), before any listing. */
START_TEST(test_keys_out_of_order)
{
    kvm_store *s = open_store(g_path, 0, 0, 0, 0);
    kvm_store_close(&s);
    kvm_store_cache_key a, c;
    memset(&a, 0, sizeof a);
    memset(&c, 0, sizeof c);
    memset(a.model_id.b, 0xaa, sizeof a.model_id.b);
    memset(c.model_id.b, 0x11, sizeof c.model_id.b);
    uint8_t ka[KVM_STORE__CACHE_KEY_BYTES], kc[KVM_STORE__CACHE_KEY_BYTES], v[16] = {0};
    kvm_store__cache_key(&a, KVM_STORE__MANIFEST, ka);
    kvm_store__cache_key(&c, 0, kc);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    raw_open(&env, &txn, &dbi, "caches");
    ck_assert_int_eq(mdb_set_compare(txn, dbi, cmp_reversed), 0);
    MDB_val k1 = {sizeof ka, ka}, k2 = {sizeof kc, kc}, val = {sizeof v, v};
    ck_assert_int_eq(mdb_put(txn, dbi, &k1, &val, 0), 0);
    ck_assert_int_eq(mdb_put(txn, dbi, &k2, &val, 0), 0);
    raw_close(env, txn);
    kvm_store_opts ro = {.read_only = 1};
    int st = kvm_store_open(g_path, &ro, &s);
    ck_assert_msg(st == KVM_ECORRUPT, "open: %d (%s)", st, kvm_errmsg());
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "out of order"));
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "db 'caches'"));
    ck_assert_ptr_null(s);
    ck_assert_int_eq(kvm_store_open(g_path, NULL, &s), KVM_ECORRUPT);
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
    Suite *su = suite_create("store");
    suite_add_tcase(su, tcase("ids", test_ids, 30));
    suite_add_tcase(su, tcase("put_get", test_put_get, 30));
    suite_add_tcase(su, tcase("strategies_meta", test_strategies_meta, 30));
    suite_add_tcase(su, tcase("concurrent", test_concurrent, 240));
    suite_add_tcase(su, tcase("sigkill", test_sigkill, 60));
    suite_add_tcase(su, tcase("corrupt", test_corrupt, 60));
    suite_add_tcase(su, tcase("verify_nonfinite", test_verify_nonfinite, 60));
    suite_add_tcase(su, tcase("map_growth", test_map_growth, 120));
    suite_add_tcase(su, tcase("evict", test_evict, 60));
    suite_add_tcase(su, tcase("mismatch", test_mismatch, 30));
    suite_add_tcase(su, tcase("network_fs", test_network_fs, 30));
    suite_add_tcase(su, tcase("cli_missing_path", test_cli_missing_path, 60));
    suite_add_tcase(su, tcase("cli_readonly_leaves_no_files", test_cli_readonly_leaves_no_files, 60));
    suite_add_tcase(su, tcase("writable_open_leaves_no_lock", test_writable_open_leaves_no_lock, 60));
    suite_add_tcase(su, tcase("failed_create_leaves_folder", test_failed_create_leaves_folder, 60));
    suite_add_tcase(su, tcase("create_in_foreign_dir", test_create_in_foreign_dir, 30));
    suite_add_tcase(su, tcase("create_while_another_creates", test_create_while_another_creates, 60));
    suite_add_tcase(su, tcase("check_new_dir_parent", test_check_new_dir_parent, 30));
    suite_add_tcase(su, tcase("cli_commands", test_cli_commands, 60));
    suite_add_tcase(su, tcase("cli_binary", test_cli_binary, 30));
    suite_add_tcase(su, tcase("cli_ls_names", test_cli_ls_names, 30));
    suite_add_tcase(su, tcase("cli_ls_names_control_bytes", test_cli_ls_names_control_bytes, 30));
    suite_add_tcase(su, tcase("cli_ls_names_not_utf8", test_cli_ls_names_not_utf8, 30));
    suite_add_tcase(su, tcase("map_beyond_address_space", test_map_beyond_address_space, 30));
    suite_add_tcase(su, tcase("docnames_index", test_docnames_index, 60));
    suite_add_tcase(su, tcase("docnames_older_store", test_docnames_older_store, 60));
    suite_add_tcase(su, tcase("docnames_long_name", test_docnames_long_name, 30));
    suite_add_tcase(su, tcase("lock_file_full_device", test_lock_file_full_device, 30));
    suite_add_tcase(su, tcase("keys_out_of_order", test_keys_out_of_order, 30));
    SRunner *sr = srunner_create(su);
    srunner_set_fork_status(sr, CK_FORK);
    srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY=verbose lists every test */
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
