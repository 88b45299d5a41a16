"""Autograd for the chunk ops: one ``torch.autograd.Function`` for the three gates (DeltaNet, Gated DeltaNet, KDA).

:func:`chunk_with_grad` is what :func:`dtune.ops.run_kernel` calls when grad mode is on and an input requires
grad; otherwise the ops run the plain forward (no autograd overhead). The forward under autograd saves what the
backward config's ``SAVE`` asks for (:mod:`dtune.kernels.chunk.backward`); the backward returns the gradients of
q, k, v, g, beta in their own dtypes and of the initial state in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from dtune.kernels.chunk import backward as chunk_bwd

Tensor = torch.Tensor

_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")


class ChunkFunction(torch.autograd.Function):
    """``(o, final_state) = chunk(q, k, v, g, beta, initial_state)`` with the chunk backward."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor | None,
        beta: Tensor,
        initial_state: Tensor | None,
        gate: str,
        scale: float,
        output_final_state: bool,
        cu_seqlens: Tensor | None,
        fwd_config: dict[str, Any],
        bwd_config: dict[str, Any],
    ) -> tuple[Tensor, Tensor | None]:
        o, ht, inter = chunk_bwd.forward_for_training(
            q, k, v, g, beta, gate, scale, initial_state, output_final_state, cu_seqlens, fwd_config, bwd_config
        )
        saved = inter.tensors()
        ctx.saved_names = list(saved)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *saved.values())
        ctx.args = (gate, scale, fwd_config, bwd_config)
        return o, ht

    @staticmethod
    @once_differentiable  # no double backward: asking for one raises instead of returning wrong second derivatives
    def backward(ctx: Any, do: Tensor, dht: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, g, beta, h0, cu_seqlens, *rest = ctx.saved_tensors
        inter = chunk_bwd.Intermediates(**dict(zip(ctx.saved_names, rest)))
        gate, scale, fwd_config, bwd_config = ctx.args
        if do is None:
            do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        grads = chunk_bwd.backward(
            do, dht, q, k, v, g, beta, gate, scale, h0, cu_seqlens, fwd_config, bwd_config, inter
        )
        needed = ctx.needs_input_grad
        out = tuple(grads[name] if needed[i] else None for i, name in enumerate(_INPUTS))
        return (*out, None, None, None, None, None, None)


def needs_grad(*tensors: Tensor | None) -> bool:
    """True when autograd must record the op: grad mode on and an input requires grad (runs on every call: a plain
    loop, no generator)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # noqa: SIM110 (any() over a generator costs twice as much, on every call)
        if t is not None and t.requires_grad:
            return True
    return False


def chunk_with_grad(
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
    fwd_config: dict[str, Any],
    bwd_config: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """The chunk op, differentiable: ``bwd_config`` is a full, checked backward config."""
    o, ht = ChunkFunction.apply(
        q, k, v, g, beta, initial_state, gate, scale, output_final_state, cu_seqlens, fwd_config, bwd_config
    )
    return o, ht
