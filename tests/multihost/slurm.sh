#!/bin/bash
# slurm.sh: deploy/slurm/kvmill.sbatch on a single-node Slurm cluster started here (Debian's
# slurm-wlm and munge, a minimal slurm.conf in a temporary folder, private ports), on three
# documents; the store then verifies and holds every cache. Needs root and the packages
# (scripts/install-deps.sh does not install them: apt-get install slurm-wlm munge); prints one
# SKIP line when slurmctld/slurmd cannot start here.
set -u
SRC=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${KVMILL_BIN:-$SRC/bin}
T=
PIDS=()
skip() { echo "SKIP: multihost slurm: $*"; exit 0; }
fail() {
    echo "FAIL: multihost slurm: $*"
    for f in "$T"/*.log "$T"/kvmill-*.out "$T"/run/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -15 "$f"; }; done
    exit 1
}
cleanup() {
    exec 2>/dev/null
    [ -n "${SLURM_CONF:-}" ] && scancel --quiet -u root 2>/dev/null
    for p in "${PIDS[@]}"; do kill "$p"; done
    sleep 0.5
    for p in "${PIDS[@]}"; do kill -9 "$p"; wait "$p"; done
    [ -n "$T" ] && [ -z "${KEEP:-}" ] && rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

[ "$(id -u)" = 0 ] || skip "needs root to start slurmctld/slurmd"
for c in slurmctld slurmd munged mungekey sbatch srun scontrol; do
    command -v "$c" >/dev/null || skip "$c not installed (apt-get install slurm-wlm munge)"
done
T=$(mktemp -d)
chmod 755 "$T"
H=$(hostname -s)
mkdir -p "$T/state" "$T/spool" "$T/munge"
mungekey -c -k "$T/munge/munge.key" >/dev/null 2>&1 || skip "mungekey cannot make a key"
munged --force --socket="$T/munge/sock" --key-file="$T/munge/munge.key" --pid-file="$T/munge/pid" \
    --log-file="$T/munge.log" --seed-file="$T/munge/seed" 2>>"$T/munge.log" || skip "munged does not start"
PIDS+=("$(cat "$T/munge/pid")")
read -r CPUS < <(slurmd -C 2>/dev/null | grep -o 'CPUs=[0-9]*' | cut -d= -f2)
# BASE .. BASE + 50 stay below 32000, under Linux's ephemeral ports (32768-60999), where an
# outgoing connection of any process could hold one (tests/util's kvm_test_tcp_port: the same range)
BASE=$((20000 + $$ % 11900))
cat >"$T/slurm.conf" <<EOF
ClusterName=kvmtest
SlurmctldHost=$H
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$BASE
SlurmdPort=$((BASE + 1))
SrunPortRange=$((BASE + 2))-$((BASE + 40))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$T/munge/sock
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
NodeName=$H CPUs=${CPUS:-2} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=10 State=UP OverSubscribe=FORCE
EOF
export SLURM_CONF=$T/slurm.conf
slurmctld -D -f "$SLURM_CONF" >>"$T/slurmctld.log" 2>&1 &
PIDS+=($!)
slurmd -D -f "$SLURM_CONF" >>"$T/slurmd.log" 2>&1 &
PIDS+=($!)
up=
for _ in $(seq 100); do
    sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed)' && { up=1; break; }
    sleep 0.2
done
[ -n "$up" ] || skip "slurmctld/slurmd did not come up here ($(tail -1 "$T/slurmctld.log"; tail -1 "$T/slurmd.log"))"

mkdir -p "$T/corpus"
cp "$SRC"/data/corpus/doc_00[0-2].txt "$T/corpus/"
cat >"$T/run.ini" <<EOF
[model]
path = $SRC/data/models/stories260K.bin
context = 64
[compress]
method = snapkv
ratio = 0.5
[store]
path = $T/store.lmdb
[run]
run_dir = $T/run
heartbeat_ms = 200
[stages]
compress_workers = 0
bin_dir = $BIN
EOF
cd "$T"
KVMILL_BIN=$BIN KVMILL_CONFIG=$T/run.ini KVMILL_CORPUS=$T/corpus KVMILL_WORKERS=2 \
    KVMILL_PORT=$((BASE + 50)) timeout 120 sbatch --wait --nodes=1 --ntasks=2 \
    --output="$T/kvmill-%j.out" "$SRC/deploy/slurm/kvmill.sbatch" >"$T/sbatch.log" 2>&1 ||
    fail "sbatch: $(cat "$T/sbatch.log")"
out=$(cat "$T"/kvmill-*.out)
echo "$out" | grep -q "summary: compressed=3 skipped=0 failed=0" || fail "no complete run: $out"
"$BIN/kvmill" store verify --store "$T/store.lmdb" >/dev/null || fail "the store does not verify"
N=$("$BIN/kvmill" store ls --store "$T/store.lmdb" --csv | tail -n +2 | wc -l)
[ "$N" = 3 ] || fail "$N caches in the store, expected 3"
echo "PASS: multihost slurm (sbatch deploy/slurm/kvmill.sbatch: 3 caches through the store service, store verified)"
