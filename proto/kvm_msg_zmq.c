/* kvm_msg_zmq.c: sends and receives a kvm_msg as one ZeroMQ multipart message. Large owned
 * frames leave zero-copy (zmq_msg_init_data hands the buffer to ZeroMQ, which frees it after
 * transmission); received parts stay in their zmq_msg_t until the kvm_msg is freed. */
#include "proto/kvm_msg_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/kvm_error.h"

/* ZeroMQ free function for malloc'ed frame buffers. */
static void kvm_zmq__free(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* kvm_msg free function of a received part: closes and frees its zmq_msg_t. */
static void kvm_zmq__close(void *data, void *hint)
{
    (void)data;
    zmq_msg_close(hint);
    free(hint);
}

/* Maps a ZeroMQ failure to KVM_EIO, keeping errno = the ZeroMQ error for the caller. */
static int kvm_zmq__fail(const char *what, size_t part)
{
    int e = zmq_errno();
    int rc = kvm_err(KVM_EIO, "%s frame %zu: %s", what, part, zmq_strerror(e));
    errno = e;
    return rc;
}

/* Sends one part; on a zero-copy handover the part's buffer is given to ZeroMQ. Parts after
 * the first retry on EINTR so that a signal never leaves a multipart message half sent. */
static int kvm_zmq__send_part(void *socket, kvm_msg__part *p, int flags, int retry)
{
    if (p->owned && p->size >= KVM_MSG_ZEROCOPY_MIN_BYTES) {
        zmq_msg_t zm;
        zmq_free_fn *ffn = p->free_fn ? p->free_fn : kvm_zmq__free;
        if (zmq_msg_init_data(&zm, p->data, p->size, ffn, p->hint) != 0) return -1;
        memset(p, 0, sizeof *p); /* ZeroMQ owns the buffer now, sent or not */
        int rc;
        do {
            rc = zmq_msg_send(&zm, socket, flags);
        } while (rc < 0 && retry && zmq_errno() == EINTR);
        int e = zmq_errno();
        zmq_msg_close(&zm); /* drops our reference; frees at once if the send failed */
        errno = e;
        return rc < 0 ? -1 : 0;
    }
    int rc;
    do {
        rc = zmq_send(socket, p->data, p->size, flags);
    } while (rc < 0 && retry && zmq_errno() == EINTR);
    return rc < 0 ? -1 : 0;
}

void kvm_msg_monitor_stop(void *socket, void **mon)
{
    if (mon && *mon) { /* a full pipe's blocked send wakes once about half of it is read: read it all */
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        while (zmq_msg_recv(&ev, *mon, ZMQ_DONTWAIT) >= 0) {
        }
        zmq_msg_close(&ev);
    }
    if (socket) zmq_socket_monitor(socket, NULL, 0);
    if (mon && *mon) zmq_close(*mon);
    if (mon) *mon = NULL;
}

int kvm_msg_send(void *socket, kvm_msg **msg, int flags)
{
    if (!msg) return kvm_err(KVM_EINVAL, "kvm_msg_send: msg is NULL");
    kvm_msg *m = *msg;
    *msg = NULL;
    int rc = 0;
    if (!socket || !m || m->n == 0) {
        rc = kvm_err(KVM_EINVAL, "kvm_msg_send: NULL socket or empty message");
        goto done;
    }
    for (size_t i = 0; i < m->n; i++) {
        /* only the first part may fail with EAGAIN; later ones are queued atomically */
        int f = (i == 0 ? flags : (flags & ~ZMQ_DONTWAIT)) | (i + 1 < m->n ? ZMQ_SNDMORE : 0);
        if (kvm_zmq__send_part(socket, &m->parts[i], f, i > 0) != 0) {
            rc = kvm_zmq__fail("kvm_msg_send", i);
            goto done;
        }
    }
done:;
    int e = errno;
    kvm_msg_free(&m);
    errno = e;
    return rc;
}

/* Receives one part into msg; *more tells whether another part follows. */
static int kvm_zmq__recv_part(void *socket, kvm_msg *msg, int flags, int *more)
{
    zmq_msg_t *zm = malloc(sizeof *zm);
    if (!zm) return kvm_err(KVM_ENOMEM, "kvm_msg_recv: out of memory");
    zmq_msg_init(zm);
    int rc;
    do {
        rc = zmq_msg_recv(zm, socket, flags);
    } while (rc < 0 && zmq_errno() == EINTR && msg->n > 0); /* never leave a message half read */
    if (rc < 0) {
        int e = zmq_errno();
        zmq_msg_close(zm);
        free(zm);
        errno = e;
        return kvm_zmq__fail("kvm_msg_recv", msg->n);
    }
    *more = zmq_msg_more(zm);
    if (!msg->user_id) {
        const char *uid = zmq_msg_gets(zm, "User-Id");
        if (uid && *uid && !(msg->user_id = strdup(uid))) {
            zmq_msg_close(zm);
            free(zm);
            return kvm_err(KVM_ENOMEM, "kvm_msg_recv: out of memory");
        }
    }
    void *data = zmq_msg_data(zm);
    size_t size = zmq_msg_size(zm);
    if (size && ((uintptr_t)data % KVM_MSG_BLOB_ALIGN) != 0) { /* keep the alignment promise */
        rc = kvm_msg_add_copy(msg, data, size);
        zmq_msg_close(zm);
        free(zm);
        return rc;
    }
    return kvm_msg_add_external(msg, size ? data : NULL, size, kvm_zmq__close, zm);
}

/* Reads and drops the remaining parts of a multipart message. */
static void kvm_zmq__drain(void *socket)
{
    int more = 1;
    while (more) {
        zmq_msg_t zm;
        zmq_msg_init(&zm);
        if (zmq_msg_recv(&zm, socket, 0) < 0 && zmq_errno() != EINTR)
            more = 0;
        else if (!zmq_msg_more(&zm))
            more = 0;
        zmq_msg_close(&zm);
    }
}

int kvm_msg_recv(void *socket, kvm_msg **out, int flags)
{
    if (!out) return kvm_err(KVM_EINVAL, "kvm_msg_recv: out is NULL");
    *out = NULL;
    if (!socket) return kvm_err(KVM_EINVAL, "kvm_msg_recv: socket is NULL");
    kvm_msg *m = NULL;
    int rc = kvm_msg_new(&m);
    if (rc) return rc;
    int more = 1;
    while (more) {
        if (m->n == KVM_MSG_MAX_FRAMES) {
            kvm_zmq__drain(socket);
            rc = kvm_err(KVM_EPROTO, "kvm_msg_recv: message has more than %d frames; dropped", KVM_MSG_MAX_FRAMES);
            goto fail;
        }
        rc = kvm_zmq__recv_part(socket, m, m->n == 0 ? flags : 0, &more);
        if (rc) {
            if (m->n > 0 && more) kvm_zmq__drain(socket);
            goto fail;
        }
    }
    *out = m;
    return 0;
fail:;
    int e = errno;
    kvm_msg_free(&m);
    errno = e;
    return rc;
}
