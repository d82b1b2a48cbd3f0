/* fuzz_file_safetensors.c: libFuzzer target for the safetensors reader (kvm_st_open_mem: the
 * 8-byte header length, the JSON header, dtypes, shapes, data offsets and their tiling). On a
 * file it accepts, every tensor is found by name and converted to float32 (the small ones) and
 * its first and last byte read. */
#include "fuzz/fuzz_file.h"
#include "model/kvm_safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvm_st *s = NULL;
    if (kvm_st_open_mem("fuzz.safetensors", data, size, &s) != 0) return 0;
    for (int64_t i = 0; i < kvm_st_n_tensors(s); i++) {
        const kvm_st_tensor *t = kvm_st_tensor_at(s, i);
        if (kvm_st_find(s, t->name) != t) {
            fprintf(stderr, "tensor '%s' is not found by its name\n", t->name);
            abort();
        }
        if (t->bytes) {
            kvm_fuzz_touch(t->data, 0);
            kvm_fuzz_touch(t->data, (size_t)t->bytes - 1);
        }
        if (t->n_elems <= 65536) {
            float *dst = malloc((size_t)(t->n_elems ? t->n_elems : 1) * sizeof *dst);
            if (dst) kvm_st_to_f32(t->dtype, t->data, dst, t->n_elems);
            free(dst);
        }
        kvm_st_release(s, t);
    }
    kvm_st_close(&s);
    return 0;
}
