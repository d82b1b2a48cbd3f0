/* prefill.c: the kvmill-prefill stage: runs the model over a job's document in one batched
 * prefill and emits, per layer, a `kv` message with the post-RoPE keys and values, the pre-
 * and post-RoPE queries and the attention statistics that compression needs. With --device
 * cuda:N the prefill runs on that GPU (model/kvm_forward_cuda.h: the same tensors, the
 * statistics made by the device's attention kernel, downloaded once) and the messages are the
 * CPU's: the wire knows no device. The weights are float32 there, or bf16/f16 with float32
 * accumulation by [model] weight_dtype. A model the device cannot run (sliding-window
 * attention) is prefilled on the CPU instead, said once on stderr. */
#include "pipeline/kvm_devmodel.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_worker.h"
#include "model/kvm_capture.h"
#include "common/kvm_error.h"
#ifdef KVM_WITH_CUDA
#include "model/kvm_forward_cuda.h"
#endif

#include <stdlib.h>
#include <string.h>

#include "proto/kvm_half.h"

typedef struct prefill_state {
    kvm_worker_model wm;
    kvm_devmodel dev; /* --device cuda:N: the device forward (pipeline/kvm_devmodel.h) */
} prefill_state;

static int setup(void *stp, const kvm_stage_args *a)
{
    prefill_state *st = stp;
    st->wm.override = a->model;
    kvm_worker_model_id_early(&st->wm, NULL); /* ready names a --model (another model is refused) */
    /* kvm_stage_main has checked the device */
    return kvm_devmodel_init(&st->dev, "prefill", a->device, "prefill",
                             "the KV, queries and statistics downloaded once per job");
}

/* One f32 tensor of n elements (layer's `what`) as the wire dtype: src itself for f32, else a
 * converted copy in *tmp (the caller frees it after encoding; the encoder copies the frame). A
 * finite value the wire dtype would turn into inf is refused (KVM_ERANGE), named: an f16 wire
 * sent +-inf on, and the document failed later "not a finite number", blaming the model. */
static int wire_tensor(const float *src, size_t n, kvm_proto_dtype dt, int layer, const char *what, void **tmp,
                       const void **out)
{
    *out = src;
    if (dt == KVM_PROTO_F32 || !src) return 0;
    for (size_t i = 0; i < n; i++)
        if (kvm_half_overflows(src[i], dt))
            return kvm_err(KVM_ERANGE,
                           "layer %d %s: value %g exceeds %s's range on the wire ([run] wire_dtype = %s): set "
                           "wire_dtype = %s",
                           layer, what, (double)src[i], kvm_proto_dtype_name(dt), kvm_proto_dtype_name(dt),
                           dt == KVM_PROTO_F16 ? "bf16 or f32" : "f32");
    if (!(*tmp = malloc(n * kvm_proto_dtype_size(dt) + 1))) return kvm_err(KVM_ENOMEM, "prefill: out of memory for the wire copy");
    *out = *tmp;
    return kvm_half_convert(*tmp, dt, src, KVM_PROTO_F32, n);
}

/* Emits one kv message per layer; keys, values and queries in the wire dtype ([run]
 * wire_dtype), the attention statistics always f32 (signals sum them). */
static int emit_layers(const kvm_model *m, const kvm_capture *cap, uint64_t id, int64_t n, kvm_proto_dtype dt,
                       kvm_stage_out *out)
{
    const kvm_model_config *c = &m->cfg;
    const size_t kvn = (size_t)c->n_kv_heads * (size_t)n * (size_t)c->head_dim;
    const size_t qn = (size_t)c->n_heads * (size_t)n * (size_t)c->head_dim;
    int rc = 0;
    for (int l = 0; l < c->n_layers && !rc; l++) {
        const kvm_capture_layer *L = kvm_capture_layer_get(cap, l);
        kvm_proto_kv kv = {.job_id = id, .layer = l, .n_layers = c->n_layers, .n_tokens = n, .n_heads = c->n_heads,
                           .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .q_start = 0, .n_queries = n,
                           .dtype = dt, .entropy = L->entropy, .attn_mass = L->mass};
        void *tmp[4] = {NULL, NULL, NULL, NULL};
        if (!(rc = wire_tensor(L->k, kvn, dt, l, "keys", &tmp[0], &kv.keys)) &&
            !(rc = wire_tensor(L->v, kvn, dt, l, "values", &tmp[1], &kv.values)) &&
            !(rc = wire_tensor(L->q_pre, qn, dt, l, "queries (pre-RoPE)", &tmp[2], &kv.q_pre)) &&
            !(rc = wire_tensor(L->q, qn, dt, l, "queries", &tmp[3], &kv.q_post)) &&
            !(rc = kvm_proto_kv_encode(&kv, &out->data[out->n_data])))
            out->n_data++;
        for (int i = 0; i < 4; i++) free(tmp[i]);
    }
    return rc;
}

/* The host forward's prefill of tokens[0, n) into cap through its capture hooks. */
static int host_prefill(const kvm_model *m, const int32_t *tokens, int64_t n, kvm_capture *cap)
{
    kvm_forward *f = NULL;
    kvm_kvcache *cache = NULL;
    int rc;
    if (!(rc = kvm_forward_new(m, NULL, n, &f)) && !(rc = kvm_forward_add_hooks(f, kvm_capture_hooks(cap))) &&
        !(rc = kvm_forward_cache_new(m, n, &cache)))
        rc = kvm_forward_prefill(f, cache, tokens, n, NULL, KVM_LOGITS_NONE);
    kvm_kvcache_free(&cache);
    kvm_forward_free(&f);
    return rc;
}

/* The job's capture: on the device (--device cuda:N, with config c's [model] weight_dtype) or
 * through the host forward's hooks (also for a model the device cannot run). */
static int prefill(prefill_state *st, const kvm_config *c, const int32_t *tokens, int64_t n, kvm_capture *cap)
{
#ifdef KVM_WITH_CUDA
    kvm_cuda_model *dm = NULL;
    int rc = kvm_devmodel_get(&st->dev, st->wm.model, &st->wm.model_id, c, n, &dm);
    if (rc || dm) return rc ? rc : kvm_capture_cuda_prefill(dm, &st->wm.model->cfg, tokens, n, cap);
#else
    (void)c;
#endif
    return host_prefill(st->wm.model, tokens, n, cap);
}

static int work(void *stp, kvm_msg *const *in, int n_in, kvm_stage_out *out, int *retryable)
{
    prefill_state *st = stp;
    kvm_proto_job j;
    kvm_config *cfg = NULL;
    kvm_capture *cap = NULL;
    int rc = kvm_proto_job_decode(in[0], &j);
    if (!rc && !j.settings) rc = kvm_err(KVM_EPROTO, "job %llu carries no settings", (unsigned long long)j.job_id);
    if (!rc) rc = kvm_jobcfg_unpack(j.settings, j.settings_bytes, &cfg);
    if (rc) { *retryable = 0; goto done; }
    if ((rc = kvm_worker_model_for_job(&st->wm, cfg, NULL, j.has_model_id ? j.model_id : NULL, &out->other_model))) {
        *retryable = kvm_worker_model_retryable(rc);
        goto done;
    }
    const kvm_model *m = st->wm.model;
    for (int64_t i = 0; i < j.n_tokens; i++)
        if (j.tokens[i] >= m->cfg.vocab_size) {
            rc = kvm_err(KVM_EINVAL, "job %llu: token %lld = %d is outside the model's vocabulary", (unsigned long long)j.job_id,
                         (long long)i, j.tokens[i]);
            *retryable = 0;
            goto done;
        }
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    if ((rc = kvm_capture_new(&m->cfg, j.n_tokens, &co, &cap)) || (rc = prefill(st, cfg, j.tokens, j.n_tokens, cap)))
        goto done;
    double t0 = kvm_now_ms();
    kvm_proto_dtype wire = KVM_PROTO_F32;
    const char *wn = kvm_config_str(cfg, "run", "wire_dtype");
    if ((rc = kvm_proto_dtype_parse(wn, strlen(wn), &wire))) goto done;
    rc = emit_layers(m, cap, j.job_id, j.n_tokens, wire, out);
    if (rc == KVM_ERANGE) *retryable = 0; /* the same values overflow the wire again */
    out->transport_ms += kvm_now_ms() - t0;
done:
    kvm_capture_free(&cap);
    kvm_config_free(&cfg);
    return rc;
}

/* The stage's model for ready (kvm_stage_ops.model_id). */
static const uint8_t *model_id(void *stp) { return kvm_worker_model_id(&((prefill_state *)stp)->wm); }

static void teardown(void *stp)
{
    prefill_state *st = stp;
    kvm_devmodel_deinit(&st->dev);
    kvm_worker_model_free(&st->wm);
}

int main(int argc, char **argv)
{
    static prefill_state st;
    kvm_stage_ops ops = {.stage = "prefill",
                         .setup = setup,
                         .complete = kvm_stage_one_job,
                         .job_id = kvm_stage_job_id,
                         .work = work,
                         .teardown = teardown,
                         .model_id = model_id};
    return kvm_stage_main(argc, argv, &ops, &st);
}
