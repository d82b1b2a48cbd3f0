/* kvm_stage.c: the stage process runtime: sockets, credits, heartbeats, a worker thread per
 * job, SIGTERM with a grace period. */
#include "pipeline/kvm_stage.h"
#include "common/kvm_signal.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_slurm.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "kernels/kvm_kernels.h"
#include "model/kvm_utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

double kvm_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

int kvm_stage_endpoints(const char *base, char *ctl, char *data, size_t size)
{
    if (!strncmp(base, "ipc://", 6)) {
        snprintf(ctl, size, "%s/ctl", base);
        snprintf(data, size, "%s/data", base);
        return 0;
    }
    if (!strncmp(base, "tcp://", 6)) {
        const char *colon = strrchr(base, ':');
        char *end;
        long port = colon ? strtol(colon + 1, &end, 10) : 0;
        if (!colon || colon < base + 6 || *end || colon[1] == '\0')
            return kvm_err(KVM_EINVAL, "endpoint %s: expected tcp://HOST:PORT with PORT in [1, 65534]", base);
        if (port < 1 || port > 65534) /* said why: the range alone read as an arbitrary limit */
            return kvm_err(KVM_EINVAL, "endpoint %s: PORT %ld is not in [1, 65534]: %s", base, port,
                           port == 0  ? "the workers must be told the port to connect to, so it cannot be 0 (any free "
                                        "port, chosen at bind)"
                           : port < 1 ? "a port is a positive number"
                                      : "the data socket binds PORT+1, which must be a port too");
        snprintf(ctl, size, "%.*s:%ld", (int)(colon - base), base, port);
        snprintf(data, size, "%.*s:%ld", (int)(colon - base), base, port + 1);
        return 0;
    }
    return kvm_err(KVM_EINVAL, "endpoint %s: expected ipc://DIR or tcp://HOST:PORT", base);
}

kvm_stage_verdict kvm_stage_judge_ready(const kvm_proto_ready *r, const uint8_t *want, int refused, int64_t refused_pid)
{
    if (want && r->has_model_id && memcmp(r->model_id, want, KVM_PROTO_ID_BYTES)) return KVM_STAGE_OTHER_MODEL;
    if (!refused) return KVM_STAGE_ACCEPT;
    /* the model named, or another process naming none (one whose model follows its jobs, a
     * revision-9 stage): accepted; the refused process naming none stays refused */
    return r->has_model_id || r->pid != refused_pid ? KVM_STAGE_ACCEPT_AGAIN : KVM_STAGE_REFUSED;
}

void kvm_stage_judge_first(const kvm_proto_ready *r, int refused, const uint8_t *other_model, int64_t *refused_pid,
                           int *ctl_seen)
{
    const int names_other = r->has_model_id && !memcmp(r->model_id, other_model, KVM_PROTO_ID_BYTES);
    if (refused && r->pid == *refused_pid && (*ctl_seen || !names_other)) *refused_pid = -1;
    *ctl_seen = 1;
}

int kvm_stage_tell_again(double told_ms, double now) { return told_ms <= 0 || now - told_ms >= KVM_STAGE_RETELL_MS; }

int kvm_stage_send_refusal(void *router, const char *worker_id, const char *from, const char *why)
{
    char text[2048];
    kvm_proto_error e = {
        .status = KVM_EMISMATCH, .stage = kvm_proto_str_c(from), .message = kvm_proto_str_utf8(why, text, sizeof text)};
    kvm_msg *m = NULL, *env = NULL;
    int rc = kvm_proto_error_encode(&e, &m);
    if (!rc) rc = kvm_msg_new(&env);
    if (!rc) rc = kvm_msg_add_copy(env, worker_id, strlen(worker_id));
    if (!rc) rc = kvm_msg_join(env, &m);
    if (!rc) rc = kvm_msg_send(router, &env, ZMQ_DONTWAIT);
    kvm_msg_free(&env);
    kvm_msg_free(&m);
    return rc;
}

/* An ack (job_id 0) to the worker behind routing id routing_id on router, naming this process's
 * protocol revision: with stopping, the end of its work; without, on the control socket, the
 * welcome (revision 15). */
static int send_ack(void *router, const void *routing_id, size_t id_len, kvm_proto_str worker_id, const char *from,
                    bool stopping)
{
    kvm_proto_ack a = {.worker_id = worker_id,
                       .stage = kvm_proto_str_c(from),
                       .pid = getpid(),
                       .stopping = stopping,
                       .revision = KVM_PROTO_REVISION};
    kvm_msg *m = NULL, *env = NULL;
    int rc = kvm_proto_ack_encode(&a, &m);
    if (!rc) rc = kvm_msg_new(&env);
    if (!rc) rc = kvm_msg_add_copy(env, routing_id, id_len);
    if (!rc) rc = kvm_msg_join(env, &m);
    if (!rc) rc = kvm_msg_send(router, &env, ZMQ_DONTWAIT);
    kvm_msg_free(&env);
    kvm_msg_free(&m);
    return rc;
}

int kvm_stage_answer_stopping(void *router, const void *routing_id, size_t id_len, const kvm_proto_heartbeat *c,
                              const char *from)
{
    if (!c->stopping) return kvm_err(KVM_EINVAL, "kvm_stage_answer_stopping: the heartbeat has no 'stopping'");
    return send_ack(router, routing_id, id_len, c->worker_id, from, true);
}

int kvm_stage_welcome(void *router, const void *routing_id, size_t id_len, const kvm_proto_ready *r, const char *from)
{
    return send_ack(router, routing_id, id_len, r->worker_id, from, false);
}

int kvm_stage_new_process(int64_t *last_pid, uint64_t *last_instance, int64_t pid, uint64_t instance, const char *what,
                          char *why, size_t size)
{
    const int64_t was = *last_pid;
    const uint64_t was_instance = *last_instance;
    *last_pid = pid;
    *last_instance = instance;
    if (!was || (was == pid && (!was_instance || !instance || was_instance == instance))) return 0;
    if (was == pid)
        snprintf(why, size, "is a new process (pid %lld again, another instance; %s was the old one's, which is gone)",
                 (long long)pid, what);
    else
        snprintf(why, size, "is a new process (pid %lld; %s was pid %lld's, which is gone)", (long long)pid, what,
                 (long long)was);
    return 1;
}

int kvm_stage_one_job(void *state, kvm_msg *const *in, int n_in)
{
    (void)state;
    kvm_proto_type t;
    int rc = kvm_proto_peek(in[0], &t);
    if (rc) return rc;
    if (t != KVM_PROTO_JOB) return kvm_err(KVM_EPROTO, "expected a job message, got %s", kvm_proto_type_name(t));
    return n_in == 1;
}

uint64_t kvm_stage_job_id(void *state, kvm_msg *const *in, int n_in)
{
    (void)state;
    kvm_proto_job j;
    return n_in > 0 && kvm_proto_job_decode(in[0], &j) == 0 ? j.job_id : 0;
}

static volatile sig_atomic_t stop_requested;
static int wake_pipe[2] = {-1, -1};

static void on_term(int sig)
{
    (void)sig;
    stop_requested = 1;
    if (wake_pipe[1] >= 0) {
        char c = 't';
        ssize_t w = write(wake_pipe[1], &c, 1);
        (void)w;
    }
}

/* The job handed to the worker thread and its outcome. */
typedef struct job_slot {
    const kvm_stage_ops *ops;
    void *state;
    kvm_msg *in[KVM_STAGE_MAX_IN];
    int n_in;
    kvm_stage_out out;
    int rc, retryable;
    char err[1024];
    double t_start, t_recv;
    pthread_t thread;
    int running;       /* a worker thread exists for this job */
    atomic_int done;   /* set by the worker thread when work() returned */
} job_slot;

static void *job_thread(void *arg)
{
    job_slot *j = arg;
    j->retryable = -1; /* work sets it where it knows better than the status */
    j->rc = j->ops->work(j->state, j->in, j->n_in, &j->out, &j->retryable);
    /* unset: by the status. It was 1: a strategy that could not be stored for bad input (an
     * invalid name, say) was built and failed again on every attempt */
    if (j->retryable < 0) j->retryable = kvm_err_retryable(j->rc);
    if (j->rc == KVM_EBUSY) j->retryable = 1; /* a busy store (reader table) frees up, whichever step met it */
    if (j->rc) snprintf(j->err, sizeof j->err, "%s", kvm_errmsg());
    atomic_store(&j->done, 1);
    char c = 'j';
    ssize_t w = write(wake_pipe[1], &c, 1);
    (void)w;
    return NULL;
}

typedef struct stage_rt {
    const kvm_stage_ops *ops;
    void *state;
    kvm_stage_args a;
    char worker_id[256];
    void *zctx, *ctl, *data;
    double last_beat, last_credit;
    job_slot job;
    int refused; /* the orchestrator sent an error on the control socket: stop, exit 1 */
    void *mon[2];     /* PAIR sockets receiving ctl's and data's connection events, or NULL */
    int greeted;      /* an orchestrator's message came and "connected" was said (a ZeroMQ handshake
                         alone does not tell: a store service or serve's front end completes one too) */
    int linked;       /* the ZeroMQ handshake of ctl succeeded and was said, since its last disconnect */
    int heard[2];     /* ctl, data: a message an orchestrator sends came on it since it connected */
    int wrong_peer;   /* an endpoint answered as no orchestrator does: stop, exit 1 */
    char ep[2][1024]; /* ctl's and data's endpoints, for messages */
    double drop_said_ms;  /* when the last "dropped" line was logged (kvm_now_ms) */
    int64_t drops_unsaid; /* messages dropped since then without a line of their own */
    int drops_burst;      /* lines logged in the current burst (drop_warn) */
    int said_waiting; /* "waiting for the orchestrator" said since the last connection */
    int tcp_seen;     /* a connection was accepted (ZMQ_EVENT_CONNECTED): a retry is no longer "nothing there" */
    int n_no_detail;  /* handshakes closed without a reason since the last one that succeeded */
    int link_failed;  /* a handshake failed for good (a rejected key, a wrong --server-key): exit 1 */
    double drain_until; /* after a stop: jobs that reach the data socket before this (kvm_now_ms) are
                           still done, those after it dropped; 0: no stop seen yet */
    int credit_out;     /* a credit (ready on the data socket) went out and no whole job came for it
                           since: the orchestrator may have handed one that is still on its way */
    int data_down;      /* the data socket has no connection: none made yet, or it closed
                           (ZMQ_EVENT_DISCONNECTED), and no handshake succeeded on it since:
                           nothing can reach the worker there (0 without monitors: not known) */
    int awaiting_end;   /* stopping: the stopping heartbeat went out, the orchestrator's end-of-work
                           ack (revision 13) has not come yet */
    int acks_due;       /* stopping heartbeats sent on data (a stop's, a probe's) not answered yet */
    int inputs_cut;     /* the data connection closed while part of a job was here: cut_inputs */
    /* Whether the orchestrator hears this worker (PROTOCOL.md §5, revision 15): ZeroMQ's ROUTER
     * hears only the first connection under a routing id while it lasts, and one that came while
     * another process held this worker's --id stays unheard even after that one is gone. */
    int welcomed;         /* a welcome (or a refusal) came on ctl since its last handshake */
    int old_peer;         /* the orchestrator hears this worker but welcomes none (revision 13, 14) */
    int probing;          /* a probe (a stopping heartbeat with `probe`) is out on data, unanswered */
    int probe_lost;       /* a probe went unanswered with no welcome: the control socket is connected
                             again at each look, with no probe, until a welcome or a message on data */
    int rejoins;          /* connections made again since the last welcome */
    int ctl_handshakes;   /* ctl's handshakes so far: each after the first gets the ready again */
    int ctl_down;         /* ctl's connection closed and no handshake succeeded on it since */
    double gone_since;    /* both connections down since (kvm_now_ms), after a handshake; 0: not */
    int ready_sent;       /* the ready went into ctl's new connection already (rejoin) */
    double hear_due;      /* when an unanswered ready is looked into (kvm_now_ms); 0: not pending */
    double hear_wait;     /* how long after a handshake that is (ms), doubled after each rejoin */
    double probe_until;   /* a probe unanswered by then was not heard */
    int recheck;          /* the probe being unanswered after a welcome, the ready went again */
    double rewelcomed_at; /* ... and was welcomed then (kvm_now_ms; 0: not yet) */
    double connect_at[2]; /* ctl, data: closed by rejoin, to be connected again then (0: not) */
    double last_result;   /* when the last result or error went out on ctl (kvm_now_ms) */
    uint64_t instance;    /* drawn at start: this process, beyond its pid, in each ready (revision 15) */
} stage_rt;

/* How long a stopping worker with a credit out waits for its orchestrator's end-of-work ack (ms).
 * An orchestrator may have handed a job for a credit the worker sent before the stop (kvmill
 * serve drains on SIGTERM waiting for its answer; one never read gave the client "server stopped
 * before answering"), and that job may still sit in the kernel's socket buffer on a loaded host,
 * for any time. So the end of the drain is a marker, not a clock: the worker says it stops (a
 * heartbeat with `stopping` on the data socket), the orchestrator withdraws its credit and answers
 * with an ack with `stopping` on the same socket, which ZeroMQ delivers after every job it sent
 * before (PROTOCOL.md §5, revision 13). This bound is for an orchestrator that never answers: a
 * revision-12 one drops the heartbeat, a gone or stopped one sends nothing. Several heartbeats of
 * a busy orchestrator's delay, and short enough that stopping such a worker by hand does not seem
 * to hang. */
#define STAGE_DRAIN_WAIT_MS 5000.0

/* A log line "[stage id] ..." (text) or a JSON object with the worker id (kvm_log.h). */
static void log_ev(const stage_rt *rt, kvm_log_level lv, const char *event, const kvm_log_field *f, int n,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void log_ev(const stage_rt *rt, kvm_log_level lv, const char *event, const kvm_log_field *f, int n,
                   const char *fmt, ...)
{
    kvm_log_field all[8] = {KVM_LOG_S("worker", rt->worker_id)};
    for (int i = 0; i < n && i < 7; i++) all[1 + i] = f[i];
    va_list ap;
    va_start(ap, fmt);
    kvm_logv(lv, event, all, 1 + (n < 7 ? n : 7), fmt, ap);
    va_end(ap);
}
#define log_line(rt, ...) log_ev((rt), KVM_LOG_INFO, "message", NULL, 0, __VA_ARGS__)
#define log_warn(rt, event, ...) log_ev((rt), KVM_LOG_WARN, (event), NULL, 0, __VA_ARGS__)

/* Lines a burst of dropped messages logs before they are counted instead, and how often a line
 * then says the count. */
#define DROP_BURST 5
#define DROP_EVERY_MS 10000.0

/* Logs a dropped message: the first DROP_BURST lines of a burst, then one line per DROP_EVERY_MS
 * that counts those left unsaid; a new burst starts after DROP_EVERY_MS without a drop. A peer
 * that sends only what a worker drops, once per heartbeat or as fast as it can, would otherwise
 * fill the log. */
static void drop_warn(stage_rt *rt, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void drop_warn(stage_rt *rt, const char *fmt, ...)
{
    const double now = kvm_now_ms();
    if (rt->drops_burst >= DROP_BURST) {
        if (now - rt->drop_said_ms < DROP_EVERY_MS) {
            rt->drops_unsaid++;
            return;
        }
        if (!rt->drops_unsaid) rt->drops_burst = 0; /* quiet since the last line: a new burst */
    }
    char why[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (rt->drops_unsaid)
        log_warn(rt, "dropped", "%s (and %lld more dropped message(s) since the last such line)", why,
                 (long long)rt->drops_unsaid);
    else
        log_warn(rt, "dropped", "%s", why);
    rt->drops_unsaid = 0;
    rt->drops_burst++;
    rt->drop_said_ms = now;
}

/* Whether an orchestrator (kvmill run, calibrate or serve) sends a message of type t to a worker
 * on socket i: on ctl (0) a refusal, an error, or the welcome, an ack (revision 15); on data (1)
 * a job's messages or a decode worker's request. */
static int orchestrator_sends(kvm_proto_type t, int i)
{
    if (i == 0) return t == KVM_PROTO_ERROR || t == KVM_PROTO_ACK;
    switch (t) {
    case KVM_PROTO_JOB:
    case KVM_PROTO_KV:
    case KVM_PROTO_STATS:
    case KVM_PROTO_STRATEGY:
    case KVM_PROTO_CACHE:
    case KVM_PROTO_ASK:
    case KVM_PROTO_GET_CACHE:
    case KVM_PROTO_ACK: /* revision 13: the end of a stopping worker's work */
        return 1;
    default:
        return 0;
    }
}

/* What sends a message of type t, none that an orchestrator sends a worker: a guess for the line
 * that says the endpoint is the wrong kind. */
static const char *sender_guess(kvm_proto_type t)
{
    switch (t) {
    case KVM_PROTO_STORE_REPLY:
        return "a kvmill store service?";
    case KVM_PROTO_ANSWER:
        return "kvmill serve's front end, where kvmill ask connects?";
    default:
        return "not an orchestrator";
    }
}

static void say_connected(stage_rt *rt)
{
    kvm_log_field f[] = {KVM_LOG_S("connect", rt->a.connect), KVM_LOG_S("device", rt->a.device),
                         KVM_LOG_I("threads", rt->a.threads)};
    log_ev(rt, KVM_LOG_INFO, "connected", f, 3, "connected to %s (device %s, %d threads)", rt->a.connect, rt->a.device,
           rt->a.threads);
    rt->greeted = 1;
    rt->said_waiting = 0;
}

/* Judges the peer of socket i by a message of type t that came on it. The ZeroMQ handshake does
 * not tell an orchestrator from any other ROUTER (a store service, serve's front end): a worker
 * said "connected" to those and then answered their replies, and they its answers, forever. A
 * message an orchestrator sends says "connected" (once per connection). Before one came on that
 * socket, a message no orchestrator sends a worker means the endpoint is another kind, which does
 * not fix itself: said, naming it and the type, and the worker stops (exit 1); returns 1, the
 * message is not to be handled. Malformed or unknown types (a later revision's) say nothing here:
 * they are dropped as ever. */
static int wrong_peer(stage_rt *rt, int i, kvm_proto_type t)
{
    if (orchestrator_sends(t, i)) {
        rt->heard[i] = 1;
        if (!rt->greeted) say_connected(rt);
        return 0;
    }
    if (rt->heard[i] || rt->wrong_peer) return rt->wrong_peer;
    /* only a reply that names another kind of endpoint stops the worker: another type this build
     * knows (a later orchestrator's liveness reply on ctl, say, where only refusals come today)
     * is dropped as ever, not taken for a wrong endpoint */
    if (t != KVM_PROTO_STORE_REPLY && t != KVM_PROTO_ANSWER) return 0;
    kvm_log_field f[] = {KVM_LOG_S("connect", rt->a.connect), KVM_LOG_S("endpoint", rt->ep[i]),
                         KVM_LOG_S("type", kvm_proto_type_name(t))};
    log_ev(rt, KVM_LOG_ERROR, "wrong_endpoint", f, 3,
           "%s%s is not a kvmill run or serve endpoint: it answered with a '%s' message (%s): give --connect the "
           "orchestrator's endpoint (kvmill run's [run] bind, kvmill serve's [serve] backend): stopping",
           rt->ep[i], i ? " (the data socket: --connect's port + 1)" : "", kvm_proto_type_name(t), sender_guess(t));
    rt->wrong_peer = 1;
    stop_requested = 1;
    return 1;
}

/* Sends a ready, ack or heartbeat of this worker on sock; returns 0 when ZeroMQ took it (a
 * kvm_status otherwise: no connection yet, a full queue). */
static int send_ctl(stage_rt *rt, void *sock, int type, uint64_t job_id)
{
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c(rt->worker_id),
                       .stage = kvm_proto_str_c(rt->ops->stage),
                       .pid = getpid(),
                       .device = kvm_proto_str_c(rt->a.device),
                       .job_id = job_id,
                       .instance = rt->instance};
    const uint8_t *model = type == KVM_PROTO_READY && rt->ops->model_id ? rt->ops->model_id(rt->state) : NULL;
    if (model) { /* revision 10: a server or run of another model refuses this worker */
        c.has_model_id = true;
        memcpy(c.model_id, model, sizeof c.model_id);
    }
    const uint8_t *settings = type == KVM_PROTO_READY && rt->ops->settings_id ? rt->ops->settings_id(rt->state) : NULL;
    if (settings) { /* revision 11: a server of other settings refuses this worker */
        c.has_settings_id = true;
        memcpy(c.settings_id, settings, sizeof c.settings_id);
    }
    const uint8_t *place = type == KVM_PROTO_READY && rt->ops->store_id ? rt->ops->store_id(rt->state) : NULL;
    if (place) { /* revision 15: a server of another store refuses this worker */
        c.has_store_id = true;
        memcpy(c.store_id, place, sizeof c.store_id);
    }
    kvm_msg *m = NULL;
    int rc = type == KVM_PROTO_READY ? kvm_proto_ready_encode(&c, &m)
             : type == KVM_PROTO_ACK ? kvm_proto_ack_encode(&c, &m)
                                     : kvm_proto_heartbeat_encode(&c, &m);
    if (!rc) rc = kvm_msg_send(sock, &m, ZMQ_DONTWAIT);
    kvm_msg_free(&m);
    return rc;
}

/* A heartbeat; while a job runs it names the job and its progress (PROTOCOL.md). */
static void send_heartbeat(stage_rt *rt)
{
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c(rt->worker_id), .stage = kvm_proto_str_c(rt->ops->stage),
                       .pid = getpid()};
    if (rt->job.running && !atomic_load(&rt->job.done)) {
        c.job_id = rt->ops->job_id(rt->state, rt->job.in, rt->job.n_in);
        int64_t total = atomic_load(&rt->job.out.progress.total), done = atomic_load(&rt->job.out.progress.done);
        c.progress_total = total > 0 ? (uint64_t)total : 0;
        c.progress_done = done > 0 ? (uint64_t)done : 0;
    }
    kvm_msg *m = NULL;
    if (!kvm_proto_heartbeat_encode(&c, &m)) kvm_msg_send(rt->ctl, &m, ZMQ_DONTWAIT);
    kvm_msg_free(&m);
}

/* A heartbeat with `stopping` on sock, without waiting. On the data socket (revision 13) it asks
 * the orchestrator to withdraw this worker's credit and answer with the end-of-work ack after
 * whatever it already sent; on the control socket (revision 14) it is the stage's last word, so
 * that its orchestrator ends it at once as stopped, where it said "went silent" a liveness period
 * later of a worker stopped cleanly (SIGTERM) while busy: a job it still runs was handed back at
 * the grace's end (the orchestrator holds none for it then) or is the orchestrator's to time out,
 * and it ends a worker only with no job out; the socket's linger delivers it at close, if a peer
 * is there. Returns 0 when ZeroMQ took it. */
static int send_stopping(stage_rt *rt, void *sock)
{
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c(rt->worker_id),
                       .stage = kvm_proto_str_c(rt->ops->stage),
                       .pid = getpid(),
                       .stopping = true,
                       .probe = rt->probing && sock == rt->data && !stop_requested};
    kvm_msg *m = NULL;
    int rc = kvm_proto_heartbeat_encode(&c, &m);
    if (!rc) rc = kvm_msg_send(sock, &m, ZMQ_DONTWAIT);
    kvm_msg_free(&m);
    if (!rc && sock == rt->data) rt->acks_due++;
    return rc;
}

/* Whether the orchestrator hears this worker (PROTOCOL.md §5, revision 15). A ZeroMQ ROUTER
 * hears only the first connection under a routing id while it lasts: a worker started with the
 * --id of one still running was never heard, and stayed so after that one was gone (libzmq
 * identifies such a connection again only when it wakes the reader, which its unread ready never
 * does), so the run waited for it for ever. A revision-15 orchestrator answers the control ready
 * with a welcome; the data socket is heard once an orchestrator's message came on it. A worker
 * that is not heard on one of them some time after the handshake asks on the data socket (a
 * probe: a stopping heartbeat, which orchestrators answer since revision 13 after withdrawing its
 * credit). Answered by an older orchestrator, it is heard, and no welcome will ever come;
 * answered by a revision-15 one that sent no welcome, its control socket is connected again.
 * Unanswered, the control socket is connected again when no welcome came (a new connection is
 * identified afresh, heard once no other process holds the id), and the data socket only when a
 * ready sent after the probe is welcomed and the probe still goes unanswered: that orchestrator
 * runs and reads both sockets, so one that does not answer the probe holds no credit of this
 * worker, and no job can be lost with the old connection (a stalled orchestrator, SIGSTOPped or
 * swapping, may hold one until it reads the probe; its welcome may be from before the stall). */

/* The first wait after a handshake: ten heartbeats, at least 5 s, at most STAGE_HEAR_WAIT_MAX_MS;
 * doubled after each control rejoin up to that. A probe is given twice as long. */
#define STAGE_HEAR_WAIT_MAX_MS 30000.0
/* Between closing a connection that is not heard and making it again (ms). */
#define STAGE_REJOIN_GAP_MS 500.0
static double hear_wait_first(const stage_rt *rt)
{
    const double w = 10.0 * rt->a.heartbeat_ms;
    return w < 5000 ? 5000 : w > STAGE_HEAR_WAIT_MAX_MS ? STAGE_HEAR_WAIT_MAX_MS : w;
}

/* Both connections down after a handshake: --leave-after-s counts from the first moment so. */
static void gone_check(stage_rt *rt)
{
    if (rt->ctl_down && rt->data_down && rt->ctl_handshakes > 0 && rt->gone_since <= 0) rt->gone_since = kvm_now_ms();
}

/* Connects socket i (0 ctl, 1 data) again: a new connection is a new pipe at the orchestrator's
 * ROUTER, identified by this worker's id afresh, heard once no other process holds it. ctl gets
 * the ready first, on its new connection. */
static void rejoin(stage_rt *rt, double now, int i, const char *why)
{
    if (++rt->rejoins == 1)
        log_warn(rt, "not_heard",
                 "the orchestrator at %s %s: another process may hold worker id %s there (ZeroMQ hears only the "
                 "first connection under an id while it lasts: give each worker its own --id), or it stopped, or "
                 "it is not a kvmill run or serve: connecting the %s socket again, and again every %.0f s at most "
                 "until it answers",
                 rt->a.connect, why, rt->worker_id, i ? "data" : "control", STAGE_HEAR_WAIT_MAX_MS / 1000);
    if (zmq_disconnect(i ? rt->data : rt->ctl, rt->ep[i]))
        log_warn(rt, "not_heard", "closing the connection to %s: %s", rt->ep[i], zmq_strerror(errno));
    /* connected again a moment later (rejoin_connect): the orchestrator's ROUTER lets the old
     * connection go first, else it may still hold this worker's id when the new one comes, which
     * would be as unheard as the last */
    rt->connect_at[i] = now + STAGE_REJOIN_GAP_MS;
    if (i == 0) rt->welcomed = 0; /* a new control connection is not welcomed yet */
    if (i == 1) rt->data_down = 1;
    /* zmq_disconnect raises no DISCONNECTED event: ctl stayed "up", and a worker whose orchestrator
     * went before the connection was made again never left (--leave-after-s) */
    if (i == 0) rt->ctl_down = 1;
    gone_check(rt);
    if (i == 0) rt->hear_wait = 2 * rt->hear_wait < STAGE_HEAR_WAIT_MAX_MS ? 2 * rt->hear_wait : STAGE_HEAR_WAIT_MAX_MS;
    rt->hear_due = now + STAGE_REJOIN_GAP_MS + rt->hear_wait; /* from the handshake, when one comes */
    rt->last_credit = 0;
}

/* Makes the connections rejoin closed, when due; ctl's gets the ready first. */
static void rejoin_connect(stage_rt *rt, double now)
{
    for (int i = 0; i < 2; i++) {
        if (rt->connect_at[i] <= 0 || now < rt->connect_at[i]) continue;
        rt->connect_at[i] = 0;
        if (zmq_connect(i ? rt->data : rt->ctl, rt->ep[i]))
            log_warn(rt, "not_heard", "connecting %s again: %s", rt->ep[i], zmq_strerror(errno));
        if (i == 0) rt->ready_sent = send_ctl(rt, rt->ctl, KVM_PROTO_READY, 0) == 0;
    }
}

/* The probe's answer (the orchestrator withdrew this worker's credit: it asks again at once). */
static void probe_answered(stage_rt *rt, const kvm_proto_ack *a)
{
    rt->probing = 0;
    rt->last_credit = 0;
    if (rt->welcomed || stop_requested) return;
    if (a->revision >= 15) {
        rejoin(rt, kvm_now_ms(), 0, "answered a probe on the data socket but sent no welcome on the control socket");
        return;
    }
    rt->old_peer = 1;
    log_line(rt,
             "the orchestrator at %s hears this worker but sends no welcome: it runs an older kvmill (protocol "
             "revision 13 or 14)",
             rt->a.connect);
}

/* Looks into a socket not heard yet when that is due (idle, the data socket connected); called in
 * the loop while no stop is asked. */
static void hear_check(stage_rt *rt, double now)
{
    const int busy = rt->job.running || rt->job.n_in || now - rt->last_result < 2.0 * rt->a.heartbeat_ms + 1000;
    if (rt->probing) {
        /* welcomed again since the probe was due and still no answer: a running orchestrator
         * that reads its data socket does not hear this one, and holds no credit of it */
        const int live = rt->rewelcomed_at > 0 && now - rt->rewelcomed_at >= rt->a.heartbeat_ms + 1000.0;
        if ((now < rt->probe_until && !live) || busy) return; /* a result on its way over ctl: not dropped */
        if (rt->welcomed && !live && !rt->recheck) {          /* the welcome may be from before a stall: ask again */
            rt->recheck = send_ctl(rt, rt->ctl, KVM_PROTO_READY, 0) == 0;
            rt->probe_until = now + 2 * rt->hear_wait;
            if (rt->recheck) return;
        }
        rt->probing = 0; /* its ack, should one still come, is dropped without a word (acks_due) */
        rt->probe_lost = !rt->welcomed && !rt->heard[1];
        if (live)
            rejoin(rt, now, 1, "welcomed this worker but did not answer a probe on the data socket");
        else if (!rt->welcomed)
            rejoin(rt, now, 0, "answered neither this worker's ready nor a probe on the data socket");
        else
            rt->hear_due = now + rt->hear_wait; /* no welcome again: stalled or gone; looked into later */
        return;
    }
    if (rt->welcomed || rt->heard[1]) rt->probe_lost = 0;
    if (rt->welcomed && rt->heard[1] && rt->rejoins) { /* both heard: the streak is over (said once) */
        log_line(rt, "the orchestrator at %s hears this worker now (after %d connection(s) made again)", rt->a.connect,
                 rt->rejoins);
        rt->rejoins = 0;
    }
    if ((rt->welcomed && rt->heard[1]) || rt->old_peer || rt->hear_due <= 0 || now < rt->hear_due) return;
    rt->hear_due = now + rt->hear_wait;
    if (busy) return;     /* heard there (a job came), or a result on its way: looked into later */
    if (rt->probe_lost) { /* nothing answered on either socket: the control socket again, no probe */
        rejoin(rt, now, 0, "");
        return;
    }
    if (rt->data_down) return;
    rt->probing = 1;
    rt->recheck = 0;
    rt->rewelcomed_at = 0;
    if (send_stopping(rt, rt->data)) {
        rt->probing = 0;
        return;
    }
    rt->probe_until = now + 2 * rt->hear_wait;
}

static void send_result(stage_rt *rt, uint64_t job_id, int status, const char *msg, int retryable, double compute_ms,
                        double total_ms, const kvm_stage_out *out)
{
    char text[2048];
    kvm_proto_result r = {.job_id = job_id,
                          .status = status,
                          .stage = kvm_proto_str_c(rt->ops->stage),
                          .worker_id = kvm_proto_str_c(rt->worker_id),
                          .compute_ms = compute_ms,
                          .total_ms = total_ms,
                          .message = kvm_proto_str_utf8(msg, text, sizeof text),
                          .retryable = retryable != 0};
    if (out && status == 0) {
        /* a KL outside the wire's [0, 1e6] (NaN, inf: logits that are not finite) is no evaluation:
         * sent as 0 and counted, it read as a perfect cache in the run's mean */
        const int in_range = out->kl_mean >= 0 && out->kl_mean <= 1e6;
        if (out->evaluated && !in_range)
            kvm_log(KVM_LOG_WARN, "eval_failed", NULL, 0, "the evaluation's KL is %g: not counted", out->kl_mean);
        r.evaluated = out->evaluated && in_range;
        r.kl_mean = r.evaluated ? out->kl_mean : 0;
        r.transport_ms = out->transport_ms;
        r.store_ms = out->store_ms;
    }
    kvm_msg *m = NULL;
    int rc = status == 0 ? kvm_proto_result_encode(&r, &m) : kvm_proto_error_encode(&r, &m);
    if (!rc) kvm_msg_send(rt->ctl, &m, 0);
    rt->last_result = kvm_now_ms(); /* no rejoin of ctl while it may still be on its way */
    kvm_msg_free(&m);
}

static void drop_inputs(job_slot *j)
{
    for (int i = 0; i < j->n_in; i++) kvm_msg_free(&j->in[i]);
    j->n_in = 0;
}

/* Stops the stage as refused (exit 1): by `by` (the orchestrator: its ready named another model
 * or, to kvmill serve, other settings; or its own job: the model file here is not the run's),
 * saying why. Whoever started the worker by hand sees why at once, and no later job is taken
 * only to fail alike. */
static void stop_refused(stage_rt *rt, int status, kvm_proto_str by, kvm_proto_str why)
{
    kvm_log_field f[] = {KVM_LOG_I("status", status)};
    /* the reason alone: the status is KVM_EMISMATCH for every refusal (PROTOCOL.md revision 10),
     * whose words ("mismatched model ...") misnamed a refusal for caches that miss the store */
    log_ev(rt, KVM_LOG_ERROR, "stopping_refused", f, 1, "refused by %.*s: %.*s: stopping", (int)by.len,
           by.ptr ? by.ptr : "", (int)why.len, why.ptr ? why.ptr : "");
    rt->refused = 1;
    stop_requested = 1; /* a job it may hold finishes or is handed back, as at SIGTERM */
}

/* The document of the job in in[0] for its log line (its name, else its id; "-" for a message
 * that is not a job), control characters as '?' so that the line stays one line. */
static void job_document(const kvm_msg *const *in, int n_in, char *out, size_t size)
{
    kvm_proto_type t;
    kvm_proto_job j;
    snprintf(out, size, "-");
    if (n_in < 1 || kvm_proto_peek(in[0], &t) || t != KVM_PROTO_JOB || kvm_proto_job_decode(in[0], &j)) return;
    kvm_proto_str name = j.doc_name.len ? j.doc_name : j.doc_id;
    if (!name.len || !name.ptr) return;
    snprintf(out, size, "%.*s", (int)(name.len < size - 1 ? name.len : size - 1), name.ptr);
    for (char *p = out; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
}

/* The worker finished: send its outputs, the result, and ask for more work. */
static void finish_job(stage_rt *rt)
{
    job_slot *j = &rt->job;
    pthread_join(j->thread, NULL);
    j->running = 0;
    uint64_t id = rt->ops->job_id(rt->state, j->in, j->n_in);
    double now = kvm_now_ms(), compute = now - j->t_start;
    size_t bytes = j->out.stored_bytes > 0 ? (size_t)j->out.stored_bytes : 0;
    char doc[256];
    job_document((const kvm_msg *const *)j->in, j->n_in, doc, sizeof doc);
    double t_send = kvm_now_ms();
    for (int i = 0; i < j->out.n_data; i++) {
        for (size_t f = 0; f < kvm_msg_nframes(j->out.data[i]); f++) bytes += kvm_msg_frame(j->out.data[i], f).size;
        if (!j->rc) kvm_msg_send(rt->data, &j->out.data[i], 0);
        kvm_msg_free(&j->out.data[i]);
    }
    j->out.transport_ms += kvm_now_ms() - t_send;
    for (int i = 0; i < j->out.n_ctl; i++) {
        if (!j->rc) kvm_msg_send(rt->ctl, &j->out.ctl[i], 0);
        kvm_msg_free(&j->out.ctl[i]);
    }
    j->out.n_data = j->out.n_ctl = 0;
    /* the job's line before its result: the orchestrator acts on the result at once (another
     * document to prefill, whose line would then come first), and logs read as the run's order */
    if (j->rc) {
        kvm_log_field f[] = {KVM_LOG_I("job_id", id), KVM_LOG_I("retryable", j->retryable), KVM_LOG_S("error", j->err)};
        log_ev(rt, KVM_LOG_ERROR, "job_failed", f, 3, "job %llu failed (%s): %s", (unsigned long long)id,
               j->retryable ? "retryable" : "final", j->err);
    } else {
        kvm_log_field f[] = {KVM_LOG_I("job_id", id), KVM_LOG_S("document", doc), KVM_LOG_F("compute_ms", compute),
                             KVM_LOG_I("bytes_out", bytes)};
        log_ev(rt, KVM_LOG_INFO, "job_done", f, 4, "job %llu document %s stage %s %.1f ms %zu bytes",
               (unsigned long long)id, doc, rt->ops->stage, compute, bytes);
    }
    send_result(rt, id, j->rc, j->rc ? j->err : "", j->retryable, compute, now - j->t_recv, &j->out);
    const int other_model = j->rc && j->out.other_model;
    j->out = (kvm_stage_out){0};
    if (other_model) { /* the run's every job would fail here alike: the run's other workers do them */
        char by[64];
        snprintf(by, sizeof by, "the run of job %llu", (unsigned long long)id);
        stop_refused(rt, j->rc, kvm_proto_str_c(by), kvm_proto_str_c(j->err));
    }
    drop_inputs(j);
    rt->last_credit = 0; /* ask for work now */
}

/* An ack on the data socket (PROTOCOL.md §5, revision 13): with `stopping`, the orchestrator's end of
 * this stopping worker's work. Every job it handed came before it (ZeroMQ keeps a connection's
 * order), so the drain ends here: a job running is finished, nothing later is taken. An ack
 * without `stopping`, or one nobody asked for (a second one, or one after the wait's bound), is
 * dropped with a line. */
static void probe_answered(stage_rt *rt, const kvm_proto_ack *a);

static void on_end_of_work(stage_rt *rt, const kvm_msg *m)
{
    kvm_proto_ack a;
    if (kvm_proto_ack_decode(m, &a)) {
        drop_warn(rt, "dropped a bad ack on the data socket: %s", kvm_errmsg());
        return;
    }
    const int due = a.stopping && rt->acks_due > 0;
    if (due) rt->acks_due--;
    if (a.stopping && rt->probing) probe_answered(rt, &a); /* a stop meanwhile: it ends the drain too */
    if (due && !rt->awaiting_end) return;                  /* a probe's, or a late one's: nothing more to do */
    if (!a.stopping || !rt->awaiting_end) {
        drop_warn(rt, "dropped an ack on the data socket: %s",
                  !a.stopping ? "it is no end of work (no 'stopping')" : "this worker asked for no end of work");
        return;
    }
    rt->awaiting_end = 0;
    rt->drain_until = kvm_now_ms(); /* whatever comes later is dropped */
    log_line(rt, "the orchestrator sent the end of this worker's work%s: stopping",
             rt->job.running ? " (after the job running now)" : "");
}

static void start_drain(stage_rt *rt, double now);
static void on_data(stage_rt *rt);

/* The data connection closed while the first parts of a job (a compress job and some of its KV
 * layers) were here: the orchestrator's ROUTER dropped what it still held for the connection, so
 * the rest will never come, and a worker holding a part asks for no work: it waited for ever
 * (and the run with it, holding the job for it). What the socket already received is read first
 * (it comes before the event's end); then a job still in part is dropped, and the worker asks
 * for work again, by which the orchestrator knows that the job was lost (kvm_orch_receive.c). */
static void cut_inputs(stage_rt *rt)
{
    zmq_pollitem_t it = {rt->data, 0, ZMQ_POLLIN, 0};
    while (!rt->job.running && rt->job.n_in > 0 && zmq_poll(&it, 1, 0) == 1)
        on_data(rt);
    rt->inputs_cut = 0;
    if (rt->job.running || rt->job.n_in == 0) return;
    uint64_t id = rt->ops->job_id(rt->state, rt->job.in, rt->job.n_in);
    log_line(rt,
             "the data connection closed with %d part(s) of job %llu here: the rest was lost with it; dropped "
             "them, asking for work again",
             rt->job.n_in, (unsigned long long)id);
    drop_inputs(&rt->job);
    rt->last_credit = 0;
}

/* One message from the data socket: part of a job, or garbage to drop. */
static void on_data(stage_rt *rt)
{
    kvm_msg *m = NULL;
    int rc = kvm_msg_recv(rt->data, &m, ZMQ_DONTWAIT);
    if (rc) return;
    job_slot *j = &rt->job;
    kvm_proto_type type;
    const int peek_rc = kvm_proto_peek(m, &type);
    if (!peek_rc && type == KVM_PROTO_ACK) { /* before the busy check: it comes after a drained job */
        if (!wrong_peer(rt, 1, type)) on_end_of_work(rt, m);
        kvm_msg_free(&m);
        return;
    }
    /* a stop that came after this round's look at it (a SIGTERM while the poll returned with
     * this job): the drain decides, as it would have a moment earlier; the job was dropped,
     * although it was handed for this worker's credit and the orchestrator waits for it */
    if (stop_requested && rt->drain_until <= 0) start_drain(rt, kvm_now_ms());
    if (j->running || (stop_requested && kvm_now_ms() >= rt->drain_until)) {
        drop_warn(rt, "dropped a message: %s", j->running ? "busy with a job" : "shutting down");
        kvm_msg_free(&m);
        return;
    }
    if (peek_rc) {
        drop_warn(rt, "dropped a malformed message: %s", kvm_errmsg());
        kvm_msg_free(&m);
        return;
    }
    if (wrong_peer(rt, 1, type)) {
        kvm_msg_free(&m);
        return;
    }
    if (j->n_in == KVM_STAGE_MAX_IN) drop_inputs(j);
    if (j->n_in == 0) j->t_recv = kvm_now_ms();
    j->in[j->n_in++] = m;
    int done = rt->ops->complete(rt->state, j->in, j->n_in);
    if (done < 0) {
        char why[1024];
        snprintf(why, sizeof why, "%s", kvm_errmsg()); /* job_id may set another */
        drop_warn(rt, "dropped %d message(s): %s", j->n_in, why);
        uint64_t id = j->n_in ? rt->ops->job_id(rt->state, j->in, j->n_in) : 0;
        if (id) send_result(rt, id, done, why, 0, 0, 0, NULL);
        drop_inputs(j);
        return;
    }
    if (!done) return;
    j->ops = rt->ops;
    j->state = rt->state;
    j->t_start = kvm_now_ms();
    j->running = 1;
    rt->credit_out = 0; /* the orchestrator spent it on this job */
    atomic_store(&j->done, 0);
    if (pthread_create(&j->thread, NULL, job_thread, j) != 0) {
        j->running = 0;
        send_result(rt, rt->ops->job_id(rt->state, j->in, j->n_in), KVM_ENOMEM, "cannot start a thread", 1, 0, 0, NULL);
        drop_inputs(j);
    }
}

/* An ack on the control socket: the orchestrator's welcome, its answer to this worker's ready
 * (revision 15): it hears the worker. Said when it ends a streak of connections made again. */
static void on_welcome(stage_rt *rt, const kvm_msg *m)
{
    kvm_proto_ack a;
    if (kvm_proto_ack_decode(m, &a)) {
        drop_warn(rt, "dropped a bad ack on the control socket: %s", kvm_errmsg());
        return;
    }
    if (a.stopping || a.job_id) {
        drop_warn(rt, "dropped an ack on the control socket that is no welcome (it names a job or says 'stopping')");
        return;
    }
    rt->welcomed = 1;
    if (rt->probing && rt->recheck) { /* the answer to the ready sent again: the probe decides */
        rt->rewelcomed_at = kvm_now_ms();
        return;
    }
    rt->hear_wait = hear_wait_first(rt);
    rt->hear_due = rt->heard[1] ? 0 : kvm_now_ms() + rt->hear_wait; /* the data socket: looked into next */
}

/* The orchestrator's control messages: an `error` refuses this worker (its ready named another
 * model: PROTOCOL.md §5, revision 10), which stops the stage so that whoever started it by hand
 * sees why at once, instead of a worker that waits for work that never comes; anything else is
 * dropped (a malformed one with a line). */
static void on_ctl(stage_rt *rt)
{
    kvm_msg *m = NULL;
    if (kvm_msg_recv(rt->ctl, &m, ZMQ_DONTWAIT) != 0) return;
    kvm_proto_type type;
    kvm_proto_error e;
    if (kvm_proto_peek(m, &type)) {
        drop_warn(rt, "dropped a malformed control message: %s", kvm_errmsg());
        kvm_msg_free(&m);
        return;
    }
    if (wrong_peer(rt, 0, type)) { /* said; stopping */
        kvm_msg_free(&m);
        return;
    }
    if (type == KVM_PROTO_ERROR && kvm_proto_error_decode(m, &e))
        drop_warn(rt, "dropped a bad error message: %s", kvm_errmsg());
    else if (type == KVM_PROTO_ERROR && (e.status != KVM_EMISMATCH || e.job_id != 0))
        /* a refusal is a job-less mismatch: another error (a later revision's) must not stop us */
        drop_warn(rt, "dropped an error on the control socket that is not a refusal: %s: %.*s",
                  kvm_strerror((int)e.status), (int)e.message.len, e.message.ptr ? e.message.ptr : "");
    else if (type == KVM_PROTO_ERROR)
        stop_refused(rt, (int)e.status, e.stage, e.message);
    else if (type == KVM_PROTO_ACK)
        on_welcome(rt, m);
    kvm_msg_free(&m);
}

/* The events connect_sockets watches: zmq_connect only starts connecting, so "connected" is said
 * when the orchestrator completed a handshake, and a failed CurveZMQ handshake, which neither side
 * reported, is said: a refusal of the worker's key stops it, a handshake closed without a reason
 * is warned about (kvmill ask and the store client watch the same). */
#define LINK_EVENTS                                                                                                    \
    (ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |        \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)

/* Handshakes that the endpoint closes without a reason, none succeeding, before the worker says
 * that its keys may not fit (a server that cannot decrypt the client's hello, a wrong
 * --server-key, closes the connection without a word, at every reconnect) and keeps trying. */
#define LINK_MAX_NO_DETAIL 3

static int connect_sockets(stage_rt *rt)
{
    char *ctl_ep = rt->ep[0], *data_ep = rt->ep[1];
    int rc = kvm_stage_endpoints(rt->a.connect, ctl_ep, data_ep, sizeof rt->ep[0]);
    if (rc) return rc;
    rt->zctx = zmq_ctx_new();
    rt->ctl = zmq_socket(rt->zctx, ZMQ_DEALER);
    rt->data = zmq_socket(rt->zctx, ZMQ_DEALER);
    if (!rt->ctl || !rt->data) return kvm_err(KVM_EIO, "zmq_socket: %s", zmq_strerror(errno));
    int linger = 1000;
    void *socks[2] = {rt->ctl, rt->data};
    for (int i = 0; i < 2; i++) {
        zmq_setsockopt(socks[i], ZMQ_ROUTING_ID, rt->worker_id, strlen(rt->worker_id));
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        if ((rc = kvm_curve_client(socks[i], rt->a.server_key, rt->a.client_public, rt->a.client_secret))) return rc;
        char mon_ep[96];
        snprintf(mon_ep, sizeof mon_ep, "inproc://kvmill-stage-monitor-%ld-%d", (long)getpid(), i);
        if (zmq_socket_monitor(socks[i], mon_ep, LINK_EVENTS) == 0) { /* without one: "connecting" only */
            rt->mon[i] = zmq_socket(rt->zctx, ZMQ_PAIR);
            if (rt->mon[i] && zmq_connect(rt->mon[i], mon_ep)) zmq_close(rt->mon[i]), rt->mon[i] = NULL;
        }
    }
    if (!rt->mon[0] || !rt->mon[1]) /* both or none are read (link_event): none, stopped */
        for (int i = 0; i < 2; i++)
            kvm_msg_monitor_stop(socks[i], &rt->mon[i]);
    if (zmq_connect(rt->ctl, ctl_ep) || zmq_connect(rt->data, data_ep))
        return kvm_err(KVM_EIO, "connect %s: %s", rt->a.connect, zmq_strerror(errno));
    /* down until its first handshake: a worker that never reached its orchestrator waited 5 s for
     * an end of work on SIGTERM, saying a job may be on its way, though none could be */
    rt->data_down = rt->mon[0] && rt->mon[1];
    return 0;
}

/* Stops the worker after a handshake that cannot succeed with these keys (exit 1). */
static void link_fail(stage_rt *rt, uint16_t event, uint32_t value, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void link_fail(stage_rt *rt, uint16_t event, uint32_t value, const char *fmt, ...)
{
    char why[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    kvm_log_field f[] = {KVM_LOG_S("connect", rt->a.connect), KVM_LOG_I("zmq_event", event),
                         KVM_LOG_I("zmq_value", value)};
    log_ev(rt, KVM_LOG_ERROR, "handshake_failed", f, 3, "%s: stopping", why);
    rt->link_failed = 1;
    stop_requested = 1;
}

/* One event of the monitor of socket i (0 ctl, 1 data); 0 when none waits. */
static int link_event(stage_rt *rt, int i)
{
    zmq_msg_t ev, ep;
    zmq_msg_init(&ev);
    zmq_msg_init(&ep);
    uint16_t event = 0;
    uint32_t value = 0;
    const int got = zmq_msg_recv(&ev, rt->mon[i], ZMQ_DONTWAIT) >= 0;
    if (got && zmq_msg_size(&ev) >= 6) {
        memcpy(&event, zmq_msg_data(&ev), 2);
        memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
    }
    if (got && zmq_msg_more(&ev)) zmq_msg_recv(&ep, rt->mon[i], 0);
    zmq_msg_close(&ev);
    zmq_msg_close(&ep);
    if (!got || rt->link_failed) return got;
    const char *ep_s = rt->a.connect, *sk = rt->a.server_key;
    const char *cpk = rt->a.client_public ? rt->a.client_public : "(none)";
    switch (event) {
    case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
        rt->n_no_detail = 0;
        rt->gone_since = 0;
        if (i == 0) rt->ctl_down = 0;
        if (i == 1) rt->data_down = 0; /* jobs can come on it again */
        if (!rt->welcomed || !rt->heard[1]) rt->hear_due = kvm_now_ms() + rt->hear_wait;
        /* a new orchestrator there (a run after the last one, a restarted server) never got the
         * first: it welcomes the ready (revision 15) and judges the process by it */
        if (i == 0 && rt->ctl_handshakes++ > 0 && !rt->ready_sent) send_ctl(rt, rt->ctl, KVM_PROTO_READY, 0);
        if (i == 0) rt->ready_sent = 0;
        if (i == 0 && !rt->greeted && !rt->linked) { /* "connected" waits for the orchestrator's first message */
            kvm_log_field f[] = {KVM_LOG_S("connect", ep_s)};
            log_ev(rt, KVM_LOG_INFO, "handshake", f, 1,
                   "%s completed the ZeroMQ handshake%s: waiting for the orchestrator's first message (work, when it "
                   "has some)",
                   ep_s, sk ? " and accepted this worker's CurveZMQ key" : "");
            rt->linked = 1;
            rt->said_waiting = 0;
        }
        break;
    case ZMQ_EVENT_CONNECTED:
        rt->tcp_seen = 1;
        break;
    case ZMQ_EVENT_CONNECT_RETRIED:
        if (!rt->greeted && !rt->said_waiting && !rt->tcp_seen) {
            kvm_log_field f[] = {KVM_LOG_S("connect", ep_s)};
            log_ev(rt, KVM_LOG_INFO, "waiting", f, 1,
                   "nothing accepts a connection at %s yet: waiting for the orchestrator (kvmill run or serve) to "
                   "bind it",
                   ep_s);
            rt->said_waiting = 1;
        }
        break;
    case ZMQ_EVENT_DISCONNECTED:
        rt->heard[i] = 0; /* the next peer there is judged afresh */
        if (i == 0) rt->welcomed = 0, rt->old_peer = 0, rt->hear_due = 0;
        /* nothing answers over a closed connection: a probe sent over it is void, its ack and any
         * other end of work lost with it (a stop's wait ends on data_down) */
        if (i == 1) rt->probing = 0, rt->acks_due = 0;
        if (i == 1) rt->data_down = 1;
        if (i == 1 && !rt->job.running && rt->job.n_in > 0) rt->inputs_cut = 1;
        if (i == 0) rt->ctl_down = 1;
        gone_check(rt);
        if (i == 0) rt->linked = 0;
        if (i == 0 && rt->greeted) {
            kvm_log_field f[] = {KVM_LOG_S("connect", ep_s)};
            log_ev(rt, KVM_LOG_INFO, "disconnected", f, 1,
                   "the orchestrator at %s closed the connection: waiting for it again", ep_s);
            rt->greeted = 0;
            rt->said_waiting = 1; /* said here */
        }
        break;
    case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
        link_fail(rt, event, value,
                  "the orchestrator at %s rejected this worker's CurveZMQ key %s (ZAP status %u): add that .public "
                  "file to the run's [security] authorized_keys on the orchestrator's host, or give "
                  "--client-public/--client-secret a key pair listed there",
                  ep_s, cpk, (unsigned)value);
        break;
    case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if (sk && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
            link_fail(rt, event, value,
                      "the orchestrator at %s has no CurveZMQ keys (a plain socket): start this worker without "
                      "--server-key, --client-public and --client-secret%s",
                      ep_s,
                      rt->a.store && !strncmp(rt->a.store, "tcp://", 6)
                          ? " (they key both connections; a keyed store service's keys come from --config's "
                            "[security] alone, which keys only the store service: a run on a local bind is not "
                            "keyed)"
                          : "");
        else if (sk)
            link_fail(rt, event, value,
                      "the CurveZMQ handshake with %s failed (ZMTP protocol error 0x%x): --server-key %s is not the "
                      "orchestrator's public key (the .public of its [security] server_secret_key)",
                      ep_s, (unsigned)value, sk);
        else
            link_fail(rt, event, value,
                      "the ZeroMQ handshake with %s failed (ZMTP protocol error 0x%x): the orchestrator uses CurveZMQ "
                      "keys (give --server-key, --client-public and --client-secret), or %s is not a kvmill run or "
                      "serve endpoint",
                      ep_s, (unsigned)value, ep_s);
        break;
    case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL: {
        /* said once per streak, not fatal: libzmq reports any connection closed during the
         * handshake so, and a TCP forwarder in front of a stopped orchestrator (docker-proxy,
         * ssh -L, kubectl port-forward) accepts and closes; the worker waits for the next one */
        if (++rt->n_no_detail != LINK_MAX_NO_DETAIL) break;
        kvm_log_field f[] = {KVM_LOG_S("connect", rt->a.connect), KVM_LOG_I("zmq_event", event),
                             KVM_LOG_I("zmq_value", value)};
        if (sk)
            log_ev(rt, KVM_LOG_WARN, "handshake_failed", f, 3,
                   "the endpoint %s closed the CurveZMQ handshake %d times without a reason: --server-key %s may not "
                   "be the orchestrator's public key (the .public of its [security] server_secret_key), or it has no "
                   "CurveZMQ keys (a local bind: start this worker without --server-key, --client-public and "
                   "--client-secret), or a proxy in front of it has no orchestrator to reach; still trying",
                   ep_s, rt->n_no_detail, sk);
        else
            log_ev(rt, KVM_LOG_WARN, "handshake_failed", f, 3,
                   "the endpoint %s closed the ZeroMQ handshake %d times without a reason: the orchestrator may use "
                   "CurveZMQ keys (give --server-key, --client-public and --client-secret), %s may not be a kvmill "
                   "run or serve endpoint, or a proxy in front of it has no orchestrator to reach; still trying",
                   ep_s, rt->n_no_detail, ep_s);
        break;
    }
    default:
        break;
    }
    return 1;
}

/* Stops the monitors (before their sockets close; kvm_msg_monitor_stop says why so). */
static void link_close(stage_rt *rt)
{
    void *socks[2] = {rt->ctl, rt->data};
    for (int i = 0; i < 2; i++)
        if (rt->mon[i]) kvm_msg_monitor_stop(socks[i], &rt->mon[i]);
}

/* The stop is seen: decides how long the worker still takes jobs (rt->drain_until). With a credit
 * out, a job the orchestrator handed for it may be on its way: the worker says it stops and takes
 * what comes until the orchestrator's end of work (on_end_of_work), at most STAGE_DRAIN_WAIT_MS.
 * Without one, or when nothing could answer or a job would fail anyway (refused, a wrong peer, a
 * failed handshake, the orchestrator process gone, the data socket's connection closed and not
 * made again: no job can be on its way over it, and the credit went with it), it stops at once: a
 * job running is finished. */
static void start_drain(stage_rt *rt, double now)
{
    const int parent_gone = rt->a.parent_pid > 0 && getppid() != (pid_t)rt->a.parent_pid;
    for (int i = 0; i < 2 && rt->mon[0] && rt->mon[1]; i++) /* the connection's state as of now, not of the */
        while (link_event(rt, i)) {                         /* last poll: a reconnection may wait unread */
        }
    rt->drain_until = now;
    if (rt->refused || rt->wrong_peer || rt->link_failed || parent_gone || rt->data_down || !rt->credit_out) return;
    if (send_stopping(rt, rt->data)) return; /* not taken: no connection, so no job on its way either */
    rt->awaiting_end = 1;
    rt->drain_until = now + STAGE_DRAIN_WAIT_MS;
    log_line(rt,
             "stopping: a job handed for this worker's credit may be on its way; waiting for the "
             "orchestrator's end of work (at most %.0f s)",
             STAGE_DRAIN_WAIT_MS / 1000);
}

static void serve(stage_rt *rt)
{
    rt->hear_wait = hear_wait_first(rt);
    /* pid 1 of a restarted container is another process: the orchestrator tells them apart by this */
    if (getentropy(&rt->instance, sizeof rt->instance) != 0) rt->instance = (uint64_t)getpid() ^ (uint64_t)time(NULL);
    rt->instance |= 1; /* 0 says "none" */
    send_ctl(rt, rt->ctl, KVM_PROTO_READY, 0);
    double stop_at = -1;
    for (;;) {
        double now = kvm_now_ms();
        if (rt->job.running && atomic_load(&rt->job.done)) finish_job(rt);
        if (rt->a.parent_pid > 0 && getppid() != (pid_t)rt->a.parent_pid && !stop_requested) {
            log_line(rt, "the orchestrator (pid %ld) is gone: stopping", rt->a.parent_pid);
            stop_requested = 1;
        }
        if (rt->a.leave_after_s > 0 && rt->gone_since > 0 && now - rt->gone_since >= 1000.0 * rt->a.leave_after_s &&
            !rt->job.running && !stop_requested) {
            log_line(rt, "the orchestrator at %s has been gone for %d s (--leave-after-s): stopping", rt->a.connect,
                     rt->a.leave_after_s);
            stop_requested = 1; /* both connections are down: the stop ends at once */
        }
        if (now - rt->last_beat >= rt->a.heartbeat_ms) {
            send_heartbeat(rt);
            rt->last_beat = now;
        }
        rejoin_connect(rt, now);
        if (!stop_requested) hear_check(rt, now);
        if (!rt->job.running && rt->job.n_in == 0 && !stop_requested && !rt->probing &&
            now - rt->last_credit >= rt->a.heartbeat_ms) {
            /* a credit on the data socket: "give me one job" */
            if (!send_ctl(rt, rt->data, KVM_PROTO_READY, 0)) rt->credit_out = 1;
            rt->last_credit = now;
        }
        if (stop_requested) {
            if (rt->drain_until <= 0) start_drain(rt, now);
            if (rt->awaiting_end && rt->data_down) { /* the end of work would come over it: none will */
                rt->awaiting_end = 0;
                rt->drain_until = now;
                log_line(rt, "the orchestrator closed the data connection while this worker waited for its end of "
                             "work: stopping");
            }
            if (!rt->job.running && now >= rt->drain_until) {
                if (rt->awaiting_end)
                    log_line(rt,
                             "no end of work from the orchestrator in %.0f s (an older or a stopped one?): stopping",
                             STAGE_DRAIN_WAIT_MS / 1000);
                return;
            }
            if (rt->job.running && stop_at < 0) { /* a drained job's grace counts from its start */
                stop_at = now + 1000.0 * rt->a.grace_s;
                log_line(rt, "%s: finishing the current job (grace %d s)", rt->refused ? "refused" : "SIGTERM",
                         rt->a.grace_s);
            }
            if (rt->job.running && now >= stop_at) {
                uint64_t id = rt->ops->job_id(rt->state, rt->job.in, rt->job.n_in);
                send_result(rt, id, KVM_ESTATE, "worker stopped before finishing; handed back", 1, 0, 0, NULL);
                log_line(rt, "grace period over: handed job %llu back", (unsigned long long)id);
                if (!rt->refused && !rt->wrong_peer) send_stopping(rt, rt->ctl); /* after the hand-back, in order */
                link_close(rt);
                zmq_close(rt->ctl); /* linger: the hand-back still goes out */
                zmq_close(rt->data);
                zmq_ctx_term(rt->zctx);
                _exit(rt->refused || rt->wrong_peer ? 1
                                                    : 0); /* the worker thread still runs: leave without joining it */
            }
        }
        zmq_pollitem_t items[5] = {{rt->ctl, 0, ZMQ_POLLIN, 0},
                                   {rt->data, 0, ZMQ_POLLIN, 0},
                                   {NULL, wake_pipe[0], ZMQ_POLLIN, 0},
                                   {rt->mon[0], 0, ZMQ_POLLIN, 0},
                                   {rt->mon[1], 0, ZMQ_POLLIN, 0}};
        const int n_items = rt->mon[0] && rt->mon[1] ? 5 : 3;
        long wait = rt->a.heartbeat_ms / 4 > 0 ? rt->a.heartbeat_ms / 4 : 1;
        if (stop_requested && !rt->job.running && now < rt->drain_until && rt->drain_until - now < wait)
            wait = (long)(rt->drain_until - now) + 1;
        if (zmq_poll(items, n_items, wait) < 0 && errno != EINTR) return;
        for (int i = 0; i < 2 && n_items == 5; i++)
            if (items[3 + i].revents & ZMQ_POLLIN)
                while (link_event(rt, i)) {
                }
        if (items[2].revents & ZMQ_POLLIN) {
            char buf[64];
            ssize_t r = read(wake_pipe[0], buf, sizeof buf);
            (void)r;
        }
        if (items[0].revents & ZMQ_POLLIN) on_ctl(rt);
        if (items[1].revents & ZMQ_POLLIN) on_data(rt);
        if (rt->inputs_cut) cut_inputs(rt);
    }
}

static void usage(const char *stage)
{
    printf("usage: kvmill-%s --connect ENDPOINT [options]\n"
           "A kvmill pipeline stage: connects to the orchestrator (kvmill run/serve) and processes jobs.\n\n"
           "options:\n"
           "  --connect BASE        orchestrator endpoint base: ipc://RUNDIR or tcp://HOST:PORT\n"
           "  --device DEV          cpu, cuda:N, or slurm: the task's GPU from Slurm's variables (default cpu)\n"
           "  --store PATH          LMDB store folder, or a store service endpoint tcp://HOST:PORT\n"
           "  --model PATH          model file (overrides the path the jobs carry)\n"
           "  --config FILE         configuration (decode workers; compress and strategy workers open the\n"
           "                        store with its [store] settings, else with those of the first job)\n"
           "  --threads N           compute threads (default 1)\n"
           "  --heartbeat-ms N      heartbeat interval (default: --config's [run] heartbeat_ms, else 1000)\n"
           "  --grace-s N           on SIGTERM, finish the current job within N s (default: --config's\n"
           "                        [run] grace_s, else 30)\n"
           "  --id NAME             worker id (default STAGE-HOST-PID); unique among the workers of a run or\n"
           "                        server: ZeroMQ hears the first connection under an id, and a second\n"
           "                        process under it gets no work until the first is gone (it says so)\n"
           "  --parent-pid PID      stop when process PID, the parent (the orchestrator that started us), is gone\n"
           "  --leave-after-s N     stop (exit 0) once the orchestrator this worker connected to has been gone\n"
           "                        N s: both connections closed and none made again (a run that ended; a\n"
           "                        Kubernetes Job or a batch script then completes). Default: wait for the\n"
           "                        next run or server on the endpoint for ever\n"
           "  --server-key FILE     CurveZMQ: the orchestrator's public key (required off-host)\n"
           "  --client-public FILE  CurveZMQ: this worker's public key\n"
           "  --client-secret FILE  CurveZMQ: this worker's secret key\n"
           "  --log-format F        text or json: one JSON object per log line ([run] log_format;\n"
           "                        default: KVMILL_LOG_FORMAT, else text)\n",
           stage);
}

/* 1 when k is one of the options usage() lists (each takes a value). */
static int known_option(const char *k)
{
    static const char *const names[] = {"--connect",       "--device",     "--store",        "--model",
                                        "--config",        "--id",         "--server-key",   "--client-public",
                                        "--client-secret", "--log-format", "--threads",      "--heartbeat-ms",
                                        "--grace-s",       "--parent-pid", "--leave-after-s"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(k, names[i])) return 1;
    return 0;
}

/* 1 when process pid has exited and waits to be reaped (a zombie, state Z or X in
 * /proc/PID/stat), or is gone; 0 when it runs, or when /proc cannot tell (not Linux, or no
 * /proc mounted). */
static int process_exited(long pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT && access("/proc/self/stat", R_OK) == 0; /* no /proc: cannot tell */
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *paren = strrchr(buf, ')'); /* the command name may hold spaces and ')' */
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* 1 when pid is a live process (or another user's); an exited parent counts as gone even
 * before its own parent reaps it. Reparenting happens a moment before the exiting parent shows
 * as a zombie, so with `again` it asks again for up to 500 ms (a usage error waits that long). */
static int process_alive(long pid, int again)
{
    for (int i = 0;; i++) {
        if (kill((pid_t)pid, 0) != 0 && errno != EPERM) return 0; /* EPERM: another user's */
        if (process_exited(pid)) return 0;
        if (!again || i >= 50) return 1;
        usleep(10000);
    }
}

int kvm_stage_parent_check(const char *who, long pid)
{
    const pid_t parent = getppid();
    if (pid == (long)parent) return 0;
    /* A live process that is not the parent: the process stops once it is reparented, so it
     * would stop at once, saying that process is gone. An exited parent stays a zombie, which
     * kill(pid, 0) finds, until its own parent reaps it (CI saw this: the orphan was told its
     * exited parent was "not the process that started this one"). */
    if (process_alive(pid, 1)) { /* asked again: a subreaper (not init) may have adopted an orphan */
        fprintf(stderr,
                "%s: --parent-pid %ld is not the process that started this one (pid %ld): give the parent's pid, or "
                "leave the option out\n",
                who, pid, (long)parent);
        return 2;
    }
    /* No process `pid`. Either it never was the parent (a mistyped pid: it stopped at once,
     * saying the parent is gone, exit 0) or it was, and exited between starting this process
     * and this check. The kernel keeps no record of the parent a process had, so the two cannot
     * be told apart for certain; what can be told is that a process whose parent exited was
     * reparented to init, pid 1 (getppid() == 1), whereas one started by hand from a shell has
     * that shell, alive, as its parent. So parent 1 is taken for the race: the process starts
     * and its loop stops it at once, saying the parent is gone, as it would a moment later.
     * Another parent is alive and is not `pid`: a usage error. A subreaper (systemd --user, a
     * container's init) that adopted the process in the race gets the usage error instead:
     * wrong words, but the process stops either way, and nobody is left waiting for it. */
    if (parent == 1) return 0;
    fprintf(stderr,
            "%s: --parent-pid %ld: no process %ld (this one's parent is pid %ld): give the parent's pid, or leave the "
            "option out\n",
            who, pid, pid, (long)parent);
    return 2;
}

/* An integer option's value in [lo, hi] into *out; else says which option, the value and the
 * range (it said "bad option or value"), and returns -1. */
static int int_option(const char *stage, const char *k, const char *v, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    const long n = strtol(v, &end, 10);
    if (!*v || *end || errno || n < lo || n > hi) {
        fprintf(stderr, "kvmill-%s: %s: '%s' is not an integer in [%ld, %ld]\n", stage, k, v, lo, hi);
        return -1;
    }
    *out = n;
    return 0;
}

/* --heartbeat-ms and --grace-s not given: the --config's [run] heartbeat_ms and grace_s, else
 * 1000 ms and 30 s. A decode worker started by hand with serve's config beat at 1000 ms while
 * serve (heartbeat_ms = 100, liveness = 3) declared it dead after 300 ms, mid-answer. A config
 * that cannot be read leaves the defaults (the stage's setup names it). */
static void config_run_defaults(kvm_stage_args *a)
{
    static const char *const run_only[] = {"run", NULL};
    kvm_config *c = NULL;
    if ((a->heartbeat_ms == 0 || a->grace_s < 0) && a->config &&
        kvm_config_load_sections(a->config, run_only, &c) == 0) {
        if (a->heartbeat_ms == 0) a->heartbeat_ms = (int)kvm_config_int(c, "run", "heartbeat_ms");
        if (a->grace_s < 0) a->grace_s = (int)kvm_config_int(c, "run", "grace_s");
        kvm_config_free(&c);
    }
    if (a->heartbeat_ms == 0) a->heartbeat_ms = 1000;
    if (a->grace_s < 0) a->grace_s = 30;
}

/* Usage errors return 2, as kvmill's own commands do (README: exit 2 for usage). */
static int parse_args(int argc, char **argv, const char *stage, kvm_stage_args *a)
{
    *a = (kvm_stage_args){.device = "cpu", .threads = 1, .heartbeat_ms = 0, .grace_s = -1}; /* 0, -1: not given */
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) return usage(stage), 3;
        if (strncmp(k, "--", 2))
            return fprintf(stderr, "kvmill-%s: unexpected argument '%s' (see kvmill-%s --help)\n", stage, k, stage), 2;
        if (!known_option(k))
            return fprintf(stderr, "kvmill-%s: unknown option '%s' (see kvmill-%s --help)\n", stage, k, stage), 2;
        if (i + 1 >= argc) return fprintf(stderr, "kvmill-%s: option '%s' needs a value\n", stage, k), 2;
        const char *v = argv[++i];
        long n = 0;
        if (!strcmp(k, "--connect")) a->connect = v;
        else if (!strcmp(k, "--device")) a->device = v;
        else if (!strcmp(k, "--store")) a->store = v;
        else if (!strcmp(k, "--model")) a->model = v;
        else if (!strcmp(k, "--config")) a->config = v;
        else if (!strcmp(k, "--id")) a->worker_id = v;
        else if (!strcmp(k, "--server-key")) a->server_key = v;
        else if (!strcmp(k, "--client-public")) a->client_public = v;
        else if (!strcmp(k, "--client-secret")) a->client_secret = v;
        else if (!strcmp(k, "--log-format")) a->log_format = v;
        else if (!strcmp(k, "--threads")) {
            if (int_option(stage, k, v, 1, 256, &n)) return 2;
            a->threads = (int)n;
        } else if (!strcmp(k, "--heartbeat-ms")) {
            if (int_option(stage, k, v, 10, 3600000, &n)) return 2;
            a->heartbeat_ms = (int)n;
        } else if (!strcmp(k, "--grace-s")) {
            if (int_option(stage, k, v, 0, 86400, &n)) return 2;
            a->grace_s = (int)n;
        } else if (!strcmp(k, "--leave-after-s")) {
            if (int_option(stage, k, v, 1, 604800, &n)) return 2;
            a->leave_after_s = (int)n;
        } else if (!strcmp(k, "--parent-pid")) {
            if (int_option(stage, k, v, 1, INT32_MAX, &n)) return 2;
            char who[64];
            snprintf(who, sizeof who, "kvmill-%s", stage);
            if (kvm_stage_parent_check(who, n)) return 2;
            a->parent_pid = n;
        } else
            return fprintf(stderr, "kvmill-%s: unknown option '%s' (see kvmill-%s --help)\n", stage, k, stage), 2;
    }
    if (!a->connect) return fprintf(stderr, "kvmill-%s: --connect is required\n", stage), 2;
    config_run_defaults(a);
    /* the id goes into every ready and heartbeat as UTF-8 (worker_id, PROTOCOL.md): an empty or
     * latin-1 one failed to encode, so the worker said "connected" and then waited for work forever */
    size_t id_len = a->worker_id ? strlen(a->worker_id) : 1;
    if (id_len == 0 || id_len > 255 || (a->worker_id && !kvm_utf8_valid(a->worker_id, id_len)))
        return fprintf(stderr, "kvmill-%s: --id '%s': expected 1 to 255 bytes of UTF-8 text\n", stage, a->worker_id), 2;
    /* stages that do not read the config (prefill, signals) would take a mistyped one silently */
    struct stat cst;
    if (a->config && (stat(a->config, &cst) != 0 || access(a->config, R_OK) != 0))
        return fprintf(stderr, "kvmill-%s: --config %s: %s\n", stage, a->config, strerror(errno)), 2;
    if (a->config && !S_ISREG(cst.st_mode))
        return fprintf(stderr, "kvmill-%s: --config %s: not a regular file\n", stage, a->config), 2;
    /* --model /dev/zero was hashed for its model id forever, at 100% CPU, deaf to SIGTERM */
    struct stat mst;
    if (a->model && stat(a->model, &mst) != 0)
        return fprintf(stderr, "kvmill-%s: --model %s: %s\n", stage, a->model, strerror(errno)), 2;
    if (a->model && !S_ISREG(mst.st_mode) && !S_ISDIR(mst.st_mode))
        return fprintf(stderr,
                       "kvmill-%s: --model %s: not a regular file (a device, FIFO or socket): a model is a "
                       "checkpoint file or a Hugging Face folder\n",
                       stage, a->model),
               2;
    if (a->device && !strcmp(a->device, "slurm")) { /* deploy/slurm: one GPU per task */
        static char dev[32];
        if (kvm_slurm_device(NULL, dev, sizeof dev))
            return fprintf(stderr, "kvmill-%s: --device slurm: %s\n", stage, kvm_errmsg()), 2;
        a->device = dev;
    }
    return 0;
}

int kvm_stage_parse_devices(const char *key, const char *devs)
{
    if (!*devs) return kvm_err(KVM_EINVAL, "%s is empty: name at least one device (cpu, cuda:N)", key);
    int item = 1;
    for (const char *p = devs;; item++) {
        size_t len = strcspn(p, ",");
        /* a trailing comma passed the loop below, and the worker the cycle gave that empty item
         * exited 2 at every restart until the run gave it up */
        if (len == 0)
            return kvm_err(KVM_EINVAL, "%s = %s: item %d is empty (a leading, trailing or doubled comma)", key, devs,
                           item);
        char dev[64];
        snprintf(dev, sizeof dev, "%.*s", (int)len, p);
        int cuda;
        if (kvm_device_parse(dev, &cuda)) {
            char why[512];
            snprintf(why, sizeof why, "%s", kvm_errmsg()); /* kvm_err reuses that buffer */
            return kvm_err(KVM_EINVAL, "%s: %s", key, why);
        }
        if (!p[len]) return 0;
        p += len + 1;
    }
}

int kvm_stage_check_devices(const char *key, const char *devs)
{
    int rc = kvm_stage_parse_devices(key, devs);
    if (rc) return rc;
    for (const char *p = devs; *p;) {
        char dev[64];
        size_t len = strcspn(p, ",");
        snprintf(dev, sizeof dev, "%.*s", (int)len, p);
        const kvm_kernels *kern;
        if (kvm_kernels_select(dev, &kern)) {
            char why[512];
            snprintf(why, sizeof why, "%s", kvm_errmsg()); /* kvm_err reuses that buffer */
            return kvm_err(KVM_EINVAL, "%s: %s", key, why);
        }
        p += len + (p[len] == ',');
    }
    return 0;
}

void kvm_stage_device_at(const char *devs, int64_t i, char *out, size_t size)
{
    int count = 1;
    for (const char *p = devs; *p; p++) count += *p == ',';
    const char *p = devs;
    for (int64_t k = i % count; k > 0; k--) p = strchr(p, ',') + 1;
    snprintf(out, size, "%.*s", (int)strcspn(p, ","), p);
}

int kvm_stage_solver_device(const kvm_stage_args *a)
{
    kvm_sculpt_opts so = kvm_sculpt_opts_default();
    int rc = kvm_sculpt_opts_set(&so, "device", a->device ? a->device : "cpu");
    if (!rc && so.cuda)
        kvm_log(KVM_LOG_INFO, "solver_device", NULL, 0, "KVSculpt solvers on cuda:%d", so.cuda_device);
    return rc;
}

int kvm_stage_main(int argc, char **argv, const kvm_stage_ops *ops, void *state)
{
    stage_rt rt = {.ops = ops, .state = state};
    int rc = parse_args(argc, argv, ops->stage, &rt.a);
    if (rc) return rc == 3 ? 0 : rc;
    if (rt.a.worker_id) snprintf(rt.worker_id, sizeof rt.worker_id, "%s", rt.a.worker_id);
    else {
        char host[128] = "host";
        gethostname(host, sizeof host);
        host[sizeof host - 1] = '\0';
        snprintf(rt.worker_id, sizeof rt.worker_id, "%s-%s-%d", ops->stage, host, (int)getpid());
    }
    char prefix[320];
    snprintf(prefix, sizeof prefix, "[%s %s] ", ops->stage, rt.worker_id);
    if (kvm_log_setup(ops->stage, prefix, rt.a.log_format)) /* without the flag: the environment's value */
        return fprintf(stderr, "kvmill-%s: %s: %s\n", ops->stage,
                       rt.a.log_format ? "--log-format" : "environment variable KVMILL_LOG_FORMAT", kvm_errmsg()),
               2;
    kvm_kernels_cpu_set_threads(rt.a.threads);
    const char *why = ops->device_refusal && rt.a.device && strncmp(rt.a.device, "cuda:", 5) == 0
                          ? ops->device_refusal(&rt.a)
                          : NULL;
    if (why) {
        log_line(&rt, "--device %s: %s: use --device cpu", rt.a.device, why);
        return 2;
    }
    const kvm_kernels *kern;
    if (kvm_kernels_select(rt.a.device, &kern)) { /* an unusable --device is refused up front */
        log_line(&rt, "--device %s", kvm_errmsg()); /* the message starts with the device's name */
        return 2;
    }
    if (pipe(wake_pipe) != 0) return fprintf(stderr, "kvmill-%s: pipe: %s\n", ops->stage, strerror(errno)), 1;
    fcntl(wake_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(wake_pipe[1], F_SETFL, O_NONBLOCK);
    struct sigaction sa = {.sa_handler = on_term};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    kvm_signal_hup(on_term, NULL); /* a closed terminal (a worker started by hand): as SIGTERM */
    signal(SIGPIPE, SIG_IGN);
    signal(SIGXFSZ, SIG_IGN); /* a file size limit: EFBIG, said by the store, not a silent death */
    if ((rc = ops->setup(state, &rt.a)) != 0) {
        log_line(&rt, "setup failed: %s", kvm_errmsg());
        /* a required option missing, or a --config, --model or --store that is missing or not
         * one, is the command line's error (exit 2, as kvmill run says of the same files) */
        return rc == KVM_EINVAL || rc == KVM_ENOTFOUND || rc == KVM_EFORMAT ? 2 : 1;
    }
    if ((rc = connect_sockets(&rt)) != 0) {
        log_line(&rt, "%s", kvm_errmsg());
        rc = rc == KVM_EIO || rc == KVM_ENOMEM ? 1 : 2; /* --connect or a --server-key/--client-* file: usage */
    } else {
        kvm_log_field f[] = {KVM_LOG_S("connect", rt.a.connect), KVM_LOG_S("device", rt.a.device),
                             KVM_LOG_I("threads", rt.a.threads)};
        /* "connected" once the orchestrator answers (link_event): zmq_connect only starts */
        log_ev(&rt, KVM_LOG_INFO, "connecting", f, 3, "connecting to %s (device %s, %d threads)%s", rt.a.connect,
               rt.a.device, rt.a.threads, rt.a.server_key ? " with CurveZMQ keys" : "");
        serve(&rt);
        if (!rt.refused && !rt.link_failed && !rt.wrong_peer) send_stopping(&rt, rt.ctl);
        log_ev(&rt, KVM_LOG_INFO, "stopped", NULL, 0,
               rt.refused       ? "stopped: refused (the reason is above)"
               : rt.link_failed ? "stopped: the handshake with the orchestrator failed"
               : rt.wrong_peer  ? "stopped: --connect names no orchestrator (the reason is above)"
                                : "stopped");
        if (rt.refused || rt.link_failed || rt.wrong_peer) rc = 1;
    }
    if (rt.job.running) pthread_join(rt.job.thread, NULL);
    drop_inputs(&rt.job);
    link_close(&rt);
    if (rt.ctl) zmq_close(rt.ctl);
    if (rt.data) zmq_close(rt.data);
    kvm_curve_ctx_term(rt.zctx); /* restarted after a signal: no I/O thread outlives the stage */
    if (ops->teardown) ops->teardown(state);
    return rc;
}
