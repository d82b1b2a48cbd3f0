// kvm_cuda_attn.cu: attention on the GPU over a ragged, position-sorted KV cache (GQA, causal by
// position, KVM_POS_NONE entries visible to all, per-entry logit bias β). Prefill: a block of
// QT queries of one head walks the entries visible to its last query in tiles of ET entries
// staged in shared memory; each thread keeps its query's online-softmax state and output
// accumulator (kvm_fb_attn_tile), so no n_q × n_e matrix exists. Decode (n_q ≤ 4): one block
// per (query, head) splits the entries over its threads and merges their partial states in
// shared memory (kvm_fb_online_merge, flash-decoding). Statistics and the per-head table call's
// probabilities come from a second pass that recomputes each score against its row's LSE.
#include "kernels/cuda/kvm_cuda_impl.h"

extern "C" {
#include "kernels/kvm_forward_body.h"
}

namespace {

enum { QT = 64, DECODE_QMAX = 4 };

struct kv_head {
    const float *k, *v, *bias; // bias NULL: all zero
    const int32_t *pos;
    int64_t n_e;
};

// passed by value (≈1.4 KB of kernel parameters): the per-KV-head device pointers
struct attn_p {
    const float *q;
    int64_t ldq;
    const int32_t *qpos;
    int64_t n_q;
    int n_heads, kv_mul, d;
    float scale;
    kv_head kv[KVM_CUDA_MAX_KV_HEADS];
    float *out;
    int64_t ldo;
    float *mass, *entropy, *lse, *obs, *probs; // probs [n_q][ld_e] (the per-head table call)
    int32_t mass_p0, mass_p1;
    int64_t n_obs, ld_e;
};

template <int MAXD> struct tile_entries { static constexpr int value = MAXD > 128 ? 16 : 32; };

// The entry count visible to the block's last query (queries sorted by position within a block
// is not assumed: the maximum over the block's threads).
__device__ inline int64_t block_end(int64_t vis, bool active)
{
    __shared__ unsigned long long e_end;
    if (threadIdx.x == 0) e_end = 0;
    __syncthreads();
    if (active) atomicMax(&e_end, (unsigned long long)vis);
    __syncthreads();
    return (int64_t)e_end;
}

template <int MAXD> __global__ void k_attn_prefill(attn_p p)
{
    constexpr int ET = tile_entries<MAXD>::value;
    __shared__ float ks[ET * MAXD], vs[ET * MAXD], bs[ET];
    const int h = blockIdx.y, g = h / p.kv_mul, d = p.d;
    const int64_t i = (int64_t)blockIdx.x * QT + threadIdx.x;
    const bool active = i < p.n_q;
    const kv_head &kh = p.kv[g];
    const int64_t ne = kh.n_e;
    const float *K = kh.k, *V = kh.v, *B = kh.bias;
    const int32_t *pos = kh.pos;
    float q[MAXD], acc[MAXD], s[ET];
    int64_t vis = 0;
    if (active) {
        for (int c = 0; c < d; c++) q[c] = p.q[i * p.ldq + (int64_t)h * d + c], acc[c] = 0.0f;
        vis = kvm_fb_visible(pos, ne, p.qpos[i]);
    }
    const int64_t e_end = block_end(vis, active);
    kvm_fb_online st = {-INFINITY, 0.0f};
    for (int64_t e0 = 0; e0 < e_end; e0 += ET) {
        const int nt = (int)(e_end - e0 < ET ? e_end - e0 : ET);
        for (int x = threadIdx.x; x < nt * d; x += blockDim.x) ks[x] = K[e0 * d + x], vs[x] = V[e0 * d + x];
        for (int x = threadIdx.x; x < nt; x += blockDim.x) bs[x] = B ? B[e0 + x] : 0.0f;
        __syncthreads();
        if (active) {
            int64_t nv = vis - e0;
            nv = nv < 0 ? 0 : nv > nt ? nt : nv;
            kvm_fb_attn_tile(q, p.scale, ks, vs, B ? bs : NULL, (int)nv, d, s, &st, acc);
        }
        __syncthreads();
    }
    if (!active) return;
    const float inv = kvm_fb_online_inv(&st);
    for (int c = 0; c < d; c++) p.out[i * p.ldo + (int64_t)h * d + c] = acc[c] * inv;
    if (p.lse) p.lse[(int64_t)h * p.n_q + i] = st.l > 0 ? st.m + logf(st.l) : -INFINITY;
}

// one block of T threads per (query, head): thread t takes entries t, t + T, ...; partial states
// merged pairwise in shared memory (T·MAXD floats of accumulators)
template <int MAXD, int T> __global__ void k_attn_decode(attn_p p)
{
    __shared__ float accs[T * MAXD];
    __shared__ kvm_fb_online sts[T];
    const int64_t i = blockIdx.x;
    const int h = blockIdx.y, g = h / p.kv_mul, d = p.d, t = threadIdx.x;
    const kv_head &kh = p.kv[g];
    const int64_t ne = kh.n_e;
    const float *K = kh.k, *V = kh.v, *B = kh.bias;
    const int32_t *pos = kh.pos;
    float q[MAXD], *acc = accs + t * MAXD, s[1];
    for (int c = 0; c < d; c++) q[c] = p.q[i * p.ldq + (int64_t)h * d + c], acc[c] = 0.0f;
    const int64_t vis = kvm_fb_visible(pos, ne, p.qpos[i]);
    kvm_fb_online st = {-INFINITY, 0.0f};
    for (int64_t e = t; e < vis; e += T)
        kvm_fb_attn_tile(q, p.scale, K + e * d, V + e * d, B ? B + e : NULL, 1, d, s, &st, acc);
    sts[t] = st;
    __syncthreads();
    for (int stride = T / 2; stride > 0; stride /= 2) {
        if (t < stride) kvm_fb_online_merge(&sts[t], acc, &sts[t + stride], accs + (t + stride) * MAXD, d);
        __syncthreads();
    }
    if (t == 0) {
        const float inv = kvm_fb_online_inv(&sts[0]);
        for (int c = 0; c < d; c++) p.out[i * p.ldo + (int64_t)h * d + c] = accs[c] * inv;
        if (p.lse) p.lse[(int64_t)h * p.n_q + i] = sts[0].l > 0 ? sts[0].m + logf(sts[0].l) : -INFINITY;
    }
}

// statistics pass: thread per (query, head), scores recomputed against the row's LSE
template <int MAXD> __global__ void k_attn_stats(attn_p p)
{
    const int h = blockIdx.y, g = h / p.kv_mul, d = p.d;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n_q) return;
    const kv_head &kh = p.kv[g];
    const int64_t ne = kh.n_e;
    const float *K = kh.k, *B = kh.bias;
    const int32_t *pos = kh.pos;
    float q[MAXD];
    for (int c = 0; c < d; c++) q[c] = p.q[i * p.ldq + (int64_t)h * d + c];
    const int64_t vis = kvm_fb_visible(pos, ne, p.qpos[i]);
    const float lse = p.lse[(int64_t)h * p.n_q + i];
    const bool in_win = p.mass && p.qpos[i] >= p.mass_p0 && p.qpos[i] < p.mass_p1;
    float *obs = p.obs && i >= p.n_q - p.n_obs ? p.obs + ((int64_t)h * p.n_obs + (i - (p.n_q - p.n_obs))) * p.ld_e : NULL;
    double z = 0.0, xt = 0.0; // the entropy's sums with the row's LSE as reference (kvm_fb_entropy_finish)
    for (int64_t e = 0; e < vis; e++) {
        const float sc = kvm_fb_score(q, K + e * d, p.scale, B ? B[e] : 0.0f, d), pr = kvm_fb_prob(sc, lse);
        z += pr;
        xt += kvm_fb_entropy_acc(pr, sc - lse);
        if (in_win) atomicAdd(&p.mass[(int64_t)h * p.ld_e + e], pr);
        if (obs) obs[e] = pr;
        if (p.probs) p.probs[i * p.ld_e + e] = pr;
    }
    if (p.entropy) p.entropy[(int64_t)h * p.n_q + i] = kvm_fb_entropy_finish(z, xt);
}

template <int MAXD> int launch(int dev, const attn_p &p)
{
    if (p.n_q <= DECODE_QMAX) {
        constexpr int T = MAXD > 128 ? 32 : 64;
        k_attn_decode<MAXD, T><<<dim3((unsigned)p.n_q, (unsigned)p.n_heads), T, 0, cudaStreamPerThread>>>(p);
    } else {
        k_attn_prefill<MAXD><<<dim3(kvm__cuda_blocks(p.n_q, QT), (unsigned)p.n_heads), QT, 0, cudaStreamPerThread>>>(p);
    }
    KVM_CU_LAUNCHED(dev, "k_attn");
    if (p.entropy || p.mass || p.obs || p.probs) {
        k_attn_stats<MAXD><<<dim3(kvm__cuda_blocks(p.n_q, QT), (unsigned)p.n_heads), QT, 0, cudaStreamPerThread>>>(p);
        KVM_CU_LAUNCHED(dev, "k_attn_stats");
    }
    return 0;
}

int run(int dev, attn_p p)
{
    if (p.d <= 0 || p.d > KVM_CUDA_MAX_HEAD_DIM)
        return kvm_err(KVM_EINVAL, "cuda:%d: attention: head_dim %d outside [1, %d]", dev, p.d, KVM_CUDA_MAX_HEAD_DIM);
    if (p.n_q < 0 || p.n_q > 0x7fffffff || p.n_heads <= 0 || p.kv_mul <= 0)
        return kvm_err(KVM_EINVAL, "cuda:%d: attention: bad sizes n_q=%lld n_heads=%d", dev, (long long)p.n_q,
                       p.n_heads);
    if (p.n_q == 0) return 0;
    int rc = kvm__cuda_use(dev);
    if (rc) return rc;
    const bool need_lse = p.entropy || p.mass || p.obs || p.probs;
    float *lse_tmp = NULL;
    if (need_lse && !p.lse) {
        KVM_CU(dev, cudaMallocAsync((void **)&lse_tmp, (size_t)p.n_heads * (size_t)p.n_q * sizeof(float),
                                    cudaStreamPerThread));
        p.lse = lse_tmp;
    }
    const size_t row = (size_t)p.ld_e * sizeof(float);
    if (p.mass) KVM_CU(dev, cudaMemsetAsync(p.mass, 0, (size_t)p.n_heads * row, cudaStreamPerThread));
    if (p.obs) KVM_CU(dev, cudaMemsetAsync(p.obs, 0, (size_t)p.n_heads * (size_t)p.n_obs * row, cudaStreamPerThread));
    if (p.probs) KVM_CU(dev, cudaMemsetAsync(p.probs, 0, (size_t)p.n_q * row, cudaStreamPerThread));
    rc = p.d <= 32 ? launch<32>(dev, p) : p.d <= 64 ? launch<64>(dev, p) : p.d <= 128 ? launch<128>(dev, p)
                                                                                      : launch<256>(dev, p);
    if (lse_tmp) {
        cudaError_t e = cudaFreeAsync(lse_tmp, cudaStreamPerThread);
        if (!rc && e != cudaSuccess) rc = kvm__cuda_fail(dev, "cudaFreeAsync", e);
    }
    return rc;
}

} // namespace

extern "C" int kvm_cuda_attention_layer(int device, const kvm_cuda_attn_layer *a)
{
    if (a->n_kv_heads <= 0 || a->n_kv_heads > KVM_CUDA_MAX_KV_HEADS || a->n_heads <= 0 || a->n_heads % a->n_kv_heads)
        return kvm_err(KVM_EINVAL, "cuda:%d: attention: %d query heads over %d KV heads (at most %d)", device,
                       a->n_heads, a->n_kv_heads, KVM_CUDA_MAX_KV_HEADS);
    const unsigned st = a->stats;
    if (((st & KVM_CUDA_STAT_MASS) && !a->mass) || ((st & KVM_CUDA_STAT_ENTROPY) && !a->entropy) ||
        ((st & KVM_CUDA_STAT_LSE) && !a->lse) || ((st & KVM_CUDA_STAT_OBS) && !a->obs))
        return kvm_err(KVM_EINVAL, "cuda:%d: attention: statistics 0x%x asked without their buffers", device, st);
    if ((st & KVM_CUDA_STAT_OBS) && (a->n_obs < 1 || a->n_obs > a->n_q))
        return kvm_err(KVM_EINVAL, "cuda:%d: attention: n_obs %lld outside [1, n_q = %lld]", device,
                       (long long)a->n_obs, (long long)a->n_q);
    attn_p p = {};
    for (int g = 0; g < a->n_kv_heads; g++) {
        if (a->n_e[g] < 0 || ((st & (KVM_CUDA_STAT_MASS | KVM_CUDA_STAT_OBS)) && a->n_e[g] > a->ld_e))
            return kvm_err(KVM_EINVAL, "cuda:%d: attention: KV head %d has %lld entries (ld_e %lld)", device, g,
                           (long long)a->n_e[g], (long long)a->ld_e);
        p.kv[g] = kv_head{a->k[g], a->v[g], a->bias ? a->bias[g] : NULL, a->pos[g], a->n_e[g]};
    }
    p.q = a->q;
    p.ldq = a->ldq;
    p.qpos = a->qpos;
    p.n_q = a->n_q;
    p.n_heads = a->n_heads;
    p.kv_mul = a->n_heads / a->n_kv_heads;
    p.d = a->head_dim;
    p.scale = a->scale;
    p.out = a->out;
    p.ldo = a->ldo;
    p.lse = st & KVM_CUDA_STAT_LSE ? a->lse : NULL;
    p.entropy = st & KVM_CUDA_STAT_ENTROPY ? a->entropy : NULL;
    p.mass = st & KVM_CUDA_STAT_MASS ? a->mass : NULL;
    p.obs = st & KVM_CUDA_STAT_OBS ? a->obs : NULL;
    p.mass_p0 = a->mass_p0;
    p.mass_p1 = a->mass_p1;
    p.n_obs = a->n_obs;
    p.ld_e = a->ld_e;
    return run(device, p);
}
