"""Benchmark: the tuned config against the untuned default, flash-linear-attention and the PyTorch reference.

For every shape of the grid the implementations are timed side by side, interleaved (round after round, each
implementation in turn, so drifting clocks hit all of them alike), with :func:`dtune.measure.time_fn`; fused-
recurrent decode (T = 1) is also timed under CUDA-graph replay (:func:`dtune.measure.time_graph`) so the host
overhead shows. Each row reports the median ms, the speedup against the default and against fla's fastest mode,
the output's relative RMS error against the float64 chunked reference (so a fast but wrong contestant shows),
and the achieved GB/s and TFLOP/s of the nominal work (:mod:`dtune.roofline`), and what the first call cost
(compile, and autotune for fla: what a user pays at start-up for each new shape family).
Under Triton's interpreter (CPU) everything runs on tiny shapes and the times are marked not meaningful.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from dtune import roofline
from dtune.inputs import Gate, Problem, dtype_name, interpreting, make_inputs
from dtune.kernels import get_kernel
from dtune.measure import Timing, time_fn, time_graph

BASELINES = ("default", "fla", "torch")
FLA_OPS: dict[str, tuple[str, str]] = {
    "chunk_delta_rule": ("fla.ops.delta_rule", "chunk_delta_rule"),
    "fused_recurrent_delta_rule": ("fla.ops.delta_rule", "fused_recurrent_delta_rule"),
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "fused_recurrent_gated_delta_rule": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "fused_recurrent_kda": ("fla.ops.kda", "fused_recurrent_kda"),
}
KDA_LOWER_BOUND = -5.0  # fla's fast mode for chunk_kda: safe_gate=True with gates in [lower_bound, 0)
COLUMNS = [
    "kernel",
    "impl",
    "mode",
    "dtype",
    "B",
    "T",
    "H",
    "HV",
    "K",
    "V",
    "median_ms",
    "min_ms",
    "iqr_ms",
    "repeats",
    "first_call_s",
    "error_o",
    "meaningful",
    "speedup_vs_default",
    "speedup_vs_fla",
    "gbs",
    "tflops",
    "flops",
    "bytes",
    "config",
    "config_source",
    "device",
    "note",
]

Inputs = dict[str, Any]
Call = Callable[[], Any]


# --------------------------------------------------------------------------------------------- shape grid


def parse_ints(text: str | None) -> list[int] | None:
    """``"1024,4096"`` -> ``[1024, 4096]``; None or empty -> None."""
    if text is None or not text.strip():
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class Grid:
    """The shapes to benchmark: every combination of sequence length, head dim, heads and batch."""

    seq_lens: tuple[int, ...]
    head_dims: tuple[int, ...]
    heads: tuple[int, ...]
    batches: tuple[int, ...] = ()  # empty: derived from batch_tokens
    batch_tokens: int | None = None
    shapes: tuple[tuple[int, int, int, int, int, int], ...] = ()  # explicit (B, T, H, HV, K, V): wins over the rest

    def problems(self, gate: Gate) -> list[Problem]:
        if self.shapes:
            return [Problem(B=b, T=t, H=h, HV=hv, K=k, V=v, N=b, gate=gate) for b, t, h, hv, k, v in self.shapes]
        out = []
        for d in self.head_dims:
            for h in self.heads:
                for t in self.seq_lens:
                    batches = self.batches or (max(1, (self.batch_tokens or t) // t),)
                    for b in batches:
                        out.append(Problem(B=b, T=t, H=h, HV=h, K=d, V=d, N=b, gate=gate))
        return out


def default_grid(kernel: str, on_gpu: bool) -> Grid:
    """The anchors' grid on a GPU (anchors/fla-0.6.0_h200.md); tiny shapes under the interpreter."""
    decode = kernel.startswith("fused_recurrent")
    if on_gpu:
        if decode:
            return Grid(seq_lens=(1,), head_dims=(64, 128), heads=(16,), batches=(1, 32, 256))
        return Grid(seq_lens=(1024, 4096, 16384), head_dims=(64, 128), heads=(16,), batch_tokens=32768)
    if decode:
        return Grid(seq_lens=(1,), head_dims=(16,), heads=(2,), batches=(1, 2))
    return Grid(seq_lens=(16, 32), head_dims=(16,), heads=(2,), batches=(1,))


def make_grid(
    kernel: str,
    on_gpu: bool,
    seq_lens: Sequence[int] | None = None,
    head_dims: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    batches: Sequence[int] | None = None,
    batch_tokens: int | None = None,
) -> Grid:
    """The default grid with any of its axes replaced; ``batches`` wins over ``batch_tokens``."""
    base = default_grid(kernel, on_gpu)
    if batches:
        bs, bt = tuple(batches), None
    elif batch_tokens:
        bs, bt = (), batch_tokens
    else:
        bs, bt = base.batches, base.batch_tokens
    return Grid(
        seq_lens=tuple(seq_lens or base.seq_lens),
        head_dims=tuple(head_dims or base.head_dims),
        heads=tuple(heads or base.heads),
        batches=bs,
        batch_tokens=bt,
    )


def tuned_grid(entries: Sequence[dict[str, Any]], kernel: str, dtype: torch.dtype) -> Grid | None:
    """The shapes a tuned.json was tuned on (its buckets for ``kernel`` and ``dtype``), or None if it has none."""
    shapes: set[tuple[int, int, int, int, int, int]] = set()
    for e in entries:
        bk = e.get("bucket", {})
        if e.get("kernel") != kernel or not _dtype_matches(e.get("dtype"), dtype):
            continue
        try:
            B, T, H, K = int(bk["B"]), int(bk["T"]), int(bk["H"]), int(bk["K"])
            shapes.add((B, T, H, int(bk.get("HV", H)), K, int(bk.get("V", K))))
        except (KeyError, TypeError, ValueError):
            continue
    if not shapes:
        return None
    ordered = tuple(sorted(shapes, key=lambda s: (s[4], s[1], s[0], s[2])))
    return Grid(seq_lens=(), head_dims=(), heads=(), shapes=ordered)


INTERPRETER_BF16_DOT = (
    "Triton's interpreter computes tl.dot on bfloat16 inputs wrongly (checked with Triton 3.9): the chunk kernels' "
    "errors here say nothing about the GPU; use --dtype fp16 or fp32 on the CPU"
)
TINY = 1 << 14  # B·T·H·K of a shape the interpreter runs in seconds


def tuned_grid_here(config_file: str | Path, kernel: str, dtype: torch.dtype, on_gpu: bool) -> Grid | None:
    """The shapes ``config_file`` was tuned on, when it has any and they can run here (tiny ones on the CPU)."""
    grid = tuned_grid(ConfigSource.load(config_file).entries, kernel, dtype)
    if grid is None or on_gpu:
        return grid
    return grid if all(B * T * H * K <= TINY for B, T, H, _, K, _ in grid.shapes) else None


# --------------------------------------------------------------------------------------------- tuned configs


def _dtype_matches(name: Any, dtype: torch.dtype) -> bool:
    return str(name).replace("torch.", "") in (dtype_name(dtype), str(dtype).replace("torch.", ""))


def _log2_gap(a: Any, b: int) -> float:
    try:
        return abs(math.log2(max(int(a), 1)) - math.log2(max(b, 1)))
    except (TypeError, ValueError):
        return 64.0


def pick_entry(entries: Sequence[dict[str, Any]], kernel: str, p: Problem, dtype: torch.dtype) -> dict[str, Any] | None:
    """The tuned.json entry for ``p``, by :mod:`dtune.store`'s rule: same kernel, dtype, K, V and HV/H; then the
    nearest sequence length, batch and heads (log scale). None when no entry matches."""

    def matches(e: dict[str, Any]) -> bool:
        b = e.get("bucket", {})
        try:
            same_ratio = int(b["HV"]) // int(b["H"]) == p.HV // p.H
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return False
        return (
            e.get("kernel") == kernel
            and _dtype_matches(e.get("dtype"), dtype)
            and (b.get("K"), b.get("V")) == (p.K, p.V)
            and same_ratio
        )

    def distance(e: dict[str, Any]) -> tuple[float, ...]:
        b = e["bucket"]
        return (_log2_gap(b.get("T", p.T), p.T), _log2_gap(b.get("B", p.N), p.N), _log2_gap(b.get("H", p.H), p.H))

    mine = [e for e in entries if matches(e)]
    return min(mine, key=distance) if mine else None


@dataclass
class ConfigSource:
    """Where the tuned config comes from: a tuned.json (or plain config) file, else :mod:`dtune.store`."""

    path: Path | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    fixed: dict[str, Any] | None = None  # a plain config file: one config for every shape
    table: Any = None  # the file as dtune.store reads it (validated), when the store can

    @classmethod
    def load(cls, path: str | Path | None) -> ConfigSource:
        if path is None:
            return cls()
        path = Path(path)
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "entries" in data:
            return cls(path=path, entries=list(data["entries"]), table=_store_table(path))
        if isinstance(data, dict) and isinstance(data.get("config"), dict):
            return cls(path=path, fixed=dict(data["config"]))
        if isinstance(data, dict):
            return cls(path=path, fixed=data)
        raise ValueError(f"{path}: expected a tuned.json (with 'entries') or a config object")

    def resolve(self, kernel: str, p: Problem, dtype: torch.dtype, device: torch.device) -> tuple[dict | None, str]:
        """``(config, where_from)``; config None means the template's default."""
        if self.fixed is not None:
            return dict(self.fixed), f"file:{self.path}"
        if self.path is not None:
            e = pick_entry(self.entries, kernel, p, dtype)
            if e is None:
                return None, f"default (no entry for {kernel} {dtype_name(dtype)} K={p.K} V={p.V} in {self.path.name})"
            b = e.get("bucket", {})
            config = dict(e["config"])
            if self.table is not None:  # what the ops would launch with this file loaded
                config = self.table.lookup(kernel, dtype_name(dtype), p) or config
            return config, f"{self.path.name}: T={b.get('T')} B={b.get('B')} H={b.get('H')}"
        try:
            store = importlib.import_module("dtune.store")
            config = store.tuned_config(kernel, p, dtype, device)
        except Exception as exc:  # the store is another module's work; never let it break a benchmark
            return None, f"default (store unavailable: {exc})"
        return (dict(config), "store") if config else (None, "default (no tuned config in the store)")


def _store_table(path: Path) -> Any:
    """``dtune.store.read_configs(path)`` (validates the file like the ops do), or None if the store lacks it."""
    try:
        read_configs = importlib.import_module("dtune.store").read_configs
    except (ImportError, AttributeError):
        return None
    return read_configs(path)


# --------------------------------------------------------------------------------------------- implementations


@dataclass
class Impl:
    """One contestant: a name and a way to turn inputs into a zero-argument call."""

    name: str
    make: Callable[[Inputs], Call]
    config: dict[str, Any] | None = None
    config_source: str = ""
    note: str = ""


def _ours(kernel: str, config: dict[str, Any]) -> Callable[[Inputs], Call]:
    from dtune.ops import run_kernel

    def make(x: Inputs) -> Call:
        return lambda: run_kernel(
            kernel,
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            x["scale"],
            x["initial_state"],
            x["output_final_state"],
            None,
            config,
        )

    return make


def fla_function(kernel: str) -> tuple[Callable[..., Any] | None, str]:
    """fla's op for ``kernel``, or ``(None, why not)``."""
    module, name = FLA_OPS[kernel]
    try:
        return getattr(importlib.import_module(module), name), ""
    except Exception as exc:
        return None, f"flash-linear-attention not importable ({type(exc).__name__}: {exc})"


def _fla(fn: Callable[..., Any], gated: bool, **extra: Any) -> Callable[[Inputs], Call]:
    def make(x: Inputs) -> Call:
        g = x["g"]
        if "lower_bound" in extra and g is not None:
            g = g.clamp(min=extra["lower_bound"])
        # By keyword: fla's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta, ...).
        lead = (x["q"], x["k"], x["v"])
        gates = {"g": g, "beta": x["beta"]} if gated else {"beta": x["beta"]}
        kw = {
            **gates,
            "scale": x["scale"],
            "initial_state": x["initial_state"],
            "output_final_state": x["output_final_state"],
            "cu_seqlens": None,
            **extra,
        }
        return lambda: fn(*lead, **kw)

    return make


TORCH_CHUNK = 16  # the reference factors exp(γ_i)·exp(−γ_j): 16 steps of log decay ≥ −5 stay inside float32


def _torch_reference() -> Callable[[Inputs], Call]:
    """The PyTorch chunked reference in float32 (chunk 16: at its default 32, strong decays overflow float32)."""
    from dtune.kernels.reference import chunk_reference

    def make(x: Inputs) -> Call:
        dtype = x["v"].dtype if x["v"].dtype == torch.float32 else torch.float32
        return lambda: chunk_reference(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            x["scale"],
            x["initial_state"],
            x["output_final_state"],
            None,
            chunk_size=TORCH_CHUNK,
            dtype=dtype,
        )

    return make


def build_impls(
    kernel: str, baselines: Sequence[str], config: dict[str, Any] | None, source: str, on_gpu: bool
) -> tuple[list[Impl], list[str]]:
    """The contestants for one shape, and notes on baselines that cannot run here."""
    spec = get_kernel(kernel)
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}")
    notes: list[str] = []
    impls = [Impl("tuned", _ours(kernel, config or {}), config, source)]
    if "default" in baselines:
        impls.append(Impl("default", _ours(kernel, {}), {}, "template default"))
    if "fla" in baselines:
        fn, why = fla_function(kernel)
        if fn is None:
            notes.append(why)
        elif not on_gpu:
            notes.append("flash-linear-attention needs a CUDA GPU: skipped")
        else:
            gated = spec.gate != "none"
            impls.append(Impl("fla", _fla(fn, gated), None, "fla default"))
            if kernel == "chunk_kda":
                fast = _fla(fn, gated, safe_gate=True, lower_bound=KDA_LOWER_BOUND)
                impls.append(Impl("fla_fast", fast, None, "fla safe_gate=True lower_bound=-5"))
    if "torch" in baselines:
        impls.append(Impl("torch", _torch_reference(), None, f"reference.chunk_reference fp32, chunk {TORCH_CHUNK}"))
    return impls, notes


# --------------------------------------------------------------------------------------------- the run


@dataclass
class BenchResult:
    frame: pd.DataFrame
    notes: list[str]


def _combine(timings: list[Timing]) -> Timing:
    """Rounds of one implementation: the median of the rounds' medians."""
    return Timing(
        statistics.median(t.median_ms for t in timings),
        min(t.min_ms for t in timings),
        statistics.median(t.iqr_ms for t in timings),
        sum(t.repeats for t in timings),
        all(t.meaningful for t in timings),
    )


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error ‖x − ref‖ / ‖ref‖ in float64; inf when x has NaN/Inf (a wrong kernel, not a slow one)."""
    x64 = x.detach().double()
    if not torch.isfinite(x64).all():
        return math.inf
    return float((x64 - ref).norm() / ref.norm().clamp_min(1e-30))


def _truth(x: Inputs) -> torch.Tensor | None:
    """The float64 chunked reference output for these inputs: every implementation's output is checked against it."""
    from dtune.kernels.reference import chunk_reference

    try:
        o, _ = chunk_reference(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], False, None, dtype=torch.float64
        )
    except Exception:  # e.g. float64 memory on a huge shape: report no error rather than no benchmark
        return None
    return o


def _shape_rows(
    kernel: str,
    p: Problem,
    dtype: torch.dtype,
    device: torch.device,
    impls: list[Impl],
    rounds: int,
    graph: bool,
) -> list[dict[str, Any]]:
    decode = kernel.startswith("fused_recurrent")
    x = make_inputs(p, dtype, device, initial_state=decode)
    x["scale"] = p.K**-0.5
    x["output_final_state"] = decode
    w = roofline.work(kernel, p, dtype, initial_state=decode, final_state=decode)
    calls: dict[str, Call] = {}
    errors: dict[str, str] = {}
    first_s: dict[str, float] = {}
    error_o: dict[str, float] = {}
    truth = _truth(x)
    for impl in impls:
        try:
            call = impl.make(x)
            t0 = time.perf_counter()
            out = call()  # compile / autotune outside the timed region (what a user pays at start-up); errors early
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_s[impl.name] = time.perf_counter() - t0
            calls[impl.name] = call
            error_o[impl.name] = rel_err(out[0], truth) if truth is not None else math.nan
        except Exception as exc:
            errors[impl.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    timings: dict[str, list[Timing]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            timings[name].append(time_fn(call, device))
    results: list[tuple[Impl, str, Timing | None]] = [
        (impl, "eager", _combine(timings[impl.name]) if impl.name in timings else None) for impl in impls
    ]
    if graph and decode and p.T == 1 and device.type == "cuda":
        for impl in impls:
            if impl.name in calls and impl.name != "torch":
                try:
                    results.append((impl, "graph", time_graph(calls[impl.name], device)))
                except Exception as exc:
                    errors[f"{impl.name}/graph"] = f"CUDA graph capture failed: {type(exc).__name__}: {exc}"[:300]
    rows = []
    for impl, mode, t in results:
        ms = t.median_ms if t is not None else math.nan
        rows.append(
            {
                "kernel": kernel,
                "impl": impl.name,
                "mode": mode,
                "dtype": dtype_name(dtype),
                "B": p.B,
                "T": p.T,
                "H": p.H,
                "HV": p.HV,
                "K": p.K,
                "V": p.V,
                "median_ms": ms,
                "min_ms": t.min_ms if t else math.nan,
                "iqr_ms": t.iqr_ms if t else math.nan,
                "repeats": t.repeats if t else 0,
                "first_call_s": first_s.get(impl.name, math.nan) if mode == "eager" else math.nan,
                "error_o": error_o.get(impl.name, math.nan),
                "meaningful": bool(t.meaningful) if t else False,
                "gbs": w.gbs(ms),
                "tflops": w.tflops(ms),
                "flops": w.flops,
                "bytes": w.bytes,
                "config": json.dumps(impl.config, sort_keys=True) if impl.config is not None else "",
                "config_source": impl.config_source,
                "device": str(device),
                "note": errors.get(impl.name if mode == "eager" else f"{impl.name}/graph", impl.note),
            }
        )
    return rows


def add_speedups(frame: pd.DataFrame) -> pd.DataFrame:
    """Per shape and mode: ``speedup_vs_default`` = default ms / ms, ``speedup_vs_fla`` = fla's fastest ms / ms."""
    frame = frame.copy()
    keys = ["kernel", "dtype", "mode", "B", "T", "H", "HV", "K", "V"]
    base = frame.groupby(keys, dropna=False)
    default_ms = base["median_ms"].transform(lambda s: s[frame.loc[s.index, "impl"] == "default"].min())
    fla_ms = base["median_ms"].transform(lambda s: s[frame.loc[s.index, "impl"].str.startswith("fla")].min())
    frame["speedup_vs_default"] = default_ms / frame["median_ms"]
    frame["speedup_vs_fla"] = fla_ms / frame["median_ms"]
    return frame


def run_bench(
    kernel: str,
    grid: Grid,
    dtype: torch.dtype = torch.bfloat16,
    baselines: Sequence[str] = BASELINES,
    config_file: str | Path | None = None,
    device: torch.device | str | None = None,
    rounds: int | None = None,
    graph: bool = False,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Time every implementation on every shape of ``grid``; one row per (shape, implementation, mode)."""
    spec = get_kernel(kernel)
    device = torch.device(device or ("cpu" if interpreting() or not torch.cuda.is_available() else "cuda"))
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
    for p in grid.problems(Gate(spec.gate)):
        if progress:
            progress(f"{kernel} B={p.B} T={p.T} H={p.H} D={p.K}")
        config, where = source.resolve(kernel, p, dtype, device)
        impls, impl_notes = build_impls(kernel, baselines, config, where, on_gpu)
        notes.extend(n for n in impl_notes if n not in notes)
        rows.extend(_shape_rows(kernel, p, dtype, device, impls, rounds, graph))
    frame = add_speedups(
        pd.DataFrame(rows, columns=[c for c in COLUMNS if c not in ("speedup_vs_default", "speedup_vs_fla")])
    )
    return BenchResult(frame[COLUMNS], notes)


def default_out_dir(config_file: str | Path | None) -> Path:
    """The run folder when ``--config`` points into one (it holds run.json), else ``reports/``."""
    if config_file is not None:
        parent = Path(config_file).resolve().parent
        if (parent / "run.json").exists():
            return parent
    return Path("reports")


def write(result: BenchResult, out_dir: str | Path) -> tuple[Path, Path]:
    """``bench.csv`` and ``bench.json`` (records) into ``out_dir``."""
    from dtune.results import write_table

    return write_table(result.frame, out_dir, "bench")
