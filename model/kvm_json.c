/* kvm_json.c: jansson loads with a leading UTF-8 byte-order mark skipped (kvm_json.h). */
#include "model/kvm_json.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static const char bom[3] = {'\xEF', '\xBB', '\xBF'};

json_t *kvm__json_load_file(const char *path, size_t flags, json_error_t *je)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        *je = (json_error_t){.line = -1, .column = -1, .position = 0};
        snprintf(je->text, sizeof je->text, "unable to open %s: %s", path, strerror(errno));
        snprintf(je->source, sizeof je->source, "%s", path);
        return NULL;
    }
    char head[3];
    size_t n = fread(head, 1, sizeof head, fp);
    if (n != sizeof head || memcmp(head, bom, sizeof bom) != 0) rewind(fp); /* no mark: parse from byte 0 */
    json_t *root = json_loadf(fp, flags, je);
    fclose(fp);
    return root;
}

json_t *kvm__json_loadb(const char *buf, size_t len, size_t flags, json_error_t *je)
{
    if (len >= sizeof bom && memcmp(buf, bom, sizeof bom) == 0) buf += sizeof bom, len -= sizeof bom;
    return json_loadb(buf, len, flags, je);
}
