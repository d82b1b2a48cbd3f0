/* kvm_orch_progress.h: the progress line `kvmill run` and `kvmill calibrate` write to stderr:
 * on a terminal one line redrawn every 200 ms; otherwise a line only when its counts changed,
 * at most every interval; an ETA only once a document has finished. */
#ifndef KVM_ORCH_PROGRESS_H
#define KVM_ORCH_PROGRESS_H

#include <stdint.h>

typedef struct kvm_orch_progress {
    const char *cmd;    /* "run" or "calibrate", for the "kvmill CMD: " prefix */
    int tty;            /* 1: stderr is a terminal (one redrawn line) */
    double interval_ms; /* not a terminal: at most one line this often */
    double t0_ms;       /* start of the run (kvm_now_ms) */
    double last_ms;     /* when the last line went out */
    char last[1024];    /* that line's counts, to print only news */
} kvm_orch_progress;

/* 1 when a line may be due now (cheap: call before gathering the counts); final: always 1. */
int kvm_orch_progress_due(const kvm_orch_progress *p, int final);

/* Prints the line for `done` of `total` documents, `tokens` compressed so far and the jobs
 * in hand (`inflight`: "" or e.g. " in compress: doc_003.txt 45/90"), unless not a terminal
 * and nothing changed since the last line (final: the line is due whatever the interval; on
 * a terminal it ends the redrawn line). */
void kvm_orch_progress_print(kvm_orch_progress *p, int64_t done, int64_t total, int64_t tokens, const char *inflight,
                             int final);

#endif
