#!/usr/bin/env bash
# The GPU-marked tests (pytest -m gpu): bf16 chunk kernels, compiled, against the float64 reference at real sizes
# (tests/kernels/test_chunk_gpu.py) and the configurations that once crashed (tests/kernels/test_chunk_crash_gpu.py).
# CI skips them (no GPU, interpreter on); run this on a GPU machine (< 6 min on an H200: ~20 compiles, 31 cases). Results: $OUT/gpu_tests.xml (JUnit) and $OUT/gpu_tests.log; the summary last.
# Usage: OUT=/tmp/out bash scripts/gpu_tests.sh [extra pytest args] [test paths: all of tests/ when none is given]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
paths=tests
for a in "$@"; do [ -e "${a%%::*}" ] && paths=; done  # a test path given: only those
"$PY" -m pytest -m gpu -p no:cacheprovider -q -rs --junitxml "$OUT/gpu_tests.xml" "$@" $paths 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
echo "gpu tests: exit $rc (0 = all passed); $OUT/gpu_tests.xml"
exit "$rc"
