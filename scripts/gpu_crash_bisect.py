"""Bisect the illegal memory access two DeltaNet trials hit on the H200 (2026-11-29, runs-2026-11-29b/chunk_delta_rule
trials 18 and 20: INTRA = "blocks" at 8 warps, FUSE_OUTPUT = false). The same configs are correct under Triton's
interpreter, so the fault depends on the compiled code (warp count, tile shapes).

Usage (one CUDA GPU):  python scripts/gpu_crash_bisect.py [--timeout-s 150]

Each variant runs in its own process (an illegal access poisons the CUDA context), all at once so their compiles
overlap: the trial's shape (bf16, B = 8, T = 4096, H = 16, D = 128), then the gate's packed edge case, each checked
against the float64 reference. One line per variant; `crash` names the first failing launch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

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

CHILD = """
import json, sys, torch
from dtune import ops
from dtune.shape import Gate, Shape
from dtune.measure.inputs import make_inputs
from dtune.kernels.reference import chunk_reference
config = json.loads(sys.argv[1])
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script under the interpreter
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
B, T = (8, 4096) if DEV == "cuda" else (1, 100)
cases = [(f"B{B}-T{T}", Shape(B, T, 16, 16, 128, 128, B, Gate.NONE), None),
         ("edge", Shape(1, 0, 2, 2, 128, 128, 3, Gate.NONE, True), [1, 17, 150])]
for name, p, lens in cases:
    x = make_inputs(p, dtype=DT, device=DEV, seed=1, initial_state=True, seq_lens=lens)
    try:
        o, s = ops.run_kernel("chunk_delta_rule", **x, output_final_state=True, config=config)
        if DEV == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        print(json.dumps({"case": name, "crash": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}))
        sys.exit(0)
    ro, rs = chunk_reference(**x, output_final_state=True)
    err = max(float((o.double() - ro).norm() / ro.norm()), float((s.double() - rs).norm() / rs.norm()))
    print(json.dumps({"case": name, "err": err}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=150.0)
    args = ap.parse_args()
    t0 = time.monotonic()
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, cfg in VARIANTS.items()
    }
    rows = []
    for name, p in procs.items():
        try:
            out, err = p.communicate(timeout=max(1.0, args.timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rows.append((name, "timeout"))
            continue
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if not results:
            rows.append((name, f"no result (rc {p.returncode}): {err.strip().splitlines()[-1:]}"))
            continue
        cells = [f"{r['case']} " + (f"CRASH {r['crash']}" if "crash" in r else f"err {r['err']:.1e}") for r in results]
        rows.append((name, "; ".join(cells)))
    print(f"{'variant':22s} result ({time.monotonic() - t0:.0f} s)")
    for name, res in rows:
        print(f"{name:22s} {res}")


if __name__ == "__main__":
    main()
