/* check_safetensors.c: the safetensors reader (model/kvm_safetensors.h) on files the test
 * writes: values of every dtype read back exactly, sharded folders with an index, and each
 * class of malformed file or index refused with a message naming the file and the tensor;
 * every truncation of a valid file refused (run under ASan: never a read past the mapping). */
#include "common/kvm_error.h"
#include "model/kvm_safetensors.h"
#include "tests/util/kvm_test.h"
#include "tests/util/kvm_test_st.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char *g_dir;

static void setup(void) { g_dir = kvm_test_tmpdir(); }
static void teardown(void)
{
    kvm_test_rmtree(g_dir);
    free(g_dir);
}

static const char *in_dir(const char *name)
{
    static char p[4096];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    return p;
}

/* Opens one file; expects status want and, when not 0, a message holding each of needles. */
static void expect_file(const char *path, int want, const char *needle1, const char *needle2)
{
    kvm_st *s = NULL;
    const char *p = path;
    int rc = kvm_st_open_files(&p, 1, &s);
    ck_assert_msg(rc == want, "%s: got %d (%s), want %d", path, rc, kvm_errmsg(), want);
    if (want == 0) {
        kvm_st_close(&s);
        return;
    }
    ck_assert_ptr_null(s);
    ck_assert_msg(strstr(kvm_errmsg(), path) != NULL, "message '%s' does not name the file", kvm_errmsg());
    if (needle1) ck_assert_msg(strstr(kvm_errmsg(), needle1) != NULL, "message '%s' lacks '%s'", kvm_errmsg(), needle1);
    if (needle2) ck_assert_msg(strstr(kvm_errmsg(), needle2) != NULL, "message '%s' lacks '%s'", kvm_errmsg(), needle2);
}

START_TEST(test_values)
{
    const char *path = in_dir("v.safetensors");
    /* a: F32 [2][3]; b: BF16 [4]; c: F16 [2]; d: F32 scalar */
    char hdr[512];
    snprintf(hdr, sizeof hdr,
             "{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
             "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]},"
             "\"c\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[32,36]},"
             "\"d\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[36,40]}}");
    float a[6] = {1, -2, 3.5f, 0, 1e-3f, -7};
    uint16_t b[4] = {0x3f80, 0xc000, 0x4049, 0x0000}; /* 1, -2, 3.140625, 0 */
    uint16_t c[2] = {0x3c00, 0xc500};                 /* 1, -5 */
    float d = 42;
    uint8_t data[40];
    memcpy(data, a, 24);
    memcpy(data + 24, b, 8);
    memcpy(data + 32, c, 4);
    memcpy(data + 36, &d, 4);
    FILE *f = fopen(path, "wb");
    uint64_t n = strlen(hdr);
    fwrite(&n, 8, 1, f);
    fwrite(hdr, 1, n, f);
    fwrite(data, 1, sizeof data, f);
    fclose(f);
    kvm_st *s;
    ck_assert_msg(kvm_st_open_files(&path, 1, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_st_n_tensors(s), 4);
    const kvm_st_tensor *t = kvm_st_find(s, "a");
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->n_dims, 2);
    ck_assert_int_eq(t->shape[0], 2);
    ck_assert_int_eq(t->shape[1], 3);
    float y[6];
    kvm_st_to_f32(t->dtype, t->data, y, t->n_elems);
    for (int i = 0; i < 6; i++)
        ck_assert_float_eq(y[i], a[i]);
    t = kvm_st_find(s, "b");
    ck_assert_int_eq(t->dtype, KVM_ST_BF16);
    kvm_st_to_f32(t->dtype, t->data, y, 4);
    ck_assert_float_eq(y[0], 1);
    ck_assert_float_eq(y[1], -2);
    ck_assert_float_eq(y[2], 3.140625f);
    ck_assert_float_eq(y[3], 0);
    t = kvm_st_find(s, "c");
    ck_assert_int_eq(t->dtype, KVM_ST_F16);
    kvm_st_to_f32(t->dtype, t->data, y, 2);
    ck_assert_float_eq(y[0], 1);
    ck_assert_float_eq(y[1], -5);
    t = kvm_st_find(s, "d");
    ck_assert_int_eq(t->n_dims, 0);
    ck_assert_int_eq(t->n_elems, 1);
    ck_assert_ptr_null(kvm_st_find(s, "e"));
    kvm_st_close(&s);
    ck_assert_ptr_null(s);
}
END_TEST

/* One malformed header per case: (header, data bytes, status, words the message must hold). */
START_TEST(test_malformed)
{
    struct {
        const char *hdr;
        size_t data;
        int want;
        const char *n1, *n2;
    } cases[] = {
        {"[1,2]", 0, KVM_EFORMAT, "not an object", NULL},
        {"{\"a\":", 0, KVM_EFORMAT, "header JSON", NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[4,8]}}",
         8, KVM_EFORMAT, "duplicate", NULL},
        {"{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, KVM_EFORMAT, "'w'", "dtype"},
        {"{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, KVM_EFORMAT, "'w'", "shape"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, KVM_EFORMAT, "'w'", "data_offsets"},
        {"{\"w\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, KVM_ENOTSUP, "'w'", "I64"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, KVM_EFORMAT, "'w'", "shape"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, KVM_ENOTSUP, "'w'",
         "dimensions"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, KVM_EFORMAT, "'w'", "end before"},
        /* said "data_offsets[1] must be an integer in [0, 4]" for what is a truncated file */
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, KVM_EFORMAT, "'w'", "cut short"},
        /* offsets no file reaches: were called a cut-short file too */
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4611686018427387904,4611686018427387912]}}", 8,
         KVM_EFORMAT, "'w'", "the header's offsets are corrupt"},
        /* 2^48 itself is still a (huge) truncation */
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,281474976710656]}}", 8, KVM_EFORMAT, "'w'",
         "cut short"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, KVM_EFORMAT, "'w'", "shape needs 12"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"v\":{\"dtype\":\"F32\",\"shape\":[2],"
         "\"data_offsets\":[4,12]}}",
         12, KVM_EFORMAT, "'v'", "overlaps 'w'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, KVM_EFORMAT, "'w'", "hole"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 12, KVM_EFORMAT, "8 bytes after", NULL},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4, KVM_EFORMAT, "'w'", "keys"},
        {"{\"__metadata__\":{\"k\":1}}", 0, KVM_EFORMAT, "__metadata__", "'k'"},
        {"{\"w\":[0]}", 0, KVM_EFORMAT, "'w'", "not an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[32];
        snprintf(name, sizeof name, "m%zu.safetensors", i);
        const char *p = in_dir(name);
        ck_assert_int_eq(kvm_test_st_write_raw(p, strlen(cases[i].hdr), cases[i].hdr, cases[i].data), 0);
        expect_file(p, cases[i].want, cases[i].n1, cases[i].n2);
    }
    /* header lengths past the file, zero, and a file shorter than the length field */
    const char *p = in_dir("len.safetensors");
    ck_assert_int_eq(kvm_test_st_write_raw(p, 1000, "{}", 0), 0);
    expect_file(p, KVM_EFORMAT, "header length 1000", NULL);
    ck_assert_int_eq(kvm_test_st_write_raw(p, 0, "{}", 0), 0);
    expect_file(p, KVM_EFORMAT, "header length 0", NULL);
    ck_assert_int_eq(kvm_test_st_write_raw(p, UINT64_MAX, "{}", 0), 0);
    expect_file(p, KVM_EFORMAT, "header length", NULL);
    ck_assert_int_eq(kvm_test_write_file(p, "abc", 3), 0);
    expect_file(p, KVM_EFORMAT, "too short", NULL);
    expect_file(in_dir("absent.safetensors"), KVM_ENOTFOUND, NULL, NULL);
}
END_TEST

/* A header without tensors ("{}", or only __metadata__) and no data is a valid empty file (the
 * Rust reader accepts it): it opens with no tensors. Found by fuzz_file_safetensors: the tiling
 * check sorted the NULL tensor array (qsort(NULL + 0, 0): undefined, reported by UBSan, which
 * make SAN=1 turns into a failure of this test). */
START_TEST(test_no_tensors)
{
    const char *hdrs[] = {"{}", "{\"__metadata__\":{\"format\":\"pt\"}}"};
    for (size_t i = 0; i < sizeof hdrs / sizeof hdrs[0]; i++) {
        const char *p = in_dir("empty.safetensors");
        ck_assert_int_eq(kvm_test_st_write_raw(p, strlen(hdrs[i]), hdrs[i], 0), 0);
        kvm_st *s = NULL;
        ck_assert_msg(kvm_st_open_files(&p, 1, &s) == 0, "%s: %s", hdrs[i], kvm_errmsg());
        ck_assert_int_eq(kvm_st_n_tensors(s), 0);
        ck_assert_ptr_null(kvm_st_find(s, "w"));
        kvm_st_close(&s);
        size_t n;
        char *bytes = kvm_test_read_file(p, &n);
        ck_assert_msg(kvm_st_open_mem("empty", (const uint8_t *)bytes, n, &s) == 0, "%s: %s", hdrs[i], kvm_errmsg());
        ck_assert_int_eq(kvm_st_n_tensors(s), 0);
        kvm_st_close(&s);
        free(bytes);
    }
}
END_TEST

/* kvm_st_open_mem on a file's bytes: the same tensors as kvm_st_open_files, its name in the
 * messages, and kvm_st_release leaves the caller's memory alone. */
START_TEST(test_open_mem)
{
    const char *path = in_dir("m.safetensors");
    enum { NA = 4096 }; /* 16 KiB: whole pages, which kvm_st_release would drop from a mapping */
    float *a = malloc(NA * sizeof *a), b[2] = {4, 5};
    for (int i = 0; i < NA; i++)
        a[i] = (float)(i + 1);
    kvm_test_st_tensor ts[] = {{"a", "F32", 1, {NA}, a}, {"b", "F32", 1, {2}, b}};
    ck_assert_int_eq(kvm_test_st_write(path, ts, 2), 0);
    size_t n = 0;
    char *bytes = kvm_test_read_file(path, &n);
    ck_assert_ptr_nonnull(bytes);
    kvm_st *s = NULL;
    ck_assert_msg(kvm_st_open_mem("mem.safetensors", (const uint8_t *)bytes, n, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_st_n_tensors(s), 2);
    ck_assert_str_eq(kvm_st_file_path(s, 0), "mem.safetensors");
    const kvm_st_tensor *t = kvm_st_find(s, "a");
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->n_elems, NA);
    ck_assert_msg(t->data >= (const uint8_t *)bytes && t->data + t->bytes <= (const uint8_t *)bytes + n,
                  "tensor data outside the buffer");
    /* release must not drop the pages of the caller's memory (they would read back as zeros) */
    kvm_st_release(s, t);
    float *back = malloc(NA * sizeof *back);
    kvm_st_to_f32(t->dtype, t->data, back, NA);
    for (int i = 0; i < NA; i++)
        ck_assert_msg(back[i] == a[i], "a[%d] = %g after release, want %g", i, back[i], a[i]);
    kvm_st_close(&s);
    ck_assert_ptr_null(s);
    ck_assert_int_eq(memcmp(bytes + n - 8, b, 8), 0); /* the buffer is the caller's: intact after close */
    ck_assert_int_eq(kvm_st_open_mem("short.safetensors", (const uint8_t *)bytes, 7, &s), KVM_EFORMAT);
    ck_assert_ptr_null(s);
    ck_assert_msg(strstr(kvm_errmsg(), "short.safetensors") && strstr(kvm_errmsg(), "too short"), "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_st_open_mem("cut.safetensors", (const uint8_t *)bytes, n - 1, &s), KVM_EFORMAT);
    ck_assert_msg(strstr(kvm_errmsg(), "cut.safetensors"), "%s", kvm_errmsg());
    free(back);
    free(bytes);
    free(a);
}
END_TEST

/* A valid two-tensor file cut at every length is refused, never read past. */
START_TEST(test_truncated)
{
    const char *p = in_dir("ok.safetensors");
    float a[6] = {1, 2, 3, 4, 5, 6};
    kvm_test_st_tensor t[2] = {{"x", "F32", 2, {2, 2}, a}, {"y", "BF16", 1, {2}, a + 4}};
    ck_assert_int_eq(kvm_test_st_write(p, t, 2), 0);
    size_t n;
    char *bytes = kvm_test_read_file(p, &n);
    ck_assert_ptr_nonnull(bytes);
    expect_file(p, 0, NULL, NULL);
    const char *q = in_dir("cut.safetensors");
    for (size_t len = 0; len < n; len++) {
        ck_assert_int_eq(kvm_test_write_file(q, bytes, len), 0);
        kvm_st *s = NULL;
        int rc = kvm_st_open_files(&q, 1, &s);
        ck_assert_msg(rc == KVM_EFORMAT, "cut at %zu of %zu: got %d (%s)", len, n, rc, kvm_errmsg());
    }
    free(bytes);
}
END_TEST

static void write_index(const char *json)
{
    ck_assert_int_eq(kvm_test_write_file(in_dir("model.safetensors.index.json"), json, strlen(json)), 0);
}

static void write_shards(void)
{
    static const float v[4] = {1, 2, 3, 4};
    kvm_test_st_tensor a[2] = {{"a", "F32", 1, {2}, v}, {"b", "F32", 1, {2}, v + 2}};
    kvm_test_st_tensor c[1] = {{"c", "BF16", 1, {4}, v}};
    ck_assert_int_eq(kvm_test_st_write(in_dir("model-00001-of-00002.safetensors"), a, 2), 0);
    ck_assert_int_eq(kvm_test_st_write(in_dir("model-00002-of-00002.safetensors"), c, 1), 0);
}

static void expect_dir(int want, const char *n1, const char *n2)
{
    kvm_st *s = NULL;
    int rc = kvm_st_open_dir(g_dir, &s);
    ck_assert_msg(rc == want, "got %d (%s), want %d", rc, kvm_errmsg(), want);
    if (!want) {
        kvm_st_close(&s);
        return;
    }
    if (n1) ck_assert_msg(strstr(kvm_errmsg(), n1) != NULL, "message '%s' lacks '%s'", kvm_errmsg(), n1);
    if (n2) ck_assert_msg(strstr(kvm_errmsg(), n2) != NULL, "message '%s' lacks '%s'", kvm_errmsg(), n2);
}

START_TEST(test_sharded)
{
    expect_dir(KVM_ENOTFOUND, "model.safetensors", NULL);
    write_shards();
    write_index("{\"metadata\":{},\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\","
                "\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00001-of-00002.safetensors\"}}");
    kvm_st *s;
    ck_assert_msg(kvm_st_open_dir(g_dir, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_st_n_files(s), 2);
    ck_assert_ptr_nonnull(strstr(kvm_st_file_path(s, 0), "model-00001-of-00002"));
    const kvm_st_tensor *t = kvm_st_find(s, "c");
    ck_assert_int_eq(t->file, 1);
    float y[4];
    kvm_st_to_f32(t->dtype, t->data, y, 4);
    ck_assert_float_eq(y[3], 4);
    kvm_st_close(&s);
    /* a model.safetensors beside the index, which transformers loads instead: the shards were loaded, unsaid */
    kvm_test_st_tensor one[1] = {{"a", "F32", 1, {4}, y}};
    ck_assert_int_eq(kvm_test_st_write(in_dir("model.safetensors"), one, 1), 0);
    expect_dir(KVM_EFORMAT, "both", "model.safetensors.index.json");
    ck_assert_msg(strstr(kvm_errmsg(), "/model.safetensors and ") &&
                      strstr(kvm_errmsg(), "remove the one that is stale"),
                  "%s", kvm_errmsg());
    ck_assert_int_eq(unlink(in_dir("model.safetensors")), 0);
    /* a link to a missing blob of that name is no file transformers loads: the index still decides */
    ck_assert_int_eq(symlink("../../blobs/0123abcd", in_dir("model.safetensors")), 0);
    expect_dir(0, NULL, NULL);
    ck_assert_int_eq(unlink(in_dir("model.safetensors")), 0);
    /* the index puts b in the other shard */
    write_index("{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\","
                "\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00002-of-00002.safetensors\"}}");
    expect_dir(KVM_EFORMAT, "'b' in model-00002-of-00002.safetensors", "but it is in");
    /* z listed but in no shard */
    write_index("{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\",\"a\":\"model-00001-of-00002.safetensors\","
                "\"b\":\"model-00001-of-00002.safetensors\",\"z\":\"model-00001-of-00002.safetensors\"}}");
    expect_dir(KVM_EFORMAT, "'z'", "not in model-00001");
    /* b unlisted */
    write_index("{\"weight_map\":{\"c\":\"model-00002-of-00002.safetensors\","
                "\"a\":\"model-00001-of-00002.safetensors\"}}");
    expect_dir(KVM_EFORMAT, "'b'", "not listed");
    /* an absent shard */
    write_index("{\"weight_map\":{\"a\":\"model-00003-of-00003.safetensors\"}}");
    expect_dir(KVM_ENOTFOUND, "model-00003-of-00003.safetensors: no such file", "(a shard ");
    ck_assert_msg(strstr(kvm_errmsg(), "model.safetensors.index.json lists)"), "%s", kvm_errmsg());
    /* a path outside the folder */
    write_index("{\"weight_map\":{\"a\":\"../x.safetensors\"}}");
    expect_dir(KVM_EFORMAT, "'a'", "not a file name");
    write_index("{\"weight_map\":[]}");
    expect_dir(KVM_EFORMAT, "weight_map", NULL);
    write_index("{\"weight_map\":{\"a\":3}}");
    expect_dir(KVM_EFORMAT, "'a'", "not a string");
    write_index("{\"weight_map\":{}}");
    expect_dir(KVM_EFORMAT, "empty", NULL);
    write_index("{\"weight_map\"");
    expect_dir(KVM_EFORMAT, "index.json", NULL);
    /* one tensor in two shards */
    static const float v[2] = {1, 2};
    kvm_test_st_tensor dup[1] = {{"a", "F32", 1, {2}, v}};
    ck_assert_int_eq(kvm_test_st_write(in_dir("model-00002-of-00002.safetensors"), dup, 1), 0);
    write_index("{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\",\"b\":\"model-00001-of-00002.safetensors\","
                "\"c\":\"model-00002-of-00002.safetensors\"}}");
    expect_dir(KVM_EFORMAT, "'a'", "also in");
}
END_TEST

/* What the folder's entries are, not only their names: the index or model.safetensors as a
 * FIFO (json_load_file blocked on it: a hang), a directory, a symbolic link loop or a link to a
 * missing blob (taken for an absent file: "no model.safetensors"), and a shard named "." or
 * naming a subfolder (KVM_EIO, exit 1) are each refused as a bad folder naming the entry; a
 * shard that is a symbolic link (the Hugging Face cache's layout) is followed. A folder of PyTorch
 * weights says they are not read. */
START_TEST(test_entries)
{
    /* PyTorch weights only: said "no model.safetensors" without saying why the .bin is not read */
    ck_assert_int_eq(kvm_test_write_file(in_dir("pytorch_model.bin"), "PK", 2), 0);
    expect_dir(KVM_ENOTFOUND, "no model.safetensors", "pytorch_model.bin weights are PyTorch pickles");
    write_shards();
    static const char idx[] = "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
                              "\"b\":\"model-00001-of-00002.safetensors\",\"c\":\"%s\"}}";
    char text[512];
    ck_assert_int_eq(mkfifo(in_dir("model.safetensors.index.json"), 0644), 0);
    expect_dir(KVM_EFORMAT, "model.safetensors.index.json", "FIFO");
    ck_assert_int_eq(unlink(in_dir("model.safetensors.index.json")), 0);
    ck_assert_int_eq(mkdir(in_dir("model.safetensors.index.json"), 0755), 0);
    expect_dir(KVM_EFORMAT, "model.safetensors.index.json", "not a regular file (a directory)");
    ck_assert_int_eq(rmdir(in_dir("model.safetensors.index.json")), 0);
    ck_assert_int_eq(symlink("model.safetensors.index.json", in_dir("model.safetensors.index.json")), 0);
    expect_dir(KVM_EFORMAT, "model.safetensors.index.json", "symbolic links");
    ck_assert_int_eq(unlink(in_dir("model.safetensors.index.json")), 0);
    ck_assert_int_eq(symlink("../../blobs/0123abcd", in_dir("model.safetensors")), 0);
    expect_dir(KVM_EFORMAT, "model.safetensors: a symbolic link to '../../blobs/0123abcd'", "does not exist");
    ck_assert_int_eq(unlink(in_dir("model.safetensors")), 0);
    /* more files than a set holds: was "safetensors: 4097 files (1..4096)", naming no file */
    size_t cap = 64 + 40 * (KVM_ST_MAX_FILES + 1), n = 0;
    char *big = malloc(cap);
    n += (size_t)snprintf(big, cap, "{\"weight_map\":{");
    for (int i = 0; i <= KVM_ST_MAX_FILES; i++)
        n += (size_t)snprintf(big + n, cap - n, "%s\"t%d\":\"f%d.safetensors\"", i ? "," : "", i, i);
    snprintf(big + n, cap - n, "}}");
    write_index(big);
    free(big);
    expect_dir(KVM_EFORMAT, "model.safetensors.index.json", "names 4097 files");
    snprintf(text, sizeof text, idx, ".");
    write_index(text);
    expect_dir(KVM_EFORMAT, "weight_map['c'] = '.'", "not a file name");
    ck_assert_int_eq(mkdir(in_dir("sub"), 0755), 0);
    snprintf(text, sizeof text, idx, "sub");
    write_index(text);
    expect_dir(KVM_EFORMAT, "sub", "not a regular file");
    ck_assert_int_eq(symlink("model-00002-of-00002.safetensors", in_dir("link.safetensors")), 0);
    snprintf(text, sizeof text, idx, "link.safetensors");
    write_index(text);
    expect_dir(0, NULL, NULL);
}
END_TEST

/* A tensor of no elements shares its offset with the next one; listed after it in the header,
 * the file was refused as "'zero' at data offset 0 overlaps 'w'" (the Rust reader sorts by
 * [begin, end) and reads it). */
START_TEST(test_empty_tensor_order)
{
    const char *p = in_dir("z.safetensors");
    static const char hdr[] = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                              "\"zero\":{\"dtype\":\"F32\",\"shape\":[2,0],\"data_offsets\":[0,0]}}";
    ck_assert_int_eq(kvm_test_st_write_raw(p, strlen(hdr), hdr, 8), 0);
    kvm_st *s = NULL;
    ck_assert_msg(kvm_st_open_files(&p, 1, &s) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_st_find(s, "zero")->n_elems, 0);
    ck_assert_int_eq(kvm_st_find(s, "w")->n_elems, 2);
    kvm_st_close(&s);
}
END_TEST

static Suite *st_suite(void)
{
    Suite *s = suite_create("safetensors");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"values", test_values},         {"malformed", test_malformed},
                 {"truncated", test_truncated},   {"open_mem", test_open_mem},
                 {"no_tensors", test_no_tensors}, {"sharded", test_sharded},
                 {"entries", test_entries},       {"empty_tensor_order", test_empty_tensor_order}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(st_suite()); }
