#!/usr/bin/env bash
# Set up a development environment in .venv: torch (a CPU build is enough without a GPU), triton, dtune and
# its dev tools. Re-running it is safe. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
CPU_INDEX=https://download.pytorch.org/whl/cpu
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  elif python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/', timeout=5)" 2>/dev/null; then
    # Without a GPU the CPU build is all the interpreter needs (~200 MB; PyPI's default Linux build is the CUDA one,
    # ~5.7 GB with its CUDA libraries).
    python -m pip install -q torch --index-url "$CPU_INDEX"
  else
    echo "setup: $CPU_INDEX is not reachable: torch comes from the configured index (on PyPI for Linux, the CUDA build)"
    python -m pip install -q torch==2.13.0
  fi
fi
python -m pip install -q -e ".[dev]"
python -c "import dtune, torch, triton; print(f'dtune {dtune.__version__}, torch {torch.__version__}, triton {triton.__version__}')"
# The report's browser test (tests/e2e) needs headless Chromium; without it that test is skipped (its reason shown).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1 && [ -z "${DTUNE_CHROMIUM:-}" ]; then
  echo "setup: no Chromium found: the report's browser test will be skipped. Install it (Debian/Ubuntu: sudo apt-get" \
    "install chromium; .ci/run does) or set DTUNE_CHROMIUM to a Chromium/Chrome binary."
fi
