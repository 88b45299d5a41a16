"""GPU memory for the compile-ahead workers: how many of them may hold a shape's buffers at once.

A compile-ahead job runs the op's host code at the trial's full shape (launches only compile), so it allocates the
call's inputs, outputs and intermediates on the GPU while it builds, and used to keep its inputs after. At 32768
tokens with K = V = 256 (chunk_kda, an H100, `dtune tune-gpu`) fourteen compile workers held 1.3-5.7 GB each, 54 GB
beside the timing worker's 24.6 GB (its gate's float64 reference): compiles ran out of memory and 3 of the bucket's 8
trials failed. :class:`CompileMemory` admits a job while the jobs in flight fit a budget (half the GPU by default:
the timing worker, the gate's float64 reference and the baselines keep the rest), weighing each job by the peak its
shape's last compile measured (``TrialOutcome.peak_mb``), or before one has, by an estimate from the call's
compulsory bytes. One job is always admitted, whatever its weight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from dtune.tune.trials import TrialJob, TrialOutcome

BUDGET_FRACTION = 0.5  # of the GPU's memory, for the compile workers together
ESTIMATE_FACTOR = 3.0  # a compile's peak per byte of the call's compulsory traffic, before one is measured
MEASURED_MARGIN = 1.1  # on a measured peak (the next config of the shape may allocate a little more)
POLL_S = 0.5  # how often a waiting job checks whether it is still wanted


def gpu_budget(fraction: float = BUDGET_FRACTION) -> int | None:
    """``fraction`` of CUDA device 0's memory in bytes (the compile workers' device), None without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(fraction * torch.cuda.get_device_properties(0).total_memory)


def shape_key(job: TrialJob) -> tuple[Any, ...]:
    """What a compile's memory depends on: kernel, dtype, shape, packed lengths and workload (not the config)."""
    return (job.kernel, job.dtype, tuple(sorted(job.shape.items())), tuple(job.seq_lens or ()), job.workload())


def estimate_bytes(job: TrialJob) -> int:
    """A first guess at a compile job's peak GPU memory: :data:`ESTIMATE_FACTOR` times the call's compulsory bytes
    (:func:`dtune.measure.work.work`: inputs, outputs, states; the intermediates come on top); 0 for a kernel without
    a work model."""
    from dtune.kernels import get_kernel

    from dtune.inputs import dtype_from_name
    from dtune.measure.work import work
    from dtune.shape import Gate, Shape

    try:
        shape = Shape.from_dict(job.shape, Gate(get_kernel(job.kernel).gate))
        w = job.workload()
        moved = work(job.kernel, shape, dtype_from_name(job.dtype), w.initial_state, w.final_state).bytes
    except Exception:  # a plugin kernel without a work model: admitted freely until its first compile measures it
        return 0
    return int(ESTIMATE_FACTOR * moved)


class CompileMemory:
    """Admission of compile jobs against a byte ``budget`` (None: no limit)."""

    def __init__(self, budget: int | None, estimate: Callable[[TrialJob], int] = estimate_bytes) -> None:
        self.budget = budget
        self._estimate = estimate
        self._peaks: dict[tuple[Any, ...], int] = {}
        self._in_use = 0
        self._cond = threading.Condition()

    def weight(self, job: TrialJob) -> int:
        """The bytes ``job`` is counted for: its shape's measured peak with a margin, else the estimate."""
        if self.budget is None:
            return 0
        peak = self._peaks.get(shape_key(job))
        return int(MEASURED_MARGIN * peak) if peak is not None else self._estimate(job)

    def acquire(self, weight: int, wanted: Callable[[], bool] = lambda: True) -> bool:
        """Wait until ``weight`` bytes fit beside the jobs in flight (or none is in flight); False, holding nothing,
        when ``wanted()`` turns false first."""
        with self._cond:
            while self.budget is not None and self._in_use > 0 and self._in_use + weight > self.budget:
                if not wanted():
                    return False
                self._cond.wait(POLL_S)
            self._in_use += weight
            return True

    def release(self, weight: int, job: TrialJob | None = None, outcome: TrialOutcome | None = None) -> None:
        """Give ``weight`` back; learn ``job``'s shape peak from a compile ``outcome`` that measured one."""
        with self._cond:
            self._in_use -= weight
            if job is not None and outcome is not None and outcome.peak_mb is not None:
                key = shape_key(job)
                self._peaks[key] = max(self._peaks.get(key, 0), int(outcome.peak_mb * 2**20))
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        return self._in_use
