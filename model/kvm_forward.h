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

/* What a hook sees at one layer's attention. Pointers are valid during the callback only. */
typedef struct kvm_attn_site {
    int layer;              /* layer index */
    kvm_phase phase;        /* prefill or decode */
    int64_t n_q;            /* tokens (queries) in this call */
    const int32_t *qpos;    /* [n_q] their absolute positions */
    const float *q;         /* [n_q][n_heads*head_dim] post-RoPE queries, token-major */
    const float *q_pre;     /* same, before RoPE; NULL unless a hook set want_q_pre */
    const float *k_new;     /* [n_q][n_kv_heads*head_dim] post-RoPE keys appended this call */
    const float *v_new;     /* [n_q][n_kv_heads*head_dim] values appended this call */
    kvm_kvcache *cache;     /* the cache; pre_attn may point it at another cache whose layer
                               `layer` the kernel then attends over (this call only) */
    /* post_attn only (called once per query head): */
    int head;               /* query head */
    int kv_head;            /* its KV head (GQA: head / (n_heads / n_kv_heads)) */
    const float *probs;     /* [n_q][n_e] attention probabilities over the head's entries */
    int64_t n_e;            /* entries of kv_head the kernel attended over */
    const float *out;       /* [n_q][head_dim] attention output of `head`, row stride ld_out */
    int64_t ld_out;         /* floats between output rows */
} kvm_attn_site;

/* A set of hooks. Each callback may be NULL; a non-zero return aborts the forward with that
 * status. Callbacks run on the calling thread, in layer order. */
typedef struct kvm_hooks {
    void *user;      /* passed to every callback */
    int want_q_pre;  /* 1 to receive pre-RoPE queries (costs one copy of q per layer) */
    int no_probs;    /* 1: post_attn reads only the outputs, never site->probs, so the kernel
                        need not write probabilities (faster, and the same arithmetic as a
                        forward without hooks) */
    /* After the call's K/V were appended to the layer's cache; may evict entries. */
    int (*cache_update)(void *user, kvm_attn_site *site);
    /* Before the attention kernel; may rewrite the cache or set site->cache to another. */
    int (*pre_attn)(void *user, kvm_attn_site *site);
    /* After the kernel, once per query head, with that head's probabilities and output. */
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

/* Registers a hook set (copied); hooks run in registration order. Returns 0 or KVM_EFULL
 * after KVM_FORWARD_MAX_HOOKS sets. */
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

/* Creates an empty cache shaped for model m with room for cap tokens per head. */
int kvm_forward_cache_new(const kvm_model *m, int64_t cap, kvm_kvcache **out);

#endif
