/* check_kv16.c: the 16-bit KV cache ([model] kv_dtype = f16, issue 16). The f16 conversions
 * against proto/kvm_half.c's portable ones; the attention kernel on f16 keys/values bit for bit
 * equal to float32 entries holding the same (widened) values, prefill and decode, ragged, with
 * β, distilled entries and every statistic; keep/drop/clone/copy_layer/convert/codec round trips;
 * stories260K and SmolLM2 logits of an f16 cache against the float32 cache within measured
 * bounds (printed); greedy golden texts; ragged decode with eviction policies and β on f16; and
 * every refusal (compression, KVSculpt, the sculpt file, the reference kernel, CUDA, bad values,
 * the CLI). */
#include "compress/eval/kvm_eval.h"
#include "common/kvm_error.h"
#include "compress/evict/kvm_evict.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "compress/sculpt/kvm_sculpt_file.h"
#include "kernels/cpu/kvm_cpu_attn_f16c.h"
#include "kernels/cpu/kvm_cpu_attn_ref.h"
#include "kernels/cpu/kvm_cpu_clones.h"
#include "model/kvm_capture.h"
#include "model/kvm_forward.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_worker.h"
#include "proto/kvm_half.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t rng = 12345u;
static float frand(void) /* uniform in [-1, 1) */
{
    rng = rng * 1664525u + 1013904223u;
    return (float)((rng >> 8) & 0xffffff) / 8388608.0f - 1.0f;
}

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* ---- conversions ---- */

START_TEST(test_conversions_match_proto)
{
    /* every f16 bit pattern widens as the portable converter does (NaNs: both NaN) */
    static uint16_t h[65536];
    static float w[65536];
    for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    kvm_f16_widen(w, h, 65536);
    for (int i = 0; i < 65536; i++) {
        float r = kvm_half_f16_to_f32((uint16_t)i);
        if (isnan(r)) ck_assert_msg(isnan(w[i]), "f16 0x%04x: NaN widened to %g", i, (double)w[i]);
        else ck_assert_msg(bits(r) == bits(w[i]), "f16 0x%04x: %a, portable %a", i, (double)w[i], (double)r);
    }
    /* rounding: specials, the f16 range's edges, subnormals, ties, and random magnitudes */
    enum { N = 200000 };
    float *x = malloc(N * sizeof *x);
    uint16_t *y = malloc(N * sizeof *y);
    const float sp[] = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e9f, INFINITY, -INFINITY,
                        5.96e-8f, 2.98e-8f, 2.99e-8f, 6.1e-5f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 1e-30f};
    const int nsp = (int)(sizeof sp / sizeof sp[0]);
    for (int i = 0; i < N; i++) x[i] = i < nsp ? sp[i] : frand() * powf(2.0f, (float)(i % 44) - 28.0f);
    kvm_f16_round(y, x, N);
    for (int i = 0; i < N; i++)
        ck_assert_msg(y[i] == kvm_half_f32_to_f16(x[i]), "%a: 0x%04x, portable 0x%04x", (double)x[i], y[i],
                      kvm_half_f32_to_f16(x[i]));
    free(x);
    free(y);
}
END_TEST

/* ---- the attention kernel ---- */

/* One random ragged layer: n_kv heads of up to 150 entries (distilled first, then positions),
 * β on some heads, f16 copies of K/V and float32 copies of the widened values. */
typedef struct rand_layer {
    int nkv, grp, d;
    int64_t n_e[4];
    float *k[4], *v[4], *bias[4];
    uint16_t *k16[4], *v16[4];
    int32_t *pos[4];
} rand_layer;

static void rand_layer_new(rand_layer *r, int nkv, int grp, int d)
{
    *r = (rand_layer){.nkv = nkv, .grp = grp, .d = d};
    for (int g = 0; g < nkv; g++) {
        int64_t n = 40 + 37 * g, nd = g % 2 ? 3 : 0; /* ragged, distilled entries on odd heads */
        r->n_e[g] = n;
        r->k[g] = malloc((size_t)(n * d) * sizeof(float));
        r->v[g] = malloc((size_t)(n * d) * sizeof(float));
        r->k16[g] = malloc((size_t)(n * d) * sizeof(uint16_t));
        r->v16[g] = malloc((size_t)(n * d) * sizeof(uint16_t));
        r->pos[g] = malloc((size_t)n * sizeof(int32_t));
        r->bias[g] = malloc((size_t)n * sizeof(float));
        for (int64_t i = 0; i < n * d; i++) {
            r->k[g][i] = 2.0f * frand();
            r->v[g][i] = frand();
        }
        kvm_f16_round(r->k16[g], r->k[g], n * d);
        kvm_f16_round(r->v16[g], r->v[g], n * d);
        kvm_f16_widen(r->k[g], r->k16[g], n * d); /* float32 entries of the same values */
        kvm_f16_widen(r->v[g], r->v16[g], n * d);
        for (int64_t e = 0; e < n; e++) {
            r->pos[g][e] = e < nd ? KVM_POS_NONE : (int32_t)(e - nd) * 2; /* gaps: an evicted cache */
            r->bias[g][e] = g == 1 ? 0.5f * frand() : 0.0f;
        }
    }
}

static void rand_layer_free(rand_layer *r)
{
    for (int g = 0; g < r->nkv; g++) {
        free(r->k[g]); free(r->v[g]); free(r->k16[g]); free(r->v16[g]); free(r->pos[g]); free(r->bias[g]);
    }
}

/* Runs the kernel on r's entries as dtype with n_q queries at positions 0, 3, 6, ... and every
 * statistic; returns the outputs and statistics in one malloc'ed buffer of *n floats. */
static float *run_attention(const rand_layer *r, kvm_kv_dtype dtype, int64_t n_q, unsigned stats, size_t *n)
{
    const int H = r->nkv * r->grp, d = r->d;
    const int64_t ld_e = 160, n_obs = n_q < 3 ? n_q : 3;
    float *q = malloc((size_t)(n_q * H * d) * sizeof *q);
    int32_t *qpos = malloc((size_t)n_q * sizeof *qpos);
    rng = 777u;
    for (int64_t i = 0; i < n_q * H * d; i++) q[i] = frand();
    for (int64_t i = 0; i < n_q; i++) qpos[i] = (int32_t)(n_q <= 2 ? 200 + i : 3 * i);
    *n = (size_t)(n_q * H * d + H * ld_e + 2 * H * n_q + H * n_obs * ld_e);
    float *o = calloc(*n, sizeof *o);
    float *mass = o + n_q * H * d, *ent = mass + H * ld_e, *lse = ent + H * n_q, *obs = lse + H * n_q;
    kvm_attn_layer a = {.n_heads = H, .n_kv_heads = r->nkv, .head_dim = d, .scale = 1.0f / sqrtf((float)d), .q = q,
                        .ldq = H * d, .qpos = qpos, .n_q = n_q, .kv_dtype = dtype,
                        .k = dtype == KVM_KV_F32 ? (const float *const *)r->k : NULL,
                        .v = dtype == KVM_KV_F32 ? (const float *const *)r->v : NULL,
                        .k16 = dtype == KVM_KV_F16 ? (const uint16_t *const *)r->k16 : NULL,
                        .v16 = dtype == KVM_KV_F16 ? (const uint16_t *const *)r->v16 : NULL,
                        .pos = (const int32_t *const *)r->pos, .bias = (const float *const *)r->bias, .n_e = r->n_e,
                        .out = o, .ldo = H * d, .stats = stats, .mass_p0 = 0, .mass_p1 = 1 << 30, .n_obs = n_obs,
                        .ld_e = ld_e, .mass = mass, .entropy = ent, .lse = lse, .obs = obs};
    ck_assert_msg(kvm_kernels_cpu()->attention(&a) == 0, "%s", kvm_errmsg());
    free(q);
    free(qpos);
    return o;
}

/* Both widenings of f16 (decode's F16C path where kvm__attn_f16c, and the cloned integer one)
 * against float32 entries of the same values, bit for bit. */
START_TEST(test_attention_f16_bitwise)
{
    const unsigned all = KVM_ATTN_STAT_MASS | KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_LSE | KVM_ATTN_STAT_OBS;
    const int dims[] = {8, 64, 128, 20}; /* stories260K's, SmolLM2's, Qwen/Llama's, one not a multiple of 8 */
    const int grps[] = {1, 7, 6, 5};     /* query heads per KV head: decode's row blocks of 1, 4 + 3, 4 + 2, 4 + 1 */
    const int64_t nqs[] = {1, 2, 70, 130};
    const int v3 = _i; /* 1: F16C where the processor and build have it; 0: the integer widening */
    const int was = kvm__cpu_v3_set(v3);
    if (v3 && !kvm__attn_f16c())
        printf("SKIP: no F16C decode path in this build or processor (the integer widening runs)\n");
    if (!v3) ck_assert_int_eq(kvm__attn_f16c(), 0); /* kvm__cpu_v3_set(0) turns it off */
    for (int di = 0; di < 4; di++) {
        rand_layer r;
        rng = 99u + (uint32_t)di;
        rand_layer_new(&r, 3, grps[di], dims[di]);
        for (int qi = 0; qi < 4; qi++)
            for (int st = 0; st < 2; st++) {
                size_t n32, n16;
                float *a = run_attention(&r, KVM_KV_F32, nqs[qi], st ? all : 0, &n32);
                float *b = run_attention(&r, KVM_KV_F16, nqs[qi], st ? all : 0, &n16);
                ck_assert_uint_eq(n32, n16);
                size_t first = 0;
                while (first < n32 && bits(a[first]) == bits(b[first])) first++;
                if (dims[di] % 8) { /* decode's scalar tail columns: the compiler may contract the two
                                       loops' multiply-adds differently, so within rounding only */
                    for (size_t i = 0; i < n32; i++)
                        ck_assert_msg(fabsf(a[i] - b[i]) <= 1e-6f * (1.0f + fabsf(a[i])), "d %d: %g vs %g", dims[di],
                                      (double)a[i], (double)b[i]);
                    first = n32;
                }
                ck_assert_msg(first == n32, "d %d, n_q %lld, stats %d: f16 differs from float32 at %zu of %zu (%a vs %a)",
                              dims[di], (long long)nqs[qi], st, first, n32, first < n32 ? (double)a[first] : 0.0,
                              first < n32 ? (double)b[first] : 0.0);
                free(a);
                free(b);
            }
        rand_layer_free(&r);
    }
    kvm__cpu_v3_set(was);
}
END_TEST

START_TEST(test_attention_refusals)
{
    rand_layer r;
    rand_layer_new(&r, 1, 2, 8);
    float q[16] = {0}, o[16];
    int32_t qpos[1] = {5};
    kvm_attn_layer a = {.n_heads = 2, .n_kv_heads = 1, .head_dim = 8, .scale = 0.35f, .q = q, .ldq = 16, .qpos = qpos,
                        .n_q = 1, .kv_dtype = KVM_KV_F16, .k16 = (const uint16_t *const *)r.k16,
                        .v16 = (const uint16_t *const *)r.v16, .pos = (const int32_t *const *)r.pos, .n_e = r.n_e,
                        .out = o, .ldo = 16};
    ck_assert_int_eq(kvm_kernels_cpu()->attention(&a), 0);
    /* the per-head reference kernel is float32 only */
    ck_assert_int_eq(kvm_cpu_attention_ref(&a), KVM_ENOTSUP);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "kv_dtype f16"));
    kvm_attn_layer b = a;
    b.v16 = NULL;
    ck_assert_int_eq(kvm_kernels_cpu()->attention(&b), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "k16/v16"));
    b = a;
    b.kv_dtype = (kvm_kv_dtype)7;
    ck_assert_int_eq(kvm_kernels_cpu()->attention(&b), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "unknown KV element type 7"));
    /* CUDA refuses f16 entries: its forward keeps its own float32 cache */
    const kvm_kernels *cu = kvm_kernels_cuda(0);
    if (!cu) printf("SKIP: no CUDA device (the CUDA attention's f16 refusal not run)\n");
    else {
        ck_assert_int_eq(cu->attention(&a), KVM_ENOTSUP);
        ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "kv_dtype f16 is CPU-only"));
    }
    rand_layer_free(&r);
}
END_TEST

/* ---- the cache ---- */

/* Head h's keys and values as float32 (widened from f16). */
static void head_floats(const kvm_kv_head *h, int d, float *k, float *v)
{
    for (int64_t e = 0; e < h->n; e++) kvm_kvcache_read(h, d, e, k + e * d, v + e * d);
}

START_TEST(test_cache_round_trips)
{
    const int L = 2, G = 3, d = 12, n = 50;
    kvm_kvcache *c16, *c32;
    ck_assert_int_eq(kvm_kvcache_new_dtype(L, G, d, 4, KVM_KV_F16, &c16), 0);
    ck_assert_int_eq(kvm_kvcache_new_dtype(L, G, d, 4, KVM_KV_F32, &c32), 0);
    ck_assert_int_eq(c16->dtype, KVM_KV_F16);
    float k[12], v[12];
    rng = 5u;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < G; g++)
            for (int e = 0; e < n - g; e++) { /* ragged; appends grow past the reserve */
                for (int i = 0; i < d; i++) k[i] = 100.0f * frand(), v[i] = frand();
                ck_assert_int_eq(kvm_kvcache_append(kvm_kvcache_head(c16, l, g), d, k, v, e, 0.25f * (float)g), 0);
                ck_assert_int_eq(kvm_kvcache_append(kvm_kvcache_head(c32, l, g), d, k, v, e, 0.25f * (float)g), 0);
            }
    ck_assert_ptr_null(kvm_kvcache_head(c16, 0, 0)->k);
    ck_assert_int_eq(kvm_kvcache_bytes(c16), kvm_kvcache_entries(c16) * (2 * d * 2 + 8));
    ck_assert_int_eq(kvm_kvcache_bytes(c32), kvm_kvcache_entries(c32) * (2 * d * 4 + 8));
    /* append rounds: the f16 head holds the f32 head's values rounded once */
    static float a[60 * 12], b[60 * 12], a2[60 * 12], b2[60 * 12];
    for (int i = 0; i < L * G; i++) {
        const kvm_kv_head *h16 = &c16->heads[i], *h32 = &c32->heads[i];
        head_floats(h16, d, a, b);
        for (int64_t j = 0; j < h32->n * d; j++) {
            ck_assert_uint_eq(bits(a[j]), bits(kvm_half_f16_to_f32(kvm_half_f32_to_f16(h32->k[j]))));
            ck_assert_uint_eq(bits(b[j]), bits(kvm_half_f16_to_f32(kvm_half_f32_to_f16(h32->v[j]))));
        }
    }
    /* convert f32 -> f16 gives the appended f16 cache bit for bit; f16 -> f32 -> f16 too */
    kvm_kvcache *t;
    ck_assert_int_eq(kvm_kvcache_clone(c32, &t), 0);
    ck_assert_int_eq(kvm_kvcache_convert(t, KVM_KV_F16), 0);
    for (int i = 0; i < L * G; i++) {
        ck_assert_int_eq(t->heads[i].n, c16->heads[i].n);
        ck_assert_mem_eq(t->heads[i].k16, c16->heads[i].k16, (size_t)(t->heads[i].n * d) * 2);
        ck_assert_mem_eq(t->heads[i].v16, c16->heads[i].v16, (size_t)(t->heads[i].n * d) * 2);
        ck_assert_mem_eq(t->heads[i].bias, c16->heads[i].bias, (size_t)t->heads[i].n * 4);
        ck_assert_ptr_null(t->heads[i].k);
    }
    ck_assert_int_eq(kvm_kvcache_convert(t, KVM_KV_F32), 0);
    ck_assert_int_eq(kvm_kvcache_convert(t, KVM_KV_F16), 0);
    for (int i = 0; i < L * G; i++) ck_assert_mem_eq(t->heads[i].k16, c16->heads[i].k16, (size_t)(t->heads[i].n * d) * 2);
    kvm_kvcache_free(&t);
    ck_assert_int_eq(kvm_kvcache_convert(c16, (kvm_kv_dtype)3), KVM_EINVAL);
    /* clone keeps f16 bits */
    ck_assert_int_eq(kvm_kvcache_clone(c16, &t), 0);
    ck_assert_int_eq(t->dtype, KVM_KV_F16);
    for (int i = 0; i < L * G; i++) {
        ck_assert_mem_eq(t->heads[i].k16, c16->heads[i].k16, (size_t)(t->heads[i].n * d) * 2);
        ck_assert_mem_eq(t->heads[i].pos, c16->heads[i].pos, (size_t)t->heads[i].n * 4);
    }
    /* keep and drop on f16 move whole entries */
    kvm_kv_head *h = kvm_kvcache_head(t, 1, 2);
    const kvm_kv_head *src = kvm_kvcache_head(c16, 1, 2);
    int64_t keep[] = {0, 3, 4, 10, 47};
    ck_assert_int_eq(kvm_kvcache_keep(h, d, keep, 5), 0);
    ck_assert_int_eq(kvm_kvcache_keep(h, d, (int64_t[]){2, 1}, 2), KVM_EINVAL);
    kvm_kvcache_drop(h, d, 1); /* entries 0, 4, 10, 47 of the source remain */
    ck_assert_int_eq(h->n, 4);
    const int64_t left[] = {0, 4, 10, 47};
    for (int e = 0; e < 4; e++) {
        ck_assert_mem_eq(h->k16 + e * d, src->k16 + left[e] * d, (size_t)d * 2);
        ck_assert_mem_eq(h->v16 + e * d, src->v16 + left[e] * d, (size_t)d * 2);
        ck_assert_int_eq(h->pos[e], src->pos[left[e]]);
    }
    /* copy_layer converts between types: f16 -> f32 widens exactly, back rounds to the same bits */
    kvm_kvcache *w;
    ck_assert_int_eq(kvm_kvcache_new(L, G, d, 0, &w), 0);
    ck_assert_int_eq(kvm_kvcache_copy_layer(w, c16, 1), 0);
    ck_assert_int_eq(kvm_kvcache_copy_layer(t, w, 1), 0);
    for (int g = 0; g < G; g++) {
        const kvm_kv_head *x = kvm_kvcache_head(c16, 1, g), *y = kvm_kvcache_head(w, 1, g), *z = kvm_kvcache_head(t, 1, g);
        head_floats(x, d, a, b);
        head_floats(y, d, a2, b2);
        ck_assert_mem_eq(a, a2, (size_t)(x->n * d) * 4);
        ck_assert_mem_eq(b, b2, (size_t)(x->n * d) * 4);
        ck_assert_int_eq(z->n, x->n);
        ck_assert_mem_eq(z->k16, x->k16, (size_t)(x->n * d) * 2);
    }
    kvm_kvcache_free(&w);
    kvm_kvcache_free(&t);
    kvm_kvcache_free(&c16);
    kvm_kvcache_free(&c32);
}
END_TEST

START_TEST(test_codec_f16)
{
    const int L = 2, G = 2, d = 8;
    kvm_kvcache *c16;
    ck_assert_int_eq(kvm_kvcache_new_dtype(L, G, d, 0, KVM_KV_F16, &c16), 0);
    float k[8], v[8];
    rng = 6u;
    for (int i = 0; i < L * G; i++)
        for (int e = 0; e < 20 + i; e++) {
            for (int j = 0; j < d; j++) k[j] = frand(), v[j] = frand();
            ck_assert_int_eq(kvm_kvcache_append(&c16->heads[i], d, k, v, e == 0 ? KVM_POS_NONE : e, 0.1f * (float)e), 0);
        }
    c16->next_pos = 30;
    const kvm_proto_dtype dts[] = {KVM_PROTO_F16, KVM_PROTO_F32, KVM_PROTO_BF16};
    for (int t = 0; t < 3; t++)
        for (int into16 = 0; into16 < 2; into16++) {
            kvm_kvcache *r;
            ck_assert_int_eq(kvm_kvcache_new_dtype(L, G, d, 0, into16 ? KVM_KV_F16 : KVM_KV_F32, &r), 0);
            for (int l = 0; l < L; l++) {
                kvm_msg *m;
                ck_assert_int_eq(kvm_cachecodec_encode_layer(c16, l, 30, dts[t], &m), 0);
                ck_assert_int_eq(kvm_cachecodec_decode_layer(m, l, r), 0);
                kvm_msg_free(&m);
            }
            for (int i = 0; i < L * G; i++) {
                const kvm_kv_head *a = &c16->heads[i], *b = &r->heads[i];
                ck_assert_int_eq(a->n, b->n);
                ck_assert_mem_eq(a->pos, b->pos, (size_t)a->n * 4);
                for (int64_t e = 0; e < a->n; e++) {
                    float ka[8], kb[8];
                    kvm_kvcache_read(a, d, e, ka, NULL);
                    kvm_kvcache_read(b, d, e, kb, NULL);
                    for (int j = 0; j < d; j++)
                        if (dts[t] == KVM_PROTO_BF16) /* bf16 frames round: 2^-9 relative */
                            ck_assert_float_le(fabsf(ka[j] - kb[j]), fabsf(ka[j]) * 0x1p-8f);
                        else /* f16 and f32 frames hold an f16 cache exactly */
                            ck_assert_uint_eq(bits(ka[j]), bits(kb[j]));
                }
            }
            kvm_kvcache_free(&r);
        }
    kvm_kvcache_free(&c16);
}
END_TEST

/* ---- the model ---- */

static kvm_model *model;
static int32_t ids[256];

static void load_model(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void free_model(void) { kvm_model_close(&model); }

/* KL(p || q) in nats of two logit rows (the harness's kvm_eval_kl), and the largest
 * |difference| of the logits into *max_abs. */
static double kl_rows(const float *p, const float *q, int n, double *max_abs)
{
    for (int i = 0; i < n; i++) {
        double d = fabs((double)p[i] - q[i]);
        if (d > *max_abs) *max_abs = d;
    }
    return kvm_eval_kl(p, q, n);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++) b = x[i] > x[b] ? i : b;
    return b;
}

/* Logits of tokens[0, n): the first n_pre by one prefill, the rest decoded one by one, on a
 * cache of dtype. */
static float *model_logits(kvm_model *m, const int32_t *tokens, int n, int n_pre, kvm_kv_dtype dtype)
{
    const int V = m->cfg.vocab_size;
    float *lg = malloc((size_t)n * (size_t)V * sizeof *lg);
    kvm_forward *f;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_new(m, NULL, 0, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new_dtype(m, n, dtype, &c), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c, tokens, n_pre, lg, KVM_LOGITS_ALL), 0);
    for (int t = n_pre; t < n; t++) ck_assert_int_eq(kvm_forward_decode(f, c, tokens[t], lg + (size_t)t * V), 0);
    ck_assert_int_eq(c->dtype, dtype);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
    return lg;
}

/* Compares f16-cache logits b with float32-cache logits a over n positions; prints the figures. */
static void compare_logits(const char *what, const float *a, const float *b, int n, int V, double kl_max_bound,
                           double abs_bound, int min_argmax)
{
    double kl_sum = 0, kl_max = 0, mx = 0;
    int same = 0;
    for (int t = 0; t < n; t++) {
        double kl = kl_rows(a + (size_t)t * V, b + (size_t)t * V, V, &mx);
        kl_sum += kl;
        kl_max = kl > kl_max ? kl : kl_max;
        same += argmax(a + (size_t)t * V, V) == argmax(b + (size_t)t * V, V);
    }
    printf("%s, f16 vs f32 KV cache, %d positions: KL mean %.3g max %.3g nats, max |dlogit| %.3g, argmax equal at %d\n",
           what, n, kl_sum / n, kl_max, mx, same);
    ck_assert_msg(kl_max < kl_max_bound, "%s: KL max %g", what, kl_max);
    ck_assert_msg(mx < abs_bound, "%s: max |dlogit| %g", what, mx);
    ck_assert_int_ge(same, min_argmax);
}

START_TEST(test_stories_logits)
{
    /* 128 prefilled (the packed f16 panels), 128 decoded (the direct f16 reads) */
    float *a = model_logits(model, ids, 256, 128, KVM_KV_F32), *b = model_logits(model, ids, 256, 128, KVM_KV_F16);
    compare_logits("stories260K", a, b, 256, 512, 1e-4, 0.1, 250);
    free(a);
    free(b);
}
END_TEST

START_TEST(test_smol_logits)
{
#ifdef __SANITIZE_ADDRESS__
    printf("SKIP: SmolLM2 f16-cache logits (ASan build: the f16 paths run under ASan on stories260K here)\n");
    return;
#endif
    FILE *fp = fopen("models/SmolLM2-135M-Instruct.Q4_1.gguf", "rb");
    if (!fp) {
        printf("SKIP: models/SmolLM2-135M-Instruct.Q4_1.gguf absent (scripts/get-model.sh): SmolLM2 f16 cache not checked\n");
        return;
    }
    fclose(fp);
    kvm_model *m;
    ck_assert_int_eq(kvm_model_open("models/SmolLM2-135M-Instruct.Q4_1.gguf", &m), 0);
    int32_t tk[256];
    int n = 0;
    FILE *f = fopen("tests/data/smollm2/seq256.ids", "r");
    ck_assert_ptr_nonnull(f);
    char line[64];
    while (n < 256 && fgets(line, sizeof line, f))
        if (line[0] != '#') tk[n++] = atoi(line);
    fclose(f);
    ck_assert_int_eq(n, 256);
    /* 240 prefilled, 16 decoded: SmolLM2's decode steps are what costs time here */
    float *a = model_logits(m, tk, 256, 240, KVM_KV_F32), *b = model_logits(m, tk, 256, 240, KVM_KV_F16);
    compare_logits("SmolLM2 Q4_1", a, b, 256, m->cfg.vocab_size, 3e-5, 0.08, 250);
    free(a);
    free(b);
    kvm_model_close(&m);
}
END_TEST

/* An evicted, ragged cache with β and distilled entries decoded on f32 and f16 under each
 * eviction pattern's decode policy: the same positions are kept and the logits agree. */
START_TEST(test_ragged_decode_policies)
{
    enum { N_CTX = 64, T = 12 };
    const int V = 512, L = model->cfg.n_layers, G = model->cfg.n_kv_heads, d = model->cfg.head_dim;
    kvm_forward *f;
    kvm_kvcache *full;
    kvm_capture *cap;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    ck_assert_int_eq(kvm_forward_new(model, NULL, N_CTX, &f), 0);
    ck_assert_int_eq(kvm_capture_new(&model->cfg, N_CTX, &co, &cap), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, 64, &full), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, full, ids, N_CTX, NULL, KVM_LOGITS_NONE), 0);
    kvm_forward_clear_hooks(f);
    kvm_compress_input in = {.model = model, .full = full, .cap = cap, .n_tokens = N_CTX, .n_future = 16};
    float *la = malloc(T * V * sizeof *la), *lb = malloc(T * V * sizeof *lb);
    for (int p = 0; p < KVM_PATTERN_COUNT; p++) {
        kvm_evict_plan *pl;
        kvm_kvcache *c[2];
        ck_assert_int_eq(kvm_evict_plan_new(L, G, (kvm_pattern)p, 20, &pl), 0);
        ck_assert_int_eq(kvm_evict_prefill(&in, pl, &c[0]), 0);
        /* a distilled entry with β in front of every head of layer 1 (as KVSculpt writes them) */
        for (int g = 0; g < G; g++) {
            kvm_kv_head *h = kvm_kvcache_head(c[0], 1, g);
            float k[64], v[64];
            kvm_kvcache_read(h, d, 0, k, v);
            ck_assert_int_eq(kvm_kvcache_reserve(h, d, h->n + 1), 0);
            memmove(h->k + d, h->k, (size_t)(h->n * d) * 4);
            memmove(h->v + d, h->v, (size_t)(h->n * d) * 4);
            memmove(h->pos + 1, h->pos, (size_t)h->n * 4);
            memmove(h->bias + 1, h->bias, (size_t)h->n * 4);
            for (int i = 0; i < d; i++) h->k[i] = 0.5f * k[i], h->v[i] = v[i];
            h->pos[0] = KVM_POS_NONE;
            h->bias[0] = 0.7f;
            h->n++;
        }
        ck_assert_int_eq(kvm_kvcache_clone(c[0], &c[1]), 0);
        ck_assert_int_eq(kvm_kvcache_convert(c[1], KVM_KV_F16), 0);
        for (int k = 0; k < 2; k++) {
            kvm_decode_policy *pol;
            ck_assert_int_eq(kvm_evict_decode_new(&model->cfg, pl, &in, &pol), 0);
            ck_assert_int_eq(kvm_forward_add_hooks(f, &pol->hooks), 0);
            for (int t = 0; t < T; t++)
                ck_assert_int_eq(kvm_forward_decode(f, c[k], ids[N_CTX + t], (k ? lb : la) + t * V), 0);
            kvm_forward_clear_hooks(f);
            kvm_decode_policy_free(&pol);
        }
        double mx = 0, klm = 0;
        for (int t = 0; t < T; t++) {
            double kl = kl_rows(la + t * V, lb + t * V, V, &mx);
            klm = kl > klm ? kl : klm;
            ck_assert_int_eq(argmax(la + t * V, V), argmax(lb + t * V, V));
        }
        for (int i = 0; i < L * G; i++) {
            ck_assert_int_eq(c[0]->heads[i].n, c[1]->heads[i].n);
            ck_assert_mem_eq(c[0]->heads[i].pos, c[1]->heads[i].pos, (size_t)c[0]->heads[i].n * 4);
        }
        printf("decode policy %d on f16: KL max %.3g, max |dlogit| %.3g over %d steps\n", p, klm, mx, T);
        ck_assert_double_lt(klm, 1e-4);
        kvm_kvcache_free(&c[0]);
        kvm_kvcache_free(&c[1]);
        kvm_evict_plan_free(&pl);
    }
    /* refusals: compression and KVSculpt read the float32 full cache, the sculpt file writes float32 */
    kvm_kvcache *full16, *out = NULL;
    ck_assert_int_eq(kvm_kvcache_clone(full, &full16), 0);
    ck_assert_int_eq(kvm_kvcache_convert(full16, KVM_KV_F16), 0);
    kvm_compress_input in16 = in;
    in16.full = full16;
    kvm_sculpt_opts so = kvm_sculpt_opts_default();
    ck_assert_int_eq(kvm_sculpt_compress(&in16, &so, &out, NULL), KVM_ENOTSUP);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "kv_dtype = f16"));
    ck_assert_ptr_null(out);
    kvm_config *cfg;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = m\n[compress]\nmethod = streaming\nbudget = 16\n", "kv16.ini", &cfg), 0);
    ck_assert_int_eq(kvm_worker_compress(cfg, &in16, NULL, NULL, &out), KVM_ENOTSUP);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "compression reads float32"));
    ck_assert_int_eq(kvm_worker_compress(cfg, &in, NULL, NULL, &out), 0); /* the float32 control */
    kvm_kvcache_free(&out);
    kvm_config_free(&cfg);
    char *dir = kvm_test_tmpdir(), path[4096];
    snprintf(path, sizeof path, "%s/c.sculpt", dir);
    ck_assert_int_eq(kvm_sculpt_cache_write(path, full16), KVM_ENOTSUP);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "c.sculpt"));
    ck_assert_int_eq(kvm_sculpt_cache_write(path, full), 0);
    kvm_test_rmtree(dir);
    free(dir);
    kvm_kvcache_free(&full16);
    free(la);
    free(lb);
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
}
END_TEST

/* ---- the CLI ---- */

static int kvmill(char **out, char **err, const char *fmt, const char *a, const char *b)
{
    char args[4096], cmd[8192];
    snprintf(args, sizeof args, fmt, a, b);
    snprintf(cmd, sizeof cmd, "%s/kvmill %s", kvm_test_bin(), args);
    return kvm_test_run(cmd, out, err);
}

/* run.c's greedy golden texts (stories260K, 200 positions) with an f16 cache. A text may differ
 * from the golden one only after a near-tie: teacher-forced on the golden ids (the prompt
 * prefilled, the rest decoded as generate does), every position where the f16 cache's argmax
 * differs from the float32 cache's must have float32 logits of the two tokens within
 * NEAR_TIE (nats) of each other: about twice the largest |Δlogit| measured on stories260K
 * (0.027), i.e. as far as two logits can move towards each other. */
enum { GOLD_N = 201 };
#define NEAR_TIE 0.06

START_TEST(test_generate_golden_f16)
{
    if (!kvm_test_shared_path("golden/gen")) return;
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s", kvm_test_data_path("models/stories260K.bin"));
    int equal = 0, flips = 0;
    double worst = 0;
    for (int i = 0; i < 4; i++) {
        char rel[64], *cmdf, *out = NULL, *err = NULL;
        snprintf(rel, sizeof rel, "golden/gen/gen_%02d.cmd", i);
        cmdf = kvm_test_read_file(kvm_test_shared_path(rel), NULL);
        ck_assert_ptr_nonnull(cmdf);
        char *p = strstr(cmdf, "-i \"");
        ck_assert_ptr_nonnull(p);
        p += 4;
        *strchr(p, '"') = 0;
        int rc = kvmill(&out, &err, "generate --model '%s' --temperature 0 -n 200 --kv-dtype f16 --prompt '%s'", mpath, p);
        ck_assert_msg(rc == 0, "gen_%02d: %s", i, err);
        snprintf(rel, sizeof rel, "golden/gen/gen_%02d.txt", i);
        char *gold = kvm_test_read_file(kvm_test_shared_path(rel), NULL);
        ck_assert_ptr_nonnull(gold);
        equal += !strcmp(out, gold);
        /* teacher-forced on the golden ids */
        snprintf(rel, sizeof rel, "golden/gen/gen_%02d.ids.txt", i);
        char *idt = kvm_test_read_file(kvm_test_shared_path(rel), NULL), *q = idt;
        ck_assert_ptr_nonnull(idt);
        int32_t g[GOLD_N];
        int n = 0;
        while (n < GOLD_N && *q) {
            g[n++] = (int32_t)strtol(q, &q, 10);
            while (*q == '\n') q++;
        }
        ck_assert_int_eq(n, GOLD_N);
        float *a = model_logits(model, g, n - 1, 8, KVM_KV_F32), *b = model_logits(model, g, n - 1, 8, KVM_KV_F16);
        for (int t = 0; t < n - 1; t++) {
            const float *la = a + (size_t)t * 512, *lb = b + (size_t)t * 512;
            int x = argmax(la, 512), y = argmax(lb, 512);
            if (x == y) continue;
            flips++;
            double gap = (double)la[x] - la[y];
            worst = gap > worst ? gap : worst;
            ck_assert_msg(gap < NEAR_TIE, "gen_%02d position %d: f16 picks %d over %d, float32 logits %.4f apart", i, t,
                          y, x, gap);
        }
        if (strcmp(out, gold)) ck_assert_msg(flips > 0, "gen_%02d differs without an argmax flip", i);
        free(a);
        free(b);
        free(idt);
        free(gold);
        free(cmdf);
        free(out);
        free(err);
    }
    printf("greedy golden texts with --kv-dtype f16: %d of 4 byte-identical; %d teacher-forced argmax flips, each at a "
           "near-tie (float32 logits at most %.4f apart)\n", equal, flips, worst);
}
END_TEST

START_TEST(test_cli_refusals)
{
    char mpath[4096];
    snprintf(mpath, sizeof mpath, "%s", kvm_test_data_path("models/stories260K.bin"));
    char *out = NULL, *err = NULL;
    ck_assert_int_eq(kvmill(&out, &err, "generate --model '%s' --kv-dtype bf16 --prompt '%s'", mpath, "Once"), 2);
    ck_assert_ptr_nonnull(strstr(err, "kvmill generate: --kv-dtype: kv_dtype 'bf16': expected f32 or f16"));
    free(out), free(err);
    ck_assert_int_eq(kvmill(&out, &err, "generate --model '%s' --kv-dtype f16 --device cuda:0 --prompt '%s'", mpath, "x"), 2);
    ck_assert_ptr_nonnull(strstr(err, "--kv-dtype f16 is for the CPU forward"));
    free(out), free(err);
    /* eval's compression paths read float32 caches: it has no such flag */
    ck_assert_int_ne(kvmill(&out, &err, "eval --model '%s' --kv-dtype f16 %s", mpath, ""), 0);
    ck_assert_ptr_nonnull(strstr(err, "kv-dtype"));
    free(out), free(err);
    /* the config key: one name, its values checked */
    kvm_config *cfg;
    ck_assert_int_ne(kvm_config_parse("[model]\npath = m\nkv_dtype = bf16\n", "bad.ini", &cfg), 0);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "kv_dtype"));
    ck_assert_int_eq(kvm_config_parse("[model]\npath = m\nkv_dtype = f16\n", "ok.ini", &cfg), 0);
    kvm_kv_dtype dt;
    ck_assert_int_eq(kvm_kvcache_dtype_parse(kvm_config_str(cfg, "model", "kv_dtype"), &dt), 0);
    ck_assert_int_eq(dt, KVM_KV_F16);
    kvm_config_free(&cfg);
    ck_assert_int_eq(kvm_kvcache_dtype_parse("F16", &dt), KVM_EINVAL);
    ck_assert_str_eq(kvm_kvcache_dtype_name(KVM_KV_F16), "f16");
}
END_TEST

static Suite *kv16_suite(void)
{
    Suite *s = suite_create("kv16");
    struct {
        const char *name;
        const TTest *fn;
        int model;
    } cases[] = {{"conversions", test_conversions_match_proto, 0},
                 {"attention_bitwise", test_attention_f16_bitwise, 0},
                 {"attention_refusals", test_attention_refusals, 0},
                 {"cache_round_trips", test_cache_round_trips, 0},
                 {"codec", test_codec_f16, 0},
                 {"stories_logits", test_stories_logits, 1},
                 {"smol_logits", test_smol_logits, 0},
                 {"ragged_decode_policies", test_ragged_decode_policies, 1},
                 {"generate_golden", test_generate_golden_f16, 1},
                 {"cli_refusals", test_cli_refusals, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        if (cases[i].model) tcase_add_checked_fixture(tc, load_model, free_model);
        tcase_set_timeout(tc, 300);
        if (cases[i].fn == test_attention_f16_bitwise)
            tcase_add_loop_test(tc, cases[i].fn, 0, 2); /* _i: F16C off, on */
        else
            tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(kv16_suite()); }
