/* kvm_methods.c: the method table behind `kvmill eval --method NAME[:ARG]`: one row per
 * method (kvm_method in compress/kvm_compress.h). To add a method, add its row below and
 * its opts_new; the harness, the CLI and the CSV need nothing else. */
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"
#include "compress/evict/kvm_evict.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "compress/sculpt/kvm_sculpt_opts.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int64_t kvm_budget_resolve(const kvm_budget *b, int64_t n_tokens)
{
    if (b->tokens > 0) return b->tokens;
    int64_t v = (int64_t)llround(b->ratio * (double)n_tokens);
    return v < 1 ? 1 : v;
}

void kvm_decode_policy_free(kvm_decode_policy **pp)
{
    if (!pp || !*pp) return;
    if ((*pp)->state_free) (*pp)->state_free((*pp)->state);
    free(*pp);
    *pp = NULL;
}

/* ---- full KV: the context cache unchanged ---- */
static int full_opts_new(const char *arg, const kvm_budget *budget, const kvm_model_config *c, void **opts)
{
    *opts = NULL;
    return 0;
}

static void no_free(void *opts) { (void)opts; }

static int full_compress(const kvm_compress_input *in, const void *opts, kvm_kvcache **out)
{
    return kvm_kvcache_clone(in->full, out);
}

/* ---- one eviction pattern everywhere ---- */
typedef struct evict_opts {
    kvm_pattern pattern;
    kvm_budget budget;
    int n_layers, n_kv_heads;
} evict_opts;

static int evict_opts_new(kvm_pattern p, const kvm_budget *budget, const kvm_model_config *c, void **opts)
{
    if (budget->tokens < 1 && !(budget->ratio > 0 && budget->ratio <= 1))
        return kvm_err(KVM_EINVAL, "%s: a budget ≥ 1 token or a ratio in (0, 1] is required", kvm_pattern_name(p));
    evict_opts *o = malloc(sizeof *o);
    if (!o) return kvm_err(KVM_ENOMEM, "out of memory");
    *o = (evict_opts){.pattern = p, .budget = *budget, .n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads};
    *opts = o;
    return 0;
}

static int plan_for(const evict_opts *o, int64_t n, kvm_evict_plan **plan)
{
    return kvm_evict_plan_new(o->n_layers, o->n_kv_heads, o->pattern, kvm_budget_resolve(&o->budget, n), plan);
}

static int evict_compress(const kvm_compress_input *in, const void *opts, kvm_kvcache **out)
{
    kvm_evict_plan *plan = NULL;
    int rc = plan_for(opts, in->n_tokens, &plan);
    if (!rc) rc = kvm_evict_prefill(in, plan, out);
    kvm_evict_plan_free(&plan);
    return rc;
}

static int evict_decode_new(const kvm_compress_input *in, const void *opts, const kvm_kvcache *compressed,
                            kvm_decode_policy **out)
{
    kvm_evict_plan *plan = NULL;
    int rc = plan_for(opts, in->n_tokens, &plan);
    if (!rc) rc = kvm_evict_decode_new(&in->model->cfg, plan, in, out);
    kvm_evict_plan_free(&plan);
    return rc;
}

static void evict_opts_free(void *opts) { free(opts); }

#define EVICT_OPTS(fn, pat)                                                                                            \
    static int fn(const char *arg, const kvm_budget *b, const kvm_model_config *c, void **o)                           \
    {                                                                                                                  \
        return evict_opts_new(pat, b, c, o);                                                                           \
    }
EVICT_OPTS(streaming_opts, KVM_PATTERN_STREAMING)
EVICT_OPTS(h2o_opts, KVM_PATTERN_H2O)
EVICT_OPTS(tova_opts, KVM_PATTERN_TOVA)
EVICT_OPTS(snapkv_opts, KVM_PATTERN_SNAPKV)
EVICT_OPTS(pyramidkv_opts, KVM_PATTERN_PYRAMIDKV)

/* KVSculpt and its baselines (compress/sculpt/): ARG is "name=value:name=value..." with the
 * sculpt option names ("sculpt:retain=32:alloc=gain:bias:lambda=0"); --ratio r means k = r·(N−m),
 * --budget b means b entries per KV head including the retain zone, unless ARG sets budget or
 * ratio itself (ARG overrides). */
static int sculpt_opts_mode(kvm_sculpt_mode mode, const char *arg, const kvm_budget *b, void **opts)
{
    kvm_sculpt_opts *o = malloc(sizeof *o);
    if (!o) return kvm_err(KVM_ENOMEM, "sculpt: out of memory");
    *o = kvm_sculpt_opts_default();
    o->mode = mode;
    if (mode == KVM_SCULPT_KVZIP) /* KVzip scores with the context-reconstruction queries */
        o->query_source = (kvm_sculpt_qsource){{[KVM_SCULPT_QSRC_REPEAT] = 1}};
    /* the harness size first, ARG after it (kvm_sculpt_opts_parse: the last size given wins,
     * resolved against the final retain zone); in --method lists ',' separates methods, so
     * sculpt options are joined with ':' there */
    const size_t size = (arg ? strlen(arg) : 0) + 64; /* the size item and ',' before ARG: no cut option */
    char *buf = malloc(size);
    int rc = buf ? 0 : kvm_err(KVM_ENOMEM, "sculpt: out of memory"), at = 0;
    if (rc) {
        free(o);
        return rc;
    }
    if (b->tokens > 0)
        at = snprintf(buf, size, "budget=%lld", (long long)b->tokens);
    else if (b->ratio > 0 && b->ratio <= 1)
        at = snprintf(buf, size, "ratio=%.17g", b->ratio);
    else rc = kvm_sculpt_opts_set_budget(o, b); /* neither: its error */
    snprintf(buf + at, size - (size_t)at, "%s%s", arg && *arg ? "," : "", arg ? arg : "");
    for (char *p = buf; *p; p++)
        if (*p == ':') *p = ',';
    if (!rc) rc = kvm_sculpt_opts_parse(o, buf);
    if (!rc) rc = kvm_sculpt_opts_check_combination(o); /* refused with the method string, before any prefill */
    free(buf);
    if (rc) {
        free(o);
        return rc;
    }
    *opts = o;
    return 0;
}

#define SCULPT_OPTS(fn, mode)                                                                                          \
    static int fn(const char *arg, const kvm_budget *b, const kvm_model_config *c, void **o)                           \
    {                                                                                                                  \
        (void)c;                                                                                                       \
        return sculpt_opts_mode(mode, arg, b, o);                                                                      \
    }
SCULPT_OPTS(sculpt_opts, KVM_SCULPT_FULL)
SCULPT_OPTS(selectfit_opts, KVM_SCULPT_SELECTFIT)
SCULPT_OPTS(joint_fixed_opts, KVM_SCULPT_JOINT_FIXED)
SCULPT_OPTS(am_opts, KVM_SCULPT_AM)
SCULPT_OPTS(kvzip_opts, KVM_SCULPT_KVZIP)

static int sculpt_run(const kvm_compress_input *in, const void *opts, kvm_kvcache **out)
{
    return kvm_sculpt_compress(in, opts, out, NULL);
}

/* The table. One row per method: name, ARG (0 none, 1 optional, 2 required), help,
 * opts_new, opts_free, compress, decode_new (NULL: no decode-phase policy). */
static const kvm_method methods[] = {
    {"full", 0, "full KV (the reference itself; KL 0)", full_opts_new, no_free, full_compress, NULL},
    {"streaming", 0, "StreamingLLM: 4 sinks + recent window", streaming_opts, evict_opts_free, evict_compress,
     evict_decode_new},
    {"h2o", 0, "H2O: heavy hitters + recent half", h2o_opts, evict_opts_free, evict_compress, evict_decode_new},
    {"tova", 0, "TOVA: top-b by the last query's attention", tova_opts, evict_opts_free, evict_compress,
     evict_decode_new},
    {"snapkv", 0, "SnapKV: observation-window votes, max pooling", snapkv_opts, evict_opts_free, evict_compress,
     evict_decode_new},
    {"pyramidkv", 0, "PyramidKV: SnapKV with budgets 1.5B..0.5B over layers", pyramidkv_opts, evict_opts_free,
     evict_compress, evict_decode_new},
    {"polykv", 2, "PolyKV strategy file (kvmill calibrate --out), budgets rescaled to B", kvm_polykv_method_opts_new,
     kvm_polykv_method_opts_free, kvm_polykv_method_compress, kvm_polykv_method_decode_new},
    {"sculpt", 1, "KVSculpt: distilled free keys (L-BFGS) + ridge values; ARG sculpt options", sculpt_opts, free,
     sculpt_run, NULL},
    {"selectfit", 1, "Select+Fit: top attention-mass tokens, ridge-refit values", selectfit_opts, free, sculpt_run, NULL},
    {"joint-fixed", 1, "ablation: Select+Fit keys fixed, biases and values fitted", joint_fixed_opts, free, sculpt_run,
     NULL},
    {"am", 1, "Attention Matching: original keys (mass + OMP), NNLS biases, least-squares values; ARG sculpt options",
     am_opts, free, sculpt_run, NULL},
    {"kvzip", 1, "KVzip: top entries by max attention of the repeated-context queries (query_source=repeat)", kvzip_opts,
     free, sculpt_run, NULL},
};

int kvm_method_evict_plan(const kvm_method *m, const void *opts, int64_t n_tokens, kvm_evict_plan **plan)
{
    *plan = NULL;
    if (m->compress != evict_compress)
        return kvm_err(KVM_ENOTSUP, "method '%s' is not one eviction pattern everywhere", m->name);
    return plan_for(opts, n_tokens, plan);
}

const struct kvm_sculpt_opts *kvm_method_solver_opts(const kvm_method *m, const void *opts)
{
    if (m->compress == sculpt_run) return opts;
    if (m->compress == kvm_polykv_method_compress) return kvm_polykv_method_distilled_opts(opts);
    return NULL;
}

const kvm_method *kvm_method_table(int *n)
{
    *n = (int)(sizeof methods / sizeof methods[0]);
    return methods;
}

const kvm_method *kvm_method_find(const char *name)
{
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (strcmp(methods[i].name, name) == 0) return &methods[i];
    return NULL;
}

int kvm_eval_method_parse(const char *spec, char *name_buf, size_t name_size, const kvm_method **m, const char **arg)
{
    const char *colon = strchr(spec, ':');
    size_t len = colon ? (size_t)(colon - spec) : strlen(spec);
    *m = NULL;
    *arg = NULL;
    if (len == 0 || len >= name_size) return kvm_err(KVM_EINVAL, "method '%s': bad name", spec);
    memcpy(name_buf, spec, len);
    name_buf[len] = '\0';
    const kvm_method *row = kvm_method_find(name_buf);
    if (!row) {
        char names[256] = "";
        for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++) {
            strncat(names, i ? "|" : "", sizeof names - strlen(names) - 1);
            strncat(names, methods[i].name, sizeof names - strlen(names) - 1);
        }
        return kvm_err(KVM_EINVAL, "unknown method '%s' (valid: %s)", name_buf, names);
    }
    if (colon && row->arg == 0) return kvm_err(KVM_EINVAL, "method '%s' takes no ':ARG' (got '%s')", name_buf, spec);
    if (!colon && row->arg == 2)
        return kvm_err(KVM_EINVAL, "method '%s' needs ':ARG' (e.g. %s:FILE)", name_buf, name_buf);
    if (colon && colon[1] == '\0') return kvm_err(KVM_EINVAL, "method '%s': empty ':ARG'", spec);
    *m = row;
    *arg = colon ? colon + 1 : NULL;
    return 0;
}
