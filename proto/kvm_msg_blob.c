/* kvm_msg_blob.c: a multipart message as one contiguous blob of length-prefixed, 8-aligned
 * frames (PROTOCOL.md §6), so the store keeps exactly the bytes it later sends. */
#include "proto/kvm_msg_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"

static size_t kvm_blob__pad(size_t n) { return (KVM_MSG_BLOB_ALIGN - n % KVM_MSG_BLOB_ALIGN) % KVM_MSG_BLOB_ALIGN; }

static void kvm_blob__put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void kvm_blob__put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void kvm_blob__put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t kvm_blob__get(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

size_t kvm_msg_packed_size(const kvm_msg *msg)
{
    size_t n = KVM_MSG_BLOB_HEADER_BYTES;
    for (size_t i = 0; msg && i < msg->n; i++)
        n += 8 + msg->parts[i].size + kvm_blob__pad(msg->parts[i].size);
    return n;
}

int kvm_msg_pack_into(const kvm_msg *msg, void *dst, size_t cap)
{
    if (!msg || !dst) return kvm_err(KVM_EINVAL, "kvm_msg_pack_into: NULL argument");
    if (msg->n == 0 || msg->n > KVM_MSG_MAX_FRAMES)
        return kvm_err(KVM_EINVAL, "kvm_msg_pack_into: %zu frames, expected 1..%d", msg->n, KVM_MSG_MAX_FRAMES);
    size_t need = kvm_msg_packed_size(msg);
    if (cap < need) return kvm_err(KVM_EINVAL, "kvm_msg_pack_into: %zu bytes of room, need %zu", cap, need);
    uint8_t *p = dst;
    memcpy(p, KVM_MSG_BLOB_MAGIC, 4);
    kvm_blob__put_u16(p + 4, KVM_MSG_BLOB_VERSION);
    kvm_blob__put_u16(p + 6, 0);
    kvm_blob__put_u32(p + 8, (uint32_t)msg->n);
    kvm_blob__put_u32(p + 12, 0);
    p += KVM_MSG_BLOB_HEADER_BYTES;
    for (size_t i = 0; i < msg->n; i++) {
        const kvm_msg__part *f = &msg->parts[i];
        kvm_blob__put_u64(p, f->size);
        p += 8;
        if (f->size) memcpy(p, f->data, f->size);
        p += f->size;
        size_t pad = kvm_blob__pad(f->size);
        memset(p, 0, pad);
        p += pad;
    }
    return 0;
}

int kvm_msg_pack(const kvm_msg *msg, uint8_t **blob, size_t *size)
{
    if (!blob || !size) return kvm_err(KVM_EINVAL, "kvm_msg_pack: NULL argument");
    *blob = NULL;
    *size = 0;
    size_t n = kvm_msg_packed_size(msg);
    uint8_t *b = malloc(n);
    if (!b) return kvm_err(KVM_ENOMEM, "kvm_msg_pack: no memory for %zu bytes", n);
    int rc = kvm_msg_pack_into(msg, b, n);
    if (rc) {
        free(b);
        return rc;
    }
    *blob = b;
    *size = n;
    return 0;
}

int kvm_msg_unpack(const void *blob, size_t size, unsigned flags, kvm_msg **out)
{
    if (!out || (!blob && size)) return kvm_err(KVM_EINVAL, "kvm_msg_unpack: NULL argument");
    *out = NULL;
    const uint8_t *b = blob;
    if (size < KVM_MSG_BLOB_HEADER_BYTES)
        return kvm_err(KVM_ECORRUPT, "blob: %zu bytes, shorter than the %d-byte header", size,
                       KVM_MSG_BLOB_HEADER_BYTES);
    if (memcmp(b, KVM_MSG_BLOB_MAGIC, 4) != 0) return kvm_err(KVM_ECORRUPT, "blob: bad magic at offset 0");
    uint64_t version = kvm_blob__get(b + 4, 2);
    if (version != KVM_MSG_BLOB_VERSION)
        return kvm_err(KVM_ECORRUPT, "blob: unsupported version %llu at offset 4 (this build reads %d)",
                       (unsigned long long)version, KVM_MSG_BLOB_VERSION);
    if (kvm_blob__get(b + 6, 2) != 0 || kvm_blob__get(b + 12, 4) != 0)
        return kvm_err(KVM_ECORRUPT, "blob: reserved header bytes are not zero");
    uint64_t n = kvm_blob__get(b + 8, 4);
    if (n == 0 || n > KVM_MSG_MAX_FRAMES)
        return kvm_err(KVM_ECORRUPT, "blob: %llu frames at offset 8, expected 1..%d", (unsigned long long)n,
                       KVM_MSG_MAX_FRAMES);
    kvm_msg *msg = NULL;
    int rc = kvm_msg_new(&msg);
    if (rc) return rc;
    size_t off = KVM_MSG_BLOB_HEADER_BYTES;
    for (uint64_t i = 0; i < n; i++) {
        if (size - off < 8) {
            rc = kvm_err(KVM_ECORRUPT, "blob: frame %llu size field at offset %zu is past the end (%zu bytes)",
                         (unsigned long long)i, off, size);
            goto fail;
        }
        uint64_t fs = kvm_blob__get(b + off, 8);
        off += 8;
        if (fs > size - off || kvm_blob__pad((size_t)fs) > size - off - fs) {
            rc = kvm_err(KVM_ECORRUPT, "blob: frame %llu at offset %zu declares %llu bytes, only %zu remain",
                         (unsigned long long)i, off - 8, (unsigned long long)fs, size - off);
            goto fail;
        }
        const uint8_t *data = b + off;
        size_t pad = kvm_blob__pad((size_t)fs);
        off += (size_t)fs;
        for (size_t k = 0; k < pad; k++) {
            if (b[off + k] != 0) {
                rc = kvm_err(KVM_ECORRUPT, "blob: non-zero padding at offset %zu after frame %llu", off + k,
                             (unsigned long long)i);
                goto fail;
            }
        }
        off += pad;
        rc = (flags & KVM_MSG_BORROW) ? kvm_msg_add_external(msg, fs ? data : NULL, (size_t)fs, NULL, NULL)
                                      : kvm_msg_add_copy(msg, fs ? data : NULL, (size_t)fs);
        if (rc) goto fail;
    }
    if (off != size) {
        rc = kvm_err(KVM_ECORRUPT, "blob: %zu trailing bytes after the last frame (offset %zu)", size - off, off);
        goto fail;
    }
    *out = msg;
    return 0;
fail:
    kvm_msg_free(&msg);
    return rc;
}
