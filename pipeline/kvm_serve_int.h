/* kvm_serve_int.h: what the serving broker's files share: the broker's state (worker slots,
 * workers, client allowances, the request queue) and the functions that cross those files:
 * kvm_serve_broker.c (the loop) over the slots, the back end and the front end, which share the
 * allowance and the per-document holds of kvm_serve_grant.c, all over kvm_serve.c (binding,
 * answer helpers). Not part of the public API (kvm_serve.h). */
#ifndef KVM_SERVE_INT_H
#define KVM_SERVE_INT_H

#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_svcproc.h"

#include <signal.h>
#include <stdint.h>
#include <sys/types.h>

enum { MAX_WORKERS = 256, MAX_EARLY_EXITS = 3 };

typedef struct srv_slot {
    pid_t pid;         /* running process, 0 when none */
    int respawns;      /* times restarted */
    char id[256];      /* worker id of the current process */
    double started_ms; /* when the current process was spawned */
    double respawn_at; /* when to start it again (0: not waiting) */
    int early_exits;   /* consecutive exits before the process ever connected */
    int join_state;    /* the current process: 0 not joined yet, 1 logged as not joined
                          ([run] join_warn_s), 2 joined */
} srv_slot;

/* New caches [serve] compute_missing added (or is adding) for one client key. */
typedef struct srv_client {
    char key[48]; /* the client's CurveZMQ public key, Z85 */
    int64_t made; /* caches added for it this server run */
    int64_t out;  /* grants held by requests in flight */
} srv_client;

/* A document an ask sends (text, bytes or tokens), as the broker can tell it without a
 * tokenizer: requests with equal keys compute the same cache (one model and config per server). */
typedef enum srv_doc_kind {
    SRV_DOC_NONE = 0, /* named by hash or name, or compute_missing off: never computed here */
    SRV_DOC_TEXT,     /* text or bytes (tokenised alike) */
    SRV_DOC_TOKENS    /* token ids */
} srv_doc_kind;

/* What a held request learnt when the granted request for its document answered. */
typedef enum srv_release {
    SRV_HELD = 0,       /* nothing yet, or that one ended without storing the cache: held while a
                           granted request for its document runs (the oldest held one computes next) */
    SRV_RELEASED,       /* that one found the cache stored, computing nothing: not held again */
    SRV_RELEASED_STORED /* that one stored the cache: not held, needs no grant */
} srv_release;

/* How a granted request for a document ended (kvm_serve__doc_release). */
typedef enum srv_doc_end {
    SRV_END_STORED,  /* it computed and stored the cache: the held requests are served from the store */
    SRV_END_FOUND,   /* it found the cache stored, computing nothing: the held requests go on */
    SRV_END_UNSTORED /* it failed, or computed the cache without storing it: one held request
                        computes it next, the others stay held */
} srv_doc_end;

typedef struct srv_doc_key {
    srv_doc_kind kind;
    uint8_t hash[32]; /* BLAKE2b-256 of the text/bytes, or of the token ids as sent */
} srv_doc_key;

typedef struct srv_worker {
    char id[256];        /* routing id (= --id) */
    int alive;           /* heard from within the liveness window */
    int idle;            /* sent a credit and holds no request */
    int busy;            /* holds a request (answer not received yet) */
    int slot;            /* spawned slot, or -1 for an external worker */
    double last_seen;    /* last message, ms */
    kvm_msg *env;        /* envelope of the client waiting for the busy request; NULL when
                            the client already got an error answer (timeout) */
    uint64_t request_id; /* of the busy request */
    double t_sent;       /* when it was handed to the worker */
    double t_recv;       /* when the server received it: [serve] request_timeout_s counts from here */
    int grant;           /* the busy request may add a cache (compute_grant): one grant held */
    int grant_client;    /* index in srv.clients of the grant's client key, or -1 */
    srv_doc_key doc;     /* the busy request's document, when it sends one */
    int refused;         /* its ready named another model than the server's: never idle, gets no
                            request (revision 10) */
    double told_ms;      /* when the refusal's error reached its control socket (kvm_now_ms), 0: not yet */
    uint8_t other_model[KVM_PROTO_ID_BYTES]; /* the model its ready named, when refused */
    int other_settings;                      /* refused for its settings (1, revision 11) or its store (2,
                                                revision 15), not its model (0) */
    uint8_t other_settings_id[KVM_PROTO_ID_BYTES]; /* the settings its ready named, then */
    char other_stage[64];                          /* refused for its stage: a prefill or compress worker's ready, whose
                                                      "stage" is not decode, named here ("" when not so refused) */
    int64_t refused_pid; /* the refused process's pid: another process reusing the id is judged afresh */
    int refused_ctl_seen; /* the refused process's control-socket ready was judged (kvm_stage_judge_first) */
    int64_t ctl_pid;      /* the pid its last control-socket ready named, 0 until one came */
    uint64_t ctl_instance;    /* ... and its instance (revision 15; 0: none named) */
    uint64_t asks_request_id; /* the request it held when it asked for work (a credit) while busy ... */
    double asks_since;        /* ... and when that first came (kvm_now_ms; 0: not since): lost_request_check */
} srv_worker;

typedef struct srv_request {
    kvm_msg *env;         /* client envelope (routing id, and the empty delimiter of a REQ) */
    kvm_msg *msg;         /* the ask */
    uint64_t request_id;  /* its request id */
    double t_recv;        /* arrival, ms */
    char key[48];         /* the client's CurveZMQ key (the message's User-Id), "" without CurveZMQ */
    srv_doc_key doc;      /* its document, when it sends one under compute_missing */
    srv_release released; /* a granted request for the same document answered while this one waited */
    int held_logged;      /* "held" was logged since it was last released (kvm_serve__doc_holder) */
} srv_request;

typedef struct srv {
    const kvm_config *cfg;
    const kvm_serve_opts *o;
    void *zctx, *front, *ctl, *data;
    char front_ep[1024], base[1024], run_dir[1024], bin_dir[1024], store_path[4096];
    int own_run_dir, backend_curve, announced;
    int svc_failed;       /* 1: the store service did not start: the run directory holds its log (kept) */
    int fatal;            /* a worker slot keeps failing before it connects, or runs another model: stop */
    char fatal_why[1024]; /* why, when not the early exits: said at the stop */
    int settings_state;   /* settings_id: 0 not made yet, 1 made, -1 none (no config) */
    uint8_t settings_id[KVM_PROTO_ID_BYTES]; /* the config id of cfg without a PolyKV strategy: a worker's
                                                ready naming other settings is refused */
    kvm_serve_ipc_file ipc[3]; /* the socket files of the front end, ctl and data binds: removed at the end */
    kvm_svcproc svc; /* the store service for decode workers on other hosts ([store] service_bind) */
    srv_slot slots[MAX_WORKERS];
    int n_slots;
    srv_worker workers[MAX_WORKERS];
    int n_workers;
    int anonymous_said; /* a peer without a worker id was logged (once: any socket may connect) */
    srv_request *queue;
    int64_t n_queue, cap_queue, max_queue;
    double hb_ms, dead_ms, timeout_ms;
    int64_t max_msg_bytes;
    uint64_t served, failed;
    int front_curve;                  /* the front end authenticates clients (CurveZMQ) */
    int compute_missing;              /* [serve] compute_missing */
    int64_t max_new, max_new_per_key; /* [serve] max_new_caches, max_new_caches_per_key */
    int64_t new_made, new_out;        /* caches added this run; grants held by requests in flight */
    int new_full_logged;              /* the "allowance used up" line was logged */
    srv_client *clients;              /* per client key, when front_curve */
    int n_clients, cap_clients;
    const volatile sig_atomic_t *interrupts; /* Ctrl-C / SIGTERM count (kvm_serve_broker.c's handler) */
    const volatile sig_atomic_t *stop_signal; /* the last of those signals (SIGINT or SIGTERM), 0: none */
    double refusal_log_start;                 /* the minute kvm_serve__log_refusal counts lines in, ms */
    int refusal_lines;                        /* lines it logged in that minute */
    int64_t refusal_unlogged;                 /* refusals it counted but did not log in that minute */
} srv;

/* ---- kvm_serve_broker.c: setup ---- */

/* The front end's ZMQ_RCVHWM for frames of at most max_frame_bytes (its ZMQ_MAXMSGSIZE, >= 1):
 * how many requests ZeroMQ may hold unread per client connection, so that they take some 1 GiB
 * per frame (32 for the default 32 MiB frames; at least 1). Pure; thread-safe. */
int kvm_serve__front_rcvhwm(int64_t max_frame_bytes);

/* ---- kvm_serve_front.c: clients ---- */

/* A line on stderr: "kvmill serve: ..." or JSON ([run] log_format). */
void kvm_serve__log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Sends *answer to the client behind *env (takes both). */
void kvm_serve__reply(srv *s, kvm_msg **env, kvm_msg **answer);
/* Sends an error answer to the client behind *env (takes it), counting it as failed. */
void kvm_serve__reply_error(srv *s, kvm_msg **env, uint64_t request_id, int status, const char *why);
/* Removes the queue's i-th request (the caller took it). */
void kvm_serve__queue_remove(srv *s, int64_t i);
/* Handles up to 1000 waiting client messages: each is queued or answered with an error (once
 * *s->interrupts is set: "the server is stopping", at once). */
void kvm_serve__receive_front(srv *s);

/* ---- kvm_serve_grant.c: the [serve] compute_missing allowance ---- */

/* The request that held worker wk's grant ended; new_cache: it added a cache. */
void kvm_serve__grant_done(srv *s, srv_worker *wk, int new_cache);
/* Gives back a grant taken for a request that never reached a worker. */
void kvm_serve__grant_release_unused(srv *s, int client);
/* Sets the request's compute_grant field to whether it may add a cache. */
int kvm_serve__with_grant(srv *s, srv_request *r, int *grant, int *client);
/* The key of the document the ask sends (kind 0 when it names a stored one, or without
 * [serve] compute_missing: nothing to compute). */
void kvm_serve__doc_key(const srv *s, const kvm_proto_ask *ask, srv_doc_key *out);
/* The worker whose granted request in flight computes queued request r's document (r waits for
 * it), or -1 when r need not wait. */
int kvm_serve__doc_holder(const srv *s, const srv_request *r);
/* "text:<64 hex digits>" (or "tokens:...") naming a document key in the log, into out. */
void kvm_serve__doc_name(const srv_doc_key *k, char out[80]);
/* Worker wk's granted request ended as `end` says (why: the reason when it stored nothing, or
 * NULL): the requests held for its document are released (STORED: served from the store, no
 * grant; FOUND: go on), or (UNSTORED) stay held but for the oldest, which computes the cache
 * next. Logged at info level, naming the document key, when any request was held. Call before
 * kvm_serve__grant_done. */
void kvm_serve__doc_release(srv *s, const srv_worker *wk, srv_doc_end end, const char *why);

/* ---- kvm_serve_back.c: decode workers ---- */

/* The worker is gone: its client gets an error; a spawned one is restarted. */
void kvm_serve__worker_dead(srv *s, int w, const char *why);
/* Worker w's control-socket ready named process pid. Another pid than the last one's under the
 * id is a new process (ZeroMQ hears one connection per id: the one that held it is gone, killed
 * and started again before its liveness ran out): the request the old one held is answered
 * with an error now (its client asks again) and its hold on the document and grant released,
 * where the new process's heartbeats kept the worker busy for ever (no request went to it
 * again). */
void kvm_serve__worker_process(srv *s, int w, int64_t pid, uint64_t instance);
/* Handles up to 1000 waiting messages of the control (is_ctl) or data socket. */
void kvm_serve__receive_back(srv *s, void *sock, int is_ctl);
/* Hands queued requests to idle workers. */
void kvm_serve__dispatch(srv *s);

/* ---- kvm_serve_slots.c: decode worker processes ---- */

/* Starts the decode worker process of slot i. */
int kvm_serve__spawn_slot(srv *s, int i);
/* Child exits, silent workers, restarts, request timeouts, the ready line. */
void kvm_serve__check_health(srv *s);
/* Lets the workers finish what they hold (relaying their answers), then stops them. */
void kvm_serve__shutdown_workers(srv *s, int hard);

#endif
