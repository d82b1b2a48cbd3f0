/* kvm_proto_encode.c: the one encoder behind every kvm_proto_<type>_encode: checks the struct
 * with the decoder's rules, writes frame 0 with msgpack-c's packer and copies each present
 * tensor into its own frame. */
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"
#include "proto/kvm_proto_internal.h"

/* Expected shape and byte length of tensor ts in s; dtype from s or the single allowed one. */
static int kvm_enc__shape(const kvm_proto__spec *sp, const kvm_proto__tensor *ts, const uint8_t *s, kvm_proto_dtype *dt,
                          int64_t shape[KVM_PROTO_MAX_DIMS], uint64_t *nbytes)
{
    if (ts->dtype_off >= 0) {
        memcpy(dt, s + ts->dtype_off, sizeof *dt);
    } else {
        for (int k = 0; k < KVM_PROTO_N_DTYPES; k++)
            if (ts->dtypes & KVM_PROTO__BIT(k)) *dt = (kvm_proto_dtype)k;
    }
    if ((int)*dt < 0 || (int)*dt >= KVM_PROTO_N_DTYPES || !(ts->dtypes & KVM_PROTO__BIT(*dt)))
        return kvm_proto__fail(KVM_EINVAL, sp->type, "tensor '%s': dtype %s not allowed here", ts->name,
                               kvm_proto_dtype_name(*dt));
    uint64_t b = kvm_proto_dtype_size(*dt);
    for (int k = 0; k < ts->ndim; k++) {
        memcpy(&shape[k], s + ts->dims[k], sizeof shape[k]);
        uint64_t dim = (uint64_t)shape[k];
        if (shape[k] < 0 || (dim && b > KVM_PROTO_MAX_FRAME_BYTES / dim))
            return kvm_proto__fail(KVM_EINVAL, sp->type, "tensor '%s': size exceeds %llu bytes", ts->name,
                                   (unsigned long long)KVM_PROTO_MAX_FRAME_BYTES);
        b *= dim;
    }
    *nbytes = b;
    return 0;
}

/* Every check the decoder makes, on the caller's struct. Returns the decoder's code. */
static int kvm_enc__check(const kvm_proto__spec *sp, const uint8_t *s, unsigned *present)
{
    int rc = kvm_proto__check_values(sp, s);
    if (rc) return rc;
    if (sp->check_fields && (rc = sp->check_fields(s)) != 0) return rc;
    *present = 0;
    for (size_t i = 0; i < sp->n_tensors; i++) {
        const kvm_proto__tensor *ts = &sp->tensors[i];
        kvm_proto_dtype dt;
        int64_t shape[KVM_PROTO_MAX_DIMS];
        uint64_t nbytes;
        const void *p;
        memcpy(&p, s + ts->off, sizeof p);
        if (!p && !ts->required) continue;
        if ((rc = kvm_enc__shape(sp, ts, s, &dt, shape, &nbytes)) != 0) return rc;
        if (!p && nbytes) return kvm_proto__fail(KVM_EINVAL, sp->type, "tensor '%s' is NULL", ts->name);
        *present |= 1u << i;
    }
    if (sp->check_tensors && (rc = sp->check_tensors(s)) != 0) return rc;
    return 0;
}

static int kvm_enc__str(msgpack_packer *pk, const char *p, size_t n)
{
    return msgpack_pack_str(pk, n) | (n ? msgpack_pack_str_body(pk, p, n) : 0);
}

/* Writes one field (key and value); *skip is set when an optional field is absent. */
static int kvm_enc__field(msgpack_packer *pk, msgpack_sbuffer *sb, const kvm_proto__field *f, const uint8_t *s)
{
    const void *m = s + f->off;
    int bad = kvm_enc__str(pk, f->key, strlen(f->key));
    switch (f->kind) {
    case KVM_PF_U64: {
        uint64_t v;
        memcpy(&v, m, sizeof v);
        return bad | msgpack_pack_uint64(pk, v);
    }
    case KVM_PF_I64: {
        int64_t v;
        memcpy(&v, m, sizeof v);
        return bad | msgpack_pack_int64(pk, v);
    }
    case KVM_PF_I32: {
        int32_t v;
        memcpy(&v, m, sizeof v);
        return bad | msgpack_pack_int32(pk, v);
    }
    case KVM_PF_F64: {
        double v;
        memcpy(&v, m, sizeof v);
        return bad | msgpack_pack_double(pk, v);
    }
    case KVM_PF_BOOL:
        return bad | (*(const bool *)m ? msgpack_pack_true(pk) : msgpack_pack_false(pk));
    case KVM_PF_STR: {
        kvm_proto_str v;
        memcpy(&v, m, sizeof v);
        return bad | kvm_enc__str(pk, v.ptr, v.len);
    }
    case KVM_PF_ID32:
    case KVM_PF_ID32_OPT:
        return bad | msgpack_pack_bin(pk, KVM_PROTO_ID_BYTES) | msgpack_pack_bin_body(pk, m, KVM_PROTO_ID_BYTES);
    case KVM_PF_BIN: {
        kvm_proto_bytes v;
        memcpy(&v, m, sizeof v);
        return bad | msgpack_pack_bin(pk, v.len) | (v.len ? msgpack_pack_bin_body(pk, v.ptr, v.len) : 0);
    }
    case KVM_PF_SETTINGS: {
        const uint8_t *p;
        size_t n;
        memcpy(&p, m, sizeof p);
        memcpy(&n, s + f->aux_off, sizeof n);
        return bad | msgpack_sbuffer_write(sb, (const char *)p, n); /* already MessagePack */
    }
    case KVM_PF_NAMES: {
        int64_t n;
        memcpy(&n, s + f->aux_off, sizeof n);
        const kvm_proto_str *names = m;
        bad |= msgpack_pack_array(pk, (size_t)n);
        for (int64_t k = 0; k < n; k++)
            bad |= kvm_enc__str(pk, names[k].ptr, names[k].len);
        return bad;
    }
    default:
        return -1;
    }
}

static int kvm_enc__present_field(const kvm_proto__field *f, const uint8_t *s)
{
    if (f->kind == KVM_PF_ID32_OPT) return *(const bool *)(s + f->aux_off);
    if (f->kind == KVM_PF_BIN) {
        kvm_proto_bytes v;
        memcpy(&v, s + f->off, sizeof v);
        return f->required || v.len > 0;
    }
    if (f->kind != KVM_PF_SETTINGS) return 1;
    const uint8_t *p;
    memcpy(&p, s + f->off, sizeof p);
    return p != NULL;
}

/* Frame 0 into a malloc'ed buffer. */
static int kvm_enc__header(const kvm_proto__spec *sp, const uint8_t *s, unsigned present, char **out, size_t *size)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    size_t n_entries = 2, n_tensors = 0;
    for (size_t i = 0; i < sp->n_fields; i++)
        n_entries += (size_t)kvm_enc__present_field(&sp->fields[i], s);
    for (size_t i = 0; i < sp->n_tensors; i++)
        n_tensors += (present >> i) & 1u;
    if (n_tensors) n_entries++;
    const char *tn = kvm_proto_type_name(sp->type);
    int bad = msgpack_pack_map(&pk, n_entries);
    bad |= kvm_enc__str(&pk, "v", 1) | msgpack_pack_uint32(&pk, KVM_PROTO_VERSION);
    bad |= kvm_enc__str(&pk, "type", 4) | kvm_enc__str(&pk, tn, strlen(tn));
    for (size_t i = 0; i < sp->n_fields; i++)
        if (kvm_enc__present_field(&sp->fields[i], s)) bad |= kvm_enc__field(&pk, &sb, &sp->fields[i], s);
    if (n_tensors) {
        bad |= kvm_enc__str(&pk, "tensors", 7) | msgpack_pack_array(&pk, n_tensors);
        for (size_t i = 0; i < sp->n_tensors; i++) {
            if (!((present >> i) & 1u)) continue;
            const kvm_proto__tensor *ts = &sp->tensors[i];
            kvm_proto_dtype dt = KVM_PROTO_F32;
            int64_t shape[KVM_PROTO_MAX_DIMS];
            uint64_t nbytes;
            kvm_enc__shape(sp, ts, s, &dt, shape, &nbytes); /* checked before */
            const char *dn = kvm_proto_dtype_name(dt);
            bad |= msgpack_pack_map(&pk, 3);
            bad |= kvm_enc__str(&pk, "name", 4) | kvm_enc__str(&pk, ts->name, strlen(ts->name));
            bad |= kvm_enc__str(&pk, "dtype", 5) | kvm_enc__str(&pk, dn, strlen(dn));
            bad |= kvm_enc__str(&pk, "shape", 5) | msgpack_pack_array(&pk, (size_t)ts->ndim);
            for (int k = 0; k < ts->ndim; k++)
                bad |= msgpack_pack_uint64(&pk, (uint64_t)shape[k]);
        }
    }
    if (bad) {
        msgpack_sbuffer_destroy(&sb);
        return kvm_proto__fail(KVM_ENOMEM, sp->type, "encode: out of memory writing the header");
    }
    if (sb.size > KVM_PROTO_MAX_HEADER_BYTES) {
        size_t n = sb.size;
        msgpack_sbuffer_destroy(&sb);
        return kvm_proto__fail(KVM_EINVAL, sp->type, "encode: header of %zu bytes exceeds %u", n,
                               KVM_PROTO_MAX_HEADER_BYTES);
    }
    *size = sb.size;
    *out = msgpack_sbuffer_release(&sb);
    return 0;
}

int kvm_proto__encode(const kvm_proto__spec *sp, const void *in, kvm_msg **out)
{
    if (!out) return kvm_proto__fail(KVM_EINVAL, sp->type, "encode: out is NULL");
    *out = NULL;
    if (!in) return kvm_proto__fail(KVM_EINVAL, sp->type, "encode: input is NULL");
    const uint8_t *s = in;
    unsigned present = 0;
    int rc = kvm_enc__check(sp, s, &present);
    if (rc) {
        char why[1024];
        snprintf(why, sizeof why, "%s", kvm_errmsg());
        return kvm_err(KVM_EINVAL, "encode %s", why);
    }
    kvm_msg *msg = NULL;
    char *hdr = NULL;
    size_t hsize = 0;
    if ((rc = kvm_enc__header(sp, s, present, &hdr, &hsize)) != 0) return rc;
    if ((rc = kvm_msg_new(&msg)) != 0) {
        free(hdr);
        return rc;
    }
    void *h = hdr;
    if ((rc = kvm_msg_add_owned(msg, &h, hsize)) != 0) goto fail;
    for (size_t i = 0; i < sp->n_tensors; i++) {
        if (!((present >> i) & 1u)) continue;
        const kvm_proto__tensor *ts = &sp->tensors[i];
        kvm_proto_dtype dt;
        int64_t shape[KVM_PROTO_MAX_DIMS];
        uint64_t nbytes;
        const void *p;
        memcpy(&p, s + ts->off, sizeof p);
        kvm_enc__shape(sp, ts, s, &dt, shape, &nbytes);
        if ((rc = kvm_msg_add_copy(msg, nbytes ? p : NULL, (size_t)nbytes)) != 0) goto fail;
    }
    *out = msg;
    return 0;
fail:
    kvm_msg_free(&msg);
    return rc;
}
