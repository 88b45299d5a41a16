#!/usr/bin/env bash
# The final GPU sitting: the shipped H200 configs against the untuned default and flash-linear-attention, side by
# side per kernel (dtune bench), and the per-stage profile of the chunk pipeline (dtune profile).
# Usage:  bash scripts/h200_final.sh [--interpret]      (OUT: where results go, default ./out)
# Everything lands in $OUT/final/<step>/ and is re-packed into $OUT/final.tgz after every step, so a step that
# runs out of time loses nothing that finished before it.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT/final"
SHAPE_T=4096 D128=128 D64=64 DECODE_B=32,256 TOKENS=32768 PROFILE_B=8 EXTRA=()
if [ "${1:-}" = "--interpret" ]; then  # the same steps on tiny shapes: checks the commands, not the speed
  SHAPE_T=20 D128=32 D64=16 DECODE_B=2 TOKENS=40 PROFILE_B=1 EXTRA=(--interpret)
fi
step() {  # name, seconds, dtune arguments...
  local name=$1 secs=$2
  shift 2
  echo "=== $name: dtune $*"
  timeout "$secs" python3 -m dtune "$@" "${EXTRA[@]}" --out "$OUT/final/$name" > "$OUT/final/$name.log" 2>&1
  echo "(exit $?)"
  tail -n 25 "$OUT/final/$name.log"
  tar czf "$OUT/final.tgz" -C "$OUT" final
}
chunk=(--seq-lens "$SHAPE_T" --heads 16 --batch-tokens "$TOKENS" --dtype bf16 --baselines default,fla)
decode=(--seq-lens 1 --head-dims "$D128" --heads 16 --batch "$DECODE_B" --dtype bf16 --baselines default,fla --graph)
step bench_chunk_delta_rule 95 bench -k chunk_delta_rule --head-dims "$D128" "${chunk[@]}"
step bench_chunk_gated_delta_rule 95 bench -k chunk_gated_delta_rule --head-dims "$D128" "${chunk[@]}"
step bench_fused_recurrent_kda 50 bench -k fused_recurrent_kda "${decode[@]}"
step profile_chunk_kda 45 profile -k chunk_kda --seq-len "$SHAPE_T" --head-dim "$D128" --heads 16 --batch "$PROFILE_B" --dtype bf16
step bench_chunk_kda 230 bench -k chunk_kda --head-dims "$D64,$D128" "${chunk[@]}"
