/* kvm_tokenizer.c: loads llama2.c tokenizer.bin files and encodes/decodes exactly as run.c
 * (commit 350e04fe) does. Encoding keeps run.c's merge order but finds each best pair with a
 * heap of cached adjacent-pair scores and a piece hash table instead of rebuilding strings and
 * bsearching the whole vocabulary on every pass. */
#include "model/kvm_tokenizer.h"
#include "model/kvm_gguf.h"
#include "model/kvm_tokenizer_bpe.h"
#include "model/kvm_tokenizer_json.h"

#include "common/kvm_error.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Which vocabulary format the handle holds; decides how encode and piece behave. */
enum kvm_tokenizer_kind {
    KVM_TOKENIZER_LLAMA2C = 1, /* llama2.c tokenizer.bin: SentencePiece BPE + byte fallback */
    KVM_TOKENIZER_GGUF_BPE = 2, /* GGUF tokenizer.ggml.model "gpt2" (byte-level BPE) or "llama"
                                   (SentencePiece BPE), as llama.cpp encodes them (kvm_tokenizer_bpe.c) */
};

/* Ids and limits fixed by the llama2.c format and run.c. */
enum {
    KVM_L2C_BOS = 1,           /* run.c: "\n<s>\n" */
    KVM_L2C_EOS = 2,           /* run.c: "\n</s>\n" */
    KVM_L2C_BYTE0 = 3,         /* byte-fallback id of byte b is b + 3 */
    KVM_L2C_MIN_VOCAB = 259,   /* 3 specials + 256 byte-fallback tokens */
};
#define KVM_TOK_MAX_FILE_BYTES ((int64_t)256 << 20) /* sanity cap on a tokenizer file */
#define KVM_TOK_MAX_TEXT_BYTES ((size_t)1 << 40)    /* encode refuses longer input */
#define KVM_L2C_MIN_MERGE_SCORE (-1e10f)            /* run.c's initial best_score */

/* Parts only the llama2.c format has. */
struct kvm_tokenizer_llama2c {
    int32_t max_token_length; /* header field: longest piece allowed, bytes */
    int32_t space_id;         /* id of the " " piece (dummy prefix), -1 if absent */
};

struct kvm_tokenizer {
    enum kvm_tokenizer_kind kind; /* format of this vocabulary */
    int32_t vocab_size;           /* number of ids */
    int32_t bos_id;               /* begin-of-sequence id */
    int32_t eos_id;               /* end-of-sequence id */
    char *piece_bytes;            /* every piece back to back, each followed by a NUL */
    int64_t *piece_off;           /* [vocab_size] offset of piece i in piece_bytes, bytes */
    int32_t *piece_len;           /* [vocab_size] length of piece i, bytes */
    float *score;                 /* [vocab_size] merge priority (higher merges first) */
    int16_t *raw_byte;            /* [vocab_size] byte of a "<0xXX>" piece, -1 otherwise */
    int32_t *lookup;              /* open-addressing hash, piece bytes -> lowest id, -1 empty */
    uint64_t lookup_mask;         /* slot count - 1 (slot count is a power of two) */
    int32_t max_piece_len;        /* longest piece actually present, bytes */
    unsigned char bytes[256];     /* bytes[b] == b: storage for decoded raw-byte pieces */
    struct kvm_tokenizer_llama2c llama2c; /* valid when kind == KVM_TOKENIZER_LLAMA2C */
    struct kvm_bpe *bpe;          /* the vocabulary when kind == KVM_TOKENIZER_GGUF_BPE */
    int add_bos;                  /* 1 when prompts start with BOS by default */
    char *chat_template;          /* GGUF tokenizer.chat_template (NUL-terminated), or NULL */
};

/* ---- file reading ---- */

static int32_t rd_i32le(const unsigned char *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                 (uint32_t)p[3] << 24;
    int32_t v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static float rd_f32le(const unsigned char *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                 (uint32_t)p[3] << 24;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Reads the whole regular file at path into a malloc'ed buffer (*buf, *size bytes). */
static int read_file(const char *path, unsigned char **buf, int64_t *size)
{
    int rc = KVM_OK;
    unsigned char *b = NULL;
    int64_t got = 0;
    struct stat st;
    *buf = NULL;
    *size = 0;

    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO: refused below, not waited on */
    if (fd < 0) {
        if (errno == ENOENT)
            return kvm_err(KVM_ENOTFOUND, "%s: tokenizer file not found", path);
        return kvm_err(KVM_EIO, "%s: cannot open tokenizer file: %s", path, strerror(errno));
    }
    if (fstat(fd, &st) != 0) {
        rc = kvm_err(KVM_EIO, "%s: fstat: %s", path, strerror(errno));
        goto fail;
    }
    if (S_ISDIR(st.st_mode)) {
        rc = kvm_err(KVM_EFORMAT, "%s: is a directory, expected a tokenizer file", path);
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = kvm_err(KVM_EFORMAT, "%s: not a regular file", path);
        goto fail;
    }
    if ((int64_t)st.st_size > KVM_TOK_MAX_FILE_BYTES) {
        rc = kvm_err(KVM_EFORMAT, "%s: %lld bytes, larger than any tokenizer (limit %lld)",
                     path, (long long)st.st_size, (long long)KVM_TOK_MAX_FILE_BYTES);
        goto fail;
    }
    b = malloc((size_t)st.st_size + 1);
    if (!b) {
        rc = kvm_err(KVM_ENOMEM, "%s: cannot allocate %lld bytes", path, (long long)st.st_size);
        goto fail;
    }
    while (got < (int64_t)st.st_size) {
        ssize_t r = read(fd, b + got, (size_t)((int64_t)st.st_size - got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            rc = kvm_err(KVM_EIO, "%s: read at offset %lld: %s", path, (long long)got,
                         strerror(errno));
            goto fail;
        }
        if (r == 0) break; /* shrank under us: parse what we have, it reports truncation */
        got += r;
    }
    close(fd);
    *buf = b;
    *size = got;
    return KVM_OK;
fail:
    free(b);
    close(fd);
    return rc;
}

/* 1 when b is a llama2.c model checkpoint: its 7 int32 header fields are plausible sizes that give
 * the file's length exactly (kvm__llama2c_load's layout). Such a file passed as the tokenizer
 * failed at a record with "piece length 265839806 exceeds max_token_length 64", which did not say
 * the file is no tokenizer. */
static int l2c_is_model(const unsigned char *b, int64_t size)
{
    if (size < 28) return 0;
    int32_t h[7];
    for (int i = 0; i < 7; i++)
        h[i] = rd_i32le(b + 4 * i);
    const int64_t dim = h[0], hid = h[1], L = h[2], nh = h[3], nkv = h[4], seq = h[6];
    const int64_t vocab = h[5] == INT32_MIN ? 0 : h[5] < 0 ? -(int64_t)h[5] : h[5];
    if (dim <= 0 || hid <= 0 || L <= 0 || nh <= 0 || nkv <= 0 || vocab <= 0 || seq <= 0 || dim % nh || nh % nkv)
        return 0;
    if (dim > 1 << 16 || hid > 1 << 20 || L > 1024 || vocab > 1 << 22 || seq > 1 << 24)
        return 0; /* no overflow below */
    const int64_t hd = dim / nh, kvd = nkv * hd;
    int64_t floats = vocab * dim + L * dim + L * dim * dim + 2 * L * kvd * dim + L * dim * dim + L * dim +
                     3 * L * hid * dim + dim + seq * hd;
    if (h[5] < 0) floats += vocab * dim; /* a separate classifier */
    return 28 + 4 * floats == size;
}

/* Checks the layout of a llama2.c tokenizer file without allocating anything, so a huge
 * vocab_size against a small file fails with a message, not an allocation. On success
 * *max_len is the header's max_token_length and *blob_bytes the sum of (len + 1). */
static int l2c_validate(const char *path, const unsigned char *b, int64_t size, int vocab_size,
                        int32_t *max_len, int64_t *blob_bytes)
{
    if (size < 4)
        return kvm_err(KVM_EFORMAT,
                       "%s: truncated inside max_token_length: file is %lld bytes, the int32 "
                       "header needs 4",
                       path, (long long)size);
    int32_t max = rd_i32le(b);
    if (max <= 0)
        return kvm_err(KVM_EFORMAT, "%s: max_token_length = %d at offset 0, must be > 0", path,
                       max);
    int64_t off = 4, blob = 0;
    for (int i = 0; i < vocab_size; i++) {
        if (off == size)
            return kvm_err(KVM_EFORMAT,
                           "%s: file ends after %d records but vocab_size is %d (record %d "
                           "missing; tokenizer from a smaller model?)",
                           path, i, vocab_size, i);
        if (size - off < 4)
            return kvm_err(KVM_EFORMAT,
                           "%s: record %d: truncated inside score (offset %lld, file is %lld "
                           "bytes)",
                           path, i, (long long)off, (long long)size);
        off += 4;
        if (size - off < 4)
            return kvm_err(KVM_EFORMAT,
                           "%s: record %d: truncated inside len (offset %lld, file is %lld "
                           "bytes)",
                           path, i, (long long)off, (long long)size);
        int32_t len = rd_i32le(b + off);
        if (len < 0)
            return kvm_err(KVM_EFORMAT, "%s: record %d: negative piece length %d at offset %lld",
                           path, i, len, (long long)off);
        if (len > max)
            return kvm_err(KVM_EFORMAT,
                           "%s: record %d: piece length %d exceeds max_token_length %d", path, i,
                           len, max);
        off += 4;
        if (size - off < len)
            return kvm_err(KVM_EFORMAT,
                           "%s: record %d: truncated inside piece bytes (len %d at offset %lld, "
                           "%lld bytes left)",
                           path, i, len, (long long)off, (long long)(size - off));
        off += len;
        blob += (int64_t)len + 1;
    }
    if (off != size)
        return kvm_err(KVM_EFORMAT,
                       "%s: %lld trailing bytes after record %d (offset %lld): the file holds "
                       "more than vocab_size = %d tokens, or is damaged",
                       path, (long long)(size - off), vocab_size - 1, (long long)off,
                       vocab_size);
    *max_len = max;
    *blob_bytes = blob;
    return KVM_OK;
}

/* ---- piece hash table (FNV-1a, linear probing) ---- */

static uint64_t fnv1a(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}
#define KVM_FNV_BASIS 14695981039346656037ull

/* Id of the piece equal to a (la bytes) followed by b (lb bytes), or -1. */
static int32_t lookup2(const kvm_tokenizer *t, const char *a, size_t la, const char *b,
                       size_t lb)
{
    if (la + lb > (size_t)t->max_piece_len) return -1;
    uint64_t slot = fnv1a(fnv1a(KVM_FNV_BASIS, a, la), b, lb) & t->lookup_mask;
    for (;; slot = (slot + 1) & t->lookup_mask) {
        int32_t id = t->lookup[slot];
        if (id < 0) return -1;
        const char *p = t->piece_bytes + t->piece_off[id];
        if ((size_t)t->piece_len[id] == la + lb && memcmp(p, a, la) == 0 &&
            memcmp(p + la, b, lb) == 0)
            return id;
    }
}

static int32_t lookup1(const kvm_tokenizer *t, const char *s, size_t n)
{
    return lookup2(t, s, n, "", 0);
}

static int build_lookup(kvm_tokenizer *t)
{
    uint64_t slots = 16;
    while (slots < 2 * (uint64_t)t->vocab_size) slots *= 2;
    t->lookup = malloc(slots * sizeof *t->lookup);
    if (!t->lookup) return kvm_err(KVM_ENOMEM, "tokenizer: cannot allocate the piece table");
    memset(t->lookup, 0xff, slots * sizeof *t->lookup); /* every slot -1 */
    t->lookup_mask = slots - 1;
    for (int32_t id = 0; id < t->vocab_size; id++) {
        const char *p = t->piece_bytes + t->piece_off[id];
        if (lookup1(t, p, (size_t)t->piece_len[id]) >= 0) continue; /* duplicate: keep lower */
        uint64_t slot = fnv1a(KVM_FNV_BASIS, p, (size_t)t->piece_len[id]) & t->lookup_mask;
        while (t->lookup[slot] >= 0) slot = (slot + 1) & t->lookup_mask;
        t->lookup[slot] = id;
    }
    return KVM_OK;
}

/* run.c decode's raw-byte test, kept as the same sscanf so odd pieces parse identically. */
static int parse_raw_byte(const char *piece)
{
    unsigned char byte_val;
    if (sscanf(piece, "<0x%02hhX>", &byte_val) == 1) return byte_val;
    return -1;
}

/* ---- open / close ---- */

int kvm_tokenizer_open_llama2c(const char *path, int vocab_size, kvm_tokenizer **out)
{
    unsigned char *file = NULL;
    int64_t size = 0;

    if (!out) return kvm_err(KVM_EINVAL, "kvm_tokenizer_open_llama2c: out is NULL");
    *out = NULL;
    if (!path) return kvm_err(KVM_EINVAL, "kvm_tokenizer_open_llama2c: path is NULL");
    if (vocab_size < KVM_L2C_MIN_VOCAB) /* the model's header sets it, not this file: said so */
        return kvm_err(KVM_EINVAL,
                       "tokenizer %s: the model's vocab_size %d is below the %d ids a llama2.c tokenizer has (unk, "
                       "BOS, EOS and 256 byte-fallback tokens): the model has another vocabulary",
                       path, vocab_size, KVM_L2C_MIN_VOCAB);
    int rc = read_file(path, &file, &size);
    if (rc == KVM_OK) rc = kvm__tokenizer_llama2c_mem(path, file, size, vocab_size, out);
    free(file);
    return rc;
}

int kvm__tokenizer_llama2c_mem(const char *path, const unsigned char *file, int64_t size, int vocab_size,
                               kvm_tokenizer **out)
{
    int rc;
    int64_t blob = 0;
    int32_t max_len = 0;
    kvm_tokenizer *t = NULL;

    if (!out) return kvm_err(KVM_EINVAL, "kvm_tokenizer_open_llama2c: out is NULL");
    *out = NULL;
    if (vocab_size < KVM_L2C_MIN_VOCAB)
        return kvm_err(KVM_EINVAL,
                       "tokenizer %s: the model's vocab_size %d is below the %d ids a llama2.c tokenizer has (unk, "
                       "BOS, EOS and 256 byte-fallback tokens): the model has another vocabulary",
                       path, vocab_size, KVM_L2C_MIN_VOCAB);
    if ((rc = l2c_validate(path, file, size, vocab_size, &max_len, &blob)) != KVM_OK) {
        if (size >= 4 && !memcmp(file, "GGUF", 4))
            rc = kvm_err(KVM_EFORMAT,
                         "%s: not a llama2.c tokenizer (a GGUF file: a GGUF model carries its own "
                         "tokenizer; give it as the model, with no tokenizer)",
                         path);
        else if (size >= 23 && !memcmp(file, "version https://git-lfs", 23)) /* a clone made without git-lfs */
            rc = kvm_err(KVM_EFORMAT,
                         "%s: a Git LFS pointer (%lld bytes), not the tokenizer itself: fetch the real file (git lfs "
                         "pull in the clone, or download it again)",
                         path, (long long)size);
        else if (size >= 1 && (file[0] == '<' || file[0] == '{'))
            rc = kvm_err(KVM_EFORMAT,
                         "%s: not a llama2.c tokenizer: a text file (HTML? JSON? a download that saved an error "
                         "page?); a tokenizer.json goes beside a Hugging Face model's config.json",
                         path);
        else if (l2c_is_model(file, size))
            rc = kvm_err(KVM_EFORMAT,
                         "%s: not a llama2.c tokenizer (a llama2.c model file: the header's "
                         "max_token_length is %d, the model's dim; give the tokenizer file, not the model)",
                         path, (int)rd_i32le(file));
        goto fail;
    }

    if (!(t = calloc(1, sizeof *t))) goto nomem;
    t->kind = KVM_TOKENIZER_LLAMA2C;
    t->vocab_size = vocab_size;
    t->bos_id = KVM_L2C_BOS;
    t->eos_id = KVM_L2C_EOS;
    t->add_bos = 1;
    t->llama2c.max_token_length = max_len;
    for (int i = 0; i < 256; i++) t->bytes[i] = (unsigned char)i;
    t->piece_bytes = malloc((size_t)blob);
    t->piece_off = malloc((size_t)vocab_size * sizeof *t->piece_off);
    t->piece_len = malloc((size_t)vocab_size * sizeof *t->piece_len);
    t->score = malloc((size_t)vocab_size * sizeof *t->score);
    t->raw_byte = malloc((size_t)vocab_size * sizeof *t->raw_byte);
    if (!t->piece_bytes || !t->piece_off || !t->piece_len || !t->score || !t->raw_byte)
        goto nomem;

    int64_t off = 4, at = 0;
    for (int32_t i = 0; i < vocab_size; i++) {
        t->score[i] = rd_f32le(file + off);
        int32_t len = rd_i32le(file + off + 4);
        off += 8;
        memcpy(t->piece_bytes + at, file + off, (size_t)len);
        t->piece_bytes[at + len] = '\0';
        t->piece_off[i] = at;
        t->piece_len[i] = len;
        t->raw_byte[i] = (int16_t)parse_raw_byte(t->piece_bytes + at);
        if (len > t->max_piece_len) t->max_piece_len = len;
        off += len;
        at += (int64_t)len + 1;
    }
    if ((rc = build_lookup(t)) != KVM_OK) goto fail;
    t->llama2c.space_id = lookup1(t, " ", 1);
    if (t->llama2c.space_id < 0) { /* else every non-empty encode fails, unnamed, much later */
        rc = kvm_err(KVM_EFORMAT,
                     "%s: no \" \" piece among the %d records: the llama2.c encoder needs it for the "
                     "dummy prefix it puts before the text",
                     path, vocab_size);
        goto fail;
    }
    *out = t;
    return KVM_OK;
nomem:
    rc = kvm_err(KVM_ENOMEM, "%s: cannot allocate the vocabulary (%d tokens)", path, vocab_size);
fail:
    kvm_tokenizer_close(&t);
    return rc;
}

void kvm_tokenizer_close(kvm_tokenizer **t)
{
    if (!t || !*t) return;
    kvm_tokenizer *p = *t;
    free(p->piece_bytes);
    free(p->piece_off);
    free(p->piece_len);
    free(p->score);
    free(p->raw_byte);
    free(p->lookup);
    kvm__bpe_free(&p->bpe);
    free(p->chat_template);
    free(p);
    *t = NULL;
}

/* ---- encode ---- */

/* A candidate merge of the adjacent tokens starting at node `left`, valid while node left
 * still holds left_id and its right neighbour still holds right_id. */
struct merge_cand {
    float score;      /* score of the merged piece */
    int32_t merged;   /* id of the merged piece */
    int32_t left_id;  /* id of the left token when pushed */
    int32_t right_id; /* id of the right token when pushed */
    int64_t left;     /* node index of the left token; nodes keep sequence order */
};

/* Scratch state of one encode call. */
struct merge_state {
    int32_t *id;             /* [n] token id per node, -1 once merged away */
    int64_t *prev, *next;    /* [n] neighbour nodes, -1 at the ends */
    struct merge_cand *heap; /* binary max-heap, best candidate at [0] */
    int64_t heap_n;          /* candidates in the heap */
    int64_t heap_cap;        /* capacity of heap, entries */
};

/* run.c's order: highest score first; among equal scores the leftmost pair, because run.c
 * scans left to right and only replaces its best on a strictly greater score. */
static int cand_before(const struct merge_cand *a, const struct merge_cand *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void heap_push(struct merge_state *s, struct merge_cand c)
{
    int64_t i = s->heap_n++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!cand_before(&c, &s->heap[parent])) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = c;
}

static struct merge_cand heap_pop(struct merge_state *s)
{
    struct merge_cand top = s->heap[0], last = s->heap[--s->heap_n];
    int64_t i = 0, n = s->heap_n;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && cand_before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!cand_before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n > 0) s->heap[i] = last;
    return top;
}

/* Pushes the merge of nodes left and right (adjacent) if their concatenation is a piece that
 * run.c would accept (score > -1e10; NaN never compares greater). */
static void push_pair(const kvm_tokenizer *t, struct merge_state *s, int64_t left, int64_t right)
{
    int32_t a = s->id[left], b = s->id[right];
    int32_t m = lookup2(t, t->piece_bytes + t->piece_off[a], (size_t)t->piece_len[a],
                        t->piece_bytes + t->piece_off[b], (size_t)t->piece_len[b]);
    if (m < 0 || !(t->score[m] > KVM_L2C_MIN_MERGE_SCORE)) return;
    struct merge_cand c = {t->score[m], m, a, b, left};
    heap_push(s, c);
}

/* Merges ids[0..*n) in place as run.c's merge loop does; *n shrinks. Each merge pushes at most
 * two new candidates, so n - 1 + 2 (n - 1) heap entries always suffice. */
static int merge_pairs(const kvm_tokenizer *t, int32_t *ids, int64_t *n)
{
    int64_t m = *n;
    if (m < 2) return KVM_OK;
    struct merge_state s = {0};
    s.id = ids;
    s.prev = malloc((size_t)m * sizeof *s.prev);
    s.next = malloc((size_t)m * sizeof *s.next);
    s.heap_cap = 3 * (m - 1);
    s.heap = malloc((size_t)s.heap_cap * sizeof *s.heap);
    int rc = KVM_OK;
    if (!s.prev || !s.next || !s.heap) {
        rc = kvm_err(KVM_ENOMEM, "tokenizer encode: cannot allocate merge state for %lld tokens",
                     (long long)m);
        goto fail;
    }
    for (int64_t i = 0; i < m; i++) {
        s.prev[i] = i - 1;
        s.next[i] = i + 1 < m ? i + 1 : -1;
    }
    for (int64_t i = 0; i + 1 < m; i++) push_pair(t, &s, i, i + 1);
    while (s.heap_n > 0) {
        struct merge_cand c = heap_pop(&s);
        int64_t left = c.left, right = s.next[left];
        if (s.id[left] != c.left_id || right < 0 || s.id[right] != c.right_id) continue; /* stale */
        s.id[left] = c.merged;
        s.id[right] = -1;
        s.next[left] = s.next[right];
        if (s.next[right] >= 0) s.prev[s.next[right]] = left;
        if (s.prev[left] >= 0) push_pair(t, &s, s.prev[left], left);
        if (s.next[left] >= 0) push_pair(t, &s, left, s.next[left]);
    }
    int64_t k = 0;
    for (int64_t i = 0; i < m; i++)
        if (ids[i] >= 0) ids[k++] = ids[i];
    *n = k;
fail:
    free(s.prev);
    free(s.next);
    free(s.heap);
    return rc;
}

int kvm_tokenizer_encode(const kvm_tokenizer *t, const char *text, size_t len, int add_bos,
                         int add_eos, int32_t **ids, int64_t *n_ids)
{
    int rc;
    int32_t *out = NULL;
    int64_t n = 0;

    if (!ids || !n_ids) return kvm_err(KVM_EINVAL, "kvm_tokenizer_encode: ids or n_ids is NULL");
    *ids = NULL;
    *n_ids = 0;
    if (!t) return kvm_err(KVM_EINVAL, "kvm_tokenizer_encode: tokenizer is NULL");
    if (!text && len > 0) return kvm_err(KVM_EINVAL, "kvm_tokenizer_encode: text is NULL");
    if (len > KVM_TOK_MAX_TEXT_BYTES)
        return kvm_err(KVM_ERANGE, "kvm_tokenizer_encode: %zu bytes of text, limit %zu", len,
                       KVM_TOK_MAX_TEXT_BYTES);
    if (t->kind == KVM_TOKENIZER_GGUF_BPE) {
        int32_t *body = NULL;
        int64_t m = 0;
        if ((rc = kvm__bpe_encode_new(t->bpe, text, len, &body, &m)) != KVM_OK) goto fail;
        if (!(out = malloc(((size_t)m + 2) * sizeof *out))) {
            free(body);
            rc = kvm_err(KVM_ENOMEM, "kvm_tokenizer_encode: cannot allocate ids for %zu bytes", len);
            goto fail;
        }
        if (add_bos) out[n++] = t->bos_id;
        if (m) memcpy(out + n, body, (size_t)m * sizeof *out);
        free(body);
        n += m;
        if (add_eos) out[n++] = t->eos_id;
        *ids = out;
        *n_ids = n;
        return KVM_OK;
    }
    if (len > 0 && t->llama2c.space_id < 0)
        return kvm_err(KVM_EFORMAT,
                       "kvm_tokenizer_encode: vocabulary has no \" \" piece for the dummy prefix");

    /* every byte yields at most one id, plus BOS, dummy prefix and EOS */
    out = malloc((len + 3) * sizeof *out);
    if (!out) {
        rc = kvm_err(KVM_ENOMEM, "kvm_tokenizer_encode: cannot allocate ids for %zu bytes", len);
        goto fail;
    }
    if (add_bos) out[n++] = t->bos_id;
    if (len > 0) out[n++] = t->llama2c.space_id;

    /* run.c's code point loop: a run of up to 4 bytes, started by any byte and extended by
     * continuation bytes (10xxxxxx), is looked up whole or else emitted byte by byte */
    char cp[4];
    size_t cp_len = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if ((c & 0xC0) != 0x80) cp_len = 0;
        cp[cp_len++] = (char)c;
        if (i + 1 < len && ((unsigned char)text[i + 1] & 0xC0) == 0x80 && cp_len < 4) continue;
        int32_t id = lookup1(t, cp, cp_len);
        if (id >= 0) {
            out[n++] = id;
        } else {
            for (size_t k = 0; k < cp_len; k++) out[n++] = (unsigned char)cp[k] + KVM_L2C_BYTE0;
        }
        cp_len = 0;
    }

    if ((rc = merge_pairs(t, out, &n)) != KVM_OK) goto fail;
    if (add_eos) out[n++] = t->eos_id;
    *ids = out;
    *n_ids = n;
    return KVM_OK;
fail:
    free(out);
    return rc;
}

/* ---- decode ---- */

const char *kvm_tokenizer_piece(const kvm_tokenizer *t, int32_t prev, int32_t id, size_t *len)
{
    if (len) *len = 0;
    if (!t || id < 0 || id >= t->vocab_size) return NULL;
    if (t->kind == KVM_TOKENIZER_GGUF_BPE) return kvm__bpe_piece(t->bpe, id, len);
    const char *p = t->piece_bytes + t->piece_off[id];
    size_t n = (size_t)t->piece_len[id];
    int raw = t->raw_byte[id];
    /* following BOS, SentencePiece strips the leading space (run.c, PR #89) */
    if (prev == t->bos_id && n > 0 && p[0] == ' ') {
        p++;
        n--;
        raw = parse_raw_byte(p); /* run.c tests the stripped piece */
    }
    if (raw >= 0) {
        p = (const char *)&t->bytes[raw];
        n = 1;
    }
    if (len) *len = n;
    return p;
}

int kvm_tokenizer_piece_printable(const char *piece, size_t len)
{
    if (!piece || len == 0 || piece[0] == '\0') return 0;
    if (len > 1 && piece[1] != '\0') return 1;
    unsigned char b = (unsigned char)piece[0];
    int printable = b >= 0x20 && b <= 0x7e;       /* isprint in the C locale */
    int space = b == ' ' || (b >= 0x09 && b <= 0x0d); /* isspace in the C locale */
    return printable || space;
}

int kvm_tokenizer_decode(const kvm_tokenizer *t, const int32_t *ids, int64_t n, char **text,
                         size_t *len)
{
    if (!text || !len) return kvm_err(KVM_EINVAL, "kvm_tokenizer_decode: text or len is NULL");
    *text = NULL;
    *len = 0;
    if (!t) return kvm_err(KVM_EINVAL, "kvm_tokenizer_decode: tokenizer is NULL");
    if (n < 0 || (n > 0 && !ids))
        return kvm_err(KVM_EINVAL, "kvm_tokenizer_decode: n = %lld, ids %s", (long long)n,
                       ids ? "set" : "NULL");
    size_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->vocab_size)
            return kvm_err(KVM_ERANGE, "kvm_tokenizer_decode: ids[%lld] = %d outside [0, %d)",
                           (long long)i, ids[i], t->vocab_size);
        size_t pn = 0;
        if (t->kind == KVM_TOKENIZER_GGUF_BPE) kvm__bpe_piece(t->bpe, ids[i], &pn);
        else pn = (size_t)t->piece_len[ids[i]];
        total += pn; /* an upper bound on the decoded bytes */
    }
    char *buf = malloc(total + 1);
    if (!buf)
        return kvm_err(KVM_ENOMEM, "kvm_tokenizer_decode: cannot allocate %zu bytes", total + 1);
    size_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        if (t->kind == KVM_TOKENIZER_LLAMA2C && (ids[i] == t->bos_id || ids[i] == t->eos_id)) continue;
        size_t pn;
        const char *p = kvm_tokenizer_piece(t, i > 0 ? ids[i - 1] : -1, ids[i], &pn);
        memcpy(buf + at, p, pn);
        at += pn;
    }
    buf[at] = '\0';
    *text = buf;
    *len = at;
    return KVM_OK;
}

int kvm_tokenizer_vocab_size(const kvm_tokenizer *t) { return t ? t->vocab_size : 0; }

int32_t kvm_tokenizer_bos(const kvm_tokenizer *t) { return t ? t->bos_id : -1; }

int32_t kvm_tokenizer_eos(const kvm_tokenizer *t) { return t ? t->eos_id : -1; }

/* ---- GGUF ---- */

int kvm_tokenizer_add_bos(const kvm_tokenizer *t) { return t ? t->add_bos : 0; }

const char *kvm_tokenizer_chat_template(const kvm_tokenizer *t) { return t ? t->chat_template : NULL; }

int32_t kvm_tokenizer_find(const kvm_tokenizer *t, const char *text)
{
    if (!t || !text) return -1;
    if (t->kind == KVM_TOKENIZER_GGUF_BPE) return kvm__bpe_find(t->bpe, text, strlen(text));
    return lookup1(t, text, strlen(text));
}

/* Fills t (kind GGUF_BPE) from a parsed GGUF file; spm: a "llama" (SentencePiece) vocabulary. */
static int open_gguf_bpe(kvm_tokenizer *t, const kvm_gguf *g, int spm)
{
    int rc = kvm__bpe_new(g, &t->bpe);
    if (rc) return rc;
    t->kind = KVM_TOKENIZER_GGUF_BPE;
    t->vocab_size = kvm__bpe_vocab_size(t->bpe);
    int64_t bos = -1, eos = -1;
    int add_bos = spm; /* llama.cpp's defaults without the key: SentencePiece yes, BPE no */
    if (((rc = kvm_gguf_get_i64(g, "tokenizer.ggml.bos_token_id", &bos)) && rc != KVM_ENOTFOUND) ||
        ((rc = kvm_gguf_get_i64(g, "tokenizer.ggml.eos_token_id", &eos)) && rc != KVM_ENOTFOUND))
        return rc; /* a string or float id was taken as absent */
    if (bos < -1 || bos >= t->vocab_size || eos < -1 || eos >= t->vocab_size)
        return kvm_err(KVM_EFORMAT, "%s: bos_token_id %lld / eos_token_id %lld outside the vocabulary [0, %d)",
                       kvm_gguf_name(g), (long long)bos, (long long)eos, t->vocab_size);
    if ((rc = kvm_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos)) && rc != KVM_ENOTFOUND) return rc;
    t->bos_id = (int32_t)bos;
    t->eos_id = (int32_t)eos;
    t->add_bos = add_bos && bos >= 0;
    return KVM_OK;
}

int kvm__tokenizer_gguf_mem(const char *path, const uint8_t *map, size_t bytes, kvm_tokenizer **out)
{
    *out = NULL;
    int rc;
    kvm_gguf *g = NULL;
    kvm_tokenizer *t = NULL;
    if ((rc = kvm_gguf_parse(path, map, bytes, &g)) != KVM_OK) goto fail;
    kvm_gguf_str model = {0}, tmpl = {0};
    if ((rc = kvm_gguf_get_str(g, "tokenizer.ggml.model", &model)) != KVM_OK) {
        if (rc == KVM_ENOTFOUND) rc = kvm_err(KVM_EFORMAT, "%s: no tokenizer (tokenizer.ggml.model is missing)", path);
        goto fail;
    }
    if (!(t = calloc(1, sizeof *t))) {
        rc = kvm_err(KVM_ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    if ((model.len == 4 && memcmp(model.ptr, "gpt2", 4) == 0) || (model.len == 5 && memcmp(model.ptr, "llama", 5) == 0)) {
        rc = open_gguf_bpe(t, g, model.len == 5);
    } else {
        rc = kvm_err(KVM_ENOTSUP, "%s: tokenizer.ggml.model '%.*s' is not supported (gpt2 and llama are)", path,
                     (int)(model.len > 64 ? 64 : model.len), model.ptr);
    }
    if (rc) goto fail;
    if ((rc = kvm_gguf_get_str(g, "tokenizer.chat_template", &tmpl)) && rc != KVM_ENOTFOUND)
        goto fail; /* not a string: --chat said the model has no template */
    rc = KVM_OK;
    if (tmpl.ptr && memchr(tmpl.ptr, '\0', tmpl.len)) { /* was cut there: the rest of the template lost unsaid */
        rc = kvm_err(KVM_EFORMAT, "%s: metadata 'tokenizer.chat_template' holds a NUL byte at offset %zu (of %llu)",
                     path, (size_t)((const char *)memchr(tmpl.ptr, '\0', tmpl.len) - (const char *)tmpl.ptr),
                     (unsigned long long)tmpl.len);
        goto fail;
    }
    if (tmpl.ptr) {
        if (!(t->chat_template = malloc(tmpl.len + 1))) {
            rc = kvm_err(KVM_ENOMEM, "%s: out of memory", path);
            goto fail;
        }
        memcpy(t->chat_template, tmpl.ptr, tmpl.len);
        t->chat_template[tmpl.len] = '\0';
    }
    kvm_gguf_free(&g);
    *out = t;
    return KVM_OK;
fail:
    kvm_tokenizer_close(&t);
    kvm_gguf_free(&g);
    return rc;
}

int kvm_tokenizer_open_gguf(const char *path, kvm_tokenizer **out)
{
    if (!out) return kvm_err(KVM_EINVAL, "kvm_tokenizer_open_gguf: out is NULL");
    *out = NULL;
    if (!path) return kvm_err(KVM_EINVAL, "kvm_tokenizer_open_gguf: path is NULL");
    int rc;
    void *map = MAP_FAILED;
    size_t bytes = 0;
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) {
        rc = kvm_err(KVM_EIO, "%s: not a non-empty regular file", path);
        goto fail;
    }
    bytes = (size_t)st.st_size;
    map = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        rc = kvm_err(KVM_EIO, "%s: mmap: %s", path, strerror(errno));
        goto fail;
    }
    rc = kvm__tokenizer_gguf_mem(path, map, bytes, out);
fail:
    if (map != MAP_FAILED) munmap(map, bytes);
    close(fd);
    return rc;
}

/* ---- Hugging Face tokenizer.json ---- */

int kvm_tokenizer_open_hf(const char *path, int min_vocab, kvm_tokenizer **out)
{
    if (!out) return kvm_err(KVM_EINVAL, "kvm_tokenizer_open_hf: out is NULL");
    *out = NULL;
    if (!path) return kvm_err(KVM_EINVAL, "kvm_tokenizer_open_hf: path is NULL");
    kvm_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    kvm_tokjson_info info;
    int rc = kvm__tokjson_open(path, min_vocab, &t->bpe, &info);
    if (rc) {
        free(t);
        return rc;
    }
    t->kind = KVM_TOKENIZER_GGUF_BPE;
    t->vocab_size = kvm__bpe_vocab_size(t->bpe);
    t->bos_id = info.bos_id;
    t->eos_id = info.eos_id;
    t->add_bos = info.add_bos && info.bos_id >= 0;
    t->chat_template = info.chat_template;
    *out = t;
    return KVM_OK;
}
