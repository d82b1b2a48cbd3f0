/* kvm_sampler.c: run.c's sampler (argmax, multinomial, top-p) and its RNG. */
#include "model/kvm_sampler.h"
#include "common/kvm_error.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

/* xorshift never leaves the all-zero state (every draw would be 0), so seed 0 gets this
 * fixed non-zero state instead (the 64-bit golden ratio, any odd constant would do). */
#define ZERO_SEED_STATE 0x9E3779B97F4A7C15ull

typedef struct prob_index {
    float prob;
    int32_t index;
} prob_index;

struct kvm_sampler {
    int vocab_size;
    float temperature, topp;
    uint64_t rng;
    prob_index *probindex; /* top-p scratch [vocab_size] */
};

int kvm_sampler_new(int vocab_size, float temperature, float topp, uint64_t seed, kvm_sampler **out)
{
    *out = NULL;
    if (vocab_size <= 0) return kvm_err(KVM_EINVAL, "sampler: vocab size %d", vocab_size);
    if (!(temperature >= 0.0f) || !isfinite(temperature))
        return kvm_err(KVM_EINVAL, "sampler: temperature %g must be >= 0", temperature);
    if (!(topp >= 0.0f && topp <= 1.0f)) return kvm_err(KVM_EINVAL, "sampler: top-p %g must be in [0, 1]", topp);
    kvm_sampler *s = calloc(1, sizeof *s);
    if (s) s->probindex = malloc((size_t)vocab_size * sizeof *s->probindex);
    if (!s || !s->probindex) {
        kvm_sampler_free(&s);
        return kvm_err(KVM_ENOMEM, "sampler: out of memory");
    }
    s->vocab_size = vocab_size;
    /* a positive temperature below FLT_MIN (a double like 1e-40 cast to float) is clamped
     * there: near-greedy, and the softmax's overflow then falls back to the argmax */
    s->temperature = temperature > 0.0f && temperature < FLT_MIN ? FLT_MIN : temperature;
    s->topp = topp;
    s->rng = seed ? seed : ZERO_SEED_STATE;
    *out = s;
    return 0;
}

void kvm_sampler_free(kvm_sampler **ps)
{
    if (!ps || !*ps) return;
    free((*ps)->probindex);
    free(*ps);
    *ps = NULL;
}

/* run.c's xorshift* generator */
static uint32_t random_u32(uint64_t *state)
{
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float random_f32(uint64_t *state) { return (float)(random_u32(state) >> 8) / 16777216.0f; }

int32_t kvm_argmax(const float *x, int64_t n)
{
    int64_t best = 0;
    while (best < n - 1 && isnan(x[best]))
        best++; /* a NaN never wins: start at the first number */
    for (int64_t i = best + 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return (int32_t)best;
}

/* run.c's softmax in place; returns the sum of the exponentials, NaN or not positive when the
 * logits held a NaN, an infinity, or overflowed (the probabilities are then unusable). */
static float softmax(float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    for (int i = 0; i < n; i++) x[i] /= sum;
    return sum;
}

static int32_t sample_mult(const float *p, int n, float coin)
{
    float cdf = 0.0f;
    for (int i = 0; i < n; i++) {
        cdf += p[i];
        if (coin < cdf) return i;
    }
    return n - 1;
}

static int compare_desc(const void *a, const void *b)
{
    const prob_index *x = a, *y = b;
    return (x->prob < y->prob) - (x->prob > y->prob);
}

static int32_t sample_topp(const float *p, int n, float topp, prob_index *pi, float coin)
{
    int n0 = 0;
    const float cutoff = (1.0f - topp) / (float)(n - 1); /* run.c's pre-filter */
    for (int i = 0; i < n; i++)
        if (p[i] >= cutoff) pi[n0++] = (prob_index){p[i], i};
    /* nothing passes only when top-p < 1/n (or n == 1): then the most probable token alone
     * exceeds top-p, so the nucleus is the argmax (run.c would read pi[-1] here) */
    if (n0 == 0) return kvm_argmax(p, n);
    qsort(pi, (size_t)n0, sizeof *pi, compare_desc);
    float cum = 0.0f;
    int last = n0 - 1;
    for (int i = 0; i < n0; i++) {
        cum += pi[i].prob;
        if (cum > topp) {
            last = i;
            break;
        }
    }
    float r = coin * cum, cdf = 0.0f;
    for (int i = 0; i <= last; i++) {
        cdf += pi[i].prob;
        if (r < cdf) return pi[i].index;
    }
    return pi[last].index;
}

int32_t kvm_sampler_sample(kvm_sampler *s, float *logits)
{
    int32_t best = kvm_argmax(logits, s->vocab_size);
    if (s->temperature == 0.0f) return best;
    for (int i = 0; i < s->vocab_size; i++) logits[i] /= s->temperature;
    float sum = softmax(logits, s->vocab_size);
    if (!(sum > 0.0f) || !isfinite(sum)) return best; /* NaN/inf logits or overflow: greedy */
    float coin = random_f32(&s->rng);
    if (s->topp <= 0.0f || s->topp >= 1.0f) return sample_mult(logits, s->vocab_size, coin);
    return sample_topp(logits, s->vocab_size, s->topp, s->probindex, coin);
}
