/* kvm_fpmode.h: the floating-point mode of a compute thread. Kernels that reach tiny values
 * (softmax tails, gradients of near-zero probabilities) run many times slower on subnormal
 * operands on x86; every compute thread (the KVSculpt solver's workers, the CPU backend's pool
 * workers) sets flush-to-zero and denormals-are-zero while it computes and restores the
 * caller's mode after, so nothing leaks to other code running on that thread. */
#ifndef KVM_FPMODE_H
#define KVM_FPMODE_H

/* A saved mode (the x86 MXCSR register; 0 and meaningless elsewhere). */
typedef struct kvm_fpmode {
    unsigned csr;
} kvm_fpmode;

/* Sets flush-to-zero (subnormal results become ±0) and denormals-are-zero (subnormal operands
 * read as ±0) on the calling thread and returns the mode it replaced, for kvm_fpmode_restore.
 * No effect (and a zero mode) on processors other than x86-64. Never fails. */
kvm_fpmode kvm_fpmode_flush_enter(void);

/* Restores a mode returned by kvm_fpmode_flush_enter on the same thread. */
void kvm_fpmode_restore(kvm_fpmode saved);

/* 1 when the calling thread flushes subnormals (both FTZ and DAZ set), else 0 (also on
 * processors without the mode). For tests and assertions. */
int kvm_fpmode_is_flushing(void);

#endif
