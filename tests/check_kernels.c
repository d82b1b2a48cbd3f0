/* check_kernels.c: the CPU backend against float64 references: packed GEMM (every tail
 * shape, k prefixes, one-row decode), attention over ragged caches (distilled entries with
 * no position, logit biases, causal masks; decode and blocked prefill paths), RoPE in both
 * pairings, and the thread pool. */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include "kernels/kvm_kernels.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_pool.h"
#include "common/kvm_cpus.h"
#include "common/kvm_error.h"

#include "kernels/cpu/kvm_cpu_clones.h"
#include "proto/kvm_half.h"
#include "tests/util/kvm_test.h"

#include <cblas.h>
#include <sched.h>
#include <sys/stat.h>
#include <check.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *rand_buf(int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    for (int64_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

START_TEST(test_matmul_shapes)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    const int64_t ms[] = {1, 2, 7, 8, 9, 130}, outs[] = {1, 15, 16, 17, 40}, ins[] = {1, 8, 33};
    for (size_t a = 0; a < 6; a++)
        for (size_t b = 0; b < 5; b++)
            for (size_t c = 0; c < 3; c++) {
                int64_t m = ms[a], out = outs[b], in = ins[c], ldx = in + 3, ldy = out + 5;
                float *x = rand_buf(m * ldx), *w = rand_buf(out * in), *y = rand_buf(m * ldy), *y0 = malloc((size_t)(m * ldy) * sizeof *y0);
                memcpy(y0, y, (size_t)(m * ldy) * sizeof *y0);
                kvm_weight *kw = k->weight_new(w, out, in);
                ck_assert_ptr_nonnull(kw);
                ck_assert_int_eq(k->matmul(x, m, ldx, kw, y, ldy), 0);
                for (int64_t r = 0; r < m; r++)
                    for (int64_t o = 0; o < ldy; o++) {
                        if (o >= out) { /* padding columns of Y are untouched */
                            ck_assert_float_eq(y[r * ldy + o], y0[r * ldy + o]);
                            continue;
                        }
                        double ref = 0;
                        for (int64_t i = 0; i < in; i++) ref += (double)x[r * ldx + i] * w[o * in + i];
                        ck_assert_msg(fabs(ref - y[r * ldy + o]) < 1e-5 * (1 + fabs(ref)), "m=%lld out=%lld in=%lld r=%lld o=%lld: %g vs %g",
                                      (long long)m, (long long)out, (long long)in, (long long)r, (long long)o, ref, y[r * ldy + o]);
                    }
                k->weight_free(kw);
                free(x); free(w); free(y); free(y0);
            }
}
END_TEST

/* Rows of a float32 W [out][in] for weight_new_rows. */
typedef struct rows_src {
    const float *w;
    int64_t in;
} rows_src;

static int rows_of(void *ctx, int64_t r0, int64_t n, float *dst)
{
    const rows_src *s = ctx;
    memcpy(dst, s->w + r0 * s->in, (size_t)(n * s->in) * sizeof *dst);
    return 0;
}

/* x rounded to the nearest bf16 / f16 (ties to even), as float32. */
static float round_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}
static float round_f16(float x) { return (float)(_Float16)x; }

/* 16-bit panels (bf16 and f16) give bit for bit the float32 panels' product when both hold the
 * same values: odd and panel-tail sizes, single rows (decode), row tails of 1, shared dimensions
 * past one widened block (KC = 256), threads splitting columns, f16 widened by the clones'
 * integer ops, by F16C (x86-64-v3) and by AVX-512's vcvtph2ps (x86-64-v4), where the processor
 * has them; and the
 * rounding itself is to nearest (16-bit panels of unrounded values stay within the dtype's
 * relative error). */
START_TEST(test_gemm_16bit_panels)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    const int64_t ms[] = {1, 2, 5, 9, 17, 130}, outs[] = {1, 15, 17, 40}, ins[] = {1, 7, 256, 257, 600};
    const kvm_weight_dtype dts[] = {KVM_WEIGHT_BF16, KVM_WEIGHT_F16};
    const int v4_was = kvm__cpu_v4_set(1), has_v4 = kvm__cpu_v4(), v3_was = kvm__cpu_v3_set(1), has_v3 = kvm__cpu_v3();
    if (!has_v4) printf("SKIP: no AVX-512 (x86-64-v4) on this processor: its f16 widening is not run\n");
    if (!has_v3) printf("SKIP: no x86-64-v3 (F16C) on this processor: its f16 widening is not run\n");
    for (int run = 0; run < 6; run++) { /* widening: the clones' integer ops, F16C, AVX-512 */
        const int th = 1 + run % 2, level = run / 2, v4 = level == 2, v3 = level == 1;
        if ((v4 && !has_v4) || (v3 && !has_v3)) continue;
        kvm_kernels_cpu_set_threads(th);
        kvm__cpu_v4_set(v4);
        kvm__cpu_v3_set(v3);
        for (size_t d = 0; d < 2; d++)
            for (size_t a = 0; a < 6; a++)
                for (size_t b = 0; b < 4; b++)
                    for (size_t c = 0; c < 5; c++) {
                        int64_t m = ms[a], out = outs[b], in = ins[c], ldx = in + 1, ldy = out + 3;
                        float *x = rand_buf(m * ldx), *w = rand_buf(out * in), *wr = malloc((size_t)(out * in) * 4);
                        for (int64_t i = 0; i < out * in; i++) wr[i] = d ? round_f16(w[i]) : round_bf16(w[i]);
                        float *y32 = calloc((size_t)(m * ldy), 4), *y16 = calloc((size_t)(m * ldy), 4);
                        float *yu = calloc((size_t)(m * ldy), 4);
                        kvm_weight *k32 = k->weight_new(wr, out, in), *k16 = NULL, *ku = NULL;
                        rows_src sr = {wr, in}, su = {w, in};
                        ck_assert_int_eq(k->weight_new_rows(rows_of, &sr, out, in, dts[d], &k16), 0);
                        ck_assert_int_eq(k->weight_new_rows(rows_of, &su, out, in, dts[d], &ku), 0);
                        ck_assert_int_eq(k->matmul(x, m, ldx, k32, y32, ldy), 0);
                        ck_assert_int_eq(k->matmul(x, m, ldx, k16, y16, ldy), 0);
                        ck_assert_int_eq(k->matmul(x, m, ldx, ku, yu, ldy), 0);
                        ck_assert_msg(memcmp(y32, y16, (size_t)(m * ldy) * 4) == 0,
                                      "%s m=%lld out=%lld in=%lld threads=%d v4=%d: 16-bit panels differ from float32",
                                      d ? "f16" : "bf16", (long long)m, (long long)out, (long long)in, th, v4);
                        for (int64_t i = 0; i < m * ldy; i++) /* the same panels as rounding by hand */
                            ck_assert_float_eq(yu[i], y16[i]);
                        k->weight_free(k32);
                        k->weight_free(k16);
                        k->weight_free(ku);
                        free(x); free(w); free(wr); free(y32); free(y16); free(yu);
                    }
    }
    kvm_kernels_cpu_set_threads(1);
    kvm__cpu_v4_set(v4_was);
    kvm__cpu_v3_set(v3_was);
}
END_TEST

/* The AVX2 single-row GEMV (float32, bf16 and f16 panels, written with intrinsics in 256-bit
 * halves) gives bit for bit what the generic 16-lane body gives: rows of 1 (decode) and a
 * batch whose last row tile is a single row, K past one widened block and not a multiple of 4,
 * partial panels. Skipped without x86-64-v3. */
START_TEST(test_gemm_v3_single_rows_equal_generic)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    const int v4_was = kvm__cpu_v4_set(0), v3_was = kvm__cpu_v3_set(1);
#ifdef __SANITIZE_ADDRESS__
    const int off = 1; /* kernels/cpu/kvm_cpu_gemm.c v3_paths: not in sanitizer builds */
#else
    const int off = !kvm__cpu_v3();
#endif
    if (off) {
        printf("SKIP: no x86-64-v3 on this processor (or a sanitizer build): its single-row GEMV is not run\n");
        kvm__cpu_v3_set(v3_was);
        kvm__cpu_v4_set(v4_was);
        return;
    }
    const int64_t ms[] = {1, 5}, outs[] = {7, 16, 40}, ins[] = {3, 258, 601};
    const kvm_weight_dtype dts[] = {KVM_WEIGHT_F32, KVM_WEIGHT_BF16, KVM_WEIGHT_F16};
    kvm_kernels_cpu_set_threads(1);
    for (size_t d = 0; d < 3; d++)
        for (size_t a = 0; a < 2; a++)
            for (size_t b = 0; b < 3; b++)
                for (size_t c = 0; c < 3; c++) {
                    const int64_t m = ms[a], out = outs[b], in = ins[c], ldx = in + 1, ldy = out + 3;
                    float *x = rand_buf(m * ldx), *w = rand_buf(out * in);
                    float *yg = calloc((size_t)(m * ldy), 4), *yv = calloc((size_t)(m * ldy), 4);
                    rows_src src = {w, in};
                    kvm_weight *kw = NULL;
                    ck_assert_int_eq(k->weight_new_rows(rows_of, &src, out, in, dts[d], &kw), 0);
                    kvm__cpu_v3_set(0);
                    ck_assert_int_eq(k->matmul(x, m, ldx, kw, yg, ldy), 0);
                    kvm__cpu_v3_set(1);
                    ck_assert_int_eq(k->matmul(x, m, ldx, kw, yv, ldy), 0);
                    ck_assert_msg(memcmp(yg, yv, (size_t)(m * ldy) * 4) == 0,
                                  "dtype %d m=%lld out=%lld in=%lld: the AVX2 GEMV differs from the generic body",
                                  (int)dts[d], (long long)m, (long long)out, (long long)in);
                    k->weight_free(kw);
                    free(x);
                    free(w);
                    free(yg);
                    free(yv);
                }
    kvm__cpu_v3_set(v3_was);
    kvm__cpu_v4_set(v4_was);
}
END_TEST

/* Every finite f16 value, subnormals and signed zeros included, comes out of an f16 panel as
 * the portable converter widens it: through the block widening (8-row tiles) and the streaming
 * one (single rows), with the clones' integer widening and, where the processor has them,
 * F16C's and AVX-512's vcvtph2ps. y = X·Wᵀ with X's rows the unit vectors reads W back. */
START_TEST(test_f16_panels_every_value)
{
    enum { IN = 4096, OUT = 16 }; /* 65,536 weights: weight (o, i) holds the bit pattern o·IN + i */
    const kvm_kernels *k = kvm_kernels_cpu();
    float *w = malloc((size_t)OUT * IN * sizeof *w), *x = calloc((size_t)IN * IN, sizeof *x);
    float *y = malloc((size_t)IN * OUT * sizeof *y);
    for (int i = 0; i < OUT * IN; i++) /* inf and NaN (exponent 31) would poison the sums: 0 */
        w[i] = (i & 0x7c00) == 0x7c00 ? 0.0f : kvm_half_f16_to_f32((uint16_t)i);
    for (int i = 0; i < IN; i++)
        x[(size_t)i * IN + i] = 1.0f;
    kvm_weight *k16 = NULL;
    rows_src src = {w, IN};
    ck_assert_int_eq(k->weight_new_rows(rows_of, &src, OUT, IN, KVM_WEIGHT_F16, &k16), 0);
    kvm_kernels_cpu_set_threads(1);
    const int v4_was = kvm__cpu_v4_set(1), has_v4 = kvm__cpu_v4(), v3_was = kvm__cpu_v3_set(1), has_v3 = kvm__cpu_v3();
    for (int level = 0; level < 3; level++) { /* the clones' integer ops, F16C, AVX-512 */
        const int v4 = level == 2, v3 = level == 1;
        if ((v4 && !has_v4) || (v3 && !has_v3)) continue;
        kvm__cpu_v4_set(v4);
        kvm__cpu_v3_set(v3);
        for (int single = 0; single < 2; single++) {
            if (single) /* one row a call: the streaming widening */
                for (int r = 0; r < IN; r++)
                    ck_assert_int_eq(k->matmul(x + (size_t)r * IN, 1, IN, k16, y + r * OUT, OUT), 0);
            else
                ck_assert_int_eq(k->matmul(x, IN, IN, k16, y, OUT), 0);
            for (int r = 0; r < IN; r++)
                for (int o = 0; o < OUT; o++)
                    ck_assert_msg(y[r * OUT + o] == w[o * IN + r],
                                  "f16 0x%04x (v4 %d, v3 %d, single rows %d): %a, portable %a", o * IN + r, v4, v3,
                                  single, (double)y[r * OUT + o], (double)w[o * IN + r]);
        }
    }
    kvm__cpu_v4_set(v4_was);
    kvm__cpu_v3_set(v3_was);
    k->weight_free(k16);
    free(w);
    free(x);
    free(y);
}
END_TEST

/* The GEMM on 16-bit panels with alpha and a prefix of the shared dimension (causal attention's
 * use) equals the float32 panels' result bit for bit. */
START_TEST(test_gemm_16bit_prefix_alpha)
{
    const int64_t out = 37, in = 530, m = 11;
    float *w = rand_buf(out * in), *x = rand_buf(m * in), y32[11 * 37], y16[11 * 37];
    for (int64_t i = 0; i < out * in; i++) w[i] = round_bf16(w[i]);
    kvm_cpu_packed p32 = {0}, p16 = {0};
    rows_src s = {w, in};
    ck_assert_int_eq(kvm__cpu_pack(&p32, w, out, in, in, 1), 0);
    ck_assert_int_eq(kvm__cpu_pack_rows(&p16, rows_of, &s, out, in, KVM_GEMM_BF16), 0);
    ck_assert_ptr_null(p16.p);
    ck_assert_ptr_nonnull(p16.h);
    for (int64_t k_len = 0; k_len <= in; k_len += 53) {
        memset(y32, 0, sizeof y32);
        memset(y16, 0, sizeof y16);
        kvm__cpu_gemm_packed(x, m, in, &p32, y32, out, 0.5f, 16, out, k_len);
        kvm__cpu_gemm_packed(x, m, in, &p16, y16, out, 0.5f, 16, out, k_len);
        ck_assert_msg(memcmp(y32, y16, sizeof y32) == 0, "k_len %lld", (long long)k_len);
    }
    kvm__cpu_packed_free(&p32);
    kvm__cpu_packed_free(&p16);
    free(w);
    free(x);
}
END_TEST

/* f16 panels refuse a value beyond ±65504 (naming row and column); bf16 panels take it. */
START_TEST(test_weight_f16_range)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    float w[3 * 4] = {0};
    w[2 * 4 + 1] = 70000.0f;
    rows_src s = {w, 4};
    kvm_weight *kw = NULL;
    ck_assert_int_eq(k->weight_new_rows(rows_of, &s, 3, 4, KVM_WEIGHT_F16, &kw), KVM_ERANGE);
    ck_assert_ptr_null(kw);
    ck_assert_msg(strstr(kvm_errmsg(), "row 2, column 1") != NULL, "%s", kvm_errmsg());
    ck_assert_int_eq(k->weight_new_rows(rows_of, &s, 3, 4, KVM_WEIGHT_BF16, &kw), 0);
    float x[4] = {0, 1, 0, 0}, y[3];
    ck_assert_int_eq(k->matmul(x, 1, 4, kw, y, 3), 0);
    ck_assert_float_eq(y[2], 70144.0f); /* 70000 rounded to bf16's 8-bit significand */
    k->weight_free(kw);
}
END_TEST

START_TEST(test_gemm_k_prefix_and_transposed_pack)
{
    /* V [n][d] packed as W [d][n]; product over the first k_len entries only, scaled */
    const int64_t n = 37, d = 8, m = 5;
    float *v = rand_buf(n * d), *p = rand_buf(m * n), y[5 * 8];
    kvm_cpu_packed pk = {0};
    ck_assert_int_eq(kvm__cpu_pack(&pk, v, d, n, 1, d), 0);
    for (int64_t k_len = 0; k_len <= n; k_len += 9) {
        kvm__cpu_gemm_packed(p, m, n, &pk, y, d, 0.5f, 0, d, k_len);
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < d; c++) {
                double ref = 0;
                for (int64_t e = 0; e < k_len; e++) ref += (double)p[r * n + e] * v[e * d + c];
                ck_assert_double_eq_tol(0.5 * ref, y[r * d + c], 1e-5);
            }
    }
    kvm__cpu_packed_free(&pk);
    free(v); free(p);
}
END_TEST

/* float64 attention reference for one query over entries visible by position */
static void ref_attention(const float *q, int32_t qp, const float *k, const float *v, const int32_t *pos,
                          const float *bias, int64_t n_e, int d, float scale, double *out, double *probs)
{
    double mx = -INFINITY, sum = 0;
    for (int64_t e = 0; e < n_e; e++) {
        probs[e] = -INFINITY;
        if (pos[e] != KVM_POS_NONE && pos[e] > qp) continue;
        double s = 0;
        for (int c = 0; c < d; c++) s += (double)q[c] * k[e * d + c];
        probs[e] = s * scale + (bias ? bias[e] : 0);
        mx = fmax(mx, probs[e]);
    }
    for (int64_t e = 0; e < n_e; e++) sum += (probs[e] = probs[e] == -INFINITY ? 0 : exp(probs[e] - mx));
    for (int c = 0; c < d; c++) out[c] = 0;
    for (int64_t e = 0; e < n_e; e++) {
        probs[e] = sum > 0 ? probs[e] / sum : 0;
        for (int c = 0; c < d; c++) out[c] += probs[e] * v[e * d + c];
    }
}

/* A ragged head: n_none distilled entries (no position, biased), then sparse positions. */
static void check_attention(int64_t n_q, int d, int with_bias)
{
    const int64_t n_none = 5, n_pos = 150, n_e = n_none + n_pos;
    float *k = rand_buf(n_e * d), *v = rand_buf(n_e * d), *bias = calloc((size_t)n_e, sizeof *bias);
    int32_t *pos = malloc((size_t)n_e * sizeof *pos), *qpos = malloc((size_t)n_q * sizeof *qpos);
    for (int64_t e = 0; e < n_e; e++) {
        pos[e] = e < n_none ? KVM_POS_NONE : (int32_t)(3 * (e - n_none) + (e % 2)); /* gaps: evicted tokens */
        if (with_bias && e < n_none) bias[e] = 0.7f * (float)e - 1.0f;
    }
    int64_t ldq = d + 4, ldo = d + 2;
    float *q = rand_buf(n_q * ldq), *out = calloc((size_t)(n_q * ldo), sizeof *out), *probs = malloc((size_t)(n_q * n_e) * sizeof *probs);
    const float *kp[1] = {k}, *vp[1] = {v}, *bp[1] = {bias};
    const int32_t *pp[1] = {pos};
    for (int64_t i = 0; i < n_q; i++) qpos[i] = pos[n_none + 40 + i]; /* growing prefixes; each query sees itself */
    for (int i = 0; i < n_q * ldq; i++) q[i] *= 3.0f;
    /* one query head over one KV head; the probabilities come back as observation rows */
    kvm_attn_layer a = {.n_heads = 1, .n_kv_heads = 1, .head_dim = d, .scale = 1.0f / sqrtf((float)d), .q = q,
                        .ldq = ldq, .qpos = qpos, .n_q = n_q, .k = kp, .v = vp, .pos = pp, .bias = bp, .n_e = &n_e,
                        .out = out, .ldo = ldo, .stats = KVM_ATTN_STAT_OBS, .n_obs = n_q, .ld_e = n_e, .obs = probs};
    ck_assert_int_eq(kvm_kernels_cpu()->attention(&a), 0);
    double *ro = malloc((size_t)d * sizeof *ro), *rp = malloc((size_t)n_e * sizeof *rp);
    for (int64_t i = 0; i < n_q; i++) {
        ref_attention(q + i * ldq, qpos[i], k, v, pos, with_bias ? bias : NULL, n_e, d, a.scale, ro, rp);
        for (int c = 0; c < d; c++)
            ck_assert_msg(fabs(ro[c] - out[i * ldo + c]) < 2e-5, "n_q=%lld d=%d row %lld col %d: %g vs %g", (long long)n_q, d,
                          (long long)i, c, ro[c], out[i * ldo + c]);
        for (int64_t e = 0; e < n_e; e++) ck_assert_double_eq_tol(rp[e], probs[i * n_e + e], 2e-6);
    }
    free(k); free(v); free(bias); free(pos); free(qpos); free(q); free(out); free(probs); free(ro); free(rp);
}

START_TEST(test_attention_decode_path) { check_attention(1, 8, 1); check_attention(2, 64, 0); check_attention(1, 12, 1); }
END_TEST

START_TEST(test_attention_blocked_path) { check_attention(100, 8, 1); check_attention(70, 64, 0); check_attention(3, 20, 1); }
END_TEST

START_TEST(test_attention_nothing_visible)
{
    float q[8] = {1}, k[16] = {1}, v[16] = {1}, out[8], probs[2], ent = 1, lse = 0, mass[2] = {1, 1};
    int32_t pos[2] = {10, 11}, qpos[1] = {3};
    int64_t n_e = 2;
    const float *kp[1] = {k}, *vp[1] = {v};
    const int32_t *pp[1] = {pos};
    memset(out, 0x7f, sizeof out);
    memset(probs, 0x7f, sizeof probs);
    kvm_attn_layer a = {.n_heads = 1, .n_kv_heads = 1, .head_dim = 8, .scale = 1, .q = q, .ldq = 8, .qpos = qpos,
                        .n_q = 1, .k = kp, .v = vp, .pos = pp, .n_e = &n_e, .out = out, .ldo = 8,
                        .stats = KVM_ATTN_STAT_OBS | KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_LSE | KVM_ATTN_STAT_MASS,
                        .mass_p0 = 0, .mass_p1 = 100, .n_obs = 1, .ld_e = 2, .mass = mass, .entropy = &ent,
                        .lse = &lse, .obs = probs};
    ck_assert_int_eq(kvm_kernels_cpu()->attention(&a), 0);
    for (int c = 0; c < 8; c++) ck_assert_float_eq(out[c], 0.0f); /* defined, never NaN */
    ck_assert_float_eq(probs[0] + probs[1], 0.0f);
    ck_assert_float_eq(mass[0] + mass[1], 0.0f);
    ck_assert_float_eq(ent, 0.0f);
    ck_assert(isinf(lse) && lse < 0);
    n_e = -1;
    ck_assert_int_eq(kvm_kernels_cpu()->attention(&a), KVM_EINVAL);
}
END_TEST

START_TEST(test_rope_pairings)
{
    const int d = 8, n = 3;
    int32_t pos[3] = {0, 5, 300};
    float cs[3 * 4], sn[3 * 4], x[3 * 16], y[3 * 16];
    kvm_rope_table(pos, n, d, 10000.0f, cs, sn);
    for (int style = 0; style < 2; style++) {
        for (int i = 0; i < 3 * 16; i++) x[i] = y[i] = frand();
        kvm_kernels_cpu()->rope(y, n, 16, 2, d, cs, sn, (kvm_rope_style)style);
        for (int r = 0; r < n; r++)
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < d / 2; i++) {
                    int i0 = style == 0 ? 2 * i : i, i1 = style == 0 ? 2 * i + 1 : i + d / 2;
                    double ang = pos[r] / pow(10000.0, 2.0 * i / d), a = x[r * 16 + h * d + i0], b = x[r * 16 + h * d + i1];
                    ck_assert_double_eq_tol(y[r * 16 + h * d + i0], a * cos(ang) - b * sin(ang), 2e-4);
                    ck_assert_double_eq_tol(y[r * 16 + h * d + i1], a * sin(ang) + b * cos(ang), 2e-4);
                }
    }
}
END_TEST

static atomic_int hits[1000];
static void count_task(void *ctx, int64_t t, int worker)
{
    (void)ctx;
    ck_assert_int_lt(worker, kvm__cpu_threads());
    atomic_fetch_add(&hits[t], 1);
}

START_TEST(test_pool_runs_every_task_once)
{
    for (int threads = 1; threads <= 3; threads++) {
        kvm_kernels_cpu_set_threads(threads);
        for (int i = 0; i < 1000; i++) atomic_store(&hits[i], 0);
        kvm__cpu_parallel_for(1000, count_task, NULL);
        for (int i = 0; i < 1000; i++) ck_assert_int_eq(atomic_load(&hits[i]), 1);
    }
    /* the same product on 1 and 2 threads gives the same bits (columns are split, not sums) */
    float *x = rand_buf(64 * 256), *w = rand_buf(512 * 256), *y1 = malloc(64 * 512 * 4), *y2 = malloc(64 * 512 * 4);
    kvm_weight *kw = kvm_kernels_cpu()->weight_new(w, 512, 256);
    kvm_kernels_cpu_set_threads(1);
    kvm_kernels_cpu()->matmul(x, 64, 256, kw, y1, 512);
    kvm_kernels_cpu_set_threads(2);
    kvm_kernels_cpu()->matmul(x, 64, 256, kw, y2, 512);
    ck_assert_int_eq(memcmp(y1, y2, 64 * 512 * 4), 0);
    kvm_kernels_cpu()->weight_free(kw);
    free(x); free(w); free(y1); free(y2);
}
END_TEST

/* OpenBLAS stays single-threaded whatever the pool's count: its idle server threads would spin
 * on the pool's cores (kernels/cpu/kvm_cpu.c). */
START_TEST(test_blas_single_threaded)
{
    ck_assert_int_eq(openblas_get_num_threads(), 1);
    kvm_kernels_cpu_set_threads(2);
    ck_assert_int_eq(openblas_get_num_threads(), 1);
    kvm_kernels_cpu_set_threads(1);
    ck_assert_int_eq(openblas_get_num_threads(), 1);
}
END_TEST

START_TEST(test_select_device)
{
    const kvm_kernels *k;
    ck_assert_int_eq(kvm_kernels_select("cpu", &k), 0);
    ck_assert_str_eq(k->name, "cpu");
    ck_assert_int_eq(kvm_kernels_select("gpu", &k), KVM_EINVAL);
    ck_assert_int_eq(kvm_kernels_select("cuda:", &k), KVM_EINVAL);
    int rc = kvm_kernels_select("cuda:0", &k); /* no GPU here: a clear device error */
    ck_assert_msg(rc == KVM_EDEVICE, "cuda:0 gave %d: %s", rc, kvm_errmsg());
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "cuda:0"));
}
END_TEST

/* Writes text to root/rel, making its folders. */
static void put_file(const char *root, const char *rel, const char *text)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    for (char *p = path + strlen(root) + 1; (p = strchr(p, '/')); p++) {
        *p = '\0';
        mkdir(path, 0755);
        *p = '/';
    }
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
}

/* The pool's default size was the host's online CPUs (sysconf): in a container with a 2-CPU
 * quota on a big host every kvmill process ran one compute thread per host core, all frozen for
 * most of each quota period. It is now the CPUs the process may use: the cgroup quota over the
 * process's cgroup and its ancestors (v2 cpu.max, v1 cfs files), and the affinity mask. */
START_TEST(test_cpus_quota)
{
    char *root = kvm_test_tmpdir(), self[4096], cg[4096];
    snprintf(self, sizeof self, "%s/self_cgroup", root);
    snprintf(cg, sizeof cg, "%s/cg", root);
    ck_assert_int_eq(mkdir(cg, 0755), 0);
    /* v2: the smallest limit on the way up; "max" is no limit */
    put_file(cg, "cpu.max", "max 100000\n");
    put_file(cg, "a/cpu.max", "250000 100000\n");
    put_file(cg, "a/b/cpu.max", "max 100000\n");
    put_file(root, "self_cgroup", "0::/a/b\n");
    ck_assert_int_eq(kvm_cpus_quota(cg, self), 3);
    put_file(cg, "a/b/cpu.max", "50000 100000\n"); /* half a CPU: one thread */
    ck_assert_int_eq(kvm_cpus_quota(cg, self), 1);
    /* a cgroup path that is not under the mount (a container without a cgroup namespace):
     * the mount's own limit */
    put_file(cg, "cpu.max", "300000 100000\n");
    put_file(root, "self_cgroup", "0::/docker/0123abcd\n");
    ck_assert_int_eq(kvm_cpus_quota(cg, self), 3);
    /* malformed or missing files: no limit */
    put_file(cg, "cpu.max", "lots\n");
    ck_assert_int_eq(kvm_cpus_quota(cg, self), 0);
    put_file(cg, "cpu.max", "max 100000\n");
    ck_assert_int_eq(kvm_cpus_quota(cg, self), 0);
    ck_assert_int_eq(kvm_cpus_quota(cg, "/nonexistent/self_cgroup"), 0);
    /* v1: the cpu controller's folder, quota -1 = none */
    put_file(cg, "cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
    put_file(cg, "cpu,cpuacct/cpu.cfs_period_us", "100000\n");
    put_file(cg, "cpu,cpuacct/x/cpu.cfs_quota_us", "200000\n");
    put_file(cg, "cpu,cpuacct/x/cpu.cfs_period_us", "100000\n");
    put_file(root, "self_cgroup", "5:memory:/x\n4:cpu,cpuacct:/x\n0::/\n");
    ck_assert_int_eq(kvm_cpus_quota(cg, self), 2);
    put_file(root, "self_cgroup", "4:cpu,cpuacct:/\n");
    ck_assert_int_eq(kvm_cpus_quota(cg, self), 0);
    kvm_test_rmtree(root);
    free(root);

    /* the affinity mask: a process pinned to one CPU gets a pool of one thread (this test runs
     * in its own forked process, whose pool is not started yet) */
    cpu_set_t cur, one;
    ck_assert_int_eq(sched_getaffinity(0, sizeof cur, &cur), 0);
    int first = 0;
    while (first < CPU_SETSIZE - 1 && !CPU_ISSET(first, &cur))
        first++; /* a cpuset need not hold CPU 0 */
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    ck_assert_int_eq(sched_setaffinity(0, sizeof one, &one), 0);
    ck_assert_int_eq(kvm_cpus_usable(), 1);
    ck_assert_int_eq(kvm__cpu_threads(), 1);
}
END_TEST

/* Every kvmill binary loaded OpenBLAS's pthread build, whose load-time constructor starts
 * server threads before main: under an address-space limit one spun in malloc and the shutdown
 * joined it for ever (ulimit -v 150000: a hang with no word), or its failed pthread_create
 * raised SIGINT (ulimit -v 60000: exit 130, which kvmill uses for "interrupted"). The serial
 * build, linked when installed (Makefile OPENBLAS_SERIAL), starts none: the command runs and
 * says what it has to say. Not under ASan, whose shadow memory needs no such limit. */
START_TEST(test_blas_under_address_limit)
{
#if defined(__SANITIZE_ADDRESS__)
    kvm_test_skip("ASan reserves terabytes of address space: no ulimit -v under it");
#elif !defined(KVM_OPENBLAS_SERIAL)
    kvm_test_skip("built with the pthread OpenBLAS (libopenblas-serial-dev not installed: Makefile OPENBLAS_SERIAL), "
                  "whose load-time threads this test would find");
#else
    const int limits[] = {150000, 60000};
    for (int i = 0; i < 2; i++) {
        char cmd[8192], *err = NULL;
        snprintf(cmd, sizeof cmd, "ulimit -v %d && exec timeout 60 '%s/kvmill' store ls --store /nonexistent/kvm-x",
                 limits[i], kvm_test_bin());
        int rc = kvm_test_run(cmd, NULL, &err);
        ck_assert_msg(rc == 2 && err && strstr(err, "/nonexistent/kvm-x: no such directory"),
                      "ulimit -v %d: exit %d (124: hung; 130: OpenBLAS raised SIGINT): %s", limits[i], rc,
                      err ? err : "");
        free(err);
    }
#endif
}
END_TEST

static Suite *kernels_suite(void)
{
    Suite *s = suite_create("kernels");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"matmul_shapes", test_matmul_shapes},
                 {"gemm_k_prefix_and_transposed_pack", test_gemm_k_prefix_and_transposed_pack},
                 {"gemm_16bit_panels", test_gemm_16bit_panels},
                 {"gemm_v3_single_rows_equal_generic", test_gemm_v3_single_rows_equal_generic},
                 {"f16_panels_every_value", test_f16_panels_every_value},
                 {"gemm_16bit_prefix_alpha", test_gemm_16bit_prefix_alpha},
                 {"weight_f16_range", test_weight_f16_range},
                 {"attention_decode_path", test_attention_decode_path},
                 {"attention_blocked_path", test_attention_blocked_path},
                 {"attention_nothing_visible", test_attention_nothing_visible},
                 {"rope_pairings", test_rope_pairings},
                 {"pool_runs_every_task_once", test_pool_runs_every_task_once},
                 {"select_device", test_select_device},
                 {"cpus_quota", test_cpus_quota},
                 {"blas_under_address_limit", test_blas_under_address_limit},
                 {"blas_single_threaded", test_blas_single_threaded}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(kernels_suite()); }
