/* kvm_sculpt_opts.h: one table of KVSculpt settings (name, type, bounds, help) that drives
 * `kvmill sculpt --NAME VALUE`, `kvmill eval --method sculpt:NAME=VALUE,...` and their --help,
 * so both commands accept every sculpt option with the same names and checks. */
#ifndef KVM_SCULPT_OPTS_H
#define KVM_SCULPT_OPTS_H

#include "compress/sculpt/kvm_sculpt.h"

#include <stdio.h>

/* One setting. */
typedef struct kvm_sculpt_setting {
    const char *name;  /* option name without "--" ("retain", "lambda", ...) */
    const char *help;  /* one line, with the default and the unit */
} kvm_sculpt_setting;

/* The settings: *n rows, static and read-only. */
const kvm_sculpt_setting *kvm_sculpt_settings(int *n);

/* Sets option `name` of o from its text value (flags such as "bias" take "1"/"0"; an empty
 * or NULL value means 1). Checks the bounds. Returns 0, KVM_ENOTFOUND (no such option),
 * KVM_EINVAL (bad value; the message names the option, the value and the range). */
int kvm_sculpt_opts_set(kvm_sculpt_opts *o, const char *name, const char *value);

/* Applies "name=value,name=value,..." (a method ARG; "bias" alone sets the flag). Returns 0 or
 * the first error of kvm_sculpt_opts_set. NULL or "" changes nothing. */
int kvm_sculpt_opts_parse(kvm_sculpt_opts *o, const char *arg);

/* Applies a harness budget (compress/kvm_compress.h): ratio r means k = r·(N−m) (o->ratio);
 * tokens b means b entries per KV head including the retain zone, k = b − m (o->k_entries).
 * Call after the retain size is final. Returns 0 or KVM_EINVAL (b ≤ m, or neither set). */
int kvm_sculpt_opts_set_budget(kvm_sculpt_opts *o, const kvm_budget *b);

/* Prints "  --NAME  help" lines for every setting to f. */
void kvm_sculpt_opts_help(FILE *f);

#endif
