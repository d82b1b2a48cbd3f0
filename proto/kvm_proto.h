/* kvm_proto.h: the kvmill wire messages (proto/PROTOCOL.md is the spec): plain C structs, one
 * encoder and one decoder per message type, and a peek at a message's type.
 *
 * A message is a multipart kvm_msg: frame 0 is a MessagePack map {"v": 1, "type": name, the
 * type's fields..., "tensors": [{"name","dtype","shape"}...]}, frames 1.. are the tensors'
 * raw little-endian elements, row-major, in the order "tensors" lists them.
 *
 * Encoders (kvm_proto_<type>_encode(const kvm_proto_<type> *in, kvm_msg **out)) check the
 * struct against the same rules as the decoder, then build a new message: frame 0 from the
 * scalar fields, one frame per tensor holding a copy of the caller's array (the caller keeps
 * ownership of everything in *in). *out is set only on success; the caller frees it with
 * kvm_msg_free or hands it to kvm_msg_send. Errors: KVM_EINVAL (NULL arguments, or a field,
 * range or tensor rule broken: the detail names the field), KVM_ENOMEM.
 *
 * Decoders (kvm_proto_<type>_decode(const kvm_msg *msg, kvm_proto_<type> *out)) validate the
 * whole message: protocol version, type, frame counts, every field's MessagePack type and
 * range, every tensor's dtype, shape (against the header's sizes) and byte length, and the
 * contents the struct comments state as ranges (token ids, counts, positions, indices).
 * On success *out is filled; its strings, tensor pointers and settings BORROW from msg's
 * frames and stay valid until msg is freed or sent (strings are not NUL-terminated). Tensor
 * pointers are aligned for their type (decoders refuse a misaligned frame with KVM_EPROTO).
 * On failure *out is zeroed. Errors: KVM_EPROTO (malformed: wrong version, type, MessagePack
 * type, missing field, missing/extra frames, tensor shape or length mismatch, bad string),
 * KVM_ERANGE (a value outside its range or a declared size beyond a limit below), KVM_EINVAL
 * (NULL arguments). The detail message (kvm_errmsg) names the type and the field or tensor.
 * Unknown fields in frame 0 are ignored (forward compatibility); unknown tensors are checked
 * for length and ignored. Float tensor contents are not inspected.
 *
 * All functions are thread-safe on distinct arguments. Hosts must be little-endian. */
#ifndef KVM_PROTO_H
#define KVM_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/kvm_dtype.h"
#include "proto/kvm_msg.h"

/* ---- versions and limits (PROTOCOL.md §4); decoders refuse anything beyond ---- */
#define KVM_PROTO_VERSION 1                    /* "v" of every message */
#define KVM_PROTO_REVISION 15                  /* compatible additions within v1 (PROTOCOL.md §9) */
#define KVM_PROTO_MAX_FRAMES 16                /* frames per message, header included */
#define KVM_PROTO_MAX_HEADER_BYTES (32u << 20) /* bytes of frame 0 */
#define KVM_PROTO_MAX_FRAME_BYTES (1ull << 34) /* bytes of one tensor frame (16 GiB) */
#define KVM_PROTO_MAX_DIMS 4                   /* dimensions of a tensor */
#define KVM_PROTO_MAX_TOKENS (1 << 20)         /* tokens of a document, context, answer */
#define KVM_PROTO_MAX_LAYERS 1024              /* n_layers */
#define KVM_PROTO_MAX_HEADS 1024               /* n_heads, n_kv_heads */
#define KVM_PROTO_MAX_HEAD_DIM 1024            /* head_dim */
#define KVM_PROTO_MAX_PHASES 4                 /* n_phases (0 = prefill, 1 = decode) */
#define KVM_PROTO_MAX_PATTERNS 16              /* eviction patterns named in stats/strategy */
#define KVM_PROTO_MAX_PATTERN_BYTES 64         /* bytes of one pattern name */
#define KVM_PROTO_MAX_NAME_BYTES 1024          /* ids, names, stage, worker id, device */
#define KVM_PROTO_MAX_MESSAGE_BYTES 65536      /* error / status message */
#define KVM_PROTO_MAX_TEXT_BYTES (8u << 20)    /* document text, prompt, answer text */
#define KVM_PROTO_MAX_DOC_BYTES (16u << 20)    /* an ask's doc_bytes (revision 2) */
#define KVM_PROTO_MAX_TYPE_BYTES 64            /* the "type" string of a header */
#define KVM_PROTO_MAX_SETTINGS 256             /* entries of a job's settings map */
#define KVM_PROTO_MAX_ATTEMPTS 1000            /* job attempt counter */
#define KVM_PROTO_MAX_STATUS 65535             /* status codes lie in [-65535, 0] */
#define KVM_PROTO_MAX_MS 1e12                  /* timings, ms (~31 years) */
#define KVM_PROTO_ID_BYTES 32                  /* model id, doc hash, config id (BLAKE2b-256) */

/* Phase indices of stats and strategy rows. */
#define KVM_PROTO_PHASE_PREFILL 0
#define KVM_PROTO_PHASE_DECODE 1

/* Message types; the wire carries the name ("job", "kv", ...; kvm_proto_type_name). */
typedef enum kvm_proto_type {
    KVM_PROTO_JOB = 1,   /* orchestrator -> prefill: a document to process */
    KVM_PROTO_KV,        /* prefill -> compress/signals: one layer's KV and attention stats */
    KVM_PROTO_STATS,     /* signals -> strategy: calibration signals */
    KVM_PROTO_STRATEGY,  /* strategy -> store/compress/decode: per layer and phase plan */
    KVM_PROTO_CACHE,     /* compress -> store, store -> decode: one layer of a ragged cache */
    KVM_PROTO_RESULT,    /* stage -> orchestrator: a job finished */
    KVM_PROTO_ERROR,     /* stage -> orchestrator: a job failed */
    KVM_PROTO_READY,     /* stage -> orchestrator: the stage is up */
    KVM_PROTO_HEARTBEAT, /* stage -> orchestrator: still alive */
    KVM_PROTO_ACK,       /* stage -> orchestrator: a job is committed */
    KVM_PROTO_GET_CACHE, /* client -> serve: fetch a stored cache */
    KVM_PROTO_ASK,       /* client -> serve: answer a prompt over a document */
    KVM_PROTO_ANSWER,    /* serve -> client: the answer */
    KVM_PROTO_PUT_CACHE, /* worker -> store service: a cache upload begins (revision 3) */
    KVM_PROTO_STORE_REPLY, /* store service -> worker: committed, refused, or a get_cache (rev 3) or
                              get_strategy (rev 5) reply */
    KVM_PROTO_GET_STRATEGY, /* worker -> store service: fetch a model's PolyKV strategy (rev 5) */
    KVM_PROTO_CLAIM,        /* run -> store service: claim a document's cache key, or probe it (rev 6) */
    KVM_PROTO_RENEW_CLAIMS, /* run -> store service: renew or release a run's claims (rev 6) */
} kvm_proto_type;
#define KVM_PROTO_TYPE_FIRST KVM_PROTO_JOB
#define KVM_PROTO_TYPE_LAST KVM_PROTO_RENEW_CLAIMS

/* A string: UTF-8 bytes, no NUL inside, not NUL-terminated. Decoded: borrowed from the
 * message. Encoding: ptr may be NULL when len == 0. */
typedef struct kvm_proto_str {
    const char *ptr; /* first byte */
    size_t len;      /* bytes */
} kvm_proto_str;

/* Raw bytes (MessagePack bin), any values. Decoded: borrowed from the message. Encoding: ptr
 * may be NULL when len == 0. */
typedef struct kvm_proto_bytes {
    const uint8_t *ptr; /* first byte */
    size_t len;         /* bytes */
} kvm_proto_bytes;

/* A kvm_proto_str over a C string (NULL gives the empty string). */
kvm_proto_str kvm_proto_str_c(const char *s);
/* A malloc'ed NUL-terminated copy (caller frees), or NULL when out of memory. */
char *kvm_proto_str_dup(kvm_proto_str s);
/* 1 when s equals the C string c byte for byte, else 0. */
int kvm_proto_str_eq(kvm_proto_str s, const char *c);
/* A protocol string made from text that may not be UTF-8 (a message naming a path, whose bytes
 * are the filesystem's; one cut by snprintf in the middle of a character): s copied into
 * buf[cap] with each byte that does not begin a valid UTF-8 character (RFC 3629, as the
 * decoders check it) written as '?', and cut at a character boundary so that the copy and its
 * terminating NUL fit. Returns a view of buf (NUL-terminated; length < cap), which encodes as a
 * str field whatever s held. s NULL gives the empty string; cap 0 gives an empty view. */
kvm_proto_str kvm_proto_str_utf8(const char *s, char *buf, size_t cap);

/* Wire name of a type ("job", "get_cache", ...), or "?" outside the enum. Never NULL. */
const char *kvm_proto_type_name(kvm_proto_type type);

/* Reads only "v" and "type" of frame 0 (not the other fields, not the tensors), to dispatch
 * on the type before decoding. Errors: KVM_EPROTO (no frames, frame 0 not a map, "v"
 * missing or not 1 (the detail gives the version), "type" missing or unknown (the detail
 * quotes it)), KVM_ERANGE (frame 0 larger than KVM_PROTO_MAX_HEADER_BYTES), KVM_EINVAL. */
int kvm_proto_peek(const kvm_msg *msg, kvm_proto_type *type);

/* ---- job: orchestrator -> prefill ---- */
typedef struct kvm_proto_job {
    uint64_t job_id;         /* "job_id" uint: unique within a run */
    int64_t attempt;         /* "attempt" uint: 0 first try, +1 per requeue; [0, MAX_ATTEMPTS] */
    kvm_proto_str doc_id;    /* "doc_id" str: the document's id in its corpus; 1..MAX_NAME_BYTES */
    kvm_proto_str doc_name;  /* "doc_name" str: human-readable name (path, title); 0..MAX_NAME_BYTES */
    int64_t n_ctx;           /* "n_ctx" uint: context length the job runs at, tokens; [1, MAX_TOKENS] */
    int64_t n_tokens;        /* "n_tokens" uint: document tokens; [1, n_ctx] */
    const int32_t *tokens;   /* tensor "tokens": i32 [n_tokens], token ids >= 0 */
    const uint8_t *settings; /* "settings" map str -> nil|bool|int|float|str (<= MAX_NAME_BYTES),
                                <= MAX_SETTINGS entries, as raw MessagePack bytes of the map;
                                NULL when absent (then not written) */
    size_t settings_bytes;   /* bytes at settings */
    int64_t n_continuation;  /* "n_continuation" uint, optional: held-out tokens after the
                                context for evaluation; [0, MAX_TOKENS], 0 when absent */
    const int32_t *continuation; /* tensor "continuation": i32 [n_continuation], ids >= 0;
                                    optional: NULL when absent */
    bool has_model_id;           /* revision 10: model_id below is given ("model_id" present) */
    uint8_t model_id[KVM_PROTO_ID_BYTES]; /* "model_id" bin 32, optional: the run's model (BLAKE2b-256
                                    of its weights), so that a worker that loads the settings'
                                    model path can refuse a file of other weights on its host */
} kvm_proto_job;
/* job codec (contract at the top). Checks beyond the field comments: n_tokens <= n_ctx, every
 * token id >= 0, settings is a map of scalars, model_id (has_model_id) exactly 32 bytes, else
 * KVM_EPROTO naming the field. 1 tensor frame. */
int kvm_proto_job_encode(const kvm_proto_job *in, kvm_msg **out);
int kvm_proto_job_decode(const kvm_msg *msg, kvm_proto_job *out);

/* ---- kv: prefill -> compress / signals, one layer ---- */
typedef struct kvm_proto_kv {
    uint64_t job_id;        /* "job_id" uint */
    int64_t layer;          /* "layer" uint: [0, n_layers) */
    int64_t n_layers;       /* "n_layers" uint: [1, MAX_LAYERS] */
    int64_t n_tokens;       /* "n_tokens" uint: N, tokens of the document; [1, MAX_TOKENS] */
    int64_t n_heads;        /* "n_heads" uint: query heads; [1, MAX_HEADS] */
    int64_t n_kv_heads;     /* "n_kv_heads" uint: KV heads; [1, n_heads], divides n_heads (GQA) */
    int64_t head_dim;       /* "head_dim" uint: [1, MAX_HEAD_DIM] */
    int64_t q_start;        /* "q_start" uint: position of the first query row; [0, n_tokens] */
    int64_t n_queries;      /* "n_queries" uint: query rows kept (observation window, retain
                               zone); q_start + n_queries <= n_tokens */
    kvm_proto_dtype dtype;  /* dtype of tensors "keys", "values", "q_pre" and "q_post": f32, or
                               f16 / bf16 ([run] wire_dtype; revision 4); all four agree */
    const void *keys;       /* tensor "keys": dtype [n_kv_heads][n_tokens][head_dim], post-RoPE */
    const void *values;     /* tensor "values": dtype [n_kv_heads][n_tokens][head_dim] */
    const void *q_pre;      /* tensor "q_pre": dtype [n_heads][n_queries][head_dim], pre-RoPE
                               query content vectors of positions [q_start, q_start+n_queries);
                               optional: NULL when absent */
    const void *q_post;     /* tensor "q_post": same shape and dtype, post-RoPE; optional */
    const float *entropy;   /* tensor "entropy": f32 [n_heads][n_tokens], entropy (nats) of
                               the attention distribution of query t */
    const float *attn_mass; /* tensor "attn_mass": f32 [n_heads][n_tokens], attention key t
                               received, summed over all queries */
} kvm_proto_kv;
/* kv codec. Checks: layer < n_layers, n_kv_heads divides n_heads, q_start + n_queries <=
 * n_tokens, every tensor shape, keys/values/queries of one float dtype (the decoder refuses
 * i32 or mixed dtypes, KVM_EPROTO, naming the tensor). 4 tensor frames, 6 with queries.
 * Readers widen 16-bit tensors with kvm_half_convert. */
int kvm_proto_kv_encode(const kvm_proto_kv *in, kvm_msg **out);
int kvm_proto_kv_decode(const kvm_msg *msg, kvm_proto_kv *out);

/* ---- stats: signals -> strategy, calibration signals of one model ---- */
typedef struct kvm_proto_stats {
    uint64_t job_id;                                /* "job_id" uint: calibration job */
    int64_t n_layers;                               /* "n_layers" uint: [1, MAX_LAYERS] */
    int64_t n_phases;                               /* "n_phases" uint: [1, MAX_PHASES]; 0 prefill, 1 decode */
    int64_t n_patterns;                             /* length of "patterns": [1, MAX_PATTERNS] */
    kvm_proto_str patterns[KVM_PROTO_MAX_PATTERNS]; /* "patterns" [str]: pattern names
                                 ("streaming", "h2o", "tova", "snapkv", "pyramidkv", "sculpt"),
                                 distinct, 1..MAX_PATTERN_BYTES each */
    int64_t n_tokens;                               /* "n_tokens" uint: calibration length, tokens; [1, MAX_TOKENS] */
    int64_t n_docs;                                 /* "n_docs" uint: calibration documents averaged; [1, 2^31) */
    int64_t budget_tokens;  /* "budget_tokens" uint: budget the patterns ran at; [0, n_tokens] */
    const float *cos_sim;   /* tensor "cos_sim": f32 [n_layers][n_phases][n_patterns], mean
                               cosine similarity of the layer's attention output vs full KV */
    const float *ppl_delta; /* tensor "ppl_delta": f32 [n_layers][n_phases][n_patterns],
                               perplexity change when only this layer uses the pattern */
    const float *entropy;   /* tensor "entropy": f32 [n_layers][n_phases], mean attention
                               entropy of the layer, nats */
    const float *ppl_worst; /* tensor "ppl_worst": f32 [n_layers][n_phases], worst-case
                               perplexity change over patterns (budget sensitivity) */
} kvm_proto_stats;
/* stats codec. Checks: budget_tokens <= n_tokens, pattern names distinct. 4 tensor frames. */
int kvm_proto_stats_encode(const kvm_proto_stats *in, kvm_msg **out);
int kvm_proto_stats_decode(const kvm_msg *msg, kvm_proto_stats *out);

/* ---- strategy: per layer and phase pattern and budget ---- */
typedef struct kvm_proto_strategy {
    kvm_proto_str name; /* "name" str: strategy name; 1..MAX_NAME_BYTES */
    int64_t n_layers;   /* "n_layers" uint: [1, MAX_LAYERS] */
    int64_t n_phases;   /* "n_phases" uint: [1, MAX_PHASES] */
    int64_t n_kv_heads; /* "n_kv_heads" uint: [1, MAX_HEADS] */
    int64_t n_ctx;      /* "n_ctx" uint: longest context the plan is for, tokens; [1, MAX_TOKENS] */
    int64_t budget_min; /* "budget_min" uint: floor b_min of every budget; [0, n_ctx] */
    int64_t n_patterns; /* length of "patterns": [1, MAX_PATTERNS] */
    kvm_proto_str patterns[KVM_PROTO_MAX_PATTERNS]; /* "patterns" [str], as in stats */
    const int32_t *pattern;     /* tensor "pattern": i32 [n_layers][n_phases], index into patterns */
    const int32_t *budget;      /* tensor "budget": i32 [n_layers][n_phases], entries kept per KV
                                   head; [budget_min, n_ctx] */
    const int32_t *head_budget; /* tensor "head_budget": i32 [n_layers][n_phases][n_kv_heads],
                                 per-KV-head entries, [0, n_ctx]; optional: NULL when absent */
} kvm_proto_strategy;
/* strategy codec. Checks: budget_min <= n_ctx; reads the tensors: every pattern index in
 * [0, n_patterns), every budget in [budget_min, n_ctx], every head budget in [0, n_ctx]. */
int kvm_proto_strategy_encode(const kvm_proto_strategy *in, kvm_msg **out);
int kvm_proto_strategy_decode(const kvm_msg *msg, kvm_proto_strategy *out);

/* ---- cache: one layer of a ragged compressed cache ---- */
typedef struct kvm_proto_cache {
    int64_t layer;               /* "layer" uint: [0, n_layers) */
    int64_t n_layers;            /* "n_layers" uint: [1, MAX_LAYERS] */
    int64_t n_kv_heads;          /* "n_kv_heads" uint: [1, MAX_HEADS] */
    int64_t head_dim;            /* "head_dim" uint: [1, MAX_HEAD_DIM] */
    int64_t n_tokens;            /* "n_tokens" uint: tokens of the original document; [1, MAX_TOKENS] */
    int64_t n_entries;           /* "n_entries" uint: entries over all KV heads; [0, n_kv_heads*n_tokens] */
    kvm_proto_dtype dtype;       /* dtype of tensors "keys" and "values": f32, f16 or bf16 */
    const int32_t *head_entries; /* tensor "head_entries": i32 [n_kv_heads], entries of each KV
                                 head, each [0, n_tokens] (0 allowed), summing to n_entries */
    const void *keys;            /* tensor "keys": dtype [n_entries][head_dim], post-RoPE; KV head
                                    h's rows start at head_entries[0] + ... + head_entries[h-1] */
    const void *values;          /* tensor "values": dtype [n_entries][head_dim], same row order */
    const int32_t *positions;    /* tensor "positions": i32 [n_entries], the entry's original
                                    position in [0, n_tokens), or -1 for a distilled entry */
    const float *logit_bias;     /* tensor "logit_bias": f32 [n_entries], added to the entry's
                                    attention logit (KVSculpt's per-entry bias; 0 for kept tokens) */
} kvm_proto_cache;
/* cache codec. Checks: layer < n_layers; reads the tensors: head_entries each in
 * [0, n_tokens] summing to n_entries (the rows of keys/values/positions/logit_bias), positions
 * in [-1, n_tokens); keys and values share one dtype in {f32, f16, bf16}. 5 tensor frames
 * (empty frames when n_entries == 0). To store: kvm_msg_pack the encoded message; to serve:
 * kvm_msg_unpack the stored blob and kvm_msg_send it. */
int kvm_proto_cache_encode(const kvm_proto_cache *in, kvm_msg **out);
int kvm_proto_cache_decode(const kvm_msg *msg, kvm_proto_cache *out);

/* ---- result / error: stage -> orchestrator ---- */
typedef struct kvm_proto_result {
    uint64_t job_id;         /* "job_id" uint */
    int32_t status;          /* "status" int: result: 0; error: a kvm_status, [-MAX_STATUS, -1] */
    kvm_proto_str stage;     /* "stage" str: "prefill", "compress", ...; 1..MAX_NAME_BYTES */
    kvm_proto_str worker_id; /* "worker_id" str: 0..MAX_NAME_BYTES */
    double wait_ms;          /* "wait_ms" float: queued before work started; [0, MAX_MS] */
    double compute_ms;       /* "compute_ms" float: working; [0, MAX_MS] */
    double total_ms;         /* "total_ms" float: receipt to reply; [0, MAX_MS] */
    kvm_proto_str message;   /* "message" str: detail (kvm_errmsg for errors); 0..MAX_MESSAGE_BYTES */
    bool retryable;          /* "retryable" bool: error only: requeueing may succeed (false for
                                a malformed document); ignored in results */
    bool evaluated;          /* "evaluated" bool, optional: kl_mean holds a measurement */
    double kl_mean;          /* "kl_mean" float, optional: mean KL(full ‖ compressed) over the
                                job's continuation, nats; [0, 1e6] */
    double transport_ms;     /* "transport_ms" float, optional: encoding, decoding and copying
                                messages inside the stage; [0, MAX_MS] */
    double store_ms;         /* "store_ms" float, optional (revision 4): time the stage spent
                                committing the cache (LMDB transaction, or upload to the store
                                service and its reply; the upload is also in transport_ms); [0, MAX_MS] */
} kvm_proto_result;
typedef kvm_proto_result kvm_proto_error;
/* result / error codecs: same struct; result requires status 0, error status < 0. No tensors. */
int kvm_proto_result_encode(const kvm_proto_result *in, kvm_msg **out);
int kvm_proto_result_decode(const kvm_msg *msg, kvm_proto_result *out);
int kvm_proto_error_encode(const kvm_proto_error *in, kvm_msg **out);
int kvm_proto_error_decode(const kvm_msg *msg, kvm_proto_error *out);

/* ---- ready / heartbeat / ack: control, stage -> orchestrator (DEALER -> ROUTER) ---- */
typedef struct kvm_proto_ctl {
    kvm_proto_str worker_id; /* "worker_id" str: 1..MAX_NAME_BYTES, unique per stage process */
    kvm_proto_str stage;     /* "stage" str: 1..MAX_NAME_BYTES */
    int64_t pid;             /* "pid" uint: [1, 2^31) */
    kvm_proto_str device;    /* "device" str: ready only ("cpu", "cuda:0"); 0..MAX_NAME_BYTES */
    bool has_model_id;       /* ready only, revision 10: model_id below is given ("model_id" present) */
    uint8_t model_id[KVM_PROTO_ID_BYTES]; /* "model_id" bin 32, ready, optional: BLAKE2b-256 of the
                                weights the stage computes with (the store's model id), so that a
                                server or run can refuse a worker of another model */
    bool has_settings_id;                 /* ready only, revision 11: settings_id below is given */
    uint8_t settings_id[KVM_PROTO_ID_BYTES]; /* "settings_id" bin 32, ready, optional: the config id of
                                the stage's own --config without a PolyKV strategy (kvm_jobcfg_config_id
                                with no strategy hash), so that a server refuses a decode worker whose
                                caches and answers follow other settings */
    uint64_t job_id;         /* "job_id" uint: ack: the job now committed; heartbeat (optional):
                                the job being worked on, 0 = none */
    uint64_t progress_done;  /* "progress_done" uint, heartbeat, optional: units of job_id done */
    uint64_t progress_total; /* "progress_total" uint, heartbeat, optional: units announced so far
                                (grows as passes start); 0 = the stage reports no progress */
    bool stopping;           /* "stopping" bool, revision 13, heartbeat and ack on the data socket
                                only: a heartbeat with it says the stage stops (withdraw its credit);
                                an ack with it (orchestrator -> stage, job_id 0) is the end of that
                                stage's work: nothing the orchestrator sends it comes after it */
    bool has_store_id;       /* ready only, revision 15: store_id below is given */
    uint8_t store_id[KVM_PROTO_ID_BYTES]; /* "store_id" bin 32, ready, optional: the place of the
                                LMDB store a decode worker reads and writes (kvm_store_place_id), so
                                that a server refuses one whose caches are another store's */
    uint64_t instance;                    /* "instance" uint, revision 15, ready, optional: a random number drawn
                                             when the stage process starts (0: none), so that a new process under
                                             the same pid (pid 1 of a restarted container) is told apart */
    bool probe;                           /* "probe" bool, revision 15, heartbeat with stopping on the data socket:
                                             the worker does not stop, it asks whether the orchestrator hears it
                                             (no welcome came): answered and its credit withdrawn as for a stop,
                                             without the line that says the worker stops */
    uint64_t revision;                    /* "revision" uint, revision 15, ack from an orchestrator or server: its
                                             protocol revision (KVM_PROTO_REVISION); absent (0) from older ones.
                                             An ack with job_id 0 and no stopping on the control socket is the
                                             welcome: the answer to the stage's control ready */
} kvm_proto_ctl;
typedef kvm_proto_ctl kvm_proto_ready;
typedef kvm_proto_ctl kvm_proto_heartbeat;
typedef kvm_proto_ctl kvm_proto_ack;
/* ready / heartbeat / ack codecs: same struct; ready also carries device and optionally
 * model_id (has_model_id; exactly 32 bytes, else KVM_EPROTO naming the field), ack job_id,
 * heartbeat optionally job_id and progress_done/progress_total, heartbeat and ack stopping;
 * fields not in a type are neither written nor read (decoded as 0 / empty). No tensors. */
int kvm_proto_ready_encode(const kvm_proto_ready *in, kvm_msg **out);
int kvm_proto_ready_decode(const kvm_msg *msg, kvm_proto_ready *out);
int kvm_proto_heartbeat_encode(const kvm_proto_heartbeat *in, kvm_msg **out);
int kvm_proto_heartbeat_decode(const kvm_msg *msg, kvm_proto_heartbeat *out);
int kvm_proto_ack_encode(const kvm_proto_ack *in, kvm_msg **out);
int kvm_proto_ack_decode(const kvm_msg *msg, kvm_proto_ack *out);

/* ---- get_cache: client -> serve ---- */
typedef struct kvm_proto_get_cache {
    uint64_t request_id;                   /* "request_id" uint: echoed in the reply */
    uint8_t model_id[KVM_PROTO_ID_BYTES];  /* "model_id" bin 32: BLAKE2b-256 of the weights */
    uint8_t doc_hash[KVM_PROTO_ID_BYTES];  /* "doc_hash" bin 32: BLAKE2b-256 of the token ids */
    uint8_t config_id[KVM_PROTO_ID_BYTES]; /* "config_id" bin 32: hash of compression settings */
} kvm_proto_get_cache;
/* get_cache codec: the three ids are bin of exactly 32 bytes. No tensors. */
int kvm_proto_get_cache_encode(const kvm_proto_get_cache *in, kvm_msg **out);
int kvm_proto_get_cache_decode(const kvm_msg *msg, kvm_proto_get_cache *out);

/* ---- ask: client -> serve. The document is given in exactly one of five ways. ---- */
typedef struct kvm_proto_ask {
    uint64_t request_id;       /* "request_id" uint: echoed in the answer */
    kvm_proto_str doc_text;    /* "doc_text" str: document as text; 0..MAX_TEXT_BYTES; empty when
                                  the document comes another way */
    int64_t n_doc_tokens;      /* "n_doc_tokens" uint: [0, MAX_TOKENS]; 0 unless given as tokens */
    const int32_t *doc_tokens; /* tensor "doc_tokens": i32 [n_doc_tokens], ids >= 0; present iff
                                 n_doc_tokens > 0 (NULL otherwise) */
    kvm_proto_str prompt;      /* "prompt" str: appended after the document; 0..MAX_TEXT_BYTES */
    int64_t max_new_tokens;    /* "max_new_tokens" uint: [0, MAX_TOKENS] */
    double temperature;        /* "temperature" float: [0, 100], 0 = greedy; optional, default 0 */
    /* revision 2 (older readers ignore these; PROTOCOL.md §9) */
    kvm_proto_bytes doc_bytes; /* "doc_bytes" bin, optional: the document file's bytes, any
                                  values (binary, latin-1); 0..MAX_DOC_BYTES; written when len > 0 */
    bool has_doc_hash;         /* doc_hash below is given ("doc_hash" present) */
    uint8_t doc_hash[KVM_PROTO_ID_BYTES]; /* "doc_hash" bin 32, optional: a stored document, by the
                                  BLAKE2b-256 of its token ids (kvmill store ls --csv) */
    kvm_proto_str doc_name;    /* "doc_name" str, optional: a stored document, by the name kvmill
                                  run stored it under; 0..MAX_NAME_BYTES, empty = not given */
    bool compute_grant;        /* "compute_grant" bool, optional: set by kvmill serve on the request
                                  it hands to a decode worker (the client's value is replaced):
                                  the worker may add one cache under [serve] compute_missing */
    /* revision 7 */
    kvm_proto_bytes prompt_bytes; /* "prompt_bytes" bin, optional: the prompt's bytes when they are
                                  not UTF-8 (latin-1, say: a byte-level tokenizer takes any); read
                                  instead of prompt, which then holds them as '?' for older
                                  readers; 0..MAX_TEXT_BYTES; written when len > 0 */
    /* revision 9 */
    int64_t doc_size; /* "doc_size" uint, optional: the whole document's bytes when doc_text
                      or doc_bytes hold only its beginning (kvmill serve cut a document over
                      [serve] max_message_bytes to what fits); 0 = they hold all of it;
                      else [1, 2^62] and more than the bytes given */
} kvm_proto_ask;
/* ask codec. Checks: exactly one of doc_text (non-empty), doc_bytes (non-empty), doc_tokens
 * (n_doc_tokens > 0), doc_hash (has_doc_hash) and doc_name (non-empty); token ids >= 0;
 * doc_size 0, or more than the bytes of doc_text / doc_bytes (KVM_EPROTO otherwise).
 * 0 or 1 tensor frame. */
int kvm_proto_ask_encode(const kvm_proto_ask *in, kvm_msg **out);
int kvm_proto_ask_decode(const kvm_msg *msg, kvm_proto_ask *out);

/* ---- answer: serve -> client ---- */
typedef struct kvm_proto_answer {
    uint64_t request_id;   /* "request_id" uint: of the ask */
    int32_t status;        /* "status" int: 0 or a kvm_status, [-MAX_STATUS, 0] */
    kvm_proto_str text;    /* "text" str: generated text; 0..MAX_TEXT_BYTES */
    int64_t n_tokens;      /* "n_tokens" uint: generated tokens; [0, MAX_TOKENS] */
    const int32_t *tokens; /* tensor "tokens": i32 [n_tokens], generated ids >= 0 (NULL or
                              not when n_tokens == 0) */
    double load_ms;        /* "load_ms" float: cache lookup and load; [0, MAX_MS] */
    double prefill_ms;     /* "prefill_ms" float: prompt prefill; [0, MAX_MS] */
    double decode_ms;      /* "decode_ms" float: generation; [0, MAX_MS] */
    double total_ms;       /* "total_ms" float: request to answer; [0, MAX_MS] */
    kvm_proto_str message; /* "message" str: error detail when status < 0; 0..MAX_MESSAGE_BYTES */
    bool new_cache;        /* "new_cache" bool, optional (revision 2): the worker computed the
                              document's cache for this answer and stored it (compute_missing) */
    bool computed;         /* "computed" bool, optional (revision 8): the worker computed (or tried
                              to compute) the document's cache for this answer, stored or not:
                              with new_cache false, the cache is not in the store */
} kvm_proto_answer;
/* answer codec. Checks: token ids >= 0; text is valid UTF-8 without NUL (a worker replaces
 * what is not: model/kvm_utf8.h). 1 tensor frame (empty when n_tokens == 0). */
int kvm_proto_answer_encode(const kvm_proto_answer *in, kvm_msg **out);
int kvm_proto_answer_decode(const kvm_msg *msg, kvm_proto_answer *out);

/* ---- put_cache: worker -> store service (revision 3). The header of an upload: exactly
 * n_layers `cache` messages (layers 0, 1, ... in order) follow on the same connection; the
 * service commits cache + manifest in one transaction and answers one store_reply. ---- */
typedef struct kvm_proto_put_cache {
    uint64_t request_id;                      /* "request_id" uint: echoed in the store_reply */
    uint64_t job_id;                          /* "job_id" uint, optional: the run's job (logs, reply) */
    uint8_t model_id[KVM_PROTO_ID_BYTES];     /* "model_id" bin 32: BLAKE2b-256 of the weights */
    uint8_t doc_hash[KVM_PROTO_ID_BYTES];     /* "doc_hash" bin 32: BLAKE2b-256 of the token ids */
    uint8_t config_id[KVM_PROTO_ID_BYTES];    /* "config_id" bin 32: the config id of the cache */
    uint8_t tokenizer_id[KVM_PROTO_ID_BYTES]; /* "tokenizer_id" bin 32: zero when none */
    int64_t n_layers;     /* "n_layers" uint: cache messages that follow; [1, MAX_LAYERS] */
    int64_t n_kv_heads;   /* "n_kv_heads" uint: of every layer; [1, MAX_HEADS] */
    int64_t head_dim;     /* "head_dim" uint: of every layer; [1, MAX_HEAD_DIM] */
    int64_t n_tokens;     /* "n_tokens" uint: document tokens N; [1, MAX_TOKENS] */
    int64_t n_entries;    /* "n_entries" uint: entries over all layers and heads; [0, 2^62] */
    int64_t full_bytes;   /* "full_bytes" uint: f32 bytes of the uncompressed cache; [0, 2^62] */
    kvm_proto_str dtype;  /* "dtype" str: keys/values dtype of every layer ("f32", "f16", "bf16") */
    kvm_proto_bytes config; /* "config" bin: the canonical config text (manifest); 0..MAX_TEXT_BYTES */
    kvm_proto_str doc_name; /* "doc_name" str, optional: recorded as the document's source */
} kvm_proto_put_cache;
/* put_cache codec. Checks: dtype one of f32, f16, bf16. No tensors. */
int kvm_proto_put_cache_encode(const kvm_proto_put_cache *in, kvm_msg **out);
int kvm_proto_put_cache_decode(const kvm_msg *msg, kvm_proto_put_cache *out);

/* ---- store_reply: store service -> worker (revision 3) ---- */
typedef struct kvm_proto_store_reply {
    uint64_t request_id;   /* "request_id" uint: of the put_cache or get_cache */
    uint64_t job_id;       /* "job_id" uint, optional: of the put_cache */
    int32_t status;        /* "status" int: 0 (committed / found) or a kvm_status, [-MAX_STATUS, 0] */
    kvm_proto_str message; /* "message" str: why not, when status < 0; 0..MAX_MESSAGE_BYTES */
    int64_t n_layers;      /* "n_layers" uint, optional: get_cache found: this many `cache`
                              messages follow; [0, MAX_LAYERS] */
    /* revision 5 (older readers ignore it; PROTOCOL.md §9) */
    kvm_proto_bytes strategy; /* "strategy" bin, optional: get_strategy found: the stored strategy
                              record's bytes (compress/polykv's canonical encoding, as
                              kvm_store_get_strategy returns them); 0..MAX_TEXT_BYTES, written
                              when len > 0 */
    /* revision 6: the answer to a claim or renew_claims */
    kvm_proto_str claim;       /* "claim" str, optional: a claim's outcome: "taken" (this run holds
                                  it now), "held" (another live run does: holder), "stored" (the
                                  cache is stored: nothing taken), "missing" (a probe: not stored);
                                  "" for other replies */
    kvm_proto_str holder;      /* "holder" str, optional: with "held": the holding run's owner */
    kvm_proto_str holder_host; /* "holder_host" str, optional: with "held": its host */
    int64_t n_claims;          /* "n_claims" uint, optional: renew_claims: claims renewed or released */
    int64_t full_bytes;        /* "full_bytes" uint, optional: with "stored": the manifest's f32 bytes */
    int64_t stored_bytes;      /* "stored_bytes" uint, optional: with "stored": the cache's bytes */
    /* revision 12 */
    int64_t holder_expires_ms; /* "holder_expires_ms" uint, optional: with "held": when the live claim
                                  lapses unless renewed, unix ms by the service's clock (a run compares
                                  two of them to see a renewal); 0 = not sent (a revision-11 service) */
} kvm_proto_store_reply;
/* store_reply codec. Checks: n_layers == 0, no strategy and no claim outcome when status < 0;
 * not both n_layers and a strategy; claim one of "", taken, held, stored, missing; holder,
 * holder_host and holder_expires_ms only with held, held with a holder. No tensors. */
int kvm_proto_store_reply_encode(const kvm_proto_store_reply *in, kvm_msg **out);
int kvm_proto_store_reply_decode(const kvm_msg *msg, kvm_proto_store_reply *out);

/* ---- get_strategy: worker -> store service (revision 5). A compress worker on another host
 * asks for the PolyKV strategy stored under (model_id, name); the service answers one
 * store_reply: status 0 with the strategy's bytes, or KVM_ENOTFOUND naming the model and
 * name. Read-only: the service never changes the store for it. ---- */
typedef struct kvm_proto_get_strategy {
    uint64_t request_id;                  /* "request_id" uint: echoed in the store_reply */
    uint8_t model_id[KVM_PROTO_ID_BYTES]; /* "model_id" bin 32: BLAKE2b-256 of the weights */
    kvm_proto_str name;                   /* "name" str: strategy name ([compress] strategy);
                                             1..MAX_NAME_BYTES */
} kvm_proto_get_strategy;
/* get_strategy codec. Checks: model_id is bin of exactly 32 bytes, name non-empty. No tensors. */
int kvm_proto_get_strategy_encode(const kvm_proto_get_strategy *in, kvm_msg **out);
int kvm_proto_get_strategy_decode(const kvm_msg *msg, kvm_proto_get_strategy *out);

/* ---- claim: run -> store service (revision 6). An orchestrator whose store is on another
 * host (its [store] path a store service endpoint) claims each document's cache key before it
 * sends the document to prefill, the lease of store/kvm_store_claim.c taken by the service in
 * one write transaction: the reply's claim is "stored" (the cache is stored and readable for
 * tokenizer_id: nothing taken), "held" (another owner's live claim: holder, holder_host) or
 * "taken". With probe the service only says "stored" or "missing" and changes nothing. ---- */
typedef struct kvm_proto_claim {
    uint64_t request_id;                      /* "request_id" uint: echoed in the store_reply */
    kvm_proto_str owner;                      /* "owner" str: the run (kvm_storew_owner); 1..127 bytes */
    kvm_proto_str host;                       /* "host" str, optional: its host; 0..63 bytes */
    int64_t ttl_ms;                           /* "ttl_ms" uint, optional: the lease, ms; [0, 2^40],
                                                 >= 1 unless probe */
    uint8_t model_id[KVM_PROTO_ID_BYTES];     /* "model_id" bin 32 */
    uint8_t doc_hash[KVM_PROTO_ID_BYTES];     /* "doc_hash" bin 32 */
    uint8_t config_id[KVM_PROTO_ID_BYTES];    /* "config_id" bin 32: the cache key */
    uint8_t tokenizer_id[KVM_PROTO_ID_BYTES]; /* "tokenizer_id" bin 32: a stored cache counts only
                                                 when its manifest names it (zero: none) */
    bool probe;                               /* "probe" bool, optional: only ask whether stored */
    /* revision 12 */
    bool index_only; /* "index_only" bool, optional: "stored" is judged by the cache's index entry
                        (its manifest) alone, not by reading and checksumming its layers: a run's
                        recheck of a document another run stored (a revision-11 service ignores it
                        and reads the whole cache) */
} kvm_proto_claim;
/* claim codec. Checks: owner 1..127 bytes, host 0..63, ttl_ms >= 1 unless probe. No tensors. */
int kvm_proto_claim_encode(const kvm_proto_claim *in, kvm_msg **out);
int kvm_proto_claim_decode(const kvm_msg *msg, kvm_proto_claim *out);

/* ---- renew_claims: run -> store service (revision 6). Sets every claim of owner to expire
 * ttl_ms from now, or removes them all (release: the run's end), in one write transaction;
 * the reply's n_claims counts them. ---- */
typedef struct kvm_proto_renew_claims {
    uint64_t request_id; /* "request_id" uint: echoed in the store_reply */
    kvm_proto_str owner; /* "owner" str: the run; 1..127 bytes */
    int64_t ttl_ms;      /* "ttl_ms" uint, optional: [0, 2^40], >= 1 unless release */
    bool release;        /* "release" bool, optional: remove the claims instead */
} kvm_proto_renew_claims;
/* renew_claims codec. Checks: owner 1..127 bytes, ttl_ms >= 1 unless release. No tensors. */
int kvm_proto_renew_claims_encode(const kvm_proto_renew_claims *in, kvm_msg **out);
int kvm_proto_renew_claims_decode(const kvm_msg *msg, kvm_proto_renew_claims *out);

#endif
