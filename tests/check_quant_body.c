/* check_quant_body.c: the dequantisation bodies (kernels/kvm_quant_body.h) in the order the
 * CUDA upload runs them (kvm_qb_row_elem, one element of a [rows][in] matrix at a time, as
 * k_dequant's threads do) against the CPU loader's kvm_model_mat_rows, bit for bit: on random
 * blocks of every type kvmill loads (always), and on every tensor of SmolLM2-135M-Instruct
 * Q4_1 against ggml's own dequantisation (tests/data/smollm2/dequant.fnv; SKIP without the
 * model); and on a GPU the CUDA kernel itself on the random blocks (SKIP: no CUDA device). The
 * CPU loader's values against hand-computed ones are check_gguf's dequant_types. */
#include "common/kvm_error.h"
#include "kernels/kvm_quant_body.h"
#ifdef KVM_WITH_CUDA
#include "kernels/cuda/kvm_cuda.h"
#endif
#include "model/kvm_gguf.h"
#include "model/kvm_model.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SMOL_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define REF_DIR "tests/data/smollm2"

/* the device's loop: element i of rows × in, its row's bytes at raw + (i / in) · row bytes */
static void device_order(int type, const uint8_t *raw, int64_t rows, int64_t in, float *y)
{
    const int64_t rb = kvm_qb_row_bytes(type, in);
    for (int64_t i = 0; i < rows * in; i++)
        y[i] = kvm_qb_row_elem(type, raw + i / in * rb, i % in);
}

static uint64_t fnv1a(const void *p, size_t n)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t k = 0; k < n; k++) {
        h ^= ((const unsigned char *)p)[k];
        h *= 1099511628211ull;
    }
    return h;
}

/* offsets of a block's f16 scale fields (d, and m / dmin where the type has one) */
static void scale_fields(int type, int off[2], int *n)
{
    *n = 0;
    switch (type) {
    case KVM_QB_Q8_0:
    case KVM_QB_Q4_0:
    case KVM_QB_Q5_0:
        off[(*n)++] = 0;
        break;
    case KVM_QB_Q4_1:
    case KVM_QB_Q5_1:
    case KVM_QB_Q4_K:
        off[(*n)++] = 0, off[(*n)++] = 2;
        break;
    case KVM_QB_Q6_K:
        off[(*n)++] = 208;
        break;
    default:
        break;
    }
}

static const int TYPES[] = {KVM_QB_F32,  KVM_QB_F16,  KVM_QB_BF16, KVM_QB_Q8_0, KVM_QB_Q4_0,
                            KVM_QB_Q4_1, KVM_QB_Q5_0, KVM_QB_Q5_1, KVM_QB_Q4_K, KVM_QB_Q6_K};
enum { N_TYPES = sizeof TYPES / sizeof TYPES[0], ROWS = 5 };

/* ROWS rows of *in elements (3 blocks; 96 for the 1-element types) of random bytes with finite
 * scales (normal and subnormal halves: a NaN scale would make every value NaN); caller frees */
static uint8_t *random_rows(int type, uint64_t *s, int64_t *in)
{
    const int64_t be = kvm_qb_block_elems(type), bb = kvm_qb_block_bytes(type);
    *in = be == 1 ? 96 : 3 * be;
    const int64_t rb = kvm_qb_row_bytes(type, *in);
    uint8_t *raw = malloc((size_t)(ROWS * rb));
    ck_assert_ptr_nonnull(raw);
    for (int64_t i = 0; i < ROWS * rb; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        raw[i] = (uint8_t)(*s >> 56);
    }
    int off[2], n_off;
    scale_fields(type, off, &n_off);
    for (int64_t b = 0; b < ROWS * *in / be; b++)
        for (int f = 0; f < n_off; f++) {
            uint8_t *p = raw + b * bb + off[f];
            const uint32_t h = (uint32_t)(p[1] & 0x83) << 8 | p[0];             /* sign, 10 mantissa bits */
            const uint32_t fin = (h & 0x83FF) | (uint32_t)((b + f) % 21) << 10; /* exponents 0..20 */
            p[0] = (uint8_t)fin, p[1] = (uint8_t)(fin >> 8);
        }
    return raw;
}

START_TEST(test_random_blocks_every_type)
{
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int ti = 0; ti < N_TYPES; ti++) {
        const int type = TYPES[ti];
        const int64_t be = kvm_qb_block_elems(type), bb = kvm_qb_block_bytes(type);
        ck_assert_int_eq(be, kvm_ggml_block_elems(type));
        ck_assert_int_eq(bb, kvm_ggml_block_bytes(type));
        int64_t in;
        uint8_t *raw = random_rows(type, &s, &in);
        ck_assert_int_eq(kvm_qb_row_bytes(type, in), in / be * bb);
        float *cpu = malloc((size_t)(ROWS * in) * sizeof *cpu), *dev = malloc((size_t)(ROWS * in) * sizeof *dev);
        ck_assert(cpu && dev);
        const kvm_mat w = {.data = raw, .type = type};
        ck_assert_msg(kvm_model_mat_rows(&w, in, 0, ROWS, cpu) == 0, "%s", kvm_errmsg());
        device_order(type, raw, ROWS, in, dev);
        for (int64_t i = 0; i < ROWS * in; i++)
            ck_assert_msg(!memcmp(&cpu[i], &dev[i], sizeof(float)), "%s element %lld: loader %.9g, device order %.9g",
                          kvm_ggml_type_name(type), (long long)i, cpu[i], dev[i]);
        /* a row range starts where the device's row indexing puts it */
        float one[256 * 3];
        ck_assert_int_eq(kvm_model_mat_rows(&w, in, 3, 1, one), 0);
        ck_assert(!memcmp(one, dev + 3 * in, (size_t)in * sizeof(float)));
        printf("%s: %lld elements of %d rows identical in both orders\n", kvm_ggml_type_name(type),
               (long long)(ROWS * in), ROWS);
        free(raw);
        free(cpu);
        free(dev);
    }
    /* a type the bodies do not know gives no block size (the upload refuses it) */
    ck_assert_int_eq(kvm_qb_block_elems(10), 0);
    ck_assert_int_eq(kvm_qb_row_bytes(10, 256), 0);
}
END_TEST

/* the same random rows dequantised by the CUDA kernel itself (kvm_cuda_dequantize) equal the
 * loader's bit for bit (SKIP without a device) */
START_TEST(test_device_dequantize)
{
#ifdef KVM_WITH_CUDA
    const kvm_kernels *k;
    if (kvm_kernels_select("cuda:0", &k)) {
        kvm_test_skip("no CUDA device: the device's dequantisation is not run");
        return;
    }
    uint64_t s = 0x243f6a8885a308d3ull;
    for (int ti = 0; ti < N_TYPES; ti++) {
        const int type = TYPES[ti];
        int64_t in;
        uint8_t *raw = random_rows(type, &s, &in);
        float *cpu = malloc((size_t)(ROWS * in) * sizeof *cpu), *dev = malloc((size_t)(ROWS * in) * sizeof *dev);
        ck_assert(cpu && dev);
        const kvm_mat w = {.data = raw, .type = type};
        ck_assert_int_eq(kvm_model_mat_rows(&w, in, 0, ROWS, cpu), 0);
        ck_assert_msg(kvm_cuda_dequantize(0, dev, raw, type, ROWS, in) == 0, "%s", kvm_errmsg());
        for (int64_t i = 0; i < ROWS * in; i++)
            ck_assert_msg(!memcmp(&cpu[i], &dev[i], sizeof(float)), "%s element %lld: loader %.9g, cuda:0 %.9g",
                          kvm_ggml_type_name(type), (long long)i, cpu[i], dev[i]);
        printf("cuda:0 %s: %lld elements identical to the loader's\n", kvm_ggml_type_name(type),
               (long long)(ROWS * in));
        free(raw);
        free(cpu);
        free(dev);
    }
    ck_assert_int_eq(kvm_cuda_dequantize(0, NULL, NULL, 10, 1, 256), KVM_ENOTSUP);
#else
    kvm_test_skip("no CUDA device (built without CUDA): the device's dequantisation is not run");
#endif
}
END_TEST

/* every tensor of SmolLM2, dequantised in the device's order, hashes to ggml's bytes */
START_TEST(test_smol_device_order_matches_ggml)
{
    FILE *mf = fopen(SMOL_PATH, "rb");
    if (!mf) {
        kvm_test_skip(SMOL_PATH " absent (run scripts/get-model.sh): SmolLM2 rows not checked");
        return;
    }
    fclose(mf);
    size_t n;
    char *file = kvm_test_read_file(SMOL_PATH, &n);
    ck_assert_ptr_nonnull(file);
    kvm_gguf *g;
    ck_assert_int_eq(kvm_gguf_parse(SMOL_PATH, (const uint8_t *)file, n, &g), 0);
    FILE *f = fopen(REF_DIR "/dequant.fnv", "r");
    ck_assert_ptr_nonnull(f);
    char name[128];
    int type, count = 0, by_type[64] = {0};
    long long elems;
    unsigned long long want;
    while (fscanf(f, "%127s %d %lld %llx", name, &type, &elems, &want) == 4) {
        const kvm_gguf_tensor *t = kvm_gguf_find_tensor(g, name);
        ck_assert_msg(t != NULL, "%s missing", name);
        const int64_t in = t->ne[0], rows = elems / in;
        float *y = malloc((size_t)elems * sizeof *y);
        ck_assert_ptr_nonnull(y);
        device_order(t->type, t->data, rows, in, y);
        ck_assert_msg(fnv1a(y, (size_t)elems * sizeof *y) == want, "%s (%s): device-order values differ from ggml's",
                      name, kvm_ggml_type_name(type));
        if (!strcmp(name, "blk.0.attn_q.weight") || !strcmp(name, "token_embd.weight")) {
            /* and equal the loader's rows (the CPU forward's weights) element for element */
            float *z = malloc((size_t)elems * sizeof *z);
            const kvm_mat w = {.data = t->data, .type = t->type};
            ck_assert_ptr_nonnull(z);
            ck_assert_int_eq(kvm_model_mat_rows(&w, in, 0, rows, z), 0);
            ck_assert(!memcmp(y, z, (size_t)elems * sizeof *y));
            free(z);
        }
        free(y);
        count++;
        by_type[type & 63]++;
    }
    fclose(f);
    printf("device-order dequantisation equals ggml's for %d tensors (F32 %d, Q8_0 %d, Q4_1 %d)\n", count,
           by_type[KVM_QB_F32], by_type[KVM_QB_Q8_0], by_type[KVM_QB_Q4_1]);
    ck_assert_int_eq(count, (int)kvm_gguf_n_tensors(g));
    kvm_gguf_free(&g);
    free(file);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("quant_body");
    TCase *tc = tcase_create("quant_body");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_random_blocks_every_type);
    tcase_add_test(tc, test_smol_device_order_matches_ggml);
    tcase_add_test(tc, test_device_dequantize);
    suite_add_tcase(s, tc);
    return kvm_test_run_suite(s);
}
