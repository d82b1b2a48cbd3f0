/* cmd_ask.c: `kvmill ask`: a client of `kvmill serve`: sends a document (a file's bytes, or
 * the hash or name of a document the store holds) and a prompt, waits for the answer (90 s by
 * default), prints the generated text to stdout and the timings to stderr. Needs no config:
 * the server tokenises and hashes the document. A server that rejects this client's CurveZMQ
 * key is reported at once (socket monitor). */
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "model/kvm_utf8.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_stage.h"
#include "proto/kvm_proto.h"
#include "store/kvm_store.h"

#include <errno.h>
#include <netdb.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

/* Each U+FFFD (3 bytes) of a sanitized prompt as '?', in place; returns the new length. */
static size_t replacement_to_question(char *s, size_t n)
{
    size_t w = 0;
    for (size_t r = 0; r < n; r++) {
        if (r + 2 < n && (unsigned char)s[r] == 0xEF && (unsigned char)s[r + 1] == 0xBF &&
            (unsigned char)s[r + 2] == 0xBD) {
            s[w++] = '?';
            r += 2;
        } else
            s[w++] = s[r];
    }
    return w;
}

/* Puts the prompt into the ask. One that is not UTF-8 (latin-1, say) was refused, where kvmill
 * generate takes any bytes (the tokenizers are byte-level, or fall back to bytes): it goes as
 * prompt_bytes (revision 7), which servers tokenise as they are, and as prompt with '?' in
 * place of its bad bytes (cut to the limit), which is what an older server reads: '?', not
 * U+FFFD's three bytes, so the ask carries the prompt at most twice, not four times ([serve]
 * max_message_bytes refused a latin-1 prompt a quarter of the size of a UTF-8 one). *fallback is
 * malloc'ed (or NULL for a UTF-8 prompt) and must outlive the encode. Returns 0 or KVM_ENOMEM. */
static int set_prompt(kvm_proto_ask *ask, const char *prompt, char **fallback)
{
    size_t n = strlen(prompt), len = 0;
    *fallback = NULL;
    ask->prompt = (kvm_proto_str){prompt, n};
    if (kvm_utf8_valid(prompt, n)) return 0;
    int rc = kvm_utf8_sanitize(prompt, n, fallback, &len, NULL);
    if (rc) return rc;
    len = replacement_to_question(*fallback, len);
    ask->prompt = (kvm_proto_str){*fallback, kvm_utf8_cut(*fallback, len, KVM_PROTO_MAX_TEXT_BYTES)};
    ask->prompt_bytes = (kvm_proto_bytes){(const uint8_t *)prompt, n};
    return 0;
}

/* What read_input reads: the flag that names the file, the file's kind in messages, its
 * limit, and what to do instead when over it (a sentence fragment, or ""). */
typedef struct ask_input {
    const char *flag;  /* "--doc", "--prompt-file" */
    const char *kind;  /* "document", "prompt" */
    size_t max;        /* bytes an ask carries of it */
    const char *large; /* advice for a file over max */
    const char *dir;   /* advice for a directory */
} ask_input;

static const ask_input doc_input = {
    "--doc", "document", KVM_PROTO_MAX_DOC_BYTES,
    ": if kvmill run stored it, name it with --doc-name NAME or --doc-hash HEX instead",
    ": give one document file (kvmill run takes a corpus folder; name a stored document with --doc-name NAME)"};
static const ask_input prompt_input = {"--prompt-file", "prompt", KVM_PROTO_MAX_TEXT_BYTES, ": send a shorter prompt",
                                       ": give the file that holds the prompt"};

/* A file that is not regular, a FIFO or a directory, by kind, for messages. */
static const char *special_kind(mode_t m)
{
    return S_ISCHR(m) ? "character device" : S_ISBLK(m) ? "block device" : S_ISSOCK(m) ? "socket" : "special file";
}

/* The checks on the file's kind before it is opened (a directory, a regular file over the
 * limit, a device: /dev/null read as "is empty", /dev/zero as too long). Prints errors;
 * returns 0/2. */
static int check_input_kind(const ask_input *in, const char *path, const struct stat *sb)
{
    if (S_ISDIR(sb->st_mode))
        return fprintf(stderr, "kvmill ask: %s %s is a directory%s\n", in->flag, path, in->dir), 2;
    if (S_ISREG(sb->st_mode) && sb->st_size > (off_t)in->max)
        return fprintf(stderr, "kvmill ask: %s %s has %lld bytes, more than an ask carries (%zu)%s\n", in->flag, path,
                       (long long)sb->st_size, in->max, in->large),
               2;
    if (!S_ISREG(sb->st_mode) && !S_ISFIFO(sb->st_mode))
        return fprintf(stderr, "kvmill ask: %s %s is a %s, not a %s file: give a regular file\n", in->flag, path,
                       special_kind(sb->st_mode), in->kind),
               2;
    return 0;
}

/* Opens a FIFO into *f without waiting for a writer (fopen waited for ever): one read that
 * does not wait, its byte (if any) into *first, *got 1 or 0; end of file at once is a FIFO
 * nobody writes to, refused by name. Prints errors; returns 0/2. */
static int open_fifo(const ask_input *in, const char *path, FILE **f, char *first, ssize_t *got)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return fprintf(stderr, "kvmill ask: %s %s: %s\n", in->flag, path, strerror(errno)), 2;
    *got = read(fd, first, 1);
    if (*got == 0 || (*got < 0 && errno != EAGAIN)) {
        int e = errno;
        close(fd);
        if (*got == 0)
            fprintf(stderr,
                    "kvmill ask: %s %s is a FIFO (named pipe) with no process writing to it (or whose "
                    "writer ended without writing): give a regular file, or start its writer first\n",
                    in->flag, path);
        else
            fprintf(stderr, "kvmill ask: %s %s: %s\n", in->flag, path, strerror(e));
        return 2;
    }
    if (*got < 0) *got = 0; /* a writer with nothing written yet: the reads that follow wait for it */
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) || !(*f = fdopen(fd, "rb"))) {
        fprintf(stderr, "kvmill ask: %s %s: %s\n", in->flag, path, strerror(errno));
        close(fd);
        return 2;
    }
    return 0;
}

/* Reads f to its end or past in->max bytes into a new *buf (*n bytes, one byte to spare for a
 * terminating NUL), after `got` bytes already read (first). Returns 0, or an errno value
 * (ENOMEM: out of memory). */
static int read_all(const ask_input *in, FILE *f, char first, ssize_t got, char **buf, size_t *n)
{
    size_t cap = 1 << 16;
    *n = 0;
    if (!(*buf = malloc(cap))) return ENOMEM;
    if (got == 1) (*buf)[(*n)++] = first;
    for (;;) {
        if (*n + 1 >= cap) {
            if (cap > in->max) break; /* over the limit: said by the caller */
            char *b = realloc(*buf, cap *= 2);
            if (!b) return ENOMEM;
            *buf = b;
        }
        size_t r = fread(*buf + *n, 1, cap - 1 - *n, f);
        if (r == 0) break;
        *n += r;
    }
    return ferror(f) ? (errno ? errno : EIO) : 0;
}

/* Reads a whole file for a flag (--doc: any bytes, at most 16 MiB; --prompt-file: at most 8
 * MiB): one routine, so that both refuse a directory, a device and a FIFO nobody writes to by
 * name, and read a pipe with a writer (bash's <(...)). *text is NUL-terminated. Prints errors;
 * returns 0/2. */
static int read_input(const ask_input *in, const char *path, char **text, size_t *len)
{
    struct stat sb;
    if (stat(path, &sb)) return fprintf(stderr, "kvmill ask: %s %s: %s\n", in->flag, path, strerror(errno)), 2;
    if (check_input_kind(in, path, &sb)) return 2;
    FILE *f = NULL; /* not fopen: a FIFO with no writer blocked the open for ever */
    char first = 0;
    ssize_t got = 0;
    if (S_ISFIFO(sb.st_mode)) {
        if (open_fifo(in, path, &f, &first, &got)) return 2;
    } else if (kvm_file_open_input(path, "rb", in->flag, &f)) {
        return fprintf(stderr, "kvmill ask: %s\n", kvm_errmsg()), 2;
    }
    char *buf = NULL;
    size_t n = 0;
    int err = read_all(in, f, first, got, &buf, &n), rc = 2;
    fclose(f);
    if (err)
        fprintf(stderr, "kvmill ask: %s %s: %s\n", in->flag, path, err == ENOMEM ? "out of memory" : strerror(err));
    else if (n > in->max)
        fprintf(stderr, "kvmill ask: %s %s: more than %zu bytes, more than an ask carries%s\n", in->flag, path, in->max,
                in->large);
    else if (n == 0)
        fprintf(stderr, "kvmill ask: %s %s is empty\n", in->flag, path);
    else
        rc = 0;
    if (rc) {
        free(buf);
        return rc;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return 0;
}

/* The prompt from --prompt-file: read_input's checks, then --prompt's (no NUL byte). Prints
 * errors; returns 0/2. */
static int read_prompt_file(const char *path, char **text, size_t *len)
{
    if (read_input(&prompt_input, path, text, len)) return 2;
    if (!memchr(*text, 0, *len)) return 0;
    fprintf(stderr, "kvmill ask: --prompt-file %s contains a NUL byte\n", path);
    free(*text);
    *text = NULL;
    return 2;
}

/* What no server can be at: an inproc:// endpoint (one process's own sockets; ask runs in its
 * own), a tcp:// port 0 or '*' or host '*' (a bind's wildcards), a host name that does not
 * resolve. Each waited the whole --timeout and said "nothing accepted a connection". Prints the
 * error; returns 0, 2 (the endpoint is wrong) or 1 (the name service failed: try again). */
static int check_target(const char *ep)
{
    static const char *hint = "give kvmill serve's front end as its \"ready\" line names it";
    if (!strncmp(ep, "inproc://", 9))
        return fprintf(stderr,
                       "kvmill ask: --connect %s: inproc:// reaches the sockets of one process, and ask runs "
                       "in its own: %s (tcp://HOST:PORT or ipc://PATH)\n",
                       ep, hint),
               2;
    const char *colon = strncmp(ep, "tcp://", 6) ? NULL : strrchr(ep, ':');
    if (!colon || strchr(ep + 6, ';')) return 0; /* ipc://; tcp://SOURCE;HOST:PORT left to ZeroMQ */
    if (!strcmp(colon + 1, "*") || strtol(colon + 1, NULL, 10) == 0)
        return fprintf(stderr, "kvmill ask: --connect %s: port %s is a bind's wildcard, no server's port: %s\n", ep,
                       colon + 1, hint),
               2;
    char host[256];
    size_t n = (size_t)(colon - (ep + 6));
    if (n >= 2 && ep[6] == '[' && colon[-1] == ']') n -= 2; /* [IPv6] */
    if (n >= sizeof host) return 0;
    memcpy(host, ep + 6 + (ep[6] == '['), n);
    host[n] = '\0';
    if (!strcmp(host, "*"))
        return fprintf(stderr, "kvmill ask: --connect %s: host '*' (every interface) is for a bind: %s\n", ep, hint), 2;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    const int g = getaddrinfo(host, NULL, &hints, &res);
    if (res) freeaddrinfo(res);
    if (!g) return 0;
    fprintf(stderr, "kvmill ask: --connect %s: cannot resolve host '%s': %s\n", ep, host, gai_strerror(g));
    return g == EAI_NONAME ? 2 : 1;
}

/* How far the connection to the server got, from the monitor socket's events: a silent
 * timeout then says whether nothing accepted the connection, something that is not a ZeroMQ
 * peer accepted it, or a ZeroMQ peer took the request and did not answer. A connection that
 * drops after its handshake and comes back (a server restarted on the same endpoint) lost the
 * request the old server had read: ask sends it again (up, lost, resend_due, resent). */
typedef struct ask_link {
    int tcp_connected; /* ZMQ_EVENT_CONNECTED seen */
    int greeted;       /* ZMQ_EVENT_HANDSHAKE_SUCCEEDED seen: a ZeroMQ peer of a fitting type */
    int keyed;         /* CurveZMQ keys given */
    int no_detail;     /* a keyed handshake ended without a reason (the peer closed the connection) */
    int plain_closed;  /* plain handshakes the peer closed without a reason, none succeeding between */
    int up;            /* the current connection completed its handshake */
    int lost;          /* a connection that had completed its handshake dropped (ZMQ_EVENT_DISCONNECTED) */
    int resend_due;    /* a handshake succeeded again after `lost`: the request is to be sent again */
    int resent;        /* times the request was sent again */
} ask_link;

/* Times ask sends its request again after the connection came back: a server that restarts
 * in a loop is not asked for ever (each send is computed by some worker). */
#define ASK_MAX_RESENDS 3

/* The connection events (no failure) into *l: whether the request may have gone with a
 * connection that dropped, and whether one is up again to send it on. */
static void link_note(ask_link *l, uint16_t event)
{
    if (event == ZMQ_EVENT_CONNECTED) l->tcp_connected = 1;
    if (event == ZMQ_EVENT_DISCONNECTED) {
        l->lost |= l->up; /* before a handshake the request stays queued in ZeroMQ: nothing lost */
        l->up = 0;
    }
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        l->greeted = l->up = 1;
        l->plain_closed = 0;
        if (l->lost) l->resend_due = 1, l->lost = 0;
    }
}

/* Why a handshake without keys failed, into why[n]. Only a greeting that names another
 * mechanism proves a keyed server; a peer that closes at once or answers bytes that are not
 * ZeroMQ is most often a wrong port (another program there), so that is said first rather
 * than blaming missing keys. */
static void say_plain_failed(uint16_t event, uint32_t value, char *why, size_t n)
{
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        snprintf(why, n,
                 "the server needs CurveZMQ keys (its ZeroMQ greeting names another security mechanism): ask "
                 "with --server-key, --client-public and --client-secret");
    else
        snprintf(why, n,
                 "the peer %s: it may not be a ZeroMQ endpoint (not kvmill serve's front end: check the port), "
                 "or a ZeroMQ socket of another kind than kvmill serve's front end, or the server needs CurveZMQ "
                 "keys (--server-key, --client-public, --client-secret)",
                 event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     ? "closed the ZeroMQ handshake without a reason"
                     : "broke off the ZeroMQ handshake with a protocol error");
}

/* Reads one monitor event into *l; returns 1 (why filled) when it means the connection
 * cannot work: the server rejected the key, or the ZeroMQ handshake failed. */
static int link_event(void *mon, ask_link *l, char *why, size_t n)
{
    zmq_msg_t ev, ep;
    zmq_msg_init(&ev);
    zmq_msg_init(&ep);
    int failed = 0;
    if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) >= 0 && zmq_msg_size(&ev) >= 6) {
        uint16_t event;
        uint32_t value;
        memcpy(&event, zmq_msg_data(&ev), 2);
        memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
        if (zmq_msg_more(&ev)) zmq_msg_recv(&ep, mon, 0);
        link_note(l, event);
        if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            snprintf(why, n,
                     "the server rejected this client's key (ZAP status %u): ask its operator to add your "
                     ".public file to [security] authorized_keys",
                     (unsigned)value);
            failed = 1;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL &&
                   value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH &&
                   l->keyed) { /* the greeting names the peer's mechanism: NULL, a socket without keys */
            snprintf(why, n,
                     "the server has no CurveZMQ keys (its front end is a plain socket, as on a local bind without "
                     "[security] keys): ask without --server-key, --client-public and --client-secret");
            failed = 1;
        } else if ((event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) &&
                   l->keyed) {
            /* a server without keys closes the connection at the greeting's mechanism: when it
             * closes before this side reads that greeting, nothing says why (server_is_plain) */
            l->no_detail = event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;
            snprintf(why, n,
                     "the security handshake with the server failed: a wrong --server-key (not the .public of the "
                     "server's secret key), or a server without CurveZMQ keys, or not kvmill serve's front end "
                     "there");
            failed = 1;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && ++l->plain_closed < 3) {
            /* the peer closed the connection in the greeting: a keyed server does it to every try
             * (said at the third), a server killed and started again to one (ZeroMQ connects
             * again, and the ask goes on) */
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
            say_plain_failed(event, value, why, n);
            failed = 1;
        }
    }
    zmq_msg_close(&ev);
    zmq_msg_close(&ep);
    return failed;
}

/* Whether the server at ep completes a ZeroMQ handshake without keys (within 1.5 s): after a
 * keyed handshake that ended with no reason, it tells a server without CurveZMQ keys from a
 * wrong --server-key, which the events alone do not (a server without keys may close the
 * connection before its greeting, naming its mechanism, is read). 1 when it does. */
static int server_is_plain(void *zctx, const char *ep)
{
    void *s = zmq_socket(zctx, ZMQ_DEALER), *mon = NULL;
    char mon_ep[80];
    snprintf(mon_ep, sizeof mon_ep, "inproc://kvmill-ask-plain-%d", (int)getpid());
    int linger = 0, one = 1, plain = 0;
    if (!s) return 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (!strncmp(ep, "tcp://[", 7)) zmq_setsockopt(s, ZMQ_IPV6, &one, sizeof one);
    if (zmq_socket_monitor(s, mon_ep, ZMQ_EVENT_HANDSHAKE_SUCCEEDED) == 0 && (mon = zmq_socket(zctx, ZMQ_PAIR)) &&
        zmq_connect(mon, mon_ep) == 0 && zmq_connect(s, ep) == 0) {
        zmq_pollitem_t it = {mon, 0, ZMQ_POLLIN, 0};
        for (double end = kvm_now_ms() + 1500; !plain && kvm_now_ms() < end;)
            plain = zmq_poll(&it, 1, 100) > 0 && (it.revents & ZMQ_POLLIN);
    }
    kvm_msg_monitor_stop(s, &mon);
    zmq_close(s);
    return plain;
}

/* Whether msg[0, len) holds needle. */
static int mentions(const char *msg, size_t len, const char *needle)
{
    const size_t n = strlen(needle);
    for (size_t i = 0; msg && i + n <= len; i++)
        if (!memcmp(msg + i, needle, n)) return 1;
    return 0;
}

/* Whether an error answer is about the document itself, which the server knows by its bytes
 * only (so ask names the --doc file it came from): its beginning that fits [serve]
 * max_message_bytes is too short (a decode worker's KVM_ERANGE, "the document is N bytes"), or
 * its cache is missing (KVM_ENOTFOUND, "no compressed cache for this document"). Not an answer
 * about the server (busy, timed out, stopping) or the prompt (too large, too many tokens). */
static int about_document(int32_t status, const char *msg, size_t len)
{
    return (status == KVM_ERANGE && mentions(msg, len, "the document is ")) ||
           (status == KVM_ENOTFOUND && mentions(msg, len, "no compressed cache for this document"));
}

/* The timeout's message for what the connection reached (ask_link). A connection accepted
 * without a handshake is also what a stopped server gives (its listening socket still accepts,
 * no thread of it answers): that message blamed the endpoint alone. */
static void say_no_answer(const char *ep, double timeout_s, const ask_link *l, int monitored)
{
    if (l->lost) /* dropped after the handshake, and not back: not a busy server */
        fprintf(stderr,
                "kvmill ask: the connection to %s was lost (kvmill serve there stopped or restarted) and no "
                "server took it again within %g s: is kvmill serve running there?\n",
                ep, timeout_s);
    else if (l->resent)
        fprintf(stderr,
                "kvmill ask: no answer from %s within %g s: the server restarted during the request (its "
                "connection was lost and came back) and the request, sent again %d time%s, got no answer from "
                "the restarted server: is it busy, or still starting its decode workers? ask again\n",
                ep, timeout_s, l->resent, l->resent == 1 ? "" : "s");
    else if (monitored && !l->tcp_connected)
        fprintf(stderr,
                "kvmill ask: nothing accepted a connection at %s within %g s: is kvmill serve running "
                "there (its \"ready\" line names the front end)?\n",
                ep, timeout_s);
    else if (monitored && !l->greeted)
        fprintf(stderr,
                "kvmill ask: %s accepted the connection but no ZeroMQ handshake with it completed within %g s: "
                "the server there is stopped or hung (Ctrl-Z in its terminal, SIGSTOP, a debugger: the system "
                "accepts connections for a stopped process), or it is not kvmill serve's front end (a program "
                "that does not speak ZeroMQ, or a ZeroMQ socket of another kind)\n",
                ep, timeout_s);
    else
        fprintf(stderr,
                "kvmill ask: no answer from %s within %g s (%sis it kvmill serve's front end, and is the "
                "server busy, or computing the document's cache for longer than --timeout? a server of an "
                "older kvmill cuts off a request larger than its [serve] max_message_bytes without an answer)\n",
                ep, timeout_s, monitored ? "the request was delivered to a ZeroMQ peer; " : "");
}

/* Encodes *ask with request id `id` and sends it (flags: ZMQ_DONTWAIT on a connection that is
 * up: no wait past --timeout). Prints errors; returns 0, 1 (not sent) or 2 (the ask does not
 * encode: a usage error). */
static int send_ask(void *sock, kvm_proto_ask *ask, uint64_t id, int flags, const char *ep)
{
    kvm_msg *m = NULL;
    ask->request_id = id;
    if (kvm_proto_ask_encode(ask, &m)) return fprintf(stderr, "kvmill ask: %s\n", kvm_cli_errmsg("ask")), 2;
    if (kvm_msg_send(sock, &m, flags) == 0) return 0;
    fprintf(stderr, "kvmill ask: could not send to %s: %s\n", ep, zmq_strerror(errno));
    return 1;
}

/* Sends the request again on a connection that came back (l->resend_due), at most
 * ASK_MAX_RESENDS times, saying so on stderr the first time. An ask only reads, so asking
 * again is safe. Each send has its own id (first_id + n, *rid): an answer to an earlier send
 * that still arrives (a server that dropped the connection but computed on) is a stale
 * answer, not taken for this one's, so one answer at most is printed. Returns send_ask's status. */
static int resend(void *sock, kvm_proto_ask *ask, ask_link *l, uint64_t first_id, uint64_t *rid, const char *ep)
{
    l->resend_due = 0;
    if (l->resent >= ASK_MAX_RESENDS) return 0;
    if (!l->resent) fprintf(stderr, "kvmill ask: the server's connection was lost and came back: asking again\n");
    *rid = first_id + (uint64_t)++l->resent;
    return send_ask(sock, ask, *rid, ZMQ_DONTWAIT, ep);
}

/* Writes the answer's text and a newline to stdout. A failed write (a full disk) keeps its
 * errno for main's message: by the end only stdout's error flag is left. Returns 0 or 1. */
static int print_text(const kvm_proto_str *t)
{
    errno = 0;
    if (fwrite(t->ptr ? t->ptr : "", 1, t->len, stdout) != t->len || fputc('\n', stdout) == EOF) {
        kvm_cli_stdout_failed(errno);
        return 1;
    }
    return kvm_cli_flush_stdout() ? 1 : 0;
}

int kvm_cmd_ask(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"connect", 1, "endpoint of kvmill serve, e.g. tcp://127.0.0.1:5555 or ipc:///run/kvmill/front", NULL},
        {"doc", 1,
         "the document, a file of any bytes (the server tokenises and truncates it as kvmill run did; at most 16 MiB)",
         NULL},
        {"doc-hash", 1, "instead of --doc: a stored document, by its 64-hex-digit hash (kvmill store ls --csv)", NULL},
        {"doc-name", 1, "instead of --doc: a stored document, by the name kvmill run stored (its corpus file name)",
         NULL},
        {"prompt", 1,
         "text appended after the document, its bytes as they are, as kvmill generate takes them (bytes that are not "
         "UTF-8 reach a server of kvmill before protocol revision 7 as U+FFFD)",
         NULL},
        {"prompt-file", 1,
         "read the prompt from this file instead of --prompt (its bytes as they are, as --prompt; no NUL byte)", NULL},
        {"n", 1, "new tokens to generate (default 64)", NULL},
        {"temperature", 1, "sampling temperature, 0 = greedy (default 0)", NULL},
        {"timeout", 1,
         "seconds to wait for the answer (default " KVM_CLI_STR(
             KVM_ASK_TIMEOUT_S) ": longer than [serve] "
                                "request_timeout_s's default, so a late request gets the server's own reason); "
                                "a server restarted meanwhile (the connection lost and back) is asked again within "
                                "it, at most " KVM_CLI_STR(ASK_MAX_RESENDS) " times",
         NULL},
        {"server-key", 1, "CurveZMQ: the server's .public key file", NULL},
        {"client-public", 1, "CurveZMQ: this client's .public key file", NULL},
        {"client-secret", 1, "CurveZMQ: this client's .secret key file", NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("ask", "Asks kvmill serve to continue a document after a prompt; prints the answer.", argc, argv,
                      opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *ep = kvm_cli_get(opts, "connect"), *doc = kvm_cli_get(opts, "doc"),
               *doc_hash = kvm_cli_get(opts, "doc-hash"), *doc_name = kvm_cli_get(opts, "doc-name"),
               *prompt = kvm_cli_get(opts, "prompt"), *pfile = kvm_cli_get(opts, "prompt-file"), *s;
    if (!ep || !(prompt || pfile) || !(doc || doc_hash || doc_name))
        return fprintf(stderr, "kvmill ask: --connect, --prompt (or --prompt-file) and one of --doc, --doc-hash, "
                               "--doc-name are required\n"),
               2;
    if (prompt && pfile) return fprintf(stderr, "kvmill ask: give --prompt or --prompt-file, not both\n"), 2;
    if (!!doc + !!doc_hash + !!doc_name > 1)
        return fprintf(stderr, "kvmill ask: give one of --doc, --doc-hash and --doc-name\n"), 2;
    kvm_store_id hash;
    if (doc_hash && (strlen(doc_hash) != KVM_STORE_ID_HEX || kvm_store_id_parse(doc_hash, &hash)))
        return fprintf(stderr,
                       "kvmill ask: --doc-hash: '%s' is not %d hex digits (the doc_hash column of kvmill store ls "
                       "--csv)\n",
                       doc_hash, KVM_STORE_ID_HEX),
               2;
    if (doc_name && (!*doc_name || !kvm_utf8_valid(doc_name, strlen(doc_name))))
        return fprintf(stderr, "kvmill ask: --doc-name: give a name of UTF-8 (1 byte at least)\n"), 2;
    /* a name is stored as its first 255 bytes (kvm_store_doc_source_len) and matched by them: a
     * longer one (a JSONL id) is sent as those, not refused past the wire's 1024 bytes */
    const size_t doc_name_len = !doc_name ? 0
                                : strlen(doc_name) <= KVM_PROTO_MAX_NAME_BYTES
                                    ? strlen(doc_name)
                                    : kvm_store_doc_source_len(doc_name, strlen(doc_name));
    if (prompt && !*prompt) return fprintf(stderr, "kvmill ask: --prompt is empty\n"), 2;
    if (prompt && strlen(prompt) > KVM_PROTO_MAX_TEXT_BYTES)
        return fprintf(stderr, "kvmill ask: --prompt is too long\n"), 2;
    int64_t n_new = 64;
    double temperature = 0, timeout_s = KVM_ASK_TIMEOUT_S; /* kvm_cli.h says why */
    if ((s = kvm_cli_get(opts, "n"))) { /* -n: kvm_cli_int would call it --n */
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (errno == ERANGE || end == s || *end)
            return fprintf(stderr, "kvmill ask: -n: '%s' is not an integer\n", s), 2;
        if (v < 0 || v > KVM_PROTO_MAX_TOKENS)
            return fprintf(stderr, "kvmill ask: -n: %s is outside [0, %d] (new tokens to generate)\n", s,
                           KVM_PROTO_MAX_TOKENS),
                   2;
        n_new = v;
    }
    if ((s = kvm_cli_get(opts, "temperature")) && kvm_cli_float("ask", "temperature", s, 0, 100, &temperature))
        return 2;
    if ((s = kvm_cli_get(opts, "timeout")) && kvm_cli_float("ask", "timeout", s, 0.01, 86400, &timeout_s)) return 2;
    const char *sk = kvm_cli_get(opts, "server-key"), *cp = kvm_cli_get(opts, "client-public"),
               *cs = kvm_cli_get(opts, "client-secret");
    if ((sk || cp || cs) && !(sk && cp && cs))
        return fprintf(stderr, "kvmill ask: CurveZMQ needs all of --server-key, --client-public and --client-secret\n"),
               2;
    char *text = NULL, *ptext = NULL, *fallback = NULL;
    size_t text_len = 0, plen = 0;
    int status = 0;
    if (pfile) { /* the file's bytes; the limits and checks of --prompt */
        if (read_prompt_file(pfile, &ptext, &plen)) return 2;
        prompt = ptext;
    }
    if (!strncmp(ep, "tcp://", 6) && kvm_serve_endpoint_check(ep, "--connect")) { /* other forms: zmq_connect's word */
        fprintf(stderr, "kvmill ask: %s\n", kvm_errmsg());
        return free(ptext), 2;
    }
    if ((status = check_target(ep))) return free(ptext), status;
    status = doc ? read_input(&doc_input, doc, &text, &text_len) : 0;
    if (status) return free(ptext), status;

    void *zctx = zmq_ctx_new(), *sock = zctx ? zmq_socket(zctx, ZMQ_DEALER) : NULL, *mon = NULL;
    kvm_msg *m = NULL;
    status = 1;
    if (!sock) {
        fprintf(stderr, "kvmill ask: zmq: %s\n", zmq_strerror(errno));
        goto done;
    }
    int linger = 0, sndtimeo = (int)(timeout_s * 1000), one = 1;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(sock, ZMQ_SNDTIMEO, &sndtimeo, sizeof sndtimeo);
    if (!strncmp(ep, "tcp://[", 7)) zmq_setsockopt(sock, ZMQ_IPV6, &one, sizeof one); /* tcp://[::1]:PORT */
    if (kvm_curve_client(sock, sk, cp, cs)) {
        fprintf(stderr, "kvmill ask: %s\n", kvm_cli_errmsg("ask"));
        status = 2;
        goto done;
    }
    char mon_ep[64];
    snprintf(mon_ep, sizeof mon_ep, "inproc://kvmill-ask-monitor-%d", (int)getpid());
    ask_link link = {.keyed = sk != NULL};
    if (zmq_socket_monitor(sock, mon_ep,
                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) == 0) {
        mon = zmq_socket(zctx, ZMQ_PAIR);
        if (mon && zmq_connect(mon, mon_ep)) zmq_close(mon), mon = NULL;
        if (!mon) kvm_msg_monitor_stop(sock, NULL); /* no reader: its first event would block */
    }
    if (zmq_connect(sock, ep)) {
        int e = errno;
        fprintf(stderr, "kvmill ask: --connect %s: %s%s\n", ep, zmq_strerror(e),
                e == EINVAL || e == EPROTONOSUPPORT ? " (give the endpoint kvmill serve's \"ready\" line names: "
                                                      "tcp://HOST:PORT or ipc://PATH)"
                                                    : "");
        status = 2;
        goto done;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    /* halved and one added: the ids of the sends again (rid + 1, + 2, ...) are never 0 */
    const uint64_t first_id =
        ((((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20)) >> 1) + 1;
    uint64_t rid = first_id;
    kvm_proto_ask ask = {.request_id = rid, .max_new_tokens = n_new, .temperature = temperature};
    if (set_prompt(&ask, prompt, &fallback)) {
        fprintf(stderr, "kvmill ask: out of memory\n");
        goto done;
    }
    /* a UTF-8 text file goes as doc_text, which servers of every revision read; any other
     * file (binary, latin-1, NUL bytes, over 8 MiB) as its bytes, doc_bytes (revision 2) */
    if (text && text_len <= KVM_PROTO_MAX_TEXT_BYTES && kvm_utf8_valid(text, text_len))
        ask.doc_text = (kvm_proto_str){text, text_len};
    else if (text)
        ask.doc_bytes = (kvm_proto_bytes){(const uint8_t *)text, text_len};
    else if (doc_hash) {
        ask.has_doc_hash = true;
        memcpy(ask.doc_hash, hash.b, sizeof ask.doc_hash);
    } else
        ask.doc_name = (kvm_proto_str){doc_name, doc_name_len};
    double t0 = kvm_now_ms(), deadline = t0 + timeout_s * 1000;
    int src = send_ask(sock, &ask, rid, 0, ep);
    if (src) {
        status = src;
        goto done;
    }
    for (;;) {
        double left = deadline - kvm_now_ms();
        if (left <= 0) {
            say_no_answer(ep, timeout_s, &link, mon != NULL);
            goto done;
        }
        zmq_pollitem_t items[2] = {{sock, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, mon ? 2 : 1, (long)(left < 100 ? left + 1 : 100)) < 0 && errno != EINTR) break;
        char why[512];
        if (mon && (items[1].revents & ZMQ_POLLIN) && link_event(mon, &link, why, sizeof why)) {
            if (link.no_detail && server_is_plain(zctx, ep))
                snprintf(why, sizeof why,
                         "the server has no CurveZMQ keys (its front end is a plain socket, as on a local bind "
                         "without [security] keys): ask without --server-key, --client-public and --client-secret");
            fprintf(stderr, "kvmill ask: %s: %s\n", ep, why);
            goto done;
        }
        if (link.resend_due && (src = resend(sock, &ask, &link, first_id, &rid, ep))) {
            status = src;
            goto done;
        }
        if (!(items[0].revents & ZMQ_POLLIN)) continue;
        if (kvm_msg_recv(sock, &m, ZMQ_DONTWAIT)) continue;
        kvm_proto_answer a;
        if (kvm_proto_answer_decode(m, &a)) {
            const char *e = kvm_errmsg();
            /* a store service answers a request it does not serve with a store_reply */
            if (mentions(e, strlen(e), "got 'store_reply'"))
                fprintf(stderr,
                        "kvmill ask: %s is a store service (kvmill store serve, or the one [store] service_bind "
                        "starts), not kvmill serve's front end: connect to the front end kvmill serve's "
                        "\"ready\" line names\n",
                        ep);
            else
                fprintf(stderr, "kvmill ask: the server sent a malformed answer: %s\n", e);
            goto done;
        }
        if (a.request_id == 0 && a.status != 0 && rid != 0) { /* the server could not read our request's id */
            fprintf(stderr, "kvmill ask: the server could not read this request (%s): %.*s\n", kvm_strerror(a.status),
                    (int)a.message.len, a.message.ptr ? a.message.ptr : "");
            goto done;
        }
        if (a.request_id != rid) { /* a stale answer: keep waiting for ours */
            kvm_msg_free(&m);
            continue;
        }
        if (a.status != 0) {
            const int named = doc && about_document(a.status, a.message.ptr, a.message.len);
            fprintf(stderr, "kvmill ask: error from the server (%s)%s%s: %.*s\n", kvm_strerror(a.status),
                    named ? " about --doc " : "", named ? doc : "", (int)a.message.len,
                    a.message.ptr ? a.message.ptr : "");
            goto done;
        }
        print_text(&a.text); /* a failure is main's to say: stdout's message, exit 1 */
        fprintf(stderr,
                "kvmill ask: %lld tokens; load %.1f ms, prefill %.1f ms, decode %.1f ms, server total %.1f ms, "
                "round trip %.1f ms\n",
                (long long)a.n_tokens, a.load_ms, a.prefill_ms, a.decode_ms, a.total_ms, kvm_now_ms() - t0);
        status = 0;
        break;
    }
done:
    kvm_msg_free(&m);
    /* drained, stopped, then closed (kvm_msg_monitor_stop): closed first, an event that came
     * between (the server closing the connection) hung the ask after its answer, as CI saw */
    if (sock && mon) kvm_msg_monitor_stop(sock, &mon);
    if (sock) zmq_close(sock);
    kvm_curve_ctx_term(zctx); /* restarted after a signal: no I/O thread outlives the command */
    free(text);
    free(ptext);
    free(fallback);
    return status;
}
