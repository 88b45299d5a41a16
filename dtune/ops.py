"""Public ops, with flash-linear-attention's argument order and ``[B, T, H, D]`` layout.

Every op validates its inputs before any launch, picks its launch configuration (the ``config`` argument,
else the tuned config for this GPU and shape from :mod:`dtune.store`, else the template's default) and
returns ``(o, final_state)``: ``o`` has v's dtype and shape ``[B, T, HV, V]``; ``final_state`` is
``[N, HV, K, V]`` float32, or ``None`` unless ``output_final_state``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dtune.autograd import chunk_with_grad, needs_grad
from dtune.inputs import check_inputs
from dtune.kernels import get_kernel
from dtune.shape import Gate
from dtune.store import tuned_config

Tensor = torch.Tensor
Result = tuple[Tensor, Tensor | None]

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "run_kernel",
]


def run_kernel(
    kernel: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    config: dict[str, Any] | None = None,
    bwd_config: dict[str, Any] | None = None,
) -> Result:
    """Run the kernel named ``kernel`` (e.g. ``"chunk_kda"``): the one entry point behind every op.

    With grad mode on and an input that requires grad, the chunk kernels run through their autograd Function
    (:mod:`dtune.autograd`; ``bwd_config`` overrides the backward's tuned/default config) and the fused-recurrent
    ones raise (they have no backward)."""
    spec = get_kernel(kernel)
    if spec.backward:
        raise ValueError(
            f"{kernel} is the backward of {spec.forward_kernel}: call {spec.forward_kernel} with inputs that require "
            f"grad (its bwd_config= sets {kernel}'s parameters)"
        )
    problem = check_inputs(q, k, v, g, beta, Gate(spec.gate), scale, initial_state, cu_seqlens)
    grad = needs_grad(q, k, v, g, beta, initial_state)
    bwd_name = spec.backward_kernel
    if bwd_name is None and (grad or bwd_config is not None):
        raise NotImplementedError(
            f"{kernel} has no backward (it serves inference: decoding and short prompts), but "
            + ("an input requires grad" if grad else "a bwd_config was given")
            + f"; for training use {kernel.replace('fused_recurrent_', 'chunk_')} (same arguments), or call it "
            "under torch.no_grad() / with detached inputs"
        )
    if config is None:
        config = tuned_config(spec.name, problem, v.dtype, v.device)
    full = spec.check_config(problem.K, problem.V, config)
    scale = problem.K**-0.5 if scale is None else float(scale)
    if bwd_name is not None and (grad or bwd_config is not None):
        bwd_spec = get_kernel(bwd_name)
        if grad and bwd_config is None:
            bwd_config = tuned_config(bwd_name, problem, v.dtype, v.device)
        bwd = bwd_spec.check_config(problem.K, problem.V, bwd_config)  # checked even when not needed: fail early
        if grad:
            args = (q, k, v, g, beta, spec.gate, scale, initial_state, output_final_state, cu_seqlens)
            return chunk_with_grad(*args, full, bwd)
    args = (q, k, v, g, beta, spec.gate, scale, initial_state, output_final_state, cu_seqlens)
    if spec.family == "chunk":  # its chunk tables come from the offsets check_inputs already read (no second copy)
        return spec.module.forward(*args, full, seq_offsets=problem.seq_offsets)
    return spec.module.forward(*args, full)


class UngatedOp(Protocol):
    """An op without a gate: ``op(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, config=None, bwd_config=None) -> (o, final_state)``; ``bwd_config`` sets the chunk
    backward's parameters (the fused-recurrent ops have no backward)."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        beta: Tensor,
        scale: float | None = None,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: Tensor | None = None,
        config: dict[str, Any] | None = None,
        bwd_config: dict[str, Any] | None = None,
    ) -> Result: ...


class GatedOp(Protocol):
    """An op with a log-space gate ``g``: ``op(q, k, v, g, beta, ...)``, the rest as :class:`UngatedOp`."""

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float | None = None,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: Tensor | None = None,
        config: dict[str, Any] | None = None,
        bwd_config: dict[str, Any] | None = None,
    ) -> Result: ...


def _ungated(kernel: str, doc: str) -> UngatedOp:
    def op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        beta: Tensor,
        scale: float | None = None,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: Tensor | None = None,
        config: dict[str, Any] | None = None,
        bwd_config: dict[str, Any] | None = None,
    ) -> Result:
        args = (q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)
        return run_kernel(kernel, *args, config, bwd_config)

    op.__name__ = op.__qualname__ = kernel
    op.__doc__ = doc
    return op


def _gated(kernel: str, doc: str) -> GatedOp:
    def op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float | None = None,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: Tensor | None = None,
        config: dict[str, Any] | None = None,
        bwd_config: dict[str, Any] | None = None,
    ) -> Result:
        args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        return run_kernel(kernel, *args, config, bwd_config)

    op.__name__ = op.__qualname__ = kernel
    op.__doc__ = doc
    return op


fused_recurrent_delta_rule = _ungated(
    "fused_recurrent_delta_rule", "DeltaNet, token by token (decoding, short prompts)."
)
fused_recurrent_gated_delta_rule = _gated(
    "fused_recurrent_gated_delta_rule", "Gated DeltaNet (scalar log gate ``g`` [B, T, HV]), token by token."
)
fused_recurrent_kda = _gated(
    "fused_recurrent_kda", "Kimi Delta Attention (per-channel log gate ``g`` [B, T, HV, K]), token by token."
)
chunk_delta_rule = _ungated("chunk_delta_rule", "DeltaNet, chunkwise (prefill, training; differentiable).")
chunk_gated_delta_rule = _gated("chunk_gated_delta_rule", "Gated DeltaNet, chunkwise (differentiable).")
chunk_kda = _gated("chunk_kda", "Kimi Delta Attention, chunkwise (differentiable).")
