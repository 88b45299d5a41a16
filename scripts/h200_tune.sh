#!/usr/bin/env bash
# Tune all six kernels on the GPU of this machine in one sitting of under ten minutes, then export and merge.
#
# Usage:  bash scripts/h200_tune.sh [--interpret]
#   Run it from outside the checkout once dtune is installed (pip install --no-deps --no-build-isolation .), so
#   the source folder dtune/ does not shadow the installed package. Results: $OUT/runs.tgz (re-packed after every
#   search) and $OUT/tuned.json; the first H200 sitting (reports/h200/tune.log) lost its run folders because
#   they were packed only at the end.
#   OUT      where run folders, the merged config and a tarball go (default ./out)
#   SCALE    multiplies every per-shape time budget (default 1)
#   ONLY     a bash pattern: run only the searches whose name matches (e.g. 'chunk_*'; default: all)
# Shapes: the targets (bf16, B*T = 32768, H = 16): chunk kernels at T = 4096 with D = 128 (KDA also
# D = 64); fused-recurrent decode (T = 1) at B = 32 and 256, D = 128. Other buckets fall back to the nearest
# tuned sequence length or the default (dtune.store). For fused_recurrent_kda at B = 32 the whole space is also
# swept with the grid sampler, to count how many TPE trials reach within 3% of the exhaustive best.
set -uo pipefail
OUT=${OUT:-out}
SCALE=${SCALE:-1}
ONLY=${ONLY:-*}
GPU=auto
EXTRA=(--compile-ahead 6 --trial-timeout 60)
if [ "${1:-}" = "--interpret" ]; then
  EXTRA=(--interpret)
fi
RUNS="$OUT/runs"
mkdir -p "$RUNS"
dtune() { python3 -m dtune "$@"; }  # works where the console script is not on PATH
t() { python3 -c "print(int($1 * $SCALE))"; }

search() {  # name, kernel, budget seconds, extra args...
  local name=$1 kernel=$2 budget
  # shellcheck disable=SC2053
  [[ $name == $ONLY ]] || return 0
  budget=$(t "$3")
  shift 3
  echo "=== $name: dtune search --kernel $kernel $* --timeout $budget"
  timeout $((budget + 45)) python3 -m dtune search --kernel "$kernel" --gpu "$GPU" --dtype bf16 --timeout "$budget" \
    --out "$RUNS/$name" "${EXTRA[@]}" "$@" || echo "!!! $name exited with $?"
  # Re-pack after every search: the device returns at most 8 files, and a later step may run out of time.
  tar czf "$OUT/runs.tgz" -C "$OUT" runs
}

search grid_fused_recurrent_kda fused_recurrent_kda 35 --seq-lens 1 --head-dims 128 --heads 16 --batch 32 \
  --sampler grid --trials 200
search chunk_kda_d128 chunk_kda 110 --seq-lens 4096 --head-dims 128 --heads 16
search chunk_kda_d64 chunk_kda 80 --seq-lens 4096 --head-dims 64 --heads 16
search chunk_gated_delta_rule chunk_gated_delta_rule 90 --seq-lens 4096 --head-dims 128 --heads 16
search chunk_delta_rule chunk_delta_rule 80 --seq-lens 4096 --head-dims 128 --heads 16
search fused_recurrent_kda fused_recurrent_kda 15 --seq-lens 1 --head-dims 128 --heads 16 --batch 32,256
search fused_recurrent_gated_delta_rule fused_recurrent_gated_delta_rule 10 --seq-lens 1 --head-dims 128 \
  --heads 16 --batch 32,256
search fused_recurrent_delta_rule fused_recurrent_delta_rule 10 --seq-lens 1 --head-dims 128 --heads 16 \
  --batch 32,256

# One tuned-config file for the package: every tuning run (the grid sweep is a measurement, not a source).
mapfile -t tuned < <(ls -d "$RUNS"/chunk_* "$RUNS"/fused_recurrent_* 2> /dev/null)
dtune export "${tuned[@]}" -o "$OUT/tuned.json" || echo "!!! export failed"
tar czf "$OUT/runs.tgz" -C "$OUT" runs
ls -la "$OUT"
