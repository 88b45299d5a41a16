"""Profile: where the time of one call goes, stage by stage, and how far each stage is from its floor.

The chunk pipeline is split into its stages by ``dtune.kernels.chunk.plan`` (each stage launchable alone,
with its own nominal FLOPs and bytes); a fused-recurrent kernel is one stage. Every stage is timed with
:func:`dtune.measure.time_fn`; its compiled Triton kernel gives registers, spills and shared memory; its
achieved GB/s and TFLOP/s are set against the GPU's ceilings measured in the same run
(:func:`dtune.measure.ceilings`) and against the floor of :mod:`dtune.roofline`. ``--ncu`` hands the same call
to Nsight Compute. Run as ``python -m dtune.profile SPEC_JSON`` it just launches the op (what ncu profiles).
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pandas as pd
import torch

from dtune import roofline
from dtune.bench import ConfigSource
from dtune.inputs import Gate, Problem, dtype_from_name, dtype_name, interpreting, make_inputs
from dtune.kernels import get_kernel
from dtune.measure import ceilings, time_fn

COLUMNS = [
    "kernel",
    "dtype",
    "B",
    "T",
    "H",
    "HV",
    "K",
    "V",
    "stage",
    "median_ms",
    "min_ms",
    "iqr_ms",
    "meaningful",
    "share",
    "flops",
    "bytes",
    "intensity",
    "gbs",
    "tflops",
    "pct_bandwidth",
    "pct_matmul",
    "registers",
    "spills",
    "shared_mem",
    "floor_ms",
    "x_floor",
    "bound",
    "verdict",
    "roof_gbs",
    "roof_tflops",
    "roof_source",
    "config",
    "note",
]
TOTAL = "total (whole op)"


class Stage(Protocol):
    """One launchable piece of a pipeline (the contract of ``dtune.kernels.chunk.plan``)."""

    name: str
    flops: float
    bytes: float

    def run(self) -> Any: ...


@dataclass
class OpStage:
    """The whole op as one stage (fused-recurrent kernels; chunk kernels when no ``plan`` is available)."""

    name: str
    call: Callable[[], Any]
    flops: float
    bytes: float
    jit: Any = None  # the Triton JIT function behind the op, to read its compiled kernel

    def run(self) -> Any:
        before = _cached_kernels(self.jit)
        self.call()
        after = _cached_kernels(self.jit)
        fresh = [k for k in after if all(k is not b for b in before)]
        return (fresh or after or [None])[-1]


def _cached_kernels(jit: Any) -> list[Any]:
    """Compiled kernels in a JIT function's caches (best effort: Triton's internals move between versions)."""
    out: list[Any] = []
    for entry in getattr(jit, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else {}
        out.extend(cache.values() if isinstance(cache, dict) else [])
    return out


def kernel_resources(compiled: Any) -> dict[str, float]:
    """Registers per thread, spills and shared memory (bytes) of a compiled Triton kernel; NaN if unknown."""

    def num(x: Any) -> float:
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan

    meta = getattr(compiled, "metadata", None)
    shared = getattr(meta, "shared", None) if meta is not None else None
    if shared is None and isinstance(meta, dict):
        shared = meta.get("shared")
    return {
        "registers": num(getattr(compiled, "n_regs", None)),
        "spills": num(getattr(compiled, "n_spills", None)),
        "shared_mem": num(shared),
    }


@dataclass
class ProfileResult:
    frame: pd.DataFrame
    notes: list[str]
    roofs: roofline.Roofs | None


def stages_for(
    kernel: str, p: Problem, dtype: torch.dtype, x: dict[str, Any], config: dict[str, Any] | None
) -> tuple[list[Stage], Callable[[], Any], list[str]]:
    """The stages of one call, the whole op as a call, and notes (e.g. why the chunk pipeline is one stage)."""
    from dtune.ops import run_kernel

    spec = get_kernel(kernel)
    full = spec.check_config(p.K, p.V, config)
    scale = p.K**-0.5
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])

    def whole() -> Any:
        return run_kernel(kernel, *args, scale, x["initial_state"], x["output_final_state"], None, full)

    w = roofline.work(kernel, p, dtype, x["initial_state"] is not None, x["output_final_state"])
    notes: list[str] = []
    if spec.family == "chunk":
        try:
            plan = importlib.import_module("dtune.kernels.chunk").plan
        except (ImportError, AttributeError) as exc:
            notes.append(f"dtune.kernels.chunk.plan is not available ({exc}): the chunk op is profiled as one stage")
        else:
            stages, _ = plan(*args, spec.gate, scale, x["initial_state"], x["output_final_state"], None, full)
            return list(stages), whole, notes
    jit = getattr(spec.module, f"{spec.family}_fwd_kernel", None)
    return [OpStage(kernel, whole, w.flops, w.bytes, jit)], whole, notes


def _stage_row(
    name: str, t: Any, w: roofline.Work, res: dict[str, float], roofs: roofline.Roofs | None
) -> dict[str, Any]:
    ms = t.median_ms
    floor = roofs.floor_ms(w) if roofs else math.nan
    return {
        "stage": name,
        "median_ms": ms,
        "min_ms": t.min_ms,
        "iqr_ms": t.iqr_ms,
        "meaningful": t.meaningful,
        "flops": w.flops,
        "bytes": w.bytes,
        "intensity": w.intensity,
        "gbs": w.gbs(ms),
        "tflops": w.tflops(ms),
        "pct_bandwidth": 100 * w.gbs(ms) / roofs.gbs if roofs else math.nan,
        "pct_matmul": 100 * w.tflops(ms) / roofs.tflops if roofs else math.nan,
        **res,
        "floor_ms": floor,
        "x_floor": ms / floor if floor and floor > 0 else math.nan,
        "bound": roofs.bound(w) if roofs else "",
        "verdict": roofline.describe(ms, w, roofs),
    }


def run_profile(
    kernel: str,
    p: Problem,
    dtype: torch.dtype = torch.bfloat16,
    config_file: str | Path | None = None,
    device: torch.device | str | None = None,
    roofs: roofline.Roofs | None = None,
    measure_ceilings: bool = True,
) -> ProfileResult:
    """Time each stage of one call of ``kernel`` on ``p``; one row per stage plus the whole op."""
    device = torch.device(device or ("cpu" if interpreting() or not torch.cuda.is_available() else "cuda"))
    notes: list[str] = []
    if device.type == "cuda" and measure_ceilings:
        roofs = roofline.Roofs.from_ceilings(ceilings(device))
    elif device.type != "cuda":
        notes.append("no GPU: times come from Triton's interpreter on the CPU and are NOT meaningful")
        if roofs is None:
            notes.append("ceilings not measured (no GPU): no floor; pass --gpu KEY to use a profile's roofs")
    config, where = ConfigSource.load(config_file).resolve(kernel, p, dtype, device)
    decode = kernel.startswith("fused_recurrent")
    x = make_inputs(p, dtype, device, initial_state=decode)
    x["output_final_state"] = decode
    stages, whole, stage_notes = stages_for(kernel, p, dtype, x, config)
    notes.extend(stage_notes)
    rows = []
    for st in stages:
        compiled = st.run()  # compile outside the timed region; its result names the compiled kernel
        t = time_fn(st.run, device)
        w = roofline.Work(float(getattr(st, "flops", math.nan)), float(getattr(st, "bytes", math.nan)))
        rows.append(_stage_row(st.name, t, w, kernel_resources(compiled), roofs))
    whole()
    w_all = roofline.work(kernel, p, dtype, x["initial_state"] is not None, decode)
    nan_res = {"registers": math.nan, "spills": math.nan, "shared_mem": math.nan}
    rows.append(_stage_row(TOTAL, time_fn(whole, device), w_all, nan_res, roofs))
    frame = pd.DataFrame(rows)
    stage_sum = frame.loc[frame["stage"] != TOTAL, "median_ms"].sum()
    frame["share"] = frame["median_ms"] / stage_sum if stage_sum > 0 else math.nan
    frame.loc[frame["stage"] == TOTAL, "share"] = math.nan
    for col, val in {
        "kernel": kernel,
        "dtype": dtype_name(dtype),
        "B": p.B,
        "T": p.T,
        "H": p.H,
        "HV": p.HV,
        "K": p.K,
        "V": p.V,
        "roof_gbs": roofs.gbs if roofs else math.nan,
        "roof_tflops": roofs.tflops if roofs else math.nan,
        "roof_source": roofs.source if roofs else "",
        "config": json.dumps(get_kernel(kernel).check_config(p.K, p.V, config), sort_keys=True),
        "note": where,
    }.items():
        frame[col] = val
    return ProfileResult(frame[COLUMNS], notes, roofs)


def write(result: ProfileResult, out_dir: str | Path) -> tuple[Path, Path]:
    """``profile.csv`` and ``profile.json`` (records) into ``out_dir``."""
    from dtune.results import write_table

    return write_table(result.frame, out_dir, "profile")


# --------------------------------------------------------------------------------------------- Nsight Compute


def launch_spec(kernel: str, p: Problem, dtype: torch.dtype, config: dict[str, Any] | None) -> str:
    """The JSON that ``python -m dtune.profile`` reads to launch one call (what ncu then profiles)."""
    return json.dumps({"kernel": kernel, **p.as_dict(), "dtype": dtype_name(dtype), "config": config or {}})


def ncu_command(
    kernel: str, p: Problem, dtype: torch.dtype, config: dict[str, Any] | None, out_dir: str | Path
) -> list[str]:
    """Nsight Compute over a few launches of the op: a full section set, exported next to profile.csv."""
    report = Path(out_dir) / f"ncu_{kernel}_T{p.T}_D{p.K}"
    return [
        "ncu",
        "--set",
        "full",
        "--target-processes",
        "all",
        "--launch-skip",
        "2",
        "--launch-count",
        "10",
        "--force-overwrite",
        "--export",
        str(report),
        sys.executable,
        "-m",
        "dtune.profile",
        launch_spec(kernel, p, dtype, config),
    ]


def ncu_available() -> bool:
    return shutil.which("ncu") is not None


def _launch(spec_json: str, repeats: int = 3) -> None:
    s = json.loads(spec_json)
    gate = Gate(s.get("gate", get_kernel(s["kernel"]).gate))
    p = Problem(B=s["B"], T=s["T"], H=s["H"], HV=s["HV"], K=s["K"], V=s["V"], N=s.get("N", s["B"]), gate=gate)
    dtype = dtype_from_name(s["dtype"])
    device = "cpu" if interpreting() else "cuda"
    decode = s["kernel"].startswith("fused_recurrent")
    x = make_inputs(p, dtype, device, initial_state=decode)
    x["output_final_state"] = decode
    _, whole, _ = stages_for(s["kernel"], p, dtype, x, s.get("config") or None)
    for _ in range(repeats):
        whole()
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    _launch(sys.argv[1])
