/* kvm_serve_slots.c: the serving broker's decode worker processes: starting them, the health
 * checks (exits, silence, restarts, request timeouts, the ready line) and the shutdown that lets
 * them finish what they hold. */
#include "pipeline/kvm_serve_int.h"
#include "common/kvm_error.h"
#include "pipeline/kvm_spawn.h"
#include "pipeline/kvm_stage.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

/* ---- processes ---- */

int kvm_serve__spawn_slot(srv *s, int i)
{
    srv_slot *sl = &s->slots[i];
    char exe[2048], hb[32], grace[32], threads[32], ppid[32], dev[64];
    snprintf(exe, sizeof exe, "%s/kvmill-decode", s->bin_dir);
    kvm_stage_device_at(kvm_config_str(s->cfg, "serve", "devices"), i, dev, sizeof dev); /* [serve] devices, cycled */
    snprintf(ppid, sizeof ppid, "%ld", (long)getpid()); /* a worker outliving a kill -9 of serve stops */
    snprintf(sl->id, sizeof sl->id, "decode-%d-r%d-%d", i, sl->respawns, (int)getpid());
    snprintf(hb, sizeof hb, "%lld", (long long)kvm_config_int(s->cfg, "run", "heartbeat_ms"));
    snprintf(grace, sizeof grace, "%lld", (long long)kvm_config_int(s->cfg, "run", "grace_s"));
    snprintf(threads, sizeof threads, "%lld", (long long)kvm_config_int(s->cfg, "stages", "threads"));
    /* clang-format off */
    char *argv[28] = {exe,       "--connect",   s->base,     "--config", (char *)s->o->config_path,
                      "--store", s->store_path, "--threads", threads,    "--heartbeat-ms",
                      hb,        "--grace-s",   grace,       "--id",     sl->id, "--parent-pid", ppid,
                      "--device", dev};
    /* clang-format on */
    int n = 19;
    if (s->backend_curve) n += kvm_spawn_curve_args(&argv[n], s->cfg);
    argv[n] = NULL;
    /* SIGTERM too: the broker stops its workers with it, after a start that ignored it */
    const kvm_spawn_opts so = {NULL, KVM_SPAWN_DEFAULT_SIGINT | KVM_SPAWN_DEFAULT_SIGTERM, NULL};
    int rc = kvm_spawn_start(&sl->pid, exe, argv, &so);
    sl->respawn_at = 0;
    sl->started_ms = kvm_now_ms();
    sl->join_state = 0;
    return rc;
}

static void stop_children(srv *s, int sig)
{
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].pid > 0) kill(s->slots[i].pid, sig);
}

/* 1 when child pid (> 0) has exited, its status into *st (reaped). By pid, never waitpid(-1):
 * that reaps any child of the process, one a program embedding the server started as well,
 * whose own waitpid then found no child and lost its exit status. */
static int child_exited(pid_t pid, int *st) { return pid > 0 && waitpid(pid, st, WNOHANG) == pid; }

/* Slot i's process exited with status st: its worker is dead, or it never connected. */
static void slot_exited(srv *s, int i, int st, double now)
{
    s->slots[i].pid = 0;
    char why[128];
    snprintf(why, sizeof why, "exited (%s %d)", WIFSIGNALED(st) ? "signal" : "status",
             WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    int found = 0;
    for (int w = 0; w < s->n_workers; w++)
        if (s->workers[w].slot == i) kvm_serve__worker_dead(s, w, why), found = 1;
    if (!found && !*s->interrupts) { /* died before it ever said ready */
        kvm_serve__log("decode worker %s %s before connecting", s->slots[i].id, why);
        s->slots[i].respawn_at = now + 1000;
        s->slots[i].respawns++;
        if (++s->slots[i].early_exits >= MAX_EARLY_EXITS) s->fatal = 1;
    }
}

/* Queued request i is past [serve] request_timeout_s: its client gets an error answer saying
 * what it waited for: a free decode worker, or (held: kvm_serve__doc_holder) the request that
 * computes its document's cache, which a worker may be free for all along. */
static void queue_timeout(srv *s, int64_t i)
{
    const int holder = kvm_serve__doc_holder(s, &s->queue[i]);
    srv_request r = s->queue[i];
    kvm_serve__queue_remove(s, i);
    char why[400];
    if (holder >= 0) {
        char name[80];
        kvm_serve__doc_name(&r.doc, name);
        snprintf(why, sizeof why,
                 "timed out waiting for request %llu, which computes this document's cache (%s), to store it "
                 "([serve] request_timeout_s); once stored it answers at once: ask again",
                 (unsigned long long)s->workers[holder].request_id, name);
    } else {
        int usable = 0, refused = 0; /* a client told only "no free worker" cannot see that some were refused */
        for (int w = 0; w < s->n_workers; w++)
            if (s->workers[w].alive) s->workers[w].refused ? refused++ : usable++;
        snprintf(why, sizeof why, "timed out waiting for a free decode worker ([serve] request_timeout_s)%s",
                 !usable && refused ? ": the only workers connected run another model and were refused (the server's "
                                      "log names them)"
                                    : "");
    }
    kvm_serve__log("request %llu %s", (unsigned long long)r.request_id, why);
    kvm_serve__reply_error(s, &r.env, r.request_id, KVM_EIO, why);
    kvm_msg_free(&r.msg);
}

/* 1 when the worker slot i started has joined (sent ready) and is alive. */
static int slot_joined(const srv *s, int i)
{
    for (int w = 0; w < s->n_workers; w++)
        if (s->workers[w].slot == i && s->workers[w].alive) return 1;
    return 0;
}

/* A worker process that runs but never joins (hung loading its model, connected to another
 * endpoint) was never named: the server just had fewer workers. Its output goes to this
 * server's stderr. */
static void check_joins(srv *s, double now)
{
    for (int i = 0; i < s->n_slots; i++) {
        srv_slot *sl = &s->slots[i];
        if (sl->pid <= 0 || sl->join_state == 2) continue;
        const kvm_spawn_worker w = {"decode worker", sl->id,  sl->pid,
                                    sl->started_ms,  s->base, "Its messages are in this server's log"};
        kvm_spawn_join_check(&w, slot_joined(s, i), (double)kvm_config_int(s->cfg, "run", "join_warn_s"), now,
                             &sl->join_state);
    }
}

void kvm_serve__check_health(srv *s)
{
    double now = kvm_now_ms();
    int st;
    if (child_exited(s->svc.pid, &st)) {
        s->svc.pid = 0;
        kvm_serve__log("the store service exited (%s %d): starting it again", WIFSIGNALED(st) ? "signal" : "status",
                       WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
        if (s->svc.restarts >= 20 || kvm_svcproc_restart(&s->svc, 10000))
            kvm_serve__log("the store service cannot be restarted: %s",
                           s->svc.restarts >= 20 ? "it died 20 times" : kvm_errmsg());
    }
    for (int i = 0; i < s->n_slots; i++)
        if (child_exited(s->slots[i].pid, &st)) slot_exited(s, i, st, now);
    for (int w = 0; w < s->n_workers; w++)
        if ((s->workers[w].alive || s->workers[w].busy) && now - s->workers[w].last_seen > s->dead_ms)
            kvm_serve__worker_dead(s, w, "went silent");
    if (!*s->interrupts) check_joins(s, now);
    for (int i = 0; i < s->n_slots && !*s->interrupts; i++)
        if (s->slots[i].pid == 0 && s->slots[i].respawn_at > 0 && now >= s->slots[i].respawn_at &&
            kvm_serve__spawn_slot(s, i))
            kvm_serve__log("%s", kvm_errmsg());
    /* requests past their deadline, queued or in flight */
    for (int64_t i = 0; i < s->n_queue;) {
        if (now - s->queue[i].t_recv > s->timeout_ms)
            queue_timeout(s, i);
        else
            i++;
    }
    for (int w = 0; w < s->n_workers; w++) {
        srv_worker *wk = &s->workers[w];
        /* from the request's arrival, as for queued ones: counted from its hand-over a request
         * that had queued could wait up to twice request_timeout_s for its error answer, past
         * the client's own timeout (kvmill ask's default is 90 s against the default 60) */
        if (wk->busy && wk->env && now - wk->t_recv > s->timeout_ms) {
            kvm_serve__log("request %llu timed out on worker %s (%.1f s after it arrived, %.1f s on the worker)",
                           (unsigned long long)wk->request_id, wk->id, (now - wk->t_recv) / 1000,
                           (now - wk->t_sent) / 1000);
            char why[200];
            snprintf(why, sizeof why,
                     "the decode worker did not answer in time ([serve] request_timeout_s: %.1f s after the request "
                     "arrived, %.1f s of them in the queue)",
                     (now - wk->t_recv) / 1000, (wk->t_sent - wk->t_recv) / 1000);
            kvm_serve__reply_error(s, &wk->env, wk->request_id, KVM_EIO, why);
        }
    }
    if (!s->announced) {
        int up = 0;
        for (int w = 0; w < s->n_workers; w++)
            up += s->workers[w].alive && s->workers[w].slot >= 0;
        if (up >= s->n_slots) {
            s->announced = 1;
            kvm_serve__log("ready: front end %s, %d decode worker(s), back end %s", s->front_ep, up, s->base);
        }
    }
}

/* During the drain: a worker silent past [run] liveness (stopped, hung) cannot finish what it
 * holds, so its request is answered with the error now and its process killed; the stop waited
 * the whole grace_s + 2 s for it (32 s by default), saying nothing. */
static void drain_silent(srv *s)
{
    const double now = kvm_now_ms();
    for (int w = 0; w < s->n_workers; w++) {
        srv_worker *wk = &s->workers[w];
        if (!(wk->alive || wk->busy) || now - wk->last_seen <= s->dead_ms) continue;
        const int slot = wk->slot;   /* worker_dead forgets it, and kills nothing while stopping */
        if (slot < 0 && !wk->busy) { /* a worker of another host that stopped and left: no word */
            wk->alive = wk->idle = 0;
            continue;
        }
        kvm_serve__worker_dead(s, w, slot >= 0 ? "went silent during the stop: killed" : "went silent during the stop");
        if (slot >= 0 && s->slots[slot].pid > 0) kill(s->slots[slot].pid, SIGKILL);
    }
}

/* Lets the workers finish what they hold (relaying their answers), then stops them. */
void kvm_serve__shutdown_workers(srv *s, int hard)
{
    stop_children(s, hard ? SIGKILL : SIGTERM);
    double end = kvm_now_ms() + (hard ? 200 : 1000.0 * (double)kvm_config_int(s->cfg, "run", "grace_s") + 2000);
    for (;;) {
        int left = 0;
        for (int i = 0; i < s->n_slots; i++) {
            if (s->slots[i].pid <= 0) continue;
            if (!kvm_spawn_reaped(&s->slots[i].pid)) {
                left++;
                continue;
            }
            for (int w = 0; w < s->n_workers; w++) /* it stopped: no silence of it to judge */
                if (s->workers[w].slot == i) {
                    if (s->workers[w].busy) kvm_serve__worker_dead(s, w, "exited during the stop");
                    s->workers[w].alive = s->workers[w].idle = 0;
                    s->workers[w].slot = -1;
                }
        }
        if (!left || *s->interrupts >= 2) break;
        drain_silent(s);
        if (kvm_now_ms() > end) {
            stop_children(s, SIGKILL);
            break;
        }
        /* the front end too: a request that came now waited unread for the whole drain and was
         * then closed away unanswered (kvm_serve__receive_front answers it at once) */
        zmq_pollitem_t items[3] = {
            {s->ctl, 0, ZMQ_POLLIN, 0}, {s->data, 0, ZMQ_POLLIN, 0}, {s->front, 0, ZMQ_POLLIN, 0}};
        zmq_poll(items, s->front ? 3 : 2, 50);
        if (items[0].revents & ZMQ_POLLIN) kvm_serve__receive_back(s, s->ctl, 1);
        if (items[1].revents & ZMQ_POLLIN) kvm_serve__receive_back(s, s->data, 0);
        if (items[2].revents & ZMQ_POLLIN) kvm_serve__receive_front(s);
    }
    if (s->front) kvm_serve__receive_front(s); /* those that came since the last poll */
    stop_children(s, SIGKILL);
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].pid > 0) waitpid(s->slots[i].pid, NULL, 0), s->slots[i].pid = 0;
    /* whoever still waits gets told */
    for (int w = 0; w < s->n_workers; w++)
        if (s->workers[w].busy && s->workers[w].env)
            kvm_serve__reply_error(s, &s->workers[w].env, s->workers[w].request_id, KVM_ESTATE,
                                   "server stopped before answering");
    while (s->n_queue > 0) {
        srv_request r = s->queue[0];
        kvm_serve__queue_remove(s, 0);
        kvm_serve__reply_error(s, &r.env, r.request_id, KVM_ESTATE, "server stopped before answering");
        kvm_msg_free(&r.msg);
    }
}
