/* kvm_task.h: task-accuracy cases for compressed caches (issue 14, item 3): a fact inserted
 * into a document at a depth, a question about it, the answer scored by exact match. Cases
 * are a pure function of (task, document text, case index): the generator is deterministic
 * and committed, never hand-picked. Needle-in-a-haystack style as in Kamradt (2023) and the
 * passkey retrieval of Mohtashami & Jaggi (arXiv 2305.16300). */
#ifndef KVM_TASK_H
#define KVM_TASK_H

#include <stddef.h>
#include <stdint.h>

typedef enum kvm_task_kind {
    KVM_TASK_PASSKEY,  /* a five-digit pass key; "What is the pass key?" */
    KVM_TASK_RECALL,   /* a person's full name for a role; "What is the name of the <role>?" */
    KVM_TASK_MULTIKEY, /* four door codes at four depths; one door's code is asked */
} kvm_task_kind;

/* Depths of the asked fact: 0.1, 0.2, ..., 0.9 of the document's characters. */
enum { KVM_TASK_DEPTHS = 9, KVM_TASK_MULTI_KEYS = 4 };

/* One case. */
typedef struct kvm_task_case {
    char *document;  /* the text with the fact(s) inserted at sentence boundaries, malloc'ed */
    size_t document_len; /* its bytes: a document's NUL bytes are kept, so strlen may be less */
    char question[160]; /* the question, with the answer-format instruction */
    char answer[64];    /* the expected answer */
    double depth;       /* where the asked fact starts, share of the document's characters */
} kvm_task_case;

/* "passkey", "recall", "multikey" -> *out. Returns 0, or KVM_EINVAL naming the valid tasks. */
int kvm_task_parse(const char *name, kvm_task_kind *out);

/* The name of a kind ("passkey", ...). */
const char *kvm_task_name(kvm_task_kind kind);

/* Case `index` of task kind over text[0, len): depth 0.1·(1 + index mod 9); the fact's values
 * (digits, names, which door is asked) from a splitmix64 stream seeded by (kind, index). The
 * fact goes after the first sentence end (". ", "! ", "? ", or a newline) at or after depth·len
 * (when there is none, at the first UTF-8 character boundary from depth·len on). Fills out (kvm_task_case_deinit frees
 * it). Returns 0, KVM_EINVAL (empty text), KVM_ENOMEM. */
int kvm_task_make(kvm_task_kind kind, const char *text, size_t len, uint64_t index, kvm_task_case *out);

/* Frees the document text kvm_task_make built into c and sets it NULL; accepts one already NULL. */
void kvm_task_case_deinit(kvm_task_case *c);

/* Exact match: 1 when `answer` occurs in generated[0, len) (ASCII case folded) with no letter
 * or digit right before or after it, so "The pass key is 48213." matches 48213 but 482130 and
 * "Anna Bell" for "Anna Bellows" do not. */
int kvm_task_match(const char *answer, const char *generated, size_t len);

/* 1 when generated[0, len) holds the answer as kvm_task_match finds it and a character after
 * it, so no later token can change the score: the answer is complete (decoding may stop). */
int kvm_task_answered(const char *answer, const char *generated, size_t len);

/* Wilson score 95% interval (z = 1.96) of a share k/n, n ≥ 1: [*lo, *hi] within [0, 1]. */
void kvm_task_wilson(int64_t k, int64_t n, double *lo, double *hi);

/* Exact two-sided McNemar test of paired right/wrong outcomes: b pairs right only under A, c
 * right only under B; p = min(1, 2·P(X ≤ min(b, c))), X ~ Binomial(b + c, 1/2); 1 when
 * b + c = 0. */
double kvm_task_mcnemar_p(int64_t b, int64_t c);

#endif
