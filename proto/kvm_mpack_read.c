/* kvm_mpack_read.c: strict bounds-checked MessagePack reader (format spec:
 * github.com/msgpack/msgpack/blob/master/spec.md). Reads never allocate or pass r->end. */
#include "proto/kvm_mpack_internal.h"

#include <string.h>

static uint64_t kvm_mpr__be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* Bytes left. */
static size_t kvm_mpr__left(const kvm_mpr *r) { return (size_t)(r->end - r->p); }

int kvm_mpr__kind(const kvm_mpr *r)
{
    if (r->p >= r->end) return KVM_MPK_END;
    uint8_t b = *r->p;
    if (b <= 0x7f) return KVM_MPK_UINT;
    if (b <= 0x8f) return KVM_MPK_MAP;
    if (b <= 0x9f) return KVM_MPK_ARRAY;
    if (b <= 0xbf) return KVM_MPK_STR;
    if (b >= 0xe0) return KVM_MPK_NEGINT;
    switch (b) {
    case 0xc0:
        return KVM_MPK_NIL;
    case 0xc2:
    case 0xc3:
        return KVM_MPK_BOOL;
    case 0xc4:
    case 0xc5:
    case 0xc6:
        return KVM_MPK_BIN;
    case 0xc7:
    case 0xc8:
    case 0xc9:
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8:
        return KVM_MPK_EXT;
    case 0xca:
    case 0xcb:
        return KVM_MPK_FLOAT;
    case 0xcc:
    case 0xcd:
    case 0xce:
    case 0xcf:
        return KVM_MPK_UINT;
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3: { /* signed encodings of possibly >= 0 values */
        int n = 1 << (b - 0xd0);
        if (kvm_mpr__left(r) < (size_t)(1 + n)) return KVM_MPK_NEGINT; /* reading will report TRUNC */
        return (r->p[1] & 0x80) ? KVM_MPK_NEGINT : KVM_MPK_UINT;
    }
    case 0xd9:
    case 0xda:
    case 0xdb:
        return KVM_MPK_STR;
    case 0xdc:
    case 0xdd:
        return KVM_MPK_ARRAY;
    case 0xde:
    case 0xdf:
        return KVM_MPK_MAP;
    default:
        return KVM_MPK_INVALID; /* 0xc1 */
    }
}

const char *kvm_mpr__kind_name(int kind)
{
    static const char *const names[] = {"end of data",  "nil",   "bool", "unsigned int",
                                        "negative int", "float", "str",  "bin",
                                        "array",        "map",   "ext",  "invalid byte 0xc1"};
    return (kind >= 0 && kind <= KVM_MPK_INVALID) ? names[kind] : "?";
}

/* Reads a length-prefixed header: fixed form (mask), or 1/2/4-byte length after tag t8/t16/t32
 * (t8 may be 0 for none). Advances past the header only. */
static int kvm_mpr__len(kvm_mpr *r, uint8_t fix_lo, uint8_t fix_hi, uint8_t fix_mask, int t8, int t16, int t32,
                        uint32_t *n)
{
    if (r->p >= r->end) return KVM_MPR_TRUNC;
    uint8_t b = *r->p;
    int w;
    if (b >= fix_lo && b <= fix_hi) {
        *n = b & fix_mask;
        r->p++;
        return 0;
    }
    if (t8 >= 0 && b == t8)
        w = 1;
    else if (b == t16)
        w = 2;
    else if (b == t32)
        w = 4;
    else
        return KVM_MPR_TYPE;
    if (kvm_mpr__left(r) < (size_t)(1 + w)) return KVM_MPR_TRUNC;
    *n = (uint32_t)kvm_mpr__be(r->p + 1, w);
    r->p += 1 + w;
    return 0;
}

int kvm_mpr__map(kvm_mpr *r, uint32_t *n) { return kvm_mpr__len(r, 0x80, 0x8f, 0x0f, -1, 0xde, 0xdf, n); }

int kvm_mpr__array(kvm_mpr *r, uint32_t *n) { return kvm_mpr__len(r, 0x90, 0x9f, 0x0f, -1, 0xdc, 0xdd, n); }

/* Header then body of `len` bytes; restores r when the body does not fit. */
static int kvm_mpr__bytes(kvm_mpr *r, int rc, const uint8_t *start, uint32_t len, const uint8_t **body)
{
    if (rc) return rc;
    if (kvm_mpr__left(r) < len) {
        r->p = start;
        return KVM_MPR_TRUNC;
    }
    *body = r->p;
    r->p += len;
    return 0;
}

int kvm_mpr__str(kvm_mpr *r, const char **s, uint32_t *len)
{
    const uint8_t *start = r->p, *body = NULL;
    uint32_t n = 0;
    int rc = kvm_mpr__len(r, 0xa0, 0xbf, 0x1f, 0xd9, 0xda, 0xdb, &n);
    rc = kvm_mpr__bytes(r, rc, start, n, &body);
    if (rc == 0) {
        *s = (const char *)body;
        *len = n;
    }
    return rc;
}

int kvm_mpr__bin(kvm_mpr *r, const uint8_t **b, uint32_t *len)
{
    const uint8_t *start = r->p, *body = NULL;
    uint32_t n = 0;
    /* bin has no fixed form: an impossible range disables it */
    int rc = kvm_mpr__len(r, 1, 0, 0, 0xc4, 0xc5, 0xc6, &n);
    rc = kvm_mpr__bytes(r, rc, start, n, &body);
    if (rc == 0) {
        *b = body;
        *len = n;
    }
    return rc;
}

int kvm_mpr__declared_len(const kvm_mpr *r, uint32_t *len, size_t *left)
{
    kvm_mpr c = *r;
    int kind = kvm_mpr__kind(&c), rc = KVM_MPR_TYPE;
    if (kind == KVM_MPK_STR) rc = kvm_mpr__len(&c, 0xa0, 0xbf, 0x1f, 0xd9, 0xda, 0xdb, len);
    if (kind == KVM_MPK_BIN) rc = kvm_mpr__len(&c, 1, 0, 0, 0xc4, 0xc5, 0xc6, len);
    if (rc == 0 && left) *left = kvm_mpr__left(&c);
    return rc;
}

int kvm_mpr__bool(kvm_mpr *r, int *v)
{
    if (r->p >= r->end) return KVM_MPR_TRUNC;
    if (*r->p != 0xc2 && *r->p != 0xc3) return KVM_MPR_TYPE;
    *v = *r->p == 0xc3;
    r->p++;
    return 0;
}

int kvm_mpr__int(kvm_mpr *r, int *neg, int64_t *i, uint64_t *u)
{
    if (r->p >= r->end) return KVM_MPR_TRUNC;
    uint8_t b = *r->p;
    if (b <= 0x7f || b >= 0xe0) {
        *neg = b >= 0xe0;
        *i = (int8_t)b;
        *u = b;
        r->p++;
        return 0;
    }
    int w, is_signed;
    if (b >= 0xcc && b <= 0xcf)
        w = 1 << (b - 0xcc), is_signed = 0;
    else if (b >= 0xd0 && b <= 0xd3)
        w = 1 << (b - 0xd0), is_signed = 1;
    else
        return KVM_MPR_TYPE;
    if (kvm_mpr__left(r) < (size_t)(1 + w)) return KVM_MPR_TRUNC;
    uint64_t v = kvm_mpr__be(r->p + 1, w);
    r->p += 1 + w;
    if (is_signed && w < 8 && (v >> (8 * w - 1)) & 1) v |= ~(uint64_t)0 << (8 * w); /* sign-extend */
    if (is_signed && (v >> 63)) {
        *neg = 1;
        memcpy(i, &v, sizeof v); /* two's complement reinterpretation without UB */
        *u = 0;
    } else {
        *neg = 0;
        *u = v;
        *i = 0;
    }
    return 0;
}

int kvm_mpr__float(kvm_mpr *r, double *v)
{
    if (r->p >= r->end) return KVM_MPR_TRUNC;
    uint8_t b = *r->p;
    if (b == 0xca || b == 0xcb) {
        int w = b == 0xca ? 4 : 8;
        if (kvm_mpr__left(r) < (size_t)(1 + w)) return KVM_MPR_TRUNC;
        uint64_t bits = kvm_mpr__be(r->p + 1, w);
        if (w == 4) {
            uint32_t b32 = (uint32_t)bits;
            float f;
            memcpy(&f, &b32, 4);
            *v = f;
        } else {
            memcpy(v, &bits, 8);
        }
        r->p += 1 + w;
        return 0;
    }
    int neg;
    int64_t i;
    uint64_t u;
    int rc = kvm_mpr__int(r, &neg, &i, &u);
    if (rc == 0) *v = neg ? (double)i : (double)u;
    return rc;
}

static int kvm_mpr__skip_depth(kvm_mpr *r, int depth)
{
    if (depth > KVM_MPR_MAX_DEPTH) return KVM_MPR_DEEP;
    const uint8_t *start = r->p;
    uint32_t n;
    int rc = 0, neg, bv;
    int64_t i;
    uint64_t u;
    double d;
    const char *s;
    const uint8_t *bb;
    switch (kvm_mpr__kind(r)) {
    case KVM_MPK_END:
        return KVM_MPR_TRUNC;
    case KVM_MPK_INVALID:
        return KVM_MPR_TYPE;
    case KVM_MPK_NIL:
        r->p++;
        return 0;
    case KVM_MPK_BOOL:
        return kvm_mpr__bool(r, &bv);
    case KVM_MPK_UINT:
    case KVM_MPK_NEGINT:
        return kvm_mpr__int(r, &neg, &i, &u);
    case KVM_MPK_FLOAT:
        return kvm_mpr__float(r, &d);
    case KVM_MPK_STR:
        return kvm_mpr__str(r, &s, &n);
    case KVM_MPK_BIN:
        return kvm_mpr__bin(r, &bb, &n);
    case KVM_MPK_EXT: {
        uint8_t b = *r->p;
        size_t hdr, len;
        if (b >= 0xd4 && b <= 0xd8) {
            hdr = 2;
            len = (size_t)1 << (b - 0xd4);
        } else {
            int w = b == 0xc7 ? 1 : b == 0xc8 ? 2 : 4;
            if (kvm_mpr__left(r) < (size_t)(1 + w)) return KVM_MPR_TRUNC;
            len = (size_t)kvm_mpr__be(r->p + 1, w);
            hdr = 2 + (size_t)w; /* tag, length, ext type byte */
        }
        if (kvm_mpr__left(r) < hdr || kvm_mpr__left(r) - hdr < len) return KVM_MPR_TRUNC;
        r->p += hdr + len;
        return 0;
    }
    case KVM_MPK_ARRAY:
    case KVM_MPK_MAP: {
        int is_map = kvm_mpr__kind(r) == KVM_MPK_MAP;
        rc = is_map ? kvm_mpr__map(r, &n) : kvm_mpr__array(r, &n);
        if (rc) return rc;
        uint64_t items = (uint64_t)n * (is_map ? 2u : 1u);
        if (items > kvm_mpr__left(r)) rc = KVM_MPR_TRUNC; /* every item needs >= 1 byte */
        for (uint64_t k = 0; rc == 0 && k < items; k++)
            rc = kvm_mpr__skip_depth(r, depth + 1);
        if (rc) r->p = start;
        return rc;
    }
    default:
        return KVM_MPR_TYPE;
    }
}

int kvm_mpr__skip(kvm_mpr *r) { return kvm_mpr__skip_depth(r, 0); }
