/* kvm_sculpt_lbfgs.h: L-BFGS of our own for the KVSculpt key fit (issue 12), written in
 * reverse communication so that many problems can step in lockstep with one batched loss and
 * gradient evaluation per step: the caller asks each problem's state which point it needs,
 * evaluates all of them at once (any order, any backend), hands the values back and steps.
 * Nocedal & Wright, Numerical Optimization (2nd ed.): the two-loop recursion (Alg. 7.4, H0 =
 * sᵀy/yᵀy·I, eq. 7.20) and a line search satisfying the strong Wolfe conditions (Alg. 3.5
 * with zoom, Alg. 3.6, cubic interpolation eq. 3.59 safeguarded). Stopping rules are those of
 * the liblbfgs run it replaces (‖g‖ ≤ ε·max(1, ‖x‖), relative decrease over `past`
 * iterations, iteration cap, 20 evaluations per line search), plus an optional progress test
 * (the decrease over `past` iterations against the run's whole decrease). A problem's iterates depend on
 * its own values only, so results never depend on what else is in a batch. */
#ifndef KVM_SCULPT_LBFGS_H
#define KVM_SCULPT_LBFGS_H

#include <stdint.h>

/* Settings (kvm_sculpt_lbfgs_params_default gives those the solver used with liblbfgs). */
typedef struct kvm_sculpt_lbfgs_params {
    int history;         /* m pairs kept (default 20) */
    int max_iters;       /* iterations (accepted line searches) (default 30) */
    int max_linesearch;  /* evaluations per line search (default 20) */
    int past;            /* decrease test distance (default 4; 0 = off) */
    double delta;        /* stop when (f_{it−past} − f)/|f| < delta (default 1e-4) */
    double progress;     /* stop when f_{it−past} − f < progress·(f_0 − f): the last `past`
                            iterations gained less than this share of the run's decrease from its
                            start f_0 (scale-free, unlike delta); 0 = off (default 0) */
    double epsilon;      /* stop when ‖g‖ ≤ ε·max(1, ‖x‖) (default 1e-6; 0 = off) */
    double gtol;         /* stop when ‖g‖ ≤ gtol·g_ref: scale-free, unlike epsilon; 0 = off (default 0) */
    double g_ref;        /* the reference gradient norm of gtol (the solver passes ‖g‖ at the start of a
                            problem's first round); ≤ 0: this run's own ‖g‖ at its start point */
    double c1, c2;       /* Wolfe constants (default 1e-4, 0.9) */
    double step0;        /* first trial step along −g; 0: 1/‖g‖ (liblbfgs's) (default 0). A run
                            that continues an earlier one passes that run's kvm_sculpt_lbfgs_gamma,
                            the H0 = γI scaling (N&W eq. 7.20), so its first line search starts
                            near the accepted step instead of expanding from 1/‖g‖ */
} kvm_sculpt_lbfgs_params;

/* What a state needs next. */
typedef enum kvm_sculpt_lbfgs_need {
    KVM_LBFGS_EVALUATE = 0, /* evaluate f and g at x (kvm_sculpt_lbfgs_x), then call _step */
    KVM_LBFGS_DONE = 1,     /* finished: the best point seen is in _best */
} kvm_sculpt_lbfgs_need;

typedef struct kvm_sculpt_lbfgs kvm_sculpt_lbfgs;

kvm_sculpt_lbfgs_params kvm_sculpt_lbfgs_params_default(void);

/* A state for n variables starting at x0 [n] (copied). NULL on allocation failure (or n < 1).
 * The first need is an evaluation at x0. */
kvm_sculpt_lbfgs *kvm_sculpt_lbfgs_new(int64_t n, const double *x0, const kvm_sculpt_lbfgs_params *p);

void kvm_sculpt_lbfgs_free(kvm_sculpt_lbfgs *s); /* accepts NULL */

/* The point [n] to evaluate next (valid until the next _step; owned by s). */
const double *kvm_sculpt_lbfgs_x(const kvm_sculpt_lbfgs *s);

/* Hands back f and g [n] (read) at the point of _x and advances. A non-finite f counts as a
 * failed trial (the step shrinks). Returns what is needed next. */
kvm_sculpt_lbfgs_need kvm_sculpt_lbfgs_step(kvm_sculpt_lbfgs *s, double f, const double *g);

/* The best point [n] evaluated so far and its value (+∞ before any finite evaluation). */
const double *kvm_sculpt_lbfgs_best(const kvm_sculpt_lbfgs *s, double *f);

/* γ = sᵀy/yᵀy of the newest stored pair (the scaling of H0, N&W eq. 7.20), 0 when none is
 * stored: a later run's step0. */
double kvm_sculpt_lbfgs_gamma(const kvm_sculpt_lbfgs *s);

/* Starts s (new, before its first _step) with the pairs (s, y) stored by prev, an earlier run
 * on the same variables (NULL, another size or history: nothing is carried): the solver's next
 * round, whose objective the ridge refit of the values has moved, so the pairs are curvature
 * of a nearby function. The first iteration then takes the two-loop direction (N&W Alg. 7.4)
 * with unit step; if that is no descent direction the pairs are dropped and the run starts
 * from −g as without them. */
void kvm_sculpt_lbfgs_carry(kvm_sculpt_lbfgs *s, const kvm_sculpt_lbfgs *prev);

/* The solver's scale-free gradient stop (opts gradient_tolerance): gtol > 0 replaces the
 * absolute test (epsilon = 0) by ‖g‖ ≤ gtol·g_ref, g_ref = ‖g‖ at the start of the problem's
 * first round (≤ 0 while that round has not run: its own start); gtol = 0 leaves p as it is. */
void kvm_sculpt_lbfgs_gtol(kvm_sculpt_lbfgs_params *p, double gtol, double g_ref);

/* Why a finished run stopped (KVM_LBFGS_STOP_NONE while it runs). */
typedef enum kvm_sculpt_lbfgs_stop {
    KVM_LBFGS_STOP_NONE = 0,
    KVM_LBFGS_STOP_GRADIENT,   /* the gradient test (epsilon or gtol) */
    KVM_LBFGS_STOP_DECREASE,   /* delta or progress over `past` iterations */
    KVM_LBFGS_STOP_ITERATIONS, /* max_iters (or max_iters < 1) */
    KVM_LBFGS_STOP_LINESEARCH, /* no acceptable step */
    KVM_LBFGS_STOP_NONFINITE,  /* non-finite value at the start point */
} kvm_sculpt_lbfgs_stop;

/* The stop reason of run s (read-only; KVM_LBFGS_STOP_NONE until kvm_sculpt_lbfgs_step has
 * returned KVM_LBFGS_DONE): the solver tests and bench_solver read it. No errors. */
kvm_sculpt_lbfgs_stop kvm_sculpt_lbfgs_stopped(const kvm_sculpt_lbfgs *s);

/* ‖g‖ at the run's start point (0 before its first _step). */
double kvm_sculpt_lbfgs_gnorm0(const kvm_sculpt_lbfgs *s);

/* Evaluations and accepted iterations so far. */
int kvm_sculpt_lbfgs_evaluations(const kvm_sculpt_lbfgs *s);
int kvm_sculpt_lbfgs_iterations(const kvm_sculpt_lbfgs *s);

#endif
