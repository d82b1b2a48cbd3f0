/* kvm_polykv_codec.c: the strategy value: allocation, canonical encoding (version 1, 2 with
 * the sculpt/kvzip layers' options, 3 with the model's id as well) with a strict decoder, files,
 * the model check, and the table print. */
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "common/kvm_log.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt_opts.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum {
    HDR_BYTES = 24,
    LAYER_BYTES = 8,
    OPTS_LEN_BYTES = 4,
    ID_BYTES = KVM_STRATEGY_MODEL_ID_BYTES,
    MAX_LAYERS = 65535,
    MAX_READ_LAYERS = 4096
};

int kvm_strategy_new(int n_layers, kvm_strategy **out)
{
    *out = NULL;
    if (n_layers < 1 || n_layers > MAX_LAYERS) return kvm_err(KVM_EINVAL, "strategy: %d layers", n_layers);
    kvm_strategy *s = calloc(1, sizeof *s);
    if (s) s->layers = calloc((size_t)n_layers, sizeof *s->layers);
    if (!s || !s->layers) {
        free(s);
        return kvm_err(KVM_ENOMEM, "strategy: out of memory");
    }
    s->n_layers = n_layers;
    s->alloc_power = 1.0;
    s->sculpt = kvm_sculpt_opts_default();
    *out = s;
    return 0;
}

int kvm_strategy_clone(const kvm_strategy *s, kvm_strategy **out)
{
    int rc = kvm_strategy_new(s->n_layers, out);
    if (rc) return rc;
    kvm_strategy_layer *layers = (*out)->layers;
    **out = *s;
    (*out)->layers = layers;
    memcpy(layers, s->layers, (size_t)s->n_layers * sizeof *layers);
    return 0;
}

int kvm_strategy_distilled(const kvm_strategy *s)
{
    int n = 0;
    for (int l = 0; l < s->n_layers; l++) n += kvm_pattern_is_distilled(s->layers[l].pattern[0]);
    return n;
}

void kvm_strategy_free(kvm_strategy **ps)
{
    if (!ps || !*ps) return;
    free((*ps)->layers);
    free(*ps);
    *ps = NULL;
}

static void put16(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get16(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* A layer's (prefill, decode) patterns: two eviction patterns, or sculpt or kvzip in both phases. */
static int pattern_pair_ok(unsigned p0, unsigned p1)
{
    if (kvm_pattern_is_distilled((kvm_pattern)p0) || kvm_pattern_is_distilled((kvm_pattern)p1)) return p0 == p1;
    return p0 < KVM_PATTERN_COUNT && p1 < KVM_PATTERN_COUNT;
}

int kvm_strategy_version(const kvm_strategy *s)
{
    return s->model_known ? 3 : s->sculpt_known && kvm_strategy_distilled(s) > 0 ? 2 : 1;
}

int kvm_strategy_encode(const kvm_strategy *s, uint8_t **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    if (s->n_layers < 1 || s->n_layers > MAX_LAYERS || s->budget_avg < 1 || s->budget_avg > UINT32_MAX ||
        s->b_min < 0 || s->b_min > s->budget_avg || (unsigned)s->select >= KVM_POLYKV_SELECT_COUNT ||
        (unsigned)s->alloc >= KVM_POLYKV_ALLOC_COUNT || (unsigned)s->head_split > 2 ||
        !(s->alloc_power >= 0 && s->alloc_power * 1000.0 < 4294967295.5)) /* every power the decoder reads */
        return kvm_err(KVM_EINVAL, "strategy encode: header field out of range");
    char opts[KVM_SCULPT_OPTS_CANONICAL_MAX] = "";
    const int version = kvm_strategy_version(s), has_opts = s->sculpt_known && kvm_strategy_distilled(s) > 0;
    if (has_opts && kvm_sculpt_opts_canonical(&s->sculpt, opts, sizeof opts))
        return kvm_err(KVM_EINVAL, "strategy encode: %s", kvm_errmsg());
    const size_t layers_end = HDR_BYTES + (size_t)LAYER_BYTES * (size_t)s->n_layers;
    const size_t opts_at = layers_end + (version == 3 ? ID_BYTES : 0); /* the options' length, v2 and v3 */
    size_t n = version == 1 ? layers_end : opts_at + OPTS_LEN_BYTES + strlen(opts);
    uint8_t *b = calloc(n, 1);
    if (!b) return kvm_err(KVM_ENOMEM, "strategy encode: out of memory");
    memcpy(b, "KVST", 4);
    put16(b + 4, (uint32_t)version);
    if (version == 3) memcpy(b + layers_end, s->model_id, ID_BYTES);
    if (version >= 2) {
        put32(b + opts_at, (uint32_t)strlen(opts));
        memcpy(b + opts_at + OPTS_LEN_BYTES, opts, strlen(opts));
    }
    put16(b + 6, (uint32_t)s->n_layers);
    put32(b + 8, (uint32_t)s->budget_avg);
    put32(b + 12, (uint32_t)s->b_min);
    b[16] = (uint8_t)s->select;
    b[17] = (uint8_t)s->alloc;
    b[18] = (uint8_t)s->head_split;
    put32(b + 20, (uint32_t)llround(s->alloc_power * 1000.0));
    for (int l = 0; l < s->n_layers; l++) {
        const kvm_strategy_layer *L = &s->layers[l];
        uint8_t *p = b + HDR_BYTES + (size_t)LAYER_BYTES * l;
        if (!pattern_pair_ok(L->pattern[0], L->pattern[1]) || L->budget < 1 || L->budget > UINT32_MAX) {
            free(b);
            return kvm_err(KVM_EINVAL, "strategy encode: layer %d pattern or budget out of range", l);
        }
        p[0] = (uint8_t)L->pattern[0];
        p[1] = (uint8_t)L->pattern[1];
        put32(p + 4, (uint32_t)L->budget);
    }
    *buf = b;
    *len = n;
    return 0;
}

/* Where a strategy's parts lie in its encoding, from its header (kvm_strategy_encode's layout). */
typedef struct layout {
    uint32_t version, n_layers;
    size_t layers_end; /* the first byte after the layers */
    size_t opts_at;    /* versions 2 and 3: the options' u32 length */
    size_t opts_len;   /* the options' text bytes (0: none) */
} layout;

/* Reads the layout of b[0, n) and checks that n is exactly its size: KVM_EFORMAT naming the
 * offset otherwise. */
static int layout_of(const uint8_t *b, size_t n, layout *o)
{
    if (n < HDR_BYTES)
        return kvm_err(KVM_EFORMAT, "strategy: %zu bytes, shorter than the %d-byte header", n, HDR_BYTES);
    if (memcmp(b, "KVST", 4) != 0) return kvm_err(KVM_EFORMAT, "strategy: bad magic at offset 0 (not \"KVST\")");
    const uint32_t v = o->version = get16(b + 4), L = o->n_layers = get16(b + 6);
    if (v < 1 || v > 3) return kvm_err(KVM_EFORMAT, "strategy: version %u at offset 4, expected 1, 2 or 3", v);
    if (L < 1) return kvm_err(KVM_EFORMAT, "strategy: 0 layers at offset 6");
    o->layers_end = HDR_BYTES + (size_t)LAYER_BYTES * L;
    o->opts_at = o->layers_end + (v == 3 ? ID_BYTES : 0);
    o->opts_len = 0;
    if (v >= 2) {
        if (n < o->opts_at + OPTS_LEN_BYTES)
            return kvm_err(
                KVM_EFORMAT,
                "strategy: %zu bytes, shorter than the %zu of %u layers%s and the options' length (version %u)", n,
                o->opts_at + OPTS_LEN_BYTES, L, v == 3 ? ", the model id" : "", v);
        o->opts_len = get32(b + o->opts_at);
        const unsigned lo = v == 2; /* version 3 says "no options" with 0 */
        if (o->opts_len < lo || o->opts_len >= KVM_SCULPT_OPTS_CANONICAL_MAX)
            return kvm_err(KVM_EFORMAT,
                           "strategy: sculpt options length %zu at offset %zu is not in [%u, %d] (version %u)",
                           o->opts_len, o->opts_at, lo, KVM_SCULPT_OPTS_CANONICAL_MAX - 1, v);
    }
    const size_t want = v == 1 ? o->layers_end : o->opts_at + OPTS_LEN_BYTES + o->opts_len;
    if (n != want)
        return kvm_err(KVM_EFORMAT, "strategy: %zu bytes, expected %zu for %u layers (version %u)", n, want, L, v);
    return 0;
}

/* The parts after the layers of s, decoded from b with layout lo: the options (version 2 needs
 * them, version 3 has them only for a strategy with a sculpt or kvzip layer, so that the
 * encoding stays canonical) and the model id. KVM_EFORMAT naming the offset. */
static int decode_tail(const uint8_t *b, const layout *lo, kvm_strategy *s)
{
    if (lo->opts_len > 0 && !kvm_strategy_distilled(s)) /* canonical: such a strategy has no options */
        return kvm_err(KVM_EFORMAT,
                       "strategy: version %u at offset 4 with sculpt options but without a sculpt or "
                       "kvzip layer (such a strategy is version %s)",
                       lo->version, lo->version == 2 ? "1" : "3 with options length 0");
    if (lo->opts_len > 0) {
        const size_t at = lo->opts_at + OPTS_LEN_BYTES;
        if (kvm_sculpt_opts_from_canonical((const char *)b + at, lo->opts_len, &s->sculpt))
            return kvm_err(KVM_EFORMAT, "strategy: sculpt options at offset %zu: %s", at, kvm_errmsg());
        s->sculpt_known = 1;
    }
    if (lo->version == 3) {
        memcpy(s->model_id, b + lo->layers_end, ID_BYTES);
        s->model_known = 1;
    }
    return 0;
}

int kvm_strategy_decode(const uint8_t *b, size_t n, kvm_strategy **out)
{
    *out = NULL;
    layout lo = {0};
    int rc = layout_of(b, n, &lo);
    if (rc) return rc;
    const uint32_t L = lo.n_layers, B = get32(b + 8), bmin = get32(b + 12);
    if (B < 1) return kvm_err(KVM_EFORMAT, "strategy: average budget 0 at offset 8");
    if (bmin > B) return kvm_err(KVM_EFORMAT, "strategy: b_min %u at offset 12 exceeds the average budget %u", bmin, B);
    if (b[16] >= KVM_POLYKV_SELECT_COUNT) return kvm_err(KVM_EFORMAT, "strategy: select mode %u at offset 16", b[16]);
    if (b[17] >= KVM_POLYKV_ALLOC_COUNT) return kvm_err(KVM_EFORMAT, "strategy: alloc mode %u at offset 17", b[17]);
    if (b[18] > 2) return kvm_err(KVM_EFORMAT, "strategy: head_split %u at offset 18 is not 0, 1 or 2", b[18]);
    if (b[19] != 0) return kvm_err(KVM_EFORMAT, "strategy: reserved byte at offset 19 is not zero");
    kvm_strategy *s;
    rc = kvm_strategy_new((int)L, &s);
    if (rc) return rc == KVM_ENOMEM ? rc : kvm_err(KVM_EFORMAT, "strategy: %u layers", L);
    s->budget_avg = B;
    s->b_min = bmin;
    s->select = (kvm_polykv_select)b[16];
    s->alloc = (kvm_polykv_alloc)b[17];
    s->head_split = b[18];
    s->alloc_power = get32(b + 20) / 1000.0;
    uint64_t sum = 0;
    for (uint32_t l = 0; l < L; l++) {
        const uint8_t *p = b + HDR_BYTES + (size_t)LAYER_BYTES * l;
        size_t off = HDR_BYTES + (size_t)LAYER_BYTES * l;
        uint32_t bud = get32(p + 4);
        if (!pattern_pair_ok(p[0], p[1]))
            rc = kvm_err(KVM_EFORMAT, "strategy: layer %u: unknown pattern pair %u/%u at offset %zu (eviction patterns "
                                      "0-%d, or sculpt %d or kvzip %d in both phases)",
                         l, p[0], p[1], off, KVM_PATTERN_COUNT - 1, KVM_PATTERN_SCULPT, KVM_PATTERN_KVZIP);
        else if (get16(p + 2) != 0)
            rc = kvm_err(KVM_EFORMAT, "strategy: layer %u: reserved bytes at offset %zu are not zero", l, off + 2);
        else if (bud < 1 || bud < bmin)
            rc = kvm_err(KVM_EFORMAT, "strategy: layer %u: budget %u at offset %zu is below the floor %u", l, bud,
                         off + 4, bmin > 1 ? bmin : 1);
        if (rc) break;
        s->layers[l] = (kvm_strategy_layer){.pattern = {(kvm_pattern)p[0], (kvm_pattern)p[1]}, .budget = bud};
        sum += bud;
    }
    if (!rc && sum != (uint64_t)L * B)
        rc = kvm_err(KVM_EFORMAT, "strategy: layer budgets sum to %llu, not L×B = %llu", (unsigned long long)sum,
                     (unsigned long long)L * B);
    if (!rc) rc = decode_tail(b, &lo, s);
    if (rc) {
        kvm_strategy_free(&s);
        return rc;
    }
    *out = s;
    return 0;
}

int kvm_strategy_read(const char *path, kvm_strategy **out)
{
    *out = NULL;
    FILE *f;
    int ost = kvm_file_open_input(path, "rb", "strategy", &f); /* a folder: named, not "read error" */
    if (ost) return ost;
    const size_t cap =
        HDR_BYTES + LAYER_BYTES * MAX_READ_LAYERS + ID_BYTES + OPTS_LEN_BYTES + KVM_SCULPT_OPTS_CANONICAL_MAX;
    uint8_t *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    }
    size_t n = fread(buf, 1, cap, f);
    int err = ferror(f);
    fclose(f);
    int rc = err ? kvm_err(KVM_EIO, "%s: read error", path) : kvm_strategy_decode(buf, n, out);
    free(buf);
    if (err) return rc;
    if (rc == KVM_EFORMAT) return kvm_err(rc, "%s: %s", path, kvm_errmsg());
    return rc;
}

int kvm_strategy_write_stream(const kvm_strategy *s, FILE *f, const char *name)
{
    uint8_t *b;
    size_t n;
    int rc = kvm_strategy_encode(s, &b, &n);
    if (rc) return rc;
    errno = 0; /* the reason said: "write failed" alone did not tell a full disk from a cut link */
    if (fwrite(b, 1, n, f) != n || fflush(f))
        rc = kvm_err(KVM_EIO, "%s: write failed: %s", name, errno ? strerror(errno) : "stream error");
    free(b);
    return rc;
}

int kvm_strategy_write(const kvm_strategy *s, const char *path)
{
    uint8_t *b;
    size_t n;
    int rc = kvm_strategy_encode(s, &b, &n);
    if (rc) return rc;
    FILE *f;
    if (!(rc = kvm_file_open_output(path, "wb", "strategy", &f))) {
        errno = 0;
        if (fwrite(b, 1, n, f) != n)
            rc = kvm_err(KVM_EIO, "%s: write failed: %s", path, errno ? strerror(errno) : "stream error");
        if (fclose(f) && !rc) rc = kvm_err(KVM_EIO, "%s: write failed: %s", path, strerror(errno));
    }
    free(b);
    return rc;
}

void kvm_strategy_set_model(kvm_strategy *s, const uint8_t *model_id)
{
    memcpy(s->model_id, model_id, ID_BYTES);
    s->model_known = 1;
}

/* id as 2·ID_BYTES lowercase hex digits in out[2·ID_BYTES + 1] (the store's kvm_store_id_hex form). */
static void id_hex(const uint8_t *id, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < ID_BYTES; i++) {
        out[2 * i] = digits[id[i] >> 4];
        out[2 * i + 1] = digits[id[i] & 15];
    }
    out[2 * ID_BYTES] = '\0';
}

/* Says on stderr that `file`'s strategy cannot be checked against model `model`, once per file:
 * eval reads the file once per budget, a worker once per document. */
static void note_unchecked(const kvm_strategy *s, const char *file, const char *model)
{
    static char last[4096];
    if (!strcmp(file, last)) return;
    snprintf(last, sizeof last, "%s", file);
    kvm_log(KVM_LOG_WARN, "message", NULL, 0,
            "polykv: %s is a version-%d strategy: it does not record the model it was calibrated on, so it cannot be "
            "checked against %s (a calibration by this build records it)",
            file, kvm_strategy_version(s), model);
}

int kvm_strategy_check_model(const kvm_strategy *s, const char *file, const uint8_t *model_id, const char *model)
{
    if (!s->model_known) {
        note_unchecked(s, file, model);
        return 0;
    }
    if (!memcmp(s->model_id, model_id, ID_BYTES)) return 0;
    char rec[2 * ID_BYTES + 1], act[2 * ID_BYTES + 1];
    id_hex(s->model_id, rec);
    id_hex(model_id, act);
    return kvm_err(KVM_EMISMATCH,
                   "polykv: strategy %s was calibrated on model %s, not on %s (model %s): its per-layer patterns and "
                   "budgets are that model's (kvmill calibrate makes one for this model)",
                   file, rec, model, act);
}

void kvm_strategy_print(const kvm_strategy *s, FILE *f)
{
    fprintf(f,
            "strategy: %d layers, average budget %lld (total %lld), b_min %lld, select %s, alloc %s^%.3g, heads %s\n",
            s->n_layers, (long long)s->budget_avg, (long long)s->budget_avg * s->n_layers, (long long)s->b_min,
            kvm_polykv_select_name(s->select), kvm_polykv_alloc_name(s->alloc), s->alloc_power,
            s->head_split == 2 ? "entropy over all heads"
            : s->head_split    ? "entropy within layers"
                               : "equal");
    char opts[KVM_SCULPT_OPTS_CANONICAL_MAX];
    if (kvm_strategy_distilled(s) && !s->sculpt_known)
        fprintf(f, "sculpt/kvzip layers' options: not recorded (a version-1 strategy)\n");
    else if (kvm_strategy_distilled(s) && !kvm_sculpt_opts_canonical(&s->sculpt, opts, sizeof opts))
        fprintf(f, "sculpt/kvzip layers' options: %s\n", opts);
    char id[2 * ID_BYTES + 1];
    if (s->model_known) {
        id_hex(s->model_id, id);
        fprintf(f, "calibrated on model %s\n", id);
    }
    fprintf(f, "%5s  %-10s  %-10s  %6s\n", "layer", "prefill", "decode", "budget");
    for (int l = 0; l < s->n_layers; l++)
        fprintf(f, "%5d  %-10s  %-10s  %6lld\n", l, kvm_pattern_name(s->layers[l].pattern[0]),
                kvm_pattern_name(s->layers[l].pattern[1]), (long long)s->layers[l].budget);
}
