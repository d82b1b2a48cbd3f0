/* kvm_docdedup.c: the documents of a list that repeat an earlier one, by the hash of the ids a
 * command reads from each (a hash set over the firsts, so a long list is not compared pairwise). */
#include "pipeline/kvm_docdedup.h"
#include "common/kvm_error.h"
#include "pipeline/kvm_idxset.h"

#include <string.h>

/* A document hash looked up among the first of each set of equal ones. */
typedef struct dedup_probe {
    const kvm_store_id *hash; /* [n] every document's */
    const kvm_store_id *want; /* the one looked for */
} dedup_probe;

static int dedup_same(void *user, int64_t idx)
{
    const dedup_probe *p = user;
    return !memcmp(p->hash[idx].b, p->want->b, sizeof p->want->b);
}

int64_t kvm_docdedup_find(const char *cmd, const char *action, const kvm_store_id *hash, const char *const *names,
                          int64_t n, FILE *notes, int64_t *dup_of)
{
    kvm_idxset firsts = {0};
    int64_t distinct = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t key;
        memcpy(&key, hash[i].b, sizeof key); /* BLAKE2b bytes: any 8 are uniform */
        dedup_probe p = {hash, &hash[i]};
        dup_of[i] = kvm_idxset_find(&firsts, key, dedup_same, &p);
        if (dup_of[i] >= 0) {
            if (notes)
                fprintf(notes, "kvmill %s: note: %s has the same content as %s; %s\n", cmd, names[i], names[dup_of[i]],
                        action);
            continue;
        }
        if (kvm_idxset_add(&firsts, key, i)) {
            kvm_idxset_free(&firsts);
            return KVM_ENOMEM;
        }
        distinct++;
    }
    kvm_idxset_free(&firsts);
    return distinct;
}
