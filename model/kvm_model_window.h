/* kvm_model_window.h: how many positions a model can run, for the up-front checks of the
 * commands (generate's -n, sculpt's cut, eval's context + continuation, run's and serve's
 * [model] context) so that they refuse what the forward would refuse halfway. */
#ifndef KVM_MODEL_WINDOW_H
#define KVM_MODEL_WINDOW_H

#include "model/kvm_model.h"

/* The positions c's model runs, tokens: seq_len, or the sliding_window when one is set (a
 * config's window at least seq_len long is stored as 0). The forward (check_tokens) refuses
 * positions past a sliding window since windowed attention is not implemented, so a check
 * against seq_len alone passed runs that failed after their first sliding_window positions. */
static inline int kvm_model_window(const kvm_model_config *c)
{
    return c->sliding_window > 0 && c->sliding_window < c->seq_len ? c->sliding_window : c->seq_len;
}

/* Names what bounds kvm_model_window(c) for messages ("the model's window of N tokens%s"):
 * ", its config's sliding_window" when the sliding window does, else "". A static string. */
static inline const char *kvm_model_window_note(const kvm_model_config *c)
{
    return kvm_model_window(c) < c->seq_len ? ", its config's sliding_window" : "";
}

#endif
