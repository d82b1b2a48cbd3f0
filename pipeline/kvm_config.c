/* kvm_config.c: INI parsing (libinih) against the settings table, ${VAR:-default}
 * expansion, per-type validation and the canonical encoding hashed into config ids. */
#include "pipeline/kvm_config.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

struct kvm_config {
    char *path;        /* file name for messages */
    int n;             /* settings in the table */
    char **value;      /* [n] resolved value, or NULL = default */
    char *first_error; /* first handler error, reported with inih's line number */
    const char *const *needed; /* sections whose required keys must be set; NULL = all */
};

static int n_settings(void)
{
    int n = 0;
    while (kvm_cfg_settings[n].section) n++;
    return n;
}

static int find(const char *section, const char *key)
{
    for (int i = 0; kvm_cfg_settings[i].section; i++)
        if (!strcmp(kvm_cfg_settings[i].section, section) && !strcmp(kvm_cfg_settings[i].key, key)) return i;
    return -1;
}

static int known_section(const char *section)
{
    for (int i = 0; kvm_cfg_settings[i].section; i++)
        if (!strcmp(kvm_cfg_settings[i].section, section)) return 1;
    return 0;
}

/* The sections other than `section` that have a key `key`, as "[compress]" or "[model] and
 * [store]", into buf ("" when none): a key put under the wrong header was "unknown key" alone. */
static void sections_with(const char *section, const char *key, char *buf, size_t n)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; kvm_cfg_settings[i].section && len < n; i++)
        if (strcmp(kvm_cfg_settings[i].section, section) && !strcmp(kvm_cfg_settings[i].key, key))
            len += (size_t)snprintf(buf + len, n - len, "%s[%s]", len ? " and " : "", kvm_cfg_settings[i].section);
}

/* ${...} may nest in a default (${A:-${B:-x}}) this deep: deeper is surely a mistake, and the
 * recursion stays bounded whatever a file holds. */
enum { EXPAND_MAX_DEPTH = 8 };

/* One value being expanded: the output so far and the first error. */
typedef struct expander {
    const char *value; /* the raw value, quoted in messages */
    char *out;         /* malloc'ed result, NUL-terminated at len */
    size_t len, cap;
    char *why;         /* error message (caller's buffer) */
    size_t why_n;
} expander;

static int expand_text(expander *e, const char **p, int depth, int emit);

/* Appends n bytes when emitting (a default not taken is only parsed, not written). */
static int expand_put(expander *e, const char *s, size_t n, int emit)
{
    if (!emit) return 0;
    if (e->len + n + 1 > e->cap) {
        size_t cap = 2 * (e->len + n + 1);
        char *o = realloc(e->out, cap);
        if (!o) return snprintf(e->why, e->why_n, "out of memory"), -1;
        e->out = o, e->cap = cap;
    }
    memcpy(e->out + e->len, s, n);
    e->len += n;
    e->out[e->len] = '\0';
    return 0;
}

static int expand_fail(expander *e, const char *at, const char *what)
{
    snprintf(e->why, e->why_n, "%s at column %d of '%s'", what, (int)(at - e->value) + 1, e->value);
    return -1;
}

/* One reference at *p ("${"): ${VAR} or ${VAR:-default}, the default itself text with
 * references. A variable set to the empty string counts as unset, as the shell's :- does.
 * emit = 0 parses without expanding (the default of a set variable is not evaluated, so its
 * unset variables are no error). Leaves *p past the closing '}'. */
static int expand_ref(expander *e, const char **p, int depth, int emit)
{
    const char *start = *p, *name = *p + 2, *q = name;
    if (depth > EXPAND_MAX_DEPTH) {
        char what[64];
        snprintf(what, sizeof what, "more than %d nested ${...}", EXPAND_MAX_DEPTH);
        return expand_fail(e, start, what);
    }
    while (*q == '_' || (*q >= 'A' && *q <= 'Z') || (*q >= 'a' && *q <= 'z') || (q > name && *q >= '0' && *q <= '9'))
        q++;
    if (!*q) return expand_fail(e, start, "unterminated ${ (no closing '}')");
    if (q == name || (*q != '}' && (q[0] != ':' || q[1] != '-')))
        return expand_fail(e, start, "bad variable reference (write ${NAME} or ${NAME:-default}, NAME of letters, "
                                     "digits and _)");
    char var[128];
    if ((size_t)(q - name) >= sizeof var) return expand_fail(e, start, "variable name too long");
    snprintf(var, sizeof var, "%.*s", (int)(q - name), name);
    const char *val = emit ? getenv(var) : NULL;
    int set = val && *val;
    if (*q == ':') {
        *p = q + 2;
        if (expand_text(e, p, depth, emit && !set)) return -1;
        if (**p != '}') return expand_fail(e, start, "unterminated ${ (no closing '}')");
    } else {
        if (emit && !set) {
            char what[320];
            /* set to "" is not unset: saying "not set" sent users looking for a missing export */
            if (val)
                snprintf(what, sizeof what,
                         "environment variable %s is empty and has no default (write ${%s:-DEFAULT} for one)", var,
                         var);
            else
                snprintf(what, sizeof what, "environment variable %s is not set and has no default", var);
            return expand_fail(e, start, what);
        }
        *p = q;
    }
    (*p)++;
    return set ? expand_put(e, val, strlen(val), emit) : 0;
}

/* Text up to the '}' closing a reference of this depth (depth 0: the whole value); a '$' not
 * followed by '{', and a '}' outside any reference, are kept as they are. */
static int expand_text(expander *e, const char **p, int depth, int emit)
{
    while (**p && !(depth > 0 && **p == '}')) {
        if ((*p)[0] == '$' && (*p)[1] == '{') {
            if (expand_ref(e, p, depth + 1, emit)) return -1;
        } else if (expand_put(e, (*p)++, 1, emit))
            return -1;
    }
    return 0;
}

/* Expands ${VAR} and ${VAR:-default} (defaults nest); returns malloc'ed text, or NULL with the
 * reason in why (the caller adds file, line and key). */
static char *expand(const char *v, char *why, size_t why_n)
{
    expander e = {.value = v, .why = why, .why_n = why_n};
    const char *p = v;
    if (expand_put(&e, "", 0, 1) || expand_text(&e, &p, 0, 1)) {
        free(e.out);
        return NULL;
    }
    return e.out;
}

/* 1 when v is wrapped in a pair of the same quote. libinih keeps quotes as part of a value, so
 * `[store] path = "my store"` made a folder named with the quotes in it, where no later command
 * given the path as written found the caches, and a quoted model path was "not found". */
static int quoted(const char *v)
{
    const size_t n = strlen(v);
    return n >= 2 && (v[0] == '"' || v[0] == '\'') && v[n - 1] == v[0];
}

/* Checks `v` against setting s; on success may rewrite *v (absolute path). */
static int validate(const kvm_cfg_setting *s, char **v, char *why, size_t why_n)
{
    char *end;
    switch (s->type) {
    case KVM_CFG_INT: {
        errno = 0;
        long long x = strtoll(*v, &end, 10);
        if (errno == ERANGE && end != *v && !*end) /* digits, but beyond 64 bits */
            return snprintf(why, why_n, "%s is outside [%.0f, %.0f]", *v, s->lo, s->hi), -1;
        if (errno || end == *v || *end) return snprintf(why, why_n, "'%s' is not an integer", *v), -1;
        if (x < s->lo || x > s->hi) return snprintf(why, why_n, "%lld is outside [%.0f, %.0f]", x, s->lo, s->hi), -1;
        return 0;
    }
    case KVM_CFG_FLOAT: {
        double x = 0;
        const int prc = kvm_parse_decimal(*v, &x);
        if (prc == KVM_ERANGE) /* a number, but beyond a double */
            return kvm_decimal_range_why(*v, s->lo, s->hi, why, why_n), -1;
        if (prc) return snprintf(why, why_n, "'%s' is not a number", *v), -1;
        if (x < s->lo || x > s->hi) return snprintf(why, why_n, "%g is outside [%g, %g]", x, s->lo, s->hi), -1;
        return 0;
    }
    case KVM_CFG_BOOL: {
        const char *ok[] = {"true", "false", "yes", "no", "on", "off", "1", "0"};
        for (size_t i = 0; i < 8; i++)
            if (!strcasecmp(*v, ok[i])) return 0;
        return snprintf(why, why_n, "'%s' is not a boolean (true/false)", *v), -1;
    }
    case KVM_CFG_ENUM: {
        size_t n = strlen(*v);
        for (const char *c = s->choices; *c;) {
            const char *bar = strchr(c, '|');
            size_t cl = bar ? (size_t)(bar - c) : strlen(c);
            if (cl == n && !strncmp(c, *v, n)) return 0;
            c += cl + (bar ? 1 : 0);
        }
        return snprintf(why, why_n, "'%s' is not one of %s", *v, s->choices), -1;
    }
    case KVM_CFG_PATH:
        if (quoted(*v))
            return snprintf(why, why_n,
                            "%s is in quotes, which an INI file keeps as part of the path: write it without them (a "
                            "path may "
                            "hold spaces as it is)",
                            *v),
                   -1;
        /* a store service endpoint ([store] path = tcp://HOST:PORT) is no file to resolve */
        if (**v && **v != '/' && strncmp(*v, "tcp://", 6) && strncmp(*v, "ipc://", 6)) {
            char cwd[4096];
            if (!getcwd(cwd, sizeof cwd)) return snprintf(why, why_n, "cannot resolve relative path '%s'", *v), -1;
            size_t n = strlen(cwd) + strlen(*v) + 2;
            char *abs = malloc(n);
            if (!abs) return snprintf(why, why_n, "out of memory"), -1;
            snprintf(abs, n, "%s/%s", cwd, (*v)[0] == '.' && (*v)[1] == '/' ? *v + 2 : *v);
            free(*v);
            *v = abs;
        }
        return 0;
    case KVM_CFG_STR:
        return 0;
    }
    return 0;
}

/* 1 when [section] key holds a ZeroMQ endpoint (a bind, a connect, or a store that may be one). */
static int endpoint_key(const char *section, const char *key)
{
    static const char *const keys[][2] = {{"run", "bind"},      {"serve", "bind"},         {"serve", "backend"},
                                          {"store", "service"}, {"store", "service_bind"}, {"store", "path"}};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strcmp(section, keys[i][0]) && !strcmp(key, keys[i][1])) return 1;
    return 0;
}

/* An endpoint's scheme with no address after it, or tcp:// without a port: [run] bind = ipc://
 * named the run's sockets /ctl and /data (the root folder), and tcp:// failed only once the run
 * came to bind it, naming neither file nor line. Refused where the file (or a flag) sets it.
 * Returns 0, or -1 with why. */
static int endpoint_hollow(const char *v, char *why, size_t why_n)
{
    if (!strncmp(v, "ipc://", 6) && !v[6]) return snprintf(why, why_n, "'%s' names no socket path (ipc://PATH)", v), -1;
    if (strncmp(v, "tcp://", 6)) return 0;
    const char *host = v + 6, *close = *host == '[' ? strchr(host, ']') : NULL; /* [IPv6]:PORT */
    const char *colon = strrchr(close ? close : host, ':');
    if (!*host) return snprintf(why, why_n, "'%s' names no host and no port (tcp://HOST:PORT)", v), -1;
    if (!colon || !colon[1]) return snprintf(why, why_n, "'%s' names no port (tcp://HOST:PORT)", v), -1;
    return 0; /* an empty host (tcp://:PORT) passes here: the endpoint checks at bind and connect refuse it by name */
}

/* vars: expand ${VAR} in raw (a line of the file); 0 takes raw as it is (a flag's value, which
 * the shell has expanded already, or job settings' values, expanded once where they were read) */
static int set_value(kvm_config *c, const char *section, const char *key, const char *raw, int vars, char *why,
                     size_t why_n)
{
    int i = find(section, key);
    if (i < 0) {
        char other[256], hint[300] = "";
        sections_with(section, key, other, sizeof other);
        if (*other) snprintf(hint, sizeof hint, " (%s is a key of %s: put it under that header)", key, other);
        if (!known_section(section))
            snprintf(why, why_n, "[%s] %s: unknown section '%s'%s", section, key, section, hint);
        else
            snprintf(why, why_n, "[%s] %s: unknown key%s", section, key, hint);
        return -1;
    }
    char w[400];
    char *v = vars ? expand(raw, w, sizeof w) : strdup(raw);
    if (!v && !vars) return snprintf(why, why_n, "[%s] %s: out of memory", section, key), -1;
    if (!v) return snprintf(why, why_n, "[%s] %s: %s", section, key, w), -1;
    if (kvm_cfg_settings[i].type == KVM_CFG_PATH && kvm_cfg_settings[i].lo >= 1 && !*v) {
        /* say where the empty value came from: a ${VAR:-} whose VAR is unset reads as nothing (a
         * required key's emptiness is checked after the file, as "required key is empty") */
        if (strcmp(raw, v)) snprintf(why, why_n, "[%s] %s: '%s' expands to an empty path", section, key, raw);
        else snprintf(why, why_n, "[%s] %s: empty path", section, key);
        free(v);
        return -1;
    }
    if (validate(&kvm_cfg_settings[i], &v, w, sizeof w) ||
        (endpoint_key(section, key) && endpoint_hollow(v, w, sizeof w))) {
        snprintf(why, why_n, "[%s] %s: %s", section, key, w);
        free(v);
        return -1;
    }
    free(c->value[i]);
    c->value[i] = v;
    return 0;
}

static int on_pair(void *user, const char *section, const char *name, const char *value)
{
    kvm_config *c = user;
    char why[512];
    for (const kvm_cfg_alias *a = kvm_cfg_aliases; a->section; a++)
        if (!strcmp(a->section, section) && !strcmp(a->old, name)) {
            fprintf(stderr, "kvmill: %s: [%s] %s is deprecated: use %s\n", c->path, section, name, a->key);
            name = a->key;
            break;
        }
    if (set_value(c, section, name, value, 1, why, sizeof why) == 0) return 1;
    if (!c->first_error) c->first_error = strdup(why);
    return 0;
}

/* Where each key was set, to refuse a key set twice (libinih would keep the last). */
typedef struct seen_key {
    char name[200]; /* "section\0key" flattened as "section.key" */
    int line;       /* line that set it */
} seen_key;

/* The "section.key" a `key = value` line sets (section names and keys as libinih trims
 * them); 0 when the line is not one (comment, blank, section header, continuation). */
static int line_key(const char *p, size_t len, const char *section, int after_key, char *out, size_t out_n)
{
    const char *q = p, *e = p + len;
    while (q < e && (*q == ' ' || *q == '\t')) q++;
    if (q == e || *q == ';' || *q == '#' || *q == '[' || (q > p && after_key)) return 0; /* indented: a continuation */
    const char *eq = q;
    while (eq < e && *eq != '=' && *eq != ':') eq++;
    if (eq == e) return 0; /* inih reports the syntax error */
    const char *k_end = eq;
    while (k_end > q && (k_end[-1] == ' ' || k_end[-1] == '\t' || k_end[-1] == '\r')) k_end--;
    snprintf(out, out_n, "%s.%.*s", section, (int)(k_end - q), q);
    return 1;
}

/* Records the key a line sets; an error naming both lines when it was set before. */
static int note_key(const char *name, seen_key **seen, int *n_seen, const char *key, int line)
{
    for (int i = 0; i < *n_seen; i++)
        if (!strcmp((*seen)[i].name, key)) {
            const char *dot = strchr(key, '.');
            return kvm_err(KVM_EINVAL, "%s:%d: [%.*s] %s is set again (first set on line %d): keep one of the two", name,
                           line, (int)(dot - key), key, dot + 1, (*seen)[i].line);
        }
    if ((*n_seen & 63) == 0) {
        seen_key *g = realloc(*seen, (size_t)(*n_seen + 64) * sizeof *g);
        if (!g) return kvm_err(KVM_ENOMEM, "%s: out of memory", name);
        *seen = g;
    }
    snprintf((*seen)[*n_seen].name, sizeof (*seen)[*n_seen].name, "%s", key);
    (*seen)[(*n_seen)++].line = line;
    return 0;
}

/* A UTF-16 (or UTF-32) file: its byte-order mark FF FE or FE FF, read as UTF-8, made libinih
 * blame a key on line 1 (or the NUL check say less). A UTF-8 byte-order mark is not an error:
 * libinih skips it (INI_ALLOW_BOM) and so does prescan. */
static int check_bom(const char *name, const unsigned char *t, size_t n)
{
    if (n >= 2 && ((t[0] == 0xFF && t[1] == 0xFE) || (t[0] == 0xFE && t[1] == 0xFF)))
        return kvm_err(KVM_EINVAL, "%s: starts with a UTF-16 byte-order mark (%02X %02X): a configuration file is UTF-8 "
                                   "text (save it as UTF-8)", name, t[0], t[1]);
    return 0;
}

/* libinih ignores whatever follows a section header's ']', so `[compress] ratio = 0.5` on one
 * line dropped the setting without a word: only blanks or a comment may follow. */
static int header_tail(const char *name, int line, const char *t, const char *end)
{
    while (t < end && (*t == ' ' || *t == '\t' || *t == '\r'))
        t++;
    if (t == end || *t == ';' || *t == '#') return 0;
    while (end > t && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
        end--;
    return kvm_err(KVM_EINVAL,
                   "%s:%d: '%.*s' after the section header's ']' would be ignored: put a key = value on "
                   "a line of its own",
                   name, line, (int)(end - t), t);
}

/* A line that is no key = value (no '=' or ':', or no key before it), header or comment: libinih calls it a syntax
 * error but reports the line of its first error with the message of the first rejected key, so
 * `foo` on line 3 and an unknown key on line 5 read "c.ini:3: [compress] ratoi: unknown key".
 * Returns 0, or an error naming the line and its text. */
static int stray_line(const char *name, int line, const char *q, const char *end)
{
    while (end > q && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
        end--;
    if (q < end && (*q == '=' || *q == ':')) /* read as "[model] : unknown key" */
        return kvm_err(KVM_EINVAL, "%s:%d: '%.*s' has no key before its '%c'", name, line, (int)(end - q), q, *q);
    if (q == end || *q == ';' || *q == '#' || *q == '[' || memchr(q, '=', (size_t)(end - q)) ||
        memchr(q, ':', (size_t)(end - q)))
        return 0;
    if (end - q >= 3 && !memcmp(q, "\xEF\xBB\xBF", 3)) /* invisible in a terminal */
        return kvm_err(KVM_EINVAL, "%s:%d: a UTF-8 byte-order mark inside the file (only one at its start is skipped)",
                       name, line);
    return kvm_err(KVM_EINVAL, "%s:%d: '%.*s' is not a key = value line, a [section] header or a comment", name, line,
                   (int)(end - q), q);
}

/* What libinih reports badly: lines longer than its 200-byte buffer (it splits them and
 * blames a later line), section headers without ']' (it keeps going with the previous
 * section) and a key set twice (it keeps the last). Checked first so the message names
 * the real line. */
static int prescan(const char *name, const char *text)
{
    int line = 1, rc = 0, n_seen = 0, after_key = 0;
    seen_key *seen = NULL;
    char section[200] = "", key[200];
    if (!strncmp(text, "\xEF\xBB\xBF", 3)) text += 3; /* a UTF-8 byte-order mark, skipped by libinih too */
    for (const char *p = text; *p && !rc; line++) {
        const char *end = strchr(p, '\n');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *q = p;
        while (q < p + len && (*q == ' ' || *q == '\t')) q++;
        if (len >= 199) /* libinih's buffer; values are expanded after parsing, so a long path fits in a variable */
            rc = kvm_err(KVM_EINVAL, "%s:%d: line of %zu characters: lines are limited to 198 (for a longer value, "
                                     "such as a deep path, write key = ${VAR} and set the environment variable VAR)",
                         name, line, len);
        else if (after_key && q > p && q < p + len && *q != ';' && *q != '#' && *q != '\r') {
            /* libinih takes an indented line after a key as a continuation and sets the key
             * again to that line alone: `path = a.bin` then `  b` silently made path b */
            const char *dot = strchr(key, '.');
            rc = kvm_err(KVM_EINVAL, "%s:%d: an indented line after [%.*s] %s continues its value, which is not "
                                     "supported: write it without leading blanks (one key = value per line)",
                         name, line, (int)(dot - key), key, dot + 1);
        } else if (q < p + len && *q == '[') {
            const char *close = memchr(q, ']', (size_t)(p + len - q));
            rc = close ? header_tail(name, line, close + 1, p + len)
                       : kvm_err(KVM_EINVAL, "%s:%d: section header without ']'", name, line);
            if (close) snprintf(section, sizeof section, "%.*s", (int)(close - q - 1), q + 1);
            after_key = 0;
        } else if ((rc = stray_line(name, line, q, p + len)) == 0 &&
                   line_key(p, len, section, after_key, key, sizeof key)) {
            /* an old name and its new one are one key: `queries` then `synthetic_queries` is
             * a key set twice too */
            for (const kvm_cfg_alias *a = kvm_cfg_aliases; a->section; a++) {
                size_t sl = strlen(a->section);
                if (!strncmp(key, a->section, sl) && key[sl] == '.' && !strcmp(key + sl + 1, a->old)) {
                    snprintf(key + sl + 1, sizeof key - sl - 1, "%s", a->key);
                    break;
                }
            }
            rc = note_key(name, &seen, &n_seen, key, line);
            after_key = 1;
        }
        if (!end) break;
        p = end + 1;
    }
    free(seen);
    return rc;
}

/* 1 when the program loading c reads `section` (kvm_config_load_sections). */
static int needed(const kvm_config *c, const char *section)
{
    if (!c->needed) return 1;
    for (const char *const *s = c->needed; *s; s++)
        if (!strcmp(*s, section)) return 1;
    return 0;
}

static int finish(kvm_config *c, int rc)
{
    if (rc == -2) return kvm_err(KVM_ENOMEM, "%s: out of memory", c->path);
    if (rc > 0)
        return kvm_err(KVM_EINVAL, "%s:%d: %s", c->path, rc, c->first_error ? c->first_error : "syntax error (expected key = value or [section])");
    for (int i = 0; kvm_cfg_settings[i].section; i++)
        if (!kvm_cfg_settings[i].def && (!c->value[i] || !*c->value[i]) && needed(c, kvm_cfg_settings[i].section))
            return kvm_err(KVM_EINVAL, "%s: [%s] %s: required key is %s", c->path, kvm_cfg_settings[i].section,
                           kvm_cfg_settings[i].key, c->value[i] ? "empty" : "missing");
    /* the map starts at map_size_mb and grows up to map_max_mb: a maximum below the start was
     * ignored (the store opened with a map of map_size_mb, exit 0) */
    const int64_t map = kvm_config_int(c, "store", "map_size_mb"), max = kvm_config_int(c, "store", "map_max_mb");
    if (needed(c, "store") && max < map)
        return kvm_err(KVM_EINVAL,
                       "%s: [store] map_max_mb = %lld is below map_size_mb = %lld%s: the store's map starts "
                       "at map_size_mb and grows up to map_max_mb; raise map_max_mb or lower map_size_mb",
                       c->path, (long long)max, (long long)map,
                       kvm_config_is_set(c, "store", "map_size_mb") ? "" : " (its default)");
    /* heartbeat_ms = 10 with liveness = 1 declared workers dead after 10 ms of silence, while the
     * orchestrator reads their heartbeats once per loop (up to 100 ms): workers were killed for
     * nothing and hundreds of "did not run for 0.0 s" lines came */
    const int64_t hb = kvm_config_int(c, "run", "heartbeat_ms"), beats = kvm_config_int(c, "run", "liveness");
    if (needed(c, "run") && hb * beats < KVM_CONFIG_MIN_DEAD_MS)
        return kvm_err(KVM_EINVAL,
                       "%s: [run] heartbeat_ms x liveness = %lld x %lld = %lld ms: a worker would be declared dead "
                       "after that much silence, and kvmill run and serve read heartbeats only every 100 ms; give "
                       "at least %d ms",
                       c->path, (long long)hb, (long long)beats, (long long)(hb * beats), KVM_CONFIG_MIN_DEAD_MS);
    return 0;
}

static kvm_config *config_new(const char *name)
{
    kvm_config *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->n = n_settings();
    c->path = strdup(name);
    c->value = calloc((size_t)c->n, sizeof *c->value);
    if (!c->path || !c->value) kvm_config_free(&c);
    return c;
}

int kvm_config_load(const char *path, kvm_config **out) { return kvm_config_load_sections(path, NULL, out); }

int kvm_config_load_sections(const char *path, const char *const *sections, kvm_config **out)
{
    *out = NULL;
    struct stat st;
    if (!path || !*path) return kvm_err(KVM_ENOTFOUND, "configuration file: empty path");
    if (stat(path, &st) != 0)
        return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "%s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return kvm_err(KVM_EIO, "%s: not a regular file", path);
    if (st.st_size > (1 << 20)) return kvm_err(KVM_EINVAL, "%s: %lld bytes is too large for a configuration file", path, (long long)st.st_size);
    FILE *f = fopen(path, "rb");
    if (!f) return kvm_err(KVM_EIO, "%s: %s", path, strerror(errno));
    char *text = malloc((size_t)st.st_size + 1);
    size_t n = text ? fread(text, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (!text) return kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    text[n] = '\0';
    int rc = check_bom(path, (const unsigned char *)text, n);
    if (rc) {
        free(text);
        return rc;
    }
    if (memchr(text, '\0', n)) {
        free(text);
        return kvm_err(KVM_EINVAL, "%s: contains NUL bytes: not a text configuration file", path);
    }
    rc = prescan(path, text);
    kvm_config *c = rc ? NULL : config_new(path);
    if (!rc && !c) rc = kvm_err(KVM_ENOMEM, "%s: out of memory", path);
    if (c) c->needed = sections;
    if (!rc) rc = finish(c, ini_parse_string(text, on_pair, c));
    free(text);
    if (rc) kvm_config_free(&c);
    *out = c;
    return rc;
}

int kvm_config_parse(const char *text, const char *name, kvm_config **out)
{
    *out = NULL;
    int rc = check_bom(name, (const unsigned char *)text, strlen(text));
    if (!rc) rc = prescan(name, text);
    if (rc) return rc;
    kvm_config *c = config_new(name);
    if (!c) return kvm_err(KVM_ENOMEM, "%s: out of memory", name);
    rc = finish(c, ini_parse_string(text, on_pair, c));
    if (rc) kvm_config_free(&c);
    *out = c;
    return rc;
}

void kvm_config_free(kvm_config **pc)
{
    if (!pc || !*pc) return;
    kvm_config *c = *pc;
    for (int i = 0; c->value && i < c->n; i++) free(c->value[i]);
    free(c->value);
    free(c->path);
    free(c->first_error);
    free(c);
    *pc = NULL;
}

static int must_find(const char *section, const char *key, kvm_cfg_type type)
{
    int i = find(section, key);
    if (i < 0 || kvm_cfg_settings[i].type != type) {
        fprintf(stderr, "kvm_config: no %s setting [%s] %s (programming error)\n", type == KVM_CFG_INT ? "int" : "typed",
                section, key);
        abort();
    }
    return i;
}

static const char *raw(const kvm_config *c, int i) { return c->value[i] ? c->value[i] : kvm_cfg_settings[i].def; }

const char *kvm_config_str(const kvm_config *c, const char *section, const char *key)
{
    int i = find(section, key);
    if (i < 0) must_find(section, key, KVM_CFG_STR);
    return raw(c, i);
}

int64_t kvm_config_int(const kvm_config *c, const char *section, const char *key)
{
    return strtoll(raw(c, must_find(section, key, KVM_CFG_INT)), NULL, 10);
}

double kvm_config_float(const kvm_config *c, const char *section, const char *key)
{
    return strtod(raw(c, must_find(section, key, KVM_CFG_FLOAT)), NULL);
}

int kvm_config_bool(const kvm_config *c, const char *section, const char *key)
{
    const char *v = raw(c, must_find(section, key, KVM_CFG_BOOL));
    return !strcasecmp(v, "true") || !strcasecmp(v, "yes") || !strcasecmp(v, "on") || !strcmp(v, "1");
}

int kvm_config_is_set(const kvm_config *c, const char *section, const char *key)
{
    int i = find(section, key);
    return i >= 0 && c->value[i] != NULL;
}

int kvm_config_set(kvm_config *c, const char *section, const char *key, const char *value)
{
    char why[512];
    if (set_value(c, section, key, value, 0, why, sizeof why)) return kvm_err(KVM_EINVAL, "%s", why);
    return 0;
}

int kvm_config_canonical(const kvm_config *c, const char *section, char **out, size_t *len)
{
    size_t cap = 256, n = 0;
    char *buf = malloc(cap);
    for (int i = 0; buf && kvm_cfg_settings[i].section; i++) {
        const kvm_cfg_setting *s = &kvm_cfg_settings[i];
        if (section && strcmp(section, s->section)) continue;
        /* numbers and booleans in one spelling, so "0.30" and ".3" give one config id. A float
         * in 9 significant digits when they give back the value (every id made so far stays),
         * else in 17, which always do: ratio 0.2864583332 and 0.2864583334, both "0.286458333",
         * shared an id while they kept 1,180 and 1,200 entries, so run skipped one as the other. */
        char norm[64];
        const char *v = raw(c, i);
        if (s->type == KVM_CFG_INT) snprintf(norm, sizeof norm, "%lld", strtoll(v, NULL, 10)), v = norm;
        else if (s->type == KVM_CFG_FLOAT) {
            const double x = strtod(v, NULL);
            snprintf(norm, sizeof norm, "%.9g", x);
            if (strtod(norm, NULL) != x) snprintf(norm, sizeof norm, "%.17g", x);
            v = norm;
        } else if (s->type == KVM_CFG_BOOL)
            v = kvm_config_bool(c, s->section, s->key) ? "true" : "false";
        size_t need = strlen(s->section) + strlen(s->key) + strlen(v) + 4;
        if (n + need > cap) {
            char *b = realloc(buf, cap = 2 * (n + need));
            if (!b) { free(buf); buf = NULL; break; }
            buf = b;
        }
        n += (size_t)snprintf(buf + n, cap - n, "%s.%s=%s\n", s->section, s->key, v);
    }
    if (!buf) return kvm_err(KVM_ENOMEM, "config: out of memory");
    *out = buf;
    *len = n;
    return 0;
}

/* "; " comment lines of at most ~100 characters, broken at spaces: the file is read back
 * (serve's decode workers read the resolved configuration), and libinih refuses lines longer
 * than its 200-byte buffer. */
static void dump_comment(FILE *f, const char *text)
{
    size_t n = strlen(text);
    while (n > 0) {
        size_t take = n;
        if (take > 96) {
            take = 96;
            while (take > 40 && text[take] != ' ') take--;
            if (text[take] != ' ') take = 96; /* no space to break at: cut */
        }
        fprintf(f, "; %.*s\n", (int)take, text);
        text += take;
        n -= take;
        while (n > 0 && *text == ' ') text++, n--;
    }
}

/* 1 when the line "key = v" reads back as v: within libinih's 198 characters, no blanks at
 * either end (stripped), no ';' after a blank (an inline comment), no line break, no "${"
 * (expanded again). */
static int reads_back(const char *key, const char *v)
{
    size_t n = strlen(v);
    if (strlen(key) + 3 + n >= 199 || strpbrk(v, "\n\r") || strstr(v, "${")) return 0;
    if (n && (v[0] == ' ' || v[0] == '\t' || v[n - 1] == ' ' || v[n - 1] == '\t')) return 0;
    for (const char *p = strchr(v, ';'); p; p = strchr(p + 1, ';'))
        if (p == v || p[-1] == ' ' || p[-1] == '\t') return 0;
    return 1;
}

/* KVMILL_CFG_SECTION_KEY: the environment variable a value that does not read back goes through. */
static void env_name(const kvm_cfg_setting *s, char *var, size_t cap)
{
    snprintf(var, cap, "KVMILL_CFG_%s_%s", s->section, s->key);
    for (char *p = var; *p; p++) *p = (char)toupper((unsigned char)*p);
}

/* The shell word 'v' (each ' as '\''), for the export line --dump-config prints to stderr. */
static void put_shell_quoted(FILE *f, const char *v)
{
    fputc('\'', f);
    for (; *v; v++)
        if (*v == '\'') fputs("'\\''", f);
        else fputc(*v, f);
    fputc('\'', f);
}

int kvm_config_dump_env(const kvm_config *c, FILE *f)
{
    const char *sec = "";
    for (int i = 0; kvm_cfg_settings[i].section; i++) {
        const kvm_cfg_setting *s = &kvm_cfg_settings[i];
        if (strcmp(sec, s->section)) fprintf(f, "%s[%s]\n", i ? "\n" : "", sec = s->section);
        const char *v = raw(c, i);
        if (reads_back(s->key, v)) {
            fprintf(f, "%s = %s\n", s->key, v);
            continue;
        }
        char var[128];
        env_name(s, var, sizeof var);
        if (setenv(var, v, 1)) return kvm_err(KVM_ENOMEM, "cannot set %s: %s", var, strerror(errno));
        fprintf(f, "%s = ${%s}\n", s->key, var);
    }
    return ferror(f) ? kvm_err(KVM_EIO, "cannot write the configuration") : 0;
}

int kvm_config_dump(const kvm_config *c, FILE *f, FILE *notes)
{
    const char *sec = "";
    int moved = 0;
    for (int i = 0; kvm_cfg_settings[i].section; i++) {
        const kvm_cfg_setting *s = &kvm_cfg_settings[i];
        if (strcmp(sec, s->section)) fprintf(f, "%s[%s]\n", i ? "\n" : "", sec = s->section);
        char help[1024];
        snprintf(help, sizeof help, "%s%s%s%s", s->help, *s->unit ? " (" : "", s->unit, *s->unit ? ")" : "");
        dump_comment(f, help);
        const char *v = c ? raw(c, i) : (s->def ? s->def : "<required>");
        if (!c || reads_back(s->key, v)) {
            fprintf(f, "%s = %s\n", s->key, v);
            continue;
        }
        /* printed as it is, the line would read back as another value (or not at all) */
        char var[128];
        env_name(s, var, sizeof var);
        fprintf(f, "; the value does not fit an INI line (over 198 characters, a line break, a ';' after a blank,\n"
                   "; blanks at an end or \"${\"): it is read from the environment\n%s = ${%s}\n", s->key, var);
        if (notes) {
            fprintf(notes, "export %s=", var);
            put_shell_quoted(notes, v);
            fputc('\n', notes);
        }
        moved++;
    }
    return moved;
}

const char *kvm_config_path(const kvm_config *c) { return c->path; }
