/* cmd_eval.c: `kvmill eval`: compares compression methods with full KV on documents
 * (compress/eval/kvm_eval.h): a table per document, the mean, and an optional CSV. */
#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"
#include "orchestrator/kvm_cli_model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "eval"

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

/* Builds the jobs from --method and --budget/--ratio lists. Returns 0, 2 (bad option), 1. */
static int make_jobs(const char *methods, const char *budgets, int is_ratio, const kvm_model_config *c, eval_job **jobs,
                     int *n_jobs)
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
    kvm_cli_opt opts[] = {
        {"model", 1, "model file (llama2.c checkpoint)", NULL},
        {"tokenizer", 1, "tokenizer (default: beside the model)", NULL},
        {"docs", 1, "documents: a folder of *.txt, a file, or a comma-separated list", NULL},
        {"method", 1, "streaming|h2o|tova|snapkv|pyramidkv|polykv:FILE|full (comma-separated list allowed)", NULL},
        {"budget", 1, "entries kept per (layer, KV head), B (comma-separated list allowed)", NULL},
        {"ratio", 1, "budget as a share r of the context, b = r*N, in (0, 1] (list allowed)", NULL},
        {"context", 1, "context tokens N, BOS included (default 384)", NULL},
        {"continuation", 1, "continuation tokens T (default 64)", NULL},
        {"phases", 1, "prefill (default): compress the context only; both: also each method's decode policy", NULL},
        {"csv", 1, "write one row per (document, method, budget) to this CSV file", NULL},
        {"device", 1, "cpu or cuda:N (default cpu)", NULL},
        {"threads", 1, "BLAS threads", NULL},
        {NULL, 0, NULL, NULL}};
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
    if (!rc) rc = make_jobs(method, budget ? budget : ratio, !budget, &m->cfg, &jobs, &n_jobs);
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
