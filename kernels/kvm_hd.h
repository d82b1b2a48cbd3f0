/* kvm_hd.h: KVM_HD, the qualifier of the per-element and per-row kernel bodies
 * (kernels/kvm_*_body.h) that cc compiles for the CPU backend and nvcc for the device, so the
 * CPU tests run the math the GPU runs (kernels/LAYOUT.md). */
#ifndef KVM_HD_H
#define KVM_HD_H

#ifndef KVM_HD
#ifdef __CUDACC__
#define KVM_HD __host__ __device__
#else
#define KVM_HD
#endif
#endif

#endif
