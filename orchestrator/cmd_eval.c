/* cmd_eval.c: `kvmill eval`: compares compression methods with full KV on documents
 * (compress/eval/kvm_eval.h): a table per document, the mean, and an optional CSV. */
#include "common/kvm_error.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"
#include "orchestrator/kvm_cli_model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "eval"

enum { MAX_OPTS = 64 };

/* Sculpt settings that are not also `kvmill eval` flags: --method is the method list, --ratio
 * and --budget the budget columns, --threads the command's own (applied to both); deprecated
 * names were never eval flags. */
static int eval_flag(const kvm_sculpt_setting *s)
{
    return strcmp(s->name, "method") && strcmp(s->name, "ratio") && strcmp(s->name, "budget") &&
           strcmp(s->name, "threads") && !s->replaced_by;
}

/* 1 for the methods the sculpt flags apply to: sculpt, selectfit, joint-fixed, am, kvzip (ARG =
 * sculpt options) and polykv (its sculpt layers; options after the file). */
static int sculpt_family(const kvm_method *m)
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

/* One (method, budget) column of the run. */
typedef struct eval_job {
    const kvm_method *m;
    char spec[512];    /* "h2o", "polykv:FILE" as given */
    kvm_budget budget; /* as requested */
    void *opts;        /* from m->opts_new */
    kvm_eval_result sum;
    int n;
} eval_job;

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

static void print_header(void)
{
    printf("%-28s %8s %7s %10s %10s %10s %6s %9s %9s %8s\n", "method", "budget", "ratio", "kl_mean", "kl_median",
           "kl_p99", "top1", "ppl_full", "ppl_comp", "seconds");
}

static void print_row(const char *spec, const kvm_eval_result *r)
{
    printf("%-28s %8.2f %7.4f %10.6f %10.6f %10.6f %6.3f %9.4f %9.4f %8.4f\n", spec, r->budget_tokens, r->ratio,
           r->kl_mean, r->kl_median, r->kl_p99, r->top1, r->ppl_full, r->ppl_compressed, r->seconds);
}

static void add_result(kvm_eval_result *s, const kvm_eval_result *r)
{
    s->budget_tokens += r->budget_tokens;
    s->ratio += r->ratio;
    s->kl_mean += r->kl_mean;
    s->kl_median += r->kl_median;
    s->kl_p99 += r->kl_p99;
    s->top1 += r->top1;
    s->ppl_full += r->ppl_full;
    s->ppl_compressed += r->ppl_compressed;
    s->seconds += r->seconds;
}

static void scale_result(kvm_eval_result *s, double f)
{
    s->budget_tokens *= f;
    s->ratio *= f;
    s->kl_mean *= f;
    s->kl_median *= f;
    s->kl_p99 *= f;
    s->top1 *= f;
    s->ppl_full *= f;
    s->ppl_compressed *= f;
    s->seconds *= f;
}

/* Builds the jobs from --method and --budget/--ratio lists; `flags` ("name=value:..."
 * from the sculpt flags, may be "") go before each sculpt-family method's own options, which
 * override them. Returns 0, 2 (bad option), 1. */
static int make_jobs(const char *methods, const char *budgets, int is_ratio, const char *flags,
                     const kvm_model_config *c, eval_job **jobs, int *n_jobs)
{
    char *ms = strdup(methods), *bs = strdup(budgets), *mv[32], *bv[32];
    int rc = 0, nm = 0, nb = 0;
    if (!ms || !bs) rc = 1;
    if (!rc && ((nm = split(ms, mv, 32)) <= 0 || (nb = split(bs, bv, 32)) <= 0)) {
        fprintf(stderr, "kvmill " CMD ": --method and --%s take 1 to 32 comma-separated values\n",
                is_ratio ? "ratio" : "budget");
        rc = 2;
    }
    eval_job *j = rc ? NULL : calloc((size_t)(nm * nb), sizeof *j);
    if (!rc && !j) rc = 1;
    int n = 0;
    for (int a = 0; !rc && a < nm; a++)
        for (int b = 0; !rc && b < nb; b++) {
            eval_job *e = &j[n];
            char name[64];
            const char *arg;
            if (kvm_eval_method_parse(mv[a], name, sizeof name, &e->m, &arg)) {
                fprintf(stderr, "kvmill " CMD ": --method: %s\n", kvm_errmsg());
                rc = 2;
                break;
            }
            snprintf(e->spec, sizeof e->spec, "%s", mv[a]);
            if (is_ratio) {
                if (kvm_cli_float(CMD, "ratio", bv[b], 1e-9, 1.0, &e->budget.ratio)) {
                    rc = 2;
                    break;
                }
            } else if (kvm_cli_int(CMD, "budget", bv[b], 1, INT32_MAX, &e->budget.tokens)) {
                rc = 2;
                break;
            }
            char full[2048];
            if (sculpt_family(e->m) && arg) warn_deprecated(mv[a], arg);
            if (sculpt_family(e->m) && *flags) {
                if (!strcmp(e->m->name, "polykv")) { /* FILE, then the flags, then its own options */
                    const char *own = NULL;
                    for (const char *q = strchr(arg, ':'); q && !own; q = strchr(q + 1, ':'))
                        if (kvm_sculpt_setting_find(q + 1, strcspn(q + 1, ":="))) own = q;
                    snprintf(full, sizeof full, "%.*s:%s%s", (int)(own ? own - arg : (long)strlen(arg)), arg, flags,
                             own ? own : "");
                } else
                    snprintf(full, sizeof full, "%s%s%s", flags, arg ? ":" : "", arg ? arg : "");
                arg = full;
            }
            int s = e->m->opts_new(arg, &e->budget, c, &e->opts);
            if (s) {
                fprintf(stderr, "kvmill " CMD ": --method %s: %s\n", mv[a], kvm_errmsg());
                rc = s == KVM_ENOMEM || s == KVM_EIO ? 1 : 2;
                break;
            }
            n++;
        }
    free(ms);
    free(bs);
    if (rc == 1) fprintf(stderr, "kvmill " CMD ": out of memory\n");
    *jobs = j;
    *n_jobs = n;
    return rc;
}

static void free_jobs(eval_job *j, int n)
{
    for (int i = 0; i < n; i++)
        j[i].m->opts_free(j[i].opts);
    free(j);
}

static int run(const kvm_model *m, const kvm_kernels *k, const kvm_tokenizer *tok, const cmd_eval_docset *docs,
               eval_job *jobs, int n_jobs, int64_t N, int64_t T, int both, FILE *csv)
{
    if (csv) fprintf(csv, KVM_EVAL_CSV_HEADER "\n");
    for (int d = 0; d < docs->n; d++) {
        kvm_eval_doc *doc;
        if (cmd_eval_docs_load(CMD, m, k, tok, docs->paths[d], N, T, 0, 1, &doc)) return 1;
        printf("== %s (context %lld, continuation %lld)\n", docs->names[d], (long long)N, (long long)T);
        print_header();
        for (int j = 0; j < n_jobs; j++) {
            kvm_eval_result r;
            if (kvm_eval_run(doc, jobs[j].m, jobs[j].opts, both, &r)) {
                fprintf(stderr, "kvmill " CMD ": %s, %s: %s\n", docs->names[d], jobs[j].spec, kvm_errmsg());
                kvm_eval_doc_free(&doc);
                return 1;
            }
            print_row(jobs[j].spec, &r);
            add_result(&jobs[j].sum, &r);
            jobs[j].n++;
            if (csv)
                fprintf(csv, "%s,%s,%.4f,%.6f,%.9g,%.9g,%.9g,%.6f,%.9g,%.9g,%.6f\n", docs->names[d], jobs[j].spec,
                        r.budget_tokens, r.ratio, r.kl_mean, r.kl_median, r.kl_p99, r.top1, r.ppl_full,
                        r.ppl_compressed, r.seconds);
        }
        kvm_eval_doc_free(&doc);
        fflush(stdout);
    }
    printf("== mean over %d documents\n", docs->n);
    print_header();
    for (int j = 0; j < n_jobs; j++) {
        scale_result(&jobs[j].sum, 1.0 / jobs[j].n);
        print_row(jobs[j].spec, &jobs[j].sum);
    }
    return 0;
}

int kvm_cmd_eval(int argc, char **argv)
{
    char method_help[768];
    snprintf(method_help, sizeof method_help, "%s (comma-separated list allowed; OPTS: name=value:... sculpt options, "
             "which override the sculpt flags below)", kvm_cli_methods());
    kvm_cli_opt opts[MAX_OPTS] = {
        {"model", 1, KVM_CLI_MODEL_HELP, NULL},
        {"tokenizer", 1, "tokenizer (default: a GGUF model's own, else beside the model)", NULL},
        {"docs", 1, "documents: a folder of *.txt, a file, or a comma-separated list", NULL},
        {"method", 1, method_help, NULL},
        {"budget", 1, "entries kept per (layer, KV head), B (comma-separated list allowed)", NULL},
        {"ratio", 1, "budget as a share r of the context, b = r*N, in (0, 1] (list allowed)", NULL},
        {"context", 1, "context tokens N, BOS included (default 384)", NULL},
        {"continuation", 1, "continuation tokens T (default 64)", NULL},
        {"phases", 1, "prefill (default): compress the context only; both: also each method's decode policy", NULL},
        {"csv", 1, "write one row per (document, method, budget) to this CSV file", NULL},
        {"device", 1, "cpu or cuda:N (default cpu)", NULL},
        {"threads", 1, "compute threads: the CPU kernels' (default: every core) and each sculpt-family method's solver "
                       "threads (default 1)",
         NULL},
    };
    int n_fixed = 12, n_set, n_opts = n_fixed;
    const kvm_sculpt_setting *set = kvm_sculpt_settings(&n_set);
    for (int i = 0; i < n_set && n_opts < MAX_OPTS - 1; i++) /* every sculpt setting, for sculpt-family methods */
        if (eval_flag(&set[i])) opts[n_opts++] = (kvm_cli_opt){set[i].flag, !set[i].is_flag, set[i].help, NULL};
    int n_pos, help;
    if (kvm_cli_parse(
            CMD, "Evaluates KV-cache compression methods against full KV: KL(full||compressed), top-1, perplexity.",
            argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *model_path = kvm_cli_get(opts, "model"), *docs_s = kvm_cli_get(opts, "docs"),
               *method = kvm_cli_get(opts, "method"), *budget = kvm_cli_get(opts, "budget"),
               *ratio = kvm_cli_get(opts, "ratio"), *phases = kvm_cli_get(opts, "phases"),
               *csv_path = kvm_cli_get(opts, "csv");
    if (!model_path || !docs_s || !method) {
        fprintf(stderr, "kvmill " CMD ": --model, --docs and --method are required\n");
        return 2;
    }
    if (!!budget == !!ratio) {
        fprintf(stderr, "kvmill " CMD ": give exactly one of --budget and --ratio\n");
        return 2;
    }
    int both = 0;
    if (phases && strcmp(phases, "both") == 0)
        both = 1;
    else if (phases && strcmp(phases, "prefill") != 0) {
        fprintf(stderr, "kvmill " CMD ": --phases: '%s' is not prefill or both\n", phases);
        return 2;
    }
    int64_t N, T;
    if (cmd_eval_lengths(CMD, kvm_cli_get(opts, "context"), kvm_cli_get(opts, "continuation"), &N, &T)) return 2;
    const kvm_kernels *k;
    if (kvm_cli_setup_device(CMD, kvm_cli_get(opts, "device"), kvm_cli_get(opts, "threads"), &k)) return 2;
    cmd_eval_docset docs;
    int rc = cmd_eval_docs_list(CMD, docs_s, &docs);
    if (rc) return rc;
    kvm_model *m = NULL;
    kvm_tokenizer *tok = NULL;
    eval_job *jobs = NULL;
    int n_jobs = 0;
    FILE *csv = NULL;
    if (kvm_cli_open_model(CMD, model_path, kvm_cli_get(opts, "tokenizer"), 1, &m, &tok)) rc = 1;
    if (!rc && N + T > m->cfg.seq_len) {
        fprintf(stderr, "kvmill " CMD ": context %lld + continuation %lld exceeds the model's window of %d tokens\n",
                (long long)N, (long long)T, m->cfg.seq_len);
        rc = 2;
    }
    char flags[2048] = "";
    size_t at = 0;
    for (int i = 0; i < n_set; i++) { /* table order; --threads too */
        const char *v = eval_flag(&set[i]) || !strcmp(set[i].name, "threads") ? kvm_cli_get(opts, set[i].flag) : NULL;
        if (!rc && v && strpbrk(v, ":,=")) {
            fprintf(stderr, "kvmill " CMD ": --%s: '%s' may not contain ':', ',' or '='\n", set[i].flag, v);
            rc = 2;
        }
        if (v && at < sizeof flags)
            at += (size_t)snprintf(flags + at, sizeof flags - at, "%s%s=%s", at ? ":" : "", set[i].name, v);
    }
    if (!rc) rc = make_jobs(method, budget ? budget : ratio, !budget, flags, &m->cfg, &jobs, &n_jobs);
    if (!rc && csv_path && !(csv = fopen(csv_path, "w"))) {
        fprintf(stderr, "kvmill " CMD ": --csv %s: %s\n", csv_path, strerror(errno));
        rc = 1;
    }
    if (!rc) rc = run(m, k, tok, &docs, jobs, n_jobs, N, T, both, csv);
    if (csv && fclose(csv) && !rc) {
        fprintf(stderr, "kvmill " CMD ": --csv %s: write failed\n", csv_path);
        rc = 1;
    }
    free_jobs(jobs, n_jobs);
    cmd_eval_docs_free(&docs);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return rc;
}
