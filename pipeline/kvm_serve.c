/* kvm_serve.c: what every server socket and the decode workers share (kvm_serve.h): the
 * binding rule (endpoint checks, CurveZMQ server keys, an ipc path another process listens on or
 * a file that is no socket, the endpoint that was bound) and the error-answer helpers. The
 * broker itself (kvm_serve_run) is kvm_serve_broker.c and the kvm_serve_*.c files it uses. */
#include "pipeline/kvm_serve.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_stage.h"
#include "proto/kvm_mpack_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

/* ---- helpers shared with the decode workers ---- */

int kvm_serve_error_answer(uint64_t request_id, int status, const char *message, kvm_msg **out)
{
    if (status >= 0) return kvm_err(KVM_EINVAL, "error answer with status %d", status);
    char text[4096];
    if (status < -KVM_PROTO_MAX_STATUS) status = KVM_EINVAL;
    kvm_proto_answer a = {
        .request_id = request_id, .status = status, .message = kvm_proto_str_utf8(message, text, sizeof text)};
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

int kvm_serve_answer_misdirected(void *sock, kvm_msg **env, const kvm_msg *msg, const char *base, int is_ctl,
                                 const char *who, const char *ask_at)
{
    kvm_proto_type t;
    if (kvm_proto_peek(msg, &t) || t != KVM_PROTO_ASK) return 0;
    char why[3400], eps[2][1100];
    kvm_stage_endpoints(base, eps[0], eps[1], sizeof eps[0]); /* checked at start-up */
    snprintf(why, sizeof why,
             "%s is %s's back end, where its %s workers connect, not kvmill serve's front end: ask at %s",
             eps[is_ctl ? 0 : 1], who, strcmp(who, "kvmill serve") ? "stage" : "decode", ask_at);
    uint64_t rid = 0;
    kvm_serve_request_id(msg, &rid); /* none readable: 0, which ask takes as "could not read" */
    kvm_msg *a = NULL;
    if (!kvm_serve_error_answer(rid, KVM_ENOTSUP, why, &a) && !kvm_msg_join(*env, &a))
        kvm_msg_send(sock, env, ZMQ_DONTWAIT); /* a client gone meanwhile: nothing to tell */
    kvm_msg_free(&a);
    kvm_msg_free(env);
    return 1;
}

/* The routing-id part of a message sock delivers (flags: of its first part) into a new *env;
 * *more: whether parts follow. */
static int recv_routing_id(void *sock, int flags, kvm_msg **env, int *more)
{
    zmq_msg_t id;
    zmq_msg_init(&id);
    if (zmq_msg_recv(&id, sock, flags) < 0) {
        int e = zmq_errno();
        zmq_msg_close(&id);
        int rc = kvm_err(KVM_EIO, "receive: %s", zmq_strerror(e));
        errno = e; /* the caller tells EAGAIN and EINTR from failures */
        return rc;
    }
    *more = zmq_msg_more(&id);
    int rc = kvm_msg_new(env);
    if (!rc) rc = kvm_msg_add_copy(*env, zmq_msg_data(&id), zmq_msg_size(&id));
    zmq_msg_close(&id);
    if (rc) kvm_msg_free(env);
    return rc;
}

int kvm_serve_recv_routed(void *sock, int flags, kvm_msg **env, kvm_msg **body)
{
    *env = *body = NULL;
    int more = 0, rc = recv_routing_id(sock, flags, env, &more);
    if (rc) return rc;
    if (!more) { /* a routing id alone: an empty body, the caller's to refuse */
        rc = kvm_msg_new(body);
        if (rc) kvm_msg_free(env);
        return rc;
    }
    /* the rest of a message arrives with its first part: only a signal interrupts the wait */
    do
        rc = kvm_msg_recv(sock, body, 0);
    while (rc == KVM_EIO && errno == EINTR);
    if (rc == KVM_EPROTO) /* only "too many parts" (drained): the sender gets told */
        return kvm_err(KVM_EPROTO,
                       "a message of more than %d parts, refused: a request has at most %d frames (PROTOCOL.md "
                       "§4)",
                       KVM_MSG_MAX_FRAMES, KVM_PROTO_MAX_FRAMES);
    if (rc) kvm_msg_free(env);
    return rc;
}

/* ---- binding a server socket ---- */

/* 1 when a tcp:// endpoint ends in ":PORT" with PORT a decimal in [0, 65535] or '*'. */
static int tcp_port_ok(const char *endpoint)
{
    const char *colon = strrchr(endpoint + 6, ':');
    if (!colon || colon == endpoint + 6 || (colon[-1] == ':' && endpoint[6] == '[')) return 0; /* no port; "[::1" */
    if (!strcmp(colon + 1, "*")) return 1;
    long port = 0;
    const char *p = colon + 1;
    for (; *p >= '0' && *p <= '9' && port <= 65535; p++)
        port = port * 10 + (*p - '0');
    return p > colon + 1 && !*p && port <= 65535;
}

int kvm_serve_endpoint_check(const char *endpoint, const char *what)
{
    if (strncmp(endpoint, "tcp://", 6) && strncmp(endpoint, "ipc://", 6) && strncmp(endpoint, "inproc://", 9))
        return kvm_err(KVM_EINVAL, "%s '%s' is not an endpoint: expected tcp://HOST:PORT or ipc://PATH", what,
                       endpoint);
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
        return kvm_err(KVM_EINVAL,
                       "%s '%s': the socket path is %zu bytes, more than the %zu a Unix socket path "
                       "takes: use a shorter folder ([run] run_dir, or TMPDIR for a temporary run directory)",
                       what, endpoint, strlen(endpoint + 6), max_path);
    return 0;
}

/* A [security] key file that is missing, not a key, not the public half of the secret one, or an
 * authorized_keys that is not a folder is the config's mistake: KVM_EINVAL (exit 2), message kept. */
static int key_error(int rc)
{
    return rc == KVM_ENOTFOUND || rc == KVM_EFORMAT || rc == KVM_EMISMATCH ? kvm_err(KVM_EINVAL, "%s", kvm_errmsg())
                                                                           : rc;
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

int kvm_serve_bind_rule(const char *endpoint, const kvm_config *cfg, const char *what)
{
    const char *sec = kvm_config_str(cfg, "security", "server_secret_key");
    const char *auth = kvm_config_str(cfg, "security", "authorized_keys");
    int rc = kvm_serve_endpoint_check(endpoint, what);
    if (rc) return rc;
    if (*auth && !*sec) /* on a local bind nothing would check the clients' keys, and nobody would know */
        return kvm_err(KVM_EINVAL,
                       "%s %s: [security] authorized_keys is set but server_secret_key is not: clients' keys are "
                       "checked only by a CurveZMQ server (make its key pair with kvmill keygen), or drop "
                       "authorized_keys",
                       what, endpoint);
    if (!kvm_curve_is_local(endpoint) && (!*sec || !*auth))
        return kvm_err(KVM_EINVAL,
                       "%s %s is not local: set [security] server_secret_key and authorized_keys "
                       "(make keys with kvmill keygen), or bind ipc:// or tcp://127.0.0.1",
                       what, endpoint);
    return 0;
}

/* 1 when paths a and b name one folder (kvm_file_path_norm: a relative one, '.', '..', links). */
static int same_folder(const char *a, const char *b)
{
    char na[4200], nb[4200];
    kvm_file_path_norm(a, na, sizeof na);
    kvm_file_path_norm(b, nb, sizeof nb);
    return !strcmp(na, nb);
}

int kvm_serve_ipc_folder_check(const char *endpoint, int is_dir, const kvm_config *cfg, const char *binds)
{
    if (strncmp(endpoint, "ipc://", 6) || endpoint[6] == '@') return 0;
    char dir[4200];
    const char *path = endpoint + 6, *slash = strrchr(path, '/');
    if (is_dir)
        snprintf(dir, sizeof dir, "%s", path);
    else if (!slash)
        return 0; /* a socket in the working directory, which exists */
    else
        snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    const char *run_dir = cfg ? kvm_config_str(cfg, "run", "run_dir") : "";
    if (*run_dir && same_folder(dir, run_dir)) return 0; /* made before the bind (kvm_rundir_make) */
    struct stat st;
    const int found = !stat(dir, &st);
    if (found && S_ISDIR(st.st_mode)) return 0;
    return kvm_err(KVM_EINVAL, "%s %s: %s; make it first", dir, found ? "is not a folder" : "does not exist", binds);
}

int kvm_serve_endpoint_external(const char *endpoint, const char *what)
{
    if (strncmp(endpoint, "inproc://", 9)) return 0;
    return kvm_err(KVM_EINVAL,
                   "%s '%s': an inproc:// endpoint is reachable from inside this process only, so no client or worker "
                   "could connect; bind tcp://HOST:PORT or ipc://PATH",
                   what, endpoint);
}

int kvm_serve_check_endpoints(const kvm_config *cfg, const char *bind_what)
{
    char what[1200];
    if (bind_what)
        snprintf(what, sizeof what, "%s", bind_what);
    else
        snprintf(what, sizeof what, "[serve] bind in %s", kvm_config_path(cfg));
    const char *bind = kvm_config_str(cfg, "serve", "bind");
    int rc = kvm_serve_endpoint_external(bind, what);
    if (!rc) rc = kvm_serve_bind_rule(bind, cfg, what);
    if (!rc && kvm_serve_ipc_folder_check(bind, 0, cfg, "kvmill serve binds its front end's socket in it"))
        rc = kvm_err(KVM_EINVAL, "%s %s: %s", what, bind, kvm_errmsg());
    if (rc) return rc;
    const char *be = kvm_config_str(cfg, "serve", "backend"), *rd = kvm_config_str(cfg, "run", "run_dir");
    char ctl_ep[1100], data_ep[1100], base[1100];
    snprintf(base, sizeof base, "%s%s", *be ? "" : "ipc://", *be ? be : rd);
    if ((*be || *rd) && !kvm_stage_endpoints(base, ctl_ep, data_ep, sizeof ctl_ep) &&
        (kvm_jobcfg_same_socket(bind, ctl_ep) || kvm_jobcfg_same_socket(bind, data_ep)))
        return kvm_err(KVM_EINVAL,
                       "%s %s is the server's own back end (%s, where its decode workers connect: %s): give the "
                       "front end another endpoint",
                       what, bind, kvm_jobcfg_same_socket(bind, ctl_ep) ? ctl_ep : data_ep,
                       *be ? "[serve] backend" : "in [run] run_dir");
    if (!*be) return 0; /* the run directory's ipc:// sockets: local */
    snprintf(what, sizeof what, "[serve] backend in %s", kvm_config_path(cfg));
    if (kvm_stage_endpoints(be, ctl_ep, data_ep, sizeof ctl_ep))
        return kvm_err(KVM_EINVAL, "%s: %s", what, kvm_errmsg());
    if (kvm_serve_ipc_folder_check(be, 1, cfg, "kvmill serve binds its back end's ctl and data sockets in it"))
        return kvm_err(KVM_EINVAL, "%s %s: %s", what, be, kvm_errmsg());
    if ((rc = kvm_serve_bind_rule(ctl_ep, cfg, what)) || (rc = kvm_serve_bind_rule(data_ep, cfg, what))) return rc;
    return 0;
}

int kvm_serve_bind(void *zctx, void *sock, const char *endpoint, const kvm_config *cfg, int curve_if_keyed,
                   const char *what)
{
    const char *sec = kvm_config_str(cfg, "security", "server_secret_key");
    const char *auth = kvm_config_str(cfg, "security", "authorized_keys");
    int rc = kvm_serve_bind_rule(endpoint, cfg, what);
    if (rc) return rc;
    int local = kvm_curve_is_local(endpoint);
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
    const char *colon = !strncmp(endpoint, "tcp://", 6) ? strrchr(endpoint + 6, ':') : NULL;
    if (colon && ((colon - endpoint == 15 && !strncasecmp(endpoint + 6, "localhost", 9)) ||
                  (colon - endpoint == 16 && !strncasecmp(endpoint + 6, "localhost.", 10))))
        snprintf(ep, sizeof ep, "tcp://127.0.0.1%s", colon); /* LOCALHOST, localhost.: "No such device" */
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
    if (zmq_bind(sock, ep)) {
        int e = errno;
        if (e == EADDRINUSE) /* a process still holds it: a second service, or one whose parent was killed */
            return kvm_err(KVM_EIO,
                           "%s: cannot bind %s: %s: another process holds that endpoint (a second kvmill serve, "
                           "run or store service with the same endpoint, or one left running after its parent was "
                           "killed: ss -ltnp or fuser names it); stop it or choose another",
                           what, endpoint, zmq_strerror(e));
        return kvm_err(KVM_EIO, "%s: cannot bind %s: %s", what, endpoint, zmq_strerror(e));
    }
    return 0;
}

void kvm_serve_ipc_note(const char *ep, kvm_serve_ipc_file *f)
{
    memset(f, 0, sizeof *f);
    struct stat st;
    if (!ep || strncmp(ep, "ipc://", 6) || ep[6] == '@' || lstat(ep + 6, &st) || !S_ISSOCK(st.st_mode)) return;
    snprintf(f->path, sizeof f->path, "%s", ep + 6);
    f->dev = st.st_dev;
    f->ino = st.st_ino;
}

void kvm_serve_ipc_remove(const kvm_serve_ipc_file *f)
{
    struct stat st;
    /* another inode is another process's socket (a rebind of ours notes its new one) */
    if (!f->path[0] || lstat(f->path, &st) || !S_ISSOCK(st.st_mode) || st.st_dev != f->dev || st.st_ino != f->ino)
        return;
    unlink(f->path);
}

int kvm_serve_bound_endpoint(void *sock, const char *fallback, char *out, size_t n)
{
    size_t len = n;
    if (n == 0) return 0;
    if (sock && zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, out, &len) == 0 && len > 1 && out[0]) return 1;
    snprintf(out, n, "%s", fallback ? fallback : "");
    return 0;
}

/* Binds sock at the ipc:// endpoint ep again when its socket file is gone. A /tmp cleaner
 * (systemd-tmpfiles removes what has not changed for 10 days; the default run directory is a
 * temporary folder) or an rm deleted the front end's or the back end's socket of a server that
 * kept running: connected peers kept their links, but a decode worker respawned after that
 * never joined and clients found nothing there, so every ask timed out "waiting for a free
 * decode worker" with no word of why. The old listener is left bound: zmq_unbind would close
 * every connection it accepted (the connected workers and clients, whose next message is
 * lost); a second listener on the same endpoint string is what ZeroMQ allows, and the old one
 * costs a descriptor until the socket closes. The folder is made again (0700, as the run
 * directory) when it went too, and bound into only when it is a folder of this user that no
 * one else may write (else another user could make it, or a link of that name, and take the
 * jobs and prompts). A failure is logged once per endpoint and reason, not every second. */
int kvm_serve_rebind_if_removed(void *sock, const char *ep, const char *what)
{
    static _Thread_local struct {
        char ep[128];
        int why;
    } said[8]; /* the last failure logged per endpoint (a server loop has at most 3) */
    if (strncmp(ep, "ipc://", 6) || ep[6] == '@') return 0; /* tcp://, or a Linux abstract socket: no file */
    const char *path = ep + 6;
    struct stat st;
    if (lstat(path, &st) == 0 || errno != ENOENT) return 0;
    int slot = 0;
    while (slot < 7 && said[slot].ep[0] && strncmp(said[slot].ep, ep, sizeof said[slot].ep - 1))
        slot++;
    snprintf(said[slot].ep, sizeof said[slot].ep, "%s", ep);
    char dir[1100], why[300] = "";
    int code = 0;
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if (mkdir(dir, 0700) && errno != EEXIST)
            code = 1, snprintf(why, sizeof why, "its folder %s cannot be made again: %s", dir, strerror(errno));
        else if (lstat(dir, &st) || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 022))
            code = 2, snprintf(why, sizeof why,
                               "%s is no folder of this user that only it may write (a link, or another user's): "
                               "not bound there",
                               dir);
    }
    if (!code && ipc_in_use(ep)) code = 3, snprintf(why, sizeof why, "another process listens there now");
    if (!code && zmq_bind(sock, ep))
        code = 4, snprintf(why, sizeof why, "binding it again failed: %s", zmq_strerror(errno));
    if (code && said[slot].why != code)
        kvm_log(KVM_LOG_ERROR, "socket_removed", NULL, 0, "the socket file of the %s %s was removed, and %s", what, ep,
                why);
    else if (!code)
        kvm_log(KVM_LOG_WARN, "socket_removed", NULL, 0,
                "the socket file of the %s %s was removed (a /tmp cleaner, or rm): bound it again", what, ep);
    said[slot].why = code;
    return !code;
}
