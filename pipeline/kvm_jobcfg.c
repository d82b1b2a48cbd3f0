/* kvm_jobcfg.c: job settings as a MessagePack map (msgpack-c) and the config id. */
#include "pipeline/kvm_jobcfg.h"
#include "common/kvm_error.h"

#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

static int carried(const kvm_cfg_setting *s)
{
    return !strcmp(s->section, "model") || !strcmp(s->section, "compress") || !strcmp(s->section, "eval") ||
           !strcmp(s->section, "calibrate") ||
           (!strcmp(s->section, "store") && !strcmp(s->key, "dtype"));
}

int kvm_jobcfg_pack(const kvm_config *c, uint8_t **mp, size_t *n)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    uint32_t count = 0;
    for (int i = 0; kvm_cfg_settings[i].section; i++) count += (uint32_t)carried(&kvm_cfg_settings[i]);
    msgpack_pack_map(&pk, count);
    char key[256];
    for (int i = 0; kvm_cfg_settings[i].section; i++) {
        const kvm_cfg_setting *s = &kvm_cfg_settings[i];
        if (!carried(s)) continue;
        snprintf(key, sizeof key, "%s.%s", s->section, s->key);
        const char *v = kvm_config_str(c, s->section, s->key); /* the resolved text, any type */
        msgpack_pack_str(&pk, strlen(key));
        msgpack_pack_str_body(&pk, key, strlen(key));
        msgpack_pack_str(&pk, strlen(v));
        msgpack_pack_str_body(&pk, v, strlen(v));
    }
    if (!sb.data) return kvm_err(KVM_ENOMEM, "job settings: out of memory");
    *mp = (uint8_t *)sb.data; /* sbuffer memory is malloc'ed: the caller frees it */
    *n = sb.size;
    return 0;
}

int kvm_jobcfg_unpack(const uint8_t *mp, size_t n, kvm_config **out)
{
    *out = NULL;
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int rc = 0;
    if (msgpack_unpack_next(&u, (const char *)mp, n, &off) != MSGPACK_UNPACK_SUCCESS || u.data.type != MSGPACK_OBJECT_MAP) {
        msgpack_unpacked_destroy(&u);
        return kvm_err(KVM_EPROTO, "job settings: not a MessagePack map");
    }
    const msgpack_object_map *m = &u.data.via.map;
    const char *path = NULL;
    char key[256], val[4096];
    for (uint32_t i = 0; i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key, *v = &m->ptr[i].val;
        if (k->type != MSGPACK_OBJECT_STR || v->type != MSGPACK_OBJECT_STR || k->via.str.size >= sizeof key ||
            v->via.str.size >= sizeof val) {
            rc = kvm_err(KVM_EPROTO, "job settings: entry %u is not a short string pair", i);
            break;
        }
        if (k->via.str.size == 10 && !memcmp(k->via.str.ptr, "model.path", 10)) path = v->via.str.ptr;
    }
    kvm_config *c = NULL;
    if (!rc) {
        char base[8192];
        int plen = 0;
        for (uint32_t i = 0; path && i < m->size; i++)
            if (m->ptr[i].val.via.str.ptr == path) plen = (int)m->ptr[i].val.via.str.size;
        snprintf(base, sizeof base, "[model]\npath = %.*s\n", plen, path ? path : "");
        if (!path) rc = kvm_err(KVM_EINVAL, "job settings: model.path missing");
        else rc = kvm_config_parse(base, "job settings", &c);
    }
    for (uint32_t i = 0; !rc && i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key, *v = &m->ptr[i].val;
        memcpy(key, k->via.str.ptr, k->via.str.size);
        key[k->via.str.size] = '\0';
        memcpy(val, v->via.str.ptr, v->via.str.size);
        val[v->via.str.size] = '\0';
        char *dot = strchr(key, '.');
        if (!dot) { rc = kvm_err(KVM_EINVAL, "job settings: key '%s' is not section.key", key); break; }
        *dot = '\0';
        rc = kvm_config_set(c, key, dot + 1, val);
    }
    msgpack_unpacked_destroy(&u);
    if (rc) kvm_config_free(&c);
    *out = c;
    return rc;
}

int kvm_jobcfg_config_id(const kvm_config *c, kvm_store_id *id, char **canonical, size_t *canonical_len)
{
    char *comp;
    size_t n;
    int rc = kvm_config_canonical(c, "compress", &comp, &n);
    if (rc) return rc;
    size_t cap = n + 256;
    char *text = malloc(cap);
    if (!text) { free(comp); return kvm_err(KVM_ENOMEM, "config id: out of memory"); }
    int k = snprintf(text, cap, "model.context=%lld\nstore.dtype=%s\n", (long long)kvm_config_int(c, "model", "context"),
                     kvm_config_str(c, "store", "dtype"));
    memcpy(text + k, comp, n);
    free(comp);
    size_t len = (size_t)k + n;
    kvm_store_hash_bytes(text, len, id);
    if (canonical) { *canonical = text; *canonical_len = len; }
    else free(text);
    return 0;
}
