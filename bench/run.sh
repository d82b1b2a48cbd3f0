#!/usr/bin/env bash
# make bench: runs every bench/*.sh (each prints its own figures). Not a test: nothing here
# asserts a speed; the figures go into bench/RESULTS.md by hand, with the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
for s in bench/*.sh; do
    [ "$s" = bench/run.sh ] && continue
    echo "== $s"
    bash "$s"
done
