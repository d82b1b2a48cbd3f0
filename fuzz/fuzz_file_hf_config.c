/* fuzz_file_hf_config.c: libFuzzer target for the Hugging Face config.json reader
 * (kvm__hf_config_mem: architecture, shapes, ids, RoPE and the settings it refuses). An accepted
 * config must describe a model kvmill can size: its KV bytes per token are computed. */
#include "fuzz/fuzz_file.h"
#include "model/kvm_hf.h"
#include "model/kvm_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvm_model_config c;
    char arch[64];
    int tied = 0, o_bias = 0;
    if (kvm__hf_config_mem("config.json", (const char *)data, size, &c, arch, sizeof arch, &tied, &o_bias) != 0)
        return 0;
    if (c.dim < 1 || c.n_layers < 1 || c.n_heads < 1 || c.n_kv_heads < 1 || c.head_dim < 1 || c.vocab_size < 1 ||
        c.n_heads % c.n_kv_heads || c.n_eos < 1 || c.bos_id < 0 || c.bos_id >= c.vocab_size) {
        fprintf(stderr, "accepted config.json has an unusable shape\n");
        abort();
    }
    (void)kvm_model_kv_bytes(&c, c.seq_len);
    return 0;
}
