/* kvm_store_here.c: is the store this process opened still the one at its path? A store is
 * folder + data.mdb + lock.mdb; any of the three can be moved, removed or replaced under a
 * running process (a swap after `store compact`, an `rm -rf`, a /tmp cleaner taking lock.mdb).
 * LMDB goes on with the files it has open, so without this check a process committed into a
 * deleted store and reported the documents stored (nothing was on disk once it exited), or, with
 * lock.mdb replaced, wrote beside a process that opened the new lock file: two writers with no
 * common mutex, and reader slots the other cannot see, whose reuse of pages a read then took for
 * a damaged data.mdb. Stats only, a few microseconds per transaction. */
#include "store/kvm_store_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "common/kvm_error.h"
#include "common/kvm_file.h"

int kvm_store__at_path(const kvm_store *s)
{
    struct stat dir_st, data_st, open_st, lock_st;
    mdb_filehandle_t fd;
    if ((s->dir_dev == 0 && s->dir_ino == 0) || mdb_env_get_fd(s->env, &fd) || fstat(fd, &open_st))
        return KVM_STORE__AT_SAME; /* nothing to compare with */
    char data[4200], lock[4200];
    snprintf(data, sizeof data, "%s/data.mdb", s->path);
    snprintf(lock, sizeof lock, "%s/lock.mdb", s->path);
    if (stat(s->path, &dir_st) || stat(data, &data_st) || !S_ISREG(data_st.st_mode)) return KVM_STORE__AT_GONE;
    const int same_dir = dir_st.st_dev == s->dir_dev && dir_st.st_ino == s->dir_ino;
    const int same_lock =
        s->lock_ino && stat(lock, &lock_st) == 0 && lock_st.st_dev == s->lock_dev && lock_st.st_ino == s->lock_ino;
    if (same_dir && data_st.st_dev == open_st.st_dev && data_st.st_ino == open_st.st_ino)
        return same_lock || !s->lock_ino ? KVM_STORE__AT_SAME : KVM_STORE__AT_LOCK_LOST;
    if (!same_dir) return KVM_STORE__AT_REPLACED;
    return same_lock ? KVM_STORE__AT_GONE : KVM_STORE__AT_REPLACED;
}

int kvm_store__at_err(const kvm_store *s, int at)
{
    if (at == KVM_STORE__AT_LOCK_LOST)
        return kvm_err(KVM_ESTATE,
                       "the store %s: its lock.mdb was removed or replaced since this process opened it: a process "
                       "that opens the store now uses another lock file, and could write or reuse pages beside this "
                       "one unseen (it may have already); stop every process that has the store "
                       "open, then start them again",
                       s->path);
    if (at == KVM_STORE__AT_GONE)
        return kvm_err(KVM_ESTATE,
                       "the store %s is gone since this process opened it (the folder moved or removed, or another "
                       "data.mdb put inside it): what it would read or write is in no store anyone else sees; put "
                       "the store back, or move a whole store folder there (mv STORE STORE.old && mv COPY STORE)",
                       s->path);
    if (at == KVM_STORE__AT_REPLACED)
        return kvm_err(KVM_ESTATE,
                       "the store %s was replaced since this process opened it (another folder or data.mdb at its "
                       "path): what it would write would go into the store moved away; start the command again",
                       s->path);
    return 0;
}

int kvm_store_check_here(const kvm_store *s) { return s ? kvm_store__still_here(s, 1) : 0; }

int kvm_store__still_here(const kvm_store *s, int writing)
{
    const int at = kvm_store__at_path(s);
    if (at == KVM_STORE__AT_SAME || (!writing && at != KVM_STORE__AT_LOCK_LOST)) return 0;
    return kvm_store__at_err(s, at);
}

int kvm_store_place_id(const char *path, kvm_store_id *out)
{
    char data[4200], boot[17];
    snprintf(data, sizeof data, "%s/data.mdb", path);
    struct stat st;
    if (stat(data, &st) != 0) return kvm_err(KVM_ENOTFOUND, "%s: no store (%s)", data, strerror(errno));
    if (kvm_file_boot_id(boot) != 0) return kvm_err(KVM_EIO, "the kernel's boot id is unreadable");
    char place[96];
    const int n = snprintf(place, sizeof place, "kvmill-store-place %s %llu %llu", boot, (unsigned long long)st.st_dev,
                           (unsigned long long)st.st_ino);
    kvm_store_hash_bytes(place, (size_t)n, out);
    return 0;
}
