/* kvm_forward_cuda.c: kvm_model → kvm_cuda_model_desc (the per-layer tensor arrays the device
 * model uploads from), see kvm_forward_cuda.h. */
#include "model/kvm_forward_cuda.h"

#ifdef KVM_WITH_CUDA
#include "common/kvm_error.h"

#include <stdlib.h>

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
    enum { N_ARR = 15 };
    const float **a = calloc((size_t)N_ARR * c->n_layers, sizeof *a);
    if (!a) return kvm_err(KVM_ENOMEM, "out of memory");
    const float **rms_att = a, **rms_ffn = a + c->n_layers, **wq = a + 2 * c->n_layers, **wk = a + 3 * c->n_layers,
                **wv = a + 4 * c->n_layers, **wo = a + 5 * c->n_layers, **w1 = a + 6 * c->n_layers,
                **w2 = a + 7 * c->n_layers, **w3 = a + 8 * c->n_layers, **bq = a + 9 * c->n_layers,
                **bk = a + 10 * c->n_layers, **bv = a + 11 * c->n_layers, **bo = a + 12 * c->n_layers,
                **qn = a + 13 * c->n_layers, **kn = a + 14 * c->n_layers;
    for (int l = 0; l < c->n_layers; l++) {
        const kvm_layer_weights *w = &m->layers[l];
        rms_att[l] = w->rms_att, rms_ffn[l] = w->rms_ffn, wq[l] = w->wq, wk[l] = w->wk, wv[l] = w->wv;
        wo[l] = w->wo, w1[l] = w->w1, w2[l] = w->w2, w3[l] = w->w3;
        bq[l] = w->bq, bk[l] = w->bk, bv[l] = w->bv, bo[l] = w->bo, qn[l] = w->q_norm, kn[l] = w->k_norm;
    }
    kvm_cuda_model_desc d = {.n_layers = c->n_layers, .dim = c->dim, .n_heads = c->n_heads,
                             .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .hidden_dim = c->hidden_dim,
                             .vocab_size = c->vocab_size, .norm_eps = c->norm_eps, .rope_theta = c->rope_theta,
                             .rope_style = c->rope_style, .tok_emb = m->tok_emb, .rms_final = m->rms_final,
                             .wcls = m->wcls, .rms_att = rms_att, .rms_ffn = rms_ffn, .wq = wq, .wk = wk, .wv = wv,
                             .wo = wo, .w1 = w1, .w2 = w2, .w3 = w3, .bq = bq, .bk = bk, .bv = bv, .bo = bo,
                             .q_norm = qn, .k_norm = kn, .rope_table = rope_table, .rope_ctx = c};
    int rc = kvm_cuda_model_new(device, &d, t, ctx, max_batch, out);
    free(a);
    return rc;
}
#endif
