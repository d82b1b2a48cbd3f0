/* kvm_serve.c: the serving broker: front end (clients), back end (decode workers), the
 * worker processes, the request queue. One thread; every wait is a zmq_poll of at most
 * 100 ms so heartbeats, timeouts, child exits and signals are handled promptly. */
#include "pipeline/kvm_serve.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_svcproc.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_stage.h"
#include "proto/kvm_mpack_internal.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

extern char **environ;

enum { MAX_WORKERS = 256, MAX_EARLY_EXITS = 3 };

/* ---- helpers shared with the decode workers ---- */

int kvm_serve_error_answer(uint64_t request_id, int status, const char *message, kvm_msg **out)
{
    if (status >= 0) return kvm_err(KVM_EINVAL, "error answer with status %d", status);
    size_t n = message ? strlen(message) : 0;
    if (n > KVM_PROTO_MAX_MESSAGE_BYTES) n = KVM_PROTO_MAX_MESSAGE_BYTES;
    if (status < -KVM_PROTO_MAX_STATUS) status = KVM_EINVAL;
    kvm_proto_answer a = {.request_id = request_id, .status = status, .message = {message, n}};
    return kvm_proto_answer_encode(&a, out);
}

int kvm_serve_request_id(const kvm_msg *msg, uint64_t *id)
{
    if (kvm_msg_nframes(msg) < 1) return 0;
    kvm_frame f = kvm_msg_frame(msg, 0);
    kvm_mpr r = {f.data, f.data + f.size};
    uint32_t n;
    if (!f.data || kvm_mpr__map(&r, &n)) return 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *k;
        uint32_t kl;
        if (kvm_mpr__str(&r, &k, &kl)) return 0;
        if (kl == 10 && !memcmp(k, "request_id", 10)) {
            int neg;
            int64_t v;
            uint64_t u;
            if (kvm_mpr__int(&r, &neg, &v, &u) || neg) return 0;
            *id = u;
            return 1;
        }
        if (kvm_mpr__skip(&r)) return 0;
    }
    return 0;
}

/* 1 when a tcp:// endpoint ends in ":PORT" with PORT a decimal in [0, 65535] or '*'. */
static int tcp_port_ok(const char *endpoint)
{
    const char *colon = strrchr(endpoint + 6, ':');
    if (!colon || colon == endpoint + 6 || (colon[-1] == ':' && endpoint[6] == '[')) return 0; /* no port; "[::1" */
    if (!strcmp(colon + 1, "*")) return 1;
    long port = 0;
    const char *p = colon + 1;
    for (; *p >= '0' && *p <= '9' && port <= 65535; p++) port = port * 10 + (*p - '0');
    return p > colon + 1 && !*p && port <= 65535;
}

int kvm_serve_endpoint_check(const char *endpoint, const char *what)
{
    if (strncmp(endpoint, "tcp://", 6) && strncmp(endpoint, "ipc://", 6) && strncmp(endpoint, "inproc://", 9))
        return kvm_err(KVM_EINVAL, "%s '%s' is not an endpoint: expected tcp://HOST:PORT or ipc://PATH", what, endpoint);
    if (!strncmp(endpoint, "tcp://", 6) && endpoint[6] == ':') /* ZeroMQ would take it for no interface */
        return kvm_err(KVM_EINVAL, "%s '%s': the host is empty (tcp://HOST:PORT; '*' binds every interface)", what,
                       endpoint);
    if (!strncmp(endpoint, "tcp://", 6) && !tcp_port_ok(endpoint))
        return kvm_err(KVM_EINVAL, "%s '%s': the port is not a number in [0, 65535] or '*' (tcp://HOST:PORT)", what,
                       endpoint);
    /* a Unix socket path holds sizeof sun_path - 1 bytes (107 on Linux): a deep [run] run_dir or
     * TMPDIR failed as "cannot bind ...: File name too long", naming neither limit nor folder */
    size_t max_path = sizeof(((struct sockaddr_un *)0)->sun_path) - 1;
    if (!strncmp(endpoint, "ipc://", 6) && strlen(endpoint + 6) > max_path)
        return kvm_err(KVM_EINVAL, "%s '%s': the socket path is %zu bytes, more than the %zu a Unix socket path "
                                   "takes: use a shorter folder ([run] run_dir, or TMPDIR for a temporary run directory)",
                       what, endpoint, strlen(endpoint + 6), max_path);
    return 0;
}

/* A [security] key file that is missing, not a key, not the public half of the secret one, or an
 * authorized_keys that is not a folder is the config's mistake: KVM_EINVAL (exit 2), message kept. */
static int key_error(int rc)
{
    return rc == KVM_ENOTFOUND || rc == KVM_EFORMAT || rc == KVM_EMISMATCH ? kvm_err(KVM_EINVAL, "%s", kvm_errmsg()) : rc;
}

/* 1 when endpoint is ipc://PATH and a process accepts connections on PATH. ZeroMQ unlinks the
 * path before it binds, so a second server on the same ipc endpoint (or the same [run] run_dir)
 * silently took the socket: the first one's workers, when respawned, joined the second, and the
 * first answered no request again. A path nobody listens on (left by a process that died) is
 * bound as before. */
static int ipc_in_use(const char *endpoint)
{
    if (strncmp(endpoint, "ipc://", 6) || endpoint[6] == '@') return 0; /* '@': abstract, never unlinked */
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if (strlen(endpoint + 6) >= sizeof a.sun_path) return 0;
    memcpy(a.sun_path, endpoint + 6, strlen(endpoint + 6));
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    int up = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return up;
}

int kvm_serve_bind(void *zctx, void *sock, const char *endpoint, const kvm_config *cfg, int curve_if_keyed,
                   const char *what)
{
    const char *sec = kvm_config_str(cfg, "security", "server_secret_key");
    const char *auth = kvm_config_str(cfg, "security", "authorized_keys");
    int rc = kvm_serve_endpoint_check(endpoint, what);
    if (rc) return rc;
    int local = kvm_curve_is_local(endpoint);
    if (*auth && !*sec) /* on a local bind nothing would check the clients' keys, and nobody would know */
        return kvm_err(KVM_EINVAL,
                       "%s %s: [security] authorized_keys is set but server_secret_key is not: clients' keys are "
                       "checked only by a CurveZMQ server (make its key pair with kvmill keygen), or drop "
                       "authorized_keys",
                       what, endpoint);
    if (!local && (!*sec || !*auth))
        return kvm_err(KVM_EINVAL,
                       "%s %s is not local: set [security] server_secret_key and authorized_keys "
                       "(make keys with kvmill keygen), or bind ipc:// or tcp://127.0.0.1",
                       what, endpoint);
    if (!local || (curve_if_keyed && *sec)) {
        if (!*auth) return kvm_err(KVM_EINVAL, "[security] server_secret_key is set but authorized_keys is not");
        const char *pub = kvm_config_str(cfg, "security", "server_public_key");
        if (*pub && (rc = kvm_curve_check_pair(sec, pub))) return key_error(rc); /* clients get pub: it must match */
        if ((rc = kvm_curve_server(zctx, sock, sec, auth))) return key_error(rc);
    }
    /* ZeroMQ binds to interfaces and numeric addresses only: "localhost" would be taken for an
     * interface name ("No such device"), and a bracketed IPv6 address needs ZMQ_IPV6 */
    char ep[1100];
    snprintf(ep, sizeof ep, "%s", endpoint);
    if (!strncmp(endpoint, "tcp://localhost:", 16)) snprintf(ep, sizeof ep, "tcp://127.0.0.1:%s", endpoint + 16);
    if (!strncmp(ep, "tcp://[", 7)) {
        int one = 1;
        if (zmq_setsockopt(sock, ZMQ_IPV6, &one, sizeof one))
            return kvm_err(KVM_EIO, "%s: cannot enable IPv6 for %s: %s", what, endpoint, zmq_strerror(errno));
    }
    struct stat ist; /* ZeroMQ unlinks the path first: a file there (a run_dir holding a file named
                      * "data" or "ctl") was deleted without a word */
    if (!strncmp(endpoint, "ipc://", 6) && endpoint[6] != '@' && lstat(endpoint + 6, &ist) == 0 &&
        !S_ISSOCK(ist.st_mode))
        return kvm_err(KVM_EINVAL,
                       "%s: cannot bind %s: %s exists and is not a socket (binding would delete it): choose another "
                       "endpoint or [run] run_dir, or move it away",
                       what, endpoint, endpoint + 6);
    if (ipc_in_use(endpoint))
        return kvm_err(KVM_EIO,
                       "%s: cannot bind %s: another process is listening on that socket (a second kvmill serve, "
                       "run or store service with the same endpoint or [run] run_dir?); stop it or choose another",
                       what, endpoint);
    if (zmq_bind(sock, ep)) return kvm_err(KVM_EIO, "%s: cannot bind %s: %s", what, endpoint, zmq_strerror(errno));
    return 0;
}

int kvm_serve_bound_endpoint(void *sock, const char *fallback, char *out, size_t n)
{
    size_t len = n;
    if (n == 0) return 0;
    if (sock && zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, out, &len) == 0 && len > 1 && out[0]) return 1;
    snprintf(out, n, "%s", fallback ? fallback : "");
    return 0;
}

/* ---- broker state ---- */

typedef struct srv_slot {
    pid_t pid;         /* running process, 0 when none */
    int respawns;      /* times restarted */
    char id[256];      /* worker id of the current process */
    double started_ms; /* when the current process was spawned */
    double respawn_at; /* when to start it again (0: not waiting) */
    int early_exits;   /* consecutive exits before the process ever connected */
} srv_slot;

/* New caches [serve] compute_missing added (or is adding) for one client key. */
typedef struct srv_client {
    char key[48];  /* the client's CurveZMQ public key, Z85 */
    int64_t made;  /* caches added for it this server run */
    int64_t out;   /* grants held by requests in flight */
} srv_client;

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
    int grant;           /* the busy request may add a cache (compute_grant): one grant held */
    int grant_client;    /* index in srv.clients of the grant's client key, or -1 */
} srv_worker;

typedef struct srv_request {
    kvm_msg *env;        /* client envelope (routing id, and the empty delimiter of a REQ) */
    kvm_msg *msg;        /* the ask */
    uint64_t request_id; /* its request id */
    double t_recv;       /* arrival, ms */
    char key[48];        /* the client's CurveZMQ key (the message's User-Id), "" without CurveZMQ */
} srv_request;

typedef struct srv {
    const kvm_config *cfg;
    const kvm_serve_opts *o;
    void *zctx, *front, *ctl, *data;
    char front_ep[1024], base[1024], run_dir[1024], bin_dir[1024], store_path[4096];
    int own_run_dir, backend_curve, announced;
    int fatal; /* a worker slot keeps failing before it connects: stop serving */
    kvm_svcproc svc; /* the store service for decode workers on other hosts ([store] service_bind) */
    srv_slot slots[MAX_WORKERS];
    int n_slots;
    srv_worker workers[MAX_WORKERS];
    int n_workers;
    srv_request *queue;
    int64_t n_queue, cap_queue, max_queue;
    double hb_ms, dead_ms, timeout_ms;
    int64_t max_msg_bytes;
    uint64_t served, failed;
    int front_curve;                   /* the front end authenticates clients (CurveZMQ) */
    int compute_missing;               /* [serve] compute_missing */
    int64_t max_new, max_new_per_key;  /* [serve] max_new_caches, max_new_caches_per_key */
    int64_t new_made, new_out;         /* caches added this run; grants held by requests in flight */
    int new_full_logged;               /* the "allowance used up" line was logged */
    srv_client *clients;               /* per client key, when front_curve */
    int n_clients, cap_clients;
} srv;

static volatile sig_atomic_t interrupts;
static void on_signal(int sig)
{
    (void)sig;
    interrupts++;
}

static void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_line(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvm_logv(KVM_LOG_INFO, "message", NULL, 0, fmt, ap); /* "kvmill serve: ..." or JSON ([run] log_format) */
    va_end(ap);
}

/* ---- replies to clients ---- */

/* Sends *answer to the client behind *env (takes both). */
static void reply(srv *s, kvm_msg **env, kvm_msg **answer)
{
    int rc = kvm_msg_join(*env, answer);
    if (!rc) rc = kvm_msg_send(s->front, env, ZMQ_DONTWAIT);
    if (rc) log_line("could not send an answer: client gone (%s)", zmq_strerror(errno));
    kvm_msg_free(env);
    kvm_msg_free(answer);
}

static void reply_error(srv *s, kvm_msg **env, uint64_t request_id, int status, const char *why)
{
    kvm_msg *a = NULL;
    s->failed++;
    if (kvm_serve_error_answer(request_id, status, why, &a)) {
        kvm_msg_free(env);
        return;
    }
    reply(s, env, &a);
}

/* ---- processes ---- */

static int spawn_slot(srv *s, int i)
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
    char *argv[28] = {exe,       "--connect",   s->base,     "--config", (char *)s->o->config_path,
                      "--store", s->store_path, "--threads", threads,    "--heartbeat-ms",
                      hb,        "--grace-s",   grace,       "--id",     sl->id, "--parent-pid", ppid,
                      "--device", dev};
    int n = 19;
    if (s->backend_curve) {
        argv[n++] = "--server-key";
        argv[n++] = (char *)kvm_config_str(s->cfg, "security", "server_public_key");
        argv[n++] = "--client-public";
        argv[n++] = (char *)kvm_config_str(s->cfg, "security", "client_public_key");
        argv[n++] = "--client-secret";
        argv[n++] = (char *)kvm_config_str(s->cfg, "security", "client_secret_key");
    }
    argv[n] = NULL;
    posix_spawnattr_t at;
    posix_spawnattr_init(&at);
    sigset_t def;
    sigemptyset(&def);
    sigaddset(&def, SIGINT);
    sigaddset(&def, SIGTERM);
    posix_spawnattr_setsigdefault(&at, &def);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP); /* Ctrl-C reaches the broker only */
    int rc = posix_spawn(&sl->pid, exe, NULL, &at, argv, environ);
    posix_spawnattr_destroy(&at);
    sl->respawn_at = 0;
    sl->started_ms = kvm_now_ms();
    if (rc) {
        sl->pid = 0;
        return kvm_err(KVM_EIO, "cannot start %s: %s", exe, strerror(rc));
    }
    return 0;
}

static void stop_children(srv *s, int sig)
{
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].pid > 0) kill(s->slots[i].pid, sig);
}

/* ---- workers ---- */

static int worker_find(srv *s, const kvm_frame *idf, int create)
{
    char id[256];
    size_t n = idf->size < sizeof id - 1 ? idf->size : sizeof id - 1;
    memcpy(id, idf->data, n);
    id[n] = '\0';
    for (int w = 0; w < s->n_workers; w++)
        if (!strcmp(s->workers[w].id, id)) return w;
    if (!create) return -1;
    int w = -1;
    for (int k = 0; k < s->n_workers && w < 0; k++) /* reuse the entry of a dead worker */
        if (!s->workers[k].alive && !s->workers[k].busy) w = k;
    if (w < 0) {
        if (s->n_workers == MAX_WORKERS) return -1;
        w = s->n_workers++;
    }
    srv_worker *wk = &s->workers[w];
    *wk = (srv_worker){.alive = 1, .slot = -1, .last_seen = kvm_now_ms()};
    snprintf(wk->id, sizeof wk->id, "%s", id);
    for (int i = 0; i < s->n_slots; i++)
        if (!strcmp(s->slots[i].id, id)) wk->slot = i, s->slots[i].early_exits = 0;
    if (wk->slot >= 0)
        log_line("decode worker %s joined (started by this server)", id);
    else
        log_line("external decode worker %s joined", id);
    return w;
}

/* ---- [serve] compute_missing allowance: max_new_caches per run, max_new_caches_per_key ---- */

/* Index of the client entry for key (created when absent), or -1 without a key / memory. */
static int client_slot(srv *s, const char *key)
{
    if (!key || !*key) return -1;
    for (int i = 0; i < s->n_clients; i++)
        if (!strcmp(s->clients[i].key, key)) return i;
    if (s->n_clients == s->cap_clients) {
        int cap = s->cap_clients ? 2 * s->cap_clients : 8;
        srv_client *c = realloc(s->clients, (size_t)cap * sizeof *c);
        if (!c) return -1;
        s->clients = c;
        s->cap_clients = cap;
    }
    srv_client *c = &s->clients[s->n_clients];
    memset(c, 0, sizeof *c);
    snprintf(c->key, sizeof c->key, "%s", key);
    return s->n_clients++;
}

/* Whether a request from `key` may add a cache: the run's allowance, and the key's when the
 * front end authenticates clients, each counting the grants in flight. On yes, one grant is
 * held for it (released by grant_done) and *client is its client entry. */
static int grant_take(srv *s, const char *key, int *client)
{
    *client = -1;
    if (!s->compute_missing || s->new_made + s->new_out >= s->max_new) return 0;
    if (s->front_curve) {
        int c = client_slot(s, key);
        if (c < 0) return 0; /* a keyed front end without a key: not expected; refuse */
        if (s->clients[c].made + s->clients[c].out >= s->max_new_per_key) return 0;
        s->clients[c].out++;
        *client = c;
    }
    s->new_out++;
    return 1;
}

/* The request that held worker wk's grant ended; new_cache: it added a cache. */
static void grant_done(srv *s, srv_worker *wk, int new_cache)
{
    if (!wk->grant) return;
    wk->grant = 0;
    s->new_out--;
    srv_client *c = wk->grant_client >= 0 ? &s->clients[wk->grant_client] : NULL;
    if (c) c->out--;
    if (!new_cache) return;
    s->new_made++;
    if (c) c->made++;
    if (c)
        log_line("request %llu added a cache: %lld of [serve] max_new_caches = %lld this run, %lld of "
                 "max_new_caches_per_key = %lld for client key %.8s...",
                 (unsigned long long)wk->request_id, (long long)s->new_made, (long long)s->max_new, (long long)c->made,
                 (long long)s->max_new_per_key, c->key);
    else
        log_line("request %llu added a cache: %lld of [serve] max_new_caches = %lld this run",
                 (unsigned long long)wk->request_id, (long long)s->new_made, (long long)s->max_new);
    if (c && c->made >= s->max_new_per_key)
        log_line("client key %.8s... has added its [serve] max_new_caches_per_key = %lld caches: its missing caches "
                 "are refused from now on",
                 c->key, (long long)s->max_new_per_key);
    if (s->new_made >= s->max_new && !s->new_full_logged) {
        s->new_full_logged = 1;
        log_line("[serve] max_new_caches = %lld caches added: missing caches are refused from now on (compress them "
                 "with kvmill run)",
                 (long long)s->max_new);
    }
}

/* The worker is gone: its client gets an error; a spawned one is restarted. */
static void worker_dead(srv *s, int w, const char *why)
{
    srv_worker *wk = &s->workers[w];
    if (!wk->alive && !wk->busy) return;
    log_line("decode worker %s %s", wk->id, why);
    if (wk->busy && wk->env) {
        char msg[512];
        snprintf(msg, sizeof msg, "decode worker %s %s while answering; try again", wk->id, why);
        reply_error(s, &wk->env, wk->request_id, KVM_EIO, msg);
    }
    kvm_msg_free(&wk->env);
    grant_done(s, wk, 0);
    wk->alive = wk->idle = wk->busy = 0;
    if (wk->slot >= 0 && !interrupts) {
        srv_slot *sl = &s->slots[wk->slot];
        if (sl->pid > 0) {
            kill(sl->pid, SIGKILL);
            waitpid(sl->pid, NULL, 0);
            sl->pid = 0;
        }
        /* a process that dies right after starting is restarted after a pause, not in a loop */
        double now = kvm_now_ms();
        sl->respawn_at = now - sl->started_ms < 5000 ? now + 2000 : now;
        sl->respawns++;
    }
    wk->slot = -1;
}

/* ---- the queue ---- */

static int queue_push(srv *s, srv_request r)
{
    if (s->n_queue >= s->max_queue) return KVM_EFULL;
    if (s->n_queue == s->cap_queue) {
        int64_t cap = s->cap_queue ? 2 * s->cap_queue : 16;
        srv_request *q = realloc(s->queue, (size_t)cap * sizeof *q);
        if (!q) return KVM_ENOMEM;
        s->queue = q;
        s->cap_queue = cap;
    }
    s->queue[s->n_queue++] = r;
    return 0;
}

static void queue_remove(srv *s, int64_t i)
{
    memmove(&s->queue[i], &s->queue[i + 1], (size_t)(s->n_queue - i - 1) * sizeof *s->queue);
    s->n_queue--;
}

/* ---- front end ---- */

static void on_request(srv *s, kvm_msg **env, kvm_msg **m)
{
    size_t bytes = 0;
    for (size_t f = 0; f < kvm_msg_nframes(*m); f++)
        bytes += kvm_msg_frame(*m, f).size;
    uint64_t rid = 0;
    int has_id = kvm_serve_request_id(*m, &rid);
    char why[1024];
    int status = 0;
    kvm_proto_type t;
    kvm_proto_ask ask;
    if ((int64_t)bytes > s->max_msg_bytes) {
        status = KVM_ERANGE;
        snprintf(why, sizeof why, "request of %zu bytes exceeds [serve] max_message_bytes = %lld", bytes,
                 (long long)s->max_msg_bytes);
    } else if (kvm_proto_peek(*m, &t)) {
        status = KVM_EPROTO;
        snprintf(why, sizeof why, "malformed request: %s", kvm_errmsg());
    } else if (t != KVM_PROTO_ASK) {
        status = KVM_ENOTSUP;
        snprintf(why, sizeof why, "unexpected %s message: this server answers ask", kvm_proto_type_name(t));
    } else if (kvm_proto_ask_decode(*m, &ask)) {
        status = KVM_EPROTO;
        snprintf(why, sizeof why, "malformed ask: %s", kvm_errmsg());
    } else
        rid = ask.request_id;
    if (status) {
        if (has_id) {
            log_line("request %llu refused: %s", (unsigned long long)rid, why);
            reply_error(s, env, rid, status, why);
        } else
            log_line("dropped a message from a client: %s", why);
        kvm_msg_free(env);
        kvm_msg_free(m);
        return;
    }
    srv_request r = {.env = *env, .msg = *m, .request_id = rid, .t_recv = kvm_now_ms()};
    const char *uid = kvm_msg_user_id(*m);
    snprintf(r.key, sizeof r.key, "%s", uid ? uid : "");
    if (queue_push(s, r)) {
        snprintf(why, sizeof why, "server busy: %lld requests are waiting ([serve] max_queue); try again later",
                 (long long)s->n_queue);
        reply_error(s, env, rid, KVM_EFULL, why);
        kvm_msg_free(m);
        return;
    }
    *env = *m = NULL;
}

static void receive_front(srv *s)
{
    for (int k = 0; k < 1000; k++) {
        kvm_msg *m = NULL, *env = NULL;
        if (kvm_msg_recv(s->front, &m, ZMQ_DONTWAIT)) {
            if (errno != EAGAIN && errno != EINTR) log_line("dropped a message from a client: %s", kvm_errmsg());
            return;
        }
        size_t nf = kvm_msg_nframes(m);
        /* a REQ client puts an empty delimiter after its routing id: keep it in the envelope */
        size_t ne = nf >= 3 && kvm_msg_frame(m, 1).size == 0 ? 2 : 1;
        if (nf <= ne || kvm_msg_split(m, ne, &env)) {
            log_line("dropped an empty message from a client");
            kvm_msg_free(&m);
            continue;
        }
        if (interrupts) {
            uint64_t rid = 0;
            kvm_serve_request_id(m, &rid);
            reply_error(s, &env, rid, KVM_ESTATE, "server is stopping");
            kvm_msg_free(&m);
            continue;
        }
        on_request(s, &env, &m);
    }
}

/* ---- back end ---- */

static void on_worker_data(srv *s, int w, kvm_msg **m)
{
    srv_worker *wk = &s->workers[w];
    kvm_proto_type t;
    if (kvm_proto_peek(*m, &t)) {
        log_line("dropped a malformed message from worker %s: %s", wk->id, kvm_errmsg());
        return;
    }
    if (t == KVM_PROTO_READY) {
        if (!wk->busy) wk->idle = 1;
        return;
    }
    if (t != KVM_PROTO_ANSWER) {
        log_line("dropped an unexpected %s from worker %s", kvm_proto_type_name(t), wk->id);
        return;
    }
    kvm_proto_answer a;
    int ok = kvm_proto_answer_decode(*m, &a) == 0;
    if (!wk->busy || (ok && a.request_id != wk->request_id)) {
        log_line("dropped an answer from worker %s that no client waits for", wk->id);
        return;
    }
    wk->busy = 0;
    grant_done(s, wk, ok && a.new_cache);
    double ms = kvm_now_ms() - wk->t_sent;
    if (!wk->env) {
        log_line("request %llu: answer from %s arrived after the client's timeout (%.0f ms); dropped",
                 (unsigned long long)wk->request_id, wk->id, ms);
        return;
    }
    if (!ok) {
        char why[600];
        snprintf(why, sizeof why, "decode worker %s sent a malformed answer: %s", wk->id, kvm_errmsg());
        log_line("request %llu: %s", (unsigned long long)wk->request_id, why);
        reply_error(s, &wk->env, wk->request_id, KVM_EPROTO, why);
        return;
    }
    if (a.status == 0)
        s->served++;
    else
        s->failed++;
    log_line("request %llu answered by %s: %s, %lld tokens, %.1f ms%s%.*s", (unsigned long long)a.request_id, wk->id,
             a.status ? kvm_strerror(a.status) : "ok", (long long)a.n_tokens, ms, a.status ? ": " : "",
             a.status ? (int)a.message.len : 0, a.message.ptr ? a.message.ptr : "");
    reply(s, &wk->env, m);
}

static void on_worker_ctl(srv *s, int w, kvm_msg *m)
{
    srv_worker *wk = &s->workers[w];
    kvm_proto_type t;
    if (kvm_proto_peek(m, &t)) {
        log_line("dropped a malformed control message from %s: %s", wk->id, kvm_errmsg());
        return;
    }
    if (t != KVM_PROTO_ERROR) return; /* ready, heartbeat, result: liveness only */
    kvm_proto_error e;
    if (kvm_proto_error_decode(m, &e)) {
        log_line("dropped a bad error message from %s: %s", wk->id, kvm_errmsg());
        return;
    }
    if (!wk->busy) return;
    wk->busy = 0;
    grant_done(s, wk, 0);
    if (!wk->env) return;
    char why[1024];
    snprintf(why, sizeof why, "decode worker %s failed: %.*s", wk->id, (int)(e.message.len < 900 ? e.message.len : 900),
             e.message.ptr ? e.message.ptr : "");
    log_line("request %llu: %s", (unsigned long long)wk->request_id, why);
    reply_error(s, &wk->env, wk->request_id, e.status < 0 ? e.status : KVM_EIO, why);
}

static void receive_back(srv *s, void *sock, int is_ctl)
{
    for (int k = 0; k < 1000; k++) {
        kvm_msg *m = NULL, *env = NULL;
        if (kvm_msg_recv(sock, &m, ZMQ_DONTWAIT)) return;
        if (kvm_msg_nframes(m) >= 2 && kvm_msg_split(m, 1, &env) == 0) {
            kvm_frame idf = kvm_msg_frame(env, 0);
            int w = worker_find(s, &idf, 1);
            if (w >= 0) {
                srv_worker *wk = &s->workers[w];
                wk->last_seen = kvm_now_ms();
                wk->alive = 1;
                if (is_ctl)
                    on_worker_ctl(s, w, m);
                else
                    on_worker_data(s, w, &m);
            }
        }
        kvm_msg_free(&env);
        kvm_msg_free(&m);
    }
}

/* ---- scheduling and health ---- */

/* Gives back a grant taken for a request that never reached a worker. */
static void grant_release_unused(srv *s, int client)
{
    s->new_out--;
    if (client >= 0) s->clients[client].out--;
}

/* Sets the request's compute_grant field (re-encoding the ask) to whether it may add a cache;
 * the client's own value never passes. *grant = 1 when a grant is held for it. */
static int with_grant(srv *s, srv_request *r, int *grant, int *client)
{
    kvm_proto_ask ask;
    *grant = 0;
    *client = -1;
    int rc = kvm_proto_ask_decode(r->msg, &ask); /* decoded fine on arrival */
    if (rc) return rc;
    if (!s->compute_missing && !ask.compute_grant) return 0; /* nothing to grant, nothing to overwrite */
    /* a stored document named by hash or name is never computed: no grant to hold */
    if (!ask.has_doc_hash && ask.doc_name.len == 0) *grant = grant_take(s, r->key, client);
    ask.compute_grant = *grant != 0;
    kvm_msg *m = NULL;
    if ((rc = kvm_proto_ask_encode(&ask, &m))) return rc;
    kvm_msg_free(&r->msg);
    r->msg = m;
    return 0;
}

static void dispatch(srv *s)
{
    while (s->n_queue > 0) {
        int w = -1;
        for (int k = 0; k < s->n_workers && w < 0; k++)
            if (s->workers[k].alive && s->workers[k].idle && !s->workers[k].busy) w = k;
        if (w < 0) return;
        srv_worker *wk = &s->workers[w];
        srv_request r = s->queue[0];
        queue_remove(s, 0);
        int client = -1, grant = 0, rc = 0;
        if ((rc = with_grant(s, &r, &grant, &client))) {
            if (grant) grant_release_unused(s, client);
            reply_error(s, &r.env, r.request_id, rc, kvm_errmsg());
            kvm_msg_free(&r.msg);
            continue;
        }
        kvm_msg *env = NULL;
        rc = kvm_msg_new(&env);
        if (!rc) rc = kvm_msg_add_copy(env, wk->id, strlen(wk->id));
        if (!rc) rc = kvm_msg_join(env, &r.msg);
        if (!rc) rc = kvm_msg_send(s->data, &env, ZMQ_DONTWAIT);
        kvm_msg_free(&env);
        kvm_msg_free(&r.msg);
        wk->idle = 0;
        wk->grant = grant;
        wk->grant_client = client;
        wk->request_id = r.request_id;
        if (rc) {
            worker_dead(s, w, "could not be reached");
            reply_error(s, &r.env, r.request_id, KVM_EIO, "the decode worker could not be reached; try again");
            continue;
        }
        wk->busy = 1;
        wk->env = r.env;
        wk->request_id = r.request_id;
        wk->t_sent = kvm_now_ms();
    }
}

static void check_health(srv *s)
{
    double now = kvm_now_ms();
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        if (s->svc.pid > 0 && pid == s->svc.pid) {
            s->svc.pid = 0;
            log_line("the store service exited (%s %d): starting it again", WIFSIGNALED(st) ? "signal" : "status",
                     WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            if (s->svc.restarts >= 20 || kvm_svcproc_restart(&s->svc, 10000))
                log_line("the store service cannot be restarted: %s", s->svc.restarts >= 20 ? "it died 20 times" : kvm_errmsg());
            continue;
        }
        for (int i = 0; i < s->n_slots; i++) {
            if (s->slots[i].pid != pid) continue;
            s->slots[i].pid = 0;
            char why[128];
            snprintf(why, sizeof why, "exited (%s %d)", WIFSIGNALED(st) ? "signal" : "status",
                     WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
            int found = 0;
            for (int w = 0; w < s->n_workers; w++)
                if (s->workers[w].slot == i) worker_dead(s, w, why), found = 1;
            if (!found && !interrupts) { /* died before it ever said ready */
                log_line("decode worker %s %s before connecting", s->slots[i].id, why);
                s->slots[i].respawn_at = now + 1000;
                s->slots[i].respawns++;
                if (++s->slots[i].early_exits >= MAX_EARLY_EXITS) s->fatal = 1;
            }
        }
    }
    for (int w = 0; w < s->n_workers; w++)
        if ((s->workers[w].alive || s->workers[w].busy) && now - s->workers[w].last_seen > s->dead_ms)
            worker_dead(s, w, "went silent");
    for (int i = 0; i < s->n_slots && !interrupts; i++)
        if (s->slots[i].pid == 0 && s->slots[i].respawn_at > 0 && now >= s->slots[i].respawn_at && spawn_slot(s, i))
            log_line("%s", kvm_errmsg());
    /* requests past their deadline, queued or in flight */
    for (int64_t i = 0; i < s->n_queue;) {
        if (now - s->queue[i].t_recv > s->timeout_ms) {
            srv_request r = s->queue[i];
            queue_remove(s, i);
            log_line("request %llu timed out waiting for a free decode worker", (unsigned long long)r.request_id);
            reply_error(s, &r.env, r.request_id, KVM_EIO,
                        "timed out waiting for a free decode worker ([serve] request_timeout_s)");
            kvm_msg_free(&r.msg);
        } else
            i++;
    }
    for (int w = 0; w < s->n_workers; w++) {
        srv_worker *wk = &s->workers[w];
        if (wk->busy && wk->env && now - wk->t_sent > s->timeout_ms) {
            log_line("request %llu timed out on worker %s", (unsigned long long)wk->request_id, wk->id);
            reply_error(s, &wk->env, wk->request_id, KVM_EIO,
                        "the decode worker did not answer in time ([serve] request_timeout_s)");
        }
    }
    if (!s->announced) {
        int up = 0;
        for (int w = 0; w < s->n_workers; w++)
            up += s->workers[w].alive && s->workers[w].slot >= 0;
        if (up >= s->n_slots) {
            s->announced = 1;
            log_line("ready: front end %s, %d decode worker(s), back end %s", s->front_ep, up, s->base);
        }
    }
}

/* ---- setup ---- */


static int prepare(srv *s)
{
    const kvm_config *cfg = s->cfg;
    /* a device this host cannot use is refused before anything starts */
    if (s->n_slots > 0 && kvm_stage_check_devices("[serve] devices", kvm_config_str(cfg, "serve", "devices")))
        return KVM_EINVAL;
    int rc0 = kvm_rundir_make(kvm_config_str(cfg, "run", "run_dir"), "serve", s->run_dir, sizeof s->run_dir,
                              &s->own_run_dir);
    if (rc0) return rc0;
    const char *sb = kvm_config_str(cfg, "store", "service_bind");
    if (*sb && strncmp(s->store_path, "tcp://", 6) && strncmp(s->store_path, "ipc://", 6)) { /* the store's host */
        char log[2200];
        snprintf(log, sizeof log, "%s/store.log", s->run_dir);
        if ((rc0 = kvm_svcproc_start(&s->svc, s->bin_dir, s->store_path, sb, kvm_config_path(cfg), log, 10000))) return rc0;
        log_line("store service on %s (pid %ld, log %s)", sb, (long)s->svc.pid, log);
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
        if (*kvm_config_str(cfg, "security", "server_secret_key") && *auth && !stat(auth, &ast) && S_ISDIR(ast.st_mode) &&
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
    int64_t maxmsg = s->max_msg_bytes;
    void *socks[3] = {s->front, s->ctl, s->data};
    for (int i = 0; i < 3; i++) {
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(socks[i], ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    }
    if (zmq_setsockopt(s->front, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg))
        return kvm_err(KVM_EIO, "ZMQ_MAXMSGSIZE: %s", zmq_strerror(errno));
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
    /* the ready line shows what was bound: a :0 or :* port as the port the system chose */
    char bound[1024];
    if (kvm_serve_bound_endpoint(s->front, s->front_ep, bound, sizeof bound))
        snprintf(s->front_ep, sizeof s->front_ep, "%s", bound);
    for (int i = 0; i < s->n_slots; i++)
        if ((rc = spawn_slot(s, i))) return rc;
    return 0;
}

/* Lets the workers finish what they hold (relaying their answers), then stops them. */
static void shutdown_workers(srv *s, int hard)
{
    stop_children(s, hard ? SIGKILL : SIGTERM);
    double end = kvm_now_ms() + (hard ? 200 : 1000.0 * (double)kvm_config_int(s->cfg, "run", "grace_s") + 2000);
    for (;;) {
        int left = 0;
        for (int i = 0; i < s->n_slots; i++) {
            if (s->slots[i].pid <= 0) continue;
            if (waitpid(s->slots[i].pid, NULL, WNOHANG) == s->slots[i].pid)
                s->slots[i].pid = 0;
            else
                left++;
        }
        if (!left || interrupts >= 2) break;
        if (kvm_now_ms() > end) {
            stop_children(s, SIGKILL);
            break;
        }
        zmq_pollitem_t items[2] = {{s->ctl, 0, ZMQ_POLLIN, 0}, {s->data, 0, ZMQ_POLLIN, 0}};
        zmq_poll(items, 2, 50);
        if (items[0].revents & ZMQ_POLLIN) receive_back(s, s->ctl, 1);
        if (items[1].revents & ZMQ_POLLIN) receive_back(s, s->data, 0);
    }
    stop_children(s, SIGKILL);
    for (int i = 0; i < s->n_slots; i++)
        if (s->slots[i].pid > 0) waitpid(s->slots[i].pid, NULL, 0), s->slots[i].pid = 0;
    /* whoever still waits gets told */
    for (int w = 0; w < s->n_workers; w++)
        if (s->workers[w].busy && s->workers[w].env)
            reply_error(s, &s->workers[w].env, s->workers[w].request_id, KVM_ESTATE, "server stopped before answering");
    while (s->n_queue > 0) {
        srv_request r = s->queue[0];
        queue_remove(s, 0);
        reply_error(s, &r.env, r.request_id, KVM_ESTATE, "server stopped before answering");
        kvm_msg_free(&r.msg);
    }
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
    struct sigaction sa = {.sa_handler = on_signal}, old_int, old_term;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    signal(SIGPIPE, SIG_IGN);
    interrupts = 0;
    int rc = prepare(&s), status = 0;
    if (rc) {
        status = rc == KVM_EINVAL ? 2 : 1;
        /* a refusal to start (README, "Seeing a run": event "refused"), as the command's own are */
        kvm_log(KVM_LOG_ERROR, status == 2 ? "refused" : "message", NULL, 0, "%s", kvm_errmsg());
    } else {
        if (s.n_slots == 0) log_line("ready: front end %s, no decode workers started; back end %s", s.front_ep, s.base);
        while (!interrupts && !s.fatal) {
            zmq_pollitem_t items[3] = {
                {s.front, 0, ZMQ_POLLIN, 0}, {s.ctl, 0, ZMQ_POLLIN, 0}, {s.data, 0, ZMQ_POLLIN, 0}};
            zmq_poll(items, 3, 100);
            if (items[1].revents & ZMQ_POLLIN) receive_back(&s, s.ctl, 1);
            if (items[2].revents & ZMQ_POLLIN) receive_back(&s, s.data, 0);
            if (items[0].revents & ZMQ_POLLIN) receive_front(&s);
            check_health(&s);
            dispatch(&s);
        }
        if (s.fatal) {
            log_line("decode workers exit %d times in a row before connecting (see their messages above): stopping",
                     MAX_EARLY_EXITS);
            status = 1;
        } else
            log_line("stopping (%s): %llu answered, %llu errors", interrupts >= 2 ? "now" : "letting workers finish",
                     (unsigned long long)s.served, (unsigned long long)s.failed);
    }
    shutdown_workers(&s, interrupts >= 2 || rc);
    kvm_svcproc_stop(&s.svc, 5000);
    for (int w = 0; w < s.n_workers; w++)
        kvm_msg_free(&s.workers[w].env);
    free(s.queue);
    free(s.clients);
    if (s.front) zmq_close(s.front);
    if (s.ctl) zmq_close(s.ctl);
    if (s.data) zmq_close(s.data);
    kvm_curve_ctx_term(s.zctx); /* joins the ZAP handler too: no thread outlives the return */
    if (s.own_run_dir) kvm_rundir_remove(s.run_dir);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (!rc && !s.fatal) log_line("stopped");
    return interrupts >= 2 ? 130 : status;
}
