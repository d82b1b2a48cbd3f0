/* kvm_hf_model.c: a Hugging Face folder as a kvm_model: config.json (kvm_hf_config.c), then
 * every safetensors tensor matched by name and shape against the architecture. Matrices stay
 * in the files' mappings in their dtype (m->st; kvm_model_prepare reads them row block by row
 * block), vectors are converted to float32 into m->owned. Weight matrices are stored [out][in]
 * row-major in safetensors, which is kvmill's layout; RoPE is the half-split one. */
#include "model/kvm_hf.h"
#include "model/kvm_model.h"
#include "model/kvm_safetensors.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int kvm_hf_is_folder(const char *path)
{
    struct stat st;
    char p[4096];
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) return 0;
    snprintf(p, sizeof p, "%s/config.json", path);
    return lstat(p, &st) == 0; /* whatever it is: kvm__hf_load says what is wrong with it */
}

/* Loading state: the set, which tensors were used, where floats go. */
typedef struct hf_load {
    const char *dir; /* the folder, for messages */
    const kvm_st *st;
    char *used; /* [n_tensors] 1 once claimed */
    float *at;  /* next free float of the buffer (NULL while counting) */
    int64_t n_floats;
} hf_load;

static int st_mat_type(kvm_st_dtype d) { return d == KVM_ST_BF16 ? KVM_MAT_BF16 : d == KVM_ST_F16 ? KVM_MAT_F16 : KVM_MAT_F32; }

/* "[d0, d1, ...]" of n dims ("[]": a scalar) into buf[size]. */
static void shape_str(const int64_t *d, int n, char *buf, size_t size)
{
    size_t at = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < n && at < size; i++)
        at += (size_t)snprintf(buf + at, size - at, "%s%lld", i ? ", " : "", (long long)d[i]);
    if (at < size) snprintf(buf + at, size - at, "]");
}

/* Claims tensor `name` of shape [d0] (d1 == 0) or [d0][d1]. A vector is converted to float32
 * at L->at into *vec (counted only while L->at is NULL); a matrix (mat != NULL) stays in its
 * file's mapping. The converting pass rejects a NaN or infinity (KVM_EFORMAT naming the file,
 * tensor and element). */
static int take(hf_load *L, const char *name, int64_t d0, int64_t d1, const float **vec, kvm_mat *mat)
{
    const kvm_st_tensor *t = kvm_st_find(L->st, name);
    if (!t && kvm_st_n_files(L->st) > 1) /* not "shard 1 lacks it": no shard has it */
        return kvm_err(KVM_EFORMAT,
                       "%s: tensor '%s' is missing (in none of the %d files model.safetensors.index.json "
                       "lists)",
                       L->dir, name, kvm_st_n_files(L->st));
    if (!t) return kvm_err(KVM_EFORMAT, "%s: tensor '%s' is missing", kvm_st_file_path(L->st, 0), name);
    const char *f = kvm_st_file_path(L->st, t->file);
    int want = d1 ? 2 : 1;
    if (t->n_dims != want || t->shape[0] != d0 || (d1 && t->shape[1] != d1)) {
        char have[96], need[64];
        int64_t dims[2] = {d0, d1};
        shape_str(t->shape, t->n_dims, have, sizeof have);
        shape_str(dims, want, need, sizeof need);
        return kvm_err(KVM_EFORMAT, "%s: tensor '%s' has shape %s, the config needs %s", f, name, have, need);
    }
    L->used[t - kvm_st_tensor_at(L->st, 0)] = 1;
    if (!L->at) { /* the counting pass; the second one checks, once */
        if (mat)
            *mat = (kvm_mat){t->data, st_mat_type(t->dtype)};
        else
            L->n_floats += t->n_elems;
        return 0;
    }
    int rc = kvm__model_check_finite(f, name, st_mat_type(t->dtype), t->data, t->n_elems);
    if (rc || mat) {
        if (mat && !rc) *mat = (kvm_mat){t->data, st_mat_type(t->dtype)};
        return rc;
    }
    kvm_st_to_f32(t->dtype, t->data, L->at, t->n_elems);
    kvm_st_release(L->st, t);
    *vec = L->at;
    L->at += t->n_elems;
    return 0;
}

static int take_layer(hf_load *L, const kvm_model_config *c, int o_bias, int l, kvm_layer_weights *w)
{
    int64_t D = c->dim, H = c->hidden_dim, Q = (int64_t)c->n_heads * c->head_dim,
            KV = (int64_t)c->n_kv_heads * c->head_dim;
    struct {
        const char *part;
        int64_t d0, d1;
        const float **vec;
        kvm_mat *mat;
        int on;
    } parts[] = {
        {"input_layernorm.weight", D, 0, &w->rms_att, NULL, 1},
        {"self_attn.q_proj.weight", Q, D, NULL, &w->wq, 1},
        {"self_attn.k_proj.weight", KV, D, NULL, &w->wk, 1},
        {"self_attn.v_proj.weight", KV, D, NULL, &w->wv, 1},
        {"self_attn.o_proj.weight", D, Q, NULL, &w->wo, 1},
        {"self_attn.q_proj.bias", Q, 0, &w->bq, NULL, c->attn_bias},
        {"self_attn.k_proj.bias", KV, 0, &w->bk, NULL, c->attn_bias},
        {"self_attn.v_proj.bias", KV, 0, &w->bv, NULL, c->attn_bias},
        {"self_attn.o_proj.bias", D, 0, &w->bo, NULL, o_bias},
        {"self_attn.q_norm.weight", c->head_dim, 0, &w->q_norm, NULL, c->qk_norm},
        {"self_attn.k_norm.weight", c->head_dim, 0, &w->k_norm, NULL, c->qk_norm},
        {"post_attention_layernorm.weight", D, 0, &w->rms_ffn, NULL, 1},
        {"mlp.gate_proj.weight", H, D, NULL, &w->w1, 1},
        {"mlp.down_proj.weight", D, H, NULL, &w->w2, 1},
        {"mlp.up_proj.weight", H, D, NULL, &w->w3, 1},
    };
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (!parts[i].on) continue;
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.%s", l, parts[i].part);
        int rc = take(L, name, parts[i].d0, parts[i].d1, parts[i].vec, parts[i].mat);
        if (rc) return rc;
    }
    return 0;
}

/* 1 when the two tensors hold the same values (after conversion to float32). */
static int same_values(const kvm_st_tensor *a, const kvm_st_tensor *b)
{
    if (a->n_elems != b->n_elems) return 0;
    if (a->dtype == b->dtype) return memcmp(a->data, b->data, a->bytes) == 0;
    for (int64_t i = 0; i < a->n_elems; i++) {
        float x, y;
        kvm_st_to_f32(a->dtype, a->data + i * kvm_st_dtype_size(a->dtype), &x, 1);
        kvm_st_to_f32(b->dtype, b->data + i * kvm_st_dtype_size(b->dtype), &y, 1);
        if (x != y) return 0;
    }
    return 1;
}

/* Every tensor not claimed must be one the loader ignores by rule, else it is an error. */
static int check_leftovers(const hf_load *L, int tied)
{
    for (int64_t i = 0; i < kvm_st_n_tensors(L->st); i++) {
        if (L->used[i]) continue;
        const kvm_st_tensor *t = kvm_st_tensor_at(L->st, i);
        const char *f = kvm_st_file_path(L->st, t->file);
        size_t n = strlen(t->name), sl = strlen(".rotary_emb.inv_freq");
        if (n > sl && strcmp(t->name + n - sl, ".rotary_emb.inv_freq") == 0) continue;
        if (tied && strcmp(t->name, "lm_head.weight") == 0) {
            const kvm_st_tensor *e = kvm_st_find(L->st, "model.embed_tokens.weight");
            if (e && t->n_dims == 2 && t->shape[0] == e->shape[0] && t->shape[1] == e->shape[1] && same_values(t, e))
                continue;
            return kvm_err(KVM_EFORMAT, "%s: tensor 'lm_head.weight' differs from the tied 'model.embed_tokens.weight' "
                                        "(tie_word_embeddings is true)", f);
        }
        return kvm_err(KVM_EFORMAT, "%s: tensor '%s' is not part of the architecture", f, t->name);
    }
    return 0;
}

/* One pass over the tensors: counting (L->at NULL) or converting. */
static int take_all(hf_load *L, kvm_model *m, int o_bias)
{
    const kvm_model_config *c = &m->cfg;
    int64_t V = c->vocab_size, D = c->dim;
    int rc;
    if ((rc = take(L, "model.embed_tokens.weight", V, D, NULL, &m->tok_emb)) ||
        (rc = take(L, "model.norm.weight", D, 0, &m->rms_final, NULL)))
        return rc;
    if (!c->shared_classifier && (rc = take(L, "lm_head.weight", V, D, NULL, &m->wcls))) {
        if (!kvm_st_find(L->st, "lm_head.weight"))
            kvm_err(rc, "%s (tie_word_embeddings is false: a model that shares model.embed_tokens.weight sets it true)",
                    kvm_errmsg());
        return rc;
    }
    for (int l = 0; l < c->n_layers; l++)
        if ((rc = take_layer(L, c, o_bias, l, &m->layers[l]))) return rc;
    if (c->shared_classifier) m->wcls = m->tok_emb;
    return 0;
}

/* The weight dtype of the folder: the common one, or "mixed". */
static void note_dtype(kvm_model *m, const kvm_st *st)
{
    const kvm_st_tensor *t0 = kvm_st_tensor_at(st, 0);
    snprintf(m->dtype, sizeof m->dtype, "%s", kvm_st_dtype_name(t0->dtype));
    for (int64_t i = 1; i < kvm_st_n_tensors(st); i++)
        if (kvm_st_tensor_at(st, i)->dtype != t0->dtype) snprintf(m->dtype, sizeof m->dtype, "mixed");
}

int kvm__hf_load(kvm_model *m, const char *dir)
{
    char cpath[4096];
    snprintf(cpath, sizeof cpath, "%s/config.json", dir);
    int tied = 0, o_bias = 0;
    int rc = kvm_file_check_found(cpath); /* a broken link or a FIFO, not a JSON syntax error (or a hang) */
    if (!rc) rc = kvm__hf_config(cpath, &m->cfg, m->arch, sizeof m->arch, &tied, &o_bias);
    if (rc) return rc;
    kvm_st *st = NULL;
    hf_load L = {0};
    float *buf = NULL;
    if ((rc = kvm_st_open_dir(dir, &st))) return rc;
    L.st = st;
    L.dir = dir;
    m->layers = calloc((size_t)m->cfg.n_layers, sizeof *m->layers);
    L.used = calloc((size_t)kvm_st_n_tensors(st) + 1, 1);
    if (!m->layers || !L.used) goto nomem;
    if ((rc = take_all(&L, m, o_bias)) || (rc = check_leftovers(&L, tied))) goto fail;
    if (!(buf = kvm__model_alloc_weights(m, L.n_floats))) goto nomem; /* m->owned, unmapped by kvm_model_close */
    L.at = buf;
    if ((rc = take_all(&L, m, o_bias))) goto fail;
    snprintf(m->format, sizeof m->format, "hf");
    note_dtype(m, st);
    free(L.used);
    m->st = st; /* the matrices' bytes: closed by kvm_model_close */
    return 0;
nomem:
    rc = kvm_err(KVM_ENOMEM, "%s: out of memory for the vector weights (%lld floats)", dir, (long long)L.n_floats);
fail:
    free(L.used);
    free(m->layers);
    m->layers = NULL;
    m->tok_emb = m->wcls = (kvm_mat){0};
    m->rms_final = NULL;
    kvm_st_close(&st);
    return rc;
}

int kvm_hf_model_files(const char *dir, char ***paths, int *n)
{
    *paths = NULL;
    *n = 0;
    kvm_st *st = NULL;
    char cpath[4096];
    snprintf(cpath, sizeof cpath, "%s/config.json", dir);
    int rc = kvm_file_check_found(cpath); /* hashing a FIFO would block */
    if (!rc) rc = kvm_st_open_dir(dir, &st);
    if (rc) return rc;
    int nf = kvm_st_n_files(st);
    char **p = calloc((size_t)nf + 1, sizeof *p);
    size_t l = strlen(dir) + 16;
    if (p && (p[0] = malloc(l))) snprintf(p[0], l, "%s/config.json", dir);
    for (int i = 0; p && p[0] && i < nf; i++)
        if (!(p[i + 1] = strdup(kvm_st_file_path(st, i)))) break;
    kvm_st_close(&st);
    if (!p || !p[nf]) {
        for (int i = 0; p && i <= nf; i++)
            free(p[i]);
        free(p);
        return kvm_err(KVM_ENOMEM, "%s: out of memory", dir);
    }
    *paths = p;
    *n = nf + 1;
    return 0;
}
