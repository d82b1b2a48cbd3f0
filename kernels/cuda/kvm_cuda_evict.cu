// kvm_cuda_evict.cu: the prefill-phase eviction of one KV head on the GPU (issue 13): the
// pattern's per-key scores from the attention kernel's statistics (MASS, OBS rows; layouts of
// kvm_cuda_attention_layer), one thread per key; the keys whose rank in the top-b order is below
// the number to choose (kvm_eb_rank: the CPU's sort order, ties to the earlier key); then the
// head's entries compacted to the kept ones in position order. The math is
// kernels/kvm_evict_body.h, the bodies the CPU selection (compress/evict/) runs.
#include "kernels/cuda/kvm_cuda_impl.h"

extern "C" {
#include "kernels/kvm_evict_body.h"
}

enum { EV_THREADS = 256 };

// vote[j] for j in [0, m): H2O's mass, TOVA's last-query average, SnapKV's summed window votes
__global__ void k_evict_vote(int pattern, const float *mass, const float *obs, int64_t n_obs, int64_t rows,
                             int64_t ld, int n_group, int64_t m, float *vote)
{
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= m) return;
    vote[j] = pattern == 1   ? kvm_eb_h2o(mass, ld, n_group, j)
              : pattern == 2 ? kvm_eb_tova(obs, n_obs, ld, n_group, j)
                             : kvm_eb_snap_vote(obs, n_obs, rows, ld, n_group, j);
}

__global__ void k_evict_pool(const float *vote, int64_t m, int64_t half, float *score)
{
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < m) score[j] = kvm_eb_pool(vote, m, half, j);
}

// keep[j] = 1 for the k candidates first in the top-b order (StreamingLLM: score NULL, the first k)
__global__ void k_evict_mark(const float *score, int64_t m, int64_t k, uint8_t *keep)
{
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < m) keep[j] = score ? kvm_eb_rank(score, m, j) < k : j < k;
}

// idx[0, k) = the marked candidates in increasing order, then the tail [tail0, n): one thread,
// O(n) (a head holds at most the context; the gather is parallel)
__global__ void k_evict_index(const uint8_t *keep, int64_t m, int64_t tail0, int64_t n, int32_t *idx)
{
    int64_t c = 0;
    for (int64_t j = 0; j < m; j++)
        if (keep[j]) idx[c++] = (int32_t)j;
    for (int64_t j = tail0; j < n; j++) idx[c++] = (int32_t)j;
}

// dst entry e = src entry idx[e]: d floats of k and v, the position and β
__global__ void k_evict_gather(const int32_t *idx, int64_t b, int d, const float *k, const float *v, const int32_t *pos,
                               const float *bias, float *k2, float *v2, int32_t *pos2, float *bias2)
{
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= b * d) return;
    const int64_t e = t / d, i = t % d, s = idx[e];
    k2[t] = k[s * d + i];
    v2[t] = v[s * d + i];
    if (i == 0) pos2[e] = pos[s], bias2[e] = bias[s];
}

int kvm__cuda_evict_head(int dev, const kvm__cuda_evict_head_args *a)
{
    const int64_t n = a->n, b = a->budget;
    if (b >= n) return 0;
    int64_t m, tail0, k;
    if (a->pattern == 0) { // StreamingLLM: the sinks, then the most recent b − sinks
        m = k = a->sinks < b ? a->sinks : b;
        tail0 = n - (b - k);
    } else {
        kvm_eb_zones(a->pattern, a->recent_frac, a->window, n, b, &m, &tail0, &k);
    }
    const float *score = NULL;
    if (a->pattern != 0 && m > 0) {
        const int64_t rows = a->window < a->n_obs ? a->window : a->n_obs;
        const unsigned blocks = kvm__cuda_blocks(m, EV_THREADS);
        k_evict_vote<<<blocks, EV_THREADS, 0, cudaStreamPerThread>>>(a->pattern, a->mass, a->obs, a->n_obs, rows,
                                                                      a->ld, a->n_group, m, a->vote);
        KVM_CU_LAUNCHED(dev, "k_evict_vote");
        score = a->vote;
        if (a->pattern == 3 || a->pattern == 4) {
            k_evict_pool<<<blocks, EV_THREADS, 0, cudaStreamPerThread>>>(a->vote, m, (a->pool > 1 ? a->pool : 1) / 2,
                                                                          a->score);
            KVM_CU_LAUNCHED(dev, "k_evict_pool");
            score = a->score;
        }
    }
    if (m > 0) {
        k_evict_mark<<<kvm__cuda_blocks(m, EV_THREADS), EV_THREADS, 0, cudaStreamPerThread>>>(score, m, k, a->mark);
        KVM_CU_LAUNCHED(dev, "k_evict_mark");
    }
    k_evict_index<<<1, 1, 0, cudaStreamPerThread>>>(a->mark, m, tail0, n, a->idx);
    KVM_CU_LAUNCHED(dev, "k_evict_index");
    const int d = a->head_dim;
    k_evict_gather<<<kvm__cuda_blocks(b * d, EV_THREADS), EV_THREADS, 0, cudaStreamPerThread>>>(
        a->idx, b, d, a->k, a->v, a->pos, a->bias, a->k2, a->v2, a->pos2, a->bias2);
    KVM_CU_LAUNCHED(dev, "k_evict_gather");
    const size_t kv_b = (size_t)b * d * sizeof(float), e_b = (size_t)b * 4;
    KVM_CU(dev, cudaMemcpyAsync(a->k, a->k2, kv_b, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    KVM_CU(dev, cudaMemcpyAsync(a->v, a->v2, kv_b, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    KVM_CU(dev, cudaMemcpyAsync(a->pos, a->pos2, e_b, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    KVM_CU(dev, cudaMemcpyAsync(a->bias, a->bias2, e_b, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    return 0;
}
