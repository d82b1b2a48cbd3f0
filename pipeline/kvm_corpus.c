/* kvm_corpus.c: reading a corpus folder or JSON Lines file (jansson) and preparing documents
 * (tokenise, truncate, hash). */
#include "pipeline/kvm_corpus.h"
#include "model/kvm_utf8.h"
#include "pipeline/kvm_doctok.h"
#include "pipeline/kvm_idxset.h"
#include "common/kvm_error.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Opens a document for reading, which must be a regular file: a FIFO named *.txt blocked the run
 * in open until a writer came (forever), a device read without end. NULL with errno set. */
static FILE *open_regular(const char *path, const char *mode)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* O_NONBLOCK: a FIFO does not block the open */
    struct stat st;
    if (fd < 0) return NULL;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        int e = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        close(fd);
        errno = e;
        return NULL;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    FILE *f = fdopen(fd, mode);
    if (!f) close(fd);
    return f;
}

/* Reads at most max bytes of a file (NUL-terminated); *at_end = 1 when that is all of it. */
static char *read_prefix(const char *path, size_t max, size_t *len, int *at_end)
{
    FILE *f = open_regular(path, "rb");
    if (!f) return NULL;
    char *buf = malloc(max + 2);
    size_t n = buf ? fread(buf, 1, max + 1, f) : 0;
    int err = ferror(f);
    fclose(f);
    if (!buf || err) { free(buf); return NULL; }
    *at_end = n <= max;
    if (n > max) n = max;
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

/* name with each CR and LF written as \r and \n (such a document fails: load_file) and each byte
 * that is not part of valid UTF-8 as %HH, as in a URL (malloc'ed; NULL when out of memory). A
 * file name holding a line break went raw into every log line naming the document; one in
 * latin-1 became U+FFFD on the wire and in the store, so `ask --doc-name` could not reach it and
 * two such names were one. '%' rather than a backslash escape: `store ls --names` shows a
 * backslash as \x5c, and the name shown there is the one --doc-name takes. */
static char *escaped_name(const char *name)
{
    size_t n = strlen(name);
    char *out = malloc(4 * n + 1), *o = out;
    for (size_t i = 0; out && i < n;) {
        size_t l = 1;
        while (l <= 4 && i + l <= n && !kvm_utf8_valid(name + i, l))
            l++;
        if (name[i] == '\n' || name[i] == '\r') {
            *o++ = '\\', *o++ = name[i] == '\n' ? 'n' : 'r', i++;
        } else if (l > 4 || i + l > n) {
            o += sprintf(o, "%%%02X", (unsigned char)name[i]), i++;
        } else {
            memcpy(o, name + i, l), o += l, i += l;
        }
    }
    if (out) *o = '\0';
    return out;
}

/* An escaped name (escaped_name: %HH) that is another file's own name ("caf%E9.txt" beside a
 * latin-1 "caf\xe9.txt") would store two documents under one name: the escaped one fails at load
 * (name_clash). Escaped names are rare, so each is compared with every name. */
static void mark_clashes(kvm_corpus *c)
{
    for (int64_t i = 0; i < c->n; i++) {
        const char *base = strrchr(c->docs[i].path, '/');
        if (!strcmp(base ? base + 1 : c->docs[i].path, c->docs[i].name)) continue; /* not escaped */
        for (int64_t k = 0; k < c->n && !c->docs[i].name_clash; k++)
            c->docs[i].name_clash = k != i && !strcmp(c->docs[k].name, c->docs[i].name);
    }
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
        struct stat st;
        /* a file that cannot be read (a dangling link, no read permission, removed since the
         * listing) fails alone when it is loaded, as a FIFO does: it does not stop the run */
        if (!(d.path = strdup(full))) { rc = kvm_err(KVM_ENOMEM, "corpus: out of memory"); break; }
        d.size = stat(full, &st) == 0 ? (int64_t)st.st_size : 0;
        /* shown escaped; one with a line break fails alone when loaded (load_file) */
        if (strpbrk(names[i], "\r\n") || !kvm_utf8_valid(names[i], strlen(names[i]))) {
            d.name = escaped_name(names[i]);
            if (!d.name) {
                free(d.path);
                rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
                break;
            }
        } else {
            d.name = names[i];
            names[i] = NULL;
        }
        if ((rc = push_doc(c, &dcap, d))) { free(d.path); free(d.name); }
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    if (!rc && c->n == 0) rc = kvm_err(KVM_EINVAL, "%s: no *.txt documents", path);
    if (!rc) mark_clashes(c);
    return rc;
}

/* The field of a JSON line that holds a NUL (\u0000) string character, which jansson refused
 * naming its own flag at the string's end: "id" or "text" (another key's otherwise). */
static const char *nul_field(const char *text)
{
    json_error_t jerr;
    json_t *o = json_loads(text, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &jerr);
    const char *keys[] = {"id", "text"}, *found = "a string";
    for (int i = 0; o && i < 2; i++) {
        json_t *v = json_object_get(o, keys[i]);
        if (json_is_string(v) && strlen(json_string_value(v)) != json_string_length(v)) {
            found = i ? "the document text" : "the \"id\"";
            break;
        }
    }
    json_decref(o);
    return found;
}

/* One JSON line -> document. */
static int parse_line(const char *path, int64_t line, const char *text, kvm_doc *d)
{
    json_error_t jerr;
    json_t *o = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    int rc = 0;
    if (!o && strstr(jerr.text, "JSON_ALLOW_NUL")) /* jansson names its flag; say what is wrong with the line */
        return kvm_err(KVM_EINVAL, "%s:%lld: %s contains NUL (\\u0000) (the string ends at column %d)", path,
                       (long long)line, nul_field(text), jerr.column);
    if (!o) return kvm_err(KVM_EINVAL, "%s:%lld: invalid JSON: %s", path, (long long)line, jerr.text);
    json_t *id = json_object_get(o, "id"), *tx = json_object_get(o, "text"), *tk = json_object_get(o, "tokens");
    const char *nl;
    if (!json_is_object(o)) rc = kvm_err(KVM_EINVAL, "%s:%lld: not a JSON object", path, (long long)line);
    else if (!json_is_string(id) || json_string_length(id) == 0)
        rc = kvm_err(KVM_EINVAL, "%s:%lld: \"id\" must be a non-empty string", path, (long long)line);
    /* a line break in one went raw into every log line naming it (text logs keep line breaks, as
     * some messages hold several lines; other control bytes are written as \xHH) */
    else if ((nl = strchr(json_string_value(id), '\n')))
        rc = kvm_err(KVM_EINVAL,
                     "%s:%lld: \"id\" holds a line break (at byte %d): ids name documents in log lines, "
                     "CSV rows and the store; use one line",
                     path, (long long)line, (int)(nl - json_string_value(id)));
    else if ((tx != NULL) == (tk != NULL))
        rc = kvm_err(KVM_EINVAL, "%s:%lld: give exactly one of \"text\" and \"tokens\"", path, (long long)line);
    else if (tx && !json_is_string(tx))
        rc = kvm_err(KVM_EINVAL, "%s:%lld: \"text\" must be a string", path, (long long)line);
    else if (tk && !json_is_array(tk)) /* an empty one is an empty document, failed alone as "text": "" is */
        rc = kvm_err(KVM_EINVAL, "%s:%lld: \"tokens\" must be an array of token ids", path, (long long)line);
    if (!rc && !(d->name = strdup(json_string_value(id)))) rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
    if (!rc && tx) {
        d->text_len = json_string_length(tx);
        if ((d->text = malloc(d->text_len + 1))) memcpy(d->text, json_string_value(tx), d->text_len + 1);
        else rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
    }
    if (!rc && tk) {
        size_t n = json_array_size(tk);
        if (!(d->tokens = malloc((n ? n : 1) * sizeof *d->tokens))) rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
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

/* A JSONL id looked up among the documents read so far. */
typedef struct name_probe {
    const kvm_corpus *c;
    const char *name;
} name_probe;

static int same_name(void *user, int64_t idx)
{
    const name_probe *p = user;
    return !strcmp(p->c->docs[idx].name, p->name);
}

static int read_jsonl(const char *path, kvm_corpus *c)
{
    kvm_idxset names = {0}; /* ids seen: each line checked against all earlier ones was quadratic */
    FILE *f = open_regular(path, "r");
    if (!f)
        return kvm_err(errno == EINVAL ? KVM_EINVAL : KVM_EIO, "%s: %s", path,
                       errno == EINVAL ? "not a regular file (a FIFO, socket or device)" : strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    int64_t lineno = 0, dcap = 0;
    int rc = 0;
    ssize_t len;
    off_t at = 0;
    while (!rc && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        kvm_doc d = {.offset = (int64_t)at, .size = (int64_t)len};
        at += len;
        if (lineno == 1 && len >= 3 && !memcmp(line, "\xEF\xBB\xBF", 3)) { /* a UTF-8 byte-order mark: skipped */
            memmove(line, line + 3, (size_t)(len -= 3) + 1);
            d.offset += 3, d.size -= 3;
        }
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
        if (len == 0) continue;
        if ((rc = parse_line(path, lineno, line, &d)) == 0) {
            name_probe np = {c, d.name};
            if (kvm_idxset_find(&names, kvm_idxset_hash_str(d.name), same_name, &np) >= 0)
                rc = kvm_err(KVM_EINVAL, "%s:%lld: duplicate id \"%s\"", path, (long long)lineno, d.name);
            else rc = kvm_idxset_add(&names, kvm_idxset_hash_str(d.name), c->n); /* its index once pushed */
        }
        free(d.text); /* kept: where the line is; loaded again by kvm_corpus_load */
        free(d.tokens);
        d.text = NULL;
        d.tokens = NULL;
        d.n_tokens = 0;
        if (!rc) rc = push_doc(c, &dcap, d);
        if (rc) free(d.name);
    }
    free(line);
    fclose(f);
    kvm_idxset_free(&names);
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
    c->jsonl = !S_ISDIR(st.st_mode);
    if (!(c->path = strdup(path))) rc = kvm_err(KVM_ENOMEM, "corpus: out of memory");
    else if (S_ISDIR(st.st_mode)) rc = read_dir(path, c);
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
        free(c->docs[i].path);
        free(c->docs[i].text);
        free(c->docs[i].tokens);
    }
    free(c->docs);
    free(c->path);
    free(c);
    *pc = NULL;
}

/* "document NAME", or "the document" when it has no name. */
static const char *label(const kvm_doc *d, char *buf, size_t n)
{
    if (!d->name) return "the document";
    snprintf(buf, n, "document %s", d->name);
    return buf;
}

/* Text -> the first n_keep + 1 ids; *need_more when the text read so far is too short to say.
 * With a chat frame the text tokenised is frame + text, as one string (the template's text
 * and the document meet as the chat template renders them), BOS as the tokenizer adds it. */
static int prepare_text(kvm_doc *d, const kvm_tokenizer *tok, const char *frame, int at_end, int64_t n_keep,
                        int *need_more)
{
    char lb[300];
    free(d->tokens);
    d->tokens = NULL;
    d->n_tokens = 0;
    if (!tok) return kvm_err(KVM_EINVAL, "%s is text but no tokenizer was found for the model", label(d, lb, sizeof lb));
    if (frame && d->text_len == 0) return kvm_err(KVM_EINVAL, "%s is empty", label(d, lb, sizeof lb));
    const char *text = d->text;
    size_t len = d->text_len, fl = frame ? strlen(frame) : 0;
    char *framed = frame ? malloc(fl + len + 1) : NULL;
    if (frame && !framed) return kvm_err(KVM_ENOMEM, "corpus: out of memory");
    if (framed) {
        memcpy(framed, frame, fl);
        memcpy(framed + fl, d->text, len);
        framed[fl + len] = '\0';
        text = framed;
        len += fl;
    }
    int bos = frame ? kvm_tokenizer_add_bos(tok) : 1;
    int rc = kvm_doctok_encode(tok, text, len, at_end, bos, n_keep + 1, &d->tokens, &d->n_tokens, need_more);
    free(framed);
    if (rc) return kvm_err(rc, "%s: %s", label(d, lb, sizeof lb), kvm_errmsg());
    return 0;
}

/* Given tokens under a chat frame: [BOS when the tokenizer adds it] + the frame's ids + the
 * tokens (a leading BOS of theirs dropped). */
static int frame_tokens(kvm_doc *d, const kvm_tokenizer *tok, const char *frame, int32_t bos)
{
    char lb[300];
    if (!tok) return kvm_err(KVM_EINVAL, "%s: chat framing needs the model's tokenizer", label(d, lb, sizeof lb));
    int skip = d->n_tokens > 0 && d->tokens[0] == bos;
    if (d->n_tokens - skip < 1) return kvm_err(KVM_EINVAL, "%s is empty", label(d, lb, sizeof lb));
    int32_t *f = NULL;
    int64_t nf = 0;
    int rc = kvm_tokenizer_encode(tok, frame, strlen(frame), kvm_tokenizer_add_bos(tok), 0, &f, &nf);
    if (rc) return kvm_err(rc, "%s: chat frame: %s", label(d, lb, sizeof lb), kvm_errmsg());
    int64_t n = nf + d->n_tokens - skip;
    int32_t *t = malloc((size_t)n * sizeof *t);
    if (!t) {
        free(f);
        return kvm_err(KVM_ENOMEM, "corpus: out of memory");
    }
    memcpy(t, f, (size_t)nf * sizeof *t);
    memcpy(t + nf, d->tokens + skip, (size_t)(d->n_tokens - skip) * sizeof *t);
    free(f);
    free(d->tokens);
    d->tokens = t;
    d->n_tokens = n;
    return 0;
}

/* Checks given tokens (prepending BOS, or the chat frame), then truncates and hashes. */
static int finish(kvm_doc *d, int from_text, const kvm_tokenizer *tok, const char *frame, int vocab_size, int32_t bos,
                  int64_t n_ctx)
{
    char lb[300];
    if (!from_text) {
        for (int64_t i = 0; i < d->n_tokens; i++)
            if (d->tokens[i] >= vocab_size)
                return kvm_err(KVM_EINVAL, "%s: token %lld has id %d, outside the vocabulary of %d", label(d, lb, sizeof lb),
                               (long long)i, d->tokens[i], vocab_size);
        int rc = frame ? frame_tokens(d, tok, frame, bos) : 0;
        if (rc) return rc;
        if (!frame && (d->n_tokens == 0 || d->tokens[0] != bos)) {
            int32_t *t = realloc(d->tokens, (size_t)(d->n_tokens + 1) * sizeof *t);
            if (!t) return kvm_err(KVM_ENOMEM, "corpus: out of memory");
            memmove(t + 1, t, (size_t)d->n_tokens * sizeof *t);
            t[0] = bos;
            d->tokens = t;
            d->n_tokens++;
        }
    }
    if (d->n_tokens <= 1) return kvm_err(KVM_EINVAL, "%s is empty", label(d, lb, sizeof lb));
    d->n_original = d->n_tokens;
    d->truncated = d->n_tokens > n_ctx;
    if (d->truncated) d->n_tokens = n_ctx;
    return kvm_store_doc_hash(d->tokens, d->n_tokens, &d->hash);
}

int kvm_doc_prepare_n(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, const char *frame,
                      int64_t n_ctx, int64_t n_keep)
{
    if (n_keep < n_ctx) n_keep = n_ctx;
    int from_text = d->text != NULL;
    int rc = from_text ? prepare_text(d, tok, frame, 1, n_keep, NULL) : 0;
    return rc ? rc : finish(d, from_text, tok, frame, vocab_size, bos, n_ctx);
}

int kvm_doc_prepare_begin(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, const char *frame,
                          int64_t n_ctx, int64_t n_keep, int *need_more)
{
    *need_more = 0;
    if (n_keep < n_ctx) n_keep = n_ctx;
    if (!d->text) return kvm_err(KVM_EINVAL, "kvm_doc_prepare_begin: the document has no text");
    int rc = prepare_text(d, tok, frame, 0, n_keep, need_more);
    return rc || *need_more ? rc : finish(d, 1, tok, frame, vocab_size, bos, n_ctx);
}

int kvm_doc_prepare(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, int64_t n_ctx)
{
    return kvm_doc_prepare_n(d, tok, vocab_size, bos, NULL, n_ctx, n_ctx);
}

/* A folder document: read a growing beginning of the file until its ids settle. */
static int load_file(kvm_doc *d, const kvm_tokenizer *tok, const char *frame, int64_t n_keep)
{
    size_t max = (size_t)n_keep * 32 + 65536;
    const char *base = strrchr(d->path, '/');
    if (d->name_clash)
        return kvm_err(KVM_EINVAL,
                       "%s: its name, with the bytes that are not UTF-8 written %%HH, is another file's name in this "
                       "folder: two documents would be stored under one name; rename one of them",
                       d->name);
    if (strpbrk(base ? base : d->path, "\r\n")) /* d->name is escaped (read_dir) */
        return kvm_err(KVM_EINVAL,
                       "%s: the file name holds a line break: documents are named by their file names in log "
                       "lines, CSV rows and the store; rename it",
                       d->name);
    for (;;) {
        int at_end = 0, more = 0;
        free(d->text);
        if (!(d->text = read_prefix(d->path, max, &d->text_len, &at_end)))
            return kvm_err(KVM_EIO, "%s: cannot read: %s", d->path,
                       errno == EINVAL ? "not a regular file (a FIFO, socket or device)" : strerror(errno));
        int rc = prepare_text(d, tok, frame, at_end, n_keep, &more);
        if (rc || !more) return rc;
        max *= 2;
    }
}

/* A JSONL document: its line, read and parsed again. */
static int load_line(const kvm_corpus *c, kvm_doc *d)
{
    FILE *f = fopen(c->path, "rb");
    char *line = f ? malloc((size_t)d->size + 1) : NULL;
    int rc = 0;
    if (!line || fseeko(f, (off_t)d->offset, SEEK_SET) || fread(line, 1, (size_t)d->size, f) != (size_t)d->size)
        rc = kvm_err(KVM_EIO, "%s: cannot read the line of document %s again (was the file changed?)", c->path, d->name);
    if (f) fclose(f);
    if (rc) { free(line); return rc; }
    size_t len = (size_t)d->size;
    line[len] = '\0';
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
    kvm_doc tmp = {0};
    rc = parse_line(c->path, 0, line, &tmp);
    free(line);
    if (rc) { /* it said "FILE:0: invalid JSON ...": line 0, and not that the file had changed */
        char why[600];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        const char *at = strstr(why, ":0: ");
        rc = kvm_err(KVM_EIO, "%s: the line of document %s (at byte %lld) changed since the corpus was read: %s",
                     c->path, d->name, (long long)d->offset, at ? at + 4 : why);
    }
    if (!rc && strcmp(tmp.name, d->name))
        rc = kvm_err(KVM_EIO, "%s: the line of document %s changed since the corpus was read", c->path, d->name);
    free(tmp.name);
    if (rc) { free(tmp.text); free(tmp.tokens); return rc; }
    free(d->text);
    free(d->tokens);
    d->text = tmp.text, d->text_len = tmp.text_len;
    d->tokens = tmp.tokens, d->n_tokens = tmp.n_tokens;
    return 0;
}

int kvm_corpus_load(const kvm_corpus *c, kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos,
                    int64_t n_ctx, int64_t n_keep)
{
    if (n_keep < n_ctx) n_keep = n_ctx;
    int rc, from_text = 1;
    if (d->path) rc = load_file(d, tok, c->frame, n_keep);
    else if ((rc = load_line(c, d)) == 0 && (from_text = d->text != NULL))
        rc = prepare_text(d, tok, c->frame, 1, n_keep, NULL);
    if (!rc) rc = finish(d, from_text, tok, c->frame, vocab_size, bos, n_ctx);
    free(d->text);
    d->text = NULL;
    d->text_len = 0;
    if (rc) kvm_doc_release(d);
    return rc;
}

void kvm_doc_release(kvm_doc *d)
{
    free(d->text);
    free(d->tokens);
    d->text = NULL;
    d->text_len = 0;
    d->tokens = NULL;
}
