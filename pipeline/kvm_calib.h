/* kvm_calib.h: PolyKV calibration signals on the wire. The signals stage measures one
 * document's signals (compress/polykv/kvm_polykv.h kvm_polykv_calibrate) and sends them as a
 * proto `stats` message; the strategy stage averages the documents' messages back into one
 * kvm_polykv_signals (means over documents, worst-case perplexity recomputed from the means)
 * before building the strategy. */
#ifndef KVM_CALIB_H
#define KVM_CALIB_H

#include "compress/polykv/kvm_polykv.h"
#include "proto/kvm_proto.h"

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

#endif
