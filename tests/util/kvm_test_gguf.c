/* kvm_test_gguf.c: the tests' GGUF writer (kvm_test_gguf.h). */
#include "tests/util/kvm_test_gguf.h"
#include "model/kvm_gguf.h"

#include <check.h>
#include <stdlib.h>
#include <string.h>

void kvm_test_gguf_put(kvm_test_gguf_buf *w, const void *p, size_t n)
{
    if (w->n + n > w->cap) {
        w->cap = (w->n + n) * 2 + 256;
        w->b = realloc(w->b, w->cap);
        ck_assert_ptr_nonnull(w->b);
    }
    memcpy(w->b + w->n, p, n);
    w->n += n;
}

void kvm_test_gguf_u32(kvm_test_gguf_buf *w, uint32_t v) { kvm_test_gguf_put(w, &v, 4); }
void kvm_test_gguf_u64(kvm_test_gguf_buf *w, uint64_t v) { kvm_test_gguf_put(w, &v, 8); }

void kvm_test_gguf_str(kvm_test_gguf_buf *w, const char *s)
{
    kvm_test_gguf_u64(w, strlen(s));
    kvm_test_gguf_put(w, s, strlen(s));
}

void kvm_test_gguf_kv_str(kvm_test_gguf_buf *w, const char *k, const char *v)
{
    kvm_test_gguf_str(w, k);
    kvm_test_gguf_u32(w, KVM_GGUF_STRING);
    kvm_test_gguf_str(w, v);
}

void kvm_test_gguf_kv_u32(kvm_test_gguf_buf *w, const char *k, uint32_t v)
{
    kvm_test_gguf_str(w, k);
    kvm_test_gguf_u32(w, KVM_GGUF_U32);
    kvm_test_gguf_u32(w, v);
}

void kvm_test_gguf_kv_f32(kvm_test_gguf_buf *w, const char *k, float v)
{
    kvm_test_gguf_str(w, k);
    kvm_test_gguf_u32(w, KVM_GGUF_F32);
    kvm_test_gguf_put(w, &v, 4);
}

void kvm_test_gguf_pad(kvm_test_gguf_buf *w, size_t align)
{
    static const uint8_t z[64];
    while (w->n % align)
        kvm_test_gguf_put(w, z, 1);
}

size_t kvm_test_gguf_tensor_bytes(const kvm_test_gguf_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->n_dims; d++)
        n *= t->ne[d];
    return (size_t)(n / kvm_ggml_block_elems(t->type) * kvm_ggml_block_bytes(t->type));
}

kvm_test_gguf_buf kvm_test_gguf_build(const kvm_test_gguf_buf *kv, uint64_t n_kv, const kvm_test_gguf_tensor *ts,
                                      int n_t)
{
    kvm_test_gguf_buf w = {0};
    kvm_test_gguf_put(&w, "GGUF", 4);
    kvm_test_gguf_u32(&w, 3);
    kvm_test_gguf_u64(&w, (uint64_t)n_t);
    kvm_test_gguf_u64(&w, n_kv);
    if (kv->n) kvm_test_gguf_put(&w, kv->b, kv->n);
    uint64_t off = 0;
    for (int i = 0; i < n_t; i++) {
        kvm_test_gguf_str(&w, ts[i].name);
        kvm_test_gguf_u32(&w, (uint32_t)ts[i].n_dims);
        for (int d = 0; d < ts[i].n_dims; d++)
            kvm_test_gguf_u64(&w, (uint64_t)ts[i].ne[d]);
        kvm_test_gguf_u32(&w, (uint32_t)ts[i].type);
        kvm_test_gguf_u64(&w, off);
        off += (ts[i].bytes + 31) / 32 * 32;
    }
    kvm_test_gguf_pad(&w, 32);
    for (int i = 0; i < n_t; i++) {
        kvm_test_gguf_put(&w, ts[i].data, ts[i].bytes);
        if (i + 1 < n_t) kvm_test_gguf_pad(&w, 32);
    }
    return w;
}
