/* kvm_polykv_signals_read.c: reads back the signals CSV that kvm_polykv_signals_csv writes, so
 * that a calibration can reuse the signals of an earlier run (they are most of its cost: on
 * SmolLM2 at N = 2048, ≈ 1,500 of 1,844 CPU s) and only measure what it adds (kvzip, sculpt). */
#include "common/kvm_error.h"
#include "common/kvm_file.h"
#include "compress/polykv/kvm_polykv.h"
#include "compress/sculpt/kvm_sculpt_opts.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { NF = 9, DIST = 2 }; /* fields per row; distilled kinds (sculpt, kvzip) */

static const char header[] = "phase,layer,pattern,budget,cosine,ppl_delta,kl,entropy,worst_ppl";
static const char opts_prefix[] = "# sculpt_options="; /* optional first line */

typedef struct reader {
    const char *path;
    long line;
    kvm_polykv_signals *s;
    unsigned char *ev;        /* [2][L][P] eviction rows seen */
    unsigned char *dist;      /* [DIST][2][L] distilled rows seen */
    unsigned char *layer_set; /* [L] entropy set / [L] worst_ppl set per phase */
    int64_t budget;           /* of the non-PyramidKV rows, −1 before the first */
    int64_t *pyr_b;           /* [L] PyramidKV rows' budgets */
} reader;

static int bad(const reader *r, const char *what)
{
    return kvm_err(KVM_EFORMAT, "signals %s line %ld: %s", r->path, r->line, what);
}

/* Splits the row in place at commas into exactly NF fields. */
static int split(char *row, char **f)
{
    int n = 0;
    for (char *p = row;; p++) {
        if (n == NF) return 0;
        f[n++] = p;
        p = strchr(p, ',');
        if (!p) break;
        *p = '\0';
    }
    return n == NF;
}

static int num(const char *s, double *v)
{
    char *end;
    errno = 0;
    *v = strtod(s, &end);
    return end != s && *end == '\0' && errno == 0 && isfinite(*v);
}

/* Rounding allowed beyond a signal's mathematical range: the CSV holds %.9g of sums of float
 * products, and a cosine of 1 or a KL of 0 may come out a few ulps outside. */
#define RANGE_SLACK 1e-6

/* The columns' ranges (v: cosine, ppl_delta, kl, entropy, worst_ppl): a cosine lies in [−1, 1],
 * a KL divergence and an attention entropy are ≥ 0 (PolyKV, arXiv 2606.15157, §3: the signals'
 * definitions); ppl_delta and worst_ppl, differences of perplexities ≥ 1, take either sign
 * (compressing a layer can lower the perplexity) and are only finite. NULL when v fits, else
 * what does not (a static buffer, valid until the next call). */
static const char *check_ranges(const double *v)
{
    static char m[160];
    if (v[0] < -1 - RANGE_SLACK || v[0] > 1 + RANGE_SLACK)
        snprintf(m, sizeof m, "cosine %.9g is outside [-1, 1]", v[0]);
    else if (v[2] < -RANGE_SLACK)
        snprintf(m, sizeof m, "kl %.9g is negative (a KL divergence is >= 0)", v[2]);
    else if (v[3] < -RANGE_SLACK)
        snprintf(m, sizeof m, "entropy %.9g is negative (an attention entropy is >= 0)", v[3]);
    else
        return NULL;
    return m;
}

/* One data row into r->s; 0 or KVM_EFORMAT naming the line. */
static int row(reader *r, char *text)
{
    kvm_polykv_signals *s = r->s;
    const int L = s->n_layers, P = KVM_PATTERN_COUNT;
    char *f[NF], *end;
    if (!split(text, f)) return bad(r, "not 9 comma-separated fields");
    int ph = !strcmp(f[0], "prefill") ? 0 : !strcmp(f[0], "decode") ? 1 : -1;
    if (ph < 0) return bad(r, "phase is not prefill or decode");
    long l = strtol(f[1], &end, 10);
    if (end == f[1] || *end || l < 0) return bad(r, "layer is not a number ≥ 0");
    if (l >= L) {
        char m[96];
        snprintf(m, sizeof m, "layer %ld, but the model has %d layers", l, L);
        return bad(r, m);
    }
    long long b = strtoll(f[3], &end, 10);
    if (end == f[3] || *end || b < 1) return bad(r, "budget is not a number ≥ 1");
    double v[5];
    for (int i = 0; i < 5; i++)
        if (!num(f[4 + i], &v[i])) return bad(r, "cosine, ppl_delta, kl, entropy or worst_ppl is not a finite number");
    const char *range = check_ranges(v);
    if (range) return bad(r, range);
    int k = !strcmp(f[2], "sculpt") ? 0 : !strcmp(f[2], "kvzip") ? 1 : -1;
    kvm_pattern p = KVM_PATTERN_STREAMING;
    if (k < 0 && kvm_pattern_parse(f[2], &p)) {
        char m[160]; /* kvm_errmsg's buffer is the one bad() writes */
        snprintf(m, sizeof m, "%s", kvm_errmsg());
        return bad(r, m);
    }
    unsigned char *seen = k < 0 ? &r->ev[((size_t)ph * L + l) * P + p] : &r->dist[((size_t)k * 2 + ph) * L + l];
    if (*seen) return bad(r, "a second row for this phase, layer and pattern");
    *seen = 1;
    if (p == KVM_PATTERN_PYRAMIDKV && k < 0)
        r->pyr_b[l] = b;
    else if (r->budget < 0)
        r->budget = b;
    else if (b != r->budget)
        return bad(r, "a budget other than the earlier rows'");
    unsigned char *es = &r->layer_set[l], *ws = &r->layer_set[(size_t)(1 + ph) * L + l];
    if ((*es && s->entropy[l] != v[3]) || (*ws && s->worst_ppl[ph * L + l] != v[4]))
        return bad(r, "entropy or worst_ppl differs from the layer's other rows");
    *es = *ws = 1;
    s->entropy[l] = v[3];
    s->worst_ppl[ph * L + l] = v[4];
    double *dst[DIST][3] = {{s->sculpt_cosine, s->sculpt_ppl, s->sculpt_kl},
                            {s->kvzip_cosine, s->kvzip_ppl, s->kvzip_kl}};
    if (k >= 0) {
        if (ph == 0)
            for (int i = 0; i < 3; i++)
                dst[k][i][l] = v[i];
        return 0;
    }
    size_t i = ((size_t)ph * L + l) * P + p;
    s->cosine[i] = v[0];
    s->ppl_delta[i] = v[1];
    s->kl[i] = v[2];
    return 0;
}

/* After the last row: every eviction row of the prefill phase, of the decode phase all or none,
 * each distilled kind all or none (prefill rows), PyramidKV's budgets its schedule's. */
static int complete(reader *r)
{
    kvm_polykv_signals *s = r->s;
    const int L = s->n_layers, P = KVM_PATTERN_COUNT;
    const size_t n2 = (size_t)L * P;
    size_t got[2] = {0, 0}, dgot[DIST] = {0, 0};
    for (int ph = 0; ph < 2; ph++)
        for (size_t i = 0; i < n2; i++)
            got[ph] += r->ev[ph * n2 + i];
    for (int k = 0; k < DIST; k++)
        for (int l = 0; l < L; l++)
            dgot[k] += r->dist[(size_t)k * 2 * L + l];
    if (got[0] != n2 || (got[1] && got[1] != n2))
        return kvm_err(KVM_EFORMAT, "signals %s: %zu prefill and %zu decode eviction rows, expected %zu (and %zu or 0)",
                       r->path, got[0], got[1], n2, n2);
    for (int k = 0; k < DIST; k++)
        if (dgot[k] && dgot[k] != (size_t)L)
            return kvm_err(KVM_EFORMAT, "signals %s: %s rows for %zu of %d layers", r->path, k ? "kvzip" : "sculpt",
                           dgot[k], L);
    if (r->budget < 0) return kvm_err(KVM_EFORMAT, "signals %s: no budget outside pyramidkv rows", r->path);
    int64_t *pyr = malloc((size_t)L * sizeof *pyr);
    int rc = pyr ? kvm_evict_pyramid_budgets(r->budget, L, pyr) : kvm_err(KVM_ENOMEM, "signals: out of memory");
    for (int l = 0; !rc && l < L; l++)
        if (r->pyr_b[l] != pyr[l])
            rc = kvm_err(KVM_EFORMAT,
                         "signals %s: pyramidkv budget %lld at layer %d, its schedule at B = %lld gives %lld", r->path,
                         (long long)r->pyr_b[l], l, (long long)r->budget, (long long)pyr[l]);
    free(pyr);
    if (rc) return rc;
    s->budget = r->budget;
    s->n_docs = 0; /* the file does not say */
    s->prefill_only = got[1] == 0;
    if (s->prefill_only) { /* what kvm_polykv_calibrate_phases does without decode-phase runs */
        memcpy(s->cosine + n2, s->cosine, n2 * sizeof *s->cosine);
        memcpy(s->ppl_delta + n2, s->ppl_delta, n2 * sizeof *s->ppl_delta);
        memcpy(s->kl + n2, s->kl, n2 * sizeof *s->kl);
        memcpy(s->worst_ppl + L, s->worst_ppl, (size_t)L * sizeof *s->worst_ppl);
    }
    s->has_sculpt = dgot[0] != 0;
    s->has_kvzip = dgot[1] != 0;
    return 0;
}

int kvm_polykv_signals_read(const char *path, kvm_polykv_signals *s)
{
    FILE *f;
    int ost = kvm_file_open_input(path, "r", "signals", &f); /* a folder: named, not "read failed" */
    if (ost) return ost;
    int rc = kvm_polykv_signals_read_stream(f, path, s);
    fclose(f);
    return rc;
}

/* fgets into buf[size] with *n the bytes it stored: a NUL byte of the file is counted too, which
 * strlen would have ended the line at (a row's junk after one was read as nothing). The buffer
 * is filled first, so the last NUL in it is fgets' own. Returns buf, or NULL at the end. */
static char *read_line(char *buf, size_t size, FILE *f, size_t *n)
{
    memset(buf, 1, size);
    if (!fgets(buf, (int)size, f)) return NULL;
    size_t end = size - 1;
    while (end > 0 && buf[end] != '\0')
        end--;
    *n = end;
    return buf;
}

int kvm_polykv_signals_read_stream(FILE *f, const char *path, kvm_polykv_signals *s)
{
    const int L = s->n_layers;
    reader r = {.path = path, .s = s, .budget = -1};
    s->sculpt_opts_known = 0;
    r.ev = calloc((size_t)2 * L * KVM_PATTERN_COUNT, 1);
    r.dist = calloc((size_t)DIST * 2 * L, 1);
    r.layer_set = calloc((size_t)3 * L, 1);
    r.pyr_b = calloc((size_t)L, sizeof *r.pyr_b);
    int rc = r.ev && r.dist && r.layer_set && r.pyr_b ? 0 : kvm_err(KVM_ENOMEM, "signals: out of memory");
    char buf[KVM_SCULPT_OPTS_CANONICAL_MAX + 64];
    long header_line = 1; /* 2 after an options line */
    size_t got;
    while (!rc && read_line(buf, sizeof buf, f, &got)) {
        r.line++;
        size_t n = strlen(buf);
        if (n != got) {
            char nul[96];
            snprintf(nul, sizeof nul, "a NUL byte at column %zu (a signals file is text)", n + 1);
            rc = bad(&r, nul);
        } else if (n == sizeof buf - 1 && buf[n - 1] != '\n')
            rc = bad(&r, "line too long");
        else {
            while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
                buf[--n] = '\0';
            if (r.line == 1 && !strncmp(buf, "\xEF\xBB\xBF", 3)) /* a byte-order mark an editor added, as */
                memmove(buf, buf + 3, (n -= 3) + 1);             /* configs and JSONL corpora skip */
            if (r.line == 1 && !strncmp(buf, opts_prefix, sizeof opts_prefix - 1)) {
                const char *t = buf + sizeof opts_prefix - 1;
                if (kvm_sculpt_opts_from_canonical(t, strlen(t), &s->sculpt_opts)) {
                    char m[512]; /* kvm_errmsg's buffer is the one bad() writes */
                    snprintf(m, sizeof m, "%s", kvm_errmsg());
                    rc = bad(&r, m);
                }
                s->sculpt_opts_known = rc == 0;
                header_line = 2;
            } else if (r.line == header_line)
                rc = strcmp(buf, header) ? bad(&r, "not the header written by --dump-signals") : 0;
            else
                rc = row(&r, buf);
        }
    }
    if (!rc && ferror(f)) rc = kvm_err(KVM_EIO, "signals %s: read failed", path);
    struct stat st; /* a FIFO opened without its writer reads as empty (kvm_file_open_input) */
    const int fifo = fstat(fileno(f), &st) == 0 && S_ISFIFO(st.st_mode);
    if (!rc && r.line < header_line)
        rc = kvm_err(KVM_EFORMAT,
                     fifo && r.line == 0
                         ? "signals %s: a FIFO that gave nothing to read (its writer wrote nothing, or was not "
                           "running yet when it was opened: start the writer first)"
                         : "signals %s: empty file",
                     path);
    if (!rc) rc = complete(&r);
    free(r.ev);
    free(r.dist);
    free(r.layer_set);
    free(r.pyr_b);
    return rc;
}
