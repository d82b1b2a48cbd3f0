/* kvm_msg_internal.h: the body of kvm_msg, shared by kvm_msg.c, kvm_msg_blob.c and
 * kvm_msg_zmq.c only. Not part of the public API. */
#ifndef KVM_MSG_INTERNAL_H
#define KVM_MSG_INTERNAL_H

#include "proto/kvm_msg.h"

/* One frame and how its bytes are released. */
typedef struct kvm_msg__part {
    uint8_t *data;            /* first byte; may be NULL when size == 0 */
    size_t size;              /* bytes */
    int owned;                /* 1: released by free_fn (or free() when free_fn is NULL) */
    kvm_msg_free_fn *free_fn; /* owned external frame's release function, or NULL */
    void *hint;               /* second argument of free_fn */
} kvm_msg__part;

struct kvm_msg {
    kvm_msg__part *parts; /* [cap], the first n in use */
    size_t n;             /* frames */
    size_t cap;           /* allocated parts */
    char *user_id;        /* ZeroMQ "User-Id" of the connection it came from (kvm_msg_recv), or NULL */
};

/* Appends a part as given (ownership rules of the part's fields). On failure the part is
 * released. Errors: KVM_ENOMEM. */
int kvm_msg__push(kvm_msg *msg, kvm_msg__part part);

/* Releases a part's bytes if owned and clears it. */
void kvm_msg__part_release(kvm_msg__part *part);

#endif
