// kvm_cuda_gemm.cu: the CUDA backend's GEMMs through cuBLAS. Row-major kvmill operands are read
// by column-major cuBLAS as their transposes (kernels/LAYOUT.md), so C = op(A)·op(B) row-major is
// Cᵀ = op(B)ᵀ·op(A)ᵀ column-major with the operands swapped and no copy. Weights in bf16/f16 go
// through cublasGemmEx with float32 accumulation (CUBLAS_COMPUTE_32F); activations are
// converted to the weight dtype in a stream-ordered scratch buffer first.
#include "kernels/cuda/kvm_cuda_impl.h"

extern "C" int kvm__cuda_sgemm_dev(int dev, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                                   const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                                   int64_t ldc);

static int too_big(int dev, int64_t m, int64_t n, int64_t k)
{
    if (m < 0 || n < 0 || k < 0 || m > 0x7fffffff || n > 0x7fffffff || k > 0x7fffffff)
        return kvm_err(KVM_EINVAL, "cuda:%d: sgemm: size m=%lld n=%lld k=%lld outside [0, 2^31)", dev, (long long)m,
                       (long long)n, (long long)k);
    return 0;
}

int kvm__cuda_sgemm_dev(int dev, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc)
{
    int rc = too_big(dev, m, n, k);
    if (rc || m == 0 || n == 0) return rc;
    if ((rc = kvm__cuda_use(dev))) return rc;
    cublasHandle_t h = kvm__cublas(dev);
    if (!h) return KVM_EDEVICE;
    // row-major C[m][n] = op(A) op(B)  <=>  column-major Cᵀ[n][m] = op(B)ᵀ op(A)ᵀ
    KVM_CUBLAS(dev, kvm__cb.sgemm(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n,
                                (int)m, (int)k, &alpha, b, (int)ldb, a, (int)lda, &beta, c, (int)ldc));
    return 0;
}

int kvm__cuda_gemm_w(int dev, const float *x, int64_t m, int64_t ldx, const void *w, kvm_cuda_wdtype t, int64_t out,
                     int64_t in, float *y, int64_t ldy)
{
    return kvm__cuda_gemm_ws(dev, x, m, ldx, w, t, out, in, y, ldy, NULL);
}

int kvm__cuda_gemm_ws(int dev, const float *x, int64_t m, int64_t ldx, const void *w, kvm_cuda_wdtype t, int64_t out,
                      int64_t in, float *y, int64_t ldy, void *scratch)
{
    int rc = too_big(dev, m, out, in);
    if (rc || m == 0 || out == 0) return rc;
    if (t == KVM_CUDA_F32)
        return kvm__cuda_sgemm_dev(dev, 0, 1, m, out, in, 1.0f, x, ldx, (const float *)w, in, 0.0f, y, ldy);
    // X → weight dtype, packed [m][in], in the caller's scratch or a stream-ordered buffer
    void *xb = scratch;
    size_t bytes = (size_t)m * (size_t)in * 2;
    if (!xb) KVM_CU(dev, cudaMallocAsync(&xb, bytes, cudaStreamPerThread));
    rc = 0;
    if (ldx == in) rc = kvm__cuda_convert(dev, xb, t, x, m * in);
    else
        for (int64_t r = 0; r < m && !rc; r++)
            rc = kvm__cuda_convert(dev, (char *)xb + (size_t)r * (size_t)in * 2, t, x + r * ldx, in);
    if (!rc) rc = kvm__cuda_gemm_half(dev, xb, m, in, w, t, out, in, y, ldy);
    cudaError_t fe = scratch ? cudaSuccess : cudaFreeAsync(xb, cudaStreamPerThread);
    if (rc) return rc;
    if (fe != cudaSuccess) return kvm__cuda_fail(dev, "cudaFreeAsync", fe);
    return 0;
}

int kvm__cuda_gemm_half(int dev, const void *xh, int64_t m, int64_t ldx, const void *w, kvm_cuda_wdtype t, int64_t out,
                        int64_t in, float *y, int64_t ldy)
{
    cublasHandle_t h = kvm__cublas(dev);
    if (!h) return KVM_EDEVICE;
    const float one = 1.0f, zero = 0.0f;
    cudaDataType dt = t == KVM_CUDA_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    // column-major Yᵀ[out][m] = W(col-major [in][out])ᵀ · Xᵀ(col-major [in][m])
    KVM_CUBLAS(dev, kvm__cb.gemm_ex(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)m, (int)in, &one, w, dt, (int)in, xh, dt,
                                 (int)ldx, &zero, y, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return 0;
}
