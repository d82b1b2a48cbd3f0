/* kvm_doctok.c: bounded tokenisation of documents (growing prefixes until the wanted ids
 * settle), so a 10 MB document costs what its first `context` tokens cost. */
#include "pipeline/kvm_doctok.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

enum { MARGIN_IDS = 64, BYTES_PER_ID = 6, FIRST_BYTES = 1024 };

/* Moves a cut back to the start of a UTF-8 code point (at most 3 continuation bytes). */
static size_t cut_at(const char *t, size_t len, size_t at)
{
    if (at >= len) return len;
    for (int k = 0; k < 3 && at > 0 && ((unsigned char)t[at] & 0xC0) == 0x80; k++) at--;
    return at;
}

static int keep_first(int32_t **ids, int64_t *n, int64_t n_want)
{
    if (*n > n_want) {
        int32_t *s = realloc(*ids, (size_t)n_want * sizeof **ids);
        if (s) *ids = s;
        *n = n_want;
    }
    return 0;
}

/* The first prefix kvm_doctok_encode tokenises for n_want ids, and the check prefix after L. */
static size_t first_bytes(int64_t n_want) { return (size_t)n_want * BYTES_PER_ID + FIRST_BYTES; }
static size_t check_bytes(size_t L) { return L + L / 4 + FIRST_BYTES; }

size_t kvm_doctok_begin_bytes(int64_t n_want) { return check_bytes(first_bytes(n_want)) + 1; }

/* A beginning text[0, len) shorter than the prefixes the loop would take (not the whole
 * text): settled when a prefix of it at least MARGIN_IDS * BYTES_PER_ID bytes (and a fifth)
 * shorter already holds n_want + MARGIN_IDS ids and agrees on the first n_want with the whole
 * beginning, as two of the loop's prefixes must. Without it a
 * beginning of 819 bytes holding 374 ids was "not enough" for 129 of them, only for its length
 * (serve's cut of an ask's document). Else *need_more. */
static int settle_beginning(const kvm_tokenizer *tok, const char *text, size_t len, int add_bos, int64_t n_want,
                            int32_t **ids, int64_t *n_ids, int *need_more)
{
    int32_t *a = NULL, *b = NULL;
    int64_t na = 0, nb = 0;
    /* the two prefixes at least MARGIN_IDS * BYTES_PER_ID bytes apart, a fifth on long ones:
     * merges reach a few tokens across a cut, never that far */
    const size_t gap = len / 5 > (size_t)MARGIN_IDS * BYTES_PER_ID ? len / 5 : (size_t)MARGIN_IDS * BYTES_PER_ID;
    if (gap >= len) return *need_more = 1, 0;
    int rc = kvm_tokenizer_encode(tok, text, cut_at(text, len, len - gap), add_bos, 0, &a, &na);
    if (rc) return rc;
    if (na >= n_want + MARGIN_IDS && !(rc = kvm_tokenizer_encode(tok, text, len, add_bos, 0, &b, &nb)) &&
        nb >= n_want && memcmp(a, b, (size_t)n_want * sizeof *a) == 0) {
        free(b);
        *ids = a;
        *n_ids = na;
        return keep_first(ids, n_ids, n_want);
    }
    free(a);
    free(b);
    if (rc) return rc;
    *need_more = 1;
    return 0;
}

int kvm_doctok_encode(const kvm_tokenizer *tok, const char *text, size_t len, int at_end, int add_bos,
                      int64_t n_want, int32_t **ids, int64_t *n_ids, int *need_more)
{
    if (!ids || !n_ids || n_want < 1 || (!at_end && !need_more))
        return kvm_err(KVM_EINVAL, "kvm_doctok_encode: NULL output or n_want %lld < 1", (long long)n_want);
    *ids = NULL;
    *n_ids = 0;
    if (need_more) *need_more = 0;
    size_t L = first_bytes(n_want);
    for (;;) {
        if (L >= len) {
            if (!at_end) return settle_beginning(tok, text, len, add_bos, n_want, ids, n_ids, need_more);
            int rc = kvm_tokenizer_encode(tok, text, len, add_bos, 0, ids, n_ids);
            return rc ? rc : keep_first(ids, n_ids, n_want);
        }
        int32_t *a = NULL, *b = NULL;
        int64_t na = 0, nb = 0;
        int rc = kvm_tokenizer_encode(tok, text, cut_at(text, len, L), add_bos, 0, &a, &na);
        if (rc) return rc;
        size_t L2 = check_bytes(L);      /* the check prefix (tokenisers can be superlinear: not 2L) */
        if (na >= n_want + MARGIN_IDS) { /* far enough past the cut: check against a longer prefix */
            if (L2 >= len && !at_end) {  /* the whole beginning as the check prefix */
                free(a);
                return settle_beginning(tok, text, len, add_bos, n_want, ids, n_ids, need_more);
            }
            if ((rc = kvm_tokenizer_encode(tok, text, cut_at(text, len, L2), add_bos, 0, &b, &nb))) {
                free(a);
                return rc;
            }
            int agree = nb >= n_want && memcmp(a, b, (size_t)n_want * sizeof *a) == 0;
            free(b);
            if (agree) {
                *ids = a;
                *n_ids = na;
                return keep_first(ids, n_ids, n_want);
            }
        }
        free(a);
        L *= 2;
    }
}
