/* kvm_devmodel.c: a stage worker's device forward, made once and kept (kvm_devmodel.h). */
#include "pipeline/kvm_devmodel.h"

#include "common/kvm_error.h"
#include "common/kvm_log.h"
#ifdef KVM_WITH_CUDA
#include "model/kvm_forward_cuda.h"
#endif

#include <string.h>

int kvm_devmodel_init(kvm_devmodel *d, const char *stage, const char *device, const char *what, const char *note)
{
    memset(d, 0, sizeof *d);
    d->stage = stage;
    int rc = kvm_device_parse(device, &d->cuda);
    if (!rc && d->cuda >= 0)
        kvm_log(KVM_LOG_INFO, "forward_device", NULL, 0, "%s on cuda:%d (%s; weights by [model] weight_dtype: bf16 "
                "or f16 with float32 accumulation, else float32)", what, d->cuda, note);
    return rc;
}

int kvm_devmodel_wdtype(const kvm_config *c)
{
    const char *w = kvm_config_str(c, "model", "weight_dtype");
    return !strcmp(w, "bf16") ? 1 : !strcmp(w, "f16") ? 2 : 0;
}

#ifdef KVM_WITH_CUDA
int kvm_devmodel_get(kvm_devmodel *d, const kvm_model *m, const kvm_store_id *id, const kvm_config *c, int64_t n,
                     kvm_cuda_model **out)
{
    const kvm_cuda_wdtype t = (kvm_cuda_wdtype)kvm_devmodel_wdtype(c);
    *out = NULL;
    if (d->cuda < 0 || (d->host_fallback && !memcmp(&d->host_model, id, sizeof *id))) return 0;
    if (d->dm && !memcmp(&d->model, id, sizeof *id) && d->wdtype == t && d->ctx >= n) {
        *out = d->dm;
        return 0;
    }
    kvm_cuda_model_free(&d->dm);
    int64_t ctx = 512;
    while (ctx < n) ctx *= 2;
    int rc = kvm_model_cuda_new(m, d->cuda, t, ctx, ctx, &d->dm);
    if (rc == KVM_ENOTSUP) {
        kvm_log(KVM_LOG_WARN, "device_fallback", NULL, 0, "%s on cuda:%d: %s: this model's forward runs on the CPU",
                d->stage, d->cuda, kvm_errmsg());
        d->host_model = *id, d->host_fallback = 1;
        return 0;
    }
    if (rc) return rc;
    d->model = *id, d->ctx = ctx, d->wdtype = t;
    *out = d->dm;
    return 0;
}
#endif

void kvm_devmodel_deinit(kvm_devmodel *d)
{
#ifdef KVM_WITH_CUDA
    kvm_cuda_model_free(&d->dm);
#endif
    d->cuda = -1;
}
