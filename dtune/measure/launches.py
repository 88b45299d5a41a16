"""Where the time of one call goes, launch by launch: every kernel that the forward or the training step launches,
timed by the CUDA profiler (``torch.profiler``, kernels named as it names them), and each of dtune's launches set
against the floor of the stage it runs.

The stages and their floors (nominal FLOPs, the bytes the launch must move) come from the work models: the forward's
from its ``plan()`` (the stages ``dtune profile`` times one by one, with the chunk pipeline's cost model), the
training step's from :func:`dtune.measure.work.backward_stages` (the forward under autograd, then each backward
kernel); with ``SAVE = "none"`` the forward under autograd is the plain forward, so its stages are the plan's. Each
stage names the Triton kernel it launches (a plan stage: the kernels seen launching when it runs). The profiler's
launches are matched to the stages in order, by kernel name (:func:`match_stages`): another launch of a kernel that
has no stage of its own left counts with the stage that launched that kernel last (KDA's exact redo of steep
chunks), a launch of a kernel no stage names (PyTorch's own) has no stage, and a stage nothing launched is reported.
A stage's floor and its time (all its launches) sit on its first launch's row.

Peers (fla, FlashQLA) have no dtune floor: their launches are grouped by kernel name (launches per call, time per
call), and every contestant's table ends with the whole call: its median (:func:`dtune.measure.timing.time_call`,
CUDA events, L2 flushed) against the floor of the whole op (compulsory bytes, nominal FLOPs:
:func:`dtune.measure.work.work`), the same floor for all. The launches' sum against that median is the time between
launches.

Timing: ``calls`` back-to-back calls under the profiler after a warm-up call (compiles, autotuning), each launch's
device time the mean over the calls; when the calls do not launch the same sequence the launches are grouped by name.
Under Triton's interpreter (CPU) the launches are Triton's, timed by the host clock: the same table, times not
meaningful.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from dtune.inputs import dtype_name, interpreting
from dtune.kernels import get_kernel
from dtune.measure import work as wm
from dtune.measure.baselines import build_impls
from dtune.measure.configs import ConfigSource
from dtune.measure.harness import OpRun, op_run, op_stages
from dtune.measure.inputs import DEFAULT_WORKLOAD, Workload
from dtune.measure.tables import write_table
from dtune.measure.timing import ceilings, time_call
from dtune.provenance import git_commit
from dtune.shape import SHAPE_COLUMNS, Shape

MODES = ("fwd", "fwd+bwd")
DTUNE_IMPLS = ("tuned", "default")  # dtune's own rows: per launch, each with its stage
CALL = "(whole call)"  # the last row of every contestant's table
CALLS = 10  # profiled calls per contestant (after a warm-up call)
COLUMNS = [
    "kernel",  # the op, e.g. chunk_gated_delta_rule (its backward for mode fwd+bwd is chunk_gated_delta_rule_bwd)
    "impl",
    "mode",
    "dtype",
    *SHAPE_COLUMNS,
    "N",
    "position",  # order of (first) launch within one call, from 1; the whole call's row: 0
    "launch",  # the kernel's name as the profiler gives it
    "count",  # launches per call
    "ms",  # device time per call (all ``count`` launches); the whole call's row: its median
    "share",  # of the launches' summed time
    "stage",
    "stage_ms",  # the stage's time, all its launches (on its first launch's row)
    "flops",
    "bytes",
    "floor_ms",
    "x_floor",
    "bound",
    "launches_ms",  # the launches' summed time per call (every row of the contestant)
    "call_ms",  # the whole call's median (every row of the contestant)
    "first_call_s",
    "meaningful",
    "roof_gbs",
    "roof_tflops",
    "roof_source",
    "config",
    "config_source",
    "note",
    "commit",
]


@dataclass(frozen=True)
class Launch:
    """One kernel of a call: its name, how many times one call launches it, and its device time per call (ms)."""

    name: str
    ms: float
    count: float = 1.0


# ---------------------------------------------------------------------------------------------- recording launches


def _is_device(event: Any) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is not None and str(getattr(kind, "name", kind)).upper().endswith("CUDA")


def device_launches(events: Iterable[Any]) -> list[tuple[str, float]]:
    """``(name, ms)`` of every device-side event of a profiler's event list (kernels, memsets, copies), in the order
    they ran (``torch.profiler.profile(...).events()``: ``name``, ``device_type``, ``time_range`` in µs); a device-side
    range that holds other events (an annotation on the GPU's timeline) is left out."""
    found = []
    for e in events:
        if not _is_device(e):
            continue
        found.append((float(e.time_range.start), float(e.time_range.end), str(e.name)))
    found.sort(key=lambda r: (r[0], -r[1]))
    # A device-side range that holds other events (a user annotation drawn on the GPU's timeline) is no launch.
    spans = [r for i, r in enumerate(found) if not (i + 1 < len(found) and found[i + 1][1] <= r[1])]
    return [(name, (end - start) / 1e3) for start, end, name in spans]


def by_name(launches: Sequence[Launch], calls: int = 1) -> list[Launch]:
    """Launches grouped by kernel name in order of first launch: launches and summed time, per call."""
    out: dict[str, list[float]] = {}
    for launch in launches:
        count_ms = out.setdefault(launch.name, [0.0, 0.0])
        count_ms[0] += launch.count
        count_ms[1] += launch.ms
    return [Launch(name, ms / calls, count / calls) for name, (count, ms) in out.items()]


def per_call(sequence: Sequence[tuple[str, float]], calls: int) -> tuple[list[Launch], str]:
    """The launches of one call, in order, from ``calls`` identical calls' sequence: each launch's time the mean over
    the calls. When the calls did not launch the same sequence, grouped by name (and a note says so)."""
    launches = [Launch(name, ms) for name, ms in sequence]
    if calls < 1 or not launches:
        return launches, "" if launches else "no launch recorded"
    n = len(launches) // calls
    chunks = [launches[i * n : (i + 1) * n] for i in range(calls)]
    names = [x.name for x in chunks[0]]
    if n * calls == len(launches) and all([x.name for x in c] == names for c in chunks):
        return [Launch(names[j], statistics.fmean(c[j].ms for c in chunks)) for j in range(n)], ""
    note = f"the {calls} profiled calls launched different kernel sequences: launches grouped by kernel name"
    return by_name(launches, calls), note


@contextmanager
def triton_launches() -> Iterator[list[tuple[str, float]]]:
    """Record every Triton launch inside the block, compiled or under the interpreter: ``(kernel name, seconds the
    host spent in the launch)`` (on a GPU the launch is asynchronous: the names are what counts; under the
    interpreter the launch is the whole run)."""
    seen: list[tuple[str, float]] = []
    classes: list[Any] = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:  # pragma: no cover
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    originals = [(cls, cls.run) for cls in classes]

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = original(self, *args, **kwargs)
            seen.append(
                (str(getattr(getattr(self, "fn", None), "__name__", "triton kernel")), time.perf_counter() - t0)
            )
            return out

        return run

    for cls, original in originals:
        cls.run = recording(original)
    try:
        yield seen
    finally:
        for cls, original in originals:
            cls.run = original


def record(call: Callable[[], Any], device: torch.device, calls: int = CALLS) -> tuple[list[Launch], str]:
    """The launches of one call (:func:`per_call`) over ``calls`` calls: on a GPU the CUDA profiler's device events;
    on the CPU (Triton's interpreter) the Triton launches, by the host clock."""
    if device.type != "cuda":
        with triton_launches() as seen:
            for _ in range(calls):
                call()
        return per_call([(name, s * 1e3) for name, s in seen], calls)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize(device)
    sequence = device_launches(prof.events())
    if sequence:
        return per_call(sequence, calls)
    averages = [e for e in prof.key_averages() if _is_device(e) and getattr(e, "device_time_total", 0) > 0]
    grouped = [Launch(str(e.key), e.device_time_total / 1e3 / calls, e.count / calls) for e in averages]
    return grouped, "the profiler gave no device events in order: its per-kernel averages, grouped by name"


# ---------------------------------------------------------------------------------------------- stages and floors


def plan_stages(run: OpRun, config: dict[str, Any], prefix: str = "") -> list[wm.StageWork]:
    """The forward's stages (its ``plan()``: :func:`dtune.measure.harness.op_stages`), run once in order, each
    with the Triton kernels seen launching: its first launch carries the stage's work, any further launch of the
    stage (e.g. KDA's exact redo of the steep chunks) none. ``run`` is a forward kernel's (or a backward kernel's:
    the same inputs)."""
    spec = get_kernel(run.kernel)
    fwd = replace(run, kernel=spec.forward_kernel) if spec.backward else run
    out: list[wm.StageWork] = []
    for st in op_stages(fwd, config):
        with triton_launches() as seen:
            st.run()
        names = [name for name, _ in seen] or [st.name]
        work = wm.Work(float(getattr(st, "flops", math.nan)), float(getattr(st, "bytes", math.nan)))
        out.append(wm.StageWork(prefix + st.name, names[0], work))
        out += [wm.StageWork(prefix + st.name, name, wm.Work(0.0, 0.0)) for name in names[1:]]
    return out


def dtune_stages(
    run: OpRun, mode: str, fwd_config: dict[str, Any], bwd_config: dict[str, Any] | None
) -> list[wm.StageWork]:
    """Every stage a call of dtune's op launches, in order, with its kernel and work: the forward's plan, or the
    training step's :func:`~dtune.measure.work.backward_stages` (with ``SAVE = "none"`` the forward under autograd
    is the plain forward: the plan's stages, named ``fwd <stage>``). Configs are full and checked."""
    if mode == "fwd":
        return plan_stages(run, fwd_config)
    assert bwd_config is not None
    w = run.workload
    step = wm.backward_stages(run.shape, run.dtype, fwd_config, bwd_config, w.initial_state, w.final_state)
    if bwd_config["SAVE"] == "none":
        step = plan_stages(run, fwd_config, "fwd ") + [s for s in step if not s.name.startswith("fwd ")]
    return step


# kernels that run a stage in another kernel's place: the state pass in Gluon (STATE_LOOP = "gluon") is the state pass,
# the reverse pass in Gluon (dh_LOOP = "gluon") the reverse pass, the dq/dk stage in Gluon (dqk_LOOP) the dq/dk stage
SAME_STAGE = {
    "chunk_state_ws_kernel": "chunk_state_kernel",
    "chunk_bwd_state_ws_kernel": "chunk_bwd_state_kernel",
    "chunk_bwd_dqk_ws_kernel": "chunk_bwd_dqk_kernel",
}


def match_stages(
    launches: Sequence[Launch], stages: Sequence[wm.StageWork]
) -> tuple[list[str | None], list[wm.StageWork]]:
    """Each launch's stage (None: no stage) and the stages no launch matched, matching in order by kernel name.

    A launch takes the next stage (from the last one taken) whose kernel it is; a launch of a kernel no later stage
    names joins the stage that launched that kernel last (an extra launch of that stage); a launch of a kernel no
    stage names has none."""
    owner: list[str | None] = []
    taken = [False] * len(stages)
    last: dict[str, str] = {}
    cursor = 0
    for launch in launches:
        name = SAME_STAGE.get(launch.name, launch.name)
        j = next((j for j in range(cursor, len(stages)) if stages[j].kernel == name), None)
        if j is None:
            owner.append(last.get(name))
            continue
        taken[j] = True
        cursor = j + 1
        last[name] = stages[j].name
        owner.append(stages[j].name)
    return owner, [s for s, t in zip(stages, taken) if not t]


def launch_rows(
    launches: Sequence[Launch],
    stages: Sequence[wm.StageWork] | None,
    roofs: wm.Roofs | None,
    op_work: wm.Work,
    call_ms: float,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One contestant's table: with ``stages`` (dtune) one row per launch, in order, with its stage, and on a
    stage's first launch the stage's time, work and floor; without (a peer) one row per kernel name. Then the
    whole call's row (its median against the whole op's floor). Returns the rows and notes (stages not launched)."""
    notes: list[str] = []
    rows: list[dict[str, Any]]
    if stages is None:
        launches = by_name(launches)
        owner: list[str | None] = [None] * len(launches)
    else:
        owner, missing = match_stages(launches, stages)
        notes += [f"modelled stage {s.name!r} ({s.kernel}) was not launched" for s in missing if s.work.bytes > 0]
    total = sum(x.ms for x in launches)
    stage_ms: dict[str, float] = {}
    for x, st in zip(launches, owner):
        if st is not None:
            stage_ms[st] = stage_ms.get(st, 0.0) + x.ms
    stage_work: dict[str, wm.Work] = {}
    for s in stages or ():
        stage_work[s.name] = stage_work.get(s.name, wm.Work(0.0, 0.0)) + s.work
    rows = []
    shown: set[str] = set()
    for i, (x, st) in enumerate(zip(launches, owner), start=1):
        row: dict[str, Any] = {
            "position": i,
            "launch": x.name,
            "count": x.count,
            "ms": x.ms,
            "share": x.ms / total if total > 0 else math.nan,
            "stage": st or "",
        }
        if st is not None and st not in shown:  # the stage's time, work and floor on its first launch
            shown.add(st)
            row |= _against_floor(stage_ms[st], stage_work[st], roofs)
            row["stage_ms"] = stage_ms[st]
        rows.append(row)
    whole = {"position": 0, "launch": CALL, "count": sum(x.count for x in launches), "ms": call_ms, "share": math.nan}
    rows.append(whole | {"stage": ""} | _against_floor(call_ms, op_work, roofs))
    for row in rows:
        row["launches_ms"] = total
        row["call_ms"] = call_ms
    return rows, notes


def _against_floor(ms: float, w: wm.Work, roofs: wm.Roofs | None) -> dict[str, Any]:
    floor = roofs.floor_ms(w) if roofs is not None and w.bytes > 0 else math.nan
    return {
        "flops": w.flops,
        "bytes": w.bytes,
        "floor_ms": floor,
        "x_floor": ms / floor if floor > 0 else math.nan,
        "bound": roofs.bound(w) if roofs is not None and w.bytes > 0 else "",
    }


# ---------------------------------------------------------------------------------------------- the profile


@dataclass
class LaunchResult:
    frame: pd.DataFrame
    notes: list[str]
    roofs: wm.Roofs | None


def op_name(kernel: str) -> str:
    """The forward op of ``kernel`` (``chunk_kda_bwd`` -> ``chunk_kda``; a forward kernel is its own)."""
    spec = get_kernel(kernel)
    return spec.forward_kernel if spec.backward else kernel


def step_kernel(op: str, mode: str) -> str:
    """The kernel a mode measures: the forward op itself, or for ``fwd+bwd`` its backward (the training step)."""
    forward = op_name(op)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "fwd":
        return forward
    bwd = get_kernel(forward).backward_kernel
    if bwd is None:
        raise ValueError(f"{forward} has no backward: mode fwd+bwd needs a chunk kernel")
    return bwd


def _dtune_configs(run: OpRun, impl_config: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The full forward and backward configs of dtune's call with ``impl_config`` (a backward kernel's: the backward
    config, the forward's from the store as the op picks it)."""
    from dtune.store import tuned_config

    spec = get_kernel(run.kernel)
    p = run.shape
    if not spec.backward:
        return spec.check_config(p.K, p.V, impl_config or {}), None
    op = get_kernel(spec.forward_kernel)
    fwd = op.check_config(p.K, p.V, tuned_config(op.name, p, run.dtype, run.device))
    return fwd, spec.check_config(p.K, p.V, impl_config or {})


def profile_launches(
    op: str,
    p: Shape,
    dtype: torch.dtype = torch.bfloat16,
    modes: Sequence[str] = MODES,
    baselines: Sequence[str] = ("fla", "flashqla"),
    config_file: str | Path | None = None,
    device: torch.device | str | None = None,
    roofs: wm.Roofs | None = None,
    calls: int | None = None,
    workload: Workload = DEFAULT_WORKLOAD,
    progress: Callable[[str], None] | None = None,
) -> LaunchResult:
    """Every launch of dtune's call (the tuned config; ``baselines`` may add ``default``) and of each peer's, per
    mode (``fwd``: the forward; ``fwd+bwd``: the training step), on shape ``p``."""
    device = torch.device(device or ("cpu" if interpreting() or not torch.cuda.is_available() else "cuda"))
    on_gpu = device.type == "cuda"
    calls = calls or (CALLS if on_gpu else 2)
    notes: list[str] = []
    if on_gpu:
        roofs = wm.Roofs.from_ceilings(ceilings(device))
    else:
        notes.append("no GPU: launches are Triton's under the interpreter, timed by the host clock (NOT meaningful)")
    source = ConfigSource.load(config_file)
    frames = []
    for mode in modes:
        kernel = step_kernel(op, mode)
        run = op_run(kernel, p, dtype, device, workload)
        config, where = source.resolve(kernel, run.shape, dtype, device)
        impls, impl_notes = build_impls(kernel, list(baselines), config, where, on_gpu, run.shape, dtype)
        notes += [n for n in impl_notes if n not in notes]
        for impl in impls:
            if progress:
                progress(f"{impl.name} {mode} {kernel}")
            rows, row_notes = _contestant(run, impl, mode, calls, roofs)
            notes += [f"{impl.name} {mode}: {n}" for n in row_notes]
            frame = pd.DataFrame(rows)
            s = run.shape
            ident: dict[str, Any] = {"kernel": op_name(op), "impl": impl.name}
            ident |= {"mode": mode, "dtype": dtype_name(dtype), "B": s.B, "T": s.T, "H": s.H, "HV": s.HV}
            ident |= {"K": s.K, "V": s.V, "N": s.N, "meaningful": on_gpu}
            ident |= {"roof_gbs": roofs.gbs if roofs else math.nan, "roof_tflops": roofs.tflops if roofs else math.nan}
            ident |= {"roof_source": roofs.source if roofs else ""}
            ident |= {"config_source": impl.config_source}
            for col, val in ident.items():
                frame[col] = val
            if "config" not in frame.columns:
                frame["config"] = json.dumps(impl.config, sort_keys=True) if impl.config is not None else ""
            frames.append(frame)
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    frame["commit"] = git_commit()
    for col in COLUMNS:
        if col not in frame.columns:
            frame[col] = math.nan if col not in ("stage", "bound", "note", "config", "config_source") else ""
    return LaunchResult(frame[COLUMNS], notes, roofs)


def _contestant(
    run: OpRun, impl: Any, mode: str, calls: int, roofs: wm.Roofs | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """One contestant's rows: warm up (compile, autotune), record its launches, time the whole call; dtune's
    launches against their stages. A contestant that fails gets one row with the error."""
    device = run.device
    try:
        call = impl.make(run.inputs)
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first = time.perf_counter() - t0
        launches, note = record(call, device, calls)
        call_ms = time_call(call, device).median_ms
        stages, config = None, None
        if impl.name in DTUNE_IMPLS:
            fwd, bwd = _dtune_configs(run, impl.config)
            stages = dtune_stages(run, mode, fwd, bwd)
            config = json.dumps(fwd if bwd is None else {"fwd": fwd, "bwd": bwd}, sort_keys=True)
    except Exception as exc:  # e.g. a peer that cannot run this shape: its row says why
        text = str(exc).strip()
        why = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]
        return [{"position": 0, "launch": CALL, "ms": math.nan, "note": why, "stage": ""}], []
    rows, notes = launch_rows(launches, stages, roofs, run.work, call_ms)
    for row in rows:
        row["first_call_s"] = first
        row["note"] = impl.note if row["position"] == 0 else ""
        if config is not None:
            row["config"] = config  # the full configs dtune launched (fwd+bwd: both)
    return rows, ([note] if note else []) + notes


def write(result: LaunchResult, out_dir: str | Path) -> tuple[Path, Path]:
    """``launches.csv`` and ``launches.json`` (records) into ``out_dir``."""
    return write_table(result.frame, out_dir, "launches")


# ---------------------------------------------------------------------------------------------- printed tables

NAME_WIDTH = 60  # printed kernel names are cut here (fla's PyTorch kernels have templated names of 200 characters)
HEADERS = ["#", "launch", "×", "ms", "share", "stage", "stage ms", "floor ms", "× floor"]


def _cell(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)) or x == "":
        return ""
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def tables(frame: pd.DataFrame) -> list[tuple[str, list[str], list[list[str]]]]:
    """The printed form of a launches frame: one ``(title, headers, rows)`` per kernel, shape, mode and contestant.
    dtune's launches in launch order, each with its stage and, on a stage's first launch, the stage's time against
    its floor; a peer's kernels by time (most first); last the whole call against the whole op's floor."""
    out = []
    keys = ["kernel", "B", "T", "H", "K", "V", "mode", "impl"]
    for key, grp in frame.groupby(keys, sort=False, dropna=False):
        kernel, B, T, H, K, V, mode, impl = key
        whole = grp[grp["launch"] == CALL].iloc[0]
        body = grp[grp["launch"] != CALL]
        if impl not in DTUNE_IMPLS:
            body = body.sort_values("ms", ascending=False)
        d = f"D{K}" if K == V else f"K{K} V{V}"
        title = f"{impl} {kernel} B{B} T{T} H{H} {d} {mode}: "
        if pd.isna(whole["ms"]):
            title += f"failed ({whole['note']})"
        else:
            title += f"call {whole['call_ms']:.3f} ms, launches {whole['launches_ms']:.3f} ms"
            if pd.notna(whole["floor_ms"]):
                title += f"; the op's floor {whole['floor_ms']:.3f} ms ({whole['bound']}-bound)"
        star = "" if bool(whole["meaningful"]) else "*"
        rows = []
        for r in [*body.to_dict("records"), whole.to_dict()]:
            name = str(r["launch"])
            rows.append(
                [
                    _cell(int(r["position"]), "d") if r["launch"] != CALL else "",
                    name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…",
                    _cell(r["count"], ".3g"),
                    _cell(r["ms"], ".4f") + (star if pd.notna(r["ms"]) else ""),
                    _cell(100 * r["share"], ".0f") + ("%" if pd.notna(r["share"]) else ""),
                    str(r["stage"] or ""),
                    _cell(r["stage_ms"], ".4f"),
                    _cell(r["floor_ms"], ".4f"),
                    _cell(r["x_floor"], ".1f") + ("×" if pd.notna(r["x_floor"]) else ""),
                ]
            )
        out.append((title, list(HEADERS), rows))
    return out
