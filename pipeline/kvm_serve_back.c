/* kvm_serve_back.c: the serving broker's back end: decode workers joining, their answers and
 * errors relayed to the waiting clients, a dead worker's client told, and queued requests
 * handed to idle workers. */
#include "pipeline/kvm_serve_int.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_stage.h"
#include "store/kvm_store.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <zmq.h>

/* ---- workers ---- */

static int worker_find(srv *s, const kvm_frame *idf, int create)
{
    if (!idf->size || !idf->data[0]) { /* ZeroMQ's own id (0 and 4 bytes): a peer that set none */
        if (create && !s->anonymous_said)
            kvm_serve__log("dropped a message from a peer without a worker id (a ZeroMQ socket that set no "
                           "routing id; kvmill-decode sets its --id): it is not a decode worker");
        s->anonymous_said |= create;
        return -1;
    }
    char id[256];
    size_t n = idf->size < sizeof id - 1 ? idf->size : sizeof id - 1;
    memcpy(id, idf->data, n);
    id[n] = '\0';
    for (int w = 0; w < s->n_workers; w++)
        if (!strcmp(s->workers[w].id, id)) {
            if (create && !s->workers[w].alive && s->workers[w].slot < 0) /* stopped or silent, now back */
                kvm_serve__log("external decode worker %s joined again", id);
            return w;
        }
    if (!create) return -1;
    int w = -1;
    for (int k = 0; k < s->n_workers && w < 0; k++) /* reuse the entry of a dead worker */
        if (!s->workers[k].alive && !s->workers[k].busy) w = k;
    if (w < 0) {
        if (s->n_workers == MAX_WORKERS) return -1;
        w = s->n_workers++;
    }
    srv_worker *wk = &s->workers[w];
    *wk = (srv_worker){.alive = 1, .slot = -1, .last_seen = kvm_now_ms()};
    snprintf(wk->id, sizeof wk->id, "%s", id);
    for (int i = 0; i < s->n_slots; i++)
        if (!strcmp(s->slots[i].id, id)) wk->slot = i, s->slots[i].early_exits = 0;
    if (wk->slot >= 0)
        kvm_serve__log("decode worker %s joined (started by this server)", id);
    else
        kvm_serve__log("external decode worker %s joined", id);
    return w;
}

/* The worker is gone: its client gets an error; a spawned one is restarted. */
/* Ends the request worker w holds (its client told why, to ask again: "decode worker W <why>
 * while answering" or, lost before it reached the worker, "... <why>"), its document's hold and
 * its grant released. */
static void drop_request(srv *s, int w, const char *why, int answering)
{
    srv_worker *wk = &s->workers[w];
    if (wk->busy && wk->env) {
        char msg[512];
        snprintf(msg, sizeof msg, "decode worker %s %s%s; try again", wk->id, why, answering ? " while answering" : "");
        kvm_serve__reply_error(s, &wk->env, wk->request_id, KVM_EIO, msg);
    }
    kvm_msg_free(&wk->env);
    kvm_serve__doc_release(s, wk, SRV_END_UNSTORED, why);
    kvm_serve__grant_done(s, wk, 0);
    wk->busy = 0;
}

void kvm_serve__worker_process(srv *s, int w, int64_t pid, uint64_t instance)
{
    srv_worker *wk = &s->workers[w];
    char why[200];
    if (!kvm_stage_new_process(&wk->ctl_pid, &wk->ctl_instance, pid, instance, "the request", why, sizeof why) ||
        !wk->busy)
        return;
    kvm_serve__log("decode worker %s %s: request %llu ends", wk->id, why, (unsigned long long)wk->request_id);
    drop_request(s, w, why, 1);
}

void kvm_serve__worker_dead(srv *s, int w, const char *why)
{
    srv_worker *wk = &s->workers[w];
    if (!wk->alive && !wk->busy) return;
    kvm_serve__log("decode worker %s %s", wk->id, why);
    drop_request(s, w, why, 1);
    wk->alive = wk->idle = wk->busy = 0;
    if (wk->slot >= 0 && !*s->interrupts) {
        srv_slot *sl = &s->slots[wk->slot];
        if (sl->pid > 0) {
            kill(sl->pid, SIGKILL);
            waitpid(sl->pid, NULL, 0);
            sl->pid = 0;
        }
        /* a process that dies right after starting is restarted after a pause, not in a loop */
        double now = kvm_now_ms();
        sl->respawn_at = now - sl->started_ms < 5000 ? now + 2000 : now;
        sl->respawns++;
    }
    wk->slot = -1;
}

/* ---- back end ---- */

/* The hex of worker wk's model (its ready's) and of the server's, into gh and wh. */
static void model_hexes(const srv *s, const srv_worker *wk, char gh[65], char wh[65])
{
    kvm_store_id a, b;
    memcpy(a.b, wk->other_model, sizeof a.b);
    memcpy(b.b, s->o->model_id, sizeof b.b);
    kvm_store_id_hex(&a, gh);
    kvm_store_id_hex(&b, wh);
}

/* The hex of a 32-byte settings id, into h. */
static const char *settings_hex(const uint8_t *id, char h[65])
{
    kvm_store_id a;
    memcpy(a.b, id, sizeof a.b);
    return kvm_store_id_hex(&a, h);
}

/* The server's settings id (kvm_jobcfg_config_id of its config, no strategy), made once; NULL
 * when it has none to compare (no config). */
static const uint8_t *server_settings(srv *s)
{
    if (s->settings_state == 0) {
        kvm_store_id id;
        s->settings_state = s->cfg && kvm_jobcfg_config_id(s->cfg, NULL, &id, NULL, NULL) == 0 ? 1 : -1;
        if (s->settings_state == 1) memcpy(s->settings_id, id.b, sizeof s->settings_id);
    }
    return s->settings_state == 1 ? s->settings_id : NULL;
}

/* Sends refused worker w the error that stops it (once it got through). Its first credit may come
 * on the data socket before the control socket's connection is up, when the control socket does
 * not know its routing id yet (EHOSTUNREACH): the next ready tries again. */
static void tell_refused(srv *s, int w)
{
    srv_worker *wk = &s->workers[w];
    char gh[65], wh[65], why[1200];
    model_hexes(s, wk, gh, wh);
    if (wk->other_stage[0])
        snprintf(why, sizeof why,
                 "%s is the back end of kvmill serve, which takes decode workers (kvmill-decode) only, and this is a "
                 "%s worker: connect it to a kvmill run's endpoint instead",
                 s->base, wk->other_stage);
    else if (wk->other_settings == 2)
        snprintf(why, sizeof why,
                 "this server's store is %s; this worker's --store (or its config's [store] path) is another store, "
                 "where it would look caches up and store what it computes: start it with the server's store (the "
                 "same folder on this host, or the server's store service)",
                 s->store_path);
    else if (wk->other_settings)
        snprintf(why, sizeof why,
                 "this server's config %s has settings %s, this worker's config has %s (other [model] context, "
                 "[compress] or other settings that change a cache): its answers would differ; start it with the "
                 "server's config",
                 kvm_config_path(s->cfg), settings_hex(s->settings_id, wh), settings_hex(wk->other_settings_id, gh));
    else
        snprintf(why, sizeof why,
                 "this server serves model %s (%s), this worker runs model %s: start it with the server's model "
                 "([model] path of its --config, or --model)",
                 wh, kvm_config_str(s->cfg, "model", "path"), gh);
    wk->told_ms = kvm_stage_send_refusal(s->ctl, wk->id, "serve", why) == 0 ? kvm_now_ms() : 0;
}

/* Marks worker wk refused (other_settings: 1 for its settings, 2 its store, 0 its model): told at the next
 * chance, never idle. One of the server's own workers shares the server's config, so its refusal
 * means a file changed under the server, and every worker it starts would be refused and
 * restarted in a loop: the server stops instead, saying `own_why`. */
static void mark_refused(srv *s, srv_worker *wk, int other_settings, const char *own_why)
{
    wk->refused = 1;
    wk->other_settings = other_settings;
    wk->told_ms = 0;
    wk->idle = 0;
    if (wk->slot < 0) return;
    snprintf(s->fatal_why, sizeof s->fatal_why, "%s", own_why);
    s->fatal = 1;
}

/* Worker w's ready named model `got`, not the server's (PROTOCOL.md §5, revision 10): its
 * requests would fail ("no compressed cache": it looks caches up under its own model id), so
 * it is refused, once: logged, told (it exits), never idle. One of the server's own workers
 * shares its config, so its refusal means the model file changed under the server: every
 * worker it starts would be refused and restarted in a loop, so the server stops instead. */
static void refuse_worker(srv *s, int w, const uint8_t *got, int64_t pid)
{
    srv_worker *wk = &s->workers[w];
    char gh[65], wh[65];
    memcpy(wk->other_model, got, sizeof wk->other_model);
    wk->refused_pid = pid;
    model_hexes(s, wk, gh, wh);
    const char *path = kvm_config_str(s->cfg, "model", "path");
    kvm_log_field f[] = {KVM_LOG_S("worker", wk->id), KVM_LOG_S("worker_model_id", gh), KVM_LOG_S("model_id", wh),
                         KVM_LOG_S("model", path)};
    kvm_log(KVM_LOG_ERROR, "worker_refused", f, 4,
            "decode worker %s runs model %.12s… but this server serves %.12s… (%s): refused, no requests go to it",
            wk->id, gh, wh, path);
    char own[1024];
    snprintf(own, sizeof own,
             "decode worker %s, started by this server, runs model %.12s… but the server serves %.12s… (%s): the "
             "model file changed since the server started? Start kvmill serve again",
             wk->id, gh, wh, path);
    mark_refused(s, wk, 0, own);
}

/* Worker w's ready (r) named the server's model but other settings (PROTOCOL.md §5, revision
 * 11): a decode worker started by hand with another config (another [model] context or
 * [compress] method) would answer from other caches, so two clients asking the same got two
 * answers. Refused as for another model: logged, told, never idle; one of the server's own
 * workers so refused means its config file changed under it: the server stops. */
static void refuse_settings(srv *s, int w, const kvm_proto_ready *r)
{
    srv_worker *wk = &s->workers[w];
    char gh[65], wh[65];
    memcpy(wk->other_model, r->model_id, sizeof wk->other_model);
    memcpy(wk->other_settings_id, r->settings_id, sizeof wk->other_settings_id);
    wk->refused_pid = r->pid;
    settings_hex(r->settings_id, gh);
    settings_hex(s->settings_id, wh);
    const char *path = kvm_config_path(s->cfg);
    kvm_log_field f[] = {KVM_LOG_S("worker", wk->id), KVM_LOG_S("worker_settings_id", gh), KVM_LOG_S("settings_id", wh),
                         KVM_LOG_S("config", path)};
    kvm_log(KVM_LOG_ERROR, "worker_refused", f, 4,
            "decode worker %s runs with settings %.12s… (its --config) but this server's config %s has %.12s… (other "
            "[model] context, [compress] or other settings that change a cache): refused, no requests go to it",
            wk->id, gh, path, wh);
    char own[1024];
    snprintf(own, sizeof own,
             "decode worker %s, started by this server, runs with settings %.12s… but the server's config %s has "
             "%.12s…: the config file changed since the server started? Start kvmill serve again",
             wk->id, gh, path, wh);
    mark_refused(s, wk, 1, own);
}

/* The place of this server's LMDB store (kvm_store_place_id) into *id, made now (a stat: a store
 * swapped in under the path is the one its workers read); NULL for a store service or a store
 * that does not stat (not compared). */
static const uint8_t *server_place(const srv *s, kvm_store_id *id)
{
    if (!strncmp(s->store_path, "tcp://", 6) || !strncmp(s->store_path, "ipc://", 6)) return NULL;
    return kvm_store_place_id(s->store_path, id) == 0 ? id->b : NULL;
}

/* Worker w's ready named another store than the server's (PROTOCOL.md §5, revision 15): it looks
 * caches up there and stores what it computes there, so it answered "no compressed cache" for
 * documents the server's store holds and computed caches the server never finds. Refused:
 * logged, told (it exits), never idle. */
static void refuse_store(srv *s, int w, const kvm_proto_ready *r)
{
    srv_worker *wk = &s->workers[w];
    memcpy(wk->other_model, r->model_id, sizeof wk->other_model);
    wk->refused_pid = r->pid;
    kvm_log_field f[] = {KVM_LOG_S("worker", wk->id), KVM_LOG_S("store", s->store_path)};
    kvm_log(KVM_LOG_ERROR, "worker_refused", f, 2,
            "decode worker %s reads and writes another store than this server's %s (its --store, or its config's "
            "[store] path): refused, no requests go to it",
            wk->id, s->store_path);
    char own[1024];
    snprintf(own, sizeof own,
             "decode worker %s, started by this server, uses another store than the server's %s: was the store "
             "replaced? Start kvmill serve again",
             wk->id, s->store_path);
    mark_refused(s, wk, 2, own);
}

/* Worker w's ready named stage `stage`, not decode: a kvmill-prefill or -compress connected to the
 * back end would take questions only to drop them ("expected a job message"), their clients
 * waiting in vain, so it is refused for good (its process never decodes): logged once, told (it
 * exits 1), never idle. */
static int refuse_stage(srv *s, int w, const kvm_proto_ready *r)
{
    srv_worker *wk = &s->workers[w];
    if (!wk->refused || !wk->other_stage[0]) {
        int n = r->stage.len < sizeof wk->other_stage - 1 ? (int)r->stage.len : (int)sizeof wk->other_stage - 1;
        snprintf(wk->other_stage, sizeof wk->other_stage, "%.*s", n, r->stage.ptr ? r->stage.ptr : "");
        for (char *p = wk->other_stage; *p; p++) /* the log line stays one line */
            if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
        kvm_log_field f[] = {KVM_LOG_S("worker", wk->id), KVM_LOG_S("stage", wk->other_stage)};
        kvm_log(KVM_LOG_ERROR, "worker_refused", f, 2,
                "worker %s is a %s worker, not a decode worker: refused, no requests go to it", wk->id,
                wk->other_stage);
        char own[512];
        snprintf(own, sizeof own, "worker %s, started by this server, is a %s worker, not a decode worker", wk->id,
                 wk->other_stage);
        mark_refused(s, wk, 0, own);
    }
    if (kvm_stage_tell_again(wk->told_ms, kvm_now_ms())) tell_refused(s, w);
    return 1;
}

/* Whether worker w is refused after its ready m (kvm_stage_judge_ready against the server's
 * model): refused now when it names another model, accepted again when it names the server's
 * or is another process naming none; one that does not decode keeps its state. first: m came
 * on the control socket, a process's first message (kvm_stage_judge_first). */
static int refused_after(srv *s, int w, const kvm_msg *m, int first)
{
    srv_worker *wk = &s->workers[w];
    kvm_proto_ready r;
    if (kvm_proto_ready_decode(m, &r)) return wk->refused; /* judged by its next ready */
    if (!kvm_proto_str_eq(r.stage, "decode")) return refuse_stage(s, w, &r);
    if (first) kvm_stage_judge_first(&r, wk->refused, wk->other_model, &wk->refused_pid, &wk->refused_ctl_seen);
    kvm_stage_verdict v = kvm_stage_judge_ready(&r, s->o->model_id, wk->refused, wk->refused_pid);
    const uint8_t *want = server_settings(s);
    if (v != KVM_STAGE_OTHER_MODEL && want && r.has_settings_id && memcmp(r.settings_id, want, sizeof r.settings_id)) {
        if (!wk->refused || !wk->other_settings || r.pid != wk->refused_pid ||
            memcmp(r.settings_id, wk->other_settings_id, sizeof r.settings_id)) {
            refuse_settings(s, w, &r);
            wk->refused_ctl_seen = first;
        }
        if (kvm_stage_tell_again(wk->told_ms, kvm_now_ms())) tell_refused(s, w);
        return 1;
    }
    kvm_store_id here;
    const uint8_t *place = v != KVM_STAGE_OTHER_MODEL && r.has_store_id ? server_place(s, &here) : NULL;
    if (place && memcmp(r.store_id, place, sizeof r.store_id)) {
        if (!wk->refused || wk->other_settings != 2 || r.pid != wk->refused_pid) {
            refuse_store(s, w, &r);
            wk->refused_ctl_seen = first;
        }
        if (kvm_stage_tell_again(wk->told_ms, kvm_now_ms())) tell_refused(s, w);
        return 1;
    }
    if (v == KVM_STAGE_ACCEPT_AGAIN) {
        wk->refused = 0;
        wk->other_settings = 0;
        kvm_log(KVM_LOG_INFO, "worker_accepted", (kvm_log_field[]){KVM_LOG_S("worker", wk->id)}, 1,
                "decode worker %s, refused before, is accepted now (%s)", wk->id,
                r.has_model_id ? "it names this server's model" : "a new process that names no model");
    }
    if (v != KVM_STAGE_OTHER_MODEL) return wk->refused;
    if (!wk->refused || r.pid != wk->refused_pid) {
        refuse_worker(s, w, r.model_id, r.pid);
        wk->refused_ctl_seen = first;
    }
    if (kvm_stage_tell_again(wk->told_ms, kvm_now_ms())) tell_refused(s, w);
    return 1;
}

/* A heartbeat on the data socket, from routing id idf: with `stopping`, that worker stops and asks
 * for the end of its work (PROTOCOL.md §5, revision 13). Its credit is withdrawn, so no request
 * goes to it (one it holds went out before this answer and is still answered,
 * kvm_serve__shutdown_workers relaying it), and it gets the end-of-work ack. A worker serve does
 * not know is answered too, and not added (it would "join" only to stop); nor is a dead one made
 * alive. Asked twice, answered twice: the worker drops the second. */
static void on_stopping(srv *s, const kvm_frame *idf, const kvm_msg *m)
{
    const int w = worker_find(s, idf, 0);
    char id[256];
    snprintf(id, sizeof id, "%.*s", (int)(idf->size < sizeof id - 1 ? idf->size : sizeof id - 1),
             idf->data ? (const char *)idf->data : "");
    kvm_proto_heartbeat c;
    if (kvm_proto_heartbeat_decode(m, &c)) {
        kvm_serve__log("dropped a bad heartbeat from worker %s: %s", id, kvm_errmsg());
        return;
    }
    if (!c.stopping) {
        kvm_serve__log("dropped a heartbeat from worker %s on the data socket that does not say 'stopping'", id);
        return;
    }
    if (w >= 0) {
        srv_worker *wk = &s->workers[w];
        if (wk->idle && !*s->interrupts && !c.probe) /* not while serve stops its own workers: each idle one asks; a
                                                        probe (revision 15) does not stop */
            kvm_serve__log("decode worker %s is stopping: its credit is withdrawn", wk->id);
        wk->idle = 0;
    }
    if (kvm_stage_answer_stopping(s->data, idf->data, idf->size, &c, "serve"))
        kvm_serve__log("could not send the end of its work to stopping worker %s: %s", id, kvm_errmsg());
}

/* A credit (data `ready`) from decode worker w while it holds a request. A stage asks for work
 * only with nothing in hand (kvm_stage.c), once a heartbeat, so credits a liveness period apart
 * say that the request never reached it: lost with a connection that closed (ZeroMQ drops what
 * the closed connection's pipe held). The worker stayed busy for ever, and no request went to it
 * again: with one decode worker every later question timed out. The span is counted from the
 * first credit read since the hand-over (one can be older than the request), as kvmill run does
 * for its jobs (kvm_orch_receive.c); the client still waiting is told to ask again. */
static void lost_request_check(srv *s, int w)
{
    srv_worker *wk = &s->workers[w];
    const double now = kvm_now_ms();
    if (wk->asks_request_id != wk->request_id || wk->asks_since <= 0 || wk->asks_since < wk->t_sent) {
        wk->asks_request_id = wk->request_id, wk->asks_since = now;
        return;
    }
    if (now - wk->asks_since < s->dead_ms) return;
    char why[200];
    snprintf(why, sizeof why,
             "did not get request %llu: it asks for work for %.1f s (the request was lost with a connection that "
             "closed)",
             (unsigned long long)wk->request_id, (now - wk->asks_since) / 1000);
    kvm_serve__log("decode worker %s %s", wk->id, why);
    wk->asks_since = 0;
    drop_request(s, w, why, 0);
}

static void on_worker_data(srv *s, int w, kvm_msg **m)
{
    srv_worker *wk = &s->workers[w];
    kvm_proto_type t;
    if (kvm_proto_peek(*m, &t)) {
        kvm_serve__log("dropped a malformed message from worker %s: %s", wk->id, kvm_errmsg());
        return;
    }
    if (t == KVM_PROTO_READY) {
        if (refused_after(s, w, *m, 0)) return;
        if (wk->busy) lost_request_check(s, w);
        if (!wk->busy) wk->idle = 1;
        return;
    }
    if (t != KVM_PROTO_ANSWER) {
        kvm_serve__log("dropped an unexpected %s from worker %s", kvm_proto_type_name(t), wk->id);
        return;
    }
    kvm_proto_answer a;
    int ok = kvm_proto_answer_decode(*m, &a) == 0;
    if (!wk->busy || (ok && a.request_id != wk->request_id)) {
        kvm_serve__log("dropped an answer from worker %s that no client waits for", wk->id);
        return;
    }
    wk->busy = 0;
    /* an answer without new_cache stored nothing: found in the store, unless it computed */
    srv_doc_end end = ok && a.new_cache                    ? SRV_END_STORED
                      : ok && a.status == 0 && !a.computed ? SRV_END_FOUND
                                                           : SRV_END_UNSTORED;
    kvm_serve__doc_release(s, wk, end,
                           !ok             ? "a malformed answer"
                           : a.status != 0 ? kvm_strerror(a.status)
                                           : "the store write failed");
    kvm_serve__grant_done(s, wk, ok && a.new_cache);
    double ms = kvm_now_ms() - wk->t_sent;
    if (!wk->env) {
        kvm_serve__log("request %llu: answer from %s came after %.0f ms, once [serve] request_timeout_s had "
                       "answered its client with a timeout; dropped",
                       (unsigned long long)wk->request_id, wk->id, ms);
        return;
    }
    if (!ok) {
        char why[600];
        snprintf(why, sizeof why, "decode worker %s sent a malformed answer: %s", wk->id, kvm_errmsg());
        kvm_serve__log("request %llu: %s", (unsigned long long)wk->request_id, why);
        kvm_serve__reply_error(s, &wk->env, wk->request_id, KVM_EPROTO, why);
        return;
    }
    if (a.status == 0)
        s->served++;
    else
        s->failed++;
    kvm_serve__log("request %llu answered by %s: %s, %lld tokens, %.1f ms%s%.*s", (unsigned long long)a.request_id,
                   wk->id, a.status ? kvm_strerror(a.status) : "ok", (long long)a.n_tokens, ms, a.status ? ": " : "",
                   a.status ? (int)a.message.len : 0, a.message.ptr ? a.message.ptr : "");
    kvm_serve__reply(s, &wk->env, m);
}

static void on_worker_ctl(srv *s, int w, kvm_msg *m)
{
    srv_worker *wk = &s->workers[w];
    kvm_proto_type t;
    if (kvm_proto_peek(m, &t)) {
        kvm_serve__log("dropped a malformed control message from %s: %s", wk->id, kvm_errmsg());
        return;
    }
    kvm_proto_ready r; /* heard (revision 15): a worker that gets no welcome is not, and connects again */
    const int ready = t == KVM_PROTO_READY && !kvm_proto_ready_decode(m, &r);
    if (ready) kvm_serve__worker_process(s, w, r.pid, r.instance);
    if (ready && !refused_after(s, w, m, 1) && kvm_stage_welcome(s->ctl, wk->id, strlen(wk->id), &r, "serve"))
        kvm_serve__log("could not welcome decode worker %s: %s", wk->id, kvm_errmsg());
    kvm_proto_heartbeat hb;
    if (t == KVM_PROTO_HEARTBEAT && wk->slot < 0 && !wk->busy && !kvm_proto_heartbeat_decode(m, &hb) && hb.stopping) {
        /* its last word (revision 14): a worker started by hand stops, idle: ended now, not
         * "went silent" a liveness period later; the server's own are its slots' to follow */
        kvm_serve__worker_dead(s, w, "stopped (it said so: a clean stop)");
        return;
    }
    if (t != KVM_PROTO_ERROR) return; /* ready, heartbeat, result: liveness */
    kvm_proto_error e;
    if (kvm_proto_error_decode(m, &e)) {
        kvm_serve__log("dropped a bad error message from %s: %s", wk->id, kvm_errmsg());
        return;
    }
    if (!wk->busy) return;
    wk->busy = 0;
    kvm_serve__doc_release(s, wk, SRV_END_UNSTORED, "the decode worker failed");
    kvm_serve__grant_done(s, wk, 0);
    if (!wk->env) return;
    char why[1024];
    snprintf(why, sizeof why, "decode worker %s failed: %.*s", wk->id, (int)(e.message.len < 900 ? e.message.len : 900),
             e.message.ptr ? e.message.ptr : "");
    kvm_serve__log("request %llu: %s", (unsigned long long)wk->request_id, why);
    kvm_serve__reply_error(s, &wk->env, wk->request_id, e.status < 0 ? e.status : KVM_EIO, why);
}

void kvm_serve__receive_back(srv *s, void *sock, int is_ctl)
{
    for (int k = 0; k < 1000; k++) {
        kvm_msg *m = NULL, *env = NULL;
        if (kvm_msg_recv(sock, &m, ZMQ_DONTWAIT)) return;
        if (kvm_msg_nframes(m) >= 2 && kvm_msg_split(m, 1, &env) == 0) {
            if (kvm_serve_answer_misdirected(sock, &env, m, s->base, is_ctl, "kvmill serve", s->front_ep)) {
                kvm_serve__log("answered an ask sent to the back end's %s socket (a client given the wrong endpoint)",
                               is_ctl ? "ctl" : "data");
                kvm_msg_free(&m);
                continue;
            }
            kvm_frame idf = kvm_msg_frame(env, 0);
            kvm_proto_type t;
            if (!is_ctl && !kvm_proto_peek(m, &t) && t == KVM_PROTO_HEARTBEAT) { /* a stopping worker */
                on_stopping(s, &idf, m);
                kvm_msg_free(&env);
                kvm_msg_free(&m);
                continue;
            }
            kvm_proto_heartbeat hb; /* a last word from a worker not known here: not "joined", to stop */
            const int last_word = is_ctl && !kvm_proto_peek(m, &t) && t == KVM_PROTO_HEARTBEAT &&
                                  !kvm_proto_heartbeat_decode(m, &hb) && hb.stopping;
            int w = worker_find(s, &idf, !last_word);
            if (w >= 0) {
                srv_worker *wk = &s->workers[w];
                wk->last_seen = kvm_now_ms();
                wk->alive = 1;
                if (is_ctl)
                    on_worker_ctl(s, w, m);
                else
                    on_worker_data(s, w, &m);
            }
        }
        kvm_msg_free(&env);
        kvm_msg_free(&m);
    }
}

/* The oldest queued request that does not wait for its document, or -1. Waiting ones are
 * skipped, not blocking: requests for other documents go on. Each is logged (info) the first
 * time it is found held, naming its document key and the request that computes it. */
static int64_t next_request(srv *s)
{
    for (int64_t i = 0; i < s->n_queue; i++) {
        srv_request *r = &s->queue[i];
        int w = kvm_serve__doc_holder(s, r);
        if (w < 0) return i;
        if (r->held_logged) continue;
        r->held_logged = 1;
        char name[80];
        kvm_serve__doc_name(&r->doc, name);
        kvm_log_field f[] = {KVM_LOG_S("doc", name), KVM_LOG_I("request_id", r->request_id),
                             KVM_LOG_I("computing_request_id", s->workers[w].request_id)};
        kvm_log(KVM_LOG_INFO, "request_held", f, 3, "request %llu held: document %s is being computed by request %llu",
                (unsigned long long)r->request_id, name, (unsigned long long)s->workers[w].request_id);
    }
    return -1;
}

/* Puts request *r back at position i of the queue, where kvm_serve__queue_remove took it from
 * (so the queue has room), before the requests that came after it. */
static void put_back(srv *s, int64_t i, srv_request *r)
{
    memmove(&s->queue[i + 1], &s->queue[i], (size_t)(s->n_queue - i) * sizeof *s->queue);
    s->queue[i] = *r;
    s->n_queue++;
}

void kvm_serve__dispatch(srv *s)
{
    for (;;) {
        int w = -1; /* an idle worker first: with every worker busy the queue is not scanned */
        for (int k = 0; k < s->n_workers && w < 0; k++)
            if (s->workers[k].alive && s->workers[k].idle && !s->workers[k].busy) w = k;
        int64_t i = w < 0 ? -1 : next_request(s);
        if (i < 0) return;
        srv_worker *wk = &s->workers[w];
        srv_request r = s->queue[i];
        kvm_serve__queue_remove(s, i);
        int client = -1, grant = 0, rc = 0;
        if ((rc = kvm_serve__with_grant(s, &r, &grant, &client))) {
            if (grant) kvm_serve__grant_release_unused(s, client);
            kvm_serve__reply_error(s, &r.env, r.request_id, rc, kvm_errmsg());
            kvm_msg_free(&r.msg);
            continue;
        }
        /* The worker's routing id goes out first, alone: with ZMQ_ROUTER_MANDATORY a worker
         * whose connection is gone fails this frame (EHOSTUNREACH) and nothing was sent, so the
         * request is still whole (kvm_msg_send would have taken it). An older worker (revision
         * 12) stopped while idle says nothing, and its credit stayed here: the request went to
         * it and failed "could not be reached" while another worker was free. */
        const int sent = zmq_send(s->data, wk->id, strlen(wk->id), ZMQ_SNDMORE | ZMQ_DONTWAIT);
        const int send_errno = sent < 0 ? errno : 0;
        if (sent < 0 && send_errno != EHOSTUNREACH) {
            /* its pipe full (EAGAIN), a signal: the worker is not gone (it sends a credit again
             * each heartbeat while idle); the request waits, nobody is killed */
            if (grant) kvm_serve__grant_release_unused(s, client);
            wk->idle = 0; /* its next credit makes it idle again */
            put_back(s, i, &r);
            continue;
        }
        if (sent < 0) { /* EHOSTUNREACH: nothing was sent, the request is still whole */
            char why[200];
            snprintf(why, sizeof why,
                     "could not be reached (%s): its credit is dropped; request %llu waits for "
                     "another worker",
                     zmq_strerror(send_errno), (unsigned long long)r.request_id);
            if (grant) kvm_serve__grant_release_unused(s, client); /* taken again at the next hand-over */
            kvm_serve__worker_dead(s, w, why);                     /* no longer alive: not picked again */
            put_back(s, i, &r); /* no attempt counted: it waits, within its timeout, for the next */
            continue;
        }
        rc = kvm_msg_send(s->data, &r.msg, ZMQ_DONTWAIT); /* the rest of the multipart message */
        kvm_msg_free(&r.msg);
        wk->idle = 0;
        wk->grant = grant;
        wk->grant_client = client;
        wk->doc = r.doc;
        wk->request_id = r.request_id;
        if (rc) {
            /* the routing frame went out: end the message (an empty last frame), or the next
             * request's frames would become parts of this one */
            zmq_send(s->data, "", 0, ZMQ_DONTWAIT);
            kvm_serve__worker_dead(s, w, "could not be reached");
            kvm_serve__reply_error(s, &r.env, r.request_id, KVM_EIO,
                                   "the decode worker could not be reached; try again");
            continue;
        }
        wk->busy = 1;
        wk->env = r.env;
        wk->request_id = r.request_id;
        wk->t_sent = kvm_now_ms();
        wk->t_recv = r.t_recv;
        /* when a request left the queue, and for whom (a drain's or a timeout's story): one line
         * per request, as "answered by" is (the log has no level filter) */
        kvm_log_field f[] = {KVM_LOG_I("request_id", r.request_id), KVM_LOG_S("worker", wk->id),
                             KVM_LOG_F("queued_ms", wk->t_sent - r.t_recv)};
        kvm_log(KVM_LOG_INFO, "request_dispatched", f, 3, "request %llu handed to decode worker %s (%.1f ms queued)",
                (unsigned long long)r.request_id, wk->id, wk->t_sent - r.t_recv);
    }
}
