/* kvm_cpu_math.h: branch-free float32 exp that compilers vectorise (Cephes polynomial,
 * ~2 ulp on [-87, 88]); libm's expf is a scalar call per element, which dominated the
 * softmax and SwiGLU of small models. Internal to kernels/cpu. */
#ifndef KVM_CPU_MATH_H
#define KVM_CPU_MATH_H

#include <stdint.h>
#include <string.h>

static inline float kvm__expf(float x)
{
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = (x * log2e + round_magic) - round_magic;
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
