/* kvm_rundir.c: making and removing run directories, and sweeping the temporary ones whose
 * owner process is gone. */
#include "pipeline/kvm_rundir.h"
#include "common/kvm_error.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *tmp_dir(void)
{
    const char *t = getenv("TMPDIR");
    return t && *t ? t : "/tmp";
}

/* Start time of process pid in clock ticks since boot (/proc/PID/stat field 22), or 0 when
 * it is unknown (no /proc) and -1 when there is no such process. */
static long long start_time(long pid)
{
    char p[64], buf[1024];
    snprintf(p, sizeof p, "/proc/%ld/stat", pid);
    FILE *f = fopen(p, "r");
    if (!f) {
        if (access("/proc/self/stat", R_OK) != 0) return kill((pid_t)pid, 0) == 0 || errno == EPERM ? 0 : -1;
        return -1;
    }
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *s = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    long long v = 0;
    if (!s) return 0;
    s++;
    for (int field = 3; field <= 22 && s; field++) { /* s points before field `field` */
        while (*s == ' ') s++;
        if (field == 22) v = strtoll(s, NULL, 10);
        s = strchr(s, ' ');
    }
    return v;
}

void kvm_rundir_template(const char *prefix, char *buf, size_t size)
{
    long pid = (long)getpid();
    snprintf(buf, size, "%s/kvmill-%s.P%ld-S%lld.XXXXXX", tmp_dir(), prefix, pid, start_time(pid));
}

/* 1 when name is kvmill-{run,serve,serve-config}.P<pid>-S<start>.* and that owner is gone. */
static int stale(const char *name)
{
    static const char *const prefixes[] = {"kvmill-run.P", "kvmill-serve.P", "kvmill-serve-config.P"};
    const char *p = NULL;
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0] && !p; i++)
        if (!strncmp(name, prefixes[i], strlen(prefixes[i]))) p = name + strlen(prefixes[i]);
    if (!p) return 0;
    char *end;
    long pid = strtol(p, &end, 10);
    if (end == p || pid <= 0 || strncmp(end, "-S", 2)) return 0;
    p = end + 2;
    long long st = strtoll(p, &end, 10);
    if (end == p || *end != '.') return 0;
    long long now = start_time(pid);
    return now < 0 || (now > 0 && st > 0 && now != st);
}

int kvm_rundir_sweep(void)
{
    const char *t = tmp_dir();
    DIR *d = opendir(t);
    if (!d) return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, "kvmill-", 7) || !stale(e->d_name)) continue;
        char p[4096];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", t, e->d_name);
        if (lstat(p, &st) != 0 || st.st_uid != getuid()) continue;
        if (S_ISDIR(st.st_mode)) kvm_rundir_remove(p);
        else if (S_ISREG(st.st_mode)) unlink(p);
        removed += lstat(p, &st) != 0;
    }
    closedir(d);
    return removed;
}

int kvm_rundir_make(const char *configured, const char *prefix, char *buf, size_t size, int *own)
{
    *own = 0;
    if (configured && *configured) {
        snprintf(buf, size, "%s", configured);
        struct stat st;
        int e = mkdir(configured, 0700) && errno != EEXIST ? errno : 0;
        if (!e && (stat(configured, &st) || !S_ISDIR(st.st_mode))) e = ENOTDIR;
        if (e) /* a folder that cannot be there is the config's mistake (exit 2), not the run's */
            return kvm_err(e == ENOENT || e == ENOTDIR || e == EACCES ? KVM_EINVAL : KVM_EIO, "[run] run_dir %s: %s",
                           configured, strerror(e));
        return 0;
    }
    kvm_rundir_sweep();
    kvm_rundir_template(prefix, buf, size);
    if (!mkdtemp(buf)) return kvm_err(KVM_EIO, "cannot create a run directory %s: %s", buf, strerror(errno));
    *own = 1;
    return 0;
}

void kvm_rundir_remove(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    if (d) closedir(d);
    rmdir(dir);
}
