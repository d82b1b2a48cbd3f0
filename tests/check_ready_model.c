/* check_ready_model.c: workers of another model are refused (protocol revision 10: `ready`
 * carries the stage's model_id). A decode worker started by hand with another model's config
 * joined a running `kvmill serve` and failed the requests handed to it ("no compressed cache");
 * a stage worker started by hand with another --model joined `kvmill run` and got jobs (a
 * prefill worker's KV would be stored under the run's model id). Real processes over ipc://,
 * on ../shared's stories260K and a random model of the same shape. */
#include "common/kvm_error.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_orch_int.h"
#include "pipeline/kvm_stage.h"
#include "proto/kvm_proto.h"
#include "pipeline/kvm_worker.h"
#include "store/kvm_store.h"
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

static char *g_dir;
static char g_front[4200], g_log[4200];
static pid_t g_serve;

static void setup(void)
{
    kvm_test_serve_dirs(&g_dir, g_front, sizeof g_front, g_log, sizeof g_log);
    g_serve = 0;
}

static void teardown(void) { kvm_test_serve_cleanup(g_serve, g_dir); }

static void assert_contains(const char *hay, const char *needle)
{
    ck_assert_msg(hay && strstr(hay, needle), "expected \"%s\" in:\n%s", needle, hay ? hay : "(null)");
}

/* ../shared's stories260K.bin and tok512.bin into model and tok (4400 bytes each): 1, or 0 after
 * the SKIP line when ../shared lacks them. */
static int shared_model(char *model, char *tok)
{
    const char *p = kvm_test_shared_path("models/stories260K.bin"); /* a static buffer: copied */
    if (!p) return 0;
    snprintf(model, 4400, "%s", p);
    if (!(p = kvm_test_shared_path("models/tok512.bin"))) return 0;
    snprintf(tok, 4400, "%s", p);
    return 1;
}

/* g_dir/other/other.bin: random weights of stories260K's shape (`kvmill make-model`), with
 * tok512.bin beside it, so that a worker loads and tokenises exactly as with stories260K. */
static void make_other_model(const char *tok, char *path, size_t size)
{
    char cmd[16384], *err = NULL;
    snprintf(path, size, "%s/other/other.bin", g_dir);
    snprintf(cmd, sizeof cmd,
             "mkdir -p '%s/other' && cp '%s' '%s/other/tok512.bin' && '%s/kvmill' make-model --dim 64 --layers 5 "
             "--heads 8 --kv-heads 4 --hidden 172 --vocab 512 --seq-len 512 --seed 7 --out '%s'",
             g_dir, tok, g_dir, kvm_test_bin(), path);
    int rc = kvm_test_run(cmd, NULL, &err);
    ck_assert_msg(rc == 0, "make-model: exit %d: %s", rc, err);
    free(err);
}

/* A config of model `model` (context tokens, method full, store g_dir/store, run directory
 * g_dir/run: the back end ipc://g_dir/run) into path. */
/* The config at path: method `method` (its options after it, one per line). */
static void write_config_method(const char *path, const char *model, int context, const char *method)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = %d\n[compress]\nmethod = %s\nbudget = 16\n[store]\npath = %s/store\n"
             "map_size_mb = 16\n[stages]\nbin_dir = %s\n[run]\nrun_dir = %s/run\nheartbeat_ms = 100\nliveness = 50\n",
             model, context, method, g_dir, kvm_test_bin(), g_dir);
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
}

static void write_config(const char *path, const char *model, int context)
{
    write_config_method(path, model, context, "full");
}

/* Starts `cmd` (a stage started by hand) in the background under `timeout 30`: stderr into
 * g_dir/NAME.err, its exit status into g_dir/NAME.rc when it ends. */
static void start_by_hand(const char *name, const char *cmd)
{
    char sh[16384];
    snprintf(sh, sizeof sh,
             "(timeout 30 %s 2>'%s/%s.err' >/dev/null; echo $? >'%s/%s.rc') </dev/null >/dev/null 2>&1 &", cmd, g_dir,
             name, g_dir, name);
    ck_assert_int_eq(kvm_test_run(sh, NULL, NULL), 0);
}

/* Waits up to 40 s for the stage started as NAME to end: its exit status, its stderr in *err. */
static int wait_by_hand(const char *name, char **err)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/%s.rc", g_dir, name);
    char *rc_text = NULL;
    for (int i = 0; i < 400 && !(rc_text = kvm_test_read_file(path, NULL)); i++)
        usleep(100000);
    ck_assert_msg(rc_text != NULL, "the %s started by hand did not end", name);
    int rc = atoi(rc_text);
    free(rc_text);
    snprintf(path, sizeof path, "%s/%s.err", g_dir, name);
    *err = kvm_test_read_file(path, NULL);
    /* under SAN=1 a sanitizer's report exits 1 too, as a refusal does */
    ck_assert_msg(!*err || (!strstr(*err, "Sanitizer") && !strstr(*err, "runtime error:")), "%s", *err);
    return rc;
}

/* Waits up to 20 s for `needle` in the file at path: 1 when it came. */
static int wait_for_line(const char *path, const char *needle)
{
    for (int i = 0; i < 200; i++) {
        char *text = kvm_test_read_file(path, NULL);
        int found = text && strstr(text, needle);
        free(text);
        if (found) return 1;
        usleep(100000);
    }
    return 0;
}

/* kvmill serve on stories260K with its own decode worker, and a kvmill-decode started by hand
 * against its back end with another model of the same shape: the server refuses it (one log
 * line naming both ids and its model path), the worker exits 1 saying why, and 8 asks at once
 * are all answered by the server's own worker. Before, the hand-started worker joined and every
 * request handed to it failed ("no compressed cache": it looks caches up under its own model). */
START_TEST(test_serve_refuses_other_model)
{
    char model[4400], tok[4400];
    if (!shared_model(model, tok)) return;
    char other[4400], cfg[4400], other_cfg[4400], store[4400], doc[4400], cmd[16384];
    make_other_model(tok, other, sizeof other);
    snprintf(cfg, sizeof cfg, "%s/serve.ini", g_dir);
    snprintf(other_cfg, sizeof other_cfg, "%s/other.ini", g_dir);
    write_config(cfg, model, 64);
    write_config(other_cfg, other, 64);
    snprintf(store, sizeof store, "%s/store", g_dir);
    kvm_test_store_create(store);
    snprintf(doc, sizeof doc, "%s/story.txt", g_dir);
    const char *text = "Once upon a time there was a little girl named Lily. She liked to play in the park.\n";
    ck_assert_int_eq(kvm_test_write_file(doc, text, strlen(text)), 0);
    const char *argv[] = {"--config", cfg, "--bind", g_front, "--workers", "1", "--compute-missing", NULL};
    ck_assert_int_eq(kvm_test_serve_start(argv, g_log, 60, &g_serve), -1);

    snprintf(cmd, sizeof cmd,
             "'%s/kvmill-decode' --connect 'ipc://%s/run' --config '%s' --store '%s' --id by-hand "
             "--heartbeat-ms 100",
             kvm_test_bin(), g_dir, other_cfg, store);
    start_by_hand("decode", cmd);
    ck_assert_msg(wait_for_line(g_log, "external decode worker by-hand joined"), "the worker never joined");
    /* 8 asks at once: with two idle workers some went to the hand-started one */
    snprintf(
        cmd, sizeof cmd,
        "for i in 1 2 3 4 5 6 7 8; do ('%s/kvmill' ask --connect '%s' --timeout 60 --doc '%s' --prompt ' She' -n 4 "
        ">'%s/ask'$i'.log' 2>&1 || echo $i >>'%s/asks.failed') & done; wait",
        kvm_test_bin(), g_front, doc, g_dir, g_dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    char *err = NULL;
    int rc = wait_by_hand("decode", &err);
    char *log = kvm_test_read_file(g_log, NULL);
    snprintf(cmd, sizeof cmd, "%s/asks.failed", g_dir);
    char *failed = kvm_test_read_file(cmd, NULL), first[4400];
    snprintf(first, sizeof first, "%s/ask%c.log", g_dir, failed ? failed[0] : '1');
    char *ask_log = failed ? kvm_test_read_file(first, NULL) : NULL;
    ck_assert_msg(!failed, "asks that failed: %s (the first said: %s)\nserver log:\n%s", failed, ask_log,
                  log ? log : "");
    assert_contains(log, "decode worker by-hand runs model ");
    assert_contains(log, "but this server serves ");
    assert_contains(log, "/stories260K.bin): refused, no requests go to it");
    ck_assert_int_eq(kvm_test_count(log, "refused, no requests go to it"), 1); /* once, not per heartbeat */
    ck_assert_msg(kvm_test_count(log, "answered by by-hand") == 0 && !strstr(log, "Sanitizer"), "server log:\n%s", log);
    ck_assert_msg(rc == 1, "the refused worker: exit %d, stderr:\n%s", rc, err ? err : "");
    assert_contains(err, "refused by serve");
    assert_contains(err, "this server serves model ");
    assert_contains(err, "this worker runs model ");
    /* the same id started again as the refusal says, with the server's model: accepted (the
     * refusal belonged to the process, not the id: before, it stayed refused without a word) */
    snprintf(cmd, sizeof cmd,
             "(timeout 8 '%s/kvmill-decode' --connect 'ipc://%s/run' --config '%s' --store '%s' --id by-hand "
             "--heartbeat-ms 100 >/dev/null 2>&1 &) </dev/null >/dev/null 2>&1",
             kvm_test_bin(), g_dir, cfg, store);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    ck_assert_msg(wait_for_line(g_log, "decode worker by-hand, refused before, is accepted now (it names this server's "
                                       "model)"),
                  "the restarted worker was not accepted");
    free(log);
    log = kvm_test_read_file(g_log, NULL);
    ck_assert_int_eq(kvm_test_count(log, "refused, no requests go to it"), 1);
    free(ask_log);
    free(failed);
    free(log);
    free(err);
}
END_TEST

/* The server's own decode worker refused: its model file was replaced by another model while the
 * server ran, and the worker restarted (killed) loads the new one. Every worker the server
 * starts would be refused, so it stops (exit 1) saying the file changed, rather than restart
 * its workers in a loop (each joins before it is refused, so the early-exit count never grew). */
START_TEST(test_serve_own_worker_other_model)
{
    char model[4400], tok[4400];
    if (!shared_model(model, tok)) return;
    char other[4400], copy[4400], cfg[4400], store[4400], cmd[16384];
    make_other_model(tok, other, sizeof other);
    snprintf(copy, sizeof copy, "%s/other/served.bin", g_dir); /* tok512.bin beside it too */
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", model, copy);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(cfg, sizeof cfg, "%s/serve.ini", g_dir);
    write_config(cfg, copy, 64);
    snprintf(store, sizeof store, "%s/store", g_dir);
    kvm_test_store_create(store);
    const char *argv[] = {"--config", cfg, "--bind", g_front, "--workers", "1", NULL};
    ck_assert_int_eq(kvm_test_serve_start(argv, g_log, 60, &g_serve), -1);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s.new' && mv '%s.new' '%s' && kill -9 $(pgrep -P %d kvmill-decode)", other,
             copy, copy, copy, (int)g_serve);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    int st = -1;
    for (int i = 0; i < 300 && waitpid(g_serve, &st, WNOHANG) != g_serve; i++)
        usleep(100000), st = -1;
    char *log = kvm_test_read_file(g_log, NULL);
    ck_assert_msg(st != -1, "the server still runs; its log:\n%s", log ? log : "");
    g_serve = 0;
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "exit status %d; log:\n%s", st, log ? log : "");
    assert_contains(log, "refused, no requests go to it");
    assert_contains(log, "started by this server, runs model ");
    assert_contains(log, "the model file changed since the server started?");
    ck_assert_msg(!strstr(log, "Sanitizer"), "server log:\n%s", log);
    free(log);
}
END_TEST

/* kvm_store_hash_file's id of path, in lowercase hex (the first column of store ls --csv). */
static void model_hex(const char *path, char hex[65])
{
    kvm_store_id id;
    ck_assert_int_eq(kvm_store_hash_file(path, &id), 0);
    kvm_store_id_hex(&id, hex);
}

/* kvmill run with its own stage workers, and a kvmill-prefill started by hand with --model
 * naming another model of the same shape: the run refuses it (one line), the worker exits 1
 * saying why, the run compresses every document with its own workers, and every stored cache is
 * under the run's model id. Before, the hand-started worker joined and could be given jobs: its
 * KV, of the other model, was compressed and stored under the run's model id. */
START_TEST(test_run_refuses_other_model)
{
    char model[4400], tok[4400];
    if (!shared_model(model, tok)) return;
    char other[4400], cfg[4400], corpus[4400], cmd[16384], want[65], *out = NULL, *err = NULL;
    const char *long_docs = kvm_test_shared_path("data/long");
    if (!long_docs) return;
    snprintf(corpus, sizeof corpus, "%s", long_docs);
    make_other_model(tok, other, sizeof other);
    snprintf(cfg, sizeof cfg, "%s/run.ini", g_dir);
    /* 20 documents of 256 tokens, each distilled (method full took 0.2 s in all, and the run could
     * end before the worker's control socket was known: refused, never told): the run lasts well
     * past the hand-started worker's connection (its sockets retry every 100 ms until the run
     * binds), so that it is refused and told */
    write_config_method(cfg, model, 256, "sculpt\nretain = 4\nqueries = 256\niterations = 60");
    /* started first: it connects once the run binds its run directory's sockets */
    snprintf(cmd, sizeof cmd,
             "'%s/kvmill-prefill' --connect 'ipc://%s/run' --model '%s' --id by-hand --heartbeat-ms 20", kvm_test_bin(),
             g_dir, other);
    start_by_hand("prefill", cmd);
    snprintf(cmd, sizeof cmd, "timeout 90 '%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, corpus);
    int rc = kvm_test_run(cmd, NULL, &err);
    char *werr = NULL;
    int wrc = wait_by_hand("prefill", &werr);
    ck_assert_msg(rc == 0, "kvmill run: exit %d: %s", rc, err);
    const char *last = strstr(err, "20/20 documents");
    printf("run: %.60s\n", last ? last : "(no last progress line)");
    assert_contains(err, "prefill worker by-hand runs model ");
    assert_contains(err, "but this run's model is ");
    assert_contains(err, "/stories260K.bin): refused, no jobs go to it");
    ck_assert_int_eq(kvm_test_count(err, "refused, no jobs go to it"), 1);
    ck_assert_msg(wrc == 1, "the refused worker: exit %d, stderr:\n%s\nthe run's stderr:\n%s", wrc, werr ? werr : "",
                  err);
    assert_contains(werr, "refused by run");
    assert_contains(werr, "this run's model is ");
    free(err);
    /* every document compressed, each under the run's model id */
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --store '%s/store' --csv", kvm_test_bin(), g_dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    model_hex(model, want);
    int rows = 0;
    for (const char *row = strchr(out, '\n'); row && row[1]; row = strchr(row + 1, '\n'), rows++)
        ck_assert_msg(strncmp(row + 1, want, 64) == 0, "a cache not under the run's model %s: %s", want, row + 1);
    ck_assert_msg(rows == 20, "%d caches stored, want 20:\n%s", rows, out);
    free(out);
    free(err);
    free(werr);
}
END_TEST

/* The same for kvmill calibrate and a kvmill-signals started by hand with another --model: its
 * signals would be measured on the other model and the strategy stored under the run's. */
START_TEST(test_calibrate_refuses_other_model)
{
    char model[4400], tok[4400];
    if (!shared_model(model, tok)) return;
    char other[4400], cfg[4400], cmd[16384], hex[65], want[200], *out = NULL, *err = NULL, *werr = NULL;
    make_other_model(tok, other, sizeof other);
    snprintf(cfg, sizeof cfg, "%s/calibrate.ini", g_dir);
    write_config(cfg, model, 64); /* calibration runs for seconds: past the worker's connection */
    snprintf(cmd, sizeof cmd,
             "'%s/kvmill-signals' --connect 'ipc://%s/run' --model '%s' --id by-hand --heartbeat-ms 20", kvm_test_bin(),
             g_dir, other);
    start_by_hand("signals", cmd);
    snprintf(cmd, sizeof cmd, "timeout 90 '%s/kvmill' calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    int rc = kvm_test_run(cmd, &out, &err);
    int wrc = wait_by_hand("signals", &werr);
    ck_assert_msg(rc == 0, "kvmill calibrate: exit %d: %s", rc, err);
    assert_contains(err, "signals worker by-hand runs model ");
    assert_contains(err, "but this calibrate's model is ");
    ck_assert_int_eq(kvm_test_count(err, "refused, no jobs go to it"), 1);
    model_hex(model, hex); /* the strategy is the run's model's */
    snprintf(want, sizeof want, "stored strategy 'default' for model %s", hex);
    assert_contains(out, want);
    ck_assert_msg(wrc == 1, "the refused worker: exit %d, stderr:\n%s", wrc, werr ? werr : "");
    assert_contains(werr, "refused by calibrate");
    free(out);
    free(err);
    free(werr);
}
END_TEST

/* dir/m.bin and dir/tok512.bin: links to model and tok (absolute targets), for a config whose
 * [model] path is /proc/self/cwd/m.bin: the same string names another file for a process
 * started in another directory, as the same path does on another host. */
static void link_model(const char *dir, const char *model, const char *tok)
{
    char cmd[16384], am[PATH_MAX], at[PATH_MAX];
    ck_assert_ptr_nonnull(realpath(model, am));
    ck_assert_ptr_nonnull(realpath(tok, at));
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && ln -sf '%s' '%s/m.bin' && ln -sf '%s' '%s/tok512.bin'", dir, am, dir,
             at, dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
}

/* The first 12 hex digits of path's model id into out (13 bytes), as a mismatch names it. */
static void model_hex12(const char *path, char out[13])
{
    char hex[65];
    model_hex(path, hex);
    snprintf(out, 13, "%s", hex);
}

/* kvmill run whose [model] path names, on a worker's host, a file of other weights: a
 * kvmill-prefill started by hand without --model (so its ready names no model and is accepted)
 * loads the path its job names and finds the other model there. Its job fails (retryable)
 * naming the file, both ids and the host, it stops (exit 1), and the run's own workers do every
 * document, each stored under the run's model id. Before, it computed the KV with the other
 * weights, stored under the run's model id, and took job after job. One host stands for two:
 * the path goes through /proc/self/cwd and the worker runs in another directory. */
/* For a test whose run and hand-started worker see different files under one [model] path (two
 * hosts on one): every path made absolute (g_dir, $KVMILL_BIN into bin, PATH_MAX bytes), the run's
 * directory g_dir/runs holding model, the worker's g_dir/hands another model (into other, 4400
 * bytes), and the config at cfg (4400 bytes) naming /proc/self/cwd/m.bin. */
static void two_hosts(const char *model, const char *tok, int context, char *bin, char *other, char *cfg)
{
    char *dir = realpath(g_dir, NULL), path[4400];
    ck_assert_ptr_nonnull(dir);
    free(g_dir);
    g_dir = dir;
    ck_assert_ptr_nonnull(realpath(kvm_test_bin(), bin));
    setenv("KVMILL_BIN", bin, 1); /* the run starts in another directory */
    make_other_model(tok, other, 4400);
    snprintf(path, sizeof path, "%s/runs", g_dir);
    link_model(path, model, tok);
    snprintf(path, sizeof path, "%s/hands", g_dir);
    link_model(path, other, tok);
    snprintf(cfg, 4400, "%s/run.ini", g_dir);
    write_config(cfg, "/proc/self/cwd/m.bin", context);
}

START_TEST(test_run_job_other_model_file)
{
    char model[4400], tok[4400];
    if (!shared_model(model, tok)) return;
    const char *long_docs = kvm_test_shared_path("data/long");
    if (!long_docs) return;
    char corpus[PATH_MAX], bin[PATH_MAX], other[4400], cfg[4400], cmd[16384], want[65], mine[13], theirs[13];
    char *out = NULL, *err = NULL, *werr = NULL;
    ck_assert_ptr_nonnull(realpath(long_docs, corpus));
    two_hosts(model, tok, 256, bin, other, cfg);
    /* every idle prefill worker gets a document while any is queued: the hand-started one too */
    snprintf(cmd, sizeof cmd, "echo 'max_prefetch = 20' >>'%s'", cfg); /* the file ends in [run] */
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(cmd, sizeof cmd,
             "env -C '%s/hands' '%s/kvmill-prefill' --connect 'ipc://%s/run' --id by-hand --heartbeat-ms 20", g_dir,
             bin, g_dir);
    start_by_hand("prefill", cmd);
    snprintf(cmd, sizeof cmd, "cd '%s/runs' && timeout 90 '%s/kvmill' run --config '%s' --corpus '%s'", g_dir, bin, cfg,
             corpus);
    int rc = kvm_test_run(cmd, NULL, &err);
    int wrc = wait_by_hand("prefill", &werr);
    ck_assert_msg(rc == 0, "kvmill run: exit %d: %s", rc, err);
    model_hex12(model, theirs);
    model_hex12(other, mine);
    ck_assert_msg(wrc == 1, "the worker of the other model file: exit %d, stderr:\n%s\nrun:\n%s", wrc, werr ? werr : "",
                  err);
    assert_contains(werr, "refused by the run of job ");
    assert_contains(werr, "model file /proc/self/cwd/m.bin on host ");
    assert_contains(werr, mine);
    assert_contains(werr, theirs);
    ck_assert_int_eq(kvm_test_count(werr, "failed (retryable)"), 1); /* one job, then it stopped */
    assert_contains(err, "prefill stage: model ");
    assert_contains(err, ": model file /proc/self/cwd/m.bin on host "); /* requeued, said why */
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --store '%s/store' --csv", bin, g_dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    model_hex(model, want);
    int rows = 0;
    for (const char *row = strchr(out, '\n'); row && row[1]; row = strchr(row + 1, '\n'), rows++)
        ck_assert_msg(strncmp(row + 1, want, 64) == 0, "a cache not under the run's model %s: %s", want, row + 1);
    ck_assert_msg(rows == 20, "%d caches stored, want 20:\n%s", rows, out);
    free(out);
    free(err);
    free(werr);
}
END_TEST

/* The run's (or calibration's) own [model] path replaced by other weights while it runs (a new version deployed
 * under the same name): a worker that loads it after the change fails its job (another model),
 * and the run re-hashes its own file, finds it changed, and fails the documents left with that
 * cause (exit 1). Before, each job went back to the queue: the run waited for a prefill worker
 * that would never succeed (here none of its own: it waited for ever), or restarted its own ones
 * one after another until it gave up, naming the restarts, not the change. */
START_TEST(test_run_model_file_changed)
{
    const int calibrate = _i; /* 0: kvmill run and a prefill worker; 1: calibrate and a signals worker */
    const char *cmd_name = calibrate ? "calibrate" : "run", *stage = calibrate ? "signals" : "prefill";
    char model[4400], tok[4400];
    if (!shared_model(model, tok)) return;
    char corpus[PATH_MAX], other[4400], cfg[4400], cmd[16384], path[4400], *err = NULL, *werr = NULL;
    ck_assert_ptr_nonnull(realpath(kvm_test_data_path("corpus"), corpus));
    make_other_model(tok, other, sizeof other);
    snprintf(path, sizeof path, "%s/runs", g_dir);
    link_model(path, model, tok);
    snprintf(path, sizeof path, "%s/runs/m.bin", g_dir);
    snprintf(cfg, sizeof cfg, "%s/run.ini", g_dir);
    write_config(cfg, path, 64);
    snprintf(cmd, sizeof cmd, "printf '[stages]\n%s_workers = 0\n' >>'%s'", stage, cfg); /* only by hand */
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' %s --config '%s' %s '%s'", kvm_test_bin(), cmd_name, cfg,
             calibrate ? "--docs" : "--corpus", corpus);
    start_by_hand("run", cmd);
    char ctl[4400];
    snprintf(ctl, sizeof ctl, "%s/run/ctl", g_dir);
    struct stat sb;
    for (int i = 0; i < 300 && stat(ctl, &sb) != 0; i++)
        usleep(100000);
    ck_assert_msg(stat(ctl, &sb) == 0, "the %s did not bind %s", cmd_name, ctl);
    snprintf(cmd, sizeof cmd, "ln -sf '%s' '%s'", other, path); /* the next version, under the same name */
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill-%s' --connect 'ipc://%s/run' --id by-hand --heartbeat-ms 20", kvm_test_bin(),
             stage, g_dir);
    start_by_hand(stage, cmd);
    int wrc = wait_by_hand(stage, &werr);
    int rc = wait_by_hand("run", &err);
    ck_assert_msg(wrc == 1, "the worker: exit %d: %s", wrc, werr ? werr : "");
    ck_assert_msg(rc == 1, "kvmill %s: exit %d (124: it waited for ever): %s", cmd_name, rc, err ? err : "");
    char want[4600], hex[13];
    snprintf(want, sizeof want, "the model file %s changed since this %s began (model ", path, cmd_name);
    assert_contains(err, want);
    model_hex12(other, hex);
    assert_contains(err, hex);
    assert_contains(err, "run again");
    free(err);
    free(werr);
}
END_TEST

/* The same for kvmill calibrate and a kvmill-signals started by hand without --model: its signals
 * would be measured on the other weights and the strategy stored under the run's model id. */
START_TEST(test_calibrate_job_other_model_file)
{
    char model[4400], tok[4400];
    if (!shared_model(model, tok)) return;
    char docs[PATH_MAX], bin[PATH_MAX], other[4400], cfg[4400], cmd[16384], hex[65], want[200], mine[13];
    char *out = NULL, *err = NULL, *werr = NULL;
    ck_assert_ptr_nonnull(realpath(kvm_test_data_path("corpus"), docs));
    two_hosts(model, tok, 64, bin, other, cfg);
    snprintf(cmd, sizeof cmd,
             "env -C '%s/hands' '%s/kvmill-signals' --connect 'ipc://%s/run' --id by-hand --heartbeat-ms 20", g_dir,
             bin, g_dir);
    start_by_hand("signals", cmd);
    snprintf(cmd, sizeof cmd, "cd '%s/runs' && timeout 90 '%s/kvmill' calibrate --config '%s' --docs '%s'", g_dir, bin,
             cfg, docs);
    int rc = kvm_test_run(cmd, &out, &err);
    int wrc = wait_by_hand("signals", &werr);
    ck_assert_msg(rc == 0, "kvmill calibrate: exit %d: %s", rc, err);
    model_hex(model, hex); /* the strategy is the run's model's, from its own workers' signals */
    snprintf(want, sizeof want, "stored strategy 'default' for model %s", hex);
    assert_contains(out, want);
    ck_assert_msg(wrc == 1, "the worker of the other model file: exit %d, stderr:\n%s\ncalibrate:\n%s", wrc,
                  werr ? werr : "", err);
    model_hex12(other, mine);
    assert_contains(werr, "refused by the run of job ");
    assert_contains(werr, mine);
    hex[12] = '\0';
    assert_contains(werr, hex);
    free(out);
    free(err);
    free(werr);
}
END_TEST

/* kvm_worker_model_for_job: a job naming its run's model is checked against the id computed at
 * load (no second load or hash per job: the model stays the same object), a job naming none
 * (revision 9) is not, a mismatch says which file, host and ids, and a model kept from an
 * earlier job whose file was replaced since (a new version under the same path) is loaded again
 * rather than called another model's. */
START_TEST(test_model_for_job_checks_id)
{
    char model[4400], tok[4400], text[8192], hex[13], other[4400], path[4400], cmd[16384];
    if (!shared_model(model, tok)) return;
    make_other_model(tok, other, sizeof other);
    snprintf(path, sizeof path, "%s/other/deployed.bin", g_dir); /* tok512.bin beside it */
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", model, path);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(text, sizeof text, "[model]\npath = %s\n", path);
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse(text, "t.ini", &c), 0);
    kvm_worker_model wm = {0};
    uint8_t wrong[32], id[32];
    memset(wrong, 0xab, sizeof wrong);
    int other_model = -1;
    ck_assert_msg(kvm_worker_model_for_job(&wm, c, NULL, NULL, &other_model) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(other_model, 0);
    const kvm_model *loaded = wm.model;
    memcpy(id, wm.model_id.b, sizeof id);
    ck_assert_int_eq(kvm_worker_model_for_job(&wm, c, NULL, id, &other_model), 0);
    ck_assert_int_eq(other_model, 0);
    ck_assert_ptr_eq(wm.model, loaded); /* the id of the load, not a reload per job */
    ck_assert_int_eq(kvm_worker_model_for_job(&wm, c, NULL, wrong, &other_model), KVM_EMISMATCH);
    ck_assert_int_eq(other_model, 1);
    ck_assert(kvm_worker_model_retryable(KVM_EMISMATCH));
    assert_contains(kvm_errmsg(), path);
    assert_contains(kvm_errmsg(), "not the run's model abababababab");
    model_hex12(model, hex);
    assert_contains(kvm_errmsg(), hex);
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    assert_contains(kvm_errmsg(), host);
    char theirs[13]; /* what the orchestrator reads back from the message (kvm_orch__model_changed) */
    ck_assert_int_eq(kvm_worker_other_model_hex(kvm_errmsg(), strlen(kvm_errmsg()), theirs), 1);
    ck_assert_str_eq(theirs, hex);
    const char *not_ours = "prefill stage: model 0123456789ab has 5 layers, not the run's model's 6";
    ck_assert_int_eq(kvm_worker_other_model_hex(not_ours, strlen(not_ours), theirs), 0);
    ck_assert_int_eq(kvm_worker_other_model_hex("model 0123456789a", 17, theirs), 0);
    /* the next run's version deployed under the same path: its job finds it */
    ck_assert_int_eq(kvm_worker_model_for_job(&wm, c, NULL, id, &other_model), 0);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s.new' && mv '%s.new' '%s'", other, path, path, path);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    kvm_store_id next;
    ck_assert_int_eq(kvm_store_hash_file(other, &next), 0);
    ck_assert_msg(kvm_worker_model_for_job(&wm, c, NULL, next.b, &other_model) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(other_model, 0);
    kvm_worker_model_free(&wm);
    kvm_config_free(&c);
}
END_TEST

/* A --model hashed at setup (so that ready names it before the first job) and replaced by other
 * weights before the first job loads it: the load named the new weights with the old id, so its
 * jobs passed the run's check and their caches were stored under the wrong model. The id is
 * reused only while the file is the one hashed (device, inode, size, mtime). */
START_TEST(test_early_id_file_replaced)
{
    char model[4400], tok[4400], other[4400], path[4400], cmd[16384];
    if (!shared_model(model, tok)) return;
    make_other_model(tok, other, sizeof other);
    snprintf(path, sizeof path, "%s/other/deployed.bin", g_dir);
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", model, path);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = unused.bin\n", "t.ini", &c), 0);
    kvm_store_id mine, next;
    ck_assert_int_eq(kvm_store_hash_file(model, &mine), 0);
    ck_assert_int_eq(kvm_store_hash_file(other, &next), 0);
    for (int replace = 0; replace <= 1; replace++) {
        kvm_worker_model wm = {.override = path};
        kvm_worker_model_id_early(&wm, NULL);
        ck_assert_int_eq(wm.has_override_id, 1);
        ck_assert_int_eq(memcmp(kvm_worker_model_id(&wm), mine.b, 32), 0);
        if (replace) {
            snprintf(cmd, sizeof cmd, "cp '%s' '%s.new' && mv '%s.new' '%s'", other, path, path, path);
            ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
        }
        ck_assert_msg(kvm_worker_model_get(&wm, c, NULL) == 0, "%s", kvm_errmsg());
        ck_assert_msg(memcmp(wm.model_id.b, replace ? next.b : mine.b, 32) == 0,
                      "replace %d: the loaded "
                      "model's id is not its file's",
                      replace);
        kvm_worker_model_free(&wm);
    }
    kvm_config_free(&c);
}
END_TEST

/* Which models a ready names: a worker's own (--model, or a decode worker's config: pinned),
 * never one that came with a job. A stage started without --model serves run after run on an
 * endpoint and loads each job's model; naming its last job's made the next run of another
 * model refuse (and stop) a worker that would have loaded that run's model. */
START_TEST(test_model_id_only_when_own)
{
    char model[4400], tok[4400], text[8192];
    if (!shared_model(model, tok)) return;
    snprintf(text, sizeof text, "[model]\npath = %s\n", model);
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse(text, "t.ini", &c), 0);
    kvm_worker_model wm = {0};
    ck_assert_msg(kvm_worker_model_get(&wm, c, NULL) == 0, "%s", kvm_errmsg());
    ck_assert_ptr_null(kvm_worker_model_id(&wm)); /* the job's model */
    wm.pinned = 1;
    ck_assert_ptr_eq(kvm_worker_model_id(&wm), wm.model_id.b);
    wm.pinned = 0;
    wm.override = model; /* --model */
    ck_assert_ptr_eq(kvm_worker_model_id(&wm), wm.model_id.b);
    kvm_worker_model_free(&wm);
    ck_assert_ptr_null(kvm_worker_model_id(&wm)); /* --model not hashed yet (no early id): nothing to name */
    kvm_config_free(&c);
}
END_TEST

/* Whether the run refuses worker 0 of o after a ready from pid naming model (NULL: none); first:
 * the ready of the control socket, which a stage sends once, at its start. */
static int refused_after_ready(orch *o, int64_t pid, const uint8_t *model, int first)
{
    kvm_proto_ready r = {.worker_id = kvm_proto_str_c("by-hand"),
                         .stage = kvm_proto_str_c("prefill"),
                         .pid = pid,
                         .device = kvm_proto_str_c("cpu"),
                         .has_model_id = model != NULL};
    if (model) memcpy(r.model_id, model, sizeof r.model_id);
    return kvm_orch__worker_refused(o, 0, &r, first);
}

/* The same for a credit (a ready on the data socket). */
static int refused_after(orch *o, int64_t pid, const uint8_t *model) { return refused_after_ready(o, pid, model, 0); }

/* A refusal belongs to the process, not to the worker id. The refusal tells the user to start
 * the worker again without --model; started so under the same --id it names no model (its
 * model follows its jobs), and the run kept it refused for ever, without a word: a run whose
 * only prefill worker it was waited for ever. */
START_TEST(test_refusal_belongs_to_process)
{
    orch *o = calloc(1, sizeof *o);
    ck_assert_ptr_nonnull(o);
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = run.bin\n", "t.ini", &c), 0);
    o->cfg = c, o->cmd = "run", o->reduce_worker = -1, o->n_workers = 1;
    memset(o->model_id.b, 1, sizeof o->model_id.b);
    o->workers[0] = (orch_worker){.stage = 0, .job = -1, .alive = 1, .slot = -1};
    snprintf(o->workers[0].id, sizeof o->workers[0].id, "by-hand");
    uint8_t other[32];
    memset(other, 2, sizeof other);
    ck_assert_int_eq(refused_after(o, 100, other), 1);         /* another model: refused */
    ck_assert_int_eq(refused_after(o, 100, NULL), 1);          /* the same process, naming none: still */
    ck_assert_int_eq(refused_after(o, 101, NULL), 0);          /* a new process naming none: accepted */
    ck_assert_int_eq(refused_after(o, 101, other), 1);         /* it names another model: refused again */
    ck_assert_int_eq(refused_after(o, 102, o->model_id.b), 0); /* the run's model */
    kvm_config_free(&c);
    free(o);
}
END_TEST

/* The run's control socket (a ROUTER, into *router) and worker "by-hand"'s end of it (the
 * returned DEALER, its receives timing out after 200 ms), over inproc in zctx. */
static void *ctl_pair(void *zctx, void **router)
{
    void *dealer = zmq_socket(zctx, ZMQ_DEALER);
    int tmo = 200;
    *router = zmq_socket(zctx, ZMQ_ROUTER);
    ck_assert_int_eq(zmq_bind(*router, "inproc://ctl"), 0);
    zmq_setsockopt(dealer, ZMQ_ROUTING_ID, "by-hand", 7);
    zmq_setsockopt(dealer, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    ck_assert_int_eq(zmq_connect(dealer, "inproc://ctl"), 0);
    return dealer;
}

/* A refused worker started again under the same id and the same pid (pid 1 of a container that
 * its orchestrator restarts, its host name and so its default id unchanged) is a new process:
 * its control socket's ready says so. Before, it was judged by the pid alone: naming no model
 * (as the refusal told it to start) it stayed refused without a word, and naming the other
 * model again it was never told, so it waited for work for ever. A worker that still asks for
 * work after being told (the error lost on a reconnect) is told again after
 * KVM_STAGE_RETELL_MS. */
START_TEST(test_refusal_same_pid_restarted)
{
    orch *o = calloc(1, sizeof *o);
    ck_assert_ptr_nonnull(o);
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = run.bin\n", "t.ini", &c), 0);
    o->cfg = c, o->cmd = "run", o->reduce_worker = -1, o->n_workers = 1;
    memset(o->model_id.b, 1, sizeof o->model_id.b);
    o->workers[0] = (orch_worker){.stage = 0, .job = -1, .alive = 1, .slot = -1};
    snprintf(o->workers[0].id, sizeof o->workers[0].id, "by-hand");
    void *zctx = zmq_ctx_new(), *router = NULL, *dealer = ctl_pair(zctx, &router);
    o->ctl = router;
    uint8_t other[32];
    memset(other, 2, sizeof other);
    char buf[4096];
    ck_assert_int_eq(refused_after_ready(o, 1, other, 1), 1); /* pid 1 names another model: refused, told */
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0);
    o->workers[0].told_ms = kvm_now_ms();            /* a saturated machine may have taken seconds since */
    ck_assert_int_eq(refused_after(o, 1, other), 1); /* its credit: told already, not again at once */
    ck_assert_int_eq(zmq_recv(dealer, buf, sizeof buf, 0), -1);
    o->workers[0].told_ms -= KVM_STAGE_RETELL_MS; /* still asking for work that long after: the error was lost */
    ck_assert_int_eq(refused_after(o, 1, other), 1);
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0);
    /* pid 1 started again naming the other model again: refused and told at once */
    ck_assert_int_eq(refused_after_ready(o, 1, other, 1), 1);
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0);
    /* a credit of the restarted pid 1 naming none may come before its control socket's ready: it
     * waits for that one, which accepts it */
    ck_assert_int_eq(refused_after(o, 1, NULL), 1);
    ck_assert_int_eq(refused_after_ready(o, 1, NULL, 1), 0);
    ck_assert_int_eq(o->workers[0].refused, 0);
    ck_assert_int_eq(refused_after(o, 1, NULL), 0);
    /* pid 2's credit names another model and comes before its control ready: refused and told
     * once; that ready, the same process's, is no new start (not refused or told twice) */
    ck_assert_int_eq(refused_after(o, 2, other), 1);
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0);
    o->workers[0].told_ms = kvm_now_ms();
    ck_assert_int_eq(refused_after_ready(o, 2, other, 1), 1);
    ck_assert_int_eq(zmq_recv(dealer, buf, sizeof buf, 0), -1);
    ck_assert_int_eq(refused_after_ready(o, 2, other, 1), 1); /* a second start as pid 2: told */
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0);
    /* a worker that outlived an earlier run sent its control ready to that run: this one sees
     * only its credits, refuses it by one, and its restart as the same pid naming no model (as
     * it was told) sends the first control ready this run gets: a new process, accepted */
    o->workers[0] = (orch_worker){.stage = 0, .job = -1, .alive = 1, .slot = -1};
    snprintf(o->workers[0].id, sizeof o->workers[0].id, "by-hand");
    ck_assert_int_eq(refused_after(o, 3, other), 1);
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0);
    ck_assert_int_eq(refused_after_ready(o, 3, NULL, 1), 0);
    ck_assert_int_eq(refused_after(o, 3, NULL), 0);
    zmq_close(dealer);
    zmq_close(router);
    zmq_ctx_term(zctx);
    kvm_config_free(&c);
    free(o);
}
END_TEST

/* A compress worker started by hand and refused because its caches miss the run's store
 * (kvm_orch__store_refuse), then started again under the same id and the same pid (pid 1 of a
 * restarted container) with the right --store: judged by the pid alone it stayed refused and was
 * told the old reason, so a run with no other compress worker waited for ever. Its control
 * socket's ready, sent once at a process's start, marks it new: accepted. */
START_TEST(test_store_refusal_same_pid_restarted)
{
    orch *o = calloc(1, sizeof *o);
    ck_assert_ptr_nonnull(o);
    o->cmd = "run", o->reduce_worker = -1, o->n_workers = 1, o->mode = MODE_RUN;
    o->workers[0] = (orch_worker){.stage = ST_COMPRESS, .job = -1, .alive = 1, .slot = -1};
    snprintf(o->workers[0].id, sizeof o->workers[0].id, "by-hand");
    void *zctx = zmq_ctx_new(), *router = NULL, *dealer = ctl_pair(zctx, &router);
    o->ctl = router;
    char buf[4096];
    ck_assert_int_eq(refused_after_ready(o, 1, NULL, 1), 0); /* pid 1 starts */
    ck_assert_int_eq(kvm_orch__store_fault_worker(o, 0), 1);
    kvm_orch__store_refuse(o, NULL, 0, "x.txt was acked, but the run's store holds no cache of it");
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0); /* told */
    ck_assert_int_eq(kvm_orch__worker_counts(o, 0), 0);
    ck_assert_int_eq(refused_after(o, 1, NULL), 1);          /* the refused process's credit */
    ck_assert_int_eq(refused_after_ready(o, 1, NULL, 1), 0); /* pid 1 started again: accepted */
    ck_assert_int_eq(o->workers[0].store_refused, 0);
    ck_assert_int_eq(refused_after(o, 1, NULL), 0);
    kvm_orch__store_refuse(o, NULL, 0, "again");
    ck_assert_int_gt(zmq_recv(dealer, buf, sizeof buf, 0), 0);
    ck_assert_int_eq(refused_after(o, 2, NULL), 0); /* another pid under the id: a new process */
    zmq_close(dealer);
    zmq_close(router);
    zmq_ctx_term(zctx);
    free(o);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("ready_model");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {
        {"serve_refuses_other_model", test_serve_refuses_other_model},
        {"serve_own_worker_other_model", test_serve_own_worker_other_model},
        {"run_refuses_other_model", test_run_refuses_other_model},
        {"calibrate_refuses_other_model", test_calibrate_refuses_other_model},
        {"run_job_other_model_file", test_run_job_other_model_file},
        {"run_model_file_changed", test_run_model_file_changed},
        {"calibrate_job_other_model_file", test_calibrate_job_other_model_file},
        {"model_for_job_checks_id", test_model_for_job_checks_id},
        {"model_id_only_when_own", test_model_id_only_when_own},
        {"early_id_file_replaced", test_early_id_file_replaced},
        {"refusal_belongs_to_process", test_refusal_belongs_to_process},
        {"refusal_same_pid_restarted", test_refusal_same_pid_restarted},
        {"store_refusal_same_pid_restarted", test_store_refusal_same_pid_restarted},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 150);
        if (cases[i].fn == test_run_model_file_changed)
            tcase_add_loop_test(tc, cases[i].fn, 0, 2); /* _i: run, calibrate */
        else
            tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(suite()); }
