/* kvm_file.c: see kvm_file.h. */
#include "common/kvm_file.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "common/kvm_error.h"

int kvm_file_open_input(const char *path, const char *mode, const char *what, FILE **out)
{
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0)
        return kvm_err(errno == ENOENT || errno == ENOTDIR ? KVM_ENOTFOUND : KVM_EIO, "%s %s: %s", what, path,
                       strerror(errno));
    if (S_ISDIR(st.st_mode)) return kvm_err(KVM_EFORMAT, "%s %s: is a directory, not a %s file", what, path, what);
    FILE *f = fopen(path, mode);
    if (!f)
        return kvm_err(errno == ENOENT ? KVM_ENOTFOUND : KVM_EIO, "%s %s: %s", what, path, strerror(errno));
    *out = f;
    return 0;
}
