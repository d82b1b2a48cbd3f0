/* bench_util.h: clocks and the median shared by the benchmark programs in bench/ (header-only:
 * each benchmark is one .c file linked against libkvmill). */
#ifndef BENCH_UTIL_H
#define BENCH_UTIL_H

#include "compress/eval/kvm_eval.h"

#include <stdint.h>
#include <time.h>

/* Seconds on clock `id`: CLOCK_MONOTONIC (wall), CLOCK_PROCESS_CPUTIME_ID (CPU of all the
 * process's threads) or CLOCK_THREAD_CPUTIME_ID (the calling thread's CPU). */
static inline double bench_clock_s(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wall seconds (CLOCK_MONOTONIC): differences of two calls time a span. */
static inline double bench_wall_s(void) { return bench_clock_s(CLOCK_MONOTONIC); }

/* Median of v[0..n), n ≥ 1 (v is sorted in place): the harness's quantile at 0.5, so an even
 * count gives the mean of the middle two. */
static inline double bench_median(double *v, int n) { return kvm_eval_quantile(v, (int64_t)n, 0.5); }

#endif
