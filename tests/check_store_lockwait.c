/* check_store_lockwait.c: another process holding the store's LMDB write lock (a kvmill writer
 * stopped with Ctrl-Z or kill -STOP inside a commit, or hung) froze `kvmill run` silently,
 * Ctrl-C and SIGTERM included, and `kvmill store rm` alike: mdb_txn_begin waits on a
 * process-shared mutex no signal interrupts. Now a wait of 2 s is said (the store, how to find
 * the holder, the stopped processes that have it open), its end too, and an interrupted run
 * exits 130 at once. Here a child process holds a write transaction while those commands run. */
#include <check.h>
#include <lmdb.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

static char *g_dir;        /* this test's temporary directory */
static char g_store[4200]; /* a store directory inside it */
static char g_cfg[4200];   /* a config file inside it */
static char g_docs[4200];  /* a corpus folder inside it */
static char g_err[4200];   /* the command's stderr */

static void setup(void)
{
    g_dir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(g_dir);
    snprintf(g_store, sizeof g_store, "%s/store.lmdb", g_dir);
    snprintf(g_cfg, sizeof g_cfg, "%s/t.ini", g_dir);
    snprintf(g_docs, sizeof g_docs, "%s/docs", g_dir);
    snprintf(g_err, sizeof g_err, "%s/cmd.err", g_dir);
    kvm_test_store_create(g_store);
    char text[9000];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = streaming\nbudget = 32\n[store]\npath = %s\n"
             "[run]\nheartbeat_ms = 100\nliveness = 50\nprogress_s = 0\n[stages]\nbin_dir = %s\n",
             kvm_test_data_path("models/stories260K.bin"), g_store, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    ck_assert_int_eq(mkdir(g_docs, 0700), 0);
    char dst[4400];
    snprintf(dst, sizeof dst, "%s/doc_000.txt", g_docs);
    size_t len;
    char *t = kvm_test_read_file(kvm_test_data_path("corpus/doc_000.txt"), &len);
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(kvm_test_write_file(dst, t, len), 0);
    free(t);
}

static void teardown(void)
{
    kvm_test_rmtree(g_dir);
    free(g_dir);
    g_dir = NULL;
}

/* The holder: a process with a write transaction open on the store (as a writer stopped inside
 * its commit has) until EOF on `release`; 'y' on `ready` once it holds it. */
static void holder_child(int ready, int release)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    int ok = mdb_env_create(&env) == 0 && mdb_env_set_maxdbs(env, 64) == 0 &&
             mdb_env_open(env, g_store, 0, 0664) == 0 && mdb_txn_begin(env, NULL, 0, &txn) == 0;
    char c = ok ? 'y' : 'n';
    if (write(ready, &c, 1) != 1) _exit(1);
    ssize_t r;
    while ((r = read(release, &c, 1)) > 0 || (r < 0 && errno == EINTR)) {
    }
    if (txn) mdb_txn_abort(txn);
    mdb_env_close(env);
    _exit(0);
}

/* Starts the holder; *release_fd: close it to let the holder go. */
static pid_t holder_start(int *release_fd)
{
    int ready[2], release[2];
    /* close-on-exec: a kvmill started later must not keep the release pipe open */
    ck_assert(pipe(ready) == 0 && pipe(release) == 0);
    for (int i = 0; i < 2; i++)
        ck_assert(fcntl(ready[i], F_SETFD, FD_CLOEXEC) == 0 && fcntl(release[i], F_SETFD, FD_CLOEXEC) == 0);
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(ready[0]);
        close(release[1]);
        holder_child(ready[1], release[0]);
    }
    close(ready[1]);
    close(release[0]);
    char c = 0;
    ssize_t r = read(ready[0], &c, 1);
    close(ready[0]);
    ck_assert_msg(r == 1 && c == 'y', "the holder could not begin a write transaction on %s", g_store);
    *release_fd = release[1];
    return pid;
}

static void holder_release(pid_t pid, int release_fd)
{
    kill(pid, SIGCONT); /* a stopped holder must run to end */
    close(release_fd);
    int st;
    waitpid(pid, &st, 0);
}

/* Starts `kvmill ARGS...` (NULL-terminated) with stderr into g_err, stdout discarded, SIGINT
 * and SIGTERM at their defaults (a test run in the background may have them ignored). */
static pid_t kvmill_start(const char *const *args)
{
    unlink(g_err); /* nothing of the command before read as this one's */
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        if (!freopen(g_err, "w", stderr) || !freopen("/dev/null", "w", stdout)) _exit(127);
        char exe[4200];
        snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
        const char *argv[16] = {exe};
        for (int i = 0; args[i] && i < 14; i++)
            argv[i + 1] = args[i];
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    return pid;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Polls g_err for `text` for up to `seconds`; the file's text (malloc'ed) either way. */
static char *wait_for_text(const char *text, double seconds)
{
    double end = now_s() + seconds;
    for (;;) {
        char *err = kvm_test_read_file(g_err, NULL);
        if ((err && strstr(err, text)) || now_s() >= end) return err ? err : strdup("");
        free(err);
        nanosleep(&(struct timespec){0, 50000000L}, NULL);
    }
}

/* waitpid for up to `seconds`; -1 when pid still runs then (it is killed and reaped). */
static int wait_exit(pid_t pid, double seconds)
{
    double end = now_s() + seconds;
    int st;
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (now_s() >= end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        nanosleep(&(struct timespec){0, 20000000L}, NULL);
    }
    return st;
}

/* Fails the test unless the store verifies (every record intact after all this). */
static void assert_verifies(void)
{
    char cmd[4400], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store verify --store '%s'", kvm_test_bin(), g_store);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "0 problem(s)"), "store verify: exit %d\n%s%s", rc, out, err);
    free(out);
    free(err);
}

/* kvmill store rm (--stale: its writable open writes) with the write lock held by a stopped
 * process: the wait is said within seconds, naming the store and the stopped holder; Ctrl-C
 * ends it. Run again, it goes on once the holder lets go, and says the wait is over. */
START_TEST(test_store_rm_says_wait)
{
    int release;
    pid_t holder = holder_start(&release);
    kill(holder, SIGSTOP); /* as Ctrl-Z on a writer inside its commit */
    const char *args[] = {"store", "rm", "--stale", "--config", g_cfg, NULL};
    pid_t rm = kvmill_start(args);
    char *err = wait_for_text("waiting for the store's write lock", 20);
    char stopped[64];
    snprintf(stopped, sizeof stopped, "stopped among them: %ld (", (long)holder);
    int said = strstr(err, "waiting for the store's write lock") && strstr(err, g_store) && strstr(err, "lock.mdb") &&
               strstr(err, stopped);
    kill(rm, SIGINT);
    double t0 = now_s();
    int st = wait_exit(rm, 10);
    double took = now_s() - t0;
    if (!said || st == -1) holder_release(holder, release);
    ck_assert_msg(said, "store rm said nothing of the wait (or not the store, lock.mdb and %s):\n%s", stopped, err);
    ck_assert_msg(st != -1 && took < 5, "store rm still ran %.1f s after SIGINT:\n%s", took, err);
    ck_assert_msg((WIFSIGNALED(st) && WTERMSIG(st) == SIGINT) || (WIFEXITED(st) && WEXITSTATUS(st) == 130),
                  "store rm: status %d after SIGINT:\n%s", st, err);
    free(err);
    /* the holder goes on and lets go: a waiting rm goes on too, and says so */
    rm = kvmill_start(args);
    err = wait_for_text("waiting for the store's write lock", 20);
    said = strstr(err, "waiting for the store's write lock") != NULL;
    holder_release(holder, release);
    st = wait_exit(rm, 20);
    free(err);
    err = kvm_test_read_file(g_err, NULL);
    ck_assert_msg(said && st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "store rm: status %d:\n%s", st, err);
    ck_assert_msg(strstr(err, "is over"), "the end of the wait was not said:\n%s", err);
    free(err);
    assert_verifies();
}
END_TEST

/* kvmill run with the write lock held by a stopped process: the wait is said, naming it, and
 * SIGINT (then the run's own handler, which set the flag the store's watchdog reads) ends the
 * run with 130 within a second or so, saying what is left undone (a stopped holder lets go only
 * when resumed); nothing was written: the store verifies. */
START_TEST(test_run_interrupted_in_wait)
{
    int release;
    pid_t holder = holder_start(&release);
    kill(holder, SIGSTOP); /* as Ctrl-Z on a writer inside its commit */
    const char *args[] = {"run", "--config", g_cfg, "--corpus", g_docs, NULL};
    pid_t run = kvmill_start(args);
    char *err = wait_for_text("waiting for the store's write lock", 30);
    char stopped[64];
    snprintf(stopped, sizeof stopped, "stopped among them: %ld (", (long)holder);
    int said = strstr(err, "waiting for the store's write lock") && strstr(err, g_store) && strstr(err, "Ctrl-C") &&
               strstr(err, stopped);
    kill(run, SIGINT);
    double t0 = now_s();
    int st = wait_exit(run, 10);
    double took = now_s() - t0;
    holder_release(holder, release);
    free(err);
    err = kvm_test_read_file(g_err, NULL);
    ck_assert_msg(said, "run said nothing of the wait (or not the store, or Ctrl-C):\n%s", err);
    ck_assert_msg(st != -1 && took < 5, "run still ran %.1f s after SIGINT:\n%s", took, err);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "run: status %d after SIGINT:\n%s", st, err);
    ck_assert_msg(strstr(err, "interrupted while waiting for the store's write lock") &&
                      strstr(err, "summary is not printed"),
                  "run: no word of the interruption:\n%s", err);
    free(err);
    assert_verifies();
}
END_TEST

/* kvmill run waiting behind a holder that is not stopped (busy: as other writers' ordinary
 * commits on a busy disk): the wait is not called stopped, and the first SIGINT does not end the
 * run (it was the graceful drain's, and cut the run short at once): the run says it drains once
 * it gets the lock and goes on waiting; a second SIGINT ends it with 130 at once. */
START_TEST(test_run_busy_holder_second_interrupt)
{
    int release;
    pid_t holder = holder_start(&release);
    const char *args[] = {"run", "--config", g_cfg, "--corpus", g_docs, NULL};
    pid_t run = kvmill_start(args);
    char *err = wait_for_text("waiting for the store's write lock", 30);
    int said = strstr(err, "another process holds it (busy, or hung)") && !strstr(err, "stopped among them");
    kill(run, SIGINT);
    nanosleep(&(struct timespec){1, 500000000L}, NULL);
    int st, alive = waitpid(run, &st, WNOHANG) == 0;
    free(err);
    err = wait_for_text("the store's write lock is busy", alive ? 2 : 0);
    int deferred = strstr(err, "interrupted: the store's write lock is busy; the run drains once it gets it") != NULL;
    if (alive) kill(run, SIGINT);
    double t0 = now_s();
    st = alive ? wait_exit(run, 10) : st;
    double took = now_s() - t0;
    holder_release(holder, release);
    free(err);
    err = kvm_test_read_file(g_err, NULL);
    ck_assert_msg(said, "the wait was not said as a busy holder's:\n%s", err);
    ck_assert_msg(alive, "the first SIGINT ended the run though the holder is not stopped: status %d:\n%s", st, err);
    ck_assert_msg(deferred, "run: no word of the interrupt left for the drain:\n%s", err);
    ck_assert_msg(st != -1 && took < 5, "run still ran %.1f s after the second SIGINT:\n%s", took, err);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "run: status %d after the second SIGINT:\n%s", st, err);
    ck_assert_msg(strstr(err, "interrupted while waiting for the store's write lock"), "run: no word of the exit:\n%s",
                  err);
    free(err);
    assert_verifies();
}
END_TEST

/* The same busy holder, one SIGINT, then the holder lets go: the run gets the lock and drains
 * as any interrupted run (its own "interrupted" line, exit 130), not cut short by the watchdog. */
START_TEST(test_run_busy_holder_first_interrupt_drains)
{
    int release;
    pid_t holder = holder_start(&release);
    const char *args[] = {"run", "--config", g_cfg, "--corpus", g_docs, NULL};
    pid_t run = kvmill_start(args);
    free(wait_for_text("waiting for the store's write lock", 30));
    kill(run, SIGINT);
    free(wait_for_text("the store's write lock is busy", 3));
    holder_release(holder, release);
    int st = wait_exit(run, 30);
    char *err = kvm_test_read_file(g_err, NULL);
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 130, "run: status %d:\n%s", st, err);
    ck_assert_msg(strstr(err, "finishing the jobs in flight") &&
                      !strstr(err, "interrupted while waiting for the store's write lock"),
                  "run: not the drain of a first Ctrl-C:\n%s", err);
    free(err);
    assert_verifies();
}
END_TEST

/* The writer thread of test_watchdog_stderr_blocked: one write, which waits for the lock. */
static void *release_claims(void *arg)
{
    int64_t n;
    kvm_store_claim_release(arg, "nobody", &n);
    return NULL;
}

/* The watchdog held its mutex while it scanned /proc and wrote to stderr: with stderr a full
 * pipe whose reader is stopped, its warning of a long wait blocked, and so did every
 * kvm_store_open, kvm_store_close and fork of the process behind it, for good. Here, in a child
 * with such a stderr, a thread waits for the held lock past the 2 s warning, then another
 * store is opened and closed: it must not take more than a moment. */
START_TEST(test_watchdog_stderr_blocked)
{
    int done[2], go[2];
    ck_assert(pipe(done) == 0 && pipe(go) == 0);
    fflush(NULL);
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    if (child == 0) {
        close(done[0]);
        close(go[1]);
        int err[2]; /* err[0] stays open, never read: a full pipe, not EPIPE */
        if (pipe(err) || fcntl(err[1], F_SETFL, O_NONBLOCK)) _exit(2);
        static char junk[4096];
        while (write(err[1], junk, sizeof junk) > 0) {
        }
        if (fcntl(err[1], F_SETFL, 0) || dup2(err[1], 2) < 0) _exit(2);
        kvm_store *s = NULL, *other = NULL;
        char c = 'o';
        /* opened (its own first write done) before the holder takes the lock */
        if (kvm_store_open(g_store, NULL, &s) || write(done[1], &c, 1) != 1 || read(go[0], &c, 1) != 1) _exit(3);
        pthread_t th;
        if (pthread_create(&th, NULL, release_claims, s)) _exit(4);
        nanosleep(&(struct timespec){3, 0}, NULL); /* past the 2 s warning: the watchdog writes */
        char path[4300];
        snprintf(path, sizeof path, "%s/other.lmdb", g_dir);
        int rc = kvm_store_open(path, NULL, &other);
        kvm_store_close(&other);
        c = rc ? 'n' : 'y';
        if (write(done[1], &c, 1) != 1) _exit(5);
        _exit(0); /* the writer still waits: no close of s */
    }
    close(done[1]);
    close(go[0]);
    char c = 0;
    ck_assert_msg(read(done[0], &c, 1) == 1 && c == 'o', "the child could not open the store");
    int release;
    pid_t holder = holder_start(&release);
    ck_assert(write(go[1], &c, 1) == 1);
    close(go[1]);
    /* the child's answer 3 s after start, plus its open: stuck, it never comes (30 s: a new
     * store's fsyncs on a busy CI disk can take seconds) */
    struct timeval tv = {.tv_sec = 30};
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(done[0], &fds);
    c = 0;
    int got = select(done[0] + 1, &fds, NULL, NULL, &tv) == 1 && read(done[0], &c, 1) == 1;
    close(done[0]);
    kill(child, SIGKILL);
    int st;
    waitpid(child, &st, 0);
    holder_release(holder, release);
    ck_assert_msg(got, "kvm_store_open waited behind the watchdog's blocked stderr write");
    ck_assert_msg(c == 'y', "the other store did not open");
}
END_TEST

static TCase *tcase(const char *name, const TTest *fn, int timeout_s)
{
    TCase *tc = tcase_create(name);
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, timeout_s);
    tcase_add_test(tc, fn);
    return tc;
}

int main(void)
{
    if (sodium_init() < 0) return 1;
    Suite *su = suite_create("store_lockwait");
    suite_add_tcase(su, tcase("store_rm_says_wait", test_store_rm_says_wait, 90));
    suite_add_tcase(su, tcase("run_interrupted_in_wait", test_run_interrupted_in_wait, 90));
    suite_add_tcase(su, tcase("watchdog_stderr_blocked", test_watchdog_stderr_blocked, 60));
    suite_add_tcase(su, tcase("run_busy_holder_second_interrupt", test_run_busy_holder_second_interrupt, 90));
    suite_add_tcase(su,
                    tcase("run_busy_holder_first_interrupt_drains", test_run_busy_holder_first_interrupt_drains, 90));
    SRunner *sr = srunner_create(su);
    srunner_set_fork_status(sr, CK_FORK);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
