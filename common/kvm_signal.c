/* kvm_signal.c: SIGHUP taken as SIGTERM unless ignored (kvm_signal.h). */
#include "common/kvm_signal.h"

#include <string.h>

int kvm_signal_hup(void (*handler)(int), struct sigaction *old)
{
    struct sigaction cur, sa;
    memset(&cur, 0, sizeof cur);
    sigaction(SIGHUP, NULL, &cur);
    if (old) *old = cur;
    if (cur.sa_handler == SIG_IGN) return 0;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGHUP, &sa, NULL);
    return 1;
}
