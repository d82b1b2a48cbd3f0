/* cmd_eval.c: `kvmill eval`: compares compression methods with full KV on documents
 * (compress/eval/kvm_eval.h). This file is the command: its options, their checks, the model and
 * documents, and the dispatch to the task runs (cmd_eval_task.c), the --target-kl searches
 * (cmd_eval_target.c) or the fixed-budget runs (cmd_eval_run.c) over the jobs (cmd_eval_jobs.c). */
#include "common/kvm_error.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "model/kvm_chat.h"
#include "model/kvm_model_window.h"
#include "orchestrator/cmd_eval_int.h"
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"
#include "orchestrator/kvm_cli_model.h"
#include "pipeline/kvm_chatcfg.h"

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

/* The command's own options; --method's help is the method list, filled in at run time. */
static const kvm_cli_opt fixed_opts[] = {
    {"model", 1, KVM_CLI_MODEL_HELP, NULL},
    {"tokenizer", 1, "tokenizer (default: a GGUF model's own, else beside the model)", NULL},
    {"docs", 1, "documents: a folder of *.txt, a file, or a comma-separated list", NULL},
    {"method", 1, NULL, NULL},
    {"budget", 1,
     "entries kept per (layer, KV head), B: an integer >= 1 (-0 reads as 0) (comma-separated list allowed)", NULL},
    {"ratio", 1,
     "budget as a share r of the context, b = r*N, in [1e-9, 1]; one that keeps the whole context (1 always) is "
     "refused but for full (list allowed)",
     NULL},
    {"context", 1, "context tokens N, BOS included (default 384)", NULL},
    {"continuation", 1, "continuation tokens T (default 64)", NULL},
    {"phases", 1,
     "prefill (default): compress the context only; both: also each method's decode policy (such rows' ppl_full "
     "is from a token-by-token full-KV reference and can differ in the last digits)",
     NULL},
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
     "compute threads: the CPU kernels' (default: every CPU the process may use: its affinity mask and cgroup CPU "
     "quota) and each sculpt-family method's solver "
     "threads (default 1)",
     NULL},
    {"dtype", 1,
     "f32 (default), f16 or bf16: score each cache as the store serves it in this [store] dtype "
     "(round trip through the store's encoding; bytes = its stored bytes)",
     NULL},
    {"decode-steps", 1,
     "decode steps timed over each compressed cache for decode_ms (default 8, or the continuation "
     "when shorter; 0: none; at most the continuation)",
     NULL},
    {"target-kl", 1,
     "per document, the smallest budget whose mean KL on tokens [N, N+T) is <= this (nats, in (0, 1e6]), by "
     "bisection; tokens [N+T, N+2T) are the check (replaces --budget/--ratio)",
     NULL},
    {"target-step", 1, "--target-kl: budgets searched are multiples of this (tokens, default 16)", NULL},
    {"task", 1,
     "passkey, recall or multikey: task accuracy instead of KL; the context (--context tokens at most) "
     "is a document with a fact inserted at depth 0.1..0.9, the question is asked over the cache",
     NULL},
    {"cases", 1, "--task: cases (default 9: one document at the nine depths; case i uses document (i/9) mod D)", NULL},
    {"first-case", 1, "--task: index of the first case (default 0), so a long run can go in pieces", NULL},
    {"answer-tokens", 1, "--task: greedy tokens per answer at most (default 16)", NULL},
    {"chat", 0,
     "chat framing, as [model] chat = true: the cached context opens the user's turn (template, then "
     "the document); --task: question, end of turn and assistant marker are appended at ask time",
     NULL},
    {"weight-dtype", 1, KVM_CLI_WEIGHT_DTYPE_HELP, NULL},
    {"system", 1, "system message for --chat (default: the template's own default, if it has one)", NULL},
    {NULL, 0, NULL, NULL},
};
_Static_assert(sizeof fixed_opts / sizeof fixed_opts[0] < MAX_OPTS, "the fixed options fit the table (raise MAX_OPTS)");

/* The command line, parsed and checked before the model is opened. */
typedef struct eval_cli {
    kvm_cli_opt opts[MAX_OPTS];    /* fixed_opts, then the sculpt settings; values point into argv */
    char method_help[768];         /* --method's help */
    const kvm_sculpt_setting *set; /* the sculpt settings, in table order */
    int n_set;
    const char *model_path, *docs_s, *method, *budget, *ratio, *phases, *csv_path;
    const char *target, *task; /* --target-kl, --task, or NULL */
    cmd_eval_task_args ta;     /* --task's and --chat's settings; the rest is filled for the run */
    kvm_sculpt_opts dev_o;     /* --device as the sculpt solver reads it */
} eval_cli;

/* What a run holds, released by eval_free. */
typedef struct eval_run {
    cmd_eval_docset docs;
    kvm_model *m;
    kvm_tokenizer *tok;
    cmd_eval_job *jobs;
    int n_jobs;
    kvm_cli_staged out;           /* --csv, renamed into place only when every document is done */
    FILE *csv;                    /* out.f, or NULL without --csv */
    char *chat_open, *chat_close; /* --chat over KL: documents framed as run frames them */
} eval_run;

/* Fills c->opts: the fixed options, then every sculpt setting that is an eval flag (for
 * sculpt-family methods). Returns 0, or 1 when they do not fit. */
static int opts_init(eval_cli *c)
{
    snprintf(c->method_help, sizeof c->method_help,
             "%s (comma-separated list allowed; OPTS: name=value:... sculpt options, "
             "which override the sculpt flags below)",
             kvm_cli_methods());
    int n_opts = 0;
    for (; fixed_opts[n_opts].name; n_opts++) { /* counted, so none is ever cut off */
        c->opts[n_opts] = fixed_opts[n_opts];
        if (!strcmp(c->opts[n_opts].name, "method")) c->opts[n_opts].help = c->method_help;
    }
    c->set = kvm_sculpt_settings(&c->n_set);
    for (int i = 0; i < c->n_set; i++)
        if (eval_flag(&c->set[i])) {
            if (n_opts >= MAX_OPTS - 1) {
                fprintf(stderr, "kvmill " CMD ": internal: more than %d options (raise MAX_OPTS)\n", MAX_OPTS - 1);
                return 1;
            }
            c->opts[n_opts++] = (kvm_cli_opt){c->set[i].flag, !c->set[i].is_flag, c->set[i].help, NULL};
        }
    return 0;
}

/* --task and its settings (--cases, --first-case, --answer-tokens, which need it). Returns 0 or 2
 * after printing why. */
static int parse_task(eval_cli *c)
{
    const kvm_cli_opt *opts = c->opts;
    const char *target = c->target, *task = c->task;
    cmd_eval_task_args *ta = &c->ta;
    *ta = (cmd_eval_task_args){.cases = 9,
                               .answer_tokens = 16,
                               .chat = kvm_cli_get(opts, "chat") != NULL,
                               .system = kvm_cli_get(opts, "system")};
    if (task) {
        const char *cs = kvm_cli_get(opts, "cases"), *at = kvm_cli_get(opts, "answer-tokens"),
                   *fc = kvm_cli_get(opts, "first-case");
        int64_t x;
        if (kvm_task_parse(task, &ta->kind)) {
            fprintf(stderr, "kvmill " CMD ": --task: %s\n", kvm_errmsg());
            return 2;
        }
        if (target) {
            fprintf(stderr, "kvmill " CMD ": --task and --target-kl do not combine\n");
            return 2;
        }
        if (cs) {
            if (kvm_cli_int(CMD, "cases", cs, 1, 1 << 20, &x)) return 2;
            ta->cases = (int)x;
        }
        if (fc) {
            if (kvm_cli_int(CMD, "first-case", fc, 0, 1 << 20, &x)) return 2;
            ta->first_case = (int)x;
        }
        if (at) {
            if (kvm_cli_int(CMD, "answer-tokens", at, 1, 4096, &x)) return 2;
            ta->answer_tokens = (int)x;
        }
    } else if (kvm_cli_get(opts, "cases") || kvm_cli_get(opts, "answer-tokens") || kvm_cli_get(opts, "first-case")) {
        fprintf(stderr, "kvmill " CMD ": --cases, --first-case and --answer-tokens need --task\n");
        return 2;
    }
    return 0;
}

/* The first item of --method list `methods` that is not method full (its name, up to ':' or
 * ','), or NULL when every item is full: full KV keeps every entry and needs no budget. */
static const char *needs_budget(const char *methods, char *name, size_t size)
{
    for (const char *p = methods; *p;) {
        size_t n = strcspn(p, ","), w = strcspn(p, ",:");
        if (w != 4 || strncmp(p, "full", 4)) {
            snprintf(name, size, "%.*s", (int)(n < size ? n : size - 1), p);
            return name;
        }
        p += n;
        if (*p) p++;
    }
    return NULL;
}

/* The settings that do not apply with --task or --target-kl are said (a base command line may
 * carry them); --system needs --chat; --target-kl excludes --budget and --ratio, which otherwise
 * come one of the two. Returns 0 or 2 after printing why. */
static int parse_modes(const eval_cli *c)
{
    const kvm_cli_opt *opts = c->opts;
    const char *target = c->target, *task = c->task, *budget = c->budget, *ratio = c->ratio;
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
    if (c->ta.system && !c->ta.chat) {
        fprintf(stderr, "kvmill " CMD ": --system needs --chat\n");
        return 2;
    }
    char other[512];
    const char *needs = needs_budget(c->method, other, sizeof other);
    if (!target && !budget && !ratio && needs) { /* full alone runs without (parse_cli) */
        fprintf(stderr,
                "kvmill " CMD
                ": --method %s needs a budget: give one of --budget and --ratio (full KV alone needs none)\n",
                needs);
        return 2;
    }
    if (target ? budget || ratio : !!budget == !!ratio) {
        fprintf(stderr, "kvmill " CMD ": %s\n", target ? "--target-kl chooses the budget: give no --budget or --ratio"
                                                        : "give exactly one of --budget and --ratio");
        return 2;
    }
    return 0;
}

/* --dtype, --decode-steps, --target-kl, --target-step and --phases into es. Returns 0 or 2 after
 * printing why. */
static int parse_settings(const eval_cli *c, cmd_eval_setup *es)
{
    const kvm_cli_opt *opts = c->opts;
    const char *target = c->target, *phases = c->phases;
    *es = (cmd_eval_setup){.both = 0, .dtype = KVM_PROTO_F32, .decode_steps = -1, .target_kl = -1, .target_step = 16};
    const char *dtype = kvm_cli_get(opts, "dtype"), *steps = kvm_cli_get(opts, "decode-steps"),
               *tstep = kvm_cli_get(opts, "target-step");
    if (dtype && (kvm_proto_dtype_parse(dtype, strlen(dtype), &es->dtype) || es->dtype == KVM_PROTO_I32)) {
        fprintf(stderr, "kvmill " CMD ": --dtype: '%s' is not f32, f16 or bf16\n", dtype);
        return 2;
    }
    int64_t n_steps;
    if (steps) {
        if (kvm_cli_int(CMD, "decode-steps", steps, 0, 1 << 20, &n_steps)) return 2;
        es->decode_steps = (int)n_steps;
    }
    /* 0 refused ([compress] target_kl = 0 means off; here the search would end at full KV), in the
     * one message that states the range */
    if (target && kvm_cli_float_above(CMD, "target-kl", target, 0.0, 1e6, &es->target_kl)) return 2;
    if (tstep && !target) {
        fprintf(stderr, "kvmill " CMD ": --target-step needs --target-kl\n");
        return 2;
    }
    if (tstep && kvm_cli_int(CMD, "target-step", tstep, 1, 1 << 20, &es->target_step)) return 2;
    int both = 0;
    if (phases && strcmp(phases, "both") == 0)
        both = 1;
    else if (phases && strcmp(phases, "prefill") != 0) {
        fprintf(stderr, "kvmill " CMD ": --phases: '%s' is not prefill or both\n", phases);
        return 2;
    }
    es->both = both;
    return 0;
}

/* --context, --continuation (and with it the default --decode-steps), and --device: the device itself, then as the
 * solver's setting (the sculpt table's `device`, the selection `kvmill sculpt` makes), checked here before any prefill;
 * the capture, hooks and eviction need the host forward, so the kernels are the CPU's (--threads).
 * Returns 0 or 2 after printing why. */
static int parse_device(eval_cli *c, cmd_eval_setup *es)
{
    const kvm_cli_opt *opts = c->opts;
    if (cmd_eval_lengths(CMD, kvm_cli_get(opts, "context"), kvm_cli_get(opts, "continuation"), &es->N, &es->T))
        return 2;
    /* Not given: 8 steps, fewer when the continuation is shorter (a default the user never set is
     * not refused by check_window); only an explicit value above the continuation is. */
    if (es->decode_steps < 0) es->decode_steps = es->T < 8 ? (int)es->T : 8;
    const char *dev = kvm_cli_get(opts, "device");
    c->dev_o = kvm_sculpt_opts_default();
    const kvm_kernels *dev_k;
    if (dev && kvm_kernels_select(dev, &dev_k)) { /* the device itself: not the solver's message (an h2o run has none) */
        fprintf(stderr, "kvmill " CMD ": --device %s\n", kvm_errmsg());
        return 2;
    }
    if (dev && kvm_sculpt_opts_set(&c->dev_o, "device", dev)) {
        fprintf(stderr, "kvmill " CMD ": %s\n", kvm_errmsg());
        return 2;
    }
    if (kvm_cli_setup_device(CMD, "cpu", kvm_cli_get(opts, "threads"), &es->k)) return 2;
    return 0;
}

/* The whole command line into c and es, checked. Returns 0 (*done = 1 when --help was shown: the
 * command is over), or 2 (1: an internal error) after printing why. */
static int eval_parse(eval_cli *c, cmd_eval_setup *es, int argc, char **argv, int *done)
{
    memset(c, 0, sizeof *c);
    if (opts_init(c)) return 1;
    int n_pos, help;
    if (kvm_cli_parse(
            CMD, "Evaluates KV-cache compression methods against full KV: KL(full||compressed), top-1, perplexity.",
            argc, argv, c->opts, NULL, 0, &n_pos, &help)) {
        *done = help;
        return help ? 0 : 2;
    }
    const kvm_cli_opt *opts = c->opts;
    c->model_path = kvm_cli_get(opts, "model"), c->docs_s = kvm_cli_get(opts, "docs");
    c->method = kvm_cli_get(opts, "method"), c->budget = kvm_cli_get(opts, "budget");
    c->ratio = kvm_cli_get(opts, "ratio"), c->phases = kvm_cli_get(opts, "phases");
    c->csv_path = kvm_cli_get(opts, "csv");
    if (!c->model_path || !c->docs_s || !c->method) {
        fprintf(stderr, "kvmill " CMD ": --model, --docs and --method are required\n");
        return 2;
    }
    c->target = kvm_cli_get(opts, "target-kl"), c->task = kvm_cli_get(opts, "task");
    char other[512];
    if (!c->target && !c->budget && !c->ratio && !needs_budget(c->method, other, sizeof other))
        c->ratio = "1"; /* full KV keeps every entry whatever the budget: a placeholder column */
    if (parse_task(c) || parse_modes(c) || parse_settings(c, es) || parse_device(c, es)) return 2;
    return 0;
}

/* Opens the model and tokenizer (--weight-dtype applied) and, with --chat, the chat frame, which
 * must leave the document a token of the context. Returns 0, or 2 (1) after printing why. */
static int open_model(const eval_cli *c, cmd_eval_setup *es, eval_run *r)
{
    const kvm_cli_opt *opts = c->opts;
    int rc = kvm_cli_open_model(CMD, c->model_path, kvm_cli_get(opts, "tokenizer"), 1, &r->m, &r->tok);
    if (!rc && kvm_cli_weight_dtype(CMD, kvm_cli_get(opts, "weight-dtype"), r->m)) rc = 2;
    if (!rc && c->ta.chat &&
        kvm_chat_frame(r->tok, c->ta.system, &r->chat_open, &r->chat_close)) { /* --task frames its own */
        fprintf(stderr, "kvmill " CMD ": --chat: %s\n", kvm_errmsg());
        rc = 2; /* a setting the model cannot take, as run and serve refuse [model] chat */
    }
    int64_t n_frame = 0, N = es->N;
    if (!rc && r->chat_open && !kvm_chatcfg_frame_tokens(r->tok, r->chat_open, &n_frame) && n_frame >= N) {
        fprintf(stderr, "kvmill " CMD ": --chat: --context %lld leaves no token for the document: the chat frame (the "
                        "system turn and the user turn's opening) takes %lld tokens\n", (long long)N, (long long)n_frame);
        rc = 2;
    }
    es->m = r->m;
    es->tok = r->tok;
    es->frame = c->task ? NULL : r->chat_open;
    return rc;
}

/* What the run reads of each document fits the model's window: --task's context and answer,
 * else the context and continuation (twice the continuation with --target-kl), and
 * --decode-steps fits the continuation. Returns 0 or 2 after printing why. */
static int check_window(const eval_cli *c, const cmd_eval_setup *es)
{
    const int64_t N = es->N, T = es->T, seq_len = kvm_model_window(&es->m->cfg);
    const char *note = kvm_model_window_note(&es->m->cfg);
    const char *task = c->task, *target = c->target;
    int64_t T_run = target ? 2 * T : T; /* the target search scores a check part after the search part */
    if (task && N + c->ta.answer_tokens > seq_len) { /* --task asks and answers after the context */
        fprintf(stderr,
                "kvmill " CMD
                ": --task: context %lld + --answer-tokens %d exceeds the model's window of %lld tokens%s\n",
                (long long)N, c->ta.answer_tokens, (long long)seq_len, note);
        return 2;
    }
    if (!task && N + T_run > seq_len) {
        fprintf(stderr,
                "kvmill " CMD ": context %lld + continuation %lld%s exceeds the model's window of %lld tokens%s\n",
                (long long)N, (long long)T_run, target ? " (2 x --continuation with --target-kl)" : "",
                (long long)seq_len, note);
        return 2;
    }
    if (!task && es->decode_steps > T) {
        fprintf(stderr, "kvmill " CMD ": --decode-steps %d: at most the continuation (%lld)\n", es->decode_steps,
                (long long)T);
        return 2;
    }
    return 0;
}

/* The sculpt flags given (and --threads, --device), in table order, as "name=value:..." into
 * flags (size bytes); *sculpt_flag: the first sculpt option given as a flag (not --threads,
 * --device), or NULL. Returns 0, or 2 for a value holding a separator after printing why. */
static int sculpt_flags(const eval_cli *c, char *flags, size_t size, const char **sculpt_flag)
{
    const kvm_sculpt_setting *set = c->set;
    size_t at = 0;
    *sculpt_flag = NULL;
    for (int i = 0; i < c->n_set; i++) {
        const int own = !strcmp(set[i].name, "threads") || !strcmp(set[i].name, "device");
        const char *v = eval_flag(&set[i]) || own ? kvm_cli_get(c->opts, set[i].flag) : NULL;
        if (v && !own && !*sculpt_flag) *sculpt_flag = set[i].flag;
        if (v && strpbrk(v, strcmp(set[i].name, "device") ? ":,=" : ",=")) { /* cuda:N keeps its ':' */
            fprintf(stderr, "kvmill " CMD ": --%s: '%s' may not contain ':', ',' or '='\n", set[i].flag, v);
            return 2;
        }
        if (v) /* past the end: measured only (snprintf of NULL, 0) */
            at += (size_t)snprintf(at < size ? flags + at : NULL, at < size ? size - at : 0, "%s%s=%s", at ? ":" : "",
                                   set[i].name, v);
    }
    if (at >= size) { /* a cut list would drop flags or end a value early in silence */
        fprintf(stderr,
                "kvmill " CMD ": the sculpt flags come to %zu bytes as options, more than the %zu they may hold; "
                "shorten their values\n",
                at, size - 1);
        return 2;
    }
    return 0;
}

/* The jobs whose solver prefills the context again after it (query_source repeat) fit the
 * model's window at a context of N tokens (ctx names it), with the repeat prompt (chat: in the
 * chat turn). Returns 0, or 2 (1) after printing why. */
static int check_repeat(const eval_run *r, int chat, int64_t N, const char *ctx)
{
    int32_t *rp = NULL;
    int64_t n_rp = 0;
    if (kvm_sculpt_repeat_prompt(r->tok, chat, &rp, &n_rp)) {
        fprintf(stderr, "kvmill " CMD ": the repeat prompt: %s\n", kvm_errmsg());
        return 1;
    }
    free(rp);
    return cmd_eval__check_repeat(r->jobs, r->n_jobs, N, n_rp, kvm_model_window(&r->m->cfg), ctx, "lower --context");
}

/* The jobs of --method at --budget, --ratio or (--target-kl) a placeholder budget, with the
 * sculpt flags, and their checks (cmd_eval__check_jobs). Returns 0, or 2 (1) after printing why. */
static int build_jobs(const eval_cli *c, const cmd_eval_setup *es, eval_run *r)
{
    const char *target = c->target, *budget = c->budget;
    char n_buf[32];
    snprintf(n_buf, sizeof n_buf, "%lld", (long long)es->N); /* placeholder budget; each probe makes its own options */
    char flags[4096] = "";
    const char *sculpt_flag;
    int rc = sculpt_flags(c, flags, sizeof flags, &sculpt_flag);
    if (!rc)
        rc = cmd_eval__make_jobs(c->method,
                                 target   ? n_buf
                                 : budget ? budget
                                          : c->ratio,
                                 !target && !budget, target != NULL, flags, &r->m->cfg, c->model_path, &r->jobs,
                                 &r->n_jobs);
    if (!rc)
        rc = cmd_eval__check_jobs(r->jobs, r->n_jobs, target != NULL, budget != NULL, c->task != NULL, es->N,
                                  sculpt_flag, c->method);
    char ctx[64];
    snprintf(ctx, sizeof ctx, "--context %lld", (long long)es->N);
    if (!rc && !c->task)
        rc = check_repeat(r, es->frame != NULL, es->N, ctx); /* --task: its cases' (check_task_cases) */
    return rc;
}

/* --csv names no input of the run: the model, the tokenizer, a document, or (the CSV was renamed
 * over a calibration's strategy file) a polykv job's strategy. Returns 0 or 2 after printing why. */
static int check_csv(const eval_cli *c, const eval_run *r)
{
    const char *csv_path = c->csv_path;
    if (kvm_cli_check_out(CMD, "csv", csv_path)) return 2;
    if (kvm_cli_check_out_model(CMD, "csv", csv_path, c->model_path, kvm_cli_get(c->opts, "tokenizer"), "--docs",
                                c->docs_s))
        return 2; /* fopen "w" emptied it */
    for (int j = 0; j < r->n_jobs; j++)
        if (!strcmp(r->jobs[j].m->name, "polykv")) {
            char file[sizeof r->jobs[j].spec];
            const char *in_flag = "--method polykv", *in = cmd_eval__strategy_file(r->jobs[j].spec, file, sizeof file);
            if (kvm_cli_check_out_inputs(CMD, "csv", csv_path, &in_flag, &in, 1)) return 2;
        }
    return 0;
}

/* Every document long enough, before the first prefill and before --csv is emptied; then each
 * distinct document once: two documents are one when the ids eval reads from them are (KL: the
 * framed first N + T; --target-kl: N + 2T; --task: the whole text its cases are made from, as its
 * cases cycle over the distinct documents). Returns 0, or 2 (1) after printing why. */
static int check_docs(const eval_cli *c, const cmd_eval_setup *es, eval_run *r)
{
    const char *task = c->task, *target = c->target;
    const int64_t N = es->N, T = es->T;
    int rc = 0;
    if (!task) {
        char need[160];
        if (target)
            snprintf(need, sizeof need,
                     "2 x continuation %lld + 1 (--target-kl's search and check parts and a context "
                     "token; --continuation)",
                     (long long)T);
        else
            snprintf(need, sizeof need, "context %lld + continuation %lld (--context, --continuation)", (long long)N,
                     (long long)T);
        rc = cmd_eval_docs_check(CMD, r->tok, es->frame, &r->docs, target ? N + 2 * T : N + T,
                                 target ? 2 * T + 1 : N + T, need);
    }
    if (!rc)
        rc = cmd_eval_docs_dedup(CMD, r->tok, es->frame, &r->docs,
                                 task     ? 0
                                 : target ? N + 2 * T
                                          : N + T,
                                 "evaluating it once");
    return rc;
}

/* --task: every case's context (shorter than --context where its document is) keeps more than
 * each job's budget, and the longest fits query_source repeat (check_repeat), checked by making
 * the cases (no prefill) before any work. Returns 0, or 2 (1) after printing why. */
static int check_task_cases(const eval_cli *c, const cmd_eval_setup *es, const eval_run *r)
{
    cmd_eval_task_args ta = c->ta;
    ta.m = r->m, ta.k = es->k, ta.tok = r->tok, ta.n_ctx = es->N;
    int64_t nc, longest;
    int ci, di;
    int rc = cmd_eval_task_extent(&ta, &r->docs, &nc, &ci, &di, &longest);
    char ctx[1024];
    snprintf(ctx, sizeof ctx, "the longest task case's context (--context %lld at most)", (long long)es->N);
    if (!rc) rc = check_repeat(r, c->ta.chat, longest, ctx);
    if (rc || nc >= es->N || ci < 0) return rc; /* at --context: checked with the jobs */
    snprintf(ctx, sizeof ctx,
             "the context of task case %d (%s), %lld tokens (its document with the fact inserted, "
             "cut to fit --context %lld)",
             ci, r->docs.names[di], (long long)nc, (long long)es->N);
    return cmd_eval__check_sizes(r->jobs, r->n_jobs, c->budget != NULL, nc, ctx,
                                 "use longer documents (or drop that case: --cases, --first-case)");
}

/* Opens everything the run needs and checks it, in the order the messages come: the model, the
 * window, the jobs, --csv against the inputs, --target-step, the documents, --task's cases; then
 * --csv itself.
 * Returns 0, or 2 (1) after printing why; r holds what was opened either way. */
static int eval_open(const eval_cli *c, cmd_eval_setup *es, eval_run *r)
{
    int rc = open_model(c, es, r);
    if (!rc) rc = check_window(c, es);
    if (!rc) rc = build_jobs(c, es, r);
    if (!rc) rc = check_csv(c, r);
    if (!rc && c->target) rc = cmd_eval__check_target_steps(es, r->jobs, r->n_jobs, es->N);
    if (!rc) rc = check_docs(c, es, r);
    if (!rc && c->target) rc = cmd_eval__check_target_docs(es, &r->docs, r->jobs, r->n_jobs);
    if (!rc && c->task) rc = check_task_cases(c, es, r);
    if (!rc && c->csv_path && !(rc = kvm_cli_staged_open(CMD, "csv", c->csv_path, &r->out))) r->csv = r->out.f;
    return rc;
}

/* With --device cuda:N, says before any document what runs where. Returns 1 when the jobs run
 * on the device (cmd_eval__device_refusal), else 0. */
static int announce_device(const eval_cli *c, const cmd_eval_setup *es, const eval_run *r)
{
    if (!c->dev_o.cuda) return 0;
    char why_buf[256];
    const char *why = cmd_eval__device_refusal(es, r->jobs, r->n_jobs, c->task != NULL, why_buf, sizeof why_buf);
    if (!why)
        fprintf(stderr,
                "kvmill " CMD ": prefill, eviction (selection and compaction%s), continuation and scoring on "
                "cuda:%d, against the device's own full KV (decode_ms is not measured there: 0)\n",
                es->both ? ", decode-phase policy" : "", c->dev_o.cuda_device);
    else
        fprintf(stderr,
                "kvmill " CMD ": prefill, compression and scoring run on the CPU (%s); the sculpt-family "
                "solver on cuda:%d\n",
                why, c->dev_o.cuda_device);
    return why == NULL;
}

/* The --task cases over the jobs (cmd_eval_task.c). Returns cmd_eval_task_run's status, or 1. */
static int run_task(eval_cli *c, cmd_eval_setup *es, eval_run *r)
{
    cmd_eval_task_job *tj = calloc((size_t)r->n_jobs + 1, sizeof *tj);
    if (!tj) return 1;
    int n = 0, dropped = 0;
    for (int i = 0; i < r->n_jobs; i++) {
        if (!strcmp(r->jobs[i].spec, "full")) { /* every case's baseline already: twice, under a budget's name */
            dropped++;
            continue;
        }
        tj[n++] = (cmd_eval_task_job){r->jobs[i].m, r->jobs[i].opts, r->jobs[i].spec, r->jobs[i].budget};
    }
    if (dropped)
        fprintf(stderr, "kvmill " CMD ": --task: full KV answers every case as the baseline; --method full adds no "
                        "column\n");
    cmd_eval_task_args *ta = &c->ta;
    ta->m = r->m;
    ta->k = es->k;
    ta->tok = r->tok;
    ta->n_ctx = es->N;
    ta->roundtrip = cmd_eval__store_roundtrip;
    ta->user = es;
    ta->csv = r->csv;
    int rc = cmd_eval_task_run(ta, &r->docs, tj, n);
    free(tj);
    return rc;
}

/* Runs what the command line asks for: --task cases, the eviction methods on the device,
 * --target-kl searches, or the fixed-budget KL runs. Returns their status. */
static int eval_dispatch(eval_cli *c, cmd_eval_setup *es, eval_run *r, int on_device)
{
    if (c->task) return run_task(c, es, r);
    if (on_device) {
#ifdef KVM_WITH_CUDA
        return cmd_eval__run_device(es, &r->docs, r->jobs, r->n_jobs, r->csv, c->dev_o.cuda_device);
#endif
        return 0;
    }
    if (c->target) return cmd_eval__run_target(es, &r->docs, r->jobs, r->n_jobs, r->csv);
    return cmd_eval__run(es, &r->docs, r->jobs, r->n_jobs, r->csv);
}

/* Releases what r holds (--csv is closed by the caller, which knows whether the run succeeded). */
static void eval_free(eval_run *r)
{
    cmd_eval__free_jobs(r->jobs, r->n_jobs);
    free(r->chat_open);
    free(r->chat_close);
    cmd_eval_docs_free(&r->docs);
    kvm_tokenizer_close(&r->tok);
    kvm_model_close(&r->m);
}

int kvm_cmd_eval(int argc, char **argv)
{
    eval_cli c;
    cmd_eval_setup es;
    int done = 0, rc = eval_parse(&c, &es, argc, argv, &done);
    if (rc || done) return rc;
    eval_run r = {0};
    rc = cmd_eval_docs_list(CMD, c.docs_s, &r.docs);
    if (rc) return rc;
    rc = eval_open(&c, &es, &r);
    int on_device = !rc && announce_device(&c, &es, &r);
    if (!rc) rc = eval_dispatch(&c, &es, &r, on_device);
    if (kvm_cli_staged_close(CMD, "csv", &r.out, rc == 0)) rc = 1;
    eval_free(&r);
    return rc;
}
