/* cmd_generate.c: `kvmill generate`: run.c-compatible text generation. The prompt goes
 * through one batched prefill, then one decode step per new token; -n counts positions as
 * run.c's -n does (BOS and prompt tokens included), and output stops at BOS. */
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_model.h"
#include "model/kvm_forward.h"
#include "model/kvm_sampler.h"
#include "common/kvm_error.h"

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

/* Reads token ids, one decimal per line, each in [0, vocab). Prints errors naming file:line. */
static int read_token_file(const char *path, int vocab, int32_t **ids, int64_t *n)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "kvmill generate: --tokens %s: %s\n", path, strerror(errno));
        return 1;
    }
    int64_t cap = 256, cnt = 0, line = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    char buf[128];
    int rc = 0;
    while (v && fgets(buf, sizeof buf, f)) {
        line++;
        char *s = buf, *end;
        while (*s == ' ' || *s == '\t') s++;
        if (*s == '\n' || *s == '\0') continue;
        errno = 0;
        long id = strtol(s, &end, 10);
        while (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n') end++;
        if (errno || end == s || *end || id < 0 || id >= vocab) {
            fprintf(stderr, "kvmill generate: %s:%lld: '%.*s' is not a token id in [0, %d)\n", path, (long long)line,
                    (int)strcspn(buf, "\r\n"), buf, vocab);
            rc = 1;
            break;
        }
        if (cnt == cap) {
            int32_t *nv = realloc(v, (size_t)(cap *= 2) * sizeof *v);
            if (!nv) { free(v); v = NULL; break; }
            v = nv;
        }
        v[cnt++] = (int32_t)id;
    }
    fclose(f);
    if (!v) { fprintf(stderr, "kvmill generate: out of memory\n"); return 1; }
    if (!rc && cnt == 0) { fprintf(stderr, "kvmill generate: %s: no token ids\n", path); rc = 1; }
    if (rc) { free(v); return rc; }
    *ids = v;
    *n = cnt;
    return 0;
}

/* Prints token `next` following `prev`: its piece (run.c safe_printf) or its id. */
static void emit(const kvm_tokenizer *tok, int32_t prev, int32_t next)
{
    if (!tok) {
        printf("%d\n", next);
        return;
    }
    size_t len;
    const char *piece = kvm_tokenizer_piece(tok, prev, next, &len);
    if (kvm_tokenizer_piece_printable(piece, len)) fwrite(piece, 1, len, stdout);
    fflush(stdout);
}

typedef struct gen_args {
    int64_t steps;
    double temperature, topp;
    uint64_t seed;
} gen_args;

static int generate(const kvm_model *m, const kvm_kernels *k, const kvm_tokenizer *tok, const int32_t *p, int64_t np,
                    const gen_args *a)
{
    kvm_forward *f = NULL;
    kvm_kvcache *cache = NULL;
    kvm_sampler *smp = NULL;
    float *logits = malloc((size_t)m->cfg.vocab_size * sizeof *logits);
    int64_t steps = a->steps, n_pre = np < steps ? np : steps, produced = 0;
    int rc = logits ? 0 : kvm_err(KVM_ENOMEM, "out of memory");
    if (!rc) rc = kvm_forward_new(m, k, np, &f);
    if (!rc) rc = kvm_forward_cache_new(m, steps, &cache);
    if (!rc) rc = kvm_sampler_new(m->cfg.vocab_size, (float)a->temperature, (float)a->topp, a->seed, &smp);
    double t0 = now_s();
    if (!rc) rc = kvm_forward_prefill(f, cache, p, n_pre, logits, KVM_LOGITS_LAST);
    for (int64_t i = 1; !rc && i < (np < steps + 1 ? np : steps + 1); i++) emit(tok, p[i - 1], p[i]);
    if (!rc && steps >= np) {
        int32_t token = p[np - 1];
        for (int64_t pos = np;; pos++) {
            int32_t next = kvm_sampler_sample(smp, logits);
            if (next == m->cfg.bos_id) break;
            emit(tok, token, next);
            produced++;
            if (pos >= steps) break;
            if ((rc = kvm_forward_decode(f, cache, next, logits))) break;
            token = next;
        }
    }
    if (tok) printf("\n");
    double dt = now_s() - t0;
    if (!rc && dt > 0) fprintf(stderr, "achieved tok/s: %f\n", (double)(n_pre + produced) / dt);
    if (rc) fprintf(stderr, "kvmill generate: %s\n", kvm_errmsg());
    kvm_sampler_free(&smp);
    kvm_kvcache_free(&cache);
    kvm_forward_free(&f);
    free(logits);
    return rc;
}

int kvm_cmd_generate(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"model", 1, "model file (llama2.c checkpoint)", NULL},
        {"tokenizer", 1, "tokenizer (default: tok512.bin or tokenizer.bin beside the model)", NULL},
        {"prompt", 1, "prompt text", NULL},
        {"tokens", 1, "file of prompt token ids, one per line (replaces --prompt)", NULL},
        {"n", 1, "positions to run, BOS and prompt included, as run.c's -n (default 256; 0 = seq_len)", NULL},
        {"temperature", 1, "sampling temperature, 0 = greedy (default 1.0)", NULL},
        {"topp", 1, "top-p nucleus sampling in [0, 1] (default 0.9)", NULL},
        {"seed", 1, "random seed (default: time)", NULL},
        {"device", 1, "cpu or cuda:N (default cpu)", NULL},
        {"threads", 1, "BLAS threads", NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("generate", "Generates text from a prompt; prints it to stdout.", argc, argv, opts, NULL, 0,
                      &n_pos, &help))
        return help ? 0 : 2;
    const char *model_path = kvm_cli_get(opts, "model"), *prompt = kvm_cli_get(opts, "prompt"),
               *tokens = kvm_cli_get(opts, "tokens");
    if (!model_path) { fprintf(stderr, "kvmill generate: --model is required\n"); return 2; }
    if (prompt && tokens) { fprintf(stderr, "kvmill generate: give --prompt or --tokens, not both\n"); return 2; }
    gen_args a = {.steps = 256, .temperature = 1.0, .topp = 0.9, .seed = (uint64_t)time(NULL)};
    int64_t v;
    const char *s;
    if ((s = kvm_cli_get(opts, "n"))) { if (kvm_cli_int("generate", "n", s, 0, INT32_MAX, &a.steps)) return 2; }
    if ((s = kvm_cli_get(opts, "temperature")) && kvm_cli_float("generate", "temperature", s, 0, 1e6, &a.temperature)) return 2;
    if ((s = kvm_cli_get(opts, "topp")) && kvm_cli_float("generate", "topp", s, 0, 1, &a.topp)) return 2;
    if ((s = kvm_cli_get(opts, "seed"))) { if (kvm_cli_int("generate", "seed", s, 0, INT64_MAX, &v)) return 2; a.seed = (uint64_t)v; }
    const kvm_kernels *k;
    if (kvm_cli_setup_device("generate", kvm_cli_get(opts, "device"), kvm_cli_get(opts, "threads"), &k)) return 2;
    kvm_model *m;
    kvm_tokenizer *tok;
    if (kvm_cli_open_model("generate", model_path, kvm_cli_get(opts, "tokenizer"), !tokens, &m, &tok)) return 1;
    if (a.steps == 0 || a.steps > m->cfg.seq_len) a.steps = m->cfg.seq_len;
    int32_t *p = NULL;
    int64_t np = 0;
    int rc = 0;
    if (tokens) rc = read_token_file(tokens, m->cfg.vocab_size, &p, &np);
    else if (kvm_tokenizer_encode(tok, prompt ? prompt : "", prompt ? strlen(prompt) : 0, 1, 0, &p, &np)) {
        fprintf(stderr, "kvmill generate: %s\n", kvm_errmsg());
        rc = 1;
    }
    if (!rc) rc = generate(m, k, tok, p, np, &a) ? 1 : 0;
    free(p);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return rc;
}
