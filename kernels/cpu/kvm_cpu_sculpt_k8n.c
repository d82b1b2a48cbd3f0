/* kvm_cpu_sculpt_k8n.c: the KVSculpt loss's head-dim-8 block kernels (kvm_cpu_sculpt.c's
 * scores_k8, exp_wv8, dscore_k8 and grad_k8) in the shape of 16 vector registers (AVX2, and the
 * baseline clone's SSE2). Those hold 16 to 32 sums or broadcasts of 16 lanes at once, which
 * AVX-512's 32 registers keep but AVX2's 16 cannot: GCC spilled them to the stack and a
 * stories260K sculpt ran at a fourteenth of its AVX-512 speed. Here one row at a time and 8
 * lanes at a time; every lane's sums run over the same terms in the same order with the same
 * operations, so each kernel gives its wide twin's bits (tests/check_sculpt compares them where
 * the processor has both). Internal to kernels/cpu. */
#include "kernels/cpu/kvm_cpu_sculpt_k8n.h"

#include <string.h>

enum { NR = KVM_GEMM_NR, H = 8 }; /* panel lanes; lanes per half */

static inline SB_INLINE v16f join(v8f lo, v8f hi)
{
    v16f r;
    memcpy(&r, &lo, 32);
    memcpy((float *)&r + H, &hi, 32);
    return r;
}

/* v16_hsum8 on the sums held as halves (acc[t] = lo[t] ‖ hi[t]): the same tree (lanes l and l + 8,
 * then l and l + 4, l + 2, l + 1) in 8-lane shuffles, without building the 16-lane vectors. */
static inline SB_INLINE void hsum8_halves(const v8f lo[8], const v8f hi[8], float out[8])
{
    v8f x[8], p[4], q[2];
    for (int t = 0; t < 8; t++)
        x[t] = lo[t] + hi[t];
    for (int i = 0; i < 4; i++)
        p[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int j = 0; j < 2; j++)
        q[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(p[2 * j], p[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    const v8f r = __builtin_shufflevector(q[0], q[1], 0, 2, 4, 6, 8, 10, 12, 14) +
                  __builtin_shufflevector(q[0], q[1], 1, 3, 5, 7, 9, 11, 13, 15);
    memcpy(out, &r, 32);
}

/* Σ_{t<8} xb[t]·pp[t][h·8 .. h·8 + 8], one FMA per t in order from 0 (k8_panel's sums). */
static inline SB_INLINE v8f panel_half(const v8f xb[8], const float *pp, int h)
{
    v8f a = {0}, v;
    for (int t = 0; t < 8; t++) {
        memcpy(&v, pp + t * NR + h * H, 32);
        a += xb[t] * v;
    }
    return a;
}

static inline SB_INLINE void bcast8(const float *x, v8f xb[8])
{
    for (int t = 0; t < 8; t++)
        xb[t] = (v8f){0} + x[t];
}

SB_CLONES
void kvm__sb_scores_k8n(const float *restrict x, int nb, const kvm_cpu_packed *P, int64_t kp, float alpha,
                        const float *restrict beta, float *restrict y, float *restrict mx)
{
    for (int b = 0; b < nb; b++) {
        v8f xb[8], bv;
        bcast8(x + b * 8, xb);
        v8f m[2] = {(v8f){0} - INFINITY, (v8f){0} - INFINITY};
        for (int64_t j0 = 0; j0 < kp; j0 += NR)
            for (int h = 0; h < 2; h++) {
                const v8f a = panel_half(xb, P->p + j0 * 8, h);
                memcpy(&bv, beta + j0 + h * H, 32);
                const v8f l = a * alpha + bv;
                m[h] = v8_max(m[h], l);
                memcpy(y + b * kp + j0 + h * H, &l, 32);
            }
        mx[b] = v16_hmax(join(m[0], m[1]));
    }
}

SB_CLONES
void kvm__sb_exp_wv8n(float *restrict s, int nb, int64_t kp, const float *mx, const kvm_cpu_packed *Vt,
                      float *restrict oh, float *lse, float *iz)
{
    for (int b = 0; b < nb; b++) {
        float *restrict row = s + b * kp;
        v8f al = {0}, ah8 = {0}, x;
        for (int64_t j0 = 0; j0 < kp; j0 += NR) { /* the exponentials first, 8 lanes at a time */
            memcpy(&x, row + j0, 32);
            x = v8_expf(x - mx[b]);
            memcpy(row + j0, &x, 32);
            al += x;
            memcpy(&x, row + j0 + H, 32);
            x = v8_expf(x - mx[b]);
            memcpy(row + j0 + H, &x, 32);
            ah8 += x;
        }
        v8f ah[2][8];
        for (int h = 0; h < 2; h++) { /* then W·Vc, 8 lanes of every panel at a time */
            v8f c[8] = {{0}}, e, v;
            for (int64_t j0 = 0; j0 < kp; j0 += NR) {
                memcpy(&e, row + j0 + h * H, 32);
                const float *vp = Vt->p + j0 * 8 + h * H;
                for (int t = 0; t < 8; t++) {
                    memcpy(&v, vp + t * NR, 32);
                    c[t] += e * v;
                }
            }
            memcpy(ah[h], c, sizeof c);
        }
        const float z = v8_hsum(al + ah8); /* v16_hsum's tree */
        iz[b] = 1.0f / z;
        lse[b] = z; /* ln z below, 16 rows at a time */
        hsum8_halves(ah[0], ah[1], oh + b * 8);
    }
    for (int b0 = 0; b0 < nb; b0 += NR) {
        v16f z = (v16f){0} + 1.0f, m = {0};
        const int n = nb - b0 < NR ? nb - b0 : NR;
        memcpy(&z, lse + b0, (size_t)n * sizeof *lse);
        memcpy(&m, mx + b0, (size_t)n * sizeof *mx);
        const v16f l = m + v16_logf(z);
        memcpy(lse + b0, &l, (size_t)n * sizeof *lse);
    }
}

SB_CLONES
void kvm__sb_dscore_k8n(const float *restrict e, int nb, const kvm_cpu_packed *Vt, int64_t kp, const float *restrict w,
                        const float *oe, const float *c1, const float *c2, float *restrict u, float *restrict gb)
{
    for (int b = 0; b < nb; b++) { /* rows in order: gb sums them in order */
        v8f xb[8], g, wv;
        bcast8(e + b * 8, xb);
        for (int64_t j0 = 0; j0 < kp; j0 += NR)
            for (int h = 0; h < 2; h++) {
                const v8f a = panel_half(xb, Vt->p + j0 * 8, h);
                memcpy(&g, gb + j0 + h * H, 32);
                memcpy(&wv, w + b * kp + j0 + h * H, 32);
                const v8f uv = wv * (c1[b] * (a - oe[b]) + c2[b]);
                g += uv;
                memcpy(u + (j0 / NR) * nb * NR + b * NR + h * H, &uv, 32);
                memcpy(gb + j0 + h * H, &g, 32);
            }
    }
}

SB_CLONES
void kvm__sb_grad_k8n(const float *restrict x, int nb, const float *restrict u, int64_t kp, float *restrict gt)
{
    for (int64_t j0 = 0; j0 < kp; j0 += NR)
        for (int h = 0; h < 2; h++) {
            v8f g[8], uv;
            for (int t = 0; t < 8; t++)
                memcpy(&g[t], gt + t * kp + j0 + h * H, 32);
            const float *up = u + (j0 / NR) * nb * NR + h * H;
            for (int b = 0; b < nb; b++) {
                memcpy(&uv, up + b * NR, 32);
                for (int t = 0; t < 8; t++)
                    g[t] += x[b * 8 + t] * uv;
            }
            for (int t = 0; t < 8; t++)
                memcpy(gt + t * kp + j0 + h * H, &g[t], 32);
        }
}
