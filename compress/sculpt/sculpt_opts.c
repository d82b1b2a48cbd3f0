/* sculpt_opts.c: the table of KVSculpt settings and the parsers built on it. */
#include "compress/sculpt/kvm_sculpt_opts.h"
#include "common/kvm_error.h"

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

typedef enum kind { K_I64, K_INT, K_F64, K_U64, K_MODE, K_ALLOC } kind;

typedef struct row {
    kvm_sculpt_setting s;
    kind kind;
    size_t off;
    double lo, hi;
} row;

#define F(m) offsetof(kvm_sculpt_opts, m)
static const row rows[] = {
    {{"method", "sculpt | selectfit | joint-fixed (default sculpt)"}, K_MODE, F(mode), 0, 0},
    {{"retain", "retain zone m, tokens kept as is (default 32)"}, K_I64, F(retain_tokens), 0, 1 << 30},
    {{"ratio", "r = k/(N-m), distilled entries per zone token (default 0.3)"}, K_F64, F(ratio), 1e-9, 1},
    {{"entries", "k: absolute distilled entries per KV head (overrides ratio; default 0 = use ratio)"}, K_I64, F(k_entries), 0, 1 << 30},
    {{"queries", "S synthetic future queries per KV head (default 2048)"}, K_I64, F(n_synth), 0, 1 << 24},
    {{"future", "F: synthetic positions N + floor(i*F/S) (default: continuation length, else 64)"}, K_I64, F(future_tokens), 0, 1 << 30},
    {{"lambda", "weight of the LSE-matching term (default 0.1)"}, K_F64, F(lambda), 0, 1e6},
    {{"lse-weight", "1: weight each query's LSE error by the zone's attention share (ours) (default 0)"}, K_INT, F(lse_mass_weight), 0, 1},
    {{"alpha", "ridge alpha relative to the mean diagonal of the normal matrix (default 1e-3)"}, K_F64, F(ridge_alpha), 1e-12, 1e6},
    {{"vcap", "value-norm guard: |v| <= vcap * max zone |v|, 0 = off (default 1)"}, K_F64, F(vnorm_cap), 0, 1e6},
    {{"kcap", "key-norm guard: |k| <= kcap * max zone |k| after each L-BFGS round, 0 = off (default 0)"}, K_F64, F(knorm_cap), 0, 1e6},
    {{"rounds", "alternating rounds R (default 4)"}, K_INT, F(rounds), 0, 1000},
    {{"iters", "L-BFGS iterations per round (default 30)"}, K_INT, F(lbfgs_iters), 0, 100000},
    {{"history", "L-BFGS memory (default 20)"}, K_INT, F(lbfgs_history), 1, 1000},
    {{"bias", "1: per-entry logit bias beta fitted with the keys (Attention Matching) (default 0)"}, K_INT, F(bias), 0, 1},
    {{"alloc", "uniform | layer | head (pilot MSE^p, paper) | gain (marginal-gain water-filling) (default uniform)"}, K_ALLOC, F(alloc), 0, 0},
    {{"power", "p of the MSE^p allocation rule (default 0.5)"}, K_F64, F(alloc_power), 0, 100},
    {{"pilot-rounds", "alternating rounds of the allocation pilot (default 1)"}, K_INT, F(pilot_rounds), 0, 1000},
    {{"pilot-iters", "L-BFGS iterations per pilot round (default 10)"}, K_INT, F(pilot_iters), 0, 100000},
    {{"seed", "seed of the synthetic queries (default 1)"}, K_U64, F(seed), 0, 9.2e18},
    {{"threads", "worker threads over (layer, KV head) problems (default 1)"}, K_INT, F(threads), 1, 256},
};
#undef F
enum { N_ROWS = sizeof rows / sizeof rows[0] };

const kvm_sculpt_setting *kvm_sculpt_settings(int *n)
{
    static kvm_sculpt_setting s[N_ROWS];
    for (int i = 0; i < N_ROWS; i++) s[i] = rows[i].s;
    *n = N_ROWS;
    return s;
}

int kvm_sculpt_opts_set(kvm_sculpt_opts *o, const char *name, const char *value)
{
    const row *r = NULL;
    for (int i = 0; i < N_ROWS; i++)
        if (!strcmp(rows[i].s.name, name)) r = &rows[i];
    if (!r) return kvm_err(KVM_ENOTFOUND, "sculpt: no option '%s'", name);
    if (!value || !*value) value = "1";
    char *p = (char *)o + r->off;
    if (r->kind == K_MODE) return kvm_sculpt_mode_parse(value, (kvm_sculpt_mode *)(void *)p);
    if (r->kind == K_ALLOC) return kvm_sculpt_alloc_parse(value, (kvm_sculpt_alloc *)(void *)p);
    errno = 0;
    char *end;
    double v = strtod(value, &end);
    if (errno || end == value || *end || !isfinite(v) || v < r->lo || v > r->hi ||
        (r->kind != K_F64 && v != floor(v)))
        return kvm_err(KVM_EINVAL, "sculpt: --%s %s: expected %s in [%g, %g]", name, value,
                       r->kind == K_F64 ? "a number" : "an integer", r->lo, r->hi);
    switch (r->kind) {
    case K_I64: *(int64_t *)(void *)p = (int64_t)v; break;
    case K_INT: *(int *)(void *)p = (int)v; break;
    case K_U64: *(uint64_t *)(void *)p = (uint64_t)v; break;
    default: *(double *)(void *)p = v; break;
    }
    return 0;
}

int kvm_sculpt_opts_parse(kvm_sculpt_opts *o, const char *arg)
{
    if (!arg || !*arg) return 0;
    char *s = strdup(arg), *save = NULL;
    if (!s) return kvm_err(KVM_ENOMEM, "out of memory");
    int rc = 0;
    for (char *t = strtok_r(s, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(t, '=');
        if (eq) *eq++ = 0;
        rc = kvm_sculpt_opts_set(o, t, eq);
    }
    free(s);
    return rc;
}

int kvm_sculpt_opts_set_budget(kvm_sculpt_opts *o, const kvm_budget *b)
{
    if (b->tokens > 0) {
        if (b->tokens <= o->retain_tokens)
            return kvm_err(KVM_EINVAL, "sculpt: budget %lld entries per head leaves none beyond the retain zone of %lld",
                           (long long)b->tokens, (long long)o->retain_tokens);
        o->k_entries = b->tokens - o->retain_tokens;
        return 0;
    }
    if (!(b->ratio > 0 && b->ratio <= 1)) return kvm_err(KVM_EINVAL, "sculpt: a ratio in (0, 1] or a budget is required");
    o->ratio = b->ratio;
    o->k_entries = 0;
    return 0;
}

void kvm_sculpt_opts_help(FILE *f)
{
    for (int i = 0; i < N_ROWS; i++) fprintf(f, "  --%-13s %s\n", rows[i].s.name, rows[i].s.help);
}
