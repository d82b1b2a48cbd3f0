/* kvm_forward_cuda.c: kvm_model → kvm_cuda_model_desc (the per-layer tensor arrays the device
 * model uploads from), see kvm_forward_cuda.h. */
#include "model/kvm_forward_cuda.h"

#ifdef KVM_WITH_CUDA
#include "common/kvm_error.h"

#include <stdlib.h>

/* Matrix w [out][in] as float32: the file's own rows when they are float32, else a dequantised
 * copy appended to *owned (released by the caller after the upload). */
static const float *mat_f32(const kvm_mat *w, int64_t out, int64_t in, float ***owned, int *n_owned)
{
    if (w->type == KVM_MAT_F32) return (const float *)w->data;
    float *p = malloc((size_t)(out * in) * sizeof *p);
    if (!p) return NULL;
    if (kvm_model_mat_rows(w, in, 0, out, p)) {
        free(p);
        return NULL;
    }
    (*owned)[(*n_owned)++] = p;
    return p;
}

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
    /* the device keeps its own copies (f32, or converted to bf16/f16 on the device): matrices not
     * float32 in the file (GGUF blocks, 16-bit safetensors) are dequantised on the host once, for
     * the upload only (a host float32 copy of those matrices lives until kvm_cuda_model_new returns) */
    float **owned = calloc((size_t)7 * c->n_layers + 2, sizeof *owned);
    int n_owned = 0, bad = !owned;
    const int64_t D = c->dim, H = c->hidden_dim, V = c->vocab_size, qd = (int64_t)c->n_heads * c->head_dim,
                  kvd = (int64_t)c->n_kv_heads * c->head_dim;
    for (int l = 0; l < c->n_layers && !bad; l++) {
        const kvm_layer_weights *w = &m->layers[l];
        rms_att[l] = w->rms_att, rms_ffn[l] = w->rms_ffn;
        bad |= !(wq[l] = mat_f32(&w->wq, qd, D, &owned, &n_owned)) || !(wk[l] = mat_f32(&w->wk, kvd, D, &owned, &n_owned)) ||
               !(wv[l] = mat_f32(&w->wv, kvd, D, &owned, &n_owned)) || !(wo[l] = mat_f32(&w->wo, D, qd, &owned, &n_owned)) ||
               !(w1[l] = mat_f32(&w->w1, H, D, &owned, &n_owned)) || !(w2[l] = mat_f32(&w->w2, D, H, &owned, &n_owned)) ||
               !(w3[l] = mat_f32(&w->w3, H, D, &owned, &n_owned));
        bq[l] = w->bq, bk[l] = w->bk, bv[l] = w->bv, bo[l] = w->bo, qn[l] = w->q_norm, kn[l] = w->k_norm;
    }
    const float *emb = bad ? NULL : mat_f32(&m->tok_emb, V, D, &owned, &n_owned);
    const float *cls = !emb ? NULL : m->wcls.data == m->tok_emb.data ? emb : mat_f32(&m->wcls, V, D, &owned, &n_owned);
    if (!cls) {
        for (int i = 0; i < n_owned; i++) free(owned[i]);
        free(owned);
        free(a);
        return kvm_err(KVM_ENOMEM, "cuda:%d: cannot dequantise the weights for the upload (%s)", device, kvm_errmsg());
    }
    kvm_cuda_model_desc d = {.n_layers = c->n_layers, .dim = c->dim, .n_heads = c->n_heads,
                             .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .hidden_dim = c->hidden_dim,
                             .vocab_size = c->vocab_size, .norm_eps = c->norm_eps, .rope_theta = c->rope_theta,
                             .rope_style = c->rope_style, .tok_emb = emb, .rms_final = m->rms_final,
                             .wcls = cls, .rms_att = rms_att, .rms_ffn = rms_ffn, .wq = wq, .wk = wk, .wv = wv,
                             .wo = wo, .w1 = w1, .w2 = w2, .w3 = w3, .bq = bq, .bk = bk, .bv = bv, .bo = bo,
                             .q_norm = qn, .k_norm = kn, .rope_table = rope_table, .rope_ctx = c};
    int rc = kvm_cuda_model_new(device, &d, t, ctx, max_batch, out);
    for (int i = 0; i < n_owned; i++) free(owned[i]);
    free(owned);
    free(a);
    return rc;
}
#endif
