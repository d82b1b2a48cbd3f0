/* cmd_info.c: `kvmill info`: a model's shapes, conventions and sizes. */
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_model.h"

#include <stdio.h>

int kvm_cmd_info(int argc, char **argv)
{
    kvm_cli_opt opts[] = {{"model", 1, KVM_CLI_MODEL_HELP, NULL},
                          {"weight-dtype", 1, KVM_CLI_WEIGHT_DTYPE_HELP, NULL},
                          {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("info", "Prints a model's shapes and parameter count.", argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *path = kvm_cli_get(opts, "model");
    if (!path) { fprintf(stderr, "kvmill info: --model is required\n"); return 2; }
    kvm_model *m;
    int ost = kvm_cli_open_model("info", path, NULL, 0, &m, NULL);
    if (ost) return ost;
    const char *wd = kvm_cli_get(opts, "weight-dtype");
    if (kvm_cli_weight_dtype("info", wd, m)) {
        kvm_model_close(&m);
        return 2;
    }
    const kvm_model_config *c = &m->cfg;
    printf("model:       %s\nformat:      %s\narch:        %s\n", m->path, m->format, m->arch);
    if (m->dtype[0]) printf("dtype:       %s (in the file)\n", m->dtype);
    kvm_model_weight_dtype d = (kvm_model_weight_dtype)m->weight_dtype;
    kvm_weight_dtype wq = kvm_model_weight_dtype_for(&m->layers[0].wq, d), wc = kvm_model_weight_dtype_for(&m->wcls, d);
    printf("weights:     %s in memory on the CPU (weight_dtype %s)", kvm_model_weight_dtype_name(wq), wd ? wd : "auto");
    if (wc != wq) printf(", classifier %s", kvm_model_weight_dtype_name(wc));
    printf("\n");
    printf("dim:         %d\nhidden_dim:  %d\nn_layers:    %d\nn_heads:     %d\nn_kv_heads:  %d (GQA %d:1)\n",
           c->dim, c->hidden_dim, c->n_layers, c->n_heads, c->n_kv_heads, c->n_heads / c->n_kv_heads);
    printf("head_dim:    %d\nvocab_size:  %d\nseq_len:     %d\n", c->head_dim, c->vocab_size, c->seq_len);
    printf("rope:        %s, theta %g\nnorm_eps:    %g\nclassifier:  %s\n",
           c->rope_style == KVM_ROPE_INTERLEAVED ? "interleaved pairs" : "half split", c->rope_theta, c->norm_eps,
           c->shared_classifier ? "shared with token embedding" : "separate");
    if (c->rope_scaling.type == 1)
        printf("rope_scaling: llama3, factor %g, low/high_freq_factor %g/%g, original_max %d\n", c->rope_scaling.factor,
               c->rope_scaling.low_freq_factor, c->rope_scaling.high_freq_factor, c->rope_scaling.original_max);
    if (c->attn_bias || c->qk_norm || c->sliding_window)
        printf("attention:   %s%s%s\n", c->attn_bias ? "q/k/v biases " : "", c->qk_norm ? "q/k RMSNorm " : "",
               c->sliding_window ? "sliding window (positions limited to it)" : "");
    printf("bos/eos:     %d /", c->bos_id);
    for (int i = 0; i < c->n_eos; i++) printf(" %d", c->eos_ids[i]);
    printf("\nparameters:  %lld\nkv_bytes_per_token: %lld (float32)\n", (long long)kvm_model_n_params(m),
           (long long)kvm_model_kv_bytes(c, 1));
    kvm_model_close(&m);
    return 0;
}
