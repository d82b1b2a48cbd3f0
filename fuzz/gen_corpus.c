/* gen_corpus.c: writes the seed corpus of the file fuzzers (fuzz/fuzz_file_*.c) into
 * fuzz/corpus/fuzz_file_<format>/: small valid files of every format, written by the library's
 * own writers where it has one (llama2.c checkpoints, .kvs, strategies, signals CSVs) and by
 * hand after the specs otherwise (GGUF, safetensors), plus copies of the repository's small
 * valid files (data/models/tok512.bin; tests/data/hf's config.json and tokenizer.json files).
 * Each seed is under 64 KB. Not part of the build: `make fuzz-seeds` compiles and runs it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "compress/sculpt/kvm_sculpt_file.h"
#include "model/kvm_gguf.h"
#include "model/kvm_model.h"

static const char *g_root;

static void die(const char *what)
{
    fprintf(stderr, "gen_corpus: %s: %s (%s)\n", what, kvm_errmsg(), strerror(errno));
    exit(1);
}

static char *seed_path(const char *target, const char *seed)
{
    static char path[4096];
    snprintf(path, sizeof path, "%s/fuzz_file_%s", g_root, target);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) die(path);
    snprintf(path, sizeof path, "%s/fuzz_file_%s/seed_%s", g_root, target, seed);
    return path;
}

static void write_seed(const char *target, const char *seed, const void *data, size_t n)
{
    const char *path = seed_path(target, seed);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) die(path);
}

/* The bytes of a file (malloc'ed; *n its size). */
static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) die(path);
    uint8_t *b = NULL;
    size_t cap = 0;
    *n = 0;
    for (;;) {
        if (*n == cap && !(b = realloc(b, cap = cap * 2 + 4096))) die("realloc");
        size_t r = fread(b + *n, 1, cap - *n, f);
        *n += r;
        if (r == 0) break;
    }
    fclose(f);
    return b;
}

static void copy_seed(const char *target, const char *seed, const char *src, const uint8_t *prefix, size_t np)
{
    size_t n;
    uint8_t *b = slurp(src, &n), *c = malloc(np + n);
    if (!c) die("malloc");
    memcpy(c, prefix, np);
    memcpy(c + np, b, n);
    write_seed(target, seed, c, np + n);
    free(b), free(c);
}

/* ---- a growing buffer for the hand-written formats ---- */
typedef struct wbuf {
    uint8_t *b;
    size_t n, cap;
} wbuf;

static void put(wbuf *w, const void *p, size_t n)
{
    if (w->n + n > w->cap && !(w->b = realloc(w->b, w->cap = (w->n + n) * 2 + 256))) die("realloc");
    memcpy(w->b + w->n, p, n);
    w->n += n;
}
static void u32(wbuf *w, uint32_t v) { put(w, &v, 4); }
static void u64(wbuf *w, uint64_t v) { put(w, &v, 8); }
static void gstr(wbuf *w, const char *s)
{
    u64(w, strlen(s));
    put(w, s, strlen(s));
}
static void kv_str(wbuf *w, const char *k, const char *v) { gstr(w, k), u32(w, KVM_GGUF_STRING), gstr(w, v); }
static void kv_u32(wbuf *w, const char *k, uint32_t v) { gstr(w, k), u32(w, KVM_GGUF_U32), u32(w, v); }
static void kv_f32(wbuf *w, const char *k, float v) { gstr(w, k), u32(w, KVM_GGUF_F32), put(w, &v, 4); }
static void kv_strs(wbuf *w, const char *k, const char *const *v, int n)
{
    gstr(w, k), u32(w, KVM_GGUF_ARRAY), u32(w, KVM_GGUF_STRING), u64(w, (uint64_t)n);
    for (int i = 0; i < n; i++)
        gstr(w, v[i]);
}
static void kv_i32s(wbuf *w, const char *k, const int32_t *v, int n)
{
    gstr(w, k), u32(w, KVM_GGUF_ARRAY), u32(w, KVM_GGUF_I32), u64(w, (uint64_t)n);
    put(w, v, 4 * (size_t)n);
}
static void kv_f32s(wbuf *w, const char *k, const float *v, int n)
{
    gstr(w, k), u32(w, KVM_GGUF_ARRAY), u32(w, KVM_GGUF_F32), u64(w, (uint64_t)n);
    put(w, v, 4 * (size_t)n);
}

/* ---- GGUF (v3, 32-byte alignment) ---- */
typedef struct gtensor {
    const char *name;
    int64_t ne0, ne1; /* ne1 = 0: one dimension */
    int type;
} gtensor;

/* Deterministic block bytes whose 2-byte scales are a finite half (1/16). */
static void fill(uint8_t *p, size_t n, int type, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((seed = seed * 1664525u + 1013904223u) >> 24);
    size_t bb = (size_t)kvm_ggml_block_bytes(type);
    uint16_t half = 0x2C00;
    for (size_t b = 0; b < n / bb; b++) {
        uint8_t *blk = p + b * bb;
        if (type == KVM_GGML_F32) {
            float f = (float)((int)blk[0] - 128) / 256.0f;
            memcpy(blk, &f, 4);
        } else if (type == KVM_GGML_BF16) {
            blk[1] = 0x3D;
        } else if (type == KVM_GGML_Q6_K) {
            memcpy(blk + 208, &half, 2);
        } else {
            memcpy(blk, &half, 2);
            if (type == KVM_GGML_Q4_1 || type == KVM_GGML_Q5_1 || type == KVM_GGML_Q4_K) memcpy(blk + 2, &half, 2);
        }
    }
}

static void gguf_seed(const char *seed, const wbuf *kv, uint64_t n_kv, const gtensor *ts, int nt)
{
    wbuf w = {0};
    put(&w, "GGUF", 4), u32(&w, 3), u64(&w, (uint64_t)nt), u64(&w, n_kv);
    put(&w, kv->b, kv->n);
    uint64_t off = 0, bytes[16];
    for (int i = 0; i < nt; i++) {
        gstr(&w, ts[i].name);
        u32(&w, ts[i].ne1 ? 2 : 1);
        u64(&w, (uint64_t)ts[i].ne0);
        if (ts[i].ne1) u64(&w, (uint64_t)ts[i].ne1);
        u32(&w, (uint32_t)ts[i].type);
        u64(&w, off);
        int64_t rows = ts[i].ne1 ? ts[i].ne1 : 1;
        bytes[i] = (uint64_t)(rows * ts[i].ne0 / kvm_ggml_block_elems(ts[i].type) * kvm_ggml_block_bytes(ts[i].type));
        off += (bytes[i] + 31) / 32 * 32;
    }
    static const uint8_t zero[32];
    put(&w, zero, (32 - w.n % 32) % 32);
    for (int i = 0; i < nt; i++) {
        uint8_t *d = malloc(bytes[i]);
        if (!d) die("malloc");
        fill(d, bytes[i], ts[i].type, (uint32_t)i * 7919u + 1);
        put(&w, d, bytes[i]);
        free(d);
        if (i + 1 < nt) put(&w, zero, (32 - bytes[i] % 32) % 32);
    }
    write_seed("gguf", seed, w.b, w.n);
    free(w.b);
}

/* A tiny llama (dim 64, one layer, 2 heads, 1 KV head, vocab 16) with a gpt2 or llama
 * (SentencePiece) tokenizer in its metadata; every tensor type kvmill dequantises but the
 * K-quants (their 256-element blocks need wider rows) appears once. */
static void gguf_tiny_llama(const char *seed, int spm)
{
    enum { D = 64, H = 64, V = 16 };
    static const char *gpt2_toks[V] = {"<|endoftext|>",
                                       "a",
                                       "b",
                                       "c",
                                       "\xc4\xa0",
                                       "bc",
                                       "ab",
                                       "abc",
                                       "\xc4\xa0"
                                       "c",
                                       "1",
                                       "x",
                                       "<|im_start|>",
                                       "<|im_end|>",
                                       "d",
                                       "e",
                                       "f"};
    static const char *spm_toks[V] = {"<unk>",
                                      "<s>",
                                      "</s>",
                                      "<0x41>",
                                      "<0x42>",
                                      "\xe2\x96\x81",
                                      "a",
                                      "b",
                                      "c",
                                      "ab",
                                      "\xe2\x96\x81"
                                      "a",
                                      "bc",
                                      "abc",
                                      "\xe2\x96\x81"
                                      "ab",
                                      "x",
                                      "1"};
    static const int32_t gpt2_types[V] = {3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 3, 3, 1, 1, 1};
    static const int32_t spm_types[V] = {2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    static const char *merges[] = {"b c", "a b", "a bc", "\xc4\xa0 c"};
    float scores[V];
    for (int i = 0; i < V; i++)
        scores[i] = -(float)i;
    wbuf kv = {0};
    uint64_t n = 0;
    kv_str(&kv, "general.architecture", "llama"), n++;
    kv_u32(&kv, "llama.block_count", 1), n++;
    kv_u32(&kv, "llama.context_length", 64), n++;
    kv_u32(&kv, "llama.embedding_length", D), n++;
    kv_u32(&kv, "llama.feed_forward_length", H), n++;
    kv_u32(&kv, "llama.attention.head_count", 2), n++;
    kv_u32(&kv, "llama.attention.head_count_kv", 1), n++;
    kv_f32(&kv, "llama.rope.freq_base", 10000.0f), n++;
    kv_f32(&kv, "llama.attention.layer_norm_rms_epsilon", 1e-5f), n++;
    kv_u32(&kv, "tokenizer.ggml.bos_token_id", spm ? 1 : 0), n++;
    kv_u32(&kv, "tokenizer.ggml.eos_token_id", spm ? 2 : 12), n++;
    kv_str(&kv, "general.alignment_comment", "32-byte data"), n++;
    if (spm) {
        kv_str(&kv, "tokenizer.ggml.model", "llama"), n++;
        kv_strs(&kv, "tokenizer.ggml.tokens", spm_toks, V), n++;
        kv_f32s(&kv, "tokenizer.ggml.scores", scores, V), n++;
        kv_i32s(&kv, "tokenizer.ggml.token_type", spm_types, V), n++;
        kv_u32(&kv, "tokenizer.ggml.unknown_token_id", 0), n++;
    } else {
        kv_str(&kv, "tokenizer.ggml.model", "gpt2"), n++;
        kv_str(&kv, "tokenizer.ggml.pre", "smollm"), n++;
        kv_strs(&kv, "tokenizer.ggml.tokens", gpt2_toks, V), n++;
        kv_i32s(&kv, "tokenizer.ggml.token_type", gpt2_types, V), n++;
        kv_strs(&kv, "tokenizer.ggml.merges", merges, 4), n++;
        kv_str(&kv, "tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"), n++;
    }
    gtensor ts[] = {{"token_embd.weight", D, V, KVM_GGML_Q8_0},        {"output_norm.weight", D, 0, KVM_GGML_F32},
                    {"blk.0.attn_norm.weight", D, 0, KVM_GGML_F32},    {"blk.0.attn_q.weight", D, D, KVM_GGML_Q4_0},
                    {"blk.0.attn_k.weight", D, 32, KVM_GGML_Q4_1},     {"blk.0.attn_v.weight", D, 32, KVM_GGML_Q5_0},
                    {"blk.0.attn_output.weight", D, D, KVM_GGML_Q5_1}, {"blk.0.ffn_norm.weight", D, 0, KVM_GGML_F32},
                    {"blk.0.ffn_gate.weight", D, H, KVM_GGML_F16},     {"blk.0.ffn_down.weight", H, D, KVM_GGML_Q8_0},
                    {"blk.0.ffn_up.weight", D, H, KVM_GGML_BF16},      {"output.weight", D, V, KVM_GGML_F16}};
    gguf_seed(seed, &kv, n, ts, (int)(sizeof ts / sizeof ts[0]));
    free(kv.b);
}

/* Tensors of the K-quant types (rows of 256) and a u64, i64, f64, bool and nested array key. */
static void gguf_kquants(void)
{
    wbuf kv = {0};
    kv_str(&kv, "general.architecture", "llama");
    gstr(&kv, "general.u64"), u32(&kv, KVM_GGUF_U64), u64(&kv, 1ull << 40);
    gstr(&kv, "general.i64"), u32(&kv, KVM_GGUF_I64), u64(&kv, (uint64_t)-5);
    double d = 0.25;
    gstr(&kv, "general.f64"), u32(&kv, KVM_GGUF_F64), put(&kv, &d, 8);
    uint8_t t = 1;
    gstr(&kv, "general.bool"), u32(&kv, KVM_GGUF_BOOL), put(&kv, &t, 1);
    gstr(&kv, "general.nested"), u32(&kv, KVM_GGUF_ARRAY), u32(&kv, KVM_GGUF_ARRAY), u64(&kv, 1);
    u32(&kv, KVM_GGUF_U16), u64(&kv, 2), put(&kv, "\1\0\2\0", 4);
    kv_u32(&kv, "general.alignment", 32);
    gtensor ts[] = {{"q4k", 256, 2, KVM_GGML_Q4_K}, {"q6k", 256, 1, KVM_GGML_Q6_K}};
    gguf_seed("kquants", &kv, 8, ts, 2);
    free(kv.b);
}

/* ---- safetensors ---- */
static void st_seed(const char *seed, const char *header, size_t data_bytes)
{
    wbuf w = {0};
    size_t hl = strlen(header), pad = (8 - hl % 8) % 8;
    u64(&w, hl + pad);
    put(&w, header, hl);
    put(&w, "        ", pad);
    for (size_t i = 0; i < data_bytes; i++) {
        uint8_t b = (uint8_t)(i * 37 + 11) & 0x3f; /* finite values of every dtype */
        put(&w, &b, 1);
    }
    write_seed("safetensors", seed, w.b, w.n);
    free(w.b);
}

static void safetensors(void)
{
    st_seed("f32",
            "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],"
            "\"data_offsets\":[0,24]},\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[24,40]}}",
            40);
    st_seed("mixed",
            "{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,2,2],\"data_offsets\":[0,16]},"
            "\"h\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[16,22]},"
            "\"s\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[22,26]},"
            "\"e\":{\"dtype\":\"F16\",\"shape\":[0,5],\"data_offsets\":[26,26]}}",
            26);
    st_seed("empty", "{}", 0);
}

/* model.safetensors.index.json for the shards fuzz_file_st_index.c writes (a, b in shard 1, c in
 * shard 2): as transformers saves it, without metadata, and naming the symlink to shard 2. */
static void st_index(void)
{
    static const char *const seeds[][2] = {
        {"two_shards", "{\"metadata\": {\"total_size\": 44},\n \"weight_map\": {\"a\": "
                       "\"model-00001-of-00002.safetensors\", \"b\": \"model-00001-of-00002.safetensors\", "
                       "\"c\": \"model-00002-of-00002.safetensors\"}}\n"},
        {"no_metadata", "{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\"}}"},
        {"symlink", "{\"weight_map\":{\"c\":\"link.safetensors\"}}"},
    };
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; i++)
        write_seed("st_index", seeds[i][0], seeds[i][1], strlen(seeds[i][1]));
}

/* ---- llama2.c checkpoints and tokenizers ---- */
static void llama2c(const char *seed, kvm_make_model_opts o)
{
    const char *tmp = seed_path("llama2c", seed);
    if (kvm_make_model_write(tmp, &o) != 0) die(tmp);
}

/* ---- .kvs (kvm_sculpt_cache_write) ---- */
static void sculpt(const char *seed, int n_layers, int n_kv, int head_dim, int n_distilled, int n_tokens)
{
    kvm_kvcache *c = NULL;
    if (kvm_kvcache_new(n_layers, n_kv, head_dim, 0, &c) != 0) die("kvcache");
    float k[64], v[64];
    for (int h = 0; h < n_layers * n_kv; h++) {
        for (int j = 0; j < n_distilled + n_tokens; j++) {
            for (int d = 0; d < head_dim; d++)
                k[d] = (float)(h + j) / 8 - (float)d / 16, v[d] = (float)(d - j) / 4;
            int32_t pos = j < n_distilled ? KVM_POS_NONE : 2 * (j - n_distilled) + h % 2;
            if (kvm_kvcache_append(&c->heads[h], head_dim, k, v, pos, j < n_distilled ? 0.5f * (float)j : 0) != 0)
                die("append");
        }
    }
    c->next_pos = 2 * n_tokens + 1;
    const char *path = seed_path("sculpt", seed);
    if (kvm_sculpt_cache_write(path, c) != 0) die(path);
    kvm_kvcache_free(&c);
}

/* ---- signals CSVs (kvm_polykv_signals_csv), for a model of n_layers (the seed's first byte) ---- */
static void signals(const char *seed, int n_layers, int prefill_only, int distilled, int opts)
{
    kvm_polykv_signals *s = NULL;
    if (kvm_polykv_signals_new(n_layers, &s) != 0) die("signals");
    const int L = n_layers, P = KVM_PATTERN_COUNT;
    for (int ph = 0; ph < 2; ph++)
        for (int l = 0; l < L; l++) {
            double worst = 0;
            for (int r = 0; r < P; r++) {
                s->cosine[(ph * L + l) * P + r] = r == (l + ph) % 4 ? 0.99 : 0.9 - 0.01 * r;
                s->ppl_delta[(ph * L + l) * P + r] = r == 3 - l % 4 ? 0.01 : 0.5 + 0.1 * r;
                s->kl[(ph * L + l) * P + r] = 0.001 * (r + 1);
                if (s->ppl_delta[(ph * L + l) * P + r] > worst) worst = s->ppl_delta[(ph * L + l) * P + r];
            }
            s->worst_ppl[ph * L + l] = worst;
        }
    for (int l = 0; l < L; l++) {
        s->entropy[l] = 1.0 + l;
        s->sculpt_cosine[l] = s->kvzip_cosine[l] = 0.97;
        s->sculpt_ppl[l] = s->kvzip_ppl[l] = 0.05;
        s->sculpt_kl[l] = s->kvzip_kl[l] = 0.002;
    }
    s->budget = 16;
    s->prefill_only = prefill_only;
    s->has_sculpt = s->has_kvzip = distilled;
    if (opts) {
        s->sculpt_opts_known = 1;
        s->sculpt_opts = kvm_sculpt_opts_default();
    }
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (!f) die("open_memstream");
    fputc(n_layers - 1, f);
    if (kvm_polykv_signals_csv(s, f) != 0) die("signals csv");
    fclose(f);
    write_seed("signals", seed, text, n);
    free(text);
    kvm_polykv_signals_free(&s);
}

/* ---- strategies (kvm_strategy_encode) ---- */
/* distilled_known: the options of its sculpt/kvzip layers recorded (v2); with_model: a model id
 * recorded too (v3). */
static void strategy(const char *seed, int n_layers, const kvm_pattern *pat, int distilled_known, int with_model)
{
    kvm_strategy *s = NULL;
    if (kvm_strategy_new(n_layers, &s) != 0) die("strategy");
    s->budget_avg = 16;
    s->b_min = 4;
    s->select = KVM_POLYKV_SELECT_COSINE;
    s->alloc = KVM_POLYKV_ALLOC_ENTROPY;
    s->alloc_power = 1.5;
    s->head_split = 1;
    for (int l = 0; l < n_layers; l++) {
        s->layers[l].pattern[0] = s->layers[l].pattern[1] = pat[l];
        s->layers[l].budget = 16 + (l % 2 ? -4 : 4) * (l + 1 < n_layers || n_layers % 2 == 0);
    }
    if (distilled_known) {
        s->sculpt_known = 1;
        s->sculpt = kvm_sculpt_opts_default();
    }
    uint8_t id[KVM_STRATEGY_MODEL_ID_BYTES];
    for (int i = 0; i < KVM_STRATEGY_MODEL_ID_BYTES; i++)
        id[i] = (uint8_t)(31 * i + 5);
    if (with_model) kvm_strategy_set_model(s, id);
    uint8_t *b = NULL;
    size_t n = 0;
    if (kvm_strategy_encode(s, &b, &n) != 0) die("strategy encode");
    write_seed("strategy", seed, b, n);
    free(b);
    kvm_strategy_free(&s);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_corpus OUTDIR (fuzz/corpus)\n");
        return 2;
    }
    g_root = argv[1];
    if (mkdir(g_root, 0755) != 0 && errno != EEXIST) die(g_root);

    gguf_tiny_llama("llama_gpt2", 0);
    gguf_tiny_llama("llama_spm", 1);
    gguf_kquants();
    safetensors();
    st_index();
    llama2c("shared", (kvm_make_model_opts){8, 16, 1, 2, 1, 32, 8, 0, 1});
    llama2c("separate_gqa", (kvm_make_model_opts){16, 24, 2, 4, 2, 24, 4, 1, 2});
    /* tok512.bin for a vocabulary of 512: the fuzzer's first two bytes give 259 + u16 % 1024 */
    const uint8_t v512[2] = {253, 0}, v259[2] = {0, 0};
    copy_seed("tok_llama2c", "tok512", "data/models/tok512.bin", v512, 2);
    /* its first 259 records alone: 4 + Σ (8 + len) bytes */
    {
        size_t n;
        uint8_t *b = slurp("data/models/tok512.bin", &n), *c = malloc(n + 2);
        size_t off = 4;
        for (int i = 0; i < 259; i++) {
            int32_t len;
            memcpy(&len, b + off + 4, 4);
            off += 8 + (size_t)len;
        }
        memcpy(c, v259, 2);
        memcpy(c + 2, b, off);
        write_seed("tok_llama2c", "first259", c, off + 2);
        free(b), free(c);
    }
    static const char *configs[] = {"llama3_rope",    "llama_bf16_sharded", "llama_f32",
                                    "mistral_window", "qwen2_bias",         "qwen3_qknorm"};
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        char src[256];
        snprintf(src, sizeof src, "tests/data/hf/tiny/%s/config.json", configs[i]);
        copy_seed("hf_config", configs[i], src, NULL, 0);
    }
    static const char rope_parameters[] = /* transformers 5: theta and llama3 factors in rope_parameters */
        "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 96, "
        "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 97, "
        "\"max_position_embeddings\": 64, \"eos_token_id\": [2, 3], \"rope_parameters\": {\"rope_type\": "
        "\"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
        "\"original_max_position_embeddings\": 32}}\n";
    write_seed("hf_config", "rope_parameters", rope_parameters, sizeof rope_parameters - 1);
    static const char *toks[] = {"llama3_style", "metaspace_style", "qwen_style", "spm_style"};
    for (size_t i = 0; i < sizeof toks / sizeof toks[0]; i++) {
        char src[256];
        snprintf(src, sizeof src, "tests/data/hf/tokenizers/%s/tokenizer.json", toks[i]);
        copy_seed("tokenizer_json", toks[i], src, NULL, 0);
    }
    sculpt("small", 2, 2, 4, 2, 3);
    sculpt("tokens_only", 1, 1, 8, 0, 5);
    sculpt("empty_heads", 1, 3, 2, 0, 0);
    const kvm_pattern evict[4] = {KVM_PATTERN_STREAMING, KVM_PATTERN_H2O, KVM_PATTERN_TOVA, KVM_PATTERN_SNAPKV};
    const kvm_pattern mixed[3] = {KVM_PATTERN_SCULPT, KVM_PATTERN_H2O, KVM_PATTERN_KVZIP};
    signals("both_phases", 2, 0, 0, 0);
    signals("prefill_distilled_opts", 3, 1, 1, 1);
    strategy("v1", 4, evict, 0, 0);
    strategy("v2_sculpt", 3, mixed, 1, 0);
    strategy("v3", 4, evict, 0, 1);
    strategy("v3_sculpt", 3, mixed, 1, 1);
    strategy("v3_sculpt_unknown_opts", 3, mixed, 0, 1);
    return 0;
}
