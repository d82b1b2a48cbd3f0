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

/* 1 with je filled when b[0, n) is a Git LFS pointer: a clone of a Hugging Face repository made
 * without git-lfs holds those in place of tokenizer.json and the weights, and jansson said only
 * "'[' or '{' expected". */
static int lfs_pointer(const char *b, size_t n, const char *source, json_error_t *je)
{
    static const char lfs[] = "version https://git-lfs";
    if (n < sizeof lfs - 1 || memcmp(b, lfs, sizeof lfs - 1)) return 0;
    *je = (json_error_t){.line = 1, .column = 1, .position = 0};
    snprintf(je->text, sizeof je->text,
             "a Git LFS pointer, not the file itself: fetch the real files (git lfs pull in the clone, or download "
             "them again)");
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
    char head[32];
    size_t n = fread(head, 1, sizeof head, fp);
    if (utf16((const unsigned char *)head, n, path, je) || lfs_pointer(head, n, path, je)) {
        fclose(fp);
        return NULL;
    }
    /* parse from byte 0, or past a UTF-8 mark */
    if (fseek(fp, n >= sizeof bom && memcmp(head, bom, sizeof bom) == 0 ? (long)sizeof bom : 0L, SEEK_SET)) {
        *je = (json_error_t){.line = -1, .column = -1, .position = 0};
        snprintf(je->text, sizeof je->text, "cannot read %s: %s", path, strerror(errno));
        snprintf(je->source, sizeof je->source, "%s", path);
        fclose(fp);
        return NULL;
    }
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
