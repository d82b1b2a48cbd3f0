/* kvm_cpu_gemm.h: the CPU backend's own GEMM on pre-packed right-hand sides. Weights are
 * packed once at load into panels of KVM_GEMM_NR output columns laid out [panel][in][NR],
 * so the inner kernel streams one contiguous panel and keeps an MR x NR tile of Y in
 * registers. The same kernel serves attention (K and V packed per head). Internal. */
#ifndef KVM_CPU_GEMM_H
#define KVM_CPU_GEMM_H

#include <stddef.h>
#include <stdint.h>

#define KVM_GEMM_NR 16 /* output columns per panel: one 512-bit vector */
#define KVM_GEMM_MR 8  /* rows of X per register tile */

/* Element types of packed panels (kvm_kernels.h kvm_weight_dtype: 0 f32, 1 bf16, 2 f16). */
#define KVM_GEMM_F32 0
#define KVM_GEMM_BF16 1
#define KVM_GEMM_F16 2

/* A packed right-hand side: the product Y = X · Wᵀ for W [out][in]. */
typedef struct kvm_cpu_packed {
    int64_t out;    /* columns of Y */
    int64_t in;     /* the shared dimension */
    int64_t cap;    /* floats allocated in p */
    float *p;       /* [ceil(out/NR)][in][NR], zero padded, 64-byte aligned, owned (f32 panels) */
    uint16_t *h;    /* the same layout in 16-bit (bf16 or f16 panels; then p is NULL), owned */
    int dtype;      /* KVM_GEMM_F32, _BF16 or _F16 */
} kvm_cpu_packed;

/* Packs a matrix given as element (o, i) = src[o * s_out + i * s_in] for o < out, i < in:
 * W [out][in] row-major is (s_out = in, s_in = 1); V [in][out] is (s_out = 1, s_in = out).
 * Reuses dst->p when large enough. Returns 0 or KVM_ENOMEM. */
int kvm__cpu_pack(kvm_cpu_packed *dst, const float *src, int64_t out, int64_t in, int64_t s_out, int64_t s_in);

/* kvm__cpu_pack for a matrix held in f16 (IEEE binary16 bits, the f16 KV cache), widened
 * exactly into float32 panels as it is packed: the attention GEMMs then run the float32 path on
 * the widened values (once per call and KV head, instead of once per 64-query tile as 16-bit
 * panels would be). Reuses dst->p when large enough. Returns 0 or KVM_ENOMEM. */
int kvm__cpu_pack_f16(kvm_cpu_packed *dst, const uint16_t *src, int64_t out, int64_t in, int64_t s_out, int64_t s_in);

/* Packs W [out][in] in 16-bit panels (dtype KVM_GEMM_BF16 or KVM_GEMM_F16, rounded to nearest
 * even), reading it NR rows at a time through rows(ctx, r0, n, buf) which fills buf [n][in]
 * float32, so no float32 copy of the whole matrix exists. dtype KVM_GEMM_F32 packs float32
 * panels the same way. dst must be zeroed. Returns 0, KVM_ENOMEM, KVM_ERANGE (a finite value
 * beyond f16's ±65504: message gives the row and column), or the error rows returned. */
int kvm__cpu_pack_rows(kvm_cpu_packed *dst, int (*rows)(void *ctx, int64_t r0, int64_t n, float *buf), void *ctx,
                       int64_t out, int64_t in, int dtype);

/* Frees dst->p (dst itself is the caller's). */
void kvm__cpu_packed_free(kvm_cpu_packed *dst);

/* Y[r][c] = alpha * Σ_i X[r][i] · W[c][i] for r < m, c in [col0, col1) (col0 a multiple
 * of NR), i < k_len (≤ in: a prefix of the shared dimension, for causal attention). X [m][in] has row stride ldx, Y row stride ldy. Columns of Y
 * outside [col0, col1) are untouched (so threads can split columns). 16-bit panels are widened
 * to float32 inside the kernel (KC rows of a panel at a time into a stack buffer for row tiles,
 * on the fly for a single row), with the float32 path's sums in the same order, so a bf16/f16
 * panel gives bit for bit the result of float32 panels holding the same (widened) values. */
void kvm__cpu_gemm_packed(const float *x, int64_t m, int64_t ldx, const kvm_cpu_packed *w, float *y, int64_t ldy,
                          float alpha, int64_t col0, int64_t col1, int64_t k_len);

#endif
