/* kvm_evict.h: token-eviction patterns over the ragged KV cache, usable per layer and per
 * KV head in two phases: prefill (one-shot: a context's cache cut to budget b) and decode
 * (the cache kept within b while tokens are appended, through the forward's hooks).
 * Every kept entry counts against the budget (sinks, windows, recent tokens included).
 * Top-k selections break exact score ties toward the earlier position, so results are
 * deterministic. */
#ifndef KVM_EVICT_H
#define KVM_EVICT_H

#include "compress/kvm_compress.h"

#include <stdint.h>

typedef enum kvm_pattern {
    /* StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
     * Sinks", arXiv 2309.17453, §3.2): the first `sinks` tokens + the most recent ones. */
    KVM_PATTERN_STREAMING = 0,
    /* H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
     * Large Language Models", arXiv 2306.14048, §3 / Alg. 1): heavy hitters by attention
     * accumulated over all queries (prefill: column sums of the causal attention) + the
     * most recent tokens (recent_frac of the budget, default half). */
    KVM_PATTERN_H2O = 1,
    /* TOVA (Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104, §4): drop
     * the entry with the lowest attention from the current query, averaged over the query
     * heads sharing the KV head; prefill: the top-b by the last context query. */
    KVM_PATTERN_TOVA = 2,
    /* SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
     * arXiv 2404.14469, §4.2, Alg. 1): votes of the last `window` queries on the earlier keys,
     * 1-D max pooling (kernel `pool`), top-(b − window) plus the window. */
    KVM_PATTERN_SNAPKV = 3,
    /* PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
     * Information Funneling", arXiv 2406.02069, §3): SnapKV selection with per-layer budgets
     * decreasing linearly from 1.5·B (first layer) to 0.5·B (last), sum L·B
     * (kvm_evict_pyramid_budgets). */
    KVM_PATTERN_PYRAMIDKV = 4,
    KVM_PATTERN_COUNT = 5, /* the eviction patterns above */
    /* Not an eviction pattern: in a PolyKV strategy, a layer whose compress zone is distilled
     * by KVSculpt (compress/sculpt/, kvm_sculpt_compress_layers) at the layer's budget; in
     * the decode phase such a layer appends new tokens unchanged. The eviction functions
     * reject it. */
    KVM_PATTERN_SCULPT = 5,
    /* Not an eviction pattern either: in a PolyKV strategy, a layer compressed by KVzip-style
     * scoring (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
     * Reconstruction", arXiv 2505.23416: each entry's largest attention from the
     * reconstruction queries, top entries kept unchanged; compress/sculpt/sculpt_kvzip.c,
     * kvm_sculpt_compress_layers with mode KVM_SCULPT_KVZIP) at the layer's budget; in decode
     * it appends unchanged, as sculpt does. */
    KVM_PATTERN_KVZIP = 6,
    KVM_PATTERN_STRATEGY_COUNT = 7, /* patterns a strategy layer may use */
    KVM_PATTERN_NONE = 255, /* in a plan: leave the head as it is */
} kvm_pattern;

/* 1 for the strategy patterns whose layers a solver fills once from the context (sculpt,
 * kvzip): the eviction plans leave them to the caller and their decode phase appends
 * unchanged. */
static inline int kvm_pattern_is_distilled(kvm_pattern p) { return p == KVM_PATTERN_SCULPT || p == KVM_PATTERN_KVZIP; }

/* Pattern parameters (the papers' defaults from kvm_evict_params_default). */
typedef struct kvm_evict_params {
    int64_t sinks;        /* StreamingLLM attention sinks, tokens (4) */
    double recent_frac;   /* H2O: share of the budget for recent tokens (0.5) */
    int64_t window;       /* SnapKV/PyramidKV observation window, queries (16) */
    int64_t pool;         /* SnapKV/PyramidKV max-pooling kernel, tokens, odd (7) */
} kvm_evict_params;

/* The defaults above. */
kvm_evict_params kvm_evict_params_default(void);

/* "streaming", "h2o", "tova", "snapkv", "pyramidkv", "sculpt", "kvzip" (or "none"/"?"). Never NULL. */
const char *kvm_pattern_name(kvm_pattern p);

/* Parses an eviction pattern name (exact, lower case; not "sculpt"). Returns 0, or KVM_EINVAL
 * with a message listing the valid names. */
int kvm_pattern_parse(const char *s, kvm_pattern *out);

/* Attention statistics of one KV head over a context of n tokens at positions [0, n), as
 * the selection functions read them. Tests build these by hand; kvm_evict_attn_from_capture
 * computes them from a capture. */
typedef struct kvm_evict_attn {
    int64_t n;            /* context tokens = entries (positions 0..n-1) */
    int n_group;          /* query heads sharing this KV head (GQA group), ≥ 1 */
    int64_t n_obs;        /* observation rows: the last n_obs queries (positions n-n_obs..n-1) */
    const float *obs;     /* [n_group][n_obs][n] causal attention probabilities of those queries */
    const float *mass;    /* [n_group][n] attention each key received, summed over all n queries
                             (H2O's accumulated attention), or NULL when H2O is not used */
} kvm_evict_attn;

/* Selects the entries pattern p keeps within budget b for one KV head (prefill phase).
 * Writes the kept positions, increasing, to keep[0..*n_keep) (keep holds ≥ min(b, n)).
 * b ≥ n keeps everything. PyramidKV here is SnapKV's selection at budget b (the caller
 * passes the layer's pyramid budget). Needs a->obs rows: TOVA the last 1, SnapKV/PyramidKV
 * the last min(window, n) (fewer rows than that is KVM_EINVAL); H2O needs a->mass.
 * Returns 0, KVM_EINVAL (b < 1, unknown pattern, missing inputs). Thread-safe. */
int kvm_evict_select(kvm_pattern p, const kvm_evict_params *prm, const kvm_evict_attn *a, int64_t b,
                     int64_t *keep, int64_t *n_keep);

/* Top-k of score[0..n) (k ≤ n): marks the k largest in mark[0..n) (1 kept, 0 not); among
 * equal scores the earlier index wins. Returns 0 or KVM_ENOMEM. */
int kvm_evict_topk(const float *score, int64_t n, int64_t k, uint8_t *mark);

/* PyramidKV's per-layer budgets for average budget B over n_layers: b_l from 1.5·B at l = 0
 * down linearly to 0.5·B at l = L−1 (L = 1: B), rounded by largest remainder so that they sum
 * to exactly L·B, each ≥ 1. out[n_layers]. Returns 0 or KVM_EINVAL (B < 1, L < 1). */
int kvm_evict_pyramid_budgets(int64_t B, int n_layers, int64_t *out);

/* Splits total entries over n parts in proportion to weights w[n] (non-positive or
 * non-finite weights count 0; all zero = equal shares), each part ≥ floor_v: shares that
 * would fall below the floor are pinned to it and the rest re-split (water-filling), then
 * rounded by largest remainder (ties to the earlier part), so out[] sums to exactly total.
 * Deterministic. Returns 0, KVM_EINVAL (n < 1, n·floor_v > total), KVM_ENOMEM. */
int kvm_evict_apportion(const double *w, int n, int64_t total, int64_t floor_v, int64_t *out);

/* kvm_evict_apportion with a ceiling too: each part also ≤ ceil_v (a KV head keeps at most the
 * context's tokens: a share above that was lost, not given to another head), shares above it
 * pinned at it and the rest re-split with the floor's water-filling; out[] sums to exactly
 * min(total, n·ceil_v). ceil_v ≤ 0: no ceiling (kvm_evict_apportion). Errors: as
 * kvm_evict_apportion, and KVM_EINVAL for 0 < ceil_v < floor_v. */
int kvm_evict_apportion_capped(const double *w, int n, int64_t total, int64_t floor_v, int64_t ceil_v, int64_t *out);

/* Which pattern and budget each (layer, KV head) gets, in one phase. */
typedef struct kvm_evict_plan {
    int n_layers, n_kv_heads;   /* shape */
    kvm_pattern *pattern;       /* [n_layers][n_kv_heads], KVM_PATTERN_NONE = untouched */
    int64_t *budget;            /* [n_layers][n_kv_heads] entries kept, ≥ 1 */
    kvm_evict_params params;    /* pattern parameters */
} kvm_evict_plan;

/* Allocates a plan of shape (L, H) with every head on pattern p at budget b (PyramidKV:
 * per-layer pyramid budgets of average b). Free with kvm_evict_plan_free. Returns 0,
 * KVM_EINVAL (bad shape, b < 1), KVM_ENOMEM. */
int kvm_evict_plan_new(int n_layers, int n_kv_heads, kvm_pattern p, int64_t b, kvm_evict_plan **out);

/* Frees. Accepts NULL and *p == NULL; sets *p = NULL. */
void kvm_evict_plan_free(kvm_evict_plan **p);

/* Fills a (a kvm_evict_attn) for (layer, kv_head) from a capture with queries and stats
 * (kvm_capture_opts want_queries = want_stats = 1, mass window = all n queries): recomputes
 * the causal probabilities of the last n_obs queries from the captured post-RoPE q and k.
 * obs_buf must hold n_group·n_obs·n floats and mass_buf n_group·n floats (caller-owned
 * scratch); a->obs and a->mass point into them. n_obs in [1, n]. Returns 0 or KVM_EINVAL
 * (capture without queries or stats). */
int kvm_evict_attn_from_capture(const kvm_model_config *c, const kvm_capture *cap, int layer, int kv_head,
                                int64_t n_obs, float *obs_buf, float *mass_buf, kvm_evict_attn *a);

/* Prefill phase: clones in->full and cuts every (layer, KV head) whose plan pattern is not
 * NONE to its budget with that pattern, from in->cap's statistics. *out: new cache owned by
 * the caller (next_pos = N). Returns 0, KVM_EINVAL (plan shape not the model's, capture
 * without queries/stats), KVM_ENOMEM. */
int kvm_evict_prefill(const kvm_compress_input *in, const kvm_evict_plan *plan, kvm_kvcache **out);

/* Decode phase: a policy whose hooks keep every (layer, KV head) of the plan within its
 * budget as tokens are appended: after each append (cache_update, any phase), while a head
 * holds more than b entries, one positioned entry is evicted by the pattern's rule:
 * StreamingLLM the oldest after the sinks; H2O the lowest accumulated attention outside the
 * recent share (scores seeded from the capture's mass and accumulated by post_attn);
 * TOVA the lowest attention of the newest query (computed from site->q, averaged over the
 * group); SnapKV/PyramidKV the lowest max-pooled vote outside the last `window` entries,
 * votes accumulated from the decode queries with a decay of (1 − 1/window) per query, so
 * they approximate the last `window` queries' votes (seeded with the prefill window's
 * votes; our decode extension, the paper compresses once). Ties evict the later entry. Distilled entries (KVM_POS_NONE) count but
 * are never evicted. `in` may be NULL (no seeding). The plan is copied. Free with
 * kvm_decode_policy_free. Returns 0, KVM_EINVAL, KVM_ENOMEM. */
int kvm_evict_decode_new(const kvm_model_config *c, const kvm_evict_plan *plan, const kvm_compress_input *in,
                         kvm_decode_policy **out);

#endif
