/* kvm_serve_broker.c: the serving broker (kvm_serve_run): setup (run directory, store service,
 * keys, sockets, decode worker processes) and the loop. One thread; every wait is a zmq_poll of
 * at most 100 ms so heartbeats, timeouts, child exits and signals are handled promptly. Clients,
 * decode workers, their processes and the allowance are kvm_serve_{front,back,slots,grant}.c. */
#include "pipeline/kvm_serve_int.h"
#include "common/kvm_signal.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_svcproc.h"
#include "pipeline/kvm_spawn.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storew.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

static volatile sig_atomic_t interrupts, stop_signal;
static void on_signal(int sig)
{
    stop_signal = sig; /* named in the answer to a request that comes while the server stops */
    interrupts++;
}

/* SIGHUP: one stop request however many hang-ups come (a terminal's close can send two) */
static void on_hup(int sig)
{
    if (!interrupts) stop_signal = sig, interrupts = 1;
}

/* ---- setup ---- */

/* Bytes of requests ZeroMQ may queue per front-end connection before on_request reads them, per
 * frame of each request (the front end's ZMQ_RCVHWM is this over its ZMQ_MAXMSGSIZE, at least
 * 1): 1 GiB, as 1000 requests (ZeroMQ's default mark) of 1 MiB frames were before the front end
 * took frames of KVM_PROTO_MAX_HEADER_BYTES. A connection at its mark is not read further (TCP
 * back-pressure on that client); nothing is dropped. */
#define FRONT_QUEUED_BYTES ((int64_t)1 << 30)

int kvm_serve__front_rcvhwm(int64_t max_frame_bytes)
{
    const int64_t n = FRONT_QUEUED_BYTES / (max_frame_bytes > 0 ? max_frame_bytes : 1);
    return n < 1 ? 1 : n > 1000 ? 1000 : (int)n; /* 1000: ZeroMQ's default, never raised */
}

/* [store] cap_mb of the server's config, recorded in a local store it can write (made, with
 * compute_missing, when it does not exist): the server is the store's owner here (its decode
 * workers keep the recorded cap, kvm_storew_worker_opts). A store that cannot be opened for
 * writing is left to the workers' own checks, said once. */
static void record_cap(srv *s)
{
    const kvm_config *cfg = s->cfg;
    char why[4400];
    if (kvm_config_int(cfg, "store", "cap_mb") <= 0 || *kvm_config_str(cfg, "store", "service") ||
        !strncmp(s->store_path, "tcp://", 6) || !strncmp(s->store_path, "ipc://", 6) ||
        kvm_store_unwritable(s->store_path, why, sizeof why))
        return;
    kvm_store_opts so;
    kvm_storew_opts(cfg, 0, &so);
    /* with compute_missing the store may not exist yet: made here, with the cap, since the
     * workers that would make it keep a store's cap as they find it (none) */
    so.must_exist = !s->compute_missing;
    kvm_store *st = NULL;
    int rc = kvm_store_open(s->store_path, &so, &st);
    if (rc && rc != KVM_ENOTFOUND)
        kvm_log(KVM_LOG_WARN, "message", NULL, 0, "[store] cap_mb not recorded in %s: %s", s->store_path, kvm_errmsg());
    kvm_store_close(&st);
}

/* The store service stopped at the end: now, or asked, when it stays up for the claims of runs
 * that store through it ([store] path = this service), waited for until it stops by itself
 * (their claims released or lapsed) or a further Ctrl-C stops it now. */
static void stop_svc(srv *s, int now)
{
    char whom[1400];
    const int seen = interrupts;
    if (now) {
        kvm_svcproc_stop(&s->svc, 5000);
        return;
    }
    if (!kvm_svcproc_ask_stop(&s->svc, 5000, whom, sizeof whom)) return;
    kvm_serve__log("the store service stays up for %s: they store through it, so serve waits for it to stop once "
                   "their claims are released or lapse (Ctrl-C again stops it now; its log: %s)",
                   whom, s->svc.log);
    while (interrupts == seen && !kvm_spawn_reaped(&s->svc.pid))
        usleep(50000);
    if (s->svc.pid <= 0)
        kvm_serve__log("the store service stopped: the runs it stayed up for released their claims or let them lapse");
    else
        kvm_svcproc_stop(&s->svc, 5000);
}

static int prepare(srv *s)
{
    const kvm_config *cfg = s->cfg;
    /* a device this host cannot use is refused before anything starts */
    if (s->n_slots > 0 && kvm_stage_check_devices("[serve] devices", kvm_config_str(cfg, "serve", "devices")))
        return KVM_EINVAL;
    record_cap(s);
    int rc0 =
        kvm_rundir_make(kvm_config_str(cfg, "run", "run_dir"), "serve", s->run_dir, sizeof s->run_dir, &s->own_run_dir);
    if (rc0) return rc0;
    const char *sb = kvm_config_str(cfg, "store", "service_bind");
    if (*sb && strncmp(s->store_path, "tcp://", 6) && strncmp(s->store_path, "ipc://", 6)) { /* the store's host */
        char log[2200];
        snprintf(log, sizeof log, "%s/store.log", s->run_dir);
        if ((rc0 = kvm_svcproc_start(&s->svc, s->bin_dir, s->store_path, sb, kvm_config_path(cfg), log, 10000))) {
            s->svc_failed = 1; /* its error names the log: the run directory is kept for it */
            return rc0;
        }
        kvm_serve__log("store service on %s (pid %ld, log %s)", sb, (long)s->svc.pid, log);
    }
    const char *be = kvm_config_str(cfg, "serve", "backend");
    if (*be)
        snprintf(s->base, sizeof s->base, "%s", be);
    else
        snprintf(s->base, sizeof s->base, "ipc://%s", s->run_dir);
    char ctl_ep[1100], data_ep[1100];
    int rc = kvm_stage_endpoints(s->base, ctl_ep, data_ep, sizeof ctl_ep);
    if (rc) return kvm_err(KVM_EINVAL, "[serve] backend: %s", kvm_errmsg());
    /* the back end follows the front end's rule: keyed server => every worker authenticates */
    s->backend_curve = !kvm_curve_is_local(ctl_ep) || !kvm_curve_is_local(data_ep) ||
                       *kvm_config_str(cfg, "security", "server_secret_key");
    if (s->backend_curve && s->n_slots > 0) {
        const char *need[3] = {"server_public_key", "client_public_key", "client_secret_key"};
        for (int i = 0; i < 3; i++)
            if (!*kvm_config_str(cfg, "security", need[i]))
                return kvm_err(KVM_EINVAL,
                               "[serve] backend %s uses CurveZMQ (a server key is set, or it is not local): the "
                               "decode workers started here need [security] %s (a key pair from kvmill keygen "
                               "whose .public is in authorized_keys, and the server's public key)",
                               s->base, need[i]);
        /* a mixed-up pair made every worker fail its handshake in silence: serve never got ready */
        if ((rc = kvm_curve_check_client_pair(kvm_config_str(cfg, "security", "client_secret_key"),
                                              kvm_config_str(cfg, "security", "client_public_key"))))
            return kvm_err(KVM_EINVAL, "[security] client_public_key, client_secret_key: %s", kvm_errmsg());
        /* and one the server does not list: the workers it starts were refused, and it never got ready */
        const char *auth = kvm_config_str(cfg, "security", "authorized_keys");
        struct stat ast; /* a folder that is missing or no folder is said when the front end binds */
        if (*kvm_config_str(cfg, "security", "server_secret_key") && *auth && !stat(auth, &ast) &&
            S_ISDIR(ast.st_mode) &&
            (rc = kvm_curve_check_authorized(kvm_config_str(cfg, "security", "client_public_key"), auth)))
            return kvm_err(KVM_EINVAL, "[security] client_public_key (the key of the decode workers serve starts): %s",
                           kvm_errmsg());
    }
    char exe[2048];
    snprintf(exe, sizeof exe, "%s/kvmill-decode", s->bin_dir);
    if (s->n_slots > 0 && access(exe, X_OK) != 0)
        return kvm_err(
            KVM_EINVAL,
            "decode worker binary %s is missing or not executable (build with make, or set [stages] bin_dir)", exe);
    s->zctx = zmq_ctx_new();
    s->front = zmq_socket(s->zctx, ZMQ_ROUTER);
    s->ctl = zmq_socket(s->zctx, ZMQ_ROUTER);
    s->data = zmq_socket(s->zctx, ZMQ_ROUTER);
    if (!s->zctx || !s->front || !s->ctl || !s->data) return kvm_err(KVM_EIO, "zmq_socket: %s", zmq_strerror(errno));
    int linger = 0, mandatory = 1;
    /* ZeroMQ drops a frame over ZMQ_MAXMSGSIZE with its connection, unanswered: the client waited
     * for its timeout. So the front end takes every frame a valid ask can have (its header, which
     * carries the document and the prompt, is at most KVM_PROTO_MAX_HEADER_BYTES) and
     * on_request cuts or refuses what is over max_message_bytes at once, before it reads the
     * next request. Until on_request reads them ZeroMQ queues up to ZMQ_RCVHWM messages per
     * client connection (1000 by default: 32 GiB of 32 MiB frames), so the front end's mark
     * is lower: 32 messages of 32 MiB frames, the bytes of 1000 under the old 1 MiB limit */
    int64_t maxmsg =
        s->max_msg_bytes > (int64_t)KVM_PROTO_MAX_HEADER_BYTES ? s->max_msg_bytes : (int64_t)KVM_PROTO_MAX_HEADER_BYTES;
    int rcvhwm = kvm_serve__front_rcvhwm(maxmsg);
    void *socks[3] = {s->front, s->ctl, s->data};
    for (int i = 0; i < 3; i++) {
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(socks[i], ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    }
    if (zmq_setsockopt(s->front, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg))
        return kvm_err(KVM_EIO, "ZMQ_MAXMSGSIZE: %s", zmq_strerror(errno));
    if (zmq_setsockopt(s->front, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm)) /* before the bind: it applies to new pipes */
        return kvm_err(KVM_EIO, "ZMQ_RCVHWM: %s", zmq_strerror(errno));
    char what[1200];
    if (s->o->bind)
        snprintf(what, sizeof what, "--bind");
    else
        snprintf(what, sizeof what, "[serve] bind in %s", kvm_config_path(cfg));
    s->front_curve = !kvm_curve_is_local(s->front_ep) || *kvm_config_str(cfg, "security", "server_secret_key");
    if ((rc = kvm_serve_bind(s->zctx, s->front, s->front_ep, cfg, 1, what)) ||
        (rc = kvm_serve_bind(s->zctx, s->ctl, ctl_ep, cfg, 1, *be ? "[serve] backend" : "run directory endpoint")) ||
        (rc = kvm_serve_bind(s->zctx, s->data, data_ep, cfg, 1, *be ? "[serve] backend" : "run directory endpoint")))
        return rc;
    kvm_serve_ipc_note(s->front_ep, &s->ipc[0]);
    kvm_serve_ipc_note(ctl_ep, &s->ipc[1]);
    kvm_serve_ipc_note(data_ep, &s->ipc[2]);
    /* the ready line shows what was bound: a :0 or :* port as the port the system chose */
    char bound[1024];
    if (kvm_serve_bound_endpoint(s->front, s->front_ep, bound, sizeof bound))
        snprintf(s->front_ep, sizeof s->front_ep, "%s", bound);
    for (int i = 0; i < s->n_slots; i++)
        if ((rc = kvm_serve__spawn_slot(s, i))) return rc;
    return 0;
}

int kvm_serve_run(const kvm_config *cfg, const kvm_serve_opts *o)
{
    static srv s;
    memset(&s, 0, sizeof s);
    const char *lf = kvm_config_str(cfg, "run", "log_format");
    kvm_log_setup("serve", "kvmill serve: ", lf);
    setenv("KVMILL_LOG_FORMAT", lf, 1); /* the decode workers it starts log alike */
    s.cfg = cfg;
    s.o = o;
    snprintf(s.front_ep, sizeof s.front_ep, "%s", o->bind ? o->bind : kvm_config_str(cfg, "serve", "bind"));
    snprintf(s.store_path, sizeof s.store_path, "%s",
             o->store_path ? o->store_path : kvm_config_str(cfg, "store", "path"));
    const char *bd = o->bin_dir ? o->bin_dir : kvm_config_str(cfg, "stages", "bin_dir");
    snprintf(s.bin_dir, sizeof s.bin_dir, "%s", *bd ? bd : ".");
    int64_t nw = o->workers >= 0 ? o->workers : kvm_config_int(cfg, "serve", "workers");
    s.n_slots = (int)(nw < MAX_WORKERS ? nw : MAX_WORKERS);
    s.hb_ms = (double)kvm_config_int(cfg, "run", "heartbeat_ms");
    s.dead_ms = s.hb_ms * (double)kvm_config_int(cfg, "run", "liveness");
    s.timeout_ms = 1000.0 * (double)kvm_config_int(cfg, "serve", "request_timeout_s");
    s.max_queue = kvm_config_int(cfg, "serve", "max_queue");
    s.max_msg_bytes = kvm_config_int(cfg, "serve", "max_message_bytes");
    s.compute_missing = kvm_config_bool(cfg, "serve", "compute_missing");
    s.max_new = kvm_config_int(cfg, "serve", "max_new_caches");
    s.max_new_per_key = kvm_config_int(cfg, "serve", "max_new_caches_per_key");
    s.announced = s.n_slots == 0;
    struct sigaction sa = {.sa_handler = on_signal}, old_int, old_term, old_hup;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    kvm_signal_hup(on_hup, &old_hup); /* a closed terminal or a daemon's hang-up: as SIGTERM */
    signal(SIGPIPE, SIG_IGN);
    interrupts = stop_signal = 0;
    s.interrupts = &interrupts;
    s.stop_signal = &stop_signal;
    int rc = prepare(&s), status = 0;
    if (rc) {
        status = rc == KVM_EINVAL ? 2 : 1;
        /* a refusal to start (README, "Seeing a run": event "refused"), as the command's own are */
        kvm_log(KVM_LOG_ERROR, status == 2 ? "refused" : "message", NULL, 0, "%s", kvm_errmsg());
    } else {
        if (s.n_slots == 0)
            kvm_serve__log("ready: front end %s, no decode workers started; back end %s", s.front_ep, s.base);
        char ctl_ep[1100] = "", data_ep[1100] = "";
        if (kvm_stage_endpoints(s.base, ctl_ep, data_ep, sizeof ctl_ep)) ctl_ep[0] = data_ep[0] = '\0';
        double next_look = kvm_now_ms() + 1000;
        while (!interrupts && !s.fatal) {
            if (kvm_now_ms() >= next_look) { /* a stat each second per ipc:// socket */
                next_look = kvm_now_ms() + 1000;
                /* a socket bound again is noted again: removed at the stop as the first was */
                if (kvm_serve_rebind_if_removed(s.front, s.front_ep, "front end"))
                    kvm_serve_ipc_note(s.front_ep, &s.ipc[0]);
                if (*ctl_ep && kvm_serve_rebind_if_removed(s.ctl, ctl_ep, "back end"))
                    kvm_serve_ipc_note(ctl_ep, &s.ipc[1]);
                if (*data_ep && kvm_serve_rebind_if_removed(s.data, data_ep, "back end"))
                    kvm_serve_ipc_note(data_ep, &s.ipc[2]);
            }
            zmq_pollitem_t items[3] = {
                {s.front, 0, ZMQ_POLLIN, 0}, {s.ctl, 0, ZMQ_POLLIN, 0}, {s.data, 0, ZMQ_POLLIN, 0}};
            zmq_poll(items, 3, 100);
            if (items[1].revents & ZMQ_POLLIN) kvm_serve__receive_back(&s, s.ctl, 1);
            if (items[2].revents & ZMQ_POLLIN) kvm_serve__receive_back(&s, s.data, 0);
            if (items[0].revents & ZMQ_POLLIN) kvm_serve__receive_front(&s);
            kvm_serve__check_health(&s);
            kvm_serve__dispatch(&s);
        }
        if (s.fatal && s.fatal_why[0]) {
            kvm_log(KVM_LOG_ERROR, "message", NULL, 0, "%s: stopping", s.fatal_why);
            status = 1;
        } else if (s.fatal) {
            kvm_serve__log(
                "decode workers exit %d times in a row before connecting (see their messages above): stopping",
                MAX_EARLY_EXITS);
            status = 1;
        } else
            kvm_serve__log("stopping (%s): %llu answered, %llu errors",
                           interrupts >= 2 ? "now" : "letting workers finish", (unsigned long long)s.served,
                           (unsigned long long)s.failed);
    }
    kvm_serve__shutdown_workers(&s, interrupts >= 2 || rc);
    stop_svc(&s, interrupts >= 2 || rc);
    for (int w = 0; w < s.n_workers; w++)
        kvm_msg_free(&s.workers[w].env);
    free(s.queue);
    free(s.clients);
    if (s.front) zmq_close(s.front);
    if (s.ctl) zmq_close(s.ctl);
    if (s.data) zmq_close(s.data);
    kvm_curve_ctx_term(s.zctx); /* joins the ZAP handler too: no thread outlives the return */
    for (int i = 0; i < 3; i++) /* the ipc:// socket files it bound, when still its own */
        kvm_serve_ipc_remove(&s.ipc[i]);
    if (s.own_run_dir && !s.svc_failed)
        kvm_rundir_remove(s.run_dir);
    else if (s.svc_failed)
        kvm_serve__log("the store service's log is in %s", s.run_dir);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    sigaction(SIGHUP, &old_hup, NULL);
    if (!rc && !s.fatal) kvm_serve__log("stopped");
    return interrupts >= 2 ? 130 : status;
}
