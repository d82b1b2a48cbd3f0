/* cmd_eval_target.c: `kvmill eval --target-kl X`: per document and method, the smallest budget
 * whose KL on the continuation's search part is at most X (bisection over multiples of
 * --target-step), checked on the part after it. */
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "orchestrator/cmd_eval_int.h"
#include "orchestrator/kvm_cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "eval"

#define TARGET_CSV_HEADER                                                                                              \
    "doc,method,target_kl,context,budget_tokens,ratio,kl_search,kl_check,reached,probes,nonmonotone,dtype"

/* One (document, job) search: kvm_eval_kl_fn's user. */
typedef struct target_ctx {
    cmd_eval_setup *es;
    const cmd_eval_job *job;
    kvm_eval_doc *doc;
    int64_t T;                                /* search part; the check part follows it */
    double check[KVM_EVAL_TARGET_MAX_PROBES]; /* KL on the check part at each probe */
    kvm_eval_result res[KVM_EVAL_TARGET_MAX_PROBES];
    int n;
} target_ctx;

static int target_kl_at(void *user, int64_t budget, double *kl)
{
    target_ctx *t = user;
    kvm_budget b = {.tokens = budget};
    void *o = NULL;
    int rc = t->job->m->opts_new(t->job->has_arg ? t->job->arg : NULL, &b, &t->es->m->cfg, &o);
    kvm_eval_opts eo = cmd_eval__opts_of(t->es);
    eo.decode_steps = 0;
    if (!rc) rc = kvm_eval_run_ex(t->doc, t->job->m, o, &eo, &t->res[t->n]);
    t->job->m->opts_free(o);
    if (rc) return rc;
    *kl = kvm_eval_kl_range(t->doc, 0, t->T);
    t->check[t->n++] = kvm_eval_kl_range(t->doc, t->T, 2 * t->T);
    return 0;
}

/* Loads a document for the search: context N and continuation 2T when it has N + 2T tokens;
 * a shorter one (≥ 2T + 1 tokens) gets context L − 2T, so its last 2T tokens are the search
 * and check parts, and says so. *n_ctx is the context used. */
static int target_load(cmd_eval_setup *es, const char *path, const char *name, kvm_eval_doc **doc, int64_t *n_ctx)
{
    int32_t *ids;
    int64_t n;
    int erc = cmd_eval_docs_encode(CMD, es->tok, es->frame, path, es->N + 2 * es->T, &ids, &n);
    if (erc) return erc;
    int64_t N = es->N, T2 = 2 * es->T;
    if (n < N + T2) {
        N = n - T2;
        if (N < 1) {
            fprintf(stderr, "kvmill " CMD ": %s: %lld tokens, too few for a search and a check part of %lld each\n",
                    path, (long long)n, (long long)es->T);
            free(ids);
            return 1;
        }
        printf("note: %s has %lld tokens, fewer than context %lld + 2 x %lld: context %lld, its last %lld tokens "
               "are the search and check parts\n",
               name, (long long)n, (long long)es->N, (long long)es->T, (long long)N, (long long)T2);
    }
    int rc = kvm_eval_doc_new(es->m, es->k, ids, N + T2, N, T2, doc);
    free(ids);
    if (rc) {
        fprintf(stderr, "kvmill " CMD ": %s: %s\n", path, kvm_errmsg());
        return 1;
    }
    *n_ctx = N;
    return 0;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The smallest multiple of step below N that the job's method takes as a budget (a sculpt-family
 * method needs more than its retain zone), else N: where the search starts. */
static int64_t target_lo(const cmd_eval_setup *es, const cmd_eval_job *job, int64_t step, int64_t N)
{
    for (int64_t b = step; b < N; b += step) {
        kvm_budget kb = {.tokens = b};
        void *o = NULL;
        int rc = job->m->opts_new(job->has_arg ? job->arg : NULL, &kb, &es->m->cfg, &o);
        if (!rc) job->m->opts_free(o);
        if (!rc) return b;
    }
    return N;
}

/* Refuses the jobs with no budget searched below context N; `where` names that context in the
 * message ("--context 64", or a short document's). Returns 0, or 2 after printing why. */
static int check_steps(const cmd_eval_setup *es, const cmd_eval_job *jobs, int n_jobs, int64_t N, const char *where,
                       const char *fix)
{
    int rc = 0;
    for (int j = 0; !rc && j < n_jobs; j++) { /* as [compress] target_step refuses it (kvm_jobcfg_check) */
        const int64_t step = es->target_step < N ? es->target_step : N, lo = target_lo(es, &jobs[j], step, N);
        const int retains = cmd_eval__sculpt_family(jobs[j].m) && strcmp(jobs[j].m->name, "polykv"); /* a retain zone */
        if (lo >= N) {
            fprintf(stderr,
                    "kvmill " CMD ": --target-kl: method %s: no budget below %s is searched "
                    "(multiples of --target-step %lld%s): the search would keep the whole context; %s"
                    "--target-step%s\n",
                    jobs[j].spec, where, (long long)es->target_step, retains ? " above the retain zone" : "", fix,
                    retains ? " or --retain" : "");
            rc = 2;
        }
    }
    return rc;
}

int cmd_eval__check_target_steps(const cmd_eval_setup *es, const cmd_eval_job *jobs, int n_jobs, int64_t N)
{
    char where[64];
    snprintf(where, sizeof where, "--context %lld", (long long)N);
    return check_steps(es, jobs, n_jobs, N, where, "lower ");
}

int cmd_eval__check_target_docs(const cmd_eval_setup *es, const cmd_eval_docset *docs, const cmd_eval_job *jobs,
                                int n_jobs)
{
    int rc = 0;
    for (int d = 0; !rc && d < docs->n; d++) {
        int32_t *ids = NULL;
        int64_t n = 0;
        rc = cmd_eval_docs_encode(CMD, es->tok, es->frame, docs->paths[d], es->N + 2 * es->T, &ids, &n);
        free(ids);
        if (rc || n >= es->N + 2 * es->T) continue; /* at --context: checked by cmd_eval__check_target_steps */
        char where[4400];
        snprintf(where, sizeof where,
                 "the context of %s, %lld token%s (its %lld tokens less the search and check parts, 2 x "
                 "--continuation %lld)",
                 docs->paths[d], (long long)(n - 2 * es->T), kvm_plural(n - 2 * es->T, "", "s"), (long long)n,
                 (long long)es->T);
        rc = check_steps(es, jobs, n_jobs, n - 2 * es->T, where, "leave the document out, or lower --continuation or ");
    }
    return rc;
}

/* Per job, over the documents: what the summary reports. */
typedef struct target_tally {
    int64_t *chosen;   /* [n_jobs][n_docs]: the budget chosen per document */
    double *check_sum; /* [n_jobs]: KL on the check part at the chosen budget, summed */
    int *met;          /* [n_jobs]: documents whose check KL is within the target */
    int *nonmono;      /* [n_jobs]: documents where KL rose with the budget */
} target_tally;

/* Searches document d for every job (t: the search's scratch): a table row each, tallied in tl,
 * and a CSV row each when csv is not NULL. Returns 0, target_load's status, or 1 after printing
 * why. */
static int search_doc(cmd_eval_setup *es, const cmd_eval_docset *docs, int d, cmd_eval_job *jobs, int n_jobs,
                      target_ctx *t, target_tally *tl, FILE *csv)
{
    const char *dt = kvm_proto_dtype_name(es->dtype);
    kvm_eval_doc *doc;
    int64_t N;
    int rc = target_load(es, docs->paths[d], docs->names[d], &doc, &N);
    if (rc) return rc;
    printf("== %s: target KL %g on tokens [%lld, %lld), check on [%lld, %lld), stored as %s\n", docs->names[d],
           es->target_kl, (long long)N, (long long)(N + es->T), (long long)(N + es->T), (long long)(N + 2 * es->T), dt);
    printf("%-28s %8s %7s %10s %10s %7s %6s %11s\n", "method", "budget", "ratio", "kl_search", "kl_check", "reached",
           "probes", "nonmonotone");
    for (int j = 0; j < n_jobs; j++) {
        *t = (target_ctx){.es = es, .job = &jobs[j], .doc = doc, .T = es->T};
        kvm_eval_target tr;
        int64_t step = es->target_step < N ? es->target_step : N;
        if (kvm_eval_target_budget(target_kl_at, t, target_lo(es, &jobs[j], step, N), N, step, es->target_kl, &tr)) {
            fprintf(stderr, "kvmill " CMD ": %s, %s: %s\n", docs->names[d], jobs[j].spec, kvm_errmsg());
            rc = 1;
            break;
        }
        double check = NAN;
        for (int i = 0; i < tr.n_probes; i++)
            if (tr.probe_budget[i] == tr.budget) check = t->check[i];
        tl->chosen[(size_t)j * (size_t)docs->n + (size_t)d] = tr.budget;
        tl->check_sum[j] += check;
        tl->met[j] += check <= es->target_kl;
        tl->nonmono[j] += tr.n_nonmonotone > 0;
        printf("%-28s %8lld %7.4f %10.6f %10.6f %7s %6d %11d\n", jobs[j].spec, (long long)tr.budget,
               (double)tr.budget / (double)N, tr.kl, check, tr.reached ? "yes" : "no", tr.n_probes, tr.n_nonmonotone);
        if (csv) kvm_cli_csv_field(csv, docs->names[d]);
        if (csv)
            fprintf(csv, ",%s,%.9g,%lld,%lld,%.6f,%.9g,%.9g,%d,%d,%d,%s\n", jobs[j].spec, es->target_kl, (long long)N,
                    (long long)tr.budget, (double)tr.budget / (double)N, tr.kl, check, tr.reached, tr.n_probes,
                    tr.n_nonmonotone, dt);
    }
    kvm_eval_doc_free(&doc);
    kvm_cli_flush_stdout(); /* a failure's errno kept for main's message */
    return rc;
}

/* The summary over the documents, a line per job (sorts tl's chosen budgets). */
static void print_summary(const cmd_eval_docset *docs, const cmd_eval_job *jobs, int n_jobs, target_tally *tl)
{
    printf("== over %d document%s: chosen budgets (min / median / max), mean KL on the check part, documents "
           "whose check KL is within the target, documents where KL rose with the budget\n",
           docs->n, kvm_plural(docs->n, "", "s"));
    for (int j = 0; j < n_jobs; j++) {
        int64_t *b = tl->chosen + (size_t)j * (size_t)docs->n;
        qsort(b, (size_t)docs->n, sizeof *b, cmp_i64);
        /* the median of an even count is the mean of the two middle ones (it printed the upper) */
        const double median = 0.5 * (double)(b[(docs->n - 1) / 2] + b[docs->n / 2]);
        printf("%-28s budget %lld / %g / %lld  kl_check %.6f  within %d/%d  nonmonotone %d/%d\n", jobs[j].spec,
               (long long)b[0], median, (long long)b[docs->n - 1], tl->check_sum[j] / docs->n, tl->met[j], docs->n,
               tl->nonmono[j], docs->n);
    }
}

int cmd_eval__run_target(cmd_eval_setup *es, const cmd_eval_docset *docs, cmd_eval_job *jobs, int n_jobs, FILE *csv)
{
    if (csv) fprintf(csv, TARGET_CSV_HEADER "\n");
    target_tally tl = {calloc((size_t)docs->n * (size_t)n_jobs, sizeof *tl.chosen),
                       calloc((size_t)n_jobs, sizeof *tl.check_sum), calloc((size_t)n_jobs, sizeof *tl.met),
                       calloc((size_t)n_jobs, sizeof *tl.nonmono)};
    target_ctx *t = malloc(sizeof *t);
    int rc = 0;
    if (!tl.chosen || !tl.check_sum || !tl.met || !tl.nonmono || !t) {
        fprintf(stderr, "kvmill " CMD ": out of memory\n");
        rc = 1;
    }
    for (int d = 0; !rc && d < docs->n; d++)
        rc = search_doc(es, docs, d, jobs, n_jobs, t, &tl, csv);
    if (!rc) print_summary(docs, jobs, n_jobs, &tl);
    free(tl.chosen);
    free(tl.check_sum);
    free(tl.met);
    free(tl.nonmono);
    free(t);
    return rc;
}
