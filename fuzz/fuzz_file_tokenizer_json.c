/* fuzz_file_tokenizer_json.c: libFuzzer target for the Hugging Face tokenizer.json reader
 * (kvm__tokjson_parse_mem: model.vocab, merges, added_tokens, normalizer, pre-tokenizer, post
 * processor). A vocabulary it accepts encodes fuzz_file.h's text; the ids must be in range. */
#include "fuzz/fuzz_file.h"
#include "model/kvm_tokenizer_json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvm_bpe *b = NULL;
    kvm_tokjson_info info;
    if (kvm__tokjson_parse_mem("tokenizer.json", (const char *)data, size, 0, &b, &info) != 0) return 0;
    int32_t *ids = NULL;
    int64_t n = 0;
    if (kvm__bpe_encode_new(b, kvm_fuzz_text, sizeof kvm_fuzz_text - 1, &ids, &n) == 0) {
        int32_t vocab = kvm__bpe_vocab_size(b);
        for (int64_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= vocab) {
                fprintf(stderr, "encode gave id %d outside [0, %d)\n", ids[i], vocab);
                abort();
            }
            size_t len = 0;
            const char *p = kvm__bpe_piece(b, ids[i], &len);
            if (p && len) kvm_fuzz_touch((const uint8_t *)p, len - 1);
        }
    }
    free(ids);
    free(info.chat_template);
    kvm__bpe_free(&b);
    return 0;
}
