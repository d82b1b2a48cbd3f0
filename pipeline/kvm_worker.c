/* kvm_worker.c: model loading for stage processes and the method dispatch. */
#include "pipeline/kvm_worker.h"
#include "orchestrator/kvm_cli_model.h"
#include "common/kvm_error.h"

#include <string.h>

int kvm_worker_model_get(kvm_worker_model *wm, const kvm_config *c, kvm_store *store)
{
    const char *path = wm->override ? wm->override : kvm_config_str(c, "model", "path");
    if (wm->model && !strcmp(path, wm->path)) return 0;
    kvm_worker_model_free(wm);
    int rc = kvm_model_open(path, &wm->model);
    if (rc) return rc;
    snprintf(wm->path, sizeof wm->path, "%s", path);
    if ((rc = store ? kvm_store_model_id(store, path, &wm->model_id) : kvm_store_hash_file(path, &wm->model_id))) return rc;
    const char *tp = kvm_config_str(c, "model", "tokenizer");
    char tpath[4096];
    memset(&wm->tok_id, 0, sizeof wm->tok_id);
    if (kvm_cli_find_tokenizer(path, *tp ? tp : NULL, tpath, sizeof tpath) == 0 &&
        kvm_tokenizer_open_llama2c(tpath, wm->model->cfg.vocab_size, &wm->tok) == 0)
        kvm_store_hash_file(tpath, &wm->tok_id);
    return 0;
}

void kvm_worker_model_free(kvm_worker_model *wm)
{
    kvm_tokenizer_close(&wm->tok);
    kvm_model_close(&wm->model);
    wm->path[0] = '\0';
}

int kvm_worker_compress(const kvm_config *c, const kvm_compress_input *in, kvm_kvcache **out)
{
    const char *method = kvm_config_str(c, "compress", "method");
    if (!strcmp(method, "full")) return kvm_kvcache_clone(in->full, out);
    return kvm_err(KVM_ENOTSUP, "compression method '%s' is not available in this build", method);
}
