/* kvm_spawn.c: posix_spawn of the pipeline's child processes and their reaping (kvm_spawn.h). */
#include "pipeline/kvm_spawn.h"
#include "pipeline/kvm_config.h"
#include "common/kvm_error.h"
#include "common/kvm_log.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

int kvm_spawn_start(pid_t *pid, const char *exe, char *const argv[], const kvm_spawn_opts *opts)
{
    const kvm_spawn_opts none = {NULL, 0, NULL};
    if (!opts) opts = &none;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (opts->log_path) {
        posix_spawn_file_actions_addopen(&fa, 1, opts->log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        posix_spawn_file_actions_addopen(&fa, 2, opts->log_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    }
    posix_spawnattr_t at;
    posix_spawnattr_init(&at);
    short flags = POSIX_SPAWN_SETPGROUP;
    if (opts->default_signals) {
        sigset_t def;
        sigemptyset(&def);
        if (opts->default_signals & KVM_SPAWN_DEFAULT_SIGINT) sigaddset(&def, SIGINT);
        if (opts->default_signals & KVM_SPAWN_DEFAULT_SIGTERM) sigaddset(&def, SIGTERM);
        posix_spawnattr_setsigdefault(&at, &def);
        flags |= POSIX_SPAWN_SETSIGDEF;
    }
    posix_spawnattr_setflags(&at, flags);
    int rc = posix_spawn(pid, exe, opts->log_path ? &fa : NULL, &at, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    if (rc) {
        *pid = 0;
        if (rc == ENOENT && opts->log_path && access(exe, X_OK) == 0) /* the log file, not the program */
            return kvm_err(KVM_EIO, "cannot start %s: cannot open its log file %s: %s", opts->what ? opts->what : exe,
                           opts->log_path, strerror(rc));
        return kvm_err(KVM_EIO, "cannot start %s: %s", opts->what ? opts->what : exe, strerror(rc));
    }
    return 0;
}

int kvm_spawn_reaped(pid_t *pid)
{
    if (waitpid(*pid, NULL, WNOHANG) != *pid) return 0;
    *pid = 0;
    return 1;
}

int kvm_spawn_curve_args(char **argv, const kvm_config *cfg)
{
    argv[0] = "--server-key", argv[1] = (char *)kvm_config_str(cfg, "security", "server_public_key");
    argv[2] = "--client-public", argv[3] = (char *)kvm_config_str(cfg, "security", "client_public_key");
    argv[4] = "--client-secret", argv[5] = (char *)kvm_config_str(cfg, "security", "client_secret_key");
    return 6;
}

void kvm_spawn_join_check(const kvm_spawn_worker *w, int joined, double join_warn_s, double now_ms, int *state)
{
    const double age_s = (now_ms - w->started_ms) / 1000;
    kvm_log_field f[] = {KVM_LOG_S("worker", w->id), KVM_LOG_I("pid", w->pid), KVM_LOG_F("since_start_s", age_s)};
    if (joined && *state == 1)
        kvm_log(KVM_LOG_INFO, "worker_joined_late", f, 3, "%s %s (pid %ld) joined %.0f s after its start", w->what,
                w->id, (long)w->pid, age_s);
    if (joined) {
        *state = 2;
    } else if (*state == 0 && age_s >= join_warn_s) {
        *state = 1;
        kvm_log(KVM_LOG_WARN, "worker_not_joined", f, 3,
                "%s %s (pid %ld) started %.0f s ago and has not joined ([run] join_warn_s): is it still loading, or "
                "connecting elsewhere than %s? %s",
                w->what, w->id, (long)w->pid, age_s, w->endpoint, w->log_hint);
    }
}
