/* kvm_slurm.h: which device a stage process started by Slurm (srun) uses, from the variables
 * Slurm sets for the task, so deploy/slurm/ can start one compress worker per allocated GPU
 * with `--device slurm`. */
#ifndef KVM_SLURM_H
#define KVM_SLURM_H

#include <stddef.h>

/* A getenv-like lookup (tests pass their own). */
typedef const char *(*kvm_slurm_getenv_fn)(const char *name);

/* The device for this task, written as "cuda:N" or "cpu" into out[n]:
 *  - CUDA_VISIBLE_DEVICES set (Slurm's gres plugin sets it to the step's GPUs, renumbered from
 *    0 inside the process): "" or "NoDevFiles" -> cpu; one entry -> cuda:0; several ->
 *    cuda:(SLURM_LOCALID mod count), one GPU per task on the node;
 *  - else SLURM_STEP_GPUS or SLURM_JOB_GPUS (physical ids, every GPU visible): the entry at
 *    SLURM_LOCALID mod count -> cuda:<that id>;
 *  - else cpu.
 * SLURM_LOCALID missing or not a number counts as 0. env NULL: getenv. Returns 0, or KVM_EINVAL
 * (a GPU list entry that is not a non-negative number; the detail names the variable). */
int kvm_slurm_device(kvm_slurm_getenv_fn env, char *out, size_t n);

#endif
