// kvm_cuda_model.cu: a Llama forward resident on one GPU (issue 13): weights, ragged KV cache and
// activations allocated once with cudaMalloc after a memory plan, every step a launch of the
// row kernels (kvm_cuda_rows.cu, bodies in kernels/kvm_forward_body.h), a cuBLAS GEMM
// (kvm_cuda_gemm.cu) or layer attention (kvm_cuda_attn.cu). The host only uploads token ids,
// positions and RoPE tables and downloads logits, statistics and captured K/V.
#include "kernels/cuda/kvm_cuda_impl.h"

extern "C" {
#include "kernels/kvm_quant_body.h"
}

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace {

struct dmat {
    void *d;
    int64_t out, in;
};

struct dlayer {
    float *rms_att, *rms_ffn, *bq, *bk, *bv, *bo, *q_norm, *k_norm;
    dmat wq, wk, wv, wo, w1, w2, w3;
    float *k, *v, *bias; // [n_kv][ctx][d], [n_kv][ctx]
    int32_t *pos;        // [n_kv][ctx]
};

} // namespace

struct kvm_cuda_model {
    int dev;
    kvm_cuda_model_desc s; // shape; tensor pointers cleared
    kvm_cuda_wdtype t;
    int64_t ctx, max_batch;
    float *tok_emb, *rms_final;
    dmat wcls;
    dlayer *L;
    int64_t *n_host; // [n_layers][n_kv] entries per head
    int32_t next_pos;
    // device scratch
    float *x, *xb, *q, *kk, *vv, *att, *hb, *hb2, *cos_t, *sin_t, *logits;
    float *st_lse, *st_ent, *st_km, *st_lp;
    void *xh; // activations converted to the weight dtype for cublasGemmEx, [max_batch][max(dim, q, hidden)]
    int32_t *qpos, *tok;
    // host scratch
    float *h_cos, *h_sin;
    int32_t *h_pos;
    // device eviction (kvm_cuda_model_keep_evict_stats): per-layer statistics and the selection's scratch
    int64_t ev_n_obs;  // observation rows the buffers hold (0: none allocated)
    int ev_armed;      // the next forward keeps the statistics
    int64_t ev_valid;  // the context the kept statistics describe (0: none)
    float *ev_mass, *ev_obs, *ev_vote, *ev_score, *ev_k2, *ev_v2, *ev_bias2;
    int32_t *ev_pos2, *ev_idx;
    uint8_t *ev_mark;
    int64_t ev_seed_n; // the context whose statistics may still seed a decode policy (0: none)
    // decode-phase eviction (kvm_cuda_model_decode_evict): the plan, per-entry scores, scratch
    int dp_on;
    uint8_t *dp_pattern; // host [n_layers][n_kv]
    int64_t *dp_budget;  // host [n_layers][n_kv]
    int64_t dp_sinks, dp_window, dp_pool;
    double dp_recent;
    float *dp_score, *dp_mass, *dp_obs, *dp_raw, *dp_pooled, *dp_tmp; // [L][n_kv][ctx], [nh][ctx] ×2, [ctx] ×2, [ctx][d]
    int64_t *dp_victim;
};

namespace {

size_t mat_bytes(int64_t out, int64_t in, kvm_cuda_wdtype t) { return (size_t)out * (size_t)in * kvm_cuda_wdtype_bytes(t); }

// the matrices of a model in upload order, with their shapes and names (for messages)
struct mat_ref {
    const kvm_cuda_mat *m; // NULL: random
    int64_t out, in;
    int layer;        // -1: embedding / classifier
    const char *name;
};

// calls f on every matrix of d (tok_emb, wcls, then per layer wq wk wv wo w1 w2 w3); stops at
// the first nonzero result and returns it
template <class F> int each_mat(const kvm_cuda_model_desc *d, F f)
{
    const bool rnd = d->tok_emb.data == NULL;
    const int64_t qd = (int64_t)d->n_heads * d->head_dim, kvd = (int64_t)d->n_kv_heads * d->head_dim;
    const int64_t D = d->dim, H = d->hidden_dim, V = d->vocab_size;
    int rc;
    if ((rc = f(mat_ref{rnd ? NULL : &d->tok_emb, V, D, -1, "token embedding"})) ||
        (rc = f(mat_ref{rnd ? NULL : &d->wcls, V, D, -1, "classifier"})))
        return rc;
    for (int l = 0; l < d->n_layers; l++) {
        const mat_ref ms[] = {{rnd ? NULL : &d->wq[l], qd, D, l, "wq"},  {rnd ? NULL : &d->wk[l], kvd, D, l, "wk"},
                              {rnd ? NULL : &d->wv[l], kvd, D, l, "wv"}, {rnd ? NULL : &d->wo[l], D, qd, l, "wo"},
                              {rnd ? NULL : &d->w1[l], H, D, l, "w1"},   {rnd ? NULL : &d->w2[l], D, H, l, "w2"},
                              {rnd ? NULL : &d->w3[l], H, D, l, "w3"}};
        for (const mat_ref &r : ms)
            if ((rc = f(r))) return rc;
    }
    return 0;
}

// bytes of the upload buffer one matrix needs: its file bytes, or its float32 values (random)
size_t upload_bytes(const mat_ref &r)
{
    return r.m ? (size_t)r.out * (size_t)kvm_qb_row_bytes(r.m->type, r.in) : (size_t)r.out * (size_t)r.in * 4;
}

// the pieces of the plan, in one place so that kvm_cuda_model_bytes and _new agree
struct plan {
    size_t weights, cache, acts, staging;
};

plan make_plan(const kvm_cuda_model_desc *d, kvm_cuda_wdtype t, int64_t ctx, int64_t B)
{
    const int64_t qd = (int64_t)d->n_heads * d->head_dim, kvd = (int64_t)d->n_kv_heads * d->head_dim;
    const int64_t D = d->dim, H = d->hidden_dim, V = d->vocab_size;
    plan p = {};
    size_t per_layer = mat_bytes(qd, D, t) + 2 * mat_bytes(kvd, D, t) + mat_bytes(D, qd, t) + 2 * mat_bytes(H, D, t) +
                       mat_bytes(D, H, t) + 4 * (size_t)(2 * D + 2 * qd + 2 * kvd + 2 * d->head_dim);
    p.weights = per_layer * (size_t)d->n_layers + 4 * (size_t)V * D + 4 * (size_t)D + mat_bytes(V, D, t);
    p.cache = (size_t)d->n_layers * ((size_t)d->n_kv_heads * ctx * (2 * (size_t)d->head_dim * 4 + 8) + 8 * d->n_kv_heads);
    int64_t wide = D > qd ? D : qd;
    p.acts = 4 * (size_t)B * (size_t)(D + wide + 2 * qd + 2 * kvd + 2 * H + d->head_dim + V) + 8 * (size_t)B +
             4 * (size_t)d->n_heads * (2 * (size_t)B + 2 * (size_t)ctx) +
             2 * (size_t)B * (size_t)(H > wide ? H : wide); // activations in the weight dtype for GemmEx
    each_mat(d, [&](const mat_ref &r) { // one upload buffer, reused matrix after matrix
        size_t b = upload_bytes(r);
        if (b > p.staging) p.staging = b;
        return 0;
    });
    return p;
}

// KVM_ENOTSUP naming the first matrix whose type or row length the dequantisation cannot take
int check_mats(int dev, const kvm_cuda_model_desc *d)
{
    return each_mat(d, [&](const mat_ref &r) {
        if (!r.m) return 0;
        const int64_t be = kvm_qb_block_elems(r.m->type);
        if (r.m->data && be && r.in % be == 0) return 0;
        char where[32] = "";
        if (r.layer >= 0) snprintf(where, sizeof where, "layer %d ", r.layer);
        return kvm_err(KVM_ENOTSUP, "cuda:%d: %s%s: %s of ggml type %d with rows of %lld elements cannot be uploaded "
                       "(types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K in whole blocks)",
                       dev, where, r.name, r.m->data ? "weights" : "no data", r.m->type, (long long)r.in);
    });
}

int dalloc(int dev, void **p, size_t bytes)
{
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *p = NULL;
        return kvm_err(KVM_ENOMEM, "cuda:%d: cudaMalloc(%zu bytes) failed: %s", dev, bytes, cudaGetErrorString(e));
    }
    KVM_CU(dev, cudaMemsetAsync(*p, 0, bytes ? bytes : 1, cudaStreamPerThread));
    return 0;
}

template <class T> int dalloc_n(int dev, T **p, size_t n) { return dalloc(dev, (void **)p, n * sizeof(T)); }

// a vector: host values, or `fill` everywhere (random model)
int vec(int dev, float **dst, const float *host, int64_t n, float fill)
{
    int rc = dalloc_n(dev, dst, (size_t)n);
    if (rc) return rc;
    if (host) {
        KVM_CU(dev, cudaMemcpyAsync(*dst, host, (size_t)n * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
        return 0;
    }
    if (fill == 0.0f) return 0;
    float *h = (float *)malloc((size_t)n * 4);
    if (!h) return kvm_err(KVM_ENOMEM, "cuda:%d: out of host memory", dev);
    for (int64_t i = 0; i < n; i++) h[i] = fill;
    cudaError_t e = cudaMemcpy(*dst, h, (size_t)n * 4, cudaMemcpyHostToDevice);
    free(h);
    if (e != cudaSuccess) return kvm__cuda_fail(dev, "cudaMemcpy", e);
    return 0;
}

// a matrix [out][in] in dtype t from the file's bytes (copied into the upload buffer `stage`,
// dequantised there by the loader's bodies) or from (seed, tensor id) uniform ±1/sqrt(in)
int mat(int dev, dmat *m, const mat_ref &r, kvm_cuda_wdtype t, uint64_t seed, void *stage)
{
    m->out = r.out;
    m->in = r.in;
    int rc = dalloc(dev, &m->d, mat_bytes(r.out, r.in, t));
    if (rc) return rc;
    if (r.m) {
        KVM_CU(dev, cudaMemcpyAsync(stage, r.m->data, upload_bytes(r), cudaMemcpyHostToDevice, cudaStreamPerThread));
        rc = kvm__cuda_dequant(dev, m->d, t, stage, r.m->type, r.out, r.in);
    } else {
        float *src = t == KVM_CUDA_F32 ? (float *)m->d : (float *)stage;
        if (!(rc = kvm_cuda_fill_uniform(dev, src, r.out * r.in, seed, 1.0f / sqrtf((float)r.in))) && t != KVM_CUDA_F32)
            rc = kvm__cuda_convert(dev, m->d, t, src, r.out * r.in);
    }
    if (rc) return rc;
    KVM_CU(dev, cudaStreamSynchronize(cudaStreamPerThread)); // the upload buffer is reused next
    return 0;
}

const float *at(const float *const *a, int l) { return a ? a[l] : NULL; }

int opt_vec(int dev, float **dst, const float *const *a, int l, int64_t n)
{
    const float *h = at(a, l);
    *dst = NULL;
    return h ? vec(dev, dst, h, n, 0.0f) : 0;
}

int load(kvm_cuda_model *m, const kvm_cuda_model_desc *d, void *stage)
{
    const int dev = m->dev;
    const kvm_cuda_wdtype t = m->t;
    const int64_t qd = (int64_t)d->n_heads * d->head_dim, kvd = (int64_t)d->n_kv_heads * d->head_dim;
    const int64_t D = d->dim;
    const bool rnd = d->tok_emb.data == NULL;
    uint64_t id = d->seed * 1000003u;
    int rc;
    int64_t i_mat = 0;
    dmat emb = {};
    // the matrices in each_mat's order: the embedding table in float32 (k_embed reads it), the
    // classifier and the layers' matrices in t
    rc = each_mat(d, [&](const mat_ref &r) {
        const int64_t i = i_mat++;
        if (i == 0) {
            if (rnd) {
                if ((rc = dalloc(dev, &emb.d, (size_t)(r.out * r.in) * 4))) return rc;
                return kvm_cuda_fill_uniform(dev, (float *)emb.d, r.out * r.in, id++, 1.0f);
            }
            return mat(dev, &emb, r, KVM_CUDA_F32, 0, stage);
        }
        if (i == 1) return mat(dev, &m->wcls, r, t, id++, stage);
        dlayer *y = &m->L[(i - 2) / 7];
        dmat *slot[] = {&y->wq, &y->wk, &y->wv, &y->wo, &y->w1, &y->w2, &y->w3};
        return mat(dev, slot[(i - 2) % 7], r, t, id++, stage);
    });
    m->tok_emb = (float *)emb.d;
    if (rc || (rc = vec(dev, &m->rms_final, rnd ? NULL : d->rms_final, D, 1.0f))) return rc;
    for (int l = 0; l < d->n_layers; l++) {
        dlayer *y = &m->L[l];
        if ((rc = vec(dev, &y->rms_att, rnd ? NULL : d->rms_att[l], D, 1.0f)) ||
            (rc = vec(dev, &y->rms_ffn, rnd ? NULL : d->rms_ffn[l], D, 1.0f)) ||
            (rc = opt_vec(dev, &y->bq, d->bq, l, qd)) || (rc = opt_vec(dev, &y->bk, d->bk, l, kvd)) ||
            (rc = opt_vec(dev, &y->bv, d->bv, l, kvd)) || (rc = opt_vec(dev, &y->bo, d->bo, l, D)) ||
            (rc = opt_vec(dev, &y->q_norm, d->q_norm, l, d->head_dim)) ||
            (rc = opt_vec(dev, &y->k_norm, d->k_norm, l, d->head_dim)))
            return rc;
        size_t ce = (size_t)d->n_kv_heads * (size_t)m->ctx;
        if ((rc = dalloc_n(dev, &y->k, ce * d->head_dim)) || (rc = dalloc_n(dev, &y->v, ce * d->head_dim)) ||
            (rc = dalloc_n(dev, &y->bias, ce)) || (rc = dalloc_n(dev, &y->pos, ce)))
            return rc;
    }
    const int64_t B = m->max_batch, wide = D > qd ? D : qd, half = d->head_dim / 2, H = d->hidden_dim,
                  V = d->vocab_size;
    if ((rc = dalloc_n(dev, &m->x, (size_t)(B * D))) || (rc = dalloc_n(dev, &m->xb, (size_t)(B * wide))) ||
        (rc = dalloc_n(dev, &m->q, (size_t)(B * qd))) || (rc = dalloc_n(dev, &m->kk, (size_t)(B * kvd))) ||
        (rc = dalloc_n(dev, &m->vv, (size_t)(B * kvd))) || (rc = dalloc_n(dev, &m->att, (size_t)(B * qd))) ||
        (rc = dalloc_n(dev, &m->hb, (size_t)(B * H))) || (rc = dalloc_n(dev, &m->hb2, (size_t)(B * H))) ||
        (rc = dalloc_n(dev, &m->cos_t, (size_t)(B * half))) || (rc = dalloc_n(dev, &m->sin_t, (size_t)(B * half))) ||
        (rc = dalloc_n(dev, &m->logits, (size_t)(B * V))) || (rc = dalloc_n(dev, &m->qpos, (size_t)B)) ||
        (rc = dalloc_n(dev, &m->tok, (size_t)B)) ||
        (rc = dalloc_n(dev, &m->st_lse, (size_t)(d->n_heads * B))) ||
        (rc = dalloc_n(dev, &m->st_ent, (size_t)(d->n_heads * B))) ||
        (rc = dalloc_n(dev, &m->st_km, (size_t)(d->n_heads * m->ctx))) ||
        (rc = dalloc_n(dev, &m->st_lp, (size_t)(d->n_heads * m->ctx))))
        return rc;
    const int64_t widest = H > wide ? H : wide;
    if (t != KVM_CUDA_F32 && (rc = dalloc(dev, &m->xh, (size_t)(B * widest) * 2))) return rc;
    KVM_CU(dev, cudaStreamSynchronize(cudaStreamPerThread));
    return 0;
}

void free_dev(void *p)
{
    if (p) cudaFree(p);
}

} // namespace

extern "C" {

size_t kvm_cuda_model_bytes(const kvm_cuda_model_desc *d, kvm_cuda_wdtype t, int64_t ctx, int64_t max_batch)
{
    plan p = make_plan(d, t, ctx, max_batch);
    return p.weights + p.cache + p.acts + p.staging;
}

void kvm_cuda_model_free(kvm_cuda_model **pm)
{
    if (!pm || !*pm) return;
    kvm_cuda_model *m = *pm;
    if (!kvm__cuda_use(m->dev)) {
        cudaStreamSynchronize(cudaStreamPerThread);
        for (int l = 0; m->L && l < m->s.n_layers; l++) {
            dlayer *y = &m->L[l];
            void *ps[] = {y->rms_att, y->rms_ffn, y->bq, y->bk, y->bv, y->bo, y->q_norm, y->k_norm, y->wq.d,
                          y->wk.d, y->wv.d, y->wo.d, y->w1.d, y->w2.d, y->w3.d, y->k, y->v, y->bias, y->pos};
            for (void *p : ps) free_dev(p);
        }
        void *ps[] = {m->tok_emb, m->rms_final, m->wcls.d, m->x,      m->xb,     m->q,       m->kk,
                      m->vv,      m->att,       m->hb,     m->hb2,    m->cos_t,  m->sin_t,   m->logits,
                      m->st_lse,  m->st_ent,    m->st_km,  m->st_lp,  m->xh,     m->qpos,    m->tok,
                      m->ev_mass, m->ev_obs,    m->ev_vote, m->ev_score, m->ev_k2, m->ev_v2, m->ev_bias2,
                      m->ev_pos2, m->ev_idx,    m->ev_mark, m->dp_score, m->dp_mass, m->dp_obs,  m->dp_raw,
                      m->dp_pooled, m->dp_tmp,  m->dp_victim};
        for (void *p : ps) free_dev(p);
    }
    free(m->dp_pattern);
    free(m->dp_budget);
    free(m->L);
    free(m->n_host);
    free(m->h_cos);
    free(m->h_sin);
    free(m->h_pos);
    free(m);
    *pm = NULL;
}

int kvm_cuda_model_new(int device, const kvm_cuda_model_desc *d, kvm_cuda_wdtype t, int64_t ctx, int64_t max_batch,
                       kvm_cuda_model **out)
{
    *out = NULL;
    if (d->n_layers <= 0 || d->dim <= 0 || d->n_heads <= 0 || d->n_kv_heads <= 0 || d->n_heads % d->n_kv_heads ||
        d->n_kv_heads > KVM_CUDA_MAX_KV_HEADS ||
        d->head_dim <= 0 || d->head_dim % 2 || d->head_dim > KVM_CUDA_MAX_HEAD_DIM || d->hidden_dim <= 0 ||
        d->vocab_size <= 0 || ctx <= 0 || max_batch <= 0 || ctx > 0x7fffffff)
        return kvm_err(KVM_EINVAL,
                       "cuda:%d: model shape layers=%d dim=%d heads=%d/%d (KV heads <= 32) head_dim=%d (even, <= %d) hidden=%d vocab=%d "
                       "ctx=%lld batch=%lld is not valid",
                       device, d->n_layers, d->dim, d->n_heads, d->n_kv_heads, d->head_dim, KVM_CUDA_MAX_HEAD_DIM,
                       d->hidden_dim, d->vocab_size, (long long)ctx, (long long)max_batch);
    int rc = check_mats(device, d);
    if (rc || (rc = kvm_cuda_plan_fits(device, kvm_cuda_model_bytes(d, t, ctx, max_batch),
                                       "the model, its KV cache and activations")))
        return rc;
    kvm_cuda_model *m = (kvm_cuda_model *)calloc(1, sizeof *m);
    if (!m) return kvm_err(KVM_ENOMEM, "cuda:%d: out of host memory", device);
    m->dev = device;
    m->s = *d;
    m->t = t;
    m->ctx = ctx;
    m->max_batch = max_batch;
    const int64_t half = d->head_dim / 2;
    m->L = (dlayer *)calloc((size_t)d->n_layers, sizeof *m->L);
    m->n_host = (int64_t *)calloc((size_t)d->n_layers * d->n_kv_heads, sizeof *m->n_host);
    m->h_cos = (float *)malloc((size_t)(max_batch * half) * 4);
    m->h_sin = (float *)malloc((size_t)(max_batch * half) * 4);
    m->h_pos = (int32_t *)malloc((size_t)max_batch * 4);
    if (!m->L || !m->n_host || !m->h_cos || !m->h_sin || !m->h_pos) {
        kvm_cuda_model_free(&m);
        return kvm_err(KVM_ENOMEM, "cuda:%d: out of host memory", device);
    }
    void *stage = NULL;
    plan p = make_plan(d, t, ctx, max_batch);
    if (!(rc = dalloc(device, &stage, p.staging))) rc = load(m, d, stage);
    free_dev(stage);
    // the tensor pointers of the description belong to the caller
    memset(&m->s.tok_emb, 0, sizeof *d - offsetof(kvm_cuda_model_desc, tok_emb));
    m->s.rope_table = d->rope_table;
    m->s.rope_ctx = d->rope_ctx;
    if (rc) {
        kvm_cuda_model_free(&m);
        return rc;
    }
    *out = m;
    return 0;
}

void kvm_cuda_model_reset(kvm_cuda_model *m)
{
    memset(m->n_host, 0, (size_t)m->s.n_layers * m->s.n_kv_heads * sizeof *m->n_host);
    m->next_pos = 0;
    m->dp_on = 0; // a new context: its decode policy is set after its prefill
    m->ev_seed_n = 0;
}

int64_t kvm_cuda_model_cache_len(const kvm_cuda_model *m) { return m->n_host[0]; }

void kvm_cuda_model_capacity(const kvm_cuda_model *m, int64_t *ctx, int64_t *max_batch)
{
    *ctx = m->ctx;
    *max_batch = m->max_batch;
}

void kvm_cuda_model_set_next_pos(kvm_cuda_model *m, int32_t pos) { m->next_pos = pos; }

int kvm_cuda_model_download_kv(const kvm_cuda_model *m, int layer, int g, float *k, float *v)
{
    if (layer < 0 || layer >= m->s.n_layers || g < 0 || g >= m->s.n_kv_heads)
        return kvm_err(KVM_EINVAL, "cuda:%d: KV head (%d, %d) outside %d layers x %d KV heads", m->dev, layer, g,
                       m->s.n_layers, m->s.n_kv_heads);
    int rc = kvm__cuda_use(m->dev);
    if (rc) return rc;
    const int d = m->s.head_dim;
    const int64_t n = m->n_host[(int64_t)layer * m->s.n_kv_heads + g];
    const size_t off = (size_t)g * m->ctx * d, bytes = (size_t)n * d * 4;
    if (k) KVM_CU(m->dev, cudaMemcpyAsync(k, m->L[layer].k + off, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread));
    if (v) KVM_CU(m->dev, cudaMemcpyAsync(v, m->L[layer].v + off, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread));
    KVM_CU(m->dev, cudaStreamSynchronize(cudaStreamPerThread));
    return 0;
}

int kvm_cuda_model_set_kv(kvm_cuda_model *m, int layer, int g, const float *k, const float *v, const int32_t *pos,
                          const float *bias, int64_t n)
{
    if (layer < 0 || layer >= m->s.n_layers || g < 0 || g >= m->s.n_kv_heads || n < 0 || n > m->ctx)
        return kvm_err(KVM_EINVAL, "cuda:%d: set_kv: head (%d, %d) with %lld entries (capacity %lld)", m->dev, layer,
                       g, (long long)n, (long long)m->ctx);
    for (int64_t i = 1; i < n; i++)
        if (pos[i] == KVM_POS_NONE ? pos[i - 1] != KVM_POS_NONE : pos[i] < pos[i - 1])
            return kvm_err(KVM_EINVAL, "cuda:%d: set_kv: head (%d, %d): entry %lld at position %d follows %d (entries "
                           "must be sorted: distilled first, then increasing positions)",
                           m->dev, layer, g, (long long)i, pos[i], pos[i - 1]);
    int rc = kvm__cuda_use(m->dev);
    if (rc) return rc;
    const int d = m->s.head_dim;
    dlayer *y = &m->L[layer];
    const size_t off = (size_t)g * m->ctx;
    m->n_host[(int64_t)layer * m->s.n_kv_heads + g] = n;
    KVM_CU(m->dev, cudaMemcpyAsync(y->k + off * d, k, (size_t)n * d * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    KVM_CU(m->dev, cudaMemcpyAsync(y->v + off * d, v, (size_t)n * d * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    KVM_CU(m->dev, cudaMemcpyAsync(y->pos + off, pos, (size_t)n * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    if (bias) KVM_CU(m->dev, cudaMemcpyAsync(y->bias + off, bias, (size_t)n * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    else KVM_CU(m->dev, cudaMemsetAsync(y->bias + off, 0, (size_t)n * 4, cudaStreamPerThread));
    KVM_CU(m->dev, cudaStreamSynchronize(cudaStreamPerThread));
    return 0;
}

} // extern "C"

namespace {

// appends the batch's keys/values (token-major kk, vv [n][n_kv·d]) to every KV head of layer l
int append_kv(kvm_cuda_model *m, int l, int64_t n)
{
    const int dev = m->dev, d = m->s.head_dim, nkv = m->s.n_kv_heads;
    dlayer *y = &m->L[l];
    int64_t *cnt = m->n_host + (int64_t)l * nkv;
    for (int g = 0; g < nkv; g++) {
        if (cnt[g] + n > m->ctx)
            return kvm_err(KVM_EFULL, "cuda:%d: layer %d KV head %d: %lld + %lld entries exceed the cache's %lld", dev,
                           l, g, (long long)cnt[g], (long long)n, (long long)m->ctx);
        const size_t e0 = (size_t)g * m->ctx + (size_t)cnt[g];
        KVM_CU(dev, cudaMemcpy2DAsync(y->k + e0 * d, (size_t)d * 4, m->kk + (size_t)g * d, (size_t)nkv * d * 4,
                                      (size_t)d * 4, (size_t)n, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
        KVM_CU(dev, cudaMemcpy2DAsync(y->v + e0 * d, (size_t)d * 4, m->vv + (size_t)g * d, (size_t)nkv * d * 4,
                                      (size_t)d * 4, (size_t)n, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
        KVM_CU(dev, cudaMemcpyAsync(y->pos + e0, m->qpos, (size_t)n * 4, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
        KVM_CU(dev, cudaMemsetAsync(y->bias + e0, 0, (size_t)n * 4, cudaStreamPerThread));
        if (m->dp_on) // appended entries start unscored
            KVM_CU(dev, cudaMemsetAsync(m->dp_score + ((size_t)l * nkv) * m->ctx + e0, 0, (size_t)n * 4,
                                        cudaStreamPerThread));
        cnt[g] += n;
    }
    return 0;
}

int download_stats(kvm_cuda_model *m, int l, int64_t n, kvm_cuda_stats *st)
{
    const int dev = m->dev, nh = m->s.n_heads;
    struct { float *host, *dev_; size_t rows; } parts[] = {
        {st->lse, m->st_lse, (size_t)n}, {st->entropy, m->st_ent, (size_t)n},
        {st->key_mass, m->st_km, (size_t)m->ctx}, {st->last_p, m->st_lp, (size_t)m->ctx}};
    for (auto &p : parts)
        if (p.host)
            KVM_CU(dev, cudaMemcpyAsync(p.host + (size_t)l * nh * p.rows, p.dev_, (size_t)nh * p.rows * 4,
                                        cudaMemcpyDeviceToHost, cudaStreamPerThread));
    // the next layer overwrites the device buffers in stream order after these copies
    return 0;
}

// drops entry v of layer l's KV head g (k, v, position, β and its decode score), the later ones
// moving down one place through dp_tmp, in stream order
int drop_entry(kvm_cuda_model *m, int l, int g, int64_t v)
{
    const int dev = m->dev, d = m->s.head_dim;
    const int64_t i = (int64_t)l * m->s.n_kv_heads + g, n = m->n_host[i], tail = n - v - 1;
    dlayer *y = &m->L[l];
    const size_t e0 = (size_t)g * m->ctx + (size_t)v;
    struct { void *base; size_t width; } parts[] = {{y->k + e0 * d, (size_t)d * 4}, {y->v + e0 * d, (size_t)d * 4},
                                                    {y->pos + e0, 4}, {y->bias + e0, 4},
                                                    {m->dp_score + (size_t)l * m->s.n_kv_heads * m->ctx + e0, 4}};
    for (auto &p : parts) {
        if (tail <= 0) break;
        char *at = (char *)p.base;
        const size_t bytes = (size_t)tail * p.width;
        KVM_CU(dev, cudaMemcpyAsync(m->dp_tmp, at + p.width, bytes, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
        KVM_CU(dev, cudaMemcpyAsync(at, m->dp_tmp, bytes, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    }
    m->n_host[i] = n - 1;
    return 0;
}

// the decode policy after layer l's append (kvm_evict_decode.c's on_update): while a head holds
// more than its budget, one victim per head and round; TOVA's newest-query probabilities come
// from an attention pass with the OBS statistic over the cache as it is (base: the layer's
// attention descriptor; its output is scratch, overwritten by the layer's own attention)
int decode_evict_layer(kvm_cuda_model *m, int l, const kvm_cuda_attn_layer *base)
{
    const int dev = m->dev, nkv = m->s.n_kv_heads, grp = m->s.n_heads / nkv;
    const dlayer *y = &m->L[l];
    bool stuck[KVM_CUDA_MAX_KV_HEADS] = {};
    for (;;) {
        bool any = false, tova = false;
        for (int g = 0; g < nkv; g++) {
            const int64_t i = (int64_t)l * nkv + g;
            if (m->dp_pattern[i] == 255 || stuck[g] || m->n_host[i] <= m->dp_budget[i]) continue;
            any = true;
            tova |= m->dp_pattern[i] == 2;
        }
        if (!any) return 0;
        int rc;
        if (tova) {
            kvm_cuda_attn_layer t = *base;
            t.stats = KVM_CUDA_STAT_OBS;
            t.obs = m->dp_obs;
            t.n_obs = 1;
            t.ld_e = m->ctx;
            if ((rc = kvm_cuda_attention_layer(dev, &t))) return rc;
        }
        for (int g = 0; g < nkv; g++) {
            const int64_t i = (int64_t)l * nkv + g;
            if (m->dp_pattern[i] == 255 || stuck[g] || m->n_host[i] <= m->dp_budget[i]) continue;
            kvm__cuda_decode_victim_args a = {};
            a.pattern = m->dp_pattern[i];
            a.n = m->n_host[i], a.budget = m->dp_budget[i];
            a.sinks = m->dp_sinks, a.window = m->dp_window, a.pool = m->dp_pool, a.recent_frac = m->dp_recent;
            a.pos = y->pos + (size_t)g * m->ctx;
            a.score = m->dp_score + (size_t)i * m->ctx;
            a.obs = m->dp_obs + (size_t)g * grp * m->ctx;
            a.ld = m->ctx, a.n_group = grp, a.raw = m->dp_raw, a.pooled = m->dp_pooled;
            int64_t v;
            if ((rc = kvm__cuda_decode_victim(dev, &a, m->dp_victim, &v))) return rc;
            if (v < 0) stuck[g] = true; // distilled entries only: nothing to evict
            else if ((rc = drop_entry(m, l, g, v))) return rc;
        }
    }
}

// whether any KV head of layer l keeps scores (H2O, SnapKV, PyramidKV) under the decode policy
bool decode_scored(const kvm_cuda_model *m, int l)
{
    for (int g = 0; g < m->s.n_kv_heads; g++) {
        const int p = m->dp_pattern[(int64_t)l * m->s.n_kv_heads + g];
        if (p == 1 || p == 3 || p == 4) return true;
    }
    return false;
}

// the scored heads of layer l updated from the attention call's MASS (kvm_evict_decode.c's on_post)
int decode_scores(kvm_cuda_model *m, int l, int64_t n_q)
{
    const int nkv = m->s.n_kv_heads, grp = m->s.n_heads / nkv;
    for (int g = 0; g < nkv; g++) {
        const int64_t i = (int64_t)l * nkv + g;
        const int p = m->dp_pattern[i];
        if (p != 1 && p != 3 && p != 4) continue;
        int rc = kvm__cuda_decode_score(m->dev, p, m->dp_window, n_q, m->dp_mass + (size_t)g * grp * m->ctx, m->ctx,
                                        grp, m->L[l].pos + (size_t)g * m->ctx, m->n_host[i],
                                        m->dp_score + (size_t)i * m->ctx);
        if (rc) return rc;
    }
    return 0;
}

// layer l's queries in m->q (token-major [n][n_heads·d]) to host dst[l] head-major [n_heads][n][d]
// (one strided copy per head); nothing when dst or dst[l] is NULL
int download_queries(kvm_cuda_model *m, float *const *dst, int l, int64_t n)
{
    if (!dst || !dst[l]) return 0;
    const int dev = m->dev, d = m->s.head_dim, nh = m->s.n_heads;
    for (int h = 0; h < nh; h++)
        KVM_CU(dev, cudaMemcpy2DAsync(dst[l] + (size_t)h * n * d, (size_t)d * 4, m->q + (size_t)h * d,
                                      (size_t)nh * d * 4, (size_t)d * 4, (size_t)n, cudaMemcpyDeviceToHost,
                                      cudaStreamPerThread));
    return 0;
}

int layer(kvm_cuda_model *m, int l, int64_t n, kvm_cuda_stats *st)
{
    const kvm_cuda_model_desc *c = &m->s;
    const int dev = m->dev;
    const int64_t D = c->dim, H = c->hidden_dim, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim;
    dlayer *y = &m->L[l];
    int rc;
    auto mm = [&](const float *x, int64_t ldx, const dmat &w, float *out) {
        return kvm__cuda_gemm_ws(dev, x, n, ldx, w.d, m->t, w.out, w.in, out, w.out, m->xh);
    };
    if ((rc = kvm__cuda_rmsnorm(dev, m->xb, m->x, y->rms_att, n, D, c->norm_eps)) || (rc = mm(m->xb, D, y->wq, m->q)) ||
        (rc = mm(m->xb, D, y->wk, m->kk)) || (rc = mm(m->xb, D, y->wv, m->vv)))
        return rc;
    if ((y->bq && (rc = kvm__cuda_add_rows(dev, m->q, y->bq, n, qd))) ||
        (y->bk && (rc = kvm__cuda_add_rows(dev, m->kk, y->bk, n, kvd))) ||
        (y->bv && (rc = kvm__cuda_add_rows(dev, m->vv, y->bv, n, kvd))) ||
        (y->q_norm && (rc = kvm__cuda_rmsnorm(dev, m->q, m->q, y->q_norm, n * c->n_heads, c->head_dim, c->norm_eps))) ||
        (y->k_norm && (rc = kvm__cuda_rmsnorm(dev, m->kk, m->kk, y->k_norm, n * c->n_kv_heads, c->head_dim, c->norm_eps))))
        return rc;
    if ((st && (rc = download_queries(m, st->q_pre, l, n))) ||
        (rc = kvm__cuda_rope(dev, m->q, n, qd, c->n_heads, c->head_dim, m->cos_t, m->sin_t, c->rope_style)) ||
        (rc = kvm__cuda_rope(dev, m->kk, n, kvd, c->n_kv_heads, c->head_dim, m->cos_t, m->sin_t, c->rope_style)) ||
        (st && (rc = download_queries(m, st->q_post, l, n))) || (rc = append_kv(m, l, n)))
        return rc;
    const int nkv = c->n_kv_heads, d = c->head_dim;
    const float *kp[KVM_CUDA_MAX_KV_HEADS], *vp[KVM_CUDA_MAX_KV_HEADS], *bp[KVM_CUDA_MAX_KV_HEADS];
    const int32_t *pp[KVM_CUDA_MAX_KV_HEADS];
    for (int g = 0; g < nkv; g++) {
        const size_t off = (size_t)g * m->ctx;
        kp[g] = y->k + off * d, vp[g] = y->v + off * d, bp[g] = y->bias + off, pp[g] = y->pos + off;
    }
    kvm_cuda_attn_layer a = {};
    a.n_heads = c->n_heads;
    a.n_kv_heads = nkv;
    a.head_dim = d;
    a.scale = 1.0f / sqrtf((float)d);
    a.q = m->q;
    a.ldq = qd;
    a.qpos = m->qpos;
    a.n_q = n;
    a.k = kp;
    a.v = vp;
    a.pos = pp;
    a.bias = bp;
    a.n_e = m->n_host + (int64_t)l * nkv;
    a.out = m->att;
    a.ldo = qd;
    if (st) {
        a.stats = (st->lse ? KVM_CUDA_STAT_LSE : 0) | (st->entropy ? KVM_CUDA_STAT_ENTROPY : 0) |
                  (st->key_mass ? KVM_CUDA_STAT_MASS : 0) | (st->last_p ? KVM_CUDA_STAT_OBS : 0);
        a.lse = m->st_lse;
        a.entropy = m->st_ent;
        a.mass = m->st_km;
        a.obs = m->st_lp;
        a.mass_p0 = m->next_pos + (int32_t)st->win0;
        a.mass_p1 = INT32_MAX;
        a.n_obs = 1;
        a.ld_e = m->ctx;
    }
    if (m->ev_armed) { // the prefill eviction's statistics, kept per layer on the device
        const size_t nh = (size_t)c->n_heads, ctx = (size_t)m->ctx;
        a.stats = KVM_CUDA_STAT_MASS | KVM_CUDA_STAT_OBS;
        a.mass = m->ev_mass + (size_t)l * nh * ctx;
        a.obs = m->ev_obs + (size_t)l * nh * (size_t)m->ev_n_obs * ctx;
        a.mass_p0 = INT32_MIN;
        a.mass_p1 = INT32_MAX;
        a.n_obs = m->ev_n_obs;
        a.ld_e = m->ctx;
    }
    if (m->dp_on && (rc = decode_evict_layer(m, l, &a))) return rc;
    const bool scored = m->dp_on && decode_scored(m, l);
    if (scored) { // the decode policy's scores read this call's received mass
        a.stats |= KVM_CUDA_STAT_MASS;
        a.mass = m->dp_mass;
        a.mass_p0 = INT32_MIN;
        a.mass_p1 = INT32_MAX;
        if (!(a.stats & KVM_CUDA_STAT_OBS)) a.n_obs = 1;
        a.ld_e = m->ctx;
    }
    if ((rc = kvm_cuda_attention_layer(dev, &a)) || (st && (rc = download_stats(m, l, n, st))) ||
        (scored && (rc = decode_scores(m, l, n))))
        return rc;
    if ((rc = mm(m->att, qd, y->wo, m->xb)) || (y->bo && (rc = kvm__cuda_add_rows(dev, m->xb, y->bo, n, D))) ||
        (rc = kvm__cuda_add(dev, m->x, m->xb, n * D)))
        return rc;
    if ((rc = kvm__cuda_rmsnorm(dev, m->xb, m->x, y->rms_ffn, n, D, c->norm_eps)) || (rc = mm(m->xb, D, y->w1, m->hb)) ||
        (rc = mm(m->xb, D, y->w3, m->hb2)) || (rc = kvm__cuda_swiglu(dev, m->hb, m->hb2, n * H)) ||
        (rc = mm(m->hb, H, y->w2, m->xb)) || (rc = kvm__cuda_add(dev, m->x, m->xb, n * D)))
        return rc;
    return 0;
}

int batch(kvm_cuda_model *m, const int32_t *tok, int64_t n, float *logits, int last_only, kvm_cuda_stats *st)
{
    const kvm_cuda_model_desc *c = &m->s;
    const int dev = m->dev;
    for (int64_t i = 0; i < n; i++) m->h_pos[i] = m->next_pos + (int32_t)i;
    if (c->rope_table) c->rope_table(c->rope_ctx, m->h_pos, n, m->h_cos, m->h_sin);
    else kvm_rope_table(m->h_pos, n, c->head_dim, c->rope_theta, m->h_cos, m->h_sin);
    const size_t half = (size_t)c->head_dim / 2;
    KVM_CU(dev, cudaMemcpyAsync(m->tok, tok, (size_t)n * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    KVM_CU(dev, cudaMemcpyAsync(m->qpos, m->h_pos, (size_t)n * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    KVM_CU(dev, cudaMemcpyAsync(m->cos_t, m->h_cos, n * half * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    KVM_CU(dev, cudaMemcpyAsync(m->sin_t, m->h_sin, n * half * 4, cudaMemcpyHostToDevice, cudaStreamPerThread));
    int rc = kvm_cuda_embed(dev, m->x, m->tok_emb, m->tok, n, c->dim);
    for (int l = 0; !rc && l < c->n_layers; l++) rc = layer(m, l, n, st);
    if (!rc && logits) {
        int64_t first = last_only ? n - 1 : 0, rows = n - first;
        if (!(rc = kvm__cuda_rmsnorm(dev, m->xb, m->x + first * c->dim, m->rms_final, rows, c->dim, c->norm_eps)) &&
            !(rc = kvm__cuda_gemm_ws(dev, m->xb, rows, c->dim, m->wcls.d, m->t, m->wcls.out, m->wcls.in, m->logits,
                                     c->vocab_size, m->xh)))
            if (cudaMemcpyAsync(logits, m->logits, (size_t)rows * c->vocab_size * 4, cudaMemcpyDeviceToHost,
                                cudaStreamPerThread) != cudaSuccess)
                rc = kvm__cuda_fail(dev, "cudaMemcpyAsync(logits)", cudaGetLastError());
    }
    // host staging (positions, counts, tables) is reused by the next batch: wait for the stream
    cudaError_t e = cudaStreamSynchronize(cudaStreamPerThread);
    if (!rc && e != cudaSuccess) rc = kvm__cuda_fail(dev, "cudaStreamSynchronize", e);
    if (!rc) m->next_pos += (int32_t)n;
    return rc;
}

} // namespace

extern "C" int kvm_cuda_model_forward(kvm_cuda_model *m, const int32_t *tokens, int64_t n, float *logits,
                                      int last_only, kvm_cuda_stats *stats)
{
    if (n <= 0) return kvm_err(KVM_EINVAL, "cuda:%d: forward: %lld tokens", m->dev, (long long)n);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->s.vocab_size)
            return kvm_err(KVM_EINVAL, "cuda:%d: forward: token %lld has id %d outside [0, %d)", m->dev, (long long)i,
                           tokens[i], m->s.vocab_size);
    if ((int64_t)m->next_pos + n > 0x7fffffff)
        return kvm_err(KVM_ERANGE, "cuda:%d: forward: position %lld exceeds int32", m->dev, (long long)m->next_pos + n);
    if (m->dp_on && stats)
        return kvm_err(KVM_EINVAL, "cuda:%d: forward: kvm_cuda_stats with a decode-phase eviction policy on (the "
                       "policy reads the attention's mass itself)", m->dev);
    const bool armed = m->ev_armed;
    m->ev_armed = 0; // statistics for this forward only
    m->ev_valid = 0;
    m->ev_seed_n = 0;
    if (armed && (stats || n > m->max_batch || n < m->ev_n_obs || m->next_pos != 0 || kvm_cuda_model_cache_len(m) != 0))
        return kvm_err(KVM_EINVAL, "cuda:%d: forward: the eviction statistics need the whole prefill in one batch over "
                       "an empty cache, without kvm_cuda_stats (%lld tokens, batch %lld, %lld rows, position %d)",
                       m->dev, (long long)n, (long long)m->max_batch, (long long)m->ev_n_obs, m->next_pos);
    m->ev_armed = armed;
    int rc = kvm__cuda_use(m->dev);
    for (int64_t i0 = 0; !rc && i0 < n; i0 += m->max_batch) {
        int64_t nb = n - i0 < m->max_batch ? n - i0 : m->max_batch;
        bool last = i0 + nb == n;
        float *lg = logits && (!last_only || last) ? logits + (last_only ? 0 : i0 * m->s.vocab_size) : NULL;
        rc = batch(m, tokens + i0, nb, lg, last_only, last ? stats : NULL);
    }
    if (!rc && armed) m->ev_valid = m->ev_seed_n = n;
    m->ev_armed = 0;
    return rc;
}

extern "C" int kvm_cuda_model_download_pos(const kvm_cuda_model *m, int layer, int g, int32_t *pos)
{
    if (layer < 0 || layer >= m->s.n_layers || g < 0 || g >= m->s.n_kv_heads)
        return kvm_err(KVM_EINVAL, "cuda:%d: KV head (%d, %d) outside %d layers x %d KV heads", m->dev, layer, g,
                       m->s.n_layers, m->s.n_kv_heads);
    int rc = kvm__cuda_use(m->dev);
    if (rc) return rc;
    const int64_t n = m->n_host[(int64_t)layer * m->s.n_kv_heads + g];
    KVM_CU(m->dev, cudaMemcpyAsync(pos, m->L[layer].pos + (size_t)g * m->ctx, (size_t)n * 4, cudaMemcpyDeviceToHost,
                                   cudaStreamPerThread));
    KVM_CU(m->dev, cudaStreamSynchronize(cudaStreamPerThread));
    return 0;
}

extern "C" int kvm_cuda_model_keep_evict_stats(kvm_cuda_model *m, int64_t n_obs)
{
    if (n_obs < 0 || n_obs > m->ctx)
        return kvm_err(KVM_EINVAL, "cuda:%d: eviction statistics of %lld rows (cache of %lld)", m->dev,
                       (long long)n_obs, (long long)m->ctx);
    int rc = kvm__cuda_use(m->dev);
    if (rc) return rc;
    m->ev_valid = 0;
    m->ev_armed = n_obs > 0;
    if (n_obs == 0 || n_obs == m->ev_n_obs) return 0; // buffers kept for the next use
    void **bufs[] = {(void **)&m->ev_mass,  (void **)&m->ev_obs,  (void **)&m->ev_vote, (void **)&m->ev_score,
                     (void **)&m->ev_k2,    (void **)&m->ev_v2,   (void **)&m->ev_bias2, (void **)&m->ev_pos2,
                     (void **)&m->ev_idx,   (void **)&m->ev_mark};
    for (void **b : bufs) free_dev(*b), *b = NULL;
    m->ev_n_obs = 0;
    m->ev_armed = 0;
    const size_t L = (size_t)m->s.n_layers, nh = (size_t)m->s.n_heads, ctx = (size_t)m->ctx, d = (size_t)m->s.head_dim;
    const size_t bytes[] = {4 * L * nh * ctx, 4 * L * nh * (size_t)n_obs * ctx, 4 * ctx, 4 * ctx, 4 * ctx * d,
                            4 * ctx * d,      4 * ctx,                          4 * ctx, 4 * ctx, ctx};
    size_t total = 0;
    for (size_t b : bytes) total += b;
    if ((rc = kvm_cuda_plan_fits(m->dev, total, "the eviction statistics"))) return rc;
    for (size_t i = 0; i < sizeof bytes / sizeof *bytes; i++)
        if ((rc = dalloc(m->dev, bufs[i], bytes[i]))) return rc; // the rest are freed with the model
    m->ev_n_obs = n_obs;
    m->ev_armed = 1;
    return 0;
}

extern "C" int kvm_cuda_model_evict(kvm_cuda_model *m, const kvm_cuda_evict_plan *p)
{
    const kvm_cuda_model_desc *c = &m->s;
    const int nkv = c->n_kv_heads, grp = c->n_heads / c->n_kv_heads;
    const int64_t n = m->ev_valid;
    if (n <= 0 || m->ev_n_obs <= 0 || m->n_host[0] != n)
        return kvm_err(KVM_EINVAL, "cuda:%d: evict: no eviction statistics for the cache (kvm_cuda_model_keep_evict_stats, "
                       "then the prefill)", m->dev);
    for (int64_t i = 0; i < (int64_t)c->n_layers * nkv; i++) {
        const int pat = p->pattern[i];
        const int64_t need = pat == 3 || pat == 4 ? (p->window < n ? p->window : n) : 1;
        if (pat == 255) continue;
        if (pat > 4 || p->budget[i] < 1 || (pat != 0 && m->ev_n_obs < need) || m->n_host[i] != n)
            return kvm_err(KVM_EINVAL, "cuda:%d: evict: layer %lld KV head %lld: pattern %d, budget %lld, %lld "
                           "statistics rows (needs %lld), %lld entries (context %lld)",
                           m->dev, (long long)(i / nkv), (long long)(i % nkv), pat, (long long)p->budget[i],
                           (long long)m->ev_n_obs, (long long)need, (long long)m->n_host[i], (long long)n);
    }
    int rc = kvm__cuda_use(m->dev);
    const size_t nh = (size_t)c->n_heads, ctx = (size_t)m->ctx, d = (size_t)c->head_dim;
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int g = 0; !rc && g < nkv; g++) {
            const int64_t i = (int64_t)l * nkv + g;
            if (p->pattern[i] == 255 || p->budget[i] >= n) continue;
            dlayer *y = &m->L[l];
            kvm__cuda_evict_head_args a = {};
            a.pattern = p->pattern[i];
            a.n = n;
            a.budget = p->budget[i];
            a.sinks = p->sinks, a.window = p->window, a.pool = p->pool, a.recent_frac = p->recent_frac;
            a.mass = m->ev_mass + ((size_t)l * nh + (size_t)g * grp) * ctx;
            a.obs = m->ev_obs + ((size_t)l * nh + (size_t)g * grp) * (size_t)m->ev_n_obs * ctx;
            a.n_obs = m->ev_n_obs, a.ld = m->ctx, a.n_group = grp;
            a.k = y->k + (size_t)g * ctx * d, a.v = y->v + (size_t)g * ctx * d;
            a.bias = y->bias + (size_t)g * ctx, a.pos = y->pos + (size_t)g * ctx, a.head_dim = c->head_dim;
            a.vote = m->ev_vote, a.score = m->ev_score, a.k2 = m->ev_k2, a.v2 = m->ev_v2, a.bias2 = m->ev_bias2;
            a.pos2 = m->ev_pos2, a.idx = m->ev_idx, a.mark = m->ev_mark;
            if (!(rc = kvm__cuda_evict_head(m->dev, &a))) m->n_host[i] = a.budget; // the scratch is reused in stream order
        }
    cudaError_t e = cudaStreamSynchronize(cudaStreamPerThread);
    if (!rc && e != cudaSuccess) rc = kvm__cuda_fail(m->dev, "cudaStreamSynchronize", e);
    m->ev_valid = 0;
    return rc;
}

extern "C" int kvm_cuda_model_gemm_only(kvm_cuda_model *m, int64_t n, int reps, double *seconds, double *flops)
{
    const kvm_cuda_model_desc *c = &m->s;
    const int dev = m->dev;
    if (n <= 0 || n > m->max_batch || reps <= 0 || m->t == KVM_CUDA_F32)
        return kvm_err(KVM_EINVAL, "cuda:%d: gemm_only: %lld rows (batch %lld), %d reps, weights %s (bf16/f16 only)",
                       dev, (long long)n, (long long)m->max_batch, reps, m->t == KVM_CUDA_F32 ? "f32" : "half");
    int rc = kvm__cuda_use(dev);
    if (rc) return rc;
    void *xh = m->xh; // [max_batch][max(dim, q, hidden)] in the weight dtype
    auto gemm = [&](const dmat &w, float *y, int64_t rows) {
        return kvm__cuda_gemm_half(dev, xh, rows, w.in, w.d, m->t, w.out, w.in, y, w.out);
    };
    double f = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const dlayer *y = &m->L[l];
        for (const dmat *w : {&y->wq, &y->wk, &y->wv, &y->wo, &y->w1, &y->w3, &y->w2}) f += 2.0 * n * w->out * w->in;
    }
    f += 2.0 * m->wcls.out * m->wcls.in;
    cudaEvent_t e0, e1;
    KVM_CU(dev, cudaEventCreate(&e0));
    KVM_CU(dev, cudaEventCreate(&e1));
    for (int r = 0; !rc && r <= reps; r++) { // repetition 0 warms up
        if (r == 1 && cudaEventRecord(e0, cudaStreamPerThread) != cudaSuccess) rc = kvm__cuda_fail(dev, "cudaEventRecord", cudaGetLastError());
        for (int l = 0; !rc && l < c->n_layers; l++) {
            const dlayer *y = &m->L[l];
            if ((rc = gemm(y->wq, m->q, n)) || (rc = gemm(y->wk, m->kk, n)) || (rc = gemm(y->wv, m->vv, n)) ||
                (rc = gemm(y->wo, m->xb, n)) || (rc = gemm(y->w1, m->hb, n)) || (rc = gemm(y->w3, m->hb2, n)) ||
                (rc = gemm(y->w2, m->x, n)))
                break;
        }
        if (!rc) rc = gemm(m->wcls, m->logits, 1);
    }
    float ms = 0;
    if (!rc && (cudaEventRecord(e1, cudaStreamPerThread) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
                cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess))
        rc = kvm__cuda_fail(dev, "cudaEventElapsedTime", cudaGetLastError());
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    *seconds = ms / 1e3 / reps;
    *flops = f;
    return rc;
}

extern "C" int kvm_cuda_model_decode_evict(kvm_cuda_model *m, const kvm_cuda_evict_plan *p)
{
    m->dp_on = 0;
    if (!p) return 0;
    const kvm_cuda_model_desc *c = &m->s;
    const int nkv = c->n_kv_heads, grp = c->n_heads / nkv;
    const int64_t nh = (int64_t)c->n_layers * nkv;
    for (int64_t i = 0; i < nh; i++)
        if ((p->pattern[i] > 4 && p->pattern[i] != 255) || p->budget[i] < 1)
            return kvm_err(KVM_EINVAL, "cuda:%d: decode eviction: layer %lld KV head %lld: pattern %d, budget %lld",
                           m->dev, (long long)(i / nkv), (long long)(i % nkv), p->pattern[i], (long long)p->budget[i]);
    int rc = kvm__cuda_use(m->dev);
    if (rc) return rc;
    if (!m->dp_victim) { // allocated at the first use (the last buffer made: all are there), freed with the model
        const size_t ctx = (size_t)m->ctx, hs = (size_t)c->n_heads * ctx;
        const size_t total = 4 * ((size_t)nh * ctx + 2 * hs + 2 * ctx + ctx * (size_t)c->head_dim) + 8;
        if ((rc = kvm_cuda_plan_fits(m->dev, total, "the decode-phase eviction's scores"))) return rc;
        if ((!m->dp_pattern && !(m->dp_pattern = (uint8_t *)malloc((size_t)nh))) ||
            (!m->dp_budget && !(m->dp_budget = (int64_t *)malloc((size_t)nh * sizeof *m->dp_budget))))
            return kvm_err(KVM_ENOMEM, "cuda:%d: out of host memory", m->dev);
        void **bufs[] = {(void **)&m->dp_score, (void **)&m->dp_mass,   (void **)&m->dp_obs,   (void **)&m->dp_raw,
                         (void **)&m->dp_pooled, (void **)&m->dp_tmp, (void **)&m->dp_victim};
        const size_t bytes[] = {4 * (size_t)nh * ctx, 4 * hs, 4 * hs, 4 * ctx, 4 * ctx, 4 * ctx * (size_t)c->head_dim, 8};
        for (int i = 0; i < 7; i++)
            if (!*bufs[i] && (rc = dalloc(m->dev, bufs[i], bytes[i]))) return rc;
    }
    memcpy(m->dp_pattern, p->pattern, (size_t)nh);
    memcpy(m->dp_budget, p->budget, (size_t)nh * sizeof *m->dp_budget);
    m->dp_sinks = p->sinks, m->dp_window = p->window, m->dp_pool = p->pool, m->dp_recent = p->recent_frac;
    // seeds from the last prefill's eviction statistics where they still describe the cache
    // (kvm_evict_decode.c's seed: H2O the context's received mass, SnapKV/PyramidKV the last
    // min(window, context) rows' votes), else every score 0
    const size_t ctx = (size_t)m->ctx;
    int64_t rows = p->window < m->ev_seed_n ? p->window : m->ev_seed_n;
    if (rows > m->ev_n_obs) rows = m->ev_n_obs;
    if (rows < 1) rows = 1;
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int g = 0; !rc && g < nkv; g++) {
            const int64_t i = (int64_t)l * nkv + g;
            const int pat = p->pattern[i];
            float *sc = m->dp_score + (size_t)i * ctx;
            if ((pat == 1 || pat == 3 || pat == 4) && m->ev_seed_n > 0 && m->ev_n_obs > 0) {
                const size_t h0 = (size_t)l * c->n_heads + (size_t)g * grp;
                rc = kvm__cuda_decode_seed(m->dev, pat, m->L[l].pos + (size_t)g * ctx, m->n_host[i],
                                           m->ev_mass + h0 * ctx, m->ev_obs + h0 * (size_t)m->ev_n_obs * ctx,
                                           m->ev_n_obs, rows, m->ctx, grp, sc);
            } else if (cudaMemsetAsync(sc, 0, ctx * 4, cudaStreamPerThread) != cudaSuccess)
                rc = kvm__cuda_fail(m->dev, "cudaMemsetAsync(decode scores)", cudaGetLastError());
        }
    cudaError_t e = cudaStreamSynchronize(cudaStreamPerThread);
    if (!rc && e != cudaSuccess) rc = kvm__cuda_fail(m->dev, "cudaStreamSynchronize", e);
    if (!rc) m->dp_on = 1;
    return rc;
}
