/* check_slurm.c: the device of a Slurm task from the variables srun sets (pipeline/kvm_slurm.h),
 * with the variables given by the test: no GPU is needed to check the binding. */
#include <check.h>
#include <stdarg.h>
#include <string.h>

#include "common/kvm_error.h"
#include "pipeline/kvm_slurm.h"
#include "tests/util/kvm_test.h"

static const char *g_vars[8][2];

static const char *fake_env(const char *name)
{
    for (int i = 0; i < 8 && g_vars[i][0]; i++)
        if (!strcmp(g_vars[i][0], name)) return g_vars[i][1];
    return NULL;
}

/* Sets the variables (name, value, ..., NULL) and returns the device. */
static const char *device_with(const char *first, ...)
{
    static char dev[32];
    memset(g_vars, 0, sizeof g_vars);
    va_list ap;
    va_start(ap, first);
    int i = 0;
    for (const char *k = first; k && i < 7; k = va_arg(ap, const char *), i++) {
        g_vars[i][0] = k;
        g_vars[i][1] = va_arg(ap, const char *);
    }
    va_end(ap);
    ck_assert_msg(kvm_slurm_device(fake_env, dev, sizeof dev) == 0, "%s", kvm_errmsg());
    return dev;
}

START_TEST(test_binding)
{
    ck_assert_str_eq(device_with(NULL), "cpu");
    ck_assert_str_eq(device_with("SLURM_LOCALID", "2", NULL), "cpu");
    /* --gpus-per-task=1: the task sees its one GPU as device 0 */
    ck_assert_str_eq(device_with("SLURM_LOCALID", "3", "CUDA_VISIBLE_DEVICES", "5", NULL), "cuda:0");
    /* the node's GPUs visible to every task: one each by local rank */
    ck_assert_str_eq(device_with("SLURM_LOCALID", "0", "CUDA_VISIBLE_DEVICES", "4,5,6,7", NULL), "cuda:0");
    ck_assert_str_eq(device_with("SLURM_LOCALID", "2", "CUDA_VISIBLE_DEVICES", "4,5,6,7", NULL), "cuda:2");
    ck_assert_str_eq(device_with("SLURM_LOCALID", "5", "CUDA_VISIBLE_DEVICES", "0,1", NULL), "cuda:1");
    /* no CUDA_VISIBLE_DEVICES: physical ids from the step's or the job's GPUs */
    ck_assert_str_eq(device_with("SLURM_LOCALID", "1", "SLURM_STEP_GPUS", "2,3", NULL), "cuda:3");
    ck_assert_str_eq(device_with("SLURM_LOCALID", "1", "SLURM_JOB_GPUS", "6,7", NULL), "cuda:7");
    ck_assert_str_eq(device_with("SLURM_LOCALID", "0", "SLURM_STEP_GPUS", "1", "SLURM_JOB_GPUS", "6,7", NULL), "cuda:1");
    /* no GPU allocated */
    ck_assert_str_eq(device_with("SLURM_LOCALID", "0", "CUDA_VISIBLE_DEVICES", "", NULL), "cpu");
    ck_assert_str_eq(device_with("CUDA_VISIBLE_DEVICES", "NoDevFiles", NULL), "cpu");
    ck_assert_str_eq(device_with("SLURM_LOCALID", "x", "CUDA_VISIBLE_DEVICES", "3,9", NULL), "cuda:0");
}
END_TEST

START_TEST(test_bad_list)
{
    char dev[32];
    memset(g_vars, 0, sizeof g_vars);
    g_vars[0][0] = "CUDA_VISIBLE_DEVICES", g_vars[0][1] = "GPU-1a2b,3";
    ck_assert_int_eq(kvm_slurm_device(fake_env, dev, sizeof dev), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "CUDA_VISIBLE_DEVICES=GPU-1a2b,3: entry 0"), "%s", kvm_errmsg());
}
END_TEST

static Suite *slurm_suite(void)
{
    Suite *s = suite_create("slurm");
    TCase *tc = tcase_create("device");
    tcase_add_test(tc, test_binding);
    tcase_add_test(tc, test_bad_list);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return kvm_test_run_suite(slurm_suite()); }
