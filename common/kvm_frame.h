/* kvm_frame.h: a borrowed view of one byte frame (a ZeroMQ message part, a stored value
 * part). Shared by proto/ and store/ so that stored caches are the wire bytes. */
#ifndef KVM_FRAME_H
#define KVM_FRAME_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvm_frame {
    const uint8_t *data; /* first byte; may be NULL when size == 0; not owned */
    size_t size;         /* bytes */
} kvm_frame;

#endif
