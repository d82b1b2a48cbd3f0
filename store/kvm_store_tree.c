/* kvm_store_tree.c: the structural check of data.mdb's B-tree pages that every transaction
 * passes before LMDB reads or writes them. LMDB keeps no page checksums and trusts its pages:
 * one flipped byte in a page header or node (a node offset, a key size, a child page number)
 * made mdb_get, cursor walks and mdb_cursor_del read or write outside the page, killing the
 * process (SIGSEGV, SIGBUS, an assert) or looping, and a delete could rewrite other pages.
 * This walk reads the snapshot the transaction sees, from the meta page down, with every
 * offset bounds-checked before it is followed, and refuses the store (KVM_ECORRUPT) unless
 * every page LMDB can reach is as LMDB writes it. Checking first is the sound way: a SIGSEGV
 * handler cannot undo what LMDB did before the fault (a write through a bad page rewrites other
 * records, its locks and half-made txn stay), and reads in a forked child cost a fork each and
 * still leave writes unguarded. Layout (lmdb/mdb.c 0.9, 64-bit builds):
 * a page is a 16-byte header (u64 pgno, u16 pad, u16 flags, u16 lower, u16 upper; an
 * overflow page holds u32 page count instead of lower/upper), then u16 node offsets; a node
 * is u16 lo, u16 hi, u16 flags, u16 key size, the key, then the value (leaf) or nothing
 * (branch: lo | hi << 16 | flags << 32 is the child page). */
#include "store/kvm_store_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "common/kvm_error.h"

_Static_assert(sizeof(size_t) == 8, "the page layout below is LMDB's on 64-bit builds (pgno_t = size_t)");
#if MDB_VERSION_MAJOR != 0 || MDB_VERSION_MINOR != 9
#error "kvm_store_tree.c reads LMDB 0.9's page layout (LMDB 1.0 pages carry a txnid): check it against mdb.c"
#endif

#define PG_HDR 16     /* page header bytes (PAGEHDRSZ) */
#define P_BRANCH 0x01 /* page flags */
#define P_LEAF 0x02
#define P_OVERFLOW 0x04
#define NODE_HDR 8             /* node header bytes (NODESIZE) */
#define F_BIGDATA 0x01         /* leaf node flags: value on overflow pages */
#define F_SUBDATA 0x02         /* value is a named db record (main db only) */
#define DB_REC 48              /* bytes of an MDB_db record */
#define META_DBS (PG_HDR + 24) /* offset of the meta's two MDB_db records: free, main */
#define META_LAST_PG (META_DBS + 2 * DB_REC)
#define META_TXNID (META_LAST_PG + 8)
#define MAX_DEPTH 32             /* LMDB's cursor stack (CURSOR_STACK) */
#define MAX_KEY 511              /* LMDB's largest key */
#define MAX_NAMED 64             /* named dbs looked at; a kvmill store has KVM_STORE__DB_COUNT */
#define P_INVALID (~(uint64_t)0) /* root of an empty db */

/* An MDB_db record: one B-tree's root and counts. */
typedef struct tree_db {
    uint16_t flags;      /* persistent db flags (0 for every kvmill db) */
    uint16_t depth;      /* levels, 0 for an empty db */
    uint64_t n_branch;   /* branch pages */
    uint64_t n_leaf;     /* leaf pages */
    uint64_t n_overflow; /* overflow pages */
    uint64_t n_entries;  /* key/value pairs */
    uint64_t root;       /* root page, P_INVALID when empty */
} tree_db;

/* A key bound of a subtree: keys lie in [lo, hi); p == NULL is unbounded. */
typedef struct tree_key {
    const uint8_t *p; /* key bytes in the map, or NULL */
    size_t n;         /* key bytes */
} tree_key;

/* State of one check. */
typedef struct tree_ctx {
    kvm_store *s;              /* the store (path for messages) */
    const uint8_t *map;        /* the handle's read-only map of data.mdb (kvm_store.tree_map) */
    size_t psize;              /* page size, bytes */
    uint64_t n_pages;          /* pages [0, n_pages) belong to the snapshot (mm_last_pg + 1) */
    uint64_t file_pages;       /* of which [0, file_pages) are in data.mdb: the others can only be free */
    uint64_t *used;            /* bitmap: pages of a tree (and the two meta pages) */
    uint64_t *freed;           /* bitmap: pages listed in the free db */
    char db[80];               /* db being walked, for messages */
    int free_db;               /* 1 in the free db: integer keys, values are page lists */
    int main_db;               /* 1 in the main db: values are named db records */
    tree_db counted;           /* what the walk found in the current db */
    tree_db named[MAX_NAMED];  /* named db records seen in the main db */
    char names[MAX_NAMED][64]; /* their printable names */
    int n_named;               /* entries of named[] */
} tree_ctx;

/* LMDB stores its page fields in host byte order: native loads (memcpy: unaligned-safe). */
static inline uint16_t u16_at(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint32_t u32_at(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint64_t u64_at(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* KVM_ECORRUPT naming the store, the db, the page, the byte of data.mdb and what is wrong. */
__attribute__((format(printf, 4, 5))) static int bad(const tree_ctx *c, uint64_t pgno, size_t off, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    unsigned long long at = (unsigned long long)pgno * c->psize + off;
    return kvm_err(KVM_ECORRUPT,
                   "store %s: data.mdb is damaged: %s, page %llu (byte %llu of the file): %s; refused before LMDB "
                   "read or wrote through it: restore the store from a copy, or move it aside and run again (its "
                   "documents are compressed again); kvmill store verify checks a store",
                   c->s->path, c->db, (unsigned long long)pgno, at, what);
}

static int bit_test_set(uint64_t *bits, uint64_t i)
{
    uint64_t m = 1ull << (i & 63);
    int was = (bits[i >> 6] & m) != 0;
    bits[i >> 6] |= m;
    return was;
}

static void db_decode(const uint8_t *p, tree_db *d)
{
    d->flags = u16_at(p + 4);
    d->depth = u16_at(p + 6);
    d->n_branch = u64_at(p + 8);
    d->n_leaf = u64_at(p + 16);
    d->n_overflow = u64_at(p + 24);
    d->n_entries = u64_at(p + 32);
    d->root = u64_at(p + 40);
}

/* LMDB's default order (mdb_cmp_memn): bytes, then length; the free db's keys are u64. */
static int key_cmp(const tree_ctx *c, const uint8_t *a, size_t an, const uint8_t *b, size_t bn)
{
    if (c->free_db && an == 8 && bn == 8) {
        uint64_t x = u64_at(a), y = u64_at(b);
        return x < y ? -1 : x > y;
    }
    int r = memcmp(a, b, an < bn ? an : bn);
    return r ? r : an < bn ? -1 : an > bn;
}

/* Claims page pgno for a tree: in the snapshot, not a meta page, not claimed before (a page
 * reached twice is a loop or two trees sharing a page: a write through one rewrites the other). */
static int page_claim(tree_ctx *c, uint64_t from, uint64_t pgno, const char *what)
{
    if (pgno < 2 || pgno >= c->file_pages)
        return bad(c, from, 0, "%s page number %llu outside the file's pages [2, %llu)", what, (unsigned long long)pgno,
                   (unsigned long long)c->file_pages);
    if (bit_test_set(c->used, pgno))
        return bad(c, from, 0, "%s page %llu is reached twice (a loop or a shared page)", what,
                   (unsigned long long)pgno);
    const uint8_t *p = c->map + pgno * c->psize;
    if (u64_at(p) != pgno) return bad(c, pgno, 0, "its header says page %llu", (unsigned long long)u64_at(p));
    return 0;
}

/* Checks an overflow run holding a value of dsize bytes and claims its pages. */
static int overflow_check(tree_ctx *c, uint64_t from, uint64_t pgno, uint64_t dsize)
{
    int st = page_claim(c, from, pgno, "overflow");
    if (st) return st;
    const uint8_t *p = c->map + pgno * c->psize;
    uint32_t n = u32_at(p + 12);
    uint64_t need = (PG_HDR - 1 + dsize) / c->psize + 1;
    if (u16_at(p + 10) != P_OVERFLOW) return bad(c, pgno, 10, "flags 0x%x, expected an overflow page", u16_at(p + 10));
    if (n < need || pgno + n > c->file_pages)
        return bad(c, pgno, 12, "%u overflow pages for a %llu-byte value (needs %llu, file has %llu pages)", n,
                   (unsigned long long)dsize, (unsigned long long)need, (unsigned long long)c->file_pages);
    for (uint64_t i = 1; i < n; i++)
        if (bit_test_set(c->used, pgno + i))
            return bad(c, pgno, 12, "overflow run overlaps page %llu", (unsigned long long)(pgno + i));
    c->counted.n_overflow += n;
    return 0;
}

/* A free db value: u64 count, then that many page numbers, descending. Marks them free. */
static int free_list_check(tree_ctx *c, uint64_t pgno, const uint8_t *v, uint64_t n)
{
    uint64_t count = n >= 8 ? u64_at(v) : 0;
    if (n < 8 || count > n / 8 - 1)
        return bad(c, pgno, 0, "a free-page list of %llu bytes says %llu pages", (unsigned long long)n,
                   (unsigned long long)count);
    for (uint64_t i = 0; i < count; i++) {
        uint64_t id = u64_at(v + 8 + 8 * i);
        if (id < 2 || id >= c->n_pages || (i && id >= u64_at(v + 8 * i)))
            return bad(c, pgno, 0, "free-page list entry %llu: page %llu out of range or order", (unsigned long long)i,
                       (unsigned long long)id);
        if (bit_test_set(c->freed, id))
            return bad(c, pgno, 0, "page %llu is listed free twice", (unsigned long long)id);
    }
    return 0;
}

/* A main db value: a named db record (F_SUBDATA) is kept to be walked after the main db. */
static int named_keep(tree_ctx *c, uint64_t pgno, const uint8_t *key, size_t kn, const uint8_t *v)
{
    if (c->n_named == MAX_NAMED) return bad(c, pgno, 0, "more than %d named databases", MAX_NAMED);
    char *name = c->names[c->n_named];
    size_t i = 0;
    for (; i < kn && i < sizeof c->names[0] - 1; i++)
        name[i] = key[i] >= 0x20 && key[i] < 0x7f ? (char)key[i] : '?';
    name[i] = '\0';
    db_decode(v, &c->named[c->n_named++]);
    return 0;
}

/* One leaf node at page offset `off` (already known to lie in the page). */
static int leaf_node(tree_ctx *c, uint64_t pgno, const uint8_t *p, size_t off)
{
    const uint8_t *nd = p + off;
    uint16_t flags = u16_at(nd + 4), kn = u16_at(nd + 6);
    uint64_t dsize = (uint64_t)u16_at(nd) | (uint64_t)u16_at(nd + 2) << 16;
    const uint8_t *v = nd + NODE_HDR + kn;
    int sub_ok = c->main_db && flags == F_SUBDATA;
    if (flags != 0 && flags != F_BIGDATA && !sub_ok) return bad(c, pgno, off + 4, "node flags 0x%x", flags);
    if (sub_ok && dsize != DB_REC)
        return bad(c, pgno, off, "a named db record of %llu bytes", (unsigned long long)dsize);
    c->counted.n_entries++;
    if (flags == F_BIGDATA) {
        int st = overflow_check(c, pgno, u64_at(v), dsize);
        if (st || !c->free_db) return st;
        return free_list_check(c, pgno, c->map + u64_at(v) * c->psize + PG_HDR, dsize);
    }
    if (sub_ok) return named_keep(c, pgno, nd + NODE_HDR, kn, v);
    return c->free_db ? free_list_check(c, pgno, v, dsize) : 0;
}

/* Bytes node i takes in its page (EVEN-rounded, as LMDB packs them). */
static size_t node_bytes(const uint8_t *nd, int leaf)
{
    size_t n = NODE_HDR + u16_at(nd + 6);
    if (leaf) n += (u16_at(nd + 4) & F_BIGDATA) ? 8 : ((size_t)u16_at(nd) | (size_t)u16_at(nd + 2) << 16);
    return (n + 1) & ~(size_t)1;
}

/* Page header and node layout: offsets, sizes and packing lie within the page; keys ascend
 * and lie in [lo, hi) (a branch's key 0 is not stored: LMDB ignores it). *n gets the keys. */
static int page_layout(tree_ctx *c, uint64_t pgno, const uint8_t *p, int leaf, const tree_key *lo, const tree_key *hi,
                       size_t *n)
{
    uint16_t lower = u16_at(p + 12), upper = u16_at(p + 14);
    if (lower < PG_HDR || (lower & 1) || lower > upper || upper > c->psize)
        return bad(c, pgno, 12, "free space bounds lower %u, upper %u in a %zu-byte page", lower, upper, c->psize);
    *n = (size_t)(lower - PG_HDR) / 2;
    size_t min_ptr = c->psize, sum = 0;
    const uint8_t *prev = NULL;
    size_t prev_n = 0;
    if (*n == 0 || (!leaf && *n < 2 && !c->free_db))
        return bad(c, pgno, 12, "%zu keys in a %s page", *n, leaf ? "leaf" : "branch");
    for (size_t i = 0; i < *n; i++) {
        size_t off = u16_at(p + PG_HDR + 2 * i);
        if (off < upper || off + NODE_HDR > c->psize)
            return bad(c, pgno, PG_HDR + 2 * i, "node %zu at offset %zu", i, off);
        const uint8_t *nd = p + off, *k = nd + NODE_HDR;
        size_t kn = u16_at(nd + 6), sz = node_bytes(nd, leaf);
        if (kn > MAX_KEY || off + sz > c->psize)
            return bad(c, pgno, off, "node %zu: %zu-byte key, %zu bytes in all, past the page end", i, kn, sz);
        min_ptr = off < min_ptr ? off : min_ptr;
        sum += sz;
        if (!leaf && i == 0) continue;
        if ((prev && key_cmp(c, prev, prev_n, k, kn) >= 0) || (lo->p && key_cmp(c, k, kn, lo->p, lo->n) < 0) ||
            (hi->p && key_cmp(c, k, kn, hi->p, hi->n) >= 0))
            return bad(c, pgno, off, "node %zu: key out of order", i);
        prev = k;
        prev_n = kn;
    }
    if (min_ptr != upper || sum != c->psize - upper)
        return bad(c, pgno, 14, "nodes fill %zu bytes from offset %zu, the header says %u", sum, min_ptr, upper);
    return 0;
}

static int walk_page(tree_ctx *c, uint64_t from, uint64_t pgno, int depth, int want, const tree_key *lo,
                     const tree_key *hi);

/* The children of branch page p, each with its key range. */
static int walk_children(tree_ctx *c, uint64_t pgno, const uint8_t *p, size_t n, int depth, int want,
                         const tree_key *lo, const tree_key *hi)
{
    for (size_t i = 0; i < n; i++) {
        const uint8_t *nd = p + u16_at(p + PG_HDR + 2 * i);
        uint64_t child = (uint64_t)u16_at(nd) | (uint64_t)u16_at(nd + 2) << 16 | (uint64_t)u16_at(nd + 4) << 32;
        tree_key clo = *lo, chi = *hi;
        if (i > 0) clo = (tree_key){nd + NODE_HDR, u16_at(nd + 6)};
        if (i + 1 < n) {
            const uint8_t *nx = p + u16_at(p + PG_HDR + 2 * (i + 1));
            chi = (tree_key){nx + NODE_HDR, u16_at(nx + 6)};
        }
        int st = walk_page(c, pgno, child, depth + 1, want, &clo, &chi);
        if (st) return st;
    }
    return 0;
}

/* Checks page pgno (reached from page `from`) at depth (1 = root) of a tree of `want` levels,
 * and everything under it. */
static int walk_page(tree_ctx *c, uint64_t from, uint64_t pgno, int depth, int want, const tree_key *lo,
                     const tree_key *hi)
{
    int st = page_claim(c, from, pgno, depth == 1 ? "root" : "child");
    if (st) return st;
    const uint8_t *p = c->map + pgno * c->psize;
    uint16_t flags = u16_at(p + 10);
    int leaf = depth == want;
    if (flags != (leaf ? P_LEAF : P_BRANCH))
        return bad(c, pgno, 10, "flags 0x%x at depth %d of %d, expected a %s page", flags, depth, want,
                   leaf ? "leaf" : "branch");
    size_t n = 0;
    if ((st = page_layout(c, pgno, p, leaf, lo, hi, &n))) return st;
    if (!leaf) {
        c->counted.n_branch++;
        return walk_children(c, pgno, p, n, depth, want, lo, hi);
    }
    c->counted.n_leaf++;
    for (size_t i = 0; i < n && st == 0; i++)
        st = leaf_node(c, pgno, p, u16_at(p + PG_HDR + 2 * i));
    return st;
}

/* Walks one db from its record and compares what it holds with the record's counts. */
static int walk_db(tree_ctx *c, const tree_db *d, uint64_t rec_page)
{
    memset(&c->counted, 0, sizeof c->counted);
    if (d->root == P_INVALID || d->depth == 0) {
        if (d->root == P_INVALID && d->depth == 0 && d->n_entries == 0) return 0;
        return bad(c, rec_page, 0, "record says root %llu at depth %u", (unsigned long long)d->root, d->depth);
    }
    if (d->depth > MAX_DEPTH) return bad(c, rec_page, 0, "record says depth %u (at most %d)", d->depth, MAX_DEPTH);
    tree_key none = {NULL, 0};
    int st = walk_page(c, rec_page, d->root, 1, d->depth, &none, &none);
    if (st) return st;
    const tree_db *w = &c->counted;
    if (w->n_branch != d->n_branch || w->n_leaf != d->n_leaf || w->n_overflow != d->n_overflow ||
        w->n_entries != d->n_entries)
        return bad(c, rec_page, 0,
                   "holds %llu/%llu/%llu branch/leaf/overflow pages and %llu entries, its record says "
                   "%llu/%llu/%llu and %llu",
                   (unsigned long long)w->n_branch, (unsigned long long)w->n_leaf, (unsigned long long)w->n_overflow,
                   (unsigned long long)w->n_entries, (unsigned long long)d->n_branch, (unsigned long long)d->n_leaf,
                   (unsigned long long)d->n_overflow, (unsigned long long)d->n_entries);
    return 0;
}

/* Walks the free db, the main db and every named db of the snapshot whose meta page is m. */
static int walk_all(tree_ctx *c, const uint8_t *m, uint64_t meta_pg)
{
    tree_db free_db, main_db;
    db_decode(m + META_DBS, &free_db);
    db_decode(m + META_DBS + DB_REC, &main_db);
    snprintf(c->db, sizeof c->db, "the free-page db");
    c->free_db = 1;
    int st = 0; /* LMDB runs its cursors by the flags stored here: integer keys, nothing else */
    if (free_db.flags != MDB_INTEGERKEY) st = bad(c, meta_pg, META_DBS + 4, "db flags 0x%x", free_db.flags);
    if (st == 0) st = walk_db(c, &free_db, meta_pg);
    c->free_db = 0;
    c->main_db = 1;
    snprintf(c->db, sizeof c->db, "the main db");
    if (st == 0 && main_db.flags) st = bad(c, meta_pg, META_DBS + DB_REC + 4, "db flags 0x%x", main_db.flags);
    if (st == 0) st = walk_db(c, &main_db, meta_pg);
    c->main_db = 0;
    for (int i = 0; st == 0 && i < c->n_named; i++) {
        snprintf(c->db, sizeof c->db, "db '%s'", c->names[i]);
        st = c->named[i].flags ? bad(c, main_db.root, 0, "db flags 0x%x", c->named[i].flags)
                               : walk_db(c, &c->named[i], main_db.root);
    }
    for (uint64_t w = 0; st == 0 && w < (c->n_pages + 63) / 64; w++)
        if (c->used[w] & c->freed[w]) {
            uint64_t pg = w * 64 + (uint64_t)__builtin_ctzll(c->used[w] & c->freed[w]);
            snprintf(c->db, sizeof c->db, "the free-page db");
            st = bad(c, pg, 0, "page %llu is in use and also listed free (a write would reuse it)",
                     (unsigned long long)pg);
        }
    return st;
}

/* Reads the meta page LMDB uses for snapshot txnid (slot txnid & 1) into out; 1 when that
 * slot holds that snapshot, 0 when it holds another (a writer has moved on: retry). */
static int meta_copy(const uint8_t *map, size_t psize, uint64_t txnid, uint8_t *out, size_t n)
{
    const uint8_t *m = map + (txnid & 1) * psize;
    if (u64_at(m + META_TXNID) != txnid) return 0;
    memcpy(out, m, n);
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy must be of that snapshot: read its txnid again */
    return u64_at(m + META_TXNID) == txnid && u64_at(out + META_TXNID) == txnid;
}

/* Where data.mdb stands: LMDB's own descriptor (no descriptor is opened or closed here) and
 * its fstat. */
static int file_stat(kvm_store *s, int *fd, struct stat *st)
{
    int rc = mdb_env_get_fd(s->env, fd);
    if (rc) return kvm_store__mdb(s, rc, "data file");
    if (fstat(*fd, st) != 0) return kvm_err(KVM_EIO, "store %s: data.mdb: %s", s->path, strerror(errno));
    return 0;
}

/* 1 when the file is as it was when snapshot txnid was last checked or committed here. A
 * file changed by anything but a commit (a copy, an editor, dd) has a new mtime or size. */
static int file_unchanged(const kvm_store *s, uint64_t txnid, const struct stat *st)
{
    return s->tree_ok && s->tree_ok_txnid == txnid && s->tree_ok_size == (int64_t)st->st_size &&
           s->tree_ok_mtime.tv_sec == st->st_mtim.tv_sec && s->tree_ok_mtime.tv_nsec == st->st_mtim.tv_nsec;
}

/* The snapshot's meta page (m, page meta_pg) within a file of file_bytes and a map of
 * map_bytes, then every tree. The file may end before the meta's last page: LMDB never writes
 * a page a transaction took and freed again (a loose page), which the free db then lists. */
static int check_snapshot(tree_ctx *c, const uint8_t *m, uint64_t meta_pg, size_t file_bytes, size_t map_bytes)
{
    uint64_t last = u64_at(m + META_LAST_PG);
    snprintf(c->db, sizeof c->db, "the meta page");
    if (u32_at(m + META_DBS) != c->psize || last < 1 || last >= map_bytes / c->psize)
        return bad(c, meta_pg, META_LAST_PG, "page size %u (LMDB uses %zu), last page %llu of a %zu-page map",
                   u32_at(m + META_DBS), c->psize, (unsigned long long)last, map_bytes / c->psize);
    c->n_pages = last + 1;
    c->file_pages = file_bytes / c->psize < c->n_pages ? file_bytes / c->psize : c->n_pages;
    c->used = calloc((c->n_pages + 63) / 64, 8);
    c->freed = calloc((c->n_pages + 63) / 64, 8);
    if (!c->used || !c->freed)
        return kvm_err(KVM_ENOMEM, "store %s: out of memory for a %llu-page check", c->s->path,
                       (unsigned long long)c->n_pages);
    c->used[0] |= 3; /* the two meta pages */
    return walk_all(c, m, meta_pg);
}

void kvm_store__tree_ok(kvm_store *s, uint64_t txnid)
{
    int fd;
    struct stat st;
    s->tree_ok = file_stat(s, &fd, &st) == 0;
    s->tree_ok_txnid = txnid;
    s->tree_ok_size = (int64_t)st.st_size;
    s->tree_ok_mtime = st.st_mtim;
}

/* The handle's read-only map of data.mdb, as long as LMDB's map (mapping past the end of the
 * file is allowed; only pages in it are read). Kept between checks, so a page read by the last
 * check is not faulted in again (a fresh map per check cost 110 ms on an 8000-cache store). */
static int tree_map(kvm_store *s, int fd, size_t map_bytes)
{
    if (s->tree_map && s->tree_map_bytes == map_bytes) return 0;
    if (s->tree_map) munmap(s->tree_map, s->tree_map_bytes);
    s->tree_map = mmap(NULL, map_bytes, PROT_READ, MAP_SHARED, fd, 0);
    s->tree_map_bytes = map_bytes;
    if (s->tree_map != MAP_FAILED) return 0;
    s->tree_map = NULL;
    return kvm_err(KVM_EIO, "store %s: cannot map data.mdb (%zu bytes): %s", s->path, map_bytes, strerror(errno));
}

void kvm_store__tree_unmap(kvm_store *s)
{
    if (s->tree_map) munmap(s->tree_map, s->tree_map_bytes);
    s->tree_map = NULL;
}

int kvm_store__tree_check(kvm_store *s, MDB_txn *txn, int write)
{
    uint64_t txnid = (uint64_t)mdb_txn_id(txn) - (write ? 1 : 0); /* a write txn modifies the last commit */
    int fd;
    struct stat fst;
    MDB_stat es;
    MDB_envinfo info;
    int st = file_stat(s, &fd, &fst), rc = st ? 0 : mdb_env_stat(s->env, &es);
    if (rc == 0 && st == 0) rc = mdb_env_info(s->env, &info);
    if (st || rc) return st ? st : kvm_store__mdb(s, rc, "env stat");
    if (file_unchanged(s, txnid, &fst)) return 0;
    size_t bytes = (size_t)fst.st_size, map_bytes = info.me_mapsize > bytes ? info.me_mapsize : bytes;
    if (bytes < 2 * (size_t)es.ms_psize)
        return kvm_err(KVM_ECORRUPT, "store %s: data.mdb is damaged: %zu bytes", s->path, bytes);
    if ((st = tree_map(s, fd, map_bytes))) return st;
    tree_ctx *c = calloc(1, sizeof *c);
    if (!c) return kvm_err(KVM_ENOMEM, "store %s: out of memory", s->path);
    c->s = s;
    c->psize = es.ms_psize;
    c->map = s->tree_map;
    uint8_t m[META_TXNID + 8] = {0};
    if (!meta_copy(c->map, c->psize, txnid, m, sizeof m))
        st = write
                 ? kvm_err(KVM_ECORRUPT, "store %s: data.mdb is damaged: meta page %llu does not hold transaction %llu",
                           s->path, (unsigned long long)(txnid & 1), (unsigned long long)txnid)
                 : KVM_STORE__TREE_RETRY;
    if (st == 0) st = check_snapshot(c, m, txnid & 1, bytes, info.me_mapsize);
    free(c->used);
    free(c->freed);
    free(c);
    s->tree_ok = st == 0;
    s->tree_ok_txnid = txnid;
    s->tree_ok_size = (int64_t)fst.st_size;
    s->tree_ok_mtime = fst.st_mtim;
    return st;
}
