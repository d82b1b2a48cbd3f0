/* kvm_cpu_chol.c: the CPU backend's float64 Cholesky solve of the KVSculpt ridge (arXiv
 * 2603.27819 §3 value step: (PᵀP + αI) V = PᵀT + αV0), blocked right-looking on the row-major
 * upper triangle, so the normal equations are solved where they were built, without LAPACKE's
 * row-major transposes of A and B. At SmolLM2's shape (k ≈ 600, d = 64) Debian's OpenBLAS
 * (generic kernels) took 10–13 ms per dposv, about half of the whole value step.
 * Each row update is a vector loop over contiguous columns (cloned for AVX-512 / AVX2), every
 * sum in a fixed order: the result depends on the arguments only. Blocks of 64-byte sums where
 * the processor has AVX-512's 32 registers (kvm__cpu_v4), of 8 columns in 32-byte halves
 * elsewhere: GCC keeps the 64-byte blocks' sums on the stack on AVX2, where the solve ran at
 * 1.4 GFLOP/s (15x slower; a SmolLM2 am compression spent a quarter of its time here). */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_clones.h"

#include <math.h>
#include <string.h>

enum { CB = 48 }; /* rows per panel: the panel's U rows (CB·k doubles) stay in L2 */

/* Rows [i0, i1) of U from the panel rows of A (trailing update of earlier panels done): the
 * diagonal block by Cholesky–Crout in row form, then each row's entries right of the block,
 * U[i][c] = (A[i][c] − Σ_{i0≤l<i} U[l][i]·U[l][c]) / U[i][i]. Returns 0 or i + 1 for a pivot
 * that is not positive and finite. */
KVM_CLONES
static int64_t panel(double *A, int64_t k, int64_t i0, int64_t i1)
{
    for (int64_t i = i0; i < i1; i++) {
        double *ri = A + i * k;
        for (int64_t l = i0; l < i; l++) { /* row i −= U[l][i]·row l, columns ≥ i */
            const double u = A[l * k + i];
            const double *rl = A + l * k;
            for (int64_t c = i; c < k; c++) ri[c] -= u * rl[c];
        }
        const double a = ri[i];
        if (!(a > 0) || !isfinite(a)) return i + 1;
        const double p = sqrt(a), ip = 1.0 / p;
        ri[i] = p;
        for (int64_t c = i + 1; c < k; c++) ri[c] *= ip;
    }
    return 0;
}

typedef double v8d __attribute__((vector_size(64)));

enum { TR = 4 }; /* rows per step of the trailing update and the solves */

/* Columns [c, c + 8·NV) of the TR rows r.. (rows at or past k get u = 0 and are not stored):
 * A[r+q][·] −= Σ_l U[l][r+q]·U[l][·], l over the panel in order, the TR·NV sums in registers,
 * so each vector of the panel read from L2 serves TR FMAs. Only columns ≥ lo and ≥ r + q are
 * written in row r + q (lo ≤ c: every lane), so a block may start on the diagonal or overlap
 * columns already done. */
static inline __attribute__((always_inline)) void trail_block(double *A, int64_t k, int64_t i0, int64_t i1,
                                                              int64_t r, int nr, int64_t c, int64_t lo, const int NV)
{
    v8d s[TR][4] = {{{0}}}, x[4];
    for (int64_t l = i0; l < i1; l++) {
        const double *rl = A + l * k;
        for (int v = 0; v < NV; v++) memcpy(&x[v], rl + c + 8 * v, 64);
        for (int q = 0; q < TR; q++) {
            const double u = q < nr ? rl[r + q] : 0;
            for (int v = 0; v < NV; v++) s[q][v] += u * x[v];
        }
    }
    for (int q = 0; q < nr; q++) {
        const int64_t from = lo > r + q ? lo : r + q;
        for (int v = 0; v < NV; v++) {
            double *a = A + (r + q) * k + c + 8 * v;
            memcpy(&x[0], a, 64);
            x[0] -= s[q][v];
            if (from <= c + 8 * v) {
                memcpy(a, &x[0], 64);
                continue;
            }
            for (int j = 0; j < 8; j++) /* the lanes left of `from` keep their values */
                if (c + 8 * v + j >= from) a[j] = x[0][j];
        }
    }
}

typedef double v4d __attribute__((vector_size(32)));

/* trail_block for 8 columns as two 32-byte vectors: the AVX2 shape (16 vector registers; the
 * 64-byte sums of trail_block spill there). Every sum over l runs in the same order as
 * trail_block's, so the two shapes give bit-identical results. */
static inline __attribute__((always_inline)) void trail_block_narrow(double *A, int64_t k, int64_t i0, int64_t i1,
                                                                     int64_t r, int nr, int64_t c, int64_t lo)
{
    v4d s0[TR] = {{0}}, s1[TR] = {{0}}, x0, x1;
    for (int64_t l = i0; l < i1; l++) {
        const double *rl = A + l * k;
        memcpy(&x0, rl + c, 32);
        memcpy(&x1, rl + c + 4, 32);
        for (int q = 0; q < TR; q++) {
            const double u = q < nr ? rl[r + q] : 0;
            s0[q] += u * x0;
            s1[q] += u * x1;
        }
    }
    for (int q = 0; q < nr; q++) {
        const int64_t from = lo > r + q ? lo : r + q;
        double *a = A + (r + q) * k + c;
        for (int j = 0; j < 4; j++)
            if (c + j >= from) a[j] -= s0[q][j];
        for (int j = 0; j < 4; j++)
            if (c + 4 + j >= from) a[4 + j] -= s1[q][j];
    }
}

/* Trailing update after panel [i0, i1): A[r][c] −= Σ_{i0≤l<i1} U[l][r]·U[l][c] for i1 ≤ r ≤ c
 * (upper triangle), TR rows at a time: the 8 columns from the diagonal (their triangle by the
 * store mask), then 32 columns at a time, then 8, and the last few as an 8-column block ending
 * at column k whose lanes already done are not stored; scalar sums where fewer than 8 columns
 * are left. Every sum over l runs in order. */
KVM_CLONES
static void trailing(double *A, int64_t k, int64_t i0, int64_t i1, int wide)
{
    for (int64_t r = i1; r < k; r += TR) {
        const int nr = k - r < TR ? (int)(k - r) : TR;
        if (r + 8 > k) {
            for (int q = 0; q < nr; q++)
                for (int64_t c = r + q; c < k; c++) {
                    double s = 0;
                    for (int64_t l = i0; l < i1; l++) s += A[l * k + r + q] * A[l * k + c];
                    A[(r + q) * k + c] -= s;
                }
            continue;
        }
        if (!wide) {
            int64_t c = r;
            for (; c + 8 <= k; c += 8)
                trail_block_narrow(A, k, i0, i1, r, nr, c, c);
            if (c < k) trail_block_narrow(A, k, i0, i1, r, nr, k - 8, c);
            continue;
        }
        trail_block(A, k, i0, i1, r, nr, r, r, 1);
        int64_t c = r + 8;
        for (; c + 32 <= k; c += 32) trail_block(A, k, i0, i1, r, nr, c, c, 4);
        for (; c + 8 <= k; c += 8) trail_block(A, k, i0, i1, r, nr, c, c, 1);
        if (c < k) trail_block(A, k, i0, i1, r, nr, k - 8, c, 1);
    }
}

/* The solves' rows in blocks of TR: rows [i, i + nr) of B (8·NV columns from column t0, row
 * stride D) get −Σ_l U·y_l over the rows l already solved — forward (fwd): l < i with U[l][i+q];
 * back: l ≥ i + nr with U[i+q][l] — each loaded y_l serving TR sums; l in order. */
static inline __attribute__((always_inline)) void solve_block(const double *A, int64_t k, double *B, int D,
                                                              int64_t i, int nr, int t0, int fwd, const int NV)
{
    v8d s[TR][4] = {{{0}}}, x[4];
    const int64_t l0 = fwd ? 0 : i + nr, l1 = fwd ? i : k;
    for (int64_t l = l0; l < l1; l++) {
        for (int v = 0; v < NV; v++) memcpy(&x[v], B + l * D + t0 + 8 * v, 64);
        for (int q = 0; q < TR; q++) {
            const double u = q >= nr ? 0 : fwd ? A[l * k + i + q] : A[(i + q) * k + l];
            for (int v = 0; v < NV; v++) s[q][v] += u * x[v];
        }
    }
    for (int q = 0; q < nr; q++)
        for (int v = 0; v < NV; v++) {
            double *b = B + (i + q) * D + t0 + 8 * v;
            memcpy(&x[0], b, 64);
            x[0] -= s[q][v];
            memcpy(b, &x[0], 64);
        }
}

/* solve_block for 8 columns as two 32-byte vectors (the AVX2 shape; sums in the same order). */
static inline __attribute__((always_inline)) void solve_block_narrow(const double *A, int64_t k, double *B, int D,
                                                                     int64_t i, int nr, int t0, int fwd)
{
    v4d s0[TR] = {{0}}, s1[TR] = {{0}}, x0, x1;
    const int64_t l0 = fwd ? 0 : i + nr, l1 = fwd ? i : k;
    for (int64_t l = l0; l < l1; l++) {
        memcpy(&x0, B + l * D + t0, 32);
        memcpy(&x1, B + l * D + t0 + 4, 32);
        for (int q = 0; q < TR; q++) {
            const double u = q >= nr ? 0 : fwd ? A[l * k + i + q] : A[(i + q) * k + l];
            s0[q] += u * x0;
            s1[q] += u * x1;
        }
    }
    for (int q = 0; q < nr; q++) {
        double *b = B + (i + q) * D + t0;
        memcpy(&x0, b, 32);
        memcpy(&x1, b + 4, 32);
        x0 -= s0[q];
        x1 -= s1[q];
        memcpy(b, &x0, 32);
        memcpy(b + 4, &x1, 32);
    }
}

/* The same for columns [t0, t1) of any d, sums in memory (l in order). */
static void solve_block_any(const double *A, int64_t k, double *B, int d, int64_t i, int nr, int t0, int t1, int fwd)
{
    const int64_t l0 = fwd ? 0 : i + nr, l1 = fwd ? i : k;
    for (int q = 0; q < nr; q++)
        for (int t = t0; t < t1; t++) {
            double s = 0;
            for (int64_t l = l0; l < l1; l++) s += (fwd ? A[l * k + i + q] : A[(i + q) * k + l]) * B[l * d + t];
            B[(i + q) * d + t] -= s;
        }
}

/* Rows [i, i + nr) finished within their block (in order forward, in reverse backward): row i+q
 * loses the terms of the block's rows solved before it, then is divided by its pivot. */
static void solve_diag(const double *A, int64_t k, double *B, int d, int64_t i, int nr, int fwd)
{
    for (int n = 0; n < nr; n++) {
        const int q = fwd ? n : nr - 1 - n;
        double *b = B + (i + q) * d;
        for (int n2 = 0; n2 < n; n2++) {
            const int p = fwd ? n2 : nr - 1 - n2;
            const double u = fwd ? A[(i + p) * k + i + q] : A[(i + q) * k + i + p];
            for (int t = 0; t < d; t++) b[t] -= u * B[(i + p) * d + t];
        }
        const double ip = 1.0 / A[(i + q) * k + i + q];
        for (int t = 0; t < d; t++) b[t] *= ip;
    }
}

/* B ← U⁻¹ U⁻ᵀ B for B [k][d]: forward Uᵀ Y = B, then back U X = Y, TR rows at a time (the
 * rows already solved gathered 32 columns at a time, then 8, then any rest; then the block's own
 * triangle). */
KVM_CLONES
static void solve_rows(const double *A, int64_t k, double *B, int d, int wide)
{
    for (int pass = 0; pass < 2; pass++) {
        const int fwd = pass == 0;
        for (int64_t n = 0; n < k; n += TR) {
            const int nr = k - n < TR ? (int)(k - n) : TR;
            const int64_t i = fwd ? n : k - n - nr;
            int t = 0;
            if (wide) {
                for (; t + 32 <= d; t += 32)
                    solve_block(A, k, B, d, i, nr, t, fwd, 4);
                for (; t + 8 <= d; t += 8)
                    solve_block(A, k, B, d, i, nr, t, fwd, 1);
            } else {
                for (; t + 8 <= d; t += 8)
                    solve_block_narrow(A, k, B, d, i, nr, t, fwd);
            }
            if (t < d) solve_block_any(A, k, B, d, i, nr, t, d, fwd);
            solve_diag(A, k, B, d, i, nr, fwd);
        }
    }
}

int64_t kvm_cpu_dposv_upper(int64_t k, int d, double *A, double *B)
{
    const int wide = kvm__cpu_v4();
    for (int64_t i0 = 0; i0 < k; i0 += CB) {
        const int64_t i1 = k - i0 < CB ? k : i0 + CB;
        int64_t bad = panel(A, k, i0, i1);
        if (bad) return bad;
        if (i1 < k) trailing(A, k, i0, i1, wide);
    }
    solve_rows(A, k, B, d, wide);
    return 0;
}
