/* kvm_polykv.h: PolyKV (Fei & Kalnis, "PolyKV: Heterogeneous Retention and Allocation for
 * KV Cache Compression", arXiv 2606.15157): per-layer heterogeneous eviction strategies.
 * Calibration measures, per layer, phase and pattern, how well each eviction pattern
 * preserves the layer (cosine similarity of its attention output vs full KV; perplexity
 * sensitivity when only that layer is compressed) and how sensitive the layer is to budget
 * (attention entropy; worst-case perplexity change over patterns). A strategy turns these
 * into a pattern and a budget per layer and phase under a global budget L×B with floor
 * b_min. The strategy has a canonical, versioned byte encoding (for the store and the wire)
 * and a table print.
 * Beyond the paper: KVSculpt distillation ("sculpt", KVM_PATTERN_SCULPT) is one more choice in
 * the per-layer design space: calibration measures its signals like the eviction patterns'
 * (kvm_polykv_calibrate_sculpt), the builder may route any layer to it, and the strategy's
 * budget for such a layer is its entries per KV head (retain zone included). */
#ifndef KVM_POLYKV_H
#define KVM_POLYKV_H

#include "compress/eval/kvm_eval.h"
#include "compress/evict/kvm_evict.h"
#include "compress/sculpt/kvm_sculpt.h"

#include <stdio.h>

/* How the per-layer pattern is chosen. */
typedef enum kvm_polykv_select {
    KVM_POLYKV_SELECT_COSINE = 0, /* highest mean cosine similarity */
    KVM_POLYKV_SELECT_PPL = 1,    /* lowest perplexity sensitivity */
    KVM_POLYKV_SELECT_SINGLE = 2, /* one pattern everywhere (a baseline candidate) */
    KVM_POLYKV_SELECT_SEARCH = 3, /* refined by search on the calibration KL (kvm_polykv_refine) */
    KVM_POLYKV_SELECT_COUNT = 4,
} kvm_polykv_select;

/* How the global budget is split over layers. */
typedef enum kvm_polykv_alloc {
    KVM_POLYKV_ALLOC_UNIFORM = 0, /* B per layer */
    KVM_POLYKV_ALLOC_ENTROPY = 1, /* ∝ the layer's mean attention entropy */
    KVM_POLYKV_ALLOC_PPL = 2,     /* ∝ the layer's worst-case perplexity degradation */
    KVM_POLYKV_ALLOC_PYRAMID = 3, /* PyramidKV's linear schedule (1.5·B → 0.5·B) */
    KVM_POLYKV_ALLOC_SEARCH = 4,  /* refined by search on the calibration KL (kvm_polykv_refine) */
    KVM_POLYKV_ALLOC_COUNT = 5,
} kvm_polykv_alloc;

enum { KVM_POLYKV_PHASES = 2 }; /* index 0 = prefill, 1 = decode (kvm_phase) */

/* Bytes of a model id recorded in a strategy: the store's KVM_STORE_ID_BYTES (compress/ does not
 * depend on store/; the users that hold both check that they agree). */
enum { KVM_STRATEGY_MODEL_ID_BYTES = 32 };

/* One layer of a strategy. */
typedef struct kvm_strategy_layer {
    kvm_pattern pattern[KVM_POLYKV_PHASES]; /* pattern in prefill and in decode */
    int64_t budget;                         /* entries per KV head of this layer (both phases) */
} kvm_strategy_layer;

/* A strategy: plain value; layers owned (free with kvm_strategy_free). */
typedef struct kvm_strategy {
    int n_layers;               /* L */
    int64_t budget_avg;         /* B: the layers' budgets sum to exactly L·B */
    int64_t b_min;              /* floor of every layer's budget */
    kvm_polykv_select select;   /* how the patterns were chosen (informational) */
    kvm_polykv_alloc alloc;     /* how the budgets were split (informational) */
    double alloc_power;         /* signal exponent used by the allocation (informational, 1 = linear) */
    int head_split;             /* 0: every KV head of a layer gets the layer budget; 1: each layer's
                                   total is split over its KV heads ∝ their attention entropy on
                                   the document being compressed; 2: the global total L·H·B is split
                                   over all (layer, KV head) ∝ entropy (kvm_polykv_head_split) */
    kvm_strategy_layer *layers; /* [n_layers] */
    int sculpt_known;           /* 1: `sculpt` holds the KVSculpt options the sculpt and kvzip layers were
                                   calibrated with (set by the builder; read from a KVST v2 file); 0: not
                                   recorded (a version-1 file, a strategy made by hand) */
    kvm_sculpt_opts sculpt;     /* those options (kvm_sculpt_opts_canonical's settings; threads and
                                   device are the reader's own); kvzip layers use them in kvzip mode */
    int model_known;            /* 1: model_id names the model the strategy was calibrated on (a KVST v3
                                   file); 0: not recorded (a v1/v2 file, a store record: its key has it) */
    uint8_t model_id[KVM_STRATEGY_MODEL_ID_BYTES]; /* that model's id: BLAKE2b-256 of its checkpoint bytes,
                                   the store's model id (kvm_store_hash_file) */
} kvm_strategy;

/* Calibration signals over n_docs documents (means over documents and continuation steps).
 * Arrays indexed [phase][layer][pattern] = (φ·L + l)·P + r with P = KVM_PATTERN_COUNT. */
typedef struct kvm_polykv_signals {
    int n_layers;         /* L */
    int n_docs;           /* documents averaged */
    int64_t budget;       /* calibration budget B (PyramidKV: its layer's pyramid budget) */
    double *cosine;       /* [2][L][P] mean cosine(layer l's attention output under r, under full KV) */
    double *ppl_delta;    /* [2][L][P] mean ppl(only layer l uses r) − ppl(full KV) */
    double *kl;           /* [2][L][P] mean KL(full ‖ only layer l uses r), nats (diagnostic) */
    double *entropy;      /* [L] mean attention entropy of layer l over heads and context queries, nats */
    double *worst_ppl;    /* [2][L] max over patterns of ppl_delta */
    int prefill_only;     /* 1: decode-phase signals were not measured; they hold the prefill ones */
    int has_sculpt;       /* 1 when the sculpt signals below were measured */
    double *sculpt_cosine; /* [L] the same signals with layer l distilled by KVSculpt at B (prefill */
    double *sculpt_ppl;    /* [L] phase; in decode a sculpt layer appends unchanged, so the decode */
    double *sculpt_kl;     /* [L] phase's values are the same run) */
    int has_kvzip;         /* 1 when the kvzip signals below were measured */
    double *kvzip_cosine;  /* [L] the same signals with layer l compressed by KVzip scoring at B */
    double *kvzip_ppl;     /* [L] (KVM_PATTERN_KVZIP; prefill phase, as for sculpt) */
    double *kvzip_kl;      /* [L] */
    int sculpt_opts_known; /* 1: sculpt_opts holds the options the sculpt and kvzip signals were
                              measured with (set by kvm_polykv_calibrate_sculpt / _kvzip, read from
                              the CSV's "# sculpt_options=" line); 0: unknown (a CSV without it) */
    kvm_sculpt_opts sculpt_opts; /* those options (one set: a calibration measures both kinds with it) */
} kvm_polykv_signals;

/* Names: "cosine"/"ppl"/"single"/"search", "uniform"/"entropy"/"ppl"/"pyramid"/"search".
 * Never NULL ("?" when out of range). */
const char *kvm_polykv_select_name(kvm_polykv_select s);
const char *kvm_polykv_alloc_name(kvm_polykv_alloc a);
/* Parse the user-facing modes (`--select cosine|ppl`, `--alloc entropy|ppl|uniform`);
 * KVM_EINVAL with a message listing the valid names otherwise. */
int kvm_polykv_select_parse(const char *s, kvm_polykv_select *out);
int kvm_polykv_alloc_parse(const char *s, kvm_polykv_alloc *out);

/* Allocates zeroed signals for L layers. Returns 0, KVM_EINVAL, KVM_ENOMEM. */
int kvm_polykv_signals_new(int n_layers, kvm_polykv_signals **out);
void kvm_polykv_signals_free(kvm_polykv_signals **s); /* accepts NULL; sets *s = NULL */

/* Measures every signal at budget B on the prepared documents (kvm_eval_doc_new), adding
 * each document's values into s and dividing at the end (s->n_docs = n_docs). For each
 * (phase, layer, pattern): only layer l is compressed with pattern r (prefill phase: its
 * context cache cut to b; decode phase: cut and kept within b by r's decode policy while
 * the continuation is appended), every other layer keeps full KV; the continuation is run
 * and layer l's attention output at each step is compared to the full-KV run (cosine of the
 * concatenated head outputs, averaged over steps), together with the continuation
 * perplexity and KL. Returns 0, KVM_EINVAL (B < 1, no documents), KVM_ENOMEM, forward
 * errors. */
int kvm_polykv_calibrate(kvm_eval_doc *const *docs, int n_docs, int64_t B, kvm_polykv_signals *s);

/* How the decode-phase signals are measured. */
typedef enum kvm_polykv_decode {
    KVM_POLYKV_DECODE_NONE = 0,     /* not at all: the prefill phase's values are copied */
    /* Replayed (the default): with only layer l compressed, the layers below it run on full
     * KV, so layer l's queries, keys and values at each continuation step are the full-KV
     * run's; the decode policy's evolution of layer l is replayed from them (one attention
     * call per step, kvm_forward_attend), then one batched continuation with those outputs
     * substituted at layer l gives the perplexity and KL. Equal to STEPWISE up to float
     * rounding (batched vs one-token GEMMs below layer l), at the cost of a prefill-phase run. */
    KVM_POLYKV_DECODE_BATCHED = 1,
    KVM_POLYKV_DECODE_STEPWISE = 2, /* the whole model one token at a time (the reference) */
} kvm_polykv_decode;

/* The same with a decode-phase mode (kvm_polykv_decode): KVM_POLYKV_DECODE_NONE measures only
 * the prefill phase (its values are copied to the decode phase, so strategies use each
 * layer's prefill pattern in decode too, and s->prefill_only = 1); BATCHED (what
 * kvm_polykv_calibrate uses) and STEPWISE measure both. Also KVM_EINVAL for another mode. */
int kvm_polykv_calibrate_phases(kvm_eval_doc *const *docs, int n_docs, int64_t B, int decode, kvm_polykv_signals *s);

/* One calibration run on document d: only `layer` compressed with eviction pattern r at budget
 * b in `phase` (prefill, or decode with mode KVM_POLYKV_DECODE_BATCHED or _STEPWISE), its
 * cosine, perplexity delta and KL as kvm_polykv_calibrate_phases measures them (including the
 * full-KV reference continuation it compares with, run here each call). For benchmarks
 * (bench/bench_polykv_decode.c) and tests. Returns 0, KVM_EINVAL (phase, layer, pattern,
 * budget or mode out of range), KVM_ENOMEM, forward errors. */
int kvm_polykv_signal_run(kvm_eval_doc *d, int phase, int layer, kvm_pattern r, int64_t b, int decode, double *cos,
                          double *ppl, double *kl);

/* The sculpt signals (our extension of PolyKV's design space): per document, every layer is
 * distilled by KVSculpt at budget B (kvm_sculpt_compress_layers with options o: retain zone
 * min(o->retain_tokens, B/2), the rest distilled), then for each layer l only that layer's
 * distilled heads replace the full cache's and the continuation is run, measuring cosine,
 * perplexity delta and KL as kvm_polykv_calibrate does for eviction patterns. Averages over
 * the documents into s->sculpt_* and sets s->has_sculpt; *o goes to s->sculpt_opts
 * (sculpt_opts_known = 1). Returns 0, KVM_EINVAL (B < 1, no
 * documents, layer count), KVM_ENOMEM, sculpt or forward errors. */
int kvm_polykv_calibrate_sculpt(kvm_eval_doc *const *docs, int n_docs, int64_t B, const kvm_sculpt_opts *o,
                                kvm_polykv_signals *s);

/* The kvzip signals: the same as kvm_polykv_calibrate_sculpt with o->mode forced to
 * KVM_SCULPT_KVZIP (KVzip-style scoring, arXiv 2505.23416, compress/sculpt/sculpt_kvzip.c; o's
 * query_source gives the reconstruction queries), into s->kvzip_* and s->has_kvzip. Same
 * errors. */
int kvm_polykv_calibrate_kvzip(kvm_eval_doc *const *docs, int n_docs, int64_t B, const kvm_sculpt_opts *o,
                               kvm_polykv_signals *s);

/* Writes every signal as CSV: header
 * "phase,layer,pattern,budget,cosine,ppl_delta,kl,entropy,worst_ppl" (sculpt and kvzip rows too
 * when measured; worst_ppl is over the eviction patterns). With sculpt or kvzip rows whose
 * options are known, a first line "# sculpt_options=TEXT" (TEXT: kvm_sculpt_opts_canonical of
 * s->sculpt_opts) comes before the header, so that a later --signals run can tell whether they
 * were measured with its options. Returns 0 or KVM_EIO. */
int kvm_polykv_signals_csv(const kvm_polykv_signals *s, FILE *f);

/* Reads such a CSV back into s (allocated for the model's L layers by kvm_polykv_signals_new),
 * so that a calibration reuses an earlier run's signals: every eviction row of the prefill
 * phase, of the decode phase all or none (none: s->prefill_only = 1 and the prefill values are
 * copied, as kvm_polykv_calibrate_phases does), the sculpt and kvzip rows all or none each
 * (has_sculpt, has_kvzip); one budget (s->budget) and PyramidKV rows at its schedule's; per
 * layer one entropy and per phase one worst_ppl; an optional first line "# sculpt_options=TEXT"
 * (kvm_sculpt_opts_from_canonical) sets s->sculpt_opts and s->sculpt_opts_known (a file without
 * it, written before it existed, leaves sculpt_opts_known = 0: its sculpt and kvzip rows are of
 * unknown options). Values are the file's (%.9g, so within 1e-9
 * relative of the run's); s->n_docs = 0 (the file does not say which documents it averaged: the
 * caller vouches for them). Errors: KVM_ENOTFOUND, KVM_EIO, KVM_EFORMAT naming the file and line
 * (header, options line, field count, phase, layer ≥ L, pattern, non-finite number, a value outside
 * its column's range within 1e-6 of rounding: cosine in [−1, 1], kl ≥ 0, entropy ≥ 0 — ppl_delta
 * and worst_ppl, perplexity differences, take either sign —, duplicate or missing row, budgets),
 * KVM_ENOMEM. */
int kvm_polykv_signals_read(const char *path, kvm_polykv_signals *s);
/* The same from an open stream f (read to its end, not closed; a file's bytes in memory through
 * fmemopen), `path` labelling the messages. Errors as kvm_polykv_signals_read's but KVM_ENOTFOUND. */
int kvm_polykv_signals_read_stream(FILE *f, const char *path, kvm_polykv_signals *s);

/* Builds a strategy from signals: per (layer, phase) the pattern with the best preference
 * score (select COSINE: highest cosine; PPL: lowest ppl_delta; ties to the earlier pattern;
 * PyramidKV is not a per-layer choice since its selection is SnapKV's and its budgets are
 * the strategy's; sculpt and kvzip are choices when s->has_sculpt / s->has_kvzip, decided on
 * the prefill signals, and such a layer is sculpt / kvzip in both phases; SINGLE: `single`
 * everywhere, sculpt and kvzip included), and budgets by alloc with weights
 * signal^power: ENTROPY the layer entropy, PPL the prefill worst_ppl (clamped to ≥ 1e-6),
 * UNIFORM equal, PYRAMID the PyramidKV schedule; each ≥ b_min, summing to exactly L·B
 * (kvm_evict_apportion). No ceiling: a layer may get more than a context holds (see _capped).
 * Deterministic. *out owned by the caller. Returns 0, KVM_EINVAL (B < 1, b_min < 1,
 * b_min·L > L·B, bad mode), KVM_ENOMEM. */
int kvm_polykv_strategy_build(const kvm_polykv_signals *s, kvm_polykv_select sel, kvm_pattern single,
                              kvm_polykv_alloc alloc, double power, int64_t B, int64_t b_min, kvm_strategy **out);

/* The same for a context of n_ctx tokens (n_ctx ≤ 0: no ceiling, kvm_polykv_strategy_build):
 * each layer's budget is also ≤ n_ctx, what the layer's KV heads can keep (eviction keeps a
 * head of n ≤ b entries whole: a budget above n_ctx bought nothing, and the strategy held fewer
 * entries than L·B, so candidates were compared at unequal sizes), shares above it pinned there
 * and the rest re-split over the other layers by the same weights (kvm_evict_apportion_capped,
 * water-filling); the budgets still sum to exactly L·B. What kvm_polykv_build_best uses, with its
 * documents' context. Also KVM_EINVAL for B > n_ctx (L·B cannot fit). */
int kvm_polykv_strategy_build_capped(const kvm_polykv_signals *s, kvm_polykv_select sel, kvm_pattern single,
                                     kvm_polykv_alloc alloc, double power, int64_t B, int64_t b_min, int64_t n_ctx,
                                     kvm_strategy **out);

/* Allocates a strategy of L layers (zeroed layers). Returns 0, KVM_EINVAL, KVM_ENOMEM. */
int kvm_strategy_new(int n_layers, kvm_strategy **out);
void kvm_strategy_free(kvm_strategy **s); /* accepts NULL; sets *s = NULL */
/* Deep copy. Returns 0, KVM_EINVAL (bad layer count), KVM_ENOMEM. */
int kvm_strategy_clone(const kvm_strategy *s, kvm_strategy **out);

/* The number of layers of s whose pattern is sculpt or kvzip (the layers its sculpt options
 * apply to). */
int kvm_strategy_distilled(const kvm_strategy *s);

/* Per-layer budgets of s rescaled proportionally to average B (sum exactly L·B, each ≥ 1,
 * kvm_evict_apportion); B == s->budget_avg gives s's budgets. No ceiling (see _capped).
 * out[n_layers]. Returns 0, KVM_EINVAL (B < 1), KVM_ENOMEM. */
int kvm_strategy_rescale(const kvm_strategy *s, int64_t B, int64_t *out);

/* The same for a context of n_ctx tokens (n_ctx ≤ 0: no ceiling): each layer also ≤ n_ctx (what
 * eviction can keep of it), the excess re-split over the other layers in proportion to s's
 * budgets (kvm_evict_apportion_capped); the sum is exactly min(L·B, L·n_ctx). B == s->budget_avg
 * still gives s's budgets when none of them exceeds n_ctx (a strategy built for this context,
 * kvm_polykv_strategy_build_capped). out[n_layers]. Returns 0, KVM_EINVAL (B < 1), KVM_ENOMEM. */
int kvm_strategy_rescale_capped(const kvm_strategy *s, int64_t B, int64_t n_ctx, int64_t *out);

/* An eviction plan for phase φ (0 prefill, 1 decode) of s at average budget B for a model
 * with n_kv_heads KV heads per layer (every KV head of a layer gets the layer's pattern and
 * budget; sculpt layers get KVM_PATTERN_NONE with their budget, for the caller to distil).
 * Budgets by kvm_strategy_rescale, without a ceiling: a caller that knows the context uses
 * kvm_strategy_plan_capped. Free with kvm_evict_plan_free. Returns 0, KVM_EINVAL, KVM_ENOMEM. */
int kvm_strategy_plan(const kvm_strategy *s, int phase, int64_t B, int n_kv_heads, kvm_evict_plan **out);

/* The same for a context of n_ctx tokens (the compress input's n_tokens; ≤ 0: no ceiling): the
 * layer budgets by kvm_strategy_rescale_capped, each ≤ n_ctx with the excess given to the other
 * layers, so that the plan holds the L·B entries asked for (a layer rescaled above the context
 * kept only n_ctx: an eval at budget B compared the strategy at fewer entries than the methods
 * beside it). Same errors. */
int kvm_strategy_plan_capped(const kvm_strategy *s, int phase, int64_t B, int64_t n_ctx, int n_kv_heads,
                             kvm_evict_plan **out);

/* Document-adaptive budgets (our extension of PolyKV's entropy allocation to KV heads and
 * to the document at hand): mode 1 splits each layer's total budget (Σ over its KV heads of
 * plan->budget) over its KV heads, mode 2 splits the plan's grand total over every
 * (layer, KV head), in proportion to each head's mean attention entropy on this document
 * (the capture's entropy [n_heads][N], averaged over the GQA group's query heads and all N
 * queries), each ≥ 1 entry (kvm_evict_apportion): diffuse heads get more entries, peaked
 * heads fewer, at the same memory. Returns 0, KVM_EINVAL (bad mode, capture without
 * statistics), KVM_ENOMEM. */
int kvm_polykv_head_split(const kvm_model_config *c, const kvm_capture *cap, int mode, kvm_evict_plan *plan);

/* Canonical encoding, little-endian (deterministic: equal strategies give equal bytes).
 * Without a model id (model_known = 0): version 1 (every strategy without sculpt or kvzip layers,
 * and one with them whose options are not known, sculpt_known = 0) and version 2 (a strategy with
 * sculpt or kvzip layers and sculpt_known = 1; issue 14: the file carries what the calibration
 * scored them with). With one (model_known = 1): version 3, the same with the model's id, so that
 * a strategy file is not used on another model with the same layer count (issue 15):
 *   0  "KVST"  magic (4 bytes)          4  u16 version (1, 2, 3)  6  u16 L (≥ 1)
 *   8  u32 B (≥ 1)                      12 u32 b_min (≤ B)      16 u8 select  17 u8 alloc
 *   18 u8 head_split (0..2)  19 u8 reserved = 0                 20 u32 round(alloc_power·1000)
 *   24 + 8·l: u8 prefill pattern, u8 decode pattern (kvm_pattern: eviction 0-4, or sculpt = 5 or
 *             kvzip = 6 in both), u16 reserved = 0, u32 budget
 * version 2 only:
 *   24 + 8·L: u32 n (1 .. KVM_SCULPT_OPTS_CANONICAL_MAX − 1)
 *   28 + 8·L: n bytes of ASCII, kvm_sculpt_opts_canonical of `sculpt` ("method=sculpt,retain=32,
 *             queries=2048,query_source=repeat,...", no NUL)
 * version 3 only:
 *   24 + 8·L: the model id (KVM_STRATEGY_MODEL_ID_BYTES raw bytes)
 *   56 + 8·L: u32 n: 0 where version 2's part would be absent (options unknown, or no sculpt or
 *             kvzip layer), else as version 2 (1 .. KVM_SCULPT_OPTS_CANONICAL_MAX − 1)
 *   60 + 8·L: n bytes of options text, as version 2
 * Total 24 + 8·L bytes (v1), 28 + 8·L + n (v2), 60 + 8·L + n (v3). Eviction-only strategies
 * without a model id keep their v1 bytes, so their hashes (and the config ids of their caches)
 * are unchanged; the store's records are written without the id (their key holds it). *buf
 * malloc'ed, owned by the caller. Returns 0, KVM_EINVAL (a field out of range), KVM_ENOMEM. */
int kvm_strategy_encode(const kvm_strategy *s, uint8_t **buf, size_t *len);

/* Decodes and validates everything (magic, version, size, ranges, patterns, reserved bytes,
 * each budget ≥ max(1, b_min), budgets summing to L·B; version 2: at least one sculpt or kvzip
 * layer, the options' length, and their text by kvm_sculpt_opts_from_canonical; version 3: the
 * same for its options when n > 0, n = 0 or a sculpt or kvzip layer); bad input is KVM_EFORMAT
 * with a message naming the field and offset, never a crash. A strategy without options
 * (version 1, version 3 with n = 0) gets sculpt_known = 0 and default options; version 3 sets
 * model_known = 1 and model_id. *out owned by the caller. Also KVM_ENOMEM. */
int kvm_strategy_decode(const uint8_t *buf, size_t len, kvm_strategy **out);

/* The version kvm_strategy_encode writes s as: 3 with a model id, else 2 when the options of its
 * sculpt or kvzip layers are known (they matter), else 1. */
int kvm_strategy_version(const kvm_strategy *s);

/* Reads / writes a strategy file (its canonical encoding: version 3 when s->model_known). Errors:
 * KVM_ENOTFOUND, KVM_EIO, KVM_EFORMAT (message names the file), KVM_ENOMEM; writing, KVM_EINVAL
 * for a FIFO that no process is reading (kvm_file_open_output: refused rather than waited for). */
int kvm_strategy_read(const char *path, kvm_strategy **out);
int kvm_strategy_write(const kvm_strategy *s, const char *path);

/* Records model_id (KVM_STRATEGY_MODEL_ID_BYTES bytes: the store's model id of the model s was
 * calibrated on, kvm_store_hash_file) in s, so that kvm_strategy_write writes version 3. */
void kvm_strategy_set_model(kvm_strategy *s, const uint8_t *model_id);

/* Checks that strategy s, read from `file` (named in messages), may be used on the model `model`
 * (its path, for messages) whose id is model_id (KVM_STRATEGY_MODEL_ID_BYTES bytes; may be NULL
 * when s->model_known = 0, since it is then not compared). A strategy without a recorded id (a
 * v1/v2 file) passes, with one stderr note per file (kvm_log warning; not repeated for the same
 * file) that it cannot be checked against the model. Returns 0, or KVM_EMISMATCH when the
 * recorded id differs, the message naming the file, the recorded id and the model with its id. */
int kvm_strategy_check_model(const kvm_strategy *s, const char *file, const uint8_t *model_id, const char *model);

/* Writes s's canonical encoding to the open stream f (an output the caller opened before its
 * work, so that a path that cannot be written is refused before it); `name` labels the messages.
 * Returns 0, KVM_EIO (a short write), KVM_ENOMEM. f stays open. */
int kvm_strategy_write_stream(const kvm_strategy *s, FILE *f, const char *name);

/* Prints the strategy as a table: one row per layer with both phases' patterns and the budget,
 * after the model id when one is recorded. */
void kvm_strategy_print(const kvm_strategy *s, FILE *f);

/* Mean KL(full ‖ compressed) of strategy s (prefill phase, at its own average budget) over
 * the documents; per_doc[n_docs] (may be NULL) receives each document's mean KL. Returns 0
 * or the run's status. */
int kvm_polykv_score(kvm_eval_doc *const *docs, int n_docs, const kvm_strategy *s, double *per_doc, double *kl_mean);

/* The KVSculpt options that kvm_polykv_score (and so the builder and refine) use for sculpt
 * layers, process-wide; NULL restores the defaults. Not thread-safe: set it before building. */
void kvm_polykv_score_sculpt_opts(const kvm_sculpt_opts *o);

/* When dir is not NULL, kvm_polykv_build_best also writes every candidate it scores to
 * dir/NAME.bin (NAME: the candidate's table name, e.g. "cosine/ppl+heads", with '/', '+' and
 * '^' as '_'), so that held-out evaluations can compare candidates; the directory must exist.
 * model_id (KVM_STRATEGY_MODEL_ID_BYTES bytes, copied; may be NULL) is the calibrated model's,
 * recorded in every such file (KVST v3). An existing file of that name that is read-only (no write
 * permission or no write bit set: root may write any file) or not a regular file is not replaced:
 * the build fails with KVM_EINVAL naming it. Process-wide, dir borrowed until reset with NULL; not
 * thread-safe: set it before building. */
void kvm_polykv_build_dump_dir(const char *dir, const uint8_t *model_id);

/* The file name ("NAME.bin", e.g. "cosine_ppl_heads.bin") of the i-th candidate (from 0) that
 * kvm_polykv_build_best scores, and so writes under kvm_polykv_build_dump_dir, with these filters
 * (sel_only, alloc_only: as kvm_polykv_build_best's; has_sculpt, has_kvzip: the signals' flags),
 * into buf[n] (64 bytes hold every name): what a command checks before any work, so that an
 * output or a read-only file of the same name is refused then, not lost or failing after. Returns
 * 1, or 0 (buf untouched) when i is past the last candidate. No errors. */
int kvm_polykv_candidate_file(int i, int sel_only, int alloc_only, int has_sculpt, int has_kvzip, char *buf, size_t n);

/* The builder: scores every candidate on the calibration documents and returns the best
 * (lowest mean KL; ties keep the earlier candidate) in *out (caller owns). Each candidate's layer
 * budgets are capped at the documents' context N (kvm_polykv_strategy_build_capped: all
 * documents share one N; B ≤ N). Candidates:
 * every heterogeneous strategy (select cosine|ppl × alloc uniform|entropy|ppl) and every
 * single pattern under every allocation mode (uniform, entropy, ppl; PyramidKV under its
 * own schedule; sculpt and kvzip too when sig->has_sculpt / has_kvzip), each with head_split 0 (equal KV heads) and 1
 * (entropy within layers), and with uniform allocation also head_split 2 (entropy over all heads). sel_only /
 * alloc_only (≥ 0) restrict the candidates to one mode; −1 for all. The lowest mean KL wins, except that a
 * heterogeneous winner must beat the best single-pattern candidate beyond noise (kvm_polykv_mix_significant; else that
 * single pattern is kept: calibration on a few documents is noisy and a mix that only ties does not generalise).
 * refine_rounds > 0 then refines the best with kvm_polykv_refine (kept only if better on the calibration documents; it
 * tends to overfit a few documents, so it is off by default in the CLI). Every candidate (the result and those written
 * by kvm_polykv_build_dump_dir) records the options its sculpt and kvzip layers were scored with
 * (kvm_polykv_score_sculpt_opts, or the defaults: sculpt_known = 1), so that its file is read with them. Prints one
 * line per candidate to `table` (may be NULL). Returns 0, KVM_EINVAL (bad budget, b_min, or no candidate left),
 * KVM_ENOMEM, run errors. */
int kvm_polykv_build_best(kvm_eval_doc *const *docs, int n_docs, const kvm_polykv_signals *sig, int64_t B,
                          int64_t b_min, int sel_only, int alloc_only, int refine_rounds, FILE *table,
                          kvm_strategy **out);

/* kvm_polykv_build_best over calibration windows grouped into documents: doc_of[n_docs] (may be
 * NULL: each window its own document, kvm_polykv_build_best) gives each window's document, 0 ..
 * D − 1, every one of them with at least one window. Candidates are scored and ranked on the mean
 * KL over all windows as before, but the noise rule's paired t-test (kvm_polykv_mix_significant)
 * runs over the D documents, each the mean of its windows' KLs: windows of one document share its
 * text (overlapping ones its very tokens) and are not independent samples, so 64 windows of one
 * short document counted as 64 documents gave t = 16.5 where the evidence is one document (D = 1:
 * never significant). The table line says what n counts when D < n_docs. The caller drops
 * windows that repeat another of the same document (the same tokens), which would otherwise weigh
 * that text more in the means. Errors: as kvm_polykv_build_best's, and KVM_EINVAL for n_docs < 1
 * or a doc_of that is negative or skips a document. */
int kvm_polykv_build_best_grouped(kvm_eval_doc *const *docs, int n_docs, const int *doc_of,
                                  const kvm_polykv_signals *sig, int64_t B, int64_t b_min, int sel_only, int alloc_only,
                                  int refine_rounds, FILE *table, kvm_strategy **out);

/* The builder's noise rule: 1 when the heterogeneous mix's per-document calibration KLs
 * mix_kl[n] beat the best single pattern's single_kl[n] by a one-sided paired t-test at level
 * 0.10, t = mean(single − mix) / its standard error ≥ kvm_polykv_t_crit(n − 1), written to *t
 * (+inf when every difference is equal and positive, 0 when n < 2 or all are 0); 0 otherwise
 * and always for n < 2. A critical value that follows the document count replaces issue 4's
 * fixed t ≥ 2 (one-sided p ≈ 0.06 at 5 documents, 0.03 at 20): on SmolLM2 it set aside, at
 * t = 1.94 over 5 documents, a mix that was 5.5% better on 15 held-out documents
 * (bench/RESULTS.md, "PolyKV on SmolLM2, part 4"). */
int kvm_polykv_mix_significant(const double *single_kl, const double *mix_kl, int n, double *t);

/* The 90th percentile of Student's t with nu ≥ 1 degrees of freedom (+inf for nu < 1), the
 * critical value of the one-sided test at level 0.10 (the only level the builder uses): exact to
 * 6 decimals for nu ≤ 30 (3.077684 at 1, 1.885618 at 2, 1.310415 at 30), beyond by the
 * Cornish–Fisher expansion around the normal quantile (Abramowitz & Stegun 26.7.5, three terms;
 * within 1e-7 there), → 1.2816. */
double kvm_polykv_t_crit(int nu);

/* Refines strategy s by coordinate descent on the mean calibration KL (kvm_polykv_score):
 * each round tries moving delta entries of budget between every ordered pair of layers
 * (keeping each ≥ s->b_min and ≤ the documents' context N, and the sum L·B) and every pattern (not PyramidKV) at every
 * layer (both phases), and applies the single best move if it lowers the KL; delta starts
 * at max(1, B/4) and halves when no move helps, down to max(1, B/16); at most max_rounds
 * rounds. Deterministic (ties keep the earlier move). *out (caller owns) is marked select =
 * alloc = SEARCH; *kl_out its score. Prints one line per applied move to log (may be NULL).
 * Returns 0, KVM_ENOMEM, run errors. */
int kvm_polykv_refine(kvm_eval_doc *const *docs, int n_docs, const kvm_strategy *s, int max_rounds, FILE *log,
                      kvm_strategy **out, double *kl_out);

/* The "polykv:FILE[:SCULPT-OPTIONS]" method's pieces (rows of compress/eval/kvm_methods.c):
 * options are the strategy read from FILE plus the requested budget; the strategy's per-layer
 * budgets are rescaled to the requested average B (b = r·N for --ratio). Sculpt layers are
 * distilled by kvm_sculpt_compress_layers (kvzip layers scored) with the options the file
 * records (KVST v2: the calibration's; a version-1 file: the KVSculpt defaults, said on stderr
 * once) changed field by field by the optional "name=value:name=value" list after the file
 * (kvm_sculpt_opts_set names, e.g. "polykv:s.bin:threads=2:alloc=head" — with alloc ≠ uniform
 * the sculpt layers' budgets are redistributed by the pilot MSE^p rule); a listed setting that
 * changes a recorded one is said on stderr once. The option list starts at the first ':'
 * followed by a setting name and '='. */
int kvm_polykv_method_opts_new(const char *arg, const kvm_budget *budget, const kvm_model_config *c, void **opts);
void kvm_polykv_method_opts_free(void *opts);
int kvm_polykv_method_compress(const kvm_compress_input *in, const void *opts, kvm_kvcache **out);
int kvm_polykv_method_decode_new(const kvm_compress_input *in, const void *opts, const kvm_kvcache *compressed,
                                 kvm_decode_policy **out);

/* The KVSculpt options a reader runs strategy s's sculpt and kvzip layers with, when the reader
 * has options of its own (`own`: the pipeline's [compress] settings, named own_name in the
 * message, e.g. "the [compress] settings of run.ini"): s's recorded options when it has them
 * (KVST v2), with own's threads and device (the reader's machine); own for a version-1 strategy,
 * and own's for one without distilled layers. One stderr line (kvm_log, once per distinct
 * message) says when a version-1 strategy's distilled layers take own, or which of own's settings
 * differ from the recorded ones and are not used. No errors. */
void kvm_polykv_strategy_sculpt_opts(const kvm_strategy *s, const kvm_sculpt_opts *own, const char *own_name,
                                     kvm_sculpt_opts *out);

/* Checks the strategy that kvm_polykv_method_opts_new read against the model it will run on
 * (kvm_strategy_check_model, naming the file): model_id (KVM_STRATEGY_MODEL_ID_BYTES bytes) may be
 * NULL when kvm_polykv_method_needs_model_id(opts) is 0. Returns 0 or KVM_EMISMATCH. */
int kvm_polykv_method_check_model(const void *opts, const uint8_t *model_id, const char *model);
/* 1 when the strategy of opts (from kvm_polykv_method_opts_new) records a model id to compare,
 * so that the caller computes the model's (hashing a checkpoint costs seconds per GB). */
int kvm_polykv_method_needs_model_id(const void *opts);

/* The same method over a strategy in memory (borrowed; must outlive the opts): what the
 * builder uses to evaluate candidates. */
int kvm_polykv_method_opts_from(const kvm_strategy *s, const kvm_budget *budget, void **opts);

/* The KVSculpt options the method's sculpt layers use (copied). */
void kvm_polykv_method_set_sculpt(void *opts, const kvm_sculpt_opts *o);

/* Between _begin and _end, distilled sculpt layers made by the method (with uniform sculpt
 * allocation) are remembered per (compress input, layer, budget) and reused, since such a
 * layer does not depend on the other layers: the builder scores dozens of strategies on the
 * same documents. The inputs must stay alive and unchanged until _end, which frees the
 * memo. Process-wide, not thread-safe; kvm_polykv_build_best brackets itself. */
void kvm_polykv_memo_begin(void);
void kvm_polykv_memo_end(void);

#endif
