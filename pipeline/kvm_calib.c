/* kvm_calib.c: PolyKV signals <-> proto `stats` messages, and their average over documents. */
#include "pipeline/kvm_calib.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

enum { P = KVM_PATTERN_COUNT, PS = KVM_PATTERN_STRATEGY_COUNT };

/* Signal r (eviction pattern, or KVM_PATTERN_SCULPT) of (phase, layer). */
static double sig_at(const double *ev, const double *sc, int L, int ph, int l, int r)
{
    return r == KVM_PATTERN_SCULPT ? sc[l] : ev[(ph * L + l) * P + r];
}

int kvm_calib_encode(const kvm_polykv_signals *s, uint64_t job_id, int64_t n_tokens, kvm_msg **out)
{
    const int L = s->n_layers, np = s->has_sculpt ? PS : P; /* sculpt travels as one more pattern */
    float *cos = malloc((size_t)L * 2 * np * sizeof *cos), *ppl = malloc((size_t)L * 2 * np * sizeof *ppl);
    float *ent = malloc((size_t)L * 2 * sizeof *ent), *worst = malloc((size_t)L * 2 * sizeof *worst);
    int rc = cos && ppl && ent && worst ? 0 : kvm_err(KVM_ENOMEM, "stats: out of memory");
    for (int l = 0; !rc && l < L; l++)
        for (int ph = 0; ph < 2; ph++) {
            for (int r = 0; r < np; r++) {
                cos[(l * 2 + ph) * np + r] = (float)sig_at(s->cosine, s->sculpt_cosine, L, ph, l, r);
                ppl[(l * 2 + ph) * np + r] = (float)sig_at(s->ppl_delta, s->sculpt_ppl, L, ph, l, r);
            }
            ent[l * 2 + ph] = (float)s->entropy[l];
            worst[l * 2 + ph] = (float)s->worst_ppl[ph * L + l];
        }
    if (!rc) {
        kvm_proto_stats m = {.job_id = job_id, .n_layers = L, .n_phases = 2, .n_patterns = np, .n_tokens = n_tokens,
                             .n_docs = 1, .budget_tokens = s->budget < n_tokens ? s->budget : n_tokens,
                             .cos_sim = cos, .ppl_delta = ppl, .entropy = ent, .ppl_worst = worst};
        for (int r = 0; r < np; r++) m.patterns[r] = kvm_proto_str_c(kvm_pattern_name((kvm_pattern)r));
        rc = kvm_proto_stats_encode(&m, out);
    }
    free(cos); free(ppl); free(ent); free(worst);
    return rc;
}

int kvm_calib_accumulate(kvm_polykv_signals *acc, const kvm_msg *msg)
{
    kvm_proto_stats m;
    int rc = kvm_proto_stats_decode(msg, &m);
    if (rc) return rc;
    const int L = acc->n_layers, np = (int)m.n_patterns;
    if (m.n_layers != L || m.n_phases != 2 || (np != P && np != PS))
        return kvm_err(KVM_EMISMATCH, "stats: %lld layers x %lld phases x %lld patterns, expected %d x 2 x %d (or %d "
                                      "with sculpt)",
                       (long long)m.n_layers, (long long)m.n_phases, (long long)m.n_patterns, L, P, PS);
    if (acc->n_docs > 0 && acc->has_sculpt != (np == PS))
        return kvm_err(KVM_EMISMATCH, "stats: documents disagree on whether sculpt was calibrated");
    for (int r = 0; r < np; r++)
        if (!kvm_proto_str_eq(m.patterns[r], kvm_pattern_name((kvm_pattern)r)))
            return kvm_err(KVM_EMISMATCH, "stats: pattern %d is '%.*s', expected '%s'", r, (int)m.patterns[r].len,
                           m.patterns[r].ptr, kvm_pattern_name((kvm_pattern)r));
    for (int l = 0; l < L; l++) {
        for (int ph = 0; ph < 2; ph++)
            for (int r = 0; r < P; r++) {
                acc->cosine[(ph * L + l) * P + r] += m.cos_sim[(l * 2 + ph) * np + r];
                acc->ppl_delta[(ph * L + l) * P + r] += m.ppl_delta[(l * 2 + ph) * np + r];
            }
        if (np == PS) { /* prefill-phase values (a sculpt layer's decode run is the same run) */
            acc->sculpt_cosine[l] += m.cos_sim[(l * 2) * np + KVM_PATTERN_SCULPT];
            acc->sculpt_ppl[l] += m.ppl_delta[(l * 2) * np + KVM_PATTERN_SCULPT];
        }
        acc->entropy[l] += m.entropy[l * 2];
    }
    acc->has_sculpt = np == PS;
    acc->budget = m.budget_tokens;
    acc->n_docs++;
    return 0;
}

void kvm_calib_finish(kvm_polykv_signals *acc)
{
    const int L = acc->n_layers;
    double inv = acc->n_docs > 0 ? 1.0 / acc->n_docs : 0;
    for (int i = 0; i < 2 * L * P; i++) {
        acc->cosine[i] *= inv;
        acc->ppl_delta[i] *= inv;
        acc->kl[i] = 0; /* diagnostic only; not carried on the wire */
    }
    for (int l = 0; l < L; l++) {
        acc->entropy[l] *= inv;
        acc->sculpt_cosine[l] *= inv;
        acc->sculpt_ppl[l] *= inv;
        acc->sculpt_kl[l] = 0;
    }
    for (int ph = 0; ph < 2; ph++)
        for (int l = 0; l < L; l++) {
            double w = acc->ppl_delta[(ph * L + l) * P];
            for (int r = 1; r < P; r++)
                if (acc->ppl_delta[(ph * L + l) * P + r] > w) w = acc->ppl_delta[(ph * L + l) * P + r];
            acc->worst_ppl[ph * L + l] = w;
        }
}
