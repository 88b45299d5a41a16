#!/usr/bin/env bash
# Set up a development environment in .venv: torch (a CPU build is enough without a GPU), triton, dtune and
# its dev tools. Re-running it is safe. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    # Without a GPU, the CPU build of torch 2.13 is all the interpreter needs.
    python -m pip install -q torch==2.13.0
  fi
fi
python -m pip install -q -e ".[dev]"
python -c "import dtune, torch, triton; print(f'dtune {dtune.__version__}, torch {torch.__version__}, triton {triton.__version__}')"
