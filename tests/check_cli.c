/* check_cli.c: the kvmill binary as a user runs it: generate reproduces run.c's greedy
 * golden texts byte for byte, --tokens, a model with no tokenizer, info, make-model, and
 * clear errors with the right exit codes for bad arguments and files. */
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_config.h"
#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
#include <sys/wait.h>
#include <signal.h>

#pragma GCC diagnostic ignored "-Wformat-truncation" /* paths are short; a cut one fails loudly */

static char cmd[16384];

static int kvmill(char **out, char **err, const char *fmt, const char *a, const char *b)
{
    char args[8192];
    snprintf(args, sizeof args, fmt, a, b);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' %s", kvm_test_bin(), args);
    return kvm_test_run(cmd, out, err);
}

/* The prompt of gen_NN.cmd: the text between -i " and the closing quote. */
static char *golden_prompt(int i)
{
    char rel[64];
    snprintf(rel, sizeof rel, "golden/gen/gen_%02d.cmd", i);
    char *c = kvm_test_read_file(kvm_test_shared_path(rel), NULL);
    ck_assert_ptr_nonnull(c);
    char *s = strstr(c, "-i \"");
    ck_assert_ptr_nonnull(s);
    s += 4;
    *strchr(s, '"') = '\0';
    char *p = strdup(s);
    free(c);
    return p;
}

START_TEST(test_generate_golden)
{
    if (!kvm_test_shared_path("golden/gen")) return;
    for (int i = 0; i < 4; i++) {
        char *prompt = golden_prompt(i), *out, *err, rel[64];
        int rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 200 --prompt '%s'",
                        kvm_test_data_path("models/stories260K.bin"), prompt);
        ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
        snprintf(rel, sizeof rel, "golden/gen/gen_%02d.txt", i);
        char *gold = kvm_test_read_file(kvm_test_shared_path(rel), NULL);
        ck_assert_str_eq(out, gold);
        free(gold); free(out); free(err); free(prompt);
    }
}
END_TEST

START_TEST(test_generate_tokens_and_no_tokenizer)
{
    if (!kvm_test_shared_path("golden/gen")) return;
    char *tmp = kvm_test_tmpdir(), path[4096], model[4096], *out, *err;
    /* the first 10 golden ids of gen_01 as a --tokens file: same continuation as the prompt */
    char *ids = kvm_test_read_file(kvm_test_shared_path("golden/gen/gen_01.ids.txt"), NULL);
    char *p = ids;
    for (int i = 0; i < 10; i++) p = strchr(p, '\n') + 1;
    snprintf(path, sizeof path, "%s/ids.txt", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, ids, (size_t)(p - ids)), 0);
    int rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 200 --tokens '%s'",
                    kvm_test_data_path("models/stories260K.bin"), path);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    char *gold = kvm_test_read_file(kvm_test_shared_path("golden/gen/gen_01.txt"), NULL);
    ck_assert_str_eq(out, gold);
    free(gold); free(out); free(err);
    /* a model copy without a tokenizer beside it prints ids, one per line */
    snprintf(model, sizeof model, "%s/m.bin", tmp);
    size_t n;
    char *bytes = kvm_test_read_file(kvm_test_data_path("models/stories260K.bin"), &n);
    ck_assert_int_eq(kvm_test_write_file(model, bytes, n), 0);
    free(bytes);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 200 --tokens '%s'", model, path);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    ck_assert_str_eq(out, strchr(ids, '\n') + 1); /* ids 2..201 of the golden file */
    free(out); free(err);
    /* ...and asking for text without a tokenizer is an error that says so */
    rc = kvmill(&out, &err, "generate --model '%s' --prompt '%s'", model, "Once");
    ck_assert_int_ne(rc, 0);
    ck_assert_ptr_nonnull(strstr(err, "tokenizer"));
    free(out); free(err);
    /* a bad id names file and line (exit 2: the file is not a --tokens file) */
    ck_assert_int_eq(kvm_test_write_file(path, "1\n403\n9999\n", 11), 0);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 20 --tokens '%s'",
                kvm_test_data_path("models/stories260K.bin"), path);
    ck_assert_int_eq(rc, 2);
    ck_assert_msg(strstr(err, "ids.txt:3"), "stderr: %s", err);
    free(out); free(err); free(ids);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

START_TEST(test_help_and_usage_errors)
{
    const char *cmds[] = {"generate", "info", "make-model"};
    char *out, *err;
    for (size_t i = 0; i < 3; i++) {
        ck_assert_int_eq(kvmill(&out, &err, "%s --help%s", cmds[i], ""), 0);
        ck_assert_ptr_nonnull(strstr(out, "usage: kvmill"));
        free(out); free(err);
        ck_assert_int_eq(kvmill(&out, &err, "%s --bogus%s", cmds[i], ""), 2);
        ck_assert_ptr_nonnull(strstr(err, "--bogus"));
        free(out); free(err);
    }
    ck_assert_int_eq(kvmill(&out, &err, "frobnicate%s%s", "", ""), 2);
    ck_assert_ptr_nonnull(strstr(err, "unknown command"));
    free(out); free(err);
    ck_assert_int_eq(kvmill(&out, &err, "generate --model '%s' -n abc%s", kvm_test_data_path("models/stories260K.bin"), ""), 2);
    ck_assert_ptr_nonnull(strstr(err, "-n"));
    free(out); free(err);
    ck_assert_int_eq(kvmill(&out, &err, "generate --model '%s' --temperature -1%s", kvm_test_data_path("models/stories260K.bin"), ""), 2);
    free(out); free(err);
    /* a positive literal that underflows a double to 0 was called "outside [0, 1e+06]": it is inside;
     * it is too close to 0 to represent, and 0 (greedy) is what to write if meant */
    ck_assert_int_eq(kvmill(&out, &err, "generate --model '%s' --temperature 1e-400 --prompt x%s",
                            kvm_test_data_path("models/stories260K.bin"), ""),
                     2);
    ck_assert_msg(strstr(err, "--temperature: 1e-400 is too close to 0 for a double") &&
                      strstr(err, "write 0 if 0 is meant") && !strstr(err, "outside"),
                  "%s", err);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "generate --model '%s' --temperature 1e999 --prompt x%s",
                            kvm_test_data_path("models/stories260K.bin"), ""),
                     2);
    ck_assert_msg(strstr(err, "--temperature: 1e999 is outside [0, 1e+06]"), "%s", err);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "generate --model /nonexistent/m.bin --prompt x%s%s", "", ""), 2); /* usage */
    ck_assert_ptr_nonnull(strstr(err, "/nonexistent/m.bin"));
    free(out); free(err);
    ck_assert_int_eq(kvmill(&out, &err, "generate --model '%s' --device cuda:x --prompt '%s'", kvm_test_data_path("models/stories260K.bin"), "a"), 2);
    ck_assert_ptr_nonnull(strstr(err, "cuda:x"));
    free(out); free(err);
}
END_TEST

START_TEST(test_info_and_make_model)
{
    char *out, *err, *tmp = kvm_test_tmpdir(), path[4096];
    ck_assert_int_eq(kvmill(&out, &err, "info --model '%s'%s", kvm_test_data_path("models/stories260K.bin"), ""), 0);
    ck_assert_ptr_nonnull(strstr(out, "n_kv_heads:  4"));
    ck_assert_ptr_nonnull(strstr(out, "parameters:  260032"));
    free(out); free(err);
    snprintf(path, sizeof path, "%s/r.bin", tmp);
    ck_assert_int_eq(kvmill(&out, &err, "make-model --dim 128 --layers 2 --heads 4 --kv-heads 2 --hidden 256 "
                                        "--vocab 1000 --seq-len 256 --seed 3 --out '%s'%s", path, ""), 0);
    free(out); free(err);
    ck_assert_int_eq(kvmill(&out, &err, "info --model '%s'%s", path, ""), 0);
    ck_assert_ptr_nonnull(strstr(out, "head_dim:    32"));
    ck_assert_ptr_nonnull(strstr(out, "vocab_size:  1000"));
    free(out); free(err);
    ck_assert_int_eq(kvmill(&out, &err, "make-model --dim 128 --layers 2 --heads 3 --hidden 256 --vocab 10 "
                                        "--seq-len 8 --out '%s'%s", path, ""), 2);
    ck_assert_ptr_nonnull(strstr(err, "--heads 3 does not divide --dim 128"));
    free(out); free(err);
    ck_assert_int_eq(kvmill(&out, &err, "info --model '%s'%s", tmp, ""), 2); /* a directory: usage */
    ck_assert_ptr_nonnull(strstr(err, "directory"));
    free(out); free(err);
    ck_assert_int_eq(kvmill(&out, &err, "info --model ''%s%s", "", ""), 2); /* not "kvmill info: : No such file" */
    ck_assert_msg(strstr(err, "kvmill info: the model path is empty"), "stderr: %s", err);
    free(out); free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A comma-separated list flag with an empty item ("16,,32", a leading or trailing comma) is
 * a usage error naming the flag and the item: the split dropped the item and ran the rest. */
START_TEST(test_list_flags_refuse_empty_items)
{
    const char *model = kvm_test_data_path("models/stories260K.bin");
    char doc[4200], base[8400];
    snprintf(doc, sizeof doc, "%s", kvm_test_data_path("corpus/doc_000.txt"));
    snprintf(base, sizeof base, "eval --model '%s' --context 64 --continuation 16", model);
    const struct {
        const char *args; /* after base; %s: the document */
        const char *want; /* in stderr */
    } bad[] = {
        {"--docs '%s' --method h2o --budget 16,,32", "--budget '16,,32': item 2 is empty"},
        {"--docs '%s' --method h2o --ratio 0.25,", "--ratio '0.25,': item 2 is empty"},
        {"--docs '%s' --method ,h2o --budget 16", "--method ',h2o': item 1 is empty"},
        {"--docs '%s,,' --method h2o --budget 16", "item 2 is empty"},
        /* a method's own ':'-joined options, and calibrate's --sculpt-opts: dropped unsaid before */
        {"--docs '%s' --method sculpt:iterations=1: --budget 40",
         "--method 'sculpt:iterations=1:': an option is empty"},
        {"--docs '%s' --method kvzip:iterations=1::seed=2 --budget 40", "'kvzip:iterations=1::seed=2': an option is"},
    };
    char *out, *err, fmt[9000];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(fmt, sizeof fmt, "%%s %s", bad[i].args);
        int rc = kvmill(&out, &err, fmt, base, doc);
        ck_assert_msg(rc == 2 && strstr(err, bad[i].want), "%s: exit %d\n%s", cmd, rc, err);
        free(out); free(err);
    }
    snprintf(fmt, sizeof fmt, "calibrate --model '%s' --docs '%%s,' --budget 16 --out /dev/null", model);
    int rc = kvmill(&out, &err, fmt, doc, "");
    ck_assert_msg(rc == 2 && strstr(err, "--docs") && strstr(err, "item 2 is empty"), "%s: exit %d\n%s", cmd, rc, err);
    free(out); free(err);
    snprintf(fmt, sizeof fmt,
             "calibrate --model '%s' --docs '%%s' --budget 16 --out /dev/null --kvzip --sculpt-opts "
             "iterations=1,,seed=2",
             model);
    rc = kvmill(&out, &err, fmt, doc, "");
    ck_assert_msg(rc == 2 && strstr(err, "--sculpt-opts 'iterations=1,,seed=2': item 2 is empty"), "%s: exit %d\n%s",
                  cmd, rc, err);
    free(out);
    free(err);
    /* a well-formed list still runs every item */
    rc = kvmill(&out, &err, "%s --docs '%s' --method h2o --budget 16,32", base, doc);
    ck_assert_msg(rc == 0 && strstr(out, "16.00") && strstr(out, "32.00"), "%s: exit %d\n%s\n%s", cmd, rc, out, err);
    free(out); free(err);
}
END_TEST

/* --tokens names a file the user made: a folder is refused by name (it read as "no token ids",
 * exit 1), and a line longer than the read buffer is an error, not split into several ids; a
 * file that is not token ids is a usage error (exit 2); a prompt longer than the model's window
 * is refused, and -n past it is said. */
START_TEST(test_generate_tokens_file_errors)
{
    char *tmp = kvm_test_tmpdir(), path[4096], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    int rc = kvmill(&out, &err, "generate --model '%s' -n 5 --tokens '%s'", model, tmp);
    ck_assert_msg(rc == 2 && strstr(err, "is a directory"), "exit %d: %s", rc, err);
    free(out); free(err);
    snprintf(path, sizeof path, "%s/ids.txt", tmp);
    char line[256];
    int k = snprintf(line, sizeof line, "1%*s\n2\n", 150, ""); /* "1", 150 blanks: one line, one id */
    ck_assert_int_eq(kvm_test_write_file(path, line, (size_t)k), 0);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 5 --tokens '%s'", model, path);
    ck_assert_msg(rc == 2 && strstr(err, "ids.txt:1") && strstr(err, "longer than"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    /* contents that are not token ids: the file named is not a --tokens file, exit 2 (was 1) */
    const char *bad[][2] = {{"1\n600\n", "ids.txt:2: '600' is not a token id in [0, 512)"},
                            {"", "ids.txt: no token ids"}};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(kvm_test_write_file(path, bad[i][0], strlen(bad[i][0])), 0);
        rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 5 --tokens '%s'", model, path);
        ck_assert_msg(rc == 2 && strstr(err, bad[i][1]), "%s: exit %d: %s", bad[i][1], rc, err);
        free(out);
        free(err);
    }
    /* a UTF-8 byte-order mark before the first id (an editor's) was refused as "'<BOM>1' is not a
     * token id", the mark invisible: it is skipped, and the ids generate what they do without it */
    char *plain = NULL;
    ck_assert_int_eq(kvm_test_write_file(path, "1\n403\n", 6), 0);
    rc = kvmill(&plain, &err, "generate --model '%s' --temperature 0 -n 8 --tokens '%s'", model, path);
    ck_assert_msg(rc == 0 && *plain, "exit %d: %s", rc, err);
    free(err);
    ck_assert_int_eq(kvm_test_write_file(path,
                                         "\xEF\xBB\xBF"
                                         "1\r\n403\r\n",
                                         11),
                     0);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 8 --tokens '%s'", model, path);
    ck_assert_msg(rc == 0 && !strcmp(out, plain), "exit %d: '%s' vs '%s': %s", rc, out, plain, err);
    free(out);
    free(err);
    free(plain);
    /* a prompt past the model's window was cut to it and nothing generated, exit 0 */
    char *many = malloc(600 * 2 + 1);
    for (int i = 0; i < 600; i++)
        memcpy(many + 2 * i, "5\n", 2);
    ck_assert_int_eq(kvm_test_write_file(path, many, 1200), 0);
    free(many);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 0 --tokens '%s'", model, path);
    ck_assert_msg(rc == 2 && strstr(err, "the prompt is 600 tokens, more than the model's window of 512"),
                  "exit %d: %s", rc, err);
    ck_assert_str_eq(out, "");
    free(out);
    free(err);
    /* -n past the window runs the window, as run.c's -n does, and says so */
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 100000 --prompt %s", model, "hi");
    ck_assert_msg(rc == 0 && strstr(err, "-n 100000 is past the model's window: running its 512 positions"),
                  "exit %d: %s", rc, err);
    free(out); free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* An output that names one of the command's inputs replaced it: `sculpt --out` given the model
 * file wrote the cache over the model, `eval --csv` given a document emptied it before reading.
 * Both are refused before any work (exit 2), the input left as it was. */
START_TEST(test_out_is_an_input)
{
    char *tmp = kvm_test_tmpdir(), model[4096], tok[4096], doc[4096], args[16384], *out, *err;
    size_t nm, nt, nd;
    char *mb = kvm_test_read_file(kvm_test_data_path("models/stories260K.bin"), &nm);
    char *tb = kvm_test_read_file(kvm_test_data_path("models/tok512.bin"), &nt);
    char *db = kvm_test_read_file(kvm_test_data_path("corpus/doc_000.txt"), &nd);
    snprintf(model, sizeof model, "%s/m.bin", tmp);
    snprintf(tok, sizeof tok, "%s/tok512.bin", tmp);
    snprintf(doc, sizeof doc, "%s/d.txt", tmp);
    ck_assert_int_eq(kvm_test_write_file(model, mb, nm), 0);
    ck_assert_int_eq(kvm_test_write_file(tok, tb, nt), 0);
    ck_assert_int_eq(kvm_test_write_file(doc, db, nd), 0);
    snprintf(args, sizeof args, "sculpt --model '%s' --doc '%s' --iterations 1 --rounds 1 --out %%s%%s", model, doc);
    int rc = kvmill(&out, &err, args, model, "");
    ck_assert_msg(rc == 2 && strstr(err, "is the --model file"), "exit %d: %s", rc, err);
    free(out); free(err);
    rc = kvmill(&out, &err, args, tok, "");
    ck_assert_msg(rc == 2 && strstr(err, "is the tokenizer (beside the model) file"), "exit %d: %s", rc, err);
    free(out); free(err);
    rc = kvmill(&out, &err, args, "''", ""); /* empty: the write failed after the work, exit 1 */
    ck_assert_msg(rc == 2 && strstr(err, "--out is empty"), "exit %d: %s", rc, err);
    free(out); free(err);
    snprintf(args, sizeof args, "eval --model '%s' --docs '%s' --method streaming --budget 8 --context 64 "
             "--continuation 8 --csv %%s%%s", model, doc);
    rc = kvmill(&out, &err, args, doc, "");
    ck_assert_msg(rc == 2 && strstr(err, "--csv") && strstr(err, "is the --docs file"), "exit %d: %s", rc, err);
    free(out); free(err);
    snprintf(args, sizeof args, "eval --model '%s' --docs '%s' --method streaming --budget 8 --context 64 "
             "--continuation 8 --csv %%s%%s", model, tmp); /* a document of a --docs folder */
    rc = kvmill(&out, &err, args, doc, "");
    ck_assert_msg(rc == 2 && strstr(err, "is a document of the --docs folder"), "exit %d: %s", rc, err);
    free(out); free(err);
    /* a polykv method's strategy file (a calibration's result) as --csv: the CSV was renamed over
     * it, exit 0; refused now (also with options after the file, and another method first) */
    char strat[4200];
    snprintf(strat, sizeof strat, "%s/s.bin", tmp);
    snprintf(args, sizeof args,
             "calibrate --model '%s' --docs '%s' --budget 12 --context 40 --continuation 8 "
             "--phases prefill --threads 1 --out %%s%%s",
             model, doc);
    rc = kvmill(&out, &err, args, strat, "");
    ck_assert_msg(rc == 0, "calibrate: exit %d: %s", rc, err);
    free(out);
    free(err);
    size_t ns;
    char *sb = kvm_test_read_file(strat, &ns);
    ck_assert_ptr_nonnull(sb);
    const char *methods[] = {"polykv:%s", "h2o,polykv:%s:threads=1"};
    for (int i = 0; i < 2; i++) {
        char method[4400], line[16384];
        snprintf(method, sizeof method, methods[i], strat);
        snprintf(line, sizeof line,
                 "eval --model '%s' --docs '%s' --method %s --budget 12 --context 40 "
                 "--continuation 8 --threads 1 --csv %%s%%s",
                 model, doc, method);
        rc = kvmill(&out, &err, line, strat, "");
        ck_assert_msg(rc == 2 && strstr(err, "--csv") && strstr(err, "is the --method polykv file") &&
                          strstr(err, "s.bin: writing it would destroy that input"),
                      "--method %s: exit %d: %s", method, rc, err);
        free(out);
        free(err);
        size_t n2;
        char *now2 = kvm_test_read_file(strat, &n2);
        ck_assert_msg(now2 && n2 == ns && !memcmp(now2, sb, ns), "--method %s: the strategy file changed", method);
        free(now2);
    }
    free(sb);
    size_t n;
    char *now = kvm_test_read_file(model, &n);
    ck_assert(now && n == nm && !memcmp(now, mb, n));
    free(now);
    now = kvm_test_read_file(tok, &n);
    ck_assert(now && n == nt && !memcmp(now, tb, n));
    free(now);
    now = kvm_test_read_file(doc, &n);
    ck_assert(now && n == nd && !memcmp(now, db, n));
    free(now);
    /* a model path holding a comma: the inputs' list check splits it, and the output went
     * unchecked; the whole path is compared by identity now */
    char cdir[4200], cmodel[4300];
    snprintf(cdir, sizeof cdir, "%s/a,b", tmp);
    ck_assert_int_eq(mkdir(cdir, 0700), 0);
    snprintf(cmodel, sizeof cmodel, "%s/m.bin", cdir);
    ck_assert_int_eq(kvm_test_write_file(cmodel, mb, nm), 0);
    snprintf(args, sizeof args, "'%s/kvmill' sculpt --model '%s' --tokenizer '%s' --doc '%s' --context 64 --out '%s'",
             kvm_test_bin(), cmodel, tok, doc, cmodel);
    rc = kvm_test_run(args, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "is the --model file"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    now = kvm_test_read_file(cmodel, &n);
    ck_assert(now && n == nm && !memcmp(now, mb, n));
    free(now);
    free(mb); free(tb); free(db);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A document shorter than context + continuation is refused (exit 2, naming it and the lengths)
 * before any prefill and before --csv is opened: a run whose second document was short emptied
 * an existing CSV and exited 1 after computing the first. calibrate refuses it the same way. */
START_TEST(test_short_doc_keeps_csv)
{
    char *tmp = kvm_test_tmpdir(), shortd[4096], csv[4096], docs[9000], args[16384], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    snprintf(shortd, sizeof shortd, "%s/short.txt", tmp);
    snprintf(csv, sizeof csv, "%s/old.csv", tmp);
    ck_assert_int_eq(kvm_test_write_file(shortd, "Once upon a time.", 17), 0);
    ck_assert_int_eq(kvm_test_write_file(csv, "keep\n", 5), 0);
    snprintf(docs, sizeof docs, "%s,%s", kvm_test_data_path("corpus/doc_000.txt"), shortd);
    const char *modes[] = {"--budget 8", "--target-kl 0.1"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args,
                 "eval --model '%%s' --docs '%%s' --method streaming %s --context 64 "
                 "--continuation 8 --threads 1 --csv '%s'",
                 modes[i], csv);
        int rc = kvmill(&out, &err, args, model, docs);
        ck_assert_msg(rc == 2 && strstr(err, "short.txt: 6 tokens, fewer than"), "%s: exit %d: %s", modes[i], rc, err);
        ck_assert_msg(!strstr(out, "doc_000"), "%s: the first document was run: %s", modes[i], out);
        char *now = kvm_test_read_file(csv, NULL);
        ck_assert_msg(now && !strcmp(now, "keep\n"), "%s: --csv was rewritten: %s", modes[i], now);
        free(now);
        free(out);
        free(err);
    }
    snprintf(args, sizeof args,
             "calibrate --model '%%s' --docs '%%s' --budget 8 --context 64 --continuation 8 "
             "--threads 1 --phases prefill --out '%s/s.bin'",
             tmp);
    int rc = kvmill(&out, &err, args, model, docs);
    ck_assert_msg(rc == 2 && strstr(err, "short.txt: 6 tokens, fewer than context 64"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* eval --csv named each document by its file name alone: x/a/doc.txt, y/a/doc.txt and z/doc.txt
 * (different texts) were three rows named "doc". Colliding names become the shortest path
 * suffixes that tell them apart (x/a/doc, y/a/doc, z/doc), in the CSV and the headings; a name
 * no other document has stays as it was. */
START_TEST(test_eval_csv_names_distinct)
{
    char *tmp = kvm_test_tmpdir(), path[4400], docs[16384], args[20000], csvp[4400], *out, *err;
    const char *rel[] = {"x/a/doc.txt", "y/a/doc.txt", "z/doc.txt", "w/other.txt"};
    const char *dirs[] = {"x", "x/a", "y", "y/a", "z", "w"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", tmp, dirs[i]);
        ck_assert_int_eq(mkdir(path, 0755), 0);
    }
    int at = 0;
    for (int i = 0; i < 4; i++) { /* different texts: eval drops a document whose text repeats another's */
        char src[64];
        snprintf(src, sizeof src, "corpus/doc_00%d.txt", i);
        snprintf(path, sizeof path, "%s/%s", tmp, rel[i]);
        kvm_test_concat_file(kvm_test_data_path(src), NULL, path);
        at += snprintf(docs + at, sizeof docs - (size_t)at, "%s%s", i ? "," : "", path);
    }
    snprintf(csvp, sizeof csvp, "%s/out.csv", tmp);
    snprintf(args, sizeof args,
             "eval --model '%%s' --docs '%%s' --method streaming --budget 16 --context 64 --continuation 8 "
             "--threads 1 --csv '%s'",
             csvp);
    int rc = kvmill(&out, &err, args, kvm_test_data_path("models/stories260K.bin"), docs);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    char *csv = kvm_test_read_file(csvp, NULL);
    ck_assert_ptr_nonnull(csv);
    const char *rows[] = {"\nx/a/doc,streaming,", "\ny/a/doc,streaming,", "\nz/doc,streaming,", "\nother,streaming,"};
    for (int i = 0; i < 4; i++)
        ck_assert_msg(strstr(csv, rows[i]), "no row '%s' in:\n%s", rows[i] + 1, csv);
    ck_assert_msg(strstr(out, "== x/a/doc (") && strstr(out, "== other ("), "headings: %s", out);
    free(csv);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* Runs `kvmill eval` on stories260K and corpus doc_000 (continuation 8, one thread) with the
 * options `fixed` then each cases[i][0]; each must exit 2, print nothing on stdout and say
 * cases[i][1]. */
static void expect_eval_refused(const char *fixed, const char *(*cases)[2], size_t n)
{
    char args[16384], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    const char *doc = kvm_test_data_path("corpus/doc_000.txt");
    for (size_t i = 0; i < n; i++) {
        snprintf(args, sizeof args, "eval --model '%%s' --docs '%%s' --continuation 8 --threads 1 %s %s", fixed,
                 cases[i][0]);
        int rc = kvmill(&out, &err, args, model, doc);
        ck_assert_msg(rc == 2 && strstr(err, cases[i][1]), "%s: exit %d: %s", cases[i][0], rc, err);
        ck_assert_str_eq(out, "");
        free(out);
        free(err);
    }
}

/* A sculpt option given twice in one method's own options or in calibrate's --sculpt-opts took
 * the last value unsaid: refused, exit 2, naming the option, both items and the string; also
 * through a deprecated name. A sculpt flag with the same option in a method's own options is no
 * repeat: the method's overrides the flag (retain=16 over --retain 8 leaves --budget 16 no room). */
START_TEST(test_sculpt_option_twice)
{
    const char *cases[][2] = {
        {"--method sculpt:retain=8:iterations=1:retain=16 --budget 40",
         "--method sculpt:retain=8:iterations=1:retain=16: option 'retain' is given twice ('retain=8' and "
         "'retain=16')"},
        {"--method h2o,kvzip:iters=1:iterations=2 --budget 40",
         "--method kvzip:iters=1:iterations=2: option 'iterations' is given twice ('iters=1' and 'iterations=2')"},
        {"--method polykv:/nonexistent/s.bin:seed=1:seed=2 --budget 40", "option 'seed' is given twice"},
        {"--retain 8 --method sculpt:retain=16:iterations=1 --budget 16", "leaves none beyond the retain zone of 16"},
    };
    expect_eval_refused("--context 64", cases, sizeof cases / sizeof cases[0]);
    char *out, *err;
    int rc = kvmill(&out, &err,
                    "calibrate --model '%s' --docs '%s' --budget 16 --context 64 --continuation 8 --threads 1 "
                    "--phases prefill --kvzip --sculpt-opts retain=8,queries=16,retain=16 --out /dev/null",
                    kvm_test_data_path("models/stories260K.bin"), kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_msg(rc == 2 && strstr(err, "kvmill calibrate: --sculpt-opts 'retain=8,queries=16,retain=16': option "
                                         "'retain' is given twice ('retain=8' and 'retain=16')"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
}
END_TEST

/* A size (budget, ratio, entries) among a method's own options, or in calibrate's --sculpt-opts,
 * was obeyed over --budget / --ratio (a --target-kl search then probed only that budget and
 * reported another) or ignored (polykv, calibrate): refused, exit 2, naming the option. So are
 * sculpt's --ratio with --budget (or --entries), where the budget won unsaid. */
START_TEST(test_size_in_method_options)
{
    char args[16384], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    const char *doc = kvm_test_data_path("corpus/doc_000.txt");
    const char *cases[][2] = {
        {"--method sculpt:budget=48:iterations=1 --ratio 0.2", "'budget=48' sizes the cache, which is --ratio's"},
        {"--method kvzip:iterations=1:Ratio=0.5 --budget 40", "no option 'Ratio'"},
        {"--method am:entries=8 --budget 40", "'entries=8' sizes the cache, which is --budget's"},
        {"--method sculpt:budget=48 --target-kl 0.001", "'budget=48' sizes the cache, which is --target-kl's"},
    };
    expect_eval_refused("--context 64", cases, sizeof cases / sizeof cases[0]);
    char *tmp = kvm_test_tmpdir();
    /* kvmill sculpt: --budget won over --ratio, unsaid */
    const char *both[] = {"--ratio 0.3 --budget 64", "--budget 64 --ratio 0.3", "--entries 10 --ratio 0.3"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(args, sizeof args,
                 "sculpt --model '%%s' --doc '%%s' --context 128 --threads 1 --iterations 1 %s "
                 "--out '%s/c.bin'",
                 both[i], tmp);
        int rc = kvmill(&out, &err, args, model, doc);
        ck_assert_msg(rc == 2 && strstr(err, "--ratio and --") && strstr(err, "give one of them"), "%s: exit %d: %s",
                      both[i], rc, err);
        free(out);
        free(err);
    }
    snprintf(args, sizeof args,
             "calibrate --model '%%s' --docs '%%s' --budget 16 --context 64 --continuation 8 "
             "--threads 1 --phases prefill --kvzip --sculpt-opts iterations=1,ratio=0.5 --out '%s/s.bin'",
             tmp);
    int rc = kvmill(&out, &err, args, model, doc);
    ck_assert_msg(rc == 2 && strstr(err, "--sculpt-opts: 'ratio=0.5' sizes the cache"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A bad value among kvzip's or am's own options was refused as "sculpt: --queries 6.4e1", naming
 * another method than the user's. The refusal says nothing of sculpt after the method string.
 * (It still names the setting as "--queries": the option parser is given eval's flags as the
 * same kind of list, and tells the two apart nowhere.) */
START_TEST(test_method_option_as_written)
{
    const char *model = kvm_test_data_path("models/stories260K.bin");
    const char *doc = kvm_test_data_path("corpus/doc_000.txt");
    const char *cases[][2] = {
        {"kvzip:queries=6.4e1", "--method kvzip:queries=6.4e1: --queries 6.4e1: expected an integer"},
        {"am:queries=64.0", "--method am:queries=64.0: --queries 64.0: expected an integer"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *out, *err, args[256];
        snprintf(args, sizeof args,
                 "eval --model '%%s' --docs '%%s' --continuation 8 --threads 1 --context 64 --budget 40 --method %s",
                 cases[i][0]);
        int rc = kvmill(&out, &err, args, model, doc);
        ck_assert_msg(rc == 2 && strstr(err, cases[i][1]) && !strstr(err, "sculpt"), "%s: exit %d: %s", cases[i][0], rc,
                      err);
        free(out);
        free(err);
    }
}
END_TEST

/* An item given twice ran twice: --docs naming one file twice (a folder and one of its files)
 * counted it twice in the mean (calibrate: in the calibration), and a (method, budget) column
 * repeated by --method h2o,h2o or --budget 16,16 (or --ratio 0.3,0.30) was computed twice. Each
 * is refused, exit 2, naming the item. */
START_TEST(test_list_duplicates)
{
    char docs[9000], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    const char *doc = kvm_test_data_path("corpus/doc_000.txt");
    const char *cases[][2] = {
        {"--method h2o,h2o --budget 16", "--method h2o at --budget 16 is given twice"},
        {"--method h2o --budget 16,16", "--method h2o at --budget 16 is given twice"},
        {"--method streaming --ratio 0.3,0.30", "--method streaming at --ratio 0.30 is given twice"},
        {"--method h2o,h2o --target-kl 0.1", "--method h2o is given twice"},
    };
    expect_eval_refused("--context 64", cases, sizeof cases / sizeof cases[0]);
    snprintf(docs, sizeof docs, "%s,%s", kvm_test_data_path("corpus"), doc);
    char *tmp = kvm_test_tmpdir(), cal[4400];
    snprintf(cal, sizeof cal,
             "calibrate --model '%%s' --docs '%%s' --budget 16 --context 64 --continuation 8 --out "
             "'%s/s.bin'",
             tmp);
    const char *cmds[] = {"eval --model '%s' --docs '%s' --method h2o --budget 16 --context 64 --continuation 8", cal};
    for (int i = 0; i < 2; i++) {
        int rc = kvmill(&out, &err, cmds[i], model, docs);
        ck_assert_msg(rc == 2 && strstr(err, "doc_000.txt are the same document"), "%s: exit %d: %s", cmds[i], rc, err);
        ck_assert_str_eq(out, "");
        free(out);
        free(err);
    }
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A value forgotten: `generate --prompt --chat` took "--chat" as the prompt (chat not set), and
 * `calibrate --out --sculpt` wrote the strategy to a file named --sculpt without KVSculpt: a value
 * that is one of the command's options is refused, naming both (--prompt=--chat still gives it).
 * --help after an unknown option, or as the value of one (`eval ... --csv --help` ran the whole
 * evaluation into a file named --help), shows the usage. */
START_TEST(test_value_is_an_option)
{
    char *tmp = kvm_test_tmpdir(), args[16384], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    int rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 4 --prompt --chat%s", model, "");
    ck_assert_msg(rc == 2 &&
                      strstr(err, "option '--prompt' needs a value, and the next argument is the option '--chat'"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 4 --prompt=--chat%s", model, "");
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(args, sizeof args,
             "calibrate --model '%%s' --docs '%%s' --budget 16 --context 64 --continuation 8 "
             "--phases prefill --out --sculpt");
    rc = kvmill(&out, &err, args, model, kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_msg(rc == 2 && strstr(err, "'--out' needs a value"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(args, sizeof args,
             "cd '%s' && '%s/kvmill' eval --model '%s' --docs '%s' --method h2o --budget 8 "
             "--context 64 --continuation 8 --csv --help",
             tmp, kvm_test_bin(), model, kvm_test_data_path("corpus/doc_000.txt"));
    rc = kvm_test_run(args, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "usage: kvmill eval"), "exit %d: %s", rc, err);
    snprintf(args, sizeof args, "%s/--help", tmp);
    ck_assert_msg(access(args, F_OK) != 0, "a file named --help was written");
    free(out);
    free(err);
    rc = kvmill(&out, &err, "eval --bogus --help%s%s", "", "");
    ck_assert_msg(rc == 0 && strstr(out, "usage: kvmill eval"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A one-letter option forgotten as a value: `generate --prompt -n 5` said "unexpected argument
 * '5'", and `--prompt -n --temperature 0` generated from the prompt "-n" with -n unset. An option
 * with a value given twice kept the last one, unsaid: `run --corpus A --corpus B` ran B alone;
 * the last still wins (a script's override appended to a base command) and a note says so. */
START_TEST(test_short_option_as_value_and_given_twice)
{
    char *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    int rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 --prompt -n 4%s", model, "");
    ck_assert_msg(rc == 2 && strstr(err, "option '--prompt' needs a value, and the next argument is the option '-n'"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 2 --prompt=-n%s", model, "");
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    free(out);
    free(err);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 2 --prompt A --prompt B%s", model, "");
    ck_assert_msg(rc == 0 && strstr(err, "note: option --prompt is given twice: 'B' applies, not 'A'"), "exit %d: %s",
                  rc, err);
    ck_assert_msg(!strncmp(out, "B", 1), "%s", out); /* the last one */
    free(out);
    free(err);
    rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 2 -n 3 --prompt A%s", model, "");
    ck_assert_msg(rc == 0 && strstr(err, "note: option -n is given twice: '3' applies, not '2'"), "exit %d: %s", rc,
                  err);
    free(out);
    free(err);
}
END_TEST

/* A strategy file of another model (layer count) was refused naming "FILE:threads=1", options
 * eval appends that the user never wrote: the message names the file and says what is wrong. */
START_TEST(test_polykv_wrong_model)
{
    char *tmp = kvm_test_tmpdir(), args[16384], *out, *err;
    const char *doc = kvm_test_data_path("corpus/doc_000.txt");
    snprintf(args, sizeof args,
             "calibrate --model '%%s' --docs '%%s' --budget 16 --context 64 --continuation 8 "
             "--threads 1 --phases prefill --layer-alloc uniform --out '%s/s.bin'",
             tmp);
    int rc = kvmill(&out, &err, args, kvm_test_data_path("models/stories260K.bin"), doc);
    ck_assert_msg(rc == 0, "calibrate: exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(args, sizeof args,
             "make-model --dim 64 --layers 2 --heads 8 --kv-heads 4 --hidden 172 --vocab 512 "
             "--seq-len 512 --seed 1 --out '%s/m2.bin'%%s%%s",
             tmp);
    ck_assert_int_eq(kvmill(&out, &err, args, "", ""), 0);
    free(out);
    free(err);
    snprintf(args, sizeof args,
             "eval --model '%s/m2.bin' --tokenizer '%%s' --docs '%%s' --context 64 --continuation 8 "
             "--threads 1 --budget 16 --method polykv:%s/s.bin",
             tmp, tmp);
    rc = kvmill(&out, &err, args, kvm_test_data_path("models/tok512.bin"), doc);
    ck_assert_msg(rc == 2 && strstr(err, "/s.bin has 5 layers, the model 2") && !strstr(err, "threads="), "exit %d: %s",
                  rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* Issue 15: a strategy file of another model with the same layer count was used silently (its
 * per-layer patterns and budgets are the other model's). calibrate records the model's id
 * (KVST v3); eval refuses the file on another model, exit 2, naming the file, the recorded and
 * the actual model; on its own model it runs. A v1 or v2 file (no id) still runs, with one note
 * on stderr (not one per budget) that it cannot be checked. */
START_TEST(test_polykv_other_model_same_layers)
{
    char *tmp = kvm_test_tmpdir(), args[16384], *out, *err, path[4200];
    const char *doc = kvm_test_data_path("corpus/doc_000.txt"), *own = kvm_test_data_path("models/stories260K.bin");
    const char *tok = kvm_test_data_path("models/tok512.bin");
    snprintf(args, sizeof args,
             "calibrate --model '%%s' --docs '%%s' --budget 16 --context 64 --continuation 8 "
             "--threads 1 --phases prefill --layer-alloc uniform --out '%s/s.bin'",
             tmp);
    int rc = kvmill(&out, &err, args, own, doc);
    ck_assert_msg(rc == 0, "calibrate: exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(args, sizeof args, /* stories260K's shape: 5 layers, random weights */
             "make-model --dim 64 --layers 5 --heads 8 --kv-heads 4 --hidden 172 --vocab 512 "
             "--seq-len 512 --seed 3 --out '%s/m5.bin'%%s%%s",
             tmp);
    ck_assert_int_eq(kvmill(&out, &err, args, "", ""), 0);
    free(out);
    free(err);
    kvm_store_id id_own, id_other;
    char hex_own[KVM_STORE_ID_HEX + 1], hex_other[KVM_STORE_ID_HEX + 1], want[16384];
    snprintf(path, sizeof path, "%s/m5.bin", tmp);
    ck_assert_int_eq(kvm_store_hash_file(own, &id_own), 0);
    ck_assert_int_eq(kvm_store_hash_file(path, &id_other), 0);
    kvm_store_id_hex(&id_own, hex_own);
    kvm_store_id_hex(&id_other, hex_other);
    const char *eval = "eval --model '%s' --tokenizer '%s' --docs '%s' --context 64 --continuation 8 --threads 1 "
                       "--budget 16,8 --method polykv:%s/%s";
    snprintf(args, sizeof args, eval, path, tok, doc, tmp, "s.bin");
    rc = kvmill(&out, &err, "%s%s", args, "");
    snprintf(want, sizeof want, "strategy %s/s.bin was calibrated on model %s, not on %s (model %s)", tmp, hex_own,
             path, hex_other);
    ck_assert_msg(rc == 2 && strstr(err, want) && !strstr(out, "kl_mean"), "exit %d: %s\nwanted: %s", rc, err, want);
    free(out);
    free(err);
    snprintf(args, sizeof args, eval, own, tok, doc, tmp, "s.bin"); /* its own model */
    rc = kvmill(&out, &err, "%s%s", args, "");
    ck_assert_msg(rc == 0 && !strstr(err, "polykv:") && strstr(out, "kl_mean"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    /* files written before version 3: eviction only (v1), and kvzip layers with their options (v2) */
    kvm_strategy *st;
    snprintf(path, sizeof path, "%s/s.bin", tmp);
    ck_assert_int_eq(kvm_strategy_read(path, &st), 0);
    st->model_known = 0;
    snprintf(path, sizeof path, "%s/v1.bin", tmp);
    ck_assert_int_eq(kvm_strategy_write(st, path), 0);
    for (int l = 0; l < st->n_layers; l++)
        st->layers[l].pattern[0] = st->layers[l].pattern[1] = KVM_PATTERN_KVZIP;
    ck_assert_int_eq(kvm_sculpt_opts_parse(&st->sculpt, "queries=16"), 0);
    st->sculpt_known = 1;
    snprintf(path, sizeof path, "%s/v2.bin", tmp);
    ck_assert_int_eq(kvm_strategy_write(st, path), 0);
    kvm_strategy_free(&st);
    for (int v = 1; v <= 2; v++) {
        char name[16], note[4400];
        snprintf(name, sizeof name, "v%d.bin", v);
        snprintf(path, sizeof path, "%s/m5.bin", tmp);
        snprintf(args, sizeof args, eval, path, tok, doc, tmp, name);
        rc = kvmill(&out, &err, "%s%s", args, "");
        snprintf(note, sizeof note,
                 "polykv: %s/%s is a version-%d strategy: it does not record the model it was "
                 "calibrated on, so it cannot be checked against %s",
                 tmp, name, v, path);
        ck_assert_msg(rc == 0 && kvm_test_count(err, note) == 1 && strstr(out, "kl_mean"), "v%d: exit %d: %s", v, rc,
                      err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* --target-kl with --target-step at or above --context (or, for a sculpt-family method, no multiple
 * between its retain zone and the context) searched no budget below the context: one probe at
 * the whole context, "reached", a "compressed" cache as large as the full one, exit 0. Refused as
 * [compress] target_step is (exit 2). */
START_TEST(test_target_step_past_context_cli)
{
    const char *cases[][2] = {
        {"--method h2o --target-step 64", "method h2o: no budget below --context 64 is searched"},
        {"--method sculpt --target-step 32 --retain 40", "lower --target-step or --retain"},
    };
    expect_eval_refused("--context 64 --target-kl 0.1", cases, 2);
}
END_TEST

/* A read error in generate's --tokens file (EIO; here a folder's stream, whose read fails with
 * EISDIR) ended fgets as the end of the file did: the ids before it made the prompt (exit 0) or
 * "no token ids". It is a runtime failure now (1), naming the file and the line it followed. */
typedef struct tokens_read {
    const char *path;
    int rc;
} tokens_read;

static void read_tokens_of_folder(void *arg)
{
    tokens_read *t = arg;
    int fd = open(t->path, O_RDONLY);
    FILE *f = fd >= 0 ? fdopen(fd, "r") : NULL;
    ck_assert_ptr_nonnull(f);
    int32_t *ids = NULL;
    int64_t n = 0;
    t->rc = kvm_cli_read_token_ids("generate", f, t->path, 512, &ids, &n);
    ck_assert_ptr_null(ids);
    fclose(f);
}

START_TEST(test_generate_tokens_read_error)
{
    char *tmp = kvm_test_tmpdir();
    tokens_read t = {tmp, -1};
    char *err = kvm_test_stderr_of(read_tokens_of_folder, &t), want[4400];
    snprintf(want, sizeof want, "kvmill generate: %s:1: read error: ", tmp);
    ck_assert_msg(t.rc == 1 && strstr(err, want) && !strstr(err, "no token ids"), "status %d: %s", t.rc, err);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* `sculpt --out` naming standard output (/dev/stdout, or the FIFO, pipe or file stdout goes to)
 * got the summary line too: mixed into the binary cache on a pipe or FIFO, lost with the file
 * the cache replaced otherwise. The summary goes to stderr then; the output is the cache alone. */
/* 1 when the n bytes at p hold the text s. */
static int holds(const char *p, size_t n, const char *s)
{
    size_t k = strlen(s);
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(p + i, s, k)) return 1;
    return 0;
}

START_TEST(test_sculpt_out_is_stdout)
{
    char *tmp = kvm_test_tmpdir(), args[16384], *out = NULL, *err = NULL;
    const char *model = kvm_test_data_path("models/stories260K.bin"), *doc = kvm_test_data_path("corpus/doc_000.txt");
    const char *sculpt = "sculpt --model '%s' --doc '%s' --context 48 --retain 8 --iterations 1 --rounds 1 --threads 1";
    char base[8400];
    snprintf(base, sizeof base, sculpt, model, doc);
    /* a FIFO (as /dev/stdout on a pipe): its reader gets exactly what was written to it */
    snprintf(args, sizeof args,
             "cd '%s' && mkfifo f && { cat f > got & } && '%s/kvmill' %s --out f > f 2> err; rc=$?; wait; "
             "cat err >&2; exit $rc",
             tmp, kvm_test_bin(), base);
    int rc = kvm_test_run(args, &out, &err);
    char got[4300], file[4300];
    snprintf(got, sizeof got, "%s/got", tmp);
    size_t n = 0;
    char *bytes = kvm_test_read_file(got, &n);
    ck_assert_msg(rc == 0 && strstr(err, "sculpt: N=48 "), "fifo: exit %d: %s", rc, err);
    ck_assert_msg(bytes && n > 8 && !memcmp(bytes, "KVMSCULP", 8), "fifo: %zu bytes read from it", n);
    ck_assert_msg(!holds(bytes, n, "sculpt: N="), "fifo: the summary is among the cache's %zu bytes", n);
    free(bytes);
    free(out);
    free(err);
    /* a file that stdout goes to as well: the summary is not lost with the file the cache replaced */
    snprintf(file, sizeof file, "%s/c.bin", tmp);
    snprintf(args, sizeof args, "'%s/kvmill' %s --out '%s' > '%s'", kvm_test_bin(), base, file, file);
    rc = kvm_test_run(args, &out, &err);
    bytes = kvm_test_read_file(file, &n);
    ck_assert_msg(rc == 0 && strstr(err, "sculpt: N=48 "), "file: exit %d: %s", rc, err);
    ck_assert_msg(bytes && n > 8 && !memcmp(bytes, "KVMSCULP", 8), "file: %zu bytes", n);
    free(bytes);
    free(out);
    free(err);
    /* another --out: the summary stays on stdout */
    snprintf(args, sizeof args, "'%s/kvmill' %s --out '%s/d.bin'", kvm_test_bin(), base, tmp);
    rc = kvm_test_run(args, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "sculpt: N=48 ") && !strstr(err, "sculpt: N="), "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* kvmill sculpt on a context just past the retain zone distils no entry and wrote the full KV,
 * exit 0 (later with a note on stderr); eval refuses such a ratio, and now sculpt does too, in
 * eval's words (exit 2, one distilled entry in the singular). */
START_TEST(test_sculpt_kept_whole_said)
{
    char *tmp = kvm_test_tmpdir(), args[16384], *out, *err;
    snprintf(args, sizeof args,
             "sculpt --model '%%s' --doc '%%s' --context 9 --retain 8 --iterations 1 --threads 1 "
             "--out '%s/c.bin'",
             tmp);
    int rc = kvmill(&out, &err, args, kvm_test_data_path("models/stories260K.bin"),
                    kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_msg(rc == 2 && strstr(err, "--ratio 0.3 of the compress zone (--context 9 less the retain zone of 8) "
                                         "keeps 1 distilled entry beside the 8 retained, the whole context"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A FIFO the user names (--docs, --tokens, polykv:FILE) with no writer blocked the open for ever
 * (the command hung, no message): it reads as empty now and is refused, named as not a regular
 * file (exit 2); a
 * shell's <(...) with its writer is still read. An output FIFO (eval --csv, sculpt and calibrate
 * --out) with no reader: exit 2. */
START_TEST(test_fifo_without_writer)
{
    char *tmp = kvm_test_tmpdir(), fifo[4200], args[16384], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    snprintf(fifo, sizeof fifo, "%s/f.txt", tmp);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    const char *cmds[][2] = {
        {"generate --model '%s' -n 4 --tokens '%s'", "f.txt: no token ids"},
        {"eval --model '%s' --docs '%s' --method h2o --budget 8 --context 64 --continuation 8",
         "f.txt: not a regular file (a FIFO"}, /* docs_from_a_pipe */
        /* named as eval names it: "is empty" blamed the document for a writer that came later */
        {"sculpt --model '%s' --doc '%s' --out /dev/null", "f.txt: not a regular file (a FIFO"},
        /* an output FIFO with no reader: fopen(..., "w") waited for one for ever */
        {"eval --model '%s' --docs DOC --method h2o --budget 8 --context 64 --continuation 8 --csv '%s'",
         "f.txt: a FIFO that no process is reading"},
        {"sculpt --model '%s' --doc DOC --context 64 --iterations 1 --threads 1 --out '%s'", "--out /"},
        {"calibrate --model '%s' --docs DOC --budget 8 --context 64 --continuation 8 --phases prefill --threads 1 "
         "--out '%s'",
         "--out /"}, /* refused before the calibration now, naming the flag */
    };
    for (int i = 0; i < 6; i++) {
        char inner[9000], fmt[9000];
        snprintf(fmt, sizeof fmt, "%s", cmds[i][0]);
        char *at = strstr(fmt, "DOC"); /* the document's path, fixed before the format */
        if (at) {
            char rest[9000];
            snprintf(rest, sizeof rest, "%s", at + 3);
            snprintf(at, sizeof fmt - (size_t)(at - fmt), "'%s'%s", kvm_test_data_path("corpus/doc_000.txt"), rest);
        }
        snprintf(inner, sizeof inner, fmt, model, fifo);
        snprintf(args, sizeof args, "timeout 30 '%s/kvmill' %s", kvm_test_bin(), inner);
        int rc = kvm_test_run(args, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, cmds[i][1]) && (i < 3 || strstr(err, "a FIFO that no process is reading")),
                      "%s: exit %d: %s", inner, rc, err);
        free(out);
        free(err);
    }
    snprintf(args, sizeof args,
             "bash -c \"'%s/kvmill' generate --model '%s' --temperature 0 -n 6 --tokens <(printf "
             "'1\\n403\\n')\"",
             kvm_test_bin(), model);
    int rc = kvm_test_run(args, &out, &err);
    ck_assert_msg(rc == 0 && strlen(out) > 0, "<(...): exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* `--docs <(...)` (a pipe whose writer is there) was read once by the length check and found
 * empty by the run: "/dev/fd/63: 1 tokens, fewer than context 64 + continuation 8", exit 1, about
 * a document that has hundreds; eval and calibrate read each document more than once. A path that
 * is not a regular file or a folder is now refused at once, naming it and why (exit 2), as a
 * folder's FIFO named *.txt was; the same document as a file runs. */
START_TEST(test_docs_from_a_pipe)
{
    const char *model = kvm_test_data_path("models/stories260K.bin"), *doc = kvm_test_data_path("corpus/doc_000.txt");
    const char *cmds[] = {
        "eval --model '%s' --docs %s --method h2o --budget 8 --context 64 --continuation 8 --threads 1",
        "calibrate --model '%s' --docs %s --budget 8 --context 40 --continuation 8 --phases prefill --threads 1 "
        "--out /dev/null",
    };
    for (int i = 0; i < 2; i++) {
        char pipe[4200], file[4200], inner[9000], args[16384], *out = NULL, *err = NULL;
        snprintf(pipe, sizeof pipe, "<(cat '%s')", doc);
        snprintf(inner, sizeof inner, cmds[i], model, pipe);
        snprintf(args, sizeof args, "bash -c \"timeout 60 '%s/kvmill' %s\"", kvm_test_bin(), inner);
        int rc = kvm_test_run(args, &out, &err);
        ck_assert_msg(
            rc == 2 && strstr(err, "/dev/fd/") &&
                strstr(err, ": not a regular file (a FIFO, such as the shell's <(...), a socket or a device): ") &&
                strstr(err, "save it to a file"),
            "%s: exit %d: %s", inner, rc, err);
        free(out);
        free(err);
        snprintf(file, sizeof file, "'%s'", doc);
        snprintf(inner, sizeof inner, cmds[i], model, file);
        snprintf(args, sizeof args, "timeout 60 '%s/kvmill' %s", kvm_test_bin(), inner);
        rc = kvm_test_run(args, &out, &err);
        ck_assert_msg(rc == 0, "%s: exit %d: %s", inner, rc, err);
        free(out);
        free(err);
    }
}
END_TEST

/* Settings under which eval's "compressed" cache is the whole context, or a method cannot run:
 * --ratio whose r·N rounds up to N (--context 1 --ratio 0.5 reported KL 0, exit 0), and a
 * sculpt-family method whose retain zone is not below --context (each document failed after its
 * prefill, exit 1). Refused before any work, exit 2, as sculpt and run refuse them. */
START_TEST(test_eval_no_compression)
{
    const char *cases[][2] = {
        {"--context 1 --ratio 0.5 --method h2o", "--ratio 0.5 of --context 1 keeps 1 entry, the whole context"},
        {"--context 128 --ratio 0.999 --method tova", "keeps 128 entries, the whole context"},
        {"--context 16 --ratio 0.5 --method sculpt", "--method sculpt: the retain zone of 32 tokens is not below"},
        {"--context 16 --ratio 0.5 --method kvzip --retain 16", "retain zone of 16 tokens is not below --context 16"},
    };
    expect_eval_refused("", cases, sizeof cases / sizeof cases[0]);
}
END_TEST

/* calibrate --config with an option of calibrate without it (--budget, --context, ...) said
 * "unknown option", though calibrate --help lists it: now it names the config key to set, or
 * says it has no --config counterpart (exit 2 either way); --help still shows the usage. */
START_TEST(test_calibrate_config_own_options)
{
    char *out, *err;
    const char *cases[][2] = {
        {"--budget 16", "--budget does not combine with --config: set [compress] budget in the config file"},
        {"--context=64", "--context does not combine with --config: set [model] context"},
        {"--windows 2", "--windows is an option of calibrate without --config"},
    };
    for (size_t i = 0; i < 3; i++) {
        int rc = kvmill(&out, &err, "calibrate --config /nonexistent.ini --docs /nonexistent %s%s", cases[i][0], "");
        ck_assert_msg(rc == 2 && strstr(err, cases[i][1]), "%s: exit %d: %s", cases[i][0], rc, err);
        free(out);
        free(err);
    }
    int rc = kvmill(&out, &err, "calibrate --config /nonexistent.ini --budget 16 --help%s%s", "", "");
    ck_assert_msg(rc == 0 && strstr(out, "usage: kvmill calibrate"), "exit %d: %s", rc, err);
    free(out);
    free(err);
}
END_TEST

/* `run --dump-config` printed (exit 0) configurations that `run` then refused at start (exit 2):
 * settings that do not go together ([compress] budget not below the context, ratio = 0 (out of
 * range, as --ratio 0), on_policy with a query source it cannot use, [model] system without chat). The
 * dump now refuses each with run's message and exit status; so does serve's dump, for the
 * settings its workers refuse. A valid config still dumps. */
START_TEST(test_dump_config_refuses_what_run_refuses)
{
    char *tmp = kvm_test_tmpdir(), ini[4096], text[8192], *out, *err;
    const char *model = kvm_test_data_path("models/stories260K.bin"), *corpus = kvm_test_data_path("corpus");
    const char *cases[][2] = {
        {"[compress]\nbudget = 1000\n", "[compress] budget = 1000 is not below [model] context = 384"},
        {"[compress]\nratio = 0\nbudget = 0\n", "[compress] ratio: 0 is outside [1e-09, 1]"}, /* as --ratio 0 */
        {"[compress]\non_policy = true\nalloc = head\n", "on_policy takes its queries from forward passes"},
        {"system = Be brief.\n", "[model] system is set but chat = false"},
        /* budget at or below retain: run compressed at ratio instead, under a config id naming the budget */
        {"[compress]\nbudget = 10\nratio = 0.3\n",
         "c.ini: [compress] budget = 10 entries per head leaves none beyond the "
         "retain zone of [compress] retain = 32 (method sculpt"},
        {"[compress]\nmethod = am\nbudget = 16\nretain = 16\n",
         "[compress] budget = 16 entries per head leaves none "
         "beyond the retain zone of [compress] retain = 16 (method am"},
    };
    snprintf(ini, sizeof ini, "%s/c.ini", tmp);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int n = snprintf(text, sizeof text, "[model]\npath = %s\n%s", model, cases[i][0]); /* [model] keys first */
        ck_assert_int_eq(kvm_test_write_file(ini, text, (size_t)n), 0);
        int rc = kvmill(&out, &err, "run --config '%s' --dump-config%s", ini, "");
        ck_assert_msg(rc == 2 && strstr(err, cases[i][1]), "%s: dump: exit %d: %s", cases[i][0], rc, err);
        ck_assert_str_eq(out, "");
        char *dump_err = err;
        free(out);
        char store[4200];
        snprintf(store, sizeof store, "%s/store", tmp);
        snprintf(text, sizeof text, "run --config '%s' --corpus '%%s' --store '%s'", ini, store);
        rc = kvmill(&out, &err, text, corpus, "");
        ck_assert_msg(rc == 2 && !strcmp(err, dump_err), "%s: run: exit %d: '%s', dump said '%s'", cases[i][0], rc, err,
                      dump_err);
        free(out);
        free(err);
        free(dump_err);
        if (i < 3) continue; /* serve's workers refuse the rest too (kvm_jobcfg_check) */
        rc = kvmill(&out, &err, "serve --config '%s' --dump-config%s", ini, "");
        ck_assert_msg(rc == 2 && strstr(err, "kvmill serve:") && strstr(err, cases[i][1]), "serve: exit %d: %s", rc,
                      err);
        free(out);
        free(err);
    }
    int n = snprintf(text, sizeof text, "[model]\npath = %s\n[compress]\nbudget = 64\n", model);
    ck_assert_int_eq(kvm_test_write_file(ini, text, (size_t)n), 0);
    int rc = kvmill(&out, &err, "run --config '%s' --dump-config%s", ini, "");
    ck_assert_msg(rc == 0 && strstr(out, "budget = 64"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A command whose stdout could not be written (a full disk: /dev/full; a closed descriptor) lost
 * its tables and summaries under exit 0, unsaid: `kvmill eval ... > results.txt` on a full device
 * looked like a finished run. It now exits 1 naming the command and stdout; a command that
 * failed keeps its own status. */
START_TEST(test_stdout_write_error)
{
    if (access("/dev/full", W_OK) != 0) {
        kvm_test_skip("/dev/full absent: a failed write to stdout not checked");
        return;
    }
    const char *model = kvm_test_data_path("models/stories260K.bin"), *doc = kvm_test_data_path("corpus/doc_000.txt");
    char *out = NULL, *err = NULL;
    const char *cases[][2] = {
        {"info --model '%s' %s> /dev/full", "kvmill info: writing to stdout failed: No space left on device"},
        {"generate --model '%s' -n 40 --temperature 0 --prompt hi %s>&-", "kvmill generate: writing to stdout failed"},
        {"eval --model '%s' --docs '%s' --method h2o --budget 16 --context 64 --continuation 8 --threads 1 > /dev/full",
         "kvmill eval: writing to stdout failed: No space left on device: the output is incomplete"},
    };
    for (int i = 0; i < 3; i++) {
        int rc = kvmill(&out, &err, cases[i][0], model, i == 2 ? doc : "");
        ck_assert_msg(rc == 1 && strstr(err, cases[i][1]), "%s: exit %d: %s", cmd, rc, err);
        free(out);
        free(err);
    }
    int rc = kvmill(&out, &err, "info --model '%s/none.bin' > /dev/full%s", kvm_test_data(), "");
    ck_assert_msg(rc == 2 && !strstr(err, "stdout"), "%s: exit %d: %s", cmd, rc, err); /* its own status */
    free(out);
    free(err);
    rc = kvmill(&out, &err, "info --model '%s'%s", model, ""); /* written: as before */
    ck_assert_msg(rc == 0 && strstr(out, "model:") && !*err, "%s: exit %d: %s", cmd, rc, err);
    free(out);
    free(err);
}
END_TEST

/* make-model wrote OUT.partial and renamed it over OUT, whatever OUT was: a FIFO without a reader
 * or a device node became a regular file, exit 0 "wrote" (as root, --out /dev/null replaced
 * /dev/null, and /dev/full "took" the checkpoint), and a link to a file became a file. --out is
 * now written as eval's --csv is (kvm_cli_staged): a FIFO without a reader is refused (exit 2),
 * a device is written in place (a full one: "write failed", exit 1, no OUT.part left), a link's
 * file is replaced and the link kept. The devices here are made in a temporary folder (mknod,
 * root only; skipped otherwise), never the machine's own. */
START_TEST(test_make_model_out_kinds)
{
    char *tmp = kvm_test_tmpdir(), path[4300], part[4400], real[4300], *out = NULL, *err = NULL;
    const char *mm = "make-model --dim 64 --layers 1 --heads 4 --hidden 64 --vocab 512 --seq-len 64 --out '%s'%s";
    struct stat st;
    snprintf(path, sizeof path, "%s/m.fifo", tmp);
    ck_assert_int_eq(mkfifo(path, 0600), 0);
    int rc = kvmill(&out, &err, mm, path, "");
    ck_assert_msg(rc == 2 && strstr(err, "m.fifo: a FIFO that no process is reading"), "%s: exit %d: %s", cmd, rc, err);
    ck_assert_msg(lstat(path, &st) == 0 && S_ISFIFO(st.st_mode), "%s: the FIFO was replaced", cmd);
    free(out);
    free(err);
    snprintf(path, sizeof path, "%s/full", tmp);
    if (mknod(path, S_IFCHR | 0666, makedev(1, 7)) != 0) { /* the kernel's /dev/full, under another name */
        kvm_test_skip("mknod not permitted: make-model --out on a full device not checked");
    } else {
        rc = kvmill(&out, &err, mm, path, "");
        ck_assert_msg(rc == 1 && strstr(err, "full: write failed: No space left on device") && !strstr(err, "wrote"),
                      "%s: exit %d: %s", cmd, rc, err);
        ck_assert_msg(lstat(path, &st) == 0 && S_ISCHR(st.st_mode), "%s: the device was replaced", cmd);
        snprintf(part, sizeof part, "%s.part", path);
        ck_assert_int_ne(access(part, F_OK), 0);
        free(out);
        free(err);
    }
    snprintf(real, sizeof real, "%s/real.bin", tmp);
    snprintf(path, sizeof path, "%s/link.bin", tmp);
    ck_assert_int_eq(kvm_test_write_file(real, "old", 3), 0);
    ck_assert_int_eq(symlink(real, path), 0);
    rc = kvmill(&out, &err, mm, path, "");
    ck_assert_msg(rc == 0 && strstr(err, "wrote"), "%s: exit %d: %s", cmd, rc, err);
    ck_assert_msg(lstat(path, &st) == 0 && S_ISLNK(st.st_mode), "%s: the link was replaced by a file", cmd);
    ck_assert_msg(stat(real, &st) == 0 && st.st_size > 1000, "%s: the link's file was not written", cmd);
    free(out);
    free(err);
    rc = kvmill(&out, &err, "info --model '%s'%s", real, "");
    ck_assert_msg(rc == 0 && strstr(out, "dim"), "%s: exit %d: %s", cmd, rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* The --docs list's same-file check stat'ed every path once per other path: 12,000 documents
 * took 70 s of stat calls before any work (20,000: minutes; quadratic). Each path is stat'ed
 * once now (a hash set over device and inode): 20,000 one-line documents are listed and the
 * first is refused as too short at once; one of them named again is still refused by name. */
START_TEST(test_docs_list_many)
{
    char *tmp = kvm_test_tmpdir(), dir[4200], path[4400], *out = NULL, *err = NULL;
    snprintf(dir, sizeof dir, "%s/docs", tmp);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    for (int i = 0; i < 20000; i++) {
        snprintf(path, sizeof path, "%s/d%05d.txt", dir, i);
        FILE *f = fopen(path, "w");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "Once upon a time %d.", i);
        ck_assert_int_eq(fclose(f), 0);
    }
    const char *model = kvm_test_data_path("models/stories260K.bin");
    char args[9000];
    snprintf(args, sizeof args,
             "timeout 60 '%s/kvmill' eval --model '%s' --docs '%s' --method h2o --budget 16 --context 64 "
             "--continuation 8",
             kvm_test_bin(), model, dir);
    int rc = kvm_test_run(args, &out, &err);
    ck_assert_msg(rc == 2 && strstr(err, "d00000.txt: ") && strstr(err, "fewer than context 64 + continuation 8"),
                  "exit %d (124: still listing after 60 s): %s", rc, err);
    free(out);
    free(err);
    snprintf(args, sizeof args, "%s,%s/d12345.txt", dir, dir);
    rc = kvmill(&out, &err, "eval --model '%s' --docs '%s' --method h2o --budget 16 --context 64 --continuation 8",
                model, args);
    ck_assert_msg(rc == 2 && strstr(err, "d12345.txt and ") && strstr(err, "d12345.txt are the same document"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A --docs file or folder whose name holds a comma was split at it and refused with the cut
 * path: a value naming a file whole is taken whole (and is an input --csv may not overwrite); a
 * missing item of a split value says the value was read as a comma-separated list. */
START_TEST(test_docs_name_with_comma)
{
    char *tmp = kvm_test_tmpdir(), doc[4300], dir[4300], in_dir[4400], list[9000], *out = NULL, *err = NULL;
    size_t n;
    char *text = kvm_test_read_file(kvm_test_data_path("corpus/doc_000.txt"), &n);
    ck_assert_ptr_nonnull(text);
    snprintf(doc, sizeof doc, "%s/notes, part 1.txt", tmp);
    snprintf(dir, sizeof dir, "%s/x,y", tmp);
    snprintf(in_dir, sizeof in_dir, "%s/d.txt", dir);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    ck_assert_int_eq(kvm_test_write_file(doc, text, n), 0);
    ck_assert_int_eq(kvm_test_write_file(in_dir, text, n), 0);
    free(text);
    const char *model = kvm_test_data_path("models/stories260K.bin");
    const char *base = "eval --model '%s' --docs '%s' --method h2o --budget 16 --context 64 --continuation 8";
    const char *whole[] = {doc, dir};
    for (int i = 0; i < 2; i++) {
        int rc = kvmill(&out, &err, base, model, whole[i]);
        ck_assert_msg(rc == 0, "--docs %s: exit %d: %s", whole[i], rc, err);
        free(out);
        free(err);
    }
    snprintf(list, sizeof list, "%s' --csv '%s", doc, doc); /* --csv names the document itself */
    int rc = kvmill(&out, &err, base, model, list);
    ck_assert_msg(rc == 2 && strstr(err, "is the --docs file"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    snprintf(list, sizeof list, "%s,%s/missing.txt", doc, tmp);
    rc = kvmill(&out, &err, base, model, list);
    /* a name with a comma cannot be one item of a list: the cut path is named, and why */
    ck_assert_msg(rc == 2 && strstr(err, "/notes: No such file or directory (--docs '") &&
                      strstr(err, "' was read as a comma-separated list: no file or folder has that whole name)"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* A PATH.part left behind (a killed command, an interrupted eval, or planted) was opened
 * following links and emptied: a link to a store's data.mdb destroyed the store, a hard link to
 * a read-only file overwrote it, and an interrupted eval's rows (which it said are there) went
 * without a word. Now a link (symbolic or hard) is refused, and so is an eval CSV's .part holding
 * rows, each left as it is, naming it; another command's leftover is written again. */
START_TEST(test_part_leftovers_refused)
{
    char *tmp = kvm_test_tmpdir(), path[4300], part[4400], victim[4300], *out = NULL, *err = NULL;
    const char *mm = "make-model --dim 64 --layers 1 --heads 4 --hidden 64 --vocab 512 --seq-len 64 --out '%s'%s";
    snprintf(path, sizeof path, "%s/m.bin", tmp);
    snprintf(part, sizeof part, "%s.part", path);
    snprintf(victim, sizeof victim, "%s/victim", tmp);
    ck_assert_int_eq(kvm_test_write_file(victim, "precious", 8), 0);
    const char *want[] = {"m.bin.part is a symbolic link: it would be written through",
                          "m.bin.part has 1 other hard link(s): it would be written through"};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(i == 0 ? symlink(victim, part) : link(victim, part), 0);
        int rc = kvmill(&out, &err, mm, path, "");
        ck_assert_msg(rc == 2 && strstr(err, want[i]), "case %d: exit %d: %s", i, rc, err);
        free(out);
        free(err);
        char *text = kvm_test_read_file(victim, NULL);
        ck_assert_msg(text && !strcmp(text, "precious"), "case %d: the file behind the .part was written", i);
        free(text);
        ck_assert_int_eq(unlink(part), 0);
    }
    /* a killed make-model's leftover: emptied and written again, as a rerun expects */
    ck_assert_int_eq(kvm_test_write_file(part, "partial", 7), 0);
    int rc = kvmill(&out, &err, mm, path, "");
    ck_assert_msg(rc == 0 && access(part, F_OK) != 0, "exit %d: %s", rc, err);
    free(out);
    free(err);
    /* an interrupted eval's rows, which it said are in CSV.part: kept, the eval refused */
    char csv[4300], args[8192];
    snprintf(csv, sizeof csv, "%s/r.csv", tmp);
    snprintf(part, sizeof part, "%s.part", csv);
    ck_assert_int_eq(kvm_test_write_file(part, "doc,method\nd,h2o\n", 17), 0);
    snprintf(args, sizeof args,
             "eval --model '%s/models/stories260K.bin' --docs '%s/corpus/doc_000.txt' --context 64 "
             "--continuation 8 --method h2o --budget 16 --csv '%s'%s",
             kvm_test_data(), kvm_test_data(), csv, "");
    rc = kvmill(&out, &err, "%s%s", args, "");
    ck_assert_msg(rc == 2 && strstr(err, "r.csv.part holds 17 bytes left by an earlier run that did not finish"),
                  "exit %d: %s", rc, err);
    free(out);
    free(err);
    char *rows = kvm_test_read_file(part, NULL);
    ck_assert_msg(rows && !strcmp(rows, "doc,method\nd,h2o\n"), "the rows were not kept");
    free(rows);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* sculpt wrote its cache straight into --out: a write that failed part-way (a full disk; here
 * the file size limit, `ulimit -f`) left OUT truncated, the cache it held before lost, and a run
 * killed while writing left a truncated OUT. The cache now goes to OUT.part, renamed over OUT when
 * whole: OUT keeps its old bytes and no .part is left; a run that succeeds replaces it. */
START_TEST(test_sculpt_out_kept_on_failure)
{
    char *tmp = kvm_test_tmpdir(), out_path[4200], part[4300], args[16384], *out = NULL, *err = NULL;
    snprintf(out_path, sizeof out_path, "%s/c.kvs", tmp);
    snprintf(part, sizeof part, "%s.part", out_path);
    const char *old = "an earlier cache";
    ck_assert_int_eq(kvm_test_write_file(out_path, old, strlen(old)), 0);
    const char *model = kvm_test_data_path("models/stories260K.bin"), *doc = kvm_test_data_path("corpus/doc_000.txt");
    snprintf(args, sizeof args,
             "sh -c \"trap '' XFSZ; ulimit -f 8; '%s/kvmill' sculpt --model '%s' --doc '%s' --context 64 --budget 40 "
             "--threads 1 --out '%s'\"",
             kvm_test_bin(), model, doc, out_path);
    int rc = kvm_test_run(args, &out, &err);
    ck_assert_msg(rc == 1 && strstr(err, "c.kvs: write failed: File too large"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    char *now = kvm_test_read_file(out_path, NULL);
    ck_assert_msg(now && !strcmp(now, old), "--out was replaced by a cut-short cache (%s)", now ? "bytes" : "gone");
    free(now);
    ck_assert_int_ne(access(part, F_OK), 0);
    snprintf(args, sizeof args, "sculpt --model '%s' --doc '%s' --context 64 --budget 40 --threads 1 --out '%%s'%%s",
             model, doc);
    rc = kvmill(&out, &err, args, out_path, "");
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    struct stat st;
    ck_assert(stat(out_path, &st) == 0 && st.st_size > 1000);
    ck_assert_int_ne(access(part, F_OK), 0);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* calibrate's --out and --dump-signals on a full device said "write failed" and nothing more (a
 * full disk and a cut network link read alike); the reason is said now. The full device is made
 * with mknod in a temporary folder (root only; skipped otherwise). */
START_TEST(test_calibrate_write_error_says_why)
{
    char *tmp = kvm_test_tmpdir(), full[4200], sig[4300], args[16384], *out = NULL, *err = NULL;
    snprintf(full, sizeof full, "%s/full", tmp);
    if (mknod(full, S_IFCHR | 0666, makedev(1, 7)) != 0) {
        kvm_test_skip("mknod not permitted: calibrate's write errors on a full device not checked");
        kvm_test_rmtree(tmp);
        free(tmp);
        return;
    }
    snprintf(sig, sizeof sig, "%s/s.bin", tmp);
    const char *model = kvm_test_data_path("models/stories260K.bin"), *doc = kvm_test_data_path("corpus/doc_000.txt");
    const char *outs[][2] = {{"--out '%s'%s", "--out "}, {"--out '%s' --dump-signals '%s'", "--dump-signals "}};
    for (int i = 0; i < 2; i++) {
        char flags[9000];
        snprintf(flags, sizeof flags, outs[i][0], i ? sig : full, i ? full : "");
        snprintf(args, sizeof args,
                 "calibrate --model '%%s' --docs '%%s' --budget 12 --context 40 --continuation 8 --phases prefill "
                 "--threads 1 %s",
                 flags);
        int rc = kvmill(&out, &err, args, model, doc);
        ck_assert_msg(rc == 1 && strstr(err, outs[i][1]) && strstr(err, "full: write failed: No space left on device"),
                      "%s: exit %d: %s", flags, rc, err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* `sculpt --doc` of an empty file (with --retain 0, which the retain zone's check let through)
 * wrote a cache of the BOS token alone and exited 0; run, serve and eval refuse an empty
 * document. Now it is refused (exit 2) naming the file, and --out is not written. */
START_TEST(test_sculpt_empty_doc)
{
    char *tmp = kvm_test_tmpdir(), doc[4096], outp[4096], args[16384], *out, *err;
    snprintf(doc, sizeof doc, "%s/empty.txt", tmp);
    snprintf(outp, sizeof outp, "%s/o.cache", tmp);
    ck_assert_int_eq(kvm_test_write_file(doc, "", 0), 0);
    snprintf(args, sizeof args, "sculpt --model '%%s' --doc '%%s' --retain 0 --iterations 1 --rounds 1 --out '%s'",
             outp);
    int rc = kvmill(&out, &err, args, kvm_test_data_path("models/stories260K.bin"), doc);
    ck_assert_msg(rc == 2 && strstr(err, "is empty: it has no tokens besides BOS") && strstr(err, doc), "exit %d: %s",
                  rc, err);
    ck_assert_int_ne(access(outp, F_OK), 0);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* `sculpt --context 1` read BOS alone and said "--doc FILE is empty: it has no tokens besides BOS"
 * of a document that has many: the context is what is too short. Refused now naming --context 1
 * (exit 2); an empty document with a larger --context is still named as empty. */
START_TEST(test_sculpt_context_one)
{
    char *tmp = kvm_test_tmpdir(), outp[4096], args[16384], *out, *err;
    snprintf(outp, sizeof outp, "%s/o.cache", tmp);
    snprintf(args, sizeof args, "sculpt --model '%%s' --doc '%%s' --context 1 --retain 0 --out '%s'", outp);
    int rc = kvmill(&out, &err, args, kvm_test_data_path("models/stories260K.bin"),
                    kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_msg(rc == 2 && strstr(err, "--context 1 is the BOS token alone") && !strstr(err, "is empty"),
                  "exit %d: %s", rc, err);
    ck_assert_int_ne(access(outp, F_OK), 0);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* sculpt refused less than eval: --ratio 0.9999 of --context 64 wrote the full KV (exit 0, a note
 * only) where eval refuses the same ratio; --budget 4e1 and 48.0 were read as 40 and 48 where
 * eval's integer flags refuse them; "-0" with --ratio was "both size the cache" though -0 is 0
 * (use the ratio) to every integer parse; and "2 token(s)". Now sculpt refuses in eval's words
 * (exit 2, --out not written), reads integers as eval does, and counts in words. */
START_TEST(test_sculpt_refuses_as_eval)
{
    char *tmp = kvm_test_tmpdir(), outp[4096], args[16384], *out, *err;
    snprintf(outp, sizeof outp, "%s/o.cache", tmp);
    const char *cases[][2] = {
        {"--context 64 --ratio 0.9999",
         "--method sculpt: --ratio 0.9999 of the compress zone (--context 64 less the retain zone of 32) keeps 32 "
         "distilled entries beside the 32 retained, the whole context"},
        {"--context 64 --method selectfit --ratio 0.999", "--method selectfit: --ratio 0.999 of the compress zone"},
        {"--context 64 --budget 4e1", "--budget 4e1: expected an integer in [0, 1048576]"},
        {"--context 64 --budget 48.0", "--budget 48.0: expected an integer in [0, 1048576]"},
        {"--context 64 --ratio 0.5 --iterations 1e1", "--iterations 1e1: expected an integer"},
        {"--context 2", "the retain zone of 32 tokens is longer than the context of 2 tokens (BOS included)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(args, sizeof args, "sculpt --model '%%s' --doc '%%s' %s --threads 1 --out '%s'", cases[i][0], outp);
        int rc = kvmill(&out, &err, args, kvm_test_data_path("models/stories260K.bin"),
                        kvm_test_data_path("corpus/doc_000.txt"));
        ck_assert_msg(rc == 2 && strstr(err, cases[i][1]), "%s: exit %d: %s", cases[i][0], rc, err);
        ck_assert_int_ne(access(outp, F_OK), 0);
        free(out);
        free(err);
    }
    /* -0 is 0: "use the ratio", beside --ratio as 0 is */
    snprintf(args, sizeof args,
             "sculpt --model '%%s' --doc '%%s' --context 64 --budget -0 --ratio 0.5 --iterations 1 --rounds 1 "
             "--threads 1 --out '%s'",
             outp);
    int rc = kvmill(&out, &err, args, kvm_test_data_path("models/stories260K.bin"),
                    kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_msg(rc == 0 && access(outp, F_OK) == 0, "--budget -0: exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* The output flags (make-model and sculpt --out, eval --csv) renamed OUT.part over whatever OUT
 * was: --out STORE/data.mdb exited 0 and the store could no longer be opened, and a read-only
 * file (a corpus document) was replaced without a word. Now an existing OUT that is an LMDB file
 * (LMDB's magic; a store's data.mdb or lock.mdb beside the other, before LMDB has written it), or
 * is read-only, is refused (exit 2, naming the flag and why) and left as it was; a command's own
 * earlier output is replaced as before. */
START_TEST(test_out_refuses_store_and_readonly)
{
    char *tmp = kvm_test_tmpdir(), store[4300], path[4400], args[16384], *out = NULL, *err = NULL;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    const char *mm = "make-model --dim 64 --layers 1 --heads 4 --hidden 64 --vocab 512 --seq-len 64 --out '%s'%s";
    snprintf(store, sizeof store, "%s/store", tmp);
    kvm_test_store_create(store);
    struct stat before, after;
    static const char *const targets[] = {"store/data.mdb", "store/lock.mdb", "copy.mdb", "fresh/data.mdb"};
    char fresh[4400];
    snprintf(fresh, sizeof fresh, "%s/fresh", tmp); /* data.mdb (empty: no magic yet) beside lock.mdb */
    ck_assert_int_eq(mkdir(fresh, 0700), 0);
    snprintf(path, sizeof path, "%s/fresh/data.mdb", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, "", 0), 0);
    snprintf(path, sizeof path, "%s/fresh/lock.mdb", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, "", 0), 0);
    size_t n = 0;
    snprintf(path, sizeof path, "%s/data.mdb", store);
    char *data = kvm_test_read_file(path, &n); /* a copy of a store's file, elsewhere: its magic */
    snprintf(path, sizeof path, "%s/copy.mdb", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, data, n), 0);
    free(data);
    for (size_t i = 0; i < sizeof targets / sizeof targets[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", tmp, targets[i]);
        ck_assert_int_eq(stat(path, &before), 0);
        int rc = kvmill(&out, &err, mm, path, "");
        ck_assert_msg(rc == 2 && strstr(err, "--out ") && strstr(err, "is an LMDB file") && !strstr(err, "wrote"),
                      "%s: exit %d: %s", cmd, rc, err);
        free(out);
        free(err);
        ck_assert_int_eq(stat(path, &after), 0);
        ck_assert_msg(after.st_ino == before.st_ino && after.st_size == before.st_size, "%s: %s was replaced", cmd,
                      path);
    }
    snprintf(path, sizeof path, "%s/data.mdb", store);
    snprintf(args, sizeof args,
             "sculpt --model '%%s' --doc '%%s' --context 48 --queries 16 --iterations 1 --rounds 1 "
             "--out '%s'",
             path);
    int rc = kvmill(&out, &err, args, model, kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_msg(rc == 2 && strstr(err, "kvmill sculpt: --out ") && strstr(err, "is an LMDB file"), "%s: exit %d: %s",
                  cmd, rc, err);
    free(out);
    free(err);
    snprintf(args, sizeof args,
             "eval --model '%%s' --docs '%%s' --context 48 --continuation 8 --method streaming "
             "--budget 16 --csv '%s'",
             path);
    rc = kvmill(&out, &err, args, model, kvm_test_data_path("corpus/doc_000.txt"));
    ck_assert_msg(rc == 2 && strstr(err, "kvmill eval: --csv ") && strstr(err, "is an LMDB file"), "%s: exit %d: %s",
                  cmd, rc, err);
    free(out);
    free(err);
    ck_assert_int_eq(kvm_test_store_caches(store), 0); /* the store still opens */
    /* a read-only file (as root too: no write permission bit) */
    snprintf(path, sizeof path, "%s/doc.txt", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, "Once upon a time.", 17), 0);
    ck_assert_int_eq(chmod(path, 0444), 0);
    rc = kvmill(&out, &err, mm, path, "");
    ck_assert_msg(rc == 2 && strstr(err, "--out ") && strstr(err, "exists and is read-only"), "%s: exit %d: %s", cmd,
                  rc, err);
    free(out);
    free(err);
    ck_assert_msg(stat(path, &after) == 0 && after.st_size == 17, "%s: the read-only file was replaced", cmd);
    snprintf(args, sizeof args,
             "eval --model '%%s' --docs '%%s' --context 48 --continuation 8 --method streaming "
             "--budget 16 --csv '%s'",
             path);
    rc = kvmill(&out, &err, args, model, kvm_test_data_path("corpus/doc_001.txt"));
    ck_assert_msg(rc == 2 && strstr(err, "--csv ") && strstr(err, "exists and is read-only"), "%s: exit %d: %s", cmd,
                  rc, err);
    free(out);
    free(err);
    /* one's own output, written again: replaced as before */
    snprintf(path, sizeof path, "%s/m.bin", tmp);
    for (int i = 0; i < 2; i++) {
        rc = kvmill(&out, &err, mm, path, "");
        ck_assert_msg(rc == 0 && strstr(err, "wrote"), "%s (time %d): exit %d: %s", cmd, i + 1, rc, err);
        free(out);
        free(err);
    }
    snprintf(path, sizeof path, "%s/e.csv", tmp);
    snprintf(args, sizeof args,
             "eval --model '%%s' --docs '%%s' --context 48 --continuation 8 --method streaming "
             "--budget 16 --csv '%s'",
             path);
    for (int i = 0; i < 2; i++) {
        rc = kvmill(&out, &err, args, model, kvm_test_data_path("corpus/doc_000.txt"));
        ck_assert_msg(rc == 0, "%s (time %d): exit %d: %s", cmd, i + 1, rc, err);
        free(out);
        free(err);
    }
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

/* kvmill ask waited 30 s by default while [serve] request_timeout_s defaults to 60: a request
 * whose cache the server computed on demand (about 50 s for SmolLM2 at 2,048 tokens) ended in
 * ask's "no answer" while the server was still working, and the server's own answer (the cache,
 * or its error saying why) was lost. Now ask's default waits longer than the server's. */
START_TEST(test_ask_timeout_above_request_timeout)
{
    char *out, *err;
    ck_assert_int_eq(kvmill(&out, &err, "ask --help", NULL, NULL), 0);
    const char *h = strstr(out, "--timeout");
    ck_assert_msg(h && strstr(h, "(default "), "ask --help: %s", out);
    const double ask_default = KVM_ASK_TIMEOUT_S; /* the code's default, which --help shows */
    ck_assert_int_eq((int)atof(strstr(h, "(default ") + strlen("(default ")), KVM_ASK_TIMEOUT_S);
    double serve_default = -1;
    for (const kvm_cfg_setting *c = kvm_cfg_settings; c->section; c++)
        if (!strcmp(c->section, "serve") && !strcmp(c->key, "request_timeout_s")) serve_default = atof(c->def);
    ck_assert_msg(serve_default > 0 && ask_default > serve_default,
                  "ask's default --timeout %g s is not above [serve] request_timeout_s's default %g s", ask_default,
                  serve_default);
    free(out);
    free(err);
}
END_TEST

/* A process that writes --FLAG PATH through PATH.part, then gets sig: its exit status, its
 * stderr into err (malloc'ed). rows: what it writes first. */
static int staged_then_signal(const char *dir, const char *flag, const char *path, const char *rows, int sig,
                              char **err)
{
    char errf[4400];
    snprintf(errf, sizeof errf, "%s/err.txt", dir);
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int fd = open(errf, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || dup2(fd, 2) < 0) _exit(3);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        kvm_cli_staged s;
        if (kvm_cli_staged_open("make-model", flag, path, &s)) _exit(4);
        fputs(rows, s.f); /* not flushed here: a --csv is written row by row */
        raise(sig);
        _exit(5); /* not reached: the signal ends the process */
    }
    int st = 0;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    *err = kvm_test_read_file(errf, NULL);
    return st;
}

/* make-model, sculpt, calibrate and eval stopped by Ctrl-C or SIGTERM died by the signal's
 * default action: no word, and PATH.part left behind. Now PATH.part goes (an --out) or keeps
 * the rows written (--csv, as after a failure), a line says so, and the process still ends by
 * the signal (130 or 143 in a shell). */
START_TEST(test_staged_output_interrupted)
{
    char *dir = kvm_test_tmpdir(), path[4300], part[4400], *err = NULL;
    snprintf(path, sizeof path, "%s/model.bin", dir);
    snprintf(part, sizeof part, "%s.part", path);
    int st = staged_then_signal(dir, "out", path, "weights", SIGINT, &err);
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGINT, "status %d", st);
    struct stat sb;
    ck_assert_int_ne(stat(part, &sb), 0);
    ck_assert_int_ne(stat(path, &sb), 0);
    ck_assert_msg(err && strstr(err, "kvmill make-model: interrupted: --out ") && strstr(err, "was not written"),
                  "stderr: %s", err ? err : "");
    free(err);
    snprintf(path, sizeof path, "%s/rows.csv", dir);
    snprintf(part, sizeof part, "%s.part", path);
    st = staged_then_signal(dir, "csv", path, "doc,kl\nd0,0.1\n", SIGTERM, &err);
    ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM, "status %d", st);
    ck_assert_int_eq(stat(part, &sb), 0); /* the rows written, kept */
    ck_assert_int_gt(sb.st_size, 0);
    ck_assert_msg(err && strstr(err, "the rows written (if any) are in "), "stderr: %s", err ? err : "");
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* --seed 0 left the sampler's xorshift state 0: every draw was 0, so top-p took the likeliest
 * token and --topp 1 always id 0 ("Once<unk><unk>..."), exit 0. Refused now, exit 2, naming the
 * flag; --seed 1 still samples. */
/* An option before the command (`kvmill --config F run`, as git's global options go) was only
 * "unknown command '--config'": the message now names the command found later and the order. */
START_TEST(test_option_before_command)
{
    char *out, *err;
    ck_assert_int_eq(kvmill(&out, &err, "--config %s run --corpus %s", "configs/default.ini", "data/corpus"), 2);
    ck_assert_msg(strstr(err, "unknown command '--config'"), "stderr: %s", err);
    ck_assert_msg(strstr(err, "the command comes first, then its options (kvmill run --config ...)"), "stderr: %s",
                  err);
    ck_assert_msg(strstr(err, "usage: kvmill COMMAND"), "stderr: %s", err);
    free(out);
    free(err);
    /* a word that is no option gets no such hint, nor does an option with no command after it */
    ck_assert_int_eq(kvmill(&out, &err, "frobnicate run%s%s", "", ""), 2);
    ck_assert_msg(strstr(err, "unknown command 'frobnicate'\n"), "stderr: %s", err);
    free(out);
    free(err);
    ck_assert_int_eq(kvmill(&out, &err, "--version%s%s", "", ""), 2);
    ck_assert_msg(strstr(err, "unknown command '--version'\n"), "stderr: %s", err);
    free(out);
    free(err);
}
END_TEST

/* A --config that is missing was "kvmill run: nosuch.ini: No such file or directory" for run, serve
 * and calibrate (the store commands and the stages named the flag): the message names --config. */
START_TEST(test_config_missing_names_flag)
{
    const char *cmds[] = {"run --corpus data/corpus", "serve", "calibrate --docs data/corpus"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char *out, *err, want[128];
        ck_assert_int_eq(kvmill(&out, &err, "%s --config %s", cmds[i], "/nonexistent/kvmill.ini"), 2);
        snprintf(want, sizeof want, "kvmill %.*s: --config: /nonexistent/kvmill.ini: No such file",
                 (int)strcspn(cmds[i], " "), cmds[i]);
        ck_assert_msg(strstr(err, want), "%s: stderr: %s", cmds[i], err);
        free(out);
        free(err);
    }
}
END_TEST

START_TEST(test_generate_seed_zero)
{
    char *out = NULL, *err = NULL;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    int rc = kvmill(&out, &err, "generate --model '%s' --prompt Once -n 12 --topp 1 --seed 0%s", model, "");
    ck_assert_msg(rc == 2 && strstr(err, "--seed 0") && strstr(err, "seeds start at 1") && !strstr(out, "<unk>"),
                  "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
    rc = kvmill(&out, &err, "generate --model '%s' --prompt Once -n 12 --topp 1 --seed 1%s", model, "");
    ck_assert_msg(rc == 0 && !strstr(out, "<unk>"), "exit %d: %s%s", rc, out, err);
    free(out);
    free(err);
}
END_TEST

/* keygen --out with a prefix past PATH_MAX ("d/" x 2100 + "k") made 2,047 nested folders, then
 * exit 1 with 1,039 bytes of path and no reason; a file as a folder of the prefix said
 * "k.public: Not a directory", exit 1. Both are refused up front now, exit 2, with the reason
 * and a shortened path, and nothing is made. A prefix in new folders still works. */
START_TEST(test_keygen_out_checked)
{
    char *tmp = kvm_test_tmpdir(), *out = NULL, *err = NULL, file[4200], d[4200];
    size_t len = strlen(tmp) + 1 + 2 * 2100 + 2;
    char *longp = malloc(len), *args = malloc(len + 64);
    int at = snprintf(longp, len, "%s/", tmp);
    for (int i = 0; i < 2100; i++)
        at += snprintf(longp + at, len - at, "d/");
    snprintf(longp + at, len - at, "k");
    snprintf(args, len + 64, "keygen --out '%s'%%s%%s", longp);
    int rc = kvmill(&out, &err, args, "", "");
    ck_assert_msg(rc == 2 && strstr(err, "longer than PATH_MAX") && strstr(err, "...") && strlen(err) < 400,
                  "exit %d: %.400s", rc, err);
    snprintf(d, sizeof d, "%s/d", tmp);
    ck_assert_msg(access(d, F_OK) != 0, "%s was made", d);
    free(out);
    free(err);
    snprintf(file, sizeof file, "%s/f.txt", tmp);
    ck_assert_int_eq(kvm_test_write_file(file, "x", 1), 0);
    rc = kvmill(&out, &err, "keygen --out '%s/new/k'%s", file, "");
    ck_assert_msg(rc == 2 && strstr(err, "f.txt is not a folder"), "exit %d: %s", rc, err);
    free(out);
    free(err);
    /* a name that fits with ".public" but not with the writer's temporary ".public.XXXXXX": it
     * passed the check, failed late (exit 1), and the cleanup then removed the folders "after"
     * the first one made, `existing/` among them (it came after new/..) */
    char name[300], existing[4300];
    memset(name, 'k', 245);
    name[245] = '\0';
    snprintf(existing, sizeof existing, "%s/existing", tmp);
    ck_assert_int_eq(mkdir(existing, 0700), 0);
    rc = kvmill(&out, &err, "keygen --out '%s/new/../existing/%s'", tmp, name);
    ck_assert_msg(rc == 2 && strstr(err, "longer than NAME_MAX"), "exit %d: %s", rc, err);
    ck_assert_msg(access(existing, F_OK) == 0, "the folder that was there before was removed");
    snprintf(d, sizeof d, "%s/new", tmp);
    ck_assert_msg(access(d, F_OK) != 0, "%s was made", d);
    free(out);
    free(err);
    rc = kvmill(&out, &err, "keygen --out '%s/a/b/k'%s", tmp, "");
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    snprintf(d, sizeof d, "%s/a/b/k.secret", tmp);
    ck_assert_int_eq(access(d, F_OK), 0);
    free(out);
    free(err);
    free(longp);
    free(args);
    kvm_test_rmtree(tmp);
    free(tmp);
}
END_TEST

static Suite *cli_suite(void)
{
    Suite *s = suite_create("cli");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"generate_golden", test_generate_golden},
                 {"generate_tokens_and_no_tokenizer", test_generate_tokens_and_no_tokenizer},
                 {"help_and_usage_errors", test_help_and_usage_errors},
                 {"option_before_command", test_option_before_command},
                 {"config_missing_names_flag", test_config_missing_names_flag},
                 {"generate_seed_zero", test_generate_seed_zero},
                 {"keygen_out_checked", test_keygen_out_checked},
                 {"info_and_make_model", test_info_and_make_model},
                 {"list_flags_refuse_empty_items", test_list_flags_refuse_empty_items},
                 {"generate_tokens_file_errors", test_generate_tokens_file_errors},
                 {"generate_tokens_read_error", test_generate_tokens_read_error},
                 {"out_is_an_input", test_out_is_an_input},
                 {"short_doc_keeps_csv", test_short_doc_keeps_csv},
                 {"eval_csv_names_distinct", test_eval_csv_names_distinct},
                 {"size_in_method_options", test_size_in_method_options},
                 {"sculpt_option_twice", test_sculpt_option_twice},
                 {"method_option_as_written", test_method_option_as_written},
                 {"list_duplicates", test_list_duplicates},
                 {"value_is_an_option", test_value_is_an_option},
                 {"short_option_as_value_and_given_twice", test_short_option_as_value_and_given_twice},
                 {"polykv_wrong_model", test_polykv_wrong_model},
                 {"polykv_other_model_same_layers", test_polykv_other_model_same_layers},
                 {"target_step_past_context", test_target_step_past_context_cli},
                 {"sculpt_kept_whole_said", test_sculpt_kept_whole_said},
                 {"sculpt_out_is_stdout", test_sculpt_out_is_stdout},
                 {"fifo_without_writer", test_fifo_without_writer},
                 {"eval_no_compression", test_eval_no_compression},
                 {"calibrate_config_own_options", test_calibrate_config_own_options},
                 {"dump_config_refuses_what_run_refuses", test_dump_config_refuses_what_run_refuses},
                 {"stdout_write_error", test_stdout_write_error},
                 {"docs_from_a_pipe", test_docs_from_a_pipe},
                 {"make_model_out_kinds", test_make_model_out_kinds},
                 {"part_leftovers_refused", test_part_leftovers_refused},
                 {"docs_list_many", test_docs_list_many},
                 {"docs_name_with_comma", test_docs_name_with_comma},
                 {"sculpt_out_kept_on_failure", test_sculpt_out_kept_on_failure},
                 {"calibrate_write_error_says_why", test_calibrate_write_error_says_why},
                 {"sculpt_empty_doc", test_sculpt_empty_doc},
                 {"out_refuses_store_and_readonly", test_out_refuses_store_and_readonly},
                 {"sculpt_context_one", test_sculpt_context_one},
                 {"sculpt_refuses_as_eval", test_sculpt_refuses_as_eval},
                 {"ask_timeout_above_request_timeout", test_ask_timeout_above_request_timeout},
                 {"staged_output_interrupted", test_staged_output_interrupted}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(cli_suite()); }
