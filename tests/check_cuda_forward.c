/* check_cuda_forward.c: the CUDA forward (kernels/cuda/, model/kvm_forward_cuda.h) against the CPU
 * forward on stories260K and ../shared/golden's sequence (the embedded copy of its ids where
 * ../shared is absent): logits with float32 weights (max|Δ|/max|ref| ≤ 1e-4) and bf16 (≤ 2e-2),
 * chunked prefill, K/V capture, the attention statistics (entropy, key mass over a window,
 * last-query probabilities) against the CPU's probabilities, and decode over a ragged cache
 * with distilled entries and their bias β, and the device eviction (every pattern's kept sets
 * against kvm_evict_prefill's, keys at the cut within 1e-5 may swap; the decode phase's kept
 * positions against kvm_evict_decode_new's policy; `kvmill eval --device cuda:0` with --phases
 * prefill and both against the CPU's KL). Where no CUDA device exists (or the build has no
 * CUDA) it prints one "SKIP: no CUDA device" line and checks only that cuda:0 fails cleanly,
 * in the API and in `kvmill generate --device cuda:0`, and (CUDA builds) the quantized upload's
 * memory plan and refusals, which come before any device call. */
#include "model/kvm_forward.h"
#include "model/kvm_forward_cuda.h"
#ifdef KVM_WITH_CUDA
#include "compress/evict/kvm_evict.h"
#include "kernels/kvm_evict_body.h"
#include "kernels/kvm_quant_body.h"
#include "model/kvm_capture.h"
#endif
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 256, V = 512, L = 5, G = 4, HEADS = 8, D = 8, WIN = 16 };

/* ---- no device ---- */

START_TEST(test_no_device_fails_cleanly)
{
    const kvm_kernels *k = NULL;
    int rc = kvm_kernels_select("cuda:0", &k);
    ck_assert_msg(rc == KVM_EDEVICE, "cuda:0 gave %d: %s", rc, kvm_errmsg());
    ck_assert_msg(strstr(kvm_errmsg(), "no CUDA device") || strstr(kvm_errmsg(), "without CUDA"), "%s", kvm_errmsg());
    char *out = NULL, *err = NULL, cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s/kvmill' generate --model '%s' --device cuda:0 --prompt a -n 8", kvm_test_bin(),
             kvm_test_data_path("models/stories260K.bin"));
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_int_eq(st, 2);
    ck_assert_msg(strstr(err, "--device cuda:0") && (strstr(err, "no CUDA device") || strstr(err, "without CUDA")),
                  "stderr: %s", err);
    free(out);
    free(err);
}
END_TEST

/* the host forward refuses a backend whose memory is not host memory, instead of handing it
 * host pointers (eval, sculpt, calibrate and the stages build that forward) */
START_TEST(test_host_forward_refuses_device_table)
{
    kvm_model *m;
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &m), 0);
    kvm_kernels fake = *kvm_kernels_cpu();
    fake.name = "cuda";
    kvm_forward *f = NULL;
    ck_assert_int_eq(kvm_forward_new(m, &fake, 0, &f), KVM_ENOTSUP);
    ck_assert_ptr_null(f);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "only generate"));
    kvm_model_close(&m);
}
END_TEST

#ifdef KVM_WITH_CUDA
/* ---- the quantized upload's plan and refusals (no device needed: both come before any CUDA call) ---- */

enum { QD = 64, QH = 128, QV = 512, QL = 2 };

/* a stories-like shape whose matrices are all `type` rows over a zeroed buffer (never read here) */
static void quant_desc(kvm_cuda_model_desc *d, kvm_cuda_mat mats[7][QL], int type, const void *buf)
{
    *d = (kvm_cuda_model_desc){.n_layers = QL, .dim = QD, .n_heads = 8, .n_kv_heads = 4, .head_dim = 8,
                               .hidden_dim = QH, .vocab_size = QV, .norm_eps = 1e-5f, .rope_theta = 1e4f};
    for (int i = 0; i < 7; i++)
        for (int l = 0; l < QL; l++) mats[i][l] = (kvm_cuda_mat){.data = buf, .type = type};
    d->tok_emb = d->wcls = (kvm_cuda_mat){.data = buf, .type = type};
    d->wq = mats[0], d->wk = mats[1], d->wv = mats[2], d->wo = mats[3], d->w1 = mats[4], d->w2 = mats[5], d->w3 = mats[6];
}

/* the upload buffer is the largest matrix's file bytes (the [512][64] embedding: 512 rows of two
 * Q4_0 blocks, 18432 bytes), not its float32 values as for a random model (131072 bytes) */
START_TEST(test_upload_plan_counts_file_bytes)
{
    static uint8_t buf[1];
    kvm_cuda_model_desc q, r;
    kvm_cuda_mat mats[7][QL];
    quant_desc(&q, mats, KVM_QB_Q4_0, buf);
    quant_desc(&r, mats, KVM_QB_Q4_0, buf);
    r.tok_emb.data = NULL; /* random */
    for (int t = KVM_CUDA_F32; t <= KVM_CUDA_F16; t++) {
        size_t bq = kvm_cuda_model_bytes(&q, (kvm_cuda_wdtype)t, 64, 16), br = kvm_cuda_model_bytes(&r, (kvm_cuda_wdtype)t, 64, 16);
        ck_assert_msg(br - bq == (size_t)QV * QD * 4 - (size_t)QV * (QD / 32) * 18, "random %zu, Q4_0 %zu", br, bq);
    }
    kvm_cuda_mat m8[7][QL];
    kvm_cuda_model_desc q8;
    quant_desc(&q8, m8, KVM_QB_Q8_0, buf); /* 34 bytes per 32 elements */
    ck_assert_uint_eq(kvm_cuda_model_bytes(&q8, KVM_CUDA_BF16, 64, 16) - kvm_cuda_model_bytes(&q, KVM_CUDA_BF16, 64, 16),
                      (size_t)QV * (QD / 32) * (34 - 18));
}
END_TEST

/* a matrix type the device cannot dequantise, or rows that are not whole blocks, are refused
 * naming the matrix, before the plan or any allocation */
START_TEST(test_upload_refuses_what_it_cannot_dequantise)
{
    static uint8_t buf[1];
    kvm_cuda_model_desc d;
    kvm_cuda_mat mats[7][QL];
    quant_desc(&d, mats, KVM_QB_Q4_1, buf);
    mats[0][1].type = 10; /* Q2_K: layer 1's wq */
    kvm_cuda_model *m = NULL;
    ck_assert_int_eq(kvm_cuda_model_new(0, &d, KVM_CUDA_BF16, 64, 16, &m), KVM_ENOTSUP);
    ck_assert_msg(strstr(kvm_errmsg(), "layer 1 wq") && strstr(kvm_errmsg(), "type 10"), "%s", kvm_errmsg());
    ck_assert_ptr_null(m);
    mats[0][1].type = KVM_QB_Q4_K; /* 256-element blocks over rows of 64 */
    ck_assert_int_eq(kvm_cuda_model_new(0, &d, KVM_CUDA_BF16, 64, 16, &m), KVM_ENOTSUP);
    ck_assert_msg(strstr(kvm_errmsg(), "layer 1 wq") && strstr(kvm_errmsg(), "rows of 64"), "%s", kvm_errmsg());
    mats[0][1].type = KVM_QB_Q4_1;
    d.wcls.data = NULL; /* a file model without its classifier's bytes */
    ck_assert_int_eq(kvm_cuda_model_new(0, &d, KVM_CUDA_BF16, 64, 16, &m), KVM_ENOTSUP);
    ck_assert_msg(strstr(kvm_errmsg(), "classifier") && strstr(kvm_errmsg(), "no data"), "%s", kvm_errmsg());
    ck_assert_ptr_null(m);
}
END_TEST

/* ---- with a device ---- */

static int32_t ids[N];

static kvm_model *model;
static float *cpu_logits;
static kvm_kvcache *cpu_cache;

typedef struct cpu_stats {
    float ent[L][HEADS][N], mass[L][HEADS][N], last[L][HEADS][N];
} cpu_stats;
static cpu_stats *cst;

/* the CPU's statistics, as its per-layer kernel produces them (post_attn hook; CPU backend memory
 * is host memory) */
static int stats_hook(void *user, const kvm_attn_site *s)
{
    cpu_stats *c = user;
    const kvm_attn_layer *a = s->attn;
    for (int h = 0; h < HEADS; h++) {
        for (int64_t i = 0; i < s->n_q; i++) c->ent[s->layer][h][i] = a->entropy[h * s->n_q + i];
        for (int64_t j = 0; j < a->ld_e && j < N; j++) {
            c->mass[s->layer][h][j] = a->mass[h * a->ld_e + j];
            c->last[s->layer][h][j] = a->obs[(h * a->n_obs + a->n_obs - 1) * a->ld_e + j];
        }
    }
    return 0;
}

static void setup(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    ck_assert_int_eq(model->cfg.n_layers, L);
    kvm_test_golden_ids(ids);
    kvm_forward *f;
    cpu_logits = malloc((size_t)N * V * sizeof *cpu_logits);
    cst = calloc(1, sizeof *cst);
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    kvm_hooks h = {.user = cst, .post_attn = stats_hook, .stats = KVM_ATTN_STAT_MASS | KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_OBS,
                   .mass_p0 = N - WIN, .mass_p1 = N, .n_obs = 1};
    ck_assert_int_eq(kvm_forward_add_hooks(f, &h), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, N, &cpu_cache), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, cpu_cache, ids, N, cpu_logits, KVM_LOGITS_ALL), 0);
    kvm_forward_free(&f);
}

static void teardown(void)
{
    kvm_kvcache_free(&cpu_cache);
    kvm_model_close(&model);
    free(cpu_logits);
    free(cst);
}

static float rel_diff(const float *a, const float *ref, int64_t n)
{
    float d = 0, m = 0;
    for (int64_t i = 0; i < n; i++) d = fmaxf(d, fabsf(a[i] - ref[i])), m = fmaxf(m, fabsf(ref[i]));
    return m > 0 ? d / m : d;
}

static void check_logits(kvm_cuda_wdtype t, int64_t batch, float tol)
{
    kvm_cuda_model *m;
    ck_assert_msg(kvm_model_cuda_new(model, 0, t, N, batch, &m) == 0, "%s", kvm_errmsg());
    float *lg = malloc((size_t)N * V * sizeof *lg);
    ck_assert_msg(kvm_cuda_model_forward(m, ids, N, lg, 0, NULL) == 0, "%s", kvm_errmsg());
    float r = rel_diff(lg, cpu_logits, (int64_t)N * V);
    printf("cuda logits (%s, batch %lld): max|d|/max|ref| %.3g\n", t == KVM_CUDA_F32 ? "f32" : "bf16",
           (long long)batch, r);
    ck_assert_float_le(r, tol);
    const char *gold_path = kvm_test_shared_find("golden/seq256.logits.f32");
    if (t == KVM_CUDA_F32 && gold_path) { /* and run.c's own logits, as check_forward holds the CPU to */
        size_t bytes;
        float *gold = (float *)kvm_test_read_file(gold_path, &bytes), worst = 0;
        ck_assert_uint_eq(bytes, (size_t)N * V * 4);
        for (int64_t i = 0; i < (int64_t)N * V; i++) worst = fmaxf(worst, fabsf(lg[i] - gold[i]));
        printf("cuda logits vs run.c golden: max|d| %.3g\n", worst);
        ck_assert_float_le(worst, 2e-4f);
        free(gold);
    }
    ck_assert_int_eq(kvm_cuda_model_cache_len(m), N);
    free(lg);
    kvm_cuda_model_free(&m);
}

START_TEST(test_logits_f32) { check_logits(KVM_CUDA_F32, N, 1e-4f); }
END_TEST

START_TEST(test_logits_f32_chunked) { check_logits(KVM_CUDA_F32, 100, 1e-4f); }
END_TEST

START_TEST(test_logits_bf16) { check_logits(KVM_CUDA_BF16, N, 2e-2f); }
END_TEST

START_TEST(test_kv_capture)
{
    kvm_cuda_model *m;
    ck_assert_int_eq(kvm_model_cuda_new(model, 0, KVM_CUDA_F32, N, N, &m), 0);
    ck_assert_int_eq(kvm_cuda_model_forward(m, ids, N, NULL, 1, NULL), 0);
    static float k[N * D], v[N * D];
    float worst = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < G; g++) {
            const kvm_kv_head *h = kvm_kvcache_head(cpu_cache, l, g);
            ck_assert_int_eq(kvm_cuda_model_download_kv(m, l, g, k, v), 0);
            worst = fmaxf(worst, fmaxf(rel_diff(k, h->k, N * D), rel_diff(v, h->v, N * D)));
        }
    printf("cuda K/V capture: max|d|/max|ref| %.3g\n", worst);
    ck_assert_float_le(worst, 1e-4f);
    ck_assert_int_eq(kvm_cuda_model_download_kv(m, L, 0, k, v), KVM_EINVAL);
    kvm_cuda_model_free(&m);
}
END_TEST

START_TEST(test_statistics)
{
    kvm_cuda_model *m;
    ck_assert_int_eq(kvm_model_cuda_new(model, 0, KVM_CUDA_F32, N, N, &m), 0);
    cpu_stats *g = calloc(1, sizeof *g);
    float *lse = calloc((size_t)L * HEADS * N, sizeof *lse);
    kvm_cuda_stats st = {.lse = lse, .entropy = &g->ent[0][0][0], .key_mass = &g->mass[0][0][0],
                         .last_p = &g->last[0][0][0], .win0 = N - WIN};
    ck_assert_int_eq(kvm_cuda_model_forward(m, ids, N, NULL, 1, &st), 0);
    float de = rel_diff(&g->ent[0][0][0], &cst->ent[0][0][0], L * HEADS * N),
          dm = rel_diff(&g->mass[0][0][0], &cst->mass[0][0][0], L * HEADS * N),
          dl = rel_diff(&g->last[0][0][0], &cst->last[0][0][0], L * HEADS * N);
    printf("cuda statistics: entropy %.3g, key mass %.3g, last query %.3g (max|d|/max|ref|)\n", de, dm, dl);
    ck_assert_float_le(de, 1e-4f);
    ck_assert_float_le(dm, 1e-4f);
    ck_assert_float_le(dl, 1e-4f);
    for (int i = 0; i < L * HEADS * N; i++) ck_assert(isfinite(lse[i]));
    free(lse);
    free(g);
    kvm_cuda_model_free(&m);
}
END_TEST

/* a ragged cache: per head a different subset of the prefill's first 64 entries, after two
 * distilled entries (KVM_POS_NONE, bias β); decode one token on both backends */
START_TEST(test_ragged_decode_with_bias)
{
    enum { P = 64 };
    kvm_forward *f;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, P + 8, &c), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, c, ids, P, NULL, KVM_LOGITS_NONE), 0);
    kvm_cuda_model *m;
    ck_assert_int_eq(kvm_model_cuda_new(model, 0, KVM_CUDA_F32, P + 8, 8, &m), 0);
    static float k[P + 2][D], v[P + 2][D], b[P + 2];
    static int32_t pos[P + 2];
    for (int l = 0; l < L; l++)
        for (int g = 0; g < G; g++) {
            kvm_kv_head *h = kvm_kvcache_head(c, l, g);
            int64_t n = 0;
            for (int d = 0; d < 2; d++, n++) { /* distilled: a blend of two keys, bias ±0.7 */
                for (int x = 0; x < D; x++)
                    k[n][x] = 0.5f * (h->k[(3 + d) * D + x] + h->k[(9 + d) * D + x]), v[n][x] = h->v[(5 + d) * D + x];
                pos[n] = KVM_POS_NONE;
                b[n] = d ? -0.7f : 0.7f;
            }
            for (int64_t e = 0; e < P; e++)
                if ((e + g + l) % 3 != 0 || e == 0) {
                    memcpy(k[n], h->k + e * D, sizeof k[n]);
                    memcpy(v[n], h->v + e * D, sizeof v[n]);
                    pos[n] = h->pos[e];
                    b[n++] = 0.0f;
                }
            h->n = 0;
            for (int64_t e = 0; e < n; e++) ck_assert_int_eq(kvm_kvcache_append(h, D, k[e], v[e], pos[e], b[e]), 0);
            ck_assert_int_eq(kvm_cuda_model_set_kv(m, l, g, &k[0][0], &v[0][0], pos, b, n), 0);
        }
    kvm_cuda_model_set_next_pos(m, c->next_pos);
    float ref[V], got[V];
    ck_assert_int_eq(kvm_forward_decode(f, c, ids[P], ref), 0);
    ck_assert_int_eq(kvm_cuda_model_forward(m, &ids[P], 1, got, 1, NULL), 0);
    float r = rel_diff(got, ref, V);
    printf("cuda ragged decode with bias: max|d|/max|ref| %.3g\n", r);
    ck_assert_float_le(r, 1e-4f);
    /* unsorted entries are refused */
    int32_t bad[2] = {5, 3};
    ck_assert_int_eq(kvm_cuda_model_set_kv(m, 0, 0, &k[0][0], &v[0][0], bad, NULL, 2), KVM_EINVAL);
    kvm_cuda_model_free(&m);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
}
END_TEST

/* ---- device eviction (prefill phase) against the CPU's kept sets ---- */

/* the CPU's scores of the candidates [0, m) of (l, g) under pattern p (the bodies on the capture's
 * statistics, as kvm_evict_select computes them) and the zones; streaming: none (exact) */
static void cpu_scores(const kvm_capture *cap, int l, int g, kvm_pattern p, int64_t b, float *obs, float *mass,
                       float *vote, float *score, int64_t *m, int64_t *k)
{
    const kvm_evict_params prm = kvm_evict_params_default();
    int64_t tail0;
    kvm_eb_zones((int)p, prm.recent_frac, prm.window, N, b, m, &tail0, k);
    kvm_evict_attn a;
    ck_assert_int_eq(kvm_evict_attn_from_capture(&model->cfg, cap, l, g, prm.window, obs, mass, &a), 0);
    for (int64_t j = 0; j < *m; j++)
        vote[j] = p == KVM_PATTERN_H2O    ? kvm_eb_h2o(a.mass, N, a.n_group, j)
                  : p == KVM_PATTERN_TOVA ? kvm_eb_tova(a.obs, a.n_obs, N, a.n_group, j)
                                          : kvm_eb_snap_vote(a.obs, a.n_obs, prm.window, N, a.n_group, j);
    for (int64_t j = 0; j < *m; j++)
        score[j] = p == KVM_PATTERN_SNAPKV || p == KVM_PATTERN_PYRAMIDKV ? kvm_eb_pool(vote, *m, prm.pool / 2, j) : vote[j];
}

START_TEST(test_device_eviction)
{
    kvm_forward *f;
    kvm_kvcache *full, *cc;
    kvm_capture *cap;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    ck_assert_int_eq(kvm_forward_new(model, NULL, N, &f), 0);
    ck_assert_int_eq(kvm_capture_new(&model->cfg, N, &co, &cap), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, N, &full), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, full, ids, N, NULL, KVM_LOGITS_NONE), 0);
    kvm_compress_input in = {.model = model, .full = full, .cap = cap, .n_tokens = N, .n_future = 16, .tokens = ids};
    kvm_cuda_model *m;
    ck_assert_int_eq(kvm_model_cuda_new(model, 0, KVM_CUDA_F32, N, N, &m), 0);
    const kvm_evict_params prm = kvm_evict_params_default();
    static float obs[2 * 16 * N], mass[2 * N], vote[N], score[N];
    int32_t pos[N];
    int swaps = 0, heads = 0;
    for (int p = 0; p < KVM_PATTERN_COUNT; p++)
        for (int64_t b = 16; b <= 128; b *= 8) {
            kvm_evict_plan *pl;
            ck_assert_int_eq(kvm_evict_plan_new(L, G, (kvm_pattern)p, b, &pl), 0);
            ck_assert_int_eq(kvm_evict_prefill(&in, pl, &cc), 0);
            uint8_t pat[L * G];
            for (int i = 0; i < L * G; i++) pat[i] = (uint8_t)pl->pattern[i];
            kvm_cuda_evict_plan dp = {.pattern = pat, .budget = pl->budget, .sinks = prm.sinks, .window = prm.window,
                                      .pool = prm.pool, .recent_frac = prm.recent_frac};
            kvm_cuda_model_reset(m);
            ck_assert_int_eq(kvm_cuda_model_keep_evict_stats(m, prm.window), 0);
            ck_assert_msg(kvm_cuda_model_forward(m, ids, N, NULL, 1, NULL) == 0, "%s", kvm_errmsg());
            ck_assert_msg(kvm_cuda_model_evict(m, &dp) == 0, "%s", kvm_errmsg());
            for (int l = 0; l < L; l++)
                for (int g = 0; g < G; g++) {
                    const kvm_kv_head *h = kvm_kvcache_head(cc, l, g);
                    ck_assert_int_eq(kvm_cuda_model_download_pos(m, l, g, pos), 0);
                    for (int64_t e = 1; e < h->n; e++) ck_assert_int_lt(pos[e - 1], pos[e]);
                    int64_t cm = 0, ck = 0;
                    if (p != KVM_PATTERN_STREAMING) cpu_scores(cap, l, g, (kvm_pattern)p, pl->budget[l * G + g], obs, mass, vote, score, &cm, &ck);
                    /* a key kept by one side only must score within 1e-5 (relative) of the cut */
                    float cut = 0;
                    for (int64_t e = 0; e < h->n; e++)
                        if (h->pos[e] < cm && (cut == 0 || score[h->pos[e]] < cut)) cut = score[h->pos[e]];
                    uint8_t in_cpu[N] = {0}, in_dev[N] = {0};
                    for (int64_t e = 0; e < h->n; e++) in_cpu[h->pos[e]] = 1, in_dev[pos[e]] = 1;
                    for (int j = 0; j < N; j++)
                        if (in_cpu[j] != in_dev[j]) {
                            ck_assert_msg(p != KVM_PATTERN_STREAMING && j < cm &&
                                              fabsf(score[j] - cut) <= 1e-5f * fabsf(cut) + 1e-12f,
                                          "%s b %lld layer %d head %d: key %d kept by %s only (score %.9g, cut %.9g)",
                                          kvm_pattern_name((kvm_pattern)p), (long long)b, l, g, j,
                                          in_cpu[j] ? "the CPU" : "cuda:0", score[j], cut);
                            swaps++;
                        }
                    heads++;
                }
            kvm_kvcache_free(&cc);
            kvm_evict_plan_free(&pl);
        }
    printf("cuda device eviction: %d heads' kept sets equal to the CPU's but %d keys at the cut (1e-5)\n", heads,
           swaps / 2);
    /* without statistics for the cache as it is, the eviction is refused */
    uint8_t none[L * G];
    int64_t bud[L * G];
    for (int i = 0; i < L * G; i++) none[i] = 1, bud[i] = 8;
    kvm_cuda_evict_plan dp = {.pattern = none, .budget = bud, .window = 16, .pool = 7, .recent_frac = 0.5};
    ck_assert_int_eq(kvm_cuda_model_evict(m, &dp), KVM_EINVAL);
    kvm_cuda_model_free(&m);
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
}
END_TEST

/* decode-phase eviction (kvm_cuda_model_decode_evict) against the CPU policy (kvm_evict_decode_new):
 * a context of NC tokens cut to b = 16, then 24 tokens decoded one by one, every head at its
 * budget after each; the final kept positions equal the CPU's for StreamingLLM on every head
 * and for the scored patterns on at least 90% of the heads (a float tie at one step changes
 * the later ones, so an exact match of every head is not asked) */
START_TEST(test_device_decode_eviction)
{
    enum { NC = 200, STEPS = 24, B = 16 };
    kvm_forward *f;
    kvm_kvcache *full, *cc;
    kvm_capture *cap;
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    ck_assert_int_eq(kvm_forward_new(model, NULL, NC, &f), 0);
    ck_assert_int_eq(kvm_capture_new(&model->cfg, NC, &co, &cap), 0);
    ck_assert_int_eq(kvm_forward_cache_new(model, N, &full), 0);
    ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap)), 0);
    ck_assert_int_eq(kvm_forward_prefill(f, full, ids, NC, NULL, KVM_LOGITS_NONE), 0);
    kvm_forward_clear_hooks(f);
    kvm_compress_input in = {.model = model, .full = full, .cap = cap, .n_tokens = NC, .tokens = ids};
    kvm_cuda_model *m;
    ck_assert_int_eq(kvm_model_cuda_new(model, 0, KVM_CUDA_F32, N, N, &m), 0);
    const kvm_evict_params prm = kvm_evict_params_default();
    float *lg = malloc((size_t)V * sizeof *lg);
    int32_t pos[N];
    for (int p = 0; p < KVM_PATTERN_COUNT; p++) {
        kvm_evict_plan *pl;
        kvm_decode_policy *pol;
        ck_assert_int_eq(kvm_evict_plan_new(L, G, (kvm_pattern)p, B, &pl), 0);
        ck_assert_int_eq(kvm_evict_prefill(&in, pl, &cc), 0);
        ck_assert_int_eq(kvm_evict_decode_new(&model->cfg, pl, &in, &pol), 0);
        ck_assert_int_eq(kvm_forward_add_hooks(f, &pol->hooks), 0);
        for (int t = 0; t < STEPS; t++) ck_assert_int_eq(kvm_forward_decode(f, cc, ids[NC + t], lg), 0);
        kvm_forward_clear_hooks(f);
        uint8_t pat[L * G];
        for (int i = 0; i < L * G; i++) pat[i] = (uint8_t)pl->pattern[i];
        kvm_cuda_evict_plan dp = {.pattern = pat, .budget = pl->budget, .sinks = prm.sinks, .window = prm.window,
                                  .pool = prm.pool, .recent_frac = prm.recent_frac};
        kvm_cuda_model_reset(m);
        ck_assert_int_eq(kvm_cuda_model_keep_evict_stats(m, prm.window), 0);
        ck_assert_msg(kvm_cuda_model_forward(m, ids, NC, NULL, 1, NULL) == 0, "%s", kvm_errmsg());
        ck_assert_msg(kvm_cuda_model_evict(m, &dp) == 0, "%s", kvm_errmsg());
        ck_assert_msg(kvm_cuda_model_decode_evict(m, &dp) == 0, "%s", kvm_errmsg());
        kvm_cuda_stats st = {0};
        ck_assert_int_eq(kvm_cuda_model_forward(m, ids + NC, 1, lg, 1, &st), KVM_EINVAL); /* stats refused */
        for (int t = 0; t < STEPS; t++)
            ck_assert_msg(kvm_cuda_model_forward(m, ids + NC + t, 1, lg, 1, NULL) == 0, "%s", kvm_errmsg());
        int equal = 0;
        for (int l = 0; l < L; l++)
            for (int g = 0; g < G; g++) {
                const kvm_kv_head *h = kvm_kvcache_head(cc, l, g);
                ck_assert_int_eq(kvm_cuda_model_download_pos(m, l, g, pos), 0);
                int same = 1;
                for (int64_t e = 0; e < h->n; e++) same &= pos[e] == h->pos[e];
                for (int64_t e = 1; e < h->n; e++) ck_assert_int_lt(pos[e - 1], pos[e]);
                if (p != KVM_PATTERN_TOVA) ck_assert_int_eq(pos[h->n - 1], NC + STEPS - 1); /* recent protected */
                equal += same;
            }
        printf("cuda decode eviction %s: %d of %d heads' kept positions equal to the CPU policy's after %d steps\n",
               kvm_pattern_name((kvm_pattern)p), equal, L * G, STEPS);
        if (p == KVM_PATTERN_STREAMING) ck_assert_int_eq(equal, L * G);
        else ck_assert_int_ge(10 * equal, 9 * L * G);
        ck_assert_int_eq(kvm_cuda_model_cache_len(m), pl->budget[0]);
        kvm_decode_policy_free(&pol);
        kvm_kvcache_free(&cc);
        kvm_evict_plan_free(&pl);
    }
    free(lg);
    kvm_cuda_model_free(&m);
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_forward_free(&f);
}
END_TEST

/* mean kl_mean per method of an eval CSV (method names in order of first appearance) */
static int csv_kl(const char *path, char names[][32], double *kl, int max)
{
    size_t n;
    char *t = kvm_test_read_file(path, &n), *save = NULL;
    ck_assert_msg(t != NULL, "%s missing", path);
    int nm = 0, cnt[8] = {0};
    for (char *line = strtok_r(t, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char doc[256], meth[32];
        double budget, ratio, k;
        if (sscanf(line, "%255[^,],%31[^,],%lf,%lf,%lf", doc, meth, &budget, &ratio, &k) != 5) continue; /* header */
        int i = 0;
        while (i < nm && strcmp(names[i], meth)) i++;
        if (i == nm && nm < max) strcpy(names[nm++], meth), kl[i] = 0;
        kl[i] += k, cnt[i]++;
    }
    for (int i = 0; i < nm; i++) kl[i] /= cnt[i];
    free(t);
    return nm;
}

/* `kvmill eval --device cuda:0` runs the eviction methods on the device: KL within 1% of the CPU's
 * run, with --phases prefill and both (the decode-phase policy on the device); a method that
 * needs the host forward runs on the CPU, said on stderr */
static void eval_device_vs_cpu(const char *phases)
{
    char *dir = kvm_test_tmpdir(), cmd[4096], *out = NULL, *err = NULL;
    const char *base = "'%s/kvmill' eval --model '%s' --docs '%s,%s' --method streaming,h2o,tova,snapkv,pyramidkv "
                       "--ratio 0.3 --context 192 --continuation 32 --phases %s --device %s --csv '%s/%s.csv'";
    char model_p[512], d0[512], d1[512]; /* kvm_test_data_path's buffer is reused by each call */
    snprintf(model_p, sizeof model_p, "%s", kvm_test_data_path("models/stories260K.bin"));
    snprintf(d0, sizeof d0, "%s", kvm_test_data_path("corpus/doc_004.txt"));
    snprintf(d1, sizeof d1, "%s", kvm_test_data_path("corpus/doc_005.txt"));
    const char *devs[2] = {"cpu", "cuda:0"};
    char names[2][8][32];
    double kl[2][8];
    int nm[2];
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, base, kvm_test_bin(), model_p, d0, d1, phases, devs[i], dir, i ? "cuda" : "cpu");
        ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "%s: %s", cmd, err);
        if (i) ck_assert_msg(strstr(err, "on cuda:0, against the device's own full KV"), "stderr: %s", err);
        if (i && !strcmp(phases, "both")) ck_assert_msg(strstr(err, "decode-phase policy"), "stderr: %s", err);
        free(out), free(err);
        char csv[600];
        snprintf(csv, sizeof csv, "%s/%s.csv", dir, i ? "cuda" : "cpu");
        nm[i] = csv_kl(csv, names[i], kl[i], 8);
    }
    ck_assert_int_eq(nm[0], 5);
    ck_assert_int_eq(nm[1], 5);
    for (int j = 0; j < 5; j++) {
        ck_assert_str_eq(names[0][j], names[1][j]);
        printf("cuda eval %s, phases %s: mean KL cpu %.6f, cuda:0 %.6f (%+.2f%%)\n", names[0][j], phases, kl[0][j],
               kl[1][j], 100 * (kl[1][j] - kl[0][j]) / kl[0][j]);
        ck_assert_msg(fabs(kl[1][j] - kl[0][j]) <= 0.01 * kl[0][j] + 1e-6, "%s: KL %.6g on cuda:0, %.6g on the CPU",
                      names[0][j], kl[1][j], kl[0][j]);
    }
    snprintf(cmd, sizeof cmd, "'%s/kvmill' eval --model '%s' --docs '%s' --method h2o,am --ratio 0.3 --context 128 "
             "--continuation 16 --phases %s --device cuda:0", kvm_test_bin(), model_p, d0, phases);
    ck_assert_msg(kvm_test_run(cmd, &out, &err) == 0, "%s: %s", cmd, err);
    ck_assert_msg(strstr(err, "run on the CPU (method am needs the host forward"), "stderr: %s", err);
    free(out), free(err);
    kvm_test_rmtree(dir);
    free(dir);
}

START_TEST(test_eval_device_eviction) { eval_device_vs_cpu("prefill"); }
END_TEST

START_TEST(test_eval_device_decode_eviction) { eval_device_vs_cpu("both"); }
END_TEST

START_TEST(test_plan_refuses_what_does_not_fit)
{
    kvm_cuda_model_desc d = {.n_layers = 64, .dim = 8192, .n_heads = 64, .n_kv_heads = 8, .head_dim = 128,
                             .hidden_dim = 28672, .vocab_size = 128256, .norm_eps = 1e-5f, .rope_theta = 5e5f};
    kvm_cuda_model *m = NULL;
    int rc = kvm_cuda_model_new(0, &d, KVM_CUDA_F32, 1 << 20, 2048, &m); /* terabytes */
    ck_assert_int_eq(rc, KVM_ENOMEM);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "needs"));
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "free"));
    ck_assert_ptr_null(m);
}
END_TEST
#endif

int main(void)
{
    Suite *s = suite_create("cuda_forward");
    TCase *tc = tcase_create("cuda");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_host_forward_refuses_device_table);
#ifdef KVM_WITH_CUDA
    tcase_add_test(tc, test_upload_plan_counts_file_bytes);
    tcase_add_test(tc, test_upload_refuses_what_it_cannot_dequantise);
#endif
    const kvm_kernels *k;
    if (kvm_kernels_select("cuda:0", &k)) {
        char why[512];
        snprintf(why, sizeof why, "no CUDA device (%s); only the clean failure of cuda:0 is checked", kvm_errmsg());
        kvm_test_skip(why);
        tcase_add_test(tc, test_no_device_fails_cleanly);
    } else {
#ifdef KVM_WITH_CUDA
        tcase_add_unchecked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_logits_f32);
        tcase_add_test(tc, test_logits_f32_chunked);
        tcase_add_test(tc, test_logits_bf16);
        tcase_add_test(tc, test_kv_capture);
        tcase_add_test(tc, test_statistics);
        tcase_add_test(tc, test_ragged_decode_with_bias);
        tcase_add_test(tc, test_plan_refuses_what_does_not_fit);
        tcase_add_test(tc, test_device_eviction);
        tcase_add_test(tc, test_device_decode_eviction);
        tcase_add_test(tc, test_eval_device_eviction);
        tcase_add_test(tc, test_eval_device_decode_eviction);
#endif
    }
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
