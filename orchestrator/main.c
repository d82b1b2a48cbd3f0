/* main.c: the `kvmill` command line: dispatches to one subcommand per verb. */
#include "orchestrator/kvm_cli.h"
#include "orchestrator/kvm_cli_eval.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

typedef struct kvm_command {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *summary;
} kvm_command;

/* One line per subcommand; keep alphabetical. */
static const kvm_command kvm_commands[] = {
    {"ask", kvm_cmd_ask, "ask kvmill serve to continue a document after a prompt"},
    {"calibrate", kvm_cmd_calibrate, "PolyKV calibration: signals and the best per-layer eviction strategy"},
    {"eval", kvm_cmd_eval, "evaluate KV compression methods against full KV (KL, top-1, perplexity)"},
    {"generate", kvm_cmd_generate, "generate text from a prompt with a model (run.c compatible)"},
    {"info", kvm_cmd_info, "print a model's shapes and parameter count"},
    {"keygen", kvm_cmd_keygen, "make a CurveZMQ key pair for a server, client or worker"},
    {"run", kvm_cmd_run, "compress a corpus through the pipeline stages into the store"},
    {"make-model", kvm_cmd_make_model, "write a random-weight llama2.c checkpoint of any shape"},
    {"sculpt", kvm_cmd_sculpt, "KVSculpt: compress a document's KV cache by distillation into a cache file"},
    {"serve", kvm_cmd_serve, "serve stored caches to clients through decode workers"},
    {"store", kvm_cmd_store, "inspect, verify and clean the LMDB cache store"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvmill COMMAND [options]   (kvmill COMMAND --help for its options)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof kvm_commands / sizeof kvm_commands[0]; i++)
        fprintf(f, "  %-12s %s\n", kvm_commands[i].name, kvm_commands[i].summary);
}

/* A command's stdout that could not be written (a full disk, a closed descriptor: `kvmill eval ...
 * > results.txt` on a full device) lost its output, tables and summaries, under exit 0. Flushes
 * stdout and says so on stderr, naming the command and the reason: the errno of the first
 * failed write (a command that flushed stdout itself failed there, and this fflush then
 * succeeds with the error flag set). Returns rc, or 1 in place of 0 when the output is
 * incomplete. */
static int finish_stdout(const char *cmd, int rc)
{
    if (kvm_cli_flush_stdout() == 0 && !ferror(stdout)) return rc;
    const int e = kvm_cli_stdout_errno();
    fprintf(stderr, "kvmill%s%s: writing to stdout failed%s%s: the output is incomplete\n", cmd ? " " : "",
            cmd ? cmd : "", e ? ": " : "", e ? strerror(e) : "");
    return rc ? rc : 1;
}

static const kvm_command *find_command(const char *name)
{
    for (size_t i = 0; i < sizeof kvm_commands / sizeof kvm_commands[0]; i++)
        if (strcmp(name, kvm_commands[i].name) == 0) return &kvm_commands[i];
    return NULL;
}

/* `kvmill --config F run ...` puts an option before the command, as git and docker allow for their
 * global options; kvmill has none, so the message names the command found later and the order. */
static void unknown_command(int argc, char **argv)
{
    fprintf(stderr, "kvmill: unknown command '%s'", argv[1]);
    for (int j = 2; argv[1][0] == '-' && j < argc; j++) {
        const kvm_command *c = find_command(argv[j]);
        if (!c) continue;
        fprintf(stderr, ": the command comes first, then its options (kvmill %s %s ...)", c->name, argv[1]);
        break;
    }
    fputc('\n', stderr);
    usage(stderr);
}

int main(int argc, char **argv)
{
    /* a write past a file size limit (ulimit -f) fails EFBIG and is said (kvm_store.c
     * file_limit), instead of ending the process by SIGXFSZ with no word of its own */
    signal(SIGXFSZ, SIG_IGN);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return finish_stdout(NULL, 0);
    }
    const kvm_command *c = find_command(argv[1]);
    if (c) return finish_stdout(c->name, c->fn(argc - 1, argv + 1));
    unknown_command(argc, argv);
    return 2;
}
