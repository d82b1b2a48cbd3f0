/* kvm_test_st.c: safetensors writers and the tiny-model weight generator for the tests. */
#include "tests/util/kvm_test_st.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

float kvm_test_bf16_trunc(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    u &= 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}

static uint64_t splitmix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float kvm_test_tiny_weight(const char *name, int64_t i)
{
    uint64_t h = 14695981039346656037ull;
    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ull;
    int64_t u = (int64_t)(splitmix64(h + (uint64_t)i) >> 40) - (1 << 23);
    if (strstr(name, "norm")) return 1.0f + (float)u * 0x1p-25f;
    return (float)u * 0x1p-23f * 0.25f;
}

int kvm_test_st_write(const char *path, const kvm_test_st_tensor *t, int n)
{
    size_t cap = 256 + (size_t)n * 256, len = 0, off = 0;
    char *h = malloc(cap);
    if (!h) return -1;
    len += (size_t)snprintf(h + len, cap - len, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        int64_t ne = 1;
        for (int d = 0; d < t[i].n_dims; d++)
            ne *= t[i].shape[d];
        size_t b = (size_t)ne * (strcmp(t[i].dtype, "BF16") == 0 ? 2 : 4);
        len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t[i].name, t[i].dtype);
        for (int d = 0; d < t[i].n_dims; d++)
            len += (size_t)snprintf(h + len, cap - len, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%zu,%zu]}", off, off + b);
        off += b;
    }
    len += (size_t)snprintf(h + len, cap - len, "}");
    while (len % 8)
        h[len++] = ' ';
    FILE *f = fopen(path, "wb");
    uint64_t l64 = len;
    int ok = f && fwrite(&l64, 8, 1, f) == 1 && fwrite(h, 1, len, f) == len;
    for (int i = 0; ok && i < n; i++) {
        int64_t ne = 1;
        for (int d = 0; d < t[i].n_dims; d++)
            ne *= t[i].shape[d];
        int bf = strcmp(t[i].dtype, "BF16") == 0;
        for (int64_t k = 0; ok && k < ne; k++) {
            uint32_t u;
            memcpy(&u, &t[i].data[k], 4);
            uint16_t hi = (uint16_t)(u >> 16);
            ok = bf ? fwrite(&hi, 2, 1, f) == 1 : fwrite(&u, 4, 1, f) == 1;
        }
    }
    if (f && fclose(f) != 0) ok = 0;
    free(h);
    return ok ? 0 : -1;
}

int kvm_test_st_write_raw(const char *path, uint64_t len_field, const char *header, size_t data_bytes)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(&len_field, 8, 1, f) == 1 && fwrite(header, 1, strlen(header), f) == strlen(header);
    for (size_t i = 0; ok && i < data_bytes; i++)
        ok = fputc(0x3f, f) != EOF;
    if (fclose(f) != 0) ok = 0;
    return ok ? 0 : -1;
}
