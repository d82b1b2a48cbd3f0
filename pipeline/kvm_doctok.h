/* kvm_doctok.h: bounded tokenisation of a document: only as much of the text as the first
 * n_want ids need is tokenised, and the ids equal the first n_want ids of the whole text's
 * tokenisation (so document hashes do not depend on how much text follows). */
#ifndef KVM_DOCTOK_H
#define KVM_DOCTOK_H

#include "model/kvm_tokenizer.h"

#include <stddef.h>
#include <stdint.h>

/* Tokenises text[0, len) (with BOS when add_bos) and keeps the first min(n_want, n_all)
 * ids, n_all being the id count of the whole text. When `at_end` is 0 the text is only the
 * beginning of a longer document: if that beginning is not enough to settle n_want ids,
 * *need_more is set to 1 and nothing is returned (read more text and call again).
 * How: growing prefixes P (cut at a UTF-8 code point boundary, doubling from 6 bytes per
 * wanted id) are tokenised until P has at least n_want + 64 ids and a prefix a quarter longer
 * agrees with it on the first n_want: merges reach only a few tokens across a cut, so those
 * ids are the whole text's. Work is that of tokenising about 2.5 × 6 bytes per wanted id on
 * prose, whatever len is.
 * On success *ids (malloc'ed, caller frees, never NULL) holds *n_ids ids. n_want >= 1.
 * Errors: as kvm_tokenizer_encode; KVM_EINVAL (n_want < 1, NULL outputs). */
int kvm_doctok_encode(const kvm_tokenizer *tok, const char *text, size_t len, int at_end, int add_bos,
                      int64_t n_want, int32_t **ids, int64_t *n_ids, int *need_more);

/* The bytes a beginning (at_end 0) of prose-like density is sure to settle n_want ids with:
 * the loop's first prefix and its longer check prefix both lie inside it. A shorter beginning
 * settles too when its first four fifths hold n_want + 64 ids that agree with the whole
 * beginning's. For messages. n_want >= 1. */
size_t kvm_doctok_begin_bytes(int64_t n_want);

#endif
