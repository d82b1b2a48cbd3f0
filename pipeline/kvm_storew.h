/* kvm_storew.h: the store's write path. Every process that writes to the store (the
 * orchestrator's claims, compress and strategy workers, decode workers computing a missing
 * cache, `kvmill store rm/compact`) opens it here, with the same settings taken from one
 * place ([store] map_size_mb, map_max_mb, cap_mb of its config, or for a worker started
 * without one, of the job's settings), and takes and renews its claims here. The calls are
 * shaped as requests (plain values in, a status out) so the many-hosts issue can carry
 * them over the wire to the host that holds the store. */
#ifndef KVM_STOREW_H
#define KVM_STOREW_H

#include "pipeline/kvm_config.h"
#include "store/kvm_store.h"

#include <stdint.h>

/* The store options of config c: map_size_mb and map_max_mb (MiB -> bytes), cap_mb (> 0:
 * set and recorded in the store; 0: keep the store's recorded cap). read_only as given. */
void kvm_storew_opts(const kvm_config *c, int read_only, kvm_store_opts *o);

/* Opens the store at path (NULL: [store] path of c) with c's settings. Errors: those of
 * kvm_store_open (the message names the path). */
int kvm_storew_open(const kvm_config *c, const char *path, int read_only, kvm_store **out);

/* A stage worker's store options (compress, strategy, decode): kvm_storew_opts, but cap_bytes 0:
 * a worker keeps the store's recorded cap whatever its settings say. The cap belongs to the
 * store's owner, the command that opens it with its own config (kvmill run, calibrate, serve,
 * the kvmill store commands, the store service): a worker started by hand with another config
 * rewrote it, and its next put evicted the caches of other runs. must_exist is 1: the store is
 * its owner's to make (a compress worker that opened it after the run's folder was moved away
 * made a new one there and committed into it; decode with compute_missing sets it back). */
void kvm_storew_worker_opts(const kvm_config *c, int read_only, kvm_store_opts *o);

/* After a worker's open of s: when c's [store] cap_mb is set (> 0) and is not the store's
 * recorded cap, one warning (event store_cap_kept, once per process) says the cap is kept. */
void kvm_storew_cap_note(kvm_store *s, const kvm_config *c);

/* A worker's kvm_storew_open: kvm_storew_worker_opts, then kvm_storew_cap_note. */
int kvm_storew_open_worker(const kvm_config *c, const char *path, kvm_store **out);

/* For a worker started with --store PATH (compress, strategy): 0 when PATH is a store (a
 * directory holding data.mdb), else KVM_ENOTFOUND or KVM_EFORMAT naming `what` (e.g. "--store")
 * and PATH. Nothing is opened: the worker opens the store with the first job's settings, and
 * that open created a store at a mistyped path, where the caches went unread while the run
 * counted them compressed. */
int kvm_storew_must_exist(const char *what, const char *path);

/* Who holds claims: "run:HOST:PID:START_MS:ID", unique per process start; ID is this process's
 * identity (kvm_rundir_proc_id: boot id, pid namespace, start ticks), left out with its ':' when
 * /proc cannot tell, so that a run of the same machine can tell this one is gone. Written into
 * out[size] (>= 192); host into host[host_size]. */
void kvm_storew_owner(char *out, size_t size, char *host, size_t host_size);

/* 1 when owner (a claim's, kvm_storew_owner's shape "run:HOST:PID:START:ID") whose claim names
 * claim_host is a run of this host (gethostname) that is gone: its process identity ID
 * (kvm_rundir_pid_gone) says the pid no longer runs it. 0 when it may run or cannot be told
 * (another host, another shape, no identity): the caller keeps its lease rule. Never blocks. */
int kvm_storew_owner_gone(const char *owner, const char *claim_host);

/* Claims the cache key for owner for ttl_ms (a lease; see kvm_store_claim_take). *taken = 1
 * when owner holds it now (new, renewed, or taken over from an expired lease), 0 when a live
 * lease of another owner holds it (*holder, may be NULL, says whose). Errors: the store's. */
int kvm_storew_claim(kvm_store *s, const kvm_store_cache_key *key, const char *owner, const char *host, int64_t ttl_ms,
                     int *taken, kvm_store_claim *holder);

/* Renews every lease of owner to now + ttl_ms (call at least once per ttl_ms while the
 * jobs live). Errors: the store's. */
int kvm_storew_renew(kvm_store *s, const char *owner, int64_t ttl_ms);

/* Releases every lease of owner (at the end of a run). Errors: the store's. */
int kvm_storew_release(kvm_store *s, const char *owner);

#endif
