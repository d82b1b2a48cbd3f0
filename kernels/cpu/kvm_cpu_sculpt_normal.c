/* kvm_cpu_sculpt_normal.c: the ridge normal equations of one KVSculpt problem on the CPU
 * (arXiv 2603.27819 §3 value step; kernels/kvm_sculpt_kernels.h): A = PᵀP, B = PᵀT from the
 * design P of kvm_cpu_sculpt_probs, either in float64 by OpenBLAS (dsyrk/dgemm, the solve
 * before issue 12's part 5) or in float32 register tiles over blocks of queries whose products
 * are summed in float64 (view ridge_f32 = 1: about 4× the float64 GEMM's speed on machines
 * where Debian's OpenBLAS runs its generic kernels). */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_sculpt_rows.h"
#include "common/kvm_error.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>

/* Queries per float32 block: each entry of A, B is a float32 sum of at most QN products (the
 * relative rounding of a sum of QN nonnegative terms stays ≲ QN·2⁻²⁴ ≈ 8e-6, typically √QN·2⁻²⁴),
 * and the blocks are added in float64. */
enum { QN = 128, NR = KVM_GEMM_NR, MR = KVM_GEMM_MR };
typedef double v8d __attribute__((vector_size(64)));

/* out[r][c] += Σ_{b<nb} x[b][r]·w[b][c] for rows r < mr and the 16·np columns c < nc of one
 * register tile (np = 1 or 2 panels), the sum in float32 over b in order (one FMA per term, the
 * order kvmill's GEMM tiles sum in), then widened and added to out (float64, row stride ldo);
 * only c ≥ r + diag is stored (diag = r0 − c0 for the upper triangle of A, else a large negative).
 * x has row stride ldx with mr readable columns, w row stride ldw with 16·np readable columns:
 * the operands are read in place, so the design P [nq][kp] needs neither a transposed copy nor
 * packed panels (what the GEMM call per block cost before: at SmolLM2's shape the copies and
 * the float32 staging of A took as long as the products). */
SB_CLONES
static void outer_tile(const float *x, int64_t ldx, const float *w, int64_t ldw, int nb, int mr, int np, int nc,
                       int64_t diag, double *out, int64_t ldo)
{
    /* rows past mr repeat row 0 through their own pointer, as the GEMM tiles do: a product the
     * compiler could see twice would be computed once and added without the FMA's rounding */
    const float *xr[MR];
    for (int r = 0; r < MR; r++) xr[r] = x + (r < mr ? r : 0);
    v16f a[MR][2];
    memset(a, 0, sizeof a);
    for (int64_t b = 0; b < nb; b++) {
        const float *wb = w + b * ldw;
        v16f w0, w1 = {0};
        memcpy(&w0, wb, 64);
        if (np > 1) memcpy(&w1, wb + NR, 64);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const float xv = xr[r][b * ldx];
            a[r][0] += xv * w0;
            a[r][1] += xv * w1;
        }
    }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < np; q++) {
            double *o = out + r * ldo + q * NR;
            if (q * NR >= r + diag && (q + 1) * NR <= nc) { /* a whole panel: widened 8 lanes at a time */
                v8d lo, hi;
                memcpy(&lo, o, 64);
                memcpy(&hi, o + 8, 64);
                lo += __builtin_convertvector(v16_lo(a[r][q]), v8d);
                hi += __builtin_convertvector(v16_hi(a[r][q]), v8d);
                memcpy(o, &lo, 64);
                memcpy(o + 8, &hi, 64);
                continue;
            }
            for (int c = q * NR; c < nc && c < (q + 1) * NR; c++)
                if (c >= r + diag) out[r * ldo + c] += (double)a[r][q][c % NR];
        }
}

/* A (upper triangle) += Pᵀ·P and B += Pᵀ·T over the nb queries of one block: P [nb][kp] and
 * T [nb][dp] float32 with zero columns past k and d (row strides kp, dp: multiples of 16). */
static void block_f32(const float *P, int64_t kp, const float *T, int64_t dp, int64_t k, int d, int nb, double *A,
                      double *B)
{
    for (int64_t c0 = 0; c0 < k; c0 += 2 * NR) {
        const int np = c0 + NR < k ? 2 : 1, nc = (int)(k - c0 < np * NR ? k - c0 : np * NR);
        for (int64_t r0 = 0; r0 < k && r0 < c0 + np * NR; r0 += MR) /* tiles on or above the diagonal */
            outer_tile(P + r0, kp, P + c0, kp, nb, (int)(k - r0 < MR ? k - r0 : MR), np, nc, r0 - c0,
                       A + r0 * k + c0, k);
    }
    for (int64_t c0 = 0; c0 < d; c0 += 2 * NR) {
        const int np = c0 + NR < dp ? 2 : 1, nc = (int)(d - c0 < np * NR ? d - c0 : np * NR);
        for (int64_t r0 = 0; r0 < k; r0 += MR)
            outer_tile(P + r0, kp, T + c0, dp, nb, (int)(k - r0 < MR ? k - r0 : MR), np, nc, -((int64_t)1 << 40),
                       B + r0 * d + c0, d);
    }
}

/* The float32 path: A, B zeroed, then block by block in query order (fixed sums: the result
 * depends on the arguments only). P [nq][kp], T [nq][dp] as block_f32 takes them. */
static void normal_f32(const float *P, int64_t kp, const float *T, int64_t dp, int64_t nq, int64_t k, int d, double *A,
                       double *B)
{
    for (int64_t i = 0; i < k * k; i++) A[i] = 0;
    for (int64_t i = 0; i < k * d; i++) B[i] = 0;
    for (int64_t i0 = 0; i0 < nq; i0 += QN)
        block_f32(P + i0 * kp, kp, T + i0 * dp, dp, k, d, nq - i0 < QN ? (int)(nq - i0) : QN, A, B);
}

/* The float64 path (OpenBLAS, one thread for reproducible sums): the solve before ridge_f32. */
static int normal_f64(const float *Pf, const double *T, int64_t nq, int64_t k, int d, double *A, double *B)
{
    double *P = malloc((size_t)(nq * k) * sizeof *P);
    if (!P) return KVM_ENOMEM;
    for (int64_t i = 0; i < nq * k; i++) P[i] = Pf[i];
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)k, (int)nq, 1.0, P, (int)k, 0.0, A, (int)k);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)k, d, (int)nq, 1.0, P, (int)k, T, d, 0.0, B, d);
    free(P);
    return 0;
}

int kvm_cpu_sculpt_normal(const kvm_sculpt_view *p, const float *kc, const float *beta, int64_t k, double *A,
                          double *B)
{
    const int d = p->d;
    const int64_t nq = p->nq, kp = (k + NR - 1) / NR * NR, dp = (d + NR - 1) / NR * NR;
    if (k < 1 || d < 1 || d > 512) return kvm_err(KVM_EINVAL, "sculpt kernel: k = %lld, d = %d", (long long)k, d);
    /* the float32 path reads P and T in padded rows (zero columns: whole 16-lane loads) */
    const int f32 = p->ridge_f32;
    const int64_t ldp = f32 ? kp : k;
    float *Pf = calloc((size_t)(nq * ldp) + 1, sizeof *Pf), *Tf = calloc((size_t)(nq * dp) + 1, sizeof *Tf);
    double *T = malloc((size_t)(nq * d) * sizeof *T), *pr = malloc((size_t)(nq > 0 ? nq : 1) * sizeof *pr);
    int rc = 0;
    if (!Pf || !Tf || !T || !pr) {
        rc = KVM_ENOMEM;
        goto done;
    }
    /* probabilities in float32 (scores are well scaled: the ridge loses nothing), T in float64 */
    if ((rc = kvm_cpu_sculpt_probs(p, kc, beta, k, Pf, ldp, pr))) goto done;
    for (int64_t i = 0; i < nq; i++)
        for (int t = 0; t < d; t++) T[i * d + t] = (double)p->o_full[i * d + t] - pr[i] * p->o_ret[i * d + t];
    if (f32) {
        for (int64_t i = 0; i < nq; i++)
            for (int t = 0; t < d; t++) Tf[i * dp + t] = (float)T[i * d + t];
        normal_f32(Pf, kp, Tf, dp, nq, k, d, A, B);
    } else {
        rc = normal_f64(Pf, T, nq, k, d, A, B);
    }
done:
    free(Pf);
    free(Tf);
    free(T);
    free(pr);
    if (rc == KVM_ENOMEM)
        return kvm_err(KVM_ENOMEM, "sculpt ridge: out of memory (k = %lld, %lld queries)", (long long)k, (long long)nq);
    return rc;
}
