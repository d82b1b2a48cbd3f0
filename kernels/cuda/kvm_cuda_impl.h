// kvm_cuda_impl.h: internal helpers of the CUDA backend (kernels/cuda/ only): checked CUDA and
// cuBLAS calls that name the call and the device, per-thread cuBLAS handles, launch wrappers
// shared by the table (kvm_cuda.cu) and the device model (kvm_cuda_model.cu). All launches go
// to the calling thread's default stream (nvcc --default-stream per-thread), so stages on
// different threads or devices do not serialise on one stream.
#ifndef KVM_CUDA_IMPL_H
#define KVM_CUDA_IMPL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" {
#include "common/kvm_error.h"
#include "kernels/cuda/kvm_cuda.h"
}

int kvm__cuda_fail(int dev, const char *call, cudaError_t e);
int kvm__cublas_fail(int dev, const char *call, cublasStatus_t s);

#define KVM_CU(dev, call)                                                                                            \
    do {                                                                                                             \
        cudaError_t e_ = (call);                                                                                     \
        if (e_ != cudaSuccess) return kvm__cuda_fail((dev), #call, e_);                                              \
    } while (0)
#define KVM_CUBLAS(dev, call)                                                                                        \
    do {                                                                                                             \
        cublasStatus_t s_ = (call);                                                                                  \
        if (s_ != CUBLAS_STATUS_SUCCESS) return kvm__cublas_fail((dev), #call, s_);                                  \
    } while (0)
// after a kernel launch: reports a launch error (bad configuration, no device) by kernel name
#define KVM_CU_LAUNCHED(dev, name) KVM_CU((dev), cudaGetLastError())

// cuBLAS, loaded with dlopen when a CUDA table or model first needs it: linked directly, its
// 600 MB of libraries would be mapped and relocated at the start of every kvmill process
// (0.4 s and 225 MB for `kvmill --help`), device or not. kvm__cublas() loads it.
struct kvm_cublas_api {
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasSgemm_v2) sgemm;
    decltype(&cublasDgemm_v2) dgemm;
    decltype(&cublasSgemmStridedBatched) sgemm_sb; // the KVSculpt solver's runs of equal-shaped problems
    decltype(&cublasDgemmStridedBatched) dgemm_sb;
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                              const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
    decltype(&cublasGetStatusString) status_string;
};
extern kvm_cublas_api kvm__cb;
// Loads cuBLAS once (thread-safe). 0, or KVM_EDEVICE naming dev and why it cannot be loaded.
int kvm__cublas_load(int dev);

// Makes dev current on the calling thread. 0 or KVM_EDEVICE.
int kvm__cuda_use(int dev);
// The calling thread's cuBLAS handle for dev (created on first use, bound to the per-thread
// stream; kept for the thread's life: destroying handles in thread-exit destructors can run
// after the CUDA context is gone at process exit), or NULL with kvm_errmsg set.
cublasHandle_t kvm__cublas(int dev);

static inline unsigned kvm__cuda_blocks(int64_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

// Launch wrappers (device pointers; dev already current). Return 0 or a kvm_status.
int kvm__cuda_rmsnorm(int dev, float *out, const float *x, const float *w, int64_t n_rows, int64_t dim, float eps);
int kvm__cuda_rope(int dev, float *x, int64_t n_rows, int64_t row_stride, int n_heads, int head_dim,
                   const float *cos_t, const float *sin_t, kvm_rope_style style);
int kvm__cuda_swiglu(int dev, float *gate, const float *up, int64_t n);
int kvm__cuda_add(int dev, float *x, const float *y, int64_t n);
// x[r][:] += b for r in [0, n_rows), width w (a projection's bias)
int kvm__cuda_add_rows(int dev, float *x, const float *b, int64_t n_rows, int64_t w);
// dst (bf16 or f16 per t) [n] from src float32 [n]
int kvm__cuda_convert(int dev, void *dst, kvm_cuda_wdtype t, const float *src, int64_t n);
// dst (dtype t) [rows][in] from raw ggml rows of `type` (device, kvm_qb_row_bytes(type, in) bytes
// each): the loader's dequantisation (kernels/kvm_quant_body.h) one element per thread, then
// rounded to t. KVM_ENOTSUP for a type kvmill cannot dequantise or rows not whole blocks.
int kvm__cuda_dequant(int dev, void *dst, kvm_cuda_wdtype t, const void *raw, int type, int64_t rows, int64_t in);
// One KV head's prefill eviction on the device (kvm_cuda_evict.cu): the pattern's scores from its
// query heads' statistics, the top-b selection in the CPU's order (kernels/kvm_evict_body.h),
// and the head's entries (positions 0..n−1 in order, as after a prefill) compacted in place to
// the b kept ones, in position order. Nothing when budget ≥ n. Device pointers; 0 or KVM_EDEVICE.
struct kvm__cuda_evict_head_args {
    int pattern;                  // kvm_pattern number: 0 streaming, 1 h2o, 2 tova, 3 snapkv, 4 pyramidkv
    int64_t n, budget;            // the head's entries and the budget (≥ 1)
    int64_t sinks, window, pool;  // kvm_evict_params
    double recent_frac;
    const float *mass, *obs;      // [n_group][ld], [n_group][n_obs][ld]: the head's group rows
    int64_t n_obs, ld;
    int n_group;
    float *k, *v, *bias;          // the head's cache [n][head_dim], [n]
    int32_t *pos;
    int head_dim;
    float *vote, *score, *k2, *v2, *bias2; // scratch [n], [n], [n][head_dim] ×2, [n]
    int32_t *pos2, *idx;                   // scratch [n]
    uint8_t *mark;                         // scratch [n]
};
int kvm__cuda_evict_head(int dev, const kvm__cuda_evict_head_args *a);
// The decode phase's eviction (kvm_cuda_decode_evict.cu; bodies kernels/kvm_evict_body.h), device
// pointers, dev current. seed: score[0, n) of a head from the prefill statistics of its entries'
// positions (mass [n_group][ld], obs [n_group][n_obs][ld], the last `rows` rows voting). score:
// one attention call of n_q queries added (mass: the group's MASS rows, [n_group][ld]).
int kvm__cuda_decode_seed(int dev, int pattern, const int32_t *pos, int64_t n, const float *mass, const float *obs,
                          int64_t n_obs, int64_t rows, int64_t ld, int n_group, float *score);
int kvm__cuda_decode_score(int dev, int pattern, int64_t window, int64_t n_q, const float *mass, int64_t ld,
                           int n_group, const int32_t *pos, int64_t n, float *score);
// victim: the entry a head of n entries over budget evicts, to host *victim (−1: none), through
// dev_victim (device, 1 int64); waits for the stream.
struct kvm__cuda_decode_victim_args {
    int pattern;                 // 0 streaming, 1 h2o, 2 tova, 3 snapkv, 4 pyramidkv
    int64_t n, budget, sinks, window, pool;
    double recent_frac;
    const int32_t *pos;          // [n]
    const float *score;          // [n] per-entry scores (H2O, SnapKV, PyramidKV)
    const float *obs;            // TOVA: the newest query's probabilities, [n_group][ld]
    int64_t ld;
    int n_group;
    float *raw, *pooled;         // scratch [n] each
};
int kvm__cuda_decode_victim(int dev, const kvm__cuda_decode_victim_args *a, int64_t *dev_victim, int64_t *victim);
// Y = X · Wᵀ with W device [out][in] in dtype t, X float32 [m][ldx], Y float32 [m][ldy]
int kvm__cuda_gemm_w(int dev, const float *x, int64_t m, int64_t ldx, const void *w, kvm_cuda_wdtype t, int64_t out,
                     int64_t in, float *y, int64_t ldy);
// The same, converting X into scratch (≥ m·in·2 bytes, device) instead of a pool buffer (NULL: pool)
int kvm__cuda_gemm_ws(int dev, const float *x, int64_t m, int64_t ldx, const void *w, kvm_cuda_wdtype t, int64_t out,
                      int64_t in, float *y, int64_t ldy, void *scratch);
// The same with X already in the weight dtype t (bf16/f16) [m][ldx]: cublasGemmEx alone
int kvm__cuda_gemm_half(int dev, const void *xh, int64_t m, int64_t ldx, const void *w, kvm_cuda_wdtype t, int64_t out,
                        int64_t in, float *y, int64_t ldy);

#endif
