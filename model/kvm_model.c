/* kvm_model.c: opening and closing model files; format detection and shared helpers. */
#include "model/kvm_model.h"
#include "common/kvm_error.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int map_file(const char *path, void **map, size_t *bytes)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return kvm_err(KVM_EIO, "%s: is a directory, not a model file", path);
    if (!S_ISREG(st.st_mode)) return kvm_err(KVM_EIO, "%s: not a regular file", path);
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

int kvm_model_open(const char *path, kvm_model **out)
{
    *out = NULL;
    kvm_model *m = calloc(1, sizeof *m);
    if (!m) return kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    int rc = KVM_ENOMEM;
    if (!(m->path = strdup(path))) goto fail;
    rc = map_file(path, &m->map, &m->map_bytes);
    if (rc) goto fail;
    rc = kvm__llama2c_load(m, m->map, m->map_bytes);
    if (rc) goto fail;
    *out = m;
    return 0;
fail:
    kvm_model_close(&m);
    return rc;
}

void kvm_model_close(kvm_model **pm)
{
    if (!pm || !*pm) return;
    kvm_model *m = *pm;
    if (m->map) munmap(m->map, m->map_bytes);
    free(m->owned);
    free(m->layers);
    free(m->path);
    free(m);
    *pm = NULL;
}

int64_t kvm_model_n_params(const kvm_model *m)
{
    const kvm_model_config *c = &m->cfg;
    int64_t kv_dim = (int64_t)c->n_kv_heads * c->head_dim, q_dim = (int64_t)c->n_heads * c->head_dim;
    int64_t per_layer = 2 * (int64_t)c->dim + q_dim * c->dim * 2 + kv_dim * c->dim * 2 +
                        3 * (int64_t)c->hidden_dim * c->dim;
    int64_t n = (int64_t)c->vocab_size * c->dim + per_layer * c->n_layers + c->dim;
    if (!c->shared_classifier) n += (int64_t)c->vocab_size * c->dim;
    return n;
}

int64_t kvm_model_kv_bytes(const kvm_model_config *c, int64_t n_tokens)
{
    return 2 * (int64_t)c->n_layers * c->n_kv_heads * n_tokens * c->head_dim * (int64_t)sizeof(float);
}
