/* bench_sculpt.c: the KVSculpt experiment of issue 5 on the shared evaluation harness
 * (compress/eval/): per document, context N and continuation T, every variant
 * (method:alloc[:bias]) at every ratio and seed; prints one CSV row per run, then per
 * (seed, ratio) the mean KL / top-1 / seconds per document of each variant and, against the
 * first variant (the baseline), the ratio of mean KLs, the geometric mean of per-document KL
 * ratios and the win count. Timing split (query construction / L-BFGS / ridge) per document.
 *
 *   bench_sculpt --model M --docs DIR --first 5 --last 19 [--ctx 384 --cont 64 --retain 32]
 *                [--ratios 0.1,0.3,0.5,0.7] [--seeds 1,2]
 *                [--variants selectfit:uniform,joint-fixed:uniform,sculpt:uniform,...]
 *                [--S 2048 --rounds 4 --iters 25 --lambda 0.1 --alpha 1e-3 --vcap 1 --kcap 0 --threads 1]
 *                [--carry-history 1 --tolerance 0 --round-tolerance 0.2]   (the convergence settings, as in kvmill sculpt)
 *                [--ridge-f32 1]   (the ridge's normal equations in float32 blocks; 0: float64)
 *                [--gradient-tolerance 0]   (L-BFGS stop |g| <= this * the first round's |g0|; 0: absolute rule)
 *                [--oracle 1]   (keys fitted by liblbfgs, the test oracle, instead of kvmill's L-BFGS)
 *                [--make-model-doc N]   (random-token document of N+T tokens instead of --docs) */
#include "compress/eval/kvm_eval.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "common/kvm_error.h"
#include "orchestrator/kvm_cli_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_V = 16, MAX_R = 8, MAX_S = 4, MAX_D = 64 };

typedef struct variant {
    char name[48];
    kvm_sculpt_mode mode;
    kvm_sculpt_alloc alloc;
    int bias;
} variant;

static const char *arg(int argc, char **argv, const char *name, const char *def)
{
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], name)) return argv[i + 1];
    return def;
}

static int split_doubles(const char *s, double *out, int max)
{
    int n = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *t = strtok(buf, ","); t && n < max; t = strtok(NULL, ",")) out[n++] = atof(t);
    return n;
}

static int parse_variants(const char *s, variant *v, int max)
{
    int n = 0;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t && n < max; t = strtok_r(NULL, ",", &save)) {
        variant *x = &v[n];
        snprintf(x->name, sizeof x->name, "%s", t);
        char tmp[48];
        snprintf(tmp, sizeof tmp, "%s", t);
        char *a = strchr(tmp, ':'), *b = NULL;
        if (a) {
            *a++ = 0;
            if ((b = strchr(a, ':'))) *b++ = 0;
        }
        x->alloc = KVM_SCULPT_ALLOC_UNIFORM;
        x->bias = b && !strcmp(b, "bias");
        if (kvm_sculpt_mode_parse(tmp, &x->mode) || (a && kvm_sculpt_alloc_parse(a, &x->alloc))) {
            fprintf(stderr, "bench_sculpt: %s\n", kvm_errmsg());
            return -1;
        }
        n++;
    }
    return n;
}

typedef struct run {
    double kl, top1, sec, qs, ls, rs, ps;
} run;

static run R[MAX_D][MAX_S][MAX_R][MAX_V];

int main(int argc, char **argv)
{
    const char *model_path = arg(argc, argv, "--model", NULL), *docs = arg(argc, argv, "--docs", NULL);
    int first = atoi(arg(argc, argv, "--first", "5")), last = atoi(arg(argc, argv, "--last", "19"));
    int64_t ctx = atoll(arg(argc, argv, "--ctx", "384")), cont = atoll(arg(argc, argv, "--cont", "64"));
    int64_t mm = atoll(arg(argc, argv, "--make-model-doc", "0"));
    double ratios[MAX_R], seedsd[MAX_S];
    int nr = split_doubles(arg(argc, argv, "--ratios", "0.1,0.3,0.5,0.7"), ratios, MAX_R);
    int ns = split_doubles(arg(argc, argv, "--seeds", "1,2"), seedsd, MAX_S);
    variant V[MAX_V];
    int nv = parse_variants(arg(argc, argv, "--variants", "selectfit:uniform,joint-fixed:uniform,sculpt:uniform"), V, MAX_V);
    kvm_sculpt_opts base = kvm_sculpt_opts_default();
    base.retain_tokens = atoll(arg(argc, argv, "--retain", "32"));
    base.n_synth = atoll(arg(argc, argv, "--S", "2048"));
    base.rounds = atoi(arg(argc, argv, "--rounds", "4"));
    char iters_def[16]; /* the solver's default unless given */
    snprintf(iters_def, sizeof iters_def, "%d", base.lbfgs_iters);
    base.lbfgs_iters = atoi(arg(argc, argv, "--iters", iters_def));
    base.carry_history = atoi(arg(argc, argv, "--carry-history", base.carry_history ? "1" : "0"));
    base.lbfgs_tolerance = atof(arg(argc, argv, "--tolerance", "0"));
    char rtdef[32]; /* the solver's default unless given */
    snprintf(rtdef, sizeof rtdef, "%.17g", base.round_tolerance);
    base.round_tolerance = atof(arg(argc, argv, "--round-tolerance", rtdef));
    base.lambda = atof(arg(argc, argv, "--lambda", "0.1"));
    base.ridge_alpha = atof(arg(argc, argv, "--alpha", "1e-3"));
    base.ridge_f32 = atoi(arg(argc, argv, "--ridge-f32", base.ridge_f32 ? "1" : "0"));
    char gdef[32]; /* the solver's default unless given */
    snprintf(gdef, sizeof gdef, "%.17g", base.lbfgs_gtol);
    base.lbfgs_gtol = atof(arg(argc, argv, "--gradient-tolerance", gdef));
    base.vnorm_cap = atof(arg(argc, argv, "--vcap", "1"));
    base.knorm_cap = atof(arg(argc, argv, "--kcap", "0"));
    base.lse_mass_weight = atoi(arg(argc, argv, "--lse-weight", "0"));
    base.alloc_power = atof(arg(argc, argv, "--power", "0.5"));
    base.threads = atoi(arg(argc, argv, "--threads", "1"));
    base.lbfgs_oracle = atoi(arg(argc, argv, "--oracle", "0")); /* 1: liblbfgs instead of kvmill's L-BFGS */
    base.future_tokens = cont;
    if (!model_path || (!docs && mm <= 0) || nv <= 0 || last - first + 1 > MAX_D) {
        fprintf(stderr, "usage: see the comment at the top of bench/bench_sculpt.c\n");
        return 2;
    }
    kvm_model *m;
    kvm_tokenizer *tok = NULL;
    if (kvm_cli_open_model("bench_sculpt", model_path, NULL, mm <= 0, &m, mm <= 0 ? &tok : NULL)) return 1;
    printf("doc,seed,variant,ratio,kl_mean,top1,seconds,query_s,lbfgs_s,ridge_s,pilot_s,head_mse_min,head_mse_max,"
           "layer_mse_min,layer_mse_max\n");
    int nd = 0;
    for (int di = first; di <= last; di++, nd++) {
        int32_t *ids = NULL;
        int64_t n = 0;
        if (mm > 0) {
            n = ctx + cont;
            ids = malloc((size_t)n * sizeof *ids);
            uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(di + 1);
            ids[0] = m->cfg.bos_id;
            for (int64_t i = 1; i < n; i++) {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                ids[i] = (int32_t)((s >> 33) % (uint64_t)m->cfg.vocab_size);
            }
        } else {
            char path[1024];
            snprintf(path, sizeof path, "%s/doc_%03d.txt", docs, di);
            FILE *f = fopen(path, "rb");
            if (!f) { fprintf(stderr, "bench_sculpt: %s missing\n", path); return 1; }
            char *text = malloc(1 << 20);
            size_t len = fread(text, 1, (1 << 20) - 1, f);
            fclose(f);
            text[len] = 0;
            if (kvm_tokenizer_encode(tok, text, len, 1, 0, &ids, &n)) { fprintf(stderr, "%s\n", kvm_errmsg()); return 1; }
            free(text);
        }
        if (n < ctx + cont) { fprintf(stderr, "bench_sculpt: doc %d has %lld tokens\n", di, (long long)n); return 1; }
        kvm_eval_doc *doc;
        if (kvm_eval_doc_new(m, NULL, ids, ctx + cont, ctx, cont, &doc)) { fprintf(stderr, "%s\n", kvm_errmsg()); return 1; }
        kvm_compress_input in = *kvm_eval_doc_input(doc);
        in.n_future = cont;
        for (int si = 0; si < ns; si++)
            for (int ri = 0; ri < nr; ri++)
                for (int vi = 0; vi < nv; vi++) {
                    kvm_sculpt_opts o = base;
                    o.seed = (uint64_t)seedsd[si];
                    o.ratio = ratios[ri];
                    o.mode = V[vi].mode;
                    o.alloc = V[vi].alloc;
                    o.bias = V[vi].bias;
                    kvm_kvcache *c;
                    kvm_sculpt_stats st;
                    kvm_eval_result r;
                    if (kvm_sculpt_compress(&in, &o, &c, &st) || kvm_eval_continue(doc, c, NULL, NULL, &r)) {
                        fprintf(stderr, "bench_sculpt: doc %d %s: %s\n", di, V[vi].name, kvm_errmsg());
                        return 1;
                    }
                    kvm_kvcache_free(&c);
                    R[nd][si][ri][vi] = (run){r.kl_mean, r.top1, st.base.seconds, st.query_s, st.lbfgs_s, st.ridge_s, st.pilot_s};
                    printf("%d,%d,%s,%.2f,%.6g,%.4f,%.3f,%.3f,%.3f,%.3f,%.3f,%.4g,%.4g,%.4g,%.4g\n", di, (int)o.seed,
                           V[vi].name, o.ratio, r.kl_mean, r.top1, st.base.seconds, st.query_s, st.lbfgs_s, st.ridge_s,
                           st.pilot_s, st.mse_min, st.mse_max, st.layer_mse_min, st.layer_mse_max);
                    fflush(stdout);
                }
        kvm_eval_doc_free(&doc);
        free(ids);
    }
    printf("\n# summary: baseline = %s; ratio = mean KL(baseline)/mean KL(variant), gmean = geometric mean of "
           "per-doc KL ratios, wins = docs where the variant's KL < the baseline's\n", V[0].name);
    printf("seed,ratio,variant,mean_kl,mean_top1,sec_per_doc,query_s,lbfgs_s,ridge_s,kl_ratio,gmean_ratio,wins\n");
    for (int si = 0; si < ns; si++)
        for (int ri = 0; ri < nr; ri++)
            for (int vi = 0; vi < nv; vi++) {
                double kl = 0, kb = 0, t1 = 0, sec = 0, q = 0, l = 0, rr = 0, lg = 0;
                int wins = 0;
                for (int d = 0; d < nd; d++) {
                    run *x = &R[d][si][ri][vi], *b = &R[d][si][ri][0];
                    kl += x->kl / nd;
                    kb += b->kl / nd;
                    t1 += x->top1 / nd;
                    sec += x->sec / nd;
                    q += x->qs / nd;
                    l += x->ls / nd;
                    rr += x->rs / nd;
                    lg += log(fmax(b->kl, 1e-12) / fmax(x->kl, 1e-12)) / nd;
                    wins += x->kl < b->kl;
                }
                printf("%d,%.2f,%s,%.5g,%.4f,%.2f,%.2f,%.2f,%.2f,%.3f,%.3f,%d/%d\n", (int)seedsd[si], ratios[ri], V[vi].name,
                       kl, t1, sec, q, l, rr, kb / kl, exp(lg), wins, nd);
            }
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return 0;
}
