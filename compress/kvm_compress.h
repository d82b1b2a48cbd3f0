/* kvm_compress.h: what every compression method (eviction patterns, KVSculpt, Select+Fit,
 * PolyKV strategies) receives and returns, so the evaluation harness, the CLI and the
 * pipeline's compress stage treat them alike. A method turns the full KV cache of a
 * document's N context tokens into a smaller ragged cache (model/kvm_kvcache.h): per
 * (layer, KV head) any number of entries, kept tokens with their positions and distilled
 * entries with KVM_POS_NONE and an optional logit bias. Decode then appends new tokens at
 * positions N, N+1, ... (cache->next_pos stays N). */
#ifndef KVM_COMPRESS_H
#define KVM_COMPRESS_H

#include "common/kvm_progress.h"
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
    const int32_t *tokens;     /* [n_tokens] the context's token ids, or NULL when the caller has none
                                  (then methods that run the model again, e.g. query_source repeat or
                                  continuation, refuse) */
    const int32_t *repeat_prompt; /* [n_repeat_prompt] tokens between the context and its repeat
                                  (query_source repeat); NULL/0: the model's BOS token alone */
    int64_t n_repeat_prompt;
    struct kvm_sculpt_qsets *qcache; /* optional (NULL = none): model query sets of this context kept
                                  across method calls (compress/sculpt/kvm_sculpt_qsource.h), so
                                  the extra forward passes of query_source run once per document;
                                  owned by the caller, results do not depend on it */
    kvm_progress *progress;    /* optional (NULL = none): methods that solve per (layer, KV head)
                                  problems count them here as they finish; results do not depend on it */
    const char *device;        /* optional (NULL = cpu): a stage worker's --device (cpu, cuda:N);
                                  kvm_worker_compress (pipeline/kvm_worker.h) sets the sculpt-family
                                  solvers' `device` setting from it; methods read their options */
} kvm_compress_input;

/* What a method reports about one run. */
typedef struct kvm_compress_stats {
    double seconds;            /* wall time of the method */
    int64_t entries;           /* entries kept over all (layer, KV head) */
} kvm_compress_stats;

/* A budget as the user gave it: exactly one of tokens (entries per (layer, KV head),
 * `--budget b`) or ratio (`--ratio r`, b = r·N) is set; the other is 0. */
typedef struct kvm_budget {
    int64_t tokens;            /* absolute entries per (layer, KV head), or 0 */
    double ratio;              /* fraction of the context N in (0, 1], or 0 */
} kvm_budget;

/* The entries per (layer, KV head) a budget means for a context of n_tokens: tokens, or
 * round(ratio·n_tokens) but at least 1. A budget ≥ N keeps everything
 * (methods clamp to the entries they have). */
int64_t kvm_budget_resolve(const kvm_budget *b, int64_t n_tokens);

/* A method's decode-phase policy: hooks registered on the forward while the continuation
 * is decoded over the compressed cache (e.g. an eviction pattern keeping each head within
 * its budget as tokens are appended). Owned by whoever made it; free with
 * kvm_decode_policy_free. */
typedef struct kvm_decode_policy {
    kvm_hooks hooks;           /* registered with kvm_forward_add_hooks; hooks.user == state */
    void *state;               /* the policy's own state */
    void (*state_free)(void *state); /* releases state (may be NULL) */
} kvm_decode_policy;

/* Frees a policy and its state. Accepts NULL and *p == NULL; sets *p = NULL. */
void kvm_decode_policy_free(kvm_decode_policy **p);

/* A compression method: makes the compressed cache of the context from `in` (borrowed,
 * valid during the call) and method options `opts` (from the method's opts_new). On success
 * *out is a new cache owned by the caller, shaped like in->full, with next_pos == N.
 * Returns 0 or a kvm_status with kvm_err's detail message. */
typedef int (*kvm_compress_fn)(const kvm_compress_input *in, const void *opts, kvm_kvcache **out);

/* One row of the method table (compress/eval/kvm_methods.c): what `--method NAME[:ARG]`
 * means. Adding a method is one row plus its opts_new. */
typedef struct kvm_method {
    const char *name;          /* "h2o", "polykv", "sculpt", ... (the part before ':') */
    int arg;                   /* 0: takes no ":ARG"; 1: ":ARG" optional; 2: ":ARG" required */
    const char *help;          /* one line for --help */
    /* Parses ARG (NULL when absent) and the budget into options for compress/decode_new,
     * for model config c. Returns 0 or KVM_EINVAL/KVM_ENOTFOUND/KVM_EFORMAT/KVM_ENOMEM with a
     * message naming the bad part. *opts is freed with opts_free. */
    int (*opts_new)(const char *arg, const kvm_budget *budget, const kvm_model_config *c, void **opts);
    void (*opts_free)(void *opts); /* accepts NULL */
    kvm_compress_fn compress;  /* the prefill-phase compression (never NULL) */
    /* The decode-phase policy for a continuation after `compressed` (made by compress from
     * `in`), or NULL in this slot when the method has none (then --phases both appends the
     * continuation's KV unchanged, as prefill does). Returns 0 or a kvm_status. */
    int (*decode_new)(const kvm_compress_input *in, const void *opts, const kvm_kvcache *compressed,
                      kvm_decode_policy **out);
} kvm_method;

/* The method named `name` (exact match on kvm_method.name), or NULL. The table is static
 * and read-only; rows live in compress/eval/kvm_methods.c. */
const kvm_method *kvm_method_find(const char *name);

/* The table: *n rows. */
const kvm_method *kvm_method_table(int *n);

#endif
