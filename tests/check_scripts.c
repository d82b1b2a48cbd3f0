/* check_scripts.c: the helper scripts README tells users to run (scripts/, bench/), run as a new
 * user meets them: from a copy of the tree whose path has a space, with fake tools (nvidia-smi,
 * python3) first on PATH, since this machine has no GPU. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/util/kvm_test.h"

/* A temporary tree "DIR/t h" holding a copy of the script at `rel` (scripts/x.sh) and an empty
 * DIR/fake for fake tools; *top gets "DIR/t h". Returns DIR (the caller removes and frees it). */
static char *script_tree(const char *rel, char *top, size_t n)
{
    char *dir = kvm_test_tmpdir(), cmd[16384];
    snprintf(top, n, "%s/t h", dir);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/fake' \"$(dirname '%s/%s')\" && cp '%s/%s' '%s/%s'", dir, top, rel,
             KVM_TEST_SRCDIR, rel, top, rel);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    return dir;
}

/* DIR/fake/name: a shell script with `body`, executable. */
static void fake_tool(const char *dir, const char *name, const char *body)
{
    char path[4400], text[4096];
    snprintf(path, sizeof path, "%s/fake/%s", dir, name);
    snprintf(text, sizeof text, "#!/bin/sh\n%s\n", body);
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    ck_assert_int_eq(chmod(path, 0755), 0);
}

/* Where the driver is installed but no GPU is, nvidia-smi prints "No devices were found" (or
 * "NVIDIA-SMI has failed ...") on stdout and fails: that text was taken for a GPU's name and the
 * script went on (exit 2 without gpu-pack/, failed checks with one) instead of exit 3. */
START_TEST(test_gpu_check_no_device)
{
    static const char *smi[] = {
        "echo 'No devices were found'; exit 6",
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9"};
    char top[4200], cmd[16384], *out = NULL;
    char *dir = script_tree("scripts/gpu-check.sh", top, sizeof top);
    fake_tool(dir, "python3", "exit 1"); /* no PyTorch */
    for (int i = 0; i < 2; i++) {
        fake_tool(dir, "nvidia-smi", smi[i]);
        snprintf(cmd, sizeof cmd, "cd / && PATH='%s/fake':\"$PATH\" bash '%s/scripts/gpu-check.sh' solver 2>&1", dir,
                 top);
        int rc = kvm_test_run(cmd, &out, NULL);
        ck_assert_msg(rc == 3, "%s: exit %d, expected 3:\n%s", smi[i], rc, out);
        ck_assert_msg(strstr(out, "gpu-check: no CUDA device on this host (nvidia-smi exit "), "%s", out);
        free(out);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* gpu-check.sh unpacks gpu-pack/root.tar.xz into $TMPDIR/kvmill-gpu-root once; a root/ left by an
 * unpack cut short (or by an earlier pack) was reused as it was. Now the unpack is redone unless
 * root/ came whole from this very archive. */
START_TEST(test_gpu_check_reunpack)
{
    char top[4200], cmd[20000], marker[4400], *out = NULL;
    char *dir = script_tree("scripts/gpu-check.sh", top, sizeof top);
    fake_tool(dir, "python3", "exit 1");
    snprintf(cmd, sizeof cmd,
             "cd '%s' && mkdir -p 'gpu-pack/bin' pk/root '%s/tmp/kvmill-gpu-root/root' && printf '#!/bin/sh\\n' > "
             "gpu-pack/bin/kvmill"
             " && chmod +x gpu-pack/bin/kvmill && echo v2 > pk/root/marker && tar -C pk -cf - root | xz > "
             "gpu-pack/root.tar.xz",
             top, dir);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(marker, sizeof marker, "%s/tmp/kvmill-gpu-root/root/marker", dir);
    for (int run = 0; run < 2; run++) { /* the second run reuses the unpacked root */
        snprintf(cmd, sizeof cmd,
                 "PATH='%s/fake':\"$PATH\" TMPDIR='%s/tmp' GPU_CHECK_ASSUME_DEVICE=1 bash '%s/scripts/gpu-check.sh' "
                 "forward 2>&1",
                 dir, dir, top);
        int rc = kvm_test_run(cmd, &out, NULL);
        ck_assert_msg(rc == 1, "exit %d, expected 1 (no check binaries in this pack):\n%s", rc, out);
        char *got = kvm_test_read_file(marker, NULL);
        ck_assert_msg(got && !strcmp(got, "v2\n"), "run %d: %s not unpacked from gpu-pack/root.tar.xz:\n%s", run,
                      marker, out);
        free(got);
        free(out);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* bench/task_table.sh on a folder without CSVs (a typo, or before bench/task_accuracy.sh ran)
 * printed an empty table and exited 0; now it names the folder and exits 2. A folder with a chunk
 * still running (.csv.part) gives its rows. */
START_TEST(test_task_table_folder)
{
    static const char *csv = "case,task,doc,depth,context,method,budget_tokens,correct,answer,generated,answer_nll\n"
                             "0,passkey,d,0.5,2048,full,2048,1,a,a,0.1\n0,passkey,d,0.5,2048,snapkv,512,1,a,a,0.2\n"
                             "1,passkey,d,0.5,2048,full,2048,1,a,a,0.1\n1,passkey,d,0.5,2048,snapkv,512,0,a,b,0.2\n";
    char top[4200], cmd[16384], path[4400], *out = NULL;
    char *dir = script_tree("bench/task_table.sh", top, sizeof top);
    snprintf(cmd, sizeof cmd, "cd / && sh '%s/bench/task_table.sh' '%s/no such' 2>&1", top, dir);
    int rc = kvm_test_run(cmd, &out, NULL);
    ck_assert_msg(rc == 2, "exit %d, expected 2:\n%s", rc, out);
    ck_assert_msg(strstr(out, "task_table: no *.csv or *.csv.part in "), "%s", out);
    ck_assert_msg(strstr(out, "/no such"), "%s", out);
    free(out);
    snprintf(path, sizeof path, "%s/passkey.N2048.c0.csv.part", top);
    ck_assert_int_eq(kvm_test_write_file(path, csv, strlen(csv)), 0);
    snprintf(cmd, sizeof cmd, "cd / && sh '%s/bench/task_table.sh' '%s' 2>&1", top, top);
    rc = kvm_test_run(cmd, &out, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_msg(strstr(out, "passkey    snapkv@0.250                  2    0.500"), "%s", out);
    free(out);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* scripts/gguf-to-hf.sh with a path that is no GGUF: a missing file went through pip's install
 * and ended in a Python traceback (exit 1); another format (a llama2.c checkpoint) too. Now each
 * is named, exit 2. The second needs the Python packages the script installs (CI has them). */
START_TEST(test_gguf_to_hf_input)
{
    char top[4200], cmd[16384], *out = NULL;
    char *dir = script_tree("scripts/gguf-to-hf.sh", top, sizeof top);
    snprintf(cmd, sizeof cmd, "cp '%s/scripts/gguf_to_hf.py' '%s/scripts/'", KVM_TEST_SRCDIR, top);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(cmd, sizeof cmd, "cd / && bash '%s/scripts/gguf-to-hf.sh' '%s/none.gguf' '%s/out' 2>&1", top, dir, dir);
    int rc = kvm_test_run(cmd, &out, NULL);
    ck_assert_msg(rc == 2, "exit %d, expected 2:\n%s", rc, out);
    ck_assert_msg(strstr(out, "gguf-to-hf: GGUF ") && strstr(out, "/none.gguf: not a readable file"), "%s", out);
    free(out);
    if (kvm_test_run("PYTHONPATH=\"${KVMILL_PYDEPS:-$HOME/.cache/kvmill/pydeps}\" python3 -c "
                     "'import gguf, numpy, safetensors, tokenizers'",
                     NULL, NULL)) {
        kvm_test_skip("gguf numpy safetensors tokenizers not installed (scripts/gguf-to-hf.sh installs them): "
                      "gguf_to_hf.py on a file of another format not checked");
    } else {
        snprintf(cmd, sizeof cmd, "cd / && bash '%s/scripts/gguf-to-hf.sh' '%s' '%s/out' 2>&1", top,
                 kvm_test_data_path("models/stories260K.bin"), dir);
        rc = kvm_test_run(cmd, &out, NULL);
        ck_assert_msg(rc == 2, "exit %d, expected 2:\n%s", rc, out);
        ck_assert_msg(strstr(out, "stories260K.bin: not a GGUF file (") && !strstr(out, "Traceback"), "%s", out);
        free(out);
    }
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The number of comma-separated fields of the line at p (up to its newline). */
static int csv_fields(const char *p)
{
    int n = 1;
    for (; *p && *p != '\n'; p++)
        n += *p == ',';
    return n;
}

/* bench/qsource.sh wrote a header of its own naming 11 columns over eval's rows of 14 (dtype,
 * bytes_compressed, decode_ms), so the CSV's columns did not line up with its names. Now the
 * header is eval's; a second run with one more document runs only that one and keeps one header. */
START_TEST(test_qsource_csv)
{
    char top[4200], cmd[20000], csv[4400], *out = NULL;
    char *dir = script_tree("bench/qsource.sh", top, sizeof top);
    snprintf(csv, sizeof csv, "%s/q s/qs.csv", dir);
    for (int run = 0; run < 2; run++) {
        snprintf(cmd, sizeof cmd,
                 "cd / && KVMILL='%s/kvmill' MODEL='%s' DOCDIR='%s' DOCS='%s' CTX=128 CONT=32 RETAIN=16 S=64 ROUNDS=1 "
                 "ITERS=2 RATIOS=0.5 METHODS=selectfit:query_source=synthetic,sculpt:query_source=repeat CSV='%s' "
                 "bash '%s/bench/qsource.sh' 2>&1",
                 kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"), kvm_test_data_path("corpus"),
                 run ? "000 001" : "000", csv, top);
        int rc = kvm_test_run(cmd, &out, NULL);
        ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
        ck_assert_int_eq(kvm_test_count(out, "== doc_000 ("), run ? 0 : 1);
        free(out);
    }
    char *text = kvm_test_read_file(csv, NULL);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(!strncmp(text, "doc,method,budget_tokens,ratio,", 31), "%s", text);
    ck_assert_int_eq(kvm_test_count(text, "doc,method"), 1);
    ck_assert_int_eq(kvm_test_count(text, "\ndoc_00"), 4);
    ck_assert_int_eq(csv_fields(text), csv_fields(strchr(text, '\n') + 1));
    free(text);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *scripts_suite(void)
{
    Suite *s = suite_create("scripts");
    TCase *tc = tcase_create("gpu_check");
    tcase_add_test(tc, test_gpu_check_no_device);
    tcase_add_test(tc, test_gpu_check_reunpack);
    suite_add_tcase(s, tc);
    TCase *inp = tcase_create("input");
    tcase_add_test(inp, test_task_table_folder);
    tcase_add_test(inp, test_gguf_to_hf_input);
    tcase_add_test(inp, test_qsource_csv);
    suite_add_tcase(s, inp);
    return s;
}

int main(void) { return kvm_test_run_suite(scripts_suite()); }
