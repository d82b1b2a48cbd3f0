/* kvm_tokenizer_json.h (internal to model/): a Hugging Face tokenizer.json (BPE model) read
 * into the one BPE engine (model/kvm_tokenizer_bpe.h), with BOS/EOS and the chat template from
 * the post-processor and tokenizer_config.json beside it. kvm_tokenizer.h is the public face. */
#ifndef KVM_TOKENIZER_JSON_H
#define KVM_TOKENIZER_JSON_H

#include "model/kvm_tokenizer_bpe.h"

#include <stdint.h>

/* What a tokenizer.json says besides the vocabulary. */
typedef struct kvm_tokjson_info {
    int32_t bos_id;      /* BOS: the post-processor's leading special token, else tokenizer_config.json's
                            bos_token, else -1 */
    int32_t eos_id;      /* tokenizer_config.json's eos_token, else -1 */
    int add_bos;         /* 1 when the post-processor (or add_bos_token) starts sequences with BOS */
    char *chat_template; /* tokenizer_config.json's chat_template (the "default" one of a list), malloc'ed, or NULL */
} kvm_tokjson_info;

/* Reads `path` (tokenizer.json) and, when present, tokenizer_config.json in its folder.
 * Supported: model "BPE" (vocab, merges as "a b" strings or [a, b] pairs, byte_fallback,
 * ignore_merges, unk_token); added_tokens (special ones as CONTROL, others USER_DEFINED);
 * normalizers NFC, NFKC, Prepend, Replace (string patterns), Sequence; pre-tokenizers Split
 * (regex or string pattern, behavior Isolated), ByteLevel (add_prefix_space false), Digits,
 * Metaspace, Sequence; post-processor TemplateProcessing (BOS), ByteLevel, Sequence. The
 * vocabulary covers ids [0, max(max id + 1, min_vocab)); unused ids are holes. Everything else
 * is refused by name. On success *bpe is a new vocabulary and *info filled (free
 * info->chat_template). Errors (message names the file and the key, token or merge index):
 * KVM_ENOTFOUND, KVM_EFORMAT (either file not a regular file or a broken symbolic link
 * (kvm_file_check_found), malformed JSON, mistyped keys, ids out of range or clashing, a merge whose
 * parts or result are not tokens), KVM_ENOTSUP, KVM_EINVAL (a regex PCRE2 rejects),
 * KVM_ENOMEM. */
int kvm__tokjson_open(const char *path, int32_t min_vocab, kvm_bpe **bpe, kvm_tokjson_info *info);

/* The same for a tokenizer.json held in memory at json[0, len) (not NUL-terminated), without a
 * tokenizer_config.json (info has only what the file says); `name` labels the messages. Errors
 * as kvm__tokjson_open's but KVM_ENOTFOUND. */
int kvm__tokjson_parse_mem(const char *name, const char *json, size_t len, int32_t min_vocab, kvm_bpe **bpe,
                           kvm_tokjson_info *info);

#endif
