/* check_attn_layer.c: the per-layer attention call (kvm_kernels.attention) on the CPU
 * backend against (1) the per-head kernel it replaced (kvm_cpu_attention_ref: bit for bit,
 * outputs and statistics), and (2) a float64 reference that builds each head's probability
 * matrix explicitly and reduces every statistic from it. Problems are random: GQA groups,
 * ragged KV heads with distilled (KVM_POS_NONE) entries carrying a logit bias β, evicted
 * positions, causal prefill blocks and decode rows, heads that see nothing. The entropy, which
 * the per-layer kernel takes from its softmax sums (kvm_fb_entropy_finish) and the per-head
 * kernel from a log per weight, agrees within 1e-5 nats, also on rows with one dominant score,
 * uniform rows, −inf-masked entries and a real stories260K capture. */
#include "kernels/kvm_kernels.h"
#include "kernels/cpu/kvm_cpu_attn_ref.h"
#include "common/kvm_error.h"
#include "model/kvm_capture.h"
#include "model/kvm_forward.h"

#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static const unsigned ALL_STATS = KVM_ATTN_STAT_MASS | KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_LSE | KVM_ATTN_STAT_OBS;

/* A random layer problem and the buffers of one call on it. */
typedef struct problem {
    kvm_attn_layer a;
    float **k, **v, **bias;
    int32_t **pos, *qpos;
    int64_t *n_e;
    float *q;
} problem;

/* n_heads over n_kv KV heads of dimension d; KV head g holds n_none[g % 3] distilled biased
 * entries and then positions 0.. with every third one evicted, fewer for later heads; the
 * n_q queries sit at the last n_q positions of [0, ctx) (prefill) or at ctx (decode). */
static void problem_make(problem *p, int n_heads, int n_kv, int d, int64_t ctx, int64_t n_q, int decode)
{
    memset(p, 0, sizeof *p);
    p->k = calloc((size_t)n_kv, sizeof *p->k);
    p->v = calloc((size_t)n_kv, sizeof *p->v);
    p->bias = calloc((size_t)n_kv, sizeof *p->bias);
    p->pos = calloc((size_t)n_kv, sizeof *p->pos);
    p->n_e = calloc((size_t)n_kv, sizeof *p->n_e);
    int64_t max_e = 1;
    for (int g = 0; g < n_kv; g++) {
        const int64_t n_none = (int64_t[]){0, 3, 17}[g % 3], keep_ctx = ctx - g * ctx / (2 * n_kv);
        int64_t n = 0;
        p->k[g] = malloc((size_t)((n_none + ctx + 1) * d) * sizeof(float));
        p->v[g] = malloc((size_t)((n_none + ctx + 1) * d) * sizeof(float));
        p->bias[g] = malloc((size_t)(n_none + ctx + 1) * sizeof(float));
        p->pos[g] = malloc((size_t)(n_none + ctx + 1) * sizeof(int32_t));
        for (int64_t e = 0; e < n_none; e++, n++) {
            p->pos[g][n] = KVM_POS_NONE;
            p->bias[g][n] = 2.0f * frand();
        }
        for (int64_t t = 0; t < keep_ctx; t++)
            if (t % 3 != 2 || t >= ctx - n_q) { /* evicted positions, but the queries' own are kept */
                p->pos[g][n] = (int32_t)t;
                p->bias[g][n++] = 0.0f;
            }
        for (int64_t e = 0; e < n * d; e++) {
            p->k[g][e] = frand();
            p->v[g][e] = frand();
        }
        p->n_e[g] = n;
        max_e = n > max_e ? n : max_e;
    }
    const int64_t ld = (int64_t)n_heads * d + 3;
    p->q = malloc((size_t)(n_q * ld + 1) * sizeof(float));
    for (int64_t i = 0; i < n_q * ld; i++) p->q[i] = 2.5f * frand();
    p->qpos = malloc((size_t)(n_q + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < n_q; i++) p->qpos[i] = (int32_t)(decode ? ctx + i : ctx - n_q + i);
    p->a = (kvm_attn_layer){.n_heads = n_heads, .n_kv_heads = n_kv, .head_dim = d, .scale = 1.0f / sqrtf((float)d),
                            .q = p->q, .ldq = ld, .qpos = p->qpos, .n_q = n_q, .k = (const float *const *)p->k,
                            .v = (const float *const *)p->v, .pos = (const int32_t *const *)p->pos,
                            .bias = (const float *const *)p->bias, .n_e = p->n_e, .ldo = ld + 1,
                            .mass_p0 = (int32_t)(ctx - n_q / 2), .mass_p1 = (int32_t)(ctx + n_q),
                            .n_obs = n_q < 5 ? n_q : 5, .ld_e = max_e + 7};
}

/* Fresh output and statistics buffers for p->a (garbage-filled, so unwritten entries show). */
static void buffers_new(const problem *p, kvm_attn_layer *a, unsigned stats)
{
    *a = p->a;
    const size_t H = (size_t)a->n_heads, nq = (size_t)a->n_q + 1, le = (size_t)a->ld_e;
    a->stats = stats;
    a->out = malloc(nq * (size_t)a->ldo * sizeof(float));
    a->mass = malloc(H * le * sizeof(float));
    a->entropy = malloc(H * nq * sizeof(float));
    a->lse = malloc(H * nq * sizeof(float));
    a->obs = malloc(H * (size_t)(a->n_obs + 1) * le * sizeof(float));
    memset(a->out, 0x7f, nq * (size_t)a->ldo * sizeof(float));
    memset(a->mass, 0x7f, H * le * sizeof(float));
    memset(a->obs, 0x7f, H * (size_t)(a->n_obs + 1) * le * sizeof(float));
}

static void buffers_free(kvm_attn_layer *a)
{
    free(a->out); free(a->mass); free(a->entropy); free(a->lse); free(a->obs);
}

static void problem_free(problem *p)
{
    for (int g = 0; g < p->a.n_kv_heads; g++) {
        free(p->k[g]); free(p->v[g]); free(p->bias[g]); free(p->pos[g]);
    }
    free(p->k); free(p->v); free(p->bias); free(p->pos); free(p->n_e); free(p->q); free(p->qpos);
}

/* The shapes every test runs: GQA prefill blocks (with a partial last block), MHA, one
 * KV head for many query heads, decode rows of one and two queries; decode of 6 query heads per
 * KV head (the scores' passes of 4 rows and 2, V's of 3 and 3), of 3 at a head dim that is not
 * a multiple of 8 (scores row by row, V's strip and its last 4 columns) and of 8 over one KV
 * head (MQA). */
typedef struct shape { int nh, nkv, d; int64_t ctx, n_q; int decode; } shape;
static const shape shapes[] = {
    {8, 4, 8, 200, 130, 0}, {9, 3, 64, 150, 70, 0}, {4, 4, 16, 40, 3, 0}, {6, 1, 12, 90, 90, 0},
    {4, 2, 16, 300, 1, 1},  {6, 3, 8, 100, 2, 1},   {3, 3, 64, 1, 1, 1},  {12, 2, 64, 261, 1, 1},
    {9, 3, 12, 77, 2, 1},   {8, 1, 16, 50, 1, 1},
};
enum { N_SHAPES = sizeof shapes / sizeof shapes[0] };

static int64_t head_rows(const kvm_attn_layer *a, int h) { return a->n_e[h / (a->n_heads / a->n_kv_heads)]; }

/* new vs the per-head kernel it replaced: the same bits for outputs and statistics (LSE, which
 * the old kernel never produced, against its float64 recomputation; the entropy within 1e-5). */
START_TEST(test_layer_equals_per_head_kernel)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    for (int run = 0; run < 2 * N_SHAPES; run++) /* 1 thread and 3: decode's heads together or split */
        for (int with = 0, s = run % N_SHAPES; with < 2; with++) {
            if (with == 0) kvm_kernels_cpu_set_threads(run < N_SHAPES ? 1 : 3);
            const shape *sh = &shapes[s];
            problem p;
            problem_make(&p, sh->nh, sh->nkv, sh->d, sh->ctx, sh->n_q, sh->decode);
            kvm_attn_layer a, r;
            buffers_new(&p, &a, with ? ALL_STATS : 0);
            buffers_new(&p, &r, with ? ALL_STATS : 0);
            ck_assert_int_eq(k->attention(&a), 0);
            ck_assert_int_eq(kvm_cpu_attention_ref(&r), 0);
            for (int64_t i = 0; i < a.n_q; i++)
                ck_assert_msg(memcmp(a.out + i * a.ldo, r.out + i * r.ldo, (size_t)(a.n_heads * a.head_dim) * 4) == 0,
                              "shape %d stats %d: output row %lld differs", s, with, (long long)i);
            for (int h = 0; with && h < a.n_heads; h++) {
                ck_assert_msg(memcmp(a.mass + h * a.ld_e, r.mass + h * r.ld_e, (size_t)a.ld_e * 4) == 0,
                              "shape %d head %d: mass differs", s, h);
                for (int64_t i = 0; i < a.n_q; i++) /* one pass of sums against a log per weight */
                    ck_assert_msg(fabsf(a.entropy[h * a.n_q + i] - r.entropy[h * r.n_q + i]) <= 1e-5f,
                                  "shape %d head %d query %lld: entropy %.9g vs %.9g", s, h, (long long)i,
                                  a.entropy[h * a.n_q + i], r.entropy[h * r.n_q + i]);
                ck_assert_int_eq(memcmp(a.obs + h * a.n_obs * a.ld_e, r.obs + h * r.n_obs * r.ld_e,
                                        (size_t)(a.n_obs * a.ld_e) * 4), 0);
                for (int64_t i = 0; i < a.n_q; i++) {
                    float x = a.lse[h * a.n_q + i], y = r.lse[h * r.n_q + i];
                    ck_assert_msg(isinf(x) ? x == y : fabsf(x - y) <= 1e-5f * (1 + fabsf(y)),
                                  "shape %d head %d query %lld: lse %g vs %g", s, h, (long long)i, x, y);
                }
            }
            buffers_free(&a);
            buffers_free(&r);
            problem_free(&p);
        }
}
END_TEST

/* Query i of head h: its float64 probability row pr[n_e], log-normaliser and output. */
static double ref_row(const kvm_attn_layer *a, int h, int64_t i, double *pr, double *out)
{
    const int g = h / (a->n_heads / a->n_kv_heads), d = a->head_dim;
    const int64_t n = a->n_e[g];
    const float *q = a->q + i * a->ldq + (int64_t)h * d;
    double mx = -INFINITY, sum = 0;
    for (int64_t e = 0; e < n; e++) {
        pr[e] = -INFINITY;
        if (a->pos[g][e] != KVM_POS_NONE && a->pos[g][e] > a->qpos[i]) continue;
        double x = 0;
        for (int c = 0; c < d; c++) x += (double)q[c] * a->k[g][e * d + c];
        pr[e] = x * a->scale + a->bias[g][e];
        mx = fmax(mx, pr[e]);
    }
    for (int64_t e = 0; e < n; e++) sum += (pr[e] = pr[e] == -INFINITY ? 0 : exp(pr[e] - mx));
    for (int c = 0; c < d; c++) out[c] = 0;
    for (int64_t e = 0; e < n; e++) {
        pr[e] = sum > 0 ? pr[e] / sum : 0;
        for (int c = 0; c < d; c++) out[c] += pr[e] * a->v[g][e * d + c];
    }
    return sum > 0 ? mx + log(sum) : -INFINITY;
}

/* Each statistic against the one reduced from the explicit float64 probability matrix. */
START_TEST(test_stats_match_explicit_probabilities)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    for (int s = 0; s < N_SHAPES; s++) {
        const shape *sh = &shapes[s];
        problem p;
        problem_make(&p, sh->nh, sh->nkv, sh->d, sh->ctx, sh->n_q, sh->decode);
        kvm_attn_layer a;
        buffers_new(&p, &a, ALL_STATS);
        ck_assert_int_eq(k->attention(&a), 0);
        double *P = malloc((size_t)(a.n_q * a.ld_e) * sizeof *P), *o = malloc((size_t)a.head_dim * sizeof *o);
        for (int h = 0; h < a.n_heads; h++) {
            const int64_t n = head_rows(&a, h);
            for (int64_t i = 0; i < a.n_q; i++) {
                double *pr = P + i * a.ld_e, lse = ref_row(&a, h, i, pr, o), ent = 0;
                for (int c = 0; c < a.head_dim; c++)
                    ck_assert_msg(fabs(o[c] - a.out[i * a.ldo + h * a.head_dim + c]) < 2e-5, "shape %d out", s);
                for (int64_t e = 0; e < n; e++) ent -= pr[e] > 0 ? pr[e] * log(pr[e]) : 0;
                ck_assert_msg(fabs(ent - a.entropy[h * a.n_q + i]) < 1e-4, "shape %d head %d q %lld: entropy %g vs %g",
                              s, h, (long long)i, a.entropy[h * a.n_q + i], ent);
                if (isinf(lse)) ck_assert(isinf(a.lse[h * a.n_q + i]) && a.lse[h * a.n_q + i] < 0);
                else ck_assert_double_eq_tol(lse, a.lse[h * a.n_q + i], 1e-4);
                if (i >= a.n_q - a.n_obs)
                    for (int64_t e = 0; e < a.ld_e; e++)
                        ck_assert_double_eq_tol(e < n ? pr[e] : 0, a.obs[(h * a.n_obs + i - (a.n_q - a.n_obs)) * a.ld_e + e], 2e-6);
            }
            for (int64_t e = 0; e < a.ld_e; e++) {
                double m = 0;
                for (int64_t i = 0; e < n && i < a.n_q; i++)
                    if (a.qpos[i] >= a.mass_p0 && a.qpos[i] < a.mass_p1) m += P[i * a.ld_e + e];
                ck_assert_msg(fabs(m - a.mass[h * a.ld_e + e]) < 1e-5 * (1 + (double)a.n_q), "shape %d head %d entry %lld: "
                              "mass %g vs %g", s, h, (long long)e, a.mass[h * a.ld_e + e], m);
            }
        }
        free(P);
        free(o);
        buffers_free(&a);
        problem_free(&p);
    }
}
END_TEST

/* Outputs with statistics asked differ from the plain path by rounding only; results do not
 * depend on the thread count. */
START_TEST(test_stats_and_threads_do_not_change_results)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    for (int s = 0; s < N_SHAPES; s++) {
        const shape *sh = &shapes[s];
        problem p;
        problem_make(&p, sh->nh, sh->nkv, sh->d, sh->ctx, sh->n_q, sh->decode);
        kvm_attn_layer a1, a2, b;
        buffers_new(&p, &a1, ALL_STATS);
        buffers_new(&p, &a2, ALL_STATS);
        buffers_new(&p, &b, 0);
        kvm_kernels_cpu_set_threads(1);
        ck_assert_int_eq(k->attention(&a1), 0);
        kvm_kernels_cpu_set_threads(3);
        ck_assert_int_eq(k->attention(&a2), 0);
        ck_assert_int_eq(k->attention(&b), 0);
        for (int64_t i = 0; i < a1.n_q; i++) {
            ck_assert_int_eq(memcmp(a1.out + i * a1.ldo, a2.out + i * a2.ldo, (size_t)(a1.n_heads * a1.head_dim) * 4), 0);
            for (int c = 0; c < a1.n_heads * a1.head_dim; c++)
                ck_assert_float_eq_tol(a1.out[i * a1.ldo + c], b.out[i * b.ldo + c], 1e-6f);
        }
        ck_assert_int_eq(memcmp(a1.mass, a2.mass, (size_t)(a1.n_heads * a1.ld_e) * 4), 0);
        ck_assert_int_eq(memcmp(a1.entropy, a2.entropy, (size_t)(a1.n_heads * a1.n_q) * 4), 0);
        buffers_free(&a1);
        buffers_free(&a2);
        buffers_free(&b);
        problem_free(&p);
    }
    kvm_kernels_cpu_set_threads(2);
}
END_TEST

/* Decode above the pool's threshold gives the same bits with one thread and several: a score
 * biased to −46 weights a value of 1e-20 into a subnormal product, which the pool's threads
 * (flush-to-zero) make 0; run on the calling thread instead with one thread, it stayed
 * subnormal (the review of the GQA decode path). */
START_TEST(test_decode_threads_flush_alike)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    problem p;
    problem_make(&p, 2, 1, 64, 900, 1, 1);
    ck_assert_int_ge(p.n_e[0] * 64 * 2, 1 << 16); /* on the pool (kvm_cpu_attn.c's threshold) */
    for (int64_t i = 0; i < p.a.ldq; i++)
        p.q[i] = 0.1f;
    for (int64_t e = 0; e < p.n_e[0] * 64; e++)
        p.k[0][e] = p.v[0][e] = 0.0f;
    p.v[0][5 * 64 + 3] = 1e-20f;
    p.bias[0][5] = -46.0f;
    kvm_attn_layer a1, a3;
    buffers_new(&p, &a1, 0);
    buffers_new(&p, &a3, 0);
    kvm_kernels_cpu_set_threads(1);
    ck_assert_int_eq(k->attention(&a1), 0);
    kvm_kernels_cpu_set_threads(3);
    ck_assert_int_eq(k->attention(&a3), 0);
    ck_assert_msg(memcmp(a1.out, a3.out, (size_t)(2 * 64) * 4) == 0, "1 thread %a, 3 threads %a", (double)a1.out[3],
                  (double)a3.out[3]);
    buffers_free(&a1);
    buffers_free(&a3);
    problem_free(&p);
    kvm_kernels_cpu_set_threads(2);
}
END_TEST

/* Rows built to stress the one-pass entropy: n entries of one KV head with zero keys, so each
 * score is its bias: one dominant score (margins 8, 30, 100), uniform rows (H = ln n), rows
 * with −inf-masked entries (H = ln of the unmasked count when those are uniform), random
 * scores; prefill blocks (n_q = 3) and decode rows (n_q = 1), n from 1 to 2,000 (the SIMD
 * lanes and their tail). The per-layer kernel's entropy against the per-head kernel's −Σ p ln p
 * in double, within 1e-5 nats. */
START_TEST(test_entropy_edge_rows)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    const int64_t ns[] = {1, 7, 16, 33, 300, 2000};
    enum { D = 8, KINDS = 7 };
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (int kind = 0; kind < KINDS; kind++)
            for (int n_q = 1; n_q <= 3; n_q += 2) {
                const int64_t n = ns[ni];
                float *kv = calloc((size_t)(n * D), sizeof *kv), *bias = malloc((size_t)n * sizeof *bias);
                int32_t *pos = malloc((size_t)n * sizeof *pos), qpos[3];
                float q[3 * D];
                int64_t masked = 0;
                for (int64_t e = 0; e < n; e++) {
                    pos[e] = KVM_POS_NONE; /* all visible to every query */
                    const float dom[] = {8.0f, 30.0f, 100.0f};
                    bias[e] = kind < 3 ? (e == n / 2 ? dom[kind] : 0.0f) /* one dominant score */
                            : kind == 3 ? 0.0f                               /* uniform */
                            : kind == 4 ? (e % 3 == 1 ? -INFINITY : 0.0f)   /* masked, the rest uniform */
                            : kind == 5 ? (e % 2 ? -INFINITY : 5.0f * frand()) /* masked, the rest random */
                                        : 20.0f * frand();                  /* random, wide */
                    masked += isinf(bias[e]) != 0;
                }
                for (int i = 0; i < 3; i++) qpos[i] = i;
                for (int i = 0; i < 3 * D; i++) q[i] = frand();
                const float *kp = kv, *bp = bias;
                const int32_t *pp = pos;
                float out[2][3 * D], ent[2][3];
                kvm_attn_layer a = {.n_heads = 1, .n_kv_heads = 1, .head_dim = D, .scale = 0.5f, .q = q, .ldq = D,
                                    .qpos = qpos, .n_q = n_q, .k = &kp, .v = &kp, .pos = &pp, .bias = &bp, .n_e = &n,
                                    .ldo = D, .stats = KVM_ATTN_STAT_ENTROPY};
                a.out = out[0], a.entropy = ent[0];
                ck_assert_int_eq(k->attention(&a), 0);
                a.out = out[1], a.entropy = ent[1];
                ck_assert_int_eq(kvm_cpu_attention_ref(&a), 0);
                for (int i = 0; i < n_q; i++) {
                    ck_assert_msg(isfinite(ent[0][i]) && fabsf(ent[0][i] - ent[1][i]) <= 1e-5f,
                                  "n %lld kind %d n_q %d query %d: entropy %.9g, per weight %.9g", (long long)n, kind,
                                  n_q, i, ent[0][i], ent[1][i]);
                    if (kind == 3 || kind == 4)
                        ck_assert_msg(fabs(ent[0][i] - log((double)(n - masked))) <= 1e-5, "n %lld kind %d: %.9g vs "
                                      "ln %lld", (long long)n, kind, ent[0][i], (long long)(n - masked));
                }
                free(kv);
                free(bias);
                free(pos);
            }
}
END_TEST

/* A real capture: stories260K's prefill of the golden sequence through the capture hooks, on
 * the CPU table and on a copy of it whose attention is the per-head kernel (a log per weight):
 * every layer's entropy rows agree within 1e-5 nats, the received mass bit for bit. */
START_TEST(test_entropy_real_capture)
{
    static kvm_kernels old_k;
    old_k = *kvm_kernels_cpu();
    old_k.attention = kvm_cpu_attention_ref;
    const kvm_kernels *ks[2] = {kvm_kernels_cpu(), &old_k};
    int32_t ids[256];
    kvm_test_golden_ids(ids);
    kvm_capture *cap[2] = {NULL, NULL};
    kvm_model *m[2] = {NULL, NULL}; /* weights are prepared per table: one model each */
    for (int s = 0; s < 2; s++) {
        kvm_forward *f = NULL;
        kvm_kvcache *c = NULL;
        kvm_capture_opts co = {.want_stats = 1};
        ck_assert_msg(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &m[s]) == 0, "%s", kvm_errmsg());
        ck_assert_int_eq(kvm_capture_new(&m[s]->cfg, 256, &co, &cap[s]), 0);
        ck_assert_int_eq(kvm_forward_new(m[s], ks[s], 256, &f), 0);
        ck_assert_int_eq(kvm_forward_add_hooks(f, kvm_capture_hooks(cap[s])), 0);
        ck_assert_int_eq(kvm_forward_cache_new(m[s], 256, &c), 0);
        ck_assert_msg(kvm_forward_prefill(f, c, ids, 256, NULL, KVM_LOGITS_NONE) == 0, "%s", kvm_errmsg());
        kvm_kvcache_free(&c);
        kvm_forward_free(&f);
    }
    const kvm_model_config *c = &m[0]->cfg;
    float worst = 0, hmax = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const kvm_capture_layer *x = kvm_capture_layer_get(cap[0], l), *y = kvm_capture_layer_get(cap[1], l);
        for (int64_t i = 0; i < (int64_t)c->n_heads * 256; i++) {
            worst = fmaxf(worst, fabsf(x->entropy[i] - y->entropy[i]));
            hmax = fmaxf(hmax, y->entropy[i]);
        }
        ck_assert_int_eq(memcmp(x->mass, y->mass, (size_t)c->n_heads * 256 * sizeof(float)), 0);
    }
    printf("stories260K capture: entropy up to %.3f nats, max |one pass - per weight| %.3g\n", hmax, worst);
    ck_assert_float_gt(hmax, 1.0f); /* rows that are far from one-hot are in it */
    ck_assert_float_le(worst, 1e-5f);
    for (int s = 0; s < 2; s++) {
        kvm_capture_free(&cap[s]);
        kvm_model_close(&m[s]);
    }
}
END_TEST

/* Each bad argument is a KVM_EINVAL naming the field, never a crash. */
START_TEST(test_bad_arguments)
{
    const kvm_kernels *k = kvm_kernels_cpu();
    problem p;
    problem_make(&p, 4, 2, 8, 30, 10, 0);
    kvm_attn_layer a;
    buffers_new(&p, &a, ALL_STATS);
    ck_assert_int_eq(k->attention(&a), 0);
    struct { const char *what; kvm_attn_layer b; } bad[9];
    for (int i = 0; i < 9; i++) bad[i].b = a;
    bad[0].what = "n_heads"; bad[0].b.n_heads = 5;
    bad[1].what = "ldq"; bad[1].b.ldq = 8;
    bad[2].what = "ldo"; bad[2].b.ldo = 31;
    bad[3].what = "ld_e"; bad[3].b.ld_e = 2;
    bad[4].what = "buffer"; bad[4].b.mass = NULL;
    bad[5].what = "n_obs"; bad[5].b.n_obs = 11;
    bad[6].what = "n_obs"; bad[6].b.n_obs = 0;
    bad[7].what = "flags"; bad[7].b.stats |= 1u << 9;
    bad[8].what = "head_dim"; bad[8].b.head_dim = 0;
    for (int i = 0; i < 9; i++) {
        ck_assert_msg(k->attention(&bad[i].b) == KVM_EINVAL, "case %d (%s) accepted", i, bad[i].what);
        ck_assert_msg(strstr(kvm_errmsg(), bad[i].what) != NULL, "case %d: message '%s' does not name %s", i,
                      kvm_errmsg(), bad[i].what);
        ck_assert_int_eq(kvm_cpu_attention_ref(&bad[i].b), KVM_EINVAL);
    }
    int64_t neg = -1, save = p.n_e[1];
    p.n_e[1] = neg;
    ck_assert_int_eq(k->attention(&a), KVM_EINVAL);
    p.n_e[1] = save;
    buffers_free(&a);
    problem_free(&p);
}
END_TEST

static Suite *attn_layer_suite(void)
{
    Suite *s = suite_create("attn_layer");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"layer_equals_per_head_kernel", test_layer_equals_per_head_kernel},
                 {"stats_match_explicit_probabilities", test_stats_match_explicit_probabilities},
                 {"stats_and_threads_do_not_change_results", test_stats_and_threads_do_not_change_results},
                 {"decode_threads_flush_alike", test_decode_threads_flush_alike},
                 {"entropy_edge_rows", test_entropy_edge_rows},
                 {"entropy_real_capture", test_entropy_real_capture},
                 {"bad_arguments", test_bad_arguments}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(attn_layer_suite()); }
