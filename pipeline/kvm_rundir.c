/* kvm_rundir.c: making and removing run directories, and sweeping the temporary ones whose
 * owner process is gone. */
#include "pipeline/kvm_rundir.h"
#include "common/kvm_file.h"
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

/* /proc's file `leaf` of process pid into p[n]: /proc/self for this process (a /proc of another
 * pid namespace would name another process by its pid). */
static void proc_path(long pid, const char *leaf, char *p, size_t n)
{
    if (pid == (long)getpid())
        snprintf(p, n, "/proc/self/%s", leaf);
    else
        snprintf(p, n, "/proc/%ld/%s", pid, leaf);
}

/* /proc/PID/stat of pid into buf[size]; a pointer just past the command name's ')' (the name may
 * hold spaces and parentheses: the fields after it are the state, ...), or NULL when it cannot
 * be opened (buf empty) or holds no ')' (buf holds what was read). */
static const char *proc_stat(long pid, char *buf, size_t size)
{
    char p[64];
    buf[0] = '\0'; /* empty: not opened */
    proc_path(pid, "stat", p, sizeof p);
    FILE *f = fopen(p, "r");
    if (!f) return NULL;
    size_t n = fread(buf, 1, size - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *s = strrchr(buf, ')');
    return s ? s + 1 : NULL;
}

/* Start time of process pid in clock ticks since boot (/proc/PID/stat field 22), or 0 when
 * it is unknown (no /proc) and -1 when there is no such process. */
static long long start_time(long pid)
{
    char buf[1024];
    const char *s = proc_stat(pid, buf, sizeof buf);
    if (!s) {
        if (access("/proc/self/stat", R_OK) != 0) return kill((pid_t)pid, 0) == 0 || errno == EPERM ? 0 : -1;
        return buf[0] ? 0 : -1; /* read without a name: unknown; not opened: no such process */
    }
    long long v = 0;
    for (int field = 3; field <= 22 && s; field++) { /* s points before field `field` */
        while (*s == ' ') s++;
        if (field == 22) v = strtoll(s, NULL, 10);
        s = strchr(s, ' ');
    }
    return v;
}

/* 1 when process pid has exited and waits for its parent's wait (state Z in /proc/PID/stat). */
static int zombie(long pid)
{
    char buf[512];
    const char *s = proc_stat(pid, buf, sizeof buf);
    return s && s[0] == ' ' && s[1] == 'Z';
}

/* 16 hex digits of the boot id: a claim owner has 127 bytes */
static int boot_id(char out[17]) { return kvm_file_boot_id(out); }

void kvm_rundir_proc_id(long pid, char *out, size_t n)
{
    if (n) out[0] = '\0';
    char bid[17], ns[64];
    struct stat st;
    proc_path(pid, "ns/pid", ns, sizeof ns);
    long long ticks = start_time(pid);
    if (pid <= 0 || boot_id(bid) || stat(ns, &st) || ticks <= 0) return;
    snprintf(out, n, "B%sN%lluT%lld", bid, (unsigned long long)st.st_ino, ticks);
}

int kvm_rundir_pid_gone(long pid, const char *id)
{
    char mine[96], bid[17];
    struct stat st;
    if (pid <= 0 || !id || id[0] != 'B' || boot_id(bid) || stat("/proc/self/ns/pid", &st)) return 0;
    snprintf(mine, sizeof mine, "B%sN%llu", bid, (unsigned long long)st.st_ino);
    const size_t k = strlen(mine);
    if (strncmp(id, mine, k) || id[k] != 'T') return 0; /* another boot or pid namespace: its pids are not ours */
    char *end;
    long long ticks = strtoll(id + k + 1, &end, 10);
    if (*end || ticks <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0) return errno == ESRCH; /* EPERM: another user's live process */
    if (zombie(pid)) return 1;
    long long now = start_time(pid);
    return now > 0 && now != ticks; /* unreadable (hidepid): alive for all we know */
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

/* The temporary run directories this process made (kvm_rundir_make): one still there when the
 * process exits was kept for the user (a failed run's stage logs, its path printed), and gets
 * KVM_RUNDIR_KEPT so that a later start's sweep leaves it. A process killed (kill -9) writes
 * none: its directory is swept as before. */
#define OWNED_MAX 8
static char owned[OWNED_MAX][4096];
static int n_owned;
static pid_t owned_by; /* a forked child that exits before its exec is not the owner */

static void mark_kept(void)
{
    if (getpid() != owned_by) return;
    for (int i = 0; i < n_owned; i++) {
        char p[4200];
        struct stat st;
        if (stat(owned[i], &st) != 0 || !S_ISDIR(st.st_mode)) continue; /* removed: a clean run */
        snprintf(p, sizeof p, "%s/%s", owned[i], KVM_RUNDIR_KEPT);
        FILE *f = fopen(p, "w");
        if (!f) continue;
        fprintf(f,
                "kept by kvmill (pid %ld) for its stage logs: later kvmill run and serve starts leave this "
                "folder; remove it with rm -r when read\n",
                (long)getpid());
        fclose(f);
    }
}

static void remember_owned(const char *dir)
{
    if (n_owned == 0) atexit(mark_kept);
    owned_by = getpid();
    if (n_owned < OWNED_MAX) snprintf(owned[n_owned++], sizeof owned[0], "%s", dir);
}

/* 1 when directory p holds KVM_RUNDIR_KEPT. */
static int kept(const char *p)
{
    char m[4200];
    struct stat st;
    snprintf(m, sizeof m, "%s/%s", p, KVM_RUNDIR_KEPT);
    return lstat(m, &st) == 0;
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
        if (S_ISDIR(st.st_mode) && kept(p)) continue; /* a failed run's logs, kept for the user */
        if (S_ISDIR(st.st_mode)) kvm_rundir_remove(p);
        else if (S_ISREG(st.st_mode)) unlink(p);
        removed += lstat(p, &st) != 0;
    }
    closedir(d);
    return removed;
}

#define RUN_DIR_HINT ", or [run] run_dir" /* a run directory may be configured instead */

/* The template for prefix; one cut short by a long TMPDIR (mkdtemp said only "Invalid
 * argument", after a path that ended part way) is refused naming TMPDIR. */
static int tmp_template(const char *prefix, char *buf, size_t size, const char *hint)
{
    kvm_rundir_template(prefix, buf, size);
    size_t n = strlen(buf);
    if (n >= 6 && strcmp(buf + n - 6, "XXXXXX") == 0) return 0;
    return kvm_err(KVM_EINVAL,
                   "TMPDIR (%zu bytes) is too long for a temporary path of at most %zu bytes: set a "
                   "shorter TMPDIR%s",
                   strlen(tmp_dir()), size - 1, hint);
}

/* mkdtemp's or mkstemp's failure e on path: a TMPDIR that is missing, not a folder or not writable is the
 * environment's mistake (exit 2) and named as TMPDIR, not only by the path made from it. */
static int tmp_fail(const char *path, int e, const char *hint)
{
    const char *t = getenv("TMPDIR");
    if (t && *t && (e == ENOENT || e == ENOTDIR || e == EACCES || e == EROFS))
        return kvm_err(KVM_EINVAL, "cannot create %s in TMPDIR=%s: %s (set TMPDIR to a writable folder%s)",
                       strrchr(path, '/') ? strrchr(path, '/') + 1 : path, t, strerror(e), hint);
    return kvm_err(KVM_EIO, "cannot create %s: %s", path, strerror(e));
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
    int rc = tmp_template(prefix, buf, size, RUN_DIR_HINT);
    if (rc) return rc;
    if (!mkdtemp(buf)) return tmp_fail(buf, errno, RUN_DIR_HINT);
    remember_owned(buf);
    *own = 1;
    return 0;
}

int kvm_rundir_mkstemp(const char *prefix, char *buf, size_t size, int *fd)
{
    int rc = tmp_template(prefix, buf, size, "");
    if (rc) return rc;
    *fd = mkstemp(buf);
    return *fd < 0 ? tmp_fail(buf, errno, "") : 0;
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
