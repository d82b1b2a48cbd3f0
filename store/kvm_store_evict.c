/* kvm_store_evict.c: least-recently-served bookkeeping and the cap on cache bytes.
 * `atime` maps a cache to when it was last served; `lru` holds the same pairs keyed by
 * big-endian time first, so the least recently served cache is the first key of `lru`.
 * A read re-records the time at most once per granularity, so serving stays cheap. */
#include "store/kvm_store_internal.h"

#include <string.h>
#include <time.h>

#include "common/kvm_error.h"

uint64_t kvm_store__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void lru_key(uint64_t ns, const uint8_t *prefix, uint8_t out[KVM_STORE__LRU_KEY_BYTES])
{
    kvm_store__put_be64(out, ns);
    memcpy(out + 8, prefix, KVM_STORE__PREFIX_BYTES);
}

int kvm_store__atime_get(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, uint64_t *ns)
{
    uint8_t prefix[KVM_STORE__PREFIX_BYTES];
    kvm_store__prefix(k, prefix);
    MDB_val key = {sizeof prefix, prefix}, val;
    *ns = 0;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_ATIME], &key, &val);
    if (rc == MDB_NOTFOUND) return 0;
    if (rc) return kvm_store__mdb(s, rc, "access time");
    if (val.mv_size == 8) *ns = kvm_store__get_u64(val.mv_data);
    return 0;
}

int kvm_store__atime_del(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k)
{
    uint64_t old;
    int st = kvm_store__atime_get(s, txn, k, &old);
    if (st) return st;
    uint8_t prefix[KVM_STORE__PREFIX_BYTES], lk[KVM_STORE__LRU_KEY_BYTES];
    kvm_store__prefix(k, prefix);
    lru_key(old, prefix, lk);
    MDB_val key = {sizeof lk, lk};
    int rc = mdb_del(txn, s->dbi[KVM_STORE__DB_LRU], &key, NULL);
    if (rc && rc != MDB_NOTFOUND) return kvm_store__mdb(s, rc, "lru");
    key = (MDB_val){sizeof prefix, prefix};
    rc = mdb_del(txn, s->dbi[KVM_STORE__DB_ATIME], &key, NULL);
    if (rc && rc != MDB_NOTFOUND) return kvm_store__mdb(s, rc, "access time");
    return 0;
}

int kvm_store__atime_set(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *k, uint64_t now_ns)
{
    int st = kvm_store__atime_del(s, txn, k);
    if (st) return st;
    uint8_t prefix[KVM_STORE__PREFIX_BYTES], lk[KVM_STORE__LRU_KEY_BYTES], t[8];
    kvm_store__prefix(k, prefix);
    lru_key(now_ns, prefix, lk);
    kvm_store__put_u64(t, now_ns);
    MDB_val key = {sizeof prefix, prefix}, val = {8, t};
    int rc = mdb_put(txn, s->dbi[KVM_STORE__DB_ATIME], &key, &val, 0);
    if (rc) return kvm_store__mdb(s, rc, "access time");
    key = (MDB_val){sizeof lk, lk};
    val = (MDB_val){0, ""};
    rc = mdb_put(txn, s->dbi[KVM_STORE__DB_LRU], &key, &val, 0);
    return rc ? kvm_store__mdb(s, rc, "lru") : 0;
}

int kvm_store__oldest_served(kvm_store *s, MDB_txn *txn, uint64_t *ns)
{
    MDB_cursor *cur;
    MDB_val key, val;
    *ns = 0;
    int rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_LRU], &cur);
    if (rc) return kvm_store__mdb(s, rc, "lru cursor");
    rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST);
    mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND) return 0;
    if (rc) return kvm_store__mdb(s, rc, "lru");
    if (key.mv_size == KVM_STORE__LRU_KEY_BYTES)
        for (int i = 0; i < 8; i++)
            *ns = *ns << 8 | ((const uint8_t *)key.mv_data)[i]; /* big-endian: lru_key */
    return 0;
}

/* Removes the least recently served cache; *none = 1 when there is none. */
static int evict_one(kvm_store *s, MDB_txn *txn, int *none)
{
    MDB_cursor *cur;
    MDB_val key, val;
    *none = 0;
    int rc = mdb_cursor_open(txn, s->dbi[KVM_STORE__DB_LRU], &cur);
    if (rc) return kvm_store__mdb(s, rc, "lru cursor");
    rc = mdb_cursor_get(cur, &key, &val, MDB_FIRST);
    kvm_store_cache_key victim;
    if (rc == 0 && key.mv_size == KVM_STORE__LRU_KEY_BYTES) kvm_store__prefix_decode((uint8_t *)key.mv_data + 8, &victim);
    if (rc == 0) rc = mdb_cursor_del(cur, 0); /* drop this entry even if stale */
    mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND) {
        *none = 1;
        return 0;
    }
    if (rc) return kvm_store__mdb(s, rc, "lru");
    if (key.mv_size != KVM_STORE__LRU_KEY_BYTES) return 0;
    int64_t freed, n_keys, n_evicted;
    int st = kvm_store__cache_delete(s, txn, &victim, &freed, &n_keys);
    if (st == 0 && n_keys) st = kvm_store__meta_get(s, txn, "n_evicted", &n_evicted);
    if (st == 0 && n_keys) st = kvm_store__meta_set(s, txn, "n_evicted", n_evicted + 1);
    return st;
}

int kvm_store__evict_for(kvm_store *s, MDB_txn *txn, const kvm_store_cache_key *keep, int64_t need)
{
    (void)keep; /* put removed the old version of `keep` first, so it is not in `lru` */
    int64_t cap, bytes;
    int st = kvm_store__meta_get(s, txn, "cap_bytes", &cap);
    if (st || cap <= 0) return st;
    if (need > cap)
        return kvm_err(KVM_EFULL, "store %s: a cache of %lld bytes exceeds the cap of %lld bytes; not stored", s->path,
                       (long long)need, (long long)cap);
    for (;;) {
        st = kvm_store__meta_get(s, txn, "cache_bytes", &bytes);
        if (st || bytes + need <= cap) return st;
        int none;
        st = evict_one(s, txn, &none);
        if (st) return st;
        if (none) return 0; /* bookkeeping says more than exists: verify reports it */
    }
}

typedef struct touch_arg {
    const kvm_store_cache_key *k; /* cache served */
    uint64_t now_ns;              /* when */
} touch_arg;

static int touch_fn(kvm_store *s, MDB_txn *txn, void *arg)
{
    const touch_arg *a = arg;
    uint8_t kb[KVM_STORE__CACHE_KEY_BYTES];
    kvm_store__cache_key(a->k, KVM_STORE__MANIFEST, kb);
    MDB_val key = {sizeof kb, kb}, val;
    int rc = mdb_get(txn, s->dbi[KVM_STORE__DB_CACHES], &key, &val);
    if (rc == MDB_NOTFOUND) return 0; /* removed since it was read */
    if (rc) return kvm_store__mdb(s, rc, "touch");
    return kvm_store__atime_set(s, txn, a->k, a->now_ns);
}

void kvm_store__touch(kvm_store *s, const kvm_store_cache_key *k, uint64_t recorded_ns)
{
    if (s->read_only) return;
    touch_arg a = {k, kvm_store__now_ns()};
    if (s->atime_granularity_ns >= 0 && recorded_ns != 0 &&
        a.now_ns < recorded_ns + (uint64_t)s->atime_granularity_ns)
        return;
    kvm_store__write(s, touch_fn, &a); /* best effort: LRU order is a hint */
}
