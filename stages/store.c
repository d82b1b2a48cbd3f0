/* store.c: the kvmill-store stage: the store service (pipeline/kvm_storesvc.h), the one
 * process that opens the LMDB store for writing when workers run on other hosts.
 *   kvmill-store --store PATH --bind ENDPOINT [--config FILE] [--create]
 * Same as `kvmill store serve`. */
#include "orchestrator/kvm_cli.h"

int main(int argc, char **argv)
{
    return kvm_cmd_store_serve(argc, argv);
}
