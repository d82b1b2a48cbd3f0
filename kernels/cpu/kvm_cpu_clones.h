/* kvm_cpu_clones.h: KVM_CLONES, the function attribute that compiles a CPU kernel three times
 * (x86-64-v4, x86-64-v3, baseline) and picks one at load time by the processor's features
 * (AVX-512 / AVX2, FMA, F16C / SSE2). Empty off x86-64, in AddressSanitizer builds (SAN=1) and
 * in a file that compiles for one target and says so by defining KVM_NO_CLONES first.
 * One definition for every file that clones. Internal to kernels/cpu. */
#ifndef KVM_CPU_CLONES_H
#define KVM_CPU_CLONES_H

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(KVM_NO_CLONES)
#define KVM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVM_CLONES
#endif

/* Whether the x86-64-v4 (AVX-512) shapes run — the loss's exponential at head dim 8, the f16
 * panels' widening by one vcvtph2ps, 64-byte blocks of sums (the Cholesky's, the head-dim-8
 * loss kernels') and 16-lane compares — rather than the 16-register shapes (8-column and
 * one-row blocks, 8-lane compares; kernels/LAYOUT.md): 1 where the processor has x86-64-v4,
 * unless KVMILL_NO_AVX512 is set (not "0"); always 0 off GCC on x86-64. Both shapes give the
 * same bits. Decided on the first call, from any thread (kernels/cpu/kvm_cpu_v4.c). _set
 * (tests: on = 0 or 1; 1 where unsupported stays 0) returns the previous state; set it while no
 * kernel runs. */
int kvm__cpu_v4(void);
int kvm__cpu_v4_set(int on);

/* The same for the hand-written x86-64-v3 (AVX2, FMA, F16C) loops (the f16 panels' widening by
 * F16C where kvm__cpu_v4 is off): 1 where the processor has x86-64-v3. No environment switch:
 * the loops give their generic loop's values (a signalling NaN comes out quiet, as with
 * vcvtph2ps on AVX-512; the GEMM's sums are the same). */
int kvm__cpu_v3(void);
int kvm__cpu_v3_set(int on);

#endif
