/* cmd_calibrate_pipeline.c: `kvmill calibrate --config FILE --docs DIR [--out FILE]`: PolyKV
 * calibration run through the stage processes (kvmill-signals per document, then
 * kvmill-strategy over all of them); the strategy is stored under the model id, where
 * `kvmill run` with [compress] method = polykv finds it, and optionally written to a file. */
#include "orchestrator/kvm_cli.h"
#include "common/kvm_signal.h"
#include "model/kvm_model_window.h"
#include "orchestrator/kvm_cli_model.h"
#include "compress/polykv/kvm_polykv.h"
#include "pipeline/kvm_docdedup.h"
#include "pipeline/kvm_chatcfg.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_corpus.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_orch.h"
#include "pipeline/kvm_worker.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "store/kvm_store.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Reads the stored strategy back, prints it and writes it to out_f (--out `out`, opened before
 * the calibration; NULL: none) with the model's id, which the stored record (keyed by it) does
 * not carry. */
static int report(const kvm_config *cfg, FILE *out_f, const char *out)
{
    kvm_store *st = NULL;
    kvm_store_opts so = {.read_only = 1};
    kvm_store_id mid;
    uint8_t *buf = NULL;
    size_t len = 0;
    kvm_strategy *s = NULL;
    int rc = kvm_store_open(kvm_config_str(cfg, "store", "path"), &so, &st);
    if (!rc) rc = kvm_store_model_id(st, kvm_config_str(cfg, "model", "path"), &mid);
    if (!rc) rc = kvm_store_get_strategy(st, &mid, kvm_config_str(cfg, "compress", "strategy"), &buf, &len);
    if (!rc) rc = kvm_strategy_decode(buf, len, &s);
    if (!rc) {
        char hex[65];
        kvm_strategy_print(s, stdout);
        printf("stored strategy '%s' for model %s in %s\n", kvm_config_str(cfg, "compress", "strategy"),
               kvm_store_id_hex(&mid, hex), kvm_config_str(cfg, "store", "path"));
    }
    if (!rc && out_f) {
        kvm_strategy_set_model(s, mid.b); /* the store's key holds it; the file must carry it (KVST v3) */
        if ((rc = kvm_strategy_write_stream(s, out_f, out)) == 0) printf("wrote %s\n", out);
    }
    if (rc) kvm_cli_refuse("calibrate", "%s\n", kvm_cli_errmsg("calibrate"));
    kvm_strategy_free(&s);
    free(buf);
    kvm_store_close(&st);
    return rc ? 1 : 0;
}

static volatile sig_atomic_t late_signal; /* a SIGINT or SIGTERM after the orchestrator ended */

static void on_late_signal(int sig) { late_signal = sig; }

/* What an interrupted calibration left: README, interrupted commands say which output was not
 * written. stored: 1 when the strategy is in the store all the same. */
static void say_interrupted(const kvm_config *cfg, const char *out, int stored)
{
    char outs[4200] = "";
    if (out) snprintf(outs, sizeof outs, ", --out %s not written", out);
    if (stored)
        fprintf(stderr, "kvmill calibrate: interrupted: strategy '%s' was stored in %s before the interrupt%s\n",
                kvm_config_str(cfg, "compress", "strategy"), kvm_config_str(cfg, "store", "path"), outs);
    else
        fprintf(stderr, "kvmill calibrate: interrupted: no strategy stored%s\n", outs);
}

/* Calibrates on each distinct document of the loaded corpus once (kvm_docdedup_find, as calibrate
 * without --config does): the ids a job carries to the signals stage (the context and the
 * continuation after it, at most n_keep) are hashed as the store hashes documents; a repeat is
 * named on stderr and dropped from the corpus, which keeps its first. Returns 0, or 1 after
 * saying why (out of memory). */
static int drop_repeats(kvm_corpus *c, int64_t n_keep)
{
    kvm_store_id *hash = calloc((size_t)c->n, sizeof *hash);
    int64_t *dup_of = calloc((size_t)c->n, sizeof *dup_of);
    const char **names = calloc((size_t)c->n, sizeof *names);
    int rc = hash && dup_of && names ? 0 : kvm_err(KVM_ENOMEM, "out of memory");
    for (int64_t i = 0; rc == 0 && i < c->n; i++) {
        const kvm_doc *d = &c->docs[i];
        names[i] = d->path ? d->path : d->name; /* a folder's file, or a JSON line's id */
        rc = kvm_store_doc_hash(d->tokens, d->n_original < n_keep ? d->n_original : n_keep, &hash[i]);
    }
    if (rc == 0 && kvm_docdedup_find("calibrate", "calibrating on it once", hash, names, c->n, stderr, dup_of) < 0)
        rc = 1;
    int64_t kept = 0;
    for (int64_t i = 0; rc == 0 && i < c->n; i++) {
        kvm_doc *d = &c->docs[i];
        if (dup_of[i] >= 0) { /* what kvm_corpus_free frees of a document */
            free(d->name);
            free(d->path);
            free(d->text);
            free(d->tokens);
            continue;
        }
        c->docs[kept++] = *d;
    }
    if (rc == 0) c->n = kept;
    free(hash);
    free(dup_of);
    free(names);
    if (rc) kvm_cli_refuse("calibrate", "%s\n", kvm_cli_errmsg("calibrate"));
    return rc ? 1 : 0;
}

/* The flags that have a [calibrate] key override it, as flags override config keys elsewhere;
 * the value is checked like the key's, naming the flag. Returns 0, or 2 after saying why. */
static int flags_override(const kvm_cli_opt *opts, kvm_config *cfg)
{
    static const struct {
        const char *flag, *key; /* flag name, [calibrate] key */
        int is_switch;          /* 1: a flag without a value, setting the key to true */
    } map[] = {{"layer-alloc", "layer_alloc", 0}, {"alloc", "layer_alloc", 0}, {"sculpt", "sculpt", 1},
               {"kvzip", "kvzip", 1},             {"phases", "phases", 0}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        const char *v = kvm_cli_get(opts, map[i].flag);
        if (!v) continue;
        kvm_polykv_alloc a; /* the key also takes "all", which the flag (one allocation) does not */
        if ((!strcmp(map[i].key, "layer_alloc") && kvm_polykv_alloc_parse(v, &a)) ||
            kvm_config_set(cfg, "calibrate", map[i].key, map[i].is_switch ? "true" : v)) {
            kvm_cli_refuse("calibrate", "--%s: %s\n", map[i].flag, kvm_errmsg());
            return 2;
        }
    }
    return 0;
}

/* [calibrate] sculpt and kvzip layers take the [compress] sculpt settings in the signals stage: a
 * combination the solver refuses (queries = 0 with retain = 0, a query_source share of no query)
 * failed every document there (exit 1), which calibrate without --config refuses at start.
 * Returns 0, or 2 after saying why. */
static int check_distilled(const kvm_config *cfg)
{
    static const struct {
        const char *key;
        kvm_sculpt_mode mode;
    } kinds[] = {{"sculpt", KVM_SCULPT_FULL}, {"kvzip", KVM_SCULPT_KVZIP}};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        kvm_sculpt_opts so;
        if (!kvm_config_bool(cfg, "calibrate", kinds[i].key)) continue;
        if (kvm_worker_sculpt_opts(cfg, kinds[i].mode, &so) || kvm_sculpt_opts_check_combination(&so)) {
            kvm_cli_refuse("calibrate", "%s: [calibrate] %s = true: its layers' [compress] settings: %s\n",
                           kvm_config_path(cfg), kinds[i].key, kvm_errmsg());
            return 2;
        }
    }
    return 0;
}

int kvm_cmd_calibrate_pipeline(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"config", 1, "pipeline configuration: model, context, [eval] continuation, [compress] budget and strategy, store", NULL},
        {"docs", 1, "calibration documents: a folder of *.txt or a .jsonl file", NULL},
        {"out", 1, "also write the strategy's canonical encoding to this file", NULL},
        {"store", 1, "LMDB store directory (overrides [store] path)", NULL},
        {"layer-alloc", 1, "only this PolyKV layer-budget allocation: entropy|ppl|uniform (overrides [calibrate] "
                           "layer_alloc)", NULL},
        {"alloc", 1, KVM_CLI_DEPRECATED "layer-alloc (KVSculpt's own alloc is [compress] alloc)", NULL},
        {"sculpt", 0, "add KVSculpt distillation to the per-layer design space (sets [calibrate] sculpt)", NULL},
        {"kvzip", 0, "add KVzip scoring to the per-layer design space (sets [calibrate] kvzip)", NULL},
        {"phases", 1, "signals measured in: both or prefill (overrides [calibrate] phases)", NULL},
        {NULL, 0, NULL, NULL}};
    /* options of calibrate without --config: "unknown option" (and a --help without them) left the
     * user guessing where the setting went; each is named with its config key, or as not applying */
    static const struct {
        const char *flag, *key;
    } own[] = {{"model", "[model] path"},
               {"tokenizer", "[model] tokenizer"},
               {"budget", "[compress] budget"},
               {"context", "[model] context"},
               {"continuation", "[eval] continuation"},
               {"sculpt-opts", "the [compress] sculpt keys"},
               {"device", "[stages] prefill_devices and compress_devices"},
               {"threads", "[stages] threads"},
               {"select", NULL},
               {"bmin", NULL},
               {"refine", NULL},
               {"windows", NULL},
               {"dump-signals", NULL},
               {"signals", NULL},
               {"dump-candidates", NULL}};
    int asks_help = 0;
    for (int i = 1; i < argc; i++)
        asks_help |= !strcmp(argv[i], "--help") || !strcmp(argv[i], "-h");
    for (int i = 1; i < argc && !asks_help; i++)
        for (size_t j = 0; j < sizeof own / sizeof own[0]; j++) {
            size_t fl = strlen(own[j].flag);
            if (strncmp(argv[i], "--", 2) || strncmp(argv[i] + 2, own[j].flag, fl) ||
                (argv[i][2 + fl] && argv[i][2 + fl] != '='))
                continue;
            if (own[j].key)
                fprintf(stderr, "kvmill calibrate: --%s does not combine with --config: set %s in the config file\n",
                        own[j].flag, own[j].key);
            else
                fprintf(stderr,
                        "kvmill calibrate: --%s is an option of calibrate without --config (one process, "
                        "--model ...); it has no --config counterpart\n",
                        own[j].flag);
            return 2;
        }
    int n_pos, help;
    if (kvm_cli_parse("calibrate", "PolyKV calibration through the stage processes; stores the strategy.", argc, argv,
                      opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *docs = kvm_cli_get(opts, "docs");
    if (!docs) return fprintf(stderr, "kvmill calibrate: --docs is required\n"), 2;
    kvm_config *cfg;
    if (kvm_config_load(kvm_cli_get(opts, "config"), &cfg))
        return fprintf(stderr, "kvmill calibrate: --config: %s\n", kvm_cli_errmsg("calibrate")), 2;
    kvm_cli_log_config("calibrate", "orchestrator", cfg); /* refusals from here on follow [run] log_format */
    int status = 2, handlers = 0; /* handlers: 1 once on_late_signal is installed (old_int, old_term, old_hup) */
    struct sigaction old_int, old_term, old_hup;
    kvm_cli_staged out_s = {0}; /* --out */
    kvm_model *m = NULL;
    kvm_tokenizer *tok = NULL;
    char *chat_open = NULL, *chat_close = NULL;
    kvm_corpus *corpus = NULL;
    const char *store = kvm_cli_get(opts, "store"), *tp = kvm_config_str(cfg, "model", "tokenizer");
    int64_t ctx = kvm_config_int(cfg, "model", "context"), cont = kvm_config_int(cfg, "eval", "continuation");
    if (store && kvm_config_set(cfg, "store", "path", store)) {
        kvm_cli_refuse("calibrate", "--store: %s\n", kvm_errmsg());
        goto done;
    }
    if (flags_override(opts, cfg)) goto done;
    /* the name the strategy is stored under: an empty one was found only when the strategy worker
     * stored it, and every document then timed out and was requeued, the command never ending
     * (run refuses it at start) */
    size_t sn = strlen(kvm_config_str(cfg, "compress", "strategy"));
    if (sn == 0 || sn > KVM_STORE_MAX_NAME) {
        kvm_cli_refuse("calibrate",
                       "%s: [compress] strategy: the name to store the strategy under must be 1 to %d bytes "
                       "(it is %zu)\n",
                       kvm_config_path(cfg), KVM_STORE_MAX_NAME, sn);
        goto done;
    }
    /* settings that do not go together are refused as run refuses them (the same config runs
     * next): calibrate took, say, polykv with target_kl and stored a strategy run then refused;
     * and a setting the jobs cannot carry failed every document */
    if (kvm_jobcfg_check(cfg) || kvm_jobcfg_check_text(cfg)) {
        kvm_cli_refuse("calibrate", "%s\n", kvm_errmsg());
        goto done;
    }
    if (check_distilled(cfg)) goto done;
    if (kvm_cli_check_run_bind("calibrate", cfg, 0)) goto done; /* its workers connect as run's do */
    /* the strategy is stored for method polykv, which `kvmill run` with another method never reads:
     * a copy of default.ini with a budget added calibrated, stored, and then ran sculpt unsaid */
    if (strcmp(kvm_config_str(cfg, "compress", "method"), "polykv"))
        fprintf(stderr,
                "kvmill calibrate: note: %s: [compress] method = %s: kvmill run with this config does not use the "
                "strategy calibrated now (set method = polykv for that)\n",
                kvm_config_path(cfg), kvm_config_str(cfg, "compress", "method"));
    /* --out is written after the whole calibration: a folder, a missing folder or an input (the
     * config, a document, the model) was found only then (exit 1), or overwritten */
    const char *out = kvm_cli_get(opts, "out");
    if (kvm_cli_check_out("calibrate", "out", out) ||
        kvm_cli_check_out_model("calibrate", "out", out, kvm_config_str(cfg, "model", "path"), *tp ? tp : NULL, "--docs",
                                docs) ||
        kvm_cli_check_out_inputs("calibrate", "out", out, (const char *const[]){"--config"},
                                 (const char *const[]){kvm_cli_get(opts, "config")}, 1))
        goto done;
    if (kvm_config_int(cfg, "compress", "budget") <= 0) {
        kvm_cli_refuse("calibrate", "%s: set [compress] budget, the average entries per KV head to calibrate for\n",
                kvm_config_path(cfg));
        goto done;
    }
    if (out && kvm_cli_staged_open("calibrate", "out", out, &out_s)) /* now: a FIFO without a reader, a file */
        goto done; /* that cannot be created, were refused after the whole calibration (status 2) */
    if ((status = kvm_cli_open_model_config("calibrate", cfg, 1, &m, &tok)))
        goto done; /* 2: a bad file, 1: out of memory or I/O */
    status = 2; /* the checks below refuse bad settings and documents */
    if (ctx + cont > kvm_model_window(&m->cfg)) {
        kvm_cli_refuse("calibrate", "context %lld + continuation %lld exceeds the model's window of %d tokens\n",
                       (long long)ctx, (long long)cont, kvm_model_window(&m->cfg));
        goto done;
    }
    if (kvm_corpus_read(docs, &corpus)) {
        /* a document file or a comma-separated list, which --docs takes without --config, was
         * refused as "corpus doc.txt: expected a folder of *.txt or a .jsonl file", or "corpus
         * a.txt,b.txt: No such file or directory", naming neither --docs nor why */
        struct stat dst;
        size_t dl = strlen(docs);
        int corpus_like = (!stat(docs, &dst) && S_ISDIR(dst.st_mode)) || (dl > 6 && !strcmp(docs + dl - 6, ".jsonl"));
        if (corpus_like)
            kvm_cli_refuse("calibrate", "%s\n", kvm_cli_errmsg("calibrate"));
        else
            kvm_cli_refuse("calibrate",
                           "--docs %s: with --config, --docs is a corpus as kvmill run takes it (a folder of *.txt or "
                           "a .jsonl file; put single documents in a folder): %s\n",
                           docs, kvm_cli_errmsg("calibrate"));
        goto done;
    }
    if (kvm_chatcfg_frame(cfg, tok, &chat_open, &chat_close)) { /* calibrate on documents framed as run frames them */
        kvm_cli_refuse("calibrate", "%s\n", kvm_errmsg());
        status = 2;
        goto done;
    }
    if (kvm_jobcfg_check_repeat(cfg, tok, kvm_model_window(&m->cfg), 1)) { /* every document failed (exit 1) */
        kvm_cli_refuse("calibrate", "%s\n", kvm_errmsg());
        goto done;
    }
    corpus->frame = chat_open;
    for (int64_t i = 0; i < corpus->n; i++) {
        kvm_doc *d = &corpus->docs[i];
        /* calibration corpora are small: every document is loaded and kept, continuation included */
        if (kvm_corpus_load(corpus, d, tok, m->cfg.vocab_size, m->cfg.bos_id, ctx, ctx + cont)) {
            kvm_cli_refuse("calibrate", "%s\n", kvm_cli_errmsg("calibrate"));
            goto done;
        }
        /* signals are measured on the continuation after the context: a shorter one than [eval]
         * continuation was taken as it was (1 token: every pattern at KL 0, the first one stored
         * as the model's strategy), where calibrate without --config refuses the document */
        if (d->n_original < ctx + cont) {
            kvm_cli_refuse("calibrate",
                           "--docs %s: document %s has %lld tokens, fewer than [model] context %lld + [eval] "
                           "continuation %lld (each pattern is scored on that continuation); lower them, or leave "
                           "the document out\n",
                           docs, d->name, (long long)d->n_original, (long long)ctx, (long long)cont);
            goto done;
        }
    }
    if ((status = drop_repeats(corpus, ctx + cont))) goto done;
    kvm_model_close(&m);
    char self[4096];
    ssize_t r = readlink("/proc/self/exe", self, sizeof self - 1);
    self[r > 0 ? r : 0] = '\0';
    kvm_orch_summary sum;
    /* a Ctrl-C or SIGTERM once the orchestrator has ended (its handler is gone by then: it
     * killed the command silently, the strategy stored) is noted and honoured before --out */
    struct sigaction sa = {.sa_handler = on_late_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    kvm_signal_hup(on_late_signal, &old_hup); /* a closed terminal or a daemon's hang-up: as SIGTERM */
    handlers = 1;
    late_signal = 0;
    status = kvm_orch_calibrate(cfg, corpus, self, &sum);
    if (status == 130) /* the orchestrator put the strategy record back (or says why it could not) */
        say_interrupted(cfg, out, sum.strategy_stored);
    if (status == 0) {
        printf("calibration: %lld document%s, %lld failed, %.2f s (signals %.2f s, strategy %.2f s of compute)\n",
               (long long)sum.compressed, kvm_plural(sum.compressed, "", "s"), (long long)sum.failed, sum.seconds, sum.stage_ms[2] / 1000.0,
               sum.stage_ms[3] / 1000.0);
        status = sum.compressed > 0 ? report(cfg, out_s.f, out) : 1;
        if (sum.compressed == 0) kvm_cli_refuse("calibrate", "no calibration document succeeded\n");
        if (late_signal) { /* the strategy is stored; --out is not renamed into place */
            say_interrupted(cfg, out, 1);
            status = 130;
        }
    }
done:
    if (kvm_cli_staged_close("calibrate", "out", &out_s, status == 0 && !late_signal)) status = 1;
    if (late_signal) status = 130;
    if (handlers) {
        sigaction(SIGINT, &old_int, NULL);
        sigaction(SIGTERM, &old_term, NULL);
        sigaction(SIGHUP, &old_hup, NULL);
    }
    kvm_corpus_free(&corpus);
    free(chat_open);
    free(chat_close);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    kvm_config_free(&cfg);
    return status;
}
