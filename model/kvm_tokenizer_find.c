/* kvm_tokenizer_find.c: which tokenizer goes with a model file: the one a GGUF file embeds,
 * an explicit file, or tokenizer.json (Hugging Face) / tok512.bin / tokenizer.bin beside the
 * model or inside its folder. Shared by the command
 * line and the pipeline's stage processes so both tokenise alike. */
#include "model/kvm_tokenizer_find.h"
#include "model/kvm_hf.h"
#include "common/kvm_error.h"

#include <libgen.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

static int is_file(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* 1 when the file starts with the GGUF magic. */
static int is_gguf(const char *p)
{
    char magic[4];
    FILE *f = is_file(p) ? fopen(p, "rb") : NULL; /* a FIFO would block the read */
    int yes = f && fread(magic, 1, 4, f) == 4 && memcmp(magic, "GGUF", 4) == 0;
    if (f) fclose(f);
    return yes;
}

int kvm_tokenizer_find_for_model(const char *model_path, const char *explicit_path, char *buf, size_t buf_size)
{
    if (explicit_path) {
        snprintf(buf, buf_size, "%s", explicit_path);
        return 0; /* opening it reports what is wrong */
    }
    struct stat st;
    char dir[4096];
    if (stat(model_path, &st) == 0 && S_ISDIR(st.st_mode)) snprintf(dir, sizeof dir, "%s", model_path);
    else {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s", model_path);
        snprintf(dir, sizeof dir, "%s", dirname(tmp));
    }
    /* a Hugging Face folder's own tokenizer.json; llama2.c tokenizers beside other models */
    const char *names[] = {"tokenizer.json", "tok512.bin", "tokenizer.bin"};
    for (size_t i = kvm_hf_is_folder(model_path) ? 0 : 1; i < sizeof names / sizeof names[0]; i++) {
        snprintf(buf, buf_size, "%s/%s", dir, names[i]);
        if (i == 0 ? lstat(buf, &st) == 0 : is_file(buf)) return 0; /* a broken tokenizer.json: opening says how */
    }
    snprintf(buf, buf_size, "%s/tokenizer.model", dir);
    const char *spm = is_file(buf) ? " (the folder's tokenizer.model, SentencePiece's format, is not read; a "
                                     "tokenizer.json of the same model is)"
                                   : "";
    return kvm_err(
        KVM_ENOTFOUND,
        "no tokenizer found beside %s (looked for tokenizer.json, tok512.bin, tokenizer.bin); pass --tokenizer%s",
        model_path, spm);
}

int kvm_tokenizer_open_for_model(const kvm_model *m, const char *model_path, const char *tok_path, kvm_tokenizer **tok,
                           char *used, size_t used_size)
{
    *tok = NULL;
    int rc;
    if (!tok_path && strcmp(m->format, "gguf") == 0) {
        snprintf(used, used_size, "%s", model_path);
        rc = kvm_tokenizer_open_gguf(model_path, tok); /* a GGUF file carries its own tokenizer */
    } else {
        rc = kvm_tokenizer_find_for_model(model_path, tok_path, used, used_size);
        size_t ul = strlen(used);
        if (rc == 0)
            rc = is_gguf(used)                                     ? kvm_tokenizer_open_gguf(used, tok)
                 : ul >= 5 && strcmp(used + ul - 5, ".json") == 0 ? kvm_tokenizer_open_hf(used, m->cfg.vocab_size, tok)
                                                                    : kvm_tokenizer_open_llama2c(used, m->cfg.vocab_size, tok);
    }
    if (rc == 0 && kvm_tokenizer_vocab_size(*tok) != m->cfg.vocab_size) {
        rc = kvm_err(KVM_EMISMATCH, "%s: tokenizer has %d tokens, the model %d", used, kvm_tokenizer_vocab_size(*tok),
                     m->cfg.vocab_size);
        kvm_tokenizer_close(tok);
    }
    return rc;
}

