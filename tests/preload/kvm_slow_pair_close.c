/* LD_PRELOAD shim for tests: zmq_close of a ZMQ_PAIR socket (a monitor's reading end) returns
 * KVM_TEST_PAIR_CLOSE_MS milliseconds late (default 400), so that what a process does between
 * closing its monitor reader and stopping the monitor meets events that arrive meanwhile. A
 * race of a few microseconds in production (libzmq's blocking monitor send, tests/check_serve.c
 * ask_monitor_stop_order) becomes one that happens every time. Built without the sanitizers:
 * a suite preloading it into a sanitized binary sets ASAN_OPTIONS=verify_asan_link_order=0. */
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>
#include <zmq.h>

int zmq_close(void *s)
{
    static int (*real_close)(void *);
    if (!real_close) *(void **)&real_close = dlsym(RTLD_NEXT, "zmq_close");
    int type = 0;
    size_t n = sizeof type;
    const int pair = zmq_getsockopt(s, ZMQ_TYPE, &type, &n) == 0 && type == ZMQ_PAIR;
    const int rc = real_close(s);
    if (pair) {
        const char *e = getenv("KVM_TEST_PAIR_CLOSE_MS");
        const long ms = e && *e ? atol(e) : 400;
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return rc;
}
