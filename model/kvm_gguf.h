/* kvm_gguf.h: a strict reader of GGUF v2/v3 files (ggml's model container: metadata
 * key/values, tensor infos, aligned tensor data) over a caller's read-only mapping, and the
 * dequantisers of the ggml block types kvmill loads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
 * Q5_1, Q4_K, Q6_K). Spec: ggml/docs/gguf.md; block layouts: ggml/src/ggml-common.h. */
#ifndef KVM_GGUF_H
#define KVM_GGUF_H

#include "kernels/kvm_quant_body.h"

#include <stddef.h>
#include <stdint.h>

/* Metadata value types, numbered as the GGUF spec does. */
typedef enum kvm_gguf_vtype {
    KVM_GGUF_U8 = 0,
    KVM_GGUF_I8 = 1,
    KVM_GGUF_U16 = 2,
    KVM_GGUF_I16 = 3,
    KVM_GGUF_U32 = 4,
    KVM_GGUF_I32 = 5,
    KVM_GGUF_F32 = 6,
    KVM_GGUF_BOOL = 7,
    KVM_GGUF_STRING = 8,
    KVM_GGUF_ARRAY = 9,
    KVM_GGUF_U64 = 10,
    KVM_GGUF_I64 = 11,
    KVM_GGUF_F64 = 12,
} kvm_gguf_vtype;

/* Tensor types, numbered as ggml's enum ggml_type does (the dequantisation bodies'
 * numbers, kernels/kvm_quant_body.h). */
typedef enum kvm_ggml_type {
    KVM_GGML_F32 = KVM_QB_F32,
    KVM_GGML_F16 = KVM_QB_F16,
    KVM_GGML_Q4_0 = KVM_QB_Q4_0,
    KVM_GGML_Q4_1 = KVM_QB_Q4_1,
    KVM_GGML_Q5_0 = KVM_QB_Q5_0,
    KVM_GGML_Q5_1 = KVM_QB_Q5_1,
    KVM_GGML_Q8_0 = KVM_QB_Q8_0,
    KVM_GGML_Q4_K = KVM_QB_Q4_K,
    KVM_GGML_Q6_K = KVM_QB_Q6_K,
    KVM_GGML_BF16 = KVM_QB_BF16,
} kvm_ggml_type;

/* A bounded string inside the mapping (not NUL-terminated). */
typedef struct kvm_gguf_str {
    const char *ptr; /* first byte, inside the mapping */
    uint64_t len;    /* bytes */
} kvm_gguf_str;

/* One metadata key/value. Scalars are decoded; arrays and strings point into the mapping. */
typedef struct kvm_gguf_kv {
    kvm_gguf_str key;     /* key, e.g. "llama.block_count" */
    kvm_gguf_vtype type;  /* value type */
    kvm_gguf_vtype etype; /* element type when type == ARRAY */
    uint64_t n;           /* element count when type == ARRAY */
    const uint8_t *data;  /* value bytes (ARRAY: first element; STRING: the length field) */
    union {
        uint64_t u;     /* unsigned integers and BOOL */
        int64_t i;      /* signed integers */
        double f;       /* F32 and F64 */
        kvm_gguf_str s; /* STRING */
    } v;                /* decoded scalar */
} kvm_gguf_kv;

/* One tensor info, validated against the file. */
typedef struct kvm_gguf_tensor {
    kvm_gguf_str name;   /* e.g. "blk.0.attn_q.weight" */
    int n_dims;          /* 1..4 */
    int64_t ne[4];       /* elements per dimension, ne[0] innermost (a row); unused = 1 */
    kvm_ggml_type type;  /* block type */
    uint64_t offset;     /* from the start of the data section, bytes (aligned) */
    uint64_t bytes;      /* size of its data, bytes */
    const uint8_t *data; /* first byte of its data, inside the mapping */
} kvm_gguf_tensor;

/* A parsed file: borrows the mapping it was parsed from. */
typedef struct kvm_gguf kvm_gguf;

/* Parses and validates a GGUF file mapped at map[0, bytes); `name` (the path) only labels
 * error messages. Checks: magic "GGUF"; version 2 or 3; counts, string lengths and array
 * sizes bounded by the bytes left in the file; array nesting ≤ 8; known value types;
 * general.alignment (if present) a u32 power of two; each tensor: name unique, 1 ≤ n_dims
 * ≤ 4, dims ≥ 1 with a product below 2^48, a known type, ne[0] a multiple of its block
 * size, offset a multiple of the alignment, data inside the file; no two tensors overlap, and
 * no gap of the alignment or more lies before the first tensor, between two (in offset order) or
 * after the last (a tensor whose declared type or shape is smaller than its data).
 * The handle borrows map: keep it mapped until kvm_gguf_free. *out is a new handle.
 * Errors (kvm_errmsg() names the file, the item and the offset): KVM_EFORMAT (every check
 * above: bad magic, truncated, out-of-file, misaligned, overlapping, a hole, bad dims),
 * KVM_ENOTSUP (GGUF version other than 2/3, a big-endian file, a tensor type
 * kvmill cannot dequantise), KVM_ENOMEM. */
int kvm_gguf_parse(const char *name, const uint8_t *map, size_t bytes, kvm_gguf **out);

/* Frees the handle (not the mapping). Accepts NULL and *g == NULL; sets *g = NULL. */
void kvm_gguf_free(kvm_gguf **g);

/* The file's version (2 or 3), its key/values and tensors, in file order. Pointers are
 * valid until kvm_gguf_free. */
uint32_t kvm_gguf_version(const kvm_gguf *g);
int64_t kvm_gguf_n_kv(const kvm_gguf *g);
const kvm_gguf_kv *kvm_gguf_kv_at(const kvm_gguf *g, int64_t i);
int64_t kvm_gguf_n_tensors(const kvm_gguf *g);
const kvm_gguf_tensor *kvm_gguf_tensor_at(const kvm_gguf *g, int64_t i);

/* The key/value or tensor with that exact name, or NULL. */
const kvm_gguf_kv *kvm_gguf_find(const kvm_gguf *g, const char *key);
const kvm_gguf_tensor *kvm_gguf_find_tensor(const kvm_gguf *g, const char *name);

/* Typed metadata getters. Each returns 0 and writes *v; KVM_ENOTFOUND when the key is
 * absent (*v untouched, so preset a default); KVM_EFORMAT when it has another type or (for
 * integers) a value outside the target's range. Integers accept any integer type; floats
 * accept F32/F64; strings are borrowed from the mapping. */
int kvm_gguf_get_i64(const kvm_gguf *g, const char *key, int64_t *v);
int kvm_gguf_get_f64(const kvm_gguf *g, const char *key, double *v);
int kvm_gguf_get_bool(const kvm_gguf *g, const char *key, int *v);
int kvm_gguf_get_str(const kvm_gguf *g, const char *key, kvm_gguf_str *v);
/* An array with elements of type etype: *n elements starting at *data. */
int kvm_gguf_get_arr(const kvm_gguf *g, const char *key, kvm_gguf_vtype etype, uint64_t *n, const uint8_t **data);

/* The file's name as given to parse (for messages). */
const char *kvm_gguf_name(const kvm_gguf *g);

/* Elements per block and bytes per block of a tensor type; 0 for a type kvmill cannot
 * dequantise. */
int64_t kvm_ggml_block_elems(int type);
int64_t kvm_ggml_block_bytes(int type);
/* "F32", "Q4_1", ...; "?" when unknown. */
const char *kvm_ggml_type_name(int type);

/* Dequantises n elements (a multiple of the block size) of blocks of `type` at src into
 * dst[n] float32, as ggml's dequantize_row_* does (same block layout, same arithmetic).
 * Returns 0, KVM_ENOTSUP (unknown type), KVM_EINVAL (n not a multiple of the block). */
int kvm_ggml_dequantize(int type, const void *src, float *dst, int64_t n);

/* IEEE half and bfloat16 to float32 (exact). */
float kvm_fp16_to_f32(uint16_t h);
float kvm_bf16_to_f32(uint16_t h);

/* Internal (model/): fills m from a GGUF file mapped at map[0, bytes) (kvm_model_open's
 * GGUF branch): Llama architecture from metadata, weights dequantised into m->owned. */
struct kvm_model;
int kvm__gguf_load(struct kvm_model *m, const uint8_t *map, size_t bytes);

#endif
