/* kvm_serve_cache.c: store and load a document's compressed cache (wire encoding). */
#include "pipeline/kvm_serve_cache.h"
#include "model/kvm_model_window.h"
#include "common/kvm_error.h"
#include "model/kvm_forward.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_jobcfg.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvm_serve_cache_encode(kvm_store *store, const uint8_t *strategy, size_t strategy_len, const kvm_config *cfg,
                           const kvm_worker_model *wm, const int32_t *tokens, int64_t n_tokens, const kvm_kvcache *cc,
                           kvm_serve_cache_enc *out)
{
    memset(out, 0, sizeof *out);
    kvm_proto_dtype dtype;
    const char *dn = kvm_config_str(cfg, "store", "dtype");
    int rc = kvm_proto_dtype_parse(dn, strlen(dn), &dtype);
    int L = cc->n_layers;
    out->n_layers = L;
    out->msgs = calloc((size_t)L, sizeof *out->msgs);
    out->man = (kvm_store_manifest){.n_layers = L,
                                    .n_tokens = n_tokens,
                                    .n_entries = kvm_kvcache_entries(cc),
                                    .full_bytes = kvm_model_kv_bytes(&wm->model->cfg, n_tokens),
                                    .model_id = wm->model_id,
                                    .tokenizer_id = wm->tok_id};
    if (!rc && !out->msgs) rc = kvm_err(KVM_ENOMEM, "storing a cache: out of memory");
    for (int l = 0; !rc && l < L; l++)
        rc = kvm_cachecodec_encode_layer(cc, l, n_tokens, dtype, &out->msgs[l]);
    if (!rc)
        rc = strategy ? kvm_jobcfg_config_id_with(cfg, strategy, strategy_len, &out->man.config_id, &out->canon, &out->canon_n)
                      : kvm_jobcfg_config_id_in(cfg, store, &wm->model_id, &out->man.config_id, &out->canon, &out->canon_n);
    if (!rc) rc = kvm_store_doc_hash(tokens, n_tokens, &out->man.doc_hash);
    if (!rc) {
        snprintf(out->man.dtype, sizeof out->man.dtype, "%s", dn);
        out->man.config = (kvm_frame){.data = (const uint8_t *)out->canon, .size = out->canon_n};
    }
    if (rc) kvm_serve_cache_enc_free(out);
    return rc;
}

void kvm_serve_cache_enc_free(kvm_serve_cache_enc *e)
{
    for (int l = 0; e->msgs && l < e->n_layers; l++)
        kvm_msg_free(&e->msgs[l]);
    free(e->msgs);
    free(e->canon);
    memset(e, 0, sizeof *e);
}

int kvm_serve_cache_store(kvm_store *store, const kvm_config *cfg, const kvm_worker_model *wm, const int32_t *tokens,
                          int64_t n_tokens, const kvm_kvcache *cc, int64_t *stored_bytes)
{
    enum { MAX_FRAMES_PER_LAYER = 16 };
    kvm_serve_cache_enc e;
    int64_t bytes = 0;
    if (stored_bytes) *stored_bytes = 0;
    int rc = kvm_serve_cache_encode(store, NULL, 0, cfg, wm, tokens, n_tokens, cc, &e);
    if (rc) return rc;
    int L = e.n_layers;
    kvm_store_layer *layers = calloc((size_t)L, sizeof *layers);
    kvm_frame *frames = calloc((size_t)L * MAX_FRAMES_PER_LAYER, sizeof *frames);
    if (!layers || !frames) rc = kvm_err(KVM_ENOMEM, "storing a cache: out of memory");
    for (int l = 0; !rc && l < L; l++) {
        size_t nf = kvm_msg_nframes(e.msgs[l]);
        if (nf > MAX_FRAMES_PER_LAYER) {
            rc = kvm_err(KVM_EINVAL, "cache layer %d encodes to %zu frames (at most %d)", l, nf, MAX_FRAMES_PER_LAYER);
            break;
        }
        for (size_t f = 0; f < nf; f++) {
            frames[(size_t)l * MAX_FRAMES_PER_LAYER + f] = kvm_msg_frame(e.msgs[l], f);
            bytes += (int64_t)frames[(size_t)l * MAX_FRAMES_PER_LAYER + f].size;
        }
        layers[l] = (kvm_store_layer){.frames = &frames[(size_t)l * MAX_FRAMES_PER_LAYER], .n_frames = (uint32_t)nf};
    }
    if (!rc) rc = kvm_store_put_cache(store, &e.man, layers);
    if (!rc && stored_bytes) *stored_bytes = bytes;
    free(layers);
    free(frames);
    kvm_serve_cache_enc_free(&e);
    return rc;
}

int kvm_serve_cache_decode_layer(const kvm_store_cache *sc, int l, kvm_kvcache *c)
{
    kvm_msg *msg = NULL;
    /* the stored frames, copied: the decoder needs them aligned for their element type */
    int rc = kvm_msg_new(&msg);
    for (uint32_t f = 0; !rc && f < sc->layers[l].n_frames; f++)
        rc = kvm_msg_add_copy(msg, sc->layers[l].frames[f].data, sc->layers[l].frames[f].size);
    if (!rc && (rc = kvm_cachecodec_decode_layer(msg, l, c)) && rc != KVM_EMISMATCH && rc != KVM_ENOMEM) {
        char why[512];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        rc = kvm_err(KVM_ECORRUPT, "stored cache layer %d does not decode: %s", l, why);
    }
    kvm_msg_free(&msg);
    return rc;
}

/* The shape to decode a stored cache into: the model record's (and its layers, else 0), else
 * layer 0's own message's. */
static int check_shape(kvm_store *store, const kvm_store_cache *sc, int *n_kv_heads, int *head_dim, int32_t *seq_len,
                       int32_t *model_layers)
{
    kvm_store_model_meta mm;
    *seq_len = *model_layers = 0;
    if (kvm_store_get_model(store, &sc->manifest.model_id, &mm) == 0) {
        *n_kv_heads = mm.n_kv_heads;
        *head_dim = mm.head_dim;
        *seq_len = mm.seq_len;
        *model_layers = mm.n_layers;
        return 0;
    }
    kvm_msg *msg = NULL;
    kvm_proto_cache pc;
    int rc = kvm_msg_new(&msg);
    for (uint32_t f = 0; !rc && f < sc->layers[0].n_frames; f++)
        rc = kvm_msg_add_copy(msg, sc->layers[0].frames[f].data, sc->layers[0].frames[f].size);
    if (!rc) rc = kvm_proto_cache_decode(msg, &pc);
    kvm_msg_free(&msg);
    if (rc) return rc;
    *n_kv_heads = (int)pc.n_kv_heads;
    *head_dim = (int)pc.head_dim;
    return 0;
}

int kvm_serve_cache_check(kvm_store *store, const kvm_store_cache_key *key, kvm_store_report_fn report, void *arg,
                          int64_t *n_bad)
{
    char a[KVM_STORE_ID_HEX + 1], b[KVM_STORE_ID_HEX + 1], d[KVM_STORE_ID_HEX + 1], name[48], line[1024];
    snprintf(name, sizeof name, "%.12s:%.12s:%.12s", kvm_store_id_hex(&key->model_id, a),
             kvm_store_id_hex(&key->doc_hash, b), kvm_store_id_hex(&key->config_id, d));
    *n_bad = 0;
    kvm_store_cache *sc = NULL;
    kvm_kvcache *c = NULL;
    int rc = kvm_store_get_cache(store, key, NULL, &sc);
    if (rc == KVM_ECORRUPT || rc == KVM_EMISMATCH || rc == KVM_ENOTFOUND) return 0; /* the record checks' to report */
    if (rc) return rc;
    const kvm_store_manifest *man = &sc->manifest;
    int n_kv_heads = 0, head_dim = 0;
    int32_t seq_len = 0, model_layers = 0;
    int shape_rc = man->n_layers > 0 ? check_shape(store, sc, &n_kv_heads, &head_dim, &seq_len, &model_layers)
                                     : kvm_err(KVM_ECORRUPT, "its manifest says %d layers", (int)man->n_layers);
    if (shape_rc == KVM_ENOMEM)
        rc = shape_rc;
    else if (shape_rc) { /* layer 0 is no message: nothing to size the others by */
        snprintf(line, sizeof line, "cache %s layer 0 does not decode: %s", name, kvm_errmsg());
        if (report) report(line, arg);
        (*n_bad)++;
    } else if (seq_len > 0 && (man->n_tokens < 1 || man->n_tokens > seq_len)) {
        snprintf(line, sizeof line, "cache %s: stored for %lld tokens, outside its model's window [1, %d]", name,
                 (long long)man->n_tokens, (int)seq_len);
        if (report) report(line, arg);
        (*n_bad)++;
    } else if (model_layers > 0 && man->n_layers != model_layers) { /* serve refuses it (KVM_EMISMATCH) */
        snprintf(line, sizeof line, "cache %s: stored with %d layers, its model record has %d", name,
                 (int)man->n_layers, (int)model_layers);
        if (report) report(line, arg);
        (*n_bad)++;
    } else {
        rc = kvm_kvcache_new(man->n_layers, n_kv_heads, head_dim, 1, &c);
        if (rc == KVM_EINVAL) { /* a model record of no valid shape */
            snprintf(line, sizeof line, "cache %s: %s", name, kvm_errmsg());
            if (report) report(line, arg);
            (*n_bad)++;
            rc = 0;
        }
        for (int l = 0; c && !rc && l < man->n_layers; l++) {
            int lrc = kvm_serve_cache_decode_layer(sc, l, c);
            if (lrc == KVM_ENOMEM)
                rc = lrc;
            else if (lrc) {
                snprintf(line, sizeof line, "cache %s layer %d: %s", name, l, kvm_errmsg());
                if (report) report(line, arg);
                (*n_bad)++;
            }
            kvm_kvcache_release_layer(c, l); /* one decoded layer held at a time */
        }
    }
    kvm_kvcache_free(&c);
    kvm_store_cache_free(&sc);
    return rc;
}

int kvm_serve_cache_load(kvm_store *store, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id,
                         const kvm_model *m, int64_t extra_per_head, kvm_kvcache **out, int64_t *n_tokens)
{
    *out = NULL;
    kvm_store_cache *sc = NULL;
    kvm_kvcache *c = NULL;
    int rc = kvm_store_get_cache(store, key, tokenizer_id, &sc);
    if (rc) return rc;
    const kvm_store_manifest *man = &sc->manifest;
    if (man->n_layers != m->cfg.n_layers)
        rc = kvm_err(KVM_EMISMATCH, "stored cache has %d layers, the model %d", (int)man->n_layers, m->cfg.n_layers);
    else if (man->n_tokens < 1 || man->n_tokens > kvm_model_window(&m->cfg))
        rc = kvm_err(KVM_ECORRUPT, "stored cache is for %lld tokens, outside the model's window [1, %d]",
                     (long long)man->n_tokens, kvm_model_window(&m->cfg));
    if (!rc) rc = kvm_forward_cache_new(m, extra_per_head > 0 ? extra_per_head : 1, &c);
    for (int l = 0; !rc && l < man->n_layers; l++)
        rc = kvm_serve_cache_decode_layer(sc, l, c);
    /* room for the continuation: entries are appended per head as tokens are decoded */
    for (int l = 0; !rc && l < c->n_layers; l++)
        for (int g = 0; !rc && g < c->n_kv_heads; g++) {
            kvm_kv_head *h = kvm_kvcache_head(c, l, g);
            rc = kvm_kvcache_reserve(h, c->head_dim, h->n + (extra_per_head > 0 ? extra_per_head : 0));
        }
    if (!rc) {
        c->next_pos = (int32_t)man->n_tokens;
        if (n_tokens) *n_tokens = man->n_tokens;
        *out = c;
        c = NULL;
    }
    kvm_kvcache_free(&c);
    kvm_store_cache_free(&sc);
    return rc;
}
