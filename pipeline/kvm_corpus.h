/* kvm_corpus.h: the documents of a run: every *.txt of a folder in name order (the file name
 * is the document name), or a JSON Lines file with one object per line holding "id" and
 * either "text" (string) or "tokens" (array of token ids). Then each document is tokenised
 * (BOS first), truncated to the context and hashed, exactly as the decode workers do. */
#ifndef KVM_CORPUS_H
#define KVM_CORPUS_H

#include "model/kvm_tokenizer.h"
#include "store/kvm_store.h"

#include <stdint.h>

typedef struct kvm_doc {
    char *name;         /* file name or JSON "id" */
    char *text;         /* text (NUL-terminated), or NULL when given as tokens */
    size_t text_len;    /* bytes of text */
    int32_t *tokens;    /* after kvm_doc_prepare (or as given): ids, BOS first */
    int64_t n_tokens;   /* tokens kept */
    int64_t n_original; /* tokens before truncation */
    int truncated;      /* 1 when the document was longer than the context */
    kvm_store_id hash;  /* BLAKE2b-256 of the kept ids (kvm_store_doc_hash) */
} kvm_doc;

typedef struct kvm_corpus {
    kvm_doc *docs; /* [n] */
    int64_t n;
} kvm_corpus;

/* Reads a folder of *.txt (name order) or a .jsonl file. Errors name the file and line:
 * KVM_ENOTFOUND (missing), KVM_EIO (unreadable), KVM_EINVAL (not a folder or .jsonl, an
 * empty corpus, a JSON line that is not an object with a string "id" and exactly one of
 * string "text" / array of non-negative integer "tokens", duplicate ids), KVM_ENOMEM. */
int kvm_corpus_read(const char *path, kvm_corpus **out);

/* Frees. Accepts NULL and *c == NULL; sets *c = NULL. */
void kvm_corpus_free(kvm_corpus **c);

/* Tokenises d->text with BOS (or validates given tokens against vocab_size, prepending BOS
 * when missing), truncates to n_ctx tokens (setting truncated and n_original) and hashes
 * the kept ids. Errors: KVM_EINVAL (empty document, token id out of range: names the
 * document), KVM_ENOMEM. */
int kvm_doc_prepare(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, int64_t n_ctx);

#endif
