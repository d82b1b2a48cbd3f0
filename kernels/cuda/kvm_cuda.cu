// kvm_cuda.cu: entry point of the CUDA backend: device probing, checked-call reporting, per-thread
// cuBLAS handles, the memory plan check and the kvm_kernels table over device memory. The table's
// functions take no context argument, so each device gets its own instantiation (template on the
// device number, KVM_CUDA_MAX_DEVICES of them) that makes its device current before working.
// Table functions returning void (rmsnorm, rope, swiglu, add) record a failure for the calling
// thread; the next int-returning call of the same table (matmul, sgemm, download, attention)
// returns it, so a forward sees every failure at its next checked step.
#include "kernels/cuda/kvm_cuda_impl.h"

#include <dlfcn.h>
#include <stdio.h>

#include <mutex>

extern "C" int kvm__cuda_sgemm_dev(int dev, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                                   const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                                   int64_t ldc);

int kvm__cuda_fail(int dev, const char *call, cudaError_t e)
{
    return kvm_err(KVM_EDEVICE, "cuda:%d: %s failed: %s (%s)", dev, call, cudaGetErrorString(e), cudaGetErrorName(e));
}

int kvm__cublas_fail(int dev, const char *call, cublasStatus_t s)
{
    return kvm_err(KVM_EDEVICE, "cuda:%d: %s failed: %s (status %d)", dev, call,
                   kvm__cb.status_string ? kvm__cb.status_string(s) : "?", (int)s);
}

kvm_cublas_api kvm__cb;
static std::once_flag cb_once;
static char cb_error[512];

// libcublas.so.13 (the runtime's soname; LD_LIBRARY_PATH or the loader's cache finds it)
static void cb_load()
{
    void *h = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(cb_error, sizeof cb_error, "cannot load libcublas.so.13: %s", dlerror());
        return;
    }
    kvm_cublas_api a;
    a.create = (decltype(a.create))dlsym(h, "cublasCreate_v2");
    a.destroy = (decltype(a.destroy))dlsym(h, "cublasDestroy_v2");
    a.set_stream = (decltype(a.set_stream))dlsym(h, "cublasSetStream_v2");
    a.set_math_mode = (decltype(a.set_math_mode))dlsym(h, "cublasSetMathMode");
    a.sgemm = (decltype(a.sgemm))dlsym(h, "cublasSgemm_v2");
    a.dgemm = (decltype(a.dgemm))dlsym(h, "cublasDgemm_v2");
    a.sgemm_sb = (decltype(a.sgemm_sb))dlsym(h, "cublasSgemmStridedBatched");
    a.dgemm_sb = (decltype(a.dgemm_sb))dlsym(h, "cublasDgemmStridedBatched");
    a.gemm_ex = (decltype(a.gemm_ex))dlsym(h, "cublasGemmEx");
    a.status_string = (decltype(a.status_string))dlsym(h, "cublasGetStatusString");
    if (!a.create || !a.destroy || !a.set_stream || !a.set_math_mode || !a.sgemm || !a.dgemm || !a.gemm_ex ||
        !a.sgemm_sb || !a.dgemm_sb || !a.status_string) {
        snprintf(cb_error, sizeof cb_error, "libcublas.so.13 lacks a cuBLAS function kvmill calls");
        return;
    }
    kvm__cb = a;
}

int kvm__cuda_use(int dev)
{
    KVM_CU(dev, cudaSetDevice(dev));
    return 0;
}

int kvm__cublas_load(int dev)
{
    std::call_once(cb_once, cb_load);
    return kvm__cb.create ? 0 : kvm_err(KVM_EDEVICE, "cuda:%d: %s", dev, cb_error);
}

static thread_local cublasHandle_t handles[KVM_CUDA_MAX_DEVICES];

cublasHandle_t kvm__cublas(int dev)
{
    if (dev < 0 || dev >= KVM_CUDA_MAX_DEVICES) return NULL;
    if (kvm__cublas_load(dev)) return NULL;
    if (!handles[dev]) {
        cublasHandle_t h;
        cublasStatus_t s = kvm__cb.create(&h);
        if (s != CUBLAS_STATUS_SUCCESS) {
            kvm__cublas_fail(dev, "cublasCreate", s);
            return NULL;
        }
        if ((s = kvm__cb.set_stream(h, cudaStreamPerThread)) != CUBLAS_STATUS_SUCCESS) {
            kvm__cublas_fail(dev, "cublasSetStream", s);
            kvm__cb.destroy(h);
            return NULL;
        }
        handles[dev] = h;
    }
    return handles[dev];
}

extern "C" {

int kvm_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
}

static kvm_cuda_wdtype weight_dtype = KVM_CUDA_BF16;
void kvm_cuda_set_weight_dtype(kvm_cuda_wdtype t) { weight_dtype = t; }
kvm_cuda_wdtype kvm_cuda_weight_dtype(void) { return weight_dtype; }
size_t kvm_cuda_wdtype_bytes(kvm_cuda_wdtype t) { return t == KVM_CUDA_F32 ? 4 : 2; }

int kvm_cuda_plan_fits(int device, size_t bytes, const char *what)
{
    const size_t reserve = (size_t)256 << 20;
    size_t free_b = 0, total_b = 0;
    int rc = kvm__cuda_use(device);
    if (rc) return rc;
    KVM_CU(device, cudaMemGetInfo(&free_b, &total_b));
    if (bytes + reserve > free_b)
        return kvm_err(KVM_ENOMEM,
                       "cuda:%d: %s needs %zu bytes (%.1f MiB, plus a %zu MiB reserve) but %zu bytes (%.1f MiB) of "
                       "%zu are free",
                       device, what, bytes, bytes / 1048576.0, reserve >> 20, free_b, free_b / 1048576.0, total_b);
    return 0;
}

} // extern "C"

// ---- the table, one instantiation per device ----
struct kvm_weight {
    kvm_cuda_wdtype t;
    int64_t out, in;
    void *d;
};

static thread_local int sticky[KVM_CUDA_MAX_DEVICES]; // a void kernel's failure, returned by the next call

template <int D> struct dev_table {
    static int take_sticky()
    {
        int rc = sticky[D];
        sticky[D] = 0;
        return rc;
    }
    static void keep(int rc)
    {
        if (rc && !sticky[D]) sticky[D] = rc;
    }
    static void *alloc(size_t bytes)
    {
        void *p = NULL;
        if (kvm__cuda_use(D)) return NULL;
        cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
        if (e != cudaSuccess) {
            kvm_err(KVM_ENOMEM, "cuda:%d: cudaMalloc(%zu bytes) failed: %s", D, bytes, cudaGetErrorString(e));
            return NULL;
        }
        if ((e = cudaMemset(p, 0, bytes ? bytes : 1)) != cudaSuccess) {
            kvm__cuda_fail(D, "cudaMemset", e);
            cudaFree(p);
            return NULL;
        }
        return p;
    }
    static void free_(void *p)
    {
        if (p && !kvm__cuda_use(D)) cudaFree(p);
    }
    static int upload(void *dst, const void *src, size_t bytes)
    {
        int rc = kvm__cuda_use(D);
        if (rc || !bytes) return rc;
        KVM_CU(D, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cudaStreamPerThread));
        KVM_CU(D, cudaStreamSynchronize(cudaStreamPerThread));
        return 0;
    }
    static int download(void *dst, const void *src, size_t bytes)
    {
        int rc = kvm__cuda_use(D);
        if (rc || (rc = take_sticky()) || !bytes) return rc;
        KVM_CU(D, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread));
        KVM_CU(D, cudaStreamSynchronize(cudaStreamPerThread));
        return 0;
    }
    static int sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                     const float *b, int64_t ldb, float beta, float *c, int64_t ldc)
    {
        int rc = take_sticky();
        return rc ? rc : kvm__cuda_sgemm_dev(D, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
    // host float32 [out][in] → device in the process-wide weight dtype (via a float32 staging copy)
    static kvm_weight *weight_new(const float *w, int64_t out, int64_t in)
    {
        kvm_weight *kw = (kvm_weight *)calloc(1, sizeof *kw);
        if (!kw) {
            kvm_err(KVM_ENOMEM, "weight %lld x %lld: out of memory", (long long)out, (long long)in);
            return NULL;
        }
        kw->t = kvm_cuda_weight_dtype();
        kw->out = out;
        kw->in = in;
        size_t n = (size_t)out * (size_t)in;
        float *stage = (float *)alloc(n * sizeof(float));
        int rc = stage ? upload(stage, w, n * sizeof(float)) : KVM_ENOMEM;
        if (!rc && kw->t == KVM_CUDA_F32) {
            kw->d = stage;
            return kw;
        }
        if (!rc && !(kw->d = alloc(n * kvm_cuda_wdtype_bytes(kw->t)))) rc = KVM_ENOMEM;
        if (!rc) rc = kvm__cuda_convert(D, kw->d, kw->t, stage, (int64_t)n);
        if (!rc && cudaStreamSynchronize(cudaStreamPerThread) != cudaSuccess)
            rc = kvm__cuda_fail(D, "cudaStreamSynchronize", cudaGetLastError());
        free_(stage);
        if (rc) {
            free_(kw->d);
            free(kw);
            return NULL;
        }
        return kw;
    }
    static void weight_free(kvm_weight *w)
    {
        if (!w) return;
        free_(w->d);
        free(w);
    }
    static int matmul(const float *x, int64_t m, int64_t ldx, const kvm_weight *w, float *y, int64_t ldy)
    {
        int rc = kvm__cuda_use(D);
        if (rc || (rc = take_sticky())) return rc;
        return kvm__cuda_gemm_w(D, x, m, ldx, w->d, w->t, w->out, w->in, y, ldy);
    }
    static void rmsnorm(float *out, const float *x, const float *w, int64_t n_rows, int64_t dim, float eps)
    {
        int rc = kvm__cuda_use(D);
        keep(rc ? rc : kvm__cuda_rmsnorm(D, out, x, w, n_rows, dim, eps));
    }
    static void rope(float *x, int64_t n_rows, int64_t row_stride, int n_heads, int head_dim, const float *c,
                     const float *s, kvm_rope_style style)
    {
        int rc = kvm__cuda_use(D);
        keep(rc ? rc : kvm__cuda_rope(D, x, n_rows, row_stride, n_heads, head_dim, c, s, style));
    }
    static void swiglu(float *gate, const float *up, int64_t n)
    {
        int rc = kvm__cuda_use(D);
        keep(rc ? rc : kvm__cuda_swiglu(D, gate, up, n));
    }
    static void add(float *x, const float *y, int64_t n)
    {
        int rc = kvm__cuda_use(D);
        keep(rc ? rc : kvm__cuda_add(D, x, y, n));
    }
    static_assert((unsigned)KVM_CUDA_STAT_MASS == (unsigned)KVM_ATTN_STAT_MASS &&
                      (unsigned)KVM_CUDA_STAT_ENTROPY == (unsigned)KVM_ATTN_STAT_ENTROPY &&
                      (unsigned)KVM_CUDA_STAT_LSE == (unsigned)KVM_ATTN_STAT_LSE &&
                      (unsigned)KVM_CUDA_STAT_OBS == (unsigned)KVM_ATTN_STAT_OBS,
                  "the CUDA statistics flags are kvm_attn_stat's");
    static int attention(const kvm_attn_layer *a)
    {
        if (a->kv_dtype != KVM_KV_F32) // the CUDA forward keeps its own float32 cache on the device
            return kvm_err(KVM_ENOTSUP, "cuda:%d: attention reads float32 keys/values only (kv_dtype f16 is CPU-only)", D);
        int rc = kvm__cuda_use(D);
        if (rc || (rc = take_sticky())) return rc;
        kvm_cuda_attn_layer c = {}; // the same fields, named in kvm_cuda.h for the .cu side
        c.n_heads = a->n_heads, c.n_kv_heads = a->n_kv_heads, c.head_dim = a->head_dim, c.scale = a->scale;
        c.q = a->q, c.ldq = a->ldq, c.qpos = a->qpos, c.n_q = a->n_q;
        c.k = a->k, c.v = a->v, c.pos = a->pos, c.bias = a->bias, c.n_e = a->n_e;
        c.out = a->out, c.ldo = a->ldo, c.stats = a->stats, c.mass_p0 = a->mass_p0, c.mass_p1 = a->mass_p1;
        c.n_obs = a->n_obs, c.ld_e = a->ld_e, c.mass = a->mass, c.entropy = a->entropy, c.lse = a->lse, c.obs = a->obs;
        return kvm_cuda_attention_layer(D, &c);
    }
    static kvm_kernels make()
    {
        kvm_kernels k = {};
        k.name = "cuda";
        k.alloc = alloc;
        k.free = free_;
        k.upload = upload;
        k.download = download;
        k.sgemm = sgemm;
        k.weight_new = weight_new;
        k.weight_free = weight_free;
        k.matmul = matmul;
        k.rmsnorm = rmsnorm;
        k.rope = rope;
        k.swiglu = swiglu;
        k.add = add;
        k.attention = attention;
        return k;
    }
};

static const kvm_kernels tables[KVM_CUDA_MAX_DEVICES] = {
    dev_table<0>::make(), dev_table<1>::make(), dev_table<2>::make(), dev_table<3>::make(),
    dev_table<4>::make(), dev_table<5>::make(), dev_table<6>::make(), dev_table<7>::make(),
};

extern "C" const kvm_kernels *kvm__cuda_backend(int device);

const kvm_kernels *kvm__cuda_backend(int device)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        kvm_err(KVM_EDEVICE, "cuda:%d: no CUDA device (%s)", device,
                e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports 0 devices");
        return NULL;
    }
    if (device >= n) {
        kvm_err(KVM_EDEVICE, "cuda:%d requested but %d CUDA device(s) are visible", device, n);
        return NULL;
    }
    if (device >= KVM_CUDA_MAX_DEVICES) {
        kvm_err(KVM_EDEVICE, "cuda:%d: this build serves cuda:0 to cuda:%d", device, KVM_CUDA_MAX_DEVICES - 1);
        return NULL;
    }
    if (kvm__cuda_use(device)) return NULL;
    return &tables[device];
}
