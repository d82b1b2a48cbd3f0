/* kvm_joblist.c: jobs grouped by state (kvm_joblist.h): intrusive lists over index arrays. */
#include "pipeline/kvm_joblist.h"
#include "common/kvm_error.h"

#include <stdlib.h>
#include <string.h>

int kvm_joblist_init(kvm_joblist *l, int64_t n, int n_states, int initial)
{
    memset(l, 0, sizeof *l);
    if (n < 0 || n_states < 1 || n_states > KVM_JOBLIST_MAX_STATES || initial < 0 || initial >= n_states)
        return kvm_err(KVM_EINVAL, "job lists: %lld items, %d states, initial state %d (items >= 0, states in [1, %d])",
                       (long long)n, n_states, initial, KVM_JOBLIST_MAX_STATES);
    size_t m = (size_t)(n > 0 ? n : 1);
    l->prev = malloc(m * sizeof *l->prev);
    l->next = malloc(m * sizeof *l->next);
    l->state = malloc(m);
    if (!l->prev || !l->next || !l->state) {
        kvm_joblist_deinit(l);
        return kvm_err(KVM_ENOMEM, "out of memory (job lists of %lld jobs)", (long long)n);
    }
    l->n = n;
    l->n_states = n_states;
    for (int s = 0; s < KVM_JOBLIST_MAX_STATES; s++) l->head[s] = l->tail[s] = -1;
    for (int64_t i = 0; i < n; i++) {
        l->prev[i] = i - 1;
        l->next[i] = i + 1 < n ? i + 1 : -1;
        l->state[i] = (uint8_t)initial;
    }
    if (n > 0) l->head[initial] = 0, l->tail[initial] = n - 1;
    l->count[initial] = n;
    return 0;
}

void kvm_joblist_deinit(kvm_joblist *l)
{
    free(l->prev);
    free(l->next);
    free(l->state);
    memset(l, 0, sizeof *l);
}

void kvm_joblist_move(kvm_joblist *l, int64_t i, int s, int front)
{
    int from = l->state[i];
    int64_t p = l->prev[i], nx = l->next[i];
    if (p >= 0) l->next[p] = nx;
    else l->head[from] = nx;
    if (nx >= 0) l->prev[nx] = p;
    else l->tail[from] = p;
    l->count[from]--;
    l->state[i] = (uint8_t)s;
    if (front) {
        l->prev[i] = -1;
        l->next[i] = l->head[s];
        if (l->head[s] >= 0) l->prev[l->head[s]] = i;
        else l->tail[s] = i;
        l->head[s] = i;
    } else {
        l->next[i] = -1;
        l->prev[i] = l->tail[s];
        if (l->tail[s] >= 0) l->next[l->tail[s]] = i;
        else l->head[s] = i;
        l->tail[s] = i;
    }
    l->count[s]++;
}
