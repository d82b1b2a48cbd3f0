/* kvm_sculpt_problem.h: one KVSculpt problem — a single (layer, KV head) — and the pieces that
 * solve it: training queries with full-cache references, the loss and its analytic gradient,
 * the ridge value fit, selection, and the per-head solver. Flat float32 arrays, one problem per
 * struct, so a batched GPU solver can stack them. Used by kvm_sculpt_compress and the tests. */
#ifndef KVM_SCULPT_PROBLEM_H
#define KVM_SCULPT_PROBLEM_H

#include "compress/sculpt/kvm_sculpt.h"

#include <stdint.h>

struct kvm_sculpt_backend;
struct kvm_progress; /* common/kvm_progress.h */

/* A problem: zone/retain tensors are borrowed (valid while the source capture lives), the
 * query and reference arrays are owned (kvm_sculpt_problem_free). */
typedef struct kvm_sculpt_problem {
    int d;               /* head_dim */
    float scale;         /* score scale 1/sqrt(d) */
    int64_t nc;          /* compress-zone tokens (N−m) */
    const float *kz;     /* [nc][d] post-RoPE zone keys (borrowed) */
    const float *vz;     /* [nc][d] zone values (borrowed) */
    int64_t m;           /* retain-zone tokens */
    const float *kr;     /* [m][d] retain keys (borrowed) */
    const float *vr;     /* [m][d] retain values (borrowed) */
    int64_t nq;          /* training queries */
    int64_t nq_real;     /* the first nq_real are real retain-zone queries */
    int64_t nq_model;    /* the next nq_model are model queries (query_source repeat/continuation) */
    float *q;            /* [nq][d] post-RoPE training queries (owned) */
    int64_t *n_vis;      /* [nq] retain entries visible to query i (causal prefix) (owned) */
    float *o_full;       /* [nq][d] attention output over the full cache (owned) */
    float *o_ret;        /* [nq][d] attention output over the visible retain entries (owned) */
    float *lse_zone;     /* [nq] log Σ_zone exp(score) (nats) (owned) */
    float *lse_ret;      /* [nq] log Σ_visible retain exp(score), −1e30 when none (owned) */
    float *mass;         /* [nc] full-softmax mass each zone token gets from the real queries
                            (retain zone and model queries; from all queries when there are none)
                            (owned) */
    double out_ms;       /* mean over queries of ‖o_full‖², the MSE normaliser */
    float vnorm_max;     /* max ‖v‖ over the zone (value-norm guard reference) */
    float knorm_max;     /* max ‖k‖ over the zone (key-norm guard reference) */
    int lse_mass_weight; /* 1: each query's LSE error is weighted by the zone's share of its full
                            attention, σ(LSE_zone − LSE_ret) (ours; 0 = the paper's plain mean) */
} kvm_sculpt_problem;

/* Builds problem (layer, kv_head) of a capture (kvm_capture.h, want_queries = 1) of N tokens:
 * zone [0, N−m), retain [N−m, N). Training queries, in this order: (a) the post-RoPE queries of
 * the retain zone for every query head of the GQA group (head-major, then position); (b) n_synth
 * synthetic queries: pre-RoPE query vectors of a uniformly random context position and a random
 * head of the group, re-RoPE'd at position N + ⌊i·F/S⌋ (F = future_tokens), drawn from a PRNG
 * seeded by (seed, layer, kv_head). Then computes the full-cache references. Returns 0,
 * KVM_EINVAL (m > N, no queries in the capture, no training query at all), KVM_ENOMEM. */
int kvm_sculpt_problem_build(const kvm_model_config *c, const kvm_capture *cap, int layer, int kv_head,
                             int64_t m, int64_t n_synth, int64_t future_tokens, uint64_t seed,
                             kvm_sculpt_problem *p);

struct kvm_sculpt_qsets;
/* The same with model queries (query_source, kvm_sculpt_qsource.h) between the real and the
 * synthetic ones: for each source s with n_model[s] > 0 (indexed by KVM_SCULPT_QSRC_*; the
 * synthetic slot is ignored), n_model[s] queries of qs->set[s] drawn by stratified sampling
 * over its (position, group head) pairs: pair ⌊(i + u_i)·G·n / n_model[s]⌋, u_i uniform in [0, 1)
 * from a PRNG seeded by (seed, layer, kv_head, s), so distinct while n_model[s] ≤ G·n and the
 * same for a seed. Each sees the whole retain zone (n_vis = m); they and the real queries give
 * the mass Select+Fit selects by. qs may be NULL when every n_model[s] is 0. Errors as _build,
 * and KVM_EINVAL when a needed set is empty. */
int kvm_sculpt_problem_build_mixed(const kvm_model_config *c, const kvm_capture *cap, int layer, int kv_head,
                                   int64_t m, int64_t n_synth, int64_t future_tokens, uint64_t seed,
                                   const struct kvm_sculpt_qsets *qs, const int64_t *n_model, kvm_sculpt_problem *p);

/* Computes o_full, o_ret, lse_zone, lse_ret, mass, out_ms, vnorm_max, knorm_max from q, n_vis and the
 * zone/retain tensors (blocked float32 GEMMs, kvm_cpu_sculpt_refs; row sums in float64). Called
 * by _build; exposed for hand-made problems (tests). Returns 0 or KVM_ENOMEM. */
int kvm_sculpt_problem_prepare(kvm_sculpt_problem *p);

/* Frees the owned arrays and zeroes *p. Accepts a zeroed or half-built problem. */
void kvm_sculpt_problem_free(kvm_sculpt_problem *p);

/* Loss of k distilled entries kc/vc [k][d] with biases beta [k] (NULL = 0), KVSculpt §3:
 *   L = (1/nq) Σ_i ‖Ô_i − O_i‖² / out_ms + λ (1/nq) Σ_i (LSE_c,i − LSE_zone,i)²
 * where Ô_i is attention over [distilled + visible retain] and LSE_c,i = log Σ_j exp(s q_i·kc_j + β_j).
 * When grad_k ([k][d]) / grad_b ([k]) are not NULL they receive ∂L/∂kc and ∂L/∂β (analytic).
 * *mse (may be NULL) gets the unnormalised mean ‖Ô−O‖², *lse_part the λ term. Thread-safe
 * on distinct outputs. Returns L, or NAN on allocation failure. k may be 0. Computed by the
 * query-blocked GEMM kernel of kernels/kvm_sculpt_kernels.h (CPU backend); deterministic. */
double kvm_sculpt_loss(const kvm_sculpt_problem *p, const float *kc, const float *vc, const float *beta,
                       int64_t k, double lambda, float *grad_k, float *grad_b, double *mse, double *lse_part);

/* The same loss and gradient computed one query at a time (GEMV-shaped, the implementation
 * before issue 12), kept as the reference the blocked path is tested against. Same contract. */
double kvm_sculpt_loss_ref(const kvm_sculpt_problem *p, const float *kc, const float *vc, const float *beta,
                       int64_t k, double lambda, float *grad_k, float *grad_b, double *mse, double *lse_part);

/* Ridge value fit given keys/biases: with P[i][j] the probability query i puts on distilled
 * entry j (softmax over distilled + visible retain) and T_i = O_i − p_ret,i · O_ret,i, solves
 *   (PᵀP + αI) V = PᵀT + α V0,   α = alpha_rel · trace(PᵀP)/k
 * by Cholesky (LAPACKE_dposv, float64; P itself from the blocked float32 kernel of
 * kernels/kvm_sculpt_kernels.h). f32 = 1 (opts ridge_f32): PᵀP and PᵀT built by kvmill's float32
 * GEMM in blocks summed in float64, rebuilt in float64 when the Cholesky shows the problem too
 * ill-conditioned for that (kvm_sculpt_ridge_solve_f32); f32 = 0: built in float64 (OpenBLAS),
 * the fit before issue 12 part 5, bit for bit. V0 = vc on entry (shrink target); vc gets V.
 * Then, when vnorm_cap > 0, rescales every row to ‖v‖ ≤ vnorm_cap · p->vnorm_max (the
 * value-norm guard). Returns 0, KVM_ENOMEM, KVM_ERANGE (not positive definite / non-finite;
 * vc unchanged). */
int kvm_sculpt_ridge(const kvm_sculpt_problem *p, const float *kc, const float *beta, int64_t k, double alpha_rel,
                     double vnorm_cap, int f32, float *vc);

/* The solve half of kvm_sculpt_ridge, given the normal equations A = PᵀP [k][k] (upper triangle
 * read) and B = PᵀT [k][d] (float64, row-major, from kvm_cpu_sculpt_normal or a batch backend's
 * normal; both overwritten): adds α = alpha_rel·trace(A)/k, solves by Cholesky, applies the
 * value-norm guard and writes vc (V0 on entry). Returns 0 or KVM_ERANGE (vc unchanged). */
int kvm_sculpt_ridge_solve(const kvm_sculpt_problem *p, double *A, double *B, int64_t k, double alpha_rel,
                           double vnorm_cap, float *vc);

/* Returned (> 0, no error message) by kvm_sculpt_ridge_solve_f32 when the float32-built
 * equations must be rebuilt in float64. */
#define KVM_SCULPT_RIDGE_F64 1
/* The float32 equations' conditioning limit: every Cholesky pivot U_jj² of A + αI must keep at
 * least 1/limit of A + αI's largest diagonal entry. Since every pivot is ≥ α, the ratio is at
 * most ≈ k/ridge at the default α (1e5–6e5 on stories260K and SmolLM2, where the float32 fit's
 * values stay within 4e-4 and its outputs P·V within 5e-6 of float64: bench/RESULTS.md "Solver
 * speed, part 5"); pivots cancelled far below that (a tiny `ridge` on near-duplicate entries)
 * go to float64. */
#define KVM_SCULPT_RIDGE_PIVOT_LIMIT 1e8

/* kvm_sculpt_ridge_solve for normal equations built in float32 blocks (view ridge_f32 = 1):
 * the same solve, but KVM_SCULPT_RIDGE_F64 (vc unchanged, A and B spoilt) where the Cholesky
 * fails or a pivot breaks KVM_SCULPT_RIDGE_PIVOT_LIMIT: the caller rebuilds them in float64 and
 * calls kvm_sculpt_ridge_solve. Returns 0, KVM_SCULPT_RIDGE_F64 or KVM_ERANGE (non-finite). */
int kvm_sculpt_ridge_solve_f32(const kvm_sculpt_problem *p, double *A, double *B, int64_t k, double alpha_rel,
                               double vnorm_cap, float *vc);

/* The rounds' convergence stop (opts round_tolerance): 1 when a round whose ridge refit reached
 * loss `after` improved the best loss so far `before` by less than tol·|before| (a round that made
 * it worse counts as converged); 0 when tol ≤ 0 (off: every round runs). */
int kvm_sculpt_round_converged(double before, double after, double tol);

/* Select+Fit's selection: the k zone indices with the highest p->mass (ties: lower index),
 * sorted increasing, into idx[k]. Returns 0, KVM_EINVAL (k not in [0, nc]), KVM_ENOMEM. */
int kvm_sculpt_select(const kvm_sculpt_problem *p, int64_t k, int64_t *idx);

/* The start of a KVSculpt / joint-fixed solve of k entries: Select+Fit's (the kvm_sculpt_select
 * tokens' own keys and values, β = 0), or with o->am_start Attention Matching's point
 * (kvm_sculpt_am_head: keys by attention mass and OMP, β by NNLS, ridge values). sel[k] is
 * scratch; kc, vc [k][d] and beta [k] receive the point (the caller refits the values). Returns 0,
 * KVM_EINVAL (k not in [0, nc]), KVM_ENOMEM or KVM_ERANGE (am's non-finite loss). */
int kvm_sculpt_start(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, int64_t *sel, float *kc,
                     float *vc, float *beta);

/* Per-problem timing and outcome. */
typedef struct kvm_sculpt_head_stats {
    double lbfgs_s, ridge_s;  /* seconds spent */
    double loss0, loss;       /* loss after the Select+Fit initialisation and at the end */
    double mse;               /* final unnormalised attention-output MSE */
    int lbfgs_calls;          /* loss evaluations */
} kvm_sculpt_head_stats;

/* Solves one problem with method o->mode, rounds/iterations given explicitly (the pilot uses
 * fewer). Outputs kc, vc [k][d] and beta [k] (caller-allocated; beta all 0 unless o->bias).
 * Select+Fit init, then (KVSculpt) R rounds of L-BFGS on keys [and β] (kvmill's own,
 * kvm_sculpt_lbfgs.h, strong-Wolfe line search; liblbfgs with More–Thuente when o->lbfgs_oracle)
 * followed by a ridge fit of the values (each round after the first starts its first line search
 * at the previous round's H0 scaling γ, kvm_sculpt_lbfgs_params.step0: about 10% fewer
 * evaluations than restarting from 1/‖g‖); the best point seen is kept. Returns 0, KVM_EINVAL (k > nc), KVM_ENOMEM, KVM_ERANGE. */
int kvm_sculpt_solve_head(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, int rounds, int iters,
                          float *kc, float *vc, float *beta, kvm_sculpt_head_stats *st);

/* Solves n problems ps[n] (each with budget k[i] ≤ ps[i]->nc) as one batch on backend be
 * (kernels/kvm_sculpt_kernels.h; NULL = CPU) with o->threads threads: the algorithm of
 * kvm_sculpt_solve_head with kvmill's own L-BFGS, every step of every problem in lockstep: one
 * batched loss+gradient call per L-BFGS step over the problems still running (a problem leaves
 * when its L-BFGS stops, and its rounds when its ridge fit fails), one batched normal-equations
 * call per ridge step (solved on the host, float64 Cholesky). On the CPU backend (unless
 * o->lockstep) each of o->threads threads instead solves one problem at a time as a batch of
 * its own (it stays in L2); *lbfgs_s and *ridge_s are then summed over the threads. Problems with k = 0 are solved
 * alone. Outputs packed problem-major: kc, vc [Σk][d], beta [Σk] at entry offset Σ_{j<i} k_j;
 * st[n] per problem (lbfgs_s and ridge_s are 0 there: the batched phases' wall seconds go to
 * *lbfgs_s and *ridge_s). o->lbfgs_oracle is ignored (the oracle is per problem:
 * kvm_sculpt_solve_head). Each problem's result is bit-identical to kvm_sculpt_solve_head's
 * with the same inputs, whatever the batch or the thread count. `progress` (may be NULL) gets one
 * step per problem as that problem's solve ends, from the thread that solved it (one at a time
 * per thread on the CPU; the whole batch at its end in lockstep and on a device), so that a
 * supervisor sees a long batch advance. Returns 0, KVM_EINVAL (k out of range, head dims
 * differ), KVM_ENOMEM, KVM_ERANGE (the message names the problem). */
int kvm_sculpt_solve_batch(const kvm_sculpt_problem *const *ps, int n, const kvm_sculpt_opts *o, const int64_t *k,
                           int rounds, int iters, const struct kvm_sculpt_backend *be, float *kc, float *vc,
                           float *beta, kvm_sculpt_head_stats *st, double *lbfgs_s, double *ridge_s,
                           struct kvm_progress *progress);
/* The baselines' per-problem solvers (kvm_sculpt_solve_head calls them for o->mode AM / KVZIP;
 * rounds and iterations do not apply). Outputs as kvm_sculpt_solve_head: kc, vc [k][d], beta [k];
 * st->mse and st->loss (λ = o->lambda) of the result.
 *
 * Attention Matching (arXiv 2602.16284 §3): with A[i][j] = exp(s·q_i·k_j − LSE_zone,i) (query i's
 * zone softmax, so the zone's partition function is Σ_j A[i][j] = 1), the keys are originals:
 * the ⌈k/2⌉ of highest attention mass, then orthogonal matching pursuit in 4 blocks, each adding
 * the candidates most correlated (Aᵀr/‖A_j‖) with the residual r = 1 − A_S·w; w ≥ 0 solves
 * min ‖A_S w − 1‖² by NNLS (kvm_sculpt_nnls, from w = 1) after every block; β_j = log max(w_j, 1e-12)
 * (finite; an unused entry gets ≈ −27.6); values by kvm_sculpt_ridge (α = o->ridge_alpha).
 * KVzip (arXiv 2505.23416 §3.2): score_j = max over training queries of the full-softmax
 * probability of zone entry j, the top k kept with their own keys and values, β = 0.
 * Ties go to the lower index. Returns 0, KVM_EINVAL (k > nc), KVM_ENOMEM, KVM_ERANGE. */
int kvm_sculpt_am_head(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, float *kc, float *vc,
                       float *beta, kvm_sculpt_head_stats *st);
int kvm_sculpt_kvzip_head(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, float *kc, float *vc,
                          float *beta, kvm_sculpt_head_stats *st);

/* Non-negative least squares in normal-equation form: minimises ½wᵀGw − hᵀw over w ≥ 0, G [k][k]
 * symmetric positive semi-definite (row-major, float64), by sequential coordinate-wise descent
 * (Franc, Hlaváč, Navara, "Sequential coordinate-wise algorithm for the non-negative least
 * squares problem", CAIP 2005), from the start point in w (negative or non-finite entries start at
 * 0), until every KKT violation ≤ tol·max|h| or max_sweeps. Coordinates with G_jj ≤ 0 keep their
 * start. w[k] ≥ 0 and finite on return. Returns the sweeps done. */
int kvm_sculpt_nnls(const double *G, const double *h, int64_t k, double tol, int max_sweeps, double *w);

/* Budget allocation (paper §4 and ours). mse[n] per problem at budget kpilot (and mse_half at
 * ⌈kpilot/2⌉, GAIN only), caps[n] = zone sizes, total = entries to hand out over the n problems
 * (n_layers × n_kv_heads, layer-major). Writes k[n], each in [min(1, cap), cap], Σ k = min(total,
 * Σ caps). LAYER pools the MSE per layer (mean over its heads). Returns 0 or KVM_EINVAL. */
int kvm_sculpt_allocate(kvm_sculpt_alloc how, int n_layers, int n_kv_heads, const double *mse,
                        const double *mse_half, int64_t kpilot, const int64_t *caps, int64_t total, double power,
                        int64_t *k);

#endif
