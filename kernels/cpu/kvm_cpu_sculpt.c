/* kvm_cpu_sculpt.c: the KVSculpt loss and gradient of one problem on the CPU as query-blocked
 * GEMMs (kvmill's packed microkernel) with fused row kernels between them, and the ridge design
 * probabilities; the per-element math is kernels/kvm_sculpt_body.h. Entries are padded to a
 * multiple of NR = 16 and every row loop runs over whole blocks of 16 lanes. */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_sculpt_rows.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { QB = KVM_SB_QB, NR = KVM_GEMM_NR };

/* Scratch of one evaluation (one allocation). kp = k rounded up to NR. */
typedef struct sb_work {
    int64_t kp;
    kvm_cpu_packed kpk, vpk, vtpk; /* Kc (out k, in d), Vc as (out d, in k), Vc as (out k, in d) */
    kvm_cpu_packed upk;            /* ∂score U of every query, already in panel layout [kp/NR][nq][NR] */
    float *S;                      /* [QB][kp] scores, then softmax weights W */
    float *oh, *E;                 /* [QB][d] distilled-part output, then the output error */
    float *R;                      /* [QB][kp] E·Vcᵀ */
    const float *qt;               /* [d][nq] Qᵀ: the view's, or built in the scratch */
    float *gt;                     /* [d][kp] Qᵀ·U */
    float *gb;                     /* [kp] Σ_i U */
    const float *vc;               /* the caller's Vc [k][d] (borrowed) */
} sb_work;

/* ∂score row: u_j = w_j·(b1·(r_j − oe) + b2) with w_j = e_j·iz (kvm_sb_dscore on 8 lanes, the
 * same operations in the same order) into its panel slots of upk, and gb += u. */
SB_CLONES
static void dscore_row(const float *restrict w, float iz, const float *restrict r, float oe, float b1, float b2,
                       int64_t kp, int64_t nq, int64_t i, float *restrict upk, float *restrict gb)
{
    for (int64_t j0 = 0; j0 < kp; j0 += NR) {
        float *restrict u = upk + (j0 / NR) * nq * NR + i * NR;
        for (int h = 0; h < NR; h += 8) {
            v8f wv, rv, g, uv;
            memcpy(&wv, w + j0 + h, 32);
            memcpy(&rv, r + j0 + h, 32);
            memcpy(&g, gb + j0 + h, 32);
            wv = wv * iz;
            uv = wv * (b1 * (rv - oe) + b2);
            g += uv;
            memcpy(u + h, &uv, 32);
            memcpy(gb + j0 + h, &g, 32);
        }
    }
}

/* Ôc = W·Vc for head dim 8 (one 256-bit vector per output row): oh[b] = Σ_{j<k} w[b][j]·vc[j]
 * for b < nb, eight rows at a time. Per row the sums run over j in order with one FMA each, the
 * operations of the packed GEMM's tile4 on the same operands, so the result is bit-identical to
 * kvm__cpu_gemm_packed(w, nb, kp, Vc, oh, 8, 1, 0, 8, k); it avoids the GEMM's padding of the
 * 8 outputs to a 16-lane panel. */
SB_CLONES
static void wv_rows8(const float *restrict w, int nb, int64_t kp, const float *restrict vc, int64_t k,
                     float *restrict oh)
{
    for (int b0 = 0; b0 < nb; b0 += 8) {
        const int mr = nb - b0 < 8 ? nb - b0 : 8;
        const float *x[8];
        for (int r = 0; r < 8; r++) x[r] = w + (int64_t)(b0 + (r < mr ? r : 0)) * kp;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0}, v;
        for (int64_t j = 0; j < k; j++) {
            memcpy(&v, vc + j * 8, 32);
            a0 += x[0][j] * v;
            a1 += x[1][j] * v;
            a2 += x[2][j] * v;
            a3 += x[3][j] * v;
            a4 += x[4][j] * v;
            a5 += x[5][j] * v;
            a6 += x[6][j] * v;
            a7 += x[7][j] * v;
        }
        v8f acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
        for (int r = 0; r < mr; r++) memcpy(oh + (int64_t)(b0 + r) * 8, &acc[r], 32);
    }
}

/* The K = 8 inner product of up to 4 rows x0..x3 [8] with one 16-entry panel pp [8][NR]:
 * acc[r][0|1] = Σ_t x_r[t]·pp[t][0..8 | 8..16], one FMA per term in t order (the packed
 * GEMM's order). Shared by gemm_k8 and dscore_k8, so both sum alike. */
static inline __attribute__((always_inline)) void k8_panel(const float *x0, const float *x1, const float *x2,
                                                           const float *x3, const float *pp, v8f acc[4][2])
{
    v8f a0 = {0}, c0 = {0}, a1 = {0}, c1 = {0}, a2 = {0}, c2 = {0}, a3 = {0}, c3 = {0}, lo, hi;
    for (int t = 0; t < 8; t++) {
        memcpy(&lo, pp + t * NR, 32);
        memcpy(&hi, pp + t * NR + 8, 32);
        a0 += x0[t] * lo;
        c0 += x0[t] * hi;
        a1 += x1[t] * lo;
        c1 += x1[t] * hi;
        a2 += x2[t] * lo;
        c2 += x2[t] * hi;
        a3 += x3[t] * lo;
        c3 += x3[t] * hi;
    }
    acc[0][0] = a0, acc[0][1] = c0, acc[1][0] = a1, acc[1][1] = c1;
    acc[2][0] = a2, acc[2][1] = c2, acc[3][0] = a3, acc[3][1] = c3;
}

/* y[b][j] = alpha·Σ_{t<8} x[b][t]·P[t][j] for b < nb, j < kp (row strides 8 and kp) with P
 * packed [kp/16][8][16] (kvm__cpu_pack, zero beyond its columns): the scores at head dim 8
 * (P = Kc; dscore_k8 repeats the loop for E·Vcᵀ). Four rows × 16 columns per step with the sums over t in
 * order, one FMA each, then the scaling: the operations of the packed GEMM's tile4, so the
 * stored columns are bit-identical to kvm__cpu_gemm_packed(x, nb, 8, P, y, kp, alpha, 0, k, 8)
 * and the padding columns get 0; inlined with K fixed, it avoids a tile call per 64 FMAs. */
SB_CLONES
static void gemm_k8(const float *restrict x, int nb, const kvm_cpu_packed *P, int64_t kp, float alpha,
                    float *restrict y)
{
    for (int b0 = 0; b0 < nb; b0 += 4) {
        const int mr = nb - b0 < 4 ? nb - b0 : 4;
        const float *x0 = x + b0 * 8, *x1 = x0 + (mr > 1 ? 8 : 0), *x2 = x0 + (mr > 2 ? 16 : 0);
        const float *x3 = x0 + (mr > 3 ? 24 : 0);
        for (int64_t j0 = 0; j0 < kp; j0 += NR) {
            const float *pp = P->p + j0 * 8;
            v8f acc[4][2];
            k8_panel(x0, x1, x2, x3, pp, acc);
            for (int r = 0; r < mr; r++) {
                v8f l = acc[r][0] * alpha, h = acc[r][1] * alpha;
                memcpy(y + (b0 + r) * kp + j0, &l, 32);
                memcpy(y + (b0 + r) * kp + j0 + 8, &h, 32);
            }
        }
    }
}

/* The ∂score rows of nb queries from i0 at head dim 8 with E·Vcᵀ fused in: per 4 rows × 16
 * entries r = Σ_{t<8} e[b][t]·Vc[j][t] (gemm_k8's sums), then u_j = (w_j·iz)·(b1·(r_j − oe) +
 * b2) into upk and gb += u row by row, as dscore_row does; bit-identical to gemm_k8 followed by
 * dscore_row (r is never stored). w [nb][kp] are the exponentiated scores, iz, oe, b1, b2 [nb]. */
SB_CLONES
static void dscore_k8(const float *restrict e, int nb, const kvm_cpu_packed *Vt, int64_t kp, const float *restrict w,
                      const float *iz, const float *oe, const float *b1, const float *b2, int64_t nq, int64_t i0,
                      float *restrict upk, float *restrict gb)
{
    for (int b0 = 0; b0 < nb; b0 += 4) {
        const int mr = nb - b0 < 4 ? nb - b0 : 4;
        const float *x0 = e + b0 * 8, *x1 = x0 + (mr > 1 ? 8 : 0), *x2 = x0 + (mr > 2 ? 16 : 0);
        const float *x3 = x0 + (mr > 3 ? 24 : 0);
        for (int64_t j0 = 0; j0 < kp; j0 += NR) {
            const float *pp = Vt->p + j0 * 8;
            v8f acc[4][2], g[2], wv, uv;
            k8_panel(x0, x1, x2, x3, pp, acc);
            memcpy(g, gb + j0, 64);
            for (int r = 0; r < mr; r++) {
                const int b = b0 + r;
                float *u = upk + (j0 / NR) * nq * NR + (i0 + b) * NR;
                for (int h = 0; h < 2; h++) {
                    memcpy(&wv, w + b * kp + j0 + 8 * h, 32);
                    wv = wv * iz[b];
                    uv = wv * (b1[b] * (acc[r][h] - oe[b]) + b2[b]);
                    g[h] += uv;
                    memcpy(u + 8 * h, &uv, 32);
                }
            }
            memcpy(gb + j0, g, 64);
        }
    }
}

/* One query's output rows and scalars; returns ⟨Ô, e⟩ and adds to *mse, *lse; b1, b2 out. */
static float query_row(const kvm_sculpt_view *p, int64_t i, float lc, float iz, const float *ohc, float *e, double a1,
                       double a2, float *b1, float *b2, double *mse, double *lse)
{
    const int d = p->d;
    kvm_sb_query s = kvm_sb_query_shares(lc, p->lse_ret[i], 1, p->n_vis[i] > 0, p->lse_zone[i], p->nc > 0,
                                         p->lse_mass_weight);
    const float *o = p->o_full + i * d, *orr = p->o_ret + i * d;
    double ei = 0;
    float oe = 0;
    for (int t = 0; t < d; t++) {
        float oh;
        e[t] = kvm_sb_out_err(s.pc, ohc[t] * iz, s.pr, orr[t], o[t], &oh);
        ei += (double)e[t] * e[t];
        oe += oh * e[t];
    }
    *mse += ei;
    *lse += s.wz * s.dl * s.dl;
    *b1 = (float)(a1 * s.pc);
    *b2 = (float)(a2 * s.wz * s.dl);
    return oe;
}

/* One block of nb queries from i0: the forward pass and (when want_grad) the ∂score rows. */
static void block(const kvm_sculpt_view *p, int64_t i0, int nb, int64_t k, const float *b0, double a1, double a2,
                  int want_grad, sb_work *w, double *mse, double *lse)
{
    const int d = p->d;
    const int64_t kp = w->kp;
    float lc[QB], iz[QB], oe[QB], b1[QB], b2[QB];
    if (d == 8) gemm_k8(p->q + i0 * d, nb, &w->kpk, kp, p->scale, w->S);
    else kvm__cpu_gemm_packed(p->q + i0 * d, nb, d, &w->kpk, w->S, kp, p->scale, 0, k, d);
    for (int b = 0; b < nb; b++) lc[b] = softmax_row(w->S + b * kp, b0, kp, &iz[b]);
    if (d == 8) wv_rows8(w->S, nb, kp, w->vc, k, w->oh);
    else kvm__cpu_gemm_packed(w->S, nb, kp, &w->vpk, w->oh, d, 1.0f, 0, d, k);
    for (int b = 0; b < nb; b++)
        oe[b] = query_row(p, i0 + b, lc[b], iz[b], w->oh + b * d, w->E + b * d, a1, a2, &b1[b], &b2[b], mse, lse);
    if (!want_grad) return;
    if (d == 8) {
        dscore_k8(w->E, nb, &w->vtpk, kp, w->S, iz, oe, b1, b2, p->nq, i0, w->upk.p, w->gb);
        return;
    }
    kvm__cpu_gemm_packed(w->E, nb, d, &w->vtpk, w->R, kp, 1.0f, 0, k, d);
    for (int b = 0; b < nb; b++)
        dscore_row(w->S + b * kp, iz[b], w->R + b * kp, oe[b], b1[b], b2[b], kp, p->nq, i0 + b, w->upk.p, w->gb);
}

static void work_free(sb_work *w)
{
    kvm__cpu_packed_free(&w->kpk);
    kvm__cpu_packed_free(&w->vpk);
    kvm__cpu_packed_free(&w->vtpk);
    kvm__cpu_packed_free(&w->upk);
    free(w->S);
}

/* Packs the entries and allocates the scratch (zeroed: padding columns stay 0). */
static int work_new(sb_work *w, const kvm_sculpt_view *p, const float *kc, const float *vc, int64_t k, int grad)
{
    const int d = p->d;
    const int64_t kp = (k + NR - 1) / NR * NR, nq = p->nq;
    memset(w, 0, sizeof *w);
    w->kp = kp;
    w->vc = vc;
    const int build_qt = grad && !p->qt;
    size_t nf = (size_t)kp * (2 * QB + d + 2) + (size_t)(2 * QB * d) + (build_qt ? (size_t)(d * nq) : 0);
    w->S = calloc(nf, sizeof *w->S);
    if (!w->S || kvm__cpu_pack(&w->kpk, kc, k, d, d, 1) || kvm__cpu_pack(&w->vpk, vc, d, k, 1, d) ||
        kvm__cpu_pack(&w->vtpk, vc, k, d, d, 1))
        goto fail;
    w->R = w->S + QB * kp;
    w->gt = w->R + QB * kp;
    w->gb = w->gt + (int64_t)d * kp;
    float *b0 = w->gb + kp; /* the caller fills the biases row */
    w->oh = b0 + kp;
    w->E = w->oh + QB * d;
    float *qt = w->E + QB * d;
    w->qt = build_qt ? qt : p->qt;
    if (grad) {
        size_t bytes = ((size_t)(kp * nq) * sizeof(float) + 63) & ~(size_t)63;
        if (!(w->upk.p = aligned_alloc(64, bytes ? bytes : 64))) goto fail;
        /* every slot of U is written by the ∂score rows: no clearing */
        w->upk.out = k;
        w->upk.in = nq;
        w->upk.cap = kp * nq;
        for (int64_t i = 0; build_qt && i < nq; i++)
            for (int t = 0; t < d; t++) qt[t * nq + i] = p->q[i * d + t];
    }
    return 0;
fail:
    work_free(w);
    return kvm_err(KVM_ENOMEM, "sculpt kernel: out of memory (k = %lld, %lld queries)", (long long)k, (long long)nq);
}

int kvm_cpu_sculpt_lossgrad(const kvm_sculpt_view *p, const float *kc, const float *vc, const float *beta, int64_t k,
                            double lambda, float *grad_k, float *grad_b, kvm_sculpt_eval *out)
{
    const int d = p->d, grad = grad_k != NULL || grad_b != NULL;
    if (k < 1 || d < 1 || d > 512) return kvm_err(KVM_EINVAL, "sculpt kernel: k = %lld, d = %d", (long long)k, d);
    sb_work w;
    int rc = work_new(&w, p, kc, vc, k, grad);
    if (rc) return rc;
    const int64_t kp = w.kp, nq = p->nq;
    float *b0 = w.gb + kp;
    for (int64_t j = 0; j < kp; j++) b0[j] = j < k ? (beta ? beta[j] : 0.0f) : -1e30f;
    const double a1 = 2.0 / ((double)nq * p->out_ms), a2 = 2.0 * lambda / (double)nq;
    double mse = 0, lse = 0;
    for (int64_t i0 = 0; i0 < nq; i0 += QB)
        block(p, i0, nq - i0 < QB ? (int)(nq - i0) : QB, k, b0, a1, a2, grad, &w, &mse, &lse);
    if (grad) {
        kvm__cpu_gemm_packed(w.qt, d, nq, &w.upk, w.gt, kp, p->scale, 0, k, nq);
        if (grad_k)
            for (int64_t j = 0; j < k; j++)
                for (int t = 0; t < d; t++) grad_k[j * d + t] = w.gt[t * kp + j];
        if (grad_b) memcpy(grad_b, w.gb, (size_t)k * sizeof *grad_b);
    }
    out->mse_sum = mse;
    out->lse_sum = lse;
    out->loss = mse / ((double)nq * p->out_ms) + lambda * lse / (double)nq;
    work_free(&w);
    return 0;
}

int kvm_cpu_sculpt_probs(const kvm_sculpt_view *p, const float *kc, const float *beta, int64_t k, float *P,
                         double *pr)
{
    const int d = p->d;
    if (k < 1 || d < 1 || d > 512) return kvm_err(KVM_EINVAL, "sculpt kernel: k = %lld, d = %d", (long long)k, d);
    sb_work w;
    int rc = work_new(&w, p, kc, kc, k, 0);
    if (rc) return rc;
    const int64_t kp = w.kp, nq = p->nq;
    float *b0 = w.gb + kp;
    for (int64_t j = 0; j < kp; j++) b0[j] = j < k ? (beta ? beta[j] : 0.0f) : -1e30f;
    for (int64_t i0 = 0; i0 < nq; i0 += QB) {
        const int nb = nq - i0 < QB ? (int)(nq - i0) : QB;
        if (d == 8) gemm_k8(p->q + i0 * d, nb, &w.kpk, kp, p->scale, w.S);
        else kvm__cpu_gemm_packed(p->q + i0 * d, nb, d, &w.kpk, w.S, kp, p->scale, 0, k, d);
        for (int b = 0; b < nb; b++) {
            const int64_t i = i0 + b;
            float iz, lc = softmax_row(w.S + b * kp, b0, kp, &iz);
            kvm_sb_query s = kvm_sb_query_shares(lc, p->lse_ret[i], 1, p->n_vis[i] > 0, p->lse_zone[i], p->nc > 0, 0);
            const float c = s.pc * iz;
            for (int64_t j = 0; j < k; j++) P[i * k + j] = c * w.S[b * kp + j];
            pr[i] = s.pr;
        }
    }
    work_free(&w);
    return 0;
}
