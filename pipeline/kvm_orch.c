/* kvm_orch.c: the orchestrator of kvmill run and calibrate: its entry points, setup (run
 * directory, store, sockets, stage processes), the broker loop and the end of a run. One thread;
 * every wait is a zmq_poll with a short timeout so heartbeats, timeouts and signals are handled
 * within ~100 ms. The job table, stages, dispatch, messages and store are kvm_orch_*.c. */
#include "pipeline/kvm_orch_int.h"
#include "pipeline/kvm_spawn.h"
#include "common/kvm_signal.h"
#include "pipeline/kvm_orch_metrics.h"
#include "pipeline/kvm_orch_remote.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storew.h"
#include "pipeline/kvm_worker.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"

#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

/* atomic, not volatile sig_atomic_t: the store's watchdog thread reads it too (a data race
 * otherwise); a lock-free atomic_int is async-signal-safe for the handler's increment */
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "the SIGINT handler's counter must be lock-free");
static atomic_int interrupts;
static void on_sigint(int s) { (void)s; interrupts++; }
/* SIGHUP: one stop request however many hang-ups come (a terminal's close can send two) */
static void on_hup(int s)
{
    (void)s;
    if (!interrupts) interrupts = 1;
}

/* ---- progress ---- */

/* Within-document progress of the jobs in compress, e.g. " doc_003.txt 45/90" (problems
 * solved), into buf; empty when no worker reports any. */
static void inflight_progress(const orch *o, char *buf, size_t n)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int64_t i = kvm_joblist_first(&o->lists, J_COMPRESS); i >= 0 && at + 1 < n; i = kvm_joblist_next(&o->lists, i)) {
        const orch_job *j = &o->jobs[i];
        if (j->prog_total <= 0) continue;
        int w = snprintf(buf + at, n - at, "%s %s %lld/%lld", at ? "," : " in compress:", j->doc->name,
                         (long long)j->prog_done, (long long)j->prog_total);
        if (w < 0) break;
        at += (size_t)w < n - at ? (size_t)w : n - at - 1;
    }
}

/* The counters file ([run] metrics, kvmill run --metrics): at most every 500 ms while
 * running, and once at the end with the summary's values. A write error is said once. */
static void write_metrics(orch *o, const char *state, int force)
{
    const char *path = kvm_config_str(o->cfg, "run", "metrics");
    double now = kvm_now_ms();
    if (!*path || o->mode != MODE_RUN || (!force && now - o->last_metrics < 500)) return;
    o->last_metrics = now;
    const kvm_orch_summary *s = o->sum;
    kvm_orch_metrics m = {.state = state, .elapsed_s = (now - o->t0) / 1000.0, .documents_total = o->n_jobs,
                          .documents_done = s->compressed, .documents_skipped = s->skipped, .requeues = s->requeues,
                          .store_commits = s->store_commits, .wire_in_bytes = s->wire_in_bytes,
                          .wire_out_bytes = s->wire_out_bytes, .tokens = s->tokens, .prefill_s = s->stage_ms[ST_PREFILL] / 1000.0,
                          .compress_s = s->stage_ms[ST_COMPRESS] / 1000.0, .transport_s = s->transport_ms / 1000.0,
                          .store_s = s->store_ms / 1000.0};
    m.sched_jobs_max = o->visited_max;
    if (force) m.elapsed_s = s->seconds, m.documents_failed = s->failed, m.documents_pending = s->pending;
    else {
        const kvm_joblist *l = &o->lists;
        m.documents_failed = kvm_joblist_count(l, J_FAILED);
        m.documents_pending = o->n_jobs - kvm_joblist_count(l, J_FAILED) - kvm_joblist_count(l, J_DONE) -
                              kvm_joblist_count(l, J_SKIPPED);
    }
    if (kvm_orch_metrics_write(path, &m) && !o->metrics_failed) {
        o->metrics_failed = 1;
        kvm_orch__log("%s\n", kvm_errmsg());
    }
}

static void progress(orch *o, int final)
{
    if (!final) write_metrics(o, "running", 0);
    if (!kvm_orch_progress_due(&o->prog, final)) return;
    int64_t failed = kvm_joblist_count(&o->lists, J_FAILED);
    char inflight[512];
    inflight_progress(o, inflight, sizeof inflight);
    kvm_orch_progress_print(&o->prog, o->sum->compressed + failed, o->n_jobs - o->sum->skipped - o->sum->claimed,
                            o->sum->tokens, inflight, final);
}

/* ---- setup ---- */

/* The ipc socket files this process bound (ctl, data), unlinked at its end: ZeroMQ leaves them
 * when it closes the sockets, and a run directory kept (configured by [run] run_dir, or kept for
 * the stage logs) held "ctl" and "data" of an orchestrator no longer there. One orchestrator per
 * process, like orch_main's own state. */
static char bound_ipc[2][1100];

static void unlink_bound_ipc(void)
{
    for (int i = 0; i < 2; i++) {
        if (bound_ipc[i][0]) unlink(bound_ipc[i]);
        bound_ipc[i][0] = '\0';
    }
}

static int bind_sockets(orch *o)
{
    const char *bind = kvm_config_str(o->cfg, "run", "bind");
    if (*bind) snprintf(o->base, sizeof o->base, "%s", bind);
    else snprintf(o->base, sizeof o->base, "ipc://%s", o->run_dir);
    char ctl_ep[1100], data_ep[1100];
    int rc = kvm_stage_endpoints(o->base, ctl_ep, data_ep, sizeof ctl_ep);
    if (rc) return rc;
    o->zctx = zmq_ctx_new();
    o->ctl = zmq_socket(o->zctx, ZMQ_ROUTER);
    o->data = zmq_socket(o->zctx, ZMQ_ROUTER);
    int linger = 0, mandatory = 1;
    void *socks[2] = {o->ctl, o->data};
    const char *eps[2] = {ctl_ep, data_ep};
    for (int i = 0; i < 2; i++) {
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(socks[i], ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
        /* which of the two sockets: tcp://HOST:P binds P and P + 1, and a failure of the second
         * named only an endpoint the user never wrote */
        const char *what = !*bind ? "run directory endpoint"
                           : i    ? "[run] bind (its data socket: port + 1, or DIR/data)"
                                  : "[run] bind (its control socket)";
        if ((rc = kvm_serve_bind(o->zctx, socks[i], eps[i], o->cfg, 0, what))) return rc;
        if (!strncmp(eps[i], "ipc://", 6)) /* only what was bound here: a refused one may be another's */
            snprintf(bound_ipc[i], sizeof bound_ipc[i], "%s", eps[i] + 6);
    }
    return 0;
}

/* ---- the run ---- */


static int prepare(orch *o, kvm_store **store)
{
    int rc = kvm_rundir_make(kvm_config_str(o->cfg, "run", "run_dir"), "run", o->run_dir, sizeof o->run_dir,
                             &o->own_run_dir);
    if (rc) return rc;
    snprintf(o->store_path, sizeof o->store_path, "%s", kvm_config_str(o->cfg, "store", "path"));
    if (o->mode == MODE_RUN) kvm_storew_owner(o->owner, sizeof o->owner, o->host, sizeof o->host);
    kvm_store_id model_id, config_id;
    if (kvm_serve_remote_is_endpoint(o->store_path)) {
        if (o->mode != MODE_RUN)
            return kvm_err(KVM_EINVAL, "[store] path = %s is a store service: kvmill calibrate stores its strategy "
                                       "and runs on the store's host, with the LMDB directory", o->store_path);
        if ((rc = kvm_orch_remote_open(o->cfg, o->store_path, &o->cli, &model_id, &config_id)) ||
            (rc = kvm_worker_tokenizer_id(o->cfg, &model_id, &o->tok_id)))
            return rc;
        o->model_id = model_id;
        o->config_id = config_id;
        if ((rc = kvm_orch__mark_skipped(o, NULL)) == KVM_EIO) { /* no reply to the first probe: nothing claimed yet */
            o->sum->store_down = 1;
            o->owner[0] = '\0'; /* no release to try at the end (it said "its claims lapse by themselves") */
            return kvm_storecli_rejected(o->cli)
                       ? rc
                       : kvm_err(rc, "%s: is kvmill store serve running and reachable there?", kvm_errmsg());
        }
        if (rc) { /* the scan only probes: nothing is claimed, nothing to release at the end (where a
                     kvmill serve front end taken for the service would be named a second time) */
            o->owner[0] = '\0';
            return rc;
        }
        if ((rc = bind_sockets(o))) return rc;
        kvm_orch__log("store service %s: this run opens no LMDB, its claims and caches go through the service\n",
                      o->store_path);
        return o->n_open > 0 ? kvm_orch__start_stages(o) : 0;
    }
    rc = kvm_storew_open(o->cfg, o->store_path, 0, store);
    if (rc) return rc;
    o->store = *store;
    if ((rc = kvm_store_model_id(*store, kvm_config_str(o->cfg, "model", "path"), &model_id))) return rc;
    if (o->mode == MODE_RUN && !strcmp(kvm_config_str(o->cfg, "compress", "method"), "polykv")) {
        uint8_t *buf = NULL;
        size_t len = 0;
        rc = kvm_worker_strategy(o->cfg, *store, &model_id, &buf, &len);
        free(buf);
        if (rc == KVM_ENOTFOUND)
            return kvm_err(KVM_EINVAL, "%s", kvm_errmsg()); /* the same message, as a usage error */
        if (rc) return rc;
    }
    kvm_store_stats ss;
    if ((rc = kvm_store_stats_get(*store, &ss))) return rc;
    o->evicted0 = ss.n_evicted;
    if (o->mode == MODE_RUN &&
        ((rc = kvm_jobcfg_config_id_in(o->cfg, *store, &model_id, &config_id, NULL, NULL)) ||
         (rc = kvm_worker_tokenizer_id(o->cfg, &model_id, &o->tok_id))))
        return rc;
    o->model_id = model_id;
    o->config_id = config_id;
    if (o->mode == MODE_RUN && (rc = kvm_orch__mark_skipped(o, *store))) return rc;
    if ((rc = bind_sockets(o))) return rc;
    const char *sb = kvm_config_str(o->cfg, "store", "service_bind");
    if (o->mode == MODE_RUN && *sb && o->n_open > 0) { /* the store's host serves it to workers on other hosts */
        char log[2200];
        snprintf(log, sizeof log, "%s/store.log", o->run_dir);
        if ((rc = kvm_svcproc_start(&o->svc, o->bin_dir, o->store_path, sb, kvm_config_path(o->cfg), log, 10000))) {
            o->svc_failed = 1; /* its error names the log: the run directory is kept for it */
            return rc;
        }
        kvm_orch__log("store service on %s (pid %ld, log %s)\n", sb, (long)o->svc.pid, log);
    }
    return o->n_open > 0 ? kvm_orch__start_stages(o) : 0;
}

/* The store service stays up for the claims of other runs, named by whom (kvm_svcproc_ask_stop):
 * waited for, once the run's own end is done, until it stops by itself, or an interrupt after
 * `seen` stops it now. The run's summary and status are its own work's either way. */
static void wait_svc(orch *o, int seen, const char *whom)
{
    if (kvm_spawn_reaped(&o->svc.pid)) return; /* their claims were released meanwhile */
    kvm_orch__log("the store service stays up for %s: they store through it, so this run waits for it to stop once "
                  "their claims are released or lapse (Ctrl-C stops it now; its log: %s)\n",
                  whom, o->svc.log);
    while (interrupts == seen && !kvm_spawn_reaped(&o->svc.pid))
        usleep(50000);
    if (o->svc.pid <= 0) {
        kvm_orch__log("the store service stopped: the runs it stayed up for released their claims or let them lapse\n");
        return;
    }
    kvm_orch__log("interrupted: stopping the store service now (the runs it stayed up for find the store down)\n");
    kvm_svcproc_stop(&o->svc, 5000);
}

static void loop(orch *o)
{
    int seen_interrupts = 0;
    double next_look = kvm_now_ms() + 1000;
    o->renewed_ok = kvm_now_ms(); /* no claim is older */
    while (o->n_open > 0 || o->left_watch > 0) {
        if (interrupts != seen_interrupts) {
            seen_interrupts = interrupts;
            if (interrupts == 1) {
                kvm_orch__log("\ninterrupted: finishing the jobs in flight (Ctrl-C again to stop now)\n");
                o->sum->interrupted = 1;
            }
            if (interrupts >= 2) return;
        }
        if (interrupts || o->store_full) { /* draining: only the jobs in a worker finish; the rest are left */
            if (kvm_joblist_count(&o->lists, J_PREFILL) + kvm_joblist_count(&o->lists, J_COMPRESS) == 0) return;
        }
        o->visited = 0;
        if (kvm_now_ms() >= next_look) { /* its ipc:// socket files removed: bound again (kvm_serve.h) */
            char ctl_ep[1100], data_ep[1100];
            next_look = kvm_now_ms() + 1000;
            if (kvm_stage_endpoints(o->base, ctl_ep, data_ep, sizeof ctl_ep) == 0) {
                kvm_serve_rebind_if_removed(o->ctl, ctl_ep, "orchestrator's endpoint");
                kvm_serve_rebind_if_removed(o->data, data_ep, "orchestrator's endpoint");
            }
        }
        zmq_pollitem_t items[2] = {{o->ctl, 0, ZMQ_POLLIN, 0}, {o->data, 0, ZMQ_POLLIN, 0}};
        zmq_poll(items, 2, 100);
        double t0 = kvm_now_ms();
        if (items[0].revents & ZMQ_POLLIN) kvm_orch__receive(o, o->ctl, 1);
        if (items[1].revents & ZMQ_POLLIN) kvm_orch__receive(o, o->data, 0);
        kvm_orch__check_health(o);
        kvm_orch__dispatch(o);
        kvm_orch__renew_claims(o, t0);
        kvm_orch__recheck_left(o, t0);
        o->sum->transport_ms += kvm_now_ms() - t0; /* the broker's own work is all message handling */
        if (o->visited > o->visited_max) o->visited_max = o->visited;
        progress(o, 0);
    }
}

static int orch_main(const kvm_config *cfg, kvm_corpus *corpus, const char *self_path, kvm_orch_summary *sum, int mode);

/* An interrupted calibration stores no strategy: the record under (model, [compress] strategy)
 * goes back to what it held before (prev_rc 0: prev[n]; KVM_ENOTFOUND: none), once every stage
 * worker of this run has ended. Only when this calibration sent its build (build_sent): a record
 * changed while it never asked for one is another process's (a calibrate beside it) and stays.
 * Not atomic with that other writer: a strategy another process stores between this build's
 * and the undo would be taken back too (a narrow window, noted in the README). Returns 0 when
 * the store holds no strategy of this calibration, 1 when it does (said on stderr). */
static int undo_strategy(const kvm_config *cfg, kvm_store *store, const kvm_store_id *mid, int prev_rc,
                         const uint8_t *prev, size_t n, int build_sent)
{
    const char *name = kvm_config_str(cfg, "compress", "strategy");
    uint8_t *now = NULL;
    size_t now_len = 0;
    int rc = kvm_store_get_strategy(store, mid, name, &now, &now_len);
    int same = rc == KVM_ENOTFOUND ? prev_rc == KVM_ENOTFOUND
                                   : !rc && !prev_rc && now_len == n && (n == 0 || !memcmp(now, prev, n));
    free(now);
    if (same) return 0; /* the build had not stored it */
    if (!build_sent) {  /* this calibration never asked for a build: another process wrote the record */
        kvm_orch__log("interrupted before the strategy build; strategy '%s' was changed meanwhile by another "
                      "process, and is left as it is\n",
                      name);
        return 0;
    }
    if (rc && rc != KVM_ENOTFOUND && rc == prev_rc) return 0; /* unreadable before and after: unchanged */
    if (rc && rc != KVM_ENOTFOUND) goto failed;
    if (prev_rc && prev_rc != KVM_ENOTFOUND) { /* the old record was not readable: nothing to put back */
        rc = prev_rc;
        goto failed;
    }
    rc = prev_rc ? kvm_store_rm_strategy(store, mid, name) : kvm_store_put_strategy(store, mid, name, prev, n);
    if (!rc) {
        kvm_orch__log("interrupted: the strategy build had stored strategy '%s'; it is taken back out of the store%s\n",
                      name, prev_rc ? "" : " (the one stored before is put back)");
        return 0;
    }
failed:
    kvm_orch__log("interrupted: the strategy build stored strategy '%s' in %s and it could not be taken back: %s\n",
                  name, kvm_config_str(cfg, "store", "path"), kvm_errmsg());
    return 1;
}

int kvm_orch_run(const kvm_config *cfg, kvm_corpus *corpus, const char *self_path, kvm_orch_summary *sum)
{
    return orch_main(cfg, corpus, self_path, sum, MODE_RUN);
}

int kvm_orch_calibrate(const kvm_config *cfg, kvm_corpus *corpus, const char *self_path, kvm_orch_summary *sum)
{
    return orch_main(cfg, corpus, self_path, sum, MODE_CALIBRATE);
}

static int orch_main(const kvm_config *cfg, kvm_corpus *corpus, const char *self_path, kvm_orch_summary *sum, int mode)
{
    static orch o;
    memset(&o, 0, sizeof o);
    o.mode = mode;
    o.reduce_worker = -1;
    o.cmd = mode == MODE_CALIBRATE ? "calibrate" : "run";
    o.interrupts = &interrupts;
    char prefix[64];
    snprintf(prefix, sizeof prefix, "kvmill %s: ", o.cmd);
    const char *lf = kvm_config_str(cfg, "run", "log_format");
    kvm_log_setup("orchestrator", prefix, lf);
    setenv("KVMILL_LOG_FORMAT", lf, 1); /* the stages it starts log alike */
    memset(sum, 0, sizeof *sum);
    o.cfg = cfg;
    o.corpus = corpus;
    o.sum = sum;
    o.t0 = kvm_now_ms();
    o.prog = (kvm_orch_progress){.cmd = o.cmd,
                                 .tty = isatty(2),
                                 .t0_ms = o.t0,
                                 .interval_ms = 1000.0 * (double)kvm_config_int(cfg, "run", "progress_s")};
    o.next_id = 1;
    o.hb_ms = (double)kvm_config_int(cfg, "run", "heartbeat_ms");
    o.dead_ms = o.hb_ms * (double)kvm_config_int(cfg, "run", "liveness");
    o.job_timeout_ms = 1000.0 * (double)kvm_config_int(cfg, "run", "job_timeout_s");
    o.max_retries = (int)kvm_config_int(cfg, "run", "max_retries");
    const char *bd = kvm_config_str(cfg, "stages", "bin_dir");
    if (*bd) snprintf(o.bin_dir, sizeof o.bin_dir, "%s", bd);
    else {
        char tmp[2048];
        snprintf(tmp, sizeof tmp, "%s", self_path);
        char *slash = strrchr(tmp, '/');
        snprintf(o.bin_dir, sizeof o.bin_dir, "%s", slash ? (*slash = '\0', tmp) : ".");
    }
    o.n_jobs = corpus->n;
    o.n_open = corpus->n;
    o.jobs = calloc((size_t)(corpus->n > 0 ? corpus->n : 1), sizeof *o.jobs);
    if (!o.jobs || kvm_joblist_init(&o.lists, corpus->n, N_JOB_STATES, J_QUEUED)) { /* all queued, in corpus order */
        kvm_orch__log("out of memory (%lld document%s)\n", (long long)corpus->n, kvm_plural(corpus->n, "", "s"));
        free(o.jobs);
        return 1;
    }
    for (int64_t i = 0; i < corpus->n; i++) {
        o.jobs[i] =
            (orch_job){.doc = &corpus->docs[i], .state = J_QUEUED, .id = o.next_id++, .worker = -1, .since_ms = o.t0};
        if (kvm_idxset_add(&o.by_id, o.jobs[i].id, i)) {
            kvm_orch__log("%s\n", kvm_errmsg());
            kvm_joblist_deinit(&o.lists);
            kvm_idxset_free(&o.by_id);
            free(o.jobs);
            return 1;
        }
    }
    struct sigaction sa = {.sa_handler = on_sigint}, old_int, old_term, old_hup;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    kvm_signal_hup(on_hup, &old_hup); /* a closed terminal or a daemon's hang-up: as SIGTERM */
    interrupts = 0;
    /* a store write lock held for long by another process: Ctrl-C still ends the run */
    kvm_store_set_interrupt(&interrupts, mode == MODE_CALIBRATE
                                             ? "no summary is printed and --out is not written; its stage workers "
                                               "stop by themselves; a strategy its build stored stays stored"
                                             : "the run's summary is not printed; its stage workers stop by "
                                               "themselves (one waiting for this lock too once it gets it) and its "
                                               "claims are taken over by the next run on this host");
    kvm_store *store = NULL;
    int rc = prepare(&o, &store), status = 0;
    /* calibrate: the strategy record as it was before, put back if the calibration is
     * interrupted (the strategy worker stores it itself, before the orchestrator hears of it;
     * a new one stored by a run the user stopped silently turned existing polykv caches stale) */
    uint8_t *prev_strat = NULL;
    size_t prev_len = 0;
    int prev_rc = KVM_ENOTFOUND;
    if (!rc && mode == MODE_CALIBRATE && store)
        prev_rc = kvm_store_get_strategy(store, &o.model_id, kvm_config_str(cfg, "compress", "strategy"), &prev_strat,
                                         &prev_len);
    if (rc) {
        status = rc == KVM_EINVAL || rc == KVM_EFORMAT ? 2 : 1; /* EFORMAT: the store is not one (truncated, foreign) */
        /* a refusal to start (README, "Seeing a run": event "refused"), as the command's own are */
        kvm_log(KVM_LOG_ERROR, status == 2 ? "refused" : "message", NULL, 0, "%s\n", kvm_errmsg());
    } else {
        sum->repeated = o.repeated;
        if (mode == MODE_CALIBRATE) /* calibration measures every document: none is skipped as stored */
            kvm_orch__log("%lld calibration document%s, each measured, run directory %s\n", (long long)o.n_jobs,
                          kvm_plural(o.n_jobs, "", "s"), o.run_dir);
        else if (o.repeated > 0) /* a duplicate within the corpus is not one already stored */
            kvm_orch__log("%lld document%s (%lld already stored, %lld duplicate%s of another in this corpus), run "
                          "directory %s\n",
                          (long long)o.n_jobs, kvm_plural(o.n_jobs, "", "s"), (long long)(sum->skipped - o.repeated),
                          (long long)o.repeated, kvm_plural(o.repeated, "", "s"), o.run_dir);
        else
            kvm_orch__log("%lld document%s (%lld already stored), run directory %s\n", (long long)o.n_jobs,
                          kvm_plural(o.n_jobs, "", "s"), (long long)sum->skipped, o.run_dir);
        loop(&o);
        /* results trail acks by a message: collect them for the per-stage times */
        for (double end = kvm_now_ms() + 1000; kvm_now_ms() < end && interrupts < 2 && o.compress_results < sum->compressed;) {
            zmq_pollitem_t items[1] = {{o.ctl, 0, ZMQ_POLLIN, 0}};
            if (zmq_poll(items, 1, 50) > 0) kvm_orch__receive(&o, o.ctl, 1);
        }
        progress(&o, 1);
    }
    int hard = interrupts >= 2;
    kvm_orch__stop_children(&o, hard ? SIGKILL : SIGTERM);
    /* abandoned jobs: their workers wait on uploads that get no reply, no grace for them */
    kvm_orch__reap_all(&o, hard          ? 100
                           : o.abandoned ? 2000
                                         : 1000.0 * (double)kvm_config_int(cfg, "run", "grace_s") + 2000);
    /* after the workers: their last uploads are committed; a service that other runs store
     * through stays up for them (documents this run left to them included), waited for below */
    char svc_whom[1400] = "";
    int svc_seen = interrupts;
    if (hard)
        kvm_svcproc_stop(&o.svc, 5000);
    else
        kvm_svcproc_ask_stop(&o.svc, 5000, svc_whom, sizeof svc_whom);
    if (!rc && !hard) kvm_orch__failed_but_stored(&o, store); /* the store is the truth, not the acks seen */
    for (int64_t i = 0; i < o.n_jobs; i++) {
        if (o.jobs[i].state == J_FAILED) sum->failed++;
        if (o.jobs[i].state != J_FAILED && o.jobs[i].state != J_DONE && o.jobs[i].state != J_SKIPPED) sum->pending++;
        kvm_orch__job_drop_kv(&o.jobs[i]);
        free(o.jobs[i].kv);
    }
    if (store && !rc && sum->store_down == 3 && sum->compressed > 0) /* damaged: nothing can be read back */
        sum->bytes_unknown = 1;
    else if (store && !rc) {
        kvm_store_list_caches(store, &o.model_id, kvm_orch__sum_bytes, &o); /* this model's caches only */
        kvm_orch__count_evictions(&o, store);
    }
    /* a service that did not answer, or a second Ctrl-C: no waiting on it for the sizes, and
     * one short try to release the claims (they lapse by themselves) */
    int quick = hard || sum->store_down;
    if (o.cli && !rc && sum->compressed > 0 &&
        (quick || kvm_orch__sum_remote(&o))) { /* partial sums are no figure either */
        sum->bytes_unknown = 1;
        sum->bytes_full = sum->bytes_compressed = sum->evicted = sum->evicted_own = 0;
    }
    if (o.cli) sum->kept_full = -1;
    if (store && o.owner[0] && kvm_storew_release(store, o.owner)) kvm_orch__log("%s\n", kvm_errmsg());
    if (store && !rc && o.owner[0] && !hard) kvm_orch__release_dead(&o); /* not after a refusal */
    if (o.cli && o.owner[0] &&
        kvm_storecli_renew(o.cli, o.owner, 0, 1, kvm_orch_remote_timeout_ms(cfg) / (quick ? 4 : 1), quick ? 1 : 2, NULL))
        kvm_orch__log("%s (its claims lapse by themselves)\n", kvm_errmsg());
    if (mode == MODE_CALIBRATE && interrupts && !sum->interrupted) { /* after the stages' work: still honoured */
        kvm_orch__log("\ninterrupted: the stages' work was done\n");
        sum->interrupted = 1;
    }
    if (mode == MODE_CALIBRATE && store && sum->interrupted)
        sum->strategy_stored = undo_strategy(cfg, store, &o.model_id, prev_rc, prev_strat, prev_len, o.reduce_id != 0);
    free(prev_strat);
    kvm_store_close(&store);
    kvm_storecli_close(&o.cli);
    sum->seconds = (kvm_now_ms() - o.t0) / 1000.0;
    if (!rc) write_metrics(&o, hard || sum->interrupted ? "interrupted" : "done", 1);
    free(o.jobs);
    free(o.left_idx);
    kvm_idxset_free(&o.by_hash);
    kvm_idxset_free(&o.by_id);
    kvm_joblist_deinit(&o.lists);
    if (o.ctl) {
        /* what is queued on the control socket still goes out, for at most 500 ms: a worker
         * refused just before a short run ended (another model) never heard why and waited for
         * an orchestrator for good; the sockets linger 0 while the run lasts */
        int linger = 500;
        zmq_setsockopt(o.ctl, ZMQ_LINGER, &linger, sizeof linger);
        zmq_close(o.ctl);
    }
    if (o.data) zmq_close(o.data);
    kvm_curve_ctx_term(o.zctx); /* joins the ZAP handler of a keyed [run] bind too */
    unlink_bound_ipc();         /* after the close: run and calibrate alike, however they ended */
    if (o.svc.pid > 0) wait_svc(&o, svc_seen, svc_whom);
    kvm_store_set_interrupt(NULL, NULL);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    sigaction(SIGHUP, &old_hup, NULL);
    if (o.own_run_dir && !o.svc_failed && (o.n_slots == 0 || (status == 0 && sum->failed == 0 && !hard)))
        kvm_rundir_remove(o.run_dir);
    else if (o.run_dir[0] && (o.n_slots > 0 || o.svc_failed))
        kvm_orch__log("%s in %s\n", o.n_slots > 0 ? "stage logs are" : "the store service's log is", o.run_dir);
    if (hard || (status == 0 && sum->interrupted)) return 130; /* stopped by Ctrl-C: not a complete run */
    return status;
}
