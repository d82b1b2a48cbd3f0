/* kvm_jobcfg.h: the settings a job carries to the stages (proto job "settings": a map of
 * "section.key" -> string), so a worker started by hand needs no config file and computes
 * the same config id as the orchestrator; and the config id itself. */
#ifndef KVM_JOBCFG_H
#define KVM_JOBCFG_H

#include "model/kvm_tokenizer.h"
#include "pipeline/kvm_config.h"
#include "store/kvm_store.h"

#include <stddef.h>
#include <stdint.h>

/* Packs the settings of sections model, compress, eval, calibrate and store (all but
 * store.path: each host names its own; map_size_mb, map_max_mb and cap_mb are what a worker
 * started without a config opens the store with) as a MessagePack map (malloc'ed *mp of *n
 * bytes). Returns 0 or KVM_ENOMEM. */
int kvm_jobcfg_pack(const kvm_config *c, uint8_t **mp, size_t *n);

/* Rebuilds a config from such a map (unknown or invalid settings are errors naming the key).
 * Returns 0 and *out, KVM_EPROTO (not a map of strings), KVM_EINVAL, KVM_ENOMEM. */
int kvm_jobcfg_unpack(const uint8_t *mp, size_t n, kvm_config **out);

/* Version of what a cache holds for given settings: the solver, the eviction patterns,
 * the defaults they fall back on, the cache encoding. It is hashed into every config id.
 * MIGRATION RULE: a change that makes the same settings produce a different cache (a solver
 * fix, a new default inside compress/, another layout) bumps this number by one, in the
 * same commit, with a line in README "Run semantics". Caches made before then keep their
 * old config id: the next `kvmill run` compresses those documents again (it never serves an
 * old cache for the new algorithm), `kvmill store ls --config F` lists the old ones as
 * `stale-algorithm` and `kvmill store rm --stale --config F` removes them. */
#define KVM_JOBCFG_ALGORITHM_VERSION 2 /* 2: query_source repeat puts KVzip's instruction before the copy */

/* The same rule for a change to method polykv alone, so that other methods' caches keep their
 * ids: a polykv cache's version is "VERSION.PLAN" (kvmill.algorithm=2.1). 1: a strategy's layer
 * budgets rescaled to a document are capped at its length, the surplus given to the other
 * layers (a layer's budget above the context had kept it whole and left the surplus unspent). */
#define KVM_JOBCFG_POLYKV_PLAN 1

/* Settings that are each valid alone but together would not compress: [model] system
 * without chat = true (the message would be ignored), [compress] target_kl with method full
 * or polykv (no budget to choose) or with a smallest budget searched at or above [model] context
 * (kvm_target_lowest_budget: target_step, or retain for sculpt methods, too large), [compress] budget
 * at or above [model] context or, without budget, ratio = 1 (any method but full; unused, so not
 * checked, with target_kl),
 * or retain at or above the context
 * (sculpt methods: the retain zone alone would hold every token), [compress] on_policy = true
 * with a method that distils no layers (eviction patterns, polykv, full) or with sculpt
 * settings it does not go with (kvm_sculpt_opts_check_combination). Returns 0 or KVM_EINVAL
 * (KVM_ENOTSUP for on_policy with alloc other than uniform) with a message naming the
 * setting, its value and the context. Also [store] service or service_bind that is not a tcp:// or
 * ipc:// endpoint (kvm_serve_endpoint_check), KVM_EINVAL. Also kvm_jobcfg_check_strategy. */
int kvm_jobcfg_check(const kvm_config *c);

/* Needs the model, so `run` and `calibrate --config` call it once it is open: a [compress]
 * query_source with a repeat share prefills the repeat prompt (P tokens of tok, in the chat turn
 * with [model] chat) and the context again after the context, 2N + P positions (N = [model]
 * context), which must fit window (the model's) for every job of a sculpt-family method
 * (calibrate = 0: [compress] method, polykv aside: its strategy is in the store) or of
 * PolyKV's distilled layers (calibrate = 1: [calibrate] sculpt or kvzip). Returns 0, KVM_EINVAL
 * naming the file, the setting, 2N + P and the window, or the tokenizer's error. */
int kvm_jobcfg_check_repeat(const kvm_config *c, const kvm_tokenizer *tok, int window, int calibrate);

/* With method = polykv, [compress] strategy must be a name the store can hold (1 to
 * KVM_STORE_MAX_NAME bytes): else KVM_EINVAL naming the file, the key and the length. 0 otherwise. */
int kvm_jobcfg_check_strategy(const kvm_config *c);

/* For the user's own file (kvmill run, kvmill serve; not a resolved copy such as serve hands its
 * workers, which sets every key): with [compress] budget > 0 and ratio set too, the budget
 * replaces the ratio (the settings table's rule; a copy of configs/default.ini, which sets
 * ratio, with a budget added is a natural config), so it is said rather than refused. Returns 1
 * with the note (naming the file and both values) in out[0, n), else 0 (also with target_kl >
 * 0 or method full, which use neither). */
int kvm_jobcfg_size_note(const kvm_config *c, char *out, size_t n);

/* For the commands that send jobs (kvmill run, kvmill calibrate --config): each setting a job
 * carries (kvm_jobcfg_pack) must be UTF-8 of at most KVM_PROTO_MAX_NAME_BYTES, or every job
 * fails to encode ("field 'settings value': invalid UTF-8") and every document fails after its
 * retries. (kvmill serve hands its workers a config file, not a job: not needed there.)
 * Returns 0 or KVM_EINVAL naming the file, [section] key and the byte where the text goes bad. */
int kvm_jobcfg_check_text(const kvm_config *c);

/* [store] service_bind against the endpoints the command binds itself (serve = 0: kvmill run's
 * [run] bind, its control socket PORT and its data socket PORT + 1; serve = 1: kvmill serve's
 * [serve] bind and [serve] backend, PORT and PORT + 1). The store service took one of them and
 * the run then failed to bind it (or the service failed first, and its error blamed "another
 * process"). An empty [run] bind (run) or [serve] backend (serve) is ipc://RUN_DIR of a set
 * [run] run_dir: RUN_DIR/ctl and RUN_DIR/data. Same port with the same host (localhost and
 * 127.0.0.1 are one), or either host 0.0.0.0 / * / [::] (every address), clashes; ipc://
 * endpoints clash when equal (runs of '/' as one). bind_what names [run] bind or [serve] bind in the
 * message (a --bind flag sets it). The store the command asks for caches ([store] path when an
 * endpoint, [store] service: serve's --store) against the same sockets by the same rule: it
 * would ask itself (serve's front end answered "not a store service" to every ask; a run's
 * first claim timed out). Also an ipc:// service_bind whose folder does not exist
 * (kvm_serve_ipc_folder_check; the service failed at its start, exit 1). Returns 0, or KVM_EINVAL
 * naming the file, both settings and the socket (or the setting and the folder). */
int kvm_jobcfg_check_service_bind(const kvm_config *c, int serve, const char *bind_what);

/* The config id: BLAKE2b-256 of the canonical text (*canonical, malloc'ed, when not NULL:
 * the manifest's config bytes) of everything that changes a stored cache, one
 * "name=value\n" line each, in this order: kvmill.algorithm (KVM_JOBCFG_ALGORITHM_VERSION, and
 * ".KVM_JOBCFG_POLYKV_PLAN" after it for method polykv),
 * model.context, store.dtype, run.wire_dtype and model.weight_dtype (each only when not f32),
 * model.chat=true and model.system (escaped \\, \n, \r; only with [model] chat = true, the
 * system line only when set), every [compress] setting (resolved, defaults included, but
 * target_kl and target_step only when target_kl > 0, budget and ratio only when it is not
 * (the search sets the budget), on_policy only when true, carry_history, tolerance,
 * round_tolerance, ridge_f32 and gradient_tolerance only when > 0, so configs without them
 * keep their ids,
 * numbers in one spelling), then strategy.hash=HEX (BLAKE2b-256 of the PolyKV strategy's
 * stored bytes) when strategy_hash is not NULL. Returns 0 or KVM_ENOMEM. */
int kvm_jobcfg_config_id(const kvm_config *c, const kvm_store_id *strategy_hash, kvm_store_id *id, char **canonical,
                         size_t *canonical_len);

/* kvm_jobcfg_config_id with the PolyKV strategy given as its stored bytes strategy[0,
 * strategy_len) (borrowed; a record fetched from the store or the store service): for
 * method polykv their BLAKE2b-256 is the strategy hash; other methods, or strategy NULL,
 * give the id without one. Returns 0 or KVM_ENOMEM. */
int kvm_jobcfg_config_id_with(const kvm_config *c, const uint8_t *strategy, size_t strategy_len, kvm_store_id *id,
                              char **canonical, size_t *canonical_len);

/* The config id of the caches config c makes for model_id with store s: for method polykv
 * the strategy [compress] strategy stored for model_id is read from s and its hash goes
 * into the id (so a recalibrated strategy gives new ids); other methods ignore s (may be
 * NULL). Errors: KVM_ENOTFOUND (polykv and no such strategy: the message says to run
 * kvmill calibrate), the store's errors, KVM_ENOMEM. */
int kvm_jobcfg_config_id_in(const kvm_config *c, kvm_store *s, const kvm_store_id *model_id, kvm_store_id *id,
                            char **canonical, size_t *canonical_len);

/* How a stored cache's config stands against the caches config c would make now. */
typedef enum kvm_jobcfg_state {
    KVM_JOBCFG_OK = 0,              /* same config id: the cache is what a run would make */
    KVM_JOBCFG_STALE_STRATEGY = 1,  /* same settings, made with another PolyKV strategy */
    KVM_JOBCFG_STALE_ALGORITHM = 2, /* same settings, made by another algorithm version */
    KVM_JOBCFG_OTHER = 3,           /* other settings, or another model */
} kvm_jobcfg_state;

/* Compares a manifest's config bytes (cache[0, cache_len): the canonical text written by
 * kvm_jobcfg_config_id, possibly by an older build without a kvmill.algorithm line, which
 * counts as version 0) with the current canonical text cur[0, cur_len). Line order is the
 * canonical one, so the texts are compared line by line with kvmill.algorithm and
 * strategy.hash set aside. Pure function, no errors. */
kvm_jobcfg_state kvm_jobcfg_compare(const char *cache, size_t cache_len, const char *cur, size_t cur_len);

/* "ok", "stale-strategy", "stale-algorithm", "other-config". */
const char *kvm_jobcfg_state_name(kvm_jobcfg_state st);

/* 1 when binding endpoints a and b would take the same socket: one tcp:// port where either
 * host is every interface (*, 0.0.0.0, ::) or both are one address however spelled (localhost
 * and localhost. as 127.0.0.1, numeric forms such as 127.1, an interface name such as lo, an
 * IPv4-mapped [::ffff:a.b.c.d]; [::1] is not 127.0.0.1), or one ipc:// file however spelled
 * (kvm_file_path_norm: relative, '.', '..', '//', links). */
int kvm_jobcfg_same_socket(const char *a_ep, const char *b_ep);

/* 1 when endpoint ep stays on this host: ipc:// and inproc://, and a tcp:// host that is a
 * loopback address however spelled (127.0.0.0/8 in any numeric form, [::1], an IPv4-mapped
 * [::ffff:127.x.y.z], localhost and localhost. in any case); 0 for every other host: a name
 * (even one that begins "127."), an interface name such as lo (a connect endpoint resolves it
 * as a name, which a DNS search domain can make another host), another address, a
 * source;destination pair. No name is resolved. */
int kvm_jobcfg_is_loopback(const char *ep);

#endif
