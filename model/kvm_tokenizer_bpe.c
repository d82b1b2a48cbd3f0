/* kvm_tokenizer_bpe.c: the vocabularies embedded in GGUF files, encoded step for step as
 * llama.cpp's llama-vocab.cpp does: byte-level BPE ("gpt2": tokenizer_st_partition,
 * llm_tokenizer_bpe_session, unicode.cpp's unicode_regex_split and bytes_to_unicode, with PCRE2
 * standing in for llama.cpp's hand-written regex splitters: the same patterns, matched per
 * fragment, unmatched text kept as its own fragment) and SentencePiece BPE ("llama":
 * llm_tokenizer_spm_session: ' ' escaped as U+2581, merges by score, byte fallback). */
#include "model/kvm_tokenizer_bpe_int.h"
#include "common/kvm_error.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* A pre-tokenizer: the regexes llama.cpp applies, in order, for a tokenizer.ggml.pre name. */
struct pre_def {
    const char *names;                    /* '|'-separated tokenizer.ggml.pre values */
    const char *regex[KVM_BPE_MAX_REGEX]; /* NULL-terminated */
};

#define KVM_GPT2_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
static const struct pre_def pre_defs[] = {
    /* llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_{STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA} */
    {"smollm|starcoder|refact|command-r|codeshell|exaone|minerva-7b", {"\\p{N}", KVM_GPT2_RE, NULL}},
    /* LLAMA_VOCAB_PRE_TYPE_{GPT2, MPT, OLMO, JAIS} */
    {"gpt-2|phi-2|jina-es|jina-de|gigachat|jina-v2-es|jina-v2-de|mpt|olmo|jais", {KVM_GPT2_RE, NULL}},
    /* LLAMA_VOCAB_PRE_TYPE_LLAMA3 */
    {"llama3|llama-v3|llama-bpe|falcon3|falcon-h1|pixtral|midm-2.0|lfm2",
     {"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
      NULL}},
    /* LLAMA_VOCAB_PRE_TYPE_QWEN2 */
    {"qwen2|deepseek-r1-qwen|hunyuan",
     {"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
      "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
      NULL}},
};


/* ---- hashing ---- */

static uint64_t fnv(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}
#define KVM_FNV0 14695981039346656037ull

int32_t kvm__bpe_find(const kvm_bpe *b, const char *s, size_t n)
{
    for (uint64_t slot = fnv(KVM_FNV0, s, n) & b->tok_mask;; slot = (slot + 1) & b->tok_mask) {
        int32_t id = b->tok_hash[slot];
        if (id < 0) return -1;
        if ((size_t)b->text_len[id] == n && memcmp(b->text + b->text_off[id], s, n) == 0) return id;
    }
}

static uint64_t merge_key(const char *a, size_t la, const char *c, size_t lc)
{
    return fnv(fnv(fnv(KVM_FNV0, a, la), " ", 1), c, lc);
}

static int32_t merge_rank(const kvm_bpe *b, const char *a, size_t la, const char *c, size_t lc)
{
    for (uint64_t slot = merge_key(a, la, c, lc) & b->merge_mask;; slot = (slot + 1) & b->merge_mask) {
        int32_t r = b->merge_hash[slot];
        if (r < 0) return -1;
        const char *m = b->merge_text + b->merge_off[r];
        if ((size_t)b->merge_first_len[r] == la && (size_t)(b->merge_len[r] - la - 1) == lc && memcmp(m, a, la) == 0 &&
            memcmp(m + la + 1, c, lc) == 0)
            return r;
    }
}

static uint64_t slots_for(int64_t n)
{
    uint64_t s = 16;
    while (s < 2 * (uint64_t)n)
        s *= 2;
    return s;
}

/* ---- GPT-2 bytes_to_unicode ---- */

static void put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        o[1] = 0;
    } else {
        o[0] = (char)(0xC0 | cp >> 6);
        o[1] = (char)(0x80 | (cp & 0x3F));
        o[2] = 0;
    }
}

void kvm__bpe_byte_map_init(kvm_bpe *b)
{
    unsigned next = 256;
    for (int i = 0; i < 324; i++)
        b->cp_byte[i] = -1;
    for (unsigned c = 0; c < 256; c++) {
        int printable = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255);
        unsigned cp = printable ? c : next++;
        put_utf8(b->byte_cp[c], cp);
        b->cp_byte[cp] = (int16_t)c;
    }
}

/* Decodes one UTF-8 sequence at s[0, n): its code point and length (invalid: the byte, 1). */
static unsigned utf8_next(const unsigned char *s, size_t n, size_t *len)
{
    unsigned c = s[0];
    size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (need == 0 || need > n) {
        *len = 1;
        return c;
    }
    unsigned cp = need == 1 ? c : need == 2 ? c & 0x1F : need == 3 ? c & 0x0F : c & 0x07;
    for (size_t i = 1; i < need; i++) {
        if ((s[i] & 0xC0) != 0x80) {
            *len = 1;
            return c;
        }
        cp = cp << 6 | (s[i] & 0x3F);
    }
    *len = need;
    return cp;
}

/* llama.cpp's unicode_utf8_to_byte per code point; unmapped code points keep their bytes. */
static size_t decode_token_text(const kvm_bpe *b, const char *s, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t l;
        unsigned cp = utf8_next((const unsigned char *)s + i, n - i, &l);
        if (cp < 324 && b->cp_byte[cp] >= 0 && l == (cp < 0x80 ? 1u : 2u))
            out[o++] = (char)b->cp_byte[cp];
        else {
            memcpy(out + o, s + i, l);
            o += l;
        }
        i += l;
    }
    return o;
}

/* SentencePiece's U+2581 (e2 96 81) back to ' ' (llama_unescape_whitespace). */
static size_t unescape_spaces(const char *s, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (i + 3 <= n && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
            out[o++] = ' ';
            i += 3;
        } else {
            out[o++] = s[i++];
        }
    }
    return o;
}

/* ---- construction ---- */

static int read_strings(const kvm_gguf *g, const char *key, uint64_t n, const uint8_t *p, char **blob, int64_t **off,
                        int32_t **len)
{
    /* the parser validated every string length against the file: sum them, then copy */
    uint64_t total = 0;
    const uint8_t *q = p;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t l = 0;
        for (int k = 7; k >= 0; k--)
            l = l << 8 | q[k];
        if (l > INT32_MAX)
            return kvm_err(KVM_EFORMAT, "%s: %s[%llu]: string of %llu bytes", kvm_gguf_name(g), key,
                           (unsigned long long)i, (unsigned long long)l);
        total += l + 1;
        q += 8 + l;
    }
    *blob = malloc(total ? total : 1);
    *off = malloc((n ? n : 1) * sizeof **off);
    *len = malloc((n ? n : 1) * sizeof **len);
    if (!*blob || !*off || !*len) return kvm_err(KVM_ENOMEM, "%s: out of memory for %s", kvm_gguf_name(g), key);
    int64_t at = 0;
    q = p;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t l = 0;
        for (int k = 7; k >= 0; k--)
            l = l << 8 | q[k];
        memcpy(*blob + at, q + 8, l);
        (*blob)[at + (int64_t)l] = 0;
        (*off)[i] = at;
        (*len)[i] = (int32_t)l;
        at += (int64_t)l + 1;
        q += 8 + l;
    }
    return 0;
}

static int cmp_i64(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, c = *(const int64_t *)y;
    return (a > c) - (a < c);
}

/* The tokens tokenizer_st_partition looks for, longest text first (ties: lower id first). */
static int build_specials(kvm_bpe *b)
{
    int32_t n = 0;
    for (int32_t i = 0; i < b->n_vocab; i++)
        if ((b->type[i] == KVM_TOKEN_CONTROL || b->type[i] == KVM_TOKEN_USER_DEFINED ||
             b->type[i] == KVM_TOKEN_UNKNOWN) &&
            b->text_len[i] > 0)
            n++;
    int64_t *key = malloc((size_t)(n ? n : 1) * sizeof *key);
    b->special = malloc((size_t)(n ? n : 1) * sizeof *b->special);
    if (!key || !b->special) {
        free(key);
        return kvm_err(KVM_ENOMEM, "tokenizer: out of memory");
    }
    for (int32_t i = 0; i < b->n_vocab; i++)
        if ((b->type[i] == KVM_TOKEN_CONTROL || b->type[i] == KVM_TOKEN_USER_DEFINED ||
             b->type[i] == KVM_TOKEN_UNKNOWN) &&
            b->text_len[i] > 0)
            key[b->n_special++] = (int64_t)(INT32_MAX - b->text_len[i]) << 32 | i;
    qsort(key, (size_t)n, sizeof *key, cmp_i64);
    for (int32_t i = 0; i < n; i++)
        b->special[i] = (int32_t)(key[i] & 0xffffffff);
    free(key);
    return 0;
}

/* Compiles the pre-tokenizer regexes re[0, n) into b->re (PCRE2, UTF with Unicode properties). */
int kvm__bpe_compile(kvm_bpe *b, const char *name, const char *const *re, int n)
{
    if (n > KVM_BPE_MAX_REGEX)
        return kvm_err(KVM_ENOTSUP, "%s: %d pre-tokenizer splits (at most %d)", name, n, KVM_BPE_MAX_REGEX);
    for (int i = 0; i < n; i++) {
        int err;
        PCRE2_SIZE at;
        b->re[i] = pcre2_compile((PCRE2_SPTR)re[i], PCRE2_ZERO_TERMINATED,
                                 PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &at, NULL);
        if (!b->re[i]) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(err, msg, sizeof msg);
            return kvm_err(KVM_EINVAL, "%s: PCRE2 rejects the pre-tokenizer regex '%.80s' at %zu: %s", name, re[i],
                           (size_t)at, (const char *)msg);
        }
    }
    return 0;
}

static int compile_pre(kvm_bpe *b, const kvm_gguf *g)
{
    kvm_gguf_str pre = {"default", 7};
    int rc = kvm_gguf_get_str(g, "tokenizer.ggml.pre", &pre);
    if (rc && rc != KVM_ENOTFOUND) return rc; /* not a string: was told "'default' is not supported" */
    const struct pre_def *d = NULL;
    for (size_t i = 0; !d && i < sizeof pre_defs / sizeof pre_defs[0]; i++) {
        const char *s = pre_defs[i].names;
        while (*s) {
            size_t l = strcspn(s, "|");
            if (l == pre.len && memcmp(s, pre.ptr, l) == 0) {
                d = &pre_defs[i];
                break;
            }
            s += l + (s[l] == '|');
        }
    }
    if (!d)
        return kvm_err(KVM_ENOTSUP,
                       "%s: tokenizer.ggml.pre '%.*s' is not supported (known: smollm, starcoder, gpt-2, "
                       "llama-bpe, qwen2 and their aliases)",
                       kvm_gguf_name(g), (int)(pre.len > 64 ? 64 : pre.len), pre.ptr);
    int n = 0;
    while (n < KVM_BPE_MAX_REGEX && d->regex[n])
        n++;
    return kvm__bpe_compile(b, kvm_gguf_name(g), d->regex, n);
}

/* Builds the lookup structures of a filled vocabulary (texts, types, merges with their split,
 * scores): the token hash, the merge hash, the decoded pieces and the special-token list. */
int kvm__bpe_finish(kvm_bpe *b, const char *f)
{
    int rc = 0;
    /* token hash: later ids overwrite earlier ones, as llama.cpp's token_to_id[text] = id */
    b->tok_mask = slots_for(b->n_vocab) - 1;
    b->tok_hash = malloc((b->tok_mask + 1) * sizeof *b->tok_hash);
    if (!b->tok_hash) goto nomem;
    memset(b->tok_hash, 0xff, (b->tok_mask + 1) * sizeof *b->tok_hash);
    for (int32_t id = 0; id < b->n_vocab; id++) {
        const char *s = b->text + b->text_off[id];
        uint64_t slot = fnv(KVM_FNV0, s, (size_t)b->text_len[id]) & b->tok_mask;
        for (;; slot = (slot + 1) & b->tok_mask) {
            int32_t o = b->tok_hash[slot];
            if (o < 0 || (b->text_len[o] == b->text_len[id] &&
                          memcmp(b->text + b->text_off[o], s, (size_t)b->text_len[id]) == 0))
                break;
        }
        b->tok_hash[slot] = id;
    }
    /* merges "left right" (split at merge_first_len); the first rank wins */
    b->merge_mask = slots_for(b->n_merges) - 1;
    b->merge_hash = malloc((b->merge_mask + 1) * sizeof *b->merge_hash);
    if (!b->merge_hash) goto nomem;
    memset(b->merge_hash, 0xff, (b->merge_mask + 1) * sizeof *b->merge_hash);
    for (int32_t r = 0; r < b->n_merges; r++) {
        const char *m = b->merge_text + b->merge_off[r];
        int32_t fl = b->merge_first_len[r];
        const char *sp = m + fl;
        if (merge_rank(b, m, (size_t)fl, sp + 1, (size_t)(b->merge_len[r] - fl - 1)) >= 0) continue;
        uint64_t slot = merge_key(m, (size_t)fl, sp + 1, (size_t)(b->merge_len[r] - fl - 1)) & b->merge_mask;
        while (b->merge_hash[slot] >= 0)
            slot = (slot + 1) & b->merge_mask;
        b->merge_hash[slot] = r;
    }
    /* decoded pieces: at most as many bytes as the raw text */
    int64_t total = 0;
    for (int32_t i = 0; i < b->n_vocab; i++)
        total += b->text_len[i] + 1;
    b->piece = malloc((size_t)total);
    b->piece_off = malloc((size_t)b->n_vocab * sizeof *b->piece_off);
    b->piece_len = malloc((size_t)b->n_vocab * sizeof *b->piece_len);
    if (!b->piece || !b->piece_off || !b->piece_len) goto nomem;
    int64_t at = 0;
    for (int32_t i = 0; i < b->n_vocab; i++) {
        const char *s = b->text + b->text_off[i];
        size_t l;
        /* token_to_piece(special = false): CONTROL, UNKNOWN and UNUSED tokens print nothing */
        int ty = b->type[i];
        unsigned hex;
        if (ty == KVM_TOKEN_CONTROL || ty == KVM_TOKEN_UNKNOWN || ty == KVM_TOKEN_UNUSED)
            l = 0;
        else if (ty == KVM_TOKEN_USER_DEFINED)
            memcpy(b->piece + at, s, l = (size_t)b->text_len[i]);
        else if (b->spm && ty == KVM_TOKEN_BYTE) {
            l = 0;
            /* two hex digits, checked first: %2x takes a sign ("<0x-5>" read as 0xfffffffb, an
             * index far past byte_tok; found by fuzz_file_tokenizer_json) */
            if (b->text_len[i] == 6 && isxdigit((unsigned char)s[3]) && isxdigit((unsigned char)s[4]) &&
                sscanf(s, "<0x%2x>", &hex) == 1 && hex < 256) {
                b->piece[at] = (char)hex;
                l = 1;
                if (b->byte_tok[hex] < 0) b->byte_tok[hex] = i;
            }
        } else if (b->spm)
            l = unescape_spaces(s, (size_t)b->text_len[i], b->piece + at);
        else
            l = decode_token_text(b, s, (size_t)b->text_len[i], b->piece + at);
        b->piece[at + (int64_t)l] = 0;
        b->piece_off[i] = at;
        b->piece_len[i] = (int32_t)l;
        at += (int64_t)l + 1;
    }
    if ((rc = build_specials(b))) return rc;
    return 0;
nomem:
    return kvm_err(KVM_ENOMEM, "%s: out of memory building the BPE vocabulary", f);
}

int kvm__bpe_new(const kvm_gguf *g, kvm_bpe **out)
{
    *out = NULL;
    const char *f = kvm_gguf_name(g);
    kvm_bpe *b = calloc(1, sizeof *b);
    if (!b) return kvm_err(KVM_ENOMEM, "%s: out of memory", f);
    kvm__bpe_byte_map_init(b);
    for (int i = 0; i < 256; i++)
        b->byte_tok[i] = -1;
    uint64_t n_tok, n_types, n_merges = 0, n_scores;
    const uint8_t *p_tok, *p_types, *p_merges = NULL, *p_scores;
    kvm_gguf_str model = {"gpt2", 4};
    int rc;
    kvm_gguf_get_str(g, "tokenizer.ggml.model", &model);
    b->spm = model.len == 5 && memcmp(model.ptr, "llama", 5) == 0;
    if ((rc = kvm_gguf_get_arr(g, "tokenizer.ggml.tokens", KVM_GGUF_STRING, &n_tok, &p_tok)) ||
        (!b->spm && (rc = kvm_gguf_get_arr(g, "tokenizer.ggml.merges", KVM_GGUF_STRING, &n_merges, &p_merges))) ||
        (b->spm && (rc = kvm_gguf_get_arr(g, "tokenizer.ggml.scores", KVM_GGUF_F32, &n_scores, &p_scores)))) {
        if (rc == KVM_ENOTFOUND)
            rc = kvm_err(KVM_EFORMAT, "%s: tokenizer.ggml.tokens or tokenizer.ggml.%s is missing", f,
                         b->spm ? "scores" : "merges");
        goto fail;
    }
    if (b->spm && n_scores != n_tok) {
        rc = kvm_err(KVM_EFORMAT, "%s: tokenizer.ggml.scores has %llu entries, tokens %llu", f,
                     (unsigned long long)n_scores, (unsigned long long)n_tok);
        goto fail;
    }
    if (n_tok < 1 || n_tok > (1u << 24) || n_merges > (1u << 24)) {
        rc = kvm_err(KVM_EFORMAT, "%s: %llu tokens and %llu merges (limits 1..2^24)", f, (unsigned long long)n_tok,
                     (unsigned long long)n_merges);
        goto fail;
    }
    b->n_vocab = (int32_t)n_tok;
    b->n_merges = (int32_t)n_merges;
    if ((rc = read_strings(g, "tokenizer.ggml.tokens", n_tok, p_tok, &b->text, &b->text_off, &b->text_len)) ||
        (rc = read_strings(g, "tokenizer.ggml.merges", n_merges, p_merges, &b->merge_text, &b->merge_off,
                           &b->merge_len)))
        goto fail;
    b->type = malloc(n_tok);
    b->merge_first_len = malloc((n_merges ? n_merges : 1) * sizeof *b->merge_first_len);
    if (!b->type || !b->merge_first_len) goto nomem;
    if (b->spm) {
        if (!(b->score = malloc(n_tok * sizeof *b->score))) goto nomem;
        memcpy(b->score, p_scores, n_tok * sizeof *b->score); /* little-endian F32, as the file */
        b->add_space_prefix = 1;                              /* llama.cpp's default for SentencePiece vocabularies */
        if ((rc = kvm_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &b->add_space_prefix)) && rc != KVM_ENOTFOUND)
            goto fail;
    }
    /* absent: no unknown token; of another type or outside the vocabulary it is refused, as
     * bos/eos ids are (it was taken as absent without a word) */
    int64_t unk = -1;
    if ((rc = kvm_gguf_get_i64(g, "tokenizer.ggml.unknown_token_id", &unk)) && rc != KVM_ENOTFOUND) goto fail;
    if (unk < -1 || unk >= (int64_t)n_tok) {
        rc = kvm_err(KVM_EFORMAT, "%s: tokenizer.ggml.unknown_token_id %lld outside the vocabulary [0, %llu)", f,
                     (long long)unk, (unsigned long long)n_tok);
        goto fail;
    }
    b->unk_id = (int32_t)unk;
    rc = kvm_gguf_get_arr(g, "tokenizer.ggml.token_type", KVM_GGUF_I32, &n_types, &p_types);
    if (rc == KVM_ENOTFOUND) {
        memset(b->type, KVM_TOKEN_NORMAL, n_tok);
    } else if (rc) {
        goto fail;
    } else {
        if (n_types != n_tok) {
            rc = kvm_err(KVM_EFORMAT, "%s: tokenizer.ggml.token_type has %llu entries, tokens %llu", f,
                         (unsigned long long)n_types, (unsigned long long)n_tok);
            goto fail;
        }
        for (uint64_t i = 0; i < n_tok; i++) {
            int32_t t = (int32_t)((uint32_t)p_types[4 * i] | (uint32_t)p_types[4 * i + 1] << 8 |
                                  (uint32_t)p_types[4 * i + 2] << 16 | (uint32_t)p_types[4 * i + 3] << 24);
            if (t < KVM_TOKEN_NORMAL || t > KVM_TOKEN_BYTE) {
                rc = kvm_err(KVM_EFORMAT, "%s: tokenizer.ggml.token_type[%llu] = %d, not 1..6", f,
                             (unsigned long long)i, t);
                goto fail;
            }
            b->type[i] = (uint8_t)t;
        }
    }
    /* merges "left right", split at the first space after the first byte */
    for (int32_t r = 0; r < b->n_merges; r++) {
        const char *m = b->merge_text + b->merge_off[r];
        const char *sp = b->merge_len[r] > 1 ? memchr(m + 1, ' ', (size_t)b->merge_len[r] - 1) : NULL;
        if (!sp) {
            rc = kvm_err(KVM_EFORMAT, "%s: tokenizer.ggml.merges[%d] '%.*s' has no space between its two parts", f, r,
                         b->merge_len[r] > 64 ? 64 : b->merge_len[r], m);
            goto fail;
        }
        b->merge_first_len[r] = (int32_t)(sp - m);
    }
    if ((rc = kvm__bpe_finish(b, f)) || (!b->spm && (rc = compile_pre(b, g)))) goto fail;
    *out = b;
    return 0;
nomem:
    rc = kvm_err(KVM_ENOMEM, "%s: out of memory building the BPE vocabulary", f);
fail:
    kvm__bpe_free(&b);
    return rc;
}

void kvm__bpe_free(kvm_bpe **pb)
{
    if (!pb || !*pb) return;
    kvm_bpe *b = *pb;
    free(b->text);
    free(b->text_off);
    free(b->text_len);
    free(b->type);
    free(b->piece);
    free(b->piece_off);
    free(b->piece_len);
    free(b->tok_hash);
    free(b->merge_text);
    free(b->merge_off);
    free(b->merge_first_len);
    free(b->merge_len);
    free(b->merge_hash);
    free(b->special);
    free(b->score);
    for (int i = 0; i < KVM_BPE_MAX_REGEX; i++)
        pcre2_code_free(b->re[i]);
    for (int i = 0; i < KVM_BPE_MAX_NORM; i++) {
        free(b->norm[i].a);
        free(b->norm[i].b);
    }
    free(b);
    *pb = NULL;
}

int32_t kvm__bpe_vocab_size(const kvm_bpe *b) { return b->n_vocab; }

const char *kvm__bpe_piece(const kvm_bpe *b, int32_t id, size_t *len)
{
    if (len) *len = 0;
    if (id < 0 || id >= b->n_vocab) return NULL;
    if (len) *len = (size_t)b->piece_len[id];
    return b->piece + b->piece_off[id];
}

/* ---- encoding ---- */


int kvm__bpe_frag_push(frag_list *l, frag f)
{
    if (l->n == l->cap) {
        int64_t cap = l->cap ? 2 * l->cap : 16;
        frag *v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) return kvm_err(KVM_ENOMEM, "tokenizer encode: out of memory");
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = f;
    return 0;
}

/* First occurrence of needle[0, nl) in hay[0, hl), or NULL (memmem is a GNU extension). */
static const char *find_bytes(const char *hay, size_t hl, const char *needle, size_t nl)
{
    if (nl == 0 || nl > hl) return NULL;
    for (const char *p = hay, *end = hay + (hl - nl);;) {
        p = memchr(p, needle[0], (size_t)(end - p) + 1);
        if (!p) return NULL;
        if (memcmp(p, needle, nl) == 0) return p;
        if (p++ == end) return NULL;
    }
}

/* Splits raw fragments at every occurrence of each special token, longest tokens first
 * (tokenizer_st_partition with parse_special = true; no lstrip/rstrip attributes in GGUF). */
int kvm__bpe_partition(const kvm_bpe *b, const char *text, size_t len, frag_list *out)
{
    frag_list cur = {0}, next = {0};
    int rc = len ? kvm__bpe_frag_push(&cur, (frag){0, (int64_t)len, -1}) : 0;
    for (int32_t s = 0; !rc && s < b->n_special; s++) {
        int32_t id = b->special[s];
        const char *st = b->text + b->text_off[id];
        size_t sl = (size_t)b->text_len[id];
        next.n = 0;
        for (int64_t i = 0; !rc && i < cur.n; i++) {
            frag f = cur.v[i];
            if (f.token >= 0 || (size_t)f.len < sl) {
                rc = kvm__bpe_frag_push(&next, f);
                continue;
            }
            int64_t pos = f.off, end = f.off + f.len;
            for (;;) {
                const char *m = find_bytes(text + pos, (size_t)(end - pos), st, sl);
                if (!m) break;
                int64_t at = m - text;
                if (at > pos && (rc = kvm__bpe_frag_push(&next, (frag){pos, at - pos, -1}))) break;
                if ((rc = kvm__bpe_frag_push(&next, (frag){at, (int64_t)sl, id}))) break;
                pos = at + (int64_t)sl;
            }
            if (!rc && pos < end) rc = kvm__bpe_frag_push(&next, (frag){pos, end - pos, -1});
        }
        frag_list t = cur;
        cur = next;
        next = t;
    }
    free(next.v);
    if (rc) {
        free(cur.v);
        return rc;
    }
    *out = cur;
    return 0;
}

/* Applies regex re to every raw fragment of in, writing the pieces (matches and the text
 * between them) to out; the match sees only its fragment, as llama.cpp's splitter does. */
int kvm__bpe_regex_split(const pcre2_code *re, const char *text, const frag_list *in, frag_list *out,
                       pcre2_match_data *md)
{
    int rc = 0;
    out->n = 0;
    for (int64_t i = 0; !rc && i < in->n; i++) {
        frag f = in->v[i];
        if (f.token >= 0) {
            rc = kvm__bpe_frag_push(out, f);
            continue;
        }
        PCRE2_SPTR subj = (PCRE2_SPTR)(text + f.off);
        PCRE2_SIZE pos = 0, n = (PCRE2_SIZE)f.len, last = 0;
        while (!rc && pos < n) {
            int m = pcre2_match(re, subj, n, pos, 0, md, NULL);
            if (m == PCRE2_ERROR_NOMATCH) break;
            if (m < 0) { /* said only "PCRE2 match error -47": name the regex's failure and where */
                PCRE2_UCHAR msg[256];
                pcre2_get_error_message(m, msg, sizeof msg);
                return kvm_err(
                    KVM_EFORMAT,
                    "tokenizer encode: the tokenizer's pre-tokenizer regex failed at byte %lld of the text it splits: "
                    "%s (PCRE2 error %d%s)",
                    (long long)(f.off + (int64_t)pos), (const char *)msg, m,
                    m == PCRE2_ERROR_MATCHLIMIT || m == PCRE2_ERROR_DEPTHLIMIT
                        ? ": a regex that backtracks without bound?"
                        : "");
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            if (ov[0] > last) rc = kvm__bpe_frag_push(out, (frag){f.off + (int64_t)last, (int64_t)(ov[0] - last), -1});
            if (!rc && ov[1] > ov[0]) rc = kvm__bpe_frag_push(out, (frag){f.off + (int64_t)ov[0], (int64_t)(ov[1] - ov[0]), -1});
            last = ov[1];
            pos = ov[1] > ov[0] ? ov[1] : ov[1] + 1; /* an empty match must not loop */
            while (pos < n && (subj[pos] & 0xC0) == 0x80)
                pos++;
        }
        if (!rc && last < n) rc = kvm__bpe_frag_push(out, (frag){f.off + (int64_t)last, (int64_t)(n - last), -1});
    }
    return rc;
}


/* llm_bigram_bpe::comparator: lowest rank first, then leftmost. */
static int bigram_before(const bigram *a, const bigram *c)
{
    return a->rank < c->rank || (a->rank == c->rank && a->left < c->left);
}


/* Binary heap over s->heap ordered by `before` (BPE: lowest merge rank first; SentencePiece:
 * highest score first; both then leftmost). */
typedef int (*bigram_order)(const bigram *a, const bigram *c);

static void heap_push(bpe_scratch *s, bigram g, bigram_order before)
{
    int64_t i = s->heap_n++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!before(&g, &s->heap[p])) break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = g;
}

static bigram heap_pop(bpe_scratch *s, bigram_order before)
{
    bigram top = s->heap[0], last = s->heap[--s->heap_n];
    int64_t i = 0, n = s->heap_n;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n > 0) s->heap[i] = last;
    return top;
}

static void add_bigram(const kvm_bpe *b, bpe_scratch *s, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return;
    const sym *l = &s->syms[left], *r = &s->syms[right];
    int32_t rank = merge_rank(b, s->word + l->off, (size_t)l->n, s->word + r->off, (size_t)r->n);
    if (rank < 0) return;
    heap_push(s, (bigram){rank, left, right, l->n, r->n}, bigram_before);
}

/* SentencePiece candidates live in the same heap array, ordered by llm_bigram_spm::comparator:
 * highest score first, then leftmost. The score is kept bit-for-bit in `rank`'s place. */
static float cand_score(const bigram *g)
{
    float f;
    memcpy(&f, &g->rank, sizeof f);
    return f;
}

static int spm_before(const bigram *a, const bigram *c)
{
    float x = cand_score(a), y = cand_score(c);
    return x > y || (x == y && a->left < c->left);
}

/* try_add_bigram: the pair is a candidate when its concatenation is a token; `ln` holds the
 * concatenation's length (llama.cpp's bigram.size) for the staleness test. */
static void spm_add_bigram(const kvm_bpe *b, bpe_scratch *s, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return;
    const sym *l = &s->syms[left], *r = &s->syms[right];
    int32_t id = kvm__bpe_find(b, s->word + l->off, (size_t)(l->n + r->n));
    if (id < 0) return;
    bigram g = {0, left, right, l->n + r->n, 0};
    memcpy(&g.rank, &b->score[id], sizeof g.rank);
    heap_push(s, g, spm_before);
}

int kvm__bpe_grow(void **p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) return kvm_err(KVM_ENOMEM, "tokenizer encode: out of memory");
    *p = q;
    *cap = c;
    return 0;
}

/* Appends the ids of the merged symbols (the list from symbol 0 via next) to out. A symbol that
 * is not a token falls back byte by byte: byte-level BPE looks each (mapped) byte up and drops
 * absent ones; SentencePiece uses its <0xNN> byte tokens, else <unk>. */
static void emit_symbols(const kvm_bpe *b, const bpe_scratch *s, int32_t ns, int spm, int32_t *out, int64_t *n)
{
    for (int32_t i = 0; i >= 0 && i < ns; i = s->syms[i].next) {
        const sym *y = &s->syms[i];
        if (y->n == 0) continue;
        int32_t id = kvm__bpe_find(b, s->word + y->off, (size_t)y->n);
        if (id >= 0) {
            out[(*n)++] = id;
            continue;
        }
        for (int32_t k = 0; k < y->n; k++) {
            int32_t bid = spm ? b->byte_tok[(uint8_t)s->word[y->off + k]] : kvm__bpe_find(b, s->word + y->off + k, 1);
            if (spm && bid < 0) bid = b->unk_id;
            if (bid >= 0) out[(*n)++] = bid;
        }
    }
}

static const uint8_t utf8_len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4}; /* unicode_len_utf8 */

/* BPE of one pre-tokenized word (raw bytes): map bytes (or, with chars, take UTF-8 characters
 * as they are), merge by rank, then look each symbol up (bytes of unknown symbols one by one:
 * dropped if absent, or with chars as <0xXX> byte tokens, else the unknown token). With
 * b->ignore_merges a word that is itself a token is emitted whole. */
int kvm__bpe_word(const kvm_bpe *b, bpe_scratch *s, const char *w, int64_t wl, int chars, int32_t *out,
                    int64_t *n)
{
    int rc;
    if ((rc = kvm__bpe_grow((void **)&s->word, &s->cap_word, 2 * wl + 1, 1)) ||
        (rc = kvm__bpe_grow((void **)&s->syms, &s->cap_syms, wl, sizeof *s->syms)) ||
        (rc = kvm__bpe_grow((void **)&s->heap, &s->cap_heap, 3 * wl + 1, sizeof *s->heap)))
        return rc;
    int32_t ml = 0, ns = 0;
    if (chars) {
        memcpy(s->word, w, (size_t)wl);
        ml = (int32_t)wl;
        for (int32_t off = 0; off < ml; ns++) {
            int32_t l = utf8_len[(uint8_t)s->word[off] >> 4];
            if (l > ml - off) l = ml - off;
            s->syms[ns] = (sym){off, l, ns - 1, off + l < ml ? ns + 1 : -1};
            off += l;
        }
    } else {
        for (int64_t i = 0; i < wl; i++) {
            const char *cp = b->byte_cp[(unsigned char)w[i]];
            size_t l = strlen(cp);
            s->syms[ns] = (sym){ml, (int32_t)l, ns - 1, i + 1 < wl ? ns + 1 : -1};
            memcpy(s->word + ml, cp, l);
            ml += (int32_t)l;
            ns++;
        }
    }
    int32_t whole = b->ignore_merges ? kvm__bpe_find(b, s->word, (size_t)ml) : -1;
    if (whole >= 0) {
        out[(*n)++] = whole;
        return 0;
    }
    s->heap_n = 0;
    for (int32_t i = 1; i < ns; i++)
        add_bigram(b, s, i - 1, i);
    while (s->heap_n > 0) {
        bigram g = heap_pop(s, bigram_before);
        sym *l = &s->syms[g.left], *r = &s->syms[g.right];
        if (l->n == 0 || r->n == 0 || l->n != g.ln || r->n != g.rn || l->next != g.right) continue; /* outdated */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) s->syms[r->next].prev = g.left;
        add_bigram(b, s, l->prev, g.left);
        add_bigram(b, s, g.left, l->next);
    }
    emit_symbols(b, s, ns, chars, out, n);
    return 0;
}

/* SentencePiece BPE of one raw fragment (llm_tokenizer_spm_session::tokenize): optional ' '
 * prefix, ' ' -> U+2581, UTF-8 characters as symbols, merge the adjacent pair whose
 * concatenation is the highest-scoring token (leftmost on ties), then each symbol's token or,
 * for a character outside the vocabulary, its bytes' <0xXX> tokens (else the unknown token). */
static int spm_fragment(const kvm_bpe *b, bpe_scratch *s, const char *w, int64_t wl, int prefix, int32_t *out,
                        int64_t *n)
{
    int rc;
    int64_t cap = 3 * (wl + 1);
    if ((rc = kvm__bpe_grow((void **)&s->word, &s->cap_word, cap, 1)) ||
        (rc = kvm__bpe_grow((void **)&s->syms, &s->cap_syms, cap, sizeof *s->syms)) ||
        (rc = kvm__bpe_grow((void **)&s->heap, &s->cap_heap, 3 * cap + 1, sizeof *s->heap)))
        return rc;
    int32_t ml = 0, ns = 0;
    if (prefix) {
        memcpy(s->word, "\xe2\x96\x81", 3);
        ml = 3;
    }
    for (int64_t i = 0; i < wl; i++) {
        if (w[i] == ' ') {
            memcpy(s->word + ml, "\xe2\x96\x81", 3);
            ml += 3;
        } else {
            s->word[ml++] = w[i];
        }
    }
    for (int32_t off = 0; off < ml; ns++) {
        int32_t l = utf8_len[(uint8_t)s->word[off] >> 4];
        if (l > ml - off) l = ml - off;
        s->syms[ns] = (sym){off, l, ns - 1, off + l < ml ? ns + 1 : -1};
        off += l;
    }
    s->heap_n = 0;
    for (int32_t i = 1; i < ns; i++)
        spm_add_bigram(b, s, i - 1, i);
    while (s->heap_n > 0) {
        bigram g = heap_pop(s, spm_before);
        sym *l = &s->syms[g.left], *r = &s->syms[g.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != g.ln || l->next != g.right) continue; /* outdated */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) s->syms[r->next].prev = g.left;
        spm_add_bigram(b, s, l->prev, g.left);
        spm_add_bigram(b, s, g.left, l->next);
    }
    emit_symbols(b, s, ns, 1, out, n);
    return 0;
}

int kvm__bpe_encode(const kvm_bpe *b, const char *text, size_t len, int32_t *out, int64_t *n)
{
    *n = 0;
    if (b->hf) return kvm_err(KVM_EINVAL, "tokenizer encode: a tokenizer.json vocabulary encodes with kvm__bpe_encode_new");
    frag_list a = {0}, c = {0};
    bpe_scratch s = {0};
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    int rc = md ? kvm__bpe_partition(b, text, len, &a) : kvm_err(KVM_ENOMEM, "tokenizer encode: out of memory");
    for (int i = 0; !rc && i < KVM_BPE_MAX_REGEX && b->re[i]; i++) {
        if ((rc = kvm__bpe_regex_split(b->re[i], text, &a, &c, md))) break;
        frag_list t = a;
        a = c;
        c = t;
    }
    if (b->spm) {
        int prev_special = 1; /* the first fragment counts as following a special token */
        for (int64_t i = 0; !rc && i < a.n; i++) {
            if (a.v[i].token >= 0) {
                out[(*n)++] = a.v[i].token;
                prev_special = 1;
                continue;
            }
            rc = spm_fragment(b, &s, text + a.v[i].off, a.v[i].len, b->add_space_prefix && prev_special, out, n);
            prev_special = 0;
        }
    }
    for (int64_t i = 0; !b->spm && !rc && i < a.n; i++) {
        if (a.v[i].token >= 0)
            out[(*n)++] = a.v[i].token;
        else
            rc = kvm__bpe_word(b, &s, text + a.v[i].off, a.v[i].len, 0, out, n);
    }
    free(a.v);
    free(c.v);
    free(s.word);
    free(s.syms);
    free(s.heap);
    pcre2_match_data_free(md);
    return rc;
}
