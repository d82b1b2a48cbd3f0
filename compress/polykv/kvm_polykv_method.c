/* kvm_polykv_method.c: the "polykv:FILE" row of the method table: a strategy applied as
 * eviction plans (prefill, and decode with --phases both) at the requested average budget,
 * its sculpt layers distilled by KVSculpt and its kvzip layers scored by KVzip at their
 * budgets. */
#include "common/kvm_error.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "common/kvm_log.h"

#include <stdlib.h>
#include <string.h>

typedef struct polykv_opts {
    kvm_strategy *owned;   /* read from FILE, or NULL when borrowed */
    const kvm_strategy *s; /* the strategy */
    kvm_budget budget;     /* requested average budget */
    kvm_sculpt_opts sculpt; /* for the sculpt layers */
    char *file;             /* owned: the file `owned` was read from (kvm_polykv_method_check_model's messages) */
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
    o->sculpt = kvm_sculpt_opts_default();
    *opts = o;
    return 0;
}

void kvm_polykv_method_set_sculpt(void *opts, const kvm_sculpt_opts *so)
{
    ((polykv_opts *)opts)->sculpt = *so;
}

/* Splits "FILE[:name=value:...]" at the first ':' followed by a sculpt setting name and '='
 * (file names may hold ':'). *opts_at is NULL when there is no option list. */
static void split_arg(const char *arg, size_t *file_len, const char **opts_at)
{
    for (const char *c = strchr(arg, ':'); c; c = strchr(c + 1, ':'))
        if (kvm_sculpt_setting_find(c + 1, strcspn(c + 1, ":="))) { /* any spelling of a setting's name */
            *file_len = (size_t)(c - arg);
            *opts_at = c + 1;
            return;
        }
    *file_len = strlen(arg);
    *opts_at = NULL;
}

/* Writes msg as one warning line on stderr unless it is the one written last (eval makes the
 * method once per budget, a worker once per document). */
static void say_once(const char *msg)
{
    static char last[4096];
    if (!*msg || !strcmp(msg, last)) return;
    snprintf(last, sizeof last, "%s", msg);
    kvm_log(KVM_LOG_WARN, "message", NULL, 0, "%s", msg);
}

/* Says how the distilled layers of strategy s from `file` get their options: a version-1 file
 * records none, and options given after the file override the recorded ones. */
static void say_options(const char *file, const kvm_strategy *s, const kvm_sculpt_opts *used, int given)
{
    char msg[4096] = "", d[2048];
    const int nd = kvm_strategy_distilled(s);
    if (nd && !s->sculpt_known)
        snprintf(msg, sizeof msg,
                 "polykv: %s is a version-%d strategy: it does not record the options its %d sculpt/kvzip layers "
                 "were calibrated with, so they use the KVSculpt defaults%s (a calibration by this build records them)",
                 file, kvm_strategy_version(s), nd, given ? " changed by the options after the file" : "");
    else if (nd && given && !kvm_sculpt_opts_diff(used, &s->sculpt, "recorded", d, sizeof d))
        snprintf(msg, sizeof msg, "polykv: %s: the options after the file override the strategy's for its %d "
                                  "sculpt/kvzip layers: %s", file, nd, d);
    say_once(msg);
}

void kvm_polykv_strategy_sculpt_opts(const kvm_strategy *s, const kvm_sculpt_opts *own, const char *own_name,
                                     kvm_sculpt_opts *out)
{
    char msg[4096] = "", d[2048];
    const int nd = kvm_strategy_distilled(s);
    *out = *own;
    if (nd && !s->sculpt_known)
        snprintf(msg, sizeof msg, "polykv: the strategy is version 1: it does not record the options its %d "
                                  "sculpt/kvzip layers were calibrated with, so they use %s (a calibration by this "
                                  "build records them)", nd, own_name);
    else if (nd) {
        *out = s->sculpt;
        out->threads = own->threads;
        out->cuda = own->cuda;
        out->cuda_device = own->cuda_device;
        if (!kvm_sculpt_opts_diff(own, &s->sculpt, "recorded", d, sizeof d))
            snprintf(msg, sizeof msg, "polykv: the strategy's %d sculpt/kvzip layers use the options it was "
                                      "calibrated with, not these of %s: %s; calibrate again to change them",
                     nd, own_name, d);
    }
    say_once(msg);
}

/* Applies the method's option list (',' joined) to *so: KVM_EINVAL naming arg on a bad one. */
static int apply_list(kvm_sculpt_opts *so, const char *list, const char *arg)
{
    int rc = kvm_sculpt_opts_parse(so, list);
    if (rc) {
        char why[256];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        return kvm_err(rc == KVM_ENOTFOUND ? KVM_EINVAL : rc, "polykv: sculpt options of '%s': %s", arg, why);
    }
    if (so->on_policy) /* each layer's method is the strategy's; the distilled layers are fitted independently */
        return kvm_err(KVM_EINVAL, "polykv: sculpt options of '%s': on_policy fits every layer in order over the layers "
                                   "below compressed, which a PolyKV strategy's per-layer methods do not do: remove it",
                       arg);
    return 0;
}

int kvm_polykv_method_opts_new(const char *arg, const kvm_budget *budget, const kvm_model_config *c, void **opts)
{
    *opts = NULL;
    size_t flen;
    const char *sopts;
    split_arg(arg, &flen, &sopts);
    char *file = strndup(arg, flen);
    kvm_sculpt_opts so = kvm_sculpt_opts_default();
    char *list = sopts ? strdup(sopts) : NULL;
    kvm_strategy *s = NULL;
    int rc = !file || (sopts && !list) ? kvm_err(KVM_ENOMEM, "polykv: out of memory") : 0;
    for (char *p = list; p && *p; p++) /* the method syntax joins options with ':' */
        if (*p == ':') *p = ',';
    if (!rc) rc = apply_list(&so, list, arg); /* checked before the file is read */
    if (!rc) rc = kvm_strategy_read(file, &s);
    if (!rc) {
        so = s->sculpt; /* the calibration's (v2) or the defaults (v1), the given options over them */
        rc = apply_list(&so, list, arg);
    }
    if (!rc && kvm_strategy_distilled(s)) { /* its sculpt/kvzip layers would fail after the prefill */
        rc = kvm_sculpt_opts_check_combination(&so);
        if (rc) rc = kvm_err(rc, "polykv: %s: the options of its sculpt/kvzip layers: %s", file, kvm_errmsg());
    }
    if (!rc) say_options(file, s, &so, list != NULL);
    if (!rc && s->n_layers != c->n_layers)
        rc = kvm_err(KVM_EMISMATCH,
                     "polykv: strategy %s has %d layers, the model %d: it was calibrated for another "
                     "model (kvmill calibrate makes one for this one)",
                     file, s->n_layers, c->n_layers);
    if (!rc) rc = kvm_polykv_method_opts_from(s, budget, opts);
    free(list);
    if (rc) {
        free(file);
        kvm_strategy_free(&s);
        return rc;
    }
    ((polykv_opts *)*opts)->owned = s;
    ((polykv_opts *)*opts)->sculpt = so;
    ((polykv_opts *)*opts)->file = file;
    return 0;
}

int kvm_polykv_method_check_model(const void *opts, const uint8_t *model_id, const char *model)
{
    const polykv_opts *o = opts;
    return kvm_strategy_check_model(o->s, o->file ? o->file : "(the strategy in memory)", model_id, model);
}

const kvm_sculpt_opts *kvm_polykv_method_distilled_opts(const void *opts)
{
    const polykv_opts *o = opts;
    return kvm_strategy_distilled(o->s) ? &o->sculpt : NULL;
}

int kvm_polykv_method_needs_model_id(const void *opts) { return ((const polykv_opts *)opts)->s->model_known; }

void kvm_polykv_method_opts_free(void *opts)
{
    polykv_opts *o = opts;
    if (!o) return;
    kvm_strategy_free(&o->owned);
    free(o->file);
    free(o);
}

static int plan_of(const kvm_compress_input *in, const polykv_opts *o, int phase, kvm_evict_plan **plan)
{
    if (o->s->n_layers != in->model->cfg.n_layers)
        return kvm_err(KVM_EMISMATCH, "polykv: strategy of %d layers for a model of %d", o->s->n_layers,
                       in->model->cfg.n_layers);
    /* the prefill plan capped at the document's length: a layer's rescaled budget above it kept
     * the layer whole and left the surplus unspent (a short document, or a budget above the
     * calibration's); KVM_JOBCFG_POLYKV_PLAN. The decode plan is not: its cache grows past the
     * context, and a budget above the length is what keeps the continuation's entries. */
    int rc = kvm_strategy_plan_capped(o->s, phase, kvm_budget_resolve(&o->budget, in->n_tokens),
                                      phase == 0 ? in->n_tokens : 0, in->model->cfg.n_kv_heads, plan);
    if (!rc && o->s->head_split) rc = kvm_polykv_head_split(&in->model->cfg, in->cap, o->s->head_split, *plan);
    if (rc) kvm_evict_plan_free(plan);
    return rc;
}

/* The builder scores many strategies on the same documents, and with uniform allocation a
 * distilled KV head depends only on (document, layer, head, budget, options): a memo of distilled
 * heads, on while kvm_polykv_memo_begin .. _end bracket a search (single-threaded). */
typedef struct memo_entry {
    const kvm_compress_input *in;
    int layer, head;
    int64_t b;
    kvm_sculpt_mode mode; /* sculpt or kvzip layers */
    kvm_kvcache *c; /* the cache the head was distilled into (only distilled heads are filled;
                       entries of one distillation share it) */
} memo_entry;

static struct {
    int on;
    kvm_sculpt_opts o;
    memo_entry *e;
    int n, cap;
} memo;

/* Options that change a distilled layer (every field but threads, whose count does not change
 * results, and mode, which is part of an entry's key). Field by field: struct padding is not
 * comparable. */
static int opts_equal(const kvm_sculpt_opts *a, const kvm_sculpt_opts *b)
{
    return a->retain_tokens == b->retain_tokens && a->ratio == b->ratio &&
           a->k_entries == b->k_entries && a->n_synth == b->n_synth && a->future_tokens == b->future_tokens &&
           a->lambda == b->lambda && a->lse_mass_weight == b->lse_mass_weight && a->ridge_alpha == b->ridge_alpha &&
           a->ridge_f32 == b->ridge_f32 && a->lbfgs_gtol == b->lbfgs_gtol &&
           a->vnorm_cap == b->vnorm_cap && a->knorm_cap == b->knorm_cap && a->rounds == b->rounds &&
           a->lbfgs_iters == b->lbfgs_iters && a->lbfgs_history == b->lbfgs_history && a->bias == b->bias &&
           a->lbfgs_tolerance == b->lbfgs_tolerance && a->round_tolerance == b->round_tolerance &&
           a->carry_history == b->carry_history && a->am_start == b->am_start &&
           a->alloc == b->alloc && a->alloc_power == b->alloc_power && a->pilot_rounds == b->pilot_rounds &&
           a->pilot_iters == b->pilot_iters && a->seed == b->seed && a->lbfgs_oracle == b->lbfgs_oracle &&
           a->cuda == b->cuda && a->cuda_device == b->cuda_device && a->lbfgs_no_stop == b->lbfgs_no_stop &&
           !memcmp(&a->query_source, &b->query_source, sizeof a->query_source);
}

static memo_entry *memo_find(const kvm_compress_input *in, int l, int g, int64_t b, kvm_sculpt_mode mode)
{
    for (int i = 0; i < memo.n; i++)
        if (memo.e[i].in == in && memo.e[i].layer == l && memo.e[i].head == g && memo.e[i].b == b &&
            memo.e[i].mode == mode)
            return &memo.e[i];
    return NULL;
}

void kvm_polykv_memo_begin(void)
{
    kvm_polykv_memo_end();
    memo.on = 1;
}

void kvm_polykv_memo_end(void)
{
    kvm_kvcache *last = NULL; /* entries of one distillation share its cache */
    for (int i = 0; i < memo.n; i++)
        if (memo.e[i].c != last) {
            last = memo.e[i].c;
            kvm_kvcache_free(&memo.e[i].c);
        }
    free(memo.e);
    memset(&memo, 0, sizeof memo);
}

/* Remembers the heads of `done` distilled at b[l·H + g] > 0 (takes ownership of done). */
static int memo_add(const kvm_compress_input *in, const int64_t *b, int L, int H, kvm_sculpt_mode mode,
                    kvm_kvcache *done)
{
    int need = 0;
    for (int i = 0; i < L * H; i++) need += b[i] > 0;
    if (memo.n + need > memo.cap) {
        int cap = (memo.n + need) * 2;
        memo_entry *e = realloc(memo.e, (size_t)cap * sizeof *e);
        if (!e) {
            kvm_kvcache_free(&done);
            return kvm_err(KVM_ENOMEM, "polykv: out of memory");
        }
        memo.e = e;
        memo.cap = cap;
    }
    for (int i = 0; i < L * H; i++)
        if (b[i] > 0) memo.e[memo.n++] = (memo_entry){in, i / H, i % H, b[i], mode, done};
    return 0;
}

/* Distils the heads b[l·H + g] > 0 into out (kvm_sculpt_compress_heads), through the memo when
 * it is on and applies (uniform allocation). */
static int distil(const kvm_compress_input *in, const kvm_sculpt_opts *so, int64_t *b, int L, int H, kvm_kvcache *out)
{
    int use = memo.on && so->alloc == KVM_SCULPT_ALLOC_UNIFORM;
    if (use && memo.n && !opts_equal(&memo.o, so)) kvm_polykv_memo_begin(); /* other options: forget */
    if (use) memo.o = *so;
    int rc = 0, left = 0;
    for (int i = 0; use && !rc && i < L * H; i++) {
        const memo_entry *e = b[i] > 0 ? memo_find(in, i / H, i % H, b[i], so->mode) : NULL;
        if (e) {
            rc = kvm_kvcache_copy_head(out, e->c, i / H, i % H);
            b[i] = 0;
        }
        left += b[i] > 0;
    }
    if (rc || (use && !left)) return rc;
    if (!use) return kvm_sculpt_compress_heads(in, so, b, out, NULL);
    /* an empty cache: only the distilled heads get filled, so the memo holds just those */
    kvm_kvcache *done = NULL;
    rc = kvm_kvcache_new(out->n_layers, out->n_kv_heads, out->head_dim, 1, &done);
    if (!rc) rc = kvm_sculpt_compress_heads(in, so, b, done, NULL);
    for (int i = 0; !rc && i < L * H; i++)
        if (b[i] > 0) rc = kvm_kvcache_copy_head(out, done, i / H, i % H);
    if (rc) {
        kvm_kvcache_free(&done);
        return rc;
    }
    return memo_add(in, b, L, H, so->mode, done);
}

/* Distils the strategy's layers of pattern `pat` (sculpt or kvzip, left full by the plan) of
 * *out with options so. With uniform allocation each KV head gets the plan's budget for it, so
 * a head split (within layers, or over all of them) reaches these layers as it reaches the
 * eviction layers. KVSculpt's own pilot allocation (alloc ≠ uniform) redistributes whole layers:
 * then each such layer gets its heads' mean, apportioned so that they together never exceed the
 * entries the plan gave them (kvm_evict_apportion). */
static int distil_layers(const kvm_compress_input *in, const polykv_opts *o, const kvm_evict_plan *plan,
                         kvm_pattern pat, const kvm_sculpt_opts *so, kvm_kvcache *out)
{
    const int L = o->s->n_layers, H = plan->n_kv_heads, per_head = so->alloc == KVM_SCULPT_ALLOC_UNIFORM;
    int64_t *b = calloc((size_t)L * H, sizeof *b), *part = calloc((size_t)L, sizeof *part), total = 0;
    double *w = calloc((size_t)L, sizeof *w);
    int n = 0, *idx = calloc((size_t)L, sizeof *idx), rc = 0;
    if (!b || !part || !w || !idx) rc = kvm_err(KVM_ENOMEM, "polykv: out of memory");
    for (int l = 0; !rc && l < L; l++) {
        if (o->s->layers[l].pattern[0] != pat) continue;
        int64_t sum = 0;
        for (int g = 0; g < H; g++) sum += b[l * H + g] = plan->budget[l * H + g];
        w[n] = (double)sum;
        idx[n++] = l;
        total += sum;
    }
    if (!rc && n && !per_head) rc = kvm_evict_apportion(w, n, total / H > n ? total / H : n, 1, part);
    for (int i = 0; !rc && !per_head && i < n; i++)
        for (int g = 0; g < H; g++) b[idx[i] * H + g] = part[i];
    if (!rc && n) rc = distil(in, so, b, L, H, out);
    free(b);
    free(part);
    free(w);
    free(idx);
    return rc;
}

int kvm_polykv_method_compress(const kvm_compress_input *in, const void *opts, kvm_kvcache **out)
{
    const polykv_opts *o = opts;
    kvm_sculpt_opts kz = o->sculpt; /* kvzip layers: the same settings, KVzip's scoring */
    kz.mode = KVM_SCULPT_KVZIP;
    kvm_evict_plan *plan = NULL;
    int rc = plan_of(in, opts, 0, &plan);
    if (!rc) rc = kvm_evict_prefill(in, plan, out);
    if (!rc) rc = distil_layers(in, o, plan, KVM_PATTERN_SCULPT, &o->sculpt, *out);
    if (!rc) rc = distil_layers(in, o, plan, KVM_PATTERN_KVZIP, &kz, *out);
    if (rc) kvm_kvcache_free(out);
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
        /* a head keeps at most the context's tokens: a share above was lost, not another head's */
        if ((rc = kvm_evict_apportion_capped(w, n, total, 1, kvm_capture_n_tokens(cap), out))) break;
        memcpy(b, out, (size_t)n * sizeof *out);
    }
    free(w);
    free(out);
    return rc;
}
