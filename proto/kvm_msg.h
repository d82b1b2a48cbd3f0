/* kvm_msg.h: an owned multipart message (the frames of one ZeroMQ message), its one-blob
 * packing for the store (length-prefixed frames, PROTOCOL.md §6), and send/recv over a
 * ZeroMQ socket with zero-copy for large frames. Message contents are interpreted by
 * proto/kvm_proto.h; this layer only moves bytes.
 *
 * Thread-safety: a kvm_msg is not shared; use one from one thread at a time. Free functions
 * of external frames may run on a ZeroMQ I/O thread (see kvm_msg_add_external). */
#ifndef KVM_MSG_H
#define KVM_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvm_frame.h"

/* Most frames kvm_msg_recv and kvm_msg_unpack accept in one message (routing envelope
 * included); a peer sending more gets its message dropped with KVM_EPROTO. */
#define KVM_MSG_MAX_FRAMES 64
/* Frames of at least this many bytes are sent zero-copy (zmq_msg_init_data); smaller ones are
 * copied by ZeroMQ, which is cheaper than a separate allocation for the content. */
#define KVM_MSG_ZEROCOPY_MIN_BYTES 4096
/* Blob format (PROTOCOL.md §6): magic, version, header bytes, alignment of each frame. */
#define KVM_MSG_BLOB_MAGIC "KVMB"
#define KVM_MSG_BLOB_VERSION 1
#define KVM_MSG_BLOB_HEADER_BYTES 16
#define KVM_MSG_BLOB_ALIGN 8

/* kvm_msg_unpack flag: frames point into the blob instead of copies (see kvm_msg_unpack). */
#define KVM_MSG_BORROW 1u

/* Releases an external frame's bytes: called once with the data pointer and the hint given to
 * kvm_msg_add_external. Same signature as ZeroMQ's zmq_free_fn, so it can be handed over. */
typedef void kvm_msg_free_fn(void *data, void *hint);

/* An ordered list of frames; each frame is owned (malloc'ed, a received ZeroMQ part, or
 * external with a free function) or borrowed. Opaque. */
typedef struct kvm_msg kvm_msg;

/* Creates an empty message. Errors: KVM_EINVAL (out NULL), KVM_ENOMEM. */
int kvm_msg_new(kvm_msg **out);

/* Frees the message and every owned frame; accepts NULL and *msg == NULL; sets *msg = NULL. */
void kvm_msg_free(kvm_msg **msg);

/* Number of frames. 0 for NULL. */
size_t kvm_msg_nframes(const kvm_msg *msg);

/* Borrowed view of frame i (data NULL or not when size is 0), valid until the message is
 * freed or sent; {NULL, 0} when i is out of range. Frames the library allocates (copies,
 * encoder output, received parts, kvm_msg_unpack copies) are at least 8-byte aligned; caller
 * frames (add_owned, add_external, borrowed blobs) keep their own alignment. */
kvm_frame kvm_msg_frame(const kvm_msg *msg, size_t i);

/* Appends a malloc'ed copy of data[0, size). data may be NULL when size == 0.
 * Errors: KVM_EINVAL, KVM_ENOMEM. */
int kvm_msg_add_copy(kvm_msg *msg, const void *data, size_t size);

/* Appends *data (from malloc, `size` bytes) and takes ownership: *data is set to NULL, and
 * the bytes are released with free() by the message or by ZeroMQ after a send, also when
 * this call fails. Errors: KVM_EINVAL, KVM_ENOMEM. */
int kvm_msg_add_owned(kvm_msg *msg, void **data, size_t size);

/* Appends a frame over caller memory. free_fn NULL: borrowed; the caller keeps data alive
 * until the message is freed (a send copies borrowed frames). free_fn non-NULL: the message
 * owns it and calls free_fn(data, hint) once when done, possibly on a ZeroMQ I/O thread after
 * a zero-copy send, also when this call fails. Errors: KVM_EINVAL, KVM_ENOMEM. */
int kvm_msg_add_external(kvm_msg *msg, const void *data, size_t size, kvm_msg_free_fn *free_fn, void *hint);

/* Moves the first n frames of msg into a new message *front (a routing envelope, for
 * instance); msg keeps the rest in order. Frame data pointers do not change.
 * Errors: KVM_EINVAL (n > frames), KVM_ENOMEM (msg unchanged). */
int kvm_msg_split(kvm_msg *msg, size_t n, kvm_msg **front);

/* Appends every frame of *back to msg and frees *back (takes ownership; *back = NULL, also
 * on failure, when *back is freed). Errors: KVM_EINVAL, KVM_ENOMEM. */
int kvm_msg_join(kvm_msg *msg, kvm_msg **back);

/* ---- one contiguous blob (the store's value format), PROTOCOL.md §6 ----
 * Layout, all integers little-endian: "KVMB", u16 version = 1, u16 0, u32 n_frames,
 * u32 0, then per frame u64 size, the bytes, zero padding to a multiple of 8. So when the
 * blob starts 8-byte aligned every frame does too. There is no checksum: the store adds its
 * own; unpack checks structure (magic, version, sizes, padding, exact length). */

/* Bytes kvm_msg_pack_into needs for msg. */
size_t kvm_msg_packed_size(const kvm_msg *msg);

/* Writes the blob of msg into dst[0, cap) (an LMDB MDB_RESERVE value, for instance).
 * Errors: KVM_EINVAL (NULL, cap < kvm_msg_packed_size(msg), more than KVM_MSG_MAX_FRAMES
 * frames or none). */
int kvm_msg_pack_into(const kvm_msg *msg, void *dst, size_t cap);

/* Packs msg into a new malloc'ed blob *blob of *size bytes (caller frees).
 * Errors: as kvm_msg_pack_into, KVM_ENOMEM. */
int kvm_msg_pack(const kvm_msg *msg, uint8_t **blob, size_t *size);

/* Parses a blob into a new message *out. flags 0: every frame is a malloc'ed copy.
 * flags KVM_MSG_BORROW: frames point into blob, which must then outlive *out (for LMDB: the
 * read transaction); their alignment is the blob's (8 when the blob is 8-aligned).
 * Errors: KVM_ECORRUPT (bad magic, unknown version, frame count 0 or > KVM_MSG_MAX_FRAMES,
 * a size past the end, non-zero padding or reserved bytes, trailing bytes; the detail names
 * the offset), KVM_EINVAL, KVM_ENOMEM. */
int kvm_msg_unpack(const void *blob, size_t size, unsigned flags, kvm_msg **out);

/* ---- ZeroMQ (libzmq 4.x) ---- */

/* Stops the monitor of `socket` (started by zmq_socket_monitor; none running: nothing to stop)
 * and closes its reading end *mon (a PAIR connected to the monitor's endpoint; NULL: none was
 * made), after reading every event queued there; *mon is NULL after. Why this order: libzmq
 * 4.3 sends each event with a blocking send, from the I/O thread and holding the socket's
 * monitor lock. An event that finds no reader connected, or ~2,000 unread events queued (a
 * long-idle client whose reconnects keep failing), blocks that thread for ever, and with it
 * this stop and zmq_ctx_term: a process hung at exit. A monitor whose reader could not be
 * made is to be stopped at once, with mon NULL, for the same reason. No errors. */
void kvm_msg_monitor_stop(void *socket, void **mon);

/* Sends every frame of *msg as one multipart message and takes ownership of *msg (*msg =
 * NULL, on failure too). Owned frames of >= KVM_MSG_ZEROCOPY_MIN_BYTES go out zero-copy:
 * their buffers pass to ZeroMQ, which frees them when transmitted (so the caller must not
 * keep frame pointers obtained before the call); others are copied. flags: 0 or
 * ZMQ_DONTWAIT (applies to the first frame; the rest follow atomically).
 * Errors: KVM_EINVAL (NULL socket or message, no frames), KVM_EIO with errno set to the
 * ZeroMQ error (EAGAIN: would block, EINTR: interrupted, ETERM: context ended, ...). */
int kvm_msg_send(void *socket, kvm_msg **msg, int flags);

/* Receives one multipart message into a new *out (every part, routing envelope included on
 * ROUTER sockets: split it off with kvm_msg_split). Parts are kept without copying unless
 * ZeroMQ's buffer is not 8-byte aligned. flags: 0 or ZMQ_DONTWAIT.
 * Errors: KVM_EIO with errno set (EAGAIN, EINTR, ETERM, ...), KVM_EPROTO (more than
 * KVM_MSG_MAX_FRAMES parts: the message is drained and dropped), KVM_ENOMEM, KVM_EINVAL. */
int kvm_msg_recv(void *socket, kvm_msg **out, int flags);

/* The "User-Id" ZeroMQ reported for the connection a received message came from: what the
 * ZAP handler returned for the peer (kvmill's: the client's CurveZMQ public key in Z85), or
 * NULL (not received, no ZAP, or an empty user id). The string lives as long as msg, which
 * keeps it through kvm_msg_split (the envelope part does not get it); kvm_msg_join gives the
 * joined message back's when msg has none. */
const char *kvm_msg_user_id(const kvm_msg *msg);

#endif
