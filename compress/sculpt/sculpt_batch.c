/* sculpt_batch.c: the KVSculpt solver (arXiv 2603.27819 §3) over all problems of a document as
 * one batch (issue 12): the steps of kvm_sculpt_solve_head — Select+Fit start, ridge values,
 * then rounds of L-BFGS on the keys [and logit biases β, arXiv 2602.16284] each followed by a
 * ridge refit — taken by every problem in lockstep, so that each step is one call of the batch
 * backend (kernels/kvm_sculpt_kernels.h) over the problems still running. The L-BFGS states
 * (kvm_sculpt_lbfgs.h, reverse communication) and the Cholesky solves stay on the host: per
 * step the backend receives the points and returns losses and gradients, per ridge step it
 * returns the k×k and k×d normal equations. On the CPU backend the same driver runs one problem
 * per batch, threads taking problems in turn (solve_one_by_one), which keeps each in L2. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/sculpt/kvm_sculpt_lbfgs.h"
#include "common/kvm_error.h"
#include "common/kvm_progress.h"
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

/* The driver's state over the batched (k ≥ 1) problems; arrays packed like the backend's. */
typedef struct drv {
    const kvm_sculpt_backend *be;
    kvm_sculpt_batch *b;
    const kvm_sculpt_problem *const *ps; /* [nb] */
    const kvm_sculpt_opts *o;
    int nb, d, move_keys, use_bias;
    int64_t *k, *off, *offA;   /* [nb] */
    float *kc, *vc, *beta;     /* current points (host) */
    float *gk, *gb;            /* gradients (host) */
    float *bk, *bv, *bb;       /* best points */
    double *best, *A, *B;      /* [nb] best loss; normal equations (packed) */
    kvm_sculpt_head_stats *st; /* [nb] */
    int *idx, *live;           /* [nb] subset scratch; 1 while in the rounds */
    kvm_sculpt_eval *ev;       /* [nb] */
    kvm_sculpt_lbfgs **ls;     /* [nb] */
    double *x;                 /* [Σ n_i] L-BFGS variables scratch (n_i = k_i·d·move_keys + k_i·use_bias) */
    double *step0;             /* [nb] the last round's γ: the next round's first step */
    double *gref;              /* [nb] ‖g‖ at the start of the first round (gradient_tolerance), 0 before */
    kvm_sculpt_lbfgs **prev;   /* [nb] the last round's L-BFGS state, kept for carry_history */
} drv;

static int64_t nvar(const drv *D, int i) { return (D->move_keys ? D->k[i] * D->d : 0) + (D->use_bias ? D->k[i] : 0); }

/* Which problem a message is about: the caller's index of batched problem i. */
static int name_err(int rc, const int *map, int i)
{
    char why[200];
    snprintf(why, sizeof why, "%s", kvm_errmsg());
    return kvm_err(rc, "sculpt batch, problem %d: %s", map[i], why);
}

/* Ridge step of problems idx[n]: normal equations on the backend, solves on the host, new values
 * uploaded; or all of it on the backend where it has `ridge` (CUDA: batched Cholesky). With
 * ridge_f32 the CPU backend builds them in float32 blocks, and a problem whose Cholesky shows
 * that too coarse is refitted from float64 equations (its own data decides: batch-independent).
 * rcs[t] = 0 or KVM_ERANGE per problem (others fail the call). */
static int ridge_step(drv *D, const int *idx, int n, int *rcs, const int *map)
{
    if (D->be->ridge) {
        double *cap = malloc((size_t)(n > 0 ? n : 1) * sizeof *cap);
        if (!cap) return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
        for (int t = 0; t < n; t++)
            cap[t] = D->o->vnorm_cap > 0 ? D->o->vnorm_cap * D->ps[idx[t]]->vnorm_max : INFINITY;
        int rc = D->be->ridge(D->b, idx, n, D->use_bias, D->o->ridge_alpha, cap, D->vc, rcs);
        free(cap);
        return rc;
    }
    int rc = D->be->normal(D->b, idx, n, D->use_bias, D->A, D->B);
    if (rc) return rc;
    int *ok = malloc((size_t)(n > 0 ? n : 1) * sizeof *ok), nok = 0;
    if (!ok) return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
    for (int t = 0; t < n; t++) {
        const int i = idx[t];
        const int64_t o = D->off[i];
        double *A = D->A + D->offA[i], *B = D->B + o * D->d;
        float *vc = D->vc + o * D->d;
        rcs[t] = D->o->ridge_f32 ? kvm_sculpt_ridge_solve_f32(D->ps[i], A, B, D->k[i], D->o->ridge_alpha, D->o->vnorm_cap, vc)
                                 : kvm_sculpt_ridge_solve(D->ps[i], A, B, D->k[i], D->o->ridge_alpha, D->o->vnorm_cap, vc);
        if (rcs[t] == KVM_SCULPT_RIDGE_F64) /* float32 sums too coarse for this one: the float64 fit on the host */
            rcs[t] = kvm_sculpt_ridge(D->ps[i], D->kc + o * D->d, D->use_bias ? D->beta + o : NULL, D->k[i],
                                      D->o->ridge_alpha, D->o->vnorm_cap, 0, vc);
        if (rcs[t] && rcs[t] != KVM_ERANGE) {
            free(ok);
            return name_err(rcs[t], map, i);
        }
        if (!rcs[t]) ok[nok++] = i;
    }
    rc = D->be->upload(D->b, ok, nok, NULL, D->vc, NULL);
    free(ok);
    return rc;
}

static void save_best(drv *D, int i)
{
    const int64_t o = D->off[i], kd = D->k[i] * D->d;
    memcpy(D->bk + o * D->d, D->kc + o * D->d, (size_t)kd * sizeof *D->kc);
    memcpy(D->bv + o * D->d, D->vc + o * D->d, (size_t)kd * sizeof *D->vc);
    memcpy(D->bb + o, D->beta + o, (size_t)D->k[i] * sizeof *D->beta);
}

/* x → the host point of problem i: keys (move_keys) then β (use_bias), as float32. */
static void x_to_point(drv *D, int i, const double *x)
{
    const int64_t o = D->off[i], nk = D->move_keys ? D->k[i] * D->d : 0;
    for (int64_t t = 0; t < nk; t++) D->kc[o * D->d + t] = (float)x[t];
    for (int64_t j = 0; D->use_bias && j < D->k[i]; j++) D->beta[o + j] = (float)x[nk + j];
}

/* One L-BFGS run of every live problem from its current point, all in lockstep; leaves each
 * problem's best point in kc/beta (host and backend). */
static int lbfgs_round(drv *D, int iters, const int *map)
{
    kvm_sculpt_lbfgs_params prm = kvm_sculpt_lbfgs_params_default();
    prm.history = D->o->lbfgs_history;
    prm.max_iters = iters;
    prm.progress = D->o->lbfgs_tolerance;
    if (D->o->lbfgs_no_stop) { /* forced iteration counts: only the line search can end a run early */
        prm.past = 0;
        prm.epsilon = 0;
    }
    int rc = 0, n = 0;
    for (int i = 0; i < D->nb; i++) {
        D->ls[i] = NULL;
        if (!D->live[i]) continue;
        const int64_t o = D->off[i], nk = D->move_keys ? D->k[i] * D->d : 0;
        double *x0 = D->x; /* scratch: the state copies x0 */
        for (int64_t t = 0; t < nk; t++) x0[t] = D->kc[o * D->d + t];
        for (int64_t j = 0; D->use_bias && j < D->k[i]; j++) x0[nk + j] = D->beta[o + j];
        prm.step0 = D->step0[i];
        if (!D->o->lbfgs_no_stop) kvm_sculpt_lbfgs_gtol(&prm, D->o->lbfgs_gtol, D->gref[i]);
        if (!(D->ls[i] = kvm_sculpt_lbfgs_new(nvar(D, i), x0, &prm))) {
            rc = kvm_err(KVM_ENOMEM, "sculpt: out of memory for L-BFGS (%lld variables)", (long long)nvar(D, i));
            goto done;
        }
        kvm_sculpt_lbfgs_carry(D->ls[i], D->prev[i]);
        kvm_sculpt_lbfgs_free(D->prev[i]);
        D->prev[i] = NULL;
    }
    for (;;) { /* one batched evaluation per pass: every problem still searching */
        n = 0;
        for (int i = 0; i < D->nb; i++)
            if (D->ls[i]) {
                x_to_point(D, i, kvm_sculpt_lbfgs_x(D->ls[i]));
                D->idx[n++] = i;
            }
        if (!n) break;
        if ((rc = D->be->upload(D->b, D->idx, n, D->move_keys ? D->kc : NULL, NULL, D->use_bias ? D->beta : NULL)) ||
            (rc = D->be->lossgrad(D->b, D->idx, n, D->o->lambda, D->use_bias, D->move_keys, D->use_bias, D->ev)) ||
            (rc = D->be->download_grads(D->b, D->idx, n, D->move_keys ? D->gk : NULL, D->use_bias ? D->gb : NULL)))
            goto done;
        for (int t = 0; t < n; t++) {
            const int i = D->idx[t];
            const int64_t o = D->off[i], nk = D->move_keys ? D->k[i] * D->d : 0;
            double *g = D->x, f = D->ev[t].loss;
            D->st[i].lbfgs_calls++;
            if (isnan(f)) {
                rc = name_err(kvm_err(KVM_ERANGE, "sculpt: NaN loss in L-BFGS (k = %lld)", (long long)D->k[i]), map, i);
                goto done;
            }
            for (int64_t s = 0; s < nk; s++) g[s] = D->gk[o * D->d + s];
            for (int64_t j = 0; D->use_bias && j < D->k[i]; j++) g[nk + j] = D->gb[o + j];
            if (kvm_sculpt_lbfgs_step(D->ls[i], isfinite(f) ? f : INFINITY, g) == KVM_LBFGS_DONE) {
                x_to_point(D, i, kvm_sculpt_lbfgs_best(D->ls[i], NULL));
                D->step0[i] = kvm_sculpt_lbfgs_gamma(D->ls[i]);
                if (!(D->gref[i] > 0)) D->gref[i] = kvm_sculpt_lbfgs_gnorm0(D->ls[i]);
                if (D->o->carry_history) D->prev[i] = D->ls[i]; /* its pairs start the next round */
                else kvm_sculpt_lbfgs_free(D->ls[i]);
                D->ls[i] = NULL;
            }
        }
    }
done:
    for (int i = 0; i < D->nb; i++) {
        kvm_sculpt_lbfgs_free(D->ls[i]);
        D->ls[i] = NULL;
    }
    return rc;
}

/* Key-norm guard of problem i (as kvm_sculpt_solve_head's projection after each round). */
static void project_keys(drv *D, int i, float cap)
{
    float *kc = D->kc + D->off[i] * D->d;
    const int d = D->d;
    for (int64_t j = 0; j < D->k[i]; j++) {
        double n2 = 0;
        for (int t = 0; t < d; t++) n2 += (double)kc[j * d + t] * kc[j * d + t];
        if (sqrt(n2) > cap)
            for (int t = 0; t < d; t++) kc[j * d + t] *= (float)(cap / sqrt(n2));
    }
}

/* The solve of the batched problems: start, then the rounds. */
static int solve(drv *D, int rounds, int iters, const int *map, double *lbfgs_s, double *ridge_s)
{
    const int nb = D->nb, d = D->d;
    int rc = 0, *rcs = malloc((size_t)nb * sizeof *rcs);
    if (!rcs) return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
    int64_t *sel = NULL;
    for (int i = 0; i < nb; i++) { /* Select+Fit's start, or Attention Matching's (am_start) */
        const kvm_sculpt_problem *p = D->ps[i];
        const int64_t o = D->off[i];
        free(sel);
        if (!(sel = malloc((size_t)D->k[i] * sizeof *sel))) {
            rc = kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
            goto done;
        }
        if ((rc = kvm_sculpt_start(p, D->o, D->k[i], sel, D->kc + o * d, D->vc + o * d, D->beta + o))) goto done;
        if (!D->use_bias) memset(D->beta + o, 0, (size_t)D->k[i] * sizeof *D->beta); /* am's β unused */
        D->idx[i] = i;
    }
    if ((rc = D->be->upload(D->b, D->idx, nb, D->kc, D->vc, D->beta))) goto done;
    double t0 = now_s();
    rc = ridge_step(D, D->idx, nb, rcs, map);
    *ridge_s += now_s() - t0;
    for (int t = 0; !rc && t < nb; t++)
        if (rcs[t]) rc = kvm_err(rcs[t], "sculpt batch, problem %d: ridge fit of the start failed", map[t]);
    if (rc || (rc = D->be->lossgrad(D->b, D->idx, nb, D->o->lambda, D->use_bias, 0, 0, D->ev))) goto done;
    const int any = D->move_keys || D->use_bias;
    for (int i = 0; i < nb; i++) {
        D->best[i] = D->st[i].loss0 = D->ev[i].loss;
        D->st[i].mse = D->ev[i].mse_sum / (double)D->ps[i]->nq;
        save_best(D, i);
        D->live[i] = any;
    }
    for (int r = 0; any && r < rounds; r++) {
        t0 = now_s();
        if (iters > 0 && (rc = lbfgs_round(D, iters, map))) goto done;
        *lbfgs_s += now_s() - t0;
        int n = 0;
        for (int i = 0; i < nb; i++)
            if (D->live[i]) {
                if (D->move_keys && D->o->knorm_cap > 0) project_keys(D, i, (float)D->o->knorm_cap * D->ps[i]->knorm_max);
                D->idx[n++] = i;
            }
        if (!n) break;
        if ((rc = D->be->upload(D->b, D->idx, n, D->kc, NULL, D->beta))) goto done;
        t0 = now_s();
        rc = ridge_step(D, D->idx, n, rcs, map);
        *ridge_s += now_s() - t0;
        if (rc) goto done;
        int m = 0;
        for (int t = 0; t < n; t++) { /* a failed fit ends that problem's rounds at its best point */
            if (rcs[t]) D->live[D->idx[t]] = 0;
            else D->idx[m++] = D->idx[t];
        }
        if ((rc = D->be->lossgrad(D->b, D->idx, m, D->o->lambda, D->use_bias, 0, 0, D->ev))) goto done;
        for (int t = 0; t < m; t++) { /* a converged problem leaves the rounds (round_tolerance) */
            const int i = D->idx[t];
            if (kvm_sculpt_round_converged(D->best[i], D->ev[t].loss, D->o->round_tolerance)) D->live[i] = 0;
            if (D->ev[t].loss < D->best[i]) {
                D->best[i] = D->ev[t].loss;
                D->st[i].mse = D->ev[t].mse_sum / (double)D->ps[i]->nq;
                save_best(D, i);
            }
        }
    }
    for (int i = 0; !rc && i < nb; i++) {
        D->st[i].loss = D->best[i];
        if (!isfinite(D->best[i]))
            rc = kvm_err(KVM_ERANGE, "sculpt batch, problem %d: non-finite loss (k = %lld)", map[i], (long long)D->k[i]);
    }
done:
    free(sel);
    free(rcs);
    return rc;
}

static void drv_free(drv *D)
{
    if (D->be && D->b) D->be->batch_free(D->b);
    free(D->k);
    free(D->off);
    free(D->offA);
    free(D->kc);
    free(D->gk);
    free(D->best);
    free(D->A);
    free(D->B);
    free(D->idx);
    free(D->live);
    free(D->ev);
    free(D->ls);
    for (int i = 0; D->prev && i < D->nb; i++) kvm_sculpt_lbfgs_free(D->prev[i]);
    free(D->prev);
    free(D->x);
}

/* Allocates the driver over the batched problems map[nb] of ps. */
static int drv_new(drv *D, const kvm_sculpt_problem *const *bps, const int64_t *kb, int nb)
{
    int64_t tot = 0, totA = 0, nmax = 1;
    const int d = D->d;
    for (int i = 0; i < nb; i++) {
        tot += kb[i];
        totA += kb[i] * kb[i];
        nmax = kb[i] * (d + 1) > nmax ? kb[i] * (d + 1) : nmax;
    }
    D->nb = nb;
    D->ps = bps;
    D->k = malloc((size_t)nb * sizeof *D->k);
    D->off = malloc((size_t)nb * sizeof *D->off);
    D->offA = malloc((size_t)nb * sizeof *D->offA);
    D->kc = malloc((size_t)(tot * (3 * d + 1) * 2) * sizeof *D->kc); /* kc vc beta, best ×3, gk gb */
    D->gk = malloc((size_t)(tot * (d + 1)) * sizeof *D->gk);
    D->best = malloc((size_t)nb * 3 * sizeof *D->best);
    D->A = malloc((size_t)totA * sizeof *D->A);
    D->B = malloc((size_t)(tot * d) * sizeof *D->B);
    D->idx = malloc((size_t)nb * sizeof *D->idx);
    D->live = calloc((size_t)nb, sizeof *D->live);
    D->ev = malloc((size_t)nb * sizeof *D->ev);
    D->ls = calloc((size_t)nb, sizeof *D->ls);
    D->prev = calloc((size_t)nb, sizeof *D->prev);
    D->x = malloc((size_t)nmax * sizeof *D->x);
    if (!D->k || !D->off || !D->offA || !D->kc || !D->gk || !D->best || !D->A || !D->B || !D->idx || !D->live ||
        !D->ev || !D->ls || !D->prev || !D->x)
        return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory (%d problems, %lld entries)", nb, (long long)tot);
    D->step0 = D->best + nb;
    D->gref = D->step0 + nb;
    for (int i = 0; i < nb; i++) D->step0[i] = D->gref[i] = 0;
    D->vc = D->kc + tot * d;
    D->beta = D->vc + tot * d;
    D->bk = D->beta + tot;
    D->bv = D->bk + tot * d;
    D->bb = D->bv + tot * d;
    D->gb = D->gk + tot * d;
    int64_t o = 0, oa = 0;
    for (int i = 0; i < nb; i++) {
        D->k[i] = kb[i];
        D->off[i] = o;
        D->offA[i] = oa;
        o += kb[i];
        oa += kb[i] * kb[i];
    }
    return 0;
}

/* Solves the batched problems bps[nb] (views, budgets kb) as one backend batch on `threads`
 * threads; the best points go to kcb, vcb [Σkb][d], bb [Σkb] (packed in this batch's order),
 * the stats to bst[nb]; map[nb] names the problems in messages. */
static int solve_group(const kvm_sculpt_backend *be, const kvm_sculpt_problem *const *bps,
                       const kvm_sculpt_view *views, const int64_t *kb, int nb, const kvm_sculpt_opts *o, int threads,
                       int rounds, int iters, const int *map, float *kcb, float *vcb, float *bb,
                       kvm_sculpt_head_stats *bst, double *lbfgs_s, double *ridge_s)
{
    const int d = views[0].d;
    drv D = {.be = be, .o = o, .d = d, .move_keys = o->mode == KVM_SCULPT_FULL,
             .use_bias = o->bias || o->mode == KVM_SCULPT_JOINT_FIXED, .st = bst};
    memset(bst, 0, (size_t)nb * sizeof *bst);
    int rc = drv_new(&D, bps, kb, nb);
    if (!rc) rc = be->batch_new(be, views, kb, nb, threads, &D.b);
    if (!rc) rc = solve(&D, rounds, iters, map, lbfgs_s, ridge_s);
    if (!rc) {
        const int64_t tot = D.off[nb - 1] + kb[nb - 1];
        memcpy(kcb, D.bk, (size_t)(tot * d) * sizeof *kcb);
        memcpy(vcb, D.bv, (size_t)(tot * d) * sizeof *vcb);
        memcpy(bb, D.bb, (size_t)tot * sizeof *bb);
    }
    drv_free(&D);
    return rc;
}

/* The CPU schedule: every problem solved as a batch of its own (its queries and references,
 * ≈ 0.2–2 MB, stay in L2 for the whole solve instead of being swept once per lockstep step),
 * threads claiming problems largest first (so that the last problem claimed is a small one,
 * not a large one that leaves the other threads idle: per-head budgets differ 20-fold).
 * Bit-identical to the lockstep batch: a problem's result depends on its own data only. */
typedef struct one_by_one {
    const kvm_sculpt_backend *be;
    const kvm_sculpt_problem *const *bps;
    const kvm_sculpt_view *views;
    const int64_t *kb, *offb;
    const kvm_sculpt_opts *o;
    int nb, rounds, iters;
    const int *map;
    int *order;      /* [nb] the claim order: largest problem first */
    float *kcb, *vcb, *bb;
    kvm_sculpt_head_stats *bst;
    double *lb, *rg; /* [nb] phase seconds per problem */
    int *rc;         /* [nb] */
    kvm_progress *progress; /* one step per solved problem, or NULL */
    char (*msg)[256];
    pthread_mutex_t lock;
    int next;
} one_by_one;

static void *one_worker(void *arg)
{
    one_by_one *w = arg; /* host code in the caller's floating-point mode; the backend's calls flush subnormals */
    for (;;) {
        pthread_mutex_lock(&w->lock);
        const int c = w->next++;
        pthread_mutex_unlock(&w->lock);
        if (c >= w->nb) break;
        const int i = w->order[c];
        const int64_t o = w->offb[i], d = w->views[0].d;
        w->rc[i] = solve_group(w->be, w->bps + i, w->views + i, w->kb + i, 1, w->o, 1, w->rounds, w->iters,
                               w->map + i, w->kcb + o * d, w->vcb + o * d, w->bb + o, w->bst + i, &w->lb[i], &w->rg[i]);
        if (w->rc[i]) snprintf(w->msg[i], sizeof w->msg[i], "%s", kvm_errmsg());
        else kvm_progress_step(w->progress);
    }
    return NULL;
}

/* A problem's work for the claim order: its loss evaluations scale with nq·k, its ridge fits
 * with nq·k² (the normal equations). */
typedef struct claim {
    double cost;
    int i;
} claim;

static int claim_cmp(const void *a, const void *b)
{
    const claim *x = a, *y = b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    return x->i - y->i;
}

static int solve_one_by_one(one_by_one *w, int threads, double *lbfgs_s, double *ridge_s)
{
    int rc = 0, started = 0;
    w->lb = calloc((size_t)w->nb * 2, sizeof *w->lb);
    w->rc = calloc((size_t)w->nb, sizeof *w->rc);
    w->msg = calloc((size_t)w->nb, sizeof *w->msg);
    w->order = malloc((size_t)w->nb * sizeof *w->order);
    claim *cl = malloc((size_t)w->nb * sizeof *cl);
    pthread_t tid[256];
    if (!w->lb || !w->rc || !w->msg || !w->order || !cl || pthread_mutex_init(&w->lock, NULL)) {
        free(cl);
        rc = kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
        goto done;
    }
    for (int i = 0; i < w->nb; i++)
        cl[i] = (claim){.cost = (double)w->views[i].nq * (double)w->kb[i] * (double)(w->views[i].d + w->kb[i]), .i = i};
    qsort(cl, (size_t)w->nb, sizeof *cl, claim_cmp);
    for (int i = 0; i < w->nb; i++) w->order[i] = cl[i].i;
    free(cl);
    w->rg = w->lb + w->nb;
    w->next = 0;
    for (int t = 1; t < threads && t < w->nb && started < 256; t++)
        if (pthread_create(&tid[started], NULL, one_worker, w) == 0) started++;
    one_worker(w);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&w->lock);
    for (int i = 0; i < w->nb; i++) { /* phase seconds summed over threads; the first failure in problem order */
        *lbfgs_s += w->lb[i];
        *ridge_s += w->rg[i];
        if (!rc && w->rc[i]) rc = kvm_err(w->rc[i], "%s", w->msg[i]);
    }
done:
    free(w->lb);
    free(w->rc);
    free(w->msg);
    free(w->order);
    return rc;
}

int kvm_sculpt_solve_batch(const kvm_sculpt_problem *const *ps, int n, const kvm_sculpt_opts *o, const int64_t *k,
                           int rounds, int iters, const kvm_sculpt_backend *be, float *kc, float *vc, float *beta,
                           kvm_sculpt_head_stats *st, double *lbfgs_s, double *ridge_s, kvm_progress *progress)
{
    if (!be) be = kvm_sculpt_backend_cpu();
    *lbfgs_s = *ridge_s = 0;
    int nb = 0;
    for (int i = 0; i < n; i++) {
        memset(&st[i], 0, sizeof st[i]);
        if (k[i] < 0 || k[i] > ps[i]->nc)
            return kvm_err(KVM_EINVAL, "sculpt batch, problem %d: k = %lld distilled entries but the compress zone has "
                                       "%lld tokens", i, (long long)k[i], (long long)ps[i]->nc);
        if (ps[i]->d != ps[0]->d)
            return kvm_err(KVM_EINVAL, "sculpt batch, problem %d: head dim %d, problem 0: %d", i, ps[i]->d, ps[0]->d);
        nb += k[i] > 0;
    }
    const int d = n > 0 ? ps[0]->d : 1;
    const size_t nn = (size_t)(n > 0 ? n : 1);
    int rc = 0, *map = malloc(nn * sizeof *map);
    const kvm_sculpt_problem **bps = malloc(nn * sizeof *bps);
    int64_t *kb = malloc(nn * sizeof *kb), *offb = malloc(nn * sizeof *offb), tot = 0;
    kvm_sculpt_view *views = malloc(nn * sizeof *views);
    kvm_sculpt_head_stats *bst = malloc(nn * sizeof *bst);
    float *kcb = NULL, *vcb = NULL, *bb = NULL;
    if (!map || !bps || !kb || !offb || !views || !bst) {
        rc = kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
        goto done;
    }
    nb = 0;
    for (int i = 0; i < n; i++) {
        if (k[i] == 0) { /* nothing to fit: the retain zone alone, solved on its own */
            if ((rc = kvm_sculpt_solve_head(ps[i], o, 0, rounds, iters, kc, vc, beta, &st[i]))) goto done;
            kvm_progress_step(progress);
            continue;
        }
        const kvm_sculpt_problem *p = ps[i];
        views[nb] = (kvm_sculpt_view){.d = d, .scale = p->scale, .nq = p->nq, .nc = p->nc, .q = p->q,
                                      .o_full = p->o_full, .o_ret = p->o_ret, .lse_zone = p->lse_zone,
                                      .lse_ret = p->lse_ret, .n_vis = p->n_vis, .out_ms = p->out_ms,
                                      .lse_mass_weight = p->lse_mass_weight, .ridge_f32 = o->ridge_f32};
        map[nb] = i;
        bps[nb] = p;
        offb[nb] = tot;
        tot += k[i];
        kb[nb++] = k[i];
    }
    if (!nb) goto done;
    kcb = malloc((size_t)(tot * d) * sizeof *kcb);
    vcb = malloc((size_t)(tot * d) * sizeof *vcb);
    bb = malloc((size_t)tot * sizeof *bb);
    if (!kcb || !vcb || !bb) {
        rc = kvm_err(KVM_ENOMEM, "sculpt batch: out of memory (%d problems, %lld entries)", nb, (long long)tot);
        goto done;
    }
    if (be == kvm_sculpt_backend_cpu() && !o->lockstep && nb > 1) {
        one_by_one w = {.be = be, .bps = bps, .views = views, .kb = kb, .offb = offb, .o = o, .nb = nb,
                        .rounds = rounds, .iters = iters, .map = map, .kcb = kcb, .vcb = vcb, .bb = bb, .bst = bst,
                        .progress = progress};
        rc = solve_one_by_one(&w, o->threads, lbfgs_s, ridge_s);
    } else {
        rc = solve_group(be, bps, views, kb, nb, o, o->threads, rounds, iters, map, kcb, vcb, bb, bst, lbfgs_s,
                         ridge_s);
        for (int i = 0; !rc && i < nb; i++) kvm_progress_step(progress); /* lockstep: all end together */
    }
    if (rc) goto done;
    for (int i = 0; i < nb; i++) { /* the best points, at the caller's offsets */
        const int j = map[i];
        int64_t oj = 0;
        for (int t = 0; t < j; t++) oj += k[t];
        memcpy(kc + oj * d, kcb + offb[i] * d, (size_t)(kb[i] * d) * sizeof *kc);
        memcpy(vc + oj * d, vcb + offb[i] * d, (size_t)(kb[i] * d) * sizeof *vc);
        memcpy(beta + oj, bb + offb[i], (size_t)kb[i] * sizeof *beta);
        st[j] = bst[i];
    }
done:
    free(map);
    free(bps);
    free(kb);
    free(offb);
    free(views);
    free(bst);
    free(kcb);
    free(vcb);
    free(bb);
    return rc;
}
