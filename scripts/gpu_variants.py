"""GPU sitting for the prefill variants of issue 14 (commits after 014c986): each new template parameter timed alone
and in combination against the H200's measured best of 2026-11-30 and fla, side by side, with per-stage times and
bf16 errors against the float64 reference.

Usage (one CUDA GPU):  python scripts/gpu_variants.py --shape B1 [--budget-s 230] [--kernels chunk_kda,...] [--no-fla]
                       python scripts/gpu_variants.py --shape B8
                       python scripts/gpu_variants.py --interpret      (the whole script on the CPU, tiny shapes)

Shapes (bf16, H = 16, K = V = 128, no initial state, final state on: the 2026-11-30 seqpar workload):
``B1`` = B 1, T 32768 (base: SEG_CHUNKS 64, vk, h_BV 64, phase 2 "tiles" = the measured best);
``B8`` = B 8, T 4096 (base: vk, h_BV 64). Rows in priority order per kernel: the base, everything together ("all"),
fla (chunk_kda also fla's fastest mode, safe_gate with lower_bound -5), then one factor at a time; rows past the
budget are skipped. Each dtune row: median of CUDA events with the L2 flushed (dtune.measure.time_fn), per-stage
medians from plan(), and the bf16 relative RMS error of the output and the final state against the float64 chunked
reference at a smaller shape with the same kernels (B 1 T 8192 for B1, B 2 T 4096 for B8, H 16: same compiled
kernels), under strong gates (log decay down to -5) and mild ones (down to -0.05, where the segments' transitions
and far blocks matter), beside the base config's errors.

Compile-ahead (--compile-ahead, default 6 processes): every config is run once at a small shape in worker processes
as the main loop starts, so that Triton's on-disk cache holds most kernels by the time the main loop reaches them.

Results go to $OUT (default ./out): variants.csv, written after every row. The table is printed last; fla columns
not measured (budget, no fla) fall back to the 2026-11-30 figures, marked with *.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import torch
from dtune.kernels import KERNELS
from dtune.kernels import chunk as chunk_mod
from dtune.kernels.reference import chunk_reference
from gpu_seqpar import Budget, Table, _fla_call, rel

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.measure.timing import time_fn
from dtune.shape import Gate, Shape

KERNEL_NAMES = ("chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule")
BASE = {
    "B1": {"SEG_CHUNKS": 64, "STATE_LAYOUT": "vk", "h_BV": 64, "SEG_COMBINE": "tiles"},
    "B8": {"STATE_LAYOUT": "vk", "h_BV": 64},
}
# H200 2026-11-30 (reports/h200/sitting-2026-11-30a/seqpar_bench.csv; /work/shared/data/h200-2026-11-30/README.md),
# ms: the fallback when fla is not timed here
FLA_REF = {
    ("B1", "chunk_delta_rule"): (1.560, None),
    ("B1", "chunk_gated_delta_rule"): (1.248, None),
    ("B1", "chunk_kda"): (2.321, 2.117),
    ("B8", "chunk_delta_rule"): (1.004, None),
    ("B8", "chunk_gated_delta_rule"): (0.841, None),
    ("B8", "chunk_kda"): (1.800, 1.607),
}
SEGMENTED = ("B1",)


def variants(kernel: str, kind: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, overrides on BASE[kind]) in priority order; "fla" marks where fla is timed."""
    kda = kernel == "chunk_kda"
    seg = kind in SEGMENTED
    intra = {"INTRA": "onepass", "SOLVE": "squaring", "DIAG_BF16": True} if kda else {"SOLVE": "squaring"}
    qk = {} if kda else {"QK_DIRECT": True}
    regs = {"SEG_COMBINE": "regs"} if seg else {}
    out: list[tuple[str, dict[str, Any]]] = [("base", {}), ("all", {**regs, **intra, **qk}), ("fla", {})]
    if seg:
        out += [
            ("regs", regs),
            ("all+tr128", {**regs, **intra, **qk, "tr_BV": 128, "tr_num_warps": 8}),
            ("all+seg32", {**regs, **intra, **qk, "SEG_CHUNKS": 32}),
            ("all+seg128", {**regs, **intra, **qk, "SEG_CHUNKS": 128}),
            ("all+hbv128", {**regs, **intra, **qk, "h_BV": 128, "h_num_warps": 8}),
            ("regs+bv16", {**regs, "seg_BV": 16}),
            ("regs+bv64", {**regs, "seg_BV": 64}),
        ]
    out += [("squaring", {"SOLVE": "squaring"})]
    if kda:
        out += [
            ("onepass", {"INTRA": "onepass"}),
            ("onepass+sq", {"INTRA": "onepass", "SOLVE": "squaring"}),
            ("onepass+sq+bf16+w4", {**intra, "intra_num_warps": 4}),
            ("onepass+sq+bf16+bk32", {**intra, "intra_BK": 32}),
        ]
    else:
        out += [("qk", qk)]
    if not seg:
        out += [("all+hbv128", {**intra, **qk, "h_BV": 128, "h_num_warps": 8})]
    return out


def shapes(kind: str, interpret: bool, gate: Gate) -> tuple[Shape, Shape]:
    """(timed shape, correctness-check shape)."""
    if interpret:
        return Shape(1 if kind == "B1" else 2, 70, 1, 1, 32, 32, gate=gate), Shape(1, 45, 1, 1, 32, 32, gate=gate)
    if kind == "B1":
        return Shape(1, 32768, 16, 16, 128, 128, gate=gate), Shape(1, 8192, 16, 16, 128, 128, gate=gate)
    return Shape(8, 4096, 16, 16, 128, 128, gate=gate), Shape(2, 4096, 16, 16, 128, 128, gate=gate)


def for_interpret(cfg: dict[str, Any]) -> dict[str, Any]:
    """Tiny shapes: chunks of 16 and segments of one chunk, so that every phase runs."""
    out = {**cfg, "BT": 16, "BC": 16}
    if out.get("SEG_CHUNKS"):
        out["SEG_CHUNKS"] = 1
    return out


class References:
    """The float64 chunked reference of the check inputs, once per kernel and gate regime."""

    def __init__(self, dev: str, dtype: torch.dtype) -> None:
        self.dev, self.dtype = dev, dtype
        self.cache: dict[tuple[str, float], tuple[dict[str, Any], Any, Any]] = {}

    def get(self, kernel: str, shape: Shape, gmin: float) -> tuple[dict[str, Any], Any, Any]:
        key = (kernel, gmin)
        if key not in self.cache:
            x = make_inputs(shape, dtype=self.dtype, device=self.dev, seed=11, gate_min=gmin)
            kw = {"initial_state": x["initial_state"], "output_final_state": True}
            o_ref, s_ref = chunk_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
            self.cache[key] = (x, o_ref, s_ref)
        return self.cache[key]


def check(kernel: str, cfg: dict[str, Any], shape: Shape, refs: References) -> dict[str, float]:
    """bf16 errors (output, final state) under strong and mild gates."""
    out: dict[str, float] = {}
    for tag, gmin in (("strong", -5.0), ("mild", -0.05)):
        x, o_ref, s_ref = refs.get(kernel, shape, gmin)
        o, s = ops.run_kernel(
            kernel, x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
            output_final_state=True, config=cfg,
        )  # fmt: skip
        assert s is not None
        out[f"err_o_{tag}"] = rel(o, o_ref)
        out[f"err_s_{tag}"] = rel(s, s_ref)
    return out


def configs(a: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """Every (kernel, config) the run times, in its order."""
    out = []
    for kernel in a.kernels:
        for name, over in variants(kernel, a.shape):
            if name != "fla":
                cfg = {**BASE[a.shape], **over}
                out.append((kernel, for_interpret(cfg) if a.interpret else cfg))
    return out


def compile_part(a: argparse.Namespace, part: int, parts: int) -> None:
    """Compile-ahead worker: every ``parts``-th config from ``part`` on, run once at a small shape with the same
    specialisations as the timed and checked calls (Triton's on-disk cache then serves the main process)."""
    dev, dtype, H, D = ("cpu", torch.float32, 1, 32) if a.interpret else ("cuda", torch.bfloat16, 16, 128)
    for i, (kernel, cfg) in enumerate(configs(a)):
        if i % parts != part:
            continue
        spec = KERNELS[kernel]
        T = max(2, cfg.get("SEG_CHUNKS", 0)) * cfg.get("BT", 32) + 1  # two segments: every phase compiles
        p = Shape(1, T, H, H, D, D, gate=Gate(spec.gate))
        for h0 in (False, True):
            try:
                x = make_inputs(p, dtype=dtype, device=dev, seed=1, initial_state=h0)
                ops.run_kernel(kernel, x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, config=cfg)  # fmt: skip
            except Exception as e:  # the main process reports it
                print(f"compile-ahead {kernel} {cfg}: {e!r}"[:300], flush=True)
    print(f"compile-ahead part {part}/{parts} done", flush=True)


def start_compile_ahead(a: argparse.Namespace, out: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for part in range(a.compile_ahead):
        cmd = [sys.executable, __file__, "--shape", a.shape, "--kernels", ",".join(a.kernels), "--compile-part",
               f"{part}/{a.compile_ahead}"]  # fmt: skip
        log = (out / f"compile_ahead_{part}.log").open("wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    return procs


def run(a: argparse.Namespace, dev: str, dtype: torch.dtype, out: Path) -> Table:
    table = Table(out / "variants.csv")
    budget = Budget(a.budget_s)
    refs = References(dev, dtype)
    kind = a.shape
    for kernel in a.kernels:
        spec = KERNELS[kernel]
        gate = Gate(spec.gate)
        p, p_check = shapes(kind, a.interpret, gate)
        x = make_inputs(p, dtype=dtype, device=dev, seed=3, initial_state=False)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        for name, over in variants(kernel, kind):
            if name == "fla":
                if a.no_fla or dev != "cuda":
                    continue
                for fast in (False, True) if gate is Gate.CHANNEL else (False,):
                    tag = "fla_fast" if fast else "fla"
                    if budget.left() < 75:  # fla autotunes a new shape family on its first call (1-45 s here before)
                        print(f"  SKIP {kernel} {tag} (budget)", flush=True)
                        continue
                    row: dict[str, Any] = {"kernel": kernel, "shape": kind, "variant": tag}
                    try:
                        call = _fla_call(kernel, x, fast)
                        assert call is not None, "fla not importable"
                        t0 = time.monotonic()
                        for _ in range(3):  # autotune, then settled
                            call()
                        torch.cuda.synchronize()
                        row["compile_s"] = round(time.monotonic() - t0, 1)
                        row |= {"median_ms": time_fn(call, dev).median_ms}
                    except Exception as e:
                        row |= {"median_ms": float("nan"), "error": repr(e)[:300]}
                        traceback.print_exc()
                    table.add(row)
                    print(f"  {kernel:24s} {kind} {tag:24s} {row['median_ms']:.3f} ms", flush=True)
                continue
            if budget.left() < 25:
                print(f"  SKIP {kernel} {name} (budget)", flush=True)
                continue
            cfg = {**BASE[kind], **over}
            if a.interpret:
                cfg = for_interpret(cfg)
            row = {
                "kernel": kernel,
                "shape": kind,
                "variant": name,
                "config": " ".join(f"{k}={v}" for k, v in over.items()),
            }
            try:
                full = spec.check_config(p.K, p.V, cfg)
                t0 = time.monotonic()
                ops.run_kernel(kernel, *args, output_final_state=True, config=full)
                if dev == "cuda":
                    torch.cuda.synchronize()
                row["compile_s"] = round(time.monotonic() - t0, 1)
                call = partial(ops.run_kernel, kernel, *args, output_final_state=True, config=full)
                row["median_ms"] = time_fn(call, dev).median_ms
                stages, _ = chunk_mod.plan(*args, spec.gate, p.K**-0.5, None, True, None, full)
                row["stages_ms"] = " ".join(
                    f"{st.name}={time_fn(st.run, dev, warmup=2, repeats=20).median_ms:.3f}" for st in stages
                )
                row |= check(kernel, full, p_check, refs)
            except Exception as e:
                row |= {"median_ms": float("nan"), "error": repr(e)[:300]}
                traceback.print_exc()
            table.add(row)
            errs = " ".join(f"{k[4:]}={row[k]:.1e}" for k in row if k.startswith("err_"))
            print(f"  {kernel:24s} {kind} {name:24s} {row['median_ms']:.3f} ms  {row.get('stages_ms', '')}  {errs}",
                  flush=True)  # fmt: skip
        del x, args
    return table


def print_table(table: Table, kind: str) -> None:
    print(f"\n=== {kind}: ms (median), x fla's fastest, stages, bf16 errors o/s strong|mild ({table.path}) ===")
    fla: dict[str, tuple[float, bool]] = {}
    for r in table.rows:
        if r["variant"] in ("fla", "fla_fast") and r["median_ms"] == r["median_ms"]:
            cur = fla.get(r["kernel"], (float("inf"), False))
            fla[r["kernel"]] = (min(cur[0], r["median_ms"]), True)
    for kernel in KERNEL_NAMES:
        if kernel not in fla and (kind, kernel) in FLA_REF:
            ref = [v for v in FLA_REF[(kind, kernel)] if v is not None]
            fla[kernel] = (min(ref), False)
    for r in table.rows:
        if r["variant"] in ("fla", "fla_fast"):
            print(f"{r['kernel']:24s} {r['variant']:24s} {r['median_ms']:8.3f}")
            continue
        f, measured = fla.get(r["kernel"], (float("nan"), False))
        ms = r.get("median_ms", float("nan"))
        ratio = f / ms if ms == ms and ms > 0 else float("nan")
        errs = "/".join(
            f"{r.get(k, float('nan')):.1e}" for k in ("err_o_strong", "err_s_strong", "err_o_mild", "err_s_mild")
        )
        print(f"{r['kernel']:24s} {r['variant']:24s} {ms:8.3f} {ratio:6.2f}x{'' if measured else '*'}  {errs}  "
              f"{r.get('stages_ms', r.get('error', ''))}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("B1", "B8"), default="B1")
    ap.add_argument("--budget-s", type=float, default=230.0, help="the whole run (rows are skipped past it)")
    ap.add_argument("--kernels", default=",".join(KERNEL_NAMES))
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--compile-ahead", type=int, default=6, help="worker processes compiling the configs ahead")
    ap.add_argument("--compile-part", default="", help=argparse.SUPPRESS)  # a worker's share, "i/n"
    ap.add_argument("--interpret", action="store_true", help="run on the CPU under Triton's interpreter, tiny shapes")
    a = ap.parse_args()
    a.kernels = [k for k in a.kernels.split(",") if k]
    if a.compile_part:
        part, parts = (int(v) for v in a.compile_part.split("/"))
        compile_part(a, part, parts)
        return
    dev = "cpu" if a.interpret else "cuda"
    dtype = torch.float32 if a.interpret else torch.bfloat16  # the interpreter's bf16 dots are wrong
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    procs = start_compile_ahead(a, out) if dev == "cuda" else []
    table = run(a, dev, dtype, out)
    for proc in procs:
        proc.kill()
    print_table(table, a.shape)


if __name__ == "__main__":
    main()
