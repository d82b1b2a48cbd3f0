/* kvm_safetensors.c: safetensors files mapped read-only and their JSON headers checked
 * entry by entry (dtype, shape, offsets inside the data section, no overlaps or holes), as
 * the reference Rust reader does, so a loader can trust every tensor's bytes. */
#include "model/kvm_safetensors.h"
#include "model/kvm_gguf.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define KVM_ST_MAX_HEADER ((uint64_t)100 << 20) /* the Rust reader's limit */

typedef struct st_file {
    char *path;          /* as opened */
    const uint8_t *map;  /* read-only mapping */
    size_t bytes;        /* file size */
    const uint8_t *data; /* first byte after the header */
    uint64_t data_bytes; /* bytes of the data section */
    int borrowed;        /* 1: map is the caller's memory (kvm_st_open_mem), not ours to unmap */
} st_file;

struct kvm_st {
    st_file *files;
    int n_files;
    kvm_st_tensor *t; /* [n_t] */
    int64_t n_t, cap_t;
    int64_t *hash; /* open addressing over names -> index into t, -1 empty */
    uint64_t hash_mask;
};

const char *kvm_st_dtype_name(kvm_st_dtype t) { return t == KVM_ST_F32 ? "F32" : t == KVM_ST_F16 ? "F16" : "BF16"; }
int kvm_st_dtype_size(kvm_st_dtype t) { return t == KVM_ST_F32 ? 4 : 2; }

void kvm_st_to_f32(kvm_st_dtype t, const uint8_t *src, float *dst, int64_t n)
{
    if (t == KVM_ST_F32) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        uint16_t h = (uint16_t)(src[2 * i] | src[2 * i + 1] << 8);
        dst[i] = t == KVM_ST_F16 ? kvm_fp16_to_f32(h) : kvm_bf16_to_f32(h);
    }
}

static int check_size(const char *path, long long bytes)
{
    if (bytes < 8)
        return kvm_err(KVM_EFORMAT, "%s: %lld bytes: too short for a safetensors header length", path, bytes);
    return 0;
}

static int map_file(const char *path, st_file *f)
{
    struct stat st;
    int rc = kvm_file_check_found(path);
    if (rc) return rc;
    if (stat(path, &st) != 0) return kvm_err(KVM_EIO, "%s: %s", path, strerror(errno));
    rc = check_size(path, (long long)st.st_size);
    if (rc) return rc;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvm_err(KVM_EIO, "%s: %s", path, strerror(errno));
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return kvm_err(KVM_EIO, "%s: mmap: %s", path, strerror(errno));
    f->map = p;
    f->bytes = (size_t)st.st_size;
    return 0;
}

static int parse_dtype(const char *file, const char *name, const char *s, kvm_st_dtype *out)
{
    if (strcmp(s, "F32") == 0) *out = KVM_ST_F32;
    else if (strcmp(s, "F16") == 0) *out = KVM_ST_F16;
    else if (strcmp(s, "BF16") == 0) *out = KVM_ST_BF16;
    else
        return kvm_err(KVM_ENOTSUP, "%s: tensor '%s': dtype '%.16s' is not supported (F32, F16, BF16 are)", file,
                       name, s);
    return 0;
}

/* A JSON integer in [0, max], else an error naming the field. */
static int json_u64(const char *file, const char *name, const char *what, const json_t *v, uint64_t max,
                    uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0 || (uint64_t)json_integer_value(v) > max)
        return kvm_err(KVM_EFORMAT, "%s: tensor '%s': %s must be an integer in [0, %llu]", file, name, what,
                       (unsigned long long)max);
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

/* No safetensors file is near 2^48 bytes (256 TiB): an offset past that is no truncated download but a corrupt
 * header, and saying "cut short" would send the user to download again for nothing. */
#define KVM_ST_PLAUSIBLE_BYTES (1ull << 48)

/* Tensor `name`'s data_offsets [b, e] end past f's data section: a download that stopped part way, the usual cause,
 * unless an offset is beyond any real file's size. */
static int offsets_past_end(const st_file *f, const char *name, uint64_t b, uint64_t e)
{
    if (b > KVM_ST_PLAUSIBLE_BYTES || e > KVM_ST_PLAUSIBLE_BYTES)
        return kvm_err(KVM_EFORMAT,
                       "%s: tensor '%s': data_offsets [%llu, %llu] lie beyond any plausible file size (2^48 bytes; "
                       "the data section holds %llu): the header's offsets are corrupt",
                       f->path, name, (unsigned long long)b, (unsigned long long)e, (unsigned long long)f->data_bytes);
    return kvm_err(KVM_EFORMAT,
                   "%s: tensor '%s': data_offsets [%llu, %llu] end past the data section's %llu "
                   "bytes: the file is cut short (an unfinished download?)",
                   f->path, name, (unsigned long long)b, (unsigned long long)e, (unsigned long long)f->data_bytes);
}

/* One header entry {"dtype", "shape", "data_offsets"} into t (offsets not yet range-checked
 * against neighbours). */
static int parse_entry(const st_file *f, const char *name, const json_t *v, kvm_st_tensor *t)
{
    const char *p = f->path;
    if (!json_is_object(v)) return kvm_err(KVM_EFORMAT, "%s: tensor '%s': header entry is not an object", p, name);
    const json_t *dt = json_object_get(v, "dtype"), *sh = json_object_get(v, "shape"),
                 *off = json_object_get(v, "data_offsets");
    if (!json_is_string(dt)) return kvm_err(KVM_EFORMAT, "%s: tensor '%s': 'dtype' is missing or not a string", p, name);
    if (!json_is_array(sh)) return kvm_err(KVM_EFORMAT, "%s: tensor '%s': 'shape' is missing or not an array", p, name);
    if (!json_is_array(off) || json_array_size(off) != 2)
        return kvm_err(KVM_EFORMAT, "%s: tensor '%s': 'data_offsets' must be an array [begin, end]", p, name);
    if (json_object_size(v) != 3)
        return kvm_err(KVM_EFORMAT, "%s: tensor '%s': entry has keys other than dtype, shape, data_offsets", p, name);
    int rc = parse_dtype(p, name, json_string_value(dt), &t->dtype);
    if (rc) return rc;
    size_t nd = json_array_size(sh);
    if (nd > KVM_ST_MAX_DIMS)
        return kvm_err(KVM_ENOTSUP, "%s: tensor '%s': %zu dimensions (at most %d)", p, name, nd, KVM_ST_MAX_DIMS);
    t->n_dims = (int)nd;
    uint64_t n = 1, b, e;
    for (int i = 0; i < KVM_ST_MAX_DIMS; i++) {
        uint64_t d = 1;
        if ((size_t)i < nd && (rc = json_u64(p, name, "shape entries", json_array_get(sh, (size_t)i), 1ull << 40, &d)))
            return rc;
        t->shape[i] = (int64_t)d;
        if (d && n > (1ull << 48) / d)
            return kvm_err(KVM_EFORMAT, "%s: tensor '%s': more than 2^48 elements", p, name);
        n *= d;
    }
    if ((rc = json_u64(p, name, "data_offsets[0]", json_array_get(off, 0), UINT64_MAX >> 1, &b)) ||
        (rc = json_u64(p, name, "data_offsets[1]", json_array_get(off, 1), UINT64_MAX >> 1, &e)))
        return rc;
    if (b > f->data_bytes || e > f->data_bytes) return offsets_past_end(f, name, b, e);
    if (e < b) return kvm_err(KVM_EFORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] end before they begin", p, name,
                              (unsigned long long)b, (unsigned long long)e);
    t->n_elems = (int64_t)n;
    t->bytes = n * (uint64_t)kvm_st_dtype_size(t->dtype);
    if (e - b != t->bytes)
        return kvm_err(KVM_EFORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, %s shape needs %llu", p,
                       name, (unsigned long long)b, (unsigned long long)e, (unsigned long long)(e - b),
                       kvm_st_dtype_name(t->dtype), (unsigned long long)t->bytes);
    t->data = f->data + b;
    return 0;
}

static int push_tensor(kvm_st *s, const kvm_st_tensor *t)
{
    if (s->n_t == s->cap_t) {
        int64_t cap = s->cap_t ? 2 * s->cap_t : 64;
        kvm_st_tensor *v = realloc(s->t, (size_t)cap * sizeof *v);
        if (!v) return kvm_err(KVM_ENOMEM, "safetensors: out of memory");
        s->t = v;
        s->cap_t = cap;
    }
    s->t[s->n_t++] = *t;
    return 0;
}

/* By [begin, end), as the Rust reader sorts: a tensor of no elements sharing its begin with
 * the next one comes first, not after it as an "overlap" when the header lists it later. */
static int cmp_data(const void *a, const void *b)
{
    const kvm_st_tensor *x = a, *y = b;
    if (x->data != y->data) return (x->data > y->data) - (x->data < y->data);
    return (x->bytes > y->bytes) - (x->bytes < y->bytes);
}

/* Checks that the file's tensors [first, s->n_t) tile its data section: sorted by offset,
 * each starting where the previous ended, the last ending at the section's end. */
static int check_tiling(const kvm_st *s, const st_file *f, int64_t first)
{
    if (s->n_t > first) /* a header without tensors leaves s->t NULL: qsort(NULL, 0) is undefined */
        qsort(s->t + first, (size_t)(s->n_t - first), sizeof *s->t, cmp_data);
    const uint8_t *at = f->data;
    for (int64_t i = first; i < s->n_t; i++) {
        const kvm_st_tensor *t = &s->t[i];
        if (t->data < at)
            return kvm_err(KVM_EFORMAT, "%s: tensor '%s' at data offset %llu overlaps '%s'", f->path, t->name,
                           (unsigned long long)(t->data - f->data), s->t[i - 1].name);
        if (t->data > at)
            return kvm_err(KVM_EFORMAT, "%s: tensor '%s' at data offset %llu leaves a hole of %llu bytes before it",
                           f->path, t->name, (unsigned long long)(t->data - f->data),
                           (unsigned long long)(t->data - at));
        at = t->data + t->bytes;
    }
    if (at != f->data + f->data_bytes)
        return kvm_err(KVM_EFORMAT, "%s: %llu bytes after the last tensor are not described by the header", f->path,
                       (unsigned long long)(f->data + f->data_bytes - at));
    return 0;
}

/* Parses file index fi's header, appending its tensors to s. */
static int parse_file(kvm_st *s, int fi)
{
    st_file *f = &s->files[fi];
    static const char lfs[] = "version https://git-lfs"; /* a clone made without git-lfs */
    if (f->bytes >= sizeof lfs - 1 && memcmp(f->map, lfs, sizeof lfs - 1) == 0)
        return kvm_err(KVM_EFORMAT,
                       "%s: a Git LFS pointer (%zu bytes), not the tensors themselves: fetch the real files (git lfs "
                       "pull in the clone, or download them again)",
                       f->path, f->bytes);
    uint64_t n = 0;
    for (int k = 7; k >= 0; k--)
        n = n << 8 | f->map[k];
    if (n < 2 || n > f->bytes - 8 || n > KVM_ST_MAX_HEADER)
        return kvm_err(KVM_EFORMAT, "%s: header length %llu is outside [2, %llu] (file of %zu bytes%s)", f->path,
                       (unsigned long long)n,
                       (unsigned long long)(f->bytes - 8 < KVM_ST_MAX_HEADER ? f->bytes - 8 : KVM_ST_MAX_HEADER),
                       f->bytes, n > f->bytes - 8 && n <= KVM_ST_MAX_HEADER ? ": cut short?" : "");
    f->data = f->map + 8 + n;
    f->data_bytes = f->bytes - 8 - n;
    json_error_t je;
    json_t *h = json_loadb((const char *)f->map + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
    if (!h) return kvm_err(KVM_EFORMAT, "%s: header JSON: %s (line %d, column %d)", f->path, je.text, je.line, je.column);
    int rc = 0;
    int64_t first = s->n_t;
    if (!json_is_object(h)) rc = kvm_err(KVM_EFORMAT, "%s: header JSON is not an object", f->path);
    const char *key;
    json_t *v;
    json_object_foreach(h, key, v)
    {
        if (rc) break;
        if (strcmp(key, "__metadata__") == 0) {
            const char *mk;
            json_t *mv;
            if (!json_is_object(v)) rc = kvm_err(KVM_EFORMAT, "%s: '__metadata__' is not an object", f->path);
            json_object_foreach(v, mk, mv) if (!rc && !json_is_string(mv)) rc =
                kvm_err(KVM_EFORMAT, "%s: '__metadata__' key '%s' is not a string", f->path, mk);
            continue;
        }
        kvm_st_tensor t = {.file = fi};
        if (!(t.name = strdup(key))) rc = kvm_err(KVM_ENOMEM, "safetensors: out of memory");
        if (!rc) rc = parse_entry(f, key, v, &t);
        if (!rc) rc = push_tensor(s, &t);
        if (rc) free((char *)t.name);
    }
    json_decref(h);
    return rc ? rc : check_tiling(s, f, first);
}

static uint64_t name_hash(const char *z)
{
    uint64_t h = 14695981039346656037ull;
    for (; *z; z++)
        h = (h ^ (unsigned char)*z) * 1099511628211ull;
    return h;
}

/* Builds the name index; a name seen twice (across files) is an error. */
static int build_index(kvm_st *s)
{
    uint64_t slots = 16;
    while (slots < 2 * (uint64_t)s->n_t)
        slots *= 2;
    s->hash_mask = slots - 1;
    if (!(s->hash = malloc(slots * sizeof *s->hash))) return kvm_err(KVM_ENOMEM, "safetensors: out of memory");
    memset(s->hash, 0xff, slots * sizeof *s->hash);
    for (int64_t i = 0; i < s->n_t; i++) {
        uint64_t slot = name_hash(s->t[i].name) & s->hash_mask;
        for (; s->hash[slot] >= 0; slot = (slot + 1) & s->hash_mask) {
            const kvm_st_tensor *o = &s->t[s->hash[slot]];
            if (strcmp(o->name, s->t[i].name) == 0)
                return kvm_err(KVM_EFORMAT, "%s: tensor '%s' is also in %s", s->files[s->t[i].file].path,
                               s->t[i].name, s->files[o->file].path);
        }
        s->hash[slot] = i;
    }
    return 0;
}

static kvm_st *st_new(int n_files)
{
    kvm_st *s = calloc(1, sizeof *s);
    if (!s || !(s->files = calloc((size_t)n_files, sizeof *s->files))) {
        free(s);
        kvm_err(KVM_ENOMEM, "safetensors: out of memory");
        return NULL;
    }
    return s;
}

int kvm_st_open_files(const char *const *paths, int n, kvm_st **out)
{
    *out = NULL;
    if (n < 1 || n > KVM_ST_MAX_FILES) return kvm_err(KVM_EINVAL, "safetensors: %d files (1..%d)", n, KVM_ST_MAX_FILES);
    kvm_st *s = st_new(n);
    if (!s) return KVM_ENOMEM;
    int rc = 0;
    for (int i = 0; !rc && i < n; i++) {
        s->n_files = i + 1;
        if (!(s->files[i].path = strdup(paths[i]))) rc = kvm_err(KVM_ENOMEM, "safetensors: out of memory");
        if (!rc) rc = map_file(paths[i], &s->files[i]);
        if (!rc) rc = parse_file(s, i);
    }
    if (!rc) rc = build_index(s);
    if (rc) {
        kvm_st_close(&s);
        return rc;
    }
    *out = s;
    return 0;
}

int kvm_st_open_mem(const char *name, const uint8_t *buf, size_t bytes, kvm_st **out)
{
    *out = NULL;
    kvm_st *s = st_new(1);
    if (!s) return KVM_ENOMEM;
    s->n_files = 1;
    s->files[0].borrowed = 1;
    int rc = (s->files[0].path = strdup(name)) ? check_size(name, (long long)bytes)
                                                : kvm_err(KVM_ENOMEM, "safetensors: out of memory");
    if (!rc) {
        s->files[0].map = buf;
        s->files[0].bytes = bytes;
        rc = parse_file(s, 0);
    }
    if (!rc) rc = build_index(s);
    if (rc) {
        kvm_st_close(&s);
        return rc;
    }
    *out = s;
    return 0;
}

void kvm_st_close(kvm_st **ps)
{
    if (!ps || !*ps) return;
    kvm_st *s = *ps;
    for (int i = 0; i < s->n_files; i++) {
        if (s->files[i].map && !s->files[i].borrowed) munmap((void *)s->files[i].map, s->files[i].bytes);
        free(s->files[i].path);
    }
    for (int64_t i = 0; i < s->n_t; i++)
        free((char *)s->t[i].name);
    free(s->files);
    free(s->t);
    free(s->hash);
    free(s);
    *ps = NULL;
}

int64_t kvm_st_n_tensors(const kvm_st *s) { return s->n_t; }
const kvm_st_tensor *kvm_st_tensor_at(const kvm_st *s, int64_t i) { return i >= 0 && i < s->n_t ? &s->t[i] : NULL; }
int kvm_st_n_files(const kvm_st *s) { return s->n_files; }
const char *kvm_st_file_path(const kvm_st *s, int i) { return i >= 0 && i < s->n_files ? s->files[i].path : NULL; }

const kvm_st_tensor *kvm_st_find(const kvm_st *s, const char *name)
{
    for (uint64_t slot = name_hash(name) & s->hash_mask;; slot = (slot + 1) & s->hash_mask) {
        int64_t i = s->hash[slot];
        if (i < 0) return NULL;
        if (strcmp(s->t[i].name, name) == 0) return &s->t[i];
    }
}

void kvm_st_release(const kvm_st *s, const kvm_st_tensor *t)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)t->data, b = a + t->bytes;
    uintptr_t lo = (a + page - 1) & ~(page - 1), hi = b & ~(page - 1);
    if (s->files[t->file].borrowed) return; /* the caller's memory: dropping its pages would zero them */
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}
