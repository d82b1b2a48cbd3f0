/* kvm_half.c: f32 <-> f16 / bf16 with round-to-nearest-even, bit-exact and portable (no
 * reliance on _Float16 or F16C), so CPU, GPU and stored bytes agree. */
#include "proto/kvm_half.h"

#include <math.h>
#include <string.h>

#include "common/kvm_error.h"

static uint32_t kvm_half__bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float kvm_half__float(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

uint16_t kvm_half_f32_to_f16(float x)
{
    uint32_t u = kvm_half__bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 (halfway past 65504) rounds to inf; also inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {                          /* below 2^-14: f16 subnormal or zero */
        if (a < 0x33000000u) return (uint16_t)sign; /* < 2^-25: rounds to zero */
        uint32_t e = a >> 23;                       /* biased exponent, 102..112 */
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* value / 2^-24 = m >> shift */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r); /* r == 0x400 is the smallest normal: still right */
    }
    uint32_t r = (a - 0x38000000u) >> 13; /* rebias exponent 127 -> 15 */
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++; /* carry into exponent is right */
    return (uint16_t)(sign | r);
}

float kvm_half_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0) {
        if (m == 0) return kvm_half__float(sign);
        e = 113; /* normalize the subnormal: value = m * 2^-24 */
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        return kvm_half__float(sign | (e << 23) | ((m & 0x3ffu) << 13));
    }
    if (e == 31) return kvm_half__float(sign | 0x7f800000u | (m << 13));
    return kvm_half__float(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t kvm_half_f32_to_bf16(float x)
{
    uint32_t u = kvm_half__bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float kvm_half_bf16_to_f32(uint16_t h) { return kvm_half__float((uint32_t)h << 16); }

int kvm_half_overflows(float x, kvm_proto_dtype dt)
{
    if (!isfinite(x) || dt == KVM_PROTO_F32) return 0;
    uint32_t u;
    memcpy(&u, &x, 4);
    u &= 0x7fffffffu;
    return dt == KVM_PROTO_F16 ? u >= 0x477ff000u /* 65520 */ : dt == KVM_PROTO_BF16 && u >= 0x7f7f8000u;
}

static void kvm_half__store(void *dst, kvm_proto_dtype dt, size_t i, float x)
{
    if (dt == KVM_PROTO_F32) {
        memcpy((uint8_t *)dst + 4 * i, &x, 4);
        return;
    }
    uint16_t h = dt == KVM_PROTO_F16 ? kvm_half_f32_to_f16(x) : kvm_half_f32_to_bf16(x);
    memcpy((uint8_t *)dst + 2 * i, &h, 2);
}

static int kvm_half__is_float(kvm_proto_dtype dt)
{
    return dt == KVM_PROTO_F32 || dt == KVM_PROTO_F16 || dt == KVM_PROTO_BF16;
}

int kvm_half_convert(void *dst, kvm_proto_dtype dst_dtype, const void *src, kvm_proto_dtype src_dtype, size_t n)
{
    if (!kvm_half__is_float(dst_dtype) || !kvm_half__is_float(src_dtype))
        return kvm_err(KVM_EINVAL, "kvm_half_convert: dtypes %s -> %s, expected f32/f16/bf16",
                       kvm_proto_dtype_name(src_dtype), kvm_proto_dtype_name(dst_dtype));
    if (n == 0) return 0;
    if (!dst || !src) return kvm_err(KVM_EINVAL, "kvm_half_convert: NULL buffer with n = %zu", n);
    if (dst_dtype == src_dtype) {
        memcpy(dst, src, n * kvm_proto_dtype_size(src_dtype));
        return 0;
    }
    for (size_t i = 0; i < n; i++)
        kvm_half__store(dst, dst_dtype, i, kvm_half_load(src, src_dtype, i));
    return 0;
}
