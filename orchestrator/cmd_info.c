/* cmd_info.c: `kvmill info`: a model's shapes, conventions and sizes. */
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_model.h"

#include <stdio.h>

int kvm_cmd_info(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"model", 1, KVM_CLI_MODEL_HELP, NULL}, {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("info", "Prints a model's shapes and parameter count.", argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *path = kvm_cli_get(opts, "model");
    if (!path) { fprintf(stderr, "kvmill info: --model is required\n"); return 2; }
    kvm_model *m;
    if (kvm_cli_open_model("info", path, NULL, 0, &m, NULL)) return 1;
    const kvm_model_config *c = &m->cfg;
    printf("model:       %s\nformat:      %s\n", m->path, m->format);
    printf("dim:         %d\nhidden_dim:  %d\nn_layers:    %d\nn_heads:     %d\nn_kv_heads:  %d (GQA %d:1)\n",
           c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->n_heads / c->n_kv_heads);
    printf("head_dim:    %d\nvocab_size:  %d\nseq_len:     %d\n", c->head_dim, c->vocab_size, c->seq_len);
    printf("rope:        %s, theta %g\nnorm_eps:    %g\nclassifier:  %s\n",
           c->rope_style == KVM_ROPE_INTERLEAVED ? "interleaved pairs" : "half split", c->rope_theta, c->norm_eps,
           c->shared_classifier ? "shared with token embedding" : "separate");
    printf("parameters:  %lld\nkv_bytes_per_token: %lld (float32)\n", (long long)kvm_model_n_params(m),
           (long long)kvm_model_kv_bytes(c, 1));
    kvm_model_close(&m);
    return 0;
}
