/* kvm_kernels.h: the compute interface the model forward uses, as one table of function
 * pointers per backend (ggml-backend style). CPU (OpenBLAS) is the reference; the CUDA
 * backend (kernels/cuda/) implements the same table over device memory.
 * Layout conventions are in kernels/LAYOUT.md. All pointers are backend memory: host
 * memory for CPU, device memory for CUDA. */
#ifndef KVM_KERNELS_H
#define KVM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Position of a KV entry that has none (a distilled KVSculpt entry). Such entries are
 * visible to every query. Only an in-memory marker; wire/disk formats encode it explicitly. */
#define KVM_POS_NONE ((int32_t)-1)

/* How RoPE pairs the entries of a head vector (a model property). */
typedef enum kvm_rope_style {
    KVM_ROPE_INTERLEAVED = 0, /* pairs (2i, 2i+1): llama2.c / Meta / GGUF "normal" */
    KVM_ROPE_HALF = 1,        /* pairs (i, i + d/2): Hugging Face rotate_half */
} kvm_rope_style;

/* One attention head's problem: n_q queries against n_e cache entries of one KV head.
 * Entry e is visible to query i iff pos[e] == KVM_POS_NONE or pos[e] <= qpos[i] (causal by
 * position). Entries must be sorted so that visible sets are prefixes: KVM_POS_NONE entries
 * first, then non-decreasing positions (the ragged KV cache keeps this order). */
typedef struct kvm_attn_head {
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
} kvm_attn_head;

/* A weight matrix W [out][in] prepared by a backend for Y = X · Wᵀ (packed panels on CPU,
 * device memory on CUDA). Opaque; made by weight_new, released by weight_free. */
typedef struct kvm_weight kvm_weight;

/* How a backend stores a prepared weight (kvm_weight). The GEMM widens 16-bit weights to
 * float32 as it reads them, so activations and sums stay float32 whatever this is. */
typedef enum kvm_weight_dtype {
    KVM_WEIGHT_F32 = 0,  /* IEEE binary32 */
    KVM_WEIGHT_BF16 = 1, /* bfloat16 (the top half of a binary32; 8-bit significand) */
    KVM_WEIGHT_F16 = 2,  /* IEEE binary16 (11-bit significand, |x| ≤ 65504) */
} kvm_weight_dtype;

/* Source of a weight matrix for weight_new_rows: fills dst [n][in] float32 (row-major) with
 * rows [r0, r0 + n) of W [out][in]. Returns 0 or a negative kvm_status (message set). */
typedef int (*kvm_weight_rows_fn)(void *ctx, int64_t r0, int64_t n, float *dst);

/* The backend table. Every function is thread-compatible (no shared mutable state) unless
 * noted. Errors: functions returning int give 0 or a negative kvm_status. */
typedef struct kvm_kernels {
    const char *name; /* "cpu", "cuda" */

    /* Backend memory: alloc returns zeroed memory or NULL; free accepts NULL. */
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    /* Copies between host and backend memory (memcpy on CPU). */
    int (*upload)(void *dst, const void *host_src, size_t bytes);
    int (*download)(void *host_dst, const void *src, size_t bytes);

    /* Row-major C[m][n] = alpha * op(A) op(B) + beta * C, op = transpose when trans_* != 0.
     * A is [m][k] (or [k][m] transposed) with row stride lda, B is [k][n] (or [n][k]) with
     * row stride ldb. A projection y = W x for a token batch X[n_tok][in] and weight
     * W[out][in] is sgemm(0, 1, n_tok, out, in, 1, X, in, W, in, 0, Y, out). */
    int (*sgemm)(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                 int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

    /* Prepares W [out][in] row-major host float32 (copied; the source may be unmapped after).
     * Returns NULL with kvm_errmsg set (KVM_ENOMEM) on failure. */
    kvm_weight *(*weight_new)(const float *w, int64_t out, int64_t in);
    void (*weight_free)(kvm_weight *w); /* accepts NULL */

    /* Prepares W [out][in] stored as dtype into *out, reading it a few rows at a time through
     * rows(ctx, ...) (so no float32 copy of the whole matrix is made); 16-bit storage rounds to
     * nearest even. NULL in a backend without it (the model then dequantises one matrix at a
     * time and calls weight_new). Returns 0, KVM_ENOMEM, KVM_ERANGE (a finite value beyond
     * f16's range; the message gives row and column), or rows' error. */
    int (*weight_new_rows)(kvm_weight_rows_fn rows, void *ctx, int64_t out, int64_t in, kvm_weight_dtype dtype,
                           kvm_weight **w);

    /* Y[m][out] = X[m][in] · Wᵀ, X row stride ldx, Y row stride ldy. Returns 0. */
    int (*matmul)(const float *x, int64_t m, int64_t ldx, const kvm_weight *w, float *y, int64_t ldy);

    /* out[r][:] = w ⊙ x[r][:] / sqrt(mean(x[r]^2) + eps), rows [0, n_rows), dim floats each. */
    void (*rmsnorm)(float *out, const float *x, const float *w, int64_t n_rows, int64_t dim, float eps);

    /* In-place RoPE on x [n_rows][row_stride]: each row holds n_heads head vectors of
     * head_dim floats from offset 0; row r is rotated at position pos[r]. cos/sin tables
     * [n_rows][head_dim/2] hold cos/sin(pos[r] * theta^(-2i/head_dim)) (kvm_rope_table). */
    void (*rope)(float *x, int64_t n_rows, int64_t row_stride, int n_heads, int head_dim, const float *cos_t,
                 const float *sin_t, kvm_rope_style style);

    /* gate[i] = silu(gate[i]) * up[i] for i in [0, n) (SwiGLU). */
    void (*swiglu)(float *gate, const float *up, int64_t n);

    /* x[i] += y[i] for i in [0, n) (residual). */
    void (*add)(float *x, const float *y, int64_t n);

    /* One head's attention (see kvm_attn_head). Returns 0 or KVM_EINVAL. */
    int (*attention)(const kvm_attn_head *a);
} kvm_kernels;

/* The CPU backend (OpenBLAS). Never NULL. */
const kvm_kernels *kvm_kernels_cpu(void);

/* The CUDA backend, or NULL (with kvm_errmsg set) when this build has no CUDA or no device
 * is present. */
const kvm_kernels *kvm_kernels_cuda(int device);

/* Selects a backend by name: "cpu" or "cuda:N". Returns 0 and *out, KVM_EINVAL for a bad
 * name, KVM_EDEVICE when CUDA is unavailable (message says why). */
int kvm_kernels_select(const char *device, const kvm_kernels **out);

/* Fills host tables cos_t/sin_t [n][head_dim/2] for positions pos[0..n) with llama2.c's
 * float32 recipe: freq_i = 1 / theta^(2i/head_dim), angle = pos * freq_i. */
void kvm_rope_table(const int32_t *pos, int64_t n, int head_dim, float theta, float *cos_t, float *sin_t);

/* Sets the number of threads the CPU backend uses for its kernels and BLAS (≥ 1). */
void kvm_kernels_cpu_set_threads(int n);

#endif
