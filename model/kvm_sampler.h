/* kvm_sampler.h: next-token sampling exactly as llama2.c's run.c does it (greedy argmax at
 * temperature 0, otherwise temperature softmax then multinomial or top-p nucleus sampling
 * with run.c's xorshift generator), so seeded runs reproduce run.c's choices. */
#ifndef KVM_SAMPLER_H
#define KVM_SAMPLER_H

#include <stdint.h>

typedef struct kvm_sampler kvm_sampler;

/* temperature ≥ 0 (0 = greedy; a positive one below FLT_MIN, e.g. a double 1e-40 cast to
 * float, is clamped to FLT_MIN), topp in [0, 1] (0 or 1 disable nucleus sampling), seed
 * the RNG state (run.c's default is time-based; 0, which xorshift would never leave, is
 * replaced by a fixed non-zero state). Returns 0, KVM_EINVAL (bad temperature/topp),
 * KVM_ENOMEM. */
int kvm_sampler_new(int vocab_size, float temperature, float topp, uint64_t seed, kvm_sampler **out);

/* Frees. Accepts NULL and *s == NULL; sets *s = NULL. */
void kvm_sampler_free(kvm_sampler **s);

/* Picks a token from logits[vocab_size]; modifies logits in place (temperature, softmax)
 * when sampling. Never reads out of bounds: logits holding NaN or infinities, or whose
 * softmax overflows (a tiny temperature), give the argmax over the non-NaN logits; top-p
 * below 1/vocab_size (nothing passes run.c's pre-filter) gives the most probable token.
 * Returns the token id in [0, vocab_size). */
int32_t kvm_sampler_sample(kvm_sampler *s, float *logits);

/* argmax over x[0..n) (first maximum on ties), NaN entries skipped (0 when all are NaN). */
int32_t kvm_argmax(const float *x, int64_t n);

#endif
