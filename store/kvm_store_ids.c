/* kvm_store_ids.c: the 32-byte ids (BLAKE2b-256 via libsodium), their hex form, and the
 * model-id memo that spares re-hashing a multi-GB checkpoint whose (path, size, mtime, ctime,
 * inode) did not change. */
#include "store/kvm_store_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "model/kvm_hf.h"

#define KVM_STORE__FILE_FIXED 72 /* u64 size, i64 mtime ns, u64 inode, u64 device, i64 ctime ns, id */
#define KVM_STORE__FILE_STAT                                                                                           \
    40 /* the bytes compared: all but the id (a 64-byte record of an older                                             \
          build, without ctime, is a miss: hashed again and rewritten) */

void kvm_store_hash_bytes(const void *data, size_t n, kvm_store_id *out)
{
    crypto_generichash(out->b, KVM_STORE_ID_BYTES, n ? data : NULL, n, NULL, 0);
}

int kvm_store_doc_hash(const int32_t *tokens, int64_t n_tokens, kvm_store_id *out)
{
    if (n_tokens < 0 || (!tokens && n_tokens > 0))
        return kvm_err(KVM_EINVAL, "doc hash: bad token array (n_tokens %lld)", (long long)n_tokens);
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KVM_STORE_ID_BYTES);
    uint8_t buf[4096];
    int64_t i = 0;
    while (i < n_tokens) {
        size_t m = 0;
        for (; m + 4 <= sizeof buf && i < n_tokens; i++, m += 4) kvm_store__put_u32(buf + m, (uint32_t)tokens[i]);
        crypto_generichash_update(&h, buf, m);
    }
    crypto_generichash_final(&h, out->b, KVM_STORE_ID_BYTES);
    return 0;
}

/* Feeds the bytes of file `path` into h. */
static int hash_into(crypto_generichash_state *h, const char *path)
{
    /* O_NONBLOCK: a FIFO without a writer is refused below, not waited on */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0) return kvm_err(KVM_EIO, "hash %s: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) { /* /dev/zero was read for ever */
        close(fd);
        return kvm_err(KVM_EINVAL, "hash %s: not a regular file (a device, FIFO or socket)", path);
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return kvm_err(KVM_ENOMEM, "hash %s: out of memory", path);
    }
    size_t cap = 1 << 20;
    uint8_t *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return kvm_err(KVM_ENOMEM, "hash %s: out of memory", path);
    }
    size_t r;
    while ((r = fread(buf, 1, cap, f)) > 0) crypto_generichash_update(h, buf, r);
    int bad = ferror(f);
    free(buf);
    fclose(f);
    if (bad) return kvm_err(KVM_EIO, "hash %s: read error", path);
    return 0;
}

int kvm_store_hash_file(const char *path, kvm_store_id *out)
{
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, KVM_STORE_ID_BYTES);
    int rc;
    if (kvm_hf_is_folder(path)) { /* a Hugging Face folder: config.json, then the weights in index order */
        char **files;
        int n;
        if ((rc = kvm_hf_model_files(path, &files, &n))) return rc;
        for (int i = 0; i < n; i++) {
            if (!rc) rc = hash_into(&h, files[i]);
            free(files[i]);
        }
        free(files);
    } else {
        rc = hash_into(&h, path);
    }
    if (rc) return rc;
    crypto_generichash_final(&h, out->b, KVM_STORE_ID_BYTES);
    return 0;
}

char *kvm_store_id_hex(const kvm_store_id *id, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < KVM_STORE_ID_BYTES; i++) {
        out[2 * i] = digits[id->b[i] >> 4];
        out[2 * i + 1] = digits[id->b[i] & 15];
    }
    out[KVM_STORE_ID_HEX] = '\0';
    return out;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int kvm_store_id_parse(const char *hex, kvm_store_id *out)
{
    if (!hex || strlen(hex) != KVM_STORE_ID_HEX)
        return kvm_err(KVM_EINVAL, "id '%s': expected %d hex digits", hex ? hex : "(null)", KVM_STORE_ID_HEX);
    for (int i = 0; i < KVM_STORE_ID_BYTES; i++) {
        int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) return kvm_err(KVM_EINVAL, "id '%s': '%c' is not a hex digit", hex, hi < 0 ? hex[2 * i] : hex[2 * i + 1]);
        out->b[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

int kvm_store_id_has_prefix(const kvm_store_id *id, const char *prefix)
{
    size_t n = strlen(prefix);
    if (n > KVM_STORE_ID_HEX) return 0;
    for (size_t i = 0; i < n; i++) {
        int v = hex_value(prefix[i]);
        int d = i % 2 == 0 ? id->b[i / 2] >> 4 : id->b[i / 2] & 15;
        if (v != d) return 0;
    }
    return 1;
}

/* What the memo remembers about a file. */
typedef struct file_memo {
    const char *abs;  /* absolute path */
    struct stat st;   /* size, mtime, inode, device, ctime when hashed */
    kvm_store_id key; /* BLAKE2b(abs) */
    kvm_store_id id;  /* the model id */
} file_memo;

static void memo_fixed(const file_memo *f, uint8_t out[KVM_STORE__FILE_FIXED])
{
    kvm_store__put_u64(out, (uint64_t)f->st.st_size);
    kvm_store__put_u64(out + 8, (uint64_t)f->st.st_mtim.tv_sec * 1000000000ull + (uint64_t)f->st.st_mtim.tv_nsec);
    kvm_store__put_u64(out + 16, (uint64_t)f->st.st_ino);
    kvm_store__put_u64(out + 24, (uint64_t)f->st.st_dev);
    /* ctime too: a checkpoint rewritten in place at its size with its mtime set back (cp -p,
     * touch -r, an rsync that keeps times) kept the old id, and caches of the old weights were
     * served as current; no write leaves ctime as it was */
    kvm_store__put_u64(out + 32, (uint64_t)f->st.st_ctim.tv_sec * 1000000000ull + (uint64_t)f->st.st_ctim.tv_nsec);
    memcpy(out + KVM_STORE__FILE_STAT, f->id.b, KVM_STORE_ID_BYTES);
}

/* Looks the file up; *hit = 1 and f->id set when the remembered record still matches. */
static int memo_lookup(kvm_store *s, file_memo *f, int *hit)
{
    *hit = 0;
    MDB_txn *txn;
    int st = kvm_store__read_begin(s, &txn);
    if (st) return st;
    MDB_val key = {KVM_STORE_ID_BYTES, f->key.b}, val;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_FILES], &key, &val);
    uint32_t np;
    if (rc == 0 && kvm_store__rec_check(&key, &val, KVM_STORE__KIND_FILE, &np, "model id memo") == 0 && np == 2) {
        kvm_frame parts[2];
        kvm_store__rec_parts(&val, parts, 2);
        uint8_t want[KVM_STORE__FILE_FIXED];
        memo_fixed(f, want); /* only the stat bytes: size, mtime, inode, device, ctime are compared */
        if (parts[0].size == KVM_STORE__FILE_FIXED && memcmp(want, parts[0].data, KVM_STORE__FILE_STAT) == 0 &&
            parts[1].size == strlen(f->abs) && memcmp(parts[1].data, f->abs, parts[1].size) == 0) {
            memcpy(f->id.b, parts[0].data + KVM_STORE__FILE_STAT, KVM_STORE_ID_BYTES);
            *hit = 1;
        }
    } else if (rc != 0 && rc != MDB_NOTFOUND) {
        st = kvm_store__mdb(s, rc, "model id memo");
    }
    mdb_txn_abort(txn);
    return st;
}

static int memo_put_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    const file_memo *f = arg;
    uint8_t fixed[KVM_STORE__FILE_FIXED];
    memo_fixed(f, fixed);
    kvm_frame parts[2] = {{fixed, sizeof fixed}, {(const uint8_t *)f->abs, strlen(f->abs)}};
    MDB_val key = {KVM_STORE_ID_BYTES, (void *)f->key.b};
    int rc = kvm_store__rec_put(txn, s->dbi[KVM_STORE__DB_FILES], &key, KVM_STORE__KIND_FILE, parts, 2);
    return rc ? kvm_store__mdb(s, rc, "model id memo") : 0;
}

static int same_file(const struct stat *a, const struct stat *b)
{
    return a->st_size == b->st_size && a->st_mtim.tv_sec == b->st_mtim.tv_sec &&
           a->st_mtim.tv_nsec == b->st_mtim.tv_nsec && a->st_ino == b->st_ino && a->st_dev == b->st_dev &&
           a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

int kvm_store_model_id(kvm_store *s, const char *path, kvm_store_id *out)
{
    char abs[PATH_MAX];
    if (!path || !realpath(path, abs)) return kvm_err(KVM_EIO, "model id %s: %s", path ? path : "(null)", strerror(errno));
    file_memo f = {.abs = abs};
    if (stat(abs, &f.st) != 0) return kvm_err(KVM_EIO, "model id %s: %s", abs, strerror(errno));
    /* a folder's mtime does not change when a weight file is rewritten: no memo for folders */
    if (S_ISDIR(f.st.st_mode)) return kvm_store_hash_file(abs, out);
    kvm_store_hash_bytes(abs, strlen(abs), &f.key);
    int hit = 0;
    int st = kvm_store__lock(s);
    if (st) return st;
    st = memo_lookup(s, &f, &hit);
    kvm_store__unlock(s);
    if (st) return st;
    if (hit) {
        *out = f.id;
        return 0;
    }
    st = kvm_store_hash_file(abs, &f.id); /* unlocked: may take minutes for a big model */
    if (st) return st;
    *out = f.id;
    struct stat after;
    if (s->read_only || stat(abs, &after) != 0 || !same_file(&after, &f.st)) return 0; /* changed: don't remember */
    st = kvm_store__lock(s);
    if (st) return st;
    st = kvm_store__write(s, memo_put_fn, &f);
    kvm_store__unlock(s);
    return st;
}
