/* check_orch_recovery.c: `kvmill run` recovering from what a new user did to it: the
 * orchestrator stopped (SIGSTOP) for longer than the workers' dead time, a rerun after a
 * `kill -9` finding the dead run's claims in the store, and documents failing at read time
 * logged as job_failed in JSON logs. */
#include "pipeline/kvm_orch_int.h"
#include "store/kvm_store.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_storew.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_storecli.h"
#include "proto/kvm_proto.h"
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

static char *tmp, cfg_path[4200], docs[4200], store[4200], run_dir[4200];

static void setup(void)
{
    tmp = kvm_test_tmpdir();
    snprintf(store, sizeof store, "%s/store.lmdb", tmp);
    snprintf(run_dir, sizeof run_dir, "%s/run", tmp);
    snprintf(cfg_path, sizeof cfg_path, "%s/t.ini", tmp);
    snprintf(docs, sizeof docs, "%s/docs", tmp);
    mkdir(docs, 0700);
}

static void teardown(void)
{
    kvm_test_rmtree(tmp);
    free(tmp);
}

/* The embedded corpus's n (<= 6) documents in tmp/docs. */
static void make_docs(int n)
{
    for (int i = 0; i < n; i++) {
        char src[64], dst[4300];
        snprintf(src, sizeof src, "corpus/doc_%03d.txt", i);
        snprintf(dst, sizeof dst, "%s/doc_%03d.txt", docs, i);
        size_t len;
        char *t = kvm_test_read_file(kvm_test_data_path(src), &len);
        ck_assert_ptr_nonnull(t);
        ck_assert_int_eq(kvm_test_write_file(dst, t, len), 0);
        free(t);
    }
}

/* A config: [model] context 128, the method lines, the store at path st, [run] with run_extra. */
static void write_config(const char *method, const char *st, const char *run_extra)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\n%s\n[store]\npath = %s\n[run]\nrun_dir = %s\n%s\n"
             "[stages]\nbin_dir = %s\nthreads = 1\n",
             kvm_test_data_path("models/stories260K.bin"), method, st, run_dir, run_extra, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg_path, text, strlen(text)), 0);
}

static int run_kvmill(char **out, char **err)
{
    char cmd[12000];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg_path, docs);
    return kvm_test_run(cmd, out, err);
}

static long long summary_field(const char *out, const char *name)
{
    const char *s = out ? strstr(out, "summary: ") : NULL;
    char key[64];
    snprintf(key, sizeof key, " %s=", name);
    const char *f = s ? strstr(s, key) : NULL;
    return f ? strtoll(f + strlen(key), NULL, 10) : -1;
}

/* 1 when a stage's log in run_dir names a job (it has begun the run's work). */
static int stage_started(void)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/prefill-0-r0.log", run_dir);
    char *log = kvm_test_read_file(p, NULL);
    int yes = log && strstr(log, " stage prefill ") != NULL;
    free(log);
    return yes;
}

/* The orchestrator stopped (kill -STOP, Ctrl-Z) for three times the workers' dead time ([run]
 * heartbeat_ms x liveness = 2 s here, so that a worker's heartbeat thread starved for a second
 * on a loaded machine under the sanitizers blames no one),
 * its workers running on. It read no heartbeat
 * meanwhile, and its poll returned at once when it went on, the heartbeats unread: every worker
 * was declared silent and killed, the killed workers' queued credits made them idle again, and
 * every send to them failed, each one using up an attempt: documents failed "after 4 attempts"
 * in a moment, and one committed by a killed worker was counted failed. Now the pause is seen
 * (event run_resumed), the workers are judged from then on, and every document is stored. */
START_TEST(test_paused_orchestrator)
{
    make_docs(4);
    /* jobs of seconds (under the sanitizers, kvm_test_quick, a smaller one is as long): the run
     * is in the middle of its work when stopped */
    write_config(kvm_test_quick() ? "method = sculpt\nqueries = 512\nrounds = 2\niterations = 60"
                                  : "method = sculpt\nqueries = 2048\nrounds = 4\niterations = 300",
                 store, "heartbeat_ms = 100\nliveness = 20");
    char out_path[4300], err_path[4300];
    snprintf(out_path, sizeof out_path, "%s/out.txt", tmp);
    snprintf(err_path, sizeof err_path, "%s/err.txt", tmp);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (!freopen(out_path, "w", stdout) || !freopen(err_path, "w", stderr)) _exit(127);
        char exe[4200];
        snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
        execl(exe, exe, "run", "--config", cfg_path, "--corpus", docs, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 1500 && !stage_started(); i++)
        usleep(20000);
    /* stopped 4 times: whether its poll or its I/O thread wakes first after a stop is a race,
     * and the old code lost it only most of the times */
    int st, ended = 0;
    for (int k = 0; k < 4 && !ended; k++) {
        usleep(k ? 800000 : 1400000); /* into the first compress job, its worker busy */
        ck_assert_int_eq(kill(pid, SIGSTOP), 0);
        usleep(6000000);
        ck_assert_int_eq(kill(pid, SIGCONT), 0);
        ended = waitpid(pid, &st, WNOHANG) == pid;
    }
    ck_assert_int_eq(ended || waitpid(pid, &st, 0) == pid, 1);
    char *out = kvm_test_read_file(out_path, NULL), *err = kvm_test_read_file(err_path, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\nstdout: %s\nstderr: %s", st, out, err);
    ck_assert_msg(summary_field(out, "failed") == 0 && summary_field(out, "compressed") == 4, "stdout: %s\nstderr: %s",
                  out, err);
    ck_assert_msg(strstr(err, "went silent") == NULL, "stderr: %s", err);
    ck_assert_msg(strstr(err, "did not run for") != NULL, "the pause is not said: %s", err);
    ck_assert_int_eq(kvm_test_store_caches(store), 4);
    free(out);
    free(err);
}
END_TEST

typedef struct keys {
    kvm_store_cache_key k[8];
    kvm_store_id tok[8]; /* each cache's tokenizer id */
    int n;
} keys;

static int collect_key(const kvm_store_cache_key *key, const kvm_store_manifest *m, int status, void *arg)
{
    keys *ks = arg;
    if (!status && ks->n < 8) ks->tok[ks->n] = m->tokenizer_id, ks->k[ks->n++] = *key;
    return 0;
}

/* A run killed with kill -9 leaves its claims in the store until their lease lapses ([run]
 * heartbeat_ms x liveness, 60 s here). A rerun on the same host left those documents "to" the
 * dead run (claimed=N, exit 0) and they were never stored. A claim whose owner names this host
 * and a process that is not running is taken over now; one of another host keeps the lease rule
 * (3 s here: taken over, before the run ends, once it lapsed unrenewed). */
START_TEST(test_dead_local_claimant)
{
    make_docs(6);
    char first[4300];
    snprintf(first, sizeof first, "%s/first.lmdb", tmp);
    const char *method = "method = streaming\nbudget = 32";
    write_config(method, first, "heartbeat_ms = 100\nliveness = 600");
    char *out = NULL, *err = NULL;
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    /* the cache keys a run makes of these documents (the same in any store: no strategy) */
    keys ks = {.n = 0};
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(first, NULL, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, collect_key, &ks), 0);
    kvm_store_close(&s);
    ck_assert_int_eq(ks.n, 6);
    /* a pid that is not running: a child that exited and was reaped */
    pid_t gone = fork();
    ck_assert_int_ge(gone, 0);
    if (gone == 0) _exit(0);
    ck_assert_int_eq(waitpid(gone, NULL, 0), gone);
    char host[64] = "";
    ck_assert_int_eq(gethostname(host, sizeof host - 1), 0);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* the owners: a run of another host (its lease rules); a live run of this host (this test's
     * parent, with its identity); its pid with another start (reused); a run of this host whose
     * process is gone; the gone pid named by a run of another boot or pid namespace under the
     * same host name (a container with host networking: its pids are not ours); and an owner of
     * an earlier version, without an identity */
    char owners[6][128], other_host[64], parent[96], self[96];
    kvm_rundir_proc_id((long)getppid(), parent, sizeof parent);
    kvm_rundir_proc_id((long)getpid(), self, sizeof self);
    ck_assert_msg(parent[0] == 'B' && self[0] == 'B', "no /proc identity: '%s' '%s'", parent, self);
    char *t = strrchr(self, 'T');
    ck_assert_ptr_nonnull(t);
    t[1] = '\0'; /* this process's boot and namespace: "B...N...T" */
    long long ms = (long long)ts.tv_sec * 1000;
    snprintf(other_host, sizeof other_host, "elsewhere-%.40s", host);
    snprintf(owners[0], sizeof owners[0], "run:%s:%ld:%lld:%s1", other_host, (long)gone, ms, self);
    snprintf(owners[1], sizeof owners[1], "run:%.48s:%ld:%lld:%s", host, (long)getppid(), ms, parent);
    snprintf(owners[2], sizeof owners[2], "run:%.48s:%ld:%lld:%s1", host, (long)getppid(), ms, self);
    snprintf(owners[3], sizeof owners[3], "run:%.48s:%ld:%lld:%s1", host, (long)gone, ms, self);
    snprintf(owners[4], sizeof owners[4], "run:%.48s:%ld:%lld:B0123456789abcdefN4026531836T1", host, (long)gone, ms);
    snprintf(owners[5], sizeof owners[5], "run:%.48s:%ld:%lld", host, (long)gone, ms);
    kvm_store_opts so = {0};
    ck_assert_msg(kvm_store_open(store, &so, &s) == 0, "%s", kvm_errmsg());
    for (int i = 0; i < ks.n; i++) {
        int taken = 0;
        ck_assert_int_eq(kvm_store_claim_take(s, &ks.k[i], owners[i], i == 0 ? other_host : host, 3000, &taken, NULL),
                         0);
        ck_assert_int_eq(taken, 1);
    }
    kvm_store_close(&s);
    write_config(method, store, "heartbeat_ms = 100\nliveness = 600");
    int rc = run_kvmill(&out, &err);
    ck_assert_msg(rc == 0, "rc %d\nstdout: %s\nstderr: %s", rc, out, err);
    /* the reused and the gone ones are taken over at once; the other host's, the live run's, the
     * other namespace's and the old owner's leases are left to them, and taken over once they
     * lapse unrenewed (3 s) */
    ck_assert_msg(summary_field(out, "compressed") == 6 && summary_field(out, "claimed") == 0 &&
                      summary_field(out, "failed") == 0,
                  "stdout: %s\nstderr: %s", out, err);
    ck_assert_msg(strstr(err, "which is no longer running: taking it over") != NULL, "stderr: %s", err);
    int lapsed = 0;
    for (const char *p = err; (p = strstr(p, "whose claim lapsed unrenewed")) != NULL; p++)
        lapsed++;
    ck_assert_msg(lapsed == 4, "stderr: %s", err);
    ck_assert_int_eq(kvm_test_store_caches(store), 6);
    free(out);
    free(err);
}
END_TEST

/* A document that fails when it is read (an empty file here; a FIFO, a folder named x.txt, a
 * dangling link, a JSONL token id past the vocabulary alike) was logged as an info "message"
 * without its name in a field, while a document a stage fails is an error "job_failed" with
 * "doc": a JSON log's reader counting failures missed it. Now it is one too. */
START_TEST(test_read_failure_json_event)
{
    make_docs(1);
    char empty[4300];
    snprintf(empty, sizeof empty, "%s/empty.txt", docs);
    ck_assert_int_eq(kvm_test_write_file(empty, "", 0), 0);
    write_config("method = streaming\nbudget = 32", store, "log_format = json");
    char *out = NULL, *err = NULL;
    int rc = run_kvmill(&out, &err);
    ck_assert_msg(rc == 1 && summary_field(out, "failed") == 1, "rc %d\nstdout: %s\nstderr: %s", rc, out, err);
    int seen = 0;
    for (char *line = err, *nl; line && *line; line = nl ? nl + 1 : NULL) {
        nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        json_t *o = json_loads(line, 0, NULL);
        const char *msg = json_string_value(json_object_get(o, "msg"));
        if (msg && strstr(msg, "empty.txt")) {
            seen++;
            ck_assert_str_eq(json_string_value(json_object_get(o, "level")), "error");
            ck_assert_str_eq(json_string_value(json_object_get(o, "event")), "job_failed");
            ck_assert_str_eq(json_string_value(json_object_get(o, "doc")), "empty.txt");
            ck_assert_ptr_nonnull(json_string_value(json_object_get(o, "reason")));
        }
        json_decref(o);
    }
    ck_assert_msg(seen == 1, "%d lines name empty.txt", seen);
    free(out);
    free(err);
}
END_TEST

/* kvmill run started in the background on cfg_path and docs, its stdout and stderr to
 * tmp/out.txt and tmp/err.txt (paths into out_path and err_path). Returns its pid. */
static pid_t start_kvmill(char *out_path, char *err_path, size_t n)
{
    snprintf(out_path, n, "%s/out.txt", tmp);
    snprintf(err_path, n, "%s/err.txt", tmp);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (!freopen(out_path, "w", stdout) || !freopen(err_path, "w", stderr)) _exit(127);
        char exe[4200];
        snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
        execl(exe, exe, "run", "--config", cfg_path, "--corpus", docs, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* A document replaced on disk after the run's scan and before its dispatch was compressed
 * silently under its new content's hash: never claimed nor checked as stored under it, and the
 * summary's bytes left it out. Now its load at dispatch finds other tokens than the scan did and
 * the document fails, named, with that reason (exit 1: a rerun compresses the new content). */
START_TEST(test_doc_changed_during_run)
{
    make_docs(3);
    /* compress jobs of seconds, one prefetched document: doc_002 is read again seconds after
     * the first prefill began */
    write_config(kvm_test_quick() ? "method = sculpt\nqueries = 512\nrounds = 2\niterations = 60"
                                  : "method = sculpt\nqueries = 2048\nrounds = 4\niterations = 300",
                 store, "max_prefetch = 1");
    char out_path[4300], err_path[4300], changed[4300];
    pid_t pid = start_kvmill(out_path, err_path, sizeof out_path);
    for (int i = 0; i < 1500 && !stage_started(); i++)
        usleep(20000);
    snprintf(changed, sizeof changed, "%s/doc_002.txt", docs);
    const char *text = "Another story now: the cat sat on the mat and looked at the moon all night long.\n";
    ck_assert_int_eq(kvm_test_write_file(changed, text, strlen(text)), 0);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    char *out = kvm_test_read_file(out_path, NULL), *err = kvm_test_read_file(err_path, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d\nstdout: %s\nstderr: %s", st, out, err);
    ck_assert_msg(summary_field(out, "failed") == 1 && summary_field(out, "compressed") == 2, "stdout: %s\nstderr: %s",
                  out, err);
    ck_assert_msg(strstr(err, "doc_002.txt changed since the run scanned it") != NULL, "stderr: %s", err);
    ck_assert_int_eq(kvm_test_store_caches(store), 2);
    free(out);
    free(err);
}
END_TEST

/* A compress worker started by hand with --store naming store path st (a folder or an endpoint),
 * joined to the run in run_dir as --id NAME, --grace-s grace (NULL: its default); its stdout and
 * stderr go to tmp/NAME.log. */
static pid_t start_worker_log(const char *st, const char *name, const char *grace, const char *log_name)
{
    pid_t worker = fork();
    ck_assert_int_ge(worker, 0);
    if (worker == 0) {
        char exe[4200], ep[4300], log[4300];
        snprintf(exe, sizeof exe, "%s/kvmill-compress", kvm_test_bin());
        snprintf(ep, sizeof ep, "ipc://%s", run_dir);
        snprintf(log, sizeof log, "%s/%s.log", tmp, log_name);
        if (!freopen(log, "w", stdout) || !freopen(log, "a", stderr)) _exit(127);
        execl(exe, exe, "--connect", ep, "--store", st, "--heartbeat-ms", "200", "--id", name,
              grace ? "--grace-s" : (char *)NULL, grace, (char *)NULL);
        _exit(127);
    }
    return worker;
}

static pid_t start_worker_grace(const char *st, const char *name, const char *grace)
{
    return start_worker_log(st, name, grace, name);
}

static pid_t start_worker(const char *st, const char *name) { return start_worker_grace(st, name, NULL); }

/* The exit status of child pid within s seconds, else -1 (then killed). */
static int wait_exit(pid_t pid, int s)
{
    int st = 0;
    for (int i = 0; i < s * 100; i++, usleep(10000))
        if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

/* A run of n_docs documents with sculpt jobs of seconds (the sanitizers' quick runs are slower by
 * themselves), heartbeats every 200 ms, `liveness` of them, and no compress worker of its own;
 * started (its stdout and stderr paths into out_path, err_path) and waiting for workers started
 * by hand, its store made (a worker refuses a --store that does not exist yet). Returns its pid. */
static pid_t start_hand_run(int n_docs, int liveness, char *out_path, char *err_path, size_t n)
{
    make_docs(n_docs);
    char run[64];
    snprintf(run, sizeof run, "heartbeat_ms = 200\nliveness = %d", liveness);
    write_config(kvm_test_quick() ? "method = sculpt\nqueries = 512\nrounds = 2\niterations = 60"
                                  : "method = sculpt\nqueries = 2048\nrounds = 4\niterations = 300",
                 store, run);
    FILE *f = fopen(cfg_path, "a");
    ck_assert_ptr_nonnull(f);
    fputs("compress_workers = 0\n", f); /* the [stages] section is the config's last */
    fclose(f);
    pid_t pid = start_kvmill(out_path, err_path, n);
    ck_assert_msg(kvm_test_wait_text(err_path, "waiting for kvmill-compress workers started by hand", 1, 30),
                  "the run did not start");
    return pid;
}

/* A compress worker started by hand and stopped cleanly while busy (SIGTERM: it finishes its job,
 * then stops) was logged "went silent" a liveness period later (5 s here), the wording of a hung
 * or dead one. Its last word, a stopping heartbeat on the control socket (revision 14), ends it
 * at once: "stopped (it said so". */
static void hand_worker_clean_stop(const char *grace)
{
    char out_path[4300], err_path[4300], wpath[4300];
    pid_t pid = start_hand_run(3, 25, out_path, err_path, sizeof out_path);
    pid_t w = start_worker_grace(store, "hand", grace);
    snprintf(wpath, sizeof wpath, "%s/hand.log", tmp);
    int busy = 0; /* its first job's KV came: a job of seconds runs */
    for (int i = 0; i < 600 && !busy; i++, usleep(50000)) {
        char *wlog = kvm_test_read_file(wpath, NULL);
        busy = wlog && strstr(wlog, "completed the ZeroMQ handshake");
        free(wlog);
    }
    usleep(500000);
    kill(w, SIGTERM);
    const int wrc = wait_exit(w, 60);
    /* within 2 s of its exit: not the 5 s of its liveness */
    const int said = kvm_test_wait_text(err_path, "stopped (it said so: a clean stop)", 1, 2);
    if (grace) { /* the same id again: said ("joined again"), as a first join is */
        pid_t w2 = start_worker_grace(store, "hand", NULL);
        kvm_test_wait_text(err_path, "worker hand joined again", 1, 20);
        kill(w2, SIGKILL);
        waitpid(w2, NULL, 0);
    }
    char *err = kvm_test_read_file(err_path, NULL);
    kill(pid, SIGINT);
    waitpid(pid, NULL, 0);
    char *wlog = kvm_test_read_file(wpath, NULL);
    ck_assert_msg(busy && wrc == 0, "worker exit %d (busy %d):\n%s", wrc, busy, wlog);
    ck_assert_msg(said, "no clean stop logged:\n%s\nworker:\n%s", err, wlog);
    ck_assert_msg(!strstr(err, "went silent"), "%s", err);
    ck_assert_msg(!grace || strstr(err, "worker hand joined again"), "started again under its id: %s", err);
    free(wlog);
    free(err);
}

/* Two processes under one --id, started by hand: the first (log first.log) is killed (SIGKILL)
 * while it runs a job; the second (second.log) was started while the first ran (duplicate: 1) or
 * at once after the kill (duplicate: 0). A ZeroMQ ROUTER hears the first connection under an id:
 * a duplicate was never heard, even once the first was gone (its first ready stayed unread), and
 * the run waited for ever; a restart's heartbeats kept the worker alive, so its job, lost with
 * the first process, was never requeued, and the run waited for ever too. Now the duplicate gets
 * no welcome and connects again until it is heard (revision 15), and a control ready of another
 * pid under the id takes the job back at once: the run stores every document. */
static void hand_worker_second_process(int duplicate)
{
    const int n_docs = 3;
    char out_path[4300], err_path[4300], first_log[4300], second_log[4300];
    snprintf(first_log, sizeof first_log, "%s/first.log", tmp);
    snprintf(second_log, sizeof second_log, "%s/second.log", tmp);
    /* a liveness of 90 s, longer than the run is given after the kill */
    pid_t pid = start_hand_run(n_docs, 450, out_path, err_path, sizeof out_path);
    pid_t a = start_worker_log(store, "twice", NULL, "first"), b = -1;
    /* welcomed, or its first job done (it asks for the next at once); stopped there, so that the
     * run holds work for it whatever the jobs' speed (the sanitizers', a quick run's) */
    const int busy = kvm_test_wait_text(first_log, duplicate ? "connected to" : " document doc_", 1, 90);
    kill(a, SIGSTOP);
    if (duplicate) { /* connected (unheard) while the first runs its jobs */
        b = start_worker_log(store, "twice", NULL, "second");
        ck_assert_msg(kvm_test_wait_text(second_log, "completed the ZeroMQ handshake", 1, 30),
                      "the second process did not connect");
        usleep(500000);
    }
    kill(a, SIGKILL);
    waitpid(a, NULL, 0);
    if (!duplicate) b = start_worker_log(store, "twice", NULL, "second");
    const int rc = wait_exit(pid, 150); /* the liveness (90 s) alone would not end it in time */
    kill(b, SIGTERM);
    const int brc = wait_exit(b, 30);
    char *err = kvm_test_read_file(err_path, NULL), *out = kvm_test_read_file(out_path, NULL);
    char *blog = kvm_test_read_file(second_log, NULL);
    char *alog = kvm_test_read_file(first_log, NULL);
    int first_did = 0;
    for (const char *p = alog; p && (p = strstr(p, " document doc_")); p++)
        first_did++;
    ck_assert_msg(busy && first_did < n_docs, "the first worker did %d jobs:\n%s\n%s", first_did, err, alog);
    free(alog);
    ck_assert_msg(rc == 0, "run exit %d:\n%s\n%s\nsecond:\n%s", rc, out, err, blog);
    char want[32];
    snprintf(want, sizeof want, "compressed=%d", n_docs);
    ck_assert_msg(strstr(out, want), "%s", out);
    ck_assert_msg(strstr(err, "worker twice is a new process"), "%s", err);
    ck_assert_msg(strstr(blog, " document doc_"), "the second process did no job:\n%s", blog);
    ck_assert_msg(!duplicate || (strstr(blog, "answered neither this worker's ready") &&
                                 strstr(blog, "another process may hold worker id twice") &&
                                 strstr(blog, "hears this worker now")),
                  "%s", blog);
    ck_assert_msg(brc == 0, "second worker exit %d:\n%s", brc, blog);
    free(blog);
    free(out);
    free(err);
}

START_TEST(test_hand_worker_duplicate_id) { hand_worker_second_process(1); }
END_TEST

START_TEST(test_hand_worker_restarted) { hand_worker_second_process(0); }
END_TEST

START_TEST(test_hand_worker_clean_stop) { hand_worker_clean_stop(NULL); }
END_TEST

/* The same with --grace-s 0: the job it runs is handed back at SIGTERM (the run requeues it) and
 * the worker stops: its last word was not sent while the abandoned job's thread still ran. */
START_TEST(test_hand_worker_grace_over) { hand_worker_clean_stop("0"); }
END_TEST

/* A compress worker started by hand with another --store than the run's joined it: first the
 * run took its acks for commits (compressed=N, exit 0, its own store empty); then each acked cache
 * missing from the run's store was requeued as an attempt of its document, and the worker took
 * job after job until every document had failed (exit 1), though a right worker came. Now the
 * first such ack refuses the worker (it is told why and exits 1), the document gets its attempt
 * back, and a worker started with the run's store stores every document (exit 0). */
START_TEST(test_worker_with_another_store)
{
    make_docs(2);
    char other[4300];
    snprintf(other, sizeof other, "%s/other.lmdb", tmp);
    kvm_store_opts so = {0}; /* the other store exists: a worker refuses a --store that does not */
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(other, &so, &s) == 0, "%s", kvm_errmsg());
    kvm_store_close(&s);
    char metrics[4400], extra[4500];
    snprintf(metrics, sizeof metrics, "%s/metrics.json", tmp);
    snprintf(extra, sizeof extra, "max_retries = 0\nmetrics = %s\nlog_format = json", metrics);
    write_config("method = streaming\nbudget = 32", store, extra);
    FILE *f = fopen(cfg_path, "a");
    ck_assert_ptr_nonnull(f);
    fputs("compress_workers = 0\n", f); /* the [stages] section is the config's last */
    fclose(f);
    char out_path[4300], err_path[4300];
    pid_t pid = start_kvmill(out_path, err_path, sizeof out_path);
    int bad = wait_exit(start_worker(other, "bad"), 60);
    char wpath[4300];
    snprintf(wpath, sizeof wpath, "%s/bad.log", tmp);
    char *wlog = kvm_test_read_file(wpath, NULL);
    ck_assert_msg(bad == 1 && wlog && strstr(wlog, "refused by run: this run refuses this worker") &&
                      strstr(wlog, "the worker writes to another store"),
                  "worker exit %d:\n%s", bad, wlog);
    free(wlog);
    pid_t good = start_worker(store, "good");
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    kill(good, SIGTERM);
    waitpid(good, NULL, 0);
    char *out = kvm_test_read_file(out_path, NULL), *err = kvm_test_read_file(err_path, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\nstdout: %s\nstderr: %s", st, out, err);
    ck_assert_msg(summary_field(out, "compressed") == 2 && summary_field(out, "failed") == 0, "stdout: %s\nstderr: %s",
                  out, err);
    ck_assert_msg(strstr(err, "is refused, no more jobs go to it") &&
                      strstr(err, "holds no cache of it: the worker writes to another store"),
                  "stderr: %s", err);
    ck_assert_int_eq(kvm_test_store_caches(store), 2);
    char *m = kvm_test_read_file(metrics, NULL); /* the refused worker's ack committed nothing here */
    ck_assert_msg(m && strstr(m, "\"store_commits\": 2,"), "metrics: %s", m);
    free(m);
    int done = 0; /* and no job_done event says it committed one */
    for (const char *p = err; (p = strstr(p, "\"event\":\"job_done\"")); p++)
        done++;
    ck_assert_msg(done == 2, "%d job_done events: %s", done, err);
    free(out);
    free(err);
}
END_TEST

/* The owner string of a run that process pid of this host would write (kvm_storew_owner's shape). */
static void owner_of(long pid, const char *host, char *out, size_t n)
{
    char id[96];
    kvm_rundir_proc_id(pid, id, sizeof id);
    snprintf(out, n, "run:%.48s:%ld:%lld:%s", host, pid, (long long)time(NULL) * 1000, id);
}

/* A child standing for a live run that holds claims in store: it renews them every 100 ms
 * (renew) or only lives (not renew). Returns its pid. */
static pid_t live_run(int renew)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid) return pid;
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failed assertion ends the test: so does this stand-in */
    char host[64] = "", owner[192];
    gethostname(host, sizeof host - 1);
    owner_of((long)getpid(), host, owner, sizeof owner);
    kvm_store *s = NULL;
    for (;;) {
        usleep(100000);
        if (!renew) continue;
        if (!s && kvm_store_open(store, NULL, &s)) continue; /* the test creates it */
        kvm_storew_renew(s, owner, 600000);
    }
}

/* Run B found documents claimed by other runs (the same store and corpus), counted them as
 * claimed=N and never looked again: when their runs died (kill -9, or on another host, a lease
 * not renewed) B still exited 0, and they were never stored. Now B rechecks them before it ends:
 * the one of a run of this host killed meanwhile and the one whose claim lapsed unrenewed are
 * taken over and compressed; the one of a run that renews its claim is left to it (claimed=1). */
START_TEST(test_left_documents_rechecked)
{
    make_docs(4);
    char first[4300];
    snprintf(first, sizeof first, "%s/first.lmdb", tmp);
    const char *method = "method = streaming\nbudget = 32";
    write_config(method, first, "heartbeat_ms = 100\nliveness = 20");
    char *out = NULL, *err = NULL;
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    keys ks = {.n = 0};
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(first, NULL, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, collect_key, &ks), 0);
    kvm_store_close(&s);
    ck_assert_int_eq(ks.n, 4);
    pid_t doomed = live_run(0), renewing = live_run(1);
    char host[64] = "", owners[3][192];
    ck_assert_int_eq(gethostname(host, sizeof host - 1), 0);
    owner_of((long)doomed, host, owners[0], sizeof owners[0]);
    owner_of((long)renewing, host, owners[1], sizeof owners[1]);
    snprintf(owners[2], sizeof owners[2], "run:elsewhere-%.40s:4242:1:B1N1T1", host);
    kvm_store_opts so = {0};
    ck_assert_msg(kvm_store_open(store, &so, &s) == 0, "%s", kvm_errmsg());
    for (int i = 0; i < 3; i++) { /* the other host's lease lapses in 3 s, unrenewed */
        int taken = 0;
        ck_assert_int_eq(kvm_store_claim_take(s, &ks.k[i], owners[i], i == 2 ? "elsewhere" : host,
                                              i == 2 ? 3000 : 600000, &taken, NULL),
                         0);
        ck_assert_int_eq(taken, 1);
    }
    kvm_store_close(&s);
    write_config(method, store, "heartbeat_ms = 100\nliveness = 20");
    char out_path[4300], err_path[4300];
    pid_t pid = start_kvmill(out_path, err_path, sizeof out_path);
    int st, ended = 0;
    for (int i = 0; i < 600 && !ended; i++) { /* B has done its own document and waits */
        err = kvm_test_read_file(err_path, NULL);
        int waiting = err && strstr(err, "waiting for the") != NULL;
        free(err);
        if (waiting) break;
        usleep(50000);
        ended = waitpid(pid, &st, WNOHANG) == pid;
    }
    kill(doomed, SIGKILL); /* kill -9 of the run B left a document to */
    waitpid(doomed, NULL, 0);
    ck_assert_int_eq(ended || waitpid(pid, &st, 0) == pid, 1);
    kill(renewing, SIGKILL);
    waitpid(renewing, NULL, 0);
    out = kvm_test_read_file(out_path, NULL), err = kvm_test_read_file(err_path, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\nstdout: %s\nstderr: %s", st, out, err);
    ck_assert_msg(summary_field(out, "compressed") == 3 && summary_field(out, "claimed") == 1 &&
                      summary_field(out, "failed") == 0,
                  "stdout: %s\nstderr: %s", out, err);
    ck_assert_msg(strstr(err, "a run which renews its claim: that run stores it") != NULL, "stderr: %s", err);
    ck_assert_int_eq(kvm_test_store_caches(store), 3);
    free(out);
    free(err);
}
END_TEST

/* A run waiting for a document left to another run said only "waiting for the 1 document left
 * to other runs", however long the claim's lease ([run] heartbeat_ms x liveness up to 1000 h,
 * or any ttl through a store service): the wait looked endless. Now the wait names each
 * document with when its claim lapses unless renewed and whether it was renewed, and the run's
 * own claims are leased for at most 24 h (the store refuses longer ones) whatever the config
 * asks: here 100 s x 1000 = 27.8 h. The other host's claim is leased for 60 s, more than a
 * loaded machine takes to start the run: the run surely waits, and its own claim is read then;
 * `kvmill store claims --release OWNER --force` (refused without --force: the claim is live)
 * ends the wait, the run taking the document over at its next recheck. */
START_TEST(test_left_wait_says_lapse)
{
    make_docs(2);
    char first[4300];
    snprintf(first, sizeof first, "%s/first.lmdb", tmp);
    const char *method = "method = streaming\nbudget = 32", *other = "run:elsewhere:4242:1:B1N1T1";
    write_config(method, first, "");
    char *out = NULL, *err = NULL;
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    keys ks = {.n = 0};
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(first, NULL, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, collect_key, &ks), 0);
    kvm_store_close(&s);
    ck_assert_int_eq(ks.n, 2);
    kvm_store_opts so = {0};
    ck_assert_msg(kvm_store_open(store, &so, &s) == 0, "%s", kvm_errmsg());
    int taken = 0;
    ck_assert_int_eq(kvm_store_claim_take(s, &ks.k[0], other, "elsewhere", 60000, &taken, NULL), 0);
    ck_assert_int_eq(taken, 1);
    kvm_store_close(&s);
    write_config(method, store, "heartbeat_ms = 100000\nliveness = 1000");
    char out_path[4300], err_path[4300];
    pid_t pid = start_kvmill(out_path, err_path, sizeof out_path);
    int st, ended = 0, waiting = 0;
    for (int i = 0; i < 2500 && !ended && !waiting; i++) { /* it has done its own document and waits */
        err = kvm_test_read_file(err_path, NULL);
        waiting = err && strstr(err, "waiting for the") != NULL;
        free(err);
        if (!waiting) usleep(20000);
        ended = waitpid(pid, &st, WNOHANG) == pid;
    }
    kvm_store_claim own = {0};
    int own_rc = -1;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    /* the run's own claim, on the other document: it waits for the other's, leased for 60 s */
    if (waiting && kvm_store_open(store, &so, &s) == 0) {
        own_rc = kvm_store_claim_get(s, &ks.k[1], &own);
        kvm_store_close(&s);
    }
    int refused = -1, released = -1;
    char *rout = NULL, *rerr = NULL;
    if (waiting) {
        char cmd[9000];
        snprintf(cmd, sizeof cmd, "'%s/kvmill' store claims --store '%s' --release '%s'", kvm_test_bin(), store, other);
        refused = kvm_test_run(cmd, &rout, &rerr);
        free(rout), free(rerr);
        strncat(cmd, " --force", sizeof cmd - strlen(cmd) - 1);
        released = kvm_test_run(cmd, &rout, &rerr);
    }
    if (!ended && !waiting) kill(pid, SIGTERM);
    ck_assert_int_eq(ended || waitpid(pid, &st, 0) == pid, 1);
    out = kvm_test_read_file(out_path, NULL), err = kvm_test_read_file(err_path, NULL);
    ck_assert_msg(waiting, "stdout: %s\nstderr: %s", out, err);
    ck_assert_msg(refused == 1 && released == 0 && rout && strstr(rout, "released 1 claim(s) of run:elsewhere"),
                  "store claims --release: %d, then with --force %d: %s%s", refused, released, rout, rerr);
    free(rout), free(rerr);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d\nstdout: %s\nstderr: %s", st, out, err);
    ck_assert_msg(own_rc == 0 && !strncmp(own.owner, "run:", 4), "own claim: %d %s\nstderr: %s", own_rc, own.owner,
                  err);
    const int64_t now_ms = (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
    ck_assert_msg(own.expires_unix_ms - now_ms <= 86400000, "the run's lease ends in %lld ms",
                  (long long)(own.expires_unix_ms - now_ms));
    ck_assert_msg(summary_field(out, "compressed") == 2 && summary_field(out, "claimed") == 0, "stdout: %s\nstderr: %s",
                  out, err);
    ck_assert_msg(strstr(err, "is being compressed by run:elsewhere:4242:1:B1N1T1 on elsewhere: left to it (its claim "
                              "lapses at ") != NULL,
                  "stderr: %s", err);
    const char *w = strstr(err, "waiting for the 1 document");
    ck_assert_msg(w && strstr(w, ".txt: its claim lapses at ") && strstr(w, " UTC (in ") &&
                      strstr(w, " s) unless renewed; not renewed since this run left it"),
                  "stderr: %s", err);
    ck_assert_msg(strstr(err, "was left to another run, whose claim lapsed unrenewed or whose process is gone: "
                              "compressing it here"),
                  "stderr: %s", err);
    free(out);
    free(err);
}
END_TEST

/* A document left to another run was rechecked by walking every skipped job: with a corpus
 * stored but for one document claimed by a live run, each recheck (every 250 ms at the end)
 * looked at the whole corpus in one event (the metrics' sched_jobs_max). The left jobs have a
 * list of their own now: a recheck looks at them alone. */
START_TEST(test_left_recheck_bounded)
{
    const int n = 120;
    for (int i = 0; i < n; i++) {
        char path[4300], text[128];
        snprintf(path, sizeof path, "%s/doc_%03d.txt", docs, i);
        int len = snprintf(text, sizeof text, "Story %d. Once upon a time there was a cat number %d.", i, 7 * i);
        ck_assert_int_eq(kvm_test_write_file(path, text, (size_t)len), 0);
    }
    char run[4500], metrics[4300];
    snprintf(metrics, sizeof metrics, "%s/metrics.json", tmp);
    snprintf(run, sizeof run, "heartbeat_ms = 100\nliveness = 20\nmetrics = %s", metrics);
    write_config("method = streaming\nbudget = 16", store, run);
    char *out = NULL, *err = NULL;
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    keys ks = {.n = 0}; /* one cache removed, its document claimed by a run that renews its claim */
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(store, NULL, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, collect_key, &ks), 0);
    ck_assert_int_ge(ks.n, 1);
    ck_assert_int_eq(kvm_store_rm_cache(s, &ks.k[0]), 0);
    pid_t renewing = live_run(1);
    char host[64] = "", owner[192];
    ck_assert_int_eq(gethostname(host, sizeof host - 1), 0);
    owner_of((long)renewing, host, owner, sizeof owner);
    int taken = 0;
    ck_assert_int_eq(kvm_store_claim_take(s, &ks.k[0], owner, host, 600000, &taken, NULL), 0);
    ck_assert_int_eq(taken, 1);
    kvm_store_close(&s);
    int rc = run_kvmill(&out, &err);
    kill(renewing, SIGKILL);
    waitpid(renewing, NULL, 0);
    ck_assert_msg(rc == 0 && summary_field(out, "claimed") == 1 && summary_field(out, "skipped") == n - 1,
                  "exit %d\nstdout: %s\nstderr: %s", rc, out, err);
    char *m = kvm_test_read_file(metrics, NULL);
    const char *k = m ? strstr(m, "\"sched_jobs_max\": ") : NULL;
    ck_assert_msg(k, "metrics: %s", m ? m : "(none)");
    long long visited = atoll(k + strlen("\"sched_jobs_max\": "));
    ck_assert_msg(visited <= 8, "an event looked at %lld jobs of %d (metrics: %s)", visited, n, m);
    free(m);
    free(out);
    free(err);
}
END_TEST

/* ---- the broker's state, without processes ---- */

typedef struct fake_run {
    orch *o;
    kvm_config *cfg;
    kvm_corpus corpus;
    kvm_doc doc;
    int32_t tokens[4];
    kvm_orch_summary sum;
} fake_run;

/* An orchestrator in memory with one queued document (tokens given, no store) and its ROUTER
 * sockets (ZMQ_ROUTER_MANDATORY, as bind_sockets sets them) bound to inproc:// endpoints. */
static void fake_start(fake_run *f)
{
    static const atomic_int no_interrupts = 0;
    memset(f, 0, sizeof *f);
    char text[4600];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = streaming\nbudget = 32\n"
             "[store]\npath = %s\n[run]\nmax_prefetch = 4\n",
             kvm_test_data_path("models/stories260K.bin"), store);
    ck_assert_msg(kvm_config_parse(text, "fake.ini", &f->cfg) == 0, "%s", kvm_errmsg());
    f->o = calloc(1, sizeof *f->o);
    ck_assert_ptr_nonnull(f->o);
    orch *o = f->o;
    for (int i = 0; i < 4; i++)
        f->tokens[i] = 1 + i;
    f->doc = (kvm_doc){.name = "doc.txt", .tokens = f->tokens, .n_tokens = 4, .n_original = 4};
    f->corpus = (kvm_corpus){.docs = &f->doc, .n = 1};
    o->cfg = f->cfg;
    o->corpus = &f->corpus;
    o->sum = &f->sum;
    o->interrupts = &no_interrupts;
    o->mode = MODE_RUN;
    o->cmd = "run";
    o->reduce_worker = -1;
    o->max_retries = 3;
    o->hb_ms = 100, o->dead_ms = 500, o->job_timeout_ms = 600000;
    o->n_jobs = o->n_open = 1;
    o->jobs = calloc(1, sizeof *o->jobs);
    ck_assert_ptr_nonnull(o->jobs);
    o->jobs[0] = (orch_job){.doc = &f->doc, .state = J_QUEUED, .id = 1, .worker = -1};
    o->next_id = 2;
    ck_assert_int_eq(kvm_joblist_init(&o->lists, 1, N_JOB_STATES, J_QUEUED), 0);
    ck_assert_int_eq(kvm_idxset_add(&o->by_id, 1, 0), 0);
    o->zctx = zmq_ctx_new();
    o->ctl = zmq_socket(o->zctx, ZMQ_ROUTER);
    o->data = zmq_socket(o->zctx, ZMQ_ROUTER);
    int mandatory = 1, linger = 0;
    void *socks[2] = {o->ctl, o->data};
    const char *eps[2] = {"inproc://fake-ctl", "inproc://fake-data"};
    for (int i = 0; i < 2; i++) {
        zmq_setsockopt(socks[i], ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        ck_assert_int_eq(zmq_bind(socks[i], eps[i]), 0);
    }
}

static void fake_end(fake_run *f)
{
    orch *o = f->o;
    zmq_close(o->ctl);
    zmq_close(o->data);
    zmq_ctx_term(o->zctx);
    kvm_orch__job_drop_kv(&o->jobs[0]);
    free(o->jobs[0].kv);
    free(o->jobs);
    kvm_idxset_free(&o->by_id);
    kvm_joblist_deinit(&o->lists);
    free(o);
    kvm_config_free(&f->cfg);
}

/* A worker the table holds as idle whose connection is gone (killed, restarted: a send to it
 * fails with EHOSTUNREACH). Each failed send used up an attempt of the document and left the
 * worker idle, so the next dispatch chose it again: the document failed "after 4 attempts" in
 * four events. Now the worker is no longer idle (until it asks again) and the document waits,
 * its attempt unused. */
START_TEST(test_unreachable_worker_not_the_documents_fault)
{
    fake_run f;
    fake_start(&f);
    orch *o = f.o;
    o->workers[0] =
        (orch_worker){.id = "prefill-0-r0", .stage = ST_PREFILL, .idle = 1, .job = -1, .alive = 1, .slot = -1};
    o->n_workers = 1;
    for (int k = 0; k < 6; k++)
        kvm_orch__dispatch(o);
    ck_assert_int_eq(o->jobs[0].state, J_QUEUED);
    ck_assert_int_eq(o->jobs[0].attempt, 0);
    ck_assert_int_eq(o->workers[0].idle, 0); /* until it asks again; not killed: a network blip costs no restart */
    ck_assert_int_eq(o->workers[0].alive, 1);
    ck_assert_int_eq(o->sum->requeues, 0);
    fake_end(&f);
}
END_TEST

/* A DEALER with routing id `id` connected to the fake run's data socket. */
static void *fake_worker(orch *o, const char *id)
{
    void *d = zmq_socket(o->zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_ROUTING_ID, id, strlen(id));
    ck_assert_int_eq(zmq_connect(d, "inproc://fake-data"), 0);
    return d;
}

/* Worker `id` (DEALER d) says on the data socket that it stops (revision 13); the run reads it. */
static void say_stopping(orch *o, void *d, const char *id)
{
    kvm_proto_heartbeat hb = {.worker_id = {id, strlen(id)}, .stage = {"prefill", 7}, .pid = 1, .stopping = true};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_heartbeat_encode(&hb, &m), 0);
    ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
    zmq_pollitem_t it = {o->data, 0, ZMQ_POLLIN, 0};
    ck_assert_int_eq(zmq_poll(&it, 1, 5000), 1);
    kvm_orch__receive(o, o->data, 0);
}

/* What came to DEALER d within 5 s must be the end of its work: an ack with `stopping`, job 0,
 * from `from`. */
static void assert_end_of_work(void *d, const char *from)
{
    zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
    ck_assert_msg(zmq_poll(&it, 1, 5000) == 1, "no end of work came to the stopping worker");
    kvm_msg *m = NULL;
    kvm_proto_type t;
    ck_assert_int_eq(kvm_msg_recv(d, &m, 0), 0);
    ck_assert_int_eq(kvm_proto_peek(m, &t), 0);
    ck_assert_msg(t == KVM_PROTO_ACK, "the stopping worker got a %s, not the end of its work", kvm_proto_type_name(t));
    kvm_proto_ack a;
    ck_assert_msg(kvm_proto_ack_decode(m, &a) == 0, "%s", kvm_errmsg());
    ck_assert(a.stopping);
    ck_assert_uint_eq(a.job_id, 0);
    ck_assert(kvm_proto_str_eq(a.stage, from));
    kvm_msg_free(&m);
}

/* A stopping worker with a credit out (PROTOCOL.md §5, revision 13): kvmill run withdraws the
 * credit, so the queued document goes to no one, and answers with the end of its work on the
 * data socket; asked twice, it answers twice. A worker the run does not know gets the end of its
 * work too and is not added to the table. Before, the run dropped the heartbeat and handed the
 * document to the stopping worker, which read it only within its 300 ms. */
START_TEST(test_stopping_worker_gets_end_of_work)
{
    fake_run f;
    fake_start(&f);
    orch *o = f.o;
    o->workers[0] =
        (orch_worker){.id = "prefill-0-r0", .stage = ST_PREFILL, .idle = 1, .job = -1, .alive = 1, .slot = -1};
    o->n_workers = 1;
    void *d = fake_worker(o, "prefill-0-r0");
    say_stopping(o, d, "prefill-0-r0");
    ck_assert_int_eq(o->workers[0].idle, 0);
    kvm_orch__dispatch(o);
    ck_assert_int_eq(o->jobs[0].state, J_QUEUED); /* not handed to the stopping worker */
    assert_end_of_work(d, "run");
    zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
    ck_assert_int_eq(zmq_poll(&it, 1, 200), 0); /* nothing else: no job */
    say_stopping(o, d, "prefill-0-r0");
    assert_end_of_work(d, "run");
    void *ghost = fake_worker(o, "ghost");
    say_stopping(o, ghost, "ghost");
    assert_end_of_work(ghost, "run");
    ck_assert_int_eq(o->n_workers, 1);
    zmq_close(ghost);
    zmq_close(d);
    fake_end(&f);
}
END_TEST

/* Worker `id` (DEALER d) asks for work on the data socket (a credit); the run reads it. */
static void ask_for_work(orch *o, void *d, const char *id)
{
    kvm_proto_ready r = {.worker_id = {id, strlen(id)}, .stage = {"prefill", 7}, .pid = 1};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_ready_encode(&r, &m), 0);
    ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
    zmq_pollitem_t it = {o->data, 0, ZMQ_POLLIN, 0};
    ck_assert_int_eq(zmq_poll(&it, 1, 5000), 1);
    kvm_orch__receive(o, o->data, 0);
}

/* The job id of the job message that came to DEALER d within 5 s. */
static uint64_t job_came(void *d)
{
    zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
    ck_assert_msg(zmq_poll(&it, 1, 5000) == 1, "no job came to the worker");
    kvm_msg *m = NULL;
    kvm_proto_job j;
    ck_assert_int_eq(kvm_msg_recv(d, &m, 0), 0);
    ck_assert_msg(kvm_proto_job_decode(m, &j) == 0, "%s", kvm_errmsg());
    const uint64_t id = j.job_id;
    kvm_msg_free(&m);
    return id;
}

/* A fake run (fake_start) whose one document went to prefill worker `id`, idle before, a DEALER
 * (returned) that got the job, its id in *first. */
static void *job_to_worker(fake_run *f, const char *id, uint64_t *first)
{
    fake_start(f);
    orch *o = f->o;
    o->workers[0] = (orch_worker){.stage = ST_PREFILL, .idle = 1, .job = -1, .alive = 1, .slot = -1};
    snprintf(o->workers[0].id, sizeof o->workers[0].id, "%s", id);
    o->n_workers = 1;
    void *d = fake_worker(o, id);
    kvm_orch__dispatch(o);
    ck_assert_int_eq(o->jobs[0].state, J_PREFILL);
    *first = job_came(d);
    ck_assert_uint_eq(*first, o->jobs[0].id);
    return d;
}

/* A job lost on the wire: it went to the worker, whose connection then closed (ZeroMQ drops what
 * the closed connection's pipe held), and the worker, connected again, asks for work once a
 * heartbeat. The run held the job for that live worker for ever (a run that never ended). Now
 * credits read a liveness period (dead_ms, 500 ms here) apart requeue it, its attempt unused,
 * and the worker gets it again. Credits read in a burst (a backlog read after a stall, or older
 * than the job) requeue nothing. */
START_TEST(test_job_lost_on_the_wire)
{
    fake_run f;
    const char *id = "prefill-0-r0";
    uint64_t first;
    void *d = job_to_worker(&f, id, &first); /* and lost: the worker never sees it */
    orch *o = f.o;
    for (int k = 0; k < 5; k++) /* a burst: nothing said yet */
        ask_for_work(o, d, id);
    ck_assert_int_eq(o->jobs[0].state, J_PREFILL);
    for (int k = 0; k < 20 && o->jobs[0].state == J_PREFILL; k++) {
        usleep(100 * 1000); /* once a heartbeat (hb_ms 100) */
        ask_for_work(o, d, id);
    }
    ck_assert_msg(o->jobs[0].state == J_QUEUED, "the lost job is still held for the worker (state %d)",
                  (int)o->jobs[0].state);
    ck_assert_int_eq(o->jobs[0].attempt, 0); /* the network's fault, not the document's */
    ck_assert_uint_ne(o->jobs[0].id, first);
    ck_assert_int_eq(o->workers[0].job, -1);
    ck_assert_int_eq(o->workers[0].idle, 1); /* the credit that told it */
    ck_assert_int_eq(o->workers[0].alive, 1);
    kvm_orch__dispatch(o);
    ck_assert_int_eq(o->jobs[0].state, J_PREFILL);
    ck_assert_uint_eq(job_came(d), o->jobs[0].id);
    zmq_close(d);
    fake_end(&f);
}
END_TEST

/* A job that reached its worker and ran a liveness period: a credit read after the job was
 * handed (sent before it came), then, the job done, the credit that overtook its result on the
 * other connection. The two were taken for a lost job, requeued and done twice. Now credits
 * with a job's silence between them requeue nothing; a lost job's, once a heartbeat, still do. */
START_TEST(test_job_run_is_not_lost)
{
    fake_run f;
    const char *id = "prefill-0-r0";
    uint64_t first;
    void *d = job_to_worker(&f, id, &first);
    orch *o = f.o;
    ask_for_work(o, d, id); /* sent before the job came */
    usleep(700 * 1000);     /* the job runs (dead_ms 500) */
    ask_for_work(o, d, id); /* the job done: this credit overtook the result */
    ck_assert_msg(o->jobs[0].state == J_PREFILL && o->jobs[0].id == first,
                  "a job its worker ran was requeued (state %d, id %llu, was %llu)", (int)o->jobs[0].state,
                  (unsigned long long)o->jobs[0].id, (unsigned long long)first);
    ck_assert_int_eq(o->workers[0].job, 0);
    for (int k = 0; k < 20 && o->jobs[0].state == J_PREFILL; k++) { /* now lost: credits once a heartbeat */
        usleep(100 * 1000);
        ask_for_work(o, d, id);
    }
    ck_assert_msg(o->jobs[0].state == J_QUEUED, "a lost job is held for the worker (state %d)", (int)o->jobs[0].state);
    zmq_close(d);
    fake_end(&f);
}
END_TEST

/* An ack of an earlier attempt of a job: the job was requeued (its worker judged dead) after its
 * worker had committed the cache. The ack was dropped as stale, and the document compressed
 * again, or failed, though stored. Now it is done, counted compressed, when the store holds its
 * cache: job ids are numbered from 1 by every run, so an ack another run's worker queued before
 * this run began can name an earlier id of this run (_i = 1: the store does not hold the cache,
 * and the ack counts for nothing). */
START_TEST(test_earlier_attempts_ack_counts)
{
    const int stored = _i == 0;
    make_docs(1); /* a real run's cache, for the store the fake run looks in */
    write_config("method = streaming\nbudget = 32", store, "heartbeat_ms = 100\nliveness = 600");
    char *out = NULL, *err = NULL;
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    keys ks = {.n = 0};
    kvm_store *st = NULL;
    ck_assert_msg(kvm_store_open(store, NULL, &st) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(st, NULL, collect_key, &ks), 0);
    ck_assert_int_eq(ks.n, 1);
    fake_run f;
    fake_start(&f);
    orch *o = f.o;
    o->store = st;
    o->model_id = ks.k[0].model_id, o->config_id = ks.k[0].config_id, o->tok_id = ks.tok[0];
    f.doc.hash = ks.k[0].doc_hash;
    if (!stored) f.doc.hash.b[0] ^= 1; /* another document's key: not in the store */
    kvm_orch__requeue(o, &o->jobs[0], "worker compress-1-r0 went silent"); /* attempt 2, a new id */
    ck_assert_int_eq(o->jobs[0].state, J_QUEUED);
    ck_assert_uint_ne(o->jobs[0].id, 1);
    void *dealer = zmq_socket(o->zctx, ZMQ_DEALER);
    const char *id = "compress-1-r0";
    zmq_setsockopt(dealer, ZMQ_ROUTING_ID, id, strlen(id));
    ck_assert_int_eq(zmq_connect(dealer, "inproc://fake-ctl"), 0);
    kvm_proto_ack ack = {.worker_id = {id, strlen(id)}, .stage = {"compress", 8}, .pid = 1, .job_id = 1};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_ack_encode(&ack, &m), 0);
    ck_assert_int_eq(kvm_msg_send(dealer, &m, 0), 0);
    zmq_pollitem_t it = {o->ctl, 0, ZMQ_POLLIN, 0};
    ck_assert_int_eq(zmq_poll(&it, 1, 5000), 1);
    kvm_orch__receive(o, o->ctl, 1);
    ck_assert_int_eq(o->jobs[0].state, stored ? J_DONE : J_QUEUED);
    ck_assert_int_eq(o->sum->compressed, stored);
    ck_assert_int_eq(o->n_open, !stored);
    zmq_close(dealer);
    fake_end(&f);
    kvm_store_close(&st);
}
END_TEST

/* The key of cache k with its document hash's first byte xor x (another document's key). */
static kvm_store_cache_key other_doc(kvm_store_cache_key k, uint8_t x)
{
    k.doc_hash.b[0] ^= x;
    return k;
}

/* A copy of the stored cache k put under k's key with its document hash's first byte xor x. */
static void put_copy(kvm_store *st, const kvm_store_cache_key *k, const kvm_store_id *tok, uint8_t x)
{
    kvm_store_cache *c = NULL;
    ck_assert_msg(kvm_store_get_cache(st, k, tok, &c) == 0, "%s", kvm_errmsg());
    kvm_store_manifest m = c->manifest;
    m.doc_hash = other_doc(*k, x).doc_hash;
    ck_assert_msg(kvm_store_put_cache(st, &m, c->layers) == 0, "%s", kvm_errmsg());
    kvm_store_cache_free(&c);
}

/* The store after a real run of one document (its key into *ks), opened again with a cap of
 * room caches and a half ([store] cap_mb's bytes). Returns the handle (the caller closes it). */
static kvm_store *one_cache_capped(keys *ks, int room)
{
    make_docs(1);
    write_config("method = streaming\nbudget = 32", store, "heartbeat_ms = 100\nliveness = 600");
    char *out = NULL, *err = NULL;
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    kvm_store *st = NULL;
    ck_assert_msg(kvm_store_open(store, NULL, &st) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(st, NULL, collect_key, ks), 0);
    ck_assert_int_eq(ks->n, 1);
    kvm_store_stats ss;
    ck_assert_int_eq(kvm_store_stats_get(st, &ss), 0);
    kvm_store_close(&st);
    kvm_store_opts capped = {.cap_bytes = room * ss.cache_bytes + ss.cache_bytes / 2};
    ck_assert_msg(kvm_store_open(store, &capped, &st) == 0, "%s", kvm_errmsg());
    return st;
}

/* f's run on store st (ks's model, config and tokenizer): worker 0, started by hand, holds job 0,
 * of document doc, in compress. Returns that job. */
static orch_job *job_in_hand_worker(fake_run *f, kvm_store *st, const keys *ks, const kvm_store_id *doc)
{
    fake_start(f);
    orch *o = f->o;
    o->store = st;
    o->model_id = ks->k[0].model_id, o->config_id = ks->k[0].config_id, o->tok_id = ks->tok[0];
    f->doc.hash = *doc;
    o->workers[0] = (orch_worker){.id = "by-hand", .stage = ST_COMPRESS, .job = 0, .alive = 1, .slot = -1};
    o->n_workers = 1;
    orch_job *j = &o->jobs[0];
    j->worker = 0;
    kvm_orch__job_set(o, j, J_COMPRESS);
    return j;
}

/* A compress worker's ack counts only when the run's store holds the cache; on a store at its
 * cap ([store] cap_mb) the cache may have been evicted between its commit and the ack. Evictions
 * counted since the job went to compress excuse the missing cache (_i = 0: counted compressed);
 * with none since then (_i = 1: the evictions came before the send) the worker is taken to
 * write elsewhere and the document is requeued. */
START_TEST(test_ack_after_evictions)
{
    const int evicted_after_send = _i == 0;
    keys ks = {.n = 0};
    kvm_store *st = one_cache_capped(&ks, 1); /* room for one cache */
    fake_run f;
    orch_job *j = job_in_hand_worker(&f, st, &ks, &ks.k[0].doc_hash);
    orch *o = f.o;
    if (evicted_after_send) kvm_orch__note_evictions(o, j); /* the job goes to compress ... */
    put_copy(st, &ks.k[0], &ks.tok[0], 1);                  /* ... and another document's cache evicts this one's */
    kvm_store_stats ss;
    ck_assert_int_eq(kvm_store_stats_get(st, &ss), 0);
    ck_assert_int_eq(ss.n_evicted, 1);
    int found = 1;
    ck_assert_int_eq(kvm_store_has_cache(st, &ks.k[0], &ks.tok[0], &found), 0);
    ck_assert_int_eq(found, 0);
    if (!evicted_after_send) kvm_orch__note_evictions(o, j); /* sent after the eviction */
    kvm_orch__ack_stored(o, j, 0);
    ck_assert_int_eq(j->state, evicted_after_send ? J_DONE : J_QUEUED);
    ck_assert_int_eq(o->sum->compressed, evicted_after_send);
    ck_assert_int_eq(o->sum->requeues, !evicted_after_send); /* "... holds no cache of it": requeued */
    fake_end(&f);
    kvm_store_close(&st);
}
END_TEST

/* A worker started by hand writing to another store, its run's store at its cap: every ack of a
 * cache missing from the run's store was excused by the evictions since the job's send and
 * counted compressed. The cap evicts the least recently served cache first, so while one served
 * before the send is still there, no cache committed after it was evicted: the ack is not
 * excused (the worker is refused, the job queued again), though the cap evicted an older one. */
START_TEST(test_evictions_of_older_excuse_nothing)
{
    keys ks = {.n = 0};
    kvm_store *st = one_cache_capped(&ks, 2); /* room for two caches */
    put_copy(st, &ks.k[0], &ks.tok[0], 1);    /* the store: the run's cache (oldest), then copy 1 */
    fake_run f;
    const kvm_store_id never = other_doc(ks.k[0], 2).doc_hash; /* the job's cache: never in this store */
    orch_job *j = job_in_hand_worker(&f, st, &ks, &never);
    orch *o = f.o;
    usleep(2000);
    kvm_orch__note_evictions(o, j); /* sent ... */
    usleep(2000);
    put_copy(st, &ks.k[0], &ks.tok[0], 4); /* ... then copy 4 evicts the run's cache; copy 1 stays */
    kvm_store_stats ss;
    ck_assert_int_eq(kvm_store_stats_get(st, &ss), 0);
    ck_assert_int_eq(ss.n_evicted, 1);
    ck_assert_msg(ss.oldest_served_ns > 0 && ss.oldest_served_ns < j->sent_ns, "%llu %llu",
                  (unsigned long long)ss.oldest_served_ns, (unsigned long long)j->sent_ns);
    kvm_orch__ack_stored(o, j, 0);
    ck_assert_int_eq(j->state, J_QUEUED);
    ck_assert_int_eq(o->sum->compressed, 0);
    ck_assert_int_eq(o->workers[0].store_refused, 1);
    fake_end(&f);
    kvm_store_close(&st);
}
END_TEST

/* A pause is seen (kvm_orch__resumed) after a gap of half the workers' dead time ([run]
 * heartbeat_ms x liveness); the claims' lease is that time but at most 24 h. With 100 h x 1 and
 * the orchestrator suspended 13 h (a laptop's night), no resume was seen: renewed_ok kept its
 * age, so the first failed renewal through a store service (more than the 24 h lease since it)
 * abandoned a healthy run. Now a gap over half the shorter of the two is a resume. The monotonic
 * clock counts from boot: a machine up for less than 13 h cannot hold that gap (said, passed). */
START_TEST(test_resume_after_capped_lease)
{
    fake_run f;
    fake_start(&f);
    orch *o = f.o;
    o->hb_ms = 100000, o->dead_ms = 360000000; /* 100 h: the lease is 24 h */
    ck_assert_int_eq(kvm_orch__claim_ttl(o), KVM_STORE_CLAIM_MAX_TTL_MS);
    const double gap = 13 * 3600000.0, now = kvm_now_ms();
    if (now - gap <= 1000) {
        fprintf(stderr, "resume_after_capped_lease: up for %.0f s only, not checked\n", now / 1000);
        fake_end(&f);
        return;
    }
    o->last_health = o->last_renew = o->renewed_ok = now - gap;
    kvm_orch__check_health(o);
    ck_assert_msg(o->renewed_ok >= now, "renewed_ok %.0f ms before the check", now - o->renewed_ok);
    ck_assert(o->last_renew == 0); /* renewed at the next chance */
    fake_end(&f);
}
END_TEST

/* A run whose store service stopped answering while it looked again at documents left to
 * other runs: each look waited for a reply, the loop's gaps were taken for pauses of the run,
 * and each "resume" reset the time of the last renewal answered, so the service was never
 * judged down and the run spun for ever. A resume keeps that time when the renewals were
 * failing already before the gap (the outage is older than the pause); otherwise it resets it. */
START_TEST(test_resume_keeps_failing_renewals)
{
    fake_run f;
    fake_start(&f);
    orch *o = f.o;
    const double now = kvm_now_ms();
    if (now <= 10000) {
        fprintf(stderr, "resume_keeps_failing_renewals: up for %.0f s only, not checked\n", now / 1000);
        fake_end(&f);
        return;
    }
    o->renew_failing = 1, o->renewed_ok = now - 5000;
    kvm_orch__resumed(o, 1500, now);
    ck_assert_msg(o->renewed_ok == now - 5000, "renewed_ok moved %.0f ms", o->renewed_ok - (now - 5000));
    o->renew_failing = 0;
    kvm_orch__resumed(o, 1500, now);
    ck_assert(o->renewed_ok >= now); /* a healthy service is not judged by the pause's length */
    fake_end(&f);
}
END_TEST

/* A store service stand-in on ep: answers every claim "held" by another host's run, with the
 * holder's expiry (expires > 0, revision 12) or without it (0, a revision-11 service). */
typedef struct fake_svc {
    char ep[4400];
    int64_t expires;
    volatile int bound, stop;
} fake_svc;

static void *fake_svc_main(void *arg)
{
    fake_svc *f = arg;
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    int linger = 0, to = 100;
    zmq_setsockopt(r, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(r, ZMQ_RCVTIMEO, &to, sizeof to);
    f->bound = zmq_bind(r, f->ep) == 0 ? 1 : -1;
    while (!f->stop) {
        kvm_msg *env = NULL, *body = NULL;
        kvm_proto_claim c;
        if (!kvm_serve_recv_routed(r, 0, &env, &body) && body && kvm_proto_claim_decode(body, &c) == 0) {
            kvm_proto_store_reply rep = {.request_id = c.request_id,
                                         .claim = kvm_proto_str_c("held"),
                                         .holder = kvm_proto_str_c("run:elsewhere:7:1"),
                                         .holder_host = kvm_proto_str_c("elsewhere"),
                                         .holder_expires_ms = f->expires};
            kvm_msg *m = NULL;
            if (!kvm_proto_store_reply_encode(&rep, &m) && !kvm_msg_join(env, &m)) kvm_msg_send(r, &env, 0);
            kvm_msg_free(&m);
        }
        kvm_msg_free(&env);
        kvm_msg_free(&body);
    }
    zmq_close(r);
    zmq_ctx_term(ctx);
    return NULL;
}

/* A document the store service says another run holds is left to it. A revision-12 service
 * names the claim's expiry, so the run watches the document (rechecked, taken over when the
 * claim lapses: _i = 1); a revision-11 service does not, and the document stays counted
 * claimed, unwatched, so that the run can end (_i = 0: it waited for nothing for ever if it
 * watched a claim whose renewals it cannot see). */
START_TEST(test_left_service_revisions)
{
    const int rev12 = _i == 1;
    fake_svc fs = {.expires = rev12 ? 1796000000000 : 0};
    snprintf(fs.ep, sizeof fs.ep, "ipc://%s/svc", tmp);
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, fake_svc_main, &fs), 0);
    for (int i = 0; i < 5000 && !fs.bound; i++)
        usleep(1000);
    ck_assert_int_eq(fs.bound, 1);
    fake_run f;
    fake_start(&f);
    orch *o = f.o;
    kvm_storecli_keys none = {0};
    ck_assert_msg(kvm_storecli_open(&none, fs.ep, &o->cli) == 0, "%s", kvm_errmsg());
    snprintf(o->owner, sizeof o->owner, "run:here:1:1");
    snprintf(o->host, sizeof o->host, "here");
    ck_assert_int_eq(kvm_orch__claim_job(o, &o->jobs[0]), 1);
    ck_assert_int_eq(o->sum->claimed, 1);
    ck_assert_int_eq(o->jobs[0].state, J_SKIPPED);
    ck_assert_int_eq(o->left_watch, rev12);
    ck_assert_int_eq(o->n_left, rev12);
    kvm_storecli_close(&o->cli);
    free(o->left_idx);
    o->left_idx = NULL;
    fake_end(&f);
    fs.stop = 1;
    pthread_join(th, NULL);
}
END_TEST

/* A run killed with kill -9 after storing its documents left claims that no rerun took over
 * (the documents were stored: skipped), and `kvmill store claims` listed them for ever, lapsed.
 * A run now releases, at its end, the claims of runs of this host that are gone; another
 * host's claim stays. */
START_TEST(test_dead_runs_claims_released)
{
    make_docs(2);
    write_config("method = streaming\nbudget = 32", store, "heartbeat_ms = 100\nliveness = 20");
    char *out = NULL, *err = NULL;
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    keys ks = {.n = 0};
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(store, NULL, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, collect_key, &ks), 0);
    ck_assert_int_eq(ks.n, 2);
    pid_t gone = fork(); /* a pid that is not running: a child that exited and was reaped */
    ck_assert_int_ge(gone, 0);
    if (gone == 0) _exit(0);
    ck_assert_int_eq(waitpid(gone, NULL, 0), gone);
    char host[64] = "", dead[192], other[192];
    ck_assert_int_eq(gethostname(host, sizeof host - 1), 0);
    char self[96]; /* this boot and pid namespace ("B...N...T"), the gone pid's start made up */
    kvm_rundir_proc_id((long)getpid(), self, sizeof self);
    char *t = strrchr(self, 'T');
    ck_assert_ptr_nonnull(t);
    t[1] = '\0';
    snprintf(dead, sizeof dead, "run:%.48s:%ld:%lld:%s1", host, (long)gone, (long long)time(NULL) * 1000, self);
    snprintf(other, sizeof other, "run:elsewhere-%.40s:4242:1:B1N1T1", host);
    int taken = 0;
    ck_assert_int_eq(kvm_store_claim_take(s, &ks.k[0], dead, host, 600000, &taken, NULL), 0);
    ck_assert_int_eq(kvm_store_claim_take(s, &ks.k[1], other, "elsewhere", 600000, &taken, NULL), 0);
    kvm_store_close(&s);
    ck_assert_msg(run_kvmill(&out, &err) == 0, "stderr: %s", err);
    ck_assert_msg(strstr(out, "skipped=2") && strstr(err, "released 1 claim left by 1 run of this host that is gone"),
                  "stdout: %s\nstderr: %s", out, err);
    free(out);
    free(err);
    /* the other host's claim is still listed */
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store claims --store '%s'", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(!strstr(out, dead) && strstr(out, "elsewhere"), "stdout: %s", out);
    free(out);
    free(err);
}
END_TEST

static Suite *orch_recovery_suite(void)
{
    Suite *s = suite_create("orch_recovery");
    struct {
        const char *name;
        const TTest *fn;
        int timeout;
    } cases[] = {{"paused_orchestrator", test_paused_orchestrator, 240},
                 {"dead_local_claimant", test_dead_local_claimant, 120},
                 {"read_failure_json_event", test_read_failure_json_event, 60},
                 {"unreachable_worker_not_the_documents_fault", test_unreachable_worker_not_the_documents_fault, 30},
                 {"stopping_worker_gets_end_of_work", test_stopping_worker_gets_end_of_work, 30},
                 {"job_lost_on_the_wire", test_job_lost_on_the_wire, 30},
                 {"job_run_is_not_lost", test_job_run_is_not_lost, 30},
                 {"earlier_attempts_ack_counts", test_earlier_attempts_ack_counts, 90},
                 {"ack_after_evictions", test_ack_after_evictions, 90},
                 {"evictions_of_older_excuse_nothing", test_evictions_of_older_excuse_nothing, 90},
                 {"left_service_revisions", test_left_service_revisions, 30},
                 {"dead_runs_claims_released", test_dead_runs_claims_released, 120},
                 {"resume_after_capped_lease", test_resume_after_capped_lease, 30},
                 {"resume_keeps_failing_renewals", test_resume_keeps_failing_renewals, 30},
                 {"doc_changed_during_run", test_doc_changed_during_run, 240},
                 {"worker_with_another_store", test_worker_with_another_store, 120},
                 {"hand_worker_clean_stop", test_hand_worker_clean_stop, 120},
                 {"hand_worker_grace_over", test_hand_worker_grace_over, 120},
                 {"hand_worker_duplicate_id", test_hand_worker_duplicate_id, 300},
                 {"hand_worker_restarted", test_hand_worker_restarted, 300},
                 {"left_documents_rechecked", test_left_documents_rechecked, 120},
                 {"left_recheck_bounded", test_left_recheck_bounded, 120},
                 {"left_wait_says_lapse", test_left_wait_says_lapse, 120}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, cases[i].timeout);
        if (cases[i].fn == test_earlier_attempts_ack_counts || cases[i].fn == test_ack_after_evictions ||
            cases[i].fn == test_left_service_revisions)
            tcase_add_loop_test(tc, cases[i].fn, 0, 2); /* _i: stored / evicted since the send, or not */
        else
            tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(orch_recovery_suite()); }
