/* cmd_store.c: `kvmill store SUBCMD --store PATH|--config FILE ...`: list (with each
 * cache's state against a config), show, verify, remove (one, or the stale ones), compact
 * and print usage of an LMDB cache store, and list or release the runs' claims. Opens
 * read-only except for `rm` and `claims --release`; never creates a store. Exit status: 0 ok, 1 failure (corruption,
 * not found), 2 usage or unopenable store. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_serve_cache.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_storew.h"
#include "store/kvm_store.h"
#include "model/kvm_utf8.h"

typedef struct store_sub {
    const char *name;                 /* subcommand */
    int (*fn)(int argc, char **argv); /* argv[0] = name */
    const char *summary;              /* one line for usage */
} store_sub;

/* Parses options; returns -1 to go on, else the exit status to return. */
static int parse(const char *cmd, const char *summary, int argc, char **argv, kvm_cli_opt *opts, char **pos,
                 int max_pos, int *n_pos)
{
    int help = 0;
    int rc = kvm_cli_parse(cmd, summary, argc, argv, opts, pos, max_pos, n_pos, &help);
    if (help) return 0;
    if (rc) return 2;
    if (!kvm_cli_get(opts, "store") && !kvm_cli_get(opts, "config")) {
        fprintf(stderr, "kvmill %s: --store PATH or --config FILE is required (see kvmill %s --help)\n", cmd, cmd);
        return 2;
    }
    return -1;
}

/* The store a command works on: --store, else [store] path of --config. With --config
 * the config is loaded into *cfg (the caller frees it; NULL without --config). A store service
 * endpoint (tcp://, ipc://) is refused: these commands need the LMDB directory. Prints why
 * not; returns 0 or 2. */
static int store_of(const char *cmd, const kvm_cli_opt *opts, kvm_config **cfg, const char **path)
{
    *cfg = NULL;
    *path = kvm_cli_get(opts, "store");
    const char *cp = kvm_cli_get(opts, "config");
    if (cp && kvm_config_load(cp, cfg)) {
        fprintf(stderr, "kvmill %s: --config: %s\n", cmd, kvm_errmsg());
        return 2;
    }
    if (!*path && *cfg) *path = kvm_config_str(*cfg, "store", "path");
    if (*path && kvm_serve_remote_is_endpoint(*path)) { /* the service answers run and serve, not these */
        fprintf(stderr, "kvmill %s: store %s is a store service endpoint: store commands open the LMDB directory "
                        "itself, so run them on the service's host with its --store directory\n", cmd, *path);
        kvm_config_free(cfg);
        return 2;
    }
    return 0;
}

#define CONFIG_OPT {"config", 1, "pipeline config: its [store] path (unless --store) and settings", NULL}

/* Says on stderr when the handle reads without LMDB's lock (its lock.mdb cannot be written):
 * what it reads is then not protected from a writer working on the store meanwhile. */
static void say_lock_note(const char *cmd, const kvm_store *s)
{
    const char *why = kvm_store_lock_note(s);
    if (why)
        fprintf(stderr, "kvmill %s: note: %s; reading without a lock (MDB_NOLOCK): a run writing to this store "
                        "meanwhile can change what is read\n", cmd, why);
}

/* Opens read-only; prints why not on stderr. */
static int open_ro(const char *cmd, const char *path, kvm_store **s, int quiet_missing)
{
    kvm_store_opts o = {.read_only = 1};
    int st = kvm_store_open(path, &o, s);
    if (st && !(quiet_missing && st == KVM_ENOTFOUND))
        fprintf(stderr, "kvmill %s: cannot open store: %s (%s)\n", cmd, kvm_errmsg(), kvm_strerror(st));
    if (st == 0) say_lock_note(cmd, *s);
    return st;
}

/* Resolves KEY; prints why not. Returns the exit status to use on failure, 0 on success. */
static int resolve(const char *cmd, kvm_store *s, const char *text, kvm_store_cache_key *k)
{
    int st = kvm_store_find_cache(s, text, k);
    if (st == 0) return 0;
    fprintf(stderr, "kvmill %s: %s\n", cmd, kvm_cli_errmsg(cmd));
    return st == KVM_EINVAL ? 2 : 1;
}

static double ratio_of(const kvm_store_manifest *m)
{
    return m->stored_bytes > 0 ? (double)m->full_bytes / (double)m->stored_bytes : 0.0;
}

/* ---- ls ---- */

/* What the caches of a config look like now (--config): to tell each cache's state. */
typedef struct cfg_now {
    int on;                /* 1 when --config was given */
    kvm_store_id model_id; /* the config's model */
    char *canon;           /* canonical config text a run would write now */
    size_t canon_n;        /* its bytes */
} cfg_now;

static kvm_jobcfg_state state_of(const cfg_now *now, const kvm_store_cache_key *k, const kvm_store_manifest *m)
{
    if (memcmp(&k->model_id, &now->model_id, sizeof k->model_id)) return KVM_JOBCFG_OTHER;
    return kvm_jobcfg_compare((const char *)m->config.data, m->config.size, now->canon, now->canon_n);
}

/* Fills *now from config c and store s (read-only handles hash the model without
 * remembering). A polykv config whose strategy is gone compares without one. */
static int cfg_now_init(const char *cmd, const kvm_config *c, kvm_store *s, cfg_now *now)
{
    kvm_store_id id;
    now->on = 1;
    int st = kvm_jobcfg_check_strategy(c);
    if (!st) st = kvm_store_model_id(s, kvm_config_str(c, "model", "path"), &now->model_id);
    if (st == 0) st = kvm_jobcfg_config_id_in(c, s, &now->model_id, &id, &now->canon, &now->canon_n);
    if (st == KVM_ENOTFOUND) { /* said: else every cache of the strategy reads other-config or stale-* unexplained */
        fprintf(stderr, "kvmill %s: --config: %s; states compare with no strategy\n", cmd, kvm_errmsg());
        st = kvm_jobcfg_config_id(c, NULL, &id, &now->canon, &now->canon_n);
    }
    if (st) fprintf(stderr, "kvmill %s: --config: %s\n", cmd, kvm_errmsg());
    return st;
}

/* One cache as ls prints it (what --names keeps until the listing's read transaction is over). */
typedef struct ls_row {
    kvm_store_cache_key k;
    kvm_store_manifest m; /* scalars only: the config frame is not kept */
    const char *state;    /* --config: the cache's state name (static), else NULL */
} ls_row;

typedef struct ls_ctx {
    const char *model_prefix; /* --model, or NULL */
    int csv;                  /* --csv */
    int names;                /* --names: rows are kept, printed with their names after the listing */
    const cfg_now *now;       /* --config: print each cache's state */
    int64_t n_rows;           /* caches printed (or kept) */
    int64_t n_bad;            /* manifests that failed their checks */
    ls_row *rows;             /* --names: the rows, n_rows of them */
    int64_t cap;              /* rows allocated */
} ls_ctx;

/* A CSV field: quoted (RFC 4180) when it holds a comma, a quote or a line break. */
static void csv_field(const char *v)
{
    if (!v[strcspn(v, ",\"\r\n")]) {
        fputs(v, stdout);
        return;
    }
    putchar('"');
    for (const char *p = v; *p; p++) {
        if (*p == '"') putchar('"');
        putchar(*p);
    }
    putchar('"');
}

/* The bytes of the UTF-8 character at p that the table prints as they are: 1 to 4, or 0 for a
 * byte to escape: a control (C0, DEL, and C1 such as U+009B, a terminal's CSI) or a byte of no
 * valid UTF-8 sequence (a name from a Latin-1 file name or JSONL id, which the terminal showed
 * as garbage or took for part of a character). */
static size_t table_char_len(const unsigned char *p)
{
    if (*p < 0x80) return *p < 0x20 || *p == 0x7f || *p == '\\' ? 0 : 1; /* \\ too: \xNN is always a byte */
    if (p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) return 0;          /* U+0080..U+009F */
    if (p[0] == 0xd8 && p[1] == 0x9c) return 0; /* U+061C, the Arabic letter mark (bidirectional) */
    if (p[0] == 0xe2 && ((p[1] == 0x80 && ((p[2] >= 0x8e && p[2] <= 0x8f) || (p[2] >= 0xa8 && p[2] <= 0xae))) ||
                         (p[1] == 0x81 && p[2] >= 0xa6 && p[2] <= 0xa9)))
        return 0; /* bidirectional marks, overrides, isolates and line/paragraph separators: they reorder a row */
    for (size_t k = 2; k <= 4; k++) {
        size_t have = strnlen((const char *)p, k); /* a NUL ends the name: no read past it */
        if (have == k && kvm_utf8_valid(p, k)) return k;
    }
    return 0;
}

/* A name in the table: control bytes (a line break, ESC of a terminal sequence, from a JSONL
 * id) and bytes that are not UTF-8 as \xNN, so that a row stays one line of text and a name
 * cannot drive the terminal. --csv keeps the bytes as they are. */
static void table_field(const char *v)
{
    for (const unsigned char *p = (const unsigned char *)v; *p;) {
        size_t k = table_char_len(p);
        if (k == 0)
            printf("\\x%02x", *p++);
        else
            fwrite(p, 1, k, stdout), p += k;
    }
}

/* Prints a row; name: --names' column (NULL without it). */
static void ls_print(const ls_ctx *c, const ls_row *r, const char *name)
{
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], d[KVM_STORE_ID_HEX + 1];
    const kvm_store_manifest *m = &r->m;
    kvm_store_id_hex(&r->k.model_id, a);
    kvm_store_id_hex(&r->k.doc_hash, b);
    kvm_store_id_hex(&r->k.config_id, d);
    if (c->csv) {
        printf("%s,%s,%s,%" PRId64 ",%" PRId64 ",%" PRId64 ",%.3f,%s%s%s", a, b, d, m->n_tokens, m->n_entries,
               m->stored_bytes, ratio_of(m), m->dtype, r->state ? "," : "", r->state ? r->state : "");
        if (name) putchar(','), csv_field(name);
    } else {
        printf("%-12.12s %-12.12s %-12.12s %9" PRId64 " %10" PRId64 " %12" PRId64 " %7.2f %-*s%-*s", a, b, d,
               m->n_tokens, m->n_entries, m->stored_bytes, ratio_of(m), r->state || name ? 6 : 0, m->dtype,
               r->state && name ? 15 : 0, r->state ? r->state : "");
        if (name) putchar(' '), table_field(name);
    }
    putchar('\n');
}

static int ls_visit(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    ls_ctx *c = arg;
    if (c->model_prefix && !kvm_store_id_has_prefix(&k->model_id, c->model_prefix)) return 0;
    if (!m) {
        fprintf(stderr, "kvmill store ls: %s (%s); run kvmill store verify\n", kvm_cli_errmsg("store ls"),
                kvm_strerror(status));
        c->n_bad++;
        return 0;
    }
    ls_row r = {.k = *k, .m = *m, .state = c->now->on ? kvm_jobcfg_state_name(state_of(c->now, k, m)) : NULL};
    r.m.config = (kvm_frame){0}; /* borrowed from the read transaction */
    if (!c->names) {
        ls_print(c, &r, NULL);
        c->n_rows++;
        return 0;
    }
    if (c->n_rows == c->cap) { /* the names are read after the listing: its lock is held during this call */
        int64_t cap = c->cap ? 2 * c->cap : 64;
        ls_row *g = realloc(c->rows, (size_t)cap * sizeof *g);
        if (!g) return kvm_err(KVM_ENOMEM, "store ls: out of memory for %lld rows", (long long)cap);
        c->rows = g, c->cap = cap;
    }
    c->rows[c->n_rows++] = r;
    return 0;
}

/* --names: prints the kept rows, each with the name its document was stored under (the name
 * kvmill ask --doc-name takes), or "-" when the store has no record of the document. */
static void ls_print_named(kvm_store *s, const ls_ctx *c)
{
    for (int64_t i = 0; i < c->n_rows; i++) {
        kvm_store_doc_meta dm;
        int st = kvm_store_get_doc(s, &c->rows[i].k.doc_hash, &dm);
        ls_print(c, &c->rows[i], st == 0 && dm.source[0] ? dm.source : "-");
    }
}

static int check_hex_prefix(const char *cmd, const char *opt, const char *v)
{
    size_t n = strlen(v);
    if (n == 0 || n > KVM_STORE_ID_HEX || strspn(v, "0123456789abcdefABCDEF") != n) {
        fprintf(stderr, "kvmill %s: --%s: '%s' is not 1 to %d hex digits\n", cmd, opt, v, KVM_STORE_ID_HEX);
        return -1;
    }
    return 0;
}

static int cmd_ls(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"store", 1, "LMDB environment directory", NULL},
        {"config", 1, "pipeline config: its [store] path (unless --store), and a state column: ok, stale-strategy "
                      "(made with another PolyKV strategy), stale-algorithm (by an older kvmill), other-config", NULL},
        {"model", 1, "only caches of this model id (hex, a prefix is enough)", NULL},
        {"csv", 0, "print CSV: model_id,doc_hash,config_id,tokens,entries,bytes,ratio,dtype[,state][,name]", NULL},
        {"names", 0, "add a NAME column: the name each cache's document was stored under (its corpus file name or "
                     "JSONL id), which kvmill ask --doc-name takes; - when the store has no record of the document",
         NULL},
        {NULL, 0, NULL, NULL},
    };
    int n_pos;
    int rc = parse("store ls", "list caches: tokens, entries, stored bytes, compression ratio (full f32 / stored)",
                   argc, argv, opts, NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    ls_ctx c = {.model_prefix = kvm_cli_get(opts, "model"), .csv = kvm_cli_get(opts, "csv") != NULL,
                .names = kvm_cli_get(opts, "names") != NULL};
    if (c.model_prefix && check_hex_prefix("store ls", "model", c.model_prefix)) return 2;
    kvm_config *cfg = NULL;
    const char *path;
    if (store_of("store ls", opts, &cfg, &path)) return 2;
    kvm_store *s = NULL;
    cfg_now now = {0};
    c.now = &now;
    int st = open_ro("store ls", path, &s, 0);
    if (st || (cfg && cfg_now_init("store ls", cfg, s, &now))) {
        kvm_store_close(&s);
        kvm_config_free(&cfg);
        return 2;
    }
    if (c.csv)
        printf("model_id,doc_hash,config_id,tokens,entries,bytes,ratio,dtype%s%s\n", now.on ? ",state" : "",
               c.names ? ",name" : "");
    else
        printf("%-12s %-12s %-12s %9s %10s %12s %7s %-*s%-*s%s\n", "MODEL", "DOC", "CONFIG", "TOKENS", "ENTRIES", "BYTES",
               "RATIO", now.on || c.names ? 6 : 0, "DTYPE", now.on && c.names ? 15 : 0, now.on ? "STATE" : "",
               c.names ? " NAME" : "");
    st = kvm_store_list_caches(s, NULL, ls_visit, &c);
    if (st) fprintf(stderr, "kvmill store ls: %s (%s)\n", kvm_cli_errmsg("store ls"), kvm_strerror(st));
    else if (c.names) ls_print_named(s, &c);
    kvm_store_close(&s);
    kvm_config_free(&cfg);
    free(now.canon);
    free(c.rows);
    return st ? 1 : c.n_bad ? 1 : 0;
}

/* ---- show ---- */

static void show_cache(const kvm_store_cache *c)
{
    const kvm_store_manifest *m = &c->manifest;
    char h[KVM_STORE_ID_HEX + 1];
    printf("model_id      %s\n", kvm_store_id_hex(&m->model_id, h));
    printf("doc_hash      %s\n", kvm_store_id_hex(&m->doc_hash, h));
    printf("config_id     %s\n", kvm_store_id_hex(&m->config_id, h));
    printf("tokenizer_id  %s\n", kvm_store_id_hex(&m->tokenizer_id, h));
    printf("format        %u\n", m->format_version);
    printf("created_ms    %" PRId64 "\n", m->created_unix_ms);
    printf("dtype         %s\n", m->dtype);
    printf("layers        %d\n", m->n_layers);
    printf("tokens        %" PRId64 "\n", m->n_tokens);
    printf("entries       %" PRId64 "\n", m->n_entries);
    printf("bytes         %" PRId64 "\n", m->stored_bytes);
    printf("full_bytes    %" PRId64 "\n", m->full_bytes);
    printf("ratio         %.3f\n", ratio_of(m));
    printf("config_bytes  %zu\n", m->config.size);
    const char *cb = (const char *)m->config.data, *sh = NULL;
    for (size_t i = 0; cb && i + 14 <= m->config.size; i++) /* the strategy the cache was made with (polykv) */
        if ((i == 0 || cb[i - 1] == '\n') && !strncmp(cb + i, "strategy.hash=", 14)) sh = cb + i + 14;
    if (sh) printf("strategy_hash %.*s\n", (int)strcspn(sh, "\n"), sh);
    for (int32_t l = 0; l < m->n_layers; l++) {
        size_t bytes = 0;
        for (uint32_t f = 0; f < c->layers[l].n_frames; f++) bytes += c->layers[l].frames[f].size;
        printf("layer %-7d %u frames, %zu bytes\n", l, c->layers[l].n_frames, bytes);
    }
}

static int cmd_show(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL}, CONFIG_OPT, {NULL, 0, NULL, NULL}};
    char *pos[1];
    int n_pos;
    int rc = parse("store show", "show one cache: KEY = MODELID:DOCHASH:CONFIGID in hex, unique prefixes accepted",
                   argc, argv, opts, pos, 1, &n_pos);
    if (rc >= 0) return rc;
    if (n_pos != 1) {
        fprintf(stderr, "kvmill store show: expected one KEY (MODELID:DOCHASH:CONFIGID)\n");
        return 2;
    }
    kvm_config *cfg = NULL;
    const char *path;
    if (store_of("store show", opts, &cfg, &path)) return 2;
    kvm_store *s = NULL;
    rc = open_ro("store show", path, &s, 0);
    kvm_config_free(&cfg);
    if (rc) return 2;
    kvm_store_cache_key k;
    kvm_store_cache *c = NULL;
    rc = resolve("store show", s, pos[0], &k);
    if (rc == 0) {
        int st = kvm_store_get_cache(s, &k, NULL, &c);
        if (st) {
            fprintf(stderr, "kvmill store show: %s (%s)\n", kvm_cli_errmsg("store show"), kvm_strerror(st));
            rc = 1;
        } else {
            show_cache(c);
        }
    }
    kvm_store_cache_free(&c);
    kvm_store_close(&s);
    return rc;
}

/* ---- verify ---- */

static void verify_report(const char *problem, void *arg)
{
    (void)arg;
    fprintf(stderr, "kvmill store verify: %s\n", problem);
}

/* The keys of every cache whose manifest passes its checks. */
typedef struct verify_keys {
    kvm_store_cache_key *keys; /* [n] */
    int64_t n, cap;            /* used / allocated */
} verify_keys;

static int verify_keys_visit(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    verify_keys *v = arg;
    if (status) return 0; /* kvm_store_verify reports it */
    if (v->n == v->cap) {
        int64_t cap = v->cap ? 2 * v->cap : 64;
        kvm_store_cache_key *p = realloc(v->keys, (size_t)cap * sizeof *p);
        if (!p) return kvm_err(KVM_ENOMEM, "store verify: out of memory");
        v->keys = p;
        v->cap = cap;
    }
    v->keys[v->n++] = *k;
    return 0;
}

/* Decodes every layer of every cache as serve would: a layer rewritten with a valid checksum
 * that does not decode passes the record checks but fails every ask on that document. */
static int verify_decode(kvm_store *s, int64_t *n_problems)
{
    verify_keys v = {0};
    int st = kvm_store_list_caches(s, NULL, verify_keys_visit, &v);
    for (int64_t i = 0; st == 0 && i < v.n; i++) {
        int64_t n_bad = 0;
        st = kvm_serve_cache_check(s, &v.keys[i], verify_report, NULL, &n_bad);
        *n_problems += n_bad;
    }
    if (st == KVM_ECORRUPT) st = 0; /* keys out of order: the page checks already said so */
    free(v.keys);
    return st;
}

static int cmd_verify(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL}, CONFIG_OPT, {NULL, 0, NULL, NULL}};
    int n_pos;
    int rc = parse("store verify",
                   "check every B-tree page, checksum and manifest, and decode every layer; exit 0 all pass, 1 "
                   "corruption, 2 store cannot be opened",
                   argc, argv, opts, NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    kvm_config *cfg = NULL;
    const char *path;
    if (store_of("store verify", opts, &cfg, &path)) return 2;
    kvm_store *s = NULL;
    kvm_store_opts o = {.read_only = 1};
    rc = kvm_store_open(path, &o, &s);
    kvm_config_free(&cfg);
    if (rc == KVM_ECORRUPT) { /* damaged B-tree pages: the open refuses the store, verify reports why */
        verify_report(kvm_errmsg(), NULL);
        printf("0 records checked, 1 problem(s)\n");
        return 1;
    }
    if (rc) {
        fprintf(stderr, "kvmill store verify: cannot open store: %s (%s)\n", kvm_errmsg(), kvm_strerror(rc));
        return 2;
    }
    say_lock_note("store verify", s);
    int64_t n_records = 0, n_problems = 0;
    int st = kvm_store_verify(s, verify_report, NULL, &n_records, &n_problems);
    if (st == 0) st = verify_decode(s, &n_problems);
    kvm_store_close(&s);
    if (st) {
        fprintf(stderr, "kvmill store verify: %s (%s)\n", kvm_cli_errmsg("store verify"), kvm_strerror(st));
        return st == KVM_ECORRUPT ? 1 : 2;
    }
    printf("%" PRId64 " records checked, %" PRId64 " problem(s)\n", n_records, n_problems);
    return n_problems ? 1 : 0;
}

/* ---- rm ---- */

typedef struct stale_ctx {
    const cfg_now *now;        /* the config's caches as a run would make them now */
    int stale, other;          /* --stale: remove stale-* caches; --other-config: other-config ones */
    kvm_store_cache_key *keys; /* stale caches found */
    kvm_jobcfg_state *states;  /* and their states */
    int64_t n, cap;            /* used / allocated */
} stale_ctx;

static int stale_visit(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    stale_ctx *c = arg;
    if (!m) return 0; /* a manifest failing its checks has no state: store verify names it */
    kvm_jobcfg_state st = state_of(c->now, k, m);
    int stale = st == KVM_JOBCFG_STALE_STRATEGY || st == KVM_JOBCFG_STALE_ALGORITHM;
    if (!(c->stale && stale) && !(c->other && st == KVM_JOBCFG_OTHER)) return 0;
    if (c->n == c->cap) {
        int64_t cap = c->cap ? 2 * c->cap : 64;
        kvm_store_cache_key *k2 = realloc(c->keys, (size_t)cap * sizeof *k2);
        if (k2) c->keys = k2;
        kvm_jobcfg_state *s2 = k2 ? realloc(c->states, (size_t)cap * sizeof *s2) : NULL;
        if (s2) c->states = s2;
        if (!k2 || !s2) return kvm_err(KVM_ENOMEM, "out of memory");
        c->cap = cap;
    }
    c->states[c->n] = st;
    c->keys[c->n++] = *k;
    return 0;
}

/* The summary line of rm --stale / --other-config. */
static const char *removed_what(const stale_ctx *c)
{
    return c->stale && c->other ? "stale or other-config" : c->stale ? "stale" : "other-config";
}

/* rm --stale --config F: every cache of the config's model made with the same settings
 * but another strategy or algorithm version; rm --other-config --config F: every cache of
 * other settings or another model (an old model's, old [compress] settings'), which no run of
 * F would use. */
static int rm_stale(const char *path, const kvm_config *cfg, int stale, int other)
{
    kvm_store *s = NULL;
    cfg_now now = {0};
    stale_ctx c = {.now = &now, .stale = stale, .other = other};
    if (open_ro("store rm", path, &s, 0)) return 2;
    /* said by cfg_now_init, and --config's mistake as store ls says it (it was said twice, exit 1) */
    if (cfg_now_init("store rm", cfg, s, &now)) {
        kvm_store_close(&s);
        free(now.canon);
        return 2;
    }
    int st = kvm_store_list_caches(s, NULL, stale_visit, &c);
    kvm_store_close(&s);
    if (st == 0) st = kvm_storew_open(cfg, path, 0, &s);
    int64_t removed = 0;
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], d[KVM_STORE_ID_HEX + 1];
    for (int64_t i = 0; st == 0 && i < c.n; i++) {
        int r = kvm_store_rm_cache(s, &c.keys[i]);
        if (r == KVM_ENOTFOUND) continue; /* removed meanwhile */
        if ((st = r)) break;
        removed++;
        printf("removed %s:%s:%s (%s)\n", kvm_store_id_hex(&c.keys[i].model_id, a), kvm_store_id_hex(&c.keys[i].doc_hash, b),
               kvm_store_id_hex(&c.keys[i].config_id, d), kvm_jobcfg_state_name(c.states[i]));
    }
    if (st) fprintf(stderr, "kvmill store rm: %s (%s)\n", kvm_cli_errmsg("store rm"), kvm_strerror(st));
    else
        printf("%lld %s cache(s) removed\n", (long long)removed, removed_what(&c));
    kvm_store_close(&s);
    free(now.canon);
    free(c.keys);
    free(c.states);
    return st ? 1 : 0;
}

static int cmd_rm(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL},
                          CONFIG_OPT,
                          {"stale", 0,
                           "remove every cache of --config's model and settings made with another PolyKV "
                           "strategy or an older algorithm (store ls --config shows them as stale-*)",
                           NULL},
                          {"other-config", 0,
                           "remove every cache made with other settings or another model than "
                           "--config's (store ls --config shows them as other-config): an old "
                           "model's or old [compress] settings'; on a store shared by several "
                           "configs, also those the others use",
                           NULL},
                          {NULL, 0, NULL, NULL}};
    char *pos[1];
    int n_pos;
    int rc = parse("store rm",
                   "remove one cache (KEY = MODELID:DOCHASH:CONFIGID in hex, unique prefixes accepted), or "
                   "the stale or other-config ones of a config (--stale and/or --other-config, with "
                   "--config FILE)",
                   argc, argv, opts, pos, 1, &n_pos);
    if (rc >= 0) return rc;
    int stale = kvm_cli_get(opts, "stale") != NULL, other = kvm_cli_get(opts, "other-config") != NULL;
    if (stale || other ? (n_pos != 0 || !kvm_cli_get(opts, "config")) : n_pos != 1) {
        fprintf(stderr, "kvmill store rm: expected one KEY (MODELID:DOCHASH:CONFIGID), or --stale and/or "
                        "--other-config with --config FILE\n");
        return 2;
    }
    kvm_config *cfg = NULL;
    const char *path;
    if (store_of("store rm", opts, &cfg, &path)) return 2;
    if (stale || other) {
        rc = rm_stale(path, cfg, stale, other);
        kvm_config_free(&cfg);
        return rc;
    }
    kvm_store *s = NULL;
    if (open_ro("store rm", path, &s, 0)) { /* read-only first: never create a store */
        kvm_config_free(&cfg);
        return 2;
    }
    kvm_store_cache_key k;
    rc = resolve("store rm", s, pos[0], &k);
    kvm_store_close(&s);
    int st = rc ? 0 : cfg ? kvm_storew_open(cfg, path, 0, &s) : kvm_store_open(path, NULL, &s);
    kvm_config_free(&cfg);
    if (rc) return rc;
    if (st == 0) st = kvm_store_rm_cache(s, &k);
    if (st) fprintf(stderr, "kvmill store rm: %s (%s)\n", kvm_cli_errmsg("store rm"), kvm_strerror(st));
    kvm_store_close(&s);
    if (st) return 1;
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], c[KVM_STORE_ID_HEX + 1];
    printf("removed %s:%s:%s\n", kvm_store_id_hex(&k.model_id, a), kvm_store_id_hex(&k.doc_hash, b),
           kvm_store_id_hex(&k.config_id, c));
    return 0;
}

/* ---- claims ---- */

typedef struct claims_ctx {
    int csv;           /* --csv */
    const char *owner; /* --owner: only this owner's claims, or NULL */
    int64_t now_ms;    /* wall clock: a claim expiring at or before it has lapsed */
    int64_t n, n_live; /* claims printed, live ones among them */
} claims_ctx;

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* "2026-12-07T05:00:00Z" of unix ms t into out[n]. */
static const char *utc_of(int64_t t, char *out, size_t n)
{
    time_t sec = (time_t)(t / 1000);
    struct tm tm;
    if (!gmtime_r(&sec, &tm) || !strftime(out, n, "%Y-%m-%dT%H:%M:%SZ", &tm)) snprintf(out, n, "%lld", (long long)t);
    return out;
}

static int claims_visit(const kvm_store_cache_key *k, const kvm_store_claim *c, void *arg)
{
    claims_ctx *x = arg;
    if (x->owner && strcmp(x->owner, c->owner)) return 0;
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], d[KVM_STORE_ID_HEX + 1], when[40];
    const int live = c->expires_unix_ms > x->now_ms;
    kvm_store_id_hex(&k->model_id, a);
    kvm_store_id_hex(&k->doc_hash, b);
    kvm_store_id_hex(&k->config_id, d);
    utc_of(c->expires_unix_ms, when, sizeof when);
    if (x->csv) {
        printf("%s,%s,%s,%" PRId64 ",%" PRId64 ",%s,", a, b, d, c->since_unix_ms, c->expires_unix_ms,
               live ? "live" : "lapsed");
        csv_field(c->host);
        putchar(',');
        csv_field(c->owner);
    } else { /* owner and host come from any client of a store service: escaped as names are */
        printf("%-12.12s %-12.12s %-12.12s %-20s %-6s ", a, b, d, when, live ? "live" : "lapsed");
        table_field(c->host[0] ? c->host : "-");
        putchar(' ');
        table_field(c->owner);
    }
    putchar('\n');
    x->n++;
    x->n_live += live;
    return 0;
}

/* Lists the claims of the store at path (--owner: one owner's). Returns the exit status. */
static int claims_list(const char *path, claims_ctx *x)
{
    kvm_store *s = NULL;
    if (open_ro("store claims", path, &s, 0)) return 2;
    if (x->csv)
        printf("model_id,doc_hash,config_id,since_ms,expires_ms,state,host,owner\n");
    else
        printf("%-12s %-12s %-12s %-20s %-6s %s\n", "MODEL", "DOC", "CONFIG", "EXPIRES", "STATE", "HOST OWNER");
    int st = kvm_store_list_claims(s, claims_visit, x);
    kvm_store_close(&s);
    if (st) {
        fprintf(stderr, "kvmill store claims: %s (%s)\n", kvm_cli_errmsg("store claims"), kvm_strerror(st));
        return 1;
    }
    if (!x->csv) printf("%lld claim(s), %lld live\n", (long long)x->n, (long long)x->n_live);
    return 0;
}

/* Whether owner ("run:HOST:PID:START_MS[:ID]", kvm_storew_owner) may be a run of this host
 * still running: its host is this one's name and its process exists (kvm_rundir_pid_gone
 * says not gone when the ID names this boot and pid namespace; without an ID, the pid answers
 * kill(0)). An ID of another boot names a process that is gone; one of this boot's other pid
 * namespace (a container sharing the host name) cannot be told, so it counts as running. Any
 * other shape is no run of this host. why[n] says what was found. */
static int owner_running_here(const char *owner, char *why, size_t n)
{
    char host[64] = "";
    if (gethostname(host, sizeof host - 1)) return 0;
    size_t hl = strnlen(host, 48); /* kvm_storew_owner writes at most 48 bytes of it */
    if (strncmp(owner, "run:", 4) || strncmp(owner + 4, host, hl) || owner[4 + hl] != ':') return 0;
    char *end;
    long pid = strtol(owner + 5 + hl, &end, 10);
    if (end == owner + 5 + hl || *end != ':' || pid <= 0) return 0;
    strtoll(end + 1, &end, 10); /* the start time */
    if (*end != ':' && *end) return 0;
    const char *id = *end ? end + 1 : "";
    char mine[96];
    kvm_rundir_proc_id((long)getpid(), mine, sizeof mine);
    size_t boot = strcspn(mine, "N"), ns = strcspn(mine, "T");
    int running;
    if (!*id || !*mine)
        running = kill((pid_t)pid, 0) == 0 || errno == EPERM;
    else if (strncmp(id, mine, boot))
        running = 0; /* another boot of this machine */
    else
        running = strncmp(id, mine, ns) || !kvm_rundir_pid_gone(pid, id);
    snprintf(why, n, "process %ld on this host (%s) %s", pid, host,
             !*id || !*mine || !strncmp(id, mine, ns) ? "is running" : "may be running in another pid namespace");
    return running;
}

/* v as table_field prints it, into out[n] (cut before a character that does not fit), for a
 * message: an owner comes from any client of a store service or the command line, and its ESC
 * or line break must not drive the terminal or forge a line. Returns out. */
static const char *table_esc(const char *v, char *out, size_t n)
{
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)v; *p;) {
        size_t k = table_char_len(p), w = k ? k : 4;
        if (o + w >= n) break;
        if (k == 0)
            snprintf(out + o, n - o, "\\x%02x", *p++);
        else
            memcpy(out + o, p, k), p += k;
        o += w;
    }
    out[o] = '\0';
    return out;
}

/* --release OWNER: removes every claim of owner, unless one of them is live (--force): a live
 * claim may be a run's that goes on, on this host or any other (a shared store, a store
 * service), and nothing tells it its claims are gone (a renewal only extends the records it
 * finds): other runs would compress its documents again meanwhile. Lapsed claims only: released.
 * Liveness is judged in the write txn that removes them (kvm_store_claim_release_lapsed), not
 * in a read before it: a claim the run took while this waited for the write lock is kept.
 * Returns the exit status. */
static int claims_release(const char *path, const kvm_config *cfg, const char *owner, int force)
{
    kvm_store *s = NULL;
    if (open_ro("store claims", path, &s, 0)) return 2; /* read-only first: never create a store */
    kvm_store_close(&s);
    int64_t n = 0, n_live = 0, latest_ms = 0;
    char esc[4 * sizeof((kvm_store_claim *)0)->owner + 1];
    table_esc(owner, esc, sizeof esc);
    int st = cfg ? kvm_storew_open(cfg, path, 0, &s) : kvm_store_open(path, NULL, &s);
    if (st == 0) st = kvm_store_claim_release_lapsed(s, owner, force, &n, &n_live, &latest_ms);
    kvm_store_close(&s);
    if (st == KVM_EBUSY && n_live > 0) {
        char why[200], when[40], run[260] = "";
        if (owner_running_here(owner, why, sizeof why)) snprintf(run, sizeof run, " (a live run: %s)", why);
        fprintf(stderr,
                "kvmill store claims: %s%s holds %lld live claim(s), the latest lapsing at %s unless renewed; "
                "not released: releasing them lets other runs compress those documents again while that run goes "
                "on (it would not notice); use --force if it is gone\n",
                esc, run, (long long)n_live, utc_of(latest_ms, when, sizeof when));
        return 1;
    }
    if (st) {
        fprintf(stderr, "kvmill store claims: %s (%s)\n", kvm_cli_errmsg("store claims"), kvm_strerror(st));
        return st == KVM_EINVAL ? 2 : 1;
    }
    if (n == 0) {
        fprintf(stderr, "kvmill store claims: no claim of %s in %s (store claims lists the owners)\n", esc, path);
        return 1;
    }
    printf("released %lld claim(s) of %s\n", (long long)n, esc);
    return 0;
}

/* An owner --release can name: 1..127 bytes, as a claim's owner is. Checked here, before the
 * store: its refusal ("owner must be 1..127 bytes, host 0..63, ttl_ms >= 1") named a host and a
 * ttl the command line never gave. 1 when fine, else 0 (said). */
static int release_owner_ok(const char *owner)
{
    const size_t max = sizeof((kvm_store_claim *)0)->owner - 1, n = strlen(owner);
    if (n >= 1 && n <= max) return 1;
    if (n == 0)
        fprintf(stderr,
                "kvmill store claims: --release: the owner is empty; an owner is 1 to %zu bytes (kvmill "
                "store claims lists the owners)\n",
                max);
    else
        fprintf(stderr,
                "kvmill store claims: --release: the owner is %zu bytes; an owner is 1 to %zu bytes (kvmill "
                "store claims lists the owners)\n",
                n, max);
    return 0;
}

static int cmd_claims(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"store", 1, "LMDB environment directory", NULL},
        CONFIG_OPT,
        {"csv", 0, "print CSV: model_id,doc_hash,config_id,since_ms,expires_ms,state,host,owner", NULL},
        {"owner", 1, "only the claims of this owner", NULL},
        {"release", 1,
         "remove every claim of this owner (refused while one of them is live, "
         "unless --force)",
         NULL},
        {"force", 0, "with --release: release live claims too (their run is gone)", NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos;
    int rc = parse("store claims",
                   "list the claims runs hold on documents (owner, host, cache key, expiry, live or lapsed), or "
                   "release an owner's (--release OWNER)",
                   argc, argv, opts, NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    const char *release = kvm_cli_get(opts, "release");
    if (kvm_cli_get(opts, "force") && !release) {
        fprintf(stderr, "kvmill store claims: --force goes with --release OWNER\n");
        return 2;
    }
    if (release && !release_owner_ok(release)) return 2;
    /* --release lists nothing and names its owner itself: an --owner other than it would be
     * ignored (the release of another owner's claims than the one asked for) */
    static const char *const listing_only[] = {"owner", "csv"};
    for (size_t i = 0; release && i < sizeof listing_only / sizeof *listing_only; i++)
        if (kvm_cli_get(opts, listing_only[i])) {
            fprintf(stderr, "kvmill store claims: --%s does not go with --release OWNER (it is for the listing)\n",
                    listing_only[i]);
            return 2;
        }
    kvm_config *cfg = NULL;
    const char *path;
    if (store_of("store claims", opts, &cfg, &path)) return 2;
    if (release)
        rc = claims_release(path, cfg, release, kvm_cli_get(opts, "force") != NULL);
    else {
        claims_ctx x = {
            .csv = kvm_cli_get(opts, "csv") != NULL, .owner = kvm_cli_get(opts, "owner"), .now_ms = wall_ms()};
        rc = claims_list(path, &x);
    }
    kvm_config_free(&cfg);
    return rc;
}

/* ---- compact ---- */

static int64_t file_bytes(const char *dir)
{
    char p[4200];
    struct stat st;
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    return stat(p, &st) == 0 ? (int64_t)st.st_size : 0;
}

/* path quoted for a POSIX shell into out[cap] ('...', each ' as '\''), so that the swap line
 * store compact prints can be pasted whatever the path holds; cut short (and still quoted)
 * only past cap. */
static const char *sh_quoted(const char *path, char *out, size_t cap)
{
    size_t k = 0;
    out[k++] = '\'';
    for (const char *p = path; *p && k + 6 < cap; p++) {
        if (*p == '\'') {
            memcpy(out + k, "'\\''", 4);
            k += 4;
        } else
            out[k++] = *p;
    }
    out[k++] = '\'';
    out[k] = '\0';
    return out;
}

/* The store path compact names: `path` without trailing slashes, resolved (realpath) when its
 * last part is "." or "..", since "STORE.compact" and "mv STORE STORE.old" need the folder's
 * own name ("..compact" would be a folder inside the store, and mv cannot move "."), and when
 * it is a symbolic link: the swap moved the link, not the store, so the copy (written beside
 * the link, maybe on another file system) replaced the link with a folder and the store it
 * pointed to stayed whole under LINK.old's target. Such a link is said on stderr. */
static void compact_store_path(const char *path, char *out, size_t cap)
{
    snprintf(out, cap, "%s", path);
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/')
        out[--len] = '\0';
    const char *base = strrchr(out, '/') ? strrchr(out, '/') + 1 : out;
    char real[PATH_MAX];
    struct stat lst;
    const int link = lstat(out, &lst) == 0 && S_ISLNK(lst.st_mode);
    if ((link || !strcmp(base, ".") || !strcmp(base, "..")) && realpath(out, real)) {
        if (link)
            fprintf(stderr,
                    "kvmill store compact: note: %s is a symbolic link to %s: the copy goes beside %s and the swap "
                    "moves it, so the link names the compacted store\n",
                    out, real, real);
        snprintf(out, cap, "%s", real);
    }
}

static int cmd_compact(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL},
                          CONFIG_OPT,
                          {"out", 1,
                           "directory for the compacted copy (must not exist; written into .NAME.compact-XXXXXX beside "
                           "it and renamed when complete); default STORE.compact",
                           NULL},
                          {NULL, 0, NULL, NULL}};
    int n_pos;
    int rc = parse("store compact", "write a compacted copy of the store (LMDB files never shrink) and say how to swap it in",
                   argc, argv, opts, NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    kvm_config *cfg = NULL;
    const char *path;
    if (store_of("store compact", opts, &cfg, &path)) return 2;
    char store[4096], out[4200];
    compact_store_path(path, store, sizeof store);
    snprintf(out, sizeof out, "%s", kvm_cli_get(opts, "out") ? kvm_cli_get(opts, "out") : store);
    if (!kvm_cli_get(opts, "out")) strncat(out, ".compact", sizeof out - strlen(out) - 1);
    kvm_config_free(&cfg);
    kvm_store *s = NULL;
    if (open_ro("store compact", store, &s, 0)) return 2;
    int64_t copy = 0;
    int st = kvm_store_compact(s, out, &copy);
    kvm_store_close(&s);
    if (st) {
        fprintf(stderr, "kvmill store compact: %s (%s)\n", kvm_cli_errmsg("store compact"), kvm_strerror(st));
        return st == KVM_EINVAL ? 2 : 1;
    }
    printf("compacted copy of %s in %s: data.mdb %lld bytes (was %lld)\n", store, out, (long long)copy,
           (long long)file_bytes(store));
    char old[4200], q[4][8500];
    snprintf(old, sizeof old, "%s.old", store);
    printf("to use it: stop every process that has the store open (kvmill run, serve, stage workers), then\n"
           "  mv %s %s && mv %s %s\n",
           sh_quoted(store, q[0], sizeof q[0]), sh_quoted(old, q[1], sizeof q[1]), sh_quoted(out, q[2], sizeof q[2]),
           sh_quoted(store, q[3], sizeof q[3]));
    return 0;
}

/* ---- stats ---- */

/* The config's [store] cap_mb when it is not the cap recorded in the store. Only a writing open
 * records it (run, calibrate, serve, store serve, store rm, store claims --release); stats, ls,
 * verify and compact open the store read-only, so that a store on a read-only mount stays
 * readable, and "cap_bytes none" would otherwise read as if the config's cap were ignored. */
static void print_config_cap(const kvm_config *cfg, const kvm_store_stats *t)
{
    const int64_t want = cfg ? kvm_config_int(cfg, "store", "cap_mb") << 20 : 0;
    if (want <= 0 || want == t->cap_bytes) return;
    printf("config_cap_bytes %" PRId64 " (%.1f%% used; [store] cap_mb = %" PRId64 " of %s, not recorded in this store: "
           "kvmill run, calibrate, serve, store serve, store rm and store claims --release record it when they open "
           "the store for writing)\n",
           want, 100.0 * (double)t->cache_bytes / (double)want, want >> 20, kvm_config_path(cfg));
}

static int cmd_stats(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL}, CONFIG_OPT, {NULL, 0, NULL, NULL}};
    int n_pos;
    int rc = parse("store stats",
                   "print usage: caches, bytes against the recorded cap (and --config's cap_mb when not recorded: "
                   "only a writing open records it), strategies, map size",
                   argc, argv, opts, NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    kvm_config *cfg = NULL;
    const char *path;
    if (store_of("store stats", opts, &cfg, &path)) return 2;
    kvm_store *s = NULL;
    int st = open_ro("store stats", path, &s, 0); /* a store that does not exist is an error, as for ls */
    if (st) {
        kvm_config_free(&cfg);
        return 2;
    }
    kvm_store_stats t = {0};
    if (s) {
        st = kvm_store_stats_get(s, &t);
        kvm_store_close(&s);
        if (st) {
            fprintf(stderr, "kvmill store stats: %s (%s)\n", kvm_cli_errmsg("store stats"), kvm_strerror(st));
            kvm_config_free(&cfg);
            return 1;
        }
    }
    printf("store           %s\n", path);
    printf("format_version  %u\n", t.format_version);
    printf("caches          %" PRId64 "\n", t.n_caches);
    printf("cache_bytes     %" PRId64 "\n", t.cache_bytes);
    if (t.cap_bytes > 0)
        printf("cap_bytes       %" PRId64 " (%.1f%% used)\n", t.cap_bytes, 100.0 * (double)t.cache_bytes / (double)t.cap_bytes);
    else
        printf("cap_bytes       none\n");
    print_config_cap(cfg, &t); /* path (from cfg) is printed above: cfg is freed only now */
    kvm_config_free(&cfg);
    printf("evicted         %" PRId64 "\n", t.n_evicted);
    printf("strategies      %" PRId64 "\n", t.n_strategies);
    printf("models          %" PRId64 "\n", t.n_models);
    printf("docs            %" PRId64 "\n", t.n_docs);
    printf("map_used_bytes  %" PRId64 "\n", t.map_used_bytes);
    printf("map_size_bytes  %" PRId64 "\n", t.map_size_bytes);
    return 0;
}

static const store_sub store_subs[] = {
    {"ls", cmd_ls, "list caches (--model ID, --csv, --config FILE: state of each)"},
    {"claims", cmd_claims, "list the runs' claims on documents; release an owner's: claims --release OWNER"},
    {"compact", cmd_compact, "write a compacted copy (--out DIR) and say how to swap it in"},
    {"rm", cmd_rm, "remove a cache: rm KEY; or rm --stale / --other-config --config FILE"},
    {"serve", kvm_cmd_store_serve, "run the store service: remote workers upload and fetch caches (--bind EP)"},
    {"show", cmd_show, "show a cache's manifest and layers: show KEY"},
    {"stats", cmd_stats, "usage against the cap, counts, map size"},
    {"verify", cmd_verify, "check every checksum, manifest and layer decode (exit 0 ok, 1 corrupt, 2 unopenable)"},
};

static void store_usage(FILE *f)
{
    fprintf(f, "usage: kvmill store SUBCOMMAND --store PATH|--config FILE [options]   (kvmill store SUBCOMMAND --help)\n"
               "inspect, verify and clean the LMDB cache store; KEY is MODELID:DOCHASH:CONFIGID in hex,\n"
               "unique prefixes accepted\n\nsubcommands:\n");
    for (size_t i = 0; i < sizeof store_subs / sizeof store_subs[0]; i++)
        fprintf(f, "  %-8s %s\n", store_subs[i].name, store_subs[i].summary);
}

int kvm_cmd_store(int argc, char **argv)
{
    if (argc < 2) {
        store_usage(stderr);
        return 2;
    }
    const char *sub = argv[1];
    if (strcmp(sub, "--help") == 0 || strcmp(sub, "-h") == 0 || strcmp(sub, "help") == 0) {
        store_usage(stdout);
        return 0;
    }
    char prefix[96];
    snprintf(prefix, sizeof prefix, "kvmill store %.32s: ", sub);
    kvm_log_setup("store", prefix, NULL); /* the store's own lines (a long wait for its write lock) */
    for (size_t i = 0; i < sizeof store_subs / sizeof store_subs[0]; i++)
        if (strcmp(sub, store_subs[i].name) == 0) return store_subs[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "kvmill store: unknown subcommand '%s'\n", sub);
    store_usage(stderr);
    return 2;
}
