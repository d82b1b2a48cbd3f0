/* kvm_error.c: status strings and the per-thread detail message. */
#include "common/kvm_error.h"

#include <stdio.h>
#include <string.h>

static _Thread_local char kvm__errbuf[1024];

int kvm_err_retryable(int status)
{
    return status == KVM_EIO || status == KVM_ENOMEM || status == KVM_EDEVICE || status == KVM_EBUSY;
}

const char *kvm_strerror(int status)
{
    switch (status) {
    case KVM_OK: return "success";
    case KVM_EINVAL: return "invalid argument";
    case KVM_EIO: return "input/output error";
    case KVM_ENOMEM: return "out of memory";
    case KVM_EFORMAT: return "bad file format";
    case KVM_EPROTO: return "protocol violation";
    case KVM_ECORRUPT: return "data corrupted";
    case KVM_ENOTFOUND: return "not found";
    case KVM_EDEVICE: return "device error";
    case KVM_ERANGE: return "value out of range";
    case KVM_EFULL: return "capacity exhausted";
    case KVM_EMISMATCH: return "mismatched model, tokenizer or config";
    case KVM_ENOTSUP: return "not supported";
    case KVM_ESTATE: return "invalid state";
    case KVM_EBUSY:
        return "resource busy";
    default: return "unknown error";
    }
}

int kvm_err(int status, const char *fmt, ...)
{
    /* Formats into a scratch buffer first: callers often wrap the previous detail,
     * kvm_err(rc, "%s: %s", path, kvm_errmsg()), whose argument is kvm__errbuf itself. */
    char tmp[sizeof kvm__errbuf];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    memcpy(kvm__errbuf, tmp, sizeof tmp);
    return status;
}

const char *kvm_errmsg(void) { return kvm__errbuf; }

void kvm_err_clear(void) { kvm__errbuf[0] = '\0'; }
