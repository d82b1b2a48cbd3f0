/* kvm_corpus.h: the documents of a run: every *.txt of a folder in name order (the file name
 * is the document name), or a JSON Lines file with one object per line holding "id" and
 * either "text" (string) or "tokens" (array of token ids). Reading a corpus keeps only where
 * each document is (name, path or line offset, size); a document is loaded when it is
 * needed, tokenised (BOS first) only as far as the context needs, truncated and hashed,
 * exactly as the decode workers do, and released again. */
#ifndef KVM_CORPUS_H
#define KVM_CORPUS_H

#include "model/kvm_tokenizer.h"
#include "store/kvm_store.h"

#include <stdint.h>

typedef struct kvm_doc {
    char *name;         /* file name or JSON "id" */
    char *path;         /* folder corpus: the file to read; NULL for a JSONL line */
    int64_t offset;     /* JSONL: byte offset of the document's line in the corpus file */
    int64_t size;       /* bytes of the file (folder) or of the line (JSONL), when read */
    char *text;         /* text (NUL-terminated), or NULL when given as tokens or not loaded */
    size_t text_len;    /* bytes of text */
    int32_t *tokens;    /* after kvm_doc_prepare (or as given): ids, BOS first; NULL once released */
    int64_t n_tokens;   /* tokens kept */
    int64_t n_original; /* tokens before truncation (text: counted up to n_keep + 1, see kvm_doc_prepare_n) */
    int truncated;      /* 1 when the document was longer than the context */
    kvm_store_id hash;  /* BLAKE2b-256 of the kept ids (kvm_store_doc_hash) */
    int name_clash;     /* folder corpus: name, escaped (%HH), is another file's name: fails at load */
} kvm_doc;

typedef struct kvm_corpus {
    kvm_doc *docs; /* [n] */
    int64_t n;
    char *path;    /* the folder or .jsonl file */
    int jsonl;     /* 1: path is a JSON Lines file */
    /* Set by the caller when the orchestrator is to load documents on demand
     * (kvm_corpus_load, kvm_doc_release) rather than get them prepared: */
    int on_demand;             /* 1: docs are not prepared; load each when it is needed */
    const kvm_tokenizer *tok;  /* tokenises text documents (borrowed; NULL: model has none) */
    int vocab_size;            /* given token ids must be below this */
    int32_t bos;               /* the BOS id put first */
    const char *frame;         /* chat framing ([model] chat, pipeline/kvm_chatcfg.h): text put before
                                  each document (borrowed), or NULL: none */
} kvm_corpus;

/* Reads a folder of *.txt (name order) or a .jsonl file: names, paths, line offsets and
 * sizes only (every JSON line is parsed and checked here, its text not kept; load with
 * kvm_corpus_load). Errors name the file and line:
 * KVM_ENOTFOUND (missing), KVM_EIO (unreadable; a folder's file that cannot be read is
 * listed all the same and fails alone in kvm_corpus_load), KVM_EINVAL (not a folder or .jsonl, an
 * empty corpus, a JSON line that is not an object with a string "id" and exactly one of
 * string "text" / array of non-negative integer "tokens", duplicate ids), KVM_ENOMEM. */
int kvm_corpus_read(const char *path, kvm_corpus **out);

/* Frees. Accepts NULL and *c == NULL; sets *c = NULL. */
void kvm_corpus_free(kvm_corpus **c);

/* Tokenises d->text with BOS (or validates given tokens against vocab_size, prepending BOS
 * when missing), truncates to n_ctx tokens (setting truncated and n_original) and hashes
 * the kept ids. Text is tokenised only as far as n_ctx + 1 ids need (kvm_doctok_encode):
 * the ids are the first ones of the whole text's tokenisation. d->name may be NULL ("the
 * document" in messages). Errors: KVM_EINVAL (empty document, token id out of range: names
 * the document), KVM_ENOMEM. */
int kvm_doc_prepare(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, int64_t n_ctx);

/* kvm_doc_prepare keeping up to n_keep >= n_ctx tokens (the held-out continuation after the
 * context: d->tokens[n_tokens, n_original) when n_original <= n_keep), under a chat frame
 * when frame is not NULL (the open text of pipeline/kvm_chatcfg.h): a text document is
 * tokenised as frame + text in one string, BOS only when the tokenizer adds one
 * (kvm_tokenizer_add_bos: the chat template's own start); given tokens become [that BOS] +
 * the frame's ids + the tokens without their BOS. Truncation to n_ctx counts the frame's
 * tokens. An empty document is an error under a frame too. */
int kvm_doc_prepare_n(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, const char *frame,
                      int64_t n_ctx, int64_t n_keep);

/* kvm_doc_prepare_n for a d->text that is only the beginning of a longer document whose other
 * bytes are not at hand (kvmill serve cut an ask's document to fit [serve] max_message_bytes):
 * when that beginning settles the first n_keep + 1 ids (kvm_doctok_encode with at_end 0), d
 * is prepared exactly as from the whole document (same ids, truncation and hash; truncated is
 * 1), else *need_more is set to 1 and d holds no tokens. Errors: as kvm_doc_prepare_n. */
int kvm_doc_prepare_begin(kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos, const char *frame,
                          int64_t n_ctx, int64_t n_keep, int *need_more);

/* Loads document d of corpus c (a folder file: only the beginning that n_keep tokens need;
 * a JSONL line: parsed again) and prepares it as kvm_doc_prepare_n, with c->frame. The text is freed
 * before returning; d->tokens stay until kvm_doc_release. Errors: KVM_EIO (the file or
 * line cannot be read, or changed since kvm_corpus_read: names it), those of
 * kvm_doc_prepare_n and of the JSON line checks, KVM_ENOMEM. */
int kvm_corpus_load(const kvm_corpus *c, kvm_doc *d, const kvm_tokenizer *tok, int vocab_size, int32_t bos,
                    int64_t n_ctx, int64_t n_keep);

/* Frees d's text and tokens (n_tokens, n_original, truncated and hash stay). */
void kvm_doc_release(kvm_doc *d);

#endif
