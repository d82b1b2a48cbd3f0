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
    double ppl_full;       /* exp(mean NLL of tokens N..N+T-1) under full KV */
    double ppl_compressed; /* the same under the compressed cache */
    double budget_tokens;  /* mean entries per (layer, KV head) of the compressed context cache */
    double ratio;          /* budget_tokens / N */
    double seconds;        /* wall time of the compression call */
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

/* Quantile q in [0, 1] of x[0..n) with linear interpolation between order statistics
 * (x is sorted in place). n ≥ 1. */
double kvm_eval_quantile(double *x, int64_t n, double q);

/* KL(p ‖ q) in nats of the softmax distributions of logits lp, lq [vocab] (double
 * accumulation; identical logits give exactly 0). */
double kvm_eval_kl(const float *lp, const float *lq, int vocab);

/* The CSV header the harness writes (no newline). */
#define KVM_EVAL_CSV_HEADER \
    "doc,method,budget_tokens,ratio,kl_mean,kl_median,kl_p99,top1,ppl_full,ppl_compressed,seconds"

/* Splits "NAME[:ARG]" and finds the method: *m is the table row, *arg points into spec after
 * ':' or is NULL; the name is copied into name_buf. Returns 0, or KVM_EINVAL naming the
 * valid methods (unknown name, missing or unexpected ARG). */
int kvm_eval_method_parse(const char *spec, char *name_buf, size_t name_size, const kvm_method **m, const char **arg);

#endif
