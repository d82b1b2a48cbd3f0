/* kvm_cpu.c: the CPU backend's element-wise kernels and BLAS bridge. The per-element math is
 * kernels/kvm_forward_body.h (shared with the CUDA backend); the loops over rows and elements
 * are compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time (target_clones),
 * so one binary runs everywhere and uses what the processor has. */
#include "kernels/cpu/kvm_cpu.h"
#include "kernels/cpu/kvm_cpu_clones.h"
#include "kernels/cpu/kvm_cpu_math.h"
#include "kernels/kvm_forward_body.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_pool.h"
#include "kernels/kvm_blas.h"
#include "common/kvm_error.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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
    kvm_blas_lock(); /* the serial OpenBLAS is not safe to call from two threads at once */
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                (blasint)m, (blasint)n, (blasint)k, alpha, a, (blasint)lda, b, (blasint)ldb, beta, c,
                (blasint)ldc);
    kvm_blas_unlock();
    return 0;
}

struct kvm_weight {
    kvm_cpu_packed packed;
};

static kvm_weight *cpu_weight_new(const float *w, int64_t out, int64_t in)
{
    kvm_weight *kw = calloc(1, sizeof *kw);
    if (!kw) {
        kvm_err(KVM_ENOMEM, "weight %lld x %lld: out of memory", (long long)out, (long long)in);
        return NULL;
    }
    if (kvm__cpu_pack(&kw->packed, w, out, in, in, 1)) {
        free(kw);
        return NULL;
    }
    return kw;
}

static int cpu_weight_new_rows(kvm_weight_rows_fn rows, void *ctx, int64_t out, int64_t in, kvm_weight_dtype dtype,
                               kvm_weight **w)
{
    *w = NULL;
    kvm_weight *kw = calloc(1, sizeof *kw);
    if (!kw) return kvm_err(KVM_ENOMEM, "weight %lld x %lld: out of memory", (long long)out, (long long)in);
    int gd = dtype == KVM_WEIGHT_BF16 ? KVM_GEMM_BF16 : dtype == KVM_WEIGHT_F16 ? KVM_GEMM_F16 : KVM_GEMM_F32;
    int rc = kvm__cpu_pack_rows(&kw->packed, rows, ctx, out, in, gd);
    if (rc) {
        free(kw);
        return rc;
    }
    *w = kw;
    return 0;
}

static void cpu_weight_free(kvm_weight *w)
{
    if (!w) return;
    kvm__cpu_packed_free(&w->packed);
    free(w);
}

typedef struct matmul_job {
    const float *x;
    int64_t m, ldx, ldy, cols_per_task;
    const kvm_cpu_packed *w;
    float *y;
} matmul_job;

static void matmul_task(void *ctx, int64_t t, int worker)
{
    const matmul_job *j = ctx;
    int64_t c0 = t * j->cols_per_task, c1 = c0 + j->cols_per_task;
    if (c1 > j->w->out) c1 = j->w->out;
    kvm__cpu_gemm_packed(j->x, j->m, j->ldx, j->w, j->y, j->ldy, 1.0f, c0, c1, j->w->in);
}

/* Splits output columns over the pool when the product is big enough to amortise a wake-up:
 * many flops (prefill), or a weight large enough that one row is bound by memory bandwidth
 * (decode), where two cores stream twice as fast. */
static int cpu_matmul(const float *x, int64_t m, int64_t ldx, const kvm_weight *w, float *y, int64_t ldy)
{
    const kvm_cpu_packed *p = &w->packed;
    int threads = kvm__cpu_threads();
    double flops = 2.0 * (double)m * (double)p->out * (double)p->in;
    double weight_bytes = (p->h ? 2.0 : 4.0) * (double)p->out * (double)p->in;
    if (threads == 1 || (flops < 4e6 && weight_bytes < 1e6)) {
        kvm__cpu_gemm_packed(x, m, ldx, p, y, ldy, 1.0f, 0, p->out, p->in);
        return 0;
    }
    int64_t panels = (p->out + KVM_GEMM_NR - 1) / KVM_GEMM_NR, tasks = 4 * (int64_t)threads;
    if (tasks > panels) tasks = panels;
    int64_t per = (panels + tasks - 1) / tasks;
    matmul_job j = {.x = x, .m = m, .ldx = ldx, .ldy = ldy, .cols_per_task = per * KVM_GEMM_NR, .w = p, .y = y};
    kvm__cpu_parallel_for((panels + per - 1) / per, matmul_task, &j);
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
        float inv = kvm_fb_rms_inv(ss, dim, eps);
        for (int64_t i = 0; i < dim; i++) o[i] = kvm_fb_rms_elem(w[i], inv, xr[i]);
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
            for (int i = 0; i < half; i++) kvm_fb_rope_pair(v, i, half, style == KVM_ROPE_HALF, c[i], s[i]);
        }
    }
}

KVM_CLONES
static void cpu_swiglu(float *gate, const float *up, int64_t n)
{
    for (int64_t i = 0; i < n; i++) gate[i] = kvm_fb_swiglu(gate[i], up[i]);
}

KVM_CLONES
static void cpu_add(float *x, const float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = kvm_fb_add(x[i], y[i]);
}

static const kvm_kernels kvm__cpu_table = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .sgemm = kvm__cpu_sgemm,
    .weight_new = cpu_weight_new,
    .weight_free = cpu_weight_free,
    .weight_new_rows = cpu_weight_new_rows,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .attention = kvm__cpu_attention,
};

const kvm_kernels *kvm_kernels_cpu(void) { return &kvm__cpu_table; }

/* OpenBLAS's server threads, when the library has them (weak: the serial and OpenMP builds of
 * libopenblas do not export it). */
extern void blas_thread_shutdown_(void) __attribute__((weak));

/* OpenBLAS runs single-threaded inside kvmill, from load time on. kvmill's own pool (and the
 * solver's per-problem workers) do the parallel work; what still calls BLAS (the float64 ridge
 * with ridge_f32 = 0, am, kvzip, the table's sgemm) runs inside those workers. An OpenBLAS
 * server thread that is not needed still spins in sched_yield for 2^28 TSC cycles after it
 * starts and after every threaded call (≈ 0.12 s of CPU per process here, 7.6% of a
 * stories260K `kvmill sculpt`, taking the second core from the pool's worker), so the server
 * threads are shut down; a threaded call would start them again, and none is made. */
__attribute__((constructor)) static void cpu_blas_single_thread(void)
{
    openblas_set_num_threads(1);
    if (blas_thread_shutdown_) blas_thread_shutdown_();
}

void kvm_kernels_cpu_set_threads(int n)
{
    kvm__cpu_set_pool_threads(n);
}
