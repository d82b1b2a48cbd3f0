/* kvm_store_compact.c: a compacted copy of the store (kvm_store_compact). The copy is written
 * into a temporary folder beside the destination, ".NAME.compact-XXXXXX", and renamed to the
 * destination only once it is complete and on disk: a compact killed midway (SIGKILL, a power
 * cut) left a truncated data.mdb under the destination's own name, which the next compact
 * refused as "already exists" and a user could take for a good copy. While a compact writes,
 * it holds an flock on its temporary folder, so a later compact can tell a leftover of a dead
 * one (unlocked) from a copy still being written (locked) and removes only the former, and only
 * when it holds nothing but LMDB's files. The look for leftovers and the creation of the new
 * folder happen under an flock on the destination's parent folder (lock_parent). */
#define _GNU_SOURCE /* renameat2, RENAME_NOREPLACE */
#include "store/kvm_store_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kvm_error.h"
#include "common/kvm_log.h"

#define TMP_TAG ".compact-" /* ".NAME" TMP_TAG "XXXXXX": the temporary folder of a copy */
/* ".NAME.compact-XXXXXX" is 16 characters longer than NAME: for a NAME near NAME_MAX it would be
 * too long a name (mkdtemp failed ENAMETOOLONG on a valid --out), so past this many characters
 * NAME's part is shortened to its first TMP_KEEP characters, '~' and a 64-bit hash of the whole
 * NAME in hex (two long names sharing the prefix do not share leftovers). */
#define TMP_SUFFIX_LEN (sizeof TMP_TAG - 1 + 6)
#define TMP_KEEP (NAME_MAX - 1 - 1 - 16 - TMP_SUFFIX_LEN) /* '.', '~', the hash */

/* The start of the temporary folder's name for destination base name `base`, ".STEM" TMP_TAG
 * (mkdtemp's XXXXXX follow), into out: what make_tmp creates and leftovers looks for, so both
 * follow the same rule. Returns its length, or -1 when it does not fit cap. */
static int tmp_prefix(const char *base, char *out, size_t cap)
{
    size_t len = strlen(base);
    int n;
    if (1 + len + TMP_SUFFIX_LEN <= NAME_MAX)
        n = snprintf(out, cap, ".%s" TMP_TAG, base);
    else {
        unsigned long long h = 1469598103934665603ULL; /* FNV-1a 64 */
        for (const unsigned char *c = (const unsigned char *)base; *c; c++)
            h = (h ^ *c) * 1099511628211ULL;
        n = snprintf(out, cap, ".%.*s~%016llx" TMP_TAG, (int)TMP_KEEP, base, h);
    }
    return n < 0 || (size_t)n >= cap ? -1 : n;
}

/* dst split into its parent folder and last part, trailing slashes dropped ("a/b/" gives "a"
 * and "b"; "b" gives "." and "b"; "/b" gives "/" and "b"). Returns 0, or KVM_EINVAL for a
 * path too long or without a last part. */
static int split_dst(const char *dst, char *parent, size_t pcap, char *base, size_t bcap)
{
    char path[PATH_MAX];
    int n = snprintf(path, sizeof path, "%s", dst);
    if (n < 0 || (size_t)n >= sizeof path) return kvm_err(KVM_EINVAL, "store compact: %s: path too long", dst);
    while (n > 1 && path[n - 1] == '/')
        path[--n] = '\0';
    char *slash = strrchr(path, '/');
    const char *last = slash ? slash + 1 : path;
    if (!*last || !strcmp(last, ".") || !strcmp(last, ".."))
        return kvm_err(KVM_EINVAL, "store compact: %s: name a new folder, not an existing one", dst);
    if ((size_t)snprintf(base, bcap, "%s", last) >= bcap)
        return kvm_err(KVM_EINVAL, "store compact: %s: path too long", dst);
    if (!slash)
        snprintf(parent, pcap, ".");
    else if (slash == path)
        snprintf(parent, pcap, "/");
    else {
        *slash = '\0';
        snprintf(parent, pcap, "%s", path);
    }
    return 0;
}

/* Refuses a destination inside the store's own directory: LMDB's directory would hold a second
 * environment, and the swap a caller prints (mv STORE STORE.old && mv DST STORE) would move the
 * copy away with the store, leaving none. dst's parent and the store are compared resolved
 * (realpath: "..", ".", symbolic links); a parent that does not resolve is left to mkdtemp to
 * refuse. Returns 0 or KVM_EINVAL. */
static int dst_outside_store(const kvm_store *s, const char *dst, const char *parent)
{
    char rp[PATH_MAX], rs[PATH_MAX];
    if (!realpath(parent, rp) || !realpath(s->path, rs)) return 0;
    size_t ls = strlen(rs);
    if (strncmp(rp, rs, ls) != 0 || (rp[ls] != '\0' && rp[ls] != '/')) return 0;
    return kvm_err(KVM_EINVAL,
                   "store compact: %s is inside the store %s: the copy would sit in LMDB's directory and be moved "
                   "away with the store when swapped in; name a directory outside it (default: %s.compact)",
                   dst, s->path, s->path);
}

/* 1 when folder `dir` holds nothing but LMDB's own files (data.mdb, lock.mdb) as plain files:
 * what a compact writes there, so nothing of the user's is lost by removing it. */
static int only_lmdb_files(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int ok = 1;
    struct dirent *e;
    while (ok && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        struct stat st;
        ok = (!strcmp(e->d_name, "data.mdb") || !strcmp(e->d_name, "lock.mdb")) &&
             fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
    }
    closedir(d);
    return ok;
}

/* Removes the copy folder `dir` (its LMDB files, then itself); errors are ignored: what
 * cannot be removed is named by the next compact. */
static void remove_copy(const char *dir)
{
    char f[PATH_MAX + 16];
    snprintf(f, sizeof f, "%s/data.mdb", dir);
    unlink(f);
    snprintf(f, sizeof f, "%s/lock.mdb", dir);
    unlink(f);
    rmdir(dir);
}

/* A leftover temporary folder `dir` of an earlier compact to the same destination: removed when
 * no compact holds its lock (its writer is gone) and it holds only LMDB's files; otherwise left
 * and, unless a live compact is writing it, named on stderr. */
static void leftover_one(const char *dir, const char *dst)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;                      /* not a folder (or gone): not ours */
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) { /* another compact is writing it now */
        close(fd);
        return;
    }
    kvm_log_field f[] = {KVM_LOG_S("path", dir), KVM_LOG_S("out", dst)};
    /* the texts start without "store compact:": the log prefix the command set
     * ("kvmill store compact: ") names it; with both, a line read "kvmill store compact: store compact: ..." */
    if (only_lmdb_files(dir)) {
        remove_copy(dir);
        kvm_log(KVM_LOG_INFO, "compact_leftover_removed", f, 2,
                "removed %s, the unfinished copy of an earlier compact to %s that was cut short", dir, dst);
    } else {
        kvm_log(KVM_LOG_WARN, "compact_leftover", f, 2,
                "%s looks like the unfinished copy of an earlier compact to %s but holds other files "
                "than data.mdb and lock.mdb: left as it is; look at it and remove it",
                dir, dst);
    }
    close(fd); /* after the removal: no compact may take the folder meanwhile */
}

/* Looks in `parent` for ".BASE.compact-XXXXXX" folders (BASE shortened as tmp_prefix says;
 * leftover_one on each). */
static void leftovers(const char *parent, const char *base, const char *dst)
{
    char prefix[NAME_MAX + 1];
    int np = tmp_prefix(base, prefix, sizeof prefix);
    DIR *d = opendir(parent);
    if (!d || np < 0) {
        if (d) closedir(d);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, prefix, (size_t)np) != 0 || strlen(e->d_name) != (size_t)np + 6) continue;
        char dir[PATH_MAX + NAME_MAX + 2];
        snprintf(dir, sizeof dir, "%s/%s", parent, e->d_name);
        leftover_one(dir, dst);
    }
    closedir(d);
}

/* An flock on folder `parent`, held from the look for leftovers until the new temporary
 * folder is locked: between mkdtemp and its flock, a second compact to the same destination
 * found the new folder unlocked and empty, took it for a dead compact's leftover and removed
 * it, and the first failed ("cannot lock", or the copy into a folder that was gone). Another
 * compact holds it for milliseconds; a holder that keeps it (`flock DIR kvmill store compact`
 * hands this process a descriptor holding the lock, which a blocking flock would wait on
 * forever) is waited for 5 s, then said and passed by. Returns the descriptor to close, or
 * -1 where the parent cannot be opened or locked (the look goes on unlocked, as before: a
 * parent mkdtemp refuses is named there). */
static int lock_parent(const char *parent)
{
    int fd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    for (int i = 0; fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0; i++) {
        if (errno != EWOULDBLOCK || i >= 500) {
            if (errno == EWOULDBLOCK) {
                kvm_log_field f[] = {KVM_LOG_S("path", parent)};
                kvm_log(KVM_LOG_WARN, "compact_parent_locked", f, 1,
                        "%s stayed locked (flock) for 5 s: looking for leftovers of earlier compacts without it",
                        parent);
            }
            close(fd);
            return -1;
        }
        usleep(10000);
    }
    return fd;
}

/* Creates the temporary folder tmp (".BASE.compact-XXXXXX" in parent, BASE shortened as
 * tmp_prefix says) and locks it (*lock_fd)
 * for the time of the copy. A missing, unwritable or non-folder parent is the caller's path:
 * KVM_EINVAL naming dst; else KVM_EIO. */
static int make_tmp(const char *parent, const char *base, const char *dst, char *tmp, size_t cap, int *lock_fd)
{
    char prefix[NAME_MAX + 1];
    int n = tmp_prefix(base, prefix, sizeof prefix) < 0 ? -1 : snprintf(tmp, cap, "%s/%sXXXXXX", parent, prefix);
    if (n < 0 || (size_t)n >= cap) return kvm_err(KVM_EINVAL, "store compact: %s: path too long", dst);
    if (!mkdtemp(tmp)) {
        int e = errno, bad_path = e == ENOENT || e == ENOTDIR || e == EACCES || e == EROFS || e == ENAMETOOLONG;
        return kvm_err(bad_path ? KVM_EINVAL : KVM_EIO, "store compact: cannot create %s: %s", dst, strerror(e));
    }
    *lock_fd = open(tmp, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*lock_fd < 0 || flock(*lock_fd, LOCK_EX) != 0) {
        int e = errno;
        if (*lock_fd >= 0) close(*lock_fd);
        *lock_fd = -1;
        rmdir(tmp);
        return kvm_err(KVM_EIO, "store compact: cannot lock %s: %s", tmp, strerror(e));
    }
    /* mkdtemp makes it 0700 and the rename keeps that: the copy swapped in would shut out the
     * group a store made by kvm_store_open (0775 less the umask) lets in */
    mode_t mask = umask(0);
    umask(mask);
    fchmod(*lock_fd, 0775 & ~mask);
    return 0;
}

/* fsync of a file or folder opened read-only (fsync needs no write access). */
static int sync_path(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}

/* The copy itself into tmp, in one read transaction, under the handle's lock. */
static int copy_into(kvm_store *s, const char *tmp, const char *dst)
{
    int rc = kvm_store__lock(s);
    if (rc) return rc;
    MDB_txn *txn = NULL; /* the copy walks every page: they pass the check first */
    rc = kvm_store__read_begin(s, &txn);
    if (txn) mdb_txn_abort(txn);
    if (rc) {
        kvm_store__unlock(s);
        return rc;
    }
    int mrc = mdb_env_copy2(s->env, tmp, MDB_CP_COMPACT);
    kvm_store__unlock(s);
    if (mrc) return kvm_err(KVM_EIO, "store %s: compacted copy into %s failed: %s", s->path, dst, mdb_strerror(mrc));
    return 0;
}

/* The finished copy tmp on disk, then renamed to dst and the rename on disk. A dst that
 * appeared meanwhile is refused (rename would replace an empty folder): renameat2's
 * RENAME_NOREPLACE refuses it atomically; where the file system lacks it, an lstat just before
 * the rename does, leaving a window of microseconds. */
static int publish(const char *tmp, const char *dst, const char *parent)
{
    char data[PATH_MAX + 16];
    snprintf(data, sizeof data, "%s/data.mdb", tmp);
    struct stat st;
    if (sync_path(data) != 0 || sync_path(tmp) != 0)
        return kvm_err(KVM_EIO, "store compact: cannot sync the copy %s: %s", data, strerror(errno));
    int rc = -1;
    errno = 0;          /* without RENAME_NOREPLACE: no EEXIST left over from an earlier call */
#ifdef RENAME_NOREPLACE /* glibc >= 2.28: no window between the check and the rename */
    rc = renameat2(AT_FDCWD, tmp, AT_FDCWD, dst, RENAME_NOREPLACE);
    if (rc != 0 && errno != EINVAL && errno != ENOSYS && errno != EEXIST)
        return kvm_err(KVM_EIO, "store compact: cannot rename %s to %s: %s", tmp, dst, strerror(errno));
#endif
    if (rc != 0 && (errno == EEXIST || lstat(dst, &st) == 0))
        return kvm_err(KVM_EINVAL, "store compact: %s was created while the copy was written: name a new directory",
                       dst);
    if (rc != 0 && rename(tmp, dst) != 0) /* a file system without RENAME_NOREPLACE: checked just before */
        return kvm_err(KVM_EIO, "store compact: cannot rename %s to %s: %s", tmp, dst, strerror(errno));
    sync_path(parent); /* best effort: the copy is whole under either name */
    return 0;
}

int kvm_store_compact(kvm_store *s, const char *dst, int64_t *copy_bytes)
{
    struct stat st;
    if (!dst || !*dst) return kvm_err(KVM_EINVAL, "store compact: empty destination");
    if (lstat(dst, &st) == 0) /* lstat: a dangling symbolic link exists too (mkdir would fail "as I/O") */
        return kvm_err(KVM_EINVAL, "store compact: %s already exists%s: name a new directory", dst,
                       S_ISLNK(st.st_mode) ? " (a symbolic link)" : "");
    char parent[PATH_MAX], base[NAME_MAX + 1], tmp[PATH_MAX];
    int rc = split_dst(dst, parent, sizeof parent, base, sizeof base);
    if (!rc) rc = dst_outside_store(s, dst, parent);
    if (rc) return rc;
    int lock_fd = -1, parent_fd = lock_parent(parent);
    leftovers(parent, base, dst);
    rc = make_tmp(parent, base, dst, tmp, sizeof tmp, &lock_fd);
    if (parent_fd >= 0) close(parent_fd); /* the new folder is locked: leftovers() passes it by */
    if (rc) return rc;
    rc = copy_into(s, tmp, dst);
    if (!rc) rc = publish(tmp, dst, parent);
    if (rc) remove_copy(tmp); /* a partial copy is never left (a full disk, a damaged page) */
    close(lock_fd);
    if (rc) return rc;
    char data[PATH_MAX + 16];
    snprintf(data, sizeof data, "%s/data.mdb", dst);
    if (copy_bytes) *copy_bytes = stat(data, &st) == 0 ? (int64_t)st.st_size : 0;
    return 0;
}
