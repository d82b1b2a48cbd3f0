/* fuzz_file_sculpt.c: libFuzzer target for the sculpt output file reader (.kvs, "KVMSCULP" v1:
 * kvm_sculpt_cache_decode). The input's last 8 bytes are replaced by the FNV-1a-64 of the rest
 * before decoding, so the fuzzer reaches the checks after the checksum instead of stopping at
 * it. An accepted cache must write back to the same bytes (kvm_sculpt_cache_write). */
#include "compress/sculpt/kvm_sculpt_file.h"
#include "fuzz/fuzz_file.h"

#include <unistd.h>

static uint64_t fnv1a(const uint8_t *p, size_t n)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* Writes c to a temporary file and compares it with want[0, n). */
static void check_rewrite(const kvm_kvcache *c, const uint8_t *want, size_t n)
{
    char path[] = "/tmp/kvm_fuzz_sculpt_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return;
    close(fd);
    if (kvm_sculpt_cache_write(path, c) != 0) {
        fprintf(stderr, "accepted cache does not write back: %s\n", kvm_errmsg());
        abort();
    }
    FILE *f = fopen(path, "rb");
    uint8_t *got = malloc(n + 1);
    size_t g = f && got ? fread(got, 1, n + 1, f) : 0;
    if (f) fclose(f);
    unlink(path);
    if (got && (g != n || memcmp(got, want, n) != 0)) {
        fprintf(stderr, "accepted cache writes back %zu other bytes (file %zu)\n", g, n);
        abort();
    }
    free(got);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 8 || size > (1u << 20)) return 0;
    uint8_t *p = malloc(size);
    if (!p) return 0;
    memcpy(p, data, size);
    uint64_t h = fnv1a(p, size - 8);
    memcpy(p + size - 8, &h, 8);
    kvm_kvcache *c = NULL;
    if (kvm_sculpt_cache_decode("fuzz.kvs", p, size, &c) == 0) check_rewrite(c, p, size);
    kvm_kvcache_free(&c);
    free(p);
    return 0;
}
