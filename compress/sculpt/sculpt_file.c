/* sculpt_file.c: writer and validating reader of the "KVMSCULP" compressed-cache file
 * (format in kvm_sculpt_file.h). The whole file is built/read in memory: caches are small. */
#include "compress/sculpt/kvm_sculpt_file.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char MAGIC[8] = {'K', 'V', 'M', 'S', 'C', 'U', 'L', 'P'};

static uint64_t fnv1a(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static int host_is_le(void)
{
    uint16_t x = 1;
    uint8_t b;
    memcpy(&b, &x, 1);
    return b == 1;
}

/* Growing byte buffer. */
typedef struct buf {
    uint8_t *p;
    size_t n, cap;
    int oom;
} buf;

static void put(buf *b, const void *src, size_t n)
{
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) { b->oom = 1; return; }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }

int kvm_sculpt_cache_fwrite(FILE *f, const char *path, const kvm_kvcache *c)
{
    if (!host_is_le()) return kvm_err(KVM_ENOTSUP, "%s: big-endian hosts are not supported", path);
    if (kvm_kvcache_need_f32(c, "the sculpt cache file writer")) return kvm_err(KVM_ENOTSUP, "%s: %s", path, kvm_errmsg());
    const int nh = c->n_layers * c->n_kv_heads, d = c->head_dim;
    for (int i = 0; i < nh; i++) {
        const kvm_kv_head *h = &c->heads[i];
        int32_t last = -1;
        int seen_tok = 0;
        for (int64_t e = 0; e < h->n; e++) {
            if (h->pos[e] == KVM_POS_NONE && !seen_tok) continue;
            if (h->pos[e] < 0 || h->pos[e] <= last || h->pos[e] >= c->next_pos)
                return kvm_err(KVM_EINVAL, "%s: head %d entry %lld: position %d out of order", path, i, (long long)e,
                               h->pos[e]);
            seen_tok = 1;
            last = h->pos[e];
        }
    }
    buf b = {0};
    put(&b, MAGIC, 8);
    put_u32(&b, KVM_SCULPT_FILE_VERSION);
    put_u32(&b, (uint32_t)d);
    put_u32(&b, (uint32_t)c->n_layers);
    put_u32(&b, (uint32_t)c->n_kv_heads);
    put_u32(&b, (uint32_t)c->next_pos);
    put_u32(&b, 0);
    for (int i = 0; i < nh; i++) put_u64(&b, (uint64_t)c->heads[i].n);
    for (int i = 0; i < nh; i++) {
        const kvm_kv_head *h = &c->heads[i];
        if (h->n == 0) continue;
        put(&b, h->k, (size_t)(h->n * d) * 4);
        put(&b, h->v, (size_t)(h->n * d) * 4);
        for (int64_t e = 0; e < h->n; e++) {
            uint8_t kind = h->pos[e] == KVM_POS_NONE;
            put(&b, &kind, 1);
        }
        for (int64_t e = 0; e < h->n; e++) put_u32(&b, h->pos[e] == KVM_POS_NONE ? 0u : (uint32_t)h->pos[e]);
        put(&b, h->bias, (size_t)h->n * 4);
    }
    put_u64(&b, b.oom ? 0 : fnv1a(b.p, b.n));
    if (b.oom) {
        free(b.p);
        return kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    }
    errno = 0;
    const int ok = fwrite(b.p, 1, b.n, f) == b.n && fflush(f) == 0;
    const int e = errno;
    free(b.p);
    if (!ok) return kvm_err(KVM_EIO, "%s: write failed: %s", path, e ? strerror(e) : "stream error");
    return 0;
}

int kvm_sculpt_cache_write(const char *path, const kvm_kvcache *c)
{
    FILE *f;
    int rc = kvm_file_open_output(path, "wb", "cache file", &f); /* a FIFO with no reader: refused, not waited for */
    if (rc) return rc;
    rc = kvm_sculpt_cache_fwrite(f, path, c);
    if (fclose(f) != 0 && !rc) rc = kvm_err(KVM_EIO, "%s: write failed: %s", path, strerror(errno));
    return rc;
}

static uint32_t get_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static int all_finite(const uint8_t *p, size_t n_floats)
{
    for (size_t i = 0; i < n_floats; i++) {
        float x;
        memcpy(&x, p + 4 * i, 4);
        if (!isfinite(x)) return 0;
    }
    return 1;
}

int kvm_sculpt_cache_decode(const char *path, const uint8_t *p, size_t n, kvm_kvcache **out)
{
    *out = NULL;
    if (!host_is_le()) return kvm_err(KVM_ENOTSUP, "%s: big-endian hosts are not supported", path);
    const size_t hdr = 32;
    if (n < hdr + 8 || memcmp(p, MAGIC, 8)) return kvm_err(KVM_EFORMAT, "%s: not a KVMSCULP file (magic)", path);
    uint32_t ver = get_u32(p + 8), d = get_u32(p + 12), nl = get_u32(p + 16), nkv = get_u32(p + 20);
    uint32_t next = get_u32(p + 24);
    if (ver != KVM_SCULPT_FILE_VERSION) return kvm_err(KVM_EFORMAT, "%s: version %u, expected %u", path, ver, KVM_SCULPT_FILE_VERSION);
    if (d < 1 || d > 65536 || nl < 1 || nl > 65536 || nkv < 1 || nkv > 65536 || next > INT32_MAX || get_u32(p + 28))
        return kvm_err(KVM_EFORMAT, "%s: bad shape head_dim=%u layers=%u kv_heads=%u next_pos=%u", path, d, nl, nkv, next);
    uint64_t nh = (uint64_t)nl * nkv;
    if (n - hdr - 8 < nh * 8) return kvm_err(KVM_EFORMAT, "%s: truncated entry counts", path);
    uint64_t per_entry = 8ull * d + 9, need = hdr + nh * 8 + 8;
    for (uint64_t i = 0; i < nh; i++) {
        uint64_t e = get_u64(p + hdr + 8 * i);
        if (e > (uint64_t)n / per_entry) return kvm_err(KVM_EFORMAT, "%s: head %llu: %llu entries exceed the file", path, (unsigned long long)i, (unsigned long long)e);
        need += e * per_entry;
    }
    if (need != n) return kvm_err(KVM_EFORMAT, "%s: size %zu, header implies %llu", path, n, (unsigned long long)need);
    if (fnv1a(p, n - 8) != get_u64(p + n - 8)) return kvm_err(KVM_ECORRUPT, "%s: checksum mismatch", path);
    int rc = kvm_kvcache_new((int)nl, (int)nkv, (int)d, 0, out);
    if (rc) return rc;
    (*out)->next_pos = (int32_t)next;
    const uint8_t *q = p + hdr + nh * 8;
    for (uint64_t i = 0; i < nh; i++) {
        int64_t e = (int64_t)get_u64(p + hdr + 8 * i);
        kvm_kv_head *h = &(*out)->heads[i];
        if ((rc = kvm_kvcache_reserve(h, (int)d, e))) goto fail;
        const uint8_t *k = q, *v = k + (size_t)e * d * 4, *kind = v + (size_t)e * d * 4, *pos = kind + e,
                      *bias = pos + 4 * e;
        if (!all_finite(k, (size_t)e * d * 2) || !all_finite(bias, (size_t)e)) {
            rc = kvm_err(KVM_ECORRUPT, "%s: head %llu: non-finite key, value or bias", path, (unsigned long long)i);
            goto fail;
        }
        int64_t last = -1;
        int seen_tok = 0;
        for (int64_t j = 0; j < e; j++) {
            uint32_t ps = get_u32(pos + 4 * j);
            if (kind[j] > 1 || (kind[j] == 1 && (seen_tok || ps != 0)) ||
                (kind[j] == 0 && ((int64_t)ps <= last || ps >= next))) {
                rc = kvm_err(KVM_ECORRUPT, "%s: head %llu entry %lld: kind %u position %u out of order", path,
                             (unsigned long long)i, (long long)j, kind[j], ps);
                goto fail;
            }
            if (kind[j] == 0) { seen_tok = 1; last = ps; }
            h->pos[j] = kind[j] ? KVM_POS_NONE : (int32_t)ps;
        }
        if (e > 0) {
            memcpy(h->k, k, (size_t)e * d * 4);
            memcpy(h->v, v, (size_t)e * d * 4);
            memcpy(h->bias, bias, (size_t)e * 4);
        }
        h->n = e;
        q = bias + 4 * e;
    }
    return 0;
fail:
    kvm_kvcache_free(out);
    return rc;
}

int kvm_sculpt_cache_read(const char *path, kvm_kvcache **out)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "%s: %s", path, strerror(errno));
    uint8_t *p = NULL;
    long sz = -1;
    if (fseek(f, 0, SEEK_END) == 0) sz = ftell(f);
    int rc = 0;
    if (sz < 0 || fseek(f, 0, SEEK_SET)) rc = kvm_err(KVM_EIO, "%s: cannot size the file", path);
    else if (!(p = malloc(sz > 0 ? (size_t)sz : 1))) rc = kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    else if (fread(p, 1, (size_t)sz, f) != (size_t)sz) rc = kvm_err(KVM_EIO, "%s: read failed", path);
    fclose(f);
    if (!rc) rc = kvm_sculpt_cache_decode(path, p, (size_t)sz, out);
    free(p);
    return rc;
}
