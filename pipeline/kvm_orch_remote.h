/* kvm_orch_remote.h: an orchestrator whose store is on another host: `[store] path` (or `kvmill
 * run --store`) names the store service's endpoint (tcp://HOST:PORT, ipc://...) instead of an
 * LMDB directory. Such a run opens no LMDB: it claims, probes, renews and releases through the
 * service (protocol revision 6, kvm_storecli_claim), the stages it starts upload their caches
 * to the same service, and it makes its ids without a store (the model id from the weights'
 * bytes, a PolyKV config id from the strategy fetched with get_strategy). */
#ifndef KVM_ORCH_REMOTE_H
#define KVM_ORCH_REMOTE_H

#include "pipeline/kvm_config.h"
#include "pipeline/kvm_storecli.h"
#include "store/kvm_store.h"

/* Timeout of one claim request, ms: the run's liveness timeout ([run] heartbeat_ms x liveness),
 * at least 1000 (a claim is a few hundred bytes; the service answers between commits). */
int kvm_orch_remote_timeout_ms(const kvm_config *cfg);

/* Settings a process whose store is the service at endpoint cannot honour: [store]
 * service_bind (the service belongs to the store's host). kvmill run (kvm_orch_remote_open)
 * and kvmill serve (--store tcp://..., [store] service or path = tcp://...) refuse them.
 * Returns 0 or KVM_EINVAL naming the config file, the setting and the endpoint. */
int kvm_orch_remote_check(const kvm_config *cfg, const char *endpoint);

/* Opens the client of the store service at endpoint with cfg's [security] keys (a non-local
 * endpoint needs them) and makes the run's model id (BLAKE2b-256 of [model] path's bytes, as a
 * worker without a store makes it) and config id (kvm_jobcfg_config_id; for polykv with the
 * strategy [compress] strategy fetched from the service). *cli is owned (kvm_storecli_close;
 * NULL on error). Errors: KVM_EINVAL ([store] service_bind set: the service belongs to the
 * store's host; no PolyKV strategy stored, the message names the model id and the strategy),
 * kvm_storecli_open's, KVM_EIO (no reply, unreadable model), KVM_ENOMEM. */
int kvm_orch_remote_open(const kvm_config *cfg, const char *endpoint, kvm_storecli **cli, kvm_store_id *model_id,
                         kvm_store_id *config_id);

#endif
