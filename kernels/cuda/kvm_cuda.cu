// kvm_cuda.cu: entry point of the CUDA backend. This build compiles and links the CUDA
// toolchain (sm_80, sm_90) and probes devices; the kernel table itself lands with the CUDA
// kernels issue, so selecting cuda:N reports that plainly instead of running anything.
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "common/kvm_error.h"
#include "kernels/kvm_kernels.h"

const kvm_kernels *kvm__cuda_backend(int device);
int kvm_cuda_device_count(void);

int kvm_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
}

const kvm_kernels *kvm__cuda_backend(int device)
{
    int n = kvm_cuda_device_count();
    if (device >= n) {
        kvm_err(KVM_EDEVICE, "cuda:%d requested but %d CUDA device(s) are visible", device, n);
        return NULL;
    }
    kvm_err(KVM_ENOTSUP, "cuda:%d: the CUDA kernel table is not implemented in this version; use --device cpu",
            device);
    return NULL;
}
}
