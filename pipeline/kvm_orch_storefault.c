/* kvm_orch_storefault.c: a compress worker started by hand whose caches cannot reach the run's
 * store (keys the store service refuses, another --store, a store service that answers the run
 * but never the worker) fails every job it takes. Each failure
 * was an attempt of that job's document, so one such worker made documents fail after
 * [run] max_retries although the run's own workers could have stored them. Such a worker is
 * the cause, not the document: it is refused (no more jobs; told why, so it exits, as a worker
 * of another model is), and its job goes back to the queue without using an attempt. */
#include "pipeline/kvm_orch_int.h"

#include <stdio.h>
#include <string.h>

#include "common/kvm_error.h"
#include "common/kvm_log.h"
#include "pipeline/kvm_orch_remote.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storecli.h"

int kvm_orch__store_fault_worker(const orch *o, int w)
{
    return o->mode == MODE_RUN && w >= 0 && o->workers[w].slot < 0 && o->workers[w].stage == ST_COMPRESS &&
           !o->workers[w].store_refused;
}

int kvm_orch__store_fault_counts(orch *o, int w, const char *why)
{
    if (strstr(why, "rejected this client's key") || strstr(why, "the security handshake failed")) return 1;
    /* no reply: w's fault only when the run asked the same service since and got an answer; a
     * run on a local store does not talk to the service it hosts, which may be stalled */
    return o->cli && ++o->workers[w].store_failures >= 2;
}

/* Sends store-refused worker w the error that stops it. */
static void tell(orch *o, int w)
{
    orch_worker *wk = &o->workers[w];
    char why[1400];
    snprintf(why, sizeof why,
             "this %s refuses this worker: its caches do not reach the run's store %s: %s; start it again with the "
             "run's store (--store, and the keys of the run's [security])",
             o->cmd, o->store_path, wk->store_why);
    wk->told_ms = kvm_stage_send_refusal(o->ctl, wk->id, o->cmd, why) == 0 ? kvm_now_ms() : 0;
}

void kvm_orch__store_refuse(orch *o, orch_job *j, int w, const char *why)
{
    orch_worker *wk = &o->workers[w];
    snprintf(wk->store_why, sizeof wk->store_why, "%s", why);
    wk->store_refused = 1;
    wk->store_refused_pid = wk->pid;
    wk->idle = 0;
    kvm_log_field f[] = {KVM_LOG_S("worker", wk->id), KVM_LOG_S("reason", why)};
    kvm_log(KVM_LOG_ERROR, "worker_refused", f, 2,
            "compress worker %s is refused, no more jobs go to it: its caches do not reach this %s's store (%s)",
            wk->id, o->cmd, why);
    tell(o, w);
    if (j) {
        j->attempt--; /* given back below, not used: the worker failed it, not the document */
        char msg[1400];
        snprintf(msg, sizeof msg, "worker %s is refused (%s)", wk->id, why);
        kvm_orch__requeue(o, j, msg);
    }
    wk->job = -1;
}

int kvm_orch__store_refused(orch *o, int w, const kvm_proto_ready *r, int first)
{
    orch_worker *wk = &o->workers[w];
    wk->pid = r->pid;
    if (!wk->store_refused) return 0;
    /* started again, perhaps with the right store: judged by its work. A control-socket ready is
     * a new process even under the refused pid (pid 1 of a restarted container): a stage sends
     * it once, at its start, and the refused process's came before the error or ack that got it
     * refused, on that same socket */
    if (first || r->pid != wk->store_refused_pid) {
        wk->store_refused = 0;
        wk->store_failures = 0;
        kvm_log(KVM_LOG_INFO, "worker_accepted", (kvm_log_field[]){KVM_LOG_S("worker", wk->id)}, 1,
                "worker %s, refused before (its caches did not reach the store), is a new process: accepted", wk->id);
        return 0;
    }
    if (kvm_stage_tell_again(wk->told_ms, kvm_now_ms())) tell(o, w);
    return 1;
}

/* Asks the run's store service whether j's cache is stored (its index entry: the service reads
 * no layers). Returns 0 with *stored, or the error (said by the caller). */
static int remote_stored(orch *o, const orch_job *j, int *stored)
{
    kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = j->doc->hash, .config_id = o->config_id};
    kvm_storecli_claim_state st;
    int rc =
        kvm_storecli_claim(o->cli, &key, &o->tok_id, o->owner, o->host, 0, KVM_STORECLI_PROBE | KVM_STORECLI_INDEX_ONLY,
                           kvm_orch_remote_timeout_ms(o->cfg), 1, &st, NULL);
    *stored = !rc && st == KVM_STORECLI_STORED;
    return rc;
}

int kvm_orch__store_answers(orch *o, const orch_job *j)
{
    int stored;
    if (!o->cli) return 1; /* a local store, checked (kvm_store_check_here) before this is asked */
    if (!remote_stored(o, j, &stored)) return 1;
    kvm_orch__log("the store service does not answer this run either (%s)\n", kvm_errmsg());
    return 0;
}

int kvm_orch__remote_ack_elsewhere(orch *o, orch_job *j, int w)
{
    int stored;
    if (!o->cli || !kvm_orch__store_fault_worker(o, w)) return 0;
    if (remote_stored(o, j, &stored)) { /* the service's commit reply stands: the summary probes again */
        kvm_orch__log("could not ask the store service whether %s is stored (%s): taken as the worker's ack says\n",
                      j->doc->name, kvm_errmsg());
        return 0;
    }
    if (stored) return 0;
    char why[600];
    snprintf(why, sizeof why,
             "%s was acked as committed, but the run's store service %s holds no cache of it: the worker uploads to "
             "another store (started with another --store?)",
             j->doc->name, o->store_path);
    kvm_orch__store_refuse(o, j, w, why);
    return 1;
}
