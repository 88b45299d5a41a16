"""The chunk forward, orchestrated: prepare the call, allocate, launch the stages in order.

``intra`` → [``transitions`` → ``segment-starts``, only with ``SEG_CHUNKS``] → ``state`` (or ``state+output``) →
[``output``, only without ``FUSE_OUTPUT``]. Each stage's launcher lives beside its kernel; the buffers in
:mod:`.buffers`; the work model in :mod:`.cost`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .. import launches as launch_cache
from ..config import Config
from ..options import NO_IN_KERNEL, InKernel
from .buffers import Intermediates, Outputs, SegmentScratch, allocate, allocate_segments, tensors_of
from .call import ChunkCall, prepare_call
from .cost import stage_costs
from .intra import launch_intra_rows
from .intra_blocks import launch_intra_blocks
from .intra_kda import launch_intra_onepass
from .output import launch_output
from .segments import launch_segment_starts
from .state import burns_in, launch_state, launch_transitions

Tensor = torch.Tensor


@dataclass
class Stage:
    """One kernel launch of the pipeline, for the profiler: ``run()`` launches it and returns the compiled kernel."""

    name: str
    run: Callable[[], Any]
    flops: float
    bytes: float


@dataclass
class ForwardResult:
    """What :func:`forward_with_intermediates` returns: the outputs and every intermediate of the forward."""

    o: Tensor  # [B, T, HV, V], v's dtype
    final_state: Tensor | None  # [N, HV, K, V] float32, or None unless asked for
    intermediates: Intermediates
    call: ChunkCall  # the prepared call: shape, config, chunk tables (chunk_info, chunk_offsets) for the backward


def _launchers(
    call: ChunkCall,
) -> tuple[list[tuple[str, Callable[[], Any]]], Intermediates, Outputs, SegmentScratch | None]:
    """Allocate every buffer of ``call``; return its stages' names and launches (to run in order) and the buffers."""
    inter, out = allocate(call)
    scratch = None if burns_in(call.config) else allocate_segments(call)
    intra = {"rows": launch_intra_rows, "onepass": launch_intra_onepass}.get(call.config["INTRA"], launch_intra_blocks)
    stages: list[tuple[str, Callable[[], Any]]] = [("intra", partial(intra, call, inter))]
    if scratch is not None:
        stages.append(("transitions", partial(launch_transitions, call, inter, scratch)))
        stages.append(("segment-starts", partial(launch_segment_starts, call, out, scratch)))
    stages.append(("state+output" if call.fuse else "state", partial(launch_state, call, inter, out, scratch)))
    if not call.fuse:
        stages.append(("output", partial(launch_output, call, inter, out)))
    return stages, inter, out, scratch


def signature(call: ChunkCall) -> Hashable:
    """Everything the forward's launchers read of ``call`` other than its tensors' data pointers (the launch cache's
    key, :mod:`dtune.kernels.launches`): the shape, the gate, the scale, the precision, the full config, the in-kernel
    options, the chunk tables (by identity: the plan holds them) and each input's dtype, shape and 16-byte
    alignment (Triton specialises on it; the TMA paths need it); the device Triton compiles for."""
    ik = call.in_kernel
    inputs = (call.q, call.k, call.v, call.g, call.beta, call.h0, ik.A_log, ik.dt_bias)
    return (
        "chunk-forward", launch_cache.device_key(call.q), call.B, call.T, call.H, call.HV, call.K, call.V, call.N,
        call.gate, call.scale, call.dt, call.dot_prec, call.output_final_state, tuple(call.config.items()),
        ik.flags(), id(call.tables), launch_cache.layout(inputs),
    )  # fmt: skip


def build_stages(call: ChunkCall) -> tuple[list[Stage], Intermediates, Outputs]:
    """Allocate every buffer of ``call`` and return its stages (to run in order), with their work model (for the
    profiler), and the buffers they fill."""
    launches, inter, out, _ = _launchers(call)
    costs = stage_costs(call)
    return [Stage(name, run, *costs[name]) for name, run in launches], inter, out


def plan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    config: Config,
    seq_offsets: Sequence[int] | None = None,
) -> tuple[list[Stage], tuple[Tensor, Tensor | None]]:
    """Allocate every buffer and return the stages (run in order) and the outputs ``(o, final_state)`` they fill."""
    call = prepare_call(
        q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, config, seq_offsets
    )
    stages, _, out = build_stages(call)
    return stages, (out.o, out.final_state)


def forward_with_intermediates(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    config: Config,
    seq_offsets: Sequence[int] | None = None,
    in_kernel: InKernel = NO_IN_KERNEL,
) -> ForwardResult:
    """Run the forward and keep its intermediates (for a backward pass that recomputes from them).

    Same arguments as :func:`forward` (validated inputs, a full checked config: ``KERNELS[name].check_config``).
    The intermediates are documented on :class:`~.buffers.Intermediates`; with ``FUSE_OUTPUT = False`` they
    include the chunk-start states ``h`` and ``V_new``, so pass a config with ``FUSE_OUTPUT = False`` when the
    backward needs them (the fused pass never writes them).
    """
    call = prepare_call(
        q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, config, seq_offsets, in_kernel
    )
    launches, inter, out, scratch = _launchers(call)  # (no work model: that is the profiler's, not a call's cost)

    def launch_all() -> None:
        for _, run in launches:
            run()

    if launch_cache.active(call.q):  # a call of a signature seen before replays its launches
        launch_cache.run(signature(call), tensors_of(call, inter, out, scratch), launch_all, keep=call.tables)
    else:
        launch_all()
    return ForwardResult(out.o, out.final_state, inter, call)


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    gate: str,
    scale: float,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
    config: Config,
    seq_offsets: Sequence[int] | None = None,
    in_kernel: InKernel = NO_IN_KERNEL,
) -> tuple[Tensor, Tensor | None]:
    """Launch the pipeline on validated inputs with a checked, complete config; same contract as fused_recurrent.

    ``seq_offsets``: ``cu_seqlens`` already copied to the host (``dtune.inputs.Problem.seq_offsets``), so that the
    call reads it from the device no second time. ``in_kernel``: fla's options applied by the stages as they load
    their inputs (``g`` raw with the gate activation), see :func:`.call.prepare_call`.
    """
    res = forward_with_intermediates(
        q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, config, seq_offsets, in_kernel
    )
    return res.o, res.final_state
