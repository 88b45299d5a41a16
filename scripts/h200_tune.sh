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
#            sitting's searches, not the grid_* pieces below, which each need a sitting of their own)
#   CA       trials compiled ahead in parallel (default 6; compiling is the chunk searches' bottleneck: ~20-50 s a
#            config on one core, so on a 16-core host 14 keeps the timing worker fed)
#   DEADLINE a Unix time: each search's budget shrinks to fit before it (45 s kept for its wind-down), and a search
#            left with under 15 s a shape (or under its planned budget, if smaller) is skipped (the device allows
#            10 minutes a command)
#   DRY      non-empty: print each search's command instead of running it
#   DEVICES  GPUs that time trials (default: 0,1 when nvidia-smi lists two or more GPUs, else one)
# Searches use the default strategy (pattern for the chunk kernels, TPE for fused-recurrent), which starts from the
# default, the seeds and the shipped configs of the nearest buckets. The grid pieces (ONLY='grid_*') tune the whole
# default grid by transfer: each kernel's anchor bucket (T = 4096, D = 128) first with a full budget, then every
# other bucket seeded with the winners of the kernel's runs so far (--transfer-from), on a third of the budget.
# Shapes: the targets (bf16, B*T = 32768, H = 16): chunk kernels at T = 4096 with D = 128 (KDA also
# D = 64); fused-recurrent decode (T = 1) at B = 32 and 256, D = 128. Other buckets fall back to the nearest
# tuned sequence length or the default (dtune.store). For fused_recurrent_kda at B = 32 the whole space is also
# swept with the grid sampler, to count how many TPE trials reach within 3% of the exhaustive best.
set -uo pipefail
OUT=${OUT:-out}
SCALE=${SCALE:-1}
ONLY=${ONLY:-first}  # "first": everything but the grid_* pieces
DEADLINE=${DEADLINE:-0}
GPU=auto
EXTRA=(--compile-ahead "${CA:-6}" --trial-timeout 60)
if [ -z "${DEVICES:-}" ] && command -v nvidia-smi >/dev/null 2>&1 && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  DEVICES=0,1
fi
[ -n "${DEVICES:-}" ] && EXTRA+=(--devices "$DEVICES")
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
    [[ $name != grid_* ]] || return 0
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
  if [ -n "${DRY:-}" ]; then  # print the commands only (and leave a run folder for the transfer plumbing)
    mkdir -p "$RUNS/$name" && echo '{}' > "$RUNS/$name/run.json"
    return 0
  fi
  timeout $((budget * shapes + 45)) python3 -m dtune search --kernel "$kernel" --gpu "$GPU" --dtype bf16 --timeout "$budget" \
    --out "$RUNS/$name" "${EXTRA[@]}" "$@" || echo "!!! $name exited with $?"
  # Re-pack after every search: the device returns at most 8 files, and a later step may run out of time.
  tar czf "$OUT/runs.tgz" -C "$OUT" runs
}

search sweep_fused_recurrent_kda fused_recurrent_kda 35 1 --seq-lens 1 --head-dims 128 --heads 16 --batch 32 \
  --strategy grid --trials 200
search chunk_kda_d128 chunk_kda 110 1 --seq-lens 4096 --head-dims 128 --heads 16
search chunk_kda_d64 chunk_kda 80 1 --seq-lens 4096 --head-dims 64 --heads 16
search chunk_gated_delta_rule chunk_gated_delta_rule 90 1 --seq-lens 4096 --head-dims 128 --heads 16
search chunk_delta_rule chunk_delta_rule 80 1 --seq-lens 4096 --head-dims 128 --heads 16
search fused_recurrent_kda fused_recurrent_kda 15 2 --seq-lens 1 --head-dims 128 --heads 16 --batch 32,256
search fused_recurrent_gated_delta_rule fused_recurrent_gated_delta_rule 10 2 --seq-lens 1 --head-dims 128 \
  --heads 16 --batch 32,256
search fused_recurrent_delta_rule fused_recurrent_delta_rule 10 2 --seq-lens 1 --head-dims 128 --heads 16 \
  --batch 32,256

# The whole default grid, by transfer (pick with ONLY='grid_<kernel>_*'; with DEADLINE each piece fits what is left).
# Per chunk kernel: the anchor (T = 4096, D = 128, B = 8, H = 16) with a full budget, then every other bucket seeded
# by the winners of that kernel's runs so far, on a third of the budget: T in {1024, 4096, 16384} x D in {64, 128, 256}
# at B*T = 32768 (H = 16; H = 8 at D = 256), B = 1 at T in {8192, 32768, 65536}, grouped value heads (HV = 2H) at
# B = 1, T = 32768, and a packed batch of 16 prompts (52640 tokens, cu_seqlens). Kernels compiled for one T serve
# the others (T is not a compile-time constant), so later buckets of a head dim mostly reuse the Triton cache.
PACKED=1024,4096,2048,6144,512,3072,8192,1536,2560,4608,896,5632,3584,1280,3328,4128  # 16 prompts, 52640 tokens
prior() {  # the run folders of kernel $1 so far, as --transfer-from arguments
  local d
  for d in "$RUNS"/grid_"$1"_*; do [ -f "$d/run.json" ] && printf '%s\n' --transfer-from "$d"; done
}
grid() {  # kernel, anchor budget seconds
  local k=$1 b=$2 t=$(( $2 / 3 ))
  search "grid_${k}_anchor" "$k" "$b" 1 --seq-lens 4096 --head-dims 128 --heads 16
  mapfile -t from < <(prior "$k")
  search "grid_${k}_d64" "$k" "$t" 3 --seq-lens 1024,4096,16384 --head-dims 64 --heads 16 "${from[@]}"
  search "grid_${k}_d128" "$k" "$t" 2 --seq-lens 1024,16384 --head-dims 128 --heads 16 "${from[@]}"
  mapfile -t from < <(prior "$k")
  search "grid_${k}_d256" "$k" "$t" 3 --seq-lens 1024,4096,16384 --head-dims 256 --heads 8 "${from[@]}"
  search "grid_${k}_b1" "$k" "$t" 3 --seq-lens 8192,32768,65536 --batch 1 --head-dims 128 --heads 16 "${from[@]}"
  mapfile -t from < <(prior "$k")
  search "grid_${k}_hv2" "$k" "$t" 1 --seq-lens 32768 --batch 1 --head-dims 128 --heads 16 --hv-ratio 2 "${from[@]}"
  search "grid_${k}_packed" "$k" "$t" 1 --packed-seqs "$PACKED" --head-dims 128 --heads 16 "${from[@]}"
}
for k in chunk_kda chunk_gated_delta_rule chunk_delta_rule; do
  grid "$k" 90
done
for k in fused_recurrent_kda fused_recurrent_gated_delta_rule fused_recurrent_delta_rule; do
  search "grid_${k}" "$k" 8 8 --seq-lens 1,64 --head-dims 64,128 --heads 16 --batch 1,32
done

# One tuned-config file for the package: every tuning run (the grid sweep is a measurement, not a source).
mapfile -t tuned < <(ls -d "$RUNS"/chunk_* "$RUNS"/fused_recurrent_* "$RUNS"/grid_* 2> /dev/null)
[ -n "${DRY:-}" ] || dtune export "${tuned[@]}" -o "$OUT/tuned.json" || echo "!!! export failed"
tar czf "$OUT/runs.tgz" -C "$OUT" runs
ls -la "$OUT"
