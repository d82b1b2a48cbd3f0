/* kvm_cpu_gemm.c: packed-panel GEMM with an 8 x 16 register tile, written with GCC vector
 * extensions and compiled for AVX-512, AVX2 and baseline x86-64 (target_clones). OpenBLAS
 * stays the reference sgemm; this kernel exists because the model's shapes are known at
 * load time, so weights can be packed once and small-K products (head size 8) stay fast.
 * Weights may be packed in 16 bits (bf16 or f16) and are widened to float32 per panel here:
 * bf16 → f32 is a 16-bit shift, f16 → f32 integer ops in the clones (kvm_cpu_half.h) and one
 * vcvtph2ps (AVX-512) where the processor runs x86-64-v4 code (kvm__cpu_v4's switch), two
 * F16C ones where it runs x86-64-v3 only (kvm__cpu_v3's). */
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_clones.h"
#include "kernels/cpu/kvm_cpu_half.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

enum { KVM_GEMM_MC = 128 }; /* rows of X per cache block */
enum { KVM_GEMM_KC = 256 }; /* rows of a 16-bit panel widened at once (16 KiB of float32) */

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One NR-wide panel row of 16-bit values as float32. */
static inline __attribute__((always_inline)) v16 widen(const uint16_t *src, int dtype)
{
    v16 f;
    if (dtype == KVM_GEMM_BF16) {
        u16x16 h;
        memcpy(&h, src, sizeof h);
        u32x16 w = __builtin_convertvector(h, u32x16) << 16;
        memcpy(&f, &w, sizeof f);
    } else
        f = kvm__f16_widen16(src);
    return f;
}

/* Room for the float32 panels of an out x in matrix in dst->p (reused when large enough). */
static int pack_room(kvm_cpu_packed *dst, int64_t out, int64_t in)
{
    const int64_t NR = KVM_GEMM_NR, panels = (out + NR - 1) / NR, need = panels * in * NR;
    if (need > dst->cap) {
        free(dst->p);
        size_t bytes = ((size_t)(need > 0 ? need : 1) * sizeof(float) + 63) & ~(size_t)63;
        dst->p = aligned_alloc(64, bytes);
        dst->cap = dst->p ? need : 0;
        if (!dst->p) return kvm_err(KVM_ENOMEM, "gemm: out of memory packing %lld x %lld", (long long)out, (long long)in);
    }
    dst->out = out;
    dst->in = in;
    return 0;
}

int kvm__cpu_pack(kvm_cpu_packed *dst, const float *src, int64_t out, int64_t in, int64_t s_out, int64_t s_in)
{
    const int64_t NR = KVM_GEMM_NR, panels = (out + NR - 1) / NR;
    int rc = pack_room(dst, out, in);
    if (rc) return rc;
    for (int64_t p = 0; p < panels; p++) {
        float *pp = dst->p + p * in * NR;
        int64_t o0 = p * NR, nr = out - o0 < NR ? out - o0 : NR;
        for (int64_t i = 0; i < in; i++) {
            float *row = pp + i * NR;
            for (int64_t j = 0; j < nr; j++) row[j] = src[(o0 + j) * s_out + i * s_in];
            for (int64_t j = nr; j < NR; j++) row[j] = 0.0f;
        }
    }
    return 0;
}

/* The panels of kvm__cpu_pack_f16, widened element by element (cloned: F16C where present). */
KVM_CLONES
static void pack_widen(float *dst, const uint16_t *src, int64_t out, int64_t in, int64_t s_out, int64_t s_in)
{
    const int64_t NR = KVM_GEMM_NR, panels = (out + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        float *pp = dst + p * in * NR;
        int64_t o0 = p * NR, nr = out - o0 < NR ? out - o0 : NR;
        for (int64_t i = 0; i < in; i++) {
            float *row = pp + i * NR;
            for (int64_t j = 0; j < nr; j++) row[j] = kvm__f16_float(src[(o0 + j) * s_out + i * s_in]);
            for (int64_t j = nr; j < NR; j++) row[j] = 0.0f;
        }
    }
}

int kvm__cpu_pack_f16(kvm_cpu_packed *dst, const uint16_t *src, int64_t out, int64_t in, int64_t s_out, int64_t s_in)
{
    int rc = pack_room(dst, out, in);
    if (!rc) pack_widen(dst->p, src, out, in, s_out, s_in);
    return rc;
}

/* One panel of NR rows (nr real ones, buf [nr][in] float32) into dst [in][NR] 16-bit; returns
 * the index (row * in + column) of the first finite value f16 cannot hold, or -1. Cloned so
 * that the conversions use F16C where the processor has it. */
KVM_CLONES
static int64_t pack_panel_h(const float *buf, int64_t nr, int64_t in, int dtype, uint16_t *dst)
{
    for (int64_t i = 0; i < in; i++)
        for (int64_t j = 0; j < KVM_GEMM_NR; j++) {
            float v = j < nr ? buf[j * in + i] : 0.0f;
            uint16_t h = dtype == KVM_GEMM_BF16 ? f32_to_bf16(v) : kvm__f16_bits(v);
            if (dtype == KVM_GEMM_F16 && (h & 0x7fffu) == 0x7c00u && v == v && v - v == 0.0f) return j * in + i;
            dst[i * KVM_GEMM_NR + j] = h;
        }
    return -1;
}

int kvm__cpu_pack_rows(kvm_cpu_packed *dst, int (*rows)(void *ctx, int64_t r0, int64_t n, float *buf), void *ctx,
                       int64_t out, int64_t in, int dtype)
{
    const int64_t NR = KVM_GEMM_NR, panels = (out + NR - 1) / NR, need = panels * in * NR;
    size_t esz = dtype == KVM_GEMM_F32 ? sizeof(float) : sizeof(uint16_t);
    size_t bytes = ((size_t)(need > 0 ? need : 1) * esz + 63) & ~(size_t)63;
    void *mem = aligned_alloc(64, bytes);
    float *buf = malloc((size_t)NR * (size_t)(in > 0 ? in : 1) * sizeof *buf);
    int rc = 0;
    if (!mem || !buf) {
        rc = kvm_err(KVM_ENOMEM, "gemm: out of memory packing %lld x %lld", (long long)out, (long long)in);
        goto fail;
    }
    for (int64_t p = 0; p < panels; p++) {
        int64_t o0 = p * NR, nr = out - o0 < NR ? out - o0 : NR;
        if ((rc = rows(ctx, o0, nr, buf))) goto fail;
        if (dtype == KVM_GEMM_F32) {
            float *pp = (float *)mem + p * in * NR;
            for (int64_t i = 0; i < in; i++)
                for (int64_t j = 0; j < NR; j++) pp[i * NR + j] = j < nr ? buf[j * in + i] : 0.0f;
            continue;
        }
        int64_t bad = pack_panel_h(buf, nr, in, dtype, (uint16_t *)mem + p * in * NR);
        if (bad >= 0) {
            rc = kvm_err(KVM_ERANGE, "gemm: value %g at row %lld, column %lld is outside f16's range (±65504)",
                         (double)buf[bad], (long long)(o0 + bad / in), (long long)(bad % in));
            goto fail;
        }
    }
    free(buf);
    *dst = (kvm_cpu_packed){.out = out, .in = in, .dtype = dtype};
    if (dtype == KVM_GEMM_F32) {
        dst->p = mem;
        dst->cap = need;
    } else dst->h = mem;
    return 0;
fail:
    free(mem);
    free(buf);
    return rc;
}

void kvm__cpu_packed_free(kvm_cpu_packed *dst)
{
    free(dst->p);
    free(dst->h);
    *dst = (kvm_cpu_packed){0};
}

/* Row r of Y's tile as the starting sums (load) or zero; columns past nr are zero. */
static inline __attribute__((always_inline)) v16 acc_start(int load, const float *y, int nr)
{
    v16 a = {0};
    if (!load) return a;
    if (nr == KVM_GEMM_NR) memcpy(&a, y, sizeof a);
    else
        for (int j = 0; j < nr; j++) a[j] = y[j];
    return a;
}

/* One MR x NR tile: rows [0, mr) of x (rows past mr repeat row 0 and are not stored),
 * columns [0, nr) stored. load: the sums start from y (a previous K block's raw sums, stored
 * with alpha = 1), so splitting K into blocks keeps every sum's order. */
KVM_CLONES
static void tile(int64_t K, const float *x, int64_t ldx, int mr, const float *panel, float *y, int64_t ldy, int nr,
                 float alpha, int load)
{
    const float *xr[KVM_GEMM_MR];
    for (int r = 0; r < KVM_GEMM_MR; r++) xr[r] = x + (r < mr ? r : 0) * ldx;
    int l1 = load && mr > 1, l2 = load && mr > 2, l3 = load && mr > 3, l4 = load && mr > 4, l5 = load && mr > 5;
    int l6 = load && mr > 6, l7 = load && mr > 7;
    v16 acc0 = acc_start(load, y, nr), acc1 = acc_start(l1, y + ldy, nr), acc2 = acc_start(l2, y + 2 * ldy, nr),
        acc3 = acc_start(l3, y + 3 * ldy, nr), acc4 = acc_start(l4, y + 4 * ldy, nr),
        acc5 = acc_start(l5, y + 5 * ldy, nr), acc6 = acc_start(l6, y + 6 * ldy, nr),
        acc7 = acc_start(l7, y + 7 * ldy, nr);
    for (int64_t k = 0; k < K; k++) {
        v16 b;
        memcpy(&b, panel + k * KVM_GEMM_NR, sizeof b);
        acc0 += xr[0][k] * b;
        acc1 += xr[1][k] * b;
        acc2 += xr[2][k] * b;
        acc3 += xr[3][k] * b;
        acc4 += xr[4][k] * b;
        acc5 += xr[5][k] * b;
        acc6 += xr[6][k] * b;
        acc7 += xr[7][k] * b;
    }
    v16 acc[KVM_GEMM_MR] = {acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7};
    for (int r = 0; r < mr; r++) {
        v16 a = acc[r] * alpha;
        if (nr == KVM_GEMM_NR) memcpy(y + r * ldy, &a, sizeof a);
        else
            for (int j = 0; j < nr; j++) y[r * ldy + j] = a[j];
    }
}

/* Four rows x NR in 256-bit halves (machines without AVX-512: 8 accumulators + operands fit 16
 * vector registers, and GCC lowers 512-bit generic vectors on AVX2 through the stack). The same
 * sums in the same order as tile, so the results are bit-identical. */
typedef float v8 __attribute__((vector_size(32)));

KVM_CLONES
static void tile4(int64_t K, const float *x, int64_t ldx, int mr, const float *panel, float *y, int64_t ldy, int nr,
                  float alpha, int load)
{
    const float *x0 = x, *x1 = x + (mr > 1 ? 1 : 0) * ldx, *x2 = x + (mr > 2 ? 2 : 0) * ldx;
    const float *x3 = x + (mr > 3 ? 3 : 0) * ldx;
    v8 a0 = {0}, b0 = {0}, a1 = {0}, b1 = {0}, a2 = {0}, b2 = {0}, a3 = {0}, b3 = {0};
    if (load) {
        v8 *s[4][2] = {{&a0, &b0}, {&a1, &b1}, {&a2, &b2}, {&a3, &b3}};
        for (int r = 0; r < mr; r++) {
            v16 a = acc_start(1, y + r * ldy, nr);
            memcpy(s[r][0], &a, sizeof a0);
            memcpy(s[r][1], (const float *)&a + 8, sizeof b0);
        }
    }
    for (int64_t k = 0; k < K; k++) {
        v8 lo, hi;
        memcpy(&lo, panel + k * KVM_GEMM_NR, sizeof lo);
        memcpy(&hi, panel + k * KVM_GEMM_NR + 8, sizeof hi);
        a0 += x0[k] * lo;
        b0 += x0[k] * hi;
        a1 += x1[k] * lo;
        b1 += x1[k] * hi;
        a2 += x2[k] * lo;
        b2 += x2[k] * hi;
        a3 += x3[k] * lo;
        b3 += x3[k] * hi;
    }
    v8 acc[4][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}};
    for (int r = 0; r < mr; r++) {
        float out[KVM_GEMM_NR];
        v8 lo = acc[r][0] * alpha, hi = acc[r][1] * alpha;
        if (nr == KVM_GEMM_NR) {
            memcpy(y + r * ldy, &lo, sizeof lo);
            memcpy(y + r * ldy + 8, &hi, sizeof hi);
            continue;
        }
        memcpy(out, &lo, sizeof lo);
        memcpy(out + 8, &hi, sizeof hi);
        for (int j = 0; j < nr; j++) y[r * ldy + j] = out[j];
    }
}

/* A single row (decode): four partial sums over k hide the FMA latency that one
 * accumulator would expose, instead of computing eight copies of the row. */
KVM_CLONES
static void tile1_any(int64_t K, const float *x, const float *panel, float *y, int nr, float alpha)
{
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        v16 b0, b1, b2, b3;
        memcpy(&b0, panel + (k + 0) * KVM_GEMM_NR, sizeof b0);
        memcpy(&b1, panel + (k + 1) * KVM_GEMM_NR, sizeof b1);
        memcpy(&b2, panel + (k + 2) * KVM_GEMM_NR, sizeof b2);
        memcpy(&b3, panel + (k + 3) * KVM_GEMM_NR, sizeof b3);
        a0 += x[k] * b0;
        a1 += x[k + 1] * b1;
        a2 += x[k + 2] * b2;
        a3 += x[k + 3] * b3;
    }
    for (; k < K; k++) {
        v16 b;
        memcpy(&b, panel + k * KVM_GEMM_NR, sizeof b);
        a0 += x[k] * b;
    }
    v16 acc = ((a0 + a1) + (a2 + a3)) * alpha;
    if (nr == KVM_GEMM_NR) memcpy(y, &acc, sizeof acc);
    else
        for (int j = 0; j < nr; j++) y[j] = acc[j];
}

/* tile1 on a 16-bit panel, widened as it streams (decode is bound by the bytes it reads, so
 * reading half of them is the point); the same sums as tile1. WIDEN(p) widens 16 values. */
#define TILE1_H_BODY(WIDEN)                                                                                            \
    do {                                                                                                               \
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                                    \
        int64_t k = 0;                                                                                                 \
        for (; k + 4 <= K; k += 4) {                                                                                   \
            v16 b0 = WIDEN(panel + (k + 0) * KVM_GEMM_NR), b1 = WIDEN(panel + (k + 1) * KVM_GEMM_NR);                  \
            v16 b2 = WIDEN(panel + (k + 2) * KVM_GEMM_NR), b3 = WIDEN(panel + (k + 3) * KVM_GEMM_NR);                  \
            a0 += x[k] * b0;                                                                                           \
            a1 += x[k + 1] * b1;                                                                                       \
            a2 += x[k + 2] * b2;                                                                                       \
            a3 += x[k + 3] * b3;                                                                                       \
        }                                                                                                              \
        for (; k < K; k++)                                                                                             \
            a0 += x[k] * WIDEN(panel + k * KVM_GEMM_NR);                                                               \
        v16 acc = ((a0 + a1) + (a2 + a3)) * alpha;                                                                     \
        if (nr == KVM_GEMM_NR)                                                                                         \
            memcpy(y, &acc, sizeof acc);                                                                               \
        else                                                                                                           \
            for (int j = 0; j < nr; j++)                                                                               \
                y[j] = acc[j];                                                                                         \
    } while (0)

/* Widens rows [k0, k0 + kc) of a 16-bit panel into buf [kc][NR]. */
#define WIDEN_BLOCK_BODY(WIDEN)                                                                                        \
    do {                                                                                                               \
        for (int64_t k = 0; k < kc; k++) {                                                                             \
            v16 f = WIDEN(panel + (k0 + k) * KVM_GEMM_NR);                                                             \
            memcpy(buf + k * KVM_GEMM_NR, &f, sizeof f);                                                               \
        }                                                                                                              \
    } while (0)

#define WIDEN_DT(p) widen(p, dtype)

KVM_CLONES
static void tile1_h_any(int64_t K, const float *x, const uint16_t *panel, int dtype, float *y, int nr, float alpha)
{
    TILE1_H_BODY(WIDEN_DT);
}

KVM_CLONES
static void widen_block_any(const uint16_t *panel, int dtype, int64_t k0, int64_t kc, float *buf)
{
    WIDEN_BLOCK_BODY(WIDEN_DT);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define GEMM_V4 __attribute__((target("arch=x86-64-v4")))
/* f16 panels where the processor runs x86-64-v4: one vcvtph2ps per 16 values (the same exact
 * values as the integer widening, which the clones compile to about 20 instructions). */
#define WIDEN_F16_V4(p) ((v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p))))

GEMM_V4 static void tile1_f16_v4(int64_t K, const float *x, const uint16_t *panel, float *y, int nr, float alpha)
{
    TILE1_H_BODY(WIDEN_F16_V4);
}

GEMM_V4 static void widen_block_f16_v4(const uint16_t *panel, int64_t k0, int64_t kc, float *buf)
{
    WIDEN_BLOCK_BODY(WIDEN_F16_V4);
}

static int f16_v4(int dtype) { return dtype == KVM_GEMM_F16 && kvm__cpu_v4(); }

#define GEMM_V3 __attribute__((target("arch=x86-64-v3")))
/* 16-bit panels where the processor runs x86-64-v3 but not v4 (AVX2 machines), in 256-bit
 * halves: f16 by two F16C vcvtph2ps of 8 values each (the integer widening in 512-bit generic
 * vectors is about 40 instructions per 16 values there), bf16 by a zero extension and a shift.
 * Written with intrinsics because GCC kept the 16-lane generic vectors of TILE1_H_BODY, built
 * from two widened halves, on the stack (spills and vpinsrq around every FMA: the decode GEMV
 * read f16 panels at 6 GB/s and bf16 ones at 3 where the core streams 15). Each lane's
 * operations and their order are the body's (a_u = fma(x[k + u], b, a_u), then ((a0 + a1) +
 * (a2 + a3)) · alpha), so the same bits as float32 panels holding the widened values. */
/* The 8 values at element i of a panel widened: mode 0 f16, 1 bf16, 2 float32 (a load). */
enum { V3_F16, V3_BF16, V3_F32 };
GEMM_V3 static inline __attribute__((always_inline)) __m256 load8_v3(const void *panel, int64_t i, const int mode)
{
    if (mode == V3_F32) return _mm256_loadu_ps((const float *)panel + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)panel + i));
    if (mode == V3_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

GEMM_V3 static inline __attribute__((always_inline)) void tile1_v3(int64_t K, const float *x, const void *panel,
                                                                   float *y, int nr, float alpha, const int mode)
{
    const int64_t NR = KVM_GEMM_NR;
    __m256 a[4][2];
    for (int u = 0; u < 4; u++)
        a[u][0] = a[u][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 4 <= K; k += 4)
        for (int u = 0; u < 4; u++) {
            const __m256 xv = _mm256_broadcast_ss(x + k + u);
            a[u][0] = _mm256_fmadd_ps(xv, load8_v3(panel, (k + u) * NR, mode), a[u][0]);
            a[u][1] = _mm256_fmadd_ps(xv, load8_v3(panel, (k + u) * NR + 8, mode), a[u][1]);
        }
    for (; k < K; k++) {
        const __m256 xv = _mm256_broadcast_ss(x + k);
        a[0][0] = _mm256_fmadd_ps(xv, load8_v3(panel, k * NR, mode), a[0][0]);
        a[0][1] = _mm256_fmadd_ps(xv, load8_v3(panel, k * NR + 8, mode), a[0][1]);
    }
    const __m256 al = _mm256_set1_ps(alpha);
    float acc[KVM_GEMM_NR];
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(
            acc + 8 * h,
            _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(a[0][h], a[1][h]), _mm256_add_ps(a[2][h], a[3][h])), al));
    memcpy(y, acc, (size_t)nr * sizeof *y);
}

GEMM_V3 static void tile1_f32_v3(int64_t K, const float *x, const float *panel, float *y, int nr, float alpha)
{
    tile1_v3(K, x, panel, y, nr, alpha, V3_F32);
}

GEMM_V3 static void tile1_f16_v3(int64_t K, const float *x, const uint16_t *panel, float *y, int nr, float alpha)
{
    tile1_v3(K, x, panel, y, nr, alpha, V3_F16);
}

GEMM_V3 static void tile1_bf16_v3(int64_t K, const float *x, const uint16_t *panel, float *y, int nr, float alpha)
{
    tile1_v3(K, x, panel, y, nr, alpha, V3_BF16);
}

GEMM_V3 static inline __attribute__((always_inline)) void widen_block_v3(const uint16_t *panel, int64_t k0, int64_t kc,
                                                                         float *buf, const int mode)
{
    for (int64_t k = 0; k < kc; k++) { /* two halves, stored as they are widened */
        _mm256_storeu_ps(buf + k * KVM_GEMM_NR, load8_v3(panel, (k0 + k) * KVM_GEMM_NR, mode));
        _mm256_storeu_ps(buf + k * KVM_GEMM_NR + 8, load8_v3(panel, (k0 + k) * KVM_GEMM_NR + 8, mode));
    }
}

GEMM_V3 static void widen_block_f16_v3(const uint16_t *panel, int64_t k0, int64_t kc, float *buf)
{
    widen_block_v3(panel, k0, kc, buf, V3_F16);
}

GEMM_V3 static void widen_block_bf16_v3(const uint16_t *panel, int64_t k0, int64_t kc, float *buf)
{
    widen_block_v3(panel, k0, kc, buf, V3_BF16);
}

/* bf16 on x86-64-v3 only: where v4 runs, the generic body's 16 lanes are one AVX-512 register. */
/* Whether the AVX2 single-row paths above run: where the processor runs x86-64-v3, except in
 * sanitizer builds, whose generic code is not cloned (baseline SSE2: products and sums
 * rounded apart) while these paths' intrinsics are FMAs: one build, one arithmetic. */
static int v3_paths(void)
{
#ifdef __SANITIZE_ADDRESS__
    return 0;
#else
    return kvm__cpu_v3();
#endif
}
static int bf16_v3(int dtype) { return dtype == KVM_GEMM_BF16 && v3_paths() && !kvm__cpu_v4(); }
static int f16_v3(int dtype) { return dtype == KVM_GEMM_F16 && v3_paths(); }
#endif

/* tile1 (float32 panels): the AVX2 halves where the processor runs x86-64-v3 but not v4. */
static void tile1(int64_t K, const float *x, const float *panel, float *y, int nr, float alpha)
{
#ifdef GEMM_V4
    if (v3_paths() && !kvm__cpu_v4()) {
        tile1_f32_v3(K, x, panel, y, nr, alpha);
        return;
    }
#endif
    tile1_any(K, x, panel, y, nr, alpha);
}

static void tile1_h(int64_t K, const float *x, const uint16_t *panel, int dtype, float *y, int nr, float alpha)
{
#ifdef GEMM_V4
    if (f16_v4(dtype)) {
        tile1_f16_v4(K, x, panel, y, nr, alpha);
        return;
    }
    if (f16_v3(dtype)) {
        tile1_f16_v3(K, x, panel, y, nr, alpha);
        return;
    }
    if (bf16_v3(dtype)) {
        tile1_bf16_v3(K, x, panel, y, nr, alpha);
        return;
    }
#endif
    tile1_h_any(K, x, panel, dtype, y, nr, alpha);
}

static void widen_block(const uint16_t *panel, int dtype, int64_t k0, int64_t kc, float *buf)
{
#ifdef GEMM_V4
    if (f16_v4(dtype)) {
        widen_block_f16_v4(panel, k0, kc, buf);
        return;
    }
    if (f16_v3(dtype)) {
        widen_block_f16_v3(panel, k0, kc, buf);
        return;
    }
    if (bf16_v3(dtype)) {
        widen_block_bf16_v3(panel, k0, kc, buf);
        return;
    }
#endif
    widen_block_any(panel, dtype, k0, kc, buf);
}

/* Two adjacent full panels (8 x 32) at once: each broadcast of x feeds two FMAs and the tile
 * set-up is paid once per 32 columns, which matters when K is small (attention scores with
 * head size 8). 16 accumulators fit AVX-512's 32 registers; the AVX2 clone is not used. */
/* 1 when the processor has AVX-512 (32 vector registers for tile2's 16 accumulators). */
static int wide_tiles(void)
{
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
    static int v = -1;
    if (v < 0) v = __builtin_cpu_supports("avx512f") ? 1 : 0;
    return v;
#else
    return 0;
#endif
}

KVM_CLONES
static void tile2(int64_t K, const float *x, int64_t ldx, int mr, const float *p0, const float *p1, float *y, int64_t ldy,
                  float alpha, int load)
{
    const float *xr[KVM_GEMM_MR];
    for (int r = 0; r < KVM_GEMM_MR; r++) xr[r] = x + (r < mr ? r : 0) * ldx;
    v16 a[KVM_GEMM_MR][2];
    memset(a, 0, sizeof a);
    for (int r = 0; load && r < mr; r++) {
        a[r][0] = acc_start(1, y + r * ldy, KVM_GEMM_NR);
        a[r][1] = acc_start(1, y + r * ldy + KVM_GEMM_NR, KVM_GEMM_NR);
    }
    for (int64_t k = 0; k < K; k++) {
        v16 b0, b1;
        memcpy(&b0, p0 + k * KVM_GEMM_NR, sizeof b0);
        memcpy(&b1, p1 + k * KVM_GEMM_NR, sizeof b1);
        for (int r = 0; r < KVM_GEMM_MR; r++) {
            float xv = xr[r][k];
            a[r][0] += xv * b0;
            a[r][1] += xv * b1;
        }
    }
    for (int r = 0; r < mr; r++) {
        v16 o0 = a[r][0] * alpha, o1 = a[r][1] * alpha;
        memcpy(y + r * ldy, &o0, sizeof o0);
        memcpy(y + r * ldy + KVM_GEMM_NR, &o1, sizeof o1);
    }
}

/* Rows [r0, r1) x one panel's columns [c, c + nr) over the shared rows [k0, k0 + kc) of a
 * float32 panel block (row k of the block at panel + k * NR). */
static void panel_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, const float *panel, int64_t kc, float *y,
                       int64_t ldy, int nr, float alpha, int load)
{
    for (int64_t r = r0; r < r1; r += KVM_GEMM_MR) {
        int mr = (int)(r1 - r < KVM_GEMM_MR ? r1 - r : KVM_GEMM_MR);
        if (mr == 1 && !load) tile1(kc, x + r * ldx, panel, y + r * ldy, nr, alpha);
        else if (!wide_tiles())
            for (int h = 0; h < mr; h += 4)
                tile4(kc, x + (r + h) * ldx, ldx, mr - h < 4 ? mr - h : 4, panel, y + (r + h) * ldy, ldy, nr, alpha,
                      load);
        else tile(kc, x + r * ldx, ldx, mr, panel, y + r * ldy, ldy, nr, alpha, load);
    }
}

/* The row tiles [r0, rt) of one panel's (pair == 0) or two adjacent full panels' (pair == 1)
 * columns from c: the panels KC rows at a time, widened once into buf ([KC][NR] per panel) and
 * reused by every row tile of the block, the tiles after the first block starting from the raw
 * sums the block before stored (alpha on the last block only: every sum over k in order). Two
 * panels go through tile2 (each broadcast of x feeds two FMAs), as the float32 path does. */
static void h_rows(const float *x, int64_t ldx, int64_t r0, int64_t rt, const kvm_cpu_packed *w, int64_t c, int nr,
                   int pair, float *y, int64_t ldy, float alpha, int64_t K, float *buf)
{
    const int64_t NR = KVM_GEMM_NR;
    const uint16_t *p0 = w->h + (c / NR) * w->in * NR, *p1 = p0 + w->in * NR;
    for (int64_t k0 = 0; rt > r0 && (k0 < K || k0 == 0); k0 += KVM_GEMM_KC) {
        const int64_t kc = K - k0 < KVM_GEMM_KC ? K - k0 : KVM_GEMM_KC;
        const float a = k0 + kc >= K ? alpha : 1.0f;
        float *b1 = buf + KVM_GEMM_KC * NR;
        widen_block(p0, w->dtype, k0, kc, buf);
        if (!pair) {
            panel_rows(x + k0, ldx, r0, rt, buf, kc, y + c, ldy, nr, a, k0 > 0);
            continue;
        }
        widen_block(p1, w->dtype, k0, kc, b1);
        for (int64_t r = r0; r < rt; r += KVM_GEMM_MR) {
            const int mr = (int)(rt - r < KVM_GEMM_MR ? rt - r : KVM_GEMM_MR);
            tile2(kc, x + r * ldx + k0, ldx, mr, buf, b1, y + r * ldy + c, ldy, a, k0 > 0);
        }
    }
}

/* The 16-bit path: a single row streams the panel (tile1_h); row tiles take the panels KC rows
 * at a time (h_rows), two full panels at once where the processor has AVX-512. */
static void gemm_h(const float *x, int64_t m, int64_t ldx, const kvm_cpu_packed *w, float *y, int64_t ldy, float alpha,
                   int64_t col0, int64_t col1, int64_t K)
{
    const int64_t NR = KVM_GEMM_NR;
    float buf[2 * KVM_GEMM_KC * KVM_GEMM_NR] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < m; r0 += KVM_GEMM_MC) {
        int64_t r1 = r0 + KVM_GEMM_MC < m ? r0 + KVM_GEMM_MC : m;
        /* a last tile of one row is tile1's job in the float32 path: the same here */
        const int64_t rt = (r1 - r0) % KVM_GEMM_MR == 1 ? r1 - 1 : r1;
        for (int64_t c = col0; c < col1;) {
            const int nr = (int)(col1 - c < NR ? col1 - c : NR);
            const int pair = wide_tiles() && c + 2 * NR <= col1 && rt - r0 > 1;
            for (int64_t p = 0; rt < r1 && p <= pair; p++) {
                const uint16_t *panel = w->h + (c / NR + p) * w->in * NR;
                tile1_h(K, x + rt * ldx, panel, w->dtype, y + rt * ldy + c + p * NR, pair ? (int)NR : nr, alpha);
            }
            h_rows(x, ldx, r0, rt, w, c, nr, pair, y, ldy, alpha, K, buf);
            c += pair ? 2 * NR : NR;
        }
    }
}

void kvm__cpu_gemm_packed(const float *x, int64_t m, int64_t ldx, const kvm_cpu_packed *w, float *y, int64_t ldy,
                          float alpha, int64_t col0, int64_t col1, int64_t k_len)
{
    const int64_t NR = KVM_GEMM_NR, K = k_len;
    if (w->h) {
        gemm_h(x, m, ldx, w, y, ldy, alpha, col0, col1, K);
        return;
    }
    for (int64_t r0 = 0; r0 < m; r0 += KVM_GEMM_MC) {
        int64_t r1 = r0 + KVM_GEMM_MC < m ? r0 + KVM_GEMM_MC : m;
        int64_t c = col0;
        if (wide_tiles())
            for (; c + 2 * NR <= col1 && m > 1; c += 2 * NR) {
                const float *p0 = w->p + (c / NR) * w->in * NR, *p1 = p0 + w->in * NR;
                for (int64_t r = r0; r < r1; r += KVM_GEMM_MR) {
                    int mr = (int)(r1 - r < KVM_GEMM_MR ? r1 - r : KVM_GEMM_MR);
                    if (mr == 1) { /* a last tile of one row is tile1's, as in panel_rows and gemm_h */
                        tile1(K, x + r * ldx, p0, y + r * ldy + c, (int)NR, alpha);
                        tile1(K, x + r * ldx, p1, y + r * ldy + c + NR, (int)NR, alpha);
                        continue;
                    }
                    tile2(K, x + r * ldx, ldx, mr, p0, p1, y + r * ldy + c, ldy, alpha, 0);
                }
            }
        for (; c < col1; c += NR) {
            const float *panel = w->p + (c / NR) * w->in * NR;
            int nr = (int)(col1 - c < NR ? col1 - c : NR);
            panel_rows(x, ldx, r0, r1, panel, K, y + c, ldy, nr, alpha, 0);
        }
    }
}
