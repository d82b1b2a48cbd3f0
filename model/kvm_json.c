/* kvm_json.c: jansson loads with a leading UTF-8 byte-order mark skipped (kvm_json.h). */
#include "model/kvm_json.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static const char bom[3] = {'\xEF', '\xBB', '\xBF'};

/* 1 with je filled when b[0, n) starts with a UTF-16 (or UTF-32) byte-order mark, FF FE or
 * FE FF: jansson would say "unable to decode byte 0xff", naming no cause (the INI loader's
 * check_bom says the same as this). */
static int utf16(const unsigned char *b, size_t n, const char *source, json_error_t *je)
{
    if (n < 2 || !((b[0] == 0xFF && b[1] == 0xFE) || (b[0] == 0xFE && b[1] == 0xFF))) return 0;
    *je = (json_error_t){.line = 1, .column = 1, .position = 0};
    snprintf(je->text, sizeof je->text,
             "starts with a UTF-16 byte-order mark (%02X %02X): a JSON file is UTF-8 text (save it as UTF-8)", b[0],
             b[1]);
    snprintf(je->source, sizeof je->source, "%s", source);
    return 1;
}

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
    if (utf16((const unsigned char *)head, n, path, je)) {
        fclose(fp);
        return NULL;
    }
    if (n != sizeof head || memcmp(head, bom, sizeof bom) != 0) rewind(fp); /* no mark: parse from byte 0 */
    json_t *root = json_loadf(fp, flags, je);
    fclose(fp);
    return root;
}

json_t *kvm__json_loadb(const char *buf, size_t len, size_t flags, json_error_t *je)
{
    if (utf16((const unsigned char *)buf, len, "<buffer>", je)) return NULL;
    if (len >= sizeof bom && memcmp(buf, bom, sizeof bom) == 0) buf += sizeof bom, len -= sizeof bom;
    return json_loadb(buf, len, flags, je);
}
