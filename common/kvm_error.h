/* kvm_error.h: status codes shared by every kvmill module, and the per-thread
 * detail message that says what went wrong and where (file, field, offset).
 * Convention (STYLE.md): 0 is success, negative values are named errors. */
#ifndef KVM_ERROR_H
#define KVM_ERROR_H

#include <stdarg.h>

enum kvm_status {
    KVM_OK = 0,
    KVM_EINVAL = -1,     /* bad argument, option or value */
    KVM_EIO = -2,        /* a system call on a file or socket failed */
    KVM_ENOMEM = -3,     /* allocation failed */
    KVM_EFORMAT = -4,    /* a file is not in the expected format (header, sizes) */
    KVM_EPROTO = -5,     /* a wire message violates proto/PROTOCOL.md */
    KVM_ECORRUPT = -6,   /* stored data failed its checksum or consistency check */
    KVM_ENOTFOUND = -7,  /* a key, file or item does not exist */
    KVM_EDEVICE = -8,    /* a compute device (CUDA) failed or is absent */
    KVM_ERANGE = -9,     /* a value is outside its allowed range */
    KVM_EFULL = -10,     /* a capacity limit (map size, budget) was reached */
    KVM_EMISMATCH = -11, /* data belongs to another model, tokenizer or config */
    KVM_ENOTSUP = -12,   /* a valid request this build does not support */
    KVM_ESTATE = -13,    /* call not valid in the object's current state */
    KVM_EBUSY = -14,     /* a shared resource is taken for now (LMDB's reader table); try again later */
};

/* Short fixed description of a status code ("invalid argument", ...). Never NULL. */
const char *kvm_strerror(int status);

/* 1 when work that failed with `status` may succeed if run again with the same input, maybe on
 * another worker: KVM_EIO (a file or socket), KVM_ENOMEM (memory), KVM_EDEVICE (a device that
 * failed; another worker's may not), KVM_EBUSY (a resource others hold for now). 0 for success
 * and for every other code: bad input, a malformed file or message, stored data that fails its
 * checks, a mismatch, a limit reached, something unsupported or missing: the same input fails
 * the same way, so retrying it only costs time. The stages' default for a job's retryable flag
 * (pipeline/kvm_stage.h). */
int kvm_err_retryable(int status);

/* Records a detail message for the calling thread and returns `status`, so that
 * error paths read `return kvm_err(KVM_EFORMAT, "%s: header field dim = %d", path, dim);`.
 * The message is kept until the next kvm_err on the same thread. Thread-safe. */
int kvm_err(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The calling thread's last detail message, or "" when none was set. Valid until the
 * next kvm_err on this thread. */
const char *kvm_errmsg(void);

/* Clears the calling thread's detail message. */
void kvm_err_clear(void);

#endif
