/* kvm_utf8.h: turning the raw bytes of generated tokens into text that is valid UTF-8.
 *
 * A token's piece is any bytes: byte-level BPE splits one character over several tokens,
 * SentencePiece byte-fallback tokens (<0xNN>) are single bytes, and a generation may stop in
 * the middle of a character. kvm_utf8_stream takes the pieces one after the other and emits
 * only complete, valid characters: a character split across pieces is held back until its
 * last byte arrives; bytes that can never form valid UTF-8, and NUL, become U+FFFD
 * (EF BF BD); at the end, an unfinished character becomes U+FFFD too. Ill-formed input is
 * replaced by the "maximal subpart" rule of the Unicode Standard (§3.9, U+FFFD substitution,
 * the rule WHATWG's decoder and Python's errors="replace" follow): each maximal prefix of a
 * well-formed sequence, and each byte that starts none, is one U+FFFD. So overlong forms
 * (C0 80, E0 80 80), surrogates (ED A0 80) and code points above U+10FFFF (F4 90 80 80)
 * give one U+FFFD per byte, and E4 BD followed by ASCII gives one U+FFFD then the ASCII.
 * Valid input, NUL excepted, passes unchanged. The result never depends on how the input is
 * split into pieces.
 *
 * kvmill serve puts the result in an answer's `text` (the exact ids stay in its `tokens`);
 * kvmill generate prints raw bytes as run.c does and does not use this. */
#ifndef KVM_UTF8_H
#define KVM_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* The replacement character U+FFFD as UTF-8. */
#define KVM_UTF8_REPLACEMENT "\xef\xbf\xbd"

/* Assembles text; zero-initialise ({0}) before the first push. Not shared between threads. */
typedef struct kvm_utf8_stream {
    char *text;         /* valid UTF-8 without NUL so far, NUL-terminated (malloc'ed; NULL until
                           the first byte is emitted) */
    size_t len;         /* bytes of text, the terminator not counted */
    size_t cap;         /* allocated bytes of text */
    uint8_t pending[4]; /* the start of a character whose remaining bytes have not arrived */
    int n_pending;      /* bytes in pending, 0..3 */
    int64_t n_replaced; /* U+FFFD written in place of bad bytes so far */
} kvm_utf8_stream;

/* Appends n bytes (any values; bytes may be NULL when n == 0): every character they complete
 * goes to s->text, an incomplete valid prefix at the end is held in s->pending, bad bytes
 * become U+FFFD. Errors: KVM_EINVAL (s NULL, bytes NULL with n > 0), KVM_ENOMEM (s->text
 * keeps what was emitted before the failing byte). */
int kvm_utf8_push(kvm_utf8_stream *s, const void *bytes, size_t n);

/* Ends the input: held-back bytes of an unfinished character become one U+FFFD. Pushing again
 * afterwards starts a new character. Errors: KVM_EINVAL, KVM_ENOMEM. */
int kvm_utf8_finish(kvm_utf8_stream *s);

/* Frees s->text and zeroes s. Accepts NULL. */
void kvm_utf8_stream_free(kvm_utf8_stream *s);

/* One shot: push(bytes, n) then finish. On success *out is malloc'ed (never NULL, even for
 * n == 0), *out_len bytes plus a terminating NUL, valid UTF-8 without NUL; *n_replaced (may
 * be NULL) counts the U+FFFD inserted. On error *out is NULL. Errors: KVM_EINVAL, KVM_ENOMEM. */
int kvm_utf8_sanitize(const void *bytes, size_t n, char **out, size_t *out_len, int64_t *n_replaced);

/* 1 when s[0, n) is valid UTF-8 (RFC 3629: no overlong forms, surrogates or code points above
 * U+10FFFF) without NUL, else 0. */
int kvm_utf8_valid(const void *s, size_t n);

/* The longest prefix of valid UTF-8 text s[0, n) that is at most max bytes and ends on a
 * character boundary (s must be valid UTF-8, as kvm_utf8_stream's text is). */
size_t kvm_utf8_cut(const char *s, size_t n, size_t max);

#endif
