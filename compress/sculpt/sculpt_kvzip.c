/* sculpt_kvzip.c: the KVzip-style baseline (Kim et al., "KVzip: Query-Agnostic KV Cache
 * Compression with Context Reconstruction", arXiv 2505.23416 §3.2) on one KVSculpt problem: every
 * compress-zone entry is scored by the largest attention probability any training query (with
 * query_source = repeat: the context-reconstruction queries) gives it, and the top k are kept
 * with their own keys and values. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"
#include "kernels/kvm_blas.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { KVZIP_BLOCK = 256 };

int kvm_sculpt_kvzip_head(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, float *kc, float *vc,
                          float *beta, kvm_sculpt_head_stats *st)
{
    memset(st, 0, sizeof *st);
    const int64_t nq = p->nq, nc = p->nc;
    const int d = p->d;
    if (k < 0 || k > nc) return kvm_err(KVM_EINVAL, "kvzip: k = %lld entries but the compress zone has %lld", (long long)k, (long long)nc);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    float *S = malloc((size_t)(KVZIP_BLOCK * (nc > 0 ? nc : 1)) * sizeof *S), *score = malloc((size_t)(nc > 0 ? nc : 1) * sizeof *score);
    uint8_t *taken = calloc((size_t)(nc > 0 ? nc : 1), 1);
    int rc = 0;
    if (!S || !score || !taken) {
        rc = kvm_err(KVM_ENOMEM, "kvzip: out of memory");
        goto done;
    }
    for (int64_t j = 0; j < nc; j++)
        score[j] = -INFINITY; /* max over queries of the log-probability */
    for (int64_t i0 = 0; nc > 0 && i0 < nq; i0 += KVZIP_BLOCK) {
        int64_t nb = nq - i0 < KVZIP_BLOCK ? nq - i0 : KVZIP_BLOCK;
        kvm_blas_lock(); /* one BLAS call at a time: the problems' workers call it concurrently */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nb, (int)nc, d, p->scale, p->q + i0 * d, d, p->kz, d,
                    0.0f, S, (int)nc);
        kvm_blas_unlock();
        for (int64_t i = 0; i < nb; i++) {
            double lz = p->lse_zone[i0 + i], lr = p->lse_ret[i0 + i];
            double hi = fmax(lz, lr), lse = hi + log(exp(lz - hi) + exp(lr - hi)); /* full softmax denominator */
            for (int64_t j = 0; j < nc; j++)
                score[j] = fmaxf(score[j], S[i * nc + j] - (float)lse);
        }
    }
    for (int64_t j = 0; j < nc; j++) /* exp is monotonic: the max of the probabilities, one exp per entry */
        score[j] = expf(score[j]);
    for (int64_t a = 0; a < k; a++) { /* top k, ties to the lower index */
        int64_t best = -1;
        for (int64_t j = 0; j < nc; j++)
            if (!taken[j] && (best < 0 || score[j] > score[best])) best = j;
        if (best < 0) break;
        taken[best] = 1;
    }
    for (int64_t j = 0, n = 0; j < nc && n < k; j++)
        if (taken[j]) {
            memcpy(kc + n * d, p->kz + j * d, (size_t)d * sizeof *kc);
            memcpy(vc + n * d, p->vz + j * d, (size_t)d * sizeof *vc);
            beta[n++] = 0;
        }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    st->lbfgs_s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    st->loss0 = st->loss = kvm_sculpt_loss(p, kc, vc, beta, k, o->lambda, NULL, NULL, &st->mse, NULL);
    if (!isfinite(st->loss)) rc = kvm_err(KVM_ERANGE, "kvzip: non-finite loss (k = %lld)", (long long)k);
done:
    free(S);
    free(score);
    free(taken);
    return rc;
}
