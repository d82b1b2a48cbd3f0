/* kvm_polykv_method.c: the "polykv:FILE" row of the method table: a strategy applied as
 * eviction plans (prefill, and decode with --phases both) at the requested average budget. */
#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"

#include <stdlib.h>
#include <string.h>

typedef struct polykv_opts {
    kvm_strategy *owned;   /* read from FILE, or NULL when borrowed */
    const kvm_strategy *s; /* the strategy */
    kvm_budget budget;     /* requested average budget */
} polykv_opts;

int kvm_polykv_method_opts_from(const kvm_strategy *s, const kvm_budget *budget, void **opts)
{
    *opts = NULL;
    if (budget->tokens < 1 && !(budget->ratio > 0 && budget->ratio <= 1))
        return kvm_err(KVM_EINVAL, "polykv: a budget ≥ 1 token or a ratio in (0, 1] is required");
    polykv_opts *o = calloc(1, sizeof *o);
    if (!o) return kvm_err(KVM_ENOMEM, "polykv: out of memory");
    o->s = s;
    o->budget = *budget;
    *opts = o;
    return 0;
}

int kvm_polykv_method_opts_new(const char *arg, const kvm_budget *budget, const kvm_model_config *c, void **opts)
{
    *opts = NULL;
    kvm_strategy *s;
    int rc = kvm_strategy_read(arg, &s);
    if (rc) return rc;
    if (s->n_layers != c->n_layers) {
        int n = s->n_layers;
        kvm_strategy_free(&s);
        return kvm_err(KVM_EMISMATCH, "polykv: %s has %d layers, the model %d", arg, n, c->n_layers);
    }
    if ((rc = kvm_polykv_method_opts_from(s, budget, opts))) {
        kvm_strategy_free(&s);
        return rc;
    }
    ((polykv_opts *)*opts)->owned = s;
    return 0;
}

void kvm_polykv_method_opts_free(void *opts)
{
    polykv_opts *o = opts;
    if (!o) return;
    kvm_strategy_free(&o->owned);
    free(o);
}

static int plan_of(const kvm_compress_input *in, const polykv_opts *o, int phase, kvm_evict_plan **plan)
{
    if (o->s->n_layers != in->model->cfg.n_layers)
        return kvm_err(KVM_EMISMATCH, "polykv: strategy of %d layers for a model of %d", o->s->n_layers,
                       in->model->cfg.n_layers);
    int rc =
        kvm_strategy_plan(o->s, phase, kvm_budget_resolve(&o->budget, in->n_tokens), in->model->cfg.n_kv_heads, plan);
    if (!rc && o->s->head_split) rc = kvm_polykv_head_split(&in->model->cfg, in->cap, o->s->head_split, *plan);
    if (rc) kvm_evict_plan_free(plan);
    return rc;
}

int kvm_polykv_method_compress(const kvm_compress_input *in, const void *opts, kvm_kvcache **out)
{
    kvm_evict_plan *plan = NULL;
    int rc = plan_of(in, opts, 0, &plan);
    if (!rc) rc = kvm_evict_prefill(in, plan, out);
    kvm_evict_plan_free(&plan);
    return rc;
}

int kvm_polykv_method_decode_new(const kvm_compress_input *in, const void *opts, const kvm_kvcache *compressed,
                                 kvm_decode_policy **out)
{
    kvm_evict_plan *plan = NULL;
    int rc = plan_of(in, opts, 1, &plan);
    if (!rc) rc = kvm_evict_decode_new(&in->model->cfg, plan, in, out);
    kvm_evict_plan_free(&plan);
    return rc;
}

/* Mean attention entropy of KV head g of layer l: over its group's query heads and all N queries. */
static double head_entropy(const kvm_model_config *c, const kvm_capture *cap, int l, int g)
{
    const int grp = c->n_heads / c->n_kv_heads;
    const int64_t N = kvm_capture_n_tokens(cap);
    const float *ent = kvm_capture_layer_get(cap, l)->entropy;
    double e = 0;
    for (int j = 0; j < grp; j++)
        for (int64_t t = 0; t < N; t++)
            e += ent[(int64_t)(g * grp + j) * N + t];
    return e / ((double)grp * N);
}

int kvm_polykv_head_split(const kvm_model_config *c, const kvm_capture *cap, int mode, kvm_evict_plan *plan)
{
    const int H = c->n_kv_heads, L = c->n_layers;
    if (mode < 1 || mode > 2) return kvm_err(KVM_EINVAL, "polykv: head split mode %d", mode);
    for (int l = 0; l < L; l++)
        if (!kvm_capture_layer_get(cap, l)->entropy)
            return kvm_err(KVM_EINVAL, "polykv: head split needs the capture's attention entropy");
    const int n = mode == 1 ? H : L * H; /* parts split together */
    double *w = malloc((size_t)n * sizeof *w);
    int64_t *out = malloc((size_t)n * sizeof *out);
    int rc = w && out ? 0 : kvm_err(KVM_ENOMEM, "polykv: out of memory");
    for (int l0 = 0; !rc && l0 < (mode == 1 ? L : 1); l0++) {
        int64_t total = 0, *b = plan->budget + (int64_t)l0 * H;
        for (int i = 0; i < n; i++) {
            total += b[i];
            w[i] = head_entropy(c, cap, l0 + i / H, i % H);
        }
        if ((rc = kvm_evict_apportion(w, n, total, 1, out))) break;
        memcpy(b, out, (size_t)n * sizeof *out);
    }
    free(w);
    free(out);
    return rc;
}
