/* kvm_sculpt_opts.h: the KVSculpt settings of compress/sculpt/kvm_sculpt_settings.h (one row
 * per setting: name, kind, bounds, default, help) and the parsers built on them, so that
 * `kvmill sculpt --NAME VALUE`, `kvmill eval --NAME VALUE`, method option strings
 * `sculpt:NAME=VALUE:...` and the [compress] NAME keys accept every setting with one name and
 * the same checks. Names are snake_case ("pilot_rounds"); flags spell them with '-'
 * ("--pilot-rounds"); option strings accept either. */
#ifndef KVM_SCULPT_OPTS_H
#define KVM_SCULPT_OPTS_H

#include "compress/sculpt/kvm_sculpt.h"

#include <stdio.h>

/* One setting. */
typedef struct kvm_sculpt_setting {
    const char *name;        /* the name and [compress] key ("retain", "pilot_rounds") */
    const char *flag;        /* the flag without "--": name with '-' for '_' ("pilot-rounds") */
    const char *help;        /* one line, with the default and the unit */
    const char *def;         /* the default as text ("32", "false", "uniform") */
    const char *replaced_by; /* NULL, or the name that replaces this deprecated one */
    int is_flag;             /* 1: boolean: `--bias` / "bias" alone set it (value "1"/"0"/"true"/...) */
    int in_config;           /* 1: also the [compress] key `name` (pipeline/kvm_config_table.c) */
} kvm_sculpt_setting;

/* The settings: *n rows in table order, static and read-only, deprecated names included. */
const kvm_sculpt_setting *kvm_sculpt_settings(int *n);

/* The setting called `name` (the first `len` bytes; '-' and '_' are the same), deprecated
 * names included, or NULL. */
const kvm_sculpt_setting *kvm_sculpt_setting_find(const char *name, size_t len);

/* Sets option `name` (any spelling kvm_sculpt_setting_find accepts) of o from its text value
 * (boolean settings take 1/0/true/false/yes/no/on/off; an empty or NULL value means 1).
 * "budget" b sets k = b − retain with the retain zone set so far (0: use the ratio).
 * "device" cpu|cuda:N sets cuda and cuda_device, cuda:N only where kvm_sculpt_backend_cuda(N)
 * gives a backend (so a command refuses before its prefill). Checks the bounds. Returns 0,
 * KVM_ENOTFOUND (no such option), KVM_EINVAL (bad value; the message names the option, the
 * value and the range), KVM_EDEVICE / KVM_ENOTSUP (no such CUDA device, or no CUDA in this
 * build: the message names the device). */
int kvm_sculpt_opts_set(kvm_sculpt_opts *o, const char *name, const char *value);

/* Applies "name=value,name=value,..." (a method ARG; "bias" alone sets the flag). Later
 * settings override earlier ones; of budget, ratio and entries the last one given decides
 * the size, applied after every other setting (so "budget=64,retain=16" means k = 48).
 * "device=cuda,N" is read as device=cuda:N (method strings join options with ':', which the
 * callers turn into ','). Returns
 * 0 or the first error of kvm_sculpt_opts_set. NULL or "" changes nothing. */
int kvm_sculpt_opts_parse(kvm_sculpt_opts *o, const char *arg);

/* The first item of the option list `list` (items separated by any character of `seps`, e.g.
 * ",:" for a method ARG) that sets the cache's size (budget, ratio or entries, in any spelling
 * kvm_sculpt_setting_find accepts), as a pointer into list (the item runs to the next separator);
 * NULL when none does, or list is NULL. For callers whose size comes from elsewhere (eval's
 * --budget / --ratio, calibrate's per-layer budgets), where such an item would be ignored. */
const char *kvm_sculpt_opts_find_size(const char *list, const char *seps);

/* Refuses a setting named twice in the option list `list` (items "name[=value]" separated by
 * any character of `seps`, as kvm_sculpt_opts_find_size reads them): "retain=8:retain=16", also
 * through a deprecated name ("iters=5:iterations=7"). kvm_sculpt_opts_parse lets a later item
 * override an earlier one, which the callers need for lists they compose (eval's sculpt flags,
 * then a method's own options over them); a list the user wrote is checked with this first, so
 * that one of the two values is not dropped unsaid. entries is budget's old name and counts as
 * it; budget and ratio are two settings (the callers refuse a size among a user's options on
 * their own). Unknown names are skipped (the parser refuses them). Returns 0, or KVM_EINVAL with a message naming the
 * setting and both items. NULL changes nothing. */
int kvm_sculpt_opts_check_repeats(const char *list, const char *seps);

/* Applies a harness budget (compress/kvm_compress.h): ratio r means k = r·(N−m) (o->ratio);
 * tokens b means b entries per KV head including the retain zone, k = b − m (o->k_entries).
 * Call after the retain size is final. Returns 0 or KVM_EINVAL (b ≤ m, or neither set). */
int kvm_sculpt_opts_set_budget(kvm_sculpt_opts *o, const kvm_budget *b);

/* Longest canonical text kvm_sculpt_opts_canonical writes, NUL included. */
#define KVM_SCULPT_OPTS_CANONICAL_MAX 2048

/* The canonical text of the settings in o that change a compressed result: every [compress]
 * key of the table (in_config rows) plus method and future, in table order, as
 * "name=value,name=value,..." (the syntax kvm_sculpt_opts_parse reads): integers in decimal,
 * numbers in the shortest "%.Ng" that reads back to the same double, booleans true/false,
 * words by name, query_source as kvm_sculpt_qsource_format. Not written: the size (ratio,
 * budget, entries: the caller's budget), threads and device (the reader's own; results do not
 * depend on them beyond float rounding). Equal options give equal text. buf[size]; returns 0,
 * or KVM_EINVAL when size is too small (KVM_SCULPT_OPTS_CANONICAL_MAX always suffices). What a
 * PolyKV strategy file (KVST v2) and a calibration's signals CSV record. */
int kvm_sculpt_opts_canonical(const kvm_sculpt_opts *o, char *buf, size_t size);

/* Reads such a text (text[0, len), not NUL-terminated; no NUL inside) into *o, starting from
 * kvm_sculpt_opts_default(): each "name=value" must be one kvm_sculpt_opts_canonical writes,
 * spelled as it spells it, in its order, each at most once; a setting the text lacks keeps its
 * default (a text written before the setting existed). Returns 0, or KVM_EINVAL with a message
 * naming the item and its byte offset in text (unknown name, bad value, not canonical, out of
 * order, repeated, too long). */
int kvm_sculpt_opts_from_canonical(const char *text, size_t len, kvm_sculpt_opts *o);

/* The recorded settings (kvm_sculpt_opts_canonical's) in which a and b differ, into out[n] as
 * "name=A (LABEL: B), ..." (truncated to fit). Returns 1 when they are equal (out = ""), 0 when
 * they differ. */
int kvm_sculpt_opts_diff(const kvm_sculpt_opts *a, const kvm_sculpt_opts *b, const char *label, char *out, size_t n);

/* Settings valid alone that do not go together: queries = 0 with retain = 0 (KVM_EINVAL: no
 * training query at all), a query_source source whose share of queries > 0 rounds to none
 * (KVM_EINVAL: it would be ignored), on_policy (Attention Matching's on-policy
 * mode, arXiv 2602.16284) without a repeat or continuation query share or with queries = 0
 * (KVM_EINVAL: its queries come from forward passes over the compressed layers) or with an alloc other than
 * uniform (KVM_ENOTSUP: one layer at a time, the pilot allocates across layers). Checked by
 * every compression and, before any work, by the commands and kvm_jobcfg_check. Returns 0 or
 * the error with a message naming the settings. */
int kvm_sculpt_opts_check_combination(const kvm_sculpt_opts *o);

/* The items of the option list `list` (items "name[=value]" separated by any character of
 * `seps`, e.g. ":" for a method ARG) that o's method never reads, given o's other settings:
 * am and kvzip run no L-BFGS (rounds, iterations, history, tolerance, gradient_tolerance,
 * carry_history, round_tolerance, kcap, bias, am_start, pilot_rounds, pilot_iterations;
 * kvzip also fits no values: ridge, ridge_f32, vcap); selectfit and joint-fixed never move keys
 * (kcap); joint-fixed always fits biases (bias); selectfit without bias runs no L-BFGS rounds;
 * alloc = uniform runs no allocation pilot (power, pilot_rounds, pilot_iterations); a
 * query_source without synthetic queries (or queries = 0) places none (future).
 * Writes their names as given, ", "-separated, into out[n] (truncated to fit); returns how
 * many. Unknown names are not counted (the parser refuses them). For a note, not a refusal:
 * strategy files and configs share one option set across methods. */
int kvm_sculpt_opts_unused(const kvm_sculpt_opts *o, const char *list, const char *seps, char *out, size_t n);

/* Prints "  --FLAG  help" lines for every current (not deprecated) setting to f. */
void kvm_sculpt_opts_help(FILE *f);

#endif
