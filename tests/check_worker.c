/* check_worker.c: the stages' shared compression dispatch: every configured method produces
 * a cache of the model's shape at its budget, and the decode-phase policy a decode worker
 * applies keeps every KV head within the entries it was stored with while tokens are added. */
#include "pipeline/kvm_calib.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_worker.h"
#include "common/kvm_error.h"
#include "proto/kvm_msg.h"
#include "proto/kvm_proto.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

static kvm_model *model;
static int32_t ids[256];
static kvm_capture *cap;
static kvm_kvcache *full;

static void setup(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
    kvm_forward *fw;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    ck_assert_int_eq(kvm_capture_new(&model->cfg, 128, &co, &cap), 0);
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &fw), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(fw, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 128, &full), 0);
    ck_assert_int_eq(kvm_forward_prefill(fw, full, ids, 128, NULL, KVM_LOGITS_NONE), 0);
    kvm_forward_free(&fw);
}

static void teardown(void)
{
    kvm_kvcache_free(&full);
    kvm_capture_free(&cap);
    kvm_model_close(&model);
}

static kvm_config *config(const char *method)
{
    char text[1024];
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = %s\nbudget = 24\n"
             "queries = 32\niterations = 2\nrounds = 1\nretain = 8\n",
             kvm_test_data_path("models/stories260K.bin"), method);
    kvm_config *c;
    ck_assert_int_eq(kvm_config_parse(text, "t.ini", &c), 0);
    return c;
}

START_TEST(test_every_method)
{
    const char *methods[] = {"full", "streaming", "h2o", "tova", "snapkv", "pyramidkv", "sculpt", "selectfit", "joint-fixed"};
    kvm_compress_input in = {.model = model, .full = full, .cap = cap, .n_tokens = 128, .n_future = 16};
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
        kvm_config *c = config(methods[i]);
        kvm_kvcache *out = NULL;
        int rc = kvm_worker_compress(c, &in, NULL, NULL, &out);
        ck_assert_msg(rc == 0, "%s: %s", methods[i], kvm_errmsg());
        ck_assert_int_eq(out->next_pos, 128);
        int64_t total = kvm_kvcache_entries(out), heads = 5 * 4;
        if (!strcmp(methods[i], "full")) ck_assert_int_eq(total, 128 * heads);
        else if (!strcmp(methods[i], "pyramidkv")) ck_assert_int_eq(total, 24 * heads); /* budgets move between layers */
        else
            for (int l = 0; l < 5; l++)
                for (int g = 0; g < 4; g++)
                    ck_assert_msg(kvm_kvcache_head(out, l, g)->n == 24, "%s: head (%d,%d) holds %lld", methods[i], l, g,
                                  (long long)kvm_kvcache_head(out, l, g)->n);
        kvm_kvcache_free(&out);
        kvm_config_free(&c);
    }
    kvm_config *c = config("polykv"); /* no store: the error says to calibrate */
    kvm_kvcache *out = NULL;
    kvm_store_id zero = {{0}};
    ck_assert_int_eq(kvm_worker_compress(c, &in, NULL, &zero, &out), KVM_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "kvmill calibrate"));
    kvm_config_free(&c);
    /* a budget at or below retain (k = budget - retain < 1) compressed at ratio instead, unsaid */
    c = config("am");
    ck_assert_int_eq(kvm_config_set(c, "compress", "budget", "8"), 0);
    ck_assert_int_eq(kvm_worker_compress(c, &in, NULL, NULL, &out), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "[compress] budget = 8 entries per head leaves none beyond the retain zone of "
                                       "[compress] retain = 8"),
                  "%s", kvm_errmsg());
    ck_assert_ptr_null(out);
    /* but a document of retain + 1 tokens (target_kl's search probes budget N - 1 = retain there)
     * is kept whole, as before the refusal */
    kvm_compress_input in9 = in;
    in9.n_tokens = 9;
    kvm_kvcache *part = NULL;
    ck_assert_int_eq(kvm_kvcache_new(5, 4, 8, 9, &part), 0);
    for (int l = 0; l < 5; l++)
        for (int g = 0; g < 4; g++)
            for (int e = 0; e < 9; e++)
                ck_assert_int_eq(kvm_kvcache_append(kvm_kvcache_head(part, l, g), 8,
                                                    kvm_kvcache_head(full, l, g)->k + e * 8,
                                                    kvm_kvcache_head(full, l, g)->v + e * 8, e, 0.0f),
                                 0);
    in9.full = part;
    ck_assert_msg(kvm_worker_compress(c, &in9, NULL, NULL, &out) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_kvcache_entries(out), 9 * 5 * 4);
    kvm_kvcache_free(&out);
    kvm_kvcache_free(&part);
    kvm_config_free(&c);
}
END_TEST

START_TEST(test_decode_policy_keeps_budget)
{
    kvm_compress_input in = {.model = model, .full = full, .cap = cap, .n_tokens = 128};
    const char *methods[] = {"snapkv", "h2o", "streaming", "sculpt"};
    for (size_t i = 0; i < 4; i++) {
        kvm_config *c = config(methods[i]);
        kvm_kvcache *cc = NULL;
        kvm_decode_policy *pol = NULL;
        ck_assert_int_eq(kvm_worker_compress(c, &in, NULL, NULL, &cc), 0);
        ck_assert_int_eq(kvm_worker_policy_new(c, model, NULL, NULL, cc, &pol), 0);
        int sculpt = !strcmp(methods[i], "sculpt");
        ck_assert_msg((pol == NULL) == sculpt, "%s: policy %p", methods[i], (void *)pol);
        kvm_forward *f;
        ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
        if (pol) ck_assert_int_eq(kvm_forward_add_hooks(f, &pol->hooks), 0);
        float logits[512];
        ck_assert_int_eq(kvm_forward_prefill(f, cc, ids + 128, 8, logits, KVM_LOGITS_LAST), 0);
        for (int t = 0; t < 20; t++) ck_assert_int_eq(kvm_forward_decode(f, cc, ids[136 + t], logits), 0);
        ck_assert_int_eq(cc->next_pos, 156);
        for (int l = 0; l < 5; l++)
            for (int g = 0; g < 4; g++) {
                int64_t n = kvm_kvcache_head(cc, l, g)->n;
                if (sculpt) ck_assert_int_eq(n, 24 + 28); /* no policy: the cache grows */
                else ck_assert_msg(n <= 24, "%s: head (%d,%d) grew to %lld", methods[i], l, g, (long long)n);
            }
        kvm_forward_free(&f);
        kvm_decode_policy_free(&pol);
        kvm_kvcache_free(&cc);
        kvm_config_free(&c);
    }
}
END_TEST

/* Signals on the wire: with and without the sculpt and kvzip patterns, averaged over documents;
 * documents that disagree on the pattern list, and unknown or misordered extras, are refused. */
START_TEST(test_calib_wire)
{
    kvm_polykv_signals *a, *acc;
    ck_assert_int_eq(kvm_polykv_signals_new(3, &a), 0);
    for (int i = 0; i < 2 * 3 * KVM_PATTERN_COUNT; i++) {
        a->cosine[i] = 0.5 + 0.01 * i;
        a->ppl_delta[i] = 0.25 * i;
    }
    for (int l = 0; l < 3; l++) {
        a->entropy[l] = 1 + l;
        a->sculpt_cosine[l] = 0.75 + 0.125 * l;
        a->sculpt_ppl[l] = -0.5 * l;
    }
    a->budget = 8;
    kvm_msg *plain, *with;
    ck_assert_int_eq(kvm_calib_encode(a, 1, 16, &plain), 0);
    a->has_sculpt = 1;
    ck_assert_int_eq(kvm_calib_encode(a, 2, 16, &with), 0);
    ck_assert_int_eq(kvm_polykv_signals_new(3, &acc), 0);
    ck_assert_int_eq(kvm_calib_accumulate(acc, with), 0);
    ck_assert_int_eq(kvm_calib_accumulate(acc, with), 0);
    ck_assert_int_eq(kvm_calib_accumulate(acc, plain), KVM_EMISMATCH);
    kvm_calib_finish(acc);
    ck_assert_int_eq(acc->has_sculpt, 1);
    ck_assert_int_eq(acc->n_docs, 2);
    for (int l = 0; l < 3; l++) {
        ck_assert_double_eq_tol(acc->sculpt_cosine[l], 0.75 + 0.125 * l, 1e-6);
        ck_assert_double_eq_tol(acc->sculpt_ppl[l], -0.5 * l, 1e-6);
    }
    for (int i = 0; i < 2 * 3 * KVM_PATTERN_COUNT; i++) ck_assert_double_eq_tol(acc->cosine[i], 0.5 + 0.01 * i, 1e-6);
    kvm_polykv_signals_free(&acc);
    ck_assert_int_eq(kvm_polykv_signals_new(3, &acc), 0);
    ck_assert_int_eq(kvm_calib_accumulate(acc, plain), 0);
    ck_assert_int_eq(acc->has_sculpt, 0);
    ck_assert_int_eq(kvm_calib_accumulate(acc, with), KVM_EMISMATCH);
    kvm_polykv_signals_free(&acc);
    ck_assert_int_eq(kvm_polykv_signals_new(4, &acc), 0); /* another layer count */
    ck_assert_int_eq(kvm_calib_accumulate(acc, with), KVM_EMISMATCH);
    kvm_polykv_signals_free(&acc);
    /* kvzip travels by name too: alone (6 patterns) and after sculpt (7) */
    for (int l = 0; l < 3; l++) {
        a->kvzip_cosine[l] = 0.625 + 0.125 * l;
        a->kvzip_ppl[l] = 0.25 * l;
    }
    kvm_msg *both, *zip;
    a->has_kvzip = 1;
    ck_assert_int_eq(kvm_calib_encode(a, 3, 16, &both), 0);
    a->has_sculpt = 0;
    ck_assert_int_eq(kvm_calib_encode(a, 4, 16, &zip), 0);
    for (int k = 0; k < 2; k++) {
        ck_assert_int_eq(kvm_polykv_signals_new(3, &acc), 0);
        ck_assert_int_eq(kvm_calib_accumulate(acc, k ? zip : both), 0);
        ck_assert_int_eq(kvm_calib_accumulate(acc, k ? both : zip), KVM_EMISMATCH);
        ck_assert_int_eq(kvm_calib_accumulate(acc, with), KVM_EMISMATCH);
        kvm_calib_finish(acc);
        ck_assert_int_eq(acc->has_kvzip, 1);
        ck_assert_int_eq(acc->has_sculpt, !k);
        for (int l = 0; l < 3; l++) {
            ck_assert_double_eq_tol(acc->kvzip_cosine[l], 0.625 + 0.125 * l, 1e-6);
            ck_assert_double_eq_tol(acc->kvzip_ppl[l], 0.25 * l, 1e-6);
            if (!k) ck_assert_double_eq_tol(acc->sculpt_cosine[l], 0.75 + 0.125 * l, 1e-6);
        }
        kvm_polykv_signals_free(&acc);
    }
    /* the extras out of order, or a name that is no extra: refused */
    float cs[3 * 2 * 7] = {0}, pp[3 * 2 * 7] = {0}, en[6] = {0}, wo[6] = {0};
    kvm_proto_stats m = {.job_id = 5, .n_layers = 3, .n_phases = 2, .n_patterns = 7, .n_tokens = 16, .n_docs = 1,
                         .budget_tokens = 8, .cos_sim = cs, .ppl_delta = pp, .entropy = en, .ppl_worst = wo};
    for (int r = 0; r < 5; r++) m.patterns[r] = kvm_proto_str_c(kvm_pattern_name((kvm_pattern)r));
    m.patterns[5] = kvm_proto_str_c("kvzip");
    m.patterns[6] = kvm_proto_str_c("sculpt");
    kvm_msg *bad;
    ck_assert_int_eq(kvm_proto_stats_encode(&m, &bad), 0);
    ck_assert_int_eq(kvm_polykv_signals_new(3, &acc), 0);
    ck_assert_int_eq(kvm_calib_accumulate(acc, bad), KVM_EMISMATCH);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "pattern 6 is 'sculpt', expected sculpt or kvzip (in that order)"));
    kvm_msg_free(&bad);
    m.n_patterns = 6;
    m.patterns[5] = kvm_proto_str_c("full");
    ck_assert_int_eq(kvm_proto_stats_encode(&m, &bad), 0);
    ck_assert_int_eq(kvm_calib_accumulate(acc, bad), KVM_EMISMATCH);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "pattern 5 is 'full'"));
    kvm_msg_free(&bad);
    kvm_polykv_signals_free(&acc);
    kvm_msg_free(&both);
    kvm_msg_free(&zip);
    kvm_msg_free(&plain);
    kvm_msg_free(&with);
    kvm_polykv_signals_free(&a);
}
END_TEST

/* The first n golden tokens' full KV and capture (what a compress worker gets for a document
 * of n tokens). */
static void prefill_short(int64_t n, kvm_capture **c, kvm_kvcache **kv)
{
    kvm_forward *fw;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    ck_assert_int_eq(kvm_capture_new(&model->cfg, n, &co, c), 0);
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &fw), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(fw, kvm_capture_hooks(*c)), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, n, kv), 0);
    ck_assert_int_eq(kvm_forward_prefill(fw, *kv, ids, n, NULL, KVM_LOGITS_NONE), 0);
    kvm_forward_free(&fw);
}

/* 1 when every head of a holds b's entries: keys, values, positions and biases. */
static int same_cache(const kvm_kvcache *a, const kvm_kvcache *b)
{
    if (a->n_layers != b->n_layers || a->n_kv_heads != b->n_kv_heads || a->next_pos != b->next_pos) return 0;
    for (int l = 0; l < a->n_layers; l++)
        for (int g = 0; g < a->n_kv_heads; g++) {
            const kvm_kv_head *x = kvm_kvcache_head(a, l, g), *y = kvm_kvcache_head(b, l, g);
            size_t nd = (size_t)x->n * (size_t)a->head_dim * sizeof(float);
            if (x->n != y->n || memcmp(x->k, y->k, nd) || memcmp(x->v, y->v, nd) ||
                memcmp(x->pos, y->pos, (size_t)x->n * sizeof *x->pos) ||
                memcmp(x->bias, y->bias, (size_t)x->n * sizeof *x->bias))
                return 0;
        }
    return 1;
}

/* A document too short for its compressed cache to save an entry is stored with its full KV
 * unchanged. With retain 8, a 9-token document's compress zone of 1 token was distilled into 1
 * entry (k is at least 1), and budget 24 on a 20-token document distilled its 12-token zone into
 * 12 entries: as many entries as the full KV, approximate where it is exact (and stored larger
 * than the f32 KV, each entry carrying a position and a logit bias). */
START_TEST(test_short_document_kept_full)
{
    static const struct {
        int64_t n;
        const char *extra;
    } docs[] = {{9, ""}, {20, "budget = 24\n"}, {8, ""}, {5, ""}};
    const char *methods[] = {"sculpt", "selectfit", "joint-fixed", "snapkv"};
    for (size_t d = 0; d < sizeof docs / sizeof docs[0]; d++) {
        kvm_capture *c = NULL;
        kvm_kvcache *kv = NULL;
        prefill_short(docs[d].n, &c, &kv);
        kvm_compress_input in = {.model = model, .full = kv, .cap = c, .n_tokens = docs[d].n};
        for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
            if (!strcmp(methods[i], "snapkv") && !*docs[d].extra) continue; /* b = ratio·N < N: it evicts */
            char text[1024];
            snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = %s\nratio = 0.3\n"
                     "queries = 32\niterations = 2\nrounds = 1\nretain = 8\n%s",
                     kvm_test_data_path("models/stories260K.bin"), methods[i], docs[d].extra);
            kvm_config *cfg;
            ck_assert_int_eq(kvm_config_parse(text, "t.ini", &cfg), 0);
            kvm_kvcache *out = NULL;
            int rc = kvm_worker_compress(cfg, &in, NULL, NULL, &out);
            ck_assert_msg(rc == 0, "%s, %lld tokens: %s", methods[i], (long long)docs[d].n, kvm_errmsg());
            ck_assert_msg(same_cache(out, kv), "%s, %lld tokens %s: %lld entries, not the full KV's %lld unchanged",
                          methods[i], (long long)docs[d].n, docs[d].extra, (long long)kvm_kvcache_entries(out),
                          (long long)kvm_kvcache_entries(kv));
            kvm_kvcache_free(&out);
            kvm_config_free(&cfg);
        }
        kvm_kvcache_free(&kv);
        kvm_capture_free(&c);
    }
    /* one token more than retain + k: distilled, fewer entries than the full KV */
    kvm_capture *c = NULL;
    kvm_kvcache *kv = NULL;
    prefill_short(12, &c, &kv); /* zone 4: k = round(1.2) = 1, 9 entries of 12 */
    kvm_compress_input in = {.model = model, .full = kv, .cap = c, .n_tokens = 12};
    kvm_config *cfg = config("sculpt");
    ck_assert_int_eq(kvm_config_set(cfg, "compress", "budget", "0"), 0);
    ck_assert_int_eq(kvm_config_set(cfg, "compress", "ratio", "0.3"), 0);
    kvm_kvcache *out = NULL;
    ck_assert_msg(kvm_worker_compress(cfg, &in, NULL, NULL, &out) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_kvcache_entries(out), 9 * 5 * 4);
    kvm_kvcache_free(&out);
    kvm_config_free(&cfg);
    kvm_kvcache_free(&kv);
    kvm_capture_free(&c);
}
END_TEST

/* `kvmill store rm --stale --config X` whose [model] path is missing printed the error twice and
 * exited 1, while store ls with that config exits 2: the config's mistake, said once. */
START_TEST(test_rm_stale_missing_model)
{
    char *dir = kvm_test_tmpdir(), store[4096], cfg[4096], text[8192], cmd[16384];
    snprintf(store, sizeof store, "%s/store", dir);
    kvm_test_store_create(store);
    snprintf(cfg, sizeof cfg, "%s/x.ini", dir);
    snprintf(text, sizeof text, "[model]\npath = %s/no-such-model.bin\n[store]\npath = %s\n", dir, store);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    char *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --config '%s'", kvm_test_bin(), cfg);
    int ls = kvm_test_run(cmd, &out, &err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store rm --stale --config '%s'", kvm_test_bin(), cfg);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(ls == 2 && rc == 2, "store ls exit %d, store rm --stale exit %d (want 2, 2): %s", ls, rc, err);
    ck_assert_msg(kvm_test_count(err, "no-such-model.bin") == 1, "the error, once, naming the model: %s", err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A child process that makes a temporary run directory in tmp, writes a stage log there and
 * leaves it: by exit (a run that failed, and kept the folder for the user) or by _exit (as
 * kill -9 leaves one). The directory's path into dir. */
static void run_dir_left(const char *tmp, int clean_exit, char *dir, size_t n)
{
    int fds[2];
    ck_assert_int_eq(pipe(fds), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        char buf[4096], log[4200];
        int own = 0;
        setenv("TMPDIR", tmp, 1);
        if (kvm_rundir_make(NULL, "run", buf, sizeof buf, &own) || !own) _exit(3);
        snprintf(log, sizeof log, "%s/compress-0.log", buf);
        if (kvm_test_write_file(log, "job 1\n", 6) || write(fds[1], buf, strlen(buf)) < 0) _exit(3);
        if (clean_exit) exit(0);
        _exit(0);
    }
    close(fds[1]);
    ssize_t got = read(fds[0], dir, n - 1);
    close(fds[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    ck_assert_msg(got > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child's run directory (status %d)", st);
    dir[got] = '\0';
}

/* A failed run's kept stage logs ("stage logs are in /tmp/kvmill-run.P...") were removed by the
 * next kvmill run or serve start: its sweep took every run directory whose owner was gone. Now a
 * directory kept by an owner that exited stays; one left by a killed owner is still swept. */
START_TEST(test_sweep_keeps_kept_run_dir)
{
    char *tmp = kvm_test_tmpdir(), kept[4096], killed[4096], log[4200];
    run_dir_left(tmp, 1, kept, sizeof kept);
    run_dir_left(tmp, 0, killed, sizeof killed);
    setenv("TMPDIR", tmp, 1);
    int removed = kvm_rundir_sweep();
    struct stat st;
    snprintf(log, sizeof log, "%s/compress-0.log", kept);
    ck_assert_msg(stat(log, &st) == 0, "%s: the kept stage log was swept", log);
    ck_assert_msg(stat(killed, &st) != 0 && removed == 1, "%s: a killed run's directory was not swept (%d removed)",
                  killed, removed);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* README: each stage's log has one line per job: document, stage, milliseconds, bytes. The lines
 * named no document, and compress (which sends no data: it stores the cache) always said 0
 * bytes. Now each names the document, and compress's bytes are the stored cache's, the figure the
 * run's summary adds up as bytes_compressed. */
/* A run in a new folder over one document, DIR/docs/NAME (doc_000's first 600 bytes), with one
 * prefill and one compress worker of its own and its run directory DIR/rd (kept: [run] run_dir);
 * fails the test when it exits other than 0. Returns DIR (free it, kvm_test_rmtree it) and the
 * run's stdout in *out (free it). */
static char *run_one_doc(const char *name, char **out)
{
    char *dir = kvm_test_tmpdir(), p[4096], text[8192], cmd[16384];
    snprintf(p, sizeof p, "%s/docs", dir);
    ck_assert_int_eq(mkdir(p, 0700), 0);
    size_t n = 0;
    char *doc = kvm_test_read_file(kvm_test_data_path("corpus/doc_000.txt"), &n);
    ck_assert_ptr_nonnull(doc);
    snprintf(p, sizeof p, "%s/docs/%s", dir, name);
    ck_assert_int_eq(kvm_test_write_file(p, doc, n < 600 ? n : 600), 0);
    free(doc);
    snprintf(p, sizeof p, "%s/c.ini", dir);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 384\n[compress]\nmethod = streaming\nratio = 0.3\n[store]\npath = "
             "%s/store\n[stages]\nprefill_workers = 1\ncompress_workers = 1\n[run]\nrun_dir = %s/rd\n",
             kvm_test_data_path("models/stories260K.bin"), dir, dir);
    ck_assert_int_eq(kvm_test_write_file(p, text, strlen(text)), 0);
    char *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s/c.ini' --corpus '%s/docs'", kvm_test_bin(), dir, dir);
    ck_assert_msg(kvm_test_run(cmd, out, &err) == 0, "kvmill run: %s", err);
    free(err);
    return dir;
}

START_TEST(test_stage_log_names_document_and_bytes)
{
    char cmd[16384], *out = NULL, *err = NULL;
    char *dir = run_one_doc("story one.txt", &out);
    const char *sum = strstr(out, "bytes_compressed=");
    ck_assert_msg(sum, "stdout: %s", out);
    long long stored = atoll(sum + strlen("bytes_compressed="));
    free(out);
    snprintf(cmd, sizeof cmd, "cat '%s'/rd/*.log", dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    char want[256];
    snprintf(want, sizeof want, "job 1 document story one.txt stage compress ");
    const char *c = strstr(out, want);
    ck_assert_msg(c, "no line \"%s...\" in the stage logs:\n%s", want, out);
    const char *b = strstr(c, " ms ");
    ck_assert_msg(b && stored > 0 && atoll(b + 4) == stored, "compress's bytes are not the summary's %lld:\n%s", stored,
                  out);
    ck_assert_msg(strstr(out, "job 1 document story one.txt stage prefill "), "the prefill line:\n%s", out);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* At a run's end its own workers stop (SIGTERM), each idle with a credit out: each asks for the
 * end of its work (revision 13), and the run, reaping them, answers at once. A run that did not
 * read its data socket while it reaped them left each worker waiting out its 5 s bound ("no end
 * of work from the orchestrator"), and the run with it. */
START_TEST(test_run_ends_its_workers_work)
{
    char cmd[16384], *out = NULL, *err = NULL;
    char *dir = run_one_doc("one.txt", &out);
    free(out);
    snprintf(cmd, sizeof cmd, "cat '%s'/rd/*.log", dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    const int ended = kvm_test_count(out, "the orchestrator sent the end of this worker's work");
    /* at least the prefill worker, idle since its one job: the compress worker may be stopped
     * between its result and its next credit, with no credit out, and then asks for nothing */
    ck_assert_msg(ended >= 1 && !strstr(out, "no end of work"),
                  "%d of the 2 workers got the end of their work from the run:\n%s", ended, out);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A stage worker said "connected to ..." right after its asynchronous connect: with nothing
 * listening, and with CurveZMQ keys the orchestrator refused (a client key not in its
 * authorized_keys, a wrong --server-key), it said so and then waited forever, the run at 0/N
 * documents. Now it says "connecting", that it waits while nothing is there, and a failed
 * handshake names the key: a refused one exits 1, one closed without a reason keeps trying. */
START_TEST(test_worker_handshake_reported)
{
    char *dir = kvm_test_tmpdir(), p[4096], text[8192], cmd[16384];
    const int port = kvm_test_tcp_port(7);
    char *out = NULL, *err = NULL;
    /* nothing listening: connecting, waiting; never "connected" */
    snprintf(cmd, sizeof cmd, "timeout --foreground -s TERM 3 '%s/kvmill-prefill' --connect tcp://127.0.0.1:%d",
             kvm_test_bin(), port);
    kvm_test_run(cmd, &out, &err);
    ck_assert_msg(strstr(err, "connecting to tcp://127.0.0.1:") && strstr(err, "waiting for the orchestrator") &&
                      !strstr(err, "connected to"),
                  "nothing listening: %s", err);
    free(out);
    free(err);

    /* a keyed run waiting for a compress worker started by hand */
    kvm_test_keygen(dir, "server");
    kvm_test_keygen(dir, "worker");
    kvm_test_keygen(dir, "rogue");
    snprintf(p, sizeof p, "%s/auth", dir);
    ck_assert_int_eq(mkdir(p, 0700), 0);
    snprintf(cmd, sizeof cmd, "cp '%s/worker.public' '%s/auth/'", dir, dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(p, sizeof p, "%s/docs", dir);
    ck_assert_int_eq(mkdir(p, 0700), 0);
    snprintf(p, sizeof p, "%s/docs/a.txt", dir);
    ck_assert_int_eq(kvm_test_write_file(p, "Once upon a time there was a cat.", 33), 0);
    snprintf(p, sizeof p, "%s/c.ini", dir);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = streaming\nratio = 0.5\n[store]\npath = "
             "%s/store\n[stages]\nprefill_workers = 1\ncompress_workers = 0\n[run]\nbind = tcp://0.0.0.0:%d\n"
             "[security]\nserver_secret_key = %s/server.secret\nserver_public_key = %s/server.public\n"
             "client_public_key = %s/worker.public\nclient_secret_key = %s/worker.secret\nauthorized_keys = %s/auth\n",
             kvm_test_data_path("models/stories260K.bin"), dir, port, dir, dir, dir, dir, dir);
    ck_assert_int_eq(kvm_test_write_file(p, text, strlen(text)), 0);
    char run_err[4200];
    snprintf(run_err, sizeof run_err, "%s/run.err", dir);
    pid_t run = fork();
    ck_assert_int_ge(run, 0);
    if (run == 0) {
        freopen("/dev/null", "w", stdout);
        freopen(run_err, "w", stderr);
        char exe[4200], corpus[4200];
        snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
        snprintf(corpus, sizeof corpus, "%s/docs", dir);
        execl(exe, exe, "run", "--config", p, "--corpus", corpus, (char *)NULL);
        _exit(127);
    }
    int waiting = 0;
    for (int i = 0; i < 300 && !waiting; i++) {
        usleep(100000);
        char *t = kvm_test_read_file(run_err, NULL);
        waiting = t && strstr(t, "waiting for kvmill-compress workers");
        free(t);
    }
    ck_assert_msg(waiting, "the keyed run did not start");
    /* a refused key stops the worker (exit 1); a wrong --server-key makes the orchestrator close
     * the handshake without a reason, as a proxy with nothing behind it does: said, and the worker
     * keeps trying (stopped here by timeout: 124) */
    static const struct {
        const char *server, *client, *want;
        int status;
    } cases[] = {
        {"server", "rogue", "rejected this worker's CurveZMQ key", 1},
        {"rogue", "worker", "may not be the orchestrator's public key", 124},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(cmd, sizeof cmd,
                 "timeout --foreground -s %s '%s/kvmill-compress' --connect tcp://127.0.0.1:%d --store '%s/store' "
                 "--server-key '%s/%s.public' --client-public '%s/%s.public' --client-secret '%s/%s.secret'",
                 i ? "TERM 6" : "KILL 20", kvm_test_bin(), port, dir, dir, cases[i].server, dir, cases[i].client, dir,
                 cases[i].client);
        int rc = kvm_test_run(cmd, &out, &err);
        char key[4200];
        snprintf(key, sizeof key, "%s/%s.public", dir, i == 0 ? cases[i].client : cases[i].server);
        const int ok =
            rc == cases[i].status && strstr(err, cases[i].want) && strstr(err, key) && !strstr(err, "connected to");
        free(out);
        if (!ok) {
            kill(run, SIGKILL);
            waitpid(run, NULL, 0);
        }
        ck_assert_msg(ok, "server key %s, client key %s: exit %d (want %d, \"%s\" naming %s): %s", cases[i].server,
                      cases[i].client, rc, cases[i].status, cases[i].want, key, err);
        free(err);
    }
    kill(run, SIGTERM);
    waitpid(run, NULL, 0);
    /* the run says whose key it refused (only the worker said so) */
    char *re = kvm_test_read_file(run_err, NULL);
    ck_assert_msg(re && strstr(re, "refused a CurveZMQ client key ") && strstr(re, "not in [security] authorized_keys"),
                  "run: %s", re ? re : "(none)");
    free(re);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* README's multi-host example did not work as written: after `keygen --out server` and `mkdir
 * authorized_keys`, `kvmill run --config configs/multi-gpu.ini` was refused (exit 2: "the stages
 * this run starts need [security] client_public_key"). Its steps, followed here with cpu devices
 * and free ports in a copy of the config, run a document through. */
START_TEST(test_multi_gpu_example_runs)
{
    char *dir = kvm_test_tmpdir(), bin[4096], weights[4096], cfg[4096], cmd[32768];
    ck_assert_ptr_nonnull(realpath(kvm_test_bin(), bin));
    ck_assert_ptr_nonnull(realpath(kvm_test_data_path("models/stories260K.bin"), weights));
    ck_assert_ptr_nonnull(realpath(kvm_test_data_path("../configs/multi-gpu.ini"), cfg));
    const int port = kvm_test_tcp_port(11), store_port = kvm_test_tcp_port(13);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && mkdir configs docs && printf 'Once upon a time there was a cat.' > docs/a.txt && "
             "sed -e 's/cuda:0,cuda:1/cpu,cpu/' -e 's/:5555/:%d/' -e 's/:5560/:%d/' "
             "-e 's#^path = data/models/stories260K.bin#path = %s#' '%s' > configs/multi-gpu.ini && "
             "'%s/kvmill' keygen --out server && '%s/kvmill' keygen --out worker && mkdir -p authorized_keys && "
             "cp worker.public authorized_keys/ && "
             "timeout --foreground -s KILL 120 '%s/kvmill' run --config configs/multi-gpu.ini --corpus docs",
             dir, port, store_port, weights, cfg, bin, bin, bin);
    char *out = NULL, *err = NULL;
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "compressed=1 "), "README's steps: exit %d\nstdout: %s\nstderr: %s", rc, out,
                  err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A store service, `kvmill store serve --create` on store DIR/NAME bound to ipc://DIR/SOCK, its
 * stderr into DIR/NAME.err; waits for its socket file. Returns its pid. */
static pid_t store_service(const char *dir, const char *name, const char *sock)
{
    char exe[4200], store[4200], bind[4200], errp[4200], path[4200];
    snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
    snprintf(store, sizeof store, "%s/%s", dir, name);
    snprintf(bind, sizeof bind, "ipc://%s/%s", dir, sock);
    snprintf(errp, sizeof errp, "%s/%s.err", dir, name);
    snprintf(path, sizeof path, "%s/%s", dir, sock);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        freopen("/dev/null", "w", stdout);
        freopen(errp, "w", stderr);
        execl(exe, exe, "store", "serve", "--store", store, "--create", "--bind", bind, (char *)NULL);
        _exit(127);
    }
    struct stat st;
    for (int i = 0; i < 600 && stat(path, &st) != 0; i++)
        usleep(50000);
    ck_assert_msg(stat(path, &st) == 0, "the store service on %s did not start", bind);
    return pid;
}

/* Lines in text. */
static int n_lines(const char *text)
{
    int n = 0;
    for (const char *p = text; p && *p; p++)
        n += *p == '\n';
    return n;
}

/* Workers given a store service's endpoint (its ROUTER completes a ZeroMQ handshake as an
 * orchestrator's does) said "connected", and a decode worker answered each store_reply refusal
 * with an error answer, which the service refused again: thousands of log lines a second, both
 * processes busy forever. The first message tells now: a store_reply is no orchestrator's, said
 * naming the endpoint and the type, and the worker exits 1, never having said "connected". */
START_TEST(test_worker_wrong_endpoint)
{
    char *dir = kvm_test_tmpdir(), p[4200], text[8192], cmd[16384];
    /* ctl and data (--connect ipc://DIR: DIR/ctl, DIR/data) each a store service */
    pid_t svc[2] = {store_service(dir, "sa", "ctl"), store_service(dir, "sb", "data")};
    snprintf(p, sizeof p, "%s/c.ini", dir);
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = streaming\nbudget = 32\n",
             kvm_test_data_path("models/stories260K.bin"));
    ck_assert_int_eq(kvm_test_write_file(p, text, strlen(text)), 0);
    const char *stages[2] = {"decode", "prefill"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "timeout -s KILL 20 '%s/kvmill-%s' --connect 'ipc://%s' --heartbeat-ms 100%s%s%s%s%s",
                 kvm_test_bin(), stages[i], dir, i ? "" : " --config '", i ? "" : p, i ? "" : "' --store '",
                 i ? "" : dir, i ? "" : "/sa'");
        char *out = NULL, *err = NULL;
        int rc = kvm_test_run(cmd, &out, &err);
        const int ok = rc == 1 &&
                       strstr(err, "is not a kvmill run or serve endpoint: it answered with a 'store_reply' "
                                   "message (a kvmill store service?)") &&
                       strstr(err, dir) && !strstr(err, "connected to") && n_lines(err) < 10;
        if (!ok)
            for (int k = 0; k < 2; k++)
                kill(svc[k], SIGKILL), waitpid(svc[k], NULL, 0);
        ck_assert_msg(ok, "kvmill-%s given store services: exit %d (want 1), %d lines:\n%.4000s", stages[i], rc,
                      n_lines(err), err);
        free(out);
        free(err);
    }
    for (int k = 0; k < 2; k++) {
        kill(svc[k], SIGTERM);
        waitpid(svc[k], NULL, 0);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The next message on ROUTER sock within ms, without its routing frame, of type t (others
 * skipped: readies, heartbeats); NULL when none came. */
static kvm_msg *router_expect(void *sock, kvm_proto_type t, int ms)
{
    for (double end = kvm_now_ms() + ms; kvm_now_ms() < end;) {
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0) continue;
        kvm_msg *m = NULL, *env = NULL;
        kvm_proto_type got;
        ck_assert_int_eq(kvm_msg_recv(sock, &m, 0), 0);
        ck_assert_int_eq(kvm_msg_split(m, 1, &env), 0);
        kvm_msg_free(&env);
        if (kvm_proto_peek(m, &got) == 0 && got == t) return m;
        kvm_msg_free(&m);
    }
    return NULL;
}

/* Sends m (taken) to worker id behind ROUTER sock. */
static void router_send(void *sock, const char *id, kvm_msg *m)
{
    kvm_msg *env = NULL;
    ck_assert_int_eq(kvm_msg_new(&env), 0);
    ck_assert_int_eq(kvm_msg_add_copy(env, id, strlen(id)), 0);
    ck_assert_int_eq(kvm_msg_join(env, &m), 0);
    ck_assert_int_eq(kvm_msg_send(sock, &env, 0), 0);
}

/* A decode worker answered whatever came on its data socket, an error answer to a message that
 * was no request: to a peer that replies to answers (a store service) that made an endless
 * exchange. Only an ask gets an answer; anything else is dropped unanswered, with a line for each
 * of the first 5 in a row only (then one per 10 s counts them). */
START_TEST(test_decode_answers_only_asks)
{
    char *dir = kvm_test_tmpdir(), p[4200], text[8192], ctl[4300], data[4300], base[4300];
    snprintf(base, sizeof base, "ipc://%s", dir);
    ck_assert_int_eq(kvm_stage_endpoints(base, ctl, data, sizeof ctl), 0);
    void *zctx = zmq_ctx_new(), *rc_ = zmq_socket(zctx, ZMQ_ROUTER), *rd = zmq_socket(zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(rc_, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(rd, ZMQ_LINGER, &linger, sizeof linger);
    ck_assert_int_eq(zmq_bind(rc_, ctl), 0);
    ck_assert_int_eq(zmq_bind(rd, data), 0);
    snprintf(p, sizeof p, "%s/c.ini", dir);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = streaming\nbudget = 32\n[store]\npath = %s/st\n",
             kvm_test_data_path("models/stories260K.bin"), dir);
    ck_assert_int_eq(kvm_test_write_file(p, text, strlen(text)), 0);
    snprintf(text, sizeof text, "%s/st", dir);
    kvm_test_store_create(text);
    char exe[4200], logp[4300];
    snprintf(exe, sizeof exe, "%s/kvmill-decode", kvm_test_bin());
    snprintf(logp, sizeof logp, "%s/decode.log", dir);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        freopen(logp, "w", stderr);
        execl(exe, exe, "--connect", base, "--config", p, "--id", "dec-test", "--heartbeat-ms", "100", (char *)NULL);
        _exit(127);
    }
    kvm_msg *m = router_expect(rd, KVM_PROTO_READY, 60000); /* its first credit */
    int ok = m != NULL;
    kvm_msg_free(&m);
    /* a type this build knows but no orchestrator sends today, first on ctl (a later orchestrator's
     * liveness reply, say): dropped; the worker took it for a wrong endpoint and exited 1 */
    if (ok && (m = router_expect(rc_, KVM_PROTO_HEARTBEAT, 10000)) != NULL) {
        kvm_msg_free(&m);
        kvm_proto_heartbeat hb0 = {.worker_id = kvm_proto_str_c("run"), .stage = kvm_proto_str_c("run"), .pid = 1};
        ck_assert_int_eq(kvm_proto_heartbeat_encode(&hb0, &m), 0);
        router_send(rc_, "dec-test", m);
        usleep(300000);
        ck_assert_msg(waitpid(pid, NULL, WNOHANG) == 0, "the worker stopped on a heartbeat on its control socket");
    }
    /* an ask (a document with no cache here: an error answer, at once) */
    kvm_proto_ask a = {.request_id = 7,
                       .doc_text = kvm_proto_str_c("Once upon a time."),
                       .prompt = kvm_proto_str_c(" The"),
                       .max_new_tokens = 1};
    if (ok) {
        ck_assert_int_eq(kvm_proto_ask_encode(&a, &m), 0);
        router_send(rd, "dec-test", m);
        m = router_expect(rd, KVM_PROTO_ANSWER, 60000);
        ok = m != NULL;
        kvm_msg_free(&m);
    }
    /* a message that is no request: no answer, and the worker keeps serving */
    int answered = 0;
    if (ok) {
        kvm_proto_heartbeat hb = {.worker_id = kvm_proto_str_c("peer"), .stage = kvm_proto_str_c("x"), .pid = 1};
        ck_assert_int_eq(kvm_proto_heartbeat_encode(&hb, &m), 0);
        router_send(rd, "dec-test", m);
        m = router_expect(rd, KVM_PROTO_ANSWER, 2000);
        answered = m != NULL;
        kvm_msg_free(&m);
        for (int i = 0; i < 20 && !answered; i++) { /* a flood: a few lines, then counted */
            ck_assert_int_eq(kvm_proto_heartbeat_encode(&hb, &m), 0);
            router_send(rd, "dec-test", m);
        }
        m = answered ? NULL : router_expect(rd, KVM_PROTO_ANSWER, 1000);
        answered = m != NULL;
        kvm_msg_free(&m);
    }
    kill(pid, SIGTERM);
    int st = 0;
    waitpid(pid, &st, 0);
    char *log = kvm_test_read_file(logp, NULL);
    ck_assert_msg(ok, "the decode worker did not answer its ask:\n%s", log ? log : "");
    ck_assert_msg(!answered, "the decode worker answered a heartbeat:\n%s", log ? log : "");
    int n_said = 0;
    for (const char *q = log ? strstr(log, "is not a request") : NULL; q; q = strstr(q + 1, "is not a request"))
        n_said++;
    ck_assert_msg(log && strstr(log, "a 'heartbeat' message is not a request") && strstr(log, "connected to") &&
                      n_said <= 5,
                  "%d lines for 21 messages dropped:\n%s", n_said, log ? log : "");
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d:\n%s", st, log ? log : "");
    free(log);
    zmq_close(rc_);
    zmq_close(rd);
    zmq_ctx_term(zctx);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A fake orchestrator (ROUTER sockets ctl and data bound in a new temporary folder) and a
 * kvmill-compress worker connected to it: --id id, heartbeats every 100 ms, one more option
 * (flag value, or flag NULL), its stderr in logp. */
typedef struct cmp_orch {
    char *dir, ctl_ep[4300], data_ep[4300], logp[4300];
    void *zctx, *ctl, *data;
    pid_t pid;
} cmp_orch;

/* New ROUTER sockets bound on c's endpoints (the orchestrator there again). */
static void cmp_orch_bind(cmp_orch *c)
{
    int linger = 0;
    c->ctl = zmq_socket(c->zctx, ZMQ_ROUTER), c->data = zmq_socket(c->zctx, ZMQ_ROUTER);
    zmq_setsockopt(c->ctl, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(c->data, ZMQ_LINGER, &linger, sizeof linger);
    ck_assert_int_eq(zmq_bind(c->ctl, c->ctl_ep), 0);
    ck_assert_int_eq(zmq_bind(c->data, c->data_ep), 0);
}

/* Both sockets closed: their connections close (the orchestrator gone). */
static void cmp_orch_close(cmp_orch *c)
{
    zmq_close(c->ctl);
    zmq_close(c->data);
    c->ctl = c->data = NULL;
}

static void cmp_orch_start(cmp_orch *c, const char *id, const char *flag, const char *value)
{
    char base[4300], st[4300], exe[4200];
    c->dir = kvm_test_tmpdir();
    snprintf(base, sizeof base, "ipc://%s", c->dir);
    ck_assert_int_eq(kvm_stage_endpoints(base, c->ctl_ep, c->data_ep, sizeof c->ctl_ep), 0);
    c->zctx = zmq_ctx_new();
    cmp_orch_bind(c);
    snprintf(st, sizeof st, "%s/st", c->dir);
    kvm_test_store_create(st);
    snprintf(exe, sizeof exe, "%s/kvmill-compress", kvm_test_bin());
    snprintf(c->logp, sizeof c->logp, "%s/compress.log", c->dir);
    c->pid = fork();
    ck_assert_int_ge(c->pid, 0);
    if (c->pid == 0) {
        freopen(c->logp, "w", stderr);
        execl(exe, exe, "--connect", base, "--store", st, "--id", id, "--heartbeat-ms", "100", flag, value,
              (char *)NULL);
        _exit(127);
    }
}

/* Waits up to ms for the worker to exit: 1 and *status when it did, else 0. */
static int cmp_orch_exited(cmp_orch *c, int ms, int *status)
{
    for (double end = kvm_now_ms() + ms; kvm_now_ms() < end; usleep(50 * 1000))
        if (waitpid(c->pid, status, WNOHANG) == c->pid) {
            c->pid = 0;
            return 1;
        }
    return 0;
}

/* The worker killed if it still runs; the worker's log (the caller frees it). */
static char *cmp_orch_end(cmp_orch *c)
{
    if (c->pid > 0) kill(c->pid, SIGKILL), waitpid(c->pid, NULL, 0);
    char *log = kvm_test_read_file(c->logp, NULL);
    if (c->ctl) cmp_orch_close(c);
    zmq_ctx_term(c->zctx);
    kvm_test_rmtree(c->dir);
    free(c->dir);
    return log;
}

/* A compress job cut on the wire: the job's first message reached the worker, then the data
 * connection closed (the orchestrator's ROUTER drops what it still held for it: the KV layers).
 * The worker held the part for ever and asked for no work, so the run never learnt that the job
 * was lost (kvm_orch_receive.c requeues a job when its worker asks for work). Now the part is
 * dropped when the connection closes, said in the log, and the worker asks again on the next
 * connection. */
START_TEST(test_job_cut_on_the_wire)
{
    cmp_orch c;
    cmp_orch_start(&c, "cmp-cut", NULL, NULL);
    kvm_msg *m = router_expect(c.data, KVM_PROTO_READY, 60000); /* its first credit */
    int asked = 0;
    if (m) {
        kvm_msg_free(&m);
        int32_t tokens[3] = {1, 2, 3};
        kvm_proto_job j = {.job_id = 42,
                           .doc_id = kvm_proto_str_c("doc"),
                           .doc_name = kvm_proto_str_c("doc"),
                           .n_ctx = 128,
                           .n_tokens = 3,
                           .tokens = tokens};
        ck_assert_int_eq(kvm_proto_job_encode(&j, &m), 0);
        router_send(c.data, "cmp-cut", m); /* the job's first part; its KV layers never come */
        usleep(500 * 1000);
        cmp_orch_close(&c); /* the connections close; new ones on the same endpoints */
        cmp_orch_bind(&c);
        m = router_expect(c.data, KVM_PROTO_READY, 15000);
        asked = m != NULL;
        kvm_msg_free(&m);
    }
    char *log = cmp_orch_end(&c);
    ck_assert_msg(asked, "the worker holding part of a job asked for no work on the new connection:\n%s",
                  log ? log : "");
    ck_assert_msg(log && strstr(log, "the data connection closed with 1 part(s) of job 42 here"), "%s", log ? log : "");
    free(log);
}
END_TEST

/* A worker started by hand (a Kubernetes Job's pod, a batch script's step) waited for the next run
 * on its endpoint for ever once its run had ended, so the Job never completed and held its GPUs.
 * With --leave-after-s N it stops (exit 0) once the orchestrator has been gone N s: both
 * connections closed and none made again. Closed and made again at once (a restarted proxy, a
 * new run on the endpoint), it stays (the count starts again). */
START_TEST(test_worker_leaves_after_run)
{
    cmp_orch c;
    cmp_orch_start(&c, "cmp-leave", "--leave-after-s", "2");
    kvm_msg *m = router_expect(c.data, KVM_PROTO_READY, 60000); /* its first credit */
    const int credit = m != NULL;
    kvm_msg_free(&m);
    for (int k = 0; k < 3 && credit; k++) { /* closed and bound again at once, three times over 3 s: it stays */
        cmp_orch_close(&c);
        cmp_orch_bind(&c);
        m = router_expect(c.data, KVM_PROTO_READY, 900);
        kvm_msg_free(&m);
    }
    int status = 0;
    const int stayed = credit && !cmp_orch_exited(&c, 500, &status);
    cmp_orch_close(&c); /* the run ends */
    const double gone = kvm_now_ms();
    const int exited = stayed && cmp_orch_exited(&c, 15000, &status);
    const double took = kvm_now_ms() - gone;
    char *log = cmp_orch_end(&c);
    ck_assert_msg(credit, "no credit from the worker:\n%s", log ? log : "");
    ck_assert_msg(stayed, "the worker left on connections closed and made again at once:\n%s", log ? log : "");
    ck_assert_msg(exited && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "the worker did not stop after its orchestrator was gone (status %d):\n%s", status, log ? log : "");
    ck_assert_msg(took >= 1900 && took < 12000, "stopped %.0f ms after the orchestrator went, want about 2 s", took);
    ck_assert_msg(log && strstr(log, "has been gone for 2 s (--leave-after-s): stopping"), "%s", log ? log : "");
    free(log);
}
END_TEST

/* An orchestrator that does not hear the worker (no welcome, no answer to its probe): the worker
 * closes its control connection to make it again (zmq_disconnect, which raises no DISCONNECTED
 * event). The orchestrator went in that gap: the control socket was still taken for connected,
 * and a worker with --leave-after-s never left. */
START_TEST(test_worker_leaves_after_rejoin)
{
    cmp_orch c;
    cmp_orch_start(&c, "cmp-rejoin", "--leave-after-s", "1");
    /* nothing answered: within about 15 s it closes the control connection to make it again */
    const int rejoined = kvm_test_wait_text(c.logp, "connecting the control socket again", 1, 60);
    cmp_orch_close(&c); /* the run ends in the gap (500 ms) before the connection is made again */
    const double gone = kvm_now_ms();
    int status = 0;
    const int exited = rejoined && cmp_orch_exited(&c, 10000, &status);
    const double took = kvm_now_ms() - gone;
    char *log = cmp_orch_end(&c);
    ck_assert_msg(rejoined, "the worker did not connect again:\n%s", log ? log : "");
    ck_assert_msg(exited && WIFEXITED(status) && WEXITSTATUS(status) == 0,
                  "the worker did not stop after its orchestrator was gone (status %d, %.0f ms):\n%s", status, took,
                  log ? log : "");
    ck_assert_msg(log && strstr(log, "(--leave-after-s): stopping"), "%s", log ? log : "");
    free(log);
}
END_TEST

/* A fake orchestrator's ROUTER sockets (ctl, data) bound under a new temporary folder, and a
 * kvmill-decode worker "dec-drain" connected to them (stderr into dir/decode.log, heartbeats every
 * 100 ms), with the store and config it needs. */
typedef struct fake_orch {
    char *dir;
    char logp[4300];
    void *zctx, *ctl, *data;
    pid_t pid;
} fake_orch;

static int g_fake_hb_flag = 1; /* fake_orch_start passes --heartbeat-ms 100; else [run] heartbeat_ms = 100 */

static void fake_orch_start(fake_orch *f)
{
    char p[4200], text[8192], ctl[4300], data[4300], base[4300], exe[4200];
    f->dir = kvm_test_tmpdir();
    snprintf(base, sizeof base, "ipc://%s", f->dir);
    ck_assert_int_eq(kvm_stage_endpoints(base, ctl, data, sizeof ctl), 0);
    f->zctx = zmq_ctx_new();
    f->ctl = zmq_socket(f->zctx, ZMQ_ROUTER);
    f->data = zmq_socket(f->zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f->ctl, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(f->data, ZMQ_LINGER, &linger, sizeof linger);
    ck_assert_int_eq(zmq_bind(f->ctl, ctl), 0);
    ck_assert_int_eq(zmq_bind(f->data, data), 0);
    snprintf(p, sizeof p, "%s/c.ini", f->dir);
    snprintf(
        text, sizeof text,
        "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = streaming\nbudget = 32\n[store]\npath = %s/st\n%s",
        kvm_test_data_path("models/stories260K.bin"), f->dir,
        g_fake_hb_flag ? "" : "[run]\nheartbeat_ms = 100\nliveness = 3\n");
    ck_assert_int_eq(kvm_test_write_file(p, text, strlen(text)), 0);
    snprintf(text, sizeof text, "%s/st", f->dir);
    kvm_test_store_create(text);
    snprintf(exe, sizeof exe, "%s/kvmill-decode", kvm_test_bin());
    snprintf(f->logp, sizeof f->logp, "%s/decode.log", f->dir);
    f->pid = fork();
    ck_assert_int_ge(f->pid, 0);
    if (f->pid == 0) {
        freopen(f->logp, "w", stderr);
        if (g_fake_hb_flag)
            execl(exe, exe, "--connect", base, "--config", p, "--id", "dec-drain", "--heartbeat-ms", "100",
                  (char *)NULL);
        else
            execl(exe, exe, "--connect", base, "--config", p, "--id", "dec-drain", (char *)NULL);
        _exit(127);
    }
}

/* Waits for the worker's first credit on f's data socket (60 s), failing with its log. */
static void fake_orch_credit(fake_orch *f)
{
    kvm_msg *m = router_expect(f->data, KVM_PROTO_READY, 60000);
    char *log = NULL;
    ck_assert_msg(m != NULL, "no credit from the worker:\n%s", (log = kvm_test_read_file(f->logp, NULL)) ? log : "");
    kvm_msg_free(&m);
}

/* The orchestrator gone: its bound sockets closed (unbound ones left for fake_orch_end). */
static void fake_orch_vanish(fake_orch *f)
{
    zmq_close(f->ctl);
    zmq_close(f->data);
    f->ctl = zmq_socket(f->zctx, ZMQ_ROUTER);
    f->data = zmq_socket(f->zctx, ZMQ_ROUTER);
}

static void fake_orch_end(fake_orch *f)
{
    if (f->pid > 0) kill(f->pid, SIGKILL), waitpid(f->pid, NULL, 0);
    zmq_close(f->ctl);
    zmq_close(f->data);
    zmq_ctx_term(f->zctx);
    kvm_test_rmtree(f->dir);
    free(f->dir);
}

/* Waits up to ms for worker f to exit; its status, or -1 when it still runs. */
static int fake_orch_wait(fake_orch *f, int ms)
{
    int st = 0;
    for (double end = kvm_now_ms() + ms; kvm_now_ms() < end; usleep(20000))
        if (waitpid(f->pid, &st, WNOHANG) == f->pid) {
            f->pid = 0;
            return st;
        }
    return -1;
}

/* An idle worker stopped with a credit out (SIGTERM) kept taking what reached its data socket for
 * 300 ms of wall time: a question its orchestrator had handed it for that credit, still on its
 * way (a loaded host, a worker resumed after SIGSTOP), was lost. Now it says on the data socket
 * that it stops (a heartbeat with `stopping`, PROTOCOL.md §5, revision 13) and takes what comes
 * until the orchestrator's end of work: here a question sent 1 s after that heartbeat, then the
 * end of work, is answered, and one sent after the end of work is not (_i = 0). An orchestrator
 * that never answers (_i = 1: an older one, a stopped one) is waited for at most 5 s. SIGHUP (a
 * closed terminal, _i = 2) stops it as SIGTERM does: it killed the worker at once. An
 * orchestrator whose connections close while the worker waits (_i = 3: serve killed during its
 * drain) ends the wait: nothing can come over them (it waited the whole 5 s). */
START_TEST(test_stopping_worker_waits_for_end_of_work)
{
    const int answered = _i != 1;
    fake_orch f;
    fake_orch_start(&f);
    fake_orch_credit(&f);
    kvm_msg *m = NULL;
    char *log = NULL;
    ck_assert_int_eq(kill(f.pid, _i == 2 ? SIGHUP : SIGTERM), 0);
    m = router_expect(f.data, KVM_PROTO_HEARTBEAT, 10000);
    ck_assert_msg(m != NULL, "the stopping worker did not say so on its data socket:\n%s",
                  (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
    kvm_proto_heartbeat hb;
    ck_assert_int_eq(kvm_proto_heartbeat_decode(m, &hb), 0);
    ck_assert(hb.stopping);
    kvm_msg_free(&m);
    const double said = kvm_now_ms();
    if (_i == 3) { /* the orchestrator gone while the worker waits: its connections close */
        fake_orch_vanish(&f);
        int st = fake_orch_wait(&f, 30000);
        const double took = kvm_now_ms() - said;
        log = kvm_test_read_file(f.logp, NULL);
        ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the worker: status %d\n%s", st,
                      log ? log : "");
        ck_assert_msg(strstr(log, "closed the data connection while this worker waited for its end of work") &&
                          !strstr(log, "no end of work from the orchestrator"),
                      "the worker waited for an end of work over a closed connection (%.0f ms):\n%s", took, log);
        free(log);
        fake_orch_end(&f);
        return;
    }
    if (answered) {
        usleep(1000000); /* past the old 300 ms window */
        kvm_proto_ask a = {.request_id = 7,
                           .doc_text = kvm_proto_str_c("Once upon a time."),
                           .prompt = kvm_proto_str_c(" The"),
                           .max_new_tokens = 1};
        ck_assert_int_eq(kvm_proto_ask_encode(&a, &m), 0);
        router_send(f.data, "dec-drain", m);
        kvm_proto_ack end = {
            .worker_id = kvm_proto_str_c("dec-drain"), .stage = kvm_proto_str_c("serve"), .pid = 1, .stopping = true};
        ck_assert_int_eq(kvm_proto_ack_encode(&end, &m), 0);
        router_send(f.data, "dec-drain", m);
        a.request_id = 8; /* after the end of work: dropped */
        ck_assert_int_eq(kvm_proto_ask_encode(&a, &m), 0);
        router_send(f.data, "dec-drain", m);
        m = router_expect(f.data, KVM_PROTO_ANSWER, 60000);
        kvm_proto_answer ans;
        ck_assert_msg(m && kvm_proto_answer_decode(m, &ans) == 0 && ans.request_id == 7,
                      "the question handed before the end of work was not answered:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
        kvm_msg_free(&m);
    }
    int st = fake_orch_wait(&f, 30000);
    const double took = kvm_now_ms() - said;
    if (answered) {
        m = router_expect(f.data, KVM_PROTO_ANSWER, 300);
        ck_assert_msg(m == NULL, "a question sent after the end of work was answered");
    }
    log = kvm_test_read_file(f.logp, NULL);
    ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the worker: status %d\n%s", st, log ? log : "");
    if (answered) {
        ck_assert_msg(strstr(log, "the orchestrator sent the end of this worker's work"), "%s", log);
        ck_assert_msg(took < 4500, "the worker stopped %.0f ms after saying so, not at the end of its work\n%s", took,
                      log);
    } else {
        ck_assert_msg(strstr(log, "no end of work from the orchestrator in 5 s"), "%s", log);
        ck_assert_msg(took >= 4500 && took < 20000, "the worker stopped %.0f ms after saying so, want its 5 s bound",
                      took);
    }
    free(log);
    fake_orch_end(&f);
}
END_TEST

/* A worker whose orchestrator closed the connection (kvmill serve stopped, killed) still waited
 * the whole 5 s for an end of work on SIGTERM, though nothing can come over a closed connection
 * and its credit went with it. Now, with the data socket's connection down (and not made again),
 * it stops at once, as it does when its --parent-pid is gone. */
START_TEST(test_stopping_worker_orchestrator_gone)
{
    fake_orch f;
    fake_orch_start(&f);
    fake_orch_credit(&f);
    char *log = NULL;
    fake_orch_vanish(&f);
    /* the worker's I/O thread sees its connections end (no line: nothing greeted it); the drain
     * also reads the monitor events still waiting when SIGTERM comes */
    usleep(1500000);
    const double sent = kvm_now_ms();
    ck_assert_int_eq(kill(f.pid, SIGTERM), 0);
    int st = fake_orch_wait(&f, 30000);
    const double took = kvm_now_ms() - sent;
    log = kvm_test_read_file(f.logp, NULL);
    ck_assert_msg(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the worker: status %d\n%s", st, log ? log : "");
    ck_assert_msg(!strstr(log, "no end of work from the orchestrator"),
                  "the worker waited for an end of work over "
                  "a closed connection:\n%s",
                  log);
    /* at once, not its 5 s bound (the margin: a loaded machine's exit under ASan's leak check) */
    ck_assert_msg(took < 4000, "the worker stopped %.0f ms after SIGTERM with its connection closed, want at once\n%s",
                  took, log);
    free(log);
    fake_orch_end(&f);
}
END_TEST

/* A worker that never reached its orchestrator (nothing bound at --connect) took 6 s to stop on
 * SIGTERM, saying "a job handed for this worker's credit may be on its way": no job can come
 * over a connection never made. It stops at once now. */
START_TEST(test_stop_never_connected)
{
    char *dir = kvm_test_tmpdir(), log[4200], cmd[16384], *out = NULL;
    snprintf(log, sizeof log, "%s/w.log", dir);
    snprintf(cmd, sizeof cmd,
             "'%s/kvmill-prefill' --connect 'ipc://%s/nobody' --heartbeat-ms 100 >'%s' 2>&1 & p=$!; "
             "for i in $(seq 200); do grep -q 'nothing accepts a connection' '%s' && break; sleep 0.05; done; "
             "s=$(date +%%s%%N); kill -TERM $p; wait $p; echo \"rc=$? ms=$(( ($(date +%%s%%N) - s) / 1000000 ))\"",
             kvm_test_bin(), dir, log, log);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    char *text = kvm_test_read_file(log, NULL);
    int ms = -1;
    const char *m = out ? strstr(out, "ms=") : NULL;
    if (m) ms = atoi(m + 3);
    ck_assert_msg(out && strstr(out, "rc=0") && text && strstr(text, "nothing accepts a connection") &&
                      !strstr(text, "may be on its way"),
                  "%s\n%s", out, text ? text : "");
    ck_assert_msg(ms >= 0 && ms < 4000, "stopped %d ms after SIGTERM (its 5 s wait for an end of work)\n%s", ms, text);
    free(text);
    free(out);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A decode worker started by hand with serve's --config beat at its built-in 1000 ms, whatever
 * the config's [run] heartbeat_ms (here 100, liveness 3: dead after 300 ms): serve declared it
 * silent mid-answer and the ask failed. Without --heartbeat-ms it now beats at the config's. */
START_TEST(test_heartbeat_from_config)
{
    g_fake_hb_flag = 0;
    fake_orch f;
    fake_orch_start(&f);
    g_fake_hb_flag = 1;
    char *log = NULL;
    kvm_msg *m = router_expect(f.ctl, KVM_PROTO_HEARTBEAT, 60000);
    ck_assert_msg(m != NULL, "no heartbeat:\n%s", (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
    kvm_msg_free(&m);
    const double t0 = kvm_now_ms();
    int beats = 0;
    while (beats < 3 && (m = router_expect(f.ctl, KVM_PROTO_HEARTBEAT, 5000)) != NULL) {
        kvm_msg_free(&m);
        beats++;
    }
    const double ms = kvm_now_ms() - t0;
    ck_assert_msg(beats == 3 && ms < 2000, "%d heartbeats in %.0f ms (want 3 at 100 ms, not 1000)", beats, ms);
    fake_orch_end(&f);
}
END_TEST

/* The next heartbeat on ROUTER sock within ms that says `stopping` and `probe` (PROTOCOL.md §5,
 * revision 15); 1 when one came. */
static int probe_within(void *sock, int ms)
{
    for (double end = kvm_now_ms() + ms; kvm_now_ms() < end;) {
        kvm_msg *m = router_expect(sock, KVM_PROTO_HEARTBEAT, (int)(end - kvm_now_ms()) + 1);
        kvm_proto_heartbeat hb;
        const int probe = m && !kvm_proto_heartbeat_decode(m, &hb) && hb.stopping && hb.probe;
        kvm_msg_free(&m);
        if (probe) return 1;
    }
    return 0;
}

/* Sends worker dec-drain behind ROUTER sock an ack, job 0: stopping (the answer to a probe) or
 * not (a welcome), naming revision rev (0: none, an older orchestrator). */
static void ack_to(void *sock, int stopping, uint64_t rev)
{
    kvm_proto_ack a = {.worker_id = kvm_proto_str_c("dec-drain"),
                       .stage = kvm_proto_str_c("serve"),
                       .pid = 1,
                       .stopping = stopping,
                       .revision = rev};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_ack_encode(&a, &m), 0);
    router_send(sock, "dec-drain", m);
}

/* A worker is heard or not (PROTOCOL.md §5, revision 15). An orchestrator that welcomes none
 * (_i = 0: an older one, revision 14) is probed once on the data socket; its answer, without
 * `revision`, says it hears the worker: the worker says so and probes no more. One that answers
 * nothing (_i = 1: another process holds the worker's id there) gets the control socket's
 * connection made again, with its ready, and a line naming the id. One that welcomes (_i = 2,
 * revision 15) is said to be connected at once ("connected to", where it waited for a first
 * job), probed once on the data socket while no job comes, and not again once it answers. One
 * that welcomes but does not answer the probe gets the ready again: welcomed again (_i = 3), the
 * data socket is connected again; not (_i = 4: stalled, it may hold a credit), it is not. A probe
 * out when its orchestrator is replaced (_i = 5) is void: the new one welcomes the ready sent
 * again, gets credits, and no connection is made again (a stale probe timed out after the
 * welcome and closed both connections, and no look followed: the worker was never heard). */
START_TEST(test_worker_heard_or_not)
{
    fake_orch f;
    fake_orch_start(&f);
    fake_orch_credit(&f);
    char *log = NULL;
    kvm_msg *first = router_expect(f.ctl, KVM_PROTO_READY, 10000); /* the ready at its start */
    ck_assert_ptr_nonnull(first);
    kvm_msg_free(&first);
    if (_i == 5) { /* a probe out to an orchestrator that answers nothing, which another replaces */
        ck_assert_msg(probe_within(f.data, 15000), "no probe on the data socket:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
        char base[4300], ctl[4300], data[4300];
        snprintf(base, sizeof base, "ipc://%s", f.dir);
        ck_assert_int_eq(kvm_stage_endpoints(base, ctl, data, sizeof ctl), 0);
        fake_orch_vanish(&f);
        int linger = 0;
        zmq_setsockopt(f.ctl, ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(f.data, ZMQ_LINGER, &linger, sizeof linger);
        ck_assert_int_eq(zmq_bind(f.ctl, ctl), 0);
        ck_assert_int_eq(zmq_bind(f.data, data), 0);
        kvm_msg *m = router_expect(f.ctl, KVM_PROTO_READY, 15000); /* its ready again, to the new one */
        ck_assert_msg(m != NULL, "no ready to the new orchestrator:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
        kvm_msg_free(&m);
        ack_to(f.ctl, 0, 15);
        m = router_expect(f.data, KVM_PROTO_READY, 3000); /* the old probe void: it asks for work at once */
        ck_assert_msg(m != NULL, "no credit to the new orchestrator:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
        kvm_msg_free(&m);
        for (double end = kvm_now_ms() + 25000; kvm_now_ms() < end;) { /* as a run: readies welcomed, */
            if ((m = router_expect(f.ctl, KVM_PROTO_READY, 200)) != NULL) ack_to(f.ctl, 0, 15);
            kvm_msg_free(&m);
            if (probe_within(f.data, 200)) ack_to(f.data, 1, 15); /* probes answered */
        }
        log = kvm_test_read_file(f.logp, NULL);
        const char *after = strstr(log, "answered neither") ? strstr(log, "answered neither") + 1 : log;
        ck_assert_msg(!strstr(after, "again"), "a connection made again with the new orchestrator:\n%s", log);
        free(log);
        fake_orch_end(&f);
        return;
    }
    if (_i >= 3) { /* welcomed; the data socket is not heard (3), or the orchestrator stalls (4) */
        ack_to(f.ctl, 0, 15);
        ck_assert_msg(probe_within(f.data, 15000), "no probe on the data socket:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
        kvm_msg *again = router_expect(f.ctl, KVM_PROTO_READY, 25000); /* unanswered: is it still there? */
        ck_assert_msg(again != NULL, "no ready again on the control socket:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
        kvm_msg_free(&again);
        if (_i == 3) ack_to(f.ctl, 0, 15);
        const int said = kvm_test_wait_text(f.logp, "did not answer a probe on the data socket", 1, _i == 3 ? 10 : 15);
        log = kvm_test_read_file(f.logp, NULL);
        /* only a running orchestrator's silence means the data socket is not heard: a stalled one
         * may hold a credit, which a new connection would lose */
        ck_assert_msg(said == (_i == 3), "%s", log);
        free(log);
        fake_orch_end(&f);
        return;
    }
    if (_i == 2) {
        ack_to(f.ctl, 0, 15);
        ck_assert_msg(kvm_test_wait_text(f.logp, "connected to", 1, 5), "no 'connected' at the welcome:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
    }
    ck_assert_msg(probe_within(f.data, 15000), "no probe on the data socket:\n%s",
                  (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
    if (_i != 1) {
        ack_to(f.data, 1, _i == 2 ? 15 : 0);
        fake_orch_credit(&f); /* it asks for work again */
        ck_assert_msg(!probe_within(f.data, 12000), "probed again after an answer");
        log = kvm_test_read_file(f.logp, NULL);
        ck_assert_msg((_i == 0) == (strstr(log, "runs an older kvmill") != NULL), "%s", log);
        ck_assert_msg(!strstr(log, "again"), "a connection made again:\n%s", log);
    } else {
        /* the ready again, on a new connection of the control socket */
        kvm_msg *m = router_expect(f.ctl, KVM_PROTO_READY, 20000);
        ck_assert_msg(m != NULL, "no ready again on the control socket:\n%s",
                      (log = kvm_test_read_file(f.logp, NULL)) ? log : "");
        kvm_msg_free(&m);
        log = kvm_test_read_file(f.logp, NULL);
        ck_assert_msg(strstr(log, "answered neither this worker's ready nor a probe") &&
                          strstr(log, "another process may hold worker id dec-drain"),
                      "%s", log);
    }
    free(log);
    fake_orch_end(&f);
}
END_TEST

static Suite *worker_suite(void)
{
    Suite *s = suite_create("worker");
    TCase *tw = tcase_create("calib_wire");
    tcase_add_test(tw, test_calib_wire);
    TCase *tr = tcase_create("rm_stale_missing_model");
    tcase_add_test(tr, test_rm_stale_missing_model);
    suite_add_tcase(s, tr);
    tr = tcase_create("sweep_keeps_kept_run_dir");
    tcase_add_test(tr, test_sweep_keeps_kept_run_dir);
    suite_add_tcase(s, tr);
    tr = tcase_create("stage_log_names_document_and_bytes");
    tcase_add_test(tr, test_stage_log_names_document_and_bytes);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("run_ends_its_workers_work");
    tcase_add_test(tr, test_run_ends_its_workers_work);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("worker_handshake_reported");
    tcase_add_test(tr, test_worker_handshake_reported);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("worker_wrong_endpoint");
    tcase_add_test(tr, test_worker_wrong_endpoint);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("decode_answers_only_asks");
    tcase_add_test(tr, test_decode_answers_only_asks);
    tcase_set_timeout(tr, 150);
    suite_add_tcase(s, tr);
    tr = tcase_create("job_cut_on_the_wire");
    tcase_add_test(tr, test_job_cut_on_the_wire);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("worker_leaves_after_run");
    tcase_add_test(tr, test_worker_leaves_after_run);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("worker_leaves_after_rejoin");
    tcase_add_test(tr, test_worker_leaves_after_rejoin);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("stopping_worker_waits_for_end_of_work");
    /* _i: end of work sent, or not; SIGHUP */
    tcase_add_loop_test(tr, test_stopping_worker_waits_for_end_of_work, 0, 4);
    tcase_set_timeout(tr, 150);
    suite_add_tcase(s, tr);
    tr = tcase_create("worker_heard_or_not");
    /* _i: revision 14, nothing, revision 15; welcomed but data unheard, and stalled */
    tcase_add_loop_test(tr, test_worker_heard_or_not, 0, 6);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("heartbeat_from_config");
    tcase_add_test(tr, test_heartbeat_from_config);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("stop_never_connected");
    tcase_add_test(tr, test_stop_never_connected);
    tcase_set_timeout(tr, 60);
    suite_add_tcase(s, tr);
    tr = tcase_create("stopping_worker_orchestrator_gone");
    tcase_add_test(tr, test_stopping_worker_orchestrator_gone);
    tcase_set_timeout(tr, 120);
    suite_add_tcase(s, tr);
    tr = tcase_create("multi_gpu_example_runs");
    tcase_add_test(tr, test_multi_gpu_example_runs);
    tcase_set_timeout(tr, 150);
    suite_add_tcase(s, tr);
    suite_add_tcase(s, tw);
    TCase *tc = tcase_create("every_method");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_every_method);
    suite_add_tcase(s, tc);
    tc = tcase_create("short_document_kept_full");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_short_document_kept_full);
    suite_add_tcase(s, tc);
    tc = tcase_create("decode_policy_keeps_budget");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, test_decode_policy_keeps_budget);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return kvm_test_run_suite(worker_suite()); }
