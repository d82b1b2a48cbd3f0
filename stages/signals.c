/* signals.c: the kvmill-signals stage (PolyKV calibration): for one calibration document
 * (context + held-out continuation) measures, per layer, phase and eviction pattern at the
 * calibration budget, the cosine similarity of the layer's attention output and the
 * perplexity change against full KV, and the layer's attention entropy; sends them as a
 * `stats` message. The signals need forward passes with each pattern applied, so this stage
 * runs its own (compress/polykv/kvm_polykv.h) rather than reusing a prefill's KV. */
#include "pipeline/kvm_calib.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_stage.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "pipeline/kvm_worker.h"
#include "compress/eval/kvm_eval.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"

#include <stdlib.h>
#include <string.h>

typedef struct signals_state {
    kvm_worker_model wm;
    const char *device; /* --device: the KVSculpt signals' solver (the forward stays on the CPU) */
} signals_state;

static int setup(void *st, const kvm_stage_args *a)
{
    ((signals_state *)st)->wm.override = a->model;
    kvm_worker_model_id_early(&((signals_state *)st)->wm, NULL); /* ready names a --model */
    ((signals_state *)st)->device = a->device;
    int rc = kvm_stage_solver_device(a), cuda = -1;
    if (!rc && !kvm_device_parse(a->device, &cuda) && cuda >= 0)
        kvm_log(KVM_LOG_INFO, "forward_device", NULL, 0, "the signals' forward passes run on the CPU: each applies "
                "an eviction pattern to one layer through the host forward's hooks, which the device forward has not");
    return rc;
}

static int work(void *stp, kvm_msg *const *in, int n_in, kvm_stage_out *out, int *retryable)
{
    signals_state *st = stp;
    kvm_proto_job j;
    kvm_config *cfg = NULL;
    kvm_eval_doc *doc = NULL;
    kvm_polykv_signals *sig = NULL;
    int32_t *all = NULL, *rp = NULL; /* rp: the repeat prompt (query_source repeat) */
    int64_t n_rp = 0;
    int rc = kvm_proto_job_decode(in[0], &j);
    if (!rc && (!j.settings || !j.continuation))
        rc = kvm_err(KVM_EPROTO, "calibration job %llu needs settings and a continuation", (unsigned long long)j.job_id);
    if (!rc) rc = kvm_jobcfg_unpack(j.settings, j.settings_bytes, &cfg);
    int64_t B = cfg ? kvm_config_int(cfg, "compress", "budget") : 0;
    if (!rc && B <= 0) rc = kvm_err(KVM_EINVAL, "calibration needs [compress] budget > 0");
    if (rc) { *retryable = 0; goto done; }
    if ((rc = kvm_worker_model_for_job(&st->wm, cfg, NULL, j.has_model_id ? j.model_id : NULL, &out->other_model))) {
        *retryable = kvm_worker_model_retryable(rc);
        goto done;
    }
    int64_t n = j.n_tokens + j.n_continuation;
    if (!(all = malloc((size_t)n * sizeof *all))) { rc = kvm_err(KVM_ENOMEM, "signals: out of memory"); goto done; }
    memcpy(all, j.tokens, (size_t)j.n_tokens * sizeof *all);
    memcpy(all + j.n_tokens, j.continuation, (size_t)j.n_continuation * sizeof *all);
    if ((rc = kvm_eval_doc_new(st->wm.model, NULL, all, n, j.n_tokens, j.n_continuation, &doc)) ||
        (rc = kvm_worker_repeat_prompt(cfg, &st->wm, &rp, &n_rp)) ||
        (rc = kvm_eval_doc_set_repeat_prompt(doc, rp, n_rp)) ||
        (rc = kvm_polykv_signals_new(st->wm.model->cfg.n_layers, &sig)) ||
        (rc = kvm_polykv_calibrate_phases(&doc, 1, B,
                                          strcmp(kvm_config_str(cfg, "calibrate", "phases"), "prefill")
                                              ? KVM_POLYKV_DECODE_BATCHED
                                              : KVM_POLYKV_DECODE_NONE,
                                          sig)))
        goto done;
    kvm_sculpt_opts so;
    if (kvm_config_bool(cfg, "calibrate", "sculpt") &&
        ((rc = kvm_worker_sculpt_opts(cfg, KVM_SCULPT_FULL, &so)) ||
         (st->device && (rc = kvm_sculpt_opts_set(&so, "device", st->device))) ||
         (rc = kvm_polykv_calibrate_sculpt(&doc, 1, B, &so, sig))))
        goto done;
    /* kvzip layers are KVzip scoring whatever [compress] method says (the pattern sets the mode) */
    if (kvm_config_bool(cfg, "calibrate", "kvzip") &&
        ((rc = kvm_worker_sculpt_opts(cfg, KVM_SCULPT_KVZIP, &so)) || (rc = kvm_polykv_calibrate_kvzip(&doc, 1, B, &so, sig))))
        goto done;
    double t0 = kvm_now_ms();
    if ((rc = kvm_calib_encode(sig, j.job_id, j.n_tokens, &out->data[out->n_data]))) goto done;
    out->n_data++;
    out->transport_ms += kvm_now_ms() - t0;
done:
    kvm_polykv_signals_free(&sig);
    kvm_eval_doc_free(&doc);
    free(all);
    free(rp);
    kvm_config_free(&cfg);
    return rc;
}

/* The stage's model for ready (kvm_stage_ops.model_id). */
static const uint8_t *model_id(void *st) { return kvm_worker_model_id(&((signals_state *)st)->wm); }

static void teardown(void *st) { kvm_worker_model_free(&((signals_state *)st)->wm); }

int main(int argc, char **argv)
{
    static signals_state st;
    kvm_stage_ops ops = {.stage = "signals",
                         .setup = setup,
                         .complete = kvm_stage_one_job,
                         .job_id = kvm_stage_job_id,
                         .work = work,
                         .teardown = teardown,
                         .model_id = model_id};
    return kvm_stage_main(argc, argv, &ops, &st);
}
