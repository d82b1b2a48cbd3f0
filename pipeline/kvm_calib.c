/* kvm_calib.c: PolyKV signals <-> proto `stats` messages, and their average over documents. */
#include "pipeline/kvm_calib.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

enum { P = KVM_PATTERN_COUNT, NX = KVM_PATTERN_STRATEGY_COUNT - KVM_PATTERN_COUNT };

/* The distilled-layer choices (sculpt, kvzip) of s: whether measured and their prefill-phase
 * cosine / perplexity arrays [L], in kvm_pattern order. */
typedef struct extra {
    kvm_pattern r;
    int *on;
    double *cos, *ppl, *kl;
} extra;

static void extras(kvm_polykv_signals *s, extra *x)
{
    x[0] = (extra){KVM_PATTERN_SCULPT, &s->has_sculpt, s->sculpt_cosine, s->sculpt_ppl, s->sculpt_kl};
    x[1] = (extra){KVM_PATTERN_KVZIP, &s->has_kvzip, s->kvzip_cosine, s->kvzip_ppl, s->kvzip_kl};
}

int kvm_calib_encode(const kvm_polykv_signals *s, uint64_t job_id, int64_t n_tokens, kvm_msg **out)
{
    extra x[NX];
    extras((kvm_polykv_signals *)s, x); /* read only here */
    kvm_pattern col[KVM_PATTERN_STRATEGY_COUNT]; /* the message's patterns: the eviction ones, then the measured extras */
    int np = 0;
    for (int r = 0; r < P; r++) col[np++] = (kvm_pattern)r;
    for (int i = 0; i < NX; i++)
        if (*x[i].on) col[np++] = x[i].r;
    const int L = s->n_layers;
    float *cos = malloc((size_t)L * 2 * np * sizeof *cos), *ppl = malloc((size_t)L * 2 * np * sizeof *ppl);
    float *ent = malloc((size_t)L * 2 * sizeof *ent), *worst = malloc((size_t)L * 2 * sizeof *worst);
    int rc = cos && ppl && ent && worst ? 0 : kvm_err(KVM_ENOMEM, "stats: out of memory");
    for (int l = 0; !rc && l < L; l++)
        for (int ph = 0; ph < 2; ph++) {
            for (int j = 0; j < np; j++) { /* an extra's prefill values travel in both phases */
                const extra *e = (int)col[j] < P ? NULL : &x[(int)col[j] - P];
                cos[(l * 2 + ph) * np + j] = (float)(e ? e->cos[l] : s->cosine[(ph * L + l) * P + col[j]]);
                ppl[(l * 2 + ph) * np + j] = (float)(e ? e->ppl[l] : s->ppl_delta[(ph * L + l) * P + col[j]]);
            }
            ent[l * 2 + ph] = (float)s->entropy[l];
            worst[l * 2 + ph] = (float)s->worst_ppl[ph * L + l];
        }
    if (!rc) {
        kvm_proto_stats m = {.job_id = job_id, .n_layers = L, .n_phases = 2, .n_patterns = np, .n_tokens = n_tokens,
                             .n_docs = 1, .budget_tokens = s->budget < n_tokens ? s->budget : n_tokens,
                             .cos_sim = cos, .ppl_delta = ppl, .entropy = ent, .ppl_worst = worst};
        for (int j = 0; j < np; j++) m.patterns[j] = kvm_proto_str_c(kvm_pattern_name(col[j]));
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
    if (m.n_layers != L || m.n_phases != 2 || np < P || np > KVM_PATTERN_STRATEGY_COUNT)
        return kvm_err(KVM_EMISMATCH, "stats: %lld layers x %lld phases x %lld patterns, expected %d x 2 x %d..%d "
                                      "(the eviction patterns, then sculpt and/or kvzip)",
                       (long long)m.n_layers, (long long)m.n_phases, (long long)m.n_patterns, L, P,
                       KVM_PATTERN_STRATEGY_COUNT);
    for (int r = 0; r < P; r++)
        if (!kvm_proto_str_eq(m.patterns[r], kvm_pattern_name((kvm_pattern)r)))
            return kvm_err(KVM_EMISMATCH, "stats: pattern %d is '%.*s', expected '%s'", r, (int)m.patterns[r].len,
                           m.patterns[r].ptr, kvm_pattern_name((kvm_pattern)r));
    extra x[NX];
    extras(acc, x);
    int col[NX], have[NX] = {0}; /* message column of each extra, whether present */
    for (int j = P, next = 0; j < np; j++) { /* extras in kvm_pattern order, each at most once */
        while (next < NX && !kvm_proto_str_eq(m.patterns[j], kvm_pattern_name(x[next].r))) next++;
        if (next == NX)
            return kvm_err(KVM_EMISMATCH, "stats: pattern %d is '%.*s', expected sculpt or kvzip (in that order)", j,
                           (int)m.patterns[j].len, m.patterns[j].ptr);
        col[next] = j;
        have[next++] = 1;
    }
    for (int i = 0; i < NX; i++)
        if (acc->n_docs > 0 && *x[i].on != have[i])
            return kvm_err(KVM_EMISMATCH, "stats: documents disagree on whether %s was calibrated",
                           kvm_pattern_name(x[i].r));
    for (int l = 0; l < L; l++) {
        for (int ph = 0; ph < 2; ph++)
            for (int r = 0; r < P; r++) {
                acc->cosine[(ph * L + l) * P + r] += m.cos_sim[(l * 2 + ph) * np + r];
                acc->ppl_delta[(ph * L + l) * P + r] += m.ppl_delta[(l * 2 + ph) * np + r];
            }
        for (int i = 0; i < NX; i++)
            if (have[i]) { /* prefill-phase values (such a layer's decode run is the same run) */
                x[i].cos[l] += m.cos_sim[(l * 2) * np + col[i]];
                x[i].ppl[l] += m.ppl_delta[(l * 2) * np + col[i]];
            }
        acc->entropy[l] += m.entropy[l * 2];
    }
    for (int i = 0; i < NX; i++) *x[i].on = have[i];
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
    extra x[NX];
    extras(acc, x);
    for (int l = 0; l < L; l++) {
        acc->entropy[l] *= inv;
        for (int i = 0; i < NX; i++) {
            x[i].cos[l] *= inv;
            x[i].ppl[l] *= inv;
            x[i].kl[l] = 0;
        }
    }
    for (int ph = 0; ph < 2; ph++)
        for (int l = 0; l < L; l++) {
            double w = acc->ppl_delta[(ph * L + l) * P];
            for (int r = 1; r < P; r++)
                if (acc->ppl_delta[(ph * L + l) * P + r] > w) w = acc->ppl_delta[(ph * L + l) * P + r];
            acc->worst_ppl[ph * L + l] = w;
        }
}
