/* check_model.c: the llama2.c checkpoint loader (every malformed-file class gives its
 * documented error naming the file and field) and the random-weight checkpoint writer. */
#include "model/kvm_forward.h"
#include "model/kvm_sampler.h"
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char *tmp;
static char *orig;
static size_t orig_n;

static void setup(void)
{
    tmp = kvm_test_tmpdir();
    orig = kvm_test_read_file(kvm_test_data_path("models/stories260K.bin"), &orig_n);
    ck_assert_ptr_nonnull(orig);
    ck_assert_uint_eq(orig_n, 1056540);
}

static void teardown(void)
{
    kvm_test_rmtree(tmp);
    free(tmp);
    free(orig);
}

/* Writes `n` bytes of `data` to tmp/name and tries to open it; checks status and message. */
static void expect_error(const char *name, const void *data, size_t n, int status, const char *needle)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", tmp, name);
    ck_assert_int_eq(kvm_test_write_file(path, data, n), 0);
    kvm_model *m = (kvm_model *)0x1;
    int rc = kvm_model_open(path, &m);
    ck_assert_msg(rc == status, "%s: status %d (%s), want %d", name, rc, kvm_errmsg(), status);
    ck_assert_ptr_null(m);
    ck_assert_msg(strstr(kvm_errmsg(), needle), "%s: message '%s' lacks '%s'", name, kvm_errmsg(), needle);
    ck_assert_msg(strstr(kvm_errmsg(), path), "%s: message '%s' does not name the file", name, kvm_errmsg());
}

START_TEST(test_loads_stories260k)
{
    kvm_model *m;
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &m), 0);
    ck_assert_int_eq(m->cfg.dim, 64);
    ck_assert_int_eq(m->cfg.hidden_dim, 172);
    ck_assert_int_eq(m->cfg.n_layers, 5);
    ck_assert_int_eq(m->cfg.n_heads, 8);
    ck_assert_int_eq(m->cfg.n_kv_heads, 4);
    ck_assert_int_eq(m->cfg.head_dim, 8);
    ck_assert_int_eq(m->cfg.vocab_size, 512);
    ck_assert_int_eq(m->cfg.seq_len, 512);
    ck_assert_int_eq(m->cfg.shared_classifier, 1);
    ck_assert_ptr_eq(m->wcls.data, m->tok_emb.data);
    ck_assert_int_eq(m->wcls.type, KVM_MAT_F32);
    ck_assert_int_eq(kvm_model_n_params(m), 260032); /* 264,128 floats minus the 4,096 RoPE-table floats */
    /* spot-check offsets against shared/models/README.md: wq of layer 0 starts at byte 132,380 */
    float w;
    memcpy(&w, orig + 132380, 4);
    ck_assert_int_eq(m->layers[0].wq.type, KVM_MAT_F32); /* zero copy, in the mapping */
    ck_assert(m->layers[0].wq.data == (const uint8_t *)m->map + 132380);
    float row0[64];
    ck_assert_int_eq(kvm_model_mat_rows(&m->layers[0].wq, 64, 0, 1, row0), 0);
    ck_assert_float_eq(row0[0], w);
    memcpy(&w, orig + 1039900, 4);
    ck_assert_float_eq(m->rms_final[0], w);
    kvm_model_close(&m);
    ck_assert_ptr_null(m);
    kvm_model_close(&m); /* NULL-safe */
}
END_TEST

START_TEST(test_missing_and_directory)
{
    kvm_model *m;
    char path[4096];
    snprintf(path, sizeof path, "%s/nope.bin", tmp);
    ck_assert_int_eq(kvm_model_open(path, &m), KVM_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), path));
    ck_assert_int_eq(kvm_model_open(tmp, &m), KVM_EFORMAT); /* the user named the wrong kind of path: exit 2 */
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "directory"));
}
END_TEST

START_TEST(test_empty_and_truncated)
{
    expect_error("empty.bin", "", 0, KVM_EFORMAT, "empty");
    expect_error("short.bin", orig, 10, KVM_EFORMAT, "truncated");
    expect_error("half.bin", orig, orig_n / 2, KVM_EFORMAT, "truncated");
    expect_error("minus4.bin", orig, orig_n - 4, KVM_EFORMAT, "truncated");
    char *longer = malloc(orig_n + 8);
    memcpy(longer, orig, orig_n);
    memset(longer + orig_n, 0, 8);
    expect_error("long.bin", longer, orig_n + 8, KVM_EFORMAT, "trailing");
    free(longer);
}
END_TEST

/* Overwrites header field idx with v and expects an error mentioning `needle`. */
static void bad_field(int idx, int32_t v, const char *needle)
{
    char *buf = malloc(orig_n), name[64];
    memcpy(buf, orig, orig_n);
    memcpy(buf + 4 * idx, &v, 4);
    snprintf(name, sizeof name, "field%d_%d.bin", idx, v);
    expect_error(name, buf, orig_n, KVM_EFORMAT, needle);
    free(buf);
}

START_TEST(test_bad_header_fields)
{
    const char *names[] = {"'dim'", "'hidden_dim'", "'n_layers'", "'n_heads'", "'n_kv_heads'", "'vocab_size'", "'seq_len'"};
    for (int i = 0; i < 7; i++) {
        if (i != 5) bad_field(i, -3, names[i]); /* a negative vocab means a separate classifier */
        bad_field(i, 0, names[i]);
    }
    bad_field(0, 1 << 30, "exceeds the limit");
    bad_field(3, 7, "does not divide dim");
    bad_field(4, 3, "does not divide n_heads");
    bad_field(3, 64, "odd");                  /* head size 1 */
    bad_field(5, -512, "separate classifier"); /* wcls missing: size check says what was expected */
    bad_field(6, 1024, "implies");            /* RoPE tables sized by seq_len no longer fit */
}
END_TEST

/* Files that are no model: each was misread as a llama2.c header ("header field 'dim' =
 * 1936876918 exceeds the limit"); now the message says what the file is. */
START_TEST(test_not_a_model)
{
    static const char lfs[] = "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 98362432\n";
    expect_error("lfs.gguf", lfs, sizeof lfs - 1, KVM_EFORMAT, "Git LFS pointer");
    expect_error("lfs.bin", lfs, sizeof lfs - 1, KVM_EFORMAT, "Git LFS pointer");
    static const char html[] = "<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head></html>\n";
    expect_error("page.bin", html, sizeof html - 1, KVM_EFORMAT, "not a model: a text file");
    static const char json[] = "{\"error\": \"Repository not found\"}";
    expect_error("err.gguf", json, sizeof json - 1, KVM_EFORMAT, "not a model: a text file");
    char *bad = malloc(4096);
    memcpy(bad, "GGUX", 4);
    memcpy(bad + 4, orig + 4, 4092); /* binary after a wrong magic */
    expect_error("bad.gguf", bad, 4096, KVM_EFORMAT, "not a GGUF file: magic 'GGUX'");
    bad[0] = 0x7f;
    expect_error("bad2.gguf", bad, 4096, KVM_EFORMAT, "magic '\\x7fGUX'");
    memcpy(bad, "GGUX", 4);
    expect_error("bad.bin", bad, 4096, KVM_EFORMAT, "not a llama2.c checkpoint nor a GGUF file");
    free(bad);
    bad_field(0, 1 << 30, "not a llama2.c checkpoint nor a GGUF file");
}
END_TEST

/* Writes orig with the float at byte off replaced by v and expects the load to name `needle`. */
static void bad_weight(size_t off, float v, const char *needle)
{
    char *buf = malloc(orig_n), name[64];
    memcpy(buf, orig, orig_n);
    memcpy(buf + off, &v, 4);
    snprintf(name, sizeof name, "w%zu.bin", off);
    expect_error(name, buf, orig_n, KVM_EFORMAT, needle);
    free(buf);
}

/* NaN or infinite weights loaded silently (info exit 0, generate printed garbage); now the
 * load fails naming the file, the llama2.c array (and layer) and the element. */
START_TEST(test_nonfinite_weights)
{
    const size_t V = 512, D = 64, L = 5, H = 172, KV = 32, h = 28;
    bad_weight(h + 4 * 7, NAN, "'token_embedding_table': element 7 is NaN");
    size_t wq = h + 4 * (V * D + L * D);
    bad_weight(wq + 4 * (3 * D * D + 5), NAN, "'wq (layer 3)': element 5 is NaN");
    size_t w2 = wq + 4 * (L * D * D + 2 * L * KV * D + L * D * D + L * D + L * H * D);
    bad_weight(w2 + 4 * (4 * D * H + D * H - 1), -INFINITY, "'w2 (layer 4)': element 11007 is -inf");
    size_t rms_final = w2 + 4 * (2 * L * H * D);
    bad_weight(rms_final + 4 * 63, INFINITY, "'rms_final_weight': element 63 is inf");
    char *rope = malloc(orig_n), path[4096];
    memcpy(rope, orig, orig_n);
    memcpy(rope + rms_final + 4 * 64, &(float){NAN}, 4); /* the legacy RoPE tables: unused, unchecked */
    snprintf(path, sizeof path, "%s/rope.bin", tmp);
    ck_assert_int_eq(kvm_test_write_file(path, rope, orig_n), 0);
    free(rope);
    kvm_model *m;
    ck_assert_msg(kvm_model_open(path, &m) == 0, "%s", kvm_errmsg());
    kvm_model_close(&m);
    char *all = malloc(orig_n);
    memcpy(all, orig, 28);
    for (size_t i = 28; i + 4 <= orig_n; i += 4)
        memcpy(all + i, "\x00\x00\xc0\x7f", 4);
    expect_error("nan.bin", all, orig_n, KVM_EFORMAT, "'token_embedding_table': element 0 is NaN");
    free(all);
    char cmd[8192], *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill info --model %s/nan.bin", kvm_test_bin(), tmp);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 2); /* bad input found up front */
    ck_assert_msg(strstr(err, "nan.bin: tensor 'token_embedding_table'"), "%s", err);
    free(err);
}
END_TEST

/* kvm__model_check_finite screens 8-byte words at a time: every lane position, chunk edges
 * and the tail must still be caught, and the largest finite values (exponent all ones but
 * one bit) let through. */
START_TEST(test_check_finite_positions)
{
    enum { N = 4096 * 2 + 3 };
    static const struct {
        int type, width;
        uint32_t big, bad[3]; /* largest finite (sign set), inf, NaN, -inf */
    } ty[] = {{KVM_MAT_F32, 4, 0xff7fffffu, {0x7f800000u, 0x7fc00001u, 0xff800000u}},
              {KVM_MAT_F16, 2, 0xfbffu, {0x7c00u, 0x7e01u, 0xfc00u}},
              {KVM_MAT_BF16, 2, 0xff7fu, {0x7f80u, 0x7fc1u, 0xff80u}}};
    static const char *const names[3] = {"inf", "NaN", "-inf"};
    static const int64_t at[] = {0, 1, 2, 3, 5, 4095, 4096, 4097, N - 2, N - 1};
    uint8_t *buf = malloc((size_t)N * 4);
    for (size_t k = 0; k < sizeof ty / sizeof ty[0]; k++) {
        for (int64_t i = 0; i < N; i++) {
            uint32_t v =
                i % 3 ? ty[k].big ^ (ty[k].width == 4 ? 0x80000000u : 0x8000u) : (uint32_t)(i * 7919u) & 0x3fffu;
            memcpy(buf + i * ty[k].width, &v, (size_t)ty[k].width); /* little-endian: the low bytes */
        }
        ck_assert_msg(kvm__model_check_finite("f", "t", ty[k].type, buf, N) == 0, "%s", kvm_errmsg());
        for (size_t a = 0; a < sizeof at / sizeof at[0]; a++)
            for (int b = 0; b < 3; b++) {
                uint32_t keep = 0;
                memcpy(&keep, buf + at[a] * ty[k].width, (size_t)ty[k].width);
                memcpy(buf + at[a] * ty[k].width, &ty[k].bad[b], (size_t)ty[k].width);
                ck_assert_int_eq(kvm__model_check_finite("f", "t", ty[k].type, buf, N), KVM_EFORMAT);
                char want[64];
                snprintf(want, sizeof want, "f: tensor 't': element %lld is %s", (long long)at[a], names[b]);
                ck_assert_msg(strstr(kvm_errmsg(), want), "type %d: '%s' lacks '%s'", ty[k].type, kvm_errmsg(), want);
                memcpy(buf + at[a] * ty[k].width, &keep, (size_t)ty[k].width);
            }
    }
    free(buf);
}
END_TEST

START_TEST(test_make_model_roundtrip)
{
    char p1[4096], p2[4096], p3[4096];
    snprintf(p1, sizeof p1, "%s/a.bin", tmp);
    snprintf(p2, sizeof p2, "%s/b.bin", tmp);
    snprintf(p3, sizeof p3, "%s/c.bin", tmp);
    kvm_make_model_opts o = {.dim = 96, .hidden_dim = 200, .n_layers = 3, .n_heads = 6, .n_kv_heads = 2,
                             .vocab_size = 300, .seq_len = 64, .seed = 7, .separate_classifier = 1};
    ck_assert_int_eq(kvm_make_model_write(p1, &o), 0);
    ck_assert_int_eq(kvm_make_model_write(p2, &o), 0);
    o.seed = 8;
    ck_assert_int_eq(kvm_make_model_write(p3, &o), 0);
    size_t n1, n2, n3;
    char *a = kvm_test_read_file(p1, &n1), *b = kvm_test_read_file(p2, &n2), *c = kvm_test_read_file(p3, &n3);
    ck_assert_uint_eq(n1, n2);
    ck_assert_int_eq(memcmp(a, b, n1), 0);     /* same seed, same bytes */
    ck_assert_int_ne(memcmp(a, c, n1), 0);     /* another seed, other weights */
    free(a); free(b); free(c);
    kvm_model *m;
    ck_assert_int_eq(kvm_model_open(p1, &m), 0);
    ck_assert_int_eq(m->cfg.shared_classifier, 0);
    ck_assert_int_eq(m->cfg.vocab_size, 300);
    ck_assert_int_eq(m->cfg.head_dim, 16);
    ck_assert_ptr_ne(m->wcls.data, m->tok_emb.data);
    ck_assert_int_eq((int64_t)n1, 28 + 4 * (kvm_model_n_params(m) + 64 * 16));
    /* the random model runs and its logits are finite and not constant */
    kvm_forward *f;
    kvm_kvcache *cache;
    ck_assert_int_eq(kvm_forward_new(m, NULL, 0, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(m, 16, &cache), 0);
    int32_t toks[16];
    for (int i = 0; i < 16; i++) toks[i] = (i * 37) % 300;
    float logits[300];
    ck_assert_int_eq(kvm_forward_prefill(f, cache, toks, 16, logits, KVM_LOGITS_LAST), 0);
    float lo = logits[0], hi = logits[0];
    for (int i = 0; i < 300; i++) {
        ck_assert(isfinite(logits[i]));
        lo = fminf(lo, logits[i]);
        hi = fmaxf(hi, logits[i]);
    }
    ck_assert_float_gt(hi - lo, 1e-3f);
    kvm_kvcache_free(&cache);
    kvm_forward_free(&f);
    kvm_model_close(&m);
}
END_TEST

START_TEST(test_make_model_bad_shapes)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/x.bin", tmp);
    kvm_make_model_opts o = {.dim = 64, .hidden_dim = 100, .n_layers = 2, .n_heads = 8, .n_kv_heads = 3,
                             .vocab_size = 32, .seq_len = 16, .seed = 1};
    ck_assert_int_eq(kvm_make_model_write(p, &o), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "--kv-heads"));
    o.n_kv_heads = 4;
    o.n_layers = 0;
    ck_assert_int_eq(kvm_make_model_write(p, &o), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "--layers"));
    struct stat st;
    ck_assert_int_ne(stat(p, &st), 0); /* nothing written */
    snprintf(p, sizeof p, "%s/no/such/dir/x.bin", tmp);
    o.n_layers = 2;
    ck_assert_int_eq(kvm_make_model_write(p, &o), KVM_EIO);
}
END_TEST

/* One draw from a fresh sampler over logits[n] (copied: sampling rewrites them). */
static int32_t sample_once(const float *logits, int n, float temperature, float topp, uint64_t seed)
{
    kvm_sampler *s;
    ck_assert_int_eq(kvm_sampler_new(n, temperature, topp, seed, &s), 0);
    float *x = malloc((size_t)n * sizeof *x);
    ck_assert_ptr_nonnull(x);
    memcpy(x, logits, (size_t)n * sizeof *x);
    int32_t t = kvm_sampler_sample(s, x);
    free(x);
    kvm_sampler_free(&s);
    ck_assert_int_ge(t, 0);
    ck_assert_int_lt(t, n);
    return t;
}

/* Degenerate but valid sampler settings: top-p below 1/vocab (nothing passes run.c's
 * pre-filter: it read pi[-1]), NaN logits, a temperature so large the distribution is
 * flat or so small (subnormal as a float) that logits/T overflow, and seed 0 (xorshift's
 * fixed point: every draw was token 0). */
START_TEST(test_sampler_degenerate)
{
    enum { N = 512 };
    float l[N] = {0};
    l[7] = 1.0f; /* at T = 1e6 every p is ~1/512, below (1 - 0.001) / 511, p[7] the largest */
    ck_assert_int_eq(sample_once(l, N, 1e6f, 0.001f, 1), 7);
    ck_assert_int_eq(sample_once(l, 1, 1.0f, 0.5f, 1), 0); /* one token: cutoff (1-p)/0 */
    float nan_l[N] = {0};
    nan_l[0] = NAN;
    nan_l[100] = NAN;
    nan_l[3] = 2.0f;
    ck_assert_int_eq(sample_once(nan_l, N, 1.0f, 0.0f, 1), 3);
    ck_assert_int_eq(sample_once(nan_l, N, 1.0f, 0.9f, 1), 3);
    float tiny_l[N];
    for (int i = 0; i < N; i++)
        tiny_l[i] = 0.1f;
    tiny_l[2] = 0.5f;
    ck_assert_int_eq(sample_once(tiny_l, N, 1e-40f, 0.0f, 1), 2);
    ck_assert_int_eq(sample_once(tiny_l, N, 1e-40f, 0.9f, 1), 2);
    float flat[N] = {0};
    kvm_sampler *s;
    ck_assert_int_eq(kvm_sampler_new(N, 1.0f, 0.0f, 0, &s), 0);
    int distinct = 0, first = -1;
    for (int k = 0; k < 20; k++) {
        float x[N];
        memcpy(x, flat, sizeof x);
        int32_t t = kvm_sampler_sample(s, x);
        if (k == 0) first = t;
        distinct += t != first;
    }
    kvm_sampler_free(&s);
    ck_assert_msg(distinct > 0, "seed 0: 20 draws from a flat distribution all gave %d", first);
}
END_TEST

static Suite *model_suite(void)
{
    Suite *s = suite_create("model");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {
        {"loads_stories260k", test_loads_stories260k},       {"missing_and_directory", test_missing_and_directory},
        {"empty_and_truncated", test_empty_and_truncated},   {"bad_header_fields", test_bad_header_fields},
        {"make_model_roundtrip", test_make_model_roundtrip}, {"make_model_bad_shapes", test_make_model_bad_shapes},
        {"sampler_degenerate", test_sampler_degenerate},     {"not_a_model", test_not_a_model},
        {"nonfinite_weights", test_nonfinite_weights},       {"check_finite_positions", test_check_finite_positions}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(model_suite()); }
