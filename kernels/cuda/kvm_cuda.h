/* kvm_cuda.h: the CUDA backend's C interface beyond the kvm_kernels table (issue 13): weight
 * dtype, memory plan, embedding/classifier launches, the upload's dequantisation, layer attention
 * over a device-resident ragged KV cache with the statistics compression reads, and a
 * device-resident Llama forward (kvm_cuda_model) with the prefill phase's eviction on the device,
 * for `generate` and `eval --device cuda:N`, the CUDA tests and the device benchmark.
 * Compiled only where nvcc is (KVM_WITH_CUDA); callers guard with #ifdef KVM_WITH_CUDA.
 * Every pointer named "device" is device memory of the backend's device; every function
 * returns 0 or a negative kvm_status with kvm_errmsg naming the failing CUDA/cuBLAS call and
 * the device. Layout conventions: kernels/LAYOUT.md. */
#ifndef KVM_CUDA_H
#define KVM_CUDA_H

#include "kernels/kvm_kernels.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { KVM_CUDA_MAX_DEVICES = 8, KVM_CUDA_MAX_HEAD_DIM = 256 };

/* Number of visible CUDA devices (0 when the driver or runtime is absent). */
int kvm_cuda_device_count(void);

/* Storage dtype of weights made by weight_new on the CUDA tables: float32 (parity runs), bf16
 * or f16 (cublasGemmEx with float32 accumulation). Process-wide; affects later weight_new. */
typedef enum kvm_cuda_wdtype { KVM_CUDA_F32 = 0, KVM_CUDA_BF16 = 1, KVM_CUDA_F16 = 2 } kvm_cuda_wdtype;
void kvm_cuda_set_weight_dtype(kvm_cuda_wdtype t);
/* The dtype set last (KVM_CUDA_F32 until set). */
kvm_cuda_wdtype kvm_cuda_weight_dtype(void);
/* Bytes per weight element in dtype t: 4 (f32) or 2 (bf16, f16). */
size_t kvm_cuda_wdtype_bytes(kvm_cuda_wdtype t);

/* Memory plan check: fails with KVM_ENOMEM, naming `what`, the bytes needed and the bytes free
 * on the device (cudaMemGetInfo), when `bytes` does not fit with a 256 MiB reserve for cuBLAS
 * workspace and the runtime. Called before any allocation of a plan. */
int kvm_cuda_plan_fits(int device, size_t bytes, const char *what);

/* out[r][0, dim) = table[tok[r]][0, dim) for r in [0, n); table [vocab][dim] float32 device,
 * tok [n] int32 device (checked on the host beforehand). */
int kvm_cuda_embed(int device, float *out, const float *table, const int32_t *tok, int64_t n, int64_t dim);

/* Fills x[0, n) device float32 with uniform values in [−a, a) from (seed, index) (a counter
 * hash, so the same seed gives the same tensor on every device): random-weight benchmark models. */
int kvm_cuda_fill_uniform(int device, float *x, int64_t n, uint64_t seed, float a);

/* The upload's dequantisation alone (the CUDA tests' check of what the device computes):
 * rows × in elements of raw ggml rows of `type` (host, kvm_qb_row_bytes(type, in) bytes each) are
 * copied to the device, dequantised there one element per thread by kernels/kvm_quant_body.h
 * and copied back to host dst [rows][in] float32. Errors: KVM_ENOTSUP (a type kvmill cannot
 * dequantise, rows not whole blocks), KVM_EDEVICE. */
int kvm_cuda_dequantize(int device, float *dst, const void *raw, int type, int64_t rows, int64_t in);

/* One layer's attention over a device-resident ragged cache, all query heads at once (GQA:
 * head h reads KV head h / (n_heads / n_kv_heads)). The descriptor follows kvm_attn_layer of the
 * per-layer kernel interface (lane fwd13, kernels/kvm_kernels.h there; same field names and
 * meanings) so that the table's attention is this call once that interface is in the build.
 * Host memory: the descriptor and its per-KV-head arrays k, v, pos, bias, n_e (at most
 * KVM_CUDA_MAX_KV_HEADS). Device memory: what those arrays point at (k[g], v[g] [n_e[g]][d];
 * pos[g] [n_e[g]] int32, KVM_POS_NONE for distilled entries, sorted so visible sets are prefixes;
 * bias[g] [n_e[g]] logit bias β or NULL), q [n_q][ldq] and out [n_q][ldo] token-major (head h at
 * h·d, post-RoPE), qpos [n_q] and the statistics. Tiled online softmax (kvm_fb_attn_tile): no
 * n_q × n_e matrix exists anywhere. Statistics (stats, OR of KVM_CUDA_STAT_*) come from a second
 * pass that recomputes each score against its row's LSE:
 *   MASS     mass[n_heads][ld_e]       Σ p_i[e] over queries with qpos in [mass_p0, mass_p1)
 *                                      (H2O accumulated attention; SnapKV/PyramidKV window votes)
 *   ENTROPY  entropy[n_heads][n_q]     −Σ p ln p, nats, from sums accumulated in double
 *                                      (kvm_fb_entropy_finish: no log per weight)
 *   LSE      lse[n_heads][n_q]         ln Σ exp(score), −inf when nothing is visible
 *   OBS      obs[n_heads][n_obs][ld_e] probability rows of the last n_obs queries (TOVA: n_obs 1)
 * Rows of mass/obs are ld_e ≥ max n_e[g] floats; entries past a head's n_e are 0. Unlike the CPU's
 * float32 in-order sums, MASS is summed with atomicAdd (order not fixed: float rounding only).
 * Returns KVM_EINVAL for bad sizes (head_dim > KVM_CUDA_MAX_HEAD_DIM, n_heads not a multiple of
 * n_kv_heads, a statistic without its buffer, n_obs outside [1, n_q], ld_e < n_e), KVM_EDEVICE. */
enum { KVM_CUDA_MAX_KV_HEADS = 32 };
enum kvm_cuda_attn_stat {
    KVM_CUDA_STAT_MASS = 1u << 0,
    KVM_CUDA_STAT_ENTROPY = 1u << 1,
    KVM_CUDA_STAT_LSE = 1u << 2,
    KVM_CUDA_STAT_OBS = 1u << 3,
};
typedef struct kvm_cuda_attn_layer {
    int n_heads, n_kv_heads, head_dim;
    float scale;
    const float *q;
    int64_t ldq;
    const int32_t *qpos;
    int64_t n_q;
    const float *const *k, *const *v;
    const int32_t *const *pos;
    const float *const *bias;
    const int64_t *n_e;
    float *out;
    int64_t ldo;
    unsigned stats;
    int32_t mass_p0, mass_p1;
    int64_t n_obs, ld_e;
    float *mass, *entropy, *lse, *obs;
} kvm_cuda_attn_layer;
int kvm_cuda_attention_layer(int device, const kvm_cuda_attn_layer *a);

/* A weight matrix [out][in] as its file stores it: host rows of kvm_qb_row_bytes(type, in) bytes
 * each (any alignment; a file's read-only mapping will do), in a ggml type of
 * kernels/kvm_quant_body.h (F32, F16, BF16 or a GGUF block type), in a multiple of its block. The
 * upload copies these bytes and dequantises them on the device. data NULL: a random matrix. */
typedef struct kvm_cuda_mat {
    const void *data; /* [out][row bytes], host, read during kvm_cuda_model_new only */
    int type;         /* ggml type number (kvm_qb_type) */
} kvm_cuda_mat;

/* A Llama model's shape and, optionally, its host tensors (tok_emb.data NULL: random weights
 * made on the device from seed, uniform in ±1/sqrt(in), embedding ±1, norms 1). Matrices are
 * kvm_cuda_mat in the file's own type; vectors are float32. Per-layer tensors are arrays of
 * n_layers entries; the optional ones (biases, QK-norm) are NULL arrays or NULL entries when
 * absent. rope_table (NULL: kvm_rope_table with rope_theta) fills the host cos/sin tables
 * [n][head_dim/2] for positions pos[0, n) (the model's own recipe, RoPE scaling included);
 * rope_ctx is passed to it. */
typedef struct kvm_cuda_model_desc {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, hidden_dim, vocab_size;
    float norm_eps, rope_theta;
    kvm_rope_style rope_style;
    uint64_t seed;
    kvm_cuda_mat tok_emb, wcls;                    /* [vocab][dim] each (wcls may repeat tok_emb) */
    const float *rms_final;                        /* [dim] */
    const float *const *rms_att, *const *rms_ffn;  /* [dim] each */
    const kvm_cuda_mat *wq, *wk, *wv, *wo;         /* [n_layers] matrices [out][in] */
    const kvm_cuda_mat *w1, *w2, *w3;
    const float *const *bq, *const *bk, *const *bv, *const *bo; /* optional biases */
    const float *const *q_norm, *const *k_norm;                 /* optional [head_dim] */
    void (*rope_table)(const void *rope_ctx, const int32_t *pos, int64_t n, float *cos_t, float *sin_t);
    const void *rope_ctx;
} kvm_cuda_model_desc;

typedef struct kvm_cuda_model kvm_cuda_model;

/* Bytes of device memory a model, a cache of `ctx` entries per KV head and activations for
 * batches of `max_batch` tokens need with weights in `t` (the memory plan): the weights in t
 * (the embedding table in float32), the cache, the activations, and one upload buffer as large
 * as the largest matrix's file bytes (random models: its float32 values). */
size_t kvm_cuda_model_bytes(const kvm_cuda_model_desc *d, kvm_cuda_wdtype t, int64_t ctx, int64_t max_batch);

/* Makes the device model: checks the shape and every matrix's type, checks the plan
 * (kvm_cuda_plan_fits), then allocates everything once with cudaMalloc and uploads (or
 * generates) the weights: each matrix's file bytes are copied into the upload buffer and
 * dequantised on the device into t (kvm__cuda_dequant: the loader's kernels/kvm_quant_body.h
 * per element), so no float32 copy of a matrix exists in host memory. Owns its memory; free
 * with kvm_cuda_model_free. Errors: KVM_EINVAL (shape beyond KVM_CUDA_MAX_HEAD_DIM / the
 * attention's KV-head limit), KVM_ENOTSUP (a matrix type kvmill cannot dequantise, or rows not
 * whole blocks: the message names the matrix), KVM_ENOMEM (the plan does not fit: the message
 * gives bytes needed and free), KVM_EDEVICE (a CUDA or cuBLAS call, named). */
int kvm_cuda_model_new(int device, const kvm_cuda_model_desc *d, kvm_cuda_wdtype t, int64_t ctx,
                       int64_t max_batch, kvm_cuda_model **out);
/* Frees the device model and its device memory; accepts NULL and *m == NULL; sets *m = NULL. */
void kvm_cuda_model_free(kvm_cuda_model **m);

/* Empties the cache (next position 0). */
void kvm_cuda_model_reset(kvm_cuda_model *m);

/* Runs tokens[0, n) (host int32, ids checked) at the next positions in batches of max_batch,
 * appending K/V to the device cache. logits (host, may be NULL): [vocab] of the last token when
 * last_only, else [n][vocab]. stats (may be NULL): asks the last batch's statistics of every
 * layer (kvm_cuda_attention_layer), copied to host arrays [n_layers][n_heads][rows]: lse and
 * entropy rows = that batch's tokens; key_mass (Σ over the batch's queries from index win0 on)
 * and last_p (the last query's probabilities) rows = ctx floats (the entries of the query head's
 * KV head, 0 past its count). q_pre and q_post (may be NULL; else [n_layers] host pointers, each
 * entry NULL to skip that layer) receive layer l's queries of that batch head-major
 * [n_heads][rows][head_dim] (rows = the batch's tokens): before RoPE (after the biases and
 * QK-norm, where the host forward's want_q_pre hook reads them) and after it — the prefill
 * stage's KV capture (model/kvm_forward_cuda.h). */
typedef struct kvm_cuda_stats {
    float *lse, *entropy, *key_mass, *last_p; /* host, each NULL to skip */
    int64_t win0;
    float *const *q_pre, *const *q_post;
} kvm_cuda_stats;
int kvm_cuda_model_forward(kvm_cuda_model *m, const int32_t *tokens, int64_t n, float *logits, int last_only,
                           kvm_cuda_stats *stats);

/* The cache's entries per KV head (ctx) and the largest batch (max_batch) m was made with. */
void kvm_cuda_model_capacity(const kvm_cuda_model *m, int64_t *ctx, int64_t *max_batch);

/* Entries per KV head in the cache, and a copy of layer l's KV head g keys/values to host
 * k[n][head_dim], v[n][head_dim] (K/V capture; each may be NULL). */
int64_t kvm_cuda_model_cache_len(const kvm_cuda_model *m);
int kvm_cuda_model_download_kv(const kvm_cuda_model *m, int layer, int g, float *k, float *v);

/* Replaces layer l's KV head g cache by host entries k, v [n][d], pos [n], bias [n] (sorted as
 * above; n ≤ ctx): a compressed ragged cache to decode over. Heads may hold different counts. */
int kvm_cuda_model_set_kv(kvm_cuda_model *m, int layer, int g, const float *k, const float *v, const int32_t *pos,
                          const float *bias, int64_t n);

/* Layer l's KV head g positions to host pos[n] (n = its entry count), e.g. after
 * kvm_cuda_model_evict. KVM_EINVAL for a head outside the model, KVM_EDEVICE. */
int kvm_cuda_model_download_pos(const kvm_cuda_model *m, int layer, int g, int32_t *pos);

/* Device eviction for the prefill phase (issue 13). keep_evict_stats asks the next forward (that
 * one only) to keep, for every layer on the device, the statistics the prefill eviction patterns
 * read: each query head's received mass summed over all the forward's queries (H2O) and the
 * probability rows of its last n_obs queries (TOVA: 1; SnapKV/PyramidKV: their window),
 * [n_layers] × (n_heads·ctx + n_heads·n_obs·ctx) floats, plus the selection's scratch; allocated
 * at the first call (the plan checked with kvm_cuda_plan_fits; again when n_obs changes), freed
 * with the model. That forward must be the context's whole prefill in one batch over an empty
 * cache (n ≤ max_batch, n ≥ n_obs) and asks no kvm_cuda_stats, else it fails with KVM_EINVAL.
 * n_obs 0 cancels the request (the buffers stay). Errors: KVM_EINVAL (n_obs outside [0, ctx]),
 * KVM_ENOMEM (does not fit: bytes needed and free), KVM_EDEVICE. */
int kvm_cuda_model_keep_evict_stats(kvm_cuda_model *m, int64_t n_obs);

/* Which pattern and budget each (layer, KV head) gets: kvm_evict_plan's contents
 * (compress/evict/kvm_evict.h) without its module (kernels know nothing of compress). */
typedef struct kvm_cuda_evict_plan {
    const uint8_t *pattern;  /* [n_layers][n_kv_heads]: 0 streaming, 1 h2o, 2 tova, 3 snapkv, 4 pyramidkv, 255 none */
    const int64_t *budget;   /* [n_layers][n_kv_heads] entries kept, ≥ 1 */
    int64_t sinks, window, pool; /* kvm_evict_params */
    double recent_frac;
} kvm_cuda_evict_plan;

/* Cuts every (layer, KV head) of the plan to its budget on the device, as kvm_evict_prefill
 * does on the CPU: scores from the statistics kept by the last forward (keep_evict_stats), the
 * top-b by the CPU's order (kernels/kvm_evict_body.h: higher score first, ties to the earlier
 * position), and the head's K, V, positions and β compacted to the kept entries, kept
 * positions increasing (the ragged cache's order). The next position stays the context's
 * length. The statistics are spent (a second call needs a new forward). Errors: KVM_EINVAL (no
 * statistics for the cache as it is, a pattern outside 0–4/255, a budget < 1, SnapKV/PyramidKV
 * with fewer kept rows than min(window, n)), KVM_EDEVICE. */
int kvm_cuda_model_evict(kvm_cuda_model *m, const kvm_cuda_evict_plan *plan);

/* Decode-phase eviction on the device (issue 13), as kvm_evict_decode_new's policy does it on the
 * CPU (compress/evict/kvm_evict.h): from the next forward on, after every layer's append, each
 * (layer, KV head) of the plan holding more than its budget evicts one entry per round until it
 * fits — StreamingLLM the oldest after the sinks; H2O, SnapKV/PyramidKV the lowest (max-pooled)
 * score outside the protected recent entries; TOVA the lowest probability under the newest query
 * (an attention pass with the OBS statistic); distilled entries never — and after the layer's
 * attention the scored heads add the call's received mass (SnapKV/PyramidKV decayed first), by
 * kernels/kvm_evict_body.h's decode bodies. Scores are kept per cache entry on the device and
 * seeded from the statistics of the last prefill with keep_evict_stats when no forward came
 * since (H2O the context's received mass, SnapKV/PyramidKV the last min(window, context)
 * observation rows' votes), else 0. Call it after the prefill (and kvm_cuda_model_evict) and
 * before the continuation; plan NULL turns it off, as kvm_cuda_model_reset does. While it is on,
 * a forward asking kvm_cuda_stats fails with KVM_EINVAL. Scratch is allocated at the first call
 * (checked with kvm_cuda_plan_fits) and freed with the model. Errors: KVM_EINVAL (a pattern
 * outside 0–4/255, a budget < 1), KVM_ENOMEM (bytes needed and free), KVM_EDEVICE. */
int kvm_cuda_model_decode_evict(kvm_cuda_model *m, const kvm_cuda_evict_plan *plan);

/* Sets the position the next token takes (after set_kv of a compressed cache). */
void kvm_cuda_model_set_next_pos(kvm_cuda_model *m, int32_t pos);

/* The ceiling the forward's GEMMs are measured against (issue 13's benchmark): the GEMMs of one
 * forward of n tokens (per layer q, k, v, o, gate, up, down; then the classifier on the last row)
 * through cublasGemmEx alone, on the model's own weights, with activations already in the weight
 * dtype and no other kernel, reps times. *seconds: the GPU time (CUDA events) per repetition;
 * *flops: the FLOPs of one repetition. n ≤ max_batch. */
int kvm_cuda_model_gemm_only(kvm_cuda_model *m, int64_t n, int reps, double *seconds, double *flops);

#ifdef __cplusplus
}
#endif

#endif
