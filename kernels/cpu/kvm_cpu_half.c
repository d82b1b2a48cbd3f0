/* kvm_cpu_half.c: the array conversions between float32 and f16 declared in kvm_kernels.h,
 * cloned so that the x86-64-v3/v4 builds use F16C (kvm_cpu_half.h). */
#include "kernels/cpu/kvm_cpu_half.h"
#include "kernels/cpu/kvm_cpu_clones.h"
#include "kernels/kvm_kernels.h"

KVM_CLONES
void kvm_f16_round(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t i = 0; i < n; i++) dst[i] = kvm__f16_bits(src[i]);
}

/* Sixteen at a time through kvm__f16_widen16 (the GEMM's and attention's widening, so
 * tests/check_kv16.c's comparison over every bit pattern checks it), the rest one by one. */
KVM_CLONES
void kvm_f16_widen(float *dst, const uint16_t *src, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        kvm__hv16 f = kvm__f16_widen16(src + i);
        memcpy(dst + i, &f, sizeof f);
    }
    for (; i < n; i++)
        dst[i] = kvm__f16_float(src[i]);
}
