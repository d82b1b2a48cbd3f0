/* fuzz_file_tok_llama2c.c: libFuzzer target for the llama2.c tokenizer reader (tok512.bin,
 * tokenizer.bin: max_token_length, then vocab_size records {f32 score, i32 len, len bytes}).
 * The first two input bytes pick vocab_size (259 + u16 % 1024, the model's header gives it in
 * kvmill), the rest is the file. A tokenizer that opens is used as fuzz_file.h says. */
#include "fuzz/fuzz_file.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    int vocab = 259 + (int)((data[0] | (unsigned)data[1] << 8) % 1024);
    kvm_tokenizer *t = NULL;
    if (kvm__tokenizer_llama2c_mem("fuzz.bin", data + 2, (int64_t)(size - 2), vocab, &t) == 0)
        kvm_fuzz_tokenizer_use(t);
    kvm_tokenizer_close(&t);
    return 0;
}
