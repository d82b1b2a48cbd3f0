/* kvm_cpus.h: how many CPUs this process may really use, for the default size of the CPU
 * thread pool (kernels/cpu/kvm_cpu_pool.c). sysconf(_SC_NPROCESSORS_ONLN) counts the host's
 * online CPUs: in a container limited to 2 CPUs on a 64-core host (a CPU quota, `docker
 * --cpus 2`, a Slurm job's cgroup, a CI runner) a pool of 64 threads then shares 2 CPUs' time,
 * every thread is frozen for the rest of each quota period, and heartbeats and deadlines slip.
 * The count here is the smaller of the CPUs in the affinity mask (taskset, cpusets) and the
 * cgroup's CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us, over the process's
 * cgroup and its ancestors), rounded up. */
#ifndef KVM_CPUS_H
#define KVM_CPUS_H

/* The CPUs this process may use (>= 1): min(affinity mask's CPUs, ceil(cgroup quota)); the
 * online CPUs when the affinity mask cannot be read; no quota found (none set, no cgroup
 * filesystem, unreadable or malformed files) leaves the affinity count. Reads /proc and
 * /sys/fs/cgroup each call (cache the result). Thread-safe; never fails. */
int kvm_cpus_usable(void);

/* kvm_cpus_usable's quota part, for tests: the CPU limit (ceil(quota / period), >= 1) that
 * the cgroup files under `cgroup_root` (the cgroup filesystem's mount point, v2 unified or v1
 * with a cpu or cpu,cpuacct controller folder) set for the process whose /proc/self/cgroup
 * text is in the file `self_cgroup`: the smallest over the process's cgroup and its
 * ancestors. Returns 0 when no quota is set or nothing could be read. */
int kvm_cpus_quota(const char *cgroup_root, const char *self_cgroup);

#endif
