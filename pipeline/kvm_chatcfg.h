/* kvm_chatcfg.h: the chat framing a pipeline config asks for ([model] chat, [model] system),
 * one place for `kvmill run`, the decode workers and `kvmill calibrate --config`: the text a
 * cached document opens with and the text a served prompt is closed with (model/kvm_chat.h). */
#ifndef KVM_CHATCFG_H
#define KVM_CHATCFG_H

#include "model/kvm_tokenizer.h"
#include "pipeline/kvm_config.h"

/* With [model] chat = false: *open = *close = NULL (no framing; documents and prompts are
 * tokenised as they are). With chat = true: kvm_chat_frame(tok, system) where system is
 * [model] system (empty = the template's own default): *open = an optional system turn and
 * the user turn's opening, put before every text document (BOS only when the tokenizer adds
 * it, kvm_tokenizer_add_bos: the template's own start); *close = the end of the turn and the
 * assistant marker, put after every served prompt. Both malloc'ed (caller frees).
 * Errors: KVM_ENOTSUP when the model's tokenizer has no chat template of the ChatML or
 * Llama-3 family (llama2.c tokenizers such as stories260K's have none), the message naming
 * the config file and the setting; KVM_EINVAL when *open (BOS included) takes [model] context
 * tokens or more (every document would be cut to the frame alone: one cache for all);
 * KVM_ENOMEM. */
int kvm_chatcfg_frame(const kvm_config *c, const kvm_tokenizer *tok, char **open, char **close);

/* *n = the tokens the frame `open` (kvm_chat_frame's prefix) takes at the start of a cached
 * document, BOS included when the tokenizer adds it. The frame opens every cached document, so
 * a context of *n or fewer tokens would hold the frame alone: every document the same ids,
 * hash and cache, none of its text (refused by kvm_chatcfg_frame and `kvmill eval --chat`).
 * Errors: the tokenizer's (KVM_ENOMEM). */
int kvm_chatcfg_frame_tokens(const kvm_tokenizer *tok, const char *open, int64_t *n);

#endif
