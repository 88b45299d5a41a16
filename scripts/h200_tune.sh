#!/usr/bin/env bash
# Tune all six kernels on the GPU of this machine in one sitting of under ten minutes, then export and merge.
#
# Usage:  bash scripts/h200_tune.sh [--interpret]
#   Run it from the checkout's root (`python3 -m dtune` runs the checkout's dtune, installed or not) or from
#   anywhere with dtune installed. Results: $OUT/runs.tgz (re-packed after every search) and $OUT/tuned.json; the
#   first H200 sitting (reports/h200/tune.log) lost its run folders because they were packed only at the end.
#   OUT      where run folders, the merged config and a tarball go (default ./out)
#   SCALE    multiplies every per-shape time budget (default 1)
#   ONLY     a bash pattern: run only the searches whose name matches (e.g. 'chunk_*'; default: the first
#            sitting's searches, not the grid2-4 pieces below, which each need a sitting of their own)
#   CA       trials compiled ahead in parallel (default 6; compiling is the chunk searches' bottleneck: ~20-50 s a
#            config on one core, so on a 16-core host 14 keeps the timing worker fed)
#   DEADLINE a Unix time: each search's budget shrinks to fit before it (45 s kept for its wind-down), and a search
#            left with under 15 s a shape (or under its planned budget, if smaller) is skipped (the device allows
#            10 minutes a command)
# Shapes: the targets (bf16, B*T = 32768, H = 16): chunk kernels at T = 4096 with D = 128 (KDA also
# D = 64); fused-recurrent decode (T = 1) at B = 32 and 256, D = 128. Other buckets fall back to the nearest
# tuned sequence length or the default (dtune.store). For fused_recurrent_kda at B = 32 the whole space is also
# swept with the grid sampler, to count how many TPE trials reach within 3% of the exhaustive best.
set -uo pipefail
OUT=${OUT:-out}
SCALE=${SCALE:-1}
ONLY=${ONLY:-first}  # "first": everything but the grid2-4 pieces
DEADLINE=${DEADLINE:-0}
GPU=auto
EXTRA=(--compile-ahead "${CA:-6}" --trial-timeout 60)
if [ "${1:-}" = "--interpret" ]; then
  EXTRA=(--interpret)
fi
RUNS="$OUT/runs"
mkdir -p "$RUNS"
dtune() { python3 -m dtune "$@"; }  # works where the console script is not on PATH
t() { python3 -c "print(int($1 * $SCALE))"; }

search() {  # name, kernel, budget seconds per shape, number of shapes, extra args...
  local name=$1 kernel=$2 budget shapes=$4 left floor
  if [ "$ONLY" = first ]; then
    [[ $name != grid[234]_* ]] || return 0
  else
    # shellcheck disable=SC2053
    [[ $name == $ONLY ]] || return 0
  fi
  budget=$(t "$3")
  if [ "$DEADLINE" -gt 0 ]; then
    left=$(((DEADLINE - $(date +%s) - 45) / shapes))
    floor=$((budget < 15 ? budget : 15))
    [ "$left" -lt "$budget" ] && budget=$left
    if [ "$budget" -lt "$floor" ]; then
      echo "=== $name: skipped (the deadline leaves ${budget} s a shape)"
      return 0
    fi
  fi
  shift 4
  echo "=== $name: dtune search --kernel $kernel $* --timeout $budget"
  timeout $((budget * shapes + 45)) python3 -m dtune search --kernel "$kernel" --gpu "$GPU" --dtype bf16 --timeout "$budget" \
    --out "$RUNS/$name" "${EXTRA[@]}" "$@" || echo "!!! $name exited with $?"
  # Re-pack after every search: the device returns at most 8 files, and a later step may run out of time.
  tar czf "$OUT/runs.tgz" -C "$OUT" runs
}

search grid_fused_recurrent_kda fused_recurrent_kda 35 1 --seq-lens 1 --head-dims 128 --heads 16 --batch 32 \
  --sampler grid --trials 200
search chunk_kda_d128 chunk_kda 110 1 --seq-lens 4096 --head-dims 128 --heads 16
search chunk_kda_d64 chunk_kda 80 1 --seq-lens 4096 --head-dims 64 --heads 16
search chunk_gated_delta_rule chunk_gated_delta_rule 90 1 --seq-lens 4096 --head-dims 128 --heads 16
search chunk_delta_rule chunk_delta_rule 80 1 --seq-lens 4096 --head-dims 128 --heads 16
search fused_recurrent_kda fused_recurrent_kda 15 2 --seq-lens 1 --head-dims 128 --heads 16 --batch 32,256
search fused_recurrent_gated_delta_rule fused_recurrent_gated_delta_rule 10 2 --seq-lens 1 --head-dims 128 \
  --heads 16 --batch 32,256
search fused_recurrent_delta_rule fused_recurrent_delta_rule 10 2 --seq-lens 1 --head-dims 128 --heads 16 \
  --batch 32,256

# The rest of the default grid, for later sittings (pick with ONLY; with DEADLINE each piece fits what is left):
#   ONLY='grid2_*'  chunk kernels at T = 1024 and 16384 (D = 128), H = 16
#   ONLY='grid3_*'  D = 256 (H = 8) for the three chunk kernels, D = 64 for DeltaNet / Gated DeltaNet
#   ONLY='grid4_*'  fused-recurrent at B = 1 and 32, decode (T = 1) and short prompts (T = 64), D = 64 and 128
# Kernels compiled for T = 4096 serve T = 1024 and 16384 too (T is not a compile-time constant), so a sitting
# that follows the T = 4096 searches on the same machine reuses their Triton cache.
for k in chunk_kda chunk_gated_delta_rule chunk_delta_rule; do
  search "grid2_$k" "$k" 45 2 --seq-lens 1024,16384 --head-dims 128 --heads 16
done
for k in chunk_kda chunk_gated_delta_rule chunk_delta_rule; do
  search "grid3_${k}_d256" "$k" 70 1 --seq-lens 4096 --head-dims 256 --heads 8
done
search grid3_chunk_gated_delta_rule_d64 chunk_gated_delta_rule 50 1 --seq-lens 4096 --head-dims 64 --heads 16
search grid3_chunk_delta_rule_d64 chunk_delta_rule 50 1 --seq-lens 4096 --head-dims 64 --heads 16
for k in fused_recurrent_kda fused_recurrent_gated_delta_rule fused_recurrent_delta_rule; do
  search "grid4_${k}" "$k" 8 8 --seq-lens 1,64 --head-dims 64,128 --heads 16 --batch 1,32
done

# One tuned-config file for the package: every tuning run (the grid sweep is a measurement, not a source).
mapfile -t tuned < <(ls -d "$RUNS"/chunk_* "$RUNS"/fused_recurrent_* "$RUNS"/grid[234]_* 2> /dev/null)
dtune export "${tuned[@]}" -o "$OUT/tuned.json" || echo "!!! export failed"
tar czf "$OUT/runs.tgz" -C "$OUT" runs
ls -la "$OUT"
