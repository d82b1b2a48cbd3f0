/* kvm_worker.h: what the prefill and compress stages (and the decode workers' on-demand
 * compression) share: the model a job names, verified by model id, and the compression
 * dispatch from a config to the compress/ methods. */
#ifndef KVM_WORKER_H
#define KVM_WORKER_H

#include "compress/kvm_compress.h"
#include "model/kvm_tokenizer.h"
#include "pipeline/kvm_config.h"
#include "store/kvm_store.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt.h"

/* A model loaded once per process and reused while jobs name the same file. */
typedef struct kvm_worker_model {
    char path[4096];         /* model file */
    kvm_model *model;        /* loaded model, or NULL */
    kvm_tokenizer *tok;      /* its tokenizer (may be NULL when none is found) */
    kvm_store_id model_id;   /* BLAKE2b-256 of the file */
    kvm_store_id tok_id;     /* BLAKE2b-256 of the tokenizer file (zero when none) */
    const char *override;    /* --model flag: used instead of the job's path */
    kvm_store_id override_id; /* model id of override, when has_override_id (kvm_worker_model_id_early) */
    int has_override_id;      /* override_id is set: ready names it before the first job loads the model */
    long long override_stat[5]; /* the --model file's device, inode, size, mtime and ctime (ns) when
                                   override_id was hashed: a file replaced since (or a folder) is
                                   hashed again at its load */
    int pinned;               /* the model is the worker's own ([model] path of its --config: a decode
                                 worker), not its jobs': ready names it as it names an override */
} kvm_worker_model;

/* For a stage that loads its model with the first job: computes the model id of its --model file
 * (wm->override; the store's memo when store is given, else hashing the file) now, so that its
 * `ready` names the model before any job (PROTOCOL.md §5, revision 10); kvm_worker_model_get
 * reuses it. Without an override it does nothing. Best effort: a file that cannot be read
 * leaves the id unset (the first job reports it, as before); returns nothing. */
void kvm_worker_model_id_early(kvm_worker_model *wm, kvm_store *store);

/* The id of the model wm computes with, when it is the worker's own (wm->override or
 * wm->pinned): the loaded model's, else the --model file's (kvm_worker_model_id_early); else
 * NULL (the model follows the jobs: each job names its run's model path).
 * Borrowed from wm: valid until wm changes (the next kvm_worker_model_get or _free); call it
 * where no job is running (the stage runtime's main thread between jobs). */
const uint8_t *kvm_worker_model_id(const kvm_worker_model *wm);

/* Makes wm hold the model that config c names (or wm->override), loading it on first use
 * or when the path changes. The model id comes from the store's memo when a store is given
 * (so big models are hashed once), else from hashing the file. Returns 0, or the error. */
int kvm_worker_model_get(kvm_worker_model *wm, const kvm_config *c, kvm_store *store);

/* What kvm_worker_model_for_job's mismatch message says right after the loaded model's 12 hex
 * digits ("model 0123456789ab, not the run's model ..."): the orchestrator reads the worker's
 * model from it (kvm_worker_other_model_hex). */
#define KVM_WORKER_OTHER_MODEL ", not the run's model "

/* The 12 hex digits of the model a worker loaded, from a job's error message (UTF-8, msg[0, n))
 * that kvm_worker_model_for_job wrote, into hex (13 bytes, NUL-terminated): 1, or 0 when the
 * message is not such a mismatch (another KVM_EMISMATCH: shapes, a tokenizer, a store format).
 * Pure. */
int kvm_worker_other_model_hex(const char *msg, size_t n, char hex[13]);

/* kvm_worker_model_get for a job, then, when the job names its run's model (want: the job's
 * model_id, 32 bytes, PROTOCOL.md §5 revision 10; NULL for a job without one), whether the model
 * loaded is that one. A worker without --model loads the path the job's settings name on its own
 * host, where another model may be deployed under it: its KV would be stored under the run's
 * model id. The id compared is the one computed when the model was (re)loaded: no file is hashed
 * again per job, except that a model kept from an earlier job that is not the run's is loaded
 * again once (its file may have been replaced by the run's version since). *other_model is set
 * to 1 on a mismatch, else 0. Returns 0, kvm_worker_model_get's errors, or KVM_EMISMATCH naming
 * the file, this host, the loaded model's id and the run's (12 hex digits each): retryable
 * (kvm_worker_model_retryable), as another worker's host may hold the right file, while every
 * later job of the run fails here alike. */
int kvm_worker_model_for_job(kvm_worker_model *wm, const kvm_config *c, kvm_store *store, const uint8_t *want,
                             int *other_model);

/* Whether a stage retries kvm_worker_model_get's error rc: the orchestrator opened the same model
 * before any stage started, so a model file missing, unreadable as a model or another model's
 * here (KVM_ENOTFOUND, KVM_EFORMAT, KVM_EMISMATCH) is the worker's host (a mount not up yet, a
 * file still being copied), and another worker may load it; and what kvm_err_retryable retries.
 * A store's error (KVM_ECORRUPT of its model memo) is final. */
int kvm_worker_model_retryable(int rc);

/* The tokenizer id kvm_worker_model_get records for config c's model without loading the
 * model: model_id for a GGUF file read without [model] tokenizer (it embeds its own), else
 * BLAKE2b-256 of the tokenizer file ([model] tokenizer, or the one beside the model); all
 * zero when there is none. The orchestrator's "already stored?" check compares it with
 * the manifests. Errors: KVM_EIO (a file cannot be read). */
int kvm_worker_tokenizer_id(const kvm_config *c, const kvm_store_id *model_id, kvm_store_id *out);

/* Frees the model and tokenizer. */
void kvm_worker_model_free(kvm_worker_model *wm);

/* The repeat prompt of query_source repeat for config c's model (kvm_sculpt_repeat_prompt with
 * wm's tokenizer, chat framing when [model] chat = true): *ids malloc'ed (caller frees) and *n,
 * for kvm_compress_input.repeat_prompt; NULL and 0 when wm has no tokenizer (then the BOS token
 * alone stands for it, as before). Every stage that compresses sets it, so equal settings give
 * equal caches. Returns 0 or the tokenizer's error. */
int kvm_worker_repeat_prompt(const kvm_config *c, const kvm_worker_model *wm, int32_t **ids, int64_t *n);

/* Compresses with the method c names ([compress] method and options): KVSculpt and its
 * baselines with the [compress] sculpt settings, a single eviction pattern at [compress]
 * budget (or ratio), or PolyKV with the strategy stored under (model_id, [compress]
 * strategy), whose sculpt and kvzip layers use the options the strategy records (KVST v2;
 * a version-1 strategy: the [compress] settings; kvm_polykv_strategy_sculpt_opts says on
 * stderr which [compress] settings differ and are not used). The sculpt-family solvers
 * (PolyKV's distilled layers included) run on in->device when set (the worker's --device,
 * the sculpt `device` setting). *out is a new cache (next_pos = N). Errors: KVM_ENOTFOUND
 * (no stored strategy: the message says to calibrate first), KVM_ENOTSUP (unknown method),
 * KVM_EDEVICE (in->device has no CUDA solver), method errors. */
int kvm_worker_compress(const kvm_config *c, const kvm_compress_input *in, kvm_store *store,
                        const kvm_store_id *model_id, kvm_kvcache **out);

/* kvm_worker_compress for a worker that reads no store: PolyKV uses the strategy record
 * strategy[0, strategy_len) (its stored bytes, fetched from the store service by a compress
 * worker on another host: kvm_storecli_get_strategy; borrowed) instead of looking it up;
 * other methods ignore it (may be NULL). Errors: as kvm_worker_compress, KVM_ENOTFOUND when
 * polykv is asked for without a strategy, the strategy decoder's errors. */
int kvm_worker_compress_with(const kvm_config *c, const kvm_compress_input *in, const uint8_t *strategy,
                             size_t strategy_len, kvm_kvcache **out);

/* A decode-phase policy for the method a config names: each KV head of `compressed` (a
 * stored cache a decode worker extends) is kept within the entries it was stored with, by
 * the method's eviction pattern (PolyKV: the strategy's decode-phase pattern of each layer)
 * as the prompt and the answer are appended. Sculpt methods and `full` have none (*out =
 * NULL, returns 0). Errors: KVM_ENOTFOUND (no stored strategy), KVM_ENOTSUP, KVM_ENOMEM.
 * Free with kvm_decode_policy_free. */
int kvm_worker_policy_new(const kvm_config *c, const kvm_model *m, kvm_store *store, const kvm_store_id *model_id,
                          const kvm_kvcache *compressed, kvm_decode_policy **out);

/* kvm_worker_policy_new for a decode worker that reads no store: PolyKV's decode-phase
 * patterns come from the strategy record strategy[0, strategy_len) (its stored bytes, fetched
 * from the store service with get_strategy; borrowed); other methods ignore it (may be NULL).
 * Errors: as kvm_worker_policy_new; KVM_ENOTFOUND when polykv is asked for without a
 * strategy; the strategy decoder's errors. */
int kvm_worker_policy_with(const kvm_config *c, const kvm_model *m, const uint8_t *strategy, size_t strategy_len,
                           const kvm_kvcache *compressed, kvm_decode_policy **out);

/* [compress] settings -> KVSculpt options for method `mode` (issue 5's defaults where the
 * config is silent; threads from [stages] threads). Returns 0 or KVM_EINVAL (bad alloc). */
int kvm_worker_sculpt_opts(const kvm_config *c, kvm_sculpt_mode mode, kvm_sculpt_opts *o);

/* Loads the PolyKV strategy the config names for model_id: malloc'ed encoding in *buf.
 * Errors: KVM_ENOTFOUND with "run kvmill calibrate --config ... first", store errors. */
int kvm_worker_strategy(const kvm_config *c, kvm_store *store, const kvm_store_id *model_id, uint8_t **buf,
                        size_t *len);

#endif
