"""GPU sitting for stage 1 (intra) variants of the chunk pipeline: correctness, then per-stage timings.

Usage (one CUDA GPU):  python scripts/gpu_intra.py [--budget-s 400]

1. Correctness (bf16 and float32, strong decays down to −5) of both stage-1 variants (INTRA = "blocks" / "rows")
   for the three gate modes at D = 128, T = 2000 and a varlen batch, against the float64 chunked reference.
2. Timings (not a test): bf16, B·T = 32768, H = 16, T = 4096, D in {64, 128}: every stage of the pipeline
   (median ms, L2 flushed, dtune.measure.time_fn) and the whole forward, for a list of variants (stage 1 and the
   state pass) on top of the default config. Rows go to $OUT/intra_stages.csv; a short table is printed last.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from dtune.kernels import KERNELS
from dtune.kernels import chunk as chunk_mod
from dtune.kernels.reference import chunk_reference

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.measure.timing import time_fn
from dtune.shape import Gate, Shape

OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
GATE_NAME = {Gate.NONE: "none", Gate.SCALAR: "scalar", Gate.CHANNEL: "channel"}
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}

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


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def correctness() -> list[str]:
    lines = []
    for gate in Gate:
        for intra in ("blocks", "rows"):
            for dtype in (torch.bfloat16, torch.float32):
                for name, p, lens in (
                    ("B2-T2000-H4-HV8-D128", Shape(2, 2000, 4, 8, 128, 128, 2, gate), None),
                    ("varlen-K128-V64", Shape(1, 0, 4, 8, 128, 64, 5, gate, True), [1, 700, 0, 2048, 129]),
                ):
                    try:
                        x = make_inputs(p, dtype=dtype, device="cuda", seed=1, seq_lens=lens, gate_min=-5.0)
                        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
                        kw = {"initial_state": x["initial_state"], "output_final_state": True}
                        kw["cu_seqlens"] = x["cu_seqlens"]
                        o, s = ops.run_kernel(OPS[gate], *args, **kw, config={"INTRA": intra})
                        o_ref, s_ref = chunk_reference(*args, **kw)
                        assert s is not None and s_ref is not None
                        eo, es = rel(o, o_ref), rel(s, s_ref)
                        ok = eo < TOL[dtype] and es < TOL[dtype]
                        line = f"{OPS[gate]:<24}{intra:<7}{str(dtype)[6:]:<9}{name:<22}o {eo:.1e} S {es:.1e} "
                        line += "PASS" if ok else "FAIL"
                    except Exception as e:  # one failure must not hide the rest
                        traceback.print_exc()
                        line = f"{OPS[gate]:<24}{intra:<7}{str(dtype)[6:]:<9}{name:<22}FAIL {e!r:.120}"
                    print(line, flush=True)
                    lines.append(line)
    return lines


def stage_times(deadline: float, out: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    shapes = [(Gate.CHANNEL, 128), (Gate.SCALAR, 128), (Gate.NONE, 128), (Gate.CHANNEL, 64)]
    for gate, D in shapes:
        p = Shape(8, 4096, 16, 16, D, D, 8, gate)
        x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=2, gate_min=-5.0)
        spec = KERNELS[OPS[gate]]
        for var in VARIANTS:
            if time.time() > deadline:
                print("budget spent: skipping the rest", flush=True)
                return rows
            row: dict[str, Any] = {"op": OPS[gate], "D": D, "variant": " ".join(f"{k}={v}" for k, v in var.items())}
            try:
                cfg = spec.check_config(D, D, var)
                args = (x["q"], x["k"], x["v"], x["g"], x["beta"], GATE_NAME[gate], D**-0.5, x["initial_state"])
                stages, _ = chunk_mod.plan(*args, True, None, cfg)
                for st in stages:
                    row[st.name] = time_fn(st.run, repeats=30).median_ms
                    row[st.name + "_floor"] = max(st.bytes / 4.2e9, st.flops / 7.0e11)  # ms at copy BW / bf16 rate

                def fwd(stages: list[Any] = stages) -> None:
                    for st in stages:
                        st.run()

                row["total"] = time_fn(fwd, repeats=30).median_ms
            except Exception as e:
                traceback.print_exc()
                row["error"] = repr(e)[:200]
            print(row, flush=True)
            rows.append(row)
            with open(out / "intra_stages.csv", "w", newline="") as f:
                keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("op", "D", "variant"), k))
                wr = csv.DictWriter(f, fieldnames=keys)
                wr.writeheader()
                wr.writerows(rows)
        del x
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    checks = [] if a.no_check else correctness()
    (out / "intra_correctness.txt").write_text("\n".join(checks) + "\n")
    rows = stage_times(t0 + a.budget_s, out)
    print("\n== correctness:", sum("PASS" in c for c in checks), "PASS /", len(checks))
    for c in checks:
        if "PASS" not in c:
            print(c)
    print(f"\n{'op':<24}{'D':>4}  {'variant':<52}{'intra':>7}{'state':>7}{'output':>7}{'total':>7}")
    for r in rows:
        cells = [r.get(k) for k in ("intra", "state", "output", "total")]
        st = r.get("state", r.get("state+output"))
        cells[1] = st
        txt = "".join(f"{c:7.3f}" if isinstance(c, float) else f"{'-':>7}" for c in cells)
        print(f"{r['op']:<24}{r['D']:>4}  {r['variant']:<52}{txt} {r.get('error', '')}")


if __name__ == "__main__":
    main()
