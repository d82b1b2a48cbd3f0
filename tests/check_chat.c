/* check_chat.c: [model] chat = true (issue 14): documents are cached as the opening of a chat
 * user turn (the template up to the user's content, then the document) and served prompts are
 * closed with the end of the turn and the assistant marker. The config id changes with the
 * framing; a model without a chat template refuses it by name; `kvmill run` stores the framed
 * ids and `kvmill serve` answers as the model asked the whole chat turn at once (SmolLM2). */
#include "common/kvm_error.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "model/kvm_chat.h"
#include "model/kvm_tokenizer.h"
#include "pipeline/kvm_chatcfg.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_corpus.h"
#include "pipeline/kvm_jobcfg.h"
#include "store/kvm_store.h"
#include "tests/util/kvm_test.h"

#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define SMOL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static kvm_config *parse(const char *model_extra)
{
    char text[2048];
    snprintf(text, sizeof text, "[model]\npath = %s\n%s\n[compress]\nmethod = h2o\nbudget = 32\n",
             kvm_test_data_path("models/stories260K.bin"), model_extra);
    kvm_config *c = NULL;
    ck_assert_msg(kvm_config_parse(text, "test.ini", &c) == 0, "%s", kvm_errmsg());
    return c;
}

static kvm_store_id config_id(const char *model_extra, char **canonical)
{
    kvm_config *c = parse(model_extra);
    kvm_store_id id;
    size_t n;
    char *text = NULL;
    ck_assert_int_eq(kvm_jobcfg_config_id(c, NULL, &id, canonical ? &text : NULL, &n), 0);
    if (canonical) { /* bytes of length n, not a C string */
        *canonical = strndup(text, n);
        free(text);
    }
    kvm_config_free(&c);
    return id;
}

/* chat = false keeps the ids of configs without the key; chat = true and each system message
 * give their own; a system message is one escaped line; system without chat is refused. */
START_TEST(test_config_id)
{
    char *a_t = NULL, *c_t = NULL, *d_t = NULL;
    kvm_store_id a = config_id("", &a_t), b = config_id("chat = false", NULL), c = config_id("chat = true", &c_t),
                 d = config_id("chat = true\nsystem = be brief\\n", &d_t),
                 e = config_id("chat = true\nsystem = be short", NULL);
    ck_assert_int_eq(memcmp(&a, &b, sizeof a), 0);
    ck_assert_int_ne(memcmp(&a, &c, sizeof a), 0);
    ck_assert_int_ne(memcmp(&c, &d, sizeof a), 0);
    ck_assert_int_ne(memcmp(&d, &e, sizeof a), 0);
    ck_assert_ptr_null(strstr(a_t, "model.chat"));
    ck_assert_ptr_nonnull(strstr(c_t, "\nmodel.chat=true\n"));
    ck_assert_ptr_null(strstr(c_t, "model.system"));
    ck_assert_msg(strstr(d_t, "\nmodel.system=be brief\\\\n\n") != NULL, "canonical: %s", d_t);
    free(a_t);
    free(c_t);
    free(d_t);
    kvm_config *cfg = parse("system = hello");
    ck_assert_int_eq(kvm_jobcfg_check(cfg), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "[model] system is set but chat = false"), "%s", kvm_errmsg());
    kvm_config_free(&cfg);
    char bad[1024];
    snprintf(bad, sizeof bad, "[model]\npath = %s\nchat = maybe\n", kvm_test_data_path("models/stories260K.bin"));
    ck_assert_int_ne(kvm_config_parse(bad, "bad.ini", &cfg), 0);
    ck_assert_msg(strstr(kvm_errmsg(), "chat"), "%s", kvm_errmsg());
}
END_TEST

/* A Hugging Face tokenizer with a Llama-3 chat template, in a temporary folder. */
static kvm_tokenizer *llama3_tokenizer(char **dir)
{
    *dir = kvm_test_tmpdir();
    char p[4096];
    size_t n;
    char *tok = kvm_test_read_file("tests/data/hf/tokenizers/llama3_style/tokenizer.json", &n);
    ck_assert_ptr_nonnull(tok);
    snprintf(p, sizeof p, "%s/tokenizer.json", *dir);
    ck_assert_int_eq(kvm_test_write_file(p, tok, n), 0);
    free(tok);
    static const char tc[] = "{\"chat_template\": \"{{ bos_token }}{% for m in messages %}<|start_header_id|>"
                             "{{ m['role'] }}<|end_header_id|>\\n\\n{{ m['content'] }}<|eot_id|>{% endfor %}\"}";
    char q[4096];
    snprintf(q, sizeof q, "%s/tokenizer_config.json", *dir);
    ck_assert_int_eq(kvm_test_write_file(q, tc, strlen(tc)), 0);
    kvm_tokenizer *t = NULL;
    ck_assert_msg(kvm_tokenizer_open_hf(p, 0, &t) == 0, "%s", kvm_errmsg());
    return t;
}

static void expect_ids(const kvm_doc *d, const int32_t *want, int64_t n)
{
    ck_assert_int_eq(d->n_tokens, n);
    for (int64_t i = 0; i < n; i++)
        ck_assert_msg(d->tokens[i] == want[i], "id %lld: %d, want %d", (long long)i, d->tokens[i], want[i]);
}

/* query_source repeat's prompt for a chat model: KVzip's instruction closes the user turn that
 * the document opened, and the assistant's turn begins (the repeated copy is its answer): the
 * ids of instruction + the frame's suffix, no BOS. */
START_TEST(test_repeat_prompt_in_the_turn)
{
    char *dir;
    kvm_tokenizer *tok = llama3_tokenizer(&dir);
    char *open = NULL, *close = NULL, text[1024];
    ck_assert_int_eq(kvm_chat_frame(tok, NULL, &open, &close), 0);
    snprintf(text, sizeof text, "%s%s", KVM_SCULPT_REPEAT_INSTRUCTION, close);
    int32_t *got = NULL, *want = NULL;
    int64_t n_got = 0, n_want = 0;
    ck_assert_int_eq(kvm_sculpt_repeat_prompt(tok, 1, &got, &n_got), 0);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, text, strlen(text), 0, 0, &want, &n_want), 0);
    ck_assert_int_eq(n_got, n_want);
    ck_assert(!memcmp(got, want, (size_t)n_got * sizeof *got));
    char *back = NULL;
    size_t len = 0;
    ck_assert_int_eq(kvm_tokenizer_decode(tok, got, n_got, &back, &len), 0);
    ck_assert_msg(strstr(back, "\n\nRepeat the previous context exactly.") && strstr(back, "assistant"), "%s", back);
    ck_assert_int_gt(n_got, 8); /* the special tokens of the turn's end (not decoded as text) are in the ids */
    ck_assert_int_ne(got[0], kvm_tokenizer_bos(tok));
    free(back);
    free(got);
    free(want);
    free(open);
    free(close);
    kvm_tokenizer_close(&tok);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* kvm_chatcfg_frame from a config; a text document's ids are those of frame + text as one
 * string (also through a corpus folder, and truncated to the context with the frame's ids
 * counted); given tokens get the frame's ids after their BOS; an empty document stays an error. */
START_TEST(test_framed_documents)
{
    char *dir;
    kvm_tokenizer *tok = llama3_tokenizer(&dir);
    kvm_config *cfg = parse("chat = true\nsystem = Answer from the document.");
    char *open = NULL, *close = NULL;
    ck_assert_msg(kvm_chatcfg_frame(cfg, tok, &open, &close) == 0, "%s", kvm_errmsg());
    ck_assert_str_eq(open, "<|start_header_id|>system<|end_header_id|>\n\nAnswer from the document.<|eot_id|>"
                           "<|start_header_id|>user<|end_header_id|>\n\n");
    ck_assert_str_eq(close, "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    static const char text[] = "The red fox sleeps under the old oak tree.";
    char whole[1024];
    snprintf(whole, sizeof whole, "%s%s", open, text);
    int32_t *want = NULL, *frame_ids = NULL, *plain = NULL;
    int64_t n_want = 0, n_frame = 0, n_plain = 0;
    int bos = kvm_tokenizer_add_bos(tok);
    int32_t bos_id = kvm_tokenizer_bos(tok);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, whole, strlen(whole), bos, 0, &want, &n_want), 0);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, open, strlen(open), bos, 0, &frame_ids, &n_frame), 0);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, text, strlen(text), 1, 0, &plain, &n_plain), 0);
    ck_assert_int_gt(n_frame, 8);
    int V = kvm_tokenizer_vocab_size(tok);
    kvm_doc d = {.name = "fox", .text = (char *)text, .text_len = strlen(text)};
    ck_assert_msg(kvm_doc_prepare_n(&d, tok, V, bos_id, open, 4096, 4096) == 0, "%s", kvm_errmsg());
    expect_ids(&d, want, n_want);
    kvm_store_id h_framed = d.hash;
    free(d.tokens);
    /* without the frame: the plain ids, another hash */
    d = (kvm_doc){.name = "fox", .text = (char *)text, .text_len = strlen(text)};
    ck_assert_int_eq(kvm_doc_prepare_n(&d, tok, V, bos_id, NULL, 4096, 4096), 0);
    expect_ids(&d, plain, n_plain);
    ck_assert_int_ne(memcmp(&d.hash, &h_framed, sizeof d.hash), 0);
    free(d.tokens);
    /* truncation counts the frame */
    d = (kvm_doc){.name = "fox", .text = (char *)text, .text_len = strlen(text)};
    ck_assert_int_eq(kvm_doc_prepare_n(&d, tok, V, bos_id, open, n_frame + 2, n_frame + 2), 0);
    ck_assert(d.truncated);
    expect_ids(&d, want, n_frame + 2);
    free(d.tokens);
    /* a corpus folder with the frame set gives the same ids */
    char cdir[4200], path[4300];
    snprintf(cdir, sizeof cdir, "%s/corpus", dir);
    ck_assert_int_eq(mkdir(cdir, 0755), 0);
    snprintf(path, sizeof path, "%s/fox.txt", cdir);
    ck_assert_int_eq(kvm_test_write_file(path, text, strlen(text)), 0);
    kvm_corpus *c = NULL;
    ck_assert_int_eq(kvm_corpus_read(cdir, &c), 0);
    c->frame = open;
    ck_assert_msg(kvm_corpus_load(c, &c->docs[0], tok, V, bos_id, 4096, 4096) == 0, "%s", kvm_errmsg());
    expect_ids(&c->docs[0], want, n_want);
    ck_assert_int_eq(memcmp(&c->docs[0].hash, &h_framed, sizeof h_framed), 0);
    kvm_corpus_free(&c);
    /* given tokens: [BOS] + frame ids + the tokens without their BOS */
    int32_t given[] = {bos_id, 300, 301, 302};
    d = (kvm_doc){.name = "ids"};
    d.tokens = malloc(sizeof given);
    memcpy(d.tokens, given, sizeof given);
    d.n_tokens = 4;
    ck_assert_msg(kvm_doc_prepare_n(&d, tok, V, bos_id, open, 4096, 4096) == 0, "%s", kvm_errmsg());
    ck_assert_int_eq(d.n_tokens, n_frame + 3);
    for (int64_t i = 0; i < n_frame; i++)
        ck_assert_int_eq(d.tokens[i], frame_ids[i]);
    ck_assert_int_eq(d.tokens[n_frame], 300);
    ck_assert_int_eq(d.tokens[n_frame + 2], 302);
    free(d.tokens);
    /* empty documents: text and tokens */
    d = (kvm_doc){.name = "empty", .text = (char *)"", .text_len = 0};
    ck_assert_int_eq(kvm_doc_prepare_n(&d, tok, V, bos_id, open, 4096, 4096), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "document empty is empty"), "%s", kvm_errmsg());
    free(d.tokens);
    d = (kvm_doc){.name = "bos-only"};
    d.tokens = malloc(sizeof(int32_t));
    d.tokens[0] = bos_id;
    d.n_tokens = 1;
    ck_assert_int_eq(kvm_doc_prepare_n(&d, tok, V, bos_id, open, 4096, 4096), KVM_EINVAL);
    ck_assert_msg(strstr(kvm_errmsg(), "is empty"), "%s", kvm_errmsg());
    free(d.tokens);
    /* chat = false: no frame */
    kvm_config_free(&cfg);
    free(open);
    free(close);
    cfg = parse("chat = false");
    ck_assert_int_eq(kvm_chatcfg_frame(cfg, tok, &open, &close), 0);
    ck_assert_ptr_null(open);
    ck_assert_ptr_null(close);
    kvm_config_free(&cfg);
    free(want);
    free(frame_ids);
    free(plain);
    kvm_tokenizer_close(&tok);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static int run_cmd(const char *cmd, char **out, char **err)
{
    *out = *err = NULL;
    return kvm_test_run(cmd, out, err);
}

/* A context the chat frame fills alone: every document was cut to the frame's ids, so all had
 * one hash and one cache holding none of their text (SmolLM2's default system turn takes 24
 * tokens). kvm_chatcfg_frame refuses it, naming the context and the frame's length; one token
 * more is enough. `kvmill eval --chat` refuses such a --context as well. */
START_TEST(test_context_filled_by_frame)
{
    char *dir;
    kvm_tokenizer *tok = llama3_tokenizer(&dir);
    char *open = NULL, *close = NULL;
    int32_t *ids = NULL;
    int64_t n = 0;
    kvm_config *cfg = parse("chat = true\nsystem = Answer from the document.");
    ck_assert_int_eq(kvm_chatcfg_frame(cfg, tok, &open, &close), 0);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, open, strlen(open), kvm_tokenizer_add_bos(tok), 0, &ids, &n), 0);
    free(ids);
    free(open);
    free(close);
    kvm_config_free(&cfg);
    char extra[256];
    for (int64_t ctx = n - 1; ctx <= n + 1; ctx++) {
        snprintf(extra, sizeof extra, "chat = true\nsystem = Answer from the document.\ncontext = %lld",
                 (long long)ctx);
        cfg = parse(extra);
        int rc = kvm_chatcfg_frame(cfg, tok, &open, &close);
        if (ctx <= n) {
            char want[256];
            snprintf(want, sizeof want,
                     "test.ini: [model] context = %lld leaves no token for the document: the chat frame "
                     "(the system turn and the user turn's opening) takes %lld tokens",
                     (long long)ctx, (long long)n);
            ck_assert_msg(rc == KVM_EINVAL && strstr(kvm_errmsg(), want) && !open && !close, "%d: %s", rc,
                          kvm_errmsg());
        } else
            ck_assert_msg(rc == 0 && open && close, "%s", kvm_errmsg());
        free(open);
        free(close);
        kvm_config_free(&cfg);
    }
    kvm_tokenizer_close(&tok);
    kvm_test_rmtree(dir);
    free(dir);
    /* kvmill eval --chat: its context is the cached prefix too (SmolLM2: the frame alone) */
    if (access(SMOL, R_OK)) {
        printf("SKIP: %s absent (run scripts/get-model.sh): eval --chat with a context the frame fills not checked\n",
               SMOL);
        return;
    }
    char cmd[8192], *out, *err;
    snprintf(cmd, sizeof cmd,
             "%s/kvmill eval --model %s --docs %s --chat --context 10 --continuation 8 --method h2o "
             "--budget 4",
             kvm_test_bin(), SMOL, kvm_test_data_path("corpus/doc_000.txt"));
    int st = kvm_test_run(cmd, &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "kvmill eval: --chat: --context 10 leaves no token for the document"),
                  "exit %d, stderr: %s", st, err);
    ck_assert_str_eq(out, "");
    free(out);
    free(err);
}
END_TEST

/* stories260K (a llama2.c tokenizer) has no chat template: `kvmill run` and `kvmill serve` with
 * chat = true and `kvmill eval --chat` refuse it by name before any work (exit 2); `system`
 * without chat is refused. */
START_TEST(test_refused_without_template)
{
    char *dir = kvm_test_tmpdir(), cfgp[4200], cmd[8192], *out, *err;
    snprintf(cfgp, sizeof cfgp, "%s/chat.ini", dir);
    const char *extra[] = {"chat = true", "system = hi"};
    const char *want[] = {"[model] chat = true: the model's tokenizer has no chat template",
                          "[model] system is set but chat = false"};
    for (int i = 0; i < 2; i++) {
        char text[2048];
        snprintf(text, sizeof text,
                 "[model]\npath = %s\ncontext = 128\n%s\n[compress]\nmethod = h2o\nbudget = 32\n"
                 "[store]\npath = %s/store\n[stages]\nbin_dir = %s\n",
                 kvm_test_data_path("models/stories260K.bin"), extra[i], dir, kvm_test_bin());
        ck_assert_int_eq(kvm_test_write_file(cfgp, text, strlen(text)), 0);
        snprintf(cmd, sizeof cmd, "%s/kvmill run --config %s --corpus %s", kvm_test_bin(), cfgp,
                 kvm_test_data_path("corpus"));
        int st = run_cmd(cmd, &out, &err);
        ck_assert_msg(st == 2 && strstr(err, want[i]) && strstr(err, cfgp), "exit %d, stderr: %s", st, err);
        free(out);
        free(err);
        /* serve refuses it before starting decode workers, naming the user's file (not its
         * resolved copy), even when it would make a new store */
        snprintf(cmd, sizeof cmd, "%s/kvmill serve --config %s --compute-missing --bind ipc://%s/front", kvm_test_bin(),
                 cfgp, dir);
        st = run_cmd(cmd, &out, &err);
        ck_assert_msg(st == 2 && strstr(err, want[i]) && strstr(err, cfgp) && !strstr(err, "decode worker"),
                      "serve: exit %d, stderr: %s", st, err);
        free(out);
        free(err);
    }
    snprintf(cmd, sizeof cmd, "%s/kvmill eval --model %s --docs %s --method h2o --budget 32 --chat", kvm_test_bin(),
             kvm_test_data_path("models/stories260K.bin"), kvm_test_data_path("corpus/doc_000.txt"));
    int st = run_cmd(cmd, &out, &err);
    ck_assert_msg(st == 2 && strstr(err, "--chat: the model's tokenizer has no chat template"), "exit %d, stderr: %s",
                  st, err);
    free(out);
    free(err);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

/* Starts `kvmill serve --config cfg --bind front` with its output in log; waits up to 120 s
 * for "ready" (SmolLM2 loads in each worker). Returns the pid. */
static pid_t start_serve(const char *cfg, const char *front, const char *log)
{
    const char *args[] = {"--config", cfg, "--bind", front, NULL};
    pid_t pid = 0;
    ck_assert_msg(kvm_test_serve_start(args, log, 120, &pid) == -1, "kvmill serve exited before ready");
    return pid;
}

static void trim(char *s)
{
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == ' '))
        s[--n] = '\0';
}

/* SmolLM2 (ChatML): `kvmill run` with chat = true stores the cache under the hash of the ids
 * of frame + document; `kvmill ask` through `kvmill serve` answers exactly as `kvmill generate
 * --chat` does for the whole turn (document and question as the user's content), so the worker
 * appended the question, the end of the turn and the assistant marker. */
START_TEST(test_smollm2_run_serve)
{
#if defined(__SANITIZE_ADDRESS__)
    printf("SKIP: SmolLM2 run/serve not checked under the sanitizers (slow there; the plain build runs it)\n");
    return;
#endif
    if (access(SMOL, R_OK)) {
        printf("SKIP: %s absent (run scripts/get-model.sh): chat run/serve on SmolLM2 not checked\n", SMOL);
        return;
    }
    static const char doc[] = "Tom is a small gray cat. He lives in a red house by the river with his best friend, "
                              "a brown dog named Max. Every morning they walk to the bridge together.";
    static const char question[] = "\n\nWhat is the name of the dog?"; /* newlines pass inside sh quotes */
    char *dir = kvm_test_tmpdir(), cfgp[4200], cdir[4200], path[4300], cmd[16384], *out, *err;
    snprintf(cdir, sizeof cdir, "%s/corpus", dir);
    ck_assert_int_eq(mkdir(cdir, 0755), 0);
    snprintf(path, sizeof path, "%s/tom.txt", cdir);
    ck_assert_int_eq(kvm_test_write_file(path, doc, strlen(doc)), 0);
    char text[4096];
    snprintf(text, sizeof text,
             "[model]\npath = %s\ncontext = 256\nchat = true\n[compress]\nmethod = full\n"
             "[store]\npath = %s/store\nmap_size_mb = 16\n[stages]\nbin_dir = %s\nthreads = 2\n"
             "[run]\nrun_dir = %s/run\n[serve]\nrequest_timeout_s = 120\n",
             SMOL, dir, kvm_test_bin(), dir);
    snprintf(cfgp, sizeof cfgp, "%s/smol.ini", dir);
    ck_assert_int_eq(kvm_test_write_file(cfgp, text, strlen(text)), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill run --config %s --corpus %s", kvm_test_bin(), cfgp, cdir);
    int st = run_cmd(cmd, &out, &err);
    ck_assert_msg(st == 0 && strstr(out, "compressed=1"), "exit %d, stdout %s, stderr: %s", st, out, err);
    free(out);
    free(err);
    /* the stored document is frame + document */
    kvm_tokenizer *tok = NULL;
    ck_assert_int_eq(kvm_tokenizer_open_gguf(SMOL, &tok), 0);
    char *open = NULL, *close = NULL, whole[4096];
    ck_assert_int_eq(kvm_chat_frame(tok, NULL, &open, &close), 0);
    ck_assert_ptr_nonnull(strstr(open, "<|im_start|>user\n"));
    snprintf(whole, sizeof whole, "%s%s", open, doc);
    int32_t *ids = NULL, *q = NULL;
    int64_t n = 0, nq = 0;
    ck_assert_int_eq(kvm_tokenizer_encode(tok, whole, strlen(whole), kvm_tokenizer_add_bos(tok), 0, &ids, &n), 0);
    snprintf(whole, sizeof whole, "%s%s", question, close);
    ck_assert_int_eq(kvm_tokenizer_encode(tok, whole, strlen(whole), 0, 0, &q, &nq), 0);
    kvm_store_id h;
    char hex[KVM_STORE_ID_HEX + 1], row[256];
    ck_assert_int_eq(kvm_store_doc_hash(ids, n, &h), 0);
    snprintf(cmd, sizeof cmd, "%s/kvmill store ls --store %s/store --csv", kvm_test_bin(), dir);
    st = run_cmd(cmd, &out, &err);
    ck_assert_int_eq(st, 0);
    snprintf(row, sizeof row, ",%s,", kvm_store_id_hex(&h, hex));
    char *at = strstr(out, row);
    ck_assert_msg(at != NULL, "no cache for the framed ids' hash %s in:\n%s", hex, out);
    char tokens_col[64];
    snprintf(tokens_col, sizeof tokens_col, ",%lld,", (long long)n);
    ck_assert_msg(strstr(at + strlen(row) + KVM_STORE_ID_HEX, tokens_col) == at + strlen(row) + KVM_STORE_ID_HEX,
                  "tokens column is not %lld: %s", (long long)n, at);
    free(out);
    free(err);
    /* serve: the answer equals generate --chat on the whole turn */
    char front[4300], log[4300];
    snprintf(front, sizeof front, "ipc://%s/front", dir);
    snprintf(log, sizeof log, "%s/serve.log", dir);
    pid_t srv = start_serve(cfgp, front, log);
    snprintf(cmd, sizeof cmd, "%s/kvmill ask --connect %s --doc %s --prompt '%s' -n 24 --timeout 120", kvm_test_bin(),
             front, path, question);
    st = run_cmd(cmd, &out, &err);
    kill(srv, SIGTERM);
    waitpid(srv, NULL, 0);
    ck_assert_msg(st == 0, "ask: exit %d, stderr %s", st, err);
    char *answer = out;
    free(err);
    snprintf(cmd, sizeof cmd, "%s/kvmill generate --model %s --chat --prompt '%s%s' -n %lld --temperature 0",
             kvm_test_bin(), SMOL, doc, question, (long long)(n + nq + 24));
    st = run_cmd(cmd, &out, &err);
    ck_assert_msg(st == 0, "generate: exit %d, stderr %s", st, err);
    trim(answer);
    trim(out);
    printf("SmolLM2 chat answer: %s\n", answer);
    /* generate's -n counts positions and may run one token further: the answer is its prefix */
    ck_assert_msg(strlen(answer) > 10 && !strncmp(answer, out, strlen(answer)),
                  "ask answered '%s', generate --chat '%s'", answer, out);
    free(answer);
    free(out);
    free(err);
    free(ids);
    free(q);
    free(open);
    free(close);
    kvm_tokenizer_close(&tok);
    kvm_test_rmtree(dir);
    free(dir);
}
END_TEST

static Suite *chat_suite(void)
{
    Suite *s = suite_create("chat");
    struct {
        const char *name;
        const TTest *fn;
        int timeout_s;
    } cases[] = {{"config_id", test_config_id, 30},
                 {"framed_documents", test_framed_documents, 30},
                 {"repeat_prompt_in_the_turn", test_repeat_prompt_in_the_turn, 30},
                 {"context_filled_by_frame", test_context_filled_by_frame, 30},
                 {"refused_without_template", test_refused_without_template, 60},
                 {"smollm2_run_serve", test_smollm2_run_serve, 600}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        TCase *tc = tcase_create(cases[i].name);
        tcase_set_timeout(tc, cases[i].timeout_s);
        tcase_add_test(tc, cases[i].fn);
        suite_add_tcase(s, tc);
    }
    return s;
}

int main(void) { return kvm_test_run_suite(chat_suite()); }
