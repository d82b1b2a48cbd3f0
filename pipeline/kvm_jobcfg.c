/* kvm_jobcfg.c: job settings as a MessagePack map (msgpack-c) and the config id. */
#include "pipeline/kvm_jobcfg.h"
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "compress/sculpt/kvm_sculpt_qsource.h"
#include "model/kvm_utf8.h"
#include "pipeline/kvm_serve.h"
#include "pipeline/kvm_serve_remote.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_target.h"
#include "pipeline/kvm_worker.h"
#include "proto/kvm_proto.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <msgpack.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int carried(const kvm_cfg_setting *s)
{
    return !strcmp(s->section, "model") || !strcmp(s->section, "compress") || !strcmp(s->section, "eval") ||
           !strcmp(s->section, "calibrate") || (!strcmp(s->section, "run") && !strcmp(s->key, "wire_dtype")) ||
           (!strcmp(s->section, "store") && strcmp(s->key, "path")); /* dtype, and the settings the store opens with */
}

int kvm_jobcfg_pack(const kvm_config *c, uint8_t **mp, size_t *n)
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    uint32_t count = 0;
    for (int i = 0; kvm_cfg_settings[i].section; i++) count += (uint32_t)carried(&kvm_cfg_settings[i]);
    msgpack_pack_map(&pk, count);
    char key[256];
    for (int i = 0; kvm_cfg_settings[i].section; i++) {
        const kvm_cfg_setting *s = &kvm_cfg_settings[i];
        if (!carried(s)) continue;
        snprintf(key, sizeof key, "%s.%s", s->section, s->key);
        const char *v = kvm_config_str(c, s->section, s->key); /* the resolved text, any type */
        msgpack_pack_str(&pk, strlen(key));
        msgpack_pack_str_body(&pk, key, strlen(key));
        msgpack_pack_str(&pk, strlen(v));
        msgpack_pack_str_body(&pk, v, strlen(v));
    }
    if (!sb.data) return kvm_err(KVM_ENOMEM, "job settings: out of memory");
    *mp = (uint8_t *)sb.data; /* sbuffer memory is malloc'ed: the caller frees it */
    *n = sb.size;
    return 0;
}

int kvm_jobcfg_unpack(const uint8_t *mp, size_t n, kvm_config **out)
{
    *out = NULL;
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int rc = 0;
    if (msgpack_unpack_next(&u, (const char *)mp, n, &off) != MSGPACK_UNPACK_SUCCESS || u.data.type != MSGPACK_OBJECT_MAP) {
        msgpack_unpacked_destroy(&u);
        return kvm_err(KVM_EPROTO, "job settings: not a MessagePack map");
    }
    const msgpack_object_map *m = &u.data.via.map;
    const char *path = NULL;
    char key[256], val[4096];
    for (uint32_t i = 0; i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key, *v = &m->ptr[i].val;
        if (k->type != MSGPACK_OBJECT_STR || v->type != MSGPACK_OBJECT_STR || k->via.str.size >= sizeof key ||
            v->via.str.size >= sizeof val) {
            rc = kvm_err(KVM_EPROTO, "job settings: entry %u is not a short string pair", i);
            break;
        }
        if (k->via.str.size == 10 && !memcmp(k->via.str.ptr, "model.path", 10)) path = v->via.str.ptr;
    }
    kvm_config *c = NULL;
    if (!rc) {
        char base[8192];
        int plen = 0;
        for (uint32_t i = 0; path && i < m->size; i++)
            if (m->ptr[i].val.via.str.ptr == path) plen = (int)m->ptr[i].val.via.str.size;
        /* a placeholder: the entries below set the path as they are (a deep one, given through
         * ${VAR} as README says, made this one-line parse fail for every job: libinih's lines hold
         * 198 characters) */
        snprintf(base, sizeof base, "[model]\npath = %s\n", plen > 0 ? "-" : "");
        if (!path) rc = kvm_err(KVM_EINVAL, "job settings: model.path missing");
        else rc = kvm_config_parse(base, "job settings", &c);
    }
    for (uint32_t i = 0; !rc && i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key, *v = &m->ptr[i].val;
        memcpy(key, k->via.str.ptr, k->via.str.size);
        key[k->via.str.size] = '\0';
        memcpy(val, v->via.str.ptr, v->via.str.size);
        val[v->via.str.size] = '\0';
        char *dot = strchr(key, '.');
        if (!dot) { rc = kvm_err(KVM_EINVAL, "job settings: key '%s' is not section.key", key); break; }
        *dot = '\0';
        rc = kvm_config_set(c, key, dot + 1, val);
    }
    msgpack_unpacked_destroy(&u);
    if (rc) kvm_config_free(&c);
    *out = c;
    return rc;
}

/* [store] service and service_bind: endpoints or empty. A service that is not one was taken for an LMDB
 * directory of that name by serve's decode workers (a new, empty store in the working directory); a bad
 * service_bind was found only when the store service it starts exited (exit 1). */
static int check_store_endpoints(const kvm_config *c)
{
    const char *keys[] = {"service", "service_bind"};
    for (int i = 0; i < 2; i++) {
        const char *v = kvm_config_str(c, "store", keys[i]);
        char what[64];
        snprintf(what, sizeof what, "[store] %s", keys[i]);
        if (*v && !kvm_serve_remote_is_endpoint(v))
            return kvm_err(KVM_EINVAL, "%s: %s = %s is not a store service endpoint (tcp://HOST:PORT or ipc://PATH); "
                                       "an LMDB directory is [store] path", kvm_config_path(c), what, v);
        if (*v && kvm_serve_endpoint_check(v, what))
            return kvm_err(KVM_EINVAL, "%s: %s", kvm_config_path(c), kvm_errmsg());
    }
    return 0;
}

/* tcp://HOST:PORT into host (the text between // and the last colon) and port; 0 when not one. */
static int tcp_parts(const char *ep, const char **host, size_t *host_len, long *port)
{
    if (strncmp(ep, "tcp://", 6)) return 0;
    const char *colon = strrchr(ep + 6, ':');
    char *end;
    if (!colon) return 0;
    *port = strtol(colon + 1, &end, 10);
    if (*end || end == colon + 1) return 0;
    *host = ep + 6;
    *host_len = (size_t)(colon - (ep + 6));
    return 1;
}

static int every_address(const char *h, size_t n)
{
    return (n == 7 && !strncmp(h, "0.0.0.0", 7)) || (n == 1 && h[0] == '*') || (n == 4 && !strncmp(h, "[::]", 4)) ||
           (n == 2 && !strncmp(h, "::", 2));
}

/* The IPv4 address of interface `name` as text into out (INET_ADDRSTRLEN), the first one as
 * libzmq's bind takes it (tcp://lo:PORT binds lo's 127.0.0.1); 0 when no such interface has one. */
static int interface_v4(const char *name, char *out)
{
    struct ifaddrs *all = NULL;
    int found = 0;
    if (getifaddrs(&all)) return 0;
    for (struct ifaddrs *i = all; i && !found; i = i->ifa_next)
        if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && !strcmp(i->ifa_name, name))
            found = !!inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, out, INET_ADDRSTRLEN);
    freeifaddrs(all);
    return found;
}

/* A tcp:// host h[0, n) as one spelling of the socket address it binds, into out (at least
 * INET6_ADDRSTRLEN + 2): with `interfaces`, an interface name is its address, as libzmq's bind
 * tries it first (without, it is a name, as a connect takes it);
 * every numeric IPv4 spelling (127.1, 0x7f.0.0.1: getaddrinfo's AI_NUMERICHOST, as libzmq)
 * is its dotted quad; a bracketed IPv6 address is its short form, an IPv4-mapped one
 * ([::ffff:127.0.0.1], which takes 127.0.0.1's port) its IPv4 quad. localhost, with or
 * without the root's dot, is 127.0.0.1: kvm_serve_bind binds it so (libzmq resolves it to
 * IPv4 without ZMQ_IPV6). An interface name or "localhost." that a connect endpoint cannot
 * resolve reaches nothing anyway: calling it a clash refuses nothing that could work. [::1]
 * stays itself: another socket than 127.0.0.1's. Anything else is kept as written. */
static void host_form(const char *h, size_t n, int interfaces, char *out, size_t size)
{
    char host[300];
    if (n >= sizeof host) { /* no address, localhost or interface is spelled so long: a name, as it is */
        snprintf(out, size, "%.*s", (int)n, h); /* (host[n - 1] was read, and written, past the copy) */
        return;
    }
    snprintf(host, sizeof host, "%.*s", (int)n, h);
    struct addrinfo hint = {.ai_flags = AI_NUMERICHOST}, *ai = NULL;
    const int v6 = n > 2 && host[0] == '[' && host[n - 1] == ']';
    if (v6) host[n - 1] = '\0';
    hint.ai_family = v6 ? AF_INET6 : AF_INET;
    snprintf(out, size, "%s", host);
    if (!strcasecmp(host, "localhost") || !strcasecmp(host, "localhost."))
        snprintf(out, size, "127.0.0.1");
    else if (interfaces && !v6 && interface_v4(host, out))
        return;
    else if (!getaddrinfo(v6 ? host + 1 : host, NULL, &hint, &ai) && ai) {
        const struct in6_addr *a6 = &((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr;
        char txt[INET6_ADDRSTRLEN] = "";
        if (!v6)
            inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_addr)->sin_addr, txt, sizeof txt);
        else if (IN6_IS_ADDR_V4MAPPED(a6))
            inet_ntop(AF_INET, &a6->s6_addr[12], txt, sizeof txt);
        else if (inet_ntop(AF_INET6, a6, txt + 1, sizeof txt - 2))
            txt[0] = '[', strcat(txt, "]");
        if (*txt) snprintf(out, size, "%s", txt);
    }
    if (ai) freeaddrinfo(ai);
}

/* ep in the form two endpoints are compared in, never bound: a tcp:// host as host_form
 * spells it (spelled one way in service_bind and another in a bind, a clash was missed:
 * localhost and 127.0.0.1, 127.1, lo), and an ipc:// path as kvm_file_path_norm spells it (a
 * [run] run_dir ending in '/' binds DIR//ctl, the file DIR/ctl; a relative one, '..' or a link
 * named the same file another way). */
static void compare_form(const char *ep, char *out, size_t size)
{
    const char *host;
    size_t host_len;
    long port;
    if (tcp_parts(ep, &host, &host_len, &port)) {
        char h[INET6_ADDRSTRLEN + 300];
        host_form(host, host_len, 1, h, sizeof h);
        snprintf(out, size, "tcp://%s:%ld", h, port);
        return;
    }
    char path[4200];
    if (!strncmp(ep, "ipc://", 6) && ep[6] != '@' && !kvm_file_path_norm(ep + 6, path, sizeof path)) {
        snprintf(out, size, "ipc://%s", path); /* relative, '.', '..', '//', links: one spelling */
        return;
    }
    snprintf(out, size, "%s", ep);
}

int kvm_jobcfg_same_socket(const char *a_ep, const char *b_ep)
{
    char a[1100], b[1100];
    const char *ha, *hb;
    size_t na, nb;
    long pa, pb;
    compare_form(a_ep, a, sizeof a);
    compare_form(b_ep, b, sizeof b);
    if (!tcp_parts(a, &ha, &na, &pa) || !tcp_parts(b, &hb, &nb, &pb)) return !strcmp(a, b);
    return pa == pb && ((na == nb && !strncmp(ha, hb, na)) || every_address(ha, na) || every_address(hb, nb));
}

int kvm_jobcfg_is_loopback(const char *ep)
{
    if (!strncmp(ep, "ipc://", 6) || !strncmp(ep, "inproc://", 9)) return 1;
    const char *colon = !strncmp(ep, "tcp://", 6) ? strrchr(ep + 6, ':') : NULL; /* the port may be '*' */
    if (!colon) return 0;
    char h[INET6_ADDRSTRLEN + 300];
    struct in_addr a4;
    /* no interface names: a connect endpoint (a store client's) takes "lo" for a DNS name, which a
     * search domain can resolve to another host; only binds read interfaces */
    host_form(ep + 6, (size_t)(colon - (ep + 6)), 0, h, sizeof h);
    return !strcmp(h, "[::1]") || (inet_pton(AF_INET, h, &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127);
}

/* The endpoint of the command's own sockets that ep (a setting, `setting`) would take or reach
 * (same_socket), as an error naming both (clash: what goes wrong), or 0. A back end left empty
 * ([run] bind, [serve] backend) is bound in [run] run_dir, ipc://RUN_DIR/ctl and /data, as
 * kvm_orch and the serve broker bind it (an empty run_dir is a fresh folder: nothing to clash). */
static int own_socket_clash(const kvm_config *c, int serve, const char *bind_what, const char *setting, const char *ep,
                            const char *clash)
{
    const char *back = kvm_config_str(c, serve ? "serve" : "run", serve ? "backend" : "bind");
    const char *run_dir = kvm_config_str(c, "run", "run_dir"), *front = serve ? kvm_config_str(c, "serve", "bind") : "";
    char in_run_dir[1100] = "";
    if (!*back && *run_dir) snprintf(in_run_dir, sizeof in_run_dir, "ipc://%s", run_dir);
    struct {
        const char *base, *what, *value; /* an endpoint the command binds; its setting and that setting's value */
        int pair;                        /* 1: a base, binding PORT (control) and PORT + 1 (data) */
    } own[2] = {
        {front, bind_what, front, 0},
        {*back ? back : in_run_dir,
         *back ? (serve ? "[serve] backend" : bind_what)
               : (serve ? "the default [serve] backend in [run] run_dir" : "the default [run] bind in [run] run_dir"),
         *back ? back : run_dir, 1}};
    for (int i = 0; i < 2; i++) {
        char ctl[1100], data[1100];
        if (!*own[i].base) continue;
        if (!own[i].pair)
            snprintf(ctl, sizeof ctl, "%s", own[i].base), data[0] = '\0';
        else if (kvm_stage_endpoints(own[i].base, ctl, data, sizeof ctl))
            continue; /* the endpoint's own check refuses it */
        const char *eps[2] = {ctl, data};
        for (int k = 0; k < 2; k++)
            if (*eps[k] && kvm_jobcfg_same_socket(ep, eps[k]))
                return kvm_err(KVM_EINVAL, "%s: %s = %s is the endpoint %s of %s = %s (%s): %s", kvm_config_path(c),
                               setting, ep, eps[k], own[i].what, own[i].value,
                               !own[i].pair ? "its front end"
                               : k          ? "its data socket: port + 1, or DIR/data for ipc://"
                                            : "its control socket",
                               clash);
    }
    return 0;
}

int kvm_jobcfg_check_service_bind(const kvm_config *c, int serve, const char *bind_what)
{
    const char *sb = kvm_config_str(c, "store", "service_bind"), *who = serve ? "kvmill serve" : "the run";
    char clash[256];
    /* a missing folder failed only when the store service started: exit 1 */
    if (*sb && kvm_serve_ipc_folder_check(sb, 0, c, "the store service binds its socket in it"))
        return kvm_err(KVM_EINVAL, "%s: [store] service_bind = %s: %s", kvm_config_path(c), sb, kvm_errmsg());
    snprintf(clash, sizeof clash,
             "the store service and %s would bind the same socket; give service_bind another port (or path)", who);
    int rc = *sb ? own_socket_clash(c, serve, bind_what, "[store] service_bind", sb, clash) : 0;
    /* the store it asks for caches: its own socket would answer it, never a store service */
    const char *svc = kvm_config_str(c, "store", "service"), *path = kvm_config_str(c, "store", "path");
    snprintf(clash, sizeof clash, "%s would ask itself for caches; name the store service's endpoint", who);
    if (!rc && *svc) rc = own_socket_clash(c, serve, bind_what, "[store] service", svc, clash);
    if (!rc && kvm_serve_remote_is_endpoint(path))
        rc = own_socket_clash(c, serve, bind_what, "[store] path", path, clash);
    return rc;
}

int kvm_jobcfg_check_text(const kvm_config *c)
{
    for (int i = 0; kvm_cfg_settings[i].section; i++) {
        const kvm_cfg_setting *s = &kvm_cfg_settings[i];
        if (!carried(s)) continue;
        const char *v = kvm_config_str(c, s->section, s->key);
        size_t n = strlen(v);
        if (n > KVM_PROTO_MAX_NAME_BYTES)
            return kvm_err(KVM_EINVAL, "%s: [%s] %s is %zu bytes, more than the %d a setting carries to the stage "
                                       "processes; shorten it (a path: link the file from a shorter one)",
                           kvm_config_path(c), s->section, s->key, n, KVM_PROTO_MAX_NAME_BYTES);
        if (!kvm_utf8_valid(v, n)) {
            size_t ok = 0; /* the longest valid prefix: where the bad bytes start, for the message */
            for (size_t k = 1; k <= n; k++)
                if (kvm_utf8_valid(v, k)) ok = k;
            return kvm_err(KVM_EINVAL, "%s: [%s] %s = '%s' is not UTF-8 text (at byte %zu): settings travel to the stage "
                                       "processes as UTF-8 (a path: rename the file, or link it under a UTF-8 name)",
                           kvm_config_path(c), s->section, s->key, v, ok);
        }
    }
    return 0;
}

int kvm_jobcfg_check_strategy(const kvm_config *c)
{
    /* polykv finds its strategy in the store under this name: one the store cannot hold was refused
     * only when opened, by run as "strategy: name must be 1 to 255 bytes and the model id given"
     * (no file or key), by serve in each decode worker until it gave up, and --dump-config took it */
    size_t sn = strlen(kvm_config_str(c, "compress", "strategy"));
    if (strcmp(kvm_config_str(c, "compress", "method"), "polykv") || (sn > 0 && sn <= KVM_STORE_MAX_NAME)) return 0;
    return kvm_err(KVM_EINVAL,
                   "%s: [compress] strategy: the name the PolyKV strategy is stored under must be 1 to %d bytes (it "
                   "is %zu)",
                   kvm_config_path(c), KVM_STORE_MAX_NAME, sn);
}

int kvm_jobcfg_check(const kvm_config *c)
{
    if (check_store_endpoints(c)) return KVM_EINVAL;
    const char *method = kvm_config_str(c, "compress", "method");
    int64_t ctx = kvm_config_int(c, "model", "context"), budget = kvm_config_int(c, "compress", "budget");
    int64_t retain = kvm_config_int(c, "compress", "retain");
    kvm_sculpt_mode mode;
    int sculpt = kvm_sculpt_mode_parse(method, &mode) == 0; /* every method that keeps a retain zone */
    if (kvm_jobcfg_check_strategy(c)) return KVM_EINVAL;
    if (*kvm_config_str(c, "model", "system") && !kvm_config_bool(c, "model", "chat"))
        return kvm_err(KVM_EINVAL, "%s: [model] system is set but chat = false: the system message is part of the chat "
                                   "framing; set chat = true or remove system",
                       kvm_config_path(c));
    int target = kvm_config_float(c, "compress", "target_kl") > 0;
    if (target && (!strcmp(method, "full") || !strcmp(method, "polykv")))
        return kvm_err(KVM_EINVAL, "%s: [compress] target_kl chooses a budget per document, which method %s does not "
                                   "take (%s); use a method with a budget or set target_kl = 0",
                       kvm_config_path(c), method,
                       !strcmp(method, "full") ? "it keeps every entry" : "its strategy sets the budgets");
    if (kvm_config_bool(c, "compress", "on_policy")) { /* a sculpt-family setting: refused where it does nothing */
        if (!sculpt)
            return kvm_err(KVM_EINVAL, "%s: [compress] on_policy = true fits the distilled layers in order, which method %s "
                                       "does not make (%s); use a sculpt-family method or set on_policy = false",
                           kvm_config_path(c), method,
                           !strcmp(method, "polykv") ? "its strategy chooses each layer's method"
                           : !strcmp(method, "full") ? "it keeps every entry"
                                                     : "it keeps or drops the original entries");
        kvm_sculpt_opts so;
        int rc = kvm_worker_sculpt_opts(c, mode, &so);
        if (!rc) rc = kvm_sculpt_opts_check_combination(&so);
        if (rc) return kvm_err(rc, "%s: [compress]: %s", kvm_config_path(c), kvm_errmsg());
    }
    if (!strcmp(method, "full")) return 0;
    if (target && kvm_target_lowest_budget(c) >= ctx)
        return kvm_err(KVM_EINVAL, "%s: [compress] target_kl: the smallest budget searched, %lld (the first multiple of "
                                   "target_step = %lld%s), is not below [model] context = %lld: the search would keep "
                                   "context - 1 entries, no smaller cache; lower target_step%s",
                       kvm_config_path(c), (long long)kvm_target_lowest_budget(c),
                       (long long)kvm_config_int(c, "compress", "target_step"), sculpt ? " above retain" : "",
                       (long long)ctx, sculpt ? " or retain" : "");
    if (!target && budget == 0 && kvm_config_float(c, "compress", "ratio") >= 1) /* b = N: as budget >= context */
        return kvm_err(KVM_EINVAL, "%s: [compress] ratio = 1 keeps every entry of every document: the \"compressed\" "
                                   "cache would be as large as the full one or larger; lower ratio (or use method = full)",
                       kvm_config_path(c));
    if (!target && budget >= ctx) /* with target_kl the search sets the budget: this one is unused */
        return kvm_err(KVM_EINVAL, "%s: [compress] budget = %lld is not below [model] context = %lld: the \"compressed\" "
                                   "cache would be as large as the full one or larger; lower budget (or use method = full)",
                       kvm_config_path(c), (long long)budget, (long long)ctx);
    if (sculpt && !target && budget > 0 && budget <= retain) /* the worker would need k = budget - retain < 1 */
        return kvm_err(KVM_EINVAL,
                       "%s: [compress] budget = %lld entries per head leaves none beyond the retain zone of "
                       "[compress] retain = %lld (method %s distils budget - retain entries); raise budget "
                       "above retain, lower retain, or use ratio",
                       kvm_config_path(c), (long long)budget, (long long)retain, method);
    if (sculpt && retain >= ctx)
        return kvm_err(KVM_EINVAL, "%s: [compress] retain = %lld is not below [model] context = %lld: the retain zone would "
                                   "keep every token and the distilled entries would make the cache larger than the full "
                                   "one; lower retain",
                       kvm_config_path(c), (long long)retain, (long long)ctx);
    /* the fit's training queries: the retain zone's own (retain per query head) and [compress]
     * queries (split by query_source): with neither, every document failed in the compress
     * worker ("sculpt: no training queries"), exit 1, naming no key */
    if (sculpt && retain == 0 && kvm_config_int(c, "compress", "queries") == 0)
        return kvm_err(KVM_EINVAL,
                       "%s: [compress] queries = 0 and retain = 0: method %s fits its entries to training "
                       "queries, the retain zone's and [compress] queries, and this config gives none "
                       "(every document would fail); set queries (default 2048) or retain above 0",
                       kvm_config_path(c), method);
    if (sculpt) { /* the rest the solver refuses (a query_source share of no query): at start, not per document */
        kvm_sculpt_opts so;
        int rc = kvm_worker_sculpt_opts(c, mode, &so);
        if (!rc) rc = kvm_sculpt_opts_check_combination(&so);
        if (rc) return kvm_err(rc, "%s: [compress]: %s", kvm_config_path(c), kvm_errmsg());
    }
    return 0;
}

int kvm_jobcfg_check_repeat(const kvm_config *c, const kvm_tokenizer *tok, int window, int calibrate)
{
    kvm_sculpt_mode mode = KVM_SCULPT_FULL;
    const char *method = kvm_config_str(c, "compress", "method");
    int distils = calibrate ? kvm_config_bool(c, "calibrate", "sculpt") || kvm_config_bool(c, "calibrate", "kvzip")
                            : strcmp(method, "polykv") && kvm_sculpt_mode_parse(method, &mode) == 0;
    kvm_sculpt_opts so;
    if (!distils || kvm_worker_sculpt_opts(c, mode, &so) || !(so.query_source.share[KVM_SCULPT_QSRC_REPEAT] > 0))
        return 0; /* a bad option was refused by kvm_jobcfg_check */
    int32_t *rp = NULL;
    int64_t P = 0, N = kvm_config_int(c, "model", "context");
    int rc = kvm_sculpt_repeat_prompt(tok, kvm_config_bool(c, "model", "chat"), &rp, &P);
    free(rp);
    if (rc) return rc;
    if (P < 1) P = 1; /* the BOS token alone without one (sculpt_qsource.c) */
    if (2 * N + P <= window) return 0;
    return kvm_err(KVM_EINVAL,
                   "%s: [compress] query_source %s prefills the context again after the repeat prompt: 2N + P = "
                   "%lld positions (N = [model] context = %lld, P = %lld) exceed the model's window of %d tokens "
                   "(every document would fail%s); lower context, or another query_source",
                   kvm_config_path(c), kvm_config_str(c, "compress", "query_source"), (long long)(2 * N + P),
                   (long long)N, (long long)P, window, calibrate ? " in the signals stage" : "");
}

int kvm_jobcfg_size_note(const kvm_config *c, char *out, size_t n)
{
    int64_t budget = kvm_config_int(c, "compress", "budget");
    if (kvm_config_float(c, "compress", "target_kl") > 0 || !strcmp(kvm_config_str(c, "compress", "method"), "full"))
        return 0; /* neither size is used */
    if (budget <= 0 || !kvm_config_is_set(c, "compress", "ratio")) return 0;
    snprintf(out, n,
             "%s: [compress] budget = %lld replaces ratio = %s (budget overrides ratio; remove one to "
             "silence this)",
             kvm_config_path(c), (long long)budget, kvm_config_str(c, "compress", "ratio"));
    return 1;
}

/* Removes the lines of text[0, n) that start with prefix; returns the new length. */
static size_t drop_lines(char *text, size_t n, const char *prefix)
{
    size_t w = 0, pl = strlen(prefix);
    for (size_t r = 0; r < n;) {
        const char *eol = memchr(text + r, '\n', n - r);
        size_t len = eol ? (size_t)(eol - (text + r)) + 1 : n - r;
        if (len < pl || memcmp(text + r, prefix, pl)) {
            memmove(text + w, text + r, len);
            w += len;
        }
        r += len;
    }
    return w;
}

int kvm_jobcfg_config_id(const kvm_config *c, const kvm_store_id *strategy_hash, kvm_store_id *id, char **canonical,
                         size_t *canonical_len)
{
    char *comp;
    size_t n;
    int rc = kvm_config_canonical(c, "compress", &comp, &n);
    if (rc) return rc;
    if (!(kvm_config_float(c, "compress", "target_kl") > 0)) /* off: the ids of configs without the keys */
        n = drop_lines(comp, n, "compress.target_");
    else { /* the search sets each document's budget: budget and ratio are unused, so not in the id */
        n = drop_lines(comp, n, "compress.budget=");
        n = drop_lines(comp, n, "compress.ratio=");
    }
    if (!kvm_config_bool(c, "compress", "on_policy")) n = drop_lines(comp, n, "compress.on_policy=");
    if (!kvm_config_bool(c, "compress", "am_start")) n = drop_lines(comp, n, "compress.am_start=");
    /* uniform budgets run no pilot: its settings do not change the cache, so not in the id (a
     * change of their defaults keeps the uniform configs' caches) */
    if (!strcmp(kvm_config_str(c, "compress", "alloc"), "uniform")) {
        n = drop_lines(comp, n, "compress.pilot_");
        n = drop_lines(comp, n, "compress.power=");
    }
    /* the solver's convergence settings when off (today's solve, bit for bit): the old ids */
    if (!(kvm_config_float(c, "compress", "tolerance") > 0)) n = drop_lines(comp, n, "compress.tolerance=");
    if (!(kvm_config_float(c, "compress", "round_tolerance") > 0)) n = drop_lines(comp, n, "compress.round_tolerance=");
    if (!kvm_config_int(c, "compress", "carry_history")) n = drop_lines(comp, n, "compress.carry_history=");
    if (!kvm_config_int(c, "compress", "ridge_f32")) n = drop_lines(comp, n, "compress.ridge_f32=");
    if (!(kvm_config_float(c, "compress", "gradient_tolerance") > 0))
        n = drop_lines(comp, n, "compress.gradient_tolerance=");
    const char *sys = kvm_config_str(c, "model", "system");
    int chat = kvm_config_bool(c, "model", "chat");
    size_t cap = n + 512 + (chat ? 2 * strlen(sys) : 0);
    char *text = malloc(cap);
    if (!text) { free(comp); return kvm_err(KVM_ENOMEM, "config id: out of memory"); }
    char hex[KVM_STORE_ID_HEX + 1];
    char version[32]; /* polykv's own part: its caches go stale alone (KVM_JOBCFG_POLYKV_PLAN) */
    if (strcmp(kvm_config_str(c, "compress", "method"), "polykv"))
        snprintf(version, sizeof version, "%d", KVM_JOBCFG_ALGORITHM_VERSION);
    else
        snprintf(version, sizeof version, "%d.%d", KVM_JOBCFG_ALGORITHM_VERSION, KVM_JOBCFG_POLYKV_PLAN);
    int k = snprintf(text, cap, "kvmill.algorithm=%s\nmodel.context=%lld\nstore.dtype=%s\n", version,
                     (long long)kvm_config_int(c, "model", "context"), kvm_config_str(c, "store", "dtype"));
    /* 16-bit KV on the wire changes the cache a little: its own id (f32 keeps the old ids) */
    const char *wire = kvm_config_str(c, "run", "wire_dtype");
    if (strcmp(wire, "f32")) k += snprintf(text + k, cap - (size_t)k, "run.wire_dtype=%s\n", wire);
    /* 16-bit weight panels (the default `auto` on GGUF and 16-bit files) change the forward a
     * little, so the caches too: their own id (f32 keeps the old ids) */
    const char *wdt = kvm_config_str(c, "model", "weight_dtype");
    if (strcmp(wdt, "f32")) k += snprintf(text + k, cap - (size_t)k, "model.weight_dtype=%s\n", wdt);
    /* chat framing changes what is cached (the documents open a chat turn): its own id, with
     * the system message (\, newline and CR escaped: one line); without it the old ids */
    if (chat) {
        k += snprintf(text + k, cap - (size_t)k, "model.chat=true\n");
        if (*sys) {
            k += snprintf(text + k, cap - (size_t)k, "model.system=");
            for (const char *p = sys; *p; p++) {
                if (*p == '\\' || *p == '\n' || *p == '\r') text[k++] = '\\';
                text[k++] = *p == '\n' ? 'n' : *p == '\r' ? 'r' : *p;
            }
            text[k++] = '\n';
        }
    }
    memcpy(text + k, comp, n);
    free(comp);
    size_t len = (size_t)k + n;
    if (strategy_hash)
        len += (size_t)snprintf(text + len, cap - len, "strategy.hash=%s\n", kvm_store_id_hex(strategy_hash, hex));
    kvm_store_hash_bytes(text, len, id);
    if (canonical) { *canonical = text; *canonical_len = len; }
    else free(text);
    return 0;
}

int kvm_jobcfg_config_id_in(const kvm_config *c, kvm_store *s, const kvm_store_id *model_id, kvm_store_id *id,
                            char **canonical, size_t *canonical_len)
{
    if (strcmp(kvm_config_str(c, "compress", "method"), "polykv"))
        return kvm_jobcfg_config_id(c, NULL, id, canonical, canonical_len);
    const char *name = kvm_config_str(c, "compress", "strategy");
    uint8_t *buf = NULL;
    size_t len = 0;
    int rc = s ? kvm_store_get_strategy(s, model_id, name, &buf, &len) : KVM_ENOTFOUND;
    if (rc == KVM_ENOTFOUND) {
        char hex[KVM_STORE_ID_HEX + 1];
        return kvm_err(KVM_ENOTFOUND, "no PolyKV strategy '%s' is stored for model %s: run kvmill calibrate --config %s "
                                      "--docs DIR first", name, kvm_store_id_hex(model_id, hex), kvm_config_path(c));
    }
    if (rc) return rc;
    rc = kvm_jobcfg_config_id_with(c, buf, len, id, canonical, canonical_len);
    free(buf);
    return rc;
}

int kvm_jobcfg_config_id_with(const kvm_config *c, const uint8_t *strategy, size_t strategy_len, kvm_store_id *id,
                              char **canonical, size_t *canonical_len)
{
    if (!strategy || strcmp(kvm_config_str(c, "compress", "method"), "polykv"))
        return kvm_jobcfg_config_id(c, NULL, id, canonical, canonical_len);
    kvm_store_id h;
    kvm_store_hash_bytes(strategy, strategy_len, &h);
    return kvm_jobcfg_config_id(c, &h, id, canonical, canonical_len);
}

/* The value of line "name=..." in text[0, n) (pointer and length), or NULL. */
static const char *line_value(const char *text, size_t n, const char *name, size_t *len)
{
    size_t nl = strlen(name);
    for (const char *p = text, *e = text + n; p < e;) {
        const char *eol = memchr(p, '\n', (size_t)(e - p));
        if (!eol) eol = e;
        if ((size_t)(eol - p) > nl && !memcmp(p, name, nl) && p[nl] == '=') {
            *len = (size_t)(eol - p) - nl - 1;
            return p + nl + 1;
        }
        p = eol + 1;
    }
    return NULL;
}

/* 1 when a and b hold the same lines once the kvmill.algorithm and strategy.hash lines are
 * left out. */
static int same_settings(const char *a, size_t an, const char *b, size_t bn)
{
    const char *pa = a, *ea = a + an, *pb = b, *eb = b + bn;
    for (;;) {
        const char *la = NULL, *lb = NULL, *ta = NULL, *tb = NULL;
        while (pa < ea) { /* next kept line of a */
            ta = memchr(pa, '\n', (size_t)(ea - pa));
            if (!ta) ta = ea;
            if (strncmp(pa, "kvmill.algorithm=", 17) && strncmp(pa, "strategy.hash=", 14)) { la = pa; break; }
            pa = ta + 1;
        }
        while (pb < eb) {
            tb = memchr(pb, '\n', (size_t)(eb - pb));
            if (!tb) tb = eb;
            if (strncmp(pb, "kvmill.algorithm=", 17) && strncmp(pb, "strategy.hash=", 14)) { lb = pb; break; }
            pb = tb + 1;
        }
        if (!la || !lb) return !la && !lb;
        if (ta - la != tb - lb || memcmp(la, lb, (size_t)(ta - la))) return 0;
        pa = ta + 1;
        pb = tb + 1;
    }
}

kvm_jobcfg_state kvm_jobcfg_compare(const char *cache, size_t cache_len, const char *cur, size_t cur_len)
{
    if (cache_len == cur_len && !memcmp(cache, cur, cur_len)) return KVM_JOBCFG_OK;
    if (!same_settings(cache, cache_len, cur, cur_len)) return KVM_JOBCFG_OTHER;
    size_t al = 0, bl = 0;
    const char *a = line_value(cache, cache_len, "kvmill.algorithm", &al), *b = line_value(cur, cur_len, "kvmill.algorithm", &bl);
    if (!a || !b || al != bl || memcmp(a, b, al)) return KVM_JOBCFG_STALE_ALGORITHM;
    return KVM_JOBCFG_STALE_STRATEGY;
}

const char *kvm_jobcfg_state_name(kvm_jobcfg_state st)
{
    switch (st) {
    case KVM_JOBCFG_OK: return "ok";
    case KVM_JOBCFG_STALE_STRATEGY: return "stale-strategy";
    case KVM_JOBCFG_STALE_ALGORITHM: return "stale-algorithm";
    default: return "other-config";
    }
}
