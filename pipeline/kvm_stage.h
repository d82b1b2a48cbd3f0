/* kvm_stage.h: the runtime every stage process shares (zguide's load-balancing worker):
 * two DEALER sockets connected to the orchestrator with one routing id — `data` (work in,
 * results out, and a `ready` credit whenever the stage is idle) and `ctl` (ready, heartbeat,
 * ack, result, error). The job runs on a worker thread so heartbeats keep flowing during
 * long computations; SIGTERM stops taking work, lets the current job finish within the
 * grace period or hands it back (a retryable error), and exits 0. A malformed or unexpected
 * message is logged with the reason and dropped; the stage keeps serving. An `error` on the
 * control socket is the orchestrator refusing this worker (another model: PROTOCOL.md §5,
 * revision 10): it is logged and the stage stops with exit status 1; so does a job whose model
 * file here is not its run's model (kvm_stage_out.other_model). */
#ifndef KVM_STAGE_H
#define KVM_STAGE_H

#include "common/kvm_progress.h"
#include "proto/kvm_proto.h"

#include <stdint.h>

enum { KVM_STAGE_MAX_IN = 1100, KVM_STAGE_MAX_OUT = 1100 };

/* Command-line settings common to every stage (parsed by kvm_stage_main). */
typedef struct kvm_stage_args {
    const char *connect;   /* --connect BASE: the orchestrator's endpoint base (see kvm_stage_endpoints) */
    const char *device;    /* --device cpu|cuda:N */
    const char *store;     /* --store PATH (NULL if not given) */
    const char *model;     /* --model PATH: overrides the model path a job's settings carry */
    const char *config;    /* --config FILE (decode workers; compress/strategy: [store] settings) */
    int threads;           /* --threads N */
    int heartbeat_ms;      /* --heartbeat-ms */
    int grace_s;           /* --grace-s */
    const char *worker_id; /* --id, default STAGE-HOST-PID */
    const char *server_key;/* --server-key FILE: CurveZMQ server public key (tcp:// to other hosts) */
    const char *client_secret; /* --client-secret FILE: this worker's CurveZMQ secret key */
    const char *client_public; /* --client-public FILE */
    const char *log_format; /* --log-format text|json (NULL: KVMILL_LOG_FORMAT, else text) */
    long parent_pid;       /* --parent-pid PID: stop when that process is gone (set by the
                              orchestrator for the stages it starts; 0 = never) */
    int leave_after_s;     /* --leave-after-s N: stop once the orchestrator it connected to has been
                              gone N s (both connections closed, none made again); 0 = never */
} kvm_stage_args;

/* Messages a job produces; the runtime sends them in order after the job returns. */
typedef struct kvm_stage_out {
    kvm_msg *data[KVM_STAGE_MAX_OUT]; /* to the data socket */
    int n_data;
    kvm_msg *ctl[8];                  /* to the control socket (e.g. ack) */
    int n_ctl;
    int evaluated;                    /* 1: kl_mean holds a measurement for the result */
    double kl_mean;                   /* mean KL over the job's continuation, nats */
    double transport_ms;              /* encoding/decoding messages inside work(); the runtime
                                         adds its own send time */
    double store_ms;                  /* committing the cache inside work() (LMDB or store service) */
    kvm_progress progress;            /* work() may count units done / announced here (from any
                                         thread); heartbeats carry it while the job runs */
    int64_t stored_bytes;             /* bytes the job stored rather than sent on (compress: the
                                         cache's bytes as the store records them, or as uploaded
                                         to the store service): the job's log line counts them
                                         with the data messages' bytes */
    int other_model;                  /* work() failed because this worker's model is not the run's
                                         (kvm_worker_model_for_job): every later job would fail
                                         alike, so after the job's error the stage stops as a
                                         refused one does (exit 1) */
} kvm_stage_out;

/* What a stage implements. */
typedef struct kvm_stage_ops {
    const char *stage; /* "prefill", "compress", ... */
    /* Once after argument parsing, before connecting: load the model, open the store.
     * Non-zero aborts the process (exit 1) with kvm_errmsg() logged. */
    int (*setup)(void *state, const kvm_stage_args *a);
    /* Given the messages received so far for the current job (in[0] is the first), returns
     * 1 when they form a whole job, 0 to wait for more, or a negative status when they are
     * malformed (they are then dropped and reported). Runs on the main thread. */
    int (*complete)(void *state, kvm_msg *const *in, int n_in);
    /* The job's id, read from in[0] (for results and hand-backs). */
    uint64_t (*job_id)(void *state, kvm_msg *const *in, int n_in);
    /* Does the work on the worker thread. Takes ownership of nothing; fills out. Returns 0 or
     * a status with kvm_errmsg() set; *retryable says whether a requeue may succeed (left
     * unset, kvm_err_retryable(status) decides: bad input is not retried; KVM_EBUSY, a store
     * whose reader table is full, is retried whatever it says). */
    int (*work)(void *state, kvm_msg *const *in, int n_in, kvm_stage_out *out, int *retryable);
    /* Frees what setup made (at exit). May be NULL. */
    void (*teardown)(void *state);
    /* NULL, or for a stage whose work has a device path only for some settings (decode): the
     * reason it cannot run on --device cuda:N with these arguments (its --config), or NULL when
     * it can; a reason refuses the worker at start (exit 2) rather than run on the CPU unsaid.
     * Asked before the device itself is checked. */
    const char *(*device_refusal)(const kvm_stage_args *a);
    /* NULL, or the id (32 bytes, BLAKE2b-256: the store's model id) of the model the stage
     * computes with, or NULL while it has none (it takes the path from its first job): every
     * `ready` names it (model_id, PROTOCOL.md §5, revision 10) so that a server or run refuses a
     * worker of another model. Called on the main thread while no job runs; the pointer is the
     * state's, read before the next job starts. */
    const uint8_t *(*model_id)(void *state);
    /* NULL, or the 32-byte config id of the stage's own --config without a PolyKV strategy
     * (kvm_jobcfg_config_id with no strategy hash), or NULL while it has none: every `ready`
     * names it (settings_id, PROTOCOL.md §5, revision 11) so that a server refuses a decode
     * worker of other settings (its answers would differ). As model_id for the threads. */
    const uint8_t *(*settings_id)(void *state);
    /* NULL, or the place of the LMDB store the stage reads and writes (kvm_store_place_id, 32
     * bytes), or NULL when it has none known (a store service: not compared): every `ready`
     * names it (store_id, PROTOCOL.md §5, revision 15) so that a server refuses a decode worker
     * whose caches are another store's. As model_id for the threads. */
    const uint8_t *(*store_id)(void *state);
} kvm_stage_ops;

/* Ready-made kvm_stage_ops pieces for stages whose work starts with a `job` message:
 * complete() for a job that is that one message, and job_id() reading in[0]'s job_id. */
int kvm_stage_one_job(void *state, kvm_msg *const *in, int n_in);
uint64_t kvm_stage_job_id(void *state, kvm_msg *const *in, int n_in);

/* The syntax of a comma-separated device list alone (no device is opened, so --dump-config can
 * check it on a host without the GPUs): 0, or KVM_EINVAL naming `key` and the empty item's
 * position or the device that is not cpu or cuda:N. */
int kvm_stage_parse_devices(const char *key, const char *devs);

/* Every device of a comma-separated list (cpu, cuda:N) must be usable (kvm_kernels_select):
 * 0, or KVM_EINVAL naming `key` (e.g. "[stages] prefill_devices") and the device, so that a run
 * or a server is refused up front rather than watching every worker die. */
int kvm_stage_check_devices(const char *key, const char *devs);

/* The i-th device of a comma-separated list, cycling (worker i of a stage), into out (size
 * bytes). */
void kvm_stage_device_at(const char *devs, int64_t i, char *out, size_t size);

/* For stages whose sculpt-family solvers follow --device (compress, signals, strategy): 0
 * when a->device has a KVSculpt solver (cpu, or a visible CUDA device: the sculpt `device`
 * setting's check), logging for cuda:N that the solvers run there (each stage says where its
 * forward passes run); else that
 * setting's error (KVM_EDEVICE, KVM_ENOTSUP, KVM_EINVAL) naming the device. */
int kvm_stage_solver_device(const kvm_stage_args *a);

/* Checks --parent-pid `pid` of a process that stops once it is reparented (a stage worker,
 * the store service): 0 when pid is its parent, or the parent may have exited since it started
 * this process (no process pid, and the process was reparented to init); else 2, with a line on
 * stderr prefixed by `who`: pid is a live process that is not the parent, or no process at all. */
int kvm_stage_parent_check(const char *who, long pid);

/* Runs a stage process: parses argv (--connect, --device, --store, --threads, --model,
 * --config, --heartbeat-ms, --grace-s, --id, --help), calls setup, connects, serves jobs
 * until SIGTERM/SIGINT. Logs "connecting", that the endpoint completed the ZeroMQ handshake
 * (nothing there yet: it says it waits, and waits), then "connected" once the orchestrator's
 * first message came (work or a refusal). Returns the process exit status
 * (0 after a clean stop; 1 on setup or socket failure, when the orchestrator refused the worker
 * or its CurveZMQ handshake (a client key it does not authorize, a wrong --server-key), when
 * the endpoint's first message is one no orchestrator sends (a store service's store_reply: no
 * kvmill run or serve endpoint), or after a job whose model
 * file here is not the run's model; 2 on bad arguments: a --connect endpoint or a key file
 * of --server-key, --client-public, --client-secret that is missing or not a key included). */
int kvm_stage_main(int argc, char **argv, const kvm_stage_ops *ops, void *state);

/* Endpoints derived from a base: ipc://DIR -> ipc://DIR/ctl, ipc://DIR/data; tcp://H:P ->
 * tcp://H:P (ctl), tcp://H:P+1 (data). Writes into ctl/data (size bytes each). Returns 0 or
 * KVM_EINVAL for another scheme or a bad port. */
int kvm_stage_endpoints(const char *base, char *ctl, char *data, size_t size);

/* The verdict on a worker's ready (kvm_stage_judge_ready). */
typedef enum kvm_stage_verdict {
    KVM_STAGE_ACCEPT,       /* it names want, or none (it cannot be checked), and was not refused */
    KVM_STAGE_ACCEPT_AGAIN, /* refused before, accepted now: it names want, or is another process
                               (pid) naming none (started again as the refusal said) */
    KVM_STAGE_REFUSED,      /* the refused process again, naming none: it stays refused */
    KVM_STAGE_OTHER_MODEL,  /* it names another model (r->model_id): refused; a new refusal unless
                               refused is set and r->pid is refused_pid */
} kvm_stage_verdict;

/* The server's or run's side of a refusal (PROTOCOL.md §5, revision 10), one rule for serve and
 * run/calibrate: judges decoded ready r against want (32 bytes, the model the server serves;
 * NULL: nothing to check, always KVM_STAGE_ACCEPT or _ACCEPT_AGAIN) and the worker's state
 * (refused: 1 when refused before; refused_pid: the refused process's pid). A refusal belongs
 * to the process, not the worker id. Pure; no errors. */
kvm_stage_verdict kvm_stage_judge_ready(const kvm_proto_ready *r, const uint8_t *want, int refused,
                                        int64_t refused_pid);

/* Before judging ready r that came on the control socket: a stage sends that one once, when its
 * process starts (the data socket's readies are its credits). A worker started again under the
 * same id often has the same pid as the refused one (pid 1 in a container that its orchestrator
 * restarts): judged by the pid alone it stayed refused without a word, or was refused again but
 * never told. The refused process named other_model (32 bytes) from its start, so a control
 * ready from the refused pid that names none or another is a new process; one naming
 * other_model is the refused process's own late ready (its credits may arrive first: the
 * sockets are not ordered; a worker that outlived an earlier run sent its control ready to that
 * run) unless *ctl_seen says that one was judged already. A new process: *refused_pid becomes -1
 * (no pid), so it is judged afresh and, refused, logged and told (one restarted with the same
 * wrong --model is told again by its credits, kvm_stage_tell_again). Sets *ctl_seen. */
void kvm_stage_judge_first(const kvm_proto_ready *r, int refused, const uint8_t *other_model, int64_t *refused_pid,
                           int *ctl_seen);

/* Milliseconds between two tellings of a refusal (kvm_stage_send_refusal) to a worker that
 * still asks for work: a refused revision-10 stage stops at the first, so asking again means
 * the error was lost (a reconnect in between). */
#define KVM_STAGE_RETELL_MS 5000.0

/* 1 when a refused worker is to be told (again): never told (told_ms 0), or told at least
 * KVM_STAGE_RETELL_MS before now (both kvm_now_ms). */
int kvm_stage_tell_again(double told_ms, double now);

/* Tells worker `worker_id` behind the ROUTER control socket `router` that it is refused: an
 * `error` (status KVM_EMISMATCH, job_id 0, stage `from` such as "serve" or "run", message `why`
 * with each byte that is not part of a UTF-8 character as '?', cut at a character boundary
 * within 2 KiB) that a revision-10 stage logs before it exits 1 (a revision-9 stage drops it;
 * a revision-10 stage drops any other error on that socket). Returns 0, or KVM_EIO / KVM_ENOMEM when it could not be
 * sent (the worker is gone); takes nothing. */
int kvm_stage_send_refusal(void *router, const char *worker_id, const char *from, const char *why);

/* Answers a stopping worker's heartbeat (`stopping`, on the data socket: PROTOCOL.md §5, revision
 * 13) from an orchestrator: `c` is that heartbeat, decoded; `routing_id`/`id_len` the routing id it
 * came with on the ROUTER data socket `router`; `from` names the sender ("serve", "run",
 * "calibrate"). Sends the end of that worker's work, an `ack` with job_id 0, `stopping` and (revision
 * 15) `revision` KVM_PROTO_REVISION, on the
 * same socket, after everything sent there before; the caller withdraws the worker's credit
 * first, so nothing follows it. Any stopping worker is answered, one the caller does not know or
 * judged dead too, and at every asking: a second answer is dropped by the worker. Returns 0;
 * KVM_EINVAL when `c` has no `stopping` (nothing sent); KVM_EIO / KVM_ENOMEM when it could not
 * be sent (the worker is gone). Takes nothing. */
int kvm_stage_answer_stopping(void *router, const void *routing_id, size_t id_len, const kvm_proto_heartbeat *c,
                              const char *from);

/* Welcomes a worker whose `ready` `r` came on the ROUTER control socket `router` with routing id
 * `routing_id`/`id_len` and was accepted (PROTOCOL.md §5, revision 15): an `ack` with job_id 0, no
 * `stopping` and `revision` KVM_PROTO_REVISION on that socket, from `from` ("serve", "run",
 * "calibrate"). A stage that gets none after its handshake is not heard (ZeroMQ hears only the
 * first connection under an id while it lasts) and connects again; a revision-14 stage drops it.
 * Returns 0, or KVM_EIO / KVM_ENOMEM when it could not be sent (the worker is gone). Takes
 * nothing. */
int kvm_stage_welcome(void *router, const void *routing_id, size_t id_len, const kvm_proto_ready *r, const char *from);

/* Whether a control-socket ready of process (pid, instance) under a worker's id is another process
 * than the last one's, (*last_pid, *last_instance), which it then replaces (PROTOCOL.md §5,
 * revision 15): another pid, or the same pid and another instance, both named (pid 1 of a
 * restarted container); never the first ready (*last_pid 0). When it is, `why` gets "is a new
 * process (...; WHAT was ...'s, which is gone)" for the log, WHAT naming what the old one held
 * ("its work", "the request"). */
int kvm_stage_new_process(int64_t *last_pid, uint64_t *last_instance, int64_t pid, uint64_t instance, const char *what,
                          char *why, size_t size);

/* Milliseconds on the monotonic clock. */
double kvm_now_ms(void);

#endif
