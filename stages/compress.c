/* compress.c: the kvmill-compress stage: receives a job and its per-layer `kv` messages,
 * compresses the cache with the configured method (eviction patterns and/or KVSculpt per
 * layer), writes all layers and the manifest to the store in one transaction, then acks.
 * With --store tcp://... or ipc://... (or [store] service of the job's settings) the cache is
 * uploaded to the store service on the store's host instead (no LMDB opened here), and the
 * job is acked only after the service replied that it committed the cache. Such a worker
 * fetches the PolyKV strategy from the service (get_strategy) for every job, so a
 * recalibration during a run reaches it with its next job. With --device cuda:N the
 * sculpt-family solvers run on that GPU (the sculpt `device` setting) and so does the [eval]
 * evaluation (the full-KV reference and the continuation over the stored cache, on the device
 * forward: pipeline/kvm_devmodel.h; a model the device cannot run is evaluated on the CPU,
 * said once), as do the [compress] target_kl search's reference and probe continuations; the
 * forward passes of query construction (query_source, on_policy) and the search's local
 * prefill stay on the CPU (they need the host forward's capture hooks). */
#include "pipeline/kvm_devmodel.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_serve_cache.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_storew.h"
#include "pipeline/kvm_target.h"
#include "pipeline/kvm_worker.h"
#include "compress/eval/kvm_eval.h"
#ifdef KVM_WITH_CUDA
#include "compress/eval/kvm_eval_cuda.h"
#endif
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "proto/kvm_half.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct compress_state {
    kvm_worker_model wm;
    kvm_store *store;       /* opened in setup (--config) or with the first job's settings */
    const char *store_path; /* --store */
    kvm_storecli *svc;      /* the store service, when the store is remote */
    kvm_config *own_cfg;    /* --config, for its [security] keys */
    uint8_t *strategy;      /* remote store, polykv: the strategy record fetched from the service */
    size_t strategy_len;
    kvm_store_id strategy_model; /* ... for this model id */
    char strategy_name[KVM_STORE_MAX_NAME + 1]; /* ... and this [compress] strategy */
    const char *server_key, *client_public, *client_secret; /* the stage's CurveZMQ arguments */
    char worker_id[256];
    const char *device;     /* --device: the solver's (kvm_compress_input.device) */
    kvm_devmodel dev;       /* --device cuda:N: the [eval] evaluation's device forward */
} compress_state;

/* Remote store: the store service client, opened with the first job's settings. */
static int svc_open(compress_state *st, const kvm_config *c)
{
    if (st->svc) return 0;
    kvm_storecli_keys k = kvm_storecli_keys_of(st->own_cfg, st->server_key, st->client_public, st->client_secret);
    return kvm_storecli_open(&k, kvm_serve_remote_endpoint(st->store_path, c), &st->svc);
}

/* Remote store, method polykv: the strategy this job compresses with, fetched from the
 * service for every job (a few KB next to the job's MB of KV), as a worker on the store's
 * host reads it from LMDB for every job: a strategy recalibrated during a run reaches this
 * worker with its next job, and the cache's config id, made from these bytes, is always that
 * of the strategy that made it. The last bytes are kept to tell a change (logged). */
static int remote_strategy(compress_state *st, const kvm_config *c)
{
    const char *name = kvm_config_str(c, "compress", "strategy");
    if (strlen(name) > KVM_STORE_MAX_NAME)
        return kvm_err(KVM_EINVAL, "[compress] strategy is %zu bytes long, at most %d", strlen(name),
                       KVM_STORE_MAX_NAME);
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = svc_open(st, c);
    if (!rc) rc = kvm_serve_remote_strategy(st->svc, c, &st->wm.model_id, &buf, &len);
    if (rc) return rc;
    int same_key = st->strategy && !memcmp(&st->strategy_model, &st->wm.model_id, sizeof st->strategy_model) &&
                   !strcmp(st->strategy_name, name);
    int same = same_key && len == st->strategy_len && !memcmp(buf, st->strategy, len);
    if (!same)
        kvm_log(KVM_LOG_INFO, same_key ? "strategy_changed" : "strategy_fetched", NULL, 0,
                same_key ? "PolyKV strategy '%s' was recalibrated (%zu bytes now): caches from this job on are made with it"
                         : "fetched PolyKV strategy '%s' (%zu bytes) from the store service",
                name, len);
    free(st->strategy);
    st->strategy = buf, st->strategy_len = len;
    st->strategy_model = st->wm.model_id;
    snprintf(st->strategy_name, sizeof st->strategy_name, "%s", name);
    return 0;
}

/* Remote store: the cache goes to the store service (its bytes sent: out->stored_bytes). */
static int upload(compress_state *st, const kvm_config *c, const kvm_proto_job *j, const kvm_kvcache *cc,
                  kvm_stage_out *out)
{
    int rc = svc_open(st, c);
    if (rc) return rc;
    const int polykv = !strcmp(kvm_config_str(c, "compress", "method"), "polykv");
    kvm_store_doc_meta named; /* the name as the store keeps it: cut at a character */
    kvm_store_doc_set_source(&named, j->doc_name.ptr, j->doc_name.len);
    const char *name = named.source;
    double t0 = kvm_now_ms();
    rc = kvm_serve_remote_store(st->svc, c, &st->wm, j->tokens, j->n_tokens, cc, polykv ? st->strategy : NULL,
                                polykv ? st->strategy_len : 0, j->job_id, name, &out->stored_bytes);
    out->transport_ms += kvm_now_ms() - t0;
    out->store_ms += kvm_now_ms() - t0;
    return rc;
}

/* The store opens with [store] settings: of --config when given, else of the first job. */
static int setup_store(void *stp, const kvm_stage_args *a)
{
    compress_state *st = stp;
    st->wm.override = a->model;
    snprintf(st->worker_id, sizeof st->worker_id, "%s", a->worker_id ? a->worker_id : "compress");
    if (!a->store && !a->config) return kvm_err(KVM_EINVAL, "kvmill-compress needs --store PATH|ENDPOINT or --config");
    st->store_path = a->store;
    st->server_key = a->server_key, st->client_public = a->client_public, st->client_secret = a->client_secret;
    st->device = a->device;
    int rc = kvm_stage_solver_device(a); /* a device without a CUDA solver: refused before any job */
    if (!rc)
        rc = kvm_devmodel_init(&st->dev, "compress", a->device, "the [eval] evaluation",
                               "full-KV reference and continuation over the stored cache, and target_kl's probes; "
                               "query construction's forward passes stay on the CPU");
    if (rc) return rc;
    /* a --store that is no store is refused here (exit 2), not created by the first job's open */
    if (!a->config) return kvm_serve_remote_endpoint(a->store, NULL) ? 0 : kvm_storew_must_exist("--store", a->store);
    rc = kvm_config_load(a->config, &st->own_cfg);
    if (!rc && !kvm_serve_remote_endpoint(a->store, st->own_cfg)) {
        rc = a->store ? kvm_storew_must_exist("--store", a->store)
                      : kvm_storew_must_exist("[store] path", kvm_config_str(st->own_cfg, "store", "path"));
        if (!rc) rc = kvm_storew_open_worker(st->own_cfg, a->store, &st->store);
    }
    return rc;
}

static int setup(void *stp, const kvm_stage_args *a)
{
    compress_state *st = stp;
    int rc = setup_store(st, a);
    if (!rc) kvm_worker_model_id_early(&st->wm, st->store); /* ready names a --model */
    return rc;
}

/* The stage's model for ready (kvm_stage_ops.model_id). */
static const uint8_t *model_id(void *stp) { return kvm_worker_model_id(&((compress_state *)stp)->wm); }

static int complete(void *st, kvm_msg *const *in, int n_in)
{
    kvm_proto_type t;
    int rc = kvm_proto_peek(in[n_in - 1], &t);
    if (rc) return rc;
    if (n_in == 1) return t == KVM_PROTO_JOB ? 0 : kvm_err(KVM_EPROTO, "expected a job message first, got %s", kvm_proto_type_name(t));
    if (t != KVM_PROTO_KV) return kvm_err(KVM_EPROTO, "expected kv message %d of the job, got %s", n_in - 1, kvm_proto_type_name(t));
    kvm_proto_kv kv;
    if ((rc = kvm_proto_kv_decode(in[n_in - 1], &kv))) return rc;
    if (kv.layer != n_in - 2) return kvm_err(KVM_EPROTO, "kv message for layer %lld arrived as layer %d", (long long)kv.layer, n_in - 2);
    return kv.layer == kv.n_layers - 1;
}

/* Rebuilds the full cache and the capture from the kv messages in[1..]. */
static int load_layers(const kvm_model *m, kvm_msg *const *in, int n_layers, int64_t n, kvm_kvcache **full, kvm_capture **cap)
{
    const kvm_model_config *c = &m->cfg;
    if (n_layers != c->n_layers) return kvm_err(KVM_EMISMATCH, "job has %d layers, the model %d", n_layers, c->n_layers);
    kvm_capture_opts co = {.want_queries = 1, .want_stats = 1};
    int rc;
    if ((rc = kvm_capture_new(c, n, &co, cap)) || (rc = kvm_forward_cache_new(m, n, full))) return rc;
    (*full)->next_pos = (int32_t)n;
    const size_t d = (size_t)c->head_dim, N = (size_t)n;
    for (int l = 0; l < n_layers; l++) {
        kvm_proto_kv kv;
        if ((rc = kvm_proto_kv_decode(in[1 + l], &kv))) return rc;
        if (kv.n_tokens != n || kv.n_heads != c->n_heads || kv.n_kv_heads != c->n_kv_heads || kv.head_dim != c->head_dim ||
            !kv.q_pre || !kv.q_post || kv.n_queries != n)
            return kvm_err(KVM_EMISMATCH, "kv layer %d: shapes or queries do not match the model and job", l);
        kvm_capture_layer *L = kvm_capture_layer_mut(*cap, l);
        /* widened from the wire dtype ([run] wire_dtype): exact for f16/bf16, a copy for f32 */
        const size_t kvn = (size_t)c->n_kv_heads * N * d, qn = (size_t)c->n_heads * N * d;
        if ((rc = kvm_half_convert(L->k, KVM_PROTO_F32, kv.keys, kv.dtype, kvn)) ||
            (rc = kvm_half_convert(L->v, KVM_PROTO_F32, kv.values, kv.dtype, kvn)) ||
            (rc = kvm_half_convert(L->q_pre, KVM_PROTO_F32, kv.q_pre, kv.dtype, qn)) ||
            (rc = kvm_half_convert(L->q, KVM_PROTO_F32, kv.q_post, kv.dtype, qn)))
            return rc;
        memcpy(L->entropy, kv.entropy, (size_t)c->n_heads * N * sizeof(float));
        memcpy(L->mass, kv.attn_mass, (size_t)c->n_heads * N * sizeof(float));
        for (int g = 0; g < c->n_kv_heads; g++) {
            kvm_kv_head *h = kvm_kvcache_head(*full, l, g);
            memcpy(h->k, L->k + (size_t)g * N * d, N * d * sizeof(float));
            memcpy(h->v, L->v + (size_t)g * N * d, N * d * sizeof(float));
            for (int64_t t = 0; t < n; t++) h->pos[t] = (int32_t)t, h->bias[t] = 0.0f;
            h->n = n;
        }
    }
    return 0;
}

/* The evaluation's KL on the worker's device forward (st->dev), tokens all[0, N + T): 0 with
 * *done = 1, or 0 with *done = 0 when the worker is on the CPU or the device cannot run the
 * model (the host then evaluates), or the device's error. */
static int evaluate_device(compress_state *st, const kvm_config *cfg, const int32_t *all, int64_t N, int64_t T,
                           const kvm_kvcache *cc, kvm_eval_result *r, int *done)
{
    *done = 0;
#ifdef KVM_WITH_CUDA
    kvm_cuda_model *dm = NULL;
    kvm_eval_cuda_doc *d = NULL;
    int rc = kvm_devmodel_get(&st->dev, st->wm.model, &st->wm.model_id, cfg, N + T, &dm);
    if (rc || !dm) return rc;
    if (!(rc = kvm_eval_cuda_doc_new(dm, &st->wm.model->cfg, all, N, T, &d))) rc = kvm_eval_cuda_continue(d, cc, r);
    kvm_eval_cuda_doc_free(&d);
    *done = !rc;
    return rc;
#else
    (void)st, (void)cfg, (void)all, (void)N, (void)T, (void)cc, (void)r;
    return 0;
#endif
}

/* KL(full ‖ compressed) over the job's continuation ([eval] enabled): the full-KV reference
 * is recomputed here from the tokens (on the worker's device when it has one), the
 * compressed cache is the one just stored. A failed evaluation is logged, never fails the job
 * (the cache is already committed). */
static void evaluate(compress_state *st, const kvm_config *cfg, const kvm_proto_job *j, const kvm_kvcache *cc,
                     kvm_stage_out *out)
{
    const kvm_model *m = st->wm.model;
    int64_t n = j->n_tokens + j->n_continuation;
    int32_t *all = malloc((size_t)n * sizeof *all);
    kvm_eval_doc *d = NULL;
    kvm_eval_result r;
    int done = 0;
    if (!all) return;
    memcpy(all, j->tokens, (size_t)j->n_tokens * sizeof *all);
    memcpy(all + j->n_tokens, j->continuation, (size_t)j->n_continuation * sizeof *all);
    int rc = evaluate_device(st, cfg, all, j->n_tokens, j->n_continuation, cc, &r, &done);
    if (!rc && !done && !(rc = kvm_eval_doc_new(m, NULL, all, n, j->n_tokens, j->n_continuation, &d)))
        rc = kvm_eval_continue(d, cc, NULL, NULL, &r);
    if (!rc && !isfinite(r.kl_mean)) /* the result message would carry it as 0, a perfect cache */
        rc = kvm_err(KVM_ERANGE, "KL(full || compressed) is %g: the model's logits are not finite", r.kl_mean);
    if (!rc) {
        out->evaluated = 1;
        out->kl_mean = r.kl_mean;
    } else
        kvm_log(KVM_LOG_WARN, "eval_failed", NULL, 0, "evaluation of job %llu %.*s failed: %s",
                (unsigned long long)j->job_id, (int)(j->doc_name.len < 200 ? j->doc_name.len : 200), j->doc_name.ptr,
                kvm_errmsg());
    kvm_eval_doc_free(&d);
    free(all);
}

/* [compress] target_kl: the budget search over the job's continuation (pipeline/kvm_target.h)
 * instead of one compression at [compress] budget; the check part's KL is the job's
 * evaluation (the summary's mean), and the choice is logged. */
static int compress_to_target(compress_state *st, kvm_config *cfg, const kvm_compress_input *ci,
                              const kvm_proto_job *j, kvm_store *store, kvm_kvcache **cc, kvm_stage_out *out)
{
    kvm_target_result tr;
    int rc = kvm_target_compress(cfg, ci, j->continuation, j->continuation ? j->n_continuation : 0, store,
                                 &st->wm.model_id, &st->dev, cc, &tr);
    if (rc) return rc;
    if (isfinite(tr.kl_check)) out->evaluated = 1, out->kl_mean = tr.kl_check; /* else not counted (kvm_stage.c) */
    char ctx_note[96] = "";
    if (tr.n_ctx_search != ci->n_tokens)
        snprintf(ctx_note, sizeof ctx_note, " (searched on its first %lld tokens, budget scaled to %lld)",
                 (long long)tr.n_ctx_search, (long long)ci->n_tokens);
    kvm_log(KVM_LOG_INFO, "target_kl", NULL, 0,
            "job %llu %.*s: budget %lld, KL %.6g on the search part%s, %.6g on the check part, %d probes, %d "
            "nonmonotone%s",
            (unsigned long long)j->job_id, (int)(j->doc_name.len < 200 ? j->doc_name.len : 200), j->doc_name.ptr,
            (long long)tr.budget, tr.kl_search, tr.reached ? "" : " (target not reached)", tr.kl_check, tr.probes,
            tr.nonmonotone, ctx_note);
    return 0;
}

/* What the store knows about the model and the document, for `kvmill store` listings. A
 * failure here is logged: the cache itself is already committed. */
static void record_meta(compress_state *st, const kvm_proto_job *j)
{
    const kvm_model *m = st->wm.model;
    const kvm_model_config *c = &m->cfg;
    kvm_store_model_meta mm = {.dim = c->dim, .hidden_dim = c->hidden_dim, .n_layers = c->n_layers,
                               .n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                               .vocab_size = c->vocab_size, .seq_len = c->seq_len};
    const char *slash = strrchr(st->wm.path, '/');
    snprintf(mm.name, sizeof mm.name, "%s", slash ? slash + 1 : st->wm.path);
    snprintf(mm.source, sizeof mm.source, "%s", st->wm.path);
    kvm_store_doc_meta dm = {.n_tokens = j->n_tokens};
    kvm_store_doc_set_source(&dm, j->doc_name.ptr, j->doc_name.len);
    kvm_store_id doc;
    if (kvm_store_put_model(st->store, &st->wm.model_id, &mm) || kvm_store_doc_hash(j->tokens, j->n_tokens, &doc) ||
        kvm_store_put_doc(st->store, &doc, &dm))
        kvm_log(KVM_LOG_WARN, "meta_failed", NULL, 0, "could not record model/document metadata: %s", kvm_errmsg());
}

/* The cache is stored under the config id computed from the strategy read when it was
 * stored; the compression read it a moment before. When a recalibration replaced the
 * strategy in between (the id changed since `before`), the cache may hold the old
 * strategy under the new id: it is removed and the job is handed back to be redone. */
static int check_strategy_kept(compress_state *st, const kvm_config *cfg, const kvm_proto_job *j,
                               const kvm_store_id *before)
{
    kvm_store_cache_key key = {.model_id = st->wm.model_id};
    int rc = kvm_jobcfg_config_id_in(cfg, st->store, &st->wm.model_id, &key.config_id, NULL, NULL);
    if (rc || !memcmp(&key.config_id, before, sizeof *before)) return rc;
    if ((rc = kvm_store_doc_hash(j->tokens, j->n_tokens, &key.doc_hash))) return rc;
    kvm_store_rm_cache(st->store, &key);
    return kvm_err(KVM_ESTATE, "the PolyKV strategy was replaced while job %llu was compressed: compressing it again",
                   (unsigned long long)j->job_id);
}

static int work(void *stp, kvm_msg *const *in, int n_in, kvm_stage_out *out, int *retryable)
{
    compress_state *st = stp;
    kvm_proto_job j;
    kvm_config *cfg = NULL;
    kvm_kvcache *full = NULL, *cc = NULL;
    kvm_capture *cap = NULL;
    int32_t *rp = NULL; /* the repeat prompt (query_source repeat) */
    int64_t n_rp = 0;
    int rc = kvm_proto_job_decode(in[0], &j);
    if (!rc && !j.settings) rc = kvm_err(KVM_EPROTO, "job %llu carries no settings", (unsigned long long)j.job_id);
    if (!rc) rc = kvm_jobcfg_unpack(j.settings, j.settings_bytes, &cfg);
    const uint8_t *run_model = !rc && j.has_model_id ? j.model_id : NULL; /* revision 10 */
    int remote = !rc && kvm_serve_remote_endpoint(st->store_path, cfg);
    /* [compress] target_kl: a budget search in place of one compression (its check part is the evaluation) */
    const int target = !rc && kvm_config_float(cfg, "compress", "target_kl") > 0;
    if (!rc && !remote && !st->store) rc = kvm_storew_open_worker(cfg, st->store_path, &st->store);
    if (rc) { *retryable = 0; goto done; }
    if (remote) {
        if ((rc = kvm_worker_model_for_job(&st->wm, cfg, NULL, run_model, &out->other_model))) {
            *retryable = kvm_worker_model_retryable(rc);
            goto done;
        }
        /* no strategy stored is not fixed by another attempt; no reply (KVM_EIO) may be */
        if (!strcmp(kvm_config_str(cfg, "compress", "method"), "polykv") && (rc = remote_strategy(st, cfg))) {
            *retryable = rc == KVM_EIO;
            goto done;
        }
        if ((rc = load_layers(st->wm.model, in, n_in - 1, j.n_tokens, &full, &cap)) ||
            (rc = kvm_worker_repeat_prompt(cfg, &st->wm, &rp, &n_rp))) { *retryable = 0; goto done; }
        kvm_compress_input ri = {.model = st->wm.model, .full = full, .cap = cap, .n_tokens = j.n_tokens, .tokens = j.tokens,
                                 .n_future = kvm_config_int(cfg, "compress", "future"), .device = st->device,
                                 .repeat_prompt = rp, .n_repeat_prompt = n_rp};
        rc = target
                 ? compress_to_target(st, cfg, &ri, &j, NULL, &cc, out)
                 : kvm_worker_compress_with(cfg, &ri, st->strategy, st->strategy_len, &cc);
        if (rc) { *retryable = rc == KVM_ENOMEM; goto done; }
        /* no reply at all: the service is down or the link cut; requeueing may succeed */
        if ((rc = upload(st, cfg, &j, cc, out))) { *retryable = rc == KVM_EIO; goto done; }
        goto evaluated;
    }
    if ((rc = kvm_worker_model_for_job(&st->wm, cfg, st->store, run_model, &out->other_model))) {
        *retryable = kvm_worker_model_retryable(rc);
        goto done;
    }
    double t0 = kvm_now_ms();
    if ((rc = load_layers(st->wm.model, in, n_in - 1, j.n_tokens, &full, &cap)) ||
        (rc = kvm_worker_repeat_prompt(cfg, &st->wm, &rp, &n_rp))) { *retryable = 0; goto done; }
    out->transport_ms += kvm_now_ms() - t0;
    kvm_compress_input ci = {.model = st->wm.model, .full = full, .cap = cap, .n_tokens = j.n_tokens, .tokens = j.tokens,
                             .n_future = kvm_config_int(cfg, "compress", "future"), .progress = &out->progress,
                             .device = st->device, .repeat_prompt = rp, .n_repeat_prompt = n_rp};
    kvm_store_id before;
    if ((rc = kvm_jobcfg_config_id_in(cfg, st->store, &st->wm.model_id, &before, NULL, NULL))) { *retryable = 0; goto done; }
    rc = target
             ? compress_to_target(st, cfg, &ci, &j, st->store, &cc, out)
             : kvm_worker_compress(cfg, &ci, st->store, &st->wm.model_id, &cc);
    if (rc) { *retryable = rc == KVM_ENOMEM; goto done; }
    double ts = kvm_now_ms();
    if ((rc = kvm_serve_cache_store(st->store, cfg, &st->wm, j.tokens, j.n_tokens, cc, &out->stored_bytes))) goto done;
    out->store_ms += kvm_now_ms() - ts;
    if ((rc = check_strategy_kept(st, cfg, &j, &before))) {
        *retryable = 1;
        goto done;
    }
    record_meta(st, &j);
evaluated:
    if (kvm_config_bool(cfg, "eval", "enabled") && j.continuation && j.n_continuation > 0 && !target)
        evaluate(st, cfg, &j, cc, out);
    else if (kvm_config_bool(cfg, "eval", "enabled") && !target) /* the run's summary counts these; this names them */
        kvm_log(KVM_LOG_INFO, "eval_skipped", NULL, 0,
                "job %llu %.*s: not evaluated ([eval] enabled): no tokens follow its %lld-token context to score as "
                "the continuation (the document is no longer than [model] context)",
                (unsigned long long)j.job_id, (int)(j.doc_name.len < 200 ? j.doc_name.len : 200), j.doc_name.ptr,
                (long long)j.n_tokens);
    kvm_proto_ack ack = {.worker_id = kvm_proto_str_c(st->worker_id), .stage = kvm_proto_str_c("compress"),
                         .pid = getpid(), .job_id = j.job_id};
    if ((rc = kvm_proto_ack_encode(&ack, &out->ctl[out->n_ctl]))) goto done;
    out->n_ctl++;
done:
    free(rp);
    kvm_capture_free(&cap);
    kvm_kvcache_free(&full);
    kvm_kvcache_free(&cc);
    kvm_config_free(&cfg);
    return rc;
}

static void teardown(void *stp)
{
    compress_state *st = stp;
    kvm_devmodel_deinit(&st->dev);
    kvm_worker_model_free(&st->wm);
    kvm_store_close(&st->store);
    kvm_storecli_close(&st->svc);
    kvm_config_free(&st->own_cfg);
    free(st->strategy);
}

int main(int argc, char **argv)
{
    static compress_state st;
    kvm_stage_ops ops = {.stage = "compress",
                         .setup = setup,
                         .complete = complete,
                         .job_id = kvm_stage_job_id,
                         .work = work,
                         .teardown = teardown,
                         .model_id = model_id};
    return kvm_stage_main(argc, argv, &ops, &st);
}
