/* kvm_proto_decode.c: the one decoder behind every kvm_proto_<type>_decode: parses frame 0
 * field by field against the type's spec, then matches tensor descriptors to frames, checking
 * types, ranges, shapes, byte lengths and alignment before anything is handed out. */
#include <stdio.h>
#include <string.h>

#include "common/kvm_error.h"
#include "proto/kvm_mpack_internal.h"
#include "proto/kvm_proto_internal.h"

/* One entry of "tensors": what frame (index + 1) claims to hold. */
typedef struct kvm_desc {
    const char *name;                  /* borrowed from frame 0 */
    uint32_t name_len;                 /* bytes */
    kvm_proto_dtype dtype;             /* element type */
    int ndim;                          /* 0..KVM_PROTO_MAX_DIMS */
    int64_t shape[KVM_PROTO_MAX_DIMS]; /* declared sizes */
    uint64_t nbytes;                   /* product of shape times dtype size, <= MAX_FRAME_BYTES */
} kvm_desc;

/* Detail for a reader failure at field `what`. */
static int kvm_dec__bad(kvm_proto_type t, const kvm_mpr *r, int rc, const char *what, const char *expected)
{
    if (rc == KVM_MPR_TRUNC) return kvm_proto__fail(KVM_EPROTO, t, "truncated header: %s cut short", what);
    if (rc == KVM_MPR_DEEP) return kvm_proto__fail(KVM_EPROTO, t, "%s nests deeper than %d", what, KVM_MPR_MAX_DEPTH);
    return kvm_proto__fail(KVM_EPROTO, t, "%s is %s, expected %s", what, kvm_mpr__kind_name(kvm_mpr__kind(r)),
                           expected);
}

/* Detail for a str/bin field that could not be read (its limit named when it is too long). */
static int kvm_dec__strbad(kvm_proto_type t, const kvm_mpr *r, int rc, const char *what, int64_t limit,
                           const char *expected)
{
    char prefix[32];
    snprintf(prefix, sizeof prefix, "%s: ", kvm_proto_type_name(t));
    return kvm_proto__str_fail(r, rc, prefix, what, limit > 0 ? (uint64_t)limit : 0, expected);
}

/* Reads one field's value into its member. */
static int kvm_dec__field(kvm_proto_type t, const kvm_proto__field *f, kvm_mpr *r, uint8_t *s)
{
    char what[96];
    snprintf(what, sizeof what, "field '%s'", f->key);
    int rc = 0, neg = 0;
    int64_t i = 0;
    uint64_t u = 0;
    switch (f->kind) {
    case KVM_PF_U64:
    case KVM_PF_I64:
    case KVM_PF_I32:
        if ((rc = kvm_mpr__int(r, &neg, &i, &u)) != 0) return kvm_dec__bad(t, r, rc, what, "int");
        if (f->kind == KVM_PF_U64) {
            if (neg) return kvm_proto__fail(KVM_ERANGE, t, "%s = %lld is negative", what, (long long)i);
            memcpy(s + f->off, &u, sizeof u);
            return 0;
        }
        if (!neg && u > (uint64_t)INT64_MAX)
            return kvm_proto__fail(KVM_ERANGE, t, "%s = %llu out of range [%lld, %lld]", what, (unsigned long long)u,
                                   (long long)f->min, (long long)f->max);
        if (!neg) i = (int64_t)u;
        if (f->kind == KVM_PF_I64) {
            memcpy(s + f->off, &i, sizeof i);
        } else {
            if (i < INT32_MIN || i > INT32_MAX)
                return kvm_proto__fail(KVM_ERANGE, t, "%s = %lld out of range [%lld, %lld]", what, (long long)i,
                                       (long long)f->min, (long long)f->max);
            int32_t v = (int32_t)i;
            memcpy(s + f->off, &v, sizeof v);
        }
        return 0;
    case KVM_PF_F64: {
        double d;
        if ((rc = kvm_mpr__float(r, &d)) != 0) return kvm_dec__bad(t, r, rc, what, "float");
        memcpy(s + f->off, &d, sizeof d);
        return 0;
    }
    case KVM_PF_BOOL: {
        int b;
        if ((rc = kvm_mpr__bool(r, &b)) != 0) return kvm_dec__bad(t, r, rc, what, "bool");
        *(bool *)(s + f->off) = b != 0;
        return 0;
    }
    case KVM_PF_STR: {
        kvm_proto_str v;
        uint32_t n;
        if ((rc = kvm_mpr__str(r, &v.ptr, &n)) != 0) return kvm_dec__strbad(t, r, rc, what, f->max, "str");
        v.len = n;
        memcpy(s + f->off, &v, sizeof v);
        return 0;
    }
    case KVM_PF_ID32: {
        const uint8_t *b;
        uint32_t n;
        if ((rc = kvm_mpr__bin(r, &b, &n)) != 0) return kvm_dec__bad(t, r, rc, what, "bin");
        if (n != KVM_PROTO_ID_BYTES)
            return kvm_proto__fail(KVM_EPROTO, t, "%s has %u bytes, expected %d", what, n, KVM_PROTO_ID_BYTES);
        memcpy(s + f->off, b, KVM_PROTO_ID_BYTES);
        return 0;
    }
    case KVM_PF_BIN: {
        kvm_proto_bytes v;
        uint32_t n;
        if ((rc = kvm_mpr__bin(r, &v.ptr, &n)) != 0) return kvm_dec__strbad(t, r, rc, what, f->max, "bin");
        if (n < f->min || n > f->max)
            return kvm_proto__fail(KVM_ERANGE, t, "%s has %u bytes, allowed %lld..%lld", what, n, (long long)f->min,
                                   (long long)f->max);
        v.len = n;
        memcpy(s + f->off, &v, sizeof v);
        return 0;
    }
    case KVM_PF_ID32_OPT: {
        const uint8_t *b;
        uint32_t n;
        if ((rc = kvm_mpr__bin(r, &b, &n)) != 0) return kvm_dec__bad(t, r, rc, what, "bin");
        if (n != KVM_PROTO_ID_BYTES)
            return kvm_proto__fail(KVM_EPROTO, t, "%s has %u bytes, expected %d", what, n, KVM_PROTO_ID_BYTES);
        memcpy(s + f->off, b, KVM_PROTO_ID_BYTES);
        *(bool *)(s + f->aux_off) = true;
        return 0;
    }
    case KVM_PF_SETTINGS: {
        if (kvm_mpr__kind(r) != KVM_MPK_MAP) return kvm_dec__bad(t, r, KVM_MPR_TYPE, what, "map");
        const uint8_t *start = r->p;
        if ((rc = kvm_mpr__skip(r)) != 0) return kvm_dec__bad(t, r, rc, what, "map");
        size_t n = (size_t)(r->p - start);
        memcpy(s + f->off, &start, sizeof start);
        memcpy(s + f->aux_off, &n, sizeof n);
        return 0;
    }
    case KVM_PF_NAMES: {
        uint32_t n;
        if ((rc = kvm_mpr__array(r, &n)) != 0) return kvm_dec__bad(t, r, rc, what, "array of str");
        if (n > KVM_PROTO_MAX_PATTERNS)
            return kvm_proto__fail(KVM_ERANGE, t, "%s lists %u names, limit %d", what, n, KVM_PROTO_MAX_PATTERNS);
        kvm_proto_str *names = (kvm_proto_str *)(void *)(s + f->off);
        for (uint32_t k = 0; k < n; k++) {
            uint32_t len;
            if ((rc = kvm_mpr__str(r, &names[k].ptr, &len)) != 0) return kvm_dec__bad(t, r, rc, what, "array of str");
            names[k].len = len;
        }
        int64_t cnt = n;
        memcpy(s + f->aux_off, &cnt, sizeof cnt);
        return 0;
    }
    default:
        return kvm_proto__fail(KVM_EINVAL, t, "%s: unknown field kind %d", what, f->kind);
    }
}

/* Parses one descriptor map of "tensors". */
static int kvm_dec__desc(kvm_proto_type t, kvm_mpr *r, uint32_t idx, kvm_desc *d)
{
    char what[64];
    snprintf(what, sizeof what, "tensors[%u]", idx);
    uint32_t n;
    int rc = kvm_mpr__map(r, &n);
    if (rc) return kvm_dec__bad(t, r, rc, what, "map");
    int have_name = 0, have_dtype = 0, have_shape = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if ((rc = kvm_mpr__str(r, &k, &kl)) != 0) return kvm_dec__bad(t, r, rc, what, "str key");
        if (kl == 4 && memcmp(k, "name", 4) == 0 && !have_name) {
            if ((rc = kvm_mpr__str(r, &d->name, &d->name_len)) != 0) return kvm_dec__bad(t, r, rc, what, "str name");
            have_name = 1;
        } else if (kl == 5 && memcmp(k, "dtype", 5) == 0 && !have_dtype) {
            const char *dn;
            uint32_t dl;
            if ((rc = kvm_mpr__str(r, &dn, &dl)) != 0) return kvm_dec__bad(t, r, rc, what, "str dtype");
            if (kvm_proto_dtype_parse(dn, dl, &d->dtype) != 0) {
                char q[64];
                kvm_proto__quote(q, sizeof q, dn, dl);
                return kvm_proto__fail(KVM_EPROTO, t, "%s: unknown dtype '%s'", what, q);
            }
            have_dtype = 1;
        } else if (kl == 5 && memcmp(k, "shape", 5) == 0 && !have_shape) {
            uint32_t nd;
            if ((rc = kvm_mpr__array(r, &nd)) != 0) return kvm_dec__bad(t, r, rc, what, "shape array");
            if (nd > KVM_PROTO_MAX_DIMS)
                return kvm_proto__fail(KVM_ERANGE, t, "%s: %u dimensions, limit %d", what, nd, KVM_PROTO_MAX_DIMS);
            d->ndim = (int)nd;
            for (uint32_t j = 0; j < nd; j++) {
                int neg;
                int64_t iv;
                uint64_t u;
                if ((rc = kvm_mpr__int(r, &neg, &iv, &u)) != 0) return kvm_dec__bad(t, r, rc, what, "uint dimension");
                if (neg || u > KVM_PROTO_MAX_FRAME_BYTES)
                    return kvm_proto__fail(KVM_ERANGE, t, "%s: dimension %u out of range [0, %llu]", what, j,
                                           (unsigned long long)KVM_PROTO_MAX_FRAME_BYTES);
                d->shape[j] = (int64_t)u;
            }
            have_shape = 1;
        } else if (kl == 4 && memcmp(k, "name", 4) == 0) {
            return kvm_proto__fail(KVM_EPROTO, t, "%s: duplicate key 'name'", what);
        } else if ((kl == 5 && memcmp(k, "dtype", 5) == 0) || (kl == 5 && memcmp(k, "shape", 5) == 0)) {
            return kvm_proto__fail(KVM_EPROTO, t, "%s: duplicate key", what);
        } else if ((rc = kvm_mpr__skip(r)) != 0) {
            return kvm_dec__bad(t, r, rc, what, "a value");
        }
    }
    if (!have_name || !have_dtype || !have_shape)
        return kvm_proto__fail(KVM_EPROTO, t, "%s: missing '%s'", what,
                               !have_name    ? "name"
                               : !have_dtype ? "dtype"
                                             : "shape");
    uint64_t bytes = kvm_proto_dtype_size(d->dtype);
    for (int j = 0; j < d->ndim; j++) {
        uint64_t dim = (uint64_t)d->shape[j];
        if (dim && bytes > KVM_PROTO_MAX_FRAME_BYTES / dim) {
            char q[64];
            kvm_proto__quote(q, sizeof q, d->name, d->name_len);
            return kvm_proto__fail(KVM_ERANGE, t, "tensor '%s': declared size exceeds %llu bytes", q,
                                   (unsigned long long)KVM_PROTO_MAX_FRAME_BYTES);
        }
        bytes *= dim;
    }
    d->nbytes = bytes;
    return 0;
}

static const kvm_proto__field *kvm_dec__find(const kvm_proto__spec *sp, const char *k, uint32_t kl, size_t *idx)
{
    for (size_t i = 0; i < sp->n_fields; i++) {
        if (strlen(sp->fields[i].key) == kl && memcmp(sp->fields[i].key, k, kl) == 0) {
            *idx = i;
            return &sp->fields[i];
        }
    }
    return NULL;
}

/* Frame 0: every field into s, the descriptors into d[*n_desc]. */
static int kvm_dec__header(const kvm_proto__spec *sp, kvm_frame f0, uint8_t *s, kvm_desc *d, uint32_t *n_desc)
{
    kvm_proto_type t = sp->type;
    kvm_mpr r = {f0.data, f0.data + f0.size};
    uint32_t n;
    int rc = kvm_mpr__map(&r, &n); /* the envelope pass already proved frame 0 is a whole map */
    if (rc) return kvm_dec__bad(t, &r, rc, "header", "map");
    uint64_t seen = 0;
    int have_tensors = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        size_t idx = 0;
        const kvm_proto__field *f;
        if ((rc = kvm_mpr__str(&r, &k, &kl)) != 0) return kvm_dec__bad(t, &r, rc, "header key", "str");
        if ((kl == 1 && k[0] == 'v') || (kl == 4 && memcmp(k, "type", 4) == 0)) {
            rc = kvm_mpr__skip(&r); /* checked by the envelope pass */
        } else if (kl == 7 && memcmp(k, "tensors", 7) == 0) {
            if (have_tensors) return kvm_proto__fail(KVM_EPROTO, t, "duplicate field 'tensors'");
            have_tensors = 1;
            uint32_t nt;
            if ((rc = kvm_mpr__array(&r, &nt)) != 0) return kvm_dec__bad(t, &r, rc, "field 'tensors'", "array");
            if (nt > KVM_PROTO_MAX_FRAMES - 1)
                return kvm_proto__fail(KVM_ERANGE, t, "field 'tensors' lists %u tensors, limit %d", nt,
                                       KVM_PROTO_MAX_FRAMES - 1);
            for (uint32_t j = 0; j < nt; j++)
                if ((rc = kvm_dec__desc(t, &r, j, &d[j])) != 0) return rc;
            *n_desc = nt;
        } else if ((f = kvm_dec__find(sp, k, kl, &idx)) != NULL) {
            if (seen & (1ull << idx)) return kvm_proto__fail(KVM_EPROTO, t, "duplicate field '%s'", f->key);
            seen |= 1ull << idx;
            if ((rc = kvm_dec__field(t, f, &r, s)) != 0) return rc;
        } else {
            rc = kvm_mpr__skip(&r); /* unknown field: ignored (forward compatibility) */
        }
        if (rc) return kvm_dec__bad(t, &r, rc, "header value", "a value");
    }
    for (size_t i = 0; i < sp->n_fields; i++)
        if (sp->fields[i].required && !(seen & (1ull << i)))
            return kvm_proto__fail(KVM_EPROTO, t, "missing field '%s'", sp->fields[i].key);
    return 0;
}

static int kvm_dec__shape_str(char *buf, size_t cap, const int64_t *shape, int ndim)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (int i = 0; i < ndim && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return 0;
}

/* Matches descriptors to frames and to the spec's tensors; sets pointers in s. */
static int kvm_dec__tensors(const kvm_proto__spec *sp, const kvm_msg *msg, uint8_t *s, const kvm_desc *d,
                            uint32_t n_desc)
{
    kvm_proto_type t = sp->type;
    size_t nf = kvm_msg_nframes(msg);
    if (n_desc + 1u > nf)
        return kvm_proto__fail(KVM_EPROTO, t, "missing frames: header lists %u tensors, message has %zu tensor frames",
                               n_desc, nf - 1);
    if (n_desc + 1u < nf)
        return kvm_proto__fail(KVM_EPROTO, t, "extra frames: header lists %u tensors, message has %zu tensor frames",
                               n_desc, nf - 1);
    unsigned found = 0;
    ptrdiff_t dt_off = -1;
    kvm_proto_dtype dt_val = KVM_PROTO_F32;
    for (uint32_t j = 0; j < n_desc; j++) {
        char q[64];
        kvm_proto__quote(q, sizeof q, d[j].name, d[j].name_len);
        for (uint32_t k = 0; k < j; k++)
            if (d[k].name_len == d[j].name_len && memcmp(d[k].name, d[j].name, d[j].name_len) == 0)
                return kvm_proto__fail(KVM_EPROTO, t, "tensor '%s' listed twice", q);
        kvm_frame f = kvm_msg_frame(msg, j + 1);
        const kvm_proto__tensor *ts = NULL;
        size_t ti = 0;
        for (; ti < sp->n_tensors; ti++)
            if (strlen(sp->tensors[ti].name) == d[j].name_len &&
                memcmp(sp->tensors[ti].name, d[j].name, d[j].name_len) == 0) {
                ts = &sp->tensors[ti];
                break;
            }
        if (ts) {
            if (!(ts->dtypes & KVM_PROTO__BIT(d[j].dtype)))
                return kvm_proto__fail(KVM_EPROTO, t, "tensor '%s': dtype %s not allowed here", q,
                                       kvm_proto_dtype_name(d[j].dtype));
            int64_t want[KVM_PROTO_MAX_DIMS];
            int ok = d[j].ndim == ts->ndim;
            for (int k = 0; k < ts->ndim; k++) {
                memcpy(&want[k], s + ts->dims[k], sizeof want[k]);
                if (ok && d[j].shape[k] != want[k]) ok = 0;
            }
            if (!ok) {
                char got[128], exp[128];
                kvm_dec__shape_str(got, sizeof got, d[j].shape, d[j].ndim);
                kvm_dec__shape_str(exp, sizeof exp, want, ts->ndim);
                return kvm_proto__fail(KVM_EPROTO, t, "tensor '%s': shape %s does not match [%s] = %s", q, got,
                                       ts->dim_names, exp);
            }
        }
        if (f.size != d[j].nbytes)
            return kvm_proto__fail(KVM_EPROTO, t, "tensor '%s': frame %u has %zu bytes, shape x %s needs %llu", q,
                                   j + 1, f.size, kvm_proto_dtype_name(d[j].dtype), (unsigned long long)d[j].nbytes);
        if (!ts) continue; /* unknown tensor: length checked, otherwise ignored */
        if (f.size && ((uintptr_t)f.data % kvm_proto_dtype_size(d[j].dtype)) != 0)
            return kvm_proto__fail(KVM_EPROTO, t, "tensor '%s': frame %u is not aligned to %zu bytes", q, j + 1,
                                   kvm_proto_dtype_size(d[j].dtype));
        if (ts->dtype_off >= 0) {
            if (dt_off == ts->dtype_off && dt_val != d[j].dtype)
                return kvm_proto__fail(KVM_EPROTO, t, "tensor '%s': dtype %s differs from %s of an earlier tensor", q,
                                       kvm_proto_dtype_name(d[j].dtype), kvm_proto_dtype_name(dt_val));
            dt_off = ts->dtype_off;
            dt_val = d[j].dtype;
            memcpy(s + ts->dtype_off, &dt_val, sizeof dt_val);
        }
        const void *p = f.data;
        memcpy(s + ts->off, &p, sizeof p);
        found |= 1u << ti;
    }
    for (size_t ti = 0; ti < sp->n_tensors; ti++)
        if (sp->tensors[ti].required && !(found & (1u << ti)))
            return kvm_proto__fail(KVM_EPROTO, t, "missing tensor '%s'", sp->tensors[ti].name);
    return 0;
}

static int kvm_dec__all(const kvm_proto__spec *sp, const kvm_msg *msg, uint8_t *s)
{
    kvm_proto_type t = sp->type, got;
    int rc = kvm_proto__envelope(msg, &got);
    if (rc) {
        /* a field's value the envelope pass could not skip (a string declaring more bytes than
         * there are): the field pass knows that field's limit, and says it when it is exceeded */
        kvm_frame f0 = kvm_msg_frame(msg, 0);
        char env[900];
        snprintf(env, sizeof env, "%s", kvm_errmsg());
        if (kvm_msg_nframes(msg) > 0 && f0.size > 0 && f0.size <= KVM_PROTO_MAX_HEADER_BYTES) {
            kvm_desc d[KVM_PROTO_MAX_FRAMES];
            uint32_t n_desc = 0;
            int frc = kvm_dec__header(sp, f0, s, d, &n_desc);
            if (frc == KVM_ERANGE) return frc;
        }
        return kvm_proto__fail(rc, t, "%s", env);
    }
    if (got != t)
        return kvm_proto__fail(KVM_EPROTO, t, "expected message type '%s', got '%s'", kvm_proto_type_name(t),
                               kvm_proto_type_name(got));
    size_t nf = kvm_msg_nframes(msg);
    if (nf > KVM_PROTO_MAX_FRAMES)
        return kvm_proto__fail(KVM_ERANGE, t, "extra frames: %zu frames, limit %d", nf, KVM_PROTO_MAX_FRAMES);
    kvm_desc d[KVM_PROTO_MAX_FRAMES];
    uint32_t n_desc = 0;
    memset(d, 0, sizeof d);
    if ((rc = kvm_dec__header(sp, kvm_msg_frame(msg, 0), s, d, &n_desc)) != 0) return rc;
    if ((rc = kvm_proto__check_values(sp, s)) != 0) return rc;
    if (sp->check_fields && (rc = sp->check_fields(s)) != 0) return rc;
    if ((rc = kvm_dec__tensors(sp, msg, s, d, n_desc)) != 0) return rc;
    if (sp->check_tensors && (rc = sp->check_tensors(s)) != 0) return rc;
    return 0;
}

int kvm_proto__decode(const kvm_proto__spec *sp, const kvm_msg *msg, void *s)
{
    if (!s) return kvm_proto__fail(KVM_EINVAL, sp->type, "decode: out is NULL");
    memset(s, 0, sp->struct_size);
    if (!msg) return kvm_proto__fail(KVM_EINVAL, sp->type, "decode: msg is NULL");
    int rc = kvm_dec__all(sp, msg, s);
    if (rc) memset(s, 0, sp->struct_size);
    return rc;
}
