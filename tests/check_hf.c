/* check_hf.c: Hugging Face folders as models. The SmolLM2 folder scripts/gguf-to-hf.sh writes
 * from the GGUF (same dequantised weights, Q/K rows un-permuted, half-split RoPE) against the
 * GGUF itself: logits within 1e-5 relative on the 256-token sequence, identical greedy
 * generations, `kvmill info`; skipped visibly when the folder is absent. Tiny folders the test
 * writes (tests/check_hf_tiny.c has the reference comparisons) live in their own suite. */
#include "common/kvm_error.h"
#include "model/kvm_forward.h"
#include "model/kvm_model.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define GGUF_PATH "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define REF_DIR "tests/data/smollm2"
#ifdef __SANITIZE_ADDRESS__
#define KVM_LOGIT_TOKENS 64 /* the ASan build prefills slowly */
#define KVM_GREEDY_STEPS 16
#else
#define KVM_LOGIT_TOKENS 256
#define KVM_GREEDY_STEPS 64
#endif

/* The converted folder: $KVMILL_HF_SMOLLM2, else models/SmolLM2-135M-Instruct-hf. */
static const char *hf_dir(void)
{
    const char *e = getenv("KVMILL_HF_SMOLLM2");
    return e && *e ? e : "models/SmolLM2-135M-Instruct-hf";
}

static int have_both(void)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", hf_dir());
    FILE *a = fopen(GGUF_PATH, "rb"), *b = fopen(p, "rb");
    int ok = a && b;
    if (a) fclose(a);
    if (b) fclose(b);
    if (!ok)
        printf("SKIP: %s or %s absent (run scripts/get-model.sh, then scripts/gguf-to-hf.sh %s %s): "
               "Hugging Face folder vs GGUF not checked\n",
               GGUF_PATH, p, GGUF_PATH, hf_dir());
    return ok;
}

static int read_ids(const char *path, int32_t *ids, int max)
{
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    char line[256];
    int n = 0;
    while (n < max && fgets(line, sizeof line, f))
        if (line[0] != '#') ids[n++] = (int32_t)atoi(line);
    fclose(f);
    return n;
}

static float *prefill_logits(const kvm_model *m, const int32_t *ids, int n)
{
    kvm_forward *f;
    kvm_kvcache *c;
    ck_assert_int_eq(kvm_forward_new(m, NULL, n, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(m, n, &c), 0);
    float *logits = malloc((size_t)n * m->cfg.vocab_size * sizeof *logits);
    ck_assert_msg(kvm_forward_prefill(f, c, ids, n, logits, KVM_LOGITS_ALL) == 0, "%s", kvm_errmsg());
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
    return logits;
}

static int argmax_of(const float *l, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (l[i] > l[b]) b = i;
    return b;
}

/* The folder's shapes match the GGUF's, and per position max |dlogit| / max |logit| <= 1e-5. */
START_TEST(test_smol_logits)
{
    if (!have_both()) return;
    kvm_model *g, *h;
    ck_assert_msg(kvm_model_open(GGUF_PATH, &g) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(kvm_model_set_weight_dtype(g, KVM_MODEL_WEIGHTS_F32), 0); /* the folder holds these values in F32 */
    ck_assert_msg(kvm_model_open(hf_dir(), &h) == 0, "%s", kvm_errmsg());
    ck_assert_str_eq(h->format, "hf");
    ck_assert_str_eq(h->arch, "LlamaForCausalLM");
    ck_assert_int_eq(h->cfg.rope_style, KVM_ROPE_HALF);
    ck_assert_int_eq(g->cfg.rope_style, KVM_ROPE_INTERLEAVED);
    ck_assert_int_eq(h->cfg.dim, g->cfg.dim);
    ck_assert_int_eq(h->cfg.n_kv_heads, g->cfg.n_kv_heads);
    ck_assert_int_eq(h->cfg.vocab_size, g->cfg.vocab_size);
    ck_assert_int_eq(h->cfg.shared_classifier, g->cfg.shared_classifier);
    ck_assert_float_eq(h->cfg.rope_theta, g->cfg.rope_theta);
    ck_assert_float_eq(h->cfg.norm_eps, g->cfg.norm_eps);
    ck_assert_int_eq(h->cfg.eos_id, g->cfg.eos_id);
    ck_assert_int_eq(kvm_model_n_params(h), kvm_model_n_params(g));
    int32_t ids[256];
    ck_assert_int_eq(read_ids(REF_DIR "/seq256.ids", ids, 256), 256);
    const int N = KVM_LOGIT_TOKENS, V = g->cfg.vocab_size;
    float *lg = prefill_logits(g, ids, N), *lh = prefill_logits(h, ids, N);
    double worst = 0;
    int argmax_diff = 0;
    for (int i = 0; i < N; i++) {
        double dmax = 0, amax = 0;
        for (int j = 0; j < V; j++) {
            dmax = fmax(dmax, fabs((double)lg[(size_t)i * V + j] - lh[(size_t)i * V + j]));
            amax = fmax(amax, fabs((double)lg[(size_t)i * V + j]));
        }
        worst = fmax(worst, dmax / amax);
        argmax_diff += argmax_of(lg + (size_t)i * V, V) != argmax_of(lh + (size_t)i * V, V);
    }
    printf("SmolLM2 Hugging Face folder vs GGUF, %d tokens: max over positions of max|dlogit| / max|logit| = %.3g; "
           "argmax differs at %d positions\n",
           N, worst, argmax_diff);
    ck_assert_double_le(worst, 1e-5);
    ck_assert_int_eq(argmax_diff, 0);
    free(lg);
    free(lh);
    kvm_model_close(&g);
    kvm_model_close(&h);
}
END_TEST

/* Greedy decode from the greedy.ids prompt: the token sequences of both models. */
static void greedy(const kvm_model *m, const int32_t *prompt, int n_prompt, int n_gen, int32_t *out)
{
    kvm_forward *f;
    kvm_kvcache *c;
    const int V = m->cfg.vocab_size;
    ck_assert_int_eq(kvm_forward_new(m, NULL, n_prompt, &f), 0);
    ck_assert_int_eq(kvm_forward_cache_new(m, n_prompt + n_gen, &c), 0);
    float *logits = malloc((size_t)V * sizeof *logits);
    ck_assert_int_eq(kvm_forward_prefill(f, c, prompt, n_prompt, logits, KVM_LOGITS_LAST), 0);
    for (int g = 0; g < n_gen; g++) {
        out[g] = argmax_of(logits, V);
        if (g + 1 < n_gen) ck_assert_int_eq(kvm_forward_decode(f, c, out[g], logits), 0);
    }
    free(logits);
    kvm_kvcache_free(&c);
    kvm_forward_free(&f);
}

START_TEST(test_smol_greedy)
{
    if (!have_both()) return;
    int32_t ref[256];
    int n_all = read_ids(REF_DIR "/f32/greedy.ids", ref, 256), n_prompt = 0;
    FILE *fp = fopen(REF_DIR "/f32/greedy.ids", "r");
    ck_assert_int_eq(fscanf(fp, "# prompt %d", &n_prompt), 1);
    fclose(fp);
    ck_assert_int_gt(n_all, n_prompt);
    kvm_model *g, *h;
    ck_assert_int_eq(kvm_model_open(GGUF_PATH, &g), 0);
    ck_assert_int_eq(kvm_model_set_weight_dtype(g, KVM_MODEL_WEIGHTS_F32), 0);
    ck_assert_int_eq(kvm_model_open(hf_dir(), &h), 0);
    int32_t a[KVM_GREEDY_STEPS], b[KVM_GREEDY_STEPS];
    greedy(g, ref, n_prompt, KVM_GREEDY_STEPS, a);
    greedy(h, ref, n_prompt, KVM_GREEDY_STEPS, b);
    int same = 0;
    while (same < KVM_GREEDY_STEPS && a[same] == b[same])
        same++;
    printf("SmolLM2 greedy: %d of %d tokens of the Hugging Face folder equal the GGUF's\n", same, KVM_GREEDY_STEPS);
    ck_assert_int_eq(same, KVM_GREEDY_STEPS);
    kvm_model_close(&g);
    kvm_model_close(&h);
}
END_TEST

START_TEST(test_smol_info)
{
    if (!have_both()) return;
    char cmd[8192], *out = NULL, *err = NULL;
    snprintf(cmd, sizeof cmd, "%s/kvmill info --model %s", kvm_test_bin(), hf_dir());
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    ck_assert_ptr_nonnull(strstr(out, "format:      hf"));
    ck_assert_ptr_nonnull(strstr(out, "arch:        LlamaForCausalLM"));
    ck_assert_ptr_nonnull(strstr(out, "dtype:       F32"));
    ck_assert_ptr_nonnull(strstr(out, "weights:     f32 in memory on the CPU (weight_dtype auto)"));
    ck_assert_ptr_nonnull(strstr(out, "rope:        half split, theta 100000"));
    ck_assert_ptr_nonnull(strstr(out, "parameters:  134515008"));
    free(out);
    free(err);
    /* the weights are as readable as the folder's other files (safetensors wrote them 0600) */
    char p1[4200], p2[4200];
    struct stat s1, s2;
    snprintf(p1, sizeof p1, "%s/model.safetensors", hf_dir());
    snprintf(p2, sizeof p2, "%s/config.json", hf_dir());
    ck_assert(stat(p1, &s1) == 0 && stat(p2, &s2) == 0);
    ck_assert_msg((s1.st_mode & 0777) == (s2.st_mode & 0777), "model.safetensors mode %o, config.json %o",
                  (unsigned)(s1.st_mode & 0777), (unsigned)(s2.st_mode & 0777));
    /* --model DIR: the folder's own tokenizer.json and chat template */
    snprintf(cmd, sizeof cmd,
             "%s/kvmill generate --model %s --chat --prompt 'What is the capital of France?' -n 64 --temperature 0",
             kvm_test_bin(), hf_dir());
    ck_assert_int_eq(kvm_test_run(cmd, &out, &err), 0);
    printf("kvmill generate --model DIR --chat: %s", out);
    ck_assert_msg(strstr(out, "Paris") != NULL, "no Paris in '%s'", out);
    ck_assert_msg(strstr(out, "<|im") == NULL, "control token text in '%s'", out);
    free(out);
    free(err);
}
END_TEST

static Suite *hf_suite(void)
{
    Suite *s = suite_create("hf");
    struct {
        const char *name;
        const TTest *fn;
    } cases[] = {{"smol_logits", test_smol_logits}, {"smol_greedy", test_smol_greedy}, {"smol_info", test_smol_info}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, 600);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(hf_suite()); }
