/* sculpt_lbfgs.c: reverse-communication L-BFGS with a strong-Wolfe line search (Nocedal &
 * Wright Alg. 7.4, 3.5, 3.6); see kvm_sculpt_lbfgs.h. float64 throughout. */
#include "compress/sculpt/kvm_sculpt_lbfgs.h"
#include "kernels/kvm_sculpt_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { PH_INIT, PH_LS, PH_DONE };
enum { LS_CONTINUE, LS_ACCEPT, LS_ACCEPT_LO, LS_FAIL }; /* ACCEPT_LO: the point is a_lo (phi_lo, gl) */

struct kvm_sculpt_lbfgs {
    int64_t n;
    kvm_sculpt_lbfgs_params p;
    int phase, evals, iters, count, head; /* count pairs stored, head = next slot */
    int stop;            /* kvm_sculpt_lbfgs_stop */
    double f, fbest, f0; /* f0: the value at the start point */
    double gn0, gstop;   /* ‖g‖ at the start point; the gtol threshold (0: off) */
    double *x, *g, *d, *xt, *gl, *best, *S, *Y, *rho, *alf, *pf;
    /* line search: phi(a) = f(x + a·d) */
    double phi0, dphi0, a_cur, a_prev, phi_prev, dphi_prev;
    double a_lo, phi_lo, dphi_lo, a_hi, phi_hi, dphi_hi;
    int zoom, ls_evals;
};

kvm_sculpt_lbfgs_params kvm_sculpt_lbfgs_params_default(void)
{
    kvm_sculpt_lbfgs_params p = {.history = 20, .max_iters = 30, .max_linesearch = 20, .past = 4, .delta = 1e-4,
                                 .epsilon = 1e-6, .c1 = 1e-4, .c2 = 0.9};
    return p;
}

/* ⟨a, b⟩ and y += a·x on the CPU backend's cloned vector code (kernels/kvm_sculpt_kernels.h):
 * the two-loop recursion is ~40 of each per iteration over the k·d variables. */
static double dot(const double *a, const double *b, int64_t n) { return kvm_cpu_ddot(a, b, n); }

static void axpy(double *restrict y, double a, const double *restrict x, int64_t n) { kvm_cpu_daxpy(y, a, x, n); }

kvm_sculpt_lbfgs *kvm_sculpt_lbfgs_new(int64_t n, const double *x0, const kvm_sculpt_lbfgs_params *p)
{
    if (n < 1 || p->history < 1) return NULL;
    kvm_sculpt_lbfgs *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    const int64_t m = p->history;
    s->x = malloc((size_t)(n * (6 + 2 * m) + 2 * m + p->past + 1) * sizeof *s->x);
    if (!s->x) {
        free(s);
        return NULL;
    }
    s->n = n;
    s->p = *p;
    s->g = s->x + n;
    s->d = s->g + n;
    s->xt = s->d + n;
    s->gl = s->xt + n;
    s->best = s->gl + n;
    s->S = s->best + n;
    s->Y = s->S + m * n;
    s->rho = s->Y + m * n;
    s->alf = s->rho + m;
    s->pf = s->alf + m;
    memcpy(s->xt, x0, (size_t)n * sizeof *x0);
    memcpy(s->best, x0, (size_t)n * sizeof *x0);
    s->fbest = INFINITY;
    s->phase = PH_INIT;
    return s;
}

void kvm_sculpt_lbfgs_free(kvm_sculpt_lbfgs *s)
{
    if (s) free(s->x);
    free(s);
}

const double *kvm_sculpt_lbfgs_x(const kvm_sculpt_lbfgs *s) { return s->xt; }

const double *kvm_sculpt_lbfgs_best(const kvm_sculpt_lbfgs *s, double *f)
{
    if (f) *f = s->fbest;
    return s->best;
}

double kvm_sculpt_lbfgs_gamma(const kvm_sculpt_lbfgs *s)
{
    if (s->count == 0) return 0;
    const int64_t m = s->p.history;
    const int j = (int)((s->head - 1 + m) % m);
    const double *y = s->Y + j * s->n;
    return 1.0 / (s->rho[j] * dot(y, y, s->n));
}

void kvm_sculpt_lbfgs_carry(kvm_sculpt_lbfgs *s, const kvm_sculpt_lbfgs *prev)
{
    if (!prev || prev->n != s->n || prev->p.history != s->p.history || s->phase != PH_INIT) return;
    const int64_t m = s->p.history, n = s->n;
    memcpy(s->S, prev->S, (size_t)(2 * m * n + m) * sizeof *s->S); /* S, Y, rho: contiguous */
    s->count = prev->count;
    s->head = prev->head;
}

void kvm_sculpt_lbfgs_gtol(kvm_sculpt_lbfgs_params *p, double gtol, double g_ref)
{
    if (!(gtol > 0)) return;
    p->epsilon = 0;
    p->gtol = gtol;
    p->g_ref = g_ref;
}

kvm_sculpt_lbfgs_stop kvm_sculpt_lbfgs_stopped(const kvm_sculpt_lbfgs *s) { return (kvm_sculpt_lbfgs_stop)s->stop; }
double kvm_sculpt_lbfgs_gnorm0(const kvm_sculpt_lbfgs *s) { return s->gn0; }

/* The gradient test: ‖g‖ = gn at x small by the absolute rule (epsilon, liblbfgs's) or by the
 * scale-free one (gtol·g_ref). */
static int gradient_small(const kvm_sculpt_lbfgs *s, double gn, const double *x)
{
    if (gn <= s->p.epsilon * fmax(1.0, sqrt(dot(x, x, s->n)))) return 1; /* ε = 0: only at g = 0 */
    return s->gstop > 0 && gn <= s->gstop;
}

int kvm_sculpt_lbfgs_evaluations(const kvm_sculpt_lbfgs *s) { return s->evals; }
int kvm_sculpt_lbfgs_iterations(const kvm_sculpt_lbfgs *s) { return s->iters; }

/* xt = x + a·d and a new line search from a (phi0, dphi0 from the current f, g). */
static void set_trial(kvm_sculpt_lbfgs *s, double a)
{
    s->a_cur = a;
    memcpy(s->xt, s->x, (size_t)s->n * sizeof *s->xt);
    axpy(s->xt, a, s->d, s->n);
}

static void start_ls(kvm_sculpt_lbfgs *s, double a)
{
    s->phi0 = s->f;
    s->dphi0 = dot(s->g, s->d, s->n);
    s->a_prev = 0;
    s->phi_prev = s->phi0;
    s->dphi_prev = s->dphi0;
    memcpy(s->gl, s->g, (size_t)s->n * sizeof *s->g);
    s->zoom = 0;
    s->ls_evals = 0;
    set_trial(s, a);
}

/* Minimiser of the cubic through (lo, phi, dphi) and (hi, phi, dphi) (N&W eq. 3.59), kept in
 * the middle 80% of the interval; bisection when it is not defined. */
static double zoom_trial(const kvm_sculpt_lbfgs *s)
{
    const double a0 = s->a_lo, a1 = s->a_hi, w = fabs(a1 - a0), mid = 0.5 * (a0 + a1);
    if (!isfinite(s->phi_hi) || !isfinite(s->dphi_hi)) return mid;
    double d1 = s->dphi_lo + s->dphi_hi - 3.0 * (s->phi_lo - s->phi_hi) / (a0 - a1);
    double disc = d1 * d1 - s->dphi_lo * s->dphi_hi;
    if (!(disc >= 0)) return mid;
    double d2 = (a1 > a0 ? 1.0 : -1.0) * sqrt(disc);
    double a = a1 - (a1 - a0) * (s->dphi_hi + d2 - d1) / (s->dphi_hi - s->dphi_lo + 2.0 * d2);
    double lo = fmin(a0, a1) + 0.1 * w, hi = fmax(a0, a1) - 0.1 * w;
    return isfinite(a) && a >= lo && a <= hi ? a : mid;
}

/* Takes the trial's phi, dphi (its g in g); returns LS_CONTINUE (xt set), LS_ACCEPT (xt, g
 * are the accepted point's) or LS_FAIL. The last Armijo point is kept in a_lo/phi_lo/gl. */
static int ls_update(kvm_sculpt_lbfgs *s, double phi, double dphi, const double *g)
{
    const kvm_sculpt_lbfgs_params *p = &s->p;
    const double a = s->a_cur, armijo = s->phi0 + p->c1 * a * s->dphi0;
    s->ls_evals++;
    if (!s->zoom) {
        if (!isfinite(phi) || phi > armijo || (s->ls_evals > 1 && phi >= s->phi_prev)) {
            s->a_lo = s->a_prev, s->phi_lo = s->phi_prev, s->dphi_lo = s->dphi_prev; /* gl holds its g */
            s->a_hi = a, s->phi_hi = phi, s->dphi_hi = dphi;
            s->zoom = 1;
        } else if (fabs(dphi) <= -p->c2 * s->dphi0) {
            return LS_ACCEPT;
        } else {
            memcpy(s->gl, g, (size_t)s->n * sizeof *g);
            if (dphi >= 0) {
                s->a_hi = s->a_prev, s->phi_hi = s->phi_prev, s->dphi_hi = s->dphi_prev;
                s->a_lo = a, s->phi_lo = phi, s->dphi_lo = dphi;
                s->zoom = 1;
            } else {
                s->a_prev = a, s->phi_prev = phi, s->dphi_prev = dphi;
                s->a_lo = a, s->phi_lo = phi;
                if (s->ls_evals >= p->max_linesearch) goto fallback;
                set_trial(s, 2.0 * a);
                return LS_CONTINUE;
            }
        }
    } else if (!isfinite(phi) || phi > armijo || phi >= s->phi_lo) {
        s->a_hi = a, s->phi_hi = phi, s->dphi_hi = dphi;
    } else {
        if (fabs(dphi) <= -p->c2 * s->dphi0) return LS_ACCEPT;
        if (dphi * (s->a_hi - s->a_lo) >= 0) s->a_hi = s->a_lo, s->phi_hi = s->phi_lo, s->dphi_hi = s->dphi_lo;
        s->a_lo = a, s->phi_lo = phi, s->dphi_lo = dphi;
        memcpy(s->gl, g, (size_t)s->n * sizeof *g);
    }
    if (s->ls_evals >= p->max_linesearch || fabs(s->a_hi - s->a_lo) <= 1e-12 * fmax(s->a_lo, s->a_hi)) goto fallback;
    set_trial(s, zoom_trial(s));
    return LS_CONTINUE;
fallback: /* out of evaluations: the last point with sufficient decrease, if any */
    if (!(s->a_lo > 0 && s->phi_lo < s->phi0)) return LS_FAIL;
    set_trial(s, s->a_lo);
    return LS_ACCEPT_LO;
}

/* d = −H·g by the two-loop recursion over the stored pairs (N&W Alg. 7.4, H0 = γI, eq. 7.20). */
static void direction(kvm_sculpt_lbfgs *s)
{
    const int64_t n = s->n, m = s->p.history;
    for (int64_t i = 0; i < n; i++) s->d[i] = -s->g[i];
    for (int c = 0; c < s->count; c++) {
        int j = (int)((s->head - 1 - c + 2 * m) % m);
        s->alf[j] = s->rho[j] * dot(s->S + j * n, s->d, n);
        axpy(s->d, -s->alf[j], s->Y + j * n, n); /* d − α·y, exactly as d + (−α)·y */
    }
    if (s->count > 0) {
        const double gamma = kvm_sculpt_lbfgs_gamma(s);
        for (int64_t i = 0; i < n; i++) s->d[i] *= gamma;
    }
    for (int c = s->count - 1; c >= 0; c--) {
        int j = (int)((s->head - 1 - c + 2 * m) % m);
        double b = s->rho[j] * dot(s->Y + j * n, s->d, n);
        axpy(s->d, s->alf[j] - b, s->S + j * n, n);
    }
}

/* Moves to the accepted point (xt, fa, ga), stores the pair, tests convergence. Returns 1 when
 * the run is over. */
static int accept(kvm_sculpt_lbfgs *s, double fa, const double *ga)
{
    const int64_t n = s->n, m = s->p.history;
    double *sv = s->S + s->head * n, *y = s->Y + s->head * n;
    for (int64_t i = 0; i < n; i++) {
        sv[i] = s->xt[i] - s->x[i];
        y[i] = ga[i] - s->g[i];
    }
    double ys = dot(y, sv, n);
    memcpy(s->x, s->xt, (size_t)n * sizeof *s->x);
    memcpy(s->g, ga, (size_t)n * sizeof *s->g);
    s->f = fa;
    s->iters++;
    if (ys > 1e-300 * fmax(1.0, dot(y, y, n))) { /* curvature: always under strong Wolfe */
        s->rho[s->head] = 1.0 / ys;
        s->head = (int)((s->head + 1) % m);
        if (s->count < m) s->count++;
    }
    const int past = s->p.past;
    if (past > 0) {
        if (s->iters >= past) {
            const double gain = s->pf[s->iters % past] - fa;
            if (gain / fabs(fa) < s->p.delta || (s->p.progress > 0 && gain < s->p.progress * (s->f0 - fa))) {
                s->stop = KVM_LBFGS_STOP_DECREASE;
                return 1;
            }
        }
        s->pf[s->iters % past] = fa;
    }
    if (gradient_small(s, sqrt(dot(s->g, s->g, n)), s->x)) {
        s->stop = KVM_LBFGS_STOP_GRADIENT;
        return 1;
    }
    if (s->iters >= s->p.max_iters) s->stop = KVM_LBFGS_STOP_ITERATIONS;
    return s->iters >= s->p.max_iters;
}

kvm_sculpt_lbfgs_need kvm_sculpt_lbfgs_step(kvm_sculpt_lbfgs *s, double f, const double *g)
{
    const int64_t n = s->n;
    if (s->phase == PH_DONE) return KVM_LBFGS_DONE;
    s->evals++;
    if (isfinite(f) && f < s->fbest) {
        s->fbest = f;
        memcpy(s->best, s->xt, (size_t)n * sizeof *s->best);
    }
    if (s->phase == PH_INIT) {
        memcpy(s->x, s->xt, (size_t)n * sizeof *s->x);
        memcpy(s->g, g, (size_t)n * sizeof *s->g);
        s->f = s->f0 = f;
        s->pf[0] = f;
        double gn = sqrt(dot(g, g, n));
        s->gn0 = gn;
        s->gstop = s->p.gtol > 0 ? s->p.gtol * (s->p.g_ref > 0 ? s->p.g_ref : gn) : 0;
        s->stop = !isfinite(f) ? KVM_LBFGS_STOP_NONFINITE : s->p.max_iters < 1 ? KVM_LBFGS_STOP_ITERATIONS
                  : gradient_small(s, gn, s->x) ? KVM_LBFGS_STOP_GRADIENT : KVM_LBFGS_STOP_NONE;
        if (s->stop) {
            s->phase = PH_DONE;
            return KVM_LBFGS_DONE;
        }
        s->phase = PH_LS;
        if (s->count > 0) { /* carried pairs: the quasi-Newton step at once */
            direction(s);
            if (dot(s->g, s->d, n) < 0) {
                start_ls(s, 1.0);
                return KVM_LBFGS_EVALUATE;
            }
            s->count = 0;
        }
        for (int64_t i = 0; i < n; i++) s->d[i] = -g[i];
        start_ls(s, s->p.step0 > 0 && isfinite(s->p.step0) ? s->p.step0 : 1.0 / gn);
        return KVM_LBFGS_EVALUATE;
    }
    int r = ls_update(s, f, dot(g, s->d, n), g);
    if (r == LS_CONTINUE) return KVM_LBFGS_EVALUATE;
    if (r == LS_FAIL) s->stop = KVM_LBFGS_STOP_LINESEARCH;
    if (r == LS_FAIL || accept(s, r == LS_ACCEPT ? f : s->phi_lo, r == LS_ACCEPT ? g : s->gl)) {
        s->phase = PH_DONE;
        return KVM_LBFGS_DONE;
    }
    direction(s);
    if (!(dot(s->g, s->d, n) < 0)) { /* not a descent direction: restart from steepest descent */
        s->count = 0;
        for (int64_t i = 0; i < n; i++) s->d[i] = -s->g[i];
        start_ls(s, 1.0 / sqrt(dot(s->g, s->g, n)));
        return KVM_LBFGS_EVALUATE;
    }
    start_ls(s, 1.0);
    return KVM_LBFGS_EVALUATE;
}
