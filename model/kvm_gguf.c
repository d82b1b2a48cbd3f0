/* kvm_gguf.c: GGUF v2/v3 parsing with every count, length and offset checked against the
 * mapping before it is used, and the loop over ggml's block dequantisers (ggml-quants.c
 * dequantize_row_*: same layout and arithmetic, so values match ggml bit for bit up to FMA
 * contraction), whose per-element bodies kernels/kvm_quant_body.h shares with the CUDA upload. */
#include "model/kvm_gguf.h"
#include "common/kvm_error.h"
#include "kernels/kvm_quant_body.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVM_GGUF_MAX_DEPTH 8                  /* array nesting limit */
#define KVM_GGUF_MAX_ELEMS ((int64_t)1 << 48) /* elements per tensor limit */
#define KVM_GGUF_DEFAULT_ALIGN 32

struct kvm_gguf {
    char *name;               /* file name for messages, owned */
    const uint8_t *map;       /* borrowed mapping */
    size_t bytes;             /* its size */
    uint32_t version;         /* 2 or 3 */
    int64_t n_kv;             /* metadata entries */
    kvm_gguf_kv *kv;          /* [n_kv] */
    int64_t n_tensors;        /* tensor infos */
    kvm_gguf_tensor *tensors; /* [n_tensors] */
    uint64_t alignment;       /* general.alignment or 32 */
    uint64_t data_off;        /* start of the data section, bytes from the file start */
};

/* A cursor over the mapping; every read checks the bytes left first. */
typedef struct rd {
    const uint8_t *p;
    size_t size, off;
    const char *name;
} rd;

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static size_t left(const rd *r) { return r->size - r->off; }

static int need(rd *r, uint64_t n, const char *what)
{
    if (n > left(r))
        return kvm_err(KVM_EFORMAT, "%s: truncated: %s needs %llu bytes at offset %zu, %zu left", r->name, what,
                       (unsigned long long)n, r->off, left(r));
    return 0;
}

static int rd_u32(rd *r, uint32_t *v, const char *what)
{
    int rc = need(r, 4, what);
    if (rc) return rc;
    *v = kvm_qb_le32(r->p + r->off);
    r->off += 4;
    return 0;
}

static int rd_u64(rd *r, uint64_t *v, const char *what)
{
    int rc = need(r, 8, what);
    if (rc) return rc;
    *v = le64(r->p + r->off);
    r->off += 8;
    return 0;
}

static int rd_str(rd *r, kvm_gguf_str *s, const char *what)
{
    uint64_t len;
    int rc = rd_u64(r, &len, what);
    if (rc) return rc;
    if (len > left(r))
        return kvm_err(KVM_EFORMAT, "%s: %s: string length %llu beyond the file (offset %zu, %zu bytes left)", r->name,
                       what, (unsigned long long)len, r->off - 8, left(r));
    s->ptr = (const char *)(r->p + r->off);
    s->len = len;
    r->off += len;
    return 0;
}

static int64_t scalar_bytes(uint32_t t)
{
    switch (t) {
    case KVM_GGUF_U8:
    case KVM_GGUF_I8:
    case KVM_GGUF_BOOL:
        return 1;
    case KVM_GGUF_U16:
    case KVM_GGUF_I16:
        return 2;
    case KVM_GGUF_U32:
    case KVM_GGUF_I32:
    case KVM_GGUF_F32:
        return 4;
    case KVM_GGUF_U64:
    case KVM_GGUF_I64:
    case KVM_GGUF_F64:
        return 8;
    default:
        return 0;
    }
}

/* Skips (validating) one value of type t; `what` names the key for messages. */
static int skip_value(rd *r, uint32_t t, int depth, const char *what)
{
    int64_t sb = scalar_bytes(t);
    if (sb) return need(r, (uint64_t)sb, what) ? KVM_EFORMAT : (r->off += (size_t)sb, 0);
    if (t == KVM_GGUF_STRING) {
        kvm_gguf_str s;
        return rd_str(r, &s, what);
    }
    if (t != KVM_GGUF_ARRAY)
        return kvm_err(KVM_EFORMAT, "%s: %s: unknown value type %u at offset %zu", r->name, what, t, r->off);
    if (depth >= KVM_GGUF_MAX_DEPTH)
        return kvm_err(KVM_EFORMAT, "%s: %s: arrays nested deeper than %d", r->name, what, KVM_GGUF_MAX_DEPTH);
    uint32_t et;
    uint64_t n;
    int rc;
    if ((rc = rd_u32(r, &et, what)) || (rc = rd_u64(r, &n, what))) return rc;
    int64_t eb = scalar_bytes(et);
    uint64_t min_elem = eb ? (uint64_t)eb : et == KVM_GGUF_STRING ? 8 : et == KVM_GGUF_ARRAY ? 12 : 0;
    if (!min_elem)
        return kvm_err(KVM_EFORMAT, "%s: %s: unknown array element type %u at offset %zu", r->name, what, et,
                       r->off - 12);
    if (n > left(r) / min_elem)
        return kvm_err(KVM_EFORMAT, "%s: %s: array count %llu beyond the file (offset %zu, %zu bytes left)", r->name,
                       what, (unsigned long long)n, r->off - 8, left(r));
    if (eb) {
        r->off += (size_t)(n * (uint64_t)eb);
        return 0;
    }
    for (uint64_t i = 0; i < n; i++)
        if ((rc = skip_value(r, et, depth + 1, what))) return rc;
    return 0;
}

static void decode_scalar(kvm_gguf_kv *kv)
{
    const uint8_t *p = kv->data;
    switch (kv->type) {
    case KVM_GGUF_U8:
    case KVM_GGUF_BOOL:
        kv->v.u = p[0];
        break;
    case KVM_GGUF_I8:
        kv->v.i = (int8_t)p[0];
        break;
    case KVM_GGUF_U16:
        kv->v.u = kvm_qb_le16(p);
        break;
    case KVM_GGUF_I16:
        kv->v.i = (int16_t)kvm_qb_le16(p);
        break;
    case KVM_GGUF_U32:
        kv->v.u = kvm_qb_le32(p);
        break;
    case KVM_GGUF_I32:
        kv->v.i = (int32_t)kvm_qb_le32(p);
        break;
    case KVM_GGUF_U64:
        kv->v.u = le64(p);
        break;
    case KVM_GGUF_I64:
        kv->v.i = (int64_t)le64(p);
        break;
    case KVM_GGUF_F32: {
        uint32_t u = kvm_qb_le32(p);
        float f;
        memcpy(&f, &u, 4);
        kv->v.f = f;
        break;
    }
    case KVM_GGUF_F64: {
        uint64_t u = le64(p);
        memcpy(&kv->v.f, &u, 8);
        break;
    }
    case KVM_GGUF_STRING:
        kv->v.s.len = le64(p);
        kv->v.s.ptr = (const char *)p + 8;
        break;
    default:
        break;
    }
}

static int parse_kvs(kvm_gguf *g, rd *r)
{
    char what[160];
    for (int64_t i = 0; i < g->n_kv; i++) {
        kvm_gguf_kv *kv = &g->kv[i];
        snprintf(what, sizeof what, "metadata entry %lld key", (long long)i);
        int rc = rd_str(r, &kv->key, what);
        if (rc) return rc;
        snprintf(what, sizeof what, "metadata '%.*s'", (int)(kv->key.len > 100 ? 100 : kv->key.len), kv->key.ptr);
        uint32_t t;
        if ((rc = rd_u32(r, &t, what))) return rc;
        if (t > KVM_GGUF_F64)
            return kvm_err(KVM_EFORMAT, "%s: %s: unknown value type %u at offset %zu", g->name, what, t, r->off - 4);
        kv->type = (kvm_gguf_vtype)t;
        kv->data = r->p + r->off;
        if (t == KVM_GGUF_ARRAY) {
            if ((rc = need(r, 12, what))) return rc;
            kv->etype = (kvm_gguf_vtype)kvm_qb_le32(kv->data);
            kv->n = le64(kv->data + 4);
            kv->data += 12;
            if ((rc = skip_value(r, t, 0, what))) return rc;
        } else {
            if ((rc = skip_value(r, t, 0, what))) return rc;
            decode_scalar(kv);
        }
    }
    return 0;
}

static int cmp_key(const void *a, const void *b)
{
    const kvm_gguf_kv *x = *(const kvm_gguf_kv *const *)a, *y = *(const kvm_gguf_kv *const *)b;
    uint64_t n = x->key.len < y->key.len ? x->key.len : y->key.len;
    int c = memcmp(x->key.ptr, y->key.ptr, n);
    return c ? c : (x->key.len > y->key.len) - (x->key.len < y->key.len);
}

/* A key given twice is refused, as llama.cpp's reader does: kvm_gguf_find took the first, so
 * a second llama.context_length or eos_token_id was dropped without a word. */
static int check_keys(const kvm_gguf *g)
{
    if (g->n_kv < 2) return 0;
    const kvm_gguf_kv **s = malloc((size_t)g->n_kv * sizeof *s);
    if (!s) return kvm_err(KVM_ENOMEM, "%s: out of memory", g->name);
    for (int64_t i = 0; i < g->n_kv; i++)
        s[i] = &g->kv[i];
    qsort(s, (size_t)g->n_kv, sizeof *s, cmp_key);
    int rc = 0;
    for (int64_t i = 1; !rc && i < g->n_kv; i++)
        if (cmp_key(&s[i - 1], &s[i]) == 0)
            rc = kvm_err(KVM_EFORMAT, "%s: metadata key '%.*s' appears twice (entries %lld and %lld)", g->name,
                         (int)(s[i]->key.len > 120 ? 120 : s[i]->key.len), s[i]->key.ptr,
                         (long long)(s[i - 1] < s[i] ? s[i - 1] - g->kv : s[i] - g->kv),
                         (long long)(s[i - 1] < s[i] ? s[i] - g->kv : s[i - 1] - g->kv));
    free(s);
    return rc;
}

static const char *const type_names[] = {"F32",     "F16",    "Q4_0",    "Q4_1",  "Q4_2",   "Q4_3",  "Q5_0",  "Q5_1",
                                         "Q8_0",    "Q8_1",   "Q2_K",    "Q3_K",  "Q4_K",   "Q5_K",  "Q6_K",  "Q8_K",
                                         "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
                                         "I8",      "I16",    "I32",     "I64",   "F64",    "IQ1_M", "BF16"};

const char *kvm_ggml_type_name(int type)
{
    if (type < 0 || type >= (int)(sizeof type_names / sizeof type_names[0])) return "?";
    return type_names[type];
}

int64_t kvm_ggml_block_elems(int type) { return kvm_qb_block_elems(type); }

int64_t kvm_ggml_block_bytes(int type) { return kvm_qb_block_bytes(type); }

static int parse_tensor_info(kvm_gguf *g, rd *r, int64_t i)
{
    kvm_gguf_tensor *t = &g->tensors[i];
    char what[200];
    snprintf(what, sizeof what, "tensor info %lld name", (long long)i);
    int rc = rd_str(r, &t->name, what);
    if (rc) return rc;
    snprintf(what, sizeof what, "tensor '%.*s'", (int)(t->name.len > 120 ? 120 : t->name.len), t->name.ptr);
    uint32_t nd, type;
    if ((rc = rd_u32(r, &nd, what))) return rc;
    if (nd < 1 || nd > 4) return kvm_err(KVM_EFORMAT, "%s: %s: n_dims = %u, must be 1..4", g->name, what, nd);
    t->n_dims = (int)nd;
    int64_t elems = 1;
    for (int d = 0; d < 4; d++)
        t->ne[d] = 1;
    for (uint32_t d = 0; d < nd; d++) {
        uint64_t ne;
        if ((rc = rd_u64(r, &ne, what))) return rc;
        if (ne < 1 || ne > (uint64_t)KVM_GGUF_MAX_ELEMS || (uint64_t)elems > (uint64_t)KVM_GGUF_MAX_ELEMS / ne)
            return kvm_err(KVM_EFORMAT, "%s: %s: dimension %u = %llu (zero, or the tensor exceeds 2^48 elements)",
                           g->name, what, d, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
        elems *= (int64_t)ne;
    }
    if ((rc = rd_u32(r, &type, what)) || (rc = rd_u64(r, &t->offset, what))) return rc;
    t->type = (kvm_ggml_type)type;
    int64_t be = kvm_ggml_block_elems((int)type), bb = kvm_ggml_block_bytes((int)type);
    if (!be)
        return kvm_err(KVM_ENOTSUP,
                       "%s: %s: tensor type %u (%s) is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
                       "Q5_1, Q8_0, Q4_K, Q6_K are)",
                       g->name, what, type, kvm_ggml_type_name((int)type));
    if (t->ne[0] % be)
        return kvm_err(KVM_EFORMAT, "%s: %s: row of %lld elements is not a multiple of the %s block (%lld)", g->name,
                       what, (long long)t->ne[0], kvm_ggml_type_name((int)type), (long long)be);
    t->bytes = (uint64_t)(elems / be) * (uint64_t)bb;
    return 0;
}

static int cmp_name(const void *a, const void *b)
{
    const kvm_gguf_tensor *x = *(const kvm_gguf_tensor *const *)a, *y = *(const kvm_gguf_tensor *const *)b;
    uint64_t n = x->name.len < y->name.len ? x->name.len : y->name.len;
    int c = memcmp(x->name.ptr, y->name.ptr, n);
    return c ? c : (x->name.len > y->name.len) - (x->name.len < y->name.len);
}

static int cmp_offset(const void *a, const void *b)
{
    const kvm_gguf_tensor *x = *(const kvm_gguf_tensor *const *)a, *y = *(const kvm_gguf_tensor *const *)b;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

#define NAME_ARG(t) (int)((t)->name.len > 120 ? 120 : (t)->name.len), (t)->name.ptr

/* Each tensor aligned and inside the data section (room bytes); sets its data pointer. */
static int place_tensors(kvm_gguf *g, uint64_t room)
{
    for (int64_t i = 0; i < g->n_tensors; i++) {
        kvm_gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment)
            return kvm_err(KVM_EFORMAT, "%s: tensor '%.*s': data offset %llu is not a multiple of the alignment %llu",
                           g->name, NAME_ARG(t), (unsigned long long)t->offset, (unsigned long long)g->alignment);
        if (t->offset > room || t->bytes > room - t->offset)
            return kvm_err(KVM_EFORMAT,
                           "%s: tensor '%.*s': data [%llu, +%llu) lies outside the file (data section "
                           "holds %llu bytes)",
                           g->name, NAME_ARG(t), (unsigned long long)t->offset, (unsigned long long)t->bytes,
                           (unsigned long long)room);
        t->data = g->map + g->data_off + t->offset;
    }
    return 0;
}

static int check_unique(const kvm_gguf *g, const kvm_gguf_tensor **s)
{
    qsort(s, (size_t)g->n_tensors, sizeof *s, cmp_name);
    for (int64_t i = 1; i < g->n_tensors; i++)
        if (cmp_name(&s[i - 1], &s[i]) == 0)
            return kvm_err(KVM_EFORMAT, "%s: tensor '%.*s' appears twice", g->name, NAME_ARG(s[i]));
    return 0;
}

/* s sorted by offset: no overlaps, and no gap of an alignment or more between two tensors, before the first or
 * after the last (writers pad each tensor to the alignment, no more). A gap means a tensor's declared type or shape
 * is smaller than its data: read with it, its values and every later one's are garbage. A shrink below the
 * alignment cannot be told from padding. */
static int check_layout(const kvm_gguf *g, const kvm_gguf_tensor **s, uint64_t room)
{
    if (s[0]->offset >= g->alignment)
        return kvm_err(KVM_EFORMAT,
                       "%s: tensor '%.*s', the first in the data section, starts at %llu: a hole of %llu "
                       "bytes before it",
                       g->name, NAME_ARG(s[0]), (unsigned long long)s[0]->offset, (unsigned long long)s[0]->offset);
    for (int64_t i = 1; i < g->n_tensors; i++) {
        const kvm_gguf_tensor *a = s[i - 1], *b = s[i];
        uint64_t end = a->offset + a->bytes;
        if (end > b->offset)
            return kvm_err(KVM_EFORMAT, "%s: tensors '%.*s' [%llu, +%llu) and '%.*s' [%llu, +%llu) overlap", g->name,
                           NAME_ARG(a), (unsigned long long)a->offset, (unsigned long long)a->bytes, NAME_ARG(b),
                           (unsigned long long)b->offset, (unsigned long long)b->bytes);
        if (b->offset - end >= g->alignment)
            return kvm_err(KVM_EFORMAT,
                           "%s: tensors '%.*s' [%llu, +%llu) and '%.*s' at %llu leave a hole of %llu bytes between "
                           "them (alignment %llu): the first one's declared type or shape is smaller than its data",
                           g->name, NAME_ARG(a), (unsigned long long)a->offset, (unsigned long long)a->bytes,
                           NAME_ARG(b), (unsigned long long)b->offset, (unsigned long long)(b->offset - end),
                           (unsigned long long)g->alignment);
    }
    const kvm_gguf_tensor *z = s[g->n_tensors - 1];
    uint64_t tail = room - (z->offset + z->bytes);
    if (tail >= g->alignment)
        return kvm_err(KVM_EFORMAT,
                       "%s: tensor '%.*s' [%llu, +%llu), the last in the data section, leaves a hole of %llu bytes "
                       "before the end of the file (alignment %llu): its declared type or shape is smaller than its "
                       "data",
                       g->name, NAME_ARG(z), (unsigned long long)z->offset, (unsigned long long)z->bytes,
                       (unsigned long long)tail, (unsigned long long)g->alignment);
    return 0;
}

/* Places the tensors: aligned, inside the file, unique names, no overlaps or holes. */
static int check_tensors(kvm_gguf *g)
{
    uint64_t room = g->bytes - g->data_off;
    int rc = place_tensors(g, room);
    if (rc || g->n_tensors == 0) return rc;
    const kvm_gguf_tensor **s = malloc((size_t)g->n_tensors * sizeof *s);
    if (!s) return kvm_err(KVM_ENOMEM, "%s: out of memory", g->name);
    for (int64_t i = 0; i < g->n_tensors; i++)
        s[i] = &g->tensors[i];
    rc = check_unique(g, s);
    if (!rc) {
        qsort(s, (size_t)g->n_tensors, sizeof *s, cmp_offset);
        rc = check_layout(g, s, room);
    }
    free(s);
    return rc;
}

int kvm_gguf_parse(const char *name, const uint8_t *map, size_t bytes, kvm_gguf **out)
{
    *out = NULL;
    kvm_gguf *g = calloc(1, sizeof *g);
    if (!g || !(g->name = strdup(name ? name : "gguf"))) {
        free(g);
        return kvm_err(KVM_ENOMEM, "%s: out of memory", name);
    }
    g->map = map;
    g->bytes = bytes;
    g->alignment = KVM_GGUF_DEFAULT_ALIGN;
    rd r = {map, bytes, 0, g->name};
    int rc;
    uint32_t magic;
    uint64_t n_t, n_kv;
    if ((rc = rd_u32(&r, &magic, "the magic"))) goto fail;
    if (memcmp(map, "GGUF", 4) != 0) {
        rc = kvm_err(KVM_EFORMAT, "%s: bad magic %02x %02x %02x %02x, expected \"GGUF\"", g->name, map[0], map[1],
                     map[2], map[3]);
        goto fail;
    }
    if ((rc = rd_u32(&r, &g->version, "the version"))) goto fail;
    if (g->version == 0x02000000u || g->version == 0x03000000u) {
        rc = kvm_err(KVM_ENOTSUP, "%s: a big-endian GGUF file (version %u byte-swapped) is not supported", g->name,
                     g->version >> 24);
        goto fail;
    }
    if (g->version != 2 && g->version != 3) {
        rc = kvm_err(KVM_ENOTSUP, "%s: GGUF version %u is not supported (2 and 3 are)", g->name, g->version);
        goto fail;
    }
    if ((rc = rd_u64(&r, &n_t, "the tensor count")) || (rc = rd_u64(&r, &n_kv, "the metadata count"))) goto fail;
    /* every metadata entry takes at least 13 bytes (key length, type, a 1-byte value), every
     * tensor info at least 32 (name length, n_dims, one dim, type, offset) */
    if (n_kv > left(&r) / 13) {
        rc = kvm_err(KVM_EFORMAT, "%s: metadata count %llu beyond the file (%zu bytes left hold at most %zu)", g->name,
                     (unsigned long long)n_kv, left(&r), left(&r) / 13);
        goto fail;
    }
    if (n_t > left(&r) / 32) {
        rc = kvm_err(KVM_EFORMAT, "%s: tensor count %llu beyond the file (%zu bytes left hold at most %zu)", g->name,
                     (unsigned long long)n_t, left(&r), left(&r) / 32);
        goto fail;
    }
    g->n_kv = (int64_t)n_kv;
    g->n_tensors = (int64_t)n_t;
    g->kv = calloc(n_kv ? n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(n_t ? n_t : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) {
        rc = kvm_err(KVM_ENOMEM, "%s: out of memory for %llu entries", g->name, (unsigned long long)(n_kv + n_t));
        goto fail;
    }
    if ((rc = parse_kvs(g, &r)) || (rc = check_keys(g))) goto fail;
    const kvm_gguf_kv *al = kvm_gguf_find(g, "general.alignment");
    if (al) {
        if (al->type != KVM_GGUF_U32 || al->v.u == 0 || (al->v.u & (al->v.u - 1))) {
            rc = kvm_err(KVM_EFORMAT, "%s: general.alignment must be a u32 power of two (type %d, value %llu)", g->name,
                         al->type, (unsigned long long)al->v.u);
            goto fail;
        }
        g->alignment = al->v.u;
    }
    for (int64_t i = 0; i < g->n_tensors; i++)
        if ((rc = parse_tensor_info(g, &r, i))) goto fail;
    g->data_off = (r.off + g->alignment - 1) / g->alignment * g->alignment;
    if (g->data_off > bytes) {
        if (g->n_tensors > 0) {
            rc = kvm_err(KVM_EFORMAT, "%s: truncated: the data section would start at %llu, past the end (%zu)",
                         g->name, (unsigned long long)g->data_off, bytes);
            goto fail;
        }
        g->data_off = bytes;
    }
    if ((rc = check_tensors(g))) goto fail;
    *out = g;
    return 0;
fail:
    kvm_gguf_free(&g);
    return rc;
}

void kvm_gguf_free(kvm_gguf **pg)
{
    if (!pg || !*pg) return;
    kvm_gguf *g = *pg;
    free(g->kv);
    free(g->tensors);
    free(g->name);
    free(g);
    *pg = NULL;
}

uint32_t kvm_gguf_version(const kvm_gguf *g) { return g->version; }
int64_t kvm_gguf_n_kv(const kvm_gguf *g) { return g->n_kv; }
const kvm_gguf_kv *kvm_gguf_kv_at(const kvm_gguf *g, int64_t i) { return i >= 0 && i < g->n_kv ? &g->kv[i] : NULL; }
int64_t kvm_gguf_n_tensors(const kvm_gguf *g) { return g->n_tensors; }
const kvm_gguf_tensor *kvm_gguf_tensor_at(const kvm_gguf *g, int64_t i)
{
    return i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}
const char *kvm_gguf_name(const kvm_gguf *g) { return g->name; }

static int str_eq(kvm_gguf_str s, const char *z)
{
    size_t n = strlen(z);
    return s.len == n && memcmp(s.ptr, z, n) == 0;
}

const kvm_gguf_kv *kvm_gguf_find(const kvm_gguf *g, const char *key)
{
    for (int64_t i = 0; i < g->n_kv; i++)
        if (str_eq(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}

const kvm_gguf_tensor *kvm_gguf_find_tensor(const kvm_gguf *g, const char *name)
{
    for (int64_t i = 0; i < g->n_tensors; i++)
        if (str_eq(g->tensors[i].name, name)) return &g->tensors[i];
    return NULL;
}

/* The GGUF spec's name of a metadata value type (gguf.md: GGUF_METADATA_VALUE_TYPE_*), for
 * errors that name a key's type: "type 8 (string)" says more than "type 8". */
static const char *meta_type_name(int type)
{
    static const char *const names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                        "bool", "string", "array", "u64", "i64", "f64"};
    return type >= 0 && type < (int)(sizeof names / sizeof names[0]) ? names[type] : "unknown";
}

int kvm_gguf_get_i64(const kvm_gguf *g, const char *key, int64_t *v)
{
    const kvm_gguf_kv *kv = kvm_gguf_find(g, key);
    if (!kv) return KVM_ENOTFOUND;
    switch (kv->type) {
    case KVM_GGUF_U8:
    case KVM_GGUF_U16:
    case KVM_GGUF_U32:
    case KVM_GGUF_U64:
        if (kv->v.u > INT64_MAX) break;
        *v = (int64_t)kv->v.u;
        return 0;
    case KVM_GGUF_I8:
    case KVM_GGUF_I16:
    case KVM_GGUF_I32:
    case KVM_GGUF_I64:
        *v = kv->v.i;
        return 0;
    default:
        return kvm_err(KVM_EFORMAT, "%s: metadata '%s' has type %d (%s), expected an integer", g->name, key, kv->type,
                       meta_type_name(kv->type));
    }
    return kvm_err(KVM_EFORMAT, "%s: metadata '%s' = %llu is out of range", g->name, key, (unsigned long long)kv->v.u);
}

int kvm_gguf_get_f64(const kvm_gguf *g, const char *key, double *v)
{
    const kvm_gguf_kv *kv = kvm_gguf_find(g, key);
    if (!kv) return KVM_ENOTFOUND;
    if (kv->type != KVM_GGUF_F32 && kv->type != KVM_GGUF_F64)
        return kvm_err(KVM_EFORMAT, "%s: metadata '%s' has type %d (%s), expected a float", g->name, key, kv->type,
                       meta_type_name(kv->type));
    *v = kv->v.f;
    return 0;
}

int kvm_gguf_get_bool(const kvm_gguf *g, const char *key, int *v)
{
    const kvm_gguf_kv *kv = kvm_gguf_find(g, key);
    if (!kv) return KVM_ENOTFOUND;
    if (kv->type != KVM_GGUF_BOOL)
        return kvm_err(KVM_EFORMAT, "%s: metadata '%s' has type %d (%s), expected a bool", g->name, key, kv->type,
                       meta_type_name(kv->type));
    *v = kv->v.u != 0;
    return 0;
}

int kvm_gguf_get_str(const kvm_gguf *g, const char *key, kvm_gguf_str *v)
{
    const kvm_gguf_kv *kv = kvm_gguf_find(g, key);
    if (!kv) return KVM_ENOTFOUND;
    if (kv->type != KVM_GGUF_STRING)
        return kvm_err(KVM_EFORMAT, "%s: metadata '%s' has type %d (%s), expected a string", g->name, key, kv->type,
                       meta_type_name(kv->type));
    *v = kv->v.s;
    return 0;
}

int kvm_gguf_get_arr(const kvm_gguf *g, const char *key, kvm_gguf_vtype etype, uint64_t *n, const uint8_t **data)
{
    const kvm_gguf_kv *kv = kvm_gguf_find(g, key);
    if (!kv) return KVM_ENOTFOUND;
    if (kv->type != KVM_GGUF_ARRAY || kv->etype != etype)
        return kvm_err(KVM_EFORMAT, "%s: metadata '%s' is not an array of type %d (type %d, elements %d)", g->name, key,
                       etype, kv->type, kv->etype);
    *n = kv->n;
    *data = kv->data;
    return 0;
}

/* ---- dequantisation (ggml-quants.c; the bodies: kernels/kvm_quant_body.h) ---- */

float kvm_fp16_to_f32(uint16_t h) { return kvm_qb_fp16(h); }

float kvm_bf16_to_f32(uint16_t h) { return kvm_qb_bf16(h); }

/* n_blocks blocks of one type: the element body with a constant type and constant block sizes, so
 * each case compiles to its own loop without the type switch, each group's scales decoded once
 * per 16 elements (the 1-element types: once per element, where they are the value itself) and
 * the group loop unrolled, so that the group index is a constant in each lane loop */
#define KVM_DEQ_CASE(T)                                                                                                \
    case T:                                                                                                            \
        for (int64_t i = 0; i < n_blocks; i++) {                                                                       \
            const int BE = (int)kvm_qb_block_elems(T);                                                                 \
            const uint8_t *b = s + i * kvm_qb_block_bytes(T);                                                          \
            _Pragma("GCC unroll 16") for (int g = 0; g * 16 < BE; g++)                                                 \
            {                                                                                                          \
                const kvm_qb_scales sc = kvm_qb_group_scales(T, b, g);                                                 \
                float *y = dst + i * BE + 16 * g;                                                                      \
                for (int l = 0; l < (BE < 16 ? BE : 16); l++)                                                          \
                    y[l] = kvm_qb_elem_s(T, b, sc, g, l);                                                              \
            }                                                                                                          \
        }                                                                                                              \
        break

int kvm_ggml_dequantize(int type, const void *src, float *dst, int64_t n)
{
    const int64_t be = kvm_qb_block_elems(type);
    if (!be)
        return kvm_err(KVM_ENOTSUP, "dequantize: tensor type %d (%s) not supported", type, kvm_ggml_type_name(type));
    if (n % be)
        return kvm_err(KVM_EINVAL, "dequantize: %lld elements is not a multiple of the block %lld", (long long)n,
                       (long long)be);
    const uint8_t *s = src;
    const int64_t n_blocks = n / be;
    switch (type) {
        KVM_DEQ_CASE(KVM_QB_F32);
        KVM_DEQ_CASE(KVM_QB_F16);
        KVM_DEQ_CASE(KVM_QB_BF16);
        KVM_DEQ_CASE(KVM_QB_Q8_0);
        KVM_DEQ_CASE(KVM_QB_Q4_0);
        KVM_DEQ_CASE(KVM_QB_Q4_1);
        KVM_DEQ_CASE(KVM_QB_Q5_0);
        KVM_DEQ_CASE(KVM_QB_Q5_1);
        KVM_DEQ_CASE(KVM_QB_Q4_K);
        KVM_DEQ_CASE(KVM_QB_Q6_K);
    default:
        break;
    }
    return 0;
}
