/* fuzz_file_strategy.c: libFuzzer target for the PolyKV strategy file reader ("KVST" v1/v2,
 * kvm_strategy_decode, what kvm_strategy_read applies to a file's bytes). An accepted strategy
 * must encode back to the same bytes (the encoding is canonical) and plan both phases. */
#include "compress/evict/kvm_evict.h"
#include "compress/polykv/kvm_polykv.h"
#include "fuzz/fuzz_file.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvm_strategy *s = NULL;
    if (kvm_strategy_decode(data, size, &s) != 0) return 0;
    uint8_t *buf = NULL;
    size_t len = 0;
    if (kvm_strategy_encode(s, &buf, &len) != 0) {
        fprintf(stderr, "accepted strategy does not encode: %s\n", kvm_errmsg());
        abort();
    }
    if (len != size || memcmp(buf, data, size) != 0) {
        fprintf(stderr, "accepted strategy encodes to %zu other bytes (file %zu)\n", len, size);
        abort();
    }
    free(buf);
    for (int phase = 0; phase < 2; phase++) {
        kvm_evict_plan *plan = NULL;
        if (kvm_strategy_plan(s, phase, s->budget_avg, 2, &plan) != 0) {
            fprintf(stderr, "accepted strategy does not plan phase %d: %s\n", phase, kvm_errmsg());
            abort();
        }
        kvm_evict_plan_free(&plan);
    }
    kvm_strategy_free(&s);
    return 0;
}
