/* kvm_orch.h: the orchestrator of `kvmill run`: binds the control and data endpoints,
 * starts and supervises the stage processes the config names, feeds documents through
 * prefill -> compress as a load-balancing broker (workers ask for work with a `ready`
 * credit), tracks every job (queued, in prefill, waiting, in compress, done, failed),
 * requeues the jobs of a worker that died, went silent or failed retryably (bounded
 * retries), and stops every stage at the end or on Ctrl-C. */
#ifndef KVM_ORCH_H
#define KVM_ORCH_H

#include "pipeline/kvm_config.h"
#include "pipeline/kvm_corpus.h"

#include <stdint.h>

typedef struct kvm_orch_summary {
    int64_t compressed, skipped, failed;            /* documents */
    int64_t repeated;                               /* of skipped: duplicates (the same tokens) of another document
                                                       of the corpus, not already stored by an earlier run */
    int64_t truncated;                              /* of the documents compressed in this run, those longer than
                                                       [model] context (truncated to it); documents skipped as
                                                       stored, failed or left by a Ctrl-C are not counted */
    int64_t bytes_full, bytes_compressed;           /* of the documents compressed in this run */
    double seconds;                                 /* wall time of the run */
    double stage_ms[4];                             /* compute time per stage: prefill, compress, signals, strategy */
    int64_t tokens;                                 /* tokens of the documents compressed */
    int interrupted;                                /* 1: stopped by Ctrl-C */
    int64_t pending;                                /* documents not processed because of it */
    int64_t evaluated;                              /* documents with a KL measurement ([eval]) */
    double kl_sum;                                  /* sum of their mean KL, nats */
    double transport_ms;                            /* message encode/decode/copy/send, stages + orchestrator */
    int64_t claimed;                                /* documents left to another live run compressing them */
    int64_t prefetch_peak;                          /* most documents prefilled (or in prefill) but not yet
                                                       taken by compress at once ([run] max_prefetch) */
    int64_t evicted;                                /* caches the store's cap evicted during the run */
    int64_t evicted_own;                            /* of those, caches this run wrote */
    int store_full;                                 /* stopped feeding: 1: no space left on the store's device;
                                                       2: the store's map reached [store] map_max_mb;
                                                       3: the file size limit (ulimit -f) stops data.mdb */
    int store_down;                                 /* stopped feeding: 1: the store service did not answer;
                                                       2: the local store is no longer the one opened;
                                                       3: the store's data.mdb is damaged */
    int bytes_unknown;                              /* 1: bytes_full, bytes_compressed and evicted not known (0):
                                                       the store service that holds the caches was not asked or
                                                       did not answer (a remote run counts evictions by the same
                                                       probes that sum the bytes) */
    int64_t wire_in_bytes;                          /* message bytes the orchestrator received on its data socket
                                                       (prefill's kv messages, workers' ready credits) */
    int64_t requeues;                               /* jobs sent again (dead or silent worker, retryable error) */
    int64_t store_commits;                          /* acks of compress workers whose cache is in the run's store */
    double store_ms;                                /* compress workers' time committing caches (LMDB or upload) */
    int64_t wire_out_bytes;                         /* message bytes it sent there (jobs to prefill; jobs and the
                                                       forwarded kv messages to compress) */
    int64_t entries_sum, entries_min, entries_max;  /* KV entries (all layers and KV heads) of the caches
                                                       compressed in this run: sum, smallest, largest */
    int64_t entries_docs;                           /* caches those count */
    int64_t kept_full;                              /* of those, caches that keep every entry of their document's
                                                       full KV (too short for compression to save one: stored
                                                       unchanged); -1: not known (a store service: its probes
                                                       give sizes only) */
    int strategy_stored;                            /* calibrate, interrupted: 1: the strategy build stored its
                                                       strategy and it could not be taken back out (said) */
} kvm_orch_summary;

/* Runs the pipeline over a corpus: prepared (kvm_doc_prepare done), or with on_demand set,
 * when each document is loaded as it is scanned (hash, skip check: one at a time) and again
 * when it is dispatched, and released once done; at most [run] max_prefetch documents are
 * prefilled and waiting for compress. The store must hold the model's id memo; documents
 * whose cache is stored are skipped; documents that cannot be loaded fail alone. With [store]
 * path a store service endpoint (tcp://, ipc://) the run opens no LMDB: stored checks, claims
 * and the summary's sizes go through the service (kvm_orch_remote.h). Writes progress to stderr
 * and returns 0 when the run completed (failures are counted in the summary), 2 for a
 * configuration problem (missing stage binary, bad endpoint, missing CurveZMQ keys for a
 * non-local bind: message printed), 130 after a second Ctrl-C. */
int kvm_orch_run(const kvm_config *cfg, kvm_corpus *corpus, const char *self_path, kvm_orch_summary *sum);

/* PolyKV calibration through the stages: every document (prepared with the context, its
 * continuation after it) goes to a kvmill-signals worker; when all have their signals, one
 * kvmill-strategy worker builds the best strategy over them and stores it under (model id,
 * [compress] strategy). Same return values as kvm_orch_run; sum->compressed counts the
 * calibration documents used. */
int kvm_orch_calibrate(const kvm_config *cfg, kvm_corpus *corpus, const char *self_path, kvm_orch_summary *sum);

#endif
