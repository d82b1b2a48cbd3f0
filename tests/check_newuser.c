/* check_newuser.c: defects found by trying kvmill as a new user after issue 11 (acceptance
 * pass): a key set twice through its old name, store commands on a store that does not
 * exist, and the other first-contact problems listed per test. */
#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_orch_progress.h"
#include "pipeline/kvm_stage.h"
#include "store/kvm_store.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_jobcfg.h"
#include "common/kvm_log.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

/* A store in a fresh temporary folder (dir/store, created empty), and a config using the
 * embedded model with that store; the folder is returned (caller removes and frees it). */
static char *make_store(char *store, size_t store_n, char *cfg, size_t cfg_n)
{
    char *dir = kvm_test_tmpdir();
    snprintf(store, store_n, "%s/store", dir);
    kvm_store_opts o = {0};
    kvm_store *s = NULL;
    ck_assert_int_eq(kvm_store_open(store, &o, &s), 0);
    kvm_store_close(&s);
    snprintf(cfg, cfg_n, "%s/c.ini", dir);
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 64\n[store]\npath = %s\n[serve]\nbind = ipc://%s/front\n",
             kvm_test_data_path("models/stories260K.bin"), store, dir);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    return dir;
}

/* Appends text (more sections and keys) to the config file cfg. */
static void config_append(const char *cfg, const char *text)
{
    FILE *f = fopen(cfg, "a");
    ck_assert_msg(f != NULL, "cannot append to %s", cfg);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/* `queries` and its old name `synthetic_queries` are one key: setting both is a key set
 * twice (both lines named), not a silent "last wins". */
START_TEST(test_alias_set_twice)
{
    kvm_config *c = NULL;
    const char *text = "[model]\npath = m.bin\n[compress]\nqueries = 10\nsynthetic_queries = 20\n";
    ck_assert_int_ne(kvm_config_parse(text, "t.ini", &c), 0);
    ck_assert_ptr_null(c);
    const char *msg = kvm_errmsg();
    ck_assert_msg(strstr(msg, "t.ini:5") && strstr(msg, "line 4") && strstr(msg, "queries"), "%s", msg);
    /* the other order too */
    text = "[model]\npath = m.bin\n[compress]\nsynthetic_queries = 20\nqueries = 10\n";
    ck_assert_int_ne(kvm_config_parse(text, "t.ini", &c), 0);
    msg = kvm_errmsg();
    ck_assert_msg(strstr(msg, "t.ini:5") && strstr(msg, "line 4"), "%s", msg);
    /* the old name alone still works */
    ck_assert_int_eq(kvm_config_parse("[model]\npath = m.bin\n[compress]\nsynthetic_queries = 20\n", "t.ini", &c), 0);
    ck_assert_int_eq(kvm_config_int(c, "compress", "queries"), 20);
    kvm_config_free(&c);
}
END_TEST

/* `store stats` on a store that does not exist is an error (exit 2), like every other store
 * command, not a table of zeros. */
START_TEST(test_stats_missing_store)
{
    char *dir = kvm_test_tmpdir(), cmd[8192], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill store stats --store %s/nope", kvm_test_bin(), dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_str_eq(out, "");
    ck_assert_msg(strstr(err, "cannot open store") && strstr(err, "/nope"), "stderr: %s", err);
    ck_assert_int_ne(access(cmd + strlen(cmd) - 4, F_OK), 0);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* `kvmill serve` on a store whose data.mdb is truncated refuses at once with the store's
 * message (file, size, expected size) and exit 2, instead of starting decode workers that
 * each fail until serve gives up with exit 1. */
START_TEST(test_serve_truncated_store)
{
    char store[4300], cfg[4300], mdb[4400], cmd[9000], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(mdb, sizeof mdb, "%s/data.mdb", store);
    static const long lens[] = {8191, 4096, 100, 0}; /* shorter each time: truncate never extends */
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        ck_assert_int_eq(truncate(mdb, lens[i]), 0);
        snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill serve --config %s --workers 1", kvm_test_bin(), cfg);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2, "length %ld: exit %d\nstderr: %s", lens[i], rc, err);
        ck_assert_msg(strstr(err, "data.mdb") && strstr(err, "truncated"), "length %ld: stderr: %s", lens[i], err);
        ck_assert_msg(!strstr(err, "decode worker"), "length %ld: workers were started: %s", lens[i], err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* 1 while process pid exists and is not a zombie. */
static int alive(pid_t pid)
{
    char path[64], *st;
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    if (!(st = kvm_test_read_file(path, NULL))) return 0;
    const char *p = strrchr(st, ')');
    int a = p && p[1] == ' ' && p[2] != 'Z' && p[2] != 'X';
    free(st);
    return a;
}

/* After `kill -9` of kvmill serve its decode workers stop by themselves (they are given the
 * server's pid, as the run's stages are), instead of living on for ever holding the store. */
START_TEST(test_serve_kill9_workers_stop)
{
    char store[4300], cfg[4300], errp[4400], exe[4200];
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[run]\nheartbeat_ms = 100\n");
    snprintf(errp, sizeof errp, "%s/serve.err", dir);
    snprintf(exe, sizeof exe, "%s/kvmill", kvm_test_bin());
    pid_t pid = fork();
    if (pid == 0) {
        freopen("/dev/null", "w", stdout);
        freopen(errp, "w", stderr);
        execl(exe, exe, "serve", "--config", cfg, "--workers", "1", (char *)NULL);
        _exit(127);
    }
    int ready = 0;
    for (int i = 0; i < 600 && !ready; i++) {
        usleep(50000);
        char *e = kvm_test_read_file(errp, NULL);
        ready = e && strstr(e, "ready:");
        free(e);
    }
    ck_assert_msg(ready, "serve never became ready");
    /* its decode worker: the child of serve */
    char cmd[128], *out = NULL;
    snprintf(cmd, sizeof cmd, "pgrep -P %d", (int)pid);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    pid_t worker = (pid_t)atoi(out);
    free(out);
    ck_assert_int_gt(worker, 0);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    int gone = 0;
    for (int i = 0; i < 200 && !gone; i++) { /* 10 s: many heartbeats */
        usleep(50000);
        gone = !alive(worker);
    }
    if (!gone) kill(worker, SIGKILL);
    ck_assert_msg(gone, "decode worker %d still runs 10 s after kill -9 of serve", (int)worker);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* An old flag and its new name given together (`--entries 8 --budget 20`) is refused with
 * exit 2 naming both; before, one silently won. */
START_TEST(test_old_and_new_flag_together)
{
    char cmd[8192], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill sculpt --model %s --doc %s --entries 8 --budget 20 --out /nonexistent/x.bin",
             kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"), "/nonexistent/doc.txt");
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--entries and --budget set the same setting"), "stderr: %s", err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill calibrate --model m --docs d --budget 4 --layer-alloc ppl --alloc uniform",
             kvm_test_bin());
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--alloc and --layer-alloc set the same setting"), "stderr: %s", err);
    free(out);
    free(err);
    /* an old name alone still works (with its warning): here it fails later, on the model */
    snprintf(cmd, sizeof cmd, "%s/kvmill sculpt --model /nonexistent/m.bin --doc /nonexistent/d.txt --iters 2 --out /nonexistent/x",
             kvm_test_bin());
    kvm_test_run(cmd, &out, &err);
    ck_assert_msg(strstr(err, "--iters is deprecated: use --iterations") && !strstr(err, "same setting"), "stderr: %s", err);
    free(out);
    free(err);
}
END_TEST

/* keygen --force over a secret key file that others can read (copied with the wrong mode, made
 * by hand): the new secret key went into that file with its old mode, world-readable, since
 * the file was opened with O_TRUNC and its mode kept. Now both files are written anew and
 * renamed over the old ones: the secret is 0600 whatever the old file's mode, and the pair
 * matches. */
/* A key setting naming a directory: "Is a directory" (it read "not a 40-character Z85 key"). */
START_TEST(test_key_file_directory)
{
    char *dir = kvm_test_tmpdir(), key[41];
    ck_assert_int_eq(kvm_curve_read_key(dir, key), KVM_EIO);
    ck_assert_msg(strstr(kvm_errmsg(), "Is a directory") && strstr(kvm_errmsg(), dir), "%s", kvm_errmsg());
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A key setting naming a FIFO (--server-key, [security] keys, a *.public in authorized_keys):
 * fopen waited for a writer for ever: ask and the stages hung before connecting, and the ZAP
 * thread reading authorized_keys stalled every client's handshake. Refused now, naming the file;
 * an authorized_keys folder holding one just does not match through it. */
START_TEST(test_key_file_fifo)
{
    char *dir = kvm_test_tmpdir(), fifo[4400], pub[4400], auth[4400], key[41], cmd[9000], *out = NULL, *err = NULL;
    snprintf(fifo, sizeof fifo, "%s/x.public", dir);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    alarm(20); /* the old code blocked in fopen: fail in seconds, not at the case's timeout */
    ck_assert_int_eq(kvm_curve_read_key(fifo, key), KVM_EFORMAT);
    ck_assert_msg(strstr(kvm_errmsg(), "x.public: not a regular file (a FIFO"), "%s", kvm_errmsg());
    snprintf(cmd, sizeof cmd, "%s/kvmill keygen --out %s/k/c", kvm_test_bin(), dir);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    snprintf(pub, sizeof pub, "%s/k/c.public", dir);
    ck_assert_int_eq(kvm_curve_check_authorized(pub, dir), KVM_EMISMATCH); /* dir: only the FIFO */
    snprintf(auth, sizeof auth, "%s/k", dir);
    ck_assert_msg(kvm_curve_check_authorized(pub, auth) == 0, "%s", kvm_errmsg());
    alarm(0);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Secret key files that other users can reach, checked as ssh checks a private key: used
 * without a word before. Readable by others (0644, a Kubernetes secret's default mode): one
 * warning naming the file, its mode and `chmod 600 FILE`, however often the key is read; the
 * public half may be 0644 unremarked. Writable by every user: refused (anyone could swap the
 * key). A link is judged by its target; a FIFO is refused without waiting, a folder named. */
struct pair_args {
    const char *sec, *pub;
    int rc[2];
};

static void check_pair_twice(void *arg)
{
    struct pair_args *a = arg;
    for (int i = 0; i < 2; i++)
        a->rc[i] = kvm_curve_check_pair(a->sec, a->pub);
}

START_TEST(test_secret_key_mode)
{
    char *dir = kvm_test_tmpdir(), cmd[8192], *out = NULL, *err = NULL, sec[4400], pub[4400], link[4400], want[9000];
    snprintf(sec, sizeof sec, "%s/k.secret", dir);
    snprintf(pub, sizeof pub, "%s/k.public", dir);
    snprintf(cmd, sizeof cmd, "%s/kvmill keygen --out %s/k", kvm_test_bin(), dir);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    struct pair_args a = {sec, pub, {1, 1}};
    char *log = kvm_test_stderr_of(check_pair_twice, &a); /* 0600 secret, 0644 public: silent */
    ck_assert_msg(a.rc[0] == 0 && a.rc[1] == 0 && !*log, "rc %d %d: %s", a.rc[0], a.rc[1], log);
    free(log);
    ck_assert_int_eq(chmod(sec, 0644), 0);
    log = kvm_test_stderr_of(check_pair_twice, &a);
    snprintf(want, sizeof want, "secret key file %s has mode 0644: other users can read it; run chmod 600 %s", sec,
             sec);
    ck_assert_msg(a.rc[0] == 0 && a.rc[1] == 0, "rc %d %d: %s", a.rc[0], a.rc[1], kvm_errmsg());
    ck_assert_msg(kvm_test_count(log, want) == 1 && kvm_test_count(log, "\n") == 1, "stderr: %s", log);
    free(log);
    /* through a symbolic link: the target's mode, the name the user gave */
    snprintf(link, sizeof link, "%s/link.secret", dir);
    ck_assert_int_eq(symlink(sec, link), 0);
    ck_assert_int_eq(chmod(sec, 0660), 0);
    a.sec = link;
    log = kvm_test_stderr_of(check_pair_twice, &a);
    snprintf(want, sizeof want, "secret key file %s has mode 0660: other users can read or change it; run chmod 600 %s",
             link, link);
    ck_assert_msg(a.rc[0] == 0 && kvm_test_count(log, want) == 1, "rc %d, stderr: %s", a.rc[0], log);
    free(log);
    ck_assert_int_eq(chmod(sec, 0610), 0); /* execute bits alone: no one else reads or changes it */
    log = kvm_test_stderr_of(check_pair_twice, &a);
    ck_assert_msg(a.rc[0] == 0 && !*log, "rc %d, stderr: %s", a.rc[0], log);
    free(log);
    ck_assert_int_eq(chmod(sec, 0666), 0);
    ck_assert_int_eq(kvm_curve_check_pair(link, pub), KVM_EINVAL);
    snprintf(want, sizeof want, "secret key file %s is writable by every user (mode 0666)", link);
    ck_assert_msg(strstr(kvm_errmsg(), want) && strstr(kvm_errmsg(), "chmod 600"), "%s", kvm_errmsg());
    char key[41];
    ck_assert_int_eq(kvm_curve_read_key(link, key), 0); /* a public key's mode is nobody's secret */
    /* a FIFO (not waited on) and a folder as the secret key */
    snprintf(link, sizeof link, "%s/fifo.secret", dir);
    ck_assert_int_eq(mkfifo(link, 0600), 0);
    alarm(20);
    ck_assert_int_eq(kvm_curve_check_pair(link, pub), KVM_EFORMAT);
    ck_assert_msg(strstr(kvm_errmsg(), "fifo.secret: not a regular file"), "%s", kvm_errmsg());
    alarm(0);
    ck_assert_int_eq(kvm_curve_check_pair(dir, pub), KVM_EIO);
    ck_assert_msg(strstr(kvm_errmsg(), "Is a directory"), "%s", kvm_errmsg());
    /* a socket: named as one, not "No such device or address" (open's ENXIO) */
    snprintf(link, sizeof link, "%s/sock.secret", dir);
    int sfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(link) < sizeof sa.sun_path) {
        memcpy(sa.sun_path, link, strlen(link) + 1);
        ck_assert_int_eq(bind(sfd, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(kvm_curve_check_pair(link, pub), KVM_EFORMAT);
        ck_assert_msg(strstr(kvm_errmsg(), "sock.secret: not a regular file"), "%s", kvm_errmsg());
    }
    close(sfd);
    kvm_test_rmtree(dir);
    free(dir);
    /* filesystems whose modes chmod cannot change (a key on a Windows or host share): named, so the
     * message says to copy the key instead of "chmod 600"; Linux filesystems are not */
    ck_assert_ptr_nonnull(strstr(kvm_curve__modeless_fs(0x4d44), "FAT"));
    ck_assert_ptr_nonnull(strstr(kvm_curve__modeless_fs(0xff534d42L), "CIFS"));
    ck_assert_ptr_nonnull(strstr(kvm_curve__modeless_fs(0x01021997), "9p"));
    ck_assert_ptr_nonnull(strstr(kvm_curve__modeless_fs((long)(int32_t)0xfe534d42), "SMB2")); /* f_type sign-extended */
    ck_assert_ptr_null(kvm_curve__modeless_fs(0xef53));                                       /* ext4 */
    ck_assert_ptr_null(kvm_curve__modeless_fs(0x01021994)); /* tmpfs, one digit from 9p */
    ck_assert_ptr_null(kvm_curve__modeless_fs(0x58465342)); /* xfs */
}
END_TEST

START_TEST(test_keygen_force_secret_private)
{
    char *dir = kvm_test_tmpdir(), cmd[8192], *out = NULL, *err = NULL, sec[4400], pub[4400];
    snprintf(sec, sizeof sec, "%s/k.secret", dir);
    snprintf(pub, sizeof pub, "%s/k.public", dir);
    snprintf(cmd, sizeof cmd, "%s/kvmill keygen --out %s/k", kvm_test_bin(), dir);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    char *old = kvm_test_read_file(sec, NULL);
    ck_assert_ptr_nonnull(old);
    ck_assert_int_eq(chmod(sec, 0644), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill keygen --force --out %s/k", kvm_test_bin(), dir);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "stderr: %s", err);
    free(out);
    free(err);
    struct stat st;
    ck_assert_int_eq(stat(sec, &st), 0);
    ck_assert_msg((st.st_mode & 077) == 0, "the new secret key file has mode %o", (unsigned)(st.st_mode & 0777));
    char *now = kvm_test_read_file(sec, NULL);
    ck_assert_ptr_nonnull(now);
    ck_assert_str_ne(old, now); /* a new key */
    ck_assert_msg(kvm_curve_check_pair(sec, pub) == 0, "%s", kvm_errmsg());
    /* nothing else is left in the folder */
    snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_int_eq(atoi(out), 2);
    free(out);
    free(old);
    free(now);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* README's `kvmill keygen --out keys/server` works where keys/ does not exist yet: the
 * folders of the prefix are made (private); before, "keys/server.public: No such file". */
START_TEST(test_keygen_makes_folder)
{
    char *dir = kvm_test_tmpdir(), cmd[8192], *out = NULL, *err = NULL, path[4400];
    snprintf(cmd, sizeof cmd, "%s/kvmill keygen --out %s/keys/a/server", kvm_test_bin(), dir);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "stderr: %s", err);
    snprintf(path, sizeof path, "%s/keys/a/server.secret", dir);
    struct stat st;
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 077, 0);
    snprintf(path, sizeof path, "%s/keys", dir);
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 077, 0);
    free(out);
    free(err);
    /* a folder as the prefix ("keys/") wrote the hidden keys/.public and keys/.secret: refused */
    snprintf(cmd, sizeof cmd, "%s/kvmill keygen --out %s/keys/", kvm_test_bin(), dir);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "names a folder, not a PREFIX"), "exit %d: %s", rc, err);
    snprintf(path, sizeof path, "%s/keys/.secret", dir);
    ck_assert_int_ne(stat(path, &st), 0);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* `kvmill run --help` names every model format [model] path takes, Hugging Face folders
 * included (every other command's --model help did; run's said only "checkpoint or GGUF"). */
START_TEST(test_run_help_model_formats)
{
    char cmd[4300], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill run --help", kvm_test_bin());
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_msg(strstr(out, "llama2.c checkpoint or GGUF file") && strstr(out, "Hugging Face folder"), "%s", out);
    free(out);
}
END_TEST

/* Help lines that disagreed with the tool: `sculpt --help` said --budget "overrides ratio", but both
 * are refused ("give one of them"); `calibrate --help` listed no --store (only --config's text named
 * it), and without --config it was an unknown option; the stages' --store said "LMDB store
 * directory" though README gives kvmill-compress a tcp:// store service. */
START_TEST(test_help_lines_agree)
{
    char cmd[4300], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill sculpt --help", kvm_test_bin());
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    const char *b = strstr(out, "  --budget ");
    ck_assert_msg(b && !strstr(out, "overrides ratio") && strstr(b, "instead of ratio: give one of them"), "%.1500s",
                  out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/kvmill calibrate --help", kvm_test_bin());
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_msg(strstr(out, "\n  --store VALUE            with --config: the LMDB store folder"), "%.1500s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/kvmill calibrate --store x --model m --docs d --budget 4 --out o", kvm_test_bin());
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--store applies with --config only"), "%.1500s", err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill-compress --help", kvm_test_bin());
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_msg(
        strstr(out, "  --store PATH          LMDB store folder, or a store service endpoint tcp://HOST:PORT\n"),
        "%.1500s", out);
    free(out);
}
END_TEST

/* Documents that failed at once (empty, ids outside the vocabulary) are no basis for an ETA:
 * `2/4 documents, 0 tokens/s, ETA 0 s` was printed before anything was compressed. */
START_TEST(test_no_eta_from_failures)
{
    char *dir = kvm_test_tmpdir(), path[4300];
    snprintf(path, sizeof path, "%s/err.txt", dir);
    fflush(stderr);
    FILE *f = freopen(path, "w", stderr);
    ck_assert_ptr_nonnull(f);
    kvm_orch_progress p = {.cmd = "run", .tty = 0, .interval_ms = 0, .t0_ms = kvm_now_ms() - 1000};
    kvm_orch_progress_print(&p, 2, 4, 0, "", 0);  /* two failed, none compressed */
    kvm_orch_progress_print(&p, 3, 4, 64, "", 0); /* one compressed: now there is a basis */
    fflush(stderr);
    char *err = kvm_test_read_file(path, NULL);
    ck_assert_ptr_nonnull(err);
    char *nl = strchr(err, '\n');
    ck_assert_ptr_nonnull(nl);
    *nl = '\0';
    ck_assert_msg(strstr(err, "2/4 documents") && !strstr(err, "ETA"), "first line: %s", err);
    ck_assert_msg(strstr(nl + 1, "3/4 documents") && strstr(nl + 1, "ETA"), "second line: %s", nl + 1);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The progress line and kvm_cli_refuse printed names raw: a document named "a\nkvmill run:
 * done" wrote a second, fake line, and an escape sequence in one drove the terminal. They show
 * control bytes as \xHH, as the logger does (kvm_log_escape). */
START_TEST(test_names_escaped)
{
    char *dir = kvm_test_tmpdir(), path[4300];
    snprintf(path, sizeof path, "%s/err.txt", dir);
    fflush(stderr);
    FILE *f = freopen(path, "w", stderr);
    ck_assert_ptr_nonnull(f);
    kvm_orch_progress p = {.cmd = "run", .tty = 0, .interval_ms = 0, .t0_ms = kvm_now_ms() - 1000};
    kvm_orch_progress_print(&p, 1, 4, 64, " in compress: a\nkvmill run: done\x1b[2J 3/9", 0);
    kvm_orch_progress tty = {.cmd = "run", .tty = 1, .interval_ms = 0, .t0_ms = kvm_now_ms() - 1000};
    kvm_orch_progress_print(&tty, 1, 4, 64, " in compress: b\nkvmill run: done\x1b[2J 3/9", 1);
    kvm_cli_refuse("eval", "--docs %s: no such file\n", "c\nkvmill eval: done\x07");
    static char longname[9000]; /* cut at 8,191 bytes: its line was left unended */
    memset(longname, 'x', sizeof longname - 1);
    kvm_cli_refuse("eval", "--docs %s: no such file\n", longname);
    fflush(stderr);
    char *err = kvm_test_read_file(path, NULL);
    ck_assert_ptr_nonnull(err);
    int lines = 0;
    for (const char *q = err; *q; q++)
        lines += *q == '\n';
    ck_assert_msg(lines == 4 && err[strlen(err) - 1] == '\n', "%d lines:\n%s", lines, err);
    ck_assert_msg(strstr(err, "in compress: a\\x0akvmill run: done\\x1b[2J 3/9, ") &&
                      strstr(err, "in compress: b\\x0akvmill run: done\\x1b[2J 3/9  ") &&
                      strstr(err, "kvmill eval: --docs c\\x0akvmill eval: done\\x07: no such file\n"),
                  "%s", err);
    ck_assert_msg(!strstr(err, "\x1b[2J") && !strchr(err, '\x07'), "%s", err);
    /* a C1 control in UTF-8 (U+009B, a CSI to some terminals) passed raw; other UTF-8 stays */
    char esc[64];
    ck_assert_str_eq(kvm_log_escape("a\xc2\x9b"
                                    "2Jb\xc3\xa9\xc2\xa0\xc2",
                                    0, esc, sizeof esc),
                     "a\\xc2\\x9b2Jb\xc3\xa9\xc2\xa0\xc2");
    ck_assert_str_eq(kvm_log_escape("\xc2\x80", 0, esc, 8), ""); /* no room for both escapes: cut before */
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* `ask --connect bogus` said only "Invalid argument": it names the endpoint forms now. */
START_TEST(test_ask_bad_endpoint)
{
    char cmd[8192], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill ask --connect bogus --doc %s --prompt x --timeout 1", kvm_test_bin(),
             kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--connect bogus") && strstr(err, "tcp://HOST:PORT or ipc://PATH"), "stderr: %s", err);
    free(out);
    free(err);
}
END_TEST

/* A corpus file that cannot be read when the folder is scanned (a dangling link, no read
 * permission, removed since the listing) stopped the whole run (exit 2, nothing compressed),
 * while a FIFO or a folder named *.txt failed alone: it fails alone now, named, and the other
 * documents are compressed (exit 1). */
START_TEST(test_corpus_dangling_link_fails_alone)
{
    char store[4300], cfg[4300], corp[4400], p[4500], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(corp, sizeof corp, "%s/corp", dir);
    ck_assert_int_eq(mkdir(corp, 0755), 0);
    snprintf(p, sizeof p, "%s/a.txt", corp);
    ck_assert_int_eq(kvm_test_write_file(p, "Once upon a time there was a dog.", 33), 0);
    snprintf(p, sizeof p, "%s/b.txt", corp);
    ck_assert_int_eq(symlink("/nonexistent/kvmill-no-such-file", p), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, corp);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
    ck_assert_msg(strstr(err, "b.txt: cannot read: No such file or directory") && strstr(out, "compressed=1 ") &&
                      strstr(out, "failed=1 "),
                  "stdout: %s\nstderr: %s", out, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A JSONL corpus saved with a UTF-8 byte-order mark (Notepad, PowerShell) was refused as
 * "invalid JSON: '[' or '{' expected near '\xef\xbb\xbf'" (an invisible character): the mark is
 * skipped, as in a config file, and the first line's document is loaded again without it. */
START_TEST(test_jsonl_bom)
{
    char store[4300], cfg[4300], p[4400], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(p, sizeof p, "%s/c.jsonl", dir);
    const char *text = "\xEF\xBB\xBF{\"id\": \"a\", \"text\": \"Once upon a time there was a dog.\"}\n"
                       "{\"id\": \"b\", \"text\": \"Once upon a time there was a cat.\"}\n";
    ck_assert_int_eq(kvm_test_write_file(p, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, p);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(strstr(out, "compressed=2 ") && strstr(out, "failed=0 "), "stdout: %s\nstderr: %s", out, err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill store ls --store '%s' --names", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_msg(strstr(out, " a\n") && strstr(out, " b\n"), "%s", out);
    free(out);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A document's name goes into the job as UTF-8 of at most 1024 bytes: a corpus file named in
 * latin-1 ("caf\xe9.txt") or a JSONL id of 2000 bytes failed every attempt with "encode job:
 * field 'doc_id': invalid UTF-8" (or "2000 bytes, allowed 1..1024") and was never compressed.
 * Both are compressed now: the bad byte stored as U+FFFD, the long id as its first 255 bytes. */
START_TEST(test_corpus_names_not_utf8_or_long)
{
    char store[4300], cfg[4300], p[4400], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(p, sizeof p, "%s/corpus", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/corpus/caf\xe9.txt", dir);
    const char *text = "Once upon a time there was a dog. It liked to run in the park with its ball.";
    ck_assert_int_eq(kvm_test_write_file(p, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s/corpus'", kvm_test_bin(), cfg, dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(strstr(out, "compressed=1 ") && strstr(out, "failed=0 "), "stdout: %s\nstderr: %s", out, err);
    free(out);
    free(err);
    static char line[4096];
    int k = snprintf(line, sizeof line, "{\"id\": \"");
    for (int i = 0; i < 2000; i++) line[k++] = 'L';
    snprintf(line + k, sizeof line - (size_t)k, "\", \"text\": \"Once upon a time there was a cat.\"}\n");
    snprintf(p, sizeof p, "%s/c.jsonl", dir);
    ck_assert_int_eq(kvm_test_write_file(p, line, strlen(line)), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, p);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(strstr(out, "compressed=1 ") && strstr(out, "failed=0 "), "stdout: %s\nstderr: %s", out, err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill store ls --store '%s' --names", kvm_test_bin(), store);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    char l255[300];
    memset(l255, 'L', 255);
    strcpy(l255 + 255, "\n");
    /* a latin-1 byte of a file name is written %HH (it was U+FFFD: two such names were one) */
    ck_assert_msg(strstr(out, " caf%E9.txt\n") && strstr(out, l255) && !strstr(out, "LLLLL\xEF"), "%s", out);
    free(out);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Every setting a job carries to the stages travels as UTF-8: a [model] path in latin-1 (a model
 * file named "m\xe9.bin") or a [compress] strategy name with such a byte made every job fail to
 * encode ("encode job: field 'settings value': invalid UTF-8 or NUL at byte 8"), each document
 * after 3 requeues, exit 1. run and calibrate --config refuse it at start, exit 2, naming the key. */
START_TEST(test_config_text_not_utf8)
{
    char store[4300], cfg[4300], p[4400], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    size_t n;
    char *bytes = kvm_test_read_file(kvm_test_data_path("models/stories260K.bin"), &n);
    snprintf(p, sizeof p, "%s/m\xe9.bin", dir);
    ck_assert_int_eq(kvm_test_write_file(p, bytes, n), 0);
    free(bytes);
    bytes = kvm_test_read_file(kvm_test_data_path("models/tok512.bin"), &n);
    snprintf(p, sizeof p, "%s/tok512.bin", dir);
    ck_assert_int_eq(kvm_test_write_file(p, bytes, n), 0);
    free(bytes);
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = %s/m\xe9.bin\ncontext = 64\n[compress]\nmethod = streaming\nbudget = 16\n"
             "[store]\npath = %s\n", dir, store);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "[model] path = ") && strstr(err, "is not UTF-8 text"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(text, sizeof text, "[model]\npath = %s\ncontext = 64\n[compress]\nmethod = polykv\nstrategy = caf\xe9\n"
             "budget = 16\n[store]\npath = %s\n", kvm_test_data_path("models/stories260K.bin"), store);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill calibrate --config '%s' --docs '%s' --phases prefill", kvm_test_bin(),
             cfg, kvm_test_data_path("corpus"));
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "[compress] strategy = ") && strstr(err, "(at byte 3)"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The run directory's ipc:// endpoints are Unix socket paths (at most 107 bytes): under a deep
 * TMPDIR (or [run] run_dir) run and serve failed with "[run] bind: cannot bind ipc://...: File
 * name too long", exit 1, naming a setting the user never set. Now: exit 2, saying the path is
 * too long and which folder to shorten, and the temporary run directory is removed. */
START_TEST(test_long_tmpdir)
{
    char store[4300], cfg[4300], deep[4400], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(deep, sizeof deep, "%s/", dir);
    for (int i = 0; i < 130; i++) strcat(deep, "t");
    ck_assert_int_eq(mkdir(deep, 0700), 0);
    const char *cmds[] = {"run --config '%s' --corpus '%s'",
                          "serve --config '%s' --workers 0 --bind tcp://127.0.0.1:0%.0s"};
    for (int i = 0; i < 2; i++) {
        char args[9000];
        snprintf(args, sizeof args, cmds[i], cfg, kvm_test_data_path("corpus"));
        snprintf(cmd, sizeof cmd, "TMPDIR='%s' timeout 20 %s/kvmill %s", deep, kvm_test_bin(), args);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, "a Unix socket path takes") && strstr(err, "TMPDIR"), "%s: exit %d: %s",
                      cmds[i], rc, err);
        free(out);
        free(err);
    }
    snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", deep);
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    ck_assert_msg(atoi(out) == 0, "left in TMPDIR: %s", out);
    free(out);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* README: a value longer than libinih's 198-character line, "such as a deep path, goes into an
 * environment variable (path = ${MODEL})". A model so named went to the stages in each job and
 * was parsed there as one line "path = ...": every document failed ("job settings:2: line of
 * 269 characters"). dir gets a copy of the model and tokenizer under a folder path longer than
 * that; the config (dir/c.ini, store dir/store) names it through ${KVM_TEST_DEEP_MODEL}. */
static void deep_model_config(const char *dir, const char *store, const char *cfg)
{
    char deep[4400], p[4500], cmd[9000];
    snprintf(deep, sizeof deep, "%s", dir);
    for (int i = 0; i < 12; i++) strcat(deep, "/ddddddddddddddddddddd");
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && cp '%s' '%s' '%s/'", deep, kvm_test_data_path("models/stories260K.bin"),
             kvm_test_data_path("models/tok512.bin"), deep);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(p, sizeof p, "%s/stories260K.bin", deep);
    ck_assert_int_gt((int)strlen(p), 200);
    ck_assert_int_eq(setenv("KVM_TEST_DEEP_MODEL", p, 1), 0);
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = ${KVM_TEST_DEEP_MODEL}\ncontext = 64\n[compress]\nmethod = streaming\n"
             "budget = 16\n[store]\npath = %s\n", store);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
}

START_TEST(test_deep_model_path_run)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    deep_model_config(dir, store, cfg);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "compressed=6 ") && strstr(out, "failed=0 "), "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* `run --store` naming the corpus folder (a directory that is there, holding other files, and
 * no store) created the store inside it, exit 0. Now exit 2 naming the folder, the number of
 * entries and one, and nothing is written there. */
START_TEST(test_run_store_in_corpus_folder)
{
    char store[4300], cfg[4300], corp[4400], cmd[16384], names[4400], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(corp, sizeof corp, "%s/corp", dir);
    ck_assert_int_eq(mkdir(corp, 0700), 0);
    for (int i = 0; i < 2; i++) {
        snprintf(names, sizeof names, "%s/doc_%03d.txt", corp, i);
        const char *text = i ? "Tom had a big red ball.\n" : "Once upon a time there was a cat.\n";
        ck_assert_int_eq(kvm_test_write_file(names, text, strlen(text)), 0);
    }
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s' --store '%s'", kvm_test_bin(), cfg,
             corp, corp);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, corp) && strstr(err, "2 entries") && strstr(err, "doc_00") &&
                      strstr(err, "empty or new folder"),
                  "exit %d\n%s\n%s", rc, out, err);
    snprintf(names, sizeof names, "%s/data.mdb", corp);
    struct stat sb;
    ck_assert_msg(stat(names, &sb) != 0, "data.mdb was made in the corpus folder");
    snprintf(names, sizeof names, "%s/lock.mdb", corp);
    ck_assert_msg(stat(names, &sb) != 0, "lock.mdb was made in the corpus folder");
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Two files of the same content (a copy under another name) in one corpus, on a new store: the
 * run said "2 documents (1 already stored)", and nothing said that the store keeps the first
 * name only (ask --doc-name of the second finds nothing). The start line now counts it as a
 * duplicate within the corpus, and a line names both and the name to ask by. */
START_TEST(test_run_duplicate_in_corpus_said)
{
    char store[4300], cfg[4300], corp[4400], f[4500], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(corp, sizeof corp, "%s/dup", dir);
    ck_assert_int_eq(mkdir(corp, 0700), 0);
    const char *text = "Once upon a time there was a cat.\n";
    snprintf(f, sizeof f, "%s/x.txt", corp);
    ck_assert_int_eq(kvm_test_write_file(f, text, strlen(text)), 0);
    snprintf(f, sizeof f, "%s/y.txt", corp);
    ck_assert_int_eq(kvm_test_write_file(f, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, corp);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "skipped=1 "), "exit %d\n%s\n%s", rc, out, err);
    ck_assert_msg(strstr(err, "2 documents (0 already stored, 1 duplicate of another in this corpus)") &&
                      strstr(err, "y.txt is a duplicate of x.txt within this corpus") &&
                      strstr(err, "kvmill ask --doc-name x.txt"),
                  "%s", err);
    free(out);
    free(err);
    /* 25 copies more: the first 20 duplicates named, the rest counted (a corpus of repeated rows
     * would flood the log) */
    for (int i = 0; i < 25; i++) {
        snprintf(f, sizeof f, "%s/z%02d.txt", corp, i);
        ck_assert_int_eq(kvm_test_write_file(f, text, strlen(text)), 0);
    }
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(err, "27 documents (1 already stored, 26 duplicates of another in this corpus)"),
                  "exit %d\n%s", rc, err);
    ck_assert_int_eq(kvm_test_count(err, "within this corpus (the same tokens)"), 20);
    ck_assert_int_eq(kvm_test_count(err, "further duplicates within this corpus are counted, not named"), 1);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The same deep model path for kvmill serve: its decode workers read the resolved configuration
 * from a file, where the path was written as one line of over 198 characters, which each worker
 * refused ("line of 269 characters: lines are limited to 198"); three such exits stopped the
 * server. The value now reaches the workers in the environment, and an ask is answered. */
START_TEST(test_deep_model_path_serve)
{
    char store[4300], cfg[4300], log[4400], front[4400], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    deep_model_config(dir, store, cfg);
    snprintf(log, sizeof log, "%s/serve.log", dir);
    snprintf(front, sizeof front, "ipc://%s/front", dir);
    const char *args[] = {"--config", cfg, "--bind", front, "--workers", "1", "--compute-missing", NULL};
    pid_t pid = 0;
    ck_assert_msg(kvm_test_serve_start(args, log, 30, &pid) == -1, "kvmill serve exited before ready");
    snprintf(cmd, sizeof cmd, "%s/kvmill ask --connect '%s' --doc '%s' --prompt ' Then' -n 4 --timeout 30", kvm_test_bin(),
             front, kvm_test_data_path("corpus/doc_000.txt"));
    int rc = kvm_test_run(cmd, &out, &err);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    char *serve_log = kvm_test_read_file(log, NULL);
    ck_assert_msg(rc == 0, "ask exit %d: %s\nserve log:\n%s", rc, err, serve_log ? serve_log : "");
    free(serve_log);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A decode worker started by hand (`kvmill-decode --connect BACKEND --config FILE --store PATH`)
 * with a mistyped --store created an empty store there and joined, answering every ask "no
 * cache", where kvmill serve refuses a store that does not exist: the worker refuses it too
 * (unless [serve] compute_missing lets it make a new one), and creates nothing. */
START_TEST(test_decode_worker_missing_store)
{
    char store[4300], cfg[4300], none[4400], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(none, sizeof none, "%s/no-such-store", dir);
    snprintf(cmd, sizeof cmd, "timeout 20 %s/kvmill-decode --connect 'ipc://%s/backend' --config '%s' --store '%s'",
             kvm_test_bin(), dir, cfg, none);
    int rc = kvm_test_run(cmd, &out, &err);
    /* exit 2: a --store that does not exist is the command line's error, as for kvmill serve */
    ck_assert_msg(rc == 2 && strstr(err, "no-such-store: no such directory"), "exit %d, stderr: %s", rc, err);
    ck_assert_int_ne(access(none, F_OK), 0);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* [compress] budget > 0 with ratio set too: the budget replaced the ratio unsaid (a default.ini
 * copy with budget = 64 added ran at 64, its ratio = 0.3 ignored). The settings table's rule
 * stands (budget overrides ratio), and run and serve now say so on stderr, naming the file and
 * both values; budget = 0 (use the ratio) and target_kl (both unused) say nothing. */
START_TEST(test_budget_and_ratio_both_set)
{
    static const struct {
        const char *compress;
        int said;
    } cases[] = {
        {"method = h2o\nratio = 0.5\nbudget = 32", 1},
        {"method = sculpt\nbudget = 48\nratio = 0.3", 1},
        {"method = h2o\nbudget = 32", 0},
        {"method = h2o\nratio = 0.5\nbudget = 0", 0},
        {"method = h2o\nratio = 0.5\nbudget = 32\ntarget_kl = 0.1", 0},
    };
    char text[1024], note[8400];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvm_config *c = NULL;
        snprintf(text, sizeof text, "[model]\npath = m.bin\ncontext = 128\n[compress]\n%s\n", cases[i].compress);
        ck_assert_int_eq(kvm_config_parse(text, "t.ini", &c), 0);
        note[0] = '\0';
        int said = kvm_jobcfg_size_note(c, note, sizeof note);
        ck_assert_msg(said == cases[i].said, "%s: %d %s", cases[i].compress, said, note);
        if (said)
            ck_assert_msg(strstr(note, "t.ini: [compress] budget = ") && strstr(note, "replaces ratio = 0."), "%s",
                          note);
        kvm_config_free(&c);
    }
    /* the command: said on stderr, and the caches are made at the budget */
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[compress]\nmethod = h2o\nratio = 0.5\nbudget = 32\n");
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(err, "c.ini: [compress] budget = 32 replaces ratio = 0.5"), "exit %d: %s", rc, err);
    ck_assert_int_gt(kvm_test_store_caches(store), 0);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* run and serve on a missing model named only the resolved path ("/abs/m.bin: No such file"):
 * the user was left to find which file and which key gave it. The refusal names the config
 * file and [model] path (or [model] tokenizer), exit 2. */
START_TEST(test_missing_model_names_config_key)
{
    char store[4200], cfg[4200], text[8192], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    const struct {
        const char *key, *lines;
    } cases[] = {{"[model] path", "[model]\npath = %s/gone/m.bin\n"},
                 {"[model] tokenizer", "[model]\npath = %s\ntokenizer = %s/gone/tok.bin\n"}};
    for (int c = 0; c < 2; c++) {
        char lines[4600];
        if (c == 0)
            snprintf(lines, sizeof lines, cases[c].lines, dir);
        else
            snprintf(lines, sizeof lines, cases[c].lines, kvm_test_data_path("models/stories260K.bin"), dir);
        snprintf(text, sizeof text, "%s[store]\npath = %s\n[serve]\nbind = ipc://%s/front\n", lines, store, dir);
        ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
        const char *cmds[] = {"run --config '%s' --corpus '%s'", "serve --config '%s'"};
        for (int k = 0; k < 2; k++) {
            char args[8400];
            snprintf(args, sizeof args, cmds[k], cfg, kvm_test_data_path("corpus"));
            snprintf(cmd, sizeof cmd, "'%s/kvmill' %s", kvm_test_bin(), args);
            int rc = kvm_test_run(cmd, &out, &err);
            char want[4400];
            snprintf(want, sizeof want, "%s: %s: %s/gone/", cfg, cases[c].key, dir);
            ck_assert_msg(rc == 2 && strstr(err, want), "%s: exit %d, wanted '%s' in: %s", args, rc, want, err);
            free(out);
            free(err);
        }
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A device list with an empty item: `compress_devices = cpu,` passed the check (only a doubled
 * comma was refused), and the worker the cycle gave the empty item exited 2 at each of its
 * restarts until the run gave it up, which then ended 0; --dump-config (run's and serve's) printed
 * `gpu` or `cpu,` as a config run accepts. Now each is refused at once, exit 2, naming the item. */
START_TEST(test_device_list_empty_item)
{
    static const char *const bad[] = {"cpu,", ",cpu", "cpu,,cpu"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_msg(kvm_stage_check_devices("[stages] compress_devices", bad[i]) != 0, "%s accepted", bad[i]);
        ck_assert_msg(strstr(kvm_errmsg(), "is empty"), "%s: %s", bad[i], kvm_errmsg());
    }
    ck_assert_int_eq(kvm_stage_check_devices("[stages] compress_devices", "cpu,cpu"), 0);
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg,
                  "[compress]\nmethod = h2o\nbudget = 16\n[stages]\ncompress_workers = 2\ncompress_devices = cpu,\n");
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "[stages] compress_devices = cpu,: item 2 is empty"), "exit %d: %s", rc, err);
    ck_assert_int_eq(kvm_test_store_caches(store), 0);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill run --config '%s' --dump-config", kvm_test_bin(), cfg);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "item 2 is empty") && !strstr(out, "[model]"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    /* serve's [serve] devices, by its --dump-config */
    char text[16384];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 64\n[store]\npath = %s\n[serve]\nworkers = 1\ndevices = gpu\n",
             kvm_test_data_path("models/stories260K.bin"), store);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill serve --config '%s' --dump-config", kvm_test_bin(), cfg);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "[serve] devices: gpu: not cpu or cuda:N"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A compress or strategy worker started by hand with a --store that is no store: the store
 * opened with the first job's settings was created at the mistyped path, the caches went there
 * and the run reported them compressed (bytes_compressed=0) while its own store stayed empty.
 * README: the stages exit 2 for a --store that is missing or not one; now they do, creating
 * nothing, before they connect. */
START_TEST(test_stage_store_missing)
{
    char *dir = kvm_test_tmpdir(), cmd[16384], path[4300], *out = NULL, *err = NULL;
    static const char *const stages[] = {"compress", "strategy"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/typo.lmdb", dir);
        snprintf(cmd, sizeof cmd, "timeout 10 '%s/kvmill-%s' --connect 'ipc://%s/none' --store '%s'", kvm_test_bin(),
                 stages[i], dir, path);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, "typo.lmdb: no such store"), "%s: exit %d: %s", stages[i], rc, err);
        ck_assert_int_ne(access(path, F_OK), 0); /* nothing made */
        free(out);
        free(err);
        /* a folder without data.mdb, the folder above the store, say */
        snprintf(cmd, sizeof cmd, "timeout 10 '%s/kvmill-%s' --connect 'ipc://%s/none' --store '%s'", kvm_test_bin(),
                 stages[i], dir, dir);
        rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, "holds no store (no data.mdb)"), "%s: exit %d: %s", stages[i], rc, err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A document name with a terminal escape (a JSONL id, or a file name, holding ESC): run's log
 * line "document NAME is empty: not processed" wrote it raw, so the terminal took it as a command
 * (colours, cursor moves that rewrite what was shown). Control bytes of text log lines are written
 * as \\xHH now, as store ls shows such names. */
START_TEST(test_log_name_control_bytes)
{
    char store[4300], cfg[4300], cmd[16384], corpus[4400], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    snprintf(corpus, sizeof corpus, "%s/c.jsonl", dir);
    const char *jl = "{\"id\": \"red\\u001b[31mdoc\\rx\", \"text\": \"\"}\n";
    ck_assert_int_eq(kvm_test_write_file(corpus, jl, strlen(jl)), 0);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg, corpus);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 1 && strstr(err, "document red\\x1b[31mdoc\\x0dx is empty") && !strchr(err, '\x1b') &&
                      !strchr(err, '\r'),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* calibrate --config with --docs naming one document, or a comma-separated list (what --docs takes
 * without --config, as calibrate --help says): refused as "corpus doc_000.txt: expected a folder of
 * *.txt or a .jsonl file" or "corpus a.txt,b.txt: No such file or directory", naming neither --docs
 * nor that --config makes it a corpus. Now both are said (exit 2 as before). */
START_TEST(test_calibrate_config_docs_file)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[compress]\nmethod = polykv\nbudget = 16\n[eval]\ncontinuation = 8\n");
    char one[4400], two[9000];
    snprintf(one, sizeof one, "%s", kvm_test_data_path("corpus/doc_000.txt"));
    snprintf(two, sizeof two, "%s,%s", one, kvm_test_data_path("corpus/doc_001.txt"));
    const char *docs[] = {one, two};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "timeout 60 %s/kvmill calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg,
                 docs[i]);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, "kvmill calibrate: --docs ") &&
                          strstr(err, "with --config, --docs is a corpus as kvmill run takes it"),
                      "%s: exit %d: %s", docs[i], rc, err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* calibrate --config with [compress] strategy = (empty): run refuses it at start, calibrate found it
 * only when the strategy worker stored the strategy; every document then timed out and was
 * requeued, and the command did not end (SIGTERM only made it wait for those jobs). Refused at once
 * now, exit 2, naming the key. */
START_TEST(test_calibrate_empty_strategy_name)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[compress]\nmethod = polykv\nstrategy =\nbudget = 16\n[eval]\ncontinuation = 8\n");
    snprintf(cmd, sizeof cmd, "timeout -k 2 20 %s/kvmill calibrate --config '%s' --docs '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "[compress] strategy: the name to store the strategy under must be 1 to 255"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* method = polykv with a [compress] strategy name the store cannot hold (empty, or over 255
 * bytes): --dump-config printed it, run refused it as "strategy: name must be 1 to 255 bytes and
 * the model id given" (no file, no key), store ls --config likewise, and kvmill serve started
 * decode workers that each failed so until it gave up. Each refuses it at start now, exit 2,
 * naming the file, the key and the length. */
START_TEST(test_polykv_strategy_name_refused)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    char name[301];
    memset(name, 's', 300);
    name[300] = '\0';
    setenv("KVM_TEST_STRATEGY", name, 1); /* a value past an INI line's 198 characters */
    config_append(cfg, "[compress]\nmethod = polykv\nstrategy = ${KVM_TEST_STRATEGY}\nbudget = 16\n");
    static const char *const cmds[] = {"run --dump-config --config '%s'", "run --config '%s' --corpus '%s'",
                                       "store ls --config '%s'", "serve --config '%s'"};
    for (int i = 0; i < 4; i++) {
        char args[9000];
        snprintf(args, sizeof args, cmds[i], cfg, kvm_test_data_path("corpus"));
        snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill %s", kvm_test_bin(), args);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 &&
                          strstr(err, "c.ini: [compress] strategy: the name the PolyKV strategy is stored under "
                                      "must be 1 to 255 bytes (it is 300)") &&
                          !strstr(err, "decode worker"),
                      "%s: exit %d: %s", args, rc, err);
        free(out);
        free(err);
    }
    unsetenv("KVM_TEST_STRATEGY");
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* calibrate --config did not check the settings that do not go together (kvm_jobcfg_check) as run
 * does: polykv with [compress] target_kl was calibrated and stored (exit 0), and run then refused
 * the same config. Refused at start now, exit 2, with run's message. */
START_TEST(test_calibrate_jobcfg_check)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[compress]\nmethod = polykv\nstrategy = s\nbudget = 16\ntarget_kl = 0.1\n[eval]\n"
                       "continuation = 8\n");
    const char *want = "[compress] target_kl chooses a budget per document, which method polykv does not take";
    snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill run --config '%s' --corpus '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, want), "run: exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill calibrate --config '%s' --docs '%s' --phases prefill",
             kvm_test_bin(), cfg, kvm_test_data_path("corpus"));
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, want) && !strstr(out, "stored strategy"), "calibrate: exit %d: %s%s", rc, out,
                  err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* [compress] method = sculpt with queries = 0 and retain = 0 gives the fit no training query: run
 * started and every document failed in the compress worker ("sculpt: no training queries", exit
 * 1, no key named), and --dump-config exited 0. Refused at start now (exit 2) by the config check
 * run, --dump-config, serve and calibrate share, naming both keys and the file; retain > 0 alone
 * (the retain zone's queries) still runs. */
START_TEST(test_no_training_queries)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[compress]\nmethod = sculpt\nqueries = 0\nretain = 0\n");
    const char *tails[] = {"--dump-config", "--corpus"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill run --config '%s' %s %s", kvm_test_bin(), cfg, tails[i],
                 i ? kvm_test_data_path("corpus") : "");
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, "[compress] queries = 0 and retain = 0") && strstr(err, cfg) &&
                          !strstr(err, "no training queries ("),
                      "%s: exit %d: %s", tails[i], rc, err);
        free(out);
        free(err);
    }
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = m.bin\ncontext = 64\n[compress]\nmethod = kvzip\nqueries = 0\n"
                                      "retain = 0\n",
                                      "t.ini", &c),
                     0);
    ck_assert_int_eq(kvm_jobcfg_check(c), KVM_EINVAL);
    kvm_config_free(&c);
    ck_assert_int_eq(kvm_config_parse("[model]\npath = m.bin\ncontext = 64\n[compress]\nmethod = sculpt\nqueries = 0\n"
                                      "retain = 4\n",
                                      "t.ini", &c),
                     0);
    ck_assert_int_eq(kvm_jobcfg_check(c), 0);
    kvm_config_free(&c);
    ck_assert_int_eq(
        kvm_config_parse("[model]\npath = m.bin\ncontext = 64\n[compress]\nmethod = streaming\nqueries = 0\n"
                         "retain = 0\n",
                         "t.ini", &c),
        0);
    ck_assert_int_eq(kvm_jobcfg_check(c), 0);
    kvm_config_free(&c);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* [run] bind in a form the run cannot bind (garbage) passed --dump-config (exit 0) and was refused
 * by run only when it bound its sockets, as "endpoint garbage: ..." naming neither key nor file.
 * run, its dump and calibrate refuse it at start now (exit 2), naming [run] bind and the file; and
 * --bind with PORT 0 or 65535, refused as "PORT in [1, 65534]" with no reason, says why. */
START_TEST(test_run_bind_checked)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[compress]\nmethod = streaming\n[run]\nbind = garbage\n");
    char want[4400];
    snprintf(want, sizeof want, "%s: [run] bind = garbage: endpoint garbage: expected ipc://DIR or tcp://HOST:PORT",
             cfg);
    const char *cmds[] = {"run --dump-config", "run --corpus", "calibrate --docs"};
    for (int i = 0; i < 3; i++) {
        snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill %s %s --config '%s'", kvm_test_bin(), cmds[i],
                 i ? kvm_test_data_path("corpus") : "", cfg);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, want), "%s: exit %d: %s", cmds[i], rc, err);
        free(out);
        free(err);
    }
    /* a non-local bind without [security] keys: the dump refuses it as the run does, naming the file */
    char cfg3[4400];
    snprintf(cfg3, sizeof cfg3, "%s.nonlocal.ini", cfg);
    snprintf(cmd, sizeof cmd,
             "[model]\npath = %s\ncontext = 64\n[store]\npath = %s\n[run]\nbind = tcp://0.0.0.0:5795\n",
             kvm_test_data_path("models/stories260K.bin"), store);
    ck_assert_int_eq(kvm_test_write_file(cfg3, cmd, strlen(cmd)), 0);
    snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill run --dump-config --config '%s'", kvm_test_bin(), cfg3);
    int rc3 = kvm_test_run(cmd, &out, &err);
    snprintf(want, sizeof want, "[run] bind in %s: tcp://0.0.0.0:5795 is not local", cfg3);
    ck_assert_msg(rc3 == 2 && strstr(err, want), "exit %d: %s", rc3, err);
    free(out);
    free(err);
    snprintf(cfg + strlen(cfg) - 4, 8, "2.ini"); /* a config without the bind, for --bind */
    snprintf(cmd, sizeof cmd, "[model]\npath = %s\ncontext = 64\n[store]\npath = %s\n",
             kvm_test_data_path("models/stories260K.bin"), store);
    ck_assert_int_eq(kvm_test_write_file(cfg, cmd, strlen(cmd)), 0);
    const struct {
        const char *bind, *why;
    } ports[] = {{"tcp://127.0.0.1:0", "the workers must be told the port to connect to, so it cannot be 0"},
                 {"tcp://127.0.0.1:65535", "the data socket binds PORT+1"}};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill run --config '%s' --corpus '%s' --bind %s", kvm_test_bin(),
                 cfg, kvm_test_data_path("corpus"), ports[i].bind);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, "kvmill run: --bind: ") && strstr(err, ports[i].why), "%s: exit %d: %s",
                      ports[i].bind, rc, err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* `run --metrics ""` was taken as "no metrics" (the key's empty value) and the run went on without
 * a word; `--bind ""` was refused as "endpoint : ...". Both are refused now as empty (exit 2,
 * naming the flag), before any document. */
START_TEST(test_run_empty_flag_values)
{
    char store[4300], cfg[4300], cmd[16384], *out = NULL, *err = NULL;
    char *dir = make_store(store, sizeof store, cfg, sizeof cfg);
    config_append(cfg, "[compress]\nmethod = streaming\n");
    const char *flags[] = {"metrics", "bind"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "timeout -k 2 60 %s/kvmill run --config '%s' --corpus '%s' --%s ''", kvm_test_bin(),
                 cfg, kvm_test_data_path("corpus"), flags[i]);
        int rc = kvm_test_run(cmd, &out, &err);
        char want[64];
        snprintf(want, sizeof want, "kvmill run: --%s is empty: name the ", flags[i]);
        ck_assert_msg(rc == 2 && strstr(err, want) && !strstr(out, "summary:"), "--%s '': exit %d: %s%s", flags[i], rc,
                      out, err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("newuser");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {
        {"alias_set_twice", test_alias_set_twice},
        {"stats_missing_store", test_stats_missing_store},
        {"serve_truncated_store", test_serve_truncated_store},
        {"serve_kill9_workers_stop", test_serve_kill9_workers_stop},
        {"old_and_new_flag_together", test_old_and_new_flag_together},
        {"keygen_makes_folder", test_keygen_makes_folder},
        {"keygen_force_secret_private", test_keygen_force_secret_private},
        {"key_file_directory", test_key_file_directory},
        {"key_file_fifo", test_key_file_fifo},
        {"secret_key_mode", test_secret_key_mode},
        {"run_help_model_formats", test_run_help_model_formats},
        {"help_lines_agree", test_help_lines_agree},
        {"no_eta_from_failures", test_no_eta_from_failures},
        {"names_escaped", test_names_escaped},
        {"calibrate_jobcfg_check", test_calibrate_jobcfg_check},
        {"ask_bad_endpoint", test_ask_bad_endpoint},
        {"corpus_dangling_link_fails_alone", test_corpus_dangling_link_fails_alone},
        {"jsonl_bom", test_jsonl_bom},
        {"corpus_names_not_utf8_or_long", test_corpus_names_not_utf8_or_long},
        {"config_text_not_utf8", test_config_text_not_utf8},
        {"long_tmpdir", test_long_tmpdir},
        {"deep_model_path_run", test_deep_model_path_run},
        {"run_store_in_corpus_folder", test_run_store_in_corpus_folder},
        {"run_duplicate_in_corpus_said", test_run_duplicate_in_corpus_said},
        {"deep_model_path_serve", test_deep_model_path_serve},
        {"decode_worker_missing_store", test_decode_worker_missing_store},
        {"budget_and_ratio_both_set", test_budget_and_ratio_both_set},
        {"missing_model_names_config_key", test_missing_model_names_config_key},
        {"device_list_empty_item", test_device_list_empty_item},
        {"stage_store_missing", test_stage_store_missing},
        {"log_name_control_bytes", test_log_name_control_bytes},
        {"calibrate_config_docs_file", test_calibrate_config_docs_file},
        {"calibrate_empty_strategy_name", test_calibrate_empty_strategy_name},
        {"polykv_strategy_name_refused", test_polykv_strategy_name_refused},
        {"no_training_queries", test_no_training_queries},
        {"run_bind_checked", test_run_bind_checked},
        {"run_empty_flag_values", test_run_empty_flag_values},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(suite()); }
