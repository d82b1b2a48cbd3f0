/* kvm_spawn.h: starting and reaping the child processes of `kvmill run` (stage workers),
 * `kvmill serve` (decode workers) and both (the store service): one posix_spawn set-up, so
 * that every child is in its own process group, gets its log and its signals the same way. */
#ifndef KVM_SPAWN_H
#define KVM_SPAWN_H

#include <sys/types.h>

typedef struct kvm_config kvm_config;

/* Signals the child starts with at their default action (kvm_spawn_opts.default_signals). */
enum {
    KVM_SPAWN_DEFAULT_SIGINT = 1 << 0,  /* SIGINT */
    KVM_SPAWN_DEFAULT_SIGTERM = 1 << 1, /* SIGTERM */
};

/* How one child is started, besides its argv. */
typedef struct kvm_spawn_opts {
    const char *log_path; /* stdout and stderr appended to this file (created 0644); NULL: the parent's */
    int default_signals;  /* KVM_SPAWN_DEFAULT_* bits; 0: the child inherits the parent's dispositions */
    const char *what;     /* names the child in the error, "cannot start WHAT: ..."; NULL: exe */
} kvm_spawn_opts;

/* Starts exe with argv (NULL-terminated, argv[0] included) and this process's environment, in a
 * process group of its own, so that a Ctrl-C at the terminal reaches the parent only, which
 * stops its children in order. default_signals resets the named signals in the child: a parent
 * started in the background by a shell ignores SIGINT, and an ignored signal is inherited, so
 * without the reset the child would not stop on it. Writes the child's pid to *pid (0 on
 * failure). Borrows exe, argv and opts (opts may be NULL: no log, no reset, exe in the error)
 * for the call only. Returns 0, or KVM_EIO when posix_spawn fails (exe missing or not
 * executable, no memory, too many processes), with the detail "cannot start WHAT: strerror".
 * Thread-safe as posix_spawn is; the caller reaps the child (kvm_spawn_reaped or waitpid). */
int kvm_spawn_start(pid_t *pid, const char *exe, char *const argv[], const kvm_spawn_opts *opts);

/* Reaps child *pid without blocking: returns 1 and sets *pid = 0 when it has exited, 0 while it
 * runs. By pid, never waitpid(-1), which would reap children that are not ours. *pid must be > 0. */
int kvm_spawn_reaped(pid_t *pid);

/* Writes the six argv entries that give a stage worker the CurveZMQ keys of cfg's [security]
 * section: --server-key, --client-public, --client-secret, each followed by its value (borrowed
 * from cfg: valid while cfg is open). argv must have room for six. Returns 6, the count written. */
int kvm_spawn_curve_args(char **argv, const kvm_config *cfg);

/* A worker process a command started, as kvm_spawn_join_check reports it. */
typedef struct kvm_spawn_worker {
    const char *what;     /* its kind in the log: "decode worker", "prefill worker" */
    const char *id;       /* its worker id (--id) */
    pid_t pid;            /* its process */
    double started_ms;    /* when it was started (kvm_now_ms) */
    const char *endpoint; /* where it was told to connect */
    const char *log_hint; /* where its output goes, a sentence: "Its log: PATH" */
} kvm_spawn_worker;

/* Says, once, that worker w has not joined (sent ready) join_warn_s seconds ([run] join_warn_s)
 * after its start: a warning (event worker_not_joined) naming it, its pid, the time since its
 * start, its endpoint and w->log_hint; and, after that, that it joined (info, worker_joined_late).
 * *state is this process's: 0 when it starts, then 1 (reported) or 2 (joined: nothing more to
 * say); joined: whether it has joined now. Borrows w; thread-safe as kvm_log. */
void kvm_spawn_join_check(const kvm_spawn_worker *w, int joined, double join_warn_s, double now_ms, int *state);

#endif
