/* kvm_proto_common.c: what every message type shares: type names, strings, the "v"/"type"
 * envelope and peek, detail messages, and the per-field range and string checks. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"
#include "proto/kvm_mpack_internal.h"
#include "proto/kvm_proto_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvmill wire tensors are little-endian; this host is not (PROTOCOL.md section 3)"
#endif

static const char *const kvm_proto__type_names[] = {
    NULL,    "job",   "kv",        "stats", "strategy",  "cache", "result",
    "error", "ready", "heartbeat", "ack",   "get_cache", "ask",   "answer",
    "put_cache", "store_reply", "get_strategy", "claim", "renew_claims",
};

const char *kvm_proto_type_name(kvm_proto_type type)
{
    if ((int)type < KVM_PROTO_TYPE_FIRST || (int)type > KVM_PROTO_TYPE_LAST) return "?";
    return kvm_proto__type_names[type];
}

kvm_proto_str kvm_proto_str_c(const char *s)
{
    kvm_proto_str r = {s ? s : "", s ? strlen(s) : 0};
    return r;
}

char *kvm_proto_str_dup(kvm_proto_str s)
{
    char *d = malloc(s.len + 1);
    if (!d) return NULL;
    if (s.len) memcpy(d, s.ptr, s.len);
    d[s.len] = '\0';
    return d;
}

int kvm_proto_str_eq(kvm_proto_str s, const char *c)
{
    size_t n = c ? strlen(c) : 0;
    return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

int kvm_proto__fail(int status, kvm_proto_type type, const char *fmt, ...)
{
    char buf[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return kvm_err(status, "%s: %s", kvm_proto_type_name(type), buf);
}

void kvm_proto__quote(char *dst, size_t cap, const char *s, size_t n)
{
    size_t o = 0, lim = 48;
    for (size_t i = 0; i < n && i < lim && o + 1 < cap; i++)
        dst[o++] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (n > lim && o + 4 < cap) {
        memcpy(dst + o, "...", 3);
        o += 3;
    }
    if (cap) dst[o < cap ? o : cap - 1] = '\0';
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when invalid (RFC 3629). */
static size_t kvm_proto__utf8_seq(const uint8_t *s, size_t left)
{
    uint8_t c = s[0];
    if (c < 0x80) return c ? 1 : 0; /* NUL is refused as well */
    size_t n;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
        n = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
        n = 4, cp = c & 0x07;
    else
        return 0;
    if (left < n) return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return n;
}

kvm_proto_str kvm_proto_str_utf8(const char *s, char *buf, size_t cap)
{
    if (!cap) return (kvm_proto_str){buf, 0};
    const uint8_t *p = (const uint8_t *)(s ? s : "");
    size_t n = 0, rest = strlen((const char *)p);
    while (rest > 0) {
        size_t len = kvm_proto__utf8_seq(p, rest);
        if (n + (len ? len : 1) >= cap) break; /* the whole character and the NUL, or nothing */
        if (len == 0)
            buf[n++] = '?', len = 1;
        else
            memcpy(buf + n, p, len), n += len;
        p += len, rest -= len;
    }
    buf[n] = '\0';
    return (kvm_proto_str){buf, n};
}

int kvm_proto__check_str(const char *tname, const char *field, const char *s, size_t len, int64_t min, int64_t max)
{
    if ((int64_t)len < min || len > (uint64_t)max)
        return kvm_err(KVM_ERANGE, "%s: field '%s': %zu bytes, allowed %lld..%lld", tname, field, len, (long long)min,
                       (long long)max);
    if (len && !s) return kvm_err(KVM_EINVAL, "%s: field '%s': NULL with length %zu", tname, field, len);
    const uint8_t *u = (const uint8_t *)s;
    for (size_t i = 0; i < len;) {
        size_t n = kvm_proto__utf8_seq(u + i, len - i);
        if (!n) return kvm_err(KVM_EPROTO, "%s: field '%s': invalid UTF-8 or NUL at byte %zu", tname, field, i);
        i += n;
    }
    return 0;
}

int kvm_proto__check_settings(const char *tname, const uint8_t *p, size_t n)
{
    kvm_mpr r = {p, p + n};
    uint32_t count;
    int rc = kvm_mpr__map(&r, &count);
    if (rc)
        return kvm_err(KVM_EPROTO, "%s: field 'settings': expected map, got %s", tname,
                       kvm_mpr__kind_name(kvm_mpr__kind(&r)));
    if (count > KVM_PROTO_MAX_SETTINGS)
        return kvm_err(KVM_ERANGE, "%s: field 'settings': %u entries, limit %d", tname, count, KVM_PROTO_MAX_SETTINGS);
    for (uint32_t i = 0; i < count; i++) {
        const char *k;
        uint32_t kl;
        if ((rc = kvm_mpr__str(&r, &k, &kl)) != 0)
            return kvm_err(KVM_EPROTO, "%s: field 'settings': entry %u: key is %s, expected str", tname, i,
                           rc == KVM_MPR_TRUNC ? "truncated" : kvm_mpr__kind_name(kvm_mpr__kind(&r)));
        char key[64];
        kvm_proto__quote(key, sizeof key, k, kl);
        if ((rc = kvm_proto__check_str(tname, "settings key", k, kl, 1, KVM_PROTO_MAX_NAME_BYTES)) != 0) return rc;
        int kind = kvm_mpr__kind(&r);
        if (kind == KVM_MPK_STR) {
            const char *v;
            uint32_t vl;
            if (kvm_mpr__str(&r, &v, &vl) != 0)
                return kvm_err(KVM_EPROTO, "%s: field 'settings': value of '%s' is truncated", tname, key);
            if ((rc = kvm_proto__check_str(tname, "settings value", v, vl, 0, KVM_PROTO_MAX_NAME_BYTES)) != 0)
                return rc;
        } else if (kind == KVM_MPK_NIL || kind == KVM_MPK_BOOL || kind == KVM_MPK_UINT || kind == KVM_MPK_NEGINT ||
                   kind == KVM_MPK_FLOAT) {
            if (kvm_mpr__skip(&r) != 0)
                return kvm_err(KVM_EPROTO, "%s: field 'settings': value of '%s' is truncated", tname, key);
        } else {
            return kvm_err(KVM_EPROTO, "%s: field 'settings': value of '%s' is %s, expected a scalar", tname, key,
                           kvm_mpr__kind_name(kind));
        }
    }
    if (r.p != r.end)
        return kvm_err(KVM_EPROTO, "%s: field 'settings': %zu bytes after the map", tname, (size_t)(r.end - r.p));
    return 0;
}

int kvm_proto__check_values(const kvm_proto__spec *spec, const void *s)
{
    const char *tn = kvm_proto_type_name(spec->type);
    const uint8_t *b = s;
    for (size_t i = 0; i < spec->n_fields; i++) {
        const kvm_proto__field *f = &spec->fields[i];
        const void *m = b + f->off;
        int rc = 0;
        switch (f->kind) {
        case KVM_PF_I64:
        case KVM_PF_I32: {
            int64_t v;
            if (f->kind == KVM_PF_I64)
                memcpy(&v, m, sizeof v);
            else {
                int32_t v32;
                memcpy(&v32, m, sizeof v32);
                v = v32;
            }
            if (v < f->min || v > f->max)
                rc = kvm_err(KVM_ERANGE, "%s: field '%s' = %lld out of range [%lld, %lld]", tn, f->key, (long long)v,
                             (long long)f->min, (long long)f->max);
            break;
        }
        case KVM_PF_F64: {
            double v;
            memcpy(&v, m, sizeof v);
            if (!isfinite(v) || v < f->fmin || v > f->fmax)
                rc = kvm_err(KVM_ERANGE, "%s: field '%s' = %g out of range [%g, %g]", tn, f->key, v, f->fmin, f->fmax);
            break;
        }
        case KVM_PF_STR: {
            kvm_proto_str v;
            memcpy(&v, m, sizeof v);
            rc = kvm_proto__check_str(tn, f->key, v.ptr, v.len, f->min, f->max);
            break;
        }
        case KVM_PF_BIN: {
            kvm_proto_bytes v;
            memcpy(&v, m, sizeof v);
            if (v.len && !v.ptr)
                rc = kvm_err(KVM_EINVAL, "%s: field '%s': NULL with length %zu", tn, f->key, v.len);
            else if ((v.len || f->required) && ((int64_t)v.len < f->min || v.len > (uint64_t)f->max))
                rc = kvm_err(KVM_ERANGE, "%s: field '%s': %zu bytes, allowed %lld..%lld", tn, f->key, v.len,
                             (long long)f->min, (long long)f->max);
            break;
        }
        case KVM_PF_SETTINGS: {
            const uint8_t *p;
            size_t n;
            memcpy(&p, m, sizeof p);
            memcpy(&n, b + f->aux_off, sizeof n);
            if (p)
                rc = kvm_proto__check_settings(tn, p, n);
            else if (n)
                rc = kvm_err(KVM_EINVAL, "%s: field '%s': NULL with %zu bytes", tn, f->key, n);
            break;
        }
        case KVM_PF_NAMES: {
            int64_t n;
            memcpy(&n, b + f->aux_off, sizeof n);
            if (n < 1 || n > KVM_PROTO_MAX_PATTERNS) {
                rc = kvm_err(KVM_ERANGE, "%s: field '%s': %lld names, allowed 1..%d", tn, f->key, (long long)n,
                             KVM_PROTO_MAX_PATTERNS);
                break;
            }
            const kvm_proto_str *names = m;
            for (int64_t k = 0; k < n && rc == 0; k++) {
                rc = kvm_proto__check_str(tn, f->key, names[k].ptr, names[k].len, 1, KVM_PROTO_MAX_PATTERN_BYTES);
                for (int64_t j = 0; j < k && rc == 0; j++)
                    if (names[j].len == names[k].len && memcmp(names[j].ptr, names[k].ptr, names[k].len) == 0)
                        rc = kvm_err(KVM_EPROTO, "%s: field '%s': name %lld repeats name %lld", tn, f->key,
                                     (long long)k, (long long)j);
            }
            break;
        }
        default:
            break; /* U64, BOOL, ID32: every value is valid */
        }
        if (rc) return rc;
    }
    return 0;
}

int kvm_proto__str_fail(const kvm_mpr *r, int rc, const char *prefix, const char *what, uint64_t limit,
                        const char *expected)
{
    uint32_t len;
    size_t left = 0;
    int kind = kvm_mpr__kind(r);
    /* the envelope's prefix "header: " says the same as "truncated header: " */
    const char *tp = strcmp(prefix, "header: ") ? prefix : "";
    if (rc == KVM_MPR_TRUNC && (kind == KVM_MPK_STR || kind == KVM_MPK_BIN) &&
        kvm_mpr__declared_len(r, &len, &left) == 0) {
        if (limit && len > limit)
            return kvm_err(KVM_ERANGE, "%s%s is a %s of %u bytes, too long: the limit is %llu bytes", prefix, what,
                           kvm_mpr__kind_name(kind), len, (unsigned long long)limit);
        return kvm_err(KVM_EPROTO, "%struncated header: %s is a %s of %u bytes, but only %zu bytes are left", tp, what,
                       kvm_mpr__kind_name(kind), len, left);
    }
    if (rc == KVM_MPR_TRUNC) return kvm_err(KVM_EPROTO, "%struncated header: %s is cut short", tp, what);
    if (rc == KVM_MPR_DEEP) return kvm_err(KVM_EPROTO, "%s%s nests deeper than %d", prefix, what, KVM_MPR_MAX_DEPTH);
    return kvm_err(KVM_EPROTO, "%s%s is %s, expected %s", prefix, what, kvm_mpr__kind_name(kind), expected);
}

/* Reads "v" and "type" of a header map; other keys are skipped. */
int kvm_proto__envelope(const kvm_msg *msg, kvm_proto_type *type)
{
    if (!msg || !type) return kvm_err(KVM_EINVAL, "kvm_proto_peek: NULL argument");
    if (kvm_msg_nframes(msg) == 0) return kvm_err(KVM_EPROTO, "message has no frames (header frame 0 missing)");
    kvm_frame f0 = kvm_msg_frame(msg, 0);
    if (f0.size == 0) return kvm_err(KVM_EPROTO, "truncated header: frame 0 is empty");
    if (f0.size > KVM_PROTO_MAX_HEADER_BYTES)
        return kvm_err(KVM_ERANGE, "header: frame 0 has %zu bytes, limit %u", f0.size, KVM_PROTO_MAX_HEADER_BYTES);
    kvm_mpr r = {f0.data, f0.data + f0.size};
    uint32_t n;
    int rc = kvm_mpr__map(&r, &n);
    if (rc == KVM_MPR_TRUNC) return kvm_err(KVM_EPROTO, "truncated header: map header cut short");
    if (rc)
        return kvm_err(KVM_EPROTO, "header: frame 0 is %s, expected a MessagePack map",
                       kvm_mpr__kind_name(kvm_mpr__kind(&r)));
    int have_v = 0;
    uint64_t version = 0;
    const char *tname = NULL;
    uint32_t tlen = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if ((rc = kvm_mpr__str(&r, &k, &kl)) != 0) {
            char what[32];
            snprintf(what, sizeof what, "key %u", i);
            return kvm_proto__str_fail(&r, rc, "header: ", what, 0, "str");
        }
        if (kl == 1 && k[0] == 'v') {
            int neg;
            int64_t iv;
            if (have_v) return kvm_err(KVM_EPROTO, "header: duplicate field 'v'");
            if ((rc = kvm_mpr__int(&r, &neg, &iv, &version)) != 0)
                return kvm_err(KVM_EPROTO, "header: field 'v' is %s, expected unsigned int",
                               kvm_mpr__kind_name(kvm_mpr__kind(&r)));
            if (neg) return kvm_err(KVM_EPROTO, "header: unsupported protocol version %lld", (long long)iv);
            have_v = 1;
        } else if (kl == 4 && memcmp(k, "type", 4) == 0) {
            if (tname) return kvm_err(KVM_EPROTO, "header: duplicate field 'type'");
            if ((rc = kvm_mpr__str(&r, &tname, &tlen)) != 0)
                return kvm_proto__str_fail(&r, rc, "header: ", "field 'type'", KVM_PROTO_MAX_TYPE_BYTES, "str");
            if (tlen > KVM_PROTO_MAX_TYPE_BYTES)
                return kvm_err(KVM_ERANGE, "header: field 'type' is a str of %u bytes, too long: the limit is %d bytes",
                               tlen, KVM_PROTO_MAX_TYPE_BYTES);
        } else if ((rc = kvm_mpr__skip(&r)) != 0) {
            char q[64], what[96];
            kvm_proto__quote(q, sizeof q, k, kl);
            snprintf(what, sizeof what, "field '%s'", q);
            uint32_t len;
            size_t left;
            if (rc == KVM_MPR_TRUNC && kvm_mpr__declared_len(&r, &len, &left) == 0)
                return kvm_proto__str_fail(&r, rc, "header: ", what, 0, "a value");
            return kvm_err(KVM_EPROTO, "truncated header: value of field '%s' is cut short or too deep", q);
        }
    }
    if (r.p != r.end) return kvm_err(KVM_EPROTO, "header: %zu trailing bytes after the map", (size_t)(r.end - r.p));
    if (!have_v) return kvm_err(KVM_EPROTO, "header: missing field 'v' (protocol version)");
    if (version != KVM_PROTO_VERSION)
        return kvm_err(KVM_EPROTO, "header: unsupported protocol version %llu (this build speaks %d)",
                       (unsigned long long)version, KVM_PROTO_VERSION);
    if (!tname) return kvm_err(KVM_EPROTO, "header: missing field 'type'");
    for (int t = KVM_PROTO_TYPE_FIRST; t <= KVM_PROTO_TYPE_LAST; t++) {
        if (strlen(kvm_proto__type_names[t]) == tlen && memcmp(kvm_proto__type_names[t], tname, tlen) == 0) {
            *type = (kvm_proto_type)t;
            return 0;
        }
    }
    char q[64];
    kvm_proto__quote(q, sizeof q, tname, tlen);
    return kvm_err(KVM_EPROTO, "header: unknown message type '%s'", q);
}

int kvm_proto_peek(const kvm_msg *msg, kvm_proto_type *type) { return kvm_proto__envelope(msg, type); }

int kvm_proto__check_i32(kvm_proto_type t, const char *tensor, const int32_t *a, int64_t n, int64_t lo, int64_t hi)
{
    for (int64_t i = 0; i < n; i++)
        if (a[i] < lo || a[i] > hi)
            return kvm_proto__fail(KVM_ERANGE, t, "tensor '%s'[%lld] = %d out of range [%lld, %lld]", tensor,
                                   (long long)i, (int)a[i], (long long)lo, (long long)hi);
    return 0;
}
