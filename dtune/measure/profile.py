"""Profile: where the time of one call goes, stage by stage, and how far each stage is from its floor.

The call is the harness's (:func:`dtune.measure.harness.op_run`: the same inputs and workload as the trials and
the benchmark). The chunk pipeline is split into its stages by ``dtune.kernels.chunk.plan`` (each stage launchable
alone, with its own nominal FLOPs and bytes); a fused-recurrent kernel is one stage. Every stage is timed with
:func:`dtune.measure.timing.time_call`; the kernels it launches give registers, spills and shared memory
(:mod:`dtune.measure.resources`); its achieved GB/s and TFLOP/s are set against the GPU's ceilings measured in the
same run (:func:`dtune.measure.timing.ceilings`) and against the floor of :mod:`dtune.measure.work`. ``--ncu``
hands the same call to Nsight Compute. Run as ``python -m dtune.measure.profile SPEC_JSON`` it just launches the
op (what ncu profiles).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from dtune.inputs import dtype_from_name, dtype_name, interpreting
from dtune.kernels import get_kernel
from dtune.measure import work as wm
from dtune.measure.configs import ConfigSource
from dtune.measure.error import rel_rms_error
from dtune.measure.harness import OpRun, OpStage, Stage, op_run, op_stages  # noqa: F401 (OpStage: re-exported)
from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload
from dtune.measure.resources import Resources, capture_launches, resources_of
from dtune.measure.tables import write_table
from dtune.measure.timing import Timing, ceilings, time_call
from dtune.provenance import git_commit
from dtune.shape import SHAPE_COLUMNS, Gate, Shape

COLUMNS = [
    "kernel",
    "dtype",
    *SHAPE_COLUMNS,
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
    "error_o",
    "config",
    "note",
    "commit",
]
TOTAL = "total (whole op)"


def stage_resources(stage: Stage) -> Resources:
    """Run ``stage`` once (compiling it outside any timed region) and read what its launches use; a stage that
    returns its compiled kernel (``plan``'s contract) is read from that when no launch was seen."""
    with capture_launches() as launched:
        returned = stage.run()
    return resources_of(launched or [returned])


@dataclass
class ProfileResult:
    frame: pd.DataFrame
    notes: list[str]
    roofs: wm.Roofs | None


def stages_for(run: OpRun, config: dict[str, Any] | None) -> tuple[list[Stage], Callable[[], Any]]:
    """The stages of one call (:func:`dtune.measure.harness.op_stages`) and the whole op as a call."""
    full = get_kernel(run.kernel).check_config(run.shape.K, run.shape.V, config)
    return op_stages(run, full), run.call(full)


def _stage_row(name: str, t: Timing, w: wm.Work, res: Resources, roofs: wm.Roofs | None) -> dict[str, Any]:
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
        **{k: math.nan if v is None else float(v) for k, v in res._asdict().items()},
        "floor_ms": floor,
        "x_floor": ms / floor if floor and floor > 0 else math.nan,
        "bound": roofs.bound(w) if roofs else "",
        "verdict": wm.describe(ms, w, roofs),
    }


def output_error(run: OpRun, o: Any) -> float:
    """Relative RMS error of ``o`` against the float64 chunked reference on the run's inputs (NaN if it cannot run)."""
    from dtune.kernels.reference import chunk_reference

    x = run.inputs
    if not isinstance(o, torch.Tensor):
        return math.nan
    try:
        ref, _ = chunk_reference(
            x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], False, x["cu_seqlens"],
        )  # fmt: skip
    except Exception:  # e.g. float64 memory on a huge shape: no error rather than no profile
        return math.nan
    return rel_rms_error(o, ref)


def run_profile(
    kernel: str,
    p: Shape,
    dtype: torch.dtype = torch.bfloat16,
    config_file: str | Path | Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    roofs: wm.Roofs | None = None,
    measure_ceilings: bool = True,
    workload: Workload = DEFAULT_WORKLOAD,
) -> ProfileResult:
    """Time each stage of one call of ``kernel`` on ``p``; one row per stage plus the whole op."""
    device = torch.device(device or ("cpu" if interpreting() or not torch.cuda.is_available() else "cuda"))
    notes: list[str] = []
    if device.type == "cuda" and measure_ceilings:
        roofs = wm.Roofs.from_ceilings(ceilings(device))
    elif device.type != "cuda":
        notes.append("no GPU: times come from Triton's interpreter on the CPU and are NOT meaningful")
        if roofs is None:
            notes.append("ceilings not measured (no GPU): no floor; pass --gpu KEY to use a profile's roofs")
    run = op_run(kernel, p, dtype, device, workload)
    if get_kernel(kernel).backward:
        notes.append(
            "a backward kernel is profiled as its whole training step (forward + backward); its kernels against the "
            "stage floors of dtune.measure.work.backward_stages: benchmarks/training_step.py (its stages step)"
        )
    config, where = ConfigSource.load(config_file).resolve(kernel, run.shape, dtype, device)
    stages, whole = stages_for(run, config)
    rows = []
    for st in stages:
        res = stage_resources(st)
        t = time_call(st.run, device)
        w = wm.Work(float(getattr(st, "flops", math.nan)), float(getattr(st, "bytes", math.nan)))
        rows.append(_stage_row(st.name, t, w, res, roofs))
    o = whole()[0]
    rows.append(_stage_row(TOTAL, time_call(whole, device), run.work, Resources(None, None, None), roofs))
    frame = pd.DataFrame(rows)
    # A fast but wrong op must show: the whole op's output against the float64 reference (the bench's metric).
    frame["error_o"] = math.nan
    frame.loc[frame["stage"] == TOTAL, "error_o"] = output_error(run, o)
    stage_sum = frame.loc[frame["stage"] != TOTAL, "median_ms"].sum()
    frame["share"] = frame["median_ms"] / stage_sum if stage_sum > 0 else math.nan
    frame.loc[frame["stage"] == TOTAL, "share"] = math.nan
    s = run.shape
    for col, val in {
        "kernel": kernel,
        "dtype": dtype_name(dtype),
        "B": s.B,
        "T": s.T,
        "H": s.H,
        "HV": s.HV,
        "K": s.K,
        "V": s.V,
        "roof_gbs": roofs.gbs if roofs else math.nan,
        "roof_tflops": roofs.tflops if roofs else math.nan,
        "roof_source": roofs.source if roofs else "",
        "config": json.dumps(get_kernel(kernel).check_config(s.K, s.V, config), sort_keys=True),
        "note": where,
        "commit": git_commit(),
    }.items():
        frame[col] = val
    return ProfileResult(frame[COLUMNS], notes, roofs)


def write(result: ProfileResult, out_dir: str | Path) -> tuple[Path, Path]:
    """``profile.csv`` and ``profile.json`` (records) into ``out_dir``."""
    return write_table(result.frame, out_dir, "profile")


# --------------------------------------------------------------------------------------------- Nsight Compute


def launch_spec(kernel: str, p: Shape, dtype: torch.dtype, config: dict[str, Any] | None) -> str:
    """The JSON that ``python -m dtune.measure.profile`` reads to launch one call (what ncu then profiles)."""
    spec = {"kernel": kernel, **p.bucket(), "N": p.N, "gate": p.gate.value}
    return json.dumps({**spec, "dtype": dtype_name(dtype), "config": config or {}})


def ncu_command(
    kernel: str, p: Shape, dtype: torch.dtype, config: dict[str, Any] | None, out_dir: str | Path
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
        "dtune.measure.profile",
        launch_spec(kernel, p, dtype, config),
    ]


def ncu_available() -> bool:
    return shutil.which("ncu") is not None


def run_ncu(cmd: list[str]) -> str:
    """Run Nsight Compute (``cmd`` from :func:`ncu_command`), or say how to when it is not on PATH."""
    if not ncu_available():
        quoted = " ".join(f"'{c}'" if " " in c or "{" in c else c for c in cmd)
        return "Nsight Compute (`ncu`) is not on PATH; install it, then run:\n  " + quoted
    done = subprocess.run(cmd, capture_output=True, text=True)
    msg = f"ncu exited {done.returncode}; report {cmd[cmd.index('--export') + 1]}.ncu-rep"
    return msg + ("\n" + done.stderr[-2000:] if done.returncode else "")


def _launch(spec_json: str, repeats: int = 3) -> None:
    s = json.loads(spec_json)
    p = Shape.from_dict(s, Gate(s.get("gate", get_kernel(s["kernel"]).gate)))
    device = "cpu" if interpreting() else "cuda"
    run = op_run(s["kernel"], p, dtype_from_name(s["dtype"]), device)
    _, whole = stages_for(run, s.get("config") or None)
    for _ in range(repeats):
        whole()
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    _launch(sys.argv[1])
