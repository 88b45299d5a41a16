"""Where the chunk ops' training step stands against fla: every gradient's error against float64 autograd (dtune's
and fla's), and dtune's CUDA time per Triton kernel against the floors of its stages.

Usage (one CUDA GPU, from the checkout's root; about 5 minutes):
    python benchmarks/training_step.py [--budget-s 540] [--gates none,scalar,channel] [--dim 128] [--varlen]
    python benchmarks/training_step.py --interpret      (CPU, Triton's interpreter, tiny shapes: a dry run)

The step is what a training loop pays per call: the op's forward under autograd (inputs that require grad, initial
and final state), then ``torch.autograd.grad`` of the output and the final state from fixed random gradients
(:mod:`dtune.measure.grad`); its time against fla's is the benchmark of record's ``training`` step
(``benchmarks/record.py``, ``dtune bench --mode fwd+bwd``). Shape: bf16, T = 4096, H = 16, K = V = --dim; B = 8
(B·T = 32768) for the stages, B = 2 for the errors (the float64 reference's graph). The backward config is the
store's (the shipped configs, or ``DTUNE_CONFIG``; ``--tuned FILE`` for another), the forward's too. Steps, each
writing under $OUT (default ./out) before the next starts:

0. warm-up (child processes, in parallel with the float64 references of step 1): dtune's training step, its plain
   forward and the search gate's packed edge case are compiled without launching, one process per kernel, and fla's
   steps run once (its compiles and autotuning): Triton's on-disk cache then serves the later steps.
1. errors -> training_errors.csv: the output and every gradient (q, k, v, g, beta, initial state) of dtune's step and
   of fla's (fla.ops.*.chunk_* with inputs that require grad; KDA also in its safe_gate mode) against float64
   autograd through the chunked reference, on inputs with strong decays (log gates down to -5); with --varlen dtune
   also on a packed batch with an empty sequence and grouped value heads (HV = 2H). A contestant that fails (fla's
   chunk_gated_delta_rule backward on triton 3.6) gets a row with its error's first line.
2. stages -> training_stages.csv: CUDA time per Triton kernel of dtune's step (torch.profiler) against the floors of
   dtune.measure.work.backward_stages (bytes at the measured copy bandwidth, FLOPs at the bf16 matmul rate).

--skip STEP[,STEP] leaves steps out (warm, errors, stages). The errors step stops while RESERVE_S are left for the
stages. The tables are printed last (and kept in training_summary.txt).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not
if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from dtune.kernels import get_kernel  # noqa: E402

from dtune.measure.baselines import KDA_LOWER_BOUND, fla_forward, fla_function  # noqa: E402
from dtune.measure.error import rel_rms_error  # noqa: E402
from dtune.measure.grad import StepResult, op_step, reference_step, step_call, with_output_grads  # noqa: E402
from dtune.measure.inputs import make_inputs  # noqa: E402
from dtune.shape import Gate, Shape  # noqa: E402

OPS = {Gate.NONE: "chunk_delta_rule", Gate.SCALAR: "chunk_gated_delta_rule", Gate.CHANNEL: "chunk_kda"}
GRADS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
RESERVE_S = 60.0  # kept for the stages after the errors step


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_csv(name: str, rows: list[dict[str, Any]]) -> None:
    """All rows so far (rewritten after each measurement: a run cut short keeps what it measured)."""
    if not rows:
        return
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with (out_dir() / name).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def shape(gate: Gate, dim: int, interpret: bool, batch: int = 8) -> Shape:
    """The benchmark's shape (B·T = 32768 at B = 8); the errors step runs B = 2 (the float64 reference's graph)."""
    if interpret:
        return Shape(2, 40, 2, 2, 16, 16, 2, gate)
    return Shape(batch, 4096, 16, 16, dim, dim, batch, gate)


def step_inputs(p: Shape, dtype: torch.dtype, device: str, seq: list[int] | None = None) -> dict[str, Any]:
    x = make_inputs(p, dtype=dtype, device=device, seed=1, seq_lens=seq, gate_min=-5.0)
    return with_output_grads({**x, "scale": p.K**-0.5, "output_final_state": True}, seed=2)


def fla_steps(gate: Gate, x: dict[str, Any]) -> tuple[list[tuple[str, Callable[[], StepResult]]], str]:
    """fla's training steps on ``x`` (KDA: also safe_gate), or ``([], why not)``."""
    fn, why = fla_function(OPS[gate])
    if fn is None:
        return [], why
    gated = gate is not Gate.NONE
    steps = [("fla", step_call(fla_forward(fn, gated), x))]
    if gate is Gate.CHANNEL:
        xf = {**x, "g": x["g"].clamp(min=KDA_LOWER_BOUND)}
        steps.append(
            ("fla safe_gate", step_call(fla_forward(fn, gated, safe_gate=True, lower_bound=KDA_LOWER_BOUND), xf))
        )
    return steps, ""


# ---- 0. warm-up: compile in parallel ---------------------------------------------------------------------------------


def warm(what: str, dim: int, interpret: bool) -> None:
    """(Child process.) ``dtune:GATE``: build, without launching, every kernel of dtune's training step with the
    default backward config at the benchmark shape, its plain forward and the search gate's packed edge case (Triton's
    on-disk cache keeps them for the main process); ``fla``: run fla's steps once per gate (its
    compiles and autotuning land in the same cache)."""
    from dtune.ops import run_kernel
    from dtune.tune.gate import edge_inputs
    from dtune.tune.trials import compile_without_launch

    t0 = time.monotonic()
    dev, dtype = ("cpu", torch.float32) if interpret else ("cuda", torch.bfloat16)
    if what.startswith("fla:"):
        for gate in [Gate(v) for v in what.split(":")[1].split(",")]:
            x = step_inputs(shape(gate, dim, interpret), dtype, dev)
            steps, why = fla_steps(gate, x)
            for name, step in steps:
                try:
                    step()
                    torch.cuda.synchronize()
                except Exception as exc:  # reported again, with its row, by the errors step
                    print(f"warm {name} {OPS[gate]}: {first_line(exc)}", flush=True)
            print(f"warm fla {OPS[gate]}: {time.monotonic() - t0:.0f} s {why}", flush=True)
        return
    gate = Gate(what.split(":")[1])
    op = OPS[gate]
    p = shape(gate, dim, interpret)
    x = step_inputs(p, dtype, dev)
    edge = with_output_grads({**edge_inputs(get_kernel(op), p, dtype, dev, 0), "output_final_state": True})
    with compile_without_launch():
        op_step(op, x, None)()
        op_step(op, edge, None)()
        with torch.no_grad():
            run_kernel(
                op, **{n: x[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state")}, output_final_state=True
            )
    print(f"warm dtune {op}: {time.monotonic() - t0:.0f} s", flush=True)


def start_warm(gates: list[Gate], dim: int, interpret: bool) -> list[subprocess.Popen[bytes]]:
    kinds = [f"dtune:{g.value}" for g in gates] + ["fla:" + ",".join(g.value for g in gates)]
    extra = ["--interpret"] if interpret else []
    cmd = [sys.executable, __file__, "--dim", str(dim), *extra, "--warm"]
    return [subprocess.Popen([*cmd, w], cwd=ROOT) for w in kinds]


def wait_warm(procs: list[subprocess.Popen[bytes]], seconds: float) -> None:
    end = time.monotonic() + max(0.0, seconds)
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"warm-up {proc.args[-1]} still running: stopped (its compiles so far stay cached)", flush=True)
            proc.kill()
            proc.wait()


# ---- 1. errors -------------------------------------------------------------------------------------------------------


def _errors_of(got: StepResult, ref: StepResult, x: dict[str, Any]) -> dict[str, str]:
    row = {"err_o": f"{rel_rms_error(got.o, ref.o):.3e}"}
    for name, label in GRADS.items():
        a, b = got.grads.get(name), ref.grads.get(name)
        row[f"err_{label}"] = f"{rel_rms_error(a, b):.3e}" if a is not None and b is not None else ""
    return row


def errors(
    gates: list[Gate],
    dim: int,
    interpret: bool,
    budget: Budget,
    rows: list[dict[str, Any]],
    varlen: bool,
    warming: list[subprocess.Popen[bytes]],
) -> None:
    """References first (while the warm-up compiles), then dtune's and fla's steps against them."""
    dev = "cpu" if interpret else "cuda"
    dtype = torch.float32 if interpret else torch.bfloat16  # bf16 dots are garbage under the interpreter
    cases: list[tuple[Gate, str, Shape, list[int] | None]] = []
    for gate in gates:
        cases.append((gate, "dense B=2", shape(gate, dim, interpret, batch=2), None))
        if varlen or interpret:
            lens = [1, 23, 0, 17] if interpret else [1, 700, 0, 2048, 129]
            h, hv, d = (2, 4, 16) if interpret else (4, 8, dim)
            cases.append((gate, "varlen HV=2H", Shape(1, 0, h, hv, d, d, len(lens), gate, True), lens))
    refs: list[tuple[dict[str, Any], StepResult | None, float]] = []
    for gate, case, p, seq in cases:
        x = step_inputs(p, dtype, dev, seq)
        t0 = time.monotonic()
        try:
            ref: StepResult | None = reference_step(x)
        except Exception as exc:
            print(f"reference {OPS[gate]} {case}: {first_line(exc)}", flush=True)
            ref = None
        refs.append((x, ref, time.monotonic() - t0))
        print(f"reference {OPS[gate]} {case} (float64 autograd): {refs[-1][2]:.1f} s", flush=True)
    wait_warm(warming, budget.left() - RESERVE_S)
    for (gate, case, p, _), (x, ref, ref_s) in zip(cases, refs):
        op = OPS[gate]
        if budget.left() < RESERVE_S:
            rows.append({"op": op, "case": case, "impl": "dtune", "note": "skipped: budget"})
            continue
        if ref is None:
            rows.append({"op": op, "case": case, "impl": "reference", "note": "failed"})
            continue
        impls: list[tuple[str, Callable[[], StepResult]]] = [("dtune", op_step(op, x, None))]
        if case.startswith("dense") and not interpret:
            steps, why = fla_steps(gate, x)
            impls += steps
            if why:
                rows.append({"op": op, "case": case, "impl": "fla", "note": why})
        for impl, step in impls:
            row: dict[str, Any] = {"op": op, "case": case, "D": p.K, "impl": impl, "ref_s": f"{ref_s:.1f}"}
            t0 = time.monotonic()
            try:
                row |= _errors_of(step(), ref, x)
                row["note"] = ""
            except Exception as exc:  # e.g. fla's backward refusing to compile: reported, not skipped
                row["note"] = first_line(exc)
                traceback.print_exc()
            row["first_s"] = f"{time.monotonic() - t0:.1f}"
            rows.append(row)
            write_csv("training_errors.csv", rows)
            print(f"errors {op} {case} {impl}: {row['first_s']} s", flush=True)
    refs.clear()
    if not interpret:
        torch.cuda.empty_cache()


# ---- 2. stages -------------------------------------------------------------------------------------------------------


def stages(gates: list[Gate], dim: int, budget: Budget, tuned: Path | None, rows: list[dict[str, Any]]) -> None:
    from torch.profiler import ProfilerActivity, profile

    from dtune.measure.configs import ConfigSource
    from dtune.measure.timing import ceilings
    from dtune.measure.work import Roofs, backward_stages
    from dtune.store import tuned_config

    roofs = Roofs.from_ceilings(ceilings(torch.device("cuda")))
    source = ConfigSource.load(tuned)  # None: the store (the shipped configs, or DTUNE_CONFIG)
    for gate in gates:
        if budget.left() < 15:
            print(f"budget: skipping the stages of {OPS[gate]}", flush=True)
            continue
        op = OPS[gate]
        p = shape(gate, dim, False)
        x = make_inputs(p, dtype=torch.bfloat16, device="cuda", seed=3, gate_min=-5.0)
        x = with_output_grads({**x, "scale": p.K**-0.5, "output_final_state": True})
        bwd_cfg, where = source.resolve(op + "_bwd", p, torch.bfloat16, torch.device("cuda"))
        bwd = get_kernel(op + "_bwd").check_config(p.K, p.V, bwd_cfg)
        fwd = get_kernel(op).check_config(p.K, p.V, tuned_config(op, p, torch.bfloat16, torch.device("cuda")))
        floors: dict[str, list[Any]] = {}
        for st in backward_stages(p, torch.bfloat16, fwd, bwd):
            floors.setdefault(st.kernel, []).append(st)
        step = op_step(op, x, bwd)
        try:
            step()
            torch.cuda.synchronize()
            calls = 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    step()
                torch.cuda.synchronize()
        except Exception as exc:
            rows.append({"op": op, "kernel": "(step)", "note": first_line(exc)})
            continue
        total = floor_total = 0.0
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if ev.device_time_total <= 0:
                continue
            ms = ev.device_time_total / 1e3 / calls
            total += ms
            mine = floors.get(ev.key, [])
            floor = sum(roofs.floor_ms(s.work) for s in mine) if mine else math.nan
            floor_total += 0.0 if math.isnan(floor) else floor
            rows.append({
                "op": op, "D": p.K, "kernel": ev.key[:40], "launches": ev.count // calls, "ms": f"{ms:.3f}",
                "floor_ms": f"{floor:.3f}", "x_floor": f"{ms / floor:.1f}" if floor > 0 else "",
                "stages": "; ".join(s.name for s in mine), "config": where,
            })  # fmt: skip
        x_total = f"{total / floor_total:.1f}" if floor_total else ""
        rows.append({
            "op": op, "D": p.K, "kernel": "(all kernels)", "ms": f"{total:.3f}", "floor_ms": f"{floor_total:.3f}",
            "x_floor": x_total,
        })  # fmt: skip
        write_csv("training_stages.csv", rows)
        del x
        torch.cuda.empty_cache()


# ---- tables ----------------------------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    if not rows:
        return "(no rows)"

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.4g}"
        return str(v if v is not None else "")

    width = {c: min(70, max(len(c), *(len(cell(r.get(c))) for r in rows))) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(cell(r.get(c))[: width[c]].ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=540.0, help="all steps together")
    ap.add_argument("--gates", default="none,scalar,channel", help="none (DeltaNet), scalar (GDN), channel (KDA)")
    ap.add_argument("--dim", type=int, default=128, help="head dim K = V")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out: warm, errors, stages")
    ap.add_argument("--tuned", type=Path, default=None, help="backward configs for the stages (default: the store's)")
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, tiny shapes (a dry run)")
    ap.add_argument("--varlen", action="store_true", help="errors also on a packed varlen batch (HV = 2H)")
    ap.add_argument("--warm", help=argparse.SUPPRESS)  # child process: compile ahead (see warm())
    a = ap.parse_args()
    if a.warm:
        warm(a.warm, a.dim, a.interpret)
        return
    if not a.interpret and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --interpret for a dry run on the CPU)")
    budget = Budget(a.budget_s)
    gates = [Gate(s) for s in a.gates.split(",")]
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    print(f"torch {torch.__version__}, OUT={out_dir()}, budget {a.budget_s:.0f} s", flush=True)
    err: list[dict[str, Any]] = []
    stg: list[dict[str, Any]] = []
    warming = [] if "warm" in skip else start_warm(gates, a.dim, a.interpret)
    try:
        if "errors" not in skip:
            errors(gates, a.dim, a.interpret, budget, err, a.varlen, warming)
        wait_warm(warming, budget.left() - RESERVE_S)
        if "stages" not in skip and not a.interpret:
            stages(gates, a.dim, budget, a.tuned, stg)
    finally:
        wait_warm(warming, 0)
        grads = [f"err_{label}" for label in GRADS.values()]
        text = "\n".join([
            "== gradient errors, relative RMS vs float64 autograd (bf16 inputs, gates down to -5) ==",
            table(err, ["op", "case", "impl", "err_o", *grads, "ref_s", "first_s", "note"]),
            "\n== dtune's step per Triton kernel (CUDA ms per step) vs the stage floors of dtune.measure.work ==",
            table(stg, ["op", "kernel", "launches", "ms", "floor_ms", "x_floor", "stages"]),
        ])  # fmt: skip
        (out_dir() / "training_summary.txt").write_text(text + "\n")
        print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
