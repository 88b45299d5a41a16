#!/usr/bin/env bash
# The committed H200 report from the committed sitting data: the run folders of sittings B and C (packed as .tgz in
# reports/h200/sitting-2026-11-30{b,c}) and the benchmark of record (sitting C: reports/h200/sitting-2026-11-30c,
# c2/bench_* and c4/bench_hv2). No GPU needed.  Usage: bash scripts/report_h200.sh [OUTPUT.html]
set -euo pipefail
OUTPUT=${1:-reports/h200/dtune-h200-report.html}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/runs"
for t in reports/h200/sitting-2026-11-30b/*/*.tgz reports/h200/sitting-2026-11-30c/c[12]/*/*.tgz; do
  case $t in *bwd_runs*) continue ;; esac  # the backward searches: three trials each, not a search history
  tar xzf "$t" -C "$tmp/runs"
done
C=reports/h200/sitting-2026-11-30c
python3 -m dtune report "$tmp/runs" $(ls -d "$C"/c2/bench_*/) "$C/c4" -o "$OUTPUT"
