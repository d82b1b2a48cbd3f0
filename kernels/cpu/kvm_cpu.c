/* kvm_cpu.c: the CPU backend's element-wise kernels and BLAS bridge. Hot loops are
 * compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time (target_clones),
 * so one binary runs everywhere and uses what the processor has. */
#include "kernels/cpu/kvm_cpu.h"
#include "kernels/cpu/kvm_cpu_math.h"
#include "common/kvm_error.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KVM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVM_CLONES
#endif

static void *cpu_alloc(size_t bytes) { return calloc(1, bytes ? bytes : 1); }
static void cpu_free(void *p) { free(p); }

static int cpu_copy(void *dst, const void *src, size_t bytes)
{
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

int kvm__cpu_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                   int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc)
{
    if (m < 0 || n < 0 || k < 0) return kvm_err(KVM_EINVAL, "sgemm: negative size m=%lld n=%lld k=%lld",
                                                (long long)m, (long long)n, (long long)k);
    if (m == 0 || n == 0) return 0;
    if (k == 0) { /* BLAS leaves C untouched for k = 0 only when beta = 1; be explicit */
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
        return 0;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                (blasint)m, (blasint)n, (blasint)k, alpha, a, (blasint)lda, b, (blasint)ldb, beta, c,
                (blasint)ldc);
    return 0;
}

KVM_CLONES
static void cpu_rmsnorm(float *out, const float *x, const float *w, int64_t n_rows, int64_t dim, float eps)
{
    for (int64_t r = 0; r < n_rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (inv * xr[i]);
    }
}

static void cpu_rope(float *x, int64_t n_rows, int64_t row_stride, int n_heads, int head_dim,
                     const float *cos_t, const float *sin_t, kvm_rope_style style)
{
    const int half = head_dim / 2;
    for (int64_t r = 0; r < n_rows; r++) {
        const float *c = cos_t + r * half, *s = sin_t + r * half;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + r * row_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i++) {
                int i0 = style == KVM_ROPE_INTERLEAVED ? 2 * i : i;
                int i1 = style == KVM_ROPE_INTERLEAVED ? 2 * i + 1 : i + half;
                float v0 = v[i0], v1 = v[i1];
                v[i0] = v0 * c[i] - v1 * s[i];
                v[i1] = v0 * s[i] + v1 * c[i];
            }
        }
    }
}

KVM_CLONES
static void cpu_swiglu(float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + kvm__expf(-g)) * up[i];
    }
}

KVM_CLONES
static void cpu_add(float *x, const float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

static const kvm_kernels kvm__cpu_table = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sgemm = kvm__cpu_sgemm,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .attention = kvm__cpu_attention,
};

const kvm_kernels *kvm_kernels_cpu(void) { return &kvm__cpu_table; }

void kvm_kernels_cpu_set_threads(int n) { openblas_set_num_threads(n < 1 ? 1 : n); }
