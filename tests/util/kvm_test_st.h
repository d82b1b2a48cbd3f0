/* kvm_test_st.h: test helpers that write safetensors files (well-formed from a tensor list, or
 * raw header text for malformed cases) and the deterministic weights the tiny Hugging Face
 * folders hold (the same generator as scripts/hf_tiny_reference.py). */
#ifndef KVM_TEST_ST_H
#define KVM_TEST_ST_H

#include <stddef.h>
#include <stdint.h>

/* One tensor to write: float32 values converted to dtype ("F32", "F16" unsupported here,
 * "BF16" by truncation). shape row-major, n_dims entries. */
typedef struct kvm_test_st_tensor {
    char name[128];
    const char *dtype;
    int n_dims;
    int64_t shape[4];
    const float *data; /* product(shape) values */
} kvm_test_st_tensor;

/* Writes a safetensors file of the n tensors in order (offsets back to back, header padded
 * with spaces to a multiple of 8 as the Rust writer does). Returns 0, or -1 on I/O error. */
int kvm_test_st_write(const char *path, const kvm_test_st_tensor *t, int n);

/* Writes 8-byte header length `len_field`, then header[0, strlen), then data_bytes bytes of
 * 0x3f (data). For malformed files. Returns 0 or -1. */
int kvm_test_st_write_raw(const char *path, uint64_t len_field, const char *header, size_t data_bytes);

/* The value of element i of the tensor named `name` of a tiny test model, float32:
 * u = top 24 bits of splitmix64(fnv1a64(name) + i); norm weights ("norm" in the name):
 * 1 + (u - 2^23) * 2^-25, other tensors: (u - 2^23) * 2^-23 * 0.25. Exact in float32. */
float kvm_test_tiny_weight(const char *name, int64_t i);

/* The float32 value x truncated to bfloat16 and widened back. */
float kvm_test_bf16_trunc(float x);

#endif
