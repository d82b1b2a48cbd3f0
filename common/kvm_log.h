/* kvm_log.h: the one log writer of every kvmill process (orchestrator, stages, store service,
 * serve). Text lines as before ("kvmill run: ...", "[prefill id] ...") or, with
 * `[run] log_format = json` (stages: --log-format json, or KVMILL_LOG_FORMAT=json inherited
 * from the orchestrator), one JSON object per line on stderr for log collectors:
 *   {"time": "2026-12-01T12:00:00.123Z", "stage": "compress", "pid": 42, "level": "info",
 *    "event": "job_done", "msg": "job 3 stage compress 12.5 ms 4096 bytes", <fields>}
 * time is UTC with milliseconds; level is debug|info|warn|error; event is a fixed snake_case
 * name per kind of line (README lists them); msg is the text line without its prefix; fields
 * are the event's values (job_id, worker, ms, bytes, ...) with their JSON types.
 * Process-wide (like stderr itself): set up once in main, then thread-safe (one write per line). */
#ifndef KVM_LOG_H
#define KVM_LOG_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

typedef enum kvm_log_format { KVM_LOG_TEXT = 0, KVM_LOG_JSON = 1 } kvm_log_format;
typedef enum kvm_log_level { KVM_LOG_DEBUG = 0, KVM_LOG_INFO, KVM_LOG_WARN, KVM_LOG_ERROR } kvm_log_level;

/* One field of a JSON line: key and a value of one kind. */
typedef struct kvm_log_field {
    const char *key; /* JSON key; not one of time, stage, pid, level, event, msg */
    char kind;       /* 'i': i, 'f': f (non-finite written as null), 's': s (NULL written as null) */
    int64_t i;
    double f;
    const char *s;
} kvm_log_field;
#define KVM_LOG_I(k, v) ((kvm_log_field){.key = (k), .kind = 'i', .i = (int64_t)(v)})
#define KVM_LOG_F(k, v) ((kvm_log_field){.key = (k), .kind = 'f', .f = (double)(v)})
#define KVM_LOG_S(k, v) ((kvm_log_field){.key = (k), .kind = 's', .s = (v)})

/* Parses "text" or "json". Returns 0, or KVM_EINVAL naming the value. */
int kvm_log_format_parse(const char *name, kvm_log_format *out);

/* Sets this process's stage name (the JSON "stage"), the text prefix ("kvmill run: ",
 * "[prefill w1] "; copied, may be "") and the format. format NULL: KVMILL_LOG_FORMAT from the
 * environment, else text. Returns KVM_EINVAL (detail names the bad value) and keeps text. */
int kvm_log_setup(const char *stage, const char *text_prefix, const char *format);

/* The format kvm_log_setup chose (KVM_LOG_TEXT before it is called). */
kvm_log_format kvm_log_format_get(void);

/* Copies s into out (out_size >= 1 bytes, always NUL-terminated; cut short at a whole byte or
 * escape when it does not fit) with every control byte (0x00-0x1f, 0x7f) written as the four
 * characters \xHH, and each C1 control in UTF-8 (0xc2 0x80-0x9f) as two such escapes, so an
 * untrusted name (a document's, a JSONL id) can neither drive the
 * terminal nor fake a line of output. keep_lines = 1 keeps '\n' and '\t' (a message of
 * several lines); 0 escapes them too (one name, one line). Returns out. Thread-safe. */
char *kvm_log_escape(const char *s, int keep_lines, char *out, size_t out_size);

/* Writes one line: text mode prints prefix + the formatted message (fields are not shown:
 * the message says them); JSON mode prints the object above. A message starting with '\n'
 * (after a redrawn progress line) gets that newline first in text mode; JSON drops it. */
void kvm_log(kvm_log_level level, const char *event, const kvm_log_field *fields, int n_fields, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void kvm_logv(kvm_log_level level, const char *event, const kvm_log_field *fields, int n_fields, const char *fmt,
              va_list ap);

#endif
