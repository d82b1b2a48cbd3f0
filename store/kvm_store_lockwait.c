/* kvm_store_lockwait.c: the watchdog of waits for LMDB's write lock (kvm_store_lockwait.h)
 * and kvm_store_set_interrupt. */
#include "store/kvm_store_lockwait.h"

#include <ctype.h>
#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/kvm_log.h"
#include "store/kvm_store.h"

/* The process's watched waits. The list and said_since are the mutex's; state and
 * intr_at_start are atomics, written by the waiting thread without it (the hot path). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* wakes the watchdog to stop; CLOCK_MONOTONIC */
    kvm_store__lockwait *head;
    pid_t pid;                      /* the process g.running and g.th belong to */
    int running;                    /* 1: this process's watchdog runs (g.th) */
    pthread_t th;                   /* the watchdog, joined when the list empties */
    unsigned gen;                   /* bumped to stop the running watchdog */
    unsigned tick;                  /* the watchdog's looks, counted */
    const atomic_int *_Atomic flag; /* kvm_store_set_interrupt's; NULL none */
    const char *_Atomic note;       /* what an interrupt leaves undone; may be NULL */
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int64_t mono_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

void kvm_store_set_interrupt(const atomic_int *flag, const char *note)
{
    atomic_store(&g.note, note);
    atomic_store(&g.flag, flag);
}

/* ---- the hot path: the waiting thread ---- */

void kvm_store__lockwait_begin(kvm_store__lockwait *w)
{
    const atomic_int *flag = atomic_load(&g.flag);
    atomic_store(&w->intr_at_start, flag ? atomic_load(flag) : 0);
    atomic_store(&w->state, mono_ms() + 1); /* > 0 even right after boot */
}

int kvm_store__lockwait_got(kvm_store__lockwait *w, int holding)
{
    int64_t since = atomic_load(&w->state);
    /* fails only when the watchdog moved the state to STOPPING first */
    return !atomic_compare_exchange_strong(&w->state, &since, holding ? KVM_STORE__LW_WRITING : 0);
}

_Noreturn void kvm_store__lockwait_park(void)
{
    for (;;)
        pause();
}

void kvm_store__lockwait_end(kvm_store__lockwait *w) { atomic_store(&w->state, 0); }

/* ---- the watchdog ---- */

/* 1 when process `pid` (its /proc name) is stopped (state T or t in /proc/PID/stat), its
 * command name then in comm[n]. */
static int proc_stopped(const char *pid, char *comm, size_t n)
{
    char p[64], stat[512];
    snprintf(p, sizeof p, "/proc/%s/stat", pid);
    FILE *f = fopen(p, "r");
    size_t got = f ? fread(stat, 1, sizeof stat - 1, f) : 0;
    if (f) fclose(f);
    stat[got] = '\0';
    /* "PID (COMM) STATE ...": COMM may hold spaces and parentheses, the last ')' ends it */
    char *open_paren = strchr(stat, '('), *close_paren = strrchr(stat, ')');
    if (!open_paren || !close_paren || close_paren < open_paren || (close_paren[2] != 'T' && close_paren[2] != 't'))
        return 0;
    snprintf(comm, n, "%.*s", (int)(close_paren - open_paren - 1), open_paren + 1);
    return 1;
}

/* 1 when process `pid` has the file `want` (a resolved path) open. Another user's: 0. */
static int proc_has_open(const char *pid, const char *want)
{
    char p[64];
    snprintf(p, sizeof p, "/proc/%s/fd", pid);
    DIR *fds = opendir(p);
    if (!fds) return 0;
    int found = 0;
    for (struct dirent *d; !found && (d = readdir(fds));) {
        char fdp[128], target[PATH_MAX];
        snprintf(fdp, sizeof fdp, "%s/%s", p, d->d_name);
        ssize_t len = readlink(fdp, target, sizeof target - 1);
        if (len <= 0) continue;
        target[len] = '\0';
        found = !strcmp(target, want);
    }
    closedir(fds);
    return found;
}

/* Names, into buf ("PID (COMM), ..."; at most 4), the stopped processes that have lockfile
 * open: the likely holders of the write lock (a kvmill writer stopped inside a commit). Empty
 * when there is none or /proc cannot be read. */
static void stopped_holders(const char *lockfile, char *buf, size_t n)
{
    char want[PATH_MAX];
    buf[0] = '\0';
    if (!realpath(lockfile, want)) return;
    DIR *proc = opendir("/proc");
    if (!proc) return;
    size_t at = 0;
    int found = 0;
    for (struct dirent *e; (e = readdir(proc)) && found < 4;) {
        char comm[64];
        if (!isdigit((unsigned char)e->d_name[0]) || atol(e->d_name) == (long)getpid()) continue;
        if (!proc_stopped(e->d_name, comm, sizeof comm) || !proc_has_open(e->d_name, want)) continue;
        int w = snprintf(buf + at, n - at, "%s%s (%s)", found ? ", " : "", e->d_name, comm);
        if (w > 0 && (size_t)w < n - at) at += (size_t)w;
        found++;
    }
    closedir(proc);
}

/* What one look at a wait found, copied under the mutex so that the slow part (the /proc
 * scan, stderr) runs without it: a stderr pipe whose reader is stopped must not block open,
 * close or fork (whose atfork handler takes the mutex) in the rest of the process. */
typedef struct {
    kvm_store__lockwait *w; /* identity only: it may be closed once the mutex is let go */
    int64_t since;          /* the wait's start (its state), 0 none */
    int64_t waited_ms;      /* how long it has waited */
    int64_t ended_after_ms; /* > 0: a wait said before is over after this long */
    int say_wait;           /* a new long wait: say it */
    int scan;               /* look for a stopped holder in /proc */
    int interrupted;        /* the flag moved during the wait */
    int flag_now;           /* the flag's value then */
    int say_busy;           /* the interrupt is left to the process's drain: say so (once a wait) */
    char path[PATH_MAX];    /* its store's directory (a copy); last: take zeroes what is before */
} look;

static void say_end(const char *path, int64_t after_ms)
{
    kvm_log(KVM_LOG_INFO, "store_lock_wait_end", (kvm_log_field[]){KVM_LOG_S("store", path)}, 1,
            "the wait for the store's write lock on %s is over (after about %lld s)\n", path,
            (long long)(after_ms / 1000));
}

/* Says a wait of KVM_STORE__LOCKWAIT_SAY_MS or more, worded by what the /proc scan found
 * (stopped: its stopped processes that have the store open, empty when none): a holder that
 * is only busy is not called stopped or hung. */
static void say_wait(const look *lk, const char *lockfile, const char *stopped)
{
    int has_flag = atomic_load(&g.flag) != NULL;
    kvm_log(KVM_LOG_WARN, "store_lock_wait",
            (kvm_log_field[]){KVM_LOG_S("store", lk->path), KVM_LOG_I("waited_s", lk->waited_ms / 1000)}, 2,
            "waiting for the store's write lock on %s for %lld s: %s%s%s; `fuser -v %s` or `lsof %s` lists the "
            "processes that have the store open%s\n",
            lk->path, (long long)(lk->waited_ms / 1000),
            stopped[0] ? "a stopped process likely holds it (a kvmill writer stopped with Ctrl-Z or kill -STOP); "
                         "stopped among them: "
                       : "another process holds it (busy, or hung)",
            stopped, stopped[0] ? " (kill -CONT PID resumes one, or end it)" : "", lockfile, lockfile,
            !has_flag    ? ""
            : stopped[0] ? "; Ctrl-C ends this process"
                         : "; a first Ctrl-C takes effect once the lock comes, a second ends this process now");
}

/* Ends the process for an interrupt during lk's long wait, unless it got the lock meanwhile,
 * was closed, or another handle of the process is inside a write transaction (then the next
 * tick looks again). The waiter holds no write transaction: nothing of this process is
 * half-written. */
static void stop_for_interrupt(const look *lk)
{
    pthread_mutex_lock(&g.mu);
    kvm_store__lockwait *w = g.head;
    while (w && w != lk->w)
        w = w->next;
    int ok = w != NULL;
    for (const kvm_store__lockwait *o = g.head; ok && o; o = o->next)
        if (o != w && atomic_load(&o->state) == KVM_STORE__LW_WRITING) ok = 0;
    int64_t since = lk->since;
    ok = ok && atomic_compare_exchange_strong(&w->state, &since, KVM_STORE__LW_STOPPING);
    pthread_mutex_unlock(&g.mu);
    if (!ok) return;
    /* STOPPING: the waiter parks once it gets the lock; nothing else of it runs */
    const char *note = atomic_load(&g.note);
    kvm_log(KVM_LOG_WARN, "store_lock_interrupted", (kvm_log_field[]){KVM_LOG_S("store", lk->path)}, 1,
            "interrupted while waiting for the store's write lock on %s: exiting (status 130); nothing of this "
            "process was being written to the store%s%s\n",
            lk->path, note ? "; " : "", note ? note : "");
    _exit(130);
}

/* The fast part of one look at w: its state and bookkeeping into lk (mutex held). */
static void take(kvm_store__lockwait *w, int64_t now, look *lk)
{
    int64_t st = atomic_load(&w->state), since = st > 0 ? st : 0;
    memset(lk, 0, offsetof(look, path));
    lk->w = w;
    snprintf(lk->path, sizeof lk->path, "%s", w->path);
    lk->since = since;
    lk->waited_ms = since ? now - since : 0;
    if (w->said_since && w->said_since != since) {
        lk->ended_after_ms = now - w->said_since;
        if (lk->ended_after_ms <= 0) lk->ended_after_ms = 1;
        w->said_since = 0;
    }
    if (!since || lk->waited_ms < KVM_STORE__LOCKWAIT_SAY_MS) return; /* a short wait: an ordinary commit */
    if (!w->said_since) {
        lk->say_wait = lk->scan = 1;
        w->said_since = since;
    }
    const atomic_int *flag = atomic_load(&g.flag);
    lk->flag_now = flag ? atomic_load(flag) : 0;
    lk->interrupted = flag && lk->flag_now != atomic_load(&w->intr_at_start);
    if (!lk->interrupted) return;
    if (now - w->scanned_ms >= KVM_STORE__LOCKWAIT_SCAN_MS) lk->scan = 1; /* a holder may stop later */
    if (w->busy_said != since) {
        lk->say_busy = 1;
        w->busy_said = since;
    }
    if (lk->scan) w->scanned_ms = now;
}

/* The slow part, mutex not held: the messages, and the exit when an interrupt came during a
 * wait that looks stuck. */
static void act(const look *lk)
{
    if (lk->ended_after_ms) say_end(lk->path, lk->ended_after_ms);
    char lockfile[PATH_MAX + 16], stopped[512] = "";
    snprintf(lockfile, sizeof lockfile, "%s/lock.mdb", lk->path);
    if (lk->scan) stopped_holders(lockfile, stopped, sizeof stopped);
    if (lk->say_wait) say_wait(lk, lockfile, stopped);
    if (!lk->interrupted) return;
    /* a stopped holder lets go only when resumed, a 30 s wait is no ordinary commit, and a
     * second interrupt asks for the exit: else a busy holder soon lets go, and the first
     * interrupt is the process's graceful drain then */
    if (stopped[0] || lk->waited_ms >= KVM_STORE__LOCKWAIT_STUCK_MS || lk->flag_now >= 2)
        stop_for_interrupt(lk);
    else if (lk->say_busy)
        kvm_log(KVM_LOG_WARN, "store_lock_interrupt_deferred", (kvm_log_field[]){KVM_LOG_S("store", lk->path)}, 1,
                "interrupted: the store's write lock is busy; the run drains once it gets it (Ctrl-C again ends it "
                "now)\n");
}

/* The watchdog of generation arg: a look at every wait each tick, until g.gen moves on. Each
 * look lets the mutex go for its slow part; g.tick marks the handles looked at this tick (the
 * list may change meanwhile). */
static void *watch_main(void *arg)
{
    unsigned gen = (unsigned)(uintptr_t)arg;
    look lk;
    pthread_mutex_lock(&g.mu);
    while (g.gen == gen) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        t.tv_nsec += KVM_STORE__LOCKWAIT_TICK_MS * 1000000L;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&g.cv, &g.mu, &t);
        if (g.gen != gen) break;
        unsigned tick = ++g.tick;
        int64_t now = mono_ms();
        for (;;) {
            kvm_store__lockwait *w = g.head;
            while (w && w->looked == tick)
                w = w->next;
            if (!w) break;
            w->looked = tick;
            take(w, now, &lk);
            pthread_mutex_unlock(&g.mu);
            act(&lk);
            pthread_mutex_lock(&g.mu);
            if (g.gen != gen) break;
        }
    }
    pthread_mutex_unlock(&g.mu);
    return NULL;
}

/* The condition variable on the monotonic clock, once per program (a wall-clock step must
 * not stretch a tick). */
static void cv_init(void)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(&g.cv, &a);
    pthread_condattr_destroy(&a);
}

/* Around fork: the child gets the mutex unlocked and a fresh condition variable, whatever the
 * watchdog was doing (the child has no watchdog thread; its first writable open starts one). */
static void fork_prepare(void) { pthread_mutex_lock(&g.mu); }
static void fork_parent(void) { pthread_mutex_unlock(&g.mu); }
static void fork_child(void)
{
    cv_init();
    pthread_mutex_unlock(&g.mu);
}

/* Starts the watchdog with every signal blocked: signals stay the other threads' (a handler
 * interrupting their waits, as before). Mutex held. */
static void start_watchdog(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    static int atfork_set; /* inherited by children: once per program */
    pthread_once(&once, cv_init);
    if (!atfork_set) atfork_set = pthread_atfork(fork_prepare, fork_parent, fork_child) == 0;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    g.running = pthread_create(&g.th, NULL, watch_main, (void *)(uintptr_t)g.gen) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

void kvm_store__lockwait_add(kvm_store__lockwait *w, const char *path)
{
    pthread_mutex_lock(&g.mu);
    if (g.pid != getpid()) { /* the first add, or the first in a forked child */
        g.head = NULL;       /* the parent's handles are not this process's to watch */
        g.running = 0;       /* nor its watchdog */
        g.pid = getpid();
    }
    if (!g.running) start_watchdog();
    w->path = path;
    w->said_since = w->busy_said = w->scanned_ms = 0;
    w->looked = 0;
    atomic_store(&w->state, 0);
    w->next = g.head;
    g.head = w;
    pthread_mutex_unlock(&g.mu);
}

void kvm_store__lockwait_remove(kvm_store__lockwait *w)
{
    int64_t ended_after = 0;
    pthread_mutex_lock(&g.mu);
    for (kvm_store__lockwait **p = &g.head; *p; p = &(*p)->next) {
        if (*p != w) continue;
        *p = w->next;
        if (w->said_since) ended_after = mono_ms() - w->said_since; /* its state is idle now */
        w->said_since = 0;
        break;
    }
    /* the last writable handle gone: so is the thread (no thread without a writable store) */
    int stop = !g.head && g.running && g.pid == getpid();
    pthread_t th = g.th;
    if (stop) {
        g.gen++;
        g.running = 0;
        pthread_cond_signal(&g.cv);
    }
    pthread_mutex_unlock(&g.mu);
    if (ended_after) say_end(w->path, ended_after > 0 ? ended_after : 1); /* stderr without the mutex */
    if (stop) pthread_join(th, NULL);
}
