/* kvm_half.h: conversions between f32 and the 16-bit float formats kept in caches and on
 * the wire (IEEE binary16 "f16", bfloat16 "bf16"). f32 -> 16 bit rounds to nearest, ties to
 * even; 16 bit -> f32 is exact. Pure functions, thread-safe. */
#ifndef KVM_HALF_H
#define KVM_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "proto/kvm_dtype.h"

/* f32 -> f16 bits, round to nearest even. |x| >= 65520 gives +-inf; values below the
 * smallest subnormal (2^-24) round to (signed) zero or 2^-24; NaN stays a quiet NaN with its
 * sign and top payload bits; -0 stays -0. */
uint16_t kvm_half_f32_to_f16(float x);
/* f16 bits -> f32, exact (subnormals, inf and NaN payloads preserved). */
float kvm_half_f16_to_f32(uint16_t h);
/* f32 -> bf16 bits, round to nearest even (overflow gives +-inf); NaN stays a quiet NaN. */
uint16_t kvm_half_f32_to_bf16(float x);
/* bf16 bits -> f32, exact. */
float kvm_half_bf16_to_f32(uint16_t h);

/* 1 when finite x becomes +-inf in dtype dt (f16: |x| >= 65520, halfway past 65504; bf16:
 * |x| >= 0x7F7F8000's 3.3961514e38, halfway past its largest finite value; f32: never), else 0.
 * Round to nearest even sends those halfway values up, to inf. */
int kvm_half_overflows(float x, kvm_proto_dtype dt);

/* Element i of src (dtype f32, f16 or bf16; unaligned is fine) as float32, exactly. Inline: the
 * codec's value checks call it per element. */
static inline float kvm_half_load(const void *src, kvm_proto_dtype dt, size_t i)
{
    if (dt == KVM_PROTO_F32) {
        float x;
        memcpy(&x, (const uint8_t *)src + 4 * i, 4);
        return x;
    }
    uint16_t h;
    memcpy(&h, (const uint8_t *)src + 2 * i, 2);
    return dt == KVM_PROTO_F16 ? kvm_half_f16_to_f32(h) : kvm_half_bf16_to_f32(h);
}

/* Converts n elements of src (dtype src_dtype) into dst (dtype dst_dtype); both in
 * {f32, f16, bf16}. Same dtype copies. dst and src must not overlap; either may be NULL when
 * n == 0. Errors: KVM_EINVAL (i32 or unknown dtype, NULL with n > 0). */
int kvm_half_convert(void *dst, kvm_proto_dtype dst_dtype, const void *src, kvm_proto_dtype src_dtype, size_t n);

#endif
