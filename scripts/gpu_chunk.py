"""GPU check of the chunkwise kernels: correctness at real sizes (float32, bfloat16) and a benchmark against fla.

Usage (one CUDA GPU):  python scripts/gpu_chunk.py [--quick] [--no-bench] [--no-check] [--no-fla] [--budget-s 230]
                                                   [--sweep N]

1. Correctness: `dtune verify`'s chunk cases (dtune.measure.verify: real sizes, D = 256, a packed batch with
   grouped heads, K != V and an empty sequence, the transposed state pass, KDA with log gates down to −60, and
   unless --quick the config variants) against the float64 reference. ``--sweep N`` adds N random configs per op
   from the shipped search space (bf16, B=2 T=1000 H=4 HV=8 D=128), each run twice and compared bitwise.
2. Benchmark (not a test): bf16, B·T = 32768, H = 16 (8 at D = 256), T in {1024, 4096, 16384}, D in {64, 128, 256}:
   `dtune bench`'s harness (shipped config, default, fla when importable, chunk_kda also in fla's safe_gate mode)
   and `dtune profile`'s per-stage times of the shipped config. fla autotunes every new shape family on its first
   call (20-80 s): the full grid does not fit 4 minutes with fla; --budget-s skips what is left (SKIP).

Details go to $OUT (default ./out): chunk_correctness.csv, chunk_bench.csv, chunk_stages.csv. The short tables are
printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import pandas as pd
import torch
from dtune.kernels import KERNELS

from dtune.measure import verify
from dtune.measure.bench import run_bench
from dtune.measure.grids import make_grid
from dtune.measure.profile import run_profile
from dtune.measure.timing import ceilings
from dtune.measure.work import Roofs
from dtune.shape import Gate, Shape


def bench(quick: bool, use_fla: bool, deadline: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, stages = [], []
    roofs = Roofs.from_ceilings(ceilings())
    for kernel in ("chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule"):
        for D in (128,) if quick else (64, 128, 256):
            for T in (4096,) if quick else (1024, 4096, 16384):
                H, B = (8 if D == 256 else 16), 32768 // T
                if time.time() > deadline:
                    print(f"{kernel:<24} D{D:<4} T{T:<6} SKIP (time budget)", flush=True)
                    continue
                try:
                    grid = make_grid(kernel, True, [T], [D], [H], [B])
                    f = run_bench(kernel, grid, torch.bfloat16, ["default", "fla"] if use_fla else ["default"]).frame
                    rows.append(f)
                    print(
                        f[["kernel", "impl", "K", "T", "median_ms", "first_call_s"]].to_string(header=False), flush=True
                    )
                    p = Shape(B, T, H, H, D, D, gate=Gate(KERNELS[kernel].gate))
                    stages.append(run_profile(kernel, p, torch.bfloat16, roofs=roofs, measure_ceilings=False).frame)
                except Exception:
                    traceback.print_exc()
                torch.cuda.empty_cache()
    return (pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()), (
        pd.concat(stages, ignore_index=True) if stages else pd.DataFrame()
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grids (benchmark: D=128, T=4096)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness part")
    ap.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    ap.add_argument("--no-fla", action="store_true", help="benchmark dtune only")
    ap.add_argument("--budget-s", type=float, default=230.0, help="skip benchmark cases started after this")
    ap.add_argument("--sweep", type=int, default=0, metavar="N", help="also check N random configs per op (bf16)")
    args = ap.parse_args()
    start = time.time()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    cases = [] if args.no_check else verify.default_cases(verify.CHUNK, on_gpu=True, quick=args.quick)
    for kernel in verify.CHUNK if args.sweep else ():
        cases += verify.sweep_cases(kernel, args.sweep, Shape(2, 1000, 4, 8, 128, 128, gate=Gate(KERNELS[kernel].gate)))
    corr = pd.DataFrame(verify.run_cases(cases, "cuda", lambda row: print(verify.describe(row), flush=True)))
    corr.to_csv(out / "chunk_correctness.csv", index=False)
    t_check = time.time() - start
    rows, stages = (pd.DataFrame(), pd.DataFrame())
    if not args.no_bench:
        rows, stages = bench(args.quick, not args.no_fla, start + args.budget_s)
        rows.to_csv(out / "chunk_bench.csv", index=False)
        stages.to_csv(out / "chunk_stages.csv", index=False)

    # ---- short tables, last ----
    if len(corr):
        print(f"\n=== chunk correctness vs the float64 reference ({t_check:.0f} s) ===")
        print(
            corr[["case", "dtype", "err_o", "err_s", "pass"]].to_string(index=False, float_format=lambda f: f"{f:.2e}")
        )
    if len(stages):
        print("\n=== shipped config: per-stage ms (nominal TFLOP/s, GB/s, regs/spills/smem) ===")
        cols = ["kernel", "K", "T", "stage", "median_ms", "tflops", "gbs", "registers", "spills", "shared_mem"]
        print(stages[cols].to_string(index=False, float_format=lambda f: f"{f:.3f}"))
    if len(rows):
        print(f"\n=== bf16, B*T=32768, median ms, speedup vs fla's fastest mode; {time.time() - start:.0f} s ===")
        eager = rows[rows["mode"] == "eager"]
        piv = eager.pivot_table(index=["kernel", "K", "T"], columns="impl", values="median_ms")
        piv["vs_fla"] = eager[eager["impl"] == "tuned"].set_index(["kernel", "K", "T"])["speedup_vs_fla"]
        print(piv.to_string(float_format=lambda f: f"{f:.3f}"))
    n_fail = int((~corr["pass"].astype(bool)).sum()) if len(corr) else 0
    if len(corr):
        print(f"\ncorrectness: {len(corr) - n_fail} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
