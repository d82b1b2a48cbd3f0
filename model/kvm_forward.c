/* kvm_forward.c: Llama forward (RMSNorm, RoPE, GQA attention, SwiGLU) in token batches.
 * Every projection of a batch is one GEMM on the backend; attention is one backend call
 * per layer over every head's ragged cache, causal by position, with the statistics the
 * hooks ask for. Hook points cost a NULL test each when nothing is registered. */
#include "model/kvm_forward.h"
#include "common/kvm_error.h"
#include "kernels/kvm_fpmode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct kvm_forward {
    const kvm_model *m;
    const kvm_kernels *k;
    const kvm_prepared *w;                  /* weights prepared for k, owned by the model */
    int64_t max_batch;                      /* tokens per chunk */
    kvm_hooks hooks[KVM_FORWARD_MAX_HOOKS]; /* registered hook sets */
    int n_hooks;
    int want_q_pre;
    unsigned stats;                         /* statistics the post_attn hooks read */
    int has_mass;                           /* a hook set the MASS window below */
    int32_t mass_p0, mass_p1;               /* MASS window of query positions */
    int64_t n_obs;                          /* OBS rows asked for (largest of the hooks) */
    /* scratch, [max_batch][width] token-major */
    float *x, *xb, *q, *q_pre, *kk, *vv, *att, *hb, *hb2, *cos_t, *sin_t;
    int32_t *qpos;
    /* the per-layer attention call: per-KV-head views of the cache (host arrays) */
    const float **kv_k, **kv_v, **kv_bias;
    const uint16_t **kv_k16, **kv_v16;      /* the same for an f16 cache */
    const int32_t **kv_pos;
    int64_t *kv_n;
    /* statistics buffers in backend memory (k->alloc), grown on demand */
    float *st_mass, *st_entropy, *st_lse, *st_obs;
    int64_t st_ld_e;      /* entries per mass/obs row they hold */
    int64_t st_n_obs;     /* obs rows they hold */
    /* kvm_forward_multi's per-sequence scratch, grown on demand (not per call: decode steps) */
    int64_t *mu_R0, *mu_row0; /* [mu_cap + 1] */
    kvm_kvcache **mu_caches;  /* [mu_cap] */
    int *mu_seq;              /* [mu_cap] */
    int mu_cap;
};

int kvm_forward_new(const kvm_model *m, const kvm_kernels *k, int64_t max_batch, kvm_forward **out)
{
    *out = NULL;
    kvm_forward *f = calloc(1, sizeof *f);
    if (!f) return kvm_err(KVM_ENOMEM, "forward: out of memory");
    const kvm_model_config *c = &m->cfg;
    f->m = m;
    f->k = k ? k : kvm_kernels_cpu();
    if (strcmp(f->k->name, "cpu") != 0) { /* its scratch, cache and hooks are host memory */
        free(f);
        return kvm_err(KVM_ENOTSUP,
                       "forward: this command's forward runs on the CPU backend only; on %s, only generate runs "
                       "the model (model/kvm_forward_cuda.h)",
                       k->name);
    }
    int rc = kvm_model_prepare(m, f->k, &f->w);
    if (rc) {
        free(f);
        return rc;
    }
    f->max_batch = max_batch > 0 ? max_batch : c->seq_len;
    size_t B = (size_t)f->max_batch, qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    f->x = malloc(B * c->dim * sizeof(float));
    f->xb = malloc(B * (size_t)(c->dim > (int)qd ? c->dim : (int)qd) * sizeof(float));
    f->q = malloc(B * qd * sizeof(float));
    f->q_pre = malloc(B * qd * sizeof(float));
    f->kk = malloc(B * kvd * sizeof(float));
    f->vv = malloc(B * kvd * sizeof(float));
    f->att = malloc(B * qd * sizeof(float));
    f->hb = malloc(B * c->hidden_dim * sizeof(float));
    f->hb2 = malloc(B * c->hidden_dim * sizeof(float));
    f->cos_t = malloc(B * (size_t)(c->head_dim / 2) * sizeof(float));
    f->sin_t = malloc(B * (size_t)(c->head_dim / 2) * sizeof(float));
    f->qpos = malloc(B * sizeof(int32_t));
    const size_t nkv = (size_t)c->n_kv_heads;
    f->kv_k = malloc(nkv * sizeof *f->kv_k);
    f->kv_v = malloc(nkv * sizeof *f->kv_v);
    f->kv_k16 = malloc(nkv * sizeof *f->kv_k16);
    f->kv_v16 = malloc(nkv * sizeof *f->kv_v16);
    f->kv_bias = malloc(nkv * sizeof *f->kv_bias);
    f->kv_pos = malloc(nkv * sizeof *f->kv_pos);
    f->kv_n = malloc(nkv * sizeof *f->kv_n);
    if (!f->x || !f->xb || !f->q || !f->q_pre || !f->kk || !f->vv || !f->att || !f->hb || !f->hb2 || !f->cos_t ||
        !f->sin_t || !f->qpos || !f->kv_k || !f->kv_v || !f->kv_k16 || !f->kv_v16 || !f->kv_bias || !f->kv_pos || !f->kv_n) {
        kvm_forward_free(&f);
        return kvm_err(KVM_ENOMEM, "forward: out of memory for a batch of %zu tokens", B);
    }
    *out = f;
    return 0;
}

void kvm_forward_free(kvm_forward **pf)
{
    if (!pf || !*pf) return;
    kvm_forward *f = *pf;
    free(f->x); free(f->xb); free(f->q); free(f->q_pre); free(f->kk); free(f->vv); free(f->att);
    free(f->hb); free(f->hb2); free(f->cos_t); free(f->sin_t); free(f->qpos);
    free(f->kv_k); free(f->kv_v); free(f->kv_k16); free(f->kv_v16); free(f->kv_bias); free(f->kv_pos); free(f->kv_n);
    f->k->free(f->st_mass); f->k->free(f->st_entropy); f->k->free(f->st_lse); f->k->free(f->st_obs);
    free(f->mu_R0);
    free(f->mu_row0);
    free(f->mu_caches);
    free(f->mu_seq);
    free(f);
    *pf = NULL;
}

int kvm_forward_add_hooks(kvm_forward *f, const kvm_hooks *h)
{
    if (f->n_hooks == KVM_FORWARD_MAX_HOOKS)
        return kvm_err(KVM_EFULL, "forward: at most %d hook sets", KVM_FORWARD_MAX_HOOKS);
    const unsigned st = h->post_attn ? h->stats : 0;
    int32_t p0 = h->mass_p0, p1 = h->mass_p1;
    if (p1 <= p0) { /* every query */
        p0 = INT32_MIN;
        p1 = INT32_MAX;
    }
    if ((st & KVM_ATTN_STAT_MASS) && f->has_mass && (p0 != f->mass_p0 || p1 != f->mass_p1))
        return kvm_err(KVM_EINVAL, "forward: hook set %d asks for the attention mass over positions [%d, %d), another "
                                   "set over [%d, %d)", f->n_hooks, p0, p1, f->mass_p0, f->mass_p1);
    if ((st & KVM_ATTN_STAT_OBS) && h->n_obs < 1)
        return kvm_err(KVM_EINVAL, "forward: hook set %d asks for observation rows with n_obs = %lld", f->n_hooks,
                       (long long)h->n_obs);
    if (st & KVM_ATTN_STAT_MASS) {
        f->has_mass = 1;
        f->mass_p0 = p0;
        f->mass_p1 = p1;
    }
    if ((st & KVM_ATTN_STAT_OBS) && h->n_obs > f->n_obs) f->n_obs = h->n_obs;
    f->hooks[f->n_hooks++] = *h;
    f->want_q_pre |= h->want_q_pre;
    f->stats |= st;
    return 0;
}

void kvm_forward_clear_hooks(kvm_forward *f)
{
    f->n_hooks = 0;
    f->want_q_pre = 0;
    f->stats = 0;
    f->has_mass = 0;
    f->n_obs = 0;
}

int kvm_forward_cache_new(const kvm_model *m, int64_t cap, kvm_kvcache **out)
{
    return kvm_kvcache_new(m->cfg.n_layers, m->cfg.n_kv_heads, m->cfg.head_dim, cap, out);
}

int kvm_forward_cache_new_dtype(const kvm_model *m, int64_t cap, kvm_kv_dtype dtype, kvm_kvcache **out)
{
    return kvm_kvcache_new_dtype(m->cfg.n_layers, m->cfg.n_kv_heads, m->cfg.head_dim, cap, dtype, out);
}

/* Replaces *buf by a backend buffer of n floats (old contents dropped). */
static int regrow(const kvm_kernels *k, float **buf, size_t n)
{
    k->free(*buf);
    *buf = k->alloc(n * sizeof **buf);
    return *buf ? 0 : kvm_err(KVM_ENOMEM, "forward: out of memory for attention statistics of %zu floats", n);
}

/* Grows the statistics buffers to rows of ld_e entries and n_obs observation rows. */
static int ensure_stats(kvm_forward *f, int64_t ld_e, int64_t n_obs)
{
    const kvm_model_config *c = &f->m->cfg;
    const size_t H = (size_t)c->n_heads;
    int rc = 0;
    if (!f->st_entropy && (f->stats & KVM_ATTN_STAT_ENTROPY))
        rc = regrow(f->k, &f->st_entropy, H * (size_t)f->max_batch);
    if (!rc && !f->st_lse && (f->stats & KVM_ATTN_STAT_LSE)) rc = regrow(f->k, &f->st_lse, H * (size_t)f->max_batch);
    if (rc) return rc;
    const int need_mass = (f->stats & KVM_ATTN_STAT_MASS) != 0, need_obs = (f->stats & KVM_ATTN_STAT_OBS) != 0;
    if (ld_e <= f->st_ld_e && n_obs <= f->st_n_obs && (f->st_mass || !need_mass) && (f->st_obs || !need_obs)) return 0;
    const int64_t ld = ld_e > f->st_ld_e ? (ld_e < 2 * f->st_ld_e ? 2 * f->st_ld_e : ld_e) : f->st_ld_e;
    const int64_t no = n_obs > f->st_n_obs ? n_obs : f->st_n_obs;
    f->k->free(f->st_mass);
    f->k->free(f->st_obs);
    f->st_mass = f->st_obs = NULL;
    f->st_ld_e = f->st_n_obs = 0;
    if (need_mass && (rc = regrow(f->k, &f->st_mass, H * (size_t)ld))) return rc;
    if (need_obs && (rc = regrow(f->k, &f->st_obs, H * (size_t)(no > 0 ? no : 1) * (size_t)ld))) return rc;
    f->st_ld_e = ld;
    f->st_n_obs = no;
    return 0;
}

/* Appends this chunk's keys/values to every KV head of the layer (rounded to f16 in an f16
 * cache: the only place the forward writes the cache). */
static int append_kv(kvm_kvcache *cache, int layer, const float *kk, const float *vv, const int32_t *pos, int64_t n)
{
    const int d = cache->head_dim, nkv = cache->n_kv_heads;
    for (int g = 0; g < nkv; g++) {
        kvm_kv_head *h = kvm_kvcache_head(cache, layer, g);
        int rc = kvm_kvcache_reserve(h, d, h->n + n);
        if (rc) return rc;
        for (int64_t i = 0; i < n; i++) /* room reserved: the append cannot fail */
            kvm_kvcache_append(h, d, kk + (i * nkv + g) * d, vv + (i * nkv + g) * d, pos[i], 0.0f);
    }
    return 0;
}

/* One attention call over every query head of site->cache's layer for site's queries (rows of
 * the call's scratch), outputs to out, then the post_attn hooks once with its outputs and
 * statistics. */
static int attend(kvm_forward *f, kvm_attn_site *site, float *out)
{
    const kvm_model_config *c = &f->m->cfg;
    const int d = c->head_dim;
    const int64_t n = site->n_q, ld = (int64_t)c->n_heads * d;
    int64_t max_e = 1;
    for (int g = 0; g < c->n_kv_heads; g++) {
        const kvm_kv_head *kh = kvm_kvcache_head(site->cache, site->layer, g);
        f->kv_k[g] = kh->k;
        f->kv_v[g] = kh->v;
        f->kv_k16[g] = kh->k16;
        f->kv_v16[g] = kh->v16;
        f->kv_pos[g] = kh->pos;
        f->kv_bias[g] = kh->bias;
        f->kv_n[g] = kh->n;
        max_e = kh->n > max_e ? kh->n : max_e;
    }
    const int64_t n_obs = f->n_obs < n ? f->n_obs : n;
    int rc = f->stats ? ensure_stats(f, max_e, n_obs) : 0;
    if (rc) return rc;
    kvm_attn_layer a = {.n_heads = c->n_heads,
                        .n_kv_heads = c->n_kv_heads,
                        .head_dim = d,
                        .scale = 1.0f / sqrtf((float)d),
                        .q = site->q,
                        .ldq = ld,
                        .qpos = site->qpos,
                        .n_q = n,
                        .k = f->kv_k,
                        .v = f->kv_v,
                        .kv_dtype = site->cache->dtype,
                        .k16 = f->kv_k16,
                        .v16 = f->kv_v16,
                        .pos = f->kv_pos,
                        .bias = f->kv_bias,
                        .n_e = f->kv_n,
                        .out = out,
                        .ldo = ld,
                        .stats = f->stats,
                        .mass_p0 = f->mass_p0,
                        .mass_p1 = f->mass_p1,
                        .n_obs = n_obs,
                        .ld_e = f->st_ld_e,
                        .mass = f->st_mass,
                        .entropy = f->st_entropy,
                        .lse = f->st_lse,
                        .obs = f->st_obs};
    if ((rc = f->k->attention(&a))) return rc;
    site->attn = &a;
    for (int i = 0; i < f->n_hooks; i++)
        if (f->hooks[i].post_attn && (rc = f->hooks[i].post_attn(f->hooks[i].user, site))) break;
    site->attn = NULL;
    return rc;
}

/* The attention step of layer l for rows [r0, r0 + n) of this call's post-RoPE f->q, f->kk,
 * f->vv at positions f->qpos[r0..r0 + n), over cache: cache append, the cache_update and
 * pre_attn hooks, the kernel and post_attn; the outputs are left in those rows of f->att. */
static int attend_step(kvm_forward *f, kvm_kvcache *cache, int l, int64_t r0, int64_t n, kvm_phase phase)
{
    const kvm_model_config *c = &f->m->cfg;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, kvd = (int64_t)c->n_kv_heads * c->head_dim;
    int rc;
    if ((rc = append_kv(cache, l, f->kk + r0 * kvd, f->vv + r0 * kvd, f->qpos + r0, n))) return rc;
    kvm_attn_site site = {.layer = l,
                          .phase = phase,
                          .kernels = f->k,
                          .n_q = n,
                          .qpos = f->qpos + r0,
                          .q = f->q + r0 * qd,
                          .q_pre = f->want_q_pre ? f->q_pre + r0 * qd : NULL,
                          .k_new = f->kk + r0 * kvd,
                          .v_new = f->vv + r0 * kvd,
                          .cache = cache};
    for (int i = 0; i < f->n_hooks; i++)
        if (f->hooks[i].cache_update && (rc = f->hooks[i].cache_update(f->hooks[i].user, &site))) return rc;
    for (int i = 0; i < f->n_hooks; i++)
        if (f->hooks[i].pre_attn && (rc = f->hooks[i].pre_attn(f->hooks[i].user, &site))) return rc;
    if (site.cache->n_layers != cache->n_layers || site.cache->n_kv_heads != cache->n_kv_heads ||
        site.cache->head_dim != cache->head_dim)
        return kvm_err(KVM_EINVAL, "forward: layer %d: a pre_attn hook substituted a cache of another shape", l);
    return attend(f, &site, f->att + r0 * qd);
}

/* y[i][:] += b for each of n rows of width w (a projection's bias). */
static void add_bias(const kvm_kernels *k, float *y, const float *b, int64_t n, int64_t w)
{
    for (int64_t i = 0; i < n; i++)
        k->add(y + i * w, b, w);
}

/* The sequences of one call: sequence s owns rows [row0[s], row0[s + 1]) of the scratch and
 * attends over, and appends to, caches[s] alone. A plain prefill is one sequence. */
typedef struct fw_seqs {
    kvm_kvcache *const *caches;
    const int64_t *row0; /* [n + 1] */
    int n;
} fw_seqs;

/* One layer's attention block over the call's n rows: norm, QKV (+ biases, QK-norm), RoPE,
 * then each sequence's cache append, hooks and attention, then the output projection. */
static int attention_block(kvm_forward *f, const fw_seqs *sq, int l, int64_t n, kvm_phase phase)
{
    const kvm_model_config *c = &f->m->cfg;
    const kvm_layer_weights *w = &f->m->layers[l];
    const kvm_kernels *k = f->k;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, kvd = (int64_t)c->n_kv_heads * c->head_dim;
    k->rmsnorm(f->xb, f->x, w->rms_att, n, c->dim, c->norm_eps);
    int rc;
    const kvm_prepared_layer *pw = &f->w->layers[l];
    if ((rc = k->matmul(f->xb, n, c->dim, pw->wq, f->q, qd)) || (rc = k->matmul(f->xb, n, c->dim, pw->wk, f->kk, kvd)) ||
        (rc = k->matmul(f->xb, n, c->dim, pw->wv, f->vv, kvd)))
        return rc;
    if (w->bq) add_bias(k, f->q, w->bq, n, qd);
    if (w->bk) add_bias(k, f->kk, w->bk, n, kvd);
    if (w->bv) add_bias(k, f->vv, w->bv, n, kvd);
    if (w->q_norm) k->rmsnorm(f->q, f->q, w->q_norm, n * c->n_heads, c->head_dim, c->norm_eps);
    if (w->k_norm) k->rmsnorm(f->kk, f->kk, w->k_norm, n * c->n_kv_heads, c->head_dim, c->norm_eps);
    if (f->want_q_pre) memcpy(f->q_pre, f->q, (size_t)(n * qd) * sizeof(float));
    k->rope(f->q, n, qd, c->n_heads, c->head_dim, f->cos_t, f->sin_t, c->rope_style);
    k->rope(f->kk, n, kvd, c->n_kv_heads, c->head_dim, f->cos_t, f->sin_t, c->rope_style);
    for (int s = 0; s < sq->n; s++)
        if ((rc = attend_step(f, sq->caches[s], l, sq->row0[s], sq->row0[s + 1] - sq->row0[s], phase))) return rc;
    if ((rc = k->matmul(f->att, n, qd, pw->wo, f->xb, c->dim))) return rc;
    if (w->bo) add_bias(k, f->xb, w->bo, n, c->dim);
    k->add(f->x, f->xb, n * c->dim);
    return 0;
}

static int ffn_block(kvm_forward *f, int l, int64_t n)
{
    const kvm_model_config *c = &f->m->cfg;
    const kvm_layer_weights *w = &f->m->layers[l];
    const kvm_kernels *k = f->k;
    const int64_t H = c->hidden_dim;
    int rc;
    k->rmsnorm(f->xb, f->x, w->rms_ffn, n, c->dim, c->norm_eps);
    const kvm_prepared_layer *pw = &f->w->layers[l];
    if ((rc = k->matmul(f->xb, n, c->dim, pw->w1, f->hb, H)) || (rc = k->matmul(f->xb, n, c->dim, pw->w3, f->hb2, H)))
        return rc;
    k->swiglu(f->hb, f->hb2, n * H);
    if ((rc = k->matmul(f->hb, n, H, pw->w2, f->xb, c->dim))) return rc;
    k->add(f->x, f->xb, n * c->dim);
    return 0;
}

/* Rows [r0, r0 + n) of the scratch: the embeddings of tok[n] at positions cache->next_pos + i. */
static void fill_rows(kvm_forward *f, const kvm_kvcache *cache, const int32_t *tok, int64_t r0, int64_t n)
{
    const kvm_model_config *c = &f->m->cfg;
    for (int64_t i = 0; i < n; i++) {
        kvm_model_embed(f->m, tok[i], f->x + (r0 + i) * c->dim);
        f->qpos[r0 + i] = cache->next_pos + (int32_t)i;
    }
}

/* Every layer over the call's n rows (filled by fill_rows), then each sequence's next_pos
 * advanced past its rows. */
static int run_layers(kvm_forward *f, const fw_seqs *sq, int64_t n, kvm_phase phase)
{
    const kvm_model_config *c = &f->m->cfg;
    kvm_model_rope_table(c, f->qpos, n, f->cos_t, f->sin_t);
    int rc;
    for (int l = 0; l < c->n_layers; l++)
        if ((rc = attention_block(f, sq, l, n, phase)) || (rc = ffn_block(f, l, n))) return rc;
    for (int s = 0; s < sq->n; s++)
        sq->caches[s]->next_pos += (int32_t)(sq->row0[s + 1] - sq->row0[s]);
    return 0;
}

/* One chunk of at most max_batch tokens. logits: rows for this chunk per mode. */
static int run_chunk(kvm_forward *f, kvm_kvcache *cache, const int32_t *tok, int64_t n, float *logits,
                     kvm_logits_mode mode, kvm_phase phase)
{
    const kvm_model_config *c = &f->m->cfg;
    const int64_t row0[2] = {0, n};
    const fw_seqs sq = {&cache, row0, 1};
    fill_rows(f, cache, tok, 0, n);
    int rc = run_layers(f, &sq, n, phase);
    if (rc || mode == KVM_LOGITS_NONE || !logits) return rc;
    int64_t first = mode == KVM_LOGITS_LAST ? n - 1 : 0, rows = n - first;
    f->k->rmsnorm(f->xb, f->x + first * c->dim, f->m->rms_final, rows, c->dim, c->norm_eps);
    return f->k->matmul(f->xb, rows, c->dim, f->w->wcls, logits, c->vocab_size);
}

/* The checks a call makes before it touches cache: its shape, positions, the model's window,
 * token ids. */
static int check_tokens(const kvm_forward *f, const kvm_kvcache *cache, const int32_t *tokens, int64_t n)
{
    const kvm_model_config *c = &f->m->cfg;
    if (n <= 0) return kvm_err(KVM_EINVAL, "forward: %lld tokens", (long long)n);
    if (cache->n_layers != c->n_layers || cache->n_kv_heads != c->n_kv_heads || cache->head_dim != c->head_dim)
        return kvm_err(KVM_EINVAL, "forward: cache shape %dx%dx%d is not the model's %dx%dx%d", cache->n_layers,
                       cache->n_kv_heads, cache->head_dim, c->n_layers, c->n_kv_heads, c->head_dim);
    if ((int64_t)cache->next_pos + n > INT32_MAX)
        return kvm_err(KVM_ERANGE, "forward: position %lld exceeds int32", (long long)cache->next_pos + n);
    if (c->sliding_window > 0 && (int64_t)cache->next_pos + n > c->sliding_window)
        return kvm_err(KVM_ENOTSUP,
                       "%s/config.json: sliding_window = %d: positions up to %lld exceed it (windowed attention "
                       "is not implemented; contexts up to the window work)",
                       f->m->path, c->sliding_window, (long long)cache->next_pos + n);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return kvm_err(KVM_EINVAL, "forward: token %lld has id %d outside [0, %d)", (long long)i, tokens[i],
                           c->vocab_size);
    return 0;
}

static int run(kvm_forward *f, kvm_kvcache *cache, const int32_t *tokens, int64_t n, float *logits,
               kvm_logits_mode mode, kvm_phase phase)
{
    const kvm_model_config *c = &f->m->cfg;
    int rc = check_tokens(f, cache, tokens, n);
    for (int64_t i0 = 0; !rc && i0 < n; i0 += f->max_batch) {
        int64_t nb = n - i0 < f->max_batch ? n - i0 : f->max_batch;
        int last = i0 + nb == n;
        float *lg = NULL;
        kvm_logits_mode md = KVM_LOGITS_NONE;
        if (mode == KVM_LOGITS_ALL) { lg = logits ? logits + i0 * c->vocab_size : NULL; md = mode; }
        else if (mode == KVM_LOGITS_LAST && last) { lg = logits; md = mode; }
        rc = run_chunk(f, cache, tokens + i0, nb, lg, md, phase);
    }
    return rc;
}

int kvm_forward_prefill(kvm_forward *f, kvm_kvcache *cache, const int32_t *tokens, int64_t n, float *logits,
                        kvm_logits_mode mode)
{
    kvm_fpmode fm = kvm_fpmode_flush_enter(); /* subnormals flushed while this thread computes */
    int rc = run(f, cache, tokens, n, logits, mode, KVM_PHASE_PREFILL);
    kvm_fpmode_restore(fm);
    return rc;
}

int kvm_forward_decode(kvm_forward *f, kvm_kvcache *cache, int32_t token, float *logits)
{
    kvm_fpmode fm = kvm_fpmode_flush_enter();
    int rc = run(f, cache, &token, 1, logits, logits ? KVM_LOGITS_LAST : KVM_LOGITS_NONE, KVM_PHASE_DECODE);
    kvm_fpmode_restore(fm);
    return rc;
}

/* kvm_forward_multi's checks, all before any cache changes; *rows gets the call's row count. */
static int check_multi(const kvm_forward *f, kvm_kvcache *const *caches, const int32_t *const *tokens, const int64_t *n,
                       int n_seq, const int64_t *n_logits, int64_t *rows)
{
    if (n_seq < 1) return kvm_err(KVM_EINVAL, "forward: multi: %d sequences", n_seq);
    if (f->n_hooks)
        return kvm_err(KVM_EINVAL, "forward: multi: %d hook sets registered (hooks see one cache a call)", f->n_hooks);
    int64_t r = 0;
    for (int s = 0; s < n_seq; s++) {
        int rc = check_tokens(f, caches[s], tokens[s], n[s]);
        if (rc) return kvm_err(rc, "forward: multi: sequence %d: %s", s, kvm_errmsg());
        if (n_logits && (n_logits[s] < 0 || n_logits[s] > n[s]))
            return kvm_err(KVM_EINVAL, "forward: multi: sequence %d asks for %lld logits rows of %lld tokens", s,
                           (long long)n_logits[s], (long long)n[s]);
        for (int t = 0; t < s; t++)
            if (caches[t] == caches[s])
                return kvm_err(KVM_EINVAL, "forward: multi: sequences %d and %d share one cache", t, s);
        r += n[s];
    }
    *rows = r;
    return 0;
}

/* A chunk of kvm_forward_multi's rows: the parts of sequences it holds. */
typedef struct multi_chunk {
    kvm_kvcache **caches; /* [parts] */
    int64_t *row0;        /* [parts + 1], rows within the chunk */
    int *seq;             /* [parts] the sequence of each part */
    int parts;
} multi_chunk;

/* Rows [i0, i1) of the call (R0: each sequence's first row in it): fills the scratch with the
 * parts of the sequences they cut, runs every layer, and writes the logits rows asked for that
 * fall in the chunk at logits + *out_row rows (advanced). */
static int multi_rows(kvm_forward *f, kvm_kvcache *const *caches, const int32_t *const *tokens, int n_seq,
                      const int64_t *R0, const int64_t *n_logits, float *logits, int64_t i0, int64_t i1,
                      multi_chunk *ch, int64_t *out_row)
{
    const kvm_model_config *c = &f->m->cfg;
    ch->parts = 0;
    ch->row0[0] = 0;
    for (int s = 0; s < n_seq; s++) {
        const int64_t a = R0[s] > i0 ? R0[s] : i0, b = R0[s + 1] < i1 ? R0[s + 1] : i1;
        if (a >= b) continue;
        fill_rows(f, caches[s], tokens[s] + (a - R0[s]), a - i0, b - a);
        ch->caches[ch->parts] = caches[s];
        ch->seq[ch->parts] = s;
        ch->row0[ch->parts + 1] = ch->row0[ch->parts] + (b - a);
        ch->parts++;
    }
    const fw_seqs sq = {ch->caches, ch->row0, ch->parts};
    int rc = run_layers(f, &sq, i1 - i0, KVM_PHASE_PREFILL);
    int64_t rows = 0;
    for (int p = 0; !rc && logits && n_logits && p < ch->parts; p++) { /* the rows asked for, packed in xb */
        const int s = ch->seq[p];
        const int64_t b = i0 + ch->row0[p + 1], want = R0[s + 1] - n_logits[s], a = i0 + ch->row0[p];
        const int64_t first = want > a ? want : a;
        if (first >= b) continue;
        f->k->rmsnorm(f->xb + rows * c->dim, f->x + (first - i0) * c->dim, f->m->rms_final, b - first, c->dim,
                      c->norm_eps);
        rows += b - first;
    }
    if (!rc && rows > 0)
        rc = f->k->matmul(f->xb, rows, c->dim, f->w->wcls, logits + *out_row * c->vocab_size, c->vocab_size);
    *out_row += rows;
    return rc;
}

/* Room in f's multi scratch for n sequences. */
static int multi_room(kvm_forward *f, int n)
{
    if (n <= f->mu_cap) return 0;
    int64_t *R0 = realloc(f->mu_R0, ((size_t)n + 1) * sizeof *R0);
    if (R0) f->mu_R0 = R0;
    int64_t *row0 = realloc(f->mu_row0, ((size_t)n + 1) * sizeof *row0);
    if (row0) f->mu_row0 = row0;
    kvm_kvcache **cs = realloc(f->mu_caches, (size_t)n * sizeof *cs);
    if (cs) f->mu_caches = cs;
    int *seq = realloc(f->mu_seq, (size_t)n * sizeof *seq);
    if (seq) f->mu_seq = seq;
    if (!R0 || !row0 || !cs || !seq) return kvm_err(KVM_ENOMEM, "forward: multi: out of memory for %d sequences", n);
    f->mu_cap = n;
    return 0;
}

int kvm_forward_multi(kvm_forward *f, kvm_kvcache *const *caches, const int32_t *const *tokens, const int64_t *n,
                      int n_seq, const int64_t *n_logits, float *logits)
{
    int64_t rows = 0, out_row = 0;
    int rc = check_multi(f, caches, tokens, n, n_seq, n_logits, &rows);
    if (!rc) rc = multi_room(f, n_seq);
    if (rc) return rc;
    int64_t *R0 = f->mu_R0;
    for (int s = 0; s <= n_seq; s++)
        R0[s] = s ? R0[s - 1] + n[s - 1] : 0;
    multi_chunk ch = {f->mu_caches, f->mu_row0, f->mu_seq, 0};
    kvm_fpmode fm = kvm_fpmode_flush_enter();
    for (int64_t i0 = 0; !rc && i0 < rows; i0 += f->max_batch) /* chunks may cut a sequence: its rest follows */
        rc = multi_rows(f, caches, tokens, n_seq, R0, n_logits, logits, i0,
                        rows - i0 < f->max_batch ? rows : i0 + f->max_batch, &ch, &out_row);
    kvm_fpmode_restore(fm);
    return rc;
}

int kvm_forward_attend(kvm_forward *f, kvm_kvcache *cache, int layer, kvm_phase phase, const float *q,
                       const float *k_new, const float *v_new, const int32_t *qpos, int64_t n, float *out)
{
    const kvm_model_config *c = &f->m->cfg;
    const int64_t qd = (int64_t)c->n_heads * c->head_dim, kvd = (int64_t)c->n_kv_heads * c->head_dim;
    if (layer < 0 || layer >= c->n_layers || n < 1 || n > f->max_batch)
        return kvm_err(KVM_EINVAL, "forward: attend: layer %d of %d, %lld queries (1..%lld)", layer, c->n_layers,
                       (long long)n, (long long)f->max_batch);
    if (cache->n_layers != c->n_layers || cache->n_kv_heads != c->n_kv_heads || cache->head_dim != c->head_dim)
        return kvm_err(KVM_EINVAL, "forward: attend: cache shape %dx%dx%d is not the model's %dx%dx%d",
                       cache->n_layers, cache->n_kv_heads, cache->head_dim, c->n_layers, c->n_kv_heads, c->head_dim);
    if (f->want_q_pre)
        return kvm_err(KVM_EINVAL, "forward: attend: a hook asks for pre-RoPE queries, which a replayed step lacks");
    /* the forward's scratch is host memory (kvm_forward_new accepts the CPU backend only) */
    memcpy(f->q, q, (size_t)(n * qd) * sizeof *q);
    memcpy(f->kk, k_new, (size_t)(n * kvd) * sizeof *k_new);
    memcpy(f->vv, v_new, (size_t)(n * kvd) * sizeof *v_new);
    memcpy(f->qpos, qpos, (size_t)n * sizeof *qpos);
    kvm_fpmode fm = kvm_fpmode_flush_enter();
    int rc = attend_step(f, cache, layer, 0, n, phase);
    kvm_fpmode_restore(fm);
    if (!rc) memcpy(out, f->att, (size_t)(n * qd) * sizeof *out);
    return rc;
}
