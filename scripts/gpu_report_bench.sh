#!/usr/bin/env bash
# The sweeps behind the report's "speedup vs sequence length / head dim" (several points per line) and its per-stage
# floors, for one kernel per call: dtune bench (tuned = the shipped configs, vs the default and fla) over T and D, and
# dtune profile at T = 4096. Results under $OUT/report/ (bench_<kernel>[_d<D>]/bench.csv, profile_<kernel>_d<D>/...),
# each file with the commit in DTUNE_COMMIT (the device's copy has no .git: pass the hash).
#
#   OUT=/tmp/out DTUNE_COMMIT=<hash> KERNEL=chunk_kda HEAD_DIMS=64 bash scripts/gpu_report_bench.sh
#   ... once per kernel (chunk_kda, chunk_gated_delta_rule, chunk_delta_rule, fused_recurrent_kda) and head dim;
#   then anywhere: dtune report $OUT/report -o reports/h200/dtune-h200-report.html
#
# One call is one kernel and the head dims in HEAD_DIMS (default 64,128): 5 sequence lengths x the head dims x
# (tuned, default, fla's modes). fla autotunes on its first call per shape (20-80 s cold), so one head dim per call
# keeps a call under 10 minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
KERNEL="${KERNEL:?set KERNEL=chunk_kda, chunk_gated_delta_rule, chunk_delta_rule or fused_recurrent_kda}"
HEAD_DIMS="${HEAD_DIMS:-64,128}"
CONFIG="${CONFIG:-dtune/configs/h200.json}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
unset TRITON_INTERPRET
tag="${KERNEL}_d${HEAD_DIMS//,/_}"
mkdir -p "$OUT/report"
case "$KERNEL" in
  chunk_*) shape=(--seq-lens 1024,2048,4096,8192,16384 --head-dims "$HEAD_DIMS" --heads 16 --batch-tokens 32768) ;;
  fused_recurrent_*) shape=(--seq-lens 1 --head-dims "$HEAD_DIMS" --heads 16 --batch 1,32,256 --graph) ;;
  *) echo "unknown KERNEL=$KERNEL"; exit 2 ;;
esac
set -x
"$PY" -m dtune bench -k "$KERNEL" --config "$CONFIG" "${shape[@]}" --baselines default,fla \
  --out "$OUT/report/bench_$tag" 2>&1 | tee "$OUT/report/bench_$tag.log"
if [[ "$KERNEL" == chunk_* ]]; then
  for D in ${HEAD_DIMS//,/ }; do
    "$PY" -m dtune profile -k "$KERNEL" --config "$CONFIG" --seq-len 4096 --head-dim "$D" --heads 16 \
      --out "$OUT/report/profile_${KERNEL}_d$D" 2>&1 | tee "$OUT/report/profile_${KERNEL}_d$D.log"
  done
fi
set +x
echo "== $KERNEL (D $HEAD_DIMS): $OUT/report/bench_$tag/bench.csv"
"$PY" - "$OUT/report/bench_$tag/bench.csv" <<'PYEOF'
import sys
import pandas as pd
f = pd.read_csv(sys.argv[1])
t = f[(f["impl"] == "tuned")][["mode", "B", "T", "K", "median_ms", "speedup_vs_default", "speedup_vs_fla"]]
print(t.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
PYEOF
