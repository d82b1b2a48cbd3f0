/* cmd_keygen.c: `kvmill keygen`: a CurveZMQ key pair for a server, client or worker. */
#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_curve.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* path for a message: whole when short, else its first and last 60 characters around "..." and
 * its length, so that a path of thousands of characters does not bury the reason after it.
 * Written into buf[n] (n >= 160); returns buf. */
static const char *short_path(const char *path, char *buf, size_t n)
{
    size_t len = strlen(path);
    if (len <= 130)
        snprintf(buf, n, "%s", path);
    else
        snprintf(buf, n, "%.60s...%s (%zu characters)", path, path + len - 60, len);
    return buf;
}

/* The deepest folder of prefix that exists (prefix's own folder when it does; "." or "/" at the
 * top), into dir[n]. */
static void deepest_existing(const char *prefix, char *dir, size_t n)
{
    snprintf(dir, n, "%s", prefix);
    for (char *cut = strrchr(dir, '/');; cut = strrchr(dir, '/')) {
        if (!cut) {
            snprintf(dir, n, ".");
            return;
        }
        if (cut == dir) {
            dir[1] = '\0';
            return;
        }
        *cut = '\0';
        if (!access(dir, F_OK)) return;
    }
}

/* The longest name keygen writes: kvm_curve_keygen's temporary PREFIX.public.XXXXXX, renamed to
 * PREFIX.public once written (the ".public" alone let a name 7 bytes too long through). */
#define KEY_SUFFIX ".public.XXXXXX"

/* Checks --out PREFIX before anything is made: PREFIX.public.XXXXXX within PATH_MAX, each name in it
 * within NAME_MAX, each folder on its way a folder (or missing: made later), and the deepest
 * existing one writable. Returns 0, or 2 after saying why (a long path shortened). */
static int check_prefix(const char *prefix)
{
    char sp[200], sd[200], dir[PATH_MAX];
    if (strlen(prefix) + strlen(KEY_SUFFIX) >= PATH_MAX)
        return fprintf(stderr,
                       "kvmill keygen: --out %s: longer than PATH_MAX (%d characters with .public.XXXXXX, the key "
                       "writer's temporary name); give a "
                       "shorter PREFIX\n",
                       short_path(prefix, sp, sizeof sp), PATH_MAX),
               2;
    for (const char *p = prefix; *p;) { /* the last name with its .public */
        size_t n = strcspn(p, "/");
        if (n + (p[n] ? 0 : strlen(KEY_SUFFIX)) > NAME_MAX)
            return fprintf(stderr, "kvmill keygen: --out %s: a name in it is longer than NAME_MAX (%d characters%s)\n",
                           short_path(prefix, sp, sizeof sp), NAME_MAX,
                           p[n] ? "" : " with .public.XXXXXX, the key writer's temporary name"),
                   2;
        p += n + (p[n] == '/');
    }
    snprintf(dir, sizeof dir, "%s", prefix);
    for (char *p = strchr(dir + 1, '/'); p; p = strchr(p + 1, '/')) { /* a folder, or missing from here on */
        struct stat st;
        *p = '\0';
        int e = stat(dir, &st) ? errno : 0;
        if (e == ENOENT) break;
        if (e || !S_ISDIR(st.st_mode))
            return fprintf(stderr, "kvmill keygen: --out %s: %s %s\n", short_path(prefix, sp, sizeof sp),
                           short_path(dir, sd, sizeof sd), e ? strerror(e) : "is not a folder"),
                   2;
        *p = '/';
    }
    deepest_existing(prefix, dir, sizeof dir);
    if (access(dir, W_OK | X_OK))
        return fprintf(stderr, "kvmill keygen: --out %s: cannot write in folder %s: %s\n",
                       short_path(prefix, sp, sizeof sp), short_path(dir, sd, sizeof sd), strerror(errno)),
               2;
    return 0;
}

/* The folders make_folders made: prefix[0, at[i]) for i < n, in the order made. */
typedef struct made_folders {
    size_t at[PATH_MAX / 2];
    int n;
} made_folders;

/* Makes the missing folders of prefix (0700: they hold a secret key), recording each one it made
 * in *m. Returns 0, or 1 after saying why. */
static int make_folders(const char *prefix, made_folders *m)
{
    char dir[PATH_MAX], sp[200], sd[200];
    m->n = 0;
    snprintf(dir, sizeof dir, "%s", prefix);
    for (char *p = strchr(dir + 1, '/'); p; p = strchr(p + 1, '/')) {
        *p = '\0';
        if (mkdir(dir, 0700) == 0) {
            if (m->n < (int)(sizeof m->at / sizeof m->at[0])) m->at[m->n++] = (size_t)(p - dir);
        } else if (errno != EEXIST) {
            int e = errno;
            fprintf(stderr, "kvmill keygen: --out %s: cannot make folder %s: %s\n", short_path(prefix, sp, sizeof sp),
                    short_path(dir, sd, sizeof sd), strerror(e));
            *p = '/';
            return 1;
        }
        *p = '/';
    }
    return 0;
}

/* Removes the folders make_folders made (*m), the last made first, so that a failed keygen
 * leaves no empty folders behind; only those: with a `..` in the prefix a folder deeper in the
 * path may be one that was there before (new/../existing/k). */
static void remove_made(const char *prefix, const made_folders *m)
{
    char dir[PATH_MAX];
    for (int i = m->n - 1; i >= 0; i--) {
        snprintf(dir, sizeof dir, "%.*s", (int)m->at[i], prefix);
        rmdir(dir);
    }
}

int kvm_cmd_keygen(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"out", 1, "writes PREFIX.public and PREFIX.secret (mode 0600)", NULL},
                          {"force", 0, "overwrite existing key files", NULL},
                          {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse(
            "keygen",
            "Makes a CurveZMQ key pair. Give the .public file to the other side (a server's to its clients "
            "and workers; a client's into the server's [security] authorized_keys folder); keep .secret private.",
            argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *prefix = kvm_cli_get(opts, "out");
    if (!prefix || !*prefix) return fprintf(stderr, "kvmill keygen: --out PREFIX is required\n"), 2;
    /* a folder ("keys/") as the prefix wrote the hidden files keys/.public and keys/.secret */
    const char *base = strrchr(prefix, '/') ? strrchr(prefix, '/') + 1 : prefix;
    if (!*base || !strcmp(base, ".") || !strcmp(base, ".."))
        return fprintf(stderr, "kvmill keygen: --out %s names a folder, not a PREFIX: give the key pair's name in it "
                               "(e.g. --out %s%sserver)\n", prefix, prefix, *base ? "/" : ""), 2;
    /* a long prefix made 2,047 folders, then failed with a message of its path alone */
    if (check_prefix(prefix)) return 2;
    char pub[PATH_MAX], sec[PATH_MAX];
    made_folders made;
    snprintf(pub, sizeof pub, "%s.public", prefix);
    snprintf(sec, sizeof sec, "%s.secret", prefix);
    if (!kvm_cli_get(opts, "force") && (access(pub, F_OK) == 0 || access(sec, F_OK) == 0))
        return fprintf(stderr, "kvmill keygen: %s or %s exists; use --force to replace it\n", pub, sec), 2;
    /* the folders of PREFIX (keys/server) are made as needed, private (0700) */
    if (make_folders(prefix, &made)) {
        remove_made(prefix, &made);
        return 1;
    }
    if (kvm_curve_keygen(prefix)) {
        fprintf(stderr, "kvmill keygen: %s\n", kvm_cli_errmsg("keygen"));
        remove_made(prefix, &made);
        return 1;
    }
    printf("%s\n%s\n", pub, sec);
    return 0;
}
