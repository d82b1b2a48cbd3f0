/* check_serve.c: cache serving end to end: a store populated in-process, `kvmill serve`
 * (broker + kvmill-decode workers) over ipc:// in a temporary run directory, `kvmill ask`
 * as the client. Answers must equal an in-process decode over the same stored cache;
 * limits, missing caches and garbage get error answers; CurveZMQ keys admit only
 * authorized clients; a non-local bind without keys is refused. */
#include "common/kvm_error.h"
#include "model/kvm_forward.h"
#include "model/kvm_sampler.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_corpus.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_serve_cache.h"
#include "pipeline/kvm_worker.h"
#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sched.h> /* CLONE_NEWNS, without _GNU_SOURCE */
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <libgen.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

/* Per-test state: a temporary folder with the config, the store, the run directory. */
static char *g_dir;
static char g_cfg[4096], g_front[4200], g_log[4200], g_doc[4096];
static pid_t g_serve;
static char g_ro_mount[4200]; /* a read-only bind mount for teardown to undo, or "" */

static const char *kvmill(void)
{
    static char b[4096];
    snprintf(b, sizeof b, "%s/kvmill", kvm_test_bin());
    return b;
}

/* Writes the test config: the tiny model at context 128, method full, fast heartbeats,
 * plus `extra` INI lines (sections allowed; later keys of a section are appended). */
static int g_liveness = 30, g_grace_s = 5; /* [run] liveness and grace_s of write_config */
static int g_context = 128;                /* [model] context of write_config */

static void write_config(const char *serve_extra, const char *extra)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = %d\n"
             "[compress]\nmethod = full\n"
             "[store]\npath = %s/store\nmap_size_mb = 8\n"
             "[stages]\nbin_dir = %s\n"
             "[run]\nrun_dir = %s/run\nheartbeat_ms = 100\nliveness = %d\ngrace_s = %d\n"
             "[serve]\nmax_prompt_tokens = 8\nmax_new_tokens = 400\nrequest_timeout_s = 15\n%s\n%s\n",
             kvm_test_data_path("models/stories260K.bin"), g_context, g_dir, kvm_test_bin(), g_dir, g_liveness,
             g_grace_s, serve_extra ? serve_extra : "", extra ? extra : "");
    snprintf(g_cfg, sizeof g_cfg, "%s/test.ini", g_dir);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    /* the store exists, empty at first (serve refuses one that does not) */
    char sp[4200];
    snprintf(sp, sizeof sp, "%s/store", g_dir);
    kvm_test_store_create(sp);
}

static void setup(void)
{
    kvm_test_serve_dirs(&g_dir, g_front, sizeof g_front, g_log, sizeof g_log);
    snprintf(g_doc, sizeof g_doc, "%s", kvm_test_data_path("corpus/doc_000.txt"));
    g_serve = 0;
    g_liveness = 30;
    g_grace_s = 5;
    g_context = 128;
}

static void teardown(void)
{
    if (g_serve > 0) { /* stopped before the read-only mount goes */
        kill(g_serve, SIGTERM);
        waitpid(g_serve, NULL, 0);
        g_serve = 0;
    }
    if (g_ro_mount[0]) umount2(g_ro_mount, MNT_DETACH);
    g_ro_mount[0] = '\0';
    kvm_test_serve_cleanup(g_serve, g_dir);
}

/* The model, tokenizer, ids and store a test needs in-process. */
typedef struct env {
    kvm_config *cfg;
    kvm_store *store;
    kvm_worker_model wm;
    kvm_doc doc;
} env;

static void env_open(env *e, const char *doc_path)
{
    memset(e, 0, sizeof *e);
    ck_assert_msg(kvm_config_load(g_cfg, &e->cfg) == 0, "%s", kvm_errmsg());
    kvm_store_opts so = {.no_sync = 1};
    ck_assert_msg(kvm_store_open(kvm_config_str(e->cfg, "store", "path"), &so, &e->store) == 0, "%s", kvm_errmsg());
    ck_assert_msg(kvm_worker_model_get(&e->wm, e->cfg, e->store) == 0, "%s", kvm_errmsg());
    ck_assert_ptr_nonnull(e->wm.tok);
    size_t n = 0;
    e->doc.name = "doc";
    e->doc.text = kvm_test_read_file(doc_path, &n);
    ck_assert_ptr_nonnull(e->doc.text);
    e->doc.text_len = n;
    const kvm_model_config *c = &e->wm.model->cfg;
    ck_assert_msg(
        kvm_doc_prepare(&e->doc, e->wm.tok, c->vocab_size, c->bos_id, kvm_config_int(e->cfg, "model", "context")) == 0,
        "%s", kvm_errmsg());
}

static void env_close(env *e)
{
    free(e->doc.text);
    free(e->doc.tokens);
    kvm_worker_model_free(&e->wm);
    kvm_store_close(&e->store);
    kvm_config_free(&e->cfg);
}

/* Stores the document's cache as `kvmill run` would with method full. */
static void populate(const char *doc_path)
{
    env e;
    env_open(&e, doc_path);
    const kvm_model *m = e.wm.model;
    int64_t N = e.doc.n_tokens;
    kvm_forward *f = NULL;
    kvm_kvcache *full = NULL, *cc = NULL;
    ck_assert_int_eq(kvm_forward_new(m, NULL, N, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(m, N, &full), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, full, e.doc.tokens, N, NULL, KVM_LOGITS_NONE), 0);
    kvm_compress_input ci = {.model = m, .full = full, .n_tokens = N, .n_future = 16};
    ck_assert_msg(kvm_worker_compress(e.cfg, &ci, e.store, &e.wm.model_id, &cc) == 0, "%s", kvm_errmsg());
    ck_assert_msg(kvm_serve_cache_store(e.store, e.cfg, &e.wm, e.doc.tokens, N, cc, NULL) == 0, "%s", kvm_errmsg());
    kvm_kvcache_free(&cc);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
    env_close(&e);
}

/* In-process greedy decode over the stored cache, written independently of the worker:
 * store frames -> cache messages -> ragged cache (converted to kv_dtype), prompt prefill,
 * argmax loop (stops at BOS). */
static char *reference_kv(const char *doc_path, const char *prompt, int64_t n_new, kvm_kv_dtype kv_dtype)
{
    env e;
    env_open(&e, doc_path);
    const kvm_model *m = e.wm.model;
    kvm_store_id config_id;
    ck_assert_int_eq(kvm_jobcfg_config_id(e.cfg, NULL, &config_id, NULL, NULL), 0);
    kvm_store_cache_key key = {.model_id = e.wm.model_id, .doc_hash = e.doc.hash, .config_id = config_id};
    kvm_store_cache *sc = NULL;
    ck_assert_msg(kvm_store_get_cache(e.store, &key, &e.wm.tok_id, &sc) == 0, "%s", kvm_errmsg());
    kvm_kvcache *cache = NULL;
    ck_assert_int_eq(kvm_forward_cache_new(m, 8, &cache), 0);
    for (int l = 0; l < sc->manifest.n_layers; l++) {
        kvm_msg *msg = NULL;
        ck_assert_int_eq(kvm_msg_new(&msg), 0);
        for (uint32_t f = 0; f < sc->layers[l].n_frames; f++)
            ck_assert_int_eq(kvm_msg_add_copy(msg, sc->layers[l].frames[f].data, sc->layers[l].frames[f].size), 0);
        ck_assert_msg(kvm_cachecodec_decode_layer(msg, l, cache) == 0, "%s", kvm_errmsg());
        kvm_msg_free(&msg);
    }
    cache->next_pos = (int32_t)e.doc.n_tokens;
    ck_assert_int_eq(kvm_kvcache_convert(cache, kv_dtype), 0);
    kvm_store_cache_free(&sc);
    int32_t *p = NULL, *gen = malloc((size_t)(n_new + 1) * sizeof *gen);
    int64_t np = 0, ng = 0;
    ck_assert_int_eq(kvm_tokenizer_encode(e.wm.tok, prompt, strlen(prompt), 0, 0, &p, &np), 0);
    float *logits = malloc((size_t)m->cfg.vocab_size * sizeof *logits);
    kvm_forward *f = NULL;
    ck_assert_int_eq(kvm_forward_new(m, NULL, np, &f), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, cache, p, np, logits, KVM_LOGITS_LAST), 0);
    while (ng < n_new) {
        int32_t next = kvm_argmax(logits, m->cfg.vocab_size);
        if (next == m->cfg.bos_id) break;
        gen[ng++] = next;
        if (ng == n_new) break;
        ck_assert_int_eq(kvm_forward_decode(f, cache, next, logits), 0);
    }
    char *text = NULL;
    size_t len = 0;
    ck_assert_int_eq(kvm_tokenizer_decode(e.wm.tok, gen, ng, &text, &len), 0);
    kvm_forward_free(&f);
    kvm_kvcache_free(&cache);
    free(logits);
    free(p);
    free(gen);
    env_close(&e);
    return text;
}

static char *reference(const char *doc_path, const char *prompt, int64_t n_new)
{
    return reference_kv(doc_path, prompt, n_new, KVM_KV_F32);
}

/* Starts `kvmill serve` (stderr into g_log) and waits up to 30 s for its "ready" line.
 * Returns the exit status instead when it exits first (then g_serve is 0). */
static int start_serve(const char *bind)
{
    const char *args[] = {"--config", g_cfg, "--bind", bind ? bind : g_front, NULL};
    return kvm_test_serve_start(args, g_log, 30, &g_serve);
}

/* Stops the server with SIGTERM; returns its exit status. */
static int stop_serve(void)
{
    int st = 0;
    kill(g_serve, SIGTERM);
    ck_assert_int_eq(waitpid(g_serve, &st, 0), g_serve);
    g_serve = 0;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Runs kvmill ask against g_front; extra options appended verbatim. */
static int ask(const char *doc, const char *prompt, int64_t n, const char *extra, char **out, char **err)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' --prompt '%s' -n %lld --timeout 30 %s", kvmill(),
             g_front, doc, prompt, (long long)n, extra ? extra : "");
    return kvm_test_run(cmd, out, err);
}

static void assert_contains(const char *hay, const char *needle)
{
    ck_assert_msg(hay && strstr(hay, needle), "expected \"%s\" in:\n%s", needle, hay ? hay : "(null)");
}

static void assert_lacks(const char *hay, const char *needle)
{
    ck_assert_msg(hay && !strstr(hay, needle), "did not expect \"%s\" in:\n%s", needle, hay ? hay : "(null)");
}

/* ---- tests ---- */

START_TEST(test_answer_equals_inprocess)
{
    write_config(NULL, NULL);
    populate(g_doc);
    char *want = reference(g_doc, "Then the", 24);
    ck_assert_int_eq(start_serve(NULL), -1);
    for (int round = 0; round < 2; round++) { /* the second answer comes from a warm worker */
        char *out = NULL, *err = NULL;
        int rc = ask(g_doc, "Then the", 24, NULL, &out, &err);
        ck_assert_msg(rc == 0, "ask exited %d: %s", rc, err);
        size_t n = strlen(out);
        ck_assert_msg(n > 0 && out[n - 1] == '\n', "answer not newline-terminated: '%s'", out);
        out[n - 1] = '\0';
        ck_assert_str_eq(out, want);
        assert_contains(err, "prefill");
        free(out);
        free(err);
    }
    ck_assert_msg(strlen(want) > 0, "the reference generated nothing");
    free(want);
    ck_assert_int_eq(stop_serve(), 0);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "answered by");
    assert_contains(log, "kvmill serve: stopped");
    free(log);
}
END_TEST

/* SIGHUP (the terminal serve was started from closed) killed it at once: no drain, its decode
 * workers left to notice, its ipc:// socket files left behind. It stops as on SIGTERM now. */
START_TEST(test_sighup_stops_cleanly)
{
    write_config(NULL, NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    kill(g_serve, SIGHUP);
    int st = 0;
    ck_assert_int_eq(waitpid(g_serve, &st, 0), g_serve);
    g_serve = 0;
    char *log = kvm_test_read_file(g_log, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, log);
    assert_contains(log, "stopping (letting workers finish)");
    assert_contains(log, "kvmill serve: stopped");
    free(log);
    /* started under nohup (SIGHUP ignored, inherited across exec): it stays up */
    signal(SIGHUP, SIG_IGN);
    ck_assert_int_eq(start_serve(NULL), -1);
    signal(SIGHUP, SIG_DFL);
    kill(g_serve, SIGHUP);
    kill(g_serve, SIGHUP);
    usleep(1500000);
    ck_assert_msg(waitpid(g_serve, &st, WNOHANG) == 0, "serve under nohup stopped on SIGHUP: status %d", st);
    ck_assert_int_eq(stop_serve(), 0);
}
END_TEST

/* A compacted copy moved in place of the store while serve runs (README says to stop first;
 * nothing noticed when one did not): the decode worker went on answering from the file moved
 * away, the caches stored since missing and removed ones still served. It opens the store
 * again when its path names another data.mdb: an empty store moved in answers "compress it
 * first"; the first one moved back answers again. */
START_TEST(test_store_replaced_under_serve)
{
    write_config(NULL, NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *out = NULL, *err = NULL;
    int rc = ask(g_doc, "Then the", 8, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask exited %d: %s", rc, err);
    free(out);
    free(err);
    char sp[4200], old[4300], fresh[4300];
    snprintf(sp, sizeof sp, "%s/store", g_dir);
    snprintf(old, sizeof old, "%s/store.old", g_dir);
    snprintf(fresh, sizeof fresh, "%s/store.new", g_dir);
    kvm_test_store_create(fresh);
    ck_assert_int_eq(rename(sp, old), 0);
    ck_assert_int_eq(rename(fresh, sp), 0);
    rc = ask(g_doc, "Then the", 8, NULL, &out, &err);
    ck_assert_msg(rc != 0 && strstr(err, "compress it first"), "ask over the empty store moved in: exit %d: %s%s", rc,
                  out, err);
    free(out);
    free(err);
    ck_assert_int_eq(rename(sp, fresh), 0);
    ck_assert_int_eq(rename(old, sp), 0);
    rc = ask(g_doc, "Then the", 8, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask over the first store moved back: exit %d: %s", rc, err);
    free(out);
    free(err);
    /* moved away, nothing put back: refused naming why (it answered from the folder moved away,
     * and a computed cache would have gone there) */
    ck_assert_int_eq(rename(sp, old), 0);
    rc = ask(g_doc, "Then the", 8, NULL, &out, &err);
    ck_assert_msg(rc != 0 && strstr(err, "is gone since this process opened it"), "ask with no store: exit %d: %s%s",
                  rc, out, err);
    free(out);
    free(err);
    ck_assert_int_eq(rename(old, sp), 0);
    rc = ask(g_doc, "Then the", 8, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask over the store put back: exit %d: %s", rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(stop_serve(), 0);
    char *log = kvm_test_read_file(g_log, NULL);
    /* one line per worker that saw a swap (the asks may go to different workers) */
    ck_assert_msg(kvm_test_count(log, "was replaced since this worker opened it") >= 1, "%s", log);
    free(log);
}
END_TEST

/* kvmill ask refused a prompt that is not UTF-8 ("--prompt is not UTF-8 text", exit 2) where
 * kvmill generate takes its bytes (the tokenizer falls back to bytes): the bytes now reach the
 * worker as they are (prompt_bytes), and the answer is the in-process decode of that prompt,
 * from --prompt and from --prompt-file alike. */
START_TEST(test_answer_prompt_not_utf8)
{
    write_config(NULL, NULL);
    populate(g_doc);
    const char *prompt = "Then caf\xe9 the";
    char *want = reference(g_doc, prompt, 24), *lossy = reference(g_doc, "Then caf\xef\xbf\xbd the", 24);
    printf("prompt not UTF-8: its answer %s the one with U+FFFD in its place\n",
           strcmp(want, lossy) ? "differs from" : "equals");
    char pf[4300], extra[4400];
    snprintf(pf, sizeof pf, "%s/prompt.txt", g_dir);
    ck_assert_int_eq(kvm_test_write_file(pf, prompt, strlen(prompt)), 0);
    ck_assert_int_eq(start_serve(NULL), -1);
    for (int from_file = 0; from_file < 2; from_file++) {
        char *out = NULL, *err = NULL, cmd[8192];
        snprintf(extra, sizeof extra, "--prompt-file '%s'", pf);
        snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' %s%s%s -n 24 --timeout 30", kvmill(), g_front,
                 g_doc, from_file ? extra : "--prompt '", from_file ? "" : prompt, from_file ? "" : "'");
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 0, "ask (%s) exited %d: %s", from_file ? "--prompt-file" : "--prompt", rc, err);
        size_t n = strlen(out);
        ck_assert_msg(n > 0 && out[n - 1] == '\n', "answer not newline-terminated: '%s'", out);
        out[n - 1] = '\0';
        ck_assert_str_eq(out, want);
        free(out);
        free(err);
    }
    ck_assert_msg(strlen(want) > 0, "the reference generated nothing");
    free(want);
    free(lossy);
    ck_assert_int_eq(stop_serve(), 0);
}
END_TEST

/* [model] kv_dtype = f16 on a cache stored in f16 ([store] dtype): the worker keeps it 16-bit
 * while decoding and answers as the in-process decode over an f16 cache does; a bad value
 * stops serve before it is ready, naming the key. */
START_TEST(test_answer_f16_cache)
{
    write_config(NULL, "[model]\nkv_dtype = f16\n[store]\ndtype = f16\n");
    populate(g_doc);
    char *want = reference_kv(g_doc, "Then the", 24, KVM_KV_F16), *want32 = reference(g_doc, "Then the", 24);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *out = NULL, *err = NULL;
    int rc = ask(g_doc, "Then the", 24, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask exited %d: %s", rc, err);
    size_t n = strlen(out);
    ck_assert_msg(n > 0 && out[n - 1] == '\n', "answer not newline-terminated: '%s'", out);
    out[n - 1] = '\0';
    ck_assert_str_eq(out, want);
    ck_assert_msg(strlen(want) > 0, "the reference generated nothing");
    printf("serve with kv_dtype = f16: the answer %s the float32 cache's\n", strcmp(want, want32) ? "differs from" : "equals");
    free(out);
    free(err);
    free(want);
    free(want32);
    ck_assert_int_eq(stop_serve(), 0);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "caches stay f16 in memory while decoding");
    free(log);
    write_config(NULL, "[model]\nkv_dtype = bf16\n");
    unlink(g_log); /* the first server's "ready" line must not count */
    ck_assert_int_eq(start_serve(NULL), 2);
    log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "kv_dtype");
    assert_contains(log, "bf16");
    free(log);
}
END_TEST

/* `kvmill run` stores the cache through the pipeline stages; serve must find it (same
 * tokenisation, truncation, hash and config id) and answer as the in-process decode does. */
START_TEST(test_run_then_serve)
{
    write_config(NULL, NULL);
    char corpus[4200], cmd[9000], *out = NULL, *err = NULL;
    snprintf(corpus, sizeof corpus, "%s/corpus", g_dir);
    snprintf(cmd, sizeof cmd, "mkdir '%s' && cp '%s' '%s/'", corpus, g_doc, corpus);
    ck_assert_int_eq(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "'%s' run --config '%s' --corpus '%s'", kvmill(), g_cfg, corpus);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "kvmill run exited %d: %s", rc, err);
    assert_contains(out, "summary: compressed=1 ");
    free(out);
    free(err);
    char *want = reference(g_doc, "Then the", 16);
    ck_assert_int_eq(start_serve(NULL), -1);
    rc = ask(g_doc, "Then the", 16, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask exited %d: %s", rc, err);
    out[strlen(out) - 1] = '\0';
    ck_assert_str_eq(out, want);
    free(want);
    free(out);
    free(err);
}
END_TEST

START_TEST(test_missing_cache)
{
    write_config(NULL, NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *out = NULL, *err = NULL;
    ck_assert_int_eq(ask(g_doc, "Then", 8, NULL, &out, &err), 1);
    assert_contains(err, "no compressed cache for this document");
    assert_contains(err, "compute_missing");
    ck_assert_str_eq(out, "");
    free(out);
    free(err);
}
END_TEST

START_TEST(test_compute_missing)
{
    write_config("compute_missing = true", NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *out = NULL, *err = NULL;
    int rc = ask(g_doc, "Then the", 16, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask exited %d: %s", rc, err);
    ck_assert_int_eq(stop_serve(), 0);
    /* the worker stored what it computed: the reference decodes the same from the store */
    char *want = reference(g_doc, "Then the", 16);
    out[strlen(out) - 1] = '\0';
    ck_assert_str_eq(out, want);
    free(want);
    free(out);
    free(err);
}
END_TEST

/* compute_missing with a store that does not exist yet and [store] cap_mb set: the decode worker
 * that made the store keeps a store's cap as it finds it (none), and serve recorded its cap only
 * in a store that existed, so the store grew without the cap for the whole session. */
START_TEST(test_compute_missing_new_store_cap)
{
    write_config("compute_missing = true", NULL);
    size_t n = 0;
    char *text = kvm_test_read_file(g_cfg, &n), sp[4200], cmd[8400];
    char *at = strstr(text, "map_size_mb = 8\n");
    ck_assert_ptr_nonnull(at);
    char fixed[9000];
    snprintf(fixed, sizeof fixed, "%.*smap_size_mb = 8\ncap_mb = 1\n%s", (int)(at - text), text,
             at + strlen("map_size_mb = 8\n"));
    free(text);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, fixed, strlen(fixed)), 0);
    snprintf(sp, sizeof sp, "%s/store", g_dir);
    kvm_test_rmtree(sp);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *out = NULL, *err = NULL;
    int rc = ask(g_doc, "Then the", 4, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask exited %d: %s", rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(stop_serve(), 0);
    snprintf(cmd, sizeof cmd, "'%s' store stats --store '%s'", kvmill(), sp);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_msg(strstr(out, "cap_bytes       1048576"), "%s", out);
    free(out);
}
END_TEST

START_TEST(test_prompt_too_long)
{
    write_config(NULL, NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *err = NULL;
    ck_assert_int_eq(ask(g_doc, "one two three four five six seven eight nine ten eleven", 4, NULL, NULL, &err), 1);
    assert_contains(err, "max_prompt_tokens");
    free(err);
}
END_TEST

START_TEST(test_too_many_new_tokens)
{
    write_config(NULL, NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *err = NULL;
    ck_assert_int_eq(ask(g_doc, "Then", 401, NULL, NULL, &err), 1);
    assert_contains(err, "[serve] max_new_tokens");
    free(err);
}
END_TEST

START_TEST(test_window_overflow)
{
    write_config(NULL, NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *err = NULL, *out = NULL;
    /* 128 context + 2 prompt + 390 new > 512: an error, not a truncation */
    ck_assert_int_eq(ask(g_doc, "Then", 390, NULL, &out, &err), 1);
    assert_contains(err, "exceeds the model's window of 512 tokens");
    ck_assert_str_eq(out, "");
    free(err);
    free(out);
    /* right at the window it is answered */
    ck_assert_int_eq(ask(g_doc, "Then", 382, NULL, NULL, &err), 0);
    free(err);
}
END_TEST

/* Sends raw frames to the front end and waits up to 5 s for one reply message. */
static kvm_msg *raw_request(const void *const *frames, const size_t *sizes, int n)
{
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    ck_assert_int_eq(zmq_connect(s, g_front), 0);
    for (int i = 0; i < n; i++)
        ck_assert_int_ge(zmq_send(s, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0), 0);
    kvm_msg *m = NULL;
    zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 5000) == 1) ck_assert_int_eq(kvm_msg_recv(s, &m, 0), 0);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return m;
}

START_TEST(test_garbage)
{
    write_config(NULL, NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    /* messages whose request id cannot be read (not MessagePack, another protocol version, a
     * map declaring 2^32 entries, more parts than a message may have) were logged and dropped,
     * the client waiting for its timeout: each gets an error answer for request 0 naming why */
    const unsigned char v2[] = {0x82, 0xa1, 'v', 0x02, 0xa4, 't', 'y', 'p', 'e', 0xa3, 'a', 's', 'k'};
    const unsigned char huge_map[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
    static const char part[] = "x";
    const void *many[70];
    size_t many_sizes[70];
    for (int i = 0; i < 70; i++)
        many[i] = part, many_sizes[i] = 1;
    const struct {
        const void *const *frames;
        const size_t *sizes;
        int n;
        const char *why;
    } unreadable[] = {{(const void *[]){"\xc1\xff garbage"}, (size_t[]){10}, 1, "expected a MessagePack map"},
                      {(const void *[]){v2}, (size_t[]){sizeof v2}, 1, "unsupported protocol version 2"},
                      {(const void *[]){huge_map}, (size_t[]){sizeof huge_map}, 1, "malformed request"},
                      {many, many_sizes, 70, "more than 64 parts"}};
    kvm_msg *m = NULL;
    kvm_proto_answer ans;
    for (size_t i = 0; i < sizeof unreadable / sizeof *unreadable; i++) {
        m = raw_request(unreadable[i].frames, unreadable[i].sizes, unreadable[i].n);
        ck_assert_msg(m != NULL, "no answer to unreadable message %zu (%s)", i, unreadable[i].why);
        ck_assert_int_eq(kvm_proto_answer_decode(m, &ans), 0);
        ck_assert_int_eq((int)ans.request_id, 0);
        ck_assert_int_eq(ans.status, KVM_EPROTO);
        ck_assert_msg(ans.message.len && strstr(ans.message.ptr, unreadable[i].why), "message %zu: %.*s", i,
                      (int)ans.message.len, ans.message.ptr);
        kvm_msg_free(&m);
    }
    /* an ask with a readable request id but missing fields: answered with an error */
    kvm_proto_ask a = {
        .request_id = 77, .doc_text = kvm_proto_str_c("x"), .prompt = kvm_proto_str_c("y"), .max_new_tokens = 1};
    kvm_msg *good = NULL;
    ck_assert_int_eq(kvm_proto_ask_encode(&a, &good), 0);
    kvm_frame h = kvm_msg_frame(good, 0);
    /* keep the map header and the first key/value pairs only: a truncated map */
    const void *f2[1] = {h.data};
    size_t s2[1] = {h.size - 3};
    m = raw_request(f2, s2, 1);
    kvm_msg_free(&good);
    ck_assert_ptr_nonnull(m);
    ck_assert_int_eq(kvm_proto_answer_decode(m, &ans), 0);
    ck_assert_int_eq((int)ans.request_id, 77);
    ck_assert_int_lt(ans.status, 0);
    kvm_msg_free(&m);
    /* the server keeps answering */
    char *err = NULL;
    int rc = ask(g_doc, "Then", 4, NULL, NULL, &err);
    ck_assert_msg(rc == 0, "ask after garbage exited %d: %s", rc, err);
    free(err);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "refused an unreadable message from a client (answered as request 0)");
    assert_contains(log, "request 77 refused");
    free(log);
    /* a client sending garbage in a loop: every message answered, at most 20 lines a minute
     * logged (5 so far) */
    for (int i = 0; i < 20; i++) {
        m = raw_request(unreadable[0].frames, unreadable[0].sizes, 1);
        ck_assert_msg(m != NULL, "no answer to garbage %d", i);
        kvm_msg_free(&m);
    }
    log = kvm_test_read_file(g_log, NULL);
    int lines = 0;
    for (const char *p = log; (p = strstr(p, "refused an unreadable message")); p++)
        lines++;
    ck_assert_int_eq(lines, 4 + 15);
    free(log);
}
END_TEST

/* Monotonic seconds, for how long an ask took. */
static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* `kvmill ask --connect g_front --timeout 30 ARGS`, stderr into *err; *secs: how long it took. A
 * generous --timeout: an answer must come (under SAN=1 or load a round trip can take seconds),
 * and one that came "at once" is told from none by *secs and by ask's "no answer". */
static int ask_timed(const char *args, char **err, double *secs)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --timeout 30 %s", kvmill(), g_front, args);
    const double t0 = mono_s();
    int rc = kvm_test_run(cmd, NULL, err);
    *secs = mono_s() - t0;
    return rc;
}

START_TEST(test_message_too_large)
{
    g_context = 512; /* 819 bytes of a story hold about 370 tokens: too few to settle 512 */
    write_config("max_message_bytes = 1024", NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *err = NULL;
    double secs = 0;
    /* the document is over 1 KiB, and its beginning that fits is too short to settle the first
     * [model] context tokens: an error answer at once naming the limit (ZeroMQ's own size
     * limit, which cut the connection and left ask waiting, is the protocol's 32 MiB header) */
    char args[12000];
    snprintf(args, sizeof args, "--doc '%s' --prompt Then -n 4", g_doc);
    int rc = ask_timed(args, &err, &secs);
    ck_assert_msg(rc == 1 && secs < 20, "ask exited %d after %.1f s (an error answer expected): %s", rc, secs, err);
    assert_contains(err, "more than this server's [serve] max_message_bytes takes: its first");
    free(err);
    ck_assert_int_eq(stop_serve(), 0);
    write_config("max_message_bytes = 2048", NULL); /* room for the 1.2 KiB latin-1 ask below */
    ck_assert_int_eq(start_serve(NULL), -1);
    /* a small document still gets answered (its cache is missing: an error answer, exit 1 with
     * a reason naming the --doc file, which the server knows by its bytes only) */
    char small[4200];
    snprintf(small, sizeof small, "%s/small.txt", g_dir);
    ck_assert_int_eq(kvm_test_write_file(small, "Once upon a time", 16), 0);
    snprintf(args, sizeof args, "--doc '%s' --prompt Then -n 4", small);
    rc = ask_timed(args, &err, &secs);
    ck_assert_msg(rc == 1, "ask exited %d after %.1f s (an error answer expected): %s", rc, secs, err);
    assert_contains(err, "no compressed cache");
    assert_contains(err, "about --doc ");
    assert_contains(err, small);
    free(err);
    /* a latin-1 prompt of 600 bytes fits too: sent as its bytes and a same-length '?' copy for
     * older servers (a U+FFFD copy, 1,800 bytes, made the ask 2.4 KiB: cut off, no answer) */
    char pf[4300], latin1[600];
    snprintf(pf, sizeof pf, "%s/latin1.txt", g_dir);
    memset(latin1, 0xe9, sizeof latin1);
    ck_assert_int_eq(kvm_test_write_file(pf, latin1, sizeof latin1), 0);
    snprintf(args, sizeof args, "--doc '%s' --prompt-file '%s' -n 4", small, pf);
    rc = ask_timed(args, &err, &secs);
    ck_assert_msg(rc == 1 && !strstr(err, "no answer"), "the latin-1 prompt's ask (exit %d after %.1f s): %s", rc, secs,
                  err);
    assert_contains(err, "the prompt has 601 tokens"); /* the decode worker's answer: the ask fit */
    assert_lacks(err, "about --doc");                  /* the prompt, not the document, is at fault */
    free(err);
}
END_TEST

START_TEST(test_nonlocal_without_keys)
{
    write_config(NULL, NULL);
    int rc = start_serve("tcp://0.0.0.0:47123");
    ck_assert_int_eq(rc, 2);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "is not local");
    assert_contains(log, "[security]");
    free(log);
}
END_TEST

/* [serve] devices: a device this host lacks is refused before anything starts (exit 2),
 * naming the key and the device */
START_TEST(test_devices_refused)
{
    if (kvm_kernels_cuda(7)) return; /* this host has such a device */
    write_config("devices = cpu,cuda:7", NULL);
    ck_assert_int_eq(start_serve(NULL), 2);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "[serve] devices: cuda:7");
    free(log);
}
END_TEST

/* Decode workers whose setup fails every time: serve gives up after three exits before connecting
 * (exit 1). The workers are a stand-in that fails at once ([stages] bin_dir): a setting every worker
 * would refuse, such as a context past the model's window, serve now refuses itself at start (exit 2,
 * naming the user's config), before any worker starts. */
START_TEST(test_worker_setup_failure)
{
    write_config(NULL, NULL);
    char *text = kvm_test_read_file(g_cfg, NULL), *ctx = text ? strstr(text, "context = 128\n") : NULL;
    ck_assert_ptr_nonnull(ctx); /* set once: a key set twice is a config error */
    memcpy(ctx, "context = 999", 13); /* beyond the model's 512 */
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    free(text);
    ck_assert_int_eq(start_serve(NULL), 2);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "test.ini: [model] context = 999 exceeds the model's window");
    ck_assert_msg(!strstr(log, "before connecting"), "%s", log);
    free(log);
    char bin[4200], exe[4300];
    snprintf(bin, sizeof bin, "%s/fakebin", g_dir);
    ck_assert_int_eq(mkdir(bin, 0755), 0);
    snprintf(exe, sizeof exe, "%s/kvmill-decode", bin);
    const char *script = "#!/bin/sh\necho 'kvmill-decode: setup failed (the test stand-in)' >&2\nexit 1\n";
    ck_assert_int_eq(kvm_test_write_file(exe, script, strlen(script)), 0);
    ck_assert_int_eq(chmod(exe, 0755), 0);
    char line[4400];
    snprintf(line, sizeof line, "bin_dir = %s", bin);
    write_config(NULL, NULL);
    text = kvm_test_read_file(g_cfg, NULL);
    char *bd = text ? strstr(text, "bin_dir = ") : NULL, *end = bd ? strchr(bd, '\n') : NULL;
    ck_assert_ptr_nonnull(end);
    char fixed[16384];
    snprintf(fixed, sizeof fixed, "%.*s%s%s", (int)(bd - text), text, line, end);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, fixed, strlen(fixed)), 0);
    free(text);
    ck_assert_int_eq(start_serve(NULL), 1);
    log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "setup failed (the test stand-in)");
    assert_contains(log, "before connecting");
    free(log);
}
END_TEST

/* Starts kvmill-decode by hand with key pair NAME against the back end; 1 when the broker
 * reports it joined within ms. The worker is stopped either way. */
static int external_worker(const char *name, int ms)
{
    char exe[4200], base[4200], sk[4200], cp[4200], cs[4200], id[64];
    snprintf(exe, sizeof exe, "%s/kvmill-decode", kvm_test_bin());
    snprintf(base, sizeof base, "ipc://%s/run", g_dir);
    snprintf(sk, sizeof sk, "%s/server.public", g_dir);
    snprintf(cp, sizeof cp, "%s/%s.public", g_dir, name);
    snprintf(cs, sizeof cs, "%s/%s.secret", g_dir, name);
    snprintf(id, sizeof id, "external-%s", name);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open("/dev/null", O_WRONLY);
        dup2(fd, 1);
        dup2(fd, 2);
        execl(exe, exe, "--connect", base, "--config", g_cfg, "--heartbeat-ms", "100", "--id", id, "--server-key", sk,
              "--client-public", cp, "--client-secret", cs, (char *)NULL);
        _exit(127);
    }
    char want[128];
    snprintf(want, sizeof want, "external decode worker %s joined", id);
    int joined = 0;
    for (int t = 0; t < ms && !joined; t += 100) {
        usleep(100000);
        char *log = kvm_test_read_file(g_log, NULL);
        joined = log && strstr(log, want);
        free(log);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return joined;
}

/* The keyed server's config: an authorized_keys folder auth (g_dir/authorized) holding the
 * .public files of the space-separated key names `listed`, and a [security] section with the
 * server's pair and, for its decode workers, worker_pub.public and worker_sec.secret (mixed up
 * when they differ); written by write_config. */
static void keyed_config(const char *listed, const char *worker_pub, const char *worker_sec, char *auth, size_t n)
{
    char cmd[9000], sec[9000], names[256];
    snprintf(auth, n, "%s/authorized", g_dir);
    snprintf(cmd, sizeof cmd, "mkdir '%s'", auth);
    ck_assert_int_eq(system(cmd), 0);
    snprintf(names, sizeof names, "%s", listed);
    for (char *save = NULL, *k = strtok_r(names, " ", &save); k; k = strtok_r(NULL, " ", &save)) {
        snprintf(cmd, sizeof cmd, "cp '%s/%s.public' '%s/'", g_dir, k, auth);
        ck_assert_int_eq(system(cmd), 0);
    }
    snprintf(sec, sizeof sec,
             "[security]\nserver_secret_key = %s/server.secret\nserver_public_key = %s/server.public\n"
             "client_public_key = %s/%s.public\nclient_secret_key = %s/%s.secret\nauthorized_keys = %s\n",
             g_dir, g_dir, g_dir, worker_pub, g_dir, worker_sec, auth);
    write_config(NULL, sec);
}

START_TEST(test_curve_keys)
{
    kvm_test_keygen(g_dir, "server");
    kvm_test_keygen(g_dir, "client");
    kvm_test_keygen(g_dir, "stranger");
    kvm_test_keygen(g_dir, "worker");
    char auth[4200], cmd[9000];
    keyed_config("client worker", "worker", "worker", auth, sizeof auth);
    /* keygen refuses to overwrite (a usage error: --force says replace) */
    snprintf(cmd, sizeof cmd, "'%s' keygen --out '%s/client'", kvmill(), g_dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 2);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    char keys[9000], *out = NULL, *err = NULL;
    snprintf(keys, sizeof keys,
             "--server-key '%s/server.public' --client-public '%s/client.public' --client-secret '%s/client.secret'",
             g_dir, g_dir, g_dir);
    int rc = ask(g_doc, "Then", 8, keys, &out, &err);
    ck_assert_msg(rc == 0, "authorized client: exit %d: %s", rc, err);
    ck_assert_int_gt((int)strlen(out), 1);
    free(out);
    free(err);
    snprintf(
        keys, sizeof keys,
        "--server-key '%s/server.public' --client-public '%s/stranger.public' --client-secret '%s/stranger.secret'",
        g_dir, g_dir, g_dir);
    rc = ask(g_doc, "Then", 8, keys, &out, &err);
    ck_assert_int_eq(rc, 1);
    assert_contains(err, "rejected");
    ck_assert_str_eq(out, "");
    free(out);
    free(err);
    /* the wrong server key (the stranger's public key): the server cannot open the handshake
     * and closes the connection; said as such rather than "no answer". The failed handshake
     * ends the ask at once; the timeout only bounds a server that never says it (20 s, not 2:
     * on a loaded machine a sanitized server can take longer than 2 s to refuse, and the ask
     * then said "no answer") */
    snprintf(keys, sizeof keys,
             "--server-key '%s/stranger.public' --client-public '%s/client.public' --client-secret '%s/client.secret' "
             "--timeout 20",
             g_dir, g_dir, g_dir);
    rc = ask(g_doc, "Then", 8, keys, &out, &err);
    ck_assert_int_eq(rc, 1);
    ck_assert_str_eq(out, "");
    assert_contains(err, "a wrong --server-key");
    free(out);
    free(err);
    /* no keys at all: the handshake fails, no answer; said as such */
    rc = ask(g_doc, "Then", 8, "--timeout 20", &out, &err);
    ck_assert_int_eq(rc, 1);
    ck_assert_str_eq(out, "");
    assert_contains(err, "CurveZMQ");
    free(out);
    free(err);
    /* workers authenticate too: a decode worker with an unknown key never joins, a listed one does */
    ck_assert_int_eq(external_worker("stranger", 1500), 0);
    ck_assert_int_eq(external_worker("worker", 8000), 1);
}
END_TEST

/* A client pair whose .public is not the .secret's half (two keygen pairs mixed up): every
 * handshake failed without a word; ask blamed the server's key (exit 1) and serve's decode
 * workers never joined, so serve sat there never ready. Both now refuse the pair (exit 2),
 * naming the two files. */
START_TEST(test_curve_mixed_pair)
{
    kvm_test_keygen(g_dir, "server");
    kvm_test_keygen(g_dir, "client");
    kvm_test_keygen(g_dir, "worker");
    kvm_test_keygen(g_dir, "other");
    char auth[4200];
    keyed_config("client worker", "worker", "other", auth, sizeof auth);
    ck_assert_int_eq(start_serve(NULL), 2);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "worker.public is not the public half of client secret key");
    assert_contains(log, "other.secret");
    free(log);
    char keys[9000], *out = NULL, *err = NULL;
    snprintf(keys, sizeof keys,
             "--server-key '%s/server.public' --client-public '%s/client.public' --client-secret '%s/other.secret' "
             "--timeout 2",
             g_dir, g_dir, g_dir);
    int rc = ask(g_doc, "Then", 8, keys, &out, &err);
    ck_assert_int_eq(rc, 2);
    assert_contains(err, "client.public is not the public half of client secret key");
    free(out);
    free(err);
}
END_TEST

/* A keyed server whose own decode workers' key ([security] client_public_key) is not in its
 * authorized_keys: every worker it started was refused, and serve sat there, never ready,
 * saying nothing. Now it is refused at start (exit 2), naming the key file and the folder. */
START_TEST(test_curve_worker_not_authorized)
{
    kvm_test_keygen(g_dir, "server");
    kvm_test_keygen(g_dir, "client");
    kvm_test_keygen(g_dir, "worker");
    char auth[4200], cmd[9000];
    keyed_config("client", "worker", "worker", auth, sizeof auth);
    ck_assert_int_eq(start_serve(NULL), 2);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "worker.public is not in authorized_keys");
    assert_contains(log, auth);
    free(log);
    /* listed, it starts */
    snprintf(cmd, sizeof cmd, "cp '%s/worker.public' '%s/'", g_dir, auth);
    ck_assert_int_eq(system(cmd), 0);
    ck_assert_int_eq(start_serve(NULL), -1);
    ck_assert_int_eq(stop_serve(), 0);
}
END_TEST

/* pid of the serve process's only child (its decode worker), from /proc. */
static pid_t worker_pid(void)
{
    char path[128];
    snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)g_serve, (int)g_serve);
    char *s = kvm_test_read_file(path, NULL);
    pid_t p = s ? (pid_t)atoi(s) : 0;
    free(s);
    return p;
}

/* Kills the serving decode worker (SIGKILL) and asks until a respawned one answers (4 s at most):
 * the broker notices, starts a new worker, and answers again; fails with `what` otherwise. */
static void kill_worker_and_ask(const char *what)
{
    pid_t w = worker_pid();
    ck_assert_int_gt(w, 0);
    ck_assert_int_eq(kill(w, SIGKILL), 0);
    char *err = NULL;
    int rc = 1;
    for (int i = 0; i < 40 && rc; i++) {
        free(err);
        err = NULL;
        usleep(100000);
        if (worker_pid() > 0 && worker_pid() != w) rc = ask(g_doc, "Then", 4, NULL, NULL, &err);
    }
    ck_assert_msg(rc == 0, "%s: %s", what, err ? err : "");
    free(err);
}

START_TEST(test_worker_respawn)
{
    write_config(NULL, NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    kill_worker_and_ask("no answer after the worker was killed");
    ck_assert_int_eq(stop_serve(), 0);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "exited (signal 9)");
    free(log);
}
END_TEST

/* A second server on the same back end ([run] run_dir) or front end: ZeroMQ unlinks an ipc://
 * path before binding it, so the second one took the first's sockets and answered for it; the
 * first one's respawned worker then joined the second, and the first answered nothing again.
 * Now the second is refused (exit 1, naming the socket) and the first keeps serving. */
START_TEST(test_second_server_same_endpoint)
{
    write_config(NULL, NULL);
    populate(g_doc);
    ck_assert_int_eq(start_serve(NULL), -1);
    char log2[4300], front2[4300];
    snprintf(log2, sizeof log2, "%s/serve2.log", g_dir);
    snprintf(front2, sizeof front2, "ipc://%s/front2", g_dir);
    const char *fronts[2] = {front2, g_front}; /* same run_dir, then the same front end too */
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--config", g_cfg, "--bind", fronts[i], NULL};
        pid_t p2 = 0;
        int rc = kvm_test_serve_start(args, log2, 10, &p2);
        if (p2 > 0) kill(p2, SIGTERM), waitpid(p2, NULL, 0);
        ck_assert_int_eq(rc, 1);
        char *log = kvm_test_read_file(log2, NULL);
        assert_contains(log, "another process is listening on that socket");
        assert_contains(log, i == 0 ? "/run/ctl" : fronts[i]);
        free(log);
    }
    /* the first server still answers, also from a respawned worker */
    kill_worker_and_ask("the first server stopped answering");
    ck_assert_int_eq(stop_serve(), 0);
}
END_TEST

/* An ipc:// endpoint whose path is a file: ZeroMQ unlinks the path before binding, so a [run]
 * run_dir holding a file named "data" (or --bind naming the config) lost that file without a
 * word. Now it is refused (exit 2), naming the file, which is left as it was. */
START_TEST(test_ipc_path_not_socket)
{
    write_config(NULL, NULL);
    char run[4300], data[4400];
    snprintf(run, sizeof run, "%s/run", g_dir);
    snprintf(data, sizeof data, "%s/data", run);
    ck_assert_int_eq(mkdir(run, 0700), 0);
    ck_assert_int_eq(kvm_test_write_file(data, "user data\n", 10), 0);
    ck_assert_int_eq(start_serve(NULL), 2);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "/run/data exists and is not a socket");
    free(log);
    char *left = kvm_test_read_file(data, NULL);
    ck_assert_ptr_nonnull(left);
    ck_assert_str_eq(left, "user data\n");
    free(left);
    ck_assert_int_eq(unlink(data), 0);
    /* the front end too: --bind naming the config file */
    char front[4300];
    snprintf(front, sizeof front, "ipc://%s", g_cfg);
    ck_assert_int_eq(start_serve(front), 2);
    struct stat st;
    ck_assert_int_eq(stat(g_cfg, &st), 0);
    ck_assert(S_ISREG(st.st_mode));
}
END_TEST

/* A store the server may not write (a read-only mount, a copy owned by someone else): the
 * decode workers opened it read-write and exited at setup until serve gave up, answering
 * nothing. They now open it read-only, say so, and answer as from a writable store. As root
 * the store is bind-mounted read-only onto itself in a mount namespace of the test's own
 * (SKIP where that is refused); as another user its files and folder lose their write bits. */
START_TEST(test_read_only_store)
{
    write_config(NULL, NULL);
    populate(g_doc);
    char *want = reference(g_doc, "Then the", 16);
    char sp[4200], f[4400];
    snprintf(sp, sizeof sp, "%s/store", g_dir);
    if (geteuid() == 0) {
        /* in a mount namespace of this test's process (Check forks one per test), inherited by
         * serve and its workers: the read-only mount goes with them even when a failed
         * assertion ends the process before teardown */
        if (syscall(SYS_unshare, CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
            mount(sp, sp, NULL, MS_BIND, NULL) != 0) {
            printf("SKIP: read_only_store: cannot bind-mount the store (%s)\n", strerror(errno));
            free(want);
            return;
        }
        snprintf(g_ro_mount, sizeof g_ro_mount, "%s", sp);
        ck_assert_msg(mount(NULL, sp, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) == 0, "remount: %s",
                      strerror(errno));
    } else {
        snprintf(f, sizeof f, "%s/data.mdb", sp);
        ck_assert_int_eq(chmod(f, 0444), 0);
        snprintf(f, sizeof f, "%s/lock.mdb", sp);
        ck_assert_int_eq(chmod(f, 0444), 0);
        ck_assert_int_eq(chmod(sp, 0555), 0);
    }
    char why[4400] = "";
    ck_assert_int_eq(kvm_store_unwritable(sp, why, sizeof why), 1);
    ck_assert_msg(strstr(why, sp) != NULL, "%s", why);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *out = NULL, *err = NULL;
    int rc = ask(g_doc, "Then the", 16, NULL, &out, &err);
    ck_assert_msg(rc == 0, "ask exited %d: %s", rc, err);
    out[strlen(out) - 1] = '\0';
    ck_assert_str_eq(out, want);
    ck_assert_int_eq(stop_serve(), 0);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "serving it read-only");
    free(log);
    free(want);
    free(out);
    free(err);
    if (geteuid() != 0) chmod(sp, 0775); /* for teardown's removal */
}
END_TEST

/* kvmill ask against what is not kvmill serve's front end said "no answer ... is kvmill serve
 * running there?" whatever was there. It now tells apart nothing listening, a listener that
 * is not ZeroMQ, a ZeroMQ socket of another kind, and a ZeroMQ peer that takes the request and
 * never answers. */
START_TEST(test_ask_wrong_peer)
{
    char ep[4300], path[4300], *out = NULL, *err = NULL;
    snprintf(path, sizeof path, "%s/peer", g_dir);
    snprintf(ep, sizeof ep, "ipc://%s", path);
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' --prompt hi --timeout 1", kvmill(), ep, g_doc);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1); /* nothing there */
    assert_contains(err, "nothing accepted a connection");
    free(out), free(err);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0); /* a listener that never speaks */
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(listen(fd, 4), 0);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
    assert_contains(err, "no ZeroMQ handshake with it completed");
    free(out), free(err);
    close(fd);
    unlink(path);
    void *zc = zmq_ctx_new();
    int kinds[2] = {ZMQ_PUB, ZMQ_ROUTER};
    /* PUB: libzmq reports the socket-type mismatch as a failed handshake or not at all within the
     * timeout (it depends on timing: CI saw both), and both messages name the other kind */
    const char *said[2] = {"a ZeroMQ socket of another kind", "the request was delivered to a ZeroMQ peer"};
    for (int i = 0; i < 2; i++) {
        void *peer = zmq_socket(zc, kinds[i]);
        ck_assert_int_eq(zmq_bind(peer, ep), 0);
        ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
        assert_contains(err, said[i]);
        free(out), free(err);
        zmq_close(peer);
    }
    zmq_ctx_term(zc);
}
END_TEST

/* A listener on 127.0.0.1 port 0 that accepts every connection and closes it at once, after
 * writing `said` when not NULL (a program that is not ZeroMQ: an HTTP server, say); in a child
 * killed by the caller. Its port into *port. */
static pid_t plain_tcp_listener(const char *said, int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(listen(fd, 8), 0);
    ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
    *port = ntohs(sa.sin_port);
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    if (child == 0)
        for (;;) {
            int c = accept(fd, NULL, NULL);
            if (c >= 0 && said && write(c, said, strlen(said)) < 0) _exit(1);
            if (c >= 0) close(c);
        }
    close(fd);
    return child;
}

/* kvmill ask at a TCP port where a program that is not ZeroMQ accepts and closes (or answers
 * garbage) said only "the server needs CurveZMQ keys", when the commonest cause is a wrong
 * port. Without keys the message now names that first, and keeps the keys as the other
 * possibility; exit 1. */
START_TEST(test_ask_plain_tcp_listener)
{
    const char *said[2] = {NULL, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"};
    for (int i = 0; i < 2; i++) {
        int port = 0;
        pid_t lst = plain_tcp_listener(said[i], &port);
        char cmd[9000], *out = NULL, *err = NULL;
        snprintf(cmd, sizeof cmd, "'%s' ask --connect tcp://127.0.0.1:%d --doc '%s' --prompt hi --timeout 10", kvmill(),
                 port, g_doc);
        const int rc = kvm_test_run(cmd, &out, &err);
        kill(lst, SIGKILL);
        waitpid(lst, NULL, 0);
        ck_assert_msg(rc == 1, "ask exited %d: %s", rc, err);
        assert_contains(err, "it may not be a ZeroMQ endpoint (not kvmill serve's front end: check the port)");
        assert_contains(err, "or the server needs CurveZMQ keys (--server-key");
        free(out), free(err);
    }
}
END_TEST

/* Fake front end at ep (a child process): answers the first message it gets with an error
 * answer for request 0, as kvmill serve answers a request whose id it cannot read, and closes
 * the connection close_ms later; exits 0 once sent, 1 when nothing came within 20 s. */
static void answer_as_unreadable(const char *ep, int close_ms)
{
    void *zc = zmq_ctx_new(), *r = zmq_socket(zc, ZMQ_ROUTER);
    int linger = 1000, rcv = 20000;
    zmq_setsockopt(r, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(r, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    kvm_msg *m = NULL, *routed = NULL, *a = NULL;
    int bad = zmq_bind(r, ep) || kvm_msg_recv(r, &m, 0) || kvm_msg_split(m, 1, &routed) ||
              kvm_serve_error_answer(0, KVM_EPROTO, "malformed request: header: unsupported protocol version 2", &a) ||
              kvm_msg_join(routed, &a) || kvm_msg_send(r, &routed, 0);
    kvm_msg_free(&m);
    if (close_ms) usleep((useconds_t)close_ms * 1000);
    zmq_close(r);
    zmq_ctx_term(zc);
    _exit(bad ? 1 : 0);
}

/* An error answer for request 0 (the server could not read the request's id: another protocol
 * version, say) is the answer to this ask: it was taken for a stale answer to another request,
 * and ask waited for its whole --timeout and said "no answer". It says what the server said now,
 * exit 1, at once. */
START_TEST(test_ask_unreadable_answer)
{
    char ep[4300], cmd[9000], *err = NULL;
    snprintf(ep, sizeof ep, "ipc://%s/fake-front", g_dir);
    pid_t fake = fork();
    ck_assert_int_ge(fake, 0);
    if (fake == 0) answer_as_unreadable(ep, 0);
    snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' --prompt hi --timeout 8", kvmill(), ep, g_doc);
    const double t0 = mono_s();
    const int rc = kvm_test_run(cmd, NULL, &err);
    const double secs = mono_s() - t0;
    int st = 0;
    kill(fake, SIGKILL);
    waitpid(fake, &st, 0);
    ck_assert_msg(rc == 1, "ask exited %d: %s", rc, err);
    assert_contains(err, "the server could not read this request");
    assert_contains(err, "unsupported protocol version 2");
    ck_assert_msg(secs < 6, "the answer took %.1f s", secs);
    free(err);
}
END_TEST

/* Endpoints no server can be at (inproc://, a bind's wildcard port or host) were connected to
 * and waited the whole --timeout ("nothing accepted a connection"): refused at once, exit 2.
 * (A host name that does not resolve is refused too; not tested: it needs the name service.) */
START_TEST(test_ask_no_server_endpoint)
{
    const char *eps[4] = {"inproc://x", "tcp://127.0.0.1:0", "tcp://127.0.0.1:*", "tcp://*:5555"};
    const char *said[4] = {"inproc:// reaches the sockets of one process", "port 0 is a bind's wildcard",
                           "port * is a bind's wildcard", "host '*' (every interface) is for a bind"};
    for (int i = 0; i < 4; i++) {
        char cmd[9000], *err = NULL;
        snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' --prompt hi --timeout 20", kvmill(), eps[i],
                 g_doc);
        const double t0 = mono_s();
        ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 2);
        assert_contains(err, said[i]);
        ck_assert_msg(mono_s() - t0 < 10, "%s took %.1f s", eps[i], mono_s() - t0);
        free(err);
    }
}
END_TEST

/* ask hung now and then after its answer (CI: the test above timed out): it closed its monitor's
 * reading end before stopping the monitor, and a connection event that came between (the
 * server closing) blocked libzmq's I/O thread in the monitor's send for ever, holding the lock
 * the stop then waited on. Here the server closes 150 ms after answering and a preloaded shim
 * (tests/preload/kvm_slow_pair_close.c) holds each close of a PAIR socket 400 ms, so the event
 * comes in that gap every time: the ask ends at once, not killed at 20 s. */
START_TEST(test_ask_monitor_stop_order)
{
    char ep[4300], cmd[16384], shim[4200], exe[4096], *err = NULL;
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    ck_assert_int_gt(n, 0);
    exe[n] = '\0';
    snprintf(shim, sizeof shim, "%s/preload/kvm_slow_pair_close.so", dirname(exe));
    ck_assert_msg(access(shim, R_OK) == 0, "%s is missing (make builds it with the suites)", shim);
    snprintf(ep, sizeof ep, "ipc://%s/fake-front", g_dir);
    pid_t fake = fork();
    ck_assert_int_ge(fake, 0);
    if (fake == 0) answer_as_unreadable(ep, 150);
    /* a sanitized kvmill wants its runtime first among the libraries: not so with a preload */
    snprintf(cmd, sizeof cmd,
             "LD_PRELOAD='%s' ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0\" timeout -s KILL "
             "20 '%s' ask --connect '%s' --doc '%s' --prompt hi --timeout 8",
             shim, kvmill(), ep, g_doc);
    const double t0 = mono_s();
    const int rc = kvm_test_run(cmd, NULL, &err);
    const double secs = mono_s() - t0;
    kill(fake, SIGKILL);
    waitpid(fake, NULL, 0);
    ck_assert_msg(rc != 137, "ask hung after its answer (killed after %.1f s): %s", secs, err);
    ck_assert_msg(rc == 1, "ask exited %d: %s", rc, err);
    assert_contains(err, "the server could not read this request");
    ck_assert_msg(secs < 6, "the ask took %.1f s", secs);
    free(err);
}
END_TEST

/* `kvmill ask` at endpoint ep (20 s allowed): its stderr into *err, its status returned, how long
 * it took into *secs. */
static int ask_at(const char *ep, char **err, double *secs)
{
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' --prompt hi --timeout 20", kvmill(), ep, g_doc);
    const double t0 = mono_s();
    const int rc = kvm_test_run(cmd, NULL, err);
    *secs = mono_s() - t0;
    return rc;
}

/* An ask sent to serve's back end (run/ctl, run/data: where decode workers connect) got no
 * answer: the server took the client for an external decode worker ("external decode worker
 * joined", with an empty name, an entry in its worker table), dropped its ask, and the client
 * waited its whole --timeout. It is answered at once now, naming the front end, with no entry. */
START_TEST(test_ask_at_serve_back_end)
{
    write_config(NULL, NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    const char *name[2] = {"ctl", "data"};
    for (int i = 0; i < 2; i++) {
        char ep[4300], *err = NULL;
        double secs = 0;
        snprintf(ep, sizeof ep, "ipc://%s/run/%s", g_dir, name[i]);
        ck_assert_int_eq(ask_at(ep, &err, &secs), 1);
        assert_contains(err,
                        "is kvmill serve's back end, where its decode workers connect, not kvmill serve's front end");
        assert_contains(err, g_front);
        ck_assert_msg(secs < 10, "the ask at %s took %.1f s", ep, secs);
        free(err);
    }
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "answered an ask sent to the back end's data socket");
    assert_lacks(log, "external decode worker");
    free(log);
}
END_TEST

/* A peer that set no routing id (any ZeroMQ socket, not a kvmill worker) at serve's back end
 * became a decode worker with an empty name ("external decode worker  joined", later "decode
 * worker  went silent"), taking a place in the worker table. It is dropped now, said once. */
START_TEST(test_anonymous_peer_at_back_end)
{
    write_config(NULL, NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    char ep[4300];
    snprintf(ep, sizeof ep, "ipc://%s/run/ctl", g_dir);
    void *zc = zmq_ctx_new(), *d = zmq_socket(zc, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    ck_assert_int_eq(zmq_connect(d, ep), 0);
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(zmq_send(d, "hello", 5, 0), 5);
    /* and a last word (a stopping heartbeat, revision 14) from a worker serve never knew: not
     * "external decode worker ghost joined" just to be ended */
    void *g = zmq_socket(zc, ZMQ_DEALER);
    zmq_setsockopt(g, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(g, ZMQ_ROUTING_ID, "ghost", 5);
    kvm_proto_heartbeat hb = {
        .worker_id = kvm_proto_str_c("ghost"), .stage = kvm_proto_str_c("decode"), .pid = 1, .stopping = true};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_heartbeat_encode(&hb, &m), 0);
    ck_assert_int_eq(zmq_connect(g, ep), 0);
    ck_assert_int_eq(kvm_msg_send(g, &m, 0), 0);
    usleep(1000000);
    kvm_test_wait_text(g_log, "peer without a worker id", 1, 20);
    char *log = kvm_test_read_file(g_log, NULL);
    zmq_close(d);
    zmq_close(g);
    zmq_ctx_term(zc);
    assert_contains(log, "dropped a message from a peer without a worker id");
    assert_lacks(log, "ghost");
    assert_lacks(log, "external decode worker");
    const char *first = strstr(log, "peer without a worker id");
    ck_assert_msg(!strstr(first + 1, "peer without a worker id"), "said more than once:\n%s", log);
    free(log);
}
END_TEST

/* Starts `kvmill run` on the repository's corpus with g_cfg (made to wait for compress workers
 * started by hand), its output into log (g_dir/run.log), and waits up to 30 s for its control
 * socket ctl (g_dir/run/ctl): *up says whether it came. Returns the run's pid. */
static pid_t start_run(char log[4300], char ctl[4300], int *up)
{
    char corpus[4200];
    snprintf(log, 4300, "%s/run.log", g_dir);
    snprintf(corpus, sizeof corpus, "%s", kvm_test_data_path("corpus"));
    snprintf(ctl, 4300, "%s/run/ctl", g_dir);
    pid_t run = fork();
    ck_assert_int_ge(run, 0);
    if (run == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(127);
        execl(kvmill(), "kvmill", "run", "--config", g_cfg, "--corpus", corpus, (char *)NULL);
        _exit(127);
    }
    struct stat sb;
    for (double end = mono_s() + 30; stat(ctl, &sb) && mono_s() < end;)
        usleep(20000);
    *up = stat(ctl, &sb) == 0;
    return run;
}

/* A worker started by hand with CurveZMQ keys and a keyed store service (--store tcp://) at a run
 * on a local bind (not keyed) was told to start without its keys; without them the store
 * service refused it, saying to give them: advice in a circle. Both messages name --config now,
 * whose [security] keys key the store service alone. */
START_TEST(test_hand_worker_keys_local_run)
{
    write_config(NULL, "[stages]\ncompress_workers = 0\n");
    char log[4300], ctl[4300], cmd[16384], *err = NULL;
    int up = 0;
    const pid_t run = start_run(log, ctl, &up);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && '%s' keygen --out server >/dev/null && '%s' keygen --out w >/dev/null && timeout -s KILL 30 "
             "'%s/kvmill-compress' --connect 'ipc://%s/run' --store tcp://127.0.0.1:%d --server-key server.public "
             "--client-public w.public --client-secret w.secret",
             g_dir, kvmill(), kvmill(), kvm_test_bin(), g_dir, kvm_test_tcp_port(3));
    const int rc = up ? kvm_test_run(cmd, NULL, &err) : -1;
    kill(run, SIGINT);
    waitpid(run, NULL, 0);
    ck_assert_msg(up, "the run made no control socket within 30 s");
    ck_assert_msg(rc == 1, "the worker exited %d: %s", rc, err);
    assert_contains(err, "has no CurveZMQ keys (a plain socket)");
    assert_contains(err, "a keyed store service's keys come from --config's [security] alone");
    free(err);
}
END_TEST

/* The same at a run's back end: an ask there waited its whole --timeout, the run dropping it;
 * and a peer without a routing id became "external compress worker  joined", nameless. */
START_TEST(test_ask_at_run_back_end)
{
    write_config(NULL, "[stages]\ncompress_workers = 0\n"); /* the run waits for hand-started ones */
    char log[4300], ctl[4300];
    int up = 0;
    const pid_t run = start_run(log, ctl, &up);
    char *err[2] = {NULL, NULL};
    int rc[2] = {-1, -1};
    double secs[2] = {0, 0};
    for (int i = 0; up && i < 2; i++) {
        char ep[4300];
        snprintf(ep, sizeof ep, "ipc://%s/run/%s", g_dir, i ? "data" : "ctl");
        rc[i] = ask_at(ep, &err[i], &secs[i]);
    }
    /* a well-formed ready from a socket without a routing id: not a worker (no "external
     * compress worker  joined" with an empty name) */
    void *zc = zmq_ctx_new(), *d = zmq_socket(zc, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    char ctl_ep[4400];
    snprintf(ctl_ep, sizeof ctl_ep, "ipc://%s", ctl);
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("nameless"), .stage = kvm_proto_str_c("compress"), .pid = 1};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    ck_assert_int_eq(zmq_connect(d, ctl_ep), 0);
    ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
    if (up) kvm_test_wait_text(log, "peer without a worker id", 1, 20);
    zmq_close(d);
    zmq_ctx_term(zc);
    kill(run, SIGINT);
    waitpid(run, NULL, 0);
    char *text = kvm_test_read_file(log, NULL);
    ck_assert_msg(up, "the run made no control socket within 30 s: %s", text);
    for (int i = 0; i < 2; i++) {
        ck_assert_msg(rc[i] == 1, "ask exited %d: %s", rc[i], err[i]);
        assert_contains(err[i],
                        "is kvmill run's back end, where its stage workers connect, not kvmill serve's front end");
        assert_contains(err[i], "(a run answers no ask)");
        ck_assert_msg(secs[i] < 10, "the ask took %.1f s", secs[i]);
        free(err[i]);
    }
    assert_contains(text, "answered an ask sent to the run's ctl socket");
    assert_contains(text, "dropped a message from a peer without a worker id");
    assert_lacks(text, "external compress worker");
    free(text);
}
END_TEST

/* A ROUTER bound at ep in context zc, waiting up to 20 s for a request; NULL when the bind
 * fails. */
static void *fake_bind(void *zc, const char *ep)
{
    void *r = zmq_socket(zc, ZMQ_ROUTER);
    int linger = 0, rcv = 20000;
    zmq_setsockopt(r, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(r, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    if (r && zmq_bind(r, ep) == 0) return r;
    if (r) zmq_close(r);
    return NULL;
}

/* Reads one ask on r: its sender's routing id into peer (*peer_len bytes), its request id into
 * *id. 0, or -1 when none came or it is not an ask. */
static int fake_recv_ask(void *r, char peer[256], int *peer_len, uint64_t *id)
{
    kvm_msg *m = NULL;
    kvm_proto_ask a;
    *peer_len = zmq_recv(r, peer, 256, 0);
    int bad = *peer_len <= 0 || *peer_len > 256 || kvm_msg_recv(r, &m, 0) || kvm_proto_ask_decode(m, &a);
    if (!bad) *id = a.request_id;
    kvm_msg_free(&m);
    return bad ? -1 : 0;
}

/* Sends the answer `text` for request id to the routing id peer on r. 0 or -1. */
static int fake_answer(void *r, const char *peer, int peer_len, uint64_t id, const char *text)
{
    kvm_proto_answer ans = {.request_id = id, .text = kvm_proto_str_c(text)};
    kvm_msg *m = NULL;
    if (kvm_proto_answer_encode(&ans, &m)) return -1;
    if (zmq_send(r, peer, (size_t)peer_len, ZMQ_SNDMORE) != peer_len) return kvm_msg_free(&m), -1;
    return kvm_msg_send(r, &m, 0) ? -1 : 0;
}

/* Closes r (NULL too) once its answers are delivered (up to 5 s), and its context. */
static void fake_close(void *zc, void *r)
{
    int linger = 5000;
    if (r) zmq_setsockopt(r, ZMQ_LINGER, &linger, sizeof linger), zmq_close(r);
    zmq_ctx_term(zc);
}

/* Fake front end at ep (a child process) that restarts during the request: reads the first
 * ask and closes (its connection drops, as when kvmill serve is killed), binds ep again and
 * reads the ask sent again. answer: 1 to answer the first ask's id late ("stale answer"),
 * then the second's ("fresh answer"); 0 to answer nothing; 2 to answer the first ask at once,
 * without closing. Exits 0, 3 when the second ask reused the first's id, 1 otherwise. */
static void restarting_front(const char *ep, int answer)
{
    char peer[256];
    int peer_len = 0, bad = 0;
    uint64_t id1 = 0, id2 = 0;
    void *zc = zmq_ctx_new(), *r = fake_bind(zc, ep);
    bad = !r || fake_recv_ask(r, peer, &peer_len, &id1);
    if (!bad && answer == 2) bad = fake_answer(r, peer, peer_len, id1, "fresh answer") != 0;
    if (bad || answer == 2) fake_close(zc, r), _exit(bad);
    zmq_close(r);
    zmq_ctx_term(zc); /* the first listener gone (and its ipc file unlinked) before the next binds */
    usleep(300000);
    zc = zmq_ctx_new();
    r = fake_bind(zc, ep);
    bad = !r || fake_recv_ask(r, peer, &peer_len, &id2);
    if (!bad && answer == 1)
        bad =
            fake_answer(r, peer, peer_len, id1, "stale answer") || fake_answer(r, peer, peer_len, id2, "fresh answer");
    if (!bad && answer == 0) fake_recv_ask(r, peer, &peer_len, &id2); /* silent until killed */
    fake_close(zc, r);
    _exit(bad ? 1 : id1 == id2 ? 3 : 0);
}

/* Runs ask (--timeout t) against a restarting_front(answer) child; its exit status into
 * *fake_rc (the child is killed when still running). Returns ask's exit status. */
static int ask_restarting(int answer, int t, const char *redirect, char **out, char **err, int *fake_rc)
{
    char ep[4300], cmd[9000];
    snprintf(ep, sizeof ep, "ipc://%s/fake-front", g_dir);
    pid_t fake = fork();
    ck_assert_int_ge(fake, 0);
    if (fake == 0) restarting_front(ep, answer);
    snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' --prompt hi --timeout %d%s", kvmill(), ep, g_doc, t,
             redirect);
    const int rc = kvm_test_run(cmd, out, err);
    int st = 0;
    if (answer == 0) kill(fake, SIGKILL);
    waitpid(fake, &st, 0);
    *fake_rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return rc;
}

/* A server restarted on the same endpoint during a request (killed, started again) left ask
 * waiting its whole --timeout: ZeroMQ reconnected, but the request had gone with the old
 * server. ask now sees the connection drop and come back and asks again, once said on stderr,
 * with a new request id: a late answer to the first send is not taken for the second's, and
 * one answer is printed. */
START_TEST(test_ask_server_restarted)
{
    char *out = NULL, *err = NULL;
    int fake_rc = -1;
    const double t0 = mono_s();
    const int rc = ask_restarting(1, 20, "", &out, &err, &fake_rc);
    const double secs = mono_s() - t0;
    ck_assert_msg(rc == 0, "ask exited %d after %.1f s: %s", rc, secs, err);
    ck_assert_msg(fake_rc == 0, "the fake server exited %d (3: the ask sent again reused the first id)", fake_rc);
    ck_assert_str_eq(out, "fresh answer\n");
    ck_assert_int_eq(kvm_test_count(err, "the server's connection was lost and came back: asking again"), 1);
    ck_assert_msg(secs < 15, "the answer took %.1f s", secs);
    free(out), free(err);
}
END_TEST

/* A front end that took the connection but never ran the greeting (serve SIGSTOPped), then went
 * away (killed) and came back: the plain handshake ended with no reason, and ask said "the
 * server needs CurveZMQ keys ..." and exited 1 at once. One such close is a server gone for a
 * moment: ZeroMQ connects again and the ask is answered. The child stands in: a bare listening
 * socket that never accepts, closed after 1.5 s, then a front end that answers. */
START_TEST(test_ask_server_closed_in_greeting)
{
    char path[4300], ep[4400], cmd[9000], *out = NULL, *err = NULL;
    snprintf(path, sizeof path, "%s/greet-front", g_dir);
    snprintf(ep, sizeof ep, "ipc://%s", path);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    ck_assert_uint_lt(strlen(path), sizeof sa.sun_path);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    ck_assert_int_ge(lfd, 0);
    ck_assert_int_eq(bind(lfd, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(listen(lfd, 4), 0);
    pid_t fake = fork();
    ck_assert_int_ge(fake, 0);
    if (fake == 0) {
        usleep(1500000);
        close(lfd); /* the connection waiting in its backlog is closed mid-greeting */
        unlink(path);
        char peer[256];
        int peer_len = 0;
        uint64_t id = 0;
        void *zc = zmq_ctx_new(), *r = fake_bind(zc, ep);
        int bad = !r || fake_recv_ask(r, peer, &peer_len, &id) || fake_answer(r, peer, peer_len, id, "fresh answer");
        fake_close(zc, r);
        _exit(bad);
    }
    close(lfd);
    snprintf(cmd, sizeof cmd, "'%s' ask --connect '%s' --doc '%s' --prompt hi --timeout 20", kvmill(), ep, g_doc);
    const int rc = kvm_test_run(cmd, &out, &err);
    int st = 0;
    waitpid(fake, &st, 0);
    ck_assert_msg(rc == 0 && out && !strcmp(out, "fresh answer\n"), "ask exited %d: %s", rc, err);
    assert_lacks(err, "CurveZMQ");
    free(out), free(err);
}
END_TEST

/* The request sent again after the server restarted, unanswered: the timeout's message says
 * the server restarted, not "is the server busy". */
START_TEST(test_ask_restarted_no_answer)
{
    char *err = NULL;
    int fake_rc = -1;
    ck_assert_int_eq(ask_restarting(0, 4, "", NULL, &err, &fake_rc), 1);
    assert_contains(err, "asking again");
    assert_contains(err, "the server restarted during the request");
    assert_lacks(err, "is the server busy");
    free(err);
}
END_TEST

/* An answer written to a full device said "writing to stdout failed: the output is incomplete"
 * without the reason (ask flushed stdout itself; main's later flush had nothing left to fail
 * on). It names the reason now, exit 1. */
START_TEST(test_ask_stdout_full)
{
    if (access("/dev/full", W_OK)) {
        printf("SKIP: no /dev/full: ask's write failure not checked\n");
        return;
    }
    char *err = NULL;
    int fake_rc = -1;
    ck_assert_int_eq(ask_restarting(2, 20, " > /dev/full", NULL, &err, &fake_rc), 1);
    ck_assert_int_eq(fake_rc, 0);
    assert_contains(err, "kvmill ask: writing to stdout failed: No space left on device: the output is incomplete");
    free(err);
}
END_TEST

/* serve's resolved configuration that could not be written (a full TMPDIR) said only "cannot
 * write the resolved configuration PATH". Here the write fails with EFBIG (RLIMIT_FSIZE 0,
 * SIGXFSZ ignored: a full disk needs root); the message gives the reason and names TMPDIR's
 * folder. A new store with --compute-missing: opening an existing one writes its lock file. */
START_TEST(test_serve_config_unwritable)
{
    write_config(NULL, NULL);
    char cmd[16384], *err = NULL, tmp[4300];
    snprintf(tmp, sizeof tmp, "%s/tmp", g_dir);
    ck_assert_int_eq(mkdir(tmp, 0700), 0);
    /* stderr through a pipe: the limit fails writes to any regular file, the captured stderr's too */
    snprintf(cmd, sizeof cmd,
             "( ( ulimit -f 0 && trap '' XFSZ && TMPDIR='%s' exec '%s' serve --config '%s' --store '%s/new-store' "
             "--compute-missing --bind '%s' ) 2>&1; echo \"serve exited $?\" ) | cat >&2",
             tmp, kvmill(), g_cfg, g_dir, g_front);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 0);
    assert_contains(err, "serve exited 1");
    assert_contains(err, "cannot write the resolved configuration");
    assert_contains(err, "File too large");
    assert_contains(err, "TMPDIR's folder");
    assert_contains(err, tmp);
    free(err);
}
END_TEST

START_TEST(test_usage)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "'%s' ask --connect ipc:///nonexistent", kvmill());
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 2);
    snprintf(cmd, sizeof cmd, "'%s' ask --connect ipc:///x --doc /nonexistent --prompt hi", kvmill());
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 2);
    snprintf(cmd, sizeof cmd, "'%s' serve --bind ipc:///x", kvmill());
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 2);
    snprintf(cmd, sizeof cmd, "'%s' keygen", kvmill());
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 2);
}
END_TEST

/* Sends sig to every child of the server (its decode workers); returns their pids, one per
 * line (free it). */
static char *signal_workers(int sig)
{
    char cmd[128], *pids = NULL;
    snprintf(cmd, sizeof cmd, "pgrep -P %d", (int)g_serve);
    ck_assert_int_eq(kvm_test_run(cmd, &pids, NULL), 0);
    for (char *p = pids; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (atoi(p) > 1) kill((pid_t)atoi(p), sig);
    return pids;
}

/* README: a first SIGTERM lets the workers finish and exits 0 (a service manager's stop); a
 * second stops at once, kills a worker that has not finished and exits 130, as a second Ctrl-C
 * stops `kvmill run`. The worker is stopped (SIGSTOP) so the first signal's wait lasts. */
START_TEST(test_second_signal_130)
{
    g_liveness = 600; /* 60 s: the stopped worker is not killed as silent before the second signal */
    write_config(NULL, NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *pids = signal_workers(SIGSTOP);
    pid_t worker = (pid_t)atoi(pids); /* every child stopped; the first checked at the end */
    free(pids);
    ck_assert_int_gt(worker, 1);
    int st = 0;
    kill(g_serve, SIGTERM);
    /* the second only once the first is taken (a pending signal is not queued twice: a fixed
     * 200 ms could merge them on a loaded machine, and serve then drains and exits 0) */
    ck_assert_msg(kvm_test_wait_text(g_log, "stopping (letting workers finish)", 1, 60), "no stop line in %s", g_log);
    ck_assert_int_eq(waitpid(g_serve, &st, WNOHANG), 0); /* waiting for the stopped worker */
    kill(g_serve, SIGTERM);
    ck_assert_int_eq(waitpid(g_serve, &st, 0), g_serve);
    g_serve = 0;
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d", st);
    ck_assert_int_eq(kill(worker, 0), -1); /* killed and reaped */
}
END_TEST

/* A request that comes while the server drains after its first SIGTERM got no answer: the
 * front end was not read during the drain, then closed, and the client waited for its whole
 * --timeout. It is answered at once now, saying the server stops and to ask again. The worker
 * is stopped (SIGSTOP) so the drain lasts (up to grace_s + 2 s = 7 s). */
START_TEST(test_request_while_stopping)
{
    g_liveness = 600; /* the drain lasts its 7 s: the stopped worker is not killed as silent */
    write_config(NULL, NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *pids = signal_workers(SIGSTOP);
    kill(g_serve, SIGTERM);
    usleep(300000);
    ck_assert_int_eq(waitpid(g_serve, NULL, WNOHANG), 0); /* draining: waiting for the stopped worker */
    char *err = NULL;
    const double t0 = mono_s();
    const int rc = ask(g_doc, "Then", 4, "--timeout 6", NULL, &err);
    const double secs = mono_s() - t0;
    free(pids);
    free(signal_workers(SIGCONT));
    ck_assert_msg(rc == 1, "ask exited %d: %s", rc, err);
    assert_contains(err, "the server is stopping (SIGTERM): ask again when it is back");
    ck_assert_msg(secs < 5, "the answer took %.1f s", secs);
    free(err);
    int st = 0;
    ck_assert_int_eq(waitpid(g_serve, &st, 0), g_serve);
    g_serve = 0;
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "refused: the server is stopping (SIGTERM)");
    free(log);
}
END_TEST

/* A worker stopped (SIGSTOP) or hung when serve gets SIGTERM: the drain waited its whole
 * grace_s + 2 s (32 s by default) with no word, the request it held answered only then. Now a
 * worker silent past [run] liveness (here 3 s) is named, its request answered with the error,
 * and it is killed: serve stops in seconds, exit 0. */
START_TEST(test_stop_kills_silent_worker)
{
    g_grace_s = 30; /* the old drain: 32 s */
    write_config(NULL, NULL);
    ck_assert_int_eq(start_serve(NULL), -1);
    char *pids = signal_workers(SIGSTOP);
    free(pids);
    const double t0 = mono_s();
    kill(g_serve, SIGTERM);
    int st = 0;
    ck_assert_int_eq(waitpid(g_serve, &st, 0), g_serve);
    const double secs = mono_s() - t0;
    g_serve = 0;
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "went silent during the stop: killed");
    free(log);
    ck_assert_msg(secs < 20, "serve took %.1f s to stop, waiting for a silent worker", secs);
}
END_TEST

static TCase *tcase(const char *name, const TTest *fn)
{
    TCase *tc = tcase_create(name);
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60); /* generous: a limit matters only when something hangs */
    tcase_add_test(tc, fn);
    return tc;
}

int main(void)
{
    Suite *su = suite_create("serve");
    suite_add_tcase(su, tcase("answer_equals_inprocess", test_answer_equals_inprocess));
    suite_add_tcase(su, tcase("stop_kills_silent_worker", test_stop_kills_silent_worker));
    suite_add_tcase(su, tcase("store_replaced_under_serve", test_store_replaced_under_serve));
    suite_add_tcase(su, tcase("sighup_stops_cleanly", test_sighup_stops_cleanly));
    suite_add_tcase(su, tcase("answer_prompt_not_utf8", test_answer_prompt_not_utf8));
    suite_add_tcase(su, tcase("answer_f16_cache", test_answer_f16_cache));
    suite_add_tcase(su, tcase("run_then_serve", test_run_then_serve));
    suite_add_tcase(su, tcase("devices_refused", test_devices_refused));
    suite_add_tcase(su, tcase("missing_cache", test_missing_cache));
    suite_add_tcase(su, tcase("compute_missing", test_compute_missing));
    suite_add_tcase(su, tcase("compute_missing_new_store_cap", test_compute_missing_new_store_cap));
    suite_add_tcase(su, tcase("prompt_too_long", test_prompt_too_long));
    suite_add_tcase(su, tcase("too_many_new_tokens", test_too_many_new_tokens));
    suite_add_tcase(su, tcase("window_overflow", test_window_overflow));
    suite_add_tcase(su, tcase("garbage", test_garbage));
    TCase *too_large = tcase("message_too_large", test_message_too_large);
    tcase_set_timeout(too_large, 120); /* three asks, each allowed --timeout 30 */
    suite_add_tcase(su, too_large);
    suite_add_tcase(su, tcase("nonlocal_without_keys", test_nonlocal_without_keys));
    suite_add_tcase(su, tcase("worker_setup_failure", test_worker_setup_failure));
    TCase *curve = tcase("curve_keys", test_curve_keys);
    /* a server start, four asks (allowed --timeout 30, 30, 20 and 20: a keyless client hears of the
     * failed handshake only when it read the server's greeting first, else it waits its timeout)
     * and two worker joins (1.5 s, 8 s): 90 s ran out on a loaded machine (a CI mirror beside
     * other jobs) */
    tcase_set_timeout(curve, 180);
    suite_add_tcase(su, curve);
    suite_add_tcase(su, tcase("curve_mixed_pair", test_curve_mixed_pair));
    suite_add_tcase(su, tcase("curve_worker_not_authorized", test_curve_worker_not_authorized));
    suite_add_tcase(su, tcase("worker_respawn", test_worker_respawn));
    suite_add_tcase(su, tcase("second_server_same_endpoint", test_second_server_same_endpoint));
    suite_add_tcase(su, tcase("ipc_path_not_socket", test_ipc_path_not_socket));
    suite_add_tcase(su, tcase("read_only_store", test_read_only_store));
    suite_add_tcase(su, tcase("ask_wrong_peer", test_ask_wrong_peer));
    suite_add_tcase(su, tcase("ask_plain_tcp_listener", test_ask_plain_tcp_listener));
    suite_add_tcase(su, tcase("ask_unreadable_answer", test_ask_unreadable_answer));
    suite_add_tcase(su, tcase("ask_monitor_stop_order", test_ask_monitor_stop_order));
    suite_add_tcase(su, tcase("ask_no_server_endpoint", test_ask_no_server_endpoint));
    suite_add_tcase(su, tcase("ask_at_serve_back_end", test_ask_at_serve_back_end));
    suite_add_tcase(su, tcase("ask_at_run_back_end", test_ask_at_run_back_end));
    suite_add_tcase(su, tcase("anonymous_peer_at_back_end", test_anonymous_peer_at_back_end));
    suite_add_tcase(su, tcase("hand_worker_keys_local_run", test_hand_worker_keys_local_run));
    suite_add_tcase(su, tcase("ask_server_restarted", test_ask_server_restarted));
    suite_add_tcase(su, tcase("ask_restarted_no_answer", test_ask_restarted_no_answer));
    suite_add_tcase(su, tcase("ask_server_closed_in_greeting", test_ask_server_closed_in_greeting));
    suite_add_tcase(su, tcase("ask_stdout_full", test_ask_stdout_full));
    suite_add_tcase(su, tcase("serve_config_unwritable", test_serve_config_unwritable));
    suite_add_tcase(su, tcase("usage", test_usage));
    suite_add_tcase(su, tcase("second_signal_130", test_second_signal_130));
    suite_add_tcase(su, tcase("request_while_stopping", test_request_while_stopping));
    SRunner *sr = srunner_create(su);
    srunner_set_fork_status(sr, CK_FORK);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
