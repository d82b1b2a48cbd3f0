// kvm_cuda_sculpt.cu: the KVSculpt batched solver's CUDA backend (kernels/kvm_sculpt_kernels.h,
// issue 12). A batch's problems live problem-major in device memory: queries and references
// [Σnq][d], entries [Σk][d], scratch [Σ nq·k]. Per problem, in the order of a call's subset, on
// one stream: cuBLAS GEMMs for S = scale·Q·Kcᵀ, Ôc = E·Vc, R = Err·Vcᵀ and G = scale·Uᵀ·Q, and row
// kernels that call the bodies of
// kernels/kvm_sculpt_body.h (kvm_sb_expf, kvm_sb_query_shares, kvm_sb_out_err, kvm_sb_dscore),
// so the arithmetic per element is the CPU backend's. A run of problems next to each other in a
// call's subset (idx[t+j] = idx[t] + j) with the same shape (nq, k, nc, scale, LSE weighting) is
// one launch of each: cublasSgemmStridedBatched / cublasDgemmStridedBatched over the run (the
// packed layout gives equal strides) and row kernels over all its rows; ragged budgets make
// shorter runs, down to one problem. Row sums are float64 and reduced in a fixed order
// (deterministic for a given device and call sequence; cuBLAS may pick its kernel by batch
// count, so unlike the CPU backend a problem's rounding may depend on the run it is in). The ridge normal equations A = PᵀP, B = PᵀT
// are float64 cuBLAS dgemm (strided-batched over a run); `ridge` solves them on the device, one
// thread block per problem running the Cholesky–Crout steps of kernels/kvm_ridge_body.h, and only
// the new values (k·d floats per problem) go to the host, as do losses (2 doubles per problem)
// and gradients (k·(d+1) floats); `normal` still hands A and B to a host solve. The L-BFGS bookkeeping stays on the host: per step the host
// sends the points (k·(d+1) floats per problem) and reads the gradients back.
// cuBLAS is opened with dlopen on first use (libcublas.so.13, kvm__cublas_load): linked directly, it and cuBLASLt
// (hundreds of MB) would load at the start of every kvmill process, GPU or not (0.4 s measured
// here, enough to lose a Ctrl-C that arrives before the orchestrator's handler is set).
// Every CUDA and cuBLAS call is checked; a failure returns KVM_EDEVICE naming the call and the
// device, never aborts. Written without a GPU at hand: compiled for sm_80 and sm_90 here,
// tests/check_cuda_sculpt.c compares it with the CPU backend where a device exists.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "common/kvm_error.h"
#include "kernels/kvm_sculpt_kernels.h"
}
#include "kernels/cuda/kvm_cuda_impl.h"
#include "kernels/kvm_ridge_body.h"
#include "kernels/kvm_sculpt_body.h"

namespace {

enum { ROW_THREADS = 128, MAX_DEVICES = 16 };

// One problem's sizes and offsets into the batch's device arrays.
struct cprob {
    int64_t nq, nc, k;
    int64_t oq;   // row offset in the query arrays (Σ nq)
    int64_t ok;   // entry offset (Σ k)
    int64_t os;   // offset in the nq×k scratch (Σ nq·k)
    int64_t oa;   // offset of A (Σ k²)
    float scale;
    double out_ms;
    int mass_w;
};

}  // namespace


// cuBLAS: the backend's one loader (kvm__cublas_load, kvm__cb in kernels/cuda/kvm_cuda_impl.h)
static int cublas_ready(int dev) { return kvm__cublas_load(dev); }

struct kvm_sculpt_batch {
    int n, d, dev;
    cprob *pr;                           // [n] host
    cudaStream_t st;
    cublasHandle_t h;
    float *q, *of, *orr, *lz, *lr;       // [Σnq][d], [Σnq][d], [Σnq][d], [Σnq], [Σnq]
    int64_t *nvis;                       // [Σnq]
    float *kc, *vc, *beta, *gk, *gb;     // [Σk][d], [Σk][d], [Σk], [Σk][d], [Σk]
    float *S, *R;                        // [Σ nq·k]: scores → exponentials; E·Vcᵀ → ∂score U
    float *oh, *E;                       // [Σnq][d]: Ôc, then the output error
    float *lc, *iz, *oe, *b1, *b2;       // [Σnq] per-query scalars
    double *msr, *lsr, *sums;            // [Σnq] per-query sums, [2n] per-problem totals
    double *P, *T, *A, *B;               // ridge: [Σ nq·k], [Σnq][d], [Σk²], [Σk][d]
    double *a1;                          // [n] per problem 2/(nq·out_ms): the MSE term's scale
    int64_t *rmeta;                      // ridge: [n][3] (A offset, entry offset, k) of a call's problems
    double *rcap;                        // ridge: [n] value-norm caps of a call's problems
    int *rst;                            // ridge: [n] 1 = not positive definite / non-finite
    double *hsums;                       // [2n] host
    int64_t *hmeta;                      // [n][3] host staging of rmeta
    int *hst;                            // [n] host copy of rst
};

#define CU(call)                                                                                              \
    do {                                                                                                      \
        cudaError_t e_ = (call);                                                                              \
        if (e_ != cudaSuccess)                                                                                \
            return kvm_err(KVM_EDEVICE, "cuda:%d: %s failed: %s", dev, #call, cudaGetErrorString(e_));         \
    } while (0)
#define BL(name, call)                                                                                        \
    do {                                                                                                      \
        cublasStatus_t s_ = (call);                                                                           \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                      \
            return kvm_err(KVM_EDEVICE, "cuda:%d: %s failed: %s", dev, name, kvm__cb.status_string(s_));           \
    } while (0)
#define LAUNCHED(what)                                                                                        \
    do {                                                                                                      \
        cudaError_t e_ = cudaGetLastError();                                                                  \
        if (e_ != cudaSuccess)                                                                                \
            return kvm_err(KVM_EDEVICE, "cuda:%d: launch of %s failed: %s", dev, what, cudaGetErrorString(e_)); \
    } while (0)

// ---- row kernels (one block per query row) ----

// Block-wide max / sum over ROW_THREADS threads (fixed tree order).
__device__ float block_max(float v, float *sh)
{
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ float block_sum(float v, float *sh)
{
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// Scores row i of S [rows][k] (a run of problems of nq rows each, scale already applied by the
// GEMM): s += β of the row's problem (beta [problems][k]), then exponentials kvm_sb_expf(s − max)
// in place; lc[i] = max + log Σ, iz[i] = 1/Σ.
__global__ void k_softmax(float *S, const float *beta, int64_t nq, int64_t k, float *lc, float *iz)
{
    __shared__ float sh[ROW_THREADS];
    float *s = S + (int64_t)blockIdx.x * k;
    const float *bt = beta ? beta + ((int64_t)blockIdx.x / nq) * k : NULL;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < k; j += ROW_THREADS) {
        float x = s[j] + (bt ? bt[j] : 0.0f);
        s[j] = x;
        m = fmaxf(m, x);
    }
    m = block_max(m, sh);
    float z = 0;
    for (int64_t j = threadIdx.x; j < k; j += ROW_THREADS) {
        float e = kvm_sb_expf(s[j] - m);
        s[j] = e;
        z += e;
    }
    z = block_sum(z, sh);
    if (threadIdx.x == 0) {
        lc[blockIdx.x] = m + kvm_sb_logf(z);
        iz[blockIdx.x] = 1.0f / z;
    }
}

// One query's output error row and scalars (the CPU's query_row): E = Ô − O with
// Ô = pc·ôc·iz + pr·o_ret, ⟨Ô, E⟩, b1 = a1·pc (a1 of the row's problem: a1 [problems], nq rows
// each), b2 = a2·wz·dl, and its MSE / LSE sums (float64).
__global__ void k_query(const float *oh, const float *of, const float *orr, const float *lz, const float *lr,
                        const int64_t *nvis, const float *lc, const float *iz, int d, int64_t nc, int mass_w,
                        const double *a1, int64_t nq, double a2, float *E, float *oe, float *b1, float *b2,
                        double *msr, double *lsr)
{
    __shared__ float sh[ROW_THREADS];
    __shared__ double shd[ROW_THREADS];
    const int64_t i = blockIdx.x;
    kvm_sb_query s = kvm_sb_query_shares(lc[i], lr[i], 1, nvis[i] > 0, lz[i], nc > 0, mass_w);
    float ohe = 0;
    double ei = 0;
    for (int t = threadIdx.x; t < d; t += ROW_THREADS) {
        float o;
        float e = kvm_sb_out_err(s.pc, oh[i * d + t] * iz[i], s.pr, orr[i * d + t], of[i * d + t], &o);
        E[i * d + t] = e;
        ei += (double)e * e;
        ohe += o * e;
    }
    ohe = block_sum(ohe, sh);
    shd[threadIdx.x] = ei;
    __syncthreads();
    for (int st = ROW_THREADS / 2; st > 0; st >>= 1) {
        if (threadIdx.x < st) shd[threadIdx.x] += shd[threadIdx.x + st];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        oe[i] = ohe;
        b1[i] = (float)(a1[i / nq] * s.pc);
        b2[i] = (float)(a2 * s.wz * s.dl);
        msr[i] = shd[0];
        lsr[i] = s.wz * s.dl * s.dl;
    }
}

// ∂score, elementwise over [nq][k]: U = kvm_sb_dscore(e·iz, r, oe, b1, b2) into R.
__global__ void k_dscore(const float *S, const float *iz, const float *oe, const float *b1, const float *b2,
                         int64_t nq, int64_t k, float *R)
{
    const int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= nq * k) return;
    const int64_t i = x / k;
    R[x] = kvm_sb_dscore(S[x] * iz[i], R[x], oe[i], b1[i], b2[i]);
}

// ∂L/∂β_j = Σ_i U_ij, one thread per entry j of a run's n_ent = problems·k entries (problem
// j / k, U [problems][nq][k]), queries in order.
__global__ void k_colsum(const float *U, int64_t nq, int64_t k, int64_t n_ent, float *gb)
{
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n_ent) return;
    const float *u = U + (j / k) * nq * k + j % k;
    float g = 0;
    for (int64_t i = 0; i < nq; i++) g += u[i * k];
    gb[j] = g;
}

// Totals of the per-query MSE and LSE sums of problem blockIdx.x of a run (one block per
// problem, nq rows each, fixed order) into out[2b], out[2b + 1].
__global__ void k_total(const double *msr, const double *lsr, int64_t nq, double *out)
{
    __shared__ double a[ROW_THREADS], b[ROW_THREADS];
    msr += (int64_t)blockIdx.x * nq;
    lsr += (int64_t)blockIdx.x * nq;
    out += 2 * (int64_t)blockIdx.x;
    double x = 0, y = 0;
    for (int64_t i = threadIdx.x; i < nq; i += ROW_THREADS) {
        x += msr[i];
        y += lsr[i];
    }
    a[threadIdx.x] = x;
    b[threadIdx.x] = y;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            a[threadIdx.x] += a[threadIdx.x + s];
            b[threadIdx.x] += b[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = a[0];
        out[1] = b[0];
    }
}

// Ridge design of one query row (the CPU's kvm_cpu_sculpt_probs and T): P_ij = pc·iz·e_ij
// (float32 product, stored as float64), T_i = o_full,i − pr·o_ret,i (float64).
__global__ void k_design(const float *S, const float *iz, const float *lc, const float *lz, const float *lr,
                         const int64_t *nvis, const float *of, const float *orr, int64_t k, int d, int64_t nc,
                         double *P, double *T)
{
    const int64_t i = blockIdx.x;
    kvm_sb_query s = kvm_sb_query_shares(lc[i], lr[i], 1, nvis[i] > 0, lz[i], nc > 0, 0);
    const float c = s.pc * iz[i];
    for (int64_t j = threadIdx.x; j < k; j += ROW_THREADS) P[i * k + j] = c * S[i * k + j];
    for (int t = threadIdx.x; t < d; t += ROW_THREADS) T[i * d + t] = (double)of[i * d + t] - (double)s.pr * orr[i * d + t];
}

// The value step of one problem per block (kvm_sculpt_backend.ridge): A + αI and B + α·V0, then
// Cholesky–Crout column by column (thread 0 the pivot, the threads the column's rows), the solve
// (threads over B's columns), the finite check and the value-norm guard writing vc (threads over
// rows), all through kernels/kvm_ridge_body.h. meta [3] per block: A offset, entry offset, k.
// status[block] = 1 when A is not positive definite or a value is not finite (vc untouched).
__global__ void k_ridge(double *A, double *B, float *vc, const int64_t *meta, const double *cap, double alpha_rel,
                        int d, int *status)
{
    __shared__ double alpha;
    __shared__ int bad;
    const int64_t k = meta[3 * blockIdx.x + 2];
    double *a = A + meta[3 * blockIdx.x], *x = B + meta[3 * blockIdx.x + 1] * d;
    float *v = vc + meta[3 * blockIdx.x + 1] * d;
    if (threadIdx.x == 0) {
        alpha = kvm_rb_alpha(a, k, alpha_rel);
        bad = 0;
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) a[j * k + j] += alpha;
    for (int64_t e = threadIdx.x; e < k * d; e += blockDim.x) x[e] += alpha * v[e];
    __syncthreads();
    for (int64_t j = 0; j < k; j++) {
        if (threadIdx.x == 0) bad = kvm_rb_chol_pivot(a, k, j);
        __syncthreads();
        if (bad) break; // read by every thread after the barrier: the whole block leaves together
        for (int64_t i = j + 1 + threadIdx.x; i < k; i += blockDim.x) kvm_rb_chol_entry(a, k, j, i);
        __syncthreads();
    }
    if (!bad)
        for (int t = threadIdx.x; t < d; t += blockDim.x) kvm_rb_solve_col(a, k, x, d, t);
    __syncthreads();
    if (!bad)
        for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
            if (!kvm_rb_row_finite(x, d, j)) atomicOr(&bad, 1);
    __syncthreads();
    if (!bad)
        for (int64_t j = threadIdx.x; j < k; j += blockDim.x) kvm_rb_row_cap(x, d, j, cap[blockIdx.x], v);
    if (threadIdx.x == 0) status[blockIdx.x] = bad;
}

// ---- the batch ----

static void free_dev(kvm_sculpt_batch *b)
{
    void *ptrs[] = {b->q, b->of, b->orr, b->lz, b->lr, b->nvis, b->kc, b->vc, b->beta, b->gk, b->gb, b->S, b->R,
                    b->oh, b->E, b->lc, b->iz, b->oe, b->b1, b->b2, b->msr, b->lsr, b->sums, b->P, b->T, b->A, b->B,
                    b->a1, b->rmeta, b->rcap, b->rst};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (ptrs[i]) cudaFree(ptrs[i]);
}

static void cuda_batch_free(kvm_sculpt_batch *b)
{
    if (!b) return;
    cudaSetDevice(b->dev);
    free_dev(b);
    if (b->h) kvm__cb.destroy(b->h);
    if (b->st) cudaStreamDestroy(b->st);
    free(b->pr);
    free(b->hsums);
    free(b->hmeta);
    free(b->hst);
    free(b);
}

// Allocations and uploads of a new batch (b->pr filled); returns 0 or KVM_EDEVICE.
static int batch_fill(kvm_sculpt_batch *b, const kvm_sculpt_view *v)
{
    const int dev = b->dev, d = b->d, n = b->n;
    const cprob &L = b->pr[n - 1];
    const int64_t nq = L.oq + L.nq, nk = L.ok + L.k, ns = L.os + L.nq * L.k, na = L.oa + L.k * L.k;
    CU(cudaSetDevice(dev));
    CU(cudaStreamCreateWithFlags(&b->st, cudaStreamNonBlocking));
    BL("cublasCreate", kvm__cb.create(&b->h));
    BL("cublasSetStream", kvm__cb.set_stream(b->h, b->st));
    BL("cublasSetMathMode", kvm__cb.set_math_mode(b->h, CUBLAS_PEDANTIC_MATH)); // float32 GEMMs in float32 (no TF32): matches the CPU
    const size_t fq = (size_t)(nq * d) * sizeof(float), fk = (size_t)(nk * d) * sizeof(float);
    CU(cudaMalloc(&b->q, fq));
    CU(cudaMalloc(&b->of, fq));
    CU(cudaMalloc(&b->orr, fq));
    CU(cudaMalloc(&b->oh, fq));
    CU(cudaMalloc(&b->E, fq));
    CU(cudaMalloc(&b->lz, (size_t)nq * sizeof(float)));
    CU(cudaMalloc(&b->lr, (size_t)nq * sizeof(float)));
    CU(cudaMalloc(&b->nvis, (size_t)nq * sizeof(int64_t)));
    float **rows[] = {&b->lc, &b->iz, &b->oe, &b->b1, &b->b2};
    for (int r = 0; r < 5; r++) CU(cudaMalloc(rows[r], (size_t)nq * sizeof(float)));
    CU(cudaMalloc(&b->msr, (size_t)nq * sizeof(double)));
    CU(cudaMalloc(&b->lsr, (size_t)nq * sizeof(double)));
    CU(cudaMalloc(&b->sums, (size_t)(2 * n) * sizeof(double)));
    CU(cudaMalloc(&b->kc, fk));
    CU(cudaMalloc(&b->vc, fk));
    CU(cudaMalloc(&b->gk, fk));
    CU(cudaMalloc(&b->beta, (size_t)nk * sizeof(float)));
    CU(cudaMalloc(&b->gb, (size_t)nk * sizeof(float)));
    CU(cudaMemset(b->beta, 0, (size_t)nk * sizeof(float)));
    CU(cudaMalloc(&b->S, (size_t)ns * sizeof(float)));
    CU(cudaMalloc(&b->R, (size_t)ns * sizeof(float)));
    CU(cudaMalloc(&b->P, (size_t)ns * sizeof(double)));
    CU(cudaMalloc(&b->T, (size_t)(nq * d) * sizeof(double)));
    CU(cudaMalloc(&b->A, (size_t)na * sizeof(double)));
    CU(cudaMalloc(&b->B, (size_t)(nk * d) * sizeof(double)));
    CU(cudaMalloc(&b->a1, (size_t)n * sizeof(double)));
    CU(cudaMalloc(&b->rmeta, (size_t)(3 * n) * sizeof(int64_t)));
    CU(cudaMalloc(&b->rcap, (size_t)n * sizeof(double)));
    CU(cudaMalloc(&b->rst, (size_t)n * sizeof(int)));
    for (int i = 0; i < n; i++) b->hsums[i] = 2.0 / ((double)b->pr[i].nq * b->pr[i].out_ms); // staged in hsums [2n]
    CU(cudaMemcpyAsync(b->a1, b->hsums, (size_t)n * sizeof(double), cudaMemcpyHostToDevice, b->st));
    for (int i = 0; i < n; i++) {
        const cprob &p = b->pr[i];
        const size_t rb = (size_t)(p.nq * d) * sizeof(float), sb = (size_t)p.nq * sizeof(float);
        CU(cudaMemcpyAsync(b->q + p.oq * d, v[i].q, rb, cudaMemcpyHostToDevice, b->st));
        CU(cudaMemcpyAsync(b->of + p.oq * d, v[i].o_full, rb, cudaMemcpyHostToDevice, b->st));
        CU(cudaMemcpyAsync(b->orr + p.oq * d, v[i].o_ret, rb, cudaMemcpyHostToDevice, b->st));
        CU(cudaMemcpyAsync(b->lz + p.oq, v[i].lse_zone, sb, cudaMemcpyHostToDevice, b->st));
        CU(cudaMemcpyAsync(b->lr + p.oq, v[i].lse_ret, sb, cudaMemcpyHostToDevice, b->st));
        CU(cudaMemcpyAsync(b->nvis + p.oq, v[i].n_vis, (size_t)p.nq * sizeof(int64_t), cudaMemcpyHostToDevice, b->st));
    }
    CU(cudaStreamSynchronize(b->st)); // the caller's host arrays may go once batch_new returns
    return 0;
}

static int cuda_batch_new(const kvm_sculpt_backend *be, const kvm_sculpt_view *views, const int64_t *k, int n,
                          int threads, kvm_sculpt_batch **out)
{
    (void)threads;
    *out = NULL;
    const int dev = be->device;
    if (n < 1) return kvm_err(KVM_EINVAL, "sculpt batch (cuda:%d): %d problems", dev, n);
    const int d = views[0].d;
    for (int i = 0; i < n; i++) {
        if (views[i].d != d || d < 1 || d > 512)
            return kvm_err(KVM_EINVAL, "sculpt batch: problem %d has head dim %d (problem 0: %d; at most 512)", i,
                           views[i].d, d);
        if (k[i] < 1) return kvm_err(KVM_EINVAL, "sculpt batch: problem %d has k = %lld (needs ≥ 1)", i, (long long)k[i]);
    }
    kvm_sculpt_batch *b = (kvm_sculpt_batch *)calloc(1, sizeof *b);
    if (!b) return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
    b->n = n;
    b->d = d;
    b->dev = dev;
    b->pr = (cprob *)malloc((size_t)n * sizeof *b->pr);
    b->hsums = (double *)malloc((size_t)(2 * n) * sizeof(double));
    b->hmeta = (int64_t *)malloc((size_t)(3 * n) * sizeof(int64_t));
    b->hst = (int *)malloc((size_t)n * sizeof(int));
    if (!b->pr || !b->hsums || !b->hmeta || !b->hst) {
        cuda_batch_free(b);
        return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
    }
    int64_t oq = 0, ok = 0, os = 0, oa = 0;
    for (int i = 0; i < n; i++) {
        b->pr[i] = cprob{views[i].nq, views[i].nc, k[i], oq, ok, os, oa, views[i].scale, views[i].out_ms,
                         views[i].lse_mass_weight};
        oq += views[i].nq;
        ok += k[i];
        os += views[i].nq * k[i];
        oa += k[i] * k[i];
    }
    int rc = batch_fill(b, views);
    if (rc) {
        cuda_batch_free(b);
        return rc;
    }
    *out = b;
    return 0;
}

static int check_idx(const kvm_sculpt_batch *b, const int *idx, int n_idx)
{
    for (int t = 0; t < n_idx; t++)
        if (idx[t] < 0 || idx[t] >= b->n)
            return kvm_err(KVM_EINVAL, "sculpt batch: problem index %d not in [0, %d)", idx[t], b->n);
    return 0;
}

static int cuda_upload(kvm_sculpt_batch *b, const int *idx, int n_idx, const float *kc, const float *vc,
                       const float *beta)
{
    const int dev = b->dev, d = b->d;
    int rc = check_idx(b, idx, n_idx);
    if (rc) return rc;
    CU(cudaSetDevice(dev));
    for (int t = 0; t < n_idx; t++) {
        const cprob &p = b->pr[idx[t]];
        const size_t kb = (size_t)(p.k * d) * sizeof(float);
        if (kc) CU(cudaMemcpyAsync(b->kc + p.ok * d, kc + p.ok * d, kb, cudaMemcpyHostToDevice, b->st));
        if (vc) CU(cudaMemcpyAsync(b->vc + p.ok * d, vc + p.ok * d, kb, cudaMemcpyHostToDevice, b->st));
        if (beta) CU(cudaMemcpyAsync(b->beta + p.ok, beta + p.ok, (size_t)p.k * sizeof(float), cudaMemcpyHostToDevice, b->st));
    }
    CU(cudaStreamSynchronize(b->st)); // host arrays are the caller's again on return
    return 0;
}

static int cuda_download_grads(kvm_sculpt_batch *b, const int *idx, int n_idx, float *gk, float *gb)
{
    const int dev = b->dev, d = b->d;
    int rc = check_idx(b, idx, n_idx);
    if (rc) return rc;
    CU(cudaSetDevice(dev));
    for (int t = 0; t < n_idx; t++) {
        const cprob &p = b->pr[idx[t]];
        if (gk) CU(cudaMemcpyAsync(gk + p.ok * d, b->gk + p.ok * d, (size_t)(p.k * d) * sizeof(float), cudaMemcpyDeviceToHost, b->st));
        if (gb) CU(cudaMemcpyAsync(gb + p.ok, b->gb + p.ok, (size_t)p.k * sizeof(float), cudaMemcpyDeviceToHost, b->st));
    }
    CU(cudaStreamSynchronize(b->st));
    return 0;
}

// The run of problems starting at idx[t]: how many follow it in the batch's order with its
// shape (one strided-batched GEMM covers them: equal strides in the packed layout).
static int run_len(const kvm_sculpt_batch *b, const int *idx, int n_idx, int t)
{
    const cprob &p = b->pr[idx[t]];
    int g = 1;
    for (; t + g < n_idx && idx[t + g] == idx[t] + g; g++) {
        const cprob &q = b->pr[idx[t + g]];
        if (q.nq != p.nq || q.k != p.k || q.nc != p.nc || q.scale != p.scale || q.mass_w != p.mass_w) break;
    }
    return g;
}

// Scores and softmax of the run of g problems from p at their current keys (β when use_beta):
// S, lc, iz.
static int scores(kvm_sculpt_batch *b, const cprob &p, int g, int use_beta)
{
    const int dev = b->dev, d = b->d;
    const float zero = 0, sc = p.scale;
    // S [nq][k] = scale·Q·Kcᵀ per problem: column-major Sᵀ = Kc·Qᵀ (LAYOUT.md's X·Wᵀ rule)
    BL("cublasSgemmStridedBatched",
       kvm__cb.sgemm_sb(b->h, CUBLAS_OP_T, CUBLAS_OP_N, (int)p.k, (int)p.nq, d, &sc, b->kc + p.ok * d, d, p.k * d,
                        b->q + p.oq * d, d, p.nq * d, &zero, b->S + p.os, (int)p.k, p.nq * p.k, g));
    k_softmax<<<(unsigned)(g * p.nq), ROW_THREADS, 0, b->st>>>(b->S + p.os, use_beta ? b->beta + p.ok : NULL, p.nq,
                                                               p.k, b->lc + p.oq, b->iz + p.oq);
    LAUNCHED("k_softmax");
    return 0;
}

// Loss (and gradients) of the run of g problems from problem i; their totals into b->sums[2i..].
static int lossgrad_run(kvm_sculpt_batch *b, int i, int g, double lambda, int use_beta, int want_gk, int want_gb)
{
    const int dev = b->dev, d = b->d;
    const cprob &p = b->pr[i];
    const float one = 1, zero = 0, sc = p.scale;
    int rc = scores(b, p, g, use_beta);
    if (rc) return rc;
    const int64_t o = p.oq, rows = g * p.nq, sq = p.nq * d, sk = p.k * d, ss = p.nq * p.k;
    float *S = b->S + p.os, *R = b->R + p.os, *oh = b->oh + o * d, *E = b->E + o * d;
    const float *vc = b->vc + p.ok * d;
    // Ôc [nq][d] = Eexp·Vc (unnormalised; the row kernel applies iz): column-major Ôcᵀ = Vcᵀ·Eexpᵀ
    BL("cublasSgemmStridedBatched", kvm__cb.sgemm_sb(b->h, CUBLAS_OP_N, CUBLAS_OP_N, d, (int)p.nq, (int)p.k, &one, vc, d,
                                                     sk, S, (int)p.k, ss, &zero, oh, d, sq, g));
    const double a2 = 2.0 * lambda / (double)p.nq;
    k_query<<<(unsigned)rows, ROW_THREADS, 0, b->st>>>(oh, b->of + o * d, b->orr + o * d, b->lz + o, b->lr + o,
                                                       b->nvis + o, b->lc + o, b->iz + o, d, p.nc, p.mass_w, b->a1 + i,
                                                       p.nq, a2, E, b->oe + o, b->b1 + o, b->b2 + o, b->msr + o,
                                                       b->lsr + o);
    LAUNCHED("k_query");
    k_total<<<(unsigned)g, ROW_THREADS, 0, b->st>>>(b->msr + o, b->lsr + o, p.nq, b->sums + 2 * i);
    LAUNCHED("k_total");
    if (!want_gk && !want_gb) return 0;
    // R [nq][k] = E·Vcᵀ: column-major Rᵀ = Vc·Eᵀ
    BL("cublasSgemmStridedBatched", kvm__cb.sgemm_sb(b->h, CUBLAS_OP_T, CUBLAS_OP_N, (int)p.k, (int)p.nq, d, &one, vc, d,
                                                     sk, E, d, sq, &zero, R, (int)p.k, ss, g));
    const int64_t ne = rows * p.k;
    k_dscore<<<(unsigned)((ne + 255) / 256), 256, 0, b->st>>>(S, b->iz + o, b->oe + o, b->b1 + o, b->b2 + o, rows,
                                                              p.k, R);
    LAUNCHED("k_dscore");
    if (want_gb) {
        const int64_t nent = g * p.k;
        k_colsum<<<(unsigned)((nent + 127) / 128), 128, 0, b->st>>>(R, p.nq, p.k, nent, b->gb + p.ok);
        LAUNCHED("k_colsum");
    }
    // G [k][d] = scale·Uᵀ·Q: column-major Gᵀ (d×k) = Qᵀ(d×nq)·U(nq×k) read as Q (ld d) · Uᵀ (ld k)
    if (want_gk)
        BL("cublasSgemmStridedBatched",
           kvm__cb.sgemm_sb(b->h, CUBLAS_OP_N, CUBLAS_OP_T, d, (int)p.k, (int)p.nq, &sc, b->q + o * d, d, sq, R,
                            (int)p.k, ss, &zero, b->gk + p.ok * d, d, sk, g));
    return 0;
}

static int cuda_lossgrad(kvm_sculpt_batch *b, const int *idx, int n_idx, double lambda, int use_beta, int want_gk,
                         int want_gb, kvm_sculpt_eval *evals)
{
    const int dev = b->dev;
    int rc = check_idx(b, idx, n_idx);
    if (rc) return rc;
    CU(cudaSetDevice(dev));
    for (int t = 0, g; t < n_idx; t += g) {
        g = run_len(b, idx, n_idx, t);
        if ((rc = lossgrad_run(b, idx[t], g, lambda, use_beta, want_gk, want_gb))) return rc;
    }
    CU(cudaMemcpyAsync(b->hsums, b->sums, (size_t)(2 * b->n) * sizeof(double), cudaMemcpyDeviceToHost, b->st));
    CU(cudaStreamSynchronize(b->st));
    for (int t = 0; t < n_idx; t++) {
        const cprob &p = b->pr[idx[t]];
        const double ms = b->hsums[2 * idx[t]], ls = b->hsums[2 * idx[t] + 1];
        evals[t].mse_sum = ms;
        evals[t].lse_sum = ls;
        evals[t].loss = ms / ((double)p.nq * p.out_ms) + lambda * ls / (double)p.nq;
    }
    return 0;
}

// Normal equations of the run of g problems from p into b->A, b->B (device).
static int normal_run(kvm_sculpt_batch *b, const cprob &p, int g, int use_beta)
{
    const int dev = b->dev, d = b->d;
    const double one = 1, zero = 0;
    int rc = scores(b, p, g, use_beta);
    if (rc) return rc;
    const int64_t o = p.oq, ss = p.nq * p.k, sq = p.nq * d;
    double *P = b->P + p.os, *T = b->T + o * d;
    k_design<<<(unsigned)(g * p.nq), ROW_THREADS, 0, b->st>>>(b->S + p.os, b->iz + o, b->lc + o, b->lz + o, b->lr + o,
                                                              b->nvis + o, b->of + o * d, b->orr + o * d, p.k, d, p.nc,
                                                              P, T);
    LAUNCHED("k_design");
    // A [k][k] = PᵀP (symmetric: both layouts agree); B [k][d] = PᵀT: column-major Bᵀ = Tᵀ·P
    BL("cublasDgemmStridedBatched", kvm__cb.dgemm_sb(b->h, CUBLAS_OP_N, CUBLAS_OP_T, (int)p.k, (int)p.k, (int)p.nq, &one,
                                                     P, (int)p.k, ss, P, (int)p.k, ss, &zero, b->A + p.oa, (int)p.k,
                                                     p.k * p.k, g));
    BL("cublasDgemmStridedBatched", kvm__cb.dgemm_sb(b->h, CUBLAS_OP_N, CUBLAS_OP_T, d, (int)p.k, (int)p.nq, &one, T, d,
                                                     sq, P, (int)p.k, ss, &zero, b->B + p.ok * d, d, p.k * d, g));
    return 0;
}

static int cuda_normal(kvm_sculpt_batch *b, const int *idx, int n_idx, int use_beta, double *A, double *B)
{
    const int dev = b->dev, d = b->d;
    int rc = check_idx(b, idx, n_idx);
    if (rc) return rc;
    CU(cudaSetDevice(dev));
    for (int t = 0, g; t < n_idx; t += g) {
        g = run_len(b, idx, n_idx, t);
        const cprob &p = b->pr[idx[t]];
        if ((rc = normal_run(b, p, g, use_beta))) return rc;
        // the run's A and B are contiguous in the packed layout: one copy each
        CU(cudaMemcpyAsync(A + p.oa, b->A + p.oa, (size_t)(g * p.k * p.k) * sizeof(double), cudaMemcpyDeviceToHost,
                           b->st));
        CU(cudaMemcpyAsync(B + p.ok * d, b->B + p.ok * d, (size_t)(g * p.k * d) * sizeof(double),
                           cudaMemcpyDeviceToHost, b->st));
    }
    CU(cudaStreamSynchronize(b->st));
    return 0;
}

static int cuda_ridge(kvm_sculpt_batch *b, const int *idx, int n_idx, int use_beta, double alpha_rel,
                      const double *cap, float *vc, int *rcs)
{
    const int dev = b->dev, d = b->d;
    int rc = check_idx(b, idx, n_idx);
    if (rc || n_idx == 0) return rc;
    CU(cudaSetDevice(dev));
    for (int t = 0, g; t < n_idx; t += g) {
        g = run_len(b, idx, n_idx, t);
        if ((rc = normal_run(b, b->pr[idx[t]], g, use_beta))) return rc;
    }
    for (int t = 0; t < n_idx; t++) {
        const cprob &p = b->pr[idx[t]];
        b->hmeta[3 * t] = p.oa, b->hmeta[3 * t + 1] = p.ok, b->hmeta[3 * t + 2] = p.k;
    }
    CU(cudaMemcpyAsync(b->rmeta, b->hmeta, (size_t)(3 * n_idx) * sizeof(int64_t), cudaMemcpyHostToDevice, b->st));
    CU(cudaMemcpyAsync(b->rcap, cap, (size_t)n_idx * sizeof(double), cudaMemcpyHostToDevice, b->st));
    k_ridge<<<(unsigned)n_idx, ROW_THREADS, 0, b->st>>>(b->A, b->B, b->vc, b->rmeta, b->rcap, alpha_rel, d, b->rst);
    LAUNCHED("k_ridge");
    CU(cudaMemcpyAsync(b->hst, b->rst, (size_t)n_idx * sizeof(int), cudaMemcpyDeviceToHost, b->st));
    CU(cudaStreamSynchronize(b->st));
    int n_bad = 0;
    for (int t = 0; t < n_idx; t++) {
        const cprob &p = b->pr[idx[t]];
        rcs[t] = b->hst[t] ? KVM_ERANGE : 0;
        n_bad += b->hst[t] != 0;
        if (!b->hst[t])
            CU(cudaMemcpyAsync(vc + p.ok * d, b->vc + p.ok * d, (size_t)(p.k * d) * sizeof(float),
                               cudaMemcpyDeviceToHost, b->st));
    }
    CU(cudaStreamSynchronize(b->st));
    if (n_bad)
        kvm_err(KVM_ERANGE, "sculpt ridge (cuda:%d): %d problem(s) with a normal matrix not positive definite or a "
                            "non-finite value", dev, n_bad);
    return 0;
}

static kvm_sculpt_backend tables[MAX_DEVICES];
static char names[MAX_DEVICES][16];

extern "C" const kvm_sculpt_backend *kvm_sculpt_backend_cuda(int device)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) n = 0;
    if (device < 0 || device >= n || device >= MAX_DEVICES) {
        kvm_err(KVM_EDEVICE, "cuda:%d requested but %d CUDA device(s) are visible%s%s", device, n,
                e != cudaSuccess ? ": " : "", e != cudaSuccess ? cudaGetErrorString(e) : "");
        return NULL;
    }
    if (cublas_ready(device)) return NULL;
    kvm_sculpt_backend *t = &tables[device];
    snprintf(names[device], sizeof names[device], "cuda:%d", device);
    t->name = names[device];
    t->device = device;
    t->batch_new = cuda_batch_new;
    t->batch_free = cuda_batch_free;
    t->upload = cuda_upload;
    t->lossgrad = cuda_lossgrad;
    t->download_grads = cuda_download_grads;
    t->normal = cuda_normal;
    t->ridge = cuda_ridge;
    return t;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// Device memory, handle and events of the ceiling run, freed on every path.
struct ceiling_run {
    float *a = nullptr, *c = nullptr;
    cublasHandle_t h = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    ~ceiling_run()
    {
        if (a) cudaFree(a);
        if (c) cudaFree(c);
        if (h) kvm__cb.destroy(h);
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
    }
};

static int ceiling(int dev, int n, int reps, double *tflops)
{
    ceiling_run r;
    double ms[64];
    if (reps > 64) reps = 64;
    CU(cudaSetDevice(dev));
    CU(cudaMalloc(&r.a, (size_t)n * n * sizeof(float)));
    CU(cudaMalloc(&r.c, (size_t)n * n * sizeof(float)));
    CU(cudaMemset(r.a, 0, (size_t)n * n * sizeof(float)));
    BL("cublasCreate", kvm__cb.create(&r.h));
    BL("cublasSetMathMode", kvm__cb.set_math_mode(r.h, CUBLAS_PEDANTIC_MATH));
    CU(cudaEventCreate(&r.e0));
    CU(cudaEventCreate(&r.e1));
    const float one = 1, zero = 0;
    BL("cublasSgemm", kvm__cb.sgemm(r.h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, r.a, n, r.a, n, &zero, r.c, n)); // warm-up
    for (int i = 0; i < reps; i++) {
        CU(cudaEventRecord(r.e0));
        BL("cublasSgemm", kvm__cb.sgemm(r.h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, r.a, n, r.a, n, &zero, r.c, n));
        CU(cudaEventRecord(r.e1));
        CU(cudaEventSynchronize(r.e1));
        float t;
        CU(cudaEventElapsedTime(&t, r.e0, r.e1));
        ms[i] = t;
    }
    qsort(ms, (size_t)reps, sizeof ms[0], cmp_double);
    *tflops = 2.0 * n * (double)n * n / (ms[reps / 2] * 1e-3) / 1e12;
    return 0;
}

extern "C" int kvm_cuda_sgemm_ceiling(int device, int n, int reps, double *tflops)
{
    *tflops = 0;
    if (n < 1 || reps < 1) return kvm_err(KVM_EINVAL, "sgemm ceiling: n = %d, reps = %d", n, reps);
    int rc = cublas_ready(device);
    return rc ? rc : ceiling(device, n, reps, tflops);
}
