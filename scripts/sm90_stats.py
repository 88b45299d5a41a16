"""Static figures of one chunk stage compiled for sm_90a (Hopper) on any machine, no GPU: tensor-core instructions,
shared-memory traffic and barriers inside the chunk loop of the PTX, registers / spills from the ptxas that Triton
ships, and the loop's machine instructions (cuobjdump; dtune.measure.sm90). The source of the "kv" vs "vk"
state-pass table in reports/h200/NOTES.md.

Usage:  python scripts/sm90_stats.py [--gate scalar] [--stage state] [--dim 128] CONFIG_JSON [CONFIG_JSON ...]
e.g.    python scripts/sm90_stats.py '{}' '{"STATE_LAYOUT": "vk", "h_BV": 64}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled Triton, not the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import triton

from dtune.measure.sm90 import OPS, PATTERNS, SASS_PATTERNS, stage_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="config overrides as JSON, on top of the kernel's default")
    ap.add_argument("--gate", choices=list(OPS), default="scalar")
    ap.add_argument("--stage", default="state", help="intra, state, output or intra-exact")
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--dtype", default="bf16")
    a = ap.parse_args()
    print(f"{OPS[a.gate]}, {a.dtype}, K = V = {a.dim}, stage {a.stage}, sm_90a, triton {triton.__version__}")
    cols = [*PATTERNS, "regs", "spills", "sass", *SASS_PATTERNS]  # sass: machine instructions in the loop
    print(f"{'config':<48}" + "".join(f"{c:>12}" for c in cols))
    for text in a.configs:
        row = stage_stats(a.gate, a.stage, a.dim, a.dtype, json.loads(text))
        print(f"{text:<48}" + "".join(f"{row.get(c, '-'):>12}" for c in cols))


if __name__ == "__main__":
    main()
