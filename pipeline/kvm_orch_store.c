/* kvm_orch_store.c: the orchestrator and the store: claims on documents (local LMDB or the
 * store service), skipping stored documents, renewing the claims, stopping when the store takes
 * no more caches, and the summary's sums of what was stored. */
#include "pipeline/kvm_orch_int.h"
#include "pipeline/kvm_cachecodec.h"
#include "pipeline/kvm_orch_remote.h"
#include "pipeline/kvm_rundir.h"
#include "pipeline/kvm_stage.h"
#include "pipeline/kvm_storew.h"
#include "common/kvm_log.h"
#include "common/kvm_error.h"
#include "common/kvm_number.h"
#include "model/kvm_utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The store takes no more caches: its device is full, its map reached [store] map_max_mb (no
 * later write can fit either: retrying each document would only fail again), or (a run whose
 * store is the store service) the service does not answer, so every upload and claim would
 * wait out its timeouts. Said once; no more documents are fed. */
static void store_mark(orch *o, const char *why, int kind)
{
    static const char *const what[6] = {
        "no space left on the store's device: feeding no more documents (free space on it and run again: stored ones "
        "are skipped)",
        "the store service does not answer: feeding no more documents (start it and run again: stored ones are "
        "skipped)",
        "the store's map is full at [store] map_max_mb: feeding no more documents (raise map_max_mb, or set [store] "
        "cap_mb so that old caches make room, and run again: stored ones are skipped)",
        "the file size limit (ulimit -f) stops the store's data.mdb from growing: feeding no more documents (raise "
        "it and run again: stored ones are skipped)",
        "the store is no longer the one this run opened: feeding no more documents (put the store back, or stop "
        "whatever replaced it, and run again: stored ones are skipped)",
        "the store's data.mdb is damaged: feeding no more documents (restore the store from a copy, or move it "
        "aside and run again: its documents are compressed again)"};
    if (!o->store_full) kvm_orch__log("%s\nkvmill %s: %s\n", why, o->cmd, what[kind]);
    o->store_full = 1;
    if (kind == STORE_DOWN || kind == STORE_GONE || kind == STORE_DAMAGED)
        o->sum->store_down = kind == STORE_DAMAGED ? 3 : kind == STORE_GONE ? 2 : 1;
    else
        o->sum->store_full = kind == STORE_MAP_FULL ? 2 : kind == STORE_FILE_LIMIT ? 3 : 1;
}

int kvm_orch__store_gone_check(orch *o)
{
    if (o->mode != MODE_RUN || o->cli || !o->store || o->store_full) return o->store_full;
    if (kvm_store_check_here(o->store)) store_mark(o, kvm_errmsg(), STORE_GONE);
    return o->store_full;
}

int kvm_orch__store_damaged(int rc, const char *why)
{
    return rc == KVM_ECORRUPT && strstr(why, "data.mdb is damaged");
}

int kvm_orch__store_gone_msg(const char *why)
{
    return strstr(why, "is gone since this process opened it") || strstr(why, "its lock.mdb was removed or replaced") ||
           strstr(why, "was replaced since this process opened it");
}

/* store_mark, and job j goes back to the queue (not an attempt: it is not the document's
 * fault). */
void kvm_orch__store_stop(orch *o, orch_job *j, const char *why, int kind)
{
    store_mark(o, why, kind);
    if (j->worker >= 0) o->workers[j->worker].job = -1;
    j->worker = -1;
    kvm_orch__job_drop_kv(j);
    kvm_orch__job_set(o, j, J_QUEUED);
}

/* The claims' renewals have had no reply for longer than the lease (a run whose store is the
 * store service): the claims have lapsed and the uploads of the jobs in workers would each wait
 * out 3 x [store] upload_timeout_ms, so the store is down now. The jobs in workers are
 * abandoned (counted not processed; their workers are stopped at the end without the grace
 * period) and no more documents are fed. */
static void store_abandon(orch *o, const char *why, int kind)
{
    store_mark(o, why, kind);
    const orch_job_state busy[2] = {J_PREFILL, J_COMPRESS};
    for (int b = 0; b < 2; b++)
        for (int64_t i = kvm_joblist_first(&o->lists, busy[b]), next; i >= 0; i = next) {
            next = kvm_joblist_next(&o->lists, i);
            o->visited++;
            kvm_orch__store_stop(o, &o->jobs[i], why, kind);
            o->abandoned++;
        }
}

int64_t kvm_orch__claim_ttl(const orch *o)
{
    int64_t ttl = (int64_t)o->dead_ms;
    return ttl > KVM_STORE_CLAIM_MAX_TTL_MS ? KVM_STORE_CLAIM_MAX_TTL_MS : ttl;
}

/* When a claim expiring at `expires` (unix ms; 0: not known) lapses unless renewed, for the
 * log: "its claim lapses at 2026-12-07 05:00:00 UTC (in 42 s) unless renewed", into out[n].
 * Through a store service the time is the service's clock, so the seconds are off by the two
 * hosts' clock difference. */
static const char *lapse_text(const orch *o, int64_t expires, char *out, size_t n)
{
    if (expires <= 0) {
        snprintf(out, n,
                 "the store service does not say when its claim lapses (a service older than protocol "
                 "revision 12)");
        return out;
    }
    time_t t = (time_t)(expires / 1000);
    struct tm tm;
    char when[40] = "?";
    if (gmtime_r(&t, &tm)) strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
    const int64_t in_s = (expires - (int64_t)time(NULL) * 1000) / 1000;
    const char *clock = o->cli ? " by the store service's clock" : "";
    if (in_s >= 0)
        snprintf(out, n, "its claim lapses at %s%s (in %lld s) unless renewed", when, clock, (long long)in_s);
    else /* the service's clock may run behind this host's */
        snprintf(out, n, "its claim lapsed at %s%s (%lld s ago%s)", when, clock, (long long)-in_s,
                 o->cli ? " by this host's clock, unless the service's runs behind" : "");
    return out;
}

/* The claim through the store service: its reply says taken, held (by holder, with its expiry
 * from a revision-12 service) or stored. recheck: a recheck of a document left to another run
 * (kvm_orch__recheck_left), which waits a quarter of the timeout, once, as a renewal does (the
 * loop waits on it, and a service that does not answer is found down by the renewals), and asks
 * the service to judge "stored" by the index entry alone: reading and checksumming a large cache
 * the other run just stored could outlast that wait at every look, for ever. */
static int claim_remote(orch *o, const kvm_store_cache_key *key, int recheck, int *taken, int *found,
                        kvm_store_claim *holder)
{
    kvm_storecli_claim_state st;
    kvm_storecli_claim_info info;
    const int timeout = kvm_orch_remote_timeout_ms(o->cfg);
    int rc = kvm_storecli_claim(o->cli, key, &o->tok_id, o->owner, o->host, kvm_orch__claim_ttl(o),
                                recheck ? KVM_STORECLI_INDEX_ONLY : 0, recheck ? timeout / 4 : timeout, recheck ? 1 : 2,
                                &st, &info);
    if (rc) return rc;
    *taken = st == KVM_STORECLI_TAKEN;
    *found = st == KVM_STORECLI_STORED;
    *holder = info.holder;
    return 0;
}

/* 1 when claim holder h is a run of this machine (kvm_storew_owner's
 * "run:HOST:PID:START_MS:ID", ID naming the kernel boot and pid namespace, kvm_rundir_proc_id)
 * whose process is gone (killed with kill -9, crashed: it released nothing, and its lease of
 * [run] heartbeat_ms x liveness, at most 24 h, has not lapsed yet), or whose pid now belongs to another
 * process. A holder on another host, in another container or boot, an owner without an ID (an
 * earlier version's) or of another shape, or this very process: 0, the lease rule. */
static int holder_gone(const orch *o, const kvm_store_claim *h)
{
    /* never this very run (a killed earlier run whose pid this one reuses is gone) */
    return strcmp(h->host, o->host) == 0 && strcmp(h->owner, o->owner) && kvm_storew_owner_gone(h->owner, h->host);
}

/* Owners of claims held by runs of this host that are gone (holder_gone), each once, for
 * kvm_orch__release_dead. */
typedef struct dead_owners {
    const orch *o;
    char owner[8][128];
    int n;
} dead_owners;

static int collect_dead(const kvm_store_cache_key *key, const kvm_store_claim *c, void *arg)
{
    dead_owners *d = arg;
    for (int i = 0; i < d->n; i++)
        if (!strcmp(d->owner[i], c->owner)) return 0;
    if (d->n < 8 && holder_gone(d->o, c)) snprintf(d->owner[d->n++], sizeof d->owner[0], "%s", c->owner);
    return 0;
}

void kvm_orch__release_dead(orch *o)
{
    if (!o->store || o->mode != MODE_RUN) return;
    dead_owners d = {.o = o};
    if (kvm_store_list_claims(o->store, collect_dead, &d)) return; /* a tidy-up: its failure is no run's */
    int64_t total = 0;
    for (int i = 0; i < d.n; i++) {
        int64_t n = 0;
        if (!kvm_store_claim_release(o->store, d.owner[i], &n)) total += n;
    }
    if (total)
        kvm_orch__log("released %lld claim%s left by %d run%s of this host that %s gone\n", (long long)total,
                      kvm_plural(total, "", "s"), d.n, kvm_plural(d.n, "", "s"), d.n == 1 ? "is" : "are");
}

/* The claim on key, held by a dead run of this host (holder_gone), is taken over: that run's
 * claims are released (all of them: it renews none any more) and key is claimed again.
 * recheck: as claim_remote's (the same short waits). */
static int take_over(orch *o, const kvm_store_cache_key *key, const orch_job *j, int recheck, int *taken, int *found,
                     kvm_store_claim *holder)
{
    const int timeout = kvm_orch_remote_timeout_ms(o->cfg);
    kvm_orch__log("%s is claimed by run %s on this host, which is no longer running: taking it over (and the "
                  "run's other claims)\n",
                  j->doc->name, holder->owner);
    char dead[sizeof holder->owner];
    snprintf(dead, sizeof dead, "%s", holder->owner);
    int rc = o->cli ? kvm_storecli_renew(o->cli, dead, 0, 1, recheck ? timeout / 4 : timeout, recheck ? 1 : 2, NULL)
                    : kvm_storew_release(o->store, dead);
    if (rc) return rc;
    return o->cli ? claim_remote(o, key, recheck, taken, found, holder)
                  : kvm_storew_claim(o->store, key, o->owner, o->host, kvm_orch__claim_ttl(o), taken, holder);
}

static int cache_stored(orch *o, kvm_store *store, const orch_job *j, int *found);

/* Claims key (j's) for this run, taking it over from a dead run of this host (holder_gone).
 * recheck: as claim_remote's. */
static int claim_key(orch *o, const kvm_store_cache_key *key, const orch_job *j, int recheck, int *taken, int *found,
                     kvm_store_claim *holder)
{
    int rc = o->cli ? claim_remote(o, key, recheck, taken, found, holder)
                    : kvm_storew_claim(o->store, key, o->owner, o->host, kvm_orch__claim_ttl(o), taken, holder);
    if (!rc && !*taken && !*found && holder_gone(o, holder)) rc = take_over(o, key, j, recheck, taken, found, holder);
    return rc;
}

/* Watches job j, left to another run whose claim expires at `expires` (unix ms; by the
 * service's clock through a store service: only compared with later replies of the same
 * service), for kvm_orch__recheck_left. A store service older than protocol revision 12 sends
 * no expiry (expires 0: a renewal cannot be seen), so there the document stays counted as
 * claimed, as the run found it. Out of memory: not watched. */
static void watch_left(orch *o, orch_job *j, int64_t expires)
{
    if (o->cli && expires <= 0) return;
    if (o->n_left == o->cap_left) {
        int64_t cap = o->cap_left ? 2 * o->cap_left : 64;
        int64_t *p = realloc(o->left_idx, (size_t)cap * sizeof *p);
        if (!p) return;
        o->left_idx = p;
        o->cap_left = cap;
    }
    o->left_idx[o->n_left++] = j - o->jobs;
    o->left_watch++;
    j->left = 1;
    j->left_expires = expires;
    j->left_renewed = 0;
}

/* A document another live run is compressing is left to it (counted as claimed, rechecked:
 * kvm_orch__recheck_left) and one stored meanwhile is skipped; one claimed by a dead run of this
 * host is taken over; else this run claims it (a lease renewed in the loop). Returns 1 when j is
 * not to be sent. */
int kvm_orch__claim_job(orch *o, orch_job *j)
{
    if (j->claimed || (!o->store && !o->cli) || o->mode != MODE_RUN) return 0;
    kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = j->doc->hash, .config_id = o->config_id};
    kvm_store_claim holder;
    int taken = 0, found = 0;
    int rc = claim_key(o, &key, j, 0, &taken, &found, &holder);
    if (rc == KVM_EIO && o->cli) { /* no reply: its upload would get none either */
        kvm_orch__store_stop(o, j, kvm_errmsg(), STORE_DOWN);
        return 1;
    }
    if (rc == KVM_ESTATE && !o->cli && kvm_orch__store_gone_msg(kvm_errmsg())) { /* nothing can be stored */
        kvm_orch__store_stop(o, j, kvm_errmsg(), STORE_GONE);
        return 1;
    }
    if (kvm_orch__store_damaged(rc, kvm_errmsg())) { /* "compressing it anyway" only to fail each upload */
        kvm_orch__store_stop(o, j, kvm_errmsg(), STORE_DAMAGED);
        return 1;
    }
    if (rc) {
        kvm_orch__log("could not claim %s (%s): compressing it anyway\n", j->doc->name, kvm_errmsg());
        taken = 1;
        found = 0;
    }
    if (!o->cli && kvm_store_has_cache(o->store, &key, &o->tok_id, &found)) found = 0;
    if (!o->cli && found) { /* stored: only when its layers pass their checksums and decode to finite
                             * keys and values, as in cache_stored (a corrupt cache found before the
                             * run would be skipped here otherwise) */
        kvm_store_cache *c = NULL;
        if (kvm_store_get_cache(o->store, &key, &o->tok_id, &c) || kvm_cachecodec_check_stored(c)) found = 0;
        kvm_store_cache_free(&c);
    }
    if (found || !taken) {
        char lapse[200];
        if (!found)
            kvm_orch__log("%s is being compressed by %s on %s: left to it (%s)\n", j->doc->name, holder.owner,
                          holder.host, lapse_text(o, holder.expires_unix_ms, lapse, sizeof lapse));
        kvm_orch__job_move(o, j, J_SKIPPED);
        o->n_open--;
        if (found)
            o->sum->skipped++;
        else {
            o->sum->claimed++;
            watch_left(o, j, holder.expires_unix_ms);
        }
        return 1;
    }
    j->claimed = 1;
    return 0;
}

/* Job j, left to another run, is no longer: stored (skipped), taken (queued here again) or its
 * recheck failed (failed, with that reason: it is not known to be stored). */
static void left_resolved(orch *o, orch_job *j, int stored, const char *err)
{
    j->left = 0;
    o->sum->claimed--;
    if (!j->left_live) o->left_watch--;
    if (stored) {
        o->sum->skipped++;
        kvm_orch__log("%s, left to another run, is stored now\n", j->doc->name);
    } else if (err) {
        snprintf(j->reason, sizeof j->reason, "left to another run, and its claim could not be checked again: %s", err);
        kvm_orch__job_move(o, j, J_FAILED);
        kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_S("reason", j->reason)};
        kvm_log(KVM_LOG_ERROR, "job_failed", f, 2, "%s failed: %s", j->doc->name, j->reason);
    } else {
        kvm_orch__log("%s was left to another run, whose claim lapsed unrenewed or whose process is gone: "
                      "compressing it here\n",
                      j->doc->name);
        j->claimed = 1;
        o->n_open++;
        kvm_orch__job_set(o, j, J_QUEUED);
    }
}

/* One recheck of job j, left to another run (kvm_orch__recheck_left). ending: this run's own
 * jobs are done, so a renewal of the claim makes j the live run's for good. Through a store
 * service one claim answers it all (the service looks for the stored cache first). Returns 1
 * when the store service did not answer: the pass stops (each further recheck would wait out
 * its timeout too) and j stays watched; the renewals find the service down. */
static int recheck_one(orch *o, orch_job *j, int ending)
{
    kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = j->doc->hash, .config_id = o->config_id};
    kvm_store_claim h;
    int found = 0, taken = 0, rc = 0;
    /* the index entry only (the other run checked what it wrote): reading and checksumming the
     * layers would cost the loop a cache's bytes per document */
    if (!o->cli) rc = kvm_store_has_cache(o->store, &key, &o->tok_id, &found);
    if (rc == KVM_EMISMATCH) rc = 0, found = 0; /* another tokenizer's: compressed again here */
    if (!rc && !found) rc = claim_key(o, &key, j, 1, &taken, &found, &h);
    if (rc == KVM_EIO && o->cli) {
        if (!o->recheck_failing)
            kvm_orch__log("%s, left to another run, could not be looked at again: %s (tried again at the next look; "
                          "said once until a look gets a reply)\n",
                          j->doc->name, kvm_errmsg());
        o->recheck_failing = 1;
        return 1;
    }
    o->recheck_failing = 0;
    /* taken: stored between the two looks (the other run ended and released its claims)? */
    if (!rc && taken && !o->cli && kvm_store_has_cache(o->store, &key, &o->tok_id, &found)) found = 0;
    if (rc && !ending) return 0; /* tried again at the next recheck; at the end, not known stored: failed */
    if (rc || found || taken) {
        left_resolved(o, j, found, rc ? kvm_errmsg() : NULL);
        return 0;
    }
    if (h.expires_unix_ms == j->left_expires) return 0; /* not renewed since: watched until it lapses */
    j->left_expires = h.expires_unix_ms;
    j->left_renewed = 1;
    if (!ending || j->left_live) return 0;
    j->left_live = 1;
    o->left_watch--;
    kvm_orch__log("%s is left to %s on %s, a run which renews its claim: that run stores it\n", j->doc->name, h.owner,
                  h.host);
    return 0;
}

#define RECHECK_PASS_MS 50.0
#define WAIT_NAMED 5 /* documents the wait names, each with its claim's lapse */

/* Once the run's own jobs are done: which documents it waits for, and how long at most: the
 * first WAIT_NAMED, each with when its claim lapses unless renewed (the run takes it over then)
 * and whether its run renewed it since this run left it (a renewal now leaves it to that run). */
static void say_wait(orch *o)
{
    kvm_orch__log("waiting for the %lld document%s left to other runs: stored by them, taken over when a claim "
                  "lapses unrenewed or its run is gone, or left to a run that renews its claim\n",
                  (long long)o->left_watch, kvm_plural(o->left_watch, "", "s"));
    int64_t named = 0;
    for (int64_t i = 0; i < o->n_left && named < WAIT_NAMED; i++) {
        const orch_job *j = &o->jobs[o->left_idx[i]];
        if (!j->left || j->left_live) continue;
        char lapse[200];
        kvm_orch__log("  %s: %s; %s since this run left it\n", j->doc->name,
                      lapse_text(o, j->left_expires, lapse, sizeof lapse), j->left_renewed ? "renewed" : "not renewed");
        named++;
    }
    if (o->left_watch > named) kvm_orch__log("  and %lld more\n", (long long)(o->left_watch - named));
    if (o->store) /* a stuck claim (a run killed elsewhere) need not be waited out */
        kvm_orch__log("  (kvmill store claims --store %s lists the claims; --release OWNER removes a stuck one)\n",
                      o->store_path);
}

void kvm_orch__recheck_left(orch *o, double t0)
{
    const int ending = o->n_open == 0;
    const double quarter = (double)kvm_orch__claim_ttl(o) / 4;
    double every = ending ? 250 : quarter > 1000 ? quarter : 1000;
    if (o->left_watch <= 0 || t0 - o->left_checked < every || *o->interrupts || o->store_full)
        return; /* draining: nothing new is sent, so nothing is taken over */
    o->left_checked = t0;
    if (ending && !o->left_ending) say_wait(o);
    o->left_ending = ending;
    /* a pass spends at most RECHECK_PASS_MS (a round trip each through a store service: many
     * left documents would hold the loop), going on where the last one stopped */
    const int64_t n = o->n_left, from = n ? o->left_next % n : 0;
    const double start = kvm_now_ms(); /* t0 came before this event's receive and dispatch */
    int64_t k = 0, next = 0, kept = 0;
    for (int stop = 0; k < n && !stop && !*o->interrupts; k++) {
        orch_job *j = &o->jobs[o->left_idx[(from + k) % n]];
        o->visited++;
        if (j->left && !j->left_live) stop = recheck_one(o, j, ending) || kvm_now_ms() - start > RECHECK_PASS_MS;
    }
    for (int64_t i = 0; i < n; i++) { /* the list keeps the jobs still watched, in order */
        orch_job *j = &o->jobs[o->left_idx[i]];
        if (i == (from + k) % n) next = kept; /* the first not rechecked in this pass */
        if (j->left && !j->left_live) o->left_idx[kept++] = o->left_idx[i];
    }
    o->n_left = kept;
    o->left_next = next;
}

/* The claims live while the jobs do: renewed every quarter of their lease (kvm_orch__claim_ttl; t0: now,
 * ms). A store service that answered no renewal for longer than the lease has let them lapse:
 * it is down (store_abandon). */
void kvm_orch__renew_claims(orch *o, double t0)
{
    const int64_t ttl = kvm_orch__claim_ttl(o);
    if (!o->owner[0] || t0 - o->last_renew <= (double)ttl / 4) return;
    int rr = o->cli ? kvm_storecli_renew(o->cli, o->owner, ttl, 0, kvm_orch_remote_timeout_ms(o->cfg) / 4, 1, NULL)
                    : kvm_storew_renew(o->store, o->owner, ttl);
    if (rr && !o->renew_failing)
        kvm_orch__log("%s (said once until a renewal succeeds)\n", kvm_errmsg());
    else if (!rr && o->renew_failing)
        kvm_orch__log("claims renewed again\n");
    o->renew_failing = rr != 0; /* one line per outage, not one per try (every heartbeat_ms x liveness / 4) */
    o->last_renew = t0;
    if (kvm_orch__store_damaged(rr, kvm_errmsg())) /* it answers: "does not answer" misled */
        store_abandon(o, kvm_errmsg(), STORE_DAMAGED);
    else if (!rr)
        o->renewed_ok = t0;
    else if (o->cli && t0 - o->renewed_ok > (double)ttl) { /* the claims have lapsed: so has the service */
        char why[600];
        snprintf(why, sizeof why,
                 "the store service %s answered no renewal of the claims for %.1f s, more "
                 "than their lease ([run] heartbeat_ms x liveness, at most 24 h)",
                 o->store_path, (t0 - o->renewed_ok) / 1000.0);
        store_abandon(o, why, STORE_DOWN);
    }
}

/* A document hash looked up in o->by_hash. */
typedef struct hash_probe {
    const orch *o;
    const kvm_store_id *hash;
} hash_probe;

static int same_hash(void *user, int64_t idx)
{
    const hash_probe *p = user;
    return !memcmp(&p->o->jobs[idx].doc->hash, p->hash, sizeof *p->hash);
}

static uint64_t hash_key(const kvm_store_id *h)
{
    uint64_t k;
    memcpy(&k, h->b, sizeof k); /* BLAKE2b bytes: any 8 are uniform */
    return k;
}

int kvm_orch__sum_bytes(const kvm_store_cache_key *key, const kvm_store_manifest *m, int status, void *arg)
{
    orch *o = arg;
    if (status || memcmp(&key->model_id, &o->model_id, sizeof o->model_id) ||
        memcmp(&key->config_id, &o->config_id, sizeof o->config_id))
        return 0;
    hash_probe p = {o, &key->doc_hash};
    int64_t i = kvm_idxset_find(&o->by_hash, hash_key(&key->doc_hash), same_hash, &p); /* only the first is done */
    if (i >= 0 && o->jobs[i].state == J_DONE) {
        o->sum->bytes_full += m->full_bytes;
        o->sum->bytes_compressed += m->stored_bytes;
        if (!o->sum->entries_docs || m->n_entries < o->sum->entries_min) o->sum->entries_min = m->n_entries;
        if (!o->sum->entries_docs || m->n_entries > o->sum->entries_max) o->sum->entries_max = m->n_entries;
        o->sum->entries_sum += m->n_entries;
        o->sum->entries_docs++;
        if (o->kv_heads > 0 && m->n_entries >= m->n_tokens * o->kv_heads) o->sum->kept_full++;
    }
    return 0;
}

/* Whether a document's cache is stored: a stored cache (or manifest) that fails its
 * checksums, or whose layers do not decode to finite keys and values, is a corrupt cache,
 * compressed again (the put replaces it). */
static int cache_stored(orch *o, kvm_store *store, const orch_job *j, int *found)
{
    kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = j->doc->hash, .config_id = o->config_id};
    if (o->cli) { /* the service applies the same rule (kvm_storesvc_claim.h) */
        kvm_storecli_claim_state st;
        int rc = kvm_storecli_claim(o->cli, &key, &o->tok_id, o->owner, o->host, 0, KVM_STORECLI_PROBE,
                                    kvm_orch_remote_timeout_ms(o->cfg), 2, &st, NULL);
        *found = !rc && st == KVM_STORECLI_STORED;
        return rc;
    }
    int rc = kvm_store_has_cache(store, &key, &o->tok_id, found);
    if (rc == KVM_EMISMATCH) { /* made from another tokenizer's ids: compressed again (the put replaces it) */
        kvm_orch__log("the stored cache of %s is refused (%s): compressing it again\n", j->doc->name, kvm_errmsg());
        *found = 0;
        return 0;
    }
    if (rc == 0 && *found) { /* layers that pass their checksums but hold NaN/inf: every ask refuses them */
        kvm_store_cache *c = NULL;
        rc = kvm_store_get_cache(store, &key, &o->tok_id, &c);
        if (rc == 0) rc = kvm_cachecodec_check_stored(c);
        kvm_store_cache_free(&c);
    }
    if (rc == KVM_ECORRUPT && !kvm_orch__store_damaged(rc, kvm_errmsg())) {
        kvm_orch__log("the stored cache of %s is corrupt (%s): compressing it again\n", j->doc->name, kvm_errmsg());
        *found = 0;
        return 0;
    }
    return rc == KVM_EMISMATCH ? 0 : rc;
}

int kvm_orch__stored_now(orch *o, const orch_job *j)
{
    int found = 0;
    if ((!o->store && !o->cli) || cache_stored(o, o->store, j, &found)) return 0;
    return found;
}

void kvm_orch__note_evictions(orch *o, orch_job *j)
{
    kvm_store_stats ss;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* the store's clock for access times */
    j->sent_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    if (o->mode == MODE_RUN && o->store && !kvm_store_stats_get(o->store, &ss)) j->evicted_at_send = ss.n_evicted;
}

/* 1 when the local store's cap evicted caches since j went to compress (said): its cache,
 * acked but missing, may be one of them, not written elsewhere. Counted from j's own send, not
 * from the last ack: acks of caches committed in another order would take the evictions. Not
 * when a cache last served before j was sent is still there: the cap evicts the least recently
 * served first, so it would have gone before j's (a worker writing to another store hid behind
 * the evictions of a capped store, its documents counted compressed). */
static int evicted_since(orch *o, const orch_job *j)
{
    kvm_store_stats ss;
    if (kvm_store_stats_get(o->store, &ss)) return 0;
    const int64_t n = ss.n_evicted - j->evicted_at_send;
    if (n <= 0 || (ss.oldest_served_ns && ss.oldest_served_ns < j->sent_ns)) return 0;
    kvm_orch__log("%s is acked but not in the store: its cap ([store] cap_mb) evicted %lld cache%s since it went to "
                  "compress, this one likely among them: counted compressed (raise cap_mb)\n",
                  j->doc->name, (long long)n, kvm_plural(n, "", "s"));
    return 1;
}

void kvm_orch__ack_stored(orch *o, orch_job *j, int w)
{
    int found = 0;
    /* a store service: the ack is its commit reply, passed on (a lookup there would read and
     * checksum the cache on the single-threaded service, the loop waiting for the round trip) */
    if (o->mode != MODE_RUN || !o->store) {
        if (!kvm_orch__remote_ack_elsewhere(o, j, w))
            kvm_orch__job_committed(o, j);
        else
            o->sum->store_commits--; /* counted at the ack: no commit into the run's store */
        return;
    }
    kvm_store_cache_key key = {.model_id = o->model_id, .doc_hash = j->doc->hash, .config_id = o->config_id};
    /* locally its index entry only: reading and checksumming the layers just written, as
     * cache_stored does, would cost the event loop a cache's bytes per document */
    int rc = kvm_store_has_cache(o->store, &key, &o->tok_id, &found);
    if (!rc && (found || evicted_since(o, j))) {
        kvm_orch__job_committed(o, j);
        return;
    }
    char why[1200];
    if (!rc) o->sum->store_commits--; /* counted at the ack: no commit into the run's store */
    if (!rc && kvm_orch__store_fault_worker(o, w)) {
        snprintf(why, sizeof why,
                 "%s was acked as committed, but the run's store %s holds no cache of it: the worker writes to another "
                 "store (started with another --store?)",
                 j->doc->name, o->store_path);
        kvm_orch__store_refuse(o, j, w, why);
        return;
    }
    if (rc)
        snprintf(why, sizeof why, "worker %s acked it, but the run's store %s could not be read to check: %s",
                 o->workers[w].id, o->store_path, kvm_errmsg());
    else
        snprintf(why, sizeof why,
                 "worker %s acked it as committed, but the run's store %s holds no cache of it: the worker writes to "
                 "another store (started with another --store?)",
                 o->workers[w].id, o->store_path);
    kvm_orch__requeue(o, j, why);
}

void kvm_orch__failed_but_stored(orch *o, kvm_store *store)
{
    if (o->mode != MODE_RUN || (!store && !o->cli) || o->sum->store_down) return;
    for (int64_t i = kvm_joblist_first(&o->lists, J_FAILED), next; i >= 0; i = next) {
        next = kvm_joblist_next(&o->lists, i);
        orch_job *j = &o->jobs[i];
        int found = 0;
        if (!j->claimed || cache_stored(o, store, j, &found) || !found) continue; /* never sent: not ours */
        kvm_log_field f[] = {KVM_LOG_S("doc", j->doc->name), KVM_LOG_I("job_id", j->id),
                             KVM_LOG_S("reason", j->reason)};
        kvm_log(KVM_LOG_INFO, "job_done", f, 3,
                "%s failed (%s), yet its cache is in the store, committed by an earlier attempt: counted compressed",
                j->doc->name, j->reason);
        kvm_orch__job_committed(o, j);
    }
}

/* A document skipped because its cache is stored gets its corpus name recorded (the docs record
 * the compress stage writes) when the store has none for it: a cache first stored without one
 * (kvmill serve --compute-missing knows only the text) left `store ls --names` at "-" and
 * `ask --doc-name` without the document, however often runs over the corpus skipped it. The
 * name as the compress stage would record it: what the job carries on the wire (valid UTF-8,
 * cut at KVM_PROTO_MAX_NAME_BYTES), its first 255 bytes. Local store only: the store service's
 * protocol carries a name only with a cache upload (put_cache), not with a claim or probe.
 * Best effort, as the compress stage's record: a failure is said, the run goes on. */
static void record_name(orch *o, kvm_store *store, const orch_job *j)
{
    kvm_store_doc_meta dm;
    if (!store || !j->doc->name || !*j->doc->name) return;
    int rc = kvm_store_get_doc(store, &j->doc->hash, &dm);
    if (rc != KVM_ENOTFOUND) return; /* named already (or unreadable: verify says so) */
    char *wire = NULL;
    size_t wn = 0;
    rc = kvm_utf8_sanitize(j->doc->name, strlen(j->doc->name), &wire, &wn, NULL);
    if (!rc) {
        wn = kvm_utf8_cut(wire, wn, KVM_PROTO_MAX_NAME_BYTES);
        dm = (kvm_store_doc_meta){.n_tokens = j->doc->n_tokens};
        kvm_store_doc_set_source(&dm, wire, wn);
        rc = kvm_store_put_doc(store, &j->doc->hash, &dm);
    }
    free(wire);
    if (rc) kvm_orch__log("could not record the name of %s, stored without one: %s\n", j->doc->name, kvm_errmsg());
}

/* Before the run: each document is loaded (tokenised, hashed) one at a time and released
 * again, so the scan holds no corpus; stored and repeated ones are skipped, unreadable
 * ones fail alone. */
int kvm_orch__mark_skipped(orch *o, kvm_store *store)
{
    for (int64_t i = 0; i < o->n_jobs; i++) {
        orch_job *j = &o->jobs[i];
        if (kvm_orch__job_load(o, j)) continue;
        int found = 0, rc = cache_stored(o, store, j, &found);
        if (rc) return rc;
        if (found) record_name(o, store, j);
        hash_probe p = {o, &j->doc->hash}; /* the same tokens twice: one cache (a loaded job is never failed here) */
        int64_t first = kvm_idxset_find(&o->by_hash, hash_key(&j->doc->hash), same_hash, &p);
        if (first >= 0) { /* the store keeps the first one's name only: said, so --doc-name is not a surprise */
            found = 1;
            /* one line each for the first ones: a JSONL corpus of repeated rows would flood the log
             * (the start line counts them all) */
            if (++o->repeated <= 20)
                kvm_orch__log("%s is a duplicate of %s within this corpus (the same tokens): one cache, stored under "
                              "the name %s only (kvmill ask --doc-name %s)\n",
                              j->doc->name, o->jobs[first].doc->name, o->jobs[first].doc->name,
                              o->jobs[first].doc->name);
            else if (o->repeated == 21)
                kvm_orch__log("further duplicates within this corpus are counted, not named\n");
        } else if ((rc = kvm_idxset_add(&o->by_hash, hash_key(&j->doc->hash), i)))
            return rc;
        if (o->corpus->on_demand) kvm_doc_release(j->doc);
        if (found) {
            kvm_orch__job_move(o, j, J_SKIPPED);
            o->sum->skipped++;
            o->n_open--;
        }
    }
    return 0;
}

/* Caches the store's cap evicted during the run (by any process), and a warning when some
 * of them were written by this run: a rerun would compress them again. */
void kvm_orch__count_evictions(orch *o, kvm_store *store)
{
    kvm_store_stats ss;
    if (kvm_store_stats_get(store, &ss)) return;
    o->sum->evicted = ss.n_evicted - o->evicted0;
    int64_t own = 0, written = 0;
    for (int64_t i = 0; i < o->n_jobs && o->sum->evicted > 0; i++) {
        if (o->jobs[i].state != J_DONE) continue;
        kvm_store_cache_key key = {
            .model_id = o->model_id, .doc_hash = o->jobs[i].doc->hash, .config_id = o->config_id};
        int found = 1;
        written++;
        if (kvm_store_has_cache(store, &key, &o->tok_id, &found) == 0 && !found) own++;
    }
    o->sum->evicted_own = own;
    if (own > 0)
        kvm_orch__log(
            "warning: the store's cap ([store] cap_mb = %lld) evicted %lld of the %lld caches this run wrote; "
            "raise cap_mb, or every rerun compresses them again\n",
            (long long)(ss.cap_bytes >> 20), (long long)own, (long long)written);
}

/* The summary's bytes with a remote store: each cache this run wrote, probed on the
 * service (its manifest's sizes). One that is gone was evicted by the store's cap; the
 * store's own eviction counter is not on the wire, so evicted counts this run's only.
 * Returns 1 when the service did not answer (said). */
int kvm_orch__sum_remote(orch *o)
{
    for (int64_t i = 0; i < o->n_jobs; i++) {
        if (o->jobs[i].state != J_DONE) continue;
        kvm_store_cache_key key = {
            .model_id = o->model_id, .doc_hash = o->jobs[i].doc->hash, .config_id = o->config_id};
        kvm_storecli_claim_state st;
        kvm_storecli_claim_info info;
        if (kvm_storecli_claim(o->cli, &key, &o->tok_id, o->owner, o->host, 0, KVM_STORECLI_PROBE,
                               kvm_orch_remote_timeout_ms(o->cfg), 1, &st, &info)) {
            kvm_orch__log("could not read the stored sizes: %s\n", kvm_errmsg());
            return 1;
        }
        if (st == KVM_STORECLI_STORED)
            o->sum->bytes_full += info.full_bytes, o->sum->bytes_compressed += info.stored_bytes;
        else
            o->sum->evicted++, o->sum->evicted_own++;
    }
    return 0;
}
