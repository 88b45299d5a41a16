"""GPU check of the fused-recurrent kernels: correctness at real sizes (float32, bfloat16) and decode timings.

Usage (on a CUDA machine):  python scripts/gpu_check.py [--quick] [--no-bench]
Correctness: every case against the float64 chunked reference on the GPU, relative RMS error of the output and
the final state; prints a pass/fail table. Benchmark (not a test): decode (T = 1, float32 state) eager and
under CUDA-graph replay, dtune's default and tuned configs vs flash-linear-attention when importable, with
achieved bandwidth on the state against the copy bandwidth measured in the same run.
Details go to $OUT (default ./out) as CSV; the short tables are printed last.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from dtune.kernels.reference import chunk_reference

from dtune import ops
from dtune.inputs import dtype_name
from dtune.measure.inputs import make_inputs
from dtune.measure.timing import ceilings, time_back_to_back, time_graph
from dtune.shape import Gate, Shape

OPS = {
    Gate.NONE: "fused_recurrent_delta_rule",
    Gate.SCALAR: "fused_recurrent_gated_delta_rule",
    Gate.CHANNEL: "fused_recurrent_kda",
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def correctness_cases(quick: bool) -> list[tuple[str, Shape, list[int] | None]]:
    cases: list[tuple[str, Shape, list[int] | None]] = []
    for gate in Gate:
        g = gate.value
        cases += [
            (f"decode-B256-H16-D128-{g}", Shape(256, 1, 16, 16, 128, 128, 256, gate), None),
            (f"decode-B32-H8-D256-{g}", Shape(32, 1, 8, 8, 256, 256, 32, gate), None),
            (f"prompt-B4-T4096-H16-D64-{g}", Shape(4, 4096, 16, 16, 64, 64, 4, gate), None),
            (f"gva-B2-T1023-H4-HV8-K128-V64-{g}", Shape(2, 1023, 4, 8, 128, 64, 2, gate), None),
            (f"varlen-H4-D128-{g}", Shape(1, 0, 4, 4, 128, 128, 6, gate, True), [1, 700, 33, 1, 2048, 129]),
        ]
    return cases[:5] if quick else cases


def check_correctness(quick: bool) -> pd.DataFrame:
    rows = []
    for name, p, seq_lens in correctness_cases(quick):
        for dtype in (torch.float32, torch.bfloat16):
            row: dict[str, Any] = {"case": name, "dtype": dtype_name(dtype)}
            try:
                x = make_inputs(p, dtype=dtype, device="cuda", seed=1, seq_lens=seq_lens, gate_min=-5.0)
                args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
                kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
                o, s = ops.run_kernel(OPS[p.gate], *args, **kw)
                o_ref, s_ref = chunk_reference(*args, **kw)
                assert s is not None and s_ref is not None
                row |= {"err_o": rel(o, o_ref), "err_s": rel(s, s_ref)}
                row["pass"] = row["err_o"] < TOL[dtype] and row["err_s"] < TOL[dtype]
            except Exception as e:  # one failing case must not hide the others
                row |= {"err_o": float("nan"), "err_s": float("nan"), "pass": False, "error": repr(e)[:200]}
                traceback.print_exc()
            rows.append(row)
            print(
                f"{row['case']:<40} {row['dtype']:<5} o {row['err_o']:.2e} S {row['err_s']:.2e} "
                f"{'PASS' if row['pass'] else 'FAIL'}",
                flush=True,
            )
    return pd.DataFrame(rows)


def fla_ops() -> dict[Gate, Any]:
    try:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        from fla.ops.kda import fused_recurrent_kda
    except Exception as e:
        print(f"fla not importable ({e!r}): no fla baseline")
        return {}
    return {
        Gate.NONE: lambda q, k, v, g, b, h0: fused_recurrent_delta_rule(
            q, k, v, b, initial_state=h0, output_final_state=True
        ),
        # fla's gated op takes (q, k, v, g, gk, gv, beta, ...): pass g and beta by keyword.
        Gate.SCALAR: lambda q, k, v, g, b, h0: fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=b, initial_state=h0, output_final_state=True
        ),
        Gate.CHANNEL: lambda q, k, v, g, b, h0: fused_recurrent_kda(
            q, k, v, g, b, initial_state=h0, output_final_state=True
        ),
    }


def bench_decode(quick: bool, copy_gbs: float) -> pd.DataFrame:
    fla = fla_ops()
    rows = []
    dims = (128,) if quick else (64, 128)
    for gate in (Gate.NONE, Gate.CHANNEL, Gate.SCALAR):
        for D in dims:
            for B in (1, 32, 256):
                p = Shape(B, 1, 16, 16, D, D, B, gate)
                x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=2)
                q, k, v, g, b, h0 = x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"]
                state_bytes = 8 * B * 16 * D * D

                impls: dict[str, Any] = {
                    "dtune": partial(
                        ops.run_kernel, OPS[gate], q, k, v, g, b, initial_state=h0, output_final_state=True
                    )
                }
                if gate in fla:
                    impls["fla"] = partial(fla[gate], q, k, v, g, b, h0)
                for impl, fn in impls.items():
                    eager = time_back_to_back(fn)
                    graph = time_graph(fn)
                    rows.append(
                        {
                            "op": OPS[gate],
                            "D": D,
                            "B": B,
                            "impl": impl,
                            "eager_ms": eager.median_ms,
                            "graph_ms": graph.median_ms,
                            "graph_gbs": state_bytes / (graph.median_ms * 1e-3) / 1e9,
                            "graph_frac_copy": state_bytes / (graph.median_ms * 1e-3) / 1e9 / copy_gbs,
                        }
                    )
                    r = rows[-1]
                    print(
                        f"{r['op']:<34} D{D:<4} B{B:<4} {impl:<6} eager {r['eager_ms'] * 1e3:7.1f} us  graph "
                        f"{r['graph_ms'] * 1e3:7.1f} us  {r['graph_gbs']:6.0f} GB/s ({r['graph_frac_copy']:.0%})",
                        flush=True,
                    )
    return pd.DataFrame(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--no-bench", action="store_true", help="correctness only")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    t0 = time.time()
    corr = check_correctness(args.quick)
    corr.to_csv(out / "fused_recurrent_correctness.csv", index=False)
    bench = None
    if not args.no_bench:
        ceil = ceilings()
        print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s")
        bench = bench_decode(args.quick, ceil["copy_gbs"])
        bench.to_csv(out / "fused_recurrent_decode.csv", index=False)
    print(f"\n=== fused recurrent correctness ({time.time() - t0:.0f} s) ===")
    print(corr.to_string(index=False, float_format=lambda f: f"{f:.2e}"))
    if bench is not None:
        print("\n=== decode, T=1, H=16, bf16 in / fp32 state: median us (graph replay), state GB/s ===")
        piv = bench.pivot_table(index=["op", "D", "B"], columns="impl", values=["graph_ms", "graph_frac_copy"])
        print(piv.to_string(float_format=lambda f: f"{f:.4f}"))
    n_fail = int((~corr["pass"]).sum())
    print(f"\n{len(corr) - n_fail} passed, {n_fail} failed")
    return 1 if n_fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
