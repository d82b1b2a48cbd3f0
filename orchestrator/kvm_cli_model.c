/* kvm_cli_model.c: model, tokenizer and device resolution shared by kvmill commands. */
#include "orchestrator/kvm_cli_model.h"
#include "model/kvm_kvcache.h"
#include "model/kvm_tokenizer_find.h"
#include "orchestrator/kvm_cli.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* The exit status of a model or tokenizer that did not open: 1 where the machine failed (out of
 * memory, a read or mmap error), else 2: the file the user named is missing, of another kind,
 * truncated or does not match (README: 2 for usage, 1 for runtime failures). */
static int open_exit_status(int st) { return st == KVM_ENOMEM || st == KVM_EIO ? 1 : 2; }

/* kvm_cli_open_model, each refusal opened by where the path came from: model_from for the
 * model's, tok_from for the tokenizer's when tok_path is given ("" when the user typed it). */
static int open_model(const char *cmd, const char *model_path, const char *tok_path, int required, kvm_model **model,
                      kvm_tokenizer **tok, const char *model_from, const char *tok_from)
{
    *model = NULL;
    if (tok) *tok = NULL;
    if (!model_path || !*model_path) {
        kvm_cli_refuse(cmd, "%sthe model path is empty\n", model_from);
        return 2;
    }
    int rc = kvm_model_open(model_path, model);
    if (rc) {
        kvm_cli_refuse(cmd, "%s%s\n", model_from, kvm_cli_errmsg(cmd));
        return open_exit_status(rc);
    }
    if (!tok) return 0;
    char path[4096];
    rc = kvm_tokenizer_open_for_model(*model, model_path, tok_path, tok, path, sizeof path);
    if (rc && (required || tok_path)) {
        kvm_cli_refuse(cmd, "%s%s\n", tok_path ? tok_from : model_from, kvm_cli_errmsg(cmd));
        kvm_model_close(model);
        return open_exit_status(rc);
    }
    return 0;
}

int kvm_cli_open_model(const char *cmd, const char *model_path, const char *tok_path, int required, kvm_model **model,
                       kvm_tokenizer **tok)
{
    return open_model(cmd, model_path, tok_path, required, model, tok, "", "");
}

int kvm_cli_open_model_config(const char *cmd, const kvm_config *cfg, int required, kvm_model **model,
                              kvm_tokenizer **tok)
{
    /* the path alone (resolved against the working directory) left the user to guess which file
     * and which key to fix */
    char model_from[4200], tok_from[4200];
    snprintf(model_from, sizeof model_from, "%s: [model] path: ", kvm_config_path(cfg));
    snprintf(tok_from, sizeof tok_from, "%s: [model] tokenizer: ", kvm_config_path(cfg));
    const char *tp = kvm_config_str(cfg, "model", "tokenizer");
    return open_model(cmd, kvm_config_str(cfg, "model", "path"), *tp ? tp : NULL, required, model, tok, model_from,
                      tok_from);
}

int kvm_cli_weight_dtype(const char *cmd, const char *value, kvm_model *m)
{
    if (!value) return 0;
    kvm_model_weight_dtype d;
    int rc = kvm_model_weight_dtype_parse(value, &d);
    if (!rc) rc = kvm_model_set_weight_dtype(m, d);
    if (rc) kvm_cli_refuse(cmd, "--weight-dtype: %s\n", kvm_errmsg());
    return rc;
}

int kvm_cli_kv_dtype(const char *cmd, const char *value, kvm_kv_dtype *out)
{
    *out = KVM_KV_F32;
    if (!value) return 0;
    int rc = kvm_kvcache_dtype_parse(value, out);
    if (rc) kvm_cli_refuse(cmd, "--kv-dtype: %s\n", kvm_errmsg());
    return rc;
}

int kvm_cli_setup_device(const char *cmd, const char *device, const char *threads, const kvm_kernels **k)
{
    if (threads) {
        int64_t n;
        if (kvm_cli_int(cmd, "threads", threads, 1, 256, &n)) return KVM_EINVAL;
        kvm_kernels_cpu_set_threads((int)n);
    }
    int rc = kvm_kernels_select(device ? device : "cpu", k);
    if (rc) kvm_cli_refuse(cmd, "--device %s\n", kvm_errmsg());
    return rc;
}
