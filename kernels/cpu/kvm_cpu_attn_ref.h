/* kvm_cpu_attn_ref.h: the per-head attention kernel that the per-layer call
 * (kvm_kernels.attention) replaced, kept as a reference: tests compare the per-layer kernel
 * and its statistics against it, bench_forward measures old against new in one run. Not for
 * production paths: it materialises each head's [n_q][n_e] probability matrix. */
#ifndef KVM_CPU_ATTN_REF_H
#define KVM_CPU_ATTN_REF_H

#include "kernels/kvm_kernels.h"

/* One head's problem (the former kvm_attn_head): n_q queries against n_e entries of one KV
 * head, visibility and order as in kvm_attn_layer. */
typedef struct kvm_cpu_attn_head {
    const float *q;       /* [n_q][head_dim], row stride ldq floats (post-RoPE queries) */
    int64_t ldq;          /* floats between consecutive query rows */
    const int32_t *qpos;  /* [n_q] absolute positions of the queries */
    int64_t n_q;          /* number of queries */
    const float *k;       /* [n_e][head_dim] contiguous post-RoPE keys */
    const float *v;       /* [n_e][head_dim] contiguous values */
    const int32_t *pos;   /* [n_e] entry positions or KVM_POS_NONE */
    const float *bias;    /* [n_e] logit bias added to each score, or NULL for all zero */
    int64_t n_e;          /* number of entries */
    int head_dim;         /* d */
    float scale;          /* score scale, 1/sqrt(d) */
    float *out;           /* [n_q][head_dim], row stride ldo floats: softmax(qK^T)V */
    int64_t ldo;          /* floats between consecutive output rows */
    float *probs;         /* scratch [n_q][n_e] (row stride n_e); on return, when want_probs,
                             holds the attention probabilities, 0 at masked entries */
    int want_probs;       /* 1: every probs row must be complete; 0: scratch only (faster) */
} kvm_cpu_attn_head;

/* One head's attention, exactly as the CPU backend computed it before the per-layer call.
 * Returns 0, KVM_EINVAL (bad sizes), KVM_ENOMEM. */
int kvm_cpu_attn_head_ref(const kvm_cpu_attn_head *a);

/* The per-layer call computed head by head through kvm_cpu_attn_head_ref with an explicit
 * probability matrix per head (thread-local scratch [n_q][max n_e]), the statistics reduced
 * from it as the hooks did before: mass summed per query in order, entropy in double from
 * the row, obs copied rows; LSE recomputed in double from the scores. Same contract and
 * errors as kvm_kernels.attention (host memory), float32 entries only (KVM_ENOTSUP for f16). */
int kvm_cpu_attention_ref(const kvm_attn_layer *a);

#endif
