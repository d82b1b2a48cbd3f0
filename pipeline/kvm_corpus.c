/* kvm_corpus.c: reading a corpus folder or JSON Lines file (jansson) and preparing documents
 * (tokenise, truncate, hash). */
#include "pipeline/kvm_corpus.h"
#include "common/kvm_error.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0, r;
    char *buf = malloc(cap);
    while (buf && (r = fread(buf + n, 1, cap - 1 - n, f)) > 0) {
        n += r;
        if (n + 1 == cap) {
            char *b = realloc(buf, cap *= 2);
            if (!b) { free(buf); buf = NULL; }
            buf = b;
        }
    }
    int err = ferror(f);
    fclose(f);
    if (!buf || err) { free(buf); return NULL; }
    buf[n] = '\0';
    *len = n;
    return buf;
}

static int push_doc(kvm_corpus *c, int64_t *cap, kvm_doc d)
{
    if (c->n == *cap) {
        kvm_doc *nd = realloc(c->docs, (size_t)(*cap = *cap ? 2 * *cap : 64) * sizeof *nd);
        if (!nd) return kvm_err(KVM_ENOMEM, "corpus: out of memory");
        c->docs = nd;
    }
    c->docs[c->n++] = d;
    return 0;
}

static int read_dir(const char *path, kvm_corpus *c)
{
    DIR *dir = opendir(path);
    if (!dir) return kvm_err(KVM_EIO, "%s: %s", path, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(dir))) {
        size_t l = strlen(e->d_name);
        if (l < 5 || strcmp(e->d_name + l - 4, ".txt")) continue;
        if (n == cap) {
            char **nn = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof *nn);
            if (!nn) { rc = kvm_err(KVM_ENOMEM, "corpus: out of memory"); break; }
            names = nn;
        }
        if (!(names[n] = strdup(e->d_name))) { rc = kvm_err(KVM_ENOMEM, "corpus: out of memory"); break; }
        n++;
    }
    closedir(dir);
    if (n > 0) qsort(names, n, sizeof *names, cmp_names);
    int64_t dcap = 0;
    for (size_t i = 0; !rc && i < n; i++) {
        char full[4096];
        snprintf(full, sizeof full, "%s/%s", path, names[i]);
        kvm_doc d = {0};
        if (!(d.text = read_all(full, &d.text_len))) { rc = kvm_err(KVM_EIO, "%s: cannot read", full); break; }
        d.name = names[i];
        names[i] = NULL;
        if ((rc = push_doc(c, &dcap, d))) { free(d.text); free(d.name); }
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (!rc && c->n == 0) rc = kvm_err(KVM_EINVAL, "%s: no *.txt documents", path);
    return rc;
}

/* One JSON line -> document. */
static int parse_line(const char *path, int64_t line, const char *text, kvm_doc *d)
{
    json_error_t jerr;
    json_t *o = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    int rc = 0;
    if (!o) return kvm_err(KVM_EINVAL, "%s:%lld: invalid JSON: %s", path, (long long)line, jerr.text);
    json_t *id = json_object_get(o, "id"), *tx = json_object_get(o, "text"), *tk = json_object_get(o, "tokens");
    if (!json_is_object(o)) rc = kvm_err(KVM_EINVAL, "%s:%lld: not a JSON object", path, (long long)line);
    else if (!json_is_string(id) || json_string_length(id) == 0)
        rc = kvm_err(KVM_EINVAL, "%s:%lld: \"id\" must be a non-empty string", path, (long long)line);
    else if ((tx != NULL) == (tk != NULL))
        rc = kvm_err(KVM_EINVAL, "%s:%lld: give exactly one of \"text\" and \"tokens\"", path, (long long)line);
    else if (tx && !json_is_string(tx))
        rc = kvm_err(KVM_EINVAL, "%s:%lld: \"text\" must be a string", path, (long long)line);
    else if (tk && (!json_is_array(tk) || json_array_size(tk) == 0))
        rc = kvm_err(KVM_EINVAL, "%s:%lld: \"tokens\" must be a non-empty array of token ids", path, (long long)line);
    if (!rc && !(d->name = strdup(json_string_value(id)))) rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
    if (!rc && tx) {
        d->text_len = json_string_length(tx);
        if ((d->text = malloc(d->text_len + 1))) memcpy(d->text, json_string_value(tx), d->text_len + 1);
        else rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
    }
    if (!rc && tk) {
        size_t n = json_array_size(tk);
        if (!(d->tokens = malloc(n * sizeof *d->tokens))) rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
        for (size_t i = 0; !rc && i < n; i++) {
            json_t *v = json_array_get(tk, i);
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
                rc = kvm_err(KVM_EINVAL, "%s:%lld: \"tokens\"[%zu] is not a token id", path, (long long)line, i);
            else d->tokens[i] = (int32_t)json_integer_value(v);
        }
        d->n_tokens = (int64_t)n;
    }
    json_decref(o);
    return rc;
}

static int read_jsonl(const char *path, kvm_corpus *c)
{
    FILE *f = fopen(path, "r");
    if (!f) return kvm_err(KVM_EIO, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    int64_t lineno = 0, dcap = 0;
    int rc = 0;
    ssize_t len;
    while (!rc && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
        if (len == 0) continue;
        kvm_doc d = {0};
        if ((rc = parse_line(path, lineno, line, &d)) == 0) {
            for (int64_t i = 0; i < c->n; i++)
                if (!strcmp(c->docs[i].name, d.name)) {
                    rc = kvm_err(KVM_EINVAL, "%s:%lld: duplicate id \"%s\"", path, (long long)lineno, d.name);
                    break;
                }
        }
        if (!rc) rc = push_doc(c, &dcap, d);
        if (rc) { free(d.name); free(d.text); free(d.tokens); }
    }
    free(line);
    fclose(f);
    if (!rc && c->n == 0) rc = kvm_err(KVM_EINVAL, "%s: no documents", path);
    return rc;
}

int kvm_corpus_read(const char *path, kvm_corpus **out)
{
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0)
        return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "corpus %s: %s", path, strerror(errno));
    kvm_corpus *c = calloc(1, sizeof *c);
    if (!c) return kvm_err(KVM_ENOMEM, "corpus: out of memory");
    size_t l = strlen(path);
    int rc;
    if (S_ISDIR(st.st_mode)) rc = read_dir(path, c);
    else if (l > 6 && !strcmp(path + l - 6, ".jsonl")) rc = read_jsonl(path, c);
    else rc = kvm_err(KVM_EINVAL, "corpus %s: expected a folder of *.txt or a .jsonl file", path);
    if (rc) kvm_corpus_free(&c);
    *out = c;
    return rc;
}

void kvm_corpus_free(kvm_corpus **pc)
{
    if (!pc || !*pc) return;
    kvm_corpus *c = *pc;
    for (int64_t i = 0; i < c->n; i++) {
        free(c->docs[i].name);
        free(c->docs[i].text);
        free(c->docs[i].tokens);
    }
    free(c->docs);
    free(c);
    *pc = NULL;
}

int kvm_doc_prepare(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, int64_t n_ctx)
{
    if (d->text) {
        free(d->tokens);
        d->tokens = NULL;
        int rc = kvm_tokenizer_encode(tok, d->text, d->text_len, 1, 0, &d->tokens, &d->n_tokens);
        if (rc) return kvm_err(rc, "document %s: %s", d->name, kvm_errmsg());
    } else {
        for (int64_t i = 0; i < d->n_tokens; i++)
            if (d->tokens[i] >= vocab_size)
                return kvm_err(KVM_EINVAL, "document %s: token %lld has id %d, outside the vocabulary of %d", d->name,
                               (long long)i, d->tokens[i], vocab_size);
        if (d->n_tokens == 0 || d->tokens[0] != bos) {
            int32_t *t = realloc(d->tokens, (size_t)(d->n_tokens + 1) * sizeof *t);
            if (!t) return kvm_err(KVM_ENOMEM, "corpus: out of memory");
            memmove(t + 1, t, (size_t)d->n_tokens * sizeof *t);
            t[0] = bos;
            d->tokens = t;
            d->n_tokens++;
        }
    }
    if (d->n_tokens <= 1) return kvm_err(KVM_EINVAL, "document %s is empty", d->name);
    d->n_original = d->n_tokens;
    d->truncated = d->n_tokens > n_ctx;
    if (d->truncated) d->n_tokens = n_ctx;
    return kvm_store_doc_hash(d->tokens, d->n_tokens, &d->hash);
}
