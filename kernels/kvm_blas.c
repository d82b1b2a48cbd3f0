/* kvm_blas.c: the process-wide lock around BLAS calls (kvm_blas.h). */
#include "kernels/kvm_blas.h"

#include <pthread.h>

static pthread_mutex_t blas_mu = PTHREAD_MUTEX_INITIALIZER;

void kvm_blas_lock(void) { pthread_mutex_lock(&blas_mu); }

void kvm_blas_unlock(void) { pthread_mutex_unlock(&blas_mu); }
