/* kvm_chatcfg.c: [model] chat / system -> the chat framing (pipeline/kvm_chatcfg.h). */
#include "pipeline/kvm_chatcfg.h"
#include "common/kvm_error.h"
#include "model/kvm_chat.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int kvm_chatcfg_frame_tokens(const kvm_tokenizer *tok, const char *open, int64_t *n)
{
    int32_t *ids = NULL;
    *n = 0;
    int rc = kvm_tokenizer_encode(tok, open, strlen(open), kvm_tokenizer_add_bos(tok), 0, &ids, n);
    free(ids);
    return rc;
}

int kvm_chatcfg_frame(const kvm_config *c, const kvm_tokenizer *tok, char **open, char **close)
{
    *open = *close = NULL;
    if (!kvm_config_bool(c, "model", "chat")) return 0;
    const char *sys = kvm_config_str(c, "model", "system");
    int rc = kvm_chat_frame(tok, *sys ? sys : NULL, open, close);
    if (rc)
        return kvm_err(rc, "%s: [model] chat = true: %s", kvm_config_path(c),
                       rc == KVM_ENOTSUP ? kvm_errmsg() : "out of memory");
    int64_t n = 0, ctx = kvm_config_int(c, "model", "context");
    rc = kvm_chatcfg_frame_tokens(tok, *open, &n);
    if (!rc && n >= ctx)
        rc = kvm_err(KVM_EINVAL,
                     "%s: [model] context = %lld leaves no token for the document: the chat frame (the "
                     "system turn and the user turn's opening) takes %lld tokens; raise context%s",
                     kvm_config_path(c), (long long)ctx, (long long)n, *sys ? " or shorten [model] system" : "");
    else if (rc)
        rc = kvm_err(rc, "%s: [model] chat = true: the chat frame: %s", kvm_config_path(c), kvm_errmsg());
    if (rc) {
        free(*open);
        free(*close);
        *open = *close = NULL;
    }
    return rc;
}
