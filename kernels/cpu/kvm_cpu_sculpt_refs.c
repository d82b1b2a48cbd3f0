/* kvm_cpu_sculpt_refs.c: the full-cache references of a KVSculpt problem on the CPU (query
 * construction, arXiv 2603.27819 §3): scores, softmax rows and outputs over the compress zone
 * and the visible retain entries as blocked float32 GEMMs, row sums in float64. */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_sculpt_rows.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

enum { QB = KVM_SB_QB, NR = KVM_GEMM_NR };

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
