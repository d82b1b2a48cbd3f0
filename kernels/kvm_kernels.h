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

/* Element type of the KV cache's keys and values in host memory (the [model] kv_dtype setting).
 * Attention widens f16 entries to float32 as it reads them; scores, softmax and outputs stay
 * float32 whatever this is. */
typedef enum kvm_kv_dtype {
    KVM_KV_F32 = 0, /* IEEE binary32 */
    KVM_KV_F16 = 1, /* IEEE binary16 (11-bit significand, |x| ≤ 65504), stored as uint16_t bits */
} kvm_kv_dtype;

/* Statistics the attention kernel writes per query head when asked (kvm_attn_layer.stats,
 * OR of these flags). p_i[e] is query i's attention probability on entry e (0 where e is
 * masked), s_i[e] = scale·q_i·k_e + bias[e] its logit. They are what compression reads from
 * attention, so no probability matrix leaves the kernel (kernels/LAYOUT.md, "Per-layer
 * attention"). */
enum kvm_attn_stat {
    /* mass[h][e] = Σ p_i[e] over the queries i with qpos[i] in [mass_p0, mass_p1), summed in
     * query order in float32 from 0: the attention each key receives (H2O heavy hitters,
     * Zhang et al. 2023 §3; the capture's received mass). */
    KVM_ATTN_STAT_MASS = 1u << 0,
    /* entropy[h][i] = −Σ_e p_i[e] ln p_i[e] (nats, 0 for a query that sees no entry): PolyKV's
     * layer entropy signal. Taken from the softmax pass's own sums, ln Z − Σ x(s − m)/Z
     * (kvm_fb_entropy_finish), with no log per weight; within 1e-5 of the per-weight sum. */
    KVM_ATTN_STAT_ENTROPY = 1u << 1,
    /* lse[h][i] = ln Σ_e exp(s_i[e]) over the visible entries (−∞ when none): the
     * log-normaliser KVSculpt's references use. */
    KVM_ATTN_STAT_LSE = 1u << 2,
    /* obs[h][r][e] = p_i[e] for the last n_obs queries, i = n_q − n_obs + r: SnapKV /
     * PyramidKV's observation window (Li et al. 2024 Alg. 1); n_obs = 1 is TOVA's
     * last-query scores (Oren et al. 2024 §4). */
    KVM_ATTN_STAT_OBS = 1u << 3,
};

/* One layer's attention: every query head over its KV head's ragged cache (GQA: query head
 * h reads KV head h / (n_heads / n_kv_heads)), for prefill (n_q tokens, causal) and decode
 * (n_q = 1) alike. Entry e of KV head g is visible to query i iff pos[g][e] == KVM_POS_NONE
 * or pos[g][e] <= qpos[i]. Each head's entries must be sorted so that visible sets are
 * prefixes: KVM_POS_NONE entries first, then non-decreasing positions (the ragged KV cache
 * keeps this order). out_h,i = Σ_e p_i[e] v_e with p_i = softmax_e(scale·q_h,i·k_e + bias[e])
 * over the visible entries (0 when none is visible).
 *
 * Memory: the descriptor and its per-KV-head arrays (k, v, pos, bias, n_e) are host memory,
 * read during the call only; every tensor they point at, and q, qpos, out and the statistics
 * buffers, are backend memory (host for CPU, device for CUDA), allocated by the caller
 * (kvm_kernels.alloc) and never retained by the kernel. Buffers of statistics not asked for
 * may be NULL. Rows of mass/obs are ld_e floats; entries [n_e[g], ld_e) of a row are set to 0. */
typedef struct kvm_attn_layer {
    int n_heads;              /* query heads, a multiple of n_kv_heads */
    int n_kv_heads;           /* KV heads */
    int head_dim;             /* d */
    float scale;              /* score scale, 1/sqrt(d) */
    const float *q;           /* [n_q][ldq] post-RoPE queries, token-major: head h of query i at q + i·ldq + h·d */
    int64_t ldq;              /* floats between query rows, ≥ n_heads·d */
    const int32_t *qpos;      /* [n_q] absolute positions of the queries */
    int64_t n_q;              /* queries (0: nothing to do) */
    const float *const *k;    /* [n_kv_heads] host array; k[g] is [n_e[g]][d] contiguous post-RoPE keys */
    const float *const *v;    /* [n_kv_heads]; v[g] is [n_e[g]][d] contiguous values */
    kvm_kv_dtype kv_dtype;    /* KVM_KV_F32 (0): k and v are read; KVM_KV_F16: k16 and v16 are (CPU only) */
    const uint16_t *const *k16; /* KVM_KV_F16: [n_kv_heads]; k16[g] is [n_e[g]][d] f16 keys (k unused) */
    const uint16_t *const *v16; /* KVM_KV_F16: [n_kv_heads]; v16[g] is [n_e[g]][d] f16 values (v unused) */
    const int32_t *const *pos;/* [n_kv_heads]; pos[g] is [n_e[g]] entry positions or KVM_POS_NONE */
    const float *const *bias; /* [n_kv_heads] or NULL (all zero); bias[g] is [n_e[g]] logit bias β or NULL */
    const int64_t *n_e;       /* [n_kv_heads] host array: entries of each KV head (ragged) */
    float *out;               /* [n_q][ldo] outputs, head h of query i at out + i·ldo + h·d */
    int64_t ldo;              /* floats between output rows, ≥ n_heads·d */

    unsigned stats;           /* OR of kvm_attn_stat; 0 = outputs only (the fast path) */
    int32_t mass_p0, mass_p1; /* MASS: sum over queries with qpos in [mass_p0, mass_p1) */
    int64_t n_obs;            /* OBS: rows kept, in [1, n_q] */
    int64_t ld_e;             /* MASS/OBS row length, ≥ max_g n_e[g] */
    float *mass;              /* MASS: [n_heads][ld_e] */
    float *entropy;           /* ENTROPY: [n_heads][n_q] */
    float *lse;               /* LSE: [n_heads][n_q] */
    float *obs;               /* OBS: [n_heads][n_obs][ld_e] */
} kvm_attn_layer;

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

    /* One layer's attention with the statistics asked for (see kvm_attn_layer), one call
     * for all heads. Returns 0, KVM_EINVAL (bad sizes: n_q < 0, n_e < 0, d ≤ 0, n_heads not
     * a multiple of n_kv_heads, ld* too small, a statistic asked for without its buffer,
     * n_obs outside [1, n_q], an unknown kv_dtype, f16 without k16/v16), KVM_ENOMEM (scratch),
     * KVM_ENOTSUP (f16 K/V on CUDA, whose forward keeps its own float32 cache), or on CUDA
     * KVM_EDEVICE with the failing call and device in kvm_errmsg. Outputs and statistics are
     * undefined on error. */
    int (*attention)(const kvm_attn_layer *a);
} kvm_kernels;

/* The CPU backend (OpenBLAS). Never NULL. */
const kvm_kernels *kvm_kernels_cpu(void);

/* The CUDA backend, or NULL (with kvm_errmsg set) when this build has no CUDA or no device
 * is present. */
const kvm_kernels *kvm_kernels_cuda(int device);

/* Parses a device name: "cpu" (or NULL) gives *cuda_index = -1, "cuda:N" gives N, N a decimal
 * in [0, 255]. Says nothing of whether the device exists (kvm_kernels_select does). Returns 0,
 * or KVM_EINVAL with "NAME: not cpu or cuda:N (N a device index in [0, 255])" in kvm_errmsg. */
int kvm_device_parse(const char *device, int *cuda_index);

/* Selects a backend by name: "cpu" or "cuda:N" (kvm_device_parse). Returns 0 and *out, KVM_EINVAL for a bad
 * name, KVM_EDEVICE when CUDA is unavailable (message says why). The message starts with the
 * name ("cuda:abc: not cpu or ...", "cuda:0: no CUDA device ..."): callers prefix the option only. */
int kvm_kernels_select(const char *device, const kvm_kernels **out);

/* Fills host tables cos_t/sin_t [n][head_dim/2] for positions pos[0..n) with llama2.c's
 * float32 recipe: freq_i = 1 / theta^(2i/head_dim), angle = pos * freq_i. */
void kvm_rope_table(const int32_t *pos, int64_t n, int head_dim, float theta, float *cos_t, float *sin_t);

/* dst[i] = src[i] rounded to IEEE binary16 (nearest even; beyond ±65504 gives ±inf, NaN stays
 * NaN) for i in [0, n): host memory, F16C where the processor has it. The f16 KV cache's
 * append path; bit for bit proto/kvm_half.h's kvm_half_f32_to_f16. */
void kvm_f16_round(uint16_t *dst, const float *src, int64_t n);

/* dst[i] = src[i] (IEEE binary16 bits) widened to float32, exact, for i in [0, n): host memory. */
void kvm_f16_widen(float *dst, const uint16_t *src, int64_t n);

/* Sets the number of threads the CPU backend's pool uses for its kernels (≥ 1). OpenBLAS stays
 * single-threaded (kernels/cpu/kvm_cpu.c: its idle server threads spin on a core). */
void kvm_kernels_cpu_set_threads(int n);

#endif
