/* fuzz_file_llama2c.c: libFuzzer target for the llama2.c checkpoint reader (kvm__llama2c_load:
 * the 7-int32 header and the size it implies). On a file it accepts, the last embedding row,
 * the last classifier row and the last layer's last weights are read, so a size formula that
 * lets a weight run past the file shows. */
#include "fuzz/fuzz_file.h"
#include "model/kvm_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvm_model *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup("fuzz.bin"))) {
        kvm_model_close(&m);
        return 0;
    }
    m->weight_dtype = KVM_MODEL_WEIGHTS_AUTO;
    if (kvm__llama2c_load(m, data, size) == 0) {
        const kvm_model_config *c = &m->cfg;
        float *row = malloc((size_t)(c->dim > c->hidden_dim ? c->dim : c->hidden_dim) * sizeof *row);
        if (row) {
            kvm_model_embed(m, c->vocab_size - 1, row);
            (void)kvm_model_mat_rows(&m->wcls, c->dim, c->vocab_size - 1, 1, row);
            const kvm_layer_weights *w = &m->layers[c->n_layers - 1];
            (void)kvm_model_mat_rows(&w->w2, c->hidden_dim, c->dim - 1, 1, row);
            (void)kvm_model_mat_rows(&w->w3, c->dim, c->hidden_dim - 1, 1, row);
            kvm_fuzz_touch((const uint8_t *)m->rms_final, (size_t)c->dim * 4 - 1);
        }
        free(row);
    }
    kvm_model_close(&m);
    return 0;
}
