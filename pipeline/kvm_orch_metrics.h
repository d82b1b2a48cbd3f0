/* kvm_orch_metrics.h: the counters file of `kvmill run --metrics FILE` ([run] metrics): one
 * JSON object, rewritten atomically (temporary file in the same folder + rename) while the run
 * goes, so a reader (operator, monitoring agent) always sees a whole, current file. Format
 * (version 1; keys are only ever added):
 *   {"version": 1, "state": "running"|"done"|"interrupted", "updated": "2026-12-01T12:00:00Z",
 *    "elapsed_s": 12.5, "documents_total": 20, "documents_done": 7, "documents_failed": 0,
 *    "documents_skipped": 3, "documents_pending": 10, "requeues": 1, "store_commits": 7,
 *    "wire_in_bytes": 123, "wire_out_bytes": 456, "prefill_s": 1.2, "compress_s": 30.1,
 *    "transport_s": 0.4, "store_s": 0.2, "tokens": 2688, "sched_jobs_max": 3}
 * documents_done = caches committed by this run (the summary's compressed=), store_commits =
 * commits acknowledged by compress workers (equal to documents_done unless a cache was
 * committed twice by a requeued job), requeues = jobs sent again (worker died, went silent,
 * retryable error), wire_* = the summary's wire_in_bytes / wire_out_bytes, *_s = seconds of
 * stage compute, of transport (encode/decode/copy/send in stages and orchestrator) and of
 * store commits (compress workers' LMDB transactions or uploads to the store service),
 * sched_jobs_max = the most jobs one iteration of the orchestrator's loop looked at (dispatch,
 * timeouts, draining): about the jobs it acts on (workers, jobs in them), not the corpus size
 * (a calibration's one strategy build sends every document at once). */
#ifndef KVM_ORCH_METRICS_H
#define KVM_ORCH_METRICS_H

#include <stdint.h>

typedef struct kvm_orch_metrics {
    const char *state; /* "running", "done" or "interrupted" */
    double elapsed_s;
    int64_t documents_total, documents_done, documents_failed, documents_skipped, documents_pending;
    int64_t requeues, store_commits, wire_in_bytes, wire_out_bytes, tokens;
    double prefill_s, compress_s, transport_s, store_s;
    int64_t sched_jobs_max; /* the most jobs one iteration of the broker loop looked at */
} kvm_orch_metrics;

/* Writes m to path atomically: path.tmp.PID in the same folder, fsync-free (a crash leaves the
 * previous file or none), then rename over path. Errors: KVM_EIO naming the path and errno's
 * text (the run goes on: the caller logs it once); KVM_ENOMEM. */
int kvm_orch_metrics_write(const char *path, const kvm_orch_metrics *m);

#endif
