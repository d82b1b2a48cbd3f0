/* kvm_cpu_half.h: IEEE binary16 (f16) <-> float32 on the CPU through GCC's _Float16, which the
 * x86-64-v3/v4 clones compile to F16C's vcvtps2ph / vcvtph2ps and the baseline to libgcc's
 * software conversion (the scalar fallback, written once by the compiler). Round to nearest
 * even, overflow to ±inf, NaN stays NaN: the same results as proto/kvm_half.c's portable
 * conversion (tests/check_kv16.c compares them). Used by the 16-bit weight panels, the f16 KV
 * cache and attention's f16 reads. Internal to kernels/. */
#ifndef KVM_CPU_HALF_H
#define KVM_CPU_HALF_H

#include <stdint.h>
#include <string.h>

typedef float kvm__hv8 __attribute__((vector_size(32)));
typedef float kvm__hv16 __attribute__((vector_size(64)));
typedef _Float16 kvm__h8 __attribute__((vector_size(16)));
typedef _Float16 kvm__h16 __attribute__((vector_size(32)));

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

/* src[0, 8) f16 widened to 8 float32 lanes. */
static inline __attribute__((always_inline)) kvm__hv8 kvm__f16_widen8(const uint16_t *src)
{
    kvm__h8 h;
    memcpy(&h, src, sizeof h);
    return __builtin_convertvector(h, kvm__hv8);
}

/* src[0, 16) f16 widened to 16 float32 lanes. */
static inline __attribute__((always_inline)) kvm__hv16 kvm__f16_widen16(const uint16_t *src)
{
    kvm__h16 h;
    memcpy(&h, src, sizeof h);
    return __builtin_convertvector(h, kvm__hv16);
}

#endif
