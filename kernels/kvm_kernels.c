/* kvm_kernels.c: backend selection by device name and the RoPE angle tables every backend
 * shares (computed once per forward call on the host, then uploaded). */
#include "kernels/kvm_kernels.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>

#ifdef KVM_WITH_CUDA
const kvm_kernels *kvm__cuda_backend(int device);
#endif

const kvm_kernels *kvm_kernels_cuda(int device)
{
#ifdef KVM_WITH_CUDA
    return kvm__cuda_backend(device);
#else
    kvm_err(KVM_EDEVICE, "cuda:%d requested but this kvmill was built without CUDA (nvcc not found or CUDA=0)",
            device);
    return NULL;
#endif
}

int kvm_device_parse(const char *device, int *cuda_index)
{
    *cuda_index = -1;
    if (!device || strcmp(device, "cpu") == 0) return 0;
    char *end = NULL;
    errno = 0;
    long n = strncmp(device, "cuda:", 5) ? -1 : strtol(device + 5, &end, 10);
    if (n < 0 || errno || end == device + 5 || *end || n > 255)
        return kvm_err(KVM_EINVAL, "%s: not cpu or cuda:N (N a device index in [0, 255])", device);
    *cuda_index = (int)n;
    return 0;
}

int kvm_kernels_select(const char *device, const kvm_kernels **out)
{
    int n;
    if (kvm_device_parse(device, &n)) return KVM_EINVAL;
    if (n < 0) {
        *out = kvm_kernels_cpu();
        return 0;
    }
    const kvm_kernels *k = kvm_kernels_cuda(n);
    if (!k) return KVM_EDEVICE;
    *out = k;
    return 0;
}

void kvm_rope_table(const int32_t *pos, int64_t n, int head_dim, float theta, float *cos_t, float *sin_t)
{
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        /* run.c: freq = 1 / powf(10000, j / head_size) with j = 2i, all in float32 */
        float freq = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
        for (int64_t r = 0; r < n; r++) {
            float angle = (float)pos[r] * freq;
            cos_t[r * half + i] = cosf(angle);
            sin_t[r * half + i] = sinf(angle);
        }
    }
}
