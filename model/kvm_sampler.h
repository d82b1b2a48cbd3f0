/* kvm_sampler.h: next-token sampling exactly as llama2.c's run.c does it (greedy argmax at
 * temperature 0, otherwise temperature softmax then multinomial or top-p nucleus sampling
 * with run.c's xorshift generator), so seeded runs reproduce run.c's choices. */
#ifndef KVM_SAMPLER_H
#define KVM_SAMPLER_H

#include <stdint.h>

typedef struct kvm_sampler kvm_sampler;

/* temperature ≥ 0 (0 = greedy), topp in [0, 1] (0 or 1 disable nucleus sampling), seed
 * the RNG state (run.c's default is time-based; 0 is valid). Returns 0, KVM_EINVAL (bad
 * temperature/topp), KVM_ENOMEM. */
int kvm_sampler_new(int vocab_size, float temperature, float topp, uint64_t seed, kvm_sampler **out);

/* Frees. Accepts NULL and *s == NULL; sets *s = NULL. */
void kvm_sampler_free(kvm_sampler **s);

/* Picks a token from logits[vocab_size]; modifies logits in place (temperature, softmax)
 * when sampling. Returns the token id. */
int32_t kvm_sampler_sample(kvm_sampler *s, float *logits);

/* argmax over x[0..n) (first maximum on ties). */
int32_t kvm_argmax(const float *x, int64_t n);

#endif
