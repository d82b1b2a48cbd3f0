/* check_tokenizer.c: the llama2.c tokenizer against run.c: golden prompt and seq256 ids,
 * golden generations decoded byte for byte, a verbatim run.c encoder as a differential
 * reference on stories and random bytes, round trips, byte fallback, and every documented
 * error for damaged tokenizer files. */
#include "model/kvm_tokenizer.h"
#include "common/kvm_error.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOK512 "models/tok512.bin"
#define VOCAB 512

static kvm_tokenizer *tok;

static void open_tok(void)
{
    int rc = kvm_tokenizer_open_llama2c(kvm_test_data_path(TOK512), VOCAB, &tok);
    ck_assert_msg(rc == 0, "open %s: %d %s", kvm_test_data_path(TOK512), rc, kvm_errmsg());
}

static void close_tok(void) { kvm_tokenizer_close(&tok); }

/* Reads a file of the embedded data/ or fails the test. */
static char *read_data(const char *rel, size_t *n)
{
    char *s = kvm_test_read_file(kvm_test_data_path(rel), n);
    ck_assert_msg(s != NULL, "cannot read %s", kvm_test_data_path(rel));
    return s;
}

/* Reads a file under shared/ or fails the test (callers check kvm_test_shared_path first). */
static char *read_shared(const char *rel, size_t *n)
{
    char *s = kvm_test_read_file(kvm_test_shared_path(rel), n);
    ck_assert_msg(s != NULL, "cannot read %s", kvm_test_shared_path(rel));
    return s;
}

/* One decimal id per line; returns the count, ids into a malloc'ed *out. */
static int read_ids(const char *rel, int32_t **out)
{
    size_t n;
    char *s = read_shared(rel, &n);
    int cap = 1024, k = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    char *p = s, *end;
    for (long v = strtol(p, &end, 10); end != p; v = strtol(p, &end, 10)) {
        ck_assert_int_lt(k, cap);
        ids[k++] = (int32_t)v;
        p = end;
    }
    free(s);
    *out = ids;
    return k;
}

static void assert_ids_eq(const int32_t *got, int64_t n_got, const int32_t *want, int64_t n_want,
                          const char *what)
{
    for (int64_t i = 0; i < n_got && i < n_want; i++)
        ck_assert_msg(got[i] == want[i], "%s: id[%lld] = %d, want %d", what, (long long)i,
                      got[i], want[i]);
    ck_assert_msg(n_got == n_want, "%s: %lld ids, want %lld", what, (long long)n_got,
                  (long long)n_want);
}

static void encode_ok(const char *text, size_t len, int bos, int eos, int32_t **ids,
                      int64_t *n)
{
    int rc = kvm_tokenizer_encode(tok, text, len, bos, eos, ids, n);
    ck_assert_msg(rc == 0, "encode: %d %s", rc, kvm_errmsg());
    ck_assert_ptr_nonnull(*ids);
}

/* decode(ids) must equal want (wn bytes) exactly. */
static void assert_decodes_to(const int32_t *ids, int64_t n, const char *want, size_t wn,
                              const char *what)
{
    char *text;
    size_t len;
    int rc = kvm_tokenizer_decode(tok, ids, n, &text, &len);
    ck_assert_msg(rc == 0, "%s: decode: %d %s", what, rc, kvm_errmsg());
    size_t i = 0;
    while (i < len && i < wn && text[i] == want[i]) i++;
    ck_assert_msg(len == wn && i == wn,
                  "%s: decoded %zu bytes, want %zu; first difference at byte %zu (0x%02x vs "
                  "0x%02x)",
                  what, len, wn, i, i < len ? (unsigned char)text[i] : 0,
                  i < wn ? (unsigned char)want[i] : 0);
    ck_assert_int_eq(text[len], '\0');
    free(text);
}

/* ---- a verbatim copy of run.c's encode (350e04fe), the differential reference ---- */

struct ref_entry {
    const char *str;
    int id;
};

/* tok512 parsed independently of kvm_tokenizer: NUL-terminated pieces, scores, sorted index */
static struct {
    char *pieces[VOCAB];
    float scores[VOCAB];
    struct ref_entry sorted[VOCAB];
} ref;

static int ref_cmp(const void *a, const void *b)
{
    return strcmp(((const struct ref_entry *)a)->str, ((const struct ref_entry *)b)->str);
}

static void ref_load(void)
{
    size_t n;
    unsigned char *f = (unsigned char *)read_data(TOK512, &n);
    size_t off = 4;
    for (int i = 0; i < VOCAB; i++) {
        int32_t len;
        memcpy(&ref.scores[i], f + off, 4);
        memcpy(&len, f + off + 4, 4);
        off += 8;
        ref.pieces[i] = malloc((size_t)len + 1);
        memcpy(ref.pieces[i], f + off, (size_t)len);
        ref.pieces[i][len] = '\0';
        off += (size_t)len;
        ref.sorted[i].str = ref.pieces[i];
        ref.sorted[i].id = i;
    }
    ck_assert_uint_eq(off, n);
    qsort(ref.sorted, VOCAB, sizeof ref.sorted[0], ref_cmp);
    free(f);
}

static void ref_unload(void)
{
    for (int i = 0; i < VOCAB; i++) free(ref.pieces[i]);
}

static int ref_lookup(const char *str)
{
    struct ref_entry key = {str, 0};
    struct ref_entry *r = bsearch(&key, ref.sorted, VOCAB, sizeof key, ref_cmp);
    return r ? r->id : -1;
}

/* run.c encode(), unchanged except for names; tokens holds strlen(text) + 3 ids. */
static void ref_encode(const char *text, int bos, int eos, int32_t *tokens, int64_t *n_tokens)
{
    char str_buffer[7 * 2 + 1 + 2];
    size_t str_len = 0;
    *n_tokens = 0;
    if (bos) tokens[(*n_tokens)++] = 1;
    if (text[0] != '\0') tokens[(*n_tokens)++] = ref_lookup(" ");
    for (const char *c = text; *c != '\0'; c++) {
        if ((*c & 0xC0) != 0x80) str_len = 0;
        str_buffer[str_len++] = *c;
        str_buffer[str_len] = '\0';
        if ((*(c + 1) & 0xC0) == 0x80 && str_len < 4) continue;
        int id = ref_lookup(str_buffer);
        if (id != -1) {
            tokens[(*n_tokens)++] = id;
        } else {
            for (size_t i = 0; i < str_len; i++)
                tokens[(*n_tokens)++] = (unsigned char)str_buffer[i] + 3;
        }
        str_len = 0;
    }
    while (1) {
        float best_score = -1e10;
        int best_id = -1;
        int64_t best_idx = -1;
        for (int64_t i = 0; i < (*n_tokens - 1); i++) {
            snprintf(str_buffer, sizeof str_buffer, "%s%s", ref.pieces[tokens[i]],
                     ref.pieces[tokens[i + 1]]);
            int id = ref_lookup(str_buffer);
            if (id != -1 && ref.scores[id] > best_score) {
                best_score = ref.scores[id];
                best_id = id;
                best_idx = i;
            }
        }
        if (best_idx == -1) break;
        tokens[best_idx] = best_id;
        for (int64_t i = best_idx + 1; i < (*n_tokens - 1); i++) tokens[i] = tokens[i + 1];
        (*n_tokens)--;
    }
    if (eos) tokens[(*n_tokens)++] = 2;
}

/* kvm_tokenizer_encode(text) must equal run.c's encode(text) for each bos/eos combination
 * whose bit is set in flag_mask (bit index bos + 2 * eos). */
static void assert_matches_ref(const char *text, unsigned flag_mask, const char *what)
{
    size_t len = strlen(text);
    int32_t *want = malloc((len + 3) * sizeof *want);
    for (int flags = 0; flags < 4; flags++) {
        if (!(flag_mask >> flags & 1u)) continue;
        int bos = flags & 1, eos = flags >> 1;
        int64_t n_want, n_got;
        int32_t *got;
        ref_encode(text, bos, eos, want, &n_want);
        encode_ok(text, len, bos, eos, &got, &n_got);
        assert_ids_eq(got, n_got, want, n_want, what);
        free(got);
    }
    free(want);
}

/* ---- golden data ---- */

/* The -i "..." argument of gen_NN.cmd, malloc'ed. */
static char *golden_prompt(int k)
{
    char rel[64];
    snprintf(rel, sizeof rel, "golden/gen/gen_%02d.cmd", k);
    size_t n;
    char *cmd = read_shared(rel, &n);
    char *start = strstr(cmd, "-i \"");
    char *end = strrchr(cmd, '"');
    ck_assert_msg(start && end > start + 3, "%s: no -i \"...\" in %s", rel, cmd);
    start += 4;
    char *prompt = strndup(start, (size_t)(end - start));
    free(cmd);
    return prompt;
}

/* gen_NN.ids.txt begins with BOS + run.c's encoding of the prompt. */
START_TEST(golden_prompt_ids)
{
    static const int32_t once_upon[] = {1, 403, 407, 261, 378}; /* "Once upon a time" */
    if (!kvm_test_shared_path("golden/gen")) return;
    for (int k = 0; k < 4; k++) {
        char rel[64];
        snprintf(rel, sizeof rel, "golden/gen/gen_%02d.ids.txt", k);
        int32_t *gold;
        int n_gold = read_ids(rel, &gold);
        ck_assert_int_eq(n_gold, 201);
        char *prompt = golden_prompt(k);
        int32_t *ids;
        int64_t n;
        encode_ok(prompt, strlen(prompt), 1, 0, &ids, &n);
        ck_assert_msg(n > 1 && n < n_gold, "%s: prompt \"%s\" gave %lld ids", rel, prompt,
                      (long long)n);
        assert_ids_eq(ids, n, gold, n, rel);
        if (k == 0) assert_ids_eq(ids, n, once_upon, 5, "gen_00 literal");
        free(ids);
        free(prompt);
        free(gold);
    }
}
END_TEST

/* seq256.ids.txt is the first 256 ids of run.c's encode(story_00000, bos=1) (320 ids), and
 * the ids the tests compute from the embedded data/corpus/doc_000.txt (kvm_test_golden_ids). */
START_TEST(golden_seq256_ids)
{
    if (!kvm_test_shared_path("golden/seq256.ids.txt") ||
        !kvm_test_shared_path("data/tinystories/stories/story_00000.txt"))
        return;
    int32_t *gold, embedded[256];
    int n_gold = read_ids("golden/seq256.ids.txt", &gold);
    ck_assert_int_eq(n_gold, 256);
    size_t len;
    char *story = read_shared("data/tinystories/stories/story_00000.txt", &len);
    int32_t *ids;
    int64_t n;
    encode_ok(story, len, 1, 0, &ids, &n);
    ck_assert_int_eq(n, 320);
    assert_ids_eq(ids, 256, gold, 256, "seq256");
    kvm_test_golden_ids(embedded);
    assert_ids_eq(embedded, 256, gold, 256, "seq256 from data/corpus/doc_000.txt");
    free(ids);
    free(story);
    free(gold);
}
END_TEST

/* run.c's generate loop output: piece(prev, id) for ids[1..], safe_printf filter, then "\n". */
START_TEST(golden_generation_text)
{
    if (!kvm_test_shared_path("golden/gen")) return;
    for (int k = 0; k < 4; k++) {
        char rel[64];
        snprintf(rel, sizeof rel, "golden/gen/gen_%02d.ids.txt", k);
        int32_t *ids;
        int n = read_ids(rel, &ids);
        snprintf(rel, sizeof rel, "golden/gen/gen_%02d.txt", k);
        size_t want_len;
        char *want = read_shared(rel, &want_len);
        char *out = malloc(8 * (size_t)n + 2);
        size_t at = 0;
        for (int i = 1; i < n; i++) {
            size_t pn;
            const char *p = kvm_tokenizer_piece(tok, ids[i - 1], ids[i], &pn);
            ck_assert_msg(p != NULL, "%s: id %d has no piece", rel, ids[i]);
            if (!kvm_tokenizer_piece_printable(p, pn)) continue;
            memcpy(out + at, p, pn);
            at += pn;
        }
        out[at++] = '\n';
        size_t i = 0;
        while (i < at && i < want_len && out[i] == want[i]) i++;
        ck_assert_msg(at == want_len && i == at, "%s: %zu bytes vs %zu, differ at byte %zu", rel,
                      at, want_len, i);
        free(out);
        free(want);
        free(ids);
    }
}
END_TEST

/* ---- differential: the hashed/heap encoder vs the verbatim run.c encoder ---- */

START_TEST(matches_runc_on_stories)
{
    ref_load();
    /* every 100th story with BOS, as the model sees them (run.c's encoder is quadratic, so
     * not all); KVMILL_TOK_ALL=1 compares all 2,316 */
    const char *all = getenv("KVMILL_TOK_ALL");
    int stride = (all && *all == '1') ? 1 : 100;
    if (!kvm_test_shared_find("data/tinystories/stories")) {
        /* no ../shared: the 6 embedded documents (stories 0-17) */
        for (int k = 0; k < 6; k++) {
            char rel[64];
            snprintf(rel, sizeof rel, "corpus/doc_%03d.txt", k);
            size_t len;
            char *doc = read_data(rel, &len);
            assert_matches_ref(doc, 1u, rel);
            free(doc);
        }
        ref_unload();
        kvm_test_shared_path("data/tinystories/stories"); /* SKIP: the stories themselves */
        return;
    }
    for (int k = 0; k < 2316; k += stride) {
        char rel[96];
        snprintf(rel, sizeof rel, "data/tinystories/stories/story_%05d.txt", k);
        size_t len;
        char *story = read_shared(rel, &len);
        assert_matches_ref(story, 1u, rel);
        free(story);
    }
    /* non-ASCII stories with curly quotes */
    static const int curly[] = {61, 75, 77};
    for (size_t k = 0; k < sizeof curly / sizeof curly[0]; k++) {
        char rel[96];
        snprintf(rel, sizeof rel, "data/tinystories/stories/story_%05d.txt", curly[k]);
        size_t len;
        char *story = read_shared(rel, &len);
        assert_matches_ref(story, 1u, rel);
        free(story);
    }
    ref_unload();
}
END_TEST

/* Random short strings from an alphabet of pieces, spaces, ASCII, valid multi-byte code
 * points, lone lead bytes, runs of stray continuation bytes (run.c groups up to 4) and runs of
 * one letter (equal-score pairs, where run.c takes the leftmost). */
START_TEST(matches_runc_on_random_bytes)
{
    ref_load();
    static const char *const atoms[] = {
        " ",    "  ",   "the", " the", "e",       "a",        "Lily", " friend", " little",
        "\n",   "\t",   ".",   ",",    "\xe2\x80\x9c", "\xe2\x80\x9d", "\xc3\xa9", "\xc3\xbc",
        "\xf0\x9f\x98\x80", "\x80", "\x80\x80\x80\x80\x80", "\xc3", "\xe2\x80", "\xff", "\xfe\xbf",
        "<0x41>", "<s>", "\x01", "ing", " was", "ed", "he", "\xe2\x82\xac",
        "l",    "lll",  "oo",  "o",    "ppp",     /* "ll", "oo", "pp" are pieces: score ties */
    };
    const int n_atoms = (int)(sizeof atoms / sizeof atoms[0]);
    unsigned int seed = 12345;
    char text[512];
    for (int iter = 0; iter < 3000; iter++) {
        size_t at = 0;
        seed = seed * 1103515245u + 12345u;
        int n = (int)((seed >> 16) % 24);
        for (int j = 0; j < n; j++) {
            seed = seed * 1103515245u + 12345u;
            const char *a = atoms[(seed >> 16) % (unsigned)n_atoms];
            size_t al = strlen(a);
            memcpy(text + at, a, al);
            at += al;
        }
        text[at] = '\0';
        char what[64];
        snprintf(what, sizeof what, "random case %d (%zu bytes)", iter, at);
        assert_matches_ref(text, 0xfu, what);
    }
    ref_unload();
}
END_TEST

/* ---- round trips ---- */

/* decode(encode(s, bos=1)) == s; decode(encode(s, bos=0)) == " " + s (the dummy prefix). */
static void assert_round_trip(const char *s, size_t len, const char *what)
{
    int32_t *ids;
    int64_t n;
    encode_ok(s, len, 1, 1, &ids, &n);
    ck_assert_int_eq(ids[0], 1);
    ck_assert_int_eq(ids[n - 1], 2);
    assert_decodes_to(ids, n, s, len, what);
    free(ids);
    encode_ok(s, len, 0, 0, &ids, &n);
    char *spaced = malloc(len + 2);
    spaced[0] = ' ';
    memcpy(spaced + 1, s, len);
    assert_decodes_to(ids, n, spaced, len + 1, what);
    free(spaced);
    free(ids);
}

START_TEST(round_trip_real_text)
{
    /* the 20 long documents of ../shared, else the 6 embedded ones */
    const int shared = kvm_test_shared_find("data/long") != NULL;
    for (int k = 0; k < (shared ? 20 : 6); k++) {
        char rel[64];
        snprintf(rel, sizeof rel, shared ? "data/long/doc_%03d.txt" : "corpus/doc_%03d.txt", k);
        size_t len;
        char *doc = shared ? read_shared(rel, &len) : read_data(rel, &len);
        assert_round_trip(doc, len, rel);
        free(doc);
    }
    /* a story with curly quotes: they are pieces of their own in tok512 (ids 465, 466) */
    if (!kvm_test_shared_path("data/tinystories/stories/story_00061.txt")) return;
    size_t len;
    char *story = read_shared("data/tinystories/stories/story_00061.txt", &len);
    ck_assert_ptr_nonnull(strstr(story, "\xe2\x80\x9c"));
    int32_t *ids;
    int64_t n;
    encode_ok(story, len, 1, 0, &ids, &n);
    int has_quote = 0;
    for (int64_t i = 0; i < n; i++) has_quote |= ids[i] == 465;
    ck_assert_msg(has_quote, "story_00061: no id 465 (left curly quote) among %lld ids",
                  (long long)n);
    free(ids);
    assert_round_trip(story, len, "story_00061");
    free(story);
}
END_TEST

/* ---- byte fallback ---- */

START_TEST(byte_fallback)
{
    /* U+1F600 and U+00FC are not in tok512: their UTF-8 bytes become ids byte + 3 */
    const char *text = "\xf0\x9f\x98\x80\xc3\xbc";
    const int32_t want[] = {1, 410, 0xf0 + 3, 0x9f + 3, 0x98 + 3, 0x80 + 3, 0xc3 + 3, 0xbc + 3};
    int32_t *ids;
    int64_t n;
    encode_ok(text, strlen(text), 1, 0, &ids, &n);
    assert_ids_eq(ids, n, want, 8, "emoji + u-umlaut");
    assert_decodes_to(ids, n, text, strlen(text), "emoji + u-umlaut");
    free(ids);
    /* é is a piece (485): no fallback */
    encode_ok("\xc3\xa9", 2, 0, 0, &ids, &n);
    const int32_t want_e[] = {410, 485};
    assert_ids_eq(ids, n, want_e, 2, "e-acute");
    free(ids);
    /* invalid UTF-8 and a NUL byte (counted by len, unlike run.c's C string) round-trip too */
    const char bad[] = "a\xff\x80\x80\x80\x80\x80 b\0c\xc3";
    assert_round_trip(bad, sizeof bad - 1, "invalid utf-8");
}
END_TEST

/* ---- pieces ---- */

START_TEST(piece_rules)
{
    size_t n;
    const char *p = kvm_tokenizer_piece(tok, 2, 410, &n); /* " " */
    ck_assert_uint_eq(n, 1);
    ck_assert_int_eq(p[0], ' ');
    p = kvm_tokenizer_piece(tok, 1, 410, &n); /* after BOS the space goes */
    ck_assert_uint_eq(n, 0);
    p = kvm_tokenizer_piece(tok, 1, 403, &n); /* " Once" after BOS */
    ck_assert_uint_eq(n, 4);
    ck_assert_int_eq(memcmp(p, "Once", 4), 0);
    p = kvm_tokenizer_piece(tok, 403, 403, &n);
    ck_assert_uint_eq(n, 5);
    ck_assert_int_eq(memcmp(p, " Once", 5), 0);
    p = kvm_tokenizer_piece(tok, -1, 0x41 + 3, &n); /* "<0x41>" -> 'A' */
    ck_assert_uint_eq(n, 1);
    ck_assert_int_eq(p[0], 'A');
    p = kvm_tokenizer_piece(tok, -1, 3, &n); /* "<0x00>" -> NUL byte, dropped by safe_printf */
    ck_assert_uint_eq(n, 1);
    ck_assert_int_eq(p[0], '\0');
    ck_assert_int_eq(kvm_tokenizer_piece_printable(p, n), 0);
    p = kvm_tokenizer_piece(tok, -1, 1, &n); /* BOS's own piece */
    ck_assert_uint_eq(n, 5);
    ck_assert_int_eq(memcmp(p, "\n<s>\n", 5), 0);
    ck_assert_ptr_null(kvm_tokenizer_piece(tok, -1, 512, &n));
    ck_assert_uint_eq(n, 0);
    ck_assert_ptr_null(kvm_tokenizer_piece(tok, -1, -1, &n));
    ck_assert_ptr_null(kvm_tokenizer_piece(NULL, -1, 5, &n));

    ck_assert_int_eq(kvm_tokenizer_piece_printable("\n", 1), 1);
    ck_assert_int_eq(kvm_tokenizer_piece_printable(" ", 1), 1);
    ck_assert_int_eq(kvm_tokenizer_piece_printable("~", 1), 1);
    ck_assert_int_eq(kvm_tokenizer_piece_printable("\x01", 1), 0);
    ck_assert_int_eq(kvm_tokenizer_piece_printable("\x7f", 1), 0);
    ck_assert_int_eq(kvm_tokenizer_piece_printable("\xe2", 1), 0);
    ck_assert_int_eq(kvm_tokenizer_piece_printable("\xe2\x80\x9c", 3), 1);
    ck_assert_int_eq(kvm_tokenizer_piece_printable("", 0), 0);
    ck_assert_int_eq(kvm_tokenizer_piece_printable(NULL, 3), 0);

    ck_assert_int_eq(kvm_tokenizer_vocab_size(tok), 512);
    ck_assert_int_eq(kvm_tokenizer_bos(tok), 1);
    ck_assert_int_eq(kvm_tokenizer_eos(tok), 2);
}
END_TEST

/* ---- empty and long input ---- */

START_TEST(empty_text)
{
    int32_t *ids;
    int64_t n;
    encode_ok("", 0, 1, 0, &ids, &n);
    const int32_t bos[] = {1};
    assert_ids_eq(ids, n, bos, 1, "empty, bos");
    free(ids);
    encode_ok(NULL, 0, 1, 1, &ids, &n);
    const int32_t bos_eos[] = {1, 2};
    assert_ids_eq(ids, n, bos_eos, 2, "NULL text, bos+eos");
    assert_decodes_to(ids, n, "", 0, "bos+eos");
    free(ids);
    encode_ok("", 0, 0, 0, &ids, &n);
    ck_assert_int_eq(n, 0);
    free(ids);
    assert_decodes_to(NULL, 0, "", 0, "no ids");
}
END_TEST

START_TEST(long_document)
{
    if (!kvm_test_shared_path("data/long2k/doc_000.txt")) return;
    size_t len;
    char *doc = read_shared("data/long2k/doc_000.txt", &len);
    ck_assert_uint_gt(len, 12000);
    int32_t *ids;
    int64_t n;
    encode_ok(doc, len, 1, 0, &ids, &n);
    ck_assert_msg(n > 1000 && n < (int64_t)len, "%zu bytes gave %lld ids", len, (long long)n);
    assert_decodes_to(ids, n, doc, len, "long2k/doc_000");
    free(ids);
    free(doc);
}
END_TEST

/* ---- argument errors ---- */

START_TEST(bad_arguments)
{
    int32_t *ids = (int32_t *)&ids;
    int64_t n = 7;
    ck_assert_int_eq(kvm_tokenizer_encode(NULL, "a", 1, 1, 0, &ids, &n), KVM_EINVAL);
    ck_assert_ptr_null(ids);
    ck_assert_int_eq(n, 0);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, NULL, 3, 1, 0, &ids, &n), KVM_EINVAL);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, "a", 1, 1, 0, NULL, &n), KVM_EINVAL);
    char *text = (char *)&text;
    size_t len = 9;
    const int32_t bad[] = {1, 410, 512};
    ck_assert_int_eq(kvm_tokenizer_decode(tok, bad, 3, &text, &len), KVM_ERANGE);
    ck_assert_ptr_null(text);
    ck_assert_uint_eq(len, 0);
    ck_assert_msg(strstr(kvm_errmsg(), "ids[2] = 512") != NULL, "message: %s", kvm_errmsg());
    const int32_t neg[] = {-4};
    ck_assert_int_eq(kvm_tokenizer_decode(tok, neg, 1, &text, &len), KVM_ERANGE);
    ck_assert_int_eq(kvm_tokenizer_decode(tok, NULL, 2, &text, &len), KVM_EINVAL);
    ck_assert_int_eq(kvm_tokenizer_decode(tok, bad, -1, &text, &len), KVM_EINVAL);
    kvm_tokenizer *t = (kvm_tokenizer *)&t;
    ck_assert_int_eq(kvm_tokenizer_open_llama2c(NULL, VOCAB, &t), KVM_EINVAL);
    ck_assert_ptr_null(t);
    ck_assert_int_eq(kvm_tokenizer_open_llama2c(kvm_test_data_path(TOK512), VOCAB, NULL),
                     KVM_EINVAL);
    /* a model header's vocab_size below what the tokenizer has: the message blamed the file */
    ck_assert_int_eq(kvm_tokenizer_open_llama2c(kvm_test_data_path(TOK512), 100, &t), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "the model's vocab_size 100 is below the 259 ids"), "message: %s", kvm_errmsg());
    kvm_tokenizer_close(NULL);
    kvm_tokenizer_close(&t);
    ck_assert_ptr_null(t);
}
END_TEST

/* ---- damaged tokenizer files ---- */

static char *tmpdir;
static char *good_bytes;
static size_t good_len;

static void bad_files_setup(void)
{
    tmpdir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(tmpdir);
    good_bytes = read_data(TOK512, &good_len);
    ck_assert_uint_eq(good_len, 6227);
}

static void bad_files_teardown(void)
{
    kvm_test_rmtree(tmpdir);
    free(tmpdir);
    free(good_bytes);
}

/* Byte offset of record i (its score) in tok512. */
static size_t record_offset(int i)
{
    size_t off = 4;
    for (int k = 0; k < i; k++) {
        int32_t len;
        memcpy(&len, good_bytes + off + 4, 4);
        off += 8 + (size_t)len;
    }
    return off;
}

/* Opens `data` written to a temp file with vocab_size and expects status `want` with a
 * message that contains the path and `needle`. */
static void expect_open_error(const void *data, size_t n, int vocab_size, int want,
                              const char *needle)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/tok.bin", tmpdir);
    ck_assert_int_eq(kvm_test_write_file(path, data, n), 0);
    kvm_tokenizer *t = (kvm_tokenizer *)&t;
    int rc = kvm_tokenizer_open_llama2c(path, vocab_size, &t);
    ck_assert_msg(rc == want, "%zu bytes, vocab %d: status %d (%s), want %d; message: %s", n,
                  vocab_size, rc, kvm_strerror(rc), want, kvm_errmsg());
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(kvm_errmsg(), path) != NULL, "message lacks the path: %s",
                  kvm_errmsg());
    ck_assert_msg(strstr(kvm_errmsg(), needle) != NULL, "message lacks \"%s\": %s", needle,
                  kvm_errmsg());
}

START_TEST(bad_file_missing_or_directory)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/absent.bin", tmpdir);
    kvm_tokenizer *t = NULL;
    int rc = kvm_tokenizer_open_llama2c(path, VOCAB, &t);
    ck_assert_msg(rc == KVM_ENOTFOUND, "status %d: %s", rc, kvm_errmsg());
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), path));
    rc = kvm_tokenizer_open_llama2c(tmpdir, VOCAB, &t);
    ck_assert_msg(rc == KVM_EFORMAT, "status %d: %s", rc, kvm_errmsg()); /* the wrong kind of path: usage */
    ck_assert_msg(strstr(kvm_errmsg(), "directory") != NULL, "message: %s", kvm_errmsg());
    ck_assert_ptr_null(t);
}
END_TEST

START_TEST(bad_file_truncated)
{
    expect_open_error("", 0, VOCAB, KVM_EFORMAT, "max_token_length");
    expect_open_error(good_bytes, 2, VOCAB, KVM_EFORMAT, "truncated inside max_token_length");
    size_t r0 = record_offset(0), r300 = record_offset(300);
    expect_open_error(good_bytes, r0 + 2, VOCAB, KVM_EFORMAT, "record 0: truncated inside score");
    expect_open_error(good_bytes, r0 + 6, VOCAB, KVM_EFORMAT, "record 0: truncated inside len");
    expect_open_error(good_bytes, r0 + 10, VOCAB, KVM_EFORMAT,
                      "record 0: truncated inside piece bytes");
    expect_open_error(good_bytes, r300 + 1, VOCAB, KVM_EFORMAT,
                      "record 300: truncated inside score");
    expect_open_error(good_bytes, r300 + 7, VOCAB, KVM_EFORMAT,
                      "record 300: truncated inside len");
    expect_open_error(good_bytes, r300 + 9, VOCAB, KVM_EFORMAT,
                      "record 300: truncated inside piece bytes");
    expect_open_error(good_bytes, good_len - 1, VOCAB, KVM_EFORMAT,
                      "record 511: truncated inside piece bytes");
    expect_open_error(good_bytes, r300, VOCAB, KVM_EFORMAT, "file ends after 300 records");
}
END_TEST

START_TEST(bad_file_fields)
{
    char *b = malloc(good_len);
    int32_t v;
    /* max_token_length 0 and negative */
    memcpy(b, good_bytes, good_len);
    v = 0;
    memcpy(b, &v, 4);
    expect_open_error(b, good_len, VOCAB, KVM_EFORMAT, "max_token_length = 0");
    v = -7;
    memcpy(b, &v, 4);
    expect_open_error(b, good_len, VOCAB, KVM_EFORMAT, "max_token_length = -7");
    /* negative len in record 5 */
    memcpy(b, good_bytes, good_len);
    v = -1;
    memcpy(b + record_offset(5) + 4, &v, 4);
    expect_open_error(b, good_len, VOCAB, KVM_EFORMAT, "record 5: negative piece length -1");
    /* len above max_token_length (7) in record 10 */
    memcpy(b, good_bytes, good_len);
    v = 8;
    memcpy(b + record_offset(10) + 4, &v, 4);
    expect_open_error(b, good_len, VOCAB, KVM_EFORMAT,
                      "record 10: piece length 8 exceeds max_token_length 7");
    /* a header that undercuts real pieces: " friend" (7 bytes) breaks max_token_length 6 */
    memcpy(b, good_bytes, good_len);
    v = 6;
    memcpy(b, &v, 4);
    expect_open_error(b, good_len, VOCAB, KVM_EFORMAT, "exceeds max_token_length 6");
    free(b);
}
END_TEST

/* A llama2.c model passed as the tokenizer failed with "record 2: piece length 265839806 exceeds
 * max_token_length 64", which did not say the file is no tokenizer; a damaged real tokenizer keeps
 * its record's message without the note. */
START_TEST(model_file_as_tokenizer)
{
    kvm_tokenizer *t = NULL;
    const char *model = kvm_test_data_path("models/stories260K.bin");
    ck_assert_int_eq(kvm_tokenizer_open_llama2c(model, VOCAB, &t), KVM_EFORMAT);
    ck_assert_ptr_null(t);
    char want[4400];
    snprintf(want, sizeof want,
             "%s: not a llama2.c tokenizer (a llama2.c model file: the header's max_token_length is 64, the model's "
             "dim; give the tokenizer file, not the model)",
             model);
    ck_assert_msg(strstr(kvm_errmsg(), want), "message: %s", kvm_errmsg());
    expect_open_error(good_bytes, record_offset(0) + 2, VOCAB, KVM_EFORMAT, "record 0: truncated inside score");
    ck_assert_msg(!strstr(kvm_errmsg(), "not a llama2.c tokenizer"), "message: %s", kvm_errmsg());
    expect_open_error("GGUF\3\0\0\0\0\0\0\0", 12, VOCAB, KVM_EFORMAT, "not a llama2.c tokenizer (a GGUF file");
    /* a clone of tinyllamas made without git-lfs, or a saved error page: "record 0: truncated
     * inside piece bytes (len 1886680168 ...)" */
    static const char lfs[] = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 6227\n";
    expect_open_error(lfs, sizeof lfs - 1, VOCAB, KVM_EFORMAT, "a Git LFS pointer");
    static const char html[] = "<!DOCTYPE html><html><body>404 Not Found</body></html>\n";
    expect_open_error(html, sizeof html - 1, VOCAB, KVM_EFORMAT, "not a llama2.c tokenizer: a text file");
}
END_TEST

/* A vocabulary without the " " piece: encode failed on every prompt with a message naming
 * no file (exit 1); now the open refuses it naming the file and the missing piece. */
START_TEST(bad_file_no_space_piece)
{
    char *b = malloc(good_len);
    memcpy(b, good_bytes, good_len);
    size_t off = 4;
    int found = 0;
    for (int i = 0; i < VOCAB; i++) {
        int32_t len;
        memcpy(&len, b + off + 4, 4);
        if (len == 1 && b[off + 8] == ' ') b[off + 8] = 0x7f, found++;
        off += 8 + (size_t)len;
    }
    ck_assert_int_eq(found, 1);
    expect_open_error(b, good_len, VOCAB, KVM_EFORMAT, "no \" \" piece among the 512 records");
    free(b);
}
END_TEST

START_TEST(bad_file_vocab_size)
{
    expect_open_error(good_bytes, good_len, 513, KVM_EFORMAT,
                      "file ends after 512 records but vocab_size is 513");
    expect_open_error(good_bytes, good_len, 1 << 30, KVM_EFORMAT, "file ends after 512 records");
    expect_open_error(good_bytes, good_len, 511, KVM_EFORMAT, "trailing bytes after record 510");
    expect_open_error(good_bytes, good_len, 100, KVM_EINVAL, "vocab_size 100");
    /* trailing garbage after all 512 records */
    char *b = malloc(good_len + 3);
    memcpy(b, good_bytes, good_len);
    memcpy(b + good_len, "xyz", 3);
    expect_open_error(b, good_len + 3, VOCAB, KVM_EFORMAT, "3 trailing bytes");
    free(b);
}
END_TEST

/* ---- scores and duplicates in a modified tok512 ---- */

/* Opens a copy of tok512 in which record `id` has score `score` (and, if dup_of >= 0, the
 * piece bytes of record dup_of, which must have the same length). */
static kvm_tokenizer *open_variant(int id, float score, int dup_of)
{
    char *b = malloc(good_len);
    memcpy(b, good_bytes, good_len);
    size_t off = record_offset(id);
    memcpy(b + off, &score, 4);
    if (dup_of >= 0) {
        size_t src = record_offset(dup_of);
        int32_t len, len_src;
        memcpy(&len, b + off + 4, 4);
        memcpy(&len_src, b + src + 4, 4);
        ck_assert_int_eq(len, len_src);
        memcpy(b + off + 8, b + src + 8, (size_t)len);
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/variant.bin", tmpdir);
    ck_assert_int_eq(kvm_test_write_file(path, b, good_len), 0);
    free(b);
    kvm_tokenizer *t = NULL;
    int rc = kvm_tokenizer_open_llama2c(path, VOCAB, &t);
    ck_assert_msg(rc == 0, "open variant: %d %s", rc, kvm_errmsg());
    return t;
}

/* Encodes "t" (no BOS): " t" is piece 259, so a mergeable 259 gives {259}. */
static int64_t encode_t(kvm_tokenizer *t, int32_t *first)
{
    int32_t *ids;
    int64_t n;
    ck_assert_int_eq(kvm_tokenizer_encode(t, "t", 1, 0, 0, &ids, &n), 0);
    *first = ids[0];
    free(ids);
    return n;
}

/* run.c starts best_score at -1e10 and compares with '>': a piece scoring -1e10 or NaN never
 * merges, one a float step above does. */
START_TEST(merge_score_threshold)
{
    int32_t first;
    kvm_tokenizer *t = open_variant(259, -1e10f, -1);
    ck_assert_int_eq(encode_t(t, &first), 2);
    ck_assert_int_eq(first, 410);
    kvm_tokenizer_close(&t);
    t = open_variant(259, nextafterf(-1e10f, 0.0f), -1);
    ck_assert_int_eq(encode_t(t, &first), 1);
    ck_assert_int_eq(first, 259);
    kvm_tokenizer_close(&t);
    t = open_variant(259, NAN, -1);
    ck_assert_int_eq(encode_t(t, &first), 2);
    kvm_tokenizer_close(&t);
}
END_TEST

/* A piece stored twice ("he" at 260 overwritten with " t" from 259): encode uses the lower
 * id, piece() still returns each record's own bytes. */
START_TEST(duplicate_piece_lower_id)
{
    kvm_tokenizer *t = open_variant(260, -1.0f, 259);
    int32_t first;
    ck_assert_int_eq(encode_t(t, &first), 1);
    ck_assert_int_eq(first, 259);
    size_t n;
    const char *p = kvm_tokenizer_piece(t, -1, 260, &n);
    ck_assert_uint_eq(n, 2);
    ck_assert_int_eq(memcmp(p, " t", 2), 0);
    kvm_tokenizer_close(&t);
}
END_TEST

/* kvm__tokenizer_llama2c_mem on tok512's bytes: the tokenizer the file gives (same ids for a
 * text), and a cut copy refused naming the label it was given. */
START_TEST(mem_matches_file)
{
    size_t n = 0;
    char *bytes = read_data(TOK512, &n);
    kvm_tokenizer *t = NULL;
    ck_assert_msg(kvm__tokenizer_llama2c_mem("mem.bin", (const unsigned char *)bytes, (int64_t)n, VOCAB, &t) == 0,
                  "%s", kvm_errmsg());
    const char text[] = "Once upon a time, a little girl named Lily \xc3\xbc.";
    int32_t *a = NULL, *b = NULL;
    int64_t na = 0, nb = 0;
    ck_assert_int_eq(kvm_tokenizer_encode(tok, text, sizeof text - 1, 1, 0, &a, &na), 0);
    ck_assert_int_eq(kvm_tokenizer_encode(t, text, sizeof text - 1, 1, 0, &b, &nb), 0);
    ck_assert_int_eq(na, nb);
    for (int64_t i = 0; i < na; i++)
        ck_assert_int_eq(a[i], b[i]);
    free(a), free(b);
    kvm_tokenizer_close(&t);
    ck_assert_int_eq(kvm__tokenizer_llama2c_mem("cut.bin", (const unsigned char *)bytes, (int64_t)n - 1, VOCAB, &t),
                     KVM_EFORMAT);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(kvm_errmsg(), "cut.bin") && strstr(kvm_errmsg(), "record 511"), "%s", kvm_errmsg());
    free(bytes);
}
END_TEST

/* ---- suite ---- */

static Suite *tokenizer_suite(void)
{
    Suite *s = suite_create("tokenizer");
    const struct {
        const char *name;
        const TTest *fn;
        int fixture; /* 1: tok512 open, 2: temp dir + tok512 bytes, 0: none */
    } cases[] = {
        {"golden_prompt_ids", golden_prompt_ids, 1},
        {"golden_seq256_ids", golden_seq256_ids, 1},
        {"golden_generation_text", golden_generation_text, 1},
        {"matches_runc_on_stories", matches_runc_on_stories, 1},
        {"matches_runc_on_random_bytes", matches_runc_on_random_bytes, 1},
        {"round_trip_real_text", round_trip_real_text, 1},
        {"byte_fallback", byte_fallback, 1},
        {"piece_rules", piece_rules, 1},
        {"empty_text", empty_text, 1},
        {"long_document", long_document, 1},
        {"bad_arguments", bad_arguments, 1},
        {"mem_matches_file", mem_matches_file, 1},
        {"bad_file_missing_or_directory", bad_file_missing_or_directory, 2},
        {"bad_file_truncated", bad_file_truncated, 2},
        {"bad_file_fields", bad_file_fields, 2},
        {"bad_file_vocab_size", bad_file_vocab_size, 2},
        {"bad_file_no_space_piece", bad_file_no_space_piece, 2},
        {"model_file_as_tokenizer", model_file_as_tokenizer, 2},
        {"merge_score_threshold", merge_score_threshold, 2},
        {"duplicate_piece_lower_id", duplicate_piece_lower_id, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        if (cases[i].fixture == 1) tcase_add_checked_fixture(tc, open_tok, close_tok);
        if (cases[i].fixture == 2)
            tcase_add_checked_fixture(tc, bad_files_setup, bad_files_teardown);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(tokenizer_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
