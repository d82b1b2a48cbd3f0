/* kvm_tokenizer_hf.c: tokenizer.json vocabularies in the BPE engine: building one from the
 * arrays kvm_tokenizer_json.c fills, and the `tokenizers` encode pipeline (added tokens first,
 * then per fragment the normalizer steps, Metaspace, the split regexes, BPE by rank). */
#include "model/kvm_tokenizer_bpe_int.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

int kvm__bpe_new_hf(const char *name, kvm_bpe_hf *h, kvm_bpe **out)
{
    *out = NULL;
    kvm_bpe *b = calloc(1, sizeof *b);
    int rc = 0;
    if (b) {
        kvm__bpe_byte_map_init(b);
        for (int i = 0; i < 256; i++)
            b->byte_tok[i] = -1;
        b->hf = 1;
        b->spm = b->chars = !h->byte_level; /* pieces: U+2581 as ' ', <0xXX> as its byte */
        b->ignore_merges = h->ignore_merges;
        b->metaspace = h->metaspace;
        b->unk_id = h->unk_id;
        b->n_vocab = h->n_vocab;
        b->text = h->text, b->text_off = h->text_off, b->text_len = h->text_len, b->type = h->type;
        b->n_merges = h->n_merges;
        b->merge_text = h->merge_text, b->merge_off = h->merge_off, b->merge_first_len = h->merge_first_len;
        b->merge_len = h->merge_len;
        memcpy(b->norm, h->norm, sizeof b->norm);
    } else {
        free(h->text), free(h->text_off), free(h->text_len), free(h->type);
        free(h->merge_text), free(h->merge_off), free(h->merge_first_len), free(h->merge_len);
        for (int i = 0; i < KVM_BPE_MAX_NORM; i++)
            free(h->norm[i].a), free(h->norm[i].b);
        rc = kvm_err(KVM_ENOMEM, "%s: out of memory", name);
    }
    int n_split = 0;
    while (n_split < KVM_BPE_MAX_SPLITS && h->split[n_split])
        n_split++;
    if (!rc) rc = kvm__bpe_finish(b, name);
    if (!rc) rc = kvm__bpe_compile(b, name, (const char *const *)h->split, n_split);
    for (int i = 0; i < n_split; i++)
        free(h->split[i]);
    memset(h, 0, sizeof *h);
    if (rc) {
        kvm__bpe_free(&b);
        return rc;
    }
    *out = b;
    return 0;
}

/* A growable byte buffer. */
typedef struct bytes {
    char *v;
    size_t n, cap;
} bytes;

static int bytes_put(bytes *o, const char *p, size_t n)
{
    if (o->n + n + 1 > o->cap) {
        size_t cap = o->cap ? o->cap : 64;
        while (cap < o->n + n + 1)
            cap *= 2;
        char *v = realloc(o->v, cap);
        if (!v) return kvm_err(KVM_ENOMEM, "tokenizer encode: out of memory");
        o->v = v;
        o->cap = cap;
    }
    memcpy(o->v + o->n, p, n);
    o->n += n;
    return 0;
}

/* One normalizer step from src[0, n) into dst (emptied first). */
static int norm_step(const kvm_bpe_norm *st, const char *src, size_t n, bytes *dst)
{
    dst->n = 0;
    int rc = 0;
    if (st->kind == KVM_BPE_NORM_NFC || st->kind == KVM_BPE_NORM_NFKC) {
        utf8proc_uint8_t *o = NULL;
        int opt = UTF8PROC_STABLE | UTF8PROC_COMPOSE | (st->kind == KVM_BPE_NORM_NFKC ? UTF8PROC_COMPAT : 0);
        utf8proc_ssize_t l = utf8proc_map((const utf8proc_uint8_t *)src, (utf8proc_ssize_t)n, &o, opt);
        rc = l >= 0 ? bytes_put(dst, (const char *)o, (size_t)l) : bytes_put(dst, src, n); /* invalid UTF-8: kept */
        free(o);
        return rc;
    }
    if (st->kind == KVM_BPE_NORM_PREPEND) {
        if (n && (rc = bytes_put(dst, st->a, strlen(st->a)))) return rc;
        return bytes_put(dst, src, n);
    }
    size_t al = strlen(st->a), bl = strlen(st->b), i = 0; /* REPLACE */
    while (!rc && i < n) {
        if (al && i + al <= n && memcmp(src + i, st->a, al) == 0) {
            rc = bytes_put(dst, st->b, bl);
            i += al;
        } else {
            rc = bytes_put(dst, src + i++, 1);
        }
    }
    return rc;
}

/* The normalizer steps, then the Metaspace rewrite, of one fragment (first: it starts the
 * text) into *out. */
static int hf_normalize(const kvm_bpe *b, const char *w, size_t wl, int first, bytes *out, bytes *tmp)
{
    out->n = 0;
    int rc = bytes_put(out, w, wl);
    for (int i = 0; !rc && i < KVM_BPE_MAX_NORM && b->norm[i].kind; i++) {
        if ((rc = norm_step(&b->norm[i], out->v, out->n, tmp))) break;
        bytes t = *out;
        *out = *tmp;
        *tmp = t;
    }
    if (rc || !b->metaspace) return rc;
    kvm_bpe_norm ms = {KVM_BPE_NORM_REPLACE, " ", "\xe2\x96\x81"};
    if ((rc = norm_step(&ms, out->v, out->n, tmp))) return rc;
    out->n = 0;
    int pre = (b->metaspace == 3 || (b->metaspace == 2 && first)) && !(tmp->n >= 3 && memcmp(tmp->v, "\xe2\x96\x81", 3) == 0);
    if (pre && (rc = bytes_put(out, "\xe2\x96\x81", 3))) return rc;
    return bytes_put(out, tmp->v, tmp->n);
}

/* A growable id array. */
static int ids_reserve(int32_t **v, int64_t *cap, int64_t need)
{
    return kvm__bpe_grow((void **)v, cap, need, sizeof **v);
}

/* tokenizers' pipeline: added tokens split out first; each other fragment normalised,
 * pre-tokenized by the split regexes, and each piece merged by rank. */
static int hf_encode(const kvm_bpe *b, const char *text, size_t len, int32_t **out, int64_t *n, int64_t *cap)
{
    frag_list a = {0}, c = {0}, d = {0};
    bpe_scratch s = {0};
    bytes nb = {0}, tmp = {0};
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    int rc = md ? kvm__bpe_partition(b, text, len, &a) : kvm_err(KVM_ENOMEM, "tokenizer encode: out of memory");
    for (int64_t i = 0; !rc && i < a.n; i++) {
        if (a.v[i].token >= 0) {
            if (!(rc = ids_reserve(out, cap, *n + 1))) (*out)[(*n)++] = a.v[i].token;
            continue;
        }
        if ((rc = hf_normalize(b, text + a.v[i].off, (size_t)a.v[i].len, a.v[i].off == 0, &nb, &tmp))) break;
        c.n = 0;
        if (nb.n && (rc = kvm__bpe_frag_push(&c, (frag){0, (int64_t)nb.n, -1}))) break;
        for (int k = 0; !rc && k < KVM_BPE_MAX_REGEX && b->re[k]; k++) {
            if ((rc = kvm__bpe_regex_split(b->re[k], nb.v, &c, &d, md))) break;
            frag_list t = c;
            c = d;
            d = t;
        }
        if (!rc) rc = ids_reserve(out, cap, *n + (int64_t)nb.n); /* at most one id per byte */
        for (int64_t k = 0; !rc && k < c.n; k++)
            rc = kvm__bpe_word(b, &s, nb.v + c.v[k].off, c.v[k].len, b->chars, *out, n);
    }
    free(a.v), free(c.v), free(d.v), free(nb.v), free(tmp.v);
    free(s.word), free(s.syms), free(s.heap);
    pcre2_match_data_free(md);
    return rc;
}

int kvm__bpe_encode_new(const kvm_bpe *b, const char *text, size_t len, int32_t **out, int64_t *n)
{
    *out = NULL;
    *n = 0;
    int64_t cap = 0;
    int rc;
    if (b->hf) {
        rc = hf_encode(b, text, len, out, n, &cap);
    } else {
        rc = ids_reserve(out, &cap, 4 * (int64_t)len + 1);
        if (!rc) rc = kvm__bpe_encode(b, text, len, *out, n);
    }
    if (rc) {
        free(*out);
        *out = NULL;
        *n = 0;
    }
    return rc;
}
