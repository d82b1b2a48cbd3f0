/* gen_corpus.c: writes the seed corpus of the proto fuzzers: valid encoded messages of every
 * type, in the split format of fuzz_common.h for proto/fuzz/corpus/fuzz_<type>/ and as blobs
 * for proto/fuzz/corpus/fuzz_blob/. Not part of the build; run by hand after a wire change
 * (the command is in proto/PROTOCOL.md, section "Fuzzing"): compile it with every proto
 * source and common/kvm_error.c, then run it with proto/fuzz/corpus as the argument. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/kvm_error.h"
#include "proto/kvm_half.h"
#include "proto/kvm_msg.h"
#include "proto/kvm_proto.h"

static const char *g_root;

static void die(const char *what)
{
    fprintf(stderr, "gen_corpus: %s: %s\n", what, kvm_errmsg());
    exit(1);
}

static void write_file(const char *dir, const char *name, const void *data, size_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", g_root, dir);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) die(path);
    snprintf(path, sizeof path, "%s/%s/%s", g_root, dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) die(path);
}

/* Writes msg as a split-format seed for fuzz_<type> and as a blob seed; frees msg. */
static void emit(const char *type, const char *seed, kvm_msg *msg)
{
    size_t n = 1;
    for (size_t i = 0; i < kvm_msg_nframes(msg); i++)
        n += 4 + kvm_msg_frame(msg, i).size;
    uint8_t *buf = malloc(n), *p = buf;
    *p++ = (uint8_t)(kvm_msg_nframes(msg) - 1);
    for (size_t i = 0; i < kvm_msg_nframes(msg); i++) {
        kvm_frame f = kvm_msg_frame(msg, i);
        if (i + 1 < kvm_msg_nframes(msg)) {
            for (int k = 0; k < 4; k++)
                *p++ = (uint8_t)(f.size >> (8 * k));
        }
        if (f.size) memcpy(p, f.data, f.size);
        p += f.size;
    }
    char dir[256], name[256];
    snprintf(dir, sizeof dir, "fuzz_%s", type);
    snprintf(name, sizeof name, "seed_%s", seed);
    write_file(dir, name, buf, (size_t)(p - buf));
    free(buf);
    uint8_t *blob;
    if (kvm_msg_pack(msg, &blob, &n) != 0) die("pack");
    snprintf(name, sizeof name, "seed_%s_%s", type, seed);
    write_file("fuzz_blob", name, blob, n);
    free(blob);
    kvm_msg_free(&msg);
}

#define EMIT(type, seed, st)                                                                                           \
    do {                                                                                                               \
        kvm_msg *m__ = NULL;                                                                                           \
        if (kvm_proto_##type##_encode(&(st), &m__) != 0) die(#type " " seed);                                          \
        emit(#type, seed, m__);                                                                                        \
    } while (0)

static float fbuf[4096];
static int32_t ibuf[256];
static uint16_t hbuf[4096];

static void gen_job_kv(void)
{
    const uint8_t settings[] = {0x82, 0xa6, 'b', 'u', 'd', 'g', 'e', 't', 0xcb, 0x3f, 0xd0, 0,   0,   0,   0,   0,
                                0,    0xa7, 'p', 'a', 't', 't', 'e', 'r', 'n',  0xa6, 's',  'n', 'a', 'p', 'k', 'v'};
    kvm_proto_job j = {.job_id = 7,
                       .attempt = 1,
                       .doc_id = kvm_proto_str_c("doc-1"),
                       .doc_name = kvm_proto_str_c("a.txt"),
                       .n_ctx = 16,
                       .n_tokens = 5,
                       .tokens = ibuf,
                       .settings = settings,
                       .settings_bytes = sizeof settings};
    EMIT(job, "settings", j);
    j.settings = NULL;
    j.settings_bytes = 0;
    j.n_tokens = 1;
    EMIT(job, "plain", j);
    j.has_model_id = true; /* revision 10 */
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        j.model_id[i] = (uint8_t)(0x60 + i);
    EMIT(job, "model_id", j);
    kvm_proto_kv kv = {.job_id = 3,
                       .layer = 1,
                       .n_layers = 2,
                       .n_tokens = 4,
                       .n_heads = 2,
                       .n_kv_heads = 1,
                       .head_dim = 4,
                       .q_start = 2,
                       .n_queries = 2,
                       .keys = fbuf,
                       .values = fbuf + 16,
                       .entropy = fbuf + 32,
                       .attn_mass = fbuf + 40};
    EMIT(kv, "noq", kv);
    kv.q_pre = fbuf + 48;
    kv.q_post = fbuf + 64;
    EMIT(kv, "q", kv);
    /* revision 4: keys, values and queries in 16 bit ([run] wire_dtype) */
    kv.dtype = KVM_PROTO_F16;
    kv.keys = hbuf, kv.values = hbuf + 16, kv.q_pre = hbuf + 32, kv.q_post = hbuf + 48;
    EMIT(kv, "q_f16", kv);
    kv.dtype = KVM_PROTO_BF16;
    EMIT(kv, "q_bf16", kv);
}

static void gen_stats_strategy(void)
{
    kvm_proto_stats s = {.job_id = 1,
                         .n_layers = 2,
                         .n_phases = 2,
                         .n_patterns = 2,
                         .n_tokens = 64,
                         .n_docs = 2,
                         .budget_tokens = 16,
                         .cos_sim = fbuf,
                         .ppl_delta = fbuf + 8,
                         .entropy = fbuf + 16,
                         .ppl_worst = fbuf + 20};
    s.patterns[0] = kvm_proto_str_c("h2o");
    s.patterns[1] = kvm_proto_str_c("sculpt");
    EMIT(stats, "a", s);
    int32_t pat[4] = {0, 1, 1, 0}, bud[4] = {16, 32, 8, 64}, hb[8] = {16, 16, 30, 34, 8, 8, 0, 128};
    kvm_proto_strategy st = {.name = kvm_proto_str_c("plan"),
                             .n_layers = 2,
                             .n_phases = 2,
                             .n_kv_heads = 2,
                             .n_ctx = 128,
                             .budget_min = 8,
                             .n_patterns = 2,
                             .pattern = pat,
                             .budget = bud};
    memcpy(st.patterns, s.patterns, sizeof s.patterns);
    EMIT(strategy, "plain", st);
    st.head_budget = hb;
    EMIT(strategy, "heads", st);
}

static void gen_cache(void)
{
    int32_t counts[3] = {2, 0, 3}, pos[5] = {0, 7, -1, 3, -1};
    kvm_proto_cache c = {.layer = 0,
                         .n_layers = 2,
                         .n_kv_heads = 3,
                         .head_dim = 2,
                         .n_tokens = 8,
                         .n_entries = 5,
                         .dtype = KVM_PROTO_F32,
                         .head_entries = counts,
                         .keys = fbuf,
                         .values = fbuf + 10,
                         .positions = pos,
                         .logit_bias = fbuf + 20};
    EMIT(cache, "f32", c);
    kvm_half_convert(hbuf, KVM_PROTO_F16, fbuf, KVM_PROTO_F32, 20);
    c.dtype = KVM_PROTO_F16;
    c.keys = hbuf;
    c.values = hbuf + 10;
    EMIT(cache, "f16", c);
    c.dtype = KVM_PROTO_BF16;
    EMIT(cache, "bf16", c);
    int32_t zero[1] = {0};
    kvm_proto_cache e = {.layer = 1,
                         .n_layers = 2,
                         .n_kv_heads = 1,
                         .head_dim = 4,
                         .n_tokens = 3,
                         .dtype = KVM_PROTO_F16,
                         .head_entries = zero};
    EMIT(cache, "empty", e);
}

static void gen_control_serve(void)
{
    kvm_proto_result r = {.job_id = 2,
                          .stage = kvm_proto_str_c("compress"),
                          .worker_id = kvm_proto_str_c("w0"),
                          .wait_ms = 1,
                          .compute_ms = 2.5,
                          .total_ms = 4,
                          .message = kvm_proto_str_c("ok")};
    EMIT(result, "a", r);
    r.status = KVM_ENOMEM;
    r.retryable = true;
    EMIT(error, "a", r);
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("p0"),
                       .stage = kvm_proto_str_c("prefill"),
                       .pid = 100,
                       .device = kvm_proto_str_c("cpu"),
                       .job_id = 9};
    EMIT(ready, "a", c);
    c.has_model_id = true; /* revision 10 */
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        c.model_id[i] = (uint8_t)(0x40 + i);
    EMIT(ready, "model_id", c);
    c.has_model_id = false;
    EMIT(heartbeat, "a", c);
    EMIT(ack, "a", c);
    c.stopping = true; /* revision 13: a stopping stage, and its end of work */
    EMIT(heartbeat, "stopping", c);
    c.job_id = 0;
    EMIT(ack, "stopping", c);
    kvm_proto_get_cache g = {.request_id = 5};
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        g.model_id[i] = (uint8_t)i, g.doc_hash[i] = (uint8_t)~i, g.config_id[i] = 7;
    EMIT(get_cache, "a", g);
    kvm_proto_ask a = {.request_id = 6,
                       .doc_text = kvm_proto_str_c("Once upon a time"),
                       .prompt = kvm_proto_str_c("Who?"),
                       .max_new_tokens = 8,
                       .temperature = 0.5};
    EMIT(ask, "text", a);
    a.doc_text = kvm_proto_str_c("");
    a.n_doc_tokens = 4;
    a.doc_tokens = ibuf;
    EMIT(ask, "tokens", a);
    /* revision 2: a file's bytes (any values), a stored document by hash or by name, the grant */
    static const uint8_t bytes[] = {'c', 'a', 'f', 0xe9, 0x00, 0xff, 0xc3, 0xa9, '\n'};
    a.n_doc_tokens = 0;
    a.doc_tokens = NULL;
    a.doc_bytes = (kvm_proto_bytes){bytes, sizeof bytes};
    a.compute_grant = true;
    EMIT(ask, "bytes", a);
    a.doc_bytes = (kvm_proto_bytes){NULL, 0};
    a.compute_grant = false;
    a.has_doc_hash = true;
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        a.doc_hash[i] = (uint8_t)(0xa0 + i);
    EMIT(ask, "hash", a);
    a.has_doc_hash = false;
    a.doc_name = kvm_proto_str_c("doc_000.txt");
    EMIT(ask, "name", a);
    /* revision 7: a prompt that is not UTF-8, its bytes beside the U+FFFD text older readers take */
    static const uint8_t latin1[] = {'c', 'a', 'f', 0xe9, '?'};
    a.prompt = kvm_proto_str_c("caf\xef\xbf\xbd?");
    a.prompt_bytes = (kvm_proto_bytes){latin1, sizeof latin1};
    EMIT(ask, "prompt_bytes", a);
    a.prompt_bytes = (kvm_proto_bytes){NULL, 0};
    kvm_proto_answer an = {
        .request_id = 6, .text = kvm_proto_str_c(" A cat."), .n_tokens = 3, .tokens = ibuf, .total_ms = 9};
    EMIT(answer, "a", an);
    an.text = kvm_proto_str_c(" \xe4\xbd\xa0\xef\xbf\xbd"); /* a character, then U+FFFD */
    an.new_cache = true;
    EMIT(answer, "utf8_new_cache", an);
    /* not valid: a header whose "type" declares a 4 GiB string, and one whose doc_bytes does
     * (the decoders name the field and the limit) */
    static const uint8_t long_type[] = {0, 0x82, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e',
                                        0xdb, 0xff, 0xff, 0xff, 0xff, 'a', 's', 'k'};
    write_file("fuzz_ask", "seed_long_type", long_type, sizeof long_type);
    static const uint8_t long_bytes[] = {0, 0x83, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa3, 'a', 's', 'k',
                                         0xa9, 'd', 'o', 'c', '_', 'b', 'y', 't', 'e', 's', 0xc6, 0x7f, 0xff, 0xff,
                                         0xff, 'x'};
    write_file("fuzz_ask", "seed_long_doc_bytes", long_bytes, sizeof long_bytes);
    kvm_proto_answer ae = {.request_id = 6, .status = KVM_ENOTFOUND, .message = kvm_proto_str_c("no cache")};
    EMIT(answer, "error", ae);
    /* revision 3: the store service */
    static const char canon[] = "kvmill.algorithm=1\nmodel.context=64\nstore.dtype=f16\n";
    kvm_proto_put_cache pc = {.request_id = 9, .job_id = 3, .n_layers = 5, .n_kv_heads = 4, .head_dim = 8,
                              .n_tokens = 64, .n_entries = 640, .full_bytes = 81920,
                              .dtype = kvm_proto_str_c("f16"),
                              .config = {(const uint8_t *)canon, sizeof canon - 1},
                              .doc_name = kvm_proto_str_c("doc_001.txt")};
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        pc.model_id[i] = (uint8_t)i, pc.doc_hash[i] = (uint8_t)~i, pc.config_id[i] = 7;
    EMIT(put_cache, "a", pc);
    kvm_proto_store_reply sr = {.request_id = 9, .job_id = 3};
    EMIT(store_reply, "committed", sr);
    sr.n_layers = 5;
    EMIT(store_reply, "found", sr);
    sr = (kvm_proto_store_reply){.request_id = 9, .status = KVM_EMISMATCH,
                                 .message = kvm_proto_str_c("layer 2 has 3 KV heads, the upload 4")};
    EMIT(store_reply, "refused", sr);
    /* revision 5: a PolyKV strategy for a compress worker on another host */
    static const uint8_t strat[] = {0x4b, 0x56, 0x53, 0x54, 1, 0, 0, 0, 2, 0, 0, 0, 9, 8, 7, 6};
    sr = (kvm_proto_store_reply){.request_id = 10, .strategy = {strat, sizeof strat}};
    EMIT(store_reply, "strategy", sr);
    kvm_proto_get_strategy gs = {.request_id = 10, .name = kvm_proto_str_c("default")};
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        gs.model_id[i] = (uint8_t)(3 * i);
    EMIT(get_strategy, "a", gs);
    /* revision 6: claims of a run on another host, and their answers */
    kvm_proto_claim cl = {.request_id = 11, .owner = kvm_proto_str_c("run:hostA:42:1000"),
                          .host = kvm_proto_str_c("hostA"), .ttl_ms = 2000};
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        cl.model_id[i] = (uint8_t)i, cl.doc_hash[i] = (uint8_t)(7 * i), cl.config_id[i] = (uint8_t)(11 * i);
    EMIT(claim, "take", cl);
    cl.probe = true, cl.ttl_ms = 0;
    EMIT(claim, "probe", cl);
    kvm_proto_renew_claims rn = {.request_id = 12, .owner = kvm_proto_str_c("run:hostA:42:1000"), .ttl_ms = 2000};
    EMIT(renew_claims, "renew", rn);
    rn.release = true, rn.ttl_ms = 0;
    EMIT(renew_claims, "release", rn);
    sr = (kvm_proto_store_reply){.request_id = 11,
                                 .claim = kvm_proto_str_c("held"),
                                 .holder = kvm_proto_str_c("run:hostB:7:2000"),
                                 .holder_host = kvm_proto_str_c("hostB"),
                                 .holder_expires_ms = 1796000002000};
    EMIT(store_reply, "claim_held", sr);
    sr = (kvm_proto_store_reply){.request_id = 11, .claim = kvm_proto_str_c("stored"), .full_bytes = 327680,
                                 .stored_bytes = 89210};
    EMIT(store_reply, "claim_stored", sr);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_corpus CORPUS_DIR\n");
        return 2;
    }
    g_root = argv[1];
    if (mkdir(g_root, 0755) != 0 && errno != EEXIST) die(g_root);
    for (int i = 0; i < 4096; i++)
        fbuf[i] = 0.125f * (float)(i % 37) - 1.0f;
    for (int i = 0; i < 256; i++)
        ibuf[i] = i * 3;
    gen_job_kv();
    gen_stats_strategy();
    gen_cache();
    gen_control_serve();
    return 0;
}
