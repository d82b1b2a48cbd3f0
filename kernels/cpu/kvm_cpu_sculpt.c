/* kvm_cpu_sculpt.c: the KVSculpt loss and gradient of one problem on the CPU as query-blocked
 * GEMMs (kvmill's packed microkernel) with fused row kernels between them, and the ridge design
 * probabilities; the per-element math is kernels/kvm_sculpt_body.h. Entries are padded to a
 * multiple of NR = 16 and every row loop runs over whole blocks of 16 lanes. At head dim 8 the
 * GEMMs are inlined fixed-size tiles and a block of QB8 queries goes through every pass (scores
 * with β and row maxima, exponentials, W·Vc, ∂score, Qᵀ·U into the key gradient) while its
 * scores and ∂score rows stay in L1; no [nq][k] array exists. */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_sculpt_rows.h"
#include "kernels/cpu/kvm_cpu_sculpt_k8n.h"
#include "kernels/cpu/kvm_cpu_clones.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { QB = KVM_SB_QB, NR = KVM_GEMM_NR };
enum { QB8 = 32 }; /* queries per block at head dim 8: S and U of a block (2·16·kp floats) stay in L1 */

/* The buffers an evaluation works in, kept between evaluations by a kvm_cpu_sculpt_scratch so
 * that each call does not allocate and fault in fresh pages (at SmolLM2's shape U alone is 5 MB
 * per evaluation, and the page clearing showed as ≈ 9% system time). */
struct kvm_cpu_sculpt_scratch {
    kvm_cpu_packed kpk, vpk, vtpk, upk;
    float *buf;    /* S, R, gt, gb, β row, oh, E and (when built) Qᵀ, 64-byte aligned */
    size_t cap;    /* floats allocated in buf */
};

/* Scratch of one evaluation. kp = k rounded up to NR. */
typedef struct sb_work {
    int64_t kp;
    kvm_cpu_packed kpk, vpk, vtpk; /* Kc (out k, in d), Vc as (out d, in k), Vc as (out k, in d) */
    kvm_cpu_packed upk;            /* ∂score U of every query, already in panel layout [kp/NR][nq][NR]
                                      (d ≠ 8; at d = 8 the block's U is R, [kp/NR][QB8][NR]) */
    float *S;                      /* [QB][kp] scores, then softmax weights W */
    float *oh, *E;                 /* [QB][d] distilled-part output, then the output error */
    float *R;                      /* [QB][kp] E·Vcᵀ */
    const float *qt;               /* [d][nq] Qᵀ: the view's, or built in the scratch */
    float *gt;                     /* [d][kp] Qᵀ·U (d = 8: summed block by block, unscaled) */
    float *gb;                     /* [kp] Σ_i U */
    kvm_cpu_sculpt_scratch *ws;    /* where the buffers live; owned when own_ws */
    int own_ws;
} sb_work;

/* ∂score row: u_j = w_j·(b1·(r_j − oe) + b2) with w_j = e_j·iz (kvm_sb_dscore on 8 lanes, the
 * same operations in the same order) into its panel slots of upk, and gb += u. */
SB_CLONES
static void dscore_row(const float *restrict w, float iz, const float *restrict r, float oe, float b1, float b2,
                       int64_t kp, int64_t nq, int64_t i, float *restrict upk, float *restrict gb)
{
    for (int64_t j0 = 0; j0 < kp; j0 += NR) {
        float *restrict u = upk + (j0 / NR) * nq * NR + i * NR;
        v16f wv, rv, g, uv;
        memcpy(&wv, w + j0, 64);
        memcpy(&rv, r + j0, 64);
        memcpy(&g, gb + j0, 64);
        wv = wv * iz;
        uv = wv * (b1 * (rv - oe) + b2);
        g += uv;
        memcpy(u, &uv, 64);
        memcpy(gb + j0, &g, 64);
    }
}

/* The exponentials of nb score rows at head dim 8 with Ôc = W·Vc fused in: per row s_j ←
 * exp(s_j − mx) in place (exp_row_body's operations, so the exponentials, the LSE into lse[b]
 * and 1/Σ into iz[b] are bit for bit exp_rows'), and while each 16-entry panel of exponentials
 * is in a register, acc_t += panel · Vt[panel][t] for the 8 output elements, Vt = Vc packed
 * [kp/16][8][16] (zero beyond k, so padding adds nothing); oh[b][t] = the 16 lanes of acc_t
 * summed by v16_hsum8's tree. One pass over the row instead of two, 16-lane FMAs instead of
 * wv_rows8's 8-lane ones; the sums of Ôc run over the panel lanes, then the tree (not j in order
 * as wv_rows8's: the loss changes in the last bits). */
/* exp_wv8's body with the 16-lane exponential EXPF (v16_expf, or v16_expf_v4: the same bits). */
#define EXP_WV8_BODY(EXPF)                                                                                             \
    for (int b = 0; b < nb; b++) {                                                                                     \
        float *restrict row = s + b * kp;                                                                              \
        v16f a = {0}, x, acc[8] = {{0}}, v;                                                                            \
        for (int64_t j0 = 0; j0 < kp; j0 += NR) {                                                                      \
            memcpy(&x, row + j0, 64);                                                                                  \
            x = EXPF(x - mx[b]);                                                                                       \
            memcpy(row + j0, &x, 64);                                                                                  \
            a += x;                                                                                                    \
            const float *vp = Vt->p + j0 * 8;                                                                          \
            _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++)                                                        \
            {                                                                                                          \
                memcpy(&v, vp + t * NR, 64);                                                                           \
                acc[t] += x * v;                                                                                       \
            }                                                                                                          \
        }                                                                                                              \
        const float z = v16_hsum(a);                                                                                   \
        iz[b] = 1.0f / z;                                                                                              \
        lse[b] = z; /* ln z below, 16 rows at a time */                                                                \
        v16_hsum8(acc, oh + b * 8);                                                                                    \
    }                                                                                                                  \
    for (int b0 = 0; b0 < nb; b0 += NR) {                                                                              \
        v16f z = (v16f){0} + 1.0f, m = {0};                                                                            \
        const int n = nb - b0 < NR ? nb - b0 : NR;                                                                     \
        memcpy(&z, lse + b0, (size_t)n * sizeof *lse);                                                                 \
        memcpy(&m, mx + b0, (size_t)n * sizeof *mx);                                                                   \
        const v16f l = m + v16_logf(z);                                                                                \
        memcpy(lse + b0, &l, (size_t)n * sizeof *lse);                                                                 \
    }

SB_CLONES
static void exp_wv8(float *restrict s, int nb, int64_t kp, const float *mx, const kvm_cpu_packed *Vt,
                    float *restrict oh, float *lse, float *iz)
{
    EXP_WV8_BODY(v16_expf)
}

#ifdef SB_HAVE_V4
/* exp_wv8 with v16_expf_v4: ≈ 35% of a stories260K sculpt is this loop, and the exponential is
 * half of its instructions. */
SB_V4 static void exp_wv8_v4(float *restrict s, int nb, int64_t kp, const float *mx, const kvm_cpu_packed *Vt,
                             float *restrict oh, float *lse, float *iz)
{
    EXP_WV8_BODY(v16_expf_v4)
}
#endif

/* kvm_sb_shares for nb queries (has_c = 1) 16 lanes at a time, lanewise its operations: pc, pr
 * [nb] from the distilled LSEs lc [nb], the retain LSEs lr [nb] and nvis [nb] (retain entries
 * visible). One vector exponential and two vector divisions per 16 queries instead of a
 * library expf and two scalar divisions per query. */
SB_CLONES
static void shares_rows(const float *lc, const float *lr, const int64_t *nvis, int nb, float *pc, float *pr)
{
    for (int b0 = 0; b0 < nb; b0 += NR) {
        const int n = nb - b0 < NR ? nb - b0 : NR;
        v16f c = {0}, r = {0};
        v16i has_r = {0};
        memcpy(&c, lc + b0, (size_t)n * sizeof *lc);
        memcpy(&r, lr + b0, (size_t)n * sizeof *lr);
        for (int l = 0; l < n; l++) has_r[l] = nvis[b0 + l] > 0 ? -1 : 0;
        const v16i gt = c > r;
        const v16f mm = (v16f)(((v16i)c & gt) | ((v16i)r & ~gt));
        const v16f x = (v16f)(((v16i)(r - mm) & gt) | ((v16i)(c - mm) & ~gt));
        const v16f e = v16_expf(x), one = (v16f){0} + 1.0f;
        const v16f ac = (v16f)(((v16i)one & gt) | ((v16i)e & ~gt));
        const v16f ar = (v16f)((((v16i)e & gt) | ((v16i)one & ~gt)) & has_r);
        const v16f zz = ac + ar;
        const v16i pos = zz > 0;
        const v16f vc = (v16f)((v16i)(ac / zz) & pos), vr = (v16f)((v16i)(ar / zz) & pos);
        memcpy(pc + b0, &vc, (size_t)n * sizeof *pc);
        memcpy(pr + b0, &vr, (size_t)n * sizeof *pr);
    }
}

/* Row b's 8 elements broadcast over 16 lanes (x[t] in every lane of xb[t]): held in registers
 * across a row pair's panels, so the panel loop loads each panel vector once for two FMAs and no
 * broadcast. */
static inline SB_INLINE void k8_bcast(const float *x, v16f xb[8])
{
    for (int t = 0; t < 8; t++) xb[t] = (v16f){0} + x[t];
}

/* The K = 8 inner product of two rows (broadcast in x0b, x1b) with one 16-entry panel pp
 * [8][NR]: acc[r] = Σ_t x_r[t]·pp[t][0..16], one FMA per term in t order (the packed GEMM's
 * order). Shared by scores_k8 and dscore_k8, so both sum alike. */
static inline SB_INLINE void k8_panel(const v16f x0b[8], const v16f x1b[8], const float *pp, v16f acc[2])
{
    v16f a0 = {0}, a1 = {0}, v;
    for (int t = 0; t < 8; t++) {
        memcpy(&v, pp + t * NR, 64);
        a0 += x0b[t] * v;
        a1 += x1b[t] * v;
    }
    acc[0] = a0, acc[1] = a1;
}

/* The scores of nb ≤ QB rows at head dim 8: y[b][j] = alpha·Σ_{t<8} x[b][t]·P[t][j] + β_j for j <
 * kp (row strides 8 and kp) with P = Kc packed [kp/16][8][16] (kvm__cpu_pack, zero beyond its
 * columns) and β [kp] (−1e30 on padding), and each row's maximum into mx[b]. Two rows (their
 * elements broadcast once, in registers) × 16 columns per step (k8_panel), the scaling and β in
 * one FMA; inlined with K fixed, it avoids a
 * GEMM tile call per 64 FMAs and the softmax's separate β-and-maximum pass over the row. */
SB_CLONES
static void scores_k8(const float *restrict x, int nb, const kvm_cpu_packed *P, int64_t kp, float alpha,
                      const float *restrict beta, float *restrict y, float *restrict mx)
{
    for (int b0 = 0; b0 < nb; b0 += 2) {
        const int mr = nb - b0 < 2 ? nb - b0 : 2;
        v16f x0b[8], x1b[8];
        k8_bcast(x + b0 * 8, x0b);
        k8_bcast(x + b0 * 8 + (mr > 1 ? 8 : 0), x1b);
        const v16f ninf = (v16f){0} - INFINITY;
        v16f m[2] = {ninf, ninf};
        for (int64_t j0 = 0; j0 < kp; j0 += NR) {
            v16f acc[2], bv;
            k8_panel(x0b, x1b, P->p + j0 * 8, acc);
            memcpy(&bv, beta + j0, 64);
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) { /* a constant trip count keeps acc and m in registers */
                const v16f l = acc[r] * alpha + bv;
                m[r] = v16_max(m[r], l);
                if (r >= mr) continue;
                memcpy(y + (b0 + r) * kp + j0, &l, 64);
            }
        }
        for (int r = 0; r < mr; r++) mx[b0 + r] = v16_hmax(m[r]);
    }
}

/* The key gradient's block term at head dim 8: gt[t][j] += Σ_{b<nb} x[b][t]·u[b][j] for t < 8,
 * j < kp, u a block's ∂score rows in panel layout [kp/16][nb][16] (dscore_k8's output).
 * Per panel (two at a time) the 8 sums are held in registers over the block's rows, in row
 * order, so the gradient is summed over the queries in order whatever the block size. */
SB_CLONES
static void grad_k8(const float *restrict x, int nb, const float *restrict u, int64_t kp, float *restrict gt)
{
    int64_t j0 = 0;
    for (; j0 + 2 * NR <= kp; j0 += 2 * NR) { /* two panels: each broadcast x[b][t] feeds two FMAs */
        v16f g[8], h[8], uv, wv;
        for (int t = 0; t < 8; t++) {
            memcpy(&g[t], gt + t * kp + j0, 64);
            memcpy(&h[t], gt + t * kp + j0 + NR, 64);
        }
        const float *up = u + (j0 / NR) * nb * NR, *wp = up + nb * NR;
        for (int b = 0; b < nb; b++) {
            memcpy(&uv, up + b * NR, 64);
            memcpy(&wv, wp + b * NR, 64);
            for (int t = 0; t < 8; t++) {
                g[t] += x[b * 8 + t] * uv;
                h[t] += x[b * 8 + t] * wv;
            }
        }
        for (int t = 0; t < 8; t++) {
            memcpy(gt + t * kp + j0, &g[t], 64);
            memcpy(gt + t * kp + j0 + NR, &h[t], 64);
        }
    }
    for (; j0 < kp; j0 += NR) {
        v16f g[8], uv;
        for (int t = 0; t < 8; t++) memcpy(&g[t], gt + t * kp + j0, 64);
        const float *up = u + (j0 / NR) * nb * NR;
        for (int b = 0; b < nb; b++) {
            memcpy(&uv, up + b * NR, 64);
            for (int t = 0; t < 8; t++) g[t] += x[b * 8 + t] * uv;
        }
        for (int t = 0; t < 8; t++) memcpy(gt + t * kp + j0, &g[t], 64);
    }
}

/* The ∂score rows of nb queries at head dim 8 with E·Vcᵀ fused in: per 2 rows × 16 entries
 * r = Σ_{t<8} e[b][t]·Vc[j][t] (k8_panel's sums), then u_j = w_j·(c1·(r_j − oe) + c2) with
 * c1 = iz·b1, c2 = iz·b2 (kvm_sb_dscore with the softmax's 1/Σ folded into the row's two
 * coefficients) into the block's panels u [kp/16][nb][16], and gb += u row by row. w [nb][kp]
 * are the exponentiated scores; oe, c1, c2 [nb]. */
SB_CLONES
static void dscore_k8(const float *restrict e, int nb, const kvm_cpu_packed *Vt, int64_t kp, const float *restrict w,
                      const float *oe, const float *c1, const float *c2, float *restrict u, float *restrict gb)
{
    for (int b0 = 0; b0 < nb; b0 += 2) {
        const int mr = nb - b0 < 2 ? nb - b0 : 2;
        v16f x0b[8], x1b[8];
        k8_bcast(e + b0 * 8, x0b);
        k8_bcast(e + b0 * 8 + (mr > 1 ? 8 : 0), x1b);
        for (int64_t j0 = 0; j0 < kp; j0 += NR) {
            v16f acc[2], g, wv;
            k8_panel(x0b, x1b, Vt->p + j0 * 8, acc);
            memcpy(&g, gb + j0, 64);
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) { /* a constant trip count keeps acc and g in registers */
                if (r >= mr) continue;
                const int b = b0 + r;
                memcpy(&wv, w + b * kp + j0, 64);
                const v16f uv = wv * (c1[b] * (acc[r] - oe[b]) + c2[b]);
                g += uv;
                memcpy(u + (j0 / NR) * nb * NR + b * NR, &uv, 64);
            }
            memcpy(gb + j0, &g, 64);
        }
    }
}

/* The output error of one query at head dim 8 as one 8-lane vector (kvm_sb_out_err per lane):
 * e = pc·(ohc·iz) + pr·o_ret − o_full; returns ⟨Ô, e⟩ and *ei = ‖e‖², both summed in float as
 * a fixed tree (no serial chain over the 8 elements). */
static inline float out_err8(float pc, float pr, float iz, const float *ohc, const float *orr, const float *o, float *e,
                             double *ei)
{
    v8f c, r, f;
    memcpy(&c, ohc, 32);
    memcpy(&r, orr, 32);
    memcpy(&f, o, 32);
    const v8f oh = pc * (c * iz) + pr * r, ev = oh - f;
    memcpy(e, &ev, 32);
    *ei = v8_hsum(ev * ev);
    return v8_hsum(oh * ev);
}

/* One query's output rows and scalars from its shares pc, pr (shares_rows); returns ⟨Ô, e⟩
 * and adds to *mse, *lse; b1, b2 out. */
static float query_row(const kvm_sculpt_view *p, int64_t i, float lc, float pc, float pr, float iz, const float *ohc,
                       float *e, double a1, double a2, float *b1, float *b2, double *mse, double *lse)
{
    const int d = p->d;
    double dl, wz;
    kvm_sb_lse_terms(lc, p->lse_ret[i], 1, p->n_vis[i] > 0, p->lse_zone[i], p->nc > 0, p->lse_mass_weight, &dl, &wz);
    const float *o = p->o_full + i * d, *orr = p->o_ret + i * d;
    double ei = 0;
    float oe = 0;
    if (d == 8) oe = out_err8(pc, pr, iz, ohc, orr, o, e, &ei);
    for (int t = 0; d != 8 && t < d; t++) {
        float oh;
        e[t] = kvm_sb_out_err(pc, ohc[t] * iz, pr, orr[t], o[t], &oh);
        ei += (double)e[t] * e[t];
        oe += oh * e[t];
    }
    *mse += ei;
    *lse += wz * dl * dl;
    *b1 = (float)(a1 * pc);
    *b2 = (float)(a2 * wz * dl);
    return oe;
}

/* The exponentiated softmax rows of nb queries from i0 into w->S (biases b0 [kp]), their LSEs
 * lc[nb] and inverse sums iz[nb]. */
static void score_rows(const kvm_sculpt_view *p, int64_t i0, int nb, int64_t k, const float *b0, sb_work *w,
                       float *lc, float *iz)
{
    const int d = p->d;
    const int64_t kp = w->kp;
    if (d == 8) {
        float mx[QB];
        if (kvm__cpu_v4())
            scores_k8(p->q + i0 * d, nb, &w->kpk, kp, p->scale, b0, w->S, mx);
        else
            kvm__sb_scores_k8n(p->q + i0 * d, nb, &w->kpk, kp, p->scale, b0, w->S, mx);
        exp_rows(w->S, nb, kp, mx, lc, iz);
        return;
    }
    kvm__cpu_gemm_packed(p->q + i0 * d, nb, d, &w->kpk, w->S, kp, p->scale, 0, k, d);
    for (int b = 0; b < nb; b++) lc[b] = softmax_row(w->S + b * kp, b0, kp, &iz[b]);
}

/* One block of nb queries from i0: the forward pass and (when want_grad) the ∂score rows and,
 * at head dim 8, their term of the key gradient. */
static void block(const kvm_sculpt_view *p, int64_t i0, int nb, int64_t k, const float *b0, double a1, double a2,
                  int want_grad, sb_work *w, double *mse, double *lse)
{
    const int d = p->d;
    const int64_t kp = w->kp;
    float lc[QB], iz[QB], oe[QB], b1[QB], b2[QB];
    if (d == 8 && !kvm__cpu_v4()) { /* 16 registers (AVX2, baseline): kvm_cpu_sculpt_k8n.c */
        float mx[QB];
        kvm__sb_scores_k8n(p->q + i0 * d, nb, &w->kpk, kp, p->scale, b0, w->S, mx);
        kvm__sb_exp_wv8n(w->S, nb, kp, mx, &w->vtpk, w->oh, lc, iz);
    } else if (d == 8) {
        float mx[QB];
        scores_k8(p->q + i0 * d, nb, &w->kpk, kp, p->scale, b0, w->S, mx);
#ifdef SB_HAVE_V4
        if (kvm__cpu_v4())
            exp_wv8_v4(w->S, nb, kp, mx, &w->vtpk, w->oh, lc, iz);
        else
#endif
            exp_wv8(w->S, nb, kp, mx, &w->vtpk, w->oh, lc, iz);
    } else {
        score_rows(p, i0, nb, k, b0, w, lc, iz);
        kvm__cpu_gemm_packed(w->S, nb, kp, &w->vpk, w->oh, d, 1.0f, 0, d, k);
    }
    float pc[QB], pr[QB];
    shares_rows(lc, p->lse_ret + i0, p->n_vis + i0, nb, pc, pr);
    for (int b = 0; b < nb; b++)
        oe[b] = query_row(p, i0 + b, lc[b], pc[b], pr[b], iz[b], w->oh + b * d, w->E + b * d, a1, a2, &b1[b], &b2[b],
                          mse, lse);
    if (!want_grad) return;
    if (d == 8) {
        for (int b = 0; b < nb; b++) {
            b1[b] *= iz[b];
            b2[b] *= iz[b];
        }
        if (!kvm__cpu_v4()) {
            kvm__sb_dscore_k8n(w->E, nb, &w->vtpk, kp, w->S, oe, b1, b2, w->R, w->gb);
            kvm__sb_grad_k8n(p->q + i0 * d, nb, w->R, kp, w->gt);
            return;
        }
        dscore_k8(w->E, nb, &w->vtpk, kp, w->S, oe, b1, b2, w->R, w->gb);
        grad_k8(p->q + i0 * d, nb, w->R, kp, w->gt);
        return;
    }
    kvm__cpu_gemm_packed(w->E, nb, d, &w->vtpk, w->R, kp, 1.0f, 0, k, d);
    for (int b = 0; b < nb; b++)
        dscore_row(w->S + b * kp, iz[b], w->R + b * kp, oe[b], b1[b], b2[b], kp, p->nq, i0 + b, w->upk.p, w->gb);
}

kvm_cpu_sculpt_scratch *kvm_cpu_sculpt_scratch_new(void)
{
    kvm_cpu_sculpt_scratch *ws = calloc(1, sizeof *ws);
    if (!ws) kvm_err(KVM_ENOMEM, "sculpt kernel: out of memory (scratch)");
    return ws;
}

void kvm_cpu_sculpt_scratch_free(kvm_cpu_sculpt_scratch *ws)
{
    if (!ws) return;
    kvm__cpu_packed_free(&ws->kpk);
    kvm__cpu_packed_free(&ws->vpk);
    kvm__cpu_packed_free(&ws->vtpk);
    kvm__cpu_packed_free(&ws->upk);
    free(ws->buf);
    free(ws);
}

static void work_free(sb_work *w)
{
    if (w->own_ws) kvm_cpu_sculpt_scratch_free(w->ws);
}

/* Room for n floats in ws->buf, zeroed (padding columns and the accumulators start at 0). */
static int scratch_room(kvm_cpu_sculpt_scratch *ws, size_t n)
{
    if (n > ws->cap) {
        free(ws->buf);
        ws->buf = aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63);
        ws->cap = ws->buf ? n : 0;
        if (!ws->buf) return KVM_ENOMEM;
    }
    memset(ws->buf, 0, n * sizeof(float));
    return 0;
}

/* Packs the entries and lays out the scratch in ws (NULL: a fresh one, freed by work_free). */
static int work_new(sb_work *w, kvm_cpu_sculpt_scratch *ws, const kvm_sculpt_view *p, const float *kc,
                    const float *vc, int64_t k, int grad)
{
    const int d = p->d;
    const int64_t kp = (k + NR - 1) / NR * NR, nq = p->nq;
    memset(w, 0, sizeof *w);
    w->kp = kp;
    w->own_ws = ws == NULL;
    w->ws = ws ? ws : kvm_cpu_sculpt_scratch_new();
    if (!w->ws) goto fail;
    ws = w->ws;
    const int full_u = grad && d != 8, build_qt = full_u && !p->qt; /* d = 8: U per block, in R */
    size_t nf = (size_t)kp * (2 * QB + d + 2) + (size_t)(2 * QB * d) + (build_qt ? (size_t)(d * nq) : 0);
    if (scratch_room(ws, nf) || kvm__cpu_pack(&ws->kpk, kc, k, d, d, 1) ||
        kvm__cpu_pack(&ws->vpk, vc, d, k, 1, d) || kvm__cpu_pack(&ws->vtpk, vc, k, d, d, 1))
        goto fail;
    w->kpk = ws->kpk;
    w->vpk = ws->vpk;
    w->vtpk = ws->vtpk;
    w->S = ws->buf;
    w->R = w->S + QB * kp;
    w->gt = w->R + QB * kp;
    w->gb = w->gt + (int64_t)d * kp;
    float *b0 = w->gb + kp; /* the caller fills the biases row */
    w->oh = b0 + kp;
    w->E = w->oh + QB * d;
    float *qt = w->E + QB * d;
    w->qt = build_qt ? qt : p->qt;
    if (full_u) {
        /* every slot of U is written by the ∂score rows: no clearing */
        if (kp * nq > ws->upk.cap) {
            free(ws->upk.p);
            size_t bytes = ((size_t)(kp * nq) * sizeof(float) + 63) & ~(size_t)63;
            ws->upk.p = aligned_alloc(64, bytes ? bytes : 64);
            ws->upk.cap = ws->upk.p ? kp * nq : 0;
            if (!ws->upk.p) goto fail;
        }
        ws->upk.out = k;
        ws->upk.in = nq;
        w->upk = ws->upk;
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
    return kvm_cpu_sculpt_lossgrad_ws(NULL, p, kc, vc, beta, k, lambda, grad_k, grad_b, out);
}

int kvm_cpu_sculpt_lossgrad_ws(kvm_cpu_sculpt_scratch *ws, const kvm_sculpt_view *p, const float *kc, const float *vc,
                               const float *beta, int64_t k, double lambda, float *grad_k, float *grad_b,
                               kvm_sculpt_eval *out)
{
    const int d = p->d, grad = grad_k != NULL || grad_b != NULL;
    if (k < 1 || d < 1 || d > 512) return kvm_err(KVM_EINVAL, "sculpt kernel: k = %lld, d = %d", (long long)k, d);
    sb_work w;
    int rc = work_new(&w, ws, p, kc, vc, k, grad);
    if (rc) return rc;
    const int64_t kp = w.kp, nq = p->nq;
    float *b0 = w.gb + kp;
    for (int64_t j = 0; j < kp; j++) b0[j] = j < k ? (beta ? beta[j] : 0.0f) : -1e30f;
    const double a1 = 2.0 / ((double)nq * p->out_ms), a2 = 2.0 * lambda / (double)nq;
    double mse = 0, lse = 0;
    const int qb = d == 8 ? QB8 : QB;
    for (int64_t i0 = 0; i0 < nq; i0 += qb)
        block(p, i0, nq - i0 < qb ? (int)(nq - i0) : qb, k, b0, a1, a2, grad, &w, &mse, &lse);
    if (grad) {
        /* d = 8: the blocks summed Qᵀ·U unscaled; otherwise one GEMM over all queries now */
        const float gs = d == 8 ? p->scale : 1.0f;
        if (d != 8) kvm__cpu_gemm_packed(w.qt, d, nq, &w.upk, w.gt, kp, p->scale, 0, k, nq);
        if (grad_k)
            for (int64_t j = 0; j < k; j++)
                for (int t = 0; t < d; t++) grad_k[j * d + t] = gs * w.gt[t * kp + j];
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
    int rc = work_new(&w, NULL, p, kc, kc, k, 0);
    if (rc) return rc;
    const int64_t kp = w.kp, nq = p->nq;
    float *b0 = w.gb + kp;
    for (int64_t j = 0; j < kp; j++) b0[j] = j < k ? (beta ? beta[j] : 0.0f) : -1e30f;
    for (int64_t i0 = 0; i0 < nq; i0 += QB) {
        const int nb = nq - i0 < QB ? (int)(nq - i0) : QB;
        float lc[QB], iz[QB];
        score_rows(p, i0, nb, k, b0, &w, lc, iz);
        for (int b = 0; b < nb; b++) {
            const int64_t i = i0 + b;
            kvm_sb_query s =
                kvm_sb_query_shares(lc[b], p->lse_ret[i], 1, p->n_vis[i] > 0, p->lse_zone[i], p->nc > 0, 0);
            const float c = s.pc * iz[b];
            for (int64_t j = 0; j < k; j++) P[i * k + j] = c * w.S[b * kp + j];
            pr[i] = s.pr;
        }
    }
    work_free(&w);
    return 0;
}
