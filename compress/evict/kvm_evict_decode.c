/* kvm_evict_decode.c: the decode phase of the eviction patterns: forward hooks that keep
 * each (layer, KV head) within its budget as tokens are appended, with per-position scores
 * (accumulated attention) where the pattern needs them. */
#include "common/kvm_error.h"
#include "compress/evict/kvm_evict.h"
#include "kernels/kvm_evict_body.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct pos_scores {
    float *s;    /* [cap] score by absolute position */
    int64_t cap; /* positions allocated */
} pos_scores;

typedef struct evict_decode {
    kvm_model_config cfg;
    kvm_pattern *pattern; /* [L][H] */
    int64_t *budget;      /* [L][H] */
    kvm_evict_params prm;
    pos_scores *sc; /* [L][H] */
    float *tmp;     /* scratch, tmp_cap floats */
    int64_t tmp_cap;
    float *host;    /* downloads of the kernel's tensors, host_cap floats */
    size_t host_cap;
} evict_decode;

static void dec_free(void *p)
{
    evict_decode *d = p;
    if (!d) return;
    for (int i = 0; d->sc && i < d->cfg.n_layers * d->cfg.n_kv_heads; i++)
        free(d->sc[i].s);
    free(d->sc);
    free(d->pattern);
    free(d->budget);
    free(d->tmp);
    free(d->host);
    free(d);
}

/* Grows a position-score array to hold position pos. */
static int ensure_pos(pos_scores *ps, int64_t pos)
{
    if (pos < ps->cap) return 0;
    int64_t cap = pos + 1 > 2 * ps->cap ? pos + 1 : 2 * ps->cap;
    float *s = realloc(ps->s, (size_t)cap * sizeof *s);
    if (!s) return kvm_err(KVM_ENOMEM, "evict decode: out of memory for %lld positions", (long long)cap);
    memset(s + ps->cap, 0, (size_t)(cap - ps->cap) * sizeof *s);
    ps->s = s;
    ps->cap = cap;
    return 0;
}

static int ensure_tmp(evict_decode *d, int64_t n)
{
    if (n <= d->tmp_cap) return 0;
    float *t = realloc(d->tmp, (size_t)n * sizeof *t);
    if (!t) return kvm_err(KVM_ENOMEM, "evict decode: out of memory");
    d->tmp = t;
    d->tmp_cap = n;
    return 0;
}

/* Host copy of n floats of backend memory src (valid until the next call), or NULL with
 * *rc set. */
static const float *download(evict_decode *d, const kvm_attn_site *s, const float *src, size_t n, int *rc)
{
    if (n > d->host_cap) {
        float *h = realloc(d->host, n * sizeof *h);
        if (!h) {
            *rc = kvm_err(KVM_ENOMEM, "evict decode: out of memory");
            return NULL;
        }
        d->host = h;
        d->host_cap = n;
    }
    *rc = s->kernels->download(d->host, src, n * sizeof *d->host);
    return *rc ? NULL : d->host;
}

/* TOVA: the newest query's attention over the head's entries, averaged over the group. */
static int tova_scores(evict_decode *d, const kvm_attn_site *s, int g, const kvm_kv_head *h, float *row, float *out)
{
    const int dh = d->cfg.head_dim, grp = d->cfg.n_heads / d->cfg.n_kv_heads;
    const int32_t qp = s->qpos[s->n_q - 1];
    const float scale = 1.0f / sqrtf((float)dh);
    int rc;
    /* the group's rows of the newest query (queries are in backend memory) */
    const float *qg = download(d, s, s->q + ((s->n_q - 1) * (int64_t)d->cfg.n_heads + g * grp) * dh,
                               (size_t)grp * (size_t)dh, &rc);
    if (!qg) return rc;
    memset(out, 0, (size_t)h->n * sizeof *out);
    for (int j = 0; j < grp; j++) {
        const float *q = qg + (int64_t)j * dh;
        float mx = -INFINITY;
        for (int64_t e = 0; e < h->n; e++) {
            int vis = h->pos[e] == KVM_POS_NONE || h->pos[e] <= qp;
            float sc = 0, kf[dh];
            const float *k = h->k ? h->k + e * dh : kf; /* an f16 cache's key widened */
            if (!h->k) kvm_kvcache_read(h, dh, e, kf, NULL);
            for (int i = 0; i < dh; i++)
                sc += q[i] * k[i];
            row[e] = vis ? sc * scale + h->bias[e] : -INFINITY;
            if (row[e] > mx) mx = row[e];
        }
        double sum = 0;
        for (int64_t e = 0; e < h->n; e++)
            sum += (row[e] = row[e] == -INFINITY ? 0.0f : expf(row[e] - mx));
        for (int64_t e = 0; e < h->n; e++)
            out[e] += (float)(row[e] / sum) / (float)grp;
    }
    return 0;
}

/* Index of the entry to evict from head h (n > b), or -1 when it holds no positioned entry. */
static int64_t victim(evict_decode *d, const kvm_attn_site *s, int l, int g, kvm_kv_head *h, int64_t b, int *rc)
{
    kvm_pattern p = d->pattern[l * d->cfg.n_kv_heads + g];
    int64_t first = 0;
    while (first < h->n && h->pos[first] == KVM_POS_NONE)
        first++;
    const int64_t npos = h->n - first;
    if (npos <= 0) return -1;
    if (p == KVM_PATTERN_STREAMING) {
        int64_t v = first + d->prm.sinks;
        return v < h->n ? v : first;
    }
    /* the most recent positioned entries are protected (the bodies the device's decode runs) */
    const int64_t prot = kvm_eb_decode_protected((int)p, d->prm.recent_frac, d->prm.window, b);
    if (prot >= npos) return first;
    const int64_t m = npos - prot;                      /* candidates first..first+m-1 */
    if ((*rc = ensure_tmp(d, 3 * h->n + 2))) return -1; /* [raw | score | all] scratch, reused per step */
    float *score = d->tmp + h->n + 1;
    if (p == KVM_PATTERN_TOVA) {
        float *all = d->tmp + 2 * h->n + 2;
        if ((*rc = tova_scores(d, s, g, h, d->tmp, all))) return -1;
        for (int64_t i = 0; i < m; i++)
            score[i] = all[first + i];
    } else {
        pos_scores *ps = &d->sc[l * d->cfg.n_kv_heads + g];
        for (int64_t i = 0; i < m; i++) {
            int32_t pp = h->pos[first + i];
            score[i] = pp < ps->cap ? ps->s[pp] : 0.0f;
        }
        if (p == KVM_PATTERN_SNAPKV || p == KVM_PATTERN_PYRAMIDKV) { /* max pooling over neighbours */
            float *raw = d->tmp;
            memcpy(raw, score, (size_t)m * sizeof *raw);
            for (int64_t i = 0; i < m; i++) score[i] = kvm_eb_pool(raw, m, d->prm.pool / 2, i);
        }
    }
    return first + kvm_eb_victim(score, m); /* lowest score; ties evict the later entry */
}

static int on_update(void *user, kvm_attn_site *s)
{
    evict_decode *d = user;
    const int H = d->cfg.n_kv_heads, l = s->layer;
    int rc = 0;
    for (int g = 0; g < H && !rc; g++) {
        kvm_pattern p = d->pattern[l * H + g];
        int64_t b = d->budget[l * H + g];
        if (p == KVM_PATTERN_NONE) continue;
        kvm_kv_head *h = kvm_kvcache_head(s->cache, l, g);
        while (h->n > b && !rc) {
            int64_t v = victim(d, s, l, g, h, b, &rc);
            if (rc || v < 0) break;
            /* drop entry v: shift the tail down (keep order) */
            kvm_kvcache_drop(h, s->cache->head_dim, v);
        }
    }
    return rc;
}

/* Updates each KV head's scores by position with its query heads' received mass (the
 * kernel's MASS statistic over this call's queries), SnapKV/PyramidKV's decayed first:
 * kvm_eb_decode_score, the body the device's decode runs. */
static int on_post(void *user, const kvm_attn_site *s)
{
    evict_decode *d = user;
    const int H = d->cfg.n_kv_heads, grp = d->cfg.n_heads / H;
    const kvm_attn_layer *a = s->attn;
    const float *mass = NULL;
    int rc = 0;
    for (int g = 0; g < H; g++) {
        kvm_pattern p = d->pattern[s->layer * H + g];
        if (p != KVM_PATTERN_H2O && p != KVM_PATTERN_SNAPKV && p != KVM_PATTERN_PYRAMIDKV) continue;
        if (!mass && !(mass = download(d, s, a->mass, (size_t)d->cfg.n_heads * (size_t)a->ld_e, &rc))) return rc;
        const kvm_kv_head *h = kvm_kvcache_head(s->cache, s->layer, g);
        pos_scores *ps = &d->sc[s->layer * H + g];
        for (int64_t e = 0; e < a->n_e[g]; e++) {
            int32_t pp = h->pos[e];
            if (pp < 0) continue;
            if ((rc = ensure_pos(ps, pp))) return rc;
            ps->s[pp] = kvm_eb_decode_score(ps->s[pp], (int)p, d->prm.window, s->n_q,
                                            mass + (int64_t)g * grp * a->ld_e, a->ld_e, grp, e);
        }
    }
    return 0;
}

/* Seeds scores from the prefill capture: H2O the accumulated mass, SnapKV the window votes
 * (summed over the group as the prefill selection sums them). */
static int seed(evict_decode *d, const kvm_compress_input *in)
{
    const kvm_model_config *c = &d->cfg;
    const int64_t n = in->n_tokens, grp = c->n_heads / c->n_kv_heads;
    int64_t w = d->prm.window < n ? d->prm.window : n;
    if (w < 1) w = 1;
    float *obs = malloc((size_t)(grp * w * n) * sizeof *obs), *mass = malloc((size_t)(grp * n) * sizeof *mass);
    int rc = obs && mass ? 0 : kvm_err(KVM_ENOMEM, "evict decode: out of memory");
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int g = 0; !rc && g < c->n_kv_heads; g++) {
            kvm_pattern p = d->pattern[l * c->n_kv_heads + g];
            if (p != KVM_PATTERN_H2O && p != KVM_PATTERN_SNAPKV && p != KVM_PATTERN_PYRAMIDKV) continue;
            kvm_evict_attn a;
            pos_scores *ps = &d->sc[l * c->n_kv_heads + g];
            if ((rc = kvm_evict_attn_from_capture(c, in->cap, l, g, w, obs, mass, &a)) || (rc = ensure_pos(ps, n - 1)))
                break;
            for (int64_t t = 0; t < n; t++) /* the prefill selection's scores (kernels/kvm_evict_body.h) */
                ps->s[t] = p == KVM_PATTERN_H2O ? kvm_eb_h2o(mass, n, (int)grp, t) : kvm_eb_snap_vote(obs, w, w, n, (int)grp, t);
        }
    free(obs);
    free(mass);
    return rc;
}

int kvm_evict_decode_new(const kvm_model_config *c, const kvm_evict_plan *plan, const kvm_compress_input *in,
                         kvm_decode_policy **out)
{
    *out = NULL;
    if (plan->n_layers != c->n_layers || plan->n_kv_heads != c->n_kv_heads)
        return kvm_err(KVM_EINVAL, "evict decode: plan shape %dx%d is not the model's %dx%d", plan->n_layers,
                       plan->n_kv_heads, c->n_layers, c->n_kv_heads);
    const size_t nh = (size_t)c->n_layers * (size_t)c->n_kv_heads;
    for (size_t i = 0; i < nh; i++)
        if (plan->budget[i] < 1)
            return kvm_err(KVM_EINVAL, "evict decode: budget %lld < 1", (long long)plan->budget[i]);
    evict_decode *d = calloc(1, sizeof *d);
    kvm_decode_policy *pol = calloc(1, sizeof *pol);
    int rc = 0;
    if (d) {
        d->cfg = *c;
        d->prm = plan->params;
        d->pattern = malloc(nh * sizeof *d->pattern);
        d->budget = malloc(nh * sizeof *d->budget);
        d->sc = calloc(nh, sizeof *d->sc);
    }
    if (!d || !pol || !d->pattern || !d->budget || !d->sc) rc = kvm_err(KVM_ENOMEM, "evict decode: out of memory");
    if (!rc) {
        memcpy(d->pattern, plan->pattern, nh * sizeof *d->pattern);
        memcpy(d->budget, plan->budget, nh * sizeof *d->budget);
        if (in && in->cap) rc = seed(d, in);
    }
    if (rc) {
        dec_free(d);
        free(pol);
        return rc;
    }
    pol->state = d;
    pol->state_free = dec_free;
    pol->hooks = (kvm_hooks){.user = d, .cache_update = on_update, .post_attn = on_post, .stats = KVM_ATTN_STAT_MASS};
    *out = pol;
    return 0;
}
