/* kvm_log.c: text or JSON log lines on stderr (kvm_log.h). JSON objects are built with
 * libjansson, which escapes every string (messages quote untrusted names and bytes). */
#include "common/kvm_log.h"
#include "common/kvm_error.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Process-wide like stderr: written once by kvm_log_setup in main, read-only afterwards. */
static struct {
    kvm_log_format format;
    char stage[64];
    char prefix[320];
} kvm_log__g = {KVM_LOG_TEXT, "kvmill", ""};

static const char *const kvm_log__levels[] = {"debug", "info", "warn", "error"};

int kvm_log_format_parse(const char *name, kvm_log_format *out)
{
    if (name && !strcmp(name, "text")) *out = KVM_LOG_TEXT;
    else if (name && !strcmp(name, "json")) *out = KVM_LOG_JSON;
    else return kvm_err(KVM_EINVAL, "log format '%s': expected text or json", name ? name : "(null)");
    return 0;
}

int kvm_log_setup(const char *stage, const char *text_prefix, const char *format)
{
    snprintf(kvm_log__g.stage, sizeof kvm_log__g.stage, "%s", stage ? stage : "kvmill");
    snprintf(kvm_log__g.prefix, sizeof kvm_log__g.prefix, "%s", text_prefix ? text_prefix : "");
    const char *f = format ? format : getenv("KVMILL_LOG_FORMAT");
    kvm_log__g.format = KVM_LOG_TEXT;
    if (!f || !*f) return 0;
    int rc = kvm_log_format_parse(f, &kvm_log__g.format);
    if (rc) kvm_log__g.format = KVM_LOG_TEXT;
    return rc;
}

kvm_log_format kvm_log_format_get(void) { return kvm_log__g.format; }

/* "2026-12-01T12:00:00.123Z" */
static void kvm_log__time(char *buf, size_t n)
{
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    size_t k = strftime(buf, n, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + k, n - k, ".%03ldZ", ts.tv_nsec / 1000000L);
}

/* Length of the well-formed UTF-8 sequence at p[0, n) (RFC 3629: no overlongs, surrogates or
 * code points past U+10FFFF), or 0 when the bytes there do not form one. */
static size_t kvm_log__utf8_len(const unsigned char *p, size_t n)
{
    unsigned c = p[0];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || len > n || (len == 2 && c < 0xC2) || (len == 4 && c > 0xF4)) return 0;
    for (size_t i = 1; i < len; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    if (len == 3 && ((c == 0xE0 && p[1] < 0xA0) || (c == 0xED && p[1] >= 0xA0))) return 0;
    if (len == 4 && ((c == 0xF0 && p[1] < 0x90) || (c == 0xF4 && p[1] >= 0x90))) return 0;
    return len;
}

/* A JSON string of s[0, n), each byte that is not part of a UTF-8 character (a path or a name
 * in latin-1, say) replaced by U+FFFD, so the rest of the message survives. NULL when out of
 * memory. */
static json_t *kvm_log__string(const char *s, size_t n)
{
    json_t *j = json_stringn(s, n);
    if (j) return j;
    char *t = malloc(3 * n + 1);
    if (!t) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t len = kvm_log__utf8_len((const unsigned char *)s + i, n - i);
        if (len == 0 || (len == 1 && s[i] == '\0')) {
            memcpy(t + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        } else {
            memcpy(t + o, s + i, len);
            o += len;
            i += len;
        }
    }
    j = json_stringn(t, o);
    free(t);
    return j;
}

static json_t *kvm_log__value(const kvm_log_field *f)
{
    if (f->kind == 'i') return json_integer((json_int_t)f->i);
    if (f->kind == 'f') return isfinite(f->f) ? json_real(f->f) : json_null();
    json_t *s = f->s ? json_string(f->s) : NULL; /* NULL also for bytes that are not UTF-8 */
    return s ? s : json_null();
}

char *kvm_log_escape(const char *s, int keep_lines, char *out, size_t out_size)
{
    size_t k = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        /* U+0080-U+009F (C1 controls, UTF-8 0xc2 0x80-0x9f: U+009B is a CSI to some terminals) */
        const int c1 = p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f;
        int raw = !c1 && ((*p >= 0x20 && *p != 0x7f) || (keep_lines && (*p == '\n' || *p == '\t')));
        if (k + (raw ? 1 : c1 ? 8 : 4) >= out_size) break;
        if (raw)
            out[k++] = (char)*p;
        else if (c1)
            k += (size_t)snprintf(out + k, out_size - k, "\\x%02x\\x%02x", p[0], p[1]), p++;
        else
            k += (size_t)snprintf(out + k, out_size - k, "\\x%02x", *p);
    }
    out[k] = '\0';
    return out;
}

void kvm_logv(kvm_log_level level, const char *event, const kvm_log_field *fields, int n_fields, const char *fmt, va_list ap)
{
    char msg[8192];
    vsnprintf(msg, sizeof msg, fmt, ap);
    const char *m = msg;
    if (kvm_log__g.format == KVM_LOG_TEXT) {
        if (*m == '\n') fputc(*m++, stderr);
        /* messages quote untrusted names (a corpus file's, a JSONL id): a terminal escape, a
         * carriage return or another control byte in one went to the terminal raw (coloured or
         * rewrote the lines shown); written as \xHH, as store ls shows names. Newlines and tabs
         * stay: some messages hold several lines. */
        char safe[4 * sizeof msg + 1];
        kvm_log_escape(m, 1, safe, sizeof safe);
        size_t k = strlen(safe);
        fprintf(stderr, "%s%s%s", kvm_log__g.prefix, safe, k && safe[k - 1] == '\n' ? "" : "\n");
        return;
    }
    while (*m == '\n') m++;
    size_t len = strlen(m);
    while (len && m[len - 1] == '\n') len--;
    char when[40];
    kvm_log__time(when, sizeof when);
    json_t *o = json_object();
    if (!o) return;
    json_object_set_new(o, "time", json_string(when));
    json_object_set_new(o, "stage", json_string(kvm_log__g.stage));
    json_object_set_new(o, "pid", json_integer((json_int_t)getpid()));
    json_object_set_new(o, "level", json_string(kvm_log__levels[level >= 0 && level <= KVM_LOG_ERROR ? level : 1]));
    json_object_set_new(o, "event", json_string(event ? event : "message"));
    json_t *js = kvm_log__string(m, len);
    json_object_set_new(o, "msg", js ? js : json_string("(out of memory)"));
    for (int i = 0; i < n_fields; i++)
        if (fields[i].key) json_object_set_new(o, fields[i].key, kvm_log__value(&fields[i]));
    char *line = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!line) return;
    size_t n = strlen(line);
    line[n] = '\n'; /* one write per line, so lines of threads and processes do not interleave */
    fwrite(line, 1, n + 1, stderr);
    line[n] = '\0';
    free(line);
}

void kvm_log(kvm_log_level level, const char *event, const kvm_log_field *fields, int n_fields, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvm_logv(level, event, fields, n_fields, fmt, ap);
    va_end(ap);
}
