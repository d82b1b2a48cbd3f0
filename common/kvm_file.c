/* kvm_file.c: see kvm_file.h. */
#include "common/kvm_file.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kvm_error.h"

/* The stream of fd, opened with O_NONBLOCK (so that a FIFO without its other end does not
 * block the open), with O_NONBLOCK cleared for the reads or writes that follow. On failure fd
 * is closed and KVM_EIO set, naming what and path. */
static int stream_of(int fd, const char *mode, const char *what, const char *path, FILE **out)
{
    int fl = fcntl(fd, F_GETFL);
    FILE *f = fl >= 0 && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == 0 ? fdopen(fd, mode) : NULL;
    if (!f) {
        int e = errno;
        close(fd);
        return kvm_err(KVM_EIO, "%s %s: %s", what, path, strerror(e));
    }
    *out = f;
    return 0;
}

int kvm_file_open_input(const char *path, const char *mode, const char *what, FILE **out)
{
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0)
        return kvm_err(errno == ENOENT || errno == ENOTDIR ? KVM_ENOTFOUND : KVM_EIO, "%s %s: %s", what, path,
                       strerror(errno));
    if (S_ISDIR(st.st_mode)) return kvm_err(KVM_EFORMAT, "%s %s: is a directory, not a %s file", what, path, what);
    /* O_NONBLOCK: a FIFO with no writer blocked the open for ever; opened so, it reads as empty (its
     * writer, as a shell's <(...), already there is read as before); cleared for the reads */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "%s %s: %s", what, path, strerror(errno));
    return stream_of(fd, mode, what, path, out);
}

int kvm_file_check_found(const char *path)
{
    struct stat st, lst;
    if (stat(path, &st) == 0) {
        if (S_ISREG(st.st_mode)) return 0;
        const char *kind = S_ISDIR(st.st_mode) ? "directory" : S_ISFIFO(st.st_mode) ? "FIFO" : "device or socket";
        return kvm_err(KVM_EFORMAT, "%s: not a regular file (a %s)", path, kind);
    }
    int e = errno;
    if (e == ENOENT && lstat(path, &lst) == 0) {
        char to[1024];
        ssize_t n = readlink(path, to, sizeof to - 1);
        to[n > 0 ? n : 0] = '\0';
        return kvm_err(KVM_EFORMAT, "%s: a symbolic link to '%s', which does not exist (an unfinished download?)", path,
                       to);
    }
    if (e == ENOENT) return kvm_err(KVM_ENOTFOUND, "%s: no such file", path);
    return kvm_err(e == ELOOP || e == ENOTDIR || e == ENAMETOOLONG ? KVM_EFORMAT : KVM_EIO, "%s: %s", path,
                   strerror(e));
}

int kvm_file_open_output(const char *path, const char *mode, const char *what, FILE **out)
{
    *out = NULL;
    /* O_NONBLOCK: fopen of a FIFO with no reader waited for one for ever; here it fails with ENXIO */
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC, 0666);
    if (fd < 0 && errno == ENXIO)
        return kvm_err(KVM_EINVAL, "%s %s: a FIFO that no process is reading; start its reader first", what, path);
    if (fd < 0) return kvm_err(KVM_EIO, "%s %s: %s", what, path, strerror(errno));
    return stream_of(fd, mode, what, path, out);
}

int kvm_file_replaceable(const char *path, const struct stat *st)
{
    return !access(path, W_OK) && (st->st_mode & (S_IWUSR | S_IWGRP | S_IWOTH));
}

int kvm_file_path_norm(const char *path, char *out, size_t n)
{
    char abs[8192], cwd[4096];
    snprintf(out, n, "%s", path);
    if (path[0] != '/' && !getcwd(cwd, sizeof cwd)) return -1;
    if ((size_t)snprintf(abs, sizeof abs, "%s%s%s", path[0] == '/' ? "" : cwd, path[0] == '/' ? "" : "/", path) >=
        sizeof abs)
        return -1;
    const char *comp[512];
    int nc = 0;
    char *save = NULL;
    for (char *t = strtok_r(abs, "/", &save); t; t = strtok_r(NULL, "/", &save))
        if (!strcmp(t, ".."))
            nc -= nc > 0;
        else if (strcmp(t, ".") && nc < 512)
            comp[nc++] = t;
    for (int k = nc; k >= 0; k--) { /* the longest existing leading part, through its links */
        char head[8192] = "/", real[PATH_MAX];
        for (int i = 0; i < k; i++)
            snprintf(head + strlen(head), sizeof head - strlen(head), "%s%s", i ? "/" : "", comp[i]);
        if (!realpath(head, real)) continue;
        size_t len = (size_t)snprintf(out, n, "%s", real);
        for (int i = k; i < nc && len < n; i++)
            len += (size_t)snprintf(out + len, n - len, "%s%s", len && out[len - 1] == '/' ? "" : "/", comp[i]);
        if (len < n) return 0;
        break;
    }
    snprintf(out, n, "%s", path);
    return -1;
}

int kvm_file_boot_id(char out[17])
{
    char buf[64] = "";
    out[0] = '\0';
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f), k = 0;
    fclose(f);
    for (size_t i = 0; i < n && k < 16; i++)
        if ((buf[i] >= '0' && buf[i] <= '9') || (buf[i] >= 'a' && buf[i] <= 'f')) out[k++] = buf[i];
    out[k] = '\0';
    return k == 16 ? 0 : -1;
}
