/* kvm_cpu_attn.c: one head's attention over a ragged, position-sorted KV cache on the CPU.
 * K and V are packed once per call into GEMM panels; query blocks then run in parallel,
 * each touching only the prefix of entries visible to its last query, so causal prefill
 * does about half the work of a dense N x N pass. */
#include "kernels/cpu/kvm_cpu.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_math.h"
#include "kernels/kvm_forward_body.h"
#include "kernels/cpu/kvm_cpu_pool.h"
#include "common/kvm_error.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KVM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVM_CLONES
#endif

enum { KVM_ATTN_QBLOCK = 64 };

/* Per-thread packed K and V of the head being processed (grown, never shrunk), freed by a
 * thread-specific destructor when the thread exits (stage job threads come and go). */
typedef struct attn_scratch {
    kvm_cpu_packed k, v;
} attn_scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
    attn_scratch *s = p;
    kvm__cpu_packed_free(&s->k);
    kvm__cpu_packed_free(&s->v);
    free(s);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static attn_scratch *scratch_get(void)
{
    pthread_once(&scratch_once, scratch_init);
    attn_scratch *s = pthread_getspecific(scratch_key);
    if (!s && (s = calloc(1, sizeof *s)) && pthread_setspecific(scratch_key, s)) {
        free(s);
        s = NULL;
    }
    return s;
}

/* The visible prefix of a head's entries: kvm_fb_visible (kernels/kvm_forward_body.h). */
static int64_t visible_count(const int32_t *pos, int64_t n, int32_t p) { return kvm_fb_visible(pos, n, p); }

/* In-place softmax of row[0, vis) (scores, bias added), zero on [vis, width): the SIMD form of
 * kvm_fb_softmax_row (kernels/kvm_forward_body.h) with the same per-element operations (bias add,
 * max, kvm_fb_expf per lane, 1/Σ); the sum is taken over 16 lanes, then across them. Explicit
 * 16-lane vectors: GCC does not vectorise the max/sum reductions without -ffast-math.
 * Returns 1/sum; the row is scaled by it only when `normalize` (else the caller scales the
 * attention output instead, which is head_dim values rather than vis). */
KVM_CLONES
static float softmax_row(float *row, const float *bias, int64_t vis, int64_t width, int normalize)
{
    typedef kvm__v16 v16;
    const int64_t nv = vis / 16 * 16;
    v16 vm = (v16){0} - INFINITY, x, b;
    for (int64_t e = 0; e < nv; e += 16) {
        memcpy(&x, row + e, sizeof x);
        if (bias) {
            memcpy(&b, bias + e, sizeof b);
            x += b;
            memcpy(row + e, &x, sizeof x);
        }
        vm = kvm__vselect(x > vm, x, vm);
    }
    float m = -INFINITY;
    for (int l = 0; l < 16; l++) m = vm[l] > m ? vm[l] : m;
    for (int64_t e = nv; e < vis; e++) {
        if (bias) row[e] += bias[e];
        m = row[e] > m ? row[e] : m;
    }
    v16 vs = {0};
    for (int64_t e = 0; e < nv; e += 16) {
        memcpy(&x, row + e, sizeof x);
        x = kvm__expf16(x - m);
        vs += x;
        memcpy(row + e, &x, sizeof x);
    }
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += vs[l];
    for (int64_t e = nv; e < vis; e++) s += row[e] = kvm__expf(row[e] - m);
    float inv = vis > 0 ? 1.0f / s : 0.0f;
    if (normalize)
        for (int64_t e = 0; e < vis; e++) row[e] *= inv;
    if (width > vis) memset(row + vis, 0, (size_t)(width - vis) * sizeof *row);
    return inv;
}

typedef struct attn_job {
    const kvm_attn_head *a;
    const kvm_cpu_packed *k, *v;
    const float *bias; /* a->bias, or NULL when it is all zero */
} attn_job;

static void attn_block(void *ctx, int64_t blk, int worker)
{
    const attn_job *j = ctx;
    const kvm_attn_head *a = j->a;
    const int64_t i0 = blk * KVM_ATTN_QBLOCK;
    const int64_t nb = a->n_q - i0 < KVM_ATTN_QBLOCK ? a->n_q - i0 : KVM_ATTN_QBLOCK;
    int32_t pmax = a->qpos[i0];
    for (int64_t i = 1; i < nb; i++) pmax = a->qpos[i0 + i] > pmax ? a->qpos[i0 + i] : pmax;
    const int64_t e_end = visible_count(a->pos, a->n_e, pmax);
    float *p = a->probs + i0 * a->n_e, *o = a->out + i0 * a->ldo;
    if (e_end == 0) {
        for (int64_t i = 0; i < nb; i++) memset(o + i * a->ldo, 0, (size_t)a->head_dim * sizeof *o);
        if (a->n_e && a->want_probs) memset(p, 0, (size_t)(nb * a->n_e) * sizeof *p);
        return;
    }
    kvm__cpu_gemm_packed(a->q + i0 * a->ldq, nb, a->ldq, j->k, p, a->n_e, a->scale, 0, e_end, a->head_dim);
    /* rows need zeros up to e_end for the PV product; past it only when the caller reads them.
     * Unless the caller reads the probabilities, rows stay unnormalised and the 1/sum goes
     * onto the head_dim outputs instead of the e_end weights. */
    const int64_t width = a->want_probs ? a->n_e : e_end;
    float inv[KVM_ATTN_QBLOCK];
    for (int64_t i = 0; i < nb; i++)
        inv[i] = softmax_row(p + i * a->n_e, j->bias, visible_count(a->pos, e_end, a->qpos[i0 + i]), width, a->want_probs);
    kvm__cpu_gemm_packed(p, nb, a->n_e, j->v, o, a->ldo, 1.0f, 0, a->head_dim, e_end);
    if (!a->want_probs)
        for (int64_t i = 0; i < nb; i++)
            for (int c = 0; c < a->head_dim; c++) o[i * a->ldo + c] *= inv[i];
}

typedef float v8 __attribute__((vector_size(32)));

/* o[0, d) = Σ_e p[e] · V[e][0, d): 8 columns at a time with four accumulators over e, so
 * consecutive entries do not wait on each other's FMA. */
KVM_CLONES
static void pv_direct(const float *p, const float *v, int64_t n, int d, float *o)
{
    int c0 = 0;
    for (; c0 + 8 <= d; c0 += 8) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, x0, x1, x2, x3;
        int64_t e = 0;
        for (; e + 4 <= n; e += 4) {
            memcpy(&x0, v + (e + 0) * d + c0, sizeof x0);
            memcpy(&x1, v + (e + 1) * d + c0, sizeof x1);
            memcpy(&x2, v + (e + 2) * d + c0, sizeof x2);
            memcpy(&x3, v + (e + 3) * d + c0, sizeof x3);
            a0 += p[e] * x0;
            a1 += p[e + 1] * x1;
            a2 += p[e + 2] * x2;
            a3 += p[e + 3] * x3;
        }
        for (; e < n; e++) {
            memcpy(&x0, v + e * d + c0, sizeof x0);
            a0 += p[e] * x0;
        }
        v8 sum = (a0 + a1) + (a2 + a3);
        memcpy(o + c0, &sum, sizeof sum);
    }
    for (; c0 < d; c0++) {
        float acc = 0.0f;
        for (int64_t e = 0; e < n; e++) acc += p[e] * v[e * d + c0];
        o[c0] = acc;
    }
}

/* Decode (a few queries): direct products over the cache, no packing, since each entry is
 * read once anyway. Loops run over entries innermost so the multiply-adds of different
 * entries are independent (a per-entry dot product would be one serial FMA chain). */
KVM_CLONES
static void attn_direct(const kvm_attn_head *a, const float *bias)
{
    enum { EB = 64 };
    const int d = a->head_dim;
    for (int64_t i = 0; i < a->n_q; i++) {
        const float *q = a->q + i * a->ldq;
        float *p = a->probs + i * a->n_e, *o = a->out + i * a->ldo;
        const int64_t vis = visible_count(a->pos, a->n_e, a->qpos[i]);
        for (int64_t e0 = 0; e0 < vis; e0 += EB) {
            const int64_t nb = vis - e0 < EB ? vis - e0 : EB;
            float s[EB] = {0};
            for (int c = 0; c < d; c++) {
                const float qc = q[c] * a->scale, *k = a->k + e0 * d + c;
                for (int64_t j = 0; j < nb; j++) s[j] += qc * k[j * d];
            }
            memcpy(p + e0, s, (size_t)nb * sizeof *s);
        }
        softmax_row(p, bias, vis, a->want_probs ? a->n_e : vis, 1);
        pv_direct(p, a->v, vis, d, o);
    }
}

int kvm__cpu_attention(const kvm_attn_head *a)
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
    attn_scratch *sc = scratch_get();
    if (!sc) return kvm_err(KVM_ENOMEM, "attention: out of memory");
    /* K as W [n_e][d] (QKᵀ), V as W [d][n_e] read from V [n_e][d] (PV) */
    if ((rc = kvm__cpu_pack(&sc->k, a->k, a->n_e, a->head_dim, a->head_dim, 1)) ||
        (rc = kvm__cpu_pack(&sc->v, a->v, a->head_dim, a->n_e, 1, a->head_dim)))
        return rc;
    attn_job j = {.a = a, .k = &sc->k, .v = &sc->v, .bias = bias};
    int64_t blocks = (a->n_q + KVM_ATTN_QBLOCK - 1) / KVM_ATTN_QBLOCK;
    /* one block (decode) is cheaper than waking a thread */
    kvm__cpu_parallel_for(blocks, attn_block, &j);
    return 0;
}
