"""GPU sitting for the chunk backward: bf16 gradient errors, forward + backward time and peak memory, dtune vs fla.

Usage (one CUDA GPU):  python scripts/gpu_bwd.py [--budget-s 540] [--gates none,scalar,channel] [--dims 128,64]
                       python scripts/gpu_bwd.py --interpret        (CPU, Triton's interpreter, tiny shapes: a dry run)

1. Errors (not a test): bf16 inputs with strong decays (log gates down to −5), a random output and final-state
   gradient; every gradient (q, k, v, g, beta, initial state) of dtune (default backward config, and SAVE = "all")
   and of fla (when it imports) against float64 autograd through the chunked reference; at the benchmark shape
   (B·T = 32768, H = 16, D = 128) and on a packed varlen batch with grouped value heads (HV = 2H). fla refusing to run
   (its chunk_gated_delta_rule backward on triton 3.6 / Hopper) is caught and reported. -> $OUT/bwd_errors.csv
2. Timing: forward + backward (torch.autograd.grad of o and the final state), median ms over CUDA events with the
   L2 flushed (dtune.measure.time_fn), and peak memory (torch.cuda.max_memory_allocated above the inputs) of:
   dtune's forward alone, dtune fwd+bwd for SAVE = "intra" (default), "all", "none" and BT = 32, fla fwd+bwd (and
   for KDA fla's safe_gate mode), at B·T = 32768, H = 16, T = 4096, D in --dims. -> $OUT/bwd_timing.csv
3. Stage breakdown of dtune's default fwd+bwd (torch.profiler, CUDA time per kernel, mean per call); with --sweep
   for a list of backward variants (SWEEP: state-pass tiles and stages, dq/dk tiles, BT = 32), at the first of
   --dims. -> $OUT/bwd_stages.csv (--skip-errors / --skip-timing / --skip-stages leave a part out)

Rows are written after each measurement, so a sitting cut short keeps what it measured; the tables print last.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from dtune.kernels.reference import chunk_reference

from dtune import ops
from dtune.measure.inputs import make_inputs
from dtune.measure.timing import time_fn
from dtune.shape import Gate, Shape

Tensor = torch.Tensor
OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
FLA = {
    Gate.NONE: ("fla.ops.delta_rule", "chunk_delta_rule"),
    Gate.SCALAR: ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    Gate.CHANNEL: ("fla.ops.kda", "chunk_kda"),
}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("dtune", {}),  # the default backward config (SAVE = "intra")
    ("dtune SAVE=all", {"SAVE": "all"}),
    ("dtune SAVE=none", {"SAVE": "none"}),
    ("dtune BT=32", {"BT": 32}),
]


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def append_row(name: str, row: dict[str, Any]) -> None:
    path = out_dir() / name
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)


def rel(x: Tensor | None, ref: Tensor | None) -> float:
    if x is None or ref is None:
        return float("nan")
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def fla_op(gate: Gate) -> tuple[Callable[..., Any] | None, str]:
    module, name = FLA[gate]
    try:
        import importlib

        return getattr(importlib.import_module(module), name), ""
    except Exception as exc:  # not installed, or broken on this triton
        return None, f"fla not importable ({type(exc).__name__}: {exc})"


def dtune_call(gate: Gate, bwd_config: dict[str, Any] | None) -> Callable[..., tuple[Tensor, Tensor | None]]:
    def call(x: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        return ops.run_kernel(
            OPS[gate], *(x[n] for n in ("q", "k", "v", "g", "beta")), initial_state=x["initial_state"],
            output_final_state=True, cu_seqlens=x["cu_seqlens"], bwd_config=bwd_config,
        )  # fmt: skip

    return call


def fla_call(gate: Gate, fn: Callable[..., Any], **extra: Any) -> Callable[..., tuple[Tensor, Tensor | None]]:
    def call(x: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        g = x["g"]
        if "lower_bound" in extra and g is not None:
            g = g.clamp(min=extra["lower_bound"])
        gates = {"g": g, "beta": x["beta"]} if gate is not Gate.NONE else {"beta": x["beta"]}
        cu = x["cu_seqlens"]
        return fn(
            x["q"], x["k"], x["v"], **gates, initial_state=x["initial_state"], output_final_state=True,
            cu_seqlens=None if cu is None else cu.long(), **extra,
        )  # fmt: skip

    return call


def leaves(x: dict[str, Any], dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Copies of the inputs that require grad (``dtype``: cast first, e.g. float64 for the reference)."""
    out = dict(x)
    for n in NAMES:
        if x[n] is not None:
            t = x[n].detach().clone() if dtype is None else x[n].detach().to(dtype)
            out[n] = t.requires_grad_()
    return out


def gradients(call: Callable[..., Any], x: dict[str, Any], do: Tensor, dht: Tensor) -> dict[str, Tensor | None]:
    xs = leaves(x)
    o, s = call(xs)
    inputs = [xs[n] for n in NAMES if xs[n] is not None]
    grads = torch.autograd.grad((o, s), inputs, (do.to(o.dtype), dht.to(s.dtype)), allow_unused=True)
    found = dict(zip([n for n in NAMES if xs[n] is not None], grads))
    found["o"] = o.detach()
    return found


def errors(gates: list[Gate], dim: int, interpret: bool, budget: Budget) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    dev = "cpu" if interpret else "cuda"
    dtype = torch.float32 if interpret else torch.bfloat16  # bf16 dots are garbage under the interpreter
    for gate in gates:
        cases = (
            (
                "dense",
                Shape(2, 40, 2, 2, 16, 16, 2, gate) if interpret else Shape(8, 4096, 16, 16, dim, dim, 8, gate),
                None,
            ),
            ("varlen-HV2H", Shape(1, 0, 2, 4, 16, 16, 4, gate, True), [1, 23, 0, 17])
            if interpret
            else ("varlen-HV2H", Shape(1, 0, 4, 8, dim, dim, 5, gate, True), [1, 700, 0, 2048, 129]),
        )
        for case, p, lens in cases:
            if budget.left() < 60:
                print(f"budget: skipping errors {OPS[gate]} {case}")
                continue
            x = make_inputs(p, dtype=dtype, device=dev, seed=1, seq_lens=lens, gate_min=-5.0)
            gen = torch.Generator(device="cpu").manual_seed(2)
            B, T = x["v"].shape[:2]
            N = x["initial_state"].shape[0]
            do = torch.randn(B, T, p.HV, p.V, generator=gen).to(dev)
            dht = torch.randn(N, p.HV, p.K, p.V, generator=gen).to(dev)
            t0 = time.monotonic()

            def reference(xs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
                return chunk_reference(
                    *(xs[n] for n in ("q", "k", "v", "g", "beta")), initial_state=xs["initial_state"],
                    output_final_state=True, cu_seqlens=xs["cu_seqlens"], chunk_size=32,
                )  # fmt: skip

            ref = gradients(reference, leaves(x, torch.float64), do.double(), dht.double())
            impls: list[tuple[str, Callable[..., Any]]] = [
                ("dtune", dtune_call(gate, None)),
                ("dtune SAVE=all", dtune_call(gate, {"SAVE": "all"})),
            ]
            fn, why = fla_op(gate)
            if fn is not None and not interpret:
                impls.append(("fla", fla_call(gate, fn)))
            for impl, call in impls:
                row: dict[str, Any] = {"op": OPS[gate], "case": case, "D": p.K, "impl": impl}
                try:
                    got = gradients(call, x, do, dht)
                    row.update({f"err_{n}": f"{rel(got.get(n), ref.get(n)):.3e}" for n in ("o", *NAMES)})
                    row["note"] = ""
                except Exception as exc:
                    row.update({f"err_{n}": "" for n in ("o", *NAMES)})
                    row["note"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    traceback.print_exc()
                append_row("bwd_errors.csv", row)
                rows.append(row)
            if fn is None:
                rows.append({"op": OPS[gate], "case": case, "D": p.K, "impl": "fla", "note": why})
                append_row("bwd_errors.csv", rows[-1] | {f"err_{n}": "" for n in ("o", *NAMES)})
            del ref
            print(f"errors {OPS[gate]} {case}: {time.monotonic() - t0:.1f}s", flush=True)
            if not interpret:
                torch.cuda.empty_cache()
    return rows


def fwd_bwd(call: Callable[..., Any], x: dict[str, Any], do: Tensor, dht: Tensor) -> Callable[[], Any]:
    xs = leaves(x)
    inputs = [xs[n] for n in NAMES if xs[n] is not None]

    def step() -> Any:
        o, s = call(xs)
        return torch.autograd.grad((o, s), inputs, (do, dht))

    return step


def peak_mb(fn: Callable[[], Any], device: str) -> float:
    if device != "cuda":
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def timing(gates: list[Gate], dims: list[int], interpret: bool, budget: Budget) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    dev = "cpu" if interpret else "cuda"
    dtype = torch.float32 if interpret else torch.bfloat16
    for dim in dims:
        for gate in gates:
            p = Shape(2, 40, 2, 2, 16, 16, 2, gate) if interpret else Shape(8, 4096, 16, 16, dim, dim, 8, gate)
            x = make_inputs(p, dtype=dtype, device=dev, seed=3, gate_min=-5.0)
            do = torch.randn_like(x["v"])
            dht = torch.randn_like(x["initial_state"])
            impls: list[tuple[str, Callable[[], Any]]] = []

            def fwd_only(xx: dict[str, Any] = x, call: Callable[..., Any] = dtune_call(gate, None)) -> Any:
                with torch.no_grad():
                    return call(xx)

            impls.append(("dtune fwd only", fwd_only))
            impls += [(name, fwd_bwd(dtune_call(gate, cfg), x, do, dht)) for name, cfg in VARIANTS]
            fn, why = fla_op(gate)
            if fn is not None and not interpret:
                impls.append(("fla", fwd_bwd(fla_call(gate, fn), x, do, dht)))
                if gate is Gate.CHANNEL:
                    fast = fla_call(gate, fn, safe_gate=True, lower_bound=-5.0)
                    impls.append(("fla safe_gate", fwd_bwd(fast, x, do, dht)))
            elif fn is None:
                print(f"fla: {why}")
            for name, step in impls:
                if budget.left() < 30:
                    print(f"budget: skipping {OPS[gate]} D={dim} {name}")
                    continue
                row: dict[str, Any] = {"op": OPS[gate], "D": p.K, "T": p.T, "B": p.B, "impl": name}
                try:
                    t0 = time.monotonic()
                    step()  # compile (and fla's autotune) outside the timing
                    first = time.monotonic() - t0
                    mb = peak_mb(step, dev)
                    t = time_fn(step, device=dev, warmup=3, repeats=30, max_seconds=min(8.0, budget.left() / 4))
                    row.update(median_ms=f"{t.median_ms:.3f}", peak_mb=f"{mb:.0f}", first_s=f"{first:.1f}", note="")
                except Exception as exc:
                    row.update(median_ms="", peak_mb="", first_s="", note=f"{type(exc).__name__}: {str(exc)[:300]}")
                    traceback.print_exc()
                append_row("bwd_timing.csv", row)
                rows.append(row)
                print(row, flush=True)
            if not interpret:
                torch.cuda.empty_cache()
    return rows


# --sweep: backward variants on top of the default, each profiled per kernel (the stage that moves shows)
SWEEP: list[dict[str, Any]] = [
    {},
    {"dh_num_stages": 1},  # the reverse state pass: more programs resident per SM (smem, registers)
    {"dh_BV": 16},
    {"dh_BV": 64, "dh_num_warps": 8},
    {"dh_BV": 128, "dh_num_warps": 8},  # one program per sequence and head: B·HV = 128 programs, one round
    {"dqk_BK": 32, "dqk_num_warps": 4},
    {"dqk_BV": 32},
    {"dv_BV": 32, "dv_num_warps": 8},
    {"BT": 32, "dh_num_stages": 2},
]


def stages(
    gates: list[Gate], dim: int, interpret: bool, budget: Budget, variants: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """CUDA time per kernel of dtune's forward + backward (mean over the profiled calls), per backward variant."""
    rows: list[dict[str, Any]] = []
    if interpret:
        return rows
    from torch.profiler import ProfilerActivity, profile

    for gate in gates:
        p = Shape(8, 4096, 16, 16, dim, dim, 8, gate)
        x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=3, gate_min=-5.0)
        do, dht = torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])
        for variant in variants:
            if budget.left() < 30:
                print(f"budget: skipping stages {OPS[gate]} {variant}")
                continue
            name = ",".join(f"{k}={v}" for k, v in variant.items()) or "default"
            try:
                step = fwd_bwd(dtune_call(gate, variant or None), x, do, dht)
                step()
                torch.cuda.synchronize()
                calls = 5
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(calls):
                        step()
                    torch.cuda.synchronize()
            except Exception as exc:
                print(f"stages {OPS[gate]} {name}: {type(exc).__name__}: {exc}")
                continue
            total = 0.0
            for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
                if ev.device_time_total <= 0:
                    continue
                total += ev.device_time_total / 1e3 / calls
                row = {
                    "op": OPS[gate],
                    "D": dim,
                    "variant": name,
                    "kernel": ev.key[:48],
                    "ms_per_call": f"{ev.device_time_total / 1e3 / calls:.3f}",
                    "launches_per_call": ev.count // calls,
                }
                append_row("bwd_stages.csv", row)
                rows.append(row)
            rows.append(
                {
                    "op": OPS[gate],
                    "D": dim,
                    "variant": name,
                    "kernel": "(sum of kernels)",
                    "ms_per_call": f"{total:.3f}",
                }
            )
            append_row("bwd_stages.csv", rows[-1] | {"launches_per_call": ""})
    return rows


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    if not rows:
        return "(no rows)"
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--gates", default="none,scalar,channel")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--skip-errors", action="store_true")
    ap.add_argument("--skip-stages", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="profile a list of backward variants per kernel (SWEEP)")
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, tiny shapes (a dry run)")
    a = ap.parse_args()
    if not a.interpret and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --interpret for a dry run on the CPU)")
    budget = Budget(a.budget_s)
    gates = [Gate(s) for s in a.gates.split(",")]
    dims = [int(d) for d in a.dims.split(",")][: 1 if a.interpret else None]  # the dry run: one (tiny) shape
    print(f"torch {torch.__version__}, OUT={out_dir()}", flush=True)
    err = [] if a.skip_errors else errors(gates, dims[0], a.interpret, budget)
    tim = [] if a.skip_timing else timing(gates, dims, a.interpret, budget)
    stg = [] if a.skip_stages else stages(gates, dims[0], a.interpret, budget, SWEEP if a.sweep else [{}])
    print("\n== gradient errors (relative RMS vs float64 autograd) ==")
    print(table(err, ["op", "case", "D", "impl", "err_o", *[f"err_{n}" for n in NAMES], "note"]))
    print("\n== forward + backward ==")
    print(table(tim, ["op", "D", "impl", "median_ms", "peak_mb", "first_s", "note"]))
    if stg:
        print("\n== kernels of dtune's fwd+bwd (CUDA ms per call) ==")
        print(table(stg, ["op", "D", "variant", "kernel", "ms_per_call", "launches_per_call"]))


if __name__ == "__main__":
    main()
