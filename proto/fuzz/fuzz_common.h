/* fuzz_common.h: shared by the libFuzzer targets proto/fuzz/fuzz_<type>.c. The input bytes
 * become a multipart message: byte 0 gives the frame count (1 + byte % 17, so one more than
 * KVM_PROTO_MAX_FRAMES is reachable), then every frame but the last is a u32 little-endian
 * length (clamped to what is left) and its bytes; the last frame takes the rest.
 * gen_corpus.c writes seeds in this format. */
#ifndef KVM_FUZZ_COMMON_H
#define KVM_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"
#include "proto/kvm_msg.h"
#include "proto/kvm_proto.h"

/* Splits fuzz input into a message of malloc'ed (exact-size, so ASan sees overreads) frames;
 * NULL for empty input. */
static inline kvm_msg *kvm_fuzz_split(const uint8_t *data, size_t size)
{
    if (size == 0) return NULL;
    kvm_msg *m = NULL;
    if (kvm_msg_new(&m) != 0) return NULL;
    size_t n = 1 + data[0] % (KVM_PROTO_MAX_FRAMES + 1), off = 1;
    for (size_t i = 0; i < n; i++) {
        size_t len = size - off;
        if (i + 1 < n) {
            if (size - off >= 4) {
                uint32_t l = (uint32_t)data[off] | (uint32_t)data[off + 1] << 8 | (uint32_t)data[off + 2] << 16 |
                             (uint32_t)data[off + 3] << 24;
                off += 4;
                len = l < size - off ? l : size - off;
            }
        }
        void *copy = malloc(len ? len : 1);
        if (!copy) break;
        if (len) memcpy(copy, data + off, len);
        off += len;
        if (kvm_msg_add_owned(m, &copy, len) != 0) break;
    }
    return m;
}

/* A decoder target: decode; when the message is accepted, re-encoding the decoded struct must
 * succeed (it reads every tensor byte, so an overread shows) and decode again. */
#define KVM_FUZZ_DECODER(T, decode, encode)                                                                            \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);                                                      \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)                                                       \
    {                                                                                                                  \
        kvm_msg *m = kvm_fuzz_split(data, size);                                                                       \
        if (!m) return 0;                                                                                              \
        kvm_proto_type type;                                                                                           \
        (void)kvm_proto_peek(m, &type);                                                                                \
        T out;                                                                                                         \
        if (decode(m, &out) == 0) {                                                                                    \
            kvm_msg *re = NULL;                                                                                        \
            if (encode(&out, &re) != 0) {                                                                              \
                fprintf(stderr, "accepted message does not re-encode: %s\n", kvm_errmsg());                            \
                abort();                                                                                               \
            }                                                                                                          \
            T again;                                                                                                   \
            if (decode(re, &again) != 0) {                                                                             \
                fprintf(stderr, "re-encoded message does not decode: %s\n", kvm_errmsg());                             \
                abort();                                                                                               \
            }                                                                                                          \
            kvm_msg_free(&re);                                                                                         \
        }                                                                                                              \
        kvm_msg_free(&m);                                                                                              \
        return 0;                                                                                                      \
    }

#endif
