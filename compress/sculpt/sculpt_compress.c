/* sculpt_compress.c: kvm_sculpt_compress — runs every (layer, KV head) problem of a context in
 * parallel worker threads (optionally after an allocation pilot) and assembles the ragged
 * compressed cache: distilled entries first (KVM_POS_NONE, logit bias β), then the retain zone
 * with its true positions. KVSculpt, arXiv 2603.27819. */
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "kernels/kvm_fpmode.h"
#include "kernels/kvm_sculpt_kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

kvm_sculpt_opts kvm_sculpt_opts_default(void)
{
    kvm_sculpt_opts o = {
        .mode = KVM_SCULPT_FULL, .retain_tokens = 32, .ratio = 0.3, .k_entries = 0, .n_synth = 2048,
        .future_tokens = 0, .lambda = 0.1, .ridge_alpha = 1e-3, .ridge_f32 = 1, .vnorm_cap = 1.0, .rounds = 4,
        .lbfgs_iters = 25, .lbfgs_history = 20, .carry_history = 1, .round_tolerance = 0.2, .bias = 0,
        .alloc = KVM_SCULPT_ALLOC_UNIFORM, .alloc_power = 0.5, .pilot_rounds = 0, .pilot_iters = 10, .seed = 1,
        .threads = 1,
        .query_source = {{[KVM_SCULPT_QSRC_SYNTHETIC] = 1}},
    };
    return o;
}

int kvm_sculpt_mode_parse(const char *s, kvm_sculpt_mode *out)
{
    if (s && !strcmp(s, "sculpt")) *out = KVM_SCULPT_FULL;
    else if (s && !strcmp(s, "selectfit")) *out = KVM_SCULPT_SELECTFIT;
    else if (s && !strcmp(s, "joint-fixed")) *out = KVM_SCULPT_JOINT_FIXED;
    else if (s && !strcmp(s, "am")) *out = KVM_SCULPT_AM;
    else if (s && !strcmp(s, "kvzip")) *out = KVM_SCULPT_KVZIP;
    else return kvm_err(KVM_EINVAL, "sculpt: method '%s' is not sculpt, selectfit, joint-fixed, am or kvzip", s ? s : "");
    return 0;
}

int kvm_sculpt_alloc_parse(const char *s, kvm_sculpt_alloc *out)
{
    if (s && !strcmp(s, "uniform")) *out = KVM_SCULPT_ALLOC_UNIFORM;
    else if (s && !strcmp(s, "layer")) *out = KVM_SCULPT_ALLOC_LAYER;
    else if (s && !strcmp(s, "head")) *out = KVM_SCULPT_ALLOC_HEAD;
    else if (s && !strcmp(s, "gain")) *out = KVM_SCULPT_ALLOC_GAIN;
    else return kvm_err(KVM_EINVAL, "sculpt: allocation '%s' is not uniform, layer, head or gain", s ? s : "");
    return 0;
}

/* One (layer, KV head) job of a pass. */
typedef struct job {
    int active;             /* 0: this head is not distilled in this call */
    int whole;              /* 1: its budget is its whole compress zone: the original entries are
                               kept as they are (exact; nothing is solved) */
    int64_t m;              /* its retain zone */
    int64_t k, k2;          /* budget; k2 > 0: also solve at k2 (gain pilot), keeping only its MSE */
    float *kc, *vc, *beta;  /* results [k][d], [k][d], [k] (full pass only) */
    double mse, mse2;       /* final MSE at k and k2 */
    double query_s, lbfgs_s, ridge_s;
    int rc;
    char msg[256];
} job;

typedef struct pass {
    const kvm_compress_input *in;
    const kvm_sculpt_opts *o;
    int rounds, iters, keep;  /* keep = 1: store kc/vc/beta */
    int64_t n_synth, future;
    const kvm_sculpt_qsets *qs; /* model queries (query_source), or NULL */
    int64_t n_model[KVM_SCULPT_QSRC_COUNT]; /* per problem, by source (synthetic slot: n_synth) */
    job *jobs;
    int n_jobs, next;
    double lbfgs_s, ridge_s;   /* wall seconds of the batched solves' phases */
    int build_only;            /* 1: workers only build the problems into probs (batched solve) */
    kvm_sculpt_problem *probs; /* [n_jobs]: built by run_pass's batched path, NULL otherwise */
    int keep_probs;            /* 1: run_pass leaves probs built for the next pass (the pilot's, same problems) */
    pthread_mutex_t lock;
} pass;

static int run_job(pass *ps, int i)
{
    const kvm_model_config *c = &ps->in->model->cfg;
    job *jb = &ps->jobs[i];
    int layer = i / c->n_kv_heads, kvh = i % c->n_kv_heads, d = c->head_dim;
    kvm_sculpt_problem p;
    double t0 = now_s();
    int rc = kvm_sculpt_problem_build_mixed(c, ps->in->cap, layer, kvh, jb->m, ps->n_synth, ps->future, ps->o->seed,
                                            ps->qs, ps->n_model, &p);
    jb->query_s += now_s() - t0;
    if (rc) return rc;
    p.lse_mass_weight = ps->o->lse_mass_weight;
    int64_t kmax = jb->k > jb->k2 ? jb->k : jb->k2, kk = kmax > 0 ? kmax : 1;
    float *kc = malloc((size_t)(kk * d) * sizeof *kc), *vc = malloc((size_t)(kk * d) * sizeof *vc);
    float *beta = malloc((size_t)kk * sizeof *beta);
    kvm_sculpt_head_stats st;
    if (!kc || !vc || !beta) {
        rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory (layer %d, head %d)", layer, kvh);
        goto done;
    }
    if (jb->k2 > 0) {
        if ((rc = kvm_sculpt_solve_head(&p, ps->o, jb->k2, ps->rounds, ps->iters, kc, vc, beta, &st))) goto done;
        jb->mse2 = st.mse;
        jb->lbfgs_s += st.lbfgs_s;
        jb->ridge_s += st.ridge_s;
    }
    if ((rc = kvm_sculpt_solve_head(&p, ps->o, jb->k, ps->rounds, ps->iters, kc, vc, beta, &st))) goto done;
    jb->mse = st.mse;
    jb->lbfgs_s += st.lbfgs_s;
    jb->ridge_s += st.ridge_s;
    if (ps->keep) {
        jb->kc = kc;
        jb->vc = vc;
        jb->beta = beta;
        kc = vc = beta = NULL;
    }
done:
    free(kc);
    free(vc);
    free(beta);
    kvm_sculpt_problem_free(&p);
    if (rc) {
        char why[200];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        return kvm_err(rc, "layer %d, KV head %d: %s", layer, kvh, why);
    }
    return 0;
}

/* Builds the problem of job i into ps->probs[i] (the batched solve's first step). */
static int build_job(pass *ps, int i)
{
    const kvm_model_config *c = &ps->in->model->cfg;
    job *jb = &ps->jobs[i];
    int layer = i / c->n_kv_heads, kvh = i % c->n_kv_heads;
    double t0 = now_s();
    int rc = kvm_sculpt_problem_build_mixed(c, ps->in->cap, layer, kvh, jb->m, ps->n_synth, ps->future, ps->o->seed,
                                            ps->qs, ps->n_model, &ps->probs[i]);
    jb->query_s += now_s() - t0;
    if (rc) {
        char why[200];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        return kvm_err(rc, "layer %d, KV head %d: %s", layer, kvh, why);
    }
    ps->probs[i].lse_mass_weight = ps->o->lse_mass_weight;
    return 0;
}

static void *worker(void *arg)
{
    pass *ps = arg;
    kvm_fpmode fm = kvm_fpmode_flush_enter(); /* subnormal softmax tails: 2x slower otherwise */
    for (;;) {
        pthread_mutex_lock(&ps->lock);
        int i = ps->next++;
        pthread_mutex_unlock(&ps->lock);
        if (i >= ps->n_jobs) break;
        job *jb = &ps->jobs[i];
        if (!jb->active) continue;
        if (ps->build_only) {
            jb->rc = build_job(ps, i);
            if (jb->rc) snprintf(jb->msg, sizeof jb->msg, "%s", kvm_errmsg());
            continue;
        }
        jb->rc = run_job(ps, i);
        if (jb->rc) snprintf(jb->msg, sizeof jb->msg, "%s", kvm_errmsg());
        kvm_progress_step(ps->in->progress);
    }
    kvm_fpmode_restore(fm);
    return NULL;
}

/* Runs the workers over every job of ps on `threads` threads (the caller's included). */
static int run_workers(pass *ps, int threads)
{
    ps->next = 0;
    if (pthread_mutex_init(&ps->lock, NULL)) return kvm_err(KVM_ENOMEM, "sculpt: mutex");
    pthread_t tid[256];
    int started = 0;
    for (int t = 1; t < threads && t < 256; t++)
        if (pthread_create(&tid[started], NULL, worker, ps) == 0) started++;
    worker(ps);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&ps->lock);
    for (int i = 0; i < ps->n_jobs; i++)
        if (ps->jobs[i].rc) return kvm_err(ps->jobs[i].rc, "%s", ps->jobs[i].msg);
    return 0;
}

/* Solves the built problems of the active jobs with budget k (k2 = 1: their k2, for those that
 * have one) as one batch; stores MSEs (and points when ps->keep). */
static int solve_batched(pass *ps, int k2)
{
    const int d = ps->in->model->cfg.head_dim;
    int n = 0, rc = 0;
    int64_t tot = 0;
    const kvm_sculpt_problem **pp = malloc((size_t)ps->n_jobs * sizeof *pp);
    int64_t *kk = malloc((size_t)ps->n_jobs * sizeof *kk);
    int *ji = malloc((size_t)ps->n_jobs * sizeof *ji);
    kvm_sculpt_head_stats *hs = malloc((size_t)ps->n_jobs * sizeof *hs);
    float *kc = NULL, *vc = NULL, *beta = NULL;
    if (!pp || !kk || !ji || !hs) goto oom;
    for (int i = 0; i < ps->n_jobs; i++) {
        const job *jb = &ps->jobs[i];
        if (!jb->active || (k2 && jb->k2 <= 0)) continue;
        pp[n] = &ps->probs[i];
        kk[n] = k2 ? jb->k2 : jb->k;
        tot += kk[n];
        ji[n++] = i;
    }
    kc = malloc((size_t)((tot > 0 ? tot : 1) * d) * sizeof *kc);
    vc = malloc((size_t)((tot > 0 ? tot : 1) * d) * sizeof *vc);
    beta = malloc((size_t)(tot > 0 ? tot : 1) * sizeof *beta);
    if (!kc || !vc || !beta) goto oom;
    double lb = 0, rg = 0;
    const kvm_sculpt_backend *be = ps->o->cuda ? kvm_sculpt_backend_cuda(ps->o->cuda_device) : NULL;
    if (ps->o->cuda && !be) {
        rc = kvm_err(KVM_EDEVICE, "sculpt solver: %s", kvm_errmsg());
        goto done;
    }
    if (n) /* the pilot's half budgets (k2) are not the pass's units */
        rc = kvm_sculpt_solve_batch(pp, n, ps->o, kk, ps->rounds, ps->iters, be, kc, vc, beta, hs, &lb, &rg,
                                    k2 ? NULL : ps->in->progress);
    if (rc) { /* name the (layer, KV head) */
        char why[200];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        rc = kvm_err(rc, "sculpt: %s (batch problems: the distilled (layer, KV head) pairs in layer-major order, %d KV "
                         "heads per layer)", why, ps->in->model->cfg.n_kv_heads);
        goto done;
    }
    ps->lbfgs_s += lb;
    ps->ridge_s += rg;
    int64_t off = 0;
    for (int t = 0; t < n && !rc; t++) {
        job *jb = &ps->jobs[ji[t]];
        if (k2) jb->mse2 = hs[t].mse;
        else jb->mse = hs[t].mse;
        if (!k2 && ps->keep) {
            jb->kc = malloc((size_t)((kk[t] > 0 ? kk[t] : 1) * d) * sizeof *jb->kc);
            jb->vc = malloc((size_t)((kk[t] > 0 ? kk[t] : 1) * d) * sizeof *jb->vc);
            jb->beta = malloc((size_t)(kk[t] > 0 ? kk[t] : 1) * sizeof *jb->beta);
            if (!jb->kc || !jb->vc || !jb->beta) goto oom;
            memcpy(jb->kc, kc + off * d, (size_t)(kk[t] * d) * sizeof *kc);
            memcpy(jb->vc, vc + off * d, (size_t)(kk[t] * d) * sizeof *vc);
            memcpy(jb->beta, beta + off, (size_t)kk[t] * sizeof *beta);
        }
        off += kk[t];
    }
    goto done;
oom:
    rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory");
done:
    free(pp);
    free(kk);
    free(ji);
    free(hs);
    free(kc);
    free(vc);
    free(beta);
    return rc;
}

/* Frees the built problems of ps, if any. */
static void probs_free(pass *ps)
{
    for (int i = 0; ps->probs && i < ps->n_jobs; i++) kvm_sculpt_problem_free(&ps->probs[i]);
    free(ps->probs);
    ps->probs = NULL;
}

/* Runs every job of ps on `threads` threads: per job with liblbfgs (o->lbfgs_oracle), else all
 * problems built in parallel, then solved as one batch (kvm_sculpt_solve_batch; with the gain
 * pilot's half budgets as a batch first). Returns the first failing job's status with its
 * message. */
static int run_pass(pass *ps, int threads)
{
    int64_t active = 0;
    for (int i = 0; i < ps->n_jobs; i++) active += ps->jobs[i].active != 0;
    kvm_progress_add_total(ps->in->progress, active);
    /* the oracle is per problem, and the am / kvzip baselines run no L-BFGS */
    if (ps->o->lbfgs_oracle || ps->o->mode == KVM_SCULPT_AM || ps->o->mode == KVM_SCULPT_KVZIP)
        return run_workers(ps, threads);
    if (ps->o->cuda && !kvm_sculpt_backend_cuda(ps->o->cuda_device)) /* before building anything */
        return kvm_err(KVM_EDEVICE, "sculpt solver: %s", kvm_errmsg());
    int rc = 0;
    if (!ps->probs) { /* else built by the pilot's pass: the problems do not depend on the budget */
        ps->probs = calloc((size_t)ps->n_jobs, sizeof *ps->probs);
        if (!ps->probs) return kvm_err(KVM_ENOMEM, "sculpt: out of memory");
        ps->build_only = 1;
        rc = run_workers(ps, threads);
        ps->build_only = 0;
    }
    if (!rc) rc = solve_batched(ps, 1);
    if (!rc) rc = solve_batched(ps, 0);
    if (rc || !ps->keep_probs) probs_free(ps);
    return rc;
}

/* The options' checks; the budget (ratio, k_entries) only when check_budget. */
static int check_opts(const kvm_compress_input *in, const kvm_sculpt_opts *o, int check_budget)
{
    if (!in || !in->model || !in->full || !in->cap) return kvm_err(KVM_EINVAL, "sculpt: missing model, cache or capture");
    int rc = kvm_kvcache_need_f32(in->full, "sculpt: the reference cache");
    if (rc) return rc;
    const kvm_model_config *c = &in->model->cfg;
    int64_t N = in->n_tokens;
    if (kvm_capture_n_tokens(in->cap) != N)
        return kvm_err(KVM_EINVAL, "sculpt: capture holds %lld tokens, input says N = %lld",
                       (long long)kvm_capture_n_tokens(in->cap), (long long)N);
    if (in->full->n_layers != c->n_layers || in->full->n_kv_heads != c->n_kv_heads || in->full->head_dim != c->head_dim)
        return kvm_err(KVM_EINVAL, "sculpt: full cache shape is not the model's");
    if (o->retain_tokens < 0)
        return kvm_err(KVM_EINVAL, "sculpt: retain %lld is negative", (long long)o->retain_tokens);
    if (o->retain_tokens > N) /* a short or empty document: say which, not only the numbers */
        return kvm_err(KVM_EINVAL,
                       "sculpt: the retain zone of %lld token%s is longer than the context of %lld token%s "
                       "(BOS included): give a longer document or context, or a smaller retain",
                       (long long)o->retain_tokens, kvm_plural(o->retain_tokens, "", "s"), (long long)N,
                       kvm_plural(N, "", "s"));
    if (check_budget && o->k_entries <= 0 && !(o->ratio > 0 && o->ratio <= 1))
        return kvm_err(KVM_EINVAL, "sculpt: ratio %g not in (0, 1]", o->ratio);
    if (check_budget && o->k_entries > N - o->retain_tokens)
        return kvm_err(KVM_EINVAL, "sculpt: k = %lld distilled entries exceed the compress zone of %lld tokens",
                       (long long)o->k_entries, (long long)(N - o->retain_tokens));
    if (o->n_synth < 0 || !(o->lambda >= 0) || !(o->ridge_alpha > 0) || !(o->vnorm_cap >= 0) || !(o->knorm_cap >= 0) || o->rounds < 0 ||
        o->lbfgs_iters < 0 || o->lbfgs_history < 1 || o->lbfgs_history > 1000 ||
        !(o->lbfgs_tolerance >= 0 && o->lbfgs_tolerance <= 1) || !(o->round_tolerance >= 0 && o->round_tolerance <= 1) ||
        o->threads < 1 || o->threads > 256 ||
        !(o->alloc_power >= 0) || o->cuda_device < 0 || o->pilot_rounds < 0 || o->pilot_iters < 0 || (int)o->alloc < 0 || o->alloc > 3 ||
        (int)o->mode < 0 || o->mode > KVM_SCULPT_KVZIP || c->head_dim > 512 || o->on_policy < 0 || o->on_policy > 1)
        return kvm_err(KVM_EINVAL, "sculpt: option out of range (synthetic %lld, lambda %g, alpha %g, vnorm cap %g, "
                                   "rounds %d, iters %d, history %d, threads %d, power %g)",
                       (long long)o->n_synth, o->lambda, o->ridge_alpha, o->vnorm_cap, o->rounds, o->lbfgs_iters,
                       o->lbfgs_history, o->threads, o->alloc_power);
    return kvm_sculpt_opts_check_combination(o);
}

/* Replaces the heads of dst whose job is active by the job's distilled entries followed by the
 * job's retain zone (the last m positions of in->full), or, for a whole-zone job, by every
 * position of in->full's head. */
static int assemble(const kvm_compress_input *in, const job *jobs, kvm_kvcache *dst)
{
    const kvm_model_config *c = &in->model->cfg;
    const int d = c->head_dim;
    for (int l = 0; l < c->n_layers; l++)
        for (int g = 0; g < c->n_kv_heads; g++) {
            const job *jb = &jobs[l * c->n_kv_heads + g];
            if (!jb->active) continue;
            kvm_kv_head *h = kvm_kvcache_head(dst, l, g);
            const kvm_kv_head *f = kvm_kvcache_head(in->full, l, g);
            /* a whole-zone head keeps every position of the context as it is: no distilled
             * entries, and a "retain zone" of all N positions */
            const int64_t k = jb->whole ? 0 : jb->k, span = jb->whole ? in->n_tokens : jb->m;
            int rc = kvm_kvcache_keep(h, d, NULL, 0);
            if (!rc) rc = kvm_kvcache_reserve(h, d, k + span);
            for (int64_t j = 0; !rc && j < k; j++)
                rc = kvm_kvcache_append(h, d, jb->kc + j * d, jb->vc + j * d, KVM_POS_NONE, jb->beta[j]);
            int64_t kept = 0;
            for (int64_t e = 0; !rc && e < f->n; e++)
                if (f->pos[e] != KVM_POS_NONE && f->pos[e] >= in->n_tokens - span && f->pos[e] < in->n_tokens) {
                    rc = kvm_kvcache_append(h, d, f->k + e * d, f->v + e * d, f->pos[e], f->bias[e]);
                    kept++;
                }
            if (rc) return rc;
            if (kept != span)
                return kvm_err(KVM_EINVAL, "sculpt: full cache layer %d head %d holds %lld of the %lld %s positions", l, g,
                               (long long)kept, (long long)span, jb->whole ? "context" : "retain");
        }
    return 0;
}

/* The allocation pilot over the active jobs (compacted), at their mean budget: rewrites each
 * active job's k so that the total is kept. Fills the MSE spread of st. */
static int pilot(pass *ps, const kvm_model_config *c, kvm_sculpt_stats *st)
{
    const kvm_sculpt_opts *o = ps->o;
    const int n = ps->n_jobs, H = c->n_kv_heads;
    job *jobs = ps->jobs;
    int64_t total = 0, n_act = 0;
    for (int i = 0; i < n; i++)
        if (jobs[i].active) {
            total += jobs[i].k;
            n_act++;
        }
    if (!n_act) return 0;
    int64_t kp = (total + n_act / 2) / n_act, *caps = malloc((size_t)n * sizeof *caps), *kk = malloc((size_t)n * sizeof *kk);
    double *mse = malloc((size_t)n * sizeof *mse), *mse2 = malloc((size_t)n * sizeof *mse2);
    int *idx = malloc((size_t)n * sizeof *idx), rc = 0, nl = 0;
    if (!caps || !kk || !mse || !mse2 || !idx) {
        rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory");
        goto done;
    }
    for (int l = 0; l < c->n_layers; l++) /* active layers, compacted: jobs are active per layer */
        if (jobs[l * H].active) idx[nl++] = l;
    for (int a = 0; a < nl * H; a++) {
        job *jb = &jobs[idx[a / H] * H + a % H];
        caps[a] = ps->in->n_tokens - jb->m;
        jb->k = kp < caps[a] ? kp : caps[a];
        jb->k2 = o->alloc == KVM_SCULPT_ALLOC_GAIN && jb->k > 1 ? (jb->k + 1) / 2 : 0;
    }
    double tp = now_s();
    ps->rounds = o->pilot_rounds;
    ps->iters = o->pilot_iters;
    ps->keep = 0;
    ps->keep_probs = 1; /* the main pass solves the same problems at the new budgets */
    /* the budgets come from Select+Fit's start whatever the solve's start (am_start): the
     * allocation signal stays the one measured, and am's point is not fitted twice */
    kvm_sculpt_opts po = *o;
    po.am_start = 0;
    ps->o = &po;
    rc = run_pass(ps, o->threads);
    ps->o = o;
    ps->keep_probs = 0;
    st->pilot_s = now_s() - tp;
    if (rc) goto done;
    st->mse_min = st->layer_mse_min = INFINITY;
    for (int a = 0; a < nl * H; a++) {
        job *jb = &jobs[idx[a / H] * H + a % H];
        mse[a] = jb->mse;
        mse2[a] = jb->k2 > 0 ? jb->mse2 : jb->mse;
        st->mse_min = fmin(st->mse_min, mse[a]);
        st->mse_max = fmax(st->mse_max, mse[a]);
        st->query_s += jb->query_s;
        st->lbfgs_s += jb->lbfgs_s;
        st->ridge_s += jb->ridge_s;
    }
    for (int a = 0; a < nl; a++) {
        double lm = 0;
        for (int g = 0; g < H; g++) lm += mse[a * H + g] / H;
        st->layer_mse_min = fmin(st->layer_mse_min, lm);
        st->layer_mse_max = fmax(st->layer_mse_max, lm);
    }
    if ((rc = kvm_sculpt_allocate(o->alloc, nl, H, mse, mse2, kp, caps, total, o->alloc_power, kk))) goto done;
    for (int a = 0; a < nl * H; a++) {
        job *jb = &jobs[idx[a / H] * H + a % H];
        int64_t m = jb->m;
        memset(jb, 0, sizeof *jb);
        jb->active = 1;
        jb->m = m;
        jb->k = kk[a];
    }
done:
    free(caps);
    free(kk);
    free(mse);
    free(mse2);
    free(idx);
    return rc;
}

/* Solves the active jobs (m, k set; pilot first when o->alloc is not uniform) and writes them
 * into dst. */
static int run_jobs(const kvm_compress_input *in, const kvm_sculpt_opts *o, job *jobs, kvm_kvcache *dst,
                    kvm_sculpt_stats *st)
{
    const kvm_model_config *c = &in->model->cfg;
    const int n = c->n_layers * c->n_kv_heads;
    pass ps = {.in = in, .o = o, .jobs = jobs, .n_jobs = n,
               .future = o->future_tokens > 0 ? o->future_tokens : in->n_future > 0 ? in->n_future : 64};
    /* the query sources' shares of S, and their forward passes once per document */
    kvm_sculpt_qsource_counts(&o->query_source, o->n_synth, ps.n_model);
    ps.n_synth = ps.n_model[KVM_SCULPT_QSRC_SYNTHETIC];
    kvm_sculpt_qsets own;
    int rc = in->qcache ? kvm_sculpt_qsets_ensure(in, &o->query_source, o->n_synth, in->qcache)
                        : kvm_sculpt_qsets_build(in, &o->query_source, o->n_synth, &own);
    if (rc) return rc;
    ps.qs = in->qcache ? in->qcache : &own;
    st->qprefill_s = ps.qs->seconds;
    rc = o->alloc != KVM_SCULPT_ALLOC_UNIFORM ? pilot(&ps, c, st) : 0;
    /* A head whose budget is its whole compress zone (per-head allocation gives some heads
     * that: 10 of SmolLM2's 90 at r = 0.3) keeps its original entries, which are exact; its
     * problem, the batch's largest, is not solved. */
    for (int i = 0; i < n; i++) {
        jobs[i].whole = jobs[i].active && jobs[i].k >= in->n_tokens - jobs[i].m;
        if (jobs[i].whole) jobs[i].active = 0;
    }
    if (!rc) {
        ps.rounds = o->rounds;
        ps.iters = o->lbfgs_iters;
        ps.keep = 1;
        rc = run_pass(&ps, o->threads);
        for (int i = 0; i < n; i++)
            if (jobs[i].whole) jobs[i].active = 1;
        for (int i = 0; i < n; i++) {
            st->query_s += jobs[i].query_s;
            st->lbfgs_s += jobs[i].lbfgs_s;
            st->ridge_s += jobs[i].ridge_s;
        }
    }
    st->lbfgs_s += ps.lbfgs_s;
    st->ridge_s += ps.ridge_s;
    probs_free(&ps); /* the pilot's, when it failed before the main pass */
    if (!in->qcache) kvm_sculpt_qsets_free(&own);
    if (!rc) rc = assemble(in, jobs, dst);
    return rc;
}

/* on_policy: layer by layer. Layer l's model queries come from the query_source passes over
 * a copy of the full cache whose layers below l hold what is already distilled (dst), so they
 * are the queries the model will send to layer l once the cache is served; its targets stay
 * the full layer's attention on those queries (Attention Matching's on-policy mode, arXiv
 * 2602.16284). The synthetic share (the context's own queries) does not depend on it. */
static int run_jobs_on_policy(const kvm_compress_input *in, const kvm_sculpt_opts *o, job *jobs, kvm_kvcache *dst,
                              kvm_sculpt_stats *st)
{
    const kvm_model_config *c = &in->model->cfg;
    const int H = c->n_kv_heads;
    kvm_kvcache *mixed = NULL;
    int rc = kvm_kvcache_clone(in->full, &mixed);
    for (int l = 0; !rc && l < c->n_layers; l++) {
        if (l > 0) rc = kvm_kvcache_copy_layer(mixed, dst, l - 1);
        for (int i = 0; i < c->n_layers * H; i++) jobs[i].active = i / H == l;
        kvm_compress_input ol = *in;
        ol.full = mixed;
        ol.qcache = NULL; /* the sets differ per layer: built afresh each time */
        kvm_sculpt_stats sl = {0};
        if (!rc) rc = run_jobs(&ol, o, jobs, dst, &sl);
        st->query_s += sl.query_s, st->lbfgs_s += sl.lbfgs_s, st->ridge_s += sl.ridge_s;
        st->qprefill_s += sl.qprefill_s;
    }
    kvm_kvcache_free(&mixed);
    return rc;
}

static void jobs_free(job *jobs, int n)
{
    if (jobs)
        for (int i = 0; i < n; i++) {
            free(jobs[i].kc);
            free(jobs[i].vc);
            free(jobs[i].beta);
        }
    free(jobs);
}

int64_t kvm_sculpt_k(const kvm_sculpt_opts *o, int64_t n_tokens)
{
    const int64_t nc = n_tokens - o->retain_tokens;
    int64_t ku = o->k_entries > 0 ? o->k_entries : (int64_t)llround(o->ratio * (double)nc);
    if (nc > 0 && ku < 1) ku = 1;
    return ku > nc ? (nc > 0 ? nc : 0) : ku;
}

int kvm_sculpt_compress(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out,
                        kvm_sculpt_stats *stats)
{
    *out = NULL;
    double t_start = now_s();
    int rc = check_opts(in, o, 1);
    if (rc) return rc;
    const kvm_model_config *c = &in->model->cfg;
    const int n = c->n_layers * c->n_kv_heads;
    const int64_t N = in->n_tokens, m = o->retain_tokens, nc = N - m, ku = kvm_sculpt_k(o, N);
    kvm_sculpt_stats st = {0};
    job *jobs = calloc((size_t)n, sizeof *jobs);
    if (!jobs) return kvm_err(KVM_ENOMEM, "sculpt: out of memory");
    for (int i = 0; i < n; i++) {
        jobs[i].active = 1;
        jobs[i].m = m;
        jobs[i].k = ku;
    }
    kvm_sculpt_opts x = *o;
    if (nc <= 0) x.alloc = KVM_SCULPT_ALLOC_UNIFORM; /* nothing to allocate */
    rc = kvm_kvcache_new(c->n_layers, c->n_kv_heads, c->head_dim, ku + m, out);
    if (!rc) {
        (*out)->next_pos = (int32_t)N;
        rc = o->on_policy ? run_jobs_on_policy(in, &x, jobs, *out, &st) : run_jobs(in, &x, jobs, *out, &st);
        if (rc) kvm_kvcache_free(out);
    }
    jobs_free(jobs, n);
    st.base.seconds = now_s() - t_start;
    st.base.entries = *out ? kvm_kvcache_entries(*out) : 0;
    if (stats) *stats = st;
    return rc;
}

int kvm_sculpt_compress_layers(const kvm_compress_input *in, const kvm_sculpt_opts *o, const int64_t *budget,
                               kvm_kvcache *dst, kvm_sculpt_stats *stats)
{
    const int L = in && in->model ? in->model->cfg.n_layers : 0, H = L ? in->model->cfg.n_kv_heads : 0;
    int64_t *bh = malloc((size_t)(L * H > 0 ? L * H : 1) * sizeof *bh);
    if (!bh) return kvm_err(KVM_ENOMEM, "sculpt: out of memory");
    for (int i = 0; i < L * H; i++) bh[i] = budget[i / H];
    int rc = kvm_sculpt_compress_heads(in, o, bh, dst, stats);
    free(bh);
    return rc;
}

int kvm_sculpt_compress_heads(const kvm_compress_input *in, const kvm_sculpt_opts *o, const int64_t *budget,
                              kvm_kvcache *dst, kvm_sculpt_stats *stats)
{
    double t_start = now_s();
    int rc = check_opts(in, o, 0);
    if (rc) return rc;
    const kvm_model_config *c = &in->model->cfg;
    const int H = c->n_kv_heads, n = c->n_layers * H, d = c->head_dim;
    const int64_t N = in->n_tokens;
    if (dst->n_layers != c->n_layers || dst->n_kv_heads != H || dst->head_dim != d)
        return kvm_err(KVM_EINVAL, "sculpt: destination cache shape is not the model's");
    for (int i = 0; o->alloc != KVM_SCULPT_ALLOC_UNIFORM && i < n; i++)
        if (budget[i] != budget[i - i % H])
            return kvm_err(KVM_EINVAL, "sculpt: layer %d's KV heads have budgets %lld and %lld, but an alloc other "
                                       "than uniform redistributes whole layers (one budget per layer, or alloc uniform)",
                           i / H, (long long)budget[i - i % H], (long long)budget[i]);
    kvm_sculpt_stats st = {0};
    job *jobs = calloc((size_t)n, sizeof *jobs);
    if (!jobs) return kvm_err(KVM_ENOMEM, "sculpt: out of memory");
    for (int i = 0; !rc && i < n; i++) {
        int64_t b = budget[i];
        if (b <= 0) continue;
        if (b >= N) { /* a budget of the whole context keeps it */
            rc = kvm_kvcache_copy_head(dst, in->full, i / H, i % H);
            continue;
        }
        jobs[i].active = 1;
        jobs[i].m = o->retain_tokens < b / 2 ? o->retain_tokens : b / 2;
        jobs[i].k = b - jobs[i].m;
    }
    if (!rc && o->on_policy)
        rc = kvm_err(KVM_ENOTSUP, "sculpt: on_policy is not available for PolyKV's distilled layers (their layers "
                                  "are chosen per layer by the strategy)");
    if (!rc) rc = run_jobs(in, o, jobs, dst, &st);
    jobs_free(jobs, n);
    st.base.seconds = now_s() - t_start;
    st.base.entries = kvm_kvcache_entries(dst);
    if (stats) *stats = st;
    return rc;
}

static int compress_as(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out, kvm_sculpt_mode mode)
{
    kvm_sculpt_opts x = o ? *o : kvm_sculpt_opts_default();
    x.mode = mode;
    return kvm_sculpt_compress(in, &x, out, NULL);
}

int kvm_sculpt_compress_sculpt(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out)
{
    return compress_as(in, o, out, KVM_SCULPT_FULL);
}

int kvm_sculpt_compress_selectfit(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out)
{
    return compress_as(in, o, out, KVM_SCULPT_SELECTFIT);
}

int kvm_sculpt_compress_joint_fixed(const kvm_compress_input *in, const kvm_sculpt_opts *o, kvm_kvcache **out)
{
    return compress_as(in, o, out, KVM_SCULPT_JOINT_FIXED);
}
