/* kvm_orch_progress.c: formatting and rate-limiting the orchestrator's progress line. */
#include "pipeline/kvm_orch_progress.h"
#include "pipeline/kvm_stage.h"
#include "common/kvm_log.h"

#include <stdio.h>
#include <string.h>

int kvm_orch_progress_due(const kvm_orch_progress *p, int final)
{
    return final || kvm_now_ms() - p->last_ms >= (p->tty ? 200.0 : p->interval_ms);
}

void kvm_orch_progress_print(kvm_orch_progress *p, int64_t done, int64_t total, int64_t tokens, const char *inflight,
                             int final)
{
    double now = kvm_now_ms(), el = (now - p->t0_ms) / 1000.0, tps = el > 0 ? (double)tokens / el : 0;
    char eta[64] = "", line[1024];
    /* a basis for an ETA is a document compressed (tokens > 0), not one that failed at once */
    if (done > 0 && tokens > 0 && done < total) snprintf(eta, sizeof eta, ", ETA %.0f s", el / (double)done * (double)(total - done));
    snprintf(line, sizeof line, "%lld/%lld documents%s", (long long)done, (long long)total, inflight);
    if (!p->tty && !strcmp(line, p->last)) return; /* nothing new to say (the final line included) */
    p->last_ms = now;
    snprintf(p->last, sizeof p->last, "%s", line);
    /* inflight names documents: a newline or terminal escape in one went out raw (a faked
     * log line, a cleared screen); text lines show such bytes as \xHH, as the logger does */
    char safe[4 * sizeof line + 1];
    kvm_log_escape(line, 0, safe, sizeof safe);
    if (p->tty && kvm_log_format_get() == KVM_LOG_TEXT) {
        int width = 30, fill = total > 0 ? (int)(width * done / total) : width;
        fprintf(stderr, "\r[%.*s%*s] %s  %.0f tok/s%s \033[K", fill, "##############################", width - fill, "",
                safe, tps, eta);
        if (final) fputc('\n', stderr);
    } else if (kvm_log_format_get() == KVM_LOG_JSON) {
        kvm_log_field f[] = {KVM_LOG_I("documents_done", done), KVM_LOG_I("documents_total", total),
                             KVM_LOG_F("tokens_per_s", tps), KVM_LOG_F("elapsed_s", el)};
        kvm_log(KVM_LOG_INFO, "progress", f, 4, "%s, %.0f tokens/s, %.1f s elapsed%s", line, tps, el, eta);
    } else
        fprintf(stderr, "kvmill %s: %s, %.0f tokens/s, %.1f s elapsed%s\n", p->cmd, safe, tps, el, eta);
}
