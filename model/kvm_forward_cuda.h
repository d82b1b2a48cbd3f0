/* kvm_forward_cuda.h: a loaded model made into the CUDA backend's device-resident forward
 * (kernels/cuda/kvm_cuda.h), for `generate --device cuda:N` and the CUDA tests. Present only in
 * CUDA builds (KVM_WITH_CUDA). */
#ifndef KVM_FORWARD_CUDA_H
#define KVM_FORWARD_CUDA_H

#ifdef KVM_WITH_CUDA
#include "kernels/cuda/kvm_cuda.h"
#include "model/kvm_model.h"

/* Uploads m's weights to cuda:device with a cache of ctx entries per KV head and batches of
 * max_batch tokens: each matrix as its file stores it (GGUF blocks, F16/BF16 or F32, straight
 * from the mapping), dequantised on the device into t by the loader's bodies
 * (kernels/kvm_quant_body.h), so the values are kvm_model_mat_rows' and no float32 copy of a
 * matrix is made on the host; norms and biases as the model's float32 vectors. RoPE tables
 * follow the model's own recipe (kvm_model_rope_table, scaling included). Errors: KVM_ENOTSUP
 * for a sliding-window model or a matrix type the upload cannot dequantise, KVM_ENOMEM (with
 * bytes needed and free) when it does not fit, KVM_EDEVICE for a CUDA failure. */
int kvm_model_cuda_new(const kvm_model *m, int device, kvm_cuda_wdtype t, int64_t ctx, int64_t max_batch,
                       kvm_cuda_model **out);
#endif

#endif
