/* check_cli_names.c: one name per setting. The KVSculpt settings table drives the [compress]
 * keys, the flags of `kvmill sculpt` and `kvmill eval` and the method option strings; old
 * names keep working with one deprecation warning; eval's sculpt flags apply to every
 * sculpt-family method with method-string options overriding; every --help lists the methods
 * and the model formats; `kvmill ask --prompt-file`. */
#include "common/kvm_error.h"
#include "compress/kvm_compress.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "kernels/kvm_sculpt_kernels.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_worker.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char *run(const char *fmt, const char *a, const char *b, int *rc, char **err)
{
    char cmd[8192], *out = NULL;
    snprintf(cmd, sizeof cmd, fmt, kvm_test_bin(), a ? a : "", b ? b : "");
    *rc = kvm_test_run(cmd, &out, err);
    return out;
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; p && (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

static const kvm_cfg_setting *cfg_row(const char *section, const char *key)
{
    for (int i = 0; kvm_cfg_settings[i].section; i++)
        if (!strcmp(kvm_cfg_settings[i].section, section) && !strcmp(kvm_cfg_settings[i].key, key))
            return &kvm_cfg_settings[i];
    return NULL;
}

/* Every current sculpt setting marked in_config is the [compress] key of that name with the
 * same default; the defaults of the table are kvm_sculpt_opts_default(); flags are the name
 * with '-' for '_'. */
START_TEST(test_table_is_the_config)
{
    int n;
    const kvm_sculpt_setting *set = kvm_sculpt_settings(&n);
    kvm_sculpt_opts d = kvm_sculpt_opts_default(), o = d;
    int in_config = 0;
    for (int i = 0; i < n; i++) {
        char flag[64];
        snprintf(flag, sizeof flag, "%s", set[i].name);
        for (char *p = flag; *p; p++)
            if (*p == '_') *p = '-';
        ck_assert_str_eq(set[i].flag, flag);
        if (set[i].replaced_by) {
            ck_assert_msg(!set[i].in_config, "%s: a deprecated name is no config key", set[i].name);
            ck_assert_ptr_nonnull(kvm_sculpt_setting_find(set[i].replaced_by, strlen(set[i].replaced_by)));
            continue;
        }
        ck_assert_msg(kvm_sculpt_opts_set(&o, set[i].name, set[i].def) == 0, "%s = %s: %s", set[i].name, set[i].def,
                      kvm_errmsg());
        const kvm_cfg_setting *c = cfg_row("compress", set[i].name);
        if (set[i].in_config) {
            in_config++;
            ck_assert_msg(c != NULL, "sculpt setting %s is not a [compress] key", set[i].name);
            ck_assert_str_eq(c->def, set[i].def);
        }
    }
    ck_assert_int_ge(in_config, 16);
    ck_assert_msg(memcmp(&o, &d, sizeof o) == 0, "the table's defaults differ from kvm_sculpt_opts_default()");
    /* the old names are no [compress] keys: one name per setting */
    const char *old[] = {"synthetic_queries", "iters", "alpha", "pilot_iters", "entries"};
    for (int i = 0; i < 5; i++) ck_assert_ptr_null(cfg_row("compress", old[i]));
    ck_assert_ptr_nonnull(cfg_row("compress", "queries"));
}
END_TEST

/* [compress] value `v` for key `name` in a config: 0 when it parses. */
static int key_parses(const char *name, const char *v)
{
    char text[256];
    snprintf(text, sizeof text, "[model]\npath = /m.bin\n[compress]\n%s = %s\n", name, v);
    kvm_config *c = NULL;
    int rc = kvm_config_parse(text, "t.ini", &c);
    kvm_config_free(&c);
    return rc;
}

/* The settings that are [compress] keys of their own and flags/options from the sculpt table
 * (ratio, budget, future) had two ranges: the key ratio took 1e-300 that --ratio refused
 * ([1e-9, 1]); budget's key stopped at 2^20, the flag at 2^30; future's flag at 2^30, its key
 * at 2^20. One range each now, the key's bounds accepted and the values past them refused by
 * both; future's 0 (the continuation length) is the flags' alone, documented: a run has none. */
START_TEST(test_shared_key_ranges)
{
    const char *names[] = {"ratio", "budget", "future", "retain", "queries"};
    for (int i = 0; i < 5; i++) {
        const kvm_cfg_setting *c = cfg_row("compress", names[i]);
        ck_assert_ptr_nonnull(c);
        const int real = c->type == KVM_CFG_FLOAT;
        const double in[2] = {c->lo, c->hi}, out[2] = {real ? c->lo / 2 : c->lo - 1, real ? c->hi * 1.5 : c->hi + 1};
        for (int b = 0; b < 2; b++) {
            kvm_sculpt_opts o = kvm_sculpt_opts_default();
            o.retain_tokens = 0; /* budget: any value above the retain zone */
            char v[64], w[64];
            snprintf(v, sizeof v, "%.17g", in[b]);
            snprintf(w, sizeof w, "%.17g", out[b]);
            ck_assert_msg(key_parses(names[i], v) == 0, "[compress] %s = %s: %s", names[i], v, kvm_errmsg());
            ck_assert_msg(kvm_sculpt_opts_set(&o, names[i], v) == 0, "--%s %s: %s", names[i], v, kvm_errmsg());
            ck_assert_msg(key_parses(names[i], w) != 0, "[compress] %s = %s accepted", names[i], w);
            if (!strcmp(names[i], "future") && b == 0) continue; /* --future 0: the continuation length */
            ck_assert_msg(kvm_sculpt_opts_set(&o, names[i], w) != 0, "--%s %s accepted, [compress] %s refuses it",
                          names[i], w, names[i]);
        }
    }
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "ratio", "1e-300"), KVM_EINVAL);
    ck_assert_int_ne(key_parses("ratio", "1e-300"), 0);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "[compress] ratio: 1e-300 is outside [1e-09, 1]"));
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "future", "0"), 0);
    ck_assert_int_ne(key_parses("future", "0"), 0);
}
END_TEST

/* A config setting every key and the same names as a method option string give the same
 * options, field by field. */
START_TEST(test_config_keys_equal_option_names)
{
    const char *text = "[model]\npath = /m.bin\n[compress]\nmethod = sculpt\nretain = 16\nqueries = 64\nlambda = 0.5\n"
                       "lse_weight = true\nridge = 0.01\nvcap = 2\nkcap = 3\nrounds = 2\niterations = 7\nhistory = 5\n"
                       "bias = yes\nalloc = head\npower = 0.25\npilot_rounds = 3\npilot_iterations = 4\nseed = 9\n"
                       "budget = 48\nfuture = 12\ntolerance = 0.01\nround_tolerance = 0.02\ncarry_history = 1\nridge_f32 = 0\n"
                       "gradient_tolerance = 0.001\n"
                       "[stages]\nthreads = 3\n";
    kvm_config *c;
    ck_assert_msg(kvm_config_parse(text, "t.ini", &c) == 0, "%s", kvm_errmsg());
    kvm_sculpt_opts a, b = kvm_sculpt_opts_default();
    ck_assert_msg(kvm_worker_sculpt_opts(c, KVM_SCULPT_FULL, &a) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_sculpt_opts_parse(&b, "budget=48,retain=16,queries=64,lambda=0.5,lse_weight,ridge=0.01,vcap=2,"
                                               "kcap=3,rounds=2,iterations=7,history=5,bias,alloc=head,power=0.25,"
                                               "pilot_rounds=3,pilot_iterations=4,seed=9,future=12,threads=3,"
                                               "tolerance=0.01,round_tolerance=0.02,carry_history=1,ridge_f32=0,"
                                               "gradient_tolerance=0.001"),
                     0);
    ck_assert_int_eq(a.k_entries, 32);
    ck_assert_int_eq(a.lbfgs_iters, 7);
    ck_assert_int_eq(a.pilot_iters, 4);
    ck_assert_int_eq(a.n_synth, 64);
    ck_assert_int_eq(a.lse_mass_weight, 1);
    ck_assert_int_eq(a.threads, 3);
    ck_assert(a.lbfgs_tolerance == 0.01 && a.round_tolerance == 0.02 && a.carry_history == 1 && a.ridge_f32 == 0 &&
              a.lbfgs_gtol == 0.001);
    ck_assert_msg(memcmp(&a, &b, sizeof a) == 0, "config and option string give different options");
    kvm_config_free(&c);
}
END_TEST

/* The config id of "[model] path = x" with `compress_lines` in [compress], into *id; returns
 * the canonical text the id hashes (caller frees). */
static char *config_id_of(const char *compress_lines, kvm_store_id *id)
{
    char text[512];
    snprintf(text, sizeof text, "[model]\npath = x\n[compress]\n%s\n", compress_lines);
    kvm_config *c = NULL;
    ck_assert_msg(kvm_config_parse(text, "t.ini", &c) == 0, "%s", kvm_errmsg());
    char *canon;
    size_t len;
    ck_assert_int_eq(kvm_jobcfg_config_id(c, NULL, id, &canon, &len), 0);
    char *z = strndup(canon, len);
    ck_assert_ptr_nonnull(z);
    free(canon);
    kvm_config_free(&c);
    return z;
}

/* The solver's convergence settings and ridge_f32 at their off values (the solve before them)
 * write no line into the canonical config text, so such configs keep the ids they had before the
 * settings existed; each one on (carry_history, ridge_f32 and round_tolerance by default) gives
 * another id. */
START_TEST(test_convergence_settings_config_id)
{
    const char *extra[] = {"carry_history = 0\nround_tolerance = 0\nridge_f32 = 0",
                           "carry_history = 0\ntolerance = 0\nround_tolerance = 0\nridge_f32 = 0",
                           "carry_history = 0\ntolerance = 0.01\nridge_f32 = 0",
                           "carry_history = 0\nround_tolerance = 0.01\nridge_f32 = 0", "carry_history = 0",
                           "carry_history = 0\nridge_f32 = 0\ngradient_tolerance = 0.001",
                           "carry_history = 0\nridge_f32 = 0"}; /* round_tolerance at its default 0.2 */
    kvm_store_id id[7];
    for (int i = 0; i < 7; i++) {
        char *z = config_id_of(extra[i], &id[i]); /* the canonical text: no line of a setting that is off */
        if (i < 2) ck_assert_ptr_null(strstr(z, "tolerance"));
        if (i < 2) ck_assert_ptr_null(strstr(z, "carry_history"));
        if (i < 2) ck_assert_ptr_null(strstr(z, "ridge_f32"));
        if (i < 2) ck_assert_ptr_null(strstr(z, "gradient_tolerance"));
        free(z);
    }
    ck_assert_int_eq(memcmp(&id[0], &id[1], sizeof id[0]), 0);
    for (int i = 2; i < 7; i++) ck_assert_int_ne(memcmp(&id[0], &id[i], sizeof id[0]), 0);
}
END_TEST

/* am_start = false writes no line into the canonical config text (ids from before the setting
 * stay), true does and changes the id; the sculpt options' canonical text (strategy files)
 * likewise records it only when set. */
START_TEST(test_am_start_config_id)
{
    kvm_store_id id[3];
    const char *extra[] = {"alloc = uniform", "am_start = false", "am_start = true"};
    for (int i = 0; i < 3; i++) {
        char *z = config_id_of(extra[i], &id[i]);
        if (i < 2) ck_assert_msg(!strstr(z, "am_start"), "%s", z);
        else ck_assert_msg(strstr(z, "compress.am_start=true"), "%s", z);
        free(z);
    }
    ck_assert_int_eq(memcmp(&id[0], &id[1], sizeof id[0]), 0);
    ck_assert_int_ne(memcmp(&id[0], &id[2], sizeof id[0]), 0);
    kvm_sculpt_opts o = kvm_sculpt_opts_default(), back;
    char text[KVM_SCULPT_OPTS_CANONICAL_MAX];
    ck_assert_int_eq(kvm_sculpt_opts_canonical(&o, text, sizeof text), 0);
    ck_assert_ptr_null(strstr(text, "am_start"));
    o.am_start = 1;
    ck_assert_int_eq(kvm_sculpt_opts_canonical(&o, text, sizeof text), 0);
    ck_assert_ptr_nonnull(strstr(text, "am_start=true"));
    ck_assert_int_eq(kvm_sculpt_opts_from_canonical(text, strlen(text), &back), 0);
    ck_assert_int_eq(back.am_start, 1);
}
END_TEST

/* Uniform budgets run no pilot: the pilot's settings (pilot_rounds, pilot_iterations, power)
 * write no line into the canonical text and leave the id alone; with alloc = head each changes
 * the id (the pilot's MSEs set the budgets). */
START_TEST(test_pilot_settings_config_id)
{
    const char *extra[] = {"alloc = uniform", "alloc = uniform\npilot_rounds = 2\npilot_iterations = 3\npower = 1",
                           "alloc = head", "alloc = head\npilot_rounds = 2", "alloc = head\npilot_iterations = 3",
                           "alloc = head\npower = 1"};
    kvm_store_id id[6];
    for (int i = 0; i < 6; i++) {
        char *z = config_id_of(extra[i], &id[i]);
        if (i < 2) ck_assert_msg(!strstr(z, "pilot_") && !strstr(z, "power="), "%s", z);
        else ck_assert_msg(strstr(z, "compress.pilot_rounds=") && strstr(z, "compress.power="), "%s", z);
        free(z);
    }
    ck_assert_int_eq(memcmp(&id[0], &id[1], sizeof id[0]), 0);
    for (int i = 3; i < 6; i++) ck_assert_int_ne(memcmp(&id[2], &id[i], sizeof id[0]), 0);
}
END_TEST

/* Old option-string names set the same fields as the new ones; '-' and '_' are one name; the
 * size is the last of budget/ratio/entries, resolved against the final retain zone. */
START_TEST(test_old_option_names)
{
    kvm_sculpt_opts a = kvm_sculpt_opts_default(), b = a;
    ck_assert_int_eq(kvm_sculpt_opts_parse(&a, "iters=7,alpha=0.01,pilot-iters=3,synthetic_queries=64,pilot-rounds=2,"
                                               "lse-weight=1,entries=20"),
                     0);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&b, "iterations=7,ridge=0.01,pilot_iterations=3,queries=64,pilot_rounds=2,"
                                               "lse_weight=true,budget=52"),
                     0);
    ck_assert_int_eq(a.k_entries, 20);
    ck_assert_msg(memcmp(&a, &b, sizeof a) == 0, "old and new names give different options");
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "budget=64,retain=16"), 0);
    ck_assert_int_eq(o.k_entries, 48);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "ratio=0.5"), 0); /* a later ratio replaces the budget */
    ck_assert_int_eq(o.k_entries, 0);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "budget=16"), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "retain zone"), "message: %s", kvm_errmsg());
}
END_TEST

/* The old config key is read as the new one, with one warning naming both. */
START_TEST(test_old_config_key)
{
    char *dir = kvm_test_tmpdir(), path[4200], text[4600];
    snprintf(path, sizeof path, "%s/old.ini", dir);
    snprintf(text, sizeof text, "[model]\npath = %s\n[compress]\nsynthetic_queries = 96\n",
             kvm_test_data_path("models/stories260K.bin"));
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    int rc;
    char *err, *out = run("'%s/kvmill' run --config '%s' --dump-config%s", path, NULL, &rc, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    ck_assert_msg(strstr(out, "\nqueries = 96\n") && !strstr(out, "synthetic_queries"), "dump: %s", out);
    ck_assert_msg(count(err, "synthetic_queries is deprecated: use queries") == 1, "stderr: %s", err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* kvmill sculpt: each old flag works (same cache bytes as the new flag) and warns once. */
START_TEST(test_old_sculpt_flags)
{
    char *dir = kvm_test_tmpdir(), a[4200], b[4200], cmd[8192], *out, *err;
    snprintf(a, sizeof a, "%s/old.kvs", dir);
    snprintf(b, sizeof b, "%s/new.kvs", dir);
    const char *base = "'%s/kvmill' sculpt --model '%s' --doc '%s' --context 64 --retain 8 --queries 32 --rounds 1 %s "
                       "--out '%s'";
    char model[4200], doc[4200];
    snprintf(model, sizeof model, "%s", kvm_test_data_path("models/stories260K.bin"));
    snprintf(doc, sizeof doc, "%s", kvm_test_data_path("corpus/doc_001.txt"));
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), model, doc,
             "--iters 2 --alpha 0.01 --entries 12 --pilot-iters 2 --alloc head", a);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    const char *olds[][2] = {{"iters", "iterations"}, {"alpha", "ridge"}, {"entries", "budget"}, {"pilot-iters", "pilot-iterations"}};
    for (int i = 0; i < 4; i++) {
        char w[128];
        snprintf(w, sizeof w, "kvmill sculpt: --%s is deprecated: use --%s\n", olds[i][0], olds[i][1]);
        ck_assert_msg(count(err, w) == 1, "'%s' not exactly once in: %s", w, err);
    }
    ck_assert_int_eq(count(err, "deprecated"), 4);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, base, kvm_test_bin(), model, doc,
             "--iterations 2 --ridge 0.01 --budget 20 --pilot-iterations 2 --alloc head", b);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    ck_assert_msg(!strstr(err, "deprecated"), "stderr: %s", err);
    free(out);
    free(err);
    size_t na, nb;
    char *ca = kvm_test_read_file(a, &na), *cb = kvm_test_read_file(b, &nb);
    ck_assert_ptr_nonnull(ca);
    ck_assert_ptr_nonnull(cb);
    ck_assert_msg(na == nb && memcmp(ca, cb, na) == 0, "old and new flags gave different caches (%zu vs %zu bytes)", na, nb);
    free(ca);
    free(cb);
    /* an old name inside an eval method string: one warning too; a value that would split the
     * option string is refused */
    snprintf(cmd, sizeof cmd, "'%s/kvmill' eval --model '%s' --docs '%s' --context 64 --continuation 8 --budget 40 "
             "--method sculpt:iters=1:queries=16:rounds=1", kvm_test_bin(), model, doc);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    ck_assert_msg(count(err, "option 'iters' is deprecated: use 'iterations'") == 1, "stderr: %s", err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' eval --model '%s' --docs '%s' --budget 40 --method sculpt --retain 8,bias",
             kvm_test_bin(), model, doc);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--retain: '8,bias'"), "stderr: %s", err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* kvmill calibrate: --layer-alloc is PolyKV's allocation; the old --alloc still means it, with
 * one warning. */
START_TEST(test_calibrate_layer_alloc)
{
    int rc;
    char *err, *out = run("'%s/kvmill' calibrate --model m --docs d --budget 8 --out o --alloc bogus%s%s", NULL, NULL,
                          &rc, &err);
    ck_assert_int_eq(rc, 2);
    ck_assert_msg(count(err, "--alloc is deprecated: use --layer-alloc") == 1, "stderr: %s", err);
    ck_assert_msg(strstr(err, "--layer-alloc: ") && strstr(err, "bogus"), "stderr: %s", err);
    free(out);
    free(err);
    out = run("'%s/kvmill' calibrate --model m --docs d --budget 8 --out o --layer-alloc bogus%s%s", NULL, NULL, &rc, &err);
    ck_assert_int_eq(rc, 2);
    ck_assert_msg(!strstr(err, "deprecated") && strstr(err, "--layer-alloc: "), "stderr: %s", err);
    free(out);
    free(err);
}
END_TEST

/* The CSV rows of one eval run without the timings (seconds and decode_ms), one malloc'ed string per row. */
static int eval_rows(const char *args, char rows[8][512])
{
    char *dir = kvm_test_tmpdir(), csv[4200], cmd[12000], *out, *err;
    snprintf(csv, sizeof csv, "%s/r.csv", dir);
    char model[4200];
    snprintf(model, sizeof model, "%s", kvm_test_data_path("models/stories260K.bin"));
    snprintf(cmd, sizeof cmd,
             "'%s/kvmill' eval --model '%s' --docs '%s' --context 64 --continuation 8 --budget 24 --csv '%s' %s",
             kvm_test_bin(), model, kvm_test_data_path("corpus/doc_002.txt"), csv, args);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "%s: exit %d: %s", args, rc, err);
    ck_assert_msg(!strstr(err, "deprecated"), "stderr: %s", err);
    char *text = kvm_test_read_file(csv, NULL);
    ck_assert_ptr_nonnull(text);
    int n = 0;
    for (char *save = NULL, *l = strtok_r(strchr(text, '\n'), "\n", &save); l && n < 8; l = strtok_r(NULL, "\n", &save)) {
        char *last = l, *second = strchr(strchr(l, ',') + 1, ','); /* drop doc,method and seconds on (timings) */
        for (int c = 0; c < 10 && last; c++)
            last = strchr(last + 1, ',');
        ck_assert_ptr_nonnull(last);
        *last = '\0';
        snprintf(rows[n++], 512, "%s", second + 1);
    }
    free(text);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
    return n;
}

/* kvmill eval: sculpt flags apply to every sculpt-family method of the list (not to eviction
 * patterns), and a method string's own options override them. */
START_TEST(test_eval_flags)
{
    char with_flags[8][512], in_strings[8][512];
    int n = eval_rows("--retain 8 --queries 32 --rounds 1 --iterations 2 --method sculpt,selectfit,h2o,sculpt:retain=16,"
                      "am,kvzip",
                      with_flags);
    ck_assert_int_eq(n, 6);
    ck_assert_int_eq(eval_rows("--method sculpt:retain=8:queries=32:rounds=1:iterations=2,"
                               "selectfit:retain=8:queries=32:rounds=1:iterations=2,h2o,"
                               "sculpt:retain=16:queries=32:rounds=1:iterations=2,am:retain=8:queries=32,"
                               "kvzip:retain=8:queries=32",
                               in_strings),
                     6);
    for (int i = 0; i < 6; i++) ck_assert_str_eq(with_flags[i], in_strings[i]);
    /* and the flags did something: retain 8 (flag) and retain 16 (string) differ */
    ck_assert_str_ne(with_flags[0], with_flags[3]);
    char plain[8][512];
    ck_assert_int_eq(eval_rows("--method h2o", plain), 1);
    ck_assert_str_eq(plain[0], with_flags[2]);
    /* the am and kvzip baselines take the sculpt flags too */
    ck_assert_int_eq(eval_rows("--retain 8 --queries 32 --method am,kvzip", with_flags), 2);
    ck_assert_int_eq(eval_rows("--method am:retain=8:queries=32,kvzip:retain=8:queries=32", in_strings), 2);
    for (int i = 0; i < 2; i++) ck_assert_str_eq(with_flags[i], in_strings[i]);
}
END_TEST

/* Every --help with a model names both formats; eval's and run's list every method; sculpt's
 * its three. */
START_TEST(test_help_lists_methods)
{
    const char *cmds[] = {"eval", "sculpt", "calibrate", "generate", "info", "run"};
    int n_methods;
    const kvm_method *m = kvm_method_table(&n_methods);
    for (int i = 0; i < 6; i++) {
        int rc;
        char *err, *out = run("'%s/kvmill' %s --help%s", cmds[i], NULL, &rc, &err);
        ck_assert_msg(rc == 0, "%s --help: exit %d", cmds[i], rc);
        ck_assert_msg(strstr(out, "llama2.c checkpoint or GGUF file"), "%s --help:\n%s", cmds[i], out);
        if (!strcmp(cmds[i], "eval") || !strcmp(cmds[i], "run"))
            for (int k = 0; k < n_methods; k++)
                ck_assert_msg(strstr(out, m[k].name), "%s --help lacks method %s:\n%s", cmds[i], m[k].name, out);
        if (!strcmp(cmds[i], "sculpt") || !strcmp(cmds[i], "eval")) {
            ck_assert_msg(strstr(out, "selectfit") && strstr(out, "joint-fixed"), "%s", out);
            int n;
            const kvm_sculpt_setting *set = kvm_sculpt_settings(&n);
            for (int k = 0; k < n; k++) { /* every current setting is a flag (eval: all but its own four) */
                char f[64];
                snprintf(f, sizeof f, "--%s ", set[k].flag);
                int own = !strcmp(set[k].name, "method") || !strcmp(set[k].name, "ratio") ||
                          !strcmp(set[k].name, "budget") || !strcmp(set[k].name, "threads");
                if (!set[k].replaced_by && !(own && !strcmp(cmds[i], "eval")))
                    ck_assert_msg(strstr(out, f), "%s --help lacks %s", cmds[i], f);
            }
        }
        free(out);
        free(err);
    }
}
END_TEST

/* kvmill ask --prompt-file: the file's text is the prompt (the same answer as --prompt), and
 * bad uses are usage errors naming the file. */
START_TEST(test_ask_prompt_file)
{
    char *dir = kvm_test_tmpdir(), cfg[4200], text[8192], front[4300], log[4300], pf[4300], cmd[16000];
    snprintf(cfg, sizeof cfg, "%s/t.ini", dir);
    snprintf(front, sizeof front, "ipc://%s/front", dir);
    snprintf(log, sizeof log, "%s/serve.log", dir);
    snprintf(pf, sizeof pf, "%s/prompt.txt", dir);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = full\n[store]\npath = %s/store\nmap_size_mb = 8\n"
             "[stages]\nbin_dir = %s\n[run]\nrun_dir = %s/run\nheartbeat_ms = 100\n[serve]\ncompute_missing = true\n",
             kvm_test_data_path("models/stories260K.bin"), dir, kvm_test_bin(), dir);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    ck_assert_int_eq(kvm_test_write_file(pf, "Then the little", 15), 0);
    char *out, *err, doc[4200];
    snprintf(doc, sizeof doc, "%s", kvm_test_data_path("corpus/doc_003.txt"));
    /* usage errors first (no server needed) */
    snprintf(cmd, sizeof cmd, "'%s/kvmill' ask --connect '%s' --doc '%s' --prompt-file '%s/missing.txt'", kvm_test_bin(),
             front, doc, dir);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--prompt-file") && strstr(err, "missing.txt"), "stderr: %s", err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' ask --connect '%s' --doc '%s' --prompt x --prompt-file '%s'", kvm_test_bin(),
             front, doc, pf);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "not both"), "stderr: %s", err);
    free(out);
    free(err);
    /* a FIFO with no writer as --prompt-file or --doc: fopen waited for a writer for ever; both
     * name the FIFO now (--prompt-file said "is empty"), read by one routine; so are a device
     * (--prompt-file read 8 MiB of /dev/zero and said "is longer than 8 MiB") and a directory
     * (a FIFO with a writer, a shell's <(...), is read) */
    char fifo[4300];
    snprintf(fifo, sizeof fifo, "%s/f.fifo", dir);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    const char *fifo_cases[][3] = {
        {"--doc '%s' --prompt-file '%s'", "--prompt-file %s is a FIFO (named pipe) with no process writing to it",
         fifo},
        {"--doc '%s' --prompt x%s", "--doc %s is a FIFO (named pipe) with no process writing to it", fifo},
        {"--doc '%s' --prompt-file '%s'", "--prompt-file %s is a character device, not a prompt file", "/dev/zero"},
        {"--doc '%s' --prompt x%s", "--doc %s is a character device, not a document file", "/dev/zero"},
        {"--doc '%s' --prompt-file '%s'", "--prompt-file %s is a directory", dir}};
    for (int i = 0; i < 5; i++) {
        const int on_doc = strstr(fifo_cases[i][0], "--prompt x") != NULL;
        char args[9000], want[4400];
        snprintf(args, sizeof args, fifo_cases[i][0], on_doc ? fifo_cases[i][2] : doc, on_doc ? "" : fifo_cases[i][2]);
        snprintf(want, sizeof want, fifo_cases[i][1], fifo_cases[i][2]);
        snprintf(cmd, sizeof cmd, "timeout 20 '%s/kvmill' ask --connect '%s' %s", kvm_test_bin(), front, args);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2 && strstr(err, want), "%s: exit %d (124: waited for a writer): %s", args, rc, err);
        free(out);
        free(err);
    }
    snprintf(cmd, sizeof cmd,
             "bash -c \"timeout 20 '%s/kvmill' ask --connect '%s' --doc '%s' --prompt-file <(printf x) "
             "--timeout 0.2\"",
             kvm_test_bin(), front, doc);
    ck_assert_int_ne(kvm_test_run(cmd, &out, &err), 124); /* read; then no server answers (exit 1) */
    ck_assert_msg(!strstr(err, "--prompt-file"), "stderr: %s", err);
    free(out);
    free(err);
    /* a prompt that is not UTF-8 was refused ("--prompt is not UTF-8 text"), where kvmill generate
     * takes its bytes: it is sent now (as prompt_bytes; its answer: check_serve's
     * answer_prompt_not_utf8), so here, with no server, the ask waits and gets no answer (exit 1) */
    snprintf(cmd, sizeof cmd,
             "'%s/kvmill' ask --connect '%s' --doc '%s' --timeout 0.2 --prompt \"$(printf 'caf\\351')\"",
             kvm_test_bin(), front, doc);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
    ck_assert_msg(!strstr(err, "UTF-8"), "stderr: %s", err);
    free(out);
    free(err);
    ck_assert_int_eq(kvm_test_write_file(pf, "caf\xe9", 4), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' ask --connect '%s' --doc '%s' --timeout 0.2 --prompt-file '%s'",
             kvm_test_bin(), front, doc, pf);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 1);
    ck_assert_msg(!strstr(err, "UTF-8"), "stderr: %s", err);
    free(out);
    free(err);
    ck_assert_int_eq(kvm_test_write_file(pf, "Then the little", 15), 0);
    const char *sargs[] = {"--config", cfg, "--bind", front, NULL};
    pid_t pid = 0;
    ck_assert_msg(kvm_test_serve_start(sargs, log, 10, &pid) == -1, "kvmill serve did not start");
    char *answers[2];
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "'%s/kvmill' ask --connect '%s' --doc '%s' -n 12 --timeout 20 %s%s%s", kvm_test_bin(),
                 front, doc, i ? "--prompt 'Then the little'" : "--prompt-file '", i ? "" : pf, i ? "" : "'");
        int rc = kvm_test_run(cmd, &answers[i], &err);
        ck_assert_msg(rc == 0, "ask exit %d: %s", rc, err);
        free(err);
    }
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    ck_assert_msg(strlen(answers[0]) > 1, "empty answer");
    ck_assert_str_eq(answers[0], answers[1]);
    free(answers[0]);
    free(answers[1]);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* `device`: one setting for the solver's device, as the flag of sculpt, eval and calibrate,
 * the method option (cuda:N keeps its ':' inside the ':'-joined method syntax) and a stage
 * worker's --device. Where there is no such device every spelling is refused before any
 * work, naming the device; the decode stage refuses cuda:N for configs it cannot serve there. */
START_TEST(test_device_setting)
{
    kvm_sculpt_opts o = kvm_sculpt_opts_default(), d = o;
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "device=cpu"), 0);
    ck_assert_msg(memcmp(&o, &d, sizeof o) == 0, "device=cpu is not the default");
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "device=gpu"), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "--device gpu: not cpu or cuda:N"), "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "device=cuda,x"), KVM_EINVAL); /* "cuda" alone, then 'x' */
    ck_assert_int_eq(kvm_sculpt_opts_set(&o, "device", "cuda:256"), KVM_EINVAL);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "=5"), KVM_ENOTFOUND); /* the list splitter keeps nameless items */
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, ",,retain=16,"), 0);
    ck_assert_int_eq(o.retain_tokens, 16);
    const int have_cuda = kvm_sculpt_backend_cuda(0) != NULL;
    o = d;
    int rc = kvm_sculpt_opts_parse(&o, "retain=16,device=cuda,0,queries=64"); /* sculpt:retain=16:device=cuda:0:... */
    if (have_cuda) {
        ck_assert_int_eq(rc, 0);
        ck_assert_int_eq(o.cuda, 1);
        ck_assert_int_eq(o.cuda_device, 0);
    } else {
        ck_assert_msg(rc == KVM_EDEVICE, "rc %d: %s", rc, kvm_errmsg());
        ck_assert_msg(strstr(kvm_errmsg(), "--device cuda:0") && count(kvm_errmsg(), "cuda:0") == 1, "%s", kvm_errmsg());
    }
    if (kvm_sculpt_backend_cuda(7)) return; /* the commands below name a device this host lacks */
    /* the flags: refused at once (model and documents are never opened: they do not exist) */
    const char *cmds[] = {
        "'%s/kvmill' eval --model m.bin --docs nodocs --method sculpt,h2o --budget 40 --device cuda:7%s%s",
        "'%s/kvmill' sculpt --model m.bin --doc nodoc --out o.kvs --device cuda:7%s%s",
        "'%s/kvmill' calibrate --model m.bin --docs nodocs --budget 8 --out o --sculpt --device cuda:7%s%s",
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char *err, *out = run(cmds[i], NULL, NULL, &rc, &err);
        ck_assert_msg(rc == 2, "%s: exit %d: %s", cmds[i], rc, err);
        if (i == 0) /* eval checks the device itself: its message names the option and value once */
            ck_assert_msg(strstr(err, "kvmill eval: --device cuda:7") && count(err, "cuda:7") == 1 && !strstr(err, "sculpt"),
                          "%s: stderr: %s", cmds[i], err);
        else
            ck_assert_msg(strstr(err, "--device cuda:7") && count(err, "cuda:7") == 1, "%s: stderr: %s", cmds[i], err);
        ck_assert_msg(!strstr(err, "nodoc") && !strstr(err, "m.bin"), "%s: got past the device: %s", cmds[i], err);
        free(out);
        free(err);
    }
    /* an eviction-only eval has no solver: the refusal says nothing of sculpt */
    {
        char *err, *out = run("'%s/kvmill' eval --model m.bin --docs nodocs --method h2o --budget 40 --device cuda:7%s%s",
                              NULL, NULL, &rc, &err);
        ck_assert_msg(rc == 2 && strstr(err, "kvmill eval: --device cuda:7") && count(err, "cuda:7") == 1 &&
                          !strstr(err, "sculpt"),
                      "eval --method h2o: exit %d: %s", rc, err);
        free(out);
        free(err);
    }
    /* the method option: refused when the methods are read, before any prefill (no table row) */
    char cmd[8192];
    const char *methods[] = {"sculpt:retain=8:device=cuda:7", "h2o,selectfit:device=cuda:7:queries=16"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "'%s/kvmill' eval --model '%s' --docs '%s' --context 64 --continuation 8 --budget 40 "
                 "--method %s", kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"),
                 kvm_test_data_path("corpus/doc_001.txt"), methods[i]);
        char *out, *err;
        rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 2, "%s: exit %d: %s", methods[i], rc, err);
        ck_assert_msg(strstr(err, "--device cuda:7") && !strstr(err, "cuda:7: cuda:7"), "%s: stderr: %s", methods[i],
                      err); /* the value once after --device (the method string names it too) */
        ck_assert_msg(!strstr(out, "kl_mean"), "%s: evaluated before refusing: %s", methods[i], out);
        free(out);
        free(err);
    }
    /* decode workers ([serve] devices): on any host, a config whose method keeps the cache with a
     * decode-phase policy (the host forward's hooks) or whose cache is 16-bit is refused on a
     * device, naming it, before the device is looked at; a config the device serves (method
     * full) gets to the device check (none here: refused naming the device) */
    {
        char *dir = kvm_test_tmpdir(), cfg[4200], text[4600];
        const char *cases[][2] = {{"[model]\npath = m.bin\n[compress]\nmethod = h2o\n", "method h2o keeps its cache within budget"},
                                  {"[model]\npath = m.bin\nkv_dtype = f16\n[compress]\nmethod = full\n", "kv_dtype = f16"},
                                  {"[model]\npath = m.bin\n[compress]\nmethod = full\n", "--device cuda:7"}};
        for (int i = 0; i < 3; i++) {
            snprintf(cfg, sizeof cfg, "%s/d%d.ini", dir, i);
            snprintf(text, sizeof text, "%s", cases[i][0]);
            ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
            char *err, *out = run("'%s/kvmill-decode' --connect ipc:///nonexistent/kvm --device cuda:7 --config '%s'%s",
                                  cfg, "", &rc, &err);
            ck_assert_msg(rc == 2 && strstr(err, cases[i][1]) && count(err, "cuda:7") == 1, "kvmill-decode, case %d: exit %d: %s",
                          i, rc, err);
            free(out);
            free(err);
        }
        kvm_test_rmtree(dir);
        free(dir);
    }
    /* prefill workers run on the device (issue 13): one this host lacks stops the worker before
     * it connects, naming the device, not the host forward */
    {
        char *err, *out = run("'%s/kvmill-prefill' --connect ipc:///nonexistent/kvm --device cuda:7%s%s", NULL, NULL,
                              &rc, &err);
        ck_assert_msg(rc == 2 && strstr(err, "--device cuda:7") && count(err, "cuda:7") == 1 && !strstr(err, "host forward"),
                      "kvmill-prefill: exit %d: %s", rc, err);
        free(out);
        free(err);
    }
    /* a compress worker on a device without a CUDA solver stops before connecting */
    if (!have_cuda) {
        char *err, *out = run("'%s/kvmill-compress' --connect ipc:///nonexistent/kvm --store /nonexistent --device "
                              "cuda:0%s%s", NULL, NULL, &rc, &err);
        ck_assert_msg(rc == 2 && strstr(err, "cuda:0"), "kvmill-compress: exit %d: %s", rc, err);
        free(out);
        free(err);
    }
    /* a bad KVMILL_LOG_FORMAT (the stages read it without --log-format) was blamed on --log-format,
     * a flag not given */
    {
        char *err, *out = run("KVMILL_LOG_FORMAT=xml '%s/kvmill-decode' --connect ipc:///nonexistent/kvm%s%s", NULL,
                              NULL, &rc, &err);
        ck_assert_msg(rc == 2 &&
                          strstr(err, "kvmill-decode: environment variable KVMILL_LOG_FORMAT: log format 'xml'") &&
                          !strstr(err, "--log-format"),
                      "kvmill-decode: exit %d: %s", rc, err);
        free(out);
        free(err);
        out = run("KVMILL_LOG_FORMAT=json '%s/kvmill-decode' --connect ipc:///nonexistent/kvm --log-format xml%s%s",
                  NULL, NULL, &rc, &err);
        ck_assert_msg(rc == 2 && strstr(err, "kvmill-decode: --log-format: log format 'xml'"), "exit %d: %s", rc, err);
        free(out);
        free(err);
    }
    /* a device name that is not one: the option and value once */
    {
        char *err, *out = run("'%s/kvmill-compress' --connect ipc:///nonexistent/kvm --store /nonexistent --device "
                              "cuda:abc%s%s", NULL, NULL, &rc, &err);
        ck_assert_msg(rc == 2 && strstr(err, "--device cuda:abc: not cpu or cuda:N") && count(err, "cuda:abc") == 1,
                      "kvmill-compress: exit %d: %s", rc, err);
        free(out);
        free(err);
    }
}
END_TEST

/* The stage programs exit 2 on usage errors, as kvmill does: an unknown option (it said
 * "needs a value (or unknown option)"), a missing value, a stray argument, a required option
 * missing (exit 1 before: "setup failed") and a --config that does not exist (prefill and
 * signals, which do not read it, connected and waited). */
START_TEST(test_stage_usage_exit_2)
{
    const char *stages[] = {"prefill", "compress", "decode", "signals", "strategy"};
    const char *ep = "--connect ipc:///nonexistent/kvm";
    for (size_t i = 0; i < sizeof stages / sizeof stages[0]; i++) {
        const struct {
            const char *args; /* after the program; %s: --connect ... */
            const char *want; /* in stderr */
        } bad[] = {
            {"%s --bogus 1", "unknown option '--bogus'"},
            {"%s --threads", "option '--threads' needs a value"},
            {"%s --threads -1", "--threads: '-1' is not an integer in [1, 256]"}, /* was "bad option or value" */
            {"%s --heartbeat-ms 1e3", "--heartbeat-ms: '1e3' is not an integer in [10, 3600000]"},
            {"%s stray", "unexpected argument 'stray'"},
            {"%s --config /nonexistent/k.ini", "/nonexistent/k.ini"},
            {"%s --config /", "--config /: not a regular file"},
            /* an id its ready messages cannot carry: it connected and waited for work forever */
            {"%s --id ''", "--id '': expected 1 to 255 bytes of UTF-8 text"},
            {"%s --id \"$(printf 'w\\377')\"", "expected 1 to 255 bytes of UTF-8 text"},
        };
        for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
            char fmt[512];
            snprintf(fmt, sizeof fmt, "timeout 20 '%%s/kvmill-%s' %s", stages[i], bad[k].args);
            int rc;
            char *err, *out = run(fmt, ep, NULL, &rc, &err);
            ck_assert_msg(rc == 2 && strstr(err, bad[k].want), "kvmill-%s (%s): exit %d: %s", stages[i], bad[k].want,
                          rc, err);
            free(out);
            free(err);
        }
    }
    const char *need[][2] = {{"compress", "needs --store"}, {"decode", "needs --config"}, {"strategy", "needs --store"}};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) { /* a required option missing */
        char fmt[512];
        snprintf(fmt, sizeof fmt, "timeout 20 '%%s/kvmill-%s' %%s%%s", need[i][0]);
        int rc;
        char *err, *out = run(fmt, ep, NULL, &rc, &err);
        ck_assert_msg(rc == 2 && strstr(err, need[i][1]), "kvmill-%s: exit %d: %s", need[i][0], rc, err);
        free(out);
        free(err);
    }
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cli_names");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {
        {"table_is_the_config", test_table_is_the_config},
        {"config_keys_equal_option_names", test_config_keys_equal_option_names},
        {"shared_key_ranges", test_shared_key_ranges},
        {"convergence_settings_config_id", test_convergence_settings_config_id},
        {"pilot_settings_config_id", test_pilot_settings_config_id},
        {"am_start_config_id", test_am_start_config_id},
        {"old_option_names", test_old_option_names},
        {"old_config_key", test_old_config_key},
        {"old_sculpt_flags", test_old_sculpt_flags},
        {"calibrate_layer_alloc", test_calibrate_layer_alloc},
        {"eval_flags", test_eval_flags},
        {"help_lists_methods", test_help_lists_methods},
        {"ask_prompt_file", test_ask_prompt_file},
        {"device_setting", test_device_setting},
        {"stage_usage_exit_2", test_stage_usage_exit_2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(suite()); }
