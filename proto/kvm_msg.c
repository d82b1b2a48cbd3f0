/* kvm_msg.c: the owned multipart message container: frames, ownership, split and join. */
#include "proto/kvm_msg_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"

void kvm_msg__part_release(kvm_msg__part *part)
{
    if (part->owned) {
        if (part->free_fn)
            part->free_fn(part->data, part->hint);
        else
            free(part->data);
    }
    memset(part, 0, sizeof *part);
}

int kvm_msg__push(kvm_msg *msg, kvm_msg__part part)
{
    if (msg->n == msg->cap) {
        size_t cap = msg->cap ? 2 * msg->cap : 4;
        kvm_msg__part *p = realloc(msg->parts, cap * sizeof *p);
        if (!p) {
            kvm_msg__part_release(&part);
            return kvm_err(KVM_ENOMEM, "kvm_msg: no memory for %zu frames", cap);
        }
        msg->parts = p;
        msg->cap = cap;
    }
    msg->parts[msg->n++] = part;
    return 0;
}

int kvm_msg_new(kvm_msg **out)
{
    if (!out) return kvm_err(KVM_EINVAL, "kvm_msg_new: out is NULL");
    *out = calloc(1, sizeof **out);
    if (!*out) return kvm_err(KVM_ENOMEM, "kvm_msg_new: out of memory");
    return 0;
}

void kvm_msg_free(kvm_msg **msg)
{
    if (!msg || !*msg) return;
    for (size_t i = 0; i < (*msg)->n; i++)
        kvm_msg__part_release(&(*msg)->parts[i]);
    free((*msg)->parts);
    free((*msg)->user_id);
    free(*msg);
    *msg = NULL;
}

const char *kvm_msg_user_id(const kvm_msg *msg) { return msg ? msg->user_id : NULL; }

size_t kvm_msg_nframes(const kvm_msg *msg) { return msg ? msg->n : 0; }

kvm_frame kvm_msg_frame(const kvm_msg *msg, size_t i)
{
    kvm_frame f = {NULL, 0};
    if (msg && i < msg->n) {
        f.data = msg->parts[i].data;
        f.size = msg->parts[i].size;
    }
    return f;
}

int kvm_msg_add_copy(kvm_msg *msg, const void *data, size_t size)
{
    if (!msg || (!data && size)) return kvm_err(KVM_EINVAL, "kvm_msg_add_copy: NULL argument");
    void *copy = malloc(size ? size : 1);
    if (!copy) return kvm_err(KVM_ENOMEM, "kvm_msg_add_copy: no memory for %zu bytes", size);
    if (size) memcpy(copy, data, size);
    return kvm_msg_add_owned(msg, &copy, size);
}

int kvm_msg_add_owned(kvm_msg *msg, void **data, size_t size)
{
    if (!data) return kvm_err(KVM_EINVAL, "kvm_msg_add_owned: data is NULL");
    kvm_msg__part part = {*data, size, 1, NULL, NULL};
    *data = NULL;
    if (!msg || (!part.data && size)) {
        kvm_msg__part_release(&part);
        return kvm_err(KVM_EINVAL, "kvm_msg_add_owned: NULL argument");
    }
    return kvm_msg__push(msg, part);
}

int kvm_msg_add_external(kvm_msg *msg, const void *data, size_t size, kvm_msg_free_fn *free_fn, void *hint)
{
    kvm_msg__part part = {(uint8_t *)(uintptr_t)data, size, free_fn != NULL, free_fn, hint};
    if (!msg || (!data && size)) {
        kvm_msg__part_release(&part);
        return kvm_err(KVM_EINVAL, "kvm_msg_add_external: NULL argument");
    }
    return kvm_msg__push(msg, part);
}

int kvm_msg_split(kvm_msg *msg, size_t n, kvm_msg **front)
{
    if (!msg || !front || n > msg->n)
        return kvm_err(KVM_EINVAL, "kvm_msg_split: cannot take %zu of %zu frames", n, kvm_msg_nframes(msg));
    kvm_msg *f = calloc(1, sizeof *f);
    if (!f) return kvm_err(KVM_ENOMEM, "kvm_msg_split: out of memory");
    if (n) {
        f->parts = malloc(n * sizeof *f->parts);
        if (!f->parts) {
            free(f);
            return kvm_err(KVM_ENOMEM, "kvm_msg_split: out of memory");
        }
        memcpy(f->parts, msg->parts, n * sizeof *f->parts);
        memmove(msg->parts, msg->parts + n, (msg->n - n) * sizeof *msg->parts);
    }
    f->n = f->cap = n;
    msg->n -= n;
    *front = f;
    return 0;
}

int kvm_msg_join(kvm_msg *msg, kvm_msg **back)
{
    if (!back) return kvm_err(KVM_EINVAL, "kvm_msg_join: back is NULL");
    if (!msg) {
        kvm_msg_free(back);
        return kvm_err(KVM_EINVAL, "kvm_msg_join: msg is NULL");
    }
    kvm_msg *b = *back;
    *back = NULL;
    if (!b) return 0;
    int rc = 0;
    size_t i = 0;
    for (; i < b->n && rc == 0; i++)
        rc = kvm_msg__push(msg, b->parts[i]); /* releases on failure */
    for (; i < b->n; i++)
        kvm_msg__part_release(&b->parts[i]);
    if (!msg->user_id)
        msg->user_id = b->user_id; /* the joined message keeps the payload's User-Id */
    else
        free(b->user_id);
    free(b->parts);
    free(b);
    return rc;
}
