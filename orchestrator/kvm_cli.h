/* kvm_cli.h: the `kvmill` subcommands and the small option parser they share.
 * Each command is `int kvm_cmd_NAME(int argc, char **argv)` with argv[0] = the command
 * name; it returns the process exit status (0 ok, 1 failure, 2 usage/config error). */
#ifndef KVM_CLI_H
#define KVM_CLI_H

#include <stdint.h>
#include <stdio.h>

/* `kvmill ask`'s default --timeout, seconds: above [serve] request_timeout_s's default (60), so
 * that a request the server cannot answer in time gets the server's error answer saying why
 * (the server counts that timeout from the request's arrival), not ask's "no answer" while the
 * server still works on it (tests/check_cli compares the two defaults). */
#define KVM_ASK_TIMEOUT_S 90
#define KVM_CLI_STR_(x) #x
#define KVM_CLI_STR(x) KVM_CLI_STR_(x)
int kvm_cmd_ask(int argc, char **argv);
int kvm_cmd_generate(int argc, char **argv);
int kvm_cmd_info(int argc, char **argv);
int kvm_cmd_keygen(int argc, char **argv);
int kvm_cmd_make_model(int argc, char **argv);
int kvm_cmd_run(int argc, char **argv);
/* `kvmill sculpt --model M --doc FILE [--context N] --ratio r ... --out CACHE`: KVSculpt (or a
 * baseline) on one document, the cache written to a file (compress/sculpt/kvm_sculpt_file.h). */
int kvm_cmd_sculpt(int argc, char **argv);
int kvm_cmd_calibrate_pipeline(int argc, char **argv);
int kvm_cmd_serve(int argc, char **argv);
int kvm_cmd_store(int argc, char **argv);
/* `kvmill store serve --store PATH --bind ENDPOINT [--config FILE] [--create]` (also the kvmill-store
 * stage): the store service (pipeline/kvm_storesvc.h) until SIGINT/SIGTERM. */
int kvm_cmd_store_serve(int argc, char **argv);

/* One long option of a command: `--name VALUE` (has_arg = 1) or `--name` (has_arg = 0). */
typedef struct kvm_cli_opt {
    const char *name;  /* without the leading "--", e.g. "model" */
    int has_arg;       /* 1 when the option takes a value */
    const char *help;  /* one line for --help */
    const char *value; /* parsed: the value, or "1" for a present flag, NULL if absent */
} kvm_cli_opt;

/* Parses argv[1..argc) against opts (terminated by an entry with name == NULL). Short
 * aliases: "-n" maps to an option named "n" if the table has one. A value taken from the next
 * argument may not be one of the command's own long options ("--out --sculpt" is refused
 * naming both: the value was forgotten; "--out=--x" gives such a value). An option whose help begins
 * with KVM_CLI_DEPRECATED ("deprecated: use --NEW ...") still works and prints one line
 * "kvmill CMD: --OLD is deprecated: use --NEW" to stderr (once per option). Returns 0, or 2 after
 * printing usage to stdout when --help/-h is given anywhere (*help_shown = 1), or 2 after printing
 * an error naming the bad argument to stderr. Positional arguments are collected into
 * pos[0..*n_pos) (at most max_pos; more is an error). */
int kvm_cli_parse(const char *cmd, const char *summary, int argc, char **argv, kvm_cli_opt *opts,
                  char **pos, int max_pos, int *n_pos, int *help_shown);

#define KVM_CLI_DEPRECATED "deprecated: use --"

/* The parsed value of option `name`, or NULL when absent. */
const char *kvm_cli_get(const kvm_cli_opt *opts, const char *name);

/* Parses an integer / float option value in [lo, hi]; on failure prints
 * "kvmill CMD: --NAME: ..." to stderr and returns -1. */
int kvm_cli_int(const char *cmd, const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out);
int kvm_cli_float(const char *cmd, const char *name, const char *s, double lo, double hi, double *out);
/* The same for a number in (lo, hi]: lo itself is refused (eval's --target-kl 0: only full KV has
 * KL 0), and the message states that range ("kvmill CMD: --NAME: S is outside (LO, HI]"), or
 * that S, inside it, is too close to 0 for a double (1e-308). */
int kvm_cli_float_above(const char *cmd, const char *name, const char *s, double lo, double hi, double *out);

/* An output file the command writes only after its work (a strategy, a cache file) is checked
 * before the work: its folder must exist and take new files, and `path` must not be a folder
 * nor empty (NULL: not given, fine).
 * On failure prints "kvmill CMD: --FLAG PATH: ..." to stderr and returns -1 (exit 2: a usage
 * error, found in a moment rather than after minutes of calibration); 0 otherwise. */
int kvm_cli_check_out(const char *cmd, const char *flag, const char *path);

/* An output file that already exists must not be one of the command's inputs: `sculpt --out`
 * given the --model file (or eval --csv a document) replaced it with the output. inputs[i]
 * (NULL skipped; a comma-separated list is checked item by item; a folder's *.txt count as
 * its documents) is what in_flags[i] names
 * ("--model", "tokenizer beside the model"). Same file = same device and inode, so links and
 * other spellings are caught. On a match prints "kvmill CMD: --FLAG OUT is the WHAT file
 * PATH: ..." (kvm_cli_refuse) and returns -1 (exit 2); 0 otherwise. */
int kvm_cli_check_out_inputs(const char *cmd, const char *flag, const char *out, const char *const *in_flags,
                             const char *const *inputs, int n);

/* fopen(path, "w") of an output the user names with --FLAG (--csv, --dump-signals), without
 * blocking: a FIFO with no reader is refused at once (fopen waited for one for ever); one with a
 * reader (a shell's >(...), /dev/stdout on a pipe) and other files open as fopen opens them.
 * Returns 0 with *out the stream (the caller fcloses it), or *out = NULL after printing "kvmill
 * CMD: --FLAG PATH: ..." (kvm_cli_refuse): 2 for a FIFO without a reader (a usage error), 1
 * when the open fails otherwise. */
int kvm_cli_open_out(const char *cmd, const char *flag, const char *path, FILE **out);

/* An output written whole or not at all (eval's --csv, calibrate's --out and --dump-signals),
 * opened before the command's work so that a path that cannot be written (a FIFO without a
 * reader, a folder that takes no new file) is refused before it: rows go to PATH.part, renamed
 * over PATH when the command succeeds, so a command that fails after some rows (a later document
 * that cannot be used, a kill) leaves no PATH that looks finished, and an existing PATH as it
 * was. PATH.part is written under an exclusive lock (flock), taken before it is emptied and held
 * until it is renamed: a second command given the same PATH meanwhile is refused (exit 2), where
 * both wrote one PATH.part and one exited 0 with the other's rows. A PATH that exists and is not
 * a regular file (a FIFO, /dev/stdout) is written in place; one that is a symbolic link to a file
 * has that file replaced. An existing file that is read-only (access(W_OK) fails, or no write
 * permission bit is set: root writes any file) or an LMDB file (its magic; data.mdb or lock.mdb
 * beside the other) is refused (exit 2): PATH.part renamed over it replaced a corpus document, a
 * store's data.mdb, without a word. */
typedef struct kvm_cli_staged {
    FILE *f;          /* the stream to write */
    const char *path; /* the file the user named (not owned) */
    char *part;       /* PATH.part (malloc'ed), or NULL when written in place */
    char *target;     /* PATH's file when PATH is a symbolic link to one (malloc'ed), else NULL: the
                         file is replaced (TARGET.part beside it), the link kept */
} kvm_cli_staged;

/* Opens s for --FLAG PATH (PATH.part, locked, or PATH in place by kvm_cli_open_out). Until s is
 * closed, a SIGINT or SIGTERM (where the process has no handler of its own) removes PATH.part
 * (for --csv only when nothing was written: the rows are kept, as after a failure), says so on
 * stderr, and ends the process by the signal (130 or 143 in a shell). Returns 0,
 * or after printing the refusal (s->f NULL) 2 (a FIFO without a reader; PATH.part locked by
 * another process; PATH read-only or an LMDB file) or 1 (the open failed otherwise). */
int kvm_cli_staged_open(const char *cmd, const char *flag, const char *path, kvm_cli_staged *s);

/* Closes s (nothing to do when s->f is NULL). ok = 1 (the command succeeded): PATH.part is
 * renamed over PATH; a write or rename that fails removes PATH.part, prints "kvmill CMD: --FLAG
 * PATH: write failed ..." and returns 1. ok = 0: PATH is not touched; PATH.part is removed when
 * nothing was written to it, else it keeps the rows written (named on stderr, with the fact that
 * PATH was not written); returns 0. Frees s->part. */
int kvm_cli_staged_close(const char *cmd, const char *flag, kvm_cli_staged *s, int ok);

/* fflush(stdout), keeping the errno of the first failure (a full disk) for the message main
 * prints when the command ends: by then stdout's error flag says only that a write failed, and
 * a later fflush succeeds (the failed bytes were dropped). Returns fflush's result. */
int kvm_cli_flush_stdout(void);
/* Keeps e (a failed fwrite's errno) as the reason stdout failed, unless one is kept already. */
void kvm_cli_stdout_failed(int e);
/* The errno kept by kvm_cli_flush_stdout or kvm_cli_stdout_failed, or 0. */
int kvm_cli_stdout_errno(void);

/* Closes s after a failure and removes PATH.part whatever it holds, for an output that is worth
 * nothing cut short (make-model's checkpoint; eval's rows are kept by kvm_cli_staged_close).
 * PATH is not touched; a PATH written in place (a FIFO, a device) keeps what reached it. Frees
 * s->part. Nothing to do when s->f is NULL. */
void kvm_cli_staged_abort(kvm_cli_staged *s);

/* Reads token ids from f, one decimal per line, each in [0, vocab) (generate's --tokens; path
 * names f in messages). A UTF-8 byte-order mark before the first id is skipped (it was refused
 * as "'1' is not a token id", the mark invisible in the message). On success *ids (malloc'ed,
 * the caller frees it) holds *n > 0 ids; returns 0. Else prints "kvmill CMD: PATH:LINE: ..."
 * (kvm_cli_refuse) and returns 2 when the contents are not token ids (none, a line too long, a
 * value out of range: a usage error), 1 for a read error (EIO; named with the line being read)
 * or out of memory. */
int kvm_cli_read_token_ids(const char *cmd, FILE *f, const char *path, int vocab, int32_t **ids, int64_t *n);

/* Writes v as one CSV field (RFC 4180): quoted, its quotes doubled, when it holds a comma, a
 * quote or a line break (a document named a,b.txt split its row), else as it is. */
void kvm_cli_csv_field(FILE *f, const char *v);

/* kvm_cli_check_out_inputs for a command reading a model: its --model, --tokenizer (or, without
 * one, tok512.bin and tokenizer.bin beside the model), a tokenizer.json beside a model file, a
 * Hugging Face --model folder's files (config.json, every *.safetensors, the
 * *.safetensors.index.json, tokenizer.json, tokenizer_config.json, generation_config.json) and,
 * docs not NULL, what docs_flag names; all compared by identity (st_dev, st_ino), so a symlink
 * or another spelling of a path is caught. Returns 0, or -1 after printing why (exit 2). */
int kvm_cli_check_out_model(const char *cmd, const char *flag, const char *out, const char *model,
                            const char *tokenizer, const char *docs_flag, const char *docs);

/* 1 when path names something that exists (stat succeeds), so a list flag's value (--docs
 * a,b) that names a file or folder whole, comma and all, is taken whole, not split; else 0. */
int kvm_cli_path_exists(const char *path);

/* Checks the comma-separated list `s` of option --FLAG (--budget 16,32, --method, --docs)
 * before it is split: an empty item ("16,,32", a leading or trailing comma) would be dropped
 * by the split and a value silently not run. Returns the number of items, or -1 after printing
 * "kvmill CMD: --FLAG 'S': item K is empty ..." (or, max > 0, that it has more than max items)
 * to stderr: a usage error (exit 2). */
int kvm_cli_list_check(const char *cmd, const char *flag, const char *s, int max);

/* The same check with the file named by `what` (e.g. "metrics file" for a path that may come
 * from a config key rather than a flag): prints "kvmill CMD: WHAT PATH: folder DIR: REASON" or
 * "kvmill CMD: WHAT PATH is a directory" and returns -1; 0 when PATH is NULL, empty or fine. */
int kvm_cli_check_writable(const char *cmd, const char *what, const char *path);

/* The calling thread's kvm_errmsg() for a line "kvmill CMD: <detail>": without a leading
 * "<first word of CMD>: " (the library's module prefix, "sculpt: ..." under `kvmill sculpt`),
 * so the line does not say the command twice. Points into kvm_errmsg()'s buffer (valid until
 * the next kvm_err on this thread); never NULL. */
const char *kvm_cli_errmsg(const char *cmd);

struct kvm_config;

/* Once a command has parsed its config: its start-up messages (kvm_cli_refuse) follow [run]
 * log_format: text lines "kvmill CMD: ..." as before, or one JSON object per line of stage
 * `stage` (common/kvm_log.h). Messages before this call (usage, an unreadable config) stay
 * plain text: no format is known yet. */
void kvm_cli_log_config(const char *cmd, const char *stage, const struct kvm_config *cfg);

/* [run] bind of cfg in the form the orchestrator binds (empty, ipc://DIR or tcp://HOST:PORT,
 * PORT in [1, 65534]: kvm_stage_endpoints) for run and calibrate, before the model: a value
 * refused only when the sockets were bound named neither key nor file, and run's --dump-config
 * printed it as a config run accepts. Returns 0, or -1 after "kvmill CMD: FILE: [run] bind =
 * VALUE: why" (kvm_cli_refuse; exit 2); from_flag 1: the value is run's --bind, and the
 * message names the flag instead of the file. */
int kvm_cli_check_run_bind(const char *cmd, const struct kvm_config *cfg, int from_flag);

/* A start-up refusal or problem of command cmd on stderr: "kvmill CMD: " + the formatted
 * message (fmt ends with "\n", its only newline) in text, its control bytes (a newline in a
 * name included) written as \xHH (kvm_log_escape), or, once kvm_cli_log_config chose json, a JSON line of
 * level error, event "refused", msg the message. */
void kvm_cli_refuse(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Every compression method of compress/eval/kvm_methods.c as one help phrase:
 * "full|streaming|...|polykv:FILE|sculpt[:OPTS]|..." (static, read-only). */
const char *kvm_cli_methods(void);

/* The help text of every --model option. */
#define KVM_CLI_MODEL_HELP "model: a llama2.c checkpoint or GGUF file, or a Hugging Face folder (config.json, *.safetensors)"

#endif
