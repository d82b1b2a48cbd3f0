/* check_pipeline.c: `kvmill run` with real stage processes over ipc:// in a temporary run
 * directory: every document stored once, a second run skips all, a compress worker killed
 * with SIGKILL mid-job loses nothing, garbage sent to each stage is logged and dropped while
 * the stage keeps working, and bad configurations or a missing stage binary fail clearly. */
#include "compress/polykv/kvm_polykv.h"
#include "model/kvm_utf8.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_stage.h"
#include "proto/kvm_proto.h"
#include "store/kvm_store.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

static char *tmp, cfg_path[4200], docs[4200], store[4200], run_dir[4200];

/* 5 documents; context 128; KVSculpt small enough for sanitizer builds. */
static void setup(void)
{
    tmp = kvm_test_tmpdir();
    snprintf(docs, sizeof docs, "%s/docs", tmp);
    snprintf(store, sizeof store, "%s/store.lmdb", tmp);
    snprintf(run_dir, sizeof run_dir, "%s/run", tmp);
    snprintf(cfg_path, sizeof cfg_path, "%s/t.ini", tmp);
    ck_assert_int_eq(mkdir(docs, 0700), 0);
    for (int i = 0; i < 5; i++) {
        char src[64], dst[4300];
        snprintf(src, sizeof src, "corpus/doc_%03d.txt", i);
        snprintf(dst, sizeof dst, "%s/doc_%03d.txt", docs, i);
        size_t n;
        char *t = kvm_test_read_file(kvm_test_data_path(src), &n);
        ck_assert_ptr_nonnull(t);
        ck_assert_int_eq(kvm_test_write_file(dst, t, n), 0);
        free(t);
    }
}

static void teardown(void)
{
    kvm_test_rmtree(tmp);
    free(tmp);
}

/* [compress] iterations: 3, or with KVM_SLOW_COMPRESS set 40 (or its value when larger). */
static const char *slow_iterations(void)
{
    const char *s = getenv("KVM_SLOW_COMPRESS");
    return !s ? "3" : atoi(s) > 40 ? s : "40";
}

/* [compress] queries: 64, or 2048 with KVM_SLOW_COMPRESS >= 2000, where a job must last seconds
 * however fast the solver (L-BFGS stops early on small problems, so iterations alone do not). */
static const char *slow_queries(void)
{
    const char *s = getenv("KVM_SLOW_COMPRESS");
    return s && atoi(s) >= 2000 ? "2048" : "64";
}

/* The run's config; extra is appended to [stages]. A worker silent for liveness heartbeats
 * (100 ms each) is declared dead: 10 s here, since a loaded machine under ASan can starve a
 * worker's heartbeat thread for seconds and a test that is not about liveness must not see a
 * requeue; write_config_liveness sets a short one for a test that is. */
static void write_config_liveness(const char *extra, int liveness)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = sculpt\nqueries = %s\n"
             "iterations = %s\nrounds = 2\n[store]\npath = %s\n[run]\nheartbeat_ms = 100\nliveness = %d\nrun_dir = %s\n"
             "[stages]\nbin_dir = %s\n%s",
             kvm_test_data_path("models/stories260K.bin"), slow_queries(), slow_iterations(), store, liveness, run_dir,
             kvm_test_bin(), extra ? extra : "");
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
}

static void write_config(const char *extra) { write_config_liveness(extra, 100); }

static int run_kvmill(char **out, char **err)
{
    char cmd[12000];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, docs);
    return kvm_test_run(cmd, out, err);
}

START_TEST(test_run_then_skip)
{
    write_config(NULL);
    char *out, *err;
    int rc = run_kvmill(&out, &err);
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, err);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0 truncated=5 "), "stdout: %s", out);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
    free(out); free(err);
    rc = run_kvmill(&out, &err);
    ck_assert_int_eq(rc, 0);
    ck_assert_msg(strstr(out, "summary: compressed=0 skipped=5 failed=0"), "stdout: %s", out);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
    /* the last stdout line is the machine-readable one */
    char *last = strrchr(out, '\n');
    *last = '\0';
    ck_assert_ptr_nonnull(strstr(strrchr(out, '\n') + 1, "summary: "));
    free(out); free(err);
}
END_TEST

/* Two files of the same text in a fresh store: one cache, the other skipped. The documents line
 * said "1 skipped (already stored)" though nothing was stored before; it tells the two apart now
 * (the summary line's fields are unchanged). */
START_TEST(test_duplicate_not_already_stored)
{
    write_config(NULL);
    char src[4300], dst[4300];
    snprintf(src, sizeof src, "%s/doc_000.txt", docs);
    snprintf(dst, sizeof dst, "%s/doc_005.txt", docs);
    size_t n;
    char *t = kvm_test_read_file(src, &n);
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(kvm_test_write_file(dst, t, n), 0);
    free(t);
    char *out, *err;
    int rc = run_kvmill(&out, &err);
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, err);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=1 failed=0 "), "stdout: %s", out);
    ck_assert_msg(strstr(out, "documents: 5 compressed, 1 skipped (0 already stored, 1 duplicate of another "
                              "document in this corpus), 0 failed"),
                  "stdout: %s", out);
    free(out);
    free(err);
    rc = run_kvmill(&out, &err); /* again: the five stored, the copy still a duplicate */
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, err);
    ck_assert_msg(strstr(out, "documents: 0 compressed, 6 skipped (5 already stored, 1 duplicate of another "
                              "document in this corpus), 0 failed"),
                  "stdout: %s", out);
    free(out);
    free(err);
}
END_TEST

/* The value of `key=` on the summary line of out, or -1. */
static long long summary_value(const char *out, const char *key)
{
    const char *s = out ? strstr(out, "summary: ") : NULL;
    char k[64];
    snprintf(k, sizeof k, " %s=", key);
    const char *p = s ? strstr(s, k) : NULL;
    return p ? atoll(p + strlen(k)) : -1;
}

/* A document too short for compression to save an entry (here fewer tokens than the retain
 * zone of 32) is stored with its full KV, and the summary says so: a "kept whole:" line and
 * kept_full= (its cache is larger than its f32 KV, bytes_compressed > bytes_full, which read as
 * compression gone wrong with nothing said). */
START_TEST(test_short_document_kept_full)
{
    const char *text = "Once upon a time, there was a cat.";
    char path[4400];
    snprintf(path, sizeof path, "%s/doc_short.txt", docs);
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    write_config(NULL);
    char *out, *err;
    int rc = run_kvmill(&out, &err);
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, err);
    ck_assert_msg(summary_value(out, "compressed") == 6 && summary_value(out, "kept_full") == 1, "stdout: %s", out);
    /* one document: the singular ("1 documents ... were stored with their full KV" before) */
    ck_assert_msg(strstr(out, "kept whole: 1 document too short for compression to save an entry was stored with its "
                              "full KV unchanged (") && strstr(out, "so its cache is larger than its f32 KV)"),
                  "stdout: %s", out);
    free(out); free(err);
}
END_TEST

/* [run] wire_dtype = f16: keys, values and queries cross prefill -> orchestrator -> compress
 * in 16 bit. The bytes saved are exactly those tensors' halves (stories260K: 5 layers, 8
 * heads, 4 KV heads, head_dim 8; 5 documents of 128 tokens); the caches get their own
 * config id (the f32 ones are not skipped, nor overwritten). */
START_TEST(test_wire_dtype)
{
    write_config(NULL);
    char *out, *err;
    int rc = run_kvmill(&out, &err);
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, err);
    long long in32 = summary_value(out, "wire_in_bytes"), out32 = summary_value(out, "wire_out_bytes");
    ck_assert_msg(strstr(out, "KV as f32 ([run] wire_dtype)"), "stdout: %s", out);
    free(out); free(err);
    write_config("[run]\nwire_dtype = f16\n");
    rc = run_kvmill(&out, &err);
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, err);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0"), "stdout: %s", out);
    ck_assert_msg(strstr(out, "KV as f16 ([run] wire_dtype)"), "stdout: %s", out);
    long long in16 = summary_value(out, "wire_in_bytes"), out16 = summary_value(out, "wire_out_bytes");
    const long long saved = 5LL * 5 * 128 * 2 * (2 * 4 * 8 + 2 * 8 * 8); /* docs x layers x N x 2 B x elements */
    ck_assert_msg(in32 > 0 && llabs(in32 - in16 - saved) < 4096, "received %lld (f32) vs %lld (f16): want %lld fewer", in32,
                  in16, saved);
    ck_assert_msg(llabs(out32 - out16 - saved) < 4096, "sent %lld (f32) vs %lld (f16): want %lld fewer", out32, out16, saved);
    ck_assert_int_eq(kvm_test_store_caches(store), 10);
    free(out); free(err);
    rc = run_kvmill(&out, &err); /* the f16 caches are found under their own id */
    ck_assert_msg(strstr(out, "summary: compressed=0 skipped=5 failed=0"), "stdout: %s", out);
    free(out); free(err);
}
END_TEST

/* Every line of text is a JSON object with time, stage, pid, level and event (kvm_log.h);
 * returns how many have event `count_event` and stage `stage` (NULL: any). */
static int check_json_lines(const char *text, const char *what, const char *stage, const char *count_event)
{
    int n = 0, lines = 0;
    for (const char *p = text; p && *p;) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        json_error_t e;
        json_t *o = json_loadb(p, len, 0, &e);
        ck_assert_msg(o && json_is_object(o), "%s: line %d is not a JSON object (%s): %.*s", what, lines + 1,
                      e.text, (int)len, p);
        const char *keys[] = {"time", "stage", "level", "event", "msg"};
        for (int k = 0; k < 5; k++)
            ck_assert_msg(json_is_string(json_object_get(o, keys[k])), "%s: no string '%s' in %.*s", what, keys[k], (int)len, p);
        ck_assert_msg(json_integer_value(json_object_get(o, "pid")) > 0, "%s: no pid in %.*s", what, (int)len, p);
        const char *ev = json_string_value(json_object_get(o, "event")), *st = json_string_value(json_object_get(o, "stage"));
        if (!strcmp(ev, count_event) && (!stage || !strcmp(st, stage))) n++;
        json_decref(o);
        lines++;
        p = nl ? nl + 1 : p + len;
    }
    ck_assert_msg(lines > 0, "%s: no log lines", what);
    return n;
}

static long long json_int(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    ck_assert_msg(json_is_integer(v), "metrics: no integer '%s'", key);
    return (long long)json_integer_value(v);
}

/* [run] log_format = json: the orchestrator's stderr and every stage log are JSON lines
 * (parsed here with libjansson). kvmill run --metrics FILE: the file is a whole JSON object
 * each time it is read during the run ("running", replaced atomically), and its final values
 * equal the summary's. */
START_TEST(test_json_logs_and_metrics)
{
    write_config("[run]\nlog_format = json\n");
    char metrics[4300], outp[4300], errp[4300], cmd[16000];
    snprintf(metrics, sizeof metrics, "%s/metrics.json", tmp);
    snprintf(outp, sizeof outp, "%s/run.out", tmp);
    snprintf(errp, sizeof errp, "%s/run.err", tmp);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill' run --config '%s' --corpus '%s' --metrics '%s' >'%s' 2>'%s'", kvm_test_bin(),
             cfg_path, docs, metrics, outp, errp);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int status = 0, seen_running = 0, reads = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        json_error_t e;
        /* opened first: the file may appear between a failed load and a check of its existence;
         * once open, it is one whole version (written to a temporary and renamed) */
        FILE *f = fopen(metrics, "r");
        if (!f) {
            ck_assert_msg(errno == ENOENT, "metrics file: %s", strerror(errno));
            usleep(10000);
            continue;
        }
        json_t *m = json_loadf(f, 0, &e);
        fclose(f);
        if (m) { /* never a half-written file */
            reads++;
            const char *st = json_string_value(json_object_get(m, "state"));
            ck_assert_msg(st, "metrics without state");
            if (!strcmp(st, "running")) {
                seen_running = 1;
                ck_assert_int_eq(json_int(m, "documents_total"), 5);
                ck_assert_int_le(json_int(m, "documents_done"), 5);
            }
            json_decref(m);
        } else
            ck_abort_msg("metrics file is not JSON: %s", e.text);
        usleep(10000);
    }
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "kvmill run exited %d", status);
    size_t n;
    char *out = kvm_test_read_file(outp, &n), *err = kvm_test_read_file(errp, &n);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0"), "stdout: %s\nstderr: %s", out, err);
    ck_assert_msg(seen_running, "the metrics file was never seen with state running (%d reads)", reads);
    ck_assert_int_eq(check_json_lines(err, "kvmill run stderr", "orchestrator", "job_done"), 5);
    json_error_t e;
    json_t *m = json_load_file(metrics, 0, &e);
    ck_assert_msg(m, "final metrics: %s", e.text);
    ck_assert_str_eq(json_string_value(json_object_get(m, "state")), "done");
    ck_assert_int_eq(json_int(m, "documents_done"), summary_value(out, "compressed"));
    ck_assert_int_eq(json_int(m, "documents_failed"), summary_value(out, "failed"));
    ck_assert_int_eq(json_int(m, "documents_skipped"), summary_value(out, "skipped"));
    ck_assert_int_eq(json_int(m, "wire_in_bytes"), summary_value(out, "wire_in_bytes"));
    ck_assert_int_eq(json_int(m, "wire_out_bytes"), summary_value(out, "wire_out_bytes"));
    ck_assert_int_eq(json_int(m, "store_commits"), 5);
    ck_assert_int_eq(json_int(m, "requeues"), 0);
    ck_assert_msg(json_real_value(json_object_get(m, "compress_s")) > 0, "compress_s");
    ck_assert_msg(json_real_value(json_object_get(m, "store_s")) > 0, "store_s");
    json_decref(m);
    /* the stages' logs in the run directory: JSON too, one job_done per document each */
    const char *logs[2] = {"prefill-0-r0.log", "compress-1-r0.log"}, *stages[2] = {"prefill", "compress"};
    for (int i = 0; i < 2; i++) {
        char lp[4400];
        snprintf(lp, sizeof lp, "%s/%s", run_dir, logs[i]);
        char *t = kvm_test_read_file(lp, &n);
        ck_assert_msg(t, "no stage log %s", lp);
        ck_assert_int_eq(check_json_lines(t, logs[i], stages[i], "job_done"), 5);
        free(t);
    }
    free(out); free(err);
}
END_TEST

/* kvm_log in JSON: quotes, newlines, control bytes and invalid UTF-8 in a message or field
 * still give one parseable object per line, with the fields' JSON types; text mode keeps the
 * prefix; a bad format name is refused (text kept). Runs in its own forked test process. */
START_TEST(test_log_json_escaping)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/log.txt", tmp);
    fflush(stderr);
    int saved = dup(2);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    dup2(fileno(f), 2);
    ck_assert_int_eq(kvm_log_setup("compress", "[compress w] ", "bogus"), KVM_EINVAL);
    ck_assert_int_eq(kvm_log_format_get(), KVM_LOG_TEXT);
    kvm_log(KVM_LOG_INFO, "message", NULL, 0, "plain %d", 1);
    ck_assert_int_eq(kvm_log_setup("compress", "[compress w] ", "json"), 0);
    kvm_log_field fl[] = {KVM_LOG_S("doc", "a \"quoted\"\nname\x01"), KVM_LOG_I("job_id", 7), KVM_LOG_F("ms", 1.5),
                          KVM_LOG_S("bad", "\xff\xfe"), KVM_LOG_F("nan", NAN)};
    kvm_log(KVM_LOG_WARN, "job_requeued", fl, 5, "requeueing \"%s\"\n", "x\ty");
    kvm_log(KVM_LOG_ERROR, "job_failed", NULL, 0, "bytes \xc3(");
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    fclose(f);
    size_t n;
    char *t = kvm_test_read_file(path, &n);
    ck_assert_msg(!strncmp(t, "[compress w] plain 1\n", 21), "text line: %s", t);
    char *json = strchr(t, '\n') + 1;
    ck_assert_int_eq(check_json_lines(json, "kvm_log", "compress", "job_requeued"), 1);
    json_t *o = json_loadb(json, strcspn(json, "\n"), 0, NULL);
    ck_assert_str_eq(json_string_value(json_object_get(o, "level")), "warn");
    ck_assert_str_eq(json_string_value(json_object_get(o, "msg")), "requeueing \"x\ty\"");
    ck_assert_str_eq(json_string_value(json_object_get(o, "doc")), "a \"quoted\"\nname\x01");
    ck_assert_int_eq(json_integer_value(json_object_get(o, "job_id")), 7);
    ck_assert(json_real_value(json_object_get(o, "ms")) == 1.5);
    ck_assert(json_is_null(json_object_get(o, "bad")) && json_is_null(json_object_get(o, "nan")));
    json_decref(o);
    ck_assert_int_eq(check_json_lines(json, "kvm_log", NULL, "job_failed"), 1);
    /* a message with bytes that are not UTF-8 (a latin-1 path, say) keeps its text, each such
     * byte as U+FFFD; it was replaced whole by "(message is not valid UTF-8)" */
    const char *line = strstr(json, "\"job_failed\"");
    ck_assert_ptr_nonnull(line);
    while (line > json && line[-1] != '\n') line--;
    o = json_loadb(line, strcspn(line, "\n"), 0, NULL);
    ck_assert_ptr_nonnull(o);
    ck_assert_str_eq(json_string_value(json_object_get(o, "msg")), "bytes \xEF\xBF\xBD(");
    json_decref(o);
    free(t);
}
END_TEST

static pid_t spawn_sh(const char *cmd)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* [store] service_bind: kvmill run starts the store service on the store's host; a compress
 * worker started by hand uploads every cache through it (no LMDB opened by the worker); the
 * service SIGKILLed after the first commit is started again by the run, the worker retries
 * its upload, and every document is stored once. */
START_TEST(test_run_starts_store_service)
{
    /* jobs long enough that the kill lands mid-run: after the first commit the other four jobs
     * must outlast the test's noticing it. 40 iterations take about 0.5 s a job under the
     * sanitizers but 70 ms in the plain build (the AVX2 solver), a margin of 0.3 s that a
     * loaded machine can eat; 300 (0.33 s a job) give the plain build 1.3 s */
    setenv("KVM_SLOW_COMPRESS", kvm_test_quick() ? "40" : "300", 1);
    int port = kvm_test_tcp_port(0);
    char extra[512], outp[4300], errp[4300], werr[4300], cmd[16000], slog[4300];
    snprintf(extra, sizeof extra, "[store]\nservice_bind = tcp://127.0.0.1:%d\n[stages]\ncompress_workers = 0\n", port);
    write_config(extra);
    snprintf(outp, sizeof outp, "%s/run.out", tmp);
    snprintf(errp, sizeof errp, "%s/run.err", tmp);
    snprintf(werr, sizeof werr, "%s/worker.err", tmp);
    snprintf(slog, sizeof slog, "%s/store.log", run_dir);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill' run --config '%s' --corpus '%s' >'%s' 2>'%s'", kvm_test_bin(), cfg_path, docs,
             outp, errp);
    pid_t run = spawn_sh(cmd);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill-compress' --connect 'ipc://%s' --store tcp://127.0.0.1:%d --heartbeat-ms 100 2>'%s'",
             kvm_test_bin(), run_dir, port, werr);
    pid_t worker = spawn_sh(cmd);
    long svc = 0;
    int killed = 0, status = 0;
    /* up to 180 s: a cache upload cut by the SIGKILL waits out the store client's 60 s reply
     * timeout before the worker retries it, so 60 s here could give up on a run that completes */
    for (int i = 0; i < 18000 && waitpid(run, &status, WNOHANG) == 0; i++, usleep(10000)) {
        size_t n;
        char *e = kvm_test_read_file(errp, &n), *l = killed ? NULL : kvm_test_read_file(slog, &n);
        const char *p = e ? strstr(e, "store service on ") : NULL;
        if (p && (p = strstr(p, "(pid "))) svc = atol(p + 5);
        if (!killed && svc > 0 && l && strstr(l, "committed job")) {
            ck_assert_int_eq(kill((pid_t)svc, SIGKILL), 0);
            killed = 1;
        }
        free(e);
        free(l);
    }
    kill(worker, SIGTERM);
    waitpid(worker, NULL, 0);
    size_t n;
    char *out = kvm_test_read_file(outp, &n), *err = kvm_test_read_file(errp, &n), *we = kvm_test_read_file(werr, &n);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "run exited %d\n%s\nworker:\n%s", status, err, we);
    ck_assert_msg(killed, "the store service never committed before the run ended\n%s", err);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0"), "stdout: %s\nstderr: %s\nworker: %s", out, err, we);
    ck_assert_msg(strstr(err, "the store service exited (signal 9): starting it again"), "stderr: %s", err);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
    ck_assert_msg(kill((pid_t)svc, 0) != 0, "the first store service is still running");
    free(out); free(err); free(we);
}
END_TEST

/* A compress worker that talks to the store service only runs method polykv: it fetches the
 * calibrated strategy by model id (get_strategy) once, every cache lands in the store under
 * the config id the store's own strategy gives (a local run afterwards skips them all). */
START_TEST(test_remote_worker_polykv)
{
    int port = kvm_test_tcp_port(1);
    char text[8192], outp[4300], errp[4300], werr[4300], cmd[16000];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n"
             "[store]\npath = %s\n[run]\nheartbeat_ms = 100\nliveness = 100\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    char *out, *err;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg_path, docs);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "stored strategy 'default'"), "calibrate exit %d: %s\n%s", rc, out, err);
    free(out); free(err);
    size_t n = strlen(text);
    snprintf(text + n, sizeof text - n, "[store]\nservice_bind = tcp://127.0.0.1:%d\n[stages]\ncompress_workers = 0\n", port);
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    snprintf(outp, sizeof outp, "%s/run.out", tmp);
    snprintf(errp, sizeof errp, "%s/run.err", tmp);
    snprintf(werr, sizeof werr, "%s/worker.err", tmp);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill' run --config '%s' --corpus '%s' >'%s' 2>'%s'", kvm_test_bin(), cfg_path, docs,
             outp, errp);
    pid_t run = spawn_sh(cmd);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill-compress' --connect 'ipc://%s' --store tcp://127.0.0.1:%d --heartbeat-ms 100 2>'%s'",
             kvm_test_bin(), run_dir, port, werr);
    pid_t worker = spawn_sh(cmd);
    int status = 0;
    for (int i = 0; i < 12000 && waitpid(run, &status, WNOHANG) == 0; i++) usleep(10000);
    kill(worker, SIGTERM);
    waitpid(worker, NULL, 0);
    out = kvm_test_read_file(outp, &n), err = kvm_test_read_file(errp, &n);
    char *we = kvm_test_read_file(werr, &n);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "run exited %d\n%s\nworker:\n%s", status, err, we);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0"), "stdout: %s\nstderr: %s\nworker: %s", out, err, we);
    const char *f = we ? strstr(we, "fetched PolyKV strategy 'default'") : NULL;
    ck_assert_msg(f && !strstr(f + 1, "fetched PolyKV strategy"), "the strategy was not fetched exactly once: %s", we);
    ck_assert_msg(!strstr(we, "run this worker on the store's host"), "worker: %s", we);
    free(out); free(err); free(we);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
    /* the same config run locally: every cache is already stored under its config id */
    text[n] = '\0';
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    ck_assert_int_eq(run_kvmill(&out, &err), 0);
    ck_assert_msg(strstr(out, "summary: compressed=0 skipped=5 failed=0"), "stdout: %s\nstderr: %s", out, err);
    free(out); free(err);
}
END_TEST

START_TEST(test_compress_worker_killed)
{
    setenv("KVM_SLOW_COMPRESS", "300", 1); /* longer solves: the worker is almost always mid-job (the fast solver needs many iterations) */
    write_config(NULL);
    unsetenv("KVM_SLOW_COMPRESS");
    char out_path[4300], err_path[4300];
    snprintf(out_path, sizeof out_path, "%s/out.txt", tmp);
    snprintf(err_path, sizeof err_path, "%s/err.txt", tmp);
    pid_t pid = fork();
    if (pid == 0) {
        freopen(out_path, "w", stdout);
        freopen(err_path, "w", stderr);
        char exe[4200];
        snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
        execl(exe, exe, "run", "--config", cfg_path, "--corpus", docs, (char *)NULL);
        _exit(127);
    }
    /* wait until the compress worker has finished one job, then kill it */
    char logp[4400], cmd[4600];
    snprintf(logp, sizeof logp, "%s/compress-1-r0.log", run_dir);
    int killed = 0;
    for (int i = 0; i < 600 && !killed; i++) {
        usleep(50000);
        char *log = kvm_test_read_file(logp, NULL);
        if (log && strstr(log, " stage compress ")) {
            /* [-] keeps the pattern from matching this shell's own command line; the parent
             * pid keeps it from killing the compress-1-r0 of any other run on this machine */
            snprintf(cmd, sizeof cmd, "pkill -KILL -f -- '[-]-id compress-1-r0 --parent-pid %d( |$)'", (int)pid);
            killed = system(cmd) == 0;
        }
        free(log);
    }
    ck_assert_msg(killed, "never saw the compress worker finish a job");
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    char *out = kvm_test_read_file(out_path, NULL), *err = kvm_test_read_file(err_path, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\n%s", st, err);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0"), "stdout: %s\nstderr: %s", out, err);
    ck_assert_msg(strstr(err, "signal 9"), "stderr: %s", err);
    ck_assert_int_eq(kvm_test_store_caches(store), 5); /* none lost, none stored twice */
    free(out); free(err);
}
END_TEST

START_TEST(test_bad_config_and_missing_binary)
{
    char *out, *err;
    write_config("[compress]\nratoi = 0.3\n");
    ck_assert_int_eq(run_kvmill(&out, &err), 2);
    ck_assert_msg(strstr(err, "t.ini:") && strstr(err, "ratoi: unknown key"), "stderr: %s", err);
    free(out); free(err);
    /* a bin_dir without stage binaries */
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 64\n[store]\npath = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, docs);
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    ck_assert_int_eq(run_kvmill(&out, &err), 2);
    ck_assert_msg(strstr(err, "kvmill-prefill is missing"), "stderr: %s", err);
    free(out); free(err);
    /* a non-local bind without CurveZMQ keys is refused before anything starts */
    write_config("[run]\nbind = tcp://0.0.0.0:5599\n");
    ck_assert_int_eq(run_kvmill(&out, &err), 2);
    ck_assert_msg(strstr(err, "is not local") && strstr(err, "[security]"), "stderr: %s", err);
    free(out); free(err);
    /* a device this machine cannot use is refused before any stage starts */
    write_config("compress_devices = cpu,cuda:7\ncompress_workers = 2\n");
    ck_assert_int_eq(run_kvmill(&out, &err), 2);
    ck_assert_msg(strstr(err, "[stages] compress_devices: cuda:7"), "stderr: %s", err);
    free(out); free(err);
    /* prefill workers run on cuda:N (issue 13): a device this machine lacks is refused up front
     * like a compress worker's, for what it is (no "host forward" refusal any more) */
    write_config("prefill_devices = cpu,cuda:7\n");
    ck_assert_int_eq(run_kvmill(&out, &err), 2);
    ck_assert_msg(strstr(err, "[stages] prefill_devices: cuda:7") && !strstr(err, "host forward"), "stderr: %s", err);
    free(out); free(err);
    /* a corpus that is neither a folder nor .jsonl */
    write_config(NULL);
    char cmd[12000];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, cfg_path);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_ptr_nonnull(strstr(err, "expected a folder of *.txt or a .jsonl file"));
    free(out); free(err);
    /* a bad sculpt-family [compress] key is refused up front, not in every document's job */
    write_config("[compress]\nquery_source = repeat+foo\n");
    ck_assert_int_eq(run_kvmill(&out, &err), 2);
    ck_assert_msg(strstr(err, "[compress]: sculpt: query_source 'repeat+foo': 'foo' is not"), "stderr: %s", err);
    free(out); free(err);
    write_config(NULL);
    /* a metrics file that cannot be written is refused before the run, not warned about after */
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s' --metrics '%s/none/m.json'", kvm_test_bin(),
             cfg_path, docs, tmp);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "/none/m.json: folder ") && strstr(err, "No such file or directory"), "stderr: %s", err);
    free(out); free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s' --metrics '%s'", kvm_test_bin(), cfg_path,
             docs, tmp);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "is a directory"), "stderr: %s", err);
    free(out); free(err);
    /* --metrics replaces its file: pointed at the config (or the store's data.mdb, a document) it
     * destroyed it; a file that is not an earlier run's metrics is refused, and left as it was */
    size_t before_n, after_n;
    char *before = kvm_test_read_file(cfg_path, &before_n);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s' --metrics '%s'", kvm_test_bin(), cfg_path,
             docs, cfg_path);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "exists and is not a metrics file kvmill wrote"), "stderr: %s", err);
    free(out); free(err);
    char *after = kvm_test_read_file(cfg_path, &after_n);
    ck_assert(after && before_n == after_n && !memcmp(before, after, before_n));
    free(before); free(after);
    /* a FIFO (or a device: as root `--metrics /dev/null` replaced /dev/null) was replaced by the
     * run's regular file, exit 0: refused now, and left a FIFO */
    char fifo[4300];
    snprintf(fifo, sizeof fifo, "%s/m.fifo", tmp);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 '%s/kvmill' run --config '%s' --corpus '%s' --metrics '%s'", kvm_test_bin(),
             cfg_path, docs, fifo);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "m.fifo is not a regular file (a FIFO, socket or device)"), "exit %d: %s", rc,
                  err);
    free(out);
    free(err);
    struct stat fs;
    ck_assert_msg(lstat(fifo, &fs) == 0 && S_ISFIFO(fs.st_mode), "--metrics replaced the FIFO %s", fifo);
}
END_TEST

/* A fake orchestrator: binds ctl/data, starts one stage, sends garbage and then real work. */
typedef struct fake {
    void *zctx, *ctl, *data;
    char base[4300], id[256];
    pid_t pid;
} fake;

static void fake_start_grace(fake *f, const char *stage, const char *grace);
static void fake_start(fake *f, const char *stage) { fake_start_grace(f, stage, "30"); }

static void fake_start_grace(fake *f, const char *stage, const char *grace)
{
    snprintf(f->base, sizeof f->base, "ipc://%s", tmp);
    char ctl[4400], data[4400];
    ck_assert_int_eq(kvm_stage_endpoints(f->base, ctl, data, sizeof ctl), 0);
    f->zctx = zmq_ctx_new();
    f->ctl = zmq_socket(f->zctx, ZMQ_ROUTER);
    f->data = zmq_socket(f->zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f->ctl, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(f->data, ZMQ_LINGER, &linger, sizeof linger);
    ck_assert_int_eq(zmq_bind(f->ctl, ctl), 0);
    ck_assert_int_eq(zmq_bind(f->data, data), 0);
    snprintf(f->id, sizeof f->id, "%s-test", stage);
    /* as kvmill run makes its store before its stages start (they refuse a --store that is none) */
    kvm_store *st = NULL;
    ck_assert_msg(kvm_store_open(store, NULL, &st) == 0, "%s", kvm_errmsg());
    kvm_store_close(&st);
    char exe[4200], logp[4400];
    snprintf(exe, sizeof exe, "%s/kvmill-%s", kvm_test_bin(), stage);
    snprintf(logp, sizeof logp, "%s/%s.log", tmp, stage);
    if ((f->pid = fork()) == 0) {
        freopen(logp, "w", stderr);
        execl(exe, exe, "--connect", f->base, "--store", store, "--id", f->id, "--heartbeat-ms", "100", "--grace-s", grace,
              (char *)NULL);
        _exit(127);
    }
}

/* Receives one message from sock within ms; returns it without the routing frame, or NULL. */
static kvm_msg *fake_recv(void *sock, int ms)
{
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, ms) <= 0) return NULL;
    kvm_msg *m = NULL, *env = NULL;
    ck_assert_int_eq(kvm_msg_recv(sock, &m, 0), 0);
    ck_assert_int_eq(kvm_msg_split(m, 1, &env), 0);
    kvm_msg_free(&env);
    return m;
}

/* Waits for a message of type t on sock (others are skipped). */
static kvm_msg *fake_expect(void *sock, kvm_proto_type t, int ms)
{
    for (double end = kvm_now_ms() + ms; kvm_now_ms() < end;) {
        kvm_msg *m = fake_recv(sock, 100);
        kvm_proto_type got;
        if (m && kvm_proto_peek(m, &got) == 0 && got == t) return m;
        kvm_msg_free(&m);
    }
    return NULL;
}

static void fake_send(fake *f, const void *frames[], const size_t sizes[], int n)
{
    zmq_send(f->data, f->id, strlen(f->id), ZMQ_SNDMORE);
    for (int i = 0; i < n; i++) zmq_send(f->data, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0);
}

static void fake_send_msg(fake *f, kvm_msg *m)
{
    const void *fr[16];
    size_t sz[16];
    int n = (int)kvm_msg_nframes(m);
    for (int i = 0; i < n; i++) fr[i] = kvm_msg_frame(m, (size_t)i).data, sz[i] = kvm_msg_frame(m, (size_t)i).size;
    fake_send(f, fr, sz, n);
}

static void fake_stop(fake *f)
{
    kill(f->pid, SIGTERM);
    int st;
    waitpid(f->pid, &st, 0);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "stage exit status %d", st);
    zmq_close(f->ctl);
    zmq_close(f->data);
    zmq_ctx_term(f->zctx);
}

static void send_garbage(fake *f)
{
    const void *g1[1] = {"\xc1" " not msgpack"};
    size_t s1[1] = {13};
    fake_send(f, g1, s1, 1);
    const char map[] = "\x82\xa1v\x01\xa4type\xa5" "bogus"; /* {"v":1,"type":"bogus"} */
    const void *g2[2] = {map, "xx"};
    size_t s2[2] = {sizeof map - 1, 2};
    fake_send(f, g2, s2, 2);
}

static kvm_msg *job_msg_n(uint64_t id, int n_tokens);
static kvm_msg *job_msg(uint64_t id) { return job_msg_n(id, 40); }
static kvm_msg *job_msg_toks(uint64_t id, const int32_t *toks, int n_tokens);

/* A job of n_tokens (<= 128) made-up token ids with the settings of cfg_path. */
static kvm_msg *job_msg_n(uint64_t id, int n_tokens)
{
    int32_t toks[128];
    for (int i = 0; i < n_tokens; i++)
        toks[i] = i == 0 ? 1 : 259 + (i * 7) % 200;
    return job_msg_toks(id, toks, n_tokens);
}

/* A job of the tokens toks[0, n_tokens) with the settings of cfg_path. */
static kvm_msg *job_msg_toks(uint64_t id, const int32_t *toks, int n_tokens)
{
    if (access(cfg_path, R_OK) != 0) write_config(NULL);
    kvm_config *c;
    ck_assert_int_eq(kvm_config_load(cfg_path, &c), 0);
    uint8_t *mp;
    size_t n;
    ck_assert_int_eq(kvm_jobcfg_pack(c, &mp, &n), 0);
    kvm_proto_job j = {.job_id = id, .doc_id = kvm_proto_str_c("doc"), .n_ctx = 128, .n_tokens = n_tokens, .tokens = toks,
                       .settings = mp, .settings_bytes = n};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_job_encode(&j, &m), 0);
    free(mp);
    kvm_config_free(&c);
    return m;
}

START_TEST(test_garbage_to_each_stage)
{
    fake p = {0}, c = {0};
    fake_start(&p, "prefill");
    kvm_msg *m = fake_expect(p.data, KVM_PROTO_READY, 10000); /* the stage's credit */
    ck_assert_ptr_nonnull(m);
    kvm_msg_free(&m);
    send_garbage(&p);
    kvm_msg *job = job_msg(7);
    fake_send_msg(&p, job);
    kvm_msg *kv[5];
    for (int l = 0; l < 5; l++) ck_assert_ptr_nonnull(kv[l] = fake_expect(p.data, KVM_PROTO_KV, 20000));
    kvm_msg *res = fake_expect(p.ctl, KVM_PROTO_RESULT, 5000);
    ck_assert_ptr_nonnull(res);
    kvm_msg_free(&res);
    fake_stop(&p);
    char lp[4400];
    snprintf(lp, sizeof lp, "%s/prefill.log", tmp);
    char *log = kvm_test_read_file(lp, NULL);
    ck_assert_msg(log && strstr(log, "dropped a malformed message") && strstr(log, "bogus"), "log: %s", log);
    free(log);

    fake_start(&c, "compress");
    ck_assert_ptr_nonnull(m = fake_expect(c.data, KVM_PROTO_READY, 10000));
    kvm_msg_free(&m);
    send_garbage(&c);
    fake_send_msg(&c, kv[0]); /* a kv before its job: unexpected */
    fake_send_msg(&c, job);
    for (int l = 0; l < 5; l++) fake_send_msg(&c, kv[l]);
    kvm_msg *ack = fake_expect(c.ctl, KVM_PROTO_ACK, 30000);
    ck_assert_ptr_nonnull(ack);
    kvm_proto_ack a;
    ck_assert_int_eq(kvm_proto_ack_decode(ack, &a), 0);
    ck_assert_int_eq(a.job_id, 7);
    kvm_msg_free(&ack);
    fake_stop(&c);
    snprintf(lp, sizeof lp, "%s/compress.log", tmp);
    log = kvm_test_read_file(lp, NULL);
    ck_assert_msg(log && strstr(log, "dropped") && strstr(log, "expected a job message first"), "log: %s", log);
    free(log);
    ck_assert_int_eq(kvm_test_store_caches(store), 1);
    for (int l = 0; l < 5; l++) kvm_msg_free(&kv[l]);
    kvm_msg_free(&job);
}
END_TEST

/* Whether a stage's error is retried. Unset by the stage's code, the flag follows the status
 * (kvm_err_retryable: I/O, memory, device), where it said "retryable" for every error, so a run
 * requeued a document up to max_retries times for the same failure. A model the worker cannot
 * load is retryable: the orchestrator opened the same model before starting the stages, so the
 * cause is the worker's host (a mount not up yet, a file still being copied), which another
 * worker may not share. A token outside the vocabulary is final. A store whose LMDB reader
 * table is full (KVM_EBUSY) is retried. */
START_TEST(test_stage_error_retryable_by_cause)
{
    ck_assert(kvm_err_retryable(KVM_EIO) && kvm_err_retryable(KVM_ENOMEM) && kvm_err_retryable(KVM_EDEVICE));
    ck_assert(!kvm_err_retryable(KVM_EINVAL) && !kvm_err_retryable(KVM_EFORMAT) && !kvm_err_retryable(KVM_ECORRUPT));
    /* a store's full reader table frees as other reads end; a full map or disk does not */
    ck_assert(kvm_err_retryable(KVM_EBUSY) && !kvm_err_retryable(KVM_EFULL));
    char bad[4300], text[8192];
    snprintf(bad, sizeof bad, "%s/not-a-model.bin", tmp);
    ck_assert_int_eq(kvm_test_write_file(bad, "not a checkpoint, only text\n", 28), 0);
    for (int final = 0; final < 2; final++) {
        snprintf(text, sizeof text,
                 "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = h2o\nbudget = 16\n"
                 "[store]\npath = %s\n",
                 final ? kvm_test_data_path("models/stories260K.bin") : bad, store);
        ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
        fake p = {0};
        fake_start(&p, "prefill");
        kvm_msg *m = fake_expect(p.data, KVM_PROTO_READY, 10000); /* the stage's credit */
        ck_assert_ptr_nonnull(m);
        kvm_msg_free(&m);
        int32_t toks[2] = {1, final ? 600 : 5}; /* 600: outside stories260K's 512 */
        kvm_msg *job = job_msg_toks(9, toks, 2);
        fake_send_msg(&p, job);
        kvm_msg *e = fake_expect(p.ctl, KVM_PROTO_ERROR, 20000);
        ck_assert_ptr_nonnull(e);
        kvm_proto_result r;
        ck_assert_int_eq(kvm_proto_error_decode(e, &r), 0);
        ck_assert_int_eq(r.job_id, 9);
        ck_assert_msg(r.retryable == !final, "error %d '%.*s': retryable %d", (int)r.status, (int)r.message.len,
                      r.message.ptr, (int)r.retryable);
        char msg[1024];
        snprintf(msg, sizeof msg, "%.*s", (int)r.message.len, r.message.ptr);
        ck_assert_msg(strstr(msg, final ? "outside the model's vocabulary" : "not-a-model.bin"), "message '%s'", msg);
        kvm_msg_free(&e);
        kvm_msg_free(&job);
        fake_stop(&p);
    }
}
END_TEST

/* Spawns `kvmill run` in the background with stdout/stderr to files in tmp. */
static pid_t run_background(const char *corpus)
{
    char out_path[4300], err_path[4300];
    snprintf(out_path, sizeof out_path, "%s/out.txt", tmp);
    snprintf(err_path, sizeof err_path, "%s/err.txt", tmp);
    /* an earlier run's files go first: a wait for a line in them must not find that run's */
    unlink(out_path);
    unlink(err_path);
    pid_t pid = fork();
    if (pid == 0) {
        freopen(out_path, "w", stdout);
        freopen(err_path, "w", stderr);
        char exe[4200];
        snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
        execl(exe, exe, "run", "--config", cfg_path, "--corpus", corpus, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static char *tmp_file(const char *name)
{
    char p[4300];
    snprintf(p, sizeof p, "%s/%s", tmp, name);
    return kvm_test_read_file(p, NULL);
}

/* Waits up to ms for tmp/NAME to hold at least `times` occurrences of needle; returns 1 when it
 * does, 0 on timeout. */
static int wait_for_file(const char *name, const char *needle, int times, int ms)
{
    for (double end = kvm_now_ms() + ms;; usleep(20000)) {
        char *text = tmp_file(name);
        int n = text ? kvm_test_count(text, needle) : 0;
        free(text);
        if (n >= times) return 1;
        if (kvm_now_ms() >= end) return 0;
    }
}

START_TEST(test_external_worker_joins)
{
    write_config("compress_workers = 0\n"); /* appended to [stages]: nobody compresses... */
    pid_t run = run_background(docs);
    /* the worker names the run's store, which the run makes before it says its run directory
     * (a worker refuses a --store that is no store: a fixed 300 ms could come before it) */
    if (!wait_for_file("err.txt", ", run directory ", 1, 60000)) kill(run, SIGKILL);
    char base[4400], exe[4200];
    snprintf(base, sizeof base, "ipc://%s", run_dir);
    snprintf(exe, sizeof exe, "%s/kvmill-compress", kvm_test_bin());
    pid_t w = fork(); /* ...until a worker started by hand joins the running pipeline */
    if (w == 0) {
        char lp[4400];
        snprintf(lp, sizeof lp, "%s/external.log", tmp);
        freopen(lp, "w", stderr);
        execl(exe, exe, "--connect", base, "--store", store, "--heartbeat-ms", "100", "--id", "by-hand", (char *)NULL);
        _exit(127);
    }
    int st;
    ck_assert_int_eq(waitpid(run, &st, 0), run);
    char *out = tmp_file("out.txt"), *err = tmp_file("err.txt");
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d: %s", st, err);
    ck_assert_msg(strstr(out, "summary: compressed=5 "), "stdout: %s", out);
    ck_assert_msg(strstr(err, "external compress worker by-hand joined"), "stderr: %s", err);
    kill(w, SIGTERM);
    ck_assert_int_eq(waitpid(w, &st, 0), w);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker exit %d", st);
    free(out); free(err);
}
END_TEST

/* The orchestrator's ipc socket files "ctl" and "data" are gone from the run directory: ZeroMQ
 * leaves them at close, and calibrate (like run) left them in a kept run directory. */
static void no_socket_files(const char *when)
{
    const char *names[] = {"ctl", "data"};
    for (int i = 0; i < 2; i++) {
        char p[4400];
        struct stat sb;
        snprintf(p, sizeof p, "%s/%s", run_dir, names[i]);
        ck_assert_msg(lstat(p, &sb) != 0, "%s: %s is left", when, p);
    }
}

START_TEST(test_ctrl_c)
{
    /* jobs of seconds: the Ctrl-C lands while work remains; under the sanitizers (quick) 60
     * iterations of 64 queries last that long already, where 2,000 of 2,048 take minutes */
    setenv("KVM_SLOW_COMPRESS", kvm_test_quick() ? "60" : "2000", 1);
    write_config(NULL);
    unsetenv("KVM_SLOW_COMPRESS");
    /* first Ctrl-C: drain (the jobs in flight complete, queued ones are abandoned), exit 130 */
    pid_t run = run_background(docs);
    char lp[4400];
    snprintf(lp, sizeof lp, "%s/compress-1-r0.log", run_dir);
    for (int i = 0; i < 400; i++) {
        usleep(50000);
        char *log = kvm_test_read_file(lp, NULL);
        int started = log && strstr(log, "connected");
        free(log);
        if (started) break;
    }
    usleep(300000);
    kill(run, SIGINT);
    int st;
    ck_assert_int_eq(waitpid(run, &st, 0), run);
    char *out = tmp_file("out.txt"), *err = tmp_file("err.txt");
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d: %s", st, err); /* not a complete run */
    ck_assert_msg(strstr(err, "interrupted: finishing the jobs in flight"), "stderr: %s", err);
    ck_assert_msg(strstr(out, "interrupted:") && strstr(out, "failed=0"), "stdout: %s", out);
    no_socket_files("a run stopped by Ctrl-C");
    /* how many documents were already past prefill when the signal came depends on timing;
     * what must hold is that the run stopped cleanly with nothing failed or half-stored */
    free(out); free(err);
    /* second Ctrl-C: stop at once, exit 130 (a fresh store, so there is work to interrupt).
     * Each Ctrl-C waits for what it needs, not for fixed 300 and 100 ms: the first for a job in
     * compress (progress_s = 0: a progress line at each change) and the second for the first's
     * drain, which that job keeps going for minutes (2,048 queries). A SIGINT before the run
     * installs its handler killed it (status 2, not 130), and so did a second one after a drain
     * with nothing in flight had ended the run and its handler was put back as it exited;
     * both happened on a loaded machine */
    kvm_test_rmtree(store);
    setenv("KVM_SLOW_COMPRESS", "2000", 1);
    write_config("[run]\nprogress_s = 0\n");
    unsetenv("KVM_SLOW_COMPRESS");
    run = run_background(docs);
    ck_assert_msg(wait_for_file("err.txt", " in compress: ", 1, 120000), "no document reached compress");
    kill(run, SIGINT);
    ck_assert_msg(wait_for_file("err.txt", "interrupted: finishing the jobs in flight", 1, 60000),
                  "the first Ctrl-C was not taken");
    kill(run, SIGINT);
    ck_assert_int_eq(waitpid(run, &st, 0), run);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "status %d", st);
    /* nothing half-written: every stored cache verifies */
    char cmd[8000];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store verify --store '%s'", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
}
END_TEST

START_TEST(test_jsonl_corpus)
{
    write_config(NULL);
    char path[4300];
    snprintf(path, sizeof path, "%s/c.jsonl", tmp);
    const char *good = "{\"id\": \"a\", \"text\": \"Once upon a time there was a cat.\"}\n"
                       "\n{\"id\": \"b\", \"tokens\": [1, 403, 300, 290, 301]}\n"
                       "{\"id\": \"c\", \"tokens\": [403, 300, 290, 301]}\n" /* = b once BOS is added: one cache */
                       "{\"id\": \"d\", \"tokens\": [1, 99999]}\n"            /* outside the vocabulary: fails alone */
                       "{\"id\": \"e\", \"text\": \"\"}\n"                   /* empty: fails alone */
                       "{\"id\": \"f\", \"tokens\": []}\n";                /* so does this one (it refused the corpus) */
    ck_assert_int_eq(kvm_test_write_file(path, good, strlen(good)), 0);
    char cmd[12000], *out, *err;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, path);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 1, "exit %d: %s", rc, err); /* some documents failed */
    ck_assert_msg(strstr(out, "summary: compressed=2 skipped=1 failed=3 truncated=0 "), "stdout: %s", out);
    ck_assert_msg(strstr(err, "document d: token 1 has id 99999") && strstr(err, "document e is empty") &&
                  strstr(err, "document f is empty"), "stderr: %s", err);
    free(out); free(err);
    /* the last: a line break in an id went raw into every log line naming the document */
    const char *bad[] = {"{\"id\": \"a\"}\n",
                         "{\"id\": 5, \"text\": \"x\"}\n",
                         "not json\n",
                         "{\"id\": \"a\", \"tokens\": [1, -2]}\n",
                         "{\"id\":\"a\",\"text\":\"x\"}\n{\"id\":\"a\",\"text\":\"y\"}\n",
                         "{\"id\": \"a\\nb\", \"text\": \"x\"}\n"};
    const char *why[] = {"exactly one of",    "\"id\" must be", "invalid JSON",
                         "is not a token id", "duplicate id",   "\"id\" holds a line break (at byte 1)"};
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(kvm_test_write_file(path, bad[i], strlen(bad[i])), 0);
        ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
        ck_assert_msg(strstr(err, why[i]) && strstr(err, "c.jsonl:"), "case %d stderr: %s", i, err);
        free(out); free(err);
    }
    /* a folder corpus's file name holding a line break went raw into the log lines naming it:
     * it is shown escaped and fails alone */
    char dir[4300], file[4400];
    snprintf(dir, sizeof dir, "%s/folder", tmp);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    const char *names[3] = {"a\nb.txt", "c.txt", "caf\xe9.txt"}, /* the last in latin-1: stored as caf%E9.txt */
        *texts[3] = {"Once upon a time.", "A cat sat on a mat.", "A dog ran in the park."};
    for (int i = 0; i < 3; i++) {
        snprintf(file, sizeof file, "%s/%s", dir, names[i]);
        ck_assert_int_eq(kvm_test_write_file(file, texts[i], strlen(texts[i])), 0);
    }
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
    ck_assert_msg(strstr(out, "summary: compressed=2 skipped=0 failed=1 "), "stdout: %s", out);
    ck_assert_msg(strstr(err, "a\\nb.txt: the file name holds a line break") && !strstr(err, "a\nb"), "stderr: %s",
                  err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --store '%s' --names", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(strstr(out, " caf%E9.txt\n") && strstr(out, " c.txt\n"), "stdout: %s", out);
    free(out);
    free(err);
    /* a file literally named caf%E9.txt beside the latin-1 one: two documents under one name;
     * the escaped one fails now, named, and the literal one keeps its name */
    snprintf(file, sizeof file, "%s/caf%%E9.txt", dir);
    ck_assert_int_eq(kvm_test_write_file(file, "A bird sang in a tree.", 22), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
    ck_assert_msg(strstr(err, "caf%E9.txt: its name, with the bytes that are not UTF-8 written %HH, is another file's"),
                  "stderr: %s", err);
    ck_assert_msg(strstr(out, "compressed=1 skipped=1 failed=2 "), "stdout: %s", out);
    free(out);
    free(err);
}
END_TEST

/* A JSONL id longer than 255 bytes was recorded as its first 255 bytes, cut inside a character
 * (an "é" split to \xc3): the store held a name that is not UTF-8, and `store ls --names --csv`
 * wrote it raw. It is cut at the character before now: 254 bytes here. */
START_TEST(test_jsonl_long_id_cut_at_char)
{
    write_config(NULL);
    char id[300], line[512], path[4300];
    memset(id, 'a', 254);
    snprintf(id + 254, sizeof id - 254, "\xc3\xa9-and-more");
    snprintf(line, sizeof line, "{\"id\": \"%s\", \"text\": \"Once upon a time there was a cat.\"}\n", id);
    snprintf(path, sizeof path, "%s/c.jsonl", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, line, strlen(line)), 0);
    char cmd[12000], *out, *err;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, path);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "summary: compressed=1 "), "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --store '%s' --names --csv", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    char want[300];
    snprintf(want, sizeof want, ",%.254s\n", id); /* the row ends with the name: the 254 ASCII bytes alone */
    ck_assert_msg(kvm_utf8_valid(out, strlen(out)), "not UTF-8: %s", out);
    ck_assert_msg(strstr(out, want), "want the name %.254s (254 bytes) in: %s", id, out);
    free(out);
    free(err);
}
END_TEST

/* [eval] enabled: the summary's mean KL equals the evaluation harness's on the same documents. */
START_TEST(test_eval_matches_harness)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = snapkv\nbudget = 32\n[eval]\nenabled = true\n"
             "continuation = 32\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    char *out, *err;
    ck_assert_int_eq(run_kvmill(&out, &err), 0);
    char *line = strstr(out, "evaluation: mean KL(full || compressed) ");
    ck_assert_msg(line, "stdout: %s", out);
    double kl_pipe = strtod(line + strlen("evaluation: mean KL(full || compressed) "), NULL);
    ck_assert_ptr_nonnull(strstr(line, "over 5 documents"));
    free(out); free(err);
    char cmd[12000], csv[4400];
    snprintf(csv, sizeof csv, "%s/eval.csv", tmp);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' eval --model '%s' --docs '%s' --method snapkv --budget 32 --context 128 "
             "--continuation 32 --csv '%s'", kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"), docs, csv);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    char *rows = kvm_test_read_file(csv, NULL);
    ck_assert_ptr_nonnull(rows);
    double sum = 0;
    int n = 0;
    for (char *r = strchr(rows, '\n'); r && r[1]; r = strchr(r + 1, '\n')) {
        const char *f = r + 1; /* doc,method,budget_tokens,ratio,kl_mean,... */
        for (int c = 0; c < 4; c++) f = strchr(f, ',') + 1;
        sum += strtod(f, NULL);
        n++;
    }
    ck_assert_int_eq(n, 5);
    ck_assert_msg(fabs(kl_pipe - sum / n) < 1e-4 && kl_pipe > 0, "pipeline %g vs harness %g", kl_pipe, sum / n);
    free(rows); free(out); free(err);
}
END_TEST

/* [eval] enabled over a model whose logits are not finite (the final norm's weights 3e38, finite
 * as the loaders require, overflow the activations):
 * the KL, NaN, went to the result message as 0 and the summary said "mean KL 0.00000 nats over
 * 5 documents", a perfect cache. Now no document counts as evaluated (the stage log says why). */
/* [run] wire_dtype = f16 turned KV values past 65504 into inf without a word, and the document
 * failed later "not a finite number ... the model's activations overflowed". The prefill stage
 * now refuses them naming the layer, the tensor and the value, and the setting to change. */
START_TEST(test_wire_f16_overflow_named)
{
    char model[4300], text[8192];
    kvm_test_scaled_model(tmp, "bigv", 1, 3e5f, 0); /* layer 0's values past f16's range */
    snprintf(model, sizeof model, "%s/bigv.bin", tmp);
    for (int f16 = 0; f16 < 2; f16++) {
        snprintf(text, sizeof text,
                 "[model]\npath = %s\ncontext = 64\n[compress]\nmethod = streaming\nbudget = 16\n[store]\npath = "
                 "%s\n[run]\nrun_dir = %s\nwire_dtype = %s\n[stages]\nbin_dir = %s\n",
                 model, store, run_dir, f16 ? "f16" : "f32", kvm_test_bin());
        ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
        char *out, *err;
        int rc = run_kvmill(&out, &err);
        if (f16)
            ck_assert_msg(rc == 1 && strstr(err, "layer 0 values: value ") &&
                              strstr(err, "exceeds f16's range on the wire ([run] wire_dtype = f16): set wire_dtype = "
                                          "bf16 or f32"),
                          "exit %d\nstderr: %s", rc, err);
        else
            ck_assert_msg(rc == 0, "exit %d\nstderr: %s", rc, err); /* f32 carries them */
        free(out);
        free(err);
    }
}
END_TEST

START_TEST(test_eval_nonfinite_not_counted)
{
    char model[4300], text[8192];
    kvm_test_scaled_model(tmp, "nan", 0, 1, 3e38f);
    snprintf(model, sizeof model, "%s/nan.bin", tmp);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = snapkv\nbudget = 32\n[eval]\nenabled = true\n"
             "continuation = 32\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             model, store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    char *out, *err;
    ck_assert_int_eq(run_kvmill(&out, &err), 0);
    ck_assert_msg(!strstr(out, "evaluation: mean KL") &&
                      strstr(out, "evaluation: no document evaluated (5 not evaluated: the evaluation failed or its KL "
                                  "was not finite; the stage logs name them)\n"),
                  "stdout: %s", out);
    free(out);
    free(err);
}
END_TEST

/* [eval] enabled with documents no longer than [model] context: their jobs carry no continuation,
 * and the summary said "mean KL ... over 1 document" for 2 compressed ("0.00000 nats over 0
 * documents" when none was longer), with no word of the rest. Now it counts them and says why; a
 * rerun that stores nothing says so instead of "0 full f32 KV -> 0 stored (0.00x smaller)". */
START_TEST(test_eval_short_not_evaluated)
{
    char text[8192], path[4400];
    snprintf(path, sizeof path, "%s/short.txt", docs);
    ck_assert_int_eq(kvm_test_write_file(path, "Once upon a time.", 17), 0);
    for (int i = 1; i < 5; i++) { /* doc_000 (longer than the context) and short.txt */
        snprintf(path, sizeof path, "%s/doc_%03d.txt", docs, i);
        ck_assert_int_eq(unlink(path), 0);
    }
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = snapkv\nbudget = 32\n[eval]\nenabled = true\n"
             "continuation = 32\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    char *out, *err;
    ck_assert_int_eq(run_kvmill(&out, &err), 0);
    ck_assert_msg(strstr(out, "summary: compressed=2 ") &&
                      strstr(out, " nats over 1 document (continuation of 32 tokens); 1 not evaluated: no longer than "
                                  "[model] context (128 tokens), so no [eval] continuation follows to score (the "
                                  "stage logs name them)\n"),
                  "stdout: %s", out);
    free(out);
    free(err);
    ck_assert_int_eq(run_kvmill(&out, &err), 0); /* both stored: nothing compressed */
    ck_assert_msg(strstr(out, "summary: compressed=0 skipped=2 ") &&
                      strstr(out, "bytes: none stored by this run (every document was already stored: all skipped), "
                                  "method snapkv\n") &&
                      strstr(out, "evaluation: no document evaluated (none was compressed by this run)\n"),
                  "stdout: %s", out);
    free(out);
    free(err);
    snprintf(path, sizeof path, "%s/doc_000.txt", docs);
    ck_assert_int_eq(unlink(path), 0);
    snprintf(path, sizeof path, "%s/short2.txt", docs);
    ck_assert_int_eq(kvm_test_write_file(path, "A cat sat.", 10), 0);
    ck_assert_int_eq(run_kvmill(&out, &err), 0); /* short2.txt alone is compressed */
    ck_assert_msg(strstr(out, "evaluation: no document evaluated (1 not evaluated: no longer than [model] context (128 "
                              "tokens), so no [eval] continuation follows to score; the stage logs name them)\n"),
                  "stdout: %s", out);
    free(out);
    free(err);
    snprintf(text, sizeof text, "cat '%s'/compress-*.log", run_dir); /* the stage log names it */
    ck_assert_int_eq(kvm_test_run(text, &out, &err), 0);
    ck_assert_msg(strstr(out, " short2.txt: not evaluated ([eval] enabled): no tokens follow its "), "log: %.2000s",
                  out);
    free(out);
    free(err);
}
END_TEST

/* SIGTERM mid-job: with a grace period the job completes (ack) and the stage exits 0; with
 * none it hands the job back as a retryable error and exits 0. */
/* Waits until a heartbeat says the stage is working on job id (not merely received it). */
static int fake_wait_busy(fake *f, uint64_t id, int ms)
{
    for (double end = kvm_now_ms() + ms; kvm_now_ms() < end;) {
        kvm_msg *m = fake_expect(f->ctl, KVM_PROTO_HEARTBEAT, 100);
        kvm_proto_heartbeat hb;
        int busy = m && kvm_proto_heartbeat_decode(m, &hb) == 0 && hb.job_id == id;
        kvm_msg_free(&m);
        if (busy) return 1;
    }
    return 0;
}

START_TEST(test_sigterm_grace_and_hand_back)
{
    setenv("KVM_SLOW_COMPRESS", "1000", 1); /* a job of seconds: SIGTERM lands mid-job even on a loaded machine */
    write_config(NULL);
    unsetenv("KVM_SLOW_COMPRESS");
    fake p = {0};
    fake_start(&p, "prefill");
    kvm_msg *m = fake_expect(p.data, KVM_PROTO_READY, 10000);
    ck_assert_ptr_nonnull(m);
    kvm_msg_free(&m);
    kvm_msg *job = job_msg_n(9, 120), *kv[5];
    fake_send_msg(&p, job);
    for (int l = 0; l < 5; l++) ck_assert_ptr_nonnull(kv[l] = fake_expect(p.data, KVM_PROTO_KV, 20000));
    fake_stop(&p);
    const char *graces[2] = {"30", "0"};
    for (int g = 0; g < 2; g++) {
        fake c = {0};
        fake_start_grace(&c, "compress", graces[g]);
        ck_assert_ptr_nonnull(m = fake_expect(c.data, KVM_PROTO_READY, 10000));
        kvm_msg_free(&m);
        fake_send_msg(&c, job);
        for (int l = 0; l < 5; l++) fake_send_msg(&c, kv[l]);
        /* only once the job runs: a SIGTERM before would find no job to finish or hand back */
        ck_assert_msg(fake_wait_busy(&c, 9, 60000), "grace %s: no heartbeat names job 9 as running", graces[g]);
        kill(c.pid, SIGTERM);
        if (g == 0) {
            kvm_msg *ack = fake_expect(c.ctl, KVM_PROTO_ACK, 120000);
            ck_assert_msg(ack != NULL, "no ack after SIGTERM with a grace period");
            kvm_msg_free(&ack);
        } else {
            kvm_msg *e = fake_expect(c.ctl, KVM_PROTO_ERROR, 60000);
            ck_assert_msg(e != NULL, "no hand-back after SIGTERM without a grace period");
            kvm_proto_error er;
            ck_assert_int_eq(kvm_proto_error_decode(e, &er), 0);
            ck_assert_int_eq(er.job_id, 9);
            ck_assert(er.retryable);
            char msg[512];
            snprintf(msg, sizeof msg, "%.*s", (int)er.message.len, er.message.ptr);
            ck_assert_msg(strstr(msg, "handed back"), "message: %s", msg);
            kvm_msg_free(&e);
        }
        int st;
        ck_assert_int_eq(waitpid(c.pid, &st, 0), c.pid);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "grace %s: exit status %d", graces[g], st);
        zmq_close(c.ctl);
        zmq_close(c.data);
        zmq_ctx_term(c.zctx);
    }
    for (int l = 0; l < 5; l++) kvm_msg_free(&kv[l]);
    kvm_msg_free(&job);
}
END_TEST

/* calibrate stopped by SIGINT or SIGHUP (a closed terminal) left the orchestrator's "ctl" and
 * "data" socket files in its run directory: now they are removed however it ends. */
START_TEST(test_calibrate_signal_no_sockets)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n[eval]\ncontinuation = 32\n"
             "[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    const int sigs[] = {SIGINT, SIGHUP};
    for (int i = 0; i < 2; i++) {
        char out_path[4300], err_path[4300], strat[4400];
        snprintf(out_path, sizeof out_path, "%s/out.txt", tmp);
        snprintf(err_path, sizeof err_path, "%s/err.txt", tmp);
        snprintf(strat, sizeof strat, "%s/strategy%d.bin", tmp, i);
        unlink(out_path);
        unlink(err_path);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            freopen(out_path, "w", stdout);
            freopen(err_path, "w", stderr);
            char exe[4200];
            snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
            execl(exe, exe, "calibrate", "--config", cfg_path, "--docs", docs, "--out", strat, (char *)NULL);
            _exit(127);
        }
        /* the signal once the workers are at it (it may also come after their work: either way
         * the orchestrator ends through its own exit path) */
        ck_assert_msg(wait_for_file("err.txt", "calibration documents, each measured", 1, 60000),
                      "calibrate did not start");
        kill(pid, sigs[i]);
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        char *err = tmp_file("err.txt");
        ck_assert_msg(WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 130), "status 0x%x: %s", st, err);
        free(err);
        no_socket_files(sigs[i] == SIGINT ? "calibrate after SIGINT" : "calibrate after SIGHUP");
    }
}
END_TEST

/* calibrate through the stages (signals, strategy), then run with the stored strategy */
START_TEST(test_calibrate_then_polykv)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n[eval]\ncontinuation = 32\n"
             "[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    char *out, *err, cmd[12000], strat[4400];
    ck_assert_int_eq(run_kvmill(&out, &err), 2); /* no strategy yet */
    ck_assert_msg(strstr(err, "run kvmill calibrate --config"), "stderr: %s", err);
    free(out); free(err);
    snprintf(strat, sizeof strat, "%s/strategy.bin", tmp);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s' --out '%s'", kvm_test_bin(), cfg_path, docs, strat);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "calibrate exit %d: %s", rc, err);
    ck_assert_msg(strstr(out, "calibration: 5 documents, 0 failed") && strstr(out, "stored strategy 'default'"), "stdout: %s", out);
    /* the start line counts calibration documents, not a meaningless "(0 already stored)" */
    ck_assert_msg(strstr(err, "5 calibration documents, each measured") && !strstr(err, "already stored"), "stderr: %s", err);
    free(out); free(err);
    no_socket_files("calibrate");
    /* the file records the model (KVST v3, issue 15); the store's record does not (its key does), so
     * the config ids of caches, made from the record's bytes, are what they were */
    kvm_strategy *file, *rec;
    ck_assert_int_eq(kvm_strategy_read(strat, &file), 0);
    kvm_store_id mid;
    ck_assert_int_eq(kvm_store_hash_file(kvm_test_data_path("models/stories260K.bin"), &mid), 0);
    ck_assert_int_eq(file->model_known, 1);
    ck_assert_mem_eq(file->model_id, mid.b, sizeof mid.b);
    kvm_store *st;
    kvm_store_opts so = {.read_only = 1};
    uint8_t *recb, *plain;
    size_t n, np;
    ck_assert_int_eq(kvm_store_open(store, &so, &st), 0);
    ck_assert_int_eq(kvm_store_get_strategy(st, &mid, "default", &recb, &n), 0);
    kvm_store_close(&st);
    ck_assert_uint_eq(recb[4], 1);
    ck_assert_int_eq(kvm_strategy_decode(recb, n, &rec), 0);
    ck_assert_int_eq(rec->model_known, 0);
    file->model_known = 0;
    ck_assert_int_eq(kvm_strategy_encode(file, &plain, &np), 0);
    ck_assert_uint_eq(np, n);
    ck_assert_mem_eq(plain, recb, n);
    free(plain);
    free(recb);
    kvm_strategy_free(&file);
    kvm_strategy_free(&rec);
    ck_assert_int_eq(run_kvmill(&out, &err), 0);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0"), "stdout: %s\nstderr: %s", out, err);
    free(out); free(err);
}
END_TEST

/* The same with KVSculpt and KVzip in the design space and prefill-phase signals only: the
 * stats carry a sixth and seventh pattern, the strategy stage scores sculpt and kvzip
 * candidates, and the run compresses with whatever strategy won (sculpt layers distilled with
 * the [compress] sculpt settings, kvzip layers scored by KVzip with them). */
START_TEST(test_calibrate_sculpt_then_polykv)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\nqueries = 64\n"
             "rounds = 1\niterations = 5\n[calibrate]\nsculpt = true\nkvzip = true\nphases = prefill\n[eval]\n"
             "continuation = 32\n"
             "enabled = true\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    char *out, *err, cmd[12000], strat[4400];
    snprintf(strat, sizeof strat, "%s/strategy.bin", tmp);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s' --out '%s'", kvm_test_bin(), cfg_path, docs, strat);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "calibrate exit %d: %s", rc, err);
    ck_assert_msg(strstr(out, "calibration: 5 documents, 0 failed"), "stdout: %s", out);
    free(out); free(err);
    kvm_strategy *s;
    ck_assert_int_eq(kvm_strategy_read(strat, &s), 0);
    int n_sculpt = 0, n_kvzip = 0;
    for (int l = 0; l < s->n_layers; l++) {
        n_sculpt += s->layers[l].pattern[0] == KVM_PATTERN_SCULPT;
        n_kvzip += s->layers[l].pattern[0] == KVM_PATTERN_KVZIP;
    }
    printf("calibrated strategy: %d of %d layers sculpt, %d kvzip\n", n_sculpt, s->n_layers, n_kvzip);
    /* the strategy records the [compress] settings its distilled layers were scored with (KVST v2) */
    if (n_sculpt + n_kvzip)
        ck_assert(s->sculpt_known && s->sculpt.n_synth == 64 && s->sculpt.rounds == 1 && s->sculpt.lbfgs_iters == 5);
    kvm_strategy_free(&s);
    ck_assert_int_eq(run_kvmill(&out, &err), 0);
    ck_assert_msg(strstr(out, "summary: compressed=5 skipped=0 failed=0"), "stdout: %s\nstderr: %s", out, err);
    free(out); free(err);
    if (!(n_sculpt + n_kvzip)) return;
    /* [compress] edited after the calibration: the run keeps the recorded options and says which are unused */
    char *q = strstr(text, "queries = 64");
    memcpy(q, "queries = 32", 12);
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    ck_assert_int_eq(run_kvmill(&out, &err), 0);
    free(out); free(err);
    snprintf(cmd, sizeof cmd, "cat '%s'/compress-*.log", run_dir); /* the compress workers say it, once each */
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(strstr(out, "sculpt/kvzip layers use the options it was calibrated with, not these of the [compress] "
                              "settings of ") && strstr(out, ": queries=32 (recorded: 64); calibrate again"),
                  "compress logs: %s", out);
    free(out); free(err);
}
END_TEST

/* A stage binary that always dies: restarted a bounded number of times, then the documents
 * fail with the reason and the run ends (exit 1) instead of waiting forever. */
START_TEST(test_dying_stage_gives_up)
{
    char bin[4300], link[4400], target[4400], cmd[12000];
    snprintf(bin, sizeof bin, "%s/bin", tmp);
    ck_assert_int_eq(mkdir(bin, 0700), 0);
    snprintf(link, sizeof link, "%s/kvmill-prefill", bin);
    snprintf(target, sizeof target, "%s/kvmill-prefill", kvm_test_bin());
    char *abs_target = realpath(target, NULL); /* KVMILL_BIN may be relative ("bin" when run by hand) */
    ck_assert_ptr_nonnull(abs_target);
    ck_assert_int_eq(symlink(abs_target, link), 0);
    free(abs_target);
    snprintf(link, sizeof link, "%s/kvmill-compress", bin);
    ck_assert_int_eq(kvm_test_write_file(link, "#!/bin/sh\nexit 3\n", 17), 0);
    ck_assert_int_eq(chmod(link, 0755), 0);
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 64\n[compress]\nmethod = full\n[store]\npath = %s\n"
             "[run]\nheartbeat_ms = 100\nmax_retries = 0\nrun_dir = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, bin);
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, docs);
    char *out, *err;
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 1, "exit %d, stderr: %s", rc, err);
    ck_assert_msg(strstr(err, "not restarting it") && strstr(err, "no kvmill-compress worker is left"), "stderr: %s", err);
    ck_assert_msg(strstr(out, "summary: compressed=0 skipped=0 failed=5"), "stdout: %s", out);
    free(out); free(err);
}
END_TEST

/* `kvmill calibrate --config` takes the flags that have a [calibrate] key (--layer-alloc,
 * --sculpt, --kvzip, --phases) and lets them override the file, as flags do elsewhere: they
 * were refused as unknown options although `calibrate --help` lists them. On these documents
 * every allocation is a candidate by default and ppl wins, so a flag that did not reach the
 * strategy stage would not show in the stored strategy. */
START_TEST(test_calibrate_config_flags)
{
    const char *allocs[] = {"uniform", "entropy", "ppl"};
    for (int with_key = 0; with_key < 2; with_key++)
        for (size_t i = 0; i < sizeof allocs / sizeof allocs[0]; i++) {
            char text[8192], *out, *err, cmd[12000];
            /* the key alone, or the flag overriding another value of the key (--phases the file's) */
            snprintf(text, sizeof text,
                     "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n[eval]\n"
                     "continuation = 32\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n"
                     "[calibrate]\nphases = both\nlayer_alloc = %s\n",
                     kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin(),
                     allocs[with_key ? i : (i + 1) % 3]);
            ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
            snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s' --phases prefill%s%s",
                     kvm_test_bin(), cfg_path, docs, with_key ? "" : " --layer-alloc ", with_key ? "" : allocs[i]);
            int rc = kvm_test_run(cmd, &out, &err);
            char want[64];
            snprintf(want, sizeof want, ", alloc %s", allocs[i]);
            ck_assert_msg(rc == 0 && strstr(out, want), "%s: exit %d\n%s\n%s", cmd, rc, out, err);
            free(out);
            free(err);
        }
    char cmd[12000], *out, *err; /* a bad value names the flag; exit 2 before anything starts */
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s' --layer-alloc pyramid", kvm_test_bin(),
             cfg_path, docs);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "--layer-alloc") && strstr(err, "pyramid"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s' --phases sometimes", kvm_test_bin(),
             cfg_path, docs);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "--phases") && strstr(err, "sometimes"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    /* --out was written only after the whole calibration: a missing folder failed then (exit 1),
     * and --out naming the config replaced it; both are refused before anything starts */
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s' --out '%s/none/s.bin'", kvm_test_bin(),
             cfg_path, docs, tmp);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "--out") && strstr(err, "/none/s.bin: folder"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    size_t before_n, after_n;
    char *before = kvm_test_read_file(cfg_path, &before_n);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s' --out '%s'", kvm_test_bin(), cfg_path,
             docs, cfg_path);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "is the --config file"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    char *after = kvm_test_read_file(cfg_path, &after_n);
    ck_assert(after && before_n == after_n && !memcmp(before, after, before_n));
    free(before);
    free(after);
}
END_TEST

/* A calibration document with more tokens than [model] context but fewer than context +
 * [eval] continuation was calibrated on the shorter continuation it had: with 1 token every
 * pattern scored KL 0 and the first (streaming everywhere) was stored as the model's strategy.
 * Refused now (exit 2) before any stage starts, as calibrate without --config refuses it, and
 * nothing is stored. */
START_TEST(test_calibrate_config_short_continuation)
{
    char text[8192], corpus[4300], cmd[12000], *out, *err;
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 64\n[compress]\nmethod = polykv\nbudget = 16\n[eval]\n"
             "continuation = 16\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n"
             "[calibrate]\nphases = prefill\nlayer_alloc = uniform\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    /* BOS and 64 more ids: the context and a continuation of 1 token */
    size_t n = (size_t)snprintf(text, sizeof text, "{\"id\": \"short\", \"tokens\": [1");
    for (int i = 0; i < 64; i++)
        n += (size_t)snprintf(text + n, sizeof text - n, ", %d", 300 + i);
    n += (size_t)snprintf(text + n, sizeof text - n, "]}\n");
    snprintf(corpus, sizeof corpus, "%s/short.jsonl", tmp);
    ck_assert_int_eq(kvm_test_write_file(corpus, text, n), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg_path, corpus);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "document short has 65 tokens, fewer than [model] context 64 + [eval] "
                                         "continuation 16"),
                  "exit %d\n%s\n%s", rc, out, err);
    ck_assert_msg(!strstr(out, "stored strategy"), "%s", out);
    free(out);
    free(err);
}
END_TEST

/* calibrate --config with [calibrate] kvzip (or sculpt) and [compress] settings those layers'
 * solver refuses (queries = 0 with retain = 0: no training query) started its stages and failed
 * every document in the signals stage (exit 1); calibrate without --config refuses the same
 * options at start. Refused now before any stage starts (exit 2), naming the key and why. */
START_TEST(test_calibrate_config_distilled_settings)
{
    char text[8192], cmd[12000], *out, *err;
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 64\n[compress]\nmethod = polykv\nbudget = 16\nqueries = 0\n"
             "retain = 0\n[eval]\ncontinuation = 16\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\n"
             "bin_dir = %s\n[calibrate]\nphases = prefill\nkvzip = true\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg_path, docs);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "[calibrate] kvzip = true: its layers' [compress] settings: sculpt: queries = "
                                         "0 and retain = 0 leave no training queries"),
                  "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
}
END_TEST

/* calibrate --config with a [compress] method other than polykv calibrated and stored a strategy
 * that run with the same config never reads, saying nothing. A note on stderr says so now (the
 * strategy is still stored: a later config may name it); a polykv config has no note. */
START_TEST(test_calibrate_config_not_polykv)
{
    for (int polykv = 0; polykv < 2; polykv++) {
        char text[8192], cmd[12000], *out, *err;
        snprintf(text, sizeof text,
                 "[model]\npath = %s\ncontext = 64\n[compress]\nmethod = %s\nbudget = 16\n[eval]\n"
                 "continuation = 16\n[store]\npath = %s\n[run]\nrun_dir = %s\n[stages]\nbin_dir = %s\n"
                 "[calibrate]\nphases = prefill\nlayer_alloc = uniform\n",
                 kvm_test_data_path("models/stories260K.bin"), polykv ? "polykv" : "h2o", store, run_dir,
                 kvm_test_bin());
        ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
        snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg_path, docs);
        int rc = kvm_test_run(cmd, &out, &err);
        const char *note = strstr(err, "[compress] method = h2o: kvmill run with this config does not use the "
                                       "strategy calibrated now");
        ck_assert_msg(rc == 0 && strstr(out, "stored strategy") && (polykv ? !strstr(err, "note: ") : note != NULL),
                      "%s: exit %d\n%s\n%s", cmd, rc, out, err);
        free(out);
        free(err);
    }
}
END_TEST

/* [compress] query_source = repeat at a [model] context whose repeat (2N + P positions) does not
 * fit the model's window: run started its stages and every document failed in compress (exit
 * 1), calibrate --config with [calibrate] kvzip every one in the signals stage. Both refuse it
 * now before any stage starts (exit 2), naming the file, the setting, 2N + P and the window. */
START_TEST(test_repeat_window)
{
    for (int cal = 0; cal < 2; cal++) {
        char text[8192], cmd[12000], *out, *err;
        snprintf(text, sizeof text,
                 "[model]\npath = %s\ncontext = 300\n[compress]\nmethod = %s\nbudget = 64\nqueries = 32\n"
                 "query_source = repeat\n[eval]\ncontinuation = 16\n[store]\npath = %s\n[run]\nrun_dir = %s\n"
                 "[stages]\nbin_dir = %s\n[calibrate]\nphases = prefill\nkvzip = true\n",
                 kvm_test_data_path("models/stories260K.bin"), cal ? "polykv" : "kvzip", store, run_dir,
                 kvm_test_bin());
        ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
        snprintf(cmd, sizeof cmd, "'%s/kvmill' %s --config '%s' %s '%s'", kvm_test_bin(), cal ? "calibrate" : "run",
                 cfg_path, cal ? "--docs" : "--corpus", docs);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 &&
                          strstr(err, "[compress] query_source repeat prefills the context again after the "
                                      "repeat prompt: 2N + P = 629 positions") &&
                          strstr(err, "window of 512 tokens"),
                      "%s: exit %d\n%s\n%s", cmd, rc, out, err);
        free(out);
        free(err);
    }
}
END_TEST

/* A keyed run ([run] bind off-host) whose own stages' key pair is mixed up, or whose key its
 * authorized_keys does not list: each stage it started was refused at its handshake, and the
 * run waited at "0/5 documents" for ever, saying nothing. Refused before any stage starts
 * (exit 2), naming the key. */
START_TEST(test_keyed_bind_stage_keys)
{
    const char *names[3] = {"server", "worker", "other"};
    for (int i = 0; i < 3; i++) {
        char prefix[4400];
        snprintf(prefix, sizeof prefix, "%s/%s", tmp, names[i]);
        ck_assert_msg(kvm_curve_keygen(prefix) == 0, "%s", kvm_errmsg());
    }
    char auth[4400];
    snprintf(auth, sizeof auth, "%s/authorized", tmp);
    ck_assert_int_eq(mkdir(auth, 0700), 0);
    struct { const char *secret, *want; } cases[2] = {
        {"worker", "worker.public is not in authorized_keys"},                      /* not listed */
        {"other", "worker.public is not the public half of client secret key"}}; /* mixed-up pair */
    for (int c = 0; c < 2; c++) {
        char extra[9000], cmd[12000], *out = NULL, *err = NULL;
        snprintf(extra, sizeof extra,
                 "[run]\nbind = tcp://0.0.0.0:45917\n[security]\nserver_secret_key = %s/server.secret\n"
                 "server_public_key = %s/server.public\nclient_public_key = %s/worker.public\n"
                 "client_secret_key = %s/%s.secret\nauthorized_keys = %s\n",
                 tmp, tmp, tmp, tmp, cases[c].secret, auth);
        write_config(extra);
        snprintf(cmd, sizeof cmd, "timeout 60 '%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path,
                 docs);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, cases[c].want), "case %d: exit %d: %s", c, rc, err);
        free(out);
        free(err);
        if (c == 0) { /* listed now: the mixed-up pair is next */
            snprintf(cmd, sizeof cmd, "cp '%s/worker.public' '%s/'", tmp, auth);
            ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
        }
    }
}
END_TEST

/* A prefill worker joined by hand, its two DEALER sockets named `id`, connected to the run's
 * ipc endpoints; sends its hello and a credit. */
typedef struct peer {
    void *zctx, *ctl, *data;
} peer;

static void peer_send(void *sock, kvm_msg **m) { ck_assert_int_eq(kvm_msg_send(sock, m, 0), 0); }

/* A prefill worker's ready message (its hello on ctl, a credit on data). */
static kvm_msg *prefill_ready(const char *id)
{
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c(id),
                       .stage = kvm_proto_str_c("prefill"),
                       .pid = getpid(),
                       .device = kvm_proto_str_c("cpu")};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    return m;
}

static void peer_credit(peer *p, const char *id)
{
    kvm_msg *m = prefill_ready(id);
    peer_send(p->data, &m);
}

static void peer_start_as(peer *p, const char *id, const char *stage);

static void peer_start(peer *p, const char *id) { peer_start_as(p, id, "prefill"); }

/* peer_start for a worker of another stage ("strategy", ...). */
static void peer_start_as(peer *p, const char *id, const char *stage)
{
    char base[4400], ctl[4500], data[4500];
    snprintf(base, sizeof base, "ipc://%s", run_dir);
    ck_assert_int_eq(kvm_stage_endpoints(base, ctl, data, sizeof ctl), 0);
    p->zctx = zmq_ctx_new();
    p->ctl = zmq_socket(p->zctx, ZMQ_DEALER);
    p->data = zmq_socket(p->zctx, ZMQ_DEALER);
    int linger = 0;
    void *socks[2] = {p->ctl, p->data};
    for (int i = 0; i < 2; i++) {
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(socks[i], ZMQ_ROUTING_ID, id, strlen(id));
    }
    ck_assert_int_eq(zmq_connect(p->ctl, ctl), 0);
    ck_assert_int_eq(zmq_connect(p->data, data), 0);
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c(id),
                       .stage = kvm_proto_str_c(stage),
                       .pid = getpid(),
                       .device = kvm_proto_str_c("cpu")};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    peer_send(p->ctl, &m);
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    peer_send(p->data, &m);
}

/* Receives a job on the peer's data socket within ms; returns its id (0: none came). */
static uint64_t peer_job(peer *p, int ms)
{
    for (double end = kvm_now_ms() + ms; kvm_now_ms() < end;) {
        zmq_pollitem_t it = {p->data, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0) continue;
        kvm_msg *m = NULL;
        ck_assert_int_eq(kvm_msg_recv(p->data, &m, 0), 0);
        kvm_proto_job j;
        uint64_t id = kvm_proto_job_decode(m, &j) == 0 ? j.job_id : 0;
        kvm_msg_free(&m);
        if (id) return id;
    }
    return 0;
}

/* One layer's kv message of n_tokens tokens, one head of size 1. */
static void peer_kv(peer *p, uint64_t job, int64_t layer, int64_t n_layers, int64_t n_tokens)
{
    float *x = calloc((size_t)n_tokens, sizeof *x);
    kvm_proto_kv kv = {.job_id = job,
                       .layer = layer,
                       .n_layers = n_layers,
                       .n_tokens = n_tokens,
                       .n_heads = 1,
                       .n_kv_heads = 1,
                       .head_dim = 1,
                       .dtype = KVM_PROTO_F32,
                       .keys = x,
                       .values = x,
                       .entropy = x,
                       .attn_mass = x};
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_kv_encode(&kv, &m) == 0, "%s", kvm_errmsg());
    peer_send(p->data, &m);
    free(x);
}

/* Stops a run_background run at once (Ctrl-C twice) and returns its stderr (free it). */
static char *stop_run(pid_t run)
{
    kill(run, SIGINT);
    /* the second once the first is taken: a pending signal is not queued twice (a fixed 200 ms
     * could merge them on a loaded machine, and the run then drains for a minute) */
    wait_for_file("err.txt", "interrupted: finishing the jobs in flight", 1, 30000);
    kill(run, SIGINT);
    int st;
    ck_assert_int_eq(waitpid(run, &st, 0), run);
    return tmp_file("err.txt");
}

static void peer_close(peer *p)
{
    zmq_close(p->ctl);
    zmq_close(p->data);
    zmq_ctx_term(p->zctx);
}

/* A prefill stage whose kv messages of one attempt disagree on the layer count (layer 0 says 2
 * layers, later ones 5): the orchestrator sized its buffer by the first and wrote past it.
 * Now the attempt is requeued, naming both counts, and the next attempt is sent out. */
START_TEST(test_kv_layer_count_changes)
{
    write_config("prefill_workers = 0\n");
    pid_t run = run_background(docs);
    peer p;
    peer_start(&p, "by-hand-prefill");
    uint64_t job = peer_job(&p, 20000);
    ck_assert_msg(job != 0, "no job for the prefill worker joined by hand");
    peer_kv(&p, job, 0, 2, 8);
    peer_kv(&p, job, 1, 5, 8);
    peer_kv(&p, job, 2, 5, 8);
    peer_credit(&p, "by-hand-prefill");
    uint64_t again = peer_job(&p, 20000);
    char *err = stop_run(run);
    ck_assert_msg(again != 0 && again != job, "no second attempt after job %llu; stderr: %s", (unsigned long long)job,
                  err);
    ck_assert_msg(strstr(err, "kv message for layer 1 names 5 layers, its layer 0 2"), "stderr: %s", err);
    free(err);
    peer_close(&p);
}
END_TEST

/* A calibration whose strategy build failed (_i = 0: with an error no retry fixes, the strategy
 * stage could not store it; _i = 1: with a retryable one, a stage handing the build back at
 * SIGTERM). The orchestrator ignored such errors: the documents waited until job_timeout_s, were
 * requeued (their signals computed again) and the build was sent again, up to max_retries times.
 * Now a final error fails the documents at once with the stage's reason, and a retryable one
 * sends the build again at once with the documents' signals kept (nothing requeued). The peer
 * joined by hand sends no heartbeats: liveness and job_timeout_s are long, so a loaded machine
 * cannot declare it dead before the build comes. */
START_TEST(test_calibrate_build_not_retried)
{
    const int retryable = _i;
    char text[8192], cmd[16000];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n[store]\npath = %s\n"
             "[run]\nheartbeat_ms = 100\nliveness = 600\nrun_dir = %s\njob_timeout_s = 120\n[stages]\nbin_dir = %s\n"
             "strategy_workers = 0\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill' calibrate --config '%s' --docs '%s' >'%s/out.txt' 2>'%s/err.txt'",
             kvm_test_bin(), cfg_path, docs, tmp, tmp);
    pid_t run = spawn_sh(cmd);
    peer p;
    peer_start_as(&p, "by-hand-strategy", "strategy");
    uint64_t build = peer_job(&p, 60000); /* the build request comes first, then the documents' messages */
    ck_assert_msg(build != 0, "no strategy build for the worker joined by hand");
    kvm_proto_result r = {
        .job_id = build,
        .status = retryable ? KVM_ESTATE : KVM_EINVAL,
        .stage = kvm_proto_str_c("strategy"),
        .worker_id = kvm_proto_str_c("by-hand-strategy"),
        .message = kvm_proto_str_c(retryable ? "handed back at SIGTERM" : "strategy 'x': a name the store refuses"),
        .retryable = retryable};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_error_encode(&r, &m), 0);
    peer_send(p.ctl, &m);
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("by-hand-strategy"),
                       .stage = kvm_proto_str_c("strategy"),
                       .pid = getpid(),
                       .device = kvm_proto_str_c("cpu")};
    uint64_t again = 0;
    int status = 0, ended = 0;
    /* idle again: a credit every 300 ms, as a stage sends one every heartbeat while idle (the
     * data socket's credit may overtake the control socket's error, and is then not counted) */
    double credit_at = 0;
    for (double end = kvm_now_ms() + 20000; kvm_now_ms() < end && !ended && !again;) {
        if (kvm_now_ms() >= credit_at) {
            ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
            peer_send(p.data, &m);
            credit_at = kvm_now_ms() + 300;
        }
        ended = waitpid(run, &status, WNOHANG) == run;
        zmq_pollitem_t it = {p.data, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0) continue;
        ck_assert_int_eq(kvm_msg_recv(p.data, &m, 0), 0);
        kvm_proto_job j;
        if (kvm_proto_job_decode(m, &j) == 0 && ((j.doc_id.len > 10 && !strncmp(j.doc_id.ptr, "calibrate:", 10)) ||
                                                 (j.doc_name.len > 10 && !strncmp(j.doc_name.ptr, "calibrate:", 10))))
            again = j.job_id;
        kvm_msg_free(&m);
    }
    if (!ended) {
        kill(run, SIGKILL);
        waitpid(run, &status, 0);
    }
    char *err = tmp_file("err.txt");
    if (retryable) {
        ck_assert_msg(again && again != build, "the build was not sent again; stderr: %s", err);
        ck_assert_msg(
            strstr(err, "sending the strategy build again (attempt 2): strategy stage: handed back at SIGTERM") &&
                !strstr(err, "requeueing"),
            "stderr: %s", err);
    } else {
        ck_assert_msg(!again, "the build was sent again (job %llu); stderr: %s", (unsigned long long)again, err);
        ck_assert_msg(ended && WIFEXITED(status) && WEXITSTATUS(status) == 1,
                      "calibrate did not fail at once; stderr: %s", err);
        ck_assert_msg(strstr(err, "strategy stage: strategy 'x': a name the store refuses") &&
                          !strstr(err, "timed out"),
                      "stderr: %s", err);
    }
    free(err);
    peer_close(&p);
}
END_TEST

/* An interrupted `calibrate --config` stores no strategy. The strategy stage stores it before
 * the orchestrator hears of it, and the drain after a Ctrl-C waits for a build in flight: the
 * command ended with 130, empty stdout and --out not written, saying neither, while the store
 * held the new strategy (which turns existing polykv caches stale). Here a strategy worker
 * joined by hand stores one when the build comes (the stages' work is done), then the Ctrl-C
 * comes, then its ack: the record is taken back out (_i = 1: the one stored before is put back)
 * and stderr says what was not written. */
START_TEST(test_calibrate_interrupted_stores_nothing)
{
    char text[8192], cmd[16000], strat[4400];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n[store]\npath = %s\n"
             "[run]\nheartbeat_ms = 100\nliveness = 600\nrun_dir = %s\njob_timeout_s = 120\n[stages]\nbin_dir = %s\n"
             "strategy_workers = 0\n",
             kvm_test_data_path("models/stories260K.bin"), store, run_dir, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    snprintf(strat, sizeof strat, "%s/strategy.bin", tmp);
    kvm_store *st = NULL;
    kvm_store_id mid;
    if (_i) { /* a strategy stored before: put back as it was */
        ck_assert_int_eq(kvm_store_open(store, &(kvm_store_opts){0}, &st), 0);
        ck_assert_int_eq(kvm_store_model_id(st, kvm_test_data_path("models/stories260K.bin"), &mid), 0);
        ck_assert_int_eq(kvm_store_put_strategy(st, &mid, "default", "before", 6), 0);
        kvm_store_close(&st);
    }
    snprintf(cmd, sizeof cmd,
             "exec '%s/kvmill' calibrate --config '%s' --docs '%s' --out '%s' >'%s/out.txt' 2>'%s/err.txt'",
             kvm_test_bin(), cfg_path, docs, strat, tmp, tmp);
    pid_t run = spawn_sh(cmd);
    peer p;
    peer_start_as(&p, "by-hand-strategy", "strategy");
    uint64_t build = peer_job(&p, 60000);
    ck_assert_msg(build != 0, "no strategy build for the worker joined by hand");
    /* the build stores its strategy, as kvmill-strategy does before it acks */
    ck_assert_int_eq(kvm_store_open(store, &(kvm_store_opts){0}, &st), 0);
    ck_assert_int_eq(kvm_store_model_id(st, kvm_test_data_path("models/stories260K.bin"), &mid), 0);
    ck_assert_int_eq(kvm_store_put_strategy(st, &mid, "default", "built", 5), 0);
    kvm_store_close(&st);
    kill(run, SIGINT);
    ck_assert_msg(wait_for_file("err.txt", "interrupted: finishing the jobs in flight", 1, 60000),
                  "the Ctrl-C was not taken");
    kvm_proto_ctl ack = {.worker_id = kvm_proto_str_c("by-hand-strategy"),
                         .stage = kvm_proto_str_c("strategy"),
                         .pid = getpid(),
                         .job_id = build};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_ack_encode(&ack, &m), 0);
    peer_send(p.ctl, &m);
    int status = 0, ended = 0;
    for (double end = kvm_now_ms() + 60000; kvm_now_ms() < end && !ended;) {
        ended = waitpid(run, &status, WNOHANG) == run;
        if (!ended) usleep(50000);
    }
    if (!ended) {
        kill(run, SIGKILL);
        waitpid(run, &status, 0);
    }
    peer_close(&p);
    char *out = tmp_file("out.txt"), *err = tmp_file("err.txt");
    ck_assert_msg(ended && WIFEXITED(status) && WEXITSTATUS(status) == 130, "status %d: %s", status, err);
    char want[4600];
    snprintf(want, sizeof want, "interrupted: no strategy stored, --out %s not written", strat);
    ck_assert_msg(strstr(err, want), "stderr: %s", err);
    ck_assert_msg(!strstr(out, "stored strategy"), "stdout: %s", out);
    ck_assert_msg(access(strat, F_OK) != 0, "--out %s was written", strat);
    ck_assert_int_eq(kvm_store_open(store, &(kvm_store_opts){.read_only = 1}, &st), 0);
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = kvm_store_get_strategy(st, &mid, "default", &buf, &len);
    if (_i)
        ck_assert_msg(rc == 0 && len == 6 && !memcmp(buf, "before", 6), "the strategy stored before: %d, %zu bytes", rc,
                      len);
    else
        ck_assert_int_eq(rc, KVM_ENOTFOUND);
    free(buf);
    kvm_store_close(&st);
    free(out);
    free(err);
}
END_TEST

/* [store] service_bind on a socket the command binds itself: with [run] bind = tcp://H:P,
 * service_bind = tcp://H:P+1 (the run's data socket) passed --dump-config and failed the run
 * with "another process holds that endpoint", blaming someone else; now both refuse it (exit
 * 2) naming the clash, as serve does for its front end. And a store service that did not start
 * names its log in the run directory: that directory was removed on the way out, though a
 * failed run keeps it (here the service's port is held by a listener of the test's own). */
static int run_cfg(const char *text, const char *args, char **out, char **err)
{
    char cmd[12000];
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' %s --config '%s'", kvm_test_bin(), args, cfg_path);
    return kvm_test_run(cmd, out, err);
}

START_TEST(test_service_bind_clash_and_kept_log)
{
    int port = kvm_test_tcp_port(7);
    char text[8192], args[5000], want[512], *out, *err;
    const char *common = "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = sculpt\n[store]\npath = %s\n"
                         "service_bind = tcp://%s:%d\n[stages]\nbin_dir = %s\n%s\n";
    struct {
        const char *svc_host, *own; /* service_bind's host; the command's own bind (%d: port) */
        int svc_port, clash;        /* service_bind's port; 1: refused */
        const char *cmd, *socket;   /* the command; the socket the refusal names */
    } cases[] = {{"127.0.0.1", "[run]\nbind = tcp://127.0.0.1:%d", port + 1, 1, "run", "data socket"},
                 {"0.0.0.0", "[run]\nbind = tcp://127.0.0.1:%d", port, 1, "run", "control socket"},
                 {"127.0.0.1", "[run]\nbind = tcp://127.0.0.1:%d", port + 2, 0, "run", NULL},
                 {"127.0.0.1", "[serve]\nbind = tcp://127.0.0.1:%d", port, 1, "serve", "front end"},
                 {"127.0.0.1", "[serve]\nbackend = tcp://127.0.0.1:%d", port + 1, 1, "serve", "data socket"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char own[256];
        snprintf(own, sizeof own, cases[i].own, port);
        snprintf(text, sizeof text, common, kvm_test_data_path("models/stories260K.bin"), store, cases[i].svc_host,
                 cases[i].svc_port, kvm_test_bin(), own);
        for (int dump = 0; dump < (cases[i].clash ? 2 : 1); dump++) {
            snprintf(args, sizeof args, "%s %s", cases[i].cmd, dump || !cases[i].clash ? "--dump-config" : "--corpus");
            if (!dump && cases[i].clash && !strcmp(cases[i].cmd, "run"))
                snprintf(args, sizeof args, "run --corpus '%s'", docs);
            else if (!dump && cases[i].clash)
                snprintf(args, sizeof args, "serve --dump-config");
            int rc = run_cfg(text, args, &out, &err);
            snprintf(want, sizeof want, "[store] service_bind = tcp://%s:%d is the endpoint", cases[i].svc_host,
                     cases[i].svc_port);
            if (cases[i].clash)
                ck_assert_msg(rc == 2 && strstr(err, want) && strstr(err, cases[i].socket),
                              "case %zu (%s): exit %d: %s", i, args, rc, err);
            else
                ck_assert_msg(rc == 0, "case %zu (%s): exit %d: %s", i, args, rc, err);
            free(out);
            free(err);
        }
    }
    /* the service's port held: it fails to start, and its log stays where the error says */
    int lfd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    ck_assert_int_ge(lfd, 0);
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(port + 3))};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(bind(lfd, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(listen(lfd, 1), 0);
    snprintf(text, sizeof text, common, kvm_test_data_path("models/stories260K.bin"), store, "127.0.0.1", port + 3,
             kvm_test_bin(), "");
    snprintf(args, sizeof args, "run --corpus '%s'", docs);
    int rc = run_cfg(text, args, &out, &err);
    close(lfd);
    const char *lp = strstr(err, "(log ");
    ck_assert_msg(rc == 1 && lp && strstr(lp, "/store.log)"), "exit %d: %s", rc, err);
    char log[4400];
    snprintf(log, sizeof log, "%.*s", (int)(strstr(lp, "/store.log)") - (lp + 5)), lp + 5);
    struct stat st;
    int kept = stat(log, &st) == 0 && S_ISDIR(st.st_mode);
    char lf[4500];
    snprintf(lf, sizeof lf, "%s/store.log", log);
    int has_log = access(lf, F_OK) == 0;
    if (kept) kvm_test_rmtree(log);
    ck_assert_msg(kept && has_log, "the run directory %s (store.log %d) is gone; stderr: %s", log, has_log, err);
    free(out);
    free(err);
}
END_TEST

/* The clash check missed service_bind = tcp://localhost:P against a bind of tcp://127.0.0.1:P (and
 * the reverse): serve started the store service, then failed its own bind, exit 1. It missed the
 * default back end too, ipc://RUN_DIR/ctl and /data of [run] run_dir when [serve] backend or [run]
 * bind is empty: the second to bind found "another process is listening", exit 1. Each is refused
 * now, at start and by --dump-config (exit 2), naming the socket; another path in run_dir is not. */
START_TEST(test_service_bind_clash_localhost_and_run_dir)
{
    int port = kvm_test_tcp_port(11);
    char text[12000], args[5000], sb[4400], own[256], want[4600], *out, *err;
    const char *common = "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = sculpt\n[store]\npath = %s\n"
                         "service_bind = %s\n[stages]\nbin_dir = %s\n[run]\nrun_dir = %s\n%s\n";
    struct {
        const char *sb_host, *sb_file; /* service_bind tcp://HOST:port, or (host NULL) ipc://RUN_DIR + file */
        const char *own, *cmd;         /* the command's own bind (%d: port); the command */
        const char *socket;            /* in the refusal; NULL: accepted */
    } cases[] = {
        {"localhost", NULL, "[serve]\nbind = tcp://127.0.0.1:%d", "serve", "(its front end)"},
        {"127.0.0.1", NULL, "bind = tcp://localhost:%d", "run", "(its control socket)"},
        /* other spellings of 127.0.0.1 (the short form, octal, the lo interface, IPv4-mapped
         * IPv6), and localhost with the root's dot; [::1] is another socket */
        {"127.1", NULL, "[serve]\nbind = tcp://127.0.0.1:%d", "serve", "(its front end)"},
        {"0177.0.0.1", NULL, "bind = tcp://localhost:%d", "run", "(its control socket)"},
        {"lo", NULL, "[serve]\nbind = tcp://127.0.0.1:%d", "serve", "(its front end)"},
        {"[::ffff:127.0.0.1]", NULL, "bind = tcp://127.0.0.1:%d", "run", "(its control socket)"},
        {"localhost.", NULL, "[serve]\nbind = tcp://127.1:%d", "serve", "(its front end)"},
        {"[::1]", NULL, "[serve]\nbind = tcp://127.0.0.1:%d", "serve", NULL},
        {NULL, "/ctl", "[serve]\nbind = tcp://127.0.0.1:%d", "serve", "default [serve] backend in [run] run_dir"},
        {NULL, "//data", "", "run", "default [run] bind in [run] run_dir"},
        /* one file spelled another way: '.', '..' (kvm_file_path_norm) */
        {NULL, "/./ctl", "", "run", "default [run] bind in [run] run_dir"},
        {NULL, "/sub/../data", "[serve]\nbind = tcp://127.0.0.1:%d", "serve",
         "default [serve] backend in [run] run_dir"},
        {NULL, "/store", "", "run", NULL},
        {NULL, "/store", "[serve]\nbind = tcp://127.0.0.1:%d", "serve", NULL}};
    ck_assert_int_eq(mkdir(run_dir, 0700), 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].sb_host)
            snprintf(sb, sizeof sb, "tcp://%s:%d", cases[i].sb_host, port);
        else
            snprintf(sb, sizeof sb, "ipc://%s%s", run_dir, cases[i].sb_file);
        snprintf(own, sizeof own, cases[i].own, port);
        snprintf(text, sizeof text, common, kvm_test_data_path("models/stories260K.bin"), store, sb, kvm_test_bin(),
                 run_dir, own);
        for (int dump = 1; dump >= (cases[i].socket ? 0 : 1); dump--) {
            if (dump)
                snprintf(args, sizeof args, "%s --dump-config", cases[i].cmd);
            else if (!strcmp(cases[i].cmd, "run"))
                snprintf(args, sizeof args, "run --corpus '%s'", docs);
            else
                snprintf(args, sizeof args, "serve --compute-missing");
            int rc = run_cfg(text, args, &out, &err);
            snprintf(want, sizeof want, "[store] service_bind = %s is the endpoint", sb);
            if (cases[i].socket)
                ck_assert_msg(rc == 2 && strstr(err, want) && strstr(err, cases[i].socket),
                              "case %zu (%s): exit %d: %s", i, args, rc, err);
            else
                ck_assert_msg(rc == 0, "case %zu (%s): exit %d: %s", i, args, rc, err);
            free(out);
            free(err);
        }
    }
}
END_TEST

/* A store endpoint ([store] path = tcp://..., [store] service, serve's --store) that is a socket
 * the command binds itself: serve started with only a "does not answer" warning and failed every
 * ask ("... is a kvmill serve front end"), a run timed out on its first claim (exit 1). Both
 * refuse it now (exit 2), naming the setting, the socket and the clash, --dump-config too. */
START_TEST(test_store_is_own_socket)
{
    int port = kvm_test_tcp_port(9);
    char text[8192], args[5000], *out, *err;
    const char *common = "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = h2o\nratio = 0.3\n[store]\n"
                         "path = tcp://127.0.0.1:%d\n[stages]\nbin_dir = %s\n%s\n";
    struct {
        int store_port;        /* [store] path's port */
        const char *own, *cmd; /* the command's own bind (%d: port); the command line */
        const char *want;      /* in the refusal; NULL: accepted */
    } cases[] = {
        {0, "[run]\nbind = tcp://127.0.0.1:%d", "run --dump-config", "(its control socket): the run would ask"},
        {1, "[run]\nbind = tcp://127.0.0.1:%d", "run --dump-config", "(its data socket"},
        {2, "[run]\nbind = tcp://127.0.0.1:%d", "run --dump-config", NULL},
        {0, "[serve]\nbind = tcp://127.0.0.1:%d", "serve --dump-config", "(its front end): kvmill serve would"},
        {5, "[serve]\nbind = tcp://127.0.0.1:%d",
         "serve --dump-config --store tcp://127.0.0.1:%d "
         "--bind tcp://127.0.0.1:%d",
         "[store] service = tcp://127.0.0.1:"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char own[256], cmd[512];
        snprintf(own, sizeof own, cases[i].own, port);
        snprintf(text, sizeof text, common, kvm_test_data_path("models/stories260K.bin"), port + cases[i].store_port,
                 kvm_test_bin(), own);
        snprintf(cmd, sizeof cmd, cases[i].cmd, port + 7, port + 7);
        snprintf(args, sizeof args, "%s", cmd);
        int rc = run_cfg(text, args, &out, &err);
        if (cases[i].want)
            ck_assert_msg(rc == 2 && strstr(err, cases[i].want) && strstr(err, "name the store service's endpoint"),
                          "case %zu (%s): exit %d: %s", i, args, rc, err);
        else
            ck_assert_msg(rc == 0, "case %zu (%s): exit %d: %s", i, args, rc, err);
        free(out);
        free(err);
    }
}
END_TEST

/* Lines of text holding a, and b after it. */
static int lines_with(const char *text, const char *a, const char *b)
{
    int n = 0;
    size_t na = strlen(a), nb = strlen(b);
    for (const char *l = text; l && *l;) {
        const char *nl = strchr(l, '\n'), *end = nl ? nl : l + strlen(l), *p = NULL;
        for (const char *c = l; !p && c + na <= end; c++)
            if (!strncmp(c, a, na)) p = c + na;
        int found = 0;
        for (const char *c = p; c && !found && c + nb <= end; c++)
            found = !strncmp(c, b, nb);
        n += found;
        l = nl ? nl + 1 : NULL;
    }
    return n;
}

/* More workers than the orchestrator's table holds (256) over a run: ones that went silent
 * gave their entries up to none, so a worker joining after them was ignored without a word
 * and the run waited for ever. Dead workers' entries are reused now. */
START_TEST(test_worker_table_reused)
{
    write_config_liveness("prefill_workers = 0\n", 20); /* heartbeat 100 ms, liveness 20: silent 2 s = dead */
    pid_t run = run_background(docs);
    ck_assert_msg(wait_for_file("err.txt", ", run directory ", 1, 60000), "the run never started");
    char base[4400], ctl[4500], data[4500];
    snprintf(base, sizeof base, "ipc://%s", run_dir);
    ck_assert_int_eq(kvm_stage_endpoints(base, ctl, data, sizeof ctl), 0);
    void *zctx = zmq_ctx_new(), *ghosts[256];
    zmq_ctx_set(zctx, ZMQ_MAX_SOCKETS, 1024);
    for (int i = 0; i < 256; i++) { /* each says hello once, then goes silent */
        char id[32];
        snprintf(id, sizeof id, "ghost-%d", i);
        ck_assert_ptr_nonnull(ghosts[i] = zmq_socket(zctx, ZMQ_DEALER));
        int linger = 0;
        zmq_setsockopt(ghosts[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(ghosts[i], ZMQ_ROUTING_ID, id, strlen(id));
        ck_assert_int_eq(zmq_connect(ghosts[i], ctl), 0);
        kvm_msg *m = prefill_ready(id);
        peer_send(ghosts[i], &m);
    }
    /* the table filled (every ghost joined, or the run said one is ignored) and every ghost that
     * joined has gone silent: the run's own words, not a fixed 4 s (the ghosts' 2 s of liveness
     * count from when the run read their hellos, later on a loaded machine) */
    int joined = 0, silent = 0, full = 0;
    for (double end = kvm_now_ms() + 60000; kvm_now_ms() < end && (!full || silent < joined); usleep(50000)) {
        char *err = tmp_file("err.txt");
        joined = lines_with(err, "external prefill worker ghost-", " joined");
        silent = lines_with(err, "worker ghost-", " went silent");
        full = joined == 256 || (err && strstr(err, " workers are alive: worker ghost-"));
        free(err);
    }
    ck_assert_msg(full && silent == joined, "%d ghosts joined (table full: %d), %d went silent", joined, full, silent);
    peer p;
    peer_start(&p, "late-prefill");
    uint64_t job = peer_job(&p, 20000);
    char *err = stop_run(run);
    ck_assert_msg(job != 0, "the worker that joined after 256 silent ones got no job; stderr: %.3000s", err);
    ck_assert_msg(strstr(err, "external prefill worker late-prefill joined"), "stderr: %.3000s", err);
    free(err);
    for (int i = 0; i < 256; i++)
        zmq_close(ghosts[i]);
    peer_close(&p);
    zmq_ctx_term(zctx);
}
END_TEST

static Suite *pipeline_suite(void)
{
    Suite *s = suite_create("pipeline");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"run_then_skip", test_run_then_skip},
                 {"duplicate_not_already_stored", test_duplicate_not_already_stored},
                 {"wire_dtype", test_wire_dtype},
                 {"json_logs_and_metrics", test_json_logs_and_metrics},
                 {"log_json_escaping", test_log_json_escaping},
                 {"run_starts_store_service", test_run_starts_store_service},
                 {"remote_worker_polykv", test_remote_worker_polykv},
                 {"compress_worker_killed", test_compress_worker_killed},
                 {"bad_config_and_missing_binary", test_bad_config_and_missing_binary},
                 {"garbage_to_each_stage", test_garbage_to_each_stage},
                 {"stage_error_retryable_by_cause", test_stage_error_retryable_by_cause},
                 {"external_worker_joins", test_external_worker_joins},
                 {"ctrl_c", test_ctrl_c},
                 {"jsonl_corpus", test_jsonl_corpus},
                 {"jsonl_long_id_cut_at_char", test_jsonl_long_id_cut_at_char},
                 {"eval_matches_harness", test_eval_matches_harness},
                 {"eval_nonfinite_not_counted", test_eval_nonfinite_not_counted},
                 {"wire_f16_overflow_named", test_wire_f16_overflow_named},
                 {"eval_short_not_evaluated", test_eval_short_not_evaluated},
                 {"sigterm_grace_and_hand_back", test_sigterm_grace_and_hand_back},
                 {"calibrate_then_polykv", test_calibrate_then_polykv},
                 {"calibrate_signal_no_sockets", test_calibrate_signal_no_sockets},
                 {"calibrate_sculpt_then_polykv", test_calibrate_sculpt_then_polykv},
                 {"calibrate_config_flags", test_calibrate_config_flags},
                 {"calibrate_config_short_continuation", test_calibrate_config_short_continuation},
                 {"repeat_window", test_repeat_window},
                 {"calibrate_config_not_polykv", test_calibrate_config_not_polykv},
                 {"calibrate_config_distilled_settings", test_calibrate_config_distilled_settings},
                 {"dying_stage_gives_up", test_dying_stage_gives_up},
                 {"short_document_kept_full", test_short_document_kept_full},
                 {"keyed_bind_stage_keys", test_keyed_bind_stage_keys},
                 {"kv_layer_count_changes", test_kv_layer_count_changes},
                 {"calibrate_build_not_retried", test_calibrate_build_not_retried},
                 {"calibrate_interrupted_stores_nothing", test_calibrate_interrupted_stores_nothing},
                 {"service_bind_clash_and_kept_log", test_service_bind_clash_and_kept_log},
                 {"service_bind_clash_localhost_and_run_dir", test_service_bind_clash_localhost_and_run_dir},
                 {"store_is_own_socket", test_store_is_own_socket},
                 {"worker_table_reused", test_worker_table_reused}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 240);
        if (cases[i].fn == test_calibrate_build_not_retried)
            tcase_add_loop_test(tc, cases[i].fn, 0, 2); /* _i: a final error, a retryable one */
        else if (cases[i].fn == test_calibrate_interrupted_stores_nothing)
            tcase_add_loop_test(tc, cases[i].fn, 0, 2); /* _i: no strategy stored before, one */
        else
            tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(pipeline_suite()); }
