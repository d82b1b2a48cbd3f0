/* kvm_llama2c.c: llama2.c checkpoint ("legacy" version-0 format): a 7-int32 header, then
 * float32 arrays back to back (shared/models/README.md). Every header field is validated
 * and the file size must equal what the header implies, so no weight read leaves the map. */
#include "model/kvm_model.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { KVM_L2C_HEADER_BYTES = 28 };

/* Upper bounds that keep every size product far from int64 overflow. */
#define KVM_L2C_MAX_DIM (1 << 16)
#define KVM_L2C_MAX_LAYERS 1024
#define KVM_L2C_MAX_VOCAB (1 << 22)
#define KVM_L2C_MAX_SEQ (1 << 22)

/* An out-of-range header field means the file is most likely no llama2.c checkpoint at all
 * (kvm_model_open tries GGUF and the known non-model files first), so the message says so. */
static int check_field(const char *path, const char *name, int32_t v, int32_t max)
{
    static const char not_l2c[] = "not a llama2.c checkpoint nor a GGUF file";
    if (v <= 0) return kvm_err(KVM_EFORMAT, "%s: %s (header field '%s' = %d must be positive)", path, not_l2c, name, v);
    if (v > max)
        return kvm_err(KVM_EFORMAT, "%s: %s (header field '%s' = %d exceeds the limit %d)", path, not_l2c, name, v,
                       max);
    return 0;
}

/* Rejects a NaN or infinity in the n_layers arrays of per_layer floats at p, naming the
 * array as run.c's TransformerWeights does ("wq (layer 3)"; n_layers 0: one unlayered array). */
static int check_finite(const char *path, const char *name, const float *p, int64_t per_layer, int64_t n_layers)
{
    char label[64];
    for (int64_t l = 0; l < (n_layers ? n_layers : 1); l++) {
        if (n_layers)
            snprintf(label, sizeof label, "%s (layer %lld)", name, (long long)l);
        else
            snprintf(label, sizeof label, "%s", name);
        int rc = kvm__model_check_finite(path, label, KVM_MAT_F32, (const uint8_t *)(p + l * per_layer), per_layer);
        if (rc) return rc;
    }
    return 0;
}

static kvm_mat f32_mat(const float *p) { return (kvm_mat){(const uint8_t *)p, KVM_MAT_F32}; }

int kvm__llama2c_load(kvm_model *m, const uint8_t *map, size_t bytes)
{
    const char *path = m->path;
    if (bytes < KVM_L2C_HEADER_BYTES)
        return kvm_err(KVM_EFORMAT, "%s: truncated: %zu bytes, the llama2.c header alone is %d", path, bytes,
                       KVM_L2C_HEADER_BYTES);
    int32_t h[7];
    memcpy(h, map, sizeof h);
    int32_t dim = h[0], hidden = h[1], n_layers = h[2], n_heads = h[3], n_kv = h[4], vocab = h[5], seq = h[6];
    int shared = vocab > 0;
    if (vocab < 0) {
        if (vocab == INT32_MIN)
            return kvm_err(KVM_EFORMAT,
                           "%s: not a llama2.c checkpoint nor a GGUF file (header field 'vocab_size' = %d)", path,
                           vocab);
        vocab = -vocab;
    }
    int rc;
    if ((rc = check_field(path, "dim", dim, KVM_L2C_MAX_DIM)) || (rc = check_field(path, "hidden_dim", hidden, KVM_L2C_MAX_DIM * 8)) ||
        (rc = check_field(path, "n_layers", n_layers, KVM_L2C_MAX_LAYERS)) ||
        (rc = check_field(path, "n_heads", n_heads, KVM_L2C_MAX_DIM)) ||
        (rc = check_field(path, "n_kv_heads", n_kv, KVM_L2C_MAX_DIM)) ||
        (rc = check_field(path, "vocab_size", vocab, KVM_L2C_MAX_VOCAB)) ||
        (rc = check_field(path, "seq_len", seq, KVM_L2C_MAX_SEQ)))
        return rc;
    if (dim % n_heads)
        return kvm_err(KVM_EFORMAT, "%s: header field 'n_heads' = %d does not divide dim = %d", path, n_heads, dim);
    if (n_heads % n_kv)
        return kvm_err(KVM_EFORMAT, "%s: header field 'n_kv_heads' = %d does not divide n_heads = %d", path, n_kv,
                       n_heads);
    int head_dim = dim / n_heads;
    if (head_dim % 2)
        return kvm_err(KVM_EFORMAT, "%s: head size dim/n_heads = %d is odd; RoPE needs pairs", path, head_dim);
    int64_t kv_dim = (int64_t)n_kv * head_dim, L = n_layers, D = dim, H = hidden;
    int64_t floats = (int64_t)vocab * D + L * D + L * D * D + 2 * L * kv_dim * D + L * D * D + L * D + 3 * L * H * D +
                     D + (int64_t)seq * head_dim; /* the two legacy RoPE tables: 2 * seq * head_dim/2 */
    if (!shared) floats += (int64_t)vocab * D;
    int64_t expect = KVM_L2C_HEADER_BYTES + 4 * floats;
    if ((int64_t)bytes != expect)
        return kvm_err(KVM_EFORMAT,
                       "%s: file is %zu bytes but the header (dim=%d hidden_dim=%d n_layers=%d n_heads=%d "
                       "n_kv_heads=%d vocab_size=%d%s seq_len=%d) implies %lld bytes%s",
                       path, bytes, dim, hidden, n_layers, n_heads, n_kv, vocab, shared ? "" : " (separate classifier)",
                       seq, (long long)expect, (int64_t)bytes < expect ? ": truncated" : ": trailing bytes");

    kvm_model_config *c = &m->cfg;
    *c = (kvm_model_config){.dim = dim, .hidden_dim = hidden, .n_layers = n_layers, .n_heads = n_heads,
                            .n_kv_heads = n_kv, .head_dim = head_dim, .vocab_size = vocab, .seq_len = seq,
                            .rope_theta = 10000.0f, .norm_eps = 1e-5f, .rope_style = KVM_ROPE_INTERLEAVED,
                            .shared_classifier = shared, .bos_id = 1, .eos_id = 2};
    snprintf(m->format, sizeof m->format, "llama2c");
    m->layers = calloc((size_t)n_layers, sizeof *m->layers);
    if (!m->layers) return kvm_err(KVM_ENOMEM, "%s: out of memory", path);

    const float *p = (const float *)(const void *)(map + KVM_L2C_HEADER_BYTES);
    m->tok_emb = f32_mat(p);
    p += (int64_t)vocab * D;
    const float *rms_att = p, *wq = rms_att + L * D, *wk = wq + L * D * D, *wv = wk + L * kv_dim * D;
    const float *wo = wv + L * kv_dim * D, *rms_ffn = wo + L * D * D, *w1 = rms_ffn + L * D;
    const float *w2 = w1 + L * H * D, *w3 = w2 + L * D * H, *rms_final = w3 + L * H * D;
    for (int64_t l = 0; l < L; l++) {
        m->layers[l] = (kvm_layer_weights){.rms_att = rms_att + l * D, .wq = f32_mat(wq + l * D * D),
                                           .wk = f32_mat(wk + l * kv_dim * D), .wv = f32_mat(wv + l * kv_dim * D),
                                           .wo = f32_mat(wo + l * D * D), .rms_ffn = rms_ffn + l * D,
                                           .w1 = f32_mat(w1 + l * H * D), .w2 = f32_mat(w2 + l * D * H),
                                           .w3 = f32_mat(w3 + l * H * D)};
    }
    m->rms_final = rms_final;
    const float *after_rope_tables = rms_final + D + (int64_t)seq * head_dim;
    m->wcls = shared ? m->tok_emb : f32_mat(after_rope_tables);
    /* one pass over the weights (not the unused legacy RoPE tables): a NaN or infinity would
     * only show up as garbage tokens or NaN logits later */
    const struct {
        const char *name;
        const float *p;
        int64_t per_layer, layers;
    } arrays[] = {
        {"token_embedding_table", (const float *)(const void *)(map + KVM_L2C_HEADER_BYTES), (int64_t)vocab * D, 0},
        {"rms_att_weight", rms_att, D, L},
        {"wq", wq, D * D, L},
        {"wk", wk, kv_dim * D, L},
        {"wv", wv, kv_dim * D, L},
        {"wo", wo, D * D, L},
        {"rms_ffn_weight", rms_ffn, D, L},
        {"w1", w1, H * D, L},
        {"w2", w2, D * H, L},
        {"w3", w3, H * D, L},
        {"rms_final_weight", rms_final, D, 0},
        {"wcls", shared ? NULL : after_rope_tables, (int64_t)vocab * D, 0}};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++)
        if (arrays[i].p &&
            (rc = check_finite(path, arrays[i].name, arrays[i].p, arrays[i].per_layer, arrays[i].layers)))
            return rc;
    return 0;
}
