/* kvm_store.c: the store handle: opening the LMDB environment and its named databases,
 * the write-transaction wrapper that grows the map on MDB_MAP_FULL and adopts a map grown
 * by another process (MDB_MAP_RESIZED), LMDB error mapping, bookkeeping values and stats. */
#include "store/kvm_store_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/kvm_error.h"

#define KVM_STORE__DEFAULT_MAP (64ll << 20)
#define KVM_STORE__DEFAULT_MAX (1ll << 40)
#define KVM_STORE__MAP_ALIGN (64ll << 10)
#define KVM_STORE__MAX_READERS 510

static const char *const kvm_store__db_names[KVM_STORE__DB_COUNT] = {
    "meta", "models", "docs", "strategies", "caches", "atime", "lru", "files", "claims", "docnames",
};

/* A write that failed with ENOSPC, or with EIO on a device with (almost) nothing free, is a
 * full disk: LMDB reports a failed page write on a full filesystem as EIO. */
static int device_full(const char *path, int rc, long long *free_bytes)
{
    struct statvfs v;
    *free_bytes = -1;
    if (path && statvfs(path, &v) == 0) *free_bytes = (long long)v.f_bavail * (long long)v.f_frsize;
    if (rc == ENOSPC) return 1;
    return rc == EIO && *free_bytes >= 0 && *free_bytes < (64LL << 20);
}

/* A failed write under a finite file size limit (ulimit -f, RLIMIT_FSIZE): the write that
 * crosses it is cut short, which LMDB reports as EIO (as a failing disk), the next one fails
 * EFBIG. Into why[n] the limit and data.mdb's size; 1 when it applies. */
static int file_limit(const char *path, int rc, char *why, size_t n)
{
    struct rlimit lim;
    if ((rc != EIO && rc != EFBIG) || !path || getrlimit(RLIMIT_FSIZE, &lim) || lim.rlim_cur == RLIM_INFINITY) return 0;
    char data[4200];
    struct stat st;
    snprintf(data, sizeof data, "%s/data.mdb", path);
    long long size = stat(data, &st) == 0 ? (long long)st.st_size : -1;
    /* an EIO far below the limit is the disk's (or the network's), not the limit's: the write
     * cut short by the limit left data.mdb at it */
    if (rc == EIO && (size < 0 || (unsigned long long)size + (1ULL << 20) < (unsigned long long)lim.rlim_cur)) return 0;
    snprintf(why, n, "the file size limit (ulimit -f, RLIMIT_FSIZE) of %llu KiB stops data.mdb (%lld KiB) from growing",
             (unsigned long long)lim.rlim_cur / 1024, size / 1024);
    return 1;
}

int kvm_store__mdb(kvm_store *s, int rc, const char *what)
{
    const char *path = s ? s->path : "?";
    if (s) s->mdb_rc = rc;
    long long free_bytes;
    if ((rc == ENOSPC || rc == EIO) && device_full(s ? s->path : NULL, rc, &free_bytes))
        return kvm_err(KVM_EFULL, "store %s: %s: no space left on the store's device (%lld KiB free)", path, what,
                       free_bytes / 1024);
    char limit[256];
    if (file_limit(s ? s->path : NULL, rc, limit, sizeof limit))
        return kvm_err(KVM_EFULL, "store %s: %s: %s: raise it (ulimit -f unlimited) and run again", path, what, limit);
    int st;
    switch (rc) {
    case MDB_NOTFOUND:
    case ENOENT: st = KVM_ENOTFOUND; break;
    case MDB_MAP_FULL:
    case MDB_TXN_FULL:
    case MDB_DBS_FULL:
        st = KVM_EFULL;
        break;
    case MDB_READERS_FULL: /* other processes' reads hold every slot: one frees when they end */
        return kvm_err(KVM_EBUSY,
                       "store %s: %s: LMDB's reader table is full (%u slots, fixed by the process that created "
                       "lock.mdb): too many processes or threads are reading the store at once; try again later",
                       path, what, s ? s->max_readers : 0u);
    case MDB_CORRUPTED:
    case MDB_PAGE_NOTFOUND:
    case MDB_PANIC: st = KVM_ECORRUPT; break;
    case MDB_INVALID:
    case MDB_VERSION_MISMATCH:
    case MDB_INCOMPATIBLE: st = KVM_EFORMAT; break;
    case MDB_BAD_VALSIZE:
    case EINVAL: st = KVM_EINVAL; break;
    case ENOMEM: st = KVM_ENOMEM; break;
    default: st = KVM_EIO; break;
    }
    return kvm_err(st, "store %s: %s: %s", path, what, mdb_strerror(rc));
}

int kvm_store__lock(kvm_store *s)
{
    if (!s) return kvm_err(KVM_EINVAL, "store: NULL handle");
    if (getpid() != s->pid)
        return kvm_err(KVM_ESTATE, "store %s: handle opened by process %ld used in process %ld (after fork); "
                                   "open the store again in this process",
                       s->path, (long)s->pid, (long)getpid());
    pthread_mutex_lock(&s->mu);
    return 0;
}

void kvm_store__unlock(kvm_store *s) { pthread_mutex_unlock(&s->mu); }

/* Whether a map of this many bytes fits the process's address space: LMDB's
 * mdb_env_set_mapsize unmaps the old map before it maps the new one, and when that fails
 * leaves the environment without a map (the next transaction dies with SIGSEGV); a new
 * data.mdb keeps the size its meta pages were written with even when mapping it failed. So
 * a size is tried first as an address-space reservation that costs nothing. */
static int map_fits(int64_t bytes)
{
    void *p = mmap(NULL, (size_t)bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 0;
    munmap(p, (size_t)bytes);
    return 1;
}

/* Doubles this process's map, up to map_max_bytes. No transaction may be active. */
static int store_grow(kvm_store *s)
{
    MDB_envinfo info;
    int rc = mdb_env_info(s->env, &info);
    if (rc) return kvm_store__mdb(s, rc, "env info");
    int64_t cur = (int64_t)info.me_mapsize;
    if (cur >= s->map_max_bytes)
        return kvm_err(KVM_EFULL,
                       "store %s: map full at %lld bytes (map_max_bytes %lld); this write was not stored, "
                       "everything committed before is intact",
                       s->path, (long long)cur, (long long)s->map_max_bytes);
    int dead = 0;
    mdb_reader_check(s->env, &dead); /* stale readers pin pages that could be reused */
    int64_t next = cur > s->map_max_bytes / 2 ? s->map_max_bytes : 2 * cur;
    if (!map_fits(next))
        return kvm_err(KVM_EFULL,
                       "store %s: map full at %lld bytes, and a map of %lld bytes does not fit this process's address "
                       "space (lower map_max_mb); this write was not stored, everything committed before is intact",
                       s->path, (long long)cur, (long long)next);
    rc = mdb_env_set_mapsize(s->env, (size_t)next);
    if (rc) return kvm_store__mdb(s, rc, "grow map");
    return 0;
}

int kvm_store__write(kvm_store *s, kvm_store__write_fn fn, void *arg)
{
    if (s->read_only) return kvm_err(KVM_ESTATE, "store %s: opened read-only, cannot write", s->path);
    int here = kvm_store__still_here(s, 1); /* a commit into a store no one sees is no commit */
    if (here) return here;
    for (int resized = 0;;) {
        MDB_txn *txn = NULL;
        s->mdb_rc = 0;
        kvm_store__lockwait_begin(&s->lockwait); /* another process may hold the lock for long */
        int rc = mdb_txn_begin(s->env, NULL, 0, &txn);
        if (kvm_store__lockwait_got(&s->lockwait, rc == 0)) { /* an interrupt ends the process */
            if (rc == 0) mdb_txn_abort(txn);
            kvm_store__lockwait_park();
        }
        if (rc == MDB_MAP_RESIZED && resized++ < 16) {
            rc = mdb_env_set_mapsize(s->env, 0); /* adopt the size another process set */
            if (rc) return kvm_store__mdb(s, rc, "adopt grown map");
            continue;
        }
        if (rc) return kvm_store__mdb(s, rc, "begin write transaction");
        if ((here = kvm_store__still_here(s, 1))) { /* again under the writer's lock: a swap may have */
            mdb_txn_abort(txn);                     /* come while another process held it */
            kvm_store__lockwait_end(&s->lockwait);
            return here;
        }
        uint64_t txnid = (uint64_t)mdb_txn_id(txn);
        int st = kvm_store__tree_check(s, txn, 1); /* no write on pages that fail it */
        s->txn_wrote = 0;
        if (st == 0) st = fn(s, txn, arg);
        if (st == 0) {
            rc = mdb_txn_commit(txn);
            /* a txn that changed nothing commits nothing: its id may become another process's */
            kvm_store__lockwait_end(&s->lockwait); /* committed or not, the txn is over */
            if (rc == 0 && s->txn_wrote) kvm_store__tree_ok(s, txnid);
            if (rc == 0) return 0;
            st = kvm_store__mdb(s, rc, "commit");
        } else {
            mdb_txn_abort(txn);
            kvm_store__lockwait_end(&s->lockwait);
        }
        if (s->mdb_rc != MDB_MAP_FULL) return st;
        st = store_grow(s);
        if (st) return st;
    }
}

int kvm_store__read_begin(kvm_store *s, MDB_txn **txn)
{
    *txn = NULL;
    int here = kvm_store__still_here(s, 0);
    if (here) return here;
    for (int resized = 0, busy = 0;;) {
        int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, txn);
        /* a full reader table: slots of processes that died reading are freed at once; live
         * readers end their reads within moments, so wait 10, 20, ... 320 ms (0.63 s in all)
         * before the caller gets KVM_EBUSY: a job retried at once would meet the same table */
        if (rc == MDB_READERS_FULL && busy < 6) {
            int dead = 0;
            if (mdb_reader_check(s->env, &dead) != 0 || dead == 0)
                nanosleep(&(struct timespec){0, 10000000L << busy}, NULL);
            busy++;
            continue;
        }
        if (rc == MDB_MAP_RESIZED && resized++ < 16) {
            rc = mdb_env_set_mapsize(s->env, 0);
            if (rc) return kvm_store__mdb(s, rc, "adopt grown map");
            continue;
        }
        if (rc) {
            *txn = NULL;
            return kvm_store__mdb(s, rc, "begin read transaction");
        }
        uint64_t txnid = (uint64_t)mdb_txn_id(*txn);
        int st = kvm_store__tree_check(s, *txn, 0);
        if (st == 0) return 0;
        mdb_txn_abort(*txn);
        *txn = NULL;
        if (st != KVM_STORE__TREE_RETRY) return st;
        if (resized++ >= 16) /* not writers moving on: the meta page is not the one LMDB picked */
            return kvm_err(KVM_ECORRUPT, "store %s: data.mdb is damaged: meta page %llu does not hold transaction %llu",
                           s->path, (unsigned long long)(txnid & 1), (unsigned long long)txnid);
    }
}

int kvm_store__cursor_begin(kvm_store *s, int db, MDB_txn **txn, MDB_cursor **cur)
{
    *txn = NULL;
    *cur = NULL;
    int st = kvm_store__lock(s);
    if (st) return st;
    st = kvm_store__read_begin(s, txn);
    int rc = st ? 0 : mdb_cursor_open(*txn, s->dbi[db], cur);
    if (rc) st = kvm_store__mdb(s, rc, "cursor");
    if (st) kvm_store__cursor_end(s, txn, cur);
    return st;
}

void kvm_store__cursor_end(kvm_store *s, MDB_txn **txn, MDB_cursor **cur)
{
    if (*cur) mdb_cursor_close(*cur);
    if (*txn) mdb_txn_abort(*txn);
    *cur = NULL;
    *txn = NULL;
    kvm_store__unlock(s);
}

int kvm_store__meta_get(kvm_store *s, MDB_txn *txn, const char *name, int64_t *v)
{
    MDB_val k = {strlen(name), (void *)name}, d;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_META], &k, &d);
    *v = 0;
    if (rc == MDB_NOTFOUND) return 0;
    if (rc) return kvm_store__mdb(s, rc, name);
    if (d.mv_size != 8) return kvm_err(KVM_ECORRUPT, "store %s: meta %s: %zu bytes, expected 8", s->path, name, d.mv_size);
    *v = (int64_t)kvm_store__get_u64(d.mv_data);
    return 0;
}

int kvm_store__meta_set(kvm_store *s, MDB_txn *txn, const char *name, int64_t v)
{
    uint8_t b[8];
    kvm_store__put_u64(b, (uint64_t)v);
    MDB_val k = {strlen(name), (void *)name}, d = {8, b};
    int rc = mdb_put(txn, s->dbi[KVM_STORE__DB_META], &k, &d, 0);
    if (rc == 0) s->txn_wrote = 1; /* the commit takes a new id (put, rm and evict all come here) */
    return rc ? kvm_store__mdb(s, rc, name) : 0;
}

typedef struct store_init_arg {
    int64_t cap_bytes; /* opts.cap_bytes */
} store_init_arg;

/* Versions count up by one per format change; a value far past any is no version but damage. */
#define STORE_VERSION_PLAUSIBLE 65536

static int store_check_version(kvm_store *s, int64_t version)
{
    /* a damaged meta value read as "store format version 8955095580320447181, this build reads
     * version 1 (mismatched model, tokenizer or config)", and store verify exited 2 (unopenable)
     * instead of reporting a damaged store */
    /* 0 is no version either: kvmill writes 1 or more, so a zero-filled value is damage, and
     * taking it for a new store would write 1 over it and hide the damage */
    if (version <= 0 || version > STORE_VERSION_PLAUSIBLE)
        return kvm_err(KVM_ECORRUPT,
                       "store %s: db meta: format_version holds %lld, which is no store format version: data.mdb is "
                       "damaged (restore the store from a copy, or move it aside)",
                       s->path, (long long)version);
    /* versions only count up, so any other one is a newer kvmill's: KVM_ENOTSUP, as KVM_EMISMATCH
     * added "(mismatched model, tokenizer or config)" to the message and said nothing to do */
    if (version != (int64_t)KVM_STORE_FORMAT_VERSION)
        return kvm_err(KVM_ENOTSUP,
                       "store %s: store format version %lld, this build reads version %u: the store was written by "
                       "a newer kvmill; open it with that version, or give another --store ([store] path) for a "
                       "store of this one",
                       s->path, (long long)version, KVM_STORE_FORMAT_VERSION);
    return 0;
}

/* Reads meta format_version into *version; *present tells a store without one (a new store)
 * from one whose value is 0 (damage). */
static int store_version_get(kvm_store *s, MDB_txn *txn, int64_t *version, int *present)
{
    MDB_val k = {strlen("format_version"), (void *)"format_version"}, d;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_META], &k, &d);
    *present = rc == 0;
    if (rc && rc != MDB_NOTFOUND) return kvm_store__mdb(s, rc, "format_version");
    return kvm_store__meta_get(s, txn, "format_version", version);
}

/* Creates (if needed) and opens every db, records the format version and the cap. */
static int store_init_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    const store_init_arg *a = arg;
    for (int i = 0; i < KVM_STORE__DB_COUNT; i++) {
        int rc = mdb_dbi_open(txn, kvm_store__db_names[i], MDB_CREATE, &s->dbi[i]);
        if (rc) return kvm_store__mdb(s, rc, kvm_store__db_names[i]);
    }
    int64_t version;
    int present;
    int st = store_version_get(s, txn, &version, &present);
    if (st) return st;
    if (!present) { /* new store, unless the environment already holds another program's data */
        MDB_dbi main_dbi;
        MDB_stat ms;
        int rc = mdb_dbi_open(txn, NULL, 0, &main_dbi);
        if (rc == 0) rc = mdb_stat(txn, main_dbi, &ms);
        if (rc) return kvm_store__mdb(s, rc, "main database");
        if (ms.ms_entries > KVM_STORE__DB_COUNT)
            return kvm_err(KVM_EFORMAT, "store %s: an LMDB environment of another program, not a kvmill store", s->path);
        st = kvm_store__meta_set(s, txn, "format_version", KVM_STORE_FORMAT_VERSION);
    } else {
        st = store_check_version(s, version);
    }
    if (st) return st;
    if ((st = kvm_store__docnames_sync(s, txn))) return st;
    if (a->cap_bytes > 0) st = kvm_store__meta_set(s, txn, "cap_bytes", a->cap_bytes);
    else if (a->cap_bytes == KVM_STORE_CAP_NONE) st = kvm_store__meta_set(s, txn, "cap_bytes", 0);
    return st;
}

/* Opens the dbs of an existing store without writing. */
static int store_init_readonly(kvm_store *s)
{
    MDB_txn *txn;
    int st = kvm_store__read_begin(s, &txn);
    if (st) return st;
    for (int i = 0; i < KVM_STORE__DB_COUNT && st == 0; i++) {
        int rc = mdb_dbi_open(txn, kvm_store__db_names[i], 0, &s->dbi[i]);
        if (rc == MDB_NOTFOUND && i == KVM_STORE__DB_CLAIMS) { /* an older store: no claims yet */
            s->no_claims = 1;
            continue;
        }
        if (rc == MDB_NOTFOUND && i == KVM_STORE__DB_DOCNAMES) { /* an older store: names are found by a scan */
            s->no_docnames = 1;
            continue;
        }
        if (rc == MDB_NOTFOUND || rc == MDB_INCOMPATIBLE)
            st = kvm_err(KVM_EFORMAT, "store %s: an LMDB environment but not a kvmill store (no '%s' database)",
                         s->path, kvm_store__db_names[i]);
        else if (rc) st = kvm_store__mdb(s, rc, kvm_store__db_names[i]);
    }
    int64_t version = 0;
    int present = 0;
    if (st == 0) st = store_version_get(s, txn, &version, &present);
    if (st == 0 && !present)
        st = kvm_err(KVM_ECORRUPT,
                     "store %s: db meta holds no format_version: data.mdb is damaged (restore the store from a "
                     "copy, or move it aside)",
                     s->path);
    if (st == 0) st = store_check_version(s, version);
    if (st == 0) {
        int rc = mdb_txn_commit(txn); /* makes the dbi handles usable by later txns */
        txn = NULL;
        if (rc) st = kvm_store__mdb(s, rc, "open databases");
    }
    if (txn) mdb_txn_abort(txn);
    return st;
}

static int store_check_opts(const kvm_store_opts *o)
{
    if (o->map_size_bytes < 0 || o->map_max_bytes < 0)
        return kvm_err(KVM_EINVAL, "store: map_size_bytes %lld and map_max_bytes %lld must be >= 0",
                       (long long)o->map_size_bytes, (long long)o->map_max_bytes);
    if (o->cap_bytes < KVM_STORE_CAP_NONE)
        return kvm_err(KVM_EINVAL, "store: cap_bytes %lld must be > 0, 0 or KVM_STORE_CAP_NONE", (long long)o->cap_bytes);
    return 0;
}

/* Checks what is at path; creates the directory for a writable open. */
/* The error for a store path that is not a directory: KVM_EFORMAT. A store's own data.mdb or
 * lock.mdb (what a user may take for "the store file") is named as such, with the folder to give. */
static int not_a_dir(const char *path)
{
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    if (strcmp(base, "data.mdb") && strcmp(base, "lock.mdb"))
        return kvm_err(KVM_EFORMAT, "store %s: not an LMDB environment directory", path);
    int dir_len = !slash ? 1 : slash == path ? 1 : (int)(slash - path);
    return kvm_err(KVM_EFORMAT,
                   "store %s: not an LMDB environment directory: %s is a file of the store: name its "
                   "folder, %.*s, instead",
                   path, base, dir_len, slash ? path : ".");
}

/* A writable open that creates the store (no data.mdb yet) in a directory that is there: refused
 * when the directory holds anything but a store's own files (lock.mdb), a fresh filesystem's
 * lost+found or hidden entries (.gitkeep), since data.mdb and lock.mdb would then sit among files that are not the
 * store's (a corpus folder named by mistake). An empty directory (made ahead, a mount point) is used. KVM_EINVAL: a
 * usage error. A data.mdb in the listing means the store exists after all: another process (the store
 * service that deploy/slurm/kvmill.sbatch starts beside the run) created it between the caller's stat
 * and this listing, so the listing alone decides and the directory is accepted. */
static int refuse_foreign_dir(const char *path)
{
    DIR *d = opendir(path);
    if (!d) return 0; /* unreadable: the open says why, or works */
    long n = 0;
    int has_data = 0;
    char example[256] = "";
    for (struct dirent *e; (e = readdir(d));) {
        const char *nm = e->d_name;
        if (!strcmp(nm, "data.mdb")) has_data = 1;
        /* hidden entries (.gitkeep, .snapshot) are a folder's housekeeping, not a corpus */
        if (nm[0] == '.' || !strcmp(nm, "lock.mdb") || !strcmp(nm, "data.mdb") || !strcmp(nm, "lost+found")) continue;
        if (n++ == 0) snprintf(example, sizeof example, "%s", nm);
    }
    closedir(d);
    if (n == 0 || has_data) return 0;
    return kvm_err(KVM_EINVAL,
                   "store %s: the directory exists and holds %ld %s that %s not a store's (such as '%s'), and no "
                   "data.mdb: a new store there would mix its files with those; give an empty or new folder for "
                   "the store",
                   path, n, n == 1 ? "entry" : "entries", n == 1 ? "is" : "are", example);
}

/* The error `code` for a store path that is a symbolic link to nothing (a disk that is not
 * mounted, a folder moved away), or 0 when path is no such link. mkdir(2) cannot make the store
 * through the link (EEXIST), so a writer went on and said "no lock file lock.mdb, and the
 * directory is not writable"; a reader said "no such directory". Making the folder it names is
 * left to the user: on an unmounted disk's mount point it would fill the wrong file system. */
static int dangling_link(const char *path, int code)
{
    struct stat st;
    char target[4096];
    if (lstat(path, &st) != 0 || !S_ISLNK(st.st_mode) || stat(path, &st) == 0) return 0;
    const int e = errno; /* why the link leads nowhere: ENOENT, ELOOP, EACCES */
    ssize_t n = readlink(path, target, sizeof target - 1);
    target[n > 0 ? n : 0] = '\0';
    return kvm_err(code,
                   "store %s is a symbolic link to %s, which does not exist (%s): mount or make that folder, or "
                   "give --store ([store] path) the store's folder",
                   path, target, strerror(e));
}

/* A store path that does not exist is created by mkdir(2) in its parent folder: refused when that
 * folder is missing, not a folder or not writable, which the open would only find out when it
 * creates the store (in serve's case in every decode worker). KVM_EINVAL: a usage error. */
static int check_parent_dir(const char *path)
{
    char parent[4200];
    snprintf(parent, sizeof parent, "%s", path);
    size_t n = strlen(parent);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = '\0'; /* "a.lmdb/" names a.lmdb */
    char *slash = strrchr(parent, '/');
    if (!slash)
        snprintf(parent, sizeof parent, ".");
    else
        slash[slash == parent ? 1 : 0] = '\0'; /* "/a.lmdb": the root */
    struct stat st;
    if (stat(parent, &st) != 0)
        return kvm_err(KVM_EINVAL,
                       "store %s cannot be created: its parent folder %s %s: make the folder first or give a store "
                       "path in a folder that exists",
                       path, parent, errno == ENOENT || errno == ENOTDIR ? "does not exist" : strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return kvm_err(KVM_EINVAL, "store %s cannot be created: its parent %s is not a folder", path, parent);
    if (access(parent, W_OK | X_OK) != 0)
        return kvm_err(KVM_EINVAL, "store %s cannot be created: its parent folder %s is not writable (%s)", path,
                       parent, strerror(errno));
    return 0;
}

int kvm_store_check_new_dir(const char *path)
{
    struct stat st;
    char data[4200];
    snprintf(data, sizeof data, "%s/data.mdb", path);
    if (stat(path, &st) != 0) {
        int rc = errno == ENOENT ? dangling_link(path, KVM_EINVAL) : 0;
        if (rc) return rc;
        return errno == ENOENT || errno == ENOTDIR ? check_parent_dir(path) : 0;
    }
    if (!S_ISDIR(st.st_mode) || lstat(data, &st) == 0) return 0;
    int rc = refuse_foreign_dir(path);
    if (rc == 0 && access(path, W_OK | X_OK) != 0) /* made ahead, a read-only mount: data.mdb cannot go there */
        return kvm_err(KVM_EINVAL, "store %s cannot be created: the folder is not writable (%s)", path,
                       strerror(errno));
    return rc;
}

/* *made_dir = 1 when this call created the directory. */
static int store_prepare_dir(const char *path, int read_only, int must_exist, int *made_dir)
{
    struct stat st;
    *made_dir = 0;
    if (stat(path, &st) != 0) {
        if (errno != ENOENT) return kvm_err(KVM_EIO, "store %s: %s", path, strerror(errno));
        int rc = dangling_link(path, KVM_EINVAL); /* not ENOTFOUND: "give --create" cannot help */
        if (rc) return rc;
        if (read_only || must_exist) return kvm_err(KVM_ENOTFOUND, "store %s: no such directory", path);
        if (mkdir(path, 0775) == 0)
            *made_dir = 1;
        else if (errno != EEXIST)
            return kvm_err(KVM_EIO, "store %s: cannot create directory: %s", path, strerror(errno));
        return 0;
    }
    if (!S_ISDIR(st.st_mode)) return not_a_dir(path);
    char data[4200];
    snprintf(data, sizeof data, "%s/data.mdb", path);
    if (read_only || must_exist) {
        if (stat(data, &st) != 0)
            return kvm_err(KVM_ENOTFOUND, "store %s: directory holds no store (no data.mdb)", path);
    } else if (lstat(data, &st) != 0 && errno == ENOENT) {
        return refuse_foreign_dir(path);
    }
    return 0;
}

/* A reader's slot lives in lock.mdb, so LMDB opens it read-write even for MDB_RDONLY and
 * fails when it cannot (a store copied read-only, a lock file owned by someone else). A
 * read-only open then reads without a lock (MDB_NOLOCK) rather than not at all. Returns
 * NULL when lock.mdb can be used, else why not (malloc'd; NULL as well when out of memory,
 * and then the open simply fails as before). */
static char *store_lock_unusable(const char *path)
{
    char lock[4200], why[4400];
    snprintf(lock, sizeof lock, "%s/lock.mdb", path);
    int fd = open(lock, O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
        close(fd);
        return NULL;
    }
    int e = errno;
    if (e == ENOENT && access(path, W_OK) == 0) return NULL; /* LMDB creates it */
    if (e == ENOENT)
        snprintf(why, sizeof why, "store %s: no lock file lock.mdb, and the directory is not writable", path);
    else
        snprintf(why, sizeof why, "store %s: lock file %s cannot be opened for writing (%s)", path, lock, strerror(e));
    return strdup(why);
}

/* 1 when path/lock.mdb exists (lstat: a dangling link as well). */
static int lock_exists(const char *path)
{
    char lock[4200];
    struct stat st;
    snprintf(lock, sizeof lock, "%s/lock.mdb", path);
    return lstat(lock, &st) == 0 || errno != ENOENT;
}

/* Removes the lock.mdb a failed open made (mdb_env_open creates it before it reads data.mdb),
 * after mdb_env_close: an inspection that fails, or a writer refused because the folder is no
 * kvmill store, leaves the lock file as it found it. Not when another process holds it: every
 * process with the environment open keeps a POSIX record lock on its byte 0 (lmdb mdb.c,
 * mdb_env_excl_lock), so taking that byte exclusively shows nobody does now. A process that has
 * opened lock.mdb but not yet locked it is not seen; the unlink happens while the lock is held. */
static void drop_created_lock(const char *path)
{
    char lock[4200];
    snprintf(lock, sizeof lock, "%s/lock.mdb", path);
    int fd = open(lock, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    if (fcntl(fd, F_SETLK, &fl) == 0) unlink(lock);
    close(fd);
}

/* 1 when the directory holds nothing but lock.mdb. */
static int only_lock_left(const char *path)
{
    DIR *d = opendir(path);
    if (!d) return 0;
    int other = 0;
    for (struct dirent *e; (e = readdir(d)) && !other;)
        other = strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "lock.mdb");
    closedir(d);
    return !other;
}

/* Takes back what a failed read-write open of a new store (no data.mdb before it) created, after
 * mdb_env_close: a full disk or a file size limit left a data.mdb with no commit (even a
 * zero-byte one, which every later open refused as damaged), and the lock.mdb and directory it
 * made. Only while no process has the environment open: each holds a record lock on lock.mdb's
 * byte 0, taken before it opens data.mdb (drop_created_lock). data.mdb goes only when it holds
 * no committed transaction (kvm_store__data_uncommitted): a store another process created
 * between this open's look and LMDB's open keeps what it stored. lock.mdb goes only with a
 * directory this open made, when nothing else is in it, and the directory then too: in a
 * directory that was there, a process between LMDB's open of lock.mdb and its record lock would
 * go on with an unlinked lock file beside a later process's new one (two writers without a
 * common mutex); in a removed directory it finds no data.mdb to open. Nothing that existed
 * before the open is removed. */
static void undo_created(const char *path, int made_lock, int made_dir)
{
    char lock[4200], data[4200];
    snprintf(lock, sizeof lock, "%s/lock.mdb", path);
    snprintf(data, sizeof data, "%s/data.mdb", path);
    int fd = open(lock, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 && errno != ENOENT) return;
    if (fd >= 0) {
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
        if (fcntl(fd, F_SETLK, &fl) != 0) { /* another process has it open: everything stays */
            close(fd);
            return;
        }
        if (kvm_store__data_uncommitted(path)) unlink(data);
        if (made_lock && made_dir && only_lock_left(path)) unlink(lock);
        close(fd);
    }
    if (made_dir) rmdir(path); /* refused unless empty */
}

int kvm_store_unwritable(const char *path, char *why, size_t why_size)
{
    if (!path || !why || why_size == 0) return 0;
    static const char *const names[] = {"", "/data.mdb", "/lock.mdb"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char f[4200];
        snprintf(f, sizeof f, "%s%s", path, names[i]);
        if (access(f, F_OK) != 0) continue; /* what does not exist is created, or refused, by the open */
        if (access(f, W_OK) == 0) continue;
        snprintf(why, why_size, "store %s: %s is not writable (%s)", path, i ? f : "the directory", strerror(errno));
        return 1;
    }
    return 0;
}

int kvm_store_open(const char *path, const kvm_store_opts *opts, kvm_store **out)
{
    kvm_store_opts o = {0};
    if (opts) o = *opts;
    if (!out) return kvm_err(KVM_EINVAL, "store: NULL output handle");
    *out = NULL;
    if (!path || !*path) return kvm_err(KVM_EINVAL, "store: empty path");
    int st = store_check_opts(&o);
    if (st) return st;
    int64_t map = o.map_size_bytes ? o.map_size_bytes : KVM_STORE__DEFAULT_MAP;
    map = (map + KVM_STORE__MAP_ALIGN - 1) / KVM_STORE__MAP_ALIGN * KVM_STORE__MAP_ALIGN;
    int64_t max = o.map_max_bytes ? o.map_max_bytes : KVM_STORE__DEFAULT_MAX;
    if (max < map) max = map;
    if (!o.read_only && !map_fits(map)) /* before anything is created or mapped */
        return kvm_err(KVM_EINVAL, "store %s: a map of %lld MiB (map_size_mb) does not fit this process's address space: "
                       "lower map_size_mb", path, (long long)(map >> 20));
    int made_dir = 0, made_lock = 0, fresh = 0; /* what this open creates: taken back when it fails */
    kvm_store *s = NULL;
    st = store_prepare_dir(path, o.read_only, o.must_exist, &made_dir);
    if (st == 0) st = kvm_store__check_fs(path);
    if (st == 0) st = kvm_store__check_file(path);
    if (st == 0) st = kvm_store__check_lock_space(path);
    if (st) goto fail;

    if (sodium_init() < 0) {
        st = kvm_err(KVM_EIO, "store %s: libsodium failed to initialize", path);
        goto fail;
    }
    if (!(s = calloc(1, sizeof *s))) {
        st = kvm_err(KVM_ENOMEM, "store %s: out of memory", path);
        goto fail;
    }
    s->path = strdup(path);
    s->opts = o;
    struct stat dir_st;
    if (stat(path, &dir_st) == 0) s->dir_dev = dir_st.st_dev, s->dir_ino = dir_st.st_ino;
    s->pid = getpid();
    s->read_only = o.read_only != 0;
    s->map_max_bytes = max;
    int64_t gran = o.atime_granularity_ms ? o.atime_granularity_ms : 1000;
    s->atime_granularity_ns = gran < 0 ? -1 : gran * 1000000;
    pthread_mutex_init(&s->mu, NULL);
    if (!s->path) {
        st = kvm_err(KVM_ENOMEM, "store %s: out of memory", path);
        goto fail;
    }
    int rc = mdb_env_create(&s->env);
    if (rc) {
        s->env = NULL;
        st = kvm_store__mdb(s, rc, "create environment");
        goto fail;
    }
    mdb_env_set_maxdbs(s->env, KVM_STORE__DB_COUNT + 4);
    mdb_env_set_maxreaders(s->env, o.max_readers > 0 ? (unsigned)o.max_readers : KVM_STORE__MAX_READERS);
    char data[4200];
    struct stat dst;
    snprintf(data, sizeof data, "%s/data.mdb", path);
    fresh = stat(data, &dst) != 0;
    if (!s->read_only && fresh) mdb_env_set_mapsize(s->env, (size_t)map); /* else adopt the stored size */
    unsigned flags = MDB_NOTLS | (s->read_only ? MDB_RDONLY : 0) | (o.no_sync ? MDB_NOSYNC : 0);
    if (s->read_only && (s->lock_note = store_lock_unusable(path))) flags |= MDB_NOLOCK;
    made_lock = !(flags & MDB_NOLOCK) && !lock_exists(path); /* LMDB makes one */
    rc = mdb_env_open(s->env, path, flags, 0664);
    if (rc == MDB_INVALID || rc == MDB_VERSION_MISMATCH || rc == ENOTDIR) {
        st = kvm_err(KVM_EFORMAT, "store %s: not an LMDB environment (%s)", path, mdb_strerror(rc));
        goto fail;
    }
    char *lock_why = rc && !s->read_only ? store_lock_unusable(path) : NULL;
    if (lock_why) { /* a command that writes needs the lock file: say which file and why */
        st = kvm_err(KVM_EIO, "%s; this command writes to the store and needs it (the store is unchanged)", lock_why);
        free(lock_why);
        goto fail;
    }
    if (rc) {
        st = kvm_store__mdb(s, rc, "open environment");
        goto fail;
    }
    if (!(flags & MDB_NOLOCK)) { /* the lock file this environment uses: kvm_store_follow */
        char lock[4200];
        struct stat lock_st;
        snprintf(lock, sizeof lock, "%s/lock.mdb", path);
        if (stat(lock, &lock_st) == 0) s->lock_dev = lock_st.st_dev, s->lock_ino = lock_st.st_ino;
    }
    int dead = 0;
    mdb_reader_check(s->env, &dead); /* free slots of readers that died */
    mdb_env_get_maxreaders(s->env, &s->max_readers); /* an existing lock.mdb's, not ours */
    MDB_envinfo info;
    if (!s->read_only && !fresh && mdb_env_info(s->env, &info) == 0 && (int64_t)info.me_mapsize < map &&
        (rc = mdb_env_set_mapsize(s->env, (size_t)map))) { /* no txn is active yet */
        st = kvm_store__mdb(s, rc, "map size"); /* the environment has no map left: closed */
        goto fail;
    }
    if (s->read_only) {
        st = store_init_readonly(s);
    } else {
        kvm_store__lockwait_add(&s->lockwait, s->path); /* before the first write: it may wait */
        store_init_arg a = {o.cap_bytes};
        st = kvm_store__write(s, store_init_fn, &a);
    }
    if (st) goto fail;
    *out = s;
    return 0;
fail:
    kvm_store_close(&s);
    /* A writer removes the lock file only when the folder is no kvmill store (another program's
     * LMDB environment, not LMDB at all): no kvmill process shares it. After any other failure
     * (map full, permissions) a second kvmill process may be between LMDB's open of lock.mdb and
     * its record lock on it, and would go on with an unlinked lock file beside a third process's
     * new one: two writers without a common mutex over one data.mdb. A writer that was creating
     * the store takes back what it made (undo_created). */
    if (!o.read_only && (fresh || made_dir))
        undo_created(path, made_lock, made_dir);
    else if (made_lock && (o.read_only || st == KVM_EFORMAT))
        drop_created_lock(path);
    return st;
}

void kvm_store_close(kvm_store **sp)
{
    if (!sp || !*sp) return;
    kvm_store *s = *sp;
    *sp = NULL;
    /* In a forked child the environment belongs to the parent: leave LMDB alone. */
    if (!s->read_only && s->pid == getpid()) kvm_store__lockwait_remove(&s->lockwait); /* no-op if never added */
    if (s->env && s->pid == getpid()) mdb_env_close(s->env);
    kvm_store__tree_unmap(s);
    pthread_mutex_destroy(&s->mu);
    free(s->lock_note);
    free(s->path);
    free(s);
}

const char *kvm_store_path(const kvm_store *s) { return s ? s->path : ""; }

const char *kvm_store_lock_note(const kvm_store *s) { return s ? s->lock_note : NULL; }

int kvm_store_follow(kvm_store **s, int wait_ms, int *reopened)
{
    if (reopened) *reopened = 0;
    if (!s || !*s) return 0;
    int at = kvm_store__at_path(*s);
    /* a swap is two renames: nothing at the path between them, for a moment */
    for (int waited = 0; at == KVM_STORE__AT_GONE && waited < wait_ms; waited += 20) {
        nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
        at = kvm_store__at_path(*s);
    }
    if (at == KVM_STORE__AT_SAME) return 0;
    if (at != KVM_STORE__AT_REPLACED) return kvm_store__at_err(*s, at);
    int rc = kvm_store_reopen(s);
    if (!rc && reopened) *reopened = 1;
    return rc;
}

int kvm_store_reopen(kvm_store **s)
{
    if (!s || !*s) return kvm_err(KVM_EINVAL, "store: no handle to open again");
    char path[4200], why[1024];
    snprintf(path, sizeof path, "%s", (*s)->path);
    kvm_store *fresh = NULL;
    kvm_store_opts o = (*s)->opts;
    o.must_exist = 1; /* the store that replaced it, never a new one made mid-swap */
    int rc = kvm_store_open(path, &o, &fresh);
    if (rc) {
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        return kvm_err(rc, "the store %s was replaced since it was opened, and the one there now cannot be opened: %s",
                       path, why);
    }
    kvm_store_close(s);
    *s = fresh;
    return 0;
}

static int store_entries(kvm_store *s, MDB_txn *txn, int db, int64_t *n)
{
    MDB_stat ms;
    int rc = mdb_stat(txn, s->dbi[db], &ms);
    if (rc) return kvm_store__mdb(s, rc, kvm_store__db_names[db]);
    *n = (int64_t)ms.ms_entries;
    return 0;
}

int kvm_store_stats_get(kvm_store *s, kvm_store_stats *out)
{
    int st = kvm_store__lock(s);
    if (st) return st;
    memset(out, 0, sizeof *out);
    MDB_txn *txn = NULL;
    int64_t version = 0;
    st = kvm_store__read_begin(s, &txn);
    if (st == 0) st = kvm_store__meta_get(s, txn, "format_version", &version);
    if (st == 0) st = kvm_store__meta_get(s, txn, "cache_bytes", &out->cache_bytes);
    if (st == 0) st = kvm_store__meta_get(s, txn, "cap_bytes", &out->cap_bytes);
    if (st == 0) st = kvm_store__meta_get(s, txn, "n_evicted", &out->n_evicted);
    if (st == 0) st = store_entries(s, txn, KVM_STORE__DB_ATIME, &out->n_caches);
    if (st == 0) st = store_entries(s, txn, KVM_STORE__DB_STRATEGIES, &out->n_strategies);
    if (st == 0) st = store_entries(s, txn, KVM_STORE__DB_MODELS, &out->n_models);
    if (st == 0) st = store_entries(s, txn, KVM_STORE__DB_DOCS, &out->n_docs);
    if (st == 0) st = kvm_store__oldest_served(s, txn, &out->oldest_served_ns);
    if (txn) mdb_txn_abort(txn);
    out->format_version = (uint32_t)version;
    MDB_envinfo info;
    MDB_stat es;
    if (st == 0 && mdb_env_info(s->env, &info) == 0 && mdb_env_stat(s->env, &es) == 0) {
        out->map_size_bytes = (int64_t)info.me_mapsize;
        out->map_used_bytes = ((int64_t)info.me_last_pgno + 1) * (int64_t)es.ms_psize;
    }
    out->map_max_bytes = s->map_max_bytes;
    kvm_store__unlock(s);
    return st;
}

void kvm_store__set_txn_hook(kvm_store *s, void (*hook)(void *arg), void *arg)
{
    s->txn_hook = hook;
    s->txn_hook_arg = arg;
}
