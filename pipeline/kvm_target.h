/* kvm_target.h: [compress] target_kl in the pipeline (issue 14, item 5): per document, the
 * smallest budget whose KL(full ‖ compressed) on the tokens after the context stays within a
 * target, found by bisection over budgets with the configured method, and the cache made at
 * that budget (what `kvmill run` stores). No published system has it; the search itself is
 * compress/eval's kvm_eval_target_budget, as `kvmill eval --target-kl` runs it. */
#ifndef KVM_TARGET_H
#define KVM_TARGET_H

#include "compress/kvm_compress.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_devmodel.h"
#include "store/kvm_store.h"

#include <stdint.h>

/* What the search chose for one document. */
typedef struct kvm_target_result {
    int64_t budget;       /* entries per KV head of the returned cache */
    double kl_search;     /* mean KL(full ‖ compressed) per token, nats, on the search part at the
                             budget searched (see n_ctx_search) */
    double kl_check;      /* the same on the check part, never seen by the search; NAN without one */
    int reached;          /* 1 when kl_search ≤ target_kl (0: even the largest budget misses it) */
    int probes;           /* budgets evaluated */
    int nonmonotone;      /* probe pairs where KL rose with the budget (kvm_eval_target) */
    int64_t n_ctx_search; /* context the search ran on: N, or N − T when the document has fewer
                             than T tokens after its context (then the budget is scaled by N / (N − T)) */
} kvm_target_result;

/* Compresses the context in->tokens[0, n) (in: the job's prefill, n = in->n_tokens) at the
 * smallest budget (entries per KV head) whose mean KL on the search part is ≤ [compress]
 * target_kl (nats per token, > 0), T = [eval] continuation: budgets are multiples of [compress] target_step from the
 * smallest the method takes (sculpt methods: above the retain zone) up to n − 1, by bisection
 * (kvm_eval_target_budget). The search part is cont[0, T) when n_cont ≥ T, and cont[T, 2T) is
 * the check part when n_cont ≥ 2T; a document with n_cont < T searches with context n − T
 * and its own last T tokens, and its budget is scaled to the context n (rounded up to the
 * step, at most n − 1) and the cache is made from `in` at that budget. Each probe compresses
 * with [compress] budget set to the probe (kvm_worker_compress; c is restored before
 * returning, so its config id is the caller's) from a local prefill of the tokens and the
 * search part (the KL reference is the full KV of that prefill), and the probe at the chosen
 * budget is the cache returned. *out: new, next_pos = n. store / model_id as
 * kvm_worker_compress. dev (may be NULL: the host) is the worker's device forward
 * (pipeline/kvm_devmodel.h): on cuda:N the full-KV reference and every probe's continuation
 * run there (the probes' compression and the local prefill, which they read, stay on the
 * host); a model the device cannot run is searched on the host. Errors: KVM_EINVAL
 * (target_kl not set, a document too short for a search part: n ≤ T + 1), KVM_ENOMEM, the
 * method's and the forward's errors (KVM_EDEVICE on the device). */
/* The smallest budget the search of c's [compress] method tries (entries per KV head): the
 * first multiple of target_step, for sculpt methods the first one above the retain zone (their
 * budget includes it). kvm_jobcfg_check refuses a config whose smallest budget is not below
 * [model] context (the search would only have budget context − 1). */
int64_t kvm_target_lowest_budget(const kvm_config *c);

int kvm_target_compress(kvm_config *c, const kvm_compress_input *in, const int32_t *cont, int64_t n_cont,
                        kvm_store *store, const kvm_store_id *model_id, kvm_devmodel *dev, kvm_kvcache **out,
                        kvm_target_result *res);

#endif
