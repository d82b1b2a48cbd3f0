/* fuzz_file_st_index.c: libFuzzer target for model.safetensors.index.json (kvm_st_open_dir's
 * index branch: weight_map, file names, shard order, tensors against the shards). The input is
 * written as the index into a temporary folder made once per process, beside two valid shards,
 * a file that is not a safetensors file, a subfolder, a symlink to a shard and a symlink loop.
 * On a folder it accepts, every tensor is found by name in a file of that folder, its first and
 * last byte are read, and kvm_hf_model_files lists the same files. */
#include "fuzz/fuzz_file.h"
#include "model/kvm_hf.h"
#include "model/kvm_safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];

/* g_dir/name: a safetensors file of `header` (padded with spaces to 8 bytes) and data_bytes
 * bytes of finite float32 values. */
static void write_shard(const char *name, const char *header, size_t data_bytes)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    size_t hl = strlen(header), pad = (8 - hl % 8) % 8;
    uint64_t n = hl + pad;
    FILE *f = fopen(p, "wb");
    int ok = f && fwrite(&n, 8, 1, f) == 1 && fwrite(header, 1, hl, f) == hl && fwrite("        ", 1, pad, f) == pad;
    for (size_t i = 0; ok && i < data_bytes; i++)
        ok = fputc((int)(i * 37 + 11) & 0x3f, f) != EOF;
    if (!f || fclose(f) != 0 || !ok) {
        fprintf(stderr, "fuzz_file_st_index: cannot write %s\n", p);
        abort();
    }
}

static void remove_folder(void)
{
    static const char *const names[] = {"model.safetensors.index.json",
                                        "model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors",
                                        "config.json",
                                        "link.safetensors",
                                        "loop.safetensors",
                                        "sub"};
    char p[512];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", g_dir, names[i]);
        if (unlink(p) != 0) rmdir(p);
    }
    rmdir(g_dir);
}

/* The folder, made on the first input: shard 1 holds a [2] and b [2][2], shard 2 holds c [3]. */
static void make_folder(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/kvm_fuzz_st_index.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) {
        fprintf(stderr, "fuzz_file_st_index: mkdtemp %s failed\n", g_dir);
        abort();
    }
    atexit(remove_folder);
    write_shard("model-00001-of-00002.safetensors",
                "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"b\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[8,24]}}",
                24);
    write_shard("model-00002-of-00002.safetensors", "{\"c\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}",
                12);
    char p[512];
    snprintf(p, sizeof p, "%s/config.json", g_dir);
    FILE *f = fopen(p, "w");
    if (f) fputs("{\"architectures\": [\"LlamaForCausalLM\"]}\n", f);
    if (!f || fclose(f) != 0) abort();
    snprintf(p, sizeof p, "%s/sub", g_dir);
    if (mkdir(p, 0755) != 0) abort();
    snprintf(p, sizeof p, "%s/link.safetensors", g_dir);
    if (symlink("model-00002-of-00002.safetensors", p) != 0) abort();
    snprintf(p, sizeof p, "%s/loop.safetensors", g_dir);
    if (symlink("loop.safetensors", p) != 0) abort();
}

/* Invariants of an accepted folder. */
static void check_set(const kvm_st *s)
{
    size_t dl = strlen(g_dir);
    for (int i = 0; i < kvm_st_n_files(s); i++) {
        const char *p = kvm_st_file_path(s, i);
        if (strncmp(p, g_dir, dl) != 0 || p[dl] != '/' || strchr(p + dl + 1, '/')) {
            fprintf(stderr, "accepted index opened '%s', outside the folder %s\n", p, g_dir);
            abort();
        }
    }
    for (int64_t i = 0; i < kvm_st_n_tensors(s); i++) {
        const kvm_st_tensor *t = kvm_st_tensor_at(s, i);
        if (kvm_st_find(s, t->name) != t || t->file < 0 || t->file >= kvm_st_n_files(s)) {
            fprintf(stderr, "tensor '%s' is not found by its name, or has no file\n", t->name);
            abort();
        }
        if (t->bytes) {
            kvm_fuzz_touch(t->data, 0);
            kvm_fuzz_touch(t->data, (size_t)t->bytes - 1);
        }
    }
    char **paths = NULL;
    int n = 0;
    if (kvm_hf_model_files(g_dir, &paths, &n) != 0 || n != kvm_st_n_files(s) + 1) {
        fprintf(stderr, "kvm_hf_model_files disagrees with kvm_st_open_dir: %s\n", kvm_errmsg());
        abort();
    }
    for (int i = 0; i < n; i++) {
        if (i && strcmp(paths[i], kvm_st_file_path(s, i - 1)) != 0) abort();
        free(paths[i]);
    }
    free(paths);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!g_dir[0]) make_folder();
    char p[512];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", g_dir);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) abort();
    kvm_st *s = NULL;
    if (kvm_st_open_dir(g_dir, &s) == 0) check_set(s);
    kvm_st_close(&s);
    unlink(p);
    return 0;
}
