/* kvm_number.c: strict decimal parsing (kvm_number.h): the grammar is checked here, then strtod
 * converts the string it has accepted. */
#include "common/kvm_number.h"
#include "common/kvm_error.h"

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* the digits at *p, skipped; returns how many */
static int digits(const char **p)
{
    int n = 0;
    while (isdigit((unsigned char)**p))
        (*p)++, n++;
    return n;
}

int kvm_parse_decimal(const char *s, double *out)
{
    if (!s) return KVM_EINVAL;
    const char *p = s;
    if (*p == '+' || *p == '-') p++;
    int n = digits(&p);
    if (*p == '.') p++, n += digits(&p);
    if (n == 0) return KVM_EINVAL;
    if (*p == 'e' || *p == 'E') {
        p++;
        if (*p == '+' || *p == '-') p++;
        if (digits(&p) == 0) return KVM_EINVAL;
    }
    if (*p) return KVM_EINVAL;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (end != p) return KVM_EINVAL;
    if (!isfinite(v) || errno == ERANGE) return KVM_ERANGE; /* 1e999, and 1e-400 read as 0 */
    *out = v;
    return 0;
}

const char *kvm_decimal_range_why(const char *s, double lo, double hi, char *why, size_t why_n)
{
    /* 1e-400 is no value outside [0, hi]: it is too close to 0 for a double, which reads it as 0 */
    if (fabs(strtod(s, NULL)) < 1.0 && lo <= 0 && hi >= 0)
        snprintf(why, why_n,
                 "%s is too close to 0 for a double (it would read as 0, or lose digits): write 0 if 0 is meant, "
                 "or a value of magnitude at least %g",
                 s, DBL_MIN);
    else
        snprintf(why, why_n, "%s is outside [%g, %g] (beyond a double's range)", s, lo, hi);
    return why;
}
