/* kvm_quant_body.h: the dequantisation of the ggml block types kvmill loads (F32, F16, BF16,
 * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K; layouts: ggml/src/ggml-common.h, arithmetic:
 * ggml-quants.c dequantize_row_*), written once as inline functions of one element: the CPU
 * loader (model/kvm_gguf.c kvm_ggml_dequantize, hence kvm_model_mat_rows, the CPU weight
 * preparation and the embedding lookup) loops over them, and the CUDA upload
 * (kernels/cuda/kvm_cuda_quant.cu) runs one per thread on the raw blocks copied to the device,
 * so the CPU tests check what the GPU computes (kernels/LAYOUT.md). Type numbers are ggml's
 * enum ggml_type. Pure functions; bytes are little-endian and may be unaligned. */
#ifndef KVM_QUANT_BODY_H
#define KVM_QUANT_BODY_H

#include <stdint.h>

#include "kernels/kvm_hd.h"

/* ggml's type numbers of the types below (model/kvm_gguf.h names them kvm_ggml_type). */
enum kvm_qb_type {
    KVM_QB_F32 = 0,
    KVM_QB_F16 = 1,
    KVM_QB_Q4_0 = 2,
    KVM_QB_Q4_1 = 3,
    KVM_QB_Q5_0 = 6,
    KVM_QB_Q5_1 = 7,
    KVM_QB_Q8_0 = 8,
    KVM_QB_Q4_K = 12,
    KVM_QB_Q6_K = 14,
    KVM_QB_BF16 = 30,
};

/* Elements and bytes per block of a type; 0 for a type not listed above. */
static inline KVM_HD int64_t kvm_qb_block_elems(int type)
{
    switch (type) {
    case KVM_QB_F32: case KVM_QB_F16: case KVM_QB_BF16: return 1;
    case KVM_QB_Q4_0: case KVM_QB_Q4_1: case KVM_QB_Q5_0: case KVM_QB_Q5_1: case KVM_QB_Q8_0: return 32;
    case KVM_QB_Q4_K: case KVM_QB_Q6_K: return 256;
    default: return 0;
    }
}

static inline KVM_HD int64_t kvm_qb_block_bytes(int type)
{
    switch (type) {
    case KVM_QB_F32: return 4;
    case KVM_QB_F16: case KVM_QB_BF16: return 2;
    case KVM_QB_Q4_0: return 18;
    case KVM_QB_Q4_1: return 20;
    case KVM_QB_Q5_0: return 22;
    case KVM_QB_Q5_1: return 24;
    case KVM_QB_Q8_0: return 34;
    case KVM_QB_Q4_K: return 144;
    case KVM_QB_Q6_K: return 210;
    default: return 0;
    }
}

/* Bytes of one row of `in` elements (in a multiple of the block; 0 for an unknown type). */
static inline KVM_HD int64_t kvm_qb_row_bytes(int type, int64_t in)
{
    int64_t be = kvm_qb_block_elems(type);
    return be ? in / be * kvm_qb_block_bytes(type) : 0;
}

static inline KVM_HD uint32_t kvm_qb_le16(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static inline KVM_HD uint32_t kvm_qb_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline KVM_HD float kvm_qb_bits_f32(uint32_t u)
{
    union { uint32_t i; float f; } c;
    c.i = u;
    return c.f;
}

/* IEEE binary16 and bfloat16 bits to float32 (exact; subnormal halves normalised). */
static inline KVM_HD float kvm_qb_fp16(uint32_t h)
{
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f)
        u = sign | 0x7f800000u | man << 13; /* inf, NaN */
    else if (exp)
        u = sign | (exp + 112) << 23 | man << 13;
    else if (!man)
        u = sign;
    else { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        u = sign | (uint32_t)(112 - e) << 23 | (man & 0x3ffu) << 13;
    }
    return kvm_qb_bits_f32(u);
}

static inline KVM_HD float kvm_qb_bf16(uint32_t h) { return kvm_qb_bits_f32(h << 16); }

/* a·b and a·b + c, each operation rounded on its own: nvcc would contract a·b + c into one fused
 * multiply-add (one rounding), which the CPU build (x86-64 baseline, no FMA) does not, and the
 * two must give the same floats. */
static inline KVM_HD float kvm_qb_mul(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

static inline KVM_HD float kvm_qb_mad(float a, float b, float c)
{
#ifdef __CUDA_ARCH__
    return __fadd_rn(__fmul_rn(a, b), c);
#else
    return a * b + c;
#endif
}

/* Q4_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline KVM_HD void kvm_qb_scale_min_k4(int j, const uint8_t *q, uint32_t *d, uint32_t *m)
{
    if (j < 4) {
        *d = q[j] & 63u;
        *m = q[j + 4] & 63u;
    } else {
        *d = (q[j + 4] & 0xFu) | ((uint32_t)(q[j - 4] >> 6) << 4);
        *m = (uint32_t)(q[j + 4] >> 4) | ((uint32_t)(q[j - 0] >> 6) << 4);
    }
}

/* The scales of a group of 16 elements (the smallest unit sharing scales in every type):
 * d and m of the value d·q + m (Q4_0, Q5_0, Q8_0, Q6_K: m = 0; Q4_K: d·sc and −dmin·min of
 * the group's sub-block, ggml's d1 and −m1; Q6_K: d·sc of the group's 16). The CPU loop decodes
 * them once per group, the device once per element. */
typedef struct kvm_qb_scales {
    float d, m;
} kvm_qb_scales;

static inline KVM_HD kvm_qb_scales kvm_qb_group_scales(int type, const uint8_t *b, int g)
{
    kvm_qb_scales s = {0.0f, 0.0f};
    switch (type) {
    case KVM_QB_Q8_0: case KVM_QB_Q4_0: case KVM_QB_Q5_0: s.d = kvm_qb_fp16(kvm_qb_le16(b)); break;
    case KVM_QB_Q4_1: case KVM_QB_Q5_1:
        s.d = kvm_qb_fp16(kvm_qb_le16(b));
        s.m = kvm_qb_fp16(kvm_qb_le16(b + 2));
        break;
    case KVM_QB_Q4_K: { /* sub-block 2c + hi of 32 elements: chunk c = g / 4, hi = (g / 2) & 1 */
        uint32_t sc, m;
        kvm_qb_scale_min_k4(2 * (g / 4) + ((g / 2) & 1), b + 4, &sc, &m);
        s.d = kvm_qb_mul(kvm_qb_fp16(kvm_qb_le16(b)), (float)sc);
        s.m = -kvm_qb_mul(kvm_qb_fp16(kvm_qb_le16(b + 2)), (float)m);
        break;
    }
    case KVM_QB_Q6_K: { /* half n = g / 8, quarter k = (g / 2) & 3, l / 16 = g & 1 */
        const int8_t *sc = (const int8_t *)(b + 192 + 8 * (g / 8));
        s.d = kvm_qb_mul(kvm_qb_fp16(kvm_qb_le16(b + 208)), (float)sc[(g & 1) + 2 * ((g / 2) & 3)]);
        break;
    }
    default: break;
    }
    return s;
}

/* Element j = 16·g + l (l ∈ [0, 16); the 1-element types: g = l = 0) of the block at b of a type
 * listed above (0 for another type), given the scales s of its group g: ggml's
 * dequantize_row_* value, same operations in the same order. Indexed by (group, lane) so that
 * in the CPU's loop over l everything but the lane is loop-invariant. */
static inline KVM_HD float kvm_qb_elem_s(int type, const uint8_t *b, kvm_qb_scales s, int g, int l)
{
    switch (type) {
    case KVM_QB_F32:
        return kvm_qb_bits_f32(kvm_qb_le32(b));
    case KVM_QB_F16:
        return kvm_qb_fp16(kvm_qb_le16(b));
    case KVM_QB_BF16:
        return kvm_qb_bf16(kvm_qb_le16(b));
    case KVM_QB_Q8_0:
        return kvm_qb_mul((float)(int8_t)b[2 + 16 * g + l], s.d);
    case KVM_QB_Q4_0: /* group 0: the low nibbles of the 16 bytes, group 1: the high ones */
        return kvm_qb_mul((float)((g ? b[2 + l] >> 4 : b[2 + l] & 0x0F) - 8), s.d);
    case KVM_QB_Q4_1:
        return kvm_qb_mad((float)(g ? b[4 + l] >> 4 : b[4 + l] & 0x0F), s.d, s.m);
    case KVM_QB_Q5_0:
    case KVM_QB_Q5_1: {
        const int has_m = type == KVM_QB_Q5_1;
        const uint32_t qh = kvm_qb_le32(b + (has_m ? 4 : 2));
        const uint8_t *qs = b + (has_m ? 8 : 6);
        /* the fifth bit: qh bit l for the low nibbles, bit l + 16 for the high ones */
        const int q = g ? ((qs[l] >> 4) | (int)((qh >> (l + 12)) & 0x10))
                        : ((qs[l] & 0x0F) | (int)(((qh >> (l + 0)) << 4) & 0x10));
        return has_m ? kvm_qb_mad((float)q, s.d, s.m) : kvm_qb_mul((float)(q - 16), s.d);
    }
    case KVM_QB_Q4_K: {
        /* 4 chunks c of 64: sub-block 2c (low nibbles of q[32c, 32c + 32)), then 2c + 1 (high);
         * group g is chunk g / 4, half (g / 2) & 1, bytes from 16·(g & 1); ggml's d1·q − m1 is
         * d1·q + (−m1) exactly */
        const uint8_t qb = b[16 + 32 * (g / 4) + 16 * (g & 1) + l];
        return kvm_qb_mad(s.d, (float)((g / 2) & 1 ? qb >> 4 : qb & 0xF), s.m);
    }
    case KVM_QB_Q6_K: {
        /* 2 halves n of 128, each 4 quarters k of 32 sharing ql[64], qh[32]: group g is half g / 8,
         * quarter (g / 2) & 3, lanes from 16·(g & 1) */
        const int n = g / 8, k = (g / 2) & 3, i = 16 * (g & 1) + l;
        const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        const int lo = (k & 1) ? ql[i + 32] : ql[i];
        const int q = (int)(int8_t)((k < 2 ? lo & 0xF : lo >> 4) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32;
        return kvm_qb_mul(s.d, (float)q);
    }
    default:
        return 0.0f;
    }
}

/* Element j of the block at b, its group's scales decoded here (the device's one element per
 * thread). */
static inline KVM_HD float kvm_qb_elem(int type, const uint8_t *b, int j)
{
    return kvm_qb_elem_s(type, b, kvm_qb_group_scales(type, b, j / 16), j / 16, j % 16);
}

/* Element `col` of a row of `in`-element rows stored at row (raw bytes, kvm_qb_row_bytes):
 * the CUDA upload's per-thread call. */
static inline KVM_HD float kvm_qb_row_elem(int type, const uint8_t *row, int64_t col)
{
    const int64_t be = kvm_qb_block_elems(type);
    return kvm_qb_elem(type, row + col / be * kvm_qb_block_bytes(type), (int)(col % be));
}

#endif
