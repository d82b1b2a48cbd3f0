/* kvm_cpu_attn_ref.c: the per-head CPU attention the per-layer kernel replaced (see
 * kvm_cpu_attn_ref.h), unchanged in its arithmetic, and a per-layer adapter over it that
 * reduces the statistics from explicit probability matrices. */
#include "kernels/cpu/kvm_cpu_attn_ref.h"
#include "kernels/cpu/kvm_cpu.h"
#include "kernels/cpu/kvm_cpu_attn_rows.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_pool.h"
#include "common/kvm_error.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Per-thread packed K and V of the head being processed and the probability matrix of
 * the per-layer adapter (grown, never shrunk), freed when the thread exits. */
typedef struct ref_scratch {
    kvm_cpu_packed k, v;
    float *probs;
    size_t probs_cap;
} ref_scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
    ref_scratch *s = p;
    kvm__cpu_packed_free(&s->k);
    kvm__cpu_packed_free(&s->v);
    free(s->probs);
    free(s);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static ref_scratch *scratch_get(void)
{
    pthread_once(&scratch_once, scratch_init);
    ref_scratch *s = pthread_getspecific(scratch_key);
    if (!s && (s = calloc(1, sizeof *s)) && pthread_setspecific(scratch_key, s)) {
        free(s);
        s = NULL;
    }
    return s;
}

typedef struct attn_job {
    const kvm_cpu_attn_head *a;
    const kvm_cpu_packed *k, *v;
    const float *bias; /* a->bias, or NULL when it is all zero */
} attn_job;

static void attn_block(void *ctx, int64_t blk, int worker)
{
    (void)worker;
    const attn_job *j = ctx;
    const kvm_cpu_attn_head *a = j->a;
    const int64_t i0 = blk * KVM_ATTN_QBLOCK;
    const int64_t nb = a->n_q - i0 < KVM_ATTN_QBLOCK ? a->n_q - i0 : KVM_ATTN_QBLOCK;
    int32_t pmax = a->qpos[i0];
    for (int64_t i = 1; i < nb; i++) pmax = a->qpos[i0 + i] > pmax ? a->qpos[i0 + i] : pmax;
    const int64_t e_end = kvm__attn_visible(a->pos, a->n_e, pmax);
    float *p = a->probs + i0 * a->n_e, *o = a->out + i0 * a->ldo;
    if (e_end == 0) {
        for (int64_t i = 0; i < nb; i++) memset(o + i * a->ldo, 0, (size_t)a->head_dim * sizeof *o);
        if (a->n_e && a->want_probs) memset(p, 0, (size_t)(nb * a->n_e) * sizeof *p);
        return;
    }
    kvm__cpu_gemm_packed(a->q + i0 * a->ldq, nb, a->ldq, j->k, p, a->n_e, a->scale, 0, e_end, a->head_dim);
    const int64_t width = a->want_probs ? a->n_e : e_end;
    float inv[KVM_ATTN_QBLOCK];
    for (int64_t i = 0; i < nb; i++)
        inv[i] = kvm__attn_softmax_row(p + i * a->n_e, j->bias, kvm__attn_visible(a->pos, e_end, a->qpos[i0 + i]),
                                       width, a->want_probs, NULL, NULL);
    kvm__cpu_gemm_packed(p, nb, a->n_e, j->v, o, a->ldo, 1.0f, 0, a->head_dim, e_end);
    if (!a->want_probs)
        for (int64_t i = 0; i < nb; i++)
            for (int c = 0; c < a->head_dim; c++) o[i * a->ldo + c] *= inv[i];
}

static void attn_direct(const kvm_cpu_attn_head *a, const float *bias)
{
    for (int64_t i = 0; i < a->n_q; i++) {
        float *p = a->probs + i * a->n_e, *o = a->out + i * a->ldo;
        const int64_t vis = kvm__attn_visible(a->pos, a->n_e, a->qpos[i]);
        kvm__attn_scores_direct(a->q + i * a->ldq, a->k, vis, a->head_dim, a->scale, p);
        kvm__attn_softmax_row(p, bias, vis, a->want_probs ? a->n_e : vis, 1, NULL, NULL);
        kvm__attn_pv_direct(p, a->v, vis, a->head_dim, o);
    }
}

int kvm_cpu_attn_head_ref(const kvm_cpu_attn_head *a)
{
    if (a->n_q < 0 || a->n_e < 0 || a->head_dim <= 0)
        return kvm_err(KVM_EINVAL, "attention: bad sizes n_q=%lld n_e=%lld head_dim=%d", (long long)a->n_q,
                       (long long)a->n_e, a->head_dim);
    if (a->n_q == 0) return 0;
    const float *bias = NULL;
    for (int64_t e = 0; a->bias && e < a->n_e; e++)
        if (a->bias[e] != 0.0f) {
            bias = a->bias;
            break;
        }
    if (a->n_q <= 2) {
        attn_direct(a, bias);
        return 0;
    }
    int rc;
    ref_scratch *sc = scratch_get();
    if (!sc) return kvm_err(KVM_ENOMEM, "attention: out of memory");
    if ((rc = kvm__cpu_pack(&sc->k, a->k, a->n_e, a->head_dim, a->head_dim, 1)) ||
        (rc = kvm__cpu_pack(&sc->v, a->v, a->head_dim, a->n_e, 1, a->head_dim)))
        return rc;
    attn_job j = {.a = a, .k = &sc->k, .v = &sc->v, .bias = bias};
    kvm__cpu_parallel_for((a->n_q + KVM_ATTN_QBLOCK - 1) / KVM_ATTN_QBLOCK, attn_block, &j);
    return 0;
}

/* ln Σ exp(score) of query i of head h over its visible entries, in double. */
static float ref_lse(const kvm_attn_layer *a, int h, int64_t i)
{
    const int g = h / (a->n_heads / a->n_kv_heads), d = a->head_dim;
    const int64_t vis = kvm__attn_visible(a->pos[g], a->n_e[g], a->qpos[i]);
    const float *q = a->q + i * a->ldq + (int64_t)h * d;
    double m = -INFINITY, s = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t e = 0; e < vis; e++) {
            double x = 0;
            for (int c = 0; c < d; c++) x += (double)q[c] * a->k[g][e * d + c];
            x = x * a->scale + (a->bias && a->bias[g] ? a->bias[g][e] : 0);
            if (pass == 0) m = x > m ? x : m;
            else s += exp(x - m);
        }
    return vis ? (float)(m + log(s)) : -INFINITY;
}

/* Statistics of head h from its probability matrix p [n_q][n_e]. */
static void ref_stats(const kvm_attn_layer *a, int h, const float *p, int64_t n_e)
{
    const unsigned st = a->stats;
    if (st & KVM_ATTN_STAT_MASS) memset(a->mass + (int64_t)h * a->ld_e, 0, (size_t)a->ld_e * sizeof(float));
    for (int64_t i = 0; i < a->n_q; i++) {
        const float *row = p + i * n_e;
        if (st & KVM_ATTN_STAT_ENTROPY) a->entropy[(int64_t)h * a->n_q + i] = kvm__attn_entropy(row, n_e);
        if (st & KVM_ATTN_STAT_LSE) a->lse[(int64_t)h * a->n_q + i] = ref_lse(a, h, i);
        if ((st & KVM_ATTN_STAT_OBS) && i >= a->n_q - a->n_obs) {
            float *o = a->obs + ((int64_t)h * a->n_obs + (i - (a->n_q - a->n_obs))) * a->ld_e;
            memcpy(o, row, (size_t)n_e * sizeof *o);
            memset(o + n_e, 0, (size_t)(a->ld_e - n_e) * sizeof *o);
        }
        if ((st & KVM_ATTN_STAT_MASS) && a->qpos[i] >= a->mass_p0 && a->qpos[i] < a->mass_p1)
            for (int64_t e = 0; e < n_e; e++) a->mass[(int64_t)h * a->ld_e + e] += row[e];
    }
}

int kvm_cpu_attention_ref(const kvm_attn_layer *a)
{
    int rc = kvm__cpu_attn_check(a);
    if (rc || a->n_q == 0) return rc;
    if (a->kv_dtype != KVM_KV_F32)
        return kvm_err(KVM_ENOTSUP, "attention reference: float32 keys/values only (kv_dtype f16 is the per-layer kernel's)");
    const int grp = a->n_heads / a->n_kv_heads, d = a->head_dim;
    int64_t max_e = 1;
    for (int g = 0; g < a->n_kv_heads; g++) max_e = a->n_e[g] > max_e ? a->n_e[g] : max_e;
    ref_scratch *sc = scratch_get();
    const size_t need = (size_t)a->n_q * (size_t)max_e;
    if (sc && need > sc->probs_cap) {
        float *p = realloc(sc->probs, need * sizeof *p);
        if (p) {
            sc->probs = p;
            sc->probs_cap = need;
        }
    }
    if (!sc || need > sc->probs_cap) return kvm_err(KVM_ENOMEM, "attention: out of memory");
    const int want = (a->stats & (KVM_ATTN_STAT_MASS | KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_OBS)) != 0;
    for (int h = 0; h < a->n_heads; h++) {
        const int g = h / grp;
        kvm_cpu_attn_head hd = {.q = a->q + (int64_t)h * d, .ldq = a->ldq, .qpos = a->qpos, .n_q = a->n_q,
                                .k = a->k[g], .v = a->v[g], .pos = a->pos[g], .bias = a->bias ? a->bias[g] : NULL,
                                .n_e = a->n_e[g], .head_dim = d, .scale = a->scale, .out = a->out + (int64_t)h * d,
                                .ldo = a->ldo, .probs = sc->probs, .want_probs = want};
        if ((rc = kvm_cpu_attn_head_ref(&hd))) return rc;
        if (a->stats) ref_stats(a, h, sc->probs, a->n_e[g]);
    }
    return 0;
}
