/* kvm_orch_remote.c: the ids and the client of a run whose store is remote (kvm_orch_remote.h). */
#include "pipeline/kvm_orch_remote.h"
#include "common/kvm_error.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_serve_remote.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvm_orch_remote_timeout_ms(const kvm_config *cfg)
{
    int64_t ms = kvm_config_int(cfg, "run", "heartbeat_ms") * kvm_config_int(cfg, "run", "liveness");
    return ms < 1000 ? 1000 : ms > 600000 ? 600000 : (int)ms;
}

/* The config id with the strategy the service holds: a strategy recalibrated on the store's
 * host after this point gives caches of this run the old id (listed stale-strategy). */
static int remote_config_id(const kvm_config *cfg, kvm_storecli *cli, const kvm_store_id *model_id, kvm_store_id *id)
{
    if (strcmp(kvm_config_str(cfg, "compress", "method"), "polykv")) return kvm_jobcfg_config_id(cfg, NULL, id, NULL, NULL);
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = kvm_serve_remote_strategy(cli, cfg, model_id, &buf, &len);
    if (rc == KVM_ENOTFOUND)
        return kvm_err(KVM_EINVAL, "%s", kvm_errmsg()); /* the same message, as a usage error */
    if (rc) return rc;
    rc = kvm_jobcfg_config_id_with(cfg, buf, len, id, NULL, NULL);
    free(buf);
    return rc;
}

int kvm_orch_remote_check(const kvm_config *cfg, const char *endpoint)
{
    const char *sb = kvm_config_str(cfg, "store", "service_bind");
    if (*sb)
        return kvm_err(KVM_EINVAL,
                       "%s: [store] service_bind = %s, but the store is the store service %s on another host: only "
                       "the store's host serves it (unset service_bind, or give the LMDB directory)",
                       kvm_config_path(cfg), sb, endpoint);
    return 0;
}

int kvm_orch_remote_open(const kvm_config *cfg, const char *endpoint, kvm_storecli **cli, kvm_store_id *model_id,
                         kvm_store_id *config_id)
{
    *cli = NULL;
    int rc = kvm_orch_remote_check(cfg, endpoint);
    if (rc) return rc;
    kvm_storecli_keys k = kvm_storecli_keys_of(cfg, NULL, NULL, NULL);
    rc = kvm_storecli_open(&k, endpoint, cli);
    if (!rc) rc = kvm_store_hash_file(kvm_config_str(cfg, "model", "path"), model_id);
    if (!rc) rc = remote_config_id(cfg, *cli, model_id, config_id);
    if (rc) kvm_storecli_close(cli);
    return rc;
}
