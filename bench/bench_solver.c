/* bench_solver.c: the KVSculpt solver's speed on one document's real problems (issue 12):
 * per-phase CPU seconds and GFLOP/s, the same-run ratios of alternatives (old vs new path,
 * alternating, medians), and kvmill's own float32 GEMM on 2048×2048×2048 as the ceiling.
 *
 *   bench_solver --model M --doc FILE [--ctx 384 --cont 16 --retain 32 --ratio 0.3 --S 2048]
 *                [--reps 5] [--solve 1] [--gemm 1] [--iters 25 --carry-history 1] [--ridge-f32 1]
 *                [--gradient-tolerance 0] [--round-tolerance 0.2]
 *                [--precision-problems 4]
 *
 * Sections (one CSV-ish line each, "section,name,value..."):
 *   gemm     kvm__cpu_gemm_packed on 2048³: GFLOP/s (median of --reps)
 *   loss     per problem shape: loss+gradient at the Select+Fit start, reference vs blocked,
 *            seconds per evaluation and GFLOP/s (8·nq·k·d FLOPs), median over --reps rounds
 *   ridge    the value fit of problem 0, float64 vs float32 normal equations (alternating)
 *   ridge_precision  float32 vs float64 normal equations on --precision-problems problems
 *   solve    kvm_sculpt_solve_head over every problem: kvmill's L-BFGS vs liblbfgs, with and
 *            without flush-to-zero (alternating problem by problem), CPU s, objective ratio.
 *
 * With --device cpu|cuda:N instead of --model/--doc: synthetic problems of a model's shapes as
 * one batch on that backend (kernels/kvm_sculpt_kernels.h), defaults Qwen2.5-1.5B's:
 *
 *   bench_solver --device cuda:0 [--layers 28 --kv-heads 2 --group 6 --head-dim 128 --N 2048
 *                --retain 64 --S 2048 --ratio 0.3 --rounds 4 --iters 30 --reps 5 --threads 1]
 *
 *   batch,DEV,sgemm_ceiling,n,4096,tflops,X            (cuda: cublasSgemm, pedantic float32)
 *   batch,DEV,queries,problems,P,nq,Q,k,K,s,X           (synthetic problems and references, CPU)
 *   batch,DEV,lossgrad,problems,P,s,X,tflops,X          (one batched call over all, median)
 *   batch,DEV,solve,rounds,R,iters,I,wall_s,X,lbfgs_s,X,ridge_s,X,evaluations,E,lossgrad_tflops,X
 * The solve forces every iteration (lbfgs_no_stop). FLOPs of a loss+gradient: 8·nq·k·d. */
#include "bench/bench_util.h"
#include "compress/eval/kvm_eval.h"
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/kvm_fpmode.h"
#include "kernels/kvm_ridge_body.h"
#include "kernels/kvm_sculpt_kernels.h"
#include "orchestrator/kvm_cli_model.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *arg(int argc, char **argv, const char *name, const char *def)
{
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], name)) return argv[i + 1];
    return def;
}

/* kvmill's own sgemm on n³ (the ceiling the loss is measured against). */
static double gemm_gflops(int64_t n, int reps)
{
    float *x = malloc((size_t)(n * n) * sizeof *x), *w = malloc((size_t)(n * n) * sizeof *w);
    float *y = malloc((size_t)(n * n) * sizeof *y);
    for (int64_t i = 0; i < n * n; i++) {
        x[i] = (float)((i * 7) % 13) / 13.0f;
        w[i] = (float)((i * 5) % 11) / 11.0f;
    }
    kvm_cpu_packed pk = {0};
    kvm__cpu_pack(&pk, w, n, n, n, 1);
    double t[16];
    for (int r = 0; r < reps && r < 16; r++) {
        double t0 = bench_clock_s(CLOCK_THREAD_CPUTIME_ID);
        kvm__cpu_gemm_packed(x, n, n, &pk, y, n, 1.0f, 0, n, n);
        t[r] = bench_clock_s(CLOCK_THREAD_CPUTIME_ID) - t0;
    }
    kvm__cpu_packed_free(&pk);
    free(x);
    free(w);
    free(y);
    return 2.0 * (double)n * n * n / bench_median(t, reps < 16 ? reps : 16) * 1e-9;
}

/* The Select+Fit start of problem p at k entries: selected keys, their values. */
static void start_point(const kvm_sculpt_problem *p, int64_t k, float *kc, float *vc)
{
    int64_t *idx = malloc((size_t)k * sizeof *idx);
    kvm_sculpt_select(p, k, idx);
    for (int64_t j = 0; j < k; j++) {
        memcpy(kc + j * p->d, p->kz + idx[j] * p->d, (size_t)p->d * sizeof *kc);
        memcpy(vc + j * p->d, p->vz + idx[j] * p->d, (size_t)p->d * sizeof *vc);
    }
    free(idx);
}

/* Loss+gradient of problem 0's shape: reference vs the production path, alternating. */
static void bench_loss(const kvm_sculpt_problem *p, int64_t k, double lambda, int reps)
{
    const int d = p->d;
    float *kc = malloc((size_t)(k * d) * sizeof *kc), *vc = malloc((size_t)(k * d) * sizeof *vc);
    float *g = malloc((size_t)(k * (d + 1)) * sizeof *g);
    start_point(p, k, kc, vc);
    double tr[64], tn[64], fl = 8.0 * (double)p->nq * (double)k * d;
    int inner = (int)fmax(1, 2e8 / fl);
    if (reps > 64) reps = 64;
    for (int r = 0; r < reps; r++) {
        double t0 = bench_clock_s(CLOCK_THREAD_CPUTIME_ID);
        for (int i = 0; i < inner; i++) kvm_sculpt_loss_ref(p, kc, vc, NULL, k, lambda, g, g + k * d, NULL, NULL);
        tr[r] = (bench_clock_s(CLOCK_THREAD_CPUTIME_ID) - t0) / inner;
        t0 = bench_clock_s(CLOCK_THREAD_CPUTIME_ID);
        for (int i = 0; i < inner; i++) kvm_sculpt_loss(p, kc, vc, NULL, k, lambda, g, g + k * d, NULL, NULL);
        tn[r] = (bench_clock_s(CLOCK_THREAD_CPUTIME_ID) - t0) / inner;
    }
    double mr = bench_median(tr, reps), mn = bench_median(tn, reps);
    printf("loss,nq=%lld k=%lld d=%d,ref_ms,%.3f,ref_gflops,%.2f,new_ms,%.3f,new_gflops,%.2f,speedup,%.2f\n",
           (long long)p->nq, (long long)k, d, 1e3 * mr, fl / mr * 1e-9, 1e3 * mn, fl / mn * 1e-9, mr / mn);
    free(kc);
    free(vc);
    free(g);
}

/* The ridge value fit at the Select+Fit start of problem p, float64 and float32 normal equations
 * alternating (opts ridge_f32 0 / 1): CPU ms per fit and GFLOP/s (2·nq·k·d scores + nq·k² normal
 * matrix + 2·nq·k·d right-hand side + k³/3 Cholesky). */
static void bench_ridge(const kvm_sculpt_problem *p, int64_t k, double alpha, int reps)
{
    const int d = p->d;
    float *kc = malloc((size_t)(k * d) * sizeof *kc), *vc = malloc((size_t)(k * d) * sizeof *vc);
    start_point(p, k, kc, vc);
    double t[2][64], fl = 4.0 * (double)p->nq * k * d + (double)p->nq * k * k + (double)k * k * k / 3;
    if (reps > 64) reps = 64;
    for (int r = 0; r < reps; r++)
        for (int f32 = 0; f32 < 2; f32++) {
            double t0 = bench_clock_s(CLOCK_THREAD_CPUTIME_ID);
            for (int i = 0; i < 10; i++) kvm_sculpt_ridge(p, kc, NULL, k, alpha, 1.0, f32, vc);
            t[f32][r] = (bench_clock_s(CLOCK_THREAD_CPUTIME_ID) - t0) / 10;
        }
    double m64 = bench_median(t[0], reps), m32 = bench_median(t[1], reps);
    printf("ridge,nq=%lld k=%lld d=%d,f64_ms,%.3f,f64_gflops,%.2f,f32_ms,%.3f,f32_gflops,%.2f,speedup,%.2f\n",
           (long long)p->nq, (long long)k, d, 1e3 * m64, fl / m64 * 1e-9, 1e3 * m32, fl / m32 * 1e-9, m64 / m32);
    free(kc);
    free(vc);
}

/* Float32-block vs float64 normal equations of the ridge (kvm_cpu_sculpt_normal, ridge_f32 1 / 0)
 * at the Select+Fit start of problem p, both solved in float64 without the guard: the fitted
 * values' largest difference relative to the largest |value|, the relative difference of the
 * fitted outputs P·V (Frobenius), and the pivot ratio max diag(A + αI) / min U_jj² of the float32
 * equations' Cholesky (what kvm_sculpt_ridge_solve_f32 tests against KVM_SCULPT_RIDGE_PIVOT_LIMIT). */
static void bench_ridge_precision(const kvm_sculpt_problem *p, int64_t k, double alpha_rel)
{
    const int d = p->d;
    const int64_t nq = p->nq;
    float *kc = malloc((size_t)(k * d) * sizeof *kc), *v0 = malloc((size_t)(k * d) * sizeof *v0);
    float *P = malloc((size_t)(nq * k) * sizeof *P);
    double *pr = malloc((size_t)nq * sizeof *pr), *A[2], *B[2];
    for (int f = 0; f < 2; f++) A[f] = malloc((size_t)(k * k) * sizeof *A[f]), B[f] = malloc((size_t)(k * d) * sizeof *B[f]);
    start_point(p, k, kc, v0);
    kvm_sculpt_view v = {.d = d, .scale = p->scale, .nq = nq, .nc = p->nc, .q = p->q, .o_full = p->o_full,
                         .o_ret = p->o_ret, .lse_zone = p->lse_zone, .lse_ret = p->lse_ret, .n_vis = p->n_vis,
                         .out_ms = p->out_ms};
    kvm_cpu_sculpt_probs(&v, kc, NULL, k, P, pr);
    double ratio = 0, dmax = 0;
    int info[2];
    for (int f = 0; f < 2; f++) {
        v.ridge_f32 = f;
        kvm_cpu_sculpt_normal(&v, kc, NULL, k, A[f], B[f]);
        const double alpha = kvm_rb_alpha(A[f], k, alpha_rel);
        for (int64_t j = 0; j < k; j++) {
            A[f][j * k + j] += alpha;
            dmax = f ? fmax(dmax, A[f][j * k + j]) : dmax;
            for (int t = 0; t < d; t++) B[f][j * d + t] += alpha * v0[j * d + t];
        }
        info[f] = LAPACKE_dposv(LAPACK_ROW_MAJOR, 'U', (lapack_int)k, d, A[f], (lapack_int)k, B[f], d);
    }
    double pmin = INFINITY;
    for (int64_t j = 0; j < k; j++) pmin = fmin(pmin, A[1][j * k + j] * A[1][j * k + j]);
    ratio = dmax / pmin;
    double vmax = 0, dv = 0, num = 0, den = 0;
    for (int64_t i = 0; i < k * d; i++) {
        vmax = fmax(vmax, fabs(B[0][i]));
        dv = fmax(dv, fabs(B[1][i] - B[0][i]));
    }
    for (int64_t i = 0; i < nq; i++)
        for (int t = 0; t < d; t++) {
            double o64 = 0, o32 = 0;
            for (int64_t j = 0; j < k; j++) {
                o64 += (double)P[i * k + j] * B[0][j * d + t];
                o32 += (double)P[i * k + j] * B[1][j * d + t];
            }
            num += (o32 - o64) * (o32 - o64);
            den += o64 * o64;
        }
    printf("ridge_precision,nq=%lld k=%lld d=%d,alpha_rel,%g,info_f32,%d,info_f64,%d,pivot_ratio_f32,%.3g,"
           "values_maxdiff_rel,%.3g,outputs_diff_rel,%.3g\n",
           (long long)nq, (long long)k, d, alpha_rel, info[1], info[0], ratio, dv / vmax, sqrt(num / den));
    free(kc), free(v0), free(P), free(pr);
    for (int f = 0; f < 2; f++) free(A[f]), free(B[f]);
}

/* Every problem solved by three variants, alternating problem by problem: (0) flush-to-zero and
 * kvmill's L-BFGS (the production path), (1) flush-to-zero and liblbfgs (the oracle), (2) no
 * flush-to-zero, kvmill's L-BFGS. Thread CPU seconds, evaluations, and the median over problems
 * of the final objective of (0) and (2) relative to (1). */
static void bench_solve(kvm_sculpt_problem *ps, int n, int64_t k, const kvm_sculpt_opts *o)
{
    const int d = ps[0].d;
    float *kc = malloc((size_t)(k * d) * sizeof *kc), *vc = malloc((size_t)(k * d) * sizeof *vc);
    float *beta = malloc((size_t)k * sizeof *beta);
    double tot[3] = {0}, lb[3] = {0}, rg[3] = {0}, *ratio[3];
    long calls[3] = {0};
    for (int v = 0; v < 3; v++) ratio[v] = calloc((size_t)n, sizeof(double));
    for (int i = 0; i < n; i++) {
        double loss[3];
        for (int v = 0; v < 3; v++) {
            kvm_sculpt_opts x = *o;
            x.lbfgs_oracle = v == 1;
            kvm_fpmode fm = v < 2 ? kvm_fpmode_flush_enter() : (kvm_fpmode){0};
            kvm_sculpt_head_stats st;
            double t0 = bench_clock_s(CLOCK_THREAD_CPUTIME_ID);
            kvm_sculpt_solve_head(&ps[i], &x, k, x.rounds, x.lbfgs_iters, kc, vc, beta, &st);
            tot[v] += bench_clock_s(CLOCK_THREAD_CPUTIME_ID) - t0;
            if (v < 2) kvm_fpmode_restore(fm);
            lb[v] += st.lbfgs_s;
            rg[v] += st.ridge_s;
            calls[v] += st.lbfgs_calls;
            loss[v] = st.loss;
        }
        for (int v = 0; v < 3; v++) ratio[v][i] = loss[v] / loss[1];
    }
    const char *name[3] = {"ftz+kvmill_lbfgs", "ftz+liblbfgs", "noftz+kvmill_lbfgs"};
    for (int v = 0; v < 3; v++)
        printf("solve,%s,problems,%d,cpu_s,%.3f,wall_lbfgs_s,%.3f,wall_ridge_s,%.3f,evaluations,%ld,"
               "median_loss_vs_liblbfgs,%.4f\n",
               name[v], n, tot[v], lb[v], rg[v], calls[v], bench_median(ratio[v], n));
    for (int v = 0; v < 3; v++) free(ratio[v]);
    free(kc);
    free(vc);
    free(beta);
}

static int32_t *read_doc(kvm_tokenizer *tok, const char *path, int64_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *text = malloc(1 << 20);
    size_t len = fread(text, 1, (1 << 20) - 1, f);
    fclose(f);
    text[len] = 0;
    int32_t *ids = NULL;
    if (kvm_tokenizer_encode(tok, text, len, 1, 0, &ids, n)) ids = NULL;
    free(text);
    return ids;
}

/* Synthetic problem i of a model's shape: random zone/retain keys and values, queries of the
 * retain zone for every head of the group (causal prefixes) then S synthetic ones. */
static int synth_problem(kvm_sculpt_problem *p, float **kv, int d, int64_t N, int64_t m, int64_t group, int64_t S,
                         uint64_t seed)
{
    memset(p, 0, sizeof *p);
    uint64_t r = seed * 0x9e3779b97f4a7c15ull + 1;
#define RND() ((r = r * 6364136223846793005ull + 1442695040888963407ull), (float)((r >> 40) / (double)(1ull << 24)) * 2 - 1)
    *kv = malloc((size_t)(2 * N * d) * sizeof **kv);
    const int64_t nq = group * m + S;
    p->q = malloc((size_t)(nq * d) * sizeof *p->q);
    p->n_vis = malloc((size_t)nq * sizeof *p->n_vis);
    if (!*kv || !p->q || !p->n_vis) return KVM_ENOMEM;
    for (int64_t i = 0; i < 2 * N * d; i++) (*kv)[i] = 1.5f * RND();
    for (int64_t i = 0; i < nq * d; i++) p->q[i] = 2.0f * RND();
#undef RND
    for (int64_t i = 0; i < nq; i++) p->n_vis[i] = i < group * m ? i % m + 1 : m;
    p->d = d;
    p->scale = 1.0f / sqrtf((float)d);
    p->nc = N - m;
    p->m = m;
    p->kz = *kv;
    p->vz = *kv + N * d;
    p->kr = p->kz + (N - m) * d;
    p->vr = p->vz + (N - m) * d;
    p->nq = nq;
    p->nq_real = group * m;
    return kvm_sculpt_problem_prepare(p);
}

static int bench_batch(int argc, char **argv, const char *dev)
{
    const int L = atoi(arg(argc, argv, "--layers", "28")), H = atoi(arg(argc, argv, "--kv-heads", "2"));
    const int d = atoi(arg(argc, argv, "--head-dim", "128")), reps = atoi(arg(argc, argv, "--reps", "5"));
    const int64_t N = atoll(arg(argc, argv, "--N", "2048")), m = atoll(arg(argc, argv, "--retain", "64"));
    const int64_t group = atoll(arg(argc, argv, "--group", "6")), S = atoll(arg(argc, argv, "--S", "2048"));
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.ratio = atof(arg(argc, argv, "--ratio", "0.3"));
    o.rounds = atoi(arg(argc, argv, "--rounds", "4"));
    o.lbfgs_iters = atoi(arg(argc, argv, "--iters", "30"));
    o.threads = atoi(arg(argc, argv, "--threads", "1"));
    o.lbfgs_no_stop = 1;
    const int np = L * H;
    if (np < 1 || d < 1 || d > 512 || m < 1 || N <= m || reps < 1 || reps > 64 || o.threads < 1) {
        fprintf(stderr, "bench_solver: bad synthetic shape (see the comment at the top of bench/bench_solver.c)\n");
        return 2;
    }
    const kvm_sculpt_backend *be = kvm_sculpt_backend_cpu();
    if (strcmp(dev, "cpu")) {
        int di = -1;
        if (sscanf(dev, "cuda:%d", &di) != 1 || !(be = kvm_sculpt_backend_cuda(di))) {
            fprintf(stderr, "bench_solver: --device %s: %s\n", dev, di < 0 ? "not cpu or cuda:N" : kvm_errmsg());
            return 2;
        }
        double tf;
        if (kvm_cuda_sgemm_ceiling(di, 4096, reps, &tf)) {
            fprintf(stderr, "bench_solver: %s\n", kvm_errmsg());
            return 1;
        }
        printf("batch,%s,sgemm_ceiling,n,4096,tflops,%.2f\n", dev, tf);
    }
    kvm_sculpt_problem *ps = calloc((size_t)np, sizeof *ps);
    const kvm_sculpt_problem **pp = calloc((size_t)np, sizeof *pp);
    float **kv = calloc((size_t)np, sizeof *kv);
    int64_t *kk = malloc((size_t)np * sizeof *kk), k = llround(o.ratio * (double)(N - m));
    kvm_sculpt_view *v = malloc((size_t)np * sizeof *v);
    int *idx = malloc((size_t)np * sizeof *idx);
    kvm_sculpt_eval *ev = malloc((size_t)np * sizeof *ev);
    kvm_sculpt_head_stats *st = malloc((size_t)np * sizeof *st);
    float *kc = malloc((size_t)(np * k * (2 * d + 1)) * sizeof *kc), *vc = kc + np * k * d, *beta = vc + np * k * d;
    if (!ps || !pp || !kv || !kk || !v || !idx || !ev || !st || !kc || k < 1) return 1;
    double t0 = bench_wall_s();
    for (int i = 0; i < np; i++) {
        if (synth_problem(&ps[i], &kv[i], d, N, m, group, S, (uint64_t)i + 1)) {
            fprintf(stderr, "bench_solver: synthetic problem %d: %s\n", i, kvm_errmsg());
            return 1;
        }
        pp[i] = &ps[i];
        kk[i] = k;
        idx[i] = i;
        v[i] = (kvm_sculpt_view){.d = d, .scale = ps[i].scale, .nq = ps[i].nq, .nc = ps[i].nc, .q = ps[i].q,
                                 .o_full = ps[i].o_full, .o_ret = ps[i].o_ret, .lse_zone = ps[i].lse_zone,
                                 .lse_ret = ps[i].lse_ret, .n_vis = ps[i].n_vis, .out_ms = ps[i].out_ms};
        memcpy(kc + i * k * d, ps[i].kz, (size_t)(k * d) * sizeof *kc); /* the zone's first k entries */
        memcpy(vc + i * k * d, ps[i].vz, (size_t)(k * d) * sizeof *vc);
    }
    const int64_t nq = ps[0].nq;
    printf("batch,%s,queries,problems,%d,nq,%lld,k,%lld,s,%.2f\n", dev, np, (long long)nq, (long long)k, bench_wall_s() - t0);
    kvm_sculpt_batch *b;
    double ts[64];
    int rc = be->batch_new(be, v, kk, np, o.threads, &b);
    if (!rc) rc = be->upload(b, idx, np, kc, vc, NULL);
    for (int r = 0; !rc && r <= reps; r++) { /* the first call warms up */
        double t1 = bench_wall_s();
        rc = be->lossgrad(b, idx, np, o.lambda, 0, 1, 0, ev);
        if (r) ts[r - 1] = bench_wall_s() - t1;
    }
    if (b) be->batch_free(b);
    if (rc) {
        fprintf(stderr, "bench_solver: %s\n", kvm_errmsg());
        return 1;
    }
    const double med = bench_median(ts, reps);
    const double fl = 8.0 * (double)nq * (double)k * d; /* per problem and evaluation */
    printf("batch,%s,lossgrad,problems,%d,s,%.4f,tflops,%.3f\n", dev, np, med, fl * np / med / 1e12);
    double lb, rg;
    t0 = bench_wall_s();
    if (kvm_sculpt_solve_batch(pp, np, &o, kk, o.rounds, o.lbfgs_iters, be, kc, vc, beta, st, &lb, &rg, NULL)) {
        fprintf(stderr, "bench_solver: %s\n", kvm_errmsg());
        return 1;
    }
    double wall = bench_wall_s() - t0;
    long evals = 0;
    for (int i = 0; i < np; i++) evals += st[i].lbfgs_calls;
    printf("batch,%s,solve,rounds,%d,iters,%d,wall_s,%.2f,lbfgs_s,%.2f,ridge_s,%.2f,evaluations,%ld,"
           "lossgrad_tflops,%.3f\n", dev, o.rounds, o.lbfgs_iters, wall, lb, rg, evals, fl * (double)evals / lb / 1e12);
    for (int i = 0; i < np; i++) {
        kvm_sculpt_problem_free(&ps[i]);
        free(kv[i]);
    }
    free(ps);
    free(pp);
    free(kv);
    free(kk);
    free(v);
    free(idx);
    free(ev);
    free(st);
    free(kc);
    return 0;
}

int main(int argc, char **argv)
{
    const char *dev = arg(argc, argv, "--device", NULL);
    if (dev) {
        openblas_set_num_threads(1);
        kvm_fpmode fm = kvm_fpmode_flush_enter();
        int rc = bench_batch(argc, argv, dev);
        kvm_fpmode_restore(fm);
        return rc;
    }
    const char *model_path = arg(argc, argv, "--model", NULL), *doc_path = arg(argc, argv, "--doc", NULL);
    int64_t ctx = atoll(arg(argc, argv, "--ctx", "384")), cont = atoll(arg(argc, argv, "--cont", "16"));
    int reps = atoi(arg(argc, argv, "--reps", "5"));
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.retain_tokens = atoll(arg(argc, argv, "--retain", "32"));
    o.ratio = atof(arg(argc, argv, "--ratio", "0.3"));
    o.n_synth = atoll(arg(argc, argv, "--S", "2048"));
    char iters_def[16]; /* the solver's defaults unless given */
    snprintf(iters_def, sizeof iters_def, "%d", o.lbfgs_iters);
    o.lbfgs_iters = atoi(arg(argc, argv, "--iters", iters_def));
    o.carry_history = atoi(arg(argc, argv, "--carry-history", o.carry_history ? "1" : "0")); /* liblbfgs never carries */
    o.ridge_f32 = atoi(arg(argc, argv, "--ridge-f32", o.ridge_f32 ? "1" : "0"));
    char gdef[32];
    snprintf(gdef, sizeof gdef, "%.17g", o.lbfgs_gtol);
    o.lbfgs_gtol = atof(arg(argc, argv, "--gradient-tolerance", gdef));
    char rtdef[32];
    snprintf(rtdef, sizeof rtdef, "%.17g", o.round_tolerance);
    o.round_tolerance = atof(arg(argc, argv, "--round-tolerance", rtdef));
    if (!model_path || !doc_path || reps < 1) {
        fprintf(stderr, "usage: see the comment at the top of bench/bench_solver.c\n");
        return 2;
    }
    openblas_set_num_threads(1); /* as kvm_sculpt_compress does: thread CPU time is then the whole cost */
    if (atoi(arg(argc, argv, "--gemm", "1"))) printf("gemm,kvm_sgemm_2048,gflops,%.1f\n", gemm_gflops(2048, reps));
    kvm_model *m;
    kvm_tokenizer *tok;
    if (kvm_cli_open_model("bench_solver", model_path, NULL, 1, &m, &tok)) return 1;
    int64_t n = 0;
    int32_t *ids = read_doc(tok, doc_path, &n);
    kvm_eval_doc *doc;
    if (!ids || n < ctx + cont || kvm_eval_doc_new(m, NULL, ids, ctx + cont, ctx, cont, &doc)) {
        fprintf(stderr, "bench_solver: %s: %s\n", doc_path, ids ? kvm_errmsg() : "unreadable or too short");
        return 1;
    }
    const kvm_model_config *c = &m->cfg;
    const int np = c->n_layers * c->n_kv_heads;
    kvm_sculpt_problem *ps = calloc((size_t)np, sizeof *ps);
    double t0 = bench_clock_s(CLOCK_THREAD_CPUTIME_ID);
    for (int i = 0; i < np; i++)
        if (kvm_sculpt_problem_build(c, kvm_eval_doc_input(doc)->cap, i / c->n_kv_heads, i % c->n_kv_heads,
                                     o.retain_tokens, o.n_synth, cont, o.seed, &ps[i])) {
            fprintf(stderr, "bench_solver: %s\n", kvm_errmsg());
            return 1;
        }
    int64_t k = llround(o.ratio * (double)ps[0].nc);
    printf("queries,problems,%d,cpu_s,%.3f\n", np, bench_clock_s(CLOCK_THREAD_CPUTIME_ID) - t0);
    kvm_fpmode fm = kvm_fpmode_flush_enter();
    bench_loss(&ps[0], k, o.lambda, reps);
    bench_ridge(&ps[0], k, o.ridge_alpha, reps);
    const int nprec = atoi(arg(argc, argv, "--precision-problems", "4")); /* problems spread over the layers */
    for (int i = 0; i < nprec && i < np; i++) bench_ridge_precision(&ps[(int64_t)i * np / nprec], k, o.ridge_alpha);
    kvm_fpmode_restore(fm);
    if (atoi(arg(argc, argv, "--solve", "1"))) bench_solve(ps, np, k, &o);
    for (int i = 0; i < np; i++) kvm_sculpt_problem_free(&ps[i]);
    free(ps);
    kvm_eval_doc_free(&doc);
    free(ids);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return 0;
}
