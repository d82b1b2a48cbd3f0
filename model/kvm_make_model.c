/* kvm_make_model.c: writes random-weight llama2.c checkpoints of any shape, so tests and
 * benchmarks can run at realistic sizes without downloading weights. */
#include "model/kvm_model.h"
#include "common/kvm_error.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* splitmix64: tiny, seedable, and good enough for weights. */
static uint64_t next_u64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Writes n floats: uniform in [-amp, amp], or all `amp` when constant is set. */
static int write_floats(FILE *f, uint64_t *rng, int64_t n, float amp, int constant)
{
    float buf[4096];
    while (n > 0) {
        int64_t k = n < 4096 ? n : 4096;
        for (int64_t i = 0; i < k; i++)
            buf[i] = constant ? amp : amp * (2.0f * (float)(next_u64(rng) >> 40) / 16777216.0f - 1.0f);
        if (fwrite(buf, sizeof(float), (size_t)k, f) != (size_t)k) return -1;
        n -= k;
    }
    return 0;
}

static int write_rope_tables(FILE *f, int seq, int head_dim)
{
    for (int part = 0; part < 2; part++)
        for (int p = 0; p < seq; p++)
            for (int i = 0; i < head_dim / 2; i++) {
                float a = (float)p / powf(10000.0f, (float)(2 * i) / (float)head_dim);
                float v = part == 0 ? cosf(a) : sinf(a);
                if (fwrite(&v, sizeof v, 1, f) != 1) return -1;
            }
    return 0;
}

static int check_shapes(const kvm_make_model_opts *o)
{
    const struct { const char *name; int v; } f[] = {
        {"dim", o->dim}, {"hidden", o->hidden_dim}, {"layers", o->n_layers}, {"heads", o->n_heads},
        {"kv-heads", o->n_kv_heads}, {"vocab", o->vocab_size}, {"seq-len", o->seq_len}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v <= 0) return kvm_err(KVM_EINVAL, "--%s = %d must be positive", f[i].name, f[i].v);
    if (o->dim % o->n_heads) return kvm_err(KVM_EINVAL, "--heads %d does not divide --dim %d", o->n_heads, o->dim);
    if (o->n_heads % o->n_kv_heads)
        return kvm_err(KVM_EINVAL, "--kv-heads %d does not divide --heads %d", o->n_kv_heads, o->n_heads);
    if ((o->dim / o->n_heads) % 2) return kvm_err(KVM_EINVAL, "head size dim/heads = %d must be even", o->dim / o->n_heads);
    double D = o->dim, H = o->hidden_dim, L = o->n_layers, kv = (double)o->n_kv_heads * (o->dim / o->n_heads);
    double floats = D * o->vocab_size * (o->separate_classifier ? 2 : 1) + L * (2 * D * D + 2 * kv * D + 3 * H * D + 2 * D) +
                    D + (double)o->seq_len * (o->dim / o->n_heads);
    if (4 * floats > 64.0 * (1ull << 30))
        return kvm_err(KVM_EINVAL, "these shapes make a %.0f GiB checkpoint; make-model writes at most 64 GiB",
                       4 * floats / (1ull << 30));
    return 0;
}

int kvm_make_model_fwrite(FILE *f, const char *name, const kvm_make_model_opts *o)
{
    int rc = check_shapes(o);
    if (rc) return rc;
    int64_t D = o->dim, H = o->hidden_dim, L = o->n_layers, hd = o->dim / o->n_heads;
    int64_t kv = (int64_t)o->n_kv_heads * hd;
    int32_t hdr[7] = {o->dim, o->hidden_dim, o->n_layers, o->n_heads, o->n_kv_heads,
                      o->separate_classifier ? -o->vocab_size : o->vocab_size, o->seq_len};
    uint64_t rng = o->seed;
    float a_in = 1.0f / sqrtf((float)D), a_hid = 1.0f / sqrtf((float)H);
    errno = 0;
    int bad = fwrite(hdr, sizeof hdr, 1, f) != 1 || write_floats(f, &rng, (int64_t)o->vocab_size * D, 1.0f, 0) ||
              write_floats(f, &rng, L * D, 1.0f, 1) ||          /* rms_att */
              write_floats(f, &rng, L * D * D, a_in, 0) ||      /* wq */
              write_floats(f, &rng, 2 * L * kv * D, a_in, 0) || /* wk, wv */
              write_floats(f, &rng, L * D * D, a_in, 0) ||      /* wo */
              write_floats(f, &rng, L * D, 1.0f, 1) ||          /* rms_ffn */
              write_floats(f, &rng, L * H * D, a_in, 0) ||      /* w1 */
              write_floats(f, &rng, L * D * H, a_hid, 0) ||     /* w2 */
              write_floats(f, &rng, L * H * D, a_in, 0) ||      /* w3 */
              write_floats(f, &rng, D, 1.0f, 1) ||              /* rms_final */
              write_rope_tables(f, o->seq_len, (int)hd) ||
              (o->separate_classifier && write_floats(f, &rng, (int64_t)o->vocab_size * D, a_in, 0)) ||
              fflush(f) != 0; /* a full device says so here, not only at fclose */
    if (bad) return kvm_err(KVM_EIO, "%s: write failed: %s", name, errno ? strerror(errno) : "stream error");
    return 0;
}

int kvm_make_model_write(const char *path, const kvm_make_model_opts *o)
{
    int rc = check_shapes(o);
    if (rc) return rc;
    /* written under a temporary name and renamed at the end: a crash or a full disk never
     * leaves a truncated checkpoint under the requested name */
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.partial", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) return kvm_err(KVM_EIO, "%s: %s", tmp, strerror(errno));
    rc = kvm_make_model_fwrite(f, path, o);
    if (fclose(f) != 0 && !rc) rc = kvm_err(KVM_EIO, "%s: write failed: %s", path, strerror(errno));
    if (!rc && rename(tmp, path) != 0) rc = kvm_err(KVM_EIO, "%s: write failed: %s", path, strerror(errno));
    if (rc) remove(tmp);
    return rc;
}
