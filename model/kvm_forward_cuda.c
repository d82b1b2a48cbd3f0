/* kvm_forward_cuda.c: kvm_model → kvm_cuda_model_desc (the per-layer tensor arrays the device
 * model uploads from), see kvm_forward_cuda.h. */
#include "model/kvm_forward_cuda.h"

#ifdef KVM_WITH_CUDA
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

static kvm_cuda_mat file_mat(const kvm_mat *w) { return (kvm_cuda_mat){.data = w->data, .type = w->type}; }

static void rope_table(const void *ctx, const int32_t *pos, int64_t n, float *cos_t, float *sin_t)
{
    kvm_model_rope_table((const kvm_model_config *)ctx, pos, n, cos_t, sin_t);
}

int kvm_model_cuda_new(const kvm_model *m, int device, kvm_cuda_wdtype t, int64_t ctx, int64_t max_batch,
                       kvm_cuda_model **out)
{
    const kvm_model_config *c = &m->cfg;
    *out = NULL;
    if (c->sliding_window > 0)
        return kvm_err(KVM_ENOTSUP, "cuda:%d: the model's sliding_window of %d tokens is not implemented on CUDA",
                       device, c->sliding_window);
    /* matrices go as the file stores them (the mapping's bytes, dequantised on the device), so
     * the host holds no float32 copy of any matrix; vectors are the model's float32 ones */
    const int L = c->n_layers;
    const float **v = calloc((size_t)8 * L, sizeof *v);
    kvm_cuda_mat *w = calloc((size_t)7 * L, sizeof *w);
    if (!v || !w) {
        free(v);
        free(w);
        return kvm_err(KVM_ENOMEM, "out of memory");
    }
    const float **rms_att = v, **rms_ffn = v + L, **bq = v + 2 * L, **bk = v + 3 * L, **bv = v + 4 * L,
                **bo = v + 5 * L, **qn = v + 6 * L, **kn = v + 7 * L;
    kvm_cuda_mat *wq = w, *wk = w + L, *wv = w + 2 * L, *wo = w + 3 * L, *w1 = w + 4 * L, *w2 = w + 5 * L,
                 *w3 = w + 6 * L;
    for (int l = 0; l < L; l++) {
        const kvm_layer_weights *y = &m->layers[l];
        rms_att[l] = y->rms_att, rms_ffn[l] = y->rms_ffn;
        wq[l] = file_mat(&y->wq), wk[l] = file_mat(&y->wk), wv[l] = file_mat(&y->wv), wo[l] = file_mat(&y->wo);
        w1[l] = file_mat(&y->w1), w2[l] = file_mat(&y->w2), w3[l] = file_mat(&y->w3);
        bq[l] = y->bq, bk[l] = y->bk, bv[l] = y->bv, bo[l] = y->bo, qn[l] = y->q_norm, kn[l] = y->k_norm;
    }
    kvm_cuda_model_desc d = {.n_layers = L, .dim = c->dim, .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads,
                             .head_dim = c->head_dim, .hidden_dim = c->hidden_dim, .vocab_size = c->vocab_size,
                             .norm_eps = c->norm_eps, .rope_theta = c->rope_theta, .rope_style = c->rope_style,
                             .tok_emb = file_mat(&m->tok_emb), .wcls = file_mat(&m->wcls),
                             .rms_final = m->rms_final, .rms_att = rms_att, .rms_ffn = rms_ffn, .wq = wq, .wk = wk,
                             .wv = wv, .wo = wo, .w1 = w1, .w2 = w2, .w3 = w3, .bq = bq, .bk = bk, .bv = bv,
                             .bo = bo, .q_norm = qn, .k_norm = kn, .rope_table = rope_table, .rope_ctx = c};
    int rc = kvm_cuda_model_new(device, &d, t, ctx, max_batch, out);
    free(v);
    free(w);
    return rc;
}

int kvm_capture_cuda_prefill(kvm_cuda_model *dm, const kvm_model_config *c, const int32_t *tokens, int64_t n,
                             kvm_capture *cap)
{
    const kvm_capture_opts *o = kvm_capture_opts_get(cap);
    int64_t ctx, batch;
    kvm_cuda_model_capacity(dm, &ctx, &batch);
    if (n != kvm_capture_n_tokens(cap) || n > ctx || n > batch || !o->want_queries || !o->want_stats ||
        o->mass_q1 != n)
        return kvm_err(KVM_EINVAL, "device capture: %lld tokens for a capture of %lld (queries %d, statistics %d, mass "
                       "window [%d, %d)) on a device model of %lld entries, batches of %lld: the whole prefill must "
                       "be one batch, with queries, statistics and a mass window to the end",
                       (long long)n, (long long)kvm_capture_n_tokens(cap), o->want_queries, o->want_stats, o->mass_q0,
                       o->mass_q1, (long long)ctx, (long long)batch);
    const int L = c->n_layers, nh = c->n_heads, d = c->head_dim;
    const size_t N = (size_t)n;
    float *ent = malloc((size_t)L * nh * N * sizeof *ent), *km = malloc((size_t)L * nh * (size_t)ctx * sizeof *km);
    float **qs = malloc((size_t)2 * L * sizeof *qs);
    int rc = ent && km && qs ? 0 : kvm_err(KVM_ENOMEM, "device capture: out of memory for %lld tokens", (long long)n);
    for (int l = 0; !rc && l < L; l++) qs[l] = kvm_capture_layer_mut(cap, l)->q_pre, qs[L + l] = kvm_capture_layer_mut(cap, l)->q;
    /* the mass window starts at mass_q0 and runs to the last query, as the host capture's */
    kvm_cuda_stats st = {.entropy = ent, .key_mass = km, .win0 = o->mass_q0, .q_pre = qs, .q_post = qs + L};
    kvm_cuda_model_reset(dm);
    if (!rc) rc = kvm_cuda_model_forward(dm, tokens, n, NULL, 1, &st);
    for (int l = 0; !rc && l < L; l++) {
        kvm_capture_layer *y = kvm_capture_layer_mut(cap, l);
        memcpy(y->entropy, ent + (size_t)l * nh * N, (size_t)nh * N * sizeof *ent);
        for (int h = 0; h < nh; h++) /* rows of ctx entries; a fresh prefill's entry e is position e */
            memcpy(y->mass + (size_t)h * N, km + ((size_t)l * nh + h) * (size_t)ctx, N * sizeof *km);
        for (int g = 0; !rc && g < c->n_kv_heads; g++)
            rc = kvm_cuda_model_download_kv(dm, l, g, y->k + (size_t)g * N * d, y->v + (size_t)g * N * d);
    }
    free(ent);
    free(km);
    free(qs);
    return rc;
}
int kvm_kvcache_cuda_upload(kvm_cuda_model *dm, const kvm_kvcache *c)
{
    if (c->dtype != KVM_KV_F32)
        return kvm_err(KVM_EINVAL, "device cache upload: the cache is %s; the device keeps float32 keys and values",
                       kvm_kvcache_dtype_name(c->dtype));
    int rc = 0;
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int g = 0; !rc && g < c->n_kv_heads; g++) {
            const kvm_kv_head *h = kvm_kvcache_head((kvm_kvcache *)c, l, g);
            rc = kvm_cuda_model_set_kv(dm, l, g, h->k, h->v, h->pos, h->bias, h->n);
        }
    if (!rc) kvm_cuda_model_set_next_pos(dm, c->next_pos);
    return rc;
}
#endif
