/* kvm_polykv_search.c: the strategy builder's candidate search: every heterogeneous
 * strategy (selection mode × allocation mode) and every single pattern under every
 * allocation mode, scored by mean KL(full ‖ compressed) on the calibration documents; the
 * best is kept (a heterogeneous mix only when it beats the best single pattern beyond
 * noise), so the result is never worse there than any single-pattern candidate. */
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "common/kvm_number.h"
#include "compress/polykv/kvm_polykv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static kvm_sculpt_opts score_sculpt;
static int score_sculpt_set;
static const char *dump_dir; /* kvm_polykv_build_dump_dir */
static int dump_model_known; /* ... and the model id its candidates record */
static uint8_t dump_model[KVM_STRATEGY_MODEL_ID_BYTES];

void kvm_polykv_build_dump_dir(const char *dir, const uint8_t *model_id)
{
    dump_dir = dir;
    dump_model_known = model_id != NULL;
    if (model_id) memcpy(dump_model, model_id, sizeof dump_model);
}

void kvm_polykv_score_sculpt_opts(const kvm_sculpt_opts *o)
{
    score_sculpt_set = o != NULL;
    if (o) score_sculpt = *o;
}

/* Records in candidate s the options its distilled layers are scored with (KVST v2 carries
 * them to every reader of the file). */
static void stamp(kvm_strategy *s)
{
    s->sculpt = score_sculpt_set ? score_sculpt : kvm_sculpt_opts_default();
    s->sculpt_known = 1;
}

int kvm_polykv_score(kvm_eval_doc *const *docs, int n_docs, const kvm_strategy *s, double *per_doc, double *kl_mean)
{
    void *opts = NULL;
    kvm_budget b = {.tokens = s->budget_avg};
    int rc = kvm_polykv_method_opts_from(s, &b, &opts);
    if (!rc && score_sculpt_set) kvm_polykv_method_set_sculpt(opts, &score_sculpt);
    double sum = 0;
    const kvm_method m = {.name = "polykv", .compress = kvm_polykv_method_compress};
    for (int i = 0; !rc && i < n_docs; i++) {
        kvm_eval_result r;
        rc = kvm_eval_run(docs[i], &m, opts, 0, &r);
        sum += r.kl_mean;
        if (per_doc) per_doc[i] = r.kl_mean;
    }
    kvm_polykv_method_opts_free(opts);
    if (!rc) *kl_mean = sum / n_docs;
    return rc;
}

/* Paired t statistic of a[i] − b[i] (how much larger a is than b); +inf when every
 * difference is equal and positive, 0 when n < 2 or all differences are 0. */
static double paired_t(const double *a, const double *b, int n)
{
    if (n < 2) return 0.0;
    double m = 0, v = 0;
    for (int i = 0; i < n; i++)
        m += a[i] - b[i];
    m /= n;
    for (int i = 0; i < n; i++)
        v += (a[i] - b[i] - m) * (a[i] - b[i] - m);
    double se = sqrt(v / (n - 1) / n);
    if (se == 0) return m > 0 ? INFINITY : 0.0;
    return m / se;
}

double kvm_polykv_t_crit(int nu)
{
    if (nu < 1) return INFINITY;
    /* exact quantiles for few documents, where the expansion below is off (2.96 at nu = 1, exact
     * 3.078: a 2-document calibration printed and tested the wrong critical value); from 31 on it
     * agrees with the exact value to 1e-7 */
    static const double exact[30] = {3.077684, 1.885618, 1.637744, 1.533206, 1.475884, 1.439756, 1.414924, 1.396815,
                                     1.383029, 1.372184, 1.363430, 1.356217, 1.350171, 1.345030, 1.340606, 1.336757,
                                     1.333379, 1.330391, 1.327728, 1.325341, 1.323188, 1.321237, 1.319460, 1.317836,
                                     1.316345, 1.314972, 1.313703, 1.312527, 1.311434, 1.310415};
    if (nu <= 30) return exact[nu - 1];
    const double z = 1.2815515655446004, z2 = z * z, n = (double)nu; /* the normal's 90th percentile */
    const double g1 = (z2 * z + z) / 4, g2 = (5 * z2 * z2 * z + 16 * z2 * z + 3 * z) / 96,
                 g3 = (3 * z2 * z2 * z2 * z + 19 * z2 * z2 * z + 17 * z2 * z - 15 * z) / 384;
    return z + g1 / n + g2 / (n * n) + g3 / (n * n * n);
}

int kvm_polykv_mix_significant(const double *single_kl, const double *mix_kl, int n, double *t)
{
    *t = paired_t(single_kl, mix_kl, n);
    return n >= 2 && *t >= kvm_polykv_t_crit(n - 1);
}

/* One candidate of the builder's search: selection, single pattern (SINGLE only), allocation,
 * index into powers[], head split. */
typedef struct candidate {
    int sel, pat, al, pw, hs;
} candidate;

static const double powers[] = {1.0}; /* signal exponents tried by the entropy and ppl allocations */

enum { CANDIDATES_MAX = 256 };

/* Every candidate the builder scores, in its order, into c[CANDIDATES_MAX]; returns the count. */
static int candidates(int sel_only, int alloc_only, int has_sculpt, int has_kvzip, candidate *c)
{
    int n = 0;
    for (int sel = 0; sel < KVM_POLYKV_SELECT_SEARCH; sel++) {
        if (sel_only >= 0 && sel != sel_only) continue;
        int n_single = sel != KVM_POLYKV_SELECT_SINGLE ? 1 : KVM_PATTERN_STRATEGY_COUNT;
        for (int pat = 0; pat < n_single; pat++)
            for (int al = 0; al < KVM_POLYKV_ALLOC_SEARCH; al++) {
                if ((pat == KVM_PATTERN_SCULPT && !has_sculpt) || (pat == KVM_PATTERN_KVZIP && !has_kvzip))
                    continue; /* distilled patterns only when their signals were measured */
                if (alloc_only >= 0 && al != alloc_only) continue;
                /* PyramidKV is SnapKV's selection under the pyramid schedule: only that pairing. */
                int pyr = sel == KVM_POLYKV_SELECT_SINGLE && pat == KVM_PATTERN_PYRAMIDKV;
                if (pyr != (al == KVM_POLYKV_ALLOC_PYRAMID)) continue;
                int np = al == KVM_POLYKV_ALLOC_ENTROPY || al == KVM_POLYKV_ALLOC_PPL
                             ? (int)(sizeof powers / sizeof powers[0])
                             : 1;
                for (int pw = 0; pw < np; pw++)
                    for (int hs = 0; hs <= 2; hs++) {
                        if (hs == 2 && al != KVM_POLYKV_ALLOC_UNIFORM)
                            continue; /* global split ignores the layer split */
                        if (n < CANDIDATES_MAX) c[n++] = (candidate){sel, pat, al, pw, hs};
                    }
            }
    }
    return n;
}

/* Names a candidate in buf: "cosine/entropy", "snapkv/uniform", ... (what the strategy built from
 * it is described as: pattern, allocation, power when not 1, head split). */
static void name_of(int sel, int pat, int al, double power, int hs, char *buf, size_t n)
{
    if (sel == KVM_POLYKV_SELECT_SINGLE)
        snprintf(buf, n, "%s/%s", kvm_pattern_name((kvm_pattern)pat), kvm_polykv_alloc_name((kvm_polykv_alloc)al));
    else
        snprintf(buf, n, "%s/%s", kvm_polykv_select_name((kvm_polykv_select)sel),
                 kvm_polykv_alloc_name((kvm_polykv_alloc)al));
    if (power != 1.0) snprintf(buf + strlen(buf), n - strlen(buf), "^%g", power);
    if (hs) snprintf(buf + strlen(buf), n - strlen(buf), "%s", hs == 2 ? "+global" : "+heads");
}

/* Describes a candidate in buf: "cosine/entropy", "snapkv/uniform", ... */
static void describe(const kvm_strategy *s, char *buf, size_t n)
{
    name_of((int)s->select, (int)s->layers[0].pattern[0], (int)s->alloc, s->alloc_power, s->head_split, buf, n);
}

/* NAME.bin of a candidate called name: '/', '+' and '^' as '_'. */
static void file_name(const char *name, char *buf, size_t n)
{
    snprintf(buf, n, "%s.bin", name);
    for (char *c = buf; *c; c++)
        if (*c == '/' || *c == '+' || *c == '^') *c = '_';
}

int kvm_polykv_candidate_file(int i, int sel_only, int alloc_only, int has_sculpt, int has_kvzip, char *buf, size_t n)
{
    candidate c[CANDIDATES_MAX];
    if (i < 0 || i >= candidates(sel_only, alloc_only, has_sculpt, has_kvzip, c)) return 0;
    const candidate *k = &c[i];
    const int powered = k->al == KVM_POLYKV_ALLOC_ENTROPY || k->al == KVM_POLYKV_ALLOC_PPL; /* as the build records */
    char name[64];
    name_of(k->sel, k->pat, k->al, powered ? powers[k->pw] : 1.0, k->hs, name, sizeof name);
    file_name(name, buf, n);
    return 1;
}

/* Writes candidate s as dump_dir/NAME.bin (file_name); an existing file there that is read-only
 * (no write permission, or no write bit: root may write any file) is refused, not replaced. */
static int dump_candidate(const kvm_strategy *s, const char *name)
{
    char file[96], path[4096];
    file_name(name, file, sizeof file);
    int n = snprintf(path, sizeof path, "%s/%s", dump_dir, file);
    if (n < 0 || (size_t)n >= sizeof path) return kvm_err(KVM_EINVAL, "polykv: candidate path under '%s' too long", dump_dir);
    struct stat st;
    if (!stat(path, &st) && (!S_ISREG(st.st_mode) || !kvm_file_replaceable(path, &st)))
        return kvm_err(KVM_EINVAL, "polykv: candidate file %s exists and is %s: not replaced", path,
                       S_ISREG(st.st_mode) ? "read-only" : "not a regular file");
    kvm_strategy file_s = *s; /* a shallow copy (the layers shared) to record the model in */
    if (dump_model_known) kvm_strategy_set_model(&file_s, dump_model);
    return kvm_strategy_write(&file_s, path);
}

static void print_budgets(const kvm_strategy *s, FILE *f)
{
    for (int l = 0; l < s->n_layers; l++)
        fprintf(f, "%s%s:%lld", l ? " " : "", kvm_pattern_name(s->layers[l].pattern[0]),
                (long long)s->layers[l].budget);
}

int kvm_polykv_build_best(kvm_eval_doc *const *docs, int n_docs, const kvm_polykv_signals *sig, int64_t B,
                          int64_t b_min, int sel_only, int alloc_only, int refine_rounds, FILE *table,
                          kvm_strategy **out)
{
    return kvm_polykv_build_best_grouped(docs, n_docs, NULL, sig, B, b_min, sel_only, alloc_only, refine_rounds, table,
                                         out);
}

/* The number of documents doc_of[n] names (its largest entry + 1; n with doc_of NULL: each sample
 * its own), or −1 when an entry is negative or a document in between has no sample. */
static int count_units(const int *doc_of, int n)
{
    if (!doc_of) return n;
    int units = 0;
    for (int i = 0; i < n; i++) {
        if (doc_of[i] < 0) return -1;
        if (doc_of[i] + 1 > units) units = doc_of[i] + 1;
    }
    for (int g = 0; g < units; g++) {
        int seen = 0;
        for (int i = 0; i < n && !seen; i++)
            seen = doc_of[i] == g;
        if (!seen) return -1;
    }
    return units;
}

/* Per-document means of x[n] (doc_of NULL: x itself) into m[units]. */
static void unit_means(const double *x, const int *doc_of, int n, int units, double *m, int *cnt)
{
    for (int g = 0; g < units; g++)
        m[g] = 0, cnt[g] = 0;
    for (int i = 0; i < n; i++) {
        const int g = doc_of ? doc_of[i] : i;
        m[g] += x[i];
        cnt[g]++;
    }
    for (int g = 0; g < units; g++)
        m[g] /= cnt[g];
}

int kvm_polykv_build_best_grouped(kvm_eval_doc *const *docs, int n_docs, const int *doc_of,
                                  const kvm_polykv_signals *sig, int64_t B, int64_t b_min, int sel_only, int alloc_only,
                                  int refine_rounds, FILE *table, kvm_strategy **out)
{
    *out = NULL;
    const int units = count_units(doc_of, n_docs);
    if (n_docs < 1 || units < 1)
        return kvm_err(KVM_EINVAL,
                       "polykv: %d calibration windows, or document indices that are negative or skip a "
                       "document",
                       n_docs);
    kvm_strategy *best = NULL, *bs = NULL; /* best overall, best single pattern */
    double best_kl = INFINITY, bs_kl = INFINITY;
    double *kd = calloc((size_t)n_docs * 3, sizeof *kd), *best_d = kd + n_docs, *bs_d = kd + 2 * n_docs;
    int rc = kd ? 0 : kvm_err(KVM_ENOMEM, "polykv: out of memory");
    kvm_polykv_memo_begin();
    if (table) fprintf(table, "%-28s %12s  %s\n", "candidate", "kl_mean", "layers (prefill pattern:budget)");
    /* each layer at most the documents' context: the entries its heads can keep */
    const int64_t n_ctx = n_docs > 0 ? kvm_eval_doc_input(docs[0])->n_tokens : 0;
    candidate *cand = malloc(CANDIDATES_MAX * sizeof *cand);
    if (!cand && !rc) rc = kvm_err(KVM_ENOMEM, "polykv: out of memory");
    const int n_cand = rc ? 0 : candidates(sel_only, alloc_only, sig->has_sculpt, sig->has_kvzip, cand);
    for (int ci = 0; !rc && ci < n_cand; ci++) {
        const candidate *c = &cand[ci];
        kvm_strategy *s = NULL;
        double kl = 0;
        rc = kvm_polykv_strategy_build_capped(sig, (kvm_polykv_select)c->sel, (kvm_pattern)c->pat,
                                              (kvm_polykv_alloc)c->al, powers[c->pw], B, b_min, n_ctx, &s);
        if (!rc) {
            s->head_split = c->hs;
            stamp(s);
            rc = kvm_polykv_score(docs, n_docs, s, kd, &kl);
        }
        char name[64];
        if (!rc) describe(s, name, sizeof name);
        if (!rc && table) {
            fprintf(table, "%-28s %12.6f  ", name, kl);
            print_budgets(s, table);
            fprintf(table, "\n");
        }
        if (!rc && dump_dir) rc = dump_candidate(s, name);
        if (!rc && c->sel == KVM_POLYKV_SELECT_SINGLE && kl < bs_kl) {
            kvm_strategy_free(&bs);
            bs_kl = kl;
            memcpy(bs_d, kd, (size_t)n_docs * sizeof *kd);
            rc = kvm_strategy_clone(s, &bs);
        }
        if (!rc && kl < best_kl) { /* strict: ties keep the earlier candidate */
            kvm_strategy_free(&best);
            best = s;
            best_kl = kl;
            memcpy(best_d, kd, (size_t)n_docs * sizeof *kd);
            s = NULL;
        }
        kvm_strategy_free(&s);
    }
    free(cand);
    if (!rc && !best) rc = kvm_err(KVM_EINVAL, "polykv: no candidate matches the selection/allocation filter");
    if (!rc && bs && best->select != KVM_POLYKV_SELECT_SINGLE) {
        /* A heterogeneous mix must beat the best single pattern beyond calibration noise:
         * one-sided paired t-test of the per-document KL differences at level 0.10. The samples
         * are documents: a document's windows share its text (overlapping ones its tokens) and
         * are not independent, so each document counts once, with its mean over its windows. */
        double t = 0, *ms = malloc((size_t)units * 2 * sizeof *ms);
        int *cnt = malloc((size_t)units * sizeof *cnt), keep = 0;
        if (ms && cnt) {
            unit_means(bs_d, doc_of, n_docs, units, ms, cnt);
            unit_means(best_d, doc_of, n_docs, units, ms + units, cnt);
            keep = kvm_polykv_mix_significant(ms, ms + units, units, &t);
        } else
            rc = kvm_err(KVM_ENOMEM, "polykv: out of memory");
        free(ms);
        free(cnt);
        if (!rc && table) {
            char per[96] = ""; /* what n counts, when it is not the windows scored */
            if (units < n_docs)
                snprintf(per, sizeof per, " (n = documents, each the mean of its windows: %d windows in all)", n_docs);
            fprintf(table,
                    "best heterogeneous vs best single pattern: paired t = %.2f over %d document%s%s, critical %.2f "
                    "(%s)\n",
                    t, units, kvm_plural(units, "", "s"), per, kvm_polykv_t_crit(units - 1),
                    keep ? "significant: keep the mix" : "not significant: keep the single pattern");
        }
        if (!rc && !keep) {
            kvm_strategy_free(&best);
            best = bs;
            best_kl = bs_kl;
            bs = NULL;
        }
    }
    kvm_strategy_free(&bs);
    free(kd);
    if (rc) {
        kvm_polykv_memo_end();
        kvm_strategy_free(&best);
        return rc;
    }
    if (!rc && best && refine_rounds > 0) { /* optional: refine the best on the calibration KL */
        kvm_strategy *r = NULL;
        double kl;
        rc = kvm_polykv_refine(docs, n_docs, best, refine_rounds, table, &r, &kl);
        if (!rc && table) {
            fprintf(table, "%-28s %12.6f  ", "search/search", kl);
            print_budgets(r, table);
            fprintf(table, "\n");
        }
        if (!rc && kl < best_kl) {
            kvm_strategy_free(&best);
            best = r;
            best_kl = kl;
            r = NULL;
        }
        kvm_strategy_free(&r);
        if (rc) {
            kvm_polykv_memo_end();
            kvm_strategy_free(&best);
            return rc;
        }
    }
    kvm_polykv_memo_end();
    if (table) {
        char name[64];
        describe(best, name, sizeof name);
        if (units < n_docs)
            fprintf(table, "best: %s, mean KL %.6f on %d calibration windows of %d document%s\n", name, best_kl, n_docs,
                    units, kvm_plural(units, "", "s"));
        else
            fprintf(table, "best: %s, mean KL %.6f on %d calibration document%s\n", name, best_kl, n_docs,
                    kvm_plural(n_docs, "", "s"));
    }
    *out = best;
    return 0;
}
