/* cmd_eval_run.c: `kvmill eval` at fixed budgets: each document against every (method, budget)
 * job, on the host or (eviction methods) on a CUDA device: a table per document, the mean, and
 * an optional CSV. */
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "compress/eval/kvm_eval_cuda.h"
#ifdef KVM_WITH_CUDA
#include "model/kvm_forward_cuda.h"
#endif
#include "orchestrator/cmd_eval_int.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_cachecodec.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CMD "eval"

static void print_header(void)
{
    printf("%-28s %8s %7s %10s %10s %10s %6s %9s %9s %8s %10s %9s\n", "method", "budget", "ratio", "kl_mean",
           "kl_median", "kl_p99", "top1", "ppl_full", "ppl_comp", "seconds", "bytes", "decode_ms");
}

/* x, a NaN printed as "nan" whatever its sign bit ("-nan" from a negated NaN). */
static double plain_nan(double x) { return isnan(x) ? NAN : x; }

/* r with every NaN field plain (plain_nan), for the table and the CSV. */
static kvm_eval_result printable(const kvm_eval_result *in)
{
    kvm_eval_result r = *in;
    r.kl_mean = plain_nan(r.kl_mean), r.kl_median = plain_nan(r.kl_median), r.kl_p99 = plain_nan(r.kl_p99);
    r.top1 = plain_nan(r.top1), r.ppl_full = plain_nan(r.ppl_full), r.ppl_compressed = plain_nan(r.ppl_compressed);
    return r;
}

/* 1 when a row's KL measures something: finite and within [0, 1e6] nats, the range `kvmill run`'s
 * [eval] counts (a KL of 1e36 comes from logits no softmax should see). */
static int kl_measures(double kl) { return isfinite(kl) && kl >= 0 && kl <= 1e6; }

static void print_row(const char *spec, const kvm_eval_result *in)
{
    const kvm_eval_result pr = printable(in), *r = &pr;
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

/* kvm_eval_roundtrip_fn over the store's codec: user is the cmd_eval_setup. */
int cmd_eval__store_roundtrip(void *user, const kvm_kvcache *c, int64_t n_tokens, kvm_kvcache **out, int64_t *bytes)
{
    const cmd_eval_setup *es = user;
    return kvm_cachecodec_roundtrip(c, n_tokens, es->dtype, out, bytes);
}

kvm_eval_opts cmd_eval__opts_of(cmd_eval_setup *es)
{
    return (kvm_eval_opts){
        .phases_both = es->both, .roundtrip = cmd_eval__store_roundtrip, .user = es, .decode_steps = es->decode_steps};
}

/* One (document, job) result: its table row, its share of the mean, its CSV row. Returns 1 (after a
 * note naming the document) when its KL is not a number: non-finite logits measure nothing. */
static int job_done(cmd_eval_job *job, const char *doc, const kvm_eval_result *in, const char *dt, FILE *csv)
{
    print_row(job->spec, in);
    const kvm_eval_result pr = printable(in), *r = &pr;
    if (kl_measures(r->kl_mean)) { /* a failed row stays out of the means (its NaN made the column NaN) */
        add_result(&job->sum, r);
        job->n++;
    }
    if (csv) kvm_cli_csv_field(csv, doc); /* a document's file name may hold a comma or a quote */
    if (csv)
        fprintf(csv, ",%s,%.4f,%.6f,%.9g,%.9g,%.9g,%.6f,%.9g,%.9g,%.6f,%s,%lld,%.4f\n", job->spec, r->budget_tokens,
                r->ratio, r->kl_mean, r->kl_median, r->kl_p99, r->top1, r->ppl_full, r->ppl_compressed, r->seconds, dt,
                (long long)r->bytes_compressed, r->decode_ms);
    if (kl_measures(r->kl_mean)) return 0;
    fprintf(stderr,
            "kvmill " CMD ": %s, %s: KL is %g: %s (ppl_full %g), so this row measures nothing (the "
            "document counts as failed, and stays out of the means)\n",
            doc, job->spec, r->kl_mean,
            isfinite(r->kl_mean)    ? "beyond any softmax's (the logits are extreme: over 1e6 nats)"
            : isfinite(r->ppl_full) ? "the logits over the compressed cache are not finite"
                                    : "the model's logits are not finite",
            r->ppl_full);
    return 1;
}

static void print_means(cmd_eval_job *jobs, int n_jobs, int n_docs)
{
    int all = 1;
    for (int j = 0; j < n_jobs; j++)
        all &= jobs[j].n == n_docs;
    if (all)
        printf("== mean over %d document%s\n", n_docs, kvm_plural(n_docs, "", "s"));
    else /* rows that measured nothing stay out: the notes on stderr say how many each mean holds */
        printf("== mean over the documents each method measured (of %d)\n", n_docs);
    print_header();
    for (int j = 0; j < n_jobs; j++) {
        scale_result(&jobs[j].sum, jobs[j].n ? 1.0 / jobs[j].n : NAN);
        print_row(jobs[j].spec, &jobs[j].sum);
        if (jobs[j].n < n_docs) /* rows that measured nothing (KL not finite) stay out */
            fprintf(stderr, "kvmill " CMD ": %s: its mean is over %d of the %d documents (the others failed)\n",
                    jobs[j].spec, jobs[j].n, n_docs);
    }
}

int cmd_eval__run(cmd_eval_setup *es, const cmd_eval_docset *docs, cmd_eval_job *jobs, int n_jobs, FILE *csv)
{
    if (csv) fprintf(csv, KVM_EVAL_CSV_HEADER "\n");
    const char *dt = kvm_proto_dtype_name(es->dtype);
    kvm_eval_opts eo = cmd_eval__opts_of(es);
    int failed = 0;
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
            failed |= job_done(&jobs[j], docs->names[d], &r, dt, csv);
        }
        kvm_eval_doc_free(&doc);
        kvm_cli_flush_stdout(); /* a failure's errno kept for main's message */
    }
    print_means(jobs, n_jobs, docs->n);
    return failed;
}

#ifdef KVM_WITH_CUDA
/* The eviction methods of `jobs` on cuda:dev (compress/eval/kvm_eval_cuda.h): the device's own
 * full-KV reference, prefill with the patterns' statistics, device selection and compaction,
 * the continuation; the same tables and CSV rows as run (dtype f32, bytes and decode_ms 0). */
int cmd_eval__run_device(cmd_eval_setup *es, const cmd_eval_docset *docs, cmd_eval_job *jobs, int n_jobs, FILE *csv,
                         int dev)
{
    kvm_cuda_model *dm = NULL;
    if (kvm_model_cuda_new(es->m, dev, KVM_CUDA_F32, es->N + es->T, es->N, &dm)) {
        fprintf(stderr, "kvmill " CMD ": --device cuda:%d: %s\n", dev, kvm_errmsg());
        return 1;
    }
    if (csv) fprintf(csv, KVM_EVAL_CSV_HEADER "\n");
    int rc = 0, failed = 0;
    for (int d = 0; !rc && d < docs->n; d++) {
        int32_t *ids = NULL;
        int64_t n_ids = 0;
        kvm_eval_cuda_doc *doc = NULL;
        int erc = cmd_eval_docs_encode(CMD, es->tok, es->frame, docs->paths[d], es->N + es->T, &ids, &n_ids);
        if (erc)
            rc = erc;
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
            if (kvm_method_evict_plan(jobs[j].m, jobs[j].opts, es->N, &plan) ||
                kvm_eval_cuda_evict(doc, plan, es->both, &r)) {
                fprintf(stderr, "kvmill " CMD ": %s, %s, cuda:%d: %s\n", docs->names[d], jobs[j].spec, dev,
                        kvm_errmsg());
                rc = 1;
            } else
                failed |= job_done(&jobs[j], docs->names[d], &r, "f32", csv);
            kvm_evict_plan_free(&plan);
        }
        kvm_eval_cuda_doc_free(&doc);
        kvm_cli_flush_stdout(); /* a failure's errno kept for main's message */
    }
    kvm_cuda_model_free(&dm);
    if (!rc) print_means(jobs, n_jobs, docs->n);
    return rc ? rc : failed;
}
#endif

/* Whether `kvmill eval --device cuda:N` runs these jobs on the device: only the eviction methods
 * (one pattern everywhere; prefill phase, and decode phase with --phases both) have a device
 * path; NULL when it does, else why not (for the message that says the run is on the CPU). */
const char *cmd_eval__device_refusal(const cmd_eval_setup *es, const cmd_eval_job *jobs, int n_jobs, int task,
                                     char *buf, size_t size)
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
            snprintf(buf, size,
                     "method %s needs the host forward (KV capture, hooks): only streaming, h2o, tova, "
                     "snapkv and pyramidkv run on the device",
                     jobs[j].spec);
            return buf;
        }
    }
    return NULL;
#endif
}
