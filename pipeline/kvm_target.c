/* kvm_target.c: [compress] target_kl: the budget search of a compress worker
 * (pipeline/kvm_target.h). */
#include "pipeline/kvm_target.h"
#include "common/kvm_error.h"
#include "compress/eval/kvm_eval.h"
#ifdef KVM_WITH_CUDA
#include "compress/eval/kvm_eval_cuda.h"
#endif
#include "pipeline/kvm_worker.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One search: kvm_eval_kl_fn's user. */
typedef struct search {
    kvm_config *c;
    kvm_eval_doc *doc;
#ifdef KVM_WITH_CUDA
    kvm_eval_cuda_doc *cdoc; /* the probes' continuation on the worker's device, or NULL */
#endif
    kvm_compress_input in; /* the local prefill's input, with the pipeline's n_future */
    kvm_store *store;
    const kvm_store_id *model_id;
    int64_t T, hi;
    int has_check;
    double target;
    kvm_kvcache *best, *at_hi; /* smallest probe within the target; the probe at hi */
    int64_t best_budget;
    double check_best, check_hi; /* check-part KL of those probes */
} search;

static int set_budget(kvm_config *c, int64_t b)
{
    char v[32];
    snprintf(v, sizeof v, "%lld", (long long)b);
    return kvm_config_set(c, "compress", "budget", v);
}

/* The probe's continuation over cc and the KL of steps [t0, t1): on the device when the search
 * has one, else on the host's document. */
static int probe_continue(search *s, const kvm_kvcache *cc)
{
    kvm_eval_result r;
#ifdef KVM_WITH_CUDA
    if (s->cdoc) return kvm_eval_cuda_continue(s->cdoc, cc, &r);
#endif
    return kvm_eval_continue(s->doc, cc, NULL, NULL, &r);
}

static double probe_kl(const search *s, int64_t t0, int64_t t1)
{
#ifdef KVM_WITH_CUDA
    if (s->cdoc) return kvm_eval_cuda_kl_range(s->cdoc, t0, t1);
#endif
    return kvm_eval_kl_range(s->doc, t0, t1);
}

static int probe(void *user, int64_t budget, double *kl)
{
    search *s = user;
    kvm_kvcache *cc = NULL;
    int rc = set_budget(s->c, budget);
    if (!rc) rc = kvm_worker_compress(s->c, &s->in, s->store, s->model_id, &cc);
    if (!rc) rc = probe_continue(s, cc);
    if (rc) {
        kvm_kvcache_free(&cc);
        return rc;
    }
    *kl = probe_kl(s, 0, s->T);
    double check = s->has_check ? probe_kl(s, s->T, 2 * s->T) : NAN;
    if (budget == s->hi) {
        kvm_kvcache_free(&s->at_hi);
        s->at_hi = cc, s->check_hi = check;
    } else if (*kl <= s->target && (!s->best || budget < s->best_budget)) {
        kvm_kvcache_free(&s->best);
        s->best = cc, s->best_budget = budget, s->check_best = check;
    } else
        kvm_kvcache_free(&cc);
    return 0;
}

int64_t kvm_target_lowest_budget(const kvm_config *c)
{
    const int64_t step = kvm_config_int(c, "compress", "target_step"), retain = kvm_config_int(c, "compress", "retain");
    kvm_sculpt_mode mode; /* the sculpt methods' budget includes the retain zone (k = budget − retain) */
    if (kvm_sculpt_mode_parse(kvm_config_str(c, "compress", "method"), &mode) == 0)
        return (retain / step + 1) * step; /* the smallest multiple of step above retain */
    return step;
}

int kvm_target_compress(kvm_config *c, const kvm_compress_input *in, const int32_t *cont, int64_t n_cont,
                        kvm_store *store, const kvm_store_id *model_id, kvm_devmodel *dev, kvm_kvcache **out,
                        kvm_target_result *res)
{
    *out = NULL;
    memset(res, 0, sizeof *res);
    res->kl_check = NAN;
    const double target = kvm_config_float(c, "compress", "target_kl");
    const int64_t n = in->n_tokens, T = kvm_config_int(c, "eval", "continuation");
    const int64_t step = kvm_config_int(c, "compress", "target_step");
    if (!(target > 0)) return kvm_err(KVM_EINVAL, "target_kl: [compress] target_kl is not set");
    int shortened = n_cont < T; /* the search part comes from the context's own end */
    int64_t N = shortened ? n - T : n, T2 = !shortened && n_cont >= 2 * T ? 2 * T : T;
    if (N < 2 || !in->tokens)
        return kvm_err(KVM_EINVAL,
                       "target_kl: the document has %lld tokens and %lld after the context: too few for a "
                       "search part of [eval] continuation = %lld tokens",
                       (long long)n, (long long)n_cont, (long long)T);
    char saved[64];
    snprintf(saved, sizeof saved, "%s", kvm_config_str(c, "compress", "budget"));
    int32_t *all = malloc((size_t)(N + T2) * sizeof *all);
    search s = {.c = c,
                .store = store,
                .model_id = model_id,
                .T = T,
                .has_check = T2 == 2 * T,
                .target = target,
                .check_best = NAN,
                .check_hi = NAN};
    int rc = all ? 0 : kvm_err(KVM_ENOMEM, "target_kl: out of memory");
    if (!rc) {
        memcpy(all, in->tokens, (size_t)(shortened ? n : N) * sizeof *all);
        if (!shortened) memcpy(all + N, cont, (size_t)T2 * sizeof *all);
        rc = kvm_eval_doc_new(in->model, NULL, all, N + T2, N, T2, &s.doc);
    }
#ifdef KVM_WITH_CUDA
    kvm_cuda_model *dm = NULL; /* the device's own full-KV reference, then each probe's continuation there */
    if (!rc && dev && !(rc = kvm_devmodel_get(dev, in->model, model_id, c, N + T2, &dm)) && dm)
        rc = kvm_eval_cuda_doc_new(dm, &in->model->cfg, all, N, T2, &s.cdoc);
#else
    (void)dev;
#endif
    kvm_eval_target tr;
    if (!rc) {
        s.in = *kvm_eval_doc_input(s.doc);
        s.in.n_future = in->n_future;
        s.in.repeat_prompt = in->repeat_prompt; /* query_source repeat: the stage's prompt */
        s.in.n_repeat_prompt = in->n_repeat_prompt;
        s.in.progress = NULL; /* probes would count problems past the document's total */
        int64_t lo = kvm_target_lowest_budget(c);
        s.hi = N - 1;
        if (lo > s.hi) lo = s.hi;
        rc = kvm_eval_target_budget(probe, &s, lo, s.hi, step, target, &tr);
    }
    if (!rc) {
        kvm_kvcache *chosen = tr.reached && tr.budget != s.hi ? s.best : s.at_hi;
        res->budget = tr.budget;
        res->kl_search = tr.kl;
        res->kl_check = chosen == s.best ? s.check_best : s.check_hi;
        res->reached = tr.reached;
        res->probes = tr.n_probes;
        res->nonmonotone = tr.n_nonmonotone;
        res->n_ctx_search = N;
        if (shortened) { /* the budget for N − T tokens, scaled to the context n */
            int64_t b = (int64_t)ceil((double)tr.budget * (double)n / (double)N);
            b = (b + step - 1) / step * step;
            res->budget = b < n - 1 ? b : n - 1;
            rc = set_budget(c, res->budget);
            if (!rc) rc = kvm_worker_compress(c, in, store, model_id, out);
        } else if (chosen == s.best) {
            *out = s.best, s.best = NULL;
        } else
            *out = s.at_hi, s.at_hi = NULL;
        if (!rc) (*out)->next_pos = (int32_t)n;
    }
    int rs = kvm_config_set(c, "compress", "budget", saved);
    if (!rc && rs) rc = rs;
    if (rc) kvm_kvcache_free(out);
    kvm_kvcache_free(&s.best);
    kvm_kvcache_free(&s.at_hi);
    kvm_eval_doc_free(&s.doc);
#ifdef KVM_WITH_CUDA
    kvm_eval_cuda_doc_free(&s.cdoc);
#endif
    free(all);
    return rc;
}
