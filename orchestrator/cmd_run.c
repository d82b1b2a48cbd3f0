/* cmd_run.c: `kvmill run`: compresses a corpus through the stage processes and stores the
 * caches; prints a summary whose last stdout line is machine-readable. */
#include "orchestrator/kvm_cli.h"
#include "model/kvm_model_window.h"
#include "orchestrator/kvm_cli_model.h"
#include "pipeline/kvm_chatcfg.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_corpus.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_orch.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_worker.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void self_path(char *buf, size_t n)
{
    ssize_t r = readlink("/proc/self/exe", buf, n - 1);
    buf[r > 0 ? r : 0] = '\0';
}

/* 1 when path names an existing file that is not empty and is not a counters file kvmill
 * wrote (a JSON object whose first key is "version", kvm_orch_metrics_write): --metrics
 * replaces its file, and one pointed at the store's data.mdb, the config or a document
 * destroyed it. A missing or empty file, or an earlier run's metrics, is fine. */
static int metrics_would_clobber(const char *path)
{
    struct stat st; /* only a regular file: opening a FIFO would wait for a writer */
    if (!path || !*path || stat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) return 0;
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char head[32] = {0};
    size_t n = fread(head, 1, sizeof head - 1, f);
    fclose(f);
    if (n == 0) return 0;
    size_t i = head[0] == '{' ? 1 : n;
    while (i < n && (head[i] == ' ' || head[i] == '\n' || head[i] == '\r' || head[i] == '\t')) i++;
    return i >= n || strncmp(head + i, "\"version\"", 9) != 0;
}

/* The [eval] line. A compressed document that was not truncated has no tokens after the context, so
 * its job carries no continuation and the compress stage does not evaluate it (it logs eval_skipped);
 * the rest of those not evaluated failed or measured a KL that is not finite (eval_failed). Without
 * the count, "0.00000 nats over 0 documents" read as a perfect cache. */
static void print_eval(const kvm_config *cfg, const kvm_orch_summary *s)
{
    const long long ctx = (long long)kvm_config_int(cfg, "model", "context");
    int64_t no_cont = s->compressed - s->truncated, failed = s->compressed - s->evaluated - no_cont;
    if (no_cont < 0) no_cont = 0;
    if (failed < 0) failed = 0; /* an earlier attempt's result may have been counted too */
    char why[400] = "";
    int n = 0;
    if (no_cont > 0)
        n += snprintf(why + n, sizeof why - (size_t)n,
                      "%lld not evaluated: no longer than [model] context (%lld tokens), so no [eval] continuation "
                      "follows to score",
                      (long long)no_cont, ctx);
    if (failed > 0)
        n += snprintf(why + n, sizeof why - (size_t)n,
                      "%s%lld not evaluated: the evaluation failed or its KL was not finite", n ? "; " : "",
                      (long long)failed);
    if (s->evaluated > 0)
        printf("evaluation: mean KL(full || compressed) %.5f nats over %lld document%s (continuation of %lld "
               "tokens)%s%s%s\n",
               s->kl_sum / (double)s->evaluated, (long long)s->evaluated, kvm_plural(s->evaluated, "", "s"),
               (long long)kvm_config_int(cfg, "eval", "continuation"), n ? "; " : "", why,
               n ? " (the stage logs name them)" : "");
    else
        printf("evaluation: no document evaluated (%s%s)\n", n ? why : "none was compressed by this run",
               n ? "; the stage logs name them" : "");
}

/* The documents a run cut short left unprocessed: its pending ones when a Ctrl-C or SIGTERM
 * (interrupted), a full store or a store gone or down stopped it, as their lines say; else 0. */
static int64_t not_processed(const kvm_orch_summary *s)
{
    return s->interrupted || s->store_full || s->store_down ? s->pending : 0;
}

static void print_summary(const kvm_config *cfg, const kvm_orch_summary *s, int64_t n_heads)
{
    double ratio = s->bytes_compressed > 0 ? (double)s->bytes_full / (double)s->bytes_compressed : 0;
    /* a duplicate within the corpus was skipped too, yet nothing was stored before: said apart */
    char why[160] = "already stored";
    if (s->repeated > 0)
        snprintf(why, sizeof why, "%lld already stored, %lld duplicate%s of another document in this corpus",
                 (long long)(s->skipped - s->repeated), (long long)s->repeated, kvm_plural(s->repeated, "", "s"));
    printf("documents: %lld compressed, %lld skipped (%s), %lld failed, %lld truncated to %lld tokens\n",
           (long long)s->compressed, (long long)s->skipped, why, (long long)s->failed, (long long)s->truncated,
           (long long)kvm_config_int(cfg, "model", "context"));
    if (s->compressed == 0) /* "0 full f32 KV -> 0 stored (0.00x smaller)" read as a measurement */
        printf("bytes: none stored by this run (%s), method %s\n",
               s->skipped > 0 && s->failed == 0 && !s->interrupted && !s->store_full && !s->store_down
                   ? "every document was already stored: all skipped"
                   : "no document was compressed",
               kvm_config_str(cfg, "compress", "method"));
    else if (s->bytes_unknown)
        printf("bytes: unknown (%s), method %s\n",
               s->store_down == 3 ? "the store is damaged" : "the store service holding the caches did not answer",
               kvm_config_str(cfg, "compress", "method"));
    else /* method full stores each entry's position and bias beside it: larger than the f32 KV */
        printf("bytes: %lld full f32 KV -> %lld stored (%.2fx %s), method %s\n", (long long)s->bytes_full,
               (long long)s->bytes_compressed, ratio >= 1 || ratio == 0 ? ratio : 1 / ratio,
               ratio >= 1 || ratio == 0 ? "smaller" : "larger", kvm_config_str(cfg, "compress", "method"));
    if (s->kept_full > 0) /* why a short document's cache is no smaller than its f32 KV */
        printf("kept whole: %lld document%s too short for compression to save an entry %s stored with %s full KV "
               "unchanged (a stored entry carries a position and a logit bias beside its key and value, so %s "
               "larger than %s f32 KV)\n",
               (long long)s->kept_full, kvm_plural(s->kept_full, "", "s"), kvm_plural(s->kept_full, "was", "were"),
               kvm_plural(s->kept_full, "its", "their"), kvm_plural(s->kept_full, "its cache is", "these caches are"),
               kvm_plural(s->kept_full, "its", "their"));
    printf("time: %.2f s wall; compute per stage: prefill %.2f s, compress %.2f s; %.0f tokens/s\n", s->seconds,
           s->stage_ms[0] / 1000.0, s->stage_ms[1] / 1000.0, s->seconds > 0 ? (double)s->tokens / s->seconds : 0);
    double compute = s->stage_ms[0] + s->stage_ms[1];
    printf("transport: %.3f s of ZeroMQ/MessagePack encode, decode, copy and send (%.1f%% of stage compute)\n",
           s->transport_ms / 1000.0, compute > 0 ? 100.0 * s->transport_ms / compute : 0);
    if (kvm_config_bool(cfg, "eval", "enabled")) print_eval(cfg, s);
    double target = kvm_config_float(cfg, "compress", "target_kl");
    if (target > 0 && s->entries_docs > 0 && n_heads > 0) /* the budgets the search chose */
        printf("target_kl: %g nats: budget per KV head %.1f / %.1f / %.1f (min / mean / max over %lld document%s); "
               "mean KL on the check part %.5f nats over %lld document%s (the %lld tokens after the search part)\n",
               target, (double)s->entries_min / (double)n_heads,
               (double)s->entries_sum / (double)s->entries_docs / (double)n_heads, (double)s->entries_max / (double)n_heads,
               (long long)s->entries_docs, kvm_plural(s->entries_docs, "", "s"),
               s->evaluated ? s->kl_sum / (double)s->evaluated : 0, (long long)s->evaluated,
               kvm_plural(s->evaluated, "", "s"),
               (long long)kvm_config_int(cfg, "eval", "continuation"));
    /* one line gives the count (README): a store that stopped the run is what a rerun must fix
     * first, so it is the one said when a Ctrl-C came too */
    if (s->interrupted && !s->store_full && !s->store_down)
        printf("interrupted: %lld document%s %s not processed (run again to finish: stored ones are skipped)\n",
               (long long)s->pending, kvm_plural(s->pending, "", "s"), kvm_plural(s->pending, "was", "were"));
    if (s->store_full)
        printf("store full: %lld document%s %s not processed (%s)\n", (long long)s->pending,
               kvm_plural(s->pending, "", "s"), kvm_plural(s->pending, "was", "were"),
               s->store_full == 2   ? "the store's map reached [store] map_max_mb; raise it or set cap_mb and run again"
               : s->store_full == 3 ? "the file size limit (ulimit -f) stops data.mdb from growing; raise it and run "
                                      "again"
                                    : "no space left on the store's device; free space and run again");
    if (s->store_down == 3 && !s->store_full)
        printf("store damaged: %lld document%s %s not processed (its data.mdb is damaged; restore the store from a "
               "copy, or move it aside and run again)\n",
               (long long)s->pending, kvm_plural(s->pending, "", "s"), kvm_plural(s->pending, "was", "were"));
    else if (s->store_down && !s->store_full)
        printf("store %s: %lld document%s %s not processed (%s: stored ones are skipped)\n",
               s->store_down == 2 ? "gone" : "down", (long long)s->pending, kvm_plural(s->pending, "", "s"),
               kvm_plural(s->pending, "was", "were"),
               s->store_down == 2 ? "the store folder was moved, removed or replaced, or its lock.mdb removed, while "
                                    "the run had it open; put it back and run again"
                                  : "the store service did not answer; start it and run again");
    /* through a store service the count is of this run's caches it no longer holds, whatever took
     * them (kvm_orch__sum_remote): put down to the cap, a store compact swapped in meanwhile or a
     * store rm read as a cap the store does not have */
    if (s->evicted > 0 && !s->bytes_unknown && s->kept_full < 0)
        printf("evicted: %lld cache%s written by this run %s no longer in the store service's store (evicted by its "
               "cap, [store] cap_mb, or removed since: store rm, or a store compact's copy swapped in meanwhile); "
               "bytes count the caches still stored\n",
               (long long)s->evicted, kvm_plural(s->evicted, "", "s"), kvm_plural(s->evicted, "is", "are"));
    else if (s->evicted > 0 && !s->bytes_unknown)
        printf("evicted: %lld caches by the store's cap ([store] cap_mb), %lld of them written by this run; bytes "
               "count the caches still stored\n", (long long)s->evicted, (long long)s->evicted_own);
    if (s->claimed)
        printf("claimed: %lld document%s %s being compressed by another run on this store and %s left to it\n",
               (long long)s->claimed, kvm_plural(s->claimed, "", "s"), kvm_plural(s->claimed, "was", "were"),
               kvm_plural(s->claimed, "was", "were"));
    int64_t docs = s->compressed + s->failed;
    printf("wire: %lld bytes received from prefill, %lld bytes sent to workers (%lld per document), KV as %s "
           "([run] wire_dtype)\n", (long long)s->wire_in_bytes, (long long)s->wire_out_bytes,
           (long long)(docs > 0 ? s->wire_out_bytes / docs : 0), kvm_config_str(cfg, "run", "wire_dtype"));
    printf("prefetch: at most %lld document%s %s prefilled and waiting for compress at once\n",
           (long long)s->prefetch_peak, kvm_plural(s->prefetch_peak, "", "s"), kvm_plural(s->prefetch_peak, "was", "were"));
    /* not 0: the service holding them was not asked (evictions come from the same probes) */
    char full[32] = "unknown", stored[32] = "unknown", evicted[32] = "unknown", kept[32] = "unknown";
    if (!s->bytes_unknown) {
        snprintf(full, sizeof full, "%lld", (long long)s->bytes_full);
        snprintf(stored, sizeof stored, "%lld", (long long)s->bytes_compressed);
        snprintf(evicted, sizeof evicted, "%lld", (long long)s->evicted);
    }
    if (s->kept_full >= 0) snprintf(kept, sizeof kept, "%lld", (long long)s->kept_full);
    /* fields are only appended (scripts read them by name or position); not_processed is the
     * count the "interrupted:", "store full:" or "store gone/down:" line says, 0 otherwise */
    printf("summary: compressed=%lld skipped=%lld failed=%lld truncated=%lld bytes_full=%s bytes_compressed=%s "
           "seconds=%.3f claimed=%lld evicted=%s wire_in_bytes=%lld wire_out_bytes=%lld kept_full=%s "
           "not_processed=%lld\n",
           (long long)s->compressed, (long long)s->skipped, (long long)s->failed, (long long)s->truncated, full, stored,
           s->seconds, (long long)s->claimed, evicted, (long long)s->wire_in_bytes, (long long)s->wire_out_bytes, kept,
           (long long)not_processed(s));
}

/* The refusals a run makes from the configuration alone, before any model or corpus is opened:
 * run and --dump-config share them, so that a dumped configuration is one run accepts (what
 * needs the model, [model] context against its window and the chat template, is checked by run
 * only). bind_flag: [run] bind is --bind's value (the refusal names the flag). Returns 0, or 1
 * after printing the refusal (the caller exits with status 2); prints the note that [compress]
 * budget replaces ratio. */
static int check_config(const kvm_config *cfg, int bind_flag)
{
    if (kvm_config_int(cfg, "compress", "budget") == 0 && kvm_config_float(cfg, "compress", "ratio") <= 0 &&
        strcmp(kvm_config_str(cfg, "compress", "method"), "full")) {
        kvm_cli_refuse("run", "%s: [compress] ratio = 0 and budget = 0 keep nothing: set one of them\n",
                       kvm_config_path(cfg));
        return 1;
    }
    if (kvm_cli_check_run_bind("run", cfg, bind_flag)) return 1;
    if (kvm_jobcfg_check_service_bind(cfg, 0, bind_flag ? "--bind" : "[run] bind")) {
        kvm_cli_refuse("run", "%s\n", kvm_errmsg());
        return 1;
    }
    char size_note[8400];
    if (kvm_jobcfg_size_note(cfg, size_note, sizeof size_note)) fprintf(stderr, "kvmill run: %s\n", size_note);
    if (kvm_jobcfg_check(cfg) || kvm_jobcfg_check_text(cfg)) {
        kvm_cli_refuse("run", "%s\n", kvm_cli_errmsg("run"));
        return 1;
    }
    /* the device lists' syntax: a dump run would refuse was printed as a config it accepts */
    const char *dev_keys[2][2] = {{"prefill_workers", "prefill_devices"}, {"compress_workers", "compress_devices"}};
    for (int i = 0; i < 2; i++) {
        char key[64];
        snprintf(key, sizeof key, "[stages] %s", dev_keys[i][1]);
        if (kvm_config_int(cfg, "stages", dev_keys[i][0]) > 0 &&
            kvm_stage_parse_devices(key, kvm_config_str(cfg, "stages", dev_keys[i][1]))) {
            kvm_cli_refuse("run", "%s: %s\n", kvm_config_path(cfg), kvm_errmsg());
            return 1;
        }
    }
    kvm_sculpt_opts so; /* the sculpt-family [compress] keys (query_source, ...) parse here, not in every job */
    if (kvm_worker_sculpt_opts(cfg, KVM_SCULPT_FULL, &so)) {
        kvm_cli_refuse("run", "%s: [compress]: %s\n", kvm_config_path(cfg), kvm_errmsg());
        return 1;
    }
    return 0;
}

int kvm_cmd_run(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"config", 1, "pipeline configuration (INI), e.g. configs/default.ini", NULL},
        {"corpus", 1, "a folder of *.txt documents or a .jsonl file (id + text or tokens per line)", NULL},
        {"store", 1,
         "LMDB store directory, or a store service on another host (tcp://HOST:PORT; overrides [store] path)", NULL},
        {"bind", 1,
         "tcp://HOST:PORT base external workers connect to (overrides [run] bind; off-host needs [security] keys)",
         NULL},
        {"metrics", 1,
         "counters file (JSON) kept current during the run, replaced atomically (overrides [run] metrics)", NULL},
        {"dump-config", 0,
         "print the resolved configuration and exit (refused, exit 2, where run would refuse it "
         "without opening the model)",
         NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos, help;
    char summary[1024];
    const char *methods = "";
    for (int i = 0; kvm_cfg_settings[i].section; i++)
        if (!strcmp(kvm_cfg_settings[i].section, "compress") && !strcmp(kvm_cfg_settings[i].key, "method"))
            methods = kvm_cfg_settings[i].choices;
    snprintf(summary, sizeof summary,
             "Compresses every document of a corpus and stores the caches.\n[model] path: a llama2.c checkpoint or GGUF "
             "file, or a Hugging Face folder; [compress] method: %s;\nevery setting, its unit and default: --dump-config.", methods);
    if (kvm_cli_parse("run", summary, argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *cpath = kvm_cli_get(opts, "config"), *corpus_path = kvm_cli_get(opts, "corpus");
    if (!cpath) return fprintf(stderr, "kvmill run: --config is required\n"), 2;
    kvm_config *cfg;
    if (kvm_config_load(cpath, &cfg)) return fprintf(stderr, "kvmill run: --config: %s\n", kvm_cli_errmsg("run")), 2;
    kvm_cli_log_config("run", "orchestrator", cfg); /* refusals from here on follow [run] log_format */
    const char *store = kvm_cli_get(opts, "store");
    if (store && kvm_config_set(cfg, "store", "path", store)) {
        kvm_cli_refuse("run", "--store: %s\n", kvm_errmsg());
        kvm_config_free(&cfg);
        return 2;
    }
    /* an empty value: --metrics "" wrote no metrics without a word (the key's empty = none), and
     * --bind "" was refused as "endpoint : ..."; leaving the flag out is how to say none */
    static const char *const valued[] = {"bind", "metrics"};
    for (size_t i = 0; i < sizeof valued / sizeof valued[0]; i++) {
        const char *v = kvm_cli_get(opts, valued[i]);
        if (v && !*v) {
            kvm_cli_refuse("run",
                           "--%s is empty: name the %s, or leave --%s out (the config's [run] %s then applies)\n",
                           valued[i], i ? "file to write the metrics to" : "endpoint to bind", valued[i], valued[i]);
            kvm_config_free(&cfg);
            return 2;
        }
    }
    const char *bind = kvm_cli_get(opts, "bind");
    char bind_ctl[1100], bind_data[1100]; /* the form the run binds: a value refused there named no flag */
    if (bind &&
        (kvm_config_set(cfg, "run", "bind", bind) || kvm_stage_endpoints(bind, bind_ctl, bind_data, sizeof bind_ctl))) {
        kvm_cli_refuse("run", "--bind: %s\n", kvm_errmsg());
        kvm_config_free(&cfg);
        return 2;
    }
    const char *metrics = kvm_cli_get(opts, "metrics");
    if (metrics && kvm_config_set(cfg, "run", "metrics", metrics)) {
        kvm_cli_refuse("run", "--metrics: %s\n", kvm_errmsg());
        kvm_config_free(&cfg);
        return 2;
    }
    if (!kvm_cli_get(opts, "dump-config") && kvm_cli_check_writable("run", "metrics file", kvm_config_str(cfg, "run", "metrics"))) {
        kvm_config_free(&cfg);
        return 2;
    }
    const char *mpath = kvm_config_str(cfg, "run", "metrics");
    struct stat mst; /* rename(2) put a regular file in place of a FIFO or device (as root: /dev/null) */
    if (!kvm_cli_get(opts, "dump-config") && mpath && *mpath && !stat(mpath, &mst) && !S_ISREG(mst.st_mode)) {
        kvm_cli_refuse("run",
                       "metrics file %s is not a regular file (a FIFO, socket or device): the run replaces the file "
                       "it names at each update, which would replace that; name a regular file\n",
                       mpath);
        kvm_config_free(&cfg);
        return 2;
    }
    if (!kvm_cli_get(opts, "dump-config") && metrics_would_clobber(kvm_config_str(cfg, "run", "metrics"))) {
        kvm_cli_refuse("run", "metrics file %s exists and is not a metrics file kvmill wrote: the run would replace it; "
                              "name a new file (or remove that one)\n", kvm_config_str(cfg, "run", "metrics"));
        kvm_config_free(&cfg);
        return 2;
    }
    if (check_config(cfg, bind != NULL)) { /* before --dump-config too: a dump is a config this run accepts */
        kvm_config_free(&cfg);
        return 2;
    }
    if (kvm_cli_get(opts, "dump-config")) {
        if (kvm_config_dump(cfg, stdout, stderr))
            fprintf(stderr, "kvmill run: --dump-config: values that do not fit an INI line are read from the environment "
                            "in the dump: run the export lines above before loading it as a config file\n");
        kvm_config_free(&cfg);
        return 0;
    }
    if (!corpus_path) {
        kvm_config_free(&cfg);
        return kvm_cli_refuse("run", "--corpus is required\n"), 2;
    }
    kvm_model *m = NULL;
    kvm_tokenizer *tok = NULL;
    kvm_corpus *corpus = NULL;
    char *chat_open = NULL, *chat_close = NULL;
    int status = 1;
    status = kvm_cli_open_model_config("run", cfg, 0, &m, &tok);
    if (status) goto done;
    status = 1;
    if (kvm_corpus_read(corpus_path, &corpus)) {
        kvm_cli_refuse("run", "%s\n", kvm_cli_errmsg("run"));
        status = 2;
        goto done;
    }
    int64_t ctx = kvm_config_int(cfg, "model", "context");
    if (ctx > kvm_model_window(&m->cfg)) {
        kvm_cli_refuse("run", "%s: [model] context = %lld exceeds the model's window of %d tokens\n",
                       kvm_config_path(cfg), (long long)ctx, kvm_model_window(&m->cfg));
        status = 2;
        goto done;
    }
    int64_t T1 = kvm_config_int(cfg, "eval", "continuation");
    if (kvm_config_bool(cfg, "eval", "enabled") && kvm_config_float(cfg, "compress", "target_kl") <= 0 &&
        ctx + T1 > kvm_model_window(&m->cfg)) { /* every evaluation would fail in the worker: "over 0 documents" */
        kvm_cli_refuse("run",
                       "%s: [eval] enabled scores the %lld tokens after the context ([eval] continuation): "
                       "context %lld + %lld exceeds the model's window of %d tokens\n",
                       kvm_config_path(cfg), (long long)T1, (long long)ctx, (long long)T1, kvm_model_window(&m->cfg));
        status = 2;
        goto done;
    }
    int64_t T2 = 2 * T1;
    if (kvm_config_float(cfg, "compress", "target_kl") > 0 && ctx + T2 > kvm_model_window(&m->cfg)) {
        kvm_cli_refuse("run",
                       "%s: [compress] target_kl searches on the %lld tokens after the context (2 x [eval] "
                       "continuation): context %lld + %lld exceeds the model's window of %d tokens\n",
                       kvm_config_path(cfg), (long long)T2, (long long)ctx, (long long)T2, kvm_model_window(&m->cfg));
        status = 2;
        goto done;
    }
    if (kvm_chatcfg_frame(cfg, tok, &chat_open, &chat_close)) { /* [model] chat: documents open the user's turn */
        kvm_cli_refuse("run", "%s\n", kvm_errmsg());
        status = 2;
        goto done;
    }
    if (kvm_jobcfg_check_repeat(cfg, tok, kvm_model_window(&m->cfg), 0)) { /* every document failed (exit 1) */
        kvm_cli_refuse("run", "%s\n", kvm_errmsg());
        status = 2;
        goto done;
    }
    /* documents are read and tokenised by the orchestrator when it needs them (a bad one fails alone) */
    corpus->on_demand = 1;
    corpus->tok = tok;
    corpus->vocab_size = m->cfg.vocab_size;
    corpus->bos = m->cfg.bos_id;
    corpus->frame = chat_open;
    int64_t n_heads = (int64_t)m->cfg.n_layers * m->cfg.n_kv_heads;
    kvm_model_close(&m); /* the stages load it; the orchestrator only needed the tokenizer */
    char self[4096];
    self_path(self, sizeof self);
    kvm_orch_summary sum;
    status = kvm_orch_run(cfg, corpus, self, &sum);
    if (status == 0 || status == 130) {
        print_summary(cfg, &sum, n_heads);
        if (status == 0) status = sum.failed > 0 || sum.store_full || sum.store_down ? 1 : 0;
    }
done:
    kvm_corpus_free(&corpus);
    free(chat_open);
    free(chat_close);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    kvm_config_free(&cfg);
    return status;
}
