/* kvm_orch_receive.c: the orchestrator's incoming messages: control (ready, heartbeat, ack,
 * result, error) and data (ready credits, kv, stats) from the stage workers, and the job state
 * changes they bring. */
#include "pipeline/kvm_orch_int.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_stage.h"
#include "common/kvm_log.h"
#include "common/kvm_error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

/* The strategy build of a calibration failed (an error for o->reduce_id). A retryable error (a
 * stage handing the build back at SIGTERM, a transient store error) puts the documents back in
 * J_KV_READY with their signals kept, as a dead strategy worker does, and the build is sent
 * again, up to max_retries times: the signals phase is the expensive part and is not run
 * again. A final error, or one retryable error too many, fails every document with its reason
 * (before, the documents waited in J_COMPRESS until job_timeout_s and were requeued, also for
 * errors no retry fixes). */
static void reduce_failed(orch *o, const kvm_proto_result *r)
{
    char why[600];
    snprintf(why, sizeof why, "%.*s stage: %.*s", (int)r->stage.len, r->stage.ptr, (int)r->message.len, r->message.ptr);
    o->workers[o->reduce_worker].job = -1;
    o->reduce_worker = -1;
    if (r->status == KVM_EMISMATCH && kvm_orch__model_changed(o, r->message.ptr, r->message.len))
        snprintf(why, sizeof why, "%s", o->model_changed); /* no retry: every strategy worker loads it */
    const int again = r->retryable && !o->model_changed[0] && ++o->reduce_failures <= o->max_retries;
    if (again) {
        kvm_log_field f[] = {KVM_LOG_I("attempt", o->reduce_failures + 1), KVM_LOG_S("reason", why)};
        kvm_log(KVM_LOG_WARN, "strategy_build_retried", f, 2, "sending the strategy build again (attempt %d): %s",
                o->reduce_failures + 1, why);
    } else if (r->retryable && !o->model_changed[0]) {
        char more[sizeof why];
        snprintf(more, sizeof more, "%s (after %d attempts of the strategy build)", why, o->reduce_failures);
        memcpy(why, more, sizeof why);
    }
    for (int64_t i = kvm_joblist_first(&o->lists, J_COMPRESS), next; i >= 0; i = next) {
        next = kvm_joblist_next(&o->lists, i);
        orch_job *j = &o->jobs[i];
        j->worker = -1;
        if (again) {
            kvm_orch__job_set(o, j, J_KV_READY);
            continue;
        }
        kvm_orch__job_drop_kv(j);
        snprintf(j->reason, sizeof j->reason, "%s", why);
        kvm_orch__job_set(o, j, J_FAILED);
        kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id), KVM_LOG_S("reason", why)};
        kvm_log(KVM_LOG_ERROR, "job_failed", f, 3, "%s failed: %s", j->doc->name, why);
    }
}

/* Whether a worker of routing id idf is in the table (alive or not). */
static int known_worker(const orch *o, const kvm_frame *idf)
{
    for (int w = 0; w < o->n_workers; w++)
        if (strlen(o->workers[w].id) == idf->size && !memcmp(o->workers[w].id, idf->data, idf->size)) return 1;
    return 0;
}

static void on_ctl(orch *o, kvm_msg *m, const kvm_frame *idf)
{
    kvm_proto_type t;
    if (kvm_proto_peek(m, &t)) {
        kvm_orch__log("dropped a malformed control message: %s\n", kvm_errmsg());
        return;
    }
    if (t == KVM_PROTO_READY || t == KVM_PROTO_HEARTBEAT || t == KVM_PROTO_ACK) {
        kvm_proto_ctl c;
        int rc = t == KVM_PROTO_READY       ? kvm_proto_ready_decode(m, &c)
                 : t == KVM_PROTO_HEARTBEAT ? kvm_proto_heartbeat_decode(m, &c)
                                            : kvm_proto_ack_decode(m, &c);
        if (rc) {
            kvm_orch__log("dropped a bad %s: %s\n", kvm_proto_type_name(t), kvm_errmsg());
            return;
        }
        if (t == KVM_PROTO_HEARTBEAT && c.stopping && !known_worker(o, idf)) return; /* not "joined", to stop */
        int w = kvm_orch__worker_get(o, idf, kvm_orch__stage_of(c.stage));
        if (w < 0) return;
        if (o->workers[w].ended && t != KVM_PROTO_ACK) return; /* queued before it was killed */
        if (!o->workers[w].ended) o->workers[w].last_seen = kvm_now_ms(), o->workers[w].alive = 1;
        if (t == KVM_PROTO_READY) kvm_orch__worker_process(o, w, c.pid, c.instance);
        if (t == KVM_PROTO_READY && kvm_orch__worker_refused(o, w, &c, 1)) return;
        /* heard (revision 15): a worker that gets no welcome is not, and connects again */
        if (t == KVM_PROTO_READY && kvm_stage_welcome(o->ctl, idf->data, idf->size, &c, o->cmd))
            kvm_orch__log("could not welcome worker %s: %s\n", o->workers[w].id, kvm_errmsg());
        /* its last word (revision 14): a worker started by hand stops with no job: ended now; the
         * run's own are the slots' to follow, and one with a job here waits out its liveness */
        if (t == KVM_PROTO_HEARTBEAT && c.stopping && o->workers[w].slot < 0 && o->workers[w].job < 0 &&
            w != o->reduce_worker) {
            kvm_orch__worker_dead(o, w, "stopped (it said so: a clean stop)");
            return;
        }
        if (t == KVM_PROTO_HEARTBEAT && c.job_id && c.progress_total > 0) {
            orch_job *hj = kvm_orch__job_by_id(o, c.job_id);
            if (hj && hj->state == J_COMPRESS && hj->worker == w)
                hj->prog_done = (int64_t)c.progress_done, hj->prog_total = (int64_t)c.progress_total;
        }
        if (t == KVM_PROTO_ACK && o->mode == MODE_CALIBRATE && c.job_id == o->reduce_id && o->reduce_worker == w) {
            for (int64_t i = kvm_joblist_first(&o->lists, J_COMPRESS), next; i >= 0; i = next) {
                next = kvm_joblist_next(&o->lists, i);
                o->jobs[i].worker = -1;
                kvm_orch__job_set(o, &o->jobs[i], J_DONE);
                o->sum->compressed++;
                o->sum->truncated += o->jobs[i].doc->truncated;
                o->sum->tokens += o->jobs[i].doc->n_tokens;
            }
            o->workers[w].job = -1;
            o->reduce_worker = -1;
            return;
        }
        if (t == KVM_PROTO_ACK) {
            orch_job *j = kvm_orch__job_by_id(o, c.job_id);
            o->workers[w].store_failures = 0; /* its caches reach a store: kvm_orch__store_fault_counts */
            if (o->mode == MODE_RUN) o->sum->store_commits++;
            if (j && j->state == J_COMPRESS) {
                const int64_t id = j->id; /* a requeued j takes a new one */
                kvm_orch__ack_stored(o, j, w);
                /* text: the progress line says it; only a commit in the run's store is one */
                if (j->state == J_DONE && kvm_log_format_get() == KVM_LOG_JSON) {
                    kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", id),
                                         KVM_LOG_S("worker", o->workers[w].id), KVM_LOG_I("tokens", j->doc->n_tokens)};
                    kvm_log(KVM_LOG_INFO, "job_done", f, 4, "%s committed by %s", j->doc->name, o->workers[w].id);
                }
            }
            if (!j && o->mode == MODE_RUN && (j = kvm_orch__job_by_any_id(o, c.job_id)) && j->state != J_DONE &&
                kvm_orch__stored_now(o, j)) {
                /* an earlier attempt's: it was requeued (its worker judged dead, timed out) but its
                 * cache was committed after all; the document is stored, not failed nor to redo */
                kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", (int64_t)c.job_id),
                                     KVM_LOG_S("worker", o->workers[w].id)};
                kvm_log(KVM_LOG_INFO, "job_done", f, 3, "%s committed by %s (an earlier attempt's job)", j->doc->name,
                        o->workers[w].id);
                kvm_orch__job_committed(o, j);
            }
        }
        return;
    }
    if (t == KVM_PROTO_RESULT || t == KVM_PROTO_ERROR) {
        kvm_proto_result r;
        if ((t == KVM_PROTO_RESULT ? kvm_proto_result_decode(m, &r) : kvm_proto_error_decode(m, &r))) {
            kvm_orch__log("dropped a bad %s: %s\n", kvm_proto_type_name(t), kvm_errmsg());
            return;
        }
        int st = kvm_orch__stage_of(r.stage);
        if (t == KVM_PROTO_RESULT && st >= 0) o->sum->stage_ms[st] += r.compute_ms;
        if (t == KVM_PROTO_RESULT && st == ST_COMPRESS) o->compress_results++;
        if (t == KVM_PROTO_RESULT) o->sum->transport_ms += r.transport_ms, o->sum->store_ms += r.store_ms;
        if (t == KVM_PROTO_RESULT && r.evaluated) {
            o->sum->evaluated++;
            o->sum->kl_sum += r.kl_mean;
        }
        if (t == KVM_PROTO_ERROR && o->mode == MODE_CALIBRATE && r.job_id == o->reduce_id && o->reduce_worker >= 0) {
            reduce_failed(o, &r);
            return;
        }
        orch_job *j = kvm_orch__job_by_id(o, r.job_id);
        if (t == KVM_PROTO_ERROR && j && (j->state == J_PREFILL || j->state == J_COMPRESS)) {
            if (r.status == KVM_EMISMATCH) /* then requeue fails it, with the cause */
                kvm_orch__model_changed(o, r.message.ptr, r.message.len);
            char why[600];
            snprintf(why, sizeof why, "%.*s stage: %.*s", (int)r.stage.len, r.stage.ptr, (int)r.message.len,
                     r.message.ptr);
            if (r.status == KVM_EFULL && strstr(why, "no space left on the store's device"))
                kvm_orch__store_stop(o, j, why, STORE_DEVICE_FULL);
            else if (r.status == KVM_EFULL && strstr(why, "map full at"))
                kvm_orch__store_stop(o, j, why, STORE_MAP_FULL);
            else if (r.status == KVM_EFULL && strstr(why, "the file size limit (ulimit -f"))
                kvm_orch__store_stop(o, j, why, STORE_FILE_LIMIT);
            else if (r.status == KVM_ESTATE && kvm_orch__store_gone_msg(why))
                kvm_orch__store_stop(o, j, why, STORE_GONE);
            else if (kvm_orch__store_damaged(r.status, why)) /* each next document would fail alike */
                kvm_orch__store_stop(o, j, why, STORE_DAMAGED);
            else if (!o->cli && o->store && kvm_store_check_here(o->store)) /* a worker that opened it after */
                kvm_orch__store_stop(o, j, kvm_errmsg(), STORE_GONE);       /* it went: "no such store" */
            else if (r.status == KVM_EIO && strstr(why, "store service") &&
                     kvm_orch__store_fault_worker(o, j->worker) && kvm_orch__store_answers(o, j)) {
                if (kvm_orch__store_fault_counts(o, j->worker, why)) /* its keys or --store */
                    kvm_orch__store_refuse(o, j, j->worker, why);
                else
                    kvm_orch__requeue(o, j, why);
            } else if (o->cli && r.status == KVM_EIO && strstr(why, "store service"))
                kvm_orch__store_stop(o, j, why, STORE_DOWN);
            else if (r.retryable)
                kvm_orch__requeue(o, j, why);
            else {
                if (j->worker >= 0) o->workers[j->worker].job = -1;
                j->worker = -1;
                snprintf(j->reason, sizeof j->reason, "%s", why);
                kvm_orch__job_set(o, j, J_FAILED);
                kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id),
                                     KVM_LOG_S("reason", why)};
                kvm_log(KVM_LOG_ERROR, "job_failed", f, 3, "%s failed: %s", j->doc->name, why);
            }
        }
        return;
    }
    kvm_orch__log("dropped an unexpected %s on the control socket\n", kvm_proto_type_name(t));
}

/* A copy of every frame of m (the receive loop frees m), or NULL when out of memory. */
static kvm_msg *copy_msg(const kvm_msg *m)
{
    kvm_msg *copy = NULL;
    if (kvm_msg_new(&copy)) return NULL;
    for (size_t f = 0; f < kvm_msg_nframes(m); f++) {
        kvm_frame fr = kvm_msg_frame(m, f);
        if (kvm_msg_add_copy(copy, fr.data, fr.size)) {
            kvm_msg_free(&copy);
            return NULL;
        }
    }
    return copy;
}

/* Makes j->kv hold at least n messages; 0 or KVM_ENOMEM (j->kv unchanged). */
static int kv_reserve(orch_job *j, int64_t n)
{
    if (n <= j->kv_cap) return 0;
    kvm_msg **kv = realloc(j->kv, (size_t)n * sizeof *kv);
    if (!kv) return KVM_ENOMEM;
    j->kv = kv;
    j->kv_cap = (int)n;
    return 0;
}

/* Keeps layer kv.layer (== j->n_kv) of the attempt. The first layer's n_layers sizes j->kv; a
 * later layer naming another count (a stage's bug or a hostile peer) would write past it, so
 * the attempt is requeued instead, as it is when the copy cannot be made (a partial copy would
 * reach the compress stage). Returns 0 when kept, else 1 (the job was requeued). */
static int kv_accept(orch *o, orch_job *j, const kvm_proto_kv *kv, const kvm_msg *m)
{
    char why[200];
    if (j->n_kv > 0 && kv->n_layers != j->kv_layers) {
        snprintf(why, sizeof why, "the prefill stage's kv message for layer %lld names %lld layers, its layer 0 %lld",
                 (long long)kv->layer, (long long)kv->n_layers, (long long)j->kv_layers);
        kvm_orch__requeue(o, j, why);
        return 1;
    }
    kvm_msg *copy = copy_msg(m);
    if (!copy || kv_reserve(j, kv->n_layers)) {
        kvm_msg_free(&copy);
        snprintf(why, sizeof why, "out of memory keeping the kv message of layer %lld", (long long)kv->layer);
        kvm_orch__requeue(o, j, why);
        return 1;
    }
    if (j->n_kv == 0) j->kv_layers = kv->n_layers;
    o->kv_heads = kv->n_layers * kv->n_kv_heads;
    j->kv[j->n_kv++] = copy;
    return 0;
}

/* A heartbeat on the data socket: with `stopping`, a worker that stops asks for the end of its work
 * (PROTOCOL.md §5, revision 13). Its credit is withdrawn (no job goes to it: a job it holds
 * already went out, before this answer) and it gets the end-of-work ack. A worker this run does
 * not know, or killed, is answered too (that costs nothing and ends its wait) and not added;
 * one asking twice is answered twice. say: the withdrawn credit is logged (not while the run's
 * own workers stop at its end, where every idle one asks). */
static void on_stopping(orch *o, const kvm_msg *m, const kvm_frame *idf, int say)
{
    kvm_proto_heartbeat c;
    if (kvm_proto_heartbeat_decode(m, &c)) {
        kvm_orch__log("dropped a bad heartbeat on the data socket: %s\n", kvm_errmsg());
        return;
    }
    if (!c.stopping) {
        kvm_orch__log("dropped a heartbeat on the data socket that does not say 'stopping'\n");
        return;
    }
    for (int w = 0; w < o->n_workers; w++) {
        orch_worker *wk = &o->workers[w];
        if (strlen(wk->id) != idf->size || memcmp(wk->id, idf->data, idf->size)) continue;
        if (say && wk->idle && !wk->ended && !c.probe) /* a probe (revision 15) does not stop */
            kvm_log(KVM_LOG_INFO, "worker_stopping", (kvm_log_field[]){KVM_LOG_S("worker", wk->id)}, 1,
                    "worker %s is stopping: its credit is withdrawn", wk->id);
        wk->idle = 0;
    }
    if (kvm_stage_answer_stopping(o->data, idf->data, idf->size, &c, o->cmd))
        kvm_orch__log("could not send the end of its work to stopping worker %.*s: %s\n", (int)c.worker_id.len,
                      c.worker_id.ptr, kvm_errmsg());
}

/* A credit (data `ready`) from worker w while it holds a job. A stage asks for work only with no
 * job and no part of one (kvm_stage.c), once a heartbeat, so credits a liveness period apart
 * after the job was sent say that the job never reached it: lost with a connection that closed
 * (ZeroMQ drops what a closed connection's pipe held; the worker's socket connects again and it
 * asks). Before, the run held the job for a live worker for ever and never ended. The first
 * credits can be older than the job (ctl and data are two connections; the one asking after a
 * result can overtake that result), and a run stopped for a while reads a backlog at once, so
 * the span is counted from the first credit read since the job was sent, not from the send. The
 * job is requeued without using up an attempt (the network's fault, as a send that failed), and
 * the credit makes w idle. The strategy build (calibrate) is left to its own timeout. */
static void lost_job_check(orch *o, int w)
{
    orch_worker *wk = &o->workers[w];
    orch_job *j = &o->jobs[wk->job];
    if (w == o->reduce_worker || j->worker != w || (j->state != J_PREFILL && j->state != J_COMPRESS)) return;
    const double now = kvm_now_ms();
    /* A worker that had the job is silent on data while it runs it: a credit read before the job
     * reached it, then, the job done, the one that overtook its result, were taken for a lost
     * job (done twice) when the job ran a liveness period. A gap longer than gap_ms starts the
     * span again, and a span no longer than gap_ms (two credits around a job) says nothing. */
    const double gap_ms = o->dead_ms / 2 > 2 * o->hb_ms ? o->dead_ms / 2 : 2 * o->hb_ms;
    if (wk->asks_job_id != j->id || wk->asks_since <= 0 || now - wk->asks_last > gap_ms) {
        wk->asks_job_id = j->id, wk->asks_since = wk->asks_last = now;
        return;
    }
    wk->asks_last = now;
    if (now - wk->asks_since < o->dead_ms || now - wk->asks_since <= gap_ms) return;
    char why[400];
    snprintf(why, sizeof why,
             "worker %s asks for work for %.1f s while it holds job %llu: the job did not reach it (lost with a "
             "connection that closed)",
             wk->id, (now - wk->asks_since) / 1000, (unsigned long long)j->id);
    wk->asks_since = 0;
    j->attempt--; /* kvm_orch__requeue counts one: not the document's fault */
    kvm_orch__requeue(o, j, why);
}

static void on_data(orch *o, kvm_msg *m, const kvm_frame *idf)
{
    kvm_proto_type t;
    if (kvm_proto_peek(m, &t)) {
        kvm_orch__log("dropped a malformed data message: %s\n", kvm_errmsg());
        return;
    }
    if (t == KVM_PROTO_HEARTBEAT) {
        on_stopping(o, m, idf, 1);
        return;
    }
    if (t == KVM_PROTO_READY) {
        kvm_proto_ready c;
        if (kvm_proto_ready_decode(m, &c)) return;
        int w = kvm_orch__worker_get(o, idf, kvm_orch__stage_of(c.stage));
        if (w < 0 || o->workers[w].ended) return; /* a killed process's credit: no worker to send to */
        orch_worker *wk = &o->workers[w];
        wk->last_seen = kvm_now_ms();
        wk->alive = 1;
        if (kvm_orch__worker_refused(o, w, &c, 0)) return;
        if (wk->job >= 0) lost_job_check(o, w);
        if (wk->job < 0) wk->idle = 1;
        return;
    }
    if (t == KVM_PROTO_STATS && o->mode == MODE_CALIBRATE) {
        kvm_proto_stats sm;
        if (kvm_proto_stats_decode(m, &sm)) {
            kvm_log(KVM_LOG_WARN, "message", NULL, 0, "dropped a bad stats message: %s", kvm_errmsg());
            return;
        }
        orch_job *j = kvm_orch__job_by_id(o, sm.job_id);
        if (!j || j->state != J_PREFILL) return; /* stale attempt */
        kvm_msg *copy = copy_msg(m);
        if (!copy || kv_reserve(j, 1)) {
            kvm_msg_free(&copy);
            kvm_orch__requeue(o, j, "out of memory keeping a stats message");
            return;
        }
        j->kv[0] = copy;
        j->n_kv = 1;
        if (j->worker >= 0) o->workers[j->worker].job = -1;
        j->worker = -1;
        kvm_orch__job_set(o, j, J_KV_READY);
        return;
    }
    if (t != KVM_PROTO_KV || o->mode != MODE_RUN) {
        kvm_orch__log("dropped an unexpected %s on the data socket\n", kvm_proto_type_name(t));
        return;
    }
    kvm_proto_kv kv;
    if (kvm_proto_kv_decode(m, &kv)) {
        kvm_orch__log("dropped a bad kv message: %s\n", kvm_errmsg());
        return;
    }
    orch_job *j = kvm_orch__job_by_id(o, kv.job_id);
    if (!j || j->state != J_PREFILL || kv.layer != j->n_kv) return; /* stale attempt */
    if (kv_accept(o, j, &kv, m)) return;
    if (j->n_kv == kv.n_layers) {
        if (j->worker >= 0) o->workers[j->worker].job = -1;
        j->worker = -1;
        kvm_orch__job_set(o, j, J_KV_READY);
    }
}

void kvm_orch__receive(orch *o, void *sock, int is_ctl)
{
    for (int k = 0; k < 1000; k++) {
        kvm_msg *m = NULL, *env = NULL;
        if (kvm_msg_recv(sock, &m, ZMQ_DONTWAIT)) return;
        if (kvm_msg_nframes(m) >= 2 && kvm_msg_split(m, 1, &env) == 0) {
            if (kvm_serve_answer_misdirected(sock, &env, m, o->base, is_ctl, "kvmill run",
                                             "the front end a kvmill serve's \"ready\" line names (a run answers "
                                             "no ask)")) {
                kvm_orch__log("answered an ask sent to the run's %s socket (a client given the wrong endpoint)\n",
                              is_ctl ? "ctl" : "data");
                kvm_msg_free(&m);
                continue;
            }
            kvm_frame idf = kvm_msg_frame(env, 0);
            if (is_ctl)
                on_ctl(o, m, &idf);
            else {
                o->sum->wire_in_bytes += kvm_orch__msg_bytes(m);
                on_data(o, m, &idf);
            }
        }
        kvm_msg_free(&env);
        kvm_msg_free(&m);
    }
}

void kvm_orch__answer_stopping(orch *o)
{
    for (int k = 0; k < 1000; k++) {
        kvm_msg *m = NULL, *env = NULL;
        kvm_proto_type t;
        if (kvm_msg_recv(o->data, &m, ZMQ_DONTWAIT)) return;
        if (kvm_msg_nframes(m) >= 2 && kvm_msg_split(m, 1, &env) == 0 && !kvm_proto_peek(m, &t) &&
            t == KVM_PROTO_HEARTBEAT) {
            kvm_frame idf = kvm_msg_frame(env, 0);
            on_stopping(o, m, &idf, 0);
        }
        kvm_msg_free(&env);
        kvm_msg_free(&m);
    }
}
