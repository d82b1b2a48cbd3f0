/* kvm_gguf_model.c: a Llama-architecture GGUF file as a kvm_model: hyperparameters from the
 * llama.* metadata, every tensor's shape checked against them, matrices kept in the mapping in
 * their block type (kvm_model_prepare dequantises them row block by row block into the
 * backend's storage) and the norm vectors dequantised into m->owned. RoPE: llama.cpp's converter permutes the Q/K rows of
 * Hugging Face checkpoints so that ggml's "normal" rotation (adjacent pairs) applies, i.e.
 * KVM_ROPE_INTERLEAVED; tests/check_gguf.c checks the logits against llama.cpp's. */
#include "common/kvm_error.h"
#include "model/kvm_gguf.h"
#include "model/kvm_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define KVM_GGUF_MAX_DIM (1 << 16)
#define KVM_GGUF_MAX_LAYERS 1024
#define KVM_GGUF_MAX_VOCAB (1 << 22)
#define KVM_GGUF_MAX_SEQ (1 << 22)

/* A required positive integer hyperparameter (or its default when def > 0 and absent). */
static int hparam(const kvm_gguf *g, const char *key, int64_t def, int64_t max, int *out)
{
    int64_t v = def;
    int rc = kvm_gguf_get_i64(g, key, &v);
    if (rc == KVM_ENOTFOUND && def <= 0)
        return kvm_err(KVM_EFORMAT, "%s: metadata '%s' is missing (needed for the llama architecture)",
                       kvm_gguf_name(g), key);
    if (rc && rc != KVM_ENOTFOUND) return rc;
    if (v <= 0 || v > max)
        return kvm_err(KVM_EFORMAT, "%s: metadata '%s' = %lld is outside [1, %lld]", kvm_gguf_name(g), key,
                       (long long)v, (long long)max);
    *out = (int)v;
    return 0;
}

/* Finds tensor `name` and checks its shape is [ne0] (ne1 == 0) or [ne0, ne1]. */
static int find_tensor(const kvm_gguf *g, const char *name, int64_t ne0, int64_t ne1, const kvm_gguf_tensor **out)
{
    const kvm_gguf_tensor *t = kvm_gguf_find_tensor(g, name);
    if (!t) return kvm_err(KVM_EFORMAT, "%s: tensor '%s' is missing", kvm_gguf_name(g), name);
    int want_dims = ne1 ? 2 : 1;
    if (t->ne[0] != ne0 || t->ne[1] != (ne1 ? ne1 : 1) || t->ne[2] != 1 || t->ne[3] != 1 || t->n_dims > want_dims)
        return kvm_err(KVM_EFORMAT,
                       "%s: tensor '%s' has shape [%lld, %lld, %lld, %lld], the architecture needs [%lld, %lld] "
                       "(ne0 = row length)",
                       kvm_gguf_name(g), name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                       (long long)t->ne[3], (long long)ne0, (long long)(ne1 ? ne1 : 1));
    *out = t;
    return 0;
}

/* A vector [ne0], dequantised into *dst (advanced). */
static int load_vector(const kvm_gguf *g, const char *name, int64_t ne0, float **dst, const float **out)
{
    const kvm_gguf_tensor *t;
    int rc = find_tensor(g, name, ne0, 0, &t);
    if (rc || (rc = kvm__model_check_finite(kvm_gguf_name(g), name, t->type, t->data, ne0))) return rc;
    if ((rc = kvm_ggml_dequantize(t->type, t->data, *dst, ne0)))
        return kvm_err(rc, "%s: tensor '%s': %s", kvm_gguf_name(g), name, kvm_errmsg());
    *out = *dst;
    *dst += ne0;
    return 0;
}

/* A matrix of ne1 rows of ne0, left in the mapping in its block type; its elements (f32, f16,
 * bf16) or block scales are checked finite here, the one pass before kvm_model_prepare. */
static int load_matrix(const kvm_gguf *g, const char *name, int64_t ne0, int64_t ne1, kvm_mat *out)
{
    const kvm_gguf_tensor *t;
    int rc = find_tensor(g, name, ne0, ne1, &t);
    if (rc) return rc;
    int64_t be = kvm_ggml_block_elems(t->type);
    if (!be || ne0 % be)
        return kvm_err(KVM_ENOTSUP, "%s: tensor '%s': type %s with rows of %lld cannot be dequantised",
                       kvm_gguf_name(g), name, kvm_ggml_type_name(t->type), (long long)ne0);
    if ((rc = kvm__model_check_finite(kvm_gguf_name(g), name, t->type, t->data, ne0 * ne1))) return rc;
    *out = (kvm_mat){t->data, t->type};
    return 0;
}

static int str_is(kvm_gguf_str s, const char *z) { return s.len == strlen(z) && memcmp(s.ptr, z, s.len) == 0; }

/* Rejects what the forward cannot reproduce: partial rotary, RoPE scaling, llama3 frequency
 * factors, Q/K head sizes other than dim / n_heads... */
static int check_unsupported(const kvm_gguf *g, int head_dim)
{
    const char *f = kvm_gguf_name(g);
    int64_t v = head_dim;
    kvm_gguf_str s;
    int rc = kvm_gguf_get_i64(g, "llama.rope.dimension_count", &v);
    if (rc && rc != KVM_ENOTFOUND) return rc; /* a float 32.0 was taken as absent: full rotary, not partial */
    if (v != head_dim)
        return kvm_err(KVM_ENOTSUP,
                       "%s: llama.rope.dimension_count = %lld: partial rotary (head size %d) is not "
                       "supported",
                       f, (long long)v, head_dim);
    if (kvm_gguf_get_str(g, "llama.rope.scaling.type", &s) == 0 && !str_is(s, "none")) {
        double factor = 1.0;
        rc = kvm_gguf_get_f64(g, "llama.rope.scaling.factor", &factor);
        if (rc && rc != KVM_ENOTFOUND) return rc; /* an integer factor was taken as 1: linear scaling let through */
        if (!(str_is(s, "linear") && factor == 1.0))
            return kvm_err(KVM_ENOTSUP, "%s: llama.rope.scaling.type '%.*s' (factor %g) is not supported", f,
                           (int)s.len, s.ptr, factor);
    }
    if (kvm_gguf_find_tensor(g, "rope_freqs.weight"))
        return kvm_err(KVM_ENOTSUP, "%s: tensor 'rope_freqs.weight' (llama3 RoPE frequency factors) is not supported",
                       f);
    if (kvm_gguf_get_i64(g, "llama.expert_count", &v) == 0 && v > 0)
        return kvm_err(KVM_ENOTSUP, "%s: llama.expert_count = %lld: mixture of experts is not supported", f,
                       (long long)v);
    return 0;
}

int kvm__gguf_load(kvm_model *m, const uint8_t *map, size_t bytes)
{
    kvm_gguf *g = NULL;
    float *buf = NULL;
    int rc = kvm_gguf_parse(m->path, map, bytes, &g);
    if (rc) return rc;
    const char *f = m->path;
    kvm_gguf_str arch = {0};
    if ((rc = kvm_gguf_get_str(g, "general.architecture", &arch)) != 0) {
        if (rc == KVM_ENOTFOUND) rc = kvm_err(KVM_EFORMAT, "%s: metadata 'general.architecture' is missing", f);
        goto fail;
    }
    if (!str_is(arch, "llama")) {
        rc = kvm_err(KVM_ENOTSUP, "%s: general.architecture '%.*s' is not supported (llama is)", f,
                     (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
        goto fail;
    }
    int dim, hidden, n_layers, n_heads, n_kv, seq;
    if ((rc = hparam(g, "llama.embedding_length", 0, KVM_GGUF_MAX_DIM, &dim)) ||
        (rc = hparam(g, "llama.feed_forward_length", 0, KVM_GGUF_MAX_DIM * 8, &hidden)) ||
        (rc = hparam(g, "llama.block_count", 0, KVM_GGUF_MAX_LAYERS, &n_layers)) ||
        (rc = hparam(g, "llama.attention.head_count", 0, KVM_GGUF_MAX_DIM, &n_heads)) ||
        (rc = hparam(g, "llama.attention.head_count_kv", n_heads, KVM_GGUF_MAX_DIM, &n_kv)) ||
        (rc = hparam(g, "llama.context_length", 0, KVM_GGUF_MAX_SEQ, &seq)))
        goto fail;
    if (dim % n_heads || n_heads % n_kv) {
        rc = kvm_err(KVM_EFORMAT,
                     "%s: llama.attention.head_count = %d must divide embedding_length = %d and be a "
                     "multiple of head_count_kv = %d",
                     f, n_heads, dim, n_kv);
        goto fail;
    }
    int head_dim = dim / n_heads, kl = head_dim, vl = head_dim;
    if ((rc = hparam(g, "llama.attention.key_length", head_dim, KVM_GGUF_MAX_DIM, &kl)) ||
        (rc = hparam(g, "llama.attention.value_length", head_dim, KVM_GGUF_MAX_DIM, &vl)))
        goto fail;
    if (kl != head_dim || vl != head_dim) {
        rc = kvm_err(KVM_ENOTSUP, "%s: key_length %d / value_length %d differ from embedding_length / head_count = %d",
                     f, kl, vl, head_dim);
        goto fail;
    }
    if (head_dim % 2) {
        rc = kvm_err(KVM_EFORMAT, "%s: head size %d is odd; RoPE needs pairs", f, head_dim);
        goto fail;
    }
    if ((rc = check_unsupported(g, head_dim))) goto fail;
    double theta = 10000.0, eps = 1e-5;
    if (((rc = kvm_gguf_get_f64(g, "llama.rope.freq_base", &theta)) && rc != KVM_ENOTFOUND) ||
        ((rc = kvm_gguf_get_f64(g, "llama.attention.layer_norm_rms_epsilon", &eps)) && rc != KVM_ENOTFOUND))
        goto fail;
    if ((rc = kvm__model_check_rope_theta(f, "llama.rope.freq_base", theta))) goto fail;
    if (!(eps > 0) || !isfinite(eps)) {
        rc = kvm_err(KVM_EFORMAT, "%s: llama.attention.layer_norm_rms_epsilon = %g must be positive", f, eps);
        goto fail;
    }
    const kvm_gguf_tensor *emb = kvm_gguf_find_tensor(g, "token_embd.weight");
    if (!emb) {
        rc = kvm_err(KVM_EFORMAT, "%s: tensor 'token_embd.weight' is missing", f);
        goto fail;
    }
    if (emb->ne[1] < 1 || emb->ne[1] > KVM_GGUF_MAX_VOCAB) {
        rc =
            kvm_err(KVM_EFORMAT, "%s: tensor 'token_embd.weight': vocabulary of %lld tokens", f, (long long)emb->ne[1]);
        goto fail;
    }
    int vocab = (int)emb->ne[1];
    int64_t meta_vocab;
    /* a vocab_size of another size than the embedding's rows was taken unsaid: the file is
     * inconsistent (a tokenizer or embedding of another model), so which one is right is unknown */
    if ((rc = kvm_gguf_get_i64(g, "llama.vocab_size", &meta_vocab)) && rc != KVM_ENOTFOUND) goto fail;
    if (rc == 0 && meta_vocab != vocab) {
        rc = kvm_err(KVM_EFORMAT, "%s: metadata llama.vocab_size = %lld, but tensor token_embd.weight has %d rows", f,
                     (long long)meta_vocab, vocab);
        goto fail;
    }
    rc = 0;
    uint64_t n_tok;
    const uint8_t *tok_data;
    /* present but no array of strings was skipped unsaid here (only a tokenizer load refused it) */
    if ((rc = kvm_gguf_get_arr(g, "tokenizer.ggml.tokens", KVM_GGUF_STRING, &n_tok, &tok_data)) && rc != KVM_ENOTFOUND)
        goto fail;
    if (rc == 0 && n_tok != (uint64_t)vocab) {
        rc = kvm_err(KVM_EFORMAT, "%s: tokenizer.ggml.tokens has %llu tokens, token_embd.weight %d rows", f,
                     (unsigned long long)n_tok, vocab);
        goto fail;
    }
    rc = 0;
    int64_t bos = 1, eos = 2;
    /* absent: llama2's 1 and 2; present but not an integer is an error, not those ids */
    if (((rc = kvm_gguf_get_i64(g, "tokenizer.ggml.bos_token_id", &bos)) && rc != KVM_ENOTFOUND) ||
        ((rc = kvm_gguf_get_i64(g, "tokenizer.ggml.eos_token_id", &eos)) && rc != KVM_ENOTFOUND))
        goto fail;
    if (bos < 0 || bos >= vocab || eos < 0 || eos >= vocab) {
        rc = kvm_err(KVM_EFORMAT, "%s: bos_token_id %lld / eos_token_id %lld outside the vocabulary [0, %d)", f,
                     (long long)bos, (long long)eos, vocab);
        goto fail;
    }
    int shared = kvm_gguf_find_tensor(g, "output.weight") == NULL;
    int64_t D = dim, H = hidden, V = vocab, KV = (int64_t)n_kv * head_dim, L = n_layers;
    int64_t floats = D + L * 2 * D; /* the norm vectors; matrices stay in the mapping */
    m->cfg = (kvm_model_config){.dim = dim,
                                .hidden_dim = hidden,
                                .n_layers = n_layers,
                                .n_heads = n_heads,
                                .n_kv_heads = n_kv,
                                .head_dim = head_dim,
                                .vocab_size = vocab,
                                .seq_len = seq,
                                .rope_theta = (float)theta,
                                .norm_eps = (float)eps,
                                .rope_style = KVM_ROPE_INTERLEAVED,
                                .shared_classifier = shared,
                                .bos_id = (int32_t)bos,
                                .eos_id = (int32_t)eos};
    snprintf(m->format, sizeof m->format, "gguf");
    m->layers = calloc((size_t)n_layers, sizeof *m->layers);
    buf = kvm__model_alloc_weights(m, floats); /* m->owned: released by kvm_model_close */
    if (!m->layers || !buf) {
        rc = kvm_err(KVM_ENOMEM, "%s: cannot allocate %lld float32 norm weights", f, (long long)floats);
        goto fail;
    }
    float *at = buf;
    if ((rc = load_matrix(g, "token_embd.weight", D, V, &m->tok_emb)) ||
        (rc = load_vector(g, "output_norm.weight", D, &at, &m->rms_final)))
        goto fail;
    if (shared)
        m->wcls = m->tok_emb;
    else if ((rc = load_matrix(g, "output.weight", D, V, &m->wcls)))
        goto fail;
    for (int l = 0; l < n_layers; l++) {
        kvm_layer_weights *w = &m->layers[l];
        char n[9][64];
        const char *parts[9] = {"attn_norm", "attn_q",   "attn_k",   "attn_v", "attn_output",
                                "ffn_norm",  "ffn_gate", "ffn_down", "ffn_up"};
        for (int i = 0; i < 9; i++)
            snprintf(n[i], sizeof n[i], "blk.%d.%s.weight", l, parts[i]);
        if ((rc = load_vector(g, n[0], D, &at, &w->rms_att)) || (rc = load_matrix(g, n[1], D, D, &w->wq)) ||
            (rc = load_matrix(g, n[2], D, KV, &w->wk)) || (rc = load_matrix(g, n[3], D, KV, &w->wv)) ||
            (rc = load_matrix(g, n[4], D, D, &w->wo)) || (rc = load_vector(g, n[5], D, &at, &w->rms_ffn)) ||
            (rc = load_matrix(g, n[6], D, H, &w->w1)) || (rc = load_matrix(g, n[7], H, D, &w->w2)) ||
            (rc = load_matrix(g, n[8], D, H, &w->w3)))
            goto fail;
    }
    /* every tensor of the file is one the forward reads: a block_count below the file's blk.N
     * tensors dropped the last layers without a word (SmolLM2 with llama.block_count = 29 answered
     * "capital of the E" for "Paris."; llama.cpp refuses that file: "wrong number of tensors"),
     * and tensors this loader does not read would be ignored alike. Attention biases, which
     * llama.cpp's llama architecture applies, are not read from GGUF here (a Hugging Face folder
     * with attention_bias is): refused as not supported rather than dropped. */
    int64_t used = 2 + !shared + 9 * L;
    if (kvm_gguf_n_tensors(g) != used) {
        for (int64_t i = 0; i < kvm_gguf_n_tensors(g); i++) {
            const kvm_gguf_str nm = kvm_gguf_tensor_at(g, i)->name;
            char name[128];
            snprintf(name, sizeof name, "%.*s", (int)(nm.len < 127 ? nm.len : 127), nm.ptr);
            int layer = -1, end = 0;
            char part[32] = "";
            int known = !strcmp(name, "token_embd.weight") || !strcmp(name, "output_norm.weight") ||
                        (!shared && !strcmp(name, "output.weight"));
            if (!known && sscanf(name, "blk.%d.%31[a-z_].weight%n", &layer, part, &end) == 2 && !name[end] &&
                layer >= 0 && layer < n_layers && nm.len < 127) {
                static const char *const parts[9] = {"attn_norm", "attn_q",   "attn_k",   "attn_v", "attn_output",
                                                     "ffn_norm",  "ffn_gate", "ffn_down", "ffn_up"};
                char canon[128];
                snprintf(canon, sizeof canon, "blk.%d.%s.weight", layer, part);
                for (int k = 0; k < 9; k++)
                    known |= !strcmp(part, parts[k]) && !strcmp(canon, name);
            }
            int bias_end = 0;
            if (!known && sscanf(name, "blk.%*d.attn_%*[a-z].bias%n", &bias_end) == 0 && bias_end > 0 &&
                !name[bias_end]) {
                rc = kvm_err(KVM_ENOTSUP,
                             "%s: tensor '%s': attention biases in a GGUF file are not supported (a Hugging Face "
                             "folder with attention_bias is)",
                             f, name);
                goto fail;
            }
            if (!known) {
                rc = kvm_err(KVM_EFORMAT,
                             "%s: tensor '%s' is not part of the llama architecture of llama.block_count = %d layers "
                             "(%lld tensors, the architecture has %lld)",
                             f, name, n_layers, (long long)kvm_gguf_n_tensors(g), (long long)used);
                goto fail;
            }
        }
        rc = kvm_err(KVM_EFORMAT, "%s: %lld tensors, the llama architecture of llama.block_count = %d layers has %lld",
                     f, (long long)kvm_gguf_n_tensors(g), n_layers, (long long)used);
        goto fail;
    }
    /* the matrices' common block type, or "mixed" */
    snprintf(m->dtype, sizeof m->dtype, "%s", kvm_ggml_type_name(m->layers[0].wq.type));
    for (int l = 0; l < n_layers; l++) {
        const kvm_layer_weights *w = &m->layers[l];
        const kvm_mat *ms[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w1, &w->w2, &w->w3, &m->tok_emb, &m->wcls};
        for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
            if (ms[i]->type != m->layers[0].wq.type) snprintf(m->dtype, sizeof m->dtype, "mixed");
    }
    kvm_gguf_free(&g); /* the tensors' bytes stay in m->map until kvm_model_close */
    return 0;
fail:
    free(m->layers);
    m->layers = NULL;
    m->tok_emb = m->wcls = (kvm_mat){0};
    m->rms_final = NULL;
    kvm_gguf_free(&g);
    return rc;
}
