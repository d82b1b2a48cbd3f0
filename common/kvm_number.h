/* kvm_number.h: the one strict parse of a decimal number that every user-given float goes
 * through (config values, CLI flags, method options, query_source shares), so that "0x10",
 * " 1", "inf", "nan" or "1e999" are refused where a user wrote a number, not read by strtod's
 * wider grammar. */
#ifndef KVM_NUMBER_H
#define KVM_NUMBER_H

#include <stddef.h>

/* Parses all of `s` as a decimal number: an optional sign, digits with an optional fraction
 * (at least one digit in all: "1", "1.", ".5", "-0.25"), and an optional exponent ("2e-5",
 * "1E3"); nothing else (no whitespace, hexadecimal, inf or nan). On success writes the value
 * to *out and returns 0 (one that overflows a double, or underflows it to zero or a
 * subnormal, is refused with KVM_ERANGE: "1e-400" is not what its writer meant by 0); other
 * text returns KVM_EINVAL; either way *out is left alone, with no detail message (the caller
 * names the setting). `s` may be NULL (refused). Thread-safe. */
int kvm_parse_decimal(const char *s, double *out);

/* Why `s`, a number kvm_parse_decimal refused with KVM_ERANGE, is no value of [lo, hi], written
 * to why (why_n bytes, NUL-terminated): one that underflows a double ("1e-400") when 0 is in
 * [lo, hi] is "S is too close to 0 for a double (...): write 0 if 0 is meant, ..." (it is not
 * outside the range); otherwise "S is outside [lo, hi] (beyond a double's range)". Returns why.
 * Thread-safe. */
const char *kvm_decimal_range_why(const char *s, double lo, double hi, char *why, size_t why_n);

/* The word for a count in a message: `one` when n is 1, else `many` ("1 document", "0
 * documents"; kvm_plural(n, "", "s") for a plural ending, kvm_plural(n, "was", "were")). */
static inline const char *kvm_plural(long long n, const char *one, const char *many) { return n == 1 ? one : many; }

#endif
