"""One trial, in-process: compile (first launch) -> gate -> time, with failures typed instead of raised.

:func:`evaluate` is what the worker subprocess runs for each job; it never raises for a bad config: the
outcome names the reason (``compile``, ``resources``, ``gate``, ``runtime``; ``memory`` when a whole call's peak
allocation is over the job's ceiling, ``max_memory_mb``: such a config is never exported). The parent adds the reasons
it sees from outside (``constraint``, ``predicted``, ``claimed``, ``timeout``, ``crash``, ``cancelled``,
``interrupted``).

Two kinds of trial (``TrialJob.kind``): ``"whole"`` gates the config (with the variable-length edge case) and times
the whole call (its value) and each stage; ``"stage"`` (a stage-local move of the stage-wise search) gates it on the
tuned shape and times only the moved stage's launches (``TrialJob.stage``). The stages are the launches of the
template's ``plan()`` (:func:`dtune.measure.harness.op_stages`) grouped by the search space's stage map.

A worker process keeps the timed inputs (:func:`timed_run`) and the gate's inputs with their float64 reference
(:func:`dtune.tune.gate.case`) per shape: drawing a real-size input set takes seconds of CPU time, so a trial
that drew its own (as every trial did before) spent most of its time there.

The call is the measurement harness's (:func:`dtune.measure.harness.op_run`): the job's workload (by default an
initial and a final state), timed with :func:`dtune.measure.timing.time_call`, its GB/s and TFLOP/s from the one
work model, its registers, spills and shared memory captured during the first launch
(:mod:`dtune.measure.resources`; None under the interpreter). ``dtune bench`` times the same call.
"""

from __future__ import annotations

import math
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dtune.inputs import dtype_from_name
from dtune.measure.bench import peak_mb
from dtune.measure.builds import watch_builds
from dtune.measure.harness import OpRun, Stage, op_call, op_run, op_stages
from dtune.measure.inputs import Workload
from dtune.measure.resources import capture_launches, resources_of
from dtune.measure.timing import MAX_SECONDS, REPEATS, WARMUP, time_call
from dtune.shape import Shape
from dtune.tune.gate import gate
from dtune.tune.gate_common import edge_inputs
from dtune.tune.stages import StageMap

REASONS = (
    "constraint",
    "predicted",
    "claimed",
    "compile",
    "resources",
    "gate",
    "timeout",
    "crash",
    "runtime",
    "memory",
    "cancelled",
    "interrupted",
)
# Reasons that say nothing about the config (the trial never ran to its end): such a config is not blocked for
# later trials (no duplicate copies this result) and is retried on --resume.
RETRYABLE = ("cancelled", "interrupted")
KINDS = ("whole", "stage")


@dataclass(frozen=True)
class TrialJob:
    """Everything a worker needs to evaluate one config (JSON-serialisable)."""

    kernel: str
    shape: dict[str, int]  # B, T, H, HV, K, V
    dtype: str  # fp32 | fp16 | bf16
    config: dict[str, Any]
    tolerance: float
    gate_seed: int = 0
    determinism: bool = False
    device: str = "cuda"
    warmup: int = WARMUP
    repeats: int = REPEATS
    max_seconds: float = MAX_SECONDS
    timing: str = "events"  # events: CUDA events, L2 flushed | graph: CUDA-graph replays (no launch overhead)
    compile_only: bool = False  # build the kernels (Triton's warmup: no launch) and stop: the compile pool's job
    initial_state: bool = True  # the timed workload (dtune.measure.inputs.Workload)
    final_state: bool = True
    kind: str = "whole"  # whole: full gate, whole call and every stage timed | stage: one stage timed (see module)
    stage: str | None = None  # the stage a "stage" trial times
    stage_launches: dict[str, list[str]] = field(default_factory=dict)  # the space's stage map (StageMap.launch_table)
    edge: bool = True  # the gate's variable-length edge case (whole trials)
    reuse_inputs: bool = False  # keep inputs and the gate's reference per shape in this process (the search)
    seq_lens: list[int] | None = None  # a packed variable-length batch (``shape`` is its bucket: B = N, T = mean)
    max_vs_default: float | None = None  # the gate's accuracy criterion (the space's [accuracy] ratio for the dtype)
    max_memory_mb: float | None = None  # a ceiling on the call's peak allocation (MiB above its inputs; CUDA only)

    def workload(self) -> Workload:
        return Workload(self.initial_state, self.final_state, tuple(self.seq_lens) if self.seq_lens else None)


@dataclass
class TrialOutcome:
    """What a trial measured, or why it failed (``reason`` is None for a passing, timed config)."""

    reason: str | None = None
    message: str = ""
    time_ms: float | None = None
    meaningful: bool = True  # False: host-clock timing under the interpreter
    error_o: float | None = None
    error_s: float | None = None
    registers: int | None = None
    spills: int | None = None
    shared_mem: int | None = None
    gbs: float | None = None
    tflops: float | None = None
    peak_mb: float | None = None  # the whole call's peak allocation above what was allocated before it (CUDA)
    compile_s: float | None = None
    stage_ms: dict[str, float] = field(default_factory=dict)  # median ms of each stage timed alone
    stage_resources: dict[str, list[int | None]] = field(default_factory=dict)  # stage: [registers, spills, smem]
    built: int | None = None  # Triton kernels this job compiled (not found in the on-disk cache); None: unknown
    built_kernels: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason is None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialOutcome:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@contextmanager
def compile_without_launch() -> Iterator[None]:
    """Triton launches inside the block only compile (``warmup=True``): kernels land in the on-disk cache.

    Under the interpreter there is nothing to compile and the launches simply run.
    """
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        yield
        return
    original = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


def classify(exc: BaseException, first_launch: bool) -> str:
    """The failure reason of an exception raised while launching."""
    names = {type(c).__name__ for c in type(exc).__mro__}
    if "OutOfResources" in names or isinstance(exc, torch.OutOfMemoryError):
        return "resources"
    if names & {"CompilationError", "PTXASError"}:
        return "compile"
    if "out of resource" in str(exc).lower():
        return "resources"
    return "compile" if first_launch else "runtime"


def _message(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[-2000:]


_RUNS: OrderedDict[tuple[Any, ...], OpRun] = OrderedDict()


def timed_run(job: TrialJob, device: torch.device) -> OpRun:
    """The job's measured call (:func:`dtune.measure.harness.op_run`); with ``reuse_inputs`` kept per shape."""
    shape, dtype, workload = Shape.from_dict(job.shape), dtype_from_name(job.dtype), job.workload()
    if not job.reuse_inputs:
        return op_run(job.kernel, shape, dtype, device, workload)
    key = (job.kernel, shape, dtype, str(device), workload)
    if key not in _RUNS:
        _RUNS[key] = op_run(job.kernel, shape, dtype, device, workload)
        while len(_RUNS) > 2:
            _RUNS.popitem(last=False)
    return _RUNS[key]


def _compile_only(job: TrialJob, device: torch.device) -> TrialOutcome:
    """Build every specialisation the timing worker will launch for this job, launching nothing.

    On a GPU the call's inputs are uninitialised (values do not change what is compiled; drawing them took seconds at
    large shapes) and not kept: the job's peak allocation is measured (``peak_mb``, what :mod:`dtune.tune.memory`
    admits the next compile of the shape by) and everything is freed, so an idle compile worker holds no GPU memory.
    """
    from dtune.kernels import get_kernel

    spec = get_kernel(job.kernel)
    shape, dtype = Shape.from_dict(job.shape), dtype_from_name(job.dtype)
    try:
        config = spec.check_config(shape.K, shape.V, job.config)
    except (ValueError, TypeError) as e:
        return TrialOutcome(reason="compile", message=f"illegal config: {e}")
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    try:
        run = op_run(job.kernel, shape, dtype, device, job.workload(), values=not cuda)
        outcome = _build(job, spec, run, config, t0)
        del run
    except Exception as e:  # the inputs did not fit
        outcome = TrialOutcome(reason=classify(e, first_launch=True), message=_message(e))
    if cuda:
        outcome.peak_mb = (torch.cuda.max_memory_allocated(device) - before) / 2**20
        torch.cuda.empty_cache()
    return outcome


def _build(job: TrialJob, spec: Any, run: OpRun, config: dict[str, Any], t0: float) -> TrialOutcome:
    x = run.inputs
    with watch_builds() as builds:
        try:
            with compile_without_launch():
                run.call(config)()
                if not (job.workload().initial_state and job.workload().final_state):  # the gate: both states
                    h0 = x["initial_state"]
                    if h0 is None:
                        s = run.shape
                        h0 = torch.zeros(s.N, s.HV, s.K, s.V, dtype=torch.float32, device=run.device)
                    op_call(job.kernel, {**x, "initial_state": h0, "output_final_state": True}, config)()
                if job.edge:
                    # the gate's packed variable-length edge case builds other specialisations (VARLEN): build them
                    # here too, or the timing worker compiles them serially (~10 s a trial for the chunk kernels);
                    # its inputs alone: the float64 reference is the timing worker's (the gate's) business
                    edge = edge_inputs(spec, run.shape, run.dtype, run.device, job.gate_seed)
                    op_call(job.kernel, {**edge, "output_final_state": True}, config)()
        except Exception as e:
            return TrialOutcome(reason=classify(e, first_launch=True), message=_message(e))
    return TrialOutcome(
        compile_s=time.perf_counter() - t0,
        built=len(builds.built) if builds.known else None,
        built_kernels=builds.built,
    )


def _group_call(stages: list[Stage]) -> Callable[[], None]:
    def run() -> None:
        for st in stages:
            st.run()

    return run


def evaluate(job: TrialJob) -> TrialOutcome:
    """Compile, gate and time one config; every failure becomes a typed outcome."""
    from dtune.kernels import get_kernel

    if job.kind not in KINDS or (job.kind == "stage" and not job.stage):
        return TrialOutcome(reason="crash", message=f"bad trial job: kind {job.kind!r}, stage {job.stage!r}")
    spec = get_kernel(job.kernel)
    device = torch.device(job.device)
    if job.compile_only:
        return _compile_only(job, device)
    run = timed_run(job, device)
    problem = run.shape
    try:
        config = spec.check_config(problem.K, problem.V, job.config)
    except (ValueError, TypeError) as e:
        return TrialOutcome(reason="compile", message=f"illegal config: {e}")
    t0 = time.perf_counter()

    out = TrialOutcome()
    stage_map = StageMap.from_table(job.stage_launches)
    launched_by: dict[str, list[Any]] = {}
    with watch_builds() as builds:
        try:
            stages = op_stages(run, config)
            for st in stages:  # the first launch of each stage, in order (compiles or loads its kernels)
                with capture_launches() as launched:
                    returned = st.run()
                launched_by.setdefault(stage_map.stage_of_launch(st.name), []).extend(launched or [returned])
        except Exception as e:
            return TrialOutcome(reason=classify(e, first_launch=True), message=_message(e))
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # an illegal address surfaces here: the kernel built, then failed
        except Exception as e:
            return TrialOutcome(reason=classify(e, first_launch=False), message=_message(e))
        out.compile_s = time.perf_counter() - t0
        out.registers, out.spills, out.shared_mem = resources_of(k for ks in launched_by.values() for k in ks)
        out.stage_resources = {name: list(resources_of(ks)) for name, ks in launched_by.items()}

        try:
            result = gate(
                spec,
                problem,
                run.dtype,
                device,
                config,
                job.tolerance,
                seed=job.gate_seed,
                determinism=job.determinism,
                edge=job.edge,
                reuse=job.reuse_inputs,
                seq_lens=job.workload().seq_lens,
                max_vs_default=job.max_vs_default,
            )
        except Exception as e:
            out.reason, out.message = classify(e, first_launch=False), _message(e)
            return out
    out.built = len(builds.built) if builds.known else None
    out.built_kernels = builds.built
    out.error_o, out.error_s = result.error_o, result.error_s
    if not result.passed:
        out.reason, out.message = "gate", result.reason or "gate failed"
        return out

    if job.kind == "whole" and (device.type == "cuda" or job.max_memory_mb is not None):
        try:
            peak = peak_mb(run.call(config), device)  # NaN where unknown (not a CUDA device)
        except Exception as e:
            out.reason, out.message = classify(e, first_launch=False), _message(e)
            return out
        out.peak_mb = peak if math.isfinite(peak) else None
        if job.max_memory_mb is not None and out.peak_mb is not None and out.peak_mb > job.max_memory_mb:
            out.reason = "memory"
            out.message = f"peak allocation {out.peak_mb:.0f} MiB over the ceiling of {job.max_memory_mb:g} MiB"
            return out
    groups = stage_map.group(st.name for st in stages)
    by_name = {st.name: st for st in stages}
    timed = [job.stage] if job.kind == "stage" else list(groups)
    try:
        if job.kind == "whole":
            timing = time_call(run.call(config), device, job.timing, job.warmup, job.repeats, job.max_seconds)
            out.time_ms, out.meaningful = timing.median_ms, timing.meaningful
            if timing.median_ms > 0:
                out.gbs, out.tflops = run.work.gbs(timing.median_ms), run.work.tflops(timing.median_ms)
        for name in timed:
            if name not in groups:
                out.reason, out.message = "runtime", f"this config launches no stage {name!r}"
                return out
            call = _group_call([by_name[n] for n in groups[name]])
            st_timing = time_call(call, device, job.timing, job.warmup, job.repeats, job.max_seconds)
            out.stage_ms[name] = st_timing.median_ms
            out.meaningful = out.meaningful and st_timing.meaningful
    except Exception as e:
        out.reason, out.message = classify(e, first_launch=False), _message(e)
        return out
    return out
