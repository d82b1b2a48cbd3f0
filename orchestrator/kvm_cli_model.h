/* kvm_cli_model.h: how every kvmill command finds and opens a model, its tokenizer and
 * its compute device, so the rules (default tokenizer beside the model, --threads,
 * --device) are the same everywhere. */
#ifndef KVM_CLI_MODEL_H
#define KVM_CLI_MODEL_H

#include "kernels/kvm_kernels.h"
#include "model/kvm_model.h"
#include "model/kvm_tokenizer.h"
#include "pipeline/kvm_config.h"

/* Opens the model, and the tokenizer when `tok` is not NULL (required = 1 makes a missing
 * tokenizer an error; otherwise *tok may come back NULL). A GGUF model uses its embedded
 * tokenizer unless tok_path is given; a tok_path that is a GGUF file is read as one; the
 * tokenizer's vocabulary size must equal the model's (KVM_EMISMATCH). Prints "kvmill CMD: <detail>" to
 * stderr on failure and returns the command's exit status: 2 when the files named are wrong
 * (empty path, missing, a directory or another format, truncated, tokenizer mismatch), 1 when
 * the machine failed (out of memory, read or mmap errors); 0 on success. */
int kvm_cli_open_model(const char *cmd, const char *model_path, const char *tok_path, int required,
                       kvm_model **model, kvm_tokenizer **tok);

/* kvm_cli_open_model for a command configured by a file (run, serve, calibrate --config): the
 * model is [model] path and the tokenizer [model] tokenizer (empty: found as without one), and
 * each refusal names the file and the key it came from ("kvmill CMD: FILE: [model] path:
 * <detail>"). Same exit statuses. */
int kvm_cli_open_model_config(const char *cmd, const kvm_config *cfg, int required, kvm_model **model,
                              kvm_tokenizer **tok);

/* Applies a --weight-dtype value (auto|f32|bf16|f16; NULL keeps the model's auto) to m before
 * it is prepared. Prints "kvmill CMD: --weight-dtype: <detail>" and returns KVM_EINVAL on a bad value. */
int kvm_cli_weight_dtype(const char *cmd, const char *value, kvm_model *m);

#define KVM_CLI_WEIGHT_DTYPE_HELP                                                                                     \
    "weight matrices in memory on the CPU, widened to float32 inside the GEMM: auto (default: the file's 16-bit "  \
    "type, f16 for quantised GGUF, f32 for F32 files), f32 (parity runs), bf16 or f16 ([model] weight_dtype)"

/* Parses a --kv-dtype value (f32|f16; NULL gives f32) into *out. Prints "kvmill CMD: --kv-dtype:
 * <detail>" and returns KVM_EINVAL on a bad value. */
int kvm_cli_kv_dtype(const char *cmd, const char *value, kvm_kv_dtype *out);

#define KVM_CLI_KV_DTYPE_HELP                                                                                         \
    "element type of the in-memory KV cache on the CPU: f32 (default) or f16 (half the memory, widened to float32 "  \
    "by attention as it reads it) ([model] kv_dtype)"

/* Applies --device and --threads values (either may be NULL). Prints "kvmill CMD: --device cuda:abc: <detail>"
 * (the value once, as the stages and eval say it) or --threads as above. */
int kvm_cli_setup_device(const char *cmd, const char *device, const char *threads, const kvm_kernels **k);

#endif
