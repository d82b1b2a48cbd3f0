#!/usr/bin/env bash
# run-suites.sh LOGDIR SUITE...: what `make test` runs. The Check suites run KVMILL_TEST_JOBS at a
# time (default: twice the number of cores, at most 8, as the suites spend most of their time
# waiting on servers, stages, timeouts and heartbeats: 155 s of CPU in 416 s, measured; KVMILL_TEST_JOBS=1
# runs them one after the other), every one even if an earlier one failed. Each suite's output
# goes to LOGDIR/<suite>.log and is shown whole when the suite ends (suites never interleave),
# under a line "== SUITE (N s, CPU C s)". The slowest start first, so that the last ones to end
# are short: tests/suite-seconds lists what each took (a suite not listed starts after those
# listed, in the order given). The last line sums them up, over the suites in the order given:
# "tests: P passed, F failed[ in SUITE, ...]" (after the failing suites' first failure lines
# again, so that a log's tail names them), followed, when a suite ended without its "Checks:" line (a crash,
# an abort, a sanitizer report, a missing binary), by "(NAME crashed before reporting: exit
# status S, ...)" for each such suite, counted as one failure. Exit status 0 when every suite
# exited 0, else 1. The environment (KVMILL_BIN, KVMILL_SHARED, CK_*) is passed on.
set -u
logdir=$1
shift
mkdir -p "$logdir"
# at most 8 by default: some suites hold a 540 MB float32 model folder each, so a many-core
# machine running every suite at once could run short of memory
# nproc counts the affinity mask but not a cgroup CPU quota (a container given 2 CPUs' time
# on a big host): the smaller of the two, as common/kvm_cpus.c sizes kvmill's thread pool
cpus=$(nproc 2>/dev/null || echo 1)
for f in /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us; do
    [ -r "$f" ] || continue
    read -r q p <"$f" 2>/dev/null || continue
    [ -z "${p:-}" ] && [ -r "${f%quota_us}period_us" ] && read -r p <"${f%quota_us}period_us"
    [[ ${q:-} =~ ^[0-9]+$ && ${p:-} =~ ^[1-9][0-9]*$ ]] || continue
    lim=$(((q + p - 1) / p))
    [ "$lim" -ge 1 ] && [ "$lim" -lt "$cpus" ] && cpus=$lim
done
jobs=${KVMILL_TEST_JOBS:-$((2 * cpus))}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || jobs=1
[ -n "${KVMILL_TEST_JOBS:-}" ] || [ "$jobs" -le 8 ] || jobs=8
hints=$(dirname "$0")/suite-seconds

# the order to start them in: estimated seconds, highest first (ties: the order given)
order=$(
    i=0
    for t in "$@"; do
        name=$(basename "$t")
        secs=$(awk -v n="$name" '$1 == n { print $2; exit }' "$hints" 2>/dev/null)
        [[ $secs =~ ^[0-9]+$ ]] || secs=0
        printf '%s %s\n' "$secs" "$i"
        i=$((i + 1))
    done | sort -k1,1nr -k2,2n | cut -d' ' -f2
)
suites=("$@")

# one suite: its output into its log; its exit status, seconds and CPU seconds (its processes'
# user + system time) into LOGDIR/<suite>.rc
run_one() {
    local t=$1 name log rc real user sys TIMEFORMAT='%0R %0U %0S'
    name=$(basename "$t")
    log=$logdir/$name.log
    # (bash's "Segmentation fault" line goes into the log too)
    { time { { "$t" </dev/null; rc=$?; } >"$log" 2>&1; }; } 2>"$logdir/$name.time"
    read -r real user sys <"$logdir/$name.time"
    rm -f "$logdir/$name.time"
    echo "$rc $real $((user + sys))" >"$logdir/$name.rc.tmp"
    mv "$logdir/$name.rc.tmp" "$logdir/$name.rc"
}

# shows a suite that has ended
show() {
    local t=$1 name rc secs cpu
    name=$(basename "$t")
    read -r rc secs cpu <"$logdir/$name.rc"
    echo "== $t ($secs s, CPU $cpu s)"
    cat "$logdir/$name.log"
}

# waits for one of the running suites to end, then shows those that have
reap() {
    local j left=()
    wait -n
    for j in "${running[@]}"; do
        if [ -f "$logdir/$(basename "${suites[$j]}").rc" ]; then show "${suites[$j]}"; else left+=("$j"); fi
    done
    running=("${left[@]}")
}
running=()
for i in $order; do
    rm -f "$logdir/$(basename "${suites[$i]}").rc"
done
for i in $order; do
    while [ "${#running[@]}" -ge "$jobs" ]; do reap; done
    run_one "${suites[$i]}" &
    running+=("$i")
done
while [ "${#running[@]}" -gt 0 ]; do reap; done

fail=0 pass=0 bad=0 crashed="" failed="" faillines=""
for t in "${suites[@]}"; do
    name=$(basename "$t")
    log=$logdir/$name.log
    read -r rc _ <"$logdir/$name.rc"
    rm -f "$logdir/$name.rc"
    [ "$rc" -eq 0 ] || fail=1
    n=$(sed -n 's/.*Checks: \([0-9]*\), Failures: \([0-9]*\), Errors: \([0-9]*\).*/\1 \2 \3/p' "$log" | tail -1)
    if [ -n "$n" ]; then
        set -- $n
        pass=$((pass + $1 - $2 - $3))
        bad=$((bad + $2 + $3))
        # a suite whose checks failed: its failing lines again at the end, where a CI log's
        # tail shows them (Check prints "file:line:F:case:test:0: message" or ":E:")
        if [ "$(($2 + $3))" -gt 0 ] || [ "$rc" -ne 0 ]; then
            failed="$failed${failed:+, }$name"
            lines=$(grep -E '^[^ ]+:[0-9]+:[EF]:' "$log" | head -5)
            # every check passed but the suite exited non-zero (a leak report after Check's summary)
            [ -n "$lines" ] || lines="$name: exit status $rc after its checks passed (output in $log)"
            faillines="$faillines$lines"$'\n'
        fi
    else
        why="exit status $rc"
        [ "$rc" -gt 128 ] && why="$why: killed by signal $((rc - 128))"
        [ "$rc" -eq 0 ] && { why="$why but no Checks: line"; fail=1; }
        echo "== $name: crashed before reporting ($why; output in $log)"
        bad=$((bad + 1))
        crashed="$crashed${crashed:+, }$name crashed before reporting: $why"
    fi
done
[ -z "$failed" ] || printf '== failed suites: %s\n%s' "$failed" "$faillines"
echo "tests: $pass passed, $bad failed${failed:+ in $failed}${crashed:+ ($crashed)}"
exit $fail
