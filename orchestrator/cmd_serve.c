/* cmd_serve.c: `kvmill serve`: the serving broker and its decode workers (pipeline/kvm_serve.h). */
#include "common/kvm_error.h"
#include "orchestrator/kvm_cli.h"
#include "model/kvm_model_window.h"
#include "orchestrator/kvm_cli_model.h"
#include "pipeline/kvm_chatcfg.h"
#include "pipeline/kvm_config.h"
#include "pipeline/kvm_jobcfg.h"
#include "pipeline/kvm_orch_remote.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storecli.h"
#include "store/kvm_store.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Settings that do not go together (kvm_jobcfg_check), which every decode worker would refuse at
 * setup: refused before --dump-config too, so that a dump is a config serve accepts as far as
 * the file alone decides. Prints the note that budget replaces ratio. Returns 0, or nonzero
 * with the refusal printed. */
static int check_settings(const kvm_config *cfg, int bind_flag)
{
    /* the endpoints' form and the keys a non-local one needs, as the binds would find them
     * (a bind that is no endpoint, a port past 65535, a non-local backend without keys) */
    if (kvm_serve_check_endpoints(cfg, bind_flag ? "--bind" : NULL))
        return kvm_cli_refuse("serve", "%s\n", kvm_errmsg()), KVM_EINVAL;
    if (kvm_jobcfg_check_service_bind(cfg, 1, bind_flag ? "--bind" : "[serve] bind"))
        return kvm_cli_refuse("serve", "%s\n", kvm_errmsg()), KVM_EINVAL;
    char size_note[8400];
    if (kvm_jobcfg_size_note(cfg, size_note, sizeof size_note)) fprintf(stderr, "kvmill serve: %s\n", size_note);
    if (kvm_jobcfg_check(cfg)) return kvm_cli_refuse("serve", "%s\n", kvm_errmsg()), KVM_EINVAL;
    /* the device list's syntax (an empty item gave a worker no device: it exited 2 at every restart) */
    if (kvm_config_int(cfg, "serve", "workers") > 0 &&
        kvm_stage_parse_devices("[serve] devices", kvm_config_str(cfg, "serve", "devices")))
        return kvm_cli_refuse("serve", "%s: %s\n", kvm_config_path(cfg), kvm_errmsg()), KVM_EINVAL;
    return 0;
}

/* With compute_missing a local store that does not exist yet is created by the decode workers
 * (or the broker, to record its cap): a folder they cannot create it in (a missing or unwritable
 * parent, a folder holding other files) is refused here, before --dump-config as well, rather
 * than by every worker until serve gives up, or never with --workers 0. Returns 0, or nonzero
 * with the refusal printed. */
static int check_new_store(const kvm_config *cfg)
{
    const char *sp = kvm_config_str(cfg, "store", "path");
    if (!kvm_config_bool(cfg, "serve", "compute_missing") || *kvm_config_str(cfg, "store", "service") ||
        kvm_serve_remote_is_endpoint(sp) || !kvm_store_check_new_dir(sp))
        return 0;
    return kvm_cli_refuse("serve", "--compute-missing: %s\n", kvm_errmsg()), KVM_EINVAL;
}

/* What else every decode worker checks at setup (a model or tokenizer that does not open; a context past the model's
 * window; [model] chat = true with a model whose tokenizer has no chat template) is refused here, naming the user's
 * file, rather than by every worker (which would name serve's resolved copy) until serve gives up. The model is opened
 * only when this host starts workers or frames chats: workers started by hand on other hosts may hold it at a path this
 * host lacks. Returns 0, or nonzero with the message printed. */
static int check_config(const kvm_config *cfg)
{
    const int chat = kvm_config_bool(cfg, "model", "chat");
    if (!chat && kvm_config_int(cfg, "serve", "workers") == 0) return 0;
    kvm_model *m = NULL;
    kvm_tokenizer *tok = NULL;
    int rc = kvm_cli_open_model_config("serve", cfg, 1, &m, &tok);
    char *open = NULL, *close_ = NULL;
    if (!rc &&
        kvm_config_int(cfg, "model", "context") > kvm_model_window(&m->cfg)) { /* as every worker's setup would */
        kvm_cli_refuse("serve", "%s: [model] context = %lld exceeds the model's window of %d tokens\n",
                       kvm_config_path(cfg), (long long)kvm_config_int(cfg, "model", "context"),
                       kvm_model_window(&m->cfg));
        rc = KVM_EINVAL;
    }
    if (!rc && chat && (rc = kvm_chatcfg_frame(cfg, tok, &open, &close_)))
        kvm_cli_refuse("serve", "%s\n", kvm_errmsg());
    free(open);
    free(close_);
    kvm_tokenizer_close(&tok);
    kvm_model_close(&m);
    return rc;
}

/* The model id the decode workers compute for [model] path (kvm_worker_model_get): the store's
 * memo when a local store exists (opened read-only: an unchanged file is not hashed again), else
 * the file's hash; the server refuses workers whose ready names another (PROTOCOL.md §5,
 * revision 10). Returns 0, or nonzero when it cannot be known: a server that starts no workers
 * may lack the file that workers on other hosts hold; it then says so and accepts any worker. */
static int serve_model_id(const kvm_config *cfg, kvm_store_id *out)
{
    const char *mp = kvm_config_str(cfg, "model", "path"), *sp = kvm_config_str(cfg, "store", "path");
    kvm_store_opts so = {.read_only = 1};
    kvm_store *st = NULL;
    int rc = !*kvm_config_str(cfg, "store", "service") && !kvm_serve_remote_is_endpoint(sp) &&
                     kvm_store_open(sp, &so, &st) == 0
                 ? kvm_store_model_id(st, mp, out)
                 : kvm_store_hash_file(mp, out);
    kvm_store_close(&st);
    if (rc == KVM_EBUSY) rc = kvm_store_hash_file(mp, out); /* a busy store's memo: the file says the same */
    if (rc)
        fprintf(stderr,
                "kvmill serve: note: the model id of [model] path cannot be computed here (%s): decode workers "
                "of any model are accepted\n",
                kvm_errmsg());
    return rc;
}

/* A store service that does not answer at start (nothing listening there, a host that is down,
 * a handshake it refuses) made every ask fail after its timeout with "no reply", behind a server
 * that said ready. It is asked once here, with a short wait (a probe for a cache that nobody
 * stores: it only reads), and a warning names the endpoint when no answer comes. Not a refusal:
 * the service may start after the server (the decode workers ask it again at every request).
 * An answer that is not a store_reply is: another kvmill endpoint answers there (a serve front
 * end's bind, ...), and every ask would fail: refused naming `where` the endpoint came from
 * ("[store] path", ...). Returns 0, or 2 after saying why. */
static int probe_store_service(const kvm_config *cfg, const char *endpoint, const char *where)
{
    enum { PROBE_MS = 1500 };
    kvm_storecli_keys k = kvm_storecli_keys_of(cfg, NULL, NULL, NULL);
    kvm_storecli *cli = NULL;
    int rc = kvm_storecli_open(&k, endpoint, &cli), foreign = 0;
    if (rc == 0) foreign = (rc = kvm_storecli_probe_service(cli, PROBE_MS)) == KVM_EPROTO;
    kvm_storecli_close(&cli);
    if (foreign) {
        kvm_cli_refuse("serve", "%s: %s\n", where, kvm_errmsg());
        return 2;
    }
    if (rc)
        fprintf(stderr,
                "kvmill serve: warning: the store service %s does not answer (%s): asks fail with \"no reply\" until "
                "it does (is kvmill store serve running and reachable there?)\n",
                endpoint, kvm_errmsg());
    return 0;
}

/* Writes cfg to f (closed here) for the decode workers. A failure (a full TMPDIR) is refused
 * with its reason and the folder, named as TMPDIR's: the path alone said neither, where a
 * missing TMPDIR was named. Returns 0 or 1. */
static int write_resolved(const kvm_config *cfg, FILE *f, const char *path)
{
    errno = 0;
    const int drc = kvm_config_dump_env(cfg, f), dump_errno = errno; /* a failed fprintf's reason */
    errno = 0;
    const int crc = fclose(f), e = drc ? dump_errno : errno;
    if (!drc && !crc) return 0;
    const char *t = getenv("TMPDIR"), *slash = strrchr(path, '/');
    kvm_cli_refuse("serve",
                   "cannot write the resolved configuration %s: %s (in TMPDIR's folder %.*s%s: free space there, or "
                   "set TMPDIR to a writable folder with room)\n",
                   path, drc == KVM_ENOMEM ? kvm_errmsg() : strerror(e ? e : EIO),
                   slash ? (int)(slash - path) : (int)strlen(path), path, t && *t ? "" : ", TMPDIR being unset");
    return 1;
}

int kvm_cmd_serve(int argc, char **argv)
{
    kvm_cli_opt opts[] = {
        {"config", 1, "configuration the caches were made with (model, context, compression), e.g. configs/default.ini",
         NULL},
        {"store", 1, "LMDB store directory (overrides [store] path; it must exist unless --compute-missing), or the "
                     "store service's endpoint tcp://HOST:PORT (sets [store] service: decode workers fetch caches from "
                     "it)", NULL},
        {"bind", 1,
         "front end endpoint for clients (overrides [serve] bind; default tcp://127.0.0.1:5555); "
         "a non-local address needs [security] keys",
         NULL},
        {"workers", 1, "decode worker processes to start (overrides [serve] workers; 0 = only external workers)", NULL},
        {"compute-missing", 0,
         "compress a document on demand when its cache is missing (sets [serve] compute_missing; a store that does "
         "not exist is then created)",
         NULL},
        {"dump-config", 0, "print the resolved configuration and exit", NULL},
        {NULL, 0, NULL, NULL}};
    int n_pos, help;
    if (kvm_cli_parse("serve", "Serves stored caches: answers `kvmill ask` requests with decode workers.", argc, argv,
                      opts, NULL, 0, &n_pos, &help))
        return help ? 0 : 2;
    const char *cpath = kvm_cli_get(opts, "config"), *store = kvm_cli_get(opts, "store"), *s;
    if (!cpath) return fprintf(stderr, "kvmill serve: --config is required\n"), 2;
    kvm_serve_opts o = {.config_path = cpath, .workers = -1};
    int64_t v;
    if ((s = kvm_cli_get(opts, "workers"))) {
        if (kvm_cli_int("serve", "workers", s, 0, 256, &v)) return 2;
        o.workers = (int)v;
    }
    kvm_config *cfg;
    char resolved[4096] = "";
    if (kvm_config_load(cpath, &cfg))
        return fprintf(stderr, "kvmill serve: --config: %s\n", kvm_cli_errmsg("serve")), 2;
    kvm_cli_log_config("serve", "serve", cfg); /* refusals from here on follow [run] log_format */
    int status = 2;
    /* an endpoint names the store service on another host (decode workers fetch with get_cache) */
    if (store && kvm_config_set(cfg, "store", kvm_serve_remote_is_endpoint(store) ? "service" : "path", store)) {
        kvm_cli_refuse("serve", "--store: %s\n", kvm_errmsg());
        goto done;
    }
    /* the command line overrides the file: --dump-config and the workers see the result */
    if ((s = kvm_cli_get(opts, "bind")) && kvm_config_set(cfg, "serve", "bind", s)) {
        kvm_cli_refuse("serve", "--bind: %s\n", kvm_errmsg());
        goto done;
    }
    if ((s = kvm_cli_get(opts, "workers")) && kvm_config_set(cfg, "serve", "workers", s)) {
        kvm_cli_refuse("serve", "--workers: %s\n", kvm_errmsg());
        goto done;
    }
    if (kvm_cli_get(opts, "compute-missing") && kvm_config_set(cfg, "serve", "compute_missing", "true")) {
        kvm_cli_refuse("serve", "--compute-missing: %s\n", kvm_errmsg());
        goto done;
    }
    if (check_settings(cfg, kvm_cli_get(opts, "bind") != NULL) || check_new_store(cfg)) goto done;
    if (kvm_cli_get(opts, "dump-config")) {
        if (kvm_config_dump(cfg, stdout, stderr))
            fprintf(stderr, "kvmill serve: --dump-config: values that do not fit an INI line are read from the environment "
                            "in the dump: run the export lines above before loading it as a config file\n");
        status = 0;
        goto done;
    }
    /* a store that cannot be opened (truncated data.mdb, not LMDB, ...) is refused here, with
     * the store's own message, rather than by every decode worker until serve gives up; one
     * that does not exist is refused too (a mistyped path would serve nothing but "no cache"
     * answers), unless the workers are to fill it (compute_missing); a store service ([store]
     * service, or a path = tcp://HOST:PORT as kvmill run takes it) is the service's to check */
    const char *sp = kvm_config_str(cfg, "store", "path"), *svc = kvm_config_str(cfg, "store", "service");
    if ((*svc || kvm_serve_remote_is_endpoint(sp)) && kvm_orch_remote_check(cfg, *svc ? svc : sp)) {
        kvm_cli_refuse("serve", "%s\n", kvm_errmsg()); /* service_bind would be ignored */
        goto done;
    }
    if (!*svc && !kvm_serve_remote_is_endpoint(sp)) {
        kvm_store_opts so = {.read_only = 1};
        kvm_store *st = NULL;
        int sst = kvm_store_open(sp, &so, &st);
        if (sst == 0) kvm_store_close(&st);
        else if (sst != KVM_ENOTFOUND) {
            kvm_cli_refuse("serve", "cannot open store: %s (%s)\n", kvm_errmsg(), kvm_strerror(sst));
            if (sst == KVM_EBUSY) status = 1; /* for now, not a setting to change: starting again may work */
            goto done;
        } else if (!kvm_config_bool(cfg, "serve", "compute_missing")) {
            struct stat sb; /* a folder made ahead (a mount point, mkdir) is there: say what it lacks */
            const int folder = stat(sp, &sb) == 0 && S_ISDIR(sb.st_mode);
            kvm_cli_refuse("serve",
                           "store %s %s: make its caches with kvmill run first, or give "
                           "--compute-missing to compress documents on demand into a new store\n",
                           sp, folder ? "is a folder without a store in it (no data.mdb)" : "does not exist");
            goto done;
        }
    }
    if (check_config(cfg)) goto done;
    const char *where = store && kvm_serve_remote_is_endpoint(store) ? "--store"
                        : *svc                                       ? "[store] service"
                                                                     : "[store] path";
    if ((*svc || kvm_serve_remote_is_endpoint(sp)) && probe_store_service(cfg, *svc ? svc : sp, where)) {
        status = 2;
        goto done;
    }
    /* the decode workers read the resolved configuration, command-line overrides included */
    kvm_rundir_sweep(); /* leftovers of a kvmill that was killed */
    int fd = -1, trc = kvm_rundir_mkstemp("serve-config", resolved, sizeof resolved, &fd);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) { /* a TMPDIR that is missing or too long is the environment's mistake (exit 2) */
        kvm_cli_refuse("serve", "cannot write the resolved configuration: %s\n", trc ? kvm_errmsg() : strerror(errno));
        if (fd >= 0) close(fd), unlink(resolved);
        resolved[0] = '\0';
        status = trc == KVM_EINVAL ? 2 : 1;
        goto done;
    }
    /* values a file cannot carry (a deep path from ${VAR}: a line over 198 characters, which every
     * decode worker refused) go to the workers in the environment */
    if (write_resolved(cfg, f, resolved)) {
        status = 1;
        goto done;
    }
    o.config_path = resolved;
    o.store_path = *kvm_config_str(cfg, "store", "service") ? kvm_config_str(cfg, "store", "service")
                                                           : kvm_config_str(cfg, "store", "path");
    o.bind = kvm_cli_get(opts, "bind");
    char self[4096], dir[4096];
    ssize_t r = readlink("/proc/self/exe", self, sizeof self - 1);
    self[r > 0 ? r : 0] = '\0';
    char *slash = strrchr(self, '/');
    snprintf(dir, sizeof dir, "%s", slash ? (*slash = '\0', self) : ".");
    o.bin_dir = *kvm_config_str(cfg, "stages", "bin_dir") ? NULL : dir;
    kvm_store_id model_id;
    if (serve_model_id(cfg, &model_id) == 0) o.model_id = model_id.b;
    status = kvm_serve_run(cfg, &o);
done:
    if (resolved[0]) unlink(resolved);
    kvm_config_free(&cfg);
    return status;
}
