/* check_serve_input.c: kvmill serve and kvmill ask under input the server cannot take (rel19):
 * a request over [serve] max_message_bytes is an error answer at once, naming the document (or
 * prompt) and the limit, not a request ZeroMQ drops with its connection while the client waits
 * for its timeout. Runs a real server on the embedded stories260K over ipc://. */
#include "tests/util/kvm_test.h"

#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

static char *g_dir;
static char g_cfg[4096], g_front[4200], g_log[4200];
static pid_t g_serve;

static void setup(void)
{
    g_dir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(g_dir);
    snprintf(g_front, sizeof g_front, "ipc://%s/front", g_dir);
    snprintf(g_log, sizeof g_log, "%s/serve.log", g_dir);
    g_serve = 0;
}

static void teardown(void)
{
    if (g_serve > 0) {
        kill(g_serve, SIGTERM);
        waitpid(g_serve, NULL, 0);
    }
    kvm_test_rmtree(g_dir);
    free(g_dir);
}

/* A config of the embedded stories260K (method full) with `serve_extra` lines in [serve], an
 * empty store, and `kvmill serve` started on it (ready). */
static void start_serve(const char *serve_extra)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n"
             "[compress]\nmethod = full\n"
             "[store]\npath = %s/store\nmap_size_mb = 16\n"
             "[stages]\nbin_dir = %s\n"
             "[run]\nrun_dir = %s/run\nheartbeat_ms = 100\nliveness = 50\n"
             "[serve]\n%s\n",
             kvm_test_data_path("models/stories260K.bin"), g_dir, kvm_test_bin(), g_dir, serve_extra);
    snprintf(g_cfg, sizeof g_cfg, "%s/test.ini", g_dir);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    char sp[4200];
    snprintf(sp, sizeof sp, "%s/store", g_dir);
    kvm_test_store_create(sp);
    const char *argv[] = {"--config", g_cfg, "--bind", g_front, NULL};
    ck_assert_int_eq(kvm_test_serve_start(argv, g_log, 60, &g_serve), -1);
}

/* `n` bytes of story text (ASCII: sent as doc_text) into the new file g_dir/name, whose path
 * goes into path[4300]; returns path. */
static const char *story_file(const char *name, size_t n, char *path)
{
    const char *words = "Once upon a time there was a little girl named Lily. ";
    size_t wl = strlen(words);
    char *b = malloc(n);
    ck_assert_ptr_nonnull(b);
    for (size_t i = 0; i < n; i++)
        b[i] = words[i % wl];
    snprintf(path, 4300, "%s/%s", g_dir, name);
    ck_assert_int_eq(kvm_test_write_file(path, b, n), 0);
    free(b);
    return path;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* `kvmill ask --connect g_front --timeout 60 ARGS`, its stderr into *err; *secs: how long it took. */
static int ask(const char *args, char **err, double *secs)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' ask --connect '%s' --timeout 60 %s", kvm_test_bin(), g_front, args);
    double t0 = now_s();
    int rc = kvm_test_run(cmd, NULL, err);
    *secs = now_s() - t0;
    return rc;
}

static void assert_contains(const char *hay, const char *needle)
{
    ck_assert_msg(hay && strstr(hay, needle), "expected \"%s\" in:\n%s", needle, hay ? hay : "(null)");
}

/* A --doc file over the server's [serve] max_message_bytes: before, ZeroMQ's ZMQ_MAXMSGSIZE
 * dropped the request with its connection and ask waited its whole --timeout for "no answer";
 * now the answer comes at once, an error naming the document's size, the limit and what to do,
 * and ask names the file. A prompt over the limit likewise; a document within it is answered. */
START_TEST(test_request_over_max_message_bytes)
{
    start_serve("max_message_bytes = 65536\nmax_prompt_tokens = 100000");
    char args[9000], *err = NULL;
    double secs = 0;
    char big[4300], small[4300], prompt[4300];
    story_file("big.txt", 200000, big);
    snprintf(args, sizeof args, "--doc '%s' --prompt ' Then' -n 4", big);
    int rc = ask(args, &err, &secs);
    ck_assert_msg(rc == 1 && secs < 20, "ask exited %d after %.1f s (an error answer at once expected): %s", rc, secs,
                  err);
    assert_contains(err, "error from the server (value out of range) about --doc ");
    assert_contains(err, big);
    assert_contains(err, "[serve] max_message_bytes = 65536");
    assert_contains(err, "the document sent with it is 200000 bytes (doc_text)");
    assert_contains(err, "--doc-name");
    free(err);
    err = NULL;
    /* the prompt is the large part: said so */
    story_file("small.txt", 2000, small);
    story_file("prompt.txt", 100000, prompt);
    snprintf(args, sizeof args, "--doc '%s' --prompt-file '%s' -n 4", small, prompt);
    rc = ask(args, &err, &secs);
    ck_assert_msg(rc == 1 && secs < 20, "ask exited %d after %.1f s: %s", rc, secs, err);
    assert_contains(err, "the prompt is 100000 bytes");
    free(err);
    err = NULL;
    /* within the limit: the usual answer (no cache stored: method full has none, said as such) */
    snprintf(args, sizeof args, "--doc '%s' --prompt ' Then' -n 4", small);
    rc = ask(args, &err, &secs);
    ck_assert_msg(rc == 1 && secs < 20, "ask exited %d after %.1f s: %s", rc, secs, err);
    assert_contains(err, "no compressed cache for this document");
    free(err);
}
END_TEST

int main(void)
{
    Suite *su = suite_create("serve_input");
    TCase *tc = tcase_create("request_over_max_message_bytes");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_request_over_max_message_bytes);
    suite_add_tcase(su, tc);
    return kvm_test_run_suite(su);
}
