/* check_sculpt.c: the KVSculpt solver (compress/sculpt/): analytic gradient vs finite
 * differences, ridge normal equations, exactness at k = N−m (KL ~ 0), the LSE term at matched
 * masses, degenerate problems, decoding a compressed cache with true positions, the cache file,
 * allocation rules, thread determinism and that the solver never ends worse than its start. */
#define _GNU_SOURCE /* RTLD_NEXT: this test binary's BLAS routines call OpenBLAS's */
#include "compress/sculpt/kvm_sculpt_file.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/sculpt/kvm_sculpt_lbfgs.h"
#include "compress/eval/kvm_eval.h"
#include "common/kvm_error.h"
#include "common/kvm_progress.h"
#include "kernels/kvm_fpmode.h"
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu.h"
#include "kernels/cpu/kvm_cpu_clones.h"
#include "kernels/kvm_sculpt_body.h"
#include "tests/util/kvm_test.h"

#include <cblas.h>
#include <check.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------- hand-made problems ---------------- */

static uint64_t rng = 12345;
static float frand(void) /* uniform in [-1, 1) */
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

typedef struct toy {
    kvm_sculpt_problem p;
    float *kz, *vz; /* [nc + m][d]: zone then retain */
} toy;

/* head dim d, nc zone tokens, m retain tokens, nq queries (n_vis cycles 0..m), keys scaled by ks. */
static void toy_new_d(toy *t, int d, int64_t nc, int64_t m, int64_t nq, float ks, int equal_keys)
{
    memset(t, 0, sizeof *t);
    t->kz = malloc((size_t)((nc + m) * d) * sizeof *t->kz);
    t->vz = malloc((size_t)((nc + m) * d) * sizeof *t->vz);
    for (int64_t i = 0; i < (nc + m) * d; i++) {
        t->kz[i] = equal_keys && i < nc * d ? ks * 0.5f : ks * frand();
        t->vz[i] = frand();
    }
    kvm_sculpt_problem *p = &t->p;
    p->d = d;
    p->scale = 1.0f / sqrtf((float)d);
    p->nc = nc;
    p->m = m;
    p->kz = t->kz;
    p->vz = t->vz;
    p->kr = t->kz + nc * d;
    p->vr = t->vz + nc * d;
    p->nq = nq;
    p->nq_real = nq / 2;
    p->q = malloc((size_t)(nq * d) * sizeof *p->q);
    p->n_vis = malloc((size_t)nq * sizeof *p->n_vis);
    for (int64_t i = 0; i < nq * d; i++) p->q[i] = 2.0f * frand();
    for (int64_t i = 0; i < nq; i++) p->n_vis[i] = m > 0 ? i % (m + 1) : 0;
    ck_assert_int_eq(kvm_sculpt_problem_prepare(p), 0);
}

/* The same with d = 8. */
static void toy_new(toy *t, int64_t nc, int64_t m, int64_t nq, float ks, int equal_keys)
{
    toy_new_d(t, 8, nc, m, nq, ks, equal_keys);
}

static void toy_free(toy *t)
{
    kvm_sculpt_problem_free(&t->p);
    free(t->kz);
    free(t->vz);
}

/* ‖a − b‖ / ‖b‖ over n floats. */
static double rel_err(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The blocked loss and gradient (kvm_sculpt_loss) against the one-query-at-a-time reference
 * (kvm_sculpt_loss_ref) at entries kc, vc, beta; returns the worst relative error seen. */
static double blocked_vs_ref(const kvm_sculpt_problem *p, const float *kc, const float *vc, const float *beta, int64_t k)
{
    const int d = p->d;
    float *g = malloc((size_t)(k * (d + 1)) * sizeof *g), *gr = malloc((size_t)(k * (d + 1)) * sizeof *gr);
    double ms, ls, msr, lsr;
    double L = kvm_sculpt_loss(p, kc, vc, beta, k, 0.1, g, g + k * d, &ms, &ls);
    double Lr = kvm_sculpt_loss_ref(p, kc, vc, beta, k, 0.1, gr, gr + k * d, &msr, &lsr);
    double e = fabs(L - Lr) / fabs(Lr);
    e = fmax(e, fabs(ms - msr) / fmax(msr, 1e-30));
    e = fmax(e, fabs(ls - lsr) / fmax(fabs(lsr), 1e-12 * fabs(Lr)));
    e = fmax(e, rel_err(g, gr, k * d));
    if (beta) e = fmax(e, rel_err(g + k * d, gr + k * d, k));
    double L2 = kvm_sculpt_loss(p, kc, vc, beta, k, 0.1, NULL, NULL, NULL, NULL); /* loss only: same value */
    ck_assert(L2 == L);
    free(g);
    free(gr);
    return e;
}

START_TEST(test_blocked_loss_random)
{
    const int dims[2] = {8, 64};
    const int64_t ks[4] = {1, 16, 37, 70};
    double worst = 0;
    for (int di = 0; di < 2; di++) {
        toy t;
        toy_new_d(&t, dims[di], 90, 12, 150, 1.0f, 0); /* 150 queries: two full blocks of 64 and a tail */
        const int d = dims[di];
        for (int w = 0; w < 2; w++) {
            t.p.lse_mass_weight = w;
            for (int ki = 0; ki < 4; ki++) {
                const int64_t k = ks[ki];
                float *kc = malloc((size_t)(k * d) * sizeof *kc), *vc = malloc((size_t)(k * d) * sizeof *vc);
                float *beta = malloc((size_t)k * sizeof *beta);
                for (int64_t i = 0; i < k * d; i++) {
                    kc[i] = 1.5f * frand();
                    vc[i] = frand();
                }
                for (int64_t j = 0; j < k; j++) beta[j] = 0.5f * frand();
                worst = fmax(worst, blocked_vs_ref(&t.p, kc, vc, NULL, k));
                worst = fmax(worst, blocked_vs_ref(&t.p, kc, vc, beta, k));
                free(kc);
                free(vc);
                free(beta);
            }
        }
        toy_free(&t);
    }
    printf("blocked vs reference loss+gradient, random problems (d 8 and 64): worst relative error %.3g\n", worst);
    ck_assert_double_lt(worst, 1e-5);
}
END_TEST

START_TEST(test_fpmode)
{
    kvm_fpmode outer = kvm_fpmode_flush_enter(); /* enter and restore: the thread's default is back, */
    kvm_fpmode_restore(outer);
    ck_assert_int_eq(kvm_fpmode_is_flushing(), 0); /* and the default keeps subnormals */
    volatile float tiny = 1e-38f, f = 0.01f;
    ck_assert(tiny * f != 0.0f);
    kvm_fpmode s = kvm_fpmode_flush_enter();
#if defined(__x86_64__)
    ck_assert_int_eq(kvm_fpmode_is_flushing(), 1);
    ck_assert(tiny * f == 0.0f);
#endif
    kvm_fpmode_restore(s);
    ck_assert_int_eq(kvm_fpmode_is_flushing(), 0);
    ck_assert(tiny * f != 0.0f);
}
END_TEST

/* Rosenbrock in n dimensions (even n): f and g at x. */
static double rosen(const double *x, double *g, int n)
{
    double f = 0;
    for (int i = 0; i < n; i++) g[i] = 0;
    for (int i = 0; i + 1 < n; i += 2) {
        double a = 1 - x[i], b = x[i + 1] - x[i] * x[i];
        f += a * a + 100 * b * b;
        g[i] += -2 * a - 400 * x[i] * b;
        g[i + 1] += 200 * b;
    }
    return f;
}

/* kvmill's L-BFGS solves Rosenbrock, and problems stepped in lockstep (one "batch") end exactly
 * where each ends alone: a state's iterates depend on its own values only. */
START_TEST(test_lbfgs_rosenbrock_and_batch)
{
    kvm_sculpt_lbfgs_params prm = kvm_sculpt_lbfgs_params_default();
    prm.max_iters = 200;
    prm.past = 0;
    prm.epsilon = 1e-10;
    const int n = 4;
    double x0[2][4] = {{-1.2, 1, -1.2, 1}, {0.5, -0.3, 2.0, 3.0}}, g[4], fbest[2], alone[2][4];
    for (int b = 0; b < 2; b++) {
        kvm_sculpt_lbfgs *s = kvm_sculpt_lbfgs_new(n, x0[b], &prm);
        ck_assert_ptr_nonnull(s);
        while (kvm_sculpt_lbfgs_step(s, rosen(kvm_sculpt_lbfgs_x(s), g, n), g) == KVM_LBFGS_EVALUATE) {}
        memcpy(alone[b], kvm_sculpt_lbfgs_best(s, &fbest[b]), sizeof alone[b]);
        printf("L-BFGS on Rosenbrock from start %d: f %.3g after %d iterations, %d evaluations\n", b, fbest[b],
               kvm_sculpt_lbfgs_iterations(s), kvm_sculpt_lbfgs_evaluations(s));
        ck_assert_double_lt(fbest[b], 1e-10);
        kvm_sculpt_lbfgs_free(s);
    }
    kvm_sculpt_lbfgs *st[2] = {kvm_sculpt_lbfgs_new(n, x0[0], &prm), kvm_sculpt_lbfgs_new(n, x0[1], &prm)};
    int live[2] = {1, 1};
    while (live[0] || live[1])
        for (int b = 1; b >= 0; b--) /* the batch, evaluated in the other order */
            if (live[b]) live[b] = kvm_sculpt_lbfgs_step(st[b], rosen(kvm_sculpt_lbfgs_x(st[b]), g, n), g) ==
                                   KVM_LBFGS_EVALUATE;
    for (int b = 0; b < 2; b++) {
        double f;
        ck_assert_int_eq(memcmp(kvm_sculpt_lbfgs_best(st[b], &f), alone[b], sizeof alone[b]), 0);
        ck_assert(f == fbest[b]);
        kvm_sculpt_lbfgs_free(st[b]);
    }
}
END_TEST

/* f = Σ c_i x_i² with c_i from 1e-3 to 1 (an ill-scaled, flat quadratic, where 1/‖g‖ is a far
 * too short first step, as in the KVSculpt key fit): f and g at x. */
static double scaled_quad(const double *x, double *g, int n)
{
    double f = 0;
    for (int i = 0; i < n; i++) {
        const double c = 1e-3 * pow(1e3, (double)i / (n - 1));
        f += c * x[i] * x[i];
        g[i] = 2 * c * x[i];
    }
    return f;
}

/* A run that continues an earlier one (the solver's next round) with step0 = the earlier run's
 * γ (kvm_sculpt_lbfgs_gamma) needs fewer evaluations for its first iteration than one starting
 * from 1/‖g‖, and reaches at least the same point; a fresh state has no γ. */
START_TEST(test_lbfgs_step0_from_gamma)
{
    enum { N = 40 };
    kvm_sculpt_lbfgs_params prm = kvm_sculpt_lbfgs_params_default();
    prm.max_iters = 8;
    prm.past = 0;
    double x0[N], g[N], mid[N];
    for (int i = 0; i < N; i++) x0[i] = 100.0 * (i + 1);
    kvm_sculpt_lbfgs *a = kvm_sculpt_lbfgs_new(N, x0, &prm);
    ck_assert_ptr_nonnull(a);
    ck_assert(kvm_sculpt_lbfgs_gamma(a) == 0);
    while (kvm_sculpt_lbfgs_step(a, scaled_quad(kvm_sculpt_lbfgs_x(a), g, N), g) == KVM_LBFGS_EVALUATE) {}
    const double gamma = kvm_sculpt_lbfgs_gamma(a);
    memcpy(mid, kvm_sculpt_lbfgs_best(a, NULL), sizeof mid);
    kvm_sculpt_lbfgs_free(a);
    ck_assert(gamma > 0 && isfinite(gamma));
    int evals[2];
    double f[2];
    prm.max_iters = 1;
    for (int v = 0; v < 2; v++) {
        prm.step0 = v ? gamma : 0;
        kvm_sculpt_lbfgs *b = kvm_sculpt_lbfgs_new(N, mid, &prm);
        ck_assert_ptr_nonnull(b);
        while (kvm_sculpt_lbfgs_step(b, scaled_quad(kvm_sculpt_lbfgs_x(b), g, N), g) == KVM_LBFGS_EVALUATE) {}
        evals[v] = kvm_sculpt_lbfgs_evaluations(b);
        kvm_sculpt_lbfgs_best(b, &f[v]);
        kvm_sculpt_lbfgs_free(b);
    }
    printf("L-BFGS first iteration of a continued run: %d evaluations from 1/|g|, %d from gamma %.3g "
           "(f %.4g vs %.4g)\n", evals[0], evals[1], gamma, f[0], f[1]);
    ck_assert_int_lt(evals[1], evals[0]);
    ck_assert_double_le(f[1], f[0] * (1 + 1e-9));
}
END_TEST

/* Runs an L-BFGS state on Rosenbrock to its end; f[t] = the value after iteration t (f[0] at
 * the start; accepted points only lower f, so the best value is the current one). Returns
 * the iteration count. */
static int rosen_trajectory(const double *x0, const kvm_sculpt_lbfgs_params *prm, double *f, int cap)
{
    double g[4];
    kvm_sculpt_lbfgs *s = kvm_sculpt_lbfgs_new(4, x0, prm);
    ck_assert_ptr_nonnull(s);
    while (kvm_sculpt_lbfgs_step(s, rosen(kvm_sculpt_lbfgs_x(s), g, 4), g) == KVM_LBFGS_EVALUATE) {
        const int it = kvm_sculpt_lbfgs_iterations(s);
        ck_assert_int_le(it, cap);
        kvm_sculpt_lbfgs_best(s, &f[it]);
    }
    const int it = kvm_sculpt_lbfgs_iterations(s);
    kvm_sculpt_lbfgs_best(s, &f[it]);
    kvm_sculpt_lbfgs_free(s);
    return it;
}

/* The progress stop (opts tolerance): a run stops at the first iteration t ≥ past where the last
 * `past` iterations gained less than `progress` of its decrease from the start, takes exactly
 * the iterates of the run without it up to there, and progress = 0 changes nothing. */
START_TEST(test_lbfgs_progress_stop)
{
    enum { CAP = 200 };
    kvm_sculpt_lbfgs_params prm = kvm_sculpt_lbfgs_params_default();
    prm.max_iters = CAP;
    prm.delta = 0;
    prm.epsilon = 1e-10;
    const double x0[4] = {-1.2, 1, -1.2, 1}, tol = 0.05;
    double fa[CAP + 1], fb[CAP + 1], fc[CAP + 1];
    const int na = rosen_trajectory(x0, &prm, fa, CAP);
    prm.progress = tol;
    const int nb = rosen_trajectory(x0, &prm, fb, CAP);
    printf("L-BFGS on Rosenbrock: %d iterations (f %.3g) without the progress stop, %d (f %.3g) with %g\n", na, fa[na],
           nb, fb[nb], tol);
    ck_assert_int_lt(nb, na);
    ck_assert_int_ge(nb, prm.past);
    for (int t = 0; t <= nb; t++) ck_assert(fb[t] == fa[t]);
    for (int t = prm.past; t <= nb; t++) {
        const int fired = fb[t - prm.past] - fb[t] < tol * (fb[0] - fb[t]);
        ck_assert_int_eq(fired, t == nb);
    }
    prm.progress = 0;
    ck_assert_int_eq(rosen_trajectory(x0, &prm, fc, CAP), na);
    ck_assert(!memcmp(fc, fa, (size_t)(na + 1) * sizeof *fa));
}
END_TEST

/* The scale-free gradient stop (opts gradient_tolerance, kvm_sculpt_lbfgs_gtol): on a quadratic
 * scaled by 1e-9 (a tiny loss and gradient, as SmolLM2's key fits) the absolute rule
 * ‖g‖ ≤ 1e-6·max(1, ‖x‖) ends the run at its start point; with gtol the run descends and stops
 * at the first iteration with ‖g‖ ≤ gtol·‖g₀‖ (the stop reason says which rule); a reference
 * g_ref far above ‖g₀‖ (a later round of a problem that has converged) stops it at once. */
START_TEST(test_lbfgs_gradient_tolerance)
{
    enum { N = 40 };
    double x0[N], g[N];
    for (int i = 0; i < N; i++) x0[i] = 10.0 + i;
    for (int v = 0; v < 3; v++) {
        kvm_sculpt_lbfgs_params prm = kvm_sculpt_lbfgs_params_default();
        prm.max_iters = 200;
        prm.past = 0;
        if (v) kvm_sculpt_lbfgs_gtol(&prm, 1e-3, v == 2 ? 1e3 : 0);
        kvm_sculpt_lbfgs *s = kvm_sculpt_lbfgs_new(N, x0, &prm);
        ck_assert_ptr_nonnull(s);
        double gn = 0, gprev = INFINITY, g0 = 0;
        for (;;) {
            const double f = 1e-9 * scaled_quad(kvm_sculpt_lbfgs_x(s), g, N);
            for (int i = 0; i < N; i++) g[i] *= 1e-9;
            const int it = kvm_sculpt_lbfgs_iterations(s);
            if (kvm_sculpt_lbfgs_step(s, f, g) != KVM_LBFGS_EVALUATE) break;
            if (kvm_sculpt_lbfgs_iterations(s) > it) gprev = gn; /* the last accepted point's norm */
            gn = 0;
            for (int i = 0; i < N; i++) gn += g[i] * g[i];
            gn = sqrt(gn);
        }
        g0 = kvm_sculpt_lbfgs_gnorm0(s);
        const int it = kvm_sculpt_lbfgs_iterations(s);
        printf("L-BFGS gradient stop %d: %d iterations, stop %d, |g0| %.3g\n", v, it, (int)kvm_sculpt_lbfgs_stopped(s), g0);
        ck_assert_int_eq(kvm_sculpt_lbfgs_stopped(s), KVM_LBFGS_STOP_GRADIENT);
        if (v == 1) {
            ck_assert_int_gt(it, 3);
            ck_assert_double_gt(gprev, 1e-3 * g0); /* not before */
        } else {
            ck_assert_int_eq(it, 0);
        }
        kvm_sculpt_lbfgs_free(s);
    }
}
END_TEST

/* carry_history (kvm_sculpt_lbfgs_carry): a run continued with the earlier run's pairs goes
 * further in the same iterations than one continued from step0 = γ alone; carrying NULL or a
 * state of another size changes nothing (bit for bit). */
START_TEST(test_lbfgs_carry)
{
    enum { N = 40 };
    kvm_sculpt_lbfgs_params prm = kvm_sculpt_lbfgs_params_default();
    prm.max_iters = 8;
    prm.past = 0;
    double x0[N], g[N], mid[N], f[4], xb[4][N];
    for (int i = 0; i < N; i++) x0[i] = 100.0 * (i + 1);
    kvm_sculpt_lbfgs *a = kvm_sculpt_lbfgs_new(N, x0, &prm), *other = kvm_sculpt_lbfgs_new(N - 1, x0, &prm);
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(other);
    while (kvm_sculpt_lbfgs_step(a, scaled_quad(kvm_sculpt_lbfgs_x(a), g, N), g) == KVM_LBFGS_EVALUATE) {}
    while (kvm_sculpt_lbfgs_step(other, scaled_quad(kvm_sculpt_lbfgs_x(other), g, N - 1), g) == KVM_LBFGS_EVALUATE) {}
    memcpy(mid, kvm_sculpt_lbfgs_best(a, NULL), sizeof mid);
    prm.step0 = kvm_sculpt_lbfgs_gamma(a);
    prm.max_iters = 4;
    const kvm_sculpt_lbfgs *from[4] = {NULL, a, NULL, other};
    for (int v = 0; v < 4; v++) {
        kvm_sculpt_lbfgs *b = kvm_sculpt_lbfgs_new(N, mid, &prm);
        ck_assert_ptr_nonnull(b);
        if (v) kvm_sculpt_lbfgs_carry(b, from[v]);
        while (kvm_sculpt_lbfgs_step(b, scaled_quad(kvm_sculpt_lbfgs_x(b), g, N), g) == KVM_LBFGS_EVALUATE) {}
        memcpy(xb[v], kvm_sculpt_lbfgs_best(b, &f[v]), sizeof xb[v]);
        kvm_sculpt_lbfgs_free(b);
    }
    printf("L-BFGS continued for 4 iterations: f %.4g from gamma alone, %.4g with the carried pairs\n", f[0], f[1]);
    ck_assert_double_lt(f[1], f[0]);
    for (int v = 2; v < 4; v++) ck_assert(f[v] == f[0] && !memcmp(xb[v], xb[0], sizeof xb[0]));
    kvm_sculpt_lbfgs_free(a);
    kvm_sculpt_lbfgs_free(other);
}
END_TEST

/* The references (kvm_sculpt_problem_prepare: blocked float32 kernel) against a plain float64
 * computation: outputs, LSEs and zone masses within 1e-5 relative. */
START_TEST(test_references_float64)
{
    toy t;
    toy_new_d(&t, 64, 150, 20, 140, 1.5f, 0);
    const kvm_sculpt_problem *p = &t.p;
    const int d = p->d;
    double worst = 0, *mass = calloc((size_t)p->nc, sizeof *mass), *sc = malloc((size_t)(p->nc + p->m) * sizeof *sc);
    for (int64_t i = 0; i < p->nq; i++) {
        const int64_t nv = p->n_vis[i], n = p->nc + nv;
        double mx = -1e300, z = 0, zz = 0;
        for (int64_t j = 0; j < n; j++) {
            const float *kj = j < p->nc ? p->kz + j * d : p->kr + (j - p->nc) * d;
            sc[j] = 0;
            for (int u = 0; u < d; u++) sc[j] += (double)p->q[i * d + u] * kj[u];
            sc[j] *= p->scale;
            mx = fmax(mx, sc[j]);
        }
        for (int64_t j = 0; j < n; j++) z += exp(sc[j] - mx);
        for (int64_t j = 0; j < p->nc; j++) zz += exp(sc[j] - mx);
        worst = fmax(worst, fabs(p->lse_zone[i] - (mx + log(zz))) / fabs(mx + log(zz)));
        double on = 0, dn = 0;
        for (int u = 0; u < d; u++) {
            double o = 0;
            for (int64_t j = 0; j < n; j++) o += exp(sc[j] - mx) / z * (j < p->nc ? p->vz[j * d + u] : p->vr[(j - p->nc) * d + u]);
            on += (o - p->o_full[i * d + u]) * (o - p->o_full[i * d + u]);
            dn += o * o;
        }
        worst = fmax(worst, sqrt(on / dn));
        if (i < p->nq_real)
            for (int64_t j = 0; j < p->nc; j++) mass[j] += exp(sc[j] - mx) / z;
    }
    double mn = 0, md = 0;
    for (int64_t j = 0; j < p->nc; j++) {
        mn += (mass[j] - p->mass[j]) * (mass[j] - p->mass[j]);
        md += mass[j] * mass[j];
    }
    worst = fmax(worst, sqrt(mn / md));
    printf("references vs float64: worst relative error %.3g\n", worst);
    ck_assert_double_lt(worst, 1e-5);
    free(mass);
    free(sc);
    toy_free(&t);
}
END_TEST

/* Real captured SmolLM2 problems (head dim 64, GQA 3:1), blocked vs reference, when the model is
 * present (models/SmolLM2-135M-Instruct.Q4_1.gguf, scripts/get-model.sh). */
START_TEST(test_blocked_loss_smollm2)
{
    const char *path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("SKIP: %s absent (run scripts/get-model.sh): blocked loss on SmolLM2 problems not checked\n", path);
        return;
    }
    fclose(f);
    kvm_model *m;
    int32_t tok[112];
    uint64_t st = 7;
    ck_assert_int_eq(kvm_model_open(path, &m), 0);
    tok[0] = m->cfg.bos_id;
    for (int i = 1; i < 112; i++) { /* a pseudo-random token sequence: real weights, real statistics */
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((st >> 33) % (uint64_t)m->cfg.vocab_size);
    }
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(m, NULL, tok, 112, 96, 16, &doc), 0);
    const int layers[3] = {0, m->cfg.n_layers / 2, m->cfg.n_layers - 1};
    const int64_t ks[3] = {1, 24, 60}; /* below the zone of 80: at k = 80 the loss is exactly 0 */
    double worst = 0;
    for (int i = 0; i < 3; i++) {
        kvm_sculpt_problem p;
        ck_assert_int_eq(kvm_sculpt_problem_build(&m->cfg, kvm_eval_doc_input(doc)->cap, layers[i], i % m->cfg.n_kv_heads,
                                                  16, 128, 16, 3, &p), 0);
        ck_assert_int_eq(p.d, 64);
        worst = fmax(worst, blocked_vs_ref(&p, p.kz, p.vz, NULL, ks[i]));
        kvm_sculpt_problem_free(&p);
    }
    printf("blocked vs reference loss+gradient, 3 real SmolLM2 problems (d 64): worst relative error %.3g\n", worst);
    ck_assert_double_lt(worst, 1e-5);
    kvm_eval_doc_free(&doc);
    kvm_model_close(&m);
}
END_TEST

START_TEST(test_gradient_fd)
{
    toy t;
    toy_new(&t, 20, 4, 40, 1.0f, 0);
    t.p.lse_mass_weight = _i; /* loop test: the paper's LSE term, then ours (mass-weighted) */
    const int d = 8, k = 5;
    float kc[5 * 8], vc[5 * 8], beta[5], gk[5 * 8], gb[5];
    for (int i = 0; i < k * d; i++) {
        kc[i] = frand();
        vc[i] = frand();
    }
    for (int j = 0; j < k; j++) beta[j] = 0.3f * frand();
    kvm_sculpt_loss(&t.p, kc, vc, beta, k, 0.1, gk, gb, NULL, NULL);
    double num = 0, den = 0;
    const float h = 1e-2f;
    for (int i = 0; i < k * d + k; i++) {
        float *x = i < k * d ? &kc[i] : &beta[i - k * d];
        float x0 = *x;
        *x = x0 + h;
        double lp = kvm_sculpt_loss(&t.p, kc, vc, beta, k, 0.1, NULL, NULL, NULL, NULL);
        *x = x0 - h;
        double lm = kvm_sculpt_loss(&t.p, kc, vc, beta, k, 0.1, NULL, NULL, NULL, NULL);
        *x = x0;
        double fd = (lp - lm) / (2.0 * h), an = i < k * d ? gk[i] : gb[i - k * d];
        num += (fd - an) * (fd - an);
        den += fd * fd;
    }
    double rel = sqrt(num / den);
    printf("gradient vs central differences (float32, h = 1e-2, mass-weighted LSE %d): relative error %.3g, |g| %.3g\n",
           t.p.lse_mass_weight, rel, sqrt(den));
    ck_assert_double_gt(den, 1e-8);
    ck_assert_double_lt(rel, 5e-3);
    toy_free(&t);
}
END_TEST

START_TEST(test_ridge_normal_equations)
{
    toy t;
    toy_new(&t, 30, 6, 60, 1.0f, 0);
    const int d = 8, k = 7;
    float kc[7 * 8], vc[7 * 8], v0[7 * 8], beta[7];
    for (int i = 0; i < k * d; i++) {
        kc[i] = frand();
        v0[i] = vc[i] = frand();
    }
    for (int j = 0; j < k; j++) beta[j] = 0.2f * frand();
    const double arel = 1e-2;
    ck_assert_int_eq(kvm_sculpt_ridge(&t.p, kc, beta, k, arel, 0.0, 0, vc), 0);
    /* rebuild P and T independently (float64) and check (PᵀP + αI)V = PᵀT + αV0 */
    const kvm_sculpt_problem *p = &t.p;
    double A[7][7] = {{0}}, B[7][8] = {{0}};
    for (int64_t i = 0; i < p->nq; i++) {
        double s[7], z = 0, mx = -1e300;
        for (int j = 0; j < k; j++) {
            s[j] = beta[j];
            for (int u = 0; u < d; u++) s[j] += (double)p->q[i * d + u] * kc[j * d + u] * p->scale;
            mx = fmax(mx, s[j]);
        }
        double lr = p->n_vis[i] > 0 ? p->lse_ret[i] : -INFINITY;
        mx = fmax(mx, lr);
        for (int j = 0; j < k; j++) z += exp(s[j] - mx);
        double er = p->n_vis[i] > 0 ? exp(lr - mx) : 0;
        z += er;
        double P[7], T[8];
        for (int j = 0; j < k; j++) P[j] = exp(s[j] - mx) / z;
        for (int u = 0; u < d; u++) T[u] = p->o_full[i * d + u] - er / z * p->o_ret[i * d + u];
        for (int a = 0; a < k; a++) {
            for (int b = 0; b < k; b++) A[a][b] += P[a] * P[b];
            for (int u = 0; u < d; u++) B[a][u] += P[a] * T[u];
        }
    }
    double tr = 0;
    for (int a = 0; a < k; a++) tr += A[a][a];
    double alpha = arel * tr / k, worst = 0, scale = 0;
    for (int a = 0; a < k; a++)
        for (int u = 0; u < d; u++) {
            double lhs = alpha * vc[a * d + u], rhs = B[a][u] + alpha * v0[a * d + u];
            for (int b = 0; b < k; b++) lhs += A[a][b] * vc[b * d + u];
            worst = fmax(worst, fabs(lhs - rhs));
            scale = fmax(scale, fabs(rhs));
        }
    printf("ridge normal equations: max residual %.3g (rhs scale %.3g)\n", worst, scale);
    ck_assert_double_lt(worst, 1e-5 * (scale + 1e-3));
    /* the value-norm guard bounds every row */
    ck_assert_int_eq(kvm_sculpt_ridge(&t.p, kc, beta, k, 1e-6, 0.5, 0, vc), 0);
    for (int a = 0; a < k; a++) {
        double n2 = 0;
        for (int u = 0; u < d; u++) n2 += (double)vc[a * d + u] * vc[a * d + u];
        ck_assert_double_le(sqrt(n2), 0.5 * p->vnorm_max * (1 + 1e-5));
    }
    toy_free(&t);
}
END_TEST

/* The view of a problem for the CPU kernels, normal equations in float32 blocks or float64. */
static kvm_sculpt_view view_of(const kvm_sculpt_problem *p, int f32)
{
    return (kvm_sculpt_view){.d = p->d, .scale = p->scale, .nq = p->nq, .nc = p->nc, .q = p->q, .o_full = p->o_full,
                             .o_ret = p->o_ret, .lse_zone = p->lse_zone, .lse_ret = p->lse_ret, .n_vis = p->n_vis,
                             .out_ms = p->out_ms, .ridge_f32 = f32};
}

/* ridge_f32: the normal equations by kvmill's float32 GEMM (blocks of 128 queries summed in
 * float64) within 1e-6 of the float64 ones and the fitted values within 1e-3 (relative to the
 * largest entry / value; bench/RESULTS.md part 5 measured ≤ 4e-4 on real problems), without a
 * float64 fallback at this conditioning; ridge_f32 = 0 is, bit for bit, OpenBLAS dsyrk/dgemm on
 * the design widened to float64 (the fit before the setting). 300 queries: two full blocks and a
 * tail; k up to 70: more than one 64-row block of A, k not a multiple of 16. */
START_TEST(test_ridge_f32)
{
    toy t;
    toy_new_d(&t, 64, 120, 8, 300, 1.0f, 0);
    const kvm_sculpt_problem *p = &t.p;
    const int d = 64;
    const int64_t ks[3] = {1, 17, 70}, nq = p->nq;
    for (int ki = 0; ki < 3; ki++) {
        const int64_t k = ks[ki];
        float *kc = malloc((size_t)(k * d) * sizeof *kc), *v0 = malloc((size_t)(k * d) * sizeof *v0);
        float *v1 = malloc((size_t)(k * d) * sizeof *v1), *v2 = malloc((size_t)(k * d) * sizeof *v2);
        float *beta = malloc((size_t)k * sizeof *beta), *P = malloc((size_t)(nq * k) * sizeof *P);
        double *A[3], *B[3], *Pd = malloc((size_t)(nq * k) * sizeof *Pd), *T = malloc((size_t)(nq * d) * sizeof *T);
        double *pr = malloc((size_t)nq * sizeof *pr);
        for (int f = 0; f < 3; f++) {
            A[f] = calloc((size_t)(k * k), sizeof *A[f]);
            B[f] = calloc((size_t)(k * d), sizeof *B[f]);
        }
        for (int64_t i = 0; i < k * d; i++) kc[i] = 1.5f * frand(), v0[i] = frand();
        for (int64_t j = 0; j < k; j++) beta[j] = 0.2f * frand();
        kvm_sculpt_view v32 = view_of(p, 1), v64 = view_of(p, 0);
        ck_assert_int_eq(kvm_cpu_sculpt_normal(&v32, kc, beta, k, A[0], B[0]), 0);
        ck_assert_int_eq(kvm_cpu_sculpt_normal(&v64, kc, beta, k, A[1], B[1]), 0);
        ck_assert_int_eq(kvm_cpu_sculpt_probs(&v64, kc, beta, k, P, pr), 0); /* the fit before, spelled out */
        for (int64_t i = 0; i < nq * k; i++) Pd[i] = P[i];
        for (int64_t i = 0; i < nq; i++)
            for (int u = 0; u < d; u++) T[i * d + u] = (double)p->o_full[i * d + u] - pr[i] * p->o_ret[i * d + u];
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)k, (int)nq, 1.0, Pd, (int)k, 0.0, A[2], (int)k);
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)k, d, (int)nq, 1.0, Pd, (int)k, T, d, 0.0, B[2], d);
        double amax = 0, da = 0, bmax = 0, db = 0;
        for (int64_t a = 0; a < k; a++)
            for (int64_t c = a; c < k; c++) {
                ck_assert(A[1][a * k + c] == A[2][a * k + c]);
                amax = fmax(amax, fabs(A[1][a * k + c]));
                da = fmax(da, fabs(A[0][a * k + c] - A[1][a * k + c]));
            }
        ck_assert(!memcmp(B[1], B[2], (size_t)(k * d) * sizeof *B[1]));
        for (int64_t i = 0; i < k * d; i++) {
            bmax = fmax(bmax, fabs(B[1][i]));
            db = fmax(db, fabs(B[0][i] - B[1][i]));
        }
        memcpy(v1, v0, (size_t)(k * d) * sizeof *v1);
        ck_assert_int_eq(kvm_sculpt_ridge_solve_f32(p, A[0], B[0], k, 1e-3, 0.0, v1), 0); /* no fallback here */
        memcpy(v1, v0, (size_t)(k * d) * sizeof *v1);
        memcpy(v2, v0, (size_t)(k * d) * sizeof *v2);
        ck_assert_int_eq(kvm_sculpt_ridge(p, kc, beta, k, 1e-3, 0.0, 1, v1), 0);
        ck_assert_int_eq(kvm_sculpt_ridge(p, kc, beta, k, 1e-3, 0.0, 0, v2), 0);
        double vmax = 0, dv = 0;
        for (int64_t i = 0; i < k * d; i++) {
            vmax = fmax(vmax, fabs(v2[i]));
            dv = fmax(dv, fabs((double)v1[i] - v2[i]));
        }
        printf("ridge_f32, k = %lld: A %.2g, B %.2g, values %.2g relative to float64\n", (long long)k, da / amax,
               db / bmax, dv / vmax);
        ck_assert_double_lt(da, 1e-6 * amax);
        ck_assert_double_lt(db, 1e-6 * bmax);
        ck_assert_double_lt(dv, 1e-3 * vmax);
        free(kc), free(v0), free(v1), free(v2), free(beta), free(P), free(Pd), free(T), free(pr);
        for (int f = 0; f < 3; f++) free(A[f]), free(B[f]);
    }
    toy_free(&t);
}
END_TEST

/* An ill-conditioned fit (every distilled key twice, so PᵀP is singular, and α = 1e-12 of the
 * mean diagonal: a Cholesky pivot of ≈ 1e-12 of the diagonal): the float32 equations' solve
 * asks for float64 ones (KVM_SCULPT_RIDGE_F64, values untouched), and kvm_sculpt_ridge with
 * ridge_f32 gives bit for bit the float64 fit. */
START_TEST(test_ridge_f32_ill_conditioned)
{
    toy t;
    toy_new_d(&t, 64, 120, 8, 300, 1.0f, 0);
    const kvm_sculpt_problem *p = &t.p;
    enum { K = 20, D = 64 };
    float kc[K * D], v0[K * D], v1[K * D], v2[K * D];
    static double A[K * K], B[K * D];
    for (int j = 0; j < K; j++)
        for (int u = 0; u < D; u++) kc[j * D + u] = j % 2 ? kc[(j - 1) * D + u] : 1.5f * frand();
    for (int i = 0; i < K * D; i++) v0[i] = frand();
    kvm_sculpt_view v32 = view_of(p, 1);
    ck_assert_int_eq(kvm_cpu_sculpt_normal(&v32, kc, NULL, K, A, B), 0);
    memcpy(v1, v0, sizeof v1);
    ck_assert_int_eq(kvm_sculpt_ridge_solve_f32(p, A, B, K, 1e-12, 0.0, v1), KVM_SCULPT_RIDGE_F64);
    ck_assert(!memcmp(v1, v0, sizeof v1));
    memcpy(v2, v0, sizeof v2);
    ck_assert_int_eq(kvm_sculpt_ridge(p, kc, NULL, K, 1e-12, 0.0, 1, v1), 0);
    ck_assert_int_eq(kvm_sculpt_ridge(p, kc, NULL, K, 1e-12, 0.0, 0, v2), 0);
    ck_assert(!memcmp(v1, v2, sizeof v1));
    toy_free(&t);
}
END_TEST

/* kvm_sb_logf (the LSE's logarithm on both backends; the CPU kernels' 16-lane form is the same
 * operations lanewise, checked through the blocked loss against the reference): within 3 ulp of
 * the C library's logf (2 measured) over the softmax sums it takes (1 .. 2^20: every exponent,
 * both sides of the mantissa's √2 split), and exact at 1. */
START_TEST(test_logf_body)
{
    double worst = 0;
    for (int i = 0; i < 320000; i++) {
        const float z = (float)pow(2.0, 20.0 * i / 320000.0) * (1.0f + 1e-7f * (float)(i % 3));
        const float ref = logf(z), got = kvm_sb_logf(z);
        const double ulp = ref != 0 ? fabs((double)nextafterf(ref, INFINITY) - ref) : 1e-45;
        worst = fmax(worst, fabs((double)got - ref) / ulp);
    }
    printf("kvm_sb_logf vs logf: worst %.2f ulp over 1 .. 2^20\n", worst);
    ck_assert_double_le(worst, 3.0);
    ck_assert(kvm_sb_logf(1.0f) == 0.0f);
}
END_TEST

START_TEST(test_lse_zero_when_masses_match)
{
    toy t;
    toy_new(&t, 16, 4, 32, 1.0f, 0);
    double mse, lse;
    /* the original zone as distilled entries: masses match exactly, outputs too */
    double L = kvm_sculpt_loss(&t.p, t.kz, t.vz, NULL, 16, 0.1, NULL, NULL, &mse, &lse);
    printf("originals: loss %.3g mse %.3g lse term %.3g\n", L, mse, lse);
    ck_assert_double_lt(lse, 1e-10);
    ck_assert_double_lt(mse, 1e-10);
    /* with λ = 0 and matched masses the LSE part is 0; perturbing a bias makes it positive */
    float beta[16] = {0};
    beta[3] = 1.0f;
    kvm_sculpt_loss(&t.p, t.kz, t.vz, beta, 16, 0.1, NULL, NULL, NULL, &lse);
    ck_assert_double_gt(lse, 1e-6);
    toy_free(&t);
}
END_TEST

START_TEST(test_degenerate_toy)
{
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.rounds = 2;
    o.lbfgs_iters = 5;
    toy t;
    /* all-equal zone keys: the normal matrix is rank one; ridge keeps it definite */
    toy_new(&t, 12, 3, 24, 1.0f, 1);
    float kc[4 * 8], vc[4 * 8], beta[4];
    kvm_sculpt_head_stats st;
    ck_assert_int_eq(kvm_sculpt_solve_head(&t.p, &o, 4, 2, 5, kc, vc, beta, &st), 0);
    ck_assert(isfinite(st.loss) && st.loss <= st.loss0 + 1e-12);
    for (int i = 0; i < 32; i++) ck_assert(isfinite(kc[i]) && isfinite(vc[i]));
    /* k larger than the zone: a clear error */
    ck_assert_int_eq(kvm_sculpt_solve_head(&t.p, &o, 13, 2, 5, kc, vc, beta, &st), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "compress zone has 12"), "message: %s", kvm_errmsg());
    /* k = 0: defined, finite loss (the retain zone alone) */
    ck_assert_int_eq(kvm_sculpt_solve_head(&t.p, &o, 0, 2, 5, kc, vc, beta, &st), 0);
    ck_assert(isfinite(st.loss));
    toy_free(&t);
    /* empty zone */
    toy_new(&t, 0, 4, 16, 1.0f, 0);
    ck_assert_int_eq(kvm_sculpt_solve_head(&t.p, &o, 0, 2, 5, kc, vc, beta, &st), 0);
    ck_assert(isfinite(st.loss));
    toy_free(&t);
}
END_TEST

START_TEST(test_allocate)
{
    int64_t caps[6] = {10, 10, 10, 10, 10, 10}, k[6];
    double mse[6] = {1, 100, 0.01, 4, 0, 9}, half[6] = {2, 300, 0.02, 8, 0, 30};
    kvm_sculpt_alloc rules[4] = {KVM_SCULPT_ALLOC_UNIFORM, KVM_SCULPT_ALLOC_LAYER, KVM_SCULPT_ALLOC_HEAD,
                                 KVM_SCULPT_ALLOC_GAIN};
    for (int r = 0; r < 4; r++) {
        ck_assert_int_eq(kvm_sculpt_allocate(rules[r], 3, 2, mse, half, 4, caps, 24, 0.5, k), 0);
        int64_t s = 0;
        for (int i = 0; i < 6; i++) {
            ck_assert(k[i] >= 1 && k[i] <= 10);
            s += k[i];
        }
        ck_assert_int_eq(s, 24);
    }
    /* head MSE^0.5: the 100× head gets the cap, the zero-MSE head the floor */
    kvm_sculpt_allocate(KVM_SCULPT_ALLOC_HEAD, 3, 2, mse, half, 4, caps, 24, 0.5, k);
    ck_assert_int_eq(k[1], 10);
    ck_assert_int_eq(k[4], 1);
    /* a budget above the caps is clamped */
    kvm_sculpt_allocate(KVM_SCULPT_ALLOC_GAIN, 3, 2, mse, half, 4, caps, 1000, 0.5, k);
    for (int i = 0; i < 6; i++) ck_assert_int_eq(k[i], 10);
}
END_TEST

/* ---------------- on stories260K ---------------- */

static kvm_model *model;
static int32_t ids[256];

static void model_setup(void)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
}

static void model_teardown(void) { kvm_model_close(&model); }

static kvm_sculpt_opts quick_opts(void)
{
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.retain_tokens = 16;
    o.n_synth = 128;
    o.rounds = 2;
    o.lbfgs_iters = 10;
    o.future_tokens = 32;
    return o;
}

/* k = N − m, the whole compress zone: the cache is the full one (exact), as every mode keeps it. */
START_TEST(test_exact_at_full_k)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    kvm_sculpt_opts o = quick_opts();
    o.k_entries = 96 - 16;
    kvm_sculpt_mode modes[3] = {KVM_SCULPT_FULL, KVM_SCULPT_SELECTFIT, KVM_SCULPT_JOINT_FIXED};
    const kvm_kvcache *full = kvm_eval_doc_input(doc)->full;
    for (int i = 0; i < 3; i++) {
        o.mode = modes[i];
        kvm_kvcache *c;
        kvm_sculpt_stats st;
        ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, &st), 0);
        /* a budget of the whole zone keeps the original entries, bit for bit, and solves nothing */
        ck_assert(st.lbfgs_s == 0 && st.ridge_s == 0);
        for (int l = 0; l < c->n_layers; l++)
            for (int g = 0; g < c->n_kv_heads; g++) {
                const kvm_kv_head *h = kvm_kvcache_head(c, l, g), *f = kvm_kvcache_head((kvm_kvcache *)full, l, g);
                const size_t nd = (size_t)(96 * c->head_dim) * sizeof(float);
                ck_assert_int_eq(h->n, 96);
                ck_assert(!memcmp(h->k, f->k, nd) && !memcmp(h->v, f->v, nd) && !memcmp(h->pos, f->pos, 96 * 4));
            }
        kvm_eval_result r;
        ck_assert_int_eq(kvm_eval_continue(doc, c, NULL, NULL, &r), 0);
        printf("k = N - m, mode %d: KL %.3g top1 %.3f\n", i, r.kl_mean, r.top1);
        ck_assert_double_lt(r.kl_mean, 1e-6);
        ck_assert_double_eq(r.top1, 1.0);
        kvm_kvcache_free(&c);
    }
    kvm_eval_doc_free(&doc);
}
END_TEST

START_TEST(test_lse_zero_real_problem)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    kvm_sculpt_problem p;
    ck_assert_int_eq(kvm_sculpt_problem_build(&model->cfg, kvm_eval_doc_input(doc)->cap, 2, 1, 16, 64, 32, 7, &p), 0);
    ck_assert_int_eq(p.nq, 2 * 16 + 64);
    double mse, lse;
    kvm_sculpt_loss(&p, p.kz, p.vz, NULL, p.nc, 0.1, NULL, NULL, &mse, &lse);
    ck_assert_double_lt(lse, 1e-9);
    ck_assert_double_lt(mse / p.out_ms, 1e-9);
    kvm_sculpt_problem_free(&p);
    kvm_eval_doc_free(&doc);
}
END_TEST

static int caches_equal(const kvm_kvcache *a, const kvm_kvcache *b)
{
    if (a->n_layers != b->n_layers || a->n_kv_heads != b->n_kv_heads || a->head_dim != b->head_dim ||
        a->next_pos != b->next_pos)
        return 0;
    for (int i = 0; i < a->n_layers * a->n_kv_heads; i++) {
        const kvm_kv_head *x = &a->heads[i], *y = &b->heads[i];
        size_t nd = (size_t)(x->n * a->head_dim) * sizeof(float);
        if (x->n != y->n || memcmp(x->k, y->k, nd) || memcmp(x->v, y->v, nd) ||
            memcmp(x->pos, y->pos, (size_t)x->n * 4) || memcmp(x->bias, y->bias, (size_t)x->n * 4))
            return 0;
    }
    return 1;
}

START_TEST(test_compress_decode_positions_and_file)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_sculpt_opts o = quick_opts();
    o.ratio = 0.25;
    o.bias = 1;
    kvm_kvcache *c;
    kvm_sculpt_stats st;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, &st), 0);
    ck_assert_int_eq(c->next_pos, 96);
    ck_assert_int_eq(st.base.entries, 5 * 4 * (20 + 16));
    for (int i = 0; i < 20; i++) {
        const kvm_kv_head *h = &c->heads[i];
        ck_assert_int_eq(h->n, 20 + 16);
        for (int64_t e = 0; e < h->n; e++) {
            ck_assert_int_eq(h->pos[e], e < 20 ? KVM_POS_NONE : (int32_t)(80 + e - 20));
            for (int u = 0; u < 8; u++) ck_assert(isfinite(h->k[e * 8 + u]) && isfinite(h->v[e * 8 + u]));
        }
    }
    kvm_eval_result r;
    ck_assert_int_eq(kvm_eval_continue(doc, c, NULL, NULL, &r), 0);
    printf("sculpt r = 0.25 with bias: KL %.4g top1 %.3f (%.2f s)\n", r.kl_mean, r.top1, st.base.seconds);
    ck_assert(isfinite(r.kl_mean) && r.kl_mean < 1.0);
    /* decode on a copy: later tokens keep their true positions */
    kvm_kvcache *d;
    kvm_forward *f;
    ck_assert_int_eq(kvm_kvcache_clone(c, &d), 0);
    ck_assert_int_eq(kvm_forward_new(model, NULL, 0, &f), 0);
    float logits[512];
    ck_assert_int_eq(kvm_forward_prefill(f, d, ids + 96, 3, logits, KVM_LOGITS_LAST), 0);
    ck_assert_int_eq(kvm_forward_decode(f, d, ids[99], logits), 0);
    for (int u = 0; u < 512; u++) ck_assert(isfinite(logits[u]));
    const kvm_kv_head *h = kvm_kvcache_head(d, 4, 3);
    ck_assert_int_eq(h->n, 36 + 4);
    for (int j = 0; j < 4; j++) ck_assert_int_eq(h->pos[36 + j], 96 + j);
    ck_assert_int_eq(d->next_pos, 100);
    kvm_forward_free(&f);
    kvm_kvcache_free(&d);
    /* file round trip and validation */
    char *dir = kvm_test_tmpdir(), path[512];
    snprintf(path, sizeof path, "%s/c.kvs", dir);
    ck_assert_int_eq(kvm_sculpt_cache_write(path, c), 0);
    ck_assert_int_eq(kvm_sculpt_cache_read(path, &d), 0);
    ck_assert(caches_equal(c, d));
    kvm_kvcache_free(&d);
    size_t n;
    uint8_t *bytes = (uint8_t *)kvm_test_read_file(path, &n);
    /* the same bytes in memory (kvm_sculpt_cache_decode) */
    ck_assert_int_eq(kvm_sculpt_cache_decode("mem.kvs", bytes, n, &d), 0);
    ck_assert(caches_equal(c, d));
    kvm_kvcache_free(&d);
    ck_assert_int_eq(kvm_sculpt_cache_decode("cut.kvs", bytes, n - 1, &d), KVM_EFORMAT);
    ck_assert_ptr_null(d);
    ck_assert_msg(strstr(kvm_errmsg(), "cut.kvs"), "message: %s", kvm_errmsg());
    bytes[n / 2] ^= 1;
    kvm_test_write_file(path, bytes, n);
    ck_assert_int_eq(kvm_sculpt_cache_read(path, &d), KVM_ECORRUPT);
    bytes[n / 2] ^= 1;
    kvm_test_write_file(path, bytes, n - 5);
    ck_assert_int_eq(kvm_sculpt_cache_read(path, &d), KVM_EFORMAT);
    bytes[8] = 9;
    kvm_test_write_file(path, bytes, n);
    ck_assert_int_eq(kvm_sculpt_cache_read(path, &d), KVM_EFORMAT);
    ck_assert_msg(strstr(kvm_errmsg(), "version"), "message: %s", kvm_errmsg());
    ck_assert_ptr_null(d);
    snprintf(path, sizeof path, "%s/missing.kvs", dir);
    ck_assert_int_eq(kvm_sculpt_cache_read(path, &d), KVM_ENOTFOUND);
    free(bytes);
    kvm_test_rmtree(dir);
    free(dir);
    kvm_kvcache_free(&c);
    kvm_eval_doc_free(&doc);
}
END_TEST

START_TEST(test_degenerate_real)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 64, 48, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_sculpt_opts o = quick_opts();
    kvm_kvcache *c;
    o.k_entries = 33; /* zone is 48 − 16 = 32 */
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, NULL), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "exceed"), "message: %s", kvm_errmsg());
    ck_assert_ptr_null(c);
    o.k_entries = 0;
    o.ratio = 1.5;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, NULL), KVM_EINVAL);
    o.ratio = 0.5;
    o.retain_tokens = 49;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, NULL), KVM_EINVAL);
    /* empty zone: the retain zone alone, equal to the full cache */
    o.retain_tokens = 48;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, NULL), 0);
    ck_assert(caches_equal(c, in->full));
    kvm_kvcache_free(&c);
    /* no retain zone and no synthetic queries: nothing to train on */
    o.retain_tokens = 0;
    o.n_synth = 0;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, NULL), KVM_EINVAL);
    /* no retain zone, synthetic queries only: defined */
    o.n_synth = 64;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, NULL), 0);
    kvm_eval_result r;
    ck_assert_int_eq(kvm_eval_continue(doc, c, NULL, NULL, &r), 0);
    ck_assert(isfinite(r.kl_mean));
    kvm_kvcache_free(&c);
    kvm_eval_doc_free(&doc);
}
END_TEST

START_TEST(test_threads_deterministic_and_alloc)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 112, 96, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    kvm_sculpt_opts o = quick_opts();
    o.ratio = 0.2;
    o.alloc = KVM_SCULPT_ALLOC_GAIN;
    kvm_kvcache *a, *b;
    kvm_sculpt_stats st;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &a, &st), 0);
    o.threads = 2;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &b, NULL), 0);
    ck_assert(caches_equal(a, b));
    ck_assert_int_eq(st.base.entries, 20 * (16 + 16)); /* total budget kept: 20 heads × (k 16 + m 16) */
    ck_assert(st.mse_max >= st.mse_min && st.mse_min >= 0);
    printf("pilot MSE spread over heads %.3g .. %.3g\n", st.mse_min, st.mse_max);
    kvm_kvcache_free(&b);
    /* am_start changes the solve's start, not the pilot's: the same per-head budgets */
    o.alloc = KVM_SCULPT_ALLOC_HEAD;
    o.am_start = 1;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &b, NULL), 0);
    o.am_start = 0;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &c, NULL), 0);
    int differ = 0;
    for (int l = 0; l < b->n_layers; l++)
        for (int h = 0; h < b->n_kv_heads; h++) {
            ck_assert_int_eq(b->heads[l * b->n_kv_heads + h].n, c->heads[l * c->n_kv_heads + h].n);
            differ |= b->heads[l * b->n_kv_heads + h].n != b->heads[0].n;
        }
    ck_assert_msg(differ, "alloc = head gave every head the same budget: the check shows nothing");
    ck_assert(!caches_equal(b, c));
    kvm_kvcache_free(&c);
    kvm_kvcache_free(&a);
    kvm_kvcache_free(&b);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* Per-layer budgets: a uniform budget over every layer reproduces kvm_sculpt_compress exactly;
 * layers with budget ≤ 0 are left as they were, a budget ≥ N restores the full layer, a small
 * budget shrinks the retain zone to ⌊b/2⌋. */
START_TEST(test_compress_layers)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 112, 96, 16, &doc), 0);
    const kvm_compress_input *in = kvm_eval_doc_input(doc);
    const int L = model->cfg.n_layers, H = model->cfg.n_kv_heads, d = model->cfg.head_dim;
    kvm_sculpt_opts o = quick_opts();
    o.k_entries = 20;
    kvm_kvcache *ref, *dst;
    ck_assert_int_eq(kvm_sculpt_compress(in, &o, &ref, NULL), 0);
    int64_t budget[16];
    for (int l = 0; l < L; l++) budget[l] = 20 + 16;
    ck_assert_int_eq(kvm_kvcache_clone(in->full, &dst), 0);
    ck_assert_int_eq(kvm_sculpt_compress_layers(in, &o, budget, dst, NULL), 0);
    ck_assert(caches_equal(ref, dst));
    kvm_kvcache_free(&dst);

    /* layer 0 untouched (full), layer 1 whole context, layer 2 budget 6 → m 3 + k 3, rest 36 */
    budget[0] = 0;
    budget[1] = 96;
    budget[2] = 6;
    ck_assert_int_eq(kvm_kvcache_clone(in->full, &dst), 0);
    kvm_sculpt_stats st;
    ck_assert_int_eq(kvm_sculpt_compress_layers(in, &o, budget, dst, &st), 0);
    for (int g = 0; g < H; g++) {
        const kvm_kv_head *f0 = kvm_kvcache_head(in->full, 0, g), *h0 = kvm_kvcache_head(dst, 0, g);
        ck_assert_int_eq(h0->n, 96);
        ck_assert_int_eq(memcmp(h0->k, f0->k, (size_t)(96 * d) * sizeof(float)), 0);
        ck_assert_int_eq(kvm_kvcache_head(dst, 1, g)->n, 96);
        const kvm_kv_head *h2 = kvm_kvcache_head(dst, 2, g);
        ck_assert_int_eq(h2->n, 6);
        for (int e = 0; e < 3; e++) ck_assert_int_eq(h2->pos[e], KVM_POS_NONE);
        for (int e = 3; e < 6; e++) ck_assert_int_eq(h2->pos[e], 96 - 6 + e);
        for (int l = 3; l < L; l++) {
            const kvm_kv_head *x = kvm_kvcache_head(dst, l, g), *y = kvm_kvcache_head(ref, l, g);
            ck_assert_int_eq(x->n, 36);
            ck_assert_int_eq(memcmp(x->k, y->k, (size_t)(36 * d) * sizeof(float)), 0);
        }
    }
    ck_assert_int_eq(st.base.entries, (int64_t)H * (96 + 96 + 6 + (L - 3) * 36));
    kvm_kvcache_free(&dst);

    /* pilot allocation over the distilled layers only keeps their total */
    o.alloc = KVM_SCULPT_ALLOC_HEAD;
    budget[0] = 0;
    budget[1] = 40;
    budget[2] = 20;
    ck_assert_int_eq(kvm_kvcache_clone(in->full, &dst), 0);
    ck_assert_int_eq(kvm_sculpt_compress_layers(in, &o, budget, dst, NULL), 0);
    int64_t tot = 0;
    for (int l = 1; l < L; l++)
        for (int g = 0; g < H; g++) tot += kvm_kvcache_head(dst, l, g)->n;
    ck_assert_int_eq(tot, (int64_t)H * (40 + 20 + (L - 3) * 36));
    ck_assert_int_eq(kvm_kvcache_head(dst, 0, 0)->n, 96);
    kvm_kvcache_free(&dst);

    /* a destination of another shape is refused */
    ck_assert_int_eq(kvm_kvcache_new(L, H, d + 1, 1, &dst), 0);
    ck_assert_int_eq(kvm_sculpt_compress_layers(in, &o, budget, dst, NULL), KVM_EINVAL);
    kvm_kvcache_free(&dst);
    kvm_kvcache_free(&ref);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* The problem of layer 1, KV head 2 of a 128-token context (retain m = 16, 128 synthetic queries
 * at future positions up to 32, seed 3): the one-head solver tests' problem; the caller frees
 * both. */
static void head_problem(kvm_eval_doc **doc, kvm_sculpt_problem *p)
{
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, doc), 0);
    ck_assert_int_eq(kvm_sculpt_problem_build(&model->cfg, kvm_eval_doc_input(*doc)->cap, 1, 2, 16, 128, 32, 3, p), 0);
}

START_TEST(test_solver_improves_on_selectfit)
{
    kvm_eval_doc *doc;
    kvm_sculpt_problem p;
    head_problem(&doc, &p);
    kvm_sculpt_opts o = quick_opts();
    float kc[16 * 8], vc[16 * 8], beta[16];
    kvm_sculpt_head_stats st;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 16, 2, 15, kc, vc, beta, &st), 0);
    printf("one head, k = 16: Select+Fit loss %.4g -> KVSculpt %.4g (%d evaluations)\n", st.loss0, st.loss,
           st.lbfgs_calls);
    ck_assert_double_lt(st.loss, 0.9 * st.loss0);
    kvm_sculpt_problem_free(&p);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* am_start: the solve starts at Attention Matching's point: am's keys and β, its values refit
 * once more by the ridge (shrunk towards am's values: the output error, so the loss, can only
 * fall), descends from it, and differs from the Select+Fit start. */
START_TEST(test_am_start)
{
    kvm_eval_doc *doc;
    kvm_sculpt_problem p;
    head_problem(&doc, &p);
    kvm_sculpt_opts o = quick_opts();
    o.bias = 1;
    float kc[3][16 * 8], vc[3][16 * 8], beta[3][16];
    kvm_sculpt_head_stats st[3];
    o.mode = KVM_SCULPT_AM;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 16, 2, 15, kc[0], vc[0], beta[0], &st[0]), 0);
    o.mode = KVM_SCULPT_FULL;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 16, 2, 15, kc[1], vc[1], beta[1], &st[1]), 0);
    o.am_start = 1;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 16, 2, 15, kc[2], vc[2], beta[2], &st[2]), 0);
    printf("am_start, k = 16: am loss %.4g; Select+Fit start %.4g -> %.4g; am start %.4g -> %.4g\n", st[0].loss,
           st[1].loss0, st[1].loss, st[2].loss0, st[2].loss);
    ck_assert_double_le(st[2].loss0, st[0].loss * (1 + 1e-6));
    ck_assert_double_gt(st[2].loss0, 0.9 * st[0].loss);
    ck_assert_double_lt(st[2].loss, st[2].loss0);
    ck_assert(st[2].loss0 != st[1].loss0);
    kvm_sculpt_problem_free(&p);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* round_tolerance: a problem leaves the rounds when a round improved its best loss by less
 * than the fraction; at 1 (no round improves by 100%) the solve is the one-round solve bit for
 * bit, with 0 every round runs (the 4-round solve), and a value in between stops in between. */
START_TEST(test_round_tolerance)
{
    kvm_eval_doc *doc;
    kvm_sculpt_problem p;
    head_problem(&doc, &p);
    kvm_sculpt_opts o = quick_opts();
    float kc[3][16 * 8], vc[3][16 * 8], beta[3][16];
    kvm_sculpt_head_stats st[3];
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 16, 1, 10, kc[0], vc[0], beta[0], &st[0]), 0);
    o.round_tolerance = 1;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 16, 4, 10, kc[1], vc[1], beta[1], &st[1]), 0);
    ck_assert(!memcmp(kc[0], kc[1], sizeof kc[0]) && !memcmp(vc[0], vc[1], sizeof vc[0]));
    ck_assert(st[0].loss == st[1].loss);
    ck_assert_int_eq(st[0].lbfgs_calls, st[1].lbfgs_calls);
    o.round_tolerance = 0;
    ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 16, 4, 10, kc[2], vc[2], beta[2], &st[2]), 0);
    printf("round_tolerance: %d evaluations at 1 (one round), %d at 0 (4 rounds)\n", st[1].lbfgs_calls,
           st[2].lbfgs_calls);
    ck_assert_int_gt(st[2].lbfgs_calls, st[1].lbfgs_calls);
    ck_assert_double_lt(st[2].loss, st[1].loss);
    kvm_sculpt_problem_free(&p);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* Real captured problems: every (layer, KV head) of a stories260K context, blocked vs reference. */
START_TEST(test_blocked_loss_real)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    const kvm_model_config *c = &model->cfg;
    double worst = 0;
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        kvm_sculpt_problem p;
        ck_assert_int_eq(kvm_sculpt_problem_build(c, kvm_eval_doc_input(doc)->cap, i / c->n_kv_heads, i % c->n_kv_heads,
                                                  16, 200, 32, 5, &p), 0);
        const int64_t k = 1 + (i * 7) % p.nc; /* from 1 to the whole zone */
        float *beta = malloc((size_t)k * sizeof *beta);
        for (int64_t j = 0; j < k; j++) beta[j] = 0.2f * frand();
        /* the zone's own first k keys and values: a realistic point with realistic scores */
        worst = fmax(worst, blocked_vs_ref(&p, p.kz, p.vz, i % 2 ? beta : NULL, k));
        free(beta);
        kvm_sculpt_problem_free(&p);
    }
    printf("blocked vs reference loss+gradient, %d real problems: worst relative error %.3g\n",
           c->n_layers * c->n_kv_heads, worst);
    ck_assert_double_lt(worst, 1e-5);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* The head-dim-8 loops in AVX-512's shape (64-byte sums in 32 registers; the exponential
 * exp_wv8_v4 with vmaxps and vscalefps) give the bits of the 16-register shape that AVX2 and
 * baseline processors run (kernels/cpu/kvm_cpu_sculpt_k8n.c): loss, MSE, LSE term and both
 * gradients, on the 20 real problems with and without β, and under flush-to-zero as the solver
 * threads run it. */
START_TEST(test_avx512_exp_loop_same_bits)
{
    const int v4_was = kvm__cpu_v4_set(1);
    if (!kvm__cpu_v4()) {
        printf("SKIP: no AVX-512 (x86-64-v4) on this processor: the 16-register loops only\n");
        return;
    }
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    const kvm_model_config *c = &model->cfg;
    kvm_fpmode fm = kvm_fpmode_flush_enter();
    for (int i = 0; i < c->n_layers * c->n_kv_heads; i++) {
        kvm_sculpt_problem p;
        ck_assert_int_eq(kvm_sculpt_problem_build(c, kvm_eval_doc_input(doc)->cap, i / c->n_kv_heads, i % c->n_kv_heads,
                                                  16, 200, 32, 5, &p), 0);
        const int64_t k = 1 + (i * 7) % p.nc, d = p.d;
        float *beta = malloc((size_t)k * sizeof *beta), *g[2];
        for (int64_t j = 0; j < k; j++) beta[j] = 0.2f * frand();
        const kvm_sculpt_view v = {.d = p.d, .scale = p.scale, .nq = p.nq, .nc = p.nc, .q = p.q, .o_full = p.o_full,
                                   .o_ret = p.o_ret, .lse_zone = p.lse_zone, .lse_ret = p.lse_ret, .n_vis = p.n_vis,
                                   .out_ms = p.out_ms};
        kvm_sculpt_eval ev[2];
        for (int on = 0; on < 2; on++) {
            kvm__cpu_v4_set(on);
            g[on] = malloc((size_t)(k * (d + 1)) * sizeof *g[on]);
            ck_assert_int_eq(kvm_cpu_sculpt_lossgrad(&v, p.kz, p.vz, i % 2 ? beta : NULL, k, 0.1, g[on], g[on] + k * d,
                                                     &ev[on]), 0);
        }
        ck_assert_msg(ev[0].loss == ev[1].loss && ev[0].mse_sum == ev[1].mse_sum && ev[0].lse_sum == ev[1].lse_sum,
                      "problem %d: loss %.9g vs %.9g", i, ev[0].loss, ev[1].loss);
        ck_assert_msg(!memcmp(g[0], g[1], (size_t)(k * (d + (i % 2))) * sizeof *g[0]), "problem %d: gradients differ", i);
        free(g[0]);
        free(g[1]);
        free(beta);
        kvm_sculpt_problem_free(&p);
    }
    kvm_fpmode_restore(fm);
    kvm__cpu_v4_set(v4_was);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* The solver's threads and the forward flush subnormals while they compute and leave the
 * caller's floating-point mode as it was, whether it flushed or not. */
START_TEST(test_fpmode_restored)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 112, 96, 16, &doc), 0);
    ck_assert_int_eq(kvm_fpmode_is_flushing(), 0);
    kvm_sculpt_opts o = quick_opts();
    o.rounds = 1;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, NULL), 0);
    ck_assert_int_eq(kvm_fpmode_is_flushing(), 0);
    kvm_eval_result r;
    ck_assert_int_eq(kvm_eval_continue(doc, c, NULL, NULL, &r), 0); /* the forward, too */
    ck_assert_int_eq(kvm_fpmode_is_flushing(), 0);
    kvm_kvcache_free(&c);
#if defined(__x86_64__)
    kvm_fpmode s = kvm_fpmode_flush_enter();
    o.threads = 2;
    ck_assert_int_eq(kvm_sculpt_compress(kvm_eval_doc_input(doc), &o, &c, NULL), 0);
    ck_assert_int_eq(kvm_fpmode_is_flushing(), 1);
    kvm_kvcache_free(&c);
    kvm_fpmode_restore(s);
#endif
    kvm_eval_doc_free(&doc);
}
END_TEST

/* Median over stories260K's 20 problems of kvmill's final objective / liblbfgs's (the oracle),
 * both from the same start with the same budget (o's rounds and iterations). */
static double oracle_median(kvm_eval_doc *doc, kvm_sculpt_opts o)
{
    const kvm_model_config *c = &model->cfg;
    const int np = c->n_layers * c->n_kv_heads;
    double ratio[64];
    for (int i = 0; i < np; i++) {
        kvm_sculpt_problem p;
        ck_assert_int_eq(kvm_sculpt_problem_build(c, kvm_eval_doc_input(doc)->cap, i / c->n_kv_heads, i % c->n_kv_heads,
                                                  16, 256, 32, 1, &p), 0);
        float kc[24 * 8], vc[24 * 8], beta[24];
        kvm_sculpt_head_stats own, ref;
        o.lbfgs_oracle = 0;
        ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 24, o.rounds, o.lbfgs_iters, kc, vc, beta, &own), 0);
        o.lbfgs_oracle = 1;
        ck_assert_int_eq(kvm_sculpt_solve_head(&p, &o, 24, o.rounds, o.lbfgs_iters, kc, vc, beta, &ref), 0);
        ratio[i] = own.loss / ref.loss;
        kvm_sculpt_problem_free(&p);
    }
    for (int a = 0; a < np; a++) /* sort for the median */
        for (int b = a + 1; b < np; b++)
            if (ratio[b] < ratio[a]) {
                double t = ratio[a];
                ratio[a] = ratio[b];
                ratio[b] = t;
            }
    double med = np % 2 ? ratio[np / 2] : 0.5 * (ratio[np / 2 - 1] + ratio[np / 2]);
    printf("kvmill L-BFGS%s / liblbfgs final objective over %d problems: median %.4f (min %.4f, max %.4f)\n",
           o.carry_history ? " with carry_history" : "", np, med, ratio[0], ratio[np - 1]);
    return med;
}

/* kvmill's L-BFGS reaches liblbfgs's objective (within 1%, or below; median over every problem
 * of a stories260K context) from the same start with the same budget, without and with the
 * memory carried over rounds (liblbfgs starts every round empty). */
START_TEST(test_lbfgs_vs_liblbfgs)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    kvm_sculpt_opts o = quick_opts();
    o.rounds = 2;
    o.lbfgs_iters = 30;
    for (int carry = 0; carry < 2; carry++) {
        o.carry_history = carry;
        ck_assert_double_lt(oracle_median(doc, o), 1.01);
    }
    kvm_eval_doc_free(&doc);
}
END_TEST


/* The batched solver (issue 12, kvm_sculpt_solve_batch): every problem of a stories260K context
 * in one batch, budgets differing per head, for each method (and β), gives each problem exactly
 * (bit for bit) what kvm_sculpt_solve_head gives it alone; the same with 2 threads and in a
 * batch of other composition (every other problem, reversed order). */
enum { BN = 20, BKMAX = 40 };

static int64_t batch_k(int i) { return 1 + (i * 13) % BKMAX; } /* 1 .. 40: ragged budgets */

static void batch_solve(const kvm_sculpt_problem *const *ps, const int *which, int n, const kvm_sculpt_opts *o,
                        float *kc, float *vc, float *beta, kvm_sculpt_head_stats *st)
{
    const kvm_sculpt_problem *pp[BN];
    int64_t kk[BN];
    for (int t = 0; t < n; t++) {
        pp[t] = ps[which[t]];
        kk[t] = batch_k(which[t]);
    }
    double lb, rg;
    kvm_progress pr = {0};
    ck_assert_int_eq(kvm_sculpt_solve_batch(pp, n, o, kk, o->rounds, o->lbfgs_iters, NULL, kc, vc, beta, st, &lb, &rg, &pr),
                     0);
    ck_assert(lb >= 0 && rg >= 0);
    /* one step per problem, whichever path solved it (one at a time per thread, or lockstep) */
    ck_assert_int_eq(atomic_load(&pr.done), n);
}

START_TEST(test_batch_equals_per_problem)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    const kvm_model_config *c = &model->cfg;
    const int np = c->n_layers * c->n_kv_heads, d = c->head_dim;
    ck_assert_int_eq(np, BN);
    kvm_sculpt_problem P[BN];
    const kvm_sculpt_problem *ps[BN];
    for (int i = 0; i < np; i++) {
        ck_assert_int_eq(kvm_sculpt_problem_build(c, kvm_eval_doc_input(doc)->cap, i / c->n_kv_heads,
                                                  i % c->n_kv_heads, 16, 160, 32, 7, &P[i]), 0);
        ps[i] = &P[i];
    }
    static float kc[BN * BKMAX * 8], vc[BN * BKMAX * 8], beta[BN * BKMAX];
    static float kc2[BN * BKMAX * 8], vc2[BN * BKMAX * 8], beta2[BN * BKMAX];
    kvm_sculpt_head_stats st[BN], st2[BN];
    int all[BN], sub[BN], ns = 0;
    for (int i = 0; i < np; i++) all[i] = i;
    for (int i = np - 1; i >= 0; i -= 2) sub[ns++] = i; /* every other problem, reversed */
    const struct { kvm_sculpt_mode mode; int bias; } V[6] = {{KVM_SCULPT_FULL, 0}, {KVM_SCULPT_FULL, 1},
        {KVM_SCULPT_JOINT_FIXED, 0}, {KVM_SCULPT_SELECTFIT, 0}, {KVM_SCULPT_FULL, 0}, {KVM_SCULPT_FULL, 1}};
    for (int v = 0; v < 6; v++) {
        kvm_sculpt_opts o = quick_opts();
        o.mode = V[v].mode;
        o.bias = V[v].bias;
        o.am_start = v == 5; /* from Attention Matching's point */
        o.knorm_cap = v == 1 ? 1.0 : 0; /* the key-norm guard between rounds, too */
        if (v == 4) { /* the convergence settings: problems leave at different steps */
            o.rounds = 4;
            o.lbfgs_tolerance = 0.05;
            o.round_tolerance = 0.02;
            o.carry_history = 1;
            o.lbfgs_gtol = 0.05; /* the scale-free gradient stop, its reference from round 1 */
            o.ridge_f32 = 0;     /* and the float64 fit (the other variants have the default) */
        }
        batch_solve(ps, all, np, &o, kc, vc, beta, st);
        int64_t off = 0;
        for (int i = 0; i < np; i++) { /* vs the per-problem solver */
            const int64_t k = batch_k(i);
            float a[BKMAX * 8], b[BKMAX * 8], g[BKMAX];
            kvm_sculpt_head_stats h;
            ck_assert_int_eq(kvm_sculpt_solve_head(ps[i], &o, k, o.rounds, o.lbfgs_iters, a, b, g, &h), 0);
            ck_assert(!memcmp(a, kc + off * d, (size_t)(k * d) * sizeof *a));
            ck_assert(!memcmp(b, vc + off * d, (size_t)(k * d) * sizeof *b));
            ck_assert(!memcmp(g, beta + off, (size_t)k * sizeof *g));
            ck_assert(h.loss == st[i].loss && h.loss0 == st[i].loss0 && h.mse == st[i].mse);
            ck_assert_int_eq(h.lbfgs_calls, st[i].lbfgs_calls);
            if (v < 3 || v == 5) ck_assert_double_lt(st[i].loss, st[i].loss0 * (1 + 1e-12));
            off += k;
        }
        o.threads = 2; /* another thread count and another batch, on both CPU schedules */
        for (int ls = 0; ls < 2; ls++) {
            o.lockstep = ls;
            batch_solve(ps, sub, ns, &o, kc2, vc2, beta2, st2);
            int64_t o2 = 0;
            for (int t = 0; t < ns; t++) {
                const int i = sub[t];
                const int64_t k = batch_k(i);
                int64_t o1 = 0;
                for (int j = 0; j < i; j++) o1 += batch_k(j);
                ck_assert(!memcmp(kc2 + o2 * d, kc + o1 * d, (size_t)(k * d) * sizeof *kc));
                ck_assert(!memcmp(vc2 + o2 * d, vc + o1 * d, (size_t)(k * d) * sizeof *vc));
                ck_assert(!memcmp(beta2 + o2, beta + o1, (size_t)k * sizeof *beta));
                ck_assert(st2[t].loss == st[i].loss);
                o2 += k;
            }
        }
    }
    printf("batched solver: 20 problems (k 1..40) x 4 methods (and sculpt with the convergence settings, and from am's start) bit-identical to the per-problem solver, "
           "with 1 and 2 threads, in two batch compositions, one problem at a time and in lockstep\n");
    /* bad budgets: named */
    int64_t kk[2] = {4, P[1].nc + 1};
    double lb, rg;
    kvm_sculpt_opts o = quick_opts();
    ck_assert_int_eq(kvm_sculpt_solve_batch(ps, 2, &o, kk, 1, 1, NULL, kc, vc, beta, st, &lb, &rg, NULL), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "problem 1"));
    for (int i = 0; i < np; i++) kvm_sculpt_problem_free(&P[i]);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* kvmill's BLAS calls are made one at a time, and give the same bits on two threads at once as
 * on one. The serial OpenBLAS that kvmill links is not safe to call concurrently (its
 * blas_memory_alloc hands two threads the same work buffer), and the solver calls it from its
 * per-problem threads (Attention Matching's start: cblas_sgemm and cblas_ssyrk; the float64
 * ridge equations: cblas_dsyrk and cblas_dgemm), so every call is made under kvm_blas_lock.
 * Without it the one-problem-per-thread schedule of test_batch_equals_per_problem (am_start)
 * differed now and then from the 1-thread run, or failed a ridge fit. This test binary's own
 * definitions of those four routines (below; the library objects linked into it call them, and
 * they call OpenBLAS's) count the calls in progress while a test watches, and wait 50 µs inside
 * each call so that unserialised calls overlap for certain (without the lock: hundreds of
 * overlaps per run). Two threads make back-to-back calls of the CPU backend's sgemm, then run
 * every problem's Attention Matching head (float64 ridge) over and over, one thread in problem
 * order and one in reverse: no call overlaps another, and every result is the 1-thread one. */
static atomic_int blas_watch, blas_in, blas_overlaps;

static void blas_enter(void)
{
    if (!atomic_load(&blas_watch)) return;
    if (atomic_fetch_add(&blas_in, 1) > 0) atomic_fetch_add(&blas_overlaps, 1);
    usleep(50);
}

static void blas_leave(void)
{
    if (atomic_load(&blas_watch)) atomic_fetch_sub(&blas_in, 1);
}

#define BLAS_NEXT(name) ((name##_fn)dlsym(RTLD_NEXT, #name))
typedef void (*cblas_sgemm_fn)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint, blasint, blasint,
                               float, const float *, blasint, const float *, blasint, float, float *, blasint);
typedef void (*cblas_dgemm_fn)(enum CBLAS_ORDER, enum CBLAS_TRANSPOSE, enum CBLAS_TRANSPOSE, blasint, blasint, blasint,
                               double, const double *, blasint, const double *, blasint, double, double *, blasint);
typedef void (*cblas_ssyrk_fn)(enum CBLAS_ORDER, enum CBLAS_UPLO, enum CBLAS_TRANSPOSE, blasint, blasint, float,
                               const float *, blasint, float, float *, blasint);
typedef void (*cblas_dsyrk_fn)(enum CBLAS_ORDER, enum CBLAS_UPLO, enum CBLAS_TRANSPOSE, blasint, blasint, double,
                               const double *, blasint, double, double *, blasint);

void cblas_sgemm(const enum CBLAS_ORDER o, const enum CBLAS_TRANSPOSE ta, const enum CBLAS_TRANSPOSE tb,
                 const blasint m, const blasint n, const blasint k, const float alpha, const float *a,
                 const blasint lda, const float *b, const blasint ldb, const float beta, float *c, const blasint ldc)
{
    blas_enter();
    BLAS_NEXT(cblas_sgemm)(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    blas_leave();
}

void cblas_dgemm(const enum CBLAS_ORDER o, const enum CBLAS_TRANSPOSE ta, const enum CBLAS_TRANSPOSE tb,
                 const blasint m, const blasint n, const blasint k, const double alpha, const double *a,
                 const blasint lda, const double *b, const blasint ldb, const double beta, double *c, const blasint ldc)
{
    blas_enter();
    BLAS_NEXT(cblas_dgemm)(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    blas_leave();
}

void cblas_ssyrk(const enum CBLAS_ORDER o, const enum CBLAS_UPLO u, const enum CBLAS_TRANSPOSE t, const blasint n,
                 const blasint k, const float alpha, const float *a, const blasint lda, const float beta, float *c,
                 const blasint ldc)
{
    blas_enter();
    BLAS_NEXT(cblas_ssyrk)(o, u, t, n, k, alpha, a, lda, beta, c, ldc);
    blas_leave();
}

void cblas_dsyrk(const enum CBLAS_ORDER o, const enum CBLAS_UPLO u, const enum CBLAS_TRANSPOSE t, const blasint n,
                 const blasint k, const double alpha, const double *a, const blasint lda, const double beta, double *c,
                 const blasint ldc)
{
    blas_enter();
    BLAS_NEXT(cblas_dsyrk)(o, u, t, n, k, alpha, a, lda, beta, c, ldc);
    blas_leave();
}

enum { HAMMER_GEMMS = 200, HAMMER_REPS = 4, HM = 192, HN = 80, HK = 8 };

typedef struct blas_hammer {
    const kvm_sculpt_problem *P;
    const kvm_sculpt_opts *o;
    const float *x, *y, *ref; /* sgemm: [HM][HK], [HN][HK], the 1-thread [HM][HN] */
    int np, d, rev, bad, bad_gemm, rc;
    const float *rk, *rv, *rb; /* [BN][BKMAX·8], [BN][BKMAX·8], [BN][BKMAX]: the 1-thread heads */
} blas_hammer;

static void *blas_hammer_run(void *arg)
{
    blas_hammer *h = arg;
    static _Thread_local float z[HM * HN];
    for (int r = 0; r < HAMMER_GEMMS; r++) {
        if ((h->rc = kvm__cpu_sgemm(0, 1, HM, HN, HK, 0.35f, h->x, HK, h->y, HK, 0.0f, z, HN))) return NULL;
        h->bad_gemm += memcmp(z, h->ref, sizeof z) != 0;
    }
    float kc[BKMAX * 8], vc[BKMAX * 8], beta[BKMAX];
    for (int r = 0; r < HAMMER_REPS; r++)
        for (int t = 0; t < h->np; t++) {
            const int i = h->rev ? h->np - 1 - t : t, kd = (int)batch_k(i) * h->d;
            kvm_sculpt_head_stats st;
            if ((h->rc = kvm_sculpt_am_head(&h->P[i], h->o, batch_k(i), kc, vc, beta, &st))) return NULL;
            h->bad += memcmp(kc, h->rk + i * BKMAX * 8, (size_t)kd * sizeof *kc) != 0 ||
                      memcmp(vc, h->rv + i * BKMAX * 8, (size_t)kd * sizeof *vc) != 0 ||
                      memcmp(beta, h->rb + i * BKMAX, (size_t)batch_k(i) * sizeof *beta) != 0;
        }
    return NULL;
}

START_TEST(test_blas_calls_thread_safe)
{
    kvm_eval_doc *doc;
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, &doc), 0);
    const kvm_model_config *c = &model->cfg;
    const int np = c->n_layers * c->n_kv_heads, d = c->head_dim;
    ck_assert_int_eq(np, BN);
    ck_assert_int_le(d, 8);
    kvm_sculpt_problem P[BN];
    for (int i = 0; i < np; i++)
        ck_assert_int_eq(kvm_sculpt_problem_build(c, kvm_eval_doc_input(doc)->cap, i / c->n_kv_heads, i % c->n_kv_heads,
                                                  16, 160, 32, 7, &P[i]),
                         0);
    static float x[HM * HK], y[HN * HK], ref[HM * HN];
    uint32_t lcg = 12345;
    for (int i = 0; i < HM * HK; i++)
        x[i] = (float)((lcg = lcg * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
    for (int i = 0; i < HN * HK; i++)
        y[i] = (float)((lcg = lcg * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f;
    ck_assert_int_eq(kvm__cpu_sgemm(0, 1, HM, HN, HK, 0.35f, x, HK, y, HK, 0.0f, ref, HN), 0);
    kvm_sculpt_opts o = quick_opts();
    o.ridge_f32 = 0; /* the values' normal equations by OpenBLAS too */
    static float rk[BN * BKMAX * 8], rv[BN * BKMAX * 8], rb[BN * BKMAX];
    for (int i = 0; i < np; i++) { /* one thread: the reference */
        kvm_sculpt_head_stats st;
        ck_assert_int_eq(
            kvm_sculpt_am_head(&P[i], &o, batch_k(i), rk + i * BKMAX * 8, rv + i * BKMAX * 8, rb + i * BKMAX, &st), 0);
    }
    blas_hammer h[2];
    pthread_t th;
    for (int t = 0; t < 2; t++)
        h[t] = (blas_hammer){
            .P = P, .o = &o, .x = x, .y = y, .ref = ref, .np = np, .d = d, .rev = t, .rk = rk, .rv = rv, .rb = rb};
    atomic_store(&blas_watch, 1);
    ck_assert_int_eq(pthread_create(&th, NULL, blas_hammer_run, &h[1]), 0);
    blas_hammer_run(&h[0]);
    pthread_join(th, NULL);
    atomic_store(&blas_watch, 0);
    const int overlaps = atomic_load(&blas_overlaps);
    printf("BLAS from two threads at once: %d overlapping calls; %d + %d of 2 x %d sgemm calls and %d + %d of 2 x %d "
           "Attention Matching heads differ from one thread's\n",
           overlaps, h[0].bad_gemm, h[1].bad_gemm, HAMMER_GEMMS, h[0].bad, h[1].bad, HAMMER_REPS * np);
    fflush(stdout);
    ck_assert_int_eq(h[0].rc, 0);
    ck_assert_int_eq(h[1].rc, 0);
    ck_assert_int_eq(overlaps, 0);
    ck_assert_int_eq(h[0].bad_gemm + h[1].bad_gemm, 0);
    ck_assert_int_eq(h[0].bad + h[1].bad, 0);
    for (int i = 0; i < np; i++)
        kvm_sculpt_problem_free(&P[i]);
    kvm_eval_doc_free(&doc);
}
END_TEST

/* The CPU batch backend: loss and gradient of a subset in one call equal the single-problem
 * kernel's; bad batches and indices are refused with a message. */
START_TEST(test_batch_backend_cpu)
{
    toy t[3];
    toy_new(&t[0], 40, 8, 70, 1.0f, 0);
    toy_new(&t[1], 30, 0, 50, 2.0f, 0);
    toy_new_d(&t[2], 16, 20, 4, 33, 1.0f, 0);
    const kvm_sculpt_backend *be = kvm_sculpt_backend_cpu();
    kvm_sculpt_view v[3];
    for (int i = 0; i < 3; i++) {
        const kvm_sculpt_problem *p = &t[i].p;
        v[i] = (kvm_sculpt_view){.d = p->d, .scale = p->scale, .nq = p->nq, .nc = p->nc, .q = p->q,
                                 .o_full = p->o_full, .o_ret = p->o_ret, .lse_zone = p->lse_zone,
                                 .lse_ret = p->lse_ret, .n_vis = p->n_vis, .out_ms = p->out_ms};
    }
    int64_t k[2] = {12, 5};
    kvm_sculpt_batch *b;
    ck_assert_int_eq(be->batch_new(be, v, k, 2, 2, &b), 0);
    float kc[17 * 8], vc[17 * 8], beta[17], gk[17 * 8], gb[17];
    for (int i = 0; i < 17 * 8; i++) {
        kc[i] = frand();
        vc[i] = frand();
    }
    for (int i = 0; i < 17; i++) beta[i] = 0.3f * frand();
    int idx[2] = {1, 0};
    ck_assert_int_eq(be->upload(b, idx, 2, kc, vc, beta), 0);
    kvm_sculpt_eval ev[2];
    ck_assert_int_eq(be->lossgrad(b, idx, 2, 0.1, 1, 1, 1, ev), 0);
    memset(gk, 0, sizeof gk);
    ck_assert_int_eq(be->download_grads(b, idx + 1, 1, gk, gb), 0); /* problem 0 only */
    float rk[12 * 8], rb[12];
    kvm_sculpt_eval r;
    ck_assert_int_eq(kvm_cpu_sculpt_lossgrad(&v[0], kc, vc, beta, 12, 0.1, rk, rb, &r), 0);
    ck_assert(r.loss == ev[1].loss && r.mse_sum == ev[1].mse_sum);
    ck_assert(!memcmp(rk, gk, sizeof rk) && !memcmp(rb, gb, sizeof rb));
    for (int i = 12 * 8; i < 17 * 8; i++) ck_assert(gk[i] == 0.0f); /* problem 1's slice untouched */
    ck_assert_int_eq(kvm_cpu_sculpt_lossgrad(&v[1], kc + 12 * 8, vc + 12 * 8, beta + 12, 5, 0.1, rk, rb, &r), 0);
    ck_assert(r.loss == ev[0].loss);
    double A[144 + 25], B[17 * 8], Ar[144], Br[12 * 8];
    ck_assert_int_eq(be->normal(b, idx + 1, 1, 1, A, B), 0);
    ck_assert_int_eq(kvm_cpu_sculpt_normal(&v[0], kc, beta, 12, Ar, Br), 0);
    for (int a = 0; a < 12; a++)
        for (int c = a; c < 12; c++) ck_assert(A[a * 12 + c] == Ar[a * 12 + c]);
    ck_assert(!memcmp(B, Br, sizeof Br));
    int bad = 2;
    ck_assert_int_eq(be->lossgrad(b, &bad, 1, 0.1, 0, 0, 0, ev), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "index 2"));
    be->batch_free(b);
    int64_t k0[2] = {3, 0};
    ck_assert_int_eq(be->batch_new(be, v, k0, 2, 1, &b), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "problem 1 has k = 0"));
    ck_assert_ptr_null(b);
    int64_t k3[3] = {3, 3, 3};
    ck_assert_int_eq(be->batch_new(be, v, k3, 3, 1, &b), KVM_EINVAL); /* head dims 8 and 16 */
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "head dim 16"));
    for (int i = 0; i < 3; i++) toy_free(&t[i]);
}
END_TEST

/* sculpt and eval read and tokenise a document only as far as --context (+ continuation)
 * needs: a 40 MB document under a 500 MB address-space limit (it was tokenised whole: 4 GB for
 * 200 MB, "cannot allocate merge state for 40000002 tokens" here). */
START_TEST(test_cli_long_document)
{
#if defined(__SANITIZE_ADDRESS__)
    printf("SKIP: cli_long_document: AddressSanitizer needs more address space than the limit\n");
    return;
#endif
    char *dir = kvm_test_tmpdir(), cmd[4096], doc[512];
    snprintf(doc, sizeof doc, "%s/long.txt", dir);
    FILE *f = fopen(doc, "w");
    ck_assert_ptr_nonnull(f);
    static char block[1 << 16];
    memset(block, 'a', sizeof block);
    for (int i = 0; i < 40000000 / (int)sizeof block; i++) ck_assert_int_eq(fwrite(block, 1, sizeof block, f), sizeof block);
    ck_assert_int_eq(fclose(f), 0);
    const char *mp = kvm_test_data_path("models/stories260K.bin");
    snprintf(cmd, sizeof cmd,
             "ulimit -v 500000 && '%s/kvmill' sculpt --model '%s' --doc '%s' --context 64 --retain 8 --ratio 0.5 "
             "--queries 32 --rounds 1 --iterations 3 --out '%s/l.kvs' && '%s/kvmill' eval --model '%s' --docs '%s' "
             "--method h2o --budget 32 --context 64 --continuation 16 --decode-steps 0",
             kvm_test_bin(), mp, doc, dir, kvm_test_bin(), mp, doc);
    char *out = NULL, *err = NULL;
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "h2o"), "exit %d\n%s\n%s", rc, out, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

START_TEST(test_cli)
{
    char *dir = kvm_test_tmpdir(), cmd[2048], path[512];
    snprintf(path, sizeof path, "%s/doc.kvs", dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvmill sculpt --model %s --doc %s --context 64 --retain 8 --ratio 0.5 --queries 32 --rounds 1 "
             "--iterations 3 --bias --threads 2 --out %s",
             kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"), "/dev/null", path);
    char *out = NULL, *err = NULL;
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2); /* an empty document has too few tokens: usage */
    ck_assert_msg(strstr(err, "tokens"), "stderr: %s", err);
    free(out);
    free(err);
    char doc[512];
    snprintf(doc, sizeof doc, "%s", kvm_test_data_path("corpus/doc_005.txt"));
    snprintf(cmd, sizeof cmd,
             "%s/kvmill sculpt --model %s --doc %s --context 64 --retain 8 --ratio 0.5 --queries 32 --rounds 1 "
             "--iterations 3 --bias --threads 2 --out %s",
             kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"), doc, path);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_msg(strstr(out, "entries=720 (full 1280)"), "stdout: %s", out); /* 20 heads × (28 + 8) */
    free(out);
    free(err);
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_sculpt_cache_read(path, &c), 0);
    ck_assert_int_eq(c->next_pos, 64);
    ck_assert_int_eq(kvm_kvcache_head(c, 0, 0)->n, 36);
    kvm_kvcache_free(&c);
    snprintf(cmd, sizeof cmd, "%s/kvmill sculpt --model %s --doc %s --ratio 0 --out %s", kvm_test_bin(),
             kvm_test_data_path("models/stories260K.bin"), doc, path);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--ratio 0"), "stderr: %s", err);
    free(out);
    free(err);
    /* --device cuda:N selects the CUDA solver: refused before any work where there is no such
     * device (this test's machine may have one: then it runs) */
    const int have_cuda = kvm_sculpt_backend_cuda(0) != NULL;
    snprintf(cmd, sizeof cmd,
             "%s/kvmill sculpt --model %s --doc %s --context 64 --retain 8 --queries 32 --rounds 1 --iterations 3 "
             "--device cuda:0 --out %s", kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"), doc, path);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), have_cuda ? 0 : 2);
    if (!have_cuda) /* the value once (the message is the backend's, or "this build has no CUDA" without nvcc) */
        ck_assert_msg(strstr(err, "--device cuda:0") && !strstr(err, "cuda:0: cuda:0"), "stderr: %s", err);
    free(out);
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill sculpt --model %s --doc %s --device cuda:one --out %s", kvm_test_bin(),
             kvm_test_data_path("models/stories260K.bin"), doc, path);
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 2);
    ck_assert_msg(strstr(err, "--device cuda:one: not cpu or cuda:N"), "stderr: %s", err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

START_TEST(test_opts_table)
{
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "retain=16,lambda=0.5,alloc=gain,bias,method=joint-fixed,queries=64"), 0);
    ck_assert_int_eq(o.retain_tokens, 16);
    ck_assert_double_eq(o.lambda, 0.5);
    ck_assert_int_eq(o.alloc, KVM_SCULPT_ALLOC_GAIN);
    ck_assert_int_eq(o.bias, 1);
    ck_assert_int_eq(o.mode, KVM_SCULPT_JOINT_FIXED);
    ck_assert_int_eq(o.n_synth, 64);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "ratio=1.5"), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "--ratio 1.5"), "message: %s", kvm_errmsg());
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "rounds=2.5"), KVM_EINVAL);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "tolerance=0.02,round_tolerance=0.01,carry_history=1"), 0);
    ck_assert(o.lbfgs_tolerance == 0.02 && o.round_tolerance == 0.01 && o.carry_history == 1);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "tolerance=-0.1"), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "--tolerance -0.1"), "message: %s", kvm_errmsg());
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "round_tolerance=2"), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "round_tolerance 2"), "message: %s", kvm_errmsg());
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "nosuch=1"), KVM_ENOTFOUND);
    ck_assert_int_eq(kvm_sculpt_opts_parse(&o, "alloc=best"), KVM_EINVAL);
    kvm_budget b = {.tokens = 48};
    ck_assert_int_eq(kvm_sculpt_opts_set_budget(&o, &b), 0);
    ck_assert_int_eq(o.k_entries, 32);
    b.tokens = 16;
    ck_assert_int_eq(kvm_sculpt_opts_set_budget(&o, &b), KVM_EINVAL);
    b = (kvm_budget){.ratio = 0.25};
    ck_assert_int_eq(kvm_sculpt_opts_set_budget(&o, &b), 0);
    ck_assert_int_eq(o.k_entries, 0);
    ck_assert_double_eq(o.ratio, 0.25);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("sculpt");
    TCase *tc = tcase_create("math");
    tcase_add_loop_test(tc, test_gradient_fd, 0, 2);
    tcase_add_test(tc, test_blocked_loss_random);
    tcase_add_test(tc, test_fpmode);
    tcase_add_test(tc, test_references_float64);
    tcase_add_test(tc, test_blocked_loss_smollm2);
    tcase_add_test(tc, test_lbfgs_rosenbrock_and_batch);
    tcase_add_test(tc, test_lbfgs_step0_from_gamma);
    tcase_add_test(tc, test_lbfgs_progress_stop);
    tcase_add_test(tc, test_lbfgs_carry);
    tcase_add_test(tc, test_lbfgs_gradient_tolerance);
    tcase_add_test(tc, test_ridge_normal_equations);
    tcase_add_test(tc, test_ridge_f32);
    tcase_add_test(tc, test_ridge_f32_ill_conditioned);
    tcase_add_test(tc, test_logf_body);
    tcase_add_test(tc, test_lse_zero_when_masses_match);
    tcase_add_test(tc, test_degenerate_toy);
    tcase_add_test(tc, test_allocate);
    tcase_add_test(tc, test_opts_table);
    tcase_add_test(tc, test_batch_backend_cpu);
    suite_add_tcase(s, tc);
    TCase *tm = tcase_create("model");
    tcase_add_checked_fixture(tm, model_setup, model_teardown);
    tcase_set_timeout(tm, 120);
    tcase_add_test(tm, test_exact_at_full_k);
    tcase_add_test(tm, test_lse_zero_real_problem);
    tcase_add_test(tm, test_compress_decode_positions_and_file);
    tcase_add_test(tm, test_degenerate_real);
    tcase_add_test(tm, test_threads_deterministic_and_alloc);
    tcase_add_test(tm, test_compress_layers);
    tcase_add_test(tm, test_solver_improves_on_selectfit);
    tcase_add_test(tm, test_round_tolerance);
    tcase_add_test(tm, test_am_start);
    tcase_add_test(tm, test_blocked_loss_real);
    tcase_add_test(tm, test_avx512_exp_loop_same_bits);
    tcase_add_test(tm, test_fpmode_restored);
    tcase_add_test(tm, test_lbfgs_vs_liblbfgs);
    tcase_add_test(tm, test_batch_equals_per_problem);
    tcase_add_test(tm, test_blas_calls_thread_safe);
    tcase_add_test(tm, test_cli);
    tcase_add_test(tm, test_cli_long_document);
    suite_add_tcase(s, tm);
    return s;
}

int main(void) { return kvm_test_run_suite(suite()); }
