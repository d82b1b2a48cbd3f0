/* kvm_mpack_internal.h: a strict, allocation-free MessagePack reader over one borrowed byte
 * range, used by the proto decoders instead of msgpack_unpack_next: nothing is allocated in
 * proportion to counts a peer declares, every read is bounds-checked, nesting is limited.
 * Internal to proto/. */
#ifndef KVM_MPACK_INTERNAL_H
#define KVM_MPACK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

/* Most nested containers kvm_mpr__skip follows. */
#define KVM_MPR_MAX_DEPTH 32

/* Reader results: 0, or one of these (no detail message is set; callers name the field). */
#define KVM_MPR_TRUNC (-1) /* the value runs past the end of the range */
#define KVM_MPR_TYPE (-2)  /* the next value has another MessagePack type */
#define KVM_MPR_DEEP (-3)  /* nesting deeper than KVM_MPR_MAX_DEPTH */

/* Kinds of the next value (kvm_mpr__kind). */
enum kvm_mpr_kind {
    KVM_MPK_END,
    KVM_MPK_NIL,
    KVM_MPK_BOOL,
    KVM_MPK_UINT,
    KVM_MPK_NEGINT,
    KVM_MPK_FLOAT,
    KVM_MPK_STR,
    KVM_MPK_BIN,
    KVM_MPK_ARRAY,
    KVM_MPK_MAP,
    KVM_MPK_EXT,
    KVM_MPK_INVALID
};

/* A read cursor: [p, end). */
typedef struct kvm_mpr {
    const uint8_t *p;   /* next byte */
    const uint8_t *end; /* one past the last byte */
} kvm_mpr;

/* Kind of the next value (KVM_MPK_END at the end). For ints: UINT when the value is >= 0,
 * NEGINT when < 0, whatever the encoding. */
int kvm_mpr__kind(const kvm_mpr *r);
/* Name of a kind for messages ("map", "str", ...). */
const char *kvm_mpr__kind_name(int kind);

/* Each reads one value of its type and advances; on failure r is unchanged. */
int kvm_mpr__map(kvm_mpr *r, uint32_t *n);
int kvm_mpr__array(kvm_mpr *r, uint32_t *n);
int kvm_mpr__str(kvm_mpr *r, const char **s, uint32_t *len);
int kvm_mpr__bin(kvm_mpr *r, const uint8_t **b, uint32_t *len);
int kvm_mpr__bool(kvm_mpr *r, int *v);
/* The length a str or bin at r declares, read from its header only (r does not move), and
 * the bytes left after that header (left may be NULL), so a caller can say how long a value
 * that does not fit is. Errors: KVM_MPR_TYPE (not str/bin), KVM_MPR_TRUNC (the length bytes
 * themselves are cut off). */
int kvm_mpr__declared_len(const kvm_mpr *r, uint32_t *len, size_t *left);
/* Any integer: *neg = 1 and *i when negative, else *neg = 0 and *u. */
int kvm_mpr__int(kvm_mpr *r, int *neg, int64_t *i, uint64_t *u);
/* float32, float64 or any integer, as a double. */
int kvm_mpr__float(kvm_mpr *r, double *v);
/* Skips one value of any type (containers recursively, at most KVM_MPR_MAX_DEPTH deep). */
int kvm_mpr__skip(kvm_mpr *r);

#endif
