"""One trial, in-process: compile (first launch) -> gate -> time, with failures typed instead of raised.

:func:`evaluate` is what the worker subprocess runs for each job; it never raises for a bad config: the
outcome names the reason (``compile``, ``resources``, ``gate``, ``runtime``). The parent adds the reasons
it sees from outside (``constraint``, ``timeout``, ``crash``).

Resource usage (registers, spills, shared memory) comes from the ``CompiledKernel`` objects that Triton's
``JITFunction.run`` returns during the first launch; with several launches per call the maximum registers
and shared memory and the total spills are recorded. Under the interpreter there are none: None.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dtune.cost import nominal_bytes, nominal_flops
from dtune.gate import edge_inputs, gate
from dtune.inputs import Gate, Problem, dtype_from_name, make_inputs

REASONS = ("constraint", "compile", "resources", "gate", "timeout", "crash", "runtime", "cancelled")
TIMING_SEED = 1234


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
    warmup: int = 5
    repeats: int = 50
    max_seconds: float = 5.0
    timing: str = "events"  # events: CUDA events, L2 flushed | graph: CUDA-graph replays (no launch overhead)
    compile_only: bool = False  # build the kernels (Triton's warmup: no launch) and stop: the compile pool's job

    def problem(self, gate_mode: str) -> Problem:
        s = self.shape
        return Problem(B=s["B"], T=s["T"], H=s["H"], HV=s["HV"], K=s["K"], V=s["V"], N=s["B"], gate=Gate(gate_mode))


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
def capture_launches() -> Iterator[list[Any]]:
    """Collect the CompiledKernel of every Triton launch inside the block (none under the interpreter)."""
    launched: list[Any] = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        yield launched
        return
    original = JITFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = original(self, *args, **kwargs)
        launched.append(kernel)
        return kernel

    JITFunction.run = run
    try:
        yield launched
    finally:
        JITFunction.run = original


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


def resources_of(launched: list[Any]) -> tuple[int | None, int | None, int | None]:
    """(max registers per thread, total spills, max shared memory bytes) of the launched kernels."""
    regs = [getattr(k, "n_regs", None) for k in launched]
    spills = [getattr(k, "n_spills", None) for k in launched]
    shared = [getattr(getattr(k, "metadata", None), "shared", None) for k in launched]
    r = [int(x) for x in regs if isinstance(x, int)]
    s = [int(x) for x in spills if isinstance(x, int)]
    m = [int(x) for x in shared if isinstance(x, int)]
    return (max(r) if r else None, sum(s) if s else None, max(m) if m else None)


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
    from dtune.ops import run_kernel

    spec = get_kernel(job.kernel)
    problem = job.problem(spec.gate)
    dtype = dtype_from_name(job.dtype)
    device = torch.device(job.device)
    try:
        config = spec.check_config(problem.K, problem.V, job.config)
    except (ValueError, TypeError) as e:
        return TrialOutcome(reason="compile", message=f"illegal config: {e}")
    x = make_inputs(problem, dtype=dtype, device=device, seed=TIMING_SEED, initial_state=True)

    def call() -> Any:
        return run_kernel(job.kernel, **x, output_final_state=True, config=config)

    out = TrialOutcome()
    t0 = time.perf_counter()
    if job.compile_only:
        try:
            with compile_without_launch():
                call()
                # the gate's packed variable-length edge case builds other specialisations (VARLEN): build them
                # here too, or the timing worker compiles them serially (~10 s a trial for the chunk kernels)
                edge = edge_inputs(spec, problem, dtype, device, job.gate_seed)
                run_kernel(job.kernel, **edge, output_final_state=True, config=config)
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
        timing = time_call(call, device, job)
    except Exception as e:
        out.reason, out.message = classify(e, first_launch=False), _message(e)
        return out
    out.time_ms, out.meaningful = timing.median_ms, timing.meaningful
    seconds = timing.median_ms * 1e-3
    if seconds > 0:
        out.gbs = nominal_bytes(problem, dtype, Gate(spec.gate)) / seconds / 1e9
        out.tflops = nominal_flops(problem, Gate(spec.gate)) / seconds / 1e12
    return out


def time_call(call: Any, device: torch.device, job: TrialJob) -> Any:
    """Median time of ``call``: CUDA events with the L2 flushed, or CUDA-graph replays (``job.timing``).

    Graph replays measure the kernel without Python's launch overhead, which otherwise hides the differences
    between configs at decode sizes; if the call cannot be captured, events are used.
    """
    from dtune.measure import time_fn, time_graph

    if job.timing == "graph" and device.type == "cuda":
        try:
            return time_graph(call, device, replays=max(job.repeats, 20) * 4)
        except Exception:
            torch.cuda.synchronize(device)
    return time_fn(call, device, warmup=job.warmup, repeats=job.repeats, max_seconds=job.max_seconds)
