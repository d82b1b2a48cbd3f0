/* kvm_cpus.c: the CPUs this process may use (see kvm_cpus.h). */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "common/kvm_cpus.h"

#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* ceil(quota / period) for positive numbers, else 0 (no limit). */
static int quota_cpus(long long quota, long long period)
{
    if (quota <= 0 || period <= 0) return 0;
    long long n = (quota + period - 1) / period;
    return n > INT_MAX ? INT_MAX : (int)n;
}

/* v2: the limit in DIR/cpu.max ("max 100000" or "150000 100000"), else 0. */
static int v2_limit(const char *dir)
{
    char path[PATH_MAX + 16], q[32];
    long long quota = 0, period = 0;
    snprintf(path, sizeof path, "%s/cpu.max", dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = fscanf(f, "%31s %lld", q, &period);
    fclose(f);
    if (n != 2 || sscanf(q, "%lld", &quota) != 1) return 0;
    return quota_cpus(quota, period);
}

/* v1: the limit in DIR/cpu.cfs_quota_us and cpu.cfs_period_us (quota -1: none), else 0. */
static int v1_limit(const char *dir)
{
    char path[PATH_MAX + 32];
    long long quota = 0, period = 0;
    snprintf(path, sizeof path, "%s/cpu.cfs_quota_us", dir);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int ok = fscanf(f, "%lld", &quota) == 1;
    fclose(f);
    snprintf(path, sizeof path, "%s/cpu.cfs_period_us", dir);
    if (!ok || !(f = fopen(path, "r"))) return 0;
    ok = fscanf(f, "%lld", &period) == 1;
    fclose(f);
    return ok ? quota_cpus(quota, period) : 0;
}

/* The smallest limit over base + rel and its ancestors up to base (rel starts with '/'). */
static int walk_up(const char *base, const char *rel, int v2)
{
    char dir[PATH_MAX];
    int best = 0, len = snprintf(dir, sizeof dir, "%s%s", base, rel);
    if (len < 0 || len >= (int)sizeof dir) return 0;
    size_t base_len = strlen(base);
    for (;;) {
        size_t n = strlen(dir);
        while (n > base_len && dir[n - 1] == '/')
            dir[--n] = '\0';
        int lim = v2 ? v2_limit(dir) : v1_limit(dir);
        if (lim > 0 && (best == 0 || lim < best)) best = lim;
        char *slash = strrchr(dir, '/');
        if (n <= base_len || !slash || (size_t)(slash - dir) < base_len) break;
        *slash = '\0';
    }
    return best;
}

int kvm_cpus_quota(const char *cgroup_root, const char *self_cgroup)
{
    FILE *f = fopen(self_cgroup, "r");
    if (!f) return 0;
    char line[PATH_MAX + 64], base[PATH_MAX];
    int best = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        /* "HIERARCHY-ID:CONTROLLERS:PATH"; v2's line is "0::PATH" */
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2 || c2[1] != '/') continue;
        int lim = 0;
        if (c2 == c1 + 1 && !strncmp(line, "0:", 2)) {
            lim = walk_up(cgroup_root, c2 + 1, 1);
        } else {
            *c2 = '\0';
            int has_cpu = 0;
            char *save = NULL;
            for (char *tok = strtok_r(c1 + 1, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
                if (!strcmp(tok, "cpu")) has_cpu = 1;
            if (!has_cpu) continue;
            /* the controller's folder: cpu,cpuacct (Debian, systemd) or cpu */
            const char *names[] = {"cpu,cpuacct", "cpu"};
            for (int i = 0; i < 2 && lim == 0; i++) {
                snprintf(base, sizeof base, "%s/%s", cgroup_root, names[i]);
                lim = walk_up(base, c2 + 1, 0);
            }
        }
        if (lim > 0 && (best == 0 || lim < best)) best = lim;
    }
    fclose(f);
    return best;
}

int kvm_cpus_usable(void)
{
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int n = online < 1 ? 1 : online > INT_MAX ? INT_MAX : (int)online;
    long conf = sysconf(_SC_NPROCESSORS_CONF); /* a fixed cpu_set_t holds 1,024: EINVAL past that */
    const int cap = conf > 1024 && conf < (1 << 20) ? (int)conf : 1024;
    cpu_set_t *set = CPU_ALLOC(cap);
    const size_t size = CPU_ALLOC_SIZE(cap);
    if (set && sched_getaffinity(0, size, set) == 0 && CPU_COUNT_S(size, set) > 0) n = CPU_COUNT_S(size, set);
    if (set) CPU_FREE(set);
    int quota = kvm_cpus_quota("/sys/fs/cgroup", "/proc/self/cgroup");
    if (quota > 0 && quota < n) n = quota;
    return n;
}
