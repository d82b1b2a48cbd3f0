/* check_codec.c: the pipeline's encodings: a ragged cache through proto `cache` messages in
 * f32 (exact), f16 and bf16 (rounded), job settings to a config and back with the same
 * config id, and a corrupted stored value refused. */
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_jobcfg.h"
#include "common/kvm_error.h"
#include "proto/kvm_half.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static kvm_kvcache *ragged_cache(void)
{
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_kvcache_new(2, 3, 8, 4, &c), 0);
    float k[8], v[8];
    for (int l = 0; l < 2; l++)
        for (int g = 0; g < 3; g++) {
            kvm_kv_head *h = kvm_kvcache_head(c, l, g);
            int n = l * 3 + g; /* 0..5 entries: head (0,0) is empty */
            for (int e = 0; e < n; e++) {
                for (int i = 0; i < 8; i++) k[i] = 0.37f * (float)(e + 1) - 0.11f * (float)i + (float)l, v[i] = -k[i] * 0.5f;
                ck_assert_int_eq(kvm_kvcache_append(h, 8, k, v, e < 2 ? KVM_POS_NONE : 40 + e, e < 2 ? 0.25f * (float)e - 1 : 0), 0);
            }
        }
    c->next_pos = 50;
    return c;
}

static void roundtrip(kvm_proto_dtype dt, float tol)
{
    kvm_kvcache *c = ragged_cache(), *d;
    uint8_t **blobs;
    size_t *sizes;
    ck_assert_int_eq(kvm_cachecodec_pack(c, 50, dt, &blobs, &sizes), 0);
    ck_assert_int_eq(kvm_cachecodec_unpack((const uint8_t *const *)blobs, sizes, 2, 3, 8, &d), 0);
    ck_assert_int_eq(d->next_pos, 50);
    float worst = 0;
    for (int l = 0; l < 2; l++)
        for (int g = 0; g < 3; g++) {
            kvm_kv_head *a = kvm_kvcache_head(c, l, g), *b = kvm_kvcache_head(d, l, g);
            ck_assert_int_eq(a->n, b->n);
            for (int64_t e = 0; e < a->n; e++) {
                ck_assert_int_eq(a->pos[e], b->pos[e]);
                ck_assert_float_eq(a->bias[e], b->bias[e]);
                for (int i = 0; i < 8; i++) {
                    worst = fmaxf(worst, fabsf(a->k[e * 8 + i] - b->k[e * 8 + i]) / (1 + fabsf(a->k[e * 8 + i])));
                    worst = fmaxf(worst, fabsf(a->v[e * 8 + i] - b->v[e * 8 + i]) / (1 + fabsf(a->v[e * 8 + i])));
                }
            }
        }
    ck_assert_msg(worst <= tol, "dtype %d: relative error %g > %g", dt, worst, tol);
    if (dt != KVM_PROTO_F32) ck_assert_float_gt(worst, 0.0f); /* really rounded */
    /* a damaged layer value (its blob magic) is refused as corrupt, never half-loaded; the
     * store's checksums catch damage anywhere else before the codec sees it */
    blobs[1][0] ^= 0x5a;
    kvm_kvcache *bad = (kvm_kvcache *)0x1;
    ck_assert_int_eq(kvm_cachecodec_unpack((const uint8_t *const *)blobs, sizes, 2, 3, 8, &bad), KVM_ECORRUPT);
    ck_assert_ptr_null(bad);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "layer 1"));
    blobs[1][0] ^= 0x5a;
    /* a cache of another shape is a mismatch */
    ck_assert_int_eq(kvm_cachecodec_unpack((const uint8_t *const *)blobs, sizes, 2, 4, 8, &bad), KVM_EMISMATCH);
    for (int l = 0; l < 2; l++) free(blobs[l]);
    free(blobs);
    free(sizes);
    kvm_kvcache_free(&c);
    kvm_kvcache_free(&d);
}

START_TEST(test_cache_f32) { roundtrip(KVM_PROTO_F32, 0.0f); }
END_TEST
START_TEST(test_cache_f16) { roundtrip(KVM_PROTO_F16, 1e-3f); }
END_TEST
START_TEST(test_cache_bf16) { roundtrip(KVM_PROTO_BF16, 8e-3f); }
END_TEST

/* Encodes ragged_cache with key x at layer 1, KV head 2, entry 3, element 5 in dtype dt. */
static int encode_with(float x, kvm_proto_dtype dt)
{
    kvm_kvcache *c = ragged_cache();
    kvm_kvcache_head(c, 1, 2)->k[3 * 8 + 5] = x;
    uint8_t **blobs = NULL;
    size_t *sizes = NULL;
    int rc = kvm_cachecodec_pack(c, 50, dt, &blobs, &sizes);
    for (int l = 0; !rc && l < 2; l++)
        free(blobs[l]);
    if (!rc) free(blobs), free(sizes);
    kvm_kvcache_free(&c);
    return rc;
}

/* f16 turned a finite value at or above 65520 into inf without a word (a model whose values
 * overflow f16 was stored, verified and served as NaN); NaN and inf were stored in any dtype.
 * Now the encoder refuses the cache naming layer, head, entry and value. */
START_TEST(test_cache_range)
{
    ck_assert_int_eq(encode_with(65504.0f, KVM_PROTO_F16), 0);
    ck_assert_int_eq(encode_with(-65519.0f, KVM_PROTO_F16), 0); /* rounds to -65504 */
    ck_assert_int_eq(encode_with(65520.0f, KVM_PROTO_F16), KVM_ERANGE);
    ck_assert_msg(strstr(kvm_errmsg(), "cache layer 1, KV head 2, key of entry 3: value 65520 exceeds f16's range "
                                       "(65504): store it as bf16 or f32"),
                  "%s", kvm_errmsg());
    ck_assert_int_eq(encode_with(6.5e6f, KVM_PROTO_BF16), 0);
    ck_assert_int_eq(encode_with(6.5e6f, KVM_PROTO_F32), 0);
    /* bf16 too: a finite f32 at or past 0x7F7F8000 (3.3961514e38) became inf, refused only when
     * read back ("written by an older kvmill's f16 encoder") */
    uint32_t edge = 0x7f7f8000u, below = 0x7f7f7fffu;
    float fe, fb;
    memcpy(&fe, &edge, 4), memcpy(&fb, &below, 4);
    ck_assert_int_eq(encode_with(fb, KVM_PROTO_BF16), 0);
    ck_assert_int_eq(encode_with(-fe, KVM_PROTO_BF16), KVM_ERANGE);
    ck_assert_msg(strstr(kvm_errmsg(), "exceeds bf16's range (3.39e38): store it as f32"), "%s", kvm_errmsg());
    ck_assert_int_eq(encode_with(fe, KVM_PROTO_F32), 0);
    ck_assert_int_eq(kvm_half_overflows(65520.0f, KVM_PROTO_F16), 1);
    ck_assert_int_eq(kvm_half_overflows(65519.99f, KVM_PROTO_F16), 0);
    ck_assert_int_eq(kvm_half_overflows(NAN, KVM_PROTO_F16), 0); /* not finite: another check's */
    kvm_proto_dtype dts[3] = {KVM_PROTO_F32, KVM_PROTO_F16, KVM_PROTO_BF16};
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(encode_with(NAN, dts[i]), KVM_ERANGE);
        ck_assert_msg(strstr(kvm_errmsg(), "cache layer 1, KV head 2, key of entry 3: nan is not a finite number"),
                      "%s", kvm_errmsg());
        ck_assert_int_eq(encode_with(-INFINITY, dts[i]), KVM_ERANGE);
    }
}
END_TEST

START_TEST(test_jobcfg_roundtrip)
{
    kvm_config *c, *back;
    ck_assert_int_eq(kvm_config_parse("[model]\npath = /m/x.bin\ncontext = 200\n[compress]\nmethod = h2o\nratio = .25\n"
                                      "[store]\ndtype = f16\npath = /s\n[run]\nheartbeat_ms = 50\n", "t.ini", &c), 0);
    uint8_t *mp;
    size_t n;
    ck_assert_int_eq(kvm_jobcfg_pack(c, &mp, &n), 0);
    ck_assert_int_eq(kvm_jobcfg_unpack(mp, n, &back), 0);
    ck_assert_str_eq(kvm_config_str(back, "model", "path"), "/m/x.bin");
    ck_assert_int_eq(kvm_config_int(back, "model", "context"), 200);
    ck_assert_str_eq(kvm_config_str(back, "compress", "method"), "h2o");
    ck_assert_str_eq(kvm_config_str(back, "store", "dtype"), "f16");
    kvm_store_id a, b;
    ck_assert_int_eq(kvm_jobcfg_config_id(c, NULL, &a, NULL, NULL), 0);
    ck_assert_int_eq(kvm_jobcfg_config_id(back, NULL, &b, NULL, NULL), 0);
    ck_assert_int_eq(memcmp(&a, &b, sizeof a), 0); /* the stage stores under the orchestrator's id */
    ck_assert_int_eq(kvm_config_set(back, "compress", "ratio", "0.26"), 0);
    ck_assert_int_eq(kvm_jobcfg_config_id(back, NULL, &b, NULL, NULL), 0);
    ck_assert_int_ne(memcmp(&a, &b, sizeof a), 0); /* another setting, another id */
    kvm_config_free(&back);
    /* settings that are not a map of strings, or name unknown keys, are refused */
    const uint8_t not_map[] = {0x92, 0x01, 0x02};
    ck_assert_int_eq(kvm_jobcfg_unpack(not_map, sizeof not_map, &back), KVM_EPROTO);
    ck_assert_ptr_null(back);
    const uint8_t unknown[] = {0x82, 0xaa, 'm', 'o', 'd', 'e', 'l', '.', 'p', 'a', 't', 'h', 0xa2, '/', 'm',
                               0xa5, 'x', '.', 'y', 'z', 'w', 0xa1, '1'};
    ck_assert_int_eq(kvm_jobcfg_unpack(unknown, sizeof unknown, &back), KVM_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvm_errmsg(), "unknown section 'x'"));
    free(mp);
    kvm_config_free(&c);
}
END_TEST

static Suite *codec_suite(void)
{
    Suite *s = suite_create("codec");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"cache_f32", test_cache_f32},
                 {"cache_f16", test_cache_f16},
                 {"cache_bf16", test_cache_bf16},
                 {"cache_range", test_cache_range},
                 {"jobcfg_roundtrip", test_jobcfg_roundtrip}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(codec_suite()); }
