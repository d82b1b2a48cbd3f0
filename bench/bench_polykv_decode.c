/* bench_polykv_decode.c: the cost of one PolyKV decode-phase calibration run, batched (the
 * compressed layer replayed token by token from the full-KV run's queries, keys and values,
 * then one batched continuation) against token by token (the whole model one decode call per
 * token), beside a prefill-phase run, on one document of pseudo-text (costs do not depend on
 * the text): CPU seconds of the process (CLOCK_PROCESS_CPUTIME_ID, so a loaded machine
 * changes them less than wall time), each minus the full-KV reference continuation that
 * every kvm_polykv_signal_run call makes, and the signals of both decode paths side by side.
 *   build/bench/bench_polykv_decode --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
 *       [--n 2048] [--t 128] [--budget 256] [--pattern h2o] [--layers 0,15,29] [--threads 1] */
#include "bench/bench_util.h"
#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int die(const char *what)
{
    fprintf(stderr, "bench_polykv_decode: %s: %s\n", what, kvm_errmsg());
    return 1;
}

static double cpu_s(void) { return bench_clock_s(CLOCK_PROCESS_CPUTIME_ID); }

int main(int argc, char **argv)
{
    const char *model = NULL, *pattern = "h2o", *layers = NULL;
    int64_t n = 2048, t = 128, budget = 256, threads = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) model = argv[i + 1];
        else if (!strcmp(argv[i], "--n")) n = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--t")) t = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--budget")) budget = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--pattern")) pattern = argv[i + 1];
        else if (!strcmp(argv[i], "--layers")) layers = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoll(argv[i + 1]);
        else {
            fprintf(stderr, "bench_polykv_decode: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    kvm_pattern pat;
    if (!model || n < 2 || t < 2 || budget < 1 || threads < 1 || kvm_pattern_parse(pattern, &pat)) {
        fprintf(stderr, "usage: bench_polykv_decode --model M [--n N] [--t T] [--budget B] [--pattern P] "
                        "[--layers L,L,...] [--threads K]\n");
        return 2;
    }
    kvm_kernels_cpu_set_threads((int)threads);
    kvm_model *m;
    if (kvm_model_open(model, &m)) return die(model);
    const int L = m->cfg.n_layers, V = m->cfg.vocab_size;
    if (n + t > m->cfg.seq_len) n = m->cfg.seq_len - t;
    int32_t *ids = malloc((size_t)(n + t) * sizeof *ids);
    if (!ids) return die("tokens");
    uint64_t s = 12345;
    for (int64_t i = 0; i < n + t; i++) { /* pseudo-text, BOS first */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = i == 0 ? m->cfg.bos_id : (int32_t)((s >> 33) % (uint64_t)V);
    }
    int sel[64], n_sel = 0;
    for (const char *p = layers ? layers : ""; *p && n_sel < 64; p += strcspn(p, ","), p += *p == ',')
        sel[n_sel++] = atoi(p);
    if (!layers) {
        sel[0] = 0, sel[1] = L / 2, sel[2] = L - 1;
        n_sel = 3;
    }
    double c0 = cpu_s(), w0 = bench_wall_s();
    kvm_eval_doc *d;
    if (kvm_eval_doc_new(m, NULL, ids, n + t, n, t, &d)) return die("document");
    printf("model %s, context %lld, continuation %lld, budget %lld, pattern %s; document prepared in %.1f s CPU "
           "(%.1f s wall)\n",
           model, (long long)n, (long long)t, (long long)budget, pattern, cpu_s() - c0, bench_wall_s() - w0);
    kvm_eval_result r;
    c0 = cpu_s();
    if (kvm_eval_continue(d, kvm_eval_doc_full(d), NULL, NULL, &r)) return die("reference continuation");
    const double ref = cpu_s() - c0;
    printf("reference continuation (in every run below, subtracted): %.2f s CPU\n", ref);
    /* the token-by-token path compares with a token-by-token full-KV reference, made once per
     * document on first use: made here (with one more token-by-token run, a no-op policy) */
    kvm_evict_plan *none = NULL;
    kvm_decode_policy *pol = NULL;
    c0 = cpu_s();
    if (kvm_evict_plan_new(L, m->cfg.n_kv_heads, KVM_PATTERN_NONE, 1, &none) ||
        kvm_evict_decode_new(&m->cfg, none, NULL, &pol) || kvm_eval_continue(d, kvm_eval_doc_full(d), pol, NULL, &r))
        return die("token-by-token reference");
    printf("token-by-token reference + one token-by-token continuation (once per document, old path only): %.2f s CPU\n",
           cpu_s() - c0);
    kvm_decode_policy_free(&pol);
    kvm_evict_plan_free(&none);
    printf("%5s %14s %14s %14s %9s %12s %12s %12s %12s\n", "layer", "prefill run s", "batched dec s", "stepwise dec s",
           "speed-up", "cos batched", "cos stepwise", "KL batched", "KL stepwise");
    double sum_b = 0, sum_s = 0, sum_p = 0;
    for (int i = 0; i < n_sel; i++) {
        double cos[3], ppl[3], kl[3], sec[3];
        const int phase[3] = {KVM_PHASE_PREFILL, KVM_PHASE_DECODE, KVM_PHASE_DECODE};
        const int mode[3] = {KVM_POLYKV_DECODE_BATCHED, KVM_POLYKV_DECODE_BATCHED, KVM_POLYKV_DECODE_STEPWISE};
        for (int k = 0; k < 3; k++) {
            c0 = cpu_s();
            if (kvm_polykv_signal_run(d, phase[k], sel[i], pat, budget, mode[k], &cos[k], &ppl[k], &kl[k]))
                return die("run");
            sec[k] = cpu_s() - c0 - ref;
        }
        sum_p += sec[0];
        sum_b += sec[1];
        sum_s += sec[2];
        printf("%5d %14.2f %14.2f %14.2f %8.1fx %12.8f %12.8f %12.8f %12.8f\n", sel[i], sec[0], sec[1], sec[2],
               sec[2] / sec[1], cos[1], cos[2], kl[1], kl[2]);
    }
    const double runs = (double)L * KVM_PATTERN_COUNT; /* decode-phase runs per calibration document */
    printf("mean per run: prefill %.2f s, decode batched %.2f s, token by token %.2f s (%.1fx); per document "
           "(%d layers x %d patterns): decode phase %.0f s batched vs %.0f s token by token CPU\n",
           sum_p / n_sel, sum_b / n_sel, sum_s / n_sel, sum_s / sum_b, L, KVM_PATTERN_COUNT, runs * sum_b / n_sel,
           runs * sum_s / n_sel);
    kvm_eval_doc_free(&d);
    free(ids);
    kvm_model_close(&m);
    return 0;
}
