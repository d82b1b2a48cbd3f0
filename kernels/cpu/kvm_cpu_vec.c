/* kvm_cpu_vec.c: the float64 vector operations of the host-side L-BFGS (compress/sculpt's
 * two-loop recursion, Nocedal & Wright Alg. 7.4: about 40 dot products and 40 axpys over the
 * k·d variables per iteration), cloned for AVX-512 / AVX2 like the other CPU kernels. Compiled
 * in compress/ (baseline SSE2, two accumulators) they took 7% of a SmolLM2 solve, bound by the
 * latency of their few accumulation chains. */
#include "kernels/kvm_sculpt_kernels.h"
#include "kernels/cpu/kvm_cpu_clones.h"

#include <string.h>

typedef double v8d __attribute__((vector_size(64)));

/* The 8 lanes as a fixed tree. */
static inline __attribute__((always_inline)) double hsum8(v8d a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

KVM_CLONES
double kvm_cpu_ddot(const double *a, const double *b, int64_t n)
{
    v8d s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, x, y;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        memcpy(&x, a + i, 64);
        memcpy(&y, b + i, 64);
        s0 += x * y;
        memcpy(&x, a + i + 8, 64);
        memcpy(&y, b + i + 8, 64);
        s1 += x * y;
        memcpy(&x, a + i + 16, 64);
        memcpy(&y, b + i + 16, 64);
        s2 += x * y;
        memcpy(&x, a + i + 24, 64);
        memcpy(&y, b + i + 24, 64);
        s3 += x * y;
    }
    double t = 0;
    for (; i < n; i++) t += a[i] * b[i];
    return hsum8((s0 + s1) + (s2 + s3)) + t;
}

KVM_CLONES
void kvm_cpu_daxpy(double *restrict y, double a, const double *restrict x, int64_t n)
{
    v8d u, v;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&u, y + i, 64);
        memcpy(&v, x + i, 64);
        u += a * v;
        memcpy(y + i, &u, 64);
    }
    for (; i < n; i++) y[i] += a * x[i];
}
