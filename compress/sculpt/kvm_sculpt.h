/* kvm_sculpt.h: KVSculpt (arXiv 2603.27819) — KV cache compression as distillation — and its
 * baselines Select+Fit and joint-fixed, as compression methods over compress/kvm_compress.h.
 * Per (layer, KV head): the retain zone (last m tokens) is kept, the compress zone (first N−m
 * tokens) is replaced by k free (key, value[, logit bias]) entries fitted so that attention over
 * [distilled + retain] reproduces attention over the full cache for a set of training queries. */
#ifndef KVM_SCULPT_H
#define KVM_SCULPT_H

#include "compress/kvm_compress.h"

#include <stdint.h>

/* Which method kvm_sculpt_compress runs (all share query construction, selection and ridge). */
typedef enum kvm_sculpt_mode {
    KVM_SCULPT_FULL = 0,        /* KVSculpt: free keys by L-BFGS alternating with ridge values (§3) */
    KVM_SCULPT_SELECTFIT = 1,   /* Select+Fit: top-k attention-mass tokens, their keys, ridge values */
    KVM_SCULPT_JOINT_FIXED = 2, /* ablation: Select+Fit keys kept fixed (no free movement); their
                                   logit biases β (L-BFGS) and values (ridge) fitted jointly on the
                                   KVSculpt objective, alternating as KVSculpt does */
    KVM_SCULPT_AM = 3,          /* Attention Matching baseline (arXiv 2602.16284): original keys chosen
                                   by attention mass then orthogonal matching pursuit on the partition
                                   function, β = log w with w from NNLS, values by least squares
                                   (compress/sculpt/sculpt_am.c) */
    KVM_SCULPT_KVZIP = 4,       /* KVzip-style baseline (arXiv 2505.23416): each zone entry scored by its
                                   maximum attention from the training queries (KVzip proper: query_source
                                   = repeat), top-k kept unchanged (compress/sculpt/sculpt_kvzip.c) */
} kvm_sculpt_mode;

/* Where the training queries come from (query_source): one share per source, summing to 1. */
enum {
    KVM_SCULPT_QSRC_SYNTHETIC = 0,    /* re-RoPE'd pre-RoPE context queries at future positions (issue 5) */
    KVM_SCULPT_QSRC_REPEAT = 1,       /* post-RoPE queries of the context repeated after a short prompt
                                         (KVzip arXiv 2505.23416, Attention Matching arXiv 2602.16284) */
    KVM_SCULPT_QSRC_CONTINUATION = 2, /* queries of tokens the model generates greedily after the context */
    KVM_SCULPT_QSRC_COUNT = 3,
};
typedef struct kvm_sculpt_qsource {
    double share[KVM_SCULPT_QSRC_COUNT]; /* fraction of the `queries` count from each source */
} kvm_sculpt_qsource;

/* How the total budget is spread over (layer, KV head) problems. */
typedef enum kvm_sculpt_alloc {
    KVM_SCULPT_ALLOC_UNIFORM = 0, /* k = round(r·(N−m)) for every head */
    KVM_SCULPT_ALLOC_LAYER = 1,   /* paper §4: pilot MSE^p per layer, split evenly over its heads */
    KVM_SCULPT_ALLOC_HEAD = 2,    /* paper §4: pilot MSE^p per (layer, head) */
    KVM_SCULPT_ALLOC_GAIN = 3,    /* ours: pilot at k and k/2, power-law error model per head,
                                     greedy marginal-gain water-filling with caps */
} kvm_sculpt_alloc;

/* Options; start from kvm_sculpt_opts_default(). Read-only during a call. (A new field that
 * changes results must also join opts_equal in compress/polykv/kvm_polykv_method.c, which
 * decides when remembered distilled layers can be reused.) */
typedef struct kvm_sculpt_opts {
    kvm_sculpt_mode mode;     /* method */
    int64_t retain_tokens;    /* m: retain zone, the last m context tokens (default 32) */
    double ratio;             /* r = k/(N−m) in (0, 1] (default 0.3); ignored when k_entries > 0 */
    int64_t k_entries;        /* absolute k per head when > 0 (must be ≤ N−m) */
    int64_t n_synth;          /* S synthetic future queries per (layer, KV head) (default 2048) */
    int64_t future_tokens;    /* F: synthetic positions N + ⌊i·F/S⌋; ≤ 0: in->n_future, else 64 */
    double lambda;            /* λ, weight of the LSE-matching term (default 0.1) */
    int lse_mass_weight;      /* 1: weight each query's LSE error by the compress zone's share of
                                 its full attention (ours); 0: plain mean as in the paper (default 0) */
    double ridge_alpha;       /* ridge α relative to the mean diagonal of the normal matrix (1e-3) */
    int ridge_f32;            /* 1: the ridge's normal equations built by kvmill's float32 GEMM
                                 (float64 block sums), rebuilt in float64 where the Cholesky's
                                 pivots show ill-conditioning (kvm_sculpt_ridge); 0: in float64
                                 (OpenBLAS), the fit before issue 12 part 5 (default 1; CPU only) */
    double vnorm_cap;         /* value-norm guard: ‖v‖ ≤ vnorm_cap · max zone ‖v‖; 0 disables (1.0) */
    double knorm_cap;         /* key-norm guard: keys projected to ‖k‖ ≤ knorm_cap · max zone ‖k‖
                                 after each L-BFGS round; 0 disables (default 0) */
    int rounds;               /* R alternating rounds (default 4) */
    int lbfgs_iters;          /* L-BFGS iterations per round (default 25: with carry_history the
                                 KL of 30 without it, bench/RESULTS.md "Solver speed, part 4") */
    int lbfgs_history;        /* L-BFGS memory (default 20) */
    double lbfgs_tolerance;   /* kvmill's L-BFGS ends a round's run when its last 4 iterations
                                 gained less than this share of the run's decrease so far
                                 (kvm_sculpt_lbfgs_params.progress); 0 = off, only the liblbfgs
                                 rules (default 0) */
    int carry_history;        /* 1: each round's L-BFGS starts with the previous round's stored
                                 pairs and takes its quasi-Newton step at once
                                 (kvm_sculpt_lbfgs_carry; kvmill's L-BFGS, on every backend; the
                                 liblbfgs oracle starts empty); 0: an empty memory each round, the
                                 solve before issue 12 part 4 (default 1) */
    double lbfgs_gtol;        /* kvmill's L-BFGS gradient stop ‖g‖ ≤ this · ‖g‖ at the start of the
                                 problem's first round, instead of ‖g‖ ≤ 1e-6·max(1, ‖x‖)
                                 (kvm_sculpt_lbfgs_gtol); 0 = the absolute rule (default 0) */
    double round_tolerance;   /* a problem leaves the rounds when a round's ridge-refit loss is
                                 below its best so far by less than this fraction of it
                                 (kvm_sculpt_round_converged); 0 = off (default 0.2: bench/RESULTS.md,
                                 "Solver speed, part 6") */
    int bias;                 /* 1: each distilled entry gets a logit bias β, optimised with the
                                 keys (Attention Matching, arXiv 2602.16284) */
    int am_start;             /* 1: each problem starts from Attention Matching's point (keys chosen
                                 by attention mass and OMP, β by NNLS, values by least squares:
                                 kvm_sculpt_am_head) instead of Select+Fit's (the top-k keys by
                                 attention, β = 0, ridge values); the rounds then descend from it;
                                 the allocation pilot keeps Select+Fit's start
                                 (ours; default 0: bench/RESULTS.md, "Attention Matching as
                                 KVSculpt's start") */
    kvm_sculpt_alloc alloc;   /* budget allocation (default uniform) */
    double alloc_power;       /* p of the MSE^p rule (default 0.5) */
    int pilot_rounds;         /* alternating rounds of the allocation pilot; 0 (default): the
                                 MSE of each problem's Select+Fit start, no L-BFGS (as good a
                                 signal on SmolLM2, 15-19 s less: bench/RESULTS.md, "Solver
                                 speed, part 9") */
    int pilot_iters;          /* L-BFGS iterations per pilot round (default 10) */
    uint64_t seed;            /* seed of the synthetic queries and of the model-query sampling (default 1) */
    kvm_sculpt_qsource query_source; /* training-query sources (default synthetic only) */
    int on_policy;            /* 1: layers compressed in order, each layer's model queries (repeat /
                                 continuation) from a forward pass over the cache whose layers below
                                 are already compressed (Attention Matching's on-policy mode, arXiv
                                 2602.16284); 0: every layer from the full-cache pass (default 0) */
    int threads;              /* worker threads over (layer, KV head) problems (default 1) */
    int lbfgs_oracle;         /* 1: keys fitted by liblbfgs (More–Thuente), the solver before issue
                                 12, kept as the test oracle; 0: kvmill's own reverse-communication
                                 L-BFGS (compress/sculpt/kvm_sculpt_lbfgs.h) (default 0) */
    int cuda;                 /* 1: the batched solver's loss, gradients and ridge normal equations
                                 run on CUDA device cuda_device (kernels/kvm_sculpt_kernels.h);
                                 0: on the CPU (default; the liblbfgs oracle is always CPU) */
    int cuda_device;          /* CUDA device index when cuda = 1 (default 0) */
    int lbfgs_no_stop;        /* 1: the batched solver's L-BFGS runs every iteration (no gradient or
                                 decrease test; benchmarks with forced counts) (default 0) */
    int lockstep;             /* 1: the CPU backend, too, steps every problem of a batch in
                                 lockstep (tests, benchmarks: the GPU's schedule); 0: on the CPU
                                 each thread solves one problem at a time, which stays in L2
                                 (default; results bit-identical either way) */
} kvm_sculpt_opts;

/* Where the time went (seconds summed over worker threads, so they may exceed wall time). */
typedef struct kvm_sculpt_stats {
    kvm_compress_stats base;  /* wall seconds of the whole call, entries kept */
    double query_s;           /* building training queries and full-cache references */
    double lbfgs_s;           /* key (and β) optimisation */
    double ridge_s;           /* closed-form value fits */
    double pilot_s;           /* wall seconds of the allocation pilot (included in base.seconds) */
    double qprefill_s;        /* wall seconds of the extra forward passes of query_source repeat /
                                 continuation (included in base.seconds) */
    double mse_min, mse_max;  /* spread of the per-(layer, head) pilot MSE (0 without a pilot) */
    double layer_mse_min, layer_mse_max; /* spread of the per-layer mean pilot MSE */
} kvm_sculpt_stats;

/* The defaults listed in kvm_sculpt_opts (those of issue 5). */
kvm_sculpt_opts kvm_sculpt_opts_default(void);

/* Parses "sculpt" | "selectfit" | "joint-fixed" | "am" | "kvzip" and "uniform" | "layer" | "head" | "gain".
 * Return 0 or KVM_EINVAL (message names the word). */
int kvm_sculpt_mode_parse(const char *s, kvm_sculpt_mode *out);
int kvm_sculpt_alloc_parse(const char *s, kvm_sculpt_alloc *out);

/* k, the distilled entries per KV head kvm_sculpt_compress makes of a context of n_tokens:
 * o->k_entries, else round(o->ratio · (n_tokens − m)) and at least 1, capped at n_tokens − m
 * (0 when the compress zone is empty); m = o->retain_tokens. */
int64_t kvm_sculpt_k(const kvm_sculpt_opts *o, int64_t n_tokens);

/* Compresses in->full with method o->mode (KVSculpt arXiv 2603.27819 §3; Select+Fit and the
 * joint-fixed ablation; β per Attention Matching arXiv 2602.16284). Needs in->cap captured with
 * want_queries = 1 over the same N = in->n_tokens context tokens. Per (layer, KV head) the result
 * holds k distilled entries (pos = KVM_POS_NONE, bias β or 0) followed by the retain zone
 * (positions N−m .. N−1, copied from in->full); next_pos = N, so later tokens keep their true
 * positions. N−m = 0 (empty compress zone) gives k = 0: the retain zone alone.
 * Runs o->threads worker threads (pthreads) over the independent problems; while they run
 * OpenBLAS is set to one thread and restored after (a process-wide setting: do not overlap two
 * calls with other BLAS users that rely on its thread count). Deterministic for a given seed
 * whatever the thread count. *out is owned by the caller (kvm_kvcache_free); stats may be NULL.
 * Errors: KVM_EINVAL (options out of range, k > N−m, m > N, capture without queries or of
 * another length; the message says which), KVM_ENOMEM, KVM_ERANGE (a fit produced a non-finite
 * value or a normal matrix that is not positive definite). On error *out = NULL. */
int kvm_sculpt_compress(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out,
                        kvm_sculpt_stats *stats);

/* KVSculpt (arXiv 2603.27819 §3) with a budget per layer (what a PolyKV strategy with "sculpt"
 * layers needs):
 * budget[L] entries per KV head of layer l, retain zone included. budget[l] ≤ 0 leaves dst's
 * layer l as it is; budget[l] ≥ N sets its heads to in->full's (the whole context); otherwise
 * the layer keeps a retain zone of m_l = min(o->retain_tokens, ⌊b/2⌋) tokens and distils its
 * compress zone into k_l = b − m_l entries, replacing dst's heads of that layer (distilled entries
 * first, then the retain zone with its positions). o->ratio and o->k_entries are ignored; with
 * o->alloc ≠ uniform the pilot (at the mean k of the distilled heads) redistributes their total
 * over the distilled (layer, KV head) problems only. Problems, seeds and results per (layer,
 * head) are those of kvm_sculpt_compress with the same m and k, so a uniform budget over every
 * layer reproduces it exactly. dst (borrowed, shaped like the model, next_pos untouched) is
 * modified in place; on error its distilled layers may be partly rewritten. Errors as
 * kvm_sculpt_compress. */
int kvm_sculpt_compress_layers(const kvm_compress_input *in, const kvm_sculpt_opts *o, const int64_t *budget,
                               kvm_kvcache *dst, kvm_sculpt_stats *stats);

/* The same with a budget per (layer, KV head), budget[l·H + g] (what a PolyKV strategy's
 * document-adaptive head split gives its sculpt and kvzip layers): each head on its own, by the
 * rules above (≤ 0 untouched, ≥ N copied, else retain zone min(o->retain_tokens, ⌊b/2⌋) and the
 * rest distilled); a head's result depends only on its own (m, k), so equal budgets within every
 * layer are kvm_sculpt_compress_layers exactly. With o->alloc ≠ uniform (the pilot redistributes
 * whole layers) every layer's heads must share one budget: KVM_EINVAL otherwise. Other errors as
 * kvm_sculpt_compress. */
int kvm_sculpt_compress_heads(const kvm_compress_input *in, const kvm_sculpt_opts *o, const int64_t *budget,
                              kvm_kvcache *dst, kvm_sculpt_stats *stats);

/* The three methods with the signature of the eviction methods' table: kvm_sculpt_compress
 * with o->mode forced to KVSculpt / Select+Fit / joint-fixed (o may be NULL for defaults). */
int kvm_sculpt_compress_sculpt(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out);
int kvm_sculpt_compress_selectfit(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out);
int kvm_sculpt_compress_joint_fixed(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out);

/* Parses a query_source value: a source name ("synthetic", "repeat", "continuation") or a mix
 * "NAME@SHARE+NAME@SHARE..." ("repeat@0.5+synthetic@0.5"; "repeat+synthetic" = equal shares).
 * '+' and '@' because ',' and ':' already separate options and methods in method strings.
 * Shares are positive numbers, normalised to sum 1; a name appears at most once. Returns 0 or
 * KVM_EINVAL (message names the bad part). */
int kvm_sculpt_qsource_parse(const char *s, kvm_sculpt_qsource *out);

#endif
