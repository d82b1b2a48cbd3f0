/* kvm_chat.h: a chat model's framing of one user turn, from the tokenizer's chat template
 * (ChatML as SmolLM2/Qwen render it, or Llama-3), split where the user's content goes, so a
 * cached document can open the turn and the question be appended at ask time. */
#ifndef KVM_CHAT_H
#define KVM_CHAT_H

#include "model/kvm_tokenizer.h"

/* The template's text around the user's content of one user turn with
 * add_generation_prompt: *prefix = an optional system turn (`system`, else the template's
 * built-in literal default, if any) and the user turn's opening ("<|im_start|>user\n");
 * *suffix = the end of the turn and the assistant marker ("<|im_end|>\n<|im_start|>assistant\n").
 * Both malloc'ed (caller frees). BOS is not included (the tokenizer adds it). Returns 0,
 * KVM_ENOTSUP (the tokenizer has no chat template, as llama2.c ones; the template is neither
 * ChatML nor Llama-3, or its special tokens are not in the vocabulary), KVM_ENOMEM. */
int kvm_chat_frame(const kvm_tokenizer *tok, const char *system, char **prefix, char **suffix);

/* prefix + user + suffix of kvm_chat_frame in one malloc'ed string *out. Errors as there. */
int kvm_chat_prompt(const kvm_tokenizer *tok, const char *system, const char *user, char **out);

#endif
