/* kvm_cpu_attn_f16c.h: decode attention's two products over an f16 KV cache, widening by F16C
 * (kvm_cpu_attn_f16c.c). Internal to the CPU backend. */
#ifndef KVM_CPU_ATTN_F16C_H
#define KVM_CPU_ATTN_F16C_H

#include <stdint.h>

/* 1 where the two functions below run their F16C code: an x86-64-v3 processor (kvm__cpu_v3:
 * AVX2, FMA, F16C; AVX-512 ones included), a GCC build for x86-64 without AddressSanitizer
 * (whose kernels are uncloned baseline code, without the FMAs these loops contract to, so the
 * float32 path they must equal bit for bit rounds otherwise). 0 elsewhere: callers then run
 * the cloned kvm__attn_scores_rows_f16 / kvm__attn_pv_rows_f16 of kvm_cpu_attn_rows.h. */
int kvm__attn_f16c(void);

/* kvm__attn_scores_rows_f16 (kvm_cpu_attn_rows.h): scores of nr query rows q + r·ldq (head dim
 * d floats each) against f16 keys kh [vis][d], times scale, into p + r·ldp [0, vis); bit for bit
 * the float32 path's on the widened keys where d is a multiple of 8 (else within rounding: the
 * scalar tail columns), NaN payloads aside. Call only where kvm__attn_f16c() is 1. No errors. */
void kvm__attn_scores_rows_f16c(const float *q, int64_t ldq, int nr, const uint16_t *kh, int64_t vis, int d,
                                float scale, float *p, int64_t ldp);

/* kvm__attn_pv_rows_f16: o + r·ldo [0, d) = Σ_e p[r·ldp + e] · V[e] for nr probability rows over
 * f16 values vh [n][d]; bit for bit the float32 path's, as above. Call only where
 * kvm__attn_f16c() is 1. */
void kvm__attn_pv_rows_f16c(const float *p, int64_t ldp, int nr, const uint16_t *vh, int64_t n, int d, float *o,
                            int64_t ldo);

#endif
