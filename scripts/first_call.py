"""First-call cost: what a user pays at start-up for a new shape family, dtune (shipped configs) vs fla.

Each measurement runs in a fresh Python process with an empty Triton cache (TRITON_CACHE_DIR in a new temporary
folder), so it includes JIT compilation and, for fla, its run-time autotuning. dtune reads its tuned config from
the package and compiles exactly one configuration per stage: no autotuning at run time.

Usage (on a CUDA machine):  python scripts/first_call.py [--kernels chunk_kda,fused_recurrent_kda] [--impls dtune,fla]
Prints one table (seconds for the first call, then ms for the second); CSV to $OUT/first_call.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from dtune.shape import Gate, Shape
from dtune.measure.inputs import make_inputs
from dtune.kernels import get_kernel
kernel, impl, T, D, B = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
p = Shape(B, T, 16, 16, D, D, B, Gate(get_kernel(kernel).gate))
x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=0)
q, k, v, g, b, h0 = x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"]
torch.cuda.synchronize()
if impl == "dtune":
    from dtune.ops import run_kernel
    call = lambda: run_kernel(kernel, q, k, v, g, b, initial_state=h0, output_final_state=True)
else:
    import importlib
    family = kernel.removeprefix("fused_recurrent_").removeprefix("chunk_")
    mod = importlib.import_module(f"fla.ops.{family}")
    fn = getattr(mod, kernel)
    kw = dict(initial_state=h0, output_final_state=True)
    call = (lambda: fn(q, k, v, b, **kw)) if g is None else (lambda: fn(q, k, v, g=g, beta=b, **kw))
t1 = time.perf_counter()
call(); torch.cuda.synchronize()
t2 = time.perf_counter()
call(); torch.cuda.synchronize()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_s": t2 - t1, "second_ms": (t3 - t2) * 1e3}))
"""

SHAPES = {"chunk": (4096, 128, 8), "fused_recurrent": (1, 128, 32)}  # T, D, B


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernels", default="chunk_kda,chunk_gated_delta_rule,chunk_delta_rule,fused_recurrent_kda")
    ap.add_argument("--impls", default="dtune,fla")
    args = ap.parse_args()
    rows = []
    for kernel in args.kernels.split(","):
        T, D, B = SHAPES["fused_recurrent" if kernel.startswith("fused") else "chunk"]
        for impl in args.impls.split(","):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, kernel, impl, str(T), str(D), str(B)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            row = {"kernel": kernel, "impl": impl, "T": T, "D": D, "B": B}
            if proc.returncode == 0:
                row |= json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                row["error"] = proc.stderr.strip().splitlines()[-1][:160] if proc.stderr else "failed"
            rows.append(row)
            print(row, flush=True)
    frame = pd.DataFrame(rows)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "first_call.csv", index=False)
    print("\n=== first call with a cold Triton cache (s), second call (ms) ===")
    print(frame.to_string(index=False, float_format=lambda f: f"{f:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
