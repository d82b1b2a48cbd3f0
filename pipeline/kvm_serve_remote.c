/* kvm_serve_remote.c: caches to and from the store service (kvm_serve_remote.h). */
#include "pipeline/kvm_serve_remote.h"
#include "model/kvm_model_window.h"
#include "common/kvm_error.h"
#include "model/kvm_forward.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_orch_remote.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvm_serve_remote_is_endpoint(const char *store)
{
    return store && (!strncmp(store, "tcp://", 6) || !strncmp(store, "ipc://", 6));
}

const char *kvm_serve_remote_endpoint(const char *store, const kvm_config *cfg)
{
    if (kvm_serve_remote_is_endpoint(store)) return store;
    if (store && *store) return NULL; /* an LMDB directory named on the command line */
    const char *s = cfg ? kvm_config_str(cfg, "store", "service") : "";
    return *s ? s : NULL;
}

int kvm_serve_remote_store(kvm_storecli *svc, const kvm_config *cfg, const kvm_worker_model *wm, const int32_t *tokens,
                           int64_t n_tokens, const kvm_kvcache *cc, const uint8_t *strategy, size_t strategy_len,
                           uint64_t job_id, const char *doc_name, int64_t *bytes)
{
    kvm_serve_cache_enc e;
    int rc = kvm_serve_cache_encode(NULL, strategy, strategy_len, cfg, wm, tokens, n_tokens, cc, &e);
    if (rc) return rc;
    rc = kvm_storecli_put(svc, &e, job_id, doc_name, (int)kvm_config_int(cfg, "store", "upload_timeout_ms"), 3, bytes);
    kvm_serve_cache_enc_free(&e);
    return rc;
}

int kvm_serve_remote_load(kvm_storecli *svc, const kvm_config *cfg, const kvm_store_cache_key *key, const kvm_model *m,
                          int64_t extra_per_head, kvm_kvcache **out, int64_t *n_tokens)
{
    *out = NULL;
    kvm_msg **layers = NULL;
    int n = 0;
    kvm_kvcache *c = NULL;
    kvm_proto_cache pc = {0};
    /* a reply is a few messages read from LMDB, not an upload: wait as long as for a claim, so a
     * service that is down is an error answer well within kvmill ask's default timeout (90 s) */
    int rc = kvm_storecli_get(svc, key, kvm_orch_remote_timeout_ms(cfg), &layers, &n);
    if (rc) return rc;
    if (n != m->cfg.n_layers) rc = kvm_err(KVM_EMISMATCH, "the served cache has %d layers, the model %d", n, m->cfg.n_layers);
    if (!rc && (rc = kvm_proto_cache_decode(layers[0], &pc)))
        rc = kvm_err(KVM_ECORRUPT, "served cache layer 0 does not decode");
    if (!rc && (pc.n_tokens < 1 || pc.n_tokens > kvm_model_window(&m->cfg)))
        rc = kvm_err(KVM_ECORRUPT, "served cache is for %lld tokens, outside the model's window", (long long)pc.n_tokens);
    int64_t N = pc.n_tokens;
    if (!rc) rc = kvm_forward_cache_new(m, extra_per_head > 0 ? extra_per_head : 1, &c);
    for (int l = 0; !rc && l < n; l++)
        if ((rc = kvm_cachecodec_decode_layer(layers[l], l, c)) && rc != KVM_EMISMATCH && rc != KVM_ENOMEM) {
            char why[512];
            snprintf(why, sizeof why, "%s", kvm_errmsg());
            rc = kvm_err(KVM_ECORRUPT, "served cache layer %d does not decode: %s", l, why);
        }
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int g = 0; !rc && g < c->n_kv_heads; g++) {
            kvm_kv_head *h = kvm_kvcache_head(c, l, g);
            rc = kvm_kvcache_reserve(h, c->head_dim, h->n + (extra_per_head > 0 ? extra_per_head : 0));
        }
    for (int l = 0; l < n; l++)
        kvm_msg_free(&layers[l]);
    free(layers);
    if (rc) {
        kvm_kvcache_free(&c);
        return rc;
    }
    c->next_pos = (int32_t)N;
    if (n_tokens) *n_tokens = N;
    *out = c;
    return 0;
}

int kvm_serve_remote_strategy(kvm_storecli *svc, const kvm_config *cfg, const kvm_store_id *model_id, uint8_t **data,
                              size_t *len)
{
    return kvm_storecli_get_strategy(svc, model_id, kvm_config_str(cfg, "compress", "strategy"),
                                     kvm_orch_remote_timeout_ms(cfg), 3, data, len);
}
