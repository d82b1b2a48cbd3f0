/* kvm_slurm.c: the device of a Slurm task (kvm_slurm.h). */
#include "pipeline/kvm_slurm.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *sys_getenv(const char *name) { return getenv(name); }

/* Entry k of a comma-separated list of non-negative numbers (k < count), or -1 when bad. */
static long list_entry(const char *list, int k)
{
    const char *p = list;
    for (int i = 0; i < k && p; i++)
        if ((p = strchr(p, ','))) p++;
    if (!p || *p < '0' || *p > '9') return -1;
    char *end;
    long v = strtol(p, &end, 10);
    return *end == ',' || *end == '\0' ? v : -1;
}

static int list_count(const char *list)
{
    int c = 1;
    for (const char *p = list; *p; p++)
        c += *p == ',';
    return c;
}

int kvm_slurm_device(kvm_slurm_getenv_fn env, char *out, size_t n)
{
    if (!env) env = sys_getenv;
    const char *lid = env("SLURM_LOCALID");
    char *end = NULL;
    long local = lid ? strtol(lid, &end, 10) : 0;
    if (!lid || *end || local < 0) local = 0;
    const char *cvd = env("CUDA_VISIBLE_DEVICES");
    const char *var = "CUDA_VISIBLE_DEVICES", *list = cvd;
    if (!cvd) {
        list = env(var = "SLURM_STEP_GPUS");
        if (!list || !*list) list = env(var = "SLURM_JOB_GPUS");
    }
    if (!list || !*list || !strcmp(list, "NoDevFiles")) {
        snprintf(out, n, "cpu");
        return 0;
    }
    int count = list_count(list), k = (int)(local % count);
    long id = list_entry(list, k);
    if (id < 0) return kvm_err(KVM_EINVAL, "%s=%s: entry %d is not a GPU number", var, list, k);
    snprintf(out, n, "cuda:%ld", cvd ? (long)k : id);
    return 0;
}
