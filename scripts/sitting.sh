#!/usr/bin/env bash
# One GPU sitting in one device command: install the carried wheels, then run a plan of jobs, one queue per GPU in
# parallel, each job under its own timeout, its output folder and log packed into $OUT/sitting.tgz after every job
# (the device returns at most 8 files), the tail of every log printed last.
#
# Usage (from the checkout root on the GPU machine, .whl carried):  bash scripts/sitting.sh PLAN_FILE
# PLAN_FILE: one job per line, "GPU|NAME|SECONDS|COMMAND" (blank lines and # comments skipped); COMMAND runs with
# CUDA_VISIBLE_DEVICES=GPU and OUT=$OUT/raw/NAME, its output in $OUT/raw/NAME.log. GPU "all": the job runs after
# every per-GPU queue has finished, with all GPUs visible (e.g. a search timed on two GPUs), in plan order. DEADLINE (a Unix time, default
# now + 580 s) ends every queue: a job starts only with its SECONDS left before it. FINALLY: a command run once all
# queues are done (e.g. merging what they tuned), its output in $OUT/raw/finally.log. COMMIT: the commit to record
# (the device's copy of .git may be older than the working tree it runs).
set -uo pipefail
PLAN=$1
OUT=${OUT:-out}
DEADLINE=${DEADLINE:-$(($(date +%s) + 580))}
mkdir -p "$OUT/raw"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv,noheader | tee "$OUT/raw/gpus.txt"
echo "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" > "$OUT/raw/commit.txt"
[ -n "${COMMIT:-}" ] && export DTUNE_COMMIT=$COMMIT  # what dtune records in run.json / bench.csv (the copy's .git may be older)

pack() { tar czf "$OUT/sitting.tgz.tmp" -C "$OUT" raw && mv "$OUT/sitting.tgz.tmp" "$OUT/sitting.tgz"; }

queue() {  # the jobs of one GPU (or of "all"), in order
  local gpu=$1 name secs cmd left visible
  while IFS='|' read -r g name secs cmd; do
    [[ -z "$g" || "$g" == \#* || "$g" != "$gpu" ]] && continue
    left=$((DEADLINE - $(date +%s)))
    if [ "$left" -lt "$secs" ]; then
      echo "skipped: ${left}s left, needs ${secs}s" > "$OUT/raw/$name.log"
      continue
    fi
    mkdir -p "$OUT/raw/$name"
    local t0=$SECONDS
    visible=$gpu
    [ "$gpu" = all ] && visible=${ALL_GPUS:-}
    CUDA_VISIBLE_DEVICES=$visible OUT="$OUT/raw/$name" timeout "$secs" bash -c "$cmd" > "$OUT/raw/$name.log" 2>&1
    echo "(exit $?, $((SECONDS - t0)) s)" >> "$OUT/raw/$name.log"
    pack
  done < "$PLAN"
}

gpus=$(cut -d'|' -f1 "$PLAN" | grep -E '^[0-9]+$' | sort -u)
ALL_GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd, -)
for gpu in $gpus; do queue "$gpu" & done
wait
queue all  # the jobs that need every GPU, once the per-GPU queues are done
if [ -n "${FINALLY:-}" ]; then
  timeout 60 bash -c "$FINALLY" > "$OUT/raw/finally.log" 2>&1
  echo "(exit $?)" >> "$OUT/raw/finally.log"
fi
pack
for f in "$OUT"/raw/*.log; do
  echo "=================== $(basename "$f")"
  tail -n 30 "$f"
done
