"""GPU sitting for the sequence-parallel state pass (SEG_CHUNKS): bf16 correctness at real sizes, then timings at
long prompts against the plain pass and flash-linear-attention.

Usage (one CUDA GPU):  python scripts/gpu_seqpar.py [--budget-s 540] [--check-s 200] [--no-check] [--no-bench]
                           [--no-fla] [--kernels chunk_kda,...] [--seq-lens 32768,65536] [--segs 0,8,16,32,64]
                       python scripts/gpu_seqpar.py --interpret      (the whole script on the CPU, tiny shapes)

1. Correctness (bf16, against the float64 chunked reference on the GPU; log gates down to −5 and, to make the
   segments' transition matrices matter, down to −0.05): each kernel at B=1 T=32768 H=16 D=128, a packed batch of
   16 prompts of 40–12000 tokens (52640, cu_seqlens) and B=1 T=32768 H=16 HV=32 (grouped value heads), each with
   an initial and a final state, with SEG_CHUNKS off and with two segmented configs. Relative RMS errors of the
   output and the final state; PASS under 2e-2 (the search spaces' bf16 tolerance).
2. Timing (not a test): B=1, T in --seq-lens, H=16, D=128, bf16, no initial state, final state on; dtune with
   SEG_CHUNKS in --segs × (BT, h_BV, STATE_LAYOUT, FUSE_OUTPUT) combinations; dtune.measure.time_fn (CUDA events,
   L2 flushed, median, IQR), per-stage medians from plan(); fla (chunk_kda also with safe_gate=True,
   lower_bound=-5, its fastest mode) in the same process, after its autotuning settled (warm-up calls first).
   Rows in priority order (T = 32768 for every kernel first), skipped when --budget-s runs out.

Results go to $OUT (default ./out): seqpar_check.csv, seqpar_bench.csv, written after every row. Tables last.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from dtune.kernels import KERNELS
from dtune.kernels import chunk as chunk_mod
from dtune.kernels.reference import chunk_reference

from dtune import ops
from dtune.measure.baselines import KDA_LOWER_BOUND, fla_function
from dtune.measure.inputs import make_inputs
from dtune.measure.timing import time_fn
from dtune.shape import Gate, Shape

KERNEL_NAMES = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda")
PACKED = [12000, 9000, 7000, 5500, 4200, 3300, 2600, 2000, 1600, 1300, 1100, 900, 700, 600, 800, 40]  # 52640
TOL = 2e-2
# (BT, h_BV, STATE_LAYOUT, FUSE_OUTPUT): the state pass's layouts worth timing with segments
COMBOS: list[tuple[int, int, str, bool]] = [(64, 64, "vk", True), (64, 32, "kv", False), (32, 64, "vk", True)]
CHECK_CONFIGS: list[dict[str, Any]] = [
    {},
    {"SEG_CHUNKS": 16, "BT": 64, "STATE_LAYOUT": "vk", "h_BV": 64},
    {"SEG_CHUNKS": 32, "BT": 32, "FUSE_OUTPUT": False, "h_BV": 32},
]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


class Table:
    """Rows written to $OUT/<name> after each one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with self.path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)


def check_cases(interpret: bool) -> list[tuple[str, Shape, list[int] | None]]:
    if interpret:
        return [(f"B1-T70-{g.value}", Shape(1, 70, 1, 1, 32, 32, 1, g), None) for g in Gate] + [
            (f"packed-{g.value}", Shape(1, 0, 1, 2, 32, 32, 3, g, True), [50, 3, 40]) for g in Gate
        ]
    cases: list[tuple[str, Shape, list[int] | None]] = []
    for g in Gate:
        cases.append((f"B1-T32768-H16-D128-{g.value}", Shape(1, 32768, 16, 16, 128, 128, 1, g), None))
        cases.append((f"packed16-52640-H16-D128-{g.value}", Shape(1, 0, 16, 16, 128, 128, 16, g, True), PACKED))
        cases.append((f"B1-T32768-H16-HV32-D128-{g.value}", Shape(1, 32768, 16, 32, 128, 128, 1, g), None))
    return cases


def run_check(a: argparse.Namespace, dev: str, dtype: torch.dtype, budget: Budget, out: Path) -> Table:
    table = Table(out / "seqpar_check.csv")
    configs = CHECK_CONFIGS if not a.interpret else [{}, {"SEG_CHUNKS": 2, "BT": 16, "BC": 16, "h_BV": 16}]
    for name, p, lens in check_cases(a.interpret):
        kernel = KERNEL_NAMES[list(Gate).index(p.gate)]
        if kernel not in a.kernels:
            continue
        for gmin in (-5.0, -0.05):
            if budget.left() < 60:
                print(f"  SKIP {name} (budget)", flush=True)
                continue
            x = make_inputs(p, dtype=dtype, device=dev, seed=7, seq_lens=lens, gate_min=gmin)
            kw = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            t0 = time.monotonic()
            o_ref, s_ref = chunk_reference(*args, **kw)
            t_ref = time.monotonic() - t0
            for cfg in configs:
                row: dict[str, Any] = {"case": name, "gate_min": gmin, "config": json.dumps(cfg)}
                try:
                    o, s = ops.run_kernel(kernel, *args, **kw, config=cfg)
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    assert s is not None and s_ref is not None
                    row |= {"err_o": rel(o, o_ref), "err_s": rel(s, s_ref)}
                    row["pass"] = row["err_o"] < TOL and row["err_s"] < TOL
                except Exception as e:  # one failing case must not hide the others
                    row |= {"err_o": float("nan"), "err_s": float("nan"), "pass": False, "error": repr(e)[:300]}
                    traceback.print_exc()
                row["ref_s"] = round(t_ref, 1)
                table.add(row)
                print(f"  {'PASS' if row['pass'] else 'FAIL'} {name:36s} g>={gmin:<6} {row['config']:60s} "
                      f"o {row['err_o']:.2e} s {row['err_s']:.2e}", flush=True)  # fmt: skip
            del x, o_ref, s_ref
    return table


def _fla_call(kernel: str, x: dict[str, Any], fast: bool) -> Any:
    fn, why = fla_function(kernel)
    if fn is None:
        return None
    g = x["g"]
    extra: dict[str, Any] = {}
    if fast:
        g = g.clamp(min=KDA_LOWER_BOUND)
        extra = {"safe_gate": True, "lower_bound": KDA_LOWER_BOUND}
    gates = {"beta": x["beta"]} if g is None else {"g": g, "beta": x["beta"]}
    kw = {**gates, "scale": x["q"].shape[-1] ** -0.5, "initial_state": None, "output_final_state": True}
    return lambda: fn(x["q"], x["k"], x["v"], **kw, **extra)


def op_call(kernel: str, args: tuple[Any, ...], config: dict[str, Any]) -> Any:
    return lambda: ops.run_kernel(kernel, *args, output_final_state=True, config=config)


def run_bench(a: argparse.Namespace, dev: str, dtype: torch.dtype, budget: Budget, out: Path) -> Table:
    table = Table(out / "seqpar_bench.csv")
    H, D = (16, 128) if not a.interpret else (1, 32)
    combos = COMBOS if not a.interpret else [(16, 16, "vk", True), (16, 16, "kv", False)]
    for T in a.seq_lens:
        for kernel in a.kernels:
            spec = KERNELS[kernel]
            gate = Gate(spec.gate)
            p = Shape(1, T, H, H, D, D, 1, gate)
            x = make_inputs(p, dtype=dtype, device=dev, seed=3, initial_state=False)
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            for BT, h_BV, layout, fuse in combos:
                for seg in a.segs:
                    if budget.left() < 45:
                        print(f"  SKIP {kernel} T{T} BT{BT} hBV{h_BV} {layout} seg{seg} (budget)", flush=True)
                        continue
                    cfg = {"BT": BT, "h_BV": h_BV, "STATE_LAYOUT": layout, "FUSE_OUTPUT": fuse, "SEG_CHUNKS": seg}
                    if a.interpret:
                        cfg |= {"BC": 16}
                    row: dict[str, Any] = {"kernel": kernel, "T": T, "impl": "dtune", **cfg}
                    try:
                        full = spec.check_config(D, D, cfg)
                        t_c = time.monotonic()
                        op_call(kernel, args, full)()  # compile
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        row["compile_s"] = round(time.monotonic() - t_c, 1)
                        t = time_fn(op_call(kernel, args, full), dev)
                        row |= {"median_ms": t.median_ms, "iqr_ms": t.iqr_ms, "meaningful": t.meaningful}
                        stages, _ = chunk_mod.plan(*args, spec.gate, D**-0.5, None, True, None, full)
                        row["stages_ms"] = " ".join(
                            f"{st.name}={time_fn(st.run, dev, warmup=2, repeats=20).median_ms:.3f}" for st in stages
                        )
                    except Exception as e:
                        row |= {"median_ms": float("nan"), "error": repr(e)[:300]}
                        traceback.print_exc()
                    table.add(row)
                    head = (
                        f"{kernel:24s} T{T:<6d} BT{BT:<3d} hBV{h_BV:<3d} {layout} {'fused' if fuse else 'unfused':8s}"
                    )
                    print(f"  {head}seg{seg:<3d} {row['median_ms']:.3f} ms  {row.get('stages_ms', '')}", flush=True)
            if not a.no_fla and dev == "cuda":
                for fast in (False, True) if gate is Gate.CHANNEL else (False,):
                    if budget.left() < 90:  # fla autotunes a new shape family on its first call (20-80 s)
                        print(f"  SKIP fla {kernel} T{T} (budget)", flush=True)
                        continue
                    name = "fla_fast" if fast else "fla"
                    row = {"kernel": kernel, "T": T, "impl": name}
                    try:
                        call = _fla_call(kernel, x, fast)
                        if call is None:
                            print(f"  fla not importable: {fla_function(kernel)[1]}", flush=True)
                            break
                        t_c = time.monotonic()
                        for _ in range(3):  # autotune, then settled
                            call()
                        torch.cuda.synchronize()
                        row["compile_s"] = round(time.monotonic() - t_c, 1)
                        t = time_fn(call, dev)
                        row |= {"median_ms": t.median_ms, "iqr_ms": t.iqr_ms, "meaningful": t.meaningful}
                    except Exception as e:
                        row |= {"median_ms": float("nan"), "error": repr(e)[:300]}
                        traceback.print_exc()
                    table.add(row)
                    print(f"  {kernel:24s} T{T:<6d} {name:10s} {row['median_ms']:.3f} ms", flush=True)
            del x, args
    return table


def print_tables(check: Table | None, bench: Table | None) -> None:
    if check is not None and check.rows:
        print(f"\n=== bf16 correctness vs float64 chunk_reference ({check.path}) ===")
        for r in check.rows:
            flag = "PASS" if r["pass"] else "FAIL"
            print(f"{flag} {r['case']:38s} g>={r['gate_min']:<6} o {r['err_o']:.2e} s {r['err_s']:.2e}  {r['config']}")
    if bench is not None and bench.rows:
        print(f"\n=== timing, ms (median; {bench.path}) ===")
        best: dict[tuple[str, int], dict[str, float]] = {}
        for r in bench.rows:
            ms = r.get("median_ms", float("nan"))
            key = (r["kernel"], r["T"])
            tag = r["impl"] if r["impl"] != "dtune" else ("seg" if r.get("SEG_CHUNKS") else "plain")
            cur = best.setdefault(key, {})
            if ms == ms and ms < cur.get(tag, float("inf")):
                cur[tag] = ms
            if r["impl"] == "dtune":
                head = f"{r['kernel']:24s} T{r['T']:<6d} BT{r['BT']:<3d} hBV{r['h_BV']:<3d} {r['STATE_LAYOUT']} "
                print(f"{head}{'fused  ' if r['FUSE_OUTPUT'] else 'unfused'} seg {r['SEG_CHUNKS']:<3d} {ms:8.3f}")
        print(f"\n{'kernel':24s}{'T':>7s}{'plain':>9s}{'seg':>9s}{'fla':>9s}{'fla_fast':>9s}{'x fla':>8s}")
        for (kernel, T), b in best.items():
            ours = min(b.get("plain", float("inf")), b.get("seg", float("inf")))
            fla = min(b.get("fla", float("inf")), b.get("fla_fast", float("inf")))
            ratio = fla / ours if ours < float("inf") and fla < float("inf") else float("nan")
            cells = [b.get(k, float("nan")) for k in ("plain", "seg", "fla", "fla_fast")]
            print(f"{kernel:24s}{T:>7d}" + "".join(f"{c:9.3f}" for c in cells) + f"{ratio:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole run (rows are skipped past it)")
    ap.add_argument("--check-s", type=float, default=200.0, help="of which the correctness part")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--kernels", default=",".join(KERNEL_NAMES))
    ap.add_argument("--seq-lens", default="32768,65536")
    ap.add_argument("--segs", default="0,8,16,32,64")
    ap.add_argument("--interpret", action="store_true", help="run on the CPU under Triton's interpreter, tiny shapes")
    a = ap.parse_args()
    a.kernels = [k for k in a.kernels.split(",") if k]
    a.seq_lens = [int(t) for t in a.seq_lens.split(",")] if not a.interpret else [70]
    a.segs = [int(s) for s in a.segs.split(",")] if not a.interpret else [0, 2]
    dev = "cpu" if a.interpret else "cuda"
    dtype = torch.float32 if a.interpret else torch.bfloat16  # the interpreter's bf16 dots are wrong
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget_s)
    check = None if a.no_check else run_check(a, dev, dtype, Budget(min(a.check_s, a.budget_s)), out)
    bench = None if a.no_bench else run_bench(a, dev, dtype, budget, out)
    print_tables(check, bench)


if __name__ == "__main__":
    main()
