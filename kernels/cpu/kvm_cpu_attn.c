/* kvm_cpu_attn.c: one layer's attention (every query head, GQA) over a ragged,
 * position-sorted KV cache on the CPU, with the statistics compression reads
 * (kvm_attn_layer). Each KV head's K and V are packed once per call into GEMM panels;
 * (query head, block of 64 queries) tiles then run on the CPU pool, each touching only the
 * prefix of entries visible to its last query, so causal prefill does about half the work
 * of a dense N x N pass. A tile's scores live in a 64 x n_e scratch of the thread running
 * it: no N x N matrix is ever held. Statistics are reduced from the tile's probability rows
 * before it is reused; the received mass sums queries in order, so with MASS asked each task
 * is one query head (its blocks in order), which keeps the sums bit-identical to the
 * per-query accumulation the capture did before. An f16 cache (kv_dtype) is widened into the
 * float32 panels as it is packed, and read widened by the direct decode products: the
 * same operations as on float32 entries holding the widened values, so the results are bit
 * for bit those (tests/check_kv16.c). */
#include "kernels/cpu/kvm_cpu.h"
#include "kernels/cpu/kvm_cpu_attn_f16c.h"
#include "kernels/cpu/kvm_cpu_attn_rows.h"
#include "kernels/cpu/kvm_cpu_gemm.h"
#include "kernels/cpu/kvm_cpu_pool.h"
#include "common/kvm_error.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Per-thread scratch (grown, never shrunk), freed by a thread-specific destructor when the
 * thread exits (stage job threads come and go): the calling thread's packed K/V per KV
 * head, and the score tile of whichever thread runs a task. */
typedef struct attn_scratch {
    kvm_cpu_packed *k, *v; /* [n_packed] */
    int n_packed;
    float *tile;      /* [KVM_ATTN_QBLOCK][tile_ld] */
    size_t tile_cap;  /* floats */
} attn_scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p)
{
    attn_scratch *s = p;
    for (int g = 0; g < s->n_packed; g++) {
        kvm__cpu_packed_free(&s->k[g]);
        kvm__cpu_packed_free(&s->v[g]);
    }
    free(s->k);
    free(s->v);
    free(s->tile);
    free(s);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static attn_scratch *scratch_get(void)
{
    pthread_once(&scratch_once, scratch_init);
    attn_scratch *s = pthread_getspecific(scratch_key);
    if (!s && (s = calloc(1, sizeof *s)) && pthread_setspecific(scratch_key, s)) {
        free(s);
        s = NULL;
    }
    return s;
}

/* Room for n KV heads' packed K and V in s. */
static int scratch_heads(attn_scratch *s, int n)
{
    if (n <= s->n_packed) return 0;
    kvm_cpu_packed *k = realloc(s->k, (size_t)n * sizeof *k);
    if (!k) return kvm_err(KVM_ENOMEM, "attention: out of memory");
    s->k = k;
    kvm_cpu_packed *v = realloc(s->v, (size_t)n * sizeof *v);
    if (!v) return kvm_err(KVM_ENOMEM, "attention: out of memory");
    s->v = v;
    memset(s->k + s->n_packed, 0, (size_t)(n - s->n_packed) * sizeof *k);
    memset(s->v + s->n_packed, 0, (size_t)(n - s->n_packed) * sizeof *v);
    s->n_packed = n;
    return 0;
}

/* The running thread's score tile of at least n floats, or NULL. */
static float *tile_get(size_t n)
{
    attn_scratch *s = scratch_get();
    if (!s) return NULL;
    if (n > s->tile_cap) {
        float *t = realloc(s->tile, n * sizeof *t);
        if (!t) return NULL;
        s->tile = t;
        s->tile_cap = n;
    }
    return s->tile;
}

typedef struct attn_job {
    const kvm_attn_layer *a;
    const kvm_cpu_packed *k, *v; /* [n_kv_heads]; unused on the direct (decode) path */
    const float **bias;          /* [n_kv_heads]: a->bias[g], or NULL when all zero */
    int grp;                     /* query heads per KV head */
    int64_t blocks;              /* query blocks per head */
    int64_t tile_ld;             /* floats per tile row */
    int normalize;               /* probabilities normalised before PV (a probability statistic asked) */
    int per_head;                /* one task per query head (MASS asked) */
    int chunks;                  /* direct path: tasks per KV head */
    int32_t m0, m1;              /* MASS window of positions */
    atomic_int rc;               /* first failure of a task (scratch), 0 if none */
} attn_job;

/* The statistics of query i of head h from its probability row p[0, e_end) (zeros past the
 * visible prefix), lse its log-normaliser and ent its entropy (both from the softmax pass). */
static void row_stats(const attn_job *j, int h, int64_t i, const float *p, int64_t e_end, float lse, float ent)
{
    const kvm_attn_layer *a = j->a;
    const unsigned st = a->stats;
    if (st & KVM_ATTN_STAT_ENTROPY) a->entropy[(int64_t)h * a->n_q + i] = ent;
    if (st & KVM_ATTN_STAT_LSE) a->lse[(int64_t)h * a->n_q + i] = lse;
    if ((st & KVM_ATTN_STAT_OBS) && i >= a->n_q - a->n_obs) {
        float *o = a->obs + ((int64_t)h * a->n_obs + (i - (a->n_q - a->n_obs))) * a->ld_e;
        memcpy(o, p, (size_t)e_end * sizeof *o);
        memset(o + e_end, 0, (size_t)(a->ld_e - e_end) * sizeof *o);
    }
    if ((st & KVM_ATTN_STAT_MASS) && a->qpos[i] >= j->m0 && a->qpos[i] < j->m1) {
        float *m = a->mass + (int64_t)h * a->ld_e;
        for (int64_t e = 0; e < e_end; e++) m[e] += p[e];
    }
}

/* Queries [i0, i0 + nb) of head h, none of which sees an entry. */
static void block_empty(const attn_job *j, int h, int64_t i0, int64_t nb)
{
    const kvm_attn_layer *a = j->a;
    for (int64_t i = i0; i < i0 + nb; i++) {
        memset(a->out + i * a->ldo + (int64_t)h * a->head_dim, 0, (size_t)a->head_dim * sizeof(float));
        if (a->stats & KVM_ATTN_STAT_ENTROPY) a->entropy[(int64_t)h * a->n_q + i] = 0.0f;
        if (a->stats & KVM_ATTN_STAT_LSE) a->lse[(int64_t)h * a->n_q + i] = -INFINITY;
        if ((a->stats & KVM_ATTN_STAT_OBS) && i >= a->n_q - a->n_obs)
            memset(a->obs + ((int64_t)h * a->n_obs + (i - (a->n_q - a->n_obs))) * a->ld_e, 0,
                   (size_t)a->ld_e * sizeof(float));
    }
}

/* One block of up to 64 queries of head h through the packed GEMMs. */
static void attn_block(const attn_job *j, int h, int64_t blk, float *tile)
{
    const kvm_attn_layer *a = j->a;
    const int g = h / j->grp, d = a->head_dim;
    const int32_t *pos = a->pos[g];
    const int64_t i0 = blk * KVM_ATTN_QBLOCK, n_e = a->n_e[g], ld = j->tile_ld;
    const int64_t nb = a->n_q - i0 < KVM_ATTN_QBLOCK ? a->n_q - i0 : KVM_ATTN_QBLOCK;
    int32_t pmax = a->qpos[i0];
    for (int64_t i = 1; i < nb; i++) pmax = a->qpos[i0 + i] > pmax ? a->qpos[i0 + i] : pmax;
    const int64_t e_end = kvm__attn_visible(pos, n_e, pmax);
    if (e_end == 0) {
        block_empty(j, h, i0, nb);
        return;
    }
    float *o = a->out + i0 * a->ldo + (int64_t)h * d;
    kvm__cpu_gemm_packed(a->q + i0 * a->ldq + (int64_t)h * d, nb, a->ldq, &j->k[g], tile, ld, a->scale, 0, e_end, d);
    /* rows need zeros up to e_end for the PV product. Unless a statistic reads the
     * probabilities, rows stay unnormalised and the 1/sum goes onto the head_dim outputs
     * instead of the e_end weights. */
    float inv[KVM_ATTN_QBLOCK], lse[KVM_ATTN_QBLOCK], ent[KVM_ATTN_QBLOCK];
    const int want_lse = (a->stats & KVM_ATTN_STAT_LSE) != 0, want_ent = (a->stats & KVM_ATTN_STAT_ENTROPY) != 0;
    for (int64_t i = 0; i < nb; i++) {
        const int64_t vis = kvm__attn_visible(pos, e_end, a->qpos[i0 + i]);
        inv[i] = kvm__attn_softmax_row(tile + i * ld, j->bias[g], vis, e_end, j->normalize, want_lse ? &lse[i] : NULL,
                                       want_ent ? &ent[i] : NULL);
    }
    kvm__cpu_gemm_packed(tile, nb, ld, &j->v[g], o, a->ldo, 1.0f, 0, d, e_end);
    if (!j->normalize)
        for (int64_t i = 0; i < nb; i++)
            for (int c = 0; c < d; c++) o[i * a->ldo + c] *= inv[i];
    if (a->stats)
        for (int64_t i = 0; i < nb; i++)
            row_stats(j, h, i0 + i, tile + i * ld, e_end, want_lse ? lse[i] : 0, want_ent ? ent[i] : 0);
}

/* Decode (a few queries) of query heads [h0, h0 + nr) of KV head g: direct products over the
 * cache, no packing, since each entry is read once anyway; the nr heads' rows share each
 * read of K and V (GQA). rows holds nr score rows of tile_ld floats. */
static void attn_direct(const attn_job *j, int g, int h0, int nr, float *rows)
{
    const kvm_attn_layer *a = j->a;
    const int d = a->head_dim;
    const int64_t ld = j->tile_ld;
    const int want_lse = (a->stats & KVM_ATTN_STAT_LSE) != 0, want_ent = (a->stats & KVM_ATTN_STAT_ENTROPY) != 0;
    const int f16c = kvm__attn_f16c();
    for (int64_t i = 0; i < a->n_q; i++) {
        const int64_t vis = kvm__attn_visible(a->pos[g], a->n_e[g], a->qpos[i]);
        if (vis == 0) {
            for (int r = 0; r < nr; r++)
                block_empty(j, h0 + r, i, 1);
            continue;
        }
        const float *q = a->q + i * a->ldq + (int64_t)h0 * d;
        float *o = a->out + i * a->ldo + (int64_t)h0 * d;
        if (a->kv_dtype == KVM_KV_F16 && f16c)
            kvm__attn_scores_rows_f16c(q, d, nr, a->k16[g], vis, d, a->scale, rows, ld);
        else if (a->kv_dtype == KVM_KV_F16)
            kvm__attn_scores_rows_f16(q, d, nr, a->k16[g], vis, d, a->scale, rows, ld);
        else
            kvm__attn_scores_rows(q, d, nr, a->k[g], vis, d, a->scale, rows, ld);
        float lse[nr], ent[nr];
        for (int r = 0; r < nr; r++) {
            lse[r] = ent[r] = 0;
            kvm__attn_softmax_row(rows + r * ld, j->bias[g], vis, vis, 1, want_lse ? &lse[r] : NULL,
                                  want_ent ? &ent[r] : NULL);
        }
        if (a->kv_dtype == KVM_KV_F16 && f16c)
            kvm__attn_pv_rows_f16c(rows, ld, nr, a->v16[g], vis, d, o, d);
        else if (a->kv_dtype == KVM_KV_F16)
            kvm__attn_pv_rows_f16(rows, ld, nr, a->v16[g], vis, d, o, d);
        else
            kvm__attn_pv_rows(rows, ld, nr, a->v[g], vis, d, o, d);
        if (a->stats)
            for (int r = 0; r < nr; r++)
                row_stats(j, h0 + r, i, rows + r * ld, vis, lse[r], ent[r]);
    }
}

/* Decode task t: KV head t / chunks, its query heads split into `chunks` runs (so that a pool
 * of several threads has tasks for all of them where KV heads are few). */
static void direct_task(void *ctx, int64_t t, int worker)
{
    (void)worker;
    attn_job *j = ctx;
    const kvm_attn_layer *a = j->a;
    const int g = (int)(t / j->chunks), c = (int)(t % j->chunks);
    const int h0 = g * j->grp + j->grp * c / j->chunks, h1 = g * j->grp + j->grp * (c + 1) / j->chunks;
    if (h1 == h0) return;
    float *rows = tile_get((size_t)(h1 - h0) * (size_t)j->tile_ld);
    if (!rows) {
        int zero = 0;
        atomic_compare_exchange_strong(&j->rc, &zero, KVM_ENOMEM);
        return;
    }
    if (a->stats & KVM_ATTN_STAT_MASS)
        memset(a->mass + (int64_t)h0 * a->ld_e, 0, (size_t)(h1 - h0) * (size_t)a->ld_e * sizeof(float));
    attn_direct(j, g, h0, h1 - h0, rows);
}

static void attn_task(void *ctx, int64_t t, int worker)
{
    (void)worker;
    attn_job *j = ctx;
    const kvm_attn_layer *a = j->a;
    float *tile = tile_get((size_t)KVM_ATTN_QBLOCK * (size_t)j->tile_ld);
    if (!tile) {
        int zero = 0;
        atomic_compare_exchange_strong(&j->rc, &zero, KVM_ENOMEM);
        return;
    }
    const int h = j->per_head ? (int)t : (int)(t / j->blocks);
    if (a->stats & KVM_ATTN_STAT_MASS) memset(a->mass + (int64_t)h * a->ld_e, 0, (size_t)a->ld_e * sizeof(float));
    if (j->per_head)
        for (int64_t b = 0; b < j->blocks; b++) attn_block(j, h, b, tile);
    else
        attn_block(j, h, t % j->blocks, tile);
}

int kvm__cpu_attn_check(const kvm_attn_layer *a)
{
    if (a->n_q < 0 || a->head_dim <= 0 || a->n_kv_heads <= 0 || a->n_heads <= 0 || a->n_heads % a->n_kv_heads)
        return kvm_err(KVM_EINVAL, "attention: bad sizes n_q=%lld head_dim=%d n_heads=%d n_kv_heads=%d",
                       (long long)a->n_q, a->head_dim, a->n_heads, a->n_kv_heads);
    const int64_t row = (int64_t)a->n_heads * a->head_dim;
    if (a->ldq < row || a->ldo < row)
        return kvm_err(KVM_EINVAL, "attention: row strides ldq=%lld ldo=%lld below n_heads*head_dim=%lld",
                       (long long)a->ldq, (long long)a->ldo, (long long)row);
    if (a->kv_dtype != KVM_KV_F32 && a->kv_dtype != KVM_KV_F16)
        return kvm_err(KVM_EINVAL, "attention: unknown KV element type %d", (int)a->kv_dtype);
    if (a->kv_dtype == KVM_KV_F16 && (!a->k16 || !a->v16))
        return kvm_err(KVM_EINVAL, "attention: f16 keys/values asked for without their k16/v16 arrays");
    for (int g = 0; g < a->n_kv_heads; g++) {
        if (a->n_e[g] < 0) return kvm_err(KVM_EINVAL, "attention: KV head %d has %lld entries", g, (long long)a->n_e[g]);
        if ((a->stats & (KVM_ATTN_STAT_MASS | KVM_ATTN_STAT_OBS)) && a->n_e[g] > a->ld_e)
            return kvm_err(KVM_EINVAL, "attention: KV head %d has %lld entries, statistics rows hold ld_e=%lld", g,
                           (long long)a->n_e[g], (long long)a->ld_e);
    }
    const unsigned st = a->stats;
    if (st & ~(unsigned)(KVM_ATTN_STAT_MASS | KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_LSE | KVM_ATTN_STAT_OBS))
        return kvm_err(KVM_EINVAL, "attention: unknown statistics flags 0x%x", st);
    if (((st & KVM_ATTN_STAT_MASS) && !a->mass) || ((st & KVM_ATTN_STAT_ENTROPY) && !a->entropy) ||
        ((st & KVM_ATTN_STAT_LSE) && !a->lse) || ((st & KVM_ATTN_STAT_OBS) && !a->obs))
        return kvm_err(KVM_EINVAL, "attention: a statistic was asked for (flags 0x%x) without its buffer", st);
    if ((st & KVM_ATTN_STAT_OBS) && a->n_q > 0 && (a->n_obs < 1 || a->n_obs > a->n_q))
        return kvm_err(KVM_EINVAL, "attention: n_obs=%lld outside [1, n_q=%lld]", (long long)a->n_obs,
                       (long long)a->n_q);
    return 0;
}

/* Direct (decode) products spread over the pool only above this many multiply-adds: below
 * it waking a thread costs more than the work. */
enum { KVM_ATTN_DIRECT_PARALLEL = 1 << 16 };

/* KV head g's K as W [n_e][d] (QKᵀ) into k, and V as W [d][n_e] read from V [n_e][d] (PV) into
 * v, once per call; f16 entries are widened as they are packed. Returns 0 or KVM_ENOMEM. */
static int pack_kv(const kvm_attn_layer *a, int g, kvm_cpu_packed *k, kvm_cpu_packed *v)
{
    const int d = a->head_dim;
    const int64_t n = a->n_e[g];
    int rc;
    if (a->kv_dtype == KVM_KV_F16) {
        if ((rc = kvm__cpu_pack_f16(k, a->k16[g], n, d, d, 1))) return rc;
        return kvm__cpu_pack_f16(v, a->v16[g], d, n, 1, d);
    }
    if ((rc = kvm__cpu_pack(k, a->k[g], n, d, d, 1))) return rc;
    return kvm__cpu_pack(v, a->v[g], d, n, 1, d);
}

int kvm__cpu_attention(const kvm_attn_layer *a)
{
    int rc = kvm__cpu_attn_check(a);
    if (rc || a->n_q == 0) return rc;
    const int nkv = a->n_kv_heads, d = a->head_dim;
    const float *bias[nkv];
    int64_t max_e = 0, work = 0;
    for (int g = 0; g < nkv; g++) {
        bias[g] = NULL;
        for (int64_t e = 0; a->bias && a->bias[g] && e < a->n_e[g]; e++)
            if (a->bias[g][e] != 0.0f) {
                bias[g] = a->bias[g];
                break;
            }
        max_e = a->n_e[g] > max_e ? a->n_e[g] : max_e;
        work += a->n_e[g] * d;
    }
    attn_job j = {.a = a, .bias = bias, .grp = a->n_heads / nkv, .tile_ld = (max_e + 15) / 16 * 16 + 16,
                  .normalize = (a->stats & (KVM_ATTN_STAT_MASS | KVM_ATTN_STAT_ENTROPY | KVM_ATTN_STAT_OBS)) != 0,
                  .m0 = a->mass_p0, .m1 = a->mass_p1};
    atomic_init(&j.rc, 0);
    if (a->n_q <= 2) { /* decode: tasks of a KV head's query heads (all of them on one thread) */
        const int par = work * j.grp * a->n_q >= KVM_ATTN_DIRECT_PARALLEL, threads = par ? kvm__cpu_threads() : 1;
        j.chunks = threads > 1 ? (2 * threads + nkv - 1) / nkv : 1;
        if (j.chunks > j.grp) j.chunks = j.grp;
        /* on the pool whenever above the threshold, with one thread or several: the pool
         * computes with flush-to-zero, so a direct loop here would give other bits */
        if (par)
            kvm__cpu_parallel_for((int64_t)nkv * j.chunks, direct_task, &j);
        else
            for (int64_t t = 0; t < (int64_t)nkv * j.chunks; t++)
                direct_task(&j, t, 0);
        return atomic_load(&j.rc) ? kvm_err(KVM_ENOMEM, "attention: out of memory for score rows") : 0;
    }
    attn_scratch *sc = scratch_get();
    if (!sc) return kvm_err(KVM_ENOMEM, "attention: out of memory");
    if ((rc = scratch_heads(sc, nkv))) return rc;
    for (int g = 0; g < nkv; g++)
        if ((rc = pack_kv(a, g, &sc->k[g], &sc->v[g]))) return rc;
    j.k = sc->k;
    j.v = sc->v;
    j.blocks = (a->n_q + KVM_ATTN_QBLOCK - 1) / KVM_ATTN_QBLOCK;
    j.per_head = (a->stats & KVM_ATTN_STAT_MASS) != 0;
    kvm__cpu_parallel_for(j.per_head ? a->n_heads : a->n_heads * j.blocks, attn_task, &j);
    return atomic_load(&j.rc) ? kvm_err(KVM_ENOMEM, "attention: out of memory for a score tile") : 0;
}
