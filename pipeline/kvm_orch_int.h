/* kvm_orch_int.h: what the orchestrator's files (kvm_orch*.c) share: the job table, the
 * workers and stage slots, the run's state, and the functions that cross those files. The
 * files call one way: kvm_orch.c (the loop) -> receive -> dispatch -> store -> jobs, and
 * stages -> jobs. Not part of the public API (kvm_orch.h). */
#ifndef KVM_ORCH_INT_H
#define KVM_ORCH_INT_H

#include "pipeline/kvm_orch.h"
#include "pipeline/kvm_corpus.h"
#include "pipeline/kvm_idxset.h"
#include "pipeline/kvm_joblist.h"
#include "pipeline/kvm_orch_progress.h"
#include "pipeline/kvm_storecli.h"
#include "pipeline/kvm_svcproc.h"
#include "proto/kvm_proto.h"
#include "store/kvm_store.h"

#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

enum { ST_PREFILL = 0, ST_COMPRESS = 1, ST_SIGNALS = 2, ST_STRATEGY = 3, N_STAGES = 4, MAX_WORKERS = 256 };

/* What the run does: compress a corpus (prefill -> compress), or calibrate PolyKV
 * (signals per document, then one strategy build over all of them). */
enum { MODE_RUN = 0, MODE_CALIBRATE = 1 };

typedef enum orch_job_state {
    J_QUEUED,
    J_PREFILL,
    J_KV_READY,
    J_COMPRESS,
    J_DONE,
    J_FAILED,
    J_SKIPPED,
    N_JOB_STATES
} orch_job_state;

typedef struct orch_job {
    kvm_doc *doc;
    orch_job_state state;
    uint64_t id; /* id of the current attempt (unique in the run) */
    int attempt;
    int worker;                    /* index in workers[] while in prefill/compress, else -1 */
    double since_ms;               /* entered the current state */
    kvm_msg **kv;                  /* [kv_cap] buffered kv messages of the current attempt */
    int kv_cap;                    /* slots allocated in kv (kept across attempts) */
    int64_t kv_layers;             /* the layer count the attempt's first kv message named */
    int64_t prog_done, prog_total; /* progress its compress worker last reported (heartbeat) */
    int n_kv;
    int claimed;      /* this run holds the document's claim in the store */
    int hashed;       /* its doc->hash was computed (the run's scan): a later load must find the same */
    int left;         /* left to another run holding its claim (kvm_orch__claim_job): rechecked */
    int left_live;    /* ... whose run renewed that claim once this run's own jobs were done */
    int64_t left_expires;    /* that claim's expiry when last seen, unix ms: a change is a renewal */
    int left_renewed;        /* ... and it changed once at least since this run left it (said while waiting) */
    int64_t evicted_at_send; /* the local store's eviction count when it went to compress
                                (kvm_orch__ack_stored's excuse for a cache missing at its ack) */
    uint64_t sent_ns;        /* ... and when (unix ns): a cache served before then still in the store means
                                the cap evicted none committed after it (kvm_store_stats.oldest_served_ns) */
    char reason[512]; /* why it failed */
} orch_job;

typedef struct orch_worker {
    char id[256];
    int stage; /* ST_* or -1 until known */
    double last_seen;
    int idle; /* has sent a credit and holds no orch_job */
    int job;  /* index in jobs[] or -1 */
    int alive;
    int ended;                /* its process, one of this run's, was killed (kvm_orch__worker_dead): the messages it
                                 had queued before are read still (an ack of a committed cache counts) but none
                                 makes it alive or idle again: its routing id is gone, a send to it fails */
    int slot;                 /* spawned slot, or -1 for an external orch_worker */
    int refused;              /* its ready named another model than the run's (revision 10): never idle, gets
                                 no job, staffs no stage (kvm_orch__worker_counts) */
    double told_ms;           /* when the refusal's error reached its control socket (kvm_now_ms), 0: not yet */
    kvm_store_id other_model; /* the model its ready named, when refused */
    int64_t refused_pid;      /* the refused process's pid (its ready's): another process reusing
                                 the id is judged afresh */
    int refused_ctl_seen;     /* the refused process's control-socket ready was judged (kvm_stage_judge_first) */
    int64_t pid;              /* the pid its last ready named */
    int64_t ctl_pid;          /* the pid its last control-socket ready named (a process sends one at its
                                 start, and again on a new connection): 0 until one came */
    uint64_t ctl_instance;    /* ... and its instance (revision 15; 0: none named) */
    int store_refused;        /* refused: its caches do not reach the run's store (kvm_orch_storefault.c) */
    int store_failures;       /* its jobs failed at the store service in a row (no ack between) */
    int64_t store_refused_pid; /* ... the process refused: another pid under its id is judged afresh */
    char store_why[600];       /* ... why (the job's error, or the ack that the store does not hold) */
    uint64_t asks_job_id;      /* the job it held when it asked for work (a credit) while holding one ... */
    double asks_since;         /* ... and when that first came (kvm_now_ms; 0: not since): lost_job_check */
    double asks_last;          /* ... and when the last one came (a longer gap: it ran the job) */
} orch_worker;

typedef struct orch_slot {
    int stage;
    char device[64];
    pid_t pid;
    int respawns;
    int gave_up;     /* exited too often: not restarted any more */
    double retry_at; /* its last start failed: try again then (0: not waiting) */
    char id[256];
    double started_ms; /* when the current process was started */
    int join_state;    /* the current process: 0 not joined yet, 1 logged as not joined
                          ([run] join_warn_s), 2 joined */
} orch_slot;

typedef struct orch {
    const kvm_config *cfg;
    kvm_corpus *corpus;
    orch_job *jobs;
    int64_t n_jobs, n_open;
    kvm_idxset by_hash;  /* jobs by document hash: the first of each set of identical documents */
    int64_t repeated;    /* skipped as a duplicate of an earlier document of the corpus (the same tokens) */
    kvm_idxset by_id;    /* jobs by attempt id (a requeue adds the new one; stale ones do not match) */
    kvm_joblist lists;   /* jobs by state, each list in the order jobs entered it (kvm_orch__job_move) */
    int64_t visited;     /* jobs the current loop iteration looked at (scheduling, health, draining) */
    int64_t visited_max; /* the most of any iteration: independent of the corpus size (metrics) */
    uint64_t next_id;
    orch_worker workers[MAX_WORKERS];
    int n_workers;
    int workers_full_said; /* the "too many workers" line was logged */
    int anonymous_said;    /* a peer without a worker id was logged (once: any socket may connect) */
    orch_slot slots[MAX_WORKERS];
    int n_slots;
    void *zctx, *ctl, *data;
    char base[1024], run_dir[1024], bin_dir[1024], store_path[4096];
    int64_t compress_results;         /* results received from compress workers */
    kvm_store_id model_id, config_id; /* the caches this run writes */
    kvm_store_id tok_id;              /* tokenizer the stages record in their manifests */
    kvm_store *store;                 /* the store (claims, the "stored meanwhile?" check) */
    kvm_storecli *cli;                /* or, with [store] path an endpoint, the store service (kvm_orch_remote.h) */
    char owner[192], host[64];        /* this run's claims: kvm_storew_owner */
    double last_renew;                /* when the claims were last renewed, ms */
    int renew_failing;                /* the last renewal failed (said once) */
    double renewed_ok;                /* when the claims were last renewed with success (or the run began), ms */
    int64_t abandoned;                /* jobs in workers given up when the store service was found down */
    int mode;                         /* MODE_RUN or MODE_CALIBRATE */
    uint64_t reduce_id;               /* calibrate: id of the strategy build request */
    int reduce_worker;                /* calibrate: strategy worker holding it, or -1 */
    int reduce_failures;              /* calibrate: retryable errors of the strategy build so far */
    int own_run_dir;                  /* created by this run: removed at the end unless something failed */
    int svc_failed;                   /* 1: the store service did not start: the run directory holds its log */
    int n_layers;
    int64_t kv_heads; /* layers x KV heads of the model, from prefill's kv messages: a full cache's
                         entries per token (0 until one came) */
    double hb_ms, dead_ms, job_timeout_ms;
    int max_retries;
    int store_full;   /* the store takes no more caches (full, or its service does not answer): no
                         more documents are fed */
    double last_health;      /* when kvm_orch__check_health last ran (kvm_now_ms), 0 before the first */
    char model_changed[512]; /* non-empty: [model] path holds other weights than when the run began
                                (kvm_orch__model_changed): why, the reason every job left fails with */
    int64_t evicted0; /* the store's eviction count when the run started */
    int64_t left_watch; /* jobs left to other runs not yet stored, taken over or judged live
                           (kvm_orch__recheck_left): the run ends when none is left */
    int64_t *left_idx;  /* [n_left] malloc'ed: the indices of the jobs left to other runs, so a
                           recheck visits them, not every skipped job */
    int64_t n_left, cap_left;
    int64_t left_next;   /* left_idx's first entry the next recheck pass looks at */
    int recheck_failing; /* a recheck through the store service got no reply (said once) */
    double left_checked; /* when they were last rechecked, ms */
    int left_ending;     /* the run's own jobs are done: their claims are watched (said once) */
    kvm_orch_summary *sum;
    double t0;
    kvm_orch_progress prog;                  /* the progress line */
    double last_metrics;                     /* when the metrics file was last written, ms */
    kvm_svcproc svc;                         /* the store service started for remote workers ([store] service_bind) */
    int metrics_failed;                      /* a metrics write failed (said once) */
    const char *cmd;                         /* "run" or "calibrate", for messages */
    const atomic_int *interrupts;            /* Ctrl-C / SIGTERM count (kvm_orch.c's handler) */
} orch;

/* Why the store takes no more caches (kvm_orch__store_stop). */
enum {
    STORE_DEVICE_FULL = 0,
    STORE_DOWN = 1,
    STORE_MAP_FULL = 2,
    STORE_FILE_LIMIT = 3,
    STORE_GONE = 4,
    STORE_DAMAGED = 5
};
/* 1 when a store error message says the store is no longer the one opened (kvm_store_here.c:
 * moved, removed or replaced, or its lock.mdb lost): nothing more can be stored in it. */
int kvm_orch__store_gone_msg(const char *why);
/* 1 when error rc with message why says the store's data.mdb is damaged (kvm_store_tree.c's page
 * walk, a meta page), as opposed to one corrupt cache: no claim, probe or upload can succeed. */
int kvm_orch__store_damaged(int rc, const char *why);
/* A run's local store checked against the one it opened (kvm_store_check_here, stats only): when
 * it is no longer that one, the feed stops as for a full store (STORE_GONE, said once). Returns
 * o->store_full. Each loop: workers that open the store after it went fail "no such store" at
 * their start, and the stage was given up with every document failed. */
int kvm_orch__store_gone_check(orch *o);

/* ---- kvm_orch_jobs.c: the job table ---- */

/* A line on stderr prefixed with the command: "kvmill run: ..." */
void kvm_orch__log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Frees the job's buffered kv messages. */
void kvm_orch__job_drop_kv(orch_job *j);
/* Moves j to state s's list (no timestamps, no counts). */
void kvm_orch__job_move(orch *o, orch_job *j, orch_job_state s);
/* Moves j to state s, counting open jobs and stamping the time. */
void kvm_orch__job_set(orch *o, orch_job *j, orch_job_state s);
/* Tokens after the context a job carries. */
int64_t kvm_orch__continuation_tokens(const orch *o);
/* Loads an on-demand document's tokens; fails the job alone when it cannot. 0 when loaded. */
int kvm_orch__job_load(orch *o, orch_job *j);
/* Puts a job back in the queue (a new attempt), or fails it after max_retries. */
void kvm_orch__requeue(orch *o, orch_job *j, const char *why);
/* The job whose current attempt is id, or NULL. */
orch_job *kvm_orch__job_by_id(orch *o, uint64_t id);
/* The job one of whose attempts, the current one or an earlier (requeued) one, was id; NULL when
 * none of this run's was (a skipped job, a calibration's build request, another run's id). */
orch_job *kvm_orch__job_by_any_id(orch *o, uint64_t id);
/* Job j's document is in the store, committed by an attempt of this run ("the store is the
 * truth"): j leaves its worker, if any, and is done, counted as compressed. */
void kvm_orch__job_committed(orch *o, orch_job *j);

/* ---- kvm_orch_store.c: claims, skips and the store's sums ---- */

/* The store takes no more caches (why, kind STORE_*); j goes back to the queue. */
void kvm_orch__store_stop(orch *o, orch_job *j, const char *why, int kind);
/* Claims j's document before it is sent. Returns 1 when j is not to be sent. */
int kvm_orch__claim_job(orch *o, orch_job *j);
/* Rechecks the jobs left to other runs (t0: now, ms): each one stored meanwhile is skipped;
 * one whose claim lapsed (not renewed) or whose run of this host is gone is claimed and queued
 * here again. Once this run's own jobs are done, every 250 ms: a claim renewed since then is a
 * live run's, left to it (counted claimed); one that is not is watched until it lapses. A pass
 * spends about 50 ms at most (a store service's claim is a round trip each) and the next goes
 * on from where it stopped. */
void kvm_orch__recheck_left(orch *o, double t0);
/* At a run's end on a local store: the claims of runs of this host that are gone (killed with
 * kill -9 before they released them) are released, up to 8 such runs a time: a rerun that found
 * their documents stored took none over, and `store claims` listed them for ever, lapsed. */
void kvm_orch__release_dead(orch *o);

/* Notes the local store's eviction count in j as it goes to compress (run mode, local store;
 * else nothing): an acked cache missing later is excused only by evictions after this. */
void kvm_orch__note_evictions(orch *o, orch_job *j);
/* Renews this run's claims when due (t0: now, ms); abandons the jobs in workers when the store
 * service answered no renewal for longer than the lease. */
void kvm_orch__renew_claims(orch *o, double t0);
/* Before the run: skips stored and repeated documents. */
int kvm_orch__mark_skipped(orch *o, kvm_store *store);
/* 1 when j's cache (this run's model and config) is in the store now (the local store or the
 * service's); 0 when not, or when it cannot be told (an error: said by the caller's next step).
 * For an ack that is not the job's current attempt: job ids are numbered from 1 by every run, so
 * an ack that another run's worker queued before this run began can name one of this run's
 * earlier ids; only the store tells that this document's cache was committed. */
int kvm_orch__stored_now(orch *o, const orch_job *j);
/* Worker w acked job j's current attempt: its cache is committed, it says. Only the run's store
 * tells: a worker started by hand with another --store commits there (its ready names no store).
 * j is done, counted compressed, when the run's store holds its cache, or when the store's cap
 * evicted caches since the last check (said: it may have been one); else w is named as writing
 * elsewhere and j is requeued with that reason (it fails after max_retries). One lookup per
 * acked document, on the local store or the service. */
void kvm_orch__ack_stored(orch *o, orch_job *j, int w);
/* kvm_store_list_caches callback: the summary's bytes and entries of this run's caches. */
int kvm_orch__sum_bytes(const kvm_store_cache_key *key, const kvm_store_manifest *m, int status, void *arg);
/* Caches the store's cap evicted during the run. */
void kvm_orch__count_evictions(orch *o, kvm_store *store);
/* The summary's bytes with a remote store. Returns 1 when the service did not answer. */
int kvm_orch__sum_remote(orch *o);
/* At the end of a run: each failed job this run had claimed whose cache is in the store after
 * all (an earlier attempt committed it, its ack unseen) is done, counted as compressed. */
void kvm_orch__failed_but_stored(orch *o, kvm_store *store);

/* ---- kvm_orch_stages.c: stage processes and workers ---- */

/* Sends sig to every started stage process. */
void kvm_orch__stop_children(orch *o, int sig);
/* Waits up to ms for every child to exit; SIGKILLs the rest. */
void kvm_orch__reap_all(orch *o, double ms);
/* The worker behind routing id idf (added when new), or -1 when the table is full. */
int kvm_orch__worker_get(orch *o, const kvm_frame *idf, int stage);
/* Whether worker w, after its decoded ready r, is refused (kvm_stage_judge_ready against
 * o->model_id; PROTOCOL.md §5, revision 10): r names another model, or r is the refused
 * process again naming none. first: r came on the control socket, which a stage sends once, at
 * its start (kvm_stage_judge_first). A new refusal is logged once, told to the worker (an
 * error: it exits; told again every KVM_STAGE_RETELL_MS while it still asks for work) and gives
 * its job back; one of the run's own processes is restarted as a dead one is, a bounded number
 * of times. */
int kvm_orch__worker_refused(orch *o, int w, const kvm_proto_ready *r, int first);
/* After a job (or the strategy build) failed with KVM_EMISMATCH, its message msg[0, n): whether
 * it is a worker's "other model" mismatch (kvm_worker_other_model_hex) and the run's own
 * [model] path now holds that very model, the file replaced since the run hashed it at its
 * start. Then every worker the run starts, or that loads the path again, computes with it: each
 * would fail its job and stop, one after the other, until the run gave up restarting them, and
 * the failures named the restarts, not the cause. Another mismatch (shapes, a tokenizer, a
 * worker of another host whose file differs) hashes nothing and returns 0. Said once (event
 * model_changed, both ids); the jobs not in a worker fail with that reason, and so does every
 * job that comes back (kvm_orch__requeue), every calibration document that reaches J_KV_READY
 * and the strategy build (no strategy from a part of the documents); jobs in workers that loaded
 * the run's weights before the change finish. The hash runs in the event loop (seconds for a
 * large model), once per such failure. Returns 1 when changed (now or before), else 0 (a file
 * that cannot be read now: 0, the jobs' own errors say it). */
int kvm_orch__model_changed(orch *o, const char *msg, size_t n);
/* ---- kvm_orch_storefault.c: compress workers whose caches do not reach the run's store ---- */

/* 1 when a store failure of worker w's job is blamed on w: a run's compress worker started by
 * hand (not one of the run's own, which take the run's store and keys), not refused yet. */
int kvm_orch__store_fault_worker(const orch *o, int w);
/* Worker w's job failed at the store service with why (KVM_EIO) while the run's store answers:
 * 1 when that is w's fault for sure, so w is to be refused: the service refused its key or its
 * handshake (a setting of w's), or, with a store service as the run's store (which answered the
 * run's probe just now), this is its second such failure in a row (its uploads get no reply; one
 * may be the service's moment of load, and that job used an attempt). A run on a local store
 * never asks the service it hosts, which may be stalled: no reply is never w's fault there. */
int kvm_orch__store_fault_counts(orch *o, int w, const char *why);
/* Refuses worker w (kvm_orch__store_fault_worker said 1) for why (the failure, 1..600 bytes
 * kept): logged once (event worker_refused), told to the worker (an error: a revision-10 stage
 * exits; told again every KVM_STAGE_RETELL_MS while that process still asks for work), no job
 * goes to it, and its job j (may be NULL) is queued again without using an attempt of its
 * document. Bounded: once per worker process. */
void kvm_orch__store_refuse(orch *o, orch_job *j, int w, const char *why);
/* On each ready r of worker w (first: on the control socket, else a data-socket credit): records
 * its pid; 1 while w is the process store-refused (kvm_orch__store_refuse), which then gets no
 * work; a ready of another pid under the same id, or a control ready (sent once, at a process's
 * start), is a process started again: the refusal is cleared, said. */
int kvm_orch__store_refused(orch *o, int w, const kvm_proto_ready *r, int first);
/* Before a store failure of job j is blamed on its worker: 1 when the run's own store answers
 * (a local one always: kvm_store_check_here ran first; a store service: a probe of j's key got a
 * reply), else 0, said: the store itself is down, no worker's fault. */
int kvm_orch__store_answers(orch *o, const orch_job *j);
/* An ack of job j from worker w with a store service as the run's store: the service's commit
 * reply, which names no store. For a worker started by hand (kvm_orch__store_fault_worker) the
 * run's service is asked for j's index entry (one round trip); missing, w uploads to another
 * store: it is refused, j queued again (kvm_orch__store_refuse), and 1 is returned. 0: the ack
 * stands (one of the run's own workers, stored, or no reply: said, and the summary probes again). */
int kvm_orch__remote_ack_elsewhere(orch *o, orch_job *j, int w);

/* 1 when worker w counts for its stage: alive and not refused. */
int kvm_orch__worker_counts(const orch *o, int w);
/* ST_* of a stage name, or -1. */
int kvm_orch__stage_of(kvm_proto_str s);
/* Worker w is dead (why: the log's words): its job is requeued (an attempt of the document's) and
 * a process of this run's is killed and started again (bounded). A no-op for a dead worker. */
void kvm_orch__worker_dead(orch *o, int w, const char *why);
/* Worker w's control-socket ready named process pid. Another pid than the last one's under the
 * same id is a new process: ZeroMQ hears one connection per id, so the one that held the id, and
 * its job, is gone (killed and started again by hand or by a service manager, before its liveness
 * ran out; or started while it ran, heard once it was gone). Its job is requeued (the strategy
 * build put back) at once, where the new process's heartbeats kept the worker alive and the job
 * waited for ever. */
void kvm_orch__worker_process(orch *o, int w, int64_t pid, uint64_t instance);
/* The lease of this run's claims, ms: [run] heartbeat_ms x liveness, at most the store's
 * longest (KVM_STORE_CLAIM_MAX_TTL_MS, which the store refuses to exceed): a valid config can
 * ask for 1000 h. The claims are renewed every quarter of it. */
int64_t kvm_orch__claim_ttl(const orch *o);
/* No health check ran for gap_ms (> half of the shorter of [run] heartbeat_ms x liveness and the
 * claims' lease, kvm_orch__check_health;
 * now: kvm_now_ms after it): the orchestrator itself was stopped (SIGSTOP, Ctrl-Z, a suspended
 * VM) or busy, so it read no heartbeat meanwhile. The workers' silence and the jobs' times are
 * judged from now: they kept working, and their queued messages are read in the next
 * iterations. The claims are renewed at the next chance, and a store service is not taken for
 * down by the pause's length, unless its renewals were failing before it. Logs run_resumed
 * (gap_ms). */
void kvm_orch__resumed(orch *o, double gap_ms, double now);
/* Child exits, silent workers, dead stages, timed-out jobs. */
void kvm_orch__check_health(orch *o);
/* Checks the stage settings and starts the configured stage processes. */
int kvm_orch__start_stages(orch *o);

/* ---- kvm_orch_dispatch.c: sending jobs ---- */

/* Bytes of a message's frames (routing ids excluded). */
int64_t kvm_orch__msg_bytes(const kvm_msg *m);
/* Sends queued and prefilled jobs to idle workers. */
void kvm_orch__dispatch(orch *o);

/* ---- kvm_orch_receive.c: messages from the stages ---- */

/* Handles up to 1000 waiting messages of the control (is_ctl) or data socket. */
void kvm_orch__receive(orch *o, void *sock, int is_ctl);
/* While the run's workers stop (kvm_orch__reap_all): reads what waits on the data socket and
 * answers each stopping worker's heartbeat with the end of its work (PROTOCOL.md §5, revision 13),
 * so that it need not wait out its bound; drops everything else, the run being over. */
void kvm_orch__answer_stopping(orch *o);

#endif
