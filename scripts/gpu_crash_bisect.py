"""Bisect the illegal memory access two DeltaNet trials hit on the H200 (2026-11-29, runs-2026-11-29b/chunk_delta_rule
trials 18 and 20: INTRA = "blocks" at 8 warps, FUSE_OUTPUT = false). The same configs are correct under Triton's
interpreter, so the fault depends on the compiled code (warp count, tile shapes).

Usage (one CUDA GPU):  python scripts/gpu_crash_bisect.py [--timeout-s 150]

Each variant and case runs in its own process (dtune.measure.verify.run_isolated: an illegal access poisons the CUDA
context), all at once so their compiles overlap: the trial's shape (bf16, B = 8, T = 4096, H = 16, D = 128) and the
gate's packed edge case, each checked against the float64 reference. One line per case; `crash` names the exit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import torch

from dtune.measure import verify
from dtune.shape import Shape

BASE: dict[str, Any] = {
    "INTRA": "blocks", "FUSE_OUTPUT": False, "F32_DOT": "ieee", "intra_BK": 64, "intra_num_stages": 1,
    "h_num_warps": 4, "h_num_stages": 2, "o_BK": 64, "o_num_stages": 2,
}  # fmt: skip
T18 = {**BASE, "BT": 128, "BC": 64, "intra_BV": 32, "intra_num_warps": 8, "h_BV": 64, "o_BV": 64, "o_num_warps": 4}
T20 = {**BASE, "BT": 64, "BC": 16, "intra_BV": 128, "intra_num_warps": 8, "h_BV": 32, "o_BV": 32, "o_num_warps": 8}
VARIANTS: dict[str, dict[str, Any]] = {
    "trial18": T18,
    "trial18 intra w4": {**T18, "intra_num_warps": 4},
    "trial20": T20,
    "trial20 intra w4": {**T20, "intra_num_warps": 4},
    "trial20 intra_BV 64": {**T20, "intra_BV": 64},
    "trial20 fused output": {**T20, "FUSE_OUTPUT": True},
    "trial20 output w4": {**T20, "o_num_warps": 4},
}


def cases(config: dict[str, Any], name: str) -> list[verify.Case]:
    """The trial's shape and the gate's packed edge case (a dry run under the interpreter: small, float32)."""
    on_gpu = torch.cuda.is_available()
    B, T = (8, 4096) if on_gpu else (1, 100)
    dtype = "bf16" if on_gpu else "fp32"
    return [
        verify.Case(f"{name} B{B}-T{T}", "chunk_delta_rule", Shape(B, T, 16, 16, 128, 128), dtype, None, config),
        verify.Case(f"{name} edge", "chunk_delta_rule", Shape(1, 0, 2, 2, 128, 128), dtype, (1, 17, 150), config),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=150.0)
    args = ap.parse_args()
    t0 = time.monotonic()
    rows = verify.run_isolated([c for name, cfg in VARIANTS.items() for c in cases(cfg, name)], args.timeout_s)
    print(f"{'variant / case':34s} result ({time.monotonic() - t0:.0f} s)")
    for r in rows:
        result = r.get("error") or f"err {max(r['err_o'], r['err_s']):.1e} " + ("PASS" if r["pass"] else "FAIL")
        print(f"{r['case']:34s} {result}")


if __name__ == "__main__":
    main()
