/* kvm_worker.c: model loading for stage processes and the method dispatch. */
#include "pipeline/kvm_worker.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "model/kvm_tokenizer_find.h"
#include "compress/sculpt/kvm_sculpt.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/polykv/kvm_polykv.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int kvm_worker_model_retryable(int rc)
{
    return rc == KVM_ENOTFOUND || rc == KVM_EFORMAT || rc == KVM_EMISMATCH || kvm_err_retryable(rc);
}

/* The file's device, inode, size, modification and change times (ns) into sig; 0, or -1 when
 * stat fails or path is a folder (a Hugging Face model: a shard rewritten in place leaves the
 * folder's own stat as it was, so a folder is always hashed again, as kvm_store_model_id does). */
static int file_stat_sig(const char *path, long long sig[5])
{
    struct stat st;
    if (stat(path, &st) != 0 || S_ISDIR(st.st_mode)) return -1;
    sig[0] = (long long)st.st_dev, sig[1] = (long long)st.st_ino, sig[2] = (long long)st.st_size;
    sig[3] = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    sig[4] = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec; /* cp -p keeps the mtime */
    return 0;
}

/* The file wm loads for config c: --model, else the config's (the job's) path. */
static const char *model_path(const kvm_worker_model *wm, const kvm_config *c)
{
    return wm->override ? wm->override : kvm_config_str(c, "model", "path");
}

int kvm_worker_model_get(kvm_worker_model *wm, const kvm_config *c, kvm_store *store)
{
    const char *path = model_path(wm, c);
    if (wm->model && !strcmp(path, wm->path)) return 0;
    kvm_worker_model_free(wm);
    int rc = kvm_model_open(path, &wm->model);
    if (rc) return rc;
    kvm_model_weight_dtype wd;
    if ((rc = kvm_model_weight_dtype_parse(kvm_config_str(c, "model", "weight_dtype"), &wd)) ||
        (rc = kvm_model_set_weight_dtype(wm->model, wd))) {
        kvm_model_close(&wm->model);
        return kvm_err(rc, "[model] %s", kvm_errmsg());
    }
    snprintf(wm->path, sizeof wm->path, "%s", path);
    long long sig[5];
    if (wm->has_override_id && path == wm->override && file_stat_sig(path, sig) == 0 &&
        !memcmp(sig, wm->override_stat, sizeof sig))
        wm->model_id = wm->override_id; /* hashed at setup for ready, the file unchanged since: not twice */
    else if ((rc = store ? kvm_store_model_id(store, path, &wm->model_id) : kvm_store_hash_file(path, &wm->model_id))) {
        kvm_worker_model_free(wm); /* no model without its id: ready would name a stale one */
        return rc;
    }
    const char *tp = kvm_config_str(c, "model", "tokenizer");
    char tpath[4096];
    memset(&wm->tok_id, 0, sizeof wm->tok_id);
    if (kvm_tokenizer_open_for_model(wm->model, path, *tp ? tp : NULL, &wm->tok, tpath, sizeof tpath) == 0)
        kvm_store_hash_file(tpath, &wm->tok_id); /* a GGUF's id is its file's: tokenizer and weights travel together */
    return 0;
}

int kvm_worker_model_for_job(kvm_worker_model *wm, const kvm_config *c, kvm_store *store, const uint8_t *want,
                             int *other_model)
{
    *other_model = 0;
    const int kept = wm->model && !strcmp(model_path(wm, c), wm->path);
    int rc = kvm_worker_model_get(wm, c, store);
    if (!rc && kept && want && memcmp(wm->model_id.b, want, sizeof wm->model_id.b)) {
        /* kept from an earlier run's job: the file may have been replaced since (this run's new
         * version under the same path), so it is loaded and hashed again, once, before it is
         * called wrong (a --model's id hashed at setup is not reused then) */
        wm->has_override_id = 0;
        kvm_worker_model_free(wm);
        rc = kvm_worker_model_get(wm, c, store);
    }
    if (rc || !want || !memcmp(wm->model_id.b, want, sizeof wm->model_id.b)) return rc;
    char host[256] = "", mine[65], run[65];
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "unknown");
    kvm_store_id run_id;
    memcpy(run_id.b, want, sizeof run_id.b);
    *other_model = 1;
    /* the ids first: a long path would push them past the message's end */
    return kvm_err(KVM_EMISMATCH, "model %.12s" KVM_WORKER_OTHER_MODEL "%.12s: model file %s on host %s (%s)",
                   kvm_store_id_hex(&wm->model_id, mine), kvm_store_id_hex(&run_id, run), wm->path, host,
                   wm->override ? "its --model names another model than the run's"
                                : "another model under the same path here: start this worker with --model naming the "
                                  "run's model");
}

int kvm_worker_other_model_hex(const char *msg, size_t n, char hex[13])
{
    const size_t mark = strlen(KVM_WORKER_OTHER_MODEL);
    for (size_t i = 18; msg && i + mark <= n; i++) { /* "model " + 12 digits before the mark */
        if (memcmp(msg + i, KVM_WORKER_OTHER_MODEL, mark) || memcmp(msg + i - 18, "model ", 6)) continue;
        int ok = 1;
        for (size_t k = i - 12; k < i; k++)
            ok &= (msg[k] >= '0' && msg[k] <= '9') || (msg[k] >= 'a' && msg[k] <= 'f');
        if (!ok) continue;
        memcpy(hex, msg + i - 12, 12);
        hex[12] = '\0';
        return 1;
    }
    return 0;
}

void kvm_worker_model_id_early(kvm_worker_model *wm, kvm_store *store)
{
    if (!wm->override) return;
    /* the file's identity before its hash: a file replaced meanwhile differs at the load; a
     * folder (or a file that does not stat) gets a signature no stat equals: hashed again */
    if (file_stat_sig(wm->override, wm->override_stat)) memset(wm->override_stat, 0xff, sizeof wm->override_stat);
    int rc = store ? kvm_store_model_id(store, wm->override, &wm->override_id)
                   : kvm_store_hash_file(wm->override, &wm->override_id);
    wm->has_override_id = rc == 0;
}

const uint8_t *kvm_worker_model_id(const kvm_worker_model *wm)
{
    /* a model that follows the jobs is the run's by construction: its path comes with each job,
     * and naming the last job's model would get a worker that serves run after run refused by
     * the next run of another model */
    if (!wm->override && !wm->pinned) return NULL;
    if (wm->model) return wm->model_id.b;
    return wm->has_override_id ? wm->override_id.b : NULL;
}

static int file_is_gguf(const char *path)
{
    char magic[4] = {0};
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(magic, 1, 4, f) : 0;
    if (f) fclose(f);
    return n == 4 && !memcmp(magic, "GGUF", 4);
}

int kvm_worker_tokenizer_id(const kvm_config *c, const kvm_store_id *model_id, kvm_store_id *out)
{
    const char *path = kvm_config_str(c, "model", "path"), *tp = kvm_config_str(c, "model", "tokenizer");
    char tpath[4096];
    memset(out, 0, sizeof *out);
    if (!*tp && file_is_gguf(path)) {
        *out = *model_id;
        return 0;
    }
    if (kvm_tokenizer_find_for_model(path, *tp ? tp : NULL, tpath, sizeof tpath)) return 0;
    return kvm_store_hash_file(tpath, out);
}

void kvm_worker_model_free(kvm_worker_model *wm)
{
    kvm_tokenizer_close(&wm->tok);
    kvm_model_close(&wm->model);
    wm->path[0] = '\0';
}

int kvm_worker_sculpt_opts(const kvm_config *c, kvm_sculpt_mode mode, kvm_sculpt_opts *o)
{
    *o = kvm_sculpt_opts_default();
    o->mode = mode;
    int n, rc = 0;
    const kvm_sculpt_setting *set = kvm_sculpt_settings(&n);
    for (int i = 0; !rc && i < n; i++) /* every [compress] key the sculpt table has, by the same name */
        if (set[i].in_config) rc = kvm_sculpt_opts_set(o, set[i].name, kvm_config_str(c, "compress", set[i].name));
    if (rc) return rc;
    o->ratio = kvm_config_float(c, "compress", "ratio");
    int64_t budget = kvm_config_int(c, "compress", "budget");
    if (budget > 0) o->k_entries = budget > o->retain_tokens ? budget - o->retain_tokens : 0;
    o->future_tokens = kvm_config_int(c, "compress", "future");
    o->threads = (int)kvm_config_int(c, "stages", "threads");
    return 0;
}

int kvm_worker_repeat_prompt(const kvm_config *c, const kvm_worker_model *wm, int32_t **ids, int64_t *n)
{
    *ids = NULL;
    *n = 0;
    return wm->tok ? kvm_sculpt_repeat_prompt(wm->tok, kvm_config_bool(c, "model", "chat"), ids, n) : 0;
}

int kvm_worker_strategy(const kvm_config *c, kvm_store *store, const kvm_store_id *model_id, uint8_t **buf,
                        size_t *len)
{
    const char *name = kvm_config_str(c, "compress", "strategy");
    int rc = store ? kvm_store_get_strategy(store, model_id, name, buf, len) : KVM_ENOTFOUND;
    if (rc == KVM_ENOTFOUND) {
        char hex[65];
        return kvm_err(KVM_ENOTFOUND, "no PolyKV strategy '%s' is stored for model %s: run kvmill calibrate --config %s "
                                      "--docs DIR first", name, kvm_store_id_hex(model_id, hex), kvm_config_path(c));
    }
    return rc;
}

/* A strategy record's bytes, borrowed. */
typedef struct strategy_bytes {
    const uint8_t *ptr;
    size_t len;
} strategy_bytes;

/* A single eviction pattern or PolyKV through the method table (compress/eval/kvm_methods.c).
 * PolyKV's strategy comes from given (non-NULL: bytes fetched from the store service) or else
 * from the store under model_id. */
static int evict(const kvm_config *c, const char *method, const kvm_compress_input *in, kvm_store *store,
                 const kvm_store_id *model_id, const strategy_bytes *given, kvm_kvcache **out)
{
    kvm_budget b = {.tokens = kvm_config_int(c, "compress", "budget")};
    if (b.tokens <= 0) b.ratio = kvm_config_float(c, "compress", "ratio");
    void *opts = NULL;
    const kvm_method *m;
    kvm_strategy *s = NULL; /* borrowed by the polykv options: freed after them */
    int rc;
    if (!strcmp(method, "polykv")) {
        uint8_t *buf = NULL;
        size_t len = 0;
        rc = given ? kvm_strategy_decode(given->ptr, given->len, &s) : kvm_worker_strategy(c, store, model_id, &buf, &len);
        if (!rc && !given) rc = kvm_strategy_decode(buf, len, &s);
        if (!rc) rc = kvm_polykv_method_opts_from(s, &b, &opts);
        kvm_sculpt_opts own, so;
        if (!rc && !(rc = kvm_worker_sculpt_opts(c, KVM_SCULPT_FULL, &own)) && in->device)
            rc = kvm_sculpt_opts_set(&own, "device", in->device); /* the worker's device runs the solver */
        if (!rc) { /* the distilled layers run with the options the strategy was calibrated with (KVST v2) */
            char name[512];
            snprintf(name, sizeof name, "the [compress] settings of %s", kvm_config_path(c));
            kvm_polykv_strategy_sculpt_opts(s, &own, name, &so);
            kvm_polykv_method_set_sculpt(opts, &so);
        }
        free(buf);
        m = kvm_method_find("polykv");
    } else {
        m = kvm_method_find(method);
        rc = m ? m->opts_new(NULL, &b, &in->model->cfg, &opts)
               : kvm_err(KVM_ENOTSUP, "compression method '%s' is not available in this build", method);
    }
    /* compression reads the prefill's float32 cache; kv_dtype = f16 applies after it (decode) */
    if (!rc && in->full) rc = kvm_kvcache_need_f32(in->full, "compression");
    if (!rc) rc = m->compress(in, opts, out);
    if (m) m->opts_free(opts);
    kvm_strategy_free(&s);
    return rc;
}

static int compress_from(const kvm_config *c, const kvm_compress_input *in, kvm_store *store,
                         const kvm_store_id *model_id, const strategy_bytes *given, kvm_kvcache **out)
{
    const char *method = kvm_config_str(c, "compress", "method");
    if (!strcmp(method, "full")) return kvm_kvcache_clone(in->full, out);
    kvm_sculpt_mode mode;
    if (kvm_sculpt_mode_parse(method, &mode) == 0) {
        kvm_sculpt_opts o;
        int rc = kvm_worker_sculpt_opts(c, mode, &o);
        if (!rc && in->device) rc = kvm_sculpt_opts_set(&o, "device", in->device); /* the worker's device */
        /* a document no longer than the retain zone has nothing to distil: keep it whole */
        if (o.retain_tokens > in->n_tokens) o.retain_tokens = in->n_tokens;
        const int64_t budget = kvm_config_int(c, "compress", "budget");
        /* k = 0 would mean ratio. A compress zone of one token (N = retain + 1: target_kl's search
         * probes budget N - 1 = retain there) is kept whole, as k >= 1 keeps it below */
        if (!rc && budget > 0 && budget <= o.retain_tokens && o.retain_tokens + 1 == in->n_tokens)
            return kvm_kvcache_clone(in->full, out);
        if (!rc && budget > 0 && budget <= o.retain_tokens && o.retain_tokens < in->n_tokens)
            return kvm_err(KVM_EINVAL,
                           "[compress] budget = %lld entries per head leaves none beyond the retain zone of "
                           "[compress] retain = %lld",
                           (long long)budget, (long long)o.retain_tokens);
        if (o.k_entries > in->n_tokens - o.retain_tokens) o.k_entries = in->n_tokens - o.retain_tokens;
        /* nor one whose cache would save no entry (retain + k = N: a compress zone of one token,
         * as k is at least 1, or a budget of the whole document): its full KV, exact, is stored
         * unchanged rather than the same number of entries distilled (the summary's kept_full) */
        if (!rc && o.retain_tokens + kvm_sculpt_k(&o, in->n_tokens) >= in->n_tokens)
            return kvm_kvcache_clone(in->full, out);
        return rc ? rc : kvm_sculpt_compress(in, &o, out, NULL);
    }
    return evict(c, method, in, store, model_id, given, out);
}

int kvm_worker_compress(const kvm_config *c, const kvm_compress_input *in, kvm_store *store,
                        const kvm_store_id *model_id, kvm_kvcache **out)
{
    return compress_from(c, in, store, model_id, NULL, out);
}

int kvm_worker_compress_with(const kvm_config *c, const kvm_compress_input *in, const uint8_t *strategy,
                             size_t strategy_len, kvm_kvcache **out)
{
    if (!strcmp(kvm_config_str(c, "compress", "method"), "polykv") && (!strategy || !strategy_len))
        return kvm_err(KVM_ENOTFOUND, "method polykv needs a strategy and none was given");
    strategy_bytes b = {strategy, strategy_len};
    return compress_from(c, in, NULL, NULL, strategy ? &b : NULL, out);
}

static int policy_from(const kvm_config *c, const kvm_model *m, kvm_store *store, const kvm_store_id *model_id,
                       const strategy_bytes *given, const kvm_kvcache *compressed, kvm_decode_policy **out);

int kvm_worker_policy_new(const kvm_config *c, const kvm_model *m, kvm_store *store, const kvm_store_id *model_id,
                          const kvm_kvcache *compressed, kvm_decode_policy **out)
{
    return policy_from(c, m, store, model_id, NULL, compressed, out);
}

int kvm_worker_policy_with(const kvm_config *c, const kvm_model *m, const uint8_t *strategy, size_t strategy_len,
                           const kvm_kvcache *compressed, kvm_decode_policy **out)
{
    *out = NULL;
    if (!strcmp(kvm_config_str(c, "compress", "method"), "polykv") && (!strategy || !strategy_len))
        return kvm_err(KVM_ENOTFOUND, "method polykv needs a strategy and none was given");
    strategy_bytes b = {strategy, strategy_len};
    return policy_from(c, m, NULL, NULL, strategy ? &b : NULL, compressed, out);
}

/* The policy with PolyKV's strategy from given (non-NULL) or else from the store. */
static int policy_from(const kvm_config *c, const kvm_model *m, kvm_store *store, const kvm_store_id *model_id,
                       const strategy_bytes *given, const kvm_kvcache *compressed, kvm_decode_policy **out)
{
    *out = NULL;
    const char *method = kvm_config_str(c, "compress", "method");
    kvm_sculpt_mode mode;
    if (!strcmp(method, "full") || kvm_sculpt_mode_parse(method, &mode) == 0) return 0;
    const int L = m->cfg.n_layers, H = m->cfg.n_kv_heads;
    kvm_pattern single = KVM_PATTERN_NONE;
    kvm_strategy *s = NULL;
    int rc = 0;
    if (!strcmp(method, "polykv")) {
        uint8_t *buf = NULL;
        size_t len = 0;
        rc = given ? kvm_strategy_decode(given->ptr, given->len, &s) : kvm_worker_strategy(c, store, model_id, &buf, &len);
        if (!rc && !given) rc = kvm_strategy_decode(buf, len, &s);
        if (!rc && s->n_layers != L) rc = kvm_err(KVM_EMISMATCH, "strategy has %d layers, the model %d", s->n_layers, L);
        free(buf);
    } else
        rc = kvm_pattern_parse(method, &single);
    kvm_evict_plan *plan = NULL;
    if (!rc) rc = kvm_evict_plan_new(L, H, single == KVM_PATTERN_NONE ? KVM_PATTERN_SNAPKV : single, 1, &plan);
    for (int l = 0; !rc && l < L; l++)
        for (int g = 0; g < H; g++) {
            int64_t n = kvm_kvcache_head(compressed, l, g)->n;
            /* a distilled (sculpt) layer appends unchanged in decode */
            kvm_pattern p = s ? s->layers[l].pattern[1] : single;
            plan->pattern[l * H + g] = kvm_pattern_is_distilled(p) ? KVM_PATTERN_NONE : p;
            plan->budget[l * H + g] = n > 0 ? n : 1;
        }
    if (!rc) rc = kvm_evict_decode_new(&m->cfg, plan, NULL, out);
    kvm_evict_plan_free(&plan);
    kvm_strategy_free(&s);
    return rc;
}
