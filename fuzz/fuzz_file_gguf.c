/* fuzz_file_gguf.c: libFuzzer target for the GGUF readers: kvm_gguf_parse (header, metadata,
 * tensor infos, offsets, dtypes), then on a file it accepts the typed getters, every tensor's
 * bytes and dequantisation (the small ones), the tokenizer (kvm__tokenizer_gguf_mem, used as
 * fuzz_file.h says) and the model loader (kvm__gguf_load). */
#include "fuzz/fuzz_file.h"
#include "model/kvm_gguf.h"
#include "model/kvm_model.h"

/* Every getter on every key, with a NUL-terminated copy of the key. */
static void use_metadata(const kvm_gguf *g)
{
    for (int64_t i = 0; i < kvm_gguf_n_kv(g); i++) {
        const kvm_gguf_kv *kv = kvm_gguf_kv_at(g, i);
        char key[256];
        size_t n = kv->key.len < sizeof key - 1 ? (size_t)kv->key.len : sizeof key - 1;
        memcpy(key, kv->key.ptr, n);
        key[n] = '\0';
        int64_t i64;
        double f64;
        int b;
        kvm_gguf_str s;
        uint64_t an;
        const uint8_t *ad;
        (void)kvm_gguf_get_i64(g, key, &i64);
        (void)kvm_gguf_get_f64(g, key, &f64);
        (void)kvm_gguf_get_bool(g, key, &b);
        if (kvm_gguf_get_str(g, key, &s) == 0 && s.len) kvm_fuzz_touch((const uint8_t *)s.ptr, (size_t)s.len - 1);
        if (kv->type == KVM_GGUF_ARRAY) (void)kvm_gguf_get_arr(g, key, kv->etype, &an, &ad);
    }
}

/* Each tensor's first and last byte; tensors up to 64 Ki elements dequantised. */
static void use_tensors(const kvm_gguf *g)
{
    for (int64_t i = 0; i < kvm_gguf_n_tensors(g); i++) {
        const kvm_gguf_tensor *t = kvm_gguf_tensor_at(g, i);
        if (t->bytes) {
            kvm_fuzz_touch(t->data, 0);
            kvm_fuzz_touch(t->data, (size_t)t->bytes - 1);
        }
        int64_t n = 1;
        for (int d = 0; d < t->n_dims; d++)
            n *= t->ne[d];
        if (n > 65536) continue;
        float *dst = malloc((size_t)n * sizeof *dst);
        if (dst && kvm_ggml_dequantize(t->type, t->data, dst, n) != 0) {
            fprintf(stderr, "accepted tensor %lld does not dequantise: %s\n", (long long)i, kvm_errmsg());
            abort();
        }
        free(dst);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvm_gguf *g = NULL;
    if (kvm_gguf_parse("fuzz.gguf", data, size, &g) != 0) return 0;
    use_metadata(g);
    use_tensors(g);
    kvm_gguf_free(&g);
    kvm_tokenizer *t = NULL;
    if (kvm__tokenizer_gguf_mem("fuzz.gguf", data, size, &t) == 0) kvm_fuzz_tokenizer_use(t);
    kvm_tokenizer_close(&t);
    kvm_model *m = calloc(1, sizeof *m);
    if (m && (m->path = strdup("fuzz.gguf"))) {
        m->weight_dtype = KVM_MODEL_WEIGHTS_AUTO;
        if (kvm__gguf_load(m, data, size) == 0) {
            float row[1 << 12];
            if (m->cfg.dim <= (int)(sizeof row / sizeof row[0])) {
                kvm_model_embed(m, m->cfg.vocab_size - 1, row);
                (void)kvm_model_mat_rows(&m->wcls, m->cfg.dim, m->cfg.vocab_size - 1, 1, row);
            }
        }
    }
    kvm_model_close(&m);
    return 0;
}
