/* kvm_store_internal.h: what the store/ files share and the tests may poke at: the handle's
 * body, key layouts, the checksummed record format, and the transaction helpers that grow
 * the map and survive other processes growing it. Not part of the public API. */
#ifndef KVM_STORE_INTERNAL_H
#define KVM_STORE_INTERNAL_H

#include <lmdb.h>
#include <pthread.h>
#include <sys/types.h>
#include <time.h>

#include "store/kvm_store.h"
#include "store/kvm_store_lockwait.h"

/* Named databases. The names are the on-disk db names. */
enum kvm_store__db {
    KVM_STORE__DB_META,       /* "meta": bookkeeping (format version, cap, cache bytes, ...) */
    KVM_STORE__DB_MODELS,     /* "models": model id -> model meta record */
    KVM_STORE__DB_DOCS,       /* "docs": doc hash -> doc meta record */
    KVM_STORE__DB_STRATEGIES, /* "strategies": model id + name -> strategy record */
    KVM_STORE__DB_CACHES,     /* "caches": model + doc + config + layer(u32 BE) -> record */
    KVM_STORE__DB_ATIME,      /* "atime": model + doc + config -> u64 LE last served, ns */
    KVM_STORE__DB_LRU,        /* "lru": u64 BE atime ns + model + doc + config -> "" */
    KVM_STORE__DB_FILES,      /* "files": BLAKE2b(abs path) -> model-id memo record */
    KVM_STORE__DB_CLAIMS,     /* "claims": model + doc + config -> claim record (a lease);
                                 absent in stores no writer of this build opened yet */
    KVM_STORE__DB_DOCNAMES,   /* "docnames": BLAKE2b-256(last '/'-part of a doc's source) + doc hash
                                 -> "" (the --doc-name index: one entry per docs record, written in
                                 its transaction; absent in stores no writer of this build opened,
                                 rebuilt on a writable open when its count differs from docs') */
    KVM_STORE__DB_COUNT
};

/* Key sizes. A cache key is the 96-byte prefix plus a 4-byte big-endian layer index, so a
 * cache's keys are adjacent and its manifest (index KVM_STORE__MANIFEST) sorts last. */
#define KVM_STORE__PREFIX_BYTES (3 * KVM_STORE_ID_BYTES)
#define KVM_STORE__CACHE_KEY_BYTES (KVM_STORE__PREFIX_BYTES + 4)
#define KVM_STORE__LRU_KEY_BYTES (8 + KVM_STORE__PREFIX_BYTES)
#define KVM_STORE__MANIFEST 0xFFFFFFFFu

/* Record format (every value of models, docs, strategies, caches, files), little-endian:
 *   [0,4)   magic "KVMS"
 *   [4,6)   u16 store format version
 *   [6,8)   u16 kind (enum kvm_store__kind)
 *   [8,12)  u32 n_parts
 *   [12,16) u32 reserved, 0
 *   [16, 16 + 8 n_parts)  u64 part lengths
 *   then the parts' bytes back to back
 *   last 32 bytes: BLAKE2b-256(key bytes || all record bytes before the checksum)
 * Hashing the key too means a value moved under another key is caught. */
#define KVM_STORE__REC_MAGIC "KVMS"
#define KVM_STORE__REC_HEADER 16
#define KVM_STORE__REC_SUM 32

enum kvm_store__kind {
    KVM_STORE__KIND_LAYER = 1,    /* parts = the layer's frames */
    KVM_STORE__KIND_MANIFEST = 2, /* part 0 = fixed manifest fields, part 1 = config bytes */
    KVM_STORE__KIND_STRATEGY = 3, /* part 0 = strategy bytes */
    KVM_STORE__KIND_MODEL = 4,    /* part 0 = fixed model meta fields */
    KVM_STORE__KIND_DOC = 5,      /* part 0 = fixed doc meta fields */
    KVM_STORE__KIND_FILE = 6,     /* part 0 = size, mtime, inode, device, ctime, model id; part 1 = path */
    KVM_STORE__KIND_CLAIM = 7,    /* part 0 = i64 since ms, i64 expires ms; part 1 = owner; part 2 = host */
};

/* Manifest part 0, v1 layout (LE): i32 n_layers, u32 0, i64 n_tokens, n_entries,
 * stored_bytes, full_bytes, created_unix_ms, char dtype[16], ids model, doc, config,
 * tokenizer (32 bytes each). */
#define KVM_STORE__MANIFEST_FIXED 192

/* What is at a store's path now against what it opened (kvm_store_here.c): the same store;
 * another store that can be opened beside this handle (another folder, or another data.mdb with
 * its own lock.mdb in the opened folder); nothing usable (no folder, no data.mdb, or another
 * data.mdb beside the lock.mdb this process has open, which LMDB cannot open twice); or the same
 * folder and data.mdb whose lock.mdb was removed or replaced. */
enum { KVM_STORE__AT_SAME, KVM_STORE__AT_REPLACED, KVM_STORE__AT_GONE, KVM_STORE__AT_LOCK_LOST };
int kvm_store__at_path(const kvm_store *s);
/* KVM_ESTATE naming the path, what happened and what to do, for a state other than
 * KVM_STORE__AT_SAME; 0 for that one. */
int kvm_store__at_err(const kvm_store *s, int at);
/* Before a transaction: 0 when the store at the path is the one opened; else KVM_ESTATE
 * (kvm_store__at_err). A read (writing 0) is refused only when lock.mdb was lost (its reader
 * slots are in a file other processes no longer see); a write also when the store is gone or
 * replaced (it would be committed where no one sees it). */
int kvm_store__still_here(const kvm_store *s, int writing);

struct kvm_store {
    MDB_env *env;                     /* the LMDB environment, owned */
    MDB_dbi dbi[KVM_STORE__DB_COUNT]; /* named db handles */
    char *path;                       /* directory, owned */
    kvm_store_opts opts;              /* as opened: kvm_store_follow opens a replaced store alike */
    dev_t dir_dev;                    /* the folder opened (stat of path at the open): */
    ino_t dir_ino;                    /* kvm_store_follow compares the folder at path now */
    dev_t lock_dev;                   /* the lock.mdb the environment opened (0, 0: none, */
    ino_t lock_ino;                   /* MDB_NOLOCK) */
    int read_only;                    /* opened MDB_RDONLY */
    char *lock_note;                  /* read-only open without lock.mdb (MDB_NOLOCK): why, owned; else NULL */
    int no_claims;                    /* read-only open of a store without the claims db */
    int no_docnames;                  /* read-only open of a store without the docnames db */
    int64_t map_max_bytes;            /* growth limit */
    int64_t atime_granularity_ns;     /* see kvm_store_opts.atime_granularity_ms; < 0 always */
    pid_t pid;                        /* process that opened the env */
    pthread_mutex_t mu;               /* serializes every call on the handle */
    int mdb_rc;                       /* raw LMDB code of the last failure in a write txn */
    unsigned max_readers;             /* slots of lock.mdb's reader table (its creator set them) */
    int tree_ok;                      /* 1: snapshot tree_ok_txnid passed kvm_store__tree_check */
    uint64_t tree_ok_txnid;           /* last snapshot checked */
    int64_t tree_ok_size;             /* data.mdb's size then, bytes */
    struct timespec tree_ok_mtime;    /* and its mtime */
    int txn_wrote;                    /* 1: the write txn in progress changed something */
    void *tree_map;                   /* the check's read-only map of data.mdb, or NULL */
    size_t tree_map_bytes;            /* its length */
    void (*txn_hook)(void *arg);      /* tests: called inside put's txn before the manifest */
    void *txn_hook_arg;               /* argument of txn_hook */
    kvm_store__lockwait lockwait;     /* a writable handle's waits for the write lock, watched */
};

/* A write step run by kvm_store__write inside a fresh write txn; returns a kvm status.
 * LMDB failures go through kvm_store__mdb(s, ...), which remembers the raw code so that
 * MDB_MAP_FULL is retried after growing the map. */
typedef int (*kvm_store__write_fn)(kvm_store *s, MDB_txn *txn, void *arg);

/* Locks the handle and checks it may be used by this process (KVM_ESTATE after fork). On
 * success the caller must kvm_store__unlock. */
int kvm_store__lock(kvm_store *s);
void kvm_store__unlock(kvm_store *s);
/* Runs fn in a write transaction and commits; on MDB_MAP_FULL (in fn or at commit) aborts,
 * doubles the map (up to map_max_bytes) and runs fn again. Before fn, the last commit's pages
 * pass kvm_store__tree_check (KVM_ECORRUPT: fn is not run, nothing is written). Handle must be
 * locked. */
int kvm_store__write(kvm_store *s, kvm_store__write_fn fn, void *arg);
/* Begins a read txn, adopting a map grown by another process (MDB_MAP_RESIZED), whose
 * snapshot's pages pass kvm_store__tree_check. A full reader table (MDB_READERS_FULL) frees
 * dead readers' slots and waits up to 0.63 s for a slot (blocking the caller). Errors:
 * KVM_ECORRUPT (then *txn is NULL), KVM_EBUSY (the table stayed full: retryable), LMDB's,
 * mapped by kvm_store__mdb. */
int kvm_store__read_begin(kvm_store *s, MDB_txn **txn);
/* The prologue of a walk over db `db` (a KVM_STORE__DB_* index): takes the handle's lock (as
 * kvm_store__lock), begins a read txn (kvm_store__read_begin) and opens a cursor on the db. On 0
 * the caller holds all three and ends them with kvm_store__cursor_end. On error nothing is held
 * (*txn and *cur are NULL, the lock is released): kvm_store__lock's, read_begin's, or the
 * cursor's (mapped by kvm_store__mdb). */
int kvm_store__cursor_begin(kvm_store *s, int db, MDB_txn **txn, MDB_cursor **cur);
/* Closes the cursor, ends the read txn of kvm_store__cursor_begin and releases the lock; sets
 * *txn and *cur to NULL. */
void kvm_store__cursor_end(kvm_store *s, MDB_txn **txn, MDB_cursor **cur);
/* Maps an LMDB code to a kvm status with a message "store PATH: WHAT: mdb error"; records
 * the raw code in s->mdb_rc. */
int kvm_store__mdb(kvm_store *s, int rc, const char *what);

/* The structural check of data.mdb's B-tree pages (store/kvm_store_tree.c), run on the
 * snapshot a transaction sees before anything reads or writes through LMDB: LMDB has no page
 * checksums, and one damaged page header or node made it read or write outside the page
 * (SIGSEGV, SIGBUS, an assert inside mdb_cursor_del) or loop. Walks the free db, the main db
 * and every named db from the meta page LMDB uses for the snapshot (txn's, or for a write txn
 * the last commit's), with every offset bounds-checked before it is followed: each page's own
 * number, flags for its level, node offsets, key and value sizes within the page and packed as
 * LMDB packs them, keys ascending and within their parent's range, child and overflow page
 * numbers within the snapshot and each page reached once, depth and counts equal to the db's
 * record, free-page lists in range, sorted, and disjoint from pages in use. Passes at once for
 * the snapshot this handle checked last, or committed with a change (kvm_store__tree_ok), while
 * data.mdb keeps that size and mtime (a file changed by anything but a commit is checked
 * again). Cost: one read of every branch and leaf page (overflow pages: their header), 2 bits
 * of memory per page of the file (14 ms for 4000 caches of 4 layers). Handle locked. Errors: KVM_ECORRUPT naming the store, the db, the page, the
 * byte of data.mdb and what is wrong; KVM_ENOMEM (bitmaps of 2 bits per page); and, for a read
 * txn only, KVM_STORE__TREE_RETRY when writers overwrote the meta page of its snapshot meanwhile
 * (abort it and begin another). */
#define KVM_STORE__TREE_RETRY 1
int kvm_store__tree_check(kvm_store *s, MDB_txn *txn, int write);
/* Records that snapshot txnid, which this handle's write txn just committed with a change
 * (s->txn_wrote: LMDB gave it that id), needs no check: LMDB made it from pages that passed
 * one. data.mdb's size and mtime are taken now: a later change by anything but a commit, or
 * another process's commit, has the next transaction check again. */
void kvm_store__tree_ok(kvm_store *s, uint64_t txnid);
/* Unmaps the check's map of data.mdb (kvm_store_close). */
void kvm_store__tree_unmap(kvm_store *s);

/* Checks DIR/data.mdb (when it exists) against its meta pages, read with pread: a file
 * shorter than the pages its newest meta says are in use would be mapped and kill the
 * process with SIGBUS on the first read past its end. A file without its two meta pages
 * gets up to 1 s to grow them (another process may be creating the store right now; LMDB
 * writes them as it creates the file). Errors: KVM_EFORMAT (truncated: the
 * message names the file, its size and the size expected; not an LMDB file: its first meta
 * page lacks LMDB's magic and no intact second meta page follows, the message names the file
 * and the bytes read; said here because mdb_env_open creates lock.mdb before it reads
 * data.mdb), KVM_ECORRUPT (a meta page with
 * LMDB's magic gives an invalid page size, or the two give different ones: LMDB would map the
 * file with it and read past its end), KVM_EIO (cannot read it). */
int kvm_store__check_file(const char *dir);

/* 1 when DIR/data.mdb is a regular file that holds no committed transaction: empty, shorter
 * than a meta page, or two meta pages that both give transaction 0 (LMDB writes them so when it
 * creates the file; the first commit writes 1). Removing such a file loses no data; the caller
 * must hold lock.mdb's byte 0 exclusively so that no process is creating or using it. 0 for
 * anything else (no file, a link, unreadable, not LMDB's). */
int kvm_store__data_uncommitted(const char *dir);

/* LMDB gives DIR/lock.mdb its size with ftruncate and maps it, so its pages get disk blocks
 * only when first written; on a full device the write of its first page (header and the
 * first 60 reader slots), inside mdb_env_open, kills the process with SIGBUS. This refuses
 * the open when that page has no blocks yet (no lock file, or one made on a full device) and
 * the device has no room for it. A lock file whose first page exists is left alone (as
 * before: a full store stays readable). It only stats: opening and closing lock.mdb here would
 * drop the fcntl locks LMDB holds on it in this process. Errors: KVM_EFULL naming the store
 * and the lock file. */
int kvm_store__check_lock_space(const char *dir);

/* The name of the network or cluster filesystem whose statfs f_type is `f_type` (nfs, cifs, smb2,
 * afs, ceph, lustre, gpfs, gfs2, ocfs2, ...), or NULL for any other (local disks, tmpfs, overlay;
 * FUSE and 9p are not counted: they also carry local filesystems). */
const char *kvm_store__network_fs(unsigned long f_type);

/* Refuses a store directory DIR on a network filesystem (kvm_store__network_fs of statfs(DIR)):
 * LMDB's locks and shared memory map do not work there, between hosts or even within one
 * (lmdb.h, caveats), so two writers could corrupt it and a reader see half a commit. A DIR
 * statfs cannot read is left to the open. Errors: KVM_EINVAL naming DIR and the filesystem. */
int kvm_store__check_fs(const char *dir);

/* The docnames index (store/kvm_store_docnames.c). */
#define KVM_STORE__DOCNAME_KEY_BYTES (2 * KVM_STORE_ID_BYTES)
/* The index key of a document whose source is source[0, len): BLAKE2b-256 of its last
 * '/'-separated part, then the doc hash. */
void kvm_store__docname_key(const char *source, size_t len, const kvm_store_id *doc_hash,
                            uint8_t out[KVM_STORE__DOCNAME_KEY_BYTES]);
/* In a write txn: puts the doc record (part 0: DOC_FIXED bytes) under doc_hash and its index
 * entry, removing the entry of the source it replaces. Returns a kvm status. */
int kvm_store__doc_put(kvm_store *s, MDB_txn *txn, const kvm_store_id *doc_hash, const uint8_t *fixed, size_t n);
/* In the open's write txn: rebuilds the docnames index from the docs records when their
 * counts differ (a store an older build wrote documents to). Returns a kvm status. */
int kvm_store__docnames_sync(kvm_store *s, MDB_txn *txn);

/* Key encoders. */
void kvm_store__cache_key(const kvm_store_cache_key *k, uint32_t layer, uint8_t out[KVM_STORE__CACHE_KEY_BYTES]);
void kvm_store__prefix(const kvm_store_cache_key *k, uint8_t out[KVM_STORE__PREFIX_BYTES]);
void kvm_store__prefix_decode(const uint8_t *p, kvm_store_cache_key *k);
uint32_t kvm_store__key_layer(const uint8_t *key);

/* Little-endian / big-endian helpers on unaligned bytes. */
void kvm_store__put_u16(uint8_t *p, uint16_t v);
void kvm_store__put_u32(uint8_t *p, uint32_t v);
void kvm_store__put_u64(uint8_t *p, uint64_t v);
uint16_t kvm_store__get_u16(const uint8_t *p);
uint32_t kvm_store__get_u32(const uint8_t *p);
uint64_t kvm_store__get_u64(const uint8_t *p);
void kvm_store__put_be64(uint8_t *p, uint64_t v);
/* The access time (unix ns) of the first cache of `lru` in txn, the one the cap evicts next;
 * *ns = 0 when none. 0 or the LMDB error (kvm_store__mdb). */
int kvm_store__oldest_served(kvm_store *s, MDB_txn *txn, uint64_t *ns);

/* Record codec (store/kvm_store_record.c). */
/* Bytes of a record holding parts[0, n_parts). */
size_t kvm_store__rec_size(const kvm_frame *parts, uint32_t n_parts);
/* Writes the record into dst[0, kvm_store__rec_size) (e.g. MDB_RESERVE'd map memory). */
void kvm_store__rec_write(uint8_t *dst, const MDB_val *key, uint16_t kind, const kvm_frame *parts,
                          uint32_t n_parts);
/* Puts a record under key in dbi (MDB_RESERVE, no intermediate copy). Returns an LMDB code. */
int kvm_store__rec_put(MDB_txn *txn, MDB_dbi dbi, const MDB_val *key, uint16_t kind, const kvm_frame *parts,
                       uint32_t n_parts);
/* Checks a record read under key: magic, version, kind, lengths, checksum. On success sets
 * *n_parts. Errors: KVM_ECORRUPT (message starts with `what`), KVM_EMISMATCH (another
 * format version). */
int kvm_store__rec_check(const MDB_val *key, const MDB_val *val, uint16_t kind, uint32_t *n_parts,
                         const char *what);
/* Views of the parts of a checked record (valid as long as val's memory). */
void kvm_store__rec_parts(const MDB_val *val, kvm_frame *parts, uint32_t n_parts);

/* Manifest fixed-part codec. Decode validates ranges (KVM_ECORRUPT naming `what`). */
void kvm_store__manifest_encode(const kvm_store_manifest *m, uint8_t out[KVM_STORE__MANIFEST_FIXED]);
int kvm_store__manifest_decode(const kvm_frame *fixed, const kvm_frame *config, kvm_store_manifest *m,
                               const char *what);
/* Checks and decodes a manifest record read under key (views valid as long as val's memory).
 * Errors: KVM_ECORRUPT, KVM_EMISMATCH (format version). */
int kvm_store__manifest_parse(const MDB_val *key, const MDB_val *val, kvm_store_manifest *m, const char *what);
/* Reads and checks the manifest of key in txn (views valid until txn ends). Errors:
 * KVM_ENOTFOUND, KVM_ECORRUPT, KVM_EMISMATCH (format version), KVM_EIO. */
int kvm_store__manifest_read(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, kvm_store_manifest *m);
/* Human name of a cache key for messages: 12-hex-digit prefixes "m:d:c" into out[48]. */
const char *kvm_store__key_name(const kvm_store_cache_key *k, char out[48]);

/* Meta values (u64 LE under a text key); missing -> 0. */
int kvm_store__meta_get(kvm_store *s, MDB_txn *txn, const char *name, int64_t *v);
int kvm_store__meta_set(kvm_store *s, MDB_txn *txn, const char *name, int64_t v);

/* Deletes every key of a cache (layers, manifest, access time) in txn; *freed_bytes = the
 * bytes of values removed (updates the recorded cache bytes itself). *n_keys = keys removed. */
int kvm_store__cache_delete(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, int64_t *freed_bytes,
                            int64_t *n_keys);

/* LRU bookkeeping (store/kvm_store_evict.c). */
/* Sets a cache's access time to now_ns (atime + lru dbs). */
int kvm_store__atime_set(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, uint64_t now_ns);
/* Removes a cache's access time records (missing is fine). */
int kvm_store__atime_del(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k);
/* Reads a cache's access time (0 when none). */
int kvm_store__atime_get(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, uint64_t *ns);
/* Evicts least recently served caches (never `keep`) until cache bytes + need <= cap.
 * Errors: KVM_EFULL (need alone exceeds the cap). */
int kvm_store__evict_for(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *keep, int64_t need);
/* Records the access time of a cache just served, when older than the granularity. */
void kvm_store__touch(kvm_store *s, const kvm_store_cache_key *k, uint64_t recorded_ns);
/* Wall clock, ns since 1970. */
uint64_t kvm_store__now_ns(void);

/* Tests: calls hook(arg) inside every put_cache write txn after the layers are written and
 * before the manifest; NULL removes it. */
void kvm_store__set_txn_hook(kvm_store *s, void (*hook)(void *arg), void *arg);

#endif
