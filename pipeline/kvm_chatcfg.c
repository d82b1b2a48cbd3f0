/* kvm_chatcfg.c: [model] chat / system -> the chat framing (pipeline/kvm_chatcfg.h). */
#include "pipeline/kvm_chatcfg.h"
#include "common/kvm_error.h"
#include "model/kvm_chat.h"

#include <stdlib.h>

int kvm_chatcfg_frame(const kvm_config *c, const kvm_tokenizer *tok, char **open, char **close)
{
    *open = *close = NULL;
    if (!kvm_config_bool(c, "model", "chat")) return 0;
    const char *sys = kvm_config_str(c, "model", "system");
    int rc = kvm_chat_frame(tok, *sys ? sys : NULL, open, close);
    if (rc)
        return kvm_err(rc, "%s: [model] chat = true: %s", kvm_config_path(c),
                       rc == KVM_ENOTSUP ? kvm_errmsg() : "out of memory");
    return 0;
}
