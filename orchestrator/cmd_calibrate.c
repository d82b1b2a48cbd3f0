/* cmd_calibrate.c: `kvmill calibrate`: PolyKV calibration on a few documents: measures the
 * signals, builds and scores the candidate strategies, writes the best one's canonical
 * encoding (compress/polykv/kvm_polykv.h). */
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "common/kvm_number.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "orchestrator/kvm_cli.h"
#include "model/kvm_model_window.h"
#include "orchestrator/kvm_cli_eval.h"
#include "orchestrator/kvm_cli_model.h"
#include "store/kvm_store.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CMD "calibrate"

typedef struct calib_args {
    int64_t B, b_min, N, T;
    int sel, alloc;  /* −1: every candidate */
    int64_t refine;  /* refinement rounds (0 = none) */
    int64_t windows; /* context+continuation windows per document */
    const char *out, *dump, *cand; /* --out, --dump-signals, --dump-candidates */
    FILE *out_f;                   /* --out, opened before the work */
    kvm_cli_staged *dump_s;        /* --dump-signals, opened before the work (its f NULL: none) */
    const char *reuse;     /* --signals: an earlier run's --dump-signals, or NULL */
    int sculpt;            /* 1: KVSculpt is in the design space */
    int kvzip;             /* 1: KVzip scoring is in the design space (a pattern of its own) */
    int decode;            /* kvm_polykv_decode: how the decode-phase signals are measured */
    kvm_sculpt_opts so;    /* its options */
    kvm_store_id model_id; /* the model's (the store's id): recorded in the strategy files (KVST v3) */
} calib_args;

_Static_assert(KVM_STORE_ID_BYTES == KVM_STRATEGY_MODEL_ID_BYTES, "a strategy records the store's model id");

/* --signals: the earlier run's signals into sig, checked against this run's budget and phases;
 * its sculpt / kvzip rows are kept only with --sculpt / --kvzip and only when the file records
 * that they were measured with this run's sculpt options (else they are measured again, said on
 * stderr; the others are measured).
 * Returns 0, 1 (the file could not be read, e.g. out of memory: kvm_errmsg says why, for the caller
 * to print) or 2 (a mismatch, or a file that is missing, a folder or not a signals CSV: a usage
 * error like any other bad argument; message printed). */
static int reuse_signals(const calib_args *a, kvm_polykv_signals *sig)
{
    int rrc = kvm_polykv_signals_read(a->reuse, sig);
    if (rrc == KVM_ENOTFOUND || rrc == KVM_EFORMAT) {
        fprintf(stderr, "kvmill " CMD ": %s\n", kvm_cli_errmsg(CMD)); /* "signals PATH: why" */
        return 2;
    }
    if (rrc) return 1;
    const int has_decode = !sig->prefill_only, wants_decode = a->decode != KVM_POLYKV_DECODE_NONE;
    const char *why = sig->budget != a->B            ? "its budget is not --budget's"
                      : has_decode && !wants_decode ? "it has decode-phase rows (use --phases both)"
                      : !has_decode && wants_decode ? "it has no decode-phase rows (use --phases prefill)"
                                                    : NULL;
    if (why) {
        fprintf(stderr, "kvmill " CMD ": --signals %s (budget %lld): %s\n", a->reuse, (long long)sig->budget, why);
        return 2;
    }
    sig->has_sculpt &= a->sculpt;
    sig->has_kvzip &= a->kvzip;
    char d[2048];
    if ((sig->has_sculpt || sig->has_kvzip) &&
        !(sig->sculpt_opts_known && kvm_sculpt_opts_diff(&a->so, &sig->sculpt_opts, "the file's", d, sizeof d))) {
        const char *kinds = sig->has_sculpt && sig->has_kvzip ? "sculpt and kvzip" : sig->has_sculpt ? "sculpt" : "kvzip";
        const char *with = sig->sculpt_opts_known ? "other sculpt options: "
                                                 : "sculpt options the file does not record (it has no "
                                                   "'# sculpt_options=' line)";
        fprintf(stderr, "kvmill " CMD ": --signals %s: its %s rows were measured with %s%s; measuring them again with "
                        "this run's\n", a->reuse, kinds, with, sig->sculpt_opts_known ? d : "");
        sig->has_sculpt = sig->has_kvzip = 0;
    }
    return 0;
}

/* 1 when output `out` (a path given to --out or --dump-signals) names folder/file: the same file
 * when both exist, else the same folder (by device and inode) and the same last component. */
static int names_file(const char *out, const char *folder, const char *file, const char *path)
{
    struct stat so, sp, sd, sf;
    if (!stat(out, &so) && !stat(path, &sp)) return so.st_dev == sp.st_dev && so.st_ino == sp.st_ino;
    const char *slash = strrchr(out, '/');
    char dir[4096];
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else
        snprintf(dir, sizeof dir, "%.*s", slash == out ? 1 : (int)(slash - out), out);
    return !strcmp(slash ? slash + 1 : out, file) && !stat(dir, &sd) && !stat(folder, &sf) && sd.st_dev == sf.st_dev &&
           sd.st_ino == sf.st_ino;
}

/* --dump-candidates DIR, before any work: every candidate file the builder will write there
 * (kvm_polykv_candidate_file, with this run's filters) must not be --out or --dump-signals (the
 * strategy or the signals, written last or first, replaced that candidate or were replaced) nor
 * an existing file that is read-only (root may write any file: its write bits are checked too)
 * or not a regular file, as --out itself is refused, nor an input: a file of the model (model,
 * tokenizer: kvm_cli_check_out_model), a --docs document or the --signals file (read first, they
 * were replaced by a candidate). Returns 0, or 2 after saying why. */
static int check_candidates(const calib_args *a, const char *model, const char *tokenizer, const char *docs)
{
    char file[64], path[4200];
    for (int i = 0; kvm_polykv_candidate_file(i, a->sel, a->alloc, a->sculpt, a->kvzip, file, sizeof file); i++) {
        size_t n = strlen(a->cand);
        while (n > 1 && a->cand[n - 1] == '/')
            n--; /* "DIR/": DIR/NAME.bin, not DIR//NAME.bin */
        snprintf(path, sizeof path, "%.*s/%s", (int)n, a->cand, file);
        const char *outs[2][2] = {{"--out", a->out}, {"--dump-signals", a->dump}};
        for (int k = 0; k < 2; k++)
            if (outs[k][1] && names_file(outs[k][1], a->cand, file, path)) {
                fprintf(stderr,
                        "kvmill " CMD ": %s %s is the --dump-candidates file %s: one would replace the other; "
                        "name another file or folder\n",
                        outs[k][0], outs[k][1], path);
                return 2;
            }
        if (kvm_cli_check_out_model(CMD, "dump-candidates", path, model, tokenizer, "--docs", docs) ||
            kvm_cli_check_out_inputs(CMD, "dump-candidates", path, (const char *const[]){"--signals"},
                                     (const char *const[]){a->reuse}, 1))
            return 2;
        struct stat st;
        if (stat(path, &st)) continue; /* a new file */
        if (!S_ISREG(st.st_mode) || !kvm_file_replaceable(path, &st)) {
            fprintf(stderr,
                    "kvmill " CMD ": --dump-candidates %s: %s exists and is %s: the calibration would replace "
                    "it; name another folder%s\n",
                    a->cand, path, S_ISREG(st.st_mode) ? "read-only" : "not a regular file",
                    S_ISREG(st.st_mode) ? ", or make it writable (chmod u+w) if it is one to replace" : "");
            return 2;
        }
    }
    return 0;
}

/* 1 when windows a and b hold the same context and continuation tokens. */
static int same_window(const kvm_eval_doc *a, const kvm_eval_doc *b)
{
    const kvm_compress_input *ia = kvm_eval_doc_input(a), *ib = kvm_eval_doc_input(b);
    int64_t ta, tb;
    const int32_t *ca = kvm_eval_doc_continuation(a, &ta), *cb = kvm_eval_doc_continuation(b, &tb);
    return ia->tokens && ib->tokens && ia->n_tokens == ib->n_tokens && ta == tb &&
           !memcmp(ia->tokens, ib->tokens, (size_t)ia->n_tokens * sizeof *ia->tokens) &&
           !memcmp(ca, cb, (size_t)ta * sizeof *ca);
}

/* Loads every document's --windows windows into docs[*nd] with doc_of[*nd] their document's index
 * (docs and doc_of hold ds->n × windows), dropping a window that repeats an earlier one of its
 * document (a document too short for its windows gives several at the same start: counted again,
 * they weighed its text more and the builder's t-test took them for more documents), with one
 * stderr note per such document. Returns 0 or cmd_eval_docs_load's status (said). */
static int load_windows(const kvm_model *m, const kvm_kernels *k, const kvm_tokenizer *tok, const cmd_eval_docset *ds,
                        const calib_args *a, kvm_eval_doc **docs, int *doc_of, int *nd)
{
    const int W = (int)a->windows;
    *nd = 0;
    for (int doc = 0; doc < ds->n; doc++) {
        int dups = 0;
        for (int w = 0; w < W; w++) {
            kvm_eval_doc *d = NULL;
            int rc = cmd_eval_docs_load(CMD, m, k, tok, NULL, ds->paths[doc], a->N, a->T, w, W, &d);
            if (rc) return rc;
            int dup = 0;
            for (int j = *nd - 1; j >= 0 && doc_of[j] == doc && !dup; j--)
                dup = same_window(docs[j], d);
            if (dup) {
                kvm_eval_doc_free(&d);
                dups++;
                continue;
            }
            docs[*nd] = d;
            doc_of[(*nd)++] = doc;
        }
        if (dups)
            fprintf(stderr,
                    "kvmill " CMD ": note: %s: %d of its %d windows repeat an earlier one (the same tokens); "
                    "calibrating on its %d distinct window%s\n",
                    ds->paths[doc], dups, W, W - dups, kvm_plural(W - dups, "", "s"));
    }
    return 0;
}

/* --sculpt or --kvzip layers whose training queries come from query_source repeat prefill the
 * repeat prompt (P tokens) and the context again after it: 2N + P positions, which must fit the
 * model's window. Found only after the eviction signals, the most of the work (exit 1); now
 * before any prefill. Returns 0, or 2 (1: the prompt could not be encoded) after saying why. */
static int check_repeat(const kvm_model *m, const kvm_tokenizer *tok, const calib_args *a)
{
    if (!(a->sculpt || a->kvzip) || !(a->so.query_source.share[KVM_SCULPT_QSRC_REPEAT] > 0)) return 0;
    int32_t *rp = NULL;
    int64_t n_rp = 0;
    if (kvm_sculpt_repeat_prompt(tok, 0, &rp, &n_rp)) {
        fprintf(stderr, "kvmill " CMD ": the repeat prompt: %s\n", kvm_errmsg());
        return 1;
    }
    free(rp);
    const int64_t need = 2 * a->N + (n_rp > 0 ? n_rp : 1);
    if (need <= kvm_model_window(&m->cfg)) return 0;
    fprintf(stderr,
            "kvmill " CMD ": --sculpt-opts: query_source repeat needs 2N + P = %lld positions (N = %lld, --context; "
            "the repeat prompt P = %lld) but the model's window is %d tokens: lower --context, or another "
            "query_source\n",
            (long long)need, (long long)a->N, (long long)(n_rp > 0 ? n_rp : 1), kvm_model_window(&m->cfg));
    return 2;
}

static int calibrate(const kvm_model *m, const kvm_kernels *k, const kvm_tokenizer *tok, const cmd_eval_docset *ds,
                     const calib_args *a)
{
    const int nw = ds->n * (int)a->windows;
    kvm_eval_doc **docs = calloc((size_t)nw, sizeof *docs);
    int *doc_of = calloc((size_t)nw, sizeof *doc_of), nd = 0; /* nd: the distinct windows kept */
    kvm_polykv_signals *sig = NULL;
    kvm_strategy *best = NULL;
    int rc = docs && doc_of ? 0 : 1; /* srs: a signals error, found before the documents' prefill where it can be */
    int srs = rc ? 0 : kvm_polykv_signals_new(m->cfg.n_layers, &sig) ? 1 : a->reuse ? reuse_signals(a, sig) : 0;
    if (!rc && !srs) rc = load_windows(m, k, tok, ds, a, docs, doc_of, &nd);
    if (!rc && !srs &&
        ((!a->reuse && kvm_polykv_calibrate_phases(docs, nd, a->B, a->decode, sig)) ||
         (a->sculpt && !sig->has_sculpt && kvm_polykv_calibrate_sculpt(docs, nd, a->B, &a->so, sig)) ||
         (a->kvzip && !sig->has_kvzip && kvm_polykv_calibrate_kvzip(docs, nd, a->B, &a->so, sig))))
        srs = 1;
    if (srs == 1) fprintf(stderr, "kvmill " CMD ": %s\n", kvm_cli_errmsg(CMD));
    if (srs) rc = srs;
    errno = 0;
    if (!rc && a->dump_s->f && (kvm_polykv_signals_csv(sig, a->dump_s->f) || fflush(a->dump_s->f))) {
        fprintf(stderr, "kvmill " CMD ": --dump-signals %s: write failed: %s\n", a->dump,
                errno ? strerror(errno) : "stream error");
        rc = 1;
    }
    /* in place now: the signals cost most of the work, and --signals reuses them if what follows fails */
    if (!rc && kvm_cli_staged_close(CMD, "dump-signals", a->dump_s, 1)) rc = 1;
    if (!rc) {
        printf("layer entropy (nats):");
        for (int l = 0; l < m->cfg.n_layers; l++)
            printf(" %.4f", sig->entropy[l]);
        if (sig->has_sculpt) {
            printf("\nsculpt cosine per layer:");
            for (int l = 0; l < m->cfg.n_layers; l++) printf(" %.4f", sig->sculpt_cosine[l]);
        }
        if (sig->has_kvzip) {
            printf("\nkvzip cosine per layer:");
            for (int l = 0; l < m->cfg.n_layers; l++) printf(" %.4f", sig->kvzip_cosine[l]);
        }
        kvm_polykv_score_sculpt_opts(a->sculpt || a->kvzip ? &a->so : NULL);
        kvm_polykv_build_dump_dir(a->cand, a->model_id.b);
        printf("\ncandidates on %d calibration document%s (%d window%s) at B = %lld, b_min = %lld:\n", ds->n,
               kvm_plural(ds->n, "", "s"), nd, kvm_plural(nd, "", "s"),
               (long long)a->B, (long long)a->b_min);
        if (kvm_polykv_build_best_grouped(docs, nd, doc_of, sig, a->B, a->b_min, a->sel, a->alloc, (int)a->refine,
                                          stdout, &best)) {
            fprintf(stderr, "kvmill " CMD ": %s\n", kvm_cli_errmsg(CMD));
            rc = 1;
        }
    }
    if (!rc) {
        kvm_strategy_set_model(best, a->model_id.b); /* used on another model, the file is refused */
        kvm_strategy_print(best, stdout);
        if (kvm_strategy_write_stream(best, a->out_f, a->out)) {
            fprintf(stderr, "kvmill " CMD ": --out %s\n", kvm_cli_errmsg(CMD));
            rc = 1;
        }
    }
    kvm_strategy_free(&best);
    kvm_polykv_signals_free(&sig);
    for (int i = 0; docs && i < nw; i++)
        kvm_eval_doc_free(&docs[i]);
    free(docs);
    free(doc_of);
    return rc;
}

int kvm_cmd_calibrate(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) /* --config: calibration through the pipeline stages */
        if (!strcmp(argv[i], "--config") || !strncmp(argv[i], "--config=", 9)) return kvm_cmd_calibrate_pipeline(argc, argv);
    kvm_cli_opt opts[] = {
        {"config", 1,
         "run through the stage processes with this pipeline configuration; then only --docs, --out, "
         "--store, --layer-alloc, --sculpt, --kvzip and --phases apply (overriding its [calibrate] keys; "
         "the rest comes from the config)",
         NULL},
        /* listed here, where `calibrate --help` is answered: only --config's text named it */
        {"store", 1, "with --config: the LMDB store folder the strategy is stored in (overrides [store] path)", NULL},
        {"model", 1, KVM_CLI_MODEL_HELP, NULL},
        {"tokenizer", 1, "tokenizer (default: a GGUF model's own, else beside the model)", NULL},
        {"docs", 1,
         "calibration documents: a folder of *.txt, a file, or a comma-separated list (with --config: a corpus, as "
         "kvmill run takes it, a folder of *.txt or a .jsonl file)",
         NULL},
        {"budget", 1, "average budget B per layer (entries per KV head); layers sum to L*B", NULL},
        {"context", 1, "context tokens N, BOS included (default 384)", NULL},
        {"continuation", 1, "continuation tokens T (default 64)", NULL},
        {"select", 1, "only heterogeneous strategies with this pattern choice: cosine|ppl (default: all candidates)",
         NULL},
        {"layer-alloc", 1, "only this PolyKV layer-budget allocation: entropy|ppl|uniform (default: all candidates)",
         NULL},
        {"alloc", 1, KVM_CLI_DEPRECATED "layer-alloc (KVSculpt's own alloc is --sculpt-opts alloc=...)", NULL},
        {"bmin", 1, "floor of every layer's budget (default max(1, B/4))", NULL},
        {"refine", 1, "then refine the best by coordinate descent on calibration KL, at most N rounds (default 0)",
         NULL},
        {"windows", 1, "context+continuation windows per document, evenly spaced (default 1: the first N+T tokens)",
         NULL},
        {"dump-signals", 1, "write every calibration signal as CSV to this file", NULL},
        {"signals", 1,
         "reuse the signals an earlier calibrate wrote with --dump-signals instead of measuring them "
         "(same model, documents, context, continuation and windows: the file cannot tell; its budget "
         "and phases must be this run's); only --sculpt / --kvzip signals it lacks, or that it records "
         "with other --sculpt-opts (or none), are measured",
         NULL},
        {"phases", 1,
         "signals measured in: both (prefill and decode, default; each decode-phase run replays the "
         "compressed layer token by token and carries it through the model in one batched call) or "
         "prefill (decode patterns = prefill patterns; about half the time)",
         NULL},
        {"sculpt", 0,
         "add KVSculpt distillation to the per-layer design space (its signals are measured and any "
         "layer may be routed to it)",
         NULL},
        {"kvzip", 0,
         "add KVzip scoring (each entry's largest attention from the reconstruction queries, top "
         "entries kept) to the per-layer design space as a pattern of its own",
         NULL},
        {"sculpt-opts", 1,
         "KVSculpt settings for those layers (and the kvzip layers' retain, queries, query_source), "
         "name=value,... with the names of kvmill sculpt --help and the [compress] keys (e.g. "
         "iterations=10,alloc=head)",
         NULL},
        {"out", 1, "write the strategy's canonical encoding to this file", NULL},
        {"dump-candidates", 1,
         "also write every candidate strategy the builder scores to this existing folder, as "
         "NAME.bin (e.g. cosine_ppl_heads.bin), for held-out comparisons",
         NULL},
        {"device", 1,
         "cpu or cuda:N: the KVSculpt solver's device for --sculpt layers; the prefill and the signals "
         "run on the CPU (default cpu)",
         NULL},
        {"threads", 1,
         "compute threads: the CPU kernels' (default: every CPU the process may use: its affinity mask and cgroup CPU "
         "quota) and KVSculpt's solver threads "
         "(default 1; --sculpt-opts threads= overrides the latter)",
         NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse(CMD, "PolyKV calibration: signals per layer/phase/pattern, then the best per-layer strategy.",
                      argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    calib_args a = {.sel = -1,
                    .alloc = -1,
                    .windows = 1,
                    .out = kvm_cli_get(opts, "out"),
                    .dump = kvm_cli_get(opts, "dump-signals"),
                    .cand = kvm_cli_get(opts, "dump-candidates"),
                    .reuse = kvm_cli_get(opts, "signals"),
                    .sculpt = kvm_cli_get(opts, "sculpt") != NULL,
                    .kvzip = kvm_cli_get(opts, "kvzip") != NULL,
                    .decode = KVM_POLYKV_DECODE_BATCHED,
                    .so = kvm_sculpt_opts_default()};
    if (kvm_cli_get(opts, "store")) { /* in the table for the help only: this calibration stores nothing */
        fprintf(stderr, "kvmill " CMD ": --store applies with --config only (without it the strategy goes to --out)\n");
        return 2;
    }
    const char *model_path = kvm_cli_get(opts, "model"), *docs_s = kvm_cli_get(opts, "docs"), *s;
    if (!model_path || !docs_s || !kvm_cli_get(opts, "budget") || !a.out) {
        fprintf(stderr, "kvmill " CMD ": --model, --docs, --budget and --out are required\n");
        return 2;
    }
    if (kvm_cli_check_out(CMD, "out", a.out) || kvm_cli_check_out(CMD, "dump-signals", a.dump)) return 2;
    if (a.dump && !strcmp(a.dump, a.out)) { /* both written in turn, the strategy over the signals */
        fprintf(stderr, "kvmill " CMD ": --dump-signals and --out name the same file %s; name two files\n", a.out);
        return 2;
    }
    for (int i = 0; i < 2; i++) /* written over the model, a document or --signals, that input was lost */
        if (kvm_cli_check_out_model(CMD, i ? "dump-signals" : "out", i ? a.dump : a.out, model_path,
                                    kvm_cli_get(opts, "tokenizer"), "--docs", docs_s) ||
            kvm_cli_check_out_inputs(CMD, i ? "dump-signals" : "out", i ? a.dump : a.out,
                                     (const char *const[]){"--signals"}, (const char *const[]){a.reuse}, 1))
            return 2;
    struct stat sb;
    if (a.cand && (stat(a.cand, &sb) != 0 || !S_ISDIR(sb.st_mode) || access(a.cand, W_OK) != 0)) {
        fprintf(stderr, "kvmill " CMD ": --dump-candidates %s: not a writable folder\n", a.cand);
        return 2;
    }
    if (kvm_cli_int(CMD, "budget", kvm_cli_get(opts, "budget"), 1, INT32_MAX, &a.B)) return 2;
    a.b_min = a.B / 4 > 1 ? a.B / 4 : 1;
    if ((s = kvm_cli_get(opts, "bmin")) && kvm_cli_int(CMD, "bmin", s, 1, INT32_MAX, &a.b_min)) return 2;
    if ((s = kvm_cli_get(opts, "refine")) && kvm_cli_int(CMD, "refine", s, 0, 1000, &a.refine)) return 2;
    if ((s = kvm_cli_get(opts, "windows")) && kvm_cli_int(CMD, "windows", s, 1, 64, &a.windows)) return 2;
    if (a.b_min > a.B) {
        fprintf(stderr, "kvmill " CMD ": --bmin %lld × L layers exceeds the total budget B × L = %lld × L\n",
                (long long)a.b_min, (long long)a.B);
        return 2;
    }
    if ((s = kvm_cli_get(opts, "select"))) {
        kvm_polykv_select v;
        if (kvm_polykv_select_parse(s, &v)) {
            fprintf(stderr, "kvmill " CMD ": --select: %s\n", kvm_errmsg());
            return 2;
        }
        a.sel = (int)v;
    }
    if ((s = kvm_cli_get(opts, "layer-alloc")) || (s = kvm_cli_get(opts, "alloc"))) {
        kvm_polykv_alloc v;
        if (kvm_polykv_alloc_parse(s, &v)) {
            fprintf(stderr, "kvmill " CMD ": --layer-alloc: %s\n", kvm_errmsg());
            return 2;
        }
        a.alloc = (int)v;
    }
    if ((s = kvm_cli_get(opts, "phases"))) {
        if (strcmp(s, "both") && strcmp(s, "prefill")) {
            fprintf(stderr, "kvmill " CMD ": --phases '%s' is not both or prefill\n", s);
            return 2;
        }
        a.decode = !strcmp(s, "both") ? KVM_POLYKV_DECODE_BATCHED : KVM_POLYKV_DECODE_NONE;
    }
    if ((s = kvm_cli_get(opts, "threads")) && kvm_sculpt_opts_set(&a.so, "threads", s)) {
        fprintf(stderr, "kvmill " CMD ": --threads: %s\n", kvm_errmsg());
        return 2;
    }
    /* --device is the solver's (the sculpt table's `device`, refused now where there is no such
     * device; --sculpt-opts device= overrides it): the signals need the host forward's hooks,
     * so the model runs on the CPU */
    const char *dev = kvm_cli_get(opts, "device");
    if (dev && kvm_sculpt_opts_set(&a.so, "device", dev)) {
        fprintf(stderr, "kvmill " CMD ": %s\n", kvm_errmsg());
        return 2;
    }
    if ((s = kvm_cli_get(opts, "sculpt-opts"))) {
        if (!a.sculpt && !a.kvzip) {
            fprintf(stderr, "kvmill " CMD ": --sculpt-opts needs --sculpt or --kvzip\n");
            return 2;
        }
        if (kvm_cli_list_check(CMD, "sculpt-opts", s, 0) < 0) return 2; /* "a=1,,b=2": an item dropped unsaid */
        /* "retain=8,retain=16": the parser keeps the last, and the first was dropped unsaid. An
         * item over --threads or --device is no repeat: the list overrides those flags (above) */
        if (kvm_sculpt_opts_check_repeats(s, ",")) {
            fprintf(stderr, "kvmill " CMD ": --sculpt-opts '%s': %s\n", s, kvm_errmsg());
            return 2;
        }
        const char *size = kvm_sculpt_opts_find_size(s, ",");
        if (size) { /* each layer is distilled at its own budget: the option was ignored */
            fprintf(stderr,
                    "kvmill " CMD ": --sculpt-opts: '%.*s' sizes the cache, and each sculpt or kvzip layer is "
                    "sized by the strategy's per-layer budget (from --budget); remove it\n",
                    (int)strcspn(size, ","), size);
            return 2;
        }
        if (kvm_sculpt_opts_parse(&a.so, s) || kvm_sculpt_opts_check_combination(&a.so)) {
            fprintf(stderr, "kvmill " CMD ": --sculpt-opts: %s\n", kvm_errmsg());
            return 2;
        }
        if (a.so.on_policy) { /* every candidate's distilled layers refused it after the signals (exit 1) */
            fprintf(stderr, "kvmill " CMD ": --sculpt-opts: on_policy fits every layer in order over the layers below "
                            "compressed, which a PolyKV strategy's per-layer methods do not do: remove it\n");
            return 2;
        }
        kvm_sculpt_opts z = a.so; /* --kvzip alone: only kvzip layers read them */
        z.mode = KVM_SCULPT_KVZIP;
        char names[512];
        if (!a.sculpt && kvm_sculpt_opts_unused(&z, s, ",", names, sizeof names) > 0)
            fprintf(stderr, "kvmill " CMD ": --sculpt-opts: note: %s not read by kvzip layers (no --sculpt); ignored\n",
                    names);
    }
    if (cmd_eval_lengths(CMD, kvm_cli_get(opts, "context"), kvm_cli_get(opts, "continuation"), &a.N, &a.T)) return 2;
    /* as eval refuses --budget >= --context: every pattern would keep every entry, all signals
     * would tie at KL 0 and the "best" strategy would be an arbitrary pick */
    if (a.B >= a.N) {
        fprintf(stderr, "kvmill " CMD ": --budget %lld is not below --context %lld: every pattern would keep the whole "
                        "context and the calibration could not tell them apart; lower --budget\n", (long long)a.B,
                (long long)a.N);
        return 2;
    }
    if (a.cand && check_candidates(&a, model_path, kvm_cli_get(opts, "tokenizer"), docs_s)) return 2;
    const kvm_kernels *k;
    if (kvm_cli_setup_device(CMD, "cpu", kvm_cli_get(opts, "threads"), &k)) return 2;
    if (a.so.cuda)
        fprintf(stderr, "kvmill " CMD ": the prefill and the signals run on the CPU (the host forward's hooks have no "
                        "CUDA forward yet); the KVSculpt solver on cuda:%d\n", a.so.cuda_device);
    cmd_eval_docset docs;
    int rc = cmd_eval_docs_list(CMD, docs_s, &docs);
    if (rc) return rc;
    kvm_model *m = NULL;
    kvm_tokenizer *tok = NULL;
    kvm_cli_staged out_s = {0}, dump_s = {0}; /* opened now: a FIFO without a reader was refused after the work */
    rc = kvm_cli_staged_open(CMD, "out", a.out, &out_s);
    if (!rc && a.dump) rc = kvm_cli_staged_open(CMD, "dump-signals", a.dump, &dump_s);
    if (rc) rc = 2; /* an output that cannot be opened, found before any work: a usage error as a missing folder is */
    a.out_f = out_s.f;
    a.dump_s = &dump_s;
    if (!rc) rc = kvm_cli_open_model(CMD, model_path, kvm_cli_get(opts, "tokenizer"), 1, &m, &tok); /* 2: bad file */
    if (!rc && a.N + a.T > kvm_model_window(&m->cfg)) {
        fprintf(stderr, "kvmill " CMD ": context %lld + continuation %lld exceeds the model's window of %d tokens\n",
                (long long)a.N, (long long)a.T, kvm_model_window(&m->cfg));
        rc = 2;
    }
    if (!rc) rc = check_repeat(m, tok, &a);
    char need[128];
    snprintf(need, sizeof need, "context %lld + continuation %lld (--context, --continuation)", (long long)a.N,
             (long long)a.T);
    if (!rc) rc = cmd_eval_docs_check(CMD, tok, NULL, &docs, a.N + a.T, a.N + a.T, need); /* before any prefill */
    if (!rc) /* each distinct sample once: the ids calibration reads (all of them with --windows, which reach the end)
              */
        rc = cmd_eval_docs_dedup(CMD, tok, NULL, &docs, a.windows > 1 ? 0 : a.N + a.T, "calibrating on it once");
    if (!rc && kvm_store_hash_file(model_path, &a.model_id)) { /* read a moment ago: the machine failed */
        fprintf(stderr, "kvmill " CMD ": --model %s: %s\n", model_path, kvm_errmsg());
        rc = 1;
    }
    if (!rc) rc = calibrate(m, k, tok, &docs, &a);
    if (kvm_cli_staged_close(CMD, "dump-signals", &dump_s, rc == 0)) rc = 1;
    if (kvm_cli_staged_close(CMD, "out", &out_s, rc == 0)) rc = 1;
    if (!rc) printf("wrote %s\n", a.out);
    cmd_eval_docs_free(&docs);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return rc;
}
