/* kvm_calib.h: PolyKV calibration signals on the wire. The signals stage measures one
 * document's signals (compress/polykv/kvm_polykv.h kvm_polykv_calibrate) and sends them as a
 * proto `stats` message; the strategy stage averages the documents' messages back into one
 * kvm_polykv_signals (means over documents, worst-case perplexity recomputed from the means)
 * before building the strategy. */
#ifndef KVM_CALIB_H
#define KVM_CALIB_H

#include "compress/polykv/kvm_polykv.h"
#include "proto/kvm_proto.h"
#include "store/kvm_store.h"

#include <stdio.h>

/* Encodes signals s measured on n_tokens context tokens as a `stats` message for job_id.
 * Layout: cos_sim / ppl_delta [L][2][P], entropy [L][2] (the layer's entropy in both
 * phases), ppl_worst [L][2]; patterns named by kvm_pattern_name: the 5 eviction patterns, then
 * "sculpt" when s->has_sculpt and "kvzip" when s->has_kvzip (their prefill values in both
 * phases), so P is 5 to 7. Returns 0, KVM_EINVAL, KVM_ENOMEM. */
int kvm_calib_encode(const kvm_polykv_signals *s, uint64_t job_id, int64_t n_tokens, kvm_msg **out);

/* Adds one decoded `stats` message into acc (same L; patterns in kvm_pattern order) and
 * counts the document; a "sculpt" / "kvzip" column sets acc->has_sculpt / has_kvzip. Errors:
 * KVM_EPROTO (malformed), KVM_EMISMATCH (layers, phases or patterns differ from acc, or from
 * the documents already added: all with sculpt or none, all with kvzip or none). */
int kvm_calib_accumulate(kvm_polykv_signals *acc, const kvm_msg *msg);

/* Turns the sums in acc into means over acc->n_docs and recomputes worst_ppl. */
void kvm_calib_finish(kvm_polykv_signals *acc);

/* Finds the calibration documents that repeat an earlier one: the same document under two
 * names (a copy, or two identical files in a folder) was measured twice, its signals weighted
 * double in the means (kvm_calib_finish) and in the candidates' scores, unsaid. Two documents
 * are the same when the token ids calibration reads from them are (context + continuation, or
 * all of them with several windows): hash[i] is kvm_store_doc_hash of document i's ids (the
 * store's document key, over those ids). names: [n] how the note calls each (a path).
 * Writes one line per repeat to `notes` (NULL: none): "kvmill CMD: note: NAME has the same
 * content as FIRST; calibrating on it once". dup_of: [n] out: the index j < i of the first
 * document with document i's ids, or -1 when i is the first; the caller drops those with
 * dup_of[i] >= 0. Returns the number of distinct documents (at least 1 when n >= 1), or
 * KVM_ENOMEM (negative). Not thread-safe only as `notes` is. */
int64_t kvm_calib_dedup(const char *cmd, const kvm_store_id *hash, const char *const *names, int64_t n, FILE *notes,
                        int64_t *dup_of);

#endif
