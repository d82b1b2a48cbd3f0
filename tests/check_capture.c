/* check_capture.c: KV capture through hooks: keys/values equal run.c's golden caches,
 * post-RoPE queries are RoPE(pre-RoPE queries), and entropy / received attention mass equal
 * a float64 recomputation from the captured queries and keys. */
#include "model/kvm_capture.h"
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvm_model *model;
static int32_t ids[256];

static void setup(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void teardown(void) { kvm_model_close(&model); }

static kvm_capture *run_capture(int64_t max_batch, int32_t q0, int32_t q1)
{
    kvm_forward *f;
    kvm_kvcache *c;
    kvm_capture *cap;
    kvm_capture_opts o = {.want_queries = 1, .want_stats = 1, .mass_q0 = q0, .mass_q1 = q1};
    ck_assert_int_eq(kvm_capture_new(&model->cfg, 256, &o, &cap), 0);
    ck_assert_int_eq(kvm_forward_new(model, NULL, max_batch, &f), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 256, &c), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c, ids, 256, NULL, KVM_LOGITS_NONE), 0);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
    return cap;
}

START_TEST(test_kv_equals_golden)
{
    if (!kvm_test_shared_path("golden/seq256.kcache.f32") || !kvm_test_shared_path("golden/seq256.vcache.f32")) return;
    kvm_capture *cap = run_capture(0, 0, 0);
    size_t n;
    float *gk = (float *)kvm_test_read_file(kvm_test_shared_path("golden/seq256.kcache.f32"), &n);
    float *gv = (float *)kvm_test_read_file(kvm_test_shared_path("golden/seq256.vcache.f32"), &n);
    float dk = 0, dv = 0;
    for (int l = 0; l < 5; l++) {
        const kvm_capture_layer *L = kvm_capture_layer_get(cap, l);
        for (int g = 0; g < 4; g++)
            for (int t = 0; t < 256; t++)
                for (int i = 0; i < 8; i++) {
                    size_t ours = ((size_t)g * 256 + t) * 8 + i, gold = ((size_t)l * 256 + t) * 32 + g * 8 + i;
                    dk = fmaxf(dk, fabsf(L->k[ours] - gk[gold]));
                    dv = fmaxf(dv, fabsf(L->v[ours] - gv[gold]));
                }
    }
    ck_assert_float_le(dk, 2e-4f);
    ck_assert_float_le(dv, 1e-4f);
    /* post-RoPE = RoPE(pre-RoPE), here for layer 3 */
    const kvm_capture_layer *L = kvm_capture_layer_get(cap, 3);
    float *q = malloc(8 * 256 * 8 * sizeof *q), cs[256 * 4], sn[256 * 4];
    memcpy(q, L->q_pre, 8 * 256 * 8 * sizeof *q);
    int32_t pos[256];
    for (int t = 0; t < 256; t++) pos[t] = t;
    kvm_rope_table(pos, 256, 8, 10000.0f, cs, sn);
    for (int h = 0; h < 8; h++)
        kvm_kernels_cpu()->rope(q + h * 256 * 8, 256, 8, 1, 8, cs, sn, KVM_ROPE_INTERLEAVED);
    float dq = 0, moved = 0;
    for (int i = 0; i < 8 * 256 * 8; i++) {
        dq = fmaxf(dq, fabsf(q[i] - L->q[i]));
        moved = fmaxf(moved, fabsf(L->q_pre[i] - L->q[i]));
    }
    ck_assert_float_le(dq, 1e-5f);
    ck_assert_float_gt(moved, 1e-2f); /* RoPE really rotated something */
    free(q);
    free(gk);
    free(gv);
    kvm_capture_free(&cap);
}
END_TEST

/* float64 reference: softmax of q_i·k_j/sqrt(d) over j <= i */
static void reference_stats(const kvm_capture_layer *L, int h, int32_t q0, int32_t q1, double *ent, double *mass)
{
    const float *q = L->q + (size_t)h * 256 * 8, *k = L->k + (size_t)(h / 2) * 256 * 8;
    memset(mass, 0, 256 * sizeof *mass);
    double p[256];
    for (int i = 0; i < 256; i++) {
        double mx = -1e300, sum = 0;
        for (int j = 0; j <= i; j++) {
            double s = 0;
            for (int c = 0; c < 8; c++) s += (double)q[i * 8 + c] * k[j * 8 + c];
            p[j] = s / sqrt(8.0);
            mx = fmax(mx, p[j]);
        }
        for (int j = 0; j <= i; j++) sum += (p[j] = exp(p[j] - mx));
        ent[i] = 0;
        for (int j = 0; j <= i; j++) {
            p[j] /= sum;
            if (p[j] > 0) ent[i] -= p[j] * log(p[j]);
            if (i >= q0 && i < q1) mass[j] += p[j];
        }
    }
}

static void check_stats(int64_t max_batch)
{
    const int32_t q0 = 200, q1 = 256;
    kvm_capture *cap = run_capture(max_batch, q0, q1);
    double ent[256], mass[256];
    for (int l = 0; l < 5; l += 2)
        for (int h = 0; h < 8; h += 3) {
            const kvm_capture_layer *L = kvm_capture_layer_get(cap, l);
            reference_stats(L, h, q0, q1, ent, mass);
            double de = 0, dm = 0, total = 0;
            for (int t = 0; t < 256; t++) {
                de = fmax(de, fabs(ent[t] - L->entropy[h * 256 + t]));
                dm = fmax(dm, fabs(mass[t] - L->mass[h * 256 + t]));
                total += L->mass[h * 256 + t];
            }
            ck_assert_msg(de < 1e-4 && dm < 1e-4, "layer %d head %d: entropy err %g mass err %g", l, h, de, dm);
            ck_assert_double_eq_tol(total, q1 - q0, 1e-3); /* each window row sums to one */
            ck_assert_double_eq_tol(L->entropy[h * 256], 0.0, 1e-6); /* BOS sees only itself */
        }
    kvm_capture_free(&cap);
}

START_TEST(test_stats_match_reference) { check_stats(0); }
END_TEST

START_TEST(test_stats_chunked) { check_stats(64); }
END_TEST

START_TEST(test_bad_window)
{
    kvm_capture *cap;
    kvm_capture_opts o = {.mass_q0 = 300, .mass_q1 = 0};
    ck_assert_int_eq(kvm_capture_new(&model->cfg, 256, &o, &cap), KVM_EINVAL);
    ck_assert_ptr_null(cap);
    ck_assert_int_eq(kvm_capture_new(&model->cfg, 0, NULL, &cap), KVM_EINVAL);
}
END_TEST

static Suite *capture_suite(void)
{
    Suite *s = suite_create("capture");
    struct { const char *name; const TTest *fn; } cases[] = {
        {"kv_equals_golden", test_kv_equals_golden}, {"stats_match_reference", test_stats_match_reference},
        {"stats_chunked", test_stats_chunked}, {"bad_window", test_bad_window}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(capture_suite()); }
