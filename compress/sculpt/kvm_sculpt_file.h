/* kvm_sculpt_file.h: a small versioned binary file for one compressed ragged KV cache (what
 * `kvmill sculpt --out` writes), until the pipeline stores caches in the proto/store encoding.
 *
 * Format "KVMSCULP" version 1, every field little-endian:
 *   char[8] magic "KVMSCULP" | u32 version (1) | u32 head_dim | u32 n_layers | u32 n_kv_heads
 *   u32 next_pos | u32 reserved (0)
 *   u64 n[n_layers·n_kv_heads]                        entries per (layer, KV head), layer-major
 *   per head, in the same order:
 *     f32 k[n][head_dim] | f32 v[n][head_dim] | u8 kind[n] (0 = token, 1 = distilled)
 *     u32 pos[n] (token position; 0 for distilled) | f32 bias[n] (logit bias, nats)
 *   u64 FNV-1a-64 of every preceding byte
 * Distilled entries come first, then tokens in increasing position, all < next_pos. */
#ifndef KVM_SCULPT_FILE_H
#define KVM_SCULPT_FILE_H

#include "model/kvm_kvcache.h"

#include <stdio.h>

#define KVM_SCULPT_FILE_VERSION 1u

/* Writes cache c to path (created or truncated; kvm_file_open_output). Returns 0, KVM_EINVAL (c
 * breaks the entry order, a position is negative other than KVM_POS_NONE; or path is a FIFO no
 * process is reading, refused rather than waited for), KVM_EIO (message names the path). */
int kvm_sculpt_cache_write(const char *path, const kvm_kvcache *c);

/* The same file written to an open stream f (borrowed, not closed; flushed at the end), so the
 * caller decides where the bytes go and what a failure leaves (kvmill sculpt --out writes
 * OUT.part and renames it). path: how messages name the output. Returns 0, KVM_EINVAL (c breaks
 * the entry order; nothing written), KVM_ENOMEM, KVM_ENOTSUP (an f16 cache, big-endian host),
 * KVM_EIO ("PATH: write failed: REASON"; f then holds part of the file). */
int kvm_sculpt_cache_fwrite(FILE *f, const char *path, const kvm_kvcache *c);

/* Reads and validates a file written by kvm_sculpt_cache_write: magic, version, shapes (each in
 * [1, 65536]), exact file size, entry kinds, order and positions, finite floats, checksum. On
 * success *out is a new cache owned by the caller (kvm_kvcache_free). Errors: KVM_ENOTFOUND,
 * KVM_EIO, KVM_EFORMAT (magic, version, shape, size), KVM_ECORRUPT (checksum, order, non-finite
 * float), KVM_ENOMEM; the message names the file and the field. On error *out = NULL. */
int kvm_sculpt_cache_read(const char *path, kvm_kvcache **out);

/* The same for a file's bytes p[0, n) (copied into *out); `path` labels the messages. Errors as
 * kvm_sculpt_cache_read's but KVM_ENOTFOUND and KVM_EIO. */
int kvm_sculpt_cache_decode(const char *path, const uint8_t *p, size_t n, kvm_kvcache **out);

#endif
