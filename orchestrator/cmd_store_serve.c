/* cmd_store_serve.c: `kvmill store serve` and the kvmill-store stage: the store service. */
#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storesvc.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* A config holding only defaults, for a service started without --config. The model path is
 * required by the table but never read here. */
static int default_config(kvm_config **cfg)
{
    return kvm_config_parse("[model]\npath = unused-by-the-store-service\n", "(defaults)", cfg);
}

int kvm_cmd_store_serve(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"store", 1, "LMDB store directory (overrides [store] path of --config)", NULL},
        {"bind", 1,
         "endpoint workers connect to, e.g. tcp://0.0.0.0:5560 (a non-local address needs [security] "
         "server_secret_key and authorized_keys in --config); default tcp://127.0.0.1:5560",
         NULL},
        {"config", 1, "config whose [store] and [security] settings apply", NULL},
        {"parent-pid", 1,
         "stop when process PID, the parent (the kvmill run or serve that started the service), is gone; its "
         "first SIGTERM waits for the live claims of the runs that claim through the service, a second stops it now",
         NULL},
        {"create", 0,
         "make the store when it does not exist (else refused: a mistyped path would take uploads into a "
         "store no run reads)",
         NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("store serve",
                      "Runs the store service: the one process writing the LMDB store; remote compress workers upload "
                      "caches to it ([store] service) and decode workers fetch them with get_cache.",
                      argc, argv, opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *cp = kvm_cli_get(opts, "config"), *path = kvm_cli_get(opts, "store");
    if (!cp && !path) return fprintf(stderr, "kvmill store serve: --store PATH or --config FILE is required\n"), 2;
    kvm_config *cfg = NULL;
    static const char *const read_here[] = {"store", "security", NULL}; /* not [model]: a store host has none */
    if (cp ? kvm_config_load_sections(cp, read_here, &cfg) : default_config(&cfg))
        return fprintf(stderr, "kvmill store serve: --config: %s\n", kvm_errmsg()), 2;
    const char *bind = kvm_cli_get(opts, "bind"), *pp = kvm_cli_get(opts, "parent-pid");
    char *end = NULL;
    errno = 0;
    long ppid = pp ? strtol(pp, &end, 10) : 0;
    if (pp && (end == pp || *end || ppid <= 0 || ppid > INT32_MAX || errno == ERANGE)) { /* not "no process LONG_MAX" */
        kvm_config_free(&cfg);
        return fprintf(stderr, "kvmill store serve: --parent-pid: '%s' is not a process id\n", pp), 2;
    }
    /* the service stops once it is reparented: a pid that is not its parent, alive or not, is
     * the command line's error (a race with a parent that exited is taken for what it is) */
    if (pp && kvm_stage_parent_check("kvmill store serve", ppid)) {
        kvm_config_free(&cfg);
        return 2;
    }
    int bad = bind && kvm_serve_endpoint_external(bind, "kvmill store serve: --bind");
    /* an ipc:// bind's missing folder failed at the bind: exit 1, naming no folder */
    if (!bad && bind && (bad = kvm_serve_ipc_folder_check(bind, 0, NULL, "the store service binds its socket in it")))
        kvm_err(KVM_EINVAL, "kvmill store serve: --bind %s: %s", bind, kvm_errmsg());
    if (bad) {
        fprintf(stderr, "%s\n", kvm_errmsg());
        kvm_config_free(&cfg);
        return 2;
    }
    int st =
        kvm_storesvc_main(cfg, path, bind ? bind : "tcp://127.0.0.1:5560", kvm_cli_get(opts, "create") != NULL, ppid);
    kvm_config_free(&cfg);
    return st;
}
