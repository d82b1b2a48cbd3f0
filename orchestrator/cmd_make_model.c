/* cmd_make_model.c: `kvmill make-model`: random-weight llama2.c checkpoints of any shape. */
#include "orchestrator/kvm_cli.h"
#include "model/kvm_model.h"
#include "common/kvm_error.h"

#include <stdio.h>

int kvm_cmd_make_model(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"dim", 1, "residual width", NULL}, {"layers", 1, "transformer blocks", NULL},
        {"heads", 1, "query heads", NULL}, {"kv-heads", 1, "KV heads (default: heads)", NULL},
        {"hidden", 1, "FFN width", NULL}, {"vocab", 1, "vocabulary size", NULL},
        {"seq-len", 1, "context window", NULL}, {"seed", 1, "PRNG seed (default 1)", NULL},
        {"separate-classifier", 0, "write a separate output classifier (untied)", NULL},
        {"out", 1, "output file", NULL}, {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("make-model", "Writes a random-weight llama2.c checkpoint.", argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *req[] = {"dim", "layers", "heads", "hidden", "vocab", "seq-len", "out"};
    for (size_t i = 0; i < sizeof req / sizeof req[0]; i++)
        if (!kvm_cli_get(opts, req[i])) {
            fprintf(stderr, "kvmill make-model: --%s is required\n", req[i]);
            return 2;
        }
    int64_t v[8];
    const char *names[] = {"dim", "hidden", "layers", "heads", "kv-heads", "vocab", "seq-len", "seed"};
    for (int i = 0; i < 8; i++) {
        const char *s = kvm_cli_get(opts, names[i]);
        if (!s) s = i == 4 ? kvm_cli_get(opts, "heads") : "1";
        if (kvm_cli_int("make-model", names[i], s, i == 7 ? 0 : 1, i == 7 ? INT64_MAX : (1 << 22), &v[i])) return 2;
    }
    kvm_make_model_opts o = {.dim = (int)v[0], .hidden_dim = (int)v[1], .n_layers = (int)v[2], .n_heads = (int)v[3],
                             .n_kv_heads = (int)v[4], .vocab_size = (int)v[5], .seq_len = (int)v[6],
                             .seed = (uint64_t)v[7], .separate_classifier = kvm_cli_get(opts, "separate-classifier") != NULL};
    const char *out = kvm_cli_get(opts, "out");
    if (kvm_cli_check_out("make-model", "out", out)) return 2;
    /* OUT.part renamed over OUT when whole; a FIFO without a reader refused, a device (/dev/null)
     * or a FIFO with one written in place: OUT.partial was renamed over whatever OUT was, a
     * device node included, and a write to /dev/full "succeeded" into that file */
    kvm_cli_staged s;
    int rc = kvm_cli_staged_open("make-model", "out", out, &s);
    if (rc) return rc;
    rc = kvm_make_model_fwrite(s.f, out, &o);
    if (rc) fprintf(stderr, "kvmill make-model: %s\n", kvm_cli_errmsg("make-model"));
    if (rc) { /* a cut-short checkpoint is worth nothing: no OUT.part left */
        kvm_cli_staged_abort(&s);
        return rc == KVM_EINVAL ? 2 : 1;
    }
    if (kvm_cli_staged_close("make-model", "out", &s, 1)) return 1;
    fprintf(stderr, "kvmill make-model: wrote %s\n", out);
    return 0;
}
