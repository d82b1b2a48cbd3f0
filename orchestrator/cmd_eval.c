/* cmd_eval.c: `kvmill eval`: compares compression methods with full KV on documents
 * (compress/eval/kvm_eval.h): a table per document, the mean, and an optional CSV. */
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "compress/eval/kvm_eval_cuda.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "model/kvm_chat.h"
#ifdef KVM_WITH_CUDA
#include "model/kvm_forward_cuda.h"
#endif
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"
#include "orchestrator/kvm_cli_model.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_chatcfg.h"
#include "store/kvm_store.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "eval"

enum { MAX_OPTS = 96 };

/* Sculpt settings that are not also `kvmill eval` flags: --method is the method list, --ratio
 * and --budget the budget columns, --threads and --device the command's own (applied to both);
 * deprecated names were never eval flags. */
static int eval_flag(const kvm_sculpt_setting *s)
{
    return strcmp(s->name, "method") && strcmp(s->name, "ratio") && strcmp(s->name, "budget") &&
           strcmp(s->name, "threads") && strcmp(s->name, "device") && !s->replaced_by;
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

/* Notes on stderr the options of `arg` (':'-joined, the flags' and the method's own) that the
 * method of o never reads (kvm_sculpt_opts_unused): they are accepted, as strategy files and
 * configs share one option set, but tuning them for this method changes nothing. */
static void note_unused(const char *spec, const char *arg, const kvm_sculpt_opts *o)
{
    char names[512];
    if (kvm_sculpt_opts_unused(o, arg, ":", names, sizeof names) > 0)
        fprintf(stderr, "kvmill " CMD ": --method %s: note: %s not read by this method; ignored\n", spec, names);
}

/* One (method, budget) column of the run. */
typedef struct eval_job {
    const kvm_method *m;
    char spec[512];    /* "h2o", "polykv:FILE" as given */
    kvm_budget budget; /* as requested */
    void *opts;        /* from m->opts_new */
    char arg[2048];    /* the options opts was made from (flags and the method's own) */
    int has_arg;       /* 0: opts_new got NULL */
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
    printf("%-28s %8s %7s %10s %10s %10s %6s %9s %9s %8s %10s %9s\n", "method", "budget", "ratio", "kl_mean",
           "kl_median", "kl_p99", "top1", "ppl_full", "ppl_comp", "seconds", "bytes", "decode_ms");
}

static void print_row(const char *spec, const kvm_eval_result *r)
{
    printf("%-28s %8.2f %7.4f %10.6f %10.6f %10.6f %6.3f %9.4f %9.4f %8.4f %10lld %9.3f\n", spec, r->budget_tokens,
           r->ratio, r->kl_mean, r->kl_median, r->kl_p99, r->top1, r->ppl_full, r->ppl_compressed, r->seconds,
           (long long)r->bytes_compressed, r->decode_ms);
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
    s->bytes_compressed += r->bytes_compressed;
    s->decode_ms += r->decode_ms;
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
    s->bytes_compressed = (int64_t)((double)s->bytes_compressed * f + 0.5);
    s->decode_ms *= f;
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
static int strategy_model_ok(const eval_job *e, model_ident *mi)
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
 * starts a sculpt option (as make_jobs splits it), so a path holding ':' stays whole. */
static const char *strategy_file(const char *spec, char *buf, size_t size)
{
    const char *f = spec + strlen("polykv:"), *end = NULL;
    for (const char *q = strchr(f, ':'); q && !end; q = strchr(q + 1, ':'))
        if (kvm_sculpt_setting_find(q + 1, strcspn(q + 1, ":="))) end = q;
    snprintf(buf, size, "%.*s", (int)(end ? end - f : (long)strlen(f)), f);
    return buf;
}

/* Builds the jobs from --method and --budget/--ratio lists (target: --target-kl's search, with
 * `budgets` a placeholder); `flags` ("name=value:..." from the sculpt flags, may be "") go before
 * each sculpt-family method's own options, which override them, except the size (budget, ratio,
 * entries: refused in a method's options, the columns set it); a polykv strategy file of another
 * model than model_path's is refused (strategy_model_ok). Returns 0, 2 (bad option), 1. */
static int make_jobs(const char *methods, const char *budgets, int is_ratio, int target, const char *flags,
                     const kvm_model_config *c, const char *model_path, eval_job **jobs, int *n_jobs)
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
    eval_job *j = rc ? NULL : calloc((size_t)(nm * nb), sizeof *j);
    if (!rc && !j) rc = oom = 1;
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
            if (arg && (strstr(mv[a], "::") || mv[a][strlen(mv[a]) - 1] == ':')) { /* an option dropped unsaid */
                fprintf(stderr,
                        "kvmill " CMD ": --method '%s': an option is empty (a method's options are name=value "
                        "items joined by single ':')\n",
                        mv[a]);
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
            const char *own_opts = arg && !strcmp(e->m->name, "polykv") ? strchr(arg, ':') : arg; /* after FILE */
            const char *size = sculpt_family(e->m) ? kvm_sculpt_opts_find_size(own_opts, ":") : NULL;
            if (size) { /* it overrode the column's size (a --target-kl search probed one budget), or polykv ignored it
                         */
                fprintf(stderr,
                        "kvmill " CMD ": --method %s: option '%.*s' sizes the cache, which is %s's to set "
                        "(%s); remove it from the method and give the size there\n",
                        mv[a], (int)strcspn(size, ":"), size,
                        target     ? "--target-kl"
                        : is_ratio ? "--ratio"
                                   : "--budget",
                        target                          ? "it searches the budget per document"
                        : !strcmp(e->m->name, "polykv") ? "the strategy's per-layer budgets are rescaled to it"
                                                        : "one column per value");
                rc = 2;
                break;
            }
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
            e->has_arg = arg != NULL;
            snprintf(e->arg, sizeof e->arg, "%s", arg ? arg : "");
            int s = e->m->opts_new(arg, &e->budget, c, &e->opts);
            if (s) {
                fprintf(stderr, "kvmill " CMD ": --method %s: %s\n", mv[a], kvm_errmsg());
                rc = s == KVM_ENOMEM || s == KVM_EIO ? 1 : 2; /* said above, with the reason */
                break;
            }
            if (b == 0 && sculpt_family(e->m) && strcmp(e->m->name, "polykv")) /* polykv: its layers' methods vary */
                note_unused(mv[a], arg, e->opts);
            n++;
            if (!strcmp(e->m->name, "polykv")) rc = strategy_model_ok(e, &mi);
        }
    for (int x = 0; !rc && x < n; x++) /* an item twice ran twice: a column repeated */
        for (int y = 0; !rc && y < x; y++)
            if (!strcmp(j[x].spec, j[y].spec) && j[x].budget.tokens == j[y].budget.tokens &&
                j[x].budget.ratio == j[y].budget.ratio) {
                if (target)
                    fprintf(stderr, "kvmill " CMD ": --method %s is given twice (--method '%s'): name each once\n",
                            j[x].spec, methods);
                else
                    fprintf(stderr,
                            "kvmill " CMD ": --method %s at --%s %s is given twice (--method '%s', --%s '%s'): "
                            "name each once\n",
                            j[x].spec, bflag, bv[x % nb], methods, bflag, budgets);
                rc = 2;
            }
    free(ms);
    free(bs);
    if (oom) fprintf(stderr, "kvmill " CMD ": out of memory\n"); /* not for a file that could not be read */
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

/* What every (document, job) run shares. */
typedef struct eval_setup {
    const kvm_model *m;
    const kvm_kernels *k;
    const kvm_tokenizer *tok;
    int64_t N, T;           /* context, continuation (target mode: the search part; 2T are scored) */
    int both;               /* --phases both */
    kvm_proto_dtype dtype;  /* --dtype: the cache is scored as the store serves it in this dtype */
    int decode_steps;       /* --decode-steps */
    double target_kl;       /* --target-kl, or < 0 */
    int64_t target_step;    /* --target-step, tokens */
    const char *frame;      /* --chat: the chat frame's prefix before each document, or NULL */
} eval_setup;

/* kvm_eval_roundtrip_fn over the store's codec: user is the eval_setup. */
static int store_roundtrip(void *user, const kvm_kvcache *c, int64_t n_tokens, kvm_kvcache **out, int64_t *bytes)
{
    const eval_setup *es = user;
    return kvm_cachecodec_roundtrip(c, n_tokens, es->dtype, out, bytes);
}

static kvm_eval_opts eval_opts_of(eval_setup *es)
{
    return (kvm_eval_opts){.phases_both = es->both, .roundtrip = store_roundtrip, .user = es,
                           .decode_steps = es->decode_steps};
}

/* One (document, job) result: its table row, its share of the mean, its CSV row. */
static void job_done(eval_job *job, const char *doc, const kvm_eval_result *r, const char *dt, FILE *csv)
{
    print_row(job->spec, r);
    add_result(&job->sum, r);
    job->n++;
    if (csv) kvm_cli_csv_field(csv, doc); /* a document's file name may hold a comma or a quote */
    if (csv)
        fprintf(csv, ",%s,%.4f,%.6f,%.9g,%.9g,%.9g,%.6f,%.9g,%.9g,%.6f,%s,%lld,%.4f\n", job->spec,
                r->budget_tokens, r->ratio, r->kl_mean, r->kl_median, r->kl_p99, r->top1, r->ppl_full, r->ppl_compressed,
                r->seconds, dt, (long long)r->bytes_compressed, r->decode_ms);
}

static void print_means(eval_job *jobs, int n_jobs, int n_docs)
{
    printf("== mean over %d document%s\n", n_docs, kvm_plural(n_docs, "", "s"));
    print_header();
    for (int j = 0; j < n_jobs; j++) {
        scale_result(&jobs[j].sum, 1.0 / jobs[j].n);
        print_row(jobs[j].spec, &jobs[j].sum);
    }
}

static int run(eval_setup *es, const cmd_eval_docset *docs, eval_job *jobs, int n_jobs, FILE *csv)
{
    if (csv) fprintf(csv, KVM_EVAL_CSV_HEADER "\n");
    const char *dt = kvm_proto_dtype_name(es->dtype);
    kvm_eval_opts eo = eval_opts_of(es);
    for (int d = 0; d < docs->n; d++) {
        kvm_eval_doc *doc;
        int lrc = cmd_eval_docs_load(CMD, es->m, es->k, es->tok, es->frame, docs->paths[d], es->N, es->T, 0, 1, &doc);
        if (lrc) return lrc; /* 2: a document that does not open, as sculpt's --doc */
        printf("== %s (context %lld, continuation %lld, stored as %s%s)\n", docs->names[d], (long long)es->N,
               (long long)es->T, dt, es->frame ? ", chat framing" : "");
        print_header();
        for (int j = 0; j < n_jobs; j++) {
            kvm_eval_result r;
            if (kvm_eval_run_ex(doc, jobs[j].m, jobs[j].opts, &eo, &r)) {
                fprintf(stderr, "kvmill " CMD ": %s, %s: %s\n", docs->names[d], jobs[j].spec, kvm_errmsg());
                kvm_eval_doc_free(&doc);
                return 1;
            }
            job_done(&jobs[j], docs->names[d], &r, dt, csv);
        }
        kvm_eval_doc_free(&doc);
        fflush(stdout);
    }
    print_means(jobs, n_jobs, docs->n);
    return 0;
}

#ifdef KVM_WITH_CUDA
/* The eviction methods of `jobs` on cuda:dev (compress/eval/kvm_eval_cuda.h): the device's own
 * full-KV reference, prefill with the patterns' statistics, device selection and compaction,
 * the continuation; the same tables and CSV rows as run (dtype f32, bytes and decode_ms 0). */
static int run_device(eval_setup *es, const cmd_eval_docset *docs, eval_job *jobs, int n_jobs, FILE *csv, int dev)
{
    kvm_cuda_model *dm = NULL;
    if (kvm_model_cuda_new(es->m, dev, KVM_CUDA_F32, es->N + es->T, es->N, &dm)) {
        fprintf(stderr, "kvmill " CMD ": --device cuda:%d: %s\n", dev, kvm_errmsg());
        return 1;
    }
    if (csv) fprintf(csv, KVM_EVAL_CSV_HEADER "\n");
    int rc = 0;
    for (int d = 0; !rc && d < docs->n; d++) {
        int32_t *ids = NULL;
        int64_t n_ids = 0;
        kvm_eval_cuda_doc *doc = NULL;
        int erc = cmd_eval_docs_encode(CMD, es->tok, es->frame, docs->paths[d], es->N + es->T, &ids, &n_ids);
        if (erc) rc = erc;
        else if (n_ids < es->N + es->T) {
            fprintf(stderr, "kvmill " CMD ": %s: %lld tokens, fewer than context %lld + continuation %lld\n",
                    docs->paths[d], (long long)n_ids, (long long)es->N, (long long)es->T);
            rc = 1;
        } else if (kvm_eval_cuda_doc_new(dm, &es->m->cfg, ids, es->N, es->T, &doc)) {
            fprintf(stderr, "kvmill " CMD ": %s: cuda:%d: %s\n", docs->names[d], dev, kvm_errmsg());
            rc = 1;
        }
        free(ids);
        if (!rc) {
            printf("== %s (context %lld, continuation %lld, stored as f32%s, on cuda:%d)\n", docs->names[d],
                   (long long)es->N, (long long)es->T, es->frame ? ", chat framing" : "", dev);
            print_header();
        }
        for (int j = 0; !rc && j < n_jobs; j++) {
            kvm_eval_result r;
            kvm_evict_plan *plan = NULL;
            if (kvm_method_evict_plan(jobs[j].m, jobs[j].opts, es->N, &plan) || kvm_eval_cuda_evict(doc, plan, es->both, &r)) {
                fprintf(stderr, "kvmill " CMD ": %s, %s, cuda:%d: %s\n", docs->names[d], jobs[j].spec, dev, kvm_errmsg());
                rc = 1;
            } else
                job_done(&jobs[j], docs->names[d], &r, "f32", csv);
            kvm_evict_plan_free(&plan);
        }
        kvm_eval_cuda_doc_free(&doc);
        fflush(stdout);
    }
    kvm_cuda_model_free(&dm);
    if (!rc) print_means(jobs, n_jobs, docs->n);
    return rc;
}
#endif

/* Whether `kvmill eval --device cuda:N` runs these jobs on the device: only the eviction methods
 * (one pattern everywhere; prefill phase, and decode phase with --phases both) have a device
 * path; NULL when it does, else why not (for the message that says the run is on the CPU). */
static const char *device_refusal(const eval_setup *es, const eval_job *jobs, int n_jobs, int task, char *buf,
                                  size_t size)
{
#ifndef KVM_WITH_CUDA
    (void)es, (void)jobs, (void)n_jobs, (void)task, (void)buf, (void)size;
    return "this kvmill has no CUDA";
#else
    if (task) return "--task answers over a host cache";
    if (es->target_kl >= 0) return "--target-kl searches budgets over the host forward";
    if (es->dtype != KVM_PROTO_F32) return "--dtype scores the store's round trip of a host cache";
    for (int j = 0; j < n_jobs; j++) {
        kvm_evict_plan *plan = NULL;
        int rc = kvm_method_evict_plan(jobs[j].m, jobs[j].opts, es->N, &plan);
        kvm_evict_plan_free(&plan);
        if (rc) {
            snprintf(buf, size, "method %s needs the host forward (KV capture, hooks): only streaming, h2o, tova, "
                     "snapkv and pyramidkv run on the device", jobs[j].spec);
            return buf;
        }
    }
    return NULL;
#endif
}

/* ---- --target-kl: per document, the smallest budget whose KL on [N, N+T) is ≤ X ---- */

#define TARGET_CSV_HEADER \
    "doc,method,target_kl,context,budget_tokens,ratio,kl_search,kl_check,reached,probes,nonmonotone,dtype"

/* One (document, job) search: kvm_eval_kl_fn's user. */
typedef struct target_ctx {
    eval_setup *es;
    const eval_job *job;
    kvm_eval_doc *doc;
    int64_t T;                                     /* search part; the check part follows it */
    double check[KVM_EVAL_TARGET_MAX_PROBES];      /* KL on the check part at each probe */
    kvm_eval_result res[KVM_EVAL_TARGET_MAX_PROBES];
    int n;
} target_ctx;

static int target_kl_at(void *user, int64_t budget, double *kl)
{
    target_ctx *t = user;
    kvm_budget b = {.tokens = budget};
    void *o = NULL;
    int rc = t->job->m->opts_new(t->job->has_arg ? t->job->arg : NULL, &b, &t->es->m->cfg, &o);
    kvm_eval_opts eo = eval_opts_of(t->es);
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
static int target_load(eval_setup *es, const char *path, const char *name, kvm_eval_doc **doc, int64_t *n_ctx)
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
static int64_t target_lo(const eval_setup *es, const eval_job *job, int64_t step, int64_t N)
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

static int run_target(eval_setup *es, const cmd_eval_docset *docs, eval_job *jobs, int n_jobs, FILE *csv)
{
    const char *dt = kvm_proto_dtype_name(es->dtype);
    if (csv) fprintf(csv, TARGET_CSV_HEADER "\n");
    int64_t *chosen = calloc((size_t)docs->n * (size_t)n_jobs, sizeof *chosen);
    double *check_sum = calloc((size_t)n_jobs, sizeof *check_sum);
    int *met = calloc((size_t)n_jobs, sizeof *met), *nonmono = calloc((size_t)n_jobs, sizeof *nonmono), rc = 0;
    target_ctx *t = malloc(sizeof *t);
    if (!chosen || !check_sum || !met || !nonmono || !t) {
        fprintf(stderr, "kvmill " CMD ": out of memory\n");
        rc = 1;
    }
    for (int d = 0; !rc && d < docs->n; d++) {
        kvm_eval_doc *doc;
        int64_t N;
        if ((rc = target_load(es, docs->paths[d], docs->names[d], &doc, &N))) break;
        printf("== %s: target KL %g on tokens [%lld, %lld), check on [%lld, %lld), stored as %s\n", docs->names[d],
               es->target_kl, (long long)N, (long long)(N + es->T), (long long)(N + es->T),
               (long long)(N + 2 * es->T), dt);
        printf("%-28s %8s %7s %10s %10s %7s %6s %11s\n", "method", "budget", "ratio", "kl_search", "kl_check",
               "reached", "probes", "nonmonotone");
        for (int j = 0; !rc && j < n_jobs; j++) {
            *t = (target_ctx){.es = es, .job = &jobs[j], .doc = doc, .T = es->T};
            kvm_eval_target tr;
            int64_t step = es->target_step < N ? es->target_step : N;
            if (kvm_eval_target_budget(target_kl_at, t, target_lo(es, &jobs[j], step, N), N, step, es->target_kl,
                                       &tr)) {
                fprintf(stderr, "kvmill " CMD ": %s, %s: %s\n", docs->names[d], jobs[j].spec, kvm_errmsg());
                rc = 1;
                break;
            }
            double check = NAN;
            for (int i = 0; i < tr.n_probes; i++)
                if (tr.probe_budget[i] == tr.budget) check = t->check[i];
            chosen[(size_t)j * (size_t)docs->n + (size_t)d] = tr.budget;
            check_sum[j] += check;
            met[j] += check <= es->target_kl;
            nonmono[j] += tr.n_nonmonotone > 0;
            printf("%-28s %8lld %7.4f %10.6f %10.6f %7s %6d %11d\n", jobs[j].spec, (long long)tr.budget,
                   (double)tr.budget / (double)N, tr.kl, check, tr.reached ? "yes" : "no", tr.n_probes,
                   tr.n_nonmonotone);
            if (csv) kvm_cli_csv_field(csv, docs->names[d]);
            if (csv)
                fprintf(csv, ",%s,%.9g,%lld,%lld,%.6f,%.9g,%.9g,%d,%d,%d,%s\n", jobs[j].spec,
                        es->target_kl, (long long)N, (long long)tr.budget, (double)tr.budget / (double)N, tr.kl,
                        check, tr.reached, tr.n_probes, tr.n_nonmonotone, dt);
        }
        kvm_eval_doc_free(&doc);
        fflush(stdout);
    }
    if (!rc) {
        printf("== over %d document%s: chosen budgets (min / median / max), mean KL on the check part, documents "
               "whose check KL is within the target, documents where KL rose with the budget\n",
               docs->n, kvm_plural(docs->n, "", "s"));
        for (int j = 0; j < n_jobs; j++) {
            int64_t *b = chosen + (size_t)j * (size_t)docs->n;
            qsort(b, (size_t)docs->n, sizeof *b, cmp_i64);
            printf("%-28s budget %lld / %lld / %lld  kl_check %.6f  within %d/%d  nonmonotone %d/%d\n", jobs[j].spec,
                   (long long)b[0], (long long)b[docs->n / 2], (long long)b[docs->n - 1], check_sum[j] / docs->n,
                   met[j], docs->n, nonmono[j], docs->n);
        }
    }
    free(chosen);
    free(check_sum);
    free(met);
    free(nonmono);
    free(t);
    return rc;
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
        {"ratio", 1, "budget as a share r of the context, b = r*N, in (0, 1) (list allowed)", NULL},
        {"context", 1, "context tokens N, BOS included (default 384)", NULL},
        {"continuation", 1, "continuation tokens T (default 64)", NULL},
        {"phases", 1, "prefill (default): compress the context only; both: also each method's decode policy", NULL},
        {"csv", 1,
         "write one row per (document, method, budget) to this CSV file (doc: the file's name without .txt; "
         "documents sharing a name get the shortest path suffixes telling them apart, a/doc and b/doc)",
         NULL},
        {"device", 1,
         "cpu or cuda:N (refused at once where there is no such device): the eviction methods run "
         "wholly there (prefill, selection, --phases both's decode policy, continuation, scoring); other "
         "methods, --task, --target-kl and --dtype run on the CPU, with the sculpt-family solver there "
         "(default cpu)",
         NULL},
        {"threads", 1,
         "compute threads: the CPU kernels' (default: every core) and each sculpt-family method's solver "
         "threads (default 1)",
         NULL},
        {"dtype", 1,
         "f32 (default), f16 or bf16: score each cache as the store serves it in this [store] dtype "
         "(round trip through the store's encoding; bytes = its stored bytes)",
         NULL},
        {"decode-steps", 1,
         "decode steps timed over each compressed cache for decode_ms (default 8; 0: none; at most "
         "the continuation)",
         NULL},
        {"target-kl", 1,
         "per document, the smallest budget whose mean KL on tokens [N, N+T) is <= this (nats), by "
         "bisection; tokens [N+T, N+2T) are the check (replaces --budget/--ratio)",
         NULL},
        {"target-step", 1, "--target-kl: budgets searched are multiples of this (tokens, default 16)", NULL},
        {"task", 1,
         "passkey, recall or multikey: task accuracy instead of KL; the context (--context tokens at most) "
         "is a document with a fact inserted at depth 0.1..0.9, the question is asked over the cache",
         NULL},
        {"cases", 1, "--task: cases (default 9: one document at the nine depths; case i uses document (i/9) mod D)",
         NULL},
        {"first-case", 1, "--task: index of the first case (default 0), so a long run can go in pieces", NULL},
        {"answer-tokens", 1, "--task: greedy tokens per answer at most (default 16)", NULL},
        {"chat", 0,
         "chat framing, as [model] chat = true: the cached context opens the user's turn (template, then "
         "the document); --task: question, end of turn and assistant marker are appended at ask time",
         NULL},
        {"weight-dtype", 1, KVM_CLI_WEIGHT_DTYPE_HELP, NULL},
        {"system", 1, "system message for --chat (default: the template's own default, if it has one)", NULL},
    };
    int n_fixed = 0, n_set;
    while (opts[n_fixed].name) n_fixed++; /* the entries above; counted, so none is ever cut off */
    int n_opts = n_fixed;
    const kvm_sculpt_setting *set = kvm_sculpt_settings(&n_set);
    for (int i = 0; i < n_set; i++) /* every sculpt setting, for sculpt-family methods */
        if (eval_flag(&set[i])) {
            if (n_opts >= MAX_OPTS - 1) {
                fprintf(stderr, "kvmill " CMD ": internal: more than %d options (raise MAX_OPTS)\n", MAX_OPTS - 1);
                return 1;
            }
            opts[n_opts++] = (kvm_cli_opt){set[i].flag, !set[i].is_flag, set[i].help, NULL};
        }
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
    const char *target = kvm_cli_get(opts, "target-kl"), *task = kvm_cli_get(opts, "task");
    cmd_eval_task_args ta = {.cases = 9, .answer_tokens = 16, .chat = kvm_cli_get(opts, "chat") != NULL,
                             .system = kvm_cli_get(opts, "system")};
    if (task) {
        const char *cs = kvm_cli_get(opts, "cases"), *at = kvm_cli_get(opts, "answer-tokens"),
                   *fc = kvm_cli_get(opts, "first-case");
        int64_t x;
        if (kvm_task_parse(task, &ta.kind)) {
            fprintf(stderr, "kvmill " CMD ": --task: %s\n", kvm_errmsg());
            return 2;
        }
        if (target) {
            fprintf(stderr, "kvmill " CMD ": --task and --target-kl do not combine\n");
            return 2;
        }
        if (cs) {
            if (kvm_cli_int(CMD, "cases", cs, 1, 1 << 20, &x)) return 2;
            ta.cases = (int)x;
        }
        if (fc) {
            if (kvm_cli_int(CMD, "first-case", fc, 0, 1 << 20, &x)) return 2;
            ta.first_case = (int)x;
        }
        if (at) {
            if (kvm_cli_int(CMD, "answer-tokens", at, 1, 4096, &x)) return 2;
            ta.answer_tokens = (int)x;
        }
    } else if (kvm_cli_get(opts, "cases") || kvm_cli_get(opts, "answer-tokens") || kvm_cli_get(opts, "first-case")) {
        fprintf(stderr, "kvmill " CMD ": --cases, --first-case and --answer-tokens need --task\n");
        return 2;
    }
    /* settings of the KL runs that --task (answers after the context) or --target-kl (its probes are
     * not timed) do not use: said, not ignored unsaid (a base command line may carry them, so not refused) */
    const char *unused[] = {task ? "continuation" : NULL, task ? "phases" : NULL,
                            task || target ? "decode-steps" : NULL};
    for (int i = 0; i < 3; i++)
        if (unused[i] && kvm_cli_get(opts, unused[i]))
            fprintf(stderr, "kvmill " CMD ": --%s does not apply with %s (%s): ignored\n", unused[i],
                    task ? "--task" : "--target-kl",
                    task ? "a case's context is --context, its answer --answer-tokens greedy tokens over the cache"
                         : "the search's probes are not timed");
    if (ta.system && !ta.chat) {
        fprintf(stderr, "kvmill " CMD ": --system needs --chat\n");
        return 2;
    }
    if (target ? budget || ratio : !!budget == !!ratio) {
        fprintf(stderr, "kvmill " CMD ": %s\n", target ? "--target-kl chooses the budget: give no --budget or --ratio"
                                                        : "give exactly one of --budget and --ratio");
        return 2;
    }
    eval_setup es = {.both = 0, .dtype = KVM_PROTO_F32, .decode_steps = 8, .target_kl = -1, .target_step = 16};
    const char *dtype = kvm_cli_get(opts, "dtype"), *steps = kvm_cli_get(opts, "decode-steps"),
               *tstep = kvm_cli_get(opts, "target-step");
    if (dtype && (kvm_proto_dtype_parse(dtype, strlen(dtype), &es.dtype) || es.dtype == KVM_PROTO_I32)) {
        fprintf(stderr, "kvmill " CMD ": --dtype: '%s' is not f32, f16 or bf16\n", dtype);
        return 2;
    }
    int64_t n_steps;
    if (steps) {
        if (kvm_cli_int(CMD, "decode-steps", steps, 0, 1 << 20, &n_steps)) return 2;
        es.decode_steps = (int)n_steps;
    }
    if (target && kvm_cli_float(CMD, "target-kl", target, 0.0, 1e6, &es.target_kl)) return 2;
    if (target && !(es.target_kl > 0)) { /* [compress] target_kl = 0 means off; here the search would end at full KV */
        fprintf(stderr, "kvmill " CMD ": --target-kl %s: the target must be above 0 nats (only full KV has KL 0)\n", target);
        return 2;
    }
    if (tstep && !target) {
        fprintf(stderr, "kvmill " CMD ": --target-step needs --target-kl\n");
        return 2;
    }
    if (tstep && kvm_cli_int(CMD, "target-step", tstep, 1, 1 << 20, &es.target_step)) return 2;
    int both = 0;
    if (phases && strcmp(phases, "both") == 0)
        both = 1;
    else if (phases && strcmp(phases, "prefill") != 0) {
        fprintf(stderr, "kvmill " CMD ": --phases: '%s' is not prefill or both\n", phases);
        return 2;
    }
    int64_t N, T;
    if (cmd_eval_lengths(CMD, kvm_cli_get(opts, "context"), kvm_cli_get(opts, "continuation"), &N, &T)) return 2;
    /* --device is the solver's, checked here before any prefill (the sculpt table's `device`, the
     * selection `kvmill sculpt` makes); the capture, hooks and eviction need the host forward */
    const char *dev = kvm_cli_get(opts, "device");
    kvm_sculpt_opts dev_o = kvm_sculpt_opts_default();
    const kvm_kernels *dev_k;
    if (dev && kvm_kernels_select(dev, &dev_k)) { /* the device itself: not the solver's message (an h2o run has none) */
        fprintf(stderr, "kvmill " CMD ": --device %s\n", kvm_errmsg());
        return 2;
    }
    if (dev && kvm_sculpt_opts_set(&dev_o, "device", dev)) {
        fprintf(stderr, "kvmill " CMD ": %s\n", kvm_errmsg());
        return 2;
    }
    const kvm_kernels *k;
    if (kvm_cli_setup_device(CMD, "cpu", kvm_cli_get(opts, "threads"), &k)) return 2;
    cmd_eval_docset docs;
    int rc = cmd_eval_docs_list(CMD, docs_s, &docs);
    if (rc) return rc;
    kvm_model *m = NULL;
    kvm_tokenizer *tok = NULL;
    eval_job *jobs = NULL;
    int n_jobs = 0;
    kvm_cli_staged out = {0}; /* --csv, renamed into place only when every document is done */
    FILE *csv = NULL;
    rc = kvm_cli_open_model(CMD, model_path, kvm_cli_get(opts, "tokenizer"), 1, &m, &tok);
    if (!rc && kvm_cli_weight_dtype(CMD, kvm_cli_get(opts, "weight-dtype"), m)) rc = 2;
    char *chat_open = NULL, *chat_close = NULL; /* --chat over KL: documents framed as run frames them */
    if (!rc && ta.chat && kvm_chat_frame(tok, ta.system, &chat_open, &chat_close)) { /* --task frames its own */
        fprintf(stderr, "kvmill " CMD ": --chat: %s\n", kvm_errmsg());
        rc = 2; /* a setting the model cannot take, as run and serve refuse [model] chat */
    }
    int64_t n_frame = 0;
    if (!rc && chat_open && !kvm_chatcfg_frame_tokens(tok, chat_open, &n_frame) && n_frame >= N) {
        fprintf(stderr, "kvmill " CMD ": --chat: --context %lld leaves no token for the document: the chat frame (the "
                        "system turn and the user turn's opening) takes %lld tokens\n", (long long)N, (long long)n_frame);
        rc = 2;
    }
    es.frame = task ? NULL : chat_open;
    int64_t T_run = target ? 2 * T : T; /* the target search scores a check part after the search part */
    if (!rc && task && N + ta.answer_tokens > m->cfg.seq_len) { /* --task asks and answers after the context */
        fprintf(stderr, "kvmill " CMD ": --task: context %lld + --answer-tokens %d exceeds the model's window of %d tokens\n",
                (long long)N, ta.answer_tokens, m->cfg.seq_len);
        rc = 2;
    }
    if (!rc && !task && N + T_run > m->cfg.seq_len) {
        fprintf(stderr, "kvmill " CMD ": context %lld + continuation %lld%s exceeds the model's window of %d tokens\n",
                (long long)N, (long long)T_run, target ? " (2 x --continuation with --target-kl)" : "",
                m->cfg.seq_len);
        rc = 2;
    }
    if (!rc && !task && es.decode_steps > T) {
        fprintf(stderr, "kvmill " CMD ": --decode-steps %d: at most the continuation (%lld)\n", es.decode_steps,
                (long long)T);
        rc = 2;
    }
    char n_buf[32];
    snprintf(n_buf, sizeof n_buf, "%lld", (long long)N); /* placeholder budget; each probe makes its own options */
    char flags[2048] = "";
    const char *sculpt_flag = NULL; /* the first sculpt option given as a flag (not --threads, --device) */
    size_t at = 0;
    for (int i = 0; i < n_set; i++) { /* table order; --threads and --device too */
        const int own = !strcmp(set[i].name, "threads") || !strcmp(set[i].name, "device");
        const char *v = eval_flag(&set[i]) || own ? kvm_cli_get(opts, set[i].flag) : NULL;
        if (v && !own && !sculpt_flag) sculpt_flag = set[i].flag;
        if (!rc && v && strpbrk(v, strcmp(set[i].name, "device") ? ":,=" : ",=")) { /* cuda:N keeps its ':' */
            fprintf(stderr, "kvmill " CMD ": --%s: '%s' may not contain ':', ',' or '='\n", set[i].flag, v);
            rc = 2;
        }
        if (v && at < sizeof flags)
            at += (size_t)snprintf(flags + at, sizeof flags - at, "%s%s=%s", at ? ":" : "", set[i].name, v);
    }
    if (!rc)
        rc = make_jobs(method,
                       target   ? n_buf
                       : budget ? budget
                                : ratio,
                       !target && !budget, target != NULL, flags, &m->cfg, model_path, &jobs, &n_jobs);
    for (int j = 0; !rc && !target && j < n_jobs; j++) /* as run refuses [compress] budget >= context, ratio = 1 */
        if (strcmp(jobs[j].m->name, "full") && (budget ? jobs[j].budget.tokens >= N : jobs[j].budget.ratio >= 1)) {
            if (budget)
                fprintf(stderr, "kvmill " CMD ": --budget %lld is not below --context %lld: the \"compressed\" cache "
                                "would be as large as the full one (the budget would be clamped to the context); lower "
                                "--budget (or use --method full)\n", (long long)jobs[j].budget.tokens, (long long)N);
            else
                fprintf(stderr, "kvmill " CMD ": --ratio 1 keeps every entry: the \"compressed\" cache would be as "
                                "large as the full one; lower --ratio (or use --method full)\n");
            rc = 2;
        }
    for (int j = 0; !rc && !target && j < n_jobs; j++) {
        const int distils = sculpt_family(jobs[j].m) && strcmp(jobs[j].m->name, "polykv"); /* opts: kvm_sculpt_opts */
        const int64_t retain = distils ? ((const kvm_sculpt_opts *)jobs[j].opts)->retain_tokens : 0;
        if (distils && retain >= N) { /* each document failed after its prefill, exit 1 (sculpt refuses it: 2) */
            fprintf(stderr,
                    "kvmill " CMD ": --method %s: the retain zone of %lld tokens is not below --context %lld: "
                    "nothing is left to compress; lower --retain or raise --context\n",
                    jobs[j].spec, (long long)retain, (long long)N);
            rc = 2;
        } else if (!distils && !budget && strcmp(jobs[j].m->name, "full") &&
                   kvm_budget_resolve(&jobs[j].budget, N) >= N) { /* r·N rounded up to a whole entry */
            fprintf(stderr,
                    "kvmill " CMD ": --ratio %g of --context %lld keeps %lld entr%s, the whole context: the "
                    "\"compressed\" cache would be as large as the full one; lower --ratio or raise --context\n",
                    jobs[j].budget.ratio, (long long)N, (long long)kvm_budget_resolve(&jobs[j].budget, N),
                    kvm_plural(kvm_budget_resolve(&jobs[j].budget, N), "y", "ies"));
            rc = 2;
        }
    }
    int any_sculpt = 0;
    for (int j = 0; j < n_jobs; j++) any_sculpt |= sculpt_family(jobs[j].m);
    if (!rc && sculpt_flag && !any_sculpt) { /* it would apply to none: the run would ignore it unsaid */
        fprintf(stderr, "kvmill " CMD ": --%s is a sculpt option, and --method %s has no method it applies to "
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
    if (!rc && kvm_cli_check_out(CMD, "csv", csv_path)) rc = 2;
    if (!rc && kvm_cli_check_out_model(CMD, "csv", csv_path, model_path, kvm_cli_get(opts, "tokenizer"), "--docs",
                                       docs_s))
        rc = 2; /* fopen "w" emptied it */
    for (int j = 0; !rc && j < n_jobs; j++) /* the CSV was renamed over a calibration's strategy file */
        if (!strcmp(jobs[j].m->name, "polykv")) {
            char file[sizeof jobs[j].spec];
            const char *in_flag = "--method polykv", *in = strategy_file(jobs[j].spec, file, sizeof file);
            if (kvm_cli_check_out_inputs(CMD, "csv", csv_path, &in_flag, &in, 1)) rc = 2;
        }
    es.m = m;   /* target_lo makes each method's options for the model */
    for (int j = 0; !rc && target && j < n_jobs; j++) { /* as [compress] target_step refuses it (kvm_jobcfg_check) */
        const int64_t step = es.target_step < N ? es.target_step : N, lo = target_lo(&es, &jobs[j], step, N);
        const int retains = sculpt_family(jobs[j].m) && strcmp(jobs[j].m->name, "polykv"); /* a retain zone */
        if (lo >= N) {
            fprintf(stderr,
                    "kvmill " CMD ": --target-kl: method %s: no budget below --context %lld is searched "
                    "(multiples of --target-step %lld%s): the search would keep the whole context; lower "
                    "--target-step%s\n",
                    jobs[j].spec, (long long)N, (long long)es.target_step, retains ? " above the retain zone" : "",
                    retains ? " or --retain" : "");
            rc = 2;
        }
    }
    if (!rc && !task) { /* every document long enough, before the first prefill and before --csv is emptied */
        char need[160];
        if (target)
            snprintf(need, sizeof need,
                     "2 x continuation %lld + 1 (--target-kl's search and check parts and a context "
                     "token; --continuation)",
                     (long long)T);
        else
            snprintf(need, sizeof need, "context %lld + continuation %lld (--context, --continuation)", (long long)N,
                     (long long)T);
        rc = cmd_eval_docs_check(CMD, tok, es.frame, &docs, target ? N + 2 * T : N + T, target ? 2 * T + 1 : N + T,
                                 need);
    }
    /* each distinct document once, before any prefill: two documents are one when the ids eval
     * reads from them are (KL: the framed first N + T; --target-kl: N + 2T; --task: the whole text
     * its cases are made from, as its cases cycle over the distinct documents) */
    if (!rc)
        rc = cmd_eval_docs_dedup(CMD, tok, es.frame, &docs,
                                 task     ? 0
                                 : target ? N + 2 * T
                                          : N + T,
                                 "evaluating it once");
    if (!rc && csv_path && !(rc = kvm_cli_staged_open(CMD, "csv", csv_path, &out))) csv = out.f;
    es.m = m;
    es.k = k;
    es.tok = tok;
    es.N = N;
    es.T = T;
    es.both = both;
    int on_device = 0;
    if (!rc && dev_o.cuda) { /* what runs where, said before any document */
        char why_buf[256];
        const char *why = device_refusal(&es, jobs, n_jobs, task != NULL, why_buf, sizeof why_buf);
        on_device = why == NULL;
        if (on_device)
            fprintf(stderr, "kvmill " CMD ": prefill, eviction (selection and compaction%s), continuation and scoring on "
                            "cuda:%d, against the device's own full KV (decode_ms is not measured there: 0)\n",
                    es.both ? ", decode-phase policy" : "", dev_o.cuda_device);
        else
            fprintf(stderr, "kvmill " CMD ": prefill, compression and scoring run on the CPU (%s); the sculpt-family "
                            "solver on cuda:%d\n", why, dev_o.cuda_device);
    }
    if (!rc && task) {
        cmd_eval_task_job *tj = calloc((size_t)n_jobs + 1, sizeof *tj);
        if (!tj) rc = 1;
        for (int i = 0; tj && i < n_jobs; i++)
            tj[i] = (cmd_eval_task_job){jobs[i].m, jobs[i].opts, jobs[i].spec, jobs[i].budget};
        ta.m = m;
        ta.k = k;
        ta.tok = tok;
        ta.n_ctx = N;
        ta.roundtrip = store_roundtrip;
        ta.user = &es;
        ta.csv = csv;
        if (tj) rc = cmd_eval_task_run(&ta, &docs, tj, n_jobs);
        free(tj);
    } else if (!rc && on_device) {
#ifdef KVM_WITH_CUDA
        rc = run_device(&es, &docs, jobs, n_jobs, csv, dev_o.cuda_device);
#endif
    } else if (!rc)
        rc = target ? run_target(&es, &docs, jobs, n_jobs, csv) : run(&es, &docs, jobs, n_jobs, csv);
    if (kvm_cli_staged_close(CMD, "csv", &out, rc == 0)) rc = 1;
    free_jobs(jobs, n_jobs);
    free(chat_open);
    free(chat_close);
    cmd_eval_docs_free(&docs);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return rc;
}
