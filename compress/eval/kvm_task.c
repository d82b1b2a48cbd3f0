/* kvm_task.c: the deterministic task-case generator and the exact-match scorer
 * (compress/eval/kvm_task.h). */
#include "common/kvm_error.h"
#include "compress/eval/kvm_task.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const task_names[] = {"passkey", "recall", "multikey"};

int kvm_task_parse(const char *name, kvm_task_kind *out)
{
    for (int i = 0; i < 3; i++)
        if (!strcmp(name, task_names[i])) {
            *out = (kvm_task_kind)i;
            return 0;
        }
    return kvm_err(KVM_EINVAL, "unknown task '%s' (passkey|recall|multikey)", name);
}

const char *kvm_task_name(kvm_task_kind kind) { return (unsigned)kind < 3 ? task_names[kind] : "?"; }

/* splitmix64 (Steele, Lea & Flood 2014): a fixed, portable stream. */
static uint64_t next_u64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static unsigned pick(uint64_t *s, unsigned n) { return (unsigned)(next_u64(s) % n); }

/* Five digits, the first not 0. */
static unsigned five_digits(uint64_t *s) { return 10000 + pick(s, 90000); }

static const char *const first_names[] = {"Marta", "Oskar", "Ingrid", "Bruno", "Selma", "Tobias", "Greta", "Viktor",
                                          "Nadia", "Hugo", "Elsa", "Felix", "Irene", "Konrad", "Lotte", "Milan"};
static const char *const last_names[] = {"Quill", "Brandt", "Okafor", "Lindqvist", "Moreau", "Castell", "Varga",
                                         "Holloway", "Petrov", "Nakamura", "Delacroix", "Sorensen", "Abara", "Whitlock",
                                         "Ferreira", "Kowalski"};
static const char *const roles[] = {"lighthouse keeper", "baker", "ship captain", "librarian",
                                    "clockmaker", "gardener", "mayor", "train driver"};
static const char *const doors[] = {"red", "blue", "green", "yellow", "purple", "orange", "silver", "golden"};

/* Offset where a fact inserted near share `depth` of text goes: after the next sentence end,
 * else at the first character boundary from depth·len on (a fact inside a UTF-8 sequence split
 * a character of the document into two invalid ones). */
static size_t insert_at(const char *text, size_t len, double depth)
{
    size_t p = (size_t)(depth * (double)len);
    if (p > len) p = len;
    for (size_t i = p; i + 1 < len; i++) {
        if (text[i] == '\n') return i + 1;
        if ((text[i] == '.' || text[i] == '!' || text[i] == '?') && text[i + 1] == ' ') return i + 2;
    }
    while (p < len && ((unsigned char)text[p] & 0xC0) == 0x80)
        p++;
    return p;
}

/* A fact and where it goes. */
typedef struct fact {
    char text[160];
    size_t at;
} fact;

static int cmp_fact(const void *a, const void *b)
{
    const fact *x = a, *y = b; /* by offset, then text: one order whatever qsort does with ties */
    return x->at != y->at ? (x->at > y->at) - (x->at < y->at) : strcmp(x->text, y->text);
}

int kvm_task_make(kvm_task_kind kind, const char *text, size_t len, uint64_t index, kvm_task_case *out)
{
    memset(out, 0, sizeof *out);
    if (!text || len == 0) return kvm_err(KVM_EINVAL, "task: empty document");
    if ((unsigned)kind > KVM_TASK_MULTIKEY) return kvm_err(KVM_EINVAL, "task: bad kind %d", (int)kind);
    uint64_t s = 0x6B766D696C6Cull ^ ((uint64_t)kind << 56) ^ index; /* "kvmill" */
    double depth = 0.1 * (double)(1 + index % KVM_TASK_DEPTHS);
    fact f[KVM_TASK_MULTI_KEYS];
    int n_facts = 1;
    if (kind == KVM_TASK_PASSKEY) {
        unsigned key = five_digits(&s);
        snprintf(f[0].text, sizeof f[0].text, "The pass key is %u. Remember it. %u is the pass key. ", key, key);
        snprintf(out->question, sizeof out->question, "What is the pass key? Answer with the number only.");
        snprintf(out->answer, sizeof out->answer, "%u", key);
    } else if (kind == KVM_TASK_RECALL) {
        const char *fn = first_names[pick(&s, 16)], *ln = last_names[pick(&s, 16)], *role = roles[pick(&s, 8)];
        snprintf(f[0].text, sizeof f[0].text, "Remember this: the name of the %s is %s %s. ", role, fn, ln);
        snprintf(out->question, sizeof out->question, "What is the name of the %s? Answer with the name only.", role);
        snprintf(out->answer, sizeof out->answer, "%s %s", fn, ln);
    } else {
        /* four distinct doors; door 0 is asked and sits at `depth`, the others spread around it */
        unsigned d[KVM_TASK_MULTI_KEYS], asked_code = 0;
        for (int i = 0; i < KVM_TASK_MULTI_KEYS; i++) {
            int dup;
            do {
                d[i] = pick(&s, 8);
                dup = 0;
                for (int j = 0; j < i; j++)
                    dup |= d[j] == d[i];
            } while (dup);
            unsigned code = five_digits(&s);
            if (i == 0) asked_code = code;
            double at = i == 0 ? depth : depth + 0.2 * i;
            while (at >= 0.95)
                at -= 0.9;
            snprintf(f[i].text, sizeof f[i].text, "The code for the %s door is %u. ", doors[d[i]], code);
            f[i].at = insert_at(text, len, at);
        }
        n_facts = KVM_TASK_MULTI_KEYS;
        snprintf(out->question, sizeof out->question, "What is the code for the %s door? Answer with the number only.",
                 doors[d[0]]);
        snprintf(out->answer, sizeof out->answer, "%u", asked_code);
    }
    if (kind != KVM_TASK_MULTIKEY) f[0].at = insert_at(text, len, depth);
    size_t asked_at = f[0].at, total = len + 1;
    char asked[sizeof f[0].text]; /* facts at the asked one's offset that sort before it go first */
    memcpy(asked, f[0].text, sizeof asked);
    for (int i = 0; i < n_facts; i++)
        total += strlen(f[i].text);
    qsort(f, (size_t)n_facts, sizeof f[0], cmp_fact);
    char *doc = malloc(total);
    if (!doc) return kvm_err(KVM_ENOMEM, "task: out of memory");
    size_t w = 0, r = 0, shift = 0;
    int before = 1; /* until the asked fact is written */
    for (int i = 0; i < n_facts; i++) {
        memcpy(doc + w, text + r, f[i].at - r);
        w += f[i].at - r;
        r = f[i].at;
        if (!strcmp(f[i].text, asked)) before = 0;
        if (before) shift += strlen(f[i].text); /* facts inserted before the asked one */
        size_t n = strlen(f[i].text);
        memcpy(doc + w, f[i].text, n);
        w += n;
    }
    memcpy(doc + w, text + r, len - r);
    w += len - r;
    doc[w] = '\0';
    out->document = doc;
    out->document_len = w;
    out->depth = (double)(asked_at + shift) / (double)w;
    return 0;
}

void kvm_task_case_deinit(kvm_task_case *c)
{
    free(c->document);
    c->document = NULL;
}

/* The first whole-word occurrence of answer in generated[0, len) (ASCII case folded); with
 * closed = 1 only one followed by a character. Returns 1 when found. */
static int find_answer(const char *answer, const char *generated, size_t len, int closed)
{
    size_t n = strlen(answer);
    if (n == 0 || n > len) return 0;
    for (size_t i = 0; i + n <= len; i++) {
        size_t j = 0;
        while (j < n && tolower((unsigned char)generated[i + j]) == tolower((unsigned char)answer[j]))
            j++;
        if (j < n) continue;
        int before = i > 0 && isalnum((unsigned char)generated[i - 1]);
        int after = i + n < len && isalnum((unsigned char)generated[i + n]);
        if (!before && !after && (!closed || i + n < len)) return 1;
    }
    return 0;
}

int kvm_task_match(const char *answer, const char *generated, size_t len)
{
    return find_answer(answer, generated, len, 0);
}

int kvm_task_answered(const char *answer, const char *generated, size_t len)
{
    return find_answer(answer, generated, len, 1);
}

void kvm_task_wilson(int64_t k, int64_t n, double *lo, double *hi)
{
    const double z = 1.96, p = (double)k / (double)n, z2n = z * z / (double)n;
    double mid = (p + z2n / 2) / (1 + z2n), half = z * sqrt(p * (1 - p) / (double)n + z2n / (4 * (double)n)) / (1 + z2n);
    *lo = mid - half < 0 ? 0 : mid - half;
    *hi = mid + half > 1 ? 1 : mid + half;
}

double kvm_task_mcnemar_p(int64_t b, int64_t c)
{
    int64_t n = b + c, k = b < c ? b : c;
    if (n == 0) return 1.0;
    double tail = 0;
    for (int64_t i = 0; i <= k; i++) /* C(n, i) / 2^n in logs: n may be in the hundreds */
        tail += exp(lgamma((double)n + 1) - lgamma((double)i + 1) - lgamma((double)(n - i) + 1) - (double)n * log(2.0));
    return 2 * tail < 1 ? 2 * tail : 1.0;
}
