/* cmd_generate.c: `kvmill generate`: run.c-compatible text generation. The prompt goes
 * through one batched prefill, then one decode step per new token; -n counts positions as
 * run.c's -n does (BOS and prompt tokens included), and output stops at BOS (and, for GGUF
 * models, at EOS). --chat wraps the prompt in the model's ChatML chat template. */
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_model.h"
#include "model/kvm_chat.h"
#include "model/kvm_forward.h"
#include "model/kvm_forward_cuda.h"
#include "model/kvm_model_window.h"
#include "model/kvm_sampler.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Reads the --tokens file (kvm_cli_read_token_ids). Returns 2 for a file that is missing or a
 * folder (a usage error, as a bad --model is), else kvm_cli_read_token_ids's status. */
static int read_token_file(const char *path, int vocab, int32_t **ids, int64_t *n)
{
    FILE *f;
    /* a folder opens on Linux and its first read fails: it read as "no token ids" */
    if (kvm_file_open_input(path, "r", "--tokens", &f)) {
        fprintf(stderr, "kvmill generate: %s\n", kvm_errmsg());
        return 2;
    }
    int rc = kvm_cli_read_token_ids("generate", f, path, vocab, ids, n);
    fclose(f);
    return rc;
}

/* Prints token `next` following `prev`: its piece (run.c safe_printf; raw = 1 prints every
 * byte, as byte-level BPE pieces may be parts of one UTF-8 character) or its id. */
static void emit(const kvm_tokenizer *tok, int32_t prev, int32_t next, int raw)
{
    if (!tok) {
        printf("%d\n", next);
        return;
    }
    size_t len;
    const char *piece = kvm_tokenizer_piece(tok, prev, next, &len);
    if (raw ? len > 0 : kvm_tokenizer_piece_printable(piece, len)) fwrite(piece, 1, len, stdout);
    kvm_cli_flush_stdout(); /* a failure's errno kept for main's message */
}

typedef struct gen_args {
    int64_t steps;
    int stop_at_eos;   /* 1 (GGUF models): EOS ends the output too, and pieces print raw */
    int echo_first;    /* 1: print p[0] as well (no BOS in front of the prompt) */
    int quiet_prompt;  /* 1: print only the generated tokens (--chat) */
    double temperature, topp;
    uint64_t seed;
    kvm_kv_dtype kv_dtype; /* the CPU forward's cache (--kv-dtype) */
} gen_args;

/* The forward generate runs: the CPU forward (kvm_forward over a host cache), or on cuda:N the
 * device-resident forward (model/kvm_forward_cuda.h), whose cache stays on the device. */
typedef struct gen_fwd {
    kvm_forward *f;
    kvm_kvcache *cache;
#ifdef KVM_WITH_CUDA
    kvm_cuda_model *dev;
#endif
} gen_fwd;

static int gen_fwd_new(const kvm_model *m, const kvm_kernels *k, int cuda_device, int64_t np, int64_t steps,
                       kvm_kv_dtype kv_dtype, gen_fwd *g)
{
#ifdef KVM_WITH_CUDA
    if (cuda_device >= 0) /* float32 weights stay bit-comparable with the CPU; bf16 is for benchmarks */
        return kvm_model_cuda_new(m, cuda_device, KVM_CUDA_F32, steps, np > 0 ? np : 1, &g->dev);
#endif
    int rc = kvm_forward_new(m, k, np < 512 ? np : 512, &g->f); /* prefill in chunks: scratch for 512 rows, not N */
    return rc ? rc : kvm_forward_cache_new_dtype(m, steps, kv_dtype, &g->cache);
}

/* logits of the last of tokens[0, n) */
static int gen_fwd_run(gen_fwd *g, const int32_t *tokens, int64_t n, float *logits)
{
#ifdef KVM_WITH_CUDA
    if (g->dev) return kvm_cuda_model_forward(g->dev, tokens, n, logits, 1, NULL);
#endif
    return n == 1 ? kvm_forward_decode(g->f, g->cache, tokens[0], logits)
                  : kvm_forward_prefill(g->f, g->cache, tokens, n, logits, KVM_LOGITS_LAST);
}

static void gen_fwd_free(gen_fwd *g)
{
#ifdef KVM_WITH_CUDA
    kvm_cuda_model_free(&g->dev);
#endif
    kvm_kvcache_free(&g->cache);
    kvm_forward_free(&g->f);
}

static int generate(const kvm_model *m, const kvm_kernels *k, int cuda_device, const kvm_tokenizer *tok,
                    const int32_t *p, int64_t np, const gen_args *a)
{
    gen_fwd g = {0};
    kvm_sampler *smp = NULL;
    float *logits = malloc((size_t)m->cfg.vocab_size * sizeof *logits);
    int64_t steps = a->steps, n_pre = np < steps ? np : steps, produced = 0;
    int rc = logits ? 0 : kvm_err(KVM_ENOMEM, "out of memory");
    if (!rc) rc = gen_fwd_new(m, k, cuda_device, np, steps, a->kv_dtype, &g);
    if (!rc) rc = kvm_sampler_new(m->cfg.vocab_size, (float)a->temperature, (float)a->topp, a->seed, &smp);
    double t0 = now_s();
    if (!rc) rc = gen_fwd_run(&g, p, n_pre, logits);
    if (!rc && !a->quiet_prompt && a->echo_first && np > 0) emit(tok, -1, p[0], a->stop_at_eos);
    for (int64_t i = 1; !rc && !a->quiet_prompt && i < (np < steps + 1 ? np : steps + 1); i++)
        emit(tok, p[i - 1], p[i], a->stop_at_eos);
    if (!rc && steps >= np) {
        int32_t token = p[np - 1];
        for (int64_t pos = np;; pos++) {
            int32_t next = kvm_sampler_sample(smp, logits);
            if (next == m->cfg.bos_id || (a->stop_at_eos && kvm_model_is_eos(&m->cfg, next))) break;
            emit(tok, token, next, a->stop_at_eos);
            produced++;
            if (pos >= steps) break;
            if ((rc = gen_fwd_run(&g, &next, 1, logits))) break;
            token = next;
        }
    }
    if (tok) printf("\n");
    double dt = now_s() - t0;
    if (!rc && dt > 0) fprintf(stderr, "achieved tok/s: %f\n", (double)(n_pre + produced) / dt);
    if (rc) fprintf(stderr, "kvmill generate: %s\n", kvm_cli_errmsg("generate"));
    kvm_sampler_free(&smp);
    gen_fwd_free(&g);
    free(logits);
    return rc;
}

int kvm_cmd_generate(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"model", 1, KVM_CLI_MODEL_HELP, NULL},
        {"tokenizer", 1,
         "tokenizer (default: a GGUF model's own, a Hugging Face folder's tokenizer.json, else tok512.bin or "
         "tokenizer.bin beside the model)",
         NULL},
        {"prompt", 1, "prompt text", NULL},
        {"chat", 0, "wrap --prompt in the model's chat template (ChatML: system, user, assistant turns)", NULL},
        {"system", 1, "system message for --chat (default: the template's own default, if it has one)", NULL},
        {"tokens", 1, "file of prompt token ids, one per line (replaces --prompt)", NULL},
        {"n", 1,
         "positions to run, BOS and prompt included, as run.c's -n (default 256; 0 = the model's window: seq_len, or "
         "its sliding_window when smaller)",
         NULL},
        {"temperature", 1, "sampling temperature, 0 = greedy (default 1.0)", NULL},
        {"topp", 1, "top-p nucleus sampling in [0, 1] (default 0.9)", NULL},
        {"seed", 1, "random seed >= 1 (default: time; 0 is refused: the sampler's state must not be 0)", NULL},
        {"device", 1, "cpu or cuda:N (default cpu)", NULL},
        {"threads", 1,
         "compute threads of the CPU kernels (default: every CPU the process may use: its affinity mask and cgroup CPU "
         "quota)",
         NULL},
        {"weight-dtype", 1, KVM_CLI_WEIGHT_DTYPE_HELP, NULL},
        {"kv-dtype", 1, KVM_CLI_KV_DTYPE_HELP, NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("generate", "Generates text from a prompt; prints it to stdout.", argc, argv, opts, NULL, 0,
                      &n_pos, &help))
        return help ? 0 : 2;
    const char *model_path = kvm_cli_get(opts, "model"), *prompt = kvm_cli_get(opts, "prompt"),
               *tokens = kvm_cli_get(opts, "tokens");
    if (!model_path) { fprintf(stderr, "kvmill generate: --model is required\n"); return 2; }
    if (prompt && tokens) { fprintf(stderr, "kvmill generate: give --prompt or --tokens, not both\n"); return 2; }
    int chat = kvm_cli_get(opts, "chat") != NULL;
    if (chat && tokens) { fprintf(stderr, "kvmill generate: --chat needs --prompt, not --tokens\n"); return 2; }
    if (kvm_cli_get(opts, "system") && !chat) { fprintf(stderr, "kvmill generate: --system needs --chat\n"); return 2; }
    gen_args a = {.steps = 256, .temperature = 1.0, .topp = 0.9, .seed = (uint64_t)time(NULL)};
    int64_t v;
    const char *s;
    if ((s = kvm_cli_get(opts, "n"))) { if (kvm_cli_int("generate", "n", s, 0, INT32_MAX, &a.steps)) return 2; }
    if ((s = kvm_cli_get(opts, "temperature")) && kvm_cli_float("generate", "temperature", s, 0, 1e6, &a.temperature)) return 2;
    if ((s = kvm_cli_get(opts, "topp")) && kvm_cli_float("generate", "topp", s, 0, 1, &a.topp)) return 2;
    if ((s = kvm_cli_get(opts, "seed"))) { if (kvm_cli_int("generate", "seed", s, 0, INT64_MAX, &v)) return 2; a.seed = (uint64_t)v; }
    if (s && a.seed == 0) { /* xorshift's state 0 stays 0: every coin 0, the same token each step */
        fprintf(stderr, "kvmill generate: --seed 0: seeds start at 1 (run.c reads 0 as 'the time'; the sampler's "
                        "xorshift state cannot be 0); give a seed >= 1, or leave --seed out for the time\n");
        return 2;
    }
    if (kvm_cli_kv_dtype("generate", kvm_cli_get(opts, "kv-dtype"), &a.kv_dtype)) return 2;
    const char *dev = kvm_cli_get(opts, "device");
    if (a.kv_dtype != KVM_KV_F32 && dev && strcmp(dev, "cpu")) {
        fprintf(stderr, "kvmill generate: --kv-dtype %s is for the CPU forward; on --device %s the cache stays float32 "
                        "on the device (leave --kv-dtype out)\n", kvm_kvcache_dtype_name(a.kv_dtype), dev);
        return 2;
    }
    const kvm_kernels *k;
    if (kvm_cli_setup_device("generate", kvm_cli_get(opts, "device"), kvm_cli_get(opts, "threads"), &k)) return 2;
    kvm_model *m;
    kvm_tokenizer *tok;
    int ost = kvm_cli_open_model("generate", model_path, kvm_cli_get(opts, "tokenizer"), !tokens, &m, &tok);
    if (ost) return ost;
    if (kvm_cli_weight_dtype("generate", kvm_cli_get(opts, "weight-dtype"), m)) {
        kvm_tokenizer_close(&tok);
        kvm_model_close(&m);
        return 2;
    }
    int32_t *p = NULL;
    int64_t np = 0;
    int rc = 0;
    char *chat_text = NULL;
    a.stop_at_eos = strcmp(m->format, "gguf") == 0 || strcmp(m->format, "hf") == 0;
    if (tokens) rc = read_token_file(tokens, m->cfg.vocab_size, &p, &np);
    else if (chat && (rc = kvm_chat_prompt(tok, kvm_cli_get(opts, "system"), prompt ? prompt : "", &chat_text))) {
        fprintf(stderr, "kvmill generate: --chat: %s\n", kvm_errmsg());
        rc = rc == KVM_ENOTSUP ? 2 : 1; /* a model without a template: usage, as run, serve and eval say */
    } else {
        const char *text = chat_text ? chat_text : prompt ? prompt : "";
        int add_bos = kvm_tokenizer_add_bos(tok);
        a.echo_first = !add_bos;
        a.quiet_prompt = chat;
        if (kvm_tokenizer_encode(tok, text, strlen(text), add_bos, 0, &p, &np)) {
            fprintf(stderr, "kvmill generate: %s\n", kvm_cli_errmsg("generate"));
            rc = 1;
        } else if (np == 0) {
            fprintf(stderr, "kvmill generate: the prompt is empty and the model adds no BOS; give --prompt\n");
            rc = 2;
        }
    }
    free(chat_text);
    const int window = kvm_model_window(&m->cfg); /* a sliding window the forward refuses to pass */
    if (!rc && np > window) {                     /* cut to the window, nothing generated, exit 0 */
        fprintf(stderr,
                "kvmill generate: the prompt is %lld tokens%s, more than the model's window of %d positions%s\n",
                (long long)np, tokens ? "" : " (BOS and any chat template included)", window,
                kvm_model_window_note(&m->cfg));
        rc = 2;
    }
    if (!rc && a.steps > window) /* run.c's -n clamps as well; said, not silent */
        fprintf(stderr, "kvmill generate: -n %lld is past the model's window%s: running its %d positions\n",
                (long long)a.steps, kvm_model_window_note(&m->cfg), window);
    if (a.steps == 0 || a.steps > window) a.steps = window;
    int cuda_device = -1;
    (void)kvm_device_parse(dev, &cuda_device); /* validated by kvm_cli_setup_device above */
    if (!rc) rc = generate(m, k, cuda_device, tok, p, np, &a) ? 1 : 0;
    free(p);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return rc;
}
