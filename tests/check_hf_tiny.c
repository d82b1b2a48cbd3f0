/* check_hf_tiny.c: tiny Hugging Face folders the test writes (weights from kvm_test_tiny_weight,
 * F32 and BF16, one file or sharded with an index) for Llama, Qwen2 (q/k/v biases), Qwen3 (q/k
 * RMSNorm, head_dim != hidden/heads), Llama-3 RoPE scaling and Mistral (sliding window): logits
 * against tests/data/hf/tiny/NAME/reference.txt (scripts/hf_tiny_reference.py, float64 numpy on
 * the same weights); the Llama folders (F32, BF16 sharded) against the same weights as a llama2.c
 * checkpoint and as a GGUF file; 16-bit weights kept 16-bit (bf16 panels = float32 panels); and
 * each malformed config.json or weight set refused with its key or tensor named. */
#include "common/kvm_error.h"
#include "model/kvm_forward.h"
#include "model/kvm_hf.h"
#include "model/kvm_model.h"
#include "store/kvm_store.h"
#include "model/kvm_json.h"
#include "tests/util/kvm_test.h"
#include "tests/util/kvm_test_st.h"
#include "tests/util/kvm_test_gguf.h"
#include "model/kvm_gguf.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TINY_DIR "tests/data/hf/tiny"
#define MAX_T 160

static char *g_tmp;
static void setup(void) { g_tmp = kvm_test_tmpdir(); }
static void teardown(void)
{
    kvm_test_rmtree(g_tmp);
    free(g_tmp);
}

/* A folder's tensors before writing (data owned). */
typedef struct tset {
    kvm_test_st_tensor t[MAX_T];
    float *data[MAX_T];
    int n;
} tset;

static void tset_add(tset *s, const char *name, const char *dtype, int64_t d0, int64_t d1)
{
    ck_assert_int_lt(s->n, MAX_T);
    kvm_test_st_tensor *t = &s->t[s->n];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dtype;
    t->n_dims = d1 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1;
    int64_t n = d0 * (d1 ? d1 : 1);
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = kvm_test_tiny_weight(name, i);
    s->data[s->n] = v;
    t->data = v;
    s->n++;
}

static void tset_free(tset *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->data[i]);
    s->n = 0;
}

static int tset_find(const tset *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->t[i].name, name) == 0) return i;
    return -1;
}

static void tset_drop(tset *s, const char *name)
{
    int i = tset_find(s, name);
    ck_assert_int_ge(i, 0);
    free(s->data[i]);
    memmove(&s->t[i], &s->t[i + 1], (size_t)(s->n - i - 1) * sizeof s->t[0]);
    memmove(&s->data[i], &s->data[i + 1], (size_t)(s->n - i - 1) * sizeof s->data[0]);
    s->n--;
}

/* Every tensor the architecture of config c needs, in the loader's order. */
static void tset_for_config(tset *s, const kvm_model_config *c, int tied, int o_bias, const char *dt)
{
    int64_t D = c->dim, H = c->hidden_dim, Q = (int64_t)c->n_heads * c->head_dim,
            KV = (int64_t)c->n_kv_heads * c->head_dim;
    tset_add(s, "model.embed_tokens.weight", dt, c->vocab_size, D);
    tset_add(s, "model.norm.weight", dt, D, 0);
    if (!tied) tset_add(s, "lm_head.weight", dt, c->vocab_size, D);
    for (int l = 0; l < c->n_layers; l++) {
        char n[128];
#define ADD(part, d0, d1)                                                                                              \
    do {                                                                                                               \
        snprintf(n, sizeof n, "model.layers.%d.%s", l, part);                                                          \
        tset_add(s, n, dt, d0, d1);                                                                                    \
    } while (0)
        ADD("input_layernorm.weight", D, 0);
        ADD("self_attn.q_proj.weight", Q, D);
        ADD("self_attn.k_proj.weight", KV, D);
        ADD("self_attn.v_proj.weight", KV, D);
        ADD("self_attn.o_proj.weight", D, Q);
        if (c->attn_bias) {
            ADD("self_attn.q_proj.bias", Q, 0);
            ADD("self_attn.k_proj.bias", KV, 0);
            ADD("self_attn.v_proj.bias", KV, 0);
        }
        if (o_bias) ADD("self_attn.o_proj.bias", D, 0);
        if (c->qk_norm) {
            ADD("self_attn.q_norm.weight", c->head_dim, 0);
            ADD("self_attn.k_norm.weight", c->head_dim, 0);
        }
        ADD("post_attention_layernorm.weight", D, 0);
        ADD("mlp.gate_proj.weight", H, D);
        ADD("mlp.down_proj.weight", D, H);
        ADD("mlp.up_proj.weight", H, D);
#undef ADD
    }
}

/* Writes s into dir as one model.safetensors, or `shards` files plus the index. */
static void tset_write(const tset *s, const char *dir, int shards)
{
    char p[4096];
    if (shards <= 1) {
        snprintf(p, sizeof p, "%s/model.safetensors", dir);
        ck_assert_int_eq(kvm_test_st_write(p, s->t, s->n), 0);
        return;
    }
    size_t cap = 64 + (size_t)s->n * 200, len = 0;
    char *idx = malloc(cap);
    len += (size_t)snprintf(idx, cap, "{\"metadata\":{},\"weight_map\":{");
    for (int k = 0, first = 0; k < shards; k++) {
        int end = (int)((int64_t)s->n * (k + 1) / shards);
        char fn[64];
        snprintf(fn, sizeof fn, "model-%05d-of-%05d.safetensors", k + 1, shards);
        snprintf(p, sizeof p, "%s/%s", dir, fn);
        ck_assert_int_eq(kvm_test_st_write(p, s->t + first, end - first), 0);
        for (int i = first; i < end; i++)
            len += (size_t)snprintf(idx + len, cap - len, "%s\"%s\":\"%s\"", i ? "," : "", s->t[i].name, fn);
        first = end;
    }
    len += (size_t)snprintf(idx + len, cap - len, "}}");
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    ck_assert_int_eq(kvm_test_write_file(p, idx, len), 0);
    free(idx);
}

/* A reference: dtype, shards, tokens and logits [n][vocab]. */
typedef struct ref {
    char dtype[8];
    int shards, n, vocab;
    int32_t tok[64];
    float *logits;
} ref;

static void ref_read(const char *name, ref *r)
{
    char p[512];
    snprintf(p, sizeof p, TINY_DIR "/%s/reference.txt", name);
    FILE *f = fopen(p, "r");
    ck_assert_msg(f != NULL, "%s missing (scripts/hf_tiny_reference.py writes it)", p);
    ck_assert_int_eq(fscanf(f, "dtype %7s shards %d tokens %d vocab %d", r->dtype, &r->shards, &r->n, &r->vocab), 4);
    ck_assert_int_le(r->n, 64);
    for (int i = 0; i < r->n; i++)
        ck_assert_int_eq(fscanf(f, "%d", &r->tok[i]), 1);
    r->logits = malloc((size_t)r->n * r->vocab * sizeof *r->logits);
    for (int i = 0; i < r->n * r->vocab; i++)
        ck_assert_int_eq(fscanf(f, "%f", &r->logits[i]), 1);
    fclose(f);
}

/* Makes g_tmp/name holding the fixture's config.json and its weights, returns the folder. */
static const char *make_folder(const char *name, tset *s, ref *r, kvm_model_config *c, int *tied)
{
    static char dir[4096];
    char p[4096], q[4096];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, name);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    snprintf(p, sizeof p, TINY_DIR "/%s/config.json", name);
    size_t n;
    char *cfg = kvm_test_read_file(p, &n);
    ck_assert_ptr_nonnull(cfg);
    snprintf(q, sizeof q, "%s/config.json", dir);
    ck_assert_int_eq(kvm_test_write_file(q, cfg, n), 0);
    free(cfg);
    ref_read(name, r);
    char arch[32];
    int o_bias;
    ck_assert_msg(kvm__hf_config(q, c, arch, sizeof arch, tied, &o_bias) == 0, "%s", kvm_errmsg());
    tset_for_config(s, c, *tied, o_bias, strcmp(r->dtype, "BF16") == 0 ? "BF16" : "F32");
    return dir;
}

static float *logits_of(const kvm_model *m, const int32_t *tok, int n)
{
    kvm_forward *f;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_new(m, NULL, n, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(m, n, &c), 0);
    float *l = malloc((size_t)n * m->cfg.vocab_size * sizeof *l);
    ck_assert_msg(kvm_forward_prefill(f, c, tok, n, l, KVM_LOGITS_ALL) == 0, "%s", kvm_errmsg());
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
    return l;
}

/* Max over positions of max|a - b| / max|b|. */
static double rel_diff(const float *a, const float *b, int n, int v)
{
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double d = 0, m = 0;
        for (int j = 0; j < v; j++) {
            d = fmax(d, fabs((double)a[(size_t)i * v + j] - b[(size_t)i * v + j]));
            m = fmax(m, fabs((double)b[(size_t)i * v + j]));
        }
        worst = fmax(worst, d / m);
    }
    return worst;
}

static const char *const tiny_cases[] = {"llama_f32",   "llama_bf16_sharded", "qwen2_bias",
                                    "qwen3_qknorm", "llama3_rope",        "mistral_window"};

START_TEST(test_reference)
{
    const char *name = tiny_cases[_i];
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    const char *dir = make_folder(name, &s, &r, &c, &tied);
    tset_write(&s, dir, r.shards);
    kvm_model *m;
    ck_assert_msg(kvm_model_open(dir, &m) == 0, "%s: %s", name, kvm_errmsg());
    ck_assert_int_eq(m->cfg.vocab_size, r.vocab);
    ck_assert_str_eq(m->dtype, r.dtype);
    float *l = logits_of(m, r.tok, r.n);
    double d = rel_diff(l, r.logits, r.n, r.vocab);
    printf("tiny %s (%s, %d file(s)): max|dlogit| / max|logit| vs numpy float64 = %.3g\n", name, r.dtype, r.shards, d);
    ck_assert_double_le(d, 1e-5);
    if (strcmp(name, "llama3_rope") == 0) {
        ck_assert_int_eq(m->cfg.rope_scaling.type, 1);
        ck_assert_int_eq(m->cfg.n_eos, 2);
        ck_assert(kvm_model_is_eos(&m->cfg, 2) && kvm_model_is_eos(&m->cfg, 5) && !kvm_model_is_eos(&m->cfg, 3));
        /* the scaling matters at these positions: without it the logits move well past the tolerance */
        m->cfg.rope_scaling.type = 0;
        float *l0 = logits_of(m, r.tok, r.n);
        ck_assert_double_gt(rel_diff(l0, r.logits, r.n, r.vocab), 1e-3);
        free(l0);
    }
    if (strcmp(name, "qwen3_qknorm") == 0) ck_assert_int_eq(m->cfg.head_dim * m->cfg.n_heads, 2 * m->cfg.dim);
    /* the matrices stay in the file's dtype until prepared (16-bit in memory for BF16 folders) */
    int bf16 = strcmp(r.dtype, "BF16") == 0;
    ck_assert_int_eq(m->layers[0].wq.type, bf16 ? KVM_MAT_BF16 : KVM_MAT_F32);
    ck_assert_int_eq(m->tok_emb.type, bf16 ? KVM_MAT_BF16 : KVM_MAT_F32);
    ck_assert_int_eq(kvm_model_weight_dtype_for(&m->layers[0].w2, KVM_MODEL_WEIGHTS_AUTO),
                     bf16 ? KVM_WEIGHT_BF16 : KVM_WEIGHT_F32);
    kvm_model_close(&m);
    /* BF16 files: bf16 panels give bit for bit the logits of float32 panels holding the same values;
     * F32 files with bf16 panels: within bf16's rounding (2^-9 relative per weight) */
    ck_assert_int_eq(kvm_model_open(dir, &m), 0);
    ck_assert_int_eq(kvm_model_set_weight_dtype(m, bf16 ? KVM_MODEL_WEIGHTS_F32 : KVM_MODEL_WEIGHTS_BF16), 0);
    float *l2 = logits_of(m, r.tok, r.n);
    if (bf16) ck_assert_msg(memcmp(l, l2, (size_t)r.n * r.vocab * sizeof *l) == 0, "%s: f32 panels differ", name);
    else {
        double d16 = rel_diff(l2, l, r.n, r.vocab);
        printf("tiny %s: bf16 panels vs float32 panels: %.3g\n", name, d16);
        ck_assert_double_le(d16, 2e-2);
        ck_assert_double_gt(d16, 0); /* the setting took effect */
    }
    free(l2);
    free(l);
    free(r.logits);
    kvm_model_close(&m);
    tset_free(&s);
}
END_TEST

/* The Hugging Face row of q/k_proj that the interleaved-pair (llama2.c / GGUF) row r holds:
 * interleaved row (head, i, j) <- half-split row (head, j, i), as llama.cpp's converter permutes. */
static int64_t hf_row(int64_t r, int64_t hd)
{
    int64_t head = r / hd, i = (r % hd) / 2, j = r % 2;
    return head * hd + j * (hd / 2) + i;
}

/* Writes the weights of s as a llama2.c checkpoint (Q/K rows permuted to interleaved pairs;
 * a tied classifier is the embedding, as a positive vocab_size says). */
static void write_llama2c(const char *path, const tset *s, const kvm_model_config *c, int tied)
{
    FILE *f = fopen(path, "wb");
    int32_t h[7] = {c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, tied ? c->vocab_size : -c->vocab_size,
                    c->seq_len};
    fwrite(h, sizeof h, 1, f);
    const char *order[] = {"input_layernorm.weight",   "self_attn.q_proj.weight",         "self_attn.k_proj.weight",
                           "self_attn.v_proj.weight",  "self_attn.o_proj.weight",         "post_attention_layernorm.weight",
                           "mlp.gate_proj.weight",     "mlp.down_proj.weight",            "mlp.up_proj.weight"};
    const kvm_test_st_tensor *e = &s->t[tset_find(s, "model.embed_tokens.weight")];
    fwrite(e->data, sizeof(float), (size_t)(e->shape[0] * e->shape[1]), f);
    for (int k = 0; k < 9; k++)
        for (int l = 0; l < c->n_layers; l++) {
            char n[128];
            snprintf(n, sizeof n, "model.layers.%d.%s", l, order[k]);
            const kvm_test_st_tensor *t = &s->t[tset_find(s, n)];
            int64_t rows = t->shape[0], cols = t->n_dims > 1 ? t->shape[1] : 1;
            for (int64_t r = 0; r < rows; r++)
                fwrite(t->data + (k == 1 || k == 2 ? hf_row(r, c->head_dim) : r) * cols, sizeof(float), (size_t)cols, f);
        }
    const kvm_test_st_tensor *fn = &s->t[tset_find(s, "model.norm.weight")];
    fwrite(fn->data, sizeof(float), (size_t)fn->shape[0], f);
    float zero = 0;
    for (int64_t i = 0; i < (int64_t)c->seq_len * c->head_dim; i++)
        fwrite(&zero, 4, 1, f); /* legacy RoPE tables, unused */
    if (!tied) {
        const kvm_test_st_tensor *cls = &s->t[tset_find(s, "lm_head.weight")];
        fwrite(cls->data, sizeof(float), (size_t)(cls->shape[0] * cls->shape[1]), f);
    }
    ck_assert_int_eq(fclose(f), 0);
}

/* Appends tensor t of s to a GGUF tensor list as `name`, rows permuted for q/k (permute), in
 * type (F32, or BF16: the top half of each float, the bytes the safetensors BF16 file holds). */
static void gguf_add(kvm_test_gguf_tensor *ts, int *n, uint8_t **arena, const kvm_test_st_tensor *t, const char *name,
                     int permute, int type, int64_t hd)
{
    int64_t rows = t->shape[0], cols = t->n_dims > 1 ? t->shape[1] : 1, esz = type == KVM_GGML_BF16 ? 2 : 4;
    uint8_t *b = malloc((size_t)(rows * cols * esz));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float v = t->data[(permute ? hf_row(r, hd) : r) * cols + c];
            uint32_t u;
            memcpy(&u, &v, 4);
            uint16_t h = (uint16_t)(u >> 16);
            memcpy(b + (r * cols + c) * esz, type == KVM_GGML_BF16 ? (const void *)&h : (const void *)&v, (size_t)esz);
        }
    kvm_test_gguf_tensor *g = &ts[(*n)++];
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "%s", name);
    g->n_dims = t->n_dims;
    g->ne[0] = t->n_dims > 1 ? cols : rows; /* ne0 = row length */
    g->ne[1] = t->n_dims > 1 ? rows : 1;
    g->type = type;
    g->data = b;
    g->bytes = (size_t)(rows * cols * esz);
    arena[*n - 1] = b;
}

/* Writes the weights of s as a llama GGUF: matrices in `type` (F32 or BF16), norms F32, Q/K
 * rows permuted to interleaved pairs. */
static void write_gguf(const char *path, const tset *s, const kvm_model_config *c, int tied, int type)
{
    kvm_test_gguf_tensor ts[MAX_T];
    uint8_t *arena[MAX_T];
    int n = 0;
    const int64_t hd = c->head_dim;
    gguf_add(ts, &n, arena, &s->t[tset_find(s, "model.embed_tokens.weight")], "token_embd.weight", 0, type, hd);
    gguf_add(ts, &n, arena, &s->t[tset_find(s, "model.norm.weight")], "output_norm.weight", 0, KVM_GGML_F32, hd);
    if (!tied) gguf_add(ts, &n, arena, &s->t[tset_find(s, "lm_head.weight")], "output.weight", 0, type, hd);
    const char *hf[] = {"input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                        "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                        "mlp.gate_proj.weight",    "mlp.down_proj.weight",    "mlp.up_proj.weight"};
    const char *gg[] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_down", "ffn_up"};
    for (int l = 0; l < c->n_layers; l++)
        for (int k = 0; k < 9; k++) {
            char a[128], b[64];
            snprintf(a, sizeof a, "model.layers.%d.%s", l, hf[k]);
            snprintf(b, sizeof b, "blk.%d.%s.weight", l, gg[k]);
            int norm = k == 0 || k == 5;
            gguf_add(ts, &n, arena, &s->t[tset_find(s, a)], b, k == 1 || k == 2, norm ? KVM_GGML_F32 : type, hd);
        }
    kvm_test_gguf_buf kv = {0};
    kvm_test_gguf_kv_str(&kv, "general.architecture", "llama");
    kvm_test_gguf_kv_u32(&kv, "llama.block_count", (uint32_t)c->n_layers);
    kvm_test_gguf_kv_u32(&kv, "llama.context_length", (uint32_t)c->seq_len);
    kvm_test_gguf_kv_u32(&kv, "llama.embedding_length", (uint32_t)c->dim);
    kvm_test_gguf_kv_u32(&kv, "llama.feed_forward_length", (uint32_t)c->hidden_dim);
    kvm_test_gguf_kv_u32(&kv, "llama.attention.head_count", (uint32_t)c->n_heads);
    kvm_test_gguf_kv_u32(&kv, "llama.attention.head_count_kv", (uint32_t)c->n_kv_heads);
    kvm_test_gguf_kv_f32(&kv, "llama.rope.freq_base", c->rope_theta);
    kvm_test_gguf_kv_f32(&kv, "llama.attention.layer_norm_rms_epsilon", c->norm_eps);
    kvm_test_gguf_kv_u32(&kv, "tokenizer.ggml.bos_token_id", (uint32_t)c->bos_id);
    kvm_test_gguf_kv_u32(&kv, "tokenizer.ggml.eos_token_id", (uint32_t)c->eos_id);
    kvm_test_gguf_buf file = kvm_test_gguf_build(&kv, 11, ts, n);
    ck_assert_int_eq(kvm_test_write_file(path, file.b, file.n), 0);
    free(file.b);
    free(kv.b);
    for (int i = 0; i < n; i++)
        free(arena[i]);
}

/* The Llama folders against the same weights as a llama2.c checkpoint and as a GGUF file
 * (llama2.c and GGUF use interleaved RoPE pairs, so their Q/K rows are permuted): the F32 folder
 * vs llama2.c and an F32 GGUF; the BF16 folder in 3 shards vs a BF16 GGUF (bf16 panels on both
 * sides) and vs llama2.c holding its values in float32. Within 1e-5 relative. */
START_TEST(test_vs_llama2c_gguf)
{
    static const struct {
        const char *fixture;
        int gguf_type;
    } cases[] = {{"llama_f32", KVM_GGML_F32}, {"llama_bf16_sharded", KVM_GGML_BF16}};
    for (int ci = 0; ci < 2; ci++) {
        tset s = {0};
        ref r;
        kvm_model_config c;
        int tied;
        const char *dir = make_folder(cases[ci].fixture, &s, &r, &c, &tied);
        tset_write(&s, dir, r.shards);
        int bf16 = cases[ci].gguf_type == KVM_GGML_BF16;
        if (bf16) /* llama2.c is float32: the values the BF16 files hold */
            for (int i = 0; i < s.n; i++) {
                int64_t ne = s.t[i].shape[0] * (s.t[i].n_dims > 1 ? s.t[i].shape[1] : 1);
                for (int64_t e = 0; e < ne; e++)
                    s.data[i][e] = kvm_test_bf16_trunc(s.data[i][e]);
            }
        char p[4096], q[4096];
        snprintf(p, sizeof p, "%s/%s.bin", g_tmp, cases[ci].fixture);
        snprintf(q, sizeof q, "%s/%s.gguf", g_tmp, cases[ci].fixture);
        write_llama2c(p, &s, &c, tied);
        write_gguf(q, &s, &c, tied, cases[ci].gguf_type);
        kvm_model *a, *b, *g;
        ck_assert_msg(kvm_model_open(dir, &a) == 0, "%s", kvm_errmsg());
        ck_assert_msg(kvm_model_open(p, &b) == 0, "%s", kvm_errmsg());
        ck_assert_msg(kvm_model_open(q, &g) == 0, "%s", kvm_errmsg());
        ck_assert_str_eq(b->format, "llama2c");
        ck_assert_str_eq(g->format, "gguf");
        ck_assert_int_eq(g->layers[0].wq.type, cases[ci].gguf_type);
        float *la = logits_of(a, r.tok, r.n), *lb = logits_of(b, r.tok, r.n), *lg = logits_of(g, r.tok, r.n);
        double db = rel_diff(la, lb, r.n, r.vocab), dg = rel_diff(la, lg, r.n, r.vocab);
        printf("tiny %s: Hugging Face folder vs llama2.c checkpoint of the same weights: %.3g; vs %s GGUF: %.3g\n",
               cases[ci].fixture, db, bf16 ? "BF16" : "F32", dg);
        ck_assert_double_le(db, 1e-5);
        ck_assert_double_le(dg, 1e-5);
        free(la);
        free(lb);
        free(lg);
        free(r.logits);
        kvm_model_close(&a);
        kvm_model_close(&b);
        kvm_model_close(&g);
        tset_free(&s);
    }
}
END_TEST

/* The ids kvmill generate prints (no tokenizer: one id per line), into ids[max]; returns the count. */
static int generate_ids(const char *cmd, int32_t *ids, int max)
{
    char *out = NULL, *err = NULL;
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "%s: exit %d: %s", cmd, rc, err);
    int n = 0;
    for (char *p = out, *e; n < max && *p; p = e) {
        long v = strtol(p, &e, 10);
        if (e == p) break;
        ids[n++] = (int32_t)v;
    }
    free(out);
    free(err);
    return n;
}

/* Generation stops at any of the eos_token_id entries, not only the first: greedy decoding of
 * the Llama folder, then the same with a later generated id added as a second EOS id stops
 * right before it; loop 0 lists it in config.json, loop 1 in generation_config.json (which
 * transformers' generate() stops at, and which was not read). */
START_TEST(test_eos_ids)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    const char *dir = make_folder("llama_f32", &s, &r, &c, &tied);
    tset_write(&s, dir, 1);
    char ids[4096], cmd[8192], cfgp[4096];
    snprintf(ids, sizeof ids, "%s/prompt.ids", g_tmp);
    ck_assert_int_eq(kvm_test_write_file(ids, "1\n5\n7\n", 6), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill generate --model %s --tokens %s -n 24 --temperature 0", kvm_test_bin(), dir,
             ids);
    int32_t a[64], b[64];
    int na = generate_ids(cmd, a, 64), stop = -1;
    for (int i = 4; i < na && stop < 0; i++) { /* a later generated id not seen before, not BOS/EOS */
        int seen = a[i] == 1 || a[i] == 2;
        for (int j = 3; j < i; j++)
            seen |= a[j] == a[i];
        if (!seen) stop = i;
    }
    ck_assert_msg(stop > 0, "no fresh id among %d generated", na - 3);
    char fixed[8192];
    if (_i == 0) {
        snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
        char *cfg = kvm_test_read_file(cfgp, NULL), *at = strstr(cfg, "\"eos_token_id\": 2");
        ck_assert_ptr_nonnull(at);
        snprintf(fixed, sizeof fixed, "%.*s\"eos_token_id\": [2, %d]%s", (int)(at - cfg), cfg, a[stop],
                 at + strlen("\"eos_token_id\": 2"));
        free(cfg);
    } else {
        snprintf(cfgp, sizeof cfgp, "%s/generation_config.json", dir);
        snprintf(fixed, sizeof fixed, "{\"bos_token_id\": 1, \"eos_token_id\": [2, %d], \"do_sample\": false}",
                 a[stop]);
    }
    ck_assert_int_eq(kvm_test_write_file(cfgp, fixed, strlen(fixed)), 0);
    int nb = generate_ids(cmd, b, 64);
    ck_assert_msg(nb == stop, "with EOS ids [2, %d]: %d ids printed, want %d", a[stop], nb, stop);
    ck_assert(memcmp(a, b, (size_t)nb * sizeof *a) == 0);
    free(r.logits);
    tset_free(&s);
}
END_TEST

/* The Mistral folder (sliding_window 48 < 64 positions) refuses positions past the window. */
START_TEST(test_window)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    const char *dir = make_folder("mistral_window", &s, &r, &c, &tied);
    tset_write(&s, dir, 1);
    kvm_model *m;
    ck_assert_int_eq(kvm_model_open(dir, &m), 0);
    ck_assert_int_eq(m->cfg.sliding_window, 48);
    kvm_forward *f;
    kvm_kvcache *kc;
    ck_assert_int_eq(kvm_forward_new(m, NULL, 64, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(m, 64, &kc), 0);
    int32_t tok[49] = {0};
    ck_assert_int_eq(kvm_forward_prefill(f, kc, tok, 48, NULL, KVM_LOGITS_NONE), 0);
    ck_assert_int_eq(kvm_forward_decode(f, kc, 3, NULL), KVM_ENOTSUP);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "sliding_window"));
    ck_assert_msg(strstr(kvm_errmsg(), "config.json") && strstr(kvm_errmsg(), "= 48"), "%s", kvm_errmsg());
    kvm_kvcache_free(&kc);
    kvm_forward_free(&f);
    kvm_model_close(&m);
    free(r.logits);
    tset_free(&s);
}
END_TEST

/* The model id of a folder: BLAKE2b-256 of config.json then the shards in index order; it
 * changes with any weight byte. */
START_TEST(test_model_id)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    const char *dir = make_folder("llama_bf16_sharded", &s, &r, &c, &tied);
    tset_write(&s, dir, 3);
    kvm_store_id a, b, want;
    ck_assert_msg(kvm_store_hash_file(dir, &a) == 0, "%s", kvm_errmsg());
    size_t total = 0, n;
    char *all = NULL, p[4096];
    const char *parts[] = {"config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors"};
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, parts[i]);
        char *bytes = kvm_test_read_file(p, &n);
        ck_assert_ptr_nonnull(bytes);
        all = realloc(all, total + n);
        memcpy(all + total, bytes, n);
        total += n;
        free(bytes);
    }
    kvm_store_hash_bytes(all, total, &want);
    ck_assert_int_eq(memcmp(a.b, want.b, sizeof a.b), 0);
    s.data[tset_find(&s, "model.layers.1.mlp.up_proj.weight")][3] += 1.0f; /* in the last shard */
    tset_write(&s, dir, 3);
    ck_assert_int_eq(kvm_store_hash_file(dir, &b), 0);
    ck_assert_int_ne(memcmp(a.b, b.b, sizeof a.b), 0);
    free(all);
    free(r.logits);
    tset_free(&s);
}
END_TEST

static char *config_with(const char *key, const char *value);

/* `kvmill generate --model DIR --chat` on a folder whose tokenizer_config.json has a Llama-3
 * template (the llama3_style tokenizer.json has its header tokens): the Llama-3 turn format is
 * used; without those tokens --chat is refused, naming the two supported families. */
START_TEST(test_llama3_chat)
{
    char dir[4096], p[4096], cfgp[4096];
    snprintf(dir, sizeof dir, "%s/chat", g_tmp);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    char *cfg = config_with("vocab_size", "800");
    snprintf(cfgp, sizeof cfgp, "%s/config.json", dir);
    ck_assert_int_eq(kvm_test_write_file(cfgp, cfg, strlen(cfg)), 0);
    free(cfg);
    kvm_model_config c;
    char arch[32];
    int tied, o_bias;
    ck_assert_int_eq(kvm__hf_config(cfgp, &c, arch, sizeof arch, &tied, &o_bias), 0);
    tset s = {0};
    tset_for_config(&s, &c, tied, o_bias, "F32");
    tset_write(&s, dir, 1);
    tset_free(&s);
    size_t n;
    char *tok = kvm_test_read_file("tests/data/hf/tokenizers/llama3_style/tokenizer.json", &n);
    ck_assert_ptr_nonnull(tok);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    ck_assert_int_eq(kvm_test_write_file(p, tok, n), 0);
    free(tok);
    static const char tc[] = "{\"chat_template\": \"{{ bos_token }}{% for m in messages %}<|start_header_id|>"
                             "{{ m['role'] }}<|end_header_id|>\\n\\n{{ m['content'] }}<|eot_id|>{% endfor %}\"}";
    snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
    ck_assert_int_eq(kvm_test_write_file(p, tc, strlen(tc)), 0);
    char cmd[8192], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill generate --model %s --chat --prompt hello -n 48 --temperature 0", kvm_test_bin(),
             dir);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    free(out);
    free(err);
    /* a template of neither family */
    static const char tc2[] = "{\"chat_template\": \"{% for m in messages %}[{{ m['role'] }}]{% endfor %}\"}";
    ck_assert_int_eq(kvm_test_write_file(p, tc2, strlen(tc2)), 0);
    rc = kvm_test_run(cmd, &out, &err);
    ck_assert_int_ne(rc, 0);
    ck_assert_msg(strstr(err, "neither ChatML") && strstr(err, "Llama-3"), "stderr: %s", err);
    free(out);
    free(err);
}
END_TEST

/* ---- malformed folders ---- */

/* Writes the llama_f32 folder with config text `cfg` (NULL: the fixture's) and tensors s. */
static const char *folder_with(const char *cfg, const tset *s)
{
    static char dir[4096];
    static int k;
    char p[4096];
    snprintf(dir, sizeof dir, "%s/bad%d", g_tmp, k++);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    snprintf(p, sizeof p, "%s/config.json", dir);
    size_t n;
    char *fix = cfg ? NULL : kvm_test_read_file(TINY_DIR "/llama_f32/config.json", &n);
    ck_assert_int_eq(kvm_test_write_file(p, cfg ? cfg : fix, cfg ? strlen(cfg) : n), 0);
    free(fix);
    if (s) tset_write(s, dir, 1);
    return dir;
}

static void expect_open(const char *dir, int want, const char *n1, const char *n2)
{
    kvm_model *m = NULL;
    int rc = kvm_model_open(dir, &m);
    ck_assert_msg(rc == want, "%s: got %d (%s), want %d", dir, rc, kvm_errmsg(), want);
    ck_assert_ptr_null(m);
    if (n1) ck_assert_msg(strstr(kvm_errmsg(), n1) != NULL, "message '%s' lacks '%s'", kvm_errmsg(), n1);
    if (n2) ck_assert_msg(strstr(kvm_errmsg(), n2) != NULL, "message '%s' lacks '%s'", kvm_errmsg(), n2);
}

/* The fixture's config with one "key": value replaced (or added when absent). */
/* fix (malloc'd, freed here) with key's value replaced by the text value, or key: value added
 * first; a new malloc'd string. */
static char *config_edit(char *fix, const char *key, const char *value)
{
    const size_t n = strlen(fix);
    char *out = malloc(n + 512), pat[128];
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    char *at = strstr(fix, pat);
    if (at) {
        char *end = at + strlen(pat);
        int depth = 0;
        for (; *end && (depth || (*end != ',' && *end != '\n')); end++)
            depth += (*end == '{' || *end == '[') - (*end == '}' || *end == ']');
        sprintf(out, "%.*s%s%s%s", (int)(at - fix), fix, pat, value, end);
    } else {
        sprintf(out, "{%s%s, %s", pat, value, fix + 1);
    }
    free(fix);
    return out;
}

static char *config_with(const char *key, const char *value)
{
    size_t n;
    return config_edit(kvm_test_read_file(TINY_DIR "/llama_f32/config.json", &n), key, value);
}

START_TEST(test_bad_config)
{
    struct {
        const char *key, *value;
        int want;
        const char *n1, *n2;
    } cases[] = {
        {"architectures", "[\"GPT2LMHeadModel\"]", KVM_ENOTSUP, "GPT2LMHeadModel", "not supported"},
        {"architectures", "\"LlamaForCausalLM\"", KVM_EFORMAT, "architectures", NULL},
        /* model_type and architectures naming two models: was read as architectures says, unsaid */
        {"model_type", "\"qwen2\"", KVM_EFORMAT, "model_type 'qwen2' and architectures[0] 'LlamaForCausalLM' disagree",
         NULL},
        {"model_type", "7", KVM_EFORMAT, "model_type", "not a string"},
        {"hidden_size", "null", KVM_EFORMAT, "hidden_size", "missing"},
        {"hidden_size", "\"64\"", KVM_EFORMAT, "hidden_size", "not an integer"},
        {"num_hidden_layers", "0", KVM_EFORMAT, "num_hidden_layers", "outside"},
        {"num_key_value_heads", "3", KVM_EFORMAT, "num_key_value_heads", NULL},
        {"rms_norm_eps", "-1", KVM_EFORMAT, "rms_norm_eps", NULL},
        {"rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}", KVM_ENOTSUP, "yarn", "rope_scaling"},
        {"rope_scaling", "{\"rope_type\": \"dynamic\", \"factor\": 2.0}", KVM_ENOTSUP, "dynamic", NULL},
        {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8.0}", KVM_EFORMAT, "low_freq_factor",
         "rope_scaling"},
        /* transformers 4 runs 'type' (linear) over 'rope_type': was read as plain RoPE, unsaid */
        {"rope_scaling", "{\"type\": \"linear\", \"rope_type\": \"default\", \"factor\": 2.0}", KVM_EFORMAT,
         "'type' 'linear' and 'rope_type' 'default'", "rope_scaling"},
        {"hidden_act", "\"gelu\"", KVM_ENOTSUP, "hidden_act", "gelu"},
        {"mlp_bias", "true", KVM_ENOTSUP, "mlp_bias", NULL},
        {"partial_rotary_factor", "0.5", KVM_ENOTSUP, "partial_rotary_factor", NULL},
        {"eos_token_id", "97", KVM_EFORMAT, "eos_token_id", NULL},
        {"eos_token_id", "[2, 1000]", KVM_EFORMAT, "eos_token_id", "entry 1"},
        /* a float or a string: was "entry 0 is not an id in [0, 256)" */
        {"eos_token_id", "2.0", KVM_EFORMAT, "key 'eos_token_id' is the float 2, not an integer id", NULL},
        {"eos_token_id", "[2, \"3\"]", KVM_EFORMAT, "key 'eos_token_id' entry 1 is the string '3', not an integer id",
         NULL},
        {"bos_token_id", "-1", KVM_EFORMAT, "bos_token_id", NULL},
        {"tie_word_embeddings", "1", KVM_EFORMAT, "tie_word_embeddings", "boolean"},
        {"head_dim", "15", KVM_EFORMAT, "head_dim", "odd"},
        /* were accepted as silu, and refused as "partial_rotary_factor = 0" */
        {"hidden_act", "3", KVM_EFORMAT, "hidden_act", "not a string"},
        {"partial_rotary_factor", "\"0.5\"", KVM_EFORMAT, "partial_rotary_factor", "not a number"},
        /* 0 and infinity as float32: were accepted, the logits NaN */
        {"rope_theta", "1e-300", KVM_EFORMAT, "rope_theta", "float32"},
        /* a RoPE base of at most 1 (frequencies rising with the pair index, or all equal): was accepted */
        {"rope_theta", "0.5", KVM_EFORMAT, "rope_theta = 0.5", "must be > 1"},
        {"rope_theta", "1", KVM_EFORMAT, "rope_theta = 1", "must be > 1"},
        {"rope_theta", "-10000", KVM_EFORMAT, "rope_theta", NULL},
        {"rms_norm_eps", "1e300", KVM_EFORMAT, "rms_norm_eps", "float32"},
        /* a quantized checkpoint: was refused later, at its first I32 or F8 tensor */
        {"quantization_config", "{\"quant_method\": \"gptq\", \"bits\": 4}", KVM_ENOTSUP, "quantization_config",
         "'gptq'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *cfg = config_with(cases[i].key, cases[i].value);
        expect_open(folder_with(cfg, NULL), cases[i].want, cases[i].n1, cases[i].n2);
        ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "config.json"));
        free(cfg);
    }
    expect_open(folder_with("{\"architectures\": [", NULL), KVM_EFORMAT, "config.json", NULL);
    expect_open(folder_with("[]", NULL), KVM_EFORMAT, "config.json", "not a JSON object");
    /* a valid config without weights */
    expect_open(folder_with(NULL, NULL), KVM_ENOTFOUND, "model.safetensors", NULL);
    /* each supported architecture with its own model_type, or none, is read */
    static const char *const pairs[][2] = {
        {"[\"LlamaForCausalLM\"], \"model_type\": \"llama\"", "LlamaForCausalLM"},
        {"[\"MistralForCausalLM\"], \"model_type\": \"mistral\"", "MistralForCausalLM"},
        {"[\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\"", "Qwen2ForCausalLM"},
        {"[\"Qwen3ForCausalLM\"], \"model_type\": \"qwen3\"", "Qwen3ForCausalLM"},
        {"[\"Qwen2ForCausalLM\"], \"model_type\": null", "Qwen2ForCausalLM"}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        char *cfg = config_with("architectures", pairs[i][0]), arch[64];
        kvm_model_config c;
        int tied, o_bias;
        ck_assert_msg(kvm__hf_config_mem("config.json", cfg, strlen(cfg), &c, arch, sizeof arch, &tied, &o_bias) == 0,
                      "%s: %s", pairs[i][0], kvm_errmsg());
        ck_assert_str_eq(arch, pairs[i][1]);
        free(cfg);
    }
    char *swapped = config_with("architectures", "[\"Qwen2ForCausalLM\"], \"model_type\": \"llama\"");
    kvm_model_config c;
    char arch[64];
    int tied, o_bias;
    ck_assert_int_eq(kvm__hf_config_mem("config.json", swapped, strlen(swapped), &c, arch, sizeof arch, &tied, &o_bias),
                     KVM_EFORMAT);
    ck_assert_msg(strstr(kvm_errmsg(), "model_type 'llama' and architectures[0] 'Qwen2ForCausalLM' disagree"), "%s",
                  kvm_errmsg());
    free(swapped);
}
END_TEST

/* kvm__hf_config_mem on config.json's bytes: the config the file gives, and malformed text
 * refused naming the label it was given. */
START_TEST(test_config_mem)
{
    static const char *names[] = {"llama_f32", "llama3_rope", "mistral_window", "qwen2_bias", "qwen3_qknorm"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char p[4096];
        snprintf(p, sizeof p, TINY_DIR "/%s/config.json", names[i]);
        size_t n;
        char *text = kvm_test_read_file(p, &n);
        ck_assert_ptr_nonnull(text);
        kvm_model_config a, b;
        char arch_a[64], arch_b[64];
        int tied_a, tied_b, ob_a, ob_b;
        ck_assert_msg(kvm__hf_config(p, &a, arch_a, sizeof arch_a, &tied_a, &ob_a) == 0, "%s", kvm_errmsg());
        ck_assert_msg(kvm__hf_config_mem("mem.json", text, n, &b, arch_b, sizeof arch_b, &tied_b, &ob_b) == 0, "%s",
                      kvm_errmsg());
        ck_assert_int_eq(memcmp(&a, &b, sizeof a), 0);
        ck_assert_str_eq(arch_a, arch_b);
        ck_assert_int_eq(tied_a, tied_b);
        ck_assert_int_eq(ob_a, ob_b);
        ck_assert_int_eq(kvm__hf_config_mem("cut.json", text, n / 2, &b, arch_b, sizeof arch_b, &tied_b, &ob_b),
                         KVM_EFORMAT);
        ck_assert_msg(strstr(kvm_errmsg(), "cut.json") && strstr(kvm_errmsg(), "line"), "%s", kvm_errmsg());
        free(text);
    }
}
END_TEST

/* transformers 5's rope_parameters (rope_type, rope_theta and the factors in one object, no
 * top-level rope_theta): its theta and type are used (rope_theta was silently 10000), and what
 * kvmill cannot run, or a top-level key that disagrees with it, is refused by name. */
START_TEST(test_rope_parameters)
{
    static const char l3[] = "\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                             "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 32";
    char v[512];
    struct {
        const char *theta, *params;
        int want;
        const char *n1;
    } cases[] = {
        {"null", "{\"rope_type\": \"default\", \"rope_theta\": 500000.0}", 0, NULL},
        {"null", "{\"rope_theta\": 500000.0}", 0, NULL},
        {"500000.0", "{\"rope_theta\": 500000.0, %s}", 1, NULL},
        {"10000.0", "{\"rope_type\": \"default\", \"rope_theta\": 1e6}", KVM_EFORMAT, "disagree"},
        {"null", "{\"full_attention\": {\"rope_theta\": 1e6}}", KVM_ENOTSUP, "per layer type"},
        {"null", "{\"rope_type\": \"yarn\", \"rope_theta\": 1e6, \"factor\": 4.0}", KVM_ENOTSUP,
         "rope_parameters type 'yarn'"},
        {"null", "{\"rope_theta\": 1e6, \"partial_rotary_factor\": 0.5}", KVM_ENOTSUP, "partial_rotary_factor"},
        {"null", "[]", KVM_EFORMAT, "'rope_parameters' is not an object"},
        {"null", "{\"rope_theta\": 0.5}", KVM_EFORMAT, "rope_theta = 0.5 must be > 1 and at most"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char params[256];
        snprintf(params, sizeof params, cases[i].params, l3);
        snprintf(v, sizeof v, "%s, \"rope_parameters\": %s", cases[i].theta, params);
        char *cfg = config_with("rope_theta", v), arch[64];
        kvm_model_config c;
        int tied, ob;
        int rc = kvm__hf_config_mem("config.json", cfg, strlen(cfg), &c, arch, sizeof arch, &tied, &ob);
        int want = cases[i].want == 1 ? 0 : cases[i].want;
        ck_assert_msg(rc == want, "case %zu: got %d (%s), want %d", i, rc, kvm_errmsg(), want);
        if (cases[i].n1) ck_assert_msg(strstr(kvm_errmsg(), cases[i].n1), "case %zu: %s", i, kvm_errmsg());
        if (!rc) ck_assert_float_eq(c.rope_theta, 500000.0f);
        if (!rc) ck_assert_int_eq(c.rope_scaling.type, cases[i].want == 1);
        if (cases[i].want == 1) ck_assert_float_eq(c.rope_scaling.factor, 8.0f);
        free(cfg);
    }
}
END_TEST

/* The sliding window from layer_types (transformers 5) and Qwen3's use_sliding_window: both were
 * ignored (full attention past the window, unlike transformers; a Mistral whose layer_types are
 * all full was still windowed); layer types kvmill cannot run are refused by name. Qwen2/Qwen3's
 * max_window_layers was ignored (every layer slid where transformers slides none), and an absent
 * sliding_window was no window where transformers' classes default it to 4096. */
START_TEST(test_layer_types)
{
    struct {
        const char *key, *value;
        int want, window;
        const char *n1;
        int long_window; /* 1: max_position_embeddings 8192, so that a 4096 window slides */
    } cases[] = {
        {"layer_types", "[\"sliding_attention\", \"sliding_attention\"], \"sliding_window\": 16", 0, 16, NULL, 0},
        {"layer_types", "[\"sliding_attention\", \"full_attention\"], \"sliding_window\": 16", 0, 16, NULL, 0},
        {"layer_types", "[\"full_attention\", \"full_attention\"]", 0, 0, NULL, 0},
        /* Qwen2/Qwen3 as their configuration classes: layer i slides when i >= max_window_layers
           (default 28, more than these 2 layers: none slides), null sliding_window is none,
           an absent one 4096 (here with a window of 8192 positions, so that it slides) */
        {"architectures", "[\"Qwen3ForCausalLM\"], \"use_sliding_window\": true, \"sliding_window\": 16", 0, 0, NULL,
         0},
        {"architectures",
         "[\"Qwen3ForCausalLM\"], \"use_sliding_window\": true, \"sliding_window\": 16, \"max_window_layers\": 1", 0,
         16, NULL, 0},
        {"architectures",
         "[\"Qwen2ForCausalLM\"], \"use_sliding_window\": true, \"sliding_window\": 16, \"max_window_layers\": 0", 0,
         16, NULL, 0},
        {"architectures",
         "[\"Qwen2ForCausalLM\"], \"use_sliding_window\": true, \"sliding_window\": null, \"max_window_layers\": 0", 0,
         0, NULL, 0},
        {"architectures", "[\"Qwen2ForCausalLM\"], \"use_sliding_window\": true, \"max_window_layers\": 0", 0, 4096,
         NULL, 1},
        {"architectures",
         "[\"Qwen2ForCausalLM\"], \"use_sliding_window\": false, \"sliding_window\": 16, \"max_window_layers\": 0", 0,
         0, NULL, 0},
        {"architectures", "[\"Qwen2ForCausalLM\"], \"use_sliding_window\": true, \"max_window_layers\": -1",
         KVM_EFORMAT, 0, "'max_window_layers' = -1", 0},
        {"architectures", "[\"MistralForCausalLM\"]", 0, 4096, NULL, 1},
        {"architectures", "[\"MistralForCausalLM\"], \"sliding_window\": null", 0, 0, NULL, 1},
        {"architectures",
         "[\"MistralForCausalLM\"], \"sliding_window\": 16, \"layer_types\": "
         "[\"full_attention\", \"full_attention\"]",
         0, 0, NULL, 0},
        {"layer_types", "[\"sliding_attention\", \"sliding_attention\"]", KVM_EFORMAT, 0, "'sliding_window' is missing",
         0},
        {"layer_types", "[\"full_attention\"]", KVM_EFORMAT, 0, "num_hidden_layers = 2", 0},
        {"layer_types", "[\"linear_attention\", \"full_attention\"]", KVM_ENOTSUP, 0,
         "layer_types[0] = 'linear_attention'", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *cfg = config_with(cases[i].key, cases[i].value), arch[64];
        if (cases[i].long_window) cfg = config_edit(cfg, "max_position_embeddings", "8192");
        kvm_model_config c;
        int tied, ob;
        int rc = kvm__hf_config_mem("config.json", cfg, strlen(cfg), &c, arch, sizeof arch, &tied, &ob);
        ck_assert_msg(rc == cases[i].want, "case %zu: got %d (%s), want %d", i, rc, kvm_errmsg(), cases[i].want);
        if (cases[i].n1) ck_assert_msg(strstr(kvm_errmsg(), cases[i].n1), "case %zu: %s", i, kvm_errmsg());
        if (!rc)
            ck_assert_msg(c.sliding_window == cases[i].window, "case %zu: window %d, want %d", i, c.sliding_window,
                          cases[i].window);
        free(cfg);
    }
}
END_TEST

/* head_dim absent: hidden_size / num_attention_heads, except for Qwen3, whose configuration class
 * defaults it to 128 (it was read as 64 / 4 = 16 here, a model with other shapes than
 * transformers builds). */
START_TEST(test_head_dim_default)
{
    const struct {
        const char *arch;
        int want;
    } cases[] = {{"[\"LlamaForCausalLM\"]", 16}, {"[\"Qwen2ForCausalLM\"]", 16}, {"[\"Qwen3ForCausalLM\"]", 128}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *cfg = config_with("architectures", cases[i].arch), arch[64];
        kvm_model_config c;
        int tied, ob;
        ck_assert_int_eq(kvm__hf_config_mem("config.json", cfg, strlen(cfg), &c, arch, sizeof arch, &tied, &ob), 0);
        ck_assert_msg(c.head_dim == cases[i].want, "%s: head_dim %d, want %d", cases[i].arch, c.head_dim,
                      cases[i].want);
        free(cfg);
    }
    /* no default where hidden_size is not a multiple of the heads: it said "key 'head_dim' is
     * missing"; it names the two keys now, and a head_dim given is taken */
    char *cfg = config_edit(config_with("num_attention_heads", "3"), "num_key_value_heads", "3"), arch[64];
    kvm_model_config c;
    int tied, ob;
    ck_assert_int_eq(kvm__hf_config_mem("config.json", cfg, strlen(cfg), &c, arch, sizeof arch, &tied, &ob),
                     KVM_EFORMAT);
    ck_assert_msg(
        strstr(kvm_errmsg(), "hidden_size = 64 is not a multiple of num_attention_heads = 3, and no head_dim"), "%s",
        kvm_errmsg());
    cfg = config_edit(cfg, "head_dim", "16");
    ck_assert_msg(kvm__hf_config_mem("config.json", cfg, strlen(cfg), &c, arch, sizeof arch, &tied, &ob) == 0, "%s",
                  kvm_errmsg());
    ck_assert_int_eq(c.head_dim, 16);
    free(cfg);
}
END_TEST

START_TEST(test_bad_tensors)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    make_folder("llama_f32", &s, &r, &c, &tied);
    free(r.logits);
    /* missing */
    tset_drop(&s, "model.layers.1.mlp.up_proj.weight");
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.layers.1.mlp.up_proj.weight'", "missing");
    const char *sharded = folder_with(NULL, NULL); /* named the first shard, which need not hold it */
    tset_write(&s, sharded, 3);
    expect_open(sharded, KVM_EFORMAT, "'model.layers.1.mlp.up_proj.weight' is missing", "none of the 3 files");
    ck_assert_ptr_null(strstr(kvm_errmsg(), "model-00001-of-00003"));
    tset_add(&s, "model.layers.1.mlp.up_proj.weight", "F32", c.hidden_dim, c.dim);
    /* unknown */
    tset_add(&s, "model.layers.0.self_attn.extra.weight", "F32", 4, 0);
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.layers.0.self_attn.extra.weight'", "not part of");
    tset_drop(&s, "model.layers.0.self_attn.extra.weight");
    /* a layer past num_hidden_layers */
    tset_add(&s, "model.layers.2.input_layernorm.weight", "F32", c.dim, 0);
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.layers.2.input_layernorm.weight'", "not part of");
    tset_drop(&s, "model.layers.2.input_layernorm.weight");
    /* wrong shape */
    int k = tset_find(&s, "model.layers.0.self_attn.k_proj.weight");
    s.t[k].shape[0] = c.dim, s.t[k].shape[1] = c.n_kv_heads * c.head_dim; /* transposed */
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.layers.0.self_attn.k_proj.weight'", "shape");
    s.t[k].shape[0] = c.n_kv_heads * c.head_dim, s.t[k].shape[1] = c.dim;
    /* the shapes in the message are the tensor's and the config's (a vector's read "[640]") */
    k = tset_find(&s, "model.norm.weight");
    s.t[k].n_dims = 2, s.t[k].shape[1] = 1;
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.norm.weight' has shape [64, 1]", "needs [64]");
    s.t[k].n_dims = 0, s.t[k].shape[0] = 1;
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.norm.weight' has shape []", "needs [64]");
    s.t[k].n_dims = 1, s.t[k].shape[0] = c.dim;
    /* a bias the architecture does not have */
    tset_add(&s, "model.layers.0.self_attn.q_proj.bias", "F32", c.n_heads * c.head_dim, 0);
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.layers.0.self_attn.q_proj.bias'", "not part of");
    tset_drop(&s, "model.layers.0.self_attn.q_proj.bias");
    /* ignored by rule: rotary_emb.inv_freq */
    tset_add(&s, "model.layers.0.self_attn.rotary_emb.inv_freq", "F32", c.head_dim / 2, 0);
    kvm_model *m;
    ck_assert_msg(kvm_model_open(folder_with(NULL, &s), &m) == 0, "%s", kvm_errmsg());
    kvm_model_close(&m);
    /* lm_head with tie_word_embeddings: equal is ignored, different refused */
    char *cfg = config_with("tie_word_embeddings", "true");
    int e = tset_find(&s, "model.embed_tokens.weight"), h = tset_find(&s, "lm_head.weight");
    memcpy(s.data[h], s.data[e], (size_t)c.vocab_size * c.dim * sizeof(float));
    ck_assert_msg(kvm_model_open(folder_with(cfg, &s), &m) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(m->cfg.shared_classifier, 1);
    ck_assert_ptr_eq(m->wcls.data, m->tok_emb.data);
    kvm_model_close(&m);
    s.data[h][7] += 1;
    expect_open(folder_with(cfg, &s), KVM_EFORMAT, "'lm_head.weight'", "differs");
    free(cfg);
    /* untied without lm_head */
    tset_drop(&s, "lm_head.weight");
    expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'lm_head.weight' is missing", "tie_word_embeddings is false");
    tset_free(&s);
}
END_TEST

/* A NaN or infinity in a weight was loaded silently (garbage tokens, NaN logits); now the
 * loader refuses it naming the file, the tensor and the element, in F32 and BF16 files. */
START_TEST(test_nonfinite)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    make_folder("llama_f32", &s, &r, &c, &tied);
    free(r.logits);
    static const char *const dtypes[] = {"F32", "BF16"};
    for (int d = 0; d < 2; d++) {
        for (int i = 0; i < s.n; i++)
            s.t[i].dtype = dtypes[d];
        int q = tset_find(&s, "model.layers.1.self_attn.q_proj.weight");
        s.data[q][5] = NAN;
        expect_open(folder_with(NULL, &s), KVM_EFORMAT, "'model.layers.1.self_attn.q_proj.weight': element 5 is NaN",
                    "model.safetensors");
        s.data[q][5] = 0.5f;
        int nrm = tset_find(&s, "model.layers.0.post_attention_layernorm.weight");
        s.data[nrm][3] = -INFINITY;
        expect_open(folder_with(NULL, &s), KVM_EFORMAT,
                    "'model.layers.0.post_attention_layernorm.weight': element 3 is -inf", "model.safetensors");
        s.data[nrm][3] = 1.0f;
    }
    kvm_model *m;
    ck_assert_msg(kvm_model_open(folder_with(NULL, &s), &m) == 0, "%s", kvm_errmsg()); /* BF16, all finite */
    kvm_model_close(&m);
    tset_free(&s);
}
END_TEST

/* Folder entries that are not plain files: config.json or model.safetensors as a symbolic link
 * loop, a link to a missing blob (the Hugging Face cache's layout) or a directory are refused
 * naming the entry (they read as "a directory without config.json" or "no model.safetensors");
 * `kvmill info` exits 2 on them, on a --model that is a link loop and on an index naming "."
 * (both exited 1, as for an I/O failure). A file of a folder given as the model is refused
 * naming the folder to give. */
START_TEST(test_bad_entries)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    make_folder("llama_f32", &s, &r, &c, &tied);
    free(r.logits);
    char p[4096], cmd[8192];
    const char *dir = folder_with(NULL, &s);
    snprintf(p, sizeof p, "%s/config.json", dir);
    ck_assert_int_eq(unlink(p), 0);
    ck_assert_int_eq(symlink("../../blobs/c0ffee", p), 0);
    expect_open(dir, KVM_EFORMAT, "config.json: a symbolic link to '../../blobs/c0ffee'", "does not exist");
    ck_assert_int_eq(unlink(p), 0);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    expect_open(dir, KVM_EFORMAT, "config.json: not a regular file", NULL);
    ck_assert_int_eq(rmdir(p), 0);
    ck_assert_int_eq(mkfifo(p, 0644), 0); /* the model id hashes config.json: never a blocking read */
    expect_open(dir, KVM_EFORMAT, "config.json: not a regular file (a FIFO)", NULL);
    kvm_store_id id;
    ck_assert_int_eq(kvm_store_hash_file(dir, &id), KVM_EFORMAT);
    ck_assert_msg(strstr(kvm_errmsg(), "config.json: not a regular file"), "%s", kvm_errmsg());
    dir = folder_with(NULL, NULL);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    ck_assert_int_eq(symlink("model.safetensors", p), 0);
    expect_open(dir, KVM_EFORMAT, "model.safetensors: ", "symbolic links");
    char *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill info --model %s", kvm_test_bin(), dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 2);
    free(err);
    snprintf(p, sizeof p, "%s/loop", g_tmp);
    ck_assert_int_eq(symlink("loop", p), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill info --model %s", kvm_test_bin(), p);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 2);
    ck_assert_msg(strstr(err, "symbolic links"), "%s", err);
    free(err);
    dir = folder_with(NULL, &s);
    /* the index alone (beside model.safetensors, the folder is refused as holding both) */
    char single[4096], aside[4096];
    snprintf(single, sizeof single, "%s/model.safetensors", dir);
    snprintf(aside, sizeof aside, "%s/aside.safetensors", g_tmp);
    ck_assert_int_eq(rename(single, aside), 0);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    static const char idx[] = "{\"weight_map\": {\"model.norm.weight\": \".\"}}";
    ck_assert_int_eq(kvm_test_write_file(p, idx, strlen(idx)), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill info --model %s", kvm_test_bin(), dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 2);
    ck_assert_msg(strstr(err, "index.json") && strstr(err, "'model.norm.weight'"), "%s", err);
    free(err);
    ck_assert_int_eq(rename(aside, single), 0);
    /* a file of the folder as the model: was read as a llama2.c checkpoint ("header field 'dim'") */
    static const char *const parts[] = {"model.safetensors", "config.json", "model.safetensors.index.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, parts[i]);
        expect_open(p, KVM_EFORMAT, "a file of the Hugging Face folder", "give the folder as the model");
    }
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    snprintf(cmd, sizeof cmd, "%s/lone.safetensors", g_tmp);
    ck_assert_int_eq(rename(p, cmd), 0);
    expect_open(cmd, KVM_EFORMAT, "lone.safetensors: a safetensors file, not a model", "folder");
    tset_free(&s);
}
END_TEST

/* generation_config.json's eos_token_id (an id or a list) where config.json has none: it was
 * refused as "key 'eos_token_id' is missing"; its ids are added after config.json's, each once;
 * neither file having the key, a bad id or malformed generation_config.json is refused naming
 * the file. */
START_TEST(test_generation_config)
{
    char *cfg = config_with("eos_token_id", "null"), p[4096];
    const char *dir = folder_with(cfg, NULL);
    free(cfg);
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    struct {
        const char *gen;
        int rc, n_eos, eos0, eos1;
        const char *n1, *n2;
    } cases[] = {
        {"{\"eos_token_id\": 2}", 0, 1, 2, -1, NULL, NULL},
        {"{\"eos_token_id\": [7, 2, 7]}", 0, 2, 7, 2, NULL, NULL},
        {"{\"do_sample\": true}", KVM_EFORMAT, 0, 0, 0, "'eos_token_id' is missing", "generation_config.json has none"},
        {"{\"eos_token_id\": [2, 1000]}", KVM_EFORMAT, 0, 0, 0, "generation_config.json: eos_token_id entry 1", NULL},
        {"{\"eos_token_id\": \"2\"}", KVM_EFORMAT, 0, 0, 0,
         "generation_config.json: key 'eos_token_id' is the string '2'", "not an integer"},
        {"{\"eos_token_id\": []}", KVM_EFORMAT, 0, 0, 0, "generation_config.json: eos_token_id", "empty"},
        {"{\"eos_token_id\": 2", KVM_EFORMAT, 0, 0, 0, "generation_config.json: ", "line 1"},
        {"[2]", KVM_EFORMAT, 0, 0, 0, "generation_config.json: not a JSON object", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ck_assert_int_eq(kvm_test_write_file(p, cases[i].gen, strlen(cases[i].gen)), 0);
        snprintf(p + strlen(dir), sizeof p - strlen(dir), "/config.json");
        kvm_model_config c;
        char arch[64];
        int tied, o_bias, rc = kvm__hf_config(p, &c, arch, sizeof arch, &tied, &o_bias);
        snprintf(p + strlen(dir), sizeof p - strlen(dir), "/generation_config.json");
        ck_assert_msg(rc == cases[i].rc, "%s: got %d (%s)", cases[i].gen, rc, kvm_errmsg());
        if (rc) {
            ck_assert_msg(strstr(kvm_errmsg(), cases[i].n1) && (!cases[i].n2 || strstr(kvm_errmsg(), cases[i].n2)),
                          "%s: %s", cases[i].gen, kvm_errmsg());
            continue;
        }
        ck_assert_int_eq(c.n_eos, cases[i].n_eos);
        ck_assert_int_eq(c.eos_id, cases[i].eos0);
        ck_assert_int_eq(c.eos_ids[0], cases[i].eos0);
        if (c.n_eos > 1) ck_assert_int_eq(c.eos_ids[1], cases[i].eos1);
    }
    /* config.json's id first, then generation_config.json's new ones */
    cfg = config_with("eos_token_id", "[2, 5]");
    dir = folder_with(cfg, NULL);
    free(cfg);
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    static const char gen[] = "{\"eos_token_id\": [5, 9]}";
    ck_assert_int_eq(kvm_test_write_file(p, gen, strlen(gen)), 0);
    snprintf(p, sizeof p, "%s/config.json", dir);
    kvm_model_config c;
    char arch[64];
    int tied, o_bias;
    ck_assert_msg(kvm__hf_config(p, &c, arch, sizeof arch, &tied, &o_bias) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(c.n_eos, 3);
    ck_assert_int_eq(c.eos_ids[0], 2);
    ck_assert_int_eq(c.eos_ids[1], 5);
    ck_assert_int_eq(c.eos_ids[2], 9);
}
END_TEST

/* Prepends a UTF-8 byte-order mark to the file at path. */
static void add_bom(const char *path)
{
    size_t n;
    char *text = kvm_test_read_file(path, &n), *marked = malloc(n + 3);
    ck_assert_ptr_nonnull(text);
    memcpy(marked, "\xEF\xBB\xBF", 3);
    memcpy(marked + 3, text, n);
    ck_assert_int_eq(kvm_test_write_file(path, marked, n + 3), 0);
    free(text);
    free(marked);
}

/* config.json and model.safetensors.index.json that start with a UTF-8 byte-order mark (as
 * Windows editors save them) load as without it; jansson's "'[' or '{' expected near" refused
 * them. kvm__hf_config_mem skips the mark too. */
START_TEST(test_bom)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    const char *dir = make_folder("llama_bf16_sharded", &s, &r, &c, &tied);
    tset_write(&s, dir, 3);
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    add_bom(p);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    add_bom(p);
    kvm_model *m = NULL;
    ck_assert_msg(kvm_model_open(dir, &m) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(memcmp(&m->cfg, &c, sizeof c), 0);
    kvm_model_close(&m);
    size_t n;
    snprintf(p, sizeof p, "%s/config.json", dir);
    char *text = kvm_test_read_file(p, &n), arch[64];
    kvm_model_config b;
    int tb, ob;
    ck_assert_msg(kvm__hf_config_mem("mem.json", text, n, &b, arch, sizeof arch, &tb, &ob) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(memcmp(&b, &c, sizeof c), 0);
    free(text);
    free(r.logits);
    tset_free(&s);
}
END_TEST

/* The Mistral folder's window (sliding_window 48 < 64 positions) with a tokenizer.json: the
 * config's vocab_size raised to the tokenizer's 800, its weights in `shards` files (2 or more:
 * with model.safetensors.index.json). Returns the folder (a static buffer). */
static const char *mistral_with_tokenizer(tset *s, int shards)
{
    static char dir[4096];
    char p[4200];
    snprintf(dir, sizeof dir, "%s/mis", g_tmp);
    ck_assert_int_eq(mkdir(dir, 0755), 0);
    char *cfg = kvm_test_read_file(TINY_DIR "/mistral_window/config.json", NULL);
    ck_assert_ptr_nonnull(cfg);
    char *fixed = config_edit(cfg, "vocab_size", "800");
    snprintf(p, sizeof p, "%s/config.json", dir);
    ck_assert_int_eq(kvm_test_write_file(p, fixed, strlen(fixed)), 0);
    free(fixed);
    kvm_model_config c;
    char arch[32];
    int tied, o_bias;
    ck_assert_msg(kvm__hf_config(p, &c, arch, sizeof arch, &tied, &o_bias) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(c.vocab_size, 800);
    tset_for_config(s, &c, tied, o_bias, "F32");
    tset_write(s, dir, shards);
    size_t n;
    char *tj = kvm_test_read_file("tests/data/hf/tokenizers/llama3_style/tokenizer.json", &n);
    ck_assert_ptr_nonnull(tj);
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    ck_assert_int_eq(kvm_test_write_file(p, tj, n), 0);
    free(tj);
    return dir;
}

/* Runs `kvmill ARGS` (args formatted), checks its exit status and that stderr holds want. */
static void expect_cli(int want_rc, const char *want, const char *args)
{
    char cmd[16384], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' %s", kvm_test_bin(), args);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == want_rc && strstr(err, want), "%s: exit %d (want %d), stderr lacks '%s': %s", args, rc, want_rc,
                  want, err);
    free(out);
    free(err);
}

/* Every up-front window check took seq_len (64) for the window, and the forward then failed
 * (exit 1) past the sliding window of 48: generate -n 0 ran 64 positions, sculpt cut a long
 * document to 64, eval and run passed context + continuation 56. They take 48 now: generate and
 * sculpt run 48 positions (exit 0), eval and run refuse at start (exit 2). */
START_TEST(test_cli_window)
{
    tset s = {0};
    const char *dir = mistral_with_tokenizer(&s, 1);
    const char *doc = kvm_test_data_path("corpus/doc_000.txt");
    char args[12000], ids[4200], cfg[4200], body[12000];
    snprintf(ids, sizeof ids, "%s/p.ids", g_tmp);
    ck_assert_int_eq(kvm_test_write_file(ids, "1\n5\n", 4), 0);
    snprintf(args, sizeof args, "generate --model '%s' --tokens '%s' -n 0 --temperature 0", dir, ids);
    expect_cli(0, "", args);
    snprintf(args, sizeof args, "generate --model '%s' --tokens '%s' -n 60 --temperature 0", dir, ids);
    expect_cli(0, "running its 48 positions", args);
    snprintf(args, sizeof args, "sculpt --model '%s' --doc '%s' --out '%s/c.kvs'", dir, doc, g_tmp);
    expect_cli(0, "its first 48 (the model's window, its config's sliding_window) are the context", args);
    snprintf(args, sizeof args, "sculpt --model '%s' --doc '%s' --context 56 --out '%s/c.kvs'", dir, doc, g_tmp);
    expect_cli(2, "--context 56 is past the model's window of 48 tokens", args);
    /* the continuation's 32 tokens were clamped to 64 - 40 = 24: the forward failed at 48 */
    snprintf(args, sizeof args,
             "sculpt --model '%s' --doc '%s' --context 40 --budget 24 --retain 8 --queries 64 --query-source "
             "continuation --iterations 2 --rounds 1 --out '%s/c.kvs'",
             dir, doc, g_tmp);
    expect_cli(0, "the model's window of 48 tokens leaves 8 positions", args);
    snprintf(args, sizeof args, "eval --model '%s' --docs '%s' --context 40 --continuation 16 --method h2o --budget 16",
             dir, doc);
    expect_cli(2, "exceeds the model's window of 48 tokens, its config's sliding_window", args);
    snprintf(cfg, sizeof cfg, "%s/w.ini", g_tmp);
    snprintf(body, sizeof body,
             "[model]\npath = %s\ncontext = 56\n[compress]\nmethod = h2o\nbudget = 8\n[store]\npath = "
             "%s/st.lmdb\n[stages]\nbin_dir = %s\n",
             dir, g_tmp, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg, body, strlen(body)), 0);
    snprintf(args, sizeof args, "run --config '%s' --corpus '%s'", cfg, kvm_test_data_path("corpus"));
    expect_cli(2, "[model] context = 56 exceeds the model's window of 48 tokens", args);
    tset_free(&s);
}
END_TEST

/* 1 when the file at path holds n bytes equal to data. */
static int same_bytes(const char *path, const char *data, size_t n)
{
    size_t m;
    char *b = kvm_test_read_file(path, &m);
    int same = b && m == n && !memcmp(b, data, n);
    free(b);
    return same;
}

/* sculpt --out and eval --csv naming a file a Hugging Face folder loads (its config.json, a
 * weight shard, the shard index, tokenizer.json, tokenizer_config.json, generation_config.json;
 * also through a symlink or a ./ path) wrote over it, exit 0, the model lost; so did a
 * tokenizer.json beside a llama2.c model. Each is refused now, exit 2, the file unchanged. */
START_TEST(test_out_is_a_model_file)
{
    tset s = {0};
    const char *dir = mistral_with_tokenizer(&s, 2);
    const char *doc = kvm_test_data_path("corpus/doc_000.txt");
    char p[4400], args[12000];
    const char *extra[] = {"tokenizer_config.json", "generation_config.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, extra[i]);
        ck_assert_int_eq(kvm_test_write_file(p, "{}", 2), 0);
    }
    snprintf(p, sizeof p, "%s/link.json", g_tmp);
    char target[4400];
    snprintf(target, sizeof target, "%s/config.json", dir);
    ck_assert_int_eq(symlink(target, p), 0);
    const char *outs[] = {"config.json",
                          "model-00001-of-00002.safetensors",
                          "model-00002-of-00002.safetensors",
                          "model.safetensors.index.json",
                          "tokenizer.json",
                          "tokenizer_config.json",
                          "generation_config.json",
                          "./config.json",
                          NULL};
    for (int i = 0; i < 9; i++) {
        char out[4400], real[4400];
        if (outs[i])
            snprintf(out, sizeof out, "%s/%s", dir, outs[i]);
        else
            snprintf(out, sizeof out, "%s/link.json", g_tmp); /* a symlink to config.json */
        snprintf(real, sizeof real, "%s", outs[i] ? out : target);
        size_t n;
        char *before = kvm_test_read_file(real, &n);
        ck_assert_ptr_nonnull(before);
        snprintf(args, sizeof args, "sculpt --model '%s' --doc '%s' --context 40 --out '%s'", dir, doc, out);
        expect_cli(2, "writing it would destroy that input", args);
        snprintf(args, sizeof args,
                 "eval --model '%s' --docs '%s' --context 16 --continuation 8 --method h2o --budget 8 --csv '%s'", dir,
                 doc, out);
        expect_cli(2, "writing it would destroy that input", args);
        ck_assert_msg(same_bytes(real, before, n), "%s changed", real);
        free(before);
    }
    /* a tokenizer.json beside a llama2.c model file, found without --tokenizer */
    char model[4400];
    size_t nm;
    char *mb = kvm_test_read_file(kvm_test_data_path("models/stories260K.bin"), &nm);
    ck_assert_ptr_nonnull(mb);
    snprintf(model, sizeof model, "%s/m.bin", g_tmp);
    ck_assert_int_eq(kvm_test_write_file(model, mb, nm), 0);
    free(mb);
    snprintf(p, sizeof p, "%s/tokenizer.json", g_tmp);
    ck_assert_int_eq(kvm_test_write_file(p, "{}", 2), 0);
    snprintf(args, sizeof args, "sculpt --model '%s' --doc '%s' --context 40 --out '%s'", model, doc, p);
    expect_cli(2, "is the model's tokenizer.json", args);
    ck_assert(same_bytes(p, "{}", 2));
    tset_free(&s);
}
END_TEST

/* config.json saved as UTF-16 (FF FE or FE FF first): jansson said "unable to decode byte
 * 0xff (line 1, column 0)"; now the message says UTF-16 and to save it as UTF-8, exit 2. */
START_TEST(test_utf16_config)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    make_folder("llama_f32", &s, &r, &c, &tied);
    free(r.logits);
    size_t n;
    char *fix = kvm_test_read_file(TINY_DIR "/llama_f32/config.json", &n);
    ck_assert_ptr_nonnull(fix);
    for (int be = 0; be < 2; be++) {
        char *u = malloc(2 * n + 2);
        u[0] = be ? '\xFE' : '\xFF', u[1] = be ? '\xFF' : '\xFE';
        for (size_t i = 0; i < n; i++)
            u[2 + 2 * i + be] = fix[i], u[2 + 2 * i + !be] = 0;
        const char *dir = folder_with(NULL, &s);
        char p[4096];
        snprintf(p, sizeof p, "%s/config.json", dir);
        ck_assert_int_eq(kvm_test_write_file(p, u, 2 * n + 2), 0);
        expect_open(dir, KVM_EFORMAT,
                    be ? "config.json: starts with a UTF-16 byte-order mark (FE FF)"
                       : "config.json: starts with a UTF-16 byte-order mark (FF FE)",
                    "save it as UTF-8");
        char cmd[8192], *err = NULL;
        snprintf(cmd, sizeof cmd, "%s/kvmill info --model %s", kvm_test_bin(), dir);
        ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 2);
        ck_assert_msg(strstr(err, "UTF-16 byte-order mark"), "%s", err);
        free(err);
        free(u);
    }
    free(fix);
    tset_free(&s);
}
END_TEST

/* A clone of a Hugging Face repository made without git-lfs holds Git LFS pointers in place of
 * model.safetensors and tokenizer.json: they read as "header length 7809644681729863030 is
 * outside [2, ...]" and jansson's "'[' or '{' expected". Both now say what they are. */
START_TEST(test_lfs_pointers)
{
    tset s = {0};
    ref r;
    kvm_model_config c;
    int tied;
    make_folder("llama_f32", &s, &r, &c, &tied);
    free(r.logits);
    static const char ptr[] = "version https://git-lfs.github.com/spec/v1\noid sha256:"
                              "4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 538090408\n";
    const char *dir = folder_with(NULL, &s);
    char p[4096];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    ck_assert_int_eq(kvm_test_write_file(p, ptr, strlen(ptr)), 0);
    expect_open(dir, KVM_EFORMAT, "model.safetensors: a Git LFS pointer", "git lfs pull");
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    ck_assert_int_eq(kvm_test_write_file(p, ptr, strlen(ptr)), 0);
    json_error_t je;
    ck_assert_ptr_null(kvm__json_load_file(p, 0, &je));
    ck_assert_msg(strstr(je.text, "a Git LFS pointer"), "%s", je.text);
    snprintf(p, sizeof p, "%s/bom.json", dir); /* a UTF-8 mark is still skipped */
    ck_assert_int_eq(kvm_test_write_file(p, "\xEF\xBB\xBF{\"a\": 1}", 11), 0);
    json_t *j = kvm__json_load_file(p, 0, &je);
    ck_assert_msg(j && json_integer_value(json_object_get(j, "a")) == 1, "%s", je.text);
    json_decref(j);
    tset_free(&s);
}
END_TEST

static Suite *tiny_suite(void)
{
    Suite *s = suite_create("hf_tiny");
    TCase *tc = tcase_create("reference");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_loop_test(tc, test_reference, 0, (int)(sizeof tiny_cases / sizeof tiny_cases[0]));
    suite_add_tcase(s, tc);
    tc = tcase_create("eos_ids");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_loop_test(tc, test_eos_ids, 0, 2);
    suite_add_tcase(s, tc);
    struct {
        const char *name;
        const TTest *fn;
    } more[] = {{"vs_llama2c_gguf", test_vs_llama2c_gguf},
                {"window", test_window},
                {"cli_window", test_cli_window},
                {"out_is_a_model_file", test_out_is_a_model_file},
                {"model_id", test_model_id},
                {"llama3_chat", test_llama3_chat},
                {"bad_config", test_bad_config},
                {"config_mem", test_config_mem},
                {"rope_parameters", test_rope_parameters},
                {"layer_types", test_layer_types},
                {"head_dim_default", test_head_dim_default},
                {"bad_tensors", test_bad_tensors},
                {"bad_entries", test_bad_entries},
                {"bom", test_bom},
                {"nonfinite", test_nonfinite},
                {"utf16_config", test_utf16_config},
                {"lfs_pointers", test_lfs_pointers},
                {"generation_config", test_generation_config}};
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) {
        tc = tcase_create(more[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, more[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(tiny_suite()); }
