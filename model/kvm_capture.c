/* kvm_capture.c: KV/query/statistics capture through the forward's hooks: cache_update
 * downloads the new keys, values and queries and stores them head-major; post_attn
 * downloads the per-head entropy and received-mass statistics the attention kernel made
 * (kvm_attn_layer) and files them by position. */
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
    float *stage;            /* host staging for downloads, stage_cap floats */
    size_t stage_cap;
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
                             .post_attn = cap->o.want_stats ? on_post : NULL,
                             .stats = cap->o.want_stats ? KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_MASS : 0,
                             .mass_p0 = cap->o.mass_q0, .mass_p1 = cap->o.mass_q1};
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
    free(c->stage);
    free(c);
    *pc = NULL;
}

const kvm_hooks *kvm_capture_hooks(kvm_capture *cap) { return &cap->hooks; }

const kvm_capture_layer *kvm_capture_layer_get(const kvm_capture *cap, int l) { return &cap->layers[l]; }

kvm_capture_layer *kvm_capture_layer_mut(kvm_capture *cap, int l) { return &cap->layers[l]; }

int64_t kvm_capture_n_tokens(const kvm_capture *cap) { return cap->n; }

const kvm_capture_opts *kvm_capture_opts_get(const kvm_capture *cap) { return &cap->o; }

/* Rows [0, n) of each of `heads` blocks of d floats: src [heads][ns][d] -> dst [heads][nd][d]. */
static void copy_rows(float *dst, int64_t nd, const float *src, int64_t ns, int heads, int d, int64_t n)
{
    for (int h = 0; dst && h < heads; h++)
        memcpy(dst + (int64_t)h * nd * d, src + (int64_t)h * ns * d, (size_t)(n * d) * sizeof *dst);
}

int kvm_capture_copy_prefix(kvm_capture *dst, const kvm_capture *src, int64_t n)
{
    const kvm_model_config *c = &dst->cfg;
    if (c->n_layers != src->cfg.n_layers || c->n_heads != src->cfg.n_heads || c->n_kv_heads != src->cfg.n_kv_heads ||
        c->head_dim != src->cfg.head_dim || dst->o.want_queries != src->o.want_queries ||
        dst->o.want_stats != src->o.want_stats || dst->o.mass_q0 != src->o.mass_q0 || n < 0 || n > dst->n ||
        n > src->n || n > dst->o.mass_q1 || n > src->o.mass_q1)
        return kvm_err(KVM_EINVAL, "capture: cannot copy %lld positions between captures of %lld and %lld (shapes or options differ)",
                       (long long)n, (long long)src->n, (long long)dst->n);
    for (int l = 0; l < c->n_layers; l++) {
        kvm_capture_layer *D = &dst->layers[l];
        const kvm_capture_layer *S = &src->layers[l];
        copy_rows(D->k, dst->n, S->k, src->n, c->n_kv_heads, c->head_dim, n);
        copy_rows(D->v, dst->n, S->v, src->n, c->n_kv_heads, c->head_dim, n);
        copy_rows(D->q, dst->n, S->q, src->n, c->n_heads, c->head_dim, n);
        copy_rows(D->q_pre, dst->n, S->q_pre, src->n, c->n_heads, c->head_dim, n);
        copy_rows(D->entropy, dst->n, S->entropy, src->n, c->n_heads, 1, n);
        copy_rows(D->mass, dst->n, S->mass, src->n, c->n_heads, 1, n);
    }
    return 0;
}

/* Host staging of at least n floats for a download. */
static float *stage(kvm_capture *c, size_t n)
{
    if (n > c->stage_cap) {
        float *p = realloc(c->stage, n * sizeof *p);
        if (!p) return NULL;
        c->stage = p;
        c->stage_cap = n;
    }
    return c->stage;
}

/* Downloads token-major rows [n_q][n_heads*d] from backend memory and files them head-major
 * [n_heads][N][d] at their positions. */
static int scatter(kvm_capture *c, const kvm_attn_site *s, float *dst, const float *src, int n_heads)
{
    const int d = c->cfg.head_dim;
    const size_t n = (size_t)s->n_q * (size_t)n_heads * (size_t)d;
    float *h = stage(c, n);
    if (!h) return kvm_err(KVM_ENOMEM, "capture: out of memory");
    int rc = s->kernels->download(h, src, n * sizeof *h);
    if (rc) return rc;
    for (int64_t i = 0; i < s->n_q; i++) {
        if (s->qpos[i] < 0 || s->qpos[i] >= c->n) continue;
        for (int hd = 0; hd < n_heads; hd++)
            memcpy(dst + ((int64_t)hd * c->n + s->qpos[i]) * d, h + (i * n_heads + hd) * d, (size_t)d * sizeof(float));
    }
    return 0;
}

static int on_update(void *user, kvm_attn_site *s)
{
    kvm_capture *c = user;
    kvm_capture_layer *L = &c->layers[s->layer];
    int rc;
    if ((rc = scatter(c, s, L->k, s->k_new, c->cfg.n_kv_heads)) || (rc = scatter(c, s, L->v, s->v_new, c->cfg.n_kv_heads)))
        return rc;
    if (c->o.want_queries &&
        ((rc = scatter(c, s, L->q, s->q, c->cfg.n_heads)) || (rc = scatter(c, s, L->q_pre, s->q_pre, c->cfg.n_heads))))
        return rc;
    return 0;
}

/* Files the kernel's entropy [n_heads][n_q] by query position and adds its mass
 * [n_heads][ld_e] (the window's queries, summed by the kernel) by entry position. */
static int on_post(void *user, const kvm_attn_site *s)
{
    kvm_capture *c = user;
    kvm_capture_layer *L = &c->layers[s->layer];
    const kvm_attn_layer *a = s->attn;
    const int H = c->cfg.n_heads, grp = H / c->cfg.n_kv_heads;
    const size_t ne = (size_t)H * (size_t)a->n_q, nm = (size_t)H * (size_t)a->ld_e;
    float *h = stage(c, ne + nm);
    if (!h) return kvm_err(KVM_ENOMEM, "capture: out of memory");
    int rc;
    if ((rc = s->kernels->download(h, a->entropy, ne * sizeof *h)) ||
        (rc = s->kernels->download(h + ne, a->mass, nm * sizeof *h)))
        return rc;
    int any = 0; /* a query of the mass window in this call */
    for (int64_t i = 0; i < s->n_q; i++) {
        int32_t p = s->qpos[i];
        if (p < 0 || p >= c->n) continue;
        for (int hd = 0; hd < H; hd++) L->entropy[(int64_t)hd * c->n + p] = h[(int64_t)hd * a->n_q + i];
        any |= p >= c->o.mass_q0 && p < c->o.mass_q1;
    }
    for (int hd = 0; any && hd < H; hd++) {
        const kvm_kv_head *kh = kvm_kvcache_head(s->cache, s->layer, hd / grp);
        const float *m = h + ne + (int64_t)hd * a->ld_e;
        float *mass = L->mass + (int64_t)hd * c->n;
        for (int64_t e = 0; e < kh->n; e++) {
            int32_t kp = kh->pos[e];
            if (kp >= 0 && kp < c->n) mass[kp] += m[e];
        }
    }
    return 0;
}
