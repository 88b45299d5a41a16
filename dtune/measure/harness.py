"""The measurement harness: one op call on one shape and workload, as every measurement in dtune times it.

:func:`op_run` builds the inputs (:func:`dtune.measure.inputs.workload_inputs`, :data:`TIMING_SEED`) and the nominal
work (:mod:`dtune.measure.work`) of one call; :meth:`OpRun.call` is the call itself with a config, through the public
entry point :func:`dtune.ops.run_kernel` (input checks and config checks included, as users pay them, except the
check of the gate's values, ``check_gate=False``: the harness draws valid gates, and fla checks nothing). The
search's trials, ``dtune bench``, ``dtune profile`` and the GPU scripts all time an ``OpRun`` with
:func:`dtune.measure.timing.time_call`, so a config's time in ``trials.csv`` and in ``dtune bench`` is the same
measurement of the same workload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from dtune.measure.inputs import DEFAULT_WORKLOAD, TIMING_SEED, Workload, workload_inputs
from dtune.measure.work import Work, work
from dtune.shape import Gate, Shape

Result = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class OpRun:
    """One measured call: its kernel, the shape it really has (the workload applied), inputs and nominal work."""

    kernel: str
    shape: Shape
    dtype: torch.dtype
    device: torch.device
    workload: Workload
    inputs: dict[str, Any]
    work: Work

    def call(self, config: dict[str, Any] | None) -> Callable[[], Result]:
        """A zero-argument call of the op on these inputs with ``config`` (None: what the ops would pick)."""
        return op_call(self.kernel, self.inputs, config)


def op_call(kernel: str, x: dict[str, Any], config: dict[str, Any] | None) -> Callable[[], Result]:
    """``dtune.ops.run_kernel(kernel, **x, config=config, check_gate=False)`` as a zero-argument call."""
    from dtune.ops import run_kernel

    return lambda: run_kernel(kernel, **x, config=config, check_gate=False)


def op_run(
    kernel: str,
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    workload: Workload = DEFAULT_WORKLOAD,
    seed: int = TIMING_SEED,
) -> OpRun:
    """Inputs and work of one call of ``kernel`` on ``shape`` (its gate mode set from the kernel) and ``workload``."""
    from dtune.kernels import get_kernel

    shape = workload.shape(replace(shape, gate=Gate(get_kernel(kernel).gate)))
    device = torch.device(device)
    x = workload_inputs(shape, dtype, device, workload, seed)
    w = work(kernel, shape, dtype, workload.initial_state, workload.final_state)
    return OpRun(kernel, shape, dtype, device, workload, x, w)
