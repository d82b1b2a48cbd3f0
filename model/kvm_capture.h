/* kvm_capture.h: KV capture during prefill, built on the forward's hook points. After a
 * prefill of N tokens into an empty cache, each layer's post-RoPE keys and values, pre- and
 * post-RoPE queries and per-head attention statistics are available head-major
 * (kernels/LAYOUT.md) — what KVSculpt and the PolyKV signals consume. */
#ifndef KVM_CAPTURE_H
#define KVM_CAPTURE_H

#include "model/kvm_forward.h"

typedef struct kvm_capture_opts {
    int want_queries;  /* 1: keep pre- and post-RoPE queries (n_heads*N*head_dim floats each per layer) */
    int want_stats;    /* 1: keep attention entropy and received mass (the kernel's ENTROPY and MASS statistics) */
    int32_t mass_q0;   /* attention mass sums queries with position in [mass_q0, mass_q1) */
    int32_t mass_q1;   /* ≤ 0 means "to the end" (N) */
} kvm_capture_opts;

/* One layer's captured tensors, float32, head-major, owned by the capture. */
typedef struct kvm_capture_layer {
    float *k;       /* [n_kv_heads][N][head_dim] post-RoPE keys */
    float *v;       /* [n_kv_heads][N][head_dim] values */
    float *q_pre;   /* [n_heads][N][head_dim] queries before RoPE, or NULL */
    float *q;       /* [n_heads][N][head_dim] queries after RoPE, or NULL */
    float *entropy; /* [n_heads][N] entropy (nats) of query t's attention row, or NULL */
    float *mass;    /* [n_heads][N] attention received by key t, summed over the mass window, or NULL */
} kvm_capture_layer;

typedef struct kvm_capture kvm_capture;

/* Prepares a capture of n_tokens positions [0, n_tokens) for model config c. Register
 * kvm_capture_hooks(cap) on a forward, then prefill a fresh cache. Returns 0, KVM_EINVAL
 * (n_tokens ≤ 0, bad window), KVM_ENOMEM. */
int kvm_capture_new(const kvm_model_config *c, int64_t n_tokens, const kvm_capture_opts *o, kvm_capture **out);

/* Frees. Accepts NULL and *cap == NULL; sets *cap = NULL. */
void kvm_capture_free(kvm_capture **cap);

/* The hook set to pass to kvm_forward_add_hooks; valid while cap lives. Tokens at positions
 * outside [0, n_tokens) are ignored, so a capture may watch the context part of a longer
 * prefill. */
const kvm_hooks *kvm_capture_hooks(kvm_capture *cap);

/* Layer l's tensors (l in [0, n_layers)); valid while cap lives. */
const kvm_capture_layer *kvm_capture_layer_get(const kvm_capture *cap, int l);

/* Writable layer l, for building a capture from tensors received over the wire (the
 * compress stage); same buffers and shapes as kvm_capture_layer_get. */
kvm_capture_layer *kvm_capture_layer_mut(kvm_capture *cap, int l);

/* Copies positions [0, n) of every layer's tensors from src to dst (the same model config and
 * options, mass windows from the same first query and covering [0, n); n ≤ both captures' N):
 * keys, values, queries, entropy, and the mass those keys have received so far in src (the
 * caller's invariant: src has watched positions [0, n) only). Watching a prefill of positions [n, N') into a cache holding src's
 * first n entries then completes dst as one prefill of [0, N') would (the mass adds up over
 * calls): a shared prefix is prefilled once. Returns 0 or KVM_EINVAL (shapes, n). */
int kvm_capture_copy_prefix(kvm_capture *dst, const kvm_capture *src, int64_t n);

/* The options cap was made with, the mass window resolved ([mass_q0, mass_q1) within [0, N)):
 * what a capture filled by another route than the hooks must honour (kvm_capture_cuda_prefill). */
const kvm_capture_opts *kvm_capture_opts_get(const kvm_capture *cap);

/* Positions captured (N). */
int64_t kvm_capture_n_tokens(const kvm_capture *cap);

#endif
