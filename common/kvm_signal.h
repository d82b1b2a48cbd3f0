/* kvm_signal.h: SIGHUP for kvmill's long-lived commands (run, calibrate, serve, store serve and
 * the stage workers): a closed terminal or a daemon's hang-up stops them as SIGTERM does (they
 * drain), where its default action killed them at once, workers left behind to notice. */
#ifndef KVM_SIGNAL_H
#define KVM_SIGNAL_H

#include <signal.h>

/* Installs handler for SIGHUP (sa_mask empty, no flags) unless SIGHUP is ignored now (`nohup`, a
 * parent's SIG_IGN inherited across exec: the user asked the process to outlive its terminal),
 * and writes to *old (may be NULL) the disposition to restore with sigaction(SIGHUP, old, NULL).
 * Returns 1 when the handler was installed, 0 when SIGHUP stays ignored. A terminal's close can
 * deliver SIGHUP twice (the shell forwards it, the kernel sends it to the foreground group), so a
 * handler should count hang-ups as one stop request, not as a second Ctrl-C. */
int kvm_signal_hup(void (*handler)(int), struct sigaction *old);

#endif
