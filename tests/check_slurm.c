/* check_slurm.c: the device of a Slurm task from the variables srun sets (pipeline/kvm_slurm.h),
 * with the variables given by the test: no GPU is needed to check the binding; and
 * deploy/slurm/kvmill.sbatch run with a fake srun and scontrol on PATH (no Slurm here). */
#include <check.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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

/* scontrol show hostnames LIST: the one node the test names; srun --ntasks=N CMD...: N copies of
 * CMD here as one node's tasks (SLURM_LOCALID 0..N-1), ended with it; srun_fails: an srun that
 * cannot create its step, as Slurm's does when the allocation lacks what it asks for. */
static void fake_slurm(const char *dir, int srun_fails)
{
    static const char *scontrol = "#!/bin/bash\necho \"$3\"\n";
    static const char *srun_ok =
        "#!/bin/bash\nn=1\n"
        "while [ $# -gt 0 ]; do case $1 in --ntasks=*) n=${1#*=}; shift ;; --*) shift ;; *) break ;; esac; done\n"
        "pids=()\ntrap 'kill \"${pids[@]}\" 2>/dev/null' TERM INT\n"
        "for ((i = 0; i < n; i++)); do SLURMD_NODENAME=fake SLURM_LOCALID=$i \"$@\" & pids+=($!); done\n"
        "wait\n";
    static const char *srun_bad = "#!/bin/bash\necho 'srun: error: Unable to create step for job 7' >&2\nexit 1\n";
    char path[4200];
    snprintf(path, sizeof path, "%s/scontrol", dir);
    ck_assert_int_eq(kvm_test_write_file(path, scontrol, strlen(scontrol)), 0);
    ck_assert_int_eq(chmod(path, 0755), 0);
    const char *srun = srun_fails ? srun_bad : srun_ok;
    snprintf(path, sizeof path, "%s/srun", dir);
    ck_assert_int_eq(kvm_test_write_file(path, srun, strlen(srun)), 0);
    ck_assert_int_eq(chmod(path, 0755), 0);
}

/* Runs kvmill.sbatch in a folder whose path has a space, with KVMILL_BIN a link there to the
 * binaries under test, on two documents; returns its exit status (124: still going after 90 s)
 * and its output in *out. */
static int run_sbatch(const char *dir, int srun_fails, char **out)
{
    char top[4200], cfg[4400], text[9000], cmd[20000];
    snprintf(top, sizeof top, "%s/a b", dir);
    ck_assert_int_eq(mkdir(top, 0755), 0);
    fake_slurm(top, srun_fails);
    snprintf(cmd, sizeof cmd, "cd '%s' && mkdir corpus && cp '%s' '%s' corpus/ && ln -s '%s' bin", top,
             kvm_test_data_path("corpus/doc_000.txt"), kvm_test_data_path("corpus/doc_001.txt"), kvm_test_bin());
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(cfg, sizeof cfg, "%s/run.ini", top);
    snprintf(
        text, sizeof text,
        "[model]\npath = %s\ncontext = 64\n[compress]\nmethod = snapkv\nratio = 0.5\n[store]\npath = %s/store.lmdb\n"
        "[run]\nrun_dir = %s/run\nheartbeat_ms = 200\n[stages]\ncompress_workers = 0\nbin_dir = %s\n",
        kvm_test_data_path("models/stories260K.bin"), top, top, kvm_test_bin());
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && PATH=\"$PWD:$PATH\" SLURM_JOB_NODELIST=fake KVMILL_BIN=\"$PWD/bin\" KVMILL_CONFIG=run.ini "
             "KVMILL_CORPUS=corpus KVMILL_WORKERS=2 KVMILL_PORT=%d timeout --foreground -k 5 90 bash "
             "'%s/deploy/slurm/kvmill.sbatch' 2>&1",
             top, kvm_test_tcp_port(7), KVM_TEST_SRCDIR);
    return kvm_test_run(cmd, out, NULL);
}

/* An srun step that ended (here: it could not start) left the run waiting for workers that never
 * came until the job's time limit: the script now stops the run, says why, and fails. */
START_TEST(test_sbatch_srun_fails)
{
    char *dir = kvm_test_tmpdir(), *out = NULL;
    int rc = run_sbatch(dir, 1, &out);
    ck_assert_msg(rc == 1, "exit %d, expected 1 (124: the run waited for ever):\n%s", rc, out);
    ck_assert_msg(
        strstr(out, "kvmill.sbatch: the srun step of the compress workers exited 1 while kvmill run was going"), "%s",
        out);
    free(out);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The same script with an srun that starts its two workers: the run ends by itself, both
 * documents compressed through the store service, the workers ended with the job. */
START_TEST(test_sbatch_runs)
{
    char *dir = kvm_test_tmpdir(), *out = NULL, store[4400];
    int rc = run_sbatch(dir, 0, &out);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_msg(strstr(out, "summary: compressed=2 skipped=0 failed=0"), "%s", out);
    ck_assert_msg(strstr(out, "kvmill.sbatch: kvmill run exited 0"), "%s", out);
    snprintf(store, sizeof store, "%s/a b/store.lmdb", dir);
    ck_assert_int_eq(kvm_test_store_caches(store), 2);
    free(out);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* A missing required variable or half a key set stopped the script through bash's ${V:?} and set -u
 * (exit 1, "KVMILL_CLIENT_PUBLIC: unbound variable"); now each is named, exit 2, before anything starts. */
START_TEST(test_sbatch_usage)
{
    static const char *env[][2] = {
        {"KVMILL_BIN=bin KVMILL_CORPUS=corpus", "kvmill.sbatch: KVMILL_CONFIG is not set"},
        {"KVMILL_BIN=bin KVMILL_CONFIG=run.ini KVMILL_CORPUS=corpus KVMILL_SERVER_KEY=server.public",
         "kvmill.sbatch: KVMILL_SERVER_KEY is set but KVMILL_CLIENT_PUBLIC is not"},
    };
    char *dir = kvm_test_tmpdir(), cmd[8192], *out = NULL;
    fake_slurm(dir, 1);
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 "cd '%s' && env -u KVMILL_CONFIG -u KVMILL_SERVER_KEY -u KVMILL_CLIENT_PUBLIC PATH=\"$PWD:$PATH\" "
                 "SLURM_JOB_NODELIST=fake %s bash '%s/deploy/slurm/kvmill.sbatch' 2>&1",
                 dir, env[i][0], KVM_TEST_SRCDIR);
        int rc = kvm_test_run(cmd, &out, NULL);
        ck_assert_msg(rc == 2, "%s: exit %d, expected 2:\n%s", env[i][0], rc, out);
        ck_assert_msg(strstr(out, env[i][1]), "%s", out);
        free(out);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *slurm_suite(void)
{
    Suite *s = suite_create("slurm");
    TCase *tc = tcase_create("device");
    tcase_add_test(tc, test_binding);
    tcase_add_test(tc, test_bad_list);
    suite_add_tcase(s, tc);
    TCase *sb = tcase_create("sbatch");
    tcase_set_timeout(sb, 200);
    tcase_add_test(sb, test_sbatch_usage);
    tcase_add_test(sb, test_sbatch_srun_fails);
    tcase_add_test(sb, test_sbatch_runs);
    suite_add_tcase(s, sb);
    return s;
}

int main(void) { return kvm_test_run_suite(slurm_suite()); }
