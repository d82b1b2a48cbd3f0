/* kvm_hf.h: Hugging Face checkpoint folders (config.json + safetensors weights) as kvm_models:
 * the Llama family architectures LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v
 * biases) and Qwen3ForCausalLM (per-head q/k RMSNorm), with Hugging Face's half-split RoPE. */
#ifndef KVM_HF_H
#define KVM_HF_H

#include <stddef.h>

struct kvm_model;

/* 1 when path is a directory with an entry named config.json (a Hugging Face folder; a broken
 * link or a directory of that name too, which kvm__hf_load then refuses by name), else 0. */
int kvm_hf_is_folder(const char *path);

/* The files whose bytes identify a Hugging Face model, in hashing order: dir/config.json, then
 * the weight files (model.safetensors, or the shards of model.safetensors.index.json in sorted
 * name order, which is index order for model-0000K-of-0000N names). On success *paths is a
 * malloc'ed array of *n malloc'ed paths (free each, then the array). Errors: KVM_ENOTFOUND (no
 * config.json or no weights), KVM_EFORMAT (a malformed index; config.json or a weight file that
 * kvm_file_check_found refuses), KVM_ENOMEM. */
int kvm_hf_model_files(const char *dir, char ***paths, int *n);

/* Internal (model/): fills m (m->path = dir) from a Hugging Face folder (kvm_model_open's
 * folder branch). config.json gives: architectures[0] (one of the four above; model_type, when
 * present and not null, must be its own: llama, mistral, qwen2, qwen3), hidden_size,
 * intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads (default:
 * heads), head_dim (default hidden_size / heads), vocab_size, max_position_embeddings,
 * rms_norm_eps (default 1e-6), rope_theta (default 10000), rope_scaling (null, "default" or
 * "llama3") or transformers 5's rope_parameters (the same and rope_theta in one object; a
 * top-level key that disagrees with it is an error), tie_word_embeddings (default false),
 * attention_bias, bos_token_id, eos_token_id (an id or a list of ids; generation_config.json's,
 * when the folder has one, are added: generation stops at any; one of the two files must have
 * the key), sliding_window
 * (Mistral; Qwen2 and Qwen3 with use_sliding_window; any architecture whose layer_types names
 * a sliding_attention layer; none when layer_types are all full_attention).
 * Weights (kvm_safetensors.h) are checked against it name by name: shape [out][in] as the
 * architecture needs, dtype F32/F16/BF16, converted to float32 into m->owned and the files
 * unmapped. Ignored by rule: "*.rotary_emb.inv_freq" (RoPE buffers older exports carry) and
 * an "lm_head.weight" equal to the tied embedding. Errors (message names the file and the key
 * or tensor): KVM_ENOTFOUND (config.json, weights), KVM_EFORMAT (config.json or a weight file
 * not a regular file or a broken symbolic link (kvm_file_check_found), malformed JSON, a missing or
 * mistyped key, bad values, a model_type and architectures[0] that disagree (both named), a
 * missing, unknown, or wrongly shaped tensor, a tied lm_head that
 * differs from the embedding), KVM_ENOTSUP (another architecture, rope_scaling type, hidden_act,
 * mlp_bias, quantization_config, partial rotary: each named), KVM_ENOMEM. */
int kvm__hf_load(struct kvm_model *m, const char *dir);

/* Internal (model/): config.json at `path` into *c (every field of kvm_model_config; vocab_size
 * from the key; eos_ids with those of generation_config.json in the same folder), the
 * architecture name into arch[arch_size], *tied = tie_word_embeddings and *o_bias = 1 when
 * o_proj has a bias too (attention_bias on Llama/Mistral/Qwen3). Errors as kvm__hf_load's for
 * config.json, and for generation_config.json (malformed, not an object, not a regular file,
 * a bad eos_token_id: KVM_EFORMAT naming it). */
struct kvm_model_config;
int kvm__hf_config(const char *path, struct kvm_model_config *c, char *arch, unsigned arch_size, int *tied,
                   int *o_bias);
/* The same for a config.json held in memory at json[0, len) (not NUL-terminated); `name` labels
 * the messages. No generation_config.json is read: eos_token_id must be in json. */
int kvm__hf_config_mem(const char *name, const char *json, size_t len, struct kvm_model_config *c, char *arch,
                       unsigned arch_size, int *tied, int *o_bias);

#endif
