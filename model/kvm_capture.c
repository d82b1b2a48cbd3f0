/* kvm_capture.c: KV/query/statistics capture through the forward's hooks: cache_update
 * copies the new keys, values and queries head-major, post_attn reduces each head's
 * probability rows to entropy and received attention mass. */
#include "model/kvm_capture.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct kvm_capture {
    kvm_model_config cfg;
    int64_t n;               /* N */
    kvm_capture_opts o;
    kvm_capture_layer *layers;
    kvm_hooks hooks;
};

static int on_update(void *user, kvm_attn_site *s);
static int on_post(void *user, const kvm_attn_site *s);

int kvm_capture_new(const kvm_model_config *c, int64_t n_tokens, const kvm_capture_opts *o, kvm_capture **out)
{
    *out = NULL;
    if (n_tokens <= 0) return kvm_err(KVM_EINVAL, "capture: %lld tokens", (long long)n_tokens);
    kvm_capture *cap = calloc(1, sizeof *cap);
    if (!cap) return kvm_err(KVM_ENOMEM, "capture: out of memory");
    cap->cfg = *c;
    cap->n = n_tokens;
    cap->o = o ? *o : (kvm_capture_opts){0};
    if (cap->o.mass_q1 <= 0 || cap->o.mass_q1 > n_tokens) cap->o.mass_q1 = (int32_t)n_tokens;
    if (cap->o.mass_q0 < 0 || cap->o.mass_q0 >= cap->o.mass_q1) {
        kvm_capture_free(&cap);
        return kvm_err(KVM_EINVAL, "capture: mass window [%d, %d) is empty or outside [0, %lld)", o->mass_q0,
                       o->mass_q1, (long long)n_tokens);
    }
    size_t N = (size_t)n_tokens, kv = (size_t)c->n_kv_heads * N * c->head_dim, q = (size_t)c->n_heads * N * c->head_dim;
    cap->layers = calloc((size_t)c->n_layers, sizeof *cap->layers);
    int ok = cap->layers != NULL;
    for (int l = 0; ok && l < c->n_layers; l++) {
        kvm_capture_layer *L = &cap->layers[l];
        ok = (L->k = calloc(kv, sizeof(float))) && (L->v = calloc(kv, sizeof(float)));
        if (ok && cap->o.want_queries) ok = (L->q_pre = calloc(q, sizeof(float))) && (L->q = calloc(q, sizeof(float)));
        if (ok && cap->o.want_stats)
            ok = (L->entropy = calloc((size_t)c->n_heads * N, sizeof(float))) &&
                 (L->mass = calloc((size_t)c->n_heads * N, sizeof(float)));
    }
    if (!ok) {
        kvm_capture_free(&cap);
        return kvm_err(KVM_ENOMEM, "capture: out of memory for %lld tokens", (long long)n_tokens);
    }
    cap->hooks = (kvm_hooks){.user = cap, .want_q_pre = cap->o.want_queries, .cache_update = on_update,
                             .post_attn = cap->o.want_stats ? on_post : NULL};
    *out = cap;
    return 0;
}

void kvm_capture_free(kvm_capture **pc)
{
    if (!pc || !*pc) return;
    kvm_capture *c = *pc;
    for (int l = 0; c->layers && l < c->cfg.n_layers; l++) {
        kvm_capture_layer *L = &c->layers[l];
        free(L->k); free(L->v); free(L->q_pre); free(L->q); free(L->entropy); free(L->mass);
    }
    free(c->layers);
    free(c);
    *pc = NULL;
}

const kvm_hooks *kvm_capture_hooks(kvm_capture *cap) { return &cap->hooks; }

const kvm_capture_layer *kvm_capture_layer_get(const kvm_capture *cap, int l) { return &cap->layers[l]; }

kvm_capture_layer *kvm_capture_layer_mut(kvm_capture *cap, int l) { return &cap->layers[l]; }

int64_t kvm_capture_n_tokens(const kvm_capture *cap) { return cap->n; }

/* Copies token-major rows [n_q][n_heads*d] into head-major [n_heads][N][d] at their positions. */
static void scatter(float *dst, const float *src, const int32_t *qpos, int64_t n_q, int n_heads, int d, int64_t N)
{
    for (int64_t i = 0; i < n_q; i++) {
        if (qpos[i] < 0 || qpos[i] >= N) continue;
        for (int h = 0; h < n_heads; h++)
            memcpy(dst + ((int64_t)h * N + qpos[i]) * d, src + (i * n_heads + h) * d, (size_t)d * sizeof(float));
    }
}

static int on_update(void *user, kvm_attn_site *s)
{
    kvm_capture *c = user;
    kvm_capture_layer *L = &c->layers[s->layer];
    const int d = c->cfg.head_dim;
    scatter(L->k, s->k_new, s->qpos, s->n_q, c->cfg.n_kv_heads, d, c->n);
    scatter(L->v, s->v_new, s->qpos, s->n_q, c->cfg.n_kv_heads, d, c->n);
    if (c->o.want_queries) {
        scatter(L->q, s->q, s->qpos, s->n_q, c->cfg.n_heads, d, c->n);
        scatter(L->q_pre, s->q_pre, s->qpos, s->n_q, c->cfg.n_heads, d, c->n);
    }
    return 0;
}

static int on_post(void *user, const kvm_attn_site *s)
{
    kvm_capture *c = user;
    kvm_capture_layer *L = &c->layers[s->layer];
    const kvm_kv_head *kh = kvm_kvcache_head(s->cache, s->layer, s->kv_head);
    float *ent = L->entropy + (int64_t)s->head * c->n, *mass = L->mass + (int64_t)s->head * c->n;
    for (int64_t i = 0; i < s->n_q; i++) {
        int32_t p = s->qpos[i];
        if (p < 0 || p >= c->n) continue;
        const float *row = s->probs + i * s->n_e;
        double h = 0.0;
        for (int64_t e = 0; e < s->n_e; e++)
            if (row[e] > 0.0f) h -= (double)row[e] * log((double)row[e]);
        ent[p] = (float)h;
        if (p < c->o.mass_q0 || p >= c->o.mass_q1) continue;
        for (int64_t e = 0; e < s->n_e; e++) {
            int32_t kp = kh->pos[e];
            if (kp >= 0 && kp < c->n) mass[kp] += row[e];
        }
    }
    return 0;
}
