"""The measurement harness: one op call on one shape and workload, as every measurement in dtune times it.

:func:`op_run` builds the inputs (:func:`dtune.measure.inputs.workload_inputs`, :data:`TIMING_SEED`) and the nominal
work (:mod:`dtune.measure.work`) of one call; :meth:`OpRun.call` is the call itself with a config, through the public
entry point :func:`dtune.ops.run_kernel`: the default call a user makes (input and config checks included, as
users pay them; the opt-in check of the gate's values is off by default, ``dtune bench`` times it in a row of its
own). The search's trials, ``dtune bench``, ``dtune profile`` and the GPU scripts all time an ``OpRun`` with
:func:`dtune.measure.timing.time_call`, so a config's time in ``trials.csv`` and in ``dtune bench`` is the same
measurement of the same workload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from dtune.measure.grad import StepResult, with_output_grads
from dtune.measure.inputs import DEFAULT_WORKLOAD, TIMING_SEED, Workload, workload_inputs
from dtune.measure.work import Work, work
from dtune.shape import Gate, Shape

# a forward call's (o, final_state); a backward kernel's training step returns a StepResult (o, final_state, grads)
Result = tuple[torch.Tensor, torch.Tensor | None] | StepResult


class Stage(Protocol):
    """One named launch (or launch group) of a call, runnable alone once the launches before it ran: the contract of
    a template family's ``plan()`` (the chunk pipeline's ``intra``, ``state``, ...)."""

    name: str
    flops: float
    bytes: float

    def run(self) -> Any: ...


@dataclass
class OpStage:
    """The whole op as one stage (a template without ``plan()``, e.g. the fused-recurrent kernels)."""

    name: str
    run: Callable[[], Any]
    flops: float
    bytes: float


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


def op_call(kernel: str, x: dict[str, Any], config: dict[str, Any] | None, **options: Any) -> Callable[[], Result]:
    """``dtune.ops.run_kernel(kernel, **x, config=config)`` as a zero-argument call: the default call (``options``:
    keywords of the op to add, e.g. ``check_gate=True``); for a backward kernel (``chunk_kda_bwd``) the training
    step of its forward op with ``config`` as the backward config (:func:`dtune.measure.grad.op_step`: it returns a
    :class:`~dtune.measure.grad.StepResult`, ``(o, ...)``)."""
    from dtune.kernels import get_kernel
    from dtune.ops import run_kernel

    spec = get_kernel(kernel)
    if spec.backward:
        from dtune.measure.grad import op_step

        return op_step(spec.forward_kernel, x, config, **options)
    return lambda: run_kernel(kernel, **x, config=config, **options)


def op_run(
    kernel: str,
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device | str,
    workload: Workload = DEFAULT_WORKLOAD,
    seed: int = TIMING_SEED,
    values: bool = True,
) -> OpRun:
    """Inputs and work of one call of ``kernel`` on ``shape`` (its gate mode set from the kernel) and ``workload``;
    a backward kernel's inputs also hold the output gradients of its step (``do``, ``dht``). ``values=False``: the
    inputs uninitialised (a call that only compiles)."""
    from dtune.kernels import get_kernel

    spec = get_kernel(kernel)
    shape = workload.shape(replace(shape, gate=Gate(spec.gate)))
    device = torch.device(device)
    x = workload_inputs(shape, dtype, device, workload, seed, values=values)
    if spec.backward:
        x = with_output_grads(x, values=values)
    w = work(kernel, shape, dtype, workload.initial_state, workload.final_state)
    return OpRun(kernel, shape, dtype, device, workload, x, w)


def op_stages(run: OpRun, config: dict[str, Any]) -> list[Stage]:
    """The launches of one call with a full, checked ``config``, in order, each runnable alone on ``run``'s inputs.

    A template family that has ``plan(q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens,
    config)`` (the chunk pipeline) gives its named stages, which allocate their buffers once: run them in order once
    before timing any one alone. Any other kernel is one stage named after it. Stage names are the family's data
    (a search space maps them to its stages); nothing here knows them. A backward kernel's stages are its training
    step's (:func:`dtune.measure.grad.op_step_stages`).
    """
    from dtune.kernels import get_kernel

    spec = get_kernel(run.kernel)
    if spec.backward:  # its training step: the forward under autograd, then each backward launch
        from dtune.measure.grad import op_step_stages

        return op_step_stages(run.kernel, run.inputs, config)
    plan = getattr(spec.module, "plan", None)
    if plan is None:
        return [OpStage(run.kernel, run.call(config), run.work.flops, run.work.bytes)]
    x = run.inputs
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], spec.gate, x["scale"], x["initial_state"])
    stages, _ = plan(*args, x["output_final_state"], x["cu_seqlens"], config)
    return list(stages)
