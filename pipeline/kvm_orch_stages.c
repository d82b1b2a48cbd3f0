/* kvm_orch_stages.c: the orchestrator's stage processes and workers: starting the configured
 * stage processes, knowing the workers that connect (started or external), restarting dead
 * ones, failing the open jobs of a stage with no worker left, and the health checks. */
#include "pipeline/kvm_orch_int.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_spawn.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_worker.h"
#include "common/kvm_log.h"
#include "common/kvm_error.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *const stage_names[N_STAGES] = {"prefill", "compress", "signals", "strategy"};

/* 1 when the run directory can take the stages' logs. Removed while the run goes on (a /tmp
 * cleaner, an rm), every start of a stage failed on its log file until the stage was given up
 * (with a tcp:// [run] bind nothing else makes the folder again; with ipc:// the sockets'
 * re-bind does): it is made again (0700) when missing. A path that then is no folder of this
 * user (another user's, made in between) gets no log of ours: 0. */
static int run_dir_usable(orch *o)
{
    struct stat st;
    if (stat(o->run_dir, &st) && errno == ENOENT && mkdir(o->run_dir, 0700) == 0)
        kvm_orch__log("the run directory %s was removed: made it again\n", o->run_dir);
    return stat(o->run_dir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid();
}

static int spawn_slot(orch *o, int s)
{
    orch_slot *sl = &o->slots[s];
    char exe[2048], hb[32], grace[32], threads[32], logp[2048], ppid[32];
    snprintf(exe, sizeof exe, "%s/kvmill-%s", o->bin_dir, stage_names[sl->stage]);
    snprintf(sl->id, sizeof sl->id, "%s-%d-r%d", stage_names[sl->stage], s, sl->respawns);
    snprintf(hb, sizeof hb, "%lld", (long long)kvm_config_int(o->cfg, "run", "heartbeat_ms"));
    snprintf(grace, sizeof grace, "%lld", (long long)kvm_config_int(o->cfg, "run", "grace_s"));
    snprintf(threads, sizeof threads, "%lld", (long long)kvm_config_int(o->cfg, "stages", "threads"));
    if (run_dir_usable(o))
        snprintf(logp, sizeof logp, "%s/%s.log", o->run_dir, sl->id);
    else
        snprintf(logp, sizeof logp, "/dev/null");
    snprintf(ppid, sizeof ppid, "%ld", (long)getpid());
    /* clang-format off */
    char *argv[] = {exe, "--connect", o->base, "--device", sl->device, "--store", o->store_path, "--threads", threads,
                    "--heartbeat-ms", hb, "--grace-s", grace, "--id", sl->id, "--parent-pid", ppid, NULL, NULL, NULL,
                    NULL, NULL, NULL, NULL};
    /* clang-format on */
    /* a keyed orchestrator ([run] bind off-host: kvm_serve_bind uses CurveZMQ only there): its
     * own stages authenticate like external ones, and use the same keys for the store service */
    const char *spk = kvm_config_str(o->cfg, "security", "server_public_key");
    char **k = &argv[17];
    if (*spk && !kvm_curve_is_local(o->base)) {
        kvm_spawn_curve_args(k, o->cfg);
    } else if (*spk && o->cli && sl->stage == ST_COMPRESS) {
        /* a local bind with a remote store: the keys are the store service's only; the worker
         * reads them from the config ([security]), and connects to this run in the clear */
        k[0] = "--config", k[1] = (char *)kvm_config_path(o->cfg);
    }
    const kvm_spawn_opts so = {logp, KVM_SPAWN_DEFAULT_SIGINT, NULL};
    sl->started_ms = kvm_now_ms();
    sl->join_state = 0;
    return kvm_spawn_start(&sl->pid, exe, argv, &so);
}

void kvm_orch__stop_children(orch *o, int sig)
{
    for (int s = 0; s < o->n_slots; s++)
        if (o->slots[s].pid > 0) kill(o->slots[s].pid, sig);
}

/* Waits up to ms for every child to exit; SIGKILLs the rest. */
void kvm_orch__reap_all(orch *o, double ms)
{
    double end = kvm_now_ms() + ms;
    for (;;) {
        int left = 0;
        for (int s = 0; s < o->n_slots; s++) {
            if (o->slots[s].pid <= 0) continue;
            if (!kvm_spawn_reaped(&o->slots[s].pid)) left++;
        }
        if (!left) return;
        if (kvm_now_ms() > end) {
            kvm_orch__stop_children(o, SIGKILL);
            for (int s = 0; s < o->n_slots; s++)
                if (o->slots[s].pid > 0) waitpid(o->slots[s].pid, NULL, 0), o->slots[s].pid = 0;
            return;
        }
        /* stopping workers ask for the end of their work (revision 13): answered, they exit now
         * instead of at their bound */
        zmq_pollitem_t item = {o->data, 0, ZMQ_POLLIN, 0};
        const int pr = o->data ? zmq_poll(&item, 1, 20) : -1;
        if (pr > 0)
            kvm_orch__answer_stopping(o);
        else if (pr < 0) /* no socket, or a signal: wait as the poll would have */
            usleep(20000);
    }
}

int kvm_orch__worker_get(orch *o, const kvm_frame *idf, int stage)
{
    if (!idf->size || !idf->data[0]) { /* ZeroMQ's own id (0 and 4 bytes): a peer that set none */
        if (!o->anonymous_said)
            kvm_orch__log("dropped a message from a peer without a worker id (a ZeroMQ socket that set no routing "
                          "id; kvmill's stage workers set their --id): it is not a worker\n");
        o->anonymous_said = 1;
        return -1;
    }
    char id[256];
    size_t n = idf->size < sizeof id - 1 ? idf->size : sizeof id - 1;
    memcpy(id, idf->data, n);
    id[n] = '\0';
    for (int w = 0; w < o->n_workers; w++)
        if (!strcmp(o->workers[w].id, id)) {
            if (o->workers[w].stage < 0) o->workers[w].stage = stage;
            const orch_worker *wk = &o->workers[w]; /* stopped or silent, now back: said, as its join was */
            if (!wk->alive && !wk->ended && wk->slot < 0 && wk->stage >= 0)
                kvm_orch__log("external %s worker %s joined again\n", stage_names[wk->stage], id);
            return w;
        }
    int at = o->n_workers < MAX_WORKERS ? o->n_workers : -1;
    for (int w = 0; at < 0 && w < o->n_workers; w++) /* a long run's restarts and joins outnumber the table: */
        if (!o->workers[w].alive && o->workers[w].job < 0 && w != o->reduce_worker) at = w; /* reuse a dead one */
    if (at < 0) {
        if (!o->workers_full_said)
            kvm_orch__log("%d workers are alive: worker %s is ignored until one of them leaves\n", MAX_WORKERS, id);
        o->workers_full_said = 1;
        return -1;
    }
    o->workers_full_said = 0; /* said again the next time the table fills */
    orch_worker *w = &o->workers[at];
    *w = (orch_worker){.stage = stage, .job = -1, .alive = 1, .slot = -1, .last_seen = kvm_now_ms()};
    snprintf(w->id, sizeof w->id, "%s", id);
    for (int s = 0; s < o->n_slots; s++)
        if (!strcmp(o->slots[s].id, id)) w->slot = s;
    if (stage >= 0 && w->slot < 0) kvm_orch__log("external %s worker %s joined\n", stage_names[stage], id);
    if (at == o->n_workers) o->n_workers++;
    return at;
}

int kvm_orch__stage_of(kvm_proto_str s)
{
    for (int i = 0; i < N_STAGES; i++)
        if (kvm_proto_str_eq(s, stage_names[i])) return i;
    return -1;
}

/* A process the orchestrator started is gone (or silent): restart it, a bounded number of
 * times; past that the slot is given up and the log says where to look. */
static void slot_died(orch *o, int s)
{
    orch_slot *sl = &o->slots[s];
    if (sl->pid > 0) {
        kill(sl->pid, SIGKILL);
        waitpid(sl->pid, NULL, 0);
        sl->pid = 0;
    }
    if (*o->interrupts || sl->gave_up) return;
    if (sl->respawns >= 2 * o->max_retries + 2) {
        sl->gave_up = 1;
        kvm_orch__log("%s exited %d times; not restarting it (log: %s/%s.log)\n", stage_names[sl->stage],
                      sl->respawns + 1, o->run_dir, sl->id);
        return;
    }
    sl->respawns++;
    sl->retry_at = 0;
    if (spawn_slot(o, s)) { /* was left there: no worker for the stage, and the run waited for ever */
        kvm_orch__log("%s: trying again in 1 s\n", kvm_errmsg());
        sl->retry_at = kvm_now_ms() + 1000;
    }
}

/* Fails every open job when a stage it needs has no worker left: every started one gave
 * up and none joined from outside (a stage with no configured workers waits for external
 * ones). */
static void check_stages_alive(orch *o)
{
    for (int st = 0; st < N_STAGES; st++) {
        int configured = 0, gave_up = 0, alive = 0;
        for (int s = 0; s < o->n_slots; s++)
            if (o->slots[s].stage == st) configured++, gave_up += o->slots[s].gave_up;
        for (int w = 0; w < o->n_workers; w++) /* a refused worker does no work for the stage */
            alive += kvm_orch__worker_counts(o, w) && o->workers[w].stage == st;
        if (configured == 0 || gave_up < configured || alive) continue;
        if (kvm_orch__store_gone_check(o)) return; /* they died of it: pending, not failed */
        const orch_job_state open[4] = {J_QUEUED, J_PREFILL, J_KV_READY, J_COMPRESS};
        for (int b = 0; b < 4; b++)
            for (int64_t i = kvm_joblist_first(&o->lists, open[b]), next; i >= 0; i = next) {
                next = kvm_joblist_next(&o->lists, i);
                orch_job *j = &o->jobs[i];
                o->visited++;
                snprintf(j->reason, sizeof j->reason, "no kvmill-%s worker is left (see the logs in %s)",
                         stage_names[st], o->run_dir);
                kvm_orch__job_drop_kv(j);
                kvm_orch__job_set(o, j, J_FAILED);
            }
        kvm_orch__log("no kvmill-%s worker is left: the remaining documents failed\n", stage_names[st]);
    }
}

/* Takes back the work worker w holds (its job, or the strategy build), the worker itself kept. */
static void take_back_work(orch *o, int w, const char *why)
{
    orch_worker *wk = &o->workers[w];
    if (wk->job >= 0 && w != o->reduce_worker) {
        orch_job *j = &o->jobs[wk->job];
        char msg[400];
        snprintf(msg, sizeof msg, "worker %s %s", wk->id, why);
        kvm_orch__requeue(o, j, msg);
    }
    if (w == o->reduce_worker) { /* the strategy build goes back to waiting for a orch_worker */
        for (int64_t i = kvm_joblist_first(&o->lists, J_COMPRESS), next; i >= 0; i = next) {
            next = kvm_joblist_next(&o->lists, i);
            o->jobs[i].worker = -1, kvm_orch__job_set(o, &o->jobs[i], J_KV_READY);
        }
        o->reduce_worker = -1;
    }
    wk->job = -1;
}

void kvm_orch__worker_dead(orch *o, int w, const char *why)
{
    orch_worker *wk = &o->workers[w];
    if (!wk->alive) return;
    wk->alive = 0;
    wk->idle = 0;
    kvm_orch__log("worker %s %s\n", wk->id, why);
    take_back_work(o, w, why);
    if (wk->slot >= 0) {
        wk->ended = 1; /* killed (or exited): its heartbeats and credits still queued here are stale */
        slot_died(o, wk->slot);
        wk->slot = -1;
    }
}

void kvm_orch__worker_process(orch *o, int w, int64_t pid, uint64_t instance)
{
    orch_worker *wk = &o->workers[w];
    char why[200];
    if (!kvm_stage_new_process(&wk->ctl_pid, &wk->ctl_instance, pid, instance, "its work", why, sizeof why) ||
        (wk->job < 0 && w != o->reduce_worker))
        return;
    kvm_orch__log("worker %s %s: its work is taken back\n", wk->id, why);
    take_back_work(o, w, why);
}

/* 1 when child pid (> 0) has exited, its status into *st (reaped). By pid, never waitpid(-1):
 * that reaps any child of the process, one a program embedding the orchestrator started as
 * well, whose own waitpid then found no child and lost its exit status. */
static int child_exited(pid_t pid, int *st) { return pid > 0 && waitpid(pid, st, WNOHANG) == pid; }

/* Slot s's stage process exited with status st: its worker is dead, or it never joined. */
static void slot_exited(orch *o, int s, int st)
{
    o->slots[s].pid = 0;
    int registered = 0;
    for (int w = 0; w < o->n_workers; w++)
        if (o->workers[w].slot == s && o->workers[w].alive) {
            char why[128];
            snprintf(why, sizeof why, "exited (%s %d)", WIFSIGNALED(st) ? "signal" : "status",
                     WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            kvm_orch__worker_dead(o, w, why);
            registered = 1;
        }
    if (!registered) { /* died before it ever reported */
        kvm_orch__log("%s exited with %s %d before joining\n", o->slots[s].id, WIFSIGNALED(st) ? "signal" : "status",
                      WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
        slot_died(o, s);
    }
}

/* 1 when the worker slot s started has joined (sent ready) and is alive. */
static int slot_joined(const orch *o, int s)
{
    for (int w = 0; w < o->n_workers; w++)
        if (o->workers[w].slot == s && o->workers[w].alive) return 1;
    return 0;
}

/* A stage process that runs but never joins (hung loading its model, connected elsewhere) was
 * never named: the run waited with fewer workers, or at "0/N documents". */
static void check_joins(orch *o, double now)
{
    for (int s = 0; s < o->n_slots; s++) {
        orch_slot *sl = &o->slots[s];
        if (sl->pid <= 0 || sl->join_state == 2) continue;
        char what[64], log[2400];
        snprintf(what, sizeof what, "%s worker", stage_names[sl->stage]);
        snprintf(log, sizeof log, "Its log: %s/%s.log", o->run_dir, sl->id);
        const kvm_spawn_worker w = {what, sl->id, sl->pid, sl->started_ms, o->base, log};
        kvm_spawn_join_check(&w, slot_joined(o, s), (double)kvm_config_int(o->cfg, "run", "join_warn_s"), now,
                             &sl->join_state);
    }
}

int kvm_orch__worker_counts(const orch *o, int w)
{
    return o->workers[w].alive && !o->workers[w].refused && !o->workers[w].store_refused;
}

/* Sends refused worker w the error that stops it (once it got through). Its first credit may come
 * on the data socket before the control socket's connection is up, when the control socket does
 * not know its routing id yet (EHOSTUNREACH): the next ready tries again. */
static void tell_refused(orch *o, int w)
{
    orch_worker *wk = &o->workers[w];
    char gh[65], wh[65], why[1200];
    kvm_store_id_hex(&wk->other_model, gh);
    kvm_store_id_hex(&o->model_id, wh);
    snprintf(why, sizeof why,
             "this %s's model is %s (%s), this worker runs model %s: start it with the run's model (without "
             "--model, or --model naming the same file)",
             o->cmd, wh, kvm_config_str(o->cfg, "model", "path"), gh);
    wk->told_ms = kvm_stage_send_refusal(o->ctl, wk->id, o->cmd, why) == 0 ? kvm_now_ms() : 0;
}

/* Worker w's ready named model got, not the run's: its work would be wrong (a prefill worker's KV
 * would be compressed and stored under the run's model id), so it is refused, once. */
static void refuse_worker(orch *o, int w, const uint8_t *got, int64_t pid)
{
    orch_worker *wk = &o->workers[w];
    memcpy(wk->other_model.b, got, sizeof wk->other_model.b);
    wk->refused_pid = pid;
    char gh[65], wh[65];
    kvm_store_id_hex(&wk->other_model, gh);
    kvm_store_id_hex(&o->model_id, wh);
    const char *path = kvm_config_str(o->cfg, "model", "path"), *stage = wk->stage >= 0 ? stage_names[wk->stage] : "a";
    kvm_log_field f[] = {KVM_LOG_S("worker", wk->id), KVM_LOG_S("worker_model_id", gh), KVM_LOG_S("model_id", wh),
                         KVM_LOG_S("model", path)};
    kvm_log(KVM_LOG_ERROR, "worker_refused", f, 4,
            "%s worker %s runs model %.12s… but this %s's model is %.12s… (%s): refused, no jobs go to it%s", stage,
            wk->id, gh, o->cmd, wh, path,
            wk->slot >= 0 ? " (started by this run: the model file changed since the run started?)" : "");
    wk->refused = 1;
    wk->told_ms = 0;
    wk->idle = 0;
    /* its job goes back to the queue; a process of this run is restarted (bounded: slot_died) */
    if (wk->job >= 0 || w == o->reduce_worker || wk->slot >= 0)
        kvm_orch__worker_dead(o, w, "was refused (another model)");
}

int kvm_orch__worker_refused(orch *o, int w, const kvm_proto_ready *r, int first)
{
    orch_worker *wk = &o->workers[w];
    if (kvm_orch__store_refused(o, w, r, first)) return 1;
    if (first) kvm_stage_judge_first(r, wk->refused, wk->other_model.b, &wk->refused_pid, &wk->refused_ctl_seen);
    kvm_stage_verdict v = kvm_stage_judge_ready(r, o->model_id.b, wk->refused, wk->refused_pid);
    if (v == KVM_STAGE_ACCEPT_AGAIN) {
        wk->refused = 0;
        kvm_log(KVM_LOG_INFO, "worker_accepted", (kvm_log_field[]){KVM_LOG_S("worker", wk->id)}, 1,
                "worker %s, refused before, is accepted now (%s)", wk->id,
                r->has_model_id ? "it names the run's model" : "a new process that names no model");
    }
    if (v != KVM_STAGE_OTHER_MODEL) return wk->refused;
    if (!wk->refused || r->pid != wk->refused_pid) {
        refuse_worker(o, w, r->model_id, r->pid);
        wk->refused_ctl_seen = first;
    }
    if (wk->refused && kvm_stage_tell_again(wk->told_ms, kvm_now_ms())) tell_refused(o, w);
    return 1;
}

int kvm_orch__model_changed(orch *o, const char *msg, size_t n)
{
    if (o->model_changed[0]) return 1;
    char theirs[13];
    if (!kvm_worker_other_model_hex(msg, n, theirs)) return 0;
    const char *path = kvm_config_str(o->cfg, "model", "path");
    kvm_store_id now;
    if (o->store ? kvm_store_model_id(o->store, path, &now) : kvm_store_hash_file(path, &now)) return 0;
    char was[65], is[65];
    kvm_store_id_hex(&o->model_id, was);
    kvm_store_id_hex(&now, is);
    /* the worker loaded what the run's path holds now: not a file of its own host */
    if (!memcmp(now.b, o->model_id.b, sizeof now.b) || memcmp(is, theirs, 12)) return 0;
    snprintf(o->model_changed, sizeof o->model_changed,
             "the model file %s changed since this %s began (model %.12s... then, %.12s... now): its workers "
             "load other weights than the %s's; run again",
             path, o->cmd, was, is, o->cmd);
    kvm_log_field f[] = {KVM_LOG_S("model", path), KVM_LOG_S("model_id", was), KVM_LOG_S("now_model_id", is)};
    kvm_log(KVM_LOG_ERROR, "model_changed", f, 3, "%s: the documents not in a worker fail", o->model_changed);
    const orch_job_state waiting[2] = {J_QUEUED, J_KV_READY};
    for (int b = 0; b < 2; b++)
        for (int64_t i = kvm_joblist_first(&o->lists, waiting[b]), next; i >= 0; i = next) {
            next = kvm_joblist_next(&o->lists, i);
            orch_job *j = &o->jobs[i];
            o->visited++;
            snprintf(j->reason, sizeof j->reason, "%s", o->model_changed);
            kvm_orch__job_drop_kv(j);
            kvm_orch__job_set(o, j, J_FAILED);
        }
    return 1;
}

void kvm_orch__resumed(orch *o, double gap_ms, double now)
{
    kvm_log_field f[] = {KVM_LOG_I("gap_ms", (int64_t)gap_ms)};
    kvm_log(KVM_LOG_WARN, "run_resumed", f, 1,
            "this %s's loop did not run for %.1f s (stopped, suspended, or in a slow call): the workers' heartbeats "
            "are judged from now",
            o->cmd, gap_ms / 1000.0);
    /* without this, every worker's last heartbeat seen was older than dead_ms: each was declared
     * silent, killed and restarted, its job requeued, though the orchestrator was the one away */
    for (int w = 0; w < o->n_workers; w++)
        if (o->workers[w].alive && o->workers[w].last_seen < now) o->workers[w].last_seen = now;
    /* the claims: renewed at the next chance (last_renew), and a store service that does not
     * answer that one renewal at once is not taken for down by the pause's length (renewed_ok);
     * claims that lapsed meanwhile may have been taken by another run, which then compresses
     * those documents too (counted by both: the store keeps one cache). Not when its renewals
     * failed already before the gap: the outage is older than the pause, and the gap may be the
     * loop's own calls waiting for that service (a run looking again at documents left to other
     * runs, the service gone): taken for pauses, they kept it from being judged down for ever */
    o->last_renew = 0;
    if (!o->renew_failing && o->renewed_ok < now) o->renewed_ok = now;
    const orch_job_state busy[2] = {J_PREFILL, J_COMPRESS}; /* their workers went on meanwhile */
    for (int b = 0; b < 2; b++)
        for (int64_t i = kvm_joblist_first(&o->lists, busy[b]); i >= 0; i = kvm_joblist_next(&o->lists, i)) {
            o->visited++;
            o->jobs[i].since_ms += gap_ms;
        }
}

void kvm_orch__check_health(orch *o)
{
    double now = kvm_now_ms();
    kvm_orch__store_gone_check(o);
    /* one loop iteration takes ~100 ms: a gap of half the workers' dead time since the last
     * check means this process was stopped (kill -STOP, Ctrl-Z, a suspended VM) or busy, not
     * reading the heartbeats, which are still queued (a poll that resumes returns at once; a stop
     * may also come inside the receive before this check): judged from now, not from before.
     * The claims' lease can be shorter than the dead time (it is at most 24 h, kvm_orch__claim_ttl):
     * a pause of half of it went unseen, so renewed_ok kept its age and the first renewal failure
     * of a store service after it abandoned the run as if the service were down. */
    /* at least 2.5 loops: a loop's own length is no pause (a dead time of 200 ms took each for one) */
    const double ttl = (double)kvm_orch__claim_ttl(o), half = (ttl < o->dead_ms ? ttl : o->dead_ms) / 2,
                 resumed_gap = half > 250 ? half : 250;
    if (o->last_health > 0 && now - o->last_health > resumed_gap) kvm_orch__resumed(o, now - o->last_health, now);
    o->last_health = now;
    int st;
    if (child_exited(o->svc.pid, &st)) { /* workers retry their uploads meanwhile */
        o->svc.pid = 0;
        kvm_log_field f[] = {KVM_LOG_S("bind", o->svc.bind), KVM_LOG_I("restarts", o->svc.restarts + 1)};
        kvm_log(KVM_LOG_WARN, "store_service_restart", f, 2, "the store service exited (%s %d): starting it again",
                WIFSIGNALED(st) ? "signal" : "status", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
        run_dir_usable(o); /* its log, run_dir/store.log, goes there */
        if (o->svc.restarts >= 20 || kvm_svcproc_restart(&o->svc, 10000))
            kvm_orch__log("the store service cannot be restarted (%s): uploads from other hosts fail\n",
                          o->svc.restarts >= 20 ? "it died 20 times" : kvm_errmsg());
    }
    for (int s = 0; s < o->n_slots; s++) /* slot_died may start a slot again: its new pid is not looked at */
        if (child_exited(o->slots[s].pid, &st)) slot_exited(o, s, st);
    for (int s = 0; s < o->n_slots; s++) /* a restart that failed (its log's folder gone, no more processes) */
        if (o->slots[s].pid == 0 && o->slots[s].retry_at > 0 && now >= o->slots[s].retry_at) slot_died(o, s);
    check_stages_alive(o);
    if (!*o->interrupts) check_joins(o, now);
    for (int w = 0; w < o->n_workers; w++)
        if (o->workers[w].alive && now - o->workers[w].last_seen > o->dead_ms) /* a refused one exits, as told */
            kvm_orch__worker_dead(o, w,
                                  o->workers[w].refused || o->workers[w].store_refused ? "is gone (it was refused)"
                                                                                       : "went silent");
    const orch_job_state busy[2] = {J_PREFILL, J_COMPRESS};
    for (int b = 0; b < 2; b++) /* each list is oldest first: the first job not timed out ends it */
        for (int64_t i = kvm_joblist_first(&o->lists, busy[b]), next; i >= 0; i = next) {
            next = kvm_joblist_next(&o->lists, i);
            o->visited++;
            if (now - o->jobs[i].since_ms <= o->job_timeout_ms) break;
            kvm_orch__requeue(o, &o->jobs[i], "timed out");
        }
}

/* The stages this run starts authenticate to a keyed ([run] bind off-host) orchestrator with
 * [security] client_public_key / client_secret_key: without them, with a mixed-up pair or with
 * a key its authorized_keys does not list, each was refused at its handshake and the run waited
 * for ever at "0/N documents", saying nothing. Refused before any stage starts (exit 2). */
static int check_stage_keys(orch *o)
{
    if (kvm_curve_is_local(o->base)) return 0;
    const char *need[3] = {"server_public_key", "client_public_key", "client_secret_key"};
    for (int i = 0; i < 3; i++)
        if (!*kvm_config_str(o->cfg, "security", need[i]))
            return kvm_err(KVM_EINVAL,
                           "[run] bind %s is not local, so it uses CurveZMQ: the stages this run starts need "
                           "[security] %s (a key pair from kvmill keygen whose .public is in authorized_keys, and "
                           "the server's public key)",
                           o->base, need[i]);
    const char *cpk = kvm_config_str(o->cfg, "security", "client_public_key");
    int rc = kvm_curve_check_client_pair(kvm_config_str(o->cfg, "security", "client_secret_key"), cpk);
    if (!rc) rc = kvm_curve_check_authorized(cpk, kvm_config_str(o->cfg, "security", "authorized_keys"));
    if (rc == KVM_EMISMATCH || rc == KVM_EFORMAT || rc == KVM_ENOTFOUND)
        return kvm_err(KVM_EINVAL, "[security] client_public_key (the key of the stages this run starts): %s",
                       kvm_errmsg());
    return rc;
}

int kvm_orch__start_stages(orch *o)
{
    int any = 0;
    const char *keys[N_STAGES][2] = {{"prefill_workers", "prefill_devices"},
                                     {"compress_workers", "compress_devices"},
                                     {"signals_workers", "prefill_devices"},
                                     {"strategy_workers", "compress_devices"}};
    for (int st = 0; st < N_STAGES; st++) {
        if ((o->mode == MODE_RUN) != (st == ST_PREFILL || st == ST_COMPRESS)) continue;
        int64_t n = kvm_config_int(o->cfg, "stages", keys[st][0]);
        char key[64];
        snprintf(key, sizeof key, "[stages] %s", keys[st][1]);
        int rc = n > 0 ? kvm_stage_check_devices(key, kvm_config_str(o->cfg, "stages", keys[st][1])) : 0;
        if (rc) return rc;
        if (n == 0)
            kvm_orch__log(
                "[stages] %s = 0: waiting for kvmill-%s workers started by hand (kvmill-%s --connect %s ...)\n",
                keys[st][0], stage_names[st], stage_names[st], o->base);
        any += n > 0;
    }
    int krc = any ? check_stage_keys(o) : 0;
    if (krc) return krc;
    for (int st = 0; st < N_STAGES; st++) {
        if ((o->mode == MODE_RUN) != (st == ST_PREFILL || st == ST_COMPRESS)) continue;
        char exe[2048];
        snprintf(exe, sizeof exe, "%s/kvmill-%s", o->bin_dir, stage_names[st]);
        int64_t n = kvm_config_int(o->cfg, "stages", keys[st][0]);
        if (n > 0 && access(exe, X_OK) != 0)
            return kvm_err(KVM_EINVAL,
                           "stage binary %s is missing or not executable (build with make, or set [stages] bin_dir)",
                           exe);
        const char *devs = kvm_config_str(o->cfg, "stages", keys[st][1]);
        for (int64_t i = 0; i < n; i++) {
            if (o->n_slots == MAX_WORKERS) return kvm_err(KVM_EINVAL, "too many workers (at most %d)", MAX_WORKERS);
            orch_slot *sl = &o->slots[o->n_slots];
            *sl = (orch_slot){.stage = st};
            kvm_stage_device_at(devs, i, sl->device, sizeof sl->device); /* the i-th device, cycling */
            int rc = spawn_slot(o, o->n_slots++);
            if (rc) return rc;
        }
    }
    return 0;
}
