/* kvm_forward.h: the transformer forward over a ragged KV cache, with hook points that
 * compression code registers without editing the model: on cache update, before and after
 * the attention kernel of every layer. Prefill runs a whole token batch through GEMMs;
 * decode runs one token against the cache. New tokens get positions cache->next_pos, ...:
 * positions are never renumbered, whatever was evicted or distilled before. */
#ifndef KVM_FORWARD_H
#define KVM_FORWARD_H

#include "kernels/kvm_kernels.h"
#include "model/kvm_kvcache.h"
#include "model/kvm_model.h"

typedef enum kvm_phase {
    KVM_PHASE_PREFILL = 0, /* a batch of context tokens */
    KVM_PHASE_DECODE = 1,  /* one generated token at a time */
} kvm_phase;

/* What a hook sees at one layer's attention. Pointers are valid during the callback only.
 * Tensors (q, q_pre, k_new, v_new and everything attn points at) are in the backend's memory
 * (host memory on the CPU backend, device memory on CUDA): host code reads them through an
 * explicit site->kernels->download into its own buffer. */
typedef struct kvm_attn_site {
    int layer;              /* layer index */
    kvm_phase phase;        /* prefill or decode */
    const kvm_kernels *kernels; /* the backend holding the tensors (download) */
    int64_t n_q;            /* tokens (queries) in this call */
    const int32_t *qpos;    /* [n_q] their absolute positions (host memory) */
    const float *q;         /* [n_q][n_heads*head_dim] post-RoPE queries, token-major */
    const float *q_pre;     /* same, before RoPE; NULL unless a hook set want_q_pre */
    const float *k_new;     /* [n_q][n_kv_heads*head_dim] post-RoPE keys appended this call */
    const float *v_new;     /* [n_q][n_kv_heads*head_dim] values appended this call */
    kvm_kvcache *cache;     /* the cache; pre_attn may point it at another cache whose layer
                               `layer` the kernel then attends over (this call only) */
    /* post_attn only (called once per layer, after the kernel): the call just made, with
     * its outputs (attn->out, [n_q][ldo], all query heads) and the statistics the hooks
     * asked for (kvm_hooks.stats; attn->n_e[g] entries of KV head g of site->cache, rows
     * attn->ld_e long). NULL in the other callbacks. */
    const kvm_attn_layer *attn;
} kvm_attn_site;

/* A set of hooks. Each callback may be NULL; a non-zero return aborts the forward with that
 * status. Callbacks run on the calling thread, in layer order. */
typedef struct kvm_hooks {
    void *user;      /* passed to every callback */
    int want_q_pre;  /* 1 to receive pre-RoPE queries (costs one copy of q per layer) */
    /* Statistics post_attn reads (OR of kvm_attn_stat, kernels/kvm_kernels.h); 0 = outputs
     * only, the same arithmetic as a forward without hooks. Asking for MASS, ENTROPY or OBS
     * makes the kernel normalise probabilities before the value product (outputs differ from
     * the plain path by float rounding only). */
    unsigned stats;
    /* MASS: the window of query positions summed, [mass_p0, mass_p1); mass_p1 ≤ mass_p0
     * means every query. Hook sets asking for MASS must agree on it. */
    int32_t mass_p0, mass_p1;
    int64_t n_obs;   /* OBS: rows of the last queries wanted (the forward passes the largest
                        any hook asks for, clamped to n_q; a hook wanting r reads the last r) */
    /* After the call's K/V were appended to the layer's cache; may evict entries. */
    int (*cache_update)(void *user, kvm_attn_site *site);
    /* Before the attention kernel; may rewrite the cache or set site->cache to another. */
    int (*pre_attn)(void *user, kvm_attn_site *site);
    /* After the kernel, once per layer, with every head's outputs and statistics. It may
     * overwrite rows of site->attn->out (backend memory, through site->kernels->upload): the
     * output projection reads them afterwards. */
    int (*post_attn)(void *user, const kvm_attn_site *site);
} kvm_hooks;

typedef struct kvm_forward kvm_forward;

enum { KVM_FORWARD_MAX_HOOKS = 8 };

/* Which rows of logits a call writes. */
typedef enum kvm_logits_mode {
    KVM_LOGITS_NONE = 0, /* skip the classifier */
    KVM_LOGITS_LAST = 1, /* logits[vocab] of the last token */
    KVM_LOGITS_ALL = 2,  /* logits[n][vocab], one row per token */
} kvm_logits_mode;

/* Creates a forward context for model m (borrowed; must outlive the context) on backend k
 * (NULL = CPU). max_batch bounds the tokens processed per GEMM batch (longer prefills run
 * in chunks of max_batch; ≤ 0 means the model's seq_len). Returns 0, KVM_ENOMEM. */
int kvm_forward_new(const kvm_model *m, const kvm_kernels *k, int64_t max_batch, kvm_forward **out);

/* Frees the context. Accepts NULL and *f == NULL; sets *f = NULL. */
void kvm_forward_free(kvm_forward **f);

/* Registers a hook set (copied); hooks run in registration order. Returns 0, KVM_EFULL
 * after KVM_FORWARD_MAX_HOOKS sets, KVM_EINVAL when its MASS window differs from that of a
 * hook set already registered. */
int kvm_forward_add_hooks(kvm_forward *f, const kvm_hooks *h);

/* Removes every hook set. */
void kvm_forward_clear_hooks(kvm_forward *f);

/* Prefill: runs tokens[0..n) at positions cache->next_pos + i, appends their K/V to every
 * (layer, KV head) of cache, advances next_pos by n, and writes logits per mode (logits is
 * [vocab] for LAST, [n][vocab] for ALL, may be NULL for NONE). Errors: KVM_EINVAL (token id
 * out of range, cache shape not the model's, n ≤ 0), KVM_ERANGE (positions would pass
 * INT32_MAX), KVM_ENOMEM, or a hook's status. On error the cache may hold a partial step. */
int kvm_forward_prefill(kvm_forward *f, kvm_kvcache *cache, const int32_t *tokens, int64_t n, float *logits,
                        kvm_logits_mode mode);

/* Decode: one token against the cache (same as prefill with n = 1, phase DECODE); writes
 * logits[vocab]. Same errors as prefill. */
int kvm_forward_decode(kvm_forward *f, kvm_kvcache *cache, int32_t token, float *logits);

/* Several independent sequences in one call, each over its own cache (batched decoding of
 * many requests, as a server batches them): sequence s runs tokens[s][0..n[s]) at positions
 * caches[s]->next_pos + i, attends over caches[s] alone, appends its K/V there and advances its
 * next_pos by n[s]. Every projection is one GEMM over all sequences' rows, so the weights are
 * read once per call rather than once per sequence: what makes answering one question over
 * many compressed caches cheap where the forward is bound by reading weights (small batches on
 * a CPU). logits (may be NULL) gets the last n_logits[s] rows of each sequence (0 ≤
 * n_logits[s] ≤ n[s]; n_logits NULL: none), sequence-major, [Σ n_logits][vocab]. The rows
 * run in chunks of max_batch, which may cut a sequence (its rest runs in the next chunk, over
 * its cache holding the part before). A row's logits equal those of the sequence run alone up
 * to float32 rounding (a row's sums depend on its place in the GEMM's register tiles). Runs as
 * a prefill (phase PREFILL). The caches (distinct) and tokens are borrowed. Errors, all before
 * any cache changes: KVM_EINVAL (n_seq < 1, a hook set registered — hooks see one cache per
 * call —, two sequences on one cache, an n_logits outside [0, n[s]], and per sequence what
 * prefill refuses, naming the sequence), KVM_ERANGE, KVM_ENOTSUP (the model's window); then
 * KVM_ENOMEM or a kernel's status, after which the caches may hold a partial step. */
int kvm_forward_multi(kvm_forward *f, kvm_kvcache *const *caches, const int32_t *const *tokens, const int64_t *n,
                      int n_seq, const int64_t *n_logits, float *logits);

/* One layer's attention step exactly as prefill (phase PREFILL) or decode (DECODE, n = 1)
 * runs it, without the rest of the model: appends k_new/v_new [n][n_kv_heads·head_dim]
 * (post-RoPE) at positions qpos[n] to every KV head of `layer` of cache, runs the registered
 * hooks' cache_update and pre_attn, the attention kernel over q [n][n_heads·head_dim]
 * (post-RoPE) with the statistics the hooks ask for, and post_attn, and writes the attention
 * outputs (before the output projection) to out [n][n_heads·head_dim]. All arrays are host
 * memory (the forward runs on the CPU backend). cache->next_pos is not advanced. Lets a
 * caller replay one layer of a token-by-token decode from the queries and keys of another
 * run at the cost of that layer's attention alone (PolyKV's decode-phase signals,
 * compress/polykv/kvm_polykv_calibrate.c). Errors: KVM_EINVAL (layer, n outside
 * [1, max_batch], cache shape, a hook wanting pre-RoPE queries), KVM_ENOMEM, a hook's status. */
int kvm_forward_attend(kvm_forward *f, kvm_kvcache *cache, int layer, kvm_phase phase, const float *q,
                       const float *k_new, const float *v_new, const int32_t *qpos, int64_t n, float *out);

/* Creates an empty float32 cache shaped for model m with room for cap tokens per head (grows on
 * demand; free with kvm_kvcache_free). Returns 0, KVM_EINVAL (cap < 0), KVM_ENOMEM. */
int kvm_forward_cache_new(const kvm_model *m, int64_t cap, kvm_kvcache **out);

/* The same with keys and values of element type dtype ([model] kv_dtype; f16 halves the cache,
 * the forward rounds each new token's keys and values once as it appends them). Returns 0,
 * KVM_EINVAL (unknown dtype), KVM_ENOMEM. */
int kvm_forward_cache_new_dtype(const kvm_model *m, int64_t cap, kvm_kv_dtype dtype, kvm_kvcache **out);

#endif
