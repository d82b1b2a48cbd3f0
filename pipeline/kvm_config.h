/* kvm_config.h: pipeline configuration. One table of settings (section, key, type, default,
 * bounds, unit, help — pipeline/kvm_config_table.c) drives INI parsing (libinih),
 * validation, `--dump-config` and the comments of the configs/ files, as Redis's config table
 * does. Values may use ${VAR} and ${VAR:-default} (VAR unset or empty: the default, which may
 * itself hold references, up to 8 deep: ${A:-${B:-x}}); relative paths resolve against the
 * working directory. A loaded config is validated once, then read-only (thread-safe to read). */
#ifndef KVM_CONFIG_H
#define KVM_CONFIG_H

#include <stdint.h>
#include <stdio.h>

/* The least [run] heartbeat_ms x liveness a config may give (ms): the time after which a
 * silent worker is declared dead must span several of the orchestrator's loops (100 ms). */
#define KVM_CONFIG_MIN_DEAD_MS 200

typedef enum kvm_cfg_type {
    KVM_CFG_STR,   /* free text */
    KVM_CFG_PATH,  /* a file or folder; made absolute against the working directory */
    KVM_CFG_INT,   /* integer within [lo, hi] */
    KVM_CFG_FLOAT, /* finite number within [lo, hi] */
    KVM_CFG_BOOL,  /* true/false, yes/no, on/off, 1/0 */
    KVM_CFG_ENUM,  /* one of the '|'-separated choices */
} kvm_cfg_type;

/* One documented setting. */
typedef struct kvm_cfg_setting {
    const char *section; /* INI section, e.g. "compress" */
    const char *key;     /* key within it, e.g. "ratio" */
    kvm_cfg_type type;
    const char *def;     /* default value as text; NULL = required */
    double lo, hi;       /* bounds for INT/FLOAT; PATH: lo = 1 refuses an empty value */
    const char *choices; /* ENUM: "a|b|c" */
    const char *unit;    /* "tokens", "ms", "bytes", ... or "" */
    const char *help;    /* one line */
} kvm_cfg_setting;

/* The table (terminated by an entry with section == NULL). */
extern const kvm_cfg_setting kvm_cfg_settings[];

/* A deprecated key still accepted in files: [section] old is read as [section] key, with a
 * one-line warning on stderr naming the file and the new key. */
typedef struct kvm_cfg_alias {
    const char *section; /* "compress" */
    const char *old;     /* "synthetic_queries" */
    const char *key;     /* "queries" */
} kvm_cfg_alias;

/* The aliases (terminated by an entry with section == NULL). */
extern const kvm_cfg_alias kvm_cfg_aliases[];

typedef struct kvm_config kvm_config;

/* Parses and validates an INI file. Every error names file, line and key: unknown section
 * or key, bad value (type, bounds, choice), unset ${VAR} without default, missing required
 * key, unreadable file. Returns 0 and *out, KVM_ENOTFOUND/KVM_EIO (file), KVM_EINVAL
 * (content; message in kvm_errmsg()), KVM_ENOMEM. Free with kvm_config_free. */
int kvm_config_load(const char *path, kvm_config **out);

/* kvm_config_load for a program that reads only `sections` (a NULL-terminated list, kept by
 * pointer while the config lives; NULL = every section): required keys of other sections may be
 * missing (kvmill store serve reads [store] and [security]; a store host needs no [model] path).
 * Their getters then return the table's default, NULL for a required string. Errors as
 * kvm_config_load's. */
int kvm_config_load_sections(const char *path, const char *const *sections, kvm_config **out);

/* Same from a string; `name` stands for the file name in messages. */
int kvm_config_parse(const char *text, const char *name, kvm_config **out);

/* Frees. Accepts NULL and *c == NULL; sets *c = NULL. */
void kvm_config_free(kvm_config **c);

/* Typed getters: the value set in the file, else the default. (section, key) must be in the
 * table with that type (a programming error aborts otherwise). Strings valid while c lives. */
const char *kvm_config_str(const kvm_config *c, const char *section, const char *key);
int64_t kvm_config_int(const kvm_config *c, const char *section, const char *key);
double kvm_config_float(const kvm_config *c, const char *section, const char *key);
int kvm_config_bool(const kvm_config *c, const char *section, const char *key);

/* 1 when the file set the key explicitly. */
int kvm_config_is_set(const kvm_config *c, const char *section, const char *key);

/* Overrides a value after loading (e.g. a --store flag), validated like the file's; taken as
 * it is: ${VAR} is expanded only in the file's lines (a flag's value has been through the
 * shell already, and a path may hold "${"). Returns 0 or KVM_EINVAL (message names the key). */
int kvm_config_set(kvm_config *c, const char *section, const char *key, const char *value);

/* Writes every setting of `section` (NULL = all) as "section.key=value\n" in table order:
 * the canonical encoding the config id is hashed from (resolved values, defaults included). */
int kvm_config_canonical(const kvm_config *c, const char *section, char **out, size_t *len);

/* Prints the resolved configuration as INI with each key's help and unit (--dump-config); c
 * NULL prints the defaults. A value that would not read back as itself (see
 * kvm_config_dump_env) is written as ${KVMILL_CFG_SECTION_KEY} with a comment saying why, and
 * its "export KVMILL_CFG_SECTION_KEY='value'" line (shell-quoted) goes to `notes` (NULL: none).
 * Returns how many values were written so. */
int kvm_config_dump(const kvm_config *c, FILE *f, FILE *notes);

/* The resolved configuration as INI for another process to load (serve's decode workers): a
 * value that would not read back as itself (longer than libinih's 198-character line, as a deep
 * path given through ${VAR} is; a ';' after a blank; blanks at an end; "${") is written as a
 * reference ${KVMILL_CFG_SECTION_KEY} to an environment variable this call sets, which the
 * processes started afterwards inherit. Returns 0, KVM_ENOMEM (setenv) or KVM_EIO. */
int kvm_config_dump_env(const kvm_config *c, FILE *f);

/* The file the config was loaded from ("<string>" for kvm_config_parse). */
const char *kvm_config_path(const kvm_config *c);

#endif
