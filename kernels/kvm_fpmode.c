/* kvm_fpmode.c: flush-to-zero / denormals-are-zero through MXCSR (SSE), per thread. */
#include "kernels/kvm_fpmode.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define KVM_FTZ_DAZ 0x8040u /* FTZ (bit 15) | DAZ (bit 6) */

kvm_fpmode kvm_fpmode_flush_enter(void)
{
    kvm_fpmode s = {_mm_getcsr()};
    _mm_setcsr(s.csr | KVM_FTZ_DAZ);
    return s;
}

void kvm_fpmode_restore(kvm_fpmode saved) { _mm_setcsr(saved.csr); }

int kvm_fpmode_is_flushing(void) { return (_mm_getcsr() & KVM_FTZ_DAZ) == KVM_FTZ_DAZ; }
#else
kvm_fpmode kvm_fpmode_flush_enter(void) { return (kvm_fpmode){0}; }

void kvm_fpmode_restore(kvm_fpmode saved) { (void)saved; }

int kvm_fpmode_is_flushing(void) { return 0; }
#endif
