/* kvm_json.h: jansson loads of the JSON files a Hugging Face folder holds (config.json,
 * generation_config.json, tokenizer.json, tokenizer_config.json, model.safetensors.index.json)
 * with a leading UTF-8 byte-order mark (EF BB BF) skipped. Editors on Windows write one, and
 * jansson refuses it with "'[' or '{' expected near '\xef'", which names no cause. A UTF-16
 * byte-order mark (FF FE, FE FF) is refused instead, je->text saying so and to save the file as
 * UTF-8 (jansson's "unable to decode byte 0xff" named no cause either). */
#ifndef KVM_JSON_H
#define KVM_JSON_H

#include <jansson.h>
#include <stddef.h>

/* json_load_file(path, flags, je) after a UTF-8 byte-order mark at the file's start, if any;
 * NULL, je at line 1 column 1, for a UTF-16 byte-order mark.
 * Returns the new reference (the caller json_decrefs it), or NULL with je filled as jansson
 * fills it (an open failure: "unable to open PATH: reason", line -1). The caller checks first
 * that path is a regular file (kvm_file_check_found): a FIFO would block. */
json_t *kvm__json_load_file(const char *path, size_t flags, json_error_t *je);

/* json_loadb(buf, len, flags, je) after a UTF-8 byte-order mark at buf's start, if any; NULL
 * for a UTF-16 one, as kvm__json_load_file. */
json_t *kvm__json_loadb(const char *buf, size_t len, size_t flags, json_error_t *je);

#endif
