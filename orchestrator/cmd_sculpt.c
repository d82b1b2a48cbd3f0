/* cmd_sculpt.c: `kvmill sculpt`: prefill a document's first N tokens with KV capture, compress
 * the cache with KVSculpt (or Select+Fit / joint-fixed) and write it to a KVMSCULP file
 * (compress/sculpt/kvm_sculpt_file.h). Every solver setting comes from the sculpt option table. */
#include "compress/sculpt/kvm_sculpt_file.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "orchestrator/kvm_cli.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "orchestrator/kvm_cli_eval.h"
#include "orchestrator/kvm_cli_model.h"
#include "model/kvm_capture.h"
#include "model/kvm_model_window.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { MAX_OPTS = 64 };

/* 1 when path is the file standard output writes to (/dev/stdout, the pipe, FIFO or file stdout
 * was sent to): the summary printed to stdout went into the binary cache (a pipe, a FIFO), or
 * into the file the cache replaced (lost). Asked before the cache is written. */
static int out_is_stdout(const char *path)
{
    struct stat so, sp;
    return fstat(STDOUT_FILENO, &so) == 0 && stat(path, &sp) == 0 && so.st_dev == sp.st_dev && so.st_ino == sp.st_ino;
}

/* 1 when path is a FIFO or socket: what its writer had not yet sent when sculpt read it is not
 * there (a device such as /dev/null that reads empty is an empty document) */
static int is_pipe(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
}

/* Why --doc gave no token besides BOS: a FIFO (opened without waiting for a writer, kvm_file.c,
 * so one whose writer comes later reads as empty) or socket is named as eval names it; a file
 * (or a device that reads empty) is empty. */
static void say_no_tokens(const char *doc)
{
    if (is_pipe(doc))
        fprintf(stderr,
                "kvmill sculpt: --doc %s: not a regular file (a FIFO, such as the shell's <(...), a socket or a "
                "device) and nothing could be read from it: sculpt does not wait for a writer; save it to a file "
                "and name that\n",
                doc);
    else
        fprintf(stderr, "kvmill sculpt: --doc %s is empty: it has no tokens besides BOS\n", doc);
}

/* 1 when s is the integer 0 as every integer flag reads it ("0", "-0": strtoll), so that --budget
 * -0 is "use --ratio" as 0 is, not a second size beside --ratio */
static int is_zero(const char *s)
{
    char *end;
    errno = 0;
    return strtoll(s, &end, 10) == 0 && !errno && end != s && !*end;
}

/* Prefill + capture + compress + write. Prints a one-line summary to stdout, or to stderr when
 * --out is standard output. Returns the exit status: 0, 2 for settings the context refuses
 * (KVM_EINVAL), 1 for any other failure. */
static int run(const kvm_model *m, const kvm_kernels *kk, const kvm_tokenizer *tok, const int32_t *ids, int64_t n,
               const kvm_sculpt_opts *o, const char *out_path)
{
    FILE *summary = out_is_stdout(out_path) ? stderr : stdout;
    /* OUT.part (locked) renamed over OUT when whole, opened before the work: a cache written in
     * place left OUT truncated, the old file lost, when the write failed (a full disk) or the run
     * was killed during it */
    kvm_cli_staged so;
    int src = kvm_cli_staged_open("sculpt", "out", out_path, &so);
    if (src) return src;
    kvm_forward *f = NULL;
    kvm_kvcache *full = NULL, *c = NULL;
    kvm_capture *cap = NULL;
    kvm_capture_opts co = {.want_queries = 1};
    int rc = kvm_capture_new(&m->cfg, n, &co, &cap);
    if (!rc) rc = kvm_forward_new(m, kk, 0, &f);
    if (!rc) rc = kvm_forward_add_hooks(f, kvm_capture_hooks(cap));
    if (!rc) rc = kvm_forward_cache_new(m, n, &full);
    if (!rc) rc = kvm_forward_prefill(f, full, ids, n, NULL, KVM_LOGITS_NONE);
    kvm_sculpt_stats st;
    int32_t *rp = NULL; /* query_source repeat: KVzip's instruction before the repeated copy */
    int64_t n_rp = 0;
    if (!rc) rc = kvm_sculpt_repeat_prompt(tok, 0, &rp, &n_rp);
    kvm_compress_input in = {.model = m, .full = full, .cap = cap, .n_tokens = n, .n_future = 0, .tokens = ids,
                             .repeat_prompt = rp, .n_repeat_prompt = n_rp};
    if (!rc) rc = kvm_sculpt_compress(&in, o, &c, &st);
    if (!rc) rc = kvm_sculpt_cache_fwrite(so.f, out_path, c);
    if (rc)
        kvm_cli_staged_abort(&so); /* a cut-short cache is worth nothing: no OUT.part left */
    else if (kvm_cli_staged_close("sculpt", "out", &so, 1))
        src = 1; /* said */
    if (!rc && !src)
        fprintf(summary,
                "sculpt: N=%lld entries=%lld (full %lld) bytes=%lld (full %lld) seconds=%.2f query_s=%.2f "
                "lbfgs_s=%.2f ridge_s=%.2f pilot_s=%.2f out=%s\n",
                (long long)n, (long long)st.base.entries, (long long)kvm_kvcache_entries(full),
                (long long)kvm_kvcache_bytes(c), (long long)kvm_kvcache_bytes(full), st.base.seconds, st.query_s,
                st.lbfgs_s, st.ridge_s, st.pilot_s, out_path);
    if (!rc && !src && st.base.entries >= kvm_kvcache_entries(full)) /* as run's "kept whole" line says it */
        fprintf(stderr,
                "kvmill sculpt: %s: %lld tokens are too few for the retain zone (%lld) and the distilled "
                "entries to save an entry: the cache holds the full KV\n",
                out_path, (long long)n, (long long)o->retain_tokens);
    if (rc) fprintf(stderr, "kvmill sculpt: %s\n", kvm_cli_errmsg("sculpt"));
    free(rp);
    kvm_kvcache_free(&c);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
    kvm_capture_free(&cap);
    return rc == KVM_EINVAL ? 2 : rc || src ? 1 : 0; /* EINVAL: settings this context cannot take (usage) */
}

/* Settings under which the "compressed" cache would hold every entry of the context (as run and
 * eval refuse them): the retain zone is the whole context, or the budget (entries per KV head,
 * retain zone included) is not below it, or --ratio (the flag's text: ratio; method: --method's)
 * keeps every entry of the N tokens (ctx: --context, NULL when the document's length is N). Says
 * which on stderr; returns 1 then. */
static int refuse_no_compression(const kvm_sculpt_opts *o, int64_t N, const char *method, const char *ratio,
                                 const char *ctx)
{
    if (o->retain_tokens > N) /* a document shorter than the retain zone: run's own message names it */
        return 0;
    if (o->retain_tokens == N)
        fprintf(stderr, "kvmill sculpt: --retain %lld is not below the context's %lld tokens: nothing is left to "
                        "compress; lower --retain\n", (long long)o->retain_tokens, (long long)N);
    else if (o->k_entries > 0 && o->k_entries + o->retain_tokens >= N)
        fprintf(stderr, "kvmill sculpt: --budget %lld is not below the context's %lld tokens: the \"compressed\" "
                        "cache would be as large as the full one; lower --budget\n",
                (long long)(o->k_entries + o->retain_tokens), (long long)N);
    else if (o->k_entries == 0 && o->ratio >= 1)
        fprintf(stderr, "kvmill sculpt: --ratio 1 keeps every entry: the \"compressed\" cache would be as large as "
                        "the full one; lower --ratio\n");
    else if (o->k_entries == 0 && kvm_sculpt_k(o, N) + o->retain_tokens >= N)
        /* k = round(r·(N − m)) rounds up to the whole compress zone: eval's wording (cmd_eval__check_sizes) */
        fprintf(stderr,
                "kvmill sculpt: --method %s: --ratio %s of the compress zone (%s%lld%s less the retain zone of %lld) "
                "keeps %lld distilled entr%s beside the %lld retained, the whole context: the \"compressed\" cache "
                "would be as large as the full one; lower --ratio%s\n",
                method, ratio, ctx ? "--context " : "the context's ", (long long)N, ctx ? "" : " tokens",
                (long long)o->retain_tokens, (long long)kvm_sculpt_k(o, N), kvm_plural(kvm_sculpt_k(o, N), "y", "ies"),
                (long long)o->retain_tokens, ctx ? " or raise --context" : "");
    else
        return 0;
    return 1;
}

int kvm_cmd_sculpt(int argc, char **argv)
{
    kvm_cli_opt opts[MAX_OPTS] = {
        {"model", 1, KVM_CLI_MODEL_HELP, NULL},
        {"tokenizer", 1,
         "tokenizer (default: a GGUF model's own, a Hugging Face folder's tokenizer.json, else tok512.bin or "
         "tokenizer.bin beside the model)",
         NULL},
        {"doc", 1, "document text file (encoded with BOS)", NULL},
        {"context", 1,
         "context tokens N: the document's first N tokens, at most the model's window (default: all, cut to the "
         "window)",
         NULL},
        {"out", 1,
         "output cache file (KVMSCULP format, compress/sculpt/kvm_sculpt_file.h); when it is standard output "
         "(/dev/stdout, or the file or pipe stdout goes to) the summary line goes to stderr",
         NULL},
    };
    int n_fixed = 0, n_set;
    while (opts[n_fixed].name) n_fixed++; /* the entries above, counted */
    const kvm_sculpt_setting *set = kvm_sculpt_settings(&n_set);
    if (n_fixed + n_set >= MAX_OPTS) {
        fprintf(stderr, "kvmill sculpt: internal: more than %d options (raise MAX_OPTS)\n", MAX_OPTS - 1);
        return 1;
    }
    for (int i = 0; i < n_set; i++) /* --NAME for every setting, --method included */
        opts[n_fixed + i] = (kvm_cli_opt){set[i].flag, !set[i].is_flag, set[i].help, NULL};
    int n_pos, help;
    if (kvm_cli_parse("sculpt", "Compresses a document's KV cache by KVSculpt distillation (--method sculpt, or the "
                                "baselines selectfit and joint-fixed) and writes it to --out.",
                      argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *model_path = kvm_cli_get(opts, "model"), *doc = kvm_cli_get(opts, "doc"),
               *out = kvm_cli_get(opts, "out"), *s;
    if (!model_path || !doc || !out) {
        fprintf(stderr, "kvmill sculpt: --model, --doc and --out are required\n");
        return 2;
    }
    if (kvm_cli_check_out("sculpt", "out", out) ||
        kvm_cli_check_out_model("sculpt", "out", out, model_path, kvm_cli_get(opts, "tokenizer"), "--doc", doc))
        return 2;
    const char *sized = kvm_cli_get(opts, "budget") ? "budget" : kvm_cli_get(opts, "entries") ? "entries" : NULL;
    if (sized && !is_zero(kvm_cli_get(opts, sized)) && kvm_cli_get(opts, "ratio")) { /* the budget won, unsaid */
        fprintf(stderr, "kvmill sculpt: --ratio and --%s both size the cache: give one of them\n", sized);
        return 2;
    }
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    for (int i = 0; i < n_set; i++) /* table order: retain before budget */
        if ((s = kvm_cli_get(opts, set[i].flag)) && kvm_sculpt_opts_set(&o, set[i].name, s)) {
            fprintf(stderr, "kvmill %s\n", kvm_errmsg());
            return 2;
        }
    if (kvm_sculpt_opts_check_combination(&o)) { /* before the model is read: the solver would refuse it after */
        fprintf(stderr, "kvmill %s\n", kvm_errmsg());
        return 2;
    }
    char given[1024] = "", names[512];
    for (int i = 0, at = 0; i < n_set && at < (int)sizeof given;
         i++) /* a note, not a refusal: see kvm_sculpt_opts_unused */
        if (kvm_cli_get(opts, set[i].flag)) at += snprintf(given + at, sizeof given - (size_t)at, "%s:", set[i].name);
    if (kvm_sculpt_opts_unused(&o, given, ":", names, sizeof names) > 0)
        fprintf(stderr, "kvmill sculpt: note: --method %s does not read %s; ignored\n",
                kvm_cli_get(opts, "method") ? kvm_cli_get(opts, "method") : "sculpt", names);
    int64_t ctx = 0;
    if ((s = kvm_cli_get(opts, "context")) && kvm_cli_int("sculpt", "context", s, 1, INT32_MAX, &ctx)) return 2;
    if (ctx == 1) { /* BOS alone: was refused as the document being empty */
        fprintf(stderr, "kvmill sculpt: --context 1 is the BOS token alone: a context needs at least 2 tokens (BOS "
                        "and the document's first); give a larger --context, or none for the whole document\n");
        return 2;
    }
    const kvm_kernels *kk;
    /* --device (the sculpt table's `device`, checked above before any work) is the solver's: the
     * query capture is the host forward's (model/kvm_capture.h), so the prefill runs on the CPU */
    if (kvm_cli_setup_device("sculpt", "cpu", kvm_cli_get(opts, "threads"), &kk)) return 2;
    if (o.cuda) /* the capture of training queries is the host forward's (model/kvm_capture.h) */
        fprintf(stderr, "kvmill sculpt: the prefill runs on the CPU (the query capture has no CUDA forward yet); "
                        "the solver on cuda:%d\n", o.cuda_device);
    kvm_model *m;
    kvm_tokenizer *tok;
    int ost = kvm_cli_open_model("sculpt", model_path, kvm_cli_get(opts, "tokenizer"), 1, &m, &tok);
    if (ost) return ost;
    int32_t *ids = NULL;
    int64_t n = 0;
    /* BOS first, as eval reads a document; with --context only the ids it needs are read and
     * tokenised (a document shorter than that is still named with its length) */
    int64_t want = ctx > 0 ? ctx : 0;
    int rc = cmd_eval_docs_encode("sculpt", tok, NULL, doc, want, &ids, &n);
    if (!rc) {
        int64_t N = ctx > 0 ? ctx : n;
        if (n <= 1) { /* BOS alone: a "cache" of nothing, which run, serve and eval refuse */
            say_no_tokens(doc);
            rc = 2;
        } else if (ctx >
                   kvm_model_window(&m->cfg)) { /* a cut the user did not ask for would compress another context */
            fprintf(stderr, "kvmill sculpt: --context %lld is past the model's window of %d tokens%s\n", (long long)ctx,
                    kvm_model_window(&m->cfg), kvm_model_window_note(&m->cfg));
            rc = 2;
        } else if (N > n) {
            fprintf(stderr, "kvmill sculpt: --context %lld but %s has %lld tokens\n", (long long)N, doc, (long long)n);
            rc = 2;
        } else {
            if (N > kvm_model_window(&m->cfg)) {
                fprintf(stderr,
                        "kvmill sculpt: %s has %lld tokens: its first %d (the model's window%s) are the context\n", doc,
                        (long long)n, kvm_model_window(&m->cfg), kvm_model_window_note(&m->cfg));
                N = kvm_model_window(&m->cfg);
            }
            const char *method = kvm_cli_get(opts, "method"), *ratio = kvm_cli_get(opts, "ratio");
            rc = refuse_no_compression(&o, N, method ? method : "sculpt",
                                       ratio ? ratio : kvm_sculpt_setting_find("ratio", 5)->def,
                                       ctx > 0 && N == ctx ? "--context" : NULL)
                     ? 2
                     : run(m, kk, tok, ids, N, &o, out);
        }
    }
    free(ids);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return rc;
}
