/* kvm_blas.h: one BLAS call at a time. kvmill links Debian's serial OpenBLAS (Makefile), which
 * is not safe to call from two threads at once: blas_memory_alloc hands out its work buffers
 * without a lock (valgrind's helgrind: the sgemm_kernel of one thread reads the panel that the
 * sgemm_oncopy of another wrote), so two concurrent calls (say cblas_sgemm on different data)
 * now and then give wrong results, or garbage that fails a later Cholesky. kvmill calls BLAS
 * from its own threads (the KVSculpt solver's per-problem workers: Attention Matching's start,
 * the float64 ridge equations, the baselines; the CPU backend's sgemm), so every call goes
 * between kvm_blas_lock and kvm_blas_unlock. The lock is process-wide and not recursive; no
 * kvmill code runs inside it. The default KVSculpt solve (float32 ridge equations, Select+Fit
 * start) makes no BLAS call but the float64 refit of an ill-conditioned problem. */
#ifndef KVM_BLAS_H
#define KVM_BLAS_H

/* Takes the process-wide BLAS lock (blocking until no other thread holds it); call right before
 * a cblas_* call, with nothing else inside. Not recursive: a thread holding it must not take it
 * again. Never fails (a static mutex). */
void kvm_blas_lock(void);
/* Releases the lock the calling thread took with kvm_blas_lock. */
void kvm_blas_unlock(void);

#endif
