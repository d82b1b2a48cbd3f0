/* kvm_dtype.h: element types of wire tensors (proto/PROTOCOL.md §3) and their names.
 * Every tensor frame is raw little-endian elements of one of these types. */
#ifndef KVM_DTYPE_H
#define KVM_DTYPE_H

#include <stddef.h>

/* Element type of a tensor frame. The numeric values are internal (never on the wire, where
 * the dtype travels as its name: "f32", "f16", "bf16", "i32"). */
typedef enum kvm_proto_dtype {
    KVM_PROTO_F32 = 0,  /* IEEE 754 binary32 */
    KVM_PROTO_F16 = 1,  /* IEEE 754 binary16 (stored as uint16_t bits) */
    KVM_PROTO_BF16 = 2, /* bfloat16: the top 16 bits of a binary32 (stored as uint16_t) */
    KVM_PROTO_I32 = 3,  /* two's complement int32 */
} kvm_proto_dtype;

/* Number of dtypes; valid values are [0, KVM_PROTO_N_DTYPES). */
#define KVM_PROTO_N_DTYPES 4

/* Bytes per element (4, 2, 2, 4), or 0 for a value outside the enum. Thread-safe. */
size_t kvm_proto_dtype_size(kvm_proto_dtype dtype);

/* Wire name ("f32", "f16", "bf16", "i32"), or "?" for a value outside the enum. Never NULL. */
const char *kvm_proto_dtype_name(kvm_proto_dtype dtype);

/* Parses a wire name of `len` bytes (not NUL-terminated). Returns 0 and sets *out, or
 * KVM_EPROTO (detail names the unknown dtype) when the name is not one of the four. */
int kvm_proto_dtype_parse(const char *name, size_t len, kvm_proto_dtype *out);

#endif
