/* kvm_cli_eval.h: the `kvmill eval` and `kvmill calibrate` commands and the document and
 * budget handling they share (orchestrator/cmd_eval_docs.c). */
#ifndef KVM_CLI_EVAL_H
#define KVM_CLI_EVAL_H

#include "compress/eval/kvm_eval.h"
#include "compress/eval/kvm_task.h"
#include "model/kvm_tokenizer.h"

#include <stdio.h>

int kvm_cmd_eval(int argc, char **argv);
int kvm_cmd_calibrate(int argc, char **argv);

/* A list of documents: paths and display names (file name without ".txt"; where several
 * documents share one, the shortest path suffix that tells each apart: a/doc, b/doc). */
typedef struct cmd_eval_docset {
    int n;        /* documents */
    char **paths; /* [n] malloc'ed */
    char **names; /* [n] malloc'ed */
} cmd_eval_docset;

/* Expands --docs: a folder (its *.txt files, sorted by name), a file, or a comma-separated
 * list of either; a value that names a file or folder whole is taken whole, commas and all
 * (a missing item of a split value is named with the note that the value was read as a list). Prints "kvmill CMD: ..."
 * and returns 2 on a bad value (missing path, no documents, one file twice: same device and inode, e.g. a folder and
 * one of its files; a path that is not a regular file or folder, such as a FIFO: eval and calibrate read each document
 * more than once, and a pipe's second read is empty; a .jsonl file: kvmill run's corpus format, which these
 * commands do not read), 1 when out of memory; 0 on success.
 * Names that would collide are made distinct (see cmd_eval_docset). */
int cmd_eval_docs_list(const char *cmd, const char *spec, cmd_eval_docset *out);
void cmd_eval_docs_free(cmd_eval_docset *d);

/* Reads a document, encodes it with BOS (tok; under a chat frame as cmd_eval_docs_encode),
 * takes N + T tokens and prepares them (kvm_eval_doc_new). n_windows = 1: the first N + T tokens (longer documents are
 * truncated). n_windows > 1: window `window` of n_windows evenly spaced N + T token windows
 * over the document (window 0 at the start, the last at the end), each after the first
 * beginning with BOS in place of its first token. The document's repeat prompt (query_source
 * repeat) is KVzip's instruction (kvm_sculpt_repeat_prompt; in the chat turn when frame is set).
 * Prints "kvmill CMD: ..." and returns 2 when the path does not open (missing, a folder, no
 * permission), 1 on other failures (unreadable, shorter than N + T tokens). */
int cmd_eval_docs_load(const char *cmd, const kvm_model *m, const kvm_kernels *k, const kvm_tokenizer *tok,
                       const char *frame, const char *path, int64_t n_ctx, int64_t n_cont, int window, int n_windows,
                       kvm_eval_doc **out);

/* Checks, before any work (a prefill, or opening an output such as --csv, whose old contents
 * would be lost), that every document of ds has at least n_min tokens among its first n_want
 * (encoded as cmd_eval_docs_encode does, under `frame` when not NULL). `need` says what n_min is
 * for the message, e.g. "context 128 + continuation 16 (--context, --continuation)". Prints
 * "kvmill CMD: --docs PATH: K tokens, fewer than NEED; ..." and returns 2 for a document too
 * short (an input that does not fit the arguments: a usage error, as sculpt --context says it),
 * or "the document is empty" and 2 for a file of 0 bytes,
 * cmd_eval_docs_encode's status for one that does not open or read; 0 when all fit. */
int cmd_eval_docs_check(const char *cmd, const kvm_tokenizer *tok, const char *frame, const cmd_eval_docset *ds,
                        int64_t n_want, int64_t n_min, const char *need);

/* Reads a document and encodes it with BOS first: *ids (caller frees) of *n tokens. With a
 * chat frame (kvm_chat_frame's prefix; NULL: none) the text encoded is frame + document, BOS
 * only when the tokenizer adds one, as `kvmill run` with [model] chat = true frames it
 * (pipeline/kvm_corpus.h). n_want > 0: only the first n_want ids (*n = fewer when the document
 * is shorter), the same as the whole text's first n_want, for reading and tokenising only the
 * text they need (kvm_doctok_encode: a 200 MB document with --context 64 took 4 GB); 0: all.
 * Prints "kvmill CMD: PATH: ..." and returns 2 when PATH does not open or is a directory, 1
 * when it cannot be read or encoded, else 0. */
int cmd_eval_docs_encode(const char *cmd, const kvm_tokenizer *tok, const char *frame, const char *path,
                         int64_t n_want, int32_t **ids, int64_t *n);

/* Keeps each distinct document of ds once: a document whose ids, as the command reads them
 * (cmd_eval_docs_encode under `frame`, its first n_want; 0: all), equal an earlier one's (the
 * same content under two names: a copy, two identical files in a folder) counted twice in the
 * command's means, unsaid. Hashes them as the store hashes documents (kvm_store_doc_hash) and
 * drops each repeat from ds (freeing its path and name), keeping the first in order; one line
 * per repeat on stderr (kvm_docdedup_find): "kvmill CMD: note: PATH has the same content as
 * FIRST; ACTION". ds keeps at least one document when it had one. Returns 0,
 * cmd_eval_docs_encode's status (2: a document that does not open; 1: a read error) after it
 * said why, or 1 after "kvmill CMD: out of memory"; ds is unchanged on failure. */
int cmd_eval_docs_dedup(const char *cmd, const kvm_tokenizer *tok, const char *frame, cmd_eval_docset *ds,
                        int64_t n_want, const char *action);

/* Parses --context / --continuation (defaults 384 / 64) against the model's window later;
 * here only the syntax and ranges [1, 1<<20]. Returns 0 or 2 after printing. */
int cmd_eval_lengths(const char *cmd, const char *ctx, const char *cont, int64_t *n_ctx, int64_t *n_cont);

/* One method column of `kvmill eval --task`. */
typedef struct cmd_eval_task_job {
    const kvm_method *m;
    const void *opts; /* from m->opts_new, borrowed */
    const char *spec; /* as given on the command line */
    kvm_budget budget; /* as requested (--budget or --ratio): names the column in the summary */
} cmd_eval_task_job;

/* What `kvmill eval --task` runs (orchestrator/cmd_eval_task.c). */
typedef struct cmd_eval_task_args {
    const kvm_model *m;
    const kvm_kernels *k;
    const kvm_tokenizer *tok;
    kvm_task_kind kind;
    int64_t n_ctx;                    /* context tokens at most (frame and document) */
    int first_case;                   /* index of the first case */
    int cases;                        /* cases; case i uses document (i / 9) mod n_docs at depth 0.1·(1 + i mod 9) */
    int answer_tokens;                /* greedy tokens per answer at most */
    int chat;                         /* 1: chat framing (kvm_chat_frame) */
    const char *system;               /* system message for chat, or NULL */
    kvm_eval_roundtrip_fn *roundtrip; /* the store round trip, or NULL */
    void *user;                       /* for roundtrip */
    FILE *csv;                        /* one row per (case, method), or NULL */
} cmd_eval_task_args;

/* Makes every case of a (a->m and a->tok set; no prefill: the documents are read and tokenized)
 * to find the shortest context among them, which a budget must stay below: *n_ctx tokens, of
 * case *case_index, from document *doc_index (docs->names); and the longest, *n_longest tokens.
 * Returns 0, or after printing "kvmill eval: task case N (DOC): ..." 2 when a case cannot be
 * made (as cmd_eval_task_run), else 1. */
int cmd_eval_task_extent(const cmd_eval_task_args *a, const cmd_eval_docset *docs, int64_t *n_ctx, int *case_index,
                         int *doc_index, int64_t *n_longest);

/* Runs the cases: full KV and each job per case, exact-match scored; prints a row per case and
 * per method the accuracy with its Wilson 95% interval and the exact McNemar test against full
 * KV. Returns 0, or after printing "kvmill eval: ..." 2 when a case cannot be made from the
 * documents at --context (usage: the fact alone fills it, the window is too small), else 1. */
int cmd_eval_task_run(const cmd_eval_task_args *a, const cmd_eval_docset *docs, const cmd_eval_task_job *jobs,
                      int n_jobs);

#endif
