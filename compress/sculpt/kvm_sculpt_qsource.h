/* kvm_sculpt_qsource.h: training queries taken from the model itself (issue 14, item 1). Besides
 * the synthetic queries of issue 5, a KVSculpt problem may train on
 *  - repeat: the context followed by a short prompt and the context again, prefilled over the
 *    full cache; the post-RoPE queries of the repeated copy are real queries at true future
 *    positions N + P + t that attend over the whole context (KVzip arXiv 2505.23416 §3.1,
 *    Attention Matching arXiv 2602.16284);
 *  - continuation: the queries of T tokens the model generates greedily after the context.
 * The sets are computed once per document (one forward pass each) and sampled per (layer, KV
 * head) problem by kvm_sculpt_problem_build_mixed. */
#ifndef KVM_SCULPT_QSOURCE_H
#define KVM_SCULPT_QSOURCE_H

#include "compress/sculpt/kvm_sculpt.h"
#include "model/kvm_tokenizer.h"

#include <stddef.h>
#include <stdint.h>

/* One source's captured queries (owned). */
typedef struct kvm_sculpt_qset {
    int64_t n;     /* token positions captured (0: the source is not used) */
    int32_t pos0;  /* absolute position of the first: repeat N + P, continuation N */
    float *q;      /* [n_layers][n_heads][n][head_dim] post-RoPE queries, head-major per layer */
} kvm_sculpt_qset;

/* The model-query sets of one document, indexed by KVM_SCULPT_QSRC_*. [SYNTHETIC] stays empty. */
typedef struct kvm_sculpt_qsets {
    kvm_sculpt_qset set[KVM_SCULPT_QSRC_COUNT];
    double seconds;          /* wall seconds of the extra forward passes */
} kvm_sculpt_qsets;

/* How many of S queries each source gets: largest-remainder rounding of share·S (ties to the
 * earlier source), n[KVM_SCULPT_QSRC_COUNT], Σ n = S. */
void kvm_sculpt_qsource_counts(const kvm_sculpt_qsource *src, int64_t S, int64_t *n);

/* Writes the canonical text of src ("synthetic", "repeat@0.5+synthetic@0.5") into buf. */
void kvm_sculpt_qsource_format(const kvm_sculpt_qsource *src, char *buf, size_t size);

/* Runs the forward passes the sources with a share need for S training queries per problem:
 * repeat prefills repeat_prompt (kvm_sculpt_repeat_prompt; the BOS token alone when none) + the
 * N context tokens over a copy of in->full, and takes the queries of the copy: positions
 * N + P .. 2N + P − 1 (needs 2N + P ≤ the model's window); continuation decodes T = ⌈n_cont / G⌉ greedy tokens
 * after the context (G = query heads per KV head, n_cont its share of S; T is cut to the
 * window, at least 1 position must remain; a cut that leaves fewer than n_cont distinct queries,
 * which the problems then sample with repeats, is said in one warning line through kvm_log).
 * Needs in->tokens. CPU forward of in->model, batch N.
 * *out is zeroed first; free with kvm_sculpt_qsets_free. Returns 0, KVM_EINVAL (no tokens, the
 * repeat does not fit the window: the message says how many positions it needs), KVM_ENOMEM,
 * or the forward's status. */
int kvm_sculpt_qsets_build(const kvm_compress_input *in, const kvm_sculpt_qsource *src, int64_t S,
                           kvm_sculpt_qsets *out);

/* The same into a cache kept across calls for one context (kvm_compress_input.qcache): builds
 * only the sets that are missing or of another length than this call needs (a continuation
 * of another T is rebuilt), so results equal those of kvm_sculpt_qsets_build. qs->seconds gets
 * the time of the passes run in this call (0 when everything was cached). Errors as
 * kvm_sculpt_qsets_build (the cache keeps its other sets). */
int kvm_sculpt_qsets_ensure(const kvm_compress_input *in, const kvm_sculpt_qsource *src, int64_t S,
                            kvm_sculpt_qsets *qs);

/* The instruction KVzip puts between the context and its repeated copy (arXiv 2505.23416 §3.1;
 * the text of its reference implementation's first chunk). */
#define KVM_SCULPT_REPEAT_INSTRUCTION "\n\nRepeat the previous context exactly."

/* The repeat prompt (kvm_compress_input.repeat_prompt) for a model's tokenizer: the ids of
 * KVM_SCULPT_REPEAT_INSTRUCTION, and for a chat model (chat = 1: the documents open a user turn,
 * as [model] chat = true and --chat frame them) the instruction followed by the end of that turn
 * and the assistant marker (kvm_chat_frame's suffix), so the repeated copy is the assistant's
 * answer; no BOS. *ids malloc'ed (caller frees), *n ≥ 1. Returns 0, the tokenizer's errors,
 * KVM_ENOTSUP (chat = 1 with a tokenizer that has no chat template: kvm_chat_frame), KVM_ENOMEM. */
int kvm_sculpt_repeat_prompt(const kvm_tokenizer *tok, int chat, int32_t **ids, int64_t *n);

/* Frees the sets; accepts a zeroed struct. */
void kvm_sculpt_qsets_free(kvm_sculpt_qsets *qs);

#endif
