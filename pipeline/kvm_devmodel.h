/* kvm_devmodel.h: a stage worker's device forward (--device cuda:N; issue 13), shared by the
 * prefill stage (the document's capture) and the compress stage (its [eval] evaluation): the
 * device model is made at the first job that needs it and kept while the jobs name the same
 * model, weight dtype and fit its context; a model the device cannot run (KVM_ENOTSUP:
 * sliding-window attention, a matrix type the upload cannot dequantise) is said once on
 * stderr and its jobs run on the CPU. */
#ifndef KVM_DEVMODEL_H
#define KVM_DEVMODEL_H

#include "model/kvm_model.h"
#include "pipeline/kvm_config.h"
#include "store/kvm_store.h"
#ifdef KVM_WITH_CUDA
#include "kernels/cuda/kvm_cuda.h"
#endif

/* One worker's device forward; zero-initialise, then kvm_devmodel_init. */
typedef struct kvm_devmodel {
    const char *stage;          /* "prefill", "compress": names the stage in messages */
    int cuda;                   /* --device cuda:N: N, else -1 (everything on the CPU) */
#ifdef KVM_WITH_CUDA
    kvm_cuda_model *dm;         /* the device model, or NULL before the first job that needs it */
    int64_t ctx;                /* its cache entries per KV head and batch tokens */
    kvm_cuda_wdtype wdtype;     /* its weight dtype */
    kvm_store_id model;         /* the model it was made from */
    kvm_store_id host_model;    /* a model the device refused (KVM_ENOTSUP): run on the CPU */
    int host_fallback;          /* host_model is set */
#endif
} kvm_devmodel;

/* Sets d for `stage` on `device` ("cpu", "cuda:N" or NULL for cpu; the stage runtime has
 * checked that the device exists) and logs, for cuda:N, "<what> on cuda:N (<note>; weights
 * ...)". Returns 0 or KVM_EINVAL (not cpu or cuda:N). */
int kvm_devmodel_init(kvm_devmodel *d, const char *stage, const char *device, const char *what, const char *note);

/* The weight dtype of the device forward for config c's [model] weight_dtype (the setting the
 * CPU forward reads): bf16 and f16 select 16-bit weights with float32 accumulation
 * (cublasGemmEx), f32 and auto float32 weights (the CPU's values, so caches compress as the
 * CPU's would). The number is a kvm_cuda_wdtype (0 f32, 1 bf16, 2 f16) in every build. */
int kvm_devmodel_wdtype(const kvm_config *c);

#ifdef KVM_WITH_CUDA
/* The device model for model m (model id `id`), config c's weight dtype and n tokens in one
 * batch: *out is kept from the last job when it is the same model and dtype and holds n
 * entries, else made anew for the next power of two ≥ max(n, 512) entries and batch tokens
 * (borrowed: valid until the next call or kvm_devmodel_deinit). *out = NULL (and 0 returned)
 * when d is on the CPU or the device cannot run this model (KVM_ENOTSUP, said once per model
 * on stderr: the caller runs the job on the CPU). Errors: KVM_ENOMEM (the model does not fit:
 * bytes needed and free), KVM_EDEVICE (a CUDA call, named). */
int kvm_devmodel_get(kvm_devmodel *d, const kvm_model *m, const kvm_store_id *id, const kvm_config *c, int64_t n,
                     kvm_cuda_model **out);
#endif

/* Frees the device model; d may be reused after kvm_devmodel_init. */
void kvm_devmodel_deinit(kvm_devmodel *d);

#endif
