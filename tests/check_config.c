/* check_config.c: the table-driven INI configuration: defaults, ${VAR:-default}, paths,
 * and an error naming file, line and key for every kind of bad input. */
#include "pipeline/kvm_config.h"
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void expect_bad(const char *text, const char *needle)
{
    kvm_config *c = (kvm_config *)0x1;
    int rc = kvm_config_parse(text, "t.ini", &c);
    ck_assert_msg(rc == KVM_EINVAL, "'%s' gave %d", text, rc);
    ck_assert_ptr_null(c);
    ck_assert_msg(strstr(kvm_errmsg(), needle), "'%s': message '%s' lacks '%s'", text, kvm_errmsg(), needle);
}

START_TEST(test_defaults_and_values)
{
    kvm_config *c;
    setenv("KVMTEST_MODEL", "/m/stories.bin", 1);
    unsetenv("KVMTEST_UNSET");
    ck_assert_int_eq(kvm_config_parse("[model]\npath = ${KVMTEST_MODEL}\ncontext = 128\n"
                                      "[compress]\nratio = 0.5 ; inline comment\nmethod = snapkv\nbias = yes\n"
                                      "[store]\npath = ${KVMTEST_UNSET:-rel/store.lmdb}\n",
                                      "t.ini", &c), 0);
    ck_assert_str_eq(kvm_config_str(c, "model", "path"), "/m/stories.bin");
    ck_assert_int_eq(kvm_config_int(c, "model", "context"), 128);
    ck_assert_double_eq(kvm_config_float(c, "compress", "ratio"), 0.5);
    ck_assert_str_eq(kvm_config_str(c, "compress", "method"), "snapkv");
    ck_assert_int_eq(kvm_config_bool(c, "compress", "bias"), 1);
    ck_assert_int_eq(kvm_config_int(c, "compress", "retain"), 32); /* default */
    ck_assert_int_eq(kvm_config_is_set(c, "compress", "retain"), 0);
    char cwd[4096], want[4200];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof cwd));
    snprintf(want, sizeof want, "%s/rel/store.lmdb", cwd);
    ck_assert_str_eq(kvm_config_str(c, "store", "path"), want); /* relative to the working directory */
    ck_assert_int_eq(kvm_config_set(c, "compress", "ratio", "0.25"), 0);
    ck_assert_double_eq(kvm_config_float(c, "compress", "ratio"), 0.25);
    ck_assert_int_eq(kvm_config_set(c, "compress", "ratio", "2"), KVM_EINVAL);
    kvm_config_free(&c);
    ck_assert_ptr_null(c);
}
END_TEST

START_TEST(test_errors_name_line_and_key)
{
    expect_bad("[model]\npath = /m\n[compress]\nratoi = 0.3\n", "t.ini:4: [compress] ratoi: unknown key");
    expect_bad("[model]\npath = /m\n[compres]\nratio = 0.3\n", "unknown section 'compres'");
    expect_bad("[model]\npath = /m\ncontext = big\n", "t.ini:3: [model] context: 'big' is not an integer");
    expect_bad("[model]\npath = /m\ncontext = 0\n", "0 is outside [1,");
    expect_bad("[model]\npath = /m\ncontext = 99999999999999999999\n",
               "t.ini:3: [model] context: 99999999999999999999 is outside [1,"); /* not "not an integer" */
    expect_bad("[model]\npath = /m\n[compress]\nratio = 1.5\n", "1.5 is outside [1e-09, 1]");
    expect_bad("[model]\npath = /m\n[compress]\nratio = 1e400\n",
               "t.ini:4: [compress] ratio: 1e400 is outside [1e-09, 1]");
    /* a value underflowing to 0 is outside [1e-9, 1] (as --ratio refuses it) */
    expect_bad("[model]\npath = /m\n[compress]\nratio = 1e-400\n",
               "t.ini:4: [compress] ratio: 1e-400 is outside [1e-09, 1]");
    /* where 0 is inside, underflowing to 0 is not "outside": the value is too close to 0 to hold */
    expect_bad("[model]\npath = /m\n[compress]\nlambda = 1e-400\n",
               "t.ini:4: [compress] lambda: 1e-400 is too close to 0 for a double (it would read as 0");
    expect_bad("[model]\npath = /m\n[compress]\nmethod = magic\n", "'magic' is not one of sculpt|");
    expect_bad("[model]\npath = /m\n[compress]\nbias = maybe\n", "not a boolean");
    expect_bad("[model]\npath = ${KVMTEST_NOPE_NOT_SET}\n", "KVMTEST_NOPE_NOT_SET is not set");
    expect_bad("[model]\ncontext = 5\n", "[model] path: required key is missing");
    /* an empty store or model path (a ${VAR:-} whose VAR is unset) is named where it is, not
     * later as "store: empty path" without file or key */
    expect_bad("[model]\npath = /m\n[store]\npath = ${KVMTEST_NOPE_NOT_SET:-}\n",
               "t.ini:4: [store] path: '${KVMTEST_NOPE_NOT_SET:-}' expands to an empty path");
    expect_bad("[model]\npath = /m\nthis line has no equals\n", "t.ini:3");
    expect_bad("[model\npath = /m\n", "t.ini:1: section header without ']'");
    /* libinih ignored the rest of a header line: the ratio was dropped without a word */
    expect_bad("[model]\npath = /m\n[compress] ratio = 0.5\n",
               "t.ini:3: 'ratio = 0.5' after the section header's ']' would be ignored");
    expect_bad("[model]\npath = /m\n[compress]]\r\n", "t.ini:3: ']' after the section header's ']'");
    kvm_config *ok = NULL; /* a comment or blanks after ']' are fine */
    ck_assert_msg(kvm_config_parse("[model] ; the model\r\npath = /m\n[compress]\t# c\nratio = 0.5\n", "t.ini", &ok) ==
                      0,
                  "%s", kvm_errmsg());
    ck_assert_double_eq(kvm_config_float(ok, "compress", "ratio"), 0.5);
    kvm_config_free(&ok);
    char long_line[400];
    snprintf(long_line, sizeof long_line, "[model]\npath = /m\n[run]\nrun_dir = /tmp/%0250d\n", 0);
    expect_bad(long_line, "t.ini:4: line of 265 characters");
}
END_TEST

START_TEST(test_file_errors)
{
    kvm_config *c;
    ck_assert_int_eq(kvm_config_load("/nonexistent/x.ini", &c), KVM_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "/nonexistent/x.ini"));
    ck_assert_int_eq(kvm_config_load("/tmp", &c), KVM_EIO);
    ck_assert_int_eq(kvm_config_load("", &c), KVM_ENOTFOUND); /* --config '': was ": No such file or directory" */
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "configuration file: empty path"));
    char *dir = kvm_test_tmpdir(), path[4200];
    snprintf(path, sizeof path, "%s/c.ini", dir);
    const char *text = "[model]\npath = /m\n\n[run]\nheartbeat_ms = 5\n";
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    ck_assert_int_eq(kvm_config_load(path, &c), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "c.ini:5: [run] heartbeat_ms: 5 is outside [10,"));
    /* byte-order marks: UTF-16 (LE with its NUL bytes, BE, and a mark before plain ASCII) is
     * named as such; a UTF-8 one is skipped, the first section header seen as one (a key set
     * twice names its section) */
    const char u16le[] = "\xFF\xFE[\0m\0o\0d\0e\0l\0]\0\n\0", u16be[] = "\xFE\xFF\0[\0m\0o\0d\0e\0l\0]\0\n";
    const struct { const char *t; size_t n; const char *why; } bad[] = {
        {u16le, sizeof u16le - 1, "c.ini: starts with a UTF-16 byte-order mark (FF FE)"},
        {u16be, sizeof u16be - 1, "c.ini: starts with a UTF-16 byte-order mark (FE FF)"},
        {"\xFF\xFE\npath = /m\n", 11, "c.ini: starts with a UTF-16 byte-order mark (FF FE): a configuration file is UTF-8"}};
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(kvm_test_write_file(path, bad[i].t, bad[i].n), 0);
        c = (kvm_config *)0x1;
        ck_assert_int_eq(kvm_config_load(path, &c), KVM_EINVAL);
        ck_assert_ptr_null(c);
        ck_assert_msg(strstr(kvm_errmsg(), bad[i].why), "case %d: %s", i, kvm_errmsg());
    }
    expect_bad("\xFF\xFE[model]\npath = /m\n", "t.ini: starts with a UTF-16 byte-order mark (FF FE)");
    text = "\xEF\xBB\xBF[model]\npath = /m\n[run]\nheartbeat_ms = 50\n";
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    ck_assert_msg(kvm_config_load(path, &c) == 0, "%s", kvm_errmsg());
    ck_assert_str_eq(kvm_config_str(c, "model", "path"), "/m");
    ck_assert_int_eq(kvm_config_int(c, "run", "heartbeat_ms"), 50);
    kvm_config_free(&c);
    expect_bad("\xEF\xBB\xBF[model]\npath = /m\npath = /n\n", "t.ini:3: [model] path is set again (first set on line 2)");
    /* a program reading only [store] and [security] (kvmill store serve) loads a file without
     * [model] path; one that reads [model] does not, nor is any other check relaxed */
    static const char *const store_only[] = {"store", "security", NULL}, *const with_model[] = {"store", "model", NULL};
    text = "[store]\npath = /s.lmdb\n";
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    ck_assert_int_eq(kvm_config_load(path, &c), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "[model] path: required key is missing"));
    ck_assert_int_eq(kvm_config_load_sections(path, with_model, &c), KVM_EINVAL);
    ck_assert_msg(kvm_config_load_sections(path, store_only, &c) == 0, "%s", kvm_errmsg());
    ck_assert_str_eq(kvm_config_str(c, "store", "path"), "/s.lmdb");
    kvm_config_free(&c);
    text = "[store]\npath = /s.lmdb\nmap_max_mb = x\n";
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    ck_assert_int_eq(kvm_config_load_sections(path, store_only, &c), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "map_max_mb"));
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* libinih joins an indented line after a key as a continuation and sets the key again to that
 * line alone: `path = /m` then `  /other` silently gave path = /other (and `ratio = 0.3`
 * then `   0.5` a ratio of 0.5), although a key set twice is refused. Now refused, naming
 * the line and the key; indented comments and blank lines are still fine. */
START_TEST(test_indented_continuation_refused)
{
    expect_bad("[model]\npath = /m\n  /other\n", "t.ini:3: an indented line after [model] path continues its value");
    expect_bad("[model]\npath = /m\n[compress]\nratio = 0.3\n\n   0.5\n",
               "t.ini:6: an indented line after [compress] ratio continues its value");
    kvm_config *c = NULL;
    ck_assert_msg(kvm_config_parse("[model]\npath = /m\n  ; a comment\n   \n\t# another\n", "t.ini", &c) == 0, "%s",
                  kvm_errmsg());
    ck_assert_str_eq(kvm_config_str(c, "model", "path"), "/m");
    kvm_config_free(&c);
}
END_TEST

START_TEST(test_canonical_encoding)
{
    kvm_config *a, *b, *d;
    ck_assert_int_eq(kvm_config_parse("[model]\npath=/m\n[compress]\nratio=0.3\n", "a", &a), 0);
    ck_assert_int_eq(kvm_config_parse("[model]\npath=/m\n", "b", &b), 0); /* same values via defaults */
    ck_assert_int_eq(kvm_config_parse("[model]\npath=/m\n[compress]\nratio=0.5\n", "d", &d), 0);
    char *ea, *eb, *ed;
    size_t na, nb, nd;
    ck_assert_int_eq(kvm_config_canonical(a, "compress", &ea, &na), 0);
    ck_assert_int_eq(kvm_config_canonical(b, "compress", &eb, &nb), 0);
    ck_assert_int_eq(kvm_config_canonical(d, "compress", &ed, &nd), 0);
    ck_assert_uint_eq(na, nb);
    ck_assert_int_eq(memcmp(ea, eb, na), 0);
    ck_assert(na != nd || memcmp(ea, ed, na) != 0);
    ck_assert_ptr_nonnull(strstr(ed, "compress.ratio=0.5\n"));
    ck_assert_ptr_null(strstr(ea, "model.")); /* only the asked section */
    free(ea); free(eb); free(ed);
    kvm_config_free(&a); kvm_config_free(&b); kvm_config_free(&d);
}
END_TEST

/* [run] heartbeat_ms = 10 with liveness = 1 (each at its own minimum): a worker was declared
 * dead after 10 ms of silence, between two reads of the orchestrator's loop, and a run printed
 * hundreds of "did not run for 0.0 s" lines. The product is refused below 200 ms, naming both. */
START_TEST(test_dead_time_floor)
{
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse("[model]\npath=/m\n[run]\nheartbeat_ms = 10\nliveness = 1\n", "t.ini", &c),
                     KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "t.ini: [run] heartbeat_ms x liveness = 10 x 1 = 10 ms") &&
                      strstr(kvm_errmsg(), "give at least 200 ms"),
                  "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_config_parse("[model]\npath=/m\n[run]\nheartbeat_ms = 10\nliveness = 20\n", "t.ini", &c), 0);
    kvm_config_free(&c);
}
END_TEST

/* Floats that share their first 9 significant digits: ratio 0.2864583332 and 0.2864583334 had
 * one canonical encoding ("0.286458333"), so one config id, while their caches kept 1,180 and
 * 1,200 entries (run skipped the one as stored by the other). Values of 9 digits or fewer keep
 * their encoding, so no stored id changes: ".30" is still "0.3". */
START_TEST(test_canonical_float_digits)
{
    const char *ratios[] = {"0.2864583332", "0.2864583334", ".30", "0.1234567891", "0.123456789"};
    const char *want[] = {"compress.ratio=0.28645833320000003\n", "compress.ratio=0.28645833339999999\n",
                          "compress.ratio=0.3\n", "compress.ratio=0.12345678910000001\n",
                          "compress.ratio=0.123456789\n"};
    for (int i = 0; i < 5; i++) {
        char text[128], *e = NULL;
        size_t n = 0;
        kvm_config *c = NULL;
        snprintf(text, sizeof text, "[model]\npath=/m\n[compress]\nratio=%s\n", ratios[i]);
        ck_assert_int_eq(kvm_config_parse(text, "c", &c), 0);
        ck_assert_int_eq(kvm_config_canonical(c, "compress", &e, &n), 0);
        ck_assert_msg(strstr(e, want[i]), "ratio %s: %s", ratios[i], e);
        free(e);
        kvm_config_free(&c);
    }
}
END_TEST

/* The dump of every setting (what serve hands its decode workers) is read back: every line fits
 * libinih's 200-byte line buffer (one help text once did not), and parsing it back gives the
 * same values. */
START_TEST(test_dump_reads_back)
{
    kvm_config *c;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = /m/x.bin\n[compress]\nratio = 0.25\n", "t.ini", &c), 0);
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(kvm_config_dump(c, f, NULL), 0);
    fclose(f);
    for (const char *l = text; *l;) {
        size_t len = strcspn(l, "\n");
        ck_assert_msg(len < 199, "dump line of %zu bytes: %.60s...", len, l);
        l += len + (l[len] == '\n');
    }
    kvm_config *back;
    ck_assert_msg(kvm_config_parse(text, "dump.ini", &back) == 0, "%s", kvm_errmsg());
    ck_assert_double_eq(kvm_config_float(back, "compress", "ratio"), 0.25);
    ck_assert_str_eq(kvm_config_str(back, "model", "path"), "/m/x.bin");
    kvm_config_free(&back);
    kvm_config_free(&c);
    free(text);
}
END_TEST

/* A value that does not fit an INI line (an inline-comment ';' after a blank, "${", over 198
 * characters) is dumped as ${KVMILL_CFG_...} with its export line on the notes stream; with the
 * variable set, the dump reads back as the same values (it read back cut or expanded before). */
START_TEST(test_dump_moves_unwritable_values)
{
    char longpath[400];
    memset(longpath, 'd', sizeof longpath - 1);
    longpath[0] = '/';
    longpath[sizeof longpath - 1] = 0;
    setenv("KVT_TAG", "/a ;b", 1);
    setenv("KVT_LONG", longpath, 1);
    setenv("KVT_REF", "/x${y}", 1);
    kvm_config *c;
    ck_assert_msg(kvm_config_parse("[model]\npath = ${KVT_LONG}\ntokenizer = ${KVT_REF}\n[run]\nmetrics = ${KVT_TAG}\n",
                                   "t.ini", &c) == 0, "%s", kvm_errmsg());
    char *text = NULL, *notes = NULL;
    size_t n = 0, nn = 0;
    FILE *f = open_memstream(&text, &n), *g = open_memstream(&notes, &nn);
    ck_assert_int_eq(kvm_config_dump(c, f, g), 3);
    fclose(f);
    fclose(g);
    ck_assert_msg(strstr(notes, "export KVMILL_CFG_RUN_METRICS='/a ;b'\n"), "%s", notes);
    ck_assert_msg(strstr(notes, "export KVMILL_CFG_MODEL_TOKENIZER='/x${y}'\n"), "%s", notes);
    ck_assert_ptr_nonnull(strstr(text, "path = ${KVMILL_CFG_MODEL_PATH}\n"));
    setenv("KVMILL_CFG_RUN_METRICS", "/a ;b", 1);
    setenv("KVMILL_CFG_MODEL_TOKENIZER", "/x${y}", 1);
    setenv("KVMILL_CFG_MODEL_PATH", longpath, 1);
    kvm_config *back;
    ck_assert_msg(kvm_config_parse(text, "dump.ini", &back) == 0, "%s", kvm_errmsg());
    ck_assert_str_eq(kvm_config_str(back, "run", "metrics"), "/a ;b");
    ck_assert_str_eq(kvm_config_str(back, "model", "tokenizer"), "/x${y}");
    ck_assert_str_eq(kvm_config_str(back, "model", "path"), longpath);
    unsetenv("KVMILL_CFG_RUN_METRICS");
    unsetenv("KVMILL_CFG_MODEL_TOKENIZER");
    unsetenv("KVMILL_CFG_MODEL_PATH");
    kvm_config_free(&back);
    kvm_config_free(&c);
    free(text);
    free(notes);
}
END_TEST

/* [serve] bind (a plain string) from `raw`, with the environment as the case sets it. */
static const char *bind_of(kvm_config **c, const char *raw)
{
    char text[512];
    snprintf(text, sizeof text, "[model]\npath = /m\n[serve]\nbind = %s\n", raw);
    ck_assert_msg(kvm_config_parse(text, "t.ini", c) == 0, "'%s': %s", raw, kvm_errmsg());
    return kvm_config_str(*c, "serve", "bind");
}

/* A default may itself hold a reference: ${A:-${B:-x}} was kept as "${B:-x}" followed by a
 * literal '}' (the first '}' ended the outer reference). It expands as the shell does: A, else
 * B, else x; the default of a set variable is not evaluated (its unset variables are no error). */
START_TEST(test_nested_defaults)
{
    static const struct {
        const char *a, *b, *raw, *want;
    } cases[] = {
        {NULL, NULL, "${KVMTEST_A:-${KVMTEST_B:-x}}", "x"},
        {NULL, "bee", "${KVMTEST_A:-${KVMTEST_B:-x}}", "bee"},
        {"ay", "bee", "${KVMTEST_A:-${KVMTEST_B:-x}}", "ay"},
        {"ay", NULL, "${KVMTEST_A:-${KVMTEST_B}}", "ay"},
        {"", NULL, "tcp://${KVMTEST_A:-${KVMTEST_B:-h}:${KVMTEST_B:-1}}/z", "tcp://h:1/z"},
        {NULL, NULL, "${KVMTEST_A:-${KVMTEST_B:-${KVMTEST_A:-deep}}}-}", "deep-}"},
        {NULL, NULL, "${KVMTEST_A:-}$x", "$x"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].a) setenv("KVMTEST_A", cases[i].a, 1);
        else unsetenv("KVMTEST_A");
        if (cases[i].b) setenv("KVMTEST_B", cases[i].b, 1);
        else unsetenv("KVMTEST_B");
        kvm_config *c = NULL;
        const char *got = bind_of(&c, cases[i].raw);
        ck_assert_msg(!strcmp(got, cases[i].want), "'%s' (A=%s B=%s): '%s', want '%s'", cases[i].raw,
                      cases[i].a ? cases[i].a : "unset", cases[i].b ? cases[i].b : "unset", got, cases[i].want);
        kvm_config_free(&c);
    }
    unsetenv("KVMTEST_A");
    unsetenv("KVMTEST_B");
    /* malformed: each message names file, line, key and where in the value */
    expect_bad("[model]\npath = /m\n[serve]\nbind = ${KVMTEST_A:-${KVMTEST_B:-x}\n",
               "t.ini:4: [serve] bind: unterminated ${ (no closing '}') at column 1 of '${KVMTEST_A:-${KVMTEST_B:-x}'");
    expect_bad("[model]\npath = /m\n[serve]\nbind = a${KVMTEST_A\n", "t.ini:4: [serve] bind: unterminated ${");
    expect_bad("[model]\npath = /m\n[serve]\nbind = ${KVMTEST_A-x}\n", "t.ini:4: [serve] bind: bad variable reference");
    expect_bad("[model]\npath = /m\n[serve]\nbind = ${:-x}\n", "bad variable reference (write ${NAME}");
    expect_bad("[model]\npath = /m\n[serve]\nbind = ${KVMTEST_A:-${KVMTEST_B}}\n",
               "t.ini:4: [serve] bind: environment variable KVMTEST_B is not set and has no default at column 14 of "
               "'${KVMTEST_A:-${KVMTEST_B}}'"); /* the column, as README says (the message gave none) */
    /* set but empty: said so, not "not set" (the variable is exported; its value is empty) */
    setenv("KVMTEST_B", "", 1);
    expect_bad("[model]\npath = /m\n[serve]\nbind = ${KVMTEST_B}\n",
               "t.ini:4: [serve] bind: environment variable KVMTEST_B is empty and has no default (write "
               "${KVMTEST_B:-DEFAULT} for one) at column 1");
    unsetenv("KVMTEST_B");
    /* a line past libinih's 198 characters (a deep path) is refused, naming the way around it:
     * the value in an environment variable, expanded after parsing */
    char longline[400];
    snprintf(longline, sizeof longline, "[model]\npath = /%0250d\n", 0);
    expect_bad(longline, "t.ini:2: line of 258 characters: lines are limited to 198 (for a longer value");
    longline[strlen(longline) - 1] = '\0'; /* the value alone */
    setenv("KVMTEST_A", longline + 15, 1);
    kvm_config *lc = NULL;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = ${KVMTEST_A}\n", "t.ini", &lc), 0);
    kvm_config_free(&lc);
    unsetenv("KVMTEST_A");
    char deep[200] = "", *d = deep;
    for (int i = 0; i < 9; i++) d += sprintf(d, "${V%d:-", i);
    d += sprintf(d, "x");
    for (int i = 0; i < 9; i++) *d++ = '}';
    *d = '\0';
    char text[400];
    snprintf(text, sizeof text, "[model]\npath = /m\n[serve]\nbind = %s\n", deep);
    expect_bad(text, "t.ini:4: [serve] bind: more than 8 nested ${...} at column 49");
    deep[strlen(deep) - 1] = '\0'; /* 8 deep is allowed */
    memmove(deep, deep + 6, strlen(deep + 6) + 1);
    kvm_config *c = NULL;
    ck_assert_str_eq(bind_of(&c, deep), "x");
    kvm_config_free(&c);
}
END_TEST

/* An endpoint key holding a scheme and no address ([run] bind = ipc://, tcp:// without host or
 * port) was accepted: ipc:// put the run's sockets in the root folder, tcp:// failed only at the
 * bind. Refused at load, naming file, line and key; a full endpoint (IPv6 included) still loads,
 * and an override (--bind) is refused the same way. */
START_TEST(test_endpoint_without_address)
{
    const struct {
        const char *section, *key, *value, *why;
    } bad[] = {{"run", "bind", "ipc://", "names no socket path"},
               {"run", "bind", "tcp://", "names no host and no port"},
               {"run", "bind", "tcp://127.0.0.1", "names no port"},
               {"run", "bind", "tcp://[::1]", "names no port"},
               {"serve", "bind", "tcp://localhost:", "names no port"},
               {"serve", "backend", "ipc://", "names no socket path"},
               {"store", "service", "tcp://", "names no host and no port"},
               {"store", "service_bind", "ipc://", "names no socket path"},
               {"store", "path", "tcp://", "names no host and no port"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[256], want[256];
        snprintf(text, sizeof text, "[model]\npath = /m\n\n[%s]\n%s = %s\n", bad[i].section, bad[i].key, bad[i].value);
        snprintf(want, sizeof want, "t.ini:5: [%s] %s: '%s' %s", bad[i].section, bad[i].key, bad[i].value, bad[i].why);
        expect_bad(text, want);
    }
    const char *good[] = {"ipc:///tmp/kvmill-run", "tcp://127.0.0.1:5555", "tcp://*:5555", "tcp://[::1]:5555"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char text[256];
        snprintf(text, sizeof text, "[model]\npath = /m\n[run]\nbind = %s\n", good[i]);
        kvm_config *c = NULL;
        ck_assert_msg(kvm_config_parse(text, "t.ini", &c) == 0, "%s: %s", good[i], kvm_errmsg());
        ck_assert_str_eq(kvm_config_str(c, "run", "bind"), good[i]);
        ck_assert_int_eq(kvm_config_set(c, "run", "bind", "ipc://"), KVM_EINVAL);
        ck_assert_msg(strstr(kvm_errmsg(), "[run] bind: 'ipc://' names no socket path"), "%s", kvm_errmsg());
        kvm_config_free(&c);
    }
}
END_TEST

/* [store] map_max_mb below map_size_mb was ignored: the store opened with a map of map_size_mb
 * (64 MiB by default for map_max_mb = 1), exit 0. Refused at load now, naming both keys and
 * values and the file (kvmill run and its --dump-config: exit 2); equal, or max above, loads, and a
 * program that does not read [store] is not refused for it. */
/* libinih keeps quotes as part of a value: `[store] path = "kvq.lmdb"` made a folder named
 * "kvq.lmdb" with its quotes (kvmill run stored its caches there, and `--store kvq.lmdb` found
 * none), and a quoted model path was only "No such file". A path in quotes is refused where it is
 * written; quotes inside a path, or one quote, are a name's own. */
START_TEST(test_quoted_path_refused)
{
    expect_bad("[model]\npath = /m\n[store]\npath = \"kvq.lmdb\"\n",
               "t.ini:4: [store] path: \"kvq.lmdb\" is in quotes, which an INI file keeps as part of the path: write "
               "it without them (a path may hold spaces as it is)");
    expect_bad("[model]\npath = '/my models/m.bin'\n", "t.ini:2: [model] path: '/my models/m.bin' is in quotes");
    expect_bad("[model]\npath = /m\n[security]\nauthorized_keys = \"keys\"\n",
               "t.ini:4: [security] authorized_keys: \"keys\" is in quotes");
    kvm_config *ok = NULL;
    ck_assert_msg(kvm_config_parse("[model]\npath = /my models/it's \"m\".bin\n[store]\npath = /s\"\n", "t.ini", &ok) ==
                      0,
                  "%s", kvm_errmsg());
    ck_assert_str_eq(kvm_config_str(ok, "model", "path"), "/my models/it's \"m\".bin");
    ck_assert_str_eq(kvm_config_str(ok, "store", "path"), "/s\"");
    kvm_config_free(&ok);
}
END_TEST

START_TEST(test_map_max_below_map_size)
{
    expect_bad("[model]\npath = /m\n[store]\nmap_max_mb = 1\n",
               "t.ini: [store] map_max_mb = 1 is below map_size_mb = 64 (its default)");
    expect_bad("[model]\npath = /m\n[store]\nmap_size_mb = 100\nmap_max_mb = 99\n",
               "t.ini: [store] map_max_mb = 99 is below map_size_mb = 100:");
    kvm_config *c = NULL;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = /m\n[store]\nmap_size_mb = 2\nmap_max_mb = 2\n", "t.ini", &c),
                     0);
    kvm_config_free(&c);
    char *dir = kvm_test_tmpdir(), path[4200], cmd[9000], *out = NULL, *err = NULL;
    snprintf(path, sizeof path, "%s/c.ini", dir);
    const char *text = "[model]\npath = /m\n[store]\nmap_max_mb = 1\n";
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    static const char *const model_only[] = {"model", NULL};
    ck_assert_msg(kvm_config_load_sections(path, model_only, &c) == 0, "%s", kvm_errmsg());
    kvm_config_free(&c);
    snprintf(cmd, sizeof cmd, "%s/kvmill run --config '%s' --dump-config", kvm_test_bin(), path);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "[store] map_max_mb = 1 is below map_size_mb = 64") && strstr(err, path),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A key under the wrong header (budget under [model], a key before any header) was refused as
 * "unknown key" (or "unknown section ''") alone, as if misspelt; the message now names the
 * section(s) that have it. A key no section has keeps the plain message. */
START_TEST(test_key_in_wrong_section)
{
    expect_bad("[model]\npath = /m\nbudget = 16\n",
               "t.ini:3: [model] budget: unknown key (budget is a key of [compress]: put it under that header)");
    expect_bad("context = 64\n[model]\npath = /m\n",
               "t.ini:1: [] context: unknown section '' (context is a key of [model]: put it under that header)");
    expect_bad("[model]\npath = /m\n[compress]\npath = /s\n", "[compress] path: unknown key (path is a key of [model] "
                                                              "and [store]");
    expect_bad("[model]\npath = /m\n[compress]\nratoi = 0.3\n", "t.ini:4: [compress] ratoi: unknown key");
    ck_assert_msg(!strstr(kvm_errmsg(), "is a key of"), "%s", kvm_errmsg());
}
END_TEST

/* A line with no '=' (a key without its value, a stray word) before a rejected key was reported
 * with the stray line's number and the key's message ("t.ini:3: [compress] ratoi: unknown key",
 * ratoi on line 5), the stray line never named; a line '= 0.3' read as "[model] : unknown key"; a second byte-order
 * mark (two files pasted together) read as "[] path: unknown section ''". Each is named at its own line now. */
START_TEST(test_stray_line_named)
{
    expect_bad("[model]\npath = /m\nfoo\n[compress]\nratoi = 0.3\n",
               "t.ini:3: 'foo' is not a key = value line, a [section] header or a comment");
    expect_bad("[model]\npath = /m\n[compress]\nratio\r\n", "t.ini:4: 'ratio' is not a key = value line");
    expect_bad("[model]\npath = /m\n= 0.3\n", "t.ini:3: '= 0.3' has no key before its '='");
    expect_bad("\xEF\xBB\xBF\xEF\xBB\xBF[model]\npath = /m\n",
               "t.ini:1: a UTF-8 byte-order mark inside the file (only one at its start is skipped)");
    kvm_config *c = NULL; /* blanks, blank CRLF lines and comments are no stray lines */
    ck_assert_msg(kvm_config_parse("\xEF\xBB\xBF[model]\r\npath = /m\r\n  \r\n\t\n; c\n# c\n", "t.ini", &c) == 0, "%s",
                  kvm_errmsg());
    kvm_config_free(&c);
}
END_TEST

static Suite *config_suite(void)
{
    Suite *s = suite_create("config");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"defaults_and_values", test_defaults_and_values},
                 {"errors_name_line_and_key", test_errors_name_line_and_key},
                 {"file_errors", test_file_errors},
                 {"canonical_encoding", test_canonical_encoding},
                 {"canonical_float_digits", test_canonical_float_digits},
                 {"dead_time_floor", test_dead_time_floor},
                 {"dump_reads_back", test_dump_reads_back},
                 {"dump_moves_unwritable_values", test_dump_moves_unwritable_values},
                 {"indented_continuation_refused", test_indented_continuation_refused},
                 {"nested_defaults", test_nested_defaults},
                 {"endpoint_without_address", test_endpoint_without_address},
                 {"map_max_below_map_size", test_map_max_below_map_size},
                 {"quoted_path_refused", test_quoted_path_refused},
                 {"key_in_wrong_section", test_key_in_wrong_section},
                 {"stray_line_named", test_stray_line_named}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(config_suite()); }
