/* kvm_eval_target.c: `target_kl`: the smallest budget whose KL on a document's continuation
 * stays under a target, by bisection over a budget grid (issue 14, item 5). */
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"

#include <math.h>
#include <string.h>

/* Evaluates budget b once and records the probe. */
static int probe(kvm_eval_kl_fn *fn, void *user, int64_t b, kvm_eval_target *t, double *kl)
{
    if (t->n_probes == KVM_EVAL_TARGET_MAX_PROBES)
        return kvm_err(KVM_EINVAL, "target_kl: more than %d probes", KVM_EVAL_TARGET_MAX_PROBES);
    int rc = fn(user, b, kl);
    if (rc) return rc;
    if (!(*kl >= 0)) return kvm_err(KVM_EINVAL, "target_kl: KL at budget %lld is %g", (long long)b, *kl);
    t->probe_budget[t->n_probes] = b;
    t->probe_kl[t->n_probes++] = *kl;
    return 0;
}

int kvm_eval_target_budget(kvm_eval_kl_fn *fn, void *user, int64_t lo, int64_t hi, int64_t step, double target,
                           kvm_eval_target *out)
{
    memset(out, 0, sizeof *out);
    if (lo < 1 || hi < lo || step < 1 || !(target >= 0))
        return kvm_err(KVM_EINVAL, "target_kl: need 1 <= lo (%lld) <= hi (%lld), step (%lld) >= 1, target (%g) >= 0",
                       (long long)lo, (long long)hi, (long long)step, target);
    double kl_hi;
    int rc = probe(fn, user, hi, out, &kl_hi);
    if (rc) return rc;
    out->budget = hi;
    out->kl = kl_hi;
    out->reached = kl_hi <= target;
    /* Grid indices: j in [0, J) are lo + j·step < hi, index J is hi. Invariant: the answer
     * index is in [a, b] and b is known to reach the target. */
    int64_t J = (hi - lo + step - 1) / step, a = 0, b = J;
    while (out->reached && a < b) {
        int64_t mid = a + (b - a) / 2, bm = lo + mid * step;
        double kl;
        if ((rc = probe(fn, user, bm, out, &kl))) return rc;
        if (kl <= target) {
            b = mid;
            out->budget = bm;
            out->kl = kl;
        } else
            a = mid + 1;
    }
    for (int i = 0; i < out->n_probes; i++)
        for (int j = 0; j < out->n_probes; j++)
            if (out->probe_budget[i] < out->probe_budget[j] && out->probe_kl[j] > out->probe_kl[i])
                out->n_nonmonotone++;
    return 0;
}
