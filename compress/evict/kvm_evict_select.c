/* kvm_evict_select.c: the prefill-phase selection of each eviction pattern for one KV head,
 * from attention statistics (kvm_evict_attn), plus the deterministic top-k and the budget
 * apportioning shared by PyramidKV and PolyKV. Scores, zones and the top-k order are the
 * bodies of kernels/kvm_evict_body.h, which the CUDA selection runs too. */
#include "common/kvm_error.h"
#include "compress/evict/kvm_evict.h"
#include "kernels/kvm_evict_body.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const pattern_names[KVM_PATTERN_STRATEGY_COUNT] = {"streaming", "h2o",    "tova", "snapkv",
                                                                      "pyramidkv", "sculpt", "kvzip"};

kvm_evict_params kvm_evict_params_default(void)
{
    return (kvm_evict_params){.sinks = 4, .recent_frac = 0.5, .window = 16, .pool = 7};
}

const char *kvm_pattern_name(kvm_pattern p)
{
    if (p == KVM_PATTERN_NONE) return "none";
    return (unsigned)p < KVM_PATTERN_STRATEGY_COUNT ? pattern_names[p] : "?";
}

int kvm_pattern_parse(const char *s, kvm_pattern *out)
{
    for (int i = 0; s && i < KVM_PATTERN_COUNT; i++)
        if (strcmp(s, pattern_names[i]) == 0) {
            *out = (kvm_pattern)i;
            return 0;
        }
    return kvm_err(KVM_EINVAL, "unknown pattern '%s' (streaming, h2o, tova, snapkv, pyramidkv)", s ? s : "");
}

typedef struct scored {
    float s;
    int64_t i;
} scored;

/* Descending score, then ascending index; NaN sorts last (kvm_eb_before). */
static int cmp_scored(const void *pa, const void *pb)
{
    const scored *a = pa, *b = pb;
    return kvm_eb_before(a->s, a->i, b->s, b->i) ? -1 : kvm_eb_before(b->s, b->i, a->s, a->i);
}

int kvm_evict_topk(const float *score, int64_t n, int64_t k, uint8_t *mark)
{
    memset(mark, 0, (size_t)n);
    if (k <= 0) return 0;
    if (k >= n) {
        memset(mark, 1, (size_t)n);
        return 0;
    }
    scored *v = malloc((size_t)n * sizeof *v);
    if (!v) return kvm_err(KVM_ENOMEM, "evict: out of memory for top-k of %lld", (long long)n);
    for (int64_t i = 0; i < n; i++)
        v[i] = (scored){score[i], i};
    qsort(v, (size_t)n, sizeof *v, cmp_scored);
    for (int64_t j = 0; j < k; j++)
        mark[v[j].i] = 1;
    free(v);
    return 0;
}

/* Writes marked indices of [0, n) then [tail0, n) into keep (all of [tail0, n) kept). */
static void emit(const uint8_t *mark, int64_t n_mark, int64_t tail0, int64_t n, int64_t *keep, int64_t *n_keep)
{
    int64_t c = 0;
    for (int64_t i = 0; i < n_mark; i++)
        if (mark[i]) keep[c++] = i;
    for (int64_t i = tail0; i < n; i++)
        keep[c++] = i;
    *n_keep = c;
}

/* SnapKV votes on keys [0, m): the last min(window, n_obs) rows of every group head, summed,
 * then max-pooled with an odd kernel (window clipped at the ends). */
static void snap_votes(const kvm_evict_params *prm, const kvm_evict_attn *a, int64_t m, float *raw, float *out)
{
    int64_t rows = prm->window < a->n_obs ? prm->window : a->n_obs;
    for (int64_t j = 0; j < m; j++)
        raw[j] = kvm_eb_snap_vote(a->obs, a->n_obs, rows, a->n, a->n_group, j);
    int64_t half = (prm->pool > 1 ? prm->pool : 1) / 2;
    for (int64_t j = 0; j < m; j++)
        out[j] = kvm_eb_pool(raw, m, half, j);
}

int kvm_evict_select(kvm_pattern p, const kvm_evict_params *prm, const kvm_evict_attn *a, int64_t b, int64_t *keep,
                     int64_t *n_keep)
{
    const int64_t n = a->n;
    *n_keep = 0;
    if (b < 1) return kvm_err(KVM_EINVAL, "evict: budget %lld < 1", (long long)b);
    if (n < 0 || a->n_group < 1)
        return kvm_err(KVM_EINVAL, "evict: bad attention input (n %lld, group %d)", (long long)n, a->n_group);
    if (kvm_pattern_is_distilled(p))
        return kvm_err(KVM_EINVAL, "evict: %s is not an eviction pattern (it runs inside a PolyKV strategy)",
                       kvm_pattern_name(p));
    if ((unsigned)p >= KVM_PATTERN_COUNT) return kvm_err(KVM_EINVAL, "evict: unknown pattern %d", (int)p);
    if (b >= n) {
        for (int64_t i = 0; i < n; i++)
            keep[i] = i;
        *n_keep = n;
        return 0;
    }
    if (p == KVM_PATTERN_STREAMING) {
        int64_t s = prm->sinks < b ? prm->sinks : b;
        uint8_t *mark = calloc((size_t)s + 1, 1);
        if (!mark) return kvm_err(KVM_ENOMEM, "evict: out of memory");
        memset(mark, 1, (size_t)s);
        emit(mark, s, n - (b - s), n, keep, n_keep);
        free(mark);
        return 0;
    }
    if (p == KVM_PATTERN_H2O && !a->mass) return kvm_err(KVM_EINVAL, "evict: h2o needs accumulated attention mass");
    if (p == KVM_PATTERN_TOVA && (!a->obs || a->n_obs < 1))
        return kvm_err(KVM_EINVAL, "evict: tova needs the last query's attention");
    if ((p == KVM_PATTERN_SNAPKV || p == KVM_PATTERN_PYRAMIDKV) &&
        (!a->obs || a->n_obs < (prm->window < n ? prm->window : n)))
        return kvm_err(KVM_EINVAL, "evict: snapkv needs the last %lld queries' attention, got %lld",
                       (long long)prm->window, (long long)a->n_obs);
    int64_t m, tail0, k; /* candidates [0, m), k of them kept, always-kept tail [tail0, n) */
    kvm_eb_zones((int)p, prm->recent_frac, prm->window, n, b, &m, &tail0, &k);
    float *score = calloc((size_t)(2 * m + 1), sizeof *score);
    uint8_t *mark = calloc((size_t)m + 1, 1);
    int rc = 0;
    if (!score || !mark) rc = kvm_err(KVM_ENOMEM, "evict: out of memory");
    if (!rc && p == KVM_PATTERN_H2O) {
        for (int64_t j = 0; j < m; j++)
            score[j] = kvm_eb_h2o(a->mass, n, a->n_group, j);
    } else if (!rc && p == KVM_PATTERN_TOVA) {
        for (int64_t j = 0; j < m; j++)
            score[j] = kvm_eb_tova(a->obs, a->n_obs, n, a->n_group, j);
    } else if (!rc) {
        snap_votes(prm, a, m, score + m, score);
    }
    if (!rc) rc = kvm_evict_topk(score, m, k, mark);
    if (!rc) emit(mark, m, tail0, n, keep, n_keep);
    free(score);
    free(mark);
    return rc;
}

int kvm_evict_apportion(const double *w, int n, int64_t total, int64_t floor_v, int64_t *out)
{
    return kvm_evict_apportion_capped(w, n, total, floor_v, 0, out);
}

int kvm_evict_apportion_capped(const double *w, int n, int64_t total, int64_t floor_v, int64_t ceil_v, int64_t *out)
{
    if (n < 1 || floor_v < 0 || total < (int64_t)n * floor_v)
        return kvm_err(KVM_EINVAL, "budget: %lld entries cannot give %d layers a floor of %lld each", (long long)total,
                       n, (long long)floor_v);
    if (ceil_v > 0 && ceil_v < floor_v)
        return kvm_err(KVM_EINVAL, "budget: a ceiling of %lld below the floor of %lld", (long long)ceil_v,
                       (long long)floor_v);
    if (ceil_v > 0 && total > (int64_t)n * ceil_v) total = (int64_t)n * ceil_v; /* the rest has nowhere to go */
    uint8_t *pinned = calloc((size_t)n, 1);                                     /* 1: at the floor, 2: at the ceiling */
    double *x = malloc((size_t)n * sizeof *x);
    if (!pinned || !x) {
        free(pinned);
        free(x);
        return kvm_err(KVM_ENOMEM, "budget: out of memory");
    }
    /* water-filling: shares above the ceiling are pinned there first, and the floor's pins are
     * undone after each new ceiling pin (the excess freed may lift them); shares below the floor
     * are pinned only when none exceeds the ceiling. Ceiling pins never come undone: it ends. */
    for (int changed = 1; changed;) {
        changed = 0;
        double sw = 0;
        int64_t rem = total;
        int n_free = 0;
        for (int i = 0; i < n; i++) {
            if (pinned[i])
                rem -= pinned[i] == 1 ? floor_v : ceil_v;
            else {
                sw += w[i] > 0 && isfinite(w[i]) ? w[i] : 0;
                n_free++;
            }
        }
        for (int i = 0; i < n; i++) {
            if (pinned[i]) {
                x[i] = (double)(pinned[i] == 1 ? floor_v : ceil_v);
                continue;
            }
            double wi = w[i] > 0 && isfinite(w[i]) ? w[i] : 0;
            x[i] = sw > 0 ? (double)rem * wi / sw : (double)rem / n_free;
        }
        for (int i = 0; i < n; i++)
            if (!pinned[i] && ceil_v > 0 && x[i] > (double)ceil_v) pinned[i] = 2, changed = 1;
        if (changed) {
            for (int i = 0; i < n; i++)
                if (pinned[i] == 1) pinned[i] = 0;
            continue;
        }
        for (int i = 0; i < n; i++)
            if (!pinned[i] && x[i] < (double)floor_v) pinned[i] = 1, changed = 1;
    }
    int64_t sum = 0;
    for (int i = 0; i < n; i++) {
        out[i] = (int64_t)floor(x[i] + 1e-9);
        sum += out[i];
    }
    while (sum < total) { /* largest remainder; ties to the earlier index; never above the ceiling */
        int best = -1;
        double br = -1;
        for (int i = 0; i < n; i++) {
            double r = x[i] - (double)out[i];
            if (r > br && (ceil_v <= 0 || out[i] < ceil_v)) {
                br = r;
                best = i;
            }
        }
        if (best < 0) break;
        out[best]++;
        x[best] = (double)out[best] - 1.0; /* taken: its remainder is now the lowest */
        sum++;
    }
    while (sum > total) { /* only from rounding noise: take from the largest above the floor */
        int best = 0;
        for (int i = 1; i < n; i++)
            if (out[i] > out[best]) best = i;
        out[best]--;
        sum--;
    }
    free(pinned);
    free(x);
    return 0;
}

int kvm_evict_pyramid_budgets(int64_t B, int n_layers, int64_t *out)
{
    if (B < 1 || n_layers < 1)
        return kvm_err(KVM_EINVAL, "pyramidkv: average budget %lld, %d layers", (long long)B, n_layers);
    double *w = malloc((size_t)n_layers * sizeof *w);
    if (!w) return kvm_err(KVM_ENOMEM, "pyramidkv: out of memory");
    for (int l = 0; l < n_layers; l++)
        w[l] = n_layers == 1 ? 1.0 : 1.5 - (double)l / (n_layers - 1);
    int rc = kvm_evict_apportion(w, n_layers, B * n_layers, 1, out);
    free(w);
    return rc;
}
