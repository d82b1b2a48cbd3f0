/* kvm_cpu_sculpt_batch.c: the KVSculpt batched solver's CPU backend (kernels/kvm_sculpt_kernels.h,
 * issue 12): a batch of (layer, KV head) problems whose loss, gradient and ridge normal equations
 * are evaluated for any subset in one call, one problem per task of the CPU thread pool (the
 * normal equations of one problem: kvm_cpu_sculpt_normal.c). */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_pool.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The batch: the caller's views (host memory is this backend's memory) and packed entries. */
struct kvm_sculpt_batch {
    int n, d, threads;
    kvm_sculpt_view *views;    /* [n] (copies of the structs; arrays borrowed) */
    int64_t *k, *off, *offA;   /* [n] entries, entry offset, A offset (Σ k_j²) */
    float *kc, *vc, *beta;     /* [Σk][d], [Σk][d], [Σk] */
    float *gk, *gb;            /* [Σk][d], [Σk] */
    float *qt;                 /* Qᵀ of every problem, [d][nq_i] each (built once, not per evaluation) */
    kvm_cpu_sculpt_scratch **ws; /* [threads] the loss kernel's buffers, one per worker, kept across calls */
};

static void cpu_batch_free(kvm_sculpt_batch *b)
{
    if (!b) return;
    free(b->views);
    free(b->k);
    free(b->off);
    free(b->offA);
    free(b->kc);
    free(b->vc);
    free(b->beta);
    free(b->gk);
    free(b->gb);
    free(b->qt);
    for (int t = 0; b->ws && t < b->threads; t++) kvm_cpu_sculpt_scratch_free(b->ws[t]);
    free(b->ws);
    free(b);
}

static int cpu_batch_new(const kvm_sculpt_backend *be, const kvm_sculpt_view *views, const int64_t *k, int n, int threads, kvm_sculpt_batch **out)
{
    (void)be;
    *out = NULL;
    if (n < 1 || threads < 1) return kvm_err(KVM_EINVAL, "sculpt batch: %d problems, %d threads", n, threads);
    const int d = views[0].d;
    int64_t tot = 0, totq = 0;
    for (int i = 0; i < n; i++) {
        totq += views[i].nq * d;
        if (views[i].d != d || d < 1 || d > 512)
            return kvm_err(KVM_EINVAL, "sculpt batch: problem %d has head dim %d (problem 0: %d; at most 512)", i,
                           views[i].d, d);
        if (k[i] < 1) return kvm_err(KVM_EINVAL, "sculpt batch: problem %d has k = %lld (needs ≥ 1)", i, (long long)k[i]);
        tot += k[i];
    }
    kvm_sculpt_batch *b = calloc(1, sizeof *b);
    if (!b) return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
    b->n = n;
    b->d = d;
    b->threads = threads;
    b->views = malloc((size_t)n * sizeof *b->views);
    b->k = malloc((size_t)n * sizeof *b->k);
    b->off = malloc((size_t)n * sizeof *b->off);
    b->offA = malloc((size_t)n * sizeof *b->offA);
    b->kc = malloc((size_t)(tot * d) * sizeof *b->kc);
    b->vc = malloc((size_t)(tot * d) * sizeof *b->vc);
    b->beta = calloc((size_t)tot, sizeof *b->beta);
    b->gk = malloc((size_t)(tot * d) * sizeof *b->gk);
    b->gb = malloc((size_t)tot * sizeof *b->gb);
    b->qt = malloc((size_t)(totq > 0 ? totq : 1) * sizeof *b->qt);
    b->ws = calloc((size_t)threads, sizeof *b->ws);
    for (int t = 0; b->ws && t < threads; t++)
        if (!(b->ws[t] = kvm_cpu_sculpt_scratch_new())) {
            for (int u = 0; u < t; u++) kvm_cpu_sculpt_scratch_free(b->ws[u]);
            free(b->ws);
            b->ws = NULL;
            break;
        }
    if (!b->views || !b->k || !b->off || !b->offA || !b->kc || !b->vc || !b->beta || !b->gk || !b->gb || !b->qt ||
        !b->ws) {
        cpu_batch_free(b);
        return kvm_err(KVM_ENOMEM, "sculpt batch: out of memory (%d problems, %lld entries)", n, (long long)tot);
    }
    memcpy(b->views, views, (size_t)n * sizeof *views);
    float *qt = b->qt;
    for (int i = 0; i < n; i++) { /* the same transpose the kernel would make per call */
        const kvm_sculpt_view *v = &views[i];
        if (v->qt) continue;
        for (int64_t q = 0; q < v->nq; q++)
            for (int t = 0; t < d; t++) qt[t * v->nq + q] = v->q[q * d + t];
        b->views[i].qt = qt;
        qt += v->nq * d;
    }
    int64_t o = 0, oa = 0;
    for (int i = 0; i < n; i++) {
        b->k[i] = k[i];
        b->off[i] = o;
        b->offA[i] = oa;
        o += k[i];
        oa += k[i] * k[i];
    }
    *out = b;
    return 0;
}

static int check_idx(const kvm_sculpt_batch *b, const int *idx, int n_idx)
{
    for (int t = 0; t < n_idx; t++)
        if (idx[t] < 0 || idx[t] >= b->n)
            return kvm_err(KVM_EINVAL, "sculpt batch: problem index %d not in [0, %d)", idx[t], b->n);
    return 0;
}

/* dst slice of problem i ← src slice (per entry `w` floats), both packed; src NULL: nothing. */
static void copy_slices(const kvm_sculpt_batch *b, const int *idx, int n_idx, int w, float *dst, const float *src)
{
    if (!src || !dst) return;
    for (int t = 0; t < n_idx; t++) {
        const int i = idx[t];
        memcpy(dst + b->off[i] * w, src + b->off[i] * w, (size_t)(b->k[i] * w) * sizeof *dst);
    }
}

static int cpu_upload(kvm_sculpt_batch *b, const int *idx, int n_idx, const float *kc, const float *vc,
                      const float *beta)
{
    int rc = check_idx(b, idx, n_idx);
    if (rc) return rc;
    copy_slices(b, idx, n_idx, b->d, b->kc, kc);
    copy_slices(b, idx, n_idx, b->d, b->vc, vc);
    copy_slices(b, idx, n_idx, 1, b->beta, beta);
    return 0;
}

static int cpu_download_grads(kvm_sculpt_batch *b, const int *idx, int n_idx, float *gk, float *gb)
{
    int rc = check_idx(b, idx, n_idx);
    if (rc) return rc;
    copy_slices(b, idx, n_idx, b->d, gk, b->gk);
    copy_slices(b, idx, n_idx, 1, gb, b->gb);
    return 0;
}

/* One call over a subset: what each task does and where it reports. */
typedef struct call {
    kvm_sculpt_batch *b;
    const int *idx;
    double lambda;
    int use_beta, want_gk, want_gb;
    kvm_sculpt_eval *evals;
    double *A, *B;
    int *rc;           /* [n_idx] status per task */
    char (*msg)[200];  /* [n_idx] its message */
} call;

static void lossgrad_task(void *ctx, int64_t t, int worker)
{
    call *c = ctx;
    const kvm_sculpt_batch *b = c->b;
    const int i = c->idx[t], d = b->d;
    const int64_t o = b->off[i];
    kvm_cpu_sculpt_scratch *ws = worker >= 0 && worker < b->threads ? b->ws[worker] : NULL;
    c->rc[t] = kvm_cpu_sculpt_lossgrad_ws(ws, &b->views[i], b->kc + o * d, b->vc + o * d,
                                          c->use_beta ? b->beta + o : NULL, b->k[i], c->lambda,
                                          c->want_gk ? b->gk + o * d : NULL, c->want_gb ? b->gb + o : NULL,
                                          &c->evals[t]);
    if (c->rc[t]) snprintf(c->msg[t], sizeof c->msg[t], "%s", kvm_errmsg());
}

static void normal_task(void *ctx, int64_t t, int worker)
{
    (void)worker;
    call *c = ctx;
    const kvm_sculpt_batch *b = c->b;
    const int i = c->idx[t], d = b->d;
    const int64_t o = b->off[i];
    c->rc[t] = kvm_cpu_sculpt_normal(&b->views[i], b->kc + o * d, c->use_beta ? b->beta + o : NULL, b->k[i],
                                     c->A + b->offA[i], c->B + o * d);
    if (c->rc[t]) snprintf(c->msg[t], sizeof c->msg[t], "%s", kvm_errmsg());
}

/* Runs fn over the subset on the batch's threads; returns the first failing task's status. */
static int run_call(call *c, int n_idx, kvm_cpu_task_fn fn)
{
    int rc = check_idx(c->b, c->idx, n_idx);
    if (rc || n_idx == 0) return rc;
    c->rc = calloc((size_t)n_idx, sizeof *c->rc);
    c->msg = calloc((size_t)n_idx, sizeof *c->msg);
    if (!c->rc || !c->msg) rc = kvm_err(KVM_ENOMEM, "sculpt batch: out of memory");
    if (!rc) kvm__cpu_parallel_for_n(c->b->threads, n_idx, fn, c);
    for (int t = 0; !rc && t < n_idx; t++)
        if (c->rc[t]) rc = kvm_err(c->rc[t], "sculpt batch, problem %d: %s", c->idx[t], c->msg[t]);
    free(c->rc);
    free(c->msg);
    return rc;
}

static int cpu_lossgrad(kvm_sculpt_batch *b, const int *idx, int n_idx, double lambda, int use_beta, int want_gk,
                        int want_gb, kvm_sculpt_eval *evals)
{
    call c = {.b = b, .idx = idx, .lambda = lambda, .use_beta = use_beta, .want_gk = want_gk, .want_gb = want_gb,
              .evals = evals};
    return run_call(&c, n_idx, lossgrad_task);
}

static int cpu_normal(kvm_sculpt_batch *b, const int *idx, int n_idx, int use_beta, double *A, double *B)
{
    call c = {.b = b, .idx = idx, .use_beta = use_beta, .A = A, .B = B};
    return run_call(&c, n_idx, normal_task);
}

static const kvm_sculpt_backend cpu_backend = {
    .name = "cpu",
    .device = -1,
    .batch_new = cpu_batch_new,
    .batch_free = cpu_batch_free,
    .upload = cpu_upload,
    .lossgrad = cpu_lossgrad,
    .download_grads = cpu_download_grads,
    .normal = cpu_normal,
};

const kvm_sculpt_backend *kvm_sculpt_backend_cpu(void) { return &cpu_backend; }

#ifndef KVM_WITH_CUDA
const kvm_sculpt_backend *kvm_sculpt_backend_cuda(int device)
{
    kvm_err(KVM_ENOTSUP, "cuda:%d: this build has no CUDA (built with CUDA=0 or without nvcc)", device);
    return NULL;
}

int kvm_cuda_sgemm_ceiling(int device, int n, int reps, double *tflops)
{
    (void)n;
    (void)reps;
    *tflops = 0;
    return kvm_err(KVM_ENOTSUP, "cuda:%d: this build has no CUDA (built with CUDA=0 or without nvcc)", device);
}
#endif
