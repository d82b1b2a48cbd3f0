/* kvm_cli.c: the option parser shared by every kvmill subcommand. */
#include "orchestrator/kvm_cli.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "common/kvm_log.h"
#include "common/kvm_number.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_stage.h"
#include "compress/eval/kvm_eval.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

static kvm_cli_opt *find_opt(kvm_cli_opt *opts, const char *name)
{
    for (kvm_cli_opt *o = opts; o->name; o++)
        if (strcmp(o->name, name) == 0) return o;
    return NULL;
}

static void print_usage(const char *cmd, const char *summary, const kvm_cli_opt *opts)
{
    printf("usage: kvmill %s [options]\n%s\n\noptions:\n", cmd, summary);
    for (const kvm_cli_opt *o = opts; o->name; o++)
        printf("  %s%s%-*s %s\n", strlen(o->name) == 1 ? "-" : "--", o->name, (int)(22 - strlen(o->name)),
               o->has_arg ? " VALUE" : "", o->help);
    printf("  --help                  show this help\n");
}

/* "-" for a one-letter option (-n), "--" for the others: the spelling the user typed */
static const char *dashes(const char *name) { return name[0] && !name[1] ? "-" : "--"; }

/* 1 when `next`, the argument after an option that takes a value, is itself one of this command's
 * options: "--NAME[=...]" (nb holds NAME) or a one-letter "-X" such as -n. Then the value was
 * forgotten (`--prompt -n 5`), and taking the option for it would leave that option unset. */
static int next_is_option(kvm_cli_opt *opts, const char *next, const char *nb)
{
    if (!strncmp(next, "--", 2)) return find_opt(opts, nb) != NULL;
    return next[0] == '-' && next[1] && !next[2] && find_opt(opts, next + 1) != NULL;
}

int kvm_cli_parse(const char *cmd, const char *summary, int argc, char **argv, kvm_cli_opt *opts,
                  char **pos, int max_pos, int *n_pos, int *help_shown)
{
    *n_pos = 0;
    *help_shown = 0;
    for (int i = 1; i < argc; i++) /* anywhere, also after an unknown option: the user asks how to fix it */
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            print_usage(cmd, summary, opts);
            *help_shown = 1;
            return 2;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] == '-' && a[1] != '\0' && !(a[1] >= '0' && a[1] <= '9')) {
            const char *name = a + (a[1] == '-' ? 2 : 1);
            char buf[64];
            const char *eq = strchr(name, '=');
            const char *inline_val = NULL;
            if (eq && (size_t)(eq - name) < sizeof buf) {
                memcpy(buf, name, (size_t)(eq - name));
                buf[eq - name] = '\0';
                inline_val = eq + 1;
                name = buf;
            }
            kvm_cli_opt *o = find_opt(opts, name);
            if (!o || (a[1] != '-' && strlen(name) != 1)) {
                fprintf(stderr, "kvmill %s: unknown option '%s' (see kvmill %s --help)\n", cmd, a, cmd);
                return 2;
            }
            if (!strncmp(o->help, KVM_CLI_DEPRECATED, strlen(KVM_CLI_DEPRECATED)) && !o->value) {
                const char *nw = o->help + strlen(KVM_CLI_DEPRECATED);
                fprintf(stderr, "kvmill %s: --%s is deprecated: use --%.*s\n", cmd, o->name, (int)strcspn(nw, " ,;)"), nw);
            }
            if (o->has_arg) {
                const char *next = i + 1 < argc ? argv[i + 1] : NULL;
                char nb[64];
                snprintf(nb, sizeof nb, "%.*s", (int)strcspn(next ? next + 2 : "", "="), next ? next + 2 : "");
                if (!inline_val && next && next_is_option(opts, next, nb)) {
                    /* `--out --sculpt`: the value forgotten, the next option taken for it and so not set */
                    fprintf(stderr,
                            "kvmill %s: option '%s' needs a value, and the next argument is the option '%s' "
                            "(a value that begins with '-' is given as %s=VALUE)\n",
                            cmd, a, next, a);
                    return 2;
                }
                const char *v = inline_val ? inline_val : i + 1 < argc ? argv[++i] : NULL;
                if (!v) {
                    fprintf(stderr, "kvmill %s: option '%s' needs a value\n", cmd, a);
                    return 2;
                }
                /* the last one wins, as scripts that append an override to a base command expect,
                 * but said: `--corpus A --corpus B` ran B alone without a word */
                if (o->value && strcmp(o->value, v))
                    fprintf(stderr, "kvmill %s: note: option %s%s is given twice: '%s' applies, not '%s'\n", cmd,
                            dashes(o->name), o->name, v, o->value);
                o->value = v;
            } else {
                if (inline_val) {
                    fprintf(stderr, "kvmill %s: option '--%s' takes no value\n", cmd, name);
                    return 2;
                }
                o->value = "1";
            }
            continue;
        }
        if (*n_pos >= max_pos) {
            fprintf(stderr, "kvmill %s: unexpected argument '%s'\n", cmd, a);
            return 2;
        }
        pos[(*n_pos)++] = argv[i];
    }
    /* an old name and its new one together set one setting twice: refuse, naming both */
    for (const kvm_cli_opt *o = opts; o->name; o++) {
        if (!o->value || strncmp(o->help, KVM_CLI_DEPRECATED, strlen(KVM_CLI_DEPRECATED))) continue;
        const char *nw = o->help + strlen(KVM_CLI_DEPRECATED);
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)strcspn(nw, " ,;)"), nw);
        const kvm_cli_opt *n = find_opt(opts, name);
        if (n && n != o && n->value) {
            fprintf(stderr, "kvmill %s: --%s and --%s set the same setting: give only --%s\n", cmd, o->name, n->name,
                    n->name);
            return 2;
        }
    }
    return 0;
}

const char *kvm_cli_get(const kvm_cli_opt *opts, const char *name)
{
    for (const kvm_cli_opt *o = opts; o->name; o++)
        if (strcmp(o->name, name) == 0) return o->value;
    return NULL;
}

int kvm_cli_int(const char *cmd, const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno == ERANGE && end != s && *end == '\0' && !isspace((unsigned char)*s)) { /* digits beyond 64 bits */
        fprintf(stderr, "kvmill %s: %s%s: %s is outside [%lld, %lld]\n", cmd, dashes(name), name, s, (long long)lo,
                (long long)hi);
        return -1;
    }
    if (errno || end == s || *end != '\0' || isspace((unsigned char)*s)) {
        fprintf(stderr, "kvmill %s: %s%s: '%s' is not an integer\n", cmd, dashes(name), name, s);
        return -1;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "kvmill %s: %s%s: %lld is outside [%lld, %lld]\n", cmd, dashes(name), name, v,
                (long long)lo, (long long)hi);
        return -1;
    }
    *out = v;
    return 0;
}

int kvm_cli_float(const char *cmd, const char *name, const char *s, double lo, double hi, double *out)
{
    double v = 0;
    const int prc = kvm_parse_decimal(s, &v);
    if (prc == KVM_ERANGE) {
        char why[512];
        fprintf(stderr, "kvmill %s: %s%s: %s\n", cmd, dashes(name), name,
                kvm_decimal_range_why(s, lo, hi, why, sizeof why));
        return -1;
    }
    if (prc) {
        fprintf(stderr, "kvmill %s: %s%s: '%s' is not a number\n", cmd, dashes(name), name, s);
        return -1;
    }
    if (v < lo || v > hi) {
        fprintf(stderr, "kvmill %s: %s%s: %g is outside [%g, %g]\n", cmd, dashes(name), name, v, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

int kvm_cli_float_above(const char *cmd, const char *name, const char *s, double lo, double hi, double *out)
{
    double v = 0;
    const int prc = kvm_parse_decimal(s, &v);
    if (prc && prc != KVM_ERANGE) {
        fprintf(stderr, "kvmill %s: %s%s: '%s' is not a number\n", cmd, dashes(name), name, s);
        return -1;
    }
    if (prc == KVM_ERANGE && fabs(strtod(s, NULL)) < 1.0) { /* 1e-308 is inside (0, hi]: a double cannot hold it */
        fprintf(stderr,
                "kvmill %s: %s%s: %s is too close to 0 for a double (it would read as 0, or lose digits): give a "
                "value in (%g, %g] of magnitude at least %g\n",
                cmd, dashes(name), name, s, lo, hi, DBL_MIN);
        return -1;
    }
    if (prc || !(v > lo && v <= hi)) { /* the range as accepted: lo itself is refused */
        fprintf(stderr, "kvmill %s: %s%s: %s is outside (%g, %g]\n", cmd, dashes(name), name, s, lo, hi);
        return -1;
    }
    *out = v;
    return 0;
}

int kvm_cli_check_writable(const char *cmd, const char *what, const char *path)
{
    if (!path || !*path) return 0;
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    struct stat st;
    const char *why = NULL;
    if (stat(dir, &st)) why = strerror(errno);
    else if (!S_ISDIR(st.st_mode)) why = "not a directory";
    else if (access(dir, W_OK | X_OK)) why = strerror(errno);
    if (why) {
        kvm_cli_refuse(cmd, "%s %s: folder %s: %s\n", what, path, dir, why);
        return -1;
    }
    if (!stat(path, &st) && S_ISDIR(st.st_mode)) {
        kvm_cli_refuse(cmd, "%s %s is a directory\n", what, path);
        return -1;
    }
    return 0;
}

int kvm_cli_open_out(const char *cmd, const char *flag, const char *path, FILE **out)
{
    char what[80];
    snprintf(what, sizeof what, "--%s", flag);
    int rc = kvm_file_open_output(path, "w", what, out);
    if (rc) kvm_cli_refuse(cmd, "%s\n", kvm_errmsg());
    return rc == KVM_EINVAL ? 2 : rc ? 1 : 0;
}

/* Opens PATH.part for writing under an exclusive lock (flock), emptied only once the lock is held.
 * Two commands given one output (two evals with the same --csv) shared PATH.part: each emptied
 * and wrote the other's file, the first to finish renamed it into place, exit 0, holding the
 * other's rows. The lock is held until the stream is closed, after the rename; a second
 * command is refused (exit 2) while the first writes. Returns 0, 2 (locked; a FIFO without a
 * reader) or 1, after saying why. */
static int open_part(const char *cmd, const char *flag, const char *path, const char *part, FILE **out)
{
    *out = NULL;
    /* no O_TRUNC before the lock; O_NOFOLLOW: a PATH.part left as a link to a store's data.mdb
     * (or any file) was emptied and written through, the store destroyed */
    int fd = open(part, O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW, 0666);
    if (fd < 0 && errno == ELOOP) {
        kvm_cli_refuse(cmd,
                       "--%s %s: %s is a symbolic link: it would be written through; remove it (only the link), "
                       "then run again\n",
                       flag, path, part);
        return 2;
    }
    if (fd < 0 && errno == ENXIO) {
        kvm_cli_refuse(cmd, "--%s %s: %s: a FIFO that no process is reading; start its reader first\n", flag, path,
                       part);
        return 2;
    }
    if (fd < 0) {
        kvm_cli_refuse(cmd, "--%s %s: %s: %s\n", flag, path, part, strerror(errno));
        return 1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
        close(fd);
        kvm_cli_refuse(cmd,
                       "--%s %s: another process is writing it (%s is locked): wait for it to end, or name another "
                       "file\n",
                       flag, path, part);
        return 2;
    } /* a filesystem without flock: written unlocked, as before */
    struct stat st;
    /* an interrupted eval's rows are worth keeping (it says they are there); another command's
     * leftover (a kill -9, an OOM kill) is emptied and written again, as a rerun expects */
    const int rows = !strcmp(flag, "csv");
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (st.st_nlink > 1 || (rows && st.st_size > 0))) {
        close(fd);
        if (st.st_nlink > 1) /* another name of the same file: emptying it empties that one */
            kvm_cli_refuse(cmd,
                           "--%s %s: %s has %lu other hard link(s): it would be written through; remove it (only "
                           "this name), then run again\n",
                           flag, path, part, (unsigned long)st.st_nlink - 1);
        else /* eval's rows of an interrupted run, which it said are there: emptied without a word */
            kvm_cli_refuse(cmd,
                           "--%s %s: %s holds %lld bytes left by an earlier run that did not finish (an interrupted "
                           "eval keeps its rows there): move it away to keep them, or remove it, then run again\n",
                           flag, path, part, (long long)st.st_size);
        return 2;
    }
    int fl = fcntl(fd, F_GETFL);
    if ((fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ftruncate(fd, 0) != 0) || fl < 0 ||
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0 || !(*out = fdopen(fd, "w"))) {
        const int e = errno;
        close(fd);
        kvm_cli_refuse(cmd, "--%s %s: %s: %s\n", flag, path, part, strerror(e));
        return 1;
    }
    return 0;
}

/* 1 when the file at fd holds LMDB's magic (0xBEEFC0DE, host order) where LMDB puts it: at byte
 * 16 of a data file (the meta of page 0, after the page header), at byte 0 of a lock file. */
static int lmdb_magic(int fd)
{
    unsigned char b[20];
    const ssize_t n = pread(fd, b, sizeof b, 0);
    uint32_t m0 = 0, m16 = 0;
    if (n >= 4) memcpy(&m0, b, 4);
    if (n >= 20) memcpy(&m16, b + 16, 4);
    return m0 == 0xBEEFC0DEu || m16 == 0xBEEFC0DEu;
}

/* 1 when file is one of an LMDB environment's two files: data.mdb or lock.mdb in a folder that
 * holds the other one too (a store's files before LMDB has written its magic), or FILE beside
 * FILE-lock (an environment opened as one file). */
static int lmdb_env_file(const char *file)
{
    const char *slash = strrchr(file, '/'), *base = slash ? slash + 1 : file;
    const char *other = !strcmp(base, "data.mdb") ? "lock.mdb" : !strcmp(base, "lock.mdb") ? "data.mdb" : NULL;
    char p[4200];
    struct stat st; /* the folder: FILE up to its last slash ("" for /data.mdb), or "." */
    if (other &&
        snprintf(p, sizeof p, "%.*s/%s", slash ? (int)(slash - file) : 1, slash ? file : ".", other) < (int)sizeof p &&
        !lstat(p, &st))
        return 1;
    return snprintf(p, sizeof p, "%s-lock", file) < (int)sizeof p && !lstat(p, &st);
}

/* An existing regular file that --FLAG PATH (FILE: PATH, or the file PATH links to) would be
 * renamed over: refused when it is read-only (access(W_OK) fails, or no write permission bit is
 * set: root may write any file, and PATH.part renamed over it replaced it without a word,
 * a corpus document among them) or an LMDB file (a store's data.mdb or lock.mdb: the store was
 * destroyed). Overwriting an earlier output of the same command is what --FLAG is for and goes
 * on. Returns 0, or 2 after saying why. */
static int refuse_existing(const char *cmd, const char *flag, const char *path, const char *file)
{
    struct stat st;
    if (stat(file, &st) || !S_ISREG(st.st_mode)) return 0; /* a new file */
    char link[4200] = "";                                  /* PATH is a link: the file it names is the one replaced */
    if (file != path) snprintf(link, sizeof link, " (a link to %s)", file);
    if (!kvm_file_replaceable(file, &st)) {
        kvm_cli_refuse(cmd,
                       "--%s %s%s exists and is read-only: the command would replace it; name another file, "
                       "or make it writable (chmod u+w) if it is one to replace\n",
                       flag, path, link);
        return 2;
    }
    const int fd = open(file, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    const int magic = fd >= 0 && lmdb_magic(fd);
    if (fd >= 0) close(fd);
    if (magic || lmdb_env_file(file)) {
        kvm_cli_refuse(cmd,
                       "--%s %s%s is an LMDB file (a kvmill store's data.mdb or lock.mdb): writing it "
                       "would destroy that store; name another file\n",
                       flag, path, link);
        return 2;
    }
    return 0;
}

/* The PATH.part files open now (kvm_cli_staged_open until _close or _abort), for the interrupt
 * handler: a command stopped by SIGINT or SIGTERM (make-model, sculpt, calibrate, eval) died by
 * the signal's default action, printed nothing and left PATH.part behind. Each slot holds its
 * own copies (nothing the handler reads is freed) and is published by `active`, set last and
 * cleared first: the handler may run on any thread (the compute pools do not block the signals),
 * so it skips a slot being filled instead of reading half of it. */
#define STAGED_MAX 4
static struct {
    volatile sig_atomic_t active;
    int keep_rows;   /* --csv: the rows written are kept in PATH.part, as after a failure */
    char part[4400]; /* PATH.part */
    char msg[4800];  /* the line the handler writes */
    size_t len;
} staged_reg[STAGED_MAX];

static void staged_on_signal(int sig)
{
    for (int i = 0; i < STAGED_MAX; i++) {
        if (!staged_reg[i].active) continue;
        struct stat st;
        const int empty = stat(staged_reg[i].part, &st) == 0 && st.st_size == 0;
        if (!staged_reg[i].keep_rows || empty) unlink(staged_reg[i].part);
        if (write(2, staged_reg[i].msg, staged_reg[i].len) < 0) break;
    }
    signal(sig, SIG_DFL); /* the exit status says which signal (130 and 143 in a shell) */
    raise(sig);
}

static void staged_register(const char *cmd, const char *flag, const kvm_cli_staged *s)
{
    int i = 0;
    while (i < STAGED_MAX && staged_reg[i].active)
        i++;
    if (i == STAGED_MAX) return; /* more outputs than slots: the extra ones are left as before */
    const int keep = !strcmp(flag, "csv");
    staged_reg[i].keep_rows = keep;
    snprintf(staged_reg[i].part, sizeof staged_reg[i].part, "%s", s->part);
    snprintf(staged_reg[i].msg, sizeof staged_reg[i].msg,
             keep ? "kvmill %s: interrupted: --%s %.2000s was not written; the rows written (if any) are in %.2100s\n"
                  : "kvmill %s: interrupted: --%s %.2000s was not written (%.2100s removed)\n",
             cmd, flag, s->path, s->part);
    staged_reg[i].len = strlen(staged_reg[i].msg);
    atomic_signal_fence(memory_order_seq_cst);
    staged_reg[i].active = 1;
    if (keep) setvbuf(s->f, NULL, _IOLBF, 0); /* each row on the file as it is written: stat sees it */
    const int sigs[2] = {SIGINT, SIGTERM};    /* only where nothing else handles it (run's orchestrator does) */
    for (int k = 0; k < 2; k++) {
        struct sigaction cur, sa = {.sa_handler = staged_on_signal};
        sigemptyset(&sa.sa_mask);
        sigaddset(&sa.sa_mask, SIGINT); /* one runs the handler, the other waits: one line, one status */
        sigaddset(&sa.sa_mask, SIGTERM);
        if (sigaction(sigs[k], NULL, &cur) == 0 && cur.sa_handler == SIG_DFL) sigaction(sigs[k], &sa, NULL);
    }
}

static void staged_unregister(const kvm_cli_staged *s)
{
    for (int i = 0; i < STAGED_MAX; i++)
        if (staged_reg[i].active && !strcmp(staged_reg[i].part, s->part)) {
            staged_reg[i].active = 0;
            break;
        }
}

int kvm_cli_staged_open(const char *cmd, const char *flag, const char *path, kvm_cli_staged *s)
{
    *s = (kvm_cli_staged){.path = path};
    struct stat st, lst;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) /* a FIFO or /dev/stdout: no file to rename over */
        return kvm_cli_open_out(cmd, flag, path, &s->f);
    /* a link to a file: the file is replaced, beside it, as writing through the link did (not the link) */
    if (!lstat(path, &lst) && S_ISLNK(lst.st_mode) && !(s->target = realpath(path, NULL))) {
        kvm_cli_refuse(cmd, "--%s %s: %s\n", flag, path, strerror(errno));
        return 1;
    }
    const char *file = s->target ? s->target : path;
    const int erc = refuse_existing(cmd, flag, path, file);
    if (erc) {
        free(s->target), s->target = NULL;
        return erc;
    }
    size_t n = strlen(file) + sizeof ".part";
    if (!(s->part = malloc(n))) {
        kvm_cli_refuse(cmd, "--%s %s: out of memory\n", flag, path);
        free(s->target), s->target = NULL;
        return 1;
    }
    snprintf(s->part, n, "%s.part", file);
    int rc = open_part(cmd, flag, path, s->part, &s->f);
    if (rc) free(s->part), s->part = NULL, free(s->target), s->target = NULL;
    if (!rc) staged_register(cmd, flag, s);
    return rc;
}

int kvm_cli_staged_close(const char *cmd, const char *flag, kvm_cli_staged *s, int ok)
{
    if (!s->f) return 0;
    if (s->part) staged_unregister(s);
    const int empty = s->part && ftell(s->f) == 0; /* opened before the work, which failed before writing */
    /* renamed (or removed) before fclose releases PATH.part's lock: another command may take the
     * name as soon as it is free */
    int failed = fflush(s->f) != 0 || ferror(s->f), rc = 0;
    const char *why = failed ? strerror(errno) : NULL;
    if (ok && !failed && s->part && rename(s->part, s->target ? s->target : s->path) != 0)
        failed = 1, why = strerror(errno);
    if (ok && failed && s->part) unlink(s->part); /* cut short: no rows worth keeping */
    if (!ok && empty) unlink(s->part);
    if (fclose(s->f) != 0 && !failed) failed = 1, why = strerror(errno);
    s->f = NULL;
    if (ok && failed) {
        kvm_cli_refuse(cmd, "--%s %s: write failed (%s)\n", flag, s->path, why);
        rc = 1;
    } else if (!ok && s->part && !empty) {
        kvm_cli_refuse(cmd,
                       "--%s %s was not written (the command failed); the rows written before the failure are "
                       "in %s\n",
                       flag, s->path, s->part);
    }
    free(s->part);
    free(s->target);
    s->part = s->target = NULL;
    return rc;
}

void kvm_cli_staged_abort(kvm_cli_staged *s)
{
    if (!s->f) return;
    if (s->part) staged_unregister(s);
    if (s->part) unlink(s->part); /* before fclose releases its lock */
    fclose(s->f);                 /* the failure is the caller's to say */
    s->f = NULL;
    free(s->part);
    free(s->target);
    s->part = s->target = NULL;
}

int kvm_cli_list_check(const char *cmd, const char *flag, const char *s, int max)
{
    int n = 0;
    for (const char *p = s;; p++) {
        size_t len = strcspn(p, ",");
        n++;
        if (len == 0) {
            fprintf(stderr, "kvmill %s: --%s '%s': item %d is empty (a list is values separated by single commas)\n",
                    cmd, flag, s, n);
            return -1;
        }
        if (max > 0 && n > max) {
            fprintf(stderr, "kvmill %s: --%s '%s': more than %d comma-separated values\n", cmd, flag, s, max);
            return -1;
        }
        p += len;
        if (!*p) return n;
    }
}

int kvm_cli_check_out(const char *cmd, const char *flag, const char *path)
{
    if (path && !*path) { /* given but empty: the write failed after the work, exit 1 */
        kvm_cli_refuse(cmd, "--%s is empty: name the file to write\n", flag);
        return -1;
    }
    char what[80];
    snprintf(what, sizeof what, "--%s", flag);
    return kvm_cli_check_writable(cmd, what, path);
}

int kvm_cli_path_exists(const char *path)
{
    struct stat st;
    return path && *path && stat(path, &st) == 0;
}

int kvm_cli_check_out_inputs(const char *cmd, const char *flag, const char *out, const char *const *in_flags,
                             const char *const *inputs, int n)
{
    struct stat so;
    if (!out || !*out || stat(out, &so) != 0 || !S_ISREG(so.st_mode)) return 0; /* a new file: nothing to lose */
    for (int i = 0; i < n; i++) {
        /* an item of a comma-separated list (--docs a,b) or a file beside a model (its tokenizer);
         * a value naming a file whole, comma and all, is one item (as cmd_eval_docs_list takes it) */
        const int whole = kvm_cli_path_exists(inputs[i]);
        for (const char *p = inputs[i]; p && *p;) {
            size_t len = whole ? strlen(p) : strcspn(p, ",");
            char path[4096];
            struct stat si;
            snprintf(path, sizeof path, "%.*s", (int)len, p);
            if (len < sizeof path && !stat(path, &si) && si.st_dev == so.st_dev && si.st_ino == so.st_ino) {
                kvm_cli_refuse(cmd, "--%s %s is the %s file %s: writing it would destroy that input; name another "
                                    "file\n", flag, out, in_flags[i], path);
                return -1;
            }
            /* a folder of documents: its *.txt are inputs too */
            size_t ol = strlen(out);
            int txt = ol > 4 && !strcmp(out + ol - 4, ".txt");
            if (txt && len < sizeof path && !stat(path, &si) && S_ISDIR(si.st_mode)) {
                char dir[4096];
                const char *slash = strrchr(out, '/');
                if (!slash) snprintf(dir, sizeof dir, ".");
                else snprintf(dir, sizeof dir, "%.*s", slash == out ? 1 : (int)(slash - out), out);
                struct stat sd;
                if (!stat(dir, &sd) && sd.st_dev == si.st_dev && sd.st_ino == si.st_ino) {
                    kvm_cli_refuse(cmd, "--%s %s is a document of the %s folder %s: writing it would destroy that "
                                        "input; name another file\n", flag, out, in_flags[i], path);
                    return -1;
                }
            }
            p += len;
            if (*p) p++;
        }
    }
    return 0;
}

/* 1 when name ends with suffix. */
static int ends_with(const char *name, const char *suffix)
{
    size_t n = strlen(name), k = strlen(suffix);
    return n >= k && !strcmp(name + n - k, suffix);
}

/* 1 when a folder's entry `name` is a file a model loads from that folder: a Hugging Face
 * folder's config.json, *.safetensors (every shard), *.safetensors.index.json and the tokenizer
 * and generation configs; beside a llama2.c or GGUF file (hf 0) only a tokenizer.json. */
static int model_folder_file(const char *name, int hf)
{
    if (!strcmp(name, "tokenizer.json")) return 1; /* kvm_tokenizer_find_for_model's, either way */
    if (!hf) return 0;
    return !strcmp(name, "config.json") || !strcmp(name, "tokenizer_config.json") ||
           !strcmp(name, "generation_config.json") || ends_with(name, ".safetensors") ||
           ends_with(name, ".safetensors.index.json");
}

/* Refuses out (a regular file, *so) when it is, by identity (st_dev, st_ino: a symlink or
 * another spelling of the path is caught), one of the files model_folder_file names in folder
 * dir (the model's folder, hf 1, or the folder holding the model file). A folder that cannot be
 * read has nothing to refuse here: the model's open says why. Returns 0, or -1 after saying why. */
static int check_out_model_folder(const char *cmd, const char *flag, const char *out, const struct stat *so,
                                  const char *dir, int hf)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int rc = 0;
    for (struct dirent *e; !rc && (e = readdir(d));) {
        char path[4400];
        struct stat si;
        if (!model_folder_file(e->d_name, hf)) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (stat(path, &si) || si.st_dev != so->st_dev || si.st_ino != so->st_ino) continue;
        kvm_cli_refuse(cmd,
                       "--%s %s is the model's %s (%s): writing it would destroy that input; name another "
                       "file\n",
                       flag, out, e->d_name, path);
        rc = -1;
    }
    closedir(d);
    return rc;
}

int kvm_cli_check_out_model(const char *cmd, const char *flag, const char *out, const char *model,
                            const char *tokenizer, const char *docs_flag, const char *docs)
{
    char dir[4096], tok1[4200], tok2[4200];
    const char *slash = model ? strrchr(model, '/') : NULL;
    /* the model's folder: "." without a slash, "/" for /m.bin (its "" opened nothing) */
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash > model ? slash - model : 1) : 1, slash ? model : ".");
    snprintf(tok1, sizeof tok1, "%s/tok512.bin", dir); /* found beside the model without --tokenizer */
    snprintf(tok2, sizeof tok2, "%s/tokenizer.bin", dir);
    const char *beside = "tokenizer (beside the model)";
    const char *flags[] = {"--model", "--tokenizer", beside, beside, docs_flag};
    const char *paths[] = {model, tokenizer, tokenizer ? NULL : tok1, tokenizer ? NULL : tok2, docs};
    if (kvm_cli_check_out_inputs(cmd, flag, out, flags, paths, docs ? 5 : 4)) return -1;
    struct stat so, sm;
    if (!out || !*out || stat(out, &so) != 0 || !S_ISREG(so.st_mode)) return 0; /* a new file: nothing to lose */
    /* a --model or --tokenizer path with a comma, which the list check above splits */
    const char *whole[2] = {model, tokenizer}, *names[2] = {"--model", "--tokenizer"};
    for (int i = 0; i < 2; i++)
        if (whole[i] && !stat(whole[i], &sm) && sm.st_dev == so.st_dev && sm.st_ino == so.st_ino) {
            kvm_cli_refuse(cmd, "--%s %s is the %s file %s: writing it would destroy that input; name another file\n",
                           flag, out, names[i], whole[i]);
            return -1;
        }
    int hf = model && !stat(model, &sm) && S_ISDIR(sm.st_mode); /* a Hugging Face folder */
    return check_out_model_folder(cmd, flag, out, &so, hf ? model : dir, hf);
}

int kvm_cli_read_token_ids(const char *cmd, FILE *f, const char *path, int vocab, int32_t **ids, int64_t *n)
{
    int64_t cap = 256, cnt = 0, line = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    char buf[128];
    int rc = 0;
    while (v && fgets(buf, sizeof buf, f)) {
        line++;
        /* fgets splits a longer line: its pieces read as several ids ("1", spaces, "2" as 1 and 2) */
        if (!strchr(buf, '\n') && !feof(f)) {
            kvm_cli_refuse(cmd, "%s:%lld: line longer than %d characters: one token id per line\n", path,
                           (long long)line, (int)sizeof buf - 2);
            rc = 2;
            break;
        }
        char *s = buf, *end;
        if (line == 1 && !strncmp(s, "\xEF\xBB\xBF", 3))
            s += 3; /* a UTF-8 byte-order mark (an editor's), as configs skip it */
        while (*s == ' ' || *s == '\t')
            s++;
        if (*s == '\n' || *s == '\0') continue;
        errno = 0;
        long id = strtol(s, &end, 10);
        while (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n')
            end++;
        if (errno || end == s || *end || id < 0 || id >= vocab) {
            kvm_cli_refuse(cmd, "%s:%lld: '%.*s' is not a token id in [0, %d)\n", path, (long long)line,
                           (int)strcspn(buf, "\r\n"), buf, vocab);
            rc = 2;
            break;
        }
        if (cnt == cap) {
            int32_t *nv = realloc(v, (size_t)(cap *= 2) * sizeof *v);
            if (!nv) {
                free(v);
                v = NULL;
                break;
            }
            v = nv;
        }
        v[cnt++] = (int32_t)id;
    }
    /* fgets says NULL for a read error as for the end: the ids before it were taken for the
     * whole prompt (or "no token ids"), exit 0 on a cut-short prompt */
    if (v && !rc && ferror(f)) {
        kvm_cli_refuse(cmd, "%s:%lld: read error: %s\n", path, (long long)line + 1, strerror(errno));
        rc = 1;
    }
    if (!v) {
        kvm_cli_refuse(cmd, "out of memory\n");
        return 1;
    }
    if (!rc && cnt == 0) {
        kvm_cli_refuse(cmd, "%s: no token ids\n", path);
        rc = 2;
    }
    if (rc) {
        free(v);
        return rc;
    }
    *ids = v;
    *n = cnt;
    return 0;
}

void kvm_cli_csv_field(FILE *f, const char *v)
{
    if (!v[strcspn(v, ",\"\r\n")]) {
        fputs(v, f);
        return;
    }
    fputc('"', f);
    for (const char *p = v; *p; p++) {
        if (*p == '"') fputc('"', f);
        fputc(*p, f);
    }
    fputc('"', f);
}

const char *kvm_cli_errmsg(const char *cmd)
{
    const char *m = kvm_errmsg();
    if (!cmd) return m;
    size_t full = strlen(cmd), word = strcspn(cmd, " "); /* "store compact: ..." or "store: ..." */
    if (full && !strncmp(m, cmd, full) && m[full] == ':' && m[full + 1] == ' ') return m + full + 2;
    if (word && !strncmp(m, cmd, word) && m[word] == ':' && m[word + 1] == ' ') return m + word + 2;
    return m;
}

void kvm_cli_log_config(const char *cmd, const char *stage, const kvm_config *cfg)
{
    char prefix[64];
    snprintf(prefix, sizeof prefix, "kvmill %s: ", cmd);
    kvm_log_setup(stage, prefix, kvm_config_str(cfg, "run", "log_format")); /* a validated choice */
}

int kvm_cli_check_run_bind(const char *cmd, const kvm_config *cfg, int from_flag)
{
    const char *bind = kvm_config_str(cfg, "run", "bind");
    char ctl_ep[1100], data_ep[1100], what[1200];
    if (!*bind) return 0;
    /* ipc://DIR holds the two sockets: a missing DIR failed at the bind, exit 1 */
    if (kvm_stage_endpoints(bind, ctl_ep, data_ep, sizeof ctl_ep) ||
        kvm_serve_ipc_folder_check(bind, 1, NULL, "the run binds its ctl and data sockets in it")) {
        if (from_flag)
            kvm_cli_refuse(cmd, "--bind %s: %s\n", bind, kvm_errmsg());
        else
            kvm_cli_refuse(cmd, "%s: [run] bind = %s: %s\n", kvm_config_path(cfg), bind, kvm_errmsg());
        return -1;
    }
    /* the keys a non-local bind needs, as the bind itself checks them (the workers' sockets); a
     * --bind value named the config file, which has no bind */
    if (from_flag)
        snprintf(what, sizeof what, "--bind (with the keys of %s):", kvm_config_path(cfg));
    else
        snprintf(what, sizeof what, "[run] bind in %s:", kvm_config_path(cfg));
    if (!kvm_serve_bind_rule(ctl_ep, cfg, what) && !kvm_serve_bind_rule(data_ep, cfg, what)) return 0;
    kvm_cli_refuse(cmd, "%s\n", kvm_errmsg());
    return -1;
}

void kvm_cli_refuse(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (kvm_log_format_get() == KVM_LOG_JSON) {
        kvm_logv(KVM_LOG_ERROR, "refused", NULL, 0, fmt, ap);
    } else {
        /* messages quote names (a --docs path, a document's): control bytes in one, a newline
         * above all, went out raw and could fake a line; fmt's own newline ends the line */
        char msg[8192], safe[4 * sizeof msg + 1];
        vsnprintf(msg, sizeof msg, fmt, ap);
        /* the newline is fmt's: a message cut at sizeof msg has lost it but still ends its line */
        size_t n = strlen(msg), nf = strlen(fmt);
        int nl = nf && fmt[nf - 1] == '\n';
        if (n && msg[n - 1] == '\n') msg[n - 1] = '\0';
        fprintf(stderr, "kvmill %s: %s%s", cmd, kvm_log_escape(msg, 0, safe, sizeof safe), nl ? "\n" : "");
    }
    va_end(ap);
}

const char *kvm_cli_methods(void)
{
    static char buf[512];
    if (!buf[0]) {
        int n;
        const kvm_method *m = kvm_method_table(&n);
        size_t at = 0;
        for (int i = 0; i < n && at < sizeof buf; i++)
            at += (size_t)snprintf(buf + at, sizeof buf - at, "%s%s%s", i ? "|" : "", m[i].name,
                                   m[i].arg == 2 ? ":FILE" : m[i].arg == 1 ? "[:OPTS]" : "");
    }
    return buf;
}

/* The errno of stdout's first failed write (kvm_cli_flush_stdout). */
static int g_stdout_errno;

void kvm_cli_stdout_failed(int e)
{
    if (!g_stdout_errno) g_stdout_errno = e ? e : EIO;
}

int kvm_cli_flush_stdout(void)
{
    errno = 0;
    const int rc = fflush(stdout);
    if (rc) kvm_cli_stdout_failed(errno);
    return rc;
}

int kvm_cli_stdout_errno(void) { return g_stdout_errno; }
