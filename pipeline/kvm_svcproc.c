/* kvm_svcproc.c: starting, restarting and stopping the store service child (kvm_svcproc.h). */
#include "pipeline/kvm_svcproc.h"
#include "pipeline/kvm_spawn.h"
#include "pipeline/kvm_stage.h"
#include "common/kvm_error.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Bytes of the log from offset `from`: does it hold "ready on"? Also its last line, for errors. */
static int log_ready(const char *path, long from, char *last, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[1024];
    int ready = 0;
    fseek(f, from, SEEK_SET);
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "ready on")) ready = 1;
        line[strcspn(line, "\n")] = '\0';
        if (*line) snprintf(last, n, "%s", line);
    }
    fclose(f);
    return ready;
}

static int spawn(kvm_svcproc *p, double timeout_ms)
{
    /* --create: kvmill run has made the store already, and kvmill serve refused a missing one
     * unless the workers are to fill it (compute_missing) */
    /* --parent-pid: the service stops when this process is gone (a kill -9 of kvmill run or
     * serve left it holding the store and the endpoint, and the next run could not bind) */
    char ppid[32];
    snprintf(ppid, sizeof ppid, "%ld", (long)getpid());
    char *argv[] = {p->exe, "--store", p->store, "--bind", p->bind, "--create", "--parent-pid", ppid, NULL, NULL, NULL};
    if (p->config[0]) argv[8] = "--config", argv[9] = p->config;
    FILE *lf = fopen(p->log, "a");
    long from = lf ? ftell(lf) : 0;
    if (lf) fclose(lf);
    char what[2100];
    snprintf(what, sizeof what, "the store service %s", p->exe);
    const kvm_spawn_opts so = {p->log, 0, what};
    int rc = kvm_spawn_start(&p->pid, p->exe, argv, &so);
    if (rc) return rc;
    char last[1024] = "(no output)";
    for (double end = kvm_now_ms() + timeout_ms; kvm_now_ms() < end; usleep(20000)) {
        if (log_ready(p->log, from, last, sizeof last)) return 0;
        int st;
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) {
            p->pid = 0;
            return kvm_err(KVM_EIO, "the store service (%s --bind %s) exited at start: %s (log %s)", p->exe, p->bind,
                           last, p->log);
        }
    }
    kvm_svcproc_stop(p, 1000);
    return kvm_err(KVM_EIO, "the store service (%s --bind %s) was not ready within %.0f ms: %s (log %s)", p->exe, p->bind,
                   timeout_ms, last, p->log);
}

int kvm_svcproc_start(kvm_svcproc *p, const char *bin_dir, const char *store, const char *bind, const char *config,
                      const char *log, double timeout_ms)
{
    memset(p, 0, sizeof *p);
    snprintf(p->exe, sizeof p->exe, "%s/kvmill-store", bin_dir);
    snprintf(p->store, sizeof p->store, "%s", store);
    snprintf(p->bind, sizeof p->bind, "%s", bind);
    snprintf(p->config, sizeof p->config, "%s", config ? config : "");
    snprintf(p->log, sizeof p->log, "%s", log);
    if (access(p->exe, X_OK) != 0)
        return kvm_err(KVM_EINVAL, "[store] service_bind: %s is missing or not executable (build with make, or set "
                                   "[stages] bin_dir)", p->exe);
    return spawn(p, timeout_ms);
}

int kvm_svcproc_restart(kvm_svcproc *p, double timeout_ms)
{
    p->restarts++;
    p->asked = 0;
    return spawn(p, timeout_ms);
}

static long log_size(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n < 0 ? 0 : n;
}

/* The log from offset `from`: its "stays up for WHOM until" line (kvm_storesvc.c, svc_stop_now)?
 * WHOM into whom[0, n). */
static int log_staying(const char *path, long from, char *whom, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[4096];
    int found = 0;
    fseek(f, from, SEEK_SET);
    while (!found && fgets(line, sizeof line, f)) {
        char *a = strstr(line, "stays up for "), *b = a ? strstr(a, " until ") : NULL;
        if (b) found = 1, snprintf(whom, n, "%.*s", (int)(b - a - 13), a + 13);
    }
    fclose(f);
    return found;
}

int kvm_svcproc_ask_stop(kvm_svcproc *p, double grace_ms, char *whom, size_t n)
{
    if (n) whom[0] = '\0';
    if (p->pid <= 0) return 0;
    long from = log_size(p->log);
    kill(p->pid, SIGTERM);
    for (double end = kvm_now_ms() + grace_ms; kvm_now_ms() < end; usleep(20000)) {
        if (waitpid(p->pid, NULL, WNOHANG) == p->pid) {
            p->pid = 0;
            return 0;
        }
        if (log_staying(p->log, from, whom, n)) return p->asked = 1;
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
    return 0;
}

void kvm_svcproc_stop(kvm_svcproc *p, double grace_ms)
{
    if (p->pid <= 0) return;
    kill(p->pid, SIGTERM);
    /* a second stop request stops a service that stays up for other runs' claims: two different
     * signals, since a second SIGTERM sent before the first is handled is merged with it */
    if (!p->asked) kill(p->pid, SIGINT);
    for (double end = kvm_now_ms() + grace_ms; kvm_now_ms() < end; usleep(20000))
        if (waitpid(p->pid, NULL, WNOHANG) == p->pid) {
            p->pid = 0;
            break;
        }
    if (p->pid > 0) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, NULL, 0);
    }
    p->pid = 0;
    p->asked = 0;
}
