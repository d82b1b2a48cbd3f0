/* kvm_cpu_sculpt.c: the KVSculpt loss and gradient of one problem on the CPU as query-blocked
 * GEMMs (kvmill's packed microkernel) with fused row kernels between them; the per-element
 * math is kernels/kvm_sculpt_body.h. Entries are padded to a multiple of NR = 16 and every row
 * loop runs over whole blocks with 16 independent lanes, so it vectorises without -ffast-math. */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/kvm_sculpt_body.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define SB_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SB_CLONES
#endif

enum { QB = 64, NR = KVM_GEMM_NR };

/* Scratch of one evaluation (one allocation). kp = k rounded up to NR. */
typedef struct sb_work {
    int64_t kp;
    kvm_cpu_packed kpk, vpk, vtpk; /* Kc (out k, in d), Vc as (out d, in k), Vc as (out k, in d) */
    kvm_cpu_packed upk;            /* ∂score U of every query, already in panel layout [kp/NR][nq][NR] */
    float *S;                      /* [QB][kp] scores, then softmax weights W */
    float *oh, *E;                 /* [QB][d] distilled-part output, then the output error */
    float *R;                      /* [QB][kp] E·Vcᵀ */
    float *qt;                     /* [d][nq] Qᵀ */
    float *gt;                     /* [d][kp] Qᵀ·U */
    float *gb;                     /* [kp] Σ_i U */
} sb_work;

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* kvm_sb_expf on 8 lanes: the same operations in the same order, so each lane is bit-identical
 * to the scalar body (GCC does not vectorise the body's bit cast by itself). */
static inline v8f v8_expf(v8f x)
{
    const v8f lo = (v8f){0} - 87.0f;
    x = (v8f)((v8i)x & (x >= lo)) + (v8f)((v8i)lo & ~(x >= lo)); /* x < −87 ? −87 : x */
    v8f t = x * 1.44269504088896341f;
    v8f r = (t + 12582912.0f) - 12582912.0f;
    v8f f = (t - r) * 0.693147180559945309f;
    v8f p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    v8i bits = (__builtin_convertvector(r, v8i) + 127) << 23;
    return p * (v8f)bits;
}

/* Exponentials of one score row s[0..kp) (+ beta; padding beyond k is −1e30) in place,
 * unnormalised: s_j ← exp(s_j + β_j − max). Returns the row's LSE; *iz = 1/Σ_j s_j. */
SB_CLONES
static float softmax_row(float *restrict s, const float *restrict b0, int64_t kp, float *iz)
{
    v8f m0 = (v8f){0} - INFINITY, m1 = m0, x0, x1, y0, y1;
    for (int64_t j = 0; j < kp; j += NR) {
        memcpy(&x0, s + j, 32);
        memcpy(&x1, s + j + 8, 32);
        memcpy(&y0, b0 + j, 32);
        memcpy(&y1, b0 + j + 8, 32);
        x0 += y0;
        x1 += y1;
        memcpy(s + j, &x0, 32);
        memcpy(s + j + 8, &x1, 32);
        m0 = (v8f)(((v8i)m0 & (m0 >= x0)) | ((v8i)x0 & ~(m0 >= x0)));
        m1 = (v8f)(((v8i)m1 & (m1 >= x1)) | ((v8i)x1 & ~(m1 >= x1)));
    }
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++) {
        mx = m0[l] > mx ? m0[l] : mx;
        mx = m1[l] > mx ? m1[l] : mx;
    }
    v8f a0 = {0}, a1 = {0};
    for (int64_t j = 0; j < kp; j += NR) {
        memcpy(&x0, s + j, 32);
        memcpy(&x1, s + j + 8, 32);
        x0 = v8_expf(x0 - mx);
        x1 = v8_expf(x1 - mx);
        memcpy(s + j, &x0, 32);
        memcpy(s + j + 8, &x1, 32);
        a0 += x0;
        a1 += x1;
    }
    v8f a = a0 + a1;
    float z = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    *iz = 1.0f / z;
    return mx + logf(z);
}

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
    kvm__cpu_gemm_packed(p->q + i0 * d, nb, d, &w->kpk, w->S, kp, p->scale, 0, k, d);
    for (int b = 0; b < nb; b++) lc[b] = softmax_row(w->S + b * kp, b0, kp, &iz[b]);
    kvm__cpu_gemm_packed(w->S, nb, kp, &w->vpk, w->oh, d, 1.0f, 0, d, k);
    for (int b = 0; b < nb; b++)
        oe[b] = query_row(p, i0 + b, lc[b], iz[b], w->oh + b * d, w->E + b * d, a1, a2, &b1[b], &b2[b], mse, lse);
    if (!want_grad) return;
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
    size_t nf = (size_t)kp * (2 * QB + d + 2) + (size_t)(2 * QB * d) + (grad ? (size_t)(d * nq) : 0);
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
    w->qt = w->E + QB * d;
    if (grad) {
        size_t bytes = ((size_t)(kp * nq) * sizeof(float) + 63) & ~(size_t)63;
        if (!(w->upk.p = aligned_alloc(64, bytes ? bytes : 64))) goto fail;
        /* every slot of U is written by the ∂score rows: no clearing */
        w->upk.out = k;
        w->upk.in = nq;
        w->upk.cap = kp * nq;
        for (int64_t i = 0; i < nq; i++)
            for (int t = 0; t < d; t++) w->qt[t * nq + i] = p->q[i * d + t];
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
        kvm__cpu_gemm_packed(p->q + i0 * d, nb, d, &w.kpk, w.S, kp, p->scale, 0, k, d);
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

/* Scratch of kvm_cpu_sculpt_refs. */
typedef struct refs_work {
    int64_t ncp, mp;
    kvm_cpu_packed kz, vz, kr, vr;
    float *S, *R, *OZ, *OR, *bz, *br;
} refs_work;

static void refs_free(refs_work *w)
{
    kvm__cpu_packed_free(&w->kz);
    kvm__cpu_packed_free(&w->vz);
    kvm__cpu_packed_free(&w->kr);
    kvm__cpu_packed_free(&w->vr);
    free(w->S);
}

static int refs_new(refs_work *w, const kvm_sculpt_refs_in *in)
{
    const int d = in->d;
    memset(w, 0, sizeof *w);
    w->ncp = (in->nc + NR - 1) / NR * NR;
    w->mp = (in->m + NR - 1) / NR * NR;
    w->S = calloc((size_t)(QB * (w->ncp + w->mp) + 2 * QB * d + w->ncp + w->mp), sizeof *w->S);
    if (!w->S) return KVM_ENOMEM;
    w->R = w->S + QB * w->ncp;
    w->OZ = w->R + QB * w->mp;
    w->OR = w->OZ + QB * d;
    w->bz = w->OR + QB * d;
    w->br = w->bz + w->ncp;
    for (int64_t j = 0; j < w->ncp; j++) w->bz[j] = j < in->nc ? 0.0f : -1e30f;
    for (int64_t j = 0; j < w->mp; j++) w->br[j] = j < in->m ? 0.0f : -1e30f;
    if (in->nc > 0 && (kvm__cpu_pack(&w->kz, in->kz, in->nc, d, d, 1) || kvm__cpu_pack(&w->vz, in->vz, d, in->nc, 1, d)))
        return KVM_ENOMEM;
    if (in->m > 0 && (kvm__cpu_pack(&w->kr, in->kr, in->m, d, d, 1) || kvm__cpu_pack(&w->vr, in->vr, d, in->m, 1, d)))
        return KVM_ENOMEM;
    return 0;
}

/* One query's references from its exponentiated rows (zone ez, retain er) and their outputs. */
static void refs_row(const kvm_sculpt_refs_in *in, int64_t i, float lz, float izz, float lr, float izr,
                     const float *ez, const float *oz, const float *orr, float *o_full, float *o_ret, double *mass,
                     double *out_sq)
{
    const int d = in->d;
    const int64_t nv = in->n_vis[i];
    kvm_sb_query s = kvm_sb_query_shares(lz, lr, in->nc > 0, nv > 0, lz, in->nc > 0, 0);
    double on = 0;
    for (int t = 0; t < d; t++) {
        float r = nv > 0 ? orr[t] * izr : 0.0f, o = s.pc * (oz[t] * izz) + s.pr * r;
        o_full[i * d + t] = o;
        o_ret[i * d + t] = r;
        on += (double)o * o;
    }
    *out_sq += on;
    if (i < in->n_mass)
        for (int64_t j = 0; j < in->nc; j++) mass[j] += (double)(s.pc * izz) * ez[j];
}

/* Exponentiated retain row b of query i (entries beyond its visible prefix masked to 0). */
static float retain_row(const kvm_sculpt_refs_in *in, refs_work *w, int b, int64_t i, float *izr)
{
    float *r = w->R + b * w->mp;
    const int64_t nv = in->n_vis[i];
    if (nv <= 0) {
        *izr = 0;
        return KVM_SB_NO_LSE;
    }
    for (int64_t j = nv; j < in->m; j++) r[j] = -1e30f;
    float l = softmax_row(r, w->br, w->mp, izr);
    for (int64_t j = nv; j < in->m; j++) r[j] = 0.0f;
    return l;
}

int kvm_cpu_sculpt_refs(const kvm_sculpt_refs_in *in, float *o_full, float *o_ret, float *lse_zone, float *lse_ret,
                        double *mass, double *out_sq)
{
    const int d = in->d;
    refs_work w;
    int rc = refs_new(&w, in);
    if (rc) {
        refs_free(&w);
        return kvm_err(KVM_ENOMEM, "sculpt kernel: out of memory for references (%lld queries)", (long long)in->nq);
    }
    *out_sq = 0;
    for (int64_t i0 = 0; i0 < in->nq; i0 += QB) {
        const int nb = in->nq - i0 < QB ? (int)(in->nq - i0) : QB;
        if (in->nc > 0) kvm__cpu_gemm_packed(in->q + i0 * d, nb, d, &w.kz, w.S, w.ncp, in->scale, 0, in->nc, d);
        if (in->m > 0) kvm__cpu_gemm_packed(in->q + i0 * d, nb, d, &w.kr, w.R, w.mp, in->scale, 0, in->m, d);
        float lz[QB], izz[QB], lr[QB], izr[QB];
        for (int b = 0; b < nb; b++) {
            lz[b] = in->nc > 0 ? softmax_row(w.S + b * w.ncp, w.bz, w.ncp, &izz[b]) : KVM_SB_NO_LSE;
            lr[b] = in->m > 0 ? retain_row(in, &w, b, i0 + b, &izr[b]) : KVM_SB_NO_LSE;
        }
        if (in->nc > 0) kvm__cpu_gemm_packed(w.S, nb, w.ncp, &w.vz, w.OZ, d, 1.0f, 0, d, in->nc);
        if (in->m > 0) kvm__cpu_gemm_packed(w.R, nb, w.mp, &w.vr, w.OR, d, 1.0f, 0, d, in->m);
        for (int b = 0; b < nb; b++) {
            const int64_t i = i0 + b;
            lse_zone[i] = lz[b];
            lse_ret[i] = in->n_vis[i] > 0 ? lr[b] : KVM_SB_NO_LSE;
            refs_row(in, i, lz[b], in->nc > 0 ? izz[b] : 0.0f, lr[b], in->m > 0 ? izr[b] : 0.0f, w.S + b * w.ncp,
                     w.OZ + b * d, w.OR + b * d, o_full, o_ret, mass, out_sq);
        }
    }
    refs_free(&w);
    return 0;
}
