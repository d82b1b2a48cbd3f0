/* kvm_cpu_sculpt_normal.c: the ridge normal equations of one KVSculpt problem on the CPU
 * (arXiv 2603.27819 §3 value step; kernels/kvm_sculpt_kernels.h): A = PᵀP, B = PᵀT from the
 * design P of kvm_cpu_sculpt_probs, either in float64 by OpenBLAS (dsyrk/dgemm, the solve
 * before issue 12's part 5) or by kvmill's own float32 GEMM over blocks of queries whose
 * products are summed in float64 (view ridge_f32 = 1: about 4× the float64 GEMM's speed on
 * machines where Debian's OpenBLAS runs its generic kernels). */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/kvm_blas.h"
#include "common/kvm_error.h"

#include <cblas.h>
#include <stdlib.h>

/* Queries per float32 block: each entry of A, B is a float32 sum of at most QN products (the
 * relative rounding of a sum of QN nonnegative terms stays ≲ QN·2⁻²⁴ ≈ 8e-6, typically √QN·2⁻²⁴),
 * and the blocks are added in float64; QN·k floats of Pᵀ stay in L2 at k ≈ 600. */
enum { QN = 128, RB = 64 /* rows of A per GEMM call: only the blocks on or above the diagonal */ };

/* A (upper triangle) += Pᵀ·P and B += Pᵀ·T over queries [i0, i0 + nb) of P [nq][k], T [nq][d]
 * (float32), through the scratch Pt [k][QN], Y [k][k], Yb [k][d] and the two packed operands. */
static int block_f32(const float *P, const float *T, int64_t k, int d, int64_t i0, int nb, float *Pt, float *Y,
                     float *Yb, kvm_cpu_packed *pp, kvm_cpu_packed *tp, double *A, double *B)
{
    const float *Pb = P + i0 * k, *Tb = T + i0 * d;
    for (int b0 = 0; b0 < nb; b0 += 8) /* Pᵀ in 8×8 tiles: both sides stay in a few cache lines */
        for (int64_t j0 = 0; j0 < k; j0 += 8)
            for (int64_t j = j0; j < j0 + 8 && j < k; j++)
                for (int b = b0; b < b0 + 8 && b < nb; b++) Pt[j * QN + b] = Pb[b * k + j];
    if (kvm__cpu_pack(pp, Pb, k, nb, 1, k) || kvm__cpu_pack(tp, Tb, d, nb, 1, d)) return KVM_ENOMEM;
    for (int64_t r0 = 0; r0 < k; r0 += RB) {
        const int64_t rows = k - r0 < RB ? k - r0 : RB, c0 = r0 / KVM_GEMM_NR * KVM_GEMM_NR;
        kvm__cpu_gemm_packed(Pt + r0 * QN, rows, QN, pp, Y + r0 * k, k, 1.0f, c0, k, nb);
        for (int64_t r = r0; r < r0 + rows; r++)
            for (int64_t c = r; c < k; c++) A[r * k + c] += Y[r * k + c];
    }
    kvm__cpu_gemm_packed(Pt, k, QN, tp, Yb, d, 1.0f, 0, d, nb);
    for (int64_t i = 0; i < k * d; i++) B[i] += Yb[i];
    return 0;
}

/* The float32 path: A, B zeroed, then block by block in query order (fixed sums: the result
 * depends on the arguments only). */
static int normal_f32(const float *P, const float *T, int64_t nq, int64_t k, int d, double *A, double *B)
{
    float *Pt = malloc((size_t)(k * QN + k * k + k * d) * sizeof *Pt);
    kvm_cpu_packed pp = {0}, tp = {0};
    int rc = Pt ? 0 : KVM_ENOMEM;
    for (int64_t i = 0; i < k * k; i++) A[i] = 0;
    for (int64_t i = 0; i < k * d; i++) B[i] = 0;
    for (int64_t i0 = 0; !rc && i0 < nq; i0 += QN)
        rc = block_f32(P, T, k, d, i0, nq - i0 < QN ? (int)(nq - i0) : QN, Pt, Pt + k * QN, Pt + k * QN + k * k, &pp,
                       &tp, A, B);
    kvm__cpu_packed_free(&pp);
    kvm__cpu_packed_free(&tp);
    free(Pt);
    return rc;
}

/* The float64 path (OpenBLAS, one thread for reproducible sums): the solve before ridge_f32. */
static int normal_f64(const float *Pf, const double *T, int64_t nq, int64_t k, int d, double *A, double *B)
{
    double *P = malloc((size_t)(nq * k) * sizeof *P);
    if (!P) return KVM_ENOMEM;
    for (int64_t i = 0; i < nq * k; i++) P[i] = Pf[i];
    kvm_blas_lock(); /* one BLAS call at a time: the problems' workers call it concurrently */
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)k, (int)nq, 1.0, P, (int)k, 0.0, A, (int)k);
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)k, d, (int)nq, 1.0, P, (int)k, T, d, 0.0, B, d);
    kvm_blas_unlock();
    free(P);
    return 0;
}

int kvm_cpu_sculpt_normal(const kvm_sculpt_view *p, const float *kc, const float *beta, int64_t k, double *A,
                          double *B)
{
    const int d = p->d;
    const int64_t nq = p->nq;
    if (k < 1 || d < 1 || d > 512) return kvm_err(KVM_EINVAL, "sculpt kernel: k = %lld, d = %d", (long long)k, d);
    float *Pf = malloc((size_t)(nq * k) * sizeof *Pf), *Tf = malloc((size_t)(nq * d) * sizeof *Tf);
    double *T = malloc((size_t)(nq * d) * sizeof *T), *pr = malloc((size_t)(nq > 0 ? nq : 1) * sizeof *pr);
    int rc = 0;
    if (!Pf || !Tf || !T || !pr) {
        rc = KVM_ENOMEM;
        goto done;
    }
    /* probabilities in float32 (scores are well scaled: the ridge loses nothing), T in float64 */
    if ((rc = kvm_cpu_sculpt_probs(p, kc, beta, k, Pf, pr))) goto done;
    for (int64_t i = 0; i < nq; i++)
        for (int t = 0; t < d; t++) T[i * d + t] = (double)p->o_full[i * d + t] - pr[i] * p->o_ret[i * d + t];
    if (p->ridge_f32) {
        for (int64_t i = 0; i < nq * d; i++) Tf[i] = (float)T[i];
        rc = normal_f32(Pf, Tf, nq, k, d, A, B);
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
