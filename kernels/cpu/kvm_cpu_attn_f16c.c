/* kvm_cpu_attn_f16c.c: decode attention's products over an f16 KV cache with F16C, one
 * vcvtph2ps per 8 keys' or values' elements. The cloned loops widen f16 by integer operations
 * (about 12 per 8 values, KVM__F16_WIDEN: GCC 12 has no vector conversion of _Float16 to use
 * F16C with), which made f16 decode 1.8× slower than float32 although it reads half the bytes.
 * The bodies are kvm_cpu_attn_rows.h's, compiled here for x86-64-v3 with KVM__ATTN_F16C set:
 * the same operations in the same order as the float32 path's clone, so the same bits
 * (tests/check_kv16.c runs both widenings against float32). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define KVM__ATTN_F16C 1
#define KVM_NO_CLONES 1 /* the whole file is x86-64-v3 code: target_clones would conflict */
#endif

#include "kernels/cpu/kvm_cpu_attn_f16c.h"
#include "kernels/cpu/kvm_cpu_clones.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Above the target pragma: it runs on every processor. */
int kvm__attn_f16c(void)
{
#ifdef KVM__ATTN_F16C
    return kvm__cpu_v3();
#else
    return 0;
#endif
}

#ifdef KVM__ATTN_F16C
#pragma GCC target("arch=x86-64-v3")
#include <immintrin.h>
#endif

#include "kernels/cpu/kvm_cpu_attn_rows.h"

void kvm__attn_scores_rows_f16c(const float *q, int64_t ldq, int nr, const uint16_t *kh, int64_t vis, int d,
                                float scale, float *p, int64_t ldp)
{
    kvm__attn_scores_rows_body(q, ldq, nr, NULL, kh, vis, d, scale, p, ldp);
}

void kvm__attn_pv_rows_f16c(const float *p, int64_t ldp, int nr, const uint16_t *vh, int64_t n, int d, float *o,
                            int64_t ldo)
{
    kvm__attn_pv_rows_body(p, ldp, nr, NULL, vh, n, d, o, ldo);
}
