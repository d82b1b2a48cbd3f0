/* bench_forward.c: prefill and decode throughput of the CPU forward, against kvmill's own
 * token-by-token path on the same input and against plain cblas_sgemm of the prefill's
 * GEMM shapes. Prints one `key=value` line per measurement (medians of --reps runs).
 * --compare-ref 1 instead times the forward on the per-layer attention kernel against the
 * same forward on the per-head kernel it replaced (kvm_cpu_attention_ref), interleaved in
 * one run, and prints both medians and their ratio. --capture 1 times the prefill with the KV
 * capture's hooks (queries and statistics: entropy and received mass, as the prefill stage and
 * eval's capture ask them) against the plain prefill, interleaved in one run. --attn-stats 1
 * times one layer's attention call (the model's head shapes, N causal queries over N random
 * keys) with the capture's statistics (MASS | ENTROPY) against MASS alone, interleaved, in
 * CPU time: the difference is what the ENTROPY statistic costs the capture per layer. */
#include "bench/bench_util.h"
#include "model/kvm_capture.h"
#include "model/kvm_forward.h"
#include "common/kvm_error.h"
#include "kernels/cpu/kvm_cpu_attn_ref.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

/* Reads up to n ids (one per line) from path, else fills a deterministic pseudo-text. */
static void load_tokens(const char *path, int32_t *ids, int64_t n, int vocab)
{
    int64_t i = 0;
    FILE *f = path ? fopen(path, "r") : NULL;
    if (f) {
        int v;
        while (i < n && fscanf(f, "%d", &v) == 1) ids[i++] = v % vocab;
        fclose(f);
    }
    for (uint64_t s = 12345; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = i == 0 ? 1 : (int32_t)((s >> 33) % (uint64_t)vocab);
    }
}

/* FLOPs of a causal prefill of n tokens (projections, attention, last-token classifier). */
static double prefill_flops(const kvm_model_config *c, double n)
{
    double qd = (double)c->n_heads * c->head_dim, kvd = (double)c->n_kv_heads * c->head_dim;
    double proj = 2.0 * n * c->dim * (2 * qd + 2 * kvd) + 2.0 * n * 3.0 * c->dim * c->hidden_dim;
    double attn = 2.0 * 2.0 * c->n_heads * c->head_dim * n * (n + 1) / 2.0;
    return c->n_layers * (proj + attn) + 2.0 * c->dim * c->vocab_size;
}

/* Plain sgemm over the prefill's projection shapes: GFLOP/s. */
static double sgemm_gflops(const kvm_model_config *c, int64_t n, int reps)
{
    int64_t qd = (int64_t)c->n_heads * c->head_dim, kvd = (int64_t)c->n_kv_heads * c->head_dim;
    int64_t shapes[][2] = {{qd, c->dim}, {kvd, c->dim}, {kvd, c->dim}, {c->dim, qd},
                           {c->hidden_dim, c->dim}, {c->hidden_dim, c->dim}, {c->dim, c->hidden_dim}};
    int64_t big = c->hidden_dim > c->dim ? c->hidden_dim : c->dim;
    float *x = calloc((size_t)(n * big), sizeof *x), *w = calloc((size_t)(big * big), sizeof *w),
          *y = calloc((size_t)(n * big), sizeof *y);
    for (int64_t i = 0; i < n * big; i++) x[i] = (float)(i % 7) * 0.1f;
    for (int64_t i = 0; i < big * big; i++) w[i] = (float)(i % 5) * 0.01f;
    double t[16], flops = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = bench_wall_s();
        flops = 0;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (blasint)n, (blasint)shapes[s][0], (blasint)shapes[s][1],
                        1.0f, x, (blasint)shapes[s][1], w, (blasint)shapes[s][1], 0.0f, y, (blasint)shapes[s][0]);
            flops += 2.0 * (double)n * (double)shapes[s][0] * (double)shapes[s][1];
        }
        t[r] = bench_wall_s() - t0;
    }
    free(x); free(w); free(y);
    return flops / bench_median(t, reps) / 1e9;
}

static int noop_hook(void *user, kvm_attn_site *site)
{
    (void)site;
    ++*(int64_t *)user;
    return 0;
}

/* Prefill of n tokens, then gen greedy decode steps, on forward f (batch n) and f1 (batch
 * 1); seconds of each into *tp, *td. */
static int time_pass(const kvm_model *m, kvm_forward *f, kvm_forward *f1, const int32_t *ids, int64_t n, int64_t gen,
                     float *logits, double *tp, double *td)
{
    kvm_kvcache *cache;
    if (kvm_forward_cache_new(m, n + gen, &cache)) return 1;
    double t0 = bench_wall_s();
    int rc = kvm_forward_prefill(f, cache, ids, n, logits, KVM_LOGITS_LAST);
    *tp = bench_wall_s() - t0;
    t0 = bench_wall_s();
    for (int64_t i = 0; !rc && i < gen; i++) {
        int32_t best = 0;
        for (int v = 1; v < m->cfg.vocab_size; v++) best = logits[v] > logits[best] ? v : best;
        rc = kvm_forward_decode(f1, cache, best, logits);
    }
    *td = bench_wall_s() - t0;
    kvm_kvcache_free(&cache);
    return rc;
}

/* --compare-ref: the per-layer kernel (new) against the per-head reference (old) on the
 * same model, tokens and threads, alternating per repetition so load drifts hit both. The
 * old side runs on a copy of the CPU table whose attention is the reference, over a second
 * copy of the model (weights are prepared per backend table). */
static int compare_ref(const char *path, const int32_t *ids, int64_t n, int64_t gen, int reps, int threads)
{
    static kvm_kernels old_k;
    old_k = *kvm_kernels_cpu();
    old_k.attention = kvm_cpu_attention_ref;
    const kvm_kernels *ks[2] = {kvm_kernels_cpu(), &old_k};
    kvm_model *m[2] = {NULL, NULL};
    kvm_forward *f[2] = {NULL, NULL}, *f1[2] = {NULL, NULL};
    double tp[2][16], td[2][16];
    float *logits = NULL;
    int rc = 0;
    for (int s = 0; !rc && s < 2; s++)
        rc = kvm_model_open(path, &m[s]) || kvm_forward_new(m[s], ks[s], n, &f[s]) || kvm_forward_new(m[s], ks[s], 1, &f1[s]);
    if (!rc && !(logits = malloc((size_t)m[0]->cfg.vocab_size * sizeof *logits))) rc = 1;
    for (int r = 0; !rc && r < reps; r++)
        for (int s = 0; !rc && s < 2; s++) {
            int side = r % 2 ? 1 - s : s; /* ABBA order */
            rc = time_pass(m[side], f[side], f1[side], ids, n, gen, logits, &tp[side][r], &td[side][r]);
        }
    if (rc) fprintf(stderr, "%s\n", kvm_errmsg());
    else {
        double pn = bench_median(tp[0], reps), po = bench_median(tp[1], reps), dn = bench_median(td[0], reps), d_o = bench_median(td[1], reps);
        printf("model=%s layers=%d heads=%d/%d threads=%d N=%lld gen=%lld reps=%d (per-layer kernel vs per-head reference)\n",
               path, m[0]->cfg.n_layers, m[0]->cfg.n_heads, m[0]->cfg.n_kv_heads, threads, (long long)n,
               (long long)gen, reps);
        printf("  prefill_tok_s new=%.0f old=%.0f new/old=%.3f\n", (double)n / pn, (double)n / po, po / pn);
        printf("  decode_tok_s new=%.1f old=%.1f new/old=%.3f (%lld steps after %lld tokens)\n", (double)gen / dn,
               (double)gen / d_o, d_o / dn, (long long)gen, (long long)n);
    }
    free(logits);
    for (int s = 0; s < 2; s++) {
        kvm_forward_free(&f[s]);
        kvm_forward_free(&f1[s]);
        kvm_model_close(&m[s]);
    }
    return rc ? 1 : 0;
}

enum { KVM_MAX_KV_HEADS_BENCH = 64 };

/* One prefill of n tokens on f (with or without the capture's hooks): wall seconds, and the
 * process's CPU seconds in *cpu (what a shared machine's load does not inflate, as long as the
 * cores are not oversubscribed by this process itself). */
static double time_capture(const kvm_model *m, kvm_forward *f, const int32_t *ids, int64_t n, float *logits, double *cpu)
{
    kvm_kvcache *cache;
    *cpu = 0;
    if (kvm_forward_cache_new(m, n, &cache)) return -1;
    double t0 = bench_wall_s(), c0 = bench_clock_s(CLOCK_PROCESS_CPUTIME_ID);
    int rc = kvm_forward_prefill(f, cache, ids, n, logits, KVM_LOGITS_LAST);
    double t = bench_wall_s() - t0;
    *cpu = bench_clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    kvm_kvcache_free(&cache);
    return rc ? -1 : t;
}

/* --capture: the prefill with the capture's hooks (queries, entropy, mass) against the plain
 * prefill, alternating per repetition (ABBA) so load drifts hit both. */
static int compare_capture(const char *path, const int32_t *ids, int64_t n, int reps, int threads)
{
    kvm_model *m = NULL;
    kvm_forward *f = NULL, *fc = NULL;
    kvm_capture *cap = NULL;
    float *logits = NULL;
    double tc[16], tp[16], cc[16], cp[16];
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    int rc = kvm_model_open(path, &m) || kvm_forward_new(m, NULL, n, &f) || kvm_forward_new(m, NULL, n, &fc) ||
             kvm_capture_new(&m->cfg, n, &co, &cap) || kvm_forward_add_hooks(fc, kvm_capture_hooks(cap)) ||
             !(logits = malloc((size_t)m->cfg.vocab_size * sizeof *logits));
    for (int r = 0; !rc && r < reps; r++)
        for (int s = 0; !rc && s < 2; s++) {
            int side = r % 2 ? 1 - s : s;
            double cpu, t = time_capture(m, side ? f : fc, ids, n, logits, &cpu);
            rc = t < 0;
            (side ? tp : tc)[r] = t;
            (side ? cp : cc)[r] = cpu;
        }
    if (rc) fprintf(stderr, "%s\n", kvm_errmsg());
    else {
        double c = bench_median(tc, reps), p = bench_median(tp, reps), uc = bench_median(cc, reps),
               up = bench_median(cp, reps);
        printf("model=%s layers=%d heads=%d/%d threads=%d N=%lld reps=%d (prefill with the capture's hooks vs plain)\n",
               path, m->cfg.n_layers, m->cfg.n_heads, m->cfg.n_kv_heads, threads, (long long)n, reps);
        printf("  capture_prefill_ms=%.1f plain_prefill_ms=%.1f capture_cost_ms=%.1f capture/plain=%.3f\n", c * 1e3,
               p * 1e3, (c - p) * 1e3, c / p);
        printf("  cpu: capture_prefill_ms=%.1f plain_prefill_ms=%.1f capture_cost_ms=%.1f capture/plain=%.3f\n",
               uc * 1e3, up * 1e3, (uc - up) * 1e3, uc / up);
    }
    free(logits);
    kvm_capture_free(&cap);
    kvm_forward_free(&f);
    kvm_forward_free(&fc);
    kvm_model_close(&m);
    return rc ? 1 : 0;
}

/* --attn-stats: the layer attention call with MASS | ENTROPY against MASS alone (CPU ms,
 * medians of reps alternating ABBA), on c's head shapes and n causal queries. */
static int compare_attn_stats(const kvm_model_config *c, int64_t n, int reps, int threads)
{
    const int nh = c->n_heads, nkv = c->n_kv_heads, d = c->head_dim;
    const int64_t row = (int64_t)nh * d;
    float *q = malloc((size_t)(n * row) * sizeof *q), *out = malloc((size_t)(n * row) * sizeof *out);
    float *mass = malloc((size_t)(nh * n) * sizeof *mass), *ent = malloc((size_t)(nh * n) * sizeof *ent);
    float *kv = malloc((size_t)(2 * nkv * n * d) * sizeof *kv);
    int32_t *pos = malloc((size_t)n * sizeof *pos);
    const float *k[KVM_MAX_KV_HEADS_BENCH], *v[KVM_MAX_KV_HEADS_BENCH];
    const int32_t *pp[KVM_MAX_KV_HEADS_BENCH];
    int64_t ne[KVM_MAX_KV_HEADS_BENCH];
    if (!q || !out || !mass || !ent || !kv || !pos || nkv > KVM_MAX_KV_HEADS_BENCH) return 1;
    uint64_t s = 7;
    for (int64_t i = 0; i < n * row; i++) s = s * 6364136223846793005ull + 1, q[i] = (float)((s >> 40) % 2001) / 1000.0f - 1.0f;
    for (int64_t i = 0; i < 2 * nkv * n * d; i++) s = s * 6364136223846793005ull + 1, kv[i] = (float)((s >> 40) % 2001) / 1000.0f - 1.0f;
    for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)i;
    for (int g = 0; g < nkv; g++) k[g] = kv + (int64_t)g * n * d, v[g] = kv + (int64_t)(nkv + g) * n * d, pp[g] = pos, ne[g] = n;
    kvm_attn_layer a = {.n_heads = nh, .n_kv_heads = nkv, .head_dim = d, .scale = 1.0f / sqrtf((float)d), .q = q,
                        .ldq = row, .qpos = pos, .n_q = n, .k = k, .v = v, .pos = pp, .n_e = ne, .out = out,
                        .ldo = row, .mass = mass, .entropy = ent, .mass_p0 = 0, .mass_p1 = (int32_t)n, .ld_e = n};
    double t[2][16];
    const kvm_kernels *kk = kvm_kernels_cpu();
    for (int r = 0; r < reps; r++)
        for (int s2 = 0; s2 < 2; s2++) {
            const int side = r % 2 ? 1 - s2 : s2;
            a.stats = KVM_ATTN_STAT_MASS | (side ? 0u : (unsigned)KVM_ATTN_STAT_ENTROPY);
            double c0 = bench_clock_s(CLOCK_PROCESS_CPUTIME_ID);
            if (kk->attention(&a)) { fprintf(stderr, "%s\n", kvm_errmsg()); return 1; }
            t[side][r] = bench_clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
        }
    const double with = bench_median(t[0], reps), without = bench_median(t[1], reps);
    printf("heads=%d/%d head_dim=%d N=%lld threads=%d reps=%d (one layer's attention, CPU time)\n", nh, nkv, d,
           (long long)n, threads, reps);
    printf("  attn_mass_entropy_ms=%.2f attn_mass_ms=%.2f entropy_ms=%.2f entropy_share=%.3f\n", with * 1e3,
           without * 1e3, (with - without) * 1e3, (with - without) / with);
    free(q), free(out), free(mass), free(ent), free(kv), free(pos);
    return 0;
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *ids_path = NULL;
    int64_t n = 512, tbt_n = 0, gen = 128;
    int reps = 5, threads = 1, cmp_ref = 0, cmp_cap = 0, cmp_stats = 0;
    const char *wdt = "auto", *kvdt = "f32";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) model_path = argv[i + 1];
        else if (!strcmp(argv[i], "--ids")) ids_path = argv[i + 1];
        else if (!strcmp(argv[i], "--tokens")) n = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--tbt-tokens")) tbt_n = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--gen")) gen = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--compare-ref")) cmp_ref = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--capture")) cmp_cap = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--attn-stats")) cmp_stats = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--weight-dtype")) wdt = argv[i + 1];
        else if (!strcmp(argv[i], "--kv-dtype"))
            kvdt = argv[i + 1];
    }
    if (!model_path || n <= gen || reps < 1 || reps > 16) {
        fprintf(stderr,
                "usage: bench_forward --model M [--ids FILE] [--tokens N] [--tbt-tokens T] [--gen G] [--reps R<=16] "
                "[--threads T] [--compare-ref 1] [--capture 1] [--attn-stats 1] [--weight-dtype auto|f32|bf16|f16] "
                "[--kv-dtype f32|f16]\n");
        return 2;
    }
    if (tbt_n <= 0 || tbt_n > n) tbt_n = n;
    kvm_kernels_cpu_set_threads(threads);
    kvm_model *m;
    if (cmp_ref || cmp_cap || cmp_stats) {
        kvm_model *mm;
        if (kvm_model_open(model_path, &mm)) { fprintf(stderr, "%s\n", kvm_errmsg()); return 1; }
        if (cmp_stats) {
            int rc = compare_attn_stats(&mm->cfg, n, reps, threads);
            kvm_model_close(&mm);
            return rc;
        }
        int32_t *tok = malloc((size_t)n * sizeof *tok);
        load_tokens(ids_path, tok, n, mm->cfg.vocab_size);
        kvm_model_close(&mm);
        int rc = cmp_cap ? compare_capture(model_path, tok, n, reps, threads)
                         : compare_ref(model_path, tok, n, gen, reps, threads);
        free(tok);
        return rc;
    }
    kvm_model_weight_dtype wd;
    kvm_kv_dtype kd;
    if (kvm_model_weight_dtype_parse(wdt, &wd) || kvm_kvcache_dtype_parse(kvdt, &kd) ||
        kvm_model_open(model_path, &m) || kvm_model_set_weight_dtype(m, wd)) {
        fprintf(stderr, "%s\n", kvm_errmsg());
        return 1;
    }
    const kvm_model_config *c = &m->cfg;
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    load_tokens(ids_path, ids, n, c->vocab_size);
    float *logits = malloc((size_t)c->vocab_size * sizeof *logits);
    kvm_forward *f, *f1;
    kvm_forward_new(m, NULL, n, &f);
    kvm_forward_new(m, NULL, 1, &f1);
    double tp[16], tt[16], td[16];
    for (int r = 0; r < reps; r++) {
        kvm_kvcache *cache;
        kvm_forward_cache_new_dtype(m, n + gen, kd, &cache);
        double t0 = bench_wall_s();
        if (kvm_forward_prefill(f, cache, ids, n, logits, KVM_LOGITS_LAST)) { fprintf(stderr, "%s\n", kvm_errmsg()); return 1; }
        tp[r] = bench_wall_s() - t0;
        kvm_kvcache_free(&cache);
        /* token by token over the same input (first tbt_n tokens) */
        kvm_forward_cache_new_dtype(m, n, kd, &cache);
        t0 = bench_wall_s();
        for (int64_t i = 0; i < tbt_n; i++) kvm_forward_decode(f1, cache, ids[i], logits);
        tt[r] = bench_wall_s() - t0;
        kvm_kvcache_free(&cache);
        /* decode: prefill n - gen tokens, then gen greedy steps */
        kvm_forward_cache_new_dtype(m, n, kd, &cache);
        kvm_forward_prefill(f, cache, ids, n - gen, logits, KVM_LOGITS_LAST);
        t0 = bench_wall_s();
        for (int64_t i = 0; i < gen; i++) {
            int32_t best = 0;
            for (int v = 1; v < c->vocab_size; v++) best = logits[v] > logits[best] ? v : best;
            kvm_forward_decode(f1, cache, best, logits);
        }
        td[r] = bench_wall_s() - t0;
        kvm_kvcache_free(&cache);
    }
    /* the same prefill with a registered hook set (no-op cache_update/pre_attn callbacks) */
    int64_t calls = 0;
    kvm_forward *fh;
    kvm_forward_new(m, NULL, n, &fh);
    kvm_hooks hk = {.user = &calls, .cache_update = noop_hook, .pre_attn = noop_hook};
    kvm_forward_add_hooks(fh, &hk);
    double th[16];
    for (int r = 0; r < reps; r++) {
        kvm_kvcache *cache;
        kvm_forward_cache_new_dtype(m, n, kd, &cache);
        double t0 = bench_wall_s();
        kvm_forward_prefill(fh, cache, ids, n, logits, KVM_LOGITS_LAST);
        th[r] = bench_wall_s() - t0;
        kvm_kvcache_free(&cache);
    }
    kvm_forward_free(&fh);
    double p = bench_median(tp, reps), t = bench_median(tt, reps), d = bench_median(td, reps), h = bench_median(th, reps);
    double model_gf = prefill_flops(c, (double)n) / p / 1e9, blas_gf = sgemm_gflops(c, n, reps);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("model=%s weight_dtype=%s kv_dtype=%s dim=%d layers=%d threads=%d N=%lld reps=%d\n", model_path, wdt, kvdt,
           c->dim, c->n_layers, threads, (long long)n, reps);
    printf("  prefill_tok_s=%.0f (%.1f ms for %lld tokens)\n", (double)n / p, p * 1e3, (long long)n);
    printf("  token_by_token_tok_s=%.0f (first %lld tokens of the same input)\n", (double)tbt_n / t, (long long)tbt_n);
    printf("  prefill_vs_token_by_token=%.1fx\n", ((double)n / p) / ((double)tbt_n / t));
    printf("  decode_tok_s=%.1f (%.1f ms per step; %lld greedy steps after %lld context tokens)\n", (double)gen / d,
           d * 1e3 / (double)gen, (long long)gen, (long long)(n - gen));
    printf("  prefill_gflops=%.1f sgemm_same_shapes_gflops=%.1f ratio=%.2f\n", model_gf, blas_gf, model_gf / blas_gf);
    printf("  hooks_registered_overhead=%+.1f%% (%lld no-op callbacks)\n", 100.0 * (h - p) / p, (long long)calls);
    printf("  peak_rss_mib=%.0f\n", (double)ru.ru_maxrss / 1024.0);
    free(ids); free(logits);
    kvm_forward_free(&f); kvm_forward_free(&f1);
    kvm_model_close(&m);
    return 0;
}
