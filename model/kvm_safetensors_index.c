/* kvm_safetensors_index.c: a Hugging Face folder's weight files: model.safetensors, or the
 * shards listed by model.safetensors.index.json, whose weight_map must agree with the
 * tensors the shards hold. */
#include "model/kvm_safetensors.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "model/kvm_json.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The distinct file names of weight_map, sorted, as full paths dir/name in *paths[*n]. */
static int index_files(const char *ipath, const char *dir, const json_t *wm, char ***paths, int *n)
{
    size_t cap = json_object_size(wm), k = 0;
    const char **names = calloc(cap ? cap : 1, sizeof *names);
    if (!names) return kvm_err(KVM_ENOMEM, "%s: out of memory", ipath);
    const char *key;
    json_t *v;
    int rc = 0;
    json_object_foreach((json_t *)wm, key, v)
    {
        const char *fn = json_string_value(v);
        if (!fn) {
            rc = kvm_err(KVM_EFORMAT, "%s: weight_map['%s'] is not a string", ipath, key);
            break;
        }
        if (!*fn || strchr(fn, '/') || strcmp(fn, ".") == 0 || strcmp(fn, "..") == 0) {
            rc = kvm_err(KVM_EFORMAT, "%s: weight_map['%s'] = '%s' is not a file name in the folder", ipath, key, fn);
            break;
        }
        names[k++] = fn;
    }
    qsort(names, k, sizeof *names, cmp_str);
    size_t u = 0;
    for (size_t i = 0; i < k; i++)
        if (i == 0 || strcmp(names[i], names[i - 1]) != 0) names[u++] = names[i];
    if (!rc && u == 0) rc = kvm_err(KVM_EFORMAT, "%s: weight_map is empty", ipath);
    if (!rc && u > KVM_ST_MAX_FILES)
        rc = kvm_err(KVM_EFORMAT, "%s: weight_map names %zu files (at most %d)", ipath, u, KVM_ST_MAX_FILES);
    char **p = rc ? NULL : calloc(u, sizeof *p);
    if (!rc && !p) rc = kvm_err(KVM_ENOMEM, "%s: out of memory", ipath);
    for (size_t i = 0; !rc && i < u; i++) {
        size_t l = strlen(dir) + strlen(names[i]) + 2;
        if (!(p[i] = malloc(l))) rc = kvm_err(KVM_ENOMEM, "%s: out of memory", ipath);
        else snprintf(p[i], l, "%s/%s", dir, names[i]);
    }
    free(names);
    if (rc) {
        for (size_t i = 0; p && i < u; i++)
            free(p[i]);
        free(p);
        return rc;
    }
    *paths = p;
    *n = (int)u;
    return 0;
}

/* Every weight_map entry names the file holding that tensor, and every tensor is listed. */
static int check_map(const char *ipath, const json_t *wm, const kvm_st *s)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)wm, key, v)
    {
        const kvm_st_tensor *t = kvm_st_find(s, key);
        if (!t) return kvm_err(KVM_EFORMAT, "%s: tensor '%s' is in weight_map but not in %s", ipath, key,
                               json_string_value(v));
        const char *fp = kvm_st_file_path(s, t->file), *base = strrchr(fp, '/');
        if (strcmp(base ? base + 1 : fp, json_string_value(v)) != 0)
            return kvm_err(KVM_EFORMAT, "%s: weight_map puts tensor '%s' in %s, but it is in %s", ipath, key,
                           json_string_value(v), fp);
    }
    if ((int64_t)json_object_size(wm) != kvm_st_n_tensors(s))
        for (int64_t i = 0; i < kvm_st_n_tensors(s); i++) {
            const kvm_st_tensor *t = kvm_st_tensor_at(s, i);
            if (!json_object_get(wm, t->name))
                return kvm_err(KVM_EFORMAT, "%s: tensor '%s' is not listed in %s's weight_map",
                               kvm_st_file_path(s, t->file), t->name, ipath);
        }
    return 0;
}

static int open_indexed(const char *dir, const char *ipath, kvm_st **out)
{
    json_error_t je;
    json_t *root = kvm__json_load_file(ipath, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kvm_err(KVM_EFORMAT, "%s: %s (line %d)", ipath, je.text, je.line);
    const json_t *wm = json_object_get(root, "weight_map");
    char **paths = NULL;
    int n = 0, rc;
    if (!json_is_object(wm)) rc = kvm_err(KVM_EFORMAT, "%s: 'weight_map' is missing or not an object", ipath);
    else rc = index_files(ipath, dir, wm, &paths, &n);
    if (!rc && (rc = kvm_st_open_files((const char *const *)paths, n, out)) == KVM_ENOTFOUND)
        rc = kvm_err(rc, "%s (a shard %s lists)", kvm_errmsg(), ipath); /* an unfinished or partial download */
    if (!rc && (rc = check_map(ipath, wm, *out))) kvm_st_close(out);
    for (int i = 0; i < n; i++)
        free(paths[i]);
    free(paths);
    json_decref(root);
    return rc;
}

/* An index found at ipath: refused when dir also holds model.safetensors. transformers' from_pretrained loads
 * model.safetensors first and kvmill loaded the shards; one of the two is stale (a re-saved or partly downloaded
 * checkpoint), and which one is not ours to guess. */
static int check_single_file_absent(const char *dir, const char *ipath)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    /* a broken link, a FIFO or a folder of that name is no file transformers would load: the index decides */
    if (kvm_file_check_found(path) != 0) return 0;
    return kvm_err(KVM_EFORMAT,
                   "%s: the folder holds both %s and %s (transformers loads model.safetensors, the shards are the "
                   "index's): remove the one that is stale",
                   dir, path, ipath);
}

int kvm_st_open_dir(const char *dir, kvm_st **out)
{
    *out = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    int rc = kvm_file_check_found(path); /* a FIFO would block json_load_file; a broken link is no absent index */
    if (rc == 0) return (rc = check_single_file_absent(dir, path)) ? rc : open_indexed(dir, path, out);
    if (rc != KVM_ENOTFOUND) return rc;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    rc = kvm_file_check_found(path);
    if (rc == KVM_ENOTFOUND) {
        struct stat st;
        snprintf(path, sizeof path, "%s/pytorch_model.bin", dir);
        int pt = stat(path, &st) == 0;
        snprintf(path, sizeof path, "%s/pytorch_model.bin.index.json", dir);
        pt |= stat(path, &st) == 0;
        return kvm_err(KVM_ENOTFOUND, "%s: no model.safetensors or model.safetensors.index.json in the folder%s", dir,
                       pt ? " (its pytorch_model.bin weights are PyTorch pickles, which kvmill does not read: "
                            "convert them to safetensors)"
                          : "");
    }
    if (rc) return rc;
    const char *p = path;
    return kvm_st_open_files(&p, 1, out);
}
