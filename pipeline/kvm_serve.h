/* kvm_serve.h: `kvmill serve`: a load-balancing broker (zguide's lbbroker) between clients
 * and decode workers. Clients (DEALER or REQ) send `ask` messages to a ROUTER front end;
 * decode workers (kvmill-decode, the stage runtime of kvm_stage.h) connect two DEALERs to
 * the back end, ask for work with a `ready` credit on the data socket and report heartbeats
 * and errors on the control socket. The broker gives each idle worker one request at a
 * time, keeps the client's envelope itself and forwards the worker's `answer` to that
 * client, so a worker that dies, fails or times out still gets its client an error answer.
 * It starts N worker processes, respawns them when they die or go silent, and stops them
 * cleanly on SIGTERM / Ctrl-C. Also: the socket-binding rule every server socket shares
 * (local by default, CurveZMQ otherwise) and the helpers the workers use for answers. */
#ifndef KVM_SERVE_H
#define KVM_SERVE_H

#include "pipeline/kvm_config.h"
#include "proto/kvm_proto.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* What `kvmill serve` passes in; NULL / negative fields take the config's values. */
typedef struct kvm_serve_opts {
    const char *config_path; /* config file, handed to every worker as --config (required) */
    const char *store_path;  /* LMDB store the workers read ([store] path when NULL) */
    const char *bind;        /* front end endpoint ([serve] bind when NULL) */
    int workers;             /* decode workers to start ([serve] workers when < 0) */
    const char *bin_dir;     /* folder of kvmill-decode ([stages] bin_dir, else this) */
    const uint8_t *model_id; /* 32 bytes: the model id of [model] path (the store's, as the workers
                                compute it); a worker whose ready names another model is refused
                                (PROTOCOL.md §5, revision 10). NULL: every worker is accepted */
} kvm_serve_opts;

/* Runs the broker until SIGTERM/SIGINT: binds the front end and the back end, starts the
 * workers, relays requests and answers, enforces [serve] max_message_bytes (a larger ask whose
 * document text or bytes makes it large goes to a worker with the document's beginning that
 * fits and doc_size, the worker answering from it or with an error; any other larger request
 * gets an error answer at once naming the size of its large part; ZMQ_MAXMSGSIZE on the front
 * end is the larger of the setting and KVM_PROTO_MAX_HEADER_BYTES, the largest frame of a valid
 * ask, so only a larger frame drops the sending connection unanswered; its ZMQ_RCVHWM holds a
 * connection's unread requests to some 1 GiB per frame), max_queue and request_timeout_s
 * (counted from the request's arrival, its time queued included: a request queued for a worker
 * and one on a worker get their error answer request_timeout_s after they arrived), and bounds
 * what compute_missing may add: each request handed to a worker carries compute_grant, true only
 * while fewer than [serve] max_new_caches caches were added this run (and, when the front end
 * uses CurveZMQ, fewer than max_new_caches_per_key for the client's key), counting requests
 * in flight that hold a grant; the worker's answer says (new_cache) whether it used it.
 * With o->model_id, a worker whose ready names another model is refused (one log line, an error
 * that stops it, no request: PROTOCOL.md §5, revision 10). Logs to stderr, one line
 * per request; prints "kvmill serve: ready ..." once every started worker has reported
 * ready. Installs its own SIGINT/SIGTERM handlers for the duration. Not reentrant (one
 * broker per process). Returns the exit status: 0 after a clean stop, 1 when a socket or
 * process could not be set up or a worker exited 3 times in a row before connecting (its
 * setup failed: bad model, store or config) or one it started runs another model than
 * o->model_id (the model file changed under the server), 2 for a configuration problem (missing kvmill-decode,
 * bad endpoint, non-local endpoint without [security] keys: the message says which),
 * 130 after a second Ctrl-C. */
int kvm_serve_run(const kvm_config *cfg, const kvm_serve_opts *o);

/* Checks an endpoint's form before a bind or connect: tcp://HOST:PORT with PORT a decimal in
 * [0, 65535] or '*' (ZeroMQ takes the port modulo 65536: tcp://127.0.0.1:99999 bound and
 * connected to port 34463 without a word), ipc://PATH or inproc://NAME. `what` names the
 * setting. Returns 0 or KVM_EINVAL naming it and the endpoint. */
int kvm_serve_endpoint_check(const char *endpoint, const char *what);

/* kvm_serve_bind's rules that cfg's settings alone decide (no key file is read): endpoint's
 * form, and the [security] keys a non-local endpoint needs (a local one: authorized_keys only
 * with server_secret_key). what names the setting in messages ("[run] bind in FILE"). Returns 0
 * or KVM_EINVAL with the message; for config checks (--dump-config) and the binds themselves. */
int kvm_serve_bind_rule(const char *endpoint, const kvm_config *cfg, const char *what);

/* The checks kvm_serve_bind makes that the settings alone decide, for [serve] bind and [serve]
 * backend (both its endpoints) of cfg: the endpoint's form (kvm_serve_endpoint_check) and the
 * [security] keys a non-local one needs; no key file is read; an ipc:// one's folder
 * (kvm_serve_ipc_folder_check). For kvmill serve's config checks,
 * which --dump-config shares. bind_what names the bind setting ("--bind"; NULL: "[serve] bind
 * in FILE"). Returns 0 or KVM_EINVAL naming the setting, the config file and the endpoint. */
int kvm_serve_check_endpoints(const kvm_config *cfg, const char *bind_what);

/* The folder an ipc:// endpoint needs: PATH itself when is_dir (a base ipc://DIR whose DIR/ctl and
 * DIR/data are bound: [run] bind, [serve] backend), else the folder of the socket file PATH. A
 * missing one failed only at the bind, exit 1 with "No such file or directory" and no folder named.
 * No check for tcp://, inproc://, ipc://@NAME (abstract) or a file in the working directory;
 * with cfg (may be NULL), none for its [run] run_dir, which kvmill serve and run make before they
 * bind. binds says what is bound there ("the run binds its ctl and data sockets in it"). Returns 0 or
 * KVM_EINVAL with "FOLDER does not exist (or: is not a folder): BINDS; make it first", which
 * the caller prefixes with the setting and endpoint. */
int kvm_serve_ipc_folder_check(const char *endpoint, int is_dir, const kvm_config *cfg, const char *binds);

/* KVM_EINVAL naming `what` and the endpoint when it is inproc:// (a command's bind that no other
 * process can reach: kvmill serve, kvmill store serve said "ready" on one), else 0. */
int kvm_serve_endpoint_external(const char *endpoint, const char *what);

/* Binds a server socket to `endpoint` with kvmill's rule: a non-local endpoint (see
 * kvm_curve_is_local) requires CurveZMQ, i.e. [security] server_secret_key and
 * authorized_keys in cfg; with `curve_if_keyed` a local endpoint uses CurveZMQ too when
 * server_secret_key is set. Under CurveZMQ only clients whose public key is a *.public
 * file in authorized_keys get through (ZAP handler of kvm_curve_server, started in zctx).
 * `what` names the setting in messages ("[serve] bind in FILE", "--bind"). tcp://localhost:PORT
 * binds 127.0.0.1; a bracketed IPv6 address (tcp://[::1]:PORT) turns on ZMQ_IPV6. Call before
 * any connection.
 * Errors: KVM_EINVAL (kvm_serve_endpoint_check's; non-local without keys, or authorized_keys
 * without server_secret_key on any bind (it would check no client): the message names [security]
 * and kvmill keygen; a key file missing or not a key, a server_public_key that is not the secret
 * key's half, an authorized_keys that is no folder: kvm_curve_server's and kvm_curve_check_pair's
 * messages), KVM_EIO (bind failed: names the endpoint and ZeroMQ's reason; CurveZMQ setup). */
int kvm_serve_bind(void *zctx, void *sock, const char *endpoint, const kvm_config *cfg, int curve_if_keyed,
                   const char *what);

/* The socket file of an ipc:// endpoint this process bound (kvm_serve_ipc_note), removed when it
 * exits (kvm_serve_ipc_remove): a clean stop of kvmill serve or the store service left
 * `ipc://PATH` files behind. */
typedef struct kvm_serve_ipc_file {
    char path[1100]; /* "" when the endpoint has no file (tcp://, an abstract socket) */
    dev_t dev;
    ino_t ino;
} kvm_serve_ipc_file;

/* Right after a bind of ep: notes its socket file (path, device and inode) into *f; no file
 * (another transport, nothing there) notes none. */
void kvm_serve_ipc_note(const char *ep, kvm_serve_ipc_file *f);

/* After the socket is closed: removes f's file when it is still the one noted (a socket with the
 * same device and inode; note again after kvm_serve_rebind_if_removed), never one another
 * process bound there since. */
void kvm_serve_ipc_remove(const kvm_serve_ipc_file *f);

/* Binds sock at the ipc:// endpoint ep again when its socket file is gone (a /tmp cleaner, an
 * rm of the run directory), making its folder again (0700) when that went too, and logs it
 * (`what` names the socket: "front end", "back end", "store service"); anything else (the file
 * there, tcp://, an abstract socket) is left alone. For the loops of long-running servers,
 * about once a second. Returns 1 when it bound the socket again (its new file: note it with
 * kvm_serve_ipc_note), else 0. */
int kvm_serve_rebind_if_removed(void *sock, const char *ep, const char *what);

/* The endpoint sock is bound to, as ZeroMQ reports it (ZMQ_LAST_ENDPOINT): a `:0` or `:*`
 * port resolved to the port chosen, localhost as 127.0.0.1. Writes it to out[0, n) and
 * returns 1; writes `fallback` and returns 0 when ZeroMQ has none. */
int kvm_serve_bound_endpoint(void *sock, const char *fallback, char *out, size_t n);

/* When msg, a message a stage back end's socket `sock` (a ROUTER: the ctl (is_ctl) or data
 * endpoint derived from `base` by kvm_stage_endpoints, where workers connect) received from the
 * peer *env routes to, is an ask (a client given the wrong endpoint), answers it there with an
 * error answer (KVM_ENOTSUP) for its request id naming the endpoint, `who` owns it ("kvmill run",
 * "kvmill serve") and where to ask (`ask_at`), and returns 1: the client says why at once instead
 * of waiting its whole --timeout, and no worker entry is made for it. *env is consumed (NULL
 * after). Returns 0, *env kept, for any other message (one peek of its header). A send that
 * fails (the client gone) is not an error: it had nobody to tell. */
int kvm_serve_answer_misdirected(void *sock, kvm_msg **env, const kvm_msg *msg, const char *base, int is_ctl,
                                 const char *who, const char *ask_at);

/* Builds an error `answer` for request_id: status (a kvm_status < 0) and message (a C
 * string: made valid UTF-8 and cut at a character boundary below 4 KiB, kvm_proto_str_utf8,
 * since a message naming a path, or one cut mid-character, would not encode and the client
 * would get no answer at all). *out is new (caller frees or sends).
 * Errors: KVM_EINVAL (status >= 0), KVM_ENOMEM. */
int kvm_serve_error_answer(uint64_t request_id, int status, const char *message, kvm_msg **out);

/* Reads only the "request_id" uint field of frame 0 of a message that may be otherwise
 * malformed (so its sender can get an error answer). Reads nothing beyond frame 0 and
 * allocates nothing. Returns 1 and *id when found, else 0. */
int kvm_serve_request_id(const kvm_msg *msg, uint64_t *id);

/* Receives one message of a ROUTER socket as its routing id (*env, one frame) and the rest
 * (*body; no frame when the peer sent none). flags: 0 or ZMQ_DONTWAIT (the first part). The
 * routing id is read on its own so that a message the body limit refuses (more than
 * KVM_MSG_MAX_FRAMES parts after it) can still be answered: kvm_msg_recv drops such a message
 * whole, its routing id too, and its sender waited for a reply that never came. Returns 0;
 * KVM_EPROTO with *env set and *body NULL for a body of too many parts (drained, the reason in
 * kvm_errmsg); else the error of kvm_msg_recv (KVM_EIO with errno: EAGAIN, ETERM, ...), both
 * NULL. */
int kvm_serve_recv_routed(void *sock, int flags, kvm_msg **env, kvm_msg **body);

#endif
