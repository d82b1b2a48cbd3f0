/* check_storesvc.c: the store service (pipeline/kvm_storesvc.h) and its client
 * (pipeline/kvm_storecli.h) over TCP loopback: an upload commits and reads back; bad input
 * (layers that do not match the upload or the stored model, a truncated upload, a client
 * without a CurveZMQ key) is refused with a reason and leaves the store unchanged; a client
 * whose service restarts retries its upload; get_strategy (revision 5) returns the stored
 * PolyKV strategy read-only, names the model and strategy when none is stored, and refuses a
 * malformed request with a reason; claims over the wire (revision 6): taken, held by another
 * run, stored, probed, renewed, released, lapsed after the owner's lease; a malformed claim is
 * refused with a reason and changes no claim. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/kvm_error.h"
#include "pipeline/kvm_curve.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storecli.h"
#include "pipeline/kvm_storesvc.h"
#include "proto/kvm_proto.h"
#include "tests/util/kvm_test.h"

/* the client's keys from a config's [security] */
#define KEYS(cfg) (&(kvm_storecli_keys){kvm_config_str(cfg, "security", "server_public_key"),                     \
                                        kvm_config_str(cfg, "security", "client_public_key"),                     \
                                        kvm_config_str(cfg, "security", "client_secret_key")})

enum { L = 3, H = 2, D = 4, N = 8, PER_HEAD = 3 };

static char *g_dir;
static char g_store[4200], g_ep[1100];
static int g_max_readers; /* the service's store: slots of its reader table (0: LMDB's default) */

/* The service in a thread of this process, over its own ZeroMQ context. */
typedef struct svc_thread {
    pthread_t th;
    void *zctx, *sock;
    kvm_store *store;
    kvm_config *cfg;
    volatile sig_atomic_t stop;
    kvm_storesvc_stats stats;
    int64_t upload_timeout_ms;
} svc_thread;

static void *svc_main(void *arg)
{
    svc_thread *t = arg;
    kvm_storesvc_loop(&t->store, t->sock, t->upload_timeout_ms, &t->stop, &t->stats, stderr);
    return NULL;
}

static kvm_config *config(const char *extra)
{
    char text[8192];
    snprintf(text, sizeof text, "[model]\npath = %s\n[store]\npath = %s\n%s", kvm_test_data_path("models/stories260K.bin"),
             g_store, extra ? extra : "");
    kvm_config *c = NULL;
    ck_assert_msg(kvm_config_parse(text, "test", &c) == 0, "%s", kvm_errmsg());
    return c;
}

/* Starts the service on tcp://127.0.0.1:port (port 0: any; g_ep gets the bound one). */
static void svc_start(svc_thread *t, const char *security, int port)
{
    memset(t, 0, sizeof *t);
    t->cfg = config(security);
    t->upload_timeout_ms = 1500;
    kvm_store_opts o = {.no_sync = 1, .max_readers = g_max_readers};
    ck_assert_msg(kvm_store_open(g_store, &o, &t->store) == 0, "%s", kvm_errmsg());
    t->zctx = zmq_ctx_new();
    t->sock = zmq_socket(t->zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(t->sock, ZMQ_LINGER, &linger, sizeof linger);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    int rc = -1;
    for (int i = 0; i < 50 && rc; i++) /* a restart on the same port may wait for the old one */
        if ((rc = kvm_serve_bind(t->zctx, t->sock, port ? ep : "tcp://127.0.0.1:0", t->cfg, 1, "test")))
            usleep(100000);
    ck_assert_msg(rc == 0, "%s", kvm_errmsg());
    kvm_serve_bound_endpoint(t->sock, ep, g_ep, sizeof g_ep);
    ck_assert_int_eq(pthread_create(&t->th, NULL, svc_main, t), 0);
}

static void svc_stop(svc_thread *t)
{
    t->stop = 1;
    pthread_join(t->th, NULL);
    zmq_close(t->sock);
    kvm_curve_ctx_term(t->zctx); /* as kvm_storesvc_main ends: the ZAP handler is joined */
    kvm_store_close(&t->store);
    kvm_config_free(&t->cfg);
}

static void setup(void)
{
    g_dir = kvm_test_tmpdir();
    snprintf(g_store, sizeof g_store, "%s/store.lmdb", g_dir);
    g_max_readers = 0; /* LMDB's default unless a case sets it (CK_FORK=no runs the cases in one process) */
}

static void teardown(void)
{
    kvm_test_rmtree(g_dir);
    free(g_dir);
}

/* A synthetic cache of L layers (PER_HEAD f32 entries per KV head), doc `seed`. */
static void make_cache(int seed, kvm_serve_cache_enc *e)
{
    static float kv[H * PER_HEAD * D];
    static int32_t he[H] = {PER_HEAD, PER_HEAD}, pos[H * PER_HEAD];
    static float bias[H * PER_HEAD];
    for (int i = 0; i < H * PER_HEAD * D; i++)
        kv[i] = 0.25f * (float)(i % 7) - (float)seed;
    for (int i = 0; i < H * PER_HEAD; i++)
        pos[i] = i % N, bias[i] = 0.0f;
    memset(e, 0, sizeof *e);
    e->n_layers = L;
    e->msgs = calloc(L, sizeof *e->msgs);
    for (int l = 0; l < L; l++) {
        kvm_proto_cache c = {.layer = l, .n_layers = L, .n_kv_heads = H, .head_dim = D, .n_tokens = N,
                             .n_entries = H * PER_HEAD, .dtype = KVM_PROTO_F32, .head_entries = he, .keys = kv,
                             .values = kv, .positions = pos, .logit_bias = bias};
        ck_assert_msg(kvm_proto_cache_encode(&c, &e->msgs[l]) == 0, "%s", kvm_errmsg());
    }
    e->canon = strdup("kvmill.algorithm=1\nmodel.context=8\nstore.dtype=f32\n");
    e->canon_n = strlen(e->canon);
    e->man = (kvm_store_manifest){.n_layers = L, .n_tokens = N, .n_entries = L * H * PER_HEAD,
                                  .full_bytes = 2LL * L * H * N * D * 4};
    snprintf(e->man.dtype, sizeof e->man.dtype, "f32");
    kvm_store_hash_bytes(e->canon, e->canon_n, &e->man.config_id);
    for (int i = 0; i < KVM_STORE_ID_BYTES; i++)
        e->man.model_id.b[i] = (uint8_t)(i + 1), e->man.doc_hash.b[i] = (uint8_t)(seed * 31 + i);
}

static kvm_store_cache_key key_of(const kvm_serve_cache_enc *e)
{
    return (kvm_store_cache_key){.model_id = e->man.model_id, .doc_hash = e->man.doc_hash,
                                 .config_id = e->man.config_id};
}

/* How many layers the service returns for e's key (-status when refused). */
static int fetch(kvm_storecli *c, const kvm_serve_cache_enc *e)
{
    kvm_store_cache_key k = key_of(e);
    kvm_msg **layers = NULL;
    int n = 0, rc = kvm_storecli_get(c, &k, 3000, &layers, &n);
    if (rc) return rc;
    for (int l = 0; l < n; l++) {
        kvm_proto_cache pc;
        ck_assert_msg(kvm_proto_cache_decode(layers[l], &pc) == 0, "%s", kvm_errmsg());
        ck_assert_int_eq(pc.layer, l);
        ck_assert_int_eq(pc.n_entries, H * PER_HEAD);
        kvm_msg_free(&layers[l]);
    }
    free(layers);
    return n;
}

/* Caches in the store, counted after the service stopped. */
static int count_caches(void)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.read_only = 1};
    ck_assert_msg(kvm_store_open(g_store, &o, &s) == 0, "%s", kvm_errmsg());
    kvm_store_stats st;
    ck_assert_int_eq(kvm_store_stats_get(s, &st), 0);
    kvm_store_close(&s);
    return (int)st.n_caches;
}

START_TEST(test_put_then_get)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_msg(kvm_storecli_open(KEYS(cfg), g_ep, &c) == 0, "%s", kvm_errmsg());
    kvm_serve_cache_enc e;
    make_cache(1, &e);
    ck_assert_int_eq(fetch(c, &e), KVM_ENOTFOUND);
    int64_t bytes = 0;
    ck_assert_msg(kvm_storecli_put(c, &e, 42, "doc_001.txt", 3000, 1, &bytes) == 0, "%s", kvm_errmsg());
    ck_assert_int_gt(bytes, (int64_t)(L * 2 * H * PER_HEAD * D * sizeof(float)));
    ck_assert_int_eq(fetch(c, &e), L);
    ck_assert_int_eq(t.stats.committed, 1);
    /* the service counts a get once its last layer is sent: the client may have them first */
    for (int i = 0; i < 200 && t.stats.served < 1; i++) usleep(10000);
    ck_assert_int_eq(t.stats.served, 1);
    kvm_serve_cache_enc_free(&e);
    kvm_storecli_close(&c);
    kvm_config_free(&cfg);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 1);
    /* the document's name came with the upload */
    kvm_store *s = NULL;
    kvm_store_opts o = {.read_only = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    make_cache(1, &e);
    kvm_store_doc_meta dm;
    ck_assert_int_eq(kvm_store_get_doc(s, &e.man.doc_hash, &dm), 0);
    ck_assert_str_eq(dm.source, "doc_001.txt");
    kvm_serve_cache_enc_free(&e);
    kvm_store_close(&s);
}
END_TEST

/* Renames paths[0] to paths[1] 200 ms from now (the second mv of a swap, a moment later). */
static void *move_in_later(void *arg)
{
    const char **paths = arg;
    usleep(200000);
    if (rename(paths[0], paths[1])) perror("rename");
    return NULL;
}

/* A compacted copy moved in place of the store while the service runs: its commits went on into
 * the file moved away, lost to every reader of the path. It opens the store there again first:
 * the upload after the swap lands in the store at the path, and is served from it. */
START_TEST(test_store_replaced_under_service)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_msg(kvm_storecli_open(KEYS(cfg), g_ep, &c) == 0, "%s", kvm_errmsg());
    kvm_serve_cache_enc e1, e2;
    make_cache(1, &e1);
    make_cache(2, &e2);
    int64_t bytes = 0;
    ck_assert_msg(kvm_storecli_put(c, &e1, 1, "doc_001.txt", 3000, 1, &bytes) == 0, "%s", kvm_errmsg());
    char moved[4300], fresh[4300];
    snprintf(moved, sizeof moved, "%s/store.old", g_dir);
    snprintf(fresh, sizeof fresh, "%s/store.new", g_dir);
    kvm_test_store_create(fresh);
    ck_assert_int_eq(rename(g_store, moved), 0);
    /* mid-swap, nothing at the path for 200 ms: the service waits for the swap to end (it makes no
     * new store there, which the second mv would then have moved the copy into) and commits into
     * the store moved in */
    const char *swap[2] = {fresh, g_store};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, move_in_later, swap), 0);
    kvm_serve_cache_enc e3;
    make_cache(3, &e3);
    ck_assert_msg(kvm_storecli_put(c, &e3, 3, "doc_003.txt", 5000, 1, &bytes) == 0, "%s", kvm_errmsg());
    pthread_join(th, NULL);
    ck_assert_int_eq(fetch(c, &e3), L);
    kvm_serve_cache_enc_free(&e3);
    ck_assert_msg(kvm_storecli_put(c, &e2, 2, "doc_002.txt", 3000, 1, &bytes) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(fetch(c, &e2), L);
    ck_assert_int_eq(fetch(c, &e1), KVM_ENOTFOUND); /* the store moved in never held it */
    /* the store moved away and nothing put back (past the swap's second): every request is
     * refused naming why, none committed into the folder moved away and acknowledged */
    char away[4300];
    snprintf(away, sizeof away, "%s/store.away", g_dir);
    ck_assert_int_eq(rename(g_store, away), 0);
    make_cache(4, &e3);
    int rc = kvm_storecli_put(c, &e3, 4, "doc_004.txt", 5000, 1, &bytes);
    ck_assert_msg(rc != 0 && strstr(kvm_errmsg(), "is gone since this process opened it"),
                  "put into a gone store: %d %s", rc, kvm_errmsg());
    ck_assert_int_eq(fetch(c, &e2), KVM_ESTATE);
    /* put back: served again */
    ck_assert_int_eq(rename(away, g_store), 0);
    ck_assert_int_eq(fetch(c, &e2), L);
    /* another data.mdb moved inside the opened folder beside its lock.mdb (which this process
     * holds open: LMDB cannot open it twice): refused as gone, not read from the old file */
    char fresh_data[4400], data[4400];
    kvm_test_store_create(fresh);
    snprintf(fresh_data, sizeof fresh_data, "%s/data.mdb", fresh);
    snprintf(data, sizeof data, "%s/data.mdb", g_store);
    ck_assert_int_eq(rename(fresh_data, data), 0);
    ck_assert_int_eq(fetch(c, &e2), KVM_ESTATE);
    kvm_serve_cache_enc_free(&e3);
    kvm_serve_cache_enc_free(&e1);
    kvm_serve_cache_enc_free(&e2);
    kvm_storecli_close(&c);
    kvm_config_free(&cfg);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 0); /* the data.mdb moved in: an empty store */
    (void)moved;
}
END_TEST

/* Layers whose shape is not the upload's, and an upload not shaped like the stored model. */
START_TEST(test_layers_mismatch_refused)
{
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    kvm_serve_cache_enc e;
    make_cache(2, &e);
    kvm_store_model_meta mm = {.n_layers = L + 1, .n_heads = H, .n_kv_heads = H, .head_dim = D};
    ck_assert_int_eq(kvm_store_put_model(s, &e.man.model_id, &mm), 0);
    kvm_store_close(&s);
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &c), 0);
    ck_assert_int_eq(kvm_storecli_put(c, &e, 1, NULL, 3000, 1, NULL), KVM_EMISMATCH);
    ck_assert_msg(strstr(kvm_errmsg(), "the stored model 4 x 2 x 4"), "%s", kvm_errmsg());
    /* another model id (no stored shape), but layer 1 claims another layer count */
    e.man.model_id.b[0] ^= 0xff;
    kvm_msg_free(&e.msgs[1]);
    static float kv[H * PER_HEAD * D];
    static int32_t he[H] = {PER_HEAD, PER_HEAD}, pos[H * PER_HEAD];
    static float bias[H * PER_HEAD];
    kvm_proto_cache bad = {.layer = 1, .n_layers = L + 2, .n_kv_heads = H, .head_dim = D, .n_tokens = N,
                           .n_entries = H * PER_HEAD, .dtype = KVM_PROTO_F32, .head_entries = he, .keys = kv,
                           .values = kv, .positions = pos, .logit_bias = bias};
    ck_assert_int_eq(kvm_proto_cache_encode(&bad, &e.msgs[1]), 0);
    ck_assert_int_eq(kvm_storecli_put(c, &e, 2, NULL, 3000, 1, NULL), KVM_EMISMATCH);
    ck_assert_msg(strstr(kvm_errmsg(), "cache message 1 (layer 1 of 5") && strstr(kvm_errmsg(), "does not match"), "%s",
                  kvm_errmsg());
    ck_assert_int_eq(fetch(c, &e), KVM_ENOTFOUND);
    ck_assert_int_eq(t.stats.refused, 2);
    kvm_serve_cache_enc_free(&e);
    kvm_storecli_close(&c);
    kvm_config_free(&cfg);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 0);
}
END_TEST

/* A raw client sends the header and only some layers: refused when its next request comes,
 * and refused on the timeout when none does. */
START_TEST(test_truncated_upload_refused)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    t.upload_timeout_ms = 1500;
    kvm_serve_cache_enc e;
    make_cache(3, &e);
    void *zctx = zmq_ctx_new(), *d = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0, rcv = 5000;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    ck_assert_int_eq(zmq_connect(d, g_ep), 0);
    for (int round = 0; round < 2; round++) {
        kvm_proto_put_cache p = {.request_id = 100 + round, .n_layers = L, .n_kv_heads = H, .head_dim = D,
                                 .n_tokens = N, .n_entries = L * H * PER_HEAD, .dtype = kvm_proto_str_c("f32"),
                                 .config = {(const uint8_t *)e.canon, e.canon_n}};
        memcpy(p.model_id, e.man.model_id.b, 32);
        memcpy(p.doc_hash, e.man.doc_hash.b, 32);
        memcpy(p.config_id, e.man.config_id.b, 32);
        kvm_msg *m = NULL;
        ck_assert_int_eq(kvm_proto_put_cache_encode(&p, &m), 0);
        ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
        kvm_msg *l0 = NULL;
        ck_assert_int_eq(kvm_msg_new(&l0), 0);
        for (size_t f = 0; f < kvm_msg_nframes(e.msgs[0]); f++)
            kvm_msg_add_copy(l0, kvm_msg_frame(e.msgs[0], f).data, kvm_msg_frame(e.msgs[0], f).size);
        ck_assert_int_eq(kvm_msg_send(d, &l0, 0), 0);
        if (round == 0) { /* a get_cache before the last layer: the upload is cut */
            kvm_proto_get_cache g = {.request_id = 7};
            memcpy(g.model_id, p.model_id, 32);
            memcpy(g.doc_hash, p.doc_hash, 32);
            memcpy(g.config_id, p.config_id, 32);
            ck_assert_int_eq(kvm_proto_get_cache_encode(&g, &m), 0);
            ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
        }
        kvm_msg *r = NULL;
        kvm_proto_store_reply sr;
        ck_assert_msg(kvm_msg_recv(d, &r, 0) == 0, "no refusal in round %d", round);
        ck_assert_int_eq(kvm_proto_store_reply_decode(r, &sr), 0);
        ck_assert_int_eq(sr.request_id, 100 + round);
        ck_assert_int_eq(sr.status, KVM_EPROTO);
        ck_assert_msg(sr.message.len > 0 && strstr(sr.message.ptr, "truncated upload"), "%.*s", (int)sr.message.len,
                      sr.message.ptr);
        kvm_msg_free(&r);
        if (round == 0) { /* and the get_cache is answered: not found */
            ck_assert_int_eq(kvm_msg_recv(d, &r, 0), 0);
            ck_assert_int_eq(kvm_proto_store_reply_decode(r, &sr), 0);
            ck_assert_int_eq(sr.request_id, 7);
            ck_assert_int_eq(sr.status, KVM_ENOTFOUND);
            kvm_msg_free(&r);
        }
    }
    zmq_close(d);
    zmq_ctx_term(zctx);
    ck_assert_int_eq(t.stats.refused, 2);
    kvm_serve_cache_enc_free(&e);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 0);
}
END_TEST

/* 1 when the reply's message contains needle (the message is not NUL-terminated). */
static int message_has(const kvm_proto_store_reply *r, const char *needle)
{
    size_t m = strlen(needle);
    for (size_t i = 0; i + m <= r->message.len; i++)
        if (!memcmp(r->message.ptr + i, needle, m)) return 1;
    return 0;
}

/* A message of more parts than a message may have (70, over KVM_MSG_MAX_FRAMES = 64) was
 * dropped with its routing id, unanswered, while every other malformed request is refused: it
 * is refused too now (request 0), and the service goes on answering the same client. */
START_TEST(test_too_many_parts_refused)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    void *zctx = zmq_ctx_new(), *d = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0, rcv = 5000;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    ck_assert_int_eq(zmq_connect(d, g_ep), 0);
    for (int i = 0; i < 70; i++)
        ck_assert_int_eq(zmq_send(d, "x", 1, i < 69 ? ZMQ_SNDMORE : 0), 1);
    kvm_msg *r = NULL;
    kvm_proto_store_reply sr;
    ck_assert_msg(kvm_msg_recv(d, &r, 0) == 0, "no reply to a message of 70 parts");
    ck_assert_int_eq(kvm_proto_store_reply_decode(r, &sr), 0);
    ck_assert_int_eq(sr.request_id, 0);
    ck_assert_int_eq(sr.status, KVM_EPROTO);
    ck_assert_msg(message_has(&sr, "more than 64 parts"), "%.*s", (int)sr.message.len, sr.message.ptr);
    kvm_msg_free(&r);
    kvm_proto_get_cache g = {.request_id = 9}; /* still served: not found */
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_get_cache_encode(&g, &m), 0);
    ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
    ck_assert_int_eq(kvm_msg_recv(d, &r, 0), 0);
    ck_assert_int_eq(kvm_proto_store_reply_decode(r, &sr), 0);
    ck_assert_int_eq(sr.request_id, 9);
    ck_assert_int_eq(sr.status, KVM_ENOTFOUND);
    kvm_msg_free(&r);
    zmq_close(d);
    zmq_ctx_term(zctx);
    svc_stop(&t);
}
END_TEST

/* Sends frame 0 = {v:1, type:"get_strategy", request_id:7, model_id: bin of id_bytes bytes,
 * name} raw on DEALER d and returns the store_reply (decoded into *sr; free the message). */
static kvm_msg *raw_get_strategy(void *d, size_t id_bytes, const char *name, kvm_proto_store_reply *sr)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    uint8_t id[64] = {0};
    msgpack_pack_map(&pk, 5);
    msgpack_pack_str_with_body(&pk, "v", 1), msgpack_pack_int(&pk, 1);
    msgpack_pack_str_with_body(&pk, "type", 4), msgpack_pack_str_with_body(&pk, "get_strategy", 12);
    msgpack_pack_str_with_body(&pk, "request_id", 10), msgpack_pack_uint64(&pk, 7);
    msgpack_pack_str_with_body(&pk, "model_id", 8), msgpack_pack_bin_with_body(&pk, id, id_bytes);
    msgpack_pack_str_with_body(&pk, "name", 4), msgpack_pack_str_with_body(&pk, name, strlen(name));
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_msg_new(&m), 0);
    ck_assert_int_eq(kvm_msg_add_copy(m, sb.data, sb.size), 0);
    msgpack_sbuffer_destroy(&sb);
    ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
    kvm_msg *r = NULL;
    ck_assert_msg(kvm_msg_recv(d, &r, 0) == 0, "no reply to a raw get_strategy");
    ck_assert_msg(kvm_proto_store_reply_decode(r, sr) == 0, "%s", kvm_errmsg());
    return r;
}

/* get_strategy: the stored bytes come back as stored (the service only reads); another
 * model or name is KVM_ENOTFOUND naming both; a malformed request (a 5-byte model id, an
 * empty name) is refused with the decoder's reason; the store keeps its one strategy. */
START_TEST(test_get_strategy)
{
    static const uint8_t rec[] = "a stored PolyKV strategy record \x01\x02\x03";
    kvm_store_id mid, other;
    for (int i = 0; i < KVM_STORE_ID_BYTES; i++)
        mid.b[i] = (uint8_t)(i + 1), other.b[i] = (uint8_t)(200 - i);
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    ck_assert_int_eq(kvm_store_put_strategy(s, &mid, "default", rec, sizeof rec), 0);
    kvm_store_close(&s);
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &c), 0);
    uint8_t *buf = NULL;
    size_t len = 0;
    ck_assert_msg(kvm_storecli_get_strategy(c, &mid, "default", 3000, 1, &buf, &len) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(len, sizeof rec);
    ck_assert_int_eq(memcmp(buf, rec, len), 0);
    free(buf);
    ck_assert_int_eq(t.stats.strategies, 1);
    char hex[KVM_STORE_ID_HEX + 1], want[256];
    ck_assert_int_eq(kvm_storecli_get_strategy(c, &other, "default", 3000, 1, &buf, &len), KVM_ENOTFOUND);
    snprintf(want, sizeof want, "no PolyKV strategy 'default' is stored for model %s", kvm_store_id_hex(&other, hex));
    ck_assert_msg(strstr(kvm_errmsg(), want), "%s", kvm_errmsg());
    ck_assert_ptr_null(buf);
    ck_assert_int_eq(kvm_storecli_get_strategy(c, &mid, "tuned", 3000, 1, &buf, &len), KVM_ENOTFOUND);
    ck_assert_msg(strstr(kvm_errmsg(), "no PolyKV strategy 'tuned' is stored for model"), "%s", kvm_errmsg());
    kvm_storecli_close(&c);
    /* malformed requests from a raw client */
    void *zctx = zmq_ctx_new(), *d = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0, rcv = 5000;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    ck_assert_int_eq(zmq_connect(d, g_ep), 0);
    kvm_proto_store_reply sr;
    kvm_msg *r = raw_get_strategy(d, 5, "default", &sr);
    ck_assert_int_eq(sr.status, KVM_EPROTO);
    ck_assert_uint_eq(sr.strategy.len, 0);
    ck_assert_msg(message_has(&sr, "field 'model_id' has 5 bytes, expected 32"), "%.*s",
                  (int)sr.message.len, sr.message.ptr);
    kvm_msg_free(&r);
    r = raw_get_strategy(d, 32, "", &sr);
    ck_assert_int_lt(sr.status, 0);
    ck_assert_msg(message_has(&sr, "'name'"), "%.*s", (int)sr.message.len, sr.message.ptr);
    kvm_msg_free(&r);
    zmq_close(d);
    zmq_ctx_term(zctx);
    ck_assert_int_eq(t.stats.strategies, 1);
    kvm_config_free(&cfg);
    svc_stop(&t);
    o = (kvm_store_opts){.read_only = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    ck_assert_int_eq(kvm_store_get_strategy(s, &mid, "default", &buf, &len), 0);
    ck_assert_uint_eq(len, sizeof rec);
    free(buf);
    ck_assert_int_eq(kvm_store_get_strategy(s, &other, "default", &buf, &len), KVM_ENOTFOUND);
    kvm_store_close(&s);
}
END_TEST

/* claim with the client: the state, and the holder's owner into holder (may be NULL). */
static int claim(kvm_storecli *c, const kvm_store_cache_key *k, const char *owner, int64_t ttl_ms, int probe,
                 char *holder)
{
    kvm_storecli_claim_state st;
    kvm_storecli_claim_info info;
    kvm_store_id tok = {{0}};
    int rc = kvm_storecli_claim(c, k, &tok, owner, "hostA", ttl_ms, probe, 3000, 1, &st, &info);
    ck_assert_msg(rc == 0, "claim by %s: %s", owner, kvm_errmsg());
    if (holder) strcpy(holder, info.holder.owner);
    if (st == KVM_STORECLI_STORED && !(probe & KVM_STORECLI_INDEX_ONLY)) ck_assert_int_gt(info.stored_bytes, 0);
    if (st == KVM_STORECLI_STORED && (probe & KVM_STORECLI_INDEX_ONLY)) /* the layers were not read */
        ck_assert_int_eq(info.stored_bytes, 0);
    return (int)st;
}

/* Two runs sharing one service (two clients, owners run:a and run:b): the first claim is
 * taken, the other run's is held (naming the holder), the holder's own claim again is taken
 * (renewed); a probe takes nothing; once the cache is committed every claim says stored.
 * renew_claims counts the owner's claims; after release, or after a lease lapses (the owner
 * died and renewed nothing), the other run takes the key. */
START_TEST(test_claims)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *a = NULL, *b = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &a), 0);
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &b), 0);
    kvm_serve_cache_enc e1, e2;
    make_cache(1, &e1);
    make_cache(2, &e2);
    kvm_store_cache_key k1 = key_of(&e1), k2 = key_of(&e2);
    char holder[256];
    ck_assert_int_eq(claim(a, &k1, "run:a", 60000, 0, NULL), KVM_STORECLI_TAKEN);
    ck_assert_int_eq(claim(b, &k1, "run:b", 60000, 0, holder), KVM_STORECLI_HELD);
    ck_assert_str_eq(holder, "run:a");
    ck_assert_int_eq(claim(a, &k1, "run:a", 60000, 0, NULL), KVM_STORECLI_TAKEN);
    ck_assert_int_eq(claim(b, &k2, "run:b", 60000, 1, NULL), KVM_STORECLI_MISSING);
    ck_assert_int_eq(claim(a, &k2, "run:a", 60000, 0, NULL), KVM_STORECLI_TAKEN); /* the probe took nothing */
    int64_t n = -1;
    ck_assert_msg(kvm_storecli_renew(a, "run:a", 60000, 0, 3000, 1, &n) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(n, 2);
    ck_assert_msg(kvm_storecli_put(a, &e1, 1, "doc1", 3000, 1, NULL) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(claim(b, &k1, "run:b", 60000, 0, NULL), KVM_STORECLI_STORED);
    ck_assert_int_eq(claim(b, &k1, "run:b", 60000, 1, NULL), KVM_STORECLI_STORED);
    /* revision 12: a recheck's claim judges "stored" by the index entry, reading no layer */
    ck_assert_int_eq(claim(b, &k1, "run:b", 60000, KVM_STORECLI_INDEX_ONLY, NULL), KVM_STORECLI_STORED);
    { /* a lease above 24 h is refused before the stored cache is looked up (it was answered
       * `stored`, refused on any other key): one rule, PROTOCOL.md's */
        kvm_storecli_claim_state st;
        kvm_storecli_claim_info info;
        kvm_store_id tok = {{0}};
        ck_assert_int_ne(
            kvm_storecli_claim(b, &k1, &tok, "run:b", "hostA", KVM_STORE_CLAIM_MAX_TTL_MS + 1, 0, 3000, 1, &st, &info),
            0);
        ck_assert_msg(strstr(kvm_errmsg(), "above the longest lease"), "%s", kvm_errmsg());
    }
    ck_assert_int_eq(kvm_storecli_renew(a, "run:a", 0, 1, 3000, 1, &n), 0); /* release */
    ck_assert_int_eq(n, 2);
    /* a lease of 1 s: short enough to wait out, long enough that the next request's round trip
     * through the service (a 300 ms lease before) cannot outlast it on a loaded machine */
    ck_assert_int_eq(claim(b, &k2, "run:b", 1000, 0, NULL), KVM_STORECLI_TAKEN);
    ck_assert_int_eq(claim(a, &k2, "run:a", 60000, 0, holder), KVM_STORECLI_HELD);
    ck_assert_str_eq(holder, "run:b");
    usleep(1200000); /* run:b "dies": its 1 s lease lapses */
    ck_assert_int_eq(claim(a, &k2, "run:a", 60000, 0, NULL), KVM_STORECLI_TAKEN);
    ck_assert_int_eq(kvm_storecli_renew(b, "run:b", 1000, 0, 3000, 1, &n), 0);
    ck_assert_int_eq(n, 0); /* the lapsed claim was taken over: run:b holds none */
    kvm_serve_cache_enc_free(&e1);
    kvm_serve_cache_enc_free(&e2);
    kvm_storecli_close(&a);
    kvm_storecli_close(&b);
    kvm_config_free(&cfg);
    svc_stop(&t);
}
END_TEST

/* Replaces layer `layer` of e with one whose `what` ("keys", "values" or "bias") holds x at KV head g,
 * entry `entry` (row within the head), element 1: a cache the forward overflowed in, as a
 * remote worker without the encoder's check (or a damaged upload) would send it. */
static void poison_layer(kvm_serve_cache_enc *e, int layer, const char *what, int g, int entry, float x)
{
    static float kv[H * PER_HEAD * D], bad[H * PER_HEAD * D];
    static int32_t he[H] = {PER_HEAD, PER_HEAD}, pos[H * PER_HEAD];
    static float bias[H * PER_HEAD];
    kvm_proto_cache old;
    ck_assert_int_eq(kvm_proto_cache_decode(e->msgs[layer], &old), 0);
    memcpy(kv, old.keys, sizeof kv); /* keys and values of make_cache are the same numbers */
    memcpy(bad, kv, sizeof bad);
    for (int i = 0; i < H * PER_HEAD; i++)
        pos[i] = old.positions[i], bias[i] = old.logit_bias[i];
    const int b = !strcmp(what, "bias"), k = !strcmp(what, "keys");
    if (b)
        bias[(size_t)g * PER_HEAD + (size_t)entry] = x;
    else
        bad[((size_t)g * PER_HEAD + (size_t)entry) * D + 1] = x;
    kvm_proto_cache c = {.layer = layer,
                         .n_layers = L,
                         .n_kv_heads = H,
                         .head_dim = D,
                         .n_tokens = N,
                         .n_entries = H * PER_HEAD,
                         .dtype = KVM_PROTO_F32,
                         .head_entries = he,
                         .keys = k ? bad : kv,
                         .values = k || b ? kv : bad,
                         .positions = pos,
                         .logit_bias = bias};
    kvm_msg_free(&e->msgs[layer]);
    ck_assert_int_eq(kvm_proto_cache_encode(&c, &e->msgs[layer]), 0);
}

/* An upload whose values (or keys) hold NaN or inf was committed with status 0: the next run
 * through the service counted the document as stored, every ask refused the cache as corrupt
 * and store verify failed. It is refused now, as the local encoder refuses it, naming the
 * document, layer, KV head, tensor and entry; nothing is committed, and the service takes the
 * next sound upload. */
START_TEST(test_nonfinite_refused)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &c), 0);
    kvm_serve_cache_enc e;
    make_cache(3, &e);
    poison_layer(&e, 1, "values", 1, 2, NAN);
    ck_assert_int_eq(kvm_storecli_put(c, &e, 7, "doc_003.txt", 3000, 1, NULL), KVM_ERANGE);
    ck_assert_msg(strstr(kvm_errmsg(), "document doc_003.txt (doc_hash ") &&
                      strstr(kvm_errmsg(), "cache layer 1, KV head 1, value of entry 2: nan is not a finite number"),
                  "%s", kvm_errmsg());
    kvm_serve_cache_enc_free(&e);
    make_cache(3, &e);
    poison_layer(&e, 2, "keys", 0, 1, -INFINITY);
    ck_assert_int_eq(kvm_storecli_put(c, &e, 8, NULL, 3000, 1, NULL), KVM_ERANGE);
    ck_assert_msg(strstr(kvm_errmsg(), "cache layer 2, KV head 0, key of entry 1: -inf is not a finite number"), "%s",
                  kvm_errmsg());
    ck_assert_int_eq(fetch(c, &e), KVM_ENOTFOUND);
    kvm_serve_cache_enc_free(&e);
    make_cache(3, &e); /* a NaN logit bias: every softmax over the head would be NaN */
    poison_layer(&e, 0, "bias", 1, 0, NAN);
    ck_assert_int_eq(kvm_storecli_put(c, &e, 10, NULL, 3000, 1, NULL), KVM_ERANGE);
    ck_assert_msg(strstr(kvm_errmsg(), "cache layer 0, KV head 1, logit bias of entry 0: nan is not a usable bias"),
                  "%s", kvm_errmsg());
    ck_assert_int_eq(t.stats.refused, 3);
    ck_assert_int_eq(t.stats.committed, 0);
    kvm_serve_cache_enc_free(&e);
    make_cache(3, &e);
    ck_assert_msg(kvm_storecli_put(c, &e, 9, "doc_003.txt", 3000, 1, NULL) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(fetch(c, &e), L);
    kvm_serve_cache_enc_free(&e);
    kvm_storecli_close(&c);
    kvm_config_free(&cfg);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 1);
}
END_TEST

/* A cache holding NaN that is in the store already (committed by a service before it checked
 * uploads): its checksums pass, so a claim answered "stored" and the run skipped a document
 * every ask refuses. The service's "already stored?" rule now decodes the layers: the probe
 * says missing, a claim takes the key (the run compresses it again, its put replaces it). */
START_TEST(test_nonfinite_stored_not_stored)
{
    kvm_serve_cache_enc e;
    make_cache(4, &e);
    poison_layer(&e, 0, "values", 0, 0, NAN);
    kvm_store *s = NULL;
    kvm_store_opts o = {.no_sync = 1};
    ck_assert_int_eq(kvm_store_open(g_store, &o, &s), 0);
    kvm_frame frames[L][16];
    kvm_store_layer layers[L];
    for (int l = 0; l < L; l++) {
        size_t nf = kvm_msg_nframes(e.msgs[l]);
        ck_assert_uint_le(nf, 16);
        for (size_t f = 0; f < nf; f++)
            frames[l][f] = kvm_msg_frame(e.msgs[l], f);
        layers[l] = (kvm_store_layer){.frames = frames[l], .n_frames = (uint32_t)nf};
    }
    e.man.config = (kvm_frame){.data = (const uint8_t *)e.canon, .size = e.canon_n};
    ck_assert_msg(kvm_store_put_cache(s, &e.man, layers) == 0, "%s", kvm_errmsg());
    kvm_store_close(&s);
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &c), 0);
    kvm_store_cache_key k = key_of(&e);
    ck_assert_int_eq(claim(c, &k, "run:a", 60000, KVM_STORECLI_PROBE, NULL), KVM_STORECLI_MISSING);
    ck_assert_int_eq(claim(c, &k, "run:a", 60000, 0, NULL), KVM_STORECLI_TAKEN);
    kvm_serve_cache_enc_free(&e);
    kvm_storecli_close(&c);
    kvm_config_free(&cfg);
    svc_stop(&t);
}
END_TEST

/* Sends frame 0 = {v:1, type, request_id:8, owner, ttl_ms, model_id/doc_hash/config_id/
 * tokenizer_id: bin of id_bytes} raw on d (type "renew_claims": no ids) and returns the reply. */
static kvm_msg *raw_claim(void *d, const char *type, const char *owner, int64_t ttl_ms, size_t id_bytes,
                          kvm_proto_store_reply *sr)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    uint8_t id[64] = {0};
    int ids = strcmp(type, "renew_claims") != 0;
    msgpack_pack_map(&pk, 5 + (ids ? 4 : 0));
    msgpack_pack_str_with_body(&pk, "v", 1), msgpack_pack_int(&pk, 1);
    msgpack_pack_str_with_body(&pk, "type", 4), msgpack_pack_str_with_body(&pk, type, strlen(type));
    msgpack_pack_str_with_body(&pk, "request_id", 10), msgpack_pack_uint64(&pk, 8);
    msgpack_pack_str_with_body(&pk, "owner", 5), msgpack_pack_str_with_body(&pk, owner, strlen(owner));
    msgpack_pack_str_with_body(&pk, "ttl_ms", 6), msgpack_pack_int64(&pk, ttl_ms);
    static const char *const names[] = {"model_id", "doc_hash", "config_id", "tokenizer_id"};
    for (int i = 0; ids && i < 4; i++)
        msgpack_pack_str_with_body(&pk, names[i], strlen(names[i])), msgpack_pack_bin_with_body(&pk, id, id_bytes);
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_msg_new(&m), 0);
    ck_assert_int_eq(kvm_msg_add_copy(m, sb.data, sb.size), 0);
    msgpack_sbuffer_destroy(&sb);
    ck_assert_int_eq(kvm_msg_send(d, &m, 0), 0);
    kvm_msg *r = NULL;
    ck_assert_msg(kvm_msg_recv(d, &r, 0) == 0, "no reply to a raw %s", type);
    ck_assert_msg(kvm_proto_store_reply_decode(r, sr) == 0, "%s", kvm_errmsg());
    return r;
}

/* Malformed claims (a 5-byte model id, an empty owner, a lease of 0 ms, an owner longer than
 * the store's 127 bytes, a renewal without a lease, a claim or renewal with a lease above
 * 24 h) are refused with a reason (the decoder's, or the store's naming the longest lease);
 * no claim is written, and the well-formed claim taken before is unchanged. */
START_TEST(test_claim_malformed_refused)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *a = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &a), 0);
    kvm_store_cache_key zero;
    memset(&zero, 0, sizeof zero);
    ck_assert_int_eq(claim(a, &zero, "run:a", 60000, 0, NULL), KVM_STORECLI_TAKEN);
    kvm_store_claim before, after;
    ck_assert_int_eq(kvm_store_claim_get(t.store, &zero, &before), 0);
    void *zctx = zmq_ctx_new(), *d = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0, rcv = 5000;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &rcv, sizeof rcv);
    ck_assert_int_eq(zmq_connect(d, g_ep), 0);
    char longer[200];
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = '\0';
    struct {
        const char *type, *owner;
        int64_t ttl;
        size_t id_bytes;
        const char *why;
    } bad[] = {{"claim", "run:b", 60000, 5, "field 'model_id' has 5 bytes, expected 32"},
               {"claim", "", 60000, 32, "'owner'"},
               {"claim", "run:b", 0, 32, "field 'ttl_ms' is 0"},
               {"claim", longer, 60000, 32, "'owner'"},
               {"renew_claims", "run:a", 0, 0, "renewing needs a lease"},
               /* a lease above 24 h (2^40 ms: ~34 years) held the document from every run */
               {"claim", "run:b", (int64_t)1 << 40, 32, "above the longest lease, 86400000 ms"},
               {"renew_claims", "run:a", (int64_t)1 << 40, 0, "above the longest lease, 86400000 ms"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvm_proto_store_reply sr;
        kvm_msg *r = raw_claim(d, bad[i].type, bad[i].owner, bad[i].ttl, bad[i].id_bytes, &sr);
        ck_assert_int_lt(sr.status, 0);
        ck_assert_uint_eq(sr.claim.len, 0);
        ck_assert_msg(message_has(&sr, bad[i].why), "case %zu: %.*s", i, (int)sr.message.len, sr.message.ptr);
        kvm_msg_free(&r);
    }
    zmq_close(d);
    zmq_ctx_term(zctx);
    ck_assert_int_eq(kvm_store_claim_get(t.store, &zero, &after), 0);
    ck_assert_str_eq(after.owner, "run:a");
    ck_assert_int_eq(after.expires_unix_ms, before.expires_unix_ms); /* the bad renewal changed nothing */
    kvm_storecli_close(&a);
    kvm_config_free(&cfg);
    svc_stop(&t);
}
END_TEST

static void keygen(const char *name)
{
    char prefix[4400];
    snprintf(prefix, sizeof prefix, "%s/%s", g_dir, name);
    ck_assert_msg(kvm_curve_keygen(prefix) == 0, "%s", kvm_errmsg());
}

/* Keys "server", "client" and "stranger" in g_dir, an authorized_keys folder holding the
 * client's public key only, and the service's [security] section naming them into sec[n]. */
static void keyed_service(char *sec, size_t n)
{
    char auth[4400], cmd[9000];
    keygen("server");
    keygen("client");
    keygen("stranger");
    snprintf(auth, sizeof auth, "%s/authorized", g_dir);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && cp '%s/client.public' '%s/'", auth, g_dir, auth);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 0);
    snprintf(sec, n,
             "[security]\nserver_secret_key = %s/server.secret\nserver_public_key = %s/server.public\n"
             "authorized_keys = %s\n",
             g_dir, g_dir, auth);
}

/* A client config with the service's section sec and the stranger's key pair (not authorized). */
static kvm_config *stranger_config(const char *sec)
{
    char who[12000];
    snprintf(who, sizeof who, "%sclient_secret_key = %s/stranger.secret\nclient_public_key = %s/stranger.public\n", sec,
             g_dir, g_dir);
    return config(who);
}

/* With [security] keys the service takes only authorized clients: one without a key is told the
 * service needs keys and stores nothing; the authorized one commits. */
START_TEST(test_client_without_key_refused)
{
    char sec[12000];
    keyed_service(sec, sizeof sec);
    svc_thread t;
    svc_start(&t, sec, 0);
    kvm_serve_cache_enc e;
    make_cache(4, &e);
    kvm_config *plain = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(plain), g_ep, &c), 0);
    /* a timeout far above the handshake's time, so that a loaded machine (CI) still sees the
     * refusal first */
    ck_assert_int_eq(kvm_storecli_put(c, &e, 1, NULL, 5000, 1, NULL), KVM_EIO);
    /* said for what it is when libzmq tells the client: it reports the mechanism mismatch to the
     * keyless side only when that side read the service's greeting before the service closed the
     * connection, a race (about 1 run in 4 here ends in "no reply"); the unknown-key case below,
     * which README promises, comes through the ZAP refusal and is reliable */
    ck_assert_msg(strstr(kvm_errmsg(), "the security handshake failed: the service uses CurveZMQ keys") ||
                      strstr(kvm_errmsg(), "no reply to the upload"),
                  "%s", kvm_errmsg());
    kvm_storecli_close(&c);
    ck_assert_int_eq(t.stats.committed + t.stats.refused, 0);
    snprintf(sec + strlen(sec), sizeof sec - strlen(sec), "client_secret_key = %s/client.secret\nclient_public_key = %s/client.public\n",
             g_dir, g_dir);
    kvm_config *keyed = config(sec);
    ck_assert_int_eq(kvm_storecli_open(KEYS(keyed), g_ep, &c), 0);
    ck_assert_int_eq(fetch(c, &e), KVM_ENOTFOUND); /* the keyless client stored nothing */
    ck_assert_msg(kvm_storecli_put(c, &e, 1, NULL, 3000, 1, NULL) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(fetch(c, &e), L);
    kvm_storecli_close(&c);
    kvm_serve_cache_enc_free(&e);
    kvm_config_free(&plain);
    kvm_config_free(&keyed);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 1);
}
END_TEST

/* A client given the wrong server public key (another pair's): the service cannot open its
 * handshake, and libzmq tells the client no reason (as it does when a restarting service drops
 * a connection mid-handshake, so the request still waits for its timeout). It read only "no
 * reply to the upload"; now the message adds the failed handshakes and names the key file,
 * and nothing is stored. */
START_TEST(test_wrong_server_key_said)
{
    char sec[12000], cli[8000];
    keyed_service(sec, sizeof sec);
    snprintf(cli, sizeof cli,
             "[security]\nserver_public_key = %s/stranger.public\nclient_secret_key = %s/client.secret\n"
             "client_public_key = %s/client.public\n",
             g_dir, g_dir, g_dir);
    kvm_config *wrong = config(cli);
    svc_thread t;
    svc_start(&t, sec, 0);
    kvm_serve_cache_enc e;
    make_cache(4, &e);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(wrong), g_ep, &c), 0);
    ck_assert_int_eq(kvm_storecli_put(c, &e, 1, NULL, 5000, 1, NULL), KVM_EIO);
    ck_assert_msg(strstr(kvm_errmsg(), "a wrong server public key") && strstr(kvm_errmsg(), "stranger.public"), "%s",
                  kvm_errmsg());
    kvm_storecli_close(&c);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 0);
    kvm_serve_cache_enc_free(&e);
    kvm_config_free(&wrong);
}
END_TEST

/* A client whose key the service does not know: the service refuses the handshake, which then
 * happens before the client's first request (the connection is gone by the time it sends). A
 * send waited for ever there: `kvmill run` with such a key hung at its end releasing its claims,
 * after "no reply" messages that did not say why. Now every request says the key was rejected,
 * names the key file, and comes back at once, without being sent again. */
START_TEST(test_unknown_key_said_at_once)
{
    char sec[12000];
    keyed_service(sec, sizeof sec);
    kvm_config *stranger = stranger_config(sec);
    svc_thread t;
    svc_start(&t, sec, 0);
    kvm_serve_cache_enc e;
    make_cache(4, &e);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(stranger), g_ep, &c), 0);
    usleep(500000); /* the handshake is refused before the first request */
    double t0 = kvm_now_ms();
    /* timeouts far above the handshake's time (a loaded machine still sees the refusal first);
     * the refusal comes back at once, well before one of them */
    ck_assert_int_eq(kvm_storecli_renew(c, "run:test", 0, 1, 5000, 1, NULL), KVM_EIO);
    ck_assert_msg(strstr(kvm_errmsg(), "rejected this client's key") && strstr(kvm_errmsg(), "stranger.public"), "%s",
                  kvm_errmsg());
    ck_assert_int_eq(kvm_storecli_put(c, &e, 1, NULL, 5000, 3, NULL), KVM_EIO);
    ck_assert_msg(strstr(kvm_errmsg(), "rejected this client's key"), "%s", kvm_errmsg());
    double ms = kvm_now_ms() - t0;
    ck_assert_msg(ms < 4500, "the refused requests took %.0f ms: they waited for a reply", ms);
    kvm_storecli_close(&c);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 0);
    kvm_serve_cache_enc_free(&e);
    kvm_config_free(&stranger);
}
END_TEST

/* Threads of this process (/proc/self/task). */
static int count_threads(void)
{
    char cmd[64], *out = NULL;
    snprintf(cmd, sizeof cmd, "ls /proc/%ld/task | wc -l", (long)getpid());
    ck_assert_int_eq(kvm_test_run(cmd, &out, NULL), 0);
    int n = atoi(out);
    free(out);
    return n;
}

/* A keyed service's ZAP handler ends with its context: kvm_curve_ctx_term joins it (it was a
 * detached thread, possibly still running when a `kvmill serve` or `store serve` returned from
 * main), and a second keyed context in the process gets a handler of its own. The handler was started once per process: the second context had none,
 * and libzmq then let any client key in (the stranger's upload committed). */
START_TEST(test_zap_handler_per_context)
{
    char sec[12000];
    keyed_service(sec, sizeof sec);
    kvm_config *stranger = stranger_config(sec);
    kvm_serve_cache_enc e;
    make_cache(4, &e);
    const int threads_before = count_threads();
    for (int round = 1; round <= 2; round++) {
        svc_thread t;
        svc_start(&t, sec, 0);
        kvm_storecli *c = NULL;
        ck_assert_int_eq(kvm_storecli_open(KEYS(stranger), g_ep, &c), 0);
        int rc = kvm_storecli_put(c, &e, 1, NULL, 5000, 1, NULL);
        ck_assert_msg(rc == KVM_EIO, "round %d: a key not in authorized_keys got %d (%s)", round, rc,
                      rc ? kvm_errmsg() : "stored");
        kvm_storecli_close(&c);
        svc_stop(&t);
        ck_assert_int_eq(count_caches(), 0);
        /* the ZAP handler and libzmq's threads are gone; a joined thread can still be listed in
         * /proc for a moment (pthread_join returns when the thread clears its tid, before the
         * kernel has released its task), so a count above is looked at again for up to 2 s */
        int threads = count_threads();
        for (int i = 0; i < 20 && threads > threads_before; i++, usleep(100000))
            threads = count_threads();
        ck_assert_int_eq(threads, threads_before);
    }
    kvm_serve_cache_enc_free(&e);
    kvm_config_free(&stranger);
}
END_TEST

/* The service goes away after one commit and comes back on the same port while a client
 * uploads: the committed cache is intact and the client's retry commits the second. */
typedef struct restart_arg {
    svc_thread *t;
    int port;
} restart_arg;

static void *restart_later(void *arg)
{
    restart_arg *r = arg;
    usleep(700000);
    svc_start(r->t, NULL, r->port);
    return NULL;
}

START_TEST(test_service_restart_retry)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    int port = atoi(strrchr(g_ep, ':') + 1);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), g_ep, &c), 0);
    kvm_serve_cache_enc a, b;
    make_cache(5, &a);
    make_cache(6, &b);
    ck_assert_int_eq(kvm_storecli_put(c, &a, 1, NULL, 3000, 1, NULL), 0);
    svc_stop(&t);
    pthread_t th;
    restart_arg ra = {&t, port};
    ck_assert_int_eq(pthread_create(&th, NULL, restart_later, &ra), 0);
    ck_assert_msg(kvm_storecli_put(c, &b, 2, NULL, 500, 20, NULL) == 0, "%s", kvm_errmsg());
    pthread_join(th, NULL);
    ck_assert_int_eq(fetch(c, &a), L);
    ck_assert_int_eq(fetch(c, &b), L);
    kvm_storecli_close(&c);
    kvm_serve_cache_enc_free(&a);
    kvm_serve_cache_enc_free(&b);
    kvm_config_free(&cfg);
    svc_stop(&t);
    ck_assert_int_eq(count_caches(), 2);
}
END_TEST

/* A non-local service endpoint without keys: neither side starts. */
START_TEST(test_nonlocal_needs_keys)
{
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(cfg), "tcp://10.255.255.1:5560", &c), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "server_public_key"), "%s", kvm_errmsg());
    void *zctx = zmq_ctx_new(), *r = zmq_socket(zctx, ZMQ_ROUTER);
    ck_assert_int_eq(kvm_serve_bind(zctx, r, "tcp://0.0.0.0:0", cfg, 1, "store"), KVM_EINVAL);
    const char *junk[] = {"", "garbage", "127.0.0.1:5560"}; /* no transport: said so, not "is not local" */
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(kvm_serve_bind(zctx, r, junk[i], cfg, 1, "store"), KVM_EINVAL);
        ck_assert_msg(strstr(kvm_errmsg(), "is not an endpoint: expected tcp://HOST:PORT or ipc://PATH"), "'%s': %s",
                      junk[i], kvm_errmsg());
    }
    zmq_close(r);
    zmq_ctx_term(zctx);
    kvm_config_free(&cfg);
}
END_TEST

/* kvmill store serve --store tcp://... (the service's own endpoint, or another's): it said "no
 * such directory: give --create", and --create then failed with "cannot create directory". Now it
 * says the path is a store service endpoint (exit 2), with or without --create. */
START_TEST(test_store_is_endpoint)
{
    for (int create = 0; create <= 1; create++) {
        char cmd[9000], *err = NULL;
        snprintf(cmd, sizeof cmd, "'%s/kvmill' store serve --store tcp://127.0.0.1:5560 --bind tcp://127.0.0.1:0 %s",
                 kvm_test_bin(), create ? "--create" : "");
        ck_assert_int_eq(kvm_test_run(cmd, NULL, &err), 2);
        ck_assert_msg(err && strstr(err, "store tcp://127.0.0.1:5560 is a store service endpoint"), "%s", err);
        free(err);
    }
}
END_TEST

/* kvmill store serve --bind on an endpoint another process holds: a runtime error, exit 1 as
 * for kvmill serve (it exited 2, the status of a usage error); a malformed one stays exit 2. */
START_TEST(test_bind_in_use_exit_1)
{
    svc_thread t;
    svc_start(&t, NULL, 0);
    char cmd[9000], *err = NULL;
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store serve --store '%s' --bind '%s'", kvm_test_bin(), g_store, g_ep);
    int rc = kvm_test_run(cmd, NULL, &err);
    ck_assert_msg(rc == 1 && err && strstr(err, "Address already in use"), "exit %d: %s", rc, err);
    free(err);
    snprintf(cmd, sizeof cmd, "'%s/kvmill' store serve --store '%s' --bind tcp://127.0.0.1:70000", kvm_test_bin(), g_store);
    ck_assert_int_eq(kvm_test_run(cmd, NULL, NULL), 2);
    svc_stop(&t);
}
END_TEST

/* The service's store with its reader table full (other processes reading at once): the
 * client gets the service's KVM_EBUSY, retryable, with its reason, not KVM_EIO, which says the
 * service did not answer (the orchestrator stops a run whose store service is down); and
 * the same request succeeds once a slot frees. */
START_TEST(test_readers_full_busy)
{
    g_max_readers = 1;
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_msg(kvm_storecli_open(KEYS(cfg), g_ep, &c) == 0, "%s", kvm_errmsg());
    kvm_serve_cache_enc e;
    make_cache(1, &e);
    int release;
    pid_t pid = kvm_test_readers_hold(g_store, 1, &release);
    int rc = fetch(c, &e);
    ck_assert_msg(rc == KVM_EBUSY && kvm_err_retryable(rc), "status %d: %s", rc, kvm_errmsg());
    ck_assert_msg(strstr(kvm_errmsg(), "store service: ") && strstr(kvm_errmsg(), "reader table is full"), "%s",
                  kvm_errmsg());
    kvm_test_readers_release(pid, release);
    ck_assert_int_eq(fetch(c, &e), KVM_ENOTFOUND);
    kvm_serve_cache_enc_free(&e);
    kvm_storecli_close(&c);
    kvm_config_free(&cfg);
    svc_stop(&t);
}
END_TEST

/* A reply whose message names a store path that is not UTF-8 (a folder's bytes are the
 * filesystem's): the service cleans it and the client gets the reply, ENOTFOUND naming the path
 * with '?' for the byte; before, the reply did not encode and the client waited for its timeout
 * and was told the service did not answer. */
START_TEST(test_reply_path_not_utf8)
{
    snprintf(g_store, sizeof g_store, "%s/st\xff.lmdb", g_dir);
    svc_thread t;
    svc_start(&t, NULL, 0);
    kvm_config *cfg = config(NULL);
    kvm_storecli *c = NULL;
    ck_assert_msg(kvm_storecli_open(KEYS(cfg), g_ep, &c) == 0, "%s", kvm_errmsg());
    kvm_serve_cache_enc e;
    make_cache(1, &e);
    int rc = fetch(c, &e);
    ck_assert_msg(rc == KVM_ENOTFOUND, "status %d: %s", rc, kvm_errmsg());
    ck_assert_msg(strstr(kvm_errmsg(), "/st?.lmdb: no cache"), "%s", kvm_errmsg());
    kvm_serve_cache_enc_free(&e);
    kvm_storecli_close(&c);
    kvm_config_free(&cfg);
    svc_stop(&t);
}
END_TEST

/* The ZAP handler names each refused client key once; past 16 keys (a peer cycling through
 * throwaway keys would fill the log) the rest are counted and said at most once a minute. 18
 * unknown keys, the first one again, then: 16 lines naming a key, one line counting 1 more,
 * nothing for the 18th (within the minute) or the repeat. The service's stderr (this test's,
 * Check's forked child) goes to a file. */
START_TEST(test_refused_keys_rate_limited)
{
    char sec[12000], errp[4400];
    keyed_service(sec, sizeof sec);
    snprintf(errp, sizeof errp, "%s/stderr.log", g_dir);
    int fd = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600), saved = dup(2);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_ge(saved, 0);
    ck_assert_int_eq(dup2(fd, 2), 2);
    close(fd);
    svc_thread t;
    svc_start(&t, sec, 0);
    for (int i = 0; i < 19; i++) {
        char name[32], who[12000];
        snprintf(name, sizeof name, "knock%02d", i % 18);
        if (i < 18) keygen(name);
        snprintf(who, sizeof who, "%sclient_secret_key = %s/%s.secret\nclient_public_key = %s/%s.public\n", sec, g_dir,
                 name, g_dir, name);
        kvm_config *k = config(who);
        kvm_storecli *c = NULL;
        ck_assert_int_eq(kvm_storecli_open(KEYS(k), g_ep, &c), 0);
        ck_assert_int_eq(kvm_storecli_renew(c, "run:test", 0, 1, 5000, 1, NULL), KVM_EIO);
        ck_assert_msg(strstr(kvm_errmsg(), "rejected this client's key"), "%s", kvm_errmsg());
        kvm_storecli_close(&c);
        kvm_config_free(&k);
    }
    svc_stop(&t);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char *log = kvm_test_read_file(errp, NULL);
    ck_assert_ptr_nonnull(log);
    int named = 0, more = 0;
    for (const char *p = log; (p = strstr(p, "refused a CurveZMQ client key ")); p++)
        named++;
    for (const char *p = log; (p = strstr(p, "more CurveZMQ client keys")); p++)
        more++;
    ck_assert_msg(named == 16 && more == 1 && strstr(log, "refused 1 more CurveZMQ client keys"),
                  "%d named, %d more:\n%s", named, more, log);
    char path[4400], first[41];
    snprintf(path, sizeof path, "%s/knock00.public", g_dir);
    ck_assert_int_eq(kvm_curve_read_key(path, first), 0); /* the first key, named once */
    const char *at = strstr(log, first);
    ck_assert_msg(at && !strstr(at + 1, first), "%s", log);
    free(log);
    ck_assert_int_eq(count_caches(), 0);
}
END_TEST

/* A *.public file in authorized_keys that does not read as a key (a bad copy, a dangling link)
 * was skipped without a word: the operator saw nothing and the client only that its key was
 * refused. The service names each at start, and its refusal of a key says such files exist. */
START_TEST(test_unreadable_authorized_keys_said)
{
    char sec[12000], errp[4400], bad[4400], dangling[4400];
    keyed_service(sec, sizeof sec);
    snprintf(bad, sizeof bad, "%s/authorized/bad.public", g_dir);
    ck_assert_int_eq(kvm_test_write_file(bad, "garbage\n", 8), 0);
    snprintf(dangling, sizeof dangling, "%s/authorized/dangling.public", g_dir);
    ck_assert_int_eq(symlink("/nonexistent-kvmill-key", dangling), 0);
    snprintf(errp, sizeof errp, "%s/stderr.log", g_dir);
    int fd = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600), saved = dup(2);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_ge(saved, 0);
    ck_assert_int_eq(dup2(fd, 2), 2);
    close(fd);
    svc_thread t;
    svc_start(&t, sec, 0);
    kvm_config *stranger = stranger_config(sec);
    kvm_storecli *c = NULL;
    ck_assert_int_eq(kvm_storecli_open(KEYS(stranger), g_ep, &c), 0);
    ck_assert_int_eq(kvm_storecli_renew(c, "run:test", 0, 1, 5000, 1, NULL), KVM_EIO);
    kvm_storecli_close(&c);
    kvm_config_free(&stranger);
    svc_stop(&t);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char *log = kvm_test_read_file(errp, NULL);
    ck_assert_ptr_nonnull(log);
    ck_assert_msg(strstr(log, "bad.public: not a 40-character Z85 CurveZMQ key") && strstr(log, "dangling.public: ") &&
                      strstr(log, "2 .public files there could not be read"),
                  "%s", log);
    free(log);
}
END_TEST

static Suite *storesvc_suite(void)
{
    Suite *s = suite_create("storesvc");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"put_then_get", test_put_then_get},
                 {"store_replaced_under_service", test_store_replaced_under_service},
                 {"layers_mismatch_refused", test_layers_mismatch_refused},
                 {"truncated_upload_refused", test_truncated_upload_refused},
                 {"too_many_parts_refused", test_too_many_parts_refused},
                 {"client_without_key_refused", test_client_without_key_refused},
                 {"zap_handler_per_context", test_zap_handler_per_context},
                 {"unknown_key_said_at_once", test_unknown_key_said_at_once},
                 {"refused_keys_rate_limited", test_refused_keys_rate_limited},
                 {"unreadable_authorized_keys_said", test_unreadable_authorized_keys_said},
                 {"wrong_server_key_said", test_wrong_server_key_said},
                 {"service_restart_retry", test_service_restart_retry},
                 {"nonlocal_needs_keys", test_nonlocal_needs_keys},
                 {"store_is_endpoint", test_store_is_endpoint},
                 {"bind_in_use_exit_1", test_bind_in_use_exit_1},
                 {"get_strategy", test_get_strategy},
                 {"claims", test_claims},
                 {"claim_malformed_refused", test_claim_malformed_refused},
                 {"readers_full_busy", test_readers_full_busy},
                 {"reply_path_not_utf8", test_reply_path_not_utf8},
                 {"nonfinite_refused", test_nonfinite_refused},
                 {"nonfinite_stored_not_stored", test_nonfinite_stored_not_stored}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(storesvc_suite()); }
