/* kvm_eval_cuda.h: the evaluation harness (kvm_eval.h) of the eviction methods on a CUDA device
 * (issue 13): the context prefill with the patterns' statistics, the selection and the
 * compaction (kvm_cuda_model_evict), the decode-phase policy (--phases both) and the
 * teacher-forced continuation all run on the device; the full-KV reference is the device's own. CUDA builds only (KVM_WITH_CUDA). */
#ifndef KVM_EVAL_CUDA_H
#define KVM_EVAL_CUDA_H

#ifdef KVM_WITH_CUDA
#include "compress/eval/kvm_eval.h"
#include "compress/evict/kvm_evict.h"
#include "kernels/cuda/kvm_cuda.h"

typedef struct kvm_eval_cuda_doc kvm_eval_cuda_doc;

/* One document on the device: tokens[0, N + T) (BOS first; copied), the device model dm (a
 * cache of ≥ N + T entries, batches of ≥ N tokens; borrowed, outlives the doc) of the model
 * whose config is c. Computes the device's full-KV reference: the last context logits, then the
 * continuation N..N+T−2 in one batched call, as kvm_eval_doc_new does on the CPU. Errors:
 * KVM_EINVAL (lengths, a model too small for them), KVM_ENOMEM, the device's errors. */
int kvm_eval_cuda_doc_new(kvm_cuda_model *dm, const kvm_model_config *c, const int32_t *tokens, int64_t N, int64_t T,
                          kvm_eval_cuda_doc **out);

/* Frees. Accepts NULL and *d == NULL; sets *d = NULL. */
void kvm_eval_cuda_doc_free(kvm_eval_cuda_doc **d);

/* Scores eviction plan p (kvm_method_evict_plan) on the document: the device prefill keeping the
 * statistics, kvm_cuda_model_evict, the continuation over the compacted cache; with phases_both
 * (`--phases both`) the continuation runs token by token with the plan's decode-phase policy on
 * the device (kvm_cuda_model_decode_evict) and is compared with a token-by-token reference, as
 * kvm_eval_continue does with a method's decode policy. KL(full ‖ compressed), top-1 and
 * perplexities as kvm_eval_continue computes them (kvm_eval_score). r->seconds is the eviction
 * call's wall time; bytes_compressed and decode_ms are 0. Errors: KVM_EINVAL (plan shape),
 * KVM_ENOMEM, the device's errors. */
int kvm_eval_cuda_evict(kvm_eval_cuda_doc *d, const kvm_evict_plan *p, int phases_both, kvm_eval_result *r);

/* Scores a compressed context cache made on the host (borrowed: a float32 cache of the
 * context with next_pos == N, any method's, e.g. the compress stage's just-stored cache) on the
 * device, as kvm_eval_continue does without a decode policy: the cache uploaded as it is
 * (kvm_kvcache_cuda_upload: ragged heads, distilled entries, β), the continuation N..N+T−2
 * teacher-forced in one batched call; step 0 is the reference's own (the context's last
 * logits do not depend on the compression). Fills r as kvm_eval_continue does (KL(full ‖
 * compressed) against the device's full-KV reference, top-1, perplexities, budget and ratio);
 * seconds, bytes_compressed and decode_ms are 0. Errors: KVM_EINVAL (cache shape, next_pos,
 * an f16 cache), KVM_ENOMEM, the device's errors. */
int kvm_eval_cuda_continue(kvm_eval_cuda_doc *d, const kvm_kvcache *compressed, kvm_eval_result *r);

/* Mean KL(full ‖ compressed) of steps [t0, t1) of the last kvm_eval_cuda_continue / _evict on
 * d, as kvm_eval_kl_range on the host: NAN before any run or for a bad range. */
double kvm_eval_cuda_kl_range(const kvm_eval_cuda_doc *d, int64_t t0, int64_t t1);
#endif

#endif
