#!/usr/bin/env bash
# run-suites.sh LOGDIR SUITE...: what `make test` runs. Each Check suite runs in turn (every one
# even if an earlier one failed), its output shown and kept in LOGDIR/<suite>.log; the last line
# sums them up: "tests: P passed, F failed", followed, when a suite ended without its "Checks:"
# line (a crash, an abort, a sanitizer report, a missing binary), by "(NAME crashed before
# reporting: exit status S, ...)" for each such suite, counted as one failure. Exit status 0 when
# every suite exited 0, else 1. The environment (KVMILL_BIN, KVMILL_SHARED, CK_*) is passed on.
set -u
logdir=$1
shift
mkdir -p "$logdir"
fail=0 pass=0 bad=0 crashed=""
for t in "$@"; do
    name=$(basename "$t")
    log=$logdir/$name.log
    echo "== $t"
    "$t" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || fail=1
    n=$(sed -n 's/.*Checks: \([0-9]*\), Failures: \([0-9]*\), Errors: \([0-9]*\).*/\1 \2 \3/p' "$log" | tail -1)
    if [ -n "$n" ]; then
        set -- $n
        pass=$((pass + $1 - $2 - $3))
        bad=$((bad + $2 + $3))
    else
        why="exit status $rc"
        [ "$rc" -gt 128 ] && why="$why: killed by signal $((rc - 128))"
        [ "$rc" -eq 0 ] && { why="$why but no Checks: line"; fail=1; }
        echo "== $name: crashed before reporting ($why; output in $log)"
        bad=$((bad + 1))
        crashed="$crashed${crashed:+, }$name crashed before reporting: $why"
    fi
done
echo "tests: $pass passed, $bad failed${crashed:+ ($crashed)}"
exit $fail
