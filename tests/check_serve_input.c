/* check_serve_input.c: kvmill serve and kvmill ask with a request over [serve] max_message_bytes
 * (rel19): a document is served from the beginning that fits when that fixes its [model]
 * context's tokens, else, as for a prompt too large, an error answer comes at once naming the
 * sizes and the limit; before, ZeroMQ dropped the request with its connection and the client
 * waited for its timeout. Runs a real server on the embedded stories260K over ipc://. */
#include "common/kvm_error.h"
#include "pipeline/kvm_serve.h"
#include "proto/kvm_proto.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

static char *g_dir;
static char g_cfg[4096], g_front[4200], g_log[4200];
static pid_t g_serve;

static void setup(void)
{
    kvm_test_serve_dirs(&g_dir, g_front, sizeof g_front, g_log, sizeof g_log);
    g_serve = 0;
}

static void teardown(void) { kvm_test_serve_cleanup(g_serve, g_dir); }

/* A config of the embedded stories260K at `context` (method full) with `serve_extra` lines in
 * [serve], and an empty store. */
static void write_config(int context, const char *serve_extra)
{
    char text[8192];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = %d\n"
             "[compress]\nmethod = full\n"
             "[store]\npath = %s/store\nmap_size_mb = 16\n"
             "[stages]\nbin_dir = %s\n"
             "[run]\nrun_dir = %s/run\nheartbeat_ms = 100\nliveness = 50\n"
             "[serve]\n%s\n",
             kvm_test_data_path("models/stories260K.bin"), context, g_dir, kvm_test_bin(), g_dir, serve_extra);
    snprintf(g_cfg, sizeof g_cfg, "%s/test.ini", g_dir);
    ck_assert_int_eq(kvm_test_write_file(g_cfg, text, strlen(text)), 0);
    char sp[4200];
    snprintf(sp, sizeof sp, "%s/store", g_dir);
    kvm_test_store_create(sp);
}

/* `kvmill serve --config g_cfg --bind g_front`, waited for until ready. */
static void start_serve(void)
{
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

/* `kvmill ask --connect g_front --timeout 60 ARGS`, its stdout into *out (NULL: dropped) and
 * stderr into *err; *secs: how long it took. */
static int ask(const char *args, char **out, char **err, double *secs)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' ask --connect '%s' --timeout 60 %s", kvm_test_bin(), g_front, args);
    double t0 = now_s();
    int rc = kvm_test_run(cmd, out, err);
    *secs = now_s() - t0;
    return rc;
}

static void assert_contains(const char *hay, const char *needle)
{
    ck_assert_msg(hay && strstr(hay, needle), "expected \"%s\" in:\n%s", needle, hay ? hay : "(null)");
}

static void assert_lacks(const char *hay, const char *needle)
{
    ck_assert_msg(hay && !strstr(hay, needle), "did not expect \"%s\" in:\n%s", needle, hay ? hay : "(null)");
}

/* `kvmill run --config g_cfg --corpus corpus` (method full: every document's cache stored). */
static void run_corpus(const char *corpus)
{
    char cmd[16384], *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), g_cfg, corpus);
    int rc = kvm_test_run(cmd, NULL, &err);
    ck_assert_msg(rc == 0, "kvmill run exited %d: %s", rc, err);
    free(err);
}

/* A --doc file over the server's [serve] max_message_bytes. Before, ZeroMQ's ZMQ_MAXMSGSIZE
 * dropped the request with its connection and ask waited its whole --timeout for "no answer".
 * Now the server hands a decode worker the document's beginning that fits (doc_size, protocol
 * revision 9), which holds far more than the 128 tokens of [model] context: the answer is the
 * stored cache's, the same as asking by name. A prompt over the limit is an error at once. */
START_TEST(test_document_over_max_message_bytes)
{
    char corpus[4300], big[4300], small[4300], prompt[4300];
    snprintf(corpus, sizeof corpus, "%s/corpus", g_dir);
    ck_assert_int_eq(mkdir(corpus, 0700), 0);
    story_file("corpus/big.txt", 200000, big);
    write_config(128, "max_message_bytes = 65536\nmax_prompt_tokens = 100000");
    run_corpus(corpus);
    start_serve();
    char args[9000], *out = NULL, *by_name = NULL, *err = NULL;
    double secs = 0;
    snprintf(args, sizeof args, "--doc '%s' --prompt ' Then' -n 8", big);
    int rc = ask(args, &out, &err, &secs);
    ck_assert_msg(rc == 0, "ask --doc of 200000 bytes exited %d after %.1f s (an answer expected): %s", rc, secs, err);
    free(err);
    ck_assert_int_eq(ask("--doc-name big.txt --prompt ' Then' -n 8", &by_name, &err, &secs), 0);
    ck_assert_str_eq(out, by_name);
    free(err);
    free(out);
    free(by_name);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "its document of 200000 bytes makes it");
    assert_contains(log, "a decode worker gets the document's first");
    free(log);
    /* the prompt is the large part: an error at once, saying so */
    story_file("small.txt", 2000, small);
    story_file("prompt.txt", 100000, prompt);
    snprintf(args, sizeof args, "--doc '%s' --prompt-file '%s' -n 4", small, prompt);
    err = NULL;
    rc = ask(args, NULL, &err, &secs);
    ck_assert_msg(rc == 1 && secs < 20, "ask exited %d after %.1f s (an error answer at once expected): %s", rc, secs,
                  err);
    /* the prompt, not the --doc file, is at fault: the file is not named */
    assert_contains(err, "error from the server (value out of range): request of ");
    assert_lacks(err, "about --doc");
    assert_contains(err, "[serve] max_message_bytes = 65536: the prompt is 100000 bytes");
    free(err);
}
END_TEST

/* A document whose beginning within [serve] max_message_bytes (1 KiB) is too short to fix the
 * [model] context's 384 tokens: an error answer at once naming the document's bytes, the bytes
 * that came, their tokens and the context. Before: no answer until ask's --timeout. */
START_TEST(test_document_beginning_too_short)
{
    char doc[4300];
    story_file("doc.txt", 3000, doc);
    write_config(384, "max_message_bytes = 1024");
    start_serve();
    char args[9000], *err = NULL;
    double secs = 0;
    snprintf(args, sizeof args, "--doc '%s' --prompt ' Then' -n 4", doc);
    int rc = ask(args, NULL, &err, &secs);
    ck_assert_msg(rc == 1 && secs < 20, "ask exited %d after %.1f s (an error answer at once expected): %s", rc, secs,
                  err);
    assert_contains(err, "about --doc ");
    assert_contains(err, doc);
    assert_contains(err, "the document is 3000 bytes, more than this server's [serve] max_message_bytes takes");
    assert_contains(err, "tokens, BOS included), and fixing the first 384 tokens ([model] context) its cache is "
                         "made of takes a longer beginning (up to 5192 bytes");
    free(err);
}
END_TEST

/* A cut document on a CurveZMQ front end with compute_missing: its missing cache is computed
 * under the client key's allowance and the question answered. Before, the message rebuilt with
 * the document's beginning lost ZeroMQ's User-Id (the client key), so the broker found no client
 * for the grant, never granted it, and the worker answered that the cache is missing. */
START_TEST(test_cut_document_keyed_compute_missing)
{
    kvm_test_keygen(g_dir, "server");
    kvm_test_keygen(g_dir, "client");
    kvm_test_keygen(g_dir, "worker");
    char auth[4200], cmd[9000], serve[12000], big[4300];
    snprintf(auth, sizeof auth, "%s/authorized", g_dir);
    snprintf(cmd, sizeof cmd, "mkdir '%s' && cp '%s/client.public' '%s/worker.public' '%s/'", auth, g_dir, g_dir, auth);
    ck_assert_int_eq(system(cmd), 0);
    /* [security] follows [serve], the config's last section */
    snprintf(serve, sizeof serve,
             "max_message_bytes = 65536\ncompute_missing = true\nmax_new_caches_per_key = 1\n"
             "[security]\nserver_secret_key = %s/server.secret\nserver_public_key = %s/server.public\n"
             "client_public_key = %s/worker.public\nclient_secret_key = %s/worker.secret\nauthorized_keys = %s",
             g_dir, g_dir, g_dir, g_dir, auth);
    write_config(128, serve);
    story_file("big.txt", 200000, big);
    start_serve();
    char args[9000], *out = NULL, *err = NULL;
    double secs = 0;
    snprintf(args, sizeof args,
             "--doc '%s' --prompt ' Then' -n 8 --server-key '%s/server.public' --client-public '%s/client.public' "
             "--client-secret '%s/client.secret'",
             big, g_dir, g_dir, g_dir);
    int rc = ask(args, &out, &err, &secs);
    ck_assert_msg(rc == 0, "keyed ask --doc of 200000 bytes (missing cache) exited %d after %.1f s: %s", rc, secs, err);
    ck_assert_int_gt((int)strlen(out), 0);
    free(out);
    free(err);
    char *log = kvm_test_read_file(g_log, NULL);
    assert_contains(log, "a decode worker gets the document's first");
    assert_contains(log, "of max_new_caches_per_key = 1 for client key");
    free(log);
}
END_TEST

/* doc_size (revision 9) travels, and is refused where it cannot describe a cut document. */
START_TEST(test_doc_size_codec)
{
    kvm_proto_ask a = {.request_id = 7,
                       .doc_text = kvm_proto_str_c("Once upon a time"),
                       .prompt = kvm_proto_str_c(" Then"),
                       .max_new_tokens = 4,
                       .doc_size = 1000};
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_ask_encode(&a, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_ask b;
    ck_assert_msg(kvm_proto_ask_decode(m, &b) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(b.doc_size, 1000);
    kvm_msg_free(&m);
    a.doc_size = 16; /* not more than the bytes given */
    ck_assert_int_ne(kvm_proto_ask_encode(&a, &m), 0);
    assert_contains(kvm_errmsg(), "'doc_size' = 16 with 16 bytes");
    a.doc_size = 1000, a.doc_text = (kvm_proto_str){NULL, 0}, a.doc_name = kvm_proto_str_c("x.txt");
    ck_assert_int_ne(kvm_proto_ask_encode(&a, &m), 0); /* a name has no beginning */
}
END_TEST

/* An error answer whose message is not UTF-8 (a path's bytes) or was cut mid-character (serve
 * cuts a decode worker's error at 900 bytes) still encodes: before, the encoder refused it and
 * the client got no answer and waited for its timeout. */
START_TEST(test_error_answer_not_utf8)
{
    char why[1024], big[1500];
    big[0] = 'x';
    for (int i = 1; i + 3 <= (int)sizeof big - 1; i += 3)
        memcpy(big + i, "\xe2\x82\xac", 3);
    big[sizeof big - 1] = '\0';
    snprintf(why, sizeof why, "decode worker w failed: %.*s", 900, big); /* 900 = 1 + 299·3 + 2: inside a character */
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_serve_error_answer(9, KVM_EIO, why, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_answer a;
    ck_assert_msg(kvm_proto_answer_decode(m, &a) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(a.request_id, 9);
    ck_assert_int_eq(a.status, KVM_EIO);
    ck_assert_uint_eq(a.message.len, strlen("decode worker w failed: ") + 900); /* the cut character's 2 bytes: '?' */
    ck_assert_int_eq(memcmp(a.message.ptr + a.message.len - 5, "\xe2\x82\xac??", 5), 0);
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_serve_error_answer(10, KVM_ENOTFOUND, "no file /data/\xff\xfe.txt", &m), 0);
    ck_assert_int_eq(kvm_proto_answer_decode(m, &a), 0);
    ck_assert_int_eq(a.message.len, strlen("no file /data/??.txt"));
    ck_assert_int_eq(memcmp(a.message.ptr, "no file /data/??.txt", a.message.len), 0);
    kvm_msg_free(&m);
}
END_TEST

static void add(Suite *su, const char *name, const TTest *fn, int timeout)
{
    TCase *tc = tcase_create(name);
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, timeout);
    tcase_add_test(tc, fn);
    suite_add_tcase(su, tc);
}

int main(void)
{
    Suite *su = suite_create("serve_input");
    add(su, "document_over_max_message_bytes", test_document_over_max_message_bytes, 240);
    add(su, "document_beginning_too_short", test_document_beginning_too_short, 120);
    add(su, "cut_document_keyed_compute_missing", test_cut_document_keyed_compute_missing, 240);
    add(su, "doc_size_codec", test_doc_size_codec, 10);
    add(su, "error_answer_not_utf8", test_error_answer_not_utf8, 10);
    return kvm_test_run_suite(su);
}
