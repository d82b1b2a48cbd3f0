/* check_storesvc_runs.c: whole runs whose store is reachable only through the store service
 * (`[store] path = tcp://...`, protocol revision 6): two runs sharing one service compress
 * every document once (claims over the wire, every cache stored, one commit per document); a
 * run killed with SIGKILL leaves claims that the next run on its host takes over at once, as a
 * run on the store's host does; settings that cannot work with a remote store
 * are refused before anything starts; a decode worker on another host runs polykv with the
 * strategy it fetches from the service and answers as a local one; a strategy recalibrated
 * while a remote compress worker lives reaches its next job; kvmill serve starts, restarts and
 * stops the store service ([store] service_bind); documents left to other runs are looked at
 * again through the service (protocol revision 12); a run whose [store] path is a kvmill serve
 * front end says so at once; a run hosting the service ([store] service_bind) keeps it up for a
 * run storing through it until that run's claims are released or lapse. The service is
 * `kvmill store serve` on loopback TCP, or the hosting run's. */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_storecli.h"
#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

static char *tmp, docs[4200], store[4200];
static int port;

/* 5 documents of the embedded corpus. */
static void setup(void)
{
    tmp = kvm_test_tmpdir();
    snprintf(docs, sizeof docs, "%s/docs", tmp);
    snprintf(store, sizeof store, "%s/store.lmdb", tmp);
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
    port = kvm_test_tcp_port(2);
}

static void teardown(void)
{
    kvm_test_rmtree(tmp);
    free(tmp);
}

static pid_t spawn_sh(const char *cmd)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        setpgid(0, 0); /* its own group: a kill reaches the run, never this test */
        /* a failed assertion ends the test before its service_stop: the service (exec'd by sh,
         * which keeps this setting) ends with it instead of holding its port for ever */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* The config of run `name` (its own run directory), the store being the service on port;
 * liveness sets the claims' lease (heartbeat_ms 100 x liveness). Returns the path (static). */
static const char *run_config(const char *name, int liveness, const char *extra)
{
    static char path[4300];
    char text[8192];
    snprintf(path, sizeof path, "%s/%s.ini", tmp, name);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = sculpt\nqueries = 64\niterations = 40\n"
             "rounds = 2\n[store]\npath = tcp://127.0.0.1:%d\n[run]\nheartbeat_ms = 100\nliveness = %d\n"
             "run_dir = %s/%s.run\n[stages]\nbin_dir = %s\n%s",
             kvm_test_data_path("models/stories260K.bin"), port, liveness, tmp, name, kvm_test_bin(), extra ? extra : "");
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    return path;
}

/* `kvmill store serve` of store st on port p with the extra arguments args ("" or e.g. --config F),
 * its stdout in tmp/NAME.out, stderr in tmp/NAME.err; waits for "ready". */
static pid_t service_start_at(const char *st, int p, const char *args, const char *name)
{
    char cmd[12000], outp[4300];
    snprintf(outp, sizeof outp, "%s/%s.out", tmp, name);
    snprintf(cmd, sizeof cmd,
             "exec '%s/kvmill' store serve --create --store '%s' --bind tcp://127.0.0.1:%d %s >'%s' 2>>'%s/%s.err'",
             kvm_test_bin(), st, p, args, outp, tmp, name);
    pid_t pid = spawn_sh(cmd);
    for (int i = 0; i < 1000; i++, usleep(10000)) {
        char *o = kvm_test_read_file(outp, NULL);
        int ready = o && strstr(o, "kvmill-store: ready on");
        free(o);
        if (ready) return pid;
    }
    ck_abort_msg("the store service did not start");
    return -1;
}

/* `kvmill store serve` on the test's port, its stderr in tmp/store.err; waits for "ready". */
static pid_t service_start(void) { return service_start_at(store, port, "", "store"); }

static void service_stop(pid_t pid)
{
    kill(pid, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
}

/* `kvmill run` of config cfg over the documents in folder corpus in the background,
 * stdout/stderr in tmp/NAME.out, .err. */
static pid_t run_start_corpus(const char *cfg, const char *name, const char *corpus)
{
    char cmd[16000];
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill' run --config '%s' --corpus '%s' >'%s/%s.out' 2>'%s/%s.err'",
             kvm_test_bin(), cfg, corpus, tmp, name, tmp, name);
    return spawn_sh(cmd);
}

/* `kvmill run` of config cfg over the 5 documents, as run_start_corpus. */
static pid_t run_start(const char *cfg, const char *name) { return run_start_corpus(cfg, name, docs); }

/* Waits for process pid (spawn_sh); returns its exit status (-1 when it did not end within s
 * seconds: then its group is killed). */
static int run_wait_s(pid_t pid, int s)
{
    int st = 0;
    for (int i = 0; i < s * 100; i++, usleep(10000))
        if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    kill(-pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

/* Waits for a run; returns its exit status (-1 when it did not end within 240 s). */
static int run_wait(pid_t pid) { return run_wait_s(pid, 240); }

static char *slurp(const char *name)
{
    char p[4300];
    snprintf(p, sizeof p, "%s/%s", tmp, name);
    char *t = kvm_test_read_file(p, NULL);
    return t ? t : strdup("");
}

static long long summary_value(const char *out, const char *key)
{
    const char *s = strstr(out, "summary: ");
    char k[64];
    snprintf(k, sizeof k, " %s=", key);
    const char *p = s ? strstr(s, k) : NULL;
    ck_assert_msg(p, "no %s in: %s", key, out);
    return atoll(p + strlen(k));
}

static int count(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p++) n++;
    return n;
}

/* Two runs on (what would be) two hosts, started together, both reaching the store only through
 * one store service: between them every document is compressed once (the service commits 5
 * caches, no more), each run's summary adds up (compressed + skipped + claimed = 5), and a
 * third run afterwards finds every cache stored through the service's probe. */
START_TEST(test_two_runs_one_service)
{
    pid_t svc = service_start();
    /* 10 s leases (liveness 100): a run stalled for 2 s on a loaded machine would otherwise see the
     * other take its claims over, and a document compressed twice is no defect of the runs */
    pid_t a = run_start(run_config("a", 100, NULL), "a"), b = run_start(run_config("b", 100, NULL), "b");
    int ra = run_wait(a), rb = run_wait(b);
    char *oa = slurp("a.out"), *ea = slurp("a.err"), *ob = slurp("b.out"), *eb = slurp("b.err");
    ck_assert_msg(ra == 0 && rb == 0, "run a exit %d:\n%s\nrun b exit %d:\n%s", ra, ea, rb, eb);
    ck_assert_msg(strstr(ea, "this run opens no LMDB"), "%s", ea);
    long long ca = summary_value(oa, "compressed"), cb = summary_value(ob, "compressed");
    ck_assert_int_eq(summary_value(oa, "failed") + summary_value(ob, "failed"), 0);
    ck_assert_msg(ca + cb == 5, "compressed %lld + %lld\n%s\n%s", ca, cb, oa, ob);
    ck_assert_int_eq(ca + summary_value(oa, "skipped") + summary_value(oa, "claimed"), 5);
    ck_assert_int_eq(cb + summary_value(ob, "skipped") + summary_value(ob, "claimed"), 5);
    ck_assert_msg(summary_value(oa, "bytes_compressed") > 0 || ca == 0, "%s", oa);
    free(oa); free(ea); free(ob); free(eb);
    pid_t c = run_start(run_config("c", 20, NULL), "c");
    ck_assert_int_eq(run_wait(c), 0);
    char *oc = slurp("c.out");
    ck_assert_msg(strstr(oc, "summary: compressed=0 skipped=5 failed=0"), "%s", oc);
    free(oc);
    service_stop(svc);
    char *sl = slurp("store.err");
    ck_assert_msg(count(sl, "committed job") == 5, "the service committed %d caches:\n%s", count(sl, "committed job"), sl);
    free(sl);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
}
END_TEST

/* A run killed with SIGKILL after its first commit leaves claims on the documents it was
 * working on (a 10 s lease: heartbeat 100 ms x liveness 100). The next run, on the same host,
 * finds their owner's process gone and takes them over through the service at once ("... which
 * is no longer running: taking it over"): it used to leave them to the dead run (claimed, exit 0)
 * until the lease lapsed. Every document is stored, and a third run finds them all. */
START_TEST(test_dead_run_claims_taken_over)
{
    pid_t svc = service_start();
    char slog[4300];
    snprintf(slog, sizeof slog, "%s/store.err", tmp);
    pid_t d = run_start(run_config("d", 100, NULL), "d");
    int killed = 0;
    for (int i = 0; i < 24000 && !killed; i++, usleep(10000)) {
        char *l = kvm_test_read_file(slog, NULL);
        if (l && strstr(l, "committed job")) killed = kill(-d, SIGKILL) == 0; /* the run and its stages */
        free(l);
    }
    ck_assert_msg(killed, "run d never committed a cache");
    waitpid(d, NULL, 0);
    pid_t e = run_start(run_config("e", 20, NULL), "e");
    ck_assert_int_eq(run_wait(e), 0);
    char *oe = slurp("e.out"), *ee = slurp("e.err");
    long long held = summary_value(oe, "claimed"), done_e = summary_value(oe, "compressed"),
              skipped = summary_value(oe, "skipped");
    ck_assert_msg(held == 0 && summary_value(oe, "failed") == 0, "documents left to the dead run:\n%s\n%s", oe, ee);
    ck_assert_msg(strstr(ee, "which is no longer running: taking it over"), "%s", ee);
    ck_assert_int_eq(done_e + skipped, 5);
    free(oe);
    free(ee);
    pid_t f = run_start(run_config("f", 50, NULL), "f");
    ck_assert_int_eq(run_wait(f), 0);
    char *of = slurp("f.out");
    ck_assert_msg(strstr(of, "summary: compressed=0 skipped=5 failed=0"), "%s", of);
    free(of);
    service_stop(svc);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
}
END_TEST

/* SIGKILLs store service svc (service_start) once its log says it committed a cache, and reaps it. */
static void kill_at_first_commit(pid_t svc)
{
    char slog[4300];
    snprintf(slog, sizeof slog, "%s/store.err", tmp);
    int killed = 0;
    for (int i = 0; i < 24000 && !killed; i++, usleep(10000)) {
        char *l = kvm_test_read_file(slog, NULL);
        if (l && strstr(l, "committed job")) killed = kill(svc, SIGKILL) == 0;
        free(l);
    }
    ck_assert_msg(killed, "the service never committed a cache");
    waitpid(svc, NULL, 0);
}

/* The store service SIGKILLed after the first commit and not started again: the run stops
 * feeding documents at the first claim or upload that gets no reply, or once its claims'
 * renewals have had no reply for longer than the lease (2 s here), abandons the jobs in
 * workers and exits 1 with the rest counted not processed ("store down:"), none failed. It used
 * to compress every document anyway, each upload waiting out 3 x upload_timeout_ms and each
 * job requeued up to max_retries times (with the defaults, hours for a small corpus), and then
 * to wait for the workers' uploads (3 x the default 60 s). Started again, the service takes
 * the rest from the next run. */
START_TEST(test_service_down_mid_run)
{
    pid_t svc = service_start();
    pid_t d = run_start(run_config("d", 20, NULL), "d"); /* the default upload_timeout_ms (60 s) */
    kill_at_first_commit(svc);
    time_t t_kill = time(NULL);
    int rd = run_wait(d);
    long waited = (long)(time(NULL) - t_kill); /* lease 2 s + 2 s to stop the workers; one upload's wait is 60 s */
    char *od = slurp("d.out"), *ed = slurp("d.err");
    size_t ne = strlen(ed); /* the end of stderr: check's messages are bounded */
    const char *tail = ne > 3000 ? ed + ne - 3000 : ed;
    ck_assert_msg(rd == 1, "exit %d:\n%.3000s\n%s", rd, od, tail);
    ck_assert_msg(waited < 45, "the run took %ld s to end after the service died:\n%s", waited, tail);
    ck_assert_msg(strstr(ed, "the store service does not answer: feeding no more documents"), "%s", tail);
    ck_assert_msg(strstr(od, "store down: ") && summary_value(od, "failed") == 0 && summary_value(od, "compressed") < 5,
                  "%.3000s", od);
    /* the sizes were not asked of the dead service: unknown, not 0 (one cache was committed) */
    ck_assert_msg(summary_value(od, "compressed") == 0 ||
                      (strstr(od, " bytes_full=unknown bytes_compressed=unknown ") && strstr(od, " evicted=unknown ") &&
                       strstr(od, "bytes: unknown")),
                  "%.3000s", od);
    /* the outage is said once by the renewals in the loop (they came every 500 ms, each said
     * twice), plus the final release's one short try */
    ck_assert_msg(count(ed, "no reply to renew_claims") <= 2, "%d lines: %s", count(ed, "no reply to renew_claims"), tail);
    /* no claim is tried after the one that found it down (each costs 2 timeouts), nor is it
     * asked for the stored sizes at the end */
    ck_assert_msg(count(ed, "no reply to claim") <= 2, "%d lines: %s", count(ed, "no reply to claim"), tail);
    ck_assert_msg(!strstr(ed, "could not read the stored sizes"), "%s", tail);
    free(od);
    free(ed);
    svc = service_start();
    pid_t e = run_start(run_config("e", 20, NULL), "e");
    ck_assert_int_eq(run_wait(e), 0);
    char *oe = slurp("e.out");
    ck_assert_msg(summary_value(oe, "compressed") + summary_value(oe, "skipped") == 5 && !strstr(oe, "store down"), "%s", oe);
    free(oe);
    service_stop(svc);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
}
END_TEST

/* The service's data.mdb damaged (cut to its two meta pages) after the first commit, the service
 * running on: every claim, probe and upload is refused as "data.mdb is damaged". The run went
 * on claiming ("compressing it anyway"), compressing and failing each document, and its
 * renewals' refusals ended as "store down ... start it", though the service answered. It now
 * stops feeding at the first such refusal and says the store is damaged (exit 1, the rest
 * counted not processed, none failed); a run started on the damaged store stops at its first
 * probe, compressing nothing. */
START_TEST(test_service_store_damaged)
{
    pid_t svc = service_start();
    /* slow documents (400 iterations, 4 rounds: tenths of a second each, not hundredths), so
     * that the cut comes before the last ones are committed */
    char cfg[4300], text[8192];
    snprintf(cfg, sizeof cfg, "%s/d.ini", tmp);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = sculpt\nqueries = 64\niterations = 400\n"
             "rounds = 4\nround_tolerance = 0\n[store]\npath = tcp://127.0.0.1:%d\n[run]\nheartbeat_ms = 100\n"
             "liveness = 20\nrun_dir = %s/d.run\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), port, tmp, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    pid_t d = run_start(cfg, "d");
    char slog[4300], data[4300];
    snprintf(slog, sizeof slog, "%s/store.err", tmp);
    snprintf(data, sizeof data, "%s/data.mdb", store);
    int cut = 0;
    for (int i = 0; i < 24000 && !cut; i++, usleep(10000)) {
        char *l = kvm_test_read_file(slog, NULL);
        if (l && strstr(l, "committed job")) cut = truncate(data, 8192) == 0;
        free(l);
    }
    ck_assert_msg(cut, "the service never committed a cache");
    int rd = run_wait(d);
    char *od = slurp("d.out"), *ed = slurp("d.err");
    size_t ne = strlen(ed);
    const char *tail = ne > 3000 ? ed + ne - 3000 : ed;
    ck_assert_msg(rd == 1, "exit %d:\n%.3000s\n%s", rd, od, tail);
    ck_assert_msg(strstr(ed, "data.mdb is damaged: feeding no more documents") && !strstr(ed, "compressing it anyway"),
                  "%s", tail);
    ck_assert_msg(strstr(od, "store damaged: ") && !strstr(od, "store down") && summary_value(od, "failed") == 0 &&
                      summary_value(od, "not_processed") > 0,
                  "%.3000s", od);
    free(od);
    free(ed);
    pid_t e = run_start(run_config("e", 20, NULL), "e");
    int re = run_wait(e);
    char *oe = slurp("e.out"), *ee = slurp("e.err");
    ck_assert_msg(re == 1 && strstr(ee, "data.mdb is damaged") && !strstr(ee, "compressing it anyway") &&
                      !strstr(oe, "compressed=1"),
                  "exit %d:\n%s\n%.3000s", re, oe, ee);
    free(oe);
    free(ee);
    service_stop(svc);
}
END_TEST

/* A cache a run committed through the store service and removed before the run's end (store rm
 * here; a store compact's copy swapped in meanwhile alike) was reported as "evicted: 1 caches by
 * the store's cap ([store] cap_mb)" from a store that has no cap: the run only sees that the
 * service no longer holds it. It says so now, naming the cap as one cause among others. */
START_TEST(test_remote_missing_not_cap)
{
    pid_t svc = service_start();
    pid_t d = run_start(run_config("d", 20, NULL), "d");
    char slog[4300];
    snprintf(slog, sizeof slog, "%s/store.err", tmp);
    int stopped = 0;
    for (int i = 0; i < 24000 && !stopped; i++, usleep(10000)) {
        char *l = kvm_test_read_file(slog, NULL);
        if (l && strstr(l, "committed job")) stopped = kill(d, SIGSTOP) == 0; /* no end-of-run probe meanwhile */
        free(l);
    }
    ck_assert_msg(stopped, "the service never committed a cache");
    char cmd[9000], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --csv --store '%s'", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    char *row = strchr(out, '\n');
    ck_assert_msg(row && row[1], "no cache listed: %s", out);
    char key[200];
    snprintf(key, sizeof key, "%.64s:%.64s:%.64s", row + 1, row + 66, row + 131);
    free(out), free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store rm --store '%s' '%s'", kvm_test_bin(), store, key);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "%s: exit %d: %s", cmd, rc, err);
    free(out), free(err);
    kill(d, SIGCONT);
    int rd = run_wait(d);
    char *od = slurp("d.out");
    ck_assert_msg(rd == 0 && summary_value(od, "evicted") == 1 &&
                      strstr(od, "evicted: 1 cache written by this run is no longer in the store service's store") &&
                      !strstr(od, "by the store's cap"),
                  "exit %d:\n%s", rd, od);
    free(od);
    service_stop(svc);
}
END_TEST

/* The store service SIGKILLed after the first commit and the run interrupted (Ctrl-C) a moment
 * later: the run printed both "interrupted: N documents were not processed" and "store down: N
 * documents were not processed" for the same N documents. One line gives the count
 * (not_processed=N): the store's, what a rerun must fix first. */
START_TEST(test_interrupted_and_store_down_one_line)
{
    pid_t svc = service_start();
    pid_t d = run_start(run_config("d", 20, NULL), "d");
    kill_at_first_commit(svc);
    usleep(300000);
    kill(d, SIGINT);
    int rd = run_wait(d);
    char *od = slurp("d.out");
    const int lines = count(od, " not processed (");
    ck_assert_msg(rd > 0 && lines == 1 && strstr(od, "store down: ") && summary_value(od, "not_processed") > 0,
                  "exit %d, %d lines:\n%s", rd, lines, od);
    free(od);
}
END_TEST

/* With a remote store: [store] service_bind (the service belongs to the store's host) and
 * kvmill calibrate (it stores the strategy) are refused with exit 2 and a reason (service_bind by
 * kvmill serve too); a polykv run
 * without a strategy on the service names the model and the strategy. Nothing is stored. */
START_TEST(test_remote_store_refusals)
{
    pid_t svc = service_start();
    char cmd[16000], *out = NULL, *err = NULL;
    const char *cfg = run_config("g", 20, "[store]\nservice_bind = tcp://127.0.0.1:1\n");
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, docs);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "only the store's host serves it"), "%s", err);
    free(out); free(err);
    /* serve ignored service_bind with a remote store ([store] path = tcp://... or --store
     * tcp://...) and started no service: refused as run refuses it */
    for (int i = 0; i < 2; i++) {
        char store_flag[64] = "";
        if (i) snprintf(store_flag, sizeof store_flag, " --store tcp://127.0.0.1:%d", port);
        snprintf(cmd, sizeof cmd, "timeout 20 '%s/kvmill' serve --config '%s' --workers 0 --bind ipc://%s/front%s",
                 kvm_test_bin(), cfg, tmp, store_flag);
        int st = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(st == 2 && strstr(err, "kvmill serve: ") && strstr(err, "only the store's host serves it"),
                      "exit %d: %s", st, err);
        free(out); free(err);
    }
    cfg = run_config("h", 20, "[compress]\nbudget = 48\n");
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg, docs);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "is a store service: kvmill calibrate"), "%s", err);
    free(out); free(err);
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n"
             "[store]\npath = tcp://127.0.0.1:%d\nupload_timeout_ms = 2000\n[run]\nrun_dir = %s/p.run\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), port, tmp, kvm_test_bin());
    char path[4300];
    snprintf(path, sizeof path, "%s/p.ini", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), path, docs);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "no PolyKV strategy 'default' is stored for model"), "%s", err);
    free(out); free(err);
    service_stop(svc);
    ck_assert_int_eq(kvm_test_store_caches(store), 0);
}
END_TEST

/* [store] path = the tcp:// endpoint of a kvmill serve front end, not of a store service:
 * serve answered every claim ("unexpected claim message: this server answers ask"), yet the
 * run skipped those answers, waited out two 5 s attempts and said "no reply to claim ... is
 * kvmill store serve running". It now fails at once, naming the mix-up, as kvmill ask names
 * the opposite one. */
START_TEST(test_store_is_serve_front_end)
{
    kvm_store *st = NULL;
    kvm_store_opts so = {.no_sync = 1};
    ck_assert_msg(kvm_store_open(store, &so, &st) == 0, "%s", kvm_errmsg()); /* serve's own store */
    kvm_store_close(&st);
    char text[8192], cfg[4300], cmd[16000], outp[4300];
    snprintf(cfg, sizeof cfg, "%s/front.ini", tmp);
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 128\n[store]\npath = %s\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(outp, sizeof outp, "%s/front.log", tmp);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill' serve --config '%s' --workers 0 --bind tcp://127.0.0.1:%d >'%s' 2>&1",
             kvm_test_bin(), cfg, port, outp);
    pid_t sp = spawn_sh(cmd);
    int ready = 0;
    for (int i = 0; i < 3000 && !ready; i++, usleep(10000)) {
        char *o = kvm_test_read_file(outp, NULL);
        ready = o && strstr(o, "ready: front end");
        free(o);
    }
    ck_assert_msg(ready, "kvmill serve did not get ready");
    char *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), run_config("f", 50, NULL),
             docs);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int rc = kvm_test_run(cmd, &out, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    kill(sp, SIGTERM);
    waitpid(sp, NULL, 0);
    char want[256];
    snprintf(want, sizeof want, "tcp://127.0.0.1:%d is a kvmill serve front end (it answers ask", port);
    ck_assert_msg(rc != 0 && strstr(err, want) && strstr(err, "not a store service (kvmill store serve)") &&
                      !strstr(err, "no reply"),
                  "exit %d: %s", rc, err);
    /* one attempt waits 5 s for a reply here (heartbeat_ms 100 x liveness 50) */
    ck_assert_msg(secs < 4.0, "the run took %.1f s: it waited for a reply", secs);
    free(out);
    free(err);
    ck_assert_int_eq(kvm_test_store_caches(store), 0);
}
END_TEST

/* Starts `kvmill serve` of config cfg with `workers` decode workers (0: the remote one below);
 * returns its pid and copies its front and back end into fe, be once it says ready. With
 * workers = 0 a kvmill-decode started by hand with --store tcp://... (the store service; no
 * LMDB opened) joins; *dec gets its pid. */
static pid_t serve_start(const char *cfg, int workers, char *fe, char *be, pid_t *dec)
{
    char cmd[16000], outp[4300];
    snprintf(outp, sizeof outp, "%s/serve-%d.log", tmp, workers);
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill' serve --config '%s' --workers %d --bind tcp://127.0.0.1:0 >'%s' 2>&1",
             kvm_test_bin(), cfg, workers, outp);
    pid_t pid = spawn_sh(cmd);
    *dec = 0;
    for (int i = 0; i < 3000; i++, usleep(10000)) {
        char *o = kvm_test_read_file(outp, NULL);
        const char *r = o ? strstr(o, "ready: front end ") : NULL, *b = r ? strstr(r, "back end ") : NULL;
        int joined = o && strstr(o, "joined");
        if (b && !*dec && workers == 0) {
            sscanf(b + 9, "%1023s", be);
            snprintf(cmd, sizeof cmd,
                     "exec '%s/kvmill-decode' --connect '%s' --config '%s' --store tcp://127.0.0.1:%d --heartbeat-ms 100 "
                     "--id dec 2>'%s/decode.err'",
                     kvm_test_bin(), be, cfg, port, tmp);
            *dec = spawn_sh(cmd);
        }
        if (r && joined) {
            sscanf(r + 17, "%1023[^,]", fe);
            free(o);
            return pid;
        }
        free(o);
    }
    char *o = slurp(workers ? "serve-1.log" : "serve-0.log"), *d = slurp("decode.err");
    ck_abort_msg("serve did not get ready:\n%s\ndecode worker:\n%s", o, d);
    return -1;
}

static char *ask(const char *fe)
{
    char cmd[16000], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' ask --connect '%s' --doc '%s/doc_002.txt' --prompt 'Then the' -n 24 --timeout 60",
             kvm_test_bin(), fe, docs);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && out && *out, "ask exit %d: %s\n%s", rc, out, err);
    free(err);
    return out;
}

/* PolyKV on a decode worker on another host: a remote kvmill-decode (its store the service)
 * fetches the calibrated strategy with get_strategy, finds the cache under the config id that
 * strategy gives, decodes with its decode-phase patterns, and answers exactly what a decode
 * worker on the store's host answers. */
START_TEST(test_remote_decode_polykv)
{
    char text[8192], cfg[4300], cmd[16000], *out = NULL, *err = NULL;
    snprintf(cfg, sizeof cfg, "%s/polykv.ini", tmp);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 32\n[store]\npath = %s\n"
             "upload_timeout_ms = 5000\n[run]\nheartbeat_ms = 100\nliveness = 20\nrun_dir = %s/p.run\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store, tmp, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg, docs);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "calibrate: %s\n%s", out, err);
    free(out); free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, docs);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "run: %s\n%s", out, err);
    free(out); free(err);
    pid_t svc = service_start(), dec = 0;
    char fe[1100], be[1100];
    pid_t sp = serve_start(cfg, 0, fe, be, &dec);
    char *remote = ask(fe);
    kill(sp, SIGTERM), waitpid(sp, NULL, 0);
    kill(dec, SIGTERM), waitpid(dec, NULL, 0);
    char *de = slurp("decode.err"), *so = slurp("serve-0.log");
    ck_assert_msg(strstr(so, "external decode worker dec joined"), "%s", so);
    ck_assert_msg(!strstr(de, "run this worker on the store's host"), "%s", de);
    free(de); free(so);
    service_stop(svc);
    sp = serve_start(cfg, 1, fe, be, &dec);
    char *local = ask(fe);
    kill(sp, SIGTERM), waitpid(sp, NULL, 0);
    ck_assert_msg(!strcmp(remote, local), "remote answer '%s' differs from the local '%s'", remote, local);
    free(remote); free(local);
}
END_TEST

/* A folder tmp/NAME with documents first..last of the test corpus; returns its path (static). */
static const char *subset(const char *name, int first, int last)
{
    static char dir[4300];
    snprintf(dir, sizeof dir, "%s/%s", tmp, name);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    for (int i = first; i <= last; i++) {
        char src[4300], dst[4400];
        snprintf(src, sizeof src, "%s/doc_%03d.txt", docs, i);
        snprintf(dst, sizeof dst, "%s/doc_%03d.txt", dir, i);
        size_t n;
        char *t = kvm_test_read_file(src, &n);
        ck_assert_int_eq(kvm_test_write_file(dst, t, n), 0);
        free(t);
    }
    return dir;
}

static void run_ok(const char *what, const char *cfg, const char *dir)
{
    char cmd[16000], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' %s --config '%s' %s '%s'", kvm_test_bin(), what, cfg,
             strcmp(what, "calibrate") ? "--corpus" : "--docs", dir);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "kvmill %s exit %d: %s\n%s", what, rc, out, err);
    free(out); free(err);
}

/* A strategy recalibrated while a remote compress worker lives reaches it: the worker (its
 * store the service, started by hand, serving two runs in turn) compresses the first run with
 * strategy A; after kvmill calibrate stores B, its next job fetches B, so the second run's
 * caches are `ok` under B's config id and only the first run's are `stale-strategy`. (Budget
 * 16: at 32 both calibrations give the last layer the whole context, capped, and the rest
 * b_min: A and B are the same strategy.) */
START_TEST(test_recalibration_reaches_remote_worker)
{
    char text[8192], cfg[4300], cmd[16000];
    snprintf(cfg, sizeof cfg, "%s/polykv.ini", tmp);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = polykv\nbudget = 16\n[store]\npath = %s\n"
             "upload_timeout_ms = 5000\n[run]\nheartbeat_ms = 100\nliveness = 20\nrun_dir = %s/r.run\n"
             "[stages]\nbin_dir = %s\ncompress_workers = 0\n",
             kvm_test_data_path("models/stories260K.bin"), store, tmp, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    char c1[4300], c2[4300];
    snprintf(c1, sizeof c1, "%s", subset("c1", 0, 1));
    snprintf(c2, sizeof c2, "%s", subset("c2", 2, 4));
    run_ok("calibrate", cfg, c1); /* strategy A */
    pid_t svc = service_start();
    snprintf(cmd, sizeof cmd, "exec '%s/kvmill-compress' --connect 'ipc://%s/r.run' --store tcp://127.0.0.1:%d "
             "--heartbeat-ms 100 2>'%s/worker.err'", kvm_test_bin(), tmp, port, tmp);
    pid_t w = spawn_sh(cmd);
    run_ok("run", cfg, c1);
    run_ok("calibrate", cfg, c2); /* strategy B, stored on the store's host while the worker lives */
    run_ok("run", cfg, c2);
    kill(w, SIGTERM), waitpid(w, NULL, 0);
    service_stop(svc);
    char *we = slurp("worker.err");
    ck_assert_msg(count(we, "fetched PolyKV strategy 'default'") == 1 && count(we, "was recalibrated") == 1,
                  "worker:\n%s", we);
    free(we);
    char *out = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store ls --csv --config '%s'", kvm_test_bin(), cfg);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_msg(count(out, ",stale-strategy\n") == 2 && count(out, ",ok\n") == 3, "store ls:\n%s", out);
    free(out);
}
END_TEST

/* The pid in "store service on EP (pid N" of log text (0 when none); from the last such line
 * when last is set. */
static long service_pid(const char *log, int last)
{
    long pid = 0;
    for (const char *p = log; (p = strstr(p, "store service on ")); p++) {
        const char *q = strstr(p, "(pid ");
        if (q) pid = atol(q + 5);
        if (!last) break;
    }
    return pid;
}

/* kvmill serve with [store] service_bind starts the store service on the store's host: a
 * decode worker on "another host" (its --store the service) answers from caches it fetches
 * with get_cache; the service SIGKILLed is started again by serve and answers again (the
 * same answer); serve stops it when it exits. */
START_TEST(test_serve_starts_store_service)
{
    char text[8192], cfg[4300], cfg2[4300];
    snprintf(cfg, sizeof cfg, "%s/s.ini", tmp);
    snprintf(cfg2, sizeof cfg2, "%s/s2.ini", tmp);
    int n = snprintf(text, sizeof text,
                     "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = snapkv\nbudget = 32\n[store]\npath = %s\n"
                     "upload_timeout_ms = 5000\n[run]\nheartbeat_ms = 100\nliveness = 20\n[stages]\nbin_dir = %s\n",
                     kvm_test_data_path("models/stories260K.bin"), store, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    run_ok("run", cfg, docs);
    snprintf(text + n, sizeof text - (size_t)n, "[store]\nservice_bind = tcp://127.0.0.1:%d\n", port);
    ck_assert_int_eq(kvm_test_write_file(cfg2, text, strlen(text)), 0);
    char fe[1100], be[1100];
    pid_t dec = 0, sp = serve_start(cfg2, 0, fe, be, &dec);
    char *log = slurp("serve-0.log");
    long svc = service_pid(log, 0);
    free(log);
    ck_assert_msg(svc > 0, "serve did not say it started the store service");
    char *first = ask(fe);
    ck_assert_int_eq(kill((pid_t)svc, SIGKILL), 0);
    long svc2 = 0;
    for (int i = 0; i < 1000 && (svc2 == 0 || svc2 == svc); i++, usleep(10000)) {
        log = slurp("serve-0.log");
        if (strstr(log, "the store service exited (signal 9): starting it again")) svc2 = service_pid(log, 1);
        free(log);
    }
    char *sl = slurp("serve-0.log");
    ck_assert_msg(strstr(sl, "the store service exited (signal 9): starting it again"), "%s", sl);
    free(sl);
    usleep(500000); /* the decode worker's connection finds the new service */
    char *again = ask(fe);
    ck_assert_msg(!strcmp(first, again), "after the restart '%s', before '%s'", again, first);
    free(first); free(again);
    kill(sp, SIGTERM), waitpid(sp, NULL, 0);
    kill(dec, SIGTERM), waitpid(dec, NULL, 0);
    /* the restarted service is gone with serve (its pid no longer exists) */
    log = slurp("serve-0.log");
    long last = service_pid(log, 1);
    free(log);
    ck_assert_int_ne(kill((pid_t)svc, 0), 0);
    ck_assert_msg(last == 0 || kill((pid_t)last, 0) != 0, "the store service %ld outlived serve", last);
    char *de = slurp("decode.err");
    ck_assert_msg(!strstr(de, "LMDB"), "%s", de);
    free(de);
}
END_TEST

/* The config of a quick run (streaming) named name on store st (a path or the service), with
 * [store] service_bind = bind unless bind is NULL. */
static const char *quick_config_bind(const char *name, const char *st, const char *bind)
{
    static char path[4300];
    char text[8192];
    snprintf(path, sizeof path, "%s/%s.ini", tmp, name);
    snprintf(
        text, sizeof text,
        "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = streaming\nbudget = 32\n[store]\npath = %s\n"
        "%s%s%s[run]\nheartbeat_ms = 100\nliveness = 20\nrun_dir = %s/%s.run\n[stages]\nbin_dir = %s\nthreads = 1\n",
        kvm_test_data_path("models/stories260K.bin"), st, bind ? "service_bind = " : "", bind ? bind : "",
        bind ? "\n" : "", tmp, name, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    return path;
}

/* The config of a quick run (streaming) named name on store st (a path or the service). */
static const char *quick_config(const char *name, const char *st) { return quick_config_bind(name, st, NULL); }

typedef struct left_keys {
    kvm_store_cache_key k[8];
    int n;
} left_keys;

static int left_key(const kvm_store_cache_key *key, const kvm_store_manifest *m, int status, void *arg)
{
    left_keys *ks = arg;
    if (!status && ks->n < 8) ks->k[ks->n++] = *key;
    return 0;
}

/* A child standing for a live run on this host that holds claims through the service: with
 * renew it renews owner's claims every 100 ms, else it only lives. Returns its pid; *owner
 * gets its claims' owner name. */
static pid_t remote_live_run(int renew, const char *ep, char *owner, size_t n)
{
    char host[64] = "", id[96];
    gethostname(host, sizeof host - 1);
    const long long start_ms = (long long)time(NULL) * 1000; /* one owner name in both processes */
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    long me = pid ? (long)pid : (long)getpid();
    if (pid) usleep(20000); /* its process identity readable (kvm_rundir_proc_id) */
    kvm_rundir_proc_id(me, id, sizeof id);
    snprintf(owner, n, "run:%.48s:%ld:%lld:%s", host, me, start_ms, id);
    if (pid) return pid;
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failed assertion ends the test: so does this stand-in */
    kvm_storecli *c = NULL;
    kvm_storecli_keys none = {0};
    for (;;) {
        usleep(100000);
        if (renew && (c || kvm_storecli_open(&none, ep, &c) == 0))
            kvm_storecli_renew(c, owner, 600000, 0, 1000, 1, NULL);
    }
}

/* A run whose store is the service found documents claimed by other runs, counted them
 * claimed=N and never looked again (the service's claim reply carried no expiry): when their
 * runs died it still exited 0 and they were never stored. The reply now names the holder's
 * expiry (revision 12) and the run rechecks them through the service as on a local store: the
 * one of a run of this host killed meanwhile and the one whose claim lapsed unrenewed (another
 * host's, 8 s) are taken over and compressed; the one of a run that renews its claim is left
 * to it (claimed=1). */
START_TEST(test_left_documents_rechecked_remote)
{
    char doc4[4300], first[4300], ep[64];
    snprintf(doc4, sizeof doc4, "%s/doc_004.txt", docs);
    ck_assert_int_eq(unlink(doc4), 0);
    snprintf(first, sizeof first, "%s/first.lmdb", tmp);
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    ck_assert_int_eq(run_wait(run_start(quick_config("first", first), "first")), 0); /* the cache keys */
    left_keys ks = {.n = 0};
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(first, NULL, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, left_key, &ks), 0);
    kvm_store_close(&s);
    ck_assert_int_eq(ks.n, 4);
    char owners[3][192], host[64] = "";
    ck_assert_int_eq(gethostname(host, sizeof host - 1), 0);
    pid_t doomed = remote_live_run(0, ep, owners[0], sizeof owners[0]);
    pid_t renewing = remote_live_run(1, ep, owners[1], sizeof owners[1]);
    snprintf(owners[2], sizeof owners[2], "run:elsewhere-%.40s:4242:1:B1N1T1", host);
    pid_t svc = service_start();
    kvm_storecli *c = NULL;
    kvm_storecli_keys none = {0};
    ck_assert_msg(kvm_storecli_open(&none, ep, &c) == 0, "%s", kvm_errmsg());
    for (int i = 0; i < 3; i++) { /* the other host's lease lapses in 8 s, unrenewed (b starts well before) */
        kvm_storecli_claim_state st = 0;
        ck_assert_msg(kvm_storecli_claim(c, &ks.k[i], NULL, owners[i], i == 2 ? "elsewhere" : host,
                                         i == 2 ? 8000 : 600000, 0, 5000, 1, &st, NULL) == 0,
                      "%s", kvm_errmsg());
        ck_assert_int_eq(st, KVM_STORECLI_TAKEN);
    }
    kvm_storecli_close(&c);
    pid_t b = run_start(quick_config("b", ep), "b");
    char errp[4300];
    snprintf(errp, sizeof errp, "%s/b.err", tmp);
    for (int i = 0; i < 2400; i++, usleep(50000)) { /* b has done its own document and waits */
        char *e = kvm_test_read_file(errp, NULL);
        int waiting = e && strstr(e, "waiting for the") != NULL;
        free(e);
        if (waiting) break;
    }
    kill(doomed, SIGKILL); /* kill -9 of a run b left a document to */
    waitpid(doomed, NULL, 0);
    int rb = run_wait(b);
    kill(renewing, SIGKILL);
    waitpid(renewing, NULL, 0);
    char *ob = slurp("b.out"), *eb = slurp("b.err");
    ck_assert_msg(rb == 0, "exit %d\nstdout: %s\nstderr: %s", rb, ob, eb);
    ck_assert_msg(summary_value(ob, "compressed") == 3 && summary_value(ob, "claimed") == 1 &&
                      summary_value(ob, "failed") == 0,
                  "stdout: %s\nstderr: %s", ob, eb);
    ck_assert_msg(strstr(eb, "a run which renews its claim: that run stores it") != NULL, "stderr: %s", eb);
    /* the lapsed claim was left first and taken over by a recheck, not taken at b's first claim */
    ck_assert_msg(strstr(eb, "is being compressed by run:elsewhere") && strstr(eb, "whose claim lapsed unrenewed"),
                  "stderr: %s", eb);
    free(ob);
    free(eb);
    service_stop(svc);
    ck_assert_int_eq(kvm_test_store_caches(store), 3);
}
END_TEST

/* A compress worker started by hand (flags args) joined to run r's run directory; its stderr in
 * tmp/NAME.err. Returns its exit status within 60 s (-1: still running, killed). */
static int hand_worker_status(const char *args, const char *name)
{
    char cmd[16000];
    snprintf(cmd, sizeof cmd,
             "exec '%s/kvmill-compress' --connect 'ipc://%s/r.run' --heartbeat-ms 100 %s 2>'%s/%s.err'", kvm_test_bin(),
             tmp, args, tmp, name);
    return run_wait_s(spawn_sh(cmd), 60);
}

/* The end of a run r (compress_workers = 0) after a hand-started worker was refused: a right
 * worker (flags args) stores every document, the run exits 0, no document failed or used an
 * attempt (max_retries = 0), and the run's log names the refusal and why (`why`). */
static void right_worker_finishes(pid_t run, const char *args, const char *why)
{
    char cmd[16000];
    snprintf(cmd, sizeof cmd,
             "exec '%s/kvmill-compress' --connect 'ipc://%s/r.run' --heartbeat-ms 100 %s 2>'%s/good.err'",
             kvm_test_bin(), tmp, args, tmp);
    pid_t good = spawn_sh(cmd);
    int rc = run_wait(run);
    kill(good, SIGTERM), waitpid(good, NULL, 0);
    char *out = slurp("r.out"), *err = slurp("r.err");
    ck_assert_msg(rc == 0 && summary_value(out, "compressed") == 5 && summary_value(out, "failed") == 0,
                  "exit %d\n%s\n%s", rc, out, err);
    ck_assert_msg(count(err, "is refused, no more jobs go to it") == 1 && strstr(err, why), "%s", err);
    free(out), free(err);
}

/* A run whose store is a store service passed every worker's ack on as a commit: a compress
 * worker started by hand with --store naming ANOTHER service made the run count its caches
 * compressed (exit 0) and call them "evicted" at the end, though the run's store never got
 * them. Now such a worker's ack is checked on the run's service (the cache's index entry): the
 * worker is refused (told why: it exits 1), its document goes back without using an attempt,
 * and the right worker stores all five in the run's store. */
START_TEST(test_worker_uploading_elsewhere_refused)
{
    char other[4300], args[4400];
    snprintf(other, sizeof other, "%s/other.lmdb", tmp);
    pid_t svc = service_start(), osvc = service_start_at(other, port + 1, "", "other");
    pid_t run = run_start(run_config("r", 50, "compress_workers = 0\n[run]\nmax_retries = 0\n"), "r");
    snprintf(args, sizeof args, "--store tcp://127.0.0.1:%d", port + 1);
    int bad = hand_worker_status(args, "bad");
    char *be = slurp("bad.err");
    ck_assert_msg(bad == 1 && strstr(be, "refused by run") && strstr(be, "uploads to another store"), "exit %d\n%s",
                  bad, be);
    free(be);
    snprintf(args, sizeof args, "--store tcp://127.0.0.1:%d", port);
    right_worker_finishes(run, args, "holds no cache of it: the worker uploads to another store");
    service_stop(svc), service_stop(osvc);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
    ck_assert_int_eq(kvm_test_store_caches(other), 1);
}
END_TEST

/* Keys kvm_curve_keygen makes as tmp/NAME.public and .secret. */
static void keygen(const char *name)
{
    char prefix[4300];
    snprintf(prefix, sizeof prefix, "%s/%s", tmp, name);
    ck_assert_msg(kvm_curve_keygen(prefix) == 0, "%s", kvm_errmsg());
}

/* A worker's config tmp/NAME.ini: the store service's public key and the key pair NAME (its
 * store connection's keys; the run's local ipc:// endpoint takes none). Returns the path (static). */
static const char *worker_keys(const char *name)
{
    static char path[4300];
    char text[9000];
    snprintf(path, sizeof path, "%s/%s.ini", tmp, name);
    snprintf(text, sizeof text,
             "[model]\npath = %s\n[security]\nserver_public_key = %s/server.public\nclient_public_key = %s/%s.public\n"
             "client_secret_key = %s/%s.secret\n",
             kvm_test_data_path("models/stories260K.bin"), tmp, tmp, name, tmp, name);
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    return path;
}

/* A keyed store service and a run through it (its [security] keys authorized): a compress worker
 * started by hand with a key the service does not list failed every job at the service, and the
 * run took the first failure for the service being down: it stopped feeding documents (exit 1).
 * Now the run, whose own requests are answered, refuses that worker and gives its document back;
 * a worker with the authorized key stores all five. */
START_TEST(test_worker_with_refused_key_refused)
{
    keygen("server"), keygen("client"), keygen("stranger");
    char cmd[16000], sec[12000], svc_cfg[4300], args[9000];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/auth' && cp '%s/client.public' '%s/auth/'", tmp, tmp, tmp);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(sec, sizeof sec,
             "[security]\nserver_secret_key = %s/server.secret\nserver_public_key = %s/server.public\n"
             "authorized_keys = %s/auth\n",
             tmp, tmp, tmp);
    snprintf(svc_cfg, sizeof svc_cfg, "%s/svc.ini", tmp);
    ck_assert_int_eq(kvm_test_write_file(svc_cfg, sec, strlen(sec)), 0);
    snprintf(args, sizeof args, "--config '%s'", svc_cfg);
    pid_t svc = service_start_at(store, port, args, "store");
    snprintf(sec + strlen(sec), sizeof sec - strlen(sec),
             "client_public_key = %s/client.public\nclient_secret_key = %s/client.secret\n[stages]\n"
             "compress_workers = 0\n[run]\nmax_retries = 0\n",
             tmp, tmp);
    pid_t run = run_start(run_config("r", 50, sec), "r");
    snprintf(args, sizeof args, "--store tcp://127.0.0.1:%d --config '%s'", port, worker_keys("stranger"));
    int bad = hand_worker_status(args, "bad");
    char *be = slurp("bad.err");
    ck_assert_msg(bad == 1 && strstr(be, "refused by run") && strstr(be, "rejected this client's key"), "exit %d\n%s",
                  bad, be);
    free(be);
    snprintf(args, sizeof args, "--store tcp://127.0.0.1:%d --config '%s'", port, worker_keys("client"));
    right_worker_finishes(run, args, "rejected this client's key");
    service_stop(svc);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
}
END_TEST

/* A folder tmp/NAME holding copies of the documents doc_00I.txt, I in ids[0, n). Returns its
 * path (static). */
static const char *corpus_of(const char *name, const int *ids, int n)
{
    static char dir[4300];
    snprintf(dir, sizeof dir, "%s/%s", tmp, name);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    for (int i = 0; i < n; i++) {
        char src[4300], dst[4400];
        snprintf(src, sizeof src, "%s/doc_%03d.txt", docs, ids[i]);
        snprintf(dst, sizeof dst, "%s/doc_%03d.txt", dir, ids[i]);
        kvm_test_concat_file(src, NULL, dst);
    }
    return dir;
}

/* A run hosting the store service ([store] service_bind, run a, document doc_000, its store
 * `store`) and a run storing through it (run b, [store] path = the service, doc_001 and
 * doc_002), brought deterministically to the moment a ends while b still works: stand-ins of
 * live runs of this host hold the claims on doc_000 (*s1) and doc_001 (*s2), so a and b each
 * wait for one; b compresses doc_002 (its claim renewed until its end); then *s1 is killed, a
 * takes doc_000 over, stores it, ends, and asks its store service to stop, which stays up for
 * b. Returns once a says so; b still waits for doc_001 (s2 lives). */
static void host_and_dependent_run(pid_t *a, pid_t *b, pid_t *s1, pid_t *s2, int b_liveness)
{
    char first[4300], ep[64], bind[64], host[64] = "", owners[2][192], errp[4300];
    snprintf(first, sizeof first, "%s/first.lmdb", tmp);
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    snprintf(bind, sizeof bind, "tcp://127.0.0.1:%d", port);
    ck_assert_int_eq(gethostname(host, sizeof host - 1), 0);
    const int ids01[] = {0, 1}, id0[] = {0}, ids12[] = {1, 2};
    /* the cache keys of doc_000 and doc_001 in the runs' config (same [compress] and model) */
    ck_assert_int_eq(run_wait(run_start_corpus(quick_config("first", first), "first", corpus_of("c01", ids01, 2))), 0);
    left_keys ks = {.n = 0};
    kvm_store_cache_key key[2];
    kvm_store *s = NULL;
    ck_assert_msg(kvm_store_open(first, NULL, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_store_list_caches(s, NULL, left_key, &ks), 0);
    ck_assert_int_eq(ks.n, 2);
    for (int i = 0; i < 2; i++) {
        kvm_store_doc_meta m;
        ck_assert_int_eq(kvm_store_get_doc(s, &ks.k[i].doc_hash, &m), 0);
        key[strstr(m.source, "doc_000") ? 0 : 1] = ks.k[i];
    }
    kvm_store_close(&s);
    *s1 = remote_live_run(0, ep, owners[0], sizeof owners[0]);
    *s2 = remote_live_run(0, ep, owners[1], sizeof owners[1]);
    ck_assert_msg(kvm_store_open(store, NULL, &s) == 0, "%s", kvm_errmsg());
    for (int i = 0; i < 2; i++) {
        int taken = 0;
        ck_assert_int_eq(kvm_store_claim_take(s, &key[i], owners[i], host, 600000, &taken, NULL), 0);
        ck_assert_int_eq(taken, 1);
    }
    kvm_store_close(&s);
    *a = run_start_corpus(quick_config_bind("a", store, bind), "a", corpus_of("ca", id0, 1));
    snprintf(errp, sizeof errp, "%s/a.err", tmp);
    ck_assert_msg(kvm_test_wait_text(errp, "waiting for the", 1, 120), "run a did not wait for doc_000");
    const char *bcfg = quick_config("b", ep);
    char *text = kvm_test_read_file(bcfg, NULL), *l = text ? strstr(text, "liveness = 20\n") : NULL;
    ck_assert_ptr_nonnull(l);
    char edited[9000]; /* b's lease: heartbeat 100 ms x b_liveness */
    snprintf(edited, sizeof edited, "%.*sliveness = %d\n%s", (int)(l - text), text, b_liveness,
             l + strlen("liveness = 20\n"));
    free(text);
    ck_assert_int_eq(kvm_test_write_file(bcfg, edited, strlen(edited)), 0);
    *b = run_start_corpus(bcfg, "b", corpus_of("cb", ids12, 2));
    snprintf(errp, sizeof errp, "%s/b.err", tmp);
    ck_assert_msg(kvm_test_wait_text(errp, "waiting for the", 1, 120), "run b did not wait for doc_001");
    kill(*s1, SIGKILL); /* a takes doc_000 over and ends */
    waitpid(*s1, NULL, 0);
    snprintf(errp, sizeof errp, "%s/a.err", tmp);
    int said = 0, st = 0;
    for (int i = 0; i < 2400 && !said; i++) { /* a ending without a word took the service away from b */
        said = kvm_test_wait_text(errp, "the store service stays up for ", 1, 0.05);
        if (!said && waitpid(*a, &st, WNOHANG) == *a) {
            kill(*s2, SIGKILL), waitpid(*s2, NULL, 0);
            int rb = -1, sb;
            for (int k = 0; k < 1000 && rb < 0; k++, usleep(20000)) /* b, given doc_001 now, has no store */
                if (waitpid(*b, &sb, WNOHANG) == *b) rb = WIFEXITED(sb) ? WEXITSTATUS(sb) : 128 + WTERMSIG(sb);
            if (rb < 0) kill(-*b, SIGKILL), waitpid(*b, NULL, 0);
            char *ea = slurp("a.err"), *eb = slurp("b.err");
            size_t na = strlen(ea), nb = strlen(eb); /* the ends: check's messages are bounded */
            ck_abort_msg("run a ended (status %d) while b stores through its service: %s\nrun b (exit %d, -1: still "
                         "running after 20 s): %s",
                         WIFEXITED(st) ? WEXITSTATUS(st) : -1, na > 1500 ? ea + na - 1500 : ea, rb,
                         nb > 1500 ? eb + nb - 1500 : eb);
        }
    }
    ck_assert_msg(said, "run a never said its store service stays up for b");
}

/* The run that hosts the store service ([store] service_bind) ended and stopped the service
 * while a run storing through it still held live claims: that run found the store down (exit
 * 1) and its documents were never stored, though the host run had left them to it. The
 * service now stays up for the runs that claim through it; the host run waits for it, saying
 * so; b stores its documents and exits 0, and once it released its claims the service stops
 * and a exits 0, its summary its own. */
START_TEST(test_host_run_waits_for_dependent_run)
{
    pid_t a, b, s1, s2;
    host_and_dependent_run(&a, &b, &s1, &s2, 20);
    usleep(500000);
    ck_assert_msg(waitpid(a, NULL, WNOHANG) == 0, "run a ended while b holds claims through its service");
    kill(s2, SIGKILL); /* b takes doc_001 over, stores it through a's service, ends */
    waitpid(s2, NULL, 0);
    int rb = run_wait(b), ra = run_wait(a);
    char *oa = slurp("a.out"), *ea = slurp("a.err"), *ob = slurp("b.out"), *eb = slurp("b.err");
    ck_assert_msg(rb == 0 && ra == 0, "run b exit %d:\n%s\n%s\nrun a exit %d:\n%s\n%s", rb, ob, eb, ra, oa, ea);
    ck_assert_msg(summary_value(ob, "compressed") == 2 && summary_value(ob, "failed") == 0, "%s\n%s", ob, eb);
    ck_assert_msg(summary_value(oa, "compressed") == 1 && summary_value(oa, "failed") == 0, "%s\n%s", oa, ea);
    ck_assert_msg(strstr(ea, "the store service stopped: the runs it stayed up for released"), "%s", ea);
    free(oa), free(ea), free(ob), free(eb);
    char *sl = slurp("a.run/store.log");
    ck_assert_msg(strstr(sl, "the claims it stayed up for were released or lapsed: stopping"), "%s", sl);
    free(sl);
    ck_assert_int_eq(kvm_test_store_caches(store), 3);
}
END_TEST

/* As test_host_run_waits_for_dependent_run, but the dependent run is killed (kill -9) with a
 * lease of 60 s (heartbeat 100 ms x liveness 600): the service waited for its claims to lapse,
 * for good with a 24 h lease. The dependent run is of this host, and its process is gone, so
 * the service stops at once, and the host run with it, exit 0. */
START_TEST(test_host_run_dependent_killed)
{
    pid_t a, b, s1, s2;
    host_and_dependent_run(&a, &b, &s1, &s2, 600);
    kill(-b, SIGKILL);
    waitpid(b, NULL, 0);
    time_t t_kill = time(NULL);
    int ra = run_wait(a);
    long waited = (long)(time(NULL) - t_kill);
    kill(s2, SIGKILL);
    waitpid(s2, NULL, 0);
    char *ea = slurp("a.err");
    /* b's lease had up to 60 s left: a did not wait for it to lapse */
    ck_assert_msg(ra == 0 && waited <= 15, "run a exit %d, %ld s after b was killed:\n%s", ra, waited, ea);
    ck_assert_msg(strstr(ea, "the store service stopped: the runs it stayed up for released"), "%s", ea);
    free(ea);
    char *sl = slurp("a.run/store.log");
    ck_assert_msg(strstr(sl, "the claims it stayed up for were released or lapsed: stopping"), "%s", sl);
    free(sl);
}
END_TEST

/* A SIGTERM (a Ctrl-C) to the host run while its store service stays up for a dependent run
 * stops the service at once, and the host run with it: exit 0, its own work done, the service's
 * log naming the claims it stopped under. */
START_TEST(test_host_run_interrupted_while_waiting)
{
    pid_t a, b, s1, s2;
    host_and_dependent_run(&a, &b, &s1, &s2, 20);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kill(a, SIGTERM);
    int ra = run_wait(a);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double took_s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    kill(-b, SIGKILL), waitpid(b, NULL, 0); /* b has no store now */
    kill(s2, SIGKILL), waitpid(s2, NULL, 0);
    char *ea = slurp("a.err"), *sl = slurp("a.run/store.log");
    ck_assert_msg(ra == 0 && took_s < 6, "run a exit %d, %.1f s after its SIGTERM:\n%s", ra, took_s, ea);
    ck_assert_msg(strstr(ea, "interrupted: stopping the store service now"), "%s", ea);
    ck_assert_msg(strstr(sl, "a second stop request: stopping now, under 1 live claim of run:"), "%s", sl);
    free(ea), free(sl);
}
END_TEST

/* A run whose store is a store service, and a compress worker started by hand whose --store
 * names an endpoint where nothing answers: each job failed after its uploads got no reply, each
 * failure used an attempt of its document, and the worker took job after job until every
 * document had failed. Now its second such failure in a row, while the run's own probe of the
 * service is answered, refuses it (the first used an attempt: max_retries 1 leaves room), and
 * the right worker stores all five. */
START_TEST(test_worker_without_replies_refused)
{
    char args[4400];
    pid_t svc = service_start();
    pid_t run = run_start(
        run_config("r", 50, "compress_workers = 0\n[run]\nmax_retries = 1\n[store]\nupload_timeout_ms = 100\n"), "r");
    snprintf(args, sizeof args, "--store tcp://127.0.0.1:%d", port + 1); /* nothing listens there */
    int bad = hand_worker_status(args, "bad");
    char *be = slurp("bad.err");
    ck_assert_msg(bad == 1 && strstr(be, "refused by run") && strstr(be, "no reply"), "exit %d\n%s", bad, be);
    free(be);
    char *err = slurp("r.err");
    ck_assert_msg(count(err, "requeueing") == 2 && strstr(err, "(attempt 2): compress stage: store service"), "%s",
                  err);
    free(err);
    snprintf(args, sizeof args, "--store tcp://127.0.0.1:%d", port);
    right_worker_finishes(run, args, "no reply to the upload");
    service_stop(svc);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
}
END_TEST

/* The store service a run on a local store hosts ([store] service_bind), stalled (SIGSTOP) while a
 * compress worker started by hand with that very service uploads: the worker's uploads got no
 * reply twice and the run refused a worker with the right --store. A run on a local store never
 * asks that service, so no reply is never the worker's fault there: it is not refused, its
 * failed jobs are queued again, and it stores all five once the service goes on. */
START_TEST(test_stalled_hosted_service_refuses_no_worker)
{
    char ep[64], cfg[4300];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    snprintf(cfg, sizeof cfg, "%s", quick_config_bind("r", store, ep));
    FILE *f = fopen(cfg, "a");
    ck_assert_ptr_nonnull(f);
    fputs("compress_workers = 0\n[store]\nupload_timeout_ms = 100\n[run]\nmax_retries = 100\n", f);
    fclose(f);
    pid_t run = run_start(cfg, "r");
    long sp = 0;
    for (int i = 0; i < 1000 && !sp; i++, usleep(10000)) {
        char *err = slurp("r.err");
        sp = service_pid(err, 0);
        free(err);
    }
    ck_assert_msg(sp > 0, "the run did not start its store service");
    ck_assert_int_eq(kill((pid_t)sp, SIGSTOP), 0);
    char cmd[16000];
    snprintf(cmd, sizeof cmd,
             "exec '%s/kvmill-compress' --connect 'ipc://%s/r.run' --heartbeat-ms 100 --store %s 2>'%s/hand.err'",
             kvm_test_bin(), tmp, ep, tmp);
    pid_t hand = spawn_sh(cmd);
    for (int i = 0; i < 600; i++, usleep(10000)) { /* up to 6 s for two failed uploads (0.3 s each) */
        char *err = slurp("r.err");
        int n = count(err, "no reply to the upload");
        free(err);
        if (n >= 2) break;
    }
    kill((pid_t)sp, SIGCONT);
    int rc = run_wait(run);
    int alive = waitpid(hand, NULL, WNOHANG) == 0;
    kill(hand, SIGTERM), waitpid(hand, NULL, 0);
    char *out = slurp("r.out"), *err = slurp("r.err");
    ck_assert_msg(count(err, "no reply to the upload") >= 2, "the uploads were not stalled:\n%s", err);
    ck_assert_msg(rc == 0 && alive && !strstr(err, "is refused") && summary_value(out, "compressed") == 5 &&
                      summary_value(out, "failed") == 0,
                  "exit %d, worker alive %d\n%s\n%s", rc, alive, out, err);
    free(out), free(err);
    ck_assert_int_eq(kvm_test_store_caches(store), 5);
}
END_TEST

static Suite *storesvc_runs_suite(void)
{
    Suite *s = suite_create("storesvc_runs");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"two_runs_one_service", test_two_runs_one_service},
                 {"dead_run_claims_taken_over", test_dead_run_claims_taken_over},
                 {"service_down_mid_run", test_service_down_mid_run},
                 {"service_store_damaged", test_service_store_damaged},
                 {"remote_missing_not_cap", test_remote_missing_not_cap},
                 {"interrupted_and_store_down_one_line", test_interrupted_and_store_down_one_line},
                 {"remote_store_refusals", test_remote_store_refusals},
                 {"remote_decode_polykv", test_remote_decode_polykv},
                 {"recalibration_reaches_remote_worker", test_recalibration_reaches_remote_worker},
                 {"serve_starts_store_service", test_serve_starts_store_service},
                 {"left_documents_rechecked_remote", test_left_documents_rechecked_remote},
                 {"store_is_serve_front_end", test_store_is_serve_front_end},
                 {"worker_uploading_elsewhere_refused", test_worker_uploading_elsewhere_refused},
                 {"worker_with_refused_key_refused", test_worker_with_refused_key_refused},
                 {"worker_without_replies_refused", test_worker_without_replies_refused},
                 {"stalled_hosted_service_refuses_no_worker", test_stalled_hosted_service_refuses_no_worker},
                 {"host_run_waits_for_dependent_run", test_host_run_waits_for_dependent_run},
                 {"host_run_dependent_killed", test_host_run_dependent_killed},
                 {"host_run_interrupted_while_waiting", test_host_run_interrupted_while_waiting}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 300);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(storesvc_runs_suite()); }
