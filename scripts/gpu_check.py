"""GPU check of the fused-recurrent kernels: correctness at real sizes (float32, bfloat16) and decode timings.

Usage (on a CUDA machine):  python scripts/gpu_check.py [--quick] [--no-bench]
Correctness: `dtune verify`'s fused-recurrent cases (dtune.measure.verify) against the float64 reference, relative
RMS error of output and final state within the correctness gate's tolerance. Benchmark (not a test): decode
(T = 1, float32 state read and written) with `dtune bench`'s harness (dtune.measure.bench: eager CUDA events and
CUDA-graph replay), the shipped configs vs the default and flash-linear-attention when importable, with the
state's bandwidth against the copy bandwidth measured in the same run.
Details go to $OUT (default ./out) as CSV; the short tables are printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import pandas as pd
import torch

from dtune.measure import verify
from dtune.measure.bench import run_bench
from dtune.measure.grids import make_grid
from dtune.measure.timing import ceilings


def bench_decode(quick: bool, copy_gbs: float) -> pd.DataFrame:
    frames = []
    for kernel in verify.RECURRENT:
        dims = [128] if quick else [64, 128]
        grid = make_grid(kernel, True, seq_lens=[1], head_dims=dims, heads=[16], batches=[1, 32, 256])
        frames.append(run_bench(kernel, grid, torch.bfloat16, ["default", "fla"], graph=True).frame)
    f = pd.concat(frames, ignore_index=True)
    state_gbs = 8 * f["B"] * f["HV"] * f["K"] * f["V"] / (f["median_ms"] * 1e-3) / 1e9  # read + write, float32
    f["state_frac_copy"] = state_gbs / copy_gbs
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--no-bench", action="store_true", help="correctness only")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    t0 = time.time()
    cases = verify.default_cases(verify.RECURRENT, on_gpu=True, quick=args.quick)
    corr = pd.DataFrame(verify.run_cases(cases, "cuda", lambda row: print(verify.describe(row), flush=True)))
    corr.to_csv(out / "fused_recurrent_correctness.csv", index=False)
    bench = None
    if not args.no_bench:
        ceil = ceilings()
        print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s")
        bench = bench_decode(args.quick, ceil["copy_gbs"])
        bench.to_csv(out / "fused_recurrent_decode.csv", index=False)
    print(f"\n=== fused recurrent correctness ({time.time() - t0:.0f} s) ===")
    print(corr[["case", "dtype", "err_o", "err_s", "pass"]].to_string(index=False, float_format=lambda f: f"{f:.2e}"))
    if bench is not None:
        print(
            "\n=== decode, T=1, H=16, bf16 in / fp32 state: median ms and the state's share of the copy bandwidth ==="
        )
        piv = bench.pivot_table(
            index=["kernel", "K", "B", "mode"], columns="impl", values=["median_ms", "state_frac_copy"]
        )
        print(piv.to_string(float_format=lambda f: f"{f:.4f}"))
    n_fail = int((~corr["pass"].astype(bool)).sum())
    print(f"\n{len(corr) - n_fail} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
