/* sculpt_loss_blocked.c: kvm_sculpt_loss — the KVSculpt loss and gradient (arXiv 2603.27819
 * §3) of one problem through the backend's query-blocked kernel (kernels/kvm_sculpt_kernels.h). */
#include "compress/sculpt/kvm_sculpt_problem.h"
#include "kernels/kvm_sculpt_kernels.h"

#include <math.h>

double kvm_sculpt_loss(const kvm_sculpt_problem *p, const float *kc, const float *vc, const float *beta,
                       int64_t k, double lambda, float *grad_k, float *grad_b, double *mse, double *lse_part)
{
    if (k == 0) /* no distilled entry: nothing to block (the retain zone alone) */
        return kvm_sculpt_loss_ref(p, kc, vc, beta, k, lambda, grad_k, grad_b, mse, lse_part);
    kvm_sculpt_view v = {.d = p->d, .scale = p->scale, .nq = p->nq, .nc = p->nc, .q = p->q, .o_full = p->o_full,
                         .o_ret = p->o_ret, .lse_zone = p->lse_zone, .lse_ret = p->lse_ret, .n_vis = p->n_vis,
                         .out_ms = p->out_ms, .lse_mass_weight = p->lse_mass_weight};
    kvm_sculpt_eval e;
    if (kvm_cpu_sculpt_lossgrad(&v, kc, vc, beta, k, lambda, grad_k, grad_b, &e)) return NAN;
    if (mse) *mse = e.mse_sum / (double)p->nq;
    if (lse_part) *lse_part = lambda * e.lse_sum / (double)p->nq;
    return e.loss;
}
