/* cmd_eval_int.h: what the files of `kvmill eval` share: the (method, budget) jobs
 * (cmd_eval_jobs.c), the KL runs over them (cmd_eval_run.c) and the --target-kl searches
 * (cmd_eval_target.c), driven by the command in cmd_eval.c. Not for other commands. */
#ifndef CMD_EVAL_INT_H
#define CMD_EVAL_INT_H

#include "compress/eval/kvm_eval.h"
#include "model/kvm_tokenizer.h"
#include "orchestrator/kvm_cli_eval.h"
#include "proto/kvm_dtype.h"

#include <stdint.h>
#include <stdio.h>

/* One (method, budget) column of the run. */
typedef struct cmd_eval_job {
    const kvm_method *m;
    char spec[6144];   /* "h2o", "polykv:FILE" as given (a FILE up to PATH_MAX, then options) */
    kvm_budget budget; /* as requested */
    char item[256];    /* the --budget or --ratio item as given, for messages */
    void *opts;        /* from m->opts_new */
    char arg[8192];    /* the options opts was made from (flags and the method's own; polykv: FILE first) */
    int has_arg;       /* 0: opts_new got NULL */
    kvm_eval_result sum;
    int n;
} cmd_eval_job;

/* What every (document, job) run shares. */
typedef struct cmd_eval_setup {
    const kvm_model *m;
    const kvm_kernels *k;
    const kvm_tokenizer *tok;
    int64_t N, T;          /* context, continuation (target mode: the search part; 2T are scored) */
    int both;              /* --phases both */
    kvm_proto_dtype dtype; /* --dtype: the cache is scored as the store serves it in this dtype */
    int decode_steps;      /* --decode-steps (default min(8, continuation)) */
    double target_kl;      /* --target-kl, or < 0 */
    int64_t target_step;   /* --target-step, tokens */
    const char *frame;     /* --chat: the chat frame's prefix before each document, or NULL */
} cmd_eval_setup;

/* ---- jobs (cmd_eval_jobs.c) ---- */

/* 1 for the methods the sculpt flags apply to: sculpt, selectfit, joint-fixed, am, kvzip (ARG =
 * sculpt options) and polykv (its sculpt layers; options after the file). */
int cmd_eval__sculpt_family(const kvm_method *m);

/* Builds the jobs from --method and --budget/--ratio lists (target: --target-kl's search, with
 * `budgets` a placeholder); `flags` ("name=value:..." from the sculpt flags, may be "") go before
 * each sculpt-family method's own options, which override them, except the size (budget, ratio,
 * entries: refused in a method's options, the columns set it); a polykv strategy file of another
 * model than model_path's is refused. *jobs (free with cmd_eval__free_jobs, also on failure) holds
 * *n_jobs made ones. Returns 0, 2 (bad option), 1 (out of memory, a file that could not be read)
 * after printing "kvmill eval: ...". */
int cmd_eval__make_jobs(const char *methods, const char *budgets, int is_ratio, int target, const char *flags,
                        const kvm_model_config *c, const char *model_path, cmd_eval_job **jobs, int *n_jobs);

/* Frees the n jobs' options and the array j (may be NULL). */
void cmd_eval__free_jobs(cmd_eval_job *j, int n);

/* Refuses, before any document, jobs that cannot be what the command line asks for at context N:
 * a budget or ratio that keeps the whole context (is_budget: the columns are --budget), a retain
 * zone not below N, two jobs of the same method, options and entries (task: --task, whose cases
 * may be shorter than N, compares ratios as given), a sculpt flag (sculpt_flag, or NULL) that no
 * method of --method `method` reads, and method full under --target-kl (target). Returns 0, or 2
 * after printing why. */
int cmd_eval__check_jobs(const cmd_eval_job *jobs, int n_jobs, int target, int is_budget, int task, int64_t N,
                         const char *sculpt_flag, const char *method);

/* Refuses, before any document, fixed-budget jobs that keep the whole of a context of N tokens:
 * a --budget (is_budget) not below N, --ratio 1, a ratio whose entries come to N (the sculpt
 * family's: round(r·(N − m)) distilled beside the retain zone m), a retain zone not below N.
 * ctx names that context in the message ("--context 64"), raise says how to grow it ("raise
 * --context"). Returns 0, or 2 after printing why. */
int cmd_eval__check_sizes(const cmd_eval_job *jobs, int n_jobs, int is_budget, int64_t N, const char *ctx,
                          const char *raise);

/* Refuses, before any prefill, a job whose solver (kvm_method_solver_opts) draws queries from
 * query_source repeat, which prefills the repeat prompt (n_prompt tokens; 1 when 0) and the
 * context again after a context of N tokens: 2N + P positions, more than the model's window.
 * ctx names N ("--context 300"), lower how to shrink it. Returns 0, or 2 after printing why. */
int cmd_eval__check_repeat(const cmd_eval_job *jobs, int n_jobs, int64_t N, int64_t n_prompt, int window,
                           const char *ctx, const char *lower);

/* The strategy FILE of a "polykv:FILE[:OPTS]" method spec into buf: up to the first ':' that
 * starts a sculpt option (as cmd_eval__make_jobs splits it), so a path holding ':' stays whole. */
const char *cmd_eval__strategy_file(const char *spec, char *buf, size_t size);

/* ---- KL runs at fixed budgets (cmd_eval_run.c) ---- */

/* kvm_eval_roundtrip_fn over the store's codec: user is the cmd_eval_setup. */
int cmd_eval__store_roundtrip(void *user, const kvm_kvcache *c, int64_t n_tokens, kvm_kvcache **out, int64_t *bytes);

/* The kvm_eval options of es's runs (the store round trip with es as its user: es must outlive them). */
kvm_eval_opts cmd_eval__opts_of(cmd_eval_setup *es);

/* Every document against every job on the host: a table per document, the means, and a CSV row
 * per (document, job) when csv is not NULL. Returns 0, cmd_eval_docs_load's status, or 1 after
 * printing "kvmill eval: DOC, METHOD: ...". */
int cmd_eval__run(cmd_eval_setup *es, const cmd_eval_docset *docs, cmd_eval_job *jobs, int n_jobs, FILE *csv);

/* The eviction methods of `jobs` on cuda:dev (compress/eval/kvm_eval_cuda.h): the device's own
 * full-KV reference, prefill with the patterns' statistics, device selection and compaction,
 * the continuation; the same tables and CSV rows as cmd_eval__run (dtype f32, bytes and
 * decode_ms 0). Built with CUDA only. Returns 0, or 1 (2: a document that does not open) after
 * printing why. */
int cmd_eval__run_device(cmd_eval_setup *es, const cmd_eval_docset *docs, cmd_eval_job *jobs, int n_jobs, FILE *csv,
                         int dev);

/* Whether `kvmill eval --device cuda:N` runs these jobs on the device: only the eviction methods
 * (one pattern everywhere; prefill phase, and decode phase with --phases both) have a device
 * path; NULL when it does, else why not (a constant, or buf: for the message that says the run
 * is on the CPU). */
const char *cmd_eval__device_refusal(const cmd_eval_setup *es, const cmd_eval_job *jobs, int n_jobs, int task,
                                     char *buf, size_t size);

/* ---- --target-kl (cmd_eval_target.c) ---- */

/* Refuses, before any document, a job whose searched budgets (multiples of es->target_step
 * that its method takes, below N) are none. es->m must be set. Returns 0, or 2 after printing why. */
int cmd_eval__check_target_steps(const cmd_eval_setup *es, const cmd_eval_job *jobs, int n_jobs, int64_t N);

/* The same for each document shorter than --context + 2 x --continuation, searched at context
 * L - 2T (a sculpt-family method's retain zone can fill it): refused before any prefill rather
 * than failing the run at that document. Returns 0, or 2 (1: a document unread) after printing why. */
int cmd_eval__check_target_docs(const cmd_eval_setup *es, const cmd_eval_docset *docs, const cmd_eval_job *jobs,
                                int n_jobs);

/* Per document and job, the smallest budget whose KL on [N, N+T) is at most es->target_kl, with
 * the KL on the check part [N+T, N+2T) at it; a table per document, a summary over them, and a
 * CSV row per (document, job) when csv is not NULL. Returns 0, or 1 (2: a document that does not
 * open) after printing why. */
int cmd_eval__run_target(cmd_eval_setup *es, const cmd_eval_docset *docs, cmd_eval_job *jobs, int n_jobs, FILE *csv);

#endif
