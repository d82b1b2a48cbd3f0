/* check_cuda_sculpt.c: the KVSculpt batch backend on CUDA (kernels/cuda/kvm_cuda_sculpt.cu)
 * against the CPU backend: loss, gradients, ridge normal equations and the value step (batched
 * Cholesky vs LAPACKE) within 1e-4 relative on random problems (head dims 8, 64, 128, ragged k)
 * and on every captured stories260K problem (ragged, and uniform k: one strided-batched run),
 * the batched solver's final objectives within 1% of the CPU's, and end to end (`kvmill eval
 * --device cuda:0`, the path users take, and `kvmill run` with the compress workers on cuda:0)
 * KVSculpt's KL within 5% of the CPU solver's on stories260K. Where no CUDA device is visible
 * (or the build has no CUDA) it prints one "SKIP: no CUDA device" line and passes. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "compress/eval/kvm_eval.h"
#include "common/kvm_error.h"
#include "kernels/kvm_sculpt_kernels.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const kvm_sculpt_backend *gpu;

static uint64_t rng = 777;
static float frand(void) /* uniform in [-1, 1) */
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}

static double rel(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static double reld(const double *a, const double *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static kvm_sculpt_view view_of(const kvm_sculpt_problem *p)
{
    return (kvm_sculpt_view){.d = p->d, .scale = p->scale, .nq = p->nq, .nc = p->nc, .q = p->q, .o_full = p->o_full,
                             .o_ret = p->o_ret, .lse_zone = p->lse_zone, .lse_ret = p->lse_ret, .n_vis = p->n_vis,
                             .out_ms = p->out_ms, .lse_mass_weight = p->lse_mass_weight};
}

/* Both backends on the same batch at random points (β when use_beta), the subset in ascending
 * order (CUDA: runs of equal shapes, strided-batched) or reversed (one problem per run); the
 * worst relative error of loss, gradients, normal equations and the value step (CUDA's batched
 * Cholesky `ridge` vs the host's LAPACKE solve of the CPU's normal equations). */
static double compare(const kvm_sculpt_problem *ps, int n, const int64_t *k, int use_beta, int ascending)
{
    kvm_sculpt_view v[64];
    int idx[64];
    int64_t tot = 0, totA = 0;
    for (int i = 0; i < n; i++) {
        v[i] = view_of(&ps[i]);
        idx[i] = ascending ? i : n - 1 - i; /* any order */
        tot += k[i];
        totA += k[i] * k[i];
    }
    const int d = ps[0].d;
    float *buf = malloc((size_t)(tot * d * 6 + tot * 5) * sizeof *buf);
    float *kc = buf, *vc = kc + tot * d, *gk1 = vc + tot * d, *gk2 = gk1 + tot * d, *beta = gk2 + tot * d;
    float *gb1 = beta + tot, *gb2 = gb1 + tot;
    double *A1 = malloc((size_t)(2 * totA + 2 * tot * d) * sizeof *A1), *A2 = A1 + totA, *B1 = A2 + totA,
           *B2 = B1 + tot * d;
    for (int64_t i = 0; i < tot * d; i++) {
        kc[i] = frand();
        vc[i] = frand();
    }
    for (int64_t i = 0; i < tot; i++) beta[i] = 0.3f * frand();
    const kvm_sculpt_backend *cpu = kvm_sculpt_backend_cpu();
    kvm_sculpt_batch *bc, *bg;
    ck_assert_int_eq(cpu->batch_new(cpu, v, k, n, 1, &bc), 0);
    ck_assert_msg(gpu->batch_new(gpu, v, k, n, 1, &bg) == 0, "%s", kvm_errmsg());
    kvm_sculpt_eval e1[64], e2[64];
    ck_assert_int_eq(cpu->upload(bc, idx, n, kc, vc, beta), 0);
    ck_assert_msg(gpu->upload(bg, idx, n, kc, vc, beta) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(cpu->lossgrad(bc, idx, n, 0.1, use_beta, 1, 1, e1), 0);
    ck_assert_msg(gpu->lossgrad(bg, idx, n, 0.1, use_beta, 1, 1, e2) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(cpu->download_grads(bc, idx, n, gk1, gb1), 0);
    ck_assert_msg(gpu->download_grads(bg, idx, n, gk2, gb2) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(cpu->normal(bc, idx, n, use_beta, A1, B1), 0);
    ck_assert_msg(gpu->normal(bg, idx, n, use_beta, A2, B2) == 0, "%s", kvm_errmsg());
    double worst = 0;
    int64_t off = 0, offA = 0;
    for (int t = 0; t < n; t++) { /* evals are in idx order; slices are packed by problem */
        worst = fmax(worst, fabs(e2[t].loss - e1[t].loss) / fabs(e1[t].loss));
        worst = fmax(worst, fabs(e2[t].mse_sum - e1[t].mse_sum) / fmax(e1[t].mse_sum, 1e-30));
    }
    for (int i = 0; i < n; i++) {
        worst = fmax(worst, rel(gk2 + off * d, gk1 + off * d, k[i] * d));
        worst = fmax(worst, rel(gb2 + off, gb1 + off, k[i]));
        /* A: the CPU writes the upper triangle only */
        double num = 0, den = 0;
        for (int64_t a = 0; a < k[i]; a++)
            for (int64_t c = a; c < k[i]; c++) {
                double x = A1[offA + a * k[i] + c], y = A2[offA + a * k[i] + c];
                num += (x - y) * (x - y);
                den += x * x;
            }
        worst = fmax(worst, sqrt(num / fmax(den, 1e-300)));
        worst = fmax(worst, reld(B2 + off * d, B1 + off * d, k[i] * d));
        off += k[i];
        offA += k[i] * k[i];
    }
    float *v1 = malloc((size_t)(2 * tot * d) * sizeof *v1), *v2 = v1 + tot * d;
    memcpy(v1, vc, (size_t)(tot * d) * sizeof *vc);
    memcpy(v2, vc, (size_t)(tot * d) * sizeof *vc);
    int rcs[64];
    double cap[64];
    for (int t = 0; t < n; t++) cap[t] = ps[idx[t]].vnorm_max; /* vcap = 1 */
    ck_assert_msg(gpu->ridge(bg, idx, n, use_beta, 1e-3, cap, v2, rcs) == 0, "%s", kvm_errmsg());
    off = offA = 0;
    for (int i = 0; i < n; i++) {
        int rc = kvm_sculpt_ridge_solve(&ps[i], A1 + offA, B1 + off * d, k[i], 1e-3, 1.0, v1 + off * d);
        ck_assert_int_eq(rcs[ascending ? i : n - 1 - i], rc);
        worst = fmax(worst, rel(v2 + off * d, v1 + off * d, k[i] * d));
        off += k[i];
        offA += k[i] * k[i];
    }
    free(v1);
    cpu->batch_free(bc);
    gpu->batch_free(bg);
    free(buf);
    free(A1);
    return worst;
}

/* A random problem: head dim d, nc zone, m retain, nq queries. */
static void toy(kvm_sculpt_problem *p, float **kz, int d, int64_t nc, int64_t m, int64_t nq)
{
    memset(p, 0, sizeof *p);
    *kz = malloc((size_t)((nc + m) * d * 2) * sizeof **kz);
    float *vz = *kz + (nc + m) * d;
    for (int64_t i = 0; i < (nc + m) * d; i++) {
        (*kz)[i] = 1.5f * frand();
        vz[i] = frand();
    }
    p->d = d;
    p->scale = 1.0f / sqrtf((float)d);
    p->nc = nc;
    p->m = m;
    p->kz = *kz;
    p->vz = vz;
    p->kr = *kz + nc * d;
    p->vr = vz + nc * d;
    p->nq = nq;
    p->nq_real = nq / 2;
    p->q = malloc((size_t)(nq * d) * sizeof *p->q);
    p->n_vis = malloc((size_t)nq * sizeof *p->n_vis);
    for (int64_t i = 0; i < nq * d; i++) p->q[i] = 2.0f * frand();
    for (int64_t i = 0; i < nq; i++) p->n_vis[i] = m > 0 ? i % (m + 1) : 0;
    ck_assert_int_eq(kvm_sculpt_problem_prepare(p), 0);
}

START_TEST(test_random)
{
    const int dims[3] = {8, 64, 128};
    for (int di = 0; di < 3; di++) {
        kvm_sculpt_problem ps[4];
        float *kz[4];
        int64_t k[4];
        for (int i = 0; i < 4; i++) {
            toy(&ps[i], &kz[i], dims[di], 60 + 40 * i, i % 2 ? 16 : 0, 150 + 97 * i);
            k[i] = 1 + 17 * i; /* ragged, from 1 */
        }
        double e0 = compare(ps, 4, k, 0, 0), e1 = compare(ps, 4, k, 1, 1);
        printf("cuda vs cpu, random problems, d = %d: worst relative error %.3g (no β), %.3g (β)\n", dims[di], e0, e1);
        ck_assert_double_lt(e0, 1e-4);
        ck_assert_double_lt(e1, 1e-4);
        for (int i = 0; i < 4; i++) {
            kvm_sculpt_problem_free(&ps[i]);
            free(kz[i]);
        }
    }
}
END_TEST

static kvm_model *model;
static int32_t ids[256];

/* Every (layer, KV head) problem of a stories260K context; the caller frees them. */
static int real_problems(kvm_eval_doc **doc, kvm_sculpt_problem *ps)
{
    ck_assert_int_eq(kvm_model_open(kvm_test_data_path("models/stories260K.bin"), &model), 0);
    kvm_test_golden_ids(ids);
    ck_assert_int_eq(kvm_eval_doc_new(model, NULL, ids, 128, 96, 32, doc), 0);
    const kvm_model_config *c = &model->cfg;
    const int np = c->n_layers * c->n_kv_heads;
    for (int i = 0; i < np; i++)
        ck_assert_int_eq(kvm_sculpt_problem_build(c, kvm_eval_doc_input(*doc)->cap, i / c->n_kv_heads,
                                                  i % c->n_kv_heads, 16, 256, 32, 3, &ps[i]), 0);
    return np;
}

START_TEST(test_real)
{
    kvm_eval_doc *doc;
    kvm_sculpt_problem ps[64];
    const int np = real_problems(&doc, ps);
    int64_t k[64];
    for (int i = 0; i < np; i++) k[i] = 1 + (i * 7) % ps[i].nc;
    double e = fmax(compare(ps, np, k, 0, 0), compare(ps, np, k, 1, 1));
    for (int i = 0; i < np; i++) k[i] = 24; /* uniform: the whole batch is one strided-batched run */
    e = fmax(e, fmax(compare(ps, np, k, 0, 1), compare(ps, np, k, 1, 1)));
    printf("cuda vs cpu, %d real stories260K problems: worst relative error %.3g\n", np, e);
    ck_assert_double_lt(e, 1e-4);
    for (int i = 0; i < np; i++) kvm_sculpt_problem_free(&ps[i]);
    kvm_eval_doc_free(&doc);
    kvm_model_close(&model);
}
END_TEST

/* The batched solver on both backends: final objectives per problem within 1% (median). */
START_TEST(test_solve)
{
    kvm_eval_doc *doc;
    kvm_sculpt_problem ps[64];
    const int np = real_problems(&doc, ps);
    const kvm_sculpt_problem *pp[64];
    int64_t k[64], tot = 0;
    for (int i = 0; i < np; i++) {
        pp[i] = &ps[i];
        k[i] = 24;
        tot += k[i];
    }
    kvm_sculpt_opts o = kvm_sculpt_opts_default();
    o.rounds = 2;
    o.lbfgs_iters = 30;
    const int d = ps[0].d;
    float *kc = malloc((size_t)(tot * (2 * d + 1)) * sizeof *kc), *vc = kc + tot * d, *beta = vc + tot * d;
    kvm_sculpt_head_stats s1[64], s2[64];
    double lb, rg, ratio[64];
    ck_assert_int_eq(kvm_sculpt_solve_batch(pp, np, &o, k, o.rounds, o.lbfgs_iters, NULL, kc, vc, beta, s1, &lb, &rg, NULL),
                     0);
    ck_assert_msg(kvm_sculpt_solve_batch(pp, np, &o, k, o.rounds, o.lbfgs_iters, gpu, kc, vc, beta, s2, &lb, &rg, NULL) == 0,
                  "%s", kvm_errmsg());
    for (int i = 0; i < np; i++) ratio[i] = s2[i].loss / s1[i].loss;
    for (int a = 0; a < np; a++)
        for (int b = a + 1; b < np; b++)
            if (ratio[b] < ratio[a]) {
                double t = ratio[a];
                ratio[a] = ratio[b];
                ratio[b] = t;
            }
    double med = np % 2 ? ratio[np / 2] : 0.5 * (ratio[np / 2 - 1] + ratio[np / 2]);
    printf("batched solver, cuda / cpu final objective over %d problems: median %.4f (min %.4f, max %.4f)\n", np, med,
           ratio[0], ratio[np - 1]);
    ck_assert_double_lt(fabs(med - 1), 0.01);
    free(kc);
    for (int i = 0; i < np; i++) kvm_sculpt_problem_free(&ps[i]);
    kvm_eval_doc_free(&doc);
    kvm_model_close(&model);
}
END_TEST

/* Mean kl_mean of the rows of an eval CSV (KVM_EVAL_CSV_HEADER: the fifth column). */
static double csv_kl(const char *path, int *rows)
{
    size_t len;
    char *text = kvm_test_read_file(path, &len);
    ck_assert_msg(text != NULL, "cannot read %s", path);
    double sum = 0;
    *rows = 0;
    for (char *line = strchr(text, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        const char *f = line + 1;
        for (int c = 0; c < 4 && f; c++) f = strchr(f, ',') ? strchr(f, ',') + 1 : NULL;
        ck_assert_ptr_nonnull(f);
        sum += strtod(f, NULL);
        ++*rows;
    }
    free(text);
    return *rows ? sum / *rows : 0;
}

/* End to end: `kvmill eval --device cuda:0` (solver on the GPU, prefill and scoring on the CPU,
 * said on stderr) gives KVSculpt's KL within 5% of `--device cpu` on two stories260K documents
 * (issue 12's test), and `kvmill sculpt --device cuda:0` writes a cache. */
START_TEST(test_end_to_end)
{
    char *dir = kvm_test_tmpdir(), csv[2][4200], cmd[16384], docs[8400], *out, *err;
    snprintf(docs, sizeof docs, "%s,", kvm_test_data_path("corpus/doc_005.txt"));
    snprintf(docs + strlen(docs), sizeof docs - strlen(docs), "%s", kvm_test_data_path("corpus/doc_004.txt"));
    const char *dev[2] = {"cpu", "cuda:0"};
    double kl[2];
    for (int i = 0; i < 2; i++) {
        snprintf(csv[i], sizeof csv[i], "%s/%s.csv", dir, i ? "cuda" : "cpu");
        snprintf(cmd, sizeof cmd, "'%s/kvmill' eval --model '%s' --docs '%s' --ratio 0.3 --method sculpt --device %s "
                 "--csv '%s'", kvm_test_bin(), kvm_test_data_path("models/stories260K.bin"), docs, dev[i], csv[i]);
        int rc = kvm_test_run(cmd, &out, &err);
        ck_assert_msg(rc == 0, "--device %s: exit %d: %s", dev[i], rc, err);
        if (i) ck_assert_msg(strstr(err, "run on the CPU") && strstr(err, "solver on cuda:0"), "stderr: %s", err);
        int rows;
        kl[i] = csv_kl(csv[i], &rows);
        ck_assert_int_eq(rows, 2);
        free(out);
        free(err);
    }
    printf("kvmill eval --method sculpt --ratio 0.3, 2 documents: KL cpu %.6f, cuda:0 %.6f (ratio %.4f)\n", kl[0], kl[1],
           kl[1] / kl[0]);
    ck_assert_double_gt(kl[0], 0);
    ck_assert_double_lt(fabs(kl[1] / kl[0] - 1), 0.05);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' sculpt --model '%s' --doc '%s' --device cuda:0 --out '%s/c.kvs'", kvm_test_bin(),
             kvm_test_data_path("models/stories260K.bin"), kvm_test_data_path("corpus/doc_005.txt"), dir);
    int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0 && strstr(out, "sculpt: N="), "exit %d: %s", rc, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* The pipeline: `kvmill run` with [stages] compress_devices = cuda:0 (the compress workers'
 * KVSculpt solvers on the GPU, the prefill on the CPU) stores caches whose mean KL ([eval]
 * enabled, the summary's figure) is within 5% of a run with compress_devices = cpu (issue 13's
 * end-to-end sculpt test), on data/corpus's six documents. */
static double run_kl(const char *dir, const char *device)
{
    char cfg[4300], text[12000], cmd[16384], *out, *err;
    const char *tag = kvm_test_device_tag(device); /* cuda0: no ':' in the run directory's ipc:// paths */
    snprintf(cfg, sizeof cfg, "%s/%s.ini", dir, tag);
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 128\n[compress]\nmethod = sculpt\nratio = 0.3\n[eval]\nenabled = true\n"
             "continuation = 32\n[store]\npath = %s/store-%s\n[run]\nrun_dir = %s/run-%s\n[stages]\nbin_dir = %s\n"
             "compress_devices = %s\n",
             kvm_test_data_path("models/stories260K.bin"), dir, tag, dir, tag, kvm_test_bin(), device);
    ck_assert_int_eq(kvm_test_write_file(cfg, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' run --config '%s' --corpus '%s'", kvm_test_bin(), cfg,
             kvm_test_data_path("corpus"));
    const int rc = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(rc == 0, "compress_devices = %s: exit %d: %s", device, rc, err);
    const char *key = "evaluation: mean KL(full || compressed) ", *line = strstr(out, key);
    ck_assert_msg(line, "stdout: %s", out);
    const double kl = strtod(line + strlen(key), NULL);
    free(out);
    free(err);
    return kl;
}

START_TEST(test_pipeline)
{
    char *dir = kvm_test_tmpdir();
    const double cpu = run_kl(dir, "cpu"), cuda = run_kl(dir, "cuda:0");
    printf("kvmill run, sculpt r = 0.3, compress_devices cpu / cuda:0: mean KL %.6f / %.6f (ratio %.4f)\n", cpu, cuda,
           cuda / cpu);
    ck_assert_double_gt(cpu, 0);
    ck_assert_double_lt(fabs(cuda / cpu - 1), 0.05);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cuda_sculpt");
    TCase *tc = tcase_create("cuda");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_random);
    tcase_add_test(tc, test_real);
    tcase_add_test(tc, test_solve);
    tcase_add_test(tc, test_end_to_end);
    tcase_add_test(tc, test_pipeline);
    suite_add_tcase(s, tc);
    return s;
}

/* Without a device: asking for one is refused with a status and a message naming it (the
 * only check that can run here), and the suite says it skipped the rest. */
START_TEST(test_no_device)
{
    ck_assert_ptr_null(kvm_sculpt_backend_cuda(0));
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "cuda:0"));
    ck_assert_ptr_null(kvm_sculpt_backend_cuda(-1));
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "cuda:-1"));
    double tf = 1;
    int rc = kvm_cuda_sgemm_ceiling(0, 64, 1, &tf);
    ck_assert(rc == KVM_EDEVICE || rc == KVM_ENOTSUP);
    ck_assert(tf == 0);
}
END_TEST

int main(void)
{
    if (!(gpu = kvm_sculpt_backend_cuda(0))) {
        fprintf(stderr, "check_cuda_sculpt: %s\n", kvm_errmsg());
        printf("SKIP: no CUDA device\n");
        Suite *s = suite_create("cuda_sculpt");
        TCase *tc = tcase_create("no_device");
        tcase_add_test(tc, test_no_device);
        suite_add_tcase(s, tc);
        return kvm_test_run_suite(s);
    }
    return kvm_test_run_suite(suite());
}
