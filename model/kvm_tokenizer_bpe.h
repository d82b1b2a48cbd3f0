/* kvm_tokenizer_bpe.h (internal to model/): the vocabulary embedded in a GGUF file, encoded
 * as llama.cpp does. Special tokens are split out first (longest first); then for
 * tokenizer.ggml.model = "gpt2" (byte-level BPE, llm_tokenizer_bpe) each remaining fragment is
 * pre-tokenized by the regexes named by tokenizer.ggml.pre (PCRE2, Unicode properties), its
 * bytes mapped to GPT-2's printable code points and merged by rank; for "llama"
 * (SentencePiece BPE, llm_tokenizer_spm) ' ' becomes U+2581 (with a leading one at the start
 * and after special tokens when add_space_prefix), characters merge by token score and
 * characters outside the vocabulary fall back to <0xXX> byte tokens. kvm_tokenizer.h is the
 * public face. */
#ifndef KVM_TOKENIZER_BPE_H
#define KVM_TOKENIZER_BPE_H

#include "model/kvm_gguf.h"

#include <stddef.h>
#include <stdint.h>

/* Token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type). */
enum {
    KVM_TOKEN_NORMAL = 1,
    KVM_TOKEN_UNKNOWN = 2,
    KVM_TOKEN_CONTROL = 3,
    KVM_TOKEN_USER_DEFINED = 4,
    KVM_TOKEN_UNUSED = 5,
    KVM_TOKEN_BYTE = 6,
};

typedef struct kvm_bpe kvm_bpe;

/* Builds the vocabulary from g's tokenizer.ggml.{model, tokens, token_type, and merges + pre
 * (gpt2) or scores + add_space_prefix (llama), unknown_token_id}. Copies everything it keeps
 * (g may be freed after). Errors: KVM_EFORMAT (missing or mistyped arrays, counts that
 * disagree, a merge without a space, a token type outside 1..6, an unknown_token_id that is
 * not an integer in [-1, tokens)),
 * KVM_ENOTSUP (a pre-tokenizer kvmill does not know, naming it), KVM_ENOMEM. */
int kvm__bpe_new(const kvm_gguf *g, kvm_bpe **out);

/* A normalizer step of a tokenizer.json (applied in order to each text fragment between
 * added tokens). */
typedef struct kvm_bpe_norm {
    int kind;  /* KVM_BPE_NORM_* */
    char *a;   /* PREPEND: the prefix; REPLACE: the string replaced (owned) */
    char *b;   /* REPLACE: its replacement (owned) */
} kvm_bpe_norm;
enum { KVM_BPE_NORM_NFC = 1, KVM_BPE_NORM_NFKC = 2, KVM_BPE_NORM_PREPEND = 3, KVM_BPE_NORM_REPLACE = 4 };
enum { KVM_BPE_MAX_NORM = 8, KVM_BPE_MAX_SPLITS = 8 };

/* A Hugging Face tokenizer.json BPE vocabulary in arrays (kvm_tokenizer_json.c fills it).
 * kvm__bpe_new_hf takes ownership of every malloc'ed member, also when it fails. */
typedef struct kvm_bpe_hf {
    int32_t n_vocab;           /* ids [0, n_vocab); ids not in the file are UNUSED holes */
    char *text;                /* raw token texts back to back */
    int64_t *text_off;         /* [n_vocab] */
    int32_t *text_len;         /* [n_vocab] bytes (0 for holes) */
    uint8_t *type;             /* [n_vocab] KVM_TOKEN_*: NORMAL, CONTROL (special added token),
                                  USER_DEFINED (other added token), BYTE (<0xXX> with byte
                                  fallback), UNUSED (hole) */
    int32_t n_merges;          /* merges, rank = index */
    char *merge_text;          /* "left right" strings back to back */
    int64_t *merge_off;        /* [n_merges] */
    int32_t *merge_first_len;  /* [n_merges] bytes of left (the space follows) */
    int32_t *merge_len;        /* [n_merges] bytes of the whole string */
    int byte_level;            /* 1: GPT-2 byte-to-unicode symbols; 0: UTF-8 characters, then
                                  <0xXX> byte fallback (else unk_id) for characters outside */
    int ignore_merges;         /* a word that is a token is emitted whole (Llama-3) */
    int32_t unk_id;            /* model.unk_token's id, or -1 */
    char *split[KVM_BPE_MAX_SPLITS]; /* pre-tokenizer regexes in order (owned), NULL after the last */
    kvm_bpe_norm norm[KVM_BPE_MAX_NORM]; /* normalizer steps in order; kind 0 after the last */
    int metaspace;             /* Metaspace pre-tokenizer: 0 none; prepend scheme 1 never,
                                  2 first (the fragment at offset 0), 3 always */
} kvm_bpe_hf;

/* Builds a vocabulary from h (see kvm_bpe_hf), `name` labelling messages. Errors:
 * KVM_EINVAL (a split regex PCRE2 rejects, named), KVM_ENOMEM. */
int kvm__bpe_new_hf(const char *name, kvm_bpe_hf *h, kvm_bpe **out);

/* Encodes like kvm__bpe_encode into a new malloc'ed array *out of *n ids (any vocabulary
 * kind; a tokenizer.json one normalises each fragment between added tokens, then splits it
 * by the pre-tokenizer regexes, then merges by rank). Errors: KVM_ENOMEM, KVM_EINVAL. */
int kvm__bpe_encode_new(const kvm_bpe *b, const char *text, size_t len, int32_t **out, int64_t *n);

/* Frees b. Accepts NULL and *b == NULL; sets *b = NULL. */
void kvm__bpe_free(kvm_bpe **b);

/* Encodes len bytes of text (special tokens recognised) into out, which must have room for
 * 4 * len ids; *n receives the count. GGUF vocabularies only (a tokenizer.json one needs
 * kvm__bpe_encode_new). Thread-safe (b is read-only). Errors: KVM_ENOMEM, KVM_EINVAL (PCRE2
 * refused the text, or a tokenizer.json vocabulary). */
int kvm__bpe_encode(const kvm_bpe *b, const char *text, size_t len, int32_t *out, int64_t *n);

/* The bytes token id stands for, as llama.cpp's token_to_piece(special = false): byte-level
 * code points mapped back to bytes (gpt2), U+2581 as ' ' and <0xXX> as its byte (llama);
 * CONTROL, UNKNOWN and UNUSED tokens give no bytes; USER_DEFINED their text.
 * Valid until kvm__bpe_free. NULL when id is outside the vocabulary. */
const char *kvm__bpe_piece(const kvm_bpe *b, int32_t id, size_t *len);

/* Id of the token whose raw text is text[0, len), or -1. */
int32_t kvm__bpe_find(const kvm_bpe *b, const char *text, size_t len);

/* Number of tokens. */
int32_t kvm__bpe_vocab_size(const kvm_bpe *b);

#endif
