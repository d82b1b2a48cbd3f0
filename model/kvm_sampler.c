/* kvm_sampler.c: run.c's sampler (argmax, multinomial, top-p) and its RNG. */
#include "model/kvm_sampler.h"
#include "common/kvm_error.h"

#include <math.h>
#include <stdlib.h>

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
    s->temperature = temperature;
    s->topp = topp;
    s->rng = seed;
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
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return (int32_t)best;
}

static void softmax(float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    for (int i = 0; i < n; i++) x[i] /= sum;
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
    if (s->temperature == 0.0f) return kvm_argmax(logits, s->vocab_size);
    for (int i = 0; i < s->vocab_size; i++) logits[i] /= s->temperature;
    softmax(logits, s->vocab_size);
    float coin = random_f32(&s->rng);
    if (s->topp <= 0.0f || s->topp >= 1.0f) return sample_mult(logits, s->vocab_size, coin);
    return sample_topp(logits, s->vocab_size, s->topp, s->probindex, coin);
}
