/* kvm_store_file.c: checks an existing data.mdb against its own meta pages before LMDB maps
 * it. A file cut short (a failed copy, a full disk, a truncate) would otherwise be mapped
 * and the first read past its end kills the process with SIGBUS; a damaged meta page made
 * LMDB call the whole file "not an LMDB file", or went unnoticed. The two meta pages are
 * read with pread, never through a map. Layout (lmdb/mdb.c, 64-bit builds): a page opens
 * with a 16-byte header; the meta that follows holds u32 magic 0xBEEFC0DE, u32 version,
 * the address and map size, two 48-byte db records (the first's u32 md_pad is the page
 * size), then pgno_t mm_last_pg and txnid_t mm_txnid. */
#include "store/kvm_store_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "common/kvm_error.h"

#define PAGE_FLAGS 10                   /* u16 mp_flags in the page header */
#define P_META 0x08                     /* LMDB's meta page flag */
#define DATA_VERSION 1                  /* MDB_DATA_VERSION */
#define META_VERSION (META_OFF + 4)     /* u32 mm_version */
#define META_OFF 16                     /* meta after the page header */
#define META_MAGIC 0xBEEFC0DEu          /* MDB_MAGIC */
#define META_PSIZE (META_OFF + 24)      /* mm_dbs[FREE_DBI].md_pad: the page size */
#define META_LAST_PG (META_OFF + 24 + 96) /* mm_last_pg */
#define META_TXNID (META_LAST_PG + 8)   /* mm_txnid */
#define META_BYTES (META_TXNID + 8)     /* bytes of a page that hold the meta */
#define MIN_PAGE 512                    /* LMDB page sizes are powers of two in [512, 64 KiB] */
#define MAX_PAGE 65536

/* One meta page as read from the file. */
typedef struct meta_page {
    int read;          /* 1 when the page's meta bytes were read whole */
    uint32_t raw_magic; /* what stands where the magic belongs */
    int magic;         /* 1 when the page was read whole and carries the magic */
    int ok;            /* 1 when it also gives a valid page size */
    char bad[96];      /* with the magic: what else is wrong in its header ("" when nothing) */
    uint32_t psize;    /* page size, bytes */
    uint64_t last_pg;  /* last page in use */
    uint64_t txnid;    /* transaction that wrote it */
} meta_page;

/* Reads meta page `pgno` at byte `at`. LMDB refuses the whole environment ("not an LMDB
 * file") when either meta page lacks the meta flag or the magic, or gives another data
 * version; the page number in the header is written once, at creation, and never again. */
static void meta_read(int fd, off_t at, uint64_t pgno, int64_t file_bytes, meta_page *m)
{
    uint8_t b[META_BYTES];
    memset(m, 0, sizeof *m);
    if (at + (int64_t)sizeof b > file_bytes || pread(fd, b, sizeof b, at) != (ssize_t)sizeof b) return;
    m->read = 1;
    m->raw_magic = kvm_store__get_u32(b + META_OFF);
    if (m->raw_magic != META_MAGIC) return;
    m->magic = 1;
    m->psize = kvm_store__get_u32(b + META_PSIZE);
    m->last_pg = kvm_store__get_u64(b + META_LAST_PG);
    m->txnid = kvm_store__get_u64(b + META_TXNID);
    m->ok = m->psize >= MIN_PAGE && m->psize <= MAX_PAGE && (m->psize & (m->psize - 1)) == 0;
    uint16_t flags = kvm_store__get_u16(b + PAGE_FLAGS);
    uint32_t version = kvm_store__get_u32(b + META_VERSION);
    uint64_t no = kvm_store__get_u64(b);
    if (!(flags & P_META))
        snprintf(m->bad, sizeof m->bad, "is not flagged as a meta page (flags 0x%04x at byte %d)", flags, PAGE_FLAGS);
    else if (version != DATA_VERSION)
        snprintf(m->bad, sizeof m->bad, "gives data version %u, not %d (byte %d)", version, DATA_VERSION, META_VERSION);
    else if (no != pgno)
        snprintf(m->bad, sizeof m->bad, "gives page number %llu, not %llu (byte 0)", (unsigned long long)no,
                 (unsigned long long)pgno);
}

/* Meta page 0 without the magic: damage when an intact meta page 1 stands one page further
 * (at any LMDB page size), else not an LMDB file. Returns the page size, or 0. */
static uint32_t meta1_without_meta0(int fd, int64_t file_bytes)
{
    for (uint32_t psize = MIN_PAGE; psize <= MAX_PAGE; psize *= 2) {
        meta_page m1;
        meta_read(fd, (off_t)psize, 1, file_bytes, &m1);
        if (m1.magic && m1.ok && m1.psize == psize && !m1.bad[0]) return psize;
    }
    return 0;
}

/* KVM_ECORRUPT naming meta page `pgno` of data.mdb, its bytes and what is wrong with it. */
static int meta_damaged(const char *dir, const char *path, int pgno, uint32_t psize, const char *what)
{
    return kvm_err(KVM_ECORRUPT,
                   "store %s: data.mdb is damaged: its %s meta page, page %d (bytes %lld-%lld of %s), %s, so LMDB "
                   "cannot open it; restore the store from a copy, or move it aside and run again (its documents are "
                   "compressed again)",
                   dir, pgno ? "second" : "first", pgno, (long long)pgno * psize, (long long)(pgno + 1) * psize - 1, path,
                   what);
}

/* One look at the file; *young = 1 when it failed for lack of its two meta pages (a store
 * another process is creating right now looks like that for a moment). */
static int check_once(const char *dir, int *young)
{
    *young = 0;
    char path[4200];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    /* O_NONBLOCK: a data.mdb that is a FIFO made this open (and every store command, run and
     * serve) wait for a writer forever; regular files ignore the flag */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return errno == ENOENT ? 0 : kvm_err(KVM_EIO, "store %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kvm_err(KVM_EIO, "store %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kvm_err(KVM_EFORMAT, "store %s: %s is not a regular file (a FIFO, socket, device or folder)", dir, path);
    }
    int64_t size = (int64_t)st.st_size;
    meta_page m0, m1 = {0};
    meta_read(fd, 0, 0, size, &m0);
    if (m0.ok) meta_read(fd, (off_t)m0.psize, 1, size, &m1);
    uint32_t psize1 = m0.read && !m0.ok ? meta1_without_meta0(fd, size) : 0;
    /* the size to compare is taken after the meta pages were read: a writer in another process
     * may commit in between, and LMDB writes a commit's pages before its meta page, so a size
     * read first could be older than the meta page and look truncated */
    if (fstat(fd, &st) == 0) size = (int64_t)st.st_size;
    close(fd);
    *young = !m0.ok || !m1.ok;
    char what[160];
    if (psize1) { /* meta page 1 is intact: page 0 is damaged, not a store being created */
        *young = m0.magic && m0.psize == 0;
        if (m0.magic)
            snprintf(what, sizeof what, "gives page size %u (bytes %d-%d), not %u as meta page 1 does", m0.psize,
                     META_PSIZE, META_PSIZE + 3, psize1);
        else
            snprintf(what, sizeof what, "does not hold LMDB's magic number (bytes %d-%d read 0x%08x, not 0x%08x)",
                     META_OFF, META_OFF + 3, m0.raw_magic, META_MAGIC);
        return meta_damaged(dir, path, 0, psize1, what);
    }
    /* LMDB takes the page size of the newer meta page and finds page 1 at page 0's size: one
     * damaged size and it maps the file with another page size, reading past its end (SIGBUS).
     * A size of 0 may be a page being written as the store is created: looked at again. */
    if ((m0.magic && !m0.ok) || (m1.magic && (!m1.ok || m1.psize != m0.psize))) {
        *young = (m0.magic && m0.psize == 0) || (m1.magic && m1.psize == 0);
        return kvm_err(KVM_ECORRUPT,
                       "store %s: data.mdb is damaged: its meta pages, page 0 and page 1, give page sizes %u and %u; "
                       "restore the store from a copy, or move it aside and run again (its documents are compressed "
                       "again)",
                       dir, m0.psize, m1.psize);
    }
    if (m0.ok && m0.bad[0]) return meta_damaged(dir, path, 0, m0.psize, m0.bad);
    if (m1.ok && m1.bad[0]) return meta_damaged(dir, path, 1, m0.psize, m1.bad);
    if (m0.ok && m1.read && !m1.magic) {
        *young = m1.raw_magic == 0; /* a store being created may not have written it yet */
        snprintf(what, sizeof what, "does not hold LMDB's magic number (bytes %d-%d read 0x%08x, not 0x%08x)",
                 META_OFF, META_OFF + 3, m1.raw_magic, META_MAGIC);
        return meta_damaged(dir, path, 1, m0.psize, what);
    }
    if (m0.read && !m0.magic && (size >= 2 * MIN_PAGE || m0.raw_magic != 0)) {
        /* said here, not by mdb_env_open: it creates lock.mdb before it reads data.mdb, and a
         * read-only command that fails must leave the user's folder as it found it; a page of
         * zeros too short for two meta pages may be a store being created, looked at again */
        *young = 0;
        return kvm_err(KVM_EFORMAT,
                       "store %s: not an LMDB environment: %s is not an LMDB file (bytes %d-%d read 0x%08x, not "
                       "LMDB's magic number 0x%08x); name the folder of a kvmill store",
                       dir, path, META_OFF, META_OFF + 3, m0.raw_magic, META_MAGIC);
    }
    if (!m0.ok) {
        return kvm_err(KVM_EFORMAT,
                       "store %s: truncated: %lld bytes, expected at least 2 meta pages (%d bytes at a %d-byte page size)",
                       path, (long long)size, 2 * 4096, 4096);
    }
    const meta_page *m = m1.ok && m1.psize == m0.psize && m1.txnid > m0.txnid ? &m1 : &m0;
    int64_t want = (int64_t)(m->last_pg + 1) * (int64_t)m->psize;
    if (want < 2 * (int64_t)m0.psize) want = 2 * (int64_t)m0.psize;
    if (m->last_pg > (uint64_t)(INT64_MAX / MAX_PAGE) || size < want)
        return kvm_err(KVM_EFORMAT,
                       "store %s: truncated: %lld bytes, expected at least %lld (%llu pages of %u bytes, as its meta page "
                       "says); restore the store from a copy or remove it",
                       path, (long long)size, (long long)want, (unsigned long long)(m->last_pg + 1), m->psize);
    return 0;
}

int kvm_store__data_uncommitted(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return 0;
    struct stat st;
    int empty = 0;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
        meta_page m0, m1 = {0};
        meta_read(fd, 0, 0, (int64_t)st.st_size, &m0);
        if (m0.ok) meta_read(fd, (off_t)m0.psize, 1, (int64_t)st.st_size, &m1);
        empty = !m0.read || (m0.ok && m0.txnid == 0 && (!m1.read || (m1.magic && m1.txnid == 0)));
    }
    close(fd);
    return empty;
}

int kvm_store__check_lock_space(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/lock.mdb", dir);
    struct stat st;
    long page = sysconf(_SC_PAGESIZE);
    int64_t need = page > 0 ? page : 4096; /* the page LMDB writes at open: header and first reader slots */
    if (stat(path, &st) == 0) need -= (int64_t)st.st_blocks * 512; /* blocks come first page first */
    else if (errno != ENOENT) return 0; /* mdb_env_open says why */
    struct statvfs vs;
    if (need <= 0 || statvfs(dir, &vs) != 0) return 0;
    int64_t avail = (int64_t)(geteuid() == 0 ? vs.f_bfree : vs.f_bavail) * (int64_t)vs.f_frsize;
    if (avail >= need) return 0;
    return kvm_err(KVM_EFULL, "store %s: no space left on the store's device for its lock file lock.mdb (%lld KiB "
                              "free, %lld KiB needed): free space and open it again",
                   dir, (long long)avail / 1024, (long long)(need + 1023) / 1024);
}

/* 1 unless DIR/lock.mdb shows that no process has the environment open: each one holds a POSIX
 * record lock on its byte 0, the one creating the store exclusively from before it opens data.mdb
 * until the meta pages are written (lmdb mdb.c: mdb_env_setup_locks runs before the data file is
 * opened). No lock.mdb, or nobody holding it, means no store is being created: a file without its
 * meta pages (a zero-byte data.mdb) is refused at once rather than after the 3 s wait. A lock
 * that cannot be tested (a filesystem without record locks) counts as held, as before. */
static int maybe_being_created(const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/lock.mdb", dir);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* O_NONBLOCK: a FIFO does not wait */
    if (fd < 0) return errno != ENOENT;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    int held = fcntl(fd, F_GETLK, &fl) != 0 || fl.l_type != F_UNLCK;
    close(fd);
    return held;
}

int kvm_store__check_file(const char *dir)
{
    int young = 0, st = check_once(dir, &young);
    if (st && young && !maybe_being_created(dir)) return st;
    for (int i = 0; st && young && i < 60; i++) { /* give a store being created 3 s to get its meta pages (1 s was too short under ASan) */
        usleep(50000);
        st = check_once(dir, &young);
    }
    return st;
}

const char *kvm_store__network_fs(unsigned long f_type)
{
    static const struct {
        unsigned long magic; /* linux/magic.h, or the filesystem's own source where it has none there */
        const char *name;
    } fs[] = {{0x6969, "nfs"},       {0xFF534D42, "cifs"}, {0xFE534D42, "smb2"},   {0x517B, "smb"},
              {0x5346414F, "afs"},   {0x6B414653, "kafs"}, {0x00C36400, "ceph"},   {0x0BD00BD0, "lustre"},
              {0x47504653, "gpfs"},  {0x73757245, "coda"}, {0x564C, "ncp"},        {0x01161970, "gfs2"},
              {0x7461636F, "ocfs2"}, {0x01021997, "9p"},   {0x19830326, "beegfs"}, {0x20030528, "orangefs"}};
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++)
        if ((f_type & 0xFFFFFFFFul) == fs[i].magic) return fs[i].name;
    return NULL;
}

int kvm_store__check_fs(const char *dir)
{
    struct statfs sf;
    if (statfs(dir, &sf) != 0) return 0;
    const char *name = kvm_store__network_fs((unsigned long)sf.f_type);
    if (!name) return 0;
    return kvm_err(KVM_EINVAL,
                   "store %s is on a network filesystem (%s): LMDB's locks and memory map do not work there (lmdb.h, "
                   "caveats), so caches could be corrupted or read half-written; keep the store on a local disk and "
                   "let other hosts use it through the store service (kvmill store serve)",
                   dir, name);
}
