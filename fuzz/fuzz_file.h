/* fuzz_file.h: shared by the libFuzzer targets fuzz/fuzz_file_<format>.c, one per reader of a
 * file a user hands kvmill. The input is the file's bytes, given to the reader's in-memory entry
 * point (libFuzzer's buffer is exactly the input's size, so ASan sees any read past the file's
 * end). What an accepted file yields is then used as kvmill uses it (tokenizers encode and decode
 * a fixed text, every tensor's first and last byte is read), so a reader that accepts something
 * it cannot serve shows too. fuzz/gen_corpus.c writes the seeds (make fuzz-seeds). */
#ifndef KVM_FUZZ_FILE_H
#define KVM_FUZZ_FILE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvm_error.h"
#include "model/kvm_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Text the tokenizer targets encode: ASCII words, digits, a run of spaces, multi-byte UTF-8
 * (é, CJK, an emoji), a stray continuation byte and a NUL. */
static const char kvm_fuzz_text[] = "Once upon a time, 42 cats  sat.\n\xc3\xa9t\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 "
                                    "\xf0\x9f\x98\x80 \x80x\0y <s></s>";

/* Reads byte p[i] through a volatile, so ASan checks the address even at -O1. */
static inline void kvm_fuzz_touch(const uint8_t *p, size_t i)
{
    volatile uint8_t b = p[i];
    (void)b;
}

/* Encodes kvm_fuzz_text with t, decodes the ids again and asks for every id's piece: on a
 * tokenizer that opened each must succeed (a failure there is a reader bug: abort), but for
 * encode's documented KVM_EFORMAT (a llama2.c vocabulary without the " " piece). */
static inline void kvm_fuzz_tokenizer_use(const kvm_tokenizer *t)
{
    int32_t *ids = NULL;
    int64_t n = 0;
    int rc = kvm_tokenizer_encode(t, kvm_fuzz_text, sizeof kvm_fuzz_text - 1, kvm_tokenizer_add_bos(t), 0, &ids, &n);
    if (rc == KVM_EFORMAT) return;
    if (rc != 0) {
        fprintf(stderr, "an opened tokenizer does not encode: %s\n", kvm_errmsg());
        abort();
    }
    int vocab = kvm_tokenizer_vocab_size(t);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) {
            fprintf(stderr, "encode gave id %d outside [0, %d)\n", ids[i], vocab);
            abort();
        }
    char *text = NULL;
    size_t len = 0;
    if (kvm_tokenizer_decode(t, ids, n, &text, &len) != 0) {
        fprintf(stderr, "ids from encode do not decode: %s\n", kvm_errmsg());
        abort();
    }
    free(text);
    free(ids);
    for (int32_t id = 0; id < vocab && id < 4096; id++) {
        size_t pl = 0;
        const char *p = kvm_tokenizer_piece(t, id > 0 ? id - 1 : -1, id, &pl);
        if (p && pl) kvm_fuzz_touch((const uint8_t *)p, pl - 1);
    }
    (void)kvm_tokenizer_find(t, "<s>");
    (void)kvm_tokenizer_chat_template(t);
}

#endif
