/* kvm_polykv_refine.c: coordinate-descent refinement of a strategy's per-layer budgets and
 * patterns directly on the calibration objective (mean KL over the calibration documents),
 * starting from the best signal-built candidate. */
#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int kvm_polykv_refine(kvm_eval_doc *const *docs, int n_docs, const kvm_strategy *s, int max_rounds, FILE *log,
                      kvm_strategy **out, double *kl_out)
{
    *out = NULL;
    kvm_strategy *cur = NULL, *trial = NULL;
    const int L = s->n_layers;
    const int64_t B = s->budget_avg, dmin = B / 16 > 1 ? B / 16 : 1;
    int64_t delta = B / 4 > 1 ? B / 4 : 1;
    const int64_t n_ctx = n_docs > 0 ? kvm_eval_doc_input(docs[0])->n_tokens : 0;
    double kl;
    int rc = kvm_strategy_clone(s, &cur);
    if (!rc) rc = kvm_strategy_clone(s, &trial);
    if (!rc) rc = kvm_polykv_score(docs, n_docs, cur, NULL, &kl);
    for (int round = 0; !rc && round < max_rounds;) {
        double best = kl;
        int bi = -1, bj = -1, bl = -1, bp = -1;
        for (int i = 0; !rc && i < L; i++) /* budget moves i → j */
            for (int j = 0; !rc && j < L; j++) {
                if (i == j || cur->layers[i].budget - delta < cur->b_min ||
                    (n_ctx > 0 && cur->layers[j].budget + delta > n_ctx))
                    continue; /* a layer above the context keeps only the context: the entries were lost */
                memcpy(trial->layers, cur->layers, (size_t)L * sizeof *trial->layers);
                trial->layers[i].budget -= delta;
                trial->layers[j].budget += delta;
                double v;
                if (!(rc = kvm_polykv_score(docs, n_docs, trial, NULL, &v)) && v < best - 1e-12) {
                    best = v;
                    bi = i;
                    bj = j;
                }
            }
        for (int l = 0; !rc && l < L; l++) /* pattern moves */
            for (int p = 0; !rc && p < KVM_PATTERN_COUNT; p++) {
                if (p == KVM_PATTERN_PYRAMIDKV || p == (int)cur->layers[l].pattern[0]) continue;
                memcpy(trial->layers, cur->layers, (size_t)L * sizeof *trial->layers);
                trial->layers[l].pattern[0] = trial->layers[l].pattern[1] = (kvm_pattern)p;
                double v;
                if (!(rc = kvm_polykv_score(docs, n_docs, trial, NULL, &v)) && v < best - 1e-12) {
                    best = v;
                    bl = l;
                    bp = p;
                    bi = bj = -1;
                }
            }
        if (rc) break;
        if (bl >= 0) {
            cur->layers[bl].pattern[0] = cur->layers[bl].pattern[1] = (kvm_pattern)bp;
            if (log)
                fprintf(log, "  refine: layer %d -> %s, KL %.6f -> %.6f\n", bl, kvm_pattern_name((kvm_pattern)bp), kl,
                        best);
        } else if (bi >= 0) {
            cur->layers[bi].budget -= delta;
            cur->layers[bj].budget += delta;
            if (log)
                fprintf(log, "  refine: %lld entries layer %d -> layer %d, KL %.6f -> %.6f\n", (long long)delta, bi, bj,
                        kl, best);
        } else {
            if (delta <= dmin) break;
            delta /= 2;
            continue;
        }
        kl = best;
        round++;
    }
    kvm_strategy_free(&trial);
    if (rc) {
        kvm_strategy_free(&cur);
        return rc;
    }
    cur->select = KVM_POLYKV_SELECT_SEARCH;
    cur->alloc = KVM_POLYKV_ALLOC_SEARCH;
    *out = cur;
    *kl_out = kl;
    return 0;
}
