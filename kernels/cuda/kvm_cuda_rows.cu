// kvm_cuda_rows.cu: the CUDA launches of the forward's row and element kernels (RMSNorm, RoPE,
// SwiGLU, residual add, bias rows, embedding, dtype conversion, GGUF dequantisation, random
// fill). The math is kernels/kvm_forward_body.h and kernels/kvm_quant_body.h, the same inline
// bodies the CPU backend and loader run; here a grid covers the rows (one block per row for
// RMSNorm's reduction) or the elements.
#include "kernels/cuda/kvm_cuda_impl.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" {
#include "kernels/kvm_forward_body.h"
#include "kernels/kvm_quant_body.h"
}

enum { ROW_THREADS = 256, ELEM_THREADS = 256 };

// one block per row: the sum of squares reduced in shared memory, then w ⊙ (inv · x)
__global__ void k_rmsnorm(float *out, const float *x, const float *w, int64_t dim, float eps)
{
    __shared__ float part[ROW_THREADS];
    const float *xr = x + blockIdx.x * dim;
    float *o = out + blockIdx.x * dim;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    part[threadIdx.x] = ss;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    float inv = kvm_fb_rms_inv(part[0], dim, eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = kvm_fb_rms_elem(w[i], inv, xr[i]);
}

int kvm__cuda_rmsnorm(int dev, float *out, const float *x, const float *w, int64_t n_rows, int64_t dim, float eps)
{
    if (n_rows <= 0) return 0;
    if (n_rows > 0x7fffffff) return kvm_err(KVM_EINVAL, "cuda:%d: rmsnorm: %lld rows", dev, (long long)n_rows);
    k_rmsnorm<<<(unsigned)n_rows, ROW_THREADS, 0, cudaStreamPerThread>>>(out, x, w, dim, eps);
    KVM_CU_LAUNCHED(dev, "k_rmsnorm");
    return 0;
}

// one thread per (row, head, pair)
__global__ void k_rope(float *x, int64_t n_rows, int64_t row_stride, int n_heads, int head_dim, const float *cos_t,
                       const float *sin_t, int half_style)
{
    const int half = head_dim / 2;
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_rows * n_heads * half) return;
    int i = (int)(t % half);
    int64_t rh = t / half, r = rh / n_heads;
    int h = (int)(rh % n_heads);
    kvm_fb_rope_pair(x + r * row_stride + (int64_t)h * head_dim, i, half, half_style, cos_t[r * half + i],
                     sin_t[r * half + i]);
}

int kvm__cuda_rope(int dev, float *x, int64_t n_rows, int64_t row_stride, int n_heads, int head_dim,
                   const float *cos_t, const float *sin_t, kvm_rope_style style)
{
    int64_t n = n_rows * n_heads * (head_dim / 2);
    if (n <= 0) return 0;
    k_rope<<<kvm__cuda_blocks(n, ELEM_THREADS), ELEM_THREADS, 0, cudaStreamPerThread>>>(
        x, n_rows, row_stride, n_heads, head_dim, cos_t, sin_t, style == KVM_ROPE_HALF);
    KVM_CU_LAUNCHED(dev, "k_rope");
    return 0;
}

__global__ void k_swiglu(float *gate, const float *up, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = kvm_fb_swiglu(gate[i], up[i]);
}

int kvm__cuda_swiglu(int dev, float *gate, const float *up, int64_t n)
{
    if (n <= 0) return 0;
    k_swiglu<<<kvm__cuda_blocks(n, ELEM_THREADS), ELEM_THREADS, 0, cudaStreamPerThread>>>(gate, up, n);
    KVM_CU_LAUNCHED(dev, "k_swiglu");
    return 0;
}

// x[i] += y[i % w] (w = n for a plain residual add, the row width for a bias)
__global__ void k_add(float *x, const float *y, int64_t n, int64_t w)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = kvm_fb_add(x[i], y[i % w]);
}

int kvm__cuda_add(int dev, float *x, const float *y, int64_t n)
{
    if (n <= 0) return 0;
    k_add<<<kvm__cuda_blocks(n, ELEM_THREADS), ELEM_THREADS, 0, cudaStreamPerThread>>>(x, y, n, n);
    KVM_CU_LAUNCHED(dev, "k_add");
    return 0;
}

int kvm__cuda_add_rows(int dev, float *x, const float *b, int64_t n_rows, int64_t w)
{
    int64_t n = n_rows * w;
    if (n <= 0) return 0;
    k_add<<<kvm__cuda_blocks(n, ELEM_THREADS), ELEM_THREADS, 0, cudaStreamPerThread>>>(x, b, n, w);
    KVM_CU_LAUNCHED(dev, "k_add");
    return 0;
}

__global__ void k_embed(float *out, const float *table, const int32_t *tok, int64_t n, int64_t dim)
{
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * dim) return;
    int64_t r = t / dim, i = t % dim;
    out[t] = table[(int64_t)tok[r] * dim + i]; /* kvm_fb_embed_row, one element per thread */
}

extern "C" int kvm_cuda_embed(int device, float *out, const float *table, const int32_t *tok, int64_t n, int64_t dim)
{
    int rc = kvm__cuda_use(device);
    if (rc || n * dim <= 0) return rc;
    k_embed<<<kvm__cuda_blocks(n * dim, ELEM_THREADS), ELEM_THREADS, 0, cudaStreamPerThread>>>(out, table, tok, n, dim);
    KVM_CU_LAUNCHED(device, "k_embed");
    return 0;
}

__global__ void k_to_bf16(__nv_bfloat16 *d, const float *s, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] = __float2bfloat16_rn(s[i]);
}

__global__ void k_to_f16(__half *d, const float *s, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] = __float2half_rn(s[i]);
}

int kvm__cuda_convert(int dev, void *dst, kvm_cuda_wdtype t, const float *src, int64_t n)
{
    if (n <= 0) return 0;
    unsigned b = kvm__cuda_blocks(n, ELEM_THREADS);
    if (t == KVM_CUDA_BF16) k_to_bf16<<<b, ELEM_THREADS, 0, cudaStreamPerThread>>>((__nv_bfloat16 *)dst, src, n);
    else if (t == KVM_CUDA_F16) k_to_f16<<<b, ELEM_THREADS, 0, cudaStreamPerThread>>>((__half *)dst, src, n);
    else KVM_CU(dev, cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    KVM_CU_LAUNCHED(dev, "k_convert");
    return 0;
}

// one thread per element of a [rows][in] matrix of raw ggml rows (kvm_qb_row_bytes each): the
// loader's float (kvm_qb_row_elem), stored as t rounds it (bf16/f16: to nearest even, as
// k_to_bf16/k_to_f16)
__global__ void k_dequant(void *dst, int t, const uint8_t *raw, int type, int64_t rows, int64_t in, int64_t row_bytes)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * in) return;
    float v = kvm_qb_row_elem(type, raw + i / in * row_bytes, i % in);
    if (t == KVM_CUDA_BF16) ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(v);
    else if (t == KVM_CUDA_F16) ((__half *)dst)[i] = __float2half_rn(v);
    else ((float *)dst)[i] = v;
}

int kvm__cuda_dequant(int dev, void *dst, kvm_cuda_wdtype t, const void *raw, int type, int64_t rows, int64_t in)
{
    const int64_t be = kvm_qb_block_elems(type);
    if (!be || in % be)
        return kvm_err(KVM_ENOTSUP, "cuda:%d: weights of ggml type %d with rows of %lld cannot be dequantised", dev,
                       type, (long long)in);
    if (rows * in <= 0) return 0;
    k_dequant<<<kvm__cuda_blocks(rows * in, ELEM_THREADS), ELEM_THREADS, 0, cudaStreamPerThread>>>(
        dst, (int)t, (const uint8_t *)raw, type, rows, in, kvm_qb_row_bytes(type, in));
    KVM_CU_LAUNCHED(dev, "k_dequant");
    return 0;
}

extern "C" int kvm_cuda_dequantize(int device, float *dst, const void *raw, int type, int64_t rows, int64_t in)
{
    const int64_t rb = kvm_qb_row_bytes(type, in);
    if (!rb || in % kvm_qb_block_elems(type) || rows < 0)
        return kvm_err(KVM_ENOTSUP, "cuda:%d: dequantize: ggml type %d, %lld rows of %lld elements", device, type,
                       (long long)rows, (long long)in);
    int rc = kvm__cuda_use(device);
    if (rc || rows == 0) return rc;
    void *draw = NULL, *dout = NULL;
    const size_t raw_b = (size_t)(rows * rb), out_b = (size_t)(rows * in) * 4;
    cudaError_t e = cudaMalloc(&draw, raw_b);
    if (e == cudaSuccess) e = cudaMalloc(&dout, out_b);
    if (e != cudaSuccess) rc = kvm__cuda_fail(device, "cudaMalloc", e);
    if (!rc && (e = cudaMemcpyAsync(draw, raw, raw_b, cudaMemcpyHostToDevice, cudaStreamPerThread)) != cudaSuccess)
        rc = kvm__cuda_fail(device, "cudaMemcpyAsync", e);
    if (!rc) rc = kvm__cuda_dequant(device, dout, KVM_CUDA_F32, draw, type, rows, in);
    if (!rc && ((e = cudaMemcpyAsync(dst, dout, out_b, cudaMemcpyDeviceToHost, cudaStreamPerThread)) != cudaSuccess ||
                (e = cudaStreamSynchronize(cudaStreamPerThread)) != cudaSuccess))
        rc = kvm__cuda_fail(device, "cudaMemcpyAsync(dequantized)", e);
    if (draw) cudaFree(draw);
    if (dout) cudaFree(dout);
    return rc;
}

// splitmix64 of (seed, index): a counter-based generator, so any device makes the same tensor
__device__ static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

__global__ void k_fill_uniform(float *x, int64_t n, uint64_t seed, float a)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ULL + (uint64_t)i);
    float u = (float)(r >> 40) * (1.0f / 16777216.0f); /* [0, 1) with 24 bits */
    x[i] = (2.0f * u - 1.0f) * a;
}

extern "C" int kvm_cuda_fill_uniform(int device, float *x, int64_t n, uint64_t seed, float a)
{
    int rc = kvm__cuda_use(device);
    if (rc || n <= 0) return rc;
    k_fill_uniform<<<kvm__cuda_blocks(n, ELEM_THREADS), ELEM_THREADS, 0, cudaStreamPerThread>>>(x, n, seed, a);
    KVM_CU_LAUNCHED(device, "k_fill_uniform");
    return 0;
}
