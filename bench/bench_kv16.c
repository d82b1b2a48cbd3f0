/* bench_kv16.c: the f16 KV cache ([model] kv_dtype) against the float32 one on the same model
 * and tokens, in one run: the logits of every position (prefilled in chunks of --chunk tokens,
 * both caches side by side) as KL(f32 || f16) mean and max in nats, max |Δlogit| and argmax
 * agreement; then CPU seconds (this process, CLOCK_PROCESS_CPUTIME_ID) of the whole prefill and
 * of --decode decode steps after it, for each dtype, alternating --reps times (medians).
 * Prints `key=value` lines. Usage: bench_kv16 --model M [--tokens FILE] [--n 2048] [--chunk 256]
 * [--decode 32] [--reps 3] [--threads 1] [--kl 1] (--kl 0: the CPU seconds only). */
#include "bench/bench_util.h"
#include "compress/eval/kvm_eval.h"
#include "model/kvm_forward.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int die(const char *what)
{
    fprintf(stderr, "bench_kv16: %s: %s\n", what, kvm_errmsg());
    return 1;
}

/* KL(p || q) in nats of two logit rows (the harness's kvm_eval_kl), and the largest
 * |difference| of the logits into *mx. */
static double kl_row(const float *p, const float *q, int n, double *mx)
{
    for (int i = 0; i < n; i++) {
        double d = fabs((double)p[i] - q[i]);
        if (d > *mx) *mx = d;
    }
    return kvm_eval_kl(p, q, n);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++) b = x[i] > x[b] ? i : b;
    return b;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *tokens = NULL;
    int64_t n = 2048, chunk = 256, n_dec = 32, reps = 3, threads = 1, want_kl = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) model = argv[i + 1];
        else if (!strcmp(argv[i], "--tokens")) tokens = argv[i + 1];
        else if (!strcmp(argv[i], "--n")) n = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--chunk")) chunk = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--decode")) n_dec = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--kl")) want_kl = atoll(argv[i + 1]);
        else {
            fprintf(stderr, "bench_kv16: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!model || n < 2 || chunk < 1 || n_dec < 0 || reps < 1 || threads < 1) {
        fprintf(stderr, "usage: bench_kv16 --model M [--tokens FILE] [--n N] [--chunk C] [--decode T] [--reps R] [--threads K]\n");
        return 2;
    }
    kvm_kernels_cpu_set_threads((int)threads);
    kvm_model *m;
    if (kvm_model_open(model, &m)) return die(model);
    const int V = m->cfg.vocab_size;
    if (n + n_dec > m->cfg.seq_len) n = m->cfg.seq_len - n_dec;
    int32_t *ids = malloc((size_t)(n + n_dec) * sizeof *ids);
    int64_t got = 0;
    FILE *f = tokens ? fopen(tokens, "r") : NULL;
    for (int v; f && got < n + n_dec && fscanf(f, "%d", &v) == 1;) ids[got++] = v % V;
    if (f) fclose(f);
    for (uint64_t s = 12345; got < n + n_dec; got++) { /* past the file: pseudo-text, BOS first */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        ids[got] = got == 0 ? m->cfg.bos_id : (int32_t)((s >> 33) % (uint64_t)V);
    }
    kvm_forward *fw;
    if (kvm_forward_new(m, NULL, chunk, &fw)) return die("forward");
    /* logits of every position, chunk by chunk on both caches */
    float *la = malloc((size_t)chunk * V * sizeof *la), *lb = malloc((size_t)chunk * V * sizeof *lb);
    kvm_kvcache *ca, *cb;
    if (!la || !lb || kvm_forward_cache_new_dtype(m, n, KVM_KV_F32, &ca) ||
        kvm_forward_cache_new_dtype(m, n, KVM_KV_F16, &cb))
        return die("out of memory");
    double kl_sum = 0, kl_max = 0, mx = 0;
    int64_t same = 0;
    for (int64_t i0 = 0; want_kl && i0 < n; i0 += chunk) {
        int64_t nb = n - i0 < chunk ? n - i0 : chunk;
        if (kvm_forward_prefill(fw, ca, ids + i0, nb, la, KVM_LOGITS_ALL) ||
            kvm_forward_prefill(fw, cb, ids + i0, nb, lb, KVM_LOGITS_ALL))
            return die("prefill");
        for (int64_t t = 0; t < nb; t++) {
            double kl = kl_row(la + t * V, lb + t * V, V, &mx);
            kl_sum += kl;
            kl_max = kl > kl_max ? kl : kl_max;
            same += argmax(la + t * V, V) == argmax(lb + t * V, V);
        }
    }
    if (want_kl)
        printf("model=%s\npositions=%lld\nkl_mean=%.3g\nkl_max=%.3g\nmax_abs_dlogit=%.3g\nargmax_equal=%lld\n", model,
           (long long)n, kl_sum / (double)n, kl_max, mx, (long long)same);
    printf("kv_bytes_f32=%lld\nkv_bytes_f16=%lld\n", (long long)kvm_kvcache_bytes(ca), (long long)kvm_kvcache_bytes(cb));
    kvm_kvcache_free(&ca);
    kvm_kvcache_free(&cb);
    kvm_forward_free(&fw);
    /* CPU seconds: a prefill of n (chunks of 512, as generate), then n_dec decode steps */
    if (kvm_forward_new(m, NULL, 512, &fw)) return die("forward");
    double *pre[2], *dec[2];
    for (int d = 0; d < 2; d++) pre[d] = calloc((size_t)reps, sizeof(double)), dec[d] = calloc((size_t)reps, sizeof(double));
    for (int64_t r = 0; r < reps; r++)
        for (int d = 0; d < 2; d++) {
            kvm_kv_dtype dt = (r + d) % 2 ? KVM_KV_F16 : KVM_KV_F32; /* alternate which goes first */
            kvm_kvcache *c;
            if (kvm_forward_cache_new_dtype(m, n + n_dec, dt, &c)) return die("cache");
            double t0 = bench_clock_s(CLOCK_PROCESS_CPUTIME_ID);
            if (kvm_forward_prefill(fw, c, ids, n, la, KVM_LOGITS_LAST)) return die("prefill");
            double t1 = bench_clock_s(CLOCK_PROCESS_CPUTIME_ID);
            for (int64_t t = 0; t < n_dec; t++)
                if (kvm_forward_decode(fw, c, ids[n + t], la)) return die("decode");
            double t2 = bench_clock_s(CLOCK_PROCESS_CPUTIME_ID);
            pre[dt][r] = t1 - t0;
            dec[dt][r] = t2 - t1;
            kvm_kvcache_free(&c);
        }
    for (int d = 0; d < 2; d++) {
        const char *name = d ? "f16" : "f32";
        double p = bench_median(pre[d], (int)reps), q = bench_median(dec[d], (int)reps);
        printf("prefill_cpu_s_%s=%.3f\nprefill_tok_per_cpu_s_%s=%.1f\n", name, p, name, (double)n / p);
        if (n_dec > 0) printf("decode_cpu_s_%s=%.3f\ndecode_tok_per_cpu_s_%s=%.2f\n", name, q, name, (double)n_dec / q);
        free(pre[d]);
        free(dec[d]);
    }
    printf("reps=%lld\nthreads=%lld\n", (long long)reps, (long long)threads);
    kvm_forward_free(&fw);
    free(la);
    free(lb);
    free(ids);
    kvm_model_close(&m);
    return 0;
}
