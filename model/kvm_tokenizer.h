/* kvm_tokenizer.h: text <-> token ids for the models kvmill serves: the llama2.c
 * tokenizer.bin (SentencePiece BPE with byte fallback, e.g. shared/models/tok512.bin),
 * encoded and decoded exactly as llama2.c run.c does, so ids and text match the golden runs;
 * and the tokenizer embedded in a GGUF file (byte-level BPE, tokenizer.ggml.model = "gpt2", or
 * SentencePiece BPE, "llama"), encoded and decoded as llama.cpp does
 * (tests/check_gguf_tokenizer.c compares the ids). */
#ifndef KVM_TOKENIZER_H
#define KVM_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

/* A loaded vocabulary: pieces, merge scores, a piece -> id hash. Read-only after open, so any
 * number of threads may encode/decode with one handle at the same time. */
typedef struct kvm_tokenizer kvm_tokenizer;

/* Reads a llama2.c tokenizer.bin (layout: shared/models/README.md, "Tokenizer file layout"):
 * int32 max_token_length, then exactly `vocab_size` records {float32 score, int32 len,
 * len bytes}, all little-endian. vocab_size is not in the file: it comes from the checkpoint
 * header (kvm_model), and must be >= 259 (unk, BOS, EOS and the 256 byte-fallback ids
 * byte+3 that encode relies on). BOS is id 1 and EOS id 2, as in run.c.
 * Validation, stricter than run.c: max_token_length > 0; every record complete; each len in
 * [0, max_token_length]; and no bytes after the last record (trailing bytes mean the file
 * holds more tokens than the model's vocab, i.e. the wrong tokenizer, or damage).
 * On success *out is a new handle the caller owns (kvm_tokenizer_close). On error *out is NULL
 * and kvm_errmsg() names the file and the field or record index. Errors:
 *   KVM_EINVAL    path or out NULL, vocab_size < 259;
 *   KVM_ENOTFOUND the file does not exist;
 *   KVM_EIO       it cannot be opened or read, or is a directory / not a regular file;
 *   KVM_EFORMAT   truncated (inside max_token_length, or record i's score, len or piece
 *                 bytes, or fewer than vocab_size records), max_token_length <= 0, a negative
 *                 len, len > max_token_length, trailing bytes, file over 256 MiB, no " "
 *                 piece (the encoder's dummy prefix);
 *   KVM_ENOMEM    allocation failed. */
int kvm_tokenizer_open_llama2c(const char *path, int vocab_size, kvm_tokenizer **out);

/* Internal (model/, fuzzers): the same for a tokenizer file's bytes file[0, size) (copied;
 * `path` labels the messages). Errors as kvm_tokenizer_open_llama2c's but KVM_ENOTFOUND and
 * KVM_EIO. */
int kvm__tokenizer_llama2c_mem(const char *path, const unsigned char *file, int64_t size, int vocab_size,
                               kvm_tokenizer **out);

/* Frees the tokenizer and everything it owns, then sets *t to NULL. Accepts t == NULL and
 * *t == NULL. Pointers returned by kvm_tokenizer_piece become invalid. */
void kvm_tokenizer_close(kvm_tokenizer **t);

/* Encodes `len` bytes of `text` (UTF-8 expected, any bytes accepted; NUL is an ordinary byte,
 * text may be NULL when len == 0) into token ids exactly as run.c encode(text, bos, eos):
 * BOS if add_bos; the " " token as SentencePiece's dummy prefix if len > 0; each UTF-8 code
 * point (a lead byte plus up to 3 continuation bytes; stray continuation bytes are grouped the
 * same way run.c groups them) as its piece, or as byte-fallback ids byte+3 if it has none;
 * then repeatedly merge the adjacent pair whose concatenation is a piece with the highest
 * score (leftmost on ties, only scores > -1e10, NaN never merges); EOS if add_eos.
 * Run time O(n log n) in the bytes of text (heap of cached pair scores), not run.c's O(n^2)
 * string lookups. When a piece occurs twice in the vocabulary the lower id is used (run.c's
 * choice depends on qsort order; tok512 has no duplicates).
 * On success *ids is a malloc'ed array of *n_ids ids the caller frees (never NULL, even for
 * zero ids). On error *ids is NULL and *n_ids 0. Errors: KVM_EINVAL (t, ids or n_ids NULL, text
 * NULL with len > 0), KVM_ERANGE (len above 2^40 bytes), KVM_EFORMAT (the vocabulary has no
 * " " piece for the dummy prefix), KVM_ENOMEM. */
int kvm_tokenizer_encode(const kvm_tokenizer *t, const char *text, size_t len, int add_bos,
                         int add_eos, int32_t **ids, int64_t *n_ids);

/* The bytes run.c's decode(prev, id) yields for token `id` that follows token `prev` (pass -1
 * when there is none): after BOS a leading ' ' is stripped; a "<0xXX>" piece becomes that one
 * raw byte. Returns a pointer to *len bytes, followed by a NUL, owned by t and valid until
 * kvm_tokenizer_close; the bytes may contain NUL or invalid UTF-8. Returns NULL with *len = 0
 * when t is NULL or id is outside [0, vocab_size). len may be NULL. */
const char *kvm_tokenizer_piece(const kvm_tokenizer *t, int32_t prev, int32_t id, size_t *len);

/* run.c's safe_printf rule: 1 if run.c would print the piece, 0 if it drops it. It drops an
 * empty piece (len 0 or, as run.c sees C strings, piece[0] == NUL) and a single byte that is
 * neither printable nor whitespace in the C locale (bytes >= 0x80 included). NULL gives 0. */
int kvm_tokenizer_piece_printable(const char *piece, size_t len);

/* Decodes n ids into text: the concatenation of kvm_tokenizer_piece(prev = ids[i-1], ids[i])
 * (prev = -1 for ids[0]) as raw bytes, without the safe_printf filter. BOS and EOS are control
 * tokens and contribute no bytes (they still count as prev, so the piece after BOS loses its
 * leading space). Hence decode(encode(s, add_bos=1)) == s and decode(encode(s, add_bos=0))
 * == " " + s for any text s. On success *text is malloc'ed, *len bytes plus a terminating NUL
 * (not counted), caller frees. On error *text is NULL and *len 0. Errors: KVM_EINVAL (t, text
 * or len NULL, ids NULL with n > 0, n < 0), KVM_ERANGE (an id outside [0, vocab_size); the
 * message gives its index), KVM_ENOMEM. */
int kvm_tokenizer_decode(const kvm_tokenizer *t, const int32_t *ids, int64_t n, char **text,
                         size_t *len);

/* Reads the tokenizer embedded in a GGUF file (model/kvm_gguf.h validates the file), with
 * tokenizer.ggml.{tokens, token_type, bos/eos_token_id, add_bos_token} and
 * tokenizer.chat_template, and by tokenizer.ggml.model:
 *   "gpt2"  byte-level BPE: merges, and the pre-tokenizer named by tokenizer.ggml.pre, run as
 *           PCRE2 regexes with Unicode properties (supported: smollm, starcoder, gpt-2,
 *           llama-bpe, qwen2 and the names llama.cpp treats as the same); add_bos default 0;
 *   "llama" SentencePiece BPE: scores, add_space_prefix (default 1), <0xXX> byte tokens,
 *           unknown_token_id; add_bos default 1.
 * Encoding follows llama.cpp's llama_tokenize(add_special, parse_special = true): special
 * tokens (CONTROL, USER_DEFINED and UNKNOWN types; longest first) are recognised anywhere in
 * the text; the fragments between them are encoded as the model kind says (a "llama"
 * fragment at the start or after a special token gets the leading space). kvm_tokenizer_piece
 * gives llama.cpp's token_to_piece(special = false): CONTROL, UNKNOWN and UNUSED tokens (e.g.
 * <|im_end|>) yield no bytes; decode is the concatenation of the pieces (so a "llama" text
 * decodes with the added leading space).
 * On success *out is a new handle (kvm_tokenizer_close). Errors: KVM_EINVAL (NULL
 * arguments), KVM_ENOTFOUND / KVM_EIO (the file), KVM_EFORMAT (a malformed file, or no
 * tokenizer.ggml.model, or inconsistent tokenizer arrays, or a bos/eos/unknown_token_id that
 * is not an integer id of the vocabulary, or a tokenizer.chat_template holding a NUL byte; the
 * message names the key),
 * KVM_ENOTSUP (another tokenizer model or an unknown pre-tokenizer), KVM_ENOMEM. Handles are
 * read-only after open: any number of threads may encode/decode with one. */
int kvm_tokenizer_open_gguf(const char *path, kvm_tokenizer **out);

/* Internal (model/, fuzzers): the same for a GGUF file's bytes map[0, bytes) (the tokenizer
 * copies what it keeps; `path` labels the messages). Errors as kvm_tokenizer_open_gguf's but
 * KVM_EINVAL, KVM_ENOTFOUND and KVM_EIO. */
int kvm__tokenizer_gguf_mem(const char *path, const uint8_t *map, size_t bytes, kvm_tokenizer **out);

/* Reads a Hugging Face tokenizer.json (model/kvm_tokenizer_json.h lists what is supported:
 * byte-level BPE as GPT-2, Llama-3 and Qwen use, and the SentencePiece-style BPE of
 * Llama-2/Mistral with U+2581 and <0xXX> byte fallback), with tokenizer_config.json beside it
 * (bos/eos tokens, chat_template). Encoding follows the `tokenizers` library's
 * encode(add_special_tokens = false): added tokens are matched first (longest first), the text
 * between them is normalised, split by the pre-tokenizer and merged by rank (one BPE engine
 * with the GGUF vocabularies). The vocabulary spans at least min_vocab ids (a model's embedding
 * may have more rows than the tokenizer has tokens; the extra ids are unused). BOS comes from
 * the post-processor's template. On success *out is a new handle. Errors as
 * kvm_tokenizer_open_gguf's, naming the file and the key (tokenizer_config.json's chat_template,
 * bos_token or eos_token holding a NUL, "\u0000", is KVM_EFORMAT). */
int kvm_tokenizer_open_hf(const char *path, int min_vocab, kvm_tokenizer **out);

/* 1 when prompts should start with BOS (llama2.c: always; GGUF: tokenizer.ggml.add_bos_token,
 * default 0 for BPE), 0 otherwise or when t is NULL. Pass it as encode's add_bos. */
int kvm_tokenizer_add_bos(const kvm_tokenizer *t);

/* Id of the token whose text (as stored in the vocabulary, special tokens included) is the
 * NUL-terminated `text`, or -1 (also for NULL arguments). */
int32_t kvm_tokenizer_find(const kvm_tokenizer *t, const char *text);

/* The GGUF tokenizer.chat_template (a Jinja source) owned by t, valid until close; NULL for
 * llama2.c tokenizers and files without one. */
const char *kvm_tokenizer_chat_template(const kvm_tokenizer *t);

/* Number of token ids, [0, vocab_size). 0 when t is NULL. */
int kvm_tokenizer_vocab_size(const kvm_tokenizer *t);

/* Begin-of-sequence id (1 for llama2.c), -1 when t is NULL. */
int32_t kvm_tokenizer_bos(const kvm_tokenizer *t);

/* End-of-sequence id (2 for llama2.c), -1 when t is NULL. */
int32_t kvm_tokenizer_eos(const kvm_tokenizer *t);

#endif
