#!/usr/bin/env bash
# Do trials.csv and `dtune bench` agree on a config's time (one measurement harness: within 5% on the same shape)?
# Usage (one CUDA GPU, from the checkout's root):  bash scripts/gpu_agree.sh [--interpret]     (~3 minutes)
#   --interpret: the same steps on tiny shapes on the CPU (checks the plumbing; the times mean nothing)
#   OUT where results go (default ./out); KERNELS the kernels to compare (default: chunk_kda and fused_recurrent_kda)
# For each kernel: a short search on one shape (the default config and the seeds), then `dtune bench --config` on the
# shapes it tuned, and a table of trials.csv's time_ms against the bench's median_ms for the default and the best
# config (chunk kernels: CUDA events; decode: CUDA-graph replays on both sides).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/agree"
T=4096 D=128 H=16 B=32 EXTRA=()
if [ "${1:-}" = "--interpret" ]; then T=20 D=16 H=1 B=2 EXTRA=(--interpret --dtype fp32); fi
for k in ${KERNELS:-chunk_kda fused_recurrent_kda}; do
  if [[ $k == fused_recurrent_* ]]; then shape=(--seq-lens 1 --head-dims $D --heads $H --batch $B); graph=(--graph)
  else shape=(--seq-lens $T --head-dims $D --heads $H); graph=(); fi
  timeout 400 python3 -m dtune search -k "$k" "${shape[@]}" "${EXTRA[@]}" --trials 4 --out "$OUT/agree/$k" --json > "$OUT/agree/$k.search.json" \
    || echo "!!! search $k exited with $?"
  timeout 150 python3 -m dtune bench -k "$k" --config "$OUT/agree/$k/tuned.json" --baselines default "${graph[@]}" "${EXTRA[@]}" \
    --out "$OUT/agree/$k" --json > "$OUT/agree/$k.bench.json" || echo "!!! bench $k exited with $?"
done
python3 - "$OUT/agree" ${KERNELS:-chunk_kda fused_recurrent_kda} <<'PY'
import json, sys
from pathlib import Path
import pandas as pd
root = Path(sys.argv[1])
print(f"{'kernel':<22}{'config':<9}{'trials.csv ms':>14}{'bench ms':>10}{'bench/trial':>12}")
for k in sys.argv[2:]:
    try:
        trials = pd.read_csv(root / k / "trials.csv")
        bench = pd.DataFrame(json.loads((root / f"{k}.bench.json").read_text())["rows"])
    except Exception as e:
        print(f"{k:<22}missing: {e}")
        continue
    done = trials[trials["state"] == "complete"]
    graph = k.startswith("fused_recurrent") and (bench["mode"] == "graph").any()
    mode = "graph" if graph else "eager"
    for name, t, impl in (("default", done[done["is_default"]]["time_ms"].min(), "default"),
                          ("best", done["time_ms"].min(), "tuned")):
        b = bench[(bench["impl"] == impl) & (bench["mode"] == mode)]["median_ms"].min()
        print(f"{k:<22}{name:<9}{t:>14.4f}{b:>10.4f}{b / t:>12.3f}")
PY
