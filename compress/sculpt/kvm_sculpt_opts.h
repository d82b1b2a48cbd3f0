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

/* Applies a harness budget (compress/kvm_compress.h): ratio r means k = r·(N−m) (o->ratio);
 * tokens b means b entries per KV head including the retain zone, k = b − m (o->k_entries).
 * Call after the retain size is final. Returns 0 or KVM_EINVAL (b ≤ m, or neither set). */
int kvm_sculpt_opts_set_budget(kvm_sculpt_opts *o, const kvm_budget *b);

/* Settings valid alone that do not go together: on_policy (Attention Matching's on-policy
 * mode, arXiv 2602.16284) without a repeat or continuation query share (KVM_EINVAL: its
 * queries come from forward passes over the compressed layers) or with an alloc other than
 * uniform (KVM_ENOTSUP: one layer at a time, the pilot allocates across layers). Checked by
 * every compression and, before any work, by the commands and kvm_jobcfg_check. Returns 0 or
 * the error with a message naming the settings. */
int kvm_sculpt_opts_check_combination(const kvm_sculpt_opts *o);

/* Prints "  --FLAG  help" lines for every current (not deprecated) setting to f. */
void kvm_sculpt_opts_help(FILE *f);

#endif
