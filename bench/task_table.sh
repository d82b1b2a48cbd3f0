#!/bin/sh
# task_table.sh: accuracy per (task, context, method, budget) over the CSVs of
# bench/task_accuracy.sh, with the Wilson 95% interval and the exact McNemar p against full KV,
# the accuracy as a share of full KV's (vs_full) and a paired non-inferiority bound (ni95_lo)
# on the same cases (a method's cell pairs each of its cases with full KV's answer to the same
# case, so cells of different runs over the same cases combine), and nll_ans: the mean over the
# cases full KV answers right of the answer_nll column (the NLL per token, nats, of full KV's
# answer under the method's cache; CSVs without the column give "-"). usage: bench/task_table.sh OUT_DIR
# env BINS (default 40): budgets are binned to the nearest 1/BINS of the case's context; BINS=8
# puts a fixed --budget 1024 over contexts of 1,988-2,048 tokens (50-51.5%) in one 50% cell
set -eu
dir=${1:-bench/out/task}
# a wrong folder printed an empty table and exit 0, as if no case had finished
found=
for f in "$dir"/*.csv "$dir"/*.csv.part; do [ -f "$f" ] && found=1 && break; done
if [ -z "$found" ]; then
    echo "task_table: no *.csv or *.csv.part in $dir (bench/task_accuracy.sh OUT_DIR writes them)" >&2
    exit 2
fi
printf "%-10s %-24s %6s %8s %17s %6s %6s %9s %8s %8s %8s\n" task method@ratio cases acc "95% interval" lost gained mcnemar_p vs_full ni95_lo nll_ans
# a chunk still running (.csv.part) counts with the cases it has finished so far
cat "$dir"/*.csv "$dir"/*.csv.part 2>/dev/null | awk -F, -v bins="${BINS:-40}" '
$1 == "case" { next }
# the budget as a share of the context, to the nearest 1/bins: a fixed --budget (512 = 25% of N = 2,048)
# over cases whose context is 2,006-2,048 tokens is one cell, as the --ratio cells are
{ key = $2 "," $5 "," $1; m = $6 "@" ($6 == "full" ? "1" : sprintf("%.3f", int($7 / $5 * bins + 0.5) / bins)) }
$6 == "full" { full[key] = $8 }
{ ok[key, m] = $8; seen[key] = 1; cells[$2 "|" m] = 1; if (NF >= 11 && $11 != "") nll[key, m] = $11 }
END {
    for (c in cells) {
        split(c, tm, "|"); task = tm[1]; m = tm[2]; split(m, mr, "@")
        n = 0; r = 0; b = 0; g = 0; sn = 0; nn_ = 0
        for (k in seen) {
            split(k, kk, ","); if (kk[1] != task || !((k, m) in ok)) continue
            n++; r += ok[k, m]; b += full[k] && !ok[k, m]; g += !full[k] && ok[k, m]
            if (full[k] && (k, m) in nll) { sn += nll[k, m]; nn_++ }
        }
        if (n == 0) continue
        p = r / n; z = 1.96; d = 1 + z * z / n; mid = (p + z * z / (2 * n)) / d
        h = z * sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
        lo = mid - h < 0 ? 0 : mid - h; hi = mid + h > 1 ? 1 : mid + h
        nn = b + g; k0 = b < g ? b : g; t = 0
        for (i = 0; i <= k0; i++) { lc = 0; for (j = 1; j <= nn; j++) lc += log(j); for (j = 1; j <= i; j++) lc -= log(j); for (j = 1; j <= nn - i; j++) lc -= log(j); t += exp(lc - nn * log(2)) }
        pv = nn == 0 ? 1 : (2 * t < 1 ? 2 * t : 1)
        # the target "95% of the accuracy of full KV" as a paired non-inferiority bound: per case
        # D = right(method) - 0.95 right(full KV) (0.05 both right, -0.95 lost, 1 gained, 0
        # neither); ni95_lo, the one-sided 95% lower bound of mean D, > 0 means the
        # method reaches >= 95% of the accuracy of full KV on these cases at that confidence
        a = r - g; f = a + b; mu = (0.05 * a - 0.95 * b + g) / n
        var = n > 1 ? (a * (0.05 - mu) ^ 2 + b * (-0.95 - mu) ^ 2 + g * (1 - mu) ^ 2 + (n - a - b - g) * mu ^ 2) / (n - 1) : 0
        ni = mu - 1.645 * sqrt(var / n)
        printf "%-10s %-24s %6d %8.3f   [%5.3f, %5.3f] %6d %6d %9.3g %8s %8.3f %8s\n", task, m, n, p, lo, hi, b, g, pv,
               (f > 0 ? sprintf("%.3f", r / f) : "-"), ni, (nn_ > 0 ? sprintf("%.4f", sn / nn_) : "-")
    }
}' | sort
