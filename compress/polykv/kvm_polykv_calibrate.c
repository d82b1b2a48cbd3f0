/* kvm_polykv_calibrate.c: PolyKV calibration signals. For each document, layer, phase and
 * pattern, only that layer is compressed; a probe on the forward's post_attn hook records
 * the layer's attention output at every continuation step, compared by cosine similarity
 * with the full-KV run, alongside the continuation perplexity and KL. Decode-phase runs are
 * batched: with only layer l compressed, the layers below it see full KV, so layer l's
 * queries, keys and values at every continuation step are the full-KV run's; the decode
 * policy's token-by-token evolution of layer l is replayed from those alone
 * (kvm_forward_attend), and one batched continuation with the replayed outputs substituted
 * at layer l gives what the token-by-token run gives, up to float rounding. */
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt_opts.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct probe {
    int n_layers, n_heads, n_kv_heads, head_dim;
    int64_t n_ctx, steps; /* continuation steps recorded: decode calls at positions N.. */
    int layer;            /* layer recorded, or -1 for all */
    int inject;           /* 1: write out's rows into the kernel's outputs instead of recording them */
    float *out;           /* [L or 1][steps][n_heads*head_dim] */
    float *q, *k, *v;     /* all layers only, or NULL: [L][steps][n_heads*head_dim] post-RoPE queries,
                             [L][steps][n_kv_heads*head_dim] post-RoPE keys and values */
} probe;

/* Copies w floats of backend memory src into host memory dst. */
static int rows_down(const kvm_attn_site *s, float *dst, const float *src, int64_t w)
{
    return s->kernels->download(dst, src, (size_t)w * sizeof(float));
}

/* Downloads the layer's attention outputs of the recorded continuation steps (all query
 * heads, one row per step) from the kernel's output buffer, with the queries, keys and
 * values when p->q is set; with p->inject, uploads the recorded rows over them instead. */
static int probe_post(void *user, const kvm_attn_site *s)
{
    probe *p = user;
    if (p->layer >= 0 && s->layer != p->layer) return 0;
    const int64_t row = (int64_t)p->n_heads * p->head_dim, kvd = (int64_t)p->n_kv_heads * p->head_dim;
    for (int64_t i = 0; i < s->n_q; i++) {
        int64_t st = s->qpos[i] - p->n_ctx;
        if (st < 0 || st >= p->steps) continue;
        int64_t li = p->layer >= 0 ? 0 : s->layer, at = li * p->steps + st;
        int rc = p->inject ? s->kernels->upload(s->attn->out + i * s->attn->ldo, p->out + at * row,
                                                (size_t)row * sizeof(float))
                           : rows_down(s, p->out + at * row, s->attn->out + i * s->attn->ldo, row);
        if (!rc && p->q) rc = rows_down(s, p->q + at * row, s->q + i * row, row);
        if (!rc && p->q) rc = rows_down(s, p->k + at * kvd, s->k_new + i * kvd, kvd);
        if (!rc && p->q) rc = rows_down(s, p->v + at * kvd, s->v_new + i * kvd, kvd);
        if (rc) return rc;
    }
    return 0;
}

static double cosine(const float *a, const float *b, int64_t n)
{
    if (memcmp(a, b, (size_t)n * sizeof *a) == 0) return 1.0; /* exact, not 1 ± rounding */
    double ab = 0, aa = 0, bb = 0;
    for (int64_t i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    if (aa == 0 && bb == 0) return 1.0;
    if (aa == 0 || bb == 0) return 0.0;
    return ab / sqrt(aa * bb);
}

/* The two probes of a document: ref records every layer of the full-KV continuation (run here;
 * with qkv = 1 also its queries, keys and values), pr one layer of a compressed run. Free both
 * with probes_free, also on error. */
static int probes_new(kvm_eval_doc *d, int qkv, probe *ref, probe *pr)
{
    const kvm_compress_input *in = kvm_eval_doc_input(d);
    const kvm_model_config *c = &in->model->cfg;
    const int64_t steps = in->n_future - 1 > 0 ? in->n_future - 1 : 0, row = (int64_t)c->n_heads * c->head_dim;
    const size_t n_kv = (size_t)(c->n_layers * steps * c->n_kv_heads * c->head_dim + 1);
    *ref = (probe){c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim, in->n_tokens, steps, -1, 0, NULL, NULL, NULL,
                   NULL};
    *pr = *ref;
    ref->out = calloc((size_t)(c->n_layers * steps * row + 1), sizeof(float));
    pr->out = calloc((size_t)(steps * row + 1), sizeof(float));
    if (qkv) {
        ref->q = calloc((size_t)(c->n_layers * steps * row + 1), sizeof(float));
        ref->k = calloc(n_kv, sizeof(float));
        ref->v = calloc(n_kv, sizeof(float));
    }
    if (!ref->out || !pr->out || (qkv && (!ref->q || !ref->k || !ref->v)))
        return kvm_err(KVM_ENOMEM, "calibrate: out of memory");
    kvm_hooks h = {.user = ref, .post_attn = probe_post};
    kvm_eval_result res;
    return kvm_eval_continue(d, in->full, NULL, &h, &res);
}

static void probes_free(probe *ref, probe *pr)
{
    free(ref->out);
    free(ref->q);
    free(ref->k);
    free(ref->v);
    free(pr->out);
}

/* Runs the continuation over cache cc (with decode policy pol, may be NULL) recording layer l
 * (inject = 1: substituting pr->out's rows for the layer's outputs instead), and adds the
 * layer's mean cosine against ref, the perplexity change and the KL to *cos, *ppl, *kl. */
static int probe_run(kvm_eval_doc *d, const kvm_kvcache *cc, kvm_decode_policy *pol, int l, int inject,
                     const probe *ref, probe *pr, double *cos, double *ppl, double *kl)
{
    pr->layer = l;
    pr->inject = inject;
    kvm_hooks h = {.user = pr, .post_attn = probe_post};
    kvm_eval_result res;
    int rc = kvm_eval_continue(d, cc, pol, &h, &res);
    pr->inject = 0;
    if (rc) return rc;
    const int64_t row = (int64_t)pr->n_heads * pr->head_dim;
    double cs = 0;
    for (int64_t st = 0; st < pr->steps; st++)
        cs += cosine(ref->out + ((int64_t)l * ref->steps + st) * row, pr->out + st * row, row);
    *cos += pr->steps ? cs / (double)pr->steps : 1.0;
    *ppl += res.ppl_compressed - res.ppl_full;
    *kl += res.kl_mean;
    return 0;
}

/* Replays layer l of a token-by-token decode under policy pol over the context cache cc
 * (layer l cut by the prefill plan): each step appends the full-KV run's key and value of
 * that token (ref->k, ref->v) to a cache holding only layer l and attends with its query
 * (ref->q), the policy's hooks evicting exactly as in the decode, and the outputs go to
 * pr->out. Then one batched continuation over cc with those outputs substituted at layer l
 * scores the run (probe_run with inject). */
static int replay_run(kvm_eval_doc *d, const kvm_kvcache *cc, kvm_decode_policy *pol, int l, const probe *ref,
                      probe *pr, double *cos, double *ppl, double *kl)
{
    const kvm_compress_input *in = kvm_eval_doc_input(d);
    const int64_t row = (int64_t)pr->n_heads * pr->head_dim, kvd = (int64_t)pr->n_kv_heads * pr->head_dim;
    kvm_forward *f = kvm_eval_doc_forward(d);
    kvm_kvcache *one = NULL;
    int rc = kvm_forward_cache_new(in->model, 0, &one);
    if (!rc) rc = kvm_kvcache_copy_layer(one, cc, l);
    if (!rc) rc = kvm_forward_add_hooks(f, &pol->hooks);
    for (int64_t st = 0; !rc && st < pr->steps; st++) {
        const int32_t pos = (int32_t)(pr->n_ctx + st);
        const int64_t at = (int64_t)l * ref->steps + st;
        rc = kvm_forward_attend(f, one, l, KVM_PHASE_DECODE, ref->q + at * row, ref->k + at * kvd, ref->v + at * kvd,
                                &pos, 1, pr->out + st * row);
    }
    kvm_forward_clear_hooks(f);
    kvm_kvcache_free(&one);
    return rc ? rc : probe_run(d, cc, NULL, l, 1, ref, pr, cos, ppl, kl);
}

/* One (phase, layer, pattern) run on one document; adds its signals into s. The decode phase
 * is replayed (replay_run) when ref holds the queries, else run token by token. */
static int one_run(kvm_eval_doc *d, int ph, int l, kvm_pattern r, int64_t b, const probe *ref, probe *pr,
                   kvm_polykv_signals *s)
{
    const kvm_compress_input *in = kvm_eval_doc_input(d);
    const kvm_model_config *c = &in->model->cfg;
    kvm_evict_plan *plan = NULL;
    kvm_kvcache *cc = NULL;
    kvm_decode_policy *pol = NULL;
    int rc = kvm_evict_plan_new(c->n_layers, c->n_kv_heads, KVM_PATTERN_NONE, 1, &plan);
    for (int g = 0; !rc && g < c->n_kv_heads; g++) {
        plan->pattern[l * c->n_kv_heads + g] = r;
        plan->budget[l * c->n_kv_heads + g] = b;
    }
    if (!rc) rc = kvm_evict_prefill(in, plan, &cc);
    if (!rc && ph == KVM_PHASE_DECODE) rc = kvm_evict_decode_new(c, plan, in, &pol);
    size_t i = ((size_t)ph * c->n_layers + l) * KVM_PATTERN_COUNT + r;
    if (!rc && pol && ref->q)
        rc = replay_run(d, cc, pol, l, ref, pr, &s->cosine[i], &s->ppl_delta[i], &s->kl[i]);
    else if (!rc)
        rc = probe_run(d, cc, pol, l, 0, ref, pr, &s->cosine[i], &s->ppl_delta[i], &s->kl[i]);
    kvm_decode_policy_free(&pol);
    kvm_kvcache_free(&cc);
    kvm_evict_plan_free(&plan);
    return rc;
}

static int calibrate_doc(kvm_eval_doc *d, int64_t B, const int64_t *pyr, int decode, kvm_polykv_signals *s)
{
    const kvm_compress_input *in = kvm_eval_doc_input(d);
    const kvm_model_config *c = &in->model->cfg;
    const int L = c->n_layers, phases = decode ? KVM_POLYKV_PHASES : 1;
    const int64_t N = in->n_tokens;
    probe ref, pr;
    int rc = probes_new(d, decode == KVM_POLYKV_DECODE_BATCHED, &ref, &pr);
    for (int l = 0; !rc && l < L; l++) {
        const float *ent = kvm_capture_layer_get(in->cap, l)->entropy;
        double e = 0;
        for (int64_t i = 0; i < (int64_t)c->n_heads * N; i++)
            e += ent[i];
        s->entropy[l] += e / ((double)c->n_heads * N);
    }
    for (int ph = 0; !rc && ph < phases; ph++)
        for (int l = 0; !rc && l < L; l++)
            for (int r = 0; !rc && r < KVM_PATTERN_COUNT; r++)
                rc = one_run(d, ph, l, (kvm_pattern)r, r == KVM_PATTERN_PYRAMIDKV ? pyr[l] : B, &ref, &pr, s);
    probes_free(&ref, &pr);
    return rc;
}

int kvm_polykv_signal_run(kvm_eval_doc *d, int phase, int layer, kvm_pattern r, int64_t b, int decode, double *cos,
                          double *ppl, double *kl)
{
    const kvm_model_config *c = &kvm_eval_doc_input(d)->model->cfg;
    if (phase < 0 || phase >= KVM_POLYKV_PHASES || layer < 0 || layer >= c->n_layers || (unsigned)r >= KVM_PATTERN_COUNT ||
        b < 1 || (phase == KVM_PHASE_DECODE && decode != KVM_POLYKV_DECODE_BATCHED && decode != KVM_POLYKV_DECODE_STEPWISE))
        return kvm_err(KVM_EINVAL, "calibrate: run of phase %d, layer %d, pattern %d, budget %lld, decode mode %d", phase,
                       layer, (int)r, (long long)b, decode);
    kvm_polykv_signals *s = NULL;
    probe ref, pr;
    int rc = probes_new(d, phase == KVM_PHASE_DECODE && decode == KVM_POLYKV_DECODE_BATCHED, &ref, &pr);
    if (!rc) rc = kvm_polykv_signals_new(c->n_layers, &s);
    if (!rc) rc = one_run(d, phase, layer, r, b, &ref, &pr, s);
    if (!rc) {
        size_t i = ((size_t)phase * c->n_layers + layer) * KVM_PATTERN_COUNT + r;
        *cos = s->cosine[i];
        *ppl = s->ppl_delta[i];
        *kl = s->kl[i];
    }
    kvm_polykv_signals_free(&s);
    probes_free(&ref, &pr);
    return rc;
}

int kvm_polykv_calibrate(kvm_eval_doc *const *docs, int n_docs, int64_t B, kvm_polykv_signals *s)
{
    return kvm_polykv_calibrate_phases(docs, n_docs, B, KVM_POLYKV_DECODE_BATCHED, s);
}

int kvm_polykv_calibrate_phases(kvm_eval_doc *const *docs, int n_docs, int64_t B, int decode, kvm_polykv_signals *s)
{
    if (B < 1 || n_docs < 1)
        return kvm_err(KVM_EINVAL, "calibrate: budget %lld, %d document%s", (long long)B, n_docs,
                       kvm_plural(n_docs, "", "s"));
    if (decode < KVM_POLYKV_DECODE_NONE || decode > KVM_POLYKV_DECODE_STEPWISE)
        return kvm_err(KVM_EINVAL, "calibrate: decode-phase mode %d", decode);
    const int L = s->n_layers, P = KVM_PATTERN_COUNT;
    if (kvm_eval_doc_input(docs[0])->model->cfg.n_layers != L)
        return kvm_err(KVM_EINVAL, "calibrate: signals for %d layers, model has %d", L,
                       kvm_eval_doc_input(docs[0])->model->cfg.n_layers);
    int64_t *pyr = malloc((size_t)L * sizeof *pyr);
    if (!pyr) return kvm_err(KVM_ENOMEM, "calibrate: out of memory");
    int rc = kvm_evict_pyramid_budgets(B, L, pyr);
    for (int i = 0; !rc && i < n_docs; i++)
        rc = calibrate_doc(docs[i], B, pyr, decode, s);
    free(pyr);
    if (rc) return rc;
    const size_t n3 = (size_t)KVM_POLYKV_PHASES * L * P, n2 = (size_t)L * P;
    for (size_t i = 0; i < n3; i++) {
        s->cosine[i] /= n_docs;
        s->ppl_delta[i] /= n_docs;
        s->kl[i] /= n_docs;
    }
    if (!decode) {
        memcpy(s->cosine + n2, s->cosine, n2 * sizeof *s->cosine);
        memcpy(s->ppl_delta + n2, s->ppl_delta, n2 * sizeof *s->ppl_delta);
        memcpy(s->kl + n2, s->kl, n2 * sizeof *s->kl);
    }
    s->prefill_only = !decode;
    for (int l = 0; l < L; l++)
        s->entropy[l] /= n_docs;
    for (int ph = 0; ph < KVM_POLYKV_PHASES; ph++)
        for (int l = 0; l < L; l++) {
            double w = -INFINITY;
            for (int r = 0; r < P; r++) {
                double v = s->ppl_delta[((size_t)ph * L + l) * P + r];
                if (v > w) w = v;
            }
            s->worst_ppl[ph * L + l] = w;
        }
    s->n_docs = n_docs;
    s->budget = B;
    return 0;
}

/* One document's distilled-layer signals (sculpt or kvzip, by o->mode): every layer
 * distilled once at B, then one continuation per layer with only that layer distilled;
 * adds into cos[L], ppl[L], kl[L]. */
static int distilled_doc(kvm_eval_doc *d, int64_t B, const kvm_sculpt_opts *o, double *cos, double *ppl, double *kl)
{
    const kvm_compress_input *in = kvm_eval_doc_input(d);
    const kvm_model_config *c = &in->model->cfg;
    const int L = c->n_layers;
    probe ref, pr;
    int64_t *bud = malloc((size_t)L * sizeof *bud);
    kvm_kvcache *sc = NULL, *mix = NULL;
    int rc = probes_new(d, 0, &ref, &pr);
    if (!rc && !bud) rc = kvm_err(KVM_ENOMEM, "calibrate: out of memory");
    for (int l = 0; !rc && l < L; l++) bud[l] = B;
    if (!rc) rc = kvm_kvcache_clone(in->full, &sc);
    if (!rc) rc = kvm_sculpt_compress_layers(in, o, bud, sc, NULL);
    for (int l = 0; !rc && l < L; l++) {
        rc = kvm_kvcache_clone(in->full, &mix);
        if (!rc) rc = kvm_kvcache_copy_layer(mix, sc, l);
        if (!rc) rc = probe_run(d, mix, NULL, l, 0, &ref, &pr, &cos[l], &ppl[l], &kl[l]);
        kvm_kvcache_free(&mix);
    }
    kvm_kvcache_free(&sc);
    free(bud);
    probes_free(&ref, &pr);
    return rc;
}

/* Means of distilled_doc over the documents into cos, ppl, kl (zeroed first). */
static int distilled_signals(kvm_eval_doc *const *docs, int n_docs, int64_t B, const kvm_sculpt_opts *o,
                             const kvm_polykv_signals *s, const char *what, double *cos, double *ppl, double *kl)
{
    if (B < 1 || n_docs < 1)
        return kvm_err(KVM_EINVAL, "calibrate %s: budget %lld, %d document%s", what, (long long)B, n_docs,
                       kvm_plural(n_docs, "", "s"));
    const int L = s->n_layers;
    if (kvm_eval_doc_input(docs[0])->model->cfg.n_layers != L)
        return kvm_err(KVM_EINVAL, "calibrate %s: signals for %d layers, model has %d", what, L,
                       kvm_eval_doc_input(docs[0])->model->cfg.n_layers);
    memset(cos, 0, (size_t)L * sizeof(double));
    memset(ppl, 0, (size_t)L * sizeof(double));
    memset(kl, 0, (size_t)L * sizeof(double));
    for (int i = 0; i < n_docs; i++) {
        int rc = distilled_doc(docs[i], B, o, cos, ppl, kl);
        if (rc) return rc;
    }
    for (int l = 0; l < L; l++) {
        cos[l] /= n_docs;
        ppl[l] /= n_docs;
        kl[l] /= n_docs;
    }
    return 0;
}

int kvm_polykv_calibrate_sculpt(kvm_eval_doc *const *docs, int n_docs, int64_t B, const kvm_sculpt_opts *o,
                                kvm_polykv_signals *s)
{
    s->has_sculpt = 0;
    int rc = distilled_signals(docs, n_docs, B, o, s, "sculpt", s->sculpt_cosine, s->sculpt_ppl, s->sculpt_kl);
    s->has_sculpt = rc == 0;
    if (!rc) s->sculpt_opts = *o, s->sculpt_opts_known = 1;
    return rc;
}

int kvm_polykv_calibrate_kvzip(kvm_eval_doc *const *docs, int n_docs, int64_t B, const kvm_sculpt_opts *o,
                               kvm_polykv_signals *s)
{
    kvm_sculpt_opts k = *o;
    k.mode = KVM_SCULPT_KVZIP;
    s->has_kvzip = 0;
    int rc = distilled_signals(docs, n_docs, B, &k, s, "kvzip", s->kvzip_cosine, s->kvzip_ppl, s->kvzip_kl);
    s->has_kvzip = rc == 0;
    if (!rc) s->sculpt_opts = *o, s->sculpt_opts_known = 1; /* as given: the mode is forced for kvzip alone */
    return rc;
}

int kvm_polykv_signals_csv(const kvm_polykv_signals *s, FILE *f)
{
    const int L = s->n_layers, P = KVM_PATTERN_COUNT;
    int64_t *pyr = malloc((size_t)L * sizeof *pyr);
    if (!pyr || kvm_evict_pyramid_budgets(s->budget > 0 ? s->budget : 1, L, pyr)) {
        free(pyr);
        return kvm_err(KVM_ENOMEM, "signals: out of memory");
    }
    char opts[KVM_SCULPT_OPTS_CANONICAL_MAX];
    if ((s->has_sculpt || s->has_kvzip) && s->sculpt_opts_known &&
        !kvm_sculpt_opts_canonical(&s->sculpt_opts, opts, sizeof opts))
        fprintf(f, "# sculpt_options=%s\n", opts); /* what the sculpt and kvzip rows were measured with */
    fprintf(f, "phase,layer,pattern,budget,cosine,ppl_delta,kl,entropy,worst_ppl\n");
    for (int ph = 0; ph < (s->prefill_only ? 1 : KVM_POLYKV_PHASES); ph++)
        for (int l = 0; l < L; l++)
            for (int r = 0; r < P; r++) {
                size_t i = ((size_t)ph * L + l) * P + r;
                fprintf(f, "%s,%d,%s,%lld,%.9g,%.9g,%.9g,%.9g,%.9g\n", ph ? "decode" : "prefill", l,
                        kvm_pattern_name((kvm_pattern)r), (long long)(r == KVM_PATTERN_PYRAMIDKV ? pyr[l] : s->budget),
                        s->cosine[i], s->ppl_delta[i], s->kl[i], s->entropy[l], s->worst_ppl[ph * L + l]);
            }
    const struct {
        int on;
        const char *name;
        const double *c, *p, *k;
    } dist[] = {{s->has_sculpt, "sculpt", s->sculpt_cosine, s->sculpt_ppl, s->sculpt_kl},
                {s->has_kvzip, "kvzip", s->kvzip_cosine, s->kvzip_ppl, s->kvzip_kl}};
    for (size_t i = 0; i < sizeof dist / sizeof dist[0]; i++)
        for (int ph = 0; dist[i].on && ph < (s->prefill_only ? 1 : KVM_POLYKV_PHASES); ph++)
            for (int l = 0; l < L; l++)
                fprintf(f, "%s,%d,%s,%lld,%.9g,%.9g,%.9g,%.9g,%.9g\n", ph ? "decode" : "prefill", l, dist[i].name,
                        (long long)s->budget, dist[i].c[l], dist[i].p[l], dist[i].k[l], s->entropy[l],
                        s->worst_ppl[ph * L + l]);
    free(pyr);
    return ferror(f) ? kvm_err(KVM_EIO, "signals: write failed") : 0;
}
