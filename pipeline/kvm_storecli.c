/* kvm_storecli.c: store service client (kvm_storecli.h). */
#include "pipeline/kvm_storecli.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_serve.h"
#include "proto/kvm_proto.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

struct kvm_storecli {
    void *zctx, *sock;
    void *mon;        /* PAIR socket receiving sock's security handshake failures, or NULL */
    int rejected;     /* the service refused this connection's handshake: retrying cannot help */
    char why[1600];   /* what the refusal said */
    int greeted;      /* a handshake of this connection succeeded */
    int n_no_detail;  /* handshakes of this connection that failed without a reason */
    char hint[1400];  /* cli_no_reply_hint's text */
    char spk[1100], cpk[1100], csk[1100]; /* [security] key files, copied at open */
    char endpoint[1100];
    uint64_t next_request;
    int strict;  /* kvm_storecli_probe_service: any reply but a store_reply is refused (cli_foreign) */
    int foreign; /* such a reply came: the endpoint is not a store service */
};

/* A request that got no reply and is sent again: one log line through the process's log writer,
 * so [run] log_format = json holds for it (the last failure is the caller's to say). */
static void cli_log_retry(const kvm_storecli *c)
{
    kvm_log_field f = KVM_LOG_S("endpoint", c->endpoint);
    kvm_log(KVM_LOG_WARN, "store_retry", &f, 1, "%s; sending it again", kvm_errmsg());
}

/* Longest a send may wait for a connection to take it. With the service down a DEALER queues
 * the request on the pending connection at once; a send waits only when the connection is gone,
 * as after the service refused the handshake (an unknown client key): then, without a limit, the
 * send waited for ever and a run whose key the service did not know hung at its end. */
enum { CLI_SEND_TIMEOUT_MS = 3000 };

static void cli_close_sock(kvm_storecli *c)
{
    /* drained first: an idle client whose reconnects keep failing (a wrong key, a dead proxy)
     * queued events until libzmq's I/O thread blocked, and the stop hung at exit */
    if (c->mon) kvm_msg_monitor_stop(c->sock, &c->mon);
    if (c->sock) zmq_close(c->sock);
    c->sock = NULL;
}

/* Reads the monitor's events; 1 (with the error set, naming the service and what to do) when the
 * service refused the handshake, else 0. */
static int cli_rejected(kvm_storecli *c)
{
    if (c->rejected) return kvm_err(KVM_EIO, "%s", c->why), 1;
    for (int i = 0; c->mon && !c->rejected && i < 16; i++) {
        zmq_msg_t ev, ep;
        zmq_msg_init(&ev);
        zmq_msg_init(&ep);
        uint16_t event = 0;
        uint32_t value = 0;
        int got = zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) >= 0;
        if (got && zmq_msg_size(&ev) >= 6) {
            memcpy(&event, zmq_msg_data(&ev), 2);
            memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
        }
        if (got && zmq_msg_more(&ev)) zmq_msg_recv(&ep, c->mon, 0);
        zmq_msg_close(&ev);
        zmq_msg_close(&ep);
        if (!got) break;
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) c->greeted = 1;
        if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) c->n_no_detail++;
        if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            snprintf(c->why, sizeof c->why,
                     "store service %s rejected this client's key %s (ZAP status %u): add that .public file to the "
                     "service's [security] authorized_keys",
                     c->endpoint, c->cpk, (unsigned)value);
            c->rejected = 1;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && *c->spk) {
            snprintf(c->why, sizeof c->why,
                     "store service %s: the security handshake failed: a wrong server public key (%s), or the "
                     "service uses no CurveZMQ keys",
                     c->endpoint, c->spk);
            c->rejected = 1;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
            snprintf(c->why, sizeof c->why,
                     "store service %s: the security handshake failed: the service uses CurveZMQ keys: set [security] "
                     "server_public_key, client_public_key and client_secret_key in the config (a worker's --config), "
                     "or give the worker --server-key, --client-public, --client-secret when its orchestrator is "
                     "keyed too (they key both; a run on a local bind is not: then --config),",
                     c->endpoint);
            c->rejected = 1;
        }
    }
    if (c->rejected) kvm_err(KVM_EIO, "%s", c->why);
    return c->rejected;
}

/* What to add to a "no reply" error: with CurveZMQ keys, handshakes that failed without a
 * reason and none that succeeded mean the service could not open them, which is what a wrong
 * server public key looks like (a restarting service too, so it is a hint, and the requests'
 * retries go on). "" otherwise. */
static const char *cli_no_reply_hint(kvm_storecli *c)
{
    c->hint[0] = '\0';
    if (cli_rejected(c)) return c->hint; /* said by the caller's check of c->rejected */
    if (*c->spk && c->n_no_detail > 0 && !c->greeted)
        snprintf(c->hint, sizeof c->hint,
                 "; its CurveZMQ handshake failed %d time(s) without a reason and never succeeded: a wrong server "
                 "public key (%s)?",
                 c->n_no_detail, c->spk);
    return c->hint;
}

int kvm_storecli_rejected(const kvm_storecli *c)
{
    return c && c->rejected;
}

/* kvm_msg_send bounded by CLI_SEND_TIMEOUT_MS; a refused handshake is said as such. */
static int cli_send(kvm_storecli *c, kvm_msg **m)
{
    /* wait until the socket takes the message, or the monitor says the service refused us (the
     * refusal may come before the first send: then the connection is gone already) */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (cli_rejected(c)) {
            kvm_msg_free(m);
            return KVM_EIO;
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long left = CLI_SEND_TIMEOUT_MS - ((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
        zmq_pollitem_t it[2] = {{.socket = c->sock, .events = ZMQ_POLLOUT}, {.socket = c->mon, .events = ZMQ_POLLIN}};
        int pr = left > 0 ? zmq_poll(it, c->mon ? 2 : 1, left) : 0;
        if (pr < 0 && errno == EINTR) continue;
        if (pr <= 0 || (it[0].revents & ZMQ_POLLOUT)) break;
    }
    int rc = kvm_msg_send(c->sock, m, 0);
    if (rc && errno == EAGAIN && !cli_rejected(c))
        rc = kvm_err(KVM_EIO, "store service %s: no connection took the request within %d ms", c->endpoint,
                     CLI_SEND_TIMEOUT_MS);
    return rc;
}

static int cli_connect(kvm_storecli *c)
{
    cli_close_sock(c);
    c->rejected = 0;
    c->greeted = 0;
    c->n_no_detail = 0;
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->sock) return kvm_err(KVM_EIO, "store service client: socket: %s", zmq_strerror(errno));
    int linger = 0, sndtimeo = CLI_SEND_TIMEOUT_MS;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &sndtimeo, sizeof sndtimeo);
    const char *spk = c->spk, *cpk = c->cpk, *csk = c->csk;
    int rc;
    if (!*spk && !kvm_curve_is_local(c->endpoint))
        return kvm_err(KVM_EINVAL,
                       "store service %s is not local: set [security] server_public_key, client_public_key and "
                       "client_secret_key (or give the worker --server-key, --client-public, --client-secret)",
                       c->endpoint);
    if (*spk && (rc = kvm_curve_client(c->sock, spk, *cpk ? cpk : NULL, *csk ? csk : NULL))) return rc;
    { /* to say so when the service refuses this key (or needs one), instead of "no reply" */
        static unsigned n_mon;
        char mon_ep[128];
        snprintf(mon_ep, sizeof mon_ep, "inproc://kvmill-storecli-monitor-%ld-%p-%u", (long)getpid(), (void *)c, ++n_mon);
        /* HANDSHAKE_FAILED_NO_DETAIL is not a refusal: it is also a connection lost while it was
         * being made (a service restarting), which the requests' retries are there for; it only
         * adds a hint to "no reply" (cli_no_reply_hint) */
        if (zmq_socket_monitor(c->sock, mon_ep,
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                   ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_SUCCEEDED) == 0) {
            c->mon = zmq_socket(c->zctx, ZMQ_PAIR);
            if (c->mon && zmq_connect(c->mon, mon_ep)) zmq_close(c->mon), c->mon = NULL;
            if (!c->mon) kvm_msg_monitor_stop(c->sock, NULL);
        }
    }
    if (zmq_connect(c->sock, c->endpoint))
        return kvm_err(KVM_EIO, "store service client: cannot connect to %s: %s", c->endpoint, zmq_strerror(errno));
    return 0;
}

kvm_storecli_keys kvm_storecli_keys_of(const kvm_config *cfg, const char *server_key, const char *client_public,
                                       const char *client_secret)
{
    const char *spk = cfg ? kvm_config_str(cfg, "security", "server_public_key") : "";
    if (*spk)
        return (kvm_storecli_keys){spk, kvm_config_str(cfg, "security", "client_public_key"),
                                   kvm_config_str(cfg, "security", "client_secret_key")};
    return (kvm_storecli_keys){server_key, client_public, client_secret};
}

int kvm_storecli_open(const kvm_storecli_keys *keys, const char *endpoint, kvm_storecli **out)
{
    *out = NULL;
    kvm_storecli *c = calloc(1, sizeof *c);
    if (!c) return kvm_err(KVM_ENOMEM, "store service client: out of memory");
    snprintf(c->spk, sizeof c->spk, "%s", keys && keys->server_public ? keys->server_public : "");
    snprintf(c->cpk, sizeof c->cpk, "%s", keys && keys->client_public ? keys->client_public : "");
    snprintf(c->csk, sizeof c->csk, "%s", keys && keys->client_secret ? keys->client_secret : "");
    snprintf(c->endpoint, sizeof c->endpoint, "%s", endpoint);
    c->next_request = (uint64_t)time(NULL) << 20;
    c->zctx = zmq_ctx_new();
    int rc = kvm_serve_endpoint_check(endpoint, "store service");
    if (!rc) rc = c->zctx ? cli_connect(c) : kvm_err(KVM_EIO, "store service client: no ZeroMQ context");
    if (rc) {
        kvm_storecli_close(&c);
        return rc;
    }
    *out = c;
    return 0;
}

void kvm_storecli_close(kvm_storecli **c)
{
    if (!c || !*c) return;
    cli_close_sock(*c);
    kvm_curve_ctx_term((*c)->zctx); /* restarted after a signal: no I/O thread outlives the close */
    free(*c);
    *c = NULL;
}

/* The error for an `answer` m on this connection: only kvmill serve's front end sends one (it
 * answers every message that is not an ask so, "unexpected claim message: this server answers
 * ask"), so the endpoint is the front end, not a store service; waiting on for a store_reply
 * said "no reply ... is kvmill store serve running?" after every attempt's timeout instead.
 * As kvmill ask says the opposite mix-up (a store service's store_reply to an ask). KVM_EPROTO. */
static int cli_serve_front_end(const kvm_storecli *c, const kvm_msg *m)
{
    kvm_proto_answer a;
    int said = kvm_proto_answer_decode(m, &a) == 0 && a.message.len > 0;
    return kvm_err(KVM_EPROTO,
                   "%s is a kvmill serve front end (it answers ask%s%.*s%s), not a store service (kvmill store "
                   "serve): point [store] path (a run's, or kvmill serve's) or [store] service (a worker's) at the "
                   "store service's endpoint",
                   c->endpoint, said ? "; it said \"" : "", said ? (int)a.message.len : 0, said ? a.message.ptr : "",
                   said ? "\"" : "");
}

/* The error for a reply m (type t; m NULL: one that is not kvmill's protocol) on a strict
 * connection: a fresh connection has asked nothing else, so anything but a store_reply is
 * another kind of endpoint (a serve front end's answer, another kvmill socket's message)
 * behind [store] path. Sets c->foreign. KVM_EPROTO. */
static int cli_foreign(kvm_storecli *c, const kvm_msg *m, kvm_proto_type t)
{
    c->foreign = 1;
    if (!m)
        return kvm_err(KVM_EPROTO,
                       "%s is not a store service: it answered with a message that is not kvmill's "
                       "protocol",
                       c->endpoint);
    if (t == KVM_PROTO_ANSWER) { /* its own words first: they name the front end */
        cli_serve_front_end(c, m);
        char why[2048];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        return kvm_err(KVM_EPROTO, "%s is not a store service: it answered with %s: %s", c->endpoint,
                       kvm_proto_type_name(t), why);
    }
    return kvm_err(KVM_EPROTO,
                   "%s is not a store service: it answered with %s, where kvmill store serve answers with "
                   "store_reply (another kvmill endpoint there?): name the store service's endpoint",
                   c->endpoint, kvm_proto_type_name(t));
}

/* Waits for the store_reply of request req (older replies are skipped). 1: got it in *r (its
 * message borrowed from *m, which the caller frees), 0: timed out, < 0: error (KVM_EPROTO at
 * once when the endpoint turns out to be kvmill serve's front end). */
static int cli_wait(kvm_storecli *c, uint64_t req, int timeout_ms, kvm_msg **m, kvm_proto_store_reply *r)
{
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long left = timeout_ms - ((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000);
        if (left <= 0) return 0;
        zmq_pollitem_t it[2] = {{.socket = c->sock, .events = ZMQ_POLLIN}, {.socket = c->mon, .events = ZMQ_POLLIN}};
        int pr = zmq_poll(it, c->mon ? 2 : 1, left);
        if (pr < 0 && errno == EINTR) continue;
        if (pr < 0) return kvm_err(KVM_EIO, "store service client: poll: %s", zmq_strerror(errno));
        if (pr == 0) return 0;
        if (c->mon && (it[1].revents & ZMQ_POLLIN) && cli_rejected(c)) return KVM_EIO;
        if (!(it[0].revents & ZMQ_POLLIN)) continue;
        kvm_msg_free(m);
        if (kvm_msg_recv(c->sock, m, ZMQ_DONTWAIT)) continue;
        kvm_proto_type t;
        if (kvm_proto_peek(*m, &t)) {
            if (c->strict) return cli_foreign(c, NULL, 0);
            continue;
        }
        if (c->strict && t != KVM_PROTO_STORE_REPLY) return cli_foreign(c, *m, t);
        if (t == KVM_PROTO_ANSWER) return cli_serve_front_end(c, *m);
        if (t != KVM_PROTO_STORE_REPLY) continue; /* layers of an old get */
        int rc = kvm_proto_store_reply_decode(*m, r);
        if (rc && c->strict) {
            char why[1024];
            snprintf(why, sizeof why, "%s", kvm_errmsg());
            c->foreign = 1;
            return kvm_err(KVM_EPROTO, "%s is not a store service: its store_reply does not decode (%s)", c->endpoint,
                           why);
        }
        if (rc) return rc;
        if (r->request_id == req) return 1;
    }
}

static int cli_send_copy(kvm_storecli *c, const kvm_msg *m, int64_t *bytes)
{
    kvm_msg *cp = NULL;
    int rc = kvm_msg_new(&cp);
    for (size_t f = 0; !rc && f < kvm_msg_nframes(m); f++) {
        kvm_frame fr = kvm_msg_frame(m, f);
        rc = kvm_msg_add_copy(cp, fr.data, fr.size);
        if (bytes) *bytes += (int64_t)fr.size;
    }
    if (!rc) return cli_send(c, &cp);
    kvm_msg_free(&cp);
    return rc;
}

static int cli_status(const kvm_proto_store_reply *r)
{
    return kvm_err(r->status, "store service: %.*s", (int)r->message.len, r->message.ptr);
}

int kvm_storecli_put(kvm_storecli *c, const kvm_serve_cache_enc *e, uint64_t job_id, const char *doc_name,
                     int timeout_ms, int attempts, int64_t *bytes)
{
    kvm_proto_put_cache p = {.job_id = job_id, .n_layers = e->n_layers, .n_tokens = e->man.n_tokens,
                             .n_entries = e->man.n_entries, .full_bytes = e->man.full_bytes,
                             .dtype = kvm_proto_str_c(e->man.dtype),
                             .config = {(const uint8_t *)e->canon, e->canon_n},
                             .doc_name = kvm_proto_str_c(doc_name)};
    kvm_proto_cache c0;
    int rc = e->n_layers > 0 ? kvm_proto_cache_decode(e->msgs[0], &c0) : kvm_err(KVM_EINVAL, "a cache without layers");
    if (rc) return rc;
    p.n_kv_heads = c0.n_kv_heads, p.head_dim = c0.head_dim;
    memcpy(p.model_id, e->man.model_id.b, KVM_PROTO_ID_BYTES);
    memcpy(p.doc_hash, e->man.doc_hash.b, KVM_PROTO_ID_BYTES);
    memcpy(p.config_id, e->man.config_id.b, KVM_PROTO_ID_BYTES);
    memcpy(p.tokenizer_id, e->man.tokenizer_id.b, KVM_PROTO_ID_BYTES);
    for (int a = 0; a < attempts; a++) {
        if (a > 0 && (rc = cli_connect(c))) return rc;
        p.request_id = ++c->next_request;
        kvm_msg *h = NULL, *reply = NULL;
        kvm_proto_store_reply r;
        if ((rc = kvm_proto_put_cache_encode(&p, &h))) return rc;
        if (bytes) *bytes += (int64_t)kvm_msg_frame(h, 0).size;
        rc = cli_send(c, &h);
        for (int l = 0; !rc && l < e->n_layers; l++)
            rc = cli_send_copy(c, e->msgs[l], bytes);
        if (!rc) rc = cli_wait(c, p.request_id, timeout_ms, &reply, &r);
        if (rc == 1) rc = r.status < 0 ? cli_status(&r) : 0;
        else if (rc == 0)
            rc = kvm_err(KVM_EIO, "store service %s: no reply to the upload within %d ms (attempt %d of %d)%s",
                         c->endpoint, timeout_ms, a + 1, attempts, cli_no_reply_hint(c));
        kvm_msg_free(&reply);
        if (rc != KVM_EIO || c->rejected) return rc;
        if (a + 1 < attempts) cli_log_retry(c);
    }
    return rc;
}

int kvm_storecli_get(kvm_storecli *c, const kvm_store_cache_key *key, int timeout_ms, kvm_msg ***layers,
                     int *n_layers)
{
    *layers = NULL;
    *n_layers = 0;
    kvm_proto_get_cache g = {.request_id = ++c->next_request};
    memcpy(g.model_id, key->model_id.b, KVM_PROTO_ID_BYTES);
    memcpy(g.doc_hash, key->doc_hash.b, KVM_PROTO_ID_BYTES);
    memcpy(g.config_id, key->config_id.b, KVM_PROTO_ID_BYTES);
    kvm_msg *m = NULL;
    kvm_proto_store_reply r;
    int rc = kvm_proto_get_cache_encode(&g, &m);
    if (!rc) rc = cli_send(c, &m);
    if (!rc) rc = cli_wait(c, g.request_id, timeout_ms, &m, &r);
    if (rc == 0)
        rc = kvm_err(KVM_EIO, "store service %s: no reply within %d ms%s", c->endpoint, timeout_ms,
                     cli_no_reply_hint(c));
    if (rc == 1) rc = r.status < 0 ? cli_status(&r) : 0;
    int64_t n = rc ? 0 : r.n_layers;
    kvm_msg_free(&m);
    kvm_msg **out = rc || n == 0 ? NULL : calloc((size_t)n, sizeof *out);
    if (!rc && n > 0 && !out) rc = kvm_err(KVM_ENOMEM, "out of memory");
    for (int64_t l = 0; !rc && l < n; l++) {
        zmq_pollitem_t it = {.socket = c->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, timeout_ms) <= 0) {
            rc = kvm_err(KVM_EIO, "store service %s: layer %lld of %lld did not arrive", c->endpoint, (long long)l,
                         (long long)n);
            break;
        }
        rc = kvm_msg_recv(c->sock, &out[l], 0);
    }
    if (rc) {
        for (int64_t l = 0; out && l < n; l++)
            kvm_msg_free(&out[l]);
        free(out);
        return rc;
    }
    *layers = out;
    *n_layers = (int)n;
    return 0;
}

int kvm_storecli_get_strategy(kvm_storecli *c, const kvm_store_id *model_id, const char *name, int timeout_ms,
                              int attempts, uint8_t **data, size_t *len)
{
    *data = NULL;
    *len = 0;
    kvm_proto_get_strategy g = {.name = kvm_proto_str_c(name)};
    memcpy(g.model_id, model_id->b, KVM_PROTO_ID_BYTES);
    int rc = KVM_EIO;
    for (int a = 0; a < attempts; a++) {
        if (a > 0 && (rc = cli_connect(c))) return rc;
        g.request_id = ++c->next_request;
        kvm_msg *m = NULL;
        kvm_proto_store_reply r;
        rc = kvm_proto_get_strategy_encode(&g, &m);
        if (!rc) rc = cli_send(c, &m);
        if (!rc) rc = cli_wait(c, g.request_id, timeout_ms, &m, &r);
        if (rc == 0)
            rc = kvm_err(KVM_EIO, "store service %s: no reply to get_strategy within %d ms (attempt %d of %d)%s",
                         c->endpoint, timeout_ms, a + 1, attempts, cli_no_reply_hint(c));
        else if (rc == 1 && r.status < 0)
            rc = cli_status(&r);
        else if (rc == 1 && r.strategy.len == 0)
            rc = kvm_err(KVM_EPROTO, "store service %s: the reply to get_strategy carries no strategy", c->endpoint);
        else if (rc == 1) {
            rc = (*data = malloc(r.strategy.len)) ? 0 : kvm_err(KVM_ENOMEM, "out of memory");
            if (!rc) memcpy(*data, r.strategy.ptr, r.strategy.len), *len = r.strategy.len;
        }
        kvm_msg_free(&m);
        if (rc != KVM_EIO || c->rejected) return rc;
        if (a + 1 < attempts) cli_log_retry(c);
    }
    return rc;
}

/* Sends m (built anew for each attempt by enc) and waits for its store_reply; reconnects and
 * retries when none comes. 1 with *r (borrowed from *reply, the caller frees it), or < 0. */
typedef int (*cli_encode_fn)(const void *req, uint64_t request_id, kvm_msg **out);

static int cli_request(kvm_storecli *c, const char *what, cli_encode_fn enc, const void *req, int timeout_ms,
                       int attempts, kvm_msg **reply, kvm_proto_store_reply *r)
{
    int rc = KVM_EIO;
    for (int a = 0; a < attempts; a++) {
        if (a > 0 && (rc = cli_connect(c))) return rc;
        uint64_t id = ++c->next_request;
        kvm_msg *m = NULL;
        rc = enc(req, id, &m);
        if (!rc) rc = cli_send(c, &m);
        kvm_msg_free(&m);
        if (!rc) rc = cli_wait(c, id, timeout_ms, reply, r);
        if (rc == 1) return r->status < 0 ? cli_status(r) : 1;
        if (rc == 0)
            rc = kvm_err(KVM_EIO, "store service %s: no reply to %s within %d ms (attempt %d of %d)%s", c->endpoint,
                         what, timeout_ms, a + 1, attempts, cli_no_reply_hint(c));
        if (rc != KVM_EIO || c->rejected) return rc;
        if (a + 1 < attempts) cli_log_retry(c);
    }
    return rc;
}

static int enc_claim(const void *req, uint64_t id, kvm_msg **out)
{
    kvm_proto_claim g = *(const kvm_proto_claim *)req;
    g.request_id = id;
    return kvm_proto_claim_encode(&g, out);
}

static int enc_renew(const void *req, uint64_t id, kvm_msg **out)
{
    kvm_proto_renew_claims g = *(const kvm_proto_renew_claims *)req;
    g.request_id = id;
    return kvm_proto_renew_claims_encode(&g, out);
}

int kvm_storecli_claim(kvm_storecli *c, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id,
                       const char *owner, const char *host, int64_t ttl_ms, int flags, int timeout_ms, int attempts,
                       kvm_storecli_claim_state *state, kvm_storecli_claim_info *info)
{
    const int probe = (flags & KVM_STORECLI_PROBE) != 0;
    *state = 0;
    if (info) memset(info, 0, sizeof *info);
    kvm_proto_claim g = {.owner = kvm_proto_str_c(owner),
                         .host = kvm_proto_str_c(host),
                         .ttl_ms = ttl_ms,
                         .probe = probe,
                         .index_only = (flags & KVM_STORECLI_INDEX_ONLY) != 0};
    memcpy(g.model_id, key->model_id.b, KVM_PROTO_ID_BYTES);
    memcpy(g.doc_hash, key->doc_hash.b, KVM_PROTO_ID_BYTES);
    memcpy(g.config_id, key->config_id.b, KVM_PROTO_ID_BYTES);
    if (tokenizer_id) memcpy(g.tokenizer_id, tokenizer_id->b, KVM_PROTO_ID_BYTES);
    kvm_msg *reply = NULL;
    kvm_proto_store_reply r;
    int rc = cli_request(c, "claim", enc_claim, &g, timeout_ms, attempts, &reply, &r);
    if (rc == 1) {
        static const char *const names[] = {"", "taken", "held", "stored", "missing"};
        for (int i = 1; i <= KVM_STORECLI_MISSING; i++)
            if (kvm_proto_str_eq(r.claim, names[i])) *state = (kvm_storecli_claim_state)i;
        rc = *state && (!probe || *state >= KVM_STORECLI_STORED) && (probe || *state != KVM_STORECLI_MISSING)
                 ? 0
                 : kvm_err(KVM_EPROTO, "store service %s: the reply to a claim says \"%.*s\" (a service older than "
                                       "protocol revision 6 answers no claims)", c->endpoint, (int)r.claim.len, r.claim.ptr);
    }
    if (rc == 0 && info) {
        snprintf(info->holder.owner, sizeof info->holder.owner, "%.*s", (int)r.holder.len, r.holder.ptr);
        snprintf(info->holder.host, sizeof info->holder.host, "%.*s", (int)r.holder_host.len, r.holder_host.ptr);
        info->holder.expires_unix_ms = r.holder_expires_ms; /* 0 from a revision-11 service */
        info->full_bytes = r.full_bytes, info->stored_bytes = r.stored_bytes;
    }
    kvm_msg_free(&reply);
    return rc;
}

int kvm_storecli_probe_service(kvm_storecli *c, int timeout_ms)
{
    kvm_store_cache_key key = {0}; /* a cache nobody stores: the probe only reads */
    kvm_storecli_claim_state state;
    c->strict = 1, c->foreign = 0;
    int rc =
        kvm_storecli_claim(c, &key, NULL, "kvmill-serve-probe", "", 0, KVM_STORECLI_PROBE, timeout_ms, 1, &state, NULL);
    c->strict = 0;
    if (c->foreign) return KVM_EPROTO;
    return rc == KVM_EIO ? KVM_EIO : 0; /* a store_reply, even a refusal of this probe, is a store service's */
}

int kvm_storecli_renew(kvm_storecli *c, const char *owner, int64_t ttl_ms, int release, int timeout_ms, int attempts,
                       int64_t *n)
{
    if (n) *n = 0;
    kvm_proto_renew_claims g = {.owner = kvm_proto_str_c(owner), .ttl_ms = ttl_ms, .release = release != 0};
    kvm_msg *reply = NULL;
    kvm_proto_store_reply r;
    int rc = cli_request(c, "renew_claims", enc_renew, &g, timeout_ms, attempts, &reply, &r);
    if (rc == 1) {
        rc = 0;
        if (n) *n = r.n_claims;
    }
    kvm_msg_free(&reply);
    return rc;
}
