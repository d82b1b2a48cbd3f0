/* kvm_evict_prefill.c: eviction plans and the prefill phase: attention statistics of a
 * captured context per (layer, KV head), then each head cut to its budget by its pattern. */
#include "common/kvm_error.h"
#include "compress/evict/kvm_evict.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int kvm_evict_plan_new(int n_layers, int n_kv_heads, kvm_pattern p, int64_t b, kvm_evict_plan **out)
{
    *out = NULL;
    if (n_layers < 1 || n_kv_heads < 1) return kvm_err(KVM_EINVAL, "evict: plan shape %dx%d", n_layers, n_kv_heads);
    if (b < 1) return kvm_err(KVM_EINVAL, "evict: budget %lld < 1", (long long)b);
    if ((unsigned)p >= KVM_PATTERN_COUNT && p != KVM_PATTERN_NONE)
        return kvm_err(KVM_EINVAL, "evict: pattern %d (%s) is not an eviction pattern", (int)p, kvm_pattern_name(p));
    kvm_evict_plan *pl = calloc(1, sizeof *pl);
    size_t nh = (size_t)n_layers * (size_t)n_kv_heads;
    int64_t *lb = malloc((size_t)n_layers * sizeof *lb);
    if (pl) {
        pl->pattern = malloc(nh * sizeof *pl->pattern);
        pl->budget = malloc(nh * sizeof *pl->budget);
    }
    if (!pl || !lb || !pl->pattern || !pl->budget) {
        free(lb);
        kvm_evict_plan_free(&pl);
        return kvm_err(KVM_ENOMEM, "evict: out of memory");
    }
    pl->n_layers = n_layers;
    pl->n_kv_heads = n_kv_heads;
    pl->params = kvm_evict_params_default();
    int rc = 0;
    if (p == KVM_PATTERN_PYRAMIDKV)
        rc = kvm_evict_pyramid_budgets(b, n_layers, lb);
    else
        for (int l = 0; l < n_layers; l++)
            lb[l] = b;
    for (int l = 0; !rc && l < n_layers; l++)
        for (int g = 0; g < n_kv_heads; g++) {
            pl->pattern[l * n_kv_heads + g] = p;
            pl->budget[l * n_kv_heads + g] = lb[l];
        }
    free(lb);
    if (rc) {
        kvm_evict_plan_free(&pl);
        return rc;
    }
    *out = pl;
    return 0;
}

void kvm_evict_plan_free(kvm_evict_plan **pp)
{
    if (!pp || !*pp) return;
    free((*pp)->pattern);
    free((*pp)->budget);
    free(*pp);
    *pp = NULL;
}

int kvm_evict_attn_from_capture(const kvm_model_config *c, const kvm_capture *cap, int layer, int kv_head,
                                int64_t n_obs, float *obs_buf, float *mass_buf, kvm_evict_attn *a)
{
    const kvm_capture_layer *L = kvm_capture_layer_get(cap, layer);
    const int64_t n = kvm_capture_n_tokens(cap);
    const int d = c->head_dim, grp = c->n_heads / c->n_kv_heads;
    if (!L->q || !L->mass) return kvm_err(KVM_EINVAL, "evict: the capture lacks queries or attention statistics");
    if (n_obs < 1 || n_obs > n)
        return kvm_err(KVM_EINVAL, "evict: %lld observation queries of %lld", (long long)n_obs, (long long)n);
    const float *K = L->k + (int64_t)kv_head * n * d, scale = 1.0f / sqrtf((float)d);
    for (int j = 0; j < grp; j++) {
        int h = kv_head * grp + j;
        memcpy(mass_buf + (int64_t)j * n, L->mass + (int64_t)h * n, (size_t)n * sizeof(float));
        for (int64_t r = 0; r < n_obs; r++) {
            int64_t t = n - n_obs + r;
            const float *q = L->q + ((int64_t)h * n + t) * d;
            float *row = obs_buf + ((int64_t)j * n_obs + r) * n, mx = -INFINITY;
            for (int64_t e = 0; e <= t; e++) {
                float s = 0;
                for (int i = 0; i < d; i++)
                    s += q[i] * K[e * d + i];
                row[e] = s * scale;
                if (row[e] > mx) mx = row[e];
            }
            double sum = 0;
            for (int64_t e = 0; e <= t; e++)
                sum += (row[e] = expf(row[e] - mx));
            for (int64_t e = 0; e <= t; e++)
                row[e] = (float)(row[e] / sum);
            for (int64_t e = t + 1; e < n; e++)
                row[e] = 0.0f;
        }
    }
    *a = (kvm_evict_attn){.n = n, .n_group = grp, .n_obs = n_obs, .obs = obs_buf, .mass = mass_buf};
    return 0;
}

/* Cuts one head (holding positions [0, n) as entries 0..n-1) to its plan budget. */
static int cut_head(const kvm_compress_input *in, const kvm_evict_plan *plan, int l, int g, kvm_kvcache *c, float *obs,
                    float *mass, int64_t *keep)
{
    const kvm_model_config *cfg = &in->model->cfg;
    kvm_pattern p = plan->pattern[l * plan->n_kv_heads + g];
    int64_t b = plan->budget[l * plan->n_kv_heads + g], n = in->n_tokens, n_keep;
    kvm_kv_head *h = kvm_kvcache_head(c, l, g);
    if (p == KVM_PATTERN_NONE || b >= h->n) return 0;
    if (h->n != n)
        return kvm_err(KVM_EINVAL, "evict: layer %d head %d holds %lld entries, not the context's %lld", l, g,
                       (long long)h->n, (long long)n);
    int64_t n_obs = p == KVM_PATTERN_SNAPKV || p == KVM_PATTERN_PYRAMIDKV ? plan->params.window : 1;
    if (n_obs > n) n_obs = n;
    if (n_obs < 1) n_obs = 1;
    kvm_evict_attn a;
    int rc = kvm_evict_attn_from_capture(cfg, in->cap, l, g, n_obs, obs, mass, &a);
    if (!rc) rc = kvm_evict_select(p, &plan->params, &a, b, keep, &n_keep);
    if (!rc) rc = kvm_kvcache_keep(h, c->head_dim, keep, n_keep);
    return rc;
}

int kvm_evict_prefill(const kvm_compress_input *in, const kvm_evict_plan *plan, kvm_kvcache **out)
{
    *out = NULL;
    const kvm_model_config *cfg = &in->model->cfg;
    if (plan->n_layers != cfg->n_layers || plan->n_kv_heads != cfg->n_kv_heads)
        return kvm_err(KVM_EINVAL, "evict: plan shape %dx%d is not the model's %dx%d", plan->n_layers, plan->n_kv_heads,
                       cfg->n_layers, cfg->n_kv_heads);
    const int64_t n = in->n_tokens, grp = cfg->n_heads / cfg->n_kv_heads;
    int64_t w = plan->params.window > 1 ? plan->params.window : 1;
    if (w > n) w = n;
    kvm_kvcache *c = NULL;
    float *obs = malloc((size_t)(grp * w * n + 1) * sizeof *obs), *mass = malloc((size_t)(grp * n + 1) * sizeof *mass);
    int64_t *keep = malloc((size_t)(n + 1) * sizeof *keep);
    int rc = obs && mass && keep ? 0 : kvm_err(KVM_ENOMEM, "evict: out of memory for %lld tokens", (long long)n);
    if (!rc) rc = kvm_kvcache_clone(in->full, &c);
    for (int l = 0; !rc && l < cfg->n_layers; l++)
        for (int g = 0; !rc && g < cfg->n_kv_heads; g++)
            rc = cut_head(in, plan, l, g, c, obs, mass, keep);
    free(obs);
    free(mass);
    free(keep);
    if (rc) {
        kvm_kvcache_free(&c);
        return rc;
    }
    *out = c;
    return 0;
}
