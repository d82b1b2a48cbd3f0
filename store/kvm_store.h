/* kvm_store.h: the LMDB store of compressed KV caches, strategies, model and document
 * metadata. One environment directory, shared by every process of a pipeline (LMDB's own
 * locking); each process opens it once. Caches are stored as the proto `cache` wire frames,
 * so serving a cache is sending stored bytes. Every value carries a checksum verified on read.
 *
 * Thread-safety (all functions taking a kvm_store *): a handle may be used from several
 * threads; calls are serialized by a mutex inside the handle. Open a store at most once per
 * process (an LMDB rule) and never use a handle in a child after fork(): every call made
 * from another process than the opener returns KVM_ESTATE; the child opens its own.
 * Every function taking a kvm_store * also returns KVM_EINVAL for a NULL handle, and KVM_EBUSY
 * when it must read and LMDB's reader table is full (every slot held by read transactions of
 * this and other processes at once; retryable: kvm_err_retryable). Failures
 * leave a detail message in kvm_errmsg() (store path, cache key prefix, layer, what). */
#ifndef KVM_STORE_H
#define KVM_STORE_H

#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kvm_frame.h"

/* Store format version written into the `meta` db and into every record header. A reader
 * refuses records of another version (KVM_EMISMATCH) and stores of another (KVM_ENOTSUP: a newer kvmill's). */
#define KVM_STORE_FORMAT_VERSION 1u
/* Bytes of every id: BLAKE2b-256. */
#define KVM_STORE_ID_BYTES 32
/* Characters of an id printed as lowercase hex, without the terminating NUL. */
#define KVM_STORE_ID_HEX 64
/* Upper bound on manifest.n_layers (layer indices are stored as u32). */
#define KVM_STORE_MAX_LAYERS 65536
/* Upper bound on frames per layer value. */
#define KVM_STORE_MAX_FRAMES 1048576
/* Longest strategy name in bytes (no NUL inside; LMDB keys are at most 511 bytes). */
#define KVM_STORE_MAX_NAME 255
/* opts.cap_bytes value that records "no cap" in the store. */
#define KVM_STORE_CAP_NONE (-1)

/* A 32-byte binary id: model id (BLAKE2b-256 of the checkpoint file bytes), document hash
 * (BLAKE2b-256 of the int32 little-endian token ids), config id (BLAKE2b-256 of the
 * canonical encoding of the compression settings), tokenizer id (caller-defined hash). */
typedef struct kvm_store_id {
    uint8_t b[KVM_STORE_ID_BYTES]; /* digest bytes, in digest order */
} kvm_store_id;

/* The key of one cache: which model, which document, which compression settings. */
typedef struct kvm_store_cache_key {
    kvm_store_id model_id;  /* BLAKE2b-256 of the model checkpoint bytes */
    kvm_store_id doc_hash;  /* BLAKE2b-256 of the document's token ids (int32 LE) */
    kvm_store_id config_id; /* BLAKE2b-256 of the canonical compression settings */
} kvm_store_cache_key;

/* The manifest of one stored cache. It is written last, in the same transaction as the
 * layers, and carries its own checksum. Fields marked "set by put" are ignored on input. */
typedef struct kvm_store_manifest {
    uint32_t format_version;   /* store format that wrote it; set by put */
    int32_t n_layers;          /* layers of the cache, [1, KVM_STORE_MAX_LAYERS] */
    int64_t n_tokens;          /* tokens of the document the cache was built from, >= 0 */
    int64_t n_entries;         /* KV entries kept, summed over layers and KV heads, >= 0 */
    int64_t stored_bytes;      /* bytes of all layer frames (payload only); set by put */
    int64_t full_bytes;        /* bytes of the uncompressed f32 cache:
                                  2 * n_layers * n_kv_heads * n_tokens * head_dim * 4; >= 0 */
    int64_t created_unix_ms;   /* wall clock when put committed it, ms since 1970; set by put */
    char dtype[16];            /* stored tensor dtype name ("f32", "f16", "bf16"), NUL-terminated */
    kvm_store_id model_id;     /* must equal the key's model id */
    kvm_store_id doc_hash;     /* must equal the key's document hash */
    kvm_store_id config_id;    /* must equal the key's config id (= hash of `config`) */
    kvm_store_id tokenizer_id; /* tokenizer the token ids came from */
    kvm_frame config;          /* canonical settings bytes, opaque to the store; borrowed */
} kvm_store_manifest;

/* One layer's value: the frames of a proto `cache` message for that layer, opaque bytes. */
typedef struct kvm_store_layer {
    const kvm_frame *frames; /* [n_frames]; borrowed */
    uint32_t n_frames;       /* frames in this layer, [0, KVM_STORE_MAX_FRAMES] */
} kvm_store_layer;

/* A cache read back by kvm_store_get_cache: one heap block holding copies of everything.
 * All pointers inside (manifest.config, layers, layers[i].frames, frame data) point into
 * the block and stay valid until kvm_store_cache_free. Not tied to any transaction. */
typedef struct kvm_store_cache {
    kvm_store_manifest manifest; /* verified manifest; manifest.config points into the block */
    kvm_store_layer *layers;     /* [manifest.n_layers], verified layer values */
} kvm_store_cache;

/* Model metadata (`models` db, by model id). */
typedef struct kvm_store_model_meta {
    char name[64];      /* display name, NUL-terminated */
    char source[256];   /* where the checkpoint came from (path or URL), NUL-terminated */
    int32_t dim;        /* model width */
    int32_t hidden_dim; /* FFN width */
    int32_t n_layers;   /* transformer layers */
    int32_t n_heads;    /* query heads */
    int32_t n_kv_heads; /* KV heads (GQA) */
    int32_t head_dim;   /* dim / n_heads */
    int32_t vocab_size; /* tokens in the vocabulary */
    int32_t seq_len;    /* maximum context, tokens */
} kvm_store_model_meta;

/* Document metadata (`docs` db, by doc hash). */
typedef struct kvm_store_doc_meta {
    int64_t n_tokens;  /* tokens in the document */
    char source[256];  /* corpus file or name the document came from, NUL-terminated */
} kvm_store_doc_meta;

/* A claim on a cache key: a lease held by the run compressing that document, so another
 * run on the same store skips it. It lapses at expires_unix_ms unless renewed. */
typedef struct kvm_store_claim {
    char owner[128];         /* who holds it (e.g. "run:HOST:PID:START"), NUL-terminated */
    char host[64];           /* host name of the holder, NUL-terminated */
    int64_t since_unix_ms;   /* wall clock when this owner first took it, ms since 1970 */
    int64_t expires_unix_ms; /* wall clock when it lapses unless renewed, ms since 1970 */
} kvm_store_claim;

typedef struct kvm_store kvm_store;

/* Options of kvm_store_open. Zero-initialize, then set what you need. */
typedef struct kvm_store_opts {
    int64_t map_size_bytes;     /* initial LMDB map size; 0 = 64 MiB; rounded up to 64 KiB */
    int64_t map_max_bytes;      /* the map doubles on MDB_MAP_FULL up to this; 0 = 1 TiB */
    int64_t cap_bytes;          /* cap on stored cache bytes: > 0 sets and records it in the
                                   store, KVM_STORE_CAP_NONE records "no cap", 0 keeps the
                                   store's recorded cap (none when never set) */
    int64_t atime_granularity_ms; /* a read re-records a cache's access time only when the
                                     recorded one is older than this; 0 = 1000; < 0 = always */
    int read_only;              /* 1: MDB_RDONLY; nothing is created or written; without
                                   a writable lock.mdb, MDB_NOLOCK (kvm_store_lock_note) */
    int must_exist;             /* 1: read-write, but a store missing at path is KVM_ENOTFOUND
                                   instead of being created (a mistyped path fails) */
    int no_sync;                /* 1: MDB_NOSYNC: commits survive a process crash, not an OS
                                   crash (tests, scratch stores) */
    int max_readers;            /* slots of LMDB's reader table (one per read transaction open
                                   at once, all processes together); 0 = 510. Set by the process
                                   that initialises lock.mdb (the first to open the store while
                                   no other has it open); the others use its size */
} kvm_store_opts;

/* Usage numbers of a store (kvm_store_stats). */
typedef struct kvm_store_stats {
    uint32_t format_version; /* the store's recorded format version */
    int64_t n_caches;        /* caches with a manifest */
    int64_t n_strategies;    /* strategies */
    int64_t n_models;        /* model metadata records */
    int64_t n_docs;          /* document metadata records */
    int64_t cache_bytes;     /* bytes of cache values (layers + manifests, with headers) */
    int64_t cap_bytes;       /* the recorded cap on cache_bytes; 0 = no cap */
    int64_t n_evicted;       /* caches evicted by the cap since the store was created */
    int64_t map_size_bytes;  /* current LMDB map size */
    int64_t map_used_bytes;  /* map bytes in use (last page + 1) * page size */
    int64_t map_max_bytes;   /* this handle's growth limit */
    uint64_t oldest_served_ns; /* when the least recently served cache was last served (or
                                  committed), unix ns by the writer's clock: the cap evicts it
                                  first, so no cache served later was evicted while it is
                                  there; 0 when the store holds none */
} kvm_store_stats;

/* ---- ids (store/kvm_store_ids.c); no store needed, thread-safe ---- */

/* BLAKE2b-256 of data[0, n). data may be NULL when n == 0. */
void kvm_store_hash_bytes(const void *data, size_t n, kvm_store_id *out);
/* Document hash: BLAKE2b-256 of tokens[0, n_tokens) as int32 little-endian (whatever the
 * host byte order). Errors: KVM_EINVAL (n_tokens < 0, or NULL tokens with n_tokens > 0). */
int kvm_store_doc_hash(const int32_t *tokens, int64_t n_tokens, kvm_store_id *out);
/* BLAKE2b-256 of a whole file's bytes, streamed (no size limit); for a Hugging Face folder,
 * of its files' bytes back to back in kvm_hf_model_files order (config.json, then the weights).
 * Errors: KVM_EIO (open/read failed; message names the path), KVM_ENOMEM. */
int kvm_store_hash_file(const char *path, kvm_store_id *out);
/* Lowercase hex of an id into out[KVM_STORE_ID_HEX + 1] (NUL-terminated). Returns out. */
char *kvm_store_id_hex(const kvm_store_id *id, char *out);
/* Parses exactly 64 hex digits (either case). Errors: KVM_EINVAL (names the bad text). */
int kvm_store_id_parse(const char *hex, kvm_store_id *out);
/* 1 when `prefix` (hex, either case, 0..64 digits) is a prefix of the id's hex, else 0. */
int kvm_store_id_has_prefix(const kvm_store_id *id, const char *prefix);

/* ---- waits for the write lock (store/kvm_store_lockwait.c) ---- */

/* LMDB's write lock is one process-shared mutex; a write waits for it without end and no
 * signal interrupts the wait. A process holding it for long (a kvmill writer stopped with
 * Ctrl-Z or kill -STOP inside a commit, or hung) froze every writer. So every process with a
 * writable handle gets one watchdog thread (started by its first writable open, joined when
 * its last writable handle is closed): a wait of 2 s
 * or more is said on stderr through kvm_log, once per wait (event store_lock_wait: the store,
 * how to find the holder, and the stopped processes of this user that have the store open),
 * and so is its end (store_lock_wait_end).
 * This sets the process's interrupt flag: a counter its SIGINT/SIGTERM handler increments
 * (borrowed; NULL, the default, for none; atomic: the watchdog thread reads it). When it changes
 * during such a wait (of 2 s or more: an interrupt during an ordinary short wait is the
 * process's own business) and the wait looks stuck (a stopped process has the store open, the
 * wait has lasted 30 s, or the counter is 2 or more: a second interrupt), the watchdog logs
 * that (event store_lock_interrupted) with note (borrowed, static; may be NULL: what the
 * process leaves undone, e.g. its summary) and ends the process with _exit(130); a wait behind
 * a holder that is only busy is left alone, said once (store_lock_interrupt_deferred): the
 * process handles that interrupt itself once it has the lock (kvmill run drains). On exit:
 * the waiting thread holds no write transaction and never gets one after, so nothing it
 * would write is half-written. Only for a process whose store writes and files are all
 * written by the thread that waits (kvmill run's orchestrator): another thread of it would be
 * cut off mid-file. Not for use inside a signal handler. */
void kvm_store_set_interrupt(const atomic_int *flag, const char *note);

/* ---- open / close (store/kvm_store.c) ---- */

/* Opens (read-write: creating the directory, one level, and the databases if missing, unless
 * must_exist) the LMDB environment directory `path`. opts may be NULL (defaults). Clears stale
 * reader slots of dead processes (mdb_reader_check). *out is set on success, NULL on failure.
 * Every transaction of the handle, the open's first, begins with a structural check of the
 * data.mdb pages it can reach (LMDB has no page checksums: a damaged page made it crash or
 * loop); a snapshot committed by another process since is checked again, so every function
 * taking a kvm_store * may also return KVM_ECORRUPT for damaged pages, without having read or
 * written anything through them.
 * Errors: KVM_EINVAL (bad opts; path on a network filesystem, kvm_store__check_fs), KVM_ENOTFOUND (read_only or
 * must_exist, and no store at path: no directory, or one without data.mdb; nothing is created), KVM_EFORMAT (path is
 * not an LMDB environment directory, or its data.mdb is not an LMDB file (no LMDB magic in its first meta page: the
 * message names the file and the bytes read), or not a kvmill store, or its data.mdb is shorter than its meta pages
 * say: checked with pread before mapping, the message names the file, its size and the size expected), KVM_ECORRUPT
 * (damaged B-tree pages: the message names the store, the db, the page and the byte of data.mdb, and what is wrong; or
 * a damaged meta page: bad page size, magic, meta flag, data version or page number, the message naming the page, its
 * bytes and the file; nothing is written),
 * KVM_ENOTSUP (store of another format version: a newer kvmill's), KVM_EIO (permissions, I/O),
 * KVM_EFULL (map_max_bytes too small to create the databases), KVM_ENOMEM, KVM_EBUSY (a
 * read_only open whose first read found LMDB's reader table full after the wait of
 * kvm_store__read_begin: retryable, nothing to change in the settings).
 * A read_only open that fails creates nothing, and a read-write open refused with KVM_EFORMAT
 * (no kvmill store) leaves no lock.mdb it made: one that LMDB created on the way (it makes the
 * lock file before it reads data.mdb) is removed again, unless another process has the
 * environment open meanwhile; a lock.mdb that was there before is never removed. A read-write
 * open failing otherwise keeps its lock.mdb: another kvmill process may be opening the same
 * store at that moment. A read-write open that was to create the store (no data.mdb before it)
 * and fails (a full disk, a file size limit) removes the data.mdb it made when no process has
 * the environment open and the file holds no commit, and a directory it made together with its
 * lock.mdb when nothing else is in it: the folder is left as it was found, never losing a file
 * that existed before the open. */
int kvm_store_open(const char *path, const kvm_store_opts *opts, kvm_store **out);

/* Whether a writable kvm_store_open could create a store at path, as far as the folder goes: 0
 * when path does not exist and its parent is a writable folder, is not a folder (the open says
 * why), already holds a data.mdb, or is a writable folder holding nothing but lock.mdb, lost+found
 * or hidden entries; KVM_EINVAL (message naming the store path and the folder at fault) when the
 * parent folder is missing, not a folder or not writable, when the folder is not writable, or
 * when it holds other files (naming its entries and one of them), which the open refuses.
 * For a command that creates the store later (kvmill serve --compute-missing: its decode
 * workers do) to refuse at its start. Reads the folder only. */
int kvm_store_check_new_dir(const char *path);
/* 1 when a read-write open of the store at `path` would fail for want of write permission:
 * the directory, its data.mdb or its lock.mdb exists and access(2) says it cannot be written
 * (a read-only filesystem, a copy owned by someone else); *why (why_size bytes) then names
 * the file and the reason. 0 otherwise, also where nothing exists yet (the open creates it,
 * or refuses it under must_exist). Lets a process that only reads unless asked to write
 * (kvmill serve's decode workers) open such a store read_only instead of failing. */
int kvm_store_unwritable(const char *path, char *why, size_t why_size);
/* Closes the environment and frees the handle; accepts NULL and *s == NULL; sets *s = NULL.
 * Must not race with other calls on the same handle. Called from a forked child it only
 * frees this process's memory (the parent's environment is left alone). */
void kvm_store_close(kvm_store **s);
/* The directory the store was opened on; valid until kvm_store_close. */
const char *kvm_store_path(const kvm_store *s);
/* NULL for a handle that takes LMDB's reader lock. A read_only open whose lock.mdb cannot be
 * opened for writing (read-only files or directory, a lock file that is not a file) reads
 * without one (MDB_NOLOCK) instead of failing: then the reason, for the caller to say that
 * the reader takes no lock (a writer working on the store meanwhile may reuse pages it
 * reads). Valid until kvm_store_close. */
const char *kvm_store_lock_note(const kvm_store *s);
/* Follows the store at (*s)'s path for a long-lived process (a decode worker, the store
 * service) that others may swap a store under: `kvmill store compact --out COPY`, then
 * `mv STORE STORE.old && mv COPY STORE` as compact prints. Without this it went on answering
 * from, or committing into, the folder moved away, which nobody else sees. Checks (stats only):
 * - the same folder and data.mdb as opened: 0, *s untouched;
 * - another store at the path (another folder holding a data.mdb, or another data.mdb with its
 *   own lock.mdb in the opened folder): opened again with the first open's options except that
 *   it must exist (never created here), *s closed and replaced, *reopened = 1 (may be NULL), 0;
 *   a failed open leaves *s as it was and returns the open's status, naming the path and why;
 * - nothing usable there (no folder, no data.mdb, or another data.mdb beside the lock.mdb this
 *   process has open, which LMDB cannot open twice): waits up to wait_ms ms (polling every 20
 *   ms: a swap's two renames leave nothing there for a moment), then KVM_ESTATE naming the path
 *   and what to do; *s is left as it was. The caller refuses the request rather than read or
 *   write a store no one else sees;
 * - the same folder and data.mdb whose lock.mdb was removed or replaced: KVM_ESTATE at once,
 *   saying to restart every process that has the store open (LMDB cannot open the environment
 *   again in this process while its first open lives).
 * Every transaction checks the same (kvm_store_here.c) without following: a write into a store
 * gone or replaced, and any transaction after lock.mdb was lost, fail with KVM_ESTATE.
 * Not while another thread uses *s. */
int kvm_store_follow(kvm_store **s, int wait_ms, int *reopened);
/* 0 when the store at s's path is still the one s opened (the same folder, data.mdb and
 * lock.mdb), else KVM_ESTATE naming the path and what happened (moved or removed, replaced,
 * lock.mdb lost): what a write through s would meet (kvm_store_here.c). Stats only. */
int kvm_store_check_here(const kvm_store *s);
/* Which store the folder `path` is, as a place (PROTOCOL.md §5, revision 15): BLAKE2b-256 of the
 * kernel's boot id and the device and inode of path/data.mdb, so that two processes, in
 * containers or not, holding the same id read and write the same LMDB file (the same kernel, the
 * same file, however the path is spelled or mounted), and two of different ids do not (LMDB is
 * never shared across hosts: network filesystems are refused). Returns 0 with *out; KVM_ENOTFOUND
 * when path/data.mdb does not stat, KVM_EIO when the boot id is unreadable (no id: not compared). */
int kvm_store_place_id(const char *path, kvm_store_id *out);
/* Opens the store at (*s)'s path again with the options of its first open, except that it must
 * exist (nothing is created), and, once that works, closes *s and sets *s to the new handle. On
 * failure *s is left as it was, still usable, and the error (the open's status) names the path
 * and why. Not while another thread uses *s. */
int kvm_store_reopen(kvm_store **s);
/* Fills *out. Errors: KVM_ESTATE (used after fork), KVM_EIO / KVM_ECORRUPT (LMDB). */
int kvm_store_stats_get(kvm_store *s, kvm_store_stats *out);

/* ---- caches (store/kvm_store_cache.c) ---- */

/* Stores a whole cache in ONE write transaction: layers[0, m->n_layers) under keys
 * (model, doc, config, layer) and then the manifest; replaces an existing cache of the
 * same key (all its old layers go). Before writing, evicts least recently served caches
 * while the store's cap would be exceeded. Frames are copied; the caller keeps ownership.
 * The key is taken from m->model_id, m->doc_hash, m->config_id; when m->config.size > 0,
 * m->config_id must equal BLAKE2b-256 of m->config. Grows the map on MDB_MAP_FULL.
 * Errors: KVM_EINVAL (bad manifest fields, layer count, frames, config id mismatch),
 * KVM_EFULL (map at map_max_bytes, or the cache alone exceeds the cap; nothing written),
 * KVM_ESTATE (read-only handle, or used after fork), KVM_EIO, KVM_ECORRUPT, KVM_ENOMEM. */
int kvm_store_put_cache(kvm_store *s, const kvm_store_manifest *m, const kvm_store_layer *layers);

/* Reads a whole cache in one read transaction, verifying every checksum, and returns a
 * copy (*out, free with kvm_store_cache_free). Refuses a cache that is not what the caller
 * expects: manifest ids other than the key's, another tokenizer (when tokenizer_id is not
 * NULL; NULL skips that check, for inspection tools), another store format version.
 * Records the access time for LRU eviction (at most once per atime_granularity_ms; not on
 * read-only handles; best effort: a failure to record does not fail the get).
 * Errors: KVM_ENOTFOUND (no manifest for key), KVM_ECORRUPT (a checksum or record check
 * failed, or a layer is missing; nothing is returned), KVM_EMISMATCH (manifest for another
 * model/tokenizer/config/format), KVM_ESTATE, KVM_EIO, KVM_ENOMEM. *out is NULL on error. */
int kvm_store_get_cache(kvm_store *s, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id,
                        kvm_store_cache **out);
/* Frees a cache from kvm_store_get_cache; accepts NULL and *c == NULL; sets *c = NULL. */
void kvm_store_cache_free(kvm_store_cache **c);

/* *found = 1 when a verified, compatible manifest exists for key (layers are not read:
 * the orchestrator's "already in the store?" check), else 0. tokenizer_id may be NULL.
 * Errors: KVM_ECORRUPT (manifest corrupt), KVM_EMISMATCH (see get), KVM_ESTATE, KVM_EIO. */
int kvm_store_has_cache(kvm_store *s, const kvm_store_cache_key *key, const kvm_store_id *tokenizer_id,
                        int *found);

/* Removes a cache (manifest, layers, access time) in one write transaction.
 * Errors: KVM_ENOTFOUND (nothing stored under key), KVM_ESTATE (read-only, fork), KVM_EIO. */
int kvm_store_rm_cache(kvm_store *s, const kvm_store_cache_key *key);

/* Visitor of kvm_store_list_caches. m is the manifest (config bytes included) when status
 * is 0, or NULL when the manifest failed its checks (status KVM_ECORRUPT / KVM_EMISMATCH,
 * kvm_errmsg() says why). Both pointers are valid only during the call, which runs inside
 * the store's lock and read txn: it must not call functions on the same handle. Return 0 to
 * go on, anything else stops the listing and is returned by kvm_store_list_caches. */
typedef int (*kvm_store_cache_visit_fn)(const kvm_store_cache_key *key, const kvm_store_manifest *m,
                                        int status, void *arg);
/* Calls fn for every cache manifest (key order), in one read transaction; model_id may be
 * NULL (all models). Errors: fn's nonzero return, KVM_ESTATE, KVM_EIO, KVM_ECORRUPT (the caches
 * db's keys out of order: a damaged B-tree, where a re-seek would visit caches again forever). */
int kvm_store_list_caches(kvm_store *s, const kvm_store_id *model_id, kvm_store_cache_visit_fn fn, void *arg);

/* The config ids under which the store holds a complete cache (its manifest) of doc_hash for
 * model_id, in key order: the first `max` go to configs, *n counts them all. One range of keys
 * (the document's own), so the cost does not grow with the store. Errors as for
 * kvm_store_list_caches. */
int kvm_store_doc_configs(kvm_store *s, const kvm_store_id *model_id, const kvm_store_id *doc_hash,
                          kvm_store_id *configs, int max, int *n);

/* Resolves "MODEL:DOC:CONFIG", each part 1..64 hex digits (a unique prefix of the id), to
 * the one cache it names. Errors: KVM_EINVAL (syntax; or the prefixes match several caches:
 * the message says "ambiguous" and how many), KVM_ENOTFOUND (no cache matches), KVM_ECORRUPT
 * (keys out of order, as for kvm_store_list_caches). */
int kvm_store_find_cache(kvm_store *s, const char *text, kvm_store_cache_key *out);

/* ---- strategies, models, documents (store/kvm_store_meta.c) ---- */

/* Stores a strategy (opaque bytes, copied) under (model_id, name), replacing an old one.
 * Strategies are never evicted. name: 1..KVM_STORE_MAX_NAME bytes, no NUL.
 * Errors: KVM_EINVAL, KVM_EFULL (map max), KVM_ESTATE, KVM_EIO. */
int kvm_store_put_strategy(kvm_store *s, const kvm_store_id *model_id, const char *name, const void *data,
                           size_t size);
/* Reads a strategy, checksum verified, into a malloc'ed copy (*data, caller frees; non-NULL
 * even when *size == 0). Errors: KVM_ENOTFOUND, KVM_ECORRUPT, KVM_EINVAL, KVM_ESTATE,
 * KVM_ENOMEM, KVM_EIO. */
int kvm_store_get_strategy(kvm_store *s, const kvm_store_id *model_id, const char *name, uint8_t **data,
                           size_t *size);
/* Visitor of kvm_store_list_strategies; name is NUL-terminated and valid during the call,
 * which must not call functions on the same handle (it runs inside its lock).
 * size is the strategy's byte count. Return nonzero to stop (and have it returned). */
typedef int (*kvm_store_strategy_visit_fn)(const kvm_store_id *model_id, const char *name, size_t size,
                                           void *arg);
/* Lists strategies (all, or of model_id when not NULL) in key order, one read txn.
 * Errors: fn's return, KVM_ESTATE, KVM_EIO. */
int kvm_store_list_strategies(kvm_store *s, const kvm_store_id *model_id, kvm_store_strategy_visit_fn fn,
                              void *arg);
/* Removes a strategy. Errors: KVM_ENOTFOUND, KVM_EINVAL, KVM_ESTATE, KVM_EIO. */
int kvm_store_rm_strategy(kvm_store *s, const kvm_store_id *model_id, const char *name);

/* Model metadata put (replaces) / get (copied into *out). Strings must be NUL-terminated
 * within their arrays. Errors: KVM_EINVAL, KVM_ENOTFOUND (get), KVM_ECORRUPT (get),
 * KVM_EFULL, KVM_ESTATE, KVM_EIO. */
int kvm_store_put_model(kvm_store *s, const kvm_store_id *model_id, const kvm_store_model_meta *meta);
int kvm_store_get_model(kvm_store *s, const kvm_store_id *model_id, kvm_store_model_meta *out);
/* Document metadata put / get, as for models. The put also writes the document's entry in
 * the name index (`docnames` db: BLAKE2b-256 of the last '/'-part of meta->source + doc hash),
 * in the same transaction, replacing the entry of the source it replaces. */
int kvm_store_put_doc(kvm_store *s, const kvm_store_id *doc_hash, const kvm_store_doc_meta *meta);
int kvm_store_get_doc(kvm_store *s, const kvm_store_id *doc_hash, kvm_store_doc_meta *out);

/* Bytes of name[0, len) a document's source keeps: all of them up to 255 (source's size less
 * its NUL), else the longest prefix of at most 255 that ends on a UTF-8 character boundary, so
 * a long UTF-8 name (a JSONL id) is stored as valid UTF-8, not cut inside a character.
 * kvm_store_find_docs cuts a name it looks for the same way. */
size_t kvm_store_doc_source_len(const char *name, size_t len);
/* Sets meta->source to name[0, len) cut by kvm_store_doc_source_len, NUL-terminated. */
void kvm_store_doc_set_source(kvm_store_doc_meta *meta, const char *name, size_t len);

/* A document found by name (kvm_store_find_docs). */
typedef struct kvm_store_doc_match {
    kvm_store_id doc_hash;   /* the document */
    kvm_store_doc_meta meta; /* its stored metadata (source: the name it was stored under) */
} kvm_store_doc_match;

/* The documents whose stored source is name[0, len) or, when no stored source is exactly that,
 * those whose source ends in "/" + name (names are the corpus file names or JSONL ids kvmill run
 * stored: a document stored as "x" is found by "x" even when "a/x" is stored too), in one read
 * txn, through the name index:
 * a range lookup of the name's last '/'-part, each candidate checked against its docs record;
 * cost independent of the number of stored documents. The index is not used, and every docs
 * record is read instead (*scanned = 1, for the caller to say so), when it cannot be trusted: a
 * read-only open of a store no writer of this build opened (no `docnames` db), or a store an
 * older build added documents to since (the two dbs' counts differ; this build's next writable
 * open rebuilds the index: kvm_store_open). Corrupt docs records are skipped (verify names them).
 * A source is stored as its first 255 bytes cut at a character (kvm_store_doc_source_len), so a
 * longer name is matched by those, as a longer JSONL id was stored; when they match nothing, by
 * its first 255 bytes as they are (an older kvmill cut a name inside a character).
 * *out: malloc'ed array of *n matches (NULL when none), the caller frees it; scanned may be NULL.
 * Errors: KVM_EINVAL (NULL outputs, len 0, a NUL in the name), KVM_ENOMEM, KVM_ESTATE,
 * KVM_EIO; *out is NULL and *n 0 on error. Thread-safe (the handle's lock). */
int kvm_store_find_docs(kvm_store *s, const char *name, size_t len, kvm_store_doc_match **out, int64_t *n,
                        int *scanned);

/* Model id of a checkpoint file: BLAKE2b-256 of its bytes, remembered in the store per
 * (absolute path, size, mtime, inode), so an unchanged file is hashed once per store; a
 * Hugging Face folder is hashed on every call (kvm_store_hash_file).
 * A read-only handle hashes without remembering. Errors: KVM_EIO (stat/read), KVM_ENOMEM,
 * KVM_ESTATE, KVM_EFULL. */
int kvm_store_model_id(kvm_store *s, const char *path, kvm_store_id *out);

/* ---- claims (store/kvm_store_claim.c): leases on cache keys ---- */

/* Takes the claim on key for owner (1..127 bytes) from host (0..63 bytes) until now +
 * ttl_ms, in one write transaction: *taken = 1 when there was none, it had lapsed
 * (expires <= now), or owner already held it (then it is renewed, since kept); *taken = 0
 * when another owner's live claim holds it, copied into *holder (may be NULL). A stored
 * cache does not stop a claim: callers check for one. Errors: KVM_EINVAL (owner, host,
 * ttl_ms < 1), KVM_ERANGE (ttl_ms above KVM_STORE_CLAIM_MAX_TTL_MS), KVM_ESTATE (read-only, fork), KVM_EFULL, KVM_EIO.
 */
int kvm_store_claim_take(kvm_store *s, const kvm_store_cache_key *key, const char *owner, const char *host,
                         int64_t ttl_ms, int *taken, kvm_store_claim *holder);
/* Sets every claim of owner to expire at now + ttl_ms (one write txn); *n (may be NULL)
 * counts them. Errors: as kvm_store_claim_take. */
int kvm_store_claim_renew(kvm_store *s, const char *owner, int64_t ttl_ms, int64_t *n);
/* Removes every claim of owner (one write txn); *n (may be NULL) counts them. Errors: as
 * kvm_store_claim_take. */
int kvm_store_claim_release(kvm_store *s, const char *owner, int64_t *n);
/* As kvm_store_claim_release, but unless force, removes nothing when one of owner's claims is
 * live at the time of the write txn that would remove them (so a claim taken or renewed while
 * this waited for the write lock counts): then returns KVM_EBUSY with *n_live (may be NULL) > 0
 * and *latest_ms (may be NULL) the latest of their expiries, unix ms. *n (may be NULL) counts
 * the claims removed (0 when refused); *n_live and *latest_ms are 0 when none is live or force.
 * Errors: as kvm_store_claim_take; KVM_EBUSY with *n_live 0 is the store's (reader table). */
int kvm_store_claim_release_lapsed(kvm_store *s, const char *owner, int force, int64_t *n, int64_t *n_live,
                                   int64_t *latest_ms);
/* Reads the claim on key, live or lapsed, into *out. Errors: KVM_ENOTFOUND (none),
 * KVM_ECORRUPT (bad record), KVM_ESTATE, KVM_EIO. */
int kvm_store_claim_get(kvm_store *s, const kvm_store_cache_key *key, kvm_store_claim *out);
/* The longest lease a claim may have, ms (24 h): kvm_store_claim_take and _renew refuse a
 * longer ttl_ms with KVM_ERANGE. A lease only has to outlast the holder's renewal interval (a
 * run renews every quarter of it); a longer one lets a dead or hostile holder keep a document
 * from every other run for that long (a ttl of 2^40 ms was ~34 years). A run whose [run]
 * heartbeat_ms x liveness is longer leases its claims for this long. */
#define KVM_STORE_CLAIM_MAX_TTL_MS 86400000LL
/* KVM_ERANGE, naming the longest lease, when ttl_ms is above KVM_STORE_CLAIM_MAX_TTL_MS (as
 * kvm_store_claim_take and _renew refuse it); else 0. */
int kvm_store_claim_check_ttl(int64_t ttl_ms);
/* Visitor of kvm_store_list_claims: one claim (live or lapsed) on key. Both pointers are valid
 * only during the call, which runs inside the store's lock and read txn: it must not call
 * functions on the same handle. Return 0 to go on; anything else stops the listing and is
 * returned by it. */
typedef int (*kvm_store_claim_visit_fn)(const kvm_store_cache_key *key, const kvm_store_claim *c, void *arg);
/* Calls fn for every claim record (key order) in one read transaction; damaged records are
 * skipped. A read-only handle on a store without a claims db (an older one) visits none.
 * Errors: fn's nonzero return, KVM_ESTATE, KVM_EIO. */
int kvm_store_list_claims(kvm_store *s, kvm_store_claim_visit_fn fn, void *arg);

/* ---- compaction (store/kvm_store_compact.c) ---- */

/* Writes a compacted copy of the store into the directory dst (it must not exist), in one read
 * transaction. The copy is written into a temporary folder beside dst, ".NAME.compact-XXXXXX"
 * (NAME: dst's last part), locked (flock) while it is written, fsynced, and renamed to dst only
 * when complete: a compact killed midway leaves no dst, only that folder, which the next
 * compact to the same dst removes when no compact holds its lock and it holds only data.mdb and
 * lock.mdb (else it is named on stderr and left). The copy is made so writers may go on meanwhile (their later commits
 * are not in the copy): LMDB never shrinks data.mdb, the copy holds only the pages in use (mdb_env_copy2 with
 * MDB_CP_COMPACT). The store itself is left as it is; swapping the copy in is the caller's business (no process may
 * have the store open then). *copy_bytes (may be NULL) gets the copy's data.mdb size. Errors: KVM_EINVAL (dst exists or
 * is empty, lies inside the store's directory (resolved: "..", symbolic links), or its parent is missing, not a folder
 * or not writable), KVM_EIO (cannot create or write dst otherwise, or to sync or rename the copy; a partial copy is
 * removed), KVM_ECORRUPT (damaged pages: the copy walks every page, so nothing is copied and dst is removed),
 * KVM_ESTATE. */
int kvm_store_compact(kvm_store *s, const char *dst, int64_t *copy_bytes);

/* ---- verify (store/kvm_store_verify.c) ---- */

/* Called once per problem found by kvm_store_verify with a one-line explanation (what,
 * which key, which layer), valid during the call. */
typedef void (*kvm_store_report_fn)(const char *problem, void *arg);
/* Checks the whole store in one read transaction: every record's checksum and header in
 * every db; every manifest: fields valid, ids equal to its key, layers [0, n_layers) all
 * present and valid, stored_bytes equal to the layers' frame bytes; no orphan layers (no
 * manifest, or index >= n_layers); access-time bookkeeping consistent; recorded cache
 * bytes equal to the sum of cache values. A snapshot whose B-tree pages are damaged (the
 * check every transaction passes first; a store damaged so is refused by kvm_store_open) is
 * one problem, naming the page, and no record is read. Reports each problem through report
 * (may be NULL) and counts them in *n_problems; *n_records counts records checked.
 * Returns 0 when the check ran (whatever it found); errors: KVM_ESTATE, KVM_EIO. */
int kvm_store_verify(kvm_store *s, kvm_store_report_fn report, void *arg, int64_t *n_records,
                     int64_t *n_problems);

#endif
