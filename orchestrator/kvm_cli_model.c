/* kvm_cli_model.c: model, tokenizer and device resolution shared by kvmill commands. */
#include "orchestrator/kvm_cli_model.h"
#include "orchestrator/kvm_cli.h"
#include "common/kvm_error.h"

#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

int kvm_cli_find_tokenizer(const char *model_path, const char *explicit_path, char *buf, size_t buf_size)
{
    if (explicit_path) {
        snprintf(buf, buf_size, "%s", explicit_path);
        return 0; /* opening it reports what is wrong */
    }
    struct stat st;
    char dir[4096];
    if (stat(model_path, &st) == 0 && S_ISDIR(st.st_mode)) snprintf(dir, sizeof dir, "%s", model_path);
    else {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s", model_path);
        snprintf(dir, sizeof dir, "%s", dirname(tmp));
    }
    const char *names[] = {"tok512.bin", "tokenizer.bin"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(buf, buf_size, "%s/%s", dir, names[i]);
        if (is_file(buf)) return 0;
    }
    return kvm_err(KVM_ENOTFOUND, "no tokenizer found beside %s (looked for tok512.bin, tokenizer.bin); pass --tokenizer",
                   model_path);
}

int kvm_cli_open_model(const char *cmd, const char *model_path, const char *tok_path, int required,
                       kvm_model **model, kvm_tokenizer **tok)
{
    *model = NULL;
    if (tok) *tok = NULL;
    int rc = kvm_model_open(model_path, model);
    if (rc) {
        fprintf(stderr, "kvmill %s: %s\n", cmd, kvm_errmsg());
        return rc;
    }
    if (!tok) return 0;
    char path[4096];
    rc = kvm_cli_find_tokenizer(model_path, tok_path, path, sizeof path);
    if (rc == 0) rc = kvm_tokenizer_open_llama2c(path, (*model)->cfg.vocab_size, tok);
    if (rc && (required || tok_path)) {
        fprintf(stderr, "kvmill %s: %s\n", cmd, kvm_errmsg());
        kvm_model_close(model);
        return rc;
    }
    return 0;
}

int kvm_cli_setup_device(const char *cmd, const char *device, const char *threads, const kvm_kernels **k)
{
    if (threads) {
        int64_t n;
        if (kvm_cli_int(cmd, "threads", threads, 1, 256, &n)) return KVM_EINVAL;
        kvm_kernels_cpu_set_threads((int)n);
    }
    int rc = kvm_kernels_select(device ? device : "cpu", k);
    if (rc) fprintf(stderr, "kvmill %s: --device: %s\n", cmd, kvm_errmsg());
    return rc;
}
