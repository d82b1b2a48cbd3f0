/* kvm_dtype.c: sizes and wire names of tensor element types. */
#include "proto/kvm_dtype.h"

#include <string.h>

#include "common/kvm_error.h"

static const char *const kvm_dtype__names[KVM_PROTO_N_DTYPES] = {"f32", "f16", "bf16", "i32"};

size_t kvm_proto_dtype_size(kvm_proto_dtype dtype)
{
    switch (dtype) {
    case KVM_PROTO_F32:
        return 4;
    case KVM_PROTO_F16:
        return 2;
    case KVM_PROTO_BF16:
        return 2;
    case KVM_PROTO_I32:
        return 4;
    default:
        return 0;
    }
}

const char *kvm_proto_dtype_name(kvm_proto_dtype dtype)
{
    if ((int)dtype < 0 || (int)dtype >= KVM_PROTO_N_DTYPES) return "?";
    return kvm_dtype__names[dtype];
}

int kvm_proto_dtype_parse(const char *name, size_t len, kvm_proto_dtype *out)
{
    for (int i = 0; i < KVM_PROTO_N_DTYPES; i++) {
        if (strlen(kvm_dtype__names[i]) == len && memcmp(kvm_dtype__names[i], name, len) == 0) {
            *out = (kvm_proto_dtype)i;
            return 0;
        }
    }
    return kvm_err(KVM_EPROTO, "unknown dtype (expected f32, f16, bf16 or i32)");
}
