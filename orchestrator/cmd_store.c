/* cmd_store.c: `kvmill store SUBCMD --store PATH ...`: list, show, verify, remove caches and
 * print usage of an LMDB cache store. Opens read-only except for `rm`; never creates a
 * store. Exit status: 0 ok, 1 failure (corruption, not found), 2 usage or unopenable store. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "store/kvm_store.h"

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
    if (!kvm_cli_get(opts, "store")) {
        fprintf(stderr, "kvmill %s: --store PATH is required (see kvmill %s --help)\n", cmd, cmd);
        return 2;
    }
    return -1;
}

/* Opens read-only; prints why not on stderr. */
static int open_ro(const char *cmd, const char *path, kvm_store **s, int quiet_missing)
{
    kvm_store_opts o = {.read_only = 1};
    int st = kvm_store_open(path, &o, s);
    if (st && !(quiet_missing && st == KVM_ENOTFOUND))
        fprintf(stderr, "kvmill %s: cannot open store: %s (%s)\n", cmd, kvm_errmsg(), kvm_strerror(st));
    return st;
}

/* Resolves KEY; prints why not. Returns the exit status to use on failure, 0 on success. */
static int resolve(const char *cmd, kvm_store *s, const char *text, kvm_store_cache_key *k)
{
    int st = kvm_store_find_cache(s, text, k);
    if (st == 0) return 0;
    fprintf(stderr, "kvmill %s: %s\n", cmd, kvm_errmsg());
    return st == KVM_EINVAL ? 2 : 1;
}

static double ratio_of(const kvm_store_manifest *m)
{
    return m->stored_bytes > 0 ? (double)m->full_bytes / (double)m->stored_bytes : 0.0;
}

/* ---- ls ---- */

typedef struct ls_ctx {
    const char *model_prefix; /* --model, or NULL */
    int csv;                  /* --csv */
    int64_t n_rows;           /* caches printed */
    int64_t n_bad;            /* manifests that failed their checks */
} ls_ctx;

static int ls_visit(const kvm_store_cache_key *k, const kvm_store_manifest *m, int status, void *arg)
{
    ls_ctx *c = arg;
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], d[KVM_STORE_ID_HEX + 1];
    if (c->model_prefix && !kvm_store_id_has_prefix(&k->model_id, c->model_prefix)) return 0;
    kvm_store_id_hex(&k->model_id, a);
    kvm_store_id_hex(&k->doc_hash, b);
    kvm_store_id_hex(&k->config_id, d);
    if (!m) {
        fprintf(stderr, "kvmill store ls: %s (%s); run kvmill store verify\n", kvm_errmsg(), kvm_strerror(status));
        c->n_bad++;
        return 0;
    }
    if (c->csv)
        printf("%s,%s,%s,%" PRId64 ",%" PRId64 ",%" PRId64 ",%.3f,%s\n", a, b, d, m->n_tokens, m->n_entries,
               m->stored_bytes, ratio_of(m), m->dtype);
    else
        printf("%-12.12s %-12.12s %-12.12s %9" PRId64 " %10" PRId64 " %12" PRId64 " %7.2f %s\n", a, b, d, m->n_tokens,
               m->n_entries, m->stored_bytes, ratio_of(m), m->dtype);
    c->n_rows++;
    return 0;
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
        {"model", 1, "only caches of this model id (hex, a prefix is enough)", NULL},
        {"csv", 0, "print CSV: model_id,doc_hash,config_id,tokens,entries,bytes,ratio,dtype", NULL},
        {NULL, 0, NULL, NULL},
    };
    int n_pos;
    int rc = parse("store ls", "list caches: tokens, entries, stored bytes, compression ratio (full f32 / stored)",
                   argc, argv, opts, NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    ls_ctx c = {.model_prefix = kvm_cli_get(opts, "model"), .csv = kvm_cli_get(opts, "csv") != NULL};
    if (c.model_prefix && check_hex_prefix("store ls", "model", c.model_prefix)) return 2;
    kvm_store *s = NULL;
    int st = open_ro("store ls", kvm_cli_get(opts, "store"), &s, 1);
    if (st && st != KVM_ENOTFOUND) return 2;
    if (c.csv) printf("model_id,doc_hash,config_id,tokens,entries,bytes,ratio,dtype\n");
    else printf("%-12s %-12s %-12s %9s %10s %12s %7s %s\n", "MODEL", "DOC", "CONFIG", "TOKENS", "ENTRIES", "BYTES",
                "RATIO", "DTYPE");
    if (!s) return 0; /* no store there: an empty listing */
    st = kvm_store_list_caches(s, NULL, ls_visit, &c);
    if (st) fprintf(stderr, "kvmill store ls: %s (%s)\n", kvm_errmsg(), kvm_strerror(st));
    kvm_store_close(&s);
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
    for (int32_t l = 0; l < m->n_layers; l++) {
        size_t bytes = 0;
        for (uint32_t f = 0; f < c->layers[l].n_frames; f++) bytes += c->layers[l].frames[f].size;
        printf("layer %-7d %u frames, %zu bytes\n", l, c->layers[l].n_frames, bytes);
    }
}

static int cmd_show(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL}, {NULL, 0, NULL, NULL}};
    char *pos[1];
    int n_pos;
    int rc = parse("store show", "show one cache: KEY = MODELID:DOCHASH:CONFIGID in hex, unique prefixes accepted",
                   argc, argv, opts, pos, 1, &n_pos);
    if (rc >= 0) return rc;
    if (n_pos != 1) {
        fprintf(stderr, "kvmill store show: expected one KEY (MODELID:DOCHASH:CONFIGID)\n");
        return 2;
    }
    kvm_store *s = NULL;
    if (open_ro("store show", kvm_cli_get(opts, "store"), &s, 0)) return 2;
    kvm_store_cache_key k;
    kvm_store_cache *c = NULL;
    rc = resolve("store show", s, pos[0], &k);
    if (rc == 0) {
        int st = kvm_store_get_cache(s, &k, NULL, &c);
        if (st) {
            fprintf(stderr, "kvmill store show: %s (%s)\n", kvm_errmsg(), kvm_strerror(st));
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

static int cmd_verify(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL}, {NULL, 0, NULL, NULL}};
    int n_pos;
    int rc = parse("store verify",
                   "check every checksum and manifest; exit 0 all pass, 1 corruption, 2 store cannot be opened", argc,
                   argv, opts, NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    kvm_store *s = NULL;
    if (open_ro("store verify", kvm_cli_get(opts, "store"), &s, 0)) return 2;
    int64_t n_records = 0, n_problems = 0;
    int st = kvm_store_verify(s, verify_report, NULL, &n_records, &n_problems);
    kvm_store_close(&s);
    if (st) {
        fprintf(stderr, "kvmill store verify: %s (%s)\n", kvm_errmsg(), kvm_strerror(st));
        return st == KVM_ECORRUPT ? 1 : 2;
    }
    printf("%" PRId64 " records checked, %" PRId64 " problem(s)\n", n_records, n_problems);
    return n_problems ? 1 : 0;
}

/* ---- rm ---- */

static int cmd_rm(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL}, {NULL, 0, NULL, NULL}};
    char *pos[1];
    int n_pos;
    int rc = parse("store rm", "remove one cache: KEY = MODELID:DOCHASH:CONFIGID in hex, unique prefixes accepted",
                   argc, argv, opts, pos, 1, &n_pos);
    if (rc >= 0) return rc;
    if (n_pos != 1) {
        fprintf(stderr, "kvmill store rm: expected one KEY (MODELID:DOCHASH:CONFIGID)\n");
        return 2;
    }
    const char *path = kvm_cli_get(opts, "store");
    kvm_store *s = NULL;
    if (open_ro("store rm", path, &s, 0)) return 2; /* read-only first: never create a store */
    kvm_store_cache_key k;
    rc = resolve("store rm", s, pos[0], &k);
    kvm_store_close(&s);
    if (rc) return rc;
    int st = kvm_store_open(path, NULL, &s);
    if (st == 0) st = kvm_store_rm_cache(s, &k);
    if (st) fprintf(stderr, "kvmill store rm: %s (%s)\n", kvm_errmsg(), kvm_strerror(st));
    kvm_store_close(&s);
    if (st) return 1;
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], c[KVM_STORE_ID_HEX + 1];
    printf("removed %s:%s:%s\n", kvm_store_id_hex(&k.model_id, a), kvm_store_id_hex(&k.doc_hash, b),
           kvm_store_id_hex(&k.config_id, c));
    return 0;
}

/* ---- stats ---- */

static int cmd_stats(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"store", 1, "LMDB environment directory", NULL}, {NULL, 0, NULL, NULL}};
    int n_pos;
    int rc = parse("store stats", "print usage: caches, bytes against the cap, strategies, map size", argc, argv, opts,
                   NULL, 0, &n_pos);
    if (rc >= 0) return rc;
    const char *path = kvm_cli_get(opts, "store");
    kvm_store *s = NULL;
    int st = open_ro("store stats", path, &s, 1);
    if (st && st != KVM_ENOTFOUND) return 2;
    kvm_store_stats t = {0};
    if (s) {
        st = kvm_store_stats_get(s, &t);
        kvm_store_close(&s);
        if (st) {
            fprintf(stderr, "kvmill store stats: %s (%s)\n", kvm_errmsg(), kvm_strerror(st));
            return 1;
        }
    }
    printf("store           %s%s\n", path, t.format_version ? "" : " (no store yet)");
    printf("format_version  %u\n", t.format_version);
    printf("caches          %" PRId64 "\n", t.n_caches);
    printf("cache_bytes     %" PRId64 "\n", t.cache_bytes);
    if (t.cap_bytes > 0)
        printf("cap_bytes       %" PRId64 " (%.1f%% used)\n", t.cap_bytes, 100.0 * (double)t.cache_bytes / (double)t.cap_bytes);
    else
        printf("cap_bytes       none\n");
    printf("evicted         %" PRId64 "\n", t.n_evicted);
    printf("strategies      %" PRId64 "\n", t.n_strategies);
    printf("models          %" PRId64 "\n", t.n_models);
    printf("docs            %" PRId64 "\n", t.n_docs);
    printf("map_used_bytes  %" PRId64 "\n", t.map_used_bytes);
    printf("map_size_bytes  %" PRId64 "\n", t.map_size_bytes);
    return 0;
}

static const store_sub store_subs[] = {
    {"ls", cmd_ls, "list caches (--model ID, --csv)"},
    {"rm", cmd_rm, "remove a cache: rm KEY"},
    {"show", cmd_show, "show a cache's manifest and layers: show KEY"},
    {"stats", cmd_stats, "usage against the cap, counts, map size"},
    {"verify", cmd_verify, "check every checksum and manifest (exit 0 ok, 1 corrupt, 2 unopenable)"},
};

static void store_usage(FILE *f)
{
    fprintf(f, "usage: kvmill store SUBCOMMAND --store PATH [options]   (kvmill store SUBCOMMAND --help)\n"
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
    for (size_t i = 0; i < sizeof store_subs / sizeof store_subs[0]; i++)
        if (strcmp(sub, store_subs[i].name) == 0) return store_subs[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "kvmill store: unknown subcommand '%s'\n", sub);
    store_usage(stderr);
    return 2;
}
