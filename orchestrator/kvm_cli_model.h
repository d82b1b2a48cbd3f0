/* kvm_cli_model.h: how every kvmill command finds and opens a model, its tokenizer and
 * its compute device, so the rules (default tokenizer beside the model, --threads,
 * --device) are the same everywhere. */
#ifndef KVM_CLI_MODEL_H
#define KVM_CLI_MODEL_H

#include "kernels/kvm_kernels.h"
#include "model/kvm_model.h"
#include "model/kvm_tokenizer.h"

/* Finds the tokenizer for a model: `explicit_path` when given, else tok512.bin then
 * tokenizer.bin in the model file's folder (or inside the model path when it is a folder).
 * Writes the path into buf and returns 0, or KVM_ENOTFOUND when none exists. */
int kvm_cli_find_tokenizer(const char *model_path, const char *explicit_path, char *buf, size_t buf_size);

/* Opens the model, and the tokenizer when `tok` is not NULL (required = 1 makes a missing
 * tokenizer an error; otherwise *tok may come back NULL). Prints "kvmill CMD: <detail>" to
 * stderr on failure and returns the kvm_status. */
int kvm_cli_open_model(const char *cmd, const char *model_path, const char *tok_path, int required,
                       kvm_model **model, kvm_tokenizer **tok);

/* Applies --device and --threads values (either may be NULL). Prints errors as above. */
int kvm_cli_setup_device(const char *cmd, const char *device, const char *threads, const kvm_kernels **k);

#endif
