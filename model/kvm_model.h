/* kvm_model.h: a Llama-architecture model in memory: its configuration and float32
 * weights, loaded from a llama2.c checkpoint (mmap, zero copy). Other formats (GGUF,
 * Hugging Face) fill the same struct, owning dequantised buffers instead of a mapping. */
#ifndef KVM_MODEL_H
#define KVM_MODEL_H

#include "kernels/kvm_kernels.h"

#include <stddef.h>
#include <stdint.h>

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

/* One transformer block's weights, row-major [out][in] float32 (kernels/LAYOUT.md). */
typedef struct kvm_layer_weights {
    const float *rms_att; /* [dim] */
    const float *wq;      /* [n_heads*head_dim][dim] */
    const float *wk;      /* [n_kv_heads*head_dim][dim] */
    const float *wv;      /* [n_kv_heads*head_dim][dim] */
    const float *wo;      /* [dim][n_heads*head_dim] */
    const float *rms_ffn; /* [dim] */
    const float *w1;      /* [hidden_dim][dim] gate */
    const float *w2;      /* [dim][hidden_dim] down */
    const float *w3;      /* [hidden_dim][dim] up */
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

typedef struct kvm_model {
    kvm_model_config cfg;      /* shapes and conventions */
    const float *tok_emb;      /* [vocab_size][dim] */
    const float *rms_final;    /* [dim] */
    const float *wcls;         /* [vocab_size][dim]; == tok_emb when shared_classifier */
    kvm_layer_weights *layers; /* [n_layers], owned */
    char *path;                /* the file it came from, owned */
    char format[16];           /* "llama2c", "gguf", "hf" */
    char arch[32];             /* "llama" or a Hugging Face architecture ("Qwen2ForCausalLM") */
    char dtype[16];            /* the file's weight dtype ("f32", "Q4_1", "BF16", "mixed") */
    void *map;                 /* read-only mapping of the file, or NULL */
    size_t map_bytes;          /* bytes mapped */
    void *owned;               /* weights this struct owns (dequantised), or NULL */
    size_t owned_bytes;        /* > 0: owned is an anonymous mapping of this size (kvm__model_alloc_weights),
                                  whose matrices kvm_model_prepare releases once prepared */
    kvm_prepared *prepared;    /* matrices prepared for a backend (lazily, by kvm_model_prepare) */
    int weights_released;      /* 1 after a failed prepare gave owned matrices back (prepare then refuses) */
} kvm_model;

/* Opens a model file or folder. A folder holding config.json is a Hugging Face checkpoint
 * (model/kvm_hf.h: config.json and safetensors, weights converted to float32 into m->owned).
 * A file's format is detected from its contents: a GGUF file (magic "GGUF";
 * llama architecture, weights dequantised to float32 into m->owned and the file unmapped;
 * model/kvm_gguf.h lists its errors, KVM_ENOTSUP among them) or else a llama2.c checkpoint,
 * whose weights stay in a read-only shared mapping of the file. On success *out owns everything;
 * release with kvm_model_close. Errors (message names the file and the field):
 * KVM_ENOTFOUND missing file, KVM_EIO unreadable or a directory, KVM_EFORMAT bad header
 * (zero/negative dimensions, heads not dividing dim, kv heads not dividing heads, odd
 * head_dim, file size different from what the header implies, truncated), KVM_ENOMEM. */
int kvm_model_open(const char *path, kvm_model **out);

/* Releases a model (unmaps, frees). Accepts NULL and *m == NULL; sets *m = NULL. */
void kvm_model_close(kvm_model **m);

/* The model's matrices prepared for backend k (packed panels on CPU), made on first use
 * and kept until kvm_model_close, so every forward over the model shares one copy. *out is
 * valid until then. The float32 source of each prepared matrix (m->layers[l].wq ... w3, and
 * wcls when not shared) is released as it is prepared: read those only before preparing
 * (a mapped file refaults its bytes; owned weights read as zeros after). Not thread-safe against concurrent first calls: prepare before
 * sharing a model between threads. Errors: KVM_ENOMEM, KVM_ESTATE (already prepared for
 * another backend, or an earlier call failed after releasing owned matrices). */
int kvm_model_prepare(const kvm_model *m, const kvm_kernels *k, const kvm_prepared **out);

/* 1 when token id ends a generation (one of c->eos_ids). */
int kvm_model_is_eos(const kvm_model_config *c, int32_t id);

/* Fills cos_t/sin_t [n][head_dim/2] for positions pos[0..n) with the model's RoPE angles:
 * kvm_rope_table's float32 recipe, frequencies then scaled as c->rope_scaling says. */
void kvm_model_rope_table(const kvm_model_config *c, const int32_t *pos, int64_t n, float *cos_t, float *sin_t);

/* Number of float parameters (the classifier counted once when shared). */
int64_t kvm_model_n_params(const kvm_model *m);

/* Bytes of a full float32 KV cache of n_tokens: 2 * n_layers * n_kv_heads * n_tokens * head_dim * 4. */
int64_t kvm_model_kv_bytes(const kvm_model_config *c, int64_t n_tokens);

/* Internal (model/): n_floats of zeroed float32 weight memory owned by m (an anonymous
 * mapping, so that kvm_model_prepare can give each matrix's pages back to the system once a
 * backend holds its own copy: loading then preparing peaks near one copy of the weights, not
 * two). Returns the memory or NULL (KVM_ENOMEM set). */
float *kvm__model_alloc_weights(kvm_model *m, int64_t n_floats);

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
 * the loader's. Returns 0, KVM_EINVAL (bad shape, message names it), KVM_EIO (write failed). */
int kvm_make_model_write(const char *path, const kvm_make_model_opts *o);

#endif
