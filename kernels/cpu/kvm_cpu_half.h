/* kvm_cpu_half.h: IEEE binary16 (f16) <-> float32 on the CPU through GCC's _Float16, which the
 * x86-64-v3/v4 clones compile to F16C's vcvtps2ph / vcvtph2ps and the baseline to libgcc's
 * software conversion (the scalar fallback, written once by the compiler). Round to nearest
 * even, overflow to ±inf, NaN stays NaN: the same results as proto/kvm_half.c's portable
 * conversion (tests/check_kv16.c compares them). Vectors of f16 widen in integer ops instead
 * (KVM__F16_WIDEN, below). Used by the 16-bit weight panels, the f16 KV cache and attention's
 * f16 reads. Internal to kernels/. */
#ifndef KVM_CPU_HALF_H
#define KVM_CPU_HALF_H

#include <stdint.h>
#include <string.h>

typedef float kvm__hv8 __attribute__((vector_size(32)));
typedef float kvm__hv16 __attribute__((vector_size(64)));

/* f32 -> f16 bits, round to nearest even. */
static inline __attribute__((always_inline)) uint16_t kvm__f16_bits(float f)
{
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}

/* f16 bits -> f32, exact. */
static inline __attribute__((always_inline)) float kvm__f16_float(uint16_t u)
{
    _Float16 h;
    memcpy(&h, &u, sizeof h);
    return (float)h;
}

typedef uint16_t kvm__u16x8 __attribute__((vector_size(16)));
typedef uint16_t kvm__u16x16 __attribute__((vector_size(32)));
typedef uint32_t kvm__u32x8 __attribute__((vector_size(32)));
typedef uint32_t kvm__u32x16 __attribute__((vector_size(64)));

/* NAME(src): src[0, lanes) f16 widened to float32 lanes, exactly: kvm__f16_float's values, but a
 * signalling NaN stays signalling (its payload kept, the quiet bit clear) where vcvtph2ps quiets
 * it. In integer vector ops, because GCC 12 turns a _Float16 vector
 * conversion into one vpinsrw + vcvtph2ps per lane where AVX512-FP16 is absent (a fifth of a
 * 16-bit GEMM's time went there): the exponent is rebiased (inf/NaN kept at the top), and a
 * subnormal becomes 2^-14·(1 + m/1024) − 2^-14 = m·2^-24, one exact float subtraction. */
#define KVM__F16_WIDEN(NAME, FV, UV, HV)                                                                               \
    static inline __attribute__((always_inline)) FV NAME(const uint16_t *src)                                          \
    {                                                                                                                  \
        HV h;                                                                                                          \
        memcpy(&h, src, sizeof h);                                                                                     \
        UV x = __builtin_convertvector(h, UV);                                                                         \
        UV o = (x & 0x7fffu) << 13, e = o & (0x7c00u << 13);                                                           \
        UV special = (UV)(e == (0x7c00u << 13)), tiny = (UV)(e == 0);                                                  \
        o += ((127u - 15u) << 23) + (special & ((128u - 16u) << 23));                                                  \
        UV ob = o + (1u << 23), db, r;                                                                                 \
        FV fd, f;                                                                                                      \
        memcpy(&fd, &ob, sizeof fd);                                                                                   \
        fd -= 0x1p-14f;                                                                                                \
        memcpy(&db, &fd, sizeof db);                                                                                   \
        r = (tiny & db) | (~tiny & o) | ((x & 0x8000u) << 16);                                                         \
        memcpy(&f, &r, sizeof f);                                                                                      \
        return f;                                                                                                      \
    }

KVM__F16_WIDEN(kvm__f16_widen8, kvm__hv8, kvm__u32x8, kvm__u16x8)
KVM__F16_WIDEN(kvm__f16_widen16, kvm__hv16, kvm__u32x16, kvm__u16x16)

#endif
