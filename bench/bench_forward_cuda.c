/* bench_forward_cuda.c: the CUDA forward's speed (issue 13) on random-weight models made on the
 * device from a shape and a seed (no weight file travels): prefill tokens/s at N tokens
 * (statistics off, logits of the last position only), the same forward's GEMMs through cuBLAS
 * alone in the same run (kvm_cuda_model_gemm_only) and prefill's share of that, and decode
 * tokens/s at context N.
 *   bench_forward_cuda [--device cuda:0] [--shape qwen2.5-1.5b|smollm2|stories] [--tokens 2048]
 *                      [--gen 64] [--reps 5] [--dtype bf16|f16|f32] [--evict PATTERN]
 * Prints a CSV line "kvmill,<shape>,<device>,<dtype>,N,<n>,prefill_tok_s,<x>,gemm_only_tok_s,<y>,
 * share,<x/y>,decode_tok_s,<z>" after human-readable lines. With --evict (streaming, h2o, tova,
 * snapkv, pyramidkv: kvm_pattern numbers 0–4 by name) also the device eviction of the prefill
 * phase: the prefill keeping the patterns' statistics (window 16) and kvm_cuda_model_evict of
 * every (layer, KV head) to N/4, medians of reps, as a second line "kvmill-evict,<shape>,
 * <device>,<dtype>,N,<n>,pattern,<p>,budget,<b>,prefill_stats_ms,<x>,evict_ms,<y>". Exit 2
 * without a device. */
#include "bench/bench_util.h"
#include "common/kvm_error.h"
#include "kernels/kvm_kernels.h"
#ifdef KVM_WITH_CUDA
#include "kernels/cuda/kvm_cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KVM_WITH_CUDA
typedef struct shape {
    const char *name;
    kvm_cuda_model_desc d;
} shape;

static const shape SHAPES[] = {
    /* Qwen2.5-1.5B: 28 layers, hidden 1536, 12 q / 2 KV heads, head 128, FFN 8960, vocab 151936 (its q/k/v
     * biases are left out: three vector adds per layer) */
    {"qwen2.5-1.5b", {.n_layers = 28, .dim = 1536, .n_heads = 12, .n_kv_heads = 2, .head_dim = 128,
                      .hidden_dim = 8960, .vocab_size = 151936, .norm_eps = 1e-6f, .rope_theta = 1e6f,
                      .rope_style = KVM_ROPE_HALF}},
    /* SmolLM2-135M: 30 layers, hidden 576, 9 q / 3 KV heads, head 64, FFN 1536, vocab 49152 */
    {"smollm2", {.n_layers = 30, .dim = 576, .n_heads = 9, .n_kv_heads = 3, .head_dim = 64, .hidden_dim = 1536,
                 .vocab_size = 49152, .norm_eps = 1e-5f, .rope_theta = 1e5f, .rope_style = KVM_ROPE_HALF}},
    /* stories260K: 5 layers, dim 64, 8 q / 4 KV heads, head 8, FFN 172, vocab 512 */
    {"stories", {.n_layers = 5, .dim = 64, .n_heads = 8, .n_kv_heads = 4, .head_dim = 8, .hidden_dim = 172,
                 .vocab_size = 512, .norm_eps = 1e-5f, .rope_theta = 1e4f, .rope_style = KVM_ROPE_INTERLEAVED}},
};

static int fail(const char *what)
{
    fprintf(stderr, "bench_forward_cuda: %s: %s\n", what, kvm_errmsg());
    return 1;
}

int main(int argc, char **argv)
{
    const char *device = "cuda:0", *shape_name = "qwen2.5-1.5b", *dtype = "bf16", *evict = NULL;
    long n = 2048, gen = 64, reps = 5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) { fprintf(stderr, "bench_forward_cuda: %s needs a value\n", a); return 2; }
        if (!strcmp(a, "--device")) device = v;
        else if (!strcmp(a, "--shape")) shape_name = v;
        else if (!strcmp(a, "--dtype")) dtype = v;
        else if (!strcmp(a, "--tokens")) n = atol(v);
        else if (!strcmp(a, "--gen")) gen = atol(v);
        else if (!strcmp(a, "--reps")) reps = atol(v);
        else if (!strcmp(a, "--evict")) evict = v;
        else { fprintf(stderr, "bench_forward_cuda: unknown option %s\n", a); return 2; }
        i++;
    }
    const shape *sh = NULL;
    for (size_t i = 0; i < sizeof SHAPES / sizeof *SHAPES; i++)
        if (!strcmp(SHAPES[i].name, shape_name)) sh = &SHAPES[i];
    if (!sh) { fprintf(stderr, "bench_forward_cuda: --shape %s: expected qwen2.5-1.5b, smollm2 or stories\n", shape_name); return 2; }
    static const char *const pattern_names[] = {"streaming", "h2o", "tova", "snapkv", "pyramidkv"};
    int pattern = -1;
    for (int i = 0; evict && i < 5; i++)
        if (!strcmp(evict, pattern_names[i])) pattern = i;
    if (evict && pattern < 0) { fprintf(stderr, "bench_forward_cuda: --evict %s: expected streaming, h2o, tova, snapkv or pyramidkv\n", evict); return 2; }
    kvm_cuda_wdtype t = !strcmp(dtype, "bf16") ? KVM_CUDA_BF16 : !strcmp(dtype, "f16") ? KVM_CUDA_F16 : KVM_CUDA_F32;
    if (strcmp(dtype, "bf16") && strcmp(dtype, "f16") && strcmp(dtype, "f32")) { fprintf(stderr, "bench_forward_cuda: --dtype %s: expected bf16, f16 or f32\n", dtype); return 2; }
    if (n < 2 || n > 1 << 20 || gen < 1 || gen > 1 << 16 || reps < 1 || reps > 100) { fprintf(stderr, "bench_forward_cuda: --tokens in [2, 2^20], --gen in [1, 65536], --reps in [1, 100]\n"); return 2; }
    const kvm_kernels *k;
    if (kvm_kernels_select(device, &k)) {
        fprintf(stderr, "bench_forward_cuda: --device: %s\n", kvm_errmsg());
        return 2;
    }
    int dev = atoi(device + 5);
    kvm_cuda_model_desc d = sh->d;
    d.seed = 1;
    printf("bench_forward_cuda: %s, %s weights, N = %ld, %zu bytes planned\n", sh->name, dtype, n,
           kvm_cuda_model_bytes(&d, t, n + gen, n));
    kvm_cuda_model *m;
    double t0 = bench_wall_s();
    if (kvm_cuda_model_new(dev, &d, t, n + gen, n, &m)) return fail("model");
    printf("  made on the device in %.2f s\n", bench_wall_s() - t0);
    int32_t *tok = malloc((size_t)(n + gen) * sizeof *tok);
    float *logits = malloc((size_t)d.vocab_size * sizeof *logits);
    double *pre = malloc((size_t)(reps + 1) * sizeof *pre), *dec = malloc((size_t)(reps + 1) * sizeof *dec);
    if (!tok || !logits || !pre || !dec) { fprintf(stderr, "bench_forward_cuda: out of memory\n"); return 1; }
    for (long i = 0; i < n + gen; i++) tok[i] = (int32_t)((i * 7919 + 13) % d.vocab_size);
    for (long r = 0; r <= reps; r++) { /* repetition 0 warms up (cuBLAS heuristics, pools) */
        kvm_cuda_model_reset(m);
        double a = bench_wall_s();
        if (kvm_cuda_model_forward(m, tok, n, logits, 1, NULL)) return fail("prefill");
        double b = bench_wall_s();
        for (long g = 0; g < gen; g++)
            if (kvm_cuda_model_forward(m, tok + n + g, 1, logits, 1, NULL)) return fail("decode");
        double c = bench_wall_s();
        pre[r] = (double)n / (b - a);
        dec[r] = (double)gen / (c - b);
    }
    double prefill = bench_median(pre + 1, (int)reps), decode = bench_median(dec + 1, (int)reps), gs = 0, gf = 0;
    double gemm_tok_s = 0;
    if (t != KVM_CUDA_F32) {
        if (kvm_cuda_model_gemm_only(m, n, (int)reps, &gs, &gf)) return fail("gemm_only");
        gemm_tok_s = (double)n / gs;
        printf("  cuBLAS alone on the forward's GEMMs: %.3f ms per forward, %.1f TFLOP/s\n", gs * 1e3, gf / gs / 1e12);
    }
    printf("  prefill %.0f tokens/s (%.1f ms), decode %.1f tokens/s at context %ld, medians of %ld\n", prefill,
           1e3 * n / prefill, decode, n, reps);
    printf("kvmill,%s,%s,%s,N,%ld,prefill_tok_s,%.0f,gemm_only_tok_s,%.0f,share,%.2f,decode_tok_s,%.1f\n", sh->name,
           device, dtype, n, prefill, gemm_tok_s, gemm_tok_s > 0 ? prefill / gemm_tok_s : 0.0, decode);
    if (evict) {
        const int64_t nh = (int64_t)d.n_layers * d.n_kv_heads, b = n / 4;
        uint8_t *pat = malloc((size_t)nh);
        int64_t *bud = malloc((size_t)nh * sizeof *bud);
        if (!pat || !bud) { fprintf(stderr, "bench_forward_cuda: out of memory\n"); return 1; }
        for (int64_t i = 0; i < nh; i++) pat[i] = (uint8_t)pattern, bud[i] = b;
        kvm_cuda_evict_plan ep = {.pattern = pat, .budget = bud, .sinks = 4, .window = 16, .pool = 7, .recent_frac = 0.5};
        for (long r = 0; r <= reps; r++) {
            kvm_cuda_model_reset(m);
            if (kvm_cuda_model_keep_evict_stats(m, 16)) return fail("keep_evict_stats"); /* the next forward's */
            double a = bench_wall_s();
            if (kvm_cuda_model_forward(m, tok, n, logits, 1, NULL)) return fail("prefill with statistics");
            double bt = bench_wall_s();
            if (kvm_cuda_model_evict(m, &ep)) return fail("evict");
            pre[r] = 1e3 * (bt - a);
            dec[r] = 1e3 * (bench_wall_s() - bt);
        }
        double pm = bench_median(pre + 1, (int)reps), em = bench_median(dec + 1, (int)reps);
        printf("  %s eviction to %lld of %ld entries per KV head: prefill with statistics %.1f ms, eviction %.2f ms "
               "(%lld heads), medians of %ld\n", evict, (long long)b, n, pm, em, (long long)nh, reps);
        printf("kvmill-evict,%s,%s,%s,N,%ld,pattern,%s,budget,%lld,prefill_stats_ms,%.2f,evict_ms,%.3f\n", sh->name,
               device, dtype, n, evict, (long long)b, pm, em);
        free(pat);
        free(bud);
    }
    kvm_cuda_model_free(&m);
    free(tok);
    free(logits);
    free(pre);
    free(dec);
    return 0;
}
#else
int main(void)
{
    fprintf(stderr, "bench_forward_cuda: no CUDA device: this kvmill was built without CUDA (nvcc not found or CUDA=0)\n");
    return 2;
}
#endif
