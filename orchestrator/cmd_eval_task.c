/* cmd_eval_task.c: `kvmill eval --task passkey|recall|multikey`: does the compressed cache
 * still answer questions about the document? (issue 14, item 3). The cached context is the
 * framed document (chat: the template up to the user's content, then the document); the
 * question, the end of the turn and the assistant marker are appended at ask time, as a
 * decode worker would, and the greedy answer is scored by exact match (compress/eval/kvm_task.h). */
#include "common/kvm_error.h"
#include "model/kvm_chat.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CMD "eval"

/* The framing: cached prefix = open + document; asked = "\n\n" + question + close. */
typedef struct frame {
    char *open, *close;
} frame;

static int read_text(const char *path, char **text, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return kvm_err(KVM_EIO, "%s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *t = malloc(cap);
    while (t) {
        n += fread(t + n, 1, cap - n, f);
        if (n < cap) break;
        char *g = realloc(t, cap *= 2);
        if (!g) free(t);
        t = g;
    }
    int err = ferror(f);
    fclose(f);
    if (!t || err) {
        free(t);
        return kvm_err(err ? KVM_EIO : KVM_ENOMEM, "%s: %s", path, err ? "read error" : "out of memory");
    }
    *text = t;
    *len = n;
    return 0;
}

static int encode(const kvm_tokenizer *tok, const char *a, const char *b, int bos, int32_t **ids, int64_t *n)
{
    size_t la = strlen(a), lb = strlen(b);
    char *s = malloc(la + lb + 1);
    if (!s) return kvm_err(KVM_ENOMEM, "out of memory");
    memcpy(s, a, la);
    memcpy(s + la, b, lb + 1);
    int rc = kvm_tokenizer_encode(tok, s, la + lb, bos, 0, ids, n);
    free(s);
    return rc;
}

/* Case `index` over the longest prefix of text whose framed context fits a->n_ctx tokens:
 * *ids = context then question tokens, *n_ctx the context's length, *n_q the question's. */
static int make_case(const cmd_eval_task_args *a, const frame *fr, const char *text, size_t len, uint64_t index,
                     kvm_task_case *tc, int32_t **ids, int64_t *n_ctx, int64_t *n_q)
{
    int32_t *ctx = NULL, *q = NULL;
    int64_t nc = 0, nq = 0;
    size_t use = len;
    int rc = 0, bos = kvm_tokenizer_add_bos(a->tok);
    for (int attempt = 0; attempt < 12; attempt++) {
        kvm_task_case_deinit(tc);
        free(ctx);
        ctx = NULL;
        if (use == 0) { /* the fact (and the frame) alone take the context: not an empty document */
            rc = kvm_err(KVM_EINVAL, "task case %llu: --context %lld leaves no room for the document beside the fact "
                                     "inserted (and the chat frame): raise --context",
                         (unsigned long long)index, (long long)a->n_ctx);
            break;
        }
        if ((rc = kvm_task_make(a->kind, text, use, index, tc))) break;
        if ((rc = encode(a->tok, fr->open, tc->document, bos, &ctx, &nc))) break;
        if (nc <= a->n_ctx) break;
        size_t next = (size_t)((double)use * (double)a->n_ctx / (double)nc * 0.99);
        use = next < use ? next : use - 1;
        rc = kvm_err(KVM_EINVAL, "task case %llu: the document does not fit %lld tokens", (unsigned long long)index,
                     (long long)a->n_ctx);
    }
    char qbuf[256];
    snprintf(qbuf, sizeof qbuf, "\n\n%s", tc->question);
    if (!rc) rc = encode(a->tok, qbuf, fr->close, 0, &q, &nq);
    if (!rc && nc + nq + a->answer_tokens > a->m->cfg.seq_len)
        rc = kvm_err(KVM_EINVAL,
                     "context %lld + question %lld + --answer-tokens %d exceed the model's window of %d tokens: use a "
                     "shorter --context",
                     (long long)nc, (long long)nq, a->answer_tokens, a->m->cfg.seq_len);
    int32_t *all = rc ? NULL : malloc((size_t)(nc + nq) * sizeof *all);
    if (!rc && !all) rc = kvm_err(KVM_ENOMEM, "out of memory");
    if (!rc) {
        memcpy(all, ctx, (size_t)nc * sizeof *all);
        memcpy(all + nc, q, (size_t)nq * sizeof *all);
        *ids = all;
        *n_ctx = nc;
        *n_q = nq;
    }
    free(ctx);
    free(q);
    return rc;
}

/* The framed document itself (no fact), at most a->n_ctx tokens: the prefix its cases share. */
static int document_prefix(const cmd_eval_task_args *a, const frame *fr, const char *text, size_t len,
                           kvm_eval_prefix **out)
{
    char *t = malloc(len + 1);
    if (!t) return kvm_err(KVM_ENOMEM, "out of memory");
    memcpy(t, text, len);
    t[len] = '\0';
    int32_t *ids = NULL;
    int64_t n = 0;
    int rc = encode(a->tok, fr->open, t, kvm_tokenizer_add_bos(a->tok), &ids, &n);
    free(t);
    if (!rc) rc = kvm_eval_prefix_new(a->m, a->k, ids, n < a->n_ctx ? n : a->n_ctx, out);
    free(ids);
    return rc;
}

/* The answer's text (pieces joined), into buf; returns its length. */
static size_t answer_text(const kvm_tokenizer *tok, const int32_t *t, int n, char *buf, size_t cap)
{
    size_t w = 0;
    for (int i = 0; i < n; i++) {
        size_t len;
        const char *p = kvm_tokenizer_piece(tok, i ? t[i - 1] : -1, t[i], &len);
        if (!p || w + len >= cap) break;
        memcpy(buf + w, p, len);
        w += len;
    }
    buf[w] = '\0';
    return w;
}

/* The answers given so far to a case: the drafts of lookup decoding (kvm_eval_answer_opts). */
typedef struct answers {
    int32_t **tok; /* [jobs + 1]: full KV's, then each job's */
    int *len;
    int n;
    int64_t tokens, calls; /* answered tokens and forward calls after the questions, all cases */
} answers;

/* kvm_eval_answer_opts.done: the answer is complete once the expected one is in it, closed. */
typedef struct done_ctx {
    const cmd_eval_task_args *a;
    const kvm_task_case *tc;
} done_ctx;

static int answer_done(void *user, const int32_t *out, int n)
{
    const done_ctx *dc = user;
    char buf[512];
    size_t len = answer_text(dc->a->tok, out, n, buf, sizeof buf);
    return kvm_task_answered(dc->tc->answer, buf, len);
}

/* One method's answer to the case over cache c (m NULL: the full cache); appended to *ans.
 * *nll: the mean NLL of full KV's answer (the first in *ans) over this cache, NAN when full KV
 * answered nothing. */
static int answer(const cmd_eval_task_args *a, kvm_eval_doc *d, const kvm_method *m, const void *opts, int *correct,
                  const kvm_task_case *tc, char *text, size_t cap, double *budget, answers *ans, double *nll)
{
    kvm_kvcache *cc = NULL, *served = NULL;
    int32_t *out = malloc((size_t)a->answer_tokens * sizeof *out);
    int n = 0, calls = 0, rc = out ? 0 : kvm_err(KVM_ENOMEM, "out of memory");
    const kvm_kvcache *use = kvm_eval_doc_full(d);
    int64_t bytes;
    if (!rc && m) rc = m->compress(kvm_eval_doc_input(d), opts, &cc);
    if (!rc && cc && a->roundtrip) rc = a->roundtrip(a->user, cc, kvm_eval_doc_full(d)->next_pos, &served, &bytes);
    if (served) {
        kvm_kvcache_free(&cc);
        cc = served;
    }
    if (cc) use = cc;
    done_ctx dc = {a, tc};
    kvm_eval_answer_opts ao = {.done = answer_done, .user = &dc, .drafts = (const int32_t *const *)ans->tok,
                               .draft_len = ans->len, .n_drafts = ans->n};
    if (!rc) rc = kvm_eval_answer(d, use, a->answer_tokens, &ao, out, &n, &calls);
    if (!rc) {
        size_t len = answer_text(a->tok, out, n, text, cap);
        *correct = kvm_task_match(tc->answer, text, len);
        const kvm_model_config *c = &a->m->cfg;
        *budget = (double)kvm_kvcache_entries(use) / ((double)c->n_layers * c->n_kv_heads);
        for (char *p = text; *p; p++) /* one CSV field, one line */
            if (*p == '\n' || *p == '\r' || *p == '"' || *p == ',') *p = ' ';
        ans->tokens += n;
        ans->calls += calls;
        ans->tok[ans->n] = out;
        ans->len[ans->n++] = n;
        out = NULL;
    }
    *nll = NAN;
    if (!rc && ans->len[0] > 0) rc = kvm_eval_answer_nll(d, use, ans->tok[0], ans->len[0], nll);
    kvm_kvcache_free(&cc);
    free(out);
    return rc;
}

/* The answer_nll field and the end of the row: empty when full KV answered nothing. */
static void csv_nll(FILE *f, double nll)
{
    if (isfinite(nll))
        fprintf(f, "%.4f\n", nll);
    else
        fprintf(f, "\n");
}

/* Forgets a case's answers (keeps the counters). */
static void answers_clear(answers *ans)
{
    for (int i = 0; i < ans->n; i++)
        free(ans->tok[i]);
    ans->n = 0;
}

static void summary(const char *name, int64_t right, int64_t n, int64_t b, int64_t c, int64_t full_right, int is_full)
{
    double lo, hi;
    kvm_task_wilson(right, n, &lo, &hi);
    printf("%-28s %5lld/%-5lld %7.3f [%5.3f, %5.3f]", name, (long long)right, (long long)n, (double)right / n, lo, hi);
    if (is_full)
        printf("\n");
    else
        printf("  vs full: %.3f of its accuracy, lost %lld, gained %lld, McNemar p = %.3g\n",
               full_right ? (double)right / full_right : 0.0, (long long)b, (long long)c, kvm_task_mcnemar_p(b, c));
}

int cmd_eval_task_run(const cmd_eval_task_args *a, const cmd_eval_docset *docs, const cmd_eval_task_job *jobs,
                      int n_jobs)
{
    frame fr = {NULL, NULL};
    int rc = a->chat ? kvm_chat_frame(a->tok, a->system, &fr.open, &fr.close) : 0;
    if (rc) fprintf(stderr, "kvmill " CMD ": --chat: %s\n", kvm_errmsg());
    if (!rc && !a->chat) {
        fr.open = strdup("");
        fr.close = strdup("\nAnswer:");
        if (!fr.open || !fr.close) rc = kvm_err(KVM_ENOMEM, "out of memory");
    }
    int32_t *rp = NULL; /* the repeat prompt (query_source repeat), in the chat turn with --chat */
    int64_t n_rp = 0;
    if (!rc) rc = kvm_sculpt_repeat_prompt(a->tok, a->chat, &rp, &n_rp);
    int64_t *right = calloc((size_t)n_jobs + 1, sizeof *right), *lost = calloc((size_t)n_jobs, sizeof *lost),
            *gained = calloc((size_t)n_jobs, sizeof *gained);
    if (!rc && (!right || !lost || !gained)) rc = kvm_err(KVM_ENOMEM, "out of memory");
    if (a->csv)
        fprintf(a->csv, "case,task,doc,depth,context,method,budget_tokens,correct,answer,generated,answer_nll\n");
    printf("== task %s: %d cases, context <= %lld tokens%s; columns: full KV, then each method (1 = right)\n",
           kvm_task_name(a->kind), a->cases, (long long)a->n_ctx, a->chat ? ", chat framing" : "");
    answers ans = {.tok = calloc((size_t)n_jobs + 1, sizeof *ans.tok), .len = calloc((size_t)n_jobs + 1, sizeof *ans.len)};
    if (!rc && (!ans.tok || !ans.len)) rc = kvm_err(KVM_ENOMEM, "out of memory");
    int done = 0, pre_doc = -1;
    kvm_eval_prefix *pre = NULL;
    int64_t ctx_tokens = 0, reused_tokens = 0;
    for (int i = a->first_case; !rc && i < a->first_case + a->cases; i++) {
        int di = (i / KVM_TASK_DEPTHS) % docs->n;
        char *text = NULL, gen[512];
        size_t len = 0;
        kvm_task_case tc = {0};
        int32_t *ids = NULL;
        int64_t nc = 0, nq = 0;
        kvm_eval_doc *d = NULL;
        rc = read_text(docs->paths[di], &text, &len);
        if (!rc) rc = make_case(a, &fr, text, len, (uint64_t)i, &tc, &ids, &nc, &nq);
        if (!rc && di != pre_doc) { /* the cases of one document share its text before the fact */
            kvm_eval_prefix_free(&pre);
            pre_doc = -1;
            rc = document_prefix(a, &fr, text, len, &pre);
            if (!rc) pre_doc = di;
        }
        int64_t reused = 0;
        if (!rc) rc = kvm_eval_doc_new_after(pre, ids, nc + nq, nc, nq, &reused, &d);
        if (!rc) rc = kvm_eval_doc_set_repeat_prompt(d, rp, n_rp);
        if (!rc) {
            ctx_tokens += nc;
            reused_tokens += reused;
        }
        int ok;
        double budget, nll;
        if (!rc) rc = answer(a, d, NULL, NULL, &ok, &tc, gen, sizeof gen, &budget, &ans, &nll);
        if (!rc) {
            right[n_jobs] += ok;
            printf("case %4d %-10s depth %.2f context %5lld  answer %-12s  full %d", i, docs->names[di], tc.depth,
                   (long long)nc, tc.answer, ok);
            if (a->csv) {
                fprintf(a->csv, "%d,%s,", i, kvm_task_name(a->kind));
                kvm_cli_csv_field(a->csv, docs->names[di]); /* a file name may hold a comma or a quote */
                fprintf(a->csv, ",%.4f,%lld,full,%.2f,%d,%s,\"%s\",", tc.depth, (long long)nc, budget, ok, tc.answer,
                        gen);
                csv_nll(a->csv, nll);
            }
        }
        for (int j = 0; !rc && j < n_jobs; j++) {
            int okj;
            rc = answer(a, d, jobs[j].m, jobs[j].opts, &okj, &tc, gen, sizeof gen, &budget, &ans, &nll);
            if (rc) break;
            right[j] += okj;
            lost[j] += ok && !okj;
            gained[j] += !ok && okj;
            printf(" %d", okj);
            if (a->csv) {
                fprintf(a->csv, "%d,%s,", i, kvm_task_name(a->kind));
                kvm_cli_csv_field(a->csv, docs->names[di]);
                fprintf(a->csv, ",%.4f,%lld,%s,%.2f,%d,%s,\"%s\",", tc.depth, (long long)nc, jobs[j].spec, budget, okj,
                        tc.answer, gen);
                csv_nll(a->csv, nll);
            }
        }
        if (!rc) {
            printf("\n");
            fflush(stdout);
            if (a->csv) fflush(a->csv);
            done++;
        } else
            fprintf(stderr, "kvmill " CMD ": task case %d (%s): %s\n", i, docs->names[di], kvm_errmsg());
        answers_clear(&ans);
        kvm_eval_doc_free(&d);
        free(ids);
        kvm_task_case_deinit(&tc);
        free(text);
    }
    if (!rc && done) {
        printf("== accuracy over %d cases, exact match, Wilson 95%% interval\n", done);
        summary("full", right[n_jobs], done, 0, 0, right[n_jobs], 1);
        for (int j = 0; j < n_jobs; j++) {
            char name[600]; /* the method and its budget: one method at several budgets is several rows */
            if (jobs[j].budget.tokens > 0)
                snprintf(name, sizeof name, "%s @ %lld", jobs[j].spec, (long long)jobs[j].budget.tokens);
            else
                snprintf(name, sizeof name, "%s @ r %g", jobs[j].spec, jobs[j].budget.ratio);
            summary(name, right[j], done, lost[j], gained[j], right[n_jobs], 0);
        }
    }
    fprintf(stderr,
            "kvmill " CMD ": task: %d cases; context %lld tokens, %lld of them taken from their document's prefix; "
            "answers %lld tokens in %lld forward calls after the questions\n",
            done, (long long)ctx_tokens, (long long)reused_tokens, (long long)ans.tokens, (long long)ans.calls);
    kvm_eval_prefix_free(&pre);
    free(ans.tok);
    free(ans.len);
    free(right);
    free(lost);
    free(gained);
    free(rp);
    free(fr.open);
    free(fr.close);
    return rc == KVM_EINVAL ? 2 : rc ? 1 : 0; /* EINVAL: a context or document the task cannot use (usage) */
}
