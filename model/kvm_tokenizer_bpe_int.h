/* kvm_tokenizer_bpe_int.h (internal to the BPE engine's files): the vocabulary struct and the
 * pieces of the encoder that kvm_tokenizer_bpe.c (GGUF vocabularies, the merge loops) and
 * kvm_tokenizer_hf.c (tokenizer.json vocabularies: normalizers, the encode pipeline) share. */
#ifndef KVM_TOKENIZER_BPE_INT_H
#define KVM_TOKENIZER_BPE_INT_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/kvm_tokenizer_bpe.h"

#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

enum { KVM_BPE_MAX_REGEX = KVM_BPE_MAX_SPLITS };

struct kvm_bpe {
    int spm;                           /* 1: tokenizer.ggml.model "llama" (SentencePiece), 0: "gpt2" */
    float *score;                      /* [n_vocab] SentencePiece merge scores (spm only) */
    int add_space_prefix;              /* spm: a raw fragment after BOS/special/start gets a leading ' ' */
    int32_t byte_tok[256];             /* spm: id of the "<0xXX>" token of each byte, -1 if none */
    int32_t unk_id;                    /* tokenizer.ggml.unknown_token_id, or -1 */
    int32_t n_vocab;                   /* tokens */
    char *text;                        /* raw token texts back to back (byte-level code points) */
    int64_t *text_off;                 /* [n_vocab] */
    int32_t *text_len;                 /* [n_vocab] bytes */
    uint8_t *type;                     /* [n_vocab] KVM_TOKEN_* */
    char *piece;                       /* decoded bytes of every token back to back, NUL after each */
    int64_t *piece_off;                /* [n_vocab] */
    int32_t *piece_len;                /* [n_vocab] */
    int32_t *tok_hash;                 /* open addressing: raw text -> id (the highest id wins, as
                                          llama.cpp's token_to_id map assignment does), -1 empty */
    uint64_t tok_mask;                 /* slots - 1 */
    int32_t n_merges;                  /* merges (rank = index) */
    char *merge_text;                  /* merge strings back to back */
    int64_t *merge_off;                /* [n_merges] */
    int32_t *merge_first_len;          /* [n_merges] bytes of the left part (the right follows a space) */
    int32_t *merge_len;                /* [n_merges] whole string bytes */
    int32_t *merge_hash;               /* (left, right) -> rank, first occurrence wins, -1 empty */
    uint64_t merge_mask;               /* slots - 1 */
    int32_t *special;                  /* CONTROL/USER_DEFINED/UNKNOWN ids, longest text first */
    int32_t n_special;                 /* entries of special */
    pcre2_code *re[KVM_BPE_MAX_REGEX]; /* the pre-tokenizer, NULL-terminated */
    char byte_cp[256][3];              /* UTF-8 (NUL-terminated) of GPT-2's code point for each byte */
    int16_t cp_byte[324];              /* byte of code point cp < 324, -1 when none maps there */
    int hf;                            /* 1: a tokenizer.json vocabulary (hf_encode) */
    int chars;                         /* hf: symbols are UTF-8 characters, not mapped bytes */
    int ignore_merges;                 /* hf: a word that is a token is emitted whole */
    int metaspace;                     /* hf: kvm_bpe_hf.metaspace */
    kvm_bpe_norm norm[KVM_BPE_MAX_NORM]; /* hf: normalizer steps, kind 0 after the last */
};

/* A fragment of the input: raw text [off, off + len) or a special token. */
typedef struct frag {
    int64_t off, len; /* bytes of the input text (raw fragments) */
    int32_t token;    /* special token id, or -1 for raw text */
} frag;

/* A growable list of fragments. */
typedef struct frag_list {
    frag *v;
    int64_t n, cap;
} frag_list;

/* One symbol of a word during merging: a span of the mapped word. */
typedef struct sym {
    int32_t off, n;     /* bytes of the mapped word; n == 0 once merged away */
    int32_t prev, next; /* neighbours, -1 at the ends */
} sym;

/* A candidate merge of symbols left and left's next, valid while both keep their lengths. */
typedef struct bigram {
    int32_t rank, left, right, ln, rn;
} bigram;

typedef struct bpe_scratch {
    char *word; /* the mapped word */
    sym *syms;
    bigram *heap;
    int64_t cap_word, cap_syms, cap_heap, heap_n;
} bpe_scratch;

/* GPT-2's byte-to-code-point table into b->byte_cp / b->cp_byte. */
void kvm__bpe_byte_map_init(kvm_bpe *b);

/* Builds the token hash, merge hash, decoded pieces and special-token list of a filled
 * vocabulary (texts, types, merges with their split). Errors: KVM_ENOMEM. */
int kvm__bpe_finish(kvm_bpe *b, const char *f);

/* Compiles the pre-tokenizer regexes re[0, n) into b->re. Errors: KVM_ENOTSUP (too many),
 * KVM_EINVAL (PCRE2 rejects one, named). */
int kvm__bpe_compile(kvm_bpe *b, const char *name, const char *const *re, int n);

/* Grows *p (elements of elem bytes, capacity *cap) to hold need. Errors: KVM_ENOMEM. */
int kvm__bpe_grow(void **p, int64_t *cap, int64_t need, size_t elem);

/* Appends f to l. Errors: KVM_ENOMEM. */
int kvm__bpe_frag_push(frag_list *l, frag f);

/* Splits text[0, len) at every special token (longest first) into *out (malloc'ed v).
 * Errors: KVM_ENOMEM. */
int kvm__bpe_partition(const kvm_bpe *b, const char *text, size_t len, frag_list *out);

/* Applies re to every raw fragment of in (offsets into text), writing matches and the text
 * between them to out. Errors: KVM_ENOMEM, KVM_EINVAL. */
int kvm__bpe_regex_split(const pcre2_code *re, const char *text, const frag_list *in, frag_list *out,
                         pcre2_match_data *md);

/* BPE by merge rank of one pre-tokenized word w[0, wl) (bytes mapped, or UTF-8 characters when
 * chars), its ids appended at out[*n] (at most wl of them). Errors: KVM_ENOMEM. */
int kvm__bpe_word(const kvm_bpe *b, bpe_scratch *s, const char *w, int64_t wl, int chars, int32_t *out, int64_t *n);

#endif
