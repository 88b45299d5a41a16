"""Benchmark: the tuned config against the untuned default, flash-linear-attention and the PyTorch reference.

For every shape of the grid the contestants (:mod:`dtune.measure.baselines`) run on the harness's inputs
(:func:`dtune.measure.harness.op_run`: the default workload, or the one asked for) and are timed side by side,
interleaved (round after round, each implementation in turn, so drifting clocks hit all of them alike), with
:func:`dtune.measure.timing.time_call`; fused-recurrent decode (T = 1) is also timed under CUDA-graph replay
with ``graph`` so the host overhead shows. Each row reports the median ms, the speedup against the default and
against fla's fastest mode, the output's relative RMS error against the float64 chunked reference (so a fast but
wrong contestant shows), the achieved GB/s and TFLOP/s of the nominal work (:mod:`dtune.measure.work`), and what
the first call cost (compile, and autotune for fla: what a user pays at start-up for each new shape family).
Under Triton's interpreter (CPU) everything runs on tiny shapes and the times are marked not meaningful.

Forward + backward (a backward kernel such as ``chunk_kda_bwd``; ``dtune bench -k chunk_kda --mode fwd+bwd``): every
contestant times its training step (:mod:`dtune.measure.grad`: the forward with inputs that require grad, then the
gradients of the output and the final state), mode ``fwd+bwd``; ``error_o`` is the output's error and ``error_grad``
the largest gradient's, against float64 autograd through the chunked reference; the tuned config is the backward's
(the forward's is the store's, else the default, for dtune's tuned and default rows alike). A contestant that fails
(fla's chunk_gated_delta_rule backward refused to run on triton 3.6 on the H200) keeps its row: no time, and its
error's first line in ``note``. ``peak_mb`` (every mode) is the memory a call allocates at its peak above what was
allocated before it (its outputs included; for a step: saved intermediates, gradients).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from dtune.inputs import INTERPRETER_BF16, dtype_name, interpreting
from dtune.kernels import get_kernel
from dtune.measure.baselines import BASELINES, FLA_IMPLS, Impl, build_impls
from dtune.measure.configs import ConfigSource, config_match
from dtune.measure.error import rel_rms_error
from dtune.measure.grad import REFERENCE_MAX_BYTES, StepResult, reference_bytes, reference_step
from dtune.measure.grids import bench_shapes
from dtune.measure.harness import OpRun, op_run
from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload
from dtune.measure.tables import write_table
from dtune.measure.timing import Timing, time_call
from dtune.provenance import git_commit
from dtune.shape import SHAPE_COLUMNS, Gate, ShapeGrid

COLUMNS = [
    "kernel",
    "impl",
    "mode",
    "dtype",
    *SHAPE_COLUMNS,
    "N",  # sequences: B for a fixed-length batch, the number of packed sequences (cu_seqlens, B = 1) otherwise
    "decays",  # the log gates timed: "strong" (the tuning inputs) or "model" (dtune.measure.inputs.make_inputs)
    "median_ms",
    "min_ms",
    "iqr_ms",
    "repeats",
    "first_call_s",
    "error_o",
    "error_grad",
    "peak_mb",
    "meaningful",
    "speedup_vs_default",
    "speedup_vs_fla",
    "gbs",
    "tflops",
    "flops",
    "bytes",
    "config",
    "config_source",
    "config_match",  # the tuned row's config: exact (its own bucket), borrowed (adjusted from others), default, given
    "device",
    "note",
    "commit",
]
INTERPRETER_BF16_DOT = f"{INTERPRETER_BF16}: dtune's chunk ops refuse it here; use --dtype fp16 or fp32 on the CPU"
WRONG = 0.1  # a relative RMS error this large is a wrong output, not rounding

Call = Callable[[], Any]


@dataclass
class BenchResult:
    frame: pd.DataFrame
    notes: list[str]

    def wrong_outputs(self) -> pd.DataFrame:
        """One row per implementation whose output (or a gradient) is off the float64 reference by more than
        :data:`WRONG`."""
        f = self.frame
        return f[(f["error_o"] > WRONG) | (f["error_grad"] > WRONG)].drop_duplicates("impl")


def _combine(timings: list[Timing]) -> Timing:
    """Rounds of one implementation: the median of the rounds' medians."""
    return Timing(
        statistics.median(t.median_ms for t in timings),
        min(t.min_ms for t in timings),
        statistics.median(t.iqr_ms for t in timings),
        sum(t.repeats for t in timings),
        all(t.meaningful for t in timings),
    )


def _truth(run: OpRun) -> torch.Tensor | StepResult | None:
    """The float64 truth every implementation is checked against: the chunked reference's output, or for a backward
    kernel its training step (float64 autograd: output and gradients). None when it cannot run (e.g. memory)."""
    from dtune.kernels.reference import chunk_reference

    x = run.inputs
    try:
        if get_kernel(run.kernel).backward:
            if reference_bytes(run.shape) > REFERENCE_MAX_BYTES:
                return None  # run_bench notes it
            return reference_step(x)
        o, _ = chunk_reference(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], False, x["cu_seqlens"],
            dtype=torch.float64,
        )  # fmt: skip
    except Exception:  # e.g. float64 memory on a huge shape: report no error rather than no benchmark
        return None
    return o


def _errors(out: Any, truth: torch.Tensor | StepResult | None) -> tuple[float, float]:
    """``(error of the output, largest error of a gradient)`` of one call's result against the truth."""
    if truth is None:
        return math.nan, math.nan
    if not isinstance(truth, StepResult):
        return rel_rms_error(out[0], truth), math.nan
    grads = [
        rel_rms_error(got, want) if got is not None else math.inf
        for n, got in out.grads.items()
        if (want := truth.grads.get(n)) is not None
    ]
    return rel_rms_error(out.o, truth.o), max(grads, default=math.nan)


def peak_mb(call: Call, device: torch.device) -> float:
    """MiB the call allocates at its peak above what is allocated before it (its outputs included); NaN on the CPU."""
    if device.type != "cuda":
        return math.nan
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak / 2**20


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def _shape_rows(run: OpRun, impls: list[Impl], rounds: int, graph: bool) -> list[dict[str, Any]]:
    kernel, p, device = run.kernel, run.shape, run.device
    decode = kernel.startswith("fused_recurrent")
    calls: dict[str, Call] = {}
    errors: dict[str, str] = {}
    first_s: dict[str, float] = {}
    error_o: dict[str, float] = {}
    error_grad: dict[str, float] = {}
    peak: dict[str, float] = {}
    truth = _truth(run)
    for impl in impls:
        try:
            call = impl.make(run.inputs)
            t0 = time.perf_counter()
            out = call()  # compile / autotune outside the timed region (what a user pays at start-up); errors early
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_s[impl.name] = time.perf_counter() - t0
            error_o[impl.name], error_grad[impl.name] = _errors(out, truth)
            del out
            peak[impl.name] = peak_mb(call, device)
            calls[impl.name] = call
        except Exception as exc:  # reported in the row's note (e.g. fla's backward refusing to run), never skipped
            errors[impl.name] = _first_line(exc)
    del truth
    timings: dict[str, list[Timing]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in list(calls.items()):
            try:
                timings[name].append(time_call(call, device))
            except Exception as exc:
                errors[name] = _first_line(exc)
                del calls[name], timings[name]
    step = "fwd+bwd" if get_kernel(kernel).backward else "eager"
    results: list[tuple[Impl, str, Timing | None]] = [
        (impl, step, _combine(timings[impl.name]) if timings.get(impl.name) else None) for impl in impls
    ]
    if graph and decode and p.T == 1 and device.type == "cuda":
        for impl in impls:
            if impl.name in calls and impl.name != "torch":
                try:
                    results.append((impl, "graph", time_call(calls[impl.name], device, "graph")))
                except Exception as exc:
                    errors[f"{impl.name}/graph"] = f"CUDA graph capture failed: {type(exc).__name__}: {exc}"[:300]
    w = run.work
    rows = []
    for impl, mode, t in results:
        ms = t.median_ms if t is not None else math.nan
        rows.append(
            {
                "kernel": kernel,
                "impl": impl.name,
                "mode": mode,
                "dtype": dtype_name(run.dtype),
                "B": p.B,
                "T": p.T,
                "H": p.H,
                "HV": p.HV,
                "K": p.K,
                "V": p.V,
                "N": p.N,
                "decays": run.workload.decays,
                "median_ms": ms,
                "min_ms": t.min_ms if t else math.nan,
                "iqr_ms": t.iqr_ms if t else math.nan,
                "repeats": t.repeats if t else 0,
                "first_call_s": first_s.get(impl.name, math.nan) if mode != "graph" else math.nan,
                "error_o": error_o.get(impl.name, math.nan),
                "error_grad": error_grad.get(impl.name, math.nan),
                "peak_mb": peak.get(impl.name, math.nan) if mode != "graph" else math.nan,
                "meaningful": bool(t.meaningful) if t else False,
                "gbs": w.gbs(ms),
                "tflops": w.tflops(ms),
                "flops": w.flops,
                "bytes": w.bytes,
                "config": json.dumps(impl.config, sort_keys=True) if impl.config is not None else "",
                "config_source": impl.config_source,
                "config_match": config_match(impl.config_source),
                "device": str(device),
                "note": errors.get(impl.name if mode != "graph" else f"{impl.name}/graph", impl.note),
            }
        )
    return rows


def add_speedups(frame: pd.DataFrame) -> pd.DataFrame:
    """Per shape and mode: ``speedup_vs_default`` = default ms / ms, ``speedup_vs_fla`` = fla's fastest ms / ms."""
    frame = frame.copy()
    if "N" not in frame.columns:  # rows of an older bench.csv: fixed-length batches
        frame["N"] = frame["B"]
    keys = ["kernel", "dtype", "mode", "B", "T", "H", "HV", "K", "V", "N"]
    base = frame.groupby(keys, dropna=False)
    default_ms = base["median_ms"].transform(lambda s: s[frame.loc[s.index, "impl"] == "default"].min())
    fla_ms = base["median_ms"].transform(lambda s: s[frame.loc[s.index, "impl"].isin(FLA_IMPLS)].min())
    frame["speedup_vs_default"] = default_ms / frame["median_ms"]
    frame["speedup_vs_fla"] = fla_ms / frame["median_ms"]
    return frame


def default_device() -> torch.device:
    """The CUDA GPU, or the CPU under Triton's interpreter (or without a GPU)."""
    return torch.device("cpu" if interpreting() or not torch.cuda.is_available() else "cuda")


def run_bench(
    kernel: str,
    grid: ShapeGrid,
    dtype: torch.dtype = torch.bfloat16,
    baselines: Sequence[str] = BASELINES,
    config_file: str | Path | Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    rounds: int | None = None,
    graph: bool = False,
    progress: Callable[[str], None] | None = None,
    workload: Workload = DEFAULT_WORKLOAD,
    shape_done: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """Time every implementation on every shape of ``grid``; one row per (shape, implementation, mode).
    ``shape_done`` gets the result so far after each shape (to write it as it grows: a run stopped midway keeps its
    finished shapes)."""
    spec = get_kernel(kernel)
    device = torch.device(device) if device is not None else default_device()
    on_gpu = device.type == "cuda"
    rounds = rounds or (3 if on_gpu else 1)
    source = ConfigSource.load(config_file)
    notes: list[str] = []
    if not on_gpu:
        notes.append("no GPU: times come from Triton's interpreter on the CPU and are NOT meaningful")
        if dtype == torch.bfloat16 and spec.family == "chunk":
            notes.append(INTERPRETER_BF16_DOT)
    if graph and not kernel.startswith("fused_recurrent"):
        notes.append("--graph applies to fused-recurrent decode (T = 1) only")
    elif graph and not on_gpu:
        notes.append("--graph needs CUDA: graph replay skipped")
    rows: list[dict[str, Any]] = []
    for p in bench_shapes(grid, Gate(spec.gate)):
        if progress:
            progress(f"{kernel} B={p.B} T={p.T} H={p.H} D={p.K}")
        run = op_run(kernel, p, dtype, device, workload)
        if spec.backward and reference_bytes(run.shape) > REFERENCE_MAX_BYTES:
            note = (
                f"no output or gradient errors at B={p.B} T={p.T}: float64 autograd through the reference would hold "
                f"~{reference_bytes(run.shape) / 2**30:.0f} GiB (benchmarks/training_step.py checks them at B = 2)"
            )
            notes.append(note)
        config, where = source.resolve(kernel, run.shape, dtype, device)
        impls, impl_notes = build_impls(kernel, baselines, config, where, on_gpu, run.shape, dtype)
        notes.extend(n for n in impl_notes if n not in notes)
        rows.extend(_shape_rows(run, impls, rounds, graph))
        if shape_done:
            shape_done(BenchResult(_frame(rows), list(notes)))
    return BenchResult(_frame(rows), notes)


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    frame = add_speedups(
        pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in ("speedup_vs_default", "speedup_vs_fla", "commit")])
    )
    frame["commit"] = git_commit()  # the source these times belong to (the report shows one commit per source)
    return frame[COLUMNS]


def combine(results: Sequence[BenchResult]) -> BenchResult:
    """Several runs' results as one (rows in order, each note once)."""
    frames = [r.frame for r in results if not r.frame.empty]
    frame = pd.concat(frames, ignore_index=True) if frames else _frame([])
    return BenchResult(frame, list(dict.fromkeys(n for r in results for n in r.notes)))


def default_out_dir(config_file: str | Path | None) -> Path:
    """The run folder when ``--config`` points into one (it holds run.json), else ``reports/``."""
    if config_file is not None:
        parent = Path(config_file).resolve().parent
        if (parent / "run.json").exists():
            return parent
    return Path("reports")


def write(result: BenchResult, out_dir: str | Path) -> tuple[Path, Path]:
    """``bench.csv`` and ``bench.json`` (records) into ``out_dir``."""
    return write_table(result.frame, out_dir, "bench")
