/* kvm_tokenizer_find.h: the tokenizer that goes with a model file (a GGUF's embedded one, an
 * explicit file, or the llama2.c tokenizer beside the model). */
#ifndef KVM_TOKENIZER_FIND_H
#define KVM_TOKENIZER_FIND_H

#include "model/kvm_model.h"
#include "model/kvm_tokenizer.h"

#include <stddef.h>

/* Finds the tokenizer for a model: `explicit_path` when given, else tokenizer.json inside a
 * Hugging Face folder (any entry of that name: opening a broken link or a directory says
 * what is wrong), else tok512.bin then tokenizer.bin in the model file's folder (or inside the
 * model path when it is a folder).
 * Writes the path into buf and returns 0, or KVM_ENOTFOUND when none exists. */
int kvm_tokenizer_find_for_model(const char *model_path, const char *explicit_path, char *buf, size_t buf_size);

/* Opens the tokenizer of model m (loaded from model_path): a GGUF model's embedded one when
 * tok_path is NULL, else the file tok_path or the one kvm_tokenizer_find_for_model finds beside
 * the model; a tokenizer file that is a GGUF is read as one, a *.json file as a Hugging Face
 * tokenizer.json (padded to the model's vocabulary size). Writes the file it used into
 * used[used_size] (for hashing). The vocabulary size must equal the model's. Returns 0 with
 * *tok a new handle, or a kvm_status with *tok NULL: KVM_ENOTFOUND, KVM_EFORMAT, KVM_ENOTSUP,
 * KVM_EMISMATCH (vocabulary sizes differ), KVM_ENOMEM, ... (kvm_errmsg() says which). */
int kvm_tokenizer_open_for_model(const kvm_model *m, const char *model_path, const char *tok_path, kvm_tokenizer **tok,
                           char *used, size_t used_size);

#endif
