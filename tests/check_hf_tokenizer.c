/* check_hf_tokenizer.c: Hugging Face tokenizer.json encoding against the `tokenizers` library's
 * own ids (tests/data/hf/tokenizers/, written by scripts/hf_tokenizer_reference.py) on 330
 * strings (shared/data text, code, numbers, emoji, CJK, whitespace runs, special tokens):
 * SmolLM2's byte-level tokenizer.json from the converted folder (skipped visibly when absent),
 * and four small committed ones (NFC + Qwen2 regex with "a b" merges, Llama-3 regex with
 * ignore_merges and pair merges, SentencePiece-style Prepend/Replace with byte fallback,
 * Metaspace with byte fallback); decoding; and each malformed tokenizer.json refused by name. */
#include "common/kvm_error.h"
#include "model/kvm_tokenizer.h"
#include "model/kvm_tokenizer_find.h"
#include "model/kvm_tokenizer_json.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TOK_DIR "tests/data/hf/tokenizers"

static const char *smol_json(void)
{
    static char p[4096];
    const char *e = getenv("KVMILL_HF_SMOLLM2");
    snprintf(p, sizeof p, "%s/tokenizer.json", e && *e ? e : "models/SmolLM2-135M-Instruct-hf");
    return p;
}

/* Encodes every string with tokenizer `path` and compares with NAME/ids.json. */
static void compare(const char *name, const char *path)
{
    json_error_t je;
    json_t *strs = json_load_file(TOK_DIR "/strings.json", 0, &je);
    char p[512];
    snprintf(p, sizeof p, TOK_DIR "/%s/ids.json", name);
    json_t *ref = json_load_file(p, 0, &je);
    ck_assert_msg(strs && ref, "%s: %s", p, je.text);
    const json_t *ids = json_object_get(ref, "ids");
    ck_assert_int_eq(json_array_size(ids), json_array_size(strs));
    kvm_tokenizer *t;
    ck_assert_msg(kvm_tokenizer_open_hf(path, 0, &t) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_tokenizer_add_bos(t), json_is_true(json_object_get(ref, "add_bos")));
    if (kvm_tokenizer_add_bos(t)) ck_assert_int_eq(kvm_tokenizer_bos(t), json_integer_value(json_object_get(ref, "bos")));
    int bad = 0;
    size_t total = 0;
    for (size_t i = 0; i < json_array_size(strs); i++) {
        const json_t *s = json_array_get(strs, i), *want = json_array_get(ids, i);
        int32_t *got;
        int64_t n;
        ck_assert_int_eq(kvm_tokenizer_encode(t, json_string_value(s), json_string_length(s), 0, 0, &got, &n), 0);
        int same = (size_t)n == json_array_size(want);
        for (int64_t k = 0; same && k < n; k++)
            same = got[k] == json_integer_value(json_array_get(want, (size_t)k));
        total += (size_t)n;
        if (!same && bad++ < 3) {
            printf("%s: string %zu '%.60s': kvmill %lld ids, tokenizers %zu:", name, i, json_string_value(s), (long long)n,
                   json_array_size(want));
            for (int64_t k = 0; k < n && k < 24; k++)
                printf(" %d/%lld", got[k], (long long)json_integer_value(json_array_get(want, (size_t)k)));
            printf("\n");
        }
        free(got);
    }
    printf("%s: %zu strings, %zu ids, %d strings differ from tokenizers'\n", name, json_array_size(strs), total, bad);
    ck_assert_int_eq(bad, 0);
    kvm_tokenizer_close(&t);
    json_decref(strs);
    json_decref(ref);
}

static const char *const names[] = {"qwen_style", "llama3_style", "spm_style", "metaspace_style"};

START_TEST(test_committed)
{
    char p[512];
    snprintf(p, sizeof p, TOK_DIR "/%s/tokenizer.json", names[_i]);
    compare(names[_i], p);
}
END_TEST

START_TEST(test_smol)
{
    FILE *f = fopen(smol_json(), "r");
    if (!f) {
        printf("SKIP: %s absent (scripts/gguf-to-hf.sh writes it): SmolLM2 tokenizer.json not checked\n", smol_json());
        return;
    }
    fclose(f);
    compare("smollm2", smol_json());
}
END_TEST

/* Decoding gives the text back: byte-level pieces map back to bytes; SentencePiece-style
 * pieces turn U+2581 into spaces (so the Prepend adds one leading space). */
START_TEST(test_decode)
{
    const char *text = "Hello wörld 😀 日本  tabs\tend";
    struct {
        const char *name, *prefix;
    } cases[] = {{"qwen_style", ""}, {"llama3_style", ""}, {"spm_style", " "}};
    for (size_t c = 0; c < 3; c++) {
        char p[512];
        snprintf(p, sizeof p, TOK_DIR "/%s/tokenizer.json", cases[c].name);
        kvm_tokenizer *t;
        ck_assert_int_eq(kvm_tokenizer_open_hf(p, 0, &t), 0);
        int32_t *ids;
        int64_t n;
        ck_assert_int_eq(kvm_tokenizer_encode(t, text, strlen(text), kvm_tokenizer_add_bos(t), 0, &ids, &n), 0);
        char *out;
        size_t len;
        ck_assert_int_eq(kvm_tokenizer_decode(t, ids, n, &out, &len), 0);
        char want[256];
        snprintf(want, sizeof want, "%s%s", cases[c].prefix, text);
        ck_assert_msg(strcmp(out, want) == 0, "%s: decoded '%s', want '%s'", cases[c].name, out, want);
        free(out);
        free(ids);
        kvm_tokenizer_close(&t);
    }
}
END_TEST

/* A copy of qwen_style's tokenizer.json with `from` replaced by `to` (first occurrence). */
static void expect_bad(const char *from, const char *to, int want, const char *needle)
{
    size_t n;
    char *src = kvm_test_read_file(TOK_DIR "/qwen_style/tokenizer.json", &n);
    ck_assert_ptr_nonnull(src);
    char *at = strstr(src, from);
    ck_assert_msg(at != NULL, "'%s' not in the fixture", from);
    char *dir = kvm_test_tmpdir(), path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    fwrite(src, 1, (size_t)(at - src), f);
    fputs(to, f);
    fputs(at + strlen(from), f);
    fclose(f);
    kvm_tokenizer *t = NULL;
    int rc = kvm_tokenizer_open_hf(path, 0, &t);
    ck_assert_msg(rc == want, "'%s' -> '%s': got %d (%s), want %d", from, to, rc, kvm_errmsg(), want);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(kvm_errmsg(), "tokenizer.json") && strstr(kvm_errmsg(), needle),
                  "message '%s' lacks the file or '%s'", kvm_errmsg(), needle);
    kvm_test_rmtree(dir);
    free(dir);
    free(src);
}

START_TEST(test_malformed)
{
    expect_bad("\"type\": \"BPE\"", "\"type\": \"Unigram\"", KVM_ENOTSUP, "Unigram");
    expect_bad("\"type\": \"NFC\"", "\"type\": \"Lowercase\"", KVM_ENOTSUP, "Lowercase");
    expect_bad("\"behavior\": \"Isolated\"", "\"behavior\": \"Removed\"", KVM_ENOTSUP, "Removed");
    expect_bad("\"type\": \"ByteLevel\", \"add_prefix_space\": false", "\"type\": \"Whitespace\", \"add_prefix_space\": false",
               KVM_ENOTSUP, "Whitespace");
    expect_bad("\"merges\": [\"h e\"", "\"merges\": [\"h e x\"", KVM_EFORMAT, "merges[0]");
    expect_bad("\"merges\": [\"h e\"", "\"merges\": [\"h q\\u00ff\"", KVM_EFORMAT, "not in model.vocab");
    expect_bad("\"merges\": [\"h e\"", "\"merges\": [7", KVM_EFORMAT, "merges[0]");
    expect_bad("\"vocab\": {", "\"vocab\": {\"zz\": -3,", KVM_EFORMAT, "'zz'");
    expect_bad("\"vocab\": {", "\"vocab\": {\"zz\": 5,", KVM_EFORMAT, "id 5");
    expect_bad("\"single_word\": false", "\"single_word\": true", KVM_ENOTSUP, "single_word");
    expect_bad("\"id\": 0,", "\"id\": \"x\",", KVM_EFORMAT, "added_tokens[0]");
    expect_bad("\"Regex\": \"", "\"Regex\": \"(?<\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9\\u00e9", KVM_EINVAL, "PCRE2");
    expect_bad("{", "[", KVM_EFORMAT, "line");
    expect_bad("\"dropout\": null", "\"dropout\": 0.1", KVM_ENOTSUP, "dropout");
}
END_TEST

/* A pre-tokenizer regex that backtracks without bound (a hostile or broken tokenizer.json) ran
 * into PCRE2's match limit while encoding, said as "tokenizer encode: PCRE2 match error -47". The
 * message now says what failed, where in the text, and PCRE2's own words. */
START_TEST(test_regex_match_limit)
{
    size_t n;
    char *src = kvm_test_read_file(TOK_DIR "/qwen_style/tokenizer.json", &n);
    ck_assert_ptr_nonnull(src);
    const char *from = "\"Regex\": \"";
    char *at = strstr(src, from);
    ck_assert_ptr_nonnull(at);
    char *dir = kvm_test_tmpdir(), path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fwrite(src, 1, (size_t)(at - src) + strlen(from), f);
    fputs("(a+)+$|", f); /* tried first at every position: exponential on a run of a's not at the end */
    fputs(at + strlen(from), f);
    fclose(f);
    kvm_tokenizer *t = NULL;
    ck_assert_msg(kvm_tokenizer_open_hf(path, 0, &t) == 0, "%s", kvm_errmsg());
    char text[64];
    memset(text, 'a', 40);
    snprintf(text + 40, sizeof text - 40, "!");
    int32_t *ids = NULL;
    int64_t nid = 0;
    int rc = kvm_tokenizer_encode(t, text, strlen(text), 0, 0, &ids, &nid);
    ck_assert_int_ne(rc, 0);
    ck_assert_msg(strstr(kvm_errmsg(), "pre-tokenizer regex failed at byte 0") && strstr(kvm_errmsg(), "match limit"),
                  "%s", kvm_errmsg());
    free(ids);
    kvm_tokenizer_close(&t);
    kvm_test_rmtree(dir);
    free(dir);
    free(src);
}
END_TEST

/* kvm__tokjson_parse_mem on a tokenizer.json's bytes: the ids kvm_tokenizer_open_hf's tokenizer
 * gives, and a cut copy refused naming the label it was given. */
START_TEST(test_mem)
{
    const char text[] = "Hello world 123, \xc3\xa9t\xc3\xa9 \xe4\xb8\xad <|endoftext|>  x";
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char p[512];
        snprintf(p, sizeof p, TOK_DIR "/%s/tokenizer.json", names[i]);
        size_t n;
        char *json = kvm_test_read_file(p, &n);
        ck_assert_ptr_nonnull(json);
        kvm_tokenizer *t;
        ck_assert_msg(kvm_tokenizer_open_hf(p, 0, &t) == 0, "%s", kvm_errmsg());
        kvm_bpe *b = NULL;
        kvm_tokjson_info info;
        ck_assert_msg(kvm__tokjson_parse_mem("mem.json", json, n, 0, &b, &info) == 0, "%s", kvm_errmsg());
        int32_t *a = NULL, *c = NULL;
        int64_t na = 0, nc = 0;
        ck_assert_int_eq(kvm_tokenizer_encode(t, text, sizeof text - 1, 0, 0, &a, &na), 0);
        ck_assert_int_eq(kvm__bpe_encode_new(b, text, sizeof text - 1, &c, &nc), 0);
        ck_assert_msg(na == nc, "%s: %lld ids from the file, %lld from memory", names[i], (long long)na, (long long)nc);
        for (int64_t k = 0; k < na; k++)
            ck_assert_int_eq(a[k], c[k]);
        free(a), free(c), free(info.chat_template);
        kvm__bpe_free(&b);
        kvm_tokenizer_close(&t);
        ck_assert_int_eq(kvm__tokjson_parse_mem("cut.json", json, n - 2, 0, &b, &info), KVM_EFORMAT);
        ck_assert_ptr_null(b);
        ck_assert_msg(strstr(kvm_errmsg(), "cut.json"), "%s", kvm_errmsg());
        free(json);
    }
}
END_TEST

/* Expects kvm_tokenizer_open_hf (llama2c: 0) on `path` to fail with `want`, naming each needle. */
static void expect_open(const char *path, int llama2c, int want, const char *n1, const char *n2)
{
    kvm_tokenizer *t = NULL;
    int rc = llama2c ? kvm_tokenizer_open_llama2c(path, 512, &t) : kvm_tokenizer_open_hf(path, 0, &t);
    ck_assert_msg(rc == want, "%s: got %d (%s), want %d", path, rc, kvm_errmsg(), want);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(kvm_errmsg(), n1) && (!n2 || strstr(kvm_errmsg(), n2)), "message '%s' lacks '%s' or '%s'",
                  kvm_errmsg(), n1, n2 ? n2 : "");
}

/* Tokenizer files that are not plain files: a FIFO as tokenizer.json, tokenizer_config.json or
 * a llama2.c tokenizer (each blocked the open or read forever), a broken symbolic link as
 * tokenizer_config.json (silently skipped: no BOS, no chat template) or as a Hugging Face
 * folder's tokenizer.json ("no tokenizer found"), each refused naming the file; a folder with
 * only tokenizer.model is told that format is not read. */
START_TEST(test_entries)
{
    char *dir = kvm_test_tmpdir(), p[4096], q[4096];
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    ck_assert_int_eq(mkfifo(p, 0644), 0);
    expect_open(p, 0, KVM_EFORMAT, "tokenizer.json: not a regular file", "FIFO");
    snprintf(q, sizeof q, "%s/tok.bin", dir);
    ck_assert_int_eq(mkfifo(q, 0644), 0);
    expect_open(q, 1, KVM_EFORMAT, "tok.bin: not a regular file", NULL);
    ck_assert_int_eq(unlink(p), 0);
    size_t n;
    char *src = kvm_test_read_file(TOK_DIR "/qwen_style/tokenizer.json", &n);
    ck_assert_int_eq(kvm_test_write_file(p, src, n), 0);
    free(src);
    snprintf(q, sizeof q, "%s/tokenizer_config.json", dir);
    ck_assert_int_eq(mkfifo(q, 0644), 0);
    expect_open(p, 0, KVM_EFORMAT, "tokenizer_config.json: not a regular file", "FIFO");
    ck_assert_int_eq(unlink(q), 0);
    ck_assert_int_eq(symlink("../../blobs/77aa", q), 0);
    expect_open(p, 0, KVM_EFORMAT, "tokenizer_config.json: a symbolic link to '../../blobs/77aa'", "does not exist");
    ck_assert_int_eq(unlink(q), 0);
    /* a Hugging Face folder (config.json) whose tokenizer.json is a link to a missing blob */
    snprintf(q, sizeof q, "%s/config.json", dir);
    ck_assert_int_eq(kvm_test_write_file(q, "{}", 2), 0);
    ck_assert_int_eq(unlink(p), 0);
    ck_assert_int_eq(symlink("../../blobs/99bb", p), 0);
    char found[4096];
    ck_assert_msg(kvm_tokenizer_find_for_model(dir, NULL, found, sizeof found) == 0, "%s", kvm_errmsg());
    ck_assert_str_eq(found, p);
    expect_open(found, 0, KVM_EFORMAT, "tokenizer.json: a symbolic link to '../../blobs/99bb'", NULL);
    /* only a SentencePiece tokenizer.model: "no tokenizer found" did not say why it is not used */
    ck_assert_int_eq(unlink(p), 0);
    snprintf(q, sizeof q, "%s/tokenizer.model", dir);
    ck_assert_int_eq(kvm_test_write_file(q, "\n\x0e", 2), 0);
    ck_assert_int_eq(kvm_tokenizer_find_for_model(dir, NULL, found, sizeof found), KVM_ENOTFOUND);
    ck_assert_msg(strstr(kvm_errmsg(), "tokenizer.model, SentencePiece's format, is not read"), "%s", kvm_errmsg());
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A new folder holding qwen_style's tokenizer.json (its path in p) and the path of a
 * tokenizer_config.json beside it, not written yet (in q); returns the folder (free it). */
static char *qwen_folder(char p[4096], char q[4096])
{
    char *dir = kvm_test_tmpdir();
    snprintf(p, 4096, "%s/tokenizer.json", dir);
    snprintf(q, 4096, "%s/tokenizer_config.json", dir);
    size_t n;
    char *src = kvm_test_read_file(TOK_DIR "/qwen_style/tokenizer.json", &n);
    ck_assert_int_eq(kvm_test_write_file(p, src, n), 0);
    free(src);
    return dir;
}

/* tokenizer_config.json's chat_template as a list of named templates (as some checkpoints ship
 * it, with a tool-use variant): the one named "default" is the chat template; entries without a
 * name, or whose name is not a string, are skipped; without a "default" there is none. */
START_TEST(test_template_list)
{
    char p[4096], q[4096], *dir = qwen_folder(p, q);
    static const char *const cfg[2] = {
        "{\"chat_template\": [{\"template\": \"N\"}, {\"name\": 3, \"template\": \"X\"}, "
        "{\"name\": \"tool_use\", \"template\": \"T\"}, {\"name\": \"default\", \"template\": \"D\"}]}",
        "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}"};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(kvm_test_write_file(q, cfg[i], strlen(cfg[i])), 0);
        kvm_bpe *b = NULL;
        kvm_tokjson_info info;
        ck_assert_msg(kvm__tokjson_open(p, 0, &b, &info) == 0, "%s", kvm_errmsg());
        if (i == 0)
            ck_assert_str_eq(info.chat_template, "D");
        else
            ck_assert_ptr_null(info.chat_template);
        free(info.chat_template);
        kvm__bpe_free(&b);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* tokenizer_config.json keys of a type the reader does not take: each was skipped as absent
 * (a string "true" as add_bos_token gave no BOS, where transformers adds one). */
START_TEST(test_config_types)
{
    char p[4096], q[4096], *dir = qwen_folder(p, q);
    static const char *const bad[][2] = {
        {"{\"add_bos_token\": \"true\"}", "key 'add_bos_token'"},
        {"{\"chat_template\": 5}", "key 'chat_template'"},
        {"{\"bos_token\": {\"content\": 1}}", "key 'bos_token'"},
        {"{\"eos_token\": 2}", "key 'eos_token'"},
        /* a NUL in a string read was cut there (jansson's refusal named no key) */
        {"{\"chat_template\": \"{{ a }}\\u0000{{ b }}\"}", "key 'chat_template' holds a NUL"},
        {"{\"chat_template\": [{\"name\": \"default\", \"template\": \"A\\u0000\"}]}",
         "key 'chat_template' holds a NUL"},
        {"{\"bos_token\": {\"content\": \"<s>\\u0000\"}}", "key 'bos_token' holds a NUL"},
        /* a BOS asked for that the vocabulary lacks: none was added */
        {"{\"bos_token\": \"<nope>\", \"add_bos_token\": true}",
         "add_bos_token is true but bos_token '<nope>' is not a token of"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_int_eq(kvm_test_write_file(q, bad[i][0], strlen(bad[i][0])), 0);
        expect_open(p, 0, KVM_EFORMAT, "tokenizer_config.json", bad[i][1]);
    }
    static const char ok[] = "{\"add_bos_token\": null, \"chat_template\": null, \"bos_token\": null, "
                             "\"eos_token\": {\"content\": \"x\"}}";
    ck_assert_int_eq(kvm_test_write_file(q, ok, strlen(ok)), 0);
    kvm_tokenizer *t = NULL;
    ck_assert_msg(kvm_tokenizer_open_hf(p, 0, &t) == 0, "%s", kvm_errmsg());
    kvm_tokenizer_close(&t);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* tokenizer.json and tokenizer_config.json that start with a UTF-8 byte-order mark are read as
 * without it (jansson refused them: "'[' or '{' expected near"). */
START_TEST(test_bom)
{
    char *dir = kvm_test_tmpdir(), p[4096], q[4096];
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    snprintf(q, sizeof q, "%s/tokenizer_config.json", dir);
    size_t n;
    char *src = kvm_test_read_file(TOK_DIR "/qwen_style/tokenizer.json", &n), *marked = malloc(n + 3);
    ck_assert_ptr_nonnull(src);
    memcpy(marked, "\xEF\xBB\xBF", 3);
    memcpy(marked + 3, src, n);
    ck_assert_int_eq(kvm_test_write_file(p, marked, n + 3), 0);
    static const char cfg[] = "\xEF\xBB\xBF{\"chat_template\": \"D\"}";
    ck_assert_int_eq(kvm_test_write_file(q, cfg, strlen(cfg)), 0);
    kvm_bpe *b = NULL;
    kvm_tokjson_info info;
    ck_assert_msg(kvm__tokjson_open(p, 0, &b, &info) == 0, "%s", kvm_errmsg());
    ck_assert_str_eq(info.chat_template, "D");
    free(info.chat_template);
    kvm__bpe_free(&b);
    ck_assert_msg(kvm__tokjson_parse_mem("mem.json", marked, n + 3, 0, &b, &info) == 0, "%s", kvm_errmsg());
    kvm__bpe_free(&b);
    free(src);
    free(marked);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Text as UTF-16 (be: big-endian) with its byte-order mark, as Notepad's "Unicode" saves it;
 * malloc'ed, *n its bytes. ASCII text only. */
static char *utf16_of(const char *text, int be, size_t *n)
{
    size_t k = strlen(text);
    char *u = malloc(2 * k + 2);
    u[0] = be ? '\xFE' : '\xFF', u[1] = be ? '\xFF' : '\xFE';
    for (size_t i = 0; i < k; i++)
        u[2 + 2 * i + be] = text[i], u[2 + 2 * i + !be] = 0;
    *n = 2 * k + 2;
    return u;
}

/* tokenizer.json or tokenizer_config.json saved as UTF-16: jansson said "unable to decode byte
 * 0xff (line 1, column 0)"; now the message names the file and the UTF-16 byte-order mark. */
START_TEST(test_utf16)
{
    char p[4096], q[4096], *dir = qwen_folder(p, q);
    size_t n;
    char *u = utf16_of("{\"chat_template\": \"D\"}", 0, &n);
    ck_assert_int_eq(kvm_test_write_file(q, u, n), 0);
    free(u);
    expect_open(p, 0, KVM_EFORMAT, "tokenizer_config.json: starts with a UTF-16 byte-order mark (FF FE)",
                "save it as UTF-8");
    unlink(q);
    u = utf16_of("{\"model\": {}}", 1, &n);
    ck_assert_int_eq(kvm_test_write_file(p, u, n), 0);
    expect_open(p, 0, KVM_EFORMAT, "tokenizer.json: starts with a UTF-16 byte-order mark (FE FF)", "save it as UTF-8");
    kvm_bpe *b = NULL;
    kvm_tokjson_info info;
    ck_assert_int_eq(kvm__tokjson_parse_mem("mem.json", u, n, 0, &b, &info), KVM_EFORMAT);
    ck_assert_msg(strstr(kvm_errmsg(), "mem.json: starts with a UTF-16 byte-order mark"), "%s", kvm_errmsg());
    free(u);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *tok_suite(void)
{
    Suite *s = suite_create("hf_tokenizer");
    TCase *tc = tcase_create("committed");
    tcase_add_loop_test(tc, test_committed, 0, (int)(sizeof names / sizeof names[0]));
    suite_add_tcase(s, tc);
    struct {
        const char *name;
        const TTest *fn;
    } more[] = {
        {"smol", test_smol},
        {"decode", test_decode},
        {"malformed", test_malformed},
        {"mem", test_mem},
        {"entries", test_entries},
        {"template_list", test_template_list},
        {"bom", test_bom},
        {"utf16", test_utf16},
        {"config_types", test_config_types},
        {"regex_match_limit", test_regex_match_limit},
    };
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) {
        tc = tcase_create(more[i].name);
        tcase_add_test(tc, more[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(tok_suite()); }
