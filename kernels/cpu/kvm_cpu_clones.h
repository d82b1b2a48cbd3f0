/* kvm_cpu_clones.h: KVM_CLONES, the function attribute that compiles a CPU kernel three times
 * (x86-64-v4, x86-64-v3, baseline) and picks one at load time by the processor's features
 * (AVX-512 / AVX2, FMA, F16C / SSE2). Empty off x86-64 and in AddressSanitizer builds (SAN=1).
 * One definition for every file that clones. Internal to kernels/cpu. */
#ifndef KVM_CPU_CLONES_H
#define KVM_CPU_CLONES_H

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KVM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVM_CLONES
#endif

#endif
