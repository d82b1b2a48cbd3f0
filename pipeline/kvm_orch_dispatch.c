/* kvm_orch_dispatch.c: the orchestrator's scheduling: job messages, sending queued documents
 * to prefill (or signals) workers within the prefetch bound, prefilled ones with their KV to
 * compress workers, and calibrate's one strategy build. */
#include "pipeline/kvm_orch_int.h"
#include "pipeline/kvm_jobcfg.h"
#include "model/kvm_utf8.h"
#include "common/kvm_log.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Bytes of a message's frames (routing ids excluded): what it costs on the wire, give or
 * take ZeroMQ's few bytes of framing per part. */
int64_t kvm_orch__msg_bytes(const kvm_msg *m)
{
    int64_t n = 0;
    for (size_t f = 0; f < kvm_msg_nframes(m); f++)
        n += (int64_t)kvm_msg_frame(m, f).size;
    return n;
}

/* Sends m (taken) to worker `id` on the data socket, counting its bytes as sent. */
static int send_to(orch *o, const char *id, kvm_msg **m)
{
    kvm_msg *env = NULL;
    if (*m) o->sum->wire_out_bytes += kvm_orch__msg_bytes(*m);
    void *sock = o->data;
    int rc = kvm_msg_new(&env);
    if (!rc) rc = kvm_msg_add_copy(env, id, strlen(id));
    if (!rc) rc = kvm_msg_join(env, m);
    if (!rc) rc = kvm_msg_send(sock, &env, 0);
    kvm_msg_free(&env);
    kvm_msg_free(m);
    return rc;
}

static int job_message(orch *o, orch_job *j, kvm_msg **out)
{
    uint8_t *mp = NULL;
    size_t n = 0;
    int rc = kvm_jobcfg_pack(o->cfg, &mp, &n);
    if (rc) return rc;
    /* The name on the wire is 1..KVM_PROTO_MAX_NAME_BYTES of UTF-8: a file name in latin-1 or a
     * JSONL id longer than that failed to encode at every attempt and the document was never
     * compressed. Bad bytes become U+FFFD and a longer name is cut at a character (the store
     * keeps a name's first 255 bytes anyway); the corpus and the logs keep the name as it is. */
    const char *name = j->doc->name ? j->doc->name : "";
    char *wire = NULL;
    size_t wn = 0;
    rc = kvm_utf8_sanitize(name, strlen(name), &wire, &wn, NULL);
    if (rc) {
        free(mp);
        return rc;
    }
    wn = kvm_utf8_cut(wire, wn, KVM_PROTO_MAX_NAME_BYTES);
    kvm_proto_str wname = {wire, wn};
    kvm_proto_job pj = {.job_id = j->id,
                        .attempt = j->attempt,
                        .doc_id = wname,
                        .doc_name = wname,
                        .n_ctx = kvm_config_int(o->cfg, "model", "context"),
                        .n_tokens = j->doc->n_tokens,
                        .tokens = j->doc->tokens,
                        .settings = mp,
                        .settings_bytes = n,
                        .has_model_id = true}; /* revision 10: a worker whose file at the settings' path
                                                  holds other weights refuses the job */
    memcpy(pj.model_id, o->model_id.b, sizeof pj.model_id);
    if (kvm_orch__continuation_tokens(o) > 0) { /* held-out continuation */
        int64_t t = kvm_orch__continuation_tokens(o), avail = j->doc->n_original - j->doc->n_tokens;
        pj.n_continuation = t < avail ? t : avail;
        pj.continuation = pj.n_continuation > 0 ? j->doc->tokens + j->doc->n_tokens : NULL;
    }
    rc = kvm_proto_job_encode(&pj, out);
    free(mp);
    free(wire);
    return rc;
}

static int idle_worker(orch *o, int stage)
{
    for (int w = 0; w < o->n_workers; w++)
        if (kvm_orch__worker_counts(o, w) && o->workers[w].idle && o->workers[w].job < 0 &&
            o->workers[w].stage == stage)
            return w;
    return -1;
}

/* Sends a copy of every frame of m to worker id on the data socket. */
static int send_copy(orch *o, const char *id, const kvm_msg *m)
{
    kvm_msg *c = NULL;
    int rc = kvm_msg_new(&c);
    for (size_t f = 0; !rc && f < kvm_msg_nframes(m); f++) {
        kvm_frame fr = kvm_msg_frame(m, f);
        rc = kvm_msg_add_copy(c, fr.data, fr.size);
    }
    if (!rc) return send_to(o, id, &c);
    kvm_msg_free(&c);
    return rc;
}

/* calibrate: once every document has its signals (or failed), one strategy worker gets the
 * build request "calibrate:N" and the N (job, stats) pairs. */
static void dispatch_reduce(orch *o)
{
    const kvm_joblist *l = &o->lists;
    if (o->model_changed[0]) { /* signals of documents measured before the change: no strategy from a part */
        for (int64_t i = kvm_joblist_first(l, J_KV_READY), next; i >= 0; i = next) {
            next = kvm_joblist_next(l, i);
            snprintf(o->jobs[i].reason, sizeof o->jobs[i].reason, "%s", o->model_changed);
            kvm_orch__job_drop_kv(&o->jobs[i]);
            kvm_orch__job_set(o, &o->jobs[i], J_FAILED);
        }
        return;
    }
    if (kvm_joblist_count(l, J_QUEUED) + kvm_joblist_count(l, J_PREFILL) + kvm_joblist_count(l, J_COMPRESS) +
            kvm_joblist_count(l, J_DONE) >
        0)
        return; /* signals still running (or the build is sent) */
    int64_t ready = kvm_joblist_count(l, J_KV_READY);
    int w = ready > 0 && o->reduce_worker < 0 ? idle_worker(o, ST_STRATEGY) : -1;
    if (w < 0) return;
    orch_job req = {.doc = NULL, .id = o->reduce_id = o->next_id++};
    kvm_doc fake = {.name = "calibrate", .tokens = (int32_t[]){1}, .n_tokens = 1, .n_original = 1};
    char name[64];
    snprintf(name, sizeof name, "calibrate:%lld", (long long)ready);
    fake.name = name;
    req.doc = &fake;
    kvm_msg *m = NULL;
    int mode = o->mode;
    o->mode = MODE_RUN; /* the request itself carries no continuation */
    int rc = job_message(o, &req, &m) || send_to(o, o->workers[w].id, &m);
    o->mode = mode;
    for (int64_t i = kvm_joblist_first(l, J_KV_READY), next; !rc && i >= 0; i = next) { /* once per calibration */
        next = kvm_joblist_next(l, i);
        orch_job *j = &o->jobs[i];
        kvm_msg *jm = NULL;
        rc = job_message(o, j, &jm) || send_to(o, o->workers[w].id, &jm) || send_copy(o, o->workers[w].id, j->kv[0]);
        if (!rc) j->worker = w, kvm_orch__job_set(o, j, J_COMPRESS);
    }
    if (rc) {
        kvm_log(KVM_LOG_ERROR, "message", NULL, 0, "could not send the strategy build: %s", kvm_errmsg());
        return;
    }
    o->workers[w].idle = 0;
    o->workers[w].job = 0;
    o->reduce_worker = w;
}

/* The prefetch bound: documents prefilled (or in prefill) but not yet taken by a compress
 * worker. [run] max_prefetch, or 0 = 2 per live compress worker. A prefill dispatch takes
 * one credit; handing the KV to compress (or a failure, or a requeue) gives it back. */
static int64_t prefetch_limit(const orch *o)
{
    int64_t n = kvm_config_int(o->cfg, "run", "max_prefetch");
    if (n > 0) return n;
    for (int w = 0; w < o->n_workers; w++)
        n += kvm_orch__worker_counts(o, w) && o->workers[w].stage == ST_COMPRESS;
    return 2 * n;
}

static int64_t prefetch_used(const orch *o)
{
    return kvm_joblist_count(&o->lists, J_PREFILL) + kvm_joblist_count(&o->lists, J_KV_READY);
}

/* A send to worker w failed (EHOSTUNREACH: its connection is gone, the process killed or
 * restarted; or its queue is full). The worker's fault, not the document's: the job that was
 * being sent keeps its attempt and stays where it was, and w is dead, so idle_worker does not
 * hand it out again (every send failed and each used up an attempt: a document failed "after 4
 * attempts" in a moment, all against one peer). */
static void unreachable(orch *o, int w)
{
    char why[300];
    snprintf(why, sizeof why, "could not be reached (%s)", kvm_errmsg());
    kvm_orch__worker_dead(o, w, why);
}

/* Nothing of a job reached worker w (EHOSTUNREACH: its connection is down, for a moment or for
 * good). It holds no job, so it is only no longer idle: a live worker asks again once it is
 * connected (a credit), and a gone one is found by its silent heartbeats. Killing it, as for a
 * job sent in part, spent one of its slot's restarts on a network blip. */
static void not_idle(orch *o, int w)
{
    kvm_log_field f[] = {KVM_LOG_S("worker", o->workers[w].id)};
    kvm_log(KVM_LOG_WARN, "message", f, 1, "worker %s could not be reached (%s): waiting for it to ask again",
            o->workers[w].id, kvm_errmsg());
    o->workers[w].idle = 0;
}

/* A queued document to a prefill (run) or signals (calibrate) worker, if one is idle.
 * Returns 1 when it was sent. */
static int dispatch_first(orch *o, orch_job *j, int64_t i)
{
    int w = idle_worker(o, o->mode == MODE_CALIBRATE ? ST_SIGNALS : ST_PREFILL);
    if (w < 0 || kvm_orch__claim_job(o, j) || kvm_orch__job_load(o, j))
        return 0; /* claim first: a document left to another run is not read */
    kvm_msg *m = NULL;
    if (job_message(o, j, &m)) {
        kvm_orch__requeue(o, j, kvm_errmsg());
        return 0;
    }
    if (send_to(o, o->workers[w].id, &m)) {
        not_idle(o, w);
        if (o->corpus->on_demand) kvm_doc_release(j->doc); /* stays queued, loaded again when sent */
        return 0;
    }
    o->workers[w].idle = 0;
    o->workers[w].job = (int)i;
    j->worker = w;
    kvm_orch__job_set(o, j, J_PREFILL);
    return 1;
}

/* A prefilled document's job and KV to an idle compress worker. */
static void dispatch_compress(orch *o, orch_job *j, int64_t i)
{
    int w = idle_worker(o, ST_COMPRESS);
    if (w < 0) return;
    kvm_msg *m = NULL;
    if (job_message(o, j, &m)) {
        kvm_orch__requeue(o, j, kvm_errmsg());
        return;
    }
    int rc = send_to(o, o->workers[w].id, &m);
    if (rc) { /* nothing of it reached the worker: the KV stays, for the next one */
        not_idle(o, w);
        return;
    }
    for (int l = 0; !rc && l < j->n_kv; l++)
        rc = send_to(o, o->workers[w].id, &j->kv[l]);
    kvm_orch__job_drop_kv(j);
    if (rc) { /* the KV went in part: the document is prefilled again, but not at its expense */
        unreachable(o, w);
        j->attempt--; /* kvm_orch__requeue counts one */
        kvm_orch__requeue(o, j, "a compress worker could not be reached while its KV was sent");
        return;
    }
    o->workers[w].idle = 0;
    o->workers[w].job = (int)i;
    j->worker = w;
    j->prog_done = j->prog_total = 0;
    kvm_orch__note_evictions(o, j);
    kvm_orch__job_set(o, j, J_COMPRESS);
}

/* After a Ctrl-C, or once the store's device is full, nothing new goes to a worker: only
 * the jobs in workers finish. */
void kvm_orch__dispatch(orch *o)
{
    if (*o->interrupts || o->store_full) return;
    if (o->mode == MODE_CALIBRATE) dispatch_reduce(o);
    /* compress first: it returns prefetch credits; each job tried leaves the list (sent, or
     * requeued) or its worker is dead (unreachable), so this ends */
    for (int64_t i; o->mode == MODE_RUN && (i = kvm_joblist_first(&o->lists, J_KV_READY)) >= 0 &&
                    idle_worker(o, ST_COMPRESS) >= 0;) {
        o->visited++;
        dispatch_compress(o, &o->jobs[i], i);
    }
    int64_t used = prefetch_used(o), limit = o->mode == MODE_RUN ? prefetch_limit(o) : INT64_MAX;
    int first_stage = o->mode == MODE_CALIBRATE ? ST_SIGNALS : ST_PREFILL;
    /* the queue in order, while a worker is idle: a job not sent (left to another run, stored
     * meanwhile, unreadable) has left the queue; one whose send failed went back to its front
     * (the rest wait for the next event); a claim may find the store down */
    for (int64_t i = kvm_joblist_first(&o->lists, J_QUEUED), next;
         i >= 0 && used < limit && !o->store_full && idle_worker(o, first_stage) >= 0; i = next) {
        next = kvm_joblist_next(&o->lists, i);
        o->visited++;
        int sent = dispatch_first(o, &o->jobs[i], i);
        if (!sent && o->jobs[i].state == J_QUEUED) break;
        used += sent;
    }
    if (used > o->sum->prefetch_peak) o->sum->prefetch_peak = used;
}
