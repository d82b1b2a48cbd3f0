#!/bin/sh
# quality_bytes_table.sh: means over documents of bench/quality_bytes.sh's CSVs per (method,
# budget, dtype): KL, top-1, perplexity, stored bytes, decode ms per token; and the KL that
# 16-bit storage adds (mean over documents of the paired difference to f32).
# usage: bench/quality_bytes_table.sh OUT_DIR
set -eu
cat "${1:-bench/out/quality_bytes}"/*.csv | awk -F, '
$1 == "doc" { next }
{ k = $2 "@" $4 "," $12; n[k]++; kl[k] += $5; t1[k] += $8; pf[k] += $9; pc[k] += $10; by[k] += $13; ms[k] += $14
  d[$1, $2 "@" $4, $12] = $5; docs[$1] = 1; mk[$2 "@" $4] = 1 }
END {
    printf "%-22s %-5s %4s %10s %10s %6s %9s %9s %10s %9s\n", "method@ratio", "dtype", "docs", "kl_mean", "dkl_vs_f32", "top1", "ppl_full", "ppl_comp", "bytes", "decode_ms"
    for (k in n) {
        split(k, a, ","); s = 0; c = 0
        for (doc in docs) if ((doc, a[1], a[2]) in d && (doc, a[1], "f32") in d) { s += d[doc, a[1], a[2]] - d[doc, a[1], "f32"]; c++ }
        printf "%-22s %-5s %4d %10.6f %10.2e %6.3f %9.4f %9.4f %10.0f %9.3f\n", a[1], a[2], n[k], kl[k] / n[k], c ? s / c : 0, t1[k] / n[k], pf[k] / n[k], pc[k] / n[k], by[k] / n[k], ms[k] / n[k]
    }
}' | sort
