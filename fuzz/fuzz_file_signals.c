/* fuzz_file_signals.c: libFuzzer target for the PolyKV signals CSV reader (what
 * `kvmill calibrate --dump-signals` writes and `--reuse` reads back:
 * kvm_polykv_signals_read_stream over fmemopen). The first input byte picks the model's layer
 * count (1 + byte % 8), the rest is the file. Accepted signals must build a strategy under every
 * selection and allocation mode, as a calibration then does. */
#include "compress/polykv/kvm_polykv.h"
#include "fuzz/fuzz_file.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    int L = 1 + data[0] % 8;
    kvm_polykv_signals *s = NULL;
    if (kvm_polykv_signals_new(L, &s) != 0) return 0;
    FILE *f = fmemopen((void *)(data + 1), size - 1, "r");
    if (f && kvm_polykv_signals_read_stream(f, "fuzz.csv", s) == 0) {
        for (int sel = KVM_POLYKV_SELECT_COSINE; sel <= KVM_POLYKV_SELECT_PPL; sel++)
            for (int al = KVM_POLYKV_ALLOC_UNIFORM; al <= KVM_POLYKV_ALLOC_PYRAMID; al++) {
                kvm_strategy *st = NULL;
                if (kvm_polykv_strategy_build(s, (kvm_polykv_select)sel, KVM_PATTERN_H2O, (kvm_polykv_alloc)al, 1.0, 16,
                                              1, &st) != 0) {
                    fprintf(stderr, "accepted signals do not build a strategy (select %d, alloc %d): %s\n", sel, al,
                            kvm_errmsg());
                    abort();
                }
                kvm_strategy_free(&st);
            }
    }
    if (f) fclose(f);
    kvm_polykv_signals_free(&s);
    return 0;
}
