/* cmd_eval_docs.c: document lists and loading shared by `kvmill eval` and `kvmill calibrate`. */
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "common/kvm_number.h"
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"
#include "pipeline/kvm_docdedup.h"
#include "pipeline/kvm_doctok.h"
#include "pipeline/kvm_idxset.h"
#include "store/kvm_store.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int add_doc(cmd_eval_docset *d, const char *path)
{
    char **p = realloc(d->paths, (size_t)(d->n + 1) * sizeof *p);
    if (!p) return 1;
    d->paths = p;
    char **nm = realloc(d->names, (size_t)(d->n + 1) * sizeof *nm);
    if (!nm) return 1;
    d->names = nm;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t bl = strlen(base);
    if (bl > 4 && strcmp(base + bl - 4, ".txt") == 0) bl -= 4;
    d->paths[d->n] = strdup(path);
    d->names[d->n] = strndup(base, bl);
    if (!d->paths[d->n] || !d->names[d->n]) {
        free(d->paths[d->n]);
        free(d->names[d->n]);
        return 1;
    }
    d->n++;
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Adds the *.txt files of a folder, sorted. */
static int add_dir(const char *cmd, cmd_eval_docset *d, const char *dir)
{
    DIR *dp = opendir(dir);
    if (!dp) {
        fprintf(stderr, "kvmill %s: --docs %s: %s\n", cmd, dir, strerror(errno));
        return 2;
    }
    char **names = NULL;
    int n = 0, rc = 0;
    struct dirent *e;
    while ((e = readdir(dp))) {
        size_t l = strlen(e->d_name);
        if (l < 5 || strcmp(e->d_name + l - 4, ".txt") != 0) continue;
        char **nn = realloc(names, (size_t)(n + 1) * sizeof *nn);
        if (!nn || !(nn[n] = strdup(e->d_name))) {
            names = nn ? nn : names;
            rc = 1;
            break;
        }
        names = nn;
        n++;
    }
    closedir(dp);
    if (!rc && n > 0) qsort(names, (size_t)n, sizeof *names, cmp_str);
    for (int i = 0; !rc && i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        struct stat st; /* a FIFO named *.txt would block the read until a writer came */
        if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
            fprintf(stderr, "kvmill %s: --docs %s: %s: not a regular file (a FIFO, socket, device or folder)\n", cmd,
                    dir, names[i]);
            rc = 2;
        } else
            rc = add_doc(d, path);
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (rc == 1) fprintf(stderr, "kvmill %s: out of memory\n", cmd);
    return rc;
}

/* A file's identity, looked up among the documents' (kvm_idxset over (device, inode)). */
typedef struct file_id {
    dev_t dev;
    ino_t ino;
} file_id;

typedef struct file_probe {
    const file_id *ids; /* [n] each document's */
    file_id want;
} file_probe;

static int same_file_id(void *user, int64_t idx)
{
    const file_probe *p = user;
    return p->ids[idx].dev == p->want.dev && p->ids[idx].ino == p->want.ino;
}

/* One file twice in d (a folder and one of its files, two links to it): it counted twice in the
 * mean. Each path is stat'ed once and its (device, inode) looked up in a hash set: comparing
 * every pair stat'ed each path once per other path, 70 s of stat calls for 12,000 documents
 * before any work (quadratic; 100,000: hours). Returns 0; 2 after naming the first repeat (the
 * earlier path first); 1 when out of memory (said). A path that does not stat is skipped here
 * (reading it says why). */
static int same_file_twice(const char *cmd, const char *spec, const cmd_eval_docset *d)
{
    file_id *ids = calloc((size_t)d->n + 1, sizeof *ids);
    kvm_idxset seen = {0};
    int rc = ids ? 0 : 1;
    for (int i = 0; !rc && i < d->n; i++) {
        struct stat st;
        if (stat(d->paths[i], &st)) continue;
        ids[i] = (file_id){st.st_dev, st.st_ino};
        const uint64_t key = ((uint64_t)st.st_dev * 0x9E3779B97F4A7C15ull) ^ (uint64_t)st.st_ino;
        file_probe p = {ids, ids[i]};
        const int64_t j = kvm_idxset_find(&seen, key, same_file_id, &p);
        if (j >= 0) {
            fprintf(stderr,
                    "kvmill %s: --docs %s: %s and %s are the same document, which would count twice in the mean; "
                    "name it once\n",
                    cmd, spec, d->paths[j], d->paths[i]);
            rc = 2;
        } else if (kvm_idxset_add(&seen, key, i))
            rc = 1;
    }
    if (rc == 1) fprintf(stderr, "kvmill %s: out of memory\n", cmd);
    kvm_idxset_free(&seen);
    free(ids);
    return rc;
}

/* The last k components of path without its ".txt" (k = 1: the file's name), or the whole
 * path when it has fewer. malloc'ed; NULL when out of memory. */
static char *path_suffix(const char *path, int k)
{
    size_t len = strlen(path), at;
    if (len > 4 && !strcmp(path + len - 4, ".txt")) len -= 4;
    for (at = len; at > 0; at--)
        if (path[at - 1] == '/' && --k == 0) break;
    return strndup(path + at, len - at);
}

typedef struct named {
    char *name;      /* a candidate name, owned */
    int doc;         /* its document */
    int shared_next; /* 1 when the next one (sorted) has the same name */
} named;

static int cmp_named(const void *a, const void *b)
{
    return strcmp(((const named *)a)->name, ((const named *)b)->name);
}

/* Renames the n documents idx[] that share one name: each gets its path's shortest suffix (in
 * whole components) that no other of them shares at that length. Suffixes of distinct files end
 * distinct at the latest when they become whole paths. Returns 0 or 1 (out of memory). */
static int rename_group(cmd_eval_docset *d, const int *idx, int n)
{
    named *c = calloc((size_t)n, sizeof *c);
    int left = n, rc = c ? 0 : 1;
    for (int i = 0; c && i < n; i++)
        c[i].doc = idx[i];
    for (int k = 2; !rc && left > 0; k++) {
        for (int i = 0; i < left && !rc; i++)
            if (!(c[i].name = path_suffix(d->paths[c[i].doc], k))) rc = 1;
        if (rc) break;
        qsort(c, (size_t)left, sizeof *c, cmp_named);
        for (int i = 0; i < left; i++) /* shared with the next one: marked before any is moved */
            c[i].shared_next = i + 1 < left && !strcmp(c[i].name, c[i + 1].name);
        int kept = 0;
        for (int i = 0; i < left; i++) {
            if ((c[i].shared_next || (i > 0 && c[i - 1].shared_next)) && k < 4096) {
                free(c[i].name); /* still ambiguous: one component more next round */
                c[kept].doc = c[i].doc, c[kept].shared_next = c[i].shared_next, c[kept++].name = NULL;
                continue;
            }
            free(d->names[c[i].doc]);
            d->names[c[i].doc] = c[i].name;
        }
        left = kept;
    }
    for (int i = 0; c && rc && i < left; i++)
        free(c[i].name);
    free(c);
    return rc;
}

/* Names that collide (a/doc.txt and b/doc.txt were both "doc": one name for two rows of --csv's
 * doc column and two "== doc" headings) become the shortest path suffixes that tell them apart
 * ("a/doc", "b/doc"); a name no other document has is kept as it was. Returns 0 or 1 (out of
 * memory). */
static int distinct_names(cmd_eval_docset *d)
{
    named *byname = calloc((size_t)d->n + 1, sizeof *byname);
    int *group = calloc((size_t)d->n + 1, sizeof *group), rc = byname && group ? 0 : 1;
    for (int i = 0; !rc && i < d->n; i++)
        byname[i] = (named){d->names[i], i, 0}; /* names borrowed */
    if (!rc) qsort(byname, (size_t)d->n, sizeof *byname, cmp_named);
    for (int i = 0; !rc && i < d->n;) {
        int j = i;
        while (j < d->n && !strcmp(byname[j].name, byname[i].name))
            group[j - i] = byname[j].doc, j++;
        if (j - i > 1) rc = rename_group(d, group, j - i); /* renames after the group was read whole */
        i = j;
    }
    free(byname);
    free(group);
    return rc;
}

/* 1 when path names a .jsonl file, the corpus format kvmill run reads (kvm_corpus_read). */
static int is_jsonl(const char *path)
{
    size_t l = strlen(path);
    return l > 6 && !strcmp(path + l - 6, ".jsonl");
}

/* Adds --docs item t (a folder's *.txt or a file) of the value spec. A path that does not stat,
 * where spec was split at its commas, says so: the user may have meant a name holding one.
 * Returns 0, 2 (bad item) or 1 (out of memory) after saying why. */
static int add_item(const char *cmd, cmd_eval_docset *out, const char *t, const char *spec)
{
    struct stat st;
    if (stat(t, &st) != 0) {
        if (strcmp(t, spec))
            fprintf(stderr,
                    "kvmill %s: --docs %s: %s (--docs '%s' was read as a comma-separated list: no file or "
                    "folder has that whole name)\n",
                    cmd, t, strerror(errno), spec);
        else
            fprintf(stderr, "kvmill %s: --docs %s: %s\n", cmd, t, strerror(errno));
        return 2;
    }
    if (S_ISDIR(st.st_mode)) return add_dir(cmd, out, t);
    if (!S_ISREG(st.st_mode)) { /* a pipe's second read (after the length check) found it empty */
        fprintf(stderr,
                "kvmill %s: --docs %s: not a regular file (a FIFO, such as the shell's <(...), a socket or a "
                "device): %s reads each document more than once; save it to a file and name that\n",
                cmd, t, cmd);
        return 2;
    }
    if (is_jsonl(t)) { /* read as one text, the JSON syntax and all, it was evaluated silently */
        fprintf(stderr,
                "kvmill %s: --docs %s: a JSONL corpus (one document per line, as kvmill run --corpus reads it) is not "
                "read by %s, which takes text files: write each document to a .txt file in a folder and name the "
                "folder\n",
                cmd, t, cmd);
        return 2;
    }
    if (add_doc(out, t)) {
        fprintf(stderr, "kvmill %s: out of memory\n", cmd);
        return 1;
    }
    return 0;
}

/* Adds the items of the comma-separated list spec. Returns as add_item. */
static int add_list(const char *cmd, cmd_eval_docset *out, const char *spec)
{
    if (kvm_cli_list_check(cmd, "docs", spec, 0) < 0) return 2;
    char *s = strdup(spec), *save = NULL;
    if (!s) return 1;
    int rc = 0;
    for (char *t = strtok_r(s, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save))
        rc = add_item(cmd, out, t, spec);
    free(s);
    return rc;
}

int cmd_eval_docs_list(const char *cmd, const char *spec, cmd_eval_docset *out)
{
    memset(out, 0, sizeof *out);
    /* a file or folder whose name holds a comma ("notes, 2024.txt") is taken whole: split, it
     * was refused with the cut path; only a value naming nothing whole is a list */
    int rc = kvm_cli_path_exists(spec) ? add_item(cmd, out, spec, spec) : add_list(cmd, out, spec);
    if (!rc) rc = same_file_twice(cmd, spec, out);
    if (!rc && distinct_names(out)) {
        fprintf(stderr, "kvmill %s: out of memory\n", cmd);
        rc = 1;
    }
    if (!rc && out->n == 0) {
        fprintf(stderr, "kvmill %s: --docs %s: no documents (*.txt)\n", cmd, spec);
        rc = 2;
    }
    if (rc) cmd_eval_docs_free(out);
    return rc;
}

void cmd_eval_docs_free(cmd_eval_docset *d)
{
    for (int i = 0; i < d->n; i++) {
        free(d->paths[i]);
        free(d->names[i]);
    }
    free(d->paths);
    free(d->names);
    memset(d, 0, sizeof *d);
}

/* Tokenises the document read so far (text[0, n), eof: all of it): with n_want > 0 only as
 * far as its first n_want ids need (kvm_doctok_encode; *more = 1: read more text first). */
static int encode_read(const kvm_tokenizer *tok, const char *text, size_t n, int eof, int bos, int64_t n_want,
                       int32_t **ids, int64_t *n_ids, int *more)
{
    *more = 0;
    if (n_want > 0) return kvm_doctok_encode(tok, text, n, eof, bos, n_want, ids, n_ids, more);
    if (!eof) return *more = 1, 0;
    return kvm_tokenizer_encode(tok, text, n, bos, 0, ids, n_ids);
}

int cmd_eval_docs_encode(const char *cmd, const kvm_tokenizer *tok, const char *frame, const char *path,
                         int64_t n_want, int32_t **ids_out, int64_t *n_out)
{
    size_t fl = frame ? strlen(frame) : 0;
    *ids_out = NULL;
    *n_out = 0;
    FILE *f;
    int ost = kvm_file_open_input(path, "rb", "document", &f); /* a folder: named, not "read error" */
    if (ost) { /* the user named a file that is not there or not a file: usage */
        fprintf(stderr, "kvmill %s: %s\n", cmd, kvm_errmsg());
        return 2;
    }
    const int bos = frame ? kvm_tokenizer_add_bos(tok) : 1;
    size_t cap = (1 << 16) + fl, n = fl;
    char *text = malloc(cap);
    if (text && fl) memcpy(text, frame, fl); /* frame + document, one string */
    int rc = 0, more = 1, err = 0, oom = !text;
    while (!oom && more) { /* a 200 MB document with n_want ids reads and tokenises only what they need */
        n += fread(text + n, 1, cap - n, f);
        const int eof = n < cap;
        if ((err = eof && ferror(f))) break;
        if ((rc = encode_read(tok, text, n, eof, bos, n_want, ids_out, n_out, &more)) || !more) break;
        char *t = realloc(text, cap *= 2);
        if (!t) oom = 1;
        else text = t;
    }
    fclose(f);
    free(text);
    if (oom || err) {
        fprintf(stderr, "kvmill %s: %s: %s\n", cmd, path, err ? "read error" : "out of memory");
        free(*ids_out);
        *ids_out = NULL;
        return 1;
    }
    if (rc) {
        fprintf(stderr, "kvmill %s: %s: %s\n", cmd, path, kvm_errmsg());
        return 1;
    }
    return 0;
}

/* An empty document read as its BOS alone, said as "1 token, fewer than context ...". Named empty
 * and refused, as every document too short to evaluate is (kvmill run fails an empty document,
 * the others going on; here the mean would quietly be over fewer documents). 1 when said. */
static int say_empty(const char *cmd, const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != 0) return 0;
    fprintf(stderr, "kvmill %s: --docs %s: the document is empty (0 bytes), as kvmill run fails it; leave it out\n",
            cmd, path);
    return 1;
}

int cmd_eval_docs_check(const char *cmd, const kvm_tokenizer *tok, const char *frame, const cmd_eval_docset *ds,
                        int64_t n_want, int64_t n_min, const char *need)
{
    for (int d = 0; d < ds->n; d++) {
        if (say_empty(cmd, ds->paths[d])) return 2;
        int32_t *ids = NULL;
        int64_t n = 0;
        int rc = cmd_eval_docs_encode(cmd, tok, frame, ds->paths[d], n_want, &ids, &n);
        free(ids);
        if (rc) return rc;
        if (n < n_min) {
            fprintf(stderr,
                    "kvmill %s: --docs %s: %lld token%s, fewer than %s; lower them, or leave the document out\n", cmd,
                    ds->paths[d], (long long)n, kvm_plural(n, "", "s"), need);
            return 2;
        }
    }
    return 0;
}

int cmd_eval_docs_dedup(const char *cmd, const kvm_tokenizer *tok, const char *frame, cmd_eval_docset *ds,
                        int64_t n_want, const char *action)
{
    kvm_store_id *hash = calloc((size_t)ds->n, sizeof *hash);
    int64_t *dup_of = calloc((size_t)ds->n, sizeof *dup_of);
    int rc = hash && dup_of ? 0 : kvm_err(KVM_ENOMEM, "out of memory"), erc = 0;
    for (int i = 0; rc == 0 && !erc && i < ds->n; i++) {
        int32_t *ids = NULL;
        int64_t n = 0;
        erc = cmd_eval_docs_encode(cmd, tok, frame, ds->paths[i], n_want, &ids, &n); /* says why itself */
        if (!erc) rc = kvm_store_doc_hash(ids, n, &hash[i]);
        free(ids);
    }
    if (rc == 0 && !erc &&
        kvm_docdedup_find(cmd, action, hash, (const char *const *)ds->paths, ds->n, stderr, dup_of) < 0)
        rc = kvm_err(KVM_ENOMEM, "out of memory");
    int kept = 0;
    for (int i = 0; rc == 0 && !erc && i < ds->n; i++) {
        if (dup_of[i] >= 0) {
            free(ds->paths[i]);
            free(ds->names[i]);
            continue;
        }
        ds->paths[kept] = ds->paths[i];
        ds->names[kept++] = ds->names[i];
    }
    if (rc == 0 && !erc) ds->n = kept;
    free(hash);
    free(dup_of);
    if (rc) fprintf(stderr, "kvmill %s: %s\n", cmd, kvm_cli_errmsg(cmd));
    return erc ? erc : rc ? 1 : 0;
}

/* Says on stderr, once per document, when its n_windows windows of w tokens overlap (the
 * document has fewer than n_windows·w tokens): the calibration then counts the shared tokens
 * once per window, and its windows are not the independent samples --windows suggests. */
static void note_overlap(const char *cmd, const char *path, int64_t n_ids, int64_t w, int n_windows)
{
    if (n_ids >= w * n_windows) return;
    const int64_t stride = (n_ids - w) / (n_windows - 1);
    fprintf(stderr,
            "kvmill %s: note: %s: %lld tokens hold %lld windows of %lld tokens (context + continuation) without "
            "overlap; its %d windows start about %lld tokens apart and overlap\n",
            cmd, path, (long long)n_ids, (long long)(n_ids / w), (long long)w, n_windows, (long long)stride);
}

int cmd_eval_docs_load(const char *cmd, const kvm_model *m, const kvm_kernels *k, const kvm_tokenizer *tok,
                       const char *frame, const char *path, int64_t n_ctx, int64_t n_cont, int window, int n_windows,
                       kvm_eval_doc **out)
{
    *out = NULL;
    int32_t *ids = NULL;
    int64_t n_ids = 0;
    /* one window: its N + T tokens; several spread over the document: all of it */
    int erc = cmd_eval_docs_encode(cmd, tok, frame, path, n_windows > 1 ? 0 : n_ctx + n_cont, &ids, &n_ids);
    if (erc) return erc; /* 2: the path does not open (usage), as sculpt says it */
    int rc = 0;
    if (n_ids < n_ctx + n_cont)
        rc = kvm_err(KVM_EINVAL, "%s: %lld tokens, fewer than context %lld + continuation %lld", path, (long long)n_ids,
                     (long long)n_ctx, (long long)n_cont);
    int64_t off = 0;
    if (!rc && n_windows > 1) { /* evenly spaced windows; a window after the start begins with BOS */
        off = (int64_t)window * (n_ids - (n_ctx + n_cont)) / (n_windows - 1);
        if (off > 0) ids[off] = m->cfg.bos_id;
        if (window == 0) note_overlap(cmd, path, n_ids, n_ctx + n_cont, n_windows);
    }
    if (!rc) rc = kvm_eval_doc_new(m, k, ids + off, n_ctx + n_cont, n_ctx, n_cont, out);
    free(ids);
    int32_t *rp = NULL; /* query_source repeat: KVzip's instruction, in the chat turn under a frame */
    int64_t n_rp = 0;
    if (!rc) rc = kvm_sculpt_repeat_prompt(tok, frame != NULL, &rp, &n_rp);
    if (!rc) rc = kvm_eval_doc_set_repeat_prompt(*out, rp, n_rp);
    free(rp);
    if (rc) kvm_eval_doc_free(out);
    if (rc) {
        fprintf(stderr, "kvmill %s: %s\n", cmd, kvm_cli_errmsg(cmd));
        return 1;
    }
    return 0;
}

int cmd_eval_lengths(const char *cmd, const char *ctx, const char *cont, int64_t *n_ctx, int64_t *n_cont)
{
    *n_ctx = 384;
    *n_cont = 64;
    if (ctx && kvm_cli_int(cmd, "context", ctx, 1, 1 << 20, n_ctx)) return 2;
    if (cont && kvm_cli_int(cmd, "continuation", cont, 2, 1 << 20, n_cont)) return 2;
    return 0;
}
