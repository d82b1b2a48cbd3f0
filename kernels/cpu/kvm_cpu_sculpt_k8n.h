/* kvm_cpu_sculpt_k8n.h: the KVSculpt loss's head-dim-8 block kernels in 16 registers' shape
 * (kvm_cpu_sculpt_k8n.c), each giving the bits of its AVX-512-shaped twin in kvm_cpu_sculpt.c,
 * which documents the arguments: kvm__sb_scores_k8n = scores_k8, kvm__sb_exp_wv8n = exp_wv8,
 * kvm__sb_dscore_k8n = dscore_k8, kvm__sb_grad_k8n = grad_k8 (nb ≤ KVM_SB_QB rows, kp a multiple
 * of 16, panels packed [kp/16][8][16]; no allocation, no errors). kvm_cpu_sculpt.c runs these
 * where kvm__cpu_v4 is off. Internal to kernels/cpu. */
#ifndef KVM_CPU_SCULPT_K8N_H
#define KVM_CPU_SCULPT_K8N_H

#include "kernels/cpu/kvm_cpu_sculpt_rows.h"

void kvm__sb_scores_k8n(const float *restrict x, int nb, const kvm_cpu_packed *P, int64_t kp, float alpha,
                        const float *restrict beta, float *restrict y, float *restrict mx);
void kvm__sb_exp_wv8n(float *restrict s, int nb, int64_t kp, const float *mx, const kvm_cpu_packed *Vt,
                      float *restrict oh, float *lse, float *iz);
void kvm__sb_dscore_k8n(const float *restrict e, int nb, const kvm_cpu_packed *Vt, int64_t kp, const float *restrict w,
                        const float *oe, const float *c1, const float *c2, float *restrict u, float *restrict gb);
void kvm__sb_grad_k8n(const float *restrict x, int nb, const float *restrict u, int64_t kp, float *restrict gt);

#endif
