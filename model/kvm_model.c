/* kvm_model.c: opening and closing model files; format detection and shared helpers. */
#include "model/kvm_model.h"
#include "model/kvm_gguf.h"
#include "model/kvm_hf.h"
#include "model/kvm_safetensors.h"
#include "common/kvm_error.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int map_file(const char *path, void **map, size_t *bytes)
{
    struct stat st;
    if (stat(path, &st) != 0) /* a link loop or a file used as a folder is a bad path, not an I/O failure */
        return kvm_err(errno == ENOENT                      ? KVM_ENOTFOUND
                       : errno == ELOOP || errno == ENOTDIR ? KVM_EFORMAT
                                                            : KVM_EIO,
                       "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) /* kvm_hf_is_folder said no: a folder is a model only with its config.json */
        return kvm_err(KVM_EFORMAT, "%s: is a directory without config.json: not a Hugging Face checkpoint folder "
                                    "(a model is a llama2.c or .gguf file, or a folder with config.json and "
                                    "model.safetensors)", path);
    if (!S_ISREG(st.st_mode)) return kvm_err(KVM_EFORMAT, "%s: not a regular file", path);
    if (st.st_size == 0) return kvm_err(KVM_EFORMAT, "%s: empty file", path);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return kvm_err(KVM_EIO, "%s: %s", path, strerror(errno));
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return kvm_err(KVM_EIO, "%s: mmap: %s", path, strerror(errno));
    *map = p;
    *bytes = (size_t)st.st_size;
    return 0;
}

/* A safetensors file (an 8-byte header length that fits the file, then '{') or a .json file
 * given as the model: a part of a Hugging Face folder, which the llama2.c reader would misread
 * ("header field 'dim' = 1768432251"). Returns 0 for other files, else KVM_EFORMAT naming the
 * folder to pass instead. */
static int hf_part(const char *path, const uint8_t *map, size_t n)
{
    size_t l = strlen(path);
    uint64_t h = 0;
    for (int k = 7; n >= 9 && k >= 0; k--)
        h = h << 8 | map[k];
    int st = n >= 10 && h >= 2 && h <= n - 8 && map[8] == '{', json = l >= 5 && strcmp(path + l - 5, ".json") == 0;
    if (!st && !json) return 0;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        snprintf(dir, sizeof dir, ".");
    if (kvm_hf_is_folder(dir))
        return kvm_err(KVM_EFORMAT,
                       "%s: a file of the Hugging Face folder %s: give the folder as the model "
                       "(--model %s)",
                       path, dir, dir);
    return kvm_err(KVM_EFORMAT,
                   "%s: a %s file, not a model: a Hugging Face checkpoint is read as its folder "
                   "(config.json, model.safetensors or its shards, tokenizer.json)",
                   path, st ? "safetensors" : "JSON");
}

/* 1 when the first bytes look like text (an HTML error page, JSON, a README saved under the
 * model's name): at least 95% printable ASCII or whitespace among the first 512, or '<' or
 * '{' followed by three printable bytes. A llama2.c header's small int32 fields hold NULs. */
static int looks_like_text(const uint8_t *map, size_t n)
{
    size_t k = n < 512 ? n : 512, printable = 0;
    for (size_t i = 0; i < k; i++)
        printable += (map[i] >= 0x20 && map[i] < 0x7f) || map[i] == '\t' || map[i] == '\n' || map[i] == '\r';
    if (printable * 100 >= k * 95) return 1;
    if (n < 4 || (map[0] != '<' && map[0] != '{')) return 0;
    for (int i = 1; i < 4; i++)
        if (map[i] < 0x20 || map[i] >= 0x7f) return 0;
    return 1;
}

/* Files that are no model at all, caught before the llama2.c reader misreads their first
 * bytes as a header ("header field 'dim' = 1936876918"): a Git LFS pointer, a text file, a
 * .gguf name without the GGUF magic. Returns 0 for other files, else KVM_EFORMAT saying what
 * the file is. */
static int not_a_model(const char *path, const uint8_t *map, size_t n)
{
    static const char lfs[] = "version https://git-lfs";
    if (n >= sizeof lfs - 1 && memcmp(map, lfs, sizeof lfs - 1) == 0)
        return kvm_err(KVM_EFORMAT,
                       "%s: a Git LFS pointer (%zu bytes), not the model itself: fetch the real file "
                       "(git lfs pull, or download it again)",
                       path, n);
    size_t l = strlen(path);
    int gguf_name = l >= 5 && strcmp(path + l - 5, ".gguf") == 0, magic = n >= 4 && memcmp(map, "GGUF", 4) == 0;
    if (looks_like_text(map, n) && !magic)
        return kvm_err(KVM_EFORMAT,
                       "%s: not a model: a text file (HTML? JSON?) of %zu bytes; a download that "
                       "saved an error page?",
                       path, n);
    if (gguf_name && !magic) {
        char shown[4 * 4 + 1] = "", *o = shown;
        for (size_t i = 0; i < 4 && i < n; i++)
            o += map[i] >= 0x20 && map[i] < 0x7f ? sprintf(o, "%c", map[i]) : sprintf(o, "\\x%02x", map[i]);
        return kvm_err(KVM_EFORMAT, "%s: not a GGUF file: magic '%s' at byte 0, expected 'GGUF'", path, shown);
    }
    return 0;
}

int kvm_model_open(const char *path, kvm_model **out)
{
    *out = NULL;
    kvm_model *m = calloc(1, sizeof *m);
    if (!m) return kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    int rc = KVM_ENOMEM;
    if (!(m->path = strdup(path))) goto fail;
    m->weight_dtype = KVM_MODEL_WEIGHTS_AUTO;
    if (kvm_hf_is_folder(path)) {
        rc = kvm__hf_load(m, path);
    } else {
        rc = map_file(path, &m->map, &m->map_bytes);
        if (rc || (rc = hf_part(path, m->map, m->map_bytes)) || (rc = not_a_model(path, m->map, m->map_bytes)))
            goto fail;
        if (m->map_bytes >= 4 && memcmp(m->map, "GGUF", 4) == 0) rc = kvm__gguf_load(m, m->map, m->map_bytes);
        else rc = kvm__llama2c_load(m, m->map, m->map_bytes);
        if (!m->arch[0]) snprintf(m->arch, sizeof m->arch, "llama");
    }
    if (rc) goto fail;
    if (m->cfg.n_eos == 0) {
        m->cfg.n_eos = 1;
        m->cfg.eos_ids[0] = m->cfg.eos_id;
    }
    *out = m;
    return 0;
fail:
    kvm_model_close(&m);
    return rc;
}

/* Why > 1: pair i rotates at theta^(-2i/head_dim) per position; at 1 every pair rotates alike
 * and below 1 the frequencies rise instead of fall, so positions alias: no checkpoint is
 * trained so, and such a value is a typo (0.5 for 5e5) that would give wrong logits silently. */
int kvm__model_check_rope_theta(const char *f, const char *key, double theta)
{
    if (theta > 1 && theta <= FLT_MAX) return 0; /* false for NaN too */
    return kvm_err(KVM_EFORMAT, "%s: %s = %g must be > 1 and at most %g (float32)", f, key, theta, (double)FLT_MAX);
}

/* 1 when the width-byte (2 or 4) field at p has every bit of mask set: an f32, f16 or bf16
 * infinity or NaN has its exponent (mask) all ones. */
static int lane_bad(const uint8_t *p, int width, uint32_t mask)
{
    uint32_t v = 0;
    if (width == 4)
        memcpy(&v, p, 4);
    else {
        uint16_t h;
        memcpy(&h, p, 2);
        v = h;
    }
    return (v & mask) == mask;
}

/* Nonzero when a lane of the words 64-bit words at p is bad: lanes of exponent mask m and
 * sign bits h. (v & m) ^ m is 0 in a bad lane, else at least m's lowest bit, so adding m sets
 * the lane's top bit exactly when it is fine (no carry leaves the lane). Two or four fields
 * per step where the compiler would not vectorise a loop of unknown length at -O2. */
static uint64_t swar_bad(const uint8_t *p, int64_t words, uint64_t m, uint64_t h)
{
    uint64_t bad = 0;
    for (int64_t i = 0; i < words; i++) {
        uint64_t v;
        memcpy(&v, p + 8 * i, 8);
        bad |= ~(((v & m) ^ m) + m) & h;
    }
    return bad;
}

/* Index of the first of count width-byte fields, stride bytes apart from p, that is an
 * infinity or NaN (lane_bad), or -1. Chunks are screened first (swar_bad where the fields are
 * back to back), so the all-finite common case is one fast pass. */
static int64_t first_bad(const uint8_t *p, int64_t count, int64_t stride, int width, uint32_t mask)
{
    enum { CHUNK = 4096 };
    const uint64_t m = (uint64_t)mask * (width == 4 ? 0x0000000100000001ull : 0x0001000100010001ull),
                   h = width == 4 ? 0x8000000080000000ull : 0x8000800080008000ull;
    for (int64_t c0 = 0; c0 < count; c0 += CHUNK) {
        int64_t c1 = count - c0 < CHUNK ? count : c0 + CHUNK, i = c0;
        int bad = 0;
        if (stride == width) {
            int64_t words = (c1 - c0) * width / 8;
            bad = swar_bad(p + c0 * width, words, m, h) != 0;
            i = c0 + words * 8 / width;
        }
        for (; i < c1; i++)
            bad |= lane_bad(p + i * stride, width, mask);
        for (i = c0; bad && i < c1; i++)
            if (lane_bad(p + i * stride, width, mask)) return i;
    }
    return -1;
}

static const char *nonfinite_name(float x) { return isnan(x) ? "NaN" : x > 0 ? "inf" : "-inf"; }

/* The f16 scale fields of a GGUF block type (byte offsets in the block, ggml-common.h's
 * layouts); NULL for a type without blocks. */
static const struct block_scales {
    int type, n, off[2];
    const char *name[2];
} * block_scales(int type)
{
    static const struct block_scales t[] = {
        {KVM_GGML_Q4_0, 1, {0, 0}, {"d", NULL}},   {KVM_GGML_Q4_1, 2, {0, 2}, {"d", "m"}},
        {KVM_GGML_Q5_0, 1, {0, 0}, {"d", NULL}},   {KVM_GGML_Q5_1, 2, {0, 2}, {"d", "m"}},
        {KVM_GGML_Q8_0, 1, {0, 0}, {"d", NULL}},   {KVM_GGML_Q4_K, 2, {0, 2}, {"d", "dmin"}},
        {KVM_GGML_Q6_K, 1, {208, 0}, {"d", NULL}},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (t[i].type == type) return &t[i];
    return NULL;
}

/* check_finite for a block type: every block's f16 scales. */
static int check_block_scales(const char *file, const char *tensor, const struct block_scales *bs, const uint8_t *data,
                              int64_t n)
{
    int64_t be = kvm_ggml_block_elems(bs->type), bb = kvm_ggml_block_bytes(bs->type), blocks = n / be;
    for (int f = 0; f < bs->n; f++) {
        int64_t b = first_bad(data + bs->off[f], blocks, bb, 2, 0x7c00);
        if (b < 0) continue;
        uint16_t h;
        memcpy(&h, data + b * bb + bs->off[f], 2);
        return kvm_err(KVM_EFORMAT,
                       "%s: tensor '%s': block %lld (elements %lld..%lld) of type %s has the f16 scale %s = %s: "
                       "non-finite weights (a corrupt file or a diverged model)",
                       file, tensor, (long long)b, (long long)(b * be), (long long)(b * be + be - 1),
                       kvm_ggml_type_name(bs->type), bs->name[f], nonfinite_name(kvm_fp16_to_f32(h)));
    }
    return 0;
}

int kvm__model_check_finite(const char *file, const char *tensor, int type, const uint8_t *data, int64_t n)
{
    const struct block_scales *bs = block_scales(type);
    if (bs) return check_block_scales(file, tensor, bs, data, n);
    int64_t i = type == KVM_MAT_F32    ? first_bad(data, n, 4, 4, 0x7f800000u)
                : type == KVM_MAT_F16  ? first_bad(data, n, 2, 2, 0x7c00)
                : type == KVM_MAT_BF16 ? first_bad(data, n, 2, 2, 0x7f80)
                                       : -1;
    if (i < 0) return 0;
    float x;
    uint16_t h;
    if (type == KVM_MAT_F32) {
        memcpy(&x, data + 4 * i, 4);
    } else {
        memcpy(&h, data + 2 * i, 2);
        x = type == KVM_MAT_F16 ? kvm_fp16_to_f32(h) : kvm_bf16_to_f32(h);
    }
    return kvm_err(KVM_EFORMAT,
                   "%s: tensor '%s': element %lld is %s: non-finite weights (a corrupt file or a diverged model)", file,
                   tensor, (long long)i, nonfinite_name(x));
}

float *kvm__model_alloc_weights(kvm_model *m, int64_t n_floats)
{
    size_t bytes = (size_t)(n_floats > 0 ? n_floats : 1) * sizeof(float);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        kvm_err(KVM_ENOMEM, "%s: cannot map %lld float32 vector weights: %s", m->path, (long long)n_floats,
                strerror(errno));
        return NULL;
    }
    m->owned = p;
    m->owned_bytes = bytes;
    return p;
}

static void prepared_free(kvm_prepared **pp, int n_layers)
{
    kvm_prepared *p = *pp;
    if (!p) return;
    for (int l = 0; p->layers && l < n_layers; l++) {
        kvm_prepared_layer *L = &p->layers[l];
        kvm_weight *ws[] = {L->wq, L->wk, L->wv, L->wo, L->w1, L->w2, L->w3};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) p->k->weight_free(ws[i]);
    }
    p->k->weight_free(p->wcls);
    free(p->layers);
    free(p);
    *pp = NULL;
}

int kvm_model_mat_rows(const kvm_mat *w, int64_t in, int64_t r0, int64_t n, float *dst)
{
    int64_t be = kvm_ggml_block_elems(w->type), bb = kvm_ggml_block_bytes(w->type);
    if (!be || in % be)
        return kvm_err(KVM_ENOTSUP, "weights of type %s with rows of %lld cannot be dequantised",
                       kvm_ggml_type_name(w->type), (long long)in);
    return kvm_ggml_dequantize(w->type, w->data + r0 * (in / be) * bb, dst, n * in);
}

void kvm_model_embed(const kvm_model *m, int32_t id, float *dst)
{
    kvm_model_mat_rows(&m->tok_emb, m->cfg.dim, id, 1, dst); /* the loader checked the type */
}

int kvm_model_weight_dtype_parse(const char *s, kvm_model_weight_dtype *out)
{
    static const struct {
        const char *name;
        kvm_model_weight_dtype d;
    } names[] = {{"auto", KVM_MODEL_WEIGHTS_AUTO},
                 {"f32", KVM_MODEL_WEIGHTS_F32},
                 {"bf16", KVM_MODEL_WEIGHTS_BF16},
                 {"f16", KVM_MODEL_WEIGHTS_F16}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].d;
            return 0;
        }
    return kvm_err(KVM_EINVAL, "weight_dtype '%s': expected auto, f32, bf16 or f16", s);
}

const char *kvm_model_weight_dtype_name(kvm_weight_dtype d)
{
    return d == KVM_WEIGHT_BF16 ? "bf16" : d == KVM_WEIGHT_F16 ? "f16" : "f32";
}

kvm_weight_dtype kvm_model_weight_dtype_for(const kvm_mat *w, kvm_model_weight_dtype d)
{
    if (d != KVM_MODEL_WEIGHTS_AUTO) return (kvm_weight_dtype)d;
    if (w->type == KVM_MAT_F32) return KVM_WEIGHT_F32;
    if (w->type == KVM_MAT_BF16) return KVM_WEIGHT_BF16;
    return KVM_WEIGHT_F16; /* F16 kept; GGUF blocks (d·q + m with f16 d, m) keep 11 significant bits */
}

int kvm_model_set_weight_dtype(kvm_model *m, kvm_model_weight_dtype d)
{
    if (m->prepared && m->weight_dtype != (int)d)
        return kvm_err(KVM_ESTATE, "%s: weights already prepared; weight_dtype cannot change", m->path);
    m->weight_dtype = d;
    return 0;
}

/* Rows of one matrix for weight_new_rows. */
typedef struct mat_src {
    const kvm_mat *w;
    int64_t in;
} mat_src;

static int mat_rows_cb(void *ctx, int64_t r0, int64_t n, float *dst)
{
    const mat_src *s = ctx;
    return kvm_model_mat_rows(s->w, s->in, r0, n, dst);
}

/* Gives back the pages of w's bytes: clean file pages that a later read faults back in.
 * Done per matrix so memory holds the prepared weights plus one matrix being read. */
static void release_pages(const kvm_mat *w, int64_t out, int64_t in)
{
    int64_t be = kvm_ggml_block_elems(w->type), bb = kvm_ggml_block_bytes(w->type);
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)w->data,
              b = (uintptr_t)(w->data + out * (in / be) * bb);
    uintptr_t lo = (a + page - 1) & ~(page - 1), hi = b & ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* One matrix into the backend: row blocks straight from the file where the backend can take
 * them, else one float32 copy of this matrix only. name is for messages. */
static int prepare_one(const kvm_model *m, const kvm_kernels *k, const kvm_mat *w, int64_t out, int64_t in,
                       const char *name, kvm_weight **kwo)
{
    kvm_weight *kw = NULL;
    mat_src src = {w, in};
    int rc = 0;
    if (k->weight_new_rows) {
        kvm_weight_dtype d = kvm_model_weight_dtype_for(w, (kvm_model_weight_dtype)m->weight_dtype);
        rc = k->weight_new_rows(mat_rows_cb, &src, out, in, d, &kw);
        if (rc == KVM_ERANGE && m->weight_dtype == KVM_MODEL_WEIGHTS_AUTO) /* auto: bf16 has float32's range */
            rc = k->weight_new_rows(mat_rows_cb, &src, out, in, KVM_WEIGHT_BF16, &kw);
    } else {
        float *tmp = malloc((size_t)(out * in > 0 ? out * in : 1) * sizeof *tmp);
        if (!tmp) rc = kvm_err(KVM_ENOMEM, "out of memory");
        else if (!(rc = mat_rows_cb(&src, 0, out, tmp)) && !(kw = k->weight_new(tmp, out, in))) rc = KVM_ENOMEM;
        free(tmp);
    }
    if (rc) {
        kvm_err(rc, "%s: preparing %s [%lld][%lld]: %s", m->path, name, (long long)out, (long long)in, kvm_errmsg());
        return rc;
    }
    *kwo = kw;
    release_pages(w, out, in);
    return 0;
}

int kvm_model_prepare(const kvm_model *cm, const kvm_kernels *k, const kvm_prepared **out)
{
    kvm_model *m = (kvm_model *)cm; /* the cache is logically const */
    if (m->prepared) {
        if (m->prepared->k != k)
            return kvm_err(KVM_ESTATE, "%s: weights already prepared for backend %s, not %s", m->path,
                           m->prepared->k->name, k->name);
        *out = m->prepared;
        return 0;
    }
    const kvm_model_config *c = &m->cfg;
    kvm_prepared *p = calloc(1, sizeof *p);
    if (!p || !(p->layers = calloc((size_t)c->n_layers, sizeof *p->layers))) {
        free(p);
        return kvm_err(KVM_ENOMEM, "%s: out of memory preparing weights", m->path);
    }
    p->k = k;
    int64_t qd = (int64_t)c->n_heads * c->head_dim, kvd = (int64_t)c->n_kv_heads * c->head_dim;
    int rc = 0;
    for (int l = 0; !rc && l < c->n_layers; l++) {
        const kvm_layer_weights *w = &m->layers[l];
        kvm_prepared_layer *L = &p->layers[l];
        char n[7][48];
        const char *parts[7] = {"wq", "wk", "wv", "wo", "w1 (gate)", "w2 (down)", "w3 (up)"};
        for (int i = 0; i < 7; i++) snprintf(n[i], sizeof n[i], "layer %d %s", l, parts[i]);
        (void)((rc = prepare_one(m, k, &w->wq, qd, c->dim, n[0], &L->wq)) ||
               (rc = prepare_one(m, k, &w->wk, kvd, c->dim, n[1], &L->wk)) ||
               (rc = prepare_one(m, k, &w->wv, kvd, c->dim, n[2], &L->wv)) ||
               (rc = prepare_one(m, k, &w->wo, c->dim, qd, n[3], &L->wo)) ||
               (rc = prepare_one(m, k, &w->w1, c->hidden_dim, c->dim, n[4], &L->w1)) ||
               (rc = prepare_one(m, k, &w->w2, c->dim, c->hidden_dim, n[5], &L->w2)) ||
               (rc = prepare_one(m, k, &w->w3, c->hidden_dim, c->dim, n[6], &L->w3)));
    }
    if (!rc) rc = prepare_one(m, k, &m->wcls, c->vocab_size, c->dim, "classifier", &p->wcls);
    if (rc) {
        prepared_free(&p, c->n_layers);
        return rc;
    }
    m->prepared = p;
    *out = p;
    return 0;
}

void kvm_model_close(kvm_model **pm)
{
    if (!pm || !*pm) return;
    kvm_model *m = *pm;
    prepared_free(&m->prepared, m->cfg.n_layers);
    if (m->map) munmap(m->map, m->map_bytes);
    if (m->owned_bytes) munmap(m->owned, m->owned_bytes);
    else free(m->owned);
    kvm_st_close(&m->st);
    free(m->layers);
    free(m->path);
    free(m);
    *pm = NULL;
}

int kvm_model_is_eos(const kvm_model_config *c, int32_t id)
{
    if (c->n_eos == 0) return id == c->eos_id;
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == id) return 1;
    return 0;
}

/* One RoPE frequency after llama3 scaling (transformers' _compute_llama3_parameters, in
 * float32 as torch computes it). */
static float llama3_freq(const kvm_rope_scaling *s, float f)
{
    const float pi = 3.14159265358979323846f;
    float low_wl = (float)s->original_max / s->low_freq_factor, high_wl = (float)s->original_max / s->high_freq_factor;
    float wl = 2 * pi / f;
    float scaled = wl > low_wl ? f / s->factor : f;
    if (wl < high_wl || wl > low_wl) return scaled;
    float smooth = ((float)s->original_max / wl - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
    return (1 - smooth) * scaled / s->factor + smooth * scaled;
}

void kvm_model_rope_table(const kvm_model_config *c, const int32_t *pos, int64_t n, float *cos_t, float *sin_t)
{
    if (c->rope_scaling.type == 0) {
        kvm_rope_table(pos, n, c->head_dim, c->rope_theta, cos_t, sin_t);
        return;
    }
    const int half = c->head_dim / 2;
    for (int i = 0; i < half; i++) {
        float freq = llama3_freq(&c->rope_scaling, 1.0f / powf(c->rope_theta, (float)(2 * i) / (float)c->head_dim));
        for (int64_t r = 0; r < n; r++) {
            float angle = (float)pos[r] * freq;
            cos_t[r * half + i] = cosf(angle);
            sin_t[r * half + i] = sinf(angle);
        }
    }
}

int64_t kvm_model_n_params(const kvm_model *m)
{
    const kvm_model_config *c = &m->cfg;
    int64_t kv_dim = (int64_t)c->n_kv_heads * c->head_dim, q_dim = (int64_t)c->n_heads * c->head_dim;
    int64_t per_layer = 2 * (int64_t)c->dim + q_dim * c->dim * 2 + kv_dim * c->dim * 2 +
                        3 * (int64_t)c->hidden_dim * c->dim;
    if (c->attn_bias) per_layer += q_dim + 2 * kv_dim + (m->layers && m->layers[0].bo ? c->dim : 0);
    if (c->qk_norm) per_layer += 2 * (int64_t)c->head_dim;
    int64_t n = (int64_t)c->vocab_size * c->dim + per_layer * c->n_layers + c->dim;
    if (!c->shared_classifier) n += (int64_t)c->vocab_size * c->dim;
    return n;
}

int64_t kvm_model_kv_bytes(const kvm_model_config *c, int64_t n_tokens)
{
    return 2 * (int64_t)c->n_layers * c->n_kv_heads * n_tokens * c->head_dim * (int64_t)sizeof(float);
}
