/* kvm_cpu_pool.c: fork-join pool: a job is (fn, ctx, n_tasks); tasks are claimed with an
 * atomic counter so uneven tasks balance; a generation number wakes the workers. */
#include "kernels/cpu/kvm_cpu_pool.h"
#include "common/kvm_cpus.h"
#include "kernels/kvm_fpmode.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

enum { KVM_POOL_MAX = 64 };

static struct {
    pthread_mutex_t mu;      /* guards everything below but the counters */
    pthread_cond_t wake;     /* a new generation started */
    pthread_cond_t done;     /* a worker finished its share */
    pthread_mutex_t job_mu;  /* one job at a time */
    pthread_once_t once;
    int n_threads;           /* threads used per job, caller included */
    int job_threads;         /* threads of the current job (≤ n_threads) */
    int n_started;           /* worker threads created */
    uint64_t generation;     /* bumped per job */
    int active;              /* workers still in the current job */
    kvm_cpu_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_llong next;       /* next task to claim */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
          PTHREAD_ONCE_INIT, 0, 0, 0, 0, 0, NULL, NULL, 0, 0};

static _Thread_local int in_task;

static void init_threads(void)
{
    if (pool.n_threads == 0) {
        /* the CPUs this process may use (affinity, cgroup quota), not the host's: a pool
         * of 64 threads on a 2-CPU quota stalls every thread of the process */
        int n = kvm_cpus_usable();
        pool.n_threads = n > KVM_POOL_MAX ? KVM_POOL_MAX : n;
    }
}

int kvm__cpu_threads(void)
{
    pthread_once(&pool.once, init_threads);
    return pool.n_threads;
}

void kvm__cpu_set_pool_threads(int n)
{
    pthread_once(&pool.once, init_threads);
    pthread_mutex_lock(&pool.job_mu);
    pool.n_threads = n < 1 ? 1 : n > KVM_POOL_MAX ? KVM_POOL_MAX : n;
    pthread_mutex_unlock(&pool.job_mu);
}

static void run_tasks(int worker)
{
    int64_t t;
    kvm_fpmode fm = kvm_fpmode_flush_enter(); /* subnormals flushed while computing, restored after */
    in_task = 1;
    while ((t = atomic_fetch_add(&pool.next, 1)) < pool.n_tasks) pool.fn(pool.ctx, t, worker);
    in_task = 0;
    kvm_fpmode_restore(fm);
}

static void *worker_main(void *arg)
{
    int id = (int)(intptr_t)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.generation;
        if (id >= pool.job_threads) continue; /* not needed for this job */
        pthread_mutex_unlock(&pool.mu);
        run_tasks(id);
        pthread_mutex_lock(&pool.mu);
        if (--pool.active == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

void kvm__cpu_parallel_for(int64_t n_tasks, kvm_cpu_task_fn fn, void *ctx)
{
    kvm__cpu_parallel_for_n(0, n_tasks, fn, ctx);
}

void kvm__cpu_parallel_for_n(int threads, int64_t n_tasks, kvm_cpu_task_fn fn, void *ctx)
{
    int n = kvm__cpu_threads();
    if (threads > 0 && threads < n) n = threads;
    if (in_task || n == 1 || n_tasks <= 1) {
        kvm_fpmode fm = kvm_fpmode_flush_enter();
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        kvm_fpmode_restore(fm);
        return;
    }
    pthread_mutex_lock(&pool.job_mu);
    n = threads > 0 && threads < pool.n_threads ? threads : pool.n_threads;
    pthread_mutex_lock(&pool.mu);
    while (pool.n_started < n - 1) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker_main, (void *)(intptr_t)(pool.n_started + 1)) != 0) break;
        pthread_detach(th);
        pool.n_started++;
    }
    int helpers = pool.n_started < n - 1 ? pool.n_started : n - 1;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_tasks = n_tasks;
    pool.job_threads = helpers + 1;
    atomic_store(&pool.next, 0);
    pool.active = helpers;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    run_tasks(0);
    pthread_mutex_lock(&pool.mu);
    while (pool.active > 0) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.job_mu);
}
