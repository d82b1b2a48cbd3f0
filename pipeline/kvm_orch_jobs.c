/* kvm_orch_jobs.c: the orchestrator's job table: states and their lists, loading a document's
 * tokens, requeueing a job for a new attempt, and finding a job by attempt id. */
#include "pipeline/kvm_orch_int.h"
#include "pipeline/kvm_stage.h"
#include "common/kvm_log.h"
#include "common/kvm_error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct job_by_id_probe {
    const orch *o;
    uint64_t id;
} job_by_id_probe;

/* A line on stderr prefixed with the command: "kvmill run: ..." */
void kvm_orch__log(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvm_logv(KVM_LOG_INFO, "message", NULL, 0, fmt, ap);
    va_end(ap);
}

void kvm_orch__job_drop_kv(orch_job *j)
{
    for (int i = 0; i < j->n_kv; i++)
        kvm_msg_free(&j->kv[i]);
    j->n_kv = 0;
}

/* Sets a job's state and moves it to that state's list: at the back, so the lists of jobs in
 * workers are in the order they were sent (oldest first: timeouts stop at the first that has
 * not timed out); a job back in the queue goes to its front (it was sent before every job still
 * queued, as the corpus order has it). */
void kvm_orch__job_move(orch *o, orch_job *j, orch_job_state s)
{
    j->state = s;
    kvm_joblist_move(&o->lists, j - o->jobs, s, s == J_QUEUED);
}

void kvm_orch__job_set(orch *o, orch_job *j, orch_job_state s)
{
    if ((j->state == J_DONE || j->state == J_FAILED) != (s == J_DONE || s == J_FAILED)) o->n_open--;
    kvm_orch__job_move(o, j, s);
    j->since_ms = kvm_now_ms();
    /* a document's tokens live only while it is in a worker or waiting for compress */
    if (o->corpus->on_demand && (s == J_QUEUED || s == J_DONE || s == J_FAILED)) kvm_doc_release(j->doc);
}

/* Tokens after the context a job carries: [eval] continuation for the KL evaluation (and
 * calibration), twice that for [compress] target_kl (a search part and a check part). */
int64_t kvm_orch__continuation_tokens(const orch *o)
{
    int64_t t = kvm_config_int(o->cfg, "eval", "continuation");
    if (o->mode == MODE_CALIBRATE) return t;
    if (kvm_config_float(o->cfg, "compress", "target_kl") > 0) return 2 * t;
    return kvm_config_bool(o->cfg, "eval", "enabled") ? t : 0;
}

/* Loads an on-demand document's tokens (a no-op for prepared ones). A document that cannot
 * be loaded fails alone, with the reason. Returns 0 when its tokens are there. */
int kvm_orch__job_load(orch *o, orch_job *j)
{
    if (!o->corpus->on_demand || j->doc->tokens) return 0;
    const kvm_corpus *c = o->corpus;
    int64_t ctx = kvm_config_int(o->cfg, "model", "context");
    int64_t keep = ctx + kvm_orch__continuation_tokens(o);
    const kvm_store_id scanned = j->doc->hash;
    int rc = kvm_corpus_load(c, j->doc, c->tok, c->vocab_size, c->bos, ctx, keep);
    if (rc == 0 && (!j->hashed || !memcmp(&scanned, &j->doc->hash, sizeof scanned))) {
        j->hashed = 1;
        return 0;
    }
    if (rc == 0) { /* the claim, the stored check and by_hash name the scanned content, not this */
        j->doc->hash = scanned;
        snprintf(j->reason, sizeof j->reason,
                 "%s changed since the run scanned it (its tokens differ now; run again to compress the new content)",
                 j->doc->name);
    } else
        snprintf(j->reason, sizeof j->reason, "%s", kvm_errmsg());
    /* a failed document, as one a stage fails (an info "message" without the doc before: a JSON
     * log's reader looking for job_failed missed every empty or unreadable file) */
    kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", (int64_t)j->id),
                         KVM_LOG_S("reason", j->reason)};
    kvm_log(KVM_LOG_ERROR, "job_failed", f, 3, "%s: not processed", j->reason);
    kvm_orch__job_set(o, j, J_FAILED);
    return -1;
}

/* Puts a job back in the queue (a new attempt), or fails it after max_retries. */
void kvm_orch__requeue(orch *o, orch_job *j, const char *why)
{
    if (j->worker >= 0) {
        o->workers[j->worker].job = -1;
        j->worker = -1;
    }
    kvm_orch__job_drop_kv(j);
    j->attempt++;
    if (j->attempt > o->max_retries || o->model_changed[0]) {
        if (o->model_changed[0]) /* no attempt can succeed: the workers load other weights */
            snprintf(j->reason, sizeof j->reason, "%s", o->model_changed);
        else
            snprintf(j->reason, sizeof j->reason, "%s (after %d attempts)", why, j->attempt);
        kvm_orch__job_set(o, j, J_FAILED);
        kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id),
                             KVM_LOG_S("reason", j->reason)};
        kvm_log(KVM_LOG_ERROR, "job_failed", f, 3, "%s failed: %s", j->doc->name, j->reason);
        return;
    }
    o->sum->requeues++;
    kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id),
                         KVM_LOG_I("attempt", j->attempt + 1), KVM_LOG_S("reason", why)};
    kvm_log(KVM_LOG_WARN, "job_requeued", f, 4, "requeueing %s (attempt %d): %s", j->doc->name, j->attempt + 1, why);
    j->id = o->next_id++;
    if (kvm_idxset_add(&o->by_id, j->id, j - o->jobs)) { /* its messages could not be found */
        snprintf(j->reason, sizeof j->reason, "%s (then: %s)", why, kvm_errmsg());
        kvm_orch__job_set(o, j, J_FAILED);
        return;
    }
    kvm_orch__job_set(o, j, J_QUEUED);
}

/* A job id looked up in o->by_id: the job's current attempt, not a skipped one. */
static int same_id(void *user, int64_t idx)
{
    const job_by_id_probe *p = user;
    return p->o->jobs[idx].id == p->id && p->o->jobs[idx].state != J_SKIPPED;
}

/* Any attempt's id: by_id's hash is the id itself, so a slot under it is that id's entry. */
static int any_attempt(void *user, int64_t idx)
{
    const job_by_id_probe *p = user;
    return p->o->jobs[idx].state != J_SKIPPED;
}

orch_job *kvm_orch__job_by_any_id(orch *o, uint64_t id)
{
    job_by_id_probe p = {o, id};
    int64_t i = kvm_idxset_find(&o->by_id, id, any_attempt, &p);
    return i >= 0 ? &o->jobs[i] : NULL;
}

void kvm_orch__job_committed(orch *o, orch_job *j)
{
    if (j->state == J_DONE) return;
    if (j->worker >= 0) o->workers[j->worker].job = -1; /* that worker's ready makes it idle again */
    j->worker = -1;
    kvm_orch__job_drop_kv(j);
    kvm_orch__job_set(o, j, J_DONE);
    o->sum->compressed++;
    o->sum->truncated += j->doc->truncated; /* of the documents compressed: not skipped or left ones */
    o->sum->tokens += j->doc->n_tokens;
}

/* The job whose current attempt is id, or NULL (a stale attempt, a skipped job, not ours). */
orch_job *kvm_orch__job_by_id(orch *o, uint64_t id)
{
    job_by_id_probe p = {o, id};
    int64_t i = kvm_idxset_find(&o->by_id, id, same_id, &p);
    return i >= 0 ? &o->jobs[i] : NULL;
}
