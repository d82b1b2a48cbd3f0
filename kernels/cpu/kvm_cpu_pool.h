/* kvm_cpu_pool.h: a fork-join thread pool for the CPU backend's kernels. The calling
 * thread works too; workers sleep on a condition variable between jobs. Internal. */
#ifndef KVM_CPU_POOL_H
#define KVM_CPU_POOL_H

#include <stdint.h>

typedef void (*kvm_cpu_task_fn)(void *ctx, int64_t task, int worker);

/* Runs fn(ctx, t, worker) for every t in [0, n_tasks) on up to kvm__cpu_threads() threads
 * and returns when all are done. worker is in [0, kvm__cpu_threads()). Calls from several
 * threads at once are serialised (one job at a time); a call from inside a task runs
 * serially on the calling thread. */
void kvm__cpu_parallel_for(int64_t n_tasks, kvm_cpu_task_fn fn, void *ctx);

/* The same with at most `threads` threads for this job (≤ 0: the pool's count); the KVSculpt
 * batch runs its problems on the thread count its caller asked for without changing the pool's
 * setting for other users. */
void kvm__cpu_parallel_for_n(int threads, int64_t n_tasks, kvm_cpu_task_fn fn, void *ctx);

/* Threads the pool uses (≥ 1). Default: online CPUs, at most 64. */
int kvm__cpu_threads(void);

/* Sets the thread count used by later jobs (clamped to [1, 64]). */
void kvm__cpu_set_pool_threads(int n);

#endif
