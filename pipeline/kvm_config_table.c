/* kvm_config_table.c: every pipeline setting, its type, default, bounds and help. This table
 * is the single source of truth: parsing, validation, --dump-config and the comments in
 * the configs/ files follow it. */
#include "pipeline/kvm_config.h"

#define I KVM_CFG_INT
#define F KVM_CFG_FLOAT
#define B KVM_CFG_BOOL
#define E KVM_CFG_ENUM
#define S KVM_CFG_STR
#define P KVM_CFG_PATH

/* a sculpt setting's config type and choices, by its kind */
#define CFG_T_I64 KVM_CFG_INT
#define CFG_T_INT KVM_CFG_INT
#define CFG_T_U64 KVM_CFG_INT
#define CFG_T_F64 KVM_CFG_FLOAT
#define CFG_T_BOOL KVM_CFG_BOOL
#define CFG_T_ALLOC KVM_CFG_ENUM
#define CFG_T_QSOURCE KVM_CFG_STR
#define CFG_C_I64 NULL
#define CFG_C_INT NULL
#define CFG_C_U64 NULL
#define CFG_C_F64 NULL
#define CFG_C_BOOL NULL
#define CFG_C_ALLOC "uniform|layer|head|gain"
#define CFG_C_QSOURCE NULL
#define CFG_ROW_0(nm, kd, lo, hi, def, unit, help)
#define CFG_ROW_1(nm, kd, lo, hi, def, unit, help) {"compress", #nm, CFG_T_##kd, def, lo, hi, CFG_C_##kd, unit, help " (sculpt)"},

const kvm_cfg_alias kvm_cfg_aliases[] = {
    {"compress", "synthetic_queries", "queries"},
    {NULL, NULL, NULL},
};

/* one setting per line, as --dump-config and configs/ list them */
/* clang-format off */
const kvm_cfg_setting kvm_cfg_settings[] = {
    {"model", "path", P, NULL, 0, 0, NULL, "", "model: llama2.c checkpoint, .gguf file, or Hugging Face folder"},
    {"model", "tokenizer", P, "", 0, 0, NULL, "", "tokenizer file; empty = the one beside the model"},
    {"model", "context", I, "384", 1, 1 << 20, NULL, "tokens", "documents are truncated to this many tokens (BOS included)"},
    {"model", "chat", B, "false", 0, 0, NULL, "", "chat framing (ChatML or Llama-3 templates): each cached document opens the user's turn (the template up to the user's content, then the document); serve appends the prompt, the end of the turn and the assistant marker"},
    {"model", "system", S, "", 0, 0, NULL, "", "system message of the chat framing; empty = the template's own default, if it has one"},
    {"model", "weight_dtype", E, "auto", 0, 0, "auto|f32|bf16|f16", "", "how the CPU stores weight matrices, widened to float32 inside the GEMM: auto = bf16 for BF16 files, f32 for F32 files, f16 for F16 and quantised GGUF; f32 for parity runs. Stage workers on cuda:N: bf16/f16 weights with float32 accumulation, auto/f32 float32"},
    {"model", "kv_dtype", E, "f32", 0, 0, "f32|f16", "", "element type of the in-memory KV cache of decoding on the CPU (serve's decode workers; generate's --kv-dtype): f16 halves it, attention widens entries as it reads them; compression and stored caches are unaffected"},

    {"store", "path", P, "./kvmill.lmdb", 1, 0, NULL, "", "LMDB environment directory, or the store service's endpoint (tcp://HOST:PORT) for a run on another host"},
    {"store", "map_size_mb", I, "64", 1, 1 << 30, NULL, "MiB", "initial LMDB map size"},
    {"store", "map_max_mb", I, "1048576", 1, 1 << 30, NULL, "MiB", "the map grows up to this size, then writes fail"},
    {"store", "cap_mb", I, "0", 0, 1 << 30, NULL, "MiB", "cap on stored cache bytes, least recently served evicted first; 0 = none"},
    {"store", "dtype", E, "f32", 0, 0, "f32|f16|bf16", "", "element type of stored keys and values"},
    {"store", "service", S, "", 0, 0, NULL, "", "store service endpoint (kvmill store serve) compress workers upload to instead of opening the LMDB store; empty = open it directly (same host only)"},
    {"store", "service_bind", S, "", 0, 0, NULL, "", "kvmill run / kvmill serve start the store service bound here for workers on other hosts (off-host needs [security] keys); empty = none"},
    {"store", "upload_timeout_ms", I, "60000", 100, 86400000, NULL, "ms", "the store service refuses an upload whose layers take longer (truncated)"},

    {"compress", "method", E, "sculpt", 0, 0, "sculpt|selectfit|joint-fixed|am|kvzip|full|streaming|h2o|tova|snapkv|pyramidkv|polykv",
     "", "compression method applied to every document"},
    {"compress", "ratio", F, "0.3", 1e-9, 1, NULL, "", "kept fraction: k = ratio*(N-retain) for sculpt methods, b = ratio*N for eviction"},
    {"compress", "budget", I, "0", 0, 1 << 20, NULL, "entries", "entries per KV head instead of ratio (0 = use ratio)"},
    /* the KVSculpt settings, one row each from compress/sculpt/kvm_sculpt_settings.h: the key is
     * the name `kvmill sculpt|eval --NAME` and method strings use */
#define KVM_SCULPT_SETTING(nm, kd, field, lo, hi, cfg, def, unit, help, repl) CFG_ROW_##cfg(nm, kd, lo, hi, def, unit, help)
#include "compress/sculpt/kvm_sculpt_settings.h"
#undef KVM_SCULPT_SETTING
    {"compress", "future", I, "64", 1, 1 << 20, NULL, "tokens", "synthetic queries are spread over positions N..N+future (at least 1: a run has no continuation for the flags' 0 to stand for)"},
    {"compress", "target_kl", F, "0", 0, 1e6, NULL, "nats", "per document, the smallest budget (a multiple of target_step) whose mean KL(full || compressed) on the [eval] continuation tokens after the context is <= this, by bisection; replaces budget/ratio; 0 = off"},
    {"compress", "target_step", I, "16", 1, 1 << 20, NULL, "entries", "target_kl: budgets searched are multiples of this"},
    {"compress", "strategy", S, "default", 0, 0, NULL, "", "name of the stored PolyKV strategy (method = polykv)"},

    {"calibrate", "sculpt", B, "false", 0, 0, NULL, "", "PolyKV calibration offers KVSculpt ([compress] sculpt settings) to every layer"},
    {"calibrate", "kvzip", B, "false", 0, 0, NULL, "", "PolyKV calibration offers KVzip scoring (a pattern of its own; [compress] retain, queries, query_source) to every layer"},
    {"calibrate", "phases", E, "both", 0, 0, "both|prefill", "", "phases whose signals are measured; prefill: decode patterns = prefill patterns (about half the time)"},
    {"calibrate", "layer_alloc", E, "all", 0, 0, "all|entropy|ppl|uniform", "", "only this PolyKV layer-budget allocation among the candidate strategies; all: every one, the best kept"},

    {"eval", "enabled", B, "false", 0, 0, NULL, "", "measure KL on a held-out continuation after compressing"},
    {"eval", "continuation", I, "64", 2, 1 << 20, NULL, "tokens", "continuation length for the KL evaluation (at least 2: its first token is predicted by the context's own last row, full KV's)"},

    {"stages", "prefill_workers", I, "1", 0, 256, NULL, "processes", "kvmill-prefill workers started by the orchestrator"},
    {"stages", "compress_workers", I, "1", 0, 256, NULL, "processes", "kvmill-compress workers started by the orchestrator"},
    {"stages", "prefill_devices", S, "cpu", 0, 0, NULL, "", "comma-separated devices, one per prefill worker (cycled)"},
    {"stages", "compress_devices", S, "cpu", 0, 0, NULL, "", "comma-separated devices, one per compress worker (cycled)"},
    {"stages", "signals_workers", I, "1", 0, 256, NULL, "processes", "kvmill-signals workers for kvmill calibrate (on prefill_devices)"},
    {"stages", "strategy_workers", I, "1", 0, 256, NULL, "processes", "kvmill-strategy workers for kvmill calibrate (on compress_devices)"},
    {"stages", "threads", I, "1", 1, 256, NULL, "threads", "compute threads per stage process"},
    {"stages", "bin_dir", P, "", 0, 0, NULL, "", "folder of the kvmill-* binaries; empty = beside kvmill"},

    {"run", "run_dir", P, "", 0, 0, NULL, "", "folder for ipc:// endpoints and logs; empty = a fresh temporary one"},
    {"run", "bind", S, "", 0, 0, NULL, "", "tcp://HOST:PORT base endpoint (ports PORT and PORT+1); empty = ipc:// in run_dir"},
    {"run", "heartbeat_ms", I, "1000", 10, 3600000, NULL, "ms", "stage heartbeat interval"},
    {"run", "liveness", I, "5", 1, 1000, NULL, "beats", "a stage missing this many heartbeats is declared dead"},
    {"run", "grace_s", I, "30", 0, 86400, NULL, "s", "on SIGTERM a stage finishes its job within this time, else hands it back"},
    {"run", "max_retries", I, "3", 0, 100, NULL, "", "a job is requeued at most this many times, then recorded as failed"},
    {"run", "max_prefetch", I, "0", 0, 1 << 20, NULL, "documents", "documents prefilled and waiting for compress at most (their KV is held in memory); 0 = 2 per live compress worker"},
    {"run", "progress_s", I, "5", 0, 86400, NULL, "s", "when stderr is not a terminal: a progress line at most this often (0: at every change), and only when something changed"},
    {"run", "job_timeout_s", I, "600", 1, 86400 * 7, NULL, "s", "a job not acknowledged in this time is requeued"},
    {"run", "join_warn_s", I, "60", 1, 86400, NULL, "s", "a stage or decode worker this command started that has not joined (sent ready) this long after its start is named in the log, once, and again when it joins"},
    {"run", "log_format", E, "text", 0, 0, "text|json", "", "log lines of every process: text, or one JSON object per line (time, stage, pid, level, event, msg, fields)"},
    {"run", "metrics", P, "", 0, 0, NULL, "", "counters file (JSON) kept current during kvmill run, replaced atomically; empty = none"},
    {"run", "wire_dtype", E, "f32", 0, 0, "f32|f16|bf16", "", "element type of prefilled keys, values and queries on the wire to compress; 16 bit halves them, costs a little KL"},

    {"serve", "workers", I, "1", 0, 256, NULL, "processes", "decode workers started by kvmill serve; 0 = only external workers"},
    {"serve", "devices", S, "cpu", 0, 0, NULL, "", "comma-separated devices, one per decode worker (cycled); cuda:N serves caches of full and the sculpt family from the device forward"},
    {"serve", "max_prompt_tokens", I, "256", 1, 1 << 20, NULL, "tokens", "longer prompts get an error answer"},
    {"serve", "max_new_tokens", I, "256", 1, 1 << 20, NULL, "tokens", "larger requests get an error answer"},
    {"serve", "max_message_bytes", I, "1048576", 1024, 1LL << 34, NULL, "bytes", "largest request taken whole (all frames); a larger --doc ask is served from the document's beginning that fits when that fixes its [model] context tokens, any other larger request gets an error answer"},
    {"serve", "compute_missing", B, "false", 0, 0, NULL, "", "compress a document on demand when its cache is missing"},
    {"serve", "max_new_caches", I, "64", 0, 1 << 20, NULL, "caches", "most caches compute_missing adds in one server run, all clients together"},
    {"serve", "max_new_caches_per_key", I, "16", 0, 1 << 20, NULL, "caches", "most caches compute_missing adds in one server run for one CurveZMQ client key (when the front end uses keys)"},
    {"serve", "bind", S, "tcp://127.0.0.1:5555", 0, 0, NULL, "", "front end clients connect to (kvmill serve --bind overrides); non-local needs [security] keys"},
    {"serve", "backend", S, "", 0, 0, NULL, "", "tcp://HOST:PORT base decode workers connect to (ports PORT, PORT+1); empty = ipc:// in [run] run_dir"},
    {"serve", "request_timeout_s", I, "60", 1, 86400, NULL, "s", "a request not answered in this time gets an error answer"},
    {"serve", "max_queue", I, "256", 1, 1 << 20, NULL, "requests", "requests waiting for a free decode worker; more get a 'busy' error answer"},

    {"security", "server_secret_key", P, "", 0, 0, NULL, "", "CurveZMQ server secret key file (kvmill keygen); required for non-local binds"},
    {"security", "server_public_key", P, "", 0, 0, NULL, "", "CurveZMQ server public key file, given to clients and workers"},
    {"security", "client_secret_key", P, "", 0, 0, NULL, "", "CurveZMQ key pair of this client or worker (secret part)"},
    {"security", "client_public_key", P, "", 0, 0, NULL, "", "CurveZMQ key pair of this client or worker (public part)"},
    {"security", "authorized_keys", P, "", 0, 0, NULL, "", "folder of client public key files the server accepts"},
    {NULL, NULL, 0, NULL, 0, 0, NULL, NULL, NULL},
};
/* clang-format on */
