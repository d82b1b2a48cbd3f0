/* check_eval_review.c: `kvmill eval` refusing what cannot be what its command line asks for,
 * before any work: a one-token [eval] continuation, a budget or ratio that keeps the whole
 * context (sculpt family, --task cases), columns that resolve to the same one, method options
 * that cannot work, and the numbers its messages print. */
#include "common/kvm_error.h"
#include "pipeline/kvm_config.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define EVAL                                                                                                           \
    "%s/kvmill eval --model %s/models/stories260K.bin --docs %s/corpus/doc_000.txt --context 64 --continuation 16 "

/* Runs `kvmill eval` with args on data/corpus/doc_000.txt at --context 64; returns the exit
 * status, with stdout and stderr in *out and *err (the caller frees them). */
static int run_eval(const char *args, char **out, char **err)
{
    char full[4096];
    snprintf(full, sizeof full, EVAL "%s", kvm_test_bin(), kvm_test_data(), kvm_test_data(), args);
    return kvm_test_run(full, out, err);
}

/* eval with args exits 2 with msg (and, when not NULL, msg2) on stderr, and nothing on stdout:
 * refused before any document was run. */
static void expect_refused(const char *args, const char *msg, const char *msg2)
{
    char *out = NULL, *err = NULL;
    int st = run_eval(args, &out, &err);
    ck_assert_msg(st == 2, "%s: exit %d, stderr %s", args, st, err);
    ck_assert_msg(strstr(err, msg), "%s: stderr '%s' lacks '%s'", args, err, msg);
    ck_assert_msg(!msg2 || strstr(err, msg2), "%s: stderr '%s' lacks '%s'", args, err, msg2);
    ck_assert_msg(!strstr(out, "== "), "%s: a document ran before the refusal: %s", args, out);
    free(out);
    free(err);
}

/* [eval] continuation = 1 scored only the context's own last row (full KV's): every KL 0, and
 * calibrate stored a strategy chosen on nothing as the store's default. Its minimum is 2, as
 * eval's and calibrate's --continuation. */
START_TEST(test_config_continuation_one)
{
    kvm_config *c = NULL;
    int rc = kvm_config_parse("[model]\npath = /m\n[eval]\ncontinuation = 1\n", "t.ini", &c);
    ck_assert_msg(rc == KVM_EINVAL, "continuation = 1 gave %d", rc);
    ck_assert_ptr_null(c);
    ck_assert_msg(strstr(kvm_errmsg(), "t.ini:4: [eval] continuation: 1 is outside [2,"), "message '%s'", kvm_errmsg());
    ck_assert_int_eq(kvm_config_parse("[model]\npath = /m\n[eval]\ncontinuation = 2\n", "t.ini", &c), 0);
    kvm_config_free(&c);
}
END_TEST

/* Messages print what was given: a ratio as typed (%g printed 0.99999999 as "--ratio 1", a ratio
 * that was never given), an integer setting's bounds as integers (%g printed 2^24 as 1.67772e+07). */
START_TEST(test_messages_numbers)
{
    expect_refused("--method h2o --ratio 0.99999999", "--ratio 0.99999999 of --context 64 keeps 64 entries", NULL);
    expect_refused("--method h2o --ratio 0.5,1.0", "--ratio 1.0 keeps every entry", NULL);
    expect_refused("--method sculpt --ratio 0.5 --queries 100000000",
                   "--queries 100000000: expected an integer in "
                   "[0, 16777216]",
                   NULL);
    expect_refused("--method sculpt --ratio 0.5 --future 2147483647", "expected an integer in [0, 1048576]", NULL);
    expect_refused("--method sculpt --ratio 0.5 --seed 1e300", "expected an integer in [0, 9007199254740992]", NULL);
    expect_refused("--method sculpt --ratio 0.5 --lambda -1", "expected a number in [", NULL);
}
END_TEST

/* A sculpt-family --ratio whose k = round(r·(N − m)) distilled entries and the m retained come
 * to the whole context ran as a compression result (budget 64.00, KL 0); h2o's was refused. */
START_TEST(test_sculpt_ratio_whole_context)
{
    expect_refused("--method sculpt,h2o --ratio 0.99", "--method sculpt: --ratio 0.99 of the compress zone",
                   "keeps 32 distilled entries beside the 32 retained, the whole context");
    const char *methods[] = {"am", "kvzip", "selectfit", "joint-fixed"};
    for (int i = 0; i < 4; i++) {
        char args[256], msg[128];
        snprintf(args, sizeof args, "--method %s --ratio 0.999 --retain 8", methods[i]);
        snprintf(msg, sizeof msg, "--method %s: --ratio 0.999 of the compress zone", methods[i]);
        expect_refused(args, msg, "keeps 56 distilled entries beside the 8 retained");
    }
    /* just below: 31 distilled entries and 32 retained */
    char *out = NULL, *err = NULL;
    int st = run_eval("--method sculpt --ratio 0.97 --queries 16 --iterations 2 --rounds 1", &out, &err);
    ck_assert_msg(st == 0 && strstr(out, "63.00"), "exit %d, stdout %s, stderr %s", st, out, err);
    free(out);
    free(err);
}
END_TEST

/* Items that resolve to the same (method, options, entries) ran as two identical rows: two ratios
 * rounding to one budget, full at several budgets; full,full was refused as "full at --ratio 1 is
 * given twice (..., --ratio '1')" though no --ratio was given. */
START_TEST(test_duplicate_columns)
{
    expect_refused("--method h2o --ratio 0.25,0.251",
                   "--method h2o at --ratio 0.25 and --method h2o at --ratio "
                   "0.251 are the same column",
                   "both keeping 16 entries per KV head of --context 64");
    expect_refused("--method sculpt --retain 8 --ratio 0.3,0.31",
                   "--method sculpt at --ratio 0.3 and --method "
                   "sculpt at --ratio 0.31 are the same column",
                   "both keeping 25 entries");
    expect_refused("--method sculpt:retain=8,sculpt --retain 8 --budget 16",
                   "--method sculpt:retain=8 at --budget 16 and --method sculpt at --budget 16 are the same column",
                   NULL);
    char *out = NULL, *err = NULL;
    int st = run_eval("--method full,full", &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "--method full is given twice") && !strstr(err, "ratio"), "exit %d, stderr %s",
                  st, err);
    free(out);
    free(err);
    /* full's one column still checks every item of the list */
    expect_refused("--method full --budget 16,abc", "--budget: 'abc' is not an integer", NULL);
    expect_refused("--method full --budget 16,16", "--budget 16 is given twice", NULL);
    /* full is one column whatever the budgets; the others keep theirs */
    st = run_eval("--method full,h2o --budget 16,32", &out, &err);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
    const char *mean = strstr(out, "== mean");
    ck_assert_msg(mean, "no mean table: %s", out);
    int n_full = 0, n_h2o = 0;
    for (const char *p = mean; (p = strstr(p, "\nfull ")); p++)
        n_full++;
    for (const char *p = mean; (p = strstr(p, "\nh2o ")); p++)
        n_h2o++;
    ck_assert_msg(n_full == 1 && n_h2o == 2, "full rows %d, h2o rows %d: %s", n_full, n_h2o, out);
    free(out);
    free(err);
    /* distinct columns still run: ratios resolving to different budgets */
    st = run_eval("--method h2o --ratio 0.25,0.26", &out, &err);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, err);
    free(out);
    free(err);
}
END_TEST

/* --task: a case's context shrinks to its document; a budget at or above it ran the method
 * uncompressed (summary "h2o @ 300", full KV's answers) or, for sculpt, failed after the work
 * (leaving --csv's .part). Refused before any prefill, naming the case and its document. */
START_TEST(test_task_budget_case_context)
{
    char *dir = kvm_test_tmpdir(), doc[4200], csv[4200], part[4300], cmd[16384];
    snprintf(doc, sizeof doc, "%s/short.txt", dir);
    snprintf(csv, sizeof csv, "%s/t.csv", dir);
    snprintf(part, sizeof part, "%s.part", csv);
    FILE *in = fopen(kvm_test_data_path("corpus/doc_000.txt"), "rb"), *out = fopen(doc, "wb");
    ck_assert_ptr_nonnull(in);
    ck_assert_ptr_nonnull(out);
    char text[420];
    ck_assert_int_eq(fread(text, 1, sizeof text, in), sizeof text);
    ck_assert_int_eq(fwrite(text, 1, sizeof text, out), sizeof text);
    fclose(in);
    fclose(out);
    const struct {
        const char *methods, *msg;
    } want[] = {
        {"h2o,snapkv --budget 300", "--budget 300 is not below the context of task case 0 (short), "},
        {"sculpt --retain 8 --budget 300", "--budget 300 is not below the context of task case 0 (short), "},
        {"sculpt --retain 300 --ratio 0.5", "the retain zone of 300 tokens is not below the context of task case 0"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        snprintf(cmd, sizeof cmd,
                 "%s/kvmill eval --model %s/models/stories260K.bin --docs %s --context 400 --task passkey --cases 2 "
                 "--method %s --csv %s",
                 kvm_test_bin(), kvm_test_data(), doc, want[i].methods, csv);
        char *o = NULL, *e = NULL;
        int st = kvm_test_run(cmd, &o, &e);
        struct stat sb;
        ck_assert_msg(st == 2 && strstr(e, want[i].msg), "%s: exit %d, stderr %s", want[i].methods, st, e);
        ck_assert_msg(!strstr(o, "case "), "%s: a case ran before the refusal: %s", want[i].methods, o);
        ck_assert_msg(stat(csv, &sb) != 0 && stat(part, &sb) != 0, "%s: --csv or its .part was written",
                      want[i].methods);
        free(o);
        free(e);
    }
    /* a budget below every case's context runs */
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --docs %s --context 400 --task passkey --cases 2 "
             "--method h2o --budget 200",
             kvm_test_bin(), kvm_test_data(), doc);
    char *o = NULL, *e = NULL;
    int st = kvm_test_run(cmd, &o, &e);
    ck_assert_msg(st == 0, "--budget 200: exit %d, stderr %s", st, e);
    free(o);
    free(e);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Method options that cannot work at this context failed after the prefill (exit 1, every other
 * method's results lost): a retain zone not below the context in a polykv strategy's sculpt/kvzip
 * layers (sculpt:retain=100 was refused up front), and query_source repeat where 2N + P exceeds
 * the model's window (known once the model is open). Refused before any prefill, exit 2. */
START_TEST(test_solver_options_up_front)
{
    char *dir = kvm_test_tmpdir(), strat[4200], cmd[16384], args[8400];
    snprintf(strat, sizeof strat, "%s/s.bin", dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvmill calibrate --model %s/models/stories260K.bin --docs %s/corpus/doc_000.txt --budget 12 "
             "--context 40 --continuation 8 --phases prefill --kvzip --sculpt-opts queries=16 --out %s",
             kvm_test_bin(), kvm_test_data(), kvm_test_data(), strat);
    char *o = NULL, *e = NULL;
    int st = kvm_test_run(cmd, &o, &e);
    ck_assert_msg(st == 0, "calibrate: exit %d, stderr %s", st, e);
    free(o);
    free(e);
    snprintf(args, sizeof args, "--method h2o,polykv:%s:retain=100 --budget 16", strat);
    expect_refused(args,
                   "the retain zone of 100 tokens (of its strategy's sculpt and kvzip layers) is not below "
                   "--context 64",
                   NULL);
    snprintf(args, sizeof args, "--method polykv:%s --budget 16 --retain 64", strat);
    expect_refused(args, "the retain zone of 64 tokens (of its strategy's sculpt and kvzip layers)", NULL);
    /* --context 64 --continuation 16 fits; 300 does not: 2 x 300 + the prompt > 512 */
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --docs %s/corpus/doc_000.txt --context 300 "
             "--continuation 16 --method h2o,kvzip:query_source=repeat --budget 64",
             kvm_test_bin(), kvm_test_data(), kvm_test_data());
    st = kvm_test_run(cmd, &o, &e);
    ck_assert_msg(st == 2 && strstr(e, "--method kvzip:query_source=repeat: query_source repeat needs 2N + P = ") &&
                      strstr(e, "but the model's window is 512 tokens") && !strstr(o, "== "),
                  "exit %d, stdout %s, stderr %s", st, o, e);
    free(o);
    free(e);
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s/models/stories260K.bin --docs %s/corpus/doc_000.txt --context 300 "
             "--continuation 16 --method polykv:%s:query_source=repeat --budget 64",
             kvm_test_bin(), kvm_test_data(), kvm_test_data(), strat);
    st = kvm_test_run(cmd, &o, &e);
    ck_assert_msg(st == 2 && strstr(e, "query_source repeat (its strategy's sculpt and kvzip layers) needs") &&
                      !strstr(o, "== "),
                  "exit %d, stdout %s, stderr %s", st, o, e);
    free(o);
    free(e);
    /* the strategy at options that work runs */
    snprintf(args, sizeof args, "--method polykv:%s:retain=8 --budget 16", strat);
    st = run_eval(args, &o, &e);
    ck_assert_msg(st == 0, "exit %d, stderr %s", st, e);
    free(o);
    free(e);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *eval_review_suite(void)
{
    Suite *s = suite_create("eval_review");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {
        {"config_continuation_one", test_config_continuation_one},
        {"messages_numbers", test_messages_numbers},
        {"sculpt_ratio_whole_context", test_sculpt_ratio_whole_context},
        {"duplicate_columns", test_duplicate_columns},
        {"task_budget_case_context", test_task_budget_case_context},
        {"solver_options_up_front", test_solver_options_up_front},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(eval_review_suite()); }
