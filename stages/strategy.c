/* strategy.c: the kvmill-strategy stage (PolyKV calibration): receives a build request (a
 * job whose doc_id is "calibrate:N"), then N pairs (a calibration document's job, its
 * `stats`); averages the signals, scores every candidate strategy on the documents
 * (kvm_polykv_build_best), stores the best under (model id, [compress] strategy) and acks. */
#include "pipeline/kvm_calib.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_stage.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_storew.h"
#include "pipeline/kvm_worker.h"
#include "compress/eval/kvm_eval.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct strategy_state {
    kvm_worker_model wm;
    kvm_store *store;       /* opened in setup (--config) or with the first request's settings */
    const char *store_path; /* --store */
    const char *device;     /* --device: the KVSculpt layers' solver (the forward stays on the CPU) */
} strategy_state;

/* The store opens with [store] settings: of --config when given, else of the first request. */
static int setup_store(void *stp, const kvm_stage_args *a)
{
    strategy_state *st = stp;
    st->wm.override = a->model;
    st->device = a->device;
    int rc = kvm_stage_solver_device(a);
    if (rc) return rc;
    if (!a->store) return kvm_err(KVM_EINVAL, "kvmill-strategy needs --store PATH");
    st->store_path = a->store;
    /* a --store that is no store is refused here (exit 2), not created by the first request's open */
    if (kvm_serve_remote_is_endpoint(a->store))
        return kvm_err(KVM_EINVAL, "--store %s: kvmill-strategy runs on the store's host and opens its LMDB directory",
                       a->store);
    if ((rc = kvm_storew_must_exist("--store", a->store))) return rc;
    if (!a->config) return 0;
    kvm_config *cfg = NULL;
    rc = kvm_config_load(a->config, &cfg);
    if (!rc) rc = kvm_storew_open_worker(cfg, a->store, &st->store);
    kvm_config_free(&cfg);
    return rc;
}

static int setup(void *stp, const kvm_stage_args *a)
{
    strategy_state *st = stp;
    int rc = setup_store(st, a);
    if (!rc) kvm_worker_model_id_early(&st->wm, st->store); /* ready names a --model */
    return rc;
}

/* The stage's model for ready (kvm_stage_ops.model_id). */
static const uint8_t *model_id(void *stp) { return kvm_worker_model_id(&((strategy_state *)stp)->wm); }

/* N from the request's doc_id "calibrate:N", or a negative status. */
static int64_t n_docs_of(kvm_msg *req)
{
    kvm_proto_job j;
    int rc = kvm_proto_job_decode(req, &j);
    if (rc) return rc;
    char id[64];
    snprintf(id, sizeof id, "%.*s", (int)(j.doc_id.len < 63 ? j.doc_id.len : 63), j.doc_id.ptr);
    char *end;
    long n = strncmp(id, "calibrate:", 10) ? -1 : strtol(id + 10, &end, 10);
    if (n < 1 || n > (KVM_STAGE_MAX_IN - 1) / 2 || *end)
        return kvm_err(KVM_EPROTO, "expected a build request with doc_id calibrate:N (N in [1, %d]), got '%s'",
                       (KVM_STAGE_MAX_IN - 1) / 2, id);
    return n;
}

static int complete(void *st, kvm_msg *const *in, int n_in)
{
    kvm_proto_type t;
    int rc = kvm_proto_peek(in[n_in - 1], &t);
    if (rc) return rc;
    int64_t n = n_docs_of(in[0]);
    if (n < 0) return (int)n;
    if (n_in == 1) return 0;
    kvm_proto_type want = (n_in - 1) % 2 == 1 ? KVM_PROTO_JOB : KVM_PROTO_STATS;
    if (t != want) return kvm_err(KVM_EPROTO, "message %d of the build request: expected %s, got %s", n_in - 1,
                                  kvm_proto_type_name(want), kvm_proto_type_name(t));
    return n_in == 1 + 2 * n;
}

/* A calibration document (context and continuation) of the job msg, with the repeat prompt
 * rp[n_rp] for query_source repeat. */
static int load_doc(const kvm_model *m, kvm_msg *msg, const int32_t *rp, int64_t n_rp, kvm_eval_doc **doc)
{
    kvm_proto_job j;
    int rc = kvm_proto_job_decode(msg, &j);
    if (rc) return rc;
    if (!j.continuation) return kvm_err(KVM_EPROTO, "calibration document %llu has no continuation", (unsigned long long)j.job_id);
    int64_t n = j.n_tokens + j.n_continuation;
    int32_t *all = malloc((size_t)n * sizeof *all);
    if (!all) return kvm_err(KVM_ENOMEM, "strategy: out of memory");
    memcpy(all, j.tokens, (size_t)j.n_tokens * sizeof *all);
    memcpy(all + j.n_tokens, j.continuation, (size_t)j.n_continuation * sizeof *all);
    rc = kvm_eval_doc_new(m, NULL, all, n, j.n_tokens, j.n_continuation, doc);
    free(all);
    if (!rc && (rc = kvm_eval_doc_set_repeat_prompt(*doc, rp, n_rp))) kvm_eval_doc_free(doc);
    return rc;
}

static int work(void *stp, kvm_msg *const *in, int n_in, kvm_stage_out *out, int *retryable)
{
    strategy_state *st = stp;
    kvm_proto_job req;
    kvm_config *cfg = NULL;
    kvm_polykv_signals *sig = NULL;
    kvm_strategy *best = NULL;
    uint8_t *buf = NULL;
    size_t len = 0;
    int n = (n_in - 1) / 2;
    kvm_eval_doc **docs = calloc((size_t)n, sizeof *docs);
    int rc = docs ? kvm_proto_job_decode(in[0], &req) : kvm_err(KVM_ENOMEM, "strategy: out of memory");
    if (!rc && !req.settings) rc = kvm_err(KVM_EPROTO, "build request carries no settings");
    if (!rc) rc = kvm_jobcfg_unpack(req.settings, req.settings_bytes, &cfg);
    if (!rc && !st->store) rc = kvm_storew_open_worker(cfg, st->store_path, &st->store);
    if (rc) { *retryable = 0; goto done; }
    int64_t B = kvm_config_int(cfg, "compress", "budget");
    if ((rc = kvm_worker_model_for_job(&st->wm, cfg, st->store, req.has_model_id ? req.model_id : NULL,
                                       &out->other_model))) {
        *retryable = kvm_worker_model_retryable(rc);
        goto done;
    }
    if ((rc = kvm_polykv_signals_new(st->wm.model->cfg.n_layers, &sig))) goto done;
    double t0 = kvm_now_ms();
    for (int i = 0; !rc && i < n; i++) rc = kvm_calib_accumulate(sig, in[2 + 2 * i]);
    out->transport_ms += kvm_now_ms() - t0;
    if (rc) { *retryable = 0; goto done; }
    kvm_calib_finish(sig);
    int32_t *rp = NULL;
    int64_t n_rp = 0;
    if (!rc) rc = kvm_worker_repeat_prompt(cfg, &st->wm, &rp, &n_rp);
    for (int i = 0; !rc && i < n; i++) rc = load_doc(st->wm.model, in[1 + 2 * i], rp, n_rp, &docs[i]);
    free(rp);
    kvm_sculpt_opts so;
    const int distilled = sig->has_sculpt || sig->has_kvzip; /* kvzip layers take these settings in kvzip mode */
    if (!rc && distilled && !(rc = kvm_worker_sculpt_opts(cfg, KVM_SCULPT_FULL, &so)) && st->device)
        rc = kvm_sculpt_opts_set(&so, "device", st->device);
    if (!rc && distilled) kvm_polykv_score_sculpt_opts(&so);
    int alloc = -1; /* [calibrate] layer_alloc: "all" (every candidate) or one allocation */
    const char *la = kvm_config_str(cfg, "calibrate", "layer_alloc");
    kvm_polykv_alloc av;
    if (!rc && strcmp(la, "all")) {
        if ((rc = kvm_polykv_alloc_parse(la, &av))) *retryable = 0;
        alloc = (int)av;
    }
    if (!rc) rc = kvm_polykv_build_best(docs, n, sig, B, B / 4 > 1 ? B / 4 : 1, -1, alloc, 0, stderr, &best);
    kvm_polykv_score_sculpt_opts(NULL);
    /* without a model id (v1/v2): the record's key has it, and its bytes hash into config ids */
    if (!rc) rc = kvm_strategy_encode(best, &buf, &len);
    if (!rc) rc = kvm_store_put_strategy(st->store, &st->wm.model_id, kvm_config_str(cfg, "compress", "strategy"), buf, len);
    if (rc) goto done;
    kvm_proto_ack ack = {.worker_id = kvm_proto_str_c("strategy"), .stage = kvm_proto_str_c("strategy"), .pid = getpid(),
                         .job_id = req.job_id};
    if ((rc = kvm_proto_ack_encode(&ack, &out->ctl[out->n_ctl]))) goto done;
    out->n_ctl++;
done:
    for (int i = 0; docs && i < n; i++) kvm_eval_doc_free(&docs[i]);
    free(docs);
    free(buf);
    kvm_strategy_free(&best);
    kvm_polykv_signals_free(&sig);
    kvm_config_free(&cfg);
    return rc;
}

static void teardown(void *stp)
{
    strategy_state *st = stp;
    kvm_worker_model_free(&st->wm);
    kvm_store_close(&st->store);
}

int main(int argc, char **argv)
{
    static strategy_state st;
    kvm_stage_ops ops = {.stage = "strategy",
                         .setup = setup,
                         .complete = complete,
                         .job_id = kvm_stage_job_id,
                         .work = work,
                         .teardown = teardown,
                         .model_id = model_id};
    return kvm_stage_main(argc, argv, &ops, &st);
}
