/* kvm_tokenizer_json.c: Hugging Face tokenizer.json files (the `tokenizers` library's
 * serialisation) into the BPE engine's arrays: the vocabulary with added tokens, the merges by
 * rank, the normalizer and pre-tokenizer pipeline as steps and PCRE2 regexes. JSON via jansson. */
#include "model/kvm_tokenizer_json.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "model/kvm_json.h"

#include <jansson.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVM_TOKJSON_MAX_VOCAB (1 << 24)
/* tokenizers' ByteLevel(use_regex = true) pattern (pre_tokenizers/byte_level.rs) */
#define KVM_HF_GPT2_RE "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

typedef struct tj {
    const char *f;      /* the file, for messages */
    kvm_bpe_hf h;       /* being filled */
    const char **tok;   /* [n_vocab] text of each id, borrowed from the JSON, NULL for holes */
    size_t *tok_len;    /* [n_vocab] */
    int n_split, n_norm;
    int has_byte_level; /* a ByteLevel pre-tokenizer was seen */
} tj;

static const char *type_of(const json_t *o) { return json_string_value(json_object_get(o, "type")); }

/* ---- vocabulary ---- */

static int vocab_size(tj *t, const json_t *vocab, const json_t *added, int32_t min_vocab)
{
    json_int_t max = min_vocab - 1;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)vocab, k, v)
    {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= KVM_TOKJSON_MAX_VOCAB)
            return kvm_err(KVM_EFORMAT, "%s: model.vocab['%.64s'] is not an id in [0, 2^24)", t->f, k);
        if (json_integer_value(v) > max) max = json_integer_value(v);
    }
    size_t i;
    json_array_foreach(added, i, v)
    {
        const json_t *id = json_object_get(v, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= KVM_TOKJSON_MAX_VOCAB ||
            !json_is_string(json_object_get(v, "content")))
            return kvm_err(KVM_EFORMAT, "%s: added_tokens[%zu] needs an id in [0, 2^24) and a content string", t->f, i);
        if (json_integer_value(id) > max) max = json_integer_value(id);
    }
    if (max < 0) return kvm_err(KVM_EFORMAT, "%s: model.vocab is empty", t->f);
    t->h.n_vocab = (int32_t)max + 1;
    size_t n = (size_t)t->h.n_vocab;
    t->tok = calloc(n, sizeof *t->tok);
    t->tok_len = calloc(n, sizeof *t->tok_len);
    t->h.type = malloc(n);
    if (!t->tok || !t->tok_len || !t->h.type) return kvm_err(KVM_ENOMEM, "%s: out of memory", t->f);
    memset(t->h.type, KVM_TOKEN_UNUSED, n);
    return 0;
}

/* Sets id's text; a second, different text for one id is an error. */
static int set_token(tj *t, int32_t id, const char *z, size_t l, int type, const char *where)
{
    if (t->tok[id] && (t->tok_len[id] != l || memcmp(t->tok[id], z, l) != 0))
        return kvm_err(KVM_EFORMAT, "%s: %s: id %d is already the token '%.64s'", t->f, where, id, t->tok[id]);
    t->tok[id] = z;
    t->tok_len[id] = l;
    t->h.type[id] = (uint8_t)type;
    return 0;
}

static int read_added(tj *t, const json_t *added)
{
    size_t i;
    json_t *v;
    json_array_foreach(added, i, v)
    {
        const json_t *c = json_object_get(v, "content");
        const char *flags[] = {"single_word", "lstrip", "rstrip"};
        for (int k = 0; k < 3; k++)
            if (json_is_true(json_object_get(v, flags[k])))
                return kvm_err(KVM_ENOTSUP, "%s: added_tokens[%zu] '%.64s': %s = true is not supported", t->f, i,
                               json_string_value(c), flags[k]);
        char where[64];
        snprintf(where, sizeof where, "added_tokens[%zu]", i);
        int special = json_is_true(json_object_get(v, "special"));
        int rc = set_token(t, (int32_t)json_integer_value(json_object_get(v, "id")), json_string_value(c),
                           json_string_length(c), special ? KVM_TOKEN_CONTROL : KVM_TOKEN_USER_DEFINED, where);
        if (rc) return rc;
    }
    return 0;
}

/* The token texts into the engine's blob. */
static int pack_tokens(tj *t, int byte_fallback)
{
    size_t n = (size_t)t->h.n_vocab, total = 1;
    for (size_t i = 0; i < n; i++)
        total += t->tok_len[i] + 1;
    t->h.text = malloc(total);
    t->h.text_off = malloc(n * sizeof *t->h.text_off);
    t->h.text_len = malloc(n * sizeof *t->h.text_len);
    if (!t->h.text || !t->h.text_off || !t->h.text_len) return kvm_err(KVM_ENOMEM, "%s: out of memory", t->f);
    int64_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (t->tok_len[i]) memcpy(t->h.text + at, t->tok[i], t->tok_len[i]);
        t->h.text[at + (int64_t)t->tok_len[i]] = 0;
        t->h.text_off[i] = at;
        t->h.text_len[i] = (int32_t)t->tok_len[i];
        at += (int64_t)t->tok_len[i] + 1;
        unsigned hex;
        char tail;
        if (byte_fallback && t->h.type[i] == KVM_TOKEN_NORMAL && t->tok_len[i] == 6 &&
            sscanf(t->tok[i], "<0x%2X%c", &hex, &tail) == 2 && tail == '>')
            t->h.type[i] = KVM_TOKEN_BYTE;
    }
    return 0;
}

/* ---- merges ---- */

/* The id model.vocab gives s[0, n), or -1 (also when out of memory). */
static int32_t vocab_id(const json_t *vocab, const char *s, size_t n)
{
    char small[512], *buf = n < sizeof small ? small : malloc(n + 1);
    if (!buf) return -1;
    memcpy(buf, s, n);
    buf[n] = 0;
    const json_t *v = json_object_get(vocab, buf);
    if (buf != small) free(buf);
    return json_is_integer(v) ? (int32_t)json_integer_value(v) : -1;
}

/* merges[r] as its two parts: a "left right" string (one space) or a [left, right] pair. */
static int merge_parts(tj *t, const json_t *m, size_t r, const char **a, size_t *al, const char **b, size_t *bl)
{
    if (json_is_string(m)) {
        const char *s = json_string_value(m), *sp = strchr(s, ' ');
        if (!sp || strchr(sp + 1, ' '))
            return kvm_err(KVM_EFORMAT, "%s: model.merges[%zu] '%.64s' is not two tokens separated by one space", t->f, r, s);
        *a = s, *al = (size_t)(sp - s), *b = sp + 1, *bl = strlen(sp + 1);
        return 0;
    }
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1))) {
        *a = json_string_value(json_array_get(m, 0)), *al = json_string_length(json_array_get(m, 0));
        *b = json_string_value(json_array_get(m, 1)), *bl = json_string_length(json_array_get(m, 1));
        return 0;
    }
    return kvm_err(KVM_EFORMAT, "%s: model.merges[%zu] is neither a string nor a pair of strings", t->f, r);
}

static int read_merges(tj *t, const json_t *vocab, const json_t *merges)
{
    size_t n = json_array_size(merges), total = 1;
    const char *a, *b;
    size_t al, bl;
    int rc;
    for (size_t r = 0; r < n; r++) {
        if ((rc = merge_parts(t, json_array_get(merges, r), r, &a, &al, &b, &bl))) return rc;
        total += al + bl + 2;
    }
    t->h.n_merges = (int32_t)n;
    t->h.merge_text = malloc(total);
    t->h.merge_off = malloc((n + 1) * sizeof *t->h.merge_off);
    t->h.merge_first_len = malloc((n + 1) * sizeof *t->h.merge_first_len);
    t->h.merge_len = malloc((n + 1) * sizeof *t->h.merge_len);
    if (!t->h.merge_text || !t->h.merge_off || !t->h.merge_first_len || !t->h.merge_len)
        return kvm_err(KVM_ENOMEM, "%s: out of memory", t->f);
    int64_t at = 0;
    for (size_t r = 0; r < n; r++) {
        merge_parts(t, json_array_get(merges, r), r, &a, &al, &b, &bl);
        char *m = t->h.merge_text + at;
        memcpy(m, a, al);
        m[al] = ' ';
        memcpy(m + al + 1, b, bl);
        m[al + 1 + bl] = 0;
        if (vocab_id(vocab, a, al) < 0 || vocab_id(vocab, b, bl) < 0)
            return kvm_err(KVM_EFORMAT, "%s: model.merges[%zu] '%.64s': a part is not in model.vocab", t->f, r, m);
        memmove(m + al, m + al + 1, bl + 1); /* the merged token, for the lookup */
        int32_t id = vocab_id(vocab, m, al + bl);
        memmove(m + al + 1, m + al, bl + 1);
        m[al] = ' ';
        if (id < 0)
            return kvm_err(KVM_EFORMAT, "%s: model.merges[%zu] '%.64s': the merged token is not in model.vocab", t->f, r, m);
        t->h.merge_off[r] = at;
        t->h.merge_first_len[r] = (int32_t)al;
        t->h.merge_len[r] = (int32_t)(al + bl + 1);
        at += (int64_t)(al + bl + 2);
    }
    return 0;
}

/* ---- normalizer and pre-tokenizer ---- */

static int add_norm(tj *t, int kind, const char *a, const char *b)
{
    if (t->n_norm == KVM_BPE_MAX_NORM) return kvm_err(KVM_ENOTSUP, "%s: more than %d normalizer steps", t->f, KVM_BPE_MAX_NORM);
    kvm_bpe_norm *n = &t->h.norm[t->n_norm++];
    n->kind = kind;
    if ((a && !(n->a = strdup(a))) || (b && !(n->b = strdup(b)))) return kvm_err(KVM_ENOMEM, "%s: out of memory", t->f);
    return 0;
}

static int read_normalizer(tj *t, const json_t *n)
{
    if (!n || json_is_null(n)) return 0;
    const char *ty = type_of(n);
    if (!ty) return kvm_err(KVM_EFORMAT, "%s: normalizer has no type", t->f);
    if (strcmp(ty, "Sequence") == 0) {
        size_t i;
        json_t *v;
        int rc;
        json_array_foreach(json_object_get(n, "normalizers"), i, v) if ((rc = read_normalizer(t, v))) return rc;
        return 0;
    }
    if (strcmp(ty, "NFC") == 0) return add_norm(t, KVM_BPE_NORM_NFC, NULL, NULL);
    if (strcmp(ty, "NFKC") == 0) return add_norm(t, KVM_BPE_NORM_NFKC, NULL, NULL);
    if (strcmp(ty, "Prepend") == 0) {
        const char *p = json_string_value(json_object_get(n, "prepend"));
        if (!p) return kvm_err(KVM_EFORMAT, "%s: normalizer Prepend has no 'prepend' string", t->f);
        return add_norm(t, KVM_BPE_NORM_PREPEND, p, NULL);
    }
    if (strcmp(ty, "Replace") == 0) {
        const char *p = json_string_value(json_object_get(json_object_get(n, "pattern"), "String")),
                   *c = json_string_value(json_object_get(n, "content"));
        if (!p || !c || !*p)
            return kvm_err(KVM_ENOTSUP, "%s: normalizer Replace: only a non-empty String pattern and a content are "
                                        "supported", t->f);
        return add_norm(t, KVM_BPE_NORM_REPLACE, p, c);
    }
    return kvm_err(KVM_ENOTSUP, "%s: normalizer '%.32s' is not supported (NFC, NFKC, Prepend, Replace, Sequence are)",
                   t->f, ty);
}

static int add_split(tj *t, const char *re, size_t n)
{
    if (t->n_split == KVM_BPE_MAX_SPLITS) return kvm_err(KVM_ENOTSUP, "%s: more than %d pre-tokenizer splits", t->f, KVM_BPE_MAX_SPLITS);
    char *s = malloc(n + 1);
    if (!s) return kvm_err(KVM_ENOMEM, "%s: out of memory", t->f);
    memcpy(s, re, n);
    s[n] = 0;
    t->h.split[t->n_split++] = s;
    return 0;
}

/* Split: a Regex pattern as is, a String pattern quoted (\Q...\E). */
static int read_split(tj *t, const json_t *p)
{
    const char *beh = json_string_value(json_object_get(p, "behavior"));
    if (!beh || strcmp(beh, "Isolated") != 0 || json_is_true(json_object_get(p, "invert")))
        return kvm_err(KVM_ENOTSUP, "%s: pre-tokenizer Split with behavior '%.32s'%s is not supported (Isolated is)",
                       t->f, beh ? beh : "?", json_is_true(json_object_get(p, "invert")) ? " inverted" : "");
    const json_t *pat = json_object_get(p, "pattern"), *re = json_object_get(pat, "Regex"),
                 *str = json_object_get(pat, "String");
    if (json_is_string(re)) return add_split(t, json_string_value(re), json_string_length(re));
    if (!json_is_string(str)) return kvm_err(KVM_EFORMAT, "%s: pre-tokenizer Split has no Regex or String pattern", t->f);
    if (strstr(json_string_value(str), "\\E"))
        return kvm_err(KVM_ENOTSUP, "%s: pre-tokenizer Split string pattern contains \\E", t->f);
    char buf[1024];
    int l = snprintf(buf, sizeof buf, "\\Q%s\\E", json_string_value(str));
    if (l < 0 || (size_t)l >= sizeof buf) return kvm_err(KVM_ENOTSUP, "%s: pre-tokenizer Split pattern too long", t->f);
    return add_split(t, buf, (size_t)l);
}

static int read_metaspace(tj *t, const json_t *p)
{
    const char *rep = json_string_value(json_object_get(p, "replacement"));
    if (!rep || strcmp(rep, "\xe2\x96\x81") != 0)
        return kvm_err(KVM_ENOTSUP, "%s: pre-tokenizer Metaspace replacement other than U+2581", t->f);
    if (t->n_split) return kvm_err(KVM_ENOTSUP, "%s: pre-tokenizer Metaspace after a split", t->f);
    const char *scheme = json_string_value(json_object_get(p, "prepend_scheme"));
    if (scheme) t->h.metaspace = strcmp(scheme, "never") == 0 ? 1 : strcmp(scheme, "first") == 0 ? 2 : 3;
    else t->h.metaspace = json_is_false(json_object_get(p, "add_prefix_space")) ? 1 : 3;
    if (json_is_false(json_object_get(p, "split"))) return 0;
    static const char re[] = "\xe2\x96\x81[^\xe2\x96\x81]*|[^\xe2\x96\x81]+"; /* MergedWithNext on U+2581 */
    return add_split(t, re, sizeof re - 1);
}

static int read_pre(tj *t, const json_t *p)
{
    if (!p || json_is_null(p)) return 0;
    const char *ty = type_of(p);
    if (!ty) return kvm_err(KVM_EFORMAT, "%s: pre_tokenizer has no type", t->f);
    if (strcmp(ty, "Sequence") == 0) {
        size_t i;
        json_t *v;
        int rc;
        json_array_foreach(json_object_get(p, "pretokenizers"), i, v) if ((rc = read_pre(t, v))) return rc;
        return 0;
    }
    if (strcmp(ty, "Split") == 0) return read_split(t, p);
    if (strcmp(ty, "Digits") == 0) {
        const char *re = json_is_true(json_object_get(p, "individual_digits")) ? "\\p{N}" : "\\p{N}+";
        return add_split(t, re, strlen(re));
    }
    if (strcmp(ty, "ByteLevel") == 0) {
        if (json_is_true(json_object_get(p, "add_prefix_space")))
            return kvm_err(KVM_ENOTSUP, "%s: pre-tokenizer ByteLevel with add_prefix_space = true is not supported", t->f);
        t->has_byte_level = 1;
        if (json_is_false(json_object_get(p, "use_regex"))) return 0;
        return add_split(t, KVM_HF_GPT2_RE, strlen(KVM_HF_GPT2_RE));
    }
    if (strcmp(ty, "Metaspace") == 0) return read_metaspace(t, p);
    return kvm_err(KVM_ENOTSUP,
                   "%s: pre-tokenizer '%.32s' is not supported (Split, ByteLevel, Digits, Metaspace, Sequence are)", t->f,
                   ty);
}

/* ---- BOS, EOS, chat template ---- */

/* The id of token text s (vocabulary or added), or -1. */
static int32_t find_text(const tj *t, const char *s)
{
    size_t l = strlen(s);
    for (int32_t i = 0; i < t->h.n_vocab; i++)
        if (t->tok[i] && t->tok_len[i] == l && memcmp(t->tok[i], s, l) == 0) return i;
    return -1;
}

static void read_post(const tj *t, const json_t *p, kvm_tokjson_info *info)
{
    const char *ty = type_of(p);
    if (!ty) return;
    if (strcmp(ty, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(p, "processors"), i, v) read_post(t, v, info);
        return;
    }
    if (strcmp(ty, "TemplateProcessing") != 0) return;
    const json_t *first = json_object_get(json_array_get(json_object_get(p, "single"), 0), "SpecialToken");
    const char *name = json_string_value(json_object_get(first, "id"));
    if (!name) return;
    const json_t *ids = json_object_get(json_object_get(json_object_get(p, "special_tokens"), name), "ids");
    int32_t id = json_is_integer(json_array_get(ids, 0)) ? (int32_t)json_integer_value(json_array_get(ids, 0)) : find_text(t, name);
    if (id >= 0 && id < t->h.n_vocab) {
        info->bos_id = id;
        info->add_bos = 1;
    }
}

/* A tokenizer_config.json token entry: a string or {"content": string}. */
static const char *token_entry(const json_t *v)
{
    return json_is_string(v) ? json_string_value(v) : json_string_value(json_object_get(v, "content"));
}

/* KVM_EFORMAT naming file p and key `key` when v is a string holding a NUL ("\u0000"): read as
 * a C string it would end there, a template or token cut short without a word. */
static int check_no_nul(const char *p, const char *key, const json_t *v)
{
    if (!json_is_string(v) || strlen(json_string_value(v)) == json_string_length(v)) return 0;
    return kvm_err(KVM_EFORMAT, "%s: key '%s' holds a NUL character (\\u0000) at offset %zu", p, key,
                   strlen(json_string_value(v)));
}

/* The chat template's strings, as a string or as a list of named templates, free of NULs. */
static int check_template_nul(const char *p, const json_t *tm)
{
    int rc = check_no_nul(p, "chat_template", tm);
    size_t i;
    const json_t *v;
    json_array_foreach(tm, i, v) {
        if ((rc = check_no_nul(p, "chat_template", json_object_get(v, "name"))) ||
            (rc = check_no_nul(p, "chat_template", json_object_get(v, "template"))))
            return rc;
    }
    return rc;
}

/* The keys read_config uses, of a type it reads: a string "true" as add_bos_token, or a
 * number as chat_template or bos_token, was taken as absent (no BOS, no template) while
 * transformers goes by the value's truth or refuses it; a string of them holding a NUL is
 * refused too (the file is loaded with JSON_ALLOW_NUL so that the message can name the key). */
static int check_config_types(const char *p, const json_t *c)
{
    static const char *const tokens[] = {"bos_token", "eos_token"};
    if (!json_is_object(c)) /* a list ([] say) read as an object without keys: no BOS, no template */
        return kvm_err(KVM_EFORMAT, "%s: not a JSON object (its settings: bos_token, chat_template, ...)", p);
    const json_t *v = json_object_get(c, "add_bos_token");
    if (v && !json_is_boolean(v) && !json_is_null(v))
        return kvm_err(KVM_EFORMAT, "%s: key 'add_bos_token' is not true, false or null", p);
    v = json_object_get(c, "chat_template");
    if (v && !json_is_string(v) && !json_is_array(v) && !json_is_null(v))
        return kvm_err(KVM_EFORMAT, "%s: key 'chat_template' is not a string or a list of named templates", p);
    int rc = check_template_nul(p, v);
    for (int i = 0; i < 2 && !rc; i++) {
        v = json_object_get(c, tokens[i]);
        if (v && !json_is_null(v) && !token_entry(v))
            return kvm_err(KVM_EFORMAT, "%s: key '%s' is not a string or an object with a 'content' string", p,
                           tokens[i]);
        if (!(rc = check_no_nul(p, tokens[i], v))) rc = check_no_nul(p, tokens[i], json_object_get(v, "content"));
    }
    return rc;
}

static int read_config(const tj *t, const char *path, kvm_tokjson_info *info)
{
    char tmp[4096], p[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    snprintf(p, sizeof p, "%s/tokenizer_config.json", dirname(tmp));
    int rc = kvm_file_check_found(p); /* a FIFO would block json_load_file; a broken link loses the template */
    if (rc == KVM_ENOTFOUND) return 0;
    if (rc) return rc;
    json_error_t je;
    json_t *c = kvm__json_load_file(p, JSON_ALLOW_NUL, &je); /* check_config_types refuses a NUL by key */
    if (!c) return kvm_err(KVM_EFORMAT, "%s: %s (line %d)", p, je.text, je.line);
    if ((rc = check_config_types(p, c))) {
        json_decref(c);
        return rc;
    }
    const char *bos = token_entry(json_object_get(c, "bos_token")), *eos = token_entry(json_object_get(c, "eos_token"));
    if (eos) info->eos_id = find_text(t, eos);
    if (bos && info->bos_id < 0) info->bos_id = find_text(t, bos);
    if (json_is_true(json_object_get(c, "add_bos_token")) && info->bos_id < 0 && bos) { /* was: no BOS, no word */
        rc = kvm_err(KVM_EFORMAT, "%s: add_bos_token is true but bos_token '%.64s' is not a token of %s", p, bos, t->f);
        json_decref(c);
        return rc;
    }
    if (!info->add_bos && json_is_true(json_object_get(c, "add_bos_token")) && info->bos_id >= 0) info->add_bos = 1;
    const json_t *tm = json_object_get(c, "chat_template");
    const char *tmpl = json_string_value(tm);
    size_t i;
    json_t *v;
    if (json_is_array(tm)) {
        json_array_foreach(tm, i, v) { /* [{"name": ..., "template": ...}]: the one named "default" */
            const char *name = json_string_value(json_object_get(v, "name"));
            if (!tmpl && name && !strcmp(name, "default")) tmpl = json_string_value(json_object_get(v, "template"));
        }
    }
    if (tmpl && !(info->chat_template = strdup(tmpl))) rc = kvm_err(KVM_ENOMEM, "%s: out of memory", p);
    json_decref(c);
    return rc;
}

/* ---- the whole file ---- */

static int read_model(tj *t, const json_t *root, int32_t min_vocab)
{
    const json_t *m = json_object_get(root, "model"), *vocab = json_object_get(m, "vocab"),
                 *merges = json_object_get(m, "merges"), *added = json_object_get(root, "added_tokens");
    const char *ty = type_of(m);
    if (!json_is_object(m)) return kvm_err(KVM_EFORMAT, "%s: 'model' is missing or not an object", t->f);
    if (ty && strcmp(ty, "BPE") != 0)
        return kvm_err(KVM_ENOTSUP, "%s: model type '%.32s' is not supported (BPE is)", t->f, ty);
    if (!json_is_object(vocab) || !json_is_array(merges))
        return kvm_err(KVM_EFORMAT, "%s: model.vocab (object) or model.merges (array) is missing", t->f);
    if (added && !json_is_array(added)) return kvm_err(KVM_EFORMAT, "%s: 'added_tokens' is not an array", t->f);
    const char *keys[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const char *v = json_string_value(json_object_get(m, keys[i]));
        if (v && *v) return kvm_err(KVM_ENOTSUP, "%s: model.%s '%.16s' is not supported", t->f, keys[i], v);
    }
    const json_t *drop = json_object_get(m, "dropout");
    if (drop && !json_is_null(drop) && json_number_value(drop) != 0)
        return kvm_err(KVM_ENOTSUP, "%s: model.dropout is not supported", t->f);
    int rc;
    if ((rc = vocab_size(t, vocab, added, min_vocab))) return rc;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)vocab, k, v)
    {
        char where[96];
        snprintf(where, sizeof where, "model.vocab['%.64s']", k);
        if ((rc = set_token(t, (int32_t)json_integer_value(v), k, strlen(k), KVM_TOKEN_NORMAL, where))) return rc;
    }
    const char *unk = json_string_value(json_object_get(m, "unk_token"));
    if (unk && (t->h.unk_id = vocab_id(vocab, unk, strlen(unk))) < 0)
        return kvm_err(KVM_EFORMAT, "%s: model.unk_token '%.64s' is not in model.vocab", t->f, unk);
    if ((rc = read_added(t, added)) || (rc = pack_tokens(t, json_is_true(json_object_get(m, "byte_fallback")))) ||
        (rc = read_merges(t, vocab, merges)))
        return rc;
    t->h.ignore_merges = json_is_true(json_object_get(m, "ignore_merges"));
    return 0;
}

static void hf_free(kvm_bpe_hf *h)
{
    free(h->text), free(h->text_off), free(h->text_len), free(h->type);
    free(h->merge_text), free(h->merge_off), free(h->merge_first_len), free(h->merge_len);
    for (int i = 0; i < KVM_BPE_MAX_SPLITS; i++)
        free(h->split[i]);
    for (int i = 0; i < KVM_BPE_MAX_NORM; i++)
        free(h->norm[i].a), free(h->norm[i].b);
    memset(h, 0, sizeof *h);
}

/* The tokenizer of root (consumed), and tokenizer_config.json beside `path` when config is 1. */
static int from_root(const char *path, json_t *root, const json_error_t *je, int config, int32_t min_vocab,
                     kvm_bpe **bpe, kvm_tokjson_info *info)
{
    if (!root) return kvm_err(KVM_EFORMAT, "%s: %s (line %d, column %d)", path, je->text, je->line, je->column);
    tj t = {.f = path};
    t.h.unk_id = -1;
    int rc = read_model(&t, root, min_vocab);
    if (!rc) rc = read_normalizer(&t, json_object_get(root, "normalizer"));
    if (!rc) rc = read_pre(&t, json_object_get(root, "pre_tokenizer"));
    if (!rc) {
        t.h.byte_level = t.has_byte_level;
        read_post(&t, json_object_get(root, "post_processor"), info);
        if (config) rc = read_config(&t, path, info);
    }
    free(t.tok), free(t.tok_len);
    json_decref(root);
    if (!rc) return kvm__bpe_new_hf(path, &t.h, bpe); /* takes t.h's arrays */
    hf_free(&t.h);
    free(info->chat_template);
    info->chat_template = NULL;
    return rc;
}

int kvm__tokjson_open(const char *path, int32_t min_vocab, kvm_bpe **bpe, kvm_tokjson_info *info)
{
    *bpe = NULL;
    *info = (kvm_tokjson_info){-1, -1, 0, NULL};
    int rc = kvm_file_check_found(path); /* absent; a FIFO (json_load_file would block), a broken link */
    if (rc) return rc;
    json_error_t je;
    json_t *root = kvm__json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    return from_root(path, root, &je, 1, min_vocab, bpe, info);
}

int kvm__tokjson_parse_mem(const char *name, const char *json, size_t len, int32_t min_vocab, kvm_bpe **bpe,
                           kvm_tokjson_info *info)
{
    *bpe = NULL;
    *info = (kvm_tokjson_info){-1, -1, 0, NULL};
    json_error_t je;
    json_t *root = kvm__json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    return from_root(name, root, &je, 0, min_vocab, bpe, info);
}
