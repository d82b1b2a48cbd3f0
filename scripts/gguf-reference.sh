#!/usr/bin/env bash
# gguf-reference.sh: regenerates tests/data/smollm2/ (the llama.cpp reference outputs that
# tests/check_gguf*.c compare kvmill against) from llama.cpp itself. Not run in CI: it builds
# llama.cpp (vendored in the llama-cpp-python sdist from PyPI) outside the repository, CPU
# only, then runs the small driver below against libllama on models/SmolLM2-135M-Instruct.Q4_1.gguf.
#   LLAMA_DIR   build folder (default /tmp/llamacpp); the sdist is unpacked and built there
#   JOBS        parallel build jobs (default 2)
# Outputs (layouts in tests/data/smollm2/README.md):
#   texts/NN_*.ids     llama_tokenize(add_special = false, parse_special = true) of texts/NN_*.txt
#   seq256.ids         the first 256 tokens of ../shared/data/long2k/doc_000.txt
#   seq256.topk.bin    per position: logsumexp and the top 64 logits (id, value)
#   seq256.full.bin    all 49152 logits at 4 positions
#   greedy.ids         prompt ids, then 64 greedily generated ids
#   dequant.fnv        ggml's dequantisation of every tensor: name, type, elements, FNV-1a 64
#   f32/               seq256.topk.bin, seq256.full.bin, greedy.ids again, from llama.cpp on the
#                      same weights dequantised to F32 (float32 matmuls, like kvmill's)
# llama.cpp runs with a float32 KV cache, flash attention off and no extra (AMX / repacked)
# weight buffers (its default f16 cache would
# add rounding kvmill does not have); the weights' matmuls are llama.cpp's usual quantized
# kernels (activations quantized to Q8_1 for Q4_1 / Q8_0 weights).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SHARED="${KVMILL_SHARED:-$ROOT/../shared}"
LLAMA_DIR="${LLAMA_DIR:-/tmp/llamacpp}"
JOBS="${JOBS:-2}"
MODEL="$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT="$ROOT/tests/data/smollm2"
VERSION=0.3.36   # llama-cpp-python sdist whose vendor/llama.cpp the reference was made with

[ -f "$MODEL" ] || bash "$ROOT/scripts/get-model.sh"
mkdir -p "$LLAMA_DIR"
SRC="$LLAMA_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
    python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$LLAMA_DIR"
    tar -xzf "$LLAMA_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$LLAMA_DIR"
fi
B="$LLAMA_DIR/build"
if [ ! -f "$B/src/libllama.a" ]; then
    nice cmake -S "$SRC" -B "$B" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF
    nice cmake --build "$B" -j"$JOBS" --target llama
fi

cat >"$LLAMA_DIR/kvm_ref.c" <<'EOF'
/* kvm_ref.c: llama.cpp reference outputs for kvmill's GGUF tests (scripts/gguf-reference.sh). */
#include "llama.h"
#include "gguf.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { TOPK = 64, N_SEQ = 256, N_GEN = 64 };

static void quiet(enum ggml_log_level l, const char *t, void *u) { (void)l; (void)t; (void)u; }

static char *slurp(const char *p, int *n)
{
    FILE *f = fopen(p, "rb");
    if (!f) { perror(p); exit(1); }
    fseek(f, 0, SEEK_END);
    long s = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)s + 1);
    if (fread(b, 1, (size_t)s, f) != (size_t)s) { perror(p); exit(1); }
    b[s] = 0;
    fclose(f);
    *n = (int)s;
    return b;
}

static int tokenize(const struct llama_vocab *v, const char *t, int n, llama_token **ids)
{
    *ids = malloc(sizeof **ids * (size_t)(n + 8));
    int k = llama_tokenize(v, t, n, *ids, n + 8, false, true);
    if (k < 0) { fprintf(stderr, "tokenize failed\n"); exit(1); }
    return k;
}

static void write_ids(const char *path, const llama_token *ids, int n)
{
    FILE *f = fopen(path, "w");
    for (int i = 0; i < n; i++) fprintf(f, "%d\n", ids[i]);
    fclose(f);
}

static int argmax(const float *l, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++) if (l[i] > l[b]) b = i;
    return b;
}

static struct llama_context *new_ctx(struct llama_model *m)
{
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    return llama_init_from_model(m, cp);
}

/* ggml's own dequantisation of every tensor: "name type elements fnv64" per line. */
static int dequant_hashes(const char *model, const char *out)
{
    struct gguf_init_params ip = {true, NULL};
    struct gguf_context *g = gguf_init_from_file(model, ip);
    FILE *f = fopen(model, "rb"), *o = fopen(out, "w");
    if (!g || !f || !o) return 1;
    for (int64_t i = 0; i < gguf_get_n_tensors(g); i++) {
        enum ggml_type t = gguf_get_tensor_type(g, i);
        size_t bytes = gguf_get_tensor_size(g, i);
        int64_t n = (int64_t)(bytes / ggml_type_size(t)) * ggml_blck_size(t);
        void *src = malloc(bytes);
        float *y = malloc((size_t)n * sizeof *y);
        fseek(f, (long)(gguf_get_data_offset(g) + gguf_get_tensor_offset(g, i)), SEEK_SET);
        if (fread(src, 1, bytes, f) != bytes) return 1;
        if (t == GGML_TYPE_F32) memcpy(y, src, bytes);
        else ggml_get_type_traits(t)->to_float(src, y, n);
        uint64_t h = 14695981039346656037ull;
        const unsigned char *p = (const unsigned char *)y;
        for (size_t k = 0; k < (size_t)n * sizeof *y; k++) { h ^= p[k]; h *= 1099511628211ull; }
        fprintf(o, "%s %d %lld %016llx\n", gguf_get_tensor_name(g, i), (int)t, (long long)n, (unsigned long long)h);
        free(src);
        free(y);
    }
    fclose(f);
    fclose(o);
    gguf_free(g);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "dequant") == 0) return dequant_hashes(argv[2], argv[3]);
    if (argc < 4) { fprintf(stderr, "usage: kvm_ref MODEL OUTDIR SEQ_TEXT [TEXT...] | kvm_ref dequant MODEL OUT\n"); return 2; }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false; /* no AMX/repacked weights: their tiles fault (SIGILL) in VMs without AMX state */
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *v = llama_model_get_vocab(model);
    const int V = llama_vocab_n_tokens(v);
    char path[4096];
    int n;
    llama_token *ids;
    for (int a = 4; a < argc; a++) {
        char *t = slurp(argv[a], &n);
        int k = tokenize(v, t, n, &ids);
        snprintf(path, sizeof path, "%.*s.ids", (int)(strlen(argv[a]) - 4), argv[a]);
        write_ids(path, ids, k);
        free(ids);
        free(t);
    }
    /* logits of a fixed 256-token sequence, one batch */
    char *t = slurp(argv[3], &n);
    int k = tokenize(v, t, n, &ids);
    if (k < N_SEQ) { fprintf(stderr, "sequence text too short\n"); return 1; }
    snprintf(path, sizeof path, "%s/seq256.ids", argv[2]);
    write_ids(path, ids, N_SEQ);
    struct llama_context *ctx = new_ctx(model);
    struct llama_batch b = llama_batch_init(N_SEQ, 0, 1);
    for (int i = 0; i < N_SEQ; i++) {
        b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
    }
    b.n_tokens = N_SEQ;
    if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
    snprintf(path, sizeof path, "%s/seq256.topk.bin", argv[2]);
    FILE *ft = fopen(path, "wb");
    int32_t hdr[3] = {N_SEQ, TOPK, V};
    fwrite("KVMTOPK1", 1, 8, ft);
    fwrite(hdr, 4, 3, ft);
    snprintf(path, sizeof path, "%s/seq256.full.bin", argv[2]);
    FILE *ff = fopen(path, "wb");
    int32_t full_pos[4] = {0, 85, 170, 255}, fh[2] = {4, V};
    fwrite("KVMFULL1", 1, 8, ff);
    fwrite(fh, 4, 2, ff);
    fwrite(full_pos, 4, 4, ff);
    int *order = malloc(sizeof *order * (size_t)V);
    for (int i = 0; i < N_SEQ; i++) {
        const float *l = llama_get_logits_ith(ctx, i);
        double mx = l[argmax(l, V)], s = 0;
        for (int j = 0; j < V; j++) s += exp((double)l[j] - mx);
        float lse = (float)(mx + log(s));
        /* top-k by repeated selection over a copy: V * TOPK is small enough */
        int32_t tid[TOPK];
        float tl[TOPK];
        for (int j = 0; j < V; j++) order[j] = 0;
        for (int q = 0; q < TOPK; q++) {
            int best = -1;
            for (int j = 0; j < V; j++) if (!order[j] && (best < 0 || l[j] > l[best])) best = j;
            order[best] = 1;
            tid[q] = best;
            tl[q] = l[best];
        }
        fwrite(&lse, 4, 1, ft);
        fwrite(tid, 4, TOPK, ft);
        fwrite(tl, 4, TOPK, ft);
        for (int q = 0; q < 4; q++) if (full_pos[q] == i) fwrite(l, 4, (size_t)V, ff);
    }
    fclose(ft);
    fclose(ff);
    llama_batch_free(b);
    llama_free(ctx);
    free(ids);
    free(t);
    /* greedy generation: the prompt in one batch, then one token per decode */
    ctx = new_ctx(model);
    const char *prompt = "Once upon a time, in a small village by the sea,";
    k = tokenize(v, prompt, (int)strlen(prompt), &ids);
    llama_token *all = malloc(sizeof *all * (size_t)(k + N_GEN));
    memcpy(all, ids, sizeof *ids * (size_t)k);
    b = llama_batch_init(k, 0, 1);
    for (int i = 0; i < k; i++) {
        b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = i == k - 1;
    }
    b.n_tokens = k;
    if (llama_decode(ctx, b)) return 1;
    int last = k - 1;
    for (int g = 0; g < N_GEN; g++) {
        llama_token next = argmax(llama_get_logits_ith(ctx, last), V);
        all[k + g] = next;
        struct llama_batch one = llama_batch_get_one(&all[k + g], 1);
        if (llama_decode(ctx, one)) return 1;
        last = -1;
    }
    snprintf(path, sizeof path, "%s/greedy.ids", argv[2]);
    FILE *fg = fopen(path, "w");
    fprintf(fg, "# prompt %d tokens: %s\n", k, prompt);
    for (int i = 0; i < k + N_GEN; i++) fprintf(fg, "%d\n", all[i]);
    fclose(fg);
    char piece[256];
    printf("greedy: %s", prompt);
    for (int g = 0; g < N_GEN; g++) {
        int m = llama_token_to_piece(v, all[k + g], piece, sizeof piece, 0, false);
        printf("%.*s", m > 0 ? m : 0, piece);
    }
    printf("\n");
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
EOF
LIBS=("$B/src/libllama.a" "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a")
gcc -O2 -std=c11 -I"$SRC/include" -I"$SRC/ggml/include" "$LLAMA_DIR/kvm_ref.c" "${LIBS[@]}" \
    -o "$LLAMA_DIR/kvm_ref" -lstdc++ -fopenmp -lm -lpthread
# 1. llama.cpp on the Q4_1 file as users run it (its matmuls quantize activations to Q8_1)
"$LLAMA_DIR/kvm_ref" "$MODEL" "$OUT" "$SHARED/data/long2k/doc_000.txt" "$OUT"/texts/*.txt
# 2. ggml's dequantisation of every tensor, hashed
"$LLAMA_DIR/kvm_ref" dequant "$MODEL" "$OUT/dequant.fnv"
# 3. llama.cpp on the same weights expanded to F32 (kvmill's gguf reader writes the expansion):
#    float32 matmuls on both sides, so this isolates kvmill's forward from Q8_1 activation rounding
cat >"$LLAMA_DIR/gguf_to_f32.c" <<'EOF'
/* gguf_to_f32: the GGUF file with every tensor dequantised to F32, metadata unchanged. */
#include "model/kvm_gguf.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
static void w64(FILE *f, uint64_t v) { fwrite(&v, 8, 1, f); }
static void w32(FILE *f, uint32_t v) { fwrite(&v, 4, 1, f); }
int main(int argc, char **argv)
{
    int fd = argc == 3 ? open(argv[1], O_RDONLY) : -1;
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) return 2;
    const uint8_t *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    kvm_gguf *g;
    if (kvm_gguf_parse(argv[1], m, (size_t)st.st_size, &g)) return 1;
    int64_t nt = kvm_gguf_n_tensors(g);
    const uint8_t *kv0 = (const uint8_t *)kvm_gguf_kv_at(g, 0)->key.ptr - 8;
    const uint8_t *kv1 = (const uint8_t *)kvm_gguf_tensor_at(g, 0)->name.ptr - 8;
    FILE *f = fopen(argv[2], "wb");
    fwrite("GGUF", 1, 4, f);
    w32(f, 3);
    w64(f, (uint64_t)nt);
    w64(f, (uint64_t)kvm_gguf_n_kv(g));
    fwrite(kv0, 1, (size_t)(kv1 - kv0), f);
    uint64_t off = 0;
    for (int64_t i = 0; i < nt; i++) {
        const kvm_gguf_tensor *t = kvm_gguf_tensor_at(g, i);
        w64(f, t->name.len);
        fwrite(t->name.ptr, 1, t->name.len, f);
        w32(f, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++) w64(f, (uint64_t)t->ne[d]);
        w32(f, 0);
        w64(f, off);
        off += ((uint64_t)(t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]) * 4 + 31) / 32 * 32;
    }
    while (ftell(f) % 32) fputc(0, f);
    for (int64_t i = 0; i < nt; i++) {
        const kvm_gguf_tensor *t = kvm_gguf_tensor_at(g, i);
        int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        float *y = malloc((size_t)n * 4);
        kvm_ggml_dequantize(t->type, t->data, y, n);
        fwrite(y, 4, (size_t)n, f);
        free(y);
        while (ftell(f) % 32) fputc(0, f);
    }
    fclose(f);
    kvm_gguf_free(&g);
    return 0;
}
EOF
make -C "$ROOT" -s build/libkvmill.a
gcc -O2 -std=c11 -D_DEFAULT_SOURCE -I"$ROOT" "$LLAMA_DIR/gguf_to_f32.c" "$ROOT/build/libkvmill.a" \
    -o "$LLAMA_DIR/gguf_to_f32" -lm
"$LLAMA_DIR/gguf_to_f32" "$MODEL" "$LLAMA_DIR/smollm2-f32.gguf"
mkdir -p "$OUT/f32"
"$LLAMA_DIR/kvm_ref" "$LLAMA_DIR/smollm2-f32.gguf" "$OUT/f32" "$SHARED/data/long2k/doc_000.txt"
rm -f "$OUT/f32/seq256.ids" "$LLAMA_DIR/smollm2-f32.gguf" # the same ids as run 1
echo "gguf-reference: wrote $OUT (llama.cpp from llama-cpp-python $VERSION)"
