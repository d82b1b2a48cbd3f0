/* kvm_cpu_attn.c: one head's attention over a ragged, position-sorted KV cache on the CPU.
 * Queries are processed in blocks; each block only touches the prefix of entries visible
 * to its last query, so causal prefill does about half the work of a dense N x N pass,
 * while the two products (QK^T and PV) stay large enough for OpenBLAS to run near peak. */
#include "kernels/cpu/kvm_cpu.h"
#include "kernels/cpu/kvm_cpu_math.h"
#include "common/kvm_error.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KVM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVM_CLONES
#endif

enum { KVM_ATTN_QBLOCK = 128 };

/* Number of entries among pos[0, n) with pos <= p (pos sorted, KVM_POS_NONE = -1 first). */
static int64_t visible_count(const int32_t *pos, int64_t n, int32_t p)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (pos[mid] <= p) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* In-place softmax of row[0, vis) (scores, bias added), zero on [vis, width). */
KVM_CLONES
static void softmax_row(float *row, const float *bias, int64_t vis, int64_t width)
{
    if (bias)
        for (int64_t e = 0; e < vis; e++) row[e] += bias[e];
    float mx = -INFINITY;
    for (int64_t e = 0; e < vis; e++) mx = row[e] > mx ? row[e] : mx;
    float sum = 0.0f;
    for (int64_t e = 0; e < vis; e++) {
        row[e] = kvm__expf(row[e] - mx);
        sum += row[e];
    }
    float inv = vis > 0 ? 1.0f / sum : 0.0f;
    for (int64_t e = 0; e < vis; e++) row[e] *= inv;
    if (width > vis) memset(row + vis, 0, (size_t)(width - vis) * sizeof *row);
}

int kvm__cpu_attention(const kvm_attn_head *a)
{
    if (a->n_q < 0 || a->n_e < 0 || a->head_dim <= 0)
        return kvm_err(KVM_EINVAL, "attention: bad sizes n_q=%lld n_e=%lld head_dim=%d", (long long)a->n_q,
                       (long long)a->n_e, a->head_dim);
    const int d = a->head_dim;
    for (int64_t i0 = 0; i0 < a->n_q; i0 += KVM_ATTN_QBLOCK) {
        int64_t nb = a->n_q - i0 < KVM_ATTN_QBLOCK ? a->n_q - i0 : KVM_ATTN_QBLOCK;
        int32_t pmax = a->qpos[i0];
        for (int64_t i = 1; i < nb; i++) pmax = a->qpos[i0 + i] > pmax ? a->qpos[i0 + i] : pmax;
        int64_t e_end = visible_count(a->pos, a->n_e, pmax);
        float *p = a->probs + i0 * a->n_e;
        int rc = kvm__cpu_sgemm(0, 1, nb, e_end, d, a->scale, a->q + i0 * a->ldq, a->ldq, a->k, d, 0.0f, p,
                                a->n_e);
        if (rc) return rc;
        for (int64_t i = 0; i < nb; i++) {
            int64_t vis = visible_count(a->pos, e_end, a->qpos[i0 + i]);
            softmax_row(p + i * a->n_e, a->bias, vis, a->n_e);
        }
        float *o = a->out + i0 * a->ldo;
        if (e_end == 0) {
            for (int64_t i = 0; i < nb; i++) memset(o + i * a->ldo, 0, (size_t)d * sizeof *o);
            continue;
        }
        rc = kvm__cpu_sgemm(0, 0, nb, d, e_end, 1.0f, p, a->n_e, a->v, d, 0.0f, o, a->ldo);
        if (rc) return rc;
    }
    return 0;
}
