/* kvm_safetensors.h: a strict reader of Hugging Face safetensors files (an 8-byte
 * little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the
 * tensor bytes), one file or the shards named by model.safetensors.index.json, each mapped
 * read-only. Spec: huggingface/safetensors README ("Format"). JSON via libjansson. */
#ifndef KVM_SAFETENSORS_H
#define KVM_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define KVM_ST_MAX_DIMS 4
#define KVM_ST_MAX_FILES 4096 /* files in one set (shards of an index) */

/* Element types kvmill loads (others are refused by name). */
typedef enum kvm_st_dtype {
    KVM_ST_F32 = 0,  /* IEEE binary32 */
    KVM_ST_F16 = 1,  /* IEEE binary16 */
    KVM_ST_BF16 = 2, /* bfloat16 (the top half of a binary32) */
} kvm_st_dtype;

/* One tensor, validated against its file. */
typedef struct kvm_st_tensor {
    const char *name;               /* e.g. "model.layers.0.self_attn.q_proj.weight", owned by the set */
    kvm_st_dtype dtype;             /* element type */
    int n_dims;                     /* 0..KVM_ST_MAX_DIMS (0: a scalar) */
    int64_t shape[KVM_ST_MAX_DIMS]; /* row-major, shape[n_dims - 1] innermost; unused = 1 */
    int64_t n_elems;                /* product of shape */
    const uint8_t *data;            /* first byte, inside the file's mapping (any alignment) */
    uint64_t bytes;                 /* n_elems * element size */
    int file;                       /* index of the file that holds it (kvm_st_file_path) */
} kvm_st_tensor;

/* A set of safetensors files, parsed: owns the mappings. */
typedef struct kvm_st kvm_st;

/* Opens the weights of a Hugging Face folder: dir/model.safetensors.index.json when present
 * (its "weight_map" {tensor: file}; the files are taken in sorted name order, which is shard
 * order for model-0000K-of-0000N names), else dir/model.safetensors; a folder with both is
 * refused (transformers loads model.safetensors, so one of them is stale). Each file is mapped and
 * parsed as kvm_st_open_files does; with an index, every tensor the index lists must be in the
 * file it names and every tensor of a file must be listed, and file names may not contain '/'
 * or be "." or "..". Symbolic links are followed (the Hugging Face cache links to its blobs).
 * Errors (message names the file, and the tensor or key): KVM_ENOTFOUND (no weights, a file
 * the index names is absent), KVM_EFORMAT (malformed index, more than KVM_ST_MAX_FILES files,
 * a tensor in the wrong file or unlisted, both an index and model.safetensors; the index or model.safetensors a broken
 * symbolic link, a link loop, or not a regular file), plus those of kvm_st_open_files. *out is a new set
 * (kvm_st_close). */
int kvm_st_open_dir(const char *dir, kvm_st **out);

/* Opens and parses n files (paths copied). Per file, checks: at least 8 bytes; header length
 * N with 2 <= N <= min(file bytes - 8, 100 MiB); the header a JSON object (duplicate keys
 * refused) whose members other than "__metadata__" (an object of strings) are tensors
 * {"dtype": string, "shape": [ints >= 0, at most 4], "data_offsets": [begin, end]} with
 * begin <= end within the data section (the bytes after the header), end - begin equal to the
 * element count times the dtype size, tensors not overlapping and covering the data section
 * without holes; names unique across all files. Errors: KVM_ENOTFOUND / KVM_EIO (a file),
 * KVM_EFORMAT (a file that kvm_file_check_found refuses; every check above, naming the file and the
 * tensor), KVM_ENOTSUP (a dtype other than F32, F16, BF16: named), KVM_ENOMEM. */
int kvm_st_open_files(const char *const *paths, int n, kvm_st **out);

/* Parses one safetensors file held in memory at buf[0, bytes) (a file read by other means, a
 * fuzzer's input), with the checks of kvm_st_open_files; `name` labels the messages and is
 * kvm_st_file_path(s, 0). The set borrows buf: keep it until kvm_st_close, which does not free
 * it (and kvm_st_release leaves it alone). Errors as kvm_st_open_files's but KVM_ENOTFOUND and
 * KVM_EIO. *out is a new set (kvm_st_close). */
int kvm_st_open_mem(const char *name, const uint8_t *buf, size_t bytes, kvm_st **out);

/* Unmaps and frees. Accepts NULL and *s == NULL; sets *s = NULL. */
void kvm_st_close(kvm_st **s);

/* Tensors of every file, file by file in header order (sorted by data offset). Valid until
 * kvm_st_close. */
int64_t kvm_st_n_tensors(const kvm_st *s);
const kvm_st_tensor *kvm_st_tensor_at(const kvm_st *s, int64_t i);

/* The tensor with that exact name, or NULL. */
const kvm_st_tensor *kvm_st_find(const kvm_st *s, const char *name);

/* Number of files and the path of file i (as opened), valid until kvm_st_close. */
int kvm_st_n_files(const kvm_st *s);
const char *kvm_st_file_path(const kvm_st *s, int i);

/* Releases the pages of file i's mapping that hold tensor t (MADV_DONTNEED; the mapping
 * stays valid and refaults on a later read). For loaders that have copied t out. Does nothing
 * to kvm_st_open_mem's memory. */
void kvm_st_release(const kvm_st *s, const kvm_st_tensor *t);

/* "F32", "F16", "BF16". */
const char *kvm_st_dtype_name(kvm_st_dtype t);

/* Bytes per element of t: 4 or 2. */
int kvm_st_dtype_size(kvm_st_dtype t);

/* Converts n elements of tensor data (src, any alignment, little-endian) of type t into
 * dst[n] float32 (exact for all three types). */
void kvm_st_to_f32(kvm_st_dtype t, const uint8_t *src, float *dst, int64_t n);

#endif
