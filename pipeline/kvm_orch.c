/* kvm_orch.c: the orchestrator: sockets, stage processes, the job table and the broker
 * loop. One thread; every wait is a zmq_poll with a short timeout so heartbeats, timeouts
 * and signals are handled within ~100 ms. */
#include "pipeline/kvm_orch.h"
#include "pipeline/kvm_orch_metrics.h"
#include "pipeline/kvm_orch_remote.h"
#include "pipeline/kvm_svcproc.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_idxset.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_joblist.h"
#include "pipeline/kvm_orch_progress.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storew.h"
#include "pipeline/kvm_worker.h"
#include "model/kvm_utf8.h"
#include "proto/kvm_proto.h"
#include "store/kvm_store.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

extern char **environ;

enum { ST_PREFILL = 0, ST_COMPRESS = 1, ST_SIGNALS = 2, ST_STRATEGY = 3, N_STAGES = 4, MAX_WORKERS = 256 };
static const char *const stage_names[N_STAGES] = {"prefill", "compress", "signals", "strategy"};

/* What the run does: compress a corpus (prefill -> compress), or calibrate PolyKV
 * (signals per document, then one strategy build over all of them). */
enum { MODE_RUN = 0, MODE_CALIBRATE = 1 };

typedef enum job_state { J_QUEUED, J_PREFILL, J_KV_READY, J_COMPRESS, J_DONE, J_FAILED, J_SKIPPED, N_JOB_STATES } job_state;

typedef struct job {
    kvm_doc *doc;
    job_state state;
    uint64_t id;          /* id of the current attempt (unique in the run) */
    int attempt;
    int worker;           /* index in workers[] while in prefill/compress, else -1 */
    double since_ms;      /* entered the current state */
    kvm_msg **kv;         /* [n_layers] buffered kv messages of the current attempt */
    int64_t prog_done, prog_total; /* progress its compress worker last reported (heartbeat) */
    int n_kv;
    int claimed;          /* this run holds the document's claim in the store */
    char reason[512];     /* why it failed */
} job;

typedef struct worker {
    char id[256];
    int stage;            /* ST_* or -1 until known */
    double last_seen;
    int idle;             /* has sent a credit and holds no job */
    int job;              /* index in jobs[] or -1 */
    int alive;
    int slot;             /* spawned slot, or -1 for an external worker */
} worker;

typedef struct slot {
    int stage;
    char device[64];
    pid_t pid;
    int respawns;
    int gave_up;          /* exited too often: not restarted any more */
    char id[256];
} slot;

typedef struct orch {
    const kvm_config *cfg;
    kvm_corpus *corpus;
    job *jobs;
    int64_t n_jobs, n_open;
    kvm_idxset by_hash;     /* jobs by document hash: the first of each set of identical documents */
    kvm_idxset by_id;       /* jobs by attempt id (a requeue adds the new one; stale ones do not match) */
    kvm_joblist lists;      /* jobs by state, each list in the order jobs entered it (job_move) */
    int64_t visited;        /* jobs the current loop iteration looked at (scheduling, health, draining) */
    int64_t visited_max;    /* the most of any iteration: independent of the corpus size (metrics) */
    uint64_t next_id;
    worker workers[MAX_WORKERS];
    int n_workers;
    slot slots[MAX_WORKERS];
    int n_slots;
    void *zctx, *ctl, *data;
    char base[1024], run_dir[1024], bin_dir[1024], store_path[4096];
    int64_t compress_results; /* results received from compress workers */
    kvm_store_id model_id, config_id; /* the caches this run writes */
    kvm_store_id tok_id;      /* tokenizer the stages record in their manifests */
    kvm_store *store;         /* the store (claims, the "stored meanwhile?" check) */
    kvm_storecli *cli;        /* or, with [store] path an endpoint, the store service (kvm_orch_remote.h) */
    char owner[192], host[64]; /* this run's claims: kvm_storew_owner */
    double last_renew;        /* when the claims were last renewed, ms */
    int renew_failing;        /* the last renewal failed (said once) */
    double renewed_ok;        /* when the claims were last renewed with success (or the run began), ms */
    int64_t abandoned;        /* jobs in workers given up when the store service was found down */
    int mode;                 /* MODE_RUN or MODE_CALIBRATE */
    uint64_t reduce_id;       /* calibrate: id of the strategy build request */
    int reduce_worker;        /* calibrate: strategy worker holding it, or -1 */
    int own_run_dir;     /* created by this run: removed at the end unless something failed */
    int n_layers;
    int64_t kv_heads;         /* layers x KV heads of the model, from prefill's kv messages: a full cache's
                                 entries per token (0 until one came) */
    double hb_ms, dead_ms, job_timeout_ms;
    int max_retries;
    int store_full;           /* the store takes no more caches (full, or its service does not answer): no
                                 more documents are fed */
    int64_t evicted0;         /* the store's eviction count when the run started */
    kvm_orch_summary *sum;
    double t0;
    kvm_orch_progress prog;   /* the progress line */
    double last_metrics;      /* when the metrics file was last written, ms */
    kvm_svcproc svc;          /* the store service started for remote workers ([store] service_bind) */
    int metrics_failed;       /* a metrics write failed (said once) */
} orch;

typedef struct job_by_id_probe {
    const orch *o;
    uint64_t id;
} job_by_id_probe;

static volatile sig_atomic_t interrupts;
static const char *orch_cmd = "run"; /* "run" or "calibrate", for messages */

/* A line on stderr prefixed with the command: "kvmill run: ..." */
static void orch_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void orch_log(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvm_logv(KVM_LOG_INFO, "message", NULL, 0, fmt, ap);
    va_end(ap);
}
static void on_sigint(int s) { (void)s; interrupts++; }

/* ---- processes ---- */

static int spawn_slot(orch *o, int s)
{
    slot *sl = &o->slots[s];
    char exe[2048], hb[32], grace[32], threads[32], logp[2048], ppid[32];
    snprintf(exe, sizeof exe, "%s/kvmill-%s", o->bin_dir, stage_names[sl->stage]);
    snprintf(sl->id, sizeof sl->id, "%s-%d-r%d", stage_names[sl->stage], s, sl->respawns);
    snprintf(hb, sizeof hb, "%lld", (long long)kvm_config_int(o->cfg, "run", "heartbeat_ms"));
    snprintf(grace, sizeof grace, "%lld", (long long)kvm_config_int(o->cfg, "run", "grace_s"));
    snprintf(threads, sizeof threads, "%lld", (long long)kvm_config_int(o->cfg, "stages", "threads"));
    snprintf(logp, sizeof logp, "%s/%s.log", o->run_dir, sl->id);
    snprintf(ppid, sizeof ppid, "%ld", (long)getpid());
    char *argv[] = {exe, "--connect", o->base, "--device", sl->device, "--store", o->store_path, "--threads", threads,
                    "--heartbeat-ms", hb, "--grace-s", grace, "--id", sl->id, "--parent-pid", ppid, NULL, NULL, NULL,
                    NULL, NULL, NULL, NULL};
    /* a keyed orchestrator ([run] bind off-host: kvm_serve_bind uses CurveZMQ only there): its
     * own stages authenticate like external ones, and use the same keys for the store service */
    const char *spk = kvm_config_str(o->cfg, "security", "server_public_key");
    char **k = &argv[17];
    if (*spk && !kvm_curve_is_local(o->base)) {
        k[0] = "--server-key", k[1] = (char *)spk;
        k[2] = "--client-public", k[3] = (char *)kvm_config_str(o->cfg, "security", "client_public_key");
        k[4] = "--client-secret", k[5] = (char *)kvm_config_str(o->cfg, "security", "client_secret_key");
    } else if (*spk && o->cli && sl->stage == ST_COMPRESS) {
        /* a local bind with a remote store: the keys are the store service's only; the worker
         * reads them from the config ([security]), and connects to this run in the clear */
        k[0] = "--config", k[1] = (char *)kvm_config_path(o->cfg);
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, logp, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, logp, O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawnattr_t at;
    posix_spawnattr_init(&at);
    sigset_t def;
    sigemptyset(&def);
    sigaddset(&def, SIGINT);
    posix_spawnattr_setsigdefault(&at, &def);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP); /* Ctrl-C reaches us only */
    int rc = posix_spawn(&sl->pid, exe, &fa, &at, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    if (rc) {
        sl->pid = 0;
        return kvm_err(KVM_EIO, "cannot start %s: %s", exe, strerror(rc));
    }
    return 0;
}

static int find_slot_by_pid(orch *o, pid_t pid)
{
    for (int s = 0; s < o->n_slots; s++)
        if (o->slots[s].pid == pid) return s;
    return -1;
}

static void stop_children(orch *o, int sig)
{
    for (int s = 0; s < o->n_slots; s++)
        if (o->slots[s].pid > 0) kill(o->slots[s].pid, sig);
}

/* Waits up to ms for every child to exit; SIGKILLs the rest. */
static void reap_all(orch *o, double ms)
{
    double end = kvm_now_ms() + ms;
    for (;;) {
        int left = 0;
        for (int s = 0; s < o->n_slots; s++) {
            if (o->slots[s].pid <= 0) continue;
            if (waitpid(o->slots[s].pid, NULL, WNOHANG) == o->slots[s].pid) o->slots[s].pid = 0;
            else left++;
        }
        if (!left) return;
        if (kvm_now_ms() > end) {
            stop_children(o, SIGKILL);
            for (int s = 0; s < o->n_slots; s++)
                if (o->slots[s].pid > 0) waitpid(o->slots[s].pid, NULL, 0), o->slots[s].pid = 0;
            return;
        }
        usleep(20000);
    }
}

/* ---- jobs ---- */

static void job_drop_kv(job *j)
{
    for (int i = 0; i < j->n_kv; i++) kvm_msg_free(&j->kv[i]);
    j->n_kv = 0;
}

/* Sets a job's state and moves it to that state's list: at the back, so the lists of jobs in
 * workers are in the order they were sent (oldest first: timeouts stop at the first that has
 * not timed out); a job back in the queue goes to its front (it was sent before every job still
 * queued, as the corpus order has it). */
static void job_move(orch *o, job *j, job_state s)
{
    j->state = s;
    kvm_joblist_move(&o->lists, j - o->jobs, s, s == J_QUEUED);
}

static void job_set(orch *o, job *j, job_state s)
{
    if ((j->state == J_DONE || j->state == J_FAILED) != (s == J_DONE || s == J_FAILED)) o->n_open--;
    job_move(o, j, s);
    j->since_ms = kvm_now_ms();
    /* a document's tokens live only while it is in a worker or waiting for compress */
    if (o->corpus->on_demand && (s == J_QUEUED || s == J_DONE || s == J_FAILED)) kvm_doc_release(j->doc);
}

/* Tokens after the context a job carries: [eval] continuation for the KL evaluation (and
 * calibration), twice that for [compress] target_kl (a search part and a check part). */
static int64_t continuation_tokens(const orch *o)
{
    int64_t t = kvm_config_int(o->cfg, "eval", "continuation");
    if (o->mode == MODE_CALIBRATE) return t;
    if (kvm_config_float(o->cfg, "compress", "target_kl") > 0) return 2 * t;
    return kvm_config_bool(o->cfg, "eval", "enabled") ? t : 0;
}

/* Loads an on-demand document's tokens (a no-op for prepared ones). A document that cannot
 * be loaded fails alone, with the reason. Returns 0 when its tokens are there. */
static int job_load(orch *o, job *j)
{
    if (!o->corpus->on_demand || j->doc->tokens) return 0;
    const kvm_corpus *c = o->corpus;
    int64_t ctx = kvm_config_int(o->cfg, "model", "context");
    int64_t keep = ctx + continuation_tokens(o);
    if (kvm_corpus_load(c, j->doc, c->tok, c->vocab_size, c->bos, ctx, keep) == 0) return 0;
    snprintf(j->reason, sizeof j->reason, "%s", kvm_errmsg());
    orch_log("%s: not processed\n", j->reason);
    job_set(o, j, J_FAILED);
    return -1;
}

/* Puts a job back in the queue (a new attempt), or fails it after max_retries. */
static void requeue(orch *o, job *j, const char *why)
{
    if (j->worker >= 0) {
        o->workers[j->worker].job = -1;
        j->worker = -1;
    }
    job_drop_kv(j);
    j->attempt++;
    if (j->attempt > o->max_retries) {
        snprintf(j->reason, sizeof j->reason, "%s (after %d attempts)", why, j->attempt);
        job_set(o, j, J_FAILED);
        kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id), KVM_LOG_S("reason", j->reason)};
        kvm_log(KVM_LOG_ERROR, "job_failed", f, 3, "%s failed: %s", j->doc->name, j->reason);
        return;
    }
    o->sum->requeues++;
    kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id), KVM_LOG_I("attempt", j->attempt + 1),
                         KVM_LOG_S("reason", why)};
    kvm_log(KVM_LOG_WARN, "job_requeued", f, 4, "requeueing %s (attempt %d): %s", j->doc->name, j->attempt + 1, why);
    j->id = o->next_id++;
    if (kvm_idxset_add(&o->by_id, j->id, j - o->jobs)) { /* its messages could not be found */
        snprintf(j->reason, sizeof j->reason, "%s (then: %s)", why, kvm_errmsg());
        job_set(o, j, J_FAILED);
        return;
    }
    job_set(o, j, J_QUEUED);
}

/* Why the store takes no more caches (store_mark). */
enum { STORE_DEVICE_FULL = 0, STORE_DOWN = 1, STORE_MAP_FULL = 2 };

/* The store takes no more caches: its device is full, its map reached [store] map_max_mb (no
 * later write can fit either: retrying each document would only fail again), or (a run whose
 * store is the store service) the service does not answer, so every upload and claim would
 * wait out its timeouts. Said once; no more documents are fed. */
static void store_mark(orch *o, const char *why, int kind)
{
    static const char *const what[3] = {
        "no space left on the store's device: feeding no more documents (free space on it and run again: stored ones "
        "are skipped)",
        "the store service does not answer: feeding no more documents (start it and run again: stored ones are "
        "skipped)",
        "the store's map is full at [store] map_max_mb: feeding no more documents (raise map_max_mb, or set [store] "
        "cap_mb so that old caches make room, and run again: stored ones are skipped)"};
    if (!o->store_full) orch_log("%s\nkvmill %s: %s\n", why, orch_cmd, what[kind]);
    o->store_full = 1;
    if (kind == STORE_DOWN) o->sum->store_down = 1;
    else o->sum->store_full = kind == STORE_MAP_FULL ? 2 : 1;
}

/* store_mark, and job j goes back to the queue (not an attempt: it is not the document's
 * fault). */
static void store_stop(orch *o, job *j, const char *why, int kind)
{
    store_mark(o, why, kind);
    if (j->worker >= 0) o->workers[j->worker].job = -1;
    j->worker = -1;
    job_drop_kv(j);
    job_set(o, j, J_QUEUED);
}

/* The claims' renewals have had no reply for longer than the lease (a run whose store is the
 * store service): the claims have lapsed and the uploads of the jobs in workers would each wait
 * out 3 x [store] upload_timeout_ms, so the store is down now. The jobs in workers are
 * abandoned (counted not processed; their workers are stopped at the end without the grace
 * period) and no more documents are fed. */
static void store_abandon(orch *o, const char *why)
{
    store_mark(o, why, STORE_DOWN);
    const job_state busy[2] = {J_PREFILL, J_COMPRESS};
    for (int b = 0; b < 2; b++)
        for (int64_t i = kvm_joblist_first(&o->lists, busy[b]), next; i >= 0; i = next) {
            next = kvm_joblist_next(&o->lists, i);
            o->visited++;
            store_stop(o, &o->jobs[i], why, STORE_DOWN);
            o->abandoned++;
        }
}

/* A job id looked up in o->by_id: the job's current attempt, not a skipped one. */
static int same_id(void *user, int64_t idx)
{
    const job_by_id_probe *p = user;
    return p->o->jobs[idx].id == p->id && p->o->jobs[idx].state != J_SKIPPED;
}

/* The job whose current attempt is id, or NULL (a stale attempt, a skipped job, not ours). */
static job *job_by_id(orch *o, uint64_t id)
{
    job_by_id_probe p = {o, id};
    int64_t i = kvm_idxset_find(&o->by_id, id, same_id, &p);
    return i >= 0 ? &o->jobs[i] : NULL;
}

/* ---- workers ---- */

static int worker_get(orch *o, const kvm_frame *idf, int stage)
{
    char id[256];
    size_t n = idf->size < sizeof id - 1 ? idf->size : sizeof id - 1;
    memcpy(id, idf->data, n);
    id[n] = '\0';
    for (int w = 0; w < o->n_workers; w++)
        if (!strcmp(o->workers[w].id, id)) {
            if (o->workers[w].stage < 0) o->workers[w].stage = stage;
            return w;
        }
    if (o->n_workers == MAX_WORKERS) return -1;
    worker *w = &o->workers[o->n_workers];
    *w = (worker){.stage = stage, .job = -1, .alive = 1, .slot = -1, .last_seen = kvm_now_ms()};
    snprintf(w->id, sizeof w->id, "%s", id);
    for (int s = 0; s < o->n_slots; s++)
        if (!strcmp(o->slots[s].id, id)) w->slot = s;
    if (stage >= 0 && w->slot < 0) orch_log("external %s worker %s joined\n", stage_names[stage], id);
    return o->n_workers++;
}

static int stage_of(kvm_proto_str s)
{
    for (int i = 0; i < N_STAGES; i++)
        if (kvm_proto_str_eq(s, stage_names[i])) return i;
    return -1;
}

/* A process the orchestrator started is gone (or silent): restart it, a bounded number of
 * times; past that the slot is given up and the log says where to look. */
static void slot_died(orch *o, int s)
{
    slot *sl = &o->slots[s];
    if (sl->pid > 0) {
        kill(sl->pid, SIGKILL);
        waitpid(sl->pid, NULL, 0);
        sl->pid = 0;
    }
    if (interrupts || sl->gave_up) return;
    if (sl->respawns >= 2 * o->max_retries + 2) {
        sl->gave_up = 1;
        orch_log("%s exited %d times; not restarting it (log: %s/%s.log)\n", stage_names[sl->stage],
                sl->respawns + 1, o->run_dir, sl->id);
        return;
    }
    sl->respawns++;
    if (spawn_slot(o, s)) orch_log("%s\n", kvm_errmsg());
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
        for (int w = 0; w < o->n_workers; w++) alive += o->workers[w].alive && o->workers[w].stage == st;
        if (configured == 0 || gave_up < configured || alive) continue;
        const job_state open[4] = {J_QUEUED, J_PREFILL, J_KV_READY, J_COMPRESS};
        for (int b = 0; b < 4; b++)
            for (int64_t i = kvm_joblist_first(&o->lists, open[b]), next; i >= 0; i = next) {
                next = kvm_joblist_next(&o->lists, i);
                job *j = &o->jobs[i];
                o->visited++;
                snprintf(j->reason, sizeof j->reason, "no kvmill-%s worker is left (see the logs in %s)", stage_names[st],
                         o->run_dir);
                job_drop_kv(j);
                job_set(o, j, J_FAILED);
            }
        orch_log("no kvmill-%s worker is left: the remaining documents failed\n", stage_names[st]);
    }
}

static void worker_dead(orch *o, int w, const char *why)
{
    worker *wk = &o->workers[w];
    if (!wk->alive) return;
    wk->alive = 0;
    wk->idle = 0;
    orch_log("worker %s %s\n", wk->id, why);
    if (wk->job >= 0 && w != o->reduce_worker) {
        job *j = &o->jobs[wk->job];
        char msg[400];
        snprintf(msg, sizeof msg, "worker %s %s", wk->id, why);
        requeue(o, j, msg);
    }
    if (w == o->reduce_worker) { /* the strategy build goes back to waiting for a worker */
        for (int64_t i = kvm_joblist_first(&o->lists, J_COMPRESS), next; i >= 0; i = next) {
            next = kvm_joblist_next(&o->lists, i);
            o->jobs[i].worker = -1, job_set(o, &o->jobs[i], J_KV_READY);
        }
        o->reduce_worker = -1;
    }
    wk->job = -1;
    if (wk->slot >= 0) {
        slot_died(o, wk->slot);
        wk->slot = -1;
    }
}

/* ---- messages ---- */

/* Bytes of a message's frames (routing ids excluded): what it costs on the wire, give or
 * take ZeroMQ's few bytes of framing per part. */
static int64_t msg_bytes(const kvm_msg *m)
{
    int64_t n = 0;
    for (size_t f = 0; f < kvm_msg_nframes(m); f++) n += (int64_t)kvm_msg_frame(m, f).size;
    return n;
}

/* Sends m (taken) to worker `id` on the data socket, counting its bytes as sent. */
static int send_to(orch *o, const char *id, kvm_msg **m)
{
    kvm_msg *env = NULL;
    if (*m) o->sum->wire_out_bytes += msg_bytes(*m);
    void *sock = o->data;
    int rc = kvm_msg_new(&env);
    if (!rc) rc = kvm_msg_add_copy(env, id, strlen(id));
    if (!rc) rc = kvm_msg_join(env, m);
    if (!rc) rc = kvm_msg_send(sock, &env, 0);
    kvm_msg_free(&env);
    kvm_msg_free(m);
    return rc;
}

static int job_message(orch *o, job *j, kvm_msg **out)
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
    kvm_proto_job pj = {.job_id = j->id, .attempt = j->attempt, .doc_id = wname,
                        .doc_name = wname, .n_ctx = kvm_config_int(o->cfg, "model", "context"),
                        .n_tokens = j->doc->n_tokens, .tokens = j->doc->tokens, .settings = mp, .settings_bytes = n};
    if (continuation_tokens(o) > 0) { /* held-out continuation */
        int64_t t = continuation_tokens(o), avail = j->doc->n_original - j->doc->n_tokens;
        pj.n_continuation = t < avail ? t : avail;
        pj.continuation = pj.n_continuation > 0 ? j->doc->tokens + j->doc->n_tokens : NULL;
    }
    rc = kvm_proto_job_encode(&pj, out);
    free(mp);
    free(wire);
    return rc;
}

static void on_ctl(orch *o, kvm_msg *m, const kvm_frame *idf)
{
    kvm_proto_type t;
    if (kvm_proto_peek(m, &t)) {
        orch_log("dropped a malformed control message: %s\n", kvm_errmsg());
        return;
    }
    if (t == KVM_PROTO_READY || t == KVM_PROTO_HEARTBEAT || t == KVM_PROTO_ACK) {
        kvm_proto_ctl c;
        int rc = t == KVM_PROTO_READY ? kvm_proto_ready_decode(m, &c)
                 : t == KVM_PROTO_HEARTBEAT ? kvm_proto_heartbeat_decode(m, &c) : kvm_proto_ack_decode(m, &c);
        if (rc) { orch_log("dropped a bad %s: %s\n", kvm_proto_type_name(t), kvm_errmsg()); return; }
        int w = worker_get(o, idf, stage_of(c.stage));
        if (w < 0) return;
        o->workers[w].last_seen = kvm_now_ms();
        o->workers[w].alive = 1;
        if (t == KVM_PROTO_HEARTBEAT && c.job_id && c.progress_total > 0) {
            job *hj = job_by_id(o, c.job_id);
            if (hj && hj->state == J_COMPRESS && hj->worker == w)
                hj->prog_done = (int64_t)c.progress_done, hj->prog_total = (int64_t)c.progress_total;
        }
        if (t == KVM_PROTO_ACK && o->mode == MODE_CALIBRATE && c.job_id == o->reduce_id && o->reduce_worker == w) {
            for (int64_t i = kvm_joblist_first(&o->lists, J_COMPRESS), next; i >= 0; i = next) {
                next = kvm_joblist_next(&o->lists, i);
                o->jobs[i].worker = -1;
                job_set(o, &o->jobs[i], J_DONE);
                o->sum->compressed++;
                o->sum->truncated += o->jobs[i].doc->truncated;
                o->sum->tokens += o->jobs[i].doc->n_tokens;
            }
            o->workers[w].job = -1;
            o->reduce_worker = -1;
            return;
        }
        if (t == KVM_PROTO_ACK) {
            job *j = job_by_id(o, c.job_id);
            if (o->mode == MODE_RUN) o->sum->store_commits++;
            if (j && j->state == J_COMPRESS && kvm_log_format_get() == KVM_LOG_JSON) { /* text: the progress line says it */
                kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id),
                                     KVM_LOG_S("worker", o->workers[w].id), KVM_LOG_I("tokens", j->doc->n_tokens)};
                kvm_log(KVM_LOG_INFO, "job_done", f, 4, "%s committed by %s", j->doc->name, o->workers[w].id);
            }
            if (j && j->state == J_COMPRESS) {
                if (j->worker >= 0) o->workers[j->worker].job = -1;
                j->worker = -1;
                job_set(o, j, J_DONE);
                o->sum->compressed++;
                o->sum->truncated += j->doc->truncated; /* of the documents compressed: not skipped or left ones */
                o->sum->tokens += j->doc->n_tokens;
            }
        }
        return;
    }
    if (t == KVM_PROTO_RESULT || t == KVM_PROTO_ERROR) {
        kvm_proto_result r;
        if ((t == KVM_PROTO_RESULT ? kvm_proto_result_decode(m, &r) : kvm_proto_error_decode(m, &r))) {
            orch_log("dropped a bad %s: %s\n", kvm_proto_type_name(t), kvm_errmsg());
            return;
        }
        int st = stage_of(r.stage);
        if (t == KVM_PROTO_RESULT && st >= 0) o->sum->stage_ms[st] += r.compute_ms;
        if (t == KVM_PROTO_RESULT && st == ST_COMPRESS) o->compress_results++;
        if (t == KVM_PROTO_RESULT) o->sum->transport_ms += r.transport_ms, o->sum->store_ms += r.store_ms;
        if (t == KVM_PROTO_RESULT && r.evaluated) {
            o->sum->evaluated++;
            o->sum->kl_sum += r.kl_mean;
        }
        job *j = job_by_id(o, r.job_id);
        if (t == KVM_PROTO_ERROR && j && (j->state == J_PREFILL || j->state == J_COMPRESS)) {
            char why[600];
            snprintf(why, sizeof why, "%.*s stage: %.*s", (int)r.stage.len, r.stage.ptr, (int)r.message.len, r.message.ptr);
            if (r.status == KVM_EFULL && strstr(why, "no space left on the store's device"))
                store_stop(o, j, why, STORE_DEVICE_FULL);
            else if (r.status == KVM_EFULL && strstr(why, "map full at")) store_stop(o, j, why, STORE_MAP_FULL);
            else if (o->cli && r.status == KVM_EIO && strstr(why, "store service")) store_stop(o, j, why, STORE_DOWN);
            else if (r.retryable) requeue(o, j, why);
            else {
                if (j->worker >= 0) o->workers[j->worker].job = -1;
                j->worker = -1;
                snprintf(j->reason, sizeof j->reason, "%s", why);
                job_set(o, j, J_FAILED);
                kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id), KVM_LOG_S("reason", why)};
                kvm_log(KVM_LOG_ERROR, "job_failed", f, 3, "%s failed: %s", j->doc->name, why);
            }
        }
        return;
    }
    orch_log("dropped an unexpected %s on the control socket\n", kvm_proto_type_name(t));
}

static void on_data(orch *o, kvm_msg *m, const kvm_frame *idf)
{
    kvm_proto_type t;
    if (kvm_proto_peek(m, &t)) {
        orch_log("dropped a malformed data message: %s\n", kvm_errmsg());
        return;
    }
    if (t == KVM_PROTO_READY) {
        kvm_proto_ready c;
        if (kvm_proto_ready_decode(m, &c)) return;
        int w = worker_get(o, idf, stage_of(c.stage));
        if (w < 0) return;
        worker *wk = &o->workers[w];
        wk->last_seen = kvm_now_ms();
        wk->alive = 1;
        if (wk->job < 0) wk->idle = 1;
        return;
    }
    if (t == KVM_PROTO_STATS && o->mode == MODE_CALIBRATE) {
        kvm_proto_stats sm;
        if (kvm_proto_stats_decode(m, &sm)) {
            kvm_log(KVM_LOG_WARN, "message", NULL, 0, "dropped a bad stats message: %s", kvm_errmsg());
            return;
        }
        job *j = job_by_id(o, sm.job_id);
        if (!j || j->state != J_PREFILL) return; /* stale attempt */
        kvm_msg *copy = NULL;
        if (!j->kv && !(j->kv = calloc(1, sizeof *j->kv))) return;
        if (kvm_msg_new(&copy)) return;
        for (size_t f = 0; f < kvm_msg_nframes(m); f++) {
            kvm_frame fr = kvm_msg_frame(m, f);
            if (kvm_msg_add_copy(copy, fr.data, fr.size)) break;
        }
        j->kv[0] = copy;
        j->n_kv = 1;
        if (j->worker >= 0) o->workers[j->worker].job = -1;
        j->worker = -1;
        job_set(o, j, J_KV_READY);
        return;
    }
    if (t != KVM_PROTO_KV || o->mode != MODE_RUN) {
        orch_log("dropped an unexpected %s on the data socket\n", kvm_proto_type_name(t));
        return;
    }
    kvm_proto_kv kv;
    if (kvm_proto_kv_decode(m, &kv)) {
        orch_log("dropped a bad kv message: %s\n", kvm_errmsg());
        return;
    }
    job *j = job_by_id(o, kv.job_id);
    if (!j || j->state != J_PREFILL || kv.layer != j->n_kv || kv.n_layers > 4096) return; /* stale attempt */
    o->kv_heads = kv.n_layers * kv.n_kv_heads;
    if (!j->kv && !(j->kv = calloc((size_t)kv.n_layers, sizeof *j->kv))) return;
    j->kv[j->n_kv++] = NULL;
    kvm_msg *copy = NULL;
    if (kvm_msg_new(&copy) == 0) {
        for (size_t f = 0; f < kvm_msg_nframes(m); f++) {
            kvm_frame fr = kvm_msg_frame(m, f);
            if (kvm_msg_add_copy(copy, fr.data, fr.size)) break;
        }
    }
    j->kv[j->n_kv - 1] = copy;
    if (j->n_kv == kv.n_layers) {
        if (j->worker >= 0) o->workers[j->worker].job = -1;
        j->worker = -1;
        job_set(o, j, J_KV_READY);
    }
}

static void receive(orch *o, void *sock, int is_ctl)
{
    for (int k = 0; k < 1000; k++) {
        kvm_msg *m = NULL, *env = NULL;
        if (kvm_msg_recv(sock, &m, ZMQ_DONTWAIT)) return;
        if (kvm_msg_nframes(m) >= 2 && kvm_msg_split(m, 1, &env) == 0) {
            kvm_frame idf = kvm_msg_frame(env, 0);
            if (is_ctl) on_ctl(o, m, &idf);
            else {
                o->sum->wire_in_bytes += msg_bytes(m);
                on_data(o, m, &idf);
            }
        }
        kvm_msg_free(&env);
        kvm_msg_free(&m);
    }
}

/* ---- scheduling ---- */

static int idle_worker(orch *o, int stage)
{
    for (int w = 0; w < o->n_workers; w++)
        if (o->workers[w].alive && o->workers[w].idle && o->workers[w].job < 0 && o->workers[w].stage == stage) return w;
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
    if (kvm_joblist_count(l, J_QUEUED) + kvm_joblist_count(l, J_PREFILL) + kvm_joblist_count(l, J_COMPRESS) +
            kvm_joblist_count(l, J_DONE) > 0)
        return; /* signals still running (or the build is sent) */
    int64_t ready = kvm_joblist_count(l, J_KV_READY);
    int w = ready > 0 && o->reduce_worker < 0 ? idle_worker(o, ST_STRATEGY) : -1;
    if (w < 0) return;
    job req = {.doc = NULL, .id = o->reduce_id = o->next_id++};
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
        job *j = &o->jobs[i];
        kvm_msg *jm = NULL;
        rc = job_message(o, j, &jm) || send_to(o, o->workers[w].id, &jm) || send_copy(o, o->workers[w].id, j->kv[0]);
        if (!rc) j->worker = w, job_set(o, j, J_COMPRESS);
    }
    if (rc) {
        kvm_log(KVM_LOG_ERROR, "message", NULL, 0, "could not send the strategy build: %s", kvm_errmsg());
        return;
    }
    o->workers[w].idle = 0;
    o->workers[w].job = 0;
    o->reduce_worker = w;
}

/* The claim through the store service: its reply says taken, held (by holder) or stored. */
static int claim_remote(orch *o, const kvm_store_cache_key *key, int *taken, int *found, kvm_store_claim *holder)
{
    kvm_storecli_claim_state st;
    kvm_storecli_claim_info info;
    int rc = kvm_storecli_claim(o->cli, key, &o->tok_id, o->owner, o->host, (int64_t)o->dead_ms, 0,
                                kvm_orch_remote_timeout_ms(o->cfg), 2, &st, &info);
    if (rc) return rc;
    *taken = st == KVM_STORECLI_TAKEN;
    *found = st == KVM_STORECLI_STORED;
    *holder = info.holder;
    return 0;
}

/* A document another live run is compressing is left to it (counted as claimed) and one
 * stored meanwhile is skipped; else this run claims it (a lease renewed in the loop).
 * Returns 1 when j is not to be sent. */
static int claim_job(orch *o, job *j)
{
    if (j->claimed || (!o->store && !o->cli) || o->mode != MODE_RUN) return 0;
    kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = j->doc->hash, .config_id = o->config_id};
    kvm_store_claim holder;
    int taken = 0, found = 0;
    int rc = o->cli ? claim_remote(o, &key, &taken, &found, &holder)
                    : kvm_storew_claim(o->store, &key, o->owner, o->host, (int64_t)o->dead_ms, &taken, &holder);
    if (rc == KVM_EIO && o->cli) { /* no reply: its upload would get none either */
        store_stop(o, j, kvm_errmsg(), STORE_DOWN);
        return 1;
    }
    if (rc) {
        orch_log("could not claim %s (%s): compressing it anyway\n", j->doc->name, kvm_errmsg());
        taken = 1;
        found = 0;
    }
    if (!o->cli && kvm_store_has_cache(o->store, &key, &o->tok_id, &found)) found = 0;
    if (!o->cli && found) { /* stored: only when its layers pass their checksums, as in cache_stored (a
                             * corrupt cache found before the run would be skipped here otherwise) */
        kvm_store_cache *c = NULL;
        if (kvm_store_get_cache(o->store, &key, &o->tok_id, &c)) found = 0;
        kvm_store_cache_free(&c);
    }
    if (found || !taken) {
        if (!found) orch_log("%s is being compressed by %s on %s: left to it\n", j->doc->name, holder.owner, holder.host);
        job_move(o, j, J_SKIPPED);
        o->n_open--;
        if (found) o->sum->skipped++;
        else o->sum->claimed++;
        return 1;
    }
    j->claimed = 1;
    return 0;
}


/* The prefetch bound: documents prefilled (or in prefill) but not yet taken by a compress
 * worker. [run] max_prefetch, or 0 = 2 per live compress worker. A prefill dispatch takes
 * one credit; handing the KV to compress (or a failure, or a requeue) gives it back. */
static int64_t prefetch_limit(const orch *o)
{
    int64_t n = kvm_config_int(o->cfg, "run", "max_prefetch");
    if (n > 0) return n;
    for (int w = 0; w < o->n_workers; w++) n += o->workers[w].alive && o->workers[w].stage == ST_COMPRESS;
    return 2 * n;
}

static int64_t prefetch_used(const orch *o)
{
    return kvm_joblist_count(&o->lists, J_PREFILL) + kvm_joblist_count(&o->lists, J_KV_READY);
}

/* A queued document to a prefill (run) or signals (calibrate) worker, if one is idle.
 * Returns 1 when it was sent. */
static int dispatch_first(orch *o, job *j, int64_t i)
{
    int w = idle_worker(o, o->mode == MODE_CALIBRATE ? ST_SIGNALS : ST_PREFILL);
    if (w < 0 || claim_job(o, j) || job_load(o, j)) return 0; /* claim first: a document left to another run is not read */
    kvm_msg *m = NULL;
    if (job_message(o, j, &m) || send_to(o, o->workers[w].id, &m)) {
        requeue(o, j, kvm_errmsg());
        return 0;
    }
    o->workers[w].idle = 0;
    o->workers[w].job = (int)i;
    j->worker = w;
    job_set(o, j, J_PREFILL);
    return 1;
}

/* A prefilled document's job and KV to an idle compress worker. */
static void dispatch_compress(orch *o, job *j, int64_t i)
{
    int w = idle_worker(o, ST_COMPRESS);
    if (w < 0) return;
    kvm_msg *m = NULL;
    int rc = job_message(o, j, &m) || send_to(o, o->workers[w].id, &m);
    for (int l = 0; !rc && l < j->n_kv; l++) rc = send_to(o, o->workers[w].id, &j->kv[l]);
    job_drop_kv(j);
    if (rc) {
        requeue(o, j, "could not send the job to a compress worker");
        return;
    }
    o->workers[w].idle = 0;
    o->workers[w].job = (int)i;
    j->worker = w;
    j->prog_done = j->prog_total = 0;
    job_set(o, j, J_COMPRESS);
}

/* After a Ctrl-C, or once the store's device is full, nothing new goes to a worker: only
 * the jobs in workers finish. */
static void dispatch(orch *o)
{
    if (interrupts || o->store_full) return;
    if (o->mode == MODE_CALIBRATE) dispatch_reduce(o);
    /* compress first: it returns prefetch credits; each job tried leaves the list (sent, or
     * requeued), so this ends */
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

static void check_health(orch *o)
{
    double now = kvm_now_ms();
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        if (o->svc.pid > 0 && pid == o->svc.pid) { /* workers retry their uploads meanwhile */
            o->svc.pid = 0;
            kvm_log_field f[] = {KVM_LOG_S("bind", o->svc.bind), KVM_LOG_I("restarts", o->svc.restarts + 1)};
            kvm_log(KVM_LOG_WARN, "store_service_restart", f, 2, "the store service exited (%s %d): starting it again",
                    WIFSIGNALED(st) ? "signal" : "status", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            if (o->svc.restarts >= 20 || kvm_svcproc_restart(&o->svc, 10000))
                orch_log("the store service cannot be restarted (%s): uploads from other hosts fail\n",
                         o->svc.restarts >= 20 ? "it died 20 times" : kvm_errmsg());
            continue;
        }
        int s = find_slot_by_pid(o, pid);
        if (s < 0) continue;
        o->slots[s].pid = 0;
        int registered = 0;
        for (int w = 0; w < o->n_workers; w++)
            if (o->workers[w].slot == s && o->workers[w].alive) {
                char why[128];
                snprintf(why, sizeof why, "exited (%s %d)", WIFSIGNALED(st) ? "signal" : "status",
                         WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
                worker_dead(o, w, why);
                registered = 1;
            }
        if (!registered) { /* died before it ever reported */
            orch_log("%s exited with %s %d before joining\n", o->slots[s].id,
                    WIFSIGNALED(st) ? "signal" : "status", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            slot_died(o, s);
        }
    }
    check_stages_alive(o);
    for (int w = 0; w < o->n_workers; w++)
        if (o->workers[w].alive && now - o->workers[w].last_seen > o->dead_ms) worker_dead(o, w, "went silent");
    const job_state busy[2] = {J_PREFILL, J_COMPRESS};
    for (int b = 0; b < 2; b++) /* each list is oldest first: the first job not timed out ends it */
        for (int64_t i = kvm_joblist_first(&o->lists, busy[b]), next; i >= 0; i = next) {
            next = kvm_joblist_next(&o->lists, i);
            o->visited++;
            if (now - o->jobs[i].since_ms <= o->job_timeout_ms) break;
            requeue(o, &o->jobs[i], "timed out");
        }
}

/* ---- progress ---- */

/* Within-document progress of the jobs in compress, e.g. " doc_003.txt 45/90" (problems
 * solved), into buf; empty when no worker reports any. */
static void inflight_progress(const orch *o, char *buf, size_t n)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int64_t i = kvm_joblist_first(&o->lists, J_COMPRESS); i >= 0 && at + 1 < n; i = kvm_joblist_next(&o->lists, i)) {
        const job *j = &o->jobs[i];
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
        orch_log("%s\n", kvm_errmsg());
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
        if ((rc = kvm_serve_bind(o->zctx, socks[i], eps[i], o->cfg, 0, *bind ? "[run] bind" : "run directory endpoint")))
            return rc;
    }
    return 0;
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

static int start_stages(orch *o)
{
    int any = 0;
    const char *keys[N_STAGES][2] = {{"prefill_workers", "prefill_devices"}, {"compress_workers", "compress_devices"},
                                     {"signals_workers", "prefill_devices"}, {"strategy_workers", "compress_devices"}};
    for (int st = 0; st < N_STAGES; st++) {
        if ((o->mode == MODE_RUN) != (st == ST_PREFILL || st == ST_COMPRESS)) continue;
        int64_t n = kvm_config_int(o->cfg, "stages", keys[st][0]);
        char key[64];
        snprintf(key, sizeof key, "[stages] %s", keys[st][1]);
        int rc = n > 0 ? kvm_stage_check_devices(key, kvm_config_str(o->cfg, "stages", keys[st][1])) : 0;
        if (rc) return rc;
        if (n == 0)
            orch_log("[stages] %s = 0: waiting for kvmill-%s workers started by hand (kvmill-%s --connect %s ...)\n",
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
            return kvm_err(KVM_EINVAL, "stage binary %s is missing or not executable (build with make, or set [stages] bin_dir)", exe);
        const char *devs = kvm_config_str(o->cfg, "stages", keys[st][1]);
        for (int64_t i = 0; i < n; i++) {
            if (o->n_slots == MAX_WORKERS) return kvm_err(KVM_EINVAL, "too many workers (at most %d)", MAX_WORKERS);
            slot *sl = &o->slots[o->n_slots];
            *sl = (slot){.stage = st};
            kvm_stage_device_at(devs, i, sl->device, sizeof sl->device); /* the i-th device, cycling */
            int rc = spawn_slot(o, o->n_slots++);
            if (rc) return rc;
        }
    }
    return 0;
}

/* A document hash looked up in o->by_hash. */
typedef struct hash_probe {
    const orch *o;
    const kvm_store_id *hash;
} hash_probe;

static int same_hash(void *user, int64_t idx)
{
    const hash_probe *p = user;
    return !memcmp(&p->o->jobs[idx].doc->hash, p->hash, sizeof *p->hash);
}

static uint64_t hash_key(const kvm_store_id *h)
{
    uint64_t k;
    memcpy(&k, h->b, sizeof k); /* BLAKE2b bytes: any 8 are uniform */
    return k;
}

static int sum_bytes(const kvm_store_cache_key *key, const kvm_store_manifest *m, int status, void *arg)
{
    orch *o = arg;
    if (status || memcmp(&key->model_id, &o->model_id, sizeof o->model_id) ||
        memcmp(&key->config_id, &o->config_id, sizeof o->config_id))
        return 0;
    hash_probe p = {o, &key->doc_hash};
    int64_t i = kvm_idxset_find(&o->by_hash, hash_key(&key->doc_hash), same_hash, &p); /* only the first is done */
    if (i >= 0 && o->jobs[i].state == J_DONE) {
        o->sum->bytes_full += m->full_bytes;
        o->sum->bytes_compressed += m->stored_bytes;
        if (!o->sum->entries_docs || m->n_entries < o->sum->entries_min) o->sum->entries_min = m->n_entries;
        if (!o->sum->entries_docs || m->n_entries > o->sum->entries_max) o->sum->entries_max = m->n_entries;
        o->sum->entries_sum += m->n_entries;
        o->sum->entries_docs++;
        if (o->kv_heads > 0 && m->n_entries >= m->n_tokens * o->kv_heads) o->sum->kept_full++;
    }
    return 0;
}

/* Whether a document's cache is stored: a stored cache (or manifest) that fails its
 * checksums is a corrupt cache, compressed again (the put replaces it). */
static int cache_stored(orch *o, kvm_store *store, const job *j, int *found)
{
    kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = j->doc->hash, .config_id = o->config_id};
    if (o->cli) { /* the service applies the same rule (kvm_storesvc_claim.h) */
        kvm_storecli_claim_state st;
        int rc = kvm_storecli_claim(o->cli, &key, &o->tok_id, o->owner, o->host, 0, 1, kvm_orch_remote_timeout_ms(o->cfg),
                                    2, &st, NULL);
        *found = !rc && st == KVM_STORECLI_STORED;
        return rc;
    }
    int rc = kvm_store_has_cache(store, &key, &o->tok_id, found);
    if (rc == KVM_EMISMATCH) { /* made from another tokenizer's ids: compressed again (the put replaces it) */
        orch_log("the stored cache of %s is refused (%s): compressing it again\n", j->doc->name, kvm_errmsg());
        *found = 0;
        return 0;
    }
    if (rc == 0 && *found) {
        kvm_store_cache *c = NULL;
        rc = kvm_store_get_cache(store, &key, &o->tok_id, &c);
        kvm_store_cache_free(&c);
    }
    if (rc == KVM_ECORRUPT) {
        orch_log("the stored cache of %s is corrupt (%s): compressing it again\n", j->doc->name, kvm_errmsg());
        *found = 0;
        return 0;
    }
    return rc == KVM_EMISMATCH ? 0 : rc;
}

/* Before the run: each document is loaded (tokenised, hashed) one at a time and released
 * again, so the scan holds no corpus; stored and repeated ones are skipped, unreadable
 * ones fail alone. */
static int mark_skipped(orch *o, kvm_store *store)
{
    for (int64_t i = 0; i < o->n_jobs; i++) {
        job *j = &o->jobs[i];
        if (job_load(o, j)) continue;
        int found = 0, rc = cache_stored(o, store, j, &found);
        if (rc) return rc;
        hash_probe p = {o, &j->doc->hash}; /* the same tokens twice: one cache (a loaded job is never failed here) */
        if (kvm_idxset_find(&o->by_hash, hash_key(&j->doc->hash), same_hash, &p) >= 0) found = 1;
        else if ((rc = kvm_idxset_add(&o->by_hash, hash_key(&j->doc->hash), i))) return rc;
        if (o->corpus->on_demand) kvm_doc_release(j->doc);
        if (found) {
            job_move(o, j, J_SKIPPED);
            o->sum->skipped++;
            o->n_open--;
        }
    }
    return 0;
}

/* Caches the store's cap evicted during the run (by any process), and a warning when some
 * of them were written by this run: a rerun would compress them again. */
static void count_evictions(orch *o, kvm_store *store)
{
    kvm_store_stats ss;
    if (kvm_store_stats_get(store, &ss)) return;
    o->sum->evicted = ss.n_evicted - o->evicted0;
    int64_t own = 0, written = 0;
    for (int64_t i = 0; i < o->n_jobs && o->sum->evicted > 0; i++) {
        if (o->jobs[i].state != J_DONE) continue;
        kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = o->jobs[i].doc->hash, .config_id = o->config_id};
        int found = 1;
        written++;
        if (kvm_store_has_cache(store, &key, &o->tok_id, &found) == 0 && !found) own++;
    }
    o->sum->evicted_own = own;
    if (own > 0)
        orch_log("warning: the store's cap ([store] cap_mb = %lld) evicted %lld of the %lld caches this run wrote; "
                 "raise cap_mb, or every rerun compresses them again\n",
                 (long long)(ss.cap_bytes >> 20), (long long)own, (long long)written);
}

/* The summary's bytes with a remote store: each cache this run wrote, probed on the
 * service (its manifest's sizes). One that is gone was evicted by the store's cap; the
 * store's own eviction counter is not on the wire, so evicted counts this run's only.
 * Returns 1 when the service did not answer (said). */
static int sum_remote(orch *o)
{
    for (int64_t i = 0; i < o->n_jobs; i++) {
        if (o->jobs[i].state != J_DONE) continue;
        kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = o->jobs[i].doc->hash, .config_id = o->config_id};
        kvm_storecli_claim_state st;
        kvm_storecli_claim_info info;
        if (kvm_storecli_claim(o->cli, &key, &o->tok_id, o->owner, o->host, 0, 1, kvm_orch_remote_timeout_ms(o->cfg), 1,
                               &st, &info)) {
            orch_log("could not read the stored sizes: %s\n", kvm_errmsg());
            return 1;
        }
        if (st == KVM_STORECLI_STORED) o->sum->bytes_full += info.full_bytes, o->sum->bytes_compressed += info.stored_bytes;
        else o->sum->evicted++, o->sum->evicted_own++;
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
        if ((rc = mark_skipped(o, NULL)) == KVM_EIO) { /* no reply to the first probe: nothing claimed yet */
            o->sum->store_down = 1;                 /* so the end makes one short release try only */
            return kvm_storecli_rejected(o->cli)
                       ? rc
                       : kvm_err(rc, "%s: is kvmill store serve running and reachable there?", kvm_errmsg());
        }
        if (rc || (rc = bind_sockets(o))) return rc;
        orch_log("store service %s: this run opens no LMDB, its claims and caches go through the service\n",
                 o->store_path);
        return o->n_open > 0 ? start_stages(o) : 0;
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
    if (o->mode == MODE_RUN && (rc = mark_skipped(o, *store))) return rc;
    if ((rc = bind_sockets(o))) return rc;
    const char *sb = kvm_config_str(o->cfg, "store", "service_bind");
    if (o->mode == MODE_RUN && *sb && o->n_open > 0) { /* the store's host serves it to workers on other hosts */
        char log[2200];
        snprintf(log, sizeof log, "%s/store.log", o->run_dir);
        if ((rc = kvm_svcproc_start(&o->svc, o->bin_dir, o->store_path, sb, kvm_config_path(o->cfg), log, 10000))) return rc;
        orch_log("store service on %s (pid %ld, log %s)\n", sb, (long)o->svc.pid, log);
    }
    return o->n_open > 0 ? start_stages(o) : 0;
}

static void loop(orch *o)
{
    int seen_interrupts = 0;
    o->renewed_ok = kvm_now_ms(); /* no claim is older */
    while (o->n_open > 0) {
        if (interrupts != seen_interrupts) {
            seen_interrupts = interrupts;
            if (interrupts == 1) {
                orch_log("\ninterrupted: finishing the jobs in flight (Ctrl-C again to stop now)\n");
                o->sum->interrupted = 1;
            }
            if (interrupts >= 2) return;
        }
        if (interrupts || o->store_full) { /* draining: only the jobs in a worker finish; the rest are left */
            if (kvm_joblist_count(&o->lists, J_PREFILL) + kvm_joblist_count(&o->lists, J_COMPRESS) == 0) return;
        }
        o->visited = 0;
        zmq_pollitem_t items[2] = {{o->ctl, 0, ZMQ_POLLIN, 0}, {o->data, 0, ZMQ_POLLIN, 0}};
        zmq_poll(items, 2, 100);
        double t0 = kvm_now_ms();
        if (items[0].revents & ZMQ_POLLIN) receive(o, o->ctl, 1);
        if (items[1].revents & ZMQ_POLLIN) receive(o, o->data, 0);
        check_health(o);
        dispatch(o);
        if (o->owner[0] && t0 - o->last_renew > o->dead_ms / 4) { /* claims live while the jobs do */
            int rr = o->cli ? kvm_storecli_renew(o->cli, o->owner, (int64_t)o->dead_ms, 0, kvm_orch_remote_timeout_ms(o->cfg) / 4, 1, NULL)
                            : kvm_storew_renew(o->store, o->owner, (int64_t)o->dead_ms);
            if (rr && !o->renew_failing) orch_log("%s (said once until a renewal succeeds)\n", kvm_errmsg());
            else if (!rr && o->renew_failing) orch_log("claims renewed again\n");
            o->renew_failing = rr != 0; /* one line per outage, not one per try (every heartbeat_ms x liveness / 4) */
            o->last_renew = t0;
            if (!rr) o->renewed_ok = t0;
            else if (o->cli && t0 - o->renewed_ok > o->dead_ms) { /* the claims have lapsed: so has the service */
                char why[600];
                snprintf(why, sizeof why, "the store service %s answered no renewal of the claims for %.1f s, more "
                         "than their lease ([run] heartbeat_ms x liveness)", o->store_path, (t0 - o->renewed_ok) / 1000.0);
                store_abandon(o, why);
            }
        }
        o->sum->transport_ms += kvm_now_ms() - t0; /* the broker's own work is all message handling */
        if (o->visited > o->visited_max) o->visited_max = o->visited;
        progress(o, 0);
    }
}

static int orch_main(const kvm_config *cfg, kvm_corpus *corpus, const char *self_path, kvm_orch_summary *sum, int mode);

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
    orch_cmd = mode == MODE_CALIBRATE ? "calibrate" : "run";
    char prefix[64];
    snprintf(prefix, sizeof prefix, "kvmill %s: ", orch_cmd);
    const char *lf = kvm_config_str(cfg, "run", "log_format");
    kvm_log_setup("orchestrator", prefix, lf);
    setenv("KVMILL_LOG_FORMAT", lf, 1); /* the stages it starts log alike */
    memset(sum, 0, sizeof *sum);
    o.cfg = cfg;
    o.corpus = corpus;
    o.sum = sum;
    o.t0 = kvm_now_ms();
    o.prog = (kvm_orch_progress){.cmd = orch_cmd, .tty = isatty(2), .t0_ms = o.t0,
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
        orch_log("out of memory (%lld document%s)\n", (long long)corpus->n, kvm_plural(corpus->n, "", "s"));
        free(o.jobs);
        return 1;
    }
    for (int64_t i = 0; i < corpus->n; i++) {
        o.jobs[i] = (job){.doc = &corpus->docs[i], .state = J_QUEUED, .id = o.next_id++, .worker = -1, .since_ms = o.t0};
        if (kvm_idxset_add(&o.by_id, o.jobs[i].id, i)) {
            orch_log("%s\n", kvm_errmsg());
            kvm_joblist_deinit(&o.lists);
            kvm_idxset_free(&o.by_id);
            free(o.jobs);
            return 1;
        }
    }
    struct sigaction sa = {.sa_handler = on_sigint}, old_int, old_term;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    interrupts = 0;
    kvm_store *store = NULL;
    int rc = prepare(&o, &store), status = 0;
    if (rc) {
        status = rc == KVM_EINVAL || rc == KVM_EFORMAT ? 2 : 1; /* EFORMAT: the store is not one (truncated, foreign) */
        /* a refusal to start (README, "Seeing a run": event "refused"), as the command's own are */
        kvm_log(KVM_LOG_ERROR, status == 2 ? "refused" : "message", NULL, 0, "%s\n", kvm_errmsg());
    } else {
        if (mode == MODE_CALIBRATE) /* calibration measures every document: none is skipped as stored */
            orch_log("%lld calibration document%s, each measured, run directory %s\n", (long long)o.n_jobs,
                     kvm_plural(o.n_jobs, "", "s"), o.run_dir);
        else
            orch_log("%lld document%s (%lld already stored), run directory %s\n", (long long)o.n_jobs,
                     kvm_plural(o.n_jobs, "", "s"),
                     (long long)sum->skipped, o.run_dir);
        loop(&o);
        /* results trail acks by a message: collect them for the per-stage times */
        for (double end = kvm_now_ms() + 1000; kvm_now_ms() < end && interrupts < 2 && o.compress_results < sum->compressed;) {
            zmq_pollitem_t items[1] = {{o.ctl, 0, ZMQ_POLLIN, 0}};
            if (zmq_poll(items, 1, 50) > 0) receive(&o, o.ctl, 1);
        }
        progress(&o, 1);
    }
    int hard = interrupts >= 2;
    stop_children(&o, hard ? SIGKILL : SIGTERM);
    /* abandoned jobs: their workers wait on uploads that get no reply, no grace for them */
    reap_all(&o, hard ? 100 : o.abandoned ? 2000 : 1000.0 * (double)kvm_config_int(cfg, "run", "grace_s") + 2000);
    kvm_svcproc_stop(&o.svc, 5000); /* after the workers: their last uploads are committed */
    for (int64_t i = 0; i < o.n_jobs; i++) {
        if (o.jobs[i].state == J_FAILED) sum->failed++;
        if (o.jobs[i].state != J_FAILED && o.jobs[i].state != J_DONE && o.jobs[i].state != J_SKIPPED) sum->pending++;
        job_drop_kv(&o.jobs[i]);
        free(o.jobs[i].kv);
    }
    if (store && !rc) {
        kvm_store_list_caches(store, &o.model_id, sum_bytes, &o); /* this model's caches only */
        count_evictions(&o, store);
    }
    /* a service that did not answer, or a second Ctrl-C: no waiting on it for the sizes, and
     * one short try to release the claims (they lapse by themselves) */
    int quick = hard || sum->store_down;
    if (o.cli && !rc && sum->compressed > 0 && (quick || sum_remote(&o))) { /* partial sums are no figure either */
        sum->bytes_unknown = 1;
        sum->bytes_full = sum->bytes_compressed = sum->evicted = sum->evicted_own = 0;
    }
    if (o.cli) sum->kept_full = -1;
    if (store && o.owner[0] && kvm_storew_release(store, o.owner)) orch_log("%s\n", kvm_errmsg());
    if (o.cli && o.owner[0] &&
        kvm_storecli_renew(o.cli, o.owner, 0, 1, kvm_orch_remote_timeout_ms(cfg) / (quick ? 4 : 1), quick ? 1 : 2, NULL))
        orch_log("%s (its claims lapse by themselves)\n", kvm_errmsg());
    kvm_store_close(&store);
    kvm_storecli_close(&o.cli);
    sum->seconds = (kvm_now_ms() - o.t0) / 1000.0;
    if (!rc) write_metrics(&o, hard || sum->interrupted ? "interrupted" : "done", 1);
    free(o.jobs);
    kvm_idxset_free(&o.by_hash);
    kvm_idxset_free(&o.by_id);
    kvm_joblist_deinit(&o.lists);
    if (o.ctl) zmq_close(o.ctl);
    if (o.data) zmq_close(o.data);
    kvm_curve_ctx_term(o.zctx); /* joins the ZAP handler of a keyed [run] bind too */
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (o.own_run_dir && (o.n_slots == 0 || (status == 0 && sum->failed == 0 && !hard))) kvm_rundir_remove(o.run_dir);
    else if (o.run_dir[0] && o.n_slots > 0) orch_log("stage logs are in %s\n", o.run_dir);
    if (hard || (status == 0 && sum->interrupted)) return 130; /* stopped by Ctrl-C: not a complete run */
    return status;
}
