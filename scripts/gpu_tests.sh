#!/usr/bin/env bash
# The GPU-marked tests (pytest -m gpu): bf16 chunk kernels forward and backward, compiled, against the float64
# reference at real sizes, the configurations that once crashed, the hot path (no host sync, CUDA graphs), fla's ops
# with the dtune backend. CI skips them (no GPU, interpreter on); run this on a GPU machine.
# One pytest process per test file: an illegal memory access poisons a process's CUDA context, so every later test in
# it would fail too; here it costs only its file. Results: $OUT/gpu_tests/<file>.xml (JUnit) and .log, a summary line
# per file and the failed tests last.
# Usage: OUT=/tmp/out bash scripts/gpu_tests.sh [extra pytest args] [test files or folders: all of tests/ if none]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT/gpu_tests"
unset TRITON_INTERPRET
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
paths=() args=()
for a in "$@"; do if [ -e "${a%%::*}" ]; then paths+=("$a"); else args+=("$a"); fi; done
[ ${#paths[@]} -eq 0 ] && paths=(tests)
files=()
for p in "${paths[@]}"; do
  if [ -d "$p" ]; then
    while IFS= read -r f; do files+=("$f"); done < <(grep -rlE "mark\.gpu|pytest\.mark\.gpu" --include='test_*.py' "$p" | sort)
  else
    files+=("$p")
  fi
done
rc=0
: > "$OUT/gpu_tests/summary.txt"
for f in "${files[@]}"; do
  name=$(echo "${f%%::*}" | sed 's|/|_|g; s|\.py$||')
  "$PY" -m pytest -m gpu -p no:cacheprovider -rfE --junitxml "$OUT/gpu_tests/$name.xml" ${args[@]+"${args[@]}"} "$f" \
    > "$OUT/gpu_tests/$name.log" 2>&1
  code=$?
  # exit 5: nothing collected under -m gpu in that file (its gpu tests are deselected by the arguments)
  [ "$code" -ne 0 ] && [ "$code" -ne 5 ] && rc=1
  echo "$f: exit $code, $(tail -1 "$OUT/gpu_tests/$name.log")" | tee -a "$OUT/gpu_tests/summary.txt"
done
grep -h "^FAILED\|^ERROR" "$OUT"/gpu_tests/*.log | cut -c1-200
echo "gpu tests: exit $rc (0 = all passed); $OUT/gpu_tests/"
exit "$rc"
