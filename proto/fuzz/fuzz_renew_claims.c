/* fuzz_renew_claims.c: libFuzzer target for kvm_proto_renew_claims_decode (and kvm_proto_peek): arbitrary bytes
 * split into frames (fuzz_common.h); accepted messages must re-encode and decode again. */
#include "proto/fuzz/fuzz_common.h"

KVM_FUZZ_DECODER(kvm_proto_renew_claims, kvm_proto_renew_claims_decode, kvm_proto_renew_claims_encode)
