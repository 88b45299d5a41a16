"""One trial, in-process: compile (first launch) -> gate -> time, with failures typed instead of raised.

:func:`evaluate` is what the worker subprocess runs for each job; it never raises for a bad config: the
outcome names the reason (``compile``, ``resources``, ``gate``, ``runtime``). The parent adds the reasons
it sees from outside (``constraint``, ``timeout``, ``crash``).

The call is the measurement harness's (:func:`dtune.measure.harness.op_run`): the job's workload (by default an
initial and a final state), timed with :func:`dtune.measure.timing.time_call`, its GB/s and TFLOP/s from the one
work model, its registers, spills and shared memory captured during the first launch
(:mod:`dtune.measure.resources`; None under the interpreter). ``dtune bench`` times the same call.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dtune.inputs import dtype_from_name
from dtune.measure.harness import op_call, op_run
from dtune.measure.inputs import Workload
from dtune.measure.resources import capture_launches, resources_of
from dtune.measure.timing import MAX_SECONDS, REPEATS, WARMUP, time_call
from dtune.shape import Shape
from dtune.tune.gate import edge_inputs, gate

REASONS = ("constraint", "compile", "resources", "gate", "timeout", "crash", "runtime", "cancelled")


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

    def workload(self) -> Workload:
        return Workload(self.initial_state, self.final_state)


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
    compile_s: float | None = None
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


def evaluate(job: TrialJob) -> TrialOutcome:
    """Compile, gate and time one config; every failure becomes a typed outcome."""
    from dtune.kernels import get_kernel

    spec = get_kernel(job.kernel)
    dtype = dtype_from_name(job.dtype)
    device = torch.device(job.device)
    run = op_run(job.kernel, Shape.from_dict(job.shape), dtype, device, job.workload())
    problem = run.shape
    try:
        config = spec.check_config(problem.K, problem.V, job.config)
    except (ValueError, TypeError) as e:
        return TrialOutcome(reason="compile", message=f"illegal config: {e}")
    call = run.call(config)

    out = TrialOutcome()
    t0 = time.perf_counter()
    if job.compile_only:
        try:
            with compile_without_launch():
                call()
                # the gate's packed variable-length edge case builds other specialisations (VARLEN): build them
                # here too, or the timing worker compiles them serially (~10 s a trial for the chunk kernels)
                edge = edge_inputs(spec, problem, dtype, device, job.gate_seed)
                op_call(job.kernel, {**edge, "output_final_state": True}, config)()
        except Exception as e:
            return TrialOutcome(reason=classify(e, first_launch=True), message=_message(e))
        return TrialOutcome(compile_s=time.perf_counter() - t0)
    try:
        with capture_launches() as launched:
            call()
    except Exception as e:
        return TrialOutcome(reason=classify(e, first_launch=True), message=_message(e))
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an illegal address surfaces here: the kernel built, then failed
    except Exception as e:
        return TrialOutcome(reason=classify(e, first_launch=False), message=_message(e))
    out.compile_s = time.perf_counter() - t0
    out.registers, out.spills, out.shared_mem = resources_of(launched)

    try:
        result = gate(
            spec, problem, dtype, device, config, job.tolerance, seed=job.gate_seed, determinism=job.determinism
        )
    except Exception as e:
        out.reason, out.message = classify(e, first_launch=False), _message(e)
        return out
    out.error_o, out.error_s = result.error_o, result.error_s
    if not result.passed:
        out.reason, out.message = "gate", result.reason or "gate failed"
        return out

    try:
        timing = time_call(call, device, job.timing, job.warmup, job.repeats, job.max_seconds)
    except Exception as e:
        out.reason, out.message = classify(e, first_launch=False), _message(e)
        return out
    out.time_ms, out.meaningful = timing.median_ms, timing.meaningful
    if timing.median_ms > 0:
        out.gbs, out.tflops = run.work.gbs(timing.median_ms), run.work.tflops(timing.median_ms)
    return out
