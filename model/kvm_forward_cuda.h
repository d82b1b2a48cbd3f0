/* kvm_forward_cuda.h: a loaded model made into the CUDA backend's device-resident forward
 * (kernels/cuda/kvm_cuda.h), for `generate --device cuda:N`, the prefill stage on cuda:N, the
 * compress stage's evaluation and the decode stage on cuda:N, and the CUDA tests. Present only in
 * CUDA builds (KVM_WITH_CUDA). */
#ifndef KVM_FORWARD_CUDA_H
#define KVM_FORWARD_CUDA_H

#ifdef KVM_WITH_CUDA
#include "kernels/cuda/kvm_cuda.h"
#include "model/kvm_capture.h"
#include "model/kvm_kvcache.h"
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

/* The prefill stage's KV capture on the device (issue 13): dm is emptied (kvm_cuda_model_reset)
 * and tokens[0, n) (host) run on it in one batch; cap (kvm_capture_new for dm's model config c
 * and n tokens, with want_queries and want_stats) is then filled as the host forward's capture
 * hooks fill it (model/kvm_capture.h): per layer the post-RoPE keys and values [n_kv_heads][n][d]
 * (downloaded from the device cache once), the pre- and post-RoPE queries [n_heads][n][d], the
 * entropy [n_heads][n] of every query's attention row and the mass [n_heads][n] each key
 * received from the queries of cap's mass window — the attention kernel's ENTROPY and MASS
 * statistics (kvm_cuda_attention_layer), so no n × n matrix is formed. The cache stays on dm (n
 * entries per head). Errors: KVM_EINVAL (n ≠ cap's N, n beyond dm's ctx or max_batch, a
 * capture without queries or statistics, a mass window that ends before n: the device sums
 * mass to the end), KVM_ENOMEM, the forward's errors (KVM_EDEVICE naming the CUDA call). */
int kvm_capture_cuda_prefill(kvm_cuda_model *dm, const kvm_model_config *c, const int32_t *tokens, int64_t n,
                             kvm_capture *cap);

/* Puts host cache c (a cache of dm's model with float32 keys and values: a compressed ragged
 * cache or a full one) onto dm as it is: each (layer, KV head)'s entries, positions and β
 * (kvm_cuda_model_set_kv, which checks the ragged order), and c's next position, so the next
 * forward continues after the document over those entries. Errors: KVM_EINVAL (a layer or KV
 * head beyond dm's model, a head beyond dm's ctx, entries out of order, an f16 cache: the
 * device keeps float32), KVM_EDEVICE. */
int kvm_kvcache_cuda_upload(kvm_cuda_model *dm, const kvm_kvcache *c);
#endif

#endif
