/* kvm_idxset.c: the index set (kvm_idxset.h). */
#include "pipeline/kvm_idxset.h"
#include "common/kvm_error.h"

#include <stdlib.h>

/* Mixes the hash (murmur3's finalizer) so that hashes equal in their low bits spread out. */
static uint64_t mix(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
}

int64_t kvm_idxset_find(const kvm_idxset *s, uint64_t hash, kvm_idxset_match_fn match, void *user)
{
    if (!s->slot) return -1;
    for (uint64_t i = mix(hash) & (s->cap - 1);; i = (i + 1) & (s->cap - 1)) {
        const kvm_idxset_slot *e = &s->slot[i];
        if (e->idx < 0) return -1; /* never full: grown at half */
        if (e->hash == hash && match(user, e->idx)) return e->idx;
    }
}

static void put(kvm_idxset_slot *slot, uint64_t cap, uint64_t hash, int64_t idx)
{
    uint64_t i = mix(hash) & (cap - 1);
    while (slot[i].idx >= 0)
        i = (i + 1) & (cap - 1);
    slot[i] = (kvm_idxset_slot){.hash = hash, .idx = idx};
}

int kvm_idxset_add(kvm_idxset *s, uint64_t hash, int64_t idx)
{
    if ((uint64_t)(s->n + 1) * 2 > s->cap) {
        uint64_t cap = s->cap ? 2 * s->cap : 64;
        kvm_idxset_slot *slot = malloc(cap * sizeof *slot);
        if (!slot) return kvm_err(KVM_ENOMEM, "out of memory (index set of %lld items)", (long long)s->n + 1);
        for (uint64_t i = 0; i < cap; i++)
            slot[i].idx = -1;
        for (uint64_t i = 0; i < s->cap; i++)
            if (s->slot[i].idx >= 0) put(slot, cap, s->slot[i].hash, s->slot[i].idx);
        free(s->slot);
        s->slot = slot;
        s->cap = cap;
    }
    put(s->slot, s->cap, hash, idx);
    s->n++;
    return 0;
}

void kvm_idxset_free(kvm_idxset *s)
{
    free(s->slot);
    *s = (kvm_idxset){0};
}

uint64_t kvm_idxset_hash_str(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}
