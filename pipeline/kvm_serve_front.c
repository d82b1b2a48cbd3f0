/* kvm_serve_front.c: the serving broker's front end: client requests checked and queued,
 * answers and error answers sent back. */
#include "pipeline/kvm_serve_int.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "model/kvm_utf8.h"
#include "pipeline/kvm_stage.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

void kvm_serve__log(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvm_logv(KVM_LOG_INFO, "message", NULL, 0, fmt, ap); /* "kvmill serve: ..." or JSON ([run] log_format) */
    va_end(ap);
}

/* ---- replies to clients ---- */

/* Sends *answer to the client behind *env (takes both). */
void kvm_serve__reply(srv *s, kvm_msg **env, kvm_msg **answer)
{
    int rc = kvm_msg_join(*env, answer);
    if (!rc) rc = kvm_msg_send(s->front, env, ZMQ_DONTWAIT);
    if (rc) kvm_serve__log("could not send an answer: client gone (%s)", zmq_strerror(errno));
    kvm_msg_free(env);
    kvm_msg_free(answer);
}

void kvm_serve__reply_error(srv *s, kvm_msg **env, uint64_t request_id, int status, const char *why)
{
    kvm_msg *a = NULL;
    s->failed++;
    if (kvm_serve_error_answer(request_id, status, why, &a)) {
        kvm_msg_free(env);
        return;
    }
    kvm_serve__reply(s, env, &a);
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

void kvm_serve__queue_remove(srv *s, int64_t i)
{
    memmove(&s->queue[i], &s->queue[i + 1], (size_t)(s->n_queue - i - 1) * sizeof *s->queue);
    s->n_queue--;
}

/* ---- front end ---- */

/* Why a request of `bytes` over [serve] max_message_bytes that cut_document could not make fit
 * is refused, into why[n]: the part of it that is large (a document's token ids, else the prompt,
 * by size, as the client sent them) and what to do instead. */
static void oversize_why(const srv *s, const kvm_msg *m, size_t bytes, char *why, size_t n)
{
    kvm_proto_ask a;
    int o = snprintf(why, n, "request of %zu bytes exceeds this server's [serve] max_message_bytes = %lld", bytes,
                     (long long)s->max_msg_bytes);
    if (o < 0 || (size_t)o >= n || kvm_proto_ask_decode(m, &a)) return;
    size_t ids = (size_t)a.n_doc_tokens * sizeof(int32_t), prompt = a.prompt.len + a.prompt_bytes.len;
    if (ids >= prompt && ids > 0)
        snprintf(why + o, n - (size_t)o,
                 ": the document sent with it is %lld token ids (%zu bytes); send its first [model] context ids, "
                 "ask about a document kvmill run stored by name or hash instead (kvmill ask --doc-name, "
                 "--doc-hash), or raise [serve] max_message_bytes",
                 (long long)a.n_doc_tokens, ids);
    else
        snprintf(why + o, n - (size_t)o, ": the prompt is %zu bytes%s; send a shorter one", prompt,
                 a.doc_text.len + a.doc_bytes.len ? " (no beginning of the document fits beside it)" : "");
}

static size_t msg_bytes(const kvm_msg *m)
{
    size_t bytes = 0;
    for (size_t f = 0; f < kvm_msg_nframes(m); f++)
        bytes += kvm_msg_frame(m, f).size;
    return bytes;
}

/* An ask of *bytes over [serve] max_message_bytes whose document (text or bytes) is what makes
 * it large becomes, in *m, the same ask with the document's beginning that fits, doc_size
 * saying how long the whole is (revision 9): a decode worker needs only as much of a document
 * as its first [model] context ids take, and answers with an error naming the document's
 * tokens and the limit when that beginning does not settle them (stages/decode.c). Returns 1
 * when *m was replaced (*bytes updated), 0 when no beginning of a document makes it fit (a
 * large prompt, token ids, a non-ask, out of memory): *m is unchanged. */
static int cut_document(const srv *s, kvm_msg **m, size_t *bytes)
{
    kvm_proto_ask a;
    if (kvm_proto_ask_decode(*m, &a)) return 0;
    const size_t doc = a.doc_text.len + a.doc_bytes.len, rest = *bytes - doc;
    const size_t slack = 64; /* the doc_size entry and a wider length prefix in the new encoding */
    if (doc == 0 || rest + slack >= (size_t)s->max_msg_bytes) return 0;
    const size_t keep = (size_t)s->max_msg_bytes - rest - slack;
    kvm_proto_ask c = a;
    if (a.doc_text.len) /* still UTF-8 text: cut at a character boundary */
        c.doc_text.len = kvm_utf8_cut(a.doc_text.ptr, a.doc_text.len, keep);
    else
        c.doc_bytes.len = keep;
    c.doc_size = a.doc_size ? a.doc_size : (int64_t)doc;
    kvm_msg *cut = NULL;
    if (c.doc_text.len + c.doc_bytes.len == 0 || kvm_proto_ask_encode(&c, &cut)) return 0;
    const size_t cut_bytes = msg_bytes(cut);
    if ((int64_t)cut_bytes > s->max_msg_bytes) {
        kvm_msg_free(&cut);
        return 0;
    }
    kvm_serve__log("request %llu: its document of %lld bytes makes it %zu bytes, over [serve] max_message_bytes = "
                   "%lld: a decode worker gets the document's first %zu bytes",
                   (unsigned long long)a.request_id, (long long)c.doc_size, *bytes, (long long)s->max_msg_bytes,
                   c.doc_text.len + c.doc_bytes.len);
    kvm_msg_free(m);
    *m = cut;
    *bytes = cut_bytes;
    return 1;
}

/* Whether a refusal of a client's message may be logged now: at most 20 lines a minute, so a
 * client sending garbage in a loop cannot fill the log; the count of those left out is logged
 * when the next minute starts. */
static int refusal_loggable(srv *s)
{
    const double now = kvm_now_ms();
    if (now - s->refusal_log_start >= 60000) {
        if (s->refusal_unlogged)
            kvm_serve__log("%lld more refused messages from clients in the last minute were not logged",
                           (long long)s->refusal_unlogged);
        s->refusal_log_start = now;
        s->refusal_lines = 0;
        s->refusal_unlogged = 0;
    }
    if (s->refusal_lines < 20) return ++s->refusal_lines;
    s->refusal_unlogged++;
    return 0;
}

/* Answers the client behind *env (takes it) with an error answer: for request *rid, or, when
 * its request id cannot be read (NULL: not MessagePack, another protocol version, too many
 * parts), for request 0, so that the client learns why at once instead of waiting for its
 * timeout; logged (refusal_loggable). */
static void refuse(srv *s, kvm_msg **env, const uint64_t *rid, int status, const char *why)
{
    if (refusal_loggable(s)) {
        if (rid)
            kvm_serve__log("request %llu refused: %s", (unsigned long long)*rid, why);
        else
            kvm_serve__log("refused an unreadable message from a client (answered as request 0): %s", why);
    }
    kvm_serve__reply_error(s, env, rid ? *rid : 0, status, why);
}

static void on_request(srv *s, kvm_msg **env, kvm_msg **m)
{
    /* the client's key first: ZeroMQ gave the received message its User-Id, which a message
     * rebuilt by cut_document lacks (a keyed front end would then find no client for the
     * compute_missing grant) */
    char key[sizeof((srv_request *)0)->key];
    const char *uid = kvm_msg_user_id(*m);
    snprintf(key, sizeof key, "%s", uid ? uid : "");
    size_t bytes = msg_bytes(*m);
    if ((int64_t)bytes > s->max_msg_bytes) cut_document(s, m, &bytes);
    uint64_t rid = 0;
    int has_id = kvm_serve_request_id(*m, &rid);
    char why[1024];
    int status = 0;
    kvm_proto_type t;
    kvm_proto_ask ask;
    if ((int64_t)bytes > s->max_msg_bytes) {
        status = KVM_ERANGE;
        oversize_why(s, *m, bytes, why, sizeof why);
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
        refuse(s, env, has_id ? &rid : NULL, status, why);
        kvm_msg_free(m);
        return;
    }
    srv_request r = {.env = *env, .msg = *m, .request_id = rid, .t_recv = kvm_now_ms()};
    memcpy(r.key, key, sizeof r.key);
    kvm_serve__doc_key(s, &ask, &r.doc);
    if (queue_push(s, r)) {
        snprintf(why, sizeof why, "server busy: %lld requests are waiting ([serve] max_queue); try again later",
                 (long long)s->n_queue);
        kvm_serve__reply_error(s, env, rid, KVM_EFULL, why);
        kvm_msg_free(m);
        return;
    }
    *env = *m = NULL;
}

/* Why the server refuses a request while it stops, into why[n]: the signal, and that it is
 * worth asking again once the server is back. */
static void stopping_why(const srv *s, char *why, size_t n)
{
    const int sig = s->stop_signal ? *s->stop_signal : 0;
    snprintf(why, n, "the server is stopping (%s): ask again when it is back",
             sig == SIGINT    ? "SIGINT, Ctrl-C"
             : sig == SIGTERM ? "SIGTERM"
             : sig == SIGHUP  ? "SIGHUP"
                              : "stop requested");
}

/* One client message, its routing id in *env (a REQ client's empty delimiter moves there too):
 * queued or answered (both taken). */
static void on_message(srv *s, kvm_msg **env, kvm_msg **m)
{
    /* a REQ client puts an empty delimiter after its routing id: keep it in the envelope */
    if (kvm_msg_nframes(*m) >= 2 && kvm_msg_frame(*m, 0).size == 0) {
        kvm_msg *delim = NULL;
        if (kvm_msg_split(*m, 1, &delim) || kvm_msg_join(*env, &delim)) {
            kvm_serve__log("dropped a message from a client: %s", kvm_errmsg());
            kvm_msg_free(env);
            kvm_msg_free(m);
            return;
        }
    }
    char why[256];
    if (kvm_msg_nframes(*m) == 0) { /* nothing to read a request id from */
        refuse(s, env, NULL, KVM_EPROTO, "an empty message: a request is an ask (PROTOCOL.md)");
        kvm_msg_free(m);
    } else if (*s->interrupts) { /* draining: a request that waited for the stop would get no answer */
        uint64_t rid = 0;
        const int has_id = kvm_serve_request_id(*m, &rid);
        stopping_why(s, why, sizeof why);
        refuse(s, env, has_id ? &rid : NULL, KVM_ESTATE, why);
        kvm_msg_free(m);
    } else
        on_request(s, env, m);
}

void kvm_serve__receive_front(srv *s)
{
    for (int k = 0; k < 1000; k++) {
        kvm_msg *m = NULL, *env = NULL;
        const int rc = kvm_serve_recv_routed(s->front, ZMQ_DONTWAIT, &env, &m);
        if (rc == KVM_EPROTO) { /* too many parts: drained, its sender still told why */
            char why[256];
            snprintf(why, sizeof why, "%s", kvm_errmsg());
            refuse(s, &env, NULL, KVM_EPROTO, why);
            continue;
        }
        if (rc) {
            if (errno != EAGAIN && errno != EINTR) kvm_serve__log("dropped a message from a client: %s", kvm_errmsg());
            return;
        }
        on_message(s, &env, &m);
    }
}
