/* check_proto.c: the wire protocol (proto/): f16/bf16 conversion, a round trip of every
 * message type (every dtype, ragged and empty KV heads), every class of malformed message
 * rejected with its error, forward compatibility, the kvm_msg container, blob pack/unpack and
 * corrupted blobs, and real ZeroMQ round trips over inproc:// and ipc://. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/kvm_error.h"
#include "proto/kvm_half.h"
#include "proto/kvm_msg.h"
#include "proto/kvm_proto.h"
#include "tests/util/kvm_test.h"

/* ---------------------------------------------------------------- fixtures */

static float *ramp_f32(size_t n, float base)
{
    float *a = malloc((n ? n : 1) * sizeof *a);
    ck_assert_ptr_nonnull(a);
    for (size_t i = 0; i < n; i++)
        a[i] = base + 0.25f * (float)i - 0.001f * (float)(i * i % 97);
    return a;
}

static int32_t *ramp_i32(size_t n, int32_t base)
{
    int32_t *a = malloc((n ? n : 1) * sizeof *a);
    ck_assert_ptr_nonnull(a);
    for (size_t i = 0; i < n; i++)
        a[i] = base + (int32_t)i;
    return a;
}

/* A kv message of one layer with owned buffers. */
typedef struct kv_fix {
    kvm_proto_kv kv;
    float *buf[6];
} kv_fix;

static void kv_fix_init(kv_fix *f, int64_t n_tokens, int with_queries)
{
    memset(f, 0, sizeof *f);
    kvm_proto_kv *k = &f->kv;
    k->job_id = 77;
    k->layer = 2;
    k->n_layers = 4;
    k->n_tokens = n_tokens;
    k->n_heads = 4;
    k->n_kv_heads = 2;
    k->head_dim = 8;
    k->q_start = n_tokens - 2;
    k->n_queries = 2;
    size_t kvn = (size_t)(k->n_kv_heads * k->n_tokens * k->head_dim);
    size_t qn = (size_t)(k->n_heads * k->n_queries * k->head_dim);
    size_t sn = (size_t)(k->n_heads * k->n_tokens);
    k->keys = f->buf[0] = ramp_f32(kvn, 1.0f);
    k->values = f->buf[1] = ramp_f32(kvn, -3.0f);
    if (with_queries) {
        k->q_pre = f->buf[2] = ramp_f32(qn, 0.5f);
        k->q_post = f->buf[3] = ramp_f32(qn, 0.75f);
    }
    k->entropy = f->buf[4] = ramp_f32(sn, 2.0f);
    k->attn_mass = f->buf[5] = ramp_f32(sn, 0.125f);
}

static void kv_fix_deinit(kv_fix *f)
{
    for (int i = 0; i < 6; i++)
        free(f->buf[i]);
    memset(f, 0, sizeof *f);
}

static kvm_msg *encode_kv(kv_fix *f)
{
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_kv_encode(&f->kv, &m) == 0, "%s", kvm_errmsg());
    return m;
}

/* A ragged cache layer: head entry counts `counts` (n_kv_heads of them), dtype dt. */
typedef struct cache_fix {
    kvm_proto_cache c;
    int32_t counts[8];
    void *keys, *values;
    int32_t *positions;
    float *bias;
} cache_fix;

static void cache_fix_init(cache_fix *f, kvm_proto_dtype dt, const int32_t *counts, int n_kv_heads)
{
    memset(f, 0, sizeof *f);
    kvm_proto_cache *c = &f->c;
    c->layer = 1;
    c->n_layers = 3;
    c->n_kv_heads = n_kv_heads;
    c->head_dim = 4;
    c->n_tokens = 10;
    c->dtype = dt;
    for (int h = 0; h < n_kv_heads; h++) {
        f->counts[h] = counts[h];
        c->n_entries += counts[h];
    }
    size_t n = (size_t)(c->n_entries * c->head_dim), es = kvm_proto_dtype_size(dt);
    float *kf = ramp_f32(n, 0.5f), *vf = ramp_f32(n, -0.5f);
    f->keys = malloc(n * es + 1);
    f->values = malloc(n * es + 1);
    ck_assert_int_eq(kvm_half_convert(f->keys, dt, kf, KVM_PROTO_F32, n), 0);
    ck_assert_int_eq(kvm_half_convert(f->values, dt, vf, KVM_PROTO_F32, n), 0);
    free(kf);
    free(vf);
    f->positions = ramp_i32((size_t)c->n_entries, 0);
    for (int64_t i = 0; i < c->n_entries; i++)
        f->positions[i] = (i % 3 == 2) ? -1 : (int32_t)(i % c->n_tokens);
    f->bias = ramp_f32((size_t)c->n_entries, -1.0f);
    c->head_entries = f->counts;
    c->keys = f->keys;
    c->values = f->values;
    c->positions = f->positions;
    c->logit_bias = f->bias;
}

static void cache_fix_deinit(cache_fix *f)
{
    free(f->keys);
    free(f->values);
    free(f->positions);
    free(f->bias);
    memset(f, 0, sizeof *f);
}

static void assert_str_eq(kvm_proto_str s, const char *want)
{
    ck_assert_msg(kvm_proto_str_eq(s, want), "string '%.*s' != '%s'", (int)s.len, s.ptr ? s.ptr : "", want);
}

static void assert_bytes_eq(const void *a, const void *b, size_t n, const char *what)
{
    ck_assert_msg(n == 0 || (a && b && memcmp(a, b, n) == 0), "%s differs", what);
}

/* ---------------------------------------------------------------- message surgery */

typedef void (*pack_fn)(msgpack_packer *pk, const void *arg);
static void pk_str(msgpack_packer *pk, const void *a)
{
    msgpack_pack_str(pk, strlen(a));
    msgpack_pack_str_body(pk, a, strlen(a));
}
static void pk_u64(msgpack_packer *pk, const void *a) { msgpack_pack_uint64(pk, *(const uint64_t *)a); }
static void pk_i64(msgpack_packer *pk, const void *a) { msgpack_pack_int64(pk, *(const int64_t *)a); }
static void pk_nil(msgpack_packer *pk, const void *a)
{
    (void)a;
    msgpack_pack_nil(pk);
}
static void pk_f64(msgpack_packer *pk, const void *a) { msgpack_pack_double(pk, *(const double *)a); }
static void pk_bin(msgpack_packer *pk, const void *a)
{
    msgpack_pack_bin(pk, 5);
    msgpack_pack_bin_body(pk, a, 5);
}

/* A bin of 31 or 33 bytes (one short of or one past a 32-byte id): arg points to the length. */
static void pk_bin_n(msgpack_packer *pk, const void *a)
{
    static const uint8_t zeros[64];
    const size_t n = *(const size_t *)a;
    msgpack_pack_bin(pk, n);
    msgpack_pack_bin_body(pk, zeros, n);
}

/* Copy of frames [from, n) of src appended to dst. */
static void copy_frames(kvm_msg *dst, const kvm_msg *src, size_t from)
{
    for (size_t i = from; i < kvm_msg_nframes(src); i++) {
        kvm_frame f = kvm_msg_frame(src, i);
        ck_assert_int_eq(kvm_msg_add_copy(dst, f.data, f.size), 0);
    }
}

/* A copy of src whose header has `key` replaced by fn(arg) (added when absent; removed when
 * fn is NULL). Tensor frames are copied as they are. */
static kvm_msg *with_field(const kvm_msg *src, const char *key, pack_fn fn, const void *arg)
{
    kvm_frame f0 = kvm_msg_frame(src, 0);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    ck_assert_int_eq(msgpack_unpack_next(&up, (const char *)f0.data, f0.size, &off), MSGPACK_UNPACK_SUCCESS);
    ck_assert_int_eq(up.data.type, MSGPACK_OBJECT_MAP);
    msgpack_object_map *m = &up.data.via.map;
    int found = 0;
    for (uint32_t i = 0; i < m->size; i++)
        if (m->ptr[i].key.type == MSGPACK_OBJECT_STR && m->ptr[i].key.via.str.size == strlen(key) &&
            memcmp(m->ptr[i].key.via.str.ptr, key, strlen(key)) == 0)
            found = 1;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, m->size - (found && !fn) + (!found && fn));
    for (uint32_t i = 0; i < m->size; i++) {
        int is_key = m->ptr[i].key.type == MSGPACK_OBJECT_STR && m->ptr[i].key.via.str.size == strlen(key) &&
                     memcmp(m->ptr[i].key.via.str.ptr, key, strlen(key)) == 0;
        if (is_key && !fn) continue;
        msgpack_pack_object(&pk, m->ptr[i].key);
        if (is_key)
            fn(&pk, arg);
        else
            msgpack_pack_object(&pk, m->ptr[i].val);
    }
    if (!found && fn) {
        pk_str(&pk, key);
        fn(&pk, arg);
    }
    kvm_msg *out = NULL;
    ck_assert_int_eq(kvm_msg_new(&out), 0);
    ck_assert_int_eq(kvm_msg_add_copy(out, sb.data, sb.size), 0);
    copy_frames(out, src, 1);
    msgpack_sbuffer_destroy(&sb);
    msgpack_unpacked_destroy(&up);
    return out;
}

/* A copy of src with frame `drop` left out (-1: none), frame `shrink` one byte shorter (-1:
 * none) and `extra` empty frames appended. */
static kvm_msg *reframe(const kvm_msg *src, int drop, int shrink, int extra)
{
    kvm_msg *out = NULL;
    ck_assert_int_eq(kvm_msg_new(&out), 0);
    for (size_t i = 0; i < kvm_msg_nframes(src); i++) {
        if ((int)i == drop) continue;
        kvm_frame f = kvm_msg_frame(src, i);
        ck_assert_int_eq(kvm_msg_add_copy(out, f.data, f.size - ((int)i == shrink && f.size ? 1 : 0)), 0);
    }
    for (int i = 0; i < extra; i++)
        ck_assert_int_eq(kvm_msg_add_copy(out, "", 0), 0);
    return out;
}

/* A message whose frame 0 is the given bytes and nothing else. */
static kvm_msg *raw_header(const void *data, size_t n)
{
    kvm_msg *out = NULL;
    ck_assert_int_eq(kvm_msg_new(&out), 0);
    ck_assert_int_eq(kvm_msg_add_copy(out, data, n), 0);
    return out;
}

#define ASSERT_FAILS(expr, code, needle)                                                                               \
    do {                                                                                                               \
        int rc__ = (expr);                                                                                             \
        ck_assert_msg(rc__ == (code), "%s returned %d (%s), want %d; detail: %s", #expr, rc__, kvm_strerror(rc__),     \
                      (code), kvm_errmsg());                                                                           \
        ck_assert_msg(strstr(kvm_errmsg(), (needle)) != NULL, "detail '%s' lacks '%s'", kvm_errmsg(), (needle));       \
    } while (0)

/* ---------------------------------------------------------------- f16 / bf16 */

START_TEST(test_half_f16)
{
    ck_assert_uint_eq(kvm_half_f32_to_f16(1.0f), 0x3c00);
    ck_assert_uint_eq(kvm_half_f32_to_f16(-2.0f), 0xc000);
    ck_assert_uint_eq(kvm_half_f32_to_f16(0.0f), 0x0000);
    ck_assert_uint_eq(kvm_half_f32_to_f16(-0.0f), 0x8000);
    ck_assert_uint_eq(kvm_half_f32_to_f16(65504.0f), 0x7bff);
    ck_assert_uint_eq(kvm_half_f32_to_f16(65519.99f), 0x7bff);
    ck_assert_uint_eq(kvm_half_f32_to_f16(65520.0f), 0x7c00); /* tie to even: inf */
    ck_assert_uint_eq(kvm_half_f32_to_f16(INFINITY), 0x7c00);
    ck_assert_uint_eq(kvm_half_f32_to_f16(-INFINITY), 0xfc00);
    ck_assert_uint_eq(kvm_half_f32_to_f16(ldexpf(1.0f, -24)), 0x0001); /* smallest subnormal */
    ck_assert_uint_eq(kvm_half_f32_to_f16(ldexpf(1.0f, -25)), 0x0000); /* tie to even: 0 */
    ck_assert_uint_eq(kvm_half_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);
    ck_assert_uint_eq(kvm_half_f32_to_f16(ldexpf(3.0f, -25)), 0x0002);        /* 1.5 ulp: tie to even 2 */
    ck_assert_uint_eq(kvm_half_f32_to_f16(ldexpf(1.0f, -14)), 0x0400);        /* smallest normal */
    ck_assert_uint_eq(kvm_half_f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00); /* tie: even */
    ck_assert_uint_eq(kvm_half_f32_to_f16(1.0f + ldexpf(3.0f, -11)), 0x3c02); /* tie: even up */
    ck_assert_uint_eq(kvm_half_f32_to_f16(1.0f + ldexpf(1.0f, -11) + ldexpf(1.0f, -20)), 0x3c01);
    uint16_t qn = kvm_half_f32_to_f16(NAN);
    ck_assert(isnan(kvm_half_f16_to_f32(qn)));
    /* every f16 value converts to f32 and back exactly (NaN stays NaN) */
    for (uint32_t h = 0; h < 65536; h++) {
        float x = kvm_half_f16_to_f32((uint16_t)h);
        uint16_t back = kvm_half_f32_to_f16(x);
        if (((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff))
            ck_assert_msg(isnan(x) && ((back & 0x7c00) == 0x7c00) && (back & 0x3ff), "nan %x", h);
        else
            ck_assert_msg(back == h, "f16 %04x -> %a -> %04x", h, x, back);
    }
    /* f32 -> f16 picks the nearest f16 (ties to even), checked on a spread of f32 values */
    uint32_t u = 12345;
    for (int i = 0; i < 200000; i++) {
        u = u * 1664525u + 1013904223u;
        uint32_t bits = (u & 0x807fffffu) | ((uint32_t)(100 + (u >> 8) % 45) << 23); /* |x| in [2^-27, 2^17) */
        float x;
        memcpy(&x, &bits, 4);
        uint16_t h = kvm_half_f32_to_f16(x);
        double dx = x, d = fabs(dx - kvm_half_f16_to_f32(h));
        if ((h & 0x7fff) == 0x7c00) {
            ck_assert_msg(fabs(dx) >= 65520.0, "%a overflowed", x);
            continue;
        }
        for (int s = -1; s <= 1; s += 2) {
            uint16_t n = (uint16_t)(h + s);
            if ((h & 0x7fff) == 0 && s < 0) continue;
            if (((n >> 10) & 0x1f) == 0x1f) continue;
            double dn = fabs(dx - kvm_half_f16_to_f32(n));
            ck_assert_msg(d < dn || (d == dn && !(h & 1)), "%a -> %04x, neighbour %04x is nearer", x, h, n);
        }
    }
}
END_TEST

START_TEST(test_half_bf16)
{
    ck_assert_uint_eq(kvm_half_f32_to_bf16(1.0f), 0x3f80);
    ck_assert_uint_eq(kvm_half_f32_to_bf16(-1.0f), 0xbf80);
    float t;
    uint32_t b = 0x3f808000u; /* exactly halfway between 0x3f80 and 0x3f81: even */
    memcpy(&t, &b, 4);
    ck_assert_uint_eq(kvm_half_f32_to_bf16(t), 0x3f80);
    b = 0x3f818000u; /* halfway between 0x3f81 and 0x3f82: even up */
    memcpy(&t, &b, 4);
    ck_assert_uint_eq(kvm_half_f32_to_bf16(t), 0x3f82);
    b = 0x3f808001u;
    memcpy(&t, &b, 4);
    ck_assert_uint_eq(kvm_half_f32_to_bf16(t), 0x3f81);
    ck_assert_uint_eq(kvm_half_f32_to_bf16(FLT_MAX), 0x7f80); /* rounds to inf */
    ck_assert(isnan(kvm_half_bf16_to_f32(kvm_half_f32_to_bf16(NAN))));
    for (uint32_t h = 0; h < 65536; h++) {
        float x = kvm_half_bf16_to_f32((uint16_t)h);
        uint16_t back = kvm_half_f32_to_bf16(x);
        if (isnan(x))
            ck_assert(isnan(kvm_half_bf16_to_f32(back)));
        else
            ck_assert_msg(back == h, "bf16 %04x -> %a -> %04x", h, x, back);
    }
}
END_TEST

START_TEST(test_half_convert)
{
    float src[5] = {1.0f, -0.5f, 3.140625f, 0.0f, 65504.0f}, back[5];
    uint16_t h[5], bh[5];
    ck_assert_int_eq(kvm_half_convert(h, KVM_PROTO_F16, src, KVM_PROTO_F32, 5), 0);
    ck_assert_int_eq(kvm_half_convert(back, KVM_PROTO_F32, h, KVM_PROTO_F16, 5), 0);
    for (int i = 0; i < 5; i++)
        ck_assert_float_eq(back[i], src[i]);
    ck_assert_int_eq(kvm_half_convert(bh, KVM_PROTO_BF16, h, KVM_PROTO_F16, 4), 0);
    ck_assert_int_eq(kvm_half_convert(back, KVM_PROTO_F32, bh, KVM_PROTO_BF16, 4), 0);
    for (int i = 0; i < 4; i++)
        ck_assert_float_eq(back[i], src[i]);
    ck_assert_int_eq(kvm_half_convert(back, KVM_PROTO_F32, src, KVM_PROTO_F32, 5), 0);
    ck_assert_int_eq(memcmp(back, src, sizeof src), 0);
    ck_assert_int_eq(kvm_half_convert(back, KVM_PROTO_I32, src, KVM_PROTO_F32, 5), KVM_EINVAL);
    ck_assert_int_eq(kvm_half_convert(NULL, KVM_PROTO_F16, src, KVM_PROTO_F32, 5), KVM_EINVAL);
    ck_assert_int_eq(kvm_half_convert(NULL, KVM_PROTO_F16, NULL, KVM_PROTO_F32, 0), 0);
}
END_TEST

/* ---------------------------------------------------------------- round trips */

START_TEST(test_roundtrip_job)
{
    int32_t tokens[6] = {1, 306, 4, 0, 32000, 7};
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    pk_str(&pk, "budget");
    msgpack_pack_double(&pk, 0.25);
    pk_str(&pk, "pattern");
    pk_str(&pk, "snapkv");
    pk_str(&pk, "sculpt");
    msgpack_pack_true(&pk);
    kvm_proto_job j = {.job_id = 1ull << 40,
                       .attempt = 3,
                       .doc_id = kvm_proto_str_c("doc-42"),
                       .doc_name = kvm_proto_str_c("corpus/ü.txt"),
                       .n_ctx = 16,
                       .n_tokens = 6,
                       .tokens = tokens,
                       .settings = (const uint8_t *)sb.data,
                       .settings_bytes = sb.size};
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_job_encode(&j, &m) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(kvm_msg_nframes(m), 2);
    kvm_proto_job d;
    ck_assert_msg(kvm_proto_job_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(d.job_id, 1ull << 40);
    ck_assert_int_eq(d.attempt, 3);
    assert_str_eq(d.doc_id, "doc-42");
    assert_str_eq(d.doc_name, "corpus/ü.txt");
    ck_assert_int_eq(d.n_ctx, 16);
    ck_assert_int_eq(d.n_tokens, 6);
    assert_bytes_eq(d.tokens, tokens, sizeof tokens, "tokens");
    ck_assert_uint_eq(d.settings_bytes, sb.size);
    assert_bytes_eq(d.settings, sb.data, sb.size, "settings");
    char *dup = kvm_proto_str_dup(d.doc_id);
    ck_assert_str_eq(dup, "doc-42");
    free(dup);
    kvm_msg_free(&m);
    /* without settings: the field is absent and decodes as NULL */
    j.settings = NULL;
    j.settings_bytes = 0;
    ck_assert_int_eq(kvm_proto_job_encode(&j, &m), 0);
    ck_assert_int_eq(kvm_proto_job_decode(m, &d), 0);
    ck_assert_ptr_null(d.settings);
    ck_assert_uint_eq(d.settings_bytes, 0);
    kvm_msg_free(&m);
    kvm_msg_free(&m); /* NULL-safe twice */
    msgpack_sbuffer_destroy(&sb);
}
END_TEST

START_TEST(test_roundtrip_kv)
{
    for (int wq = 0; wq <= 1; wq++) {
        kv_fix f;
        kv_fix_init(&f, 5, wq);
        kvm_msg *m = encode_kv(&f);
        ck_assert_uint_eq(kvm_msg_nframes(m), wq ? 7u : 5u);
        kvm_proto_kv d;
        ck_assert_msg(kvm_proto_kv_decode(m, &d) == 0, "%s", kvm_errmsg());
        ck_assert_uint_eq(d.job_id, 77);
        ck_assert_int_eq(d.layer, 2);
        ck_assert_int_eq(d.n_layers, 4);
        ck_assert_int_eq(d.n_tokens, 5);
        ck_assert_int_eq(d.n_heads, 4);
        ck_assert_int_eq(d.n_kv_heads, 2);
        ck_assert_int_eq(d.head_dim, 8);
        ck_assert_int_eq(d.q_start, 3);
        ck_assert_int_eq(d.n_queries, 2);
        assert_bytes_eq(d.keys, f.kv.keys, 2 * 5 * 8 * 4, "keys");
        assert_bytes_eq(d.values, f.kv.values, 2 * 5 * 8 * 4, "values");
        assert_bytes_eq(d.entropy, f.kv.entropy, 4 * 5 * 4, "entropy");
        assert_bytes_eq(d.attn_mass, f.kv.attn_mass, 4 * 5 * 4, "attn_mass");
        if (wq) {
            assert_bytes_eq(d.q_pre, f.kv.q_pre, 4 * 2 * 8 * 4, "q_pre");
            assert_bytes_eq(d.q_post, f.kv.q_post, 4 * 2 * 8 * 4, "q_post");
        } else {
            ck_assert_ptr_null(d.q_pre);
            ck_assert_ptr_null(d.q_post);
        }
        kvm_proto_type t = 0;
        ck_assert_int_eq(kvm_proto_peek(m, &t), 0);
        ck_assert_int_eq(t, KVM_PROTO_KV);
        kvm_msg_free(&m);
        kv_fix_deinit(&f);
    }
}
END_TEST

/* Packs a tensors array of n descriptors (kv without queries: keys, values, entropy, attn_mass). */
typedef struct descs_arg {
    int n;
    const char *name[4], *dtype[4];
    int ndim[4];
    uint64_t shape[4][3];
} descs_arg;

static void pk_descs(msgpack_packer *pk, const void *a)
{
    const descs_arg *d = a;
    msgpack_pack_array(pk, (size_t)d->n);
    for (int j = 0; j < d->n; j++) {
        msgpack_pack_map(pk, 3);
        pk_str(pk, "name");
        pk_str(pk, d->name[j]);
        pk_str(pk, "dtype");
        pk_str(pk, d->dtype[j]);
        pk_str(pk, "shape");
        msgpack_pack_array(pk, (size_t)d->ndim[j]);
        for (int i = 0; i < d->ndim[j]; i++)
            msgpack_pack_uint64(pk, d->shape[j][i]);
    }
}

/* Revision 4: keys, values and queries in f16 / bf16 ([run] wire_dtype) round-trip bit for
 * bit at half the bytes; statistics stay f32; mixed key/value dtypes are refused. */
START_TEST(test_roundtrip_kv_wire_dtype)
{
    const kvm_proto_dtype dts[2] = {KVM_PROTO_F16, KVM_PROTO_BF16};
    for (int k = 0; k < 2; k++) {
        kv_fix f;
        kv_fix_init(&f, 5, 1);
        const size_t kvn = 2 * 5 * 8, qn = 4 * 2 * 8;
        uint16_t hk[80], hv[80], hq[64], hp[64];
        ck_assert_int_eq(kvm_half_convert(hk, dts[k], f.kv.keys, KVM_PROTO_F32, kvn), 0);
        ck_assert_int_eq(kvm_half_convert(hv, dts[k], f.kv.values, KVM_PROTO_F32, kvn), 0);
        ck_assert_int_eq(kvm_half_convert(hq, dts[k], f.kv.q_pre, KVM_PROTO_F32, qn), 0);
        ck_assert_int_eq(kvm_half_convert(hp, dts[k], f.kv.q_post, KVM_PROTO_F32, qn), 0);
        kvm_proto_kv h = f.kv;
        h.dtype = dts[k], h.keys = hk, h.values = hv, h.q_pre = hq, h.q_post = hp;
        kvm_msg *m = NULL;
        ck_assert_msg(kvm_proto_kv_encode(&h, &m) == 0, "%s", kvm_errmsg());
        ck_assert_uint_eq(kvm_msg_frame(m, 1).size, kvn * 2);
        ck_assert_uint_eq(kvm_msg_frame(m, 3).size, qn * 2);
        ck_assert_uint_eq(kvm_msg_frame(m, 5).size, 4 * 5 * 4); /* entropy stays f32 */
        kvm_proto_kv d;
        ck_assert_msg(kvm_proto_kv_decode(m, &d) == 0, "%s", kvm_errmsg());
        ck_assert_int_eq(d.dtype, dts[k]);
        assert_bytes_eq(d.keys, hk, kvn * 2, "keys");
        assert_bytes_eq(d.values, hv, kvn * 2, "values");
        assert_bytes_eq(d.q_pre, hq, qn * 2, "q_pre");
        assert_bytes_eq(d.q_post, hp, qn * 2, "q_post");
        assert_bytes_eq(d.entropy, f.kv.entropy, 4 * 5 * 4, "entropy");
        float back[80];
        ck_assert_int_eq(kvm_half_convert(back, KVM_PROTO_F32, d.keys, d.dtype, kvn), 0);
        const float rel = k == 0 ? 0x1p-11f : 0x1p-8f; /* half an ulp: round to nearest */
        for (size_t i = 0; i < kvn; i++) {
            float x = ((const float *)f.kv.keys)[i];
            ck_assert_msg(fabsf(back[i] - x) <= rel * fabsf(x), "key %zu: %g on the wire, %g sent", i, back[i], x);
        }
        kvm_msg_free(&m);
        /* keys f16, values f32 (a frame of the right f32 length): refused, naming the tensor */
        kvm_proto_kv nq = f.kv;
        nq.q_pre = nq.q_post = NULL;
        kvm_msg *m32 = NULL, *m16 = NULL;
        ck_assert_int_eq(kvm_proto_kv_encode(&nq, &m32), 0);
        nq.dtype = dts[k], nq.keys = hk, nq.values = hv;
        ck_assert_int_eq(kvm_proto_kv_encode(&nq, &m16), 0);
        descs_arg da = {4, {"keys", "values", "entropy", "attn_mass"}, {kvm_proto_dtype_name(dts[k]), "f32", "f32", "f32"},
                        {3, 3, 2, 2}, {{2, 5, 8}, {2, 5, 8}, {4, 5}, {4, 5}}};
        kvm_msg *hdr = with_field(m32, "tensors", pk_descs, &da);
        kvm_msg *t = raw_header(kvm_msg_frame(hdr, 0).data, kvm_msg_frame(hdr, 0).size);
        ck_assert_int_eq(kvm_msg_add_copy(t, kvm_msg_frame(m16, 1).data, kvm_msg_frame(m16, 1).size), 0);
        for (size_t i = 2; i < 5; i++)
            ck_assert_int_eq(kvm_msg_add_copy(t, kvm_msg_frame(m32, i).data, kvm_msg_frame(m32, i).size), 0);
        char want[128];
        snprintf(want, sizeof want, "tensor 'values': dtype f32 differs from %s", kvm_proto_dtype_name(dts[k]));
        ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, want);
        kvm_msg_free(&t);
        /* a 16-bit keys frame with an f32 length: refused with both lengths */
        da.dtype[1] = kvm_proto_dtype_name(dts[k]);
        kvm_msg_free(&hdr);
        hdr = with_field(m32, "tensors", pk_descs, &da);
        t = raw_header(kvm_msg_frame(hdr, 0).data, kvm_msg_frame(hdr, 0).size);
        for (size_t i = 1; i < 5; i++)
            ck_assert_int_eq(kvm_msg_add_copy(t, kvm_msg_frame(i == 1 ? m16 : m32, i).data, kvm_msg_frame(i == 1 ? m16 : m32, i).size), 0);
        snprintf(want, sizeof want, "tensor 'values': frame 2 has 320 bytes, shape x %s needs 160", kvm_proto_dtype_name(dts[k]));
        ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, want);
        kvm_msg_free(&t);
        kvm_msg_free(&hdr);
        kvm_msg_free(&m16);
        kvm_msg_free(&m32);
        kv_fix_deinit(&f);
    }
}
END_TEST

START_TEST(test_roundtrip_stats_strategy)
{
    float cs[2 * 2 * 3], pd[2 * 2 * 3], en[4], pw[4];
    for (int i = 0; i < 12; i++)
        cs[i] = 0.9f - 0.01f * (float)i, pd[i] = 0.1f * (float)i;
    for (int i = 0; i < 4; i++)
        en[i] = 1.5f + (float)i, pw[i] = 2.0f * (float)i;
    kvm_proto_stats s = {.job_id = 5,
                         .n_layers = 2,
                         .n_phases = 2,
                         .n_patterns = 3,
                         .n_tokens = 512,
                         .n_docs = 8,
                         .budget_tokens = 128,
                         .cos_sim = cs,
                         .ppl_delta = pd,
                         .entropy = en,
                         .ppl_worst = pw};
    s.patterns[0] = kvm_proto_str_c("h2o");
    s.patterns[1] = kvm_proto_str_c("snapkv");
    s.patterns[2] = kvm_proto_str_c("sculpt");
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_stats_encode(&s, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_stats ds;
    ck_assert_msg(kvm_proto_stats_decode(m, &ds) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(ds.n_patterns, 3);
    assert_str_eq(ds.patterns[1], "snapkv");
    ck_assert_int_eq(ds.n_docs, 8);
    ck_assert_int_eq(ds.budget_tokens, 128);
    assert_bytes_eq(ds.cos_sim, cs, sizeof cs, "cos_sim");
    assert_bytes_eq(ds.ppl_delta, pd, sizeof pd, "ppl_delta");
    assert_bytes_eq(ds.entropy, en, sizeof en, "entropy");
    assert_bytes_eq(ds.ppl_worst, pw, sizeof pw, "ppl_worst");
    kvm_msg_free(&m);

    int32_t pat[4] = {0, 1, 2, 0}, bud[4] = {64, 128, 256, 32}, hb[4 * 2] = {60, 68, 100, 156, 0, 512, 32, 32};
    kvm_proto_strategy st = {.name = kvm_proto_str_c("polykv-b128"),
                             .n_layers = 2,
                             .n_phases = 2,
                             .n_kv_heads = 2,
                             .n_ctx = 4096,
                             .budget_min = 16,
                             .n_patterns = 3,
                             .pattern = pat,
                             .budget = bud};
    memcpy(st.patterns, s.patterns, sizeof s.patterns);
    for (int with_heads = 0; with_heads <= 1; with_heads++) {
        st.head_budget = with_heads ? hb : NULL;
        ck_assert_msg(kvm_proto_strategy_encode(&st, &m) == 0, "%s", kvm_errmsg());
        kvm_proto_strategy d;
        ck_assert_msg(kvm_proto_strategy_decode(m, &d) == 0, "%s", kvm_errmsg());
        assert_str_eq(d.name, "polykv-b128");
        ck_assert_int_eq(d.n_ctx, 4096);
        ck_assert_int_eq(d.budget_min, 16);
        assert_str_eq(d.patterns[2], "sculpt");
        assert_bytes_eq(d.pattern, pat, sizeof pat, "pattern");
        assert_bytes_eq(d.budget, bud, sizeof bud, "budget");
        if (with_heads)
            assert_bytes_eq(d.head_budget, hb, sizeof hb, "head_budget");
        else
            ck_assert_ptr_null(d.head_budget);
        kvm_msg_free(&m);
    }
}
END_TEST

START_TEST(test_roundtrip_cache_dtypes)
{
    const int32_t counts[4] = {3, 0, 5, 1}; /* ragged, one KV head empty */
    const kvm_proto_dtype dts[3] = {KVM_PROTO_F32, KVM_PROTO_F16, KVM_PROTO_BF16};
    for (int k = 0; k < 3; k++) {
        cache_fix f;
        cache_fix_init(&f, dts[k], counts, 4);
        kvm_msg *m = NULL;
        ck_assert_msg(kvm_proto_cache_encode(&f.c, &m) == 0, "%s", kvm_errmsg());
        kvm_proto_cache d;
        ck_assert_msg(kvm_proto_cache_decode(m, &d) == 0, "%s: %s", kvm_proto_dtype_name(dts[k]), kvm_errmsg());
        ck_assert_int_eq(d.dtype, dts[k]);
        ck_assert_int_eq(d.layer, 1);
        ck_assert_int_eq(d.n_layers, 3);
        ck_assert_int_eq(d.n_kv_heads, 4);
        ck_assert_int_eq(d.head_dim, 4);
        ck_assert_int_eq(d.n_tokens, 10);
        ck_assert_int_eq(d.n_entries, 9);
        size_t es = kvm_proto_dtype_size(dts[k]);
        assert_bytes_eq(d.head_entries, counts, sizeof counts, "head_entries");
        assert_bytes_eq(d.keys, f.keys, 9 * 4 * es, "keys");
        assert_bytes_eq(d.values, f.values, 9 * 4 * es, "values");
        assert_bytes_eq(d.positions, f.positions, 9 * 4, "positions");
        assert_bytes_eq(d.logit_bias, f.bias, 9 * 4, "logit_bias");
        ck_assert_int_eq(d.positions[2], -1); /* a distilled entry */
        /* the store's path: pack to one blob, unpack, decode the same */
        uint8_t *blob = NULL;
        size_t n = 0;
        ck_assert_int_eq(kvm_msg_pack(m, &blob, &n), 0);
        ck_assert_uint_eq(n, kvm_msg_packed_size(m));
        kvm_msg *u = NULL;
        ck_assert_int_eq(kvm_msg_unpack(blob, n, KVM_MSG_BORROW, &u), 0);
        kvm_proto_cache d2;
        ck_assert_msg(kvm_proto_cache_decode(u, &d2) == 0, "%s", kvm_errmsg());
        ck_assert_int_eq(d2.dtype, dts[k]);
        assert_bytes_eq(d2.values, f.values, 9 * 4 * es, "values from blob");
        kvm_msg_free(&u);
        free(blob);
        kvm_msg_free(&m);
        cache_fix_deinit(&f);
    }
}
END_TEST

START_TEST(test_roundtrip_cache_empty)
{
    const int32_t counts[2] = {0, 0};
    cache_fix f;
    cache_fix_init(&f, KVM_PROTO_F16, counts, 2);
    ck_assert_int_eq(f.c.n_entries, 0);
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_cache_encode(&f.c, &m) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(kvm_msg_nframes(m), 6);
    ck_assert_uint_eq(kvm_msg_frame(m, 2).size, 0);
    kvm_proto_cache d;
    ck_assert_msg(kvm_proto_cache_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(d.n_entries, 0);
    ck_assert_int_eq(d.head_entries[0], 0);
    ck_assert_int_eq(d.head_entries[1], 0);
    kvm_msg_free(&m);
    /* NULL arrays are fine for zero entries */
    f.c.keys = f.c.values = NULL;
    f.c.positions = NULL;
    f.c.logit_bias = NULL;
    ck_assert_msg(kvm_proto_cache_encode(&f.c, &m) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_proto_cache_decode(m, &d), 0);
    kvm_msg_free(&m);
    cache_fix_deinit(&f);
}
END_TEST

START_TEST(test_roundtrip_result_error)
{
    kvm_proto_result r = {.job_id = 9,
                          .status = 0,
                          .stage = kvm_proto_str_c("compress"),
                          .worker_id = kvm_proto_str_c("w1"),
                          .wait_ms = 1.5,
                          .compute_ms = 20.25,
                          .total_ms = 22.0,
                          .message = kvm_proto_str_c("ok")};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_result_encode(&r, &m), 0);
    kvm_proto_result d;
    ck_assert_msg(kvm_proto_result_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(d.job_id, 9);
    ck_assert_int_eq(d.status, 0);
    assert_str_eq(d.stage, "compress");
    assert_str_eq(d.worker_id, "w1");
    ck_assert_double_eq(d.compute_ms, 20.25);
    ck_assert_double_eq(d.total_ms, 22.0);
    assert_str_eq(d.message, "ok");
    /* a result is not an error */
    ASSERT_FAILS(kvm_proto_error_decode(m, &d), KVM_EPROTO, "expected message type 'error', got 'result'");
    kvm_msg_free(&m);
    kvm_proto_error e = r;
    e.status = KVM_ENOMEM;
    e.retryable = true;
    e.message = kvm_proto_str_c("prefill: out of memory at layer 3");
    ck_assert_int_eq(kvm_proto_error_encode(&e, &m), 0);
    ck_assert_msg(kvm_proto_error_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(d.status, KVM_ENOMEM);
    ck_assert(d.retryable);
    assert_str_eq(d.message, "prefill: out of memory at layer 3");
    kvm_msg_free(&m);
    /* status 0 is not an error; a negative status is not a result */
    ck_assert_int_eq(kvm_proto_error_encode(&r, &m), KVM_EINVAL);
    ck_assert_ptr_null(m);
    ck_assert_int_eq(kvm_proto_result_encode(&e, &m), KVM_EINVAL);
}
END_TEST

START_TEST(test_roundtrip_control)
{
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("prefill-0"),
                       .stage = kvm_proto_str_c("prefill"),
                       .pid = 4242,
                       .device = kvm_proto_str_c("cuda:0"),
                       .job_id = 31};
    kvm_msg *m = NULL;
    kvm_proto_ctl d;
    kvm_proto_type t;
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    ck_assert_int_eq(kvm_proto_peek(m, &t), 0);
    ck_assert_int_eq(t, KVM_PROTO_READY);
    ck_assert_msg(kvm_proto_ready_decode(m, &d) == 0, "%s", kvm_errmsg());
    assert_str_eq(d.worker_id, "prefill-0");
    assert_str_eq(d.stage, "prefill");
    assert_str_eq(d.device, "cuda:0");
    ck_assert_int_eq(d.pid, 4242);
    ck_assert_uint_eq(d.job_id, 0); /* not part of ready */
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_proto_heartbeat_encode(&c, &m), 0);
    ck_assert_int_eq(kvm_proto_peek(m, &t), 0);
    ck_assert_int_eq(t, KVM_PROTO_HEARTBEAT);
    ck_assert_int_eq(kvm_proto_heartbeat_decode(m, &d), 0);
    ck_assert_int_eq(d.pid, 4242);
    ASSERT_FAILS(kvm_proto_ack_decode(m, &d), KVM_EPROTO, "expected message type 'ack'");
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_proto_ack_encode(&c, &m), 0);
    ck_assert_int_eq(kvm_proto_ack_decode(m, &d), 0);
    ck_assert_uint_eq(d.job_id, 31);
    assert_str_eq(d.worker_id, "prefill-0");
    kvm_msg_free(&m);
}
END_TEST

/* Revision 10: ready names the stage's model (model_id, optional bin 32), so that a server or a run
 * can refuse a worker of another model; a ready without it (revision 9) decodes as before, and
 * an id of another length is refused naming the field. */
START_TEST(test_roundtrip_ready_model_id)
{
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("decode-1"), .stage = kvm_proto_str_c("decode"), .pid = 77};
    kvm_msg *m = NULL;
    kvm_proto_ctl d;
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    ck_assert_msg(kvm_proto_ready_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(!d.has_model_id);
    kvm_msg_free(&m);
    c.has_model_id = true;
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        c.model_id[i] = (uint8_t)(0x80 + i);
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    ck_assert_msg(kvm_proto_ready_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(d.has_model_id);
    assert_bytes_eq(d.model_id, c.model_id, KVM_PROTO_ID_BYTES, "model_id");
    assert_str_eq(d.worker_id, "decode-1");
    const size_t bad[2] = {31, 33};
    for (int i = 0; i < 2; i++) {
        kvm_msg *t = with_field(m, "model_id", pk_bin_n, &bad[i]);
        char want[80];
        snprintf(want, sizeof want, "field 'model_id' has %zu bytes, expected 32", bad[i]);
        ASSERT_FAILS(kvm_proto_ready_decode(t, &d), KVM_EPROTO, want);
        kvm_msg_free(&t);
    }
    /* only ready carries it: a heartbeat or ack neither writes nor reads it */
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_proto_heartbeat_encode(&c, &m), 0);
    ck_assert_int_eq(kvm_proto_heartbeat_decode(m, &d), 0);
    ck_assert(!d.has_model_id);
    kvm_msg_free(&m);
}
END_TEST

/* Revision 13: a heartbeat with `stopping` (a stage that stops asks for the end of its work) and
 * an ack with it (the orchestrator's end of that work) round-trip; a heartbeat or ack without the
 * key (revision 12) reads as not stopping, a ready neither writes nor reads it, and a value that
 * is no bool is refused naming the field. */
START_TEST(test_roundtrip_ctl_stopping)
{
    kvm_proto_ctl c = {
        .worker_id = kvm_proto_str_c("decode-1"), .stage = kvm_proto_str_c("decode"), .pid = 77, .stopping = true};
    kvm_msg *m = NULL, *t = NULL;
    kvm_proto_ctl d;
    ck_assert_int_eq(kvm_proto_heartbeat_encode(&c, &m), 0);
    ck_assert_msg(kvm_proto_heartbeat_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(d.stopping);
    t = with_field(m, "stopping", NULL, NULL); /* a revision-12 heartbeat */
    ck_assert_msg(kvm_proto_heartbeat_decode(t, &d) == 0, "%s", kvm_errmsg());
    ck_assert(!d.stopping);
    kvm_msg_free(&t);
    const int64_t one = 1;
    t = with_field(m, "stopping", pk_i64, &one);
    ASSERT_FAILS(kvm_proto_heartbeat_decode(t, &d), KVM_EPROTO, "stopping");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_proto_ack_encode(&c, &m), 0);
    ck_assert_msg(kvm_proto_ack_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(d.stopping);
    ck_assert_uint_eq(d.job_id, 0);
    t = with_field(m, "stopping", NULL, NULL);
    ck_assert_msg(kvm_proto_ack_decode(t, &d) == 0, "%s", kvm_errmsg());
    ck_assert(!d.stopping);
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0); /* only heartbeat and ack carry it */
    ck_assert_msg(kvm_proto_ready_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(!d.stopping);
    kvm_msg_free(&m);
}
END_TEST

/* Revision 15: ready's instance and store_id, ack's revision, heartbeat's probe; absent (a
 * revision-14 peer), each decodes as 0 / none; a store_id of another length is refused naming it. */
START_TEST(test_roundtrip_ctl_revision15)
{
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("decode-1"),
                       .stage = kvm_proto_str_c("decode"),
                       .pid = 77,
                       .instance = 0x123456789abcdef1ULL,
                       .has_store_id = true,
                       .stopping = true,
                       .probe = true,
                       .revision = KVM_PROTO_REVISION};
    memset(c.store_id, 0x5a, sizeof c.store_id);
    kvm_msg *m = NULL, *t = NULL;
    kvm_proto_ctl d;
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    ck_assert_msg(kvm_proto_ready_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(d.instance == c.instance && d.has_store_id && !memcmp(d.store_id, c.store_id, sizeof d.store_id));
    t = with_field(m, "store_id", NULL, NULL);
    ck_assert_msg(kvm_proto_ready_decode(t, &d) == 0 && !d.has_store_id, "%s", kvm_errmsg());
    kvm_msg_free(&t);
    t = with_field(m, "instance", NULL, NULL);
    ck_assert_msg(kvm_proto_ready_decode(t, &d) == 0 && d.instance == 0, "%s", kvm_errmsg());
    kvm_msg_free(&t);
    const int64_t one = 1;
    t = with_field(m, "store_id", pk_i64, &one);
    ASSERT_FAILS(kvm_proto_ready_decode(t, &d), KVM_EPROTO, "store_id");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_proto_heartbeat_encode(&c, &m), 0);
    ck_assert_msg(kvm_proto_heartbeat_decode(m, &d) == 0 && d.probe && d.stopping, "%s", kvm_errmsg());
    t = with_field(m, "probe", NULL, NULL);
    ck_assert_msg(kvm_proto_heartbeat_decode(t, &d) == 0 && !d.probe, "%s", kvm_errmsg());
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_proto_ack_encode(&c, &m), 0);
    ck_assert_msg(kvm_proto_ack_decode(m, &d) == 0 && d.revision == KVM_PROTO_REVISION, "%s", kvm_errmsg());
    t = with_field(m, "revision", NULL, NULL);
    ck_assert_msg(kvm_proto_ack_decode(t, &d) == 0 && d.revision == 0, "%s", kvm_errmsg());
    kvm_msg_free(&t);
    kvm_msg_free(&m);
}
END_TEST

/* Revision 10: a job names its run's model (model_id, optional bin 32), so that a worker that loads
 * the settings' model path can refuse other weights found there; a job without it (revision 9)
 * decodes as before, and an id of another length is refused naming the field. */
START_TEST(test_roundtrip_job_model_id)
{
    int32_t tok[2] = {1, 2};
    kvm_proto_job j = {.job_id = 5, .doc_id = kvm_proto_str_c("d5"), .n_ctx = 4, .n_tokens = 2, .tokens = tok};
    kvm_msg *m = NULL;
    kvm_proto_job d;
    ck_assert_int_eq(kvm_proto_job_encode(&j, &m), 0);
    ck_assert_msg(kvm_proto_job_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(!d.has_model_id);
    kvm_msg_free(&m);
    j.has_model_id = true;
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        j.model_id[i] = (uint8_t)(0xa0 + i);
    ck_assert_int_eq(kvm_proto_job_encode(&j, &m), 0);
    ck_assert_msg(kvm_proto_job_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(d.has_model_id);
    assert_bytes_eq(d.model_id, j.model_id, KVM_PROTO_ID_BYTES, "model_id");
    assert_str_eq(d.doc_id, "d5");
    assert_bytes_eq(d.tokens, tok, sizeof tok, "tokens");
    const size_t bad[2] = {31, 33};
    for (int i = 0; i < 2; i++) {
        kvm_msg *t = with_field(m, "model_id", pk_bin_n, &bad[i]);
        char want[80];
        snprintf(want, sizeof want, "field 'model_id' has %zu bytes, expected 32", bad[i]);
        ASSERT_FAILS(kvm_proto_job_decode(t, &d), KVM_EPROTO, want);
        kvm_msg_free(&t);
    }
    kvm_msg_free(&m);
}
END_TEST

START_TEST(test_roundtrip_serve)
{
    kvm_proto_get_cache g = {.request_id = 12};
    for (int i = 0; i < 32; i++)
        g.model_id[i] = (uint8_t)i, g.doc_hash[i] = (uint8_t)(255 - i), g.config_id[i] = (uint8_t)(i * 7);
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_get_cache_encode(&g, &m), 0);
    kvm_proto_get_cache dg;
    ck_assert_msg(kvm_proto_get_cache_decode(m, &dg) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(memcmp(&dg, &g, sizeof g), 0);
    kvm_msg_free(&m);

    int32_t doc[4] = {1, 2, 3, 4};
    kvm_proto_ask a = {.request_id = 13,
                       .n_doc_tokens = 4,
                       .doc_tokens = doc,
                       .prompt = kvm_proto_str_c("Q: why?"),
                       .max_new_tokens = 32,
                       .temperature = 0.7};
    ck_assert_int_eq(kvm_proto_ask_encode(&a, &m), 0);
    kvm_proto_ask da;
    ck_assert_msg(kvm_proto_ask_decode(m, &da) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(da.n_doc_tokens, 4);
    assert_bytes_eq(da.doc_tokens, doc, sizeof doc, "doc_tokens");
    ck_assert_uint_eq(da.doc_text.len, 0);
    assert_str_eq(da.prompt, "Q: why?");
    ck_assert_int_eq(da.max_new_tokens, 32);
    ck_assert_double_eq(da.temperature, 0.7);
    kvm_msg_free(&m);
    kvm_proto_ask at = {.request_id = 14,
                        .doc_text = kvm_proto_str_c("Once upon a time"),
                        .prompt = kvm_proto_str_c(""),
                        .max_new_tokens = 0};
    ck_assert_int_eq(kvm_proto_ask_encode(&at, &m), 0);
    ck_assert_uint_eq(kvm_msg_nframes(m), 1);
    ck_assert_msg(kvm_proto_ask_decode(m, &da) == 0, "%s", kvm_errmsg());
    assert_str_eq(da.doc_text, "Once upon a time");
    ck_assert_ptr_null(da.doc_tokens);
    kvm_msg_free(&m);
    /* both or neither document form is refused */
    at.doc_tokens = doc;
    at.n_doc_tokens = 4;
    ASSERT_FAILS(kvm_proto_ask_encode(&at, &m), KVM_EINVAL, "several of 'doc_text', 'doc_bytes', 'doc_tokens'");
    at.doc_text = kvm_proto_str_c("");
    at.doc_tokens = NULL;
    at.n_doc_tokens = 0;
    ASSERT_FAILS(kvm_proto_ask_encode(&at, &m), KVM_EINVAL, "none of 'doc_text'");

    int32_t gen[3] = {9, 8, 7};
    kvm_proto_answer an = {.request_id = 13,
                           .status = 0,
                           .text = kvm_proto_str_c(" because."),
                           .n_tokens = 3,
                           .tokens = gen,
                           .load_ms = 1,
                           .prefill_ms = 2,
                           .decode_ms = 3,
                           .total_ms = 6.5};
    ck_assert_int_eq(kvm_proto_answer_encode(&an, &m), 0);
    kvm_proto_answer dn;
    ck_assert_msg(kvm_proto_answer_decode(m, &dn) == 0, "%s", kvm_errmsg());
    assert_str_eq(dn.text, " because.");
    assert_bytes_eq(dn.tokens, gen, sizeof gen, "tokens");
    ck_assert_double_eq(dn.total_ms, 6.5);
    kvm_msg_free(&m);
    kvm_proto_answer bad = {.request_id = 13, .status = KVM_ENOTFOUND, .message = kvm_proto_str_c("no cache")};
    ck_assert_int_eq(kvm_proto_answer_encode(&bad, &m), 0); /* zero tokens: an empty frame */
    ck_assert_uint_eq(kvm_msg_nframes(m), 2);
    ck_assert_int_eq(kvm_proto_answer_decode(m, &dn), 0);
    ck_assert_int_eq(dn.status, KVM_ENOTFOUND);
    ck_assert_int_eq(dn.n_tokens, 0);
    kvm_msg_free(&m);
}
END_TEST

/* Revision 2 of ask and answer: doc_bytes, doc_hash, doc_name, compute_grant, new_cache. */
/* revision 5: get_strategy and a store_reply carrying a strategy; the decoder refuses a bad
 * model id, an empty name, and a strategy in a refusal or beside n_layers. */
START_TEST(test_roundtrip_get_strategy)
{
    kvm_proto_get_strategy g = {.request_id = 31, .name = kvm_proto_str_c("default")};
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        g.model_id[i] = (uint8_t)(i * 5);
    kvm_msg *m = NULL, *t = NULL;
    ck_assert_msg(kvm_proto_get_strategy_encode(&g, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_type ty;
    ck_assert_int_eq(kvm_proto_peek(m, &ty), 0);
    ck_assert_int_eq(ty, KVM_PROTO_GET_STRATEGY);
    ck_assert_str_eq(kvm_proto_type_name(ty), "get_strategy");
    kvm_proto_get_strategy dg;
    ck_assert_msg(kvm_proto_get_strategy_decode(m, &dg) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(dg.request_id, 31);
    ck_assert_int_eq(memcmp(dg.model_id, g.model_id, KVM_PROTO_ID_BYTES), 0);
    ck_assert(kvm_proto_str_eq(dg.name, "default"));
    t = with_field(m, "model_id", pk_bin, "abcde");
    ASSERT_FAILS(kvm_proto_get_strategy_decode(t, &dg), KVM_EPROTO, "field 'model_id' has 5 bytes, expected 32");
    kvm_msg_free(&t);
    t = with_field(m, "name", pk_str, "");
    ck_assert_int_ne(kvm_proto_get_strategy_decode(t, &dg), 0);
    ck_assert_msg(strstr(kvm_errmsg(), "field 'name'"), "%s", kvm_errmsg());
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    g.name = kvm_proto_str_c("");
    ck_assert_int_ne(kvm_proto_get_strategy_encode(&g, &m), 0);
    static const uint8_t rec[] = {1, 2, 3, 0, 255};
    kvm_proto_store_reply r = {.request_id = 31, .strategy = {rec, sizeof rec}}, dr;
    ck_assert_msg(kvm_proto_store_reply_encode(&r, &m) == 0, "%s", kvm_errmsg());
    ck_assert_msg(kvm_proto_store_reply_decode(m, &dr) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(dr.strategy.len, sizeof rec);
    ck_assert_int_eq(memcmp(dr.strategy.ptr, rec, sizeof rec), 0);
    ck_assert_int_eq(dr.n_layers, 0);
    kvm_msg_free(&m);
    r.status = KVM_ENOTFOUND;
    ASSERT_FAILS(kvm_proto_store_reply_encode(&r, &m), KVM_EINVAL, "field 'strategy' has 5 bytes in a refusal");
    r.status = 0, r.n_layers = 2;
    ASSERT_FAILS(kvm_proto_store_reply_encode(&r, &m), KVM_EINVAL, "either a get_cache or a get_strategy");
    r.n_layers = 0;
    ck_assert_int_eq(kvm_proto_store_reply_encode(&r, &m), 0);
    const int64_t refused = KVM_ENOTFOUND;
    t = with_field(m, "status", pk_i64, &refused);
    ASSERT_FAILS(kvm_proto_store_reply_decode(t, &dr), KVM_EPROTO, "field 'strategy' has 5 bytes in a refusal");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
}
END_TEST

/* revision 6: claim and renew_claims, and a store_reply carrying a claim outcome; the decoder
 * refuses an empty owner, a claim without a lease, an unknown outcome, an outcome in a
 * refusal, and a holder (or, revision 12, its expiry) beside any outcome but "held". */
START_TEST(test_roundtrip_claim)
{
    kvm_proto_claim c = {.request_id = 41, .owner = kvm_proto_str_c("run:hostA:42:1000"), .host = kvm_proto_str_c("hostA"),
                         .ttl_ms = 2000};
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        c.model_id[i] = (uint8_t)i, c.doc_hash[i] = (uint8_t)(2 * i), c.config_id[i] = (uint8_t)(3 * i);
    kvm_msg *m = NULL, *t = NULL;
    ck_assert_msg(kvm_proto_claim_encode(&c, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_type ty;
    ck_assert_int_eq(kvm_proto_peek(m, &ty), 0);
    ck_assert_str_eq(kvm_proto_type_name(ty), "claim");
    kvm_proto_claim dc;
    ck_assert_msg(kvm_proto_claim_decode(m, &dc) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(dc.request_id, 41);
    ck_assert_int_eq(dc.ttl_ms, 2000);
    ck_assert(kvm_proto_str_eq(dc.owner, "run:hostA:42:1000") && kvm_proto_str_eq(dc.host, "hostA") && !dc.probe);
    ck_assert_int_eq(memcmp(dc.config_id, c.config_id, KVM_PROTO_ID_BYTES), 0);
    t = with_field(m, "owner", pk_str, "");
    ASSERT_FAILS(kvm_proto_claim_decode(t, &dc), KVM_ERANGE, "field 'owner'");
    kvm_msg_free(&t);
    const int64_t zero = 0;
    t = with_field(m, "ttl_ms", pk_i64, &zero);
    ASSERT_FAILS(kvm_proto_claim_decode(t, &dc), KVM_ERANGE, "field 'ttl_ms' is 0");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    c.ttl_ms = 0, c.probe = true; /* a probe needs no lease */
    ck_assert_msg(kvm_proto_claim_encode(&c, &m) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_proto_claim_decode(m, &dc), 0);
    ck_assert(dc.probe);
    kvm_msg_free(&m);
    kvm_proto_renew_claims rn = {.request_id = 42, .owner = kvm_proto_str_c("run:a"), .release = true}, drn;
    ck_assert_msg(kvm_proto_renew_claims_encode(&rn, &m) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_proto_renew_claims_decode(m, &drn), 0);
    ck_assert(drn.release && drn.request_id == 42);
    kvm_msg_free(&m);
    rn.release = false;
    ASSERT_FAILS(kvm_proto_renew_claims_encode(&rn, &m), KVM_EINVAL, "renewing needs a lease");
    kvm_proto_store_reply r = {.request_id = 41,
                               .claim = kvm_proto_str_c("held"),
                               .holder = kvm_proto_str_c("run:b"),
                               .holder_host = kvm_proto_str_c("hostB"),
                               .holder_expires_ms = 1796000000123},
                          dr;
    ck_assert_msg(kvm_proto_store_reply_encode(&r, &m) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_proto_store_reply_decode(m, &dr), 0);
    ck_assert(kvm_proto_str_eq(dr.claim, "held") && kvm_proto_str_eq(dr.holder, "run:b") &&
              kvm_proto_str_eq(dr.holder_host, "hostB"));
    ck_assert_int_eq(dr.holder_expires_ms, 1796000000123); /* revision 12 */
    const int64_t negative = -5;
    t = with_field(m, "holder_expires_ms", pk_i64, &negative);
    ASSERT_FAILS(kvm_proto_store_reply_decode(t, &dr), KVM_ERANGE, "field 'holder_expires_ms'");
    kvm_msg_free(&t);
    t = with_field(m, "claim", pk_str, "mine");
    ASSERT_FAILS(kvm_proto_store_reply_decode(t, &dr), KVM_EPROTO, "field 'claim' is \"mine\"");
    kvm_msg_free(&t);
    t = with_field(m, "claim", pk_str, "taken");
    ASSERT_FAILS(kvm_proto_store_reply_decode(t, &dr), KVM_EPROTO, "field 'holder' comes with claim \"held\"");
    kvm_msg_free(&t);
    const int64_t refused = KVM_EIO;
    t = with_field(m, "status", pk_i64, &refused);
    ASSERT_FAILS(kvm_proto_store_reply_decode(t, &dr), KVM_EPROTO, "field 'claim' in a refusal");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    r = (kvm_proto_store_reply){.request_id = 41, .claim = kvm_proto_str_c("stored"), .full_bytes = 100, .stored_bytes = 30};
    ck_assert_int_eq(kvm_proto_store_reply_encode(&r, &m), 0);
    ck_assert_int_eq(kvm_proto_store_reply_decode(m, &dr), 0);
    ck_assert(dr.full_bytes == 100 && dr.stored_bytes == 30 && dr.holder.len == 0);
    const int64_t when = 1796000000123; /* an expiry beside any outcome but "held" */
    t = with_field(m, "holder_expires_ms", pk_i64, &when);
    ASSERT_FAILS(kvm_proto_store_reply_decode(t, &dr), KVM_EPROTO,
                 "field 'holder_expires_ms' comes with claim \"held\"");
    kvm_msg_free(&t);
    r.holder_expires_ms = when;
    ASSERT_FAILS(kvm_proto_store_reply_encode(&r, &t), KVM_EINVAL, "'holder_expires_ms'");
    kvm_msg_free(&m);
}
END_TEST

START_TEST(test_roundtrip_serve_revision2)
{
    static const uint8_t bytes[] = {'c', 'a', 'f', 0xe9, 0x00, 0xff, 0x80, '\n'};
    kvm_proto_ask a = {.request_id = 21,
                       .doc_bytes = {bytes, sizeof bytes},
                       .prompt = kvm_proto_str_c("Q"),
                       .max_new_tokens = 3,
                       .compute_grant = true};
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_ask_encode(&a, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_ask d;
    ck_assert_msg(kvm_proto_ask_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(d.doc_bytes.len, sizeof bytes);
    assert_bytes_eq(d.doc_bytes.ptr, bytes, sizeof bytes, "doc_bytes");
    ck_assert_uint_eq(d.doc_text.len, 0);
    ck_assert(!d.has_doc_hash);
    ck_assert(d.compute_grant);
    kvm_msg_free(&m);
    /* by hash */
    kvm_proto_ask h = {.request_id = 22, .has_doc_hash = true, .prompt = kvm_proto_str_c("Q"), .max_new_tokens = 1};
    for (int i = 0; i < KVM_PROTO_ID_BYTES; i++)
        h.doc_hash[i] = (uint8_t)(i * 7);
    ck_assert_msg(kvm_proto_ask_encode(&h, &m) == 0, "%s", kvm_errmsg());
    ck_assert_msg(kvm_proto_ask_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert(d.has_doc_hash);
    assert_bytes_eq(d.doc_hash, h.doc_hash, KVM_PROTO_ID_BYTES, "doc_hash");
    ck_assert(!d.compute_grant);
    /* a doc_hash of another length is refused */
    kvm_msg *t = with_field(m, "doc_hash", pk_bin, "abcde");
    ASSERT_FAILS(kvm_proto_ask_decode(t, &d), KVM_EPROTO, "field 'doc_hash' has 5 bytes, expected 32");
    kvm_msg_free(&t);
    /* two ways at once */
    t = with_field(m, "doc_name", pk_str, "doc_000.txt");
    ASSERT_FAILS(kvm_proto_ask_decode(t, &d), KVM_EPROTO, "several of 'doc_text', 'doc_bytes'");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    /* by name */
    kvm_proto_ask n = {.request_id = 23, .doc_name = kvm_proto_str_c("doc_000.txt"), .prompt = kvm_proto_str_c("Q")};
    ck_assert_msg(kvm_proto_ask_encode(&n, &m) == 0, "%s", kvm_errmsg());
    ck_assert_msg(kvm_proto_ask_decode(m, &d) == 0, "%s", kvm_errmsg());
    assert_str_eq(d.doc_name, "doc_000.txt");
    ck_assert(!d.has_doc_hash);
    ck_assert_uint_eq(kvm_msg_nframes(m), 1);
    kvm_msg_free(&m);
    /* limits */
    n.doc_name = kvm_proto_str_c("");
    n.doc_bytes = (kvm_proto_bytes){bytes, (size_t)KVM_PROTO_MAX_DOC_BYTES + 1};
    ASSERT_FAILS(kvm_proto_ask_encode(&n, &m), KVM_EINVAL, "field 'doc_bytes': 16777217 bytes, allowed 0..16777216");
    n.doc_bytes.len = 0;
    ASSERT_FAILS(kvm_proto_ask_encode(&n, &m), KVM_EINVAL, "none of 'doc_text'");
    /* answers: new_cache, and text that is valid UTF-8 only */
    int32_t ids[2] = {5, 6};
    kvm_proto_answer an = {.request_id = 23, .text = kvm_proto_str_c(" \xef\xbf\xbd"), .n_tokens = 2, .tokens = ids,
                           .new_cache = true};
    ck_assert_msg(kvm_proto_answer_encode(&an, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_answer da;
    ck_assert_msg(kvm_proto_answer_decode(m, &da) == 0, "%s", kvm_errmsg());
    ck_assert(da.new_cache);
    kvm_msg_free(&m);
    an.text = kvm_proto_str_c(" \xe4\xbd");
    ASSERT_FAILS(kvm_proto_answer_encode(&an, &m), KVM_EINVAL, "field 'text': invalid UTF-8");
}
END_TEST

/* 1 when the n bytes at p hold the text t. */
static int frame_holds(const uint8_t *p, size_t n, const char *t)
{
    size_t k = strlen(t);
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(p + i, t, k)) return 1;
    return 0;
}

/* Revision 7 of ask: prompt_bytes, a prompt that is not UTF-8 (kvmill ask refused one that
 * kvmill generate takes): its bytes travel as they are; an ask without it is written as before
 * (no prompt_bytes key), and it has the text limit. */
START_TEST(test_roundtrip_ask_prompt_bytes)
{
    static const uint8_t latin1[] = {'c', 'a', 'f', 0xe9, ' ', 0xff, 0x80};
    kvm_proto_ask a = {.request_id = 31,
                       .doc_name = kvm_proto_str_c("doc_000.txt"),
                       .prompt = kvm_proto_str_c("caf\xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd"),
                       .prompt_bytes = {latin1, sizeof latin1},
                       .max_new_tokens = 2};
    kvm_msg *m = NULL;
    ck_assert_msg(kvm_proto_ask_encode(&a, &m) == 0, "%s", kvm_errmsg());
    kvm_proto_ask d;
    ck_assert_msg(kvm_proto_ask_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(d.prompt_bytes.len, sizeof latin1);
    assert_bytes_eq(d.prompt_bytes.ptr, latin1, sizeof latin1, "prompt_bytes");
    assert_str_eq(d.prompt, "caf\xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd");
    kvm_msg_free(&m);
    a.prompt_bytes.len = 0; /* a UTF-8 prompt: the message of revision 6 */
    ck_assert_msg(kvm_proto_ask_encode(&a, &m) == 0, "%s", kvm_errmsg());
    kvm_frame f0 = kvm_msg_frame(m, 0);
    ck_assert_msg(!frame_holds(f0.data, f0.size, "prompt_bytes"), "an empty prompt_bytes was written");
    ck_assert_msg(kvm_proto_ask_decode(m, &d) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(d.prompt_bytes.len, 0);
    kvm_msg_free(&m);
    a.prompt_bytes = (kvm_proto_bytes){latin1, (size_t)KVM_PROTO_MAX_TEXT_BYTES + 1};
    ASSERT_FAILS(kvm_proto_ask_encode(&a, &m), KVM_EINVAL, "field 'prompt_bytes': 8388609 bytes, allowed 0..8388608");
}
END_TEST

/* A string that declares more bytes than it may have, or than are left: the detail says which,
 * and names the limit. */
START_TEST(test_malformed_long_strings)
{
    /* {"v": 1, "type": str32 of 4 GiB - 1 bytes "ask"} */
    static const uint8_t long_type[] = {0x82, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xdb, 0xff, 0xff, 0xff, 0xff,
                                        'a',  's',  'k'};
    kvm_msg *t = raw_header(long_type, sizeof long_type);
    kvm_proto_type ty;
    kvm_proto_ask d;
    ASSERT_FAILS(kvm_proto_peek(t, &ty), KVM_ERANGE,
                 "header: field 'type' is a str of 4294967295 bytes, too long: the limit is 64 bytes");
    ASSERT_FAILS(kvm_proto_ask_decode(t, &d), KVM_ERANGE, "too long: the limit is 64 bytes");
    kvm_msg_free(&t);
    /* a whole type name of 100 bytes */
    uint8_t hundred[9 + 2 + 100] = {0x82, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xd9, 100};
    memset(hundred + 11, 'x', 100);
    t = raw_header(hundred, sizeof hundred);
    ASSERT_FAILS(kvm_proto_peek(t, &ty), KVM_ERANGE, "field 'type' is a str of 100 bytes, too long: the limit is 64");
    kvm_msg_free(&t);
    /* a short declared type cut off: a truncated header */
    static const uint8_t cut_type[] = {0x82, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa5, 'a', 's'};
    t = raw_header(cut_type, sizeof cut_type);
    ASSERT_FAILS(kvm_proto_peek(t, &ty), KVM_EPROTO,
                 "truncated header: field 'type' is a str of 5 bytes, but only 2 bytes are left");
    kvm_msg_free(&t);
    /* a field: {"v": 1, "type": "ask", "prompt": str32 of 100 MiB "ab"} */
    static const uint8_t long_prompt[] = {0x83, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa3, 'a', 's', 'k',
                                          0xa6, 'p', 'r', 'o', 'm', 'p', 't', 0xdb, 0x06, 0x40, 0x00, 0x00, 'a', 'b'};
    t = raw_header(long_prompt, sizeof long_prompt);
    /* the envelope cannot skip it; the decoder knows the field's limit */
    ASSERT_FAILS(kvm_proto_peek(t, &ty), KVM_EPROTO,
                 "truncated header: field 'prompt' is a str of 104857600 bytes, but only 2 bytes are left");
    ASSERT_FAILS(kvm_proto_ask_decode(t, &d), KVM_ERANGE,
                 "ask: field 'prompt' is a str of 104857600 bytes, too long: the limit is 8388608 bytes");
    kvm_msg_free(&t);
    /* within the field's limit but past the end: truncated */
    uint8_t short_prompt[sizeof long_prompt];
    memcpy(short_prompt, long_prompt, sizeof long_prompt);
    short_prompt[21] = 0x00, short_prompt[22] = 0x00, short_prompt[23] = 0x00, short_prompt[24] = 0x09;
    t = raw_header(short_prompt, sizeof short_prompt);
    ASSERT_FAILS(kvm_proto_ask_decode(t, &d), KVM_EPROTO,
                 "truncated header: field 'prompt' is a str of 9 bytes, but only 2 bytes are left");
    kvm_msg_free(&t);
}
END_TEST

/* ---------------------------------------------------------------- malformed messages */

START_TEST(test_malformed_truncated_header)
{
    kv_fix f;
    kv_fix_init(&f, 5, 1);
    kvm_msg *m = encode_kv(&f);
    kvm_frame f0 = kvm_msg_frame(m, 0);
    kvm_proto_kv d;
    for (size_t cut = 0; cut < f0.size; cut++) {
        kvm_msg *t = raw_header(f0.data, cut);
        copy_frames(t, m, 1);
        int rc = kvm_proto_kv_decode(t, &d);
        ck_assert_msg(rc == KVM_EPROTO, "cut at %zu: rc %d (%s)", cut, rc, kvm_errmsg());
        ck_assert_ptr_null(d.keys); /* zeroed on failure */
        kvm_proto_type ty;
        ck_assert_int_eq(kvm_proto_peek(t, &ty), KVM_EPROTO);
        kvm_msg_free(&t);
    }
    kvm_msg *t = raw_header(f0.data, 0);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "truncated header");
    kvm_msg_free(&t);
    t = raw_header(f0.data, f0.size / 2);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "truncated header");
    kvm_msg_free(&t);
    /* trailing bytes after the map */
    uint8_t buf[4096];
    memcpy(buf, f0.data, f0.size);
    buf[f0.size] = 0xc0;
    t = raw_header(buf, f0.size + 1);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "trailing bytes");
    kvm_msg_free(&t);
    /* no frames at all; frame 0 not a map */
    ck_assert_int_eq(kvm_msg_new(&t), 0);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "no frames");
    kvm_msg_free(&t);
    t = raw_header("\x93\x01\x02\x03", 4);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "expected a MessagePack map");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);
}
END_TEST

START_TEST(test_malformed_wrong_types)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *t;
    kvm_proto_kv d;
    double half = 2.5;
    int64_t neg = -1;
    t = with_field(m, "layer", pk_str, "two");
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "field 'layer' is str, expected int");
    kvm_msg_free(&t);
    t = with_field(m, "n_tokens", pk_f64, &half);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "field 'n_tokens' is float");
    kvm_msg_free(&t);
    t = with_field(m, "job_id", pk_nil, NULL);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "field 'job_id' is nil");
    kvm_msg_free(&t);
    t = with_field(m, "job_id", pk_i64, &neg);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "field 'job_id' = -1 is negative");
    kvm_msg_free(&t);
    t = with_field(m, "tensors", pk_str, "keys");
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "field 'tensors' is str, expected array");
    kvm_msg_free(&t);
    t = with_field(m, "type", pk_u64, &(uint64_t){2});
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "field 'type' is unsigned int, expected str");
    kvm_msg_free(&t);
    t = with_field(m, "v", pk_str, "1");
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "field 'v' is str");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);

    /* string rules: invalid UTF-8, embedded NUL, wrong bin length */
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("w"), .stage = kvm_proto_str_c("prefill"), .pid = 1};
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    kvm_proto_ctl dc;
    t = with_field(m, "stage", pk_str, "pre\xff");
    ASSERT_FAILS(kvm_proto_ready_decode(t, &dc), KVM_EPROTO, "field 'stage': invalid UTF-8");
    kvm_msg_free(&t);
    t = with_field(m, "stage", pk_bin, "abcde");
    ASSERT_FAILS(kvm_proto_ready_decode(t, &dc), KVM_EPROTO, "field 'stage' is bin, expected str");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    c.stage = (kvm_proto_str){"a\0b", 3};
    ASSERT_FAILS(kvm_proto_ready_encode(&c, &m), KVM_EINVAL, "NUL");
    kvm_proto_get_cache g = {.request_id = 1};
    ck_assert_int_eq(kvm_proto_get_cache_encode(&g, &m), 0);
    kvm_proto_get_cache dg;
    t = with_field(m, "doc_hash", pk_bin, "abcde");
    ASSERT_FAILS(kvm_proto_get_cache_decode(t, &dg), KVM_EPROTO, "field 'doc_hash' has 5 bytes, expected 32");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
}
END_TEST

/* Packs one tensors array with a single descriptor. */
typedef struct desc_arg {
    const char *name, *dtype;
    int ndim;
    uint64_t shape[5];
} desc_arg;

static void pk_desc(msgpack_packer *pk, const void *a)
{
    const desc_arg *d = a;
    msgpack_pack_array(pk, 1);
    msgpack_pack_map(pk, 3);
    pk_str(pk, "name");
    pk_str(pk, d->name);
    pk_str(pk, "dtype");
    pk_str(pk, d->dtype);
    pk_str(pk, "shape");
    msgpack_pack_array(pk, (size_t)d->ndim);
    for (int i = 0; i < d->ndim; i++)
        msgpack_pack_uint64(pk, d->shape[i]);
}

START_TEST(test_malformed_huge_sizes)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *t;
    kvm_proto_kv d;
    uint64_t big = 1ull << 40, huge = UINT64_MAX;
    t = with_field(m, "n_tokens", pk_u64, &big);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "field 'n_tokens' = 1099511627776 out of range");
    kvm_msg_free(&t);
    t = with_field(m, "n_tokens", pk_u64, &huge);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "field 'n_tokens'");
    kvm_msg_free(&t);
    uint64_t heads = KVM_PROTO_MAX_HEADS + 1;
    t = with_field(m, "n_kv_heads", pk_u64, &heads);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "field 'n_kv_heads'");
    kvm_msg_free(&t);
    desc_arg da = {"keys", "f32", 3, {1ull << 33, 1ull << 33, 1ull << 33}};
    t = with_field(m, "tensors", pk_desc, &da);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "declared size exceeds");
    kvm_msg_free(&t);
    desc_arg db = {"keys", "f32", 5, {1, 1, 1, 1, 1}};
    t = with_field(m, "tensors", pk_desc, &db);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "5 dimensions, limit 4");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);
    /* a header of 2^31-element containers with no bytes behind them */
    const uint8_t arr[] = {0x82, 0xa1, 'v', 0x01, 0xa4, 't', 'y', 'p', 'e'};
    (void)arr;
    const uint8_t hugemap[] = {0xdf, 0x7f, 0xff, 0xff, 0xff, 0xa1, 'v', 0x01};
    t = raw_header(hugemap, sizeof hugemap);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "truncated header");
    kvm_msg_free(&t);
    const uint8_t hugestr[] = {0x81, 0xa1, 'v', 0xdb, 0xff, 0xff, 0xff, 0xff, 'x'};
    t = raw_header(hugestr, sizeof hugestr);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "header");
    kvm_msg_free(&t);
    /* an encoder refuses sizes past the limits too */
    kv_fix_init(&f, 5, 0);
    f.kv.n_tokens = (int64_t)1 << 40;
    kvm_msg *e = NULL;
    ASSERT_FAILS(kvm_proto_kv_encode(&f.kv, &e), KVM_EINVAL, "n_tokens");
    ck_assert_ptr_null(e);
    kv_fix_deinit(&f);
}
END_TEST

START_TEST(test_malformed_shape_frame_mismatch)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *t;
    kvm_proto_kv d;
    t = reframe(m, -1, 1, 0); /* keys one byte short */
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "tensor 'keys': frame 1 has 319 bytes, shape x f32 needs 320");
    kvm_msg_free(&t);
    uint64_t six = 6;
    t = with_field(m, "n_tokens", pk_u64, &six); /* header sizes disagree with the descriptors */
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO,
                 "shape [2, 5, 8] does not match [n_kv_heads, n_tokens, head_dim] = [2, 6, 8]");
    kvm_msg_free(&t);
    desc_arg dt = {"keys", "i32", 3, {2, 5, 8}};
    kvm_msg *one = reframe(m, -1, -1, 0);
    t = with_field(one, "tensors", pk_desc, &dt);
    kvm_msg_free(&one);
    one = reframe(t, -1, -1, 0);
    kvm_msg_free(&t);
    /* only the first frame is described now: make it a single-tensor message */
    t = raw_header(kvm_msg_frame(one, 0).data, kvm_msg_frame(one, 0).size);
    ck_assert_int_eq(kvm_msg_add_copy(t, kvm_msg_frame(m, 1).data, kvm_msg_frame(m, 1).size), 0);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "tensor 'keys': dtype i32 not allowed here");
    kvm_msg_free(&t);
    kvm_msg_free(&one);
    desc_arg dq = {"keys", "f64", 3, {2, 5, 8}};
    t = with_field(m, "tensors", pk_desc, &dq);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "unknown dtype 'f64'");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);

    /* a misaligned frame (a blob borrowed at an odd address) is refused, not read */
    const int32_t counts[2] = {2, 1};
    cache_fix c;
    cache_fix_init(&c, KVM_PROTO_F32, counts, 2);
    ck_assert_int_eq(kvm_proto_cache_encode(&c.c, &m), 0);
    uint8_t *blob = NULL;
    size_t n = 0;
    ck_assert_int_eq(kvm_msg_pack(m, &blob, &n), 0);
    uint8_t *odd = malloc(n + 1);
    memcpy(odd + 1, blob, n);
    ck_assert_int_eq(kvm_msg_unpack(odd + 1, n, KVM_MSG_BORROW, &t), 0);
    kvm_proto_cache dc;
    ASSERT_FAILS(kvm_proto_cache_decode(t, &dc), KVM_EPROTO, "not aligned");
    kvm_msg_free(&t);
    ck_assert_int_eq(kvm_msg_unpack(odd + 1, n, 0, &t), 0); /* copies are aligned */
    ck_assert_msg(kvm_proto_cache_decode(t, &dc) == 0, "%s", kvm_errmsg());
    kvm_msg_free(&t);
    free(odd);
    free(blob);
    kvm_msg_free(&m);
    cache_fix_deinit(&c);
}
END_TEST

START_TEST(test_malformed_version_and_type)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *t;
    kvm_proto_kv d;
    kvm_proto_type ty;
    uint64_t v2 = 2;
    t = with_field(m, "v", pk_u64, &v2);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "unsupported protocol version 2 (this build speaks 1)");
    ASSERT_FAILS(kvm_proto_peek(t, &ty), KVM_EPROTO, "unsupported protocol version 2");
    kvm_msg_free(&t);
    t = with_field(m, "v", NULL, NULL);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "missing field 'v'");
    kvm_msg_free(&t);
    t = with_field(m, "type", pk_str, "kv2");
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "unknown message type 'kv2'");
    ASSERT_FAILS(kvm_proto_peek(t, &ty), KVM_EPROTO, "unknown message type 'kv2'");
    kvm_msg_free(&t);
    t = with_field(m, "type", NULL, NULL);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "missing field 'type'");
    kvm_msg_free(&t);
    t = with_field(m, "type", pk_str, "cache");
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "expected message type 'kv', got 'cache'");
    ck_assert_int_eq(kvm_proto_peek(t, &ty), 0);
    ck_assert_int_eq(ty, KVM_PROTO_CACHE);
    kvm_proto_cache dc;
    ck_assert_int_eq(kvm_proto_cache_decode(t, &dc), KVM_EPROTO); /* kv fields are no cache */
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);
    for (int ti = KVM_PROTO_TYPE_FIRST; ti <= KVM_PROTO_TYPE_LAST; ti++)
        ck_assert_str_ne(kvm_proto_type_name(ti), "?");
    ck_assert_str_eq(kvm_proto_type_name(0), "?");
}
END_TEST

START_TEST(test_malformed_missing_and_extra_frames)
{
    kv_fix f;
    kv_fix_init(&f, 5, 1);
    kvm_msg *m = encode_kv(&f), *t;
    kvm_proto_kv d;
    t = reframe(m, 6, -1, 0);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO,
                 "missing frames: header lists 6 tensors, message has 5 tensor frames");
    kvm_msg_free(&t);
    t = reframe(m, -1, -1, 1);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO,
                 "extra frames: header lists 6 tensors, message has 7 tensor frames");
    kvm_msg_free(&t);
    t = reframe(m, -1, -1, KVM_PROTO_MAX_FRAMES);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "extra frames");
    kvm_msg_free(&t);
    t = with_field(m, "tensors", NULL, NULL);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "extra frames: header lists 0 tensors");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    /* a required tensor not listed at all */
    float *keep = f.buf[4];
    f.kv.entropy = NULL;
    ASSERT_FAILS(kvm_proto_kv_encode(&f.kv, &m), KVM_EINVAL, "tensor 'entropy' is NULL");
    f.kv.entropy = keep;
    m = encode_kv(&f);
    desc_arg da = {"keys", "f32", 3, {2, 5, 8}};
    t = with_field(m, "tensors", pk_desc, &da);
    kvm_msg *one = raw_header(kvm_msg_frame(t, 0).data, kvm_msg_frame(t, 0).size);
    ck_assert_int_eq(kvm_msg_add_copy(one, kvm_msg_frame(m, 1).data, kvm_msg_frame(m, 1).size), 0);
    ASSERT_FAILS(kvm_proto_kv_decode(one, &d), KVM_EPROTO, "missing tensor 'values'");
    kvm_msg_free(&one);
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);
}
END_TEST

START_TEST(test_malformed_fields)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *t;
    kvm_proto_kv d;
    t = with_field(m, "head_dim", NULL, NULL);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "missing field 'head_dim'");
    kvm_msg_free(&t);
    /* a duplicate key: append a second "layer" by hand */
    kvm_frame f0 = kvm_msg_frame(m, 0);
    uint8_t *buf = malloc(f0.size + 16);
    memcpy(buf, f0.data, f0.size);
    ck_assert_uint_eq(buf[0] & 0xf0, 0x80); /* fixmap */
    buf[0]++;
    memcpy(buf + f0.size, "\xa5layer\x01", 7);
    t = raw_header(buf, f0.size + 7);
    copy_frames(t, m, 1);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "duplicate field 'layer'");
    kvm_msg_free(&t);
    free(buf);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);
}
END_TEST

START_TEST(test_malformed_ranges)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *t;
    kvm_proto_kv d;
    uint64_t four = 4, three = 3;
    t = with_field(m, "layer", pk_u64, &four);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "field 'layer' = 4 must be < n_layers = 4");
    kvm_msg_free(&t);
    t = with_field(m, "n_kv_heads", pk_u64, &three);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "must divide n_heads");
    kvm_msg_free(&t);
    t = with_field(m, "q_start", pk_u64, &four);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_ERANGE, "exceed n_tokens");
    kvm_msg_free(&t);
    kvm_msg_free(&m);
    f.kv.layer = 4;
    ASSERT_FAILS(kvm_proto_kv_encode(&f.kv, &m), KVM_EINVAL, "must be < n_layers");
    kv_fix_deinit(&f);

    /* cache: per-head counts must sum to the rows; positions in [-1, n_tokens) */
    const int32_t counts[3] = {2, 0, 3};
    cache_fix c;
    cache_fix_init(&c, KVM_PROTO_BF16, counts, 3);
    kvm_msg *cm = NULL;
    ck_assert_int_eq(kvm_proto_cache_encode(&c.c, &cm), 0);
    kvm_proto_cache dc;
    kvm_msg *bad = reframe(cm, -1, -1, 0);
    int32_t *he = (int32_t *)(uintptr_t)kvm_msg_frame(bad, 1).data;
    he[0] = 1;
    he[1] = 1; /* sum still 5, fine */
    ck_assert_msg(kvm_proto_cache_decode(bad, &dc) == 0, "%s", kvm_errmsg());
    he[1] = 2; /* sum 6 != 5 */
    ASSERT_FAILS(kvm_proto_cache_decode(bad, &dc), KVM_EPROTO, "tensor 'head_entries' sums to 6, but n_entries");
    he[1] = -1;
    ASSERT_FAILS(kvm_proto_cache_decode(bad, &dc), KVM_ERANGE, "tensor 'head_entries'[1] = -1 out of range [0, 10]");
    he[1] = 1;
    int32_t *pos = (int32_t *)(uintptr_t)kvm_msg_frame(bad, 4).data;
    pos[4] = 10;
    ASSERT_FAILS(kvm_proto_cache_decode(bad, &dc), KVM_ERANGE, "tensor 'positions'[4] = 10 out of range [-1, 9]");
    pos[4] = -2;
    ASSERT_FAILS(kvm_proto_cache_decode(bad, &dc), KVM_ERANGE, "tensor 'positions'[4] = -2");
    kvm_msg_free(&bad);
    uint64_t zero = 0, n_layers_small = 1;
    t = with_field(cm, "n_layers", pk_u64, &n_layers_small);
    ASSERT_FAILS(kvm_proto_cache_decode(t, &dc), KVM_ERANGE, "field 'layer' = 1 must be < n_layers = 1");
    kvm_msg_free(&t);
    t = with_field(cm, "n_tokens", pk_u64, &zero);
    ASSERT_FAILS(kvm_proto_cache_decode(t, &dc), KVM_ERANGE, "field 'n_tokens' = 0 out of range [1, 1048576]");
    kvm_msg_free(&t);
    kvm_msg_free(&cm);
    c.counts[0] = 3; /* encode checks the same */
    ASSERT_FAILS(kvm_proto_cache_encode(&c.c, &cm), KVM_EINVAL, "sums to 6");
    c.counts[0] = 2;
    c.c.dtype = KVM_PROTO_I32;
    ASSERT_FAILS(kvm_proto_cache_encode(&c.c, &cm), KVM_EINVAL, "dtype i32 not allowed");
    cache_fix_deinit(&c);

    /* strategy: budgets within [budget_min, n_ctx], pattern indices within patterns */
    int32_t pat[2] = {0, 1}, bud[2] = {64, 5000};
    kvm_proto_strategy st = {.name = kvm_proto_str_c("s"),
                             .n_layers = 1,
                             .n_phases = 2,
                             .n_kv_heads = 1,
                             .n_ctx = 4096,
                             .budget_min = 16,
                             .n_patterns = 2,
                             .pattern = pat,
                             .budget = bud};
    st.patterns[0] = kvm_proto_str_c("h2o");
    st.patterns[1] = kvm_proto_str_c("tova");
    ASSERT_FAILS(kvm_proto_strategy_encode(&st, &cm), KVM_EINVAL, "tensor 'budget'[1] = 5000 out of range [16, 4096]");
    bud[1] = 100;
    pat[1] = 2;
    ASSERT_FAILS(kvm_proto_strategy_encode(&st, &cm), KVM_EINVAL, "tensor 'pattern'[1] = 2 out of range [0, 1]");
    pat[1] = 1;
    st.patterns[1] = kvm_proto_str_c("h2o");
    ASSERT_FAILS(kvm_proto_strategy_encode(&st, &cm), KVM_EINVAL, "repeats");
    st.patterns[1] = kvm_proto_str_c("tova");
    ck_assert_int_eq(kvm_proto_strategy_encode(&st, &cm), 0);
    kvm_msg *sm = reframe(cm, -1, -1, 0);
    ((int32_t *)(uintptr_t)kvm_msg_frame(sm, 2).data)[0] = 8; /* below budget_min */
    kvm_proto_strategy ds;
    ASSERT_FAILS(kvm_proto_strategy_decode(sm, &ds), KVM_ERANGE, "tensor 'budget'[0] = 8 out of range [16, 4096]");
    kvm_msg_free(&sm);
    kvm_msg_free(&cm);

    /* job: tokens >= 0, n_tokens <= n_ctx */
    int32_t tok[3] = {1, -5, 3};
    kvm_proto_job j = {.job_id = 1, .doc_id = kvm_proto_str_c("d"), .n_ctx = 8, .n_tokens = 3, .tokens = tok};
    ASSERT_FAILS(kvm_proto_job_encode(&j, &cm), KVM_EINVAL, "tensor 'tokens'[1] = -5");
    tok[1] = 5;
    j.n_ctx = 2;
    ASSERT_FAILS(kvm_proto_job_encode(&j, &cm), KVM_EINVAL, "field 'n_tokens' = 3 exceeds n_ctx = 2");
    j.n_ctx = 8;
    j.doc_id = kvm_proto_str_c("");
    ASSERT_FAILS(kvm_proto_job_encode(&j, &cm), KVM_EINVAL, "field 'doc_id': 0 bytes");
    /* settings must be a map of scalars */
    j.doc_id = kvm_proto_str_c("d");
    const uint8_t nested[] = {0x81, 0xa1, 'k', 0x91, 0x01};
    j.settings = nested;
    j.settings_bytes = sizeof nested;
    ASSERT_FAILS(kvm_proto_job_encode(&j, &cm), KVM_EINVAL, "value of 'k' is array, expected a scalar");
    /* floats must be finite and in range */
    kvm_proto_result r = {.job_id = 1, .stage = kvm_proto_str_c("x"), .total_ms = NAN};
    ASSERT_FAILS(kvm_proto_result_encode(&r, &cm), KVM_EINVAL, "field 'total_ms'");
    r.total_ms = -1;
    ASSERT_FAILS(kvm_proto_result_encode(&r, &cm), KVM_EINVAL, "field 'total_ms'");
}
END_TEST

START_TEST(test_forward_compatible)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *t, *t2;
    kvm_proto_kv d;
    /* unknown fields of any type are ignored */
    t = with_field(m, "rope_theta", pk_f64, &(double){10000.0});
    t2 = with_field(t, "future_map", pk_desc, &(desc_arg){"x", "f32", 1, {1}});
    ck_assert_msg(kvm_proto_kv_decode(t2, &d) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(d.n_tokens, 5);
    assert_bytes_eq(d.keys, f.kv.keys, 320, "keys");
    kvm_msg_free(&t);
    kvm_msg_free(&t2);
    /* an unknown tensor is length-checked and skipped */
    kvm_frame f0 = kvm_msg_frame(m, 0);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    ck_assert_int_eq(msgpack_unpack_next(&up, (const char *)f0.data, f0.size, &off), MSGPACK_UNPACK_SUCCESS);
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_object_map *mp = &up.data.via.map;
    msgpack_pack_map(&pk, mp->size);
    for (uint32_t i = 0; i < mp->size; i++) {
        msgpack_pack_object(&pk, mp->ptr[i].key);
        if (mp->ptr[i].key.via.str.size == 7 && memcmp(mp->ptr[i].key.via.str.ptr, "tensors", 7) == 0) {
            msgpack_object_array *a = &mp->ptr[i].val.via.array;
            msgpack_pack_array(&pk, a->size + 1);
            for (uint32_t k = 0; k < a->size; k++)
                msgpack_pack_object(&pk, a->ptr[k]);
            msgpack_pack_map(&pk, 4);
            pk_str(&pk, "name");
            pk_str(&pk, "value_norms");
            pk_str(&pk, "dtype");
            pk_str(&pk, "bf16");
            pk_str(&pk, "shape");
            msgpack_pack_array(&pk, 2);
            msgpack_pack_uint64(&pk, 2);
            msgpack_pack_uint64(&pk, 3);
            pk_str(&pk, "unit");
            pk_str(&pk, "none");
        } else {
            msgpack_pack_object(&pk, mp->ptr[i].val);
        }
    }
    t = raw_header(sb.data, sb.size);
    copy_frames(t, m, 1);
    uint16_t norms[6] = {0};
    ck_assert_int_eq(kvm_msg_add_copy(t, norms, sizeof norms), 0);
    ck_assert_msg(kvm_proto_kv_decode(t, &d) == 0, "%s", kvm_errmsg());
    kvm_msg_free(&t);
    t = raw_header(sb.data, sb.size);
    copy_frames(t, m, 1);
    ck_assert_int_eq(kvm_msg_add_copy(t, norms, sizeof norms - 2), 0);
    ASSERT_FAILS(kvm_proto_kv_decode(t, &d), KVM_EPROTO, "tensor 'value_norms': frame 5 has 10 bytes");
    kvm_msg_free(&t);
    msgpack_sbuffer_destroy(&sb);
    msgpack_unpacked_destroy(&up);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);
}
END_TEST

/* ---------------------------------------------------------------- container and blob */

static int ext_freed;
static void count_free(void *data, void *hint)
{
    (void)data;
    ext_freed += *(int *)hint;
}

START_TEST(test_msg_container)
{
    kvm_msg *m = NULL, *front = NULL, *back = NULL;
    ck_assert_int_eq(kvm_msg_new(&m), 0);
    static const char a[] = "identity", b[] = "";
    static char c[] = "payload";
    int one = 1;
    ck_assert_int_eq(kvm_msg_add_copy(m, a, sizeof a - 1), 0);
    ck_assert_int_eq(kvm_msg_add_copy(m, b, 0), 0);
    ck_assert_int_eq(kvm_msg_add_external(m, c, sizeof c - 1, count_free, &one), 0);
    void *own = strdup("owned");
    ck_assert_int_eq(kvm_msg_add_owned(m, &own, 5), 0);
    ck_assert_ptr_null(own);
    ck_assert_int_eq(kvm_msg_add_external(m, c, 3, NULL, NULL), 0); /* borrowed */
    ck_assert_uint_eq(kvm_msg_nframes(m), 5);
    ck_assert_uint_eq(kvm_msg_frame(m, 1).size, 0);
    ck_assert_ptr_null(kvm_msg_frame(m, 9).data);
    ck_assert_int_eq(kvm_msg_split(m, 6, &front), KVM_EINVAL);
    ck_assert_int_eq(kvm_msg_split(m, 2, &front), 0);
    ck_assert_uint_eq(kvm_msg_nframes(front), 2);
    ck_assert_uint_eq(kvm_msg_nframes(m), 3);
    ck_assert_int_eq(memcmp(kvm_msg_frame(front, 0).data, "identity", 8), 0);
    ck_assert_ptr_eq(kvm_msg_frame(m, 0).data, c);
    back = m;
    m = NULL;
    ck_assert_int_eq(kvm_msg_join(front, &back), 0);
    ck_assert_ptr_null(back);
    ck_assert_uint_eq(kvm_msg_nframes(front), 5);
    ck_assert_int_eq(memcmp(kvm_msg_frame(front, 3).data, "owned", 5), 0);
    ck_assert_int_eq(ext_freed, 0);
    kvm_msg_free(&front);
    ck_assert_ptr_null(front);
    ck_assert_int_eq(ext_freed, 1);
    kvm_msg_free(NULL);
    ck_assert_uint_eq(kvm_msg_nframes(NULL), 0);
    /* add_owned on a NULL message still frees what it was given */
    own = strdup("x");
    ck_assert_int_eq(kvm_msg_add_owned(NULL, &own, 1), KVM_EINVAL);
    ck_assert_ptr_null(own);
    ck_assert_int_eq(kvm_msg_add_external(NULL, c, 1, count_free, &one), KVM_EINVAL);
    ck_assert_int_eq(ext_freed, 2);
}
END_TEST

START_TEST(test_blob_roundtrip)
{
    kvm_msg *m = NULL, *u = NULL;
    ck_assert_int_eq(kvm_msg_new(&m), 0);
    const size_t sizes[5] = {13, 0, 8, 1, 4099};
    uint8_t *data = malloc(5000);
    for (int i = 0; i < 5000; i++)
        data[i] = (uint8_t)(i * 31 + 7);
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(kvm_msg_add_copy(m, data, sizes[i]), 0);
    size_t need = kvm_msg_packed_size(m);
    ck_assert_uint_eq(need, 16 + (8 + 16) + 8 + (8 + 8) + (8 + 8) + (8 + 4104));
    uint8_t *blob = NULL;
    size_t n = 0;
    ck_assert_int_eq(kvm_msg_pack(m, &blob, &n), 0);
    ck_assert_uint_eq(n, need);
    ck_assert_int_eq(memcmp(blob, "KVMB\x01\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00", 16), 0);
    uint8_t small[64];
    ck_assert_int_eq(kvm_msg_pack_into(m, small, sizeof small), KVM_EINVAL);
    for (unsigned flags = 0; flags <= KVM_MSG_BORROW; flags++) {
        ck_assert_int_eq(kvm_msg_unpack(blob, n, flags, &u), 0);
        ck_assert_uint_eq(kvm_msg_nframes(u), 5);
        for (size_t i = 0; i < 5; i++) {
            kvm_frame f = kvm_msg_frame(u, i);
            ck_assert_uint_eq(f.size, sizes[i]);
            if (f.size) ck_assert_int_eq(memcmp(f.data, data, f.size), 0);
            if (f.size) ck_assert_uint_eq((uintptr_t)f.data % 8, 0);
            if (flags == KVM_MSG_BORROW && f.size) ck_assert(f.data > blob && f.data < blob + n);
        }
        kvm_msg_free(&u);
    }
    free(blob);
    free(data);
    kvm_msg_free(&m);
    ck_assert_int_eq(kvm_msg_new(&m), 0);
    ck_assert_int_eq(kvm_msg_pack(m, &blob, &n), KVM_EINVAL); /* no frames */
    ck_assert_ptr_null(blob);
    kvm_msg_free(&m);
}
END_TEST

START_TEST(test_blob_corrupt)
{
    kv_fix f;
    kv_fix_init(&f, 5, 0);
    kvm_msg *m = encode_kv(&f), *u = NULL;
    uint8_t *blob = NULL;
    size_t n = 0;
    ck_assert_int_eq(kvm_msg_pack(m, &blob, &n), 0);
    /* every truncation is refused */
    for (size_t cut = 0; cut < n; cut++) {
        int rc = kvm_msg_unpack(blob, cut, 0, &u);
        ck_assert_msg(rc == KVM_ECORRUPT, "cut %zu: %d", cut, rc);
        ck_assert_ptr_null(u);
    }
    uint8_t *c = malloc(n + 8);
    memcpy(c, blob, n);
    memset(c + n, 0, 8);
    ASSERT_FAILS(kvm_msg_unpack(c, n + 8, 0, &u), KVM_ECORRUPT, "trailing bytes");
    c[0] = 'X';
    ASSERT_FAILS(kvm_msg_unpack(c, n, 0, &u), KVM_ECORRUPT, "bad magic");
    c[0] = 'K';
    c[4] = 2;
    ASSERT_FAILS(kvm_msg_unpack(c, n, 0, &u), KVM_ECORRUPT, "unsupported version 2");
    c[4] = 1;
    c[8] = 0;
    ASSERT_FAILS(kvm_msg_unpack(c, n, 0, &u), KVM_ECORRUPT, "0 frames");
    c[8] = 200;
    ASSERT_FAILS(kvm_msg_unpack(c, n, 0, &u), KVM_ECORRUPT, "200 frames");
    c[8] = blob[8];
    c[16 + 7] = 0x80; /* frame 0 size: 2^63 + x */
    ASSERT_FAILS(kvm_msg_unpack(c, n, 0, &u), KVM_ECORRUPT, "declares");
    c[16 + 7] = 0;
    size_t h = kvm_msg_frame(m, 0).size;
    if (h % 8) {
        c[16 + 8 + h] = 1; /* padding after frame 0 */
        ASSERT_FAILS(kvm_msg_unpack(c, n, 0, &u), KVM_ECORRUPT, "non-zero padding");
        c[16 + 8 + h] = 0;
    }
    c[12] = 1;
    ASSERT_FAILS(kvm_msg_unpack(c, n, 0, &u), KVM_ECORRUPT, "reserved");
    c[12] = 0;
    ck_assert_int_eq(memcmp(c, blob, n), 0);
    /* any single flipped byte either is refused or unpacks to a message the decoder checks */
    for (size_t i = 0; i < n; i += 3) {
        c[i] ^= 0x5a;
        if (kvm_msg_unpack(c, n, KVM_MSG_BORROW, &u) == 0) {
            kvm_proto_kv d;
            (void)kvm_proto_kv_decode(u, &d);
            kvm_msg_free(&u);
        }
        c[i] ^= 0x5a;
    }
    free(c);
    free(blob);
    kvm_msg_free(&m);
    kv_fix_deinit(&f);
}
END_TEST

/* ---------------------------------------------------------------- ZeroMQ */

static void zmq_roundtrip(void *tx, void *rx)
{
    kv_fix f;
    kv_fix_init(&f, 300, 1); /* keys: 2*300*8*4 = 19200 bytes: zero-copy */
    kvm_msg *m = encode_kv(&f), *r = NULL;
    ck_assert_uint_gt(kvm_msg_frame(m, 1).size, KVM_MSG_ZEROCOPY_MIN_BYTES);
    ck_assert_msg(kvm_msg_send(tx, &m, 0) == 0, "%s", kvm_errmsg());
    ck_assert_ptr_null(m);
    ck_assert_msg(kvm_msg_recv(rx, &r, 0) == 0, "%s", kvm_errmsg());
    kvm_proto_kv d;
    ck_assert_msg(kvm_proto_kv_decode(r, &d) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(d.n_tokens, 300);
    assert_bytes_eq(d.keys, f.kv.keys, 2 * 300 * 8 * 4, "keys");
    assert_bytes_eq(d.values, f.kv.values, 2 * 300 * 8 * 4, "values");
    assert_bytes_eq(d.q_post, f.kv.q_post, 4 * 2 * 8 * 4, "q_post");
    assert_bytes_eq(d.attn_mass, f.kv.attn_mass, 4 * 300 * 4, "attn_mass");
    /* forwarding a received message (a broker) sends its parts without copies */
    ck_assert_int_eq(kvm_msg_send(tx, &r, 0), 0);
    ck_assert_int_eq(kvm_msg_recv(rx, &r, 0), 0);
    ck_assert_int_eq(kvm_proto_kv_decode(r, &d), 0);
    assert_bytes_eq(d.values, f.kv.values, 2 * 300 * 8 * 4, "values forwarded");
    kvm_msg_free(&r);
    /* nothing waiting: EAGAIN */
    errno = 0;
    ck_assert_int_eq(kvm_msg_recv(rx, &r, ZMQ_DONTWAIT), KVM_EIO);
    ck_assert_int_eq(errno, EAGAIN);
    ck_assert_ptr_null(r);
    kv_fix_deinit(&f);
}

START_TEST(test_zmq_inproc)
{
    void *ctx = zmq_ctx_new();
    void *a = zmq_socket(ctx, ZMQ_PAIR), *b = zmq_socket(ctx, ZMQ_PAIR);
    ck_assert_int_eq(zmq_bind(a, "inproc://check_proto"), 0);
    ck_assert_int_eq(zmq_connect(b, "inproc://check_proto"), 0);
    zmq_roundtrip(a, b);
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_msg_send(a, &m, 0), KVM_EINVAL);
    ck_assert_int_eq(kvm_msg_new(&m), 0);
    ck_assert_int_eq(kvm_msg_send(a, &m, 0), KVM_EINVAL); /* empty: refused and freed */
    ck_assert_ptr_null(m);
    int linger = 0;
    zmq_setsockopt(a, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(b, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(a);
    zmq_close(b);
    zmq_ctx_term(ctx);
}
END_TEST

/* A socket that reconnects in a loop (nothing listens: a wrong key, a dead proxy did the same
 * with handshakes) while no one reads its monitor: after ~2,000 unread events libzmq's I/O
 * thread blocks in the monitor's send, holding the socket's monitor lock, and a plain stop
 * (zmq_socket_monitor(sock, NULL, 0)) then waited for ever: an idle store client hung its
 * process at exit. kvm_msg_monitor_stop reads them first and returns. The alarm turns a hang
 * into a failure (the suite's own timeout would too, slower). */
START_TEST(test_zmq_monitor_stop_full)
{
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER), *mon = zmq_socket(ctx, ZMQ_PAIR);
    int ivl = 1, linger = 0;
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    ck_assert_int_eq(zmq_socket_monitor(s, "inproc://check_proto_mon", ZMQ_EVENT_ALL), 0);
    ck_assert_int_eq(zmq_connect(mon, "inproc://check_proto_mon"), 0);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", kvm_test_tcp_port(7)); /* free now: refused */
    ck_assert_int_eq(zmq_connect(s, ep), 0);
    /* refused connects, ~3 events each, every ~1-2 ms: the pipe fills within a second or two */
    struct timespec ts = {4, 0};
    nanosleep(&ts, NULL);
    zmq_msg_t ev;
    zmq_msg_init(&ev);
    ck_assert_int_ge(zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT), 0); /* events were queued */
    zmq_msg_close(&ev);
    alarm(20);
    kvm_msg_monitor_stop(s, &mon);
    alarm(0);
    ck_assert_ptr_null(mon);
    zmq_close(s);
    zmq_ctx_term(ctx);
}
END_TEST

START_TEST(test_zmq_ipc_router)
{
    char *dir = kvm_test_tmpdir();
    ck_assert_ptr_nonnull(dir);
    char ep[4200], ep2[4200];
    snprintf(ep, sizeof ep, "ipc://%s/pipe", dir);
    snprintf(ep2, sizeof ep2, "ipc://%s/ctl", dir);
    void *ctx = zmq_ctx_new();
    void *push = zmq_socket(ctx, ZMQ_PUSH), *pull = zmq_socket(ctx, ZMQ_PULL);
    ck_assert_int_eq(zmq_bind(pull, ep), 0);
    ck_assert_int_eq(zmq_connect(push, ep), 0);
    zmq_roundtrip(push, pull);
    /* control: DEALER (stage) -> ROUTER (orchestrator), reply routed back by identity */
    void *router = zmq_socket(ctx, ZMQ_ROUTER), *dealer = zmq_socket(ctx, ZMQ_DEALER);
    ck_assert_int_eq(zmq_bind(router, ep2), 0);
    ck_assert_int_eq(zmq_connect(dealer, ep2), 0);
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("compress-1"), .stage = kvm_proto_str_c("compress"), .pid = 99};
    kvm_msg *m = NULL, *env = NULL;
    ck_assert_int_eq(kvm_proto_ready_encode(&c, &m), 0);
    ck_assert_int_eq(kvm_msg_send(dealer, &m, 0), 0);
    ck_assert_int_eq(kvm_msg_recv(router, &m, 0), 0);
    ck_assert_uint_eq(kvm_msg_nframes(m), 2);
    ck_assert_int_eq(kvm_msg_split(m, 1, &env), 0);
    kvm_proto_type t;
    ck_assert_int_eq(kvm_proto_peek(m, &t), 0);
    ck_assert_int_eq(t, KVM_PROTO_READY);
    kvm_proto_ctl d;
    ck_assert_int_eq(kvm_proto_ready_decode(m, &d), 0);
    assert_str_eq(d.worker_id, "compress-1");
    kvm_msg_free(&m);
    int32_t tok[2] = {5, 6};
    kvm_proto_job j = {.job_id = 3, .doc_id = kvm_proto_str_c("d3"), .n_ctx = 4, .n_tokens = 2, .tokens = tok};
    ck_assert_int_eq(kvm_proto_job_encode(&j, &m), 0);
    ck_assert_int_eq(kvm_msg_join(env, &m), 0);
    ck_assert_int_eq(kvm_msg_send(router, &env, 0), 0);
    ck_assert_int_eq(kvm_msg_recv(dealer, &m, 0), 0);
    kvm_proto_job dj;
    ck_assert_msg(kvm_proto_job_decode(m, &dj) == 0, "%s", kvm_errmsg());
    ck_assert_uint_eq(dj.job_id, 3);
    ck_assert_int_eq(dj.tokens[1], 6);
    kvm_msg_free(&m);
    void *socks[4] = {push, pull, router, dealer};
    int linger = 0;
    for (int i = 0; i < 4; i++) {
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_close(socks[i]);
    }
    zmq_ctx_term(ctx);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

START_TEST(test_zmq_limits)
{
    void *ctx = zmq_ctx_new();
    void *a = zmq_socket(ctx, ZMQ_PAIR), *b = zmq_socket(ctx, ZMQ_PAIR);
    ck_assert_int_eq(zmq_bind(a, "inproc://check_proto_limits"), 0);
    ck_assert_int_eq(zmq_connect(b, "inproc://check_proto_limits"), 0);
    /* a peer sending more than KVM_MSG_MAX_FRAMES parts: dropped whole, the next one arrives */
    for (int i = 0; i <= KVM_MSG_MAX_FRAMES; i++)
        ck_assert_int_ge(zmq_send(a, "x", 1, i < KVM_MSG_MAX_FRAMES ? ZMQ_SNDMORE : 0), 0);
    kvm_proto_ctl c = {.worker_id = kvm_proto_str_c("w"), .stage = kvm_proto_str_c("s"), .pid = 1};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_heartbeat_encode(&c, &m), 0);
    ck_assert_int_eq(kvm_msg_send(a, &m, 0), 0);
    ASSERT_FAILS(kvm_msg_recv(b, &m, 0), KVM_EPROTO, "more than 64 frames");
    ck_assert_ptr_null(m);
    ck_assert_int_eq(kvm_msg_recv(b, &m, 0), 0);
    kvm_proto_ctl d;
    ck_assert_msg(kvm_proto_heartbeat_decode(m, &d) == 0, "%s", kvm_errmsg());
    kvm_msg_free(&m);
    /* a send that would block fails with EAGAIN and still frees the message (zero-copy frame too) */
    void *push = zmq_socket(ctx, ZMQ_PUSH);
    ck_assert_int_eq(zmq_bind(push, "inproc://check_proto_nobody"), 0);
    kv_fix f;
    kv_fix_init(&f, 300, 0);
    m = encode_kv(&f);
    errno = 0;
    ck_assert_int_eq(kvm_msg_send(push, &m, ZMQ_DONTWAIT), KVM_EIO);
    ck_assert_int_eq(errno, EAGAIN);
    ck_assert_ptr_null(m);
    kv_fix_deinit(&f);
    int linger = 0;
    void *socks[3] = {a, b, push};
    for (int i = 0; i < 3; i++) {
        zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_close(socks[i]);
    }
    zmq_ctx_term(ctx);
}
END_TEST

/* ---------------------------------------------------------------- allocation failures */

/* Outside the sanitizer build the test binary interposes malloc/calloc/realloc (glibc supports
 * replacing them; these forward to glibc's own) so that the Nth allocation can fail and every
 * `goto fail` path runs; live allocations are counted to show nothing leaks. Under ASan, which
 * owns the allocator, the test is skipped visibly. */
#if !defined(__SANITIZE_ADDRESS__)
#define KVM_TEST_ALLOC_INJECTION 1
extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);
extern void __libc_free(void *p);
static int inj_on;       /* counting and failing only between inj_begin and inj_end */
static long inj_fail_at; /* index of the allocation that fails */
static long inj_count;   /* allocations attempted since inj_begin */
static long inj_live;    /* allocations minus frees since inj_begin */

static int inj_fail(void) { return inj_on && inj_count++ == inj_fail_at; }
void *malloc(size_t n)
{
    if (inj_fail()) return NULL;
    void *p = __libc_malloc(n);
    if (p && inj_on) inj_live++;
    return p;
}
void *calloc(size_t n, size_t size)
{
    if (inj_fail()) return NULL;
    void *p = __libc_calloc(n, size);
    if (p && inj_on) inj_live++;
    return p;
}
void *realloc(void *p, size_t n)
{
    if (inj_fail()) return NULL;
    void *q = __libc_realloc(p, n);
    if (q && !p && inj_on) inj_live++;
    return q;
}
void free(void *p)
{
    if (p && inj_on) inj_live--;
    __libc_free(p);
}

/* Encodes, packs, unpacks (both ways) and decodes a cache layer and a job; frees everything. */
static int alloc_roundtrip(const kvm_proto_cache *c, const kvm_proto_job *j)
{
    kvm_msg *m = NULL, *u = NULL, *b = NULL, *front = NULL;
    uint8_t *blob = NULL;
    size_t n = 0;
    kvm_proto_cache d;
    kvm_proto_job dj;
    int rc = kvm_proto_cache_encode(c, &m);
    if (!rc) rc = kvm_msg_pack(m, &blob, &n);
    if (!rc) rc = kvm_msg_unpack(blob, n, 0, &u);
    if (!rc) rc = kvm_msg_unpack(blob, n, KVM_MSG_BORROW, &b);
    if (!rc) rc = kvm_proto_cache_decode(u, &d);
    if (!rc) rc = kvm_msg_split(u, 2, &front);
    if (!rc) rc = kvm_msg_join(front, &u);
    kvm_msg_free(&m);
    if (!rc) rc = kvm_proto_job_encode(j, &m);
    if (!rc) rc = kvm_proto_job_decode(m, &dj);
    kvm_msg_free(&m);
    kvm_msg_free(&u);
    kvm_msg_free(&b);
    kvm_msg_free(&front);
    free(blob);
    return rc;
}
#endif

START_TEST(test_alloc_failures)
{
#ifdef KVM_TEST_ALLOC_INJECTION
    void *(*volatile alloc)(size_t) = malloc; /* is our malloc the one in use (not valgrind's)? */
    inj_count = 0;
    inj_fail_at = -1;
    inj_on = 1;
    void *probe = alloc(1);
    inj_on = 0;
    free(probe);
    if (inj_count != 1) {
        fprintf(stderr, "check_proto: alloc_failures skipped: malloc is not interposable here\n");
        return;
    }
    const int32_t counts[3] = {2, 0, 3};
    cache_fix f;
    cache_fix_init(&f, KVM_PROTO_F16, counts, 3);
    int32_t tok[3] = {1, 2, 3};
    kvm_proto_job j = {.job_id = 1, .doc_id = kvm_proto_str_c("d"), .n_ctx = 8, .n_tokens = 3, .tokens = tok};
    int failures = 0;
    for (long k = 0;; k++) {
        inj_count = inj_live = 0;
        inj_fail_at = k;
        inj_on = 1;
        int rc = alloc_roundtrip(&f.c, &j);
        inj_on = 0;
        ck_assert_msg(rc == 0 || rc == KVM_ENOMEM, "allocation %ld failed: rc %d (%s)", k, rc, kvm_errmsg());
        ck_assert_msg(inj_live == 0, "allocation %ld failed: %ld allocations leaked", k, inj_live);
        if (rc == KVM_ENOMEM) failures++;
        if (inj_count <= k) break; /* this run had no allocation left to fail: all paths done */
        ck_assert_int_lt(k, 10000);
    }
    ck_assert_int_gt(failures, 10);
    cache_fix_deinit(&f);
#else
    fprintf(stderr, "check_proto: alloc_failures skipped: AddressSanitizer owns malloc\n");
#endif
}
END_TEST

/* ---------------------------------------------------------------- suite */

/* proto/PROTOCOL.md is what other implementations read: its title and its revisions table (§9)
 * name KVM_PROTO_REVISION, the revision this code writes. The title said "revision 6" through
 * three later revisions. */
START_TEST(test_protocol_md_revision)
{
    const char *path = kvm_test_data_path("../proto/PROTOCOL.md");
    size_t len = 0;
    char *text = kvm_test_read_file(path, &len);
    if (!text) { /* test binaries carried to a GPU host without the source tree */
        kvm_test_skip("no proto/PROTOCOL.md beside the test data");
        return;
    }
    char want[64];
    snprintf(want, sizeof want, "(revision %d)\n", KVM_PROTO_REVISION);
    const char *eol = strchr(text, '\n'), *at = strstr(text, want);
    ck_assert_msg(eol && at && at + strlen(want) - 1 == eol, "%s's first line must end with \"%.*s\"", path,
                  (int)strlen(want) - 1, want);
    const char *table = strstr(text, "\n## 9. Revisions\n"); /* rows of other tables look alike */
    ck_assert_msg(table != NULL, "%s: no section '## 9. Revisions'", path);
    const char *end = strstr(table + 1, "\n## ");
    if (end) text[end - text] = '\0';
    snprintf(want, sizeof want, "\n| %d | ", KVM_PROTO_REVISION);
    ck_assert_msg(strstr(table, want) != NULL, "%s: no row for revision %d in the revisions table", path,
                  KVM_PROTO_REVISION);
    snprintf(want, sizeof want, "\n| %d | ", KVM_PROTO_REVISION + 1);
    ck_assert_msg(strstr(table, want) == NULL, "%s: a row for revision %d, beyond KVM_PROTO_REVISION", path,
                  KVM_PROTO_REVISION + 1);
    free(text);
}
END_TEST

/* kvm_proto_str_utf8: what a message holds (a path's bytes, a character cut by snprintf)
 * becomes a str field that encodes, cut only at a character boundary. */
START_TEST(test_str_utf8_clean)
{
    char buf[16];
    kvm_proto_str v = kvm_proto_str_utf8("caf\xc3\xa9 ok", buf, sizeof buf); /* valid: kept byte for byte */
    ck_assert_uint_eq(v.len, 8);
    ck_assert_str_eq(buf, "caf\xc3\xa9 ok");
    v = kvm_proto_str_utf8("a\xff\xc3(\xe2\x82", buf, sizeof buf); /* stray, lone lead, cut 3-byte */
    ck_assert_str_eq(buf, "a?"
                          "?("
                          "??"); /* split: "??(" is a trigraph */
    v = kvm_proto_str_utf8("\xed\xa0\x80\xc0\xaf\xf4\x90\x80\x80", buf,
                           sizeof buf); /* surrogate, overlong, > U+10FFFF */
    ck_assert_str_eq(buf, "?????????");
    /* cap: "abcdefghijklm" (13) + a 4-byte character does not fit 16 with the NUL: cut before it */
    v = kvm_proto_str_utf8("abcdefghijklm\xf0\x9f\x98\x80", buf, sizeof buf);
    ck_assert_uint_eq(v.len, 13);
    ck_assert_str_eq(buf, "abcdefghijklm");
    v = kvm_proto_str_utf8("abcdefghijklmnopqrstuvwxyz", buf, sizeof buf);
    ck_assert_uint_eq(v.len, 15);
    ck_assert_uint_eq(strlen(buf), 15);
    v = kvm_proto_str_utf8(NULL, buf, sizeof buf);
    ck_assert_uint_eq(v.len, 0);
    v = kvm_proto_str_utf8("x", buf, 0);
    ck_assert_uint_eq(v.len, 0);
    /* every cleaned string encodes: a 900-byte cut through 3-byte characters (after one ASCII
     * byte: 900 = 1 + 299·3 + 2), then text's cap cutting again, before another character */
    char big[2000], text[1023];
    big[0] = 'x';
    for (int i = 1; i + 3 <= 1998; i += 3)
        memcpy(big + i, "\xe2\x82\xac", 3);
    big[1998] = '\0';
    char cut[1200];
    snprintf(cut, sizeof cut, "worker w failed: %.*s", 900, big);
    kvm_proto_error e = {
        .status = KVM_EIO, .stage = kvm_proto_str_c("decode"), .message = kvm_proto_str_utf8(cut, text, sizeof text)};
    kvm_msg *m = NULL;
    ck_assert_int_eq(kvm_proto_error_encode(&e, &m), 0);
    kvm_proto_error d;
    ck_assert_int_eq(kvm_proto_error_decode(m, &d), 0);
    ck_assert_uint_eq(d.message.len, e.message.len);
    ck_assert_uint_eq(e.message.len, 917); /* 17 + 900: the cut character's two bytes as "??" */
    ck_assert_int_eq(memcmp(text + 915, "??", 2), 0);
    char longer[1200];
    snprintf(longer, sizeof longer, "%.1100s", big); /* 1 + 366·3 + 1 bytes */
    v = kvm_proto_str_utf8(longer, text, sizeof text);
    ck_assert_uint_eq(v.len, 1 + 340 * 3); /* 1021 + the next character (3) + NUL > 1023: cut before it */
    ck_assert_ptr_null(strchr(text, '?'));
    kvm_msg_free(&m);
}
END_TEST

static Suite *proto_suite(void)
{
    Suite *s = suite_create("proto");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {
        {"half_f16", test_half_f16},
        {"half_bf16", test_half_bf16},
        {"half_convert", test_half_convert},
        {"roundtrip_job", test_roundtrip_job},
        {"roundtrip_kv", test_roundtrip_kv},
        {"roundtrip_kv_wire_dtype", test_roundtrip_kv_wire_dtype},
        {"roundtrip_stats_strategy", test_roundtrip_stats_strategy},
        {"roundtrip_cache_dtypes", test_roundtrip_cache_dtypes},
        {"roundtrip_cache_empty", test_roundtrip_cache_empty},
        {"roundtrip_result_error", test_roundtrip_result_error},
        {"roundtrip_control", test_roundtrip_control},
        {"roundtrip_ready_model_id", test_roundtrip_ready_model_id},
        {"roundtrip_ctl_stopping", test_roundtrip_ctl_stopping},
        {"roundtrip_ctl_revision15", test_roundtrip_ctl_revision15},
        {"roundtrip_job_model_id", test_roundtrip_job_model_id},
        {"roundtrip_serve", test_roundtrip_serve},
        {"roundtrip_serve_revision2", test_roundtrip_serve_revision2},
        {"roundtrip_ask_prompt_bytes", test_roundtrip_ask_prompt_bytes},
        {"roundtrip_get_strategy", test_roundtrip_get_strategy},
        {"roundtrip_claim", test_roundtrip_claim},
        {"malformed_long_strings", test_malformed_long_strings},
        {"malformed_truncated_header", test_malformed_truncated_header},
        {"malformed_wrong_types", test_malformed_wrong_types},
        {"malformed_huge_sizes", test_malformed_huge_sizes},
        {"malformed_shape_frame_mismatch", test_malformed_shape_frame_mismatch},
        {"malformed_version_and_type", test_malformed_version_and_type},
        {"malformed_missing_and_extra_frames", test_malformed_missing_and_extra_frames},
        {"malformed_fields", test_malformed_fields},
        {"malformed_ranges", test_malformed_ranges},
        {"forward_compatible", test_forward_compatible},
        {"msg_container", test_msg_container},
        {"blob_roundtrip", test_blob_roundtrip},
        {"blob_corrupt", test_blob_corrupt},
        {"zmq_inproc", test_zmq_inproc},
        {"zmq_ipc_router", test_zmq_ipc_router},
        {"zmq_monitor_stop_full", test_zmq_monitor_stop_full},
        {"zmq_limits", test_zmq_limits},
        {"alloc_failures", test_alloc_failures},
        {"protocol_md_revision", test_protocol_md_revision},
        {"str_utf8_clean", test_str_utf8_clean},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(proto_suite()); }
