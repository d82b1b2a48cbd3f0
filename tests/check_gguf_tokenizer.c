/* check_gguf_tokenizer.c: the GGUF byte-level BPE tokenizer. SmolLM2's vocabulary against
 * llama.cpp's llama_tokenize ids (tests/data/smollm2/texts/, made by scripts/gguf-reference.sh;
 * skipped visibly when scripts/get-model.sh has not run), decode round trips, and small
 * vocabularies the test writes itself (merge order, special tokens, malformed tokenizers). */
#include "common/kvm_error.h"
#include "model/kvm_tokenizer.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SMOL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define TEXT_DIR "tests/data/smollm2/texts"

static int have_smol(void)
{
    FILE *f = fopen(SMOL_PATH, "rb");
    if (!f) {
        printf("SKIP: %s absent (run scripts/get-model.sh): SmolLM2 tokenizer vs llama.cpp not checked\n", SMOL_PATH);
        return 0;
    }
    fclose(f);
    return 1;
}

static int32_t *read_ids(const char *path, int64_t *n)
{
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    int64_t cap = 64;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    int x;
    *n = 0;
    while (fscanf(f, "%d", &x) == 1) {
        if (*n == cap) v = realloc(v, (size_t)(cap *= 2) * sizeof *v);
        v[(*n)++] = x;
    }
    fclose(f);
    return v;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

START_TEST(test_smol_ids)
{
    if (!have_smol()) return;
    kvm_tokenizer *t;
    ck_assert_msg(kvm_tokenizer_open_gguf(SMOL_PATH, &t) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_tokenizer_vocab_size(t), 49152);
    ck_assert_int_eq(kvm_tokenizer_bos(t), 1);
    ck_assert_int_eq(kvm_tokenizer_eos(t), 2);
    ck_assert_int_eq(kvm_tokenizer_add_bos(t), 0);
    ck_assert_int_eq(kvm_tokenizer_find(t, "<|im_start|>"), 1);
    ck_assert_int_eq(kvm_tokenizer_find(t, "<|im_end|>"), 2);
    ck_assert_ptr_nonnull(kvm_tokenizer_chat_template(t));
    DIR *d = opendir(TEXT_DIR);
    ck_assert_ptr_nonnull(d);
    char *names[64];
    int nn = 0;
    struct dirent *e;
    while ((e = readdir(d)) && nn < 64) {
        size_t l = strlen(e->d_name);
        if (l > 4 && strcmp(e->d_name + l - 4, ".txt") == 0) names[nn++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)nn, sizeof *names, cmp_str);
    ck_assert_int_ge(nn, 8);
    int64_t total = 0;
    for (int i = 0; i < nn; i++) {
        char path[512];
        size_t len;
        snprintf(path, sizeof path, "%s/%s", TEXT_DIR, names[i]);
        char *text = kvm_test_read_file(path, &len);
        snprintf(path, sizeof path, "%s/%.*s.ids", TEXT_DIR, (int)strlen(names[i]) - 4, names[i]);
        int64_t nref, n;
        int32_t *ref = read_ids(path, &nref), *ids;
        ck_assert_int_eq(kvm_tokenizer_encode(t, text, len, 0, 0, &ids, &n), 0);
        for (int64_t k = 0; k < n && k < nref; k++)
            ck_assert_msg(ids[k] == ref[k], "%s: token %lld is %d, llama.cpp has %d", names[i], (long long)k, ids[k],
                          ref[k]);
        ck_assert_msg(n == nref, "%s: %lld tokens, llama.cpp %lld", names[i], (long long)n, (long long)nref);
        /* decoding gives the text back, less the control tokens (which have no piece) */
        if (!strstr(names[i], "special")) {
            char *back;
            size_t blen;
            ck_assert_int_eq(kvm_tokenizer_decode(t, ids, n, &back, &blen), 0);
            ck_assert_msg(blen == len && memcmp(back, text, len) == 0, "%s: decode differs", names[i]);
            free(back);
        }
        int32_t *with;
        int64_t nw;
        ck_assert_int_eq(kvm_tokenizer_encode(t, text, len, 1, 1, &with, &nw), 0);
        ck_assert_int_eq(nw, n + 2);
        ck_assert_int_eq(with[0], 1);
        ck_assert_int_eq(with[nw - 1], 2);
        total += n;
        free(with);
        free(ids);
        free(ref);
        free(text);
        free(names[i]);
    }
    printf("SmolLM2 tokenizer: %d texts, %lld tokens, all equal to llama.cpp's\n", nn, (long long)total);
    kvm_tokenizer_close(&t);
    kvm_tokenizer_close(&t);
}
END_TEST

/* A 12,000-character document: its first 256 ids are the logits reference's sequence. */
START_TEST(test_smol_long_doc)
{
    if (!have_smol() || !kvm_test_shared_path("data/long2k/doc_000.txt")) return;
    kvm_tokenizer *t;
    ck_assert_int_eq(kvm_tokenizer_open_gguf(SMOL_PATH, &t), 0);
    size_t len;
    char *text = kvm_test_read_file(kvm_test_shared_path("data/long2k/doc_000.txt"), &len);
    ck_assert_ptr_nonnull(text);
    int64_t nref, n;
    int32_t *ref = read_ids("tests/data/smollm2/seq256.ids", &nref), *ids;
    ck_assert_int_eq(nref, 256);
    ck_assert_int_eq(kvm_tokenizer_encode(t, text, len, 0, 0, &ids, &n), 0);
    ck_assert_int_ge(n, 256);
    for (int k = 0; k < 256; k++)
        ck_assert_int_eq(ids[k], ref[k]);
    char *back;
    size_t blen;
    ck_assert_int_eq(kvm_tokenizer_decode(t, ids, n, &back, &blen), 0);
    ck_assert(blen == len && memcmp(back, text, len) == 0);
    printf("long2k/doc_000: %zu bytes -> %lld tokens; decode restores it\n", len, (long long)n);
    free(back);
    free(ids);
    free(ref);
    free(text);
    kvm_tokenizer_close(&t);
}
END_TEST

/* ---- small vocabularies written by the test ---- */

typedef struct gw {
    uint8_t *b;
    size_t n, cap;
} gw;

static void gw_put(gw *w, const void *p, size_t n)
{
    if (w->n + n > w->cap) {
        w->cap = (w->n + n) * 2 + 256;
        w->b = realloc(w->b, w->cap);
    }
    memcpy(w->b + w->n, p, n);
    w->n += n;
}
static void gw_u32(gw *w, uint32_t v) { gw_put(w, &v, 4); }
static void gw_u64(gw *w, uint64_t v) { gw_put(w, &v, 8); }
static void gw_str(gw *w, const char *s)
{
    gw_u64(w, strlen(s));
    gw_put(w, s, strlen(s));
}

/* A tokenizer-only GGUF: model and pre strings (NULL: key absent), tokens, types, merges. */
static int g_pre_u32;  /* write_vocab writes tokenizer.ggml.pre as the u32 7, not the string pre */
static int g_tmpl_u32; /* write_vocab adds tokenizer.chat_template as the u32 1 */
static int g_tmpl_nul; /* write_vocab adds tokenizer.chat_template as a string with a NUL at offset 7 */
static uint32_t g_unk_type; /* nonzero: write_vocab adds tokenizer.ggml.unknown_token_id of this GGUF type */
static uint32_t g_unk_val;  /* its 4 value bytes */

static char *write_vocab(const char *dir, const char *model, const char *pre, const char **tokens, int n_tok,
                         const int32_t *types, int n_types, const char **merges, int n_merges)
{
    gw w = {0};
    gw_put(&w, "GGUF", 4);
    gw_u32(&w, 3);
    gw_u64(&w, 0);
    gw_u64(&w, (uint64_t)(4 + (model != NULL) + (pre != NULL) + (n_types > 0) + g_tmpl_u32 + g_tmpl_nul +
                          (g_unk_type != 0)));
    if (g_tmpl_nul) {
        static const char t[] = "{{ a }}\0{{ b }}";
        gw_str(&w, "tokenizer.chat_template");
        gw_u32(&w, 8);
        gw_u64(&w, sizeof t - 1);
        gw_put(&w, t, sizeof t - 1);
    }
    if (g_unk_type) {
        gw_str(&w, "tokenizer.ggml.unknown_token_id");
        gw_u32(&w, g_unk_type);
        gw_u32(&w, g_unk_val);
    }
    if (g_tmpl_u32) {
        gw_str(&w, "tokenizer.chat_template");
        gw_u32(&w, 4);
        gw_u32(&w, 1);
    }
    if (model) {
        gw_str(&w, "tokenizer.ggml.model");
        gw_u32(&w, 8);
        gw_str(&w, model);
    }
    if (pre) {
        gw_str(&w, "tokenizer.ggml.pre");
        gw_u32(&w, g_pre_u32 ? 4 : 8);
        if (g_pre_u32)
            gw_u32(&w, 7);
        else
            gw_str(&w, pre);
    }
    gw_str(&w, "tokenizer.ggml.tokens");
    gw_u32(&w, 9);
    gw_u32(&w, 8);
    gw_u64(&w, (uint64_t)n_tok);
    for (int i = 0; i < n_tok; i++)
        gw_str(&w, tokens[i]);
    if (n_types > 0) {
        gw_str(&w, "tokenizer.ggml.token_type");
        gw_u32(&w, 9);
        gw_u32(&w, 5);
        gw_u64(&w, (uint64_t)n_types);
        gw_put(&w, types, 4 * (size_t)n_types);
    }
    gw_str(&w, "tokenizer.ggml.merges");
    gw_u32(&w, 9);
    gw_u32(&w, 8);
    gw_u64(&w, (uint64_t)n_merges);
    for (int i = 0; i < n_merges; i++)
        gw_str(&w, merges[i]);
    gw_str(&w, "tokenizer.ggml.bos_token_id");
    gw_u32(&w, 4);
    gw_u32(&w, 0);
    gw_str(&w, "tokenizer.ggml.eos_token_id");
    gw_u32(&w, 4);
    gw_u32(&w, 0);
    char *path = malloc(strlen(dir) + 16);
    sprintf(path, "%s/v.gguf", dir);
    ck_assert_int_eq(kvm_test_write_file(path, w.b, w.n), 0);
    free(w.b);
    return path;
}

/* id:       0      1    2    3    4     5     6      7     8      9    10 */
static const char *toks[] = {"<s>",
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
                             "x"};
static const int32_t types[] = {3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4};
static const char *merges[] = {"b c", "a b", "a bc", "\xc4\xa0 c"};

static void expect_ids(const kvm_tokenizer *t, const char *text, const int32_t *want, int n_want)
{
    int32_t *ids;
    int64_t n;
    ck_assert_int_eq(kvm_tokenizer_encode(t, text, strlen(text), 0, 0, &ids, &n), 0);
    char got[256] = "";
    for (int64_t i = 0; i < n; i++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%d ", ids[i]);
    ck_assert_msg(n == n_want, "'%s': %lld ids (%s), want %d", text, (long long)n, got, n_want);
    for (int i = 0; i < n_want; i++)
        ck_assert_msg(ids[i] == want[i], "'%s': ids %s", text, got);
    free(ids);
}

START_TEST(test_small_vocab)
{
    char *dir = kvm_test_tmpdir();
    char *path = write_vocab(dir, "gpt2", "smollm", toks, 11, types, 11, merges, 4);
    kvm_tokenizer *t;
    ck_assert_msg(kvm_tokenizer_open_gguf(path, &t) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_tokenizer_vocab_size(t), 11);
    /* "b c" (rank 0) merges before "a b" (rank 1) though it is further right, then "a bc" */
    expect_ids(t, "abc", (int32_t[]){7}, 1);
    expect_ids(t, "ab", (int32_t[]){6}, 1);
    /* " c" is one pre-token: byte-level "Ġc" merges */
    expect_ids(t, "ab c", (int32_t[]){6, 8}, 2);
    /* the CONTROL token is split out first, the USER_DEFINED one too */
    expect_ids(t, "a<s>bx", (int32_t[]){1, 0, 2, 10}, 4);
    /* smollm's pre-tokenizer isolates every digit */
    expect_ids(t, "1a1", (int32_t[]){9, 1, 9}, 3);
    /* a merge whose result is not a token falls back to its bytes' tokens: none here */
    expect_ids(t, "", (int32_t[]){0}, 0);
    size_t len;
    const char *p = kvm_tokenizer_piece(t, -1, 4, &len);
    ck_assert_uint_eq(len, 1);
    ck_assert_int_eq(p[0], ' ');
    p = kvm_tokenizer_piece(t, -1, 0, &len); /* CONTROL: no bytes */
    ck_assert_uint_eq(len, 0);
    p = kvm_tokenizer_piece(t, -1, 10, &len); /* USER_DEFINED: its text */
    ck_assert_uint_eq(len, 1);
    ck_assert_ptr_null(kvm_tokenizer_piece(t, -1, 11, &len));
    int32_t ids[] = {6, 8, 0, 99};
    char *text;
    ck_assert_int_eq(kvm_tokenizer_decode(t, ids, 3, &text, &len), 0);
    ck_assert_str_eq(text, "ab c");
    free(text);
    ck_assert_int_eq(kvm_tokenizer_decode(t, ids, 4, &text, &len), KVM_ERANGE);
    kvm_tokenizer_close(&t);
    free(path);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* kvm__tokenizer_gguf_mem on a GGUF file's bytes: the vocabulary the file gives, and a cut copy
 * refused naming the label it was given. */
START_TEST(test_mem)
{
    char *dir = kvm_test_tmpdir();
    char *path = write_vocab(dir, "gpt2", "smollm", toks, 11, types, 11, merges, 4);
    size_t n = 0;
    char *bytes = kvm_test_read_file(path, &n);
    ck_assert_ptr_nonnull(bytes);
    kvm_tokenizer *t = NULL;
    ck_assert_msg(kvm__tokenizer_gguf_mem("mem.gguf", (const uint8_t *)bytes, n, &t) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_tokenizer_vocab_size(t), 11);
    expect_ids(t, "ab c", (int32_t[]){6, 8}, 2);
    kvm_tokenizer_close(&t);
    ck_assert_int_eq(kvm__tokenizer_gguf_mem("cut.gguf", (const uint8_t *)bytes, n / 2, &t), KVM_EFORMAT);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(kvm_errmsg(), "cut.gguf"), "%s", kvm_errmsg());
    free(bytes);
    free(path);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static void expect_open_error(const char *model, const char *pre, int n_types, const char **m, int n_m, int rc_want,
                              const char *frag)
{
    char *dir = kvm_test_tmpdir();
    char *path = write_vocab(dir, model, pre, toks, 11, types, n_types, m, n_m);
    kvm_tokenizer *t = (kvm_tokenizer *)1;
    int rc = kvm_tokenizer_open_gguf(path, &t);
    printf("tokenizer error: %s\n", kvm_errmsg());
    ck_assert_int_eq(rc, rc_want);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(kvm_errmsg(), frag), "'%s' not in '%s'", frag, kvm_errmsg());
    free(path);
    kvm_test_rmtree(dir);
    free(dir);
}

START_TEST(test_bad_vocab)
{
    static const char *bad_merge[] = {"bc"};
    expect_open_error("gpt2", "no-such-pre", 11, merges, 4, KVM_ENOTSUP, "no-such-pre");
    expect_open_error("gpt2", NULL, 11, merges, 4, KVM_ENOTSUP, "tokenizer.ggml.pre 'default'");
    expect_open_error("bert", "smollm", 11, merges, 4, KVM_ENOTSUP, "'bert'");
    expect_open_error(NULL, "smollm", 11, merges, 4, KVM_EFORMAT, "tokenizer.ggml.model");
    expect_open_error("gpt2", "smollm", 11, bad_merge, 1, KVM_EFORMAT, "merges[0]");
    expect_open_error("gpt2", "smollm", 7, merges, 4, KVM_EFORMAT, "token_type");
    g_pre_u32 = 1; /* a pre-tokenizer that is not a string was named as 'default' */
    expect_open_error("gpt2", "smollm", 11, merges, 4, KVM_EFORMAT,
                      "'tokenizer.ggml.pre' has type 4 (u32), expected a string");
    g_pre_u32 = 0;
    g_tmpl_u32 = 1; /* a chat template that is not a string was taken as none */
    expect_open_error("gpt2", "smollm", 11, merges, 4, KVM_EFORMAT, "'tokenizer.chat_template' has type 4 (u32)");
    g_tmpl_u32 = 0;
    g_tmpl_nul = 1; /* a template with a NUL byte was cut there without a word */
    expect_open_error("gpt2", "smollm", 11, merges, 4, KVM_EFORMAT,
                      "'tokenizer.chat_template' holds a NUL byte at offset 7 (of 15)");
    g_tmpl_nul = 0;
    /* unknown_token_id as a float, or outside the vocabulary, was taken as absent (no unknown
     * token) while a bos/eos id of a wrong type or value is refused */
    g_unk_type = 6, g_unk_val = 0; /* KVM_GGUF_F32 0.0f */
    expect_open_error("gpt2", "smollm", 11, merges, 4, KVM_EFORMAT,
                      "'tokenizer.ggml.unknown_token_id' has type 6 (f32), expected an integer");
    g_unk_type = 4, g_unk_val = 11; /* u32, one past the last token */
    expect_open_error("gpt2", "smollm", 11, merges, 4, KVM_EFORMAT,
                      "tokenizer.ggml.unknown_token_id 11 outside the vocabulary [0, 11)");
    g_unk_val = 3; /* in range: read */
    char *udir = kvm_test_tmpdir(), *upath = write_vocab(udir, "gpt2", "smollm", toks, 11, types, 11, merges, 4);
    kvm_tokenizer *tu = NULL;
    ck_assert_msg(kvm_tokenizer_open_gguf(upath, &tu) == 0, "%s", kvm_errmsg());
    kvm_tokenizer_close(&tu);
    free(upath);
    kvm_test_rmtree(udir);
    free(udir);
    g_unk_type = 0;
    /* eos_token_id stored as a float (the file's last entry: its type, then 4 value bytes) was
     * taken as absent: the tokenizer ran without an end-of-sequence id */
    char *dir = kvm_test_tmpdir(), *path = write_vocab(dir, "gpt2", "smollm", toks, 11, types, 11, merges, 4);
    size_t n = 0;
    char *bytes = kvm_test_read_file(path, &n);
    ck_assert_ptr_nonnull(bytes);
    bytes[n - 8] = 6; /* KVM_GGUF_F32: value 0.0f */
    ck_assert_int_eq(kvm_test_write_file(path, bytes, n), 0);
    kvm_tokenizer *te = (kvm_tokenizer *)1;
    ck_assert_int_eq(kvm_tokenizer_open_gguf(path, &te), KVM_EFORMAT);
    ck_assert_ptr_null(te);
    ck_assert_msg(strstr(kvm_errmsg(), "'tokenizer.ggml.eos_token_id' has type 6 (f32), expected an integer"), "%s",
                  kvm_errmsg());
    free(bytes);
    free(path);
    kvm_test_rmtree(dir);
    free(dir);
    kvm_tokenizer *t = (kvm_tokenizer *)1;
    ck_assert_int_eq(kvm_tokenizer_open_gguf("/nonexistent/x.gguf", &t), KVM_ENOTFOUND);
    ck_assert_ptr_null(t);
    ck_assert_int_eq(kvm_tokenizer_open_gguf(kvm_test_data_path("models/tok512.bin"), &t), KVM_EFORMAT);
    ck_assert_int_eq(kvm_tokenizer_find(NULL, "a"), -1);
    ck_assert_int_eq(kvm_tokenizer_add_bos(NULL), 0);
    ck_assert_ptr_null(kvm_tokenizer_chat_template(NULL));
}
END_TEST

/* tok512.bin (a SentencePiece vocabulary) rewritten as a GGUF "llama" tokenizer: the GGUF
 * path (llama.cpp's llm_tokenizer_spm) must give run.c's ids (kvm_tokenizer_open_llama2c)
 * on real TinyStories text. */
START_TEST(test_spm_matches_llama2c)
{
    size_t n;
    unsigned char *f = (unsigned char *)kvm_test_read_file(kvm_test_data_path("models/tok512.bin"), &n);
    ck_assert_ptr_nonnull(f);
    enum { V = 512 };
    gw w = {0}, toks_kv = {0};
    float scores[V];
    int32_t ttype[V];
    size_t off = 4;
    for (int i = 0; i < V; i++) {
        int32_t len;
        memcpy(&scores[i], f + off, 4);
        memcpy(&len, f + off + 4, 4);
        off += 8;
        char piece[256], esc[768];
        memcpy(piece, f + off, (size_t)len);
        piece[len] = 0;
        off += (size_t)len;
        size_t e = 0;
        for (int k = 0; k < len; k++) { /* llama2.c's export turned U+2581 into ' ': undo it */
            if (piece[k] == ' ') {
                memcpy(esc + e, "\xe2\x96\x81", 3);
                e += 3;
            } else
                esc[e++] = piece[k];
        }
        esc[e] = 0;
        ttype[i] = i == 0 ? 2 : i <= 2 ? 3 : i <= 258 ? 6 : 1;
        gw_str(&toks_kv, esc);
    }
    gw_put(&w, "GGUF", 4);
    gw_u32(&w, 3);
    gw_u64(&w, 0);
    gw_u64(&w, 7);
    gw_str(&w, "tokenizer.ggml.model");
    gw_u32(&w, 8);
    gw_str(&w, "llama");
    gw_str(&w, "tokenizer.ggml.tokens");
    gw_u32(&w, 9);
    gw_u32(&w, 8);
    gw_u64(&w, V);
    gw_put(&w, toks_kv.b, toks_kv.n);
    gw_str(&w, "tokenizer.ggml.scores");
    gw_u32(&w, 9);
    gw_u32(&w, 6);
    gw_u64(&w, V);
    gw_put(&w, scores, sizeof scores);
    gw_str(&w, "tokenizer.ggml.token_type");
    gw_u32(&w, 9);
    gw_u32(&w, 5);
    gw_u64(&w, V);
    gw_put(&w, ttype, sizeof ttype);
    gw_str(&w, "tokenizer.ggml.bos_token_id");
    gw_u32(&w, 4);
    gw_u32(&w, 1);
    gw_str(&w, "tokenizer.ggml.eos_token_id");
    gw_u32(&w, 4);
    gw_u32(&w, 2);
    gw_str(&w, "tokenizer.ggml.unknown_token_id");
    gw_u32(&w, 4);
    gw_u32(&w, 0);
    char *dir = kvm_test_tmpdir(), path[4096];
    snprintf(path, sizeof path, "%s/tok512.gguf", dir);
    ck_assert_int_eq(kvm_test_write_file(path, w.b, w.n), 0);
    kvm_tokenizer *sp, *l2c;
    ck_assert_msg(kvm_tokenizer_open_gguf(path, &sp) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_tokenizer_open_llama2c(kvm_test_data_path("models/tok512.bin"), V, &l2c), 0);
    ck_assert_int_eq(kvm_tokenizer_add_bos(sp), 1);
    int64_t total = 0;
    /* 40 stories from ../shared, else the 6 embedded documents (stories 0-17) */
    const int stories = kvm_test_shared_find("data/tinystories/stories") != NULL, n_texts = stories ? 40 : 6;
    for (int s_i = 0; s_i < n_texts; s_i++) {
        char sp_path[256];
        snprintf(sp_path, sizeof sp_path, stories ? "data/tinystories/stories/story_%05d.txt" : "corpus/doc_%03d.txt", s_i);
        size_t len;
        char *text = kvm_test_read_file(stories ? kvm_test_shared_find(sp_path) : kvm_test_data_path(sp_path), &len);
        ck_assert_ptr_nonnull(text);
        int32_t *a, *b;
        int64_t na, nb;
        ck_assert_int_eq(kvm_tokenizer_encode(l2c, text, len, 1, 0, &a, &na), 0);
        ck_assert_int_eq(kvm_tokenizer_encode(sp, text, len, 1, 0, &b, &nb), 0);
        ck_assert_msg(na == nb, "story %d: run.c %lld ids, GGUF llama %lld", s_i, (long long)na, (long long)nb);
        for (int64_t k = 0; k < na; k++)
            ck_assert_msg(a[k] == b[k], "story %d id %lld: %d vs %d", s_i, (long long)k, a[k], b[k]);
        char *back;
        size_t blen;
        ck_assert_int_eq(kvm_tokenizer_decode(sp, b, nb, &back, &blen), 0);
        ck_assert(blen == len + 1 && back[0] == ' ' && memcmp(back + 1, text, len) == 0);
        total += na;
        free(back);
        free(a);
        free(b);
        free(text);
    }
    /* a character outside the vocabulary falls back to its bytes' <0xXX> tokens */
    int32_t *ids;
    int64_t k;
    ck_assert_int_eq(kvm_tokenizer_encode(sp, "\xf0\x9f\x99\x82", 4, 0, 0, &ids, &k), 0); /* U+1F642 */
    ck_assert_int_eq(k, 5);
    ck_assert_int_eq(ids[1], 0xf0 + 3);
    ck_assert_int_eq(ids[4], 0x82 + 3);
    free(ids);
    printf("tok512 as a GGUF llama vocabulary: %d texts, %lld ids, equal to run.c's\n", n_texts, (long long)total);
    kvm_tokenizer_close(&sp);
    kvm_tokenizer_close(&l2c);
    kvm_test_rmtree(dir);
    free(dir);
    free(w.b);
    free(toks_kv.b);
    free(f);
}
END_TEST

/* The llama2.c path keeps its behaviour: BOS by default, no chat template. */
START_TEST(test_llama2c_unchanged)
{
    kvm_tokenizer *t;
    ck_assert_int_eq(kvm_tokenizer_open_llama2c(kvm_test_data_path("models/tok512.bin"), 512, &t), 0);
    ck_assert_int_eq(kvm_tokenizer_add_bos(t), 1);
    ck_assert_ptr_null(kvm_tokenizer_chat_template(t));
    ck_assert_int_ge(kvm_tokenizer_find(t, " "), 0);
    kvm_tokenizer_close(&t);
}
END_TEST

static Suite *gguf_tokenizer_suite(void)
{
    Suite *s = suite_create("gguf_tokenizer");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"smol_ids", test_smol_ids},
                 {"smol_long_doc", test_smol_long_doc},
                 {"small_vocab", test_small_vocab},
                 {"mem", test_mem},
                 {"bad_vocab", test_bad_vocab},
                 {"spm_matches_llama2c", test_spm_matches_llama2c},
                 {"llama2c_unchanged", test_llama2c_unchanged}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void)
{
    setvbuf(stdout, NULL, _IONBF, 0);
    SRunner *sr = srunner_create(gguf_tokenizer_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
