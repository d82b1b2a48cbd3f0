/* kvm_polykv_strategy.c: from calibration signals to a strategy (pattern per layer and
 * phase, budgets under L×B with floor b_min), and from a strategy to eviction plans. */
#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const select_names[KVM_POLYKV_SELECT_COUNT] = {"cosine", "ppl", "single", "search"};
static const char *const alloc_names[KVM_POLYKV_ALLOC_COUNT] = {"uniform", "entropy", "ppl", "pyramid", "search"};

const char *kvm_polykv_select_name(kvm_polykv_select s)
{
    return (unsigned)s < KVM_POLYKV_SELECT_COUNT ? select_names[s] : "?";
}

const char *kvm_polykv_alloc_name(kvm_polykv_alloc a)
{
    return (unsigned)a < KVM_POLYKV_ALLOC_COUNT ? alloc_names[a] : "?";
}

int kvm_polykv_select_parse(const char *s, kvm_polykv_select *out)
{
    for (int i = 0; i < 2; i++)
        if (strcmp(s, select_names[i]) == 0) {
            *out = (kvm_polykv_select)i;
            return 0;
        }
    return kvm_err(KVM_EINVAL, "unknown selection mode '%s' (cosine, ppl)", s);
}

int kvm_polykv_alloc_parse(const char *s, kvm_polykv_alloc *out)
{
    for (int i = 0; i < 3; i++)
        if (strcmp(s, alloc_names[i]) == 0) {
            *out = (kvm_polykv_alloc)i;
            return 0;
        }
    return kvm_err(KVM_EINVAL, "unknown allocation mode '%s' (entropy, ppl, uniform)", s);
}

int kvm_polykv_signals_new(int n_layers, kvm_polykv_signals **out)
{
    *out = NULL;
    if (n_layers < 1) return kvm_err(KVM_EINVAL, "signals: %d layers", n_layers);
    kvm_polykv_signals *s = calloc(1, sizeof *s);
    size_t n3 = (size_t)KVM_POLYKV_PHASES * n_layers * KVM_PATTERN_COUNT;
    if (s) {
        s->n_layers = n_layers;
        s->sculpt_opts = kvm_sculpt_opts_default();
        s->cosine = calloc(n3, sizeof(double));
        s->ppl_delta = calloc(n3, sizeof(double));
        s->kl = calloc(n3, sizeof(double));
        s->entropy = calloc((size_t)n_layers, sizeof(double));
        s->worst_ppl = calloc((size_t)KVM_POLYKV_PHASES * n_layers, sizeof(double));
        s->sculpt_cosine = calloc((size_t)n_layers, sizeof(double));
        s->sculpt_ppl = calloc((size_t)n_layers, sizeof(double));
        s->sculpt_kl = calloc((size_t)n_layers, sizeof(double));
        s->kvzip_cosine = calloc((size_t)n_layers, sizeof(double));
        s->kvzip_ppl = calloc((size_t)n_layers, sizeof(double));
        s->kvzip_kl = calloc((size_t)n_layers, sizeof(double));
    }
    if (!s || !s->cosine || !s->ppl_delta || !s->kl || !s->entropy || !s->worst_ppl || !s->sculpt_cosine ||
        !s->sculpt_ppl || !s->sculpt_kl || !s->kvzip_cosine || !s->kvzip_ppl || !s->kvzip_kl) {
        kvm_polykv_signals_free(&s);
        return kvm_err(KVM_ENOMEM, "signals: out of memory");
    }
    *out = s;
    return 0;
}

void kvm_polykv_signals_free(kvm_polykv_signals **ps)
{
    if (!ps || !*ps) return;
    kvm_polykv_signals *s = *ps;
    free(s->cosine);
    free(s->ppl_delta);
    free(s->kl);
    free(s->entropy);
    free(s->worst_ppl);
    free(s->sculpt_cosine);
    free(s->sculpt_ppl);
    free(s->sculpt_kl);
    free(s->kvzip_cosine);
    free(s->kvzip_ppl);
    free(s->kvzip_kl);
    free(s);
    *ps = NULL;
}

/* Index of the best eviction pattern for (phase, layer) by select mode; PyramidKV is skipped. */
static kvm_pattern best_eviction(const kvm_polykv_signals *s, kvm_polykv_select sel, int ph, int l)
{
    const int P = KVM_PATTERN_COUNT;
    int best = -1;
    for (int r = 0; r < P; r++) {
        if (r == KVM_PATTERN_PYRAMIDKV) continue;
        size_t i = ((size_t)ph * s->n_layers + l) * P + r;
        if (best < 0) {
            best = r;
            continue;
        }
        size_t j = ((size_t)ph * s->n_layers + l) * P + best;
        if (sel == KVM_POLYKV_SELECT_COSINE ? s->cosine[i] > s->cosine[j] : s->ppl_delta[i] < s->ppl_delta[j]) best = r;
    }
    return (kvm_pattern)best;
}

/* Patterns of layer l in both phases: sculpt or kvzip (both phases) when measured and strictly
 * better on the prefill signals than the best eviction pattern (and sculpt before kvzip on a
 * tie), else the best eviction per phase. */
static void best_patterns(const kvm_polykv_signals *s, kvm_polykv_select sel, int l, kvm_pattern *out)
{
    for (int ph = 0; ph < KVM_POLYKV_PHASES; ph++) out[ph] = best_eviction(s, sel, ph, l);
    size_t j = (size_t)l * KVM_PATTERN_COUNT + out[0];
    double cos = s->cosine[j], ppl = s->ppl_delta[j];
    const struct {
        int on;
        const double *c, *p;
        kvm_pattern r;
    } dist[] = {{s->has_sculpt, s->sculpt_cosine, s->sculpt_ppl, KVM_PATTERN_SCULPT},
                {s->has_kvzip, s->kvzip_cosine, s->kvzip_ppl, KVM_PATTERN_KVZIP}};
    for (size_t i = 0; i < sizeof dist / sizeof dist[0]; i++)
        if (dist[i].on && (sel == KVM_POLYKV_SELECT_COSINE ? dist[i].c[l] > cos : dist[i].p[l] < ppl)) {
            out[0] = out[1] = dist[i].r;
            cos = dist[i].c[l];
            ppl = dist[i].p[l];
        }
}

int kvm_polykv_strategy_build(const kvm_polykv_signals *s, kvm_polykv_select sel, kvm_pattern single,
                              kvm_polykv_alloc alloc, double power, int64_t B, int64_t b_min, kvm_strategy **out)
{
    return kvm_polykv_strategy_build_capped(s, sel, single, alloc, power, B, b_min, 0, out);
}

int kvm_polykv_strategy_build_capped(const kvm_polykv_signals *s, kvm_polykv_select sel, kvm_pattern single,
                                     kvm_polykv_alloc alloc, double power, int64_t B, int64_t b_min, int64_t n_ctx,
                                     kvm_strategy **out)
{
    *out = NULL;
    const int L = s->n_layers;
    if (B < 1) return kvm_err(KVM_EINVAL, "strategy: budget %lld < 1", (long long)B);
    if (b_min < 1) return kvm_err(KVM_EINVAL, "strategy: b_min %lld < 1", (long long)b_min);
    if (b_min > B)
        return kvm_err(KVM_EINVAL, "strategy: b_min %lld × %d layers exceeds the total budget %lld × %d",
                       (long long)b_min, L, (long long)B, L);
    if (n_ctx > 0 && B > n_ctx) /* L·B would not fit under the layers' ceilings: the sum would not be L·B */
        return kvm_err(KVM_EINVAL, "strategy: budget %lld per layer exceeds the context's %lld tokens", (long long)B,
                       (long long)n_ctx);
    if ((unsigned)sel >= KVM_POLYKV_SELECT_COUNT || (unsigned)alloc >= KVM_POLYKV_ALLOC_COUNT ||
        sel == KVM_POLYKV_SELECT_SEARCH || alloc == KVM_POLYKV_ALLOC_SEARCH ||
        (sel == KVM_POLYKV_SELECT_SINGLE && (unsigned)single >= KVM_PATTERN_STRATEGY_COUNT) || !(power > 0))
        return kvm_err(KVM_EINVAL, "strategy: bad selection/allocation mode");
    kvm_strategy *st;
    int rc = kvm_strategy_new(L, &st);
    if (rc) return rc;
    double *w = malloc((size_t)L * sizeof *w);
    int64_t *bud = malloc((size_t)L * sizeof *bud);
    if (!w || !bud) rc = kvm_err(KVM_ENOMEM, "strategy: out of memory");
    for (int l = 0; !rc && l < L; l++) {
        if (sel == KVM_POLYKV_SELECT_SINGLE)
            st->layers[l].pattern[0] = st->layers[l].pattern[1] = single;
        else
            best_patterns(s, sel, l, st->layers[l].pattern);
        double v = 1.0;
        if (alloc == KVM_POLYKV_ALLOC_ENTROPY)
            v = s->entropy[l];
        else if (alloc == KVM_POLYKV_ALLOC_PPL)
            v = s->worst_ppl[l] > 1e-6 ? s->worst_ppl[l] : 1e-6;
        else if (alloc == KVM_POLYKV_ALLOC_PYRAMID)
            v = L == 1 ? 1.0 : 1.5 - (double)l / (L - 1);
        w[l] = alloc == KVM_POLYKV_ALLOC_PYRAMID ? v : pow(v > 0 ? v : 0, power);
    }
    if (!rc) rc = kvm_evict_apportion_capped(w, L, B * L, b_min, n_ctx > 0 ? n_ctx : 0, bud);
    for (int l = 0; !rc && l < L; l++)
        st->layers[l].budget = bud[l];
    free(w);
    free(bud);
    if (rc) {
        kvm_strategy_free(&st);
        return rc;
    }
    st->budget_avg = B;
    st->b_min = b_min;
    st->select = sel;
    st->alloc = alloc;
    st->alloc_power = alloc == KVM_POLYKV_ALLOC_PYRAMID || alloc == KVM_POLYKV_ALLOC_UNIFORM ? 1.0 : power;
    *out = st;
    return 0;
}

int kvm_strategy_rescale(const kvm_strategy *s, int64_t B, int64_t *out)
{
    return kvm_strategy_rescale_capped(s, B, 0, out);
}

int kvm_strategy_rescale_capped(const kvm_strategy *s, int64_t B, int64_t n_ctx, int64_t *out)
{
    if (B < 1) return kvm_err(KVM_EINVAL, "strategy: budget %lld < 1", (long long)B);
    double *w = malloc((size_t)s->n_layers * sizeof *w);
    if (!w) return kvm_err(KVM_ENOMEM, "strategy: out of memory");
    for (int l = 0; l < s->n_layers; l++)
        w[l] = (double)s->layers[l].budget;
    int rc = kvm_evict_apportion_capped(w, s->n_layers, B * s->n_layers, 1, n_ctx > 0 ? n_ctx : 0, out);
    free(w);
    return rc;
}

int kvm_strategy_plan(const kvm_strategy *s, int phase, int64_t B, int n_kv_heads, kvm_evict_plan **out)
{
    return kvm_strategy_plan_capped(s, phase, B, 0, n_kv_heads, out);
}

int kvm_strategy_plan_capped(const kvm_strategy *s, int phase, int64_t B, int64_t n_ctx, int n_kv_heads,
                             kvm_evict_plan **out)
{
    *out = NULL;
    if (phase < 0 || phase >= KVM_POLYKV_PHASES) return kvm_err(KVM_EINVAL, "strategy: phase %d", phase);
    kvm_evict_plan *p;
    int rc = kvm_evict_plan_new(s->n_layers, n_kv_heads, KVM_PATTERN_NONE, 1, &p);
    if (rc) return rc;
    int64_t *bud = malloc((size_t)s->n_layers * sizeof *bud);
    if (!bud) rc = kvm_err(KVM_ENOMEM, "strategy: out of memory");
    if (!rc) rc = kvm_strategy_rescale_capped(s, B, n_ctx, bud);
    for (int l = 0; !rc && l < s->n_layers; l++)
        for (int g = 0; g < n_kv_heads; g++) {
            p->pattern[l * n_kv_heads + g] =
                kvm_pattern_is_distilled(s->layers[l].pattern[phase]) ? KVM_PATTERN_NONE : s->layers[l].pattern[phase];
            p->budget[l * n_kv_heads + g] = bud[l];
        }
    free(bud);
    if (rc) {
        kvm_evict_plan_free(&p);
        return rc;
    }
    *out = p;
    return 0;
}
