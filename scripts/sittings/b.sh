#!/usr/bin/env bash
# The steps of sittings B and C (2026-11-30): tune the chunk kernels' grid by transfer, then the benchmark of record
# against fla, the backward, the sanitizer sweep, the search-quality benchmark. One step per call:
# bash scripts/sittings/b.sh STEP (the plans b1.plan, b2.plan and c1-c3.plan queue them per GPU through
# scripts/sitting.sh). Run folders and the merged config live in $S (default /tmp/sitting, outside $OUT, so the next
# command of a warm machine finds them); $OUT gets copies. BASE_CONFIG: the config file the first merge starts from
# and the benches use while $S has none (default the shipped dtune/configs/h200.json).
# DRY=1: the same steps on the CPU under Triton's interpreter at tiny shapes (checks the plumbing, not the speed).
set -euo pipefail
STEP=$1
S=${S:-/tmp/sitting}
RUNS=$S/runs
OUT=${OUT:-out}
mkdir -p "$RUNS" "$OUT"
PACKED=1024,4096,2048,6144,512,3072,8192,1536,2560,4608,896,5632,3584,1280,3328,4128  # 16 prompts, 52640 tokens
if [ -n "${DRY:-}" ]; then
  export TRITON_INTERPRET=1
  SEARCH=(python3 -m dtune search --interpret --dtype fp32 --gpu auto)
  BENCH=(python3 -m dtune bench --interpret --dtype fp32 --rounds 1)
  D=16; D2=32; D3=32; H=2; TA=64; T1=32; T2=96; LONG=160,200; LONG3=160,200,128; PACKED=5,17,40; DIV=8; BT=256
else
  SEARCH=(python3 -m dtune search --dtype bf16 --gpu auto --compile-ahead 14 --trial-timeout 90)
  BENCH=(python3 -m dtune bench --dtype bf16 --rounds 3)
  D=128; D2=64; D3=256; H=16; TA=4096; T1=1024; T2=16384; LONG=32768,65536; LONG3=32768,65536,8192; DIV=1; BT=32768
fi
t() { echo $(($1 / DIV + 2)); }  # a search budget, scaled down for dry runs
search() {  # name, kernel, seconds per shape, args...
  local name=$1 kernel=$2 secs=$3
  shift 3
  local from=()
  [ -f "$RUNS/${kernel}_anchor/run.json" ] && from=(--transfer-from "$RUNS/${kernel}_anchor")
  "${SEARCH[@]}" -k "$kernel" --timeout "$(t "$secs")" --out "$RUNS/$name" "${from[@]}" "$@" \
    || echo "search $name exited $? (a shape with no passing config exits 1)"
  tar czf "$OUT/$name.tgz" -C "$RUNS" "$name"
}
merge() {  # the tuned configs of every run so far, over the shipped file: $S/h200.json (and a copy in $OUT)
  local runs=()
  for d in "$RUNS"/*; do [ -f "$d/run.json" ] && runs+=("$d"); done
  local bwd=() f
  for f in "$S/bwd_tuned.json" "$OUT/raw/bwd/bwd_tuned.json"; do  # the backward searches' export (step bwd)
    if [ -f "$f" ]; then bwd=("$f"); break; fi
  done
  python3 -m dtune export "${runs[@]}" -o "$S/tuned.json"
  if [ -n "${DRY:-}" ]; then  # a CPU export cannot merge into the H200 file: the plumbing stops at the export
    cp "$S/tuned.json" "$S/h200.json"
  else
    [ -f "$S/h200.json" ] || cp "${BASE_CONFIG:-dtune/configs/h200.json}" "$S/h200.json"
    python3 scripts/merge_configs.py "$S/h200.json" "$S/tuned.json" "${bwd[@]}" \
      --note "H200 ${SITTING:-sitting B}, $(date +%F): $1"
  fi
  cp "$S/h200.json" "$S/tuned.json" "$OUT/"
}
config_args() {  # cfg=(--config FILE): the merged config when there is one, else BASE_CONFIG, else none
  cfg=()
  if [ -f "$S/h200.json" ]; then cfg=(--config "$S/h200.json")
  elif [ -n "${BASE_CONFIG:-}" ]; then cfg=(--config "$BASE_CONFIG"); fi
}
bench() {  # name, kernel, args... (the merged config when there is one)
  local name=$1 kernel=$2
  shift 2
  local cfg
  config_args
  "${BENCH[@]}" -k "$kernel" "${cfg[@]}" --baselines "${BASELINES:-fla}" --out "$OUT/$name" "$@"
}
case $STEP in
  # tuning: each kernel's anchor bucket, then the others seeded from it (and from the shipped configs)
  kda_anchor) search chunk_kda_anchor chunk_kda 110 --seq-lens $TA --head-dims $D --heads $H ;;
  kda_d64) search kda_d64 chunk_kda 60 --seq-lens $TA --head-dims $D2 --heads $H ;;
  kda_t) search kda_t chunk_kda ${KDA_T_S:-25} --seq-lens $T1,$T2 --head-dims $D --heads $H ;;
  kda_b1) search kda_b1 chunk_kda 35 --seq-lens $LONG3 --batch 1 --head-dims $D --heads $H ;;
  kda_packed) search kda_packed chunk_kda ${PACKED_S:-35} --packed-seqs $PACKED --head-dims $D --heads $H ;;
  gdn_anchor) search chunk_gated_delta_rule_anchor chunk_gated_delta_rule 100 --seq-lens $TA --head-dims $D --heads $H ;;
  gdn_t) search gdn_t chunk_gated_delta_rule 25 --seq-lens $T1,$T2 --head-dims $D --heads $H ;;
  gdn_b1) search gdn_b1 chunk_gated_delta_rule 35 --seq-lens $LONG3 --batch 1 --head-dims $D --heads $H ;;
  gdn_packed) search gdn_packed chunk_gated_delta_rule ${PACKED_S:-35} --packed-seqs $PACKED --head-dims $D --heads $H ;;
  gdn_hv2) search gdn_hv2 chunk_gated_delta_rule 35 --seq-lens ${LONG%%,*} --batch 1 --hv-ratio 2 --head-dims $D --heads $H ;;
  dn_anchor) search chunk_delta_rule_anchor chunk_delta_rule 90 --seq-lens $TA --head-dims $D --heads $H ;;
  dn_b1) search dn_b1 chunk_delta_rule 35 --seq-lens $LONG --batch 1 --head-dims $D --heads $H ;;
  dn_packed) search dn_packed chunk_delta_rule ${PACKED_S:-35} --packed-seqs $PACKED --head-dims $D --heads $H ;;
  # sitting D (planned): the buckets sittings B and C left untuned
  kda_d64_t) search kda_d64_t chunk_kda ${KDA_T_S:-45} --seq-lens $T1,$T2 --head-dims $D2 --heads $H ;;
  gdn_d64) search gdn_d64 chunk_gated_delta_rule 30 --seq-lens $T1,$TA,$T2 --head-dims $D2 --heads $H ;;
  dn_d64) search dn_d64 chunk_delta_rule 30 --seq-lens $T1,$TA,$T2 --head-dims $D2 --heads $H ;;
  d256_*) k=${STEP#d256_}; search "d256_$k" "chunk_$k" ${D256_S:-60} --seq-lens $TA --head-dims $D3 --heads $H ;;
  merge1) merge "chunk_kda and chunk_gated_delta_rule" ;;
  merge2) merge "chunk_delta_rule" ;;
  merge3) merge "${MERGE_NOTE:-chunk_delta_rule, chunk_kda T 1024/16384, the backward}" ;;
  # the benchmark of record: dtune (merged configs) vs its default and fla (default; chunk_kda also safe_gate)
  bench_grid_kda) bench "$STEP" chunk_kda --seq-lens $T1,$TA,$T2 --head-dims $D2,$D --heads $H --batch-tokens $BT ;;
  bench_grid_*)
    k=${STEP#bench_grid_}
    bench "$STEP" "chunk_$k" --seq-lens $T1,$TA,$T2 --head-dims $D --heads $H --batch-tokens $BT ;;
  bench_long_*) k=${STEP#bench_long_}; bench "$STEP" "chunk_$k" --seq-lens $LONG --batch 1 --head-dims $D --heads $H ;;
  bench_packed_*) k=${STEP#bench_packed_}; bench "$STEP" "chunk_$k" --packed-seqs $PACKED --head-dims $D --heads $H ;;
  bench_d64_*) k=${STEP#bench_d64_}; bench "$STEP" "chunk_$k" --seq-lens $T1,$TA,$T2 --head-dims $D2 --heads $H \
    --batch-tokens $BT ;;
  bench_d256_*) k=${STEP#bench_d256_}; bench "$STEP" "chunk_$k" --seq-lens $T1,$TA --head-dims $D3 --heads $H \
    --batch-tokens $BT ;;
  # where the time goes at the shapes below target: per-stage times against each stage's floor (dtune profile)
  profile_*)  # profile_<kernel without chunk_>_<T>_<B>_<D>, e.g. profile_gated_delta_rule_16384_2_128
    IFS=_ read -r -a parts <<< "${STEP#profile_}"
    n=${#parts[@]}
    k=$(IFS=_; echo "${parts[*]:0:n-3}")
    T=${parts[n-3]} B=${parts[n-2]} DD=${parts[n-1]}
    config_args
    if [ -n "${DRY:-}" ]; then T=$((T / 256 + 5)); B=1; DD=$D; fi
    python3 -m dtune profile -k "chunk_$k" --seq-len "$T" --batch "$B" --head-dim "$DD" --heads $H \
      --dtype "$([ -n "${DRY:-}" ] && echo fp32 || echo bf16)" "${cfg[@]}" --out "$OUT/$STEP" \
      $([ -n "${DRY:-}" ] && echo --interpret) ;;
  # the search on two GPUs against one (issue 10's target: 1.8x the completed trials a minute), same budget
  scaling)  # the summary line of each search ("... timed/min ...") is in this step's log
    pair=0,1
    [ -n "${DRY:-}" ] && pair=0  # one CPU: the plumbing only
    for d in "$pair" 0; do
      name=scaling_$(echo "$d" | tr , _)_$RANDOM
      "${SEARCH[@]}" -k chunk_gated_delta_rule --no-seeds --seq-lens $TA --head-dims $D --heads $H \
        --timeout "$(t "${SCALING_S:-90}")" --devices "$d" --out "$RUNS/$name" || echo "search on devices $d exited $?"
      tar czf "$OUT/$name.tgz" -C "$RUNS" "$name"
    done ;;
  bench_hv2) bench "$STEP" chunk_gated_delta_rule --seq-lens ${LONG%%,*} --batch 1 --hv-ratio 2 --head-dims $D --heads $H ;;
  bwd)
    if [ -n "${DRY:-}" ]; then python3 scripts/gpu_bwd.py --interpret --budget-s 120 --search-s 10
    else python3 scripts/gpu_bwd.py --budget-s "${BWD_S:-180}" --search-s "${BWD_SEARCH_S:-25}" \
      --skip "${BWD_SKIP:-}" -j "${BWD_J:-6}"; fi
    [ -f "$OUT/bwd_tuned.json" ] && cp "$OUT/bwd_tuned.json" "$S/" || true ;;
  sanitizer)
    if [ -n "${DRY:-}" ]; then python3 scripts/gpu_crash.py --interpret --no-variants --sweep-s 20
    else python3 scripts/gpu_crash.py --no-variants --budget-s "${SAN_S:-100}" --sweep-s "$((${SAN_S:-100} - 10))"; fi ;;
  # the search-quality benchmark: each strategy from the default alone, against the best known config
  sq_*)
    strategy=${STEP#sq_}
    if [ -n "${DRY:-}" ]; then python3 scripts/search_quality.py --interpret --strategies "$strategy" --budget 8
    else
      known=()
      [ -f "$S/h200.json" ] && known=(--known-config "$S/h200.json")
      python3 scripts/search_quality.py --strategies "$strategy" --budget "${SQ_S:-80}" --compile-ahead 14 \
        --kernels "${KERNELS:-chunk_kda,chunk_gated_delta_rule,chunk_delta_rule}" \
        --deadline "${DEADLINE:-0}" "${known[@]}"
    fi ;;
  *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
