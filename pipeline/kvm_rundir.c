/* kvm_rundir.c: making and removing run directories. */
#include "pipeline/kvm_rundir.h"
#include "common/kvm_error.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int kvm_rundir_make(const char *configured, const char *prefix, char *buf, size_t size, int *own)
{
    *own = 0;
    if (configured && *configured) {
        snprintf(buf, size, "%s", configured);
        if (mkdir(configured, 0700) && errno != EEXIST)
            return kvm_err(KVM_EIO, "[run] run_dir %s: %s", configured, strerror(errno));
        return 0;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(buf, size, "%s/kvmill-%s.XXXXXX", tmp && *tmp ? tmp : "/tmp", prefix);
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
