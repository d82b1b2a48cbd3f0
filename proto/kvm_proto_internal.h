/* kvm_proto_internal.h: the table-driven codec behind every kvm_proto_<type>_encode/decode.
 * Each message type is a spec (fields with kinds, offsets and ranges; tensors with dtypes and
 * shapes named by size fields; two check hooks), and one engine encodes or decodes any spec,
 * so every type gets the same validation. Internal to proto/. */
#ifndef KVM_PROTO_INTERNAL_H
#define KVM_PROTO_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "proto/kvm_proto.h"

/* Field kinds: MessagePack type on the wire -> C member type. */
enum kvm_proto__kind {
    KVM_PF_U64,      /* uint -> uint64_t, any value */
    KVM_PF_I64,      /* int  -> int64_t, [min, max] */
    KVM_PF_I32,      /* int  -> int32_t, [min, max] */
    KVM_PF_F64,      /* float (or int) -> double, finite, [fmin, fmax] */
    KVM_PF_BOOL,     /* bool -> bool */
    KVM_PF_STR,      /* str  -> kvm_proto_str, length [min, max] bytes, UTF-8, no NUL */
    KVM_PF_ID32,     /* bin 32 -> uint8_t[32] */
    KVM_PF_SETTINGS, /* map str -> scalar -> const uint8_t * raw bytes + size_t at aux_off */
    KVM_PF_NAMES,    /* [str] -> kvm_proto_str[MAX_PATTERNS] + int64_t count at aux_off */
    KVM_PF_BIN,      /* bin  -> kvm_proto_bytes, length [min, max]; optional ones are written
                        only when len > 0 */
    KVM_PF_ID32_OPT, /* bin 32 -> uint8_t[32] + bool presence at aux_off (written when true) */
};

/* One header field of a message type. */
typedef struct kvm_proto__field {
    const char *key;   /* MessagePack map key */
    int kind;          /* enum kvm_proto__kind */
    size_t off;        /* offsetof the struct member */
    int required;      /* 1: decode fails when absent; 0: default (zero / empty) */
    int64_t min, max;  /* I64/I32: value range; STR: length range in bytes */
    double fmin, fmax; /* F64: value range */
    size_t aux_off;    /* SETTINGS: offsetof the size_t byte count; NAMES: of the int64_t count */
} kvm_proto__field;

/* One tensor of a message type. */
typedef struct kvm_proto__tensor {
    const char *name;                /* "name" in the descriptor */
    unsigned dtypes;                 /* allowed dtypes, bit (1u << kvm_proto_dtype) */
    size_t off;                      /* offsetof the data pointer member */
    ptrdiff_t dtype_off;             /* offsetof a kvm_proto_dtype member, or -1 when dtypes has one bit */
    int required;                    /* 1: must be present; 0: optional (pointer NULL when absent) */
    int ndim;                        /* dimensions, 1..KVM_PROTO_MAX_DIMS */
    size_t dims[KVM_PROTO_MAX_DIMS]; /* offsetof the int64_t size members giving the shape */
    const char *dim_names;           /* "n_kv_heads, n_tokens, head_dim", for messages */
} kvm_proto__tensor;

/* A message type. */
typedef struct kvm_proto__spec {
    kvm_proto_type type;
    size_t struct_size;
    const kvm_proto__field *fields;
    size_t n_fields;
    const kvm_proto__tensor *tensors;
    size_t n_tensors;
    /* relations between header fields, after each field's own range (NULL: none) */
    int (*check_fields)(const void *s);
    /* contents of tensors (counts, positions, indices), after shapes (NULL: none) */
    int (*check_tensors)(const void *s);
} kvm_proto__spec;

#define KVM_PROTO__BIT(dt) (1u << (dt))
#define KVM_PROTO__FLOATS                                                                                              \
    (KVM_PROTO__BIT(KVM_PROTO_F32) | KVM_PROTO__BIT(KVM_PROTO_F16) | KVM_PROTO__BIT(KVM_PROTO_BF16))

/* Table rows; the wire key is the member's name. */
#define KVM_F_U64(T, m, req)                                                                                           \
    {                                                                                                                  \
#m, KVM_PF_U64, offsetof(T, m), req, 0, 0, 0.0, 0.0, 0                                                         \
    }
#define KVM_F_I64(T, m, req, lo, hi)                                                                                   \
    {                                                                                                                  \
#m, KVM_PF_I64, offsetof(T, m), req, lo, hi, 0.0, 0.0, 0                                                       \
    }
#define KVM_F_I32(T, m, req, lo, hi)                                                                                   \
    {                                                                                                                  \
#m, KVM_PF_I32, offsetof(T, m), req, lo, hi, 0.0, 0.0, 0                                                       \
    }
#define KVM_F_F64(T, m, req, lo, hi)                                                                                   \
    {                                                                                                                  \
#m, KVM_PF_F64, offsetof(T, m), req, 0, 0, lo, hi, 0                                                           \
    }
#define KVM_F_BOOL(T, m, req)                                                                                          \
    {                                                                                                                  \
#m, KVM_PF_BOOL, offsetof(T, m), req, 0, 0, 0.0, 0.0, 0                                                        \
    }
#define KVM_F_STR(T, m, req, lo, hi)                                                                                   \
    {                                                                                                                  \
#m, KVM_PF_STR, offsetof(T, m), req, lo, hi, 0.0, 0.0, 0                                                       \
    }
#define KVM_F_ID32(T, m, req)                                                                                          \
    {                                                                                                                  \
#m, KVM_PF_ID32, offsetof(T, m), req, 0, 0, 0.0, 0.0, 0                                                        \
    }
#define KVM_F_BIN(T, m, req, lo, hi)                                                                                   \
    {                                                                                                                  \
#m, KVM_PF_BIN, offsetof(T, m), req, lo, hi, 0.0, 0.0, 0                                                       \
    }
#define KVM_F_ID32_OPT(T, m, flag)                                                                                     \
    {                                                                                                                  \
#m, KVM_PF_ID32_OPT, offsetof(T, m), 0, 0, 0, 0.0, 0.0, offsetof(T, flag)                                      \
    }
#define KVM_F_SETTINGS(T, m, nbytes)                                                                                   \
    {                                                                                                                  \
#m, KVM_PF_SETTINGS, offsetof(T, m), 0, 0, 0, 0.0, 0.0, offsetof(T, nbytes)                                    \
    }
#define KVM_F_NAMES(T, m, count)                                                                                       \
    {                                                                                                                  \
#m, KVM_PF_NAMES, offsetof(T, m), 1, 0, 0, 0.0, 0.0, offsetof(T, count)                                        \
    }
/* A tensor row: member m, allowed dtypes, dtype member offset or -1, required, shape. */
#define KVM_T(T, m, dtypes, dt_off, req, dim_names, ndim, ...)                                                         \
    {                                                                                                                  \
#m, dtypes, offsetof(T, m), dt_off, req, ndim, {__VA_ARGS__ }, dim_names                                       \
    }
#define KVM_PROTO__N(a) (sizeof(a) / sizeof((a)[0]))

/* Encodes s (a struct of spec's type) into a new message. See kvm_proto.h. */
int kvm_proto__encode(const kvm_proto__spec *spec, const void *s, kvm_msg **out);
/* Decodes msg into s (a struct of spec's type). See kvm_proto.h. */
int kvm_proto__decode(const kvm_proto__spec *spec, const kvm_msg *msg, void *s);

/* Checks each field's own range and string rules on a filled struct (used by both). */
int kvm_proto__check_values(const kvm_proto__spec *spec, const void *s);
/* Validates a settings map at [p, p+n): returns 0 or KVM_EPROTO/KVM_ERANGE naming the entry. */
int kvm_proto__check_settings(const char *tname, const uint8_t *p, size_t n);
/* Checks a string: length <= max, UTF-8, no NUL. Errors: KVM_ERANGE, KVM_EPROTO. */
int kvm_proto__check_str(const char *tname, const char *field, const char *s, size_t len, int64_t min, int64_t max);

/* Checks every element of an i32 tensor lies in [lo, hi]; the detail names tensor and index.
 * Errors: KVM_ERANGE. */
int kvm_proto__check_i32(kvm_proto_type t, const char *tensor, const int32_t *a, int64_t n, int64_t lo, int64_t hi);

/* kvm_err with the message type's name in front: "kv: ...". */
int kvm_proto__fail(int status, kvm_proto_type type, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Writes a printable, shortened copy of untrusted bytes into dst (for detail messages). */
void kvm_proto__quote(char *dst, size_t cap, const char *s, size_t n);

/* Detail for a header value that could not be read as a str/bin (kvm_mpr result rc at r):
 * a declared length beyond `limit` (0: none) is "too long: the limit is N bytes"
 * (KVM_ERANGE); one past the end of the header is a truncated header (KVM_EPROTO); otherwise
 * the wrong type, "`what` is KIND, expected `expected`". prefix goes in front ("header: "). */
struct kvm_mpr;
int kvm_proto__str_fail(const struct kvm_mpr *r, int rc, const char *prefix, const char *what, uint64_t limit,
                        const char *expected);

/* Parses the envelope of frame 0 ("v" and "type"); see kvm_proto_peek. */
int kvm_proto__envelope(const kvm_msg *msg, kvm_proto_type *type);

#endif
