/* cmd_eval_task.c: `kvmill eval --task passkey|recall|multikey`: does the compressed cache
 * still answer questions about the document? (issue 14, item 3). The cached context is the
 * framed document (chat: the template up to the user's content, then the document); the
 * question, the end of the turn and the assistant marker are appended at ask time, as a
 * decode worker would, and the greedy answer is scored by exact match (compress/eval/kvm_task.h). */
#include "common/kvm_error.h"
#include "model/kvm_chat.h"
#include "model/kvm_model_window.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
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

/* a then b[0, lb), encoded: lb, not strlen, since a document's NUL bytes are text here as in
 * the KL evaluation (a case's fact after one was cut off with the rest of the document) */
static int encode(const kvm_tokenizer *tok, const char *a, const char *b, size_t lb, int bos, int32_t **ids, int64_t *n)
{
    size_t la = strlen(a);
    char *s = malloc(la + lb + 1);
    if (!s) return kvm_err(KVM_ENOMEM, "out of memory");
    memcpy(s, a, la);
    memcpy(s + la, b, lb);
    s[la + lb] = '\0';
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
    /* 64, not 12: where the fact (and the frame) take most of --context the proportional cut
     * below converges slowly (by 0.84 a step at 30 tokens, recall), and after 12 tries a context
     * that holds a few of the document's tokens was refused as "the document does not fit" */
    for (int attempt = 0; attempt < 64; attempt++) {
        kvm_task_case_deinit(tc);
        free(ctx);
        ctx = NULL;
        if (use == 0) { /* the fact (and the frame) alone take the context: not an empty document */
            rc = kvm_err(KVM_EINVAL, /* the caller names the case: "task case N (DOC): " */
                         "--context %lld leaves no room for the document beside the fact inserted (and the chat "
                         "frame): raise --context",
                         (long long)a->n_ctx);
            break;
        }
        if ((rc = kvm_task_make(a->kind, text, use, index, tc))) break;
        if ((rc = encode(a->tok, fr->open, tc->document, tc->document_len, bos, &ctx, &nc))) break;
        if (nc <= a->n_ctx) break;
        size_t next = (size_t)((double)use * (double)a->n_ctx / (double)nc * 0.99);
        use = next < use ? next : use - 1;
        rc = kvm_err(KVM_EINVAL,
                     "--context %lld: no prefix of the document fits beside the fact inserted (and the "
                     "chat frame): raise --context",
                     (long long)a->n_ctx);
    }
    char qbuf[256];
    snprintf(qbuf, sizeof qbuf, "\n\n%s", tc->question);
    if (!rc) rc = encode(a->tok, qbuf, fr->close, strlen(fr->close), 0, &q, &nq);
    if (!rc && nc + nq + a->answer_tokens > kvm_model_window(&a->m->cfg))
        rc = kvm_err(KVM_EINVAL,
                     "context %lld + question %lld + --answer-tokens %d exceed the model's window of %d tokens: use a "
                     "shorter --context",
                     (long long)nc, (long long)nq, a->answer_tokens, kvm_model_window(&a->m->cfg));
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
    int32_t *ids = NULL;
    int64_t n = 0;
    int rc = encode(a->tok, fr->open, text, len, kvm_tokenizer_add_bos(a->tok), &ids, &n);
    if (!rc) rc = kvm_eval_prefix_new(a->m, a->k, ids, n < a->n_ctx ? n : a->n_ctx, out);
    free(ids);
    return rc;
}

/* The answer's text, its pieces joined, malloc'ed whole (a fixed 512 bytes cut answers of a few
 * hundred tokens: the match and the CSV saw only their start); *len its length. NULL: no memory. */
static char *answer_text(const kvm_tokenizer *tok, const int32_t *t, int n, size_t *len)
{
    size_t total = 0, pl;
    for (int i = 0; i < n; i++)
        if (kvm_tokenizer_piece(tok, i ? t[i - 1] : -1, t[i], &pl)) total += pl;
    char *buf = malloc(total + 1);
    size_t w = 0;
    for (int i = 0; buf && i < n; i++) {
        const char *p = kvm_tokenizer_piece(tok, i ? t[i - 1] : -1, t[i], &pl);
        if (!p) continue;
        memcpy(buf + w, p, pl);
        w += pl;
    }
    if (buf) buf[w] = '\0';
    *len = w;
    return buf;
}

/* A case's answers: [0] full KV's, then each job's. */
typedef struct case_answers {
    int32_t *tok;   /* [jobs + 1][max_new] */
    int *len;       /* [jobs + 1] */
    int *ok;        /* [jobs + 1] 1: exact match */
    double *budget; /* [jobs + 1] entries per KV head of the cache answered over */
    double *nll;    /* [jobs + 1] full KV's answer's mean NLL over each cache (NAN: none) */
    char **text;    /* [jobs + 1] the answers' text (malloc'ed; CSV-safe: no newline, quote or comma) */
    size_t n;       /* jobs + 1 */
    int64_t tokens, calls; /* answered tokens and forward calls after the questions, all cases */
} case_answers;

/* Jobs whose caches are answered over together: one batched call per decode step for all of
 * them (their compressed caches live at once), at most TASK_GROUP and as many as keep the first
 * call's logits (answer tokens + 1 rows of the vocabulary per cache) within TASK_LOGITS bytes. */
enum { TASK_GROUP = 32 };
#define TASK_LOGITS (256.0 * 1024 * 1024)

static int group_size(const cmd_eval_task_args *a)
{
    double per = (double)(a->answer_tokens + 1) * a->m->cfg.vocab_size * sizeof(float);
    int g = (int)(TASK_LOGITS / per) - 1; /* one slot for full KV's copy in the first group */
    return g < 1 ? 1 : g > TASK_GROUP ? TASK_GROUP : g;
}

/* kvm_eval_answers_opts.done: an answer is complete once the expected one is in it, closed. */
typedef struct done_ctx {
    const cmd_eval_task_args *a;
    const kvm_task_case *tc;
} done_ctx;

static int answer_done(void *user, int i, const int32_t *out, int n)
{
    (void)i;
    const done_ctx *dc = user;
    size_t len;
    char *buf = answer_text(dc->a->tok, out, n, &len);
    int done = buf && kvm_task_answered(dc->tc->answer, buf, len); /* no memory: not done, decoded on */
    free(buf);
    return done;
}

/* Answer slot r's text (one CSV field, one line), its match and the budget (entries per KV
 * head) of the cache it answered over. */
static int score(const cmd_eval_task_args *a, const kvm_task_case *tc, case_answers *ca, int r, double budget)
{
    size_t len;
    char *text = answer_text(a->tok, ca->tok + (size_t)r * a->answer_tokens, ca->len[r], &len);
    if (!text) return kvm_err(KVM_ENOMEM, "out of memory");
    free(ca->text[r]);
    ca->text[r] = text;
    ca->ok[r] = kvm_task_match(tc->answer, text, len);
    ca->budget[r] = budget;
    for (size_t i = 0; i < len; i++)
        if (text[i] == '\n' || text[i] == '\r' || text[i] == '"' || text[i] == ',' || !text[i]) text[i] = ' ';
    ca->tokens += ca->len[r];
    return 0;
}

/* Jobs [j0, j1): each compresses (and round-trips) the context, then all answer in one batch
 * with full KV's answer as the reference (and full KV again first in the batch of j0 = 0, for
 * its own NLL). The caches are this batch's to spend (kvm_eval_answers appends to them). */
static int answer_group(const cmd_eval_task_args *a, kvm_eval_doc *d, const kvm_task_case *tc,
                        const cmd_eval_task_job *jobs, int j0, int j1, case_answers *ca)
{
    const int with_full = j0 == 0, n = j1 - j0 + with_full;
    kvm_kvcache *cc[TASK_GROUP + 1] = {0};
    double budget[TASK_GROUP + 1];
    int rc = with_full ? kvm_kvcache_clone(kvm_eval_doc_full(d), &cc[0]) : 0;
    for (int j = j0; !rc && j < j1; j++) {
        kvm_kvcache **c = &cc[j - j0 + with_full], *served = NULL;
        int64_t bytes;
        rc = jobs[j].m->compress(kvm_eval_doc_input(d), jobs[j].opts, c);
        if (!rc && *c && a->roundtrip) rc = a->roundtrip(a->user, *c, kvm_eval_doc_full(d)->next_pos, &served, &bytes);
        if (served) {
            kvm_kvcache_free(c);
            *c = served;
        }
        if (!rc && !*c) rc = kvm_kvcache_clone(kvm_eval_doc_full(d), c); /* a method that keeps it all */
    }
    const kvm_model_config *m = &a->m->cfg;
    for (int i = 0; !rc && i < n; i++) /* before the answers are appended */
        budget[i] = (double)kvm_kvcache_entries(cc[i]) / ((double)m->n_layers * m->n_kv_heads);
    done_ctx dc = {a, tc};
    kvm_eval_answers_opts ao = {
        .done = answer_done, .user = &dc, .ref = ca->len[0] ? ca->tok : NULL, .n_ref = ca->len[0]};
    const int r0 = 1 + j0 - with_full; /* answer slot of cc[0] */
    int32_t *tok = malloc((size_t)n * a->answer_tokens * sizeof *tok);
    int *len = malloc((size_t)n * sizeof *len), calls = 0;
    if (!rc && (!tok || !len)) rc = kvm_err(KVM_ENOMEM, "out of memory");
    if (!rc) rc = kvm_eval_answers(d, cc, n, a->answer_tokens, &ao, tok, len, ca->nll + r0, &calls);
    for (int i = with_full; !rc && i < n; i++) { /* full KV's own answer is the first call's */
        memcpy(ca->tok + (size_t)(r0 + i) * a->answer_tokens, tok + (size_t)i * a->answer_tokens,
               (size_t)a->answer_tokens * sizeof *tok);
        ca->len[r0 + i] = len[i];
        rc = score(a, tc, ca, r0 + i, budget[i]);
    }
    ca->calls += calls;
    for (int i = 0; i < n; i++)
        kvm_kvcache_free(&cc[i]);
    free(tok);
    free(len);
    return rc;
}

/* Full KV's answer to the case, then every job's in groups (group_size). */
static int answer_case(const cmd_eval_task_args *a, kvm_eval_doc *d, const kvm_task_case *tc,
                       const cmd_eval_task_job *jobs, int n_jobs, case_answers *ca)
{
    done_ctx dc = {a, tc};
    kvm_eval_answers_opts ao = {.done = answer_done, .user = &dc};
    kvm_kvcache *full = NULL;
    int calls = 0, rc = kvm_kvcache_clone(kvm_eval_doc_full(d), &full);
    if (!rc) rc = kvm_eval_answers(d, &full, 1, a->answer_tokens, &ao, ca->tok, &ca->len[0], NULL, &calls);
    kvm_kvcache_free(&full);
    ca->calls += calls;
    ca->nll[0] = NAN;
    const kvm_model_config *m = &a->m->cfg;
    const double per_head = (double)m->n_layers * m->n_kv_heads;
    if (!rc) rc = score(a, tc, ca, 0, (double)kvm_kvcache_entries(kvm_eval_doc_full(d)) / per_head);
    const int g = group_size(a);
    for (int j0 = 0; !rc && (j0 < n_jobs || j0 == 0); j0 += g) /* no jobs: full KV's NLL alone */
        rc = answer_group(a, d, tc, jobs, j0, j0 + g < n_jobs ? j0 + g : n_jobs, ca);
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

/* A case's CSV row for answer slot r (0: full KV). */
static void csv_row(const cmd_eval_task_args *a, int i, const char *doc, const kvm_task_case *tc, int64_t nc,
                    const char *spec, const case_answers *ca, int r)
{
    fprintf(a->csv, "%d,%s,", i, kvm_task_name(a->kind));
    kvm_cli_csv_field(a->csv, doc); /* a file name may hold a comma or a quote */
    fprintf(a->csv, ",%.4f,%lld,%s,%.2f,%d,%s,\"%s\",", tc->depth, (long long)nc, spec, ca->budget[r], ca->ok[r],
            tc->answer, ca->text[r]);
    csv_nll(a->csv, ca->nll[r]);
}

static void case_answers_free(case_answers *ca)
{
    free(ca->tok);
    free(ca->len);
    free(ca->ok);
    free(ca->budget);
    free(ca->nll);
    for (size_t i = 0; ca->text && i < ca->n; i++)
        free(ca->text[i]);
    free(ca->text);
}

static int case_answers_new(int n_jobs, int answer_tokens, case_answers *ca)
{
    const size_t n = (size_t)n_jobs + 1;
    *ca = (case_answers){.tok = malloc(n * (size_t)answer_tokens * sizeof *ca->tok),
                         .len = calloc(n, sizeof *ca->len),
                         .ok = calloc(n, sizeof *ca->ok),
                         .budget = calloc(n, sizeof *ca->budget),
                         .nll = calloc(n, sizeof *ca->nll),
                         .text = calloc(n, sizeof *ca->text),
                         .n = n};
    if (ca->tok && ca->len && ca->ok && ca->budget && ca->nll && ca->text) return 0;
    case_answers_free(ca);
    return kvm_err(KVM_ENOMEM, "out of memory");
}

/* The case's line (full KV, then each job: 1 = right), its CSV rows and the counts. */
static void print_case(const cmd_eval_task_args *a, int i, const char *doc, const kvm_task_case *tc, int64_t nc,
                       const cmd_eval_task_job *jobs, int n_jobs, const case_answers *ca, int64_t *right, int64_t *lost,
                       int64_t *gained)
{
    const int ok = ca->ok[0];
    right[n_jobs] += ok;
    printf("case %4d %-10s depth %.2f context %5lld  answer %-12s  full %d", i, doc, tc->depth, (long long)nc,
           tc->answer, ok);
    if (a->csv) csv_row(a, i, doc, tc, nc, "full", ca, 0);
    for (int j = 0; j < n_jobs; j++) {
        const int okj = ca->ok[j + 1];
        right[j] += okj;
        lost[j] += ok && !okj;
        gained[j] += !ok && okj;
        printf(" %d", okj);
        if (a->csv) csv_row(a, i, doc, tc, nc, jobs[j].spec, ca, j + 1);
    }
}

static void summary(const char *name, int64_t right, int64_t n, int64_t b, int64_t c, int64_t full_right, int is_full)
{
    double lo, hi;
    kvm_task_wilson(right, n, &lo, &hi);
    printf("%-28s %5lld/%-5lld %7.3f [%5.3f, %5.3f]", name, (long long)right, (long long)n, (double)right / n, lo, hi);
    if (is_full)
        printf("\n");
    else if (full_right) /* full KV right on none: no share of its accuracy to give */
        printf("  vs full: %.3f of its accuracy, lost %lld, gained %lld, McNemar p = %.3g\n",
               (double)right / full_right, (long long)b, (long long)c, kvm_task_mcnemar_p(b, c));
    else
        printf("  vs full: n/a (full KV answered none), lost %lld, gained %lld, McNemar p = %.3g\n", (long long)b,
               (long long)c, kvm_task_mcnemar_p(b, c));
}

/* The task's framing (chat or plain) into *fr (free fr->open and fr->close). Returns 0 or an
 * error, said on stderr for --chat. */
static int frame_new(const cmd_eval_task_args *a, frame *fr)
{
    *fr = (frame){NULL, NULL};
    int rc = a->chat ? kvm_chat_frame(a->tok, a->system, &fr->open, &fr->close) : 0;
    if (rc) fprintf(stderr, "kvmill " CMD ": --chat: %s\n", kvm_errmsg());
    if (!rc && !a->chat) {
        fr->open = strdup("");
        fr->close = strdup("\nAnswer:");
        if (!fr->open || !fr->close) rc = kvm_err(KVM_ENOMEM, "out of memory");
    }
    return rc;
}

int cmd_eval_task_extent(const cmd_eval_task_args *a, const cmd_eval_docset *docs, int64_t *n_ctx, int *case_index,
                         int *doc_index, int64_t *n_longest)
{
    frame fr;
    int rc = frame_new(a, &fr);
    *n_ctx = INT64_MAX, *case_index = -1, *doc_index = -1, *n_longest = 0;
    for (int i = a->first_case; !rc && i < a->first_case + a->cases; i++) {
        int di = (i / KVM_TASK_DEPTHS) % docs->n;
        char *text = NULL;
        size_t len = 0;
        kvm_task_case tc = {0};
        int32_t *ids = NULL;
        int64_t nc = 0, nq = 0;
        rc = read_text(docs->paths[di], &text, &len);
        if (!rc) rc = make_case(a, &fr, text, len, (uint64_t)i, &tc, &ids, &nc, &nq);
        if (rc) fprintf(stderr, "kvmill " CMD ": task case %d (%s): %s\n", i, docs->names[di], kvm_errmsg());
        if (!rc && nc < *n_ctx) *n_ctx = nc, *case_index = i, *doc_index = di;
        if (!rc && nc > *n_longest) *n_longest = nc;
        free(ids);
        kvm_task_case_deinit(&tc);
        free(text);
    }
    free(fr.open);
    free(fr.close);
    return rc == KVM_EINVAL ? 2 : rc ? 1 : 0;
}

int cmd_eval_task_run(const cmd_eval_task_args *a, const cmd_eval_docset *docs, const cmd_eval_task_job *jobs,
                      int n_jobs)
{
    frame fr;
    int rc = frame_new(a, &fr);
    int32_t *rp = NULL; /* the repeat prompt (query_source repeat), in the chat turn with --chat */
    int64_t n_rp = 0;
    if (!rc) rc = kvm_sculpt_repeat_prompt(a->tok, a->chat, &rp, &n_rp);
    /* + 1: n_jobs may be 0 (--method full only: the baseline alone), and calloc(0) may be NULL */
    int64_t *right = calloc((size_t)n_jobs + 1, sizeof *right), *lost = calloc((size_t)n_jobs + 1, sizeof *lost),
            *gained = calloc((size_t)n_jobs + 1, sizeof *gained);
    if (!rc && (!right || !lost || !gained)) rc = kvm_err(KVM_ENOMEM, "out of memory");
    if (a->csv)
        fprintf(a->csv, "case,task,doc,depth,context,method,budget_tokens,correct,answer,generated,answer_nll\n");
    printf("== task %s: %d cases, context <= %lld tokens%s; columns: full KV, then each method (1 = right)\n",
           kvm_task_name(a->kind), a->cases, (long long)a->n_ctx, a->chat ? ", chat framing" : "");
    case_answers ca = {0};
    if (!rc) rc = case_answers_new(n_jobs, a->answer_tokens, &ca);
    int done = 0, pre_doc = -1;
    kvm_eval_prefix *pre = NULL;
    int64_t ctx_tokens = 0, reused_tokens = 0;
    for (int i = a->first_case; !rc && i < a->first_case + a->cases; i++) {
        int di = (i / KVM_TASK_DEPTHS) % docs->n;
        char *text = NULL;
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
        if (!rc) rc = answer_case(a, d, &tc, jobs, n_jobs, &ca);
        if (!rc) print_case(a, i, docs->names[di], &tc, nc, jobs, n_jobs, &ca, right, lost, gained);
        if (!rc) {
            printf("\n");
            kvm_cli_flush_stdout(); /* a failure's errno kept for main's message */
            if (a->csv) fflush(a->csv);
            done++;
        } else
            fprintf(stderr, "kvmill " CMD ": task case %d (%s): %s\n", i, docs->names[di], kvm_errmsg());
        kvm_eval_doc_free(&d);
        free(ids);
        kvm_task_case_deinit(&tc);
        free(text);
    }
    if (!rc && done) {
        printf("== accuracy over %d cases, exact match, Wilson 95%% interval\n", done);
        summary("full", right[n_jobs], done, 0, 0, right[n_jobs], 1);
        for (int j = 0; j < n_jobs; j++) {
            char name[6144 + 64]; /* the method (cmd_eval_job.spec) and its budget: a row per budget */
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
            done, (long long)ctx_tokens, (long long)reused_tokens, (long long)ca.tokens, (long long)ca.calls);
    kvm_eval_prefix_free(&pre);
    case_answers_free(&ca);
    free(right);
    free(lost);
    free(gained);
    free(rp);
    free(fr.open);
    free(fr.close);
    return rc == KVM_EINVAL ? 2 : rc ? 1 : 0; /* EINVAL: a context or document the task cannot use (usage) */
}
