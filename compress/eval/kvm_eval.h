/* kvm_eval.h: the evaluation harness shared by every compression method. A document is
 * split into a context (tokens [0, N), BOS first) and a continuation (tokens [N, N+T)).
 * The full-KV reference is computed once per document: the context prefill (with the
 * capture every method reads), then the continuation teacher-forced (tokens N..N+T-2 in one
 * batched call over the cache: causal among themselves, every cache entry visible). A
 * method's compressed cache is then run the same way and compared step by step (a run with a
 * decode-phase policy, which changes the cache between tokens, goes one token at a time and
 * is compared with a reference made token by token too, so both paths are exact at full KV):
 * KL(full ‖ compressed) of the T next-token distributions for tokens N..N+T-1 (the first
 * comes from the context prefill itself, before compression, so it is identical in both),
 * top-1 agreement and the continuation perplexity. */
#ifndef KVM_EVAL_H
#define KVM_EVAL_H

#include "compress/kvm_compress.h"

/* One method's scores on one document. */
typedef struct kvm_eval_result {
    double kl_mean;        /* mean over the T steps of KL(full ‖ compressed), nats */
    double kl_median;      /* median of the same (linear interpolation) */
    double kl_p99;         /* 99th percentile of the same (linear interpolation) */
    double top1;           /* share of steps whose argmax tokens agree, [0, 1] */
    double ppl_full;       /* exp(mean NLL of tokens N..N+T-1) under full KV; with a decode policy the
                              token-by-token reference's (ppl_dec), whose sums run in another order:
                              it can differ from a prefill-only row's in the last digits */
    double ppl_compressed; /* the same under the compressed cache */
    double budget_tokens;  /* mean entries per (layer, KV head) of the compressed context cache */
    double ratio;          /* budget_tokens / N */
    double seconds;        /* wall time of the compression call */
    int64_t bytes_compressed; /* stored bytes of the cache as served (kvm_eval_opts.roundtrip), 0 without one */
    double decode_ms;      /* wall ms per decode step over the compressed cache (kvm_eval_opts.decode_steps), 0
                              when not measured */
} kvm_eval_result;

typedef struct kvm_eval_doc kvm_eval_doc;

/* Prepares document tokens[0..n_tokens) (BOS first) for evaluation with context N = n_ctx
 * and continuation T = n_cont: computes the full context cache, a capture with queries and
 * statistics (mass over all N queries) and the reference logits. Needs n_tokens ≥ N + T
 * (callers truncate longer documents) and N + T ≤ the model's seq_len; m and k (NULL = CPU)
 * are borrowed and must outlive the doc. Returns 0, KVM_EINVAL (lengths), KVM_ENOMEM, or a
 * forward error. */
int kvm_eval_doc_new(const kvm_model *m, const kvm_kernels *k, const int32_t *tokens, int64_t n_tokens,
                     int64_t n_ctx, int64_t n_cont, kvm_eval_doc **out);

/* Frees. Accepts NULL and *d == NULL; sets *d = NULL. */
void kvm_eval_doc_free(kvm_eval_doc **d);

/* A token prefix shared by several documents (task cases: one text with a fact inserted at
 * different depths share the text before it), prefilled once, in steps, with the capture
 * every method reads. Causal attention: the keys, values, queries and per-query statistics of
 * positions [0, s) depend on tokens [0, s) only, and the mass a key receives is a sum over
 * queries, so a document's prefill can start from the prefix's state at s. */
typedef struct kvm_eval_prefix kvm_eval_prefix;

/* Prepares prefix tokens[0, n) (copied) for model m on backend k (NULL = CPU; both borrowed,
 * must outlive p); nothing is prefilled yet. Returns 0, KVM_EINVAL (n < 1 or past the model's
 * window), KVM_ENOMEM. */
int kvm_eval_prefix_new(const kvm_model *m, const kvm_kernels *k, const int32_t *tokens, int64_t n,
                        kvm_eval_prefix **out);

/* Frees. Accepts NULL and *p == NULL; sets *p = NULL. */
void kvm_eval_prefix_free(kvm_eval_prefix **p);

/* kvm_eval_doc_new for a document that may begin with p's tokens: s = the length of the common
 * start of tokens[0, N − 1) and p's. When p has been prefilled no further than s, it is
 * prefilled on to s (and kept there for the next document) and the document's cache and
 * capture start from a copy of it: only [s, N) is prefilled for the document. When p is
 * already past s (a document sharing less after one sharing more), p starts again from
 * position 0 (the document then costs what kvm_eval_doc_new does; give documents in order of
 * their insertion point to avoid it). *reused (may be NULL) gets s.
 * The result equals kvm_eval_doc_new's up to float rounding (the context runs in two prefill
 * calls instead of one; tests/check_eval.c measures it). Errors: those of kvm_eval_doc_new,
 * or a forward error of p's prefill (p then shares nothing with later documents). */
int kvm_eval_doc_new_after(kvm_eval_prefix *p, const int32_t *tokens, int64_t n_tokens, int64_t n_ctx,
                           int64_t n_cont, int64_t *reused, kvm_eval_doc **out);

/* Sets the tokens between the context and its repeated copy for query_source repeat
 * (kvm_compress_input.repeat_prompt, e.g. kvm_sculpt_repeat_prompt's), copied: ids[n], n ≥ 0
 * (0: none, the BOS token alone). Drops the model query sets built so far for the document.
 * Returns 0, KVM_ENOMEM. */
int kvm_eval_doc_set_repeat_prompt(kvm_eval_doc *d, const int32_t *ids, int64_t n);

/* What a method receives for this document; valid while d lives. */
const kvm_compress_input *kvm_eval_doc_input(const kvm_eval_doc *d);

/* Full-KV continuation perplexity of the document. */
double kvm_eval_doc_ppl_full(const kvm_eval_doc *d);

/* Runs the continuation over a copy of `compressed` (borrowed; a cache of the context with
 * next_pos == N), with the decode policy's hooks (pol may be NULL) and extra hooks (may be
 * NULL; e.g. a signal probe) registered, and fills r (all fields but seconds). Returns 0,
 * KVM_EINVAL (cache shape or next_pos wrong), KVM_ENOMEM, a forward or hook error. */
int kvm_eval_continue(kvm_eval_doc *d, const kvm_kvcache *compressed, kvm_decode_policy *pol, const kvm_hooks *extra,
                      kvm_eval_result *r);

/* Compresses the document's context with method m and options opts (from m->opts_new),
 * times it, and runs the continuation; with phases_both = 1 and a method that has a
 * decode-phase policy, the policy is applied while the continuation is appended. Fills r.
 * Returns 0 or the method's / the run's status. */
int kvm_eval_run(kvm_eval_doc *d, const kvm_method *m, const void *opts, int phases_both, kvm_eval_result *r);

/* Replaces a compressed context cache by what a store would serve for it: *out (new, caller
 * frees) is c as read back after storing (e.g. keys and values rounded to a 16-bit dtype),
 * *stored_bytes its stored size. n_tokens = N. Returns 0 or an error (the detail says why). */
typedef int kvm_eval_roundtrip_fn(void *user, const kvm_kvcache *c, int64_t n_tokens, kvm_kvcache **out,
                                  int64_t *stored_bytes);

/* How kvm_eval_run_ex runs a method. Zero-initialised: what kvm_eval_run does. */
typedef struct kvm_eval_opts {
    int phases_both;                 /* 1: apply the method's decode-phase policy, if any, while continuing */
    kvm_eval_roundtrip_fn *roundtrip; /* NULL: score the cache as compressed; else what it serves back */
    void *user;                      /* for roundtrip */
    int decode_steps;                /* > 0: also time this many decode steps (≤ T) over the served cache */
} kvm_eval_opts;

/* kvm_eval_run with the cache scored as a store would serve it (eo->roundtrip, applied before
 * any decode policy sees the cache; fills r->bytes_compressed) and, with eo->decode_steps > 0,
 * the decode latency at the compressed size (r->decode_ms: tokens N.. fed one decode call each
 * over a copy of the served cache, no policy; wall time, so it depends on the machine's load).
 * Returns 0, KVM_EINVAL (decode_steps > T), or the method's / the round trip's / the run's
 * status. */
int kvm_eval_run_ex(kvm_eval_doc *d, const kvm_method *m, const void *opts, const kvm_eval_opts *eo,
                    kvm_eval_result *r);

/* Mean KL(full ‖ compressed) of steps [t0, t1) of the last kvm_eval_continue / _run on d
 * (step i predicts token N + i; 0 ≤ t0 < t1 ≤ T). Lets one continuation of 2T tokens give a
 * search part and a held-out part (causal attention: steps [0, T) do not depend on the tokens
 * after them). Returns NAN before any run or for a bad range. */
double kvm_eval_kl_range(const kvm_eval_doc *d, int64_t t0, int64_t t1);

/* Mean of kl_steps[t0, t1) (per-step KL of a run of T steps, kvm_eval_score's kl_steps): NAN when
 * kl_steps is NULL (no run yet) or for a range outside [0, T) or empty. */
double kvm_eval_kl_steps_mean(const double *kl_steps, int64_t T, int64_t t0, int64_t t1);

/* How kvm_eval_answers decodes. Zero-initialised: plain greedy decoding to max_new or EOS. */
typedef struct kvm_eval_answers_opts {
    /* 1 when out[0, n) is a complete answer of cache i, so its decoding stops there; NULL: never */
    int (*done)(void *user, int i, const int32_t *out, int n);
    void *user; /* for done */
    /* A reference answer (e.g. full KV's greedy one; NULL / 0: none), teacher-forced after the
     * question in the first call: its rows give each cache's NLL of it, and each greedy answer
     * follows it while it agrees (greedy speculative decoding with the reference as the draft,
     * Leviathan et al., arXiv 2211.17192), so an answer that equals it costs no decode step.
     * n_ref ≤ max_new. */
    const int32_t *ref;
    int n_ref;
} kvm_eval_answers_opts;

/* Answers one question over n caches at once (task accuracy, compress/eval/kvm_task.h): the
 * document's continuation tokens [N, N+T) (the question and the assistant marker, appended at
 * ask time) are prefilled over each cache (caches of the context, next_pos == N, distinct; the
 * caller's to spend: the question and the answer are appended to them in place, so pass copies
 * of caches to keep), then each answer is decoded greedily to max_new tokens, EOS (not stored)
 * or o->done; every step is one forward call over all the answers still going
 * (kvm_forward_multi), so n caches cost about one cache's weight reads. out [n][max_new] gets
 * the tokens, n_out[n] their counts; nll[n] (may be NULL) the mean over the reference's tokens
 * of −log p(ref[j] | question, ref[0, j)) in nats under each cache (NAN without a reference: a
 * continuous companion of exact match, which moves by whole cases); *forward_calls (may be
 * NULL) the calls after the first. An answer is greedy decoding's up to the float rounding of
 * batched calls against single-token ones. Memory: logits of n·(n_ref + 1) rows of the
 * vocabulary for the first call (callers bound n). Uses d's forward: one call at a time per
 * document. Returns 0, KVM_EINVAL (n < 1, max_new < 1, n_ref outside [0, max_new], a cache of
 * another shape or length, naming it, one cache twice; before any cache changes; a reference
 * token outside the vocabulary is the forward's "sequence i: token T + j"), KVM_ENOMEM, a
 * forward error; after an error out, n_out and nll hold nothing to read. */
int kvm_eval_answers(kvm_eval_doc *d, kvm_kvcache *const *caches, int n, int max_new, const kvm_eval_answers_opts *o,
                     int32_t *out, int *n_out, double *nll, int *forward_calls);

/* The document's continuation tokens [N, N+T) (the question of a task case): *n = T; owned by d. */
const int32_t *kvm_eval_doc_continuation(const kvm_eval_doc *d, int64_t *n);

/* The forward d runs its continuations with (borrowed, valid while d lives; no hooks are
 * registered between calls): for callers that replay single layers (kvm_forward_attend). */
kvm_forward *kvm_eval_doc_forward(kvm_eval_doc *d);

/* The full-KV context cache of d (borrowed, valid while d lives). */
const kvm_kvcache *kvm_eval_doc_full(const kvm_eval_doc *d);

/* ---- quality-targeted compression (issue 14 item 5, compress/eval/kvm_eval_target.c) ---- */

/* The KL (nats) a method reaches at a budget of `budget` entries per (layer, KV head). */
typedef int kvm_eval_kl_fn(void *user, int64_t budget, double *kl);

enum { KVM_EVAL_TARGET_MAX_PROBES = 64 };

/* What the budget search found. */
typedef struct kvm_eval_target {
    int64_t budget;     /* the smallest probed budget with KL ≤ target (hi when none reaches it) */
    double kl;          /* KL at that budget */
    int reached;        /* 1 when kl ≤ target */
    int n_probes;       /* budgets evaluated, ≤ KVM_EVAL_TARGET_MAX_PROBES */
    int64_t probe_budget[KVM_EVAL_TARGET_MAX_PROBES]; /* in evaluation order */
    double probe_kl[KVM_EVAL_TARGET_MAX_PROBES];
    int n_nonmonotone;  /* probe pairs b1 < b2 with KL(b2) > KL(b1) (the bisection assumes none) */
} kvm_eval_target;

/* Finds the smallest budget b = lo + j·step (j ≥ 0, b ≤ hi; hi itself is always a candidate)
 * whose KL from fn is ≤ target, by bisection: KL(hi) first (when it exceeds target the
 * search stops there with reached = 0), then halving the interval [lo, hi], so about
 * log2((hi − lo)/step) + 1 probes. The bisection assumes KL does not rise with the budget;
 * every pair of probes is checked and violations counted in n_nonmonotone (where they occur
 * the answer may not be the smallest). 1 ≤ lo ≤ hi, step ≥ 1, target ≥ 0. Returns 0,
 * KVM_EINVAL (bad arguments), or fn's error. */
int kvm_eval_target_budget(kvm_eval_kl_fn *fn, void *user, int64_t lo, int64_t hi, int64_t step, double target,
                           kvm_eval_target *out);

/* Quantile q in [0, 1] of x[0..n) with linear interpolation between order statistics
 * (x is sorted in place). n ≥ 1. */
double kvm_eval_quantile(double *x, int64_t n, double q);

/* KL(p ‖ q) in nats of the softmax distributions of logits lp, lq [vocab] (double
 * accumulation; identical logits give exactly 0). Non-finite logits give NaN or inf, never 0. */
double kvm_eval_kl(const float *lp, const float *lq, int vocab);

/* exp(mean over steps i < T of −log softmax(logits[i])[next[i]]): the perplexity of tokens
 * next[0, T) under logits [T][vocab]. */
double kvm_eval_ppl(const float *logits, const int32_t *next, int64_t T, int vocab);

/* Scores a run's logits got [T][vocab] against the reference ref [T][vocab] (step i predicts
 * next[i]): r's kl_mean, kl_median, kl_p99, top1 and ppl_compressed (the other fields are the
 * caller's). kl [T] is scratch (sorted for the quantiles); kl_steps [T] (may be NULL) gets the
 * per-step KL in step order. A step with NaN KL makes kl_mean, kl_median and kl_p99 NaN. */
void kvm_eval_score(const float *ref, const float *got, const int32_t *next, int64_t T, int vocab, double *kl,
                    double *kl_steps, kvm_eval_result *r);

/* The prefill-phase plan of an eviction method (streaming, h2o, tova, snapkv, pyramidkv: one
 * pattern everywhere) with options opts (from m->opts_new) for a context of n_tokens: what its
 * compress function cuts the cache with (kvm_evict_prefill). *plan is new (kvm_evict_plan_free).
 * Returns 0, KVM_ENOTSUP (any other method: the message names it), KVM_EINVAL, KVM_ENOMEM. */
struct kvm_evict_plan;
int kvm_method_evict_plan(const kvm_method *m, const void *opts, int64_t n_tokens, struct kvm_evict_plan **plan);

/* The KVSculpt solver's options under method m with opts (from m->opts_new): opts itself for
 * sculpt, selectfit, joint-fixed, am and kvzip; a polykv strategy's sculpt and kvzip layers'
 * (kvm_polykv_method_distilled_opts); NULL for a method that runs no solver. Borrowed: valid
 * while opts is. What a harness checks (retain zone, query sources) before any prefill. */
struct kvm_sculpt_opts;
const struct kvm_sculpt_opts *kvm_method_solver_opts(const kvm_method *m, const void *opts);

/* polykv's part of kvm_method_solver_opts: the options of the sculpt and kvzip layers of the
 * strategy of opts (from kvm_polykv_method_opts_new), or NULL when it has none (kvzip layers
 * score with mode kvzip, the rest as given). Defined in compress/polykv/kvm_polykv_method.c. */
const struct kvm_sculpt_opts *kvm_polykv_method_distilled_opts(const void *opts);

/* The CSV header the harness writes (no newline). */
#define KVM_EVAL_CSV_HEADER \
    "doc,method,budget_tokens,ratio,kl_mean,kl_median,kl_p99,top1,ppl_full,ppl_compressed,seconds,dtype," \
    "bytes_compressed,decode_ms"

/* Splits "NAME[:ARG]" and finds the method: *m is the table row, *arg points into spec after
 * ':' or is NULL; the name is copied into name_buf. Returns 0, or KVM_EINVAL naming the
 * valid methods (unknown name, missing or unexpected ARG). */
int kvm_eval_method_parse(const char *spec, char *name_buf, size_t name_size, const kvm_method **m, const char **arg);

#endif
