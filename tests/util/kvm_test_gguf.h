/* kvm_test_gguf.h: a GGUF writer for tests (version 3, little-endian, 32-byte aligned data):
 * metadata entries encoded into a buffer, then the header, tensor infos and tensor bytes, so
 * tests can write well-formed files of any tensor type and then break them. */
#ifndef KVM_TEST_GGUF_H
#define KVM_TEST_GGUF_H

#include <stddef.h>
#include <stdint.h>

/* A growing byte buffer (b malloc'ed, owned by the caller: free(b)). */
typedef struct kvm_test_gguf_buf {
    uint8_t *b;
    size_t n, cap;
} kvm_test_gguf_buf;

/* A tensor to write: name, shape (ne[0] = row length), ggml type, raw data of `bytes`. */
typedef struct kvm_test_gguf_tensor {
    char name[64];
    int n_dims;
    int64_t ne[4];
    int type;
    const void *data;
    size_t bytes;
} kvm_test_gguf_tensor;

/* Appends raw bytes / a u32 / a u64 / a GGUF string (u64 length, bytes). */
void kvm_test_gguf_put(kvm_test_gguf_buf *w, const void *p, size_t n);
void kvm_test_gguf_u32(kvm_test_gguf_buf *w, uint32_t v);
void kvm_test_gguf_u64(kvm_test_gguf_buf *w, uint64_t v);
void kvm_test_gguf_str(kvm_test_gguf_buf *w, const char *s);

/* Appends one metadata entry (key, type, value) of type string, u32 or f32. */
void kvm_test_gguf_kv_str(kvm_test_gguf_buf *w, const char *k, const char *v);
void kvm_test_gguf_kv_u32(kvm_test_gguf_buf *w, const char *k, uint32_t v);
void kvm_test_gguf_kv_f32(kvm_test_gguf_buf *w, const char *k, float v);

/* Zero bytes up to a multiple of align. */
void kvm_test_gguf_pad(kvm_test_gguf_buf *w, size_t align);

/* Bytes of a tensor of t->ne / t->type. */
size_t kvm_test_gguf_tensor_bytes(const kvm_test_gguf_tensor *t);

/* Header, metadata (already encoded in kv, n_kv entries), tensor infos, data at 32-byte
 * alignment, no trailing padding. */
kvm_test_gguf_buf kvm_test_gguf_build(const kvm_test_gguf_buf *kv, uint64_t n_kv, const kvm_test_gguf_tensor *ts,
                                      int n_t);

#endif
