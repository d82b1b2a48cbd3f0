/* kvm_chat.c: ChatML and Llama-3 framing of one user turn (model/kvm_chat.h). */
#include "common/kvm_error.h"
#include "model/kvm_chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Sets *prefix and *suffix to malloc'ed copies. */
static int frame_out(const char *p, size_t np, const char *s, char **prefix, char **suffix)
{
    *prefix = malloc(np + 1);
    *suffix = strdup(s);
    if (!*prefix || !*suffix) {
        free(*prefix);
        free(*suffix);
        *prefix = *suffix = NULL;
        return kvm_err(KVM_ENOMEM, "chat: out of memory");
    }
    memcpy(*prefix, p, np);
    (*prefix)[np] = '\0';
    return 0;
}

/* The Llama-3 family's template (<|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>). */
static int llama3_frame(const char *system, char **prefix, char **suffix)
{
    static const char h[] = "<|start_header_id|>", e[] = "<|end_header_id|>\n\n", eot[] = "<|eot_id|>";
    size_t n = (system ? strlen(system) : 0) + 128;
    char *s = malloc(n), suf[128];
    if (!s) return kvm_err(KVM_ENOMEM, "chat: out of memory");
    int k = system ? snprintf(s, n, "%ssystem%s%s%s", h, e, system, eot) : 0;
    k += snprintf(s + k, n - (size_t)k, "%suser%s", h, e);
    snprintf(suf, sizeof suf, "%s%sassistant%s", eot, h, e);
    int rc = frame_out(s, (size_t)k, suf, prefix, suffix);
    free(s);
    return rc;
}

int kvm_chat_frame(const kvm_tokenizer *tok, const char *system, char **prefix, char **suffix)
{
    const char *tmpl = kvm_tokenizer_chat_template(tok);
    static const char start[] = "<|im_start|>", end[] = "<|im_end|>", sys_tag[] = "<|im_start|>system\n";
    *prefix = *suffix = NULL;
    if (tmpl && strstr(tmpl, "<|start_header_id|>") && kvm_tokenizer_find(tok, "<|start_header_id|>") >= 0 &&
        kvm_tokenizer_find(tok, "<|end_header_id|>") >= 0 && kvm_tokenizer_find(tok, "<|eot_id|>") >= 0)
        return llama3_frame(system, prefix, suffix);
    if (!tmpl)
        return kvm_err(KVM_ENOTSUP, "the model's tokenizer has no chat template: chat framing needs a ChatML (%s) or "
                                    "Llama-3 (<|start_header_id|>) template, as instruction-tuned GGUF and Hugging Face "
                                    "models carry",
                       start);
    if (!strstr(tmpl, start) || kvm_tokenizer_find(tok, start) < 0 || kvm_tokenizer_find(tok, end) < 0)
        return kvm_err(KVM_ENOTSUP,
                       "the model's chat template is neither ChatML (%s) nor Llama-3 (<|start_header_id|>): "
                       "chat framing supports those two families",
                       start);
    const char *def = NULL;
    size_t def_len = 0;
    const char *d = strstr(tmpl, sys_tag);
    if (!system && d) { /* the template's default system message, when it is a literal */
        def = d + strlen(sys_tag);
        const char *e = strstr(def, end);
        def_len = e ? (size_t)(e - def) : 0;
        if (!e || memchr(def, '{', def_len) || memchr(def, '\'', def_len)) def = NULL;
    }
    size_t n = (system ? strlen(system) : def_len) + 128;
    char *s = malloc(n), suf[64];
    if (!s) return kvm_err(KVM_ENOMEM, "chat: out of memory");
    int k = 0;
    if (system) k = snprintf(s, n, "%ssystem\n%s%s\n", start, system, end);
    else if (def) k = snprintf(s, n, "%ssystem\n%.*s%s\n", start, (int)def_len, def, end);
    k += snprintf(s + k, n - (size_t)k, "%suser\n", start);
    snprintf(suf, sizeof suf, "%s\n%sassistant\n", end, start);
    int rc = frame_out(s, (size_t)k, suf, prefix, suffix);
    free(s);
    return rc;
}

int kvm_chat_prompt(const kvm_tokenizer *tok, const char *system, const char *user, char **out)
{
    char *p, *s;
    *out = NULL;
    int rc = kvm_chat_frame(tok, system, &p, &s);
    if (rc) return rc;
    size_t n = strlen(p) + strlen(user) + strlen(s) + 1;
    *out = malloc(n);
    if (*out) snprintf(*out, n, "%s%s%s", p, user, s);
    free(p);
    free(s);
    return *out ? 0 : kvm_err(KVM_ENOMEM, "chat: out of memory");
}
