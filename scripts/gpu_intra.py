"""GPU sitting for stage 1 (intra) variants of the chunk pipeline: correctness, then per-stage timings.

Usage (one CUDA GPU):  python scripts/gpu_intra.py [--budget-s 400] [--no-check]

1. Correctness (`dtune verify`'s check, dtune.measure.verify): bf16 and float32, strong decays down to −5, both
   stage-1 variants (INTRA = "blocks" / "rows") for the three gate modes at D = 128, T = 2000 and a packed batch
   with an empty sequence and K != V, against the float64 reference.
2. Timings (not a test): bf16, B·T = 32768, H = 16, T = 4096, D in {64, 128}: `dtune profile`'s per-stage times
   (dtune.measure.profile: the default workload, L2 flushed, median) and the whole op, for a list of variants (stage
   1 and the state pass) on top of the default config. Rows go to $OUT/intra_stages.csv; a short table is printed
   last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import pandas as pd
import torch
from dtune.kernels import KERNELS

from dtune.measure import verify
from dtune.measure.profile import TOTAL, run_profile
from dtune.measure.timing import ceilings
from dtune.measure.work import Roofs
from dtune.shape import Gate, Shape

VARIANTS: list[dict[str, Any]] = [
    {},  # the default: BT = 32, INTRA = "blocks" at 2 warps, fused output, STATE_LAYOUT = "kv"
    {"STATE_LAYOUT": "vk", "h_BV": 64},  # the transposed state pass at its wgmma size
    {"BT": 64, "STATE_LAYOUT": "vk", "h_BV": 64},
    {"h_BV": 16},  # twice the state-pass programs
    {"FUSE_OUTPUT": False},
    {"BT": 64},
    {"INTRA": "rows"},
    {"intra_BK": 32, "intra_num_warps": 4},
]


def correctness_cases() -> list[verify.Case]:
    cases = []
    for kernel in verify.CHUNK:
        g = Gate(KERNELS[kernel].gate)
        for intra in ("blocks", "rows"):
            for dtype in ("bf16", "fp32"):
                cfg = {"INTRA": intra}
                p = Shape(2, 2000, 4, 8, 128, 128, gate=g)
                cases.append(verify.Case(f"{kernel}-{intra}-B2-T2000-H4-HV8-D128", kernel, p, dtype, None, cfg))
                lens = (1, 700, 0, 2048, 129)
                p = Shape(1, 0, 4, 8, 128, 64, gate=g)
                cases.append(verify.Case(f"{kernel}-{intra}-varlen-K128-V64", kernel, p, dtype, lens, cfg))
    return cases


def stage_times(deadline: float, out: Path) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    roofs = Roofs.from_ceilings(ceilings())
    for kernel, D in (
        ("chunk_kda", 128),
        ("chunk_gated_delta_rule", 128),
        ("chunk_delta_rule", 128),
        ("chunk_kda", 64),
    ):
        p = Shape(8, 4096, 16, 16, D, D, gate=Gate(KERNELS[kernel].gate))
        for var in VARIANTS:
            if time.time() > deadline:
                print("budget spent: skipping the rest", flush=True)
                return pd.DataFrame(rows)
            row: dict[str, Any] = {"op": kernel, "D": D, "variant": " ".join(f"{k}={v}" for k, v in var.items())}
            try:
                f = run_profile(kernel, p, torch.bfloat16, var, roofs=roofs, measure_ceilings=False).frame
                for r in f.itertuples(index=False):
                    name = "total" if r.stage == TOTAL else str(r.stage)
                    row[name] = r.median_ms
                    row[name + "_floor"] = r.floor_ms
            except Exception as e:
                traceback.print_exc()
                row["error"] = repr(e)[:200]
            print(row, flush=True)
            rows.append(row)
            pd.DataFrame(rows).to_csv(out / "intra_stages.csv", index=False)
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    cases = [] if a.no_check else correctness_cases()
    checks = verify.run_cases(cases, "cuda", lambda row: print(verify.describe(row), flush=True))
    (out / "intra_correctness.txt").write_text("\n".join(verify.describe(r) for r in checks) + "\n")
    rows = stage_times(t0 + a.budget_s, out)
    print("\n== correctness:", sum(r["pass"] for r in checks), "PASS /", len(checks))
    for r in checks:
        if not r["pass"]:
            print(verify.describe(r))
    cols = [
        c for c in ("op", "D", "variant", "intra", "state", "state+output", "output", "total", "error") if c in rows
    ]
    print(rows[cols].to_string(index=False, float_format=lambda f: f"{f:.3f}") if len(rows) else "no timings")


if __name__ == "__main__":
    main()
