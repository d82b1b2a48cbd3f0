/* kvm_compress.h: what every compression method (eviction patterns, KVSculpt, Select+Fit,
 * PolyKV strategies) receives and returns, so the evaluation harness, the CLI and the
 * pipeline's compress stage treat them alike. A method turns the full KV cache of a
 * document's N context tokens into a smaller ragged cache (model/kvm_kvcache.h): per
 * (layer, KV head) any number of entries, kept tokens with their positions and distilled
 * entries with KVM_POS_NONE and an optional logit bias. Decode then appends new tokens at
 * positions N, N+1, ... (cache->next_pos stays N). */
#ifndef KVM_COMPRESS_H
#define KVM_COMPRESS_H

#include "model/kvm_capture.h"
#include "model/kvm_forward.h"

/* Everything a method may read about the context. All borrowed, valid during the call. */
typedef struct kvm_compress_input {
    const kvm_model *model;    /* the model (config, weights) */
    const kvm_kvcache *full;   /* full cache of the context: every head holds positions [0, N) */
    const kvm_capture *cap;    /* capture of the context prefill: keys, values, pre/post-RoPE
                                  queries, entropy and attention mass (window: all N queries) */
    int64_t n_tokens;          /* N */
    int64_t n_future;          /* tokens the caller expects to append (continuation length), a hint */
} kvm_compress_input;

/* What a method reports about one run. */
typedef struct kvm_compress_stats {
    double seconds;            /* wall time of the method */
    int64_t entries;           /* entries kept over all (layer, KV head) */
} kvm_compress_stats;

#endif
