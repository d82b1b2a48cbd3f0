// kvm_cuda_decode_evict.cu: the decode phase of the eviction patterns on the GPU (issue 13), as
// compress/evict/kvm_evict_decode.c's policy does it on the CPU: each scored KV head keeps one
// score per cache entry (the CPU keeps them by position; tests/check_evict_body.c shows the two
// bookkeepings evict the same entries), seeded from the prefill's statistics, updated after every
// attention call from the kernel's MASS, and read when the head is over its budget to choose one
// victim. The math is kernels/kvm_evict_body.h, the bodies the CPU policy runs.
#include "kernels/cuda/kvm_cuda_impl.h"

extern "C" {
#include "kernels/kvm_evict_body.h"
}

enum { DE_THREADS = 256 };

// score[e] from the prefill statistics of position pos[e] (a prefill's entry index): H2O the
// group's received mass, SnapKV/PyramidKV the last `rows` observation rows' votes; 0 for a
// distilled entry or an unscored pattern
__global__ void k_decode_seed(int pattern, const int32_t *pos, int64_t n, const float *mass, const float *obs,
                              int64_t n_obs, int64_t rows, int64_t ld, int n_group, float *score)
{
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const int32_t p = pos[e];
    score[e] = p < 0                       ? 0.0f
               : pattern == 1              ? kvm_eb_h2o(mass, ld, n_group, p)
               : pattern == 3 || pattern == 4 ? kvm_eb_snap_vote(obs, n_obs, rows, ld, n_group, p)
                                           : 0.0f;
}

// one attention call's update of every positioned entry's score (kvm_eb_decode_score)
__global__ void k_decode_score(int pattern, int64_t window, int64_t n_q, const float *mass, int64_t ld, int n_group,
                               const int32_t *pos, int64_t n, float *score)
{
    int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < n && pos[e] != KVM_POS_NONE)
        score[e] = kvm_eb_decode_score(score[e], pattern, window, n_q, mass, ld, n_group, e);
}

// the victim of one head (one thread: O(n · pool), a head holds its budget plus the batch), as
// kvm_evict_decode.c's victim(): distilled entries first are never chosen; StreamingLLM the
// oldest after the sinks; otherwise the lowest (pooled) score among the positioned entries
// before the protected recent ones. *victim = −1 when the head holds no positioned entry.
__global__ void k_decode_victim(kvm__cuda_decode_victim_args a, int64_t *victim)
{
    int64_t first = 0;
    while (first < a.n && a.pos[first] == KVM_POS_NONE) first++;
    const int64_t npos = a.n - first;
    if (npos <= 0) {
        *victim = -1;
        return;
    }
    if (a.pattern == 0) {
        *victim = first + a.sinks < a.n ? first + a.sinks : first;
        return;
    }
    const int64_t prot = kvm_eb_decode_protected(a.pattern, a.recent_frac, a.window, a.budget);
    if (prot >= npos) {
        *victim = first;
        return;
    }
    const int64_t m = npos - prot;
    for (int64_t i = 0; i < m; i++)
        a.raw[i] = a.pattern == 2 ? kvm_eb_tova(a.obs, 1, a.ld, a.n_group, first + i) : a.score[first + i];
    const float *s = a.raw;
    if (a.pattern == 3 || a.pattern == 4) {
        for (int64_t i = 0; i < m; i++) a.pooled[i] = kvm_eb_pool(a.raw, m, a.pool / 2, i);
        s = a.pooled;
    }
    *victim = first + kvm_eb_victim(s, m);
}

int kvm__cuda_decode_seed(int dev, int pattern, const int32_t *pos, int64_t n, const float *mass, const float *obs,
                          int64_t n_obs, int64_t rows, int64_t ld, int n_group, float *score)
{
    if (n <= 0) return 0;
    k_decode_seed<<<kvm__cuda_blocks(n, DE_THREADS), DE_THREADS, 0, cudaStreamPerThread>>>(
        pattern, pos, n, mass, obs, n_obs, rows, ld, n_group, score);
    KVM_CU_LAUNCHED(dev, "k_decode_seed");
    return 0;
}

int kvm__cuda_decode_score(int dev, int pattern, int64_t window, int64_t n_q, const float *mass, int64_t ld,
                           int n_group, const int32_t *pos, int64_t n, float *score)
{
    if (n <= 0) return 0;
    k_decode_score<<<kvm__cuda_blocks(n, DE_THREADS), DE_THREADS, 0, cudaStreamPerThread>>>(
        pattern, window, n_q, mass, ld, n_group, pos, n, score);
    KVM_CU_LAUNCHED(dev, "k_decode_score");
    return 0;
}

int kvm__cuda_decode_victim(int dev, const kvm__cuda_decode_victim_args *a, int64_t *dev_victim, int64_t *victim)
{
    k_decode_victim<<<1, 1, 0, cudaStreamPerThread>>>(*a, dev_victim);
    KVM_CU_LAUNCHED(dev, "k_decode_victim");
    KVM_CU(dev, cudaMemcpyAsync(victim, dev_victim, sizeof *victim, cudaMemcpyDeviceToHost, cudaStreamPerThread));
    KVM_CU(dev, cudaStreamSynchronize(cudaStreamPerThread));
    return 0;
}
