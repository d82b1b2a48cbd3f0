/* kvm_cpu.h: internals of the CPU backend shared between its files (not a public API:
 * callers use kvm_kernels_cpu()). */
#ifndef KVM_CPU_H
#define KVM_CPU_H

#include "kernels/kvm_kernels.h"

/* Row-major sgemm through OpenBLAS; see kvm_kernels.sgemm. */
int kvm__cpu_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                   int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

/* One layer's attention on host memory; see kvm_kernels.attention. */
int kvm__cpu_attention(const kvm_attn_layer *a);

/* The argument checks of kvm_kernels.attention (shared with the reference kernel): 0 or
 * KVM_EINVAL with a message naming the field. */
int kvm__cpu_attn_check(const kvm_attn_layer *a);

#endif
