/* cmd_eval_jobs.c: `kvmill eval`'s jobs, one per (method, budget) column: building them from
 * --method and --budget/--ratio with the sculpt flags, and the checks that refuse, before any
 * document, a job that cannot be what the command line asks for. */
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "orchestrator/cmd_eval_int.h"
#include "orchestrator/kvm_cli.h"
#include "store/kvm_store.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "eval"

/* 1 for the methods the sculpt flags apply to: sculpt, selectfit, joint-fixed, am, kvzip (ARG =
 * sculpt options) and polykv (its sculpt layers; options after the file). */
int cmd_eval__sculpt_family(const kvm_method *m)
{
    return !strcmp(m->name, "sculpt") || !strcmp(m->name, "selectfit") || !strcmp(m->name, "joint-fixed") ||
           !strcmp(m->name, "am") || !strcmp(m->name, "kvzip") || !strcmp(m->name, "polykv");
}

/* One warning per deprecated option name in a method's ':'-joined sculpt options. */
static void warn_deprecated(const char *spec, const char *arg)
{
    for (const char *t = arg; t && *t;) {
        size_t len = strcspn(t, ":=");
        const kvm_sculpt_setting *s = kvm_sculpt_setting_find(t, len);
        if (s && s->replaced_by)
            fprintf(stderr, "kvmill " CMD ": --method %s: option '%.*s' is deprecated: use '%s'\n", spec, (int)len, t,
                    s->replaced_by);
        t = strchr(t, ':');
        if (t) t++;
    }
}

/* Notes on stderr the options of `arg` (':'-joined, the flags' and the method's own) that the
 * method of o never reads (kvm_sculpt_opts_unused): they are accepted, as strategy files and
 * configs share one option set, but tuning them for this method changes nothing. */
static void note_unused(const char *spec, const char *arg, const kvm_sculpt_opts *o)
{
    char names[512];
    if (kvm_sculpt_opts_unused(o, arg, ":", names, sizeof names) > 0)
        fprintf(stderr, "kvmill " CMD ": --method %s: note: %s not read by this method; ignored\n", spec, names);
}

/* Splits a comma-separated list in place; returns the count (≤ max) or -1 when too many. */
static int split(char *s, char **items, int max)
{
    int n = 0;
    for (char *save = NULL, *t = strtok_r(s, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == max) return -1;
        items[n++] = t;
    }
    return n;
}

_Static_assert(KVM_STORE_ID_BYTES == KVM_STRATEGY_MODEL_ID_BYTES, "a strategy records the store's model id");

/* The model id a polykv job's strategy file is checked against (KVST v3 records the one it was
 * calibrated on): the store's (kvm_store_hash_file), computed on the first file that records
 * one, since hashing a checkpoint costs seconds per GB. */
typedef struct model_ident {
    const char *path; /* --model */
    int known;        /* id computed */
    kvm_store_id id;
} model_ident;

/* Refuses polykv job e whose strategy was calibrated on another model than mi's (a v1/v2 file
 * passes with a note). Returns 0, 2 (another model), 1 (the model could not be read) after
 * saying why. */
static int strategy_model_ok(const cmd_eval_job *e, model_ident *mi)
{
    if (kvm_polykv_method_needs_model_id(e->opts) && !mi->known) {
        int rc = kvm_store_hash_file(mi->path, &mi->id);
        if (rc) {
            fprintf(stderr, "kvmill " CMD ": --model %s: %s\n", mi->path, kvm_errmsg());
            return rc == KVM_ENOMEM || rc == KVM_EIO ? 1 : 2;
        }
        mi->known = 1;
    }
    if (!kvm_polykv_method_check_model(e->opts, mi->known ? mi->id.b : NULL, mi->path)) return 0;
    fprintf(stderr, "kvmill " CMD ": --method %s: %s\n", e->spec, kvm_errmsg());
    return 2;
}

/* The strategy FILE of a "polykv:FILE[:OPTS]" method spec into buf: up to the first ':' that
 * starts a sculpt option (as cmd_eval__make_jobs splits it), so a path holding ':' stays whole. */
const char *cmd_eval__strategy_file(const char *spec, char *buf, size_t size)
{
    const char *f = spec + strlen("polykv:"), *end = NULL;
    for (const char *q = strchr(f, ':'); q && !end; q = strchr(q + 1, ':'))
        if (kvm_sculpt_setting_find(q + 1, strcspn(q + 1, ":="))) end = q;
    snprintf(buf, size, "%.*s", (int)(end ? end - f : (long)strlen(f)), f);
    return buf;
}

/* Parses one (method, budget) item into e: its method (*arg: the method's options, or NULL), spec
 * and budget (a ratio when is_ratio). Returns 0, or 2 after printing why. */
static int job_parse(cmd_eval_job *e, const char *spec, const char *item, int is_ratio, const char **arg)
{
    char name[64];
    if (kvm_eval_method_parse(spec, name, sizeof name, &e->m, arg)) {
        fprintf(stderr, "kvmill " CMD ": --method: %s\n", kvm_errmsg());
        return 2;
    }
    if (*arg && (strstr(spec, "::") || spec[strlen(spec) - 1] == ':')) { /* an option dropped unsaid */
        fprintf(stderr,
                "kvmill " CMD ": --method '%s': an option is empty (a method's options are name=value "
                "items joined by single ':')\n",
                spec);
        return 2;
    }
    snprintf(e->spec, sizeof e->spec, "%s", spec);
    snprintf(e->item, sizeof e->item, "%s", item);
    if (is_ratio) {
        if (kvm_cli_float(CMD, "ratio", item, 1e-9, 1.0, &e->budget.ratio)) return 2;
    } else if (kvm_cli_int(CMD, "budget", item, 1, INT32_MAX, &e->budget.tokens))
        return 2;
    return 0;
}

/* Refuses a sculpt-family method's own option that sizes the cache (budget, ratio, entries): the
 * column sets the size (target: --target-kl searches it). Returns 0, or 2 after printing why. */
static int job_size_refused(const cmd_eval_job *e, const char *spec, const char *arg, int is_ratio, int target)
{
    const char *own_opts = arg && !strcmp(e->m->name, "polykv") ? strchr(arg, ':') : arg; /* after FILE */
    const char *size = cmd_eval__sculpt_family(e->m) ? kvm_sculpt_opts_find_size(own_opts, ":") : NULL;
    if (!size) return 0;
    /* it overrode the column's size (a --target-kl search probed one budget), or polykv ignored it */
    fprintf(stderr,
            "kvmill " CMD ": --method %s: option '%.*s' sizes the cache, which is %s's to set "
            "(%s); remove it from the method and give the size there\n",
            spec, (int)strcspn(size, ":"), size,
            target     ? "--target-kl"
            : is_ratio ? "--ratio"
                       : "--budget",
            target                          ? "it searches the budget per document"
            : !strcmp(e->m->name, "polykv") ? "the strategy's per-layer budgets are rescaled to it"
                                            : "one column per value");
    return 2;
}

/* Refuses a sculpt-family method's own option given twice ("sculpt:retain=8:retain=16"), where
 * the last one won unsaid. Only the method's own options are checked: a sculpt flag (--retain 8)
 * with the same option among them is no repeat, the method's own overrides the flag for that
 * method (job_options). Returns 0, or 2 after printing why. */
static int job_repeat_refused(const cmd_eval_job *e, const char *spec, const char *arg)
{
    if (!arg || !cmd_eval__sculpt_family(e->m)) return 0;
    const char *own_opts = strcmp(e->m->name, "polykv") ? arg : strchr(arg, ':'); /* after FILE */
    if (!kvm_sculpt_opts_check_repeats(own_opts, ":")) return 0;
    fprintf(stderr, "kvmill " CMD ": --method %s: %s\n", spec, kvm_errmsg());
    return 2;
}

/* The options a sculpt-family method is made from when sculpt flags are given: the flags, then
 * the method's own, which override them (polykv: FILE first), written to full (size bytes);
 * otherwise arg as it is. *len: their length (size or more: they do not fit). */
static const char *job_options(const cmd_eval_job *e, const char *arg, const char *flags, char *full, size_t size,
                               size_t *len)
{
    *len = arg ? strlen(arg) : 0;
    if (!cmd_eval__sculpt_family(e->m) || !*flags) return arg;
    int w;
    if (!strcmp(e->m->name, "polykv")) { /* FILE, then the flags, then its own options */
        const char *own = NULL;
        for (const char *q = strchr(arg, ':'); q && !own; q = strchr(q + 1, ':'))
            if (kvm_sculpt_setting_find(q + 1, strcspn(q + 1, ":="))) own = q;
        w = snprintf(full, size, "%.*s:%s%s", (int)(own ? own - arg : (long)strlen(arg)), arg, flags, own ? own : "");
    } else
        w = snprintf(full, size, "%s%s%s", flags, arg ? ":" : "", arg ? arg : "");
    *len = w < 0 ? size : (size_t)w;
    return full;
}

/* A --method item, its budget item or its options (with the sculpt flags) longer than a job
 * holds (opts_len: 0 before they are joined): refused, since a copy cut to fit dropped options
 * or ended a value early (lambda=0.1e-3 cut to lambda=0.1) in silence. Returns 0, or 2 after
 * printing why. */
static int job_too_long(const cmd_eval_job *e, const char *spec, const char *item, size_t opts_len)
{
    const char *what = NULL;
    size_t n, max;
    if ((n = strlen(spec)) >= (max = sizeof e->spec))
        what = "the method item is";
    else if ((n = strlen(item)) >= (max = sizeof e->item))
        what = "the --budget/--ratio item is";
    else if ((n = opts_len) >= (max = sizeof e->arg))
        what = "its options with the sculpt flags come to";
    if (!what) return 0;
    fprintf(stderr, "kvmill " CMD ": --method %.60s%s: %s %zu bytes, more than the %zu a job holds; shorten it\n", spec,
            strlen(spec) > 60 ? "..." : "", what, n, max - 1);
    return 2;
}

/* Makes job e of method spec `spec` at budget item `item` (first: the method's first column,
 * where unused options are noted). Returns 0, 2 (bad option) or 1 after printing why. */
static int make_job(cmd_eval_job *e, const char *spec, const char *item, int first, int is_ratio, int target,
                    const char *flags, const kvm_model_config *c)
{
    const char *arg;
    if (job_too_long(e, spec, item, 0) || job_parse(e, spec, item, is_ratio, &arg) ||
        job_size_refused(e, spec, arg, is_ratio, target) || job_repeat_refused(e, spec, arg))
        return 2;
    if (cmd_eval__sculpt_family(e->m) && arg) warn_deprecated(spec, arg);
    char full[sizeof e->arg];
    size_t opts_len;
    arg = job_options(e, arg, flags, full, sizeof full, &opts_len);
    if (job_too_long(e, spec, item, opts_len)) return 2;
    e->has_arg = arg != NULL;
    snprintf(e->arg, sizeof e->arg, "%s", arg ? arg : "");
    int s = e->m->opts_new(arg, &e->budget, c, &e->opts);
    if (s) {
        fprintf(stderr, "kvmill " CMD ": --method %s: %s\n", spec, kvm_errmsg());
        return s == KVM_ENOMEM || s == KVM_EIO ? 1 : 2; /* said above, with the reason */
    }
    if (first && cmd_eval__sculpt_family(e->m) && strcmp(e->m->name, "polykv")) /* polykv: its layers' methods vary */
        note_unused(spec, arg, e->opts);
    return 0;
}

/* Item b of the --budget/--ratio list items, which method full (one column) makes no job of:
 * still a valid value, and not one an earlier item has. Returns 0, or 2 after printing why. */
static int full_item_ok(char *const *items, int b, int is_ratio)
{
    double r[2] = {0, 0};
    int64_t t[2] = {0, 0};
    for (int i = 0; i < b; i++) {
        int bad = is_ratio ? kvm_cli_float(CMD, "ratio", items[b], 1e-9, 1.0, &r[1]) ||
                                 kvm_cli_float(CMD, "ratio", items[i], 1e-9, 1.0, &r[0])
                           : kvm_cli_int(CMD, "budget", items[b], 1, INT32_MAX, &t[1]) ||
                                 kvm_cli_int(CMD, "budget", items[i], 1, INT32_MAX, &t[0]);
        if (bad) return 2;
        if (r[0] == r[1] && t[0] == t[1]) {
            if (strcmp(items[i], items[b]))
                fprintf(stderr, "kvmill " CMD ": --%s %s is given twice (as %s and %s): name each once\n",
                        is_ratio ? "ratio" : "budget", items[b], items[i], items[b]);
            else
                fprintf(stderr, "kvmill " CMD ": --%s %s is given twice: name each once\n",
                        is_ratio ? "ratio" : "budget", items[b]);
            return 2;
        }
    }
    return 0;
}

int cmd_eval__make_jobs(const char *methods, const char *budgets, int is_ratio, int target, const char *flags,
                        const kvm_model_config *c, const char *model_path, cmd_eval_job **jobs, int *n_jobs)
{
    model_ident mi = {.path = model_path};
    char *ms = strdup(methods), *bs = strdup(budgets), *mv[32], *bv[32];
    int rc = 0, nm = 0, nb = 0, oom = !ms || !bs;
    if (oom) rc = 1;
    const char *bflag = is_ratio ? "ratio" : "budget";
    if (!rc && (kvm_cli_list_check(CMD, "method", methods, 32) < 0 || kvm_cli_list_check(CMD, bflag, budgets, 32) < 0))
        rc = 2;
    if (!rc && ((nm = split(ms, mv, 32)) <= 0 || (nb = split(bs, bv, 32)) <= 0)) {
        fprintf(stderr, "kvmill " CMD ": --method and --%s take 1 to 32 comma-separated values\n",
                is_ratio ? "ratio" : "budget");
        rc = 2;
    }
    cmd_eval_job *j = rc ? NULL : calloc((size_t)(nm * nb), sizeof *j);
    if (!rc && !j) rc = oom = 1;
    int n = 0;
    for (int a = 0; !rc && a < nm; a++)
        for (int b = 0; !rc && b < nb; b++) {
            if (b > 0 && !strcmp(j[n - 1].m->name, "full")) { /* one column whatever the budgets */
                rc = full_item_ok(bv, b, is_ratio);
                continue;
            }
            if ((rc = make_job(&j[n], mv[a], bv[b], b == 0, is_ratio, target, flags, c))) break;
            n++;
            if (!strcmp(j[n - 1].m->name, "polykv")) rc = strategy_model_ok(&j[n - 1], &mi);
        }
    free(ms);
    free(bs);
    if (oom) fprintf(stderr, "kvmill " CMD ": out of memory\n"); /* not for a file that could not be read */
    *jobs = j;
    *n_jobs = n;
    return rc;
}

void cmd_eval__free_jobs(cmd_eval_job *j, int n)
{
    for (int i = 0; i < n; i++)
        j[i].m->opts_free(j[i].opts);
    free(j);
}

int cmd_eval__check_sizes(const cmd_eval_job *jobs, int n_jobs, int is_budget, int64_t N, const char *ctx,
                          const char *raise)
{
    int rc = 0;
    for (int j = 0; !rc && j < n_jobs; j++) /* as run refuses [compress] budget >= context, ratio = 1 */
        if (strcmp(jobs[j].m->name, "full") && (is_budget ? jobs[j].budget.tokens >= N : jobs[j].budget.ratio >= 1)) {
            if (is_budget)
                fprintf(stderr,
                        "kvmill " CMD ": --budget %lld is not below %s: the \"compressed\" cache "
                        "would be as large as the full one (the budget would be clamped to the context); lower "
                        "--budget (or use --method full)\n",
                        (long long)jobs[j].budget.tokens, ctx);
            else
                fprintf(stderr,
                        "kvmill " CMD ": --ratio %s keeps every entry: the \"compressed\" cache would be as "
                        "large as the full one; lower --ratio (or use --method full)\n",
                        jobs[j].item);
            rc = 2;
        }
    for (int j = 0; !rc && j < n_jobs; j++) {
        const kvm_sculpt_opts *so = kvm_method_solver_opts(jobs[j].m, jobs[j].opts); /* polykv: its layers' */
        const int distils = so && strcmp(jobs[j].m->name, "polykv"); /* the solver sizes the whole cache */
        const int64_t retain = so ? so->retain_tokens : 0;
        if (so && retain >= N) { /* each document failed after its prefill, exit 1 (sculpt refuses it: 2) */
            fprintf(stderr,
                    "kvmill " CMD ": --method %s: the retain zone of %lld tokens%s is not below %s: "
                    "nothing is left to compress; lower --retain or %s\n",
                    jobs[j].spec, (long long)retain, distils ? "" : " (of its strategy's sculpt and kvzip layers)", ctx,
                    raise);
            rc = 2;
        } else if (distils && !is_budget && kvm_sculpt_k(jobs[j].opts, N) + retain >= N) {
            /* k = round(r·(N − m)) distilled entries beside the m retained: the full cache, KL 0 */
            fprintf(stderr,
                    "kvmill " CMD ": --method %s: --ratio %s of the compress zone (%s less the retain "
                    "zone of %lld) keeps %lld distilled entr%s beside the %lld retained, the whole context: the "
                    "\"compressed\" cache would be as large as the full one; lower --ratio or %s\n",
                    jobs[j].spec, jobs[j].item, ctx, (long long)retain, (long long)kvm_sculpt_k(jobs[j].opts, N),
                    kvm_plural(kvm_sculpt_k(jobs[j].opts, N), "y", "ies"), (long long)retain, raise);
            rc = 2;
        } else if (!distils && !is_budget && strcmp(jobs[j].m->name, "full") &&
                   kvm_budget_resolve(&jobs[j].budget, N) >= N) { /* r·N rounded up to a whole entry */
            fprintf(stderr,
                    "kvmill " CMD ": --ratio %s of %s keeps %lld entr%s, the whole context: the "
                    "\"compressed\" cache would be as large as the full one; lower --ratio or %s\n",
                    jobs[j].item, ctx, (long long)kvm_budget_resolve(&jobs[j].budget, N),
                    kvm_plural(kvm_budget_resolve(&jobs[j].budget, N), "y", "ies"), raise);
            rc = 2;
        }
    }
    return rc;
}

int cmd_eval__check_repeat(const cmd_eval_job *jobs, int n_jobs, int64_t N, int64_t n_prompt, int window,
                           const char *ctx, const char *lower)
{
    const int64_t P = n_prompt > 0 ? n_prompt : 1; /* the BOS token alone without one (sculpt_qsource.c) */
    for (int j = 0; j < n_jobs; j++) {
        const kvm_sculpt_opts *so = kvm_method_solver_opts(jobs[j].m, jobs[j].opts);
        if (!so || !(so->query_source.share[KVM_SCULPT_QSRC_REPEAT] > 0) || 2 * N + P <= window) continue;
        fprintf(stderr,
                "kvmill " CMD ": --method %s: query_source repeat%s needs 2N + P = %lld positions (N = %lld, %s; "
                "the repeat prompt P = %lld) but the model's window is %d tokens: %s, or another query_source\n",
                jobs[j].spec, strcmp(jobs[j].m->name, "polykv") ? "" : " (its strategy's sculpt and kvzip layers)",
                (long long)(2 * N + P), (long long)N, ctx, (long long)P, window, lower);
        return 2;
    }
    return 0;
}

/* The entries per KV head job e keeps of a context of N tokens, as its method resolves its budget
 * (kvm_budget_resolve; the sculpt family: kvm_sculpt_k distilled entries and the retain zone);
 * task: a case's context may be shorter than N, so a ratio is compared as given (scaled to
 * compare as an integer). */
static int64_t job_entries(const cmd_eval_job *e, int is_budget, int task, int64_t N)
{
    if (is_budget) return e->budget.tokens;
    if (task) return (int64_t)llround(e->budget.ratio * 1e15);
    if (cmd_eval__sculpt_family(e->m) && strcmp(e->m->name, "polykv")) {
        const kvm_sculpt_opts *o = e->opts;
        return kvm_sculpt_k(o, N) + o->retain_tokens;
    }
    return kvm_budget_resolve(&e->budget, N);
}

/* 1 when jobs a and b run the same method with the same options: the sculpt family's settings
 * that change a result (kvm_sculpt_opts_canonical), else the options as given. */
static int same_options(const cmd_eval_job *a, const cmd_eval_job *b)
{
    if (a->m != b->m) return 0;
    if (!strcmp(a->m->name, "full")) return 1;
    if (cmd_eval__sculpt_family(a->m) && strcmp(a->m->name, "polykv")) {
        char ta[KVM_SCULPT_OPTS_CANONICAL_MAX], tb[KVM_SCULPT_OPTS_CANONICAL_MAX];
        if (kvm_sculpt_opts_canonical(a->opts, ta, sizeof ta) || kvm_sculpt_opts_canonical(b->opts, tb, sizeof tb))
            return !strcmp(a->arg, b->arg);
        return !strcmp(ta, tb);
    }
    return a->has_arg == b->has_arg && !strcmp(a->arg, b->arg);
}

/* Two jobs that resolve to the same (method, options, entries) would be the same column twice
 * (an item repeated, two ratios rounding to one budget, full at several budgets). Returns 0, or
 * 2 after printing why, naming both items as given. */
static int check_duplicates(const cmd_eval_job *jobs, int n_jobs, int target, int is_budget, int task, int64_t N)
{
    const char *bflag = is_budget ? "budget" : "ratio";
    for (int x = 0; x < n_jobs; x++)
        for (int y = 0; y < x; y++) {
            const cmd_eval_job *a = &jobs[y], *b = &jobs[x];
            if (!same_options(a, b)) continue;
            if (!strcmp(a->m->name, "full")) {
                fprintf(stderr, "kvmill " CMD ": --method full is given twice (full KV is one column whatever the "
                                "budgets): name it once\n");
                return 2;
            }
            if (target) {
                if (!strcmp(a->spec, b->spec))
                    fprintf(stderr, "kvmill " CMD ": --method %s is given twice: name each once\n", a->spec);
                else
                    fprintf(stderr,
                            "kvmill " CMD ": --method %s and --method %s are the same method with the same "
                            "options (--target-kl searches each once): name each once\n",
                            a->spec, b->spec);
                return 2;
            }
            const int64_t ea = job_entries(a, is_budget, task, N);
            if (ea != job_entries(b, is_budget, task, N)) continue;
            if (!strcmp(a->spec, b->spec) && !strcmp(a->item, b->item))
                fprintf(stderr, "kvmill " CMD ": --method %s at --%s %s is given twice: name each once\n", a->spec,
                        bflag, a->item);
            else if (!strcmp(a->spec, b->spec) && a->budget.tokens == b->budget.tokens &&
                     a->budget.ratio == b->budget.ratio) /* 0.3 and 0.30 */
                fprintf(stderr,
                        "kvmill " CMD ": --method %s at --%s %s is given twice (as %s and %s): name each once\n",
                        a->spec, bflag, b->item, a->item, b->item);
            else if (is_budget || task)
                fprintf(stderr,
                        "kvmill " CMD ": --method %s at --%s %s and --method %s at --%s %s are the same column (the "
                        "same method, options and size): name each once\n",
                        a->spec, bflag, a->item, b->spec, bflag, b->item);
            else
                fprintf(stderr,
                        "kvmill " CMD ": --method %s at --ratio %s and --method %s at --ratio %s are the same column: "
                        "the same method and options, both keeping %lld entries per KV head of --context %lld; "
                        "name each once\n",
                        a->spec, a->item, b->spec, b->item, (long long)ea, (long long)N);
            return 2;
        }
    return 0;
}

int cmd_eval__check_jobs(const cmd_eval_job *jobs, int n_jobs, int target, int is_budget, int task, int64_t N,
                         const char *sculpt_flag, const char *method)
{
    char ctx[64];
    snprintf(ctx, sizeof ctx, "--context %lld", (long long)N);
    int rc = target ? 0 : cmd_eval__check_sizes(jobs, n_jobs, is_budget, N, ctx, "raise --context");
    if (!rc) rc = check_duplicates(jobs, n_jobs, target, is_budget, task, N);
    int any_sculpt = 0;
    for (int j = 0; j < n_jobs; j++)
        any_sculpt |= cmd_eval__sculpt_family(jobs[j].m);
    if (!rc && sculpt_flag && !any_sculpt) { /* it would apply to none: the run would ignore it unsaid */
        fprintf(stderr,
                "kvmill " CMD ": --%s is a sculpt option, and --method %s has no method it applies to "
                "(sculpt, selectfit, joint-fixed, am, kvzip, polykv:FILE); drop it or add one\n",
                sculpt_flag, method);
        rc = 2;
    }
    for (int j = 0; !rc && target && j < n_jobs; j++)
        if (!strcmp(jobs[j].m->name, "full")) { /* as [compress] target_kl refuses it (kvm_jobcfg_check) */
            fprintf(stderr, "kvmill " CMD ": --target-kl chooses a budget per document, which method full does not "
                            "take (it keeps every entry: KL 0, the reference the others are scored against); leave "
                            "full out of --method\n");
            rc = 2;
        }
    return rc;
}
