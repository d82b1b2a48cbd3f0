/* kvm_orch_metrics.c: the `kvmill run --metrics FILE` counters file (kvm_orch_metrics.h),
 * a JSON object built with libjansson and put in place by rename(2). */
#include "pipeline/kvm_orch_metrics.h"
#include "common/kvm_error.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static json_t *metrics_json(const kvm_orch_metrics *m)
{
    char when[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return json_pack("{s:i, s:s, s:s, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f, s:f, s:I, s:I}",
                     "version", 1, "state", m->state ? m->state : "running", "updated", when, "elapsed_s", m->elapsed_s,
                     "documents_total", (json_int_t)m->documents_total, "documents_done", (json_int_t)m->documents_done,
                     "documents_failed", (json_int_t)m->documents_failed, "documents_skipped",
                     (json_int_t)m->documents_skipped, "documents_pending", (json_int_t)m->documents_pending, "requeues",
                     (json_int_t)m->requeues, "store_commits", (json_int_t)m->store_commits, "wire_in_bytes",
                     (json_int_t)m->wire_in_bytes, "wire_out_bytes", (json_int_t)m->wire_out_bytes, "prefill_s",
                     m->prefill_s, "compress_s", m->compress_s, "transport_s", m->transport_s, "store_s", m->store_s,
                     "tokens", (json_int_t)m->tokens, "sched_jobs_max", (json_int_t)m->sched_jobs_max);
}

int kvm_orch_metrics_write(const char *path, const kvm_orch_metrics *m)
{
    json_t *o = metrics_json(m);
    if (!o) return kvm_err(KVM_ENOMEM, "metrics %s: out of memory", path);
    size_t n = strlen(path) + 32;
    char *tmp = malloc(n);
    if (!tmp) { json_decref(o); return kvm_err(KVM_ENOMEM, "metrics %s: out of memory", path); }
    snprintf(tmp, n, "%s.tmp.%ld", path, (long)getpid());
    int rc = 0;
    if (json_dump_file(o, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0)
        rc = kvm_err(KVM_EIO, "metrics: cannot write %s: %s", tmp, strerror(errno));
    else if (rename(tmp, path) != 0)
        rc = kvm_err(KVM_EIO, "metrics: cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (rc) unlink(tmp);
    json_decref(o);
    free(tmp);
    return rc;
}
