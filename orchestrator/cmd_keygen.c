/* cmd_keygen.c: `kvmill keygen`: a CurveZMQ key pair for a server, client or worker. */
#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_curve.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
    char pub[4096], sec[4096];
    snprintf(pub, sizeof pub, "%s.public", prefix);
    snprintf(sec, sizeof sec, "%s.secret", prefix);
    if (!kvm_cli_get(opts, "force") && (access(pub, F_OK) == 0 || access(sec, F_OK) == 0))
        return fprintf(stderr, "kvmill keygen: %s or %s exists; use --force to replace it\n", pub, sec), 2;
    /* the folders of PREFIX (keys/server) are made as needed, private (0700) */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", prefix);
    for (char *p = dir + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(dir, 0700) && errno != EEXIST)
            return fprintf(stderr, "kvmill keygen: cannot make folder %s: %s\n", dir, strerror(errno)), 1;
        *p = '/';
    }
    if (kvm_curve_keygen(prefix)) return fprintf(stderr, "kvmill keygen: %s\n", kvm_cli_errmsg("keygen")), 1;
    printf("%s\n%s\n", pub, sec);
    return 0;
}
