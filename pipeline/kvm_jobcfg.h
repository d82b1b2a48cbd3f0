/* kvm_jobcfg.h: the settings a job carries to the stages (proto job "settings": a map of
 * "section.key" -> string), so a worker started by hand needs no config file and computes
 * the same config id as the orchestrator; and the config id itself. */
#ifndef KVM_JOBCFG_H
#define KVM_JOBCFG_H

#include "pipeline/kvm_config.h"
#include "store/kvm_store.h"

#include <stddef.h>
#include <stdint.h>

/* Packs the settings of sections model, compress, eval and store.dtype as a MessagePack map
 * (malloc'ed *mp of *n bytes). Returns 0 or KVM_ENOMEM. */
int kvm_jobcfg_pack(const kvm_config *c, uint8_t **mp, size_t *n);

/* Rebuilds a config from such a map (unknown or invalid settings are errors naming the key).
 * Returns 0 and *out, KVM_EPROTO (not a map of strings), KVM_EINVAL, KVM_ENOMEM. */
int kvm_jobcfg_unpack(const uint8_t *mp, size_t n, kvm_config **out);

/* The config id: BLAKE2b-256 of the canonical text of every setting that changes the stored
 * cache (model.context, store.dtype, the compress section). */
int kvm_jobcfg_config_id(const kvm_config *c, kvm_store_id *id, char **canonical, size_t *canonical_len);

#endif
