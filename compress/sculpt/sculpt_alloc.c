/* sculpt_alloc.c: pilot-based budget allocation over (layer, KV head) problems. The paper's rule
 * (KVSculpt arXiv 2603.27819 §4: budget ∝ pilot MSE^p, at layer or head level, capped at the
 * zone size, at least one entry each) and ours: a per-head power-law error model fitted to the
 * pilot at two budgets, then greedy marginal-gain water-filling under the caps. */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdlib.h>

/* Rounds real targets x[n] (Σ x = total, lo ≤ x ≤ cap) to integers with the same sum. */
static void round_targets(int n, const double *x, const int64_t *lo, const int64_t *caps, int64_t total, int64_t *k)
{
    int64_t sum = 0;
    for (int i = 0; i < n; i++) {
        int64_t v = (int64_t)floor(x[i]);
        k[i] = v < lo[i] ? lo[i] : v > caps[i] ? caps[i] : v;
        sum += k[i];
    }
    while (sum != total) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            double fr = x[i] - (double)k[i];
            if (sum < total && k[i] < caps[i] && (best < 0 || fr > x[best] - (double)k[best])) best = i;
            if (sum > total && k[i] > lo[i] && (best < 0 || fr < x[best] - (double)k[best])) best = i;
        }
        if (best < 0) break;
        k[best] += sum < total ? 1 : -1;
        sum += sum < total ? 1 : -1;
    }
}

/* x_i = clamp(θ·w_i, lo_i, cap_i) with θ found by bisection so that Σ x_i = total. */
static void capped_proportional(int n, const double *w, const int64_t *lo, const int64_t *caps, int64_t total,
                                double *x)
{
    double hi = 1, lo_t = 0;
    for (int it = 0; it < 200; it++) { /* grow θ until the sum reaches total */
        double s = 0;
        for (int i = 0; i < n; i++) s += fmin((double)caps[i], fmax((double)lo[i], hi * w[i]));
        if (s >= (double)total) break;
        hi *= 2;
    }
    for (int it = 0; it < 200; it++) {
        double mid = 0.5 * (lo_t + hi), s = 0;
        for (int i = 0; i < n; i++) s += fmin((double)caps[i], fmax((double)lo[i], mid * w[i]));
        if (s < (double)total) lo_t = mid;
        else hi = mid;
    }
    for (int i = 0; i < n; i++) x[i] = fmin((double)caps[i], fmax((double)lo[i], hi * w[i]));
}

/* Power-law error model e(k) = a·k^(−b) through (k1, e1) and (k2, e2), k2 < k1. */
static double model_err(double a, double b, int64_t k) { return k <= 0 ? a * 2.0 : a * pow((double)k, -b); }

static void water_fill(int n, const double *mse, const double *mse_half, int64_t kp, const int64_t *lo,
                       const int64_t *caps, int64_t total, int64_t *k)
{
    double *a = malloc((size_t)n * sizeof *a), *b = malloc((size_t)n * sizeof *b);
    int64_t kh = (kp + 1) / 2, sum = 0;
    for (int i = 0; i < n; i++) {
        double bi = 1.0;
        if (kp > kh && mse[i] > 0 && mse_half[i] > 0) bi = log(mse_half[i] / mse[i]) / log((double)kp / (double)kh);
        bi = fmin(4.0, fmax(0.05, isfinite(bi) ? bi : 1.0));
        if (a) a[i] = fmax(mse[i], 0) * pow((double)(kp > 0 ? kp : 1), bi);
        if (b) b[i] = bi;
        k[i] = lo[i];
        sum += k[i];
    }
    while (a && b && sum < total) {
        int best = -1;
        double bg = -1;
        for (int i = 0; i < n; i++) {
            if (k[i] >= caps[i]) continue;
            double g = model_err(a[i], b[i], k[i]) - model_err(a[i], b[i], k[i] + 1);
            if (g > bg) { bg = g; best = i; }
        }
        if (best < 0) break;
        k[best]++;
        sum++;
    }
    free(a);
    free(b);
}

int kvm_sculpt_allocate(kvm_sculpt_alloc how, int n_layers, int n_kv_heads, const double *mse,
                        const double *mse_half, int64_t kpilot, const int64_t *caps, int64_t total, double power,
                        int64_t *k)
{
    const int n = n_layers * n_kv_heads;
    if (n <= 0 || total < 0) return kvm_err(KVM_EINVAL, "sculpt alloc: %d problems, budget %lld", n, (long long)total);
    if (how == KVM_SCULPT_ALLOC_GAIN && !mse_half) return kvm_err(KVM_EINVAL, "sculpt alloc: gain rule needs mse_half");
    int64_t *lo = malloc((size_t)n * sizeof *lo);
    double *w = malloc((size_t)n * sizeof *w), *x = malloc((size_t)n * sizeof *x);
    if (!lo || !w || !x) {
        free(lo);
        free(w);
        free(x);
        return kvm_err(KVM_ENOMEM, "sculpt alloc: out of memory");
    }
    int64_t capsum = 0, losum = 0;
    for (int i = 0; i < n; i++) {
        lo[i] = caps[i] > 0 ? 1 : 0;
        capsum += caps[i];
        losum += lo[i];
    }
    if (total > capsum) total = capsum;
    if (total < losum) total = losum;
    if (how == KVM_SCULPT_ALLOC_GAIN) {
        water_fill(n, mse, mse_half, kpilot, lo, caps, total, k);
    } else {
        double wsum = 0;
        for (int l = 0; l < n_layers; l++) {
            double lm = 0;
            for (int h = 0; h < n_kv_heads; h++) lm += mse[l * n_kv_heads + h] / n_kv_heads;
            for (int h = 0; h < n_kv_heads; h++) {
                int i = l * n_kv_heads + h;
                double e = how == KVM_SCULPT_ALLOC_LAYER ? lm : mse[i];
                w[i] = how == KVM_SCULPT_ALLOC_UNIFORM ? 1.0 : pow(fmax(e, 0), power);
                if (!isfinite(w[i])) w[i] = 0;
                wsum += w[i];
            }
        }
        if (!(wsum > 0))
            for (int i = 0; i < n; i++) w[i] = 1.0;
        capped_proportional(n, w, lo, caps, total, x);
        round_targets(n, x, lo, caps, total, k);
    }
    free(lo);
    free(w);
    free(x);
    return 0;
}
