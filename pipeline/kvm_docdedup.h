/* kvm_docdedup.h: finding the documents of a list that repeat an earlier one (the same content
 * under two names: a copy, two identical files in a folder), so that a command which averages
 * over documents (`kvmill calibrate`, `kvmill eval`) uses each once instead of weighting it
 * double, unsaid. */
#ifndef KVM_DOCDEDUP_H
#define KVM_DOCDEDUP_H

#include "store/kvm_store.h"

#include <stdint.h>
#include <stdio.h>

/* Finds the documents that repeat an earlier one. Two documents are the same when the token ids
 * the command reads from them are: hash[i] is kvm_store_doc_hash of document i's ids (the
 * store's document key, over those ids; which ids is the caller's choice, e.g. calibration's
 * context + continuation). names: [n] how the note calls each (a path). Writes one line per
 * repeat to `notes` (NULL: none): "kvmill CMD: note: NAME has the same content as FIRST; ACTION"
 * (action, e.g. "calibrating on it once"). dup_of: [n] out: the index j < i of the first
 * document with document i's ids, or -1 when i is the first; the caller drops those with
 * dup_of[i] >= 0. hash, names and dup_of are the caller's (borrowed for the call). Returns the
 * number of distinct documents (at least 1 when n >= 1), or KVM_ENOMEM (negative). Not
 * thread-safe only as `notes` is. */
int64_t kvm_docdedup_find(const char *cmd, const char *action, const kvm_store_id *hash, const char *const *names,
                          int64_t n, FILE *notes, int64_t *dup_of);

#endif
