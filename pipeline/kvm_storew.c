/* kvm_storew.c: the store's write path: store options from settings, and claims. */
#include "pipeline/kvm_storew.h"
#include "pipeline/kvm_rundir.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

void kvm_storew_opts(const kvm_config *c, int read_only, kvm_store_opts *o)
{
    *o = (kvm_store_opts){.map_size_bytes = kvm_config_int(c, "store", "map_size_mb") << 20,
                          .map_max_bytes = kvm_config_int(c, "store", "map_max_mb") << 20,
                          .cap_bytes = kvm_config_int(c, "store", "cap_mb") << 20,
                          .read_only = read_only};
    if (read_only) o->cap_bytes = 0; /* a reader records nothing */
}

int kvm_storew_open(const kvm_config *c, const char *path, int read_only, kvm_store **out)
{
    kvm_store_opts o;
    kvm_storew_opts(c, read_only, &o);
    return kvm_store_open(path ? path : kvm_config_str(c, "store", "path"), &o, out);
}

void kvm_storew_worker_opts(const kvm_config *c, int read_only, kvm_store_opts *o)
{
    kvm_storew_opts(c, read_only, o);
    o->cap_bytes = 0;  /* the store's owner records the cap, never a worker */
    o->must_exist = 1; /* the run made it: a worker that came after the folder was moved away made a
                        * new empty store there and committed into it, beside the run's */
}

void kvm_storew_cap_note(kvm_store *s, const kvm_config *c)
{
    static int said; /* once per process: a worker opens the store once, or once per job's settings */
    int64_t want = kvm_config_int(c, "store", "cap_mb") << 20;
    kvm_store_stats t;
    if (said || !s || want <= 0 || kvm_store_stats_get(s, &t) || t.cap_bytes == want) return;
    said = 1;
    char cap[64] = "none";
    if (t.cap_bytes > 0) snprintf(cap, sizeof cap, "%lld MiB", (long long)(t.cap_bytes >> 20));
    kvm_log_field f[] = {KVM_LOG_S("store", kvm_store_path(s)), KVM_LOG_I("cap_bytes", t.cap_bytes),
                         KVM_LOG_I("config_cap_bytes", want)};
    kvm_log(KVM_LOG_WARN, "store_cap_kept", f, 3,
            "[store] cap_mb = %lld of this worker's settings is not applied: store %s keeps its cap (%s); a cap is "
            "set by the store's owner (kvmill run, calibrate, serve or a kvmill store command with that config), "
            "never by a worker",
            (long long)(want >> 20), kvm_store_path(s), cap);
}

int kvm_storew_open_worker(const kvm_config *c, const char *path, kvm_store **out)
{
    kvm_store_opts o;
    kvm_storew_worker_opts(c, 0, &o);
    int rc = kvm_store_open(path ? path : kvm_config_str(c, "store", "path"), &o, out);
    if (!rc) kvm_storew_cap_note(*out, c);
    return rc;
}

int kvm_storew_must_exist(const char *what, const char *path)
{
    struct stat sb;
    char data[4200];
    if (stat(path, &sb) != 0)
        return kvm_err(KVM_ENOTFOUND, "%s %s: no such store (%s): the run that sends the jobs made its store; name it",
                       what, path, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return kvm_err(KVM_EFORMAT, "%s %s: not a store directory (an LMDB store is a folder holding data.mdb)", what,
                       path);
    snprintf(data, sizeof data, "%s/data.mdb", path);
    if (stat(data, &sb) != 0)
        return kvm_err(KVM_ENOTFOUND,
                       "%s %s: the directory holds no store (no data.mdb): the run that sends the jobs made its "
                       "store; name it",
                       what, path);
    return 0;
}

void kvm_storew_owner(char *out, size_t size, char *host, size_t host_size)
{
    char h[64] = "";
    if (gethostname(h, sizeof h - 1) != 0) snprintf(h, sizeof h, "unknown");
    h[sizeof h - 1] = '\0';
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(host, host_size, "%s", h);
    char id[96];
    kvm_rundir_proc_id((long)getpid(), id, sizeof id);
    snprintf(out, size, "run:%.48s:%ld:%lld%s%s", h, (long)getpid(), (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000,
             *id ? ":" : "", id);
}

int kvm_storew_owner_gone(const char *owner, const char *claim_host)
{
    char h[64] = "";
    if (gethostname(h, sizeof h - 1) != 0) return 0;
    h[sizeof h - 1] = '\0';
    if (strcmp(claim_host, h) || strncmp(owner, "run:", 4)) return 0;
    const char *p = strchr(owner + 4, ':'); /* after the host name, which holds no ':' */
    if (!p) return 0;
    char *end;
    long pid = strtol(p + 1, &end, 10);
    if (end == p + 1 || *end != ':' || pid <= 0) return 0;
    strtoll(end + 1, &end, 10); /* the start time (wall clock): not used to judge */
    if (*end != ':') return 0;
    return kvm_rundir_pid_gone(pid, end + 1);
}

int kvm_storew_claim(kvm_store *s, const kvm_store_cache_key *key, const char *owner, const char *host, int64_t ttl_ms,
                     int *taken, kvm_store_claim *holder)
{
    return kvm_store_claim_take(s, key, owner, host, ttl_ms, taken, holder);
}

int kvm_storew_renew(kvm_store *s, const char *owner, int64_t ttl_ms)
{
    return kvm_store_claim_renew(s, owner, ttl_ms, NULL);
}

int kvm_storew_release(kvm_store *s, const char *owner) { return kvm_store_claim_release(s, owner, NULL); }
