/* kvm_model.h: a Llama-architecture model in memory: its configuration and weights, loaded
 * from a llama2.c checkpoint, a GGUF file or a Hugging Face folder. Matrices stay in the
 * file's mapping and element type until a backend prepares them; vectors are float32. */
#ifndef KVM_MODEL_H
#define KVM_MODEL_H

#include "kernels/kvm_kernels.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define KVM_MODEL_MAX_EOS 8

/* RoPE frequency scaling (Hugging Face rope_scaling). type 0: none; 1: "llama3"
 * (transformers' _compute_llama3_parameters: wavelengths above original_max / low_freq_factor
 * divided by factor, below original_max / high_freq_factor kept, smoothly blended between). */
typedef struct kvm_rope_scaling {
    int type;               /* 0 none, 1 llama3 */
    float factor;           /* "factor" */
    float low_freq_factor;  /* "low_freq_factor" */
    float high_freq_factor; /* "high_freq_factor" */
    int original_max;       /* "original_max_position_embeddings", tokens */
} kvm_rope_scaling;

typedef struct kvm_model_config {
    int dim;                   /* residual width */
    int hidden_dim;            /* SwiGLU FFN width */
    int n_layers;              /* transformer blocks */
    int n_heads;               /* query heads */
    int n_kv_heads;            /* KV heads (GQA: n_heads / n_kv_heads query heads share one) */
    int head_dim;              /* dim / n_heads */
    int vocab_size;            /* tokens */
    int seq_len;               /* the model's context window, tokens */
    float rope_theta;          /* RoPE base (10000 for llama2.c) */
    float norm_eps;            /* RMSNorm epsilon (1e-5 for llama2.c) */
    kvm_rope_style rope_style; /* how RoPE pairs entries */
    int shared_classifier;     /* 1 when the classifier is the token embedding (tied) */
    int32_t bos_id;            /* beginning-of-sequence token */
    int32_t eos_id;            /* end-of-sequence token (the first of eos_ids) */
    int n_eos;                 /* entries of eos_ids, >= 1 (Hugging Face configs may list several) */
    int32_t eos_ids[KVM_MODEL_MAX_EOS]; /* every token that ends a generation */
    int sliding_window;        /* Mistral's attention window, tokens; 0 = none. The forward refuses
                                  positions at or past it (windowed attention is not implemented) */
    kvm_rope_scaling rope_scaling; /* frequency scaling of RoPE (Llama-3.1's "llama3" type) */
    int qk_norm;               /* 1: per-head RMSNorm on q and k before RoPE (Qwen3) */
    int attn_bias;             /* 1: q/k/v (and o when present) projections have biases (Qwen2) */
} kvm_model_config;

/* A weight matrix [out][in] row-major as its file stores it: zero copy inside the file's
 * read-only mapping, in the file's element type (ggml type numbers, which also name llama2.c's
 * and safetensors' F32, F16 and BF16), until a backend prepares it (kvm_model_prepare). */
typedef struct kvm_mat {
    const uint8_t *data; /* row r at data + r * kvm_ggml_row_bytes(type, in); any alignment */
    int type;            /* KVM_MAT_F32, KVM_MAT_F16, KVM_MAT_BF16 or a GGUF block type (Q4_1 ...) */
} kvm_mat;

#define KVM_MAT_F32 0   /* ggml GGML_TYPE_F32 */
#define KVM_MAT_F16 1   /* ggml GGML_TYPE_F16 */
#define KVM_MAT_BF16 30 /* ggml GGML_TYPE_BF16 */

/* One transformer block's weights, [out][in] row-major (kernels/LAYOUT.md); vectors float32. */
typedef struct kvm_layer_weights {
    const float *rms_att; /* [dim] */
    kvm_mat wq;           /* [n_heads*head_dim][dim] */
    kvm_mat wk;           /* [n_kv_heads*head_dim][dim] */
    kvm_mat wv;           /* [n_kv_heads*head_dim][dim] */
    kvm_mat wo;           /* [dim][n_heads*head_dim] */
    const float *rms_ffn; /* [dim] */
    kvm_mat w1;           /* [hidden_dim][dim] gate */
    kvm_mat w2;           /* [dim][hidden_dim] down */
    kvm_mat w3;           /* [hidden_dim][dim] up */
    const float *bq;      /* [n_heads*head_dim] q bias, or NULL (cfg.attn_bias) */
    const float *bk;      /* [n_kv_heads*head_dim] k bias, or NULL */
    const float *bv;      /* [n_kv_heads*head_dim] v bias, or NULL */
    const float *bo;      /* [dim] output bias, or NULL */
    const float *q_norm;  /* [head_dim] per-head RMSNorm weight on q, or NULL (cfg.qk_norm) */
    const float *k_norm;  /* [head_dim] per-head RMSNorm weight on k, or NULL */
} kvm_layer_weights;

/* A layer's matrices prepared by a backend (kernels/kvm_kernels.h kvm_weight). */
typedef struct kvm_prepared_layer {
    kvm_weight *wq, *wk, *wv, *wo, *w1, *w2, *w3;
} kvm_prepared_layer;

/* All of a model's matrices prepared for one backend. */
typedef struct kvm_prepared {
    const kvm_kernels *k;       /* the backend they belong to */
    kvm_prepared_layer *layers; /* [n_layers] */
    kvm_weight *wcls;           /* classifier [vocab][dim] */
} kvm_prepared;

/* The [model] weight_dtype setting: how kvm_model_prepare stores matrices on the CPU. */
typedef enum kvm_model_weight_dtype {
    KVM_MODEL_WEIGHTS_AUTO = -1, /* the file's: F32 → f32, BF16 → bf16, F16 and GGUF blocks → f16 */
    KVM_MODEL_WEIGHTS_F32 = KVM_WEIGHT_F32,   /* float32 (parity runs) */
    KVM_MODEL_WEIGHTS_BF16 = KVM_WEIGHT_BF16, /* bfloat16 */
    KVM_MODEL_WEIGHTS_F16 = KVM_WEIGHT_F16,   /* IEEE half */
} kvm_model_weight_dtype;

typedef struct kvm_model {
    kvm_model_config cfg;      /* shapes and conventions */
    kvm_mat tok_emb;           /* [vocab_size][dim]; rows read by kvm_model_embed */
    const float *rms_final;    /* [dim] */
    kvm_mat wcls;              /* [vocab_size][dim]; == tok_emb when shared_classifier */
    kvm_layer_weights *layers; /* [n_layers], owned */
    char *path;                /* the file it came from, owned */
    char format[16];           /* "llama2c", "gguf", "hf" */
    char arch[32];             /* "llama" or a Hugging Face architecture ("Qwen2ForCausalLM") */
    char dtype[16];            /* the file's weight dtype ("f32", "Q4_1", "BF16", "mixed") */
    void *map;                 /* read-only mapping of the file, or NULL */
    size_t map_bytes;          /* bytes mapped */
    void *owned;               /* float32 vectors this struct owns (norms, biases), or NULL */
    size_t owned_bytes;        /* > 0: owned is an anonymous mapping of this size (kvm__model_alloc_weights) */
    struct kvm_st *st;         /* a Hugging Face folder's safetensors set (the matrices' mappings), or NULL */
    int weight_dtype;          /* kvm_model_weight_dtype; KVM_MODEL_WEIGHTS_AUTO after open */
    kvm_prepared *prepared;    /* matrices prepared for a backend (lazily, by kvm_model_prepare) */
} kvm_model;

/* Opens a model file or folder. A folder holding config.json is a Hugging Face checkpoint
 * (model/kvm_hf.h: config.json and safetensors, kept mapped in m->st). A file's format is
 * detected from its contents: a GGUF file (magic "GGUF"; llama architecture; model/kvm_gguf.h
 * lists its errors, KVM_ENOTSUP among them) or else a llama2.c checkpoint. Every format's
 * matrices stay in the read-only mapping in the file's element type (kvm_mat) until
 * kvm_model_prepare packs them; norm and bias vectors are float32 (converted into m->owned
 * where the file's are not). On success *out owns everything; release with kvm_model_close.
 * Errors (message names the file and the field): KVM_ENOTFOUND missing file, KVM_EIO
 * unreadable, KVM_EFORMAT a directory without config.json, a symbolic link loop or a path
 * through a file, not a regular file, a safetensors or .json file (a part of a Hugging Face
 * folder: the message names the folder to pass), bad header (zero/negative dimensions, heads not
 * dividing dim, kv heads not dividing heads, odd head_dim, file size different from what the
 * header implies, truncated), KVM_ENOMEM. */
int kvm_model_open(const char *path, kvm_model **out);

/* Releases a model (unmaps, frees). Accepts NULL and *m == NULL; sets *m = NULL. */
void kvm_model_close(kvm_model **m);

/* The model's matrices prepared for backend k (packed panels on CPU), made on first use
 * and kept until kvm_model_close, so every forward over the model shares one copy. *out is
 * valid until then. Each matrix is dequantised/widened a few rows at a time straight from the
 * file's mapping into the backend's storage (m->weight_dtype on CPU: 16-bit panels need half
 * the memory of float32 ones; a backend without weight_new_rows gets one float32 matrix at a
 * time), and the mapping's pages are given back after (the file refaults them if read again),
 * so loading never holds a float32 copy of all weights. Not thread-safe against concurrent
 * first calls: prepare before sharing a model between threads. Errors: KVM_ENOMEM,
 * KVM_ERANGE (weight_dtype f16 and a value beyond ±65504: message names the matrix),
 * KVM_ESTATE (already prepared for another backend). */
int kvm_model_prepare(const kvm_model *m, const kvm_kernels *k, const kvm_prepared **out);

/* Sets how kvm_model_prepare stores matrices (before the first prepare). Returns 0, or
 * KVM_ESTATE once prepared with another dtype. */
int kvm_model_set_weight_dtype(kvm_model *m, kvm_model_weight_dtype d);

/* Parses a weight_dtype value: "auto", "f32", "bf16" or "f16". Returns 0 and *out, or
 * KVM_EINVAL naming the value and the choices. */
int kvm_model_weight_dtype_parse(const char *s, kvm_model_weight_dtype *out);

/* The storage kvm_model_prepare picks for matrix w under setting d ("auto": the file's
 * 16-bit type kept, F32 kept, GGUF blocks dequantised into f16). */
kvm_weight_dtype kvm_model_weight_dtype_for(const kvm_mat *w, kvm_model_weight_dtype d);

/* Name of a storage dtype: "f32", "bf16", "f16". */
const char *kvm_model_weight_dtype_name(kvm_weight_dtype d);

/* Dequantises rows [r0, r0 + n) of w ([out][in], in elements per row) into dst [n][in]
 * float32. Returns 0 or KVM_ENOTSUP (a block type kvmill cannot dequantise). */
int kvm_model_mat_rows(const kvm_mat *w, int64_t in, int64_t r0, int64_t n, float *dst);

/* Token id's embedding row, float32, into dst [dim]. id must be in [0, vocab_size). */
void kvm_model_embed(const kvm_model *m, int32_t id, float *dst);

/* 1 when token id ends a generation (one of c->eos_ids). */
int kvm_model_is_eos(const kvm_model_config *c, int32_t id);

/* Fills cos_t/sin_t [n][head_dim/2] for positions pos[0..n) with the model's RoPE angles:
 * kvm_rope_table's float32 recipe, frequencies then scaled as c->rope_scaling says. */
void kvm_model_rope_table(const kvm_model_config *c, const int32_t *pos, int64_t n, float *cos_t, float *sin_t);

/* Number of float parameters (the classifier counted once when shared). */
int64_t kvm_model_n_params(const kvm_model *m);

/* Bytes of a full float32 KV cache of n_tokens: 2 * n_layers * n_kv_heads * n_tokens * head_dim * 4. */
int64_t kvm_model_kv_bytes(const kvm_model_config *c, int64_t n_tokens);

/* Internal (model/): n_floats of zeroed float32 memory owned by m (an anonymous mapping) for
 * the vectors a loader converts (norms, biases). Returns the memory or NULL (KVM_ENOMEM set). */
float *kvm__model_alloc_weights(kvm_model *m, int64_t n_floats);

/* Internal (model/): 0 when theta, a checkpoint's RoPE base (file f, key `key`: config.json's
 * rope_theta, GGUF's llama.rope.freq_base), is > 1 and finite as float32 (the forward's type);
 * else KVM_EFORMAT, kvm_errmsg naming f, key and the value. One rule for every loader. */
int kvm__model_check_rope_theta(const char *f, const char *key, double theta);

/* Internal (model/): 0 when the n weights of `type` (KVM_MAT_F32, KVM_MAT_F16, KVM_MAT_BF16:
 * every element; a GGUF block type, n a multiple of its block: every block's f16 scales d,
 * m / dmin, whose non-finite value makes the whole block so) at data are finite; another type
 * is not checked. One pass over the bytes, nothing kept. Else KVM_EFORMAT, kvm_errmsg naming
 * file, tensor (a display name) and the first bad element (block and field). */
int kvm__model_check_finite(const char *file, const char *tensor, int type, const uint8_t *data, int64_t n);

/* Internal (model/): parse and validate a llama2.c checkpoint mapped at map[0, bytes). */
int kvm__llama2c_load(kvm_model *m, const uint8_t *map, size_t bytes);

/* Options of a random-weight llama2.c checkpoint (kvmill make-model). */
typedef struct kvm_make_model_opts {
    int dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; /* shapes */
    int separate_classifier; /* 1: write a separate wcls (negative vocab in the header) */
    uint64_t seed;           /* PRNG seed: same seed, same bytes */
} kvm_make_model_opts;

/* Writes a llama2.c checkpoint with random weights: matrices uniform in ±1/sqrt(in), RMSNorm
 * weights 1, RoPE legacy tables filled as llama2.c's export does. Shapes are validated like
 * the loader's. Written as PATH.partial, renamed over PATH when whole (so over whatever PATH is:
 * a file, not a FIFO or device; kvmill make-model writes through kvm_make_model_fwrite).
 * Returns 0, KVM_EINVAL (bad shape, message names it), KVM_EIO (write failed). */
int kvm_make_model_write(const char *path, const kvm_make_model_opts *o);

/* The same checkpoint written to an open stream f (borrowed: not closed; the caller decides where
 * the bytes go and what a failure leaves, as kvmill make-model's --out does), flushed at the end.
 * name: how messages call the output. Shapes are validated before anything is written. Returns
 * 0, KVM_EINVAL (bad shape, nothing written), KVM_EIO ("NAME: write failed: REASON": a short
 * write or flush, e.g. a full device; f then holds part of the checkpoint). */
int kvm_make_model_fwrite(FILE *f, const char *name, const kvm_make_model_opts *o);

#endif
