/* sculpt_opts.c: the table of KVSculpt settings (expanded from kvm_sculpt_settings.h) and the
 * parsers built on it. */
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "kernels/kvm_sculpt_kernels.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef enum kind { K_I64, K_INT, K_F64, K_U64, K_BOOL, K_MODE, K_ALLOC, K_QSOURCE, K_BUDGET, K_DEVICE } kind;

typedef struct row {
    const char *name, *def, *unit, *help, *replaced_by;
    kind kind;
    size_t off;
    double lo, hi;
    int in_config;
} row;

#define KVM_SCULPT_SETTING(nm, kd, field, lo_, hi_, cfg, def_, unit_, help_, repl)                                     \
    {#nm, def_, unit_, help_, repl, K_##kd, offsetof(kvm_sculpt_opts, field), lo_, hi_, cfg},
static const row rows[] = {
#include "compress/sculpt/kvm_sculpt_settings.h"
};
#undef KVM_SCULPT_SETTING
enum { N_ROWS = sizeof rows / sizeof rows[0] };

static kvm_sculpt_setting settings[N_ROWS];
static char flags[N_ROWS][32], helps[N_ROWS][320];
static pthread_once_t settings_once = PTHREAD_ONCE_INIT;

static void settings_init(void)
{
    kvm_sculpt_setting *s = settings;
    for (int i = 0; i < N_ROWS; i++) {
        const row *r = &rows[i];
        snprintf(flags[i], sizeof flags[i], "%s", r->name);
        for (char *p = flags[i]; *p; p++)
            if (*p == '_') *p = '-';
        if (r->replaced_by) {
            char repl[32];
            snprintf(repl, sizeof repl, "%s", r->replaced_by);
            for (char *p = repl; *p; p++)
                if (*p == '_') *p = '-';
            snprintf(helps[i], sizeof helps[i], "deprecated: use --%s (%s)", repl, r->help);
        } else
            snprintf(helps[i], sizeof helps[i], "%s (default %s%s%s)", r->help, r->def, *r->unit ? " " : "", r->unit);
        s[i] = (kvm_sculpt_setting){r->name, flags[i], helps[i], r->def, r->replaced_by, r->kind == K_BOOL,
                                    r->in_config};
    }
}

const kvm_sculpt_setting *kvm_sculpt_settings(int *n)
{
    pthread_once(&settings_once, settings_init);
    *n = N_ROWS;
    return settings;
}

/* a == b over len bytes of a, with '-' equal to '_' */
static int same_name(const char *a, size_t len, const char *b)
{
    if (strlen(b) != len) return 0;
    for (size_t i = 0; i < len; i++) {
        char x = a[i] == '-' ? '_' : a[i];
        if (x != b[i]) return 0;
    }
    return 1;
}

static const row *find_row(const char *name, size_t len)
{
    for (int i = 0; i < N_ROWS; i++)
        if (same_name(name, len, rows[i].name)) return &rows[i];
    return NULL;
}

const kvm_sculpt_setting *kvm_sculpt_setting_find(const char *name, size_t len)
{
    int n;
    const kvm_sculpt_setting *s = kvm_sculpt_settings(&n);
    const row *r = name ? find_row(name, len) : NULL;
    return r ? &s[r - rows] : NULL;
}

/* The solver's device (the `device` setting): "cpu", or "cuda:N" with N in [0, 255] checked
 * against the visible devices now, so a command refuses before its prefill
 * (kvm_sculpt_backend_cuda: the one selection every caller goes through). */
static int parse_device(const char *pre, const char *name, const char *v, kvm_sculpt_opts *o)
{
    int n;
    if (kvm_device_parse(v, &n)) return kvm_err(KVM_EINVAL, "%s--%s %s", pre, name, kvm_errmsg());
    if (n < 0) {
        o->cuda = 0, o->cuda_device = 0;
        return 0;
    }
    if (!kvm_sculpt_backend_cuda(n)) { /* kvm_err formats into scratch first: its own message may be an argument */
        const char *why = kvm_errmsg();   /* "cuda:N requested but …" names the value itself */
        return strncmp(why, v, strlen(v)) ? kvm_err(KVM_EDEVICE, "%s--%s %s: %s", pre, name, v, why)
                                          : kvm_err(KVM_EDEVICE, "%s--%s %s", pre, name, why);
    }
    o->cuda = 1, o->cuda_device = n;
    return 0;
}

static int parse_bool(const char *v, int *out)
{
    static const char *yes[] = {"1", "true", "yes", "on"}, *no[] = {"0", "false", "no", "off"};
    for (int i = 0; i < 4; i++) {
        if (!strcasecmp(v, yes[i])) return *out = 1, 0;
        if (!strcasecmp(v, no[i])) return *out = 0, 0;
    }
    return -1;
}

/* An integer setting's value as the command line's integer flags read it (kvm_cli_int: strtoll,
 * the whole string, no leading space), so that --budget 4e1 or 48.0 is refused by sculpt as by
 * eval; "-0" is 0. Returns 0 with *v, or -1. */
static int parse_integer(const char *s, double *v)
{
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (errno || end == s || *end || isspace((unsigned char)*s)) return -1;
    *v = (double)x;
    return 0;
}

/* kvm_sculpt_opts_set with the refusals starting with `pre`: "sculpt: " for a setting given
 * alone, "" for one of an option list (kvm_sculpt_opts_parse). A list is a method's options
 * (eval --method kvzip:queries=6.4e1, am:...), eval's sculpt flags or calibrate's --sculpt-opts:
 * "sculpt:" there named another method than the user's, and the caller says where the list
 * came from ("--method kvzip:queries=6.4e1: "). The setting is still named as a flag
 * ("--queries 6.4e1"): whether it was written as one is not known here (eval turns its flags into
 * such a list too). */
static int set_opt(kvm_sculpt_opts *o, const char *name, const char *value, const char *pre)
{
    const row *r = name ? find_row(name, strlen(name)) : NULL;
    if (!r) return kvm_err(KVM_ENOTFOUND, "%sno option '%s'", pre, name ? name : "");
    if (!value || !*value) { /* a bare name sets a switch; every other setting needs a value */
        if (r->kind != K_BOOL) return kvm_err(KVM_EINVAL, "%s--%s needs a value", pre, name);
        value = "1";
    }
    char *p = (char *)o + r->off;
    if (r->kind == K_MODE) return kvm_sculpt_mode_parse(value, (kvm_sculpt_mode *)(void *)p);
    if (r->kind == K_ALLOC) return kvm_sculpt_alloc_parse(value, (kvm_sculpt_alloc *)(void *)p);
    if (r->kind == K_QSOURCE) return kvm_sculpt_qsource_parse(value, (kvm_sculpt_qsource *)(void *)p);
    if (r->kind == K_DEVICE) return parse_device(pre, name, value, o);
    if (r->kind == K_BOOL) {
        if (parse_bool(value, (int *)(void *)p))
            return kvm_err(KVM_EINVAL, "%s--%s %s: expected 1/0, true/false, yes/no or on/off", pre, name, value);
        return 0;
    }
    double v = 0;
    if (r->kind == K_F64 && kvm_parse_decimal(value, &v) == KVM_ERANGE) { /* 1e-320 is in [0, hi]: no double */
        char why[512];
        return kvm_err(KVM_EINVAL, "%s--%s %s", pre, name, kvm_decimal_range_why(value, r->lo, r->hi, why, sizeof why));
    }
    if ((r->kind == K_F64 ? kvm_parse_decimal(value, &v) : parse_integer(value, &v)) || v < r->lo || v > r->hi)
        return r->kind == K_F64 /* an integer's bounds whole: %g printed 2^24 as 1.67772e+07 */
                   ? kvm_err(KVM_EINVAL, "%s--%s %s: expected a number in [%g, %g]", pre, name, value, r->lo, r->hi)
                   : kvm_err(KVM_EINVAL, "%s--%s %s: expected an integer in [%.0f, %.0f]", pre, name, value, r->lo,
                             r->hi);
    switch (r->kind) {
    case K_BUDGET:
        if (v > 0 && v <= o->retain_tokens)
            return kvm_err(KVM_EINVAL, "%sbudget %s entries per head leaves none beyond the retain zone of %lld", pre,
                           value, (long long)o->retain_tokens);
        *(int64_t *)(void *)p = v > 0 ? (int64_t)v - o->retain_tokens : 0;
        break;
    case K_I64: *(int64_t *)(void *)p = (int64_t)v; break;
    case K_INT: *(int *)(void *)p = (int)v; break;
    case K_U64: *(uint64_t *)(void *)p = (uint64_t)v; break;
    default: *(double *)(void *)p = v; break;
    }
    return 0;
}

int kvm_sculpt_opts_set(kvm_sculpt_opts *o, const char *name, const char *value)
{
    return set_opt(o, name, value, "sculpt: ");
}

/* budget, ratio, entries: which one sizes the cache (the last given) */
static int is_size(const row *r)
{
    return r && (!strcmp(r->name, "budget") || !strcmp(r->name, "ratio") || !strcmp(r->name, "entries"));
}

/* value [value, rest) "cuda" of the device setting followed by ",N" (digits) in an option list:
 * the device cuda:N, whose ':' the method syntax turned into ','. Returns the length of ",N"
 * to take into the value, else 0. */
static size_t device_tail(const row *r, const char *value, const char *rest)
{
    if (!r || r->kind != K_DEVICE || !value || rest - value != 4 || memcmp(value, "cuda", 4) || *rest != ',') return 0;
    size_t n = strspn(rest + 1, "0123456789");
    return n && (rest[1 + n] == ',' || !rest[1 + n]) ? 1 + n : 0;
}

const char *kvm_sculpt_opts_find_size(const char *list, const char *seps)
{
    for (const char *t = list; t && *t;) {
        size_t len = strcspn(t, seps), name = strcspn(t, "=");
        if (is_size(find_row(t, name < len ? name : len))) return t;
        t += len;
        if (*t) t++;
    }
    return NULL;
}

/* The setting an item names, deprecated names as the ones replacing them ("iters" is
 * "iterations"), so that two spellings of one setting count as one; NULL when unknown. */
static const char *setting_of(const char *item, size_t len)
{
    size_t name_len = strcspn(item, "=");
    const row *r = find_row(item, name_len < len ? name_len : len);
    return !r ? NULL : r->replaced_by ? r->replaced_by : r->name;
}

int kvm_sculpt_opts_check_repeats(const char *list, const char *seps)
{
    for (const char *t = list; t && *t; t += strcspn(t, seps), t += *t != '\0') {
        size_t len = strcspn(t, seps);
        const char *name = setting_of(t, len);
        if (!name) continue; /* an unknown name is the parser's to refuse; "cuda:1"'s "1" is no item */
        for (const char *u = t + len + (t[len] != '\0'); *u; u += strcspn(u, seps), u += *u != '\0') {
            size_t ulen = strcspn(u, seps);
            const char *again = setting_of(u, ulen);
            if (again && !strcmp(again, name))
                return kvm_err(KVM_EINVAL, "option '%s' is given twice ('%.*s' and '%.*s'): give it once", name,
                               (int)len, t, (int)ulen, u);
        }
    }
    return 0;
}

int kvm_sculpt_opts_parse(kvm_sculpt_opts *o, const char *arg)
{
    if (!arg || !*arg) return 0;
    char *s = strdup(arg);
    if (!s) return kvm_err(KVM_ENOMEM, "out of memory");
    int rc = 0;
    const char *size_name = NULL, *size_value = NULL;
    for (char *t = s; t && !rc;) {
        char *next = t + strcspn(t, ",");
        const int empty = next == t; /* ",," or a trailing ',': nothing */
        char *eq = memchr(t, '=', (size_t)(next - t));
        if (eq) *eq++ = 0;
        const row *r = find_row(t, strlen(t));
        size_t tail = device_tail(r, eq, next);
        if (tail) { /* "device=cuda,N" is device=cuda:N */
            *next = ':';
            next += tail;
        }
        char *after = *next ? next + 1 : NULL;
        *next = 0;
        if (!empty) {
            if (is_size(r)) {
                size_name = t;
                size_value = eq;
            } else
                rc = set_opt(o, t, eq, "");
        }
        t = after;
    }
    if (!rc && size_name) {
        const row *r = find_row(size_name, strlen(size_name));
        if (strcmp(r->name, "budget")) o->k_entries = 0; /* ratio or entries replaces an earlier budget */
        rc = set_opt(o, size_name, size_value, "");
    }
    free(s);
    return rc;
}

int kvm_sculpt_opts_set_budget(kvm_sculpt_opts *o, const kvm_budget *b)
{
    if (b->tokens > 0) {
        if (b->tokens <= o->retain_tokens)
            return kvm_err(KVM_EINVAL, "sculpt: budget %lld entries per head leaves none beyond the retain zone of %lld",
                           (long long)b->tokens, (long long)o->retain_tokens);
        o->k_entries = b->tokens - o->retain_tokens;
        return 0;
    }
    if (!(b->ratio > 0 && b->ratio <= 1)) return kvm_err(KVM_EINVAL, "sculpt: a ratio in (0, 1] or a budget is required");
    o->ratio = b->ratio;
    o->k_entries = 0;
    return 0;
}

/* 1 when setting `name` (the table's current name) is never read by o's method (see
 * kvm_sculpt_opts_unused). The solvers decide: sculpt_solve.c and sculpt_batch.c run L-BFGS
 * rounds only when keys move (sculpt) or biases are fitted (bias, joint-fixed); am and kvzip
 * return before (sculpt_am.c, sculpt_kvzip.c), and kvzip keeps the original values; the
 * allocation pilot (power, pilot_*) runs only with alloc other than uniform (sculpt_compress.c),
 * and future places synthetic queries only. */
static int unused_by(const kvm_sculpt_opts *o, const char *name)
{
    static const char *const rounds[] = {
        "rounds",        "iterations",      "history",      "tolerance",        "gradient_tolerance",
        "carry_history", "round_tolerance", "pilot_rounds", "pilot_iterations", NULL};
    static const char *const values[] = {"ridge", "ridge_f32", "vcap", NULL};
    const int baseline = o->mode == KVM_SCULPT_AM || o->mode == KVM_SCULPT_KVZIP;
    const int no_rounds = baseline || (o->mode == KVM_SCULPT_SELECTFIT && !o->bias);
    for (int i = 0; no_rounds && rounds[i]; i++)
        if (!strcmp(name, rounds[i])) return 1;
    for (int i = 0; o->mode == KVM_SCULPT_KVZIP && values[i]; i++)
        if (!strcmp(name, values[i])) return 1;
    if (!strcmp(name, "power") || !strcmp(name, "pilot_rounds") || !strcmp(name, "pilot_iterations"))
        return o->alloc == KVM_SCULPT_ALLOC_UNIFORM; /* the allocation pilot's: uniform budgets run none */
    if (!strcmp(name, "future"))                     /* the synthetic queries' positions (sculpt_problem.c) */
        return !(o->query_source.share[KVM_SCULPT_QSRC_SYNTHETIC] > 0) || o->n_synth == 0;
    if (!strcmp(name, "kcap")) return o->mode != KVM_SCULPT_FULL;
    if (!strcmp(name, "bias")) return baseline || o->mode == KVM_SCULPT_JOINT_FIXED;
    if (!strcmp(name, "am_start")) return baseline;
    return 0;
}

int kvm_sculpt_opts_unused(const kvm_sculpt_opts *o, const char *list, const char *seps, char *out, size_t n)
{
    int count = 0;
    size_t at = 0;
    if (n) out[0] = '\0';
    for (const char *t = list; t && *t; t += strcspn(t, seps), t += *t != '\0') {
        size_t len = strcspn(t, seps), name_len = strcspn(t, "=");
        const row *r = find_row(t, name_len < len ? name_len : len);
        if (!r) continue;
        const char *name = r->replaced_by ? r->replaced_by : r->name; /* iters is iterations */
        if (!unused_by(o, name)) continue;
        if (at < n)
            at += (size_t)snprintf(out + at, n - at, "%s%.*s", count ? ", " : "",
                                   (int)(name_len < len ? name_len : len), t);
        count++;
    }
    return count;
}

void kvm_sculpt_opts_help(FILE *f)
{
    int n;
    const kvm_sculpt_setting *s = kvm_sculpt_settings(&n);
    for (int i = 0; i < n; i++)
        if (!s[i].replaced_by) fprintf(f, "  --%-16s %s\n", s[i].flag, s[i].help);
}

/* A source named in query_source whose share of `queries` rounds to none would be ignored in
 * silence (repeat@1e-6+synthetic, or repeat+synthetic with queries = 1: on_policy then changed
 * nothing), so it is refused; queries = 0 (the retain zone's queries alone) names no count. */
static int check_query_counts(const kvm_sculpt_opts *o)
{
    static const char *const names[KVM_SCULPT_QSRC_COUNT] = {"synthetic", "repeat", "continuation"};
    int64_t n[KVM_SCULPT_QSRC_COUNT];
    if (o->n_synth <= 0) return 0;
    kvm_sculpt_qsource_counts(&o->query_source, o->n_synth, n);
    for (int i = 0; i < KVM_SCULPT_QSRC_COUNT; i++)
        if (o->query_source.share[i] > 0 && n[i] == 0) {
            char qs[256];
            kvm_sculpt_qsource_format(&o->query_source, qs, sizeof qs);
            return kvm_err(KVM_EINVAL,
                           "sculpt: query_source %s with queries = %lld gives %s no query (its share %g of them "
                           "rounds to 0): raise its share or queries, or leave %s out",
                           qs, (long long)o->n_synth, names[i], o->query_source.share[i], names[i]);
        }
    return 0;
}

int kvm_sculpt_opts_check_combination(const kvm_sculpt_opts *o)
{
    /* the fit's training queries are the retain zone's own and `queries` more (sculpt_problem.c):
     * with neither every head fails after the prefill, so say it before any work */
    if (o->n_synth == 0 && o->retain_tokens == 0)
        return kvm_err(KVM_EINVAL, "sculpt: queries = 0 and retain = 0 leave no training queries (the retain zone's "
                                   "own and `queries` more): set queries (default 2048) or retain above 0");
    int rc = check_query_counts(o);
    if (rc) return rc;
    if (o->on_policy && o->query_source.share[KVM_SCULPT_QSRC_REPEAT] <= 0 &&
        o->query_source.share[KVM_SCULPT_QSRC_CONTINUATION] <= 0)
        return kvm_err(KVM_EINVAL, "sculpt: on_policy takes its queries from forward passes over the compressed layers: "
                                   "it needs query_source repeat or continuation (or a mix with one of them)");
    if (o->on_policy && o->n_synth == 0) /* a repeat share of no queries: the layers would be fitted as without it */
        return kvm_err(KVM_EINVAL,
                       "sculpt: on_policy takes its queries from forward passes over the compressed layers: "
                       "queries = 0 gives it none: set queries above 0");
    if (o->on_policy && o->alloc != KVM_SCULPT_ALLOC_UNIFORM)
        return kvm_err(KVM_ENOTSUP, "sculpt: on_policy solves one layer at a time and the alloc pilot allocates across "
                                    "layers: use alloc = uniform with on_policy");
    return 0;
}

/* The settings kvm_sculpt_opts_canonical records: the [compress] keys, and method and future
 * (keys of their own, shared with eviction and the stages, that change a distilled result). */
static int recorded(const row *r)
{
    return !r->replaced_by && (r->in_config || r->kind == K_MODE || !strcmp(r->name, "future"));
}

/* The word of a MODE or ALLOC value, found through the row's own parse (so the two cannot
 * disagree), or "?" for a value no word gives. */
static const char *word_of(const row *r, int v)
{
    static const char *const modes[] = {"sculpt", "selectfit", "joint-fixed", "am", "kvzip"};
    static const char *const allocs[] = {"uniform", "layer", "head", "gain"};
    const char *const *w = r->kind == K_MODE ? modes : allocs;
    const size_t n = r->kind == K_MODE ? sizeof modes / sizeof *modes : sizeof allocs / sizeof *allocs;
    for (size_t i = 0; i < n; i++) {
        kvm_sculpt_opts t = kvm_sculpt_opts_default();
        if (!kvm_sculpt_opts_set(&t, r->name, w[i]) && *(const int *)(const void *)((const char *)&t + r->off) == v)
            return w[i];
    }
    return "?";
}

/* The shortest "%.Ng" of v that kvm_parse_decimal reads back to v exactly. */
static void put_number(double v, char *out, size_t n)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, n, "%.*g", prec, v);
        double back;
        if (!kvm_parse_decimal(out, &back) && back == v) return;
    }
}

/* Row r's value in o, in its canonical spelling. */
static void put_value(const row *r, const kvm_sculpt_opts *o, char *out, size_t n)
{
    const void *p = (const char *)o + r->off;
    switch (r->kind) {
    case K_MODE:
    case K_ALLOC: snprintf(out, n, "%s", word_of(r, *(const int *)p)); break;
    case K_QSOURCE: kvm_sculpt_qsource_format(p, out, n); break;
    case K_BOOL: snprintf(out, n, "%s", *(const int *)p ? "true" : "false"); break;
    case K_I64: snprintf(out, n, "%lld", (long long)*(const int64_t *)p); break;
    case K_INT: snprintf(out, n, "%d", *(const int *)p); break;
    case K_U64: snprintf(out, n, "%llu", (unsigned long long)*(const uint64_t *)p); break;
    case K_F64: put_number(*(const double *)p, out, n); break;
    default: out[0] = 0; break; /* budget, device: never recorded */
    }
}

int kvm_sculpt_opts_canonical(const kvm_sculpt_opts *o, char *buf, size_t size)
{
    size_t at = 0;
    if (size) buf[0] = 0;
    const kvm_sculpt_opts def = kvm_sculpt_opts_default();
    for (int i = 0; i < N_ROWS; i++) {
        if (!recorded(&rows[i])) continue;
        /* am_start, added after strategy files recorded their options: written only when set, so
         * the files written before (and their hashes, the ids of their caches) keep their bytes */
        if (!strcmp(rows[i].name, "am_start") && o->am_start == def.am_start) continue;
        char v[256];
        put_value(&rows[i], o, v, sizeof v);
        int w = snprintf(buf + at, size > at ? size - at : 0, "%s%s=%s", at ? "," : "", rows[i].name, v);
        if (w < 0 || at + (size_t)w >= size)
            return kvm_err(KVM_EINVAL, "sculpt options: the canonical text needs more than %zu bytes", size);
        at += (size_t)w;
    }
    return 0;
}

int kvm_sculpt_opts_from_canonical(const char *text, size_t len, kvm_sculpt_opts *o)
{
    *o = kvm_sculpt_opts_default();
    char s[KVM_SCULPT_OPTS_CANONICAL_MAX];
    if (len >= sizeof s)
        return kvm_err(KVM_EINVAL, "sculpt options: %zu bytes, longer than %zu", len, sizeof s - 1);
    memcpy(s, text, len);
    s[len] = 0;
    if (strlen(s) != len) return kvm_err(KVM_EINVAL, "sculpt options: a NUL byte at offset %zu", strlen(s));
    int next = 0; /* items come in table order, each once */
    for (size_t at = 0; at < len;) {
        size_t end = at + strcspn(s + at, ",");
        if (end + 1 == len) return kvm_err(KVM_EINVAL, "sculpt options: a trailing ',' at offset %zu", end);
        s[end] = 0;
        char *item = s + at, *eq = strchr(item, '=');
        if (!eq) return kvm_err(KVM_EINVAL, "sculpt options: '%s' at offset %zu is not name=value", item, at);
        *eq = 0;
        const row *r = NULL;
        for (int i = 0; i < N_ROWS && !r; i++)
            if (!strcmp(rows[i].name, item) && recorded(&rows[i])) r = &rows[i];
        if (!r) return kvm_err(KVM_EINVAL, "sculpt options: '%s' at offset %zu is not a recorded setting", item, at);
        if (r - rows < next)
            return kvm_err(KVM_EINVAL, "sculpt options: '%s' at offset %zu is repeated or out of order", item, at);
        next = (int)(r - rows) + 1;
        if (kvm_sculpt_opts_set(o, item, eq + 1))
            return kvm_err(KVM_EINVAL, "sculpt options: offset %zu: %s", at, kvm_errmsg());
        char v[256];
        put_value(r, o, v, sizeof v);
        if (strcmp(v, eq + 1))
            return kvm_err(KVM_EINVAL, "sculpt options: %s=%s at offset %zu is not canonical (%s=%s)", item, eq + 1, at,
                           item, v);
        at = end + 1;
    }
    return 0;
}

int kvm_sculpt_opts_diff(const kvm_sculpt_opts *a, const kvm_sculpt_opts *b, const char *label, char *out, size_t n)
{
    char ta[KVM_SCULPT_OPTS_CANONICAL_MAX], tb[KVM_SCULPT_OPTS_CANONICAL_MAX];
    out[0] = 0;
    if (kvm_sculpt_opts_canonical(a, ta, sizeof ta) || kvm_sculpt_opts_canonical(b, tb, sizeof tb)) return 1;
    size_t at = 0;
    int same = 1;
    for (const char *pa = ta, *pb = tb; *pa && *pb && at < n;) { /* the same names in the same order */
        size_t la = strcspn(pa, ","), lb = strcspn(pb, ","), eq = strcspn(pa, "=");
        if (la != lb || memcmp(pa, pb, la)) {
            int w = snprintf(out + at, n - at, "%s%.*s (%s: %.*s)", same ? "" : ", ", (int)la, pa, label,
                             (int)(lb - eq - 1), pb + eq + 1);
            if (w < 0) break;
            at += (size_t)w;
            same = 0;
        }
        pa += la + (pa[la] == ',');
        pb += lb + (pb[lb] == ',');
    }
    return same;
}
