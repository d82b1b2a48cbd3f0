/* kvm_sculpt_kernels.h: the KVSculpt solver's numerics behind the backend interface (issue
 * 12): loss and analytic gradient (arXiv 2603.27819 §3, logit biases per Attention Matching
 * arXiv 2602.16284) of one problem as query-blocked GEMMs with fused row kernels between them
 * (the bodies in kernels/kvm_sculpt_body.h). What is minimised, rounds, allocation and the
 * cache format stay in compress/sculpt/. */
#ifndef KVM_SCULPT_KERNELS_H
#define KVM_SCULPT_KERNELS_H

#include <stdint.h>

/* One (layer, KV head) problem as flat float32 arrays (borrowed; host memory for the CPU
 * backend). Shapes: q, o_full, o_ret [nq][d] row-major; lse_zone, lse_ret [nq] (nats,
 * KVM_SB_NO_LSE for an empty set); n_vis [nq] = retain entries query i sees (0: none). */
typedef struct kvm_sculpt_view {
    int d;               /* head dim (≤ 512) */
    float scale;         /* score scale 1/sqrt(d) */
    int64_t nq;          /* training queries */
    int64_t nc;          /* compress-zone tokens (0: no LSE term) */
    const float *q, *o_full, *o_ret, *lse_zone, *lse_ret;
    const int64_t *n_vis;
    double out_ms;       /* MSE normaliser: mean ‖o_full‖² */
    int lse_mass_weight; /* 1: LSE error weighted by σ(lse_zone − lse_ret) */
    const float *qt;     /* Qᵀ [d][nq] (the key gradient's left operand), or NULL: the CPU kernel
                            transposes q per call (the CPU batch builds it once per problem) */
    int ridge_f32;       /* CPU normal equations: 1 float32 GEMM blocks summed in float64, 0 float64
                            (kvm_cpu_sculpt_normal); other backends ignore it */
} kvm_sculpt_view;

/* The result of one evaluation. */
typedef struct kvm_sculpt_eval {
    double loss;     /* L = mse_sum/(nq·out_ms) + λ·lse_sum/nq */
    double mse_sum;  /* Σ_i ‖Ô_i − O_i‖² */
    double lse_sum;  /* Σ_i wz_i (LSE_c,i − LSE_zone,i)² */
} kvm_sculpt_eval;

/* CPU backend, one problem, k ≥ 1 distilled entries kc, vc [k][d], beta [k] (NULL = 0):
 * scores S = scale·Q·Kcᵀ + β, softmax rows, Ôc = W·Vc, output error rows, E·Vcᵀ, ∂score rows,
 * gradient Gᵀ = Qᵀ·U, in blocks of 64 queries (kvmill's own packed GEMM, kvm_cpu_gemm.h; at head
 * dim 8 inlined fixed-size tiles on blocks of 32 queries, Gᵀ summed block by block).
 * grad_k [k][d] and grad_b [k] may be NULL (then only the loss is computed). Single-threaded
 * and deterministic: the result depends on nothing but the arguments. Returns 0, KVM_EINVAL
 * (k < 1 or d > 512), KVM_ENOMEM. */
int kvm_cpu_sculpt_lossgrad(const kvm_sculpt_view *p, const float *kc, const float *vc, const float *beta, int64_t k,
                            double lambda, float *grad_k, float *grad_b, kvm_sculpt_eval *out);

/* Buffers of the CPU loss kernel kept between evaluations (packed entries, score and ∂score
 * tiles, U): one per thread that evaluates, owned by the caller (kvm_cpu_sculpt_scratch_new,
 * NULL with KVM_ENOMEM set; kvm_cpu_sculpt_scratch_free, NULL accepted). They grow to the
 * largest problem seen and are not shared between threads. */
typedef struct kvm_cpu_sculpt_scratch kvm_cpu_sculpt_scratch;
kvm_cpu_sculpt_scratch *kvm_cpu_sculpt_scratch_new(void);
void kvm_cpu_sculpt_scratch_free(kvm_cpu_sculpt_scratch *ws);

/* kvm_cpu_sculpt_lossgrad working in ws (NULL: allocate for this call alone); the result is
 * bit-identical either way. */
int kvm_cpu_sculpt_lossgrad_ws(kvm_cpu_sculpt_scratch *ws, const kvm_sculpt_view *p, const float *kc, const float *vc,
                               const float *beta, int64_t k, double lambda, float *grad_k, float *grad_b,
                               kvm_sculpt_eval *out);

/* CPU backend, the ridge design (KVSculpt §3 value step): P [nq][k] (row-major, float32),
 * P_ij = the probability query i puts on distilled entry j under the softmax over the k
 * entries (scores scale·q·kc + β, beta NULL = 0) and its visible retain entries, and pr [nq]
 * (float64) the retain share; the same blocked GEMM and row bodies as the loss. Returns 0,
 * KVM_EINVAL (k < 1 or d > 512), KVM_ENOMEM. */
int kvm_cpu_sculpt_probs(const kvm_sculpt_view *p, const float *kc, const float *beta, int64_t k, float *P,
                         double *pr);

/* The full-cache references of one problem (KVSculpt §3 targets), CPU backend: for queries q
 * [nq][d] (scale), zone keys/values kz, vz [nc][d] and retain kr, vr [m][d] of which query i
 * sees the first n_vis[i]: attention outputs o_full [nq][d] (over zone + visible retain) and
 * o_ret [nq][d] (visible retain only, 0 when none), LSEs lse_zone, lse_ret [nq] (nats,
 * KVM_SB_NO_LSE when empty), Σ_i ‖o_full,i‖² into *out_sq, and mass [nc] += the full-softmax
 * probability of each zone token summed over queries [0, n_mass). Scores and products are
 * blocked float32 GEMMs, sums per row in float64. Returns 0 or KVM_ENOMEM. */
typedef struct kvm_sculpt_refs_in {
    int d;
    float scale;
    int64_t nq, nc, m, n_mass;
    const float *q, *kz, *vz, *kr, *vr;
    const int64_t *n_vis;
} kvm_sculpt_refs_in;

int kvm_cpu_sculpt_refs(const kvm_sculpt_refs_in *in, float *o_full, float *o_ret, float *lse_zone, float *lse_ret,
                        double *mass, double *out_sq);

/* Host float64 vector operations of the L-BFGS two-loop recursion (Nocedal & Wright, Numerical
 * Optimization, Alg. 7.4; compress/sculpt/sculpt_lbfgs.c) over arrays of n ≥ 0 doubles (borrowed;
 * y is updated in place and must not overlap x; no errors):
 * kvm_cpu_ddot = Σ_i a_i·b_i as 32 interleaved partial sums (i mod 32) added in a fixed tree,
 * then the tail (i ≥ 32·⌊n/32⌋) in order; kvm_cpu_daxpy: y_i += a·x_i. Deterministic on a given
 * machine (the AVX-512/AVX2 clones fuse the multiply-add, the baseline one does not). */
double kvm_cpu_ddot(const double *a, const double *b, int64_t n);
void kvm_cpu_daxpy(double *y, double a, const double *x, int64_t n);

/* CPU backend, the ridge solve (KVSculpt §3 value step, float64): A [k][k] row-major holding
 * the symmetric positive definite matrix in its upper triangle (the lower one is not read) is
 * factored in place as A = UᵀU (U upper, in the upper triangle: LAPACK dpotrf's row-major 'U'
 * result, so U[j][j]² is pivot j), and B [k][d] row-major is overwritten by A⁻¹B. Blocked
 * right-looking, sums in a fixed order (deterministic; within rounding of LAPACKE_dposv, not bit
 * for bit). Returns 0, or j + 1 when pivot j is not positive and finite (A not positive definite;
 * A partly factored, B untouched). */
int64_t kvm_cpu_dposv_upper(int64_t k, int d, double *A, double *B);

/* CPU backend, the ridge normal equations of one problem (KVSculpt §3 value step): with P, pr
 * from kvm_cpu_sculpt_probs and T_i = o_full,i − pr_i·o_ret,i, A = PᵀP [k][k] (float64, upper
 * triangle written, row-major) and B = PᵀT [k][d] (float64). p->ridge_f32 = 0: by OpenBLAS
 * dsyrk/dgemm in float64 (call with OpenBLAS at one thread for reproducible sums); 1: by
 * kvmill's float32 GEMM over blocks of 128 queries (T rounded to float32), the blocks' products
 * added in float64 in query order (entries within ≈ 1e-6 relative of float64; the caller checks
 * the conditioning: compress/sculpt's kvm_sculpt_ridge_solve_f32). Deterministic either way.
 * Returns 0, KVM_EINVAL, KVM_ENOMEM. */
int kvm_cpu_sculpt_normal(const kvm_sculpt_view *p, const float *kc, const float *beta, int64_t k, double *A,
                          double *B);

/* ---- The batched solver's backend interface (issue 12: all problems of a document as one batch) ----
 *
 * A batch holds n problems in one backend's memory, problem-major: problem i owns k_i ≥ 1
 * distilled entries at entry offset off_i = Σ_{j<i} k_j of the packed arrays kc, vc [Σk][d],
 * beta [Σk] and gradients gk [Σk][d], gb [Σk] (float32); ridge outputs are packed at matrix
 * offsets Σ_{j<i} k_j² (A) and Σ_{j<i} k_j·d (B). Problems may differ in nq and k (ragged: the
 * CPU backend runs one task per problem, so no padding across problems is needed); all share d.
 * Host arrays passed to upload / download are in the same packed layout over the whole batch;
 * a call on a subset idx[n_idx] (indices into the batch, any order, no repeats) reads or writes
 * only those problems' slices. A problem's result depends on its own data only (no reduction
 * across problems, fixed order inside one), so it is bit-identical whatever the subset, the
 * batch or the thread count (the CUDA backend: see kvm_sculpt_backend_cuda). Every function
 * returns 0 or a kvm_status with a message (CUDA: the
 * failing call and device), never aborts; on error the outputs of that call are undefined. */
typedef struct kvm_sculpt_batch kvm_sculpt_batch;

typedef struct kvm_sculpt_backend {
    const char *name; /* "cpu", "cuda:N" */
    int device;       /* the CUDA device (−1 for the CPU) */
    /* Makes a batch of n ≥ 1 problems views[n] (all with the same d ≤ 512) with k[n] ≥ 1 entries
     * each. The problems' arrays are uploaded into backend memory (the CPU backend's memory is
     * the host's: it keeps the caller's arrays, which must outlive the batch). threads: CPU
     * worker threads for this batch's calls (≥ 1; the thread pool, kvm_cpu_pool.h), ignored by
     * other backends. be: the table itself (its device). Errors: KVM_EINVAL (n < 1, k < 1, d out
     * of range or not shared), KVM_ENOMEM, KVM_EDEVICE (a CUDA call failed: named). */
    int (*batch_new)(const struct kvm_sculpt_backend *be, const kvm_sculpt_view *views, const int64_t *k, int n, int threads, kvm_sculpt_batch **out);
    void (*batch_free)(kvm_sculpt_batch *b); /* accepts NULL */
    /* Host → backend: the entries of problems idx from host kc, vc [Σk][d], beta [Σk] (each may
     * be NULL: that array is left as it is; beta starts at 0, kc and vc undefined). */
    int (*upload)(kvm_sculpt_batch *b, const int *idx, int n_idx, const float *kc, const float *vc,
                  const float *beta);
    /* Loss (kvm_sculpt_eval into host evals[n_idx], in the order of idx) of problems idx at their
     * current entries (kvm_cpu_sculpt_lossgrad per problem: β used when use_beta), with
     * ∂L/∂kc when want_gk and ∂L/∂β when want_gb kept in backend memory. */
    int (*lossgrad)(kvm_sculpt_batch *b, const int *idx, int n_idx, double lambda, int use_beta, int want_gk,
                    int want_gb, kvm_sculpt_eval *evals);
    /* Backend → host: the gradients of the last lossgrad of problems idx into gk [Σk][d] and gb
     * [Σk] (either may be NULL). */
    int (*download_grads)(kvm_sculpt_batch *b, const int *idx, int n_idx, float *gk, float *gb);
    /* Ridge normal equations (kvm_cpu_sculpt_normal) of problems idx at their current keys (β
     * when use_beta) into host A, B (float64, packed as above). */
    int (*normal)(kvm_sculpt_batch *b, const int *idx, int n_idx, int use_beta, double *A, double *B);
    /* Optional (NULL: the caller solves normal's A, B on the host): the whole value step of
     * problems idx on the backend (KVSculpt §3): the normal equations as `normal`, then A + αI,
     * B + α·V0 with α = alpha_rel·mean diag A, a batched Cholesky and solve, and the value-norm
     * guard |v_j| ≤ cap[t] (cap [n_idx] in idx order, INFINITY = off), as compress/sculpt's
     * kvm_sculpt_ridge_solve does with LAPACKE, through kernels/kvm_ridge_body.h. The new values
     * stay in backend memory and go to host vc [Σk][d] (packed; only those problems' slices).
     * rcs[t] = 0, or KVM_ERANGE (not positive definite, or a non-finite value: that problem's
     * values are left as they were, in both memories). Returns 0 or a failure of the call. */
    int (*ridge)(kvm_sculpt_batch *b, const int *idx, int n_idx, int use_beta, double alpha_rel, const double *cap,
                 float *vc, int *rcs);
} kvm_sculpt_backend;

/* The CPU backend: problems of a call run as tasks of the CPU thread pool (one problem per task,
 * claimed in idx order), each single-threaded through the kernels above. */
const kvm_sculpt_backend *kvm_sculpt_backend_cpu(void);

/* The CUDA backend on device `device` (kernels/cuda/kvm_cuda_sculpt.cu): problems problem-major
 * in device memory, strided-batched cuBLAS GEMMs over runs of equal-shaped problems (ragged k:
 * shorter runs) with row kernels that run the bodies of kernels/kvm_sculpt_body.h, and the value
 * step (`ridge`) by a batched Cholesky on kernels/kvm_ridge_body.h; sums reduced in a fixed
 * order. Deterministic for a given device and call sequence, but not bit-identical across
 * subsets as the CPU backend is: cuBLAS may choose its kernel by batch count. NULL with
 * KVM_EDEVICE (no such device) or KVM_ENOTSUP (a build without CUDA), the message saying which. */
const kvm_sculpt_backend *kvm_sculpt_backend_cuda(int device);

/* The cuBLAS float32 GEMM ceiling of CUDA device `device` (benchmarks, bench/bench_solver.c):
 * the median over reps of n×n×n cublasSgemm (pedantic float32 math, no TF32) in TFLOP/s into
 * *tflops. Returns 0, KVM_EDEVICE (the failing call named), KVM_ENOTSUP (no CUDA build). */
int kvm_cuda_sgemm_ceiling(int device, int n, int reps, double *tflops);

#endif
