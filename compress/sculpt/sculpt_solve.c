/* sculpt_solve.c: the per-(layer, KV head) solver (KVSculpt arXiv 2603.27819 §3): Select+Fit
 * initialisation, then alternating rounds of L-BFGS on the distilled keys (and logit biases β,
 * Attention Matching arXiv 2602.16284) with the values fixed, and a closed-form ridge fit of the
 * values with the keys fixed. The best point seen is returned. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/sculpt/kvm_sculpt_lbfgs.h"
#include "common/kvm_error.h"

#include <lbfgs.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* State shared with the liblbfgs callback. x = [keys k·d (when move_keys)] [β k (when bias)]. */
typedef struct solve_ctx {
    const kvm_sculpt_problem *p;
    int64_t k;
    double lambda;
    int move_keys, bias;
    float *kc, *vc, *beta;  /* current point (kc/beta overwritten from x at each evaluation) */
    float *gk, *gb;         /* gradient scratch */
    lbfgsfloatval_t *best_x; /* best point of this L-BFGS run */
    double best_f;
    int calls;
    int failed;             /* allocation failure inside the loss */
    double step0;           /* the last round's γ: the next round's first step (own L-BFGS) */
    double progress;        /* opts lbfgs_tolerance (own L-BFGS) */
    double gtol, gref;      /* opts gradient_tolerance and its reference ‖g‖ (the first round's start) */
    int carry;              /* opts carry_history: prev's pairs start the next round */
    kvm_sculpt_lbfgs *prev; /* the last round's state when carry (own L-BFGS) */
} solve_ctx;

/* x0 = [keys (when move_keys)] [β (when bias)] of the current point. */
static void for_init(double *x0, const solve_ctx *s, int64_t nk)
{
    for (int64_t i = 0; i < nk; i++) x0[i] = s->kc[i];
    for (int64_t j = 0; s->bias && j < s->k; j++) x0[nk + j] = s->beta[j];
}

static void x_to_point(solve_ctx *s, const lbfgsfloatval_t *x)
{
    int64_t nk = s->move_keys ? s->k * s->p->d : 0;
    for (int64_t i = 0; i < nk; i++) s->kc[i] = (float)x[i];
    if (s->bias)
        for (int64_t j = 0; j < s->k; j++) s->beta[j] = (float)x[nk + j];
}

static lbfgsfloatval_t evaluate(void *inst, const lbfgsfloatval_t *x, lbfgsfloatval_t *g, const int n,
                                const lbfgsfloatval_t step)
{
    (void)step;
    solve_ctx *s = inst;
    x_to_point(s, x);
    double f = kvm_sculpt_loss(s->p, s->kc, s->vc, s->bias ? s->beta : NULL, s->k, s->lambda,
                               s->move_keys ? s->gk : NULL, s->bias ? s->gb : NULL, NULL, NULL);
    s->calls++;
    if (!isfinite(f)) {
        s->failed = isnan(f);
        for (int i = 0; i < n; i++) g[i] = 0;
        return INFINITY;
    }
    int64_t nk = s->move_keys ? s->k * s->p->d : 0;
    for (int64_t i = 0; i < nk; i++) g[i] = s->gk[i];
    if (s->bias)
        for (int64_t j = 0; j < s->k; j++) g[nk + j] = s->gb[j];
    if (f < s->best_f) {
        s->best_f = f;
        memcpy(s->best_x, x, (size_t)n * sizeof *x);
    }
    return f;
}

/* One L-BFGS run from the current point; leaves the best point found in kc/beta. */
static int lbfgs_round(solve_ctx *s, int iters, int history)
{
    int64_t n = (s->move_keys ? s->k * s->p->d : 0) + (s->bias ? s->k : 0);
    if (n == 0 || iters <= 0) return 0;
    lbfgsfloatval_t *x = lbfgs_malloc((int)n);
    s->best_x = lbfgs_malloc((int)n);
    if (!x || !s->best_x) {
        lbfgs_free(x);
        lbfgs_free(s->best_x);
        return kvm_err(KVM_ENOMEM, "sculpt: out of memory for L-BFGS (%lld variables)", (long long)n);
    }
    int64_t nk = s->move_keys ? s->k * s->p->d : 0;
    for (int64_t i = 0; i < nk; i++) x[i] = s->kc[i];
    if (s->bias)
        for (int64_t j = 0; j < s->k; j++) x[nk + j] = s->beta[j];
    memcpy(s->best_x, x, (size_t)n * sizeof *x);
    s->best_f = INFINITY;
    lbfgs_parameter_t prm;
    lbfgs_parameter_init(&prm);
    prm.m = history;
    prm.max_iterations = iters;
    prm.epsilon = 1e-6;
    prm.linesearch = LBFGS_LINESEARCH_MORETHUENTE;
    prm.max_linesearch = 20;
    prm.past = 4;      /* stop when 4 iterations gained < 1e-4 relative: converged */
    prm.delta = 1e-4;
    lbfgsfloatval_t fx;
    /* negative returns (rounding errors, line-search limits at a flat optimum) only end the run */
    int ret = lbfgs((int)n, x, &fx, evaluate, NULL, s, &prm);
    x_to_point(s, s->best_x);
    lbfgs_free(x);
    lbfgs_free(s->best_x);
    s->best_x = NULL;
    if (ret == LBFGSERR_OUTOFMEMORY || s->failed) return kvm_err(KVM_ENOMEM, "sculpt: out of memory in L-BFGS");
    return 0;
}

/* One run of kvmill's own L-BFGS (kvm_sculpt_lbfgs.h) from the current point, with the
 * stopping rules of the liblbfgs run; leaves the best point found in kc/beta. */
static int own_round(solve_ctx *s, int iters, int history)
{
    const int64_t nk = s->move_keys ? s->k * s->p->d : 0, n = nk + (s->bias ? s->k : 0);
    if (n == 0 || iters <= 0) return 0;
    double *x0 = malloc((size_t)(2 * n) * sizeof *x0), *g = x0 + n;
    kvm_sculpt_lbfgs_params prm = kvm_sculpt_lbfgs_params_default();
    prm.history = history;
    prm.max_iters = iters;
    prm.step0 = s->step0;
    prm.progress = s->progress;
    kvm_sculpt_lbfgs_gtol(&prm, s->gtol, s->gref);
    kvm_sculpt_lbfgs *st = NULL;
    if (x0) {
        for_init(x0, s, nk);
        st = kvm_sculpt_lbfgs_new(n, x0, &prm);
    }
    if (st) kvm_sculpt_lbfgs_carry(st, s->prev);
    kvm_sculpt_lbfgs_free(s->prev);
    s->prev = NULL;
    if (!st) {
        free(x0);
        return kvm_err(KVM_ENOMEM, "sculpt: out of memory for L-BFGS (%lld variables)", (long long)n);
    }
    kvm_sculpt_lbfgs_need need = KVM_LBFGS_EVALUATE;
    while (need == KVM_LBFGS_EVALUATE && !s->failed) {
        const double *x = kvm_sculpt_lbfgs_x(st);
        x_to_point(s, x);
        double f = kvm_sculpt_loss(s->p, s->kc, s->vc, s->bias ? s->beta : NULL, s->k, s->lambda,
                                   s->move_keys ? s->gk : NULL, s->bias ? s->gb : NULL, NULL, NULL);
        s->calls++;
        if (isnan(f)) s->failed = 1;
        for (int64_t i = 0; i < nk; i++) g[i] = s->gk[i];
        for (int64_t j = 0; s->bias && j < s->k; j++) g[nk + j] = s->gb[j];
        need = kvm_sculpt_lbfgs_step(st, isfinite(f) ? f : INFINITY, g);
    }
    x_to_point(s, kvm_sculpt_lbfgs_best(st, NULL));
    s->step0 = kvm_sculpt_lbfgs_gamma(st);
    if (!(s->gref > 0)) s->gref = kvm_sculpt_lbfgs_gnorm0(st);
    if (s->carry) s->prev = st;
    else kvm_sculpt_lbfgs_free(st);
    free(x0);
    return s->failed ? kvm_err(KVM_ENOMEM, "sculpt: out of memory in L-BFGS") : 0;
}

/* Key-norm guard: rescales every key to ‖k‖ ≤ cap (a projection after each L-BFGS round). */
static void project_keys(float *kc, int64_t k, int d, float cap)
{
    for (int64_t j = 0; j < k; j++) {
        double n2 = 0;
        for (int t = 0; t < d; t++) n2 += (double)kc[j * d + t] * kc[j * d + t];
        if (sqrt(n2) > cap)
            for (int t = 0; t < d; t++) kc[j * d + t] *= (float)(cap / sqrt(n2));
    }
}

int kvm_sculpt_round_converged(double before, double after, double tol)
{
    return tol > 0 && !(before - after >= tol * fabs(before));
}

int kvm_sculpt_start(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, int64_t *sel, float *kc,
                     float *vc, float *beta)
{
    if (o->am_start) {
        kvm_sculpt_head_stats st;
        return kvm_sculpt_am_head(p, o, k, kc, vc, beta, &st);
    }
    int rc = kvm_sculpt_select(p, k, sel);
    for (int64_t j = 0; !rc && j < k; j++) {
        memcpy(kc + j * p->d, p->kz + sel[j] * p->d, (size_t)p->d * sizeof *kc);
        memcpy(vc + j * p->d, p->vz + sel[j] * p->d, (size_t)p->d * sizeof *vc);
        beta[j] = 0;
    }
    return rc;
}

int kvm_sculpt_solve_head(const kvm_sculpt_problem *p, const kvm_sculpt_opts *o, int64_t k, int rounds, int iters,
                          float *kc, float *vc, float *beta, kvm_sculpt_head_stats *st)
{
    memset(st, 0, sizeof *st);
    if (k < 0 || k > p->nc)
        return kvm_err(KVM_EINVAL, "sculpt: k = %lld distilled entries but the compress zone has %lld tokens",
                       (long long)k, (long long)p->nc);
    if (o->mode == KVM_SCULPT_AM) return kvm_sculpt_am_head(p, o, k, kc, vc, beta, st);
    if (o->mode == KVM_SCULPT_KVZIP) return kvm_sculpt_kvzip_head(p, o, k, kc, vc, beta, st);
    const int d = p->d;
    int rc = 0;
    int64_t *idx = malloc((size_t)(k > 0 ? k : 1) * sizeof *idx);
    float *bk = malloc((size_t)(k > 0 ? k : 1) * (size_t)(2 * d + 1) * sizeof *bk);
    float *gk = malloc((size_t)(k > 0 ? k : 1) * (size_t)(d + 1) * sizeof *gk);
    if (!idx || !bk || !gk) {
        rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory (k = %lld)", (long long)k);
        goto done;
    }
    if ((rc = kvm_sculpt_start(p, o, k, idx, kc, vc, beta))) goto done;
    /* joint-fixed: the keys stay the selected tokens' keys; their logit biases and values are fitted
     * on the KVSculpt objective instead (an Attention Matching-style fit, arXiv 2602.16284) */
    const int use_bias = o->bias || o->mode == KVM_SCULPT_JOINT_FIXED;
    if (!use_bias) memset(beta, 0, (size_t)k * sizeof *beta); /* am's β unused: its keys, refit values */
    const float *bp = use_bias ? beta : NULL;
    double t0 = now_s();
    rc = kvm_sculpt_ridge(p, kc, bp, k, o->ridge_alpha, o->vnorm_cap, o->ridge_f32, vc);
    st->ridge_s += now_s() - t0;
    if (rc) goto done;
    double best = kvm_sculpt_loss(p, kc, vc, bp, k, o->lambda, NULL, NULL, &st->mse, NULL);
    st->loss0 = best;
    float *best_k = bk, *best_v = bk + k * d, *best_b = bk + 2 * k * d;
    memcpy(best_k, kc, (size_t)(k * d) * sizeof *kc);
    memcpy(best_v, vc, (size_t)(k * d) * sizeof *vc);
    memcpy(best_b, beta, (size_t)k * sizeof *beta);
    int move_keys = o->mode == KVM_SCULPT_FULL;
    int any = move_keys || use_bias;
    solve_ctx s = {.p = p, .k = k, .lambda = o->lambda, .move_keys = move_keys, .bias = use_bias, .kc = kc,
                   .vc = vc, .beta = beta, .gk = gk, .gb = gk + k * d, .progress = o->lbfgs_tolerance,
                   .carry = o->carry_history, .gtol = o->lbfgs_gtol};
    for (int r = 0; any && k > 0 && r < rounds; r++) {
        t0 = now_s();
        rc = o->lbfgs_oracle ? lbfgs_round(&s, iters, o->lbfgs_history) : own_round(&s, iters, o->lbfgs_history);
        st->lbfgs_s += now_s() - t0;
        if (rc) break;
        if (move_keys && o->knorm_cap > 0) project_keys(kc, k, d, (float)o->knorm_cap * p->knorm_max);
        t0 = now_s();
        rc = kvm_sculpt_ridge(p, kc, bp, k, o->ridge_alpha, o->vnorm_cap, o->ridge_f32, vc);
        st->ridge_s += now_s() - t0;
        if (rc == KVM_ERANGE) { rc = 0; break; } /* keep the best point so far */
        if (rc) break;
        double mse, L = kvm_sculpt_loss(p, kc, vc, bp, k, o->lambda, NULL, NULL, &mse, NULL);
        const int converged = kvm_sculpt_round_converged(best, L, o->round_tolerance);
        if (L < best) {
            best = L;
            st->mse = mse;
            memcpy(best_k, kc, (size_t)(k * d) * sizeof *kc);
            memcpy(best_v, vc, (size_t)(k * d) * sizeof *vc);
            memcpy(best_b, beta, (size_t)k * sizeof *beta);
        }
        if (converged) break;
    }
    kvm_sculpt_lbfgs_free(s.prev);
    if (rc) goto done;
    memcpy(kc, best_k, (size_t)(k * d) * sizeof *kc);
    memcpy(vc, best_v, (size_t)(k * d) * sizeof *vc);
    memcpy(beta, best_b, (size_t)k * sizeof *beta);
    st->loss = best;
    st->lbfgs_calls = s.calls;
    if (!isfinite(best)) rc = kvm_err(KVM_ERANGE, "sculpt: non-finite loss (k = %lld)", (long long)k);
done:
    free(idx);
    free(bk);
    free(gk);
    return rc;
}
